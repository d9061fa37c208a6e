"""Text files attached to a message (the composer's Attach button, files dropped or pasted on the message box).

An attachment becomes part of the message the user sees and can edit before sending: the file's name in bold, then
its text in a fenced code block tagged with its language (the chat shows it highlighted, and Clover reads the name
and the fence). Only UTF-8 text is attached, at most :data:`ATTACH_MAX_BYTES`: the file is read with a bound, so a
huge or binary file is refused in one line naming it, without reading it whole. (No Qt, no torch.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ATTACH_MAX_BYTES = 1 << 20  # 1 MiB: ~250,000 tokens of code, far past any context this app plans
# File endings and the fence tag the chat's highlighter and the model know them by; others get a bare fence.
LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".ts": "typescript",
    ".tsx": "tsx", ".jsx": "jsx", ".html": "html", ".htm": "html", ".css": "css", ".json": "json",
    ".md": "markdown", ".markdown": "markdown", ".sh": "bash", ".bash": "bash", ".c": "c", ".h": "c",
    ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".rs": "rust", ".go": "go", ".java": "java", ".kt": "kotlin",
    ".rb": "ruby", ".php": "php", ".sql": "sql", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".xml": "xml",
    ".svg": "svg", ".csv": "csv", ".tex": "latex", ".lua": "lua", ".swift": "swift", ".cs": "csharp",
}
_BACKTICKS = re.compile(r"`{3,}")


class AttachmentError(Exception):
    """A file that cannot be attached; the message is one line naming it and what is allowed."""


def _size_text(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def read_text_file(path: str | os.PathLike[str], max_bytes: int = ATTACH_MAX_BYTES) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark dropped, line ends as ``\\n``), reading at most
    ``max_bytes + 1`` bytes; :class:`AttachmentError` for a folder, an unreadable, too large or binary file."""
    p = Path(path)
    name = p.name or str(p)
    try:
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except IsADirectoryError:
        raise AttachmentError(f"{name}: a folder; attach files one by one") from None
    except OSError as exc:
        raise AttachmentError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        try:
            size = _size_text(p.stat().st_size)
        except OSError:
            size = "larger"
        raise AttachmentError(f"{name}: {size}, more than the {_size_text(max_bytes)} a message can attach; "
                              "paste the part you need")
    if b"\0" in data:
        raise AttachmentError(f"{name}: not a text file (it holds NUL bytes); attach UTF-8 text such as code, "
                              "Markdown, HTML or CSV")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AttachmentError(f"{name}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start:,}); "
                              "save it as UTF-8 and attach it again") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def attachment_markdown(name: str, text: str) -> str:
    """The file as the message shows it: its name in bold, then its text fenced with more backticks than any run
    inside it (so a Markdown file's own fences stay inside), tagged with its language."""
    longest = max((len(m) for m in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    language = LANGUAGES.get(Path(name).suffix.lower(), "")
    body = text if text.endswith("\n") or not text else text + "\n"
    return f"**{name}**\n\n{fence}{language}\n{body}{fence}\n"


def read_attachment(path: str | os.PathLike[str], max_bytes: int = ATTACH_MAX_BYTES) -> str:
    """:func:`attachment_markdown` of the file at ``path`` (:class:`AttachmentError` when it cannot be attached)."""
    return attachment_markdown(Path(path).name, read_text_file(path, max_bytes))
