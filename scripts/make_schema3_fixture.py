"""Write tests/data/chats_schema3.sql: a chat database as Clover Desk wrote it before answer versions (schema 3).

It runs the ChatStore of commit 41d9ac3 (the last one with schema 3, read with ``git show``) through the calls the
window made then (send, regenerate = truncate + new answer, edit-and-resend, an answer cut by a crash) and dumps the
file as SQL. Run from the repository root: ``.venv/bin/python scripts/make_schema3_fixture.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

OLD_COMMIT = "41d9ac3"
OUT = Path("tests/data/chats_schema3.sql")


def old_storage_module():
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:clover_desk/storage.py"], check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp())
    (folder / "old_storage.py").write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("old_storage", folder / "old_storage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_storage"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    old = old_storage_module()
    path = Path(tempfile.mkdtemp()) / "chats.sqlite3"
    store = old.ChatStore(path)
    assert store.schema_version == 3
    a = store.create_conversation("Trip plan", system_prompt="Be brief.", settings={"temperature": 0.6})
    store.add_message(a.id, "user", "Plan two days in Lisbon")
    store.add_message(a.id, "assistant", "Day 1: Alfama.\n\n```python\nprint('tram 28')\n```", thinking="hmm",
                      thinking_seconds=1.5, stats={"tokens": 61, "stop_reason": "eos", "mode": "diffusion"})
    store.add_message(a.id, "user", "And a third day?")
    wrong = store.add_message(a.id, "assistant", "Day 3: Be", status="stopped", stats={"stop_reason": "cancelled"})
    store.truncate_after(wrong.id, include=True)  # Regenerate, as the window did it then
    store.add_message(a.id, "assistant", "Day 3: Belém and Sintra.", stats={"tokens": 6, "stop_reason": "eos"})
    b = store.create_conversation("Edited question")
    first = store.add_message(b.id, "user", "What is 2+2?")
    store.add_message(b.id, "assistant", "4")
    store.edit_message(first.id, "What is 3+3?")  # Edit and resend, as the window did it then
    store.add_message(b.id, "assistant", "6")
    c = store.create_conversation("Crashed answer")
    store.add_message(c.id, "user", "Write a long story")
    store.add_message(c.id, "assistant", "Once upon a ti", status="streaming")  # a crash left it streaming
    store.create_conversation("Empty chat")
    lines = list(store._conn.iterdump())
    store.close()
    header = f"-- A Clover Desk chat database at schema 3 (commit {OLD_COMMIT}), written by {Path(__file__).name}\n"
    OUT.write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(lines)} statements)")


if __name__ == "__main__":
    main()
