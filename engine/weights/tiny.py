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

:func:`make_real_shape` writes the same folder with the real Clover-35B-A3B widths (hidden 2048, vocab 248,320,
256 experts of 512, ...) and fewer layers: a few GB per layer, so it is streamed to disk tensor by tensor in
chunks (:func:`engine.weights.streaming_writer.write_checkpoint_streaming`) and never held in memory. It exists to exercise the
loading, quantizing, offloading and planning paths at full width without the 67 GB download.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from clover_desk.engine.decode.tokenizer import ENDOFTEXT, IM_END, MASK, THINK_END, train_tiny_tokenizer
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover_desk.engine.errors import ConfigError
from clover_desk.engine.model.config import CloverConfig, parse_config
from clover_desk.engine.placement.manifest import SHAPES, ModelGeometry, _text_tensors, shape_fields
from clover_desk.engine.weights.checkpoint import random_state_dict, write_checkpoint
from clover_desk.engine.weights.formats import INDEX_NAME, SINGLE_NAME
from clover_desk.engine.weights.streaming_writer import SHARD_NAME, TensorSpec, write_checkpoint_streaming

if TYPE_CHECKING:  # torch is imported only by the functions that write weights
    from clover_desk.engine.weights.streaming_writer import FillFn, TensorSpec

log = logging.getLogger(__name__)

MODEL_TYPES = ("clover_moe", "qwen3_5_moe")

# Clover-35B-A3B-Preview's published generation_config.json values.
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
    model_type: str, text: dict[str, Any], special: dict[str, int], *, block_size: int = DEFAULT_BLOCK_SIZE,
    threshold: float = DEFAULT_THRESHOLD,
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
    moe_intermediate: int = 32,
) -> Path:
    """Write a tiny random model folder to ``out_dir`` and return its path.

    ``clover_extras``: True (random Clover GDN tensors), "neutral" (present, but the model then equals causal
    Qwen inside a block), False (absent; the default for ``qwen3_5_moe``). ``max_shard_bytes`` None picks a limit
    that gives three shards.
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(out, tokenizer_vocab)
    special = {name: tokenizer.token_to_id(name) for name in (ENDOFTEXT, IM_END, MASK, THINK_END)}
    vocab = -(-tokenizer.vocab_size // 64) * 64  # round up, as real checkpoints pad the embedding
    text = tiny_text_config(
        vocab_size=vocab, layers=layers, hidden=hidden, experts=experts, experts_per_tok=experts_per_tok,
        max_position_embeddings=max_position_embeddings, moe_intermediate=moe_intermediate,
    )
    config_dict = config_dict_for(model_type, text, special)  # type: ignore[arg-type]
    config = parse_config(config_dict, source=str(out / "config.json"))
    extras = clover_extras if model_type == "clover_moe" else False
    state = random_state_dict(config, seed=seed, clover_extras=extras)
    if max_shard_bytes is None:
        total = sum(t.numel() * t.element_size() for t in state.values())
        max_shard_bytes = total // 3 + 1
    write_checkpoint(out, state, config_dict, max_shard_bytes=max_shard_bytes)

    write_generation_config(out, model_type, special)
    log.info("wrote a tiny %s model (%d layers, hidden %d, %d experts) to %s", model_type, layers, hidden, experts, out)
    return out


def write_generation_config(out_dir: str | Path, model_type: str, special: dict[str, int]) -> Path:
    """``generation_config.json`` as the release has it: Clover's published decoding defaults for ``clover_moe``,
    plain greedy for ``qwen3_5_moe``; EOS / pad ids are the tokenizer's (``special``: name -> id)."""
    generation: dict[str, Any] = {"eos_token_id": [special[IM_END], special[ENDOFTEXT]], "pad_token_id": special[ENDOFTEXT]}
    if model_type == "clover_moe":
        generation.update(CLOVER_GENERATION_DEFAULTS)
    else:
        generation.update({"do_sample": False, "max_new_tokens": 24576})
    path = Path(out_dir) / "generation_config.json"
    path.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------------------
# full-width random checkpoints (real Clover-35B-A3B widths, fewer layers), streamed to disk
# ----------------------------------------------------------------------------------------------------------------

REAL_SHAPES = ("clover-35b-a3b",)
MAX_LAYERS = SHAPES["clover-35b-a3b"].num_hidden_layers  # the real model's depth; more would be a model that does not exist
GiB = 1 << 30
_CHUNK_ELEMENTS = 1 << 24  # 32 MiB of bf16 per generated chunk: big enough for speed, small for memory


def clover_35b_a3b_text_config(*, layers: int = MAX_LAYERS, vocab_size: int | None = None) -> dict[str, Any]:
    """The text fields of Clover-35B-A3B-Preview's config.json with ``layers`` layers (real widths).

    The layer pattern is the real one: layer i is full attention when (i + 1) % 4 == 0. With fewer than 4 layers
    there is no full-attention layer at all; the engine loads and runs such a model (only Gated DeltaNet layers,
    no KV cache), so the pattern is kept rather than bent.
    """
    fields = shape_fields("clover-35b-a3b")  # the widths are engine.placement.manifest.SHAPES'
    return tiny_text_config(**{**fields, "layers": layers, "vocab_size": vocab_size or fields["vocab_size"]})


class RandomInit(NamedTuple):
    """How one tensor's random values are drawn: ``normal`` (a = mean, b = std) or ``uniform`` (a = low, b = high)."""

    kind: str
    a: float
    b: float


def random_checkpoint_specs(config: CloverConfig, clover_extras: bool = True) -> list[tuple[TensorSpec, RandomInit]]:
    """Every text tensor of ``config`` with its official name, shape, stored dtype and random init.

    Names, shapes and dtypes come from the planner's tensor list (:func:`engine.placement.manifest._text_tensors`: bf16,
    except ``linear_attn.A_log`` and ``linear_attn.norm.weight`` in fp32; q_proj carries the output gate). Init
    scales follow :func:`engine.weights.checkpoint.random_state_dict` (:func:`_random_init`), so the activations of a random
    model stay finite and not degenerate."""
    import torch


    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    geo = ModelGeometry.from_config(config, clover_extras=clover_extras)
    out: list[tuple[TensorSpec, RandomInit]] = []
    for name, shape, stored in _text_tensors(geo):
        full = name if name == "lm_head.weight" else config.weight_prefix + name
        out.append((TensorSpec(full, tuple(shape), dtypes[stored]), _random_init(name, shape)))
    return out


def _random_init(name: str, shape: tuple[int, ...]) -> RandomInit:
    """The init of one tensor by its role: projections normal with std ~ fan_in^-0.5 (output projections half of
    it, the router twice), RMSNorm weights (1 + w form) small around 0, the gated GDN norm around 1, A_log / dt_bias
    in the ranges that give sane decay, Clover's extras near their neutral values."""
    fan_in = shape[-1]
    for suffix, init in (
        ("embed_tokens.weight", RandomInit("normal", 0.0, 1.0)),
        ("linear_attn.norm.weight", RandomInit("uniform", 0.5, 1.5)),
        ("norm.weight", RandomInit("normal", 0.0, 0.1)),  # input / post-attention / q / k / final RMSNorms
        ("conv1d.weight", RandomInit("normal", 0.0, 0.5)),
        ("conv1d.weight_right", RandomInit("normal", 0.0, 0.3)),
        ("dt_bias", RandomInit("uniform", -1.0, 1.0)),
        ("A_log", RandomInit("uniform", math.log(0.05), math.log(2.0))),
        ("bd_history.bias", RandomInit("normal", 0.0, 1.0)),
        ("bd_logit_scale.weight", RandomInit("uniform", 0.8, 1.2)),
        ("mlp.gate.weight", RandomInit("normal", 0.0, 2.0 * fan_in**-0.5)),
    ):
        if name.endswith(suffix):
            return init
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
        return RandomInit("normal", 0.0, 0.5 * fan_in**-0.5)
    return RandomInit("normal", 0.0, fan_in**-0.5)


def _tensor_seed(seed: int, name: str) -> int:
    """A generator seed per tensor: a tensor's values depend on (seed, name) only, so layer 0 of a 1-layer model
    equals layer 0 of a 4-layer one and the order of writing does not matter."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_fill(inits: dict[str, RandomInit], seed: int, chunk_elements: int = _CHUNK_ELEMENTS) -> FillFn:
    """A fill for :func:`engine.weights.streaming_writer.write_safetensors_streaming` that draws each tensor's values in chunks
    of ``chunk_elements`` from its own ``torch.Generator`` (see :func:`_tensor_seed`), deterministic in ``seed``.

    Each chunk is a fresh tensor (the writer may still be writing the previous one), so memory is a few chunks
    whatever the tensor size. Values are drawn directly in the stored dtype: bf16 ``normal_`` is about twice as
    fast as fp32-then-convert on a 2-core CPU."""
    import torch

    def fill(spec: TensorSpec) -> Any:
        init = inits[spec.name]
        gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
        left = spec.numel
        while left > 0:
            n = min(left, chunk_elements)
            chunk = torch.empty(n, dtype=spec.dtype)
            if init.kind == "normal":
                chunk.normal_(init.a, init.b, generator=gen)
            elif init.kind == "uniform":
                chunk.uniform_(init.a, init.b, generator=gen)
            else:
                raise ValueError(f"tensor {spec.name!r}: unknown init kind {init.kind!r}")
            yield chunk
            left -= n

    return fill


def write_random_checkpoint(
    out_dir: str | Path,
    config_dict: dict[str, Any],
    *,
    seed: int = 0,
    clover_extras: bool = True,
    max_shard_bytes: int = 2 * GiB,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Path]:
    """Stream random weights for ``config_dict`` (any size) into ``out_dir`` as sharded safetensors + index, in
    bounded memory. ``progress(done_bytes, total_bytes, file_name)`` after each chunk. Returns the shard paths.

    Only the weights: config.json, the tokenizer and generation_config.json are the caller's (see
    :func:`make_real_shape`)."""

    out = Path(out_dir)
    config = parse_config(config_dict, source=str(out / "config.json"))
    pairs = random_checkpoint_specs(config, clover_extras=clover_extras)
    specs = [spec for spec, _ in pairs]
    total = sum(spec.nbytes for spec in specs)
    done = 0

    def report(fname: str, n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total, fname)

    fill = random_fill({spec.name: init for spec, init in pairs}, seed)
    return write_checkpoint_streaming(out, specs, fill, max_shard_bytes=max_shard_bytes, progress=report)


def _check_free_space(out: Path, needed: int) -> None:
    """Refuse before writing anything when the disk cannot hold the weights (a full disk mid-write wastes minutes).

    Model files already in the folder count as free: they are replaced one shard at a time."""
    replaced = sum(p.stat().st_size for p in out.glob("*.safetensors") if p.is_file())
    free = shutil.disk_usage(out).free
    if free + replaced < needed:
        raise ConfigError(
            f"{out}: the weights need {needed / GiB:.1f} GiB, the disk has {(free + replaced) / GiB:.1f} GiB free"
        )


def make_real_shape(
    out_dir: str | Path,
    *,
    shape: str = "clover-35b-a3b",
    layers: int = 4,
    model_type: str = "clover_moe",
    seed: int = 0,
    max_shard_bytes: int = 2 * GiB,
    progress: Callable[[int, int, str], None] | None = None,
) -> Path:
    """Write a random model with the real widths of ``shape`` and ``layers`` layers to ``out_dir``; return it.

    The folder is what :func:`make_tiny` writes (config.json with the diffusion keys for ``clover_moe``, shards of
    at most ``max_shard_bytes`` plus index, generation_config.json, the tiny tokenizer and chat template), only
    wider: 2.0 GB of embedding + lm_head plus ~1.7 GB per layer (bf16; 1 layer ~3.7 GB, 4 layers ~8.8 GB).
    Memory stays at a few tens of MiB above the interpreter whatever the size (chunked streaming).

    Special token ids come from the tiny tokenizer (ids < 16) and are far below vocab_size 248,320: the
    embedding simply has rows no token uses, as the engine allows (tokenizer vocab <= config vocab).
    Layers: 1..40, real pattern (see :func:`clover_35b_a3b_text_config`: fewer than 4 layers means no
    full-attention layer, which the engine supports). ``qwen3_5_moe`` gives the base-model layout (nested
    text_config, no Clover tensors).

    Crash safety: config.json and the index are removed first and written last, and each shard appears under its
    final name only once complete, so an interrupted run never leaves a folder that looks loadable. Shards of an
    earlier run that the new index does not list (``model-*-of-*.safetensors``, ``model.safetensors``) are deleted.
    """

    if shape not in REAL_SHAPES:
        raise ConfigError(f"shape {shape!r} is not one of {', '.join(REAL_SHAPES)}")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"layers must be an integer from 1 to {MAX_LAYERS}, got {layers!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "config.json", out / INDEX_NAME):
        stale.unlink(missing_ok=True)  # the folder must not look complete until it is

    tokenizer = train_tiny_tokenizer(out, 1024)
    special = {name: tokenizer.token_to_id(name) for name in (ENDOFTEXT, IM_END, MASK, THINK_END)}
    text = clover_35b_a3b_text_config(layers=layers)
    if max(special.values()) >= text["vocab_size"]:  # cannot happen with the tiny tokenizer; guards a change
        raise ConfigError(f"special token ids {special} do not fit vocab_size {text['vocab_size']}")
    config_dict = config_dict_for(model_type, text, special)  # type: ignore[arg-type]
    config = parse_config(config_dict, source=str(out / "config.json"))
    extras = model_type == "clover_moe"
    needed = sum(spec.nbytes for spec, _ in random_checkpoint_specs(config, clover_extras=extras))
    _check_free_space(out, needed)

    paths = write_random_checkpoint(
        out, config_dict, seed=seed, clover_extras=extras, max_shard_bytes=max_shard_bytes, progress=progress
    )
    keep = {p.name for p in paths}
    for old in out.iterdir():
        if old.name not in keep and (SHARD_NAME.match(old.name) or old.name == SINGLE_NAME):
            log.info("removing %s (left by an earlier run, not part of this checkpoint)", old)
            old.unlink()
    write_generation_config(out, model_type, special)
    tmp = out / f".config.json.{os.getpid()}.partial"
    tmp.write_text(json.dumps(config_dict, indent=2), encoding="utf-8")
    os.replace(tmp, out / "config.json")
    log.info("wrote a %s-wide %s model (%d layers, %d shards, %d bytes of weights) to %s",
             shape, model_type, layers, len(paths), needed, out)
    return out
