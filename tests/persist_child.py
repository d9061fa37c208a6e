"""Child process of test_persistence_kill.py: the app's save path with nothing faked.

Starts the engine worker through :class:`EngineClient`, loads a model, and streams an answer into a
:class:`ChatStore` through :class:`StreamRecorder` (one committed transaction per block), exactly as the window
does. After each saved block it prints one JSON line with what the database now holds, so the test knows what must
survive when it kills this process with SIGKILL. If a generation ends before the test kills it (a random tiny model
may hit EOS), it starts another with the next seed.

    python -m tests.persist_child DB MODEL_DIR      (from the repository root)
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from PySide6.QtCore import QCoreApplication

from clover_desk.engine.decode.events import BlockCommitted, GenerationParams
from clover_desk.storage.recorder import StreamRecorder
from clover_desk.storage.store import ChatStore
from clover_desk.worker.client import EngineClient

PROMPT = "Tell me a long story about a dragon."
MAX_ATTEMPTS = 5


def report(**record: Any) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    db, model_dir = argv[1], argv[2]
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    app = QCoreApplication(argv[:1])
    store = ChatStore(db)
    client = EngineClient()
    state: dict[str, Any] = {}

    def begin(seed: int) -> None:
        conversation = store.create_conversation(f"kill test, seed {seed}")
        store.add_message(conversation.id, "user", PROMPT)
        history = store.chat_messages(conversation.id)
        message = store.add_message(conversation.id, "assistant", status="streaming")
        params = GenerationParams(max_new_tokens=1024, block_size=4, do_sample=True, temperature=1.0, seed=seed)
        state.update(
            seed=seed,
            conversation=conversation.id,
            message=message.id,
            recorder=StreamRecorder(store, message.id),
            request=client.generate(history, params),
        )

    def on_ready() -> None:
        report(worker_pid=client.pid)
        client.load(model_dir)

    def on_event(request_id: str, event: object) -> None:
        if request_id != state.get("request"):
            return
        ended = state["recorder"].on_event(event)
        if isinstance(event, BlockCommitted):
            saved = store.get_message(state["message"])
            report(
                conversation=state["conversation"],
                message=saved.id,
                blocks=state["recorder"].blocks_saved,
                content=saved.content,
                thinking=saved.thinking,
            )
        if ended:
            report(ended=state["seed"])
            if state["seed"] >= MAX_ATTEMPTS:
                app.exit(1)
            else:
                begin(state["seed"] + 1)

    def on_crashed(reason: str) -> None:
        report(crashed=reason)
        app.exit(2)

    client.ready.connect(on_ready)
    client.loaded.connect(lambda info: begin(1))
    client.event.connect(on_event)
    client.crashed.connect(on_crashed)
    client.errorMessage.connect(lambda kind, message: report(error=f"{kind}: {message}"))
    client.start()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
