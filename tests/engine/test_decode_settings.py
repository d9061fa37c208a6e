"""What a request decodes with (engine.decode.settings): the model's generation defaults reach DecodeSettings."""

from __future__ import annotations

from clover_desk.engine.decode.events import GenerationParams
from clover_desk.engine.decode.settings import resolve_settings
from clover_desk.engine.model.config import GenerationDefaults
from tests.helpers_model import tiny_config


def test_the_length_and_think_end_ramps_come_from_generation_config() -> None:
    """Each dllm_<name> of generation_config.json is the settings' <name>, whatever the request asks."""
    defaults = GenerationDefaults(
        dllm_length_penalty=2.5, dllm_length_penalty_start=11, dllm_length_penalty_window=12,
        dllm_think_end_bias=3.5, dllm_think_end_bias_start=13, dllm_think_end_bias_window=14,
    )
    s = resolve_settings(GenerationParams(mode="ar"), defaults, tiny_config())
    assert (s.length_penalty, s.length_penalty_start, s.length_penalty_window) == (2.5, 11, 12)
    assert (s.think_end_bias, s.think_end_bias_start, s.think_end_bias_window) == (3.5, 13, 14)
