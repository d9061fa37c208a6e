"""Render the screenshots of answer versions, code highlighting and the chat settings (issue 32), headless:
``.venv/bin/python scripts/screenshots_versions.py``. The application's own window (``CloverDeskApp``) over a
temporary app-data folder, its chats written straight into the store (the engine is the replay client of
``scripts/screenshots.py``; nothing is generated). Writes ``docs/screenshots/answer-versions.png``,
``code-highlight-{light,dark}.png`` and ``chat-settings-drawer.png``."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from PySide6.QtWidgets import QApplication  # noqa: E402
from screenshots import GIB, ROOT, ReplayClient, settle, shot  # noqa: E402  (sets the headless environment)

from clover_desk.engine.placement.hardware import Hardware  # noqa: E402

log = logging.getLogger("screenshots")

QUESTION = "Write a function that returns the n-th Fibonacci number, iteratively."
EDITED = "Write a function that returns the n-th Fibonacci number, with memoization."
FIRST = "Here is a recursive one:\n\n```python\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```"
SECOND = """An iterative version runs in O(n) time and O(1) memory:

```python
def fib(n: int) -> int:
    \"\"\"The n-th Fibonacci number (fib(0) == 0).\"\"\"
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a, b = 0, 1
    for _ in range(n):  # each step moves the pair one along
        a, b = b, a + b
    return a


print([fib(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
```

The same in JavaScript:

```js
const fib = (n) => { let [a, b] = [0, 1]; while (n-- > 0) [a, b] = [b, a + b]; return a; };
```"""
THIRD = "Iteratively, keeping only the last two numbers:\n\n```python\ndef fib(n):\n    a, b = 0, 1\n" \
        "    for _ in range(n):\n        a, b = b, a + b\n    return a\n```"
MEMO = "```python\nfrom functools import lru_cache\n\n@lru_cache(maxsize=None)\ndef fib(n):\n" \
       "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n```"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = ROOT / "docs" / "screenshots"
    app = QApplication.instance() or QApplication(sys.argv[:1])
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.ui.theme import apply_theme

    apply_theme(app, "dark")
    home = Path(tempfile.mkdtemp(prefix="clover-shots-"))
    hardware = Hardware(gpu_name="NVIDIA GeForce RTX 4070 Ti SUPER", vram_total_bytes=16 * GIB,
                        vram_free_bytes=15 * GIB, ram_total_bytes=64 * GIB, ram_available_bytes=52 * GIB)
    desk = CloverDeskApp(home, client=ReplayClient(), settings=AppSettings(model_dir="/models/Clover-35B-A3B-Preview"),
                         hardware=hardware, with_model_manager=False)
    window, store = desk.window, desk.store
    chat = store.create_conversation(title="Fibonacci, three ways")
    user = store.add_message(chat.id, "user", QUESTION)
    stats = {"mode": "diffusion", "stop_reason": "eos", "tokens_per_s": 41.2, "tokens_per_pass": 3.4}
    first = store.add_message(chat.id, "assistant", FIRST, stats={**stats, "tokens": 34})
    second = store.add_message(chat.id, "assistant", SECOND, stats={**stats, "tokens": 181}, version_of=first.id)
    store.add_message(chat.id, "assistant", THIRD, stats={**stats, "tokens": 52}, version_of=first.id)
    store.add_message(chat.id, "user", EDITED, version_of=user.id)
    store.add_message(chat.id, "assistant", MEMO, stats={**stats, "tokens": 45})
    store.select_version(user.id)
    store.select_version(second.id)
    window.conversations.reload()
    window.open_conversation(chat.id)
    window.state.set_theme_preference("dark")
    window.resize(1280, 860)
    window.show()
    settle(500)
    window.chat.scroll.verticalScrollBar().setValue(0)
    settle(200)
    shot(window, out / "answer-versions.png")
    for theme in ("light", "dark"):
        window.state.set_theme_preference(theme)
        settle(400)
        shot(window.chat.widgets[1], out / f"code-highlight-{theme}.png")
    window.state.set_theme_preference("dark")
    window.drawer.temperature.setValue(0.7)
    window.drawer.top_p.setValue(0.95)
    window.drawer.top_k.setValue(20)
    window.drawer.preset_name.setText("Precise coder")
    window.drawer.preset_save.click()
    window.settings_button.setChecked(True)
    settle(300)
    window.resize(1280, 1080)
    settle(300)
    window.drawer_scroll.verticalScrollBar().setValue(window.drawer_scroll.verticalScrollBar().maximum())
    settle(200)
    shot(window, out / "chat-settings-drawer.png")
    window.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
