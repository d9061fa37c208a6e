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
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QListWidget, QListWidgetItem, QWidget

from clover_desk.ui.preview_sandbox import FLOOD_MESSAGES_PER_S, FLOOD_WINDOW_S, FLOOD_WINDOWS
from clover_desk.ui.throttle import Throttle
from clover_desk.ui.widgets import hbox, tool_button, vbox

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


class PreviewStrip(QWidget):
    """The strip under the preview: its counts and Clear over the list of entries, one bounded list per source
    (``logs``), totals per kind (``counts``), redrawn at most every :data:`STRIP_REPAINT_MS`.

    :meth:`add` takes every entry, from the page (``report``) and the pane alike; a page that floods it (see the
    module docstring) is not listed further: ``on_flood(notice)`` is called instead, once per flood, to stop it."""

    # A line was added (kind, text): "blocked" | "dialog" | "error" | "warning".
    entryAdded = Signal(str, str)

    def __init__(self, parent: QWidget | None = None, *, on_flood: Callable[[str], None]) -> None:
        super().__init__(parent)
        self._on_flood = on_flood
        # Flood detection: entries from the page since the window started, and how many windows in a row were full.
        self._activity_start = time.monotonic()
        self._activity_count = 0
        self._flood_windows = 0
        # Bounded lists, one per source (see the module docstring), and the totals per kind.
        self.logs: dict[str, BoundedLog] = {
            "blocked": BoundedLog(MAX_BLOCKED_ENTRIES),
            "dialogs": BoundedLog(MAX_DIALOG_ENTRIES),
            "console": BoundedLog(MAX_CONSOLE_ENTRIES),
            "pane": BoundedLog(MAX_NOTICE_ENTRIES),
        }
        self.counts: Counter[str] = Counter()
        self.list = QListWidget(self)
        self.list.setObjectName("previewStrip")
        self.list.setAccessibleName("What the page tried, and its console")
        self.list.setAlternatingRowColors(True)
        # long lines wrap inside the panel (no line is cut at its edge; the full text is also the tooltip)
        self.list.setWordWrap(True)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setResizeMode(QListWidget.ResizeMode.Adjust)
        self.label = QLabel(self)
        self.label.setProperty("class", "muted")
        self.clear_button = tool_button(self, "Clear", "Clear the list of blocked attempts, dialogs and console messages")
        self.clear_button.setProperty("class", "ghost")
        self._lay_out()
        # The one place the strip is redrawn: however fast entries arrive, at most every STRIP_REPAINT_MS.
        self.throttle = Throttle(self._repaint, STRIP_REPAINT_MS, self)
        self._update_label()
        self.clear_button.clicked.connect(self.on_clear_clicked)

    def _lay_out(self) -> None:
        header = hbox((self.label, 1), self.clear_button, margins=(2, 2, 0, 0))
        vbox(header, (self.list, 1), spacing=2, parent=self)

    @property
    def entries(self) -> list[StripEntry]:
        """Every entry the strip lists, oldest first (each source keeps its own last entries)."""
        merged = [e for log_ in self.logs.values() for e in log_.entries]
        merged.sort(key=lambda e: e.seq)
        return merged

    def add(self, source: str, kind: str, text: str) -> None:
        """One entry from ``source`` ("blocked" | "dialogs" | "console" | "pane")."""
        # Called for every console line of a page that may log in a loop: O(1), and the strip only marked dirty.
        if source != "pane" and self._flooded():
            return
        entry = StripEntry(kind, text, source, next(_entry_sequence))
        self.logs[source].add(entry)
        self.counts[kind] += 1
        self.throttle.request()
        self.entryAdded.emit(kind, text)

    def clear(self) -> None:
        for log_ in self.logs.values():
            log_.clear()
        self.counts.clear()
        self.throttle.cancel()
        self._repaint()

    def flush(self) -> None:
        """Redraw the strip now (it is otherwise redrawn at most every :data:`STRIP_REPAINT_MS`)."""
        self.throttle.cancel()
        self._repaint()

    def on_clear_clicked(self) -> None:
        self.clear()

    def _flooded(self) -> bool:
        """Count one entry from the page; True when it ends a flood (``on_flood`` has then been called)."""
        self._activity_count += 1
        if self._activity_count < FLOOD_MESSAGES_PER_S * FLOOD_WINDOW_S:
            return False  # cheap: the clock is read only once a window's worth of entries has arrived
        now = time.monotonic()
        elapsed = now - self._activity_start
        flooding = elapsed <= FLOOD_WINDOW_S
        self._activity_start, self._activity_count = now, 0
        self._flood_windows = self._flood_windows + 1 if flooding else 0
        if self._flood_windows < FLOOD_WINDOWS:
            return False
        self._flood_windows = 0
        self._on_flood(f"the page flooded the strip (over {FLOOD_MESSAGES_PER_S:,} messages a second): it was "
                       "stopped; press Reload to run it again")
        return True

    def _repaint(self) -> None:
        entries = self.entries
        self.list.setUpdatesEnabled(False)
        try:
            self.list.clear()
            for entry in entries:
                item = QListWidgetItem(f"{_KIND_MARK.get(entry.kind, '[info]')} {entry.text}")
                item.setData(Qt.ItemDataRole.UserRole, entry.kind)
                item.setToolTip(entry.text)
                self.list.addItem(item)
        finally:
            self.list.setUpdatesEnabled(True)
        self.list.scrollToBottom()
        self._update_label()

    def _update_label(self) -> None:
        c = self.counts
        parts = [f"{c['blocked']} blocked", _plural(c["error"], "error"), _plural(c["warning"], "warning")]
        if c["dialog"]:
            parts.append(_plural(c["dialog"], "dialog"))
        hidden = sum(log_.dropped for log_ in self.logs.values())
        if hidden:
            parts.append(f"{hidden} more not listed")
        self.label.setText(" · ".join(parts))
