"""Write a Hugging Face model folder as a GGUF file, in either Clover layout (engine.weights.gguf.file): for tests, the
benchmark and round trips. It applies the converter's transforms (norms stored as ``1 + w``, value heads tiled,
``ssm_a`` raw ``A_log`` for ``fork`` or ``-exp(A_log)`` for ``upstream``, conv weights squeezed, experts split into
gate / up / down banks) and quantizes with the ``gguf`` package (Q8_0, Q4_0) or :func:`engine.weights.gguf.quants.quantize`
(Q4_K, Q5_K, Q6_K, which the package cannot write).

Type policy, as llama.cpp's quantizer does it: 1-D tensors, the router, ``ssm_alpha`` / ``ssm_beta``, the conv and
decay tensors and the diffusion tensors stay F32; other matrices take the asked type, and one whose rows are not a
whole number of that type's blocks falls back to Q8_0 (or F16 when rows are not a multiple of 32).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clover_desk.engine.errors import ConfigError
from clover_desk.engine.model.config import CloverConfig, load_config
from clover_desk.engine.weights.checkpoint import iter_model_tensors
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.file import GGUF_OF_HF, hf_to_tiled_heads

log = logging.getLogger(__name__)

TYPE_OF_NAME = {name: qtype for qtype, name in gq.TYPE_NAMES.items()}
_KEEP_F32 = ("ssm_conv1d.weight", "ssm_conv1d.weight_right", "ssm_a", "ssm_dt.bias", "ffn_gate_inp.weight",
             "ffn_gate_inp_shexp.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_bd_history.weight",
             "ssm_bd_history.bias", "ssm_bd_logit_scale.weight")
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def tensor_type(gguf_name: str, shape: tuple[int, ...], requested: int) -> int:
    """The ggml type a tensor is written in (see the module docstring)."""
    leaf = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    if len(shape) == 1 or leaf in _KEEP_F32:
        return gq.F32
    elems = gq.BLOCK[requested][0]
    if shape[-1] % elems == 0:
        return requested
    return gq.Q8_0 if shape[-1] % 32 == 0 else gq.F16


def _to_tiled(t: Tensor, leaf: str, cfg: CloverConfig) -> Tensor:
    """Hugging Face head order -> GGUF's tiled order along the axis ``leaf`` keeps per value head."""
    hk, hv, dv, kd = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.key_dim
    if hk == hv:
        return t
    heads = hf_to_tiled_heads(hk, hv)

    def expand(width: int, base: int = 0) -> Tensor:
        return torch.tensor([base + h * width + j for h in heads for j in range(width)])

    if leaf in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a") or (
        leaf.startswith(("ssm_bd_history", "ssm_bd_logit_scale")) and t.shape[0] == hv
    ):
        return t[torch.tensor(heads)]
    if leaf == "attn_gate.weight":
        return t[expand(dv)]
    if leaf in ("attn_qkv.weight", "ssm_conv1d.weight", "ssm_conv1d.weight_right"):
        return t[torch.cat([torch.arange(2 * kd), expand(dv, 2 * kd)])]
    if leaf == "ssm_out.weight":
        return t[:, expand(dv)]
    return t


def gguf_tensors(model_dir: str | Path, layout: str = "fork") -> tuple[CloverConfig, dict[str, Tensor]]:
    """(config, {gguf name: fp32 tensor in GGUF order, torch shape}) of a model folder, transforms applied."""
    cfg = load_config(model_dir)
    return cfg, dict(iter_gguf_tensors(model_dir, cfg, layout))


def iter_gguf_tensors(model_dir: str | Path, cfg: CloverConfig, layout: str = "fork") -> Iterator[tuple[str, Tensor]]:
    """(gguf name, fp32 tensor in GGUF order) one at a time: a writer holds one fp32 tensor at once, not the model."""
    if layout not in ("fork", "upstream"):
        raise ConfigError(f"GGUF layout {layout!r} is not 'fork' or 'upstream'")
    for target, tensor in iter_model_tensors(model_dir, cfg):
        name, t = target.name, tensor.to(torch.float32)
        if target.index is not None:
            raise ConfigError(f"{model_dir}: per-expert checkpoints are not written as GGUF here (fuse them first)")
        if name.startswith("layers.") and ".mlp.experts." in name:
            layer = name.split(".")[1]
            if name.endswith("gate_up_proj"):
                inter = t.shape[1] // 2
                yield f"blk.{layer}.ffn_gate_exps.weight", t[:, :inter].contiguous()
                yield f"blk.{layer}.ffn_up_exps.weight", t[:, inter:].contiguous()
            else:
                yield f"blk.{layer}.ffn_down_exps.weight", t
            continue
        gname = _gguf_name(name)
        if gname is None:
            continue
        if layout == "upstream" and gname.endswith(("ssm_bd_history.weight", "ssm_bd_history.bias",
                                                    "ssm_bd_logit_scale.weight", "ssm_conv1d.weight_right")):
            continue  # upstream's converter drops the diffusion tensors
        leaf = gname.split(".", 2)[-1] if gname.startswith("blk.") else gname
        if name.endswith(_PLUS_ONE) or name == "norm.weight":
            t = t + 1.0
        if leaf == "ssm_a" and layout == "upstream":
            t = -torch.exp(t)
        if leaf == "ssm_conv1d.weight":
            t = t.reshape(t.shape[0], t.shape[-1])
        if leaf == "ffn_gate_inp_shexp.weight":
            t = t.reshape(-1)
        yield gname, _to_tiled(t, leaf, cfg).contiguous()


def _gguf_name(hf_name: str) -> str | None:
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or parts[2] not in GGUF_OF_HF:
        return None
    return f"blk.{parts[1]}.{GGUF_OF_HF[parts[2]]}"


def _tokenizer_metadata(model_dir: Path, vocab_size: int = 0) -> dict[str, Any]:
    """Tokens, types and merges of the folder's byte-level BPE tokenizer.json, as GGUF stores them; the list is
    padded with unused ``[PADn]`` entries up to ``vocab_size`` (the embedding's rows, which real checkpoints round
    up past the tokenizer), since llama.cpp sizes the vocabulary from the list."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    types: dict[int, int] = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        types[added["id"]] = 3 if added.get("special") else 4
    tokens = [""] * max(max(vocab.values()) + 1, vocab_size)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ConfigError(f"{model_dir / 'tokenizer.json'}: only a plain ByteLevel pre-tokenizer is written as GGUF here")
    for i, tok in enumerate(tokens):
        if not tok:
            tokens[i], types[i] = f"[PAD{i}]", 5  # unused
    return {"tokens": tokens, "types": [types.get(i, 1) for i in range(len(tokens))], "merges": merges}


def write_gguf(
    model_dir: str | Path,
    out: str | Path,
    qtype: str | int = "F32",
    *,
    layout: str = "fork",
    arch: str | None = None,
    split_max_tensors: int = 0,
    with_shared_count: bool | None = None,
    diffusion_tensors: bool | None = None,
    types: dict[str, int] | None = None,
) -> list[Path]:
    """Write ``model_dir`` as GGUF to ``out`` (``split_max_tensors`` > 0: a ``-0000k-of-0000N`` split set next to
    it). ``arch`` defaults to ``clover_moe``; ``with_shared_count`` (default: upstream layout only) writes the
    ``{arch}.expert_shared_count`` key the official files lack. ``diffusion_tensors`` (default: fork layout only)
    keeps the Clover tensors; ``types`` forces the ggml type of named tensors (any type the ``gguf`` package can
    quantize: tests write unsupported ones). Returns the files written."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    requested = TYPE_OF_NAME[qtype] if isinstance(qtype, str) else int(qtype)
    if requested not in gq.BLOCK:
        raise ConfigError(f"cannot write ggml type {qtype!r} (known: {', '.join(TYPE_OF_NAME)})")
    cfg = load_config(model_dir)
    drop: tuple[str, ...] = ()
    if diffusion_tensors is None or diffusion_tensors == (layout == "fork"):
        pass
    elif diffusion_tensors:
        raise ConfigError("the upstream layout has no diffusion tensors to keep")
    else:
        drop = ("ssm_bd_history.weight", "ssm_bd_history.bias", "ssm_bd_logit_scale.weight", "ssm_conv1d.weight_right")
    arch = arch or "clover_moe"
    # one file: each converted tensor goes to a spooled temporary file as it comes (memory peaks at one tensor, not
    # the model: an F16 file of the 4-layer real-width checkpoint held 17.5 GB in memory before); a split set keeps
    # them in memory, as the package only spools a single file
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors, use_temp_file=split_max_tensors == 0)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    # multimodal RoPE sections (llama.cpp's qwen35moe requires the key); for text every section sees the same
    # position, so only their sum matters: the 35B model's [11, 11, 10] split of 32 pairs, scaled
    pairs = cfg.rotary_dim // 2
    side = round(pairs * 11 / 32)
    w.add_rope_dimension_sections([side, side, pairs - 2 * side, 0])
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if with_shared_count if with_shared_count is not None else layout == "upstream":
        w.add_uint32(f"{arch}.expert_shared_count", 1)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    interval = next((i + 1 for i, t in enumerate(cfg.layer_types) if t == "full_attention"), 4)
    w.add_uint32(f"{arch}.full_attention_interval", interval)
    tok = _tokenizer_metadata(model_dir, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text(encoding="utf-8"))
    if layout == "fork":
        if cfg.mask_token_id is not None:
            w.add_mask_token_id(cfg.mask_token_id)
        w.add_bool("diffusion.shift_logits", cfg.shift_logits)
    count = 0
    for name, t in iter_gguf_tensors(model_dir, cfg, layout):  # each converted to its type as it comes
        if name.endswith(drop) and drop:
            continue
        count += 1
        kind = (types or {}).get(name, tensor_type(name, tuple(t.shape), requested))
        if kind == gq.F32:
            w.add_tensor(name, t.numpy())
        elif kind == gq.F16:
            w.add_tensor(name, t.to(torch.float16).numpy())
        else:
            if kind in gq.BLOCK and kind not in (gq.Q8_0, gq.Q4_0):
                raw = gq.quantize(t, kind).numpy()  # the K formats (and BF16), which the package cannot write
            else:
                raw = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType(kind))
            w.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=gguf.GGMLQuantizationType(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files = w.format_shard_names(out)
    log.info("wrote %s (%s, %s layout, %d tensors)", files[0], gq.TYPE_NAMES[requested], layout, count)
    return files
