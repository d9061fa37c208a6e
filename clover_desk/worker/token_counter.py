"""Counting a conversation's tokens in the GUI process, as the engine will read it, without the engine worker.

The count is the model folder's own tokenizer and chat template (:class:`engine.decode.tokenizer.CloverTokenizer`, which
imports no torch): the same ids the engine prefills, available as soon as a model is chosen, and never waiting for a
worker busy generating. :meth:`TokenCounter.count` runs on a thread of its own (the latest request wins; the answer
comes back as the queued ``counted`` signal) so typing never waits for it; :meth:`TokenCounter.count_now` counts
at once, for the decision at Send.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from clover_desk.engine.decode.tokenizer import CloverTokenizer
from clover_desk.engine.errors import CloverError
from clover_desk.engine.weights.gguf.file import load_tokenizer, open_gguf

log = logging.getLogger(__name__)

NOW_WAIT_S = 2.0  # count_now waits at most this long for a count in flight on the thread


class TokenCounter(QObject):
    """Tokens of ``messages`` under the chosen model's tokenizer and chat template (see the module docstring)."""

    counted = Signal(int, int)  # (key given to count(), tokens); tokens -1: cannot count (no tokenizer, bad template)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._model_dir: str | None = None
        self._tokenizer: Any = None
        self._loaded_for: str | None = None  # the folder _tokenizer was read from ("" when it could not be)
        self._use = threading.Lock()  # one user of the tokenizer at a time (the thread, or count_now)
        self._wake = threading.Condition()
        self._job: tuple[int, list[dict[str, str]], bool] | None = None  # the latest request not yet counted
        self._stopping = False
        self._thread: threading.Thread | None = None

    def set_model(self, model_dir: str | None) -> None:
        """Count for this model folder from now on (its tokenizer is read on the thread, ahead of the first count)."""
        with self._wake:
            self._model_dir = model_dir or None
            self._ensure_thread()
            self._wake.notify()

    def count(self, key: int, messages: Sequence[dict[str, str]], enable_thinking: bool = True) -> None:
        """Count on the thread; ``counted(key, tokens)`` answers. A request not started yet is replaced."""
        with self._wake:
            self._job = (key, [dict(m) for m in messages], enable_thinking)
            self._ensure_thread()
            self._wake.notify()

    def count_now(self, messages: Sequence[dict[str, str]], enable_thinking: bool = True) -> int | None:
        """The count, at once (None: no tokenizer, a template error, or the thread held it too long)."""
        if not self._use.acquire(timeout=NOW_WAIT_S):
            return None
        try:
            return self._count(list(messages), enable_thinking)
        finally:
            self._use.release()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ----------------------------------------------------------------- the thread

    def _ensure_thread(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="token-counter", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and self._job is None and self._loaded_for == (self._model_dir or ""):
                    self._wake.wait()
                if self._stopping:
                    return
                job, self._job = self._job, None
            with self._use:
                if job is None:
                    self._tokenizer_for_model()  # read ahead: the first count should not wait for it
                    continue
                key, messages, thinking = job
                tokens = self._count(messages, thinking)
            self.counted.emit(key, -1 if tokens is None else tokens)

    # ----------------------------------------------------------------- counting (holding _use)

    def _count(self, messages: list[dict[str, str]], enable_thinking: bool) -> int | None:
        tokenizer = self._tokenizer_for_model()
        if tokenizer is None or not messages:
            return None

        try:
            return len(tokenizer.encode_chat(messages, enable_thinking=enable_thinking))
        except CloverError as exc:
            log.info("cannot count the conversation's tokens: %s", exc)
            return None

    def _tokenizer_for_model(self) -> Any:
        folder = self._model_dir or ""
        if self._loaded_for != folder:
            self._tokenizer, self._loaded_for = _read_tokenizer(folder), folder
        return self._tokenizer


def _read_tokenizer(folder: str) -> Any:
    """The model's CloverTokenizer (a model folder's, or the one a GGUF file embeds), or None (no model, an
    unreadable tokenizer)."""
    if not folder:
        return None

    try:
        if folder.lower().endswith(".gguf") and Path(folder).is_file():
            return load_tokenizer(open_gguf(folder))
        return CloverTokenizer.from_dir(folder) if Path(folder).is_dir() else None
    except (CloverError, OSError) as exc:
        log.info("no tokenizer to count with in %s: %s", folder, exc)
        return None
