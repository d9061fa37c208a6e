"""``make_tiny``: a complete tiny model folder in the official Hugging Face layout (random weights: output is noise).

What it writes, as a real Clover / Qwen3.5-MoE release would have it:

* ``config.json``: ``clover_moe`` (flat, with the diffusion keys: mask id, EOS ids, block size 32, threshold 0.95,
  coreset switches) or ``qwen3_5_moe`` (nested ``text_config``, no diffusion keys);
* sharded safetensors (a small shard limit so there are always several shards) with
  ``model.safetensors.index.json``, names under ``model.language_model.``, fused experts, and for Clover the four
  extra tensors per Gated DeltaNet layer;
* ``generation_config.json`` with Clover's published decoding defaults;
* ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` (a byte-level BPE trained here on the
  corpus shipped in ``engine/data``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.config import parse_config
from engine.errors import ConfigError
from engine.tokenizer import ENDOFTEXT, IM_END, MASK, THINK_END, train_tiny_tokenizer

log = logging.getLogger(__name__)

MODEL_TYPES = ("clover_moe", "qwen3_5_moe")

# Clover-35B-A3B-Preview's published generation_config.json values (clover.md).
CLOVER_GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "presence_penalty": 0.9,
    "repetition_penalty": 1.05,
    "dllm_length_penalty": 10.0,
    "dllm_length_penalty_start": 8192,
    "dllm_length_penalty_window": 8192,
    "dllm_think_end_bias": 10.0,
    "dllm_think_end_bias_start": 4096,
    "dllm_think_end_bias_window": 4096,
    "max_new_tokens": 24576,
}


def tiny_text_config(
    *,
    vocab_size: int,
    layers: int = 4,
    hidden: int = 64,
    experts: int = 16,
    experts_per_tok: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 16,
    moe_intermediate: int = 32,
    shared_intermediate: int = 32,
    full_attention_interval: int = 4,
    max_position_embeddings: int = 131_072,
) -> dict[str, Any]:
    """The architecture fields of a Qwen3.5-MoE-style text config (config.json names)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_key_heads,
        "linear_num_value_heads": linear_value_heads,
        "linear_key_head_dim": linear_head_dim,
        "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": experts_per_tok,
        "moe_intermediate_size": moe_intermediate,
        "shared_expert_intermediate_size": shared_intermediate,
        "layer_types": [
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(layers)
        ],
        "full_attention_interval": full_attention_interval,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
        "partial_rotary_factor": 0.25,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "dtype": "bfloat16",
    }


def config_dict_for(
    model_type: str, text: dict[str, Any], special: dict[str, int], *, block_size: int = 32, threshold: float = 0.95
) -> dict[str, Any]:
    """A full config.json dict for ``model_type`` around the text fields ``text``."""
    eos = [special[IM_END], special[ENDOFTEXT]]
    if model_type == "clover_moe":
        return {
            "architectures": ["CloverMoeForCausalLM"],
            "model_type": "clover_moe",
            **text,
            "eos_token_id": eos,
            "pad_token_id": special[ENDOFTEXT],
            "mask_token_id": special[MASK],
            "think_end_token_id": special[THINK_END],
            "block_size": block_size,
            "threshold": threshold,
            "denoising_strategy": "low_confidence",
            "shift_logits": False,
            "moe_block_coreset_enabled": True,
            "moe_block_coreset_top_p": 0.9,
            "weight_prefix": "model.language_model.",
        }
    if model_type == "qwen3_5_moe":
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": {"model_type": "qwen3_5_moe_text", **text, "eos_token_id": eos[0]},
            "tie_word_embeddings": False,
            "eos_token_id": eos[0],
        }
    raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")


def make_tiny(
    out_dir: str | Path,
    *,
    model_type: str = "clover_moe",
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    experts: int = 16,
    experts_per_tok: int = 4,
    tokenizer_vocab: int = 1024,
    clover_extras: bool | str = True,
    max_shard_bytes: int | None = None,
    max_position_embeddings: int = 131_072,
) -> Path:
    """Write a tiny random model folder to ``out_dir`` and return its path.

    ``clover_extras``: True (random Clover GDN tensors), "neutral" (present, but the model then equals causal
    Qwen inside a block), False (absent; the default for ``qwen3_5_moe``). ``max_shard_bytes`` None picks a limit
    that gives three shards.
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    from engine.checkpoint import random_state_dict, write_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(out, tokenizer_vocab)
    special = {name: tokenizer.token_to_id(name) for name in (ENDOFTEXT, IM_END, MASK, THINK_END)}
    vocab = -(-tokenizer.vocab_size // 64) * 64  # round up, as real checkpoints pad the embedding
    text = tiny_text_config(
        vocab_size=vocab, layers=layers, hidden=hidden, experts=experts, experts_per_tok=experts_per_tok,
        max_position_embeddings=max_position_embeddings,
    )
    config_dict = config_dict_for(model_type, text, special)  # type: ignore[arg-type]
    config = parse_config(config_dict, source=str(out / "config.json"))
    extras = clover_extras if model_type == "clover_moe" else False
    state = random_state_dict(config, seed=seed, clover_extras=extras)
    if max_shard_bytes is None:
        total = sum(t.numel() * t.element_size() for t in state.values())
        max_shard_bytes = total // 3 + 1
    write_checkpoint(out, state, config_dict, max_shard_bytes=max_shard_bytes)

    generation = {"eos_token_id": [special[IM_END], special[ENDOFTEXT]], "pad_token_id": special[ENDOFTEXT]}
    if model_type == "clover_moe":
        generation.update(CLOVER_GENERATION_DEFAULTS)
    else:
        generation.update({"do_sample": False, "max_new_tokens": 24576})
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    log.info("wrote a tiny %s model (%d layers, hidden %d, %d experts) to %s", model_type, layers, hidden, experts, out)
    return out
