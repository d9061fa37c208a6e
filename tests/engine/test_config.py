"""Config parsing: Clover, the nested Qwen3.5-MoE wrapper and the flat text config; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_desk.engine.errors import ConfigError
from clover_desk.engine.model.config import load_config, load_generation_defaults, parse_config
from tests.helpers_model import tiny_text_dict

# The tiny text config (tests/helpers_model.py) less what parse_config must default: the layer types (from the
# full-attention interval), the conv kernel, the context, the norm epsilon and the mrope fields.
DEFAULTED = ("layer_types", "linear_conv_kernel_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters")
TEXT = {
    **{k: v for k, v in tiny_text_dict(vocab_size=320, num_experts=8, num_experts_per_tok=2).items()
       if k not in DEFAULTED},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def test_flat_text_config_uses_model_prefix() -> None:
    cfg = parse_config({"model_type": "qwen3_5_moe_text", **TEXT})
    assert cfg.weight_prefix == "model."
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 4 and cfg.rope_theta == 10000.0
    assert cfg.conv_dim == 2 * 32 + 64
    assert not cfg.is_diffusion


def test_nested_wrapper_reads_text_config() -> None:
    cfg = parse_config({"model_type": "qwen3_5_moe", "text_config": dict(TEXT, model_type="qwen3_5_moe_text")})
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.hidden_size == 64


def test_clover_reads_diffusion_fields_and_switches() -> None:
    cfg = parse_config(
        {"model_type": "clover_moe", **TEXT, "mask_token_id": 300, "block_size": 32, "threshold": 0.9,
         "moe_block_coreset_top_p": 0.8, "bd_history_form": "F2", "eos_token_id": [1, 2]}
    )
    assert cfg.is_diffusion and cfg.mask_token_id == 300 and cfg.threshold == 0.9
    assert cfg.moe_block_coreset_enabled and cfg.moe_block_coreset_top_p == 0.8
    assert cfg.bd_history_form == "F2" and cfg.eos_token_ids == (1, 2)


def test_unknown_model_type_is_named() -> None:
    with pytest.raises(ConfigError, match="'llama'"):
        parse_config({"model_type": "llama", **TEXT})


def test_missing_field_is_named() -> None:
    data = {"model_type": "qwen3_5_moe_text", **TEXT}
    del data["num_experts"]
    with pytest.raises(ConfigError, match="num_experts"):
        parse_config(data)


def test_wrong_field_value_is_named() -> None:
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_config({"model_type": "qwen3_5_moe_text", **TEXT, "hidden_size": "big"})


def test_files_and_generation_defaults(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json: file not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clover_moe", **TEXT}))
    cfg = load_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"presence_penalty": 0.9, "repetition_penalty": 1.05, "dllm_length_penalty": 10.0,
                    "max_new_tokens": 24576, "eos_token_id": [7, 8]})
    )
    gen = load_generation_defaults(tmp_path, cfg)
    assert gen.presence_penalty == 0.9 and gen.repetition_penalty == 1.05
    assert gen.dllm_length_penalty == 10.0 and gen.eos_token_ids == (7, 8)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": "lots"}))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_generation_defaults(tmp_path, cfg)


def test_unknown_switch_value_is_named() -> None:
    with pytest.raises(ConfigError, match="bd_right_conv_taps"):
        parse_config({"model_type": "clover_moe", **TEXT, "bd_right_conv_taps": "R9"})


BAD_FIELDS = [
    ("layer_types", 5, "'layer_types' must be a list"),
    ("rope_parameters", [1], "'rope_parameters' must be an object"),
    ("eos_token_id", "abc", "'eos_token_id' must be a token id"),
    ("eos_token_id", [2, True], "'eos_token_id' must be a token id"),
    ("rms_norm_eps", "abc", "'rms_norm_eps' must be a number"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a number"),
    ("block_size", "x", "'block_size' must be an integer from 1 to 4,096"),
    ("threshold", "high", "'threshold' must be a number from 0 to 1"),
    ("threshold", 1.5, "'threshold' must be a number from 0 to 1"),
    ("mask_token_id", 320, "'mask_token_id' must be a token id from 0 to 319"),
    ("mask_token_id", "3", "'mask_token_id' must be a token id"),
    ("moe_intermediate_size", 1e9, "'moe_intermediate_size' must be an integer from 1 to 262,144"),
    ("num_hidden_layers", 1e10, "'num_hidden_layers' must be an integer from 1 to 1,024"),
    ("vocab_size", 10**12, "'vocab_size' must be an integer"),
    ("hidden_size", float("inf"), "'hidden_size' must be an integer"),
    ("num_experts", 0, "'num_experts' must be an integer from 1"),
]


@pytest.mark.parametrize("field, value, message", BAD_FIELDS)
def test_wrong_types_and_absurd_sizes_are_one_line_before_any_allocation(field: str, value: object, message: str) -> None:
    data = {"model_type": "clover_moe", **TEXT, "mask_token_id": 5, field: value}
    if field == "num_hidden_layers":
        data.pop("layer_types", None)
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(data, source="m/config.json")
    assert str(err.value).startswith("m/config.json: field ") and "\n" not in str(err.value)
