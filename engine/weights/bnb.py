"""bitsandbytes, imported on first use, with its one import-time warning that does not concern this engine dropped."""

from __future__ import annotations

import logging
from typing import Any

from clover_desk.engine.errors import ConfigError


class _NotOurKernel(logging.Filter):
    """Drops bitsandbytes' import-time warning that its optional CPU ``gemm_4bit`` kernel (from the ``kernels``
    package) is missing: this engine never calls ``gemm_4bit`` (NF4 is dequantized, or read by its own kernels), so
    the line only told every CPU run of ``generate --vram-gb`` or ``bench`` to install something it does not use."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


# installed once, here: bnb_functional runs inside compiled forwards, where a logging call breaks the graph
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NotOurKernel())


def bnb_functional() -> Any:
    """bitsandbytes.functional, imported on first use."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as exc:  # pragma: no cover - bitsandbytes is a hard dependency
        raise ConfigError(f"NF4 needs bitsandbytes, which failed to import: {exc}") from None
    return bnbf
