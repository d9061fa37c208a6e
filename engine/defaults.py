"""Defaults every planning caller shares, defined once (stdlib only: the UI imports this module).

* :data:`DEFAULT_CTX_TOKENS`: the context a plan reserves KV cache and prefill scratch for when the user has not
  chosen one (the CLI, the VRAM panel, the worker and the benchmarks all use it).
* :data:`DEFAULT_CARD_BYTES`: the card a plan is made for when no NVIDIA GPU is found (the product's target, a
  16 GB RTX card); :data:`CARD_CHOICES_GIB` are the sizes a user without a GPU may plan for instead.
* :data:`DEFAULT_BLOCK_SIZE`, :data:`DEFAULT_THRESHOLD`: block diffusion's published settings (32 masked slots a
  block, every slot above 0.95 confidence committed per pass), what a config.json, a GGUF header, the decoding
  loop, the planner and the window's settings fall back to when nothing says otherwise.
* :data:`PROMPT_CACHE_RAM_MIB`: the system RAM the prompt cache may fill with other chats' states
  (``engine.decode.prompt_cache.PromptCache.host_bytes``; ``--cache-ram`` of ``chat`` and ``serve``).
* :data:`PRECISIONS`: how ``engine.api.Engine.load`` may hold a model's weights (its ``precision``; the worker's load
  command and the CLI's ``--precision`` take the same names).
"""

from __future__ import annotations

GIB = 1 << 30

DEFAULT_CTX_TOKENS = 16_384
CARD_CHOICES_GIB = (8, 12, 16, 24)
DEFAULT_CARD_GIB = 16
DEFAULT_CARD_BYTES = DEFAULT_CARD_GIB * GIB
PROMPT_CACHE_RAM_MIB = 1024
DEFAULT_BLOCK_SIZE = 32
DEFAULT_THRESHOLD = 0.95
# Engine.load's precisions: unquantized in that dtype (computing in it), the engine's own quantized cache (NF4
# experts, INT8 dense: what the app loads for a 16 GB card), a GGUF file's own blocks
DTYPE_OF_PRECISION = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
PRECISIONS = (*DTYPE_OF_PRECISION, "nf4", "gguf")

__all__ = ["CARD_CHOICES_GIB", "DEFAULT_BLOCK_SIZE", "DEFAULT_CARD_BYTES", "DEFAULT_CARD_GIB", "DEFAULT_CTX_TOKENS",
           "DEFAULT_THRESHOLD", "DTYPE_OF_PRECISION", "GIB", "PRECISIONS", "PROMPT_CACHE_RAM_MIB"]
