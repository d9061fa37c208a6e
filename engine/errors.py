"""Errors the engine raises. Each names the file, tensor, field or value at fault."""

from __future__ import annotations


class CloverError(Exception):
    """Base class: a user-facing problem with a clear message (never a raw traceback at the CLI)."""


class ConfigError(CloverError):
    """config.json / generation_config.json is missing, malformed, or names an unknown model_type or field."""


class CheckpointError(CloverError):
    """A weight file is truncated, a tensor is missing or has the wrong shape or dtype."""


class PromptError(CloverError):
    """The request cannot be served: empty prompt, too long for the context, bad ids."""


class PlanError(CloverError):
    """The VRAM / RAM budget cannot hold a working plan."""


class OutOfMemory(PlanError):
    """The device ran out of memory (or of the byte budget given to placement) while placing weights."""


class CancelledError(CloverError):
    """A long call (load, quantize, download, generate) was cancelled by the user."""
