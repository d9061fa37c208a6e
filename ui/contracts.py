"""What the window is handed, as typed protocols (no Qt widgets, no clover_desk imports).

The composition root (``clover_desk.app``) builds the real objects (``EngineClient``, ``ChatStore``,
``StreamRecorder``, ``engine.placement.hardware.MemoryMonitor``) and passes them in; tests pass fakes that speak the same
contracts. The window's view of the engine's life is :class:`EngineState`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from clover_desk.engine.decode.events import GenerationParams


class EngineState(Enum):
    """Where the engine is, as the window shows it. Only :attr:`READY` accepts a message."""

    STARTING = "starting"  # the worker process is starting (or restarting) and will load the model
    LOADING = "loading"  # the model is being read, quantized or placed
    READY = "ready"  # a model is loaded: Send works
    CRASHED = "crashed"  # the worker died; the crash banner offers a restart
    NO_MODEL = "no-model"  # nothing chosen yet: the model manager is open
    ERROR = "error"  # the model failed to load (the info banner says why)

    @property
    def status_text(self) -> str:
        return _STATE_TEXTS[self][0]

    @property
    def why_not_ready(self) -> str:
        """Why Send is disabled in this state ("" when it is not)."""
        return _STATE_TEXTS[self][1]


# Each state's status-bar line and why Send is disabled in it ("" when it is not): one entry a state.
_STATE_TEXTS: dict[EngineState, tuple[str, str]] = {
    EngineState.STARTING: ("● Starting engine…", "The engine is starting; Send works once the model has loaded."),
    EngineState.LOADING: ("● Loading model…", "The model is loading; Send works once it is ready."),
    EngineState.READY: ("● Ready", ""),
    EngineState.CRASHED: ("● Engine stopped", "The engine stopped. Restart it to send (your text stays here)."),
    EngineState.NO_MODEL: ("● No model: choose one in Models", "Choose a model first (Model ▸ Models…)."),
    EngineState.ERROR: ("● Model failed to load",
                        "The model failed to load. Choose another model or a smaller VRAM budget."),
}


class SignalLike(Protocol):
    """A bound Qt signal (``SignalInstance``): what the window connects to."""

    def connect(self, slot: Callable[..., Any]) -> Any: ...
    def emit(self, *args: Any) -> None: ...


class EngineClientLike(Protocol):
    """``clover_desk.worker.client.EngineClient`` as the window uses it."""

    ready: SignalLike  # the worker accepts commands (it will load the model)
    loadProgress: SignalLike  # engine.decode.events.LoadProgress
    loaded: SignalLike  # dict: model_dir, device, config, generation_defaults, plan, ...
    event: SignalLike  # (request id, engine event)
    errorMessage: SignalLike  # (kind, message) not tied to a request
    crashed: SignalLike  # reason

    @property
    def state(self) -> str: ...
    @property
    def model_info(self) -> dict[str, Any] | None: ...  # the last ``loaded`` record (None: no model loaded)

    def generate(self, messages: Sequence[dict[str, str]], params: GenerationParams, tools: Any = None) -> str: ...
    def cancel(self, request_id: str | None = None) -> None: ...
    def cancel_load(self) -> None: ...
    def restart(self) -> None: ...


class ConversationLike(Protocol):
    id: int
    title: str
    system_prompt: str
    settings: dict[str, Any]


class MessageLike(Protocol):
    id: int
    role: str
    content: str
    thinking: str
    thinking_seconds: float | None
    status: str
    stats: dict[str, Any]


class SearchHitLike(Protocol):
    conversation: ConversationLike
    snippet: str


class ChatStoreLike(Protocol):
    """``clover_desk.storage.store.ChatStore`` as the window uses it. ``Error`` is the exception class every failed save
    raises (``StorageError``): the window catches it, shows it and keeps the user's text."""

    Error: type[Exception]

    def list_conversations(self, limit: int | None = None) -> Sequence[ConversationLike]: ...
    def search(self, query: str) -> Sequence[SearchHitLike]: ...
    def get_conversation(self, conversation_id: int) -> ConversationLike: ...
    def create_conversation(self, title: str = ..., system_prompt: str = "",
                            settings: dict[str, Any] | None = None) -> ConversationLike: ...
    def update_conversation(self, conversation_id: int, *, title: str | None = None, system_prompt: str | None = None,
                            settings: dict[str, Any] | None = None) -> ConversationLike: ...
    def rename_conversation(self, conversation_id: int, title: str) -> Any: ...
    def delete_conversation(self, conversation_id: int) -> None: ...
    def messages(self, conversation_id: int) -> Sequence[MessageLike]: ...
    def chat_messages(self, conversation_id: int) -> list[dict[str, str]]: ...
    def add_message(self, conversation_id: int, role: str, content: str, **kwargs: Any) -> MessageLike: ...
    def versions(self, message_id: int) -> list[int]: ...
    def version_counts(self, conversation_id: int) -> dict[int, tuple[int, int]]: ...
    def select_version(self, message_id: int) -> None: ...
    def edit_message(self, message_id: int, content: str) -> Any: ...
    def truncate_after(self, message_id: int, include: bool = False) -> Any: ...
    def reopen_message(self, message_id: int) -> MessageLike: ...
    def branch_conversation(self, message_id: int) -> ConversationLike: ...
    def export_markdown(self, conversation_id: int, path: str) -> Path: ...
    def export_json(self, conversation_id: int, path: str) -> Path: ...


class Recorder(Protocol):
    """Saves one streaming answer from its events (``clover_desk.storage.recorder.StreamRecorder``)."""

    done: bool

    def on_event(self, event: object) -> bool: ...
    def flush(self) -> None: ...


RecorderFactory = Callable[[Any, int], Recorder]  # (store, assistant message id) -> recorder


class TokenCounterLike(Protocol):
    """Tokens of a conversation as the engine will read it (``clover_desk.worker.token_counter.TokenCounter``: the model
    folder's tokenizer and chat template, in the GUI process, off the GUI thread)."""

    counted: SignalLike  # (key, tokens) answering count(); tokens -1: cannot count

    def count(self, key: int, messages: Sequence[dict[str, str]], enable_thinking: bool = True) -> None: ...
    def count_now(self, messages: Sequence[dict[str, str]], enable_thinking: bool = True) -> int | None: ...


class HtmlPreview(Protocol):
    """What the window needs from the preview tab (``ui.preview.PreviewPane``)."""

    def set_html(self, text: str, document_id: str | None = None) -> None: ...  # throttled
    def flush(self) -> None: ...  # show the latest text now


class MemoryMonitor(Protocol):
    """RAM / VRAM in use (``engine.placement.hardware.MemoryMonitor``): ``ram_used``, ``ram_total``, ``vram_used``,
    ``vram_total`` in bytes, None where unknown."""

    def sample(self) -> dict[str, int | None]: ...


class ServerControl(Protocol):
    """The engine worker's OpenAI-compatible HTTP server (``EngineClient.start_server`` / ``stop_server``)."""

    serving: SignalLike  # base URL (".../v1"): the server listens
    serveStopped: SignalLike  # it stopped; the port is free
    serveFailed: SignalLike  # message naming the address that could not be used

    @property
    def server_url(self) -> str | None: ...
    @property
    def server_policy(self) -> str:
        """Whom the server answers (Host / Origin policy), one line; "" while it does not serve."""
        ...
    def start_server(self, host: str, port: int, api_key: str | None = None) -> None: ...
    def stop_server(self) -> None: ...


class RemoteFinishedLike(Protocol):
    """The last event of a remote answer (``clover_desk.worker.remote.RemoteFinished``): what the server did not report is
    None, and :meth:`stats` keeps it None (the window shows it as unavailable, never estimated)."""

    text: str
    thinking: str
    finish_reason: str | None
    client_elapsed_s: float
    denoising_available: bool

    def stats(self) -> dict[str, Any]: ...


class RemoteChat(Protocol):
    """One OpenAI-compatible server (``clover_desk.worker.remote.RemoteBackend``). Errors are ``engine.errors.CloverError``
    subclasses whose message says what went wrong (cannot reach, HTTP 401 ..., not an answer)."""

    def models(self) -> list[str]: ...
    def chat(self, messages: Sequence[dict[str, Any]], params: GenerationParams | None = None,
             tools: Sequence[dict[str, Any]] | None = None, cancel: Any = None) -> Iterator[object]: ...
    # chat yields engine.decode.events.TextDelta ..., then one RemoteFinishedLike


RemoteFactory = Callable[..., RemoteChat]  # (url, api_key, model) -> a remote; CloverError for a bad URL


class ChatWindowParts(Protocol):
    """The chat window's parts (``ui.main_window.MainWindow``) that its helpers (the answer display, the
    conversations) share; each helper's own Protocol adds what else it uses."""

    chat: Any  # ui.chat_view.ChatView
    composer: Any  # ui.composer.Composer
    long_chats: Any  # ui.long_chats.LongChats
    chat_actions: Any  # ui.chat_actions.ChatActions: .request_source(), .read_ahead_timer
    engine_status: Any  # ui.engine_status.EngineStatus: .refresh(), .throttle

    def show_save_error(self, error: BaseException, what: str) -> None: ...
