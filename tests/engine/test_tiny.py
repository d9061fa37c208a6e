"""``make_tiny`` writes the official Hugging Face layout, and what it writes loads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures_tiny import one_torch_thread, tiny_clover_dir, tiny_qwen_dir  # noqa: F401
from safetensors import safe_open

from clover_desk.engine.model.config import load_config, load_generation_defaults
from clover_desk.engine.weights.tiny import make_tiny


def _tensor_names(folder: Path) -> dict[str, str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return index["weight_map"]


def test_clover_folder_has_every_file(tiny_clover_dir: Path) -> None:
    names = {p.name for p in tiny_clover_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "model.safetensors.index.json"} <= names
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 2 and all(s.startswith("model-0000") for s in shards)
    assert set(_tensor_names(tiny_clover_dir).values()) == set(shards)


def test_clover_tensors_use_the_official_names(tiny_clover_dir: Path) -> None:
    weight_map = _tensor_names(tiny_clover_dir)
    config = load_config(tiny_clover_dir)
    assert "lm_head.weight" in weight_map
    assert all(n == "lm_head.weight" or n.startswith("model.language_model.") for n in weight_map)
    pre = "model.language_model.layers.0."
    extras = ["linear_attn.bd_history.weight", "linear_attn.bd_history.bias", "linear_attn.bd_logit_scale.weight",
              "linear_attn.conv1d.weight_right"]
    gdn_layers = [i for i in range(config.num_hidden_layers) if not config.is_full_attention(i)]
    for i in gdn_layers:
        for e in extras:
            assert f"model.language_model.layers.{i}.{e}" in weight_map
    assert sum(".bd_" in n or n.endswith("weight_right") for n in weight_map) == 4 * len(gdn_layers)
    shard = tiny_clover_dir / weight_map[pre + "mlp.experts.gate_up_proj"]
    with safe_open(str(shard), "pt") as f:
        shape = f.get_slice(pre + "mlp.experts.gate_up_proj").get_shape()
    assert shape == [config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size]  # fused experts
    assert not any(".experts.0." in n for n in weight_map)


def test_clover_config_and_generation_defaults(tiny_clover_dir: Path) -> None:
    raw = json.loads((tiny_clover_dir / "config.json").read_text())
    config = load_config(tiny_clover_dir)
    tok = json.loads((tiny_clover_dir / "tokenizer.json").read_text())
    vocab = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert config.model_type == "clover_moe" and config.is_diffusion
    assert config.block_size == 32 and config.threshold == 0.95
    assert config.mask_token_id == vocab["<|mask|>"] and config.think_end_token_id == vocab["</think>"]
    assert config.eos_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert config.moe_block_coreset_enabled and raw["moe_block_coreset_top_p"] == 0.9
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(vocab)
    g = load_generation_defaults(tiny_clover_dir, config)
    assert (g.presence_penalty, g.repetition_penalty, g.max_new_tokens) == (0.9, 1.05, 24576)
    assert (g.dllm_length_penalty, g.dllm_length_penalty_start, g.dllm_length_penalty_window) == (10.0, 8192, 8192)
    assert (g.dllm_think_end_bias, g.dllm_think_end_bias_start, g.dllm_think_end_bias_window) == (10.0, 4096, 4096)
    assert not g.do_sample and g.eos_token_ids == config.eos_token_ids


def test_qwen_folder_is_the_base_layout(tiny_qwen_dir: Path) -> None:
    raw = json.loads((tiny_qwen_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and raw["text_config"]["model_type"] == "qwen3_5_moe_text"
    config = load_config(tiny_qwen_dir)
    assert not config.is_diffusion and config.mask_token_id is None
    weight_map = _tensor_names(tiny_qwen_dir)
    assert not any(".bd_" in n or n.endswith("weight_right") for n in weight_map)
    assert all(n == "lm_head.weight" or n.startswith("model.language_model.") for n in weight_map)


def test_tiny_models_load_and_run(tiny_clover_dir: Path, tiny_qwen_dir: Path, one_torch_thread: None) -> None:
    import torch

    from clover_desk.engine.weights.checkpoint import load_model

    for folder in (tiny_clover_dir, tiny_qwen_dir):
        model = load_model(folder)
        logits = model.forward(torch.arange(10, 20), 0, model.new_cache(16))
        assert logits.shape == (10, load_config(folder).vocab_size) and torch.isfinite(logits).all()


def test_seed_decides_the_weights(tmp_path: Path, tiny_clover_dir: Path) -> None:
    other = make_tiny(tmp_path / "s1", seed=1, layers=2, hidden=32, experts=4, experts_per_tok=2)
    again = make_tiny(tmp_path / "s1b", seed=1, layers=2, hidden=32, experts=4, experts_per_tok=2)
    name = "model.language_model.embed_tokens.weight"

    def first(folder: Path) -> bytes:
        shard = folder / _tensor_names(folder)[name]
        with safe_open(str(shard), "pt") as f:
            return f.get_tensor(name).numpy().tobytes()

    assert first(other) == first(again)
    assert first(other)[:256] != first(make_tiny(tmp_path / "s2", seed=2, layers=2, hidden=32, experts=4,
                                                 experts_per_tok=2))[:256]


def test_unknown_model_type_is_refused(tmp_path: Path) -> None:
    from clover_desk.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="llama"):
        make_tiny(tmp_path, model_type="llama")
