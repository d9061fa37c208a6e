"""The strip under the preview: bounded lists of blocked attempts, dialogs, console messages and notices.

The strip under the view keeps separate, bounded lists: blocked attempts (host side only), page dialogs, console
messages and the pane's own notices; each keeps its last entries and counts the rest, long lines are cut, and the
list is repainted through one throttle. Bounded lists alone do not bound the app: the engine queues a page's
console messages for the window without limit when the page outruns it. So the guard drops ``console.*`` lines
past :data:`CONSOLE_LINES_PER_S` in the page itself (and says how many), and a page that still floods the strip
(engine errors, CSP refusals, dialogs) is stopped, with a notice.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

STRIP_REPAINT_MS = 200  # the strip is redrawn at most this often, however fast entries arrive
MAX_LINE_CHARS = 500  # longer strip lines are cut (a page can log megabytes in one message)
# Each list keeps its last entries and counts the rest ("N more"): a page logging or alerting in a loop cannot
# push the blocked attempts out, nor grow the app's memory.
MAX_BLOCKED_ENTRIES = 200
MAX_CONSOLE_ENTRIES = 200
MAX_DIALOG_ENTRIES = 50
MAX_NOTICE_ENTRIES = 50
MAX_STRIP_ENTRIES = MAX_BLOCKED_ENTRIES + MAX_CONSOLE_ENTRIES + MAX_DIALOG_ENTRIES + MAX_NOTICE_ENTRIES


# ---------------------------------------------------------------------------------------------------------------
# The strip's model: bounded lists by source
# ---------------------------------------------------------------------------------------------------------------

_entry_sequence = itertools.count()


@dataclass(frozen=True)
class StripEntry:
    """One line in the strip under the view."""

    kind: str  # "blocked" | "dialog" | "error" | "warning" | "info"
    text: str
    source: str = "pane"  # "blocked" | "dialogs" | "console" | "pane": which bounded list holds it
    seq: int = 0  # arrival order across the lists


class BoundedLog:
    """The last ``limit`` entries of one source, and how many there were in all."""

    def __init__(self, limit: int) -> None:
        self.entries: deque[StripEntry] = deque(maxlen=limit)
        self.total = 0

    @property
    def dropped(self) -> int:
        return self.total - len(self.entries)

    def add(self, entry: StripEntry) -> None:
        self.entries.append(entry)
        self.total += 1

    def clear(self) -> None:
        self.entries.clear()
        self.total = 0


def clip_line(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """One strip line: at most ``limit`` characters (cut before any other work on a possibly huge string)."""
    if len(text) > limit:
        extra = len(text) - limit
        text = f"{text[:limit]}… ({extra} more characters)"
    return text.strip()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_KIND_MARK = {"blocked": "[blocked]", "dialog": "[dialog]", "error": "[error]", "warning": "[warning]", "info": "[info]"}
