"""The real engine with short prefill segments and a slower pass, for window tests of a long prompt's prefill.

Selected by the worker's ``--engine-factory tests.small_pass_engine:load``. ``Engine.load`` as is, then the model
reads at most :data:`PASS_TOKENS` prompt tokens per forward (as a small VRAM plan's ``prefill_chunk_tokens`` would
make it) and every forward takes at least :data:`PASS_S` longer, so a few hundred prompt tokens take long enough
for a test to watch the progress and press Stop while it runs.
"""

from __future__ import annotations

import time
from typing import Any

from clover_desk.engine.api import Engine

PASS_TOKENS = 32
PASS_S = 0.02


def load(model_dir: str, **kwargs: Any) -> Engine:
    engine = Engine.load(model_dir, **kwargs)
    model = engine.model
    model.max_pass_tokens = PASS_TOKENS
    forward = model.forward

    def slow_forward(*args: Any, **kw: Any) -> Any:
        time.sleep(PASS_S)
        return forward(*args, **kw)

    model.forward = slow_forward
    return engine
