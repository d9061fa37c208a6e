"""VRAM / RAM planner: a byte-exact tensor manifest, a placement plan for a budget, and a roofline speed estimate.

Stdlib only (plus psutil / pynvml inside :func:`engine.hardware.probe_hardware`): the Qt UI imports this module.
Units: sizes are bytes, ``GiB`` = 2**30; bandwidths are GB/s (10**9 bytes per second), as hardware specs state them.

Manifests (:class:`Manifest`): every text-model tensor with its exact bytes and a kind. From a checkpoint's
safetensors headers (:func:`manifest_from_checkpoint`, never the data), from the quantized cache's manifest JSON
(:func:`manifest_from_quantized_cache`, or the same dict: :func:`manifest_from_dict`), or from a known shape under a
:class:`QuantPolicy` (:func:`manifest_for_shape`; the byte rules are the one table :data:`FORMAT_BYTES`).

How a plan is made (:func:`make_plan`); every VRAM byte is in ``Plan.vram_breakdown``:
* ``non_expert``: everything that is not a routed expert (attention, Gated DeltaNet, shared experts, routers,
  norms, Clover extras, lm_head) lives on the GPU, except the input embedding: a row lookup, kept in system RAM.
* ``resident_experts`` / ``expert_slots``: routed experts are placed by whole layers, either resident or streamed
  from pinned host RAM into a pool of expert-sized slots. The pool is at least ``2 x E`` slots (E experts per
  layer) when any layer streams: one 32-token pass can touch all E experts of a layer, and the next streamed
  layer loads while this one computes (double buffering); ``min_slot_experts`` lowers it for a bank that computes
  in chunks (engine.offload accepts E). It never exceeds the streamed experts. VRAM left over after the layers
  becomes extra slots: they hold streamed layers' block working sets across a block's denoising passes.
* Which layers stay resident: the count R with the best predicted tok/s for ``optimize_for`` (ties: more
  resident); the streamed layers are spread evenly over the depth, so resident layers sit between streamed ones
  and their compute hides the next streamed layer's copy (a run of adjacent streamed layers leaves the copy
  engine nothing to overlap with).
* ``kv_cache``: bf16 K and V of every full-attention layer for the context, rounded up to whole blocks.
* ``gdn_state``: fp32 recurrent state + bf16 conv state per GDN layer; denoising passes read it without writing,
  so no snapshot copy.
* ``workspace``: the larger of a prefill forward's scratch and a decoding pass's (fp32 block logits, activations),
  plus the dequantize buffers (engine.quant dequantizes a whole weight per forward). The prefill scratch depends
  on the attention kernel and sets ``Plan.prefill_chunk_tokens`` (:func:`choose_prefill_chunk`).
* ``reserve``: CUDA context + cuBLAS (500 MiB) and caching-allocator slack (256 MiB). The budget is what this
  process may use: pass the card's free VRAM (what the desktop leaves), not its total.

RAM (``Plan.ram_bytes``): the streamed layers' experts (pinned), the embedding and a pinned staging area; not the
Python/torch process itself. Speed: :class:`Roofline` (time per pass = max(VRAM traffic / VRAM bandwidth, PCIe
bytes / PCIe bandwidth, FLOPs / compute) + eager per-layer and per-expert overheads).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, ConfigError, PlanError
from engine.hardware import DEFAULT_HARDWARE, GB, Hardware, probe_hardware

__all__ = [
    "KINDS",
    "SHAPES",
    "Hardware",
    "Manifest",
    "ModelGeometry",
    "Plan",
    "QuantPolicy",
    "Roofline",
    "TensorEntry",
    "classify",
    "format_bytes",
    "make_plan",
    "manifest_for_shape",
    "manifest_from_checkpoint",
    "manifest_from_dict",
    "manifest_for_model_dir",
    "quantize_manifest",
    "manifest_from_quantized_cache",
    "probe_hardware",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30

KINDS = ("expert", "attn", "gdn", "shared_expert", "router", "norm", "embed", "lm_head", "clover_extra", "other")

# ---------------------------------------------------------------------------------------------------------------
# Byte rules: the one table
# ---------------------------------------------------------------------------------------------------------------

NF4_BLOCK = 64  # routed experts: 4-bit codes + one fp32 absmax per 64 values = 4.5 bits per parameter


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def _nf4_bytes(shape: tuple[int, ...]) -> int:
    n = _numel(shape)
    return (n + 1) // 2 + -(-n // NF4_BLOCK) * 4


def _int8_bytes(shape: tuple[int, ...]) -> int:
    # int8 codes + one fp32 scale per output row (bitsandbytes Int8Params' SCB); rows = all but the last dim.
    n = _numel(shape)
    rows = n // shape[-1] if shape and shape[-1] else 0
    return n + rows * 4


# format -> bytes of a tensor of that shape in that format. Every byte count the planner uses comes from here
# (or, for a real checkpoint, from the file's own data offsets).
FORMAT_BYTES: dict[str, Callable[[tuple[int, ...]], int]] = {
    "nf4": _nf4_bytes,  # 4.5 bits / param
    "int8": _int8_bytes,  # 8 bits / param + 32 bits / row
    "bf16": lambda s: 2 * _numel(s),
    "fp16": lambda s: 2 * _numel(s),
    "fp32": lambda s: 4 * _numel(s),
}

# safetensors dtype -> (format name, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bf16", 2),
    "F16": ("fp16", 2),
    "F32": ("fp32", 4),
    "F64": ("fp64", 8),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("fp8_e4m3", 1),
    "F8_E5M2": ("fp8_e5m2", 1),
}


# ---------------------------------------------------------------------------------------------------------------
# Model geometry
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes the planner needs beyond tensor bytes (KV, GDN state, routing, FLOPs). Names as in config.json."""

    num_hidden_layers: int
    full_attention_layers: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    tie_word_embeddings: bool = False
    attn_output_gate: bool = True  # q_proj also produces the output gate (Qwen3.5 / Clover)
    clover_extras: bool = False  # the 4 Clover block-diffusion tensors per GDN layer

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        full = set(self.full_attention_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in full)

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every full-attention layer."""
        return len(self.full_attention_layers) * 2 * self.num_key_value_heads * self.head_dim * 2

    @property
    def gdn_state_bytes(self) -> int:
        """Per sequence: fp32 recurrent state S [Hv, dk, dv] + bf16 conv state [conv_dim, K-1] per GDN layer."""
        s = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        conv = self.conv_dim * (self.linear_conv_kernel_dim - 1) * 2
        return len(self.gdn_layers) * (s + conv)

    @classmethod
    def from_config(cls, cfg: Any, clover_extras: bool | None = None) -> "ModelGeometry":
        """From an :class:`engine.config.CloverConfig`."""
        full = tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        return cls(
            num_hidden_layers=cfg.num_hidden_layers,
            full_attention_layers=full,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads,
            linear_key_head_dim=cfg.linear_key_head_dim,
            linear_value_head_dim=cfg.linear_value_head_dim,
            linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            tie_word_embeddings=cfg.tie_word_embeddings,
            clover_extras=cfg.is_diffusion if clover_extras is None else clover_extras,
        )


_QWEN35_35B_A3B = ModelGeometry(
    num_hidden_layers=40,
    full_attention_layers=tuple(range(3, 40, 4)),
    hidden_size=2048,
    vocab_size=248_320,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)

# Known shapes for `manifest_for_shape` / `clover-desk plan --shape` (architecture.md sections 1.2 and 6).
SHAPES: dict[str, ModelGeometry] = {
    "clover-35b-a3b": ModelGeometry(**{**asdict(_QWEN35_35B_A3B), "clover_extras": True}),
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
}


# ---------------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PREFIXES = ("model.language_model.", "model.")
_EXCLUDED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_CLOVER_MARKERS = ("bd_history", "bd_logit_scale", "weight_right")


def strip_prefix(name: str) -> str | None:
    """Checkpoint name -> text-model name (``layers.0...``, ``embed_tokens.weight``, ``lm_head.weight``), or None
    for a tensor the text model does not load (vision tower, MTP block)."""
    if name.startswith(_EXCLUDED_PREFIXES):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def classify(name: str) -> tuple[str, int | None]:
    """(kind, layer index or None) of a text-model tensor name (prefix already stripped)."""
    match = _LAYER_RE.search(name)
    layer = int(match.group(1)) if match else None
    module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    last = module.rsplit(".", 1)[-1]
    if ".mlp.experts." in f".{name}":
        kind = "expert"
    elif any(marker in name for marker in _CLOVER_MARKERS):
        kind = "clover_extra"
    elif "shared_expert" in name:
        kind = "shared_expert"
    elif module.endswith("mlp.gate"):
        kind = "router"
    elif last.endswith("norm"):
        kind = "norm"
    elif "linear_attn." in name:
        kind = "gdn"
    elif "self_attn." in name:
        kind = "attn"
    elif name.startswith("embed_tokens."):
        kind = "embed"
    elif name.startswith("lm_head."):
        kind = "lm_head"
    else:
        kind = "other"
    return kind, layer


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as stored: ``format`` is a key of :data:`FORMAT_BYTES` or a safetensors dtype name."""

    name: str
    shape: tuple[int, ...]
    format: str
    bytes: int
    layer: int | None
    kind: str

    @property
    def numel(self) -> int:
        return _numel(self.shape)


@dataclass(frozen=True)
class Manifest:
    """Every tensor of the text model with its exact bytes, plus the geometry for KV / state / routing sizes."""

    entries: tuple[TensorEntry, ...]
    geometry: ModelGeometry
    source: str
    policy: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def by_name(self) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries}

    def total_bytes(self, kinds: Iterable[str] | None = None) -> int:
        wanted = set(KINDS if kinds is None else kinds)
        return sum(e.bytes for e in self.entries if e.kind in wanted)

    def total_params(self, kinds: Iterable[str] | None = None) -> int:
        wanted = set(KINDS if kinds is None else kinds)
        return sum(e.numel for e in self.entries if e.kind in wanted)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for e in self.entries:
            out[e.kind] += e.bytes
        return out

    def params_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for e in self.entries:
            out[e.kind] += e.numel
        return out

    def expert_layer_bytes(self) -> dict[int, int]:
        """Bytes of all routed experts of each MoE layer."""
        out: dict[int, int] = {}
        for e in self.entries:
            if e.kind == "expert":
                if e.layer is None:
                    raise PlanError(f"{self.source}: expert tensor {e.name!r} has no layer index")
                out[e.layer] = out.get(e.layer, 0) + e.bytes
        return dict(sorted(out.items()))

    def expert_layer_params(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for e in self.entries:
            if e.kind == "expert" and e.layer is not None:
                out[e.layer] = out.get(e.layer, 0) + e.numel
        return dict(sorted(out.items()))


# Tensors the policy quantizes, by kind, matched on the module name (mirrors ``engine.quant.make_policy``'s table;
# everything else - router, norms, A_log, dt_bias, conv1d (+ Clover weight_right), GDN in_proj_a/b, the Clover
# extras, the shared-expert gate and the embedding - keeps its stored dtype).
_QUANTIZED_MODULES: dict[str, re.Pattern[str]] = {
    "experts": re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$|mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"),
    "shared_expert": re.compile(r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$"),
    "attention": re.compile(
        r"linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)\.weight$|self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$"
    ),
    "lm_head": re.compile(r"(^|\.)lm_head\.weight$"),
}


@dataclass(frozen=True)
class QuantPolicy:
    """Storage format of each quantized group (field names = ``engine.quant.make_policy`` arguments).

    ``attention`` covers the full-attention and the Gated DeltaNet projections. Quantized formats apply only to
    tensors with >= 2 dims and an even size (as in ``engine.quant``); unmatched tensors keep their stored dtype.

    Defaults, by the numbers (35B-A3B shapes, 16K context; ``tests/test_planner.py`` pins them):
    * routed experts are 93 % of the weights and only 8 of 256 run per token: NF4 (4.5 bits), 16.9 GiB.
    * dense projections (attention + GDN + shared experts, 1.41 B params): int8 1.42 GB, NF4 0.80 GB. The 0.62 GB
      is 1.4 expert layers: at 16 GiB NF4 keeps 20 layers resident against int8's 18, for 8 % (diffusion) to
      11 % (AR) more hardware-bound speed, 1-6 % with today's eager overheads (18 % diffusion at 8 GiB). int8 is
      the default anyway: this path runs for every token of every denoising pass, and block diffusion commits a
      position only at >= 0.95 confidence, so noise here costs tokens per pass; a 10 % lower TPF would cancel
      the whole NF4 gain, and expert error, by contrast, is averaged over 8 experts and a shared one.
      ``QuantPolicy(attention="nf4", shared_expert="nf4")`` is the small-card option. Same defaults as
      ``engine.quant.make_policy``.
    * lm_head int8: 0.51 GB instead of 1.02 GB bf16, above 4 bits as llama.cpp's Q4_K_M keeps its output head.
    """

    experts: str = "nf4"
    attention: str = "int8"
    shared_expert: str = "int8"
    lm_head: str = "int8"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value not in FORMAT_BYTES:
                raise PlanError(f"QuantPolicy.{name} = {value!r} is not a known format ({', '.join(FORMAT_BYTES)})")

    def format_for(self, name: str, shape: tuple[int, ...], stored: str) -> str:
        """The storage format of one tensor under this policy."""
        for group, rx in _QUANTIZED_MODULES.items():
            if rx.search(name):
                fmt = getattr(self, group)
                if fmt in ("nf4", "int8") and (len(shape) < 2 or _numel(shape) % 2):
                    return stored
                return fmt
        return stored


def _text_tensors(geo: ModelGeometry) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, stored dtype) of every text-model tensor of a geometry (architecture.md section 1.2)."""
    d, v = geo.hidden_size, geo.vocab_size
    yield "embed_tokens.weight", (v, d), "bf16"
    full = set(geo.full_attention_layers)
    for i in range(geo.num_hidden_layers):
        p = f"layers.{i}."
        yield p + "input_layernorm.weight", (d,), "bf16"
        yield p + "post_attention_layernorm.weight", (d,), "bf16"
        if i in full:
            q_rows = geo.q_dim * (2 if geo.attn_output_gate else 1)
            kv = geo.num_key_value_heads * geo.head_dim
            yield p + "self_attn.q_proj.weight", (q_rows, d), "bf16"
            yield p + "self_attn.k_proj.weight", (kv, d), "bf16"
            yield p + "self_attn.v_proj.weight", (kv, d), "bf16"
            yield p + "self_attn.o_proj.weight", (d, geo.q_dim), "bf16"
            yield p + "self_attn.q_norm.weight", (geo.head_dim,), "bf16"
            yield p + "self_attn.k_norm.weight", (geo.head_dim,), "bf16"
        else:
            hv, k = geo.linear_num_value_heads, geo.linear_conv_kernel_dim
            yield p + "linear_attn.in_proj_qkv.weight", (geo.conv_dim, d), "bf16"
            yield p + "linear_attn.in_proj_z.weight", (geo.value_dim, d), "bf16"
            yield p + "linear_attn.in_proj_b.weight", (hv, d), "bf16"
            yield p + "linear_attn.in_proj_a.weight", (hv, d), "bf16"
            yield p + "linear_attn.conv1d.weight", (geo.conv_dim, 1, k), "bf16"
            yield p + "linear_attn.dt_bias", (hv,), "bf16"
            yield p + "linear_attn.A_log", (hv,), "fp32"
            yield p + "linear_attn.norm.weight", (geo.linear_value_head_dim,), "fp32"
            yield p + "linear_attn.out_proj.weight", (d, geo.value_dim), "bf16"
            if geo.clover_extras:  # architecture.md section 5.1, primary shapes
                yield p + "linear_attn.bd_history.weight", (hv, d), "bf16"
                yield p + "linear_attn.bd_history.bias", (hv,), "bf16"
                yield p + "linear_attn.bd_logit_scale.weight", (hv,), "bf16"
                yield p + "linear_attn.conv1d.weight_right", (geo.conv_dim, k), "bf16"
        e, inter, shared = geo.num_experts, geo.moe_intermediate_size, geo.shared_expert_intermediate_size
        yield p + "mlp.gate.weight", (e, d), "bf16"
        yield p + "mlp.experts.gate_up_proj", (e, 2 * inter, d), "bf16"
        yield p + "mlp.experts.down_proj", (e, d, inter), "bf16"
        yield p + "mlp.shared_expert.gate_proj.weight", (shared, d), "bf16"
        yield p + "mlp.shared_expert.up_proj.weight", (shared, d), "bf16"
        yield p + "mlp.shared_expert.down_proj.weight", (d, shared), "bf16"
        yield p + "mlp.shared_expert_gate.weight", (1, d), "bf16"
    yield "norm.weight", (d,), "bf16"
    if not geo.tie_word_embeddings:
        yield "lm_head.weight", (v, d), "bf16"


def _first(entries: dict[str, TensorEntry], suffix: str) -> TensorEntry | None:
    for name in sorted(entries, key=lambda n: (len(n), n)):
        if name.endswith(suffix):
            return entries[name]
    return None


def geometry_from_entries(entries: Iterable[TensorEntry], experts_per_tok: int | None = None) -> ModelGeometry:
    """Derive the geometry from tensor shapes alone (when no config.json is at hand).

    Two numbers are not in any shape: the routing top-k (``experts_per_tok``, default 8 = the Qwen3.5 value) and
    the GDN key head count, taken as key_dim / value head dim (key and value heads have equal dims in Qwen3.5)."""
    by_name = {e.name: e for e in entries}
    if not by_name:
        raise PlanError("an empty manifest has no geometry")
    layers = sorted({e.layer for e in by_name.values() if e.layer is not None})
    n_layers = layers[-1] + 1 if layers else 0
    full = tuple(sorted({e.layer for e in by_name.values() if e.layer is not None and e.kind == "attn"}))

    def dim(suffix: str, axis: int, default: int = 0) -> int:
        e = _first(by_name, suffix)
        if e is None:
            return default
        try:
            return int(e.shape[axis])
        except IndexError:
            return default

    hidden = dim("embed_tokens.weight", 1) or dim("lm_head.weight", 1) or dim("input_layernorm.weight", 0)
    vocab = dim("embed_tokens.weight", 0) or dim("lm_head.weight", 0)
    head_dim = dim("self_attn.q_norm.weight", 0)
    q_dim = dim("self_attn.o_proj.weight", 1)
    q_rows = dim("self_attn.q_proj.weight", 0)
    kv_rows = dim("self_attn.k_proj.weight", 0)
    hv = dim("linear_attn.A_log", 0)
    dv = dim("linear_attn.norm.weight", 0)
    conv_dim = dim("linear_attn.conv1d.weight", 0)
    kernel = dim("linear_attn.conv1d.weight", -1, 4)
    value_dim = hv * dv
    key_dim = (conv_dim - value_dim) // 2 if conv_dim > value_dim else 0
    router = _first(by_name, "mlp.gate.weight")
    fused = _first(by_name, "mlp.experts.down_proj")
    if router is not None:
        n_experts = int(router.shape[0])
    elif fused is not None:
        n_experts = int(fused.shape[0])
    else:
        ids = {int(m.group(1)) for n in by_name for m in [re.search(r"mlp\.experts\.(\d+)\.", n)] if m}
        n_experts = len(ids)
    if fused is not None:
        inter = int(fused.shape[-1])
    else:
        inter = dim("mlp.experts.0.down_proj.weight", 1)
    top_k = experts_per_tok if experts_per_tok is not None else min(8, n_experts)
    return ModelGeometry(
        num_hidden_layers=n_layers,
        full_attention_layers=full,
        hidden_size=hidden,
        vocab_size=vocab,
        num_attention_heads=q_dim // head_dim if head_dim else 0,
        num_key_value_heads=kv_rows // head_dim if head_dim else 0,
        head_dim=head_dim,
        linear_num_key_heads=key_dim // dv if dv else 0,
        linear_num_value_heads=hv,
        linear_key_head_dim=dv,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=dim("mlp.shared_expert.gate_proj.weight", 0),
        tie_word_embeddings=not any(e.kind == "lm_head" for e in by_name.values()),
        attn_output_gate=bool(q_dim) and q_rows == 2 * q_dim,
        clover_extras=any(e.kind == "clover_extra" for e in by_name.values()),
    )


def manifest_for_geometry(geo: ModelGeometry, policy: QuantPolicy | None = None, source: str = "geometry") -> Manifest:
    """The manifest a geometry would have after quantization under ``policy`` (default :class:`QuantPolicy`)."""
    policy = policy or QuantPolicy()
    entries = []
    for name, shape, stored in _text_tensors(geo):
        kind, layer = classify(name)
        fmt = policy.format_for(name, shape, stored)
        entries.append(TensorEntry(name, shape, fmt, FORMAT_BYTES[fmt](shape), layer, kind))
    return Manifest(tuple(entries), geo, source, asdict(policy))


def manifest_for_shape(shape: str = "clover-35b-a3b", policy: QuantPolicy | None = None) -> Manifest:
    """The known shapes of a named model (see :data:`SHAPES`), with bytes under ``policy``."""
    geo = SHAPES.get(shape.lower())
    if geo is None:
        raise PlanError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    return manifest_for_geometry(geo, policy, source=f"shape:{shape.lower()}")


# ---- real files ----

MAX_HEADER_BYTES = 100 * MiB


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (8-byte little-endian length + JSON). Never reads the data."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file ({len(head)} bytes)")
            (length,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(f"{path}: header length {length} does not fit the file of {size} bytes")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_size = size - 8 - length
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            shape = [int(x) for x in meta["shape"]]
            dtype = str(meta["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if not 0 <= begin <= end <= data_size:
            raise CheckpointError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] outside the data ({data_size} B)")
        if dtype in SAFETENSORS_DTYPES and (end - begin) != _numel(shape) * SAFETENSORS_DTYPES[dtype][1]:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {dtype}")
    return header


def _checkpoint_shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        shards = sorted({str(v) for v in weight_map.values()})
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no model.safetensors.index.json and no *.safetensors files")
    return shards


def _geometry_near(directory: Path, what: str) -> ModelGeometry:
    from engine.config import load_config  # stdlib-only module

    try:
        cfg = load_config(directory)
    except ConfigError as exc:
        raise PlanError(f"{what}: the planner needs the model's config.json ({exc})") from None
    return ModelGeometry.from_config(cfg)


def manifest_from_checkpoint(model_dir: str | Path) -> Manifest:
    """Read every shard's safetensors header (never the data) of a Hugging Face model folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    geo = _geometry_near(model_dir, str(model_dir))
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    for shard in _checkpoint_shards(model_dir):
        for raw_name, meta in read_safetensors_header(shard).items():
            if raw_name == "__metadata__":
                continue
            name = strip_prefix(raw_name)
            if name is None:
                continue
            if name in seen:
                raise CheckpointError(f"{shard}: tensor {name!r} appears in more than one shard")
            seen.add(name)
            begin, end = meta["data_offsets"]
            fmt = SAFETENSORS_DTYPES.get(meta["dtype"], (meta["dtype"].lower(), 0))[0]
            kind, layer = classify(name)
            entries.append(TensorEntry(name, tuple(int(x) for x in meta["shape"]), fmt, int(end) - int(begin), layer, kind))
    if not entries:
        raise CheckpointError(f"{model_dir}: the checkpoint holds no text-model tensors")
    return Manifest(tuple(entries), geo, str(model_dir))


def manifest_from_dict(
    data: dict[str, Any], source: str = "manifest", geometry: ModelGeometry | None = None
) -> Manifest:
    """A :class:`Manifest` from the cache-manifest dict (``{"version": 1, "policy", "source", "tensors"}``), as
    written by the quantization helper or by ``engine.offload.manifest_from_model``.

    Without ``geometry`` it is derived from the shapes (:func:`geometry_from_entries`), with the routing top-k from
    ``source["num_experts_per_tok"]`` when present."""
    if not isinstance(data, dict) or data.get("version") != 1:
        version = data.get("version") if isinstance(data, dict) else None
        raise PlanError(f"{source}: expected a manifest object with version 1, got version {version!r}")
    tensors = data.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise PlanError(f"{source}: field 'tensors' is missing or empty")
    entries = []
    for raw_name, meta in tensors.items():
        name = strip_prefix(str(raw_name))
        if name is None:
            continue
        try:
            shape = tuple(int(x) for x in meta["shape"])
            fmt = str(meta["format"])
            nbytes = int(meta["bytes"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{source}: tensor {raw_name!r} needs 'shape', 'format' and 'bytes', got {meta!r}") from None
        if fmt not in FORMAT_BYTES:
            raise PlanError(f"{source}: tensor {raw_name!r} has unknown format {fmt!r} (known: {', '.join(FORMAT_BYTES)})")
        if nbytes < 0:
            raise PlanError(f"{source}: tensor {raw_name!r} has negative bytes {nbytes}")
        kind, layer = classify(name)
        entries.append(TensorEntry(name, shape, fmt, nbytes, layer, kind))
    src = data.get("source") if isinstance(data.get("source"), dict) else {}
    if geometry is None:
        top_k = src.get("num_experts_per_tok")
        geometry = geometry_from_entries(entries, int(top_k) if isinstance(top_k, int) else None)
    policy = data.get("policy") if isinstance(data.get("policy"), dict) else None
    return Manifest(tuple(entries), geometry, source, policy)


def manifest_from_quantized_cache(manifest_json_path: str | Path) -> Manifest:
    """Read the quantization helper's manifest JSON (``{"version": 1, "policy", "source", "tensors"}``).

    The geometry comes from ``config.json`` next to the manifest file, else from ``source["model_dir"]``, else from
    the tensor shapes."""
    path = Path(manifest_json_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{path}: quantized-cache manifest not found") from None
    except IsADirectoryError:
        raise PlanError(f"{path}: is a directory, expected the manifest JSON file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from None
    src = data.get("source") if isinstance(data, dict) and isinstance(data.get("source"), dict) else {}
    geometry = None
    for directory in (path.parent, Path(str(src["model_dir"])) if src.get("model_dir") else None):
        if directory is not None and (directory / "config.json").exists():
            geometry = _geometry_near(directory, str(path))
            break
    return manifest_from_dict(data, str(path), geometry)


_FLOAT_FORMATS = ("bf16", "fp16", "fp32")
QUANT_MANIFEST_NAME = "manifest.json"  # the quantized cache's manifest inside its folder


def quantize_manifest(manifest: Manifest, policy: QuantPolicy | None = None) -> Manifest:
    """The manifest after quantization under ``policy`` (default :class:`QuantPolicy`): float tensors the policy
    quantizes take its format and bytes; everything else is unchanged. What a checkpoint will occupy once loaded
    through the quantized cache."""
    policy = policy or QuantPolicy()
    entries = []
    for e in manifest:
        fmt = policy.format_for(e.name, e.shape, e.format) if e.format in _FLOAT_FORMATS else e.format
        entries.append(e if fmt == e.format else dataclasses.replace(e, format=fmt, bytes=FORMAT_BYTES[fmt](e.shape)))
    return Manifest(tuple(entries), manifest.geometry, manifest.source, asdict(policy))


def manifest_for_model_dir(path: str | Path, policy: QuantPolicy | None = None, *, as_stored: bool = False) -> Manifest:
    """The manifest to plan a model with: a quantized cache's ``manifest.json`` (the file, or the cache folder
    ``<model>/.clover-cache/<policy hash>/`` holding it beside ``weights.safetensors``) as written; a Hugging Face
    checkpoint folder as it will be after quantization under ``policy`` (``as_stored=True``: the bytes in the
    files)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        return manifest_from_quantized_cache(path)
    if (path / QUANT_MANIFEST_NAME).is_file():
        return manifest_from_quantized_cache(path / QUANT_MANIFEST_NAME)
    stored = manifest_from_checkpoint(path)
    return stored if as_stored else quantize_manifest(stored, policy)


# ---------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------

CUDA_CONTEXT_BYTES = 500 * MiB  # CUDA context + cuBLAS handles and workspaces (torch, recent drivers)
ALLOCATOR_SLACK_BYTES = 256 * MiB  # caching-allocator fragmentation headroom
STAGING_BYTES = 64 * MiB  # pinned host staging: the offload staging ring + weight-upload buffers at load
PREFILL_MAX_TOKENS = 2048  # engine.model.CloverModel.max_pass_tokens: the longest prefill forward
PREFILL_WORKSPACE_BYTES = 512 * MiB  # what the chunk-dependent part of one prefill forward may take
ACTIVATION_BUFFERS = 8  # live fp32 [tokens, widest projection] buffers inside one layer
ATTENTION_PATHS = ("math", "efficient")
EXPERT_DEQUANT_EXPERTS = 16  # experts dequantized to bf16 at once on CUDA (engine.experts.GROUP_BYTES: 96 MiB for 35B-A3B)

CORESET_DISTINCT_EXPERTS_PER_PASS = 30.0  # [assumption] DES / MoE-Spec: 30-50 % of the raw union

BREAKDOWN_KEYS = ("non_expert", "resident_experts", "expert_slots", "kv_cache", "gdn_state", "workspace", "reserve")


@dataclass(frozen=True)
class Roofline:
    """The speed model's inputs that are not hardware. Every default is an assumption to calibrate with
    ``clover-desk bench speed`` / ``bench offload``; sources in offload-anchors.md sections 2.3-2.4.

    Time per pass = max(VRAM traffic / VRAM bandwidth, PCIe bytes / PCIe bandwidth, FLOPs / compute)
                    + layers x ``layer_overhead_us`` + experts computed x ``expert_overhead_us``.
    The overheads are launch and Python costs of an eager PyTorch forward (no CUDA graphs): per layer (norms,
    projections, GDN / attention, router, top-k, grouping) and per distinct expert computed (``engine.quant.
    routed_forward`` loops over experts: two dequantizes, two GEMMs, SiLU, product, copy).
    """

    tokens_per_pass: float = 3.0  # committed per denoising pass: LLaDA2-like TPF 2.5-3.2 (architecture.md 4.1)
    distinct_experts_per_pass: float = 70.0  # per layer, 32-token pass: LLaDA2.0-mini measured 69.5 of 256
    block_reuse_factor: float = 1.3  # block working set / per-pass union across one block's passes
    commit_pass: bool = True  # one extra forward per block writes the caches (architecture.md 4.1; 5.6 folds it)
    compute_tflops: float = 30.0  # effective bf16 TFLOPS of a 16 GB RTX card on 32-token GEMMs
    layer_overhead_us: float = 250.0
    expert_overhead_us: float = 60.0
    l2_bytes: int = 48 * MiB  # a dequantized weight larger than this round-trips through VRAM (4070 Ti S: 48 MB)

    @classmethod
    def with_coreset(cls, **kwargs: Any) -> "Roofline":
        """Clover's 90 %-mass block coreset: ~25-35 distinct experts per layer and pass (offload-anchors 2.3)."""
        return cls(**{"distinct_experts_per_pass": CORESET_DISTINCT_EXPERTS_PER_PASS, **kwargs})

    def __post_init__(self) -> None:
        for name in ("tokens_per_pass", "distinct_experts_per_pass", "block_reuse_factor", "compute_tflops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise PlanError(f"Roofline.{name} must be positive, got {value!r}")
        if self.block_reuse_factor < 1:
            raise PlanError(f"Roofline.block_reuse_factor must be >= 1, got {self.block_reuse_factor!r}")
        for name in ("layer_overhead_us", "expert_overhead_us", "l2_bytes"):
            if getattr(self, name) < 0:
                raise PlanError(f"Roofline.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Plan:
    """Where every byte goes for one model, budget and context. ``vram_bytes == sum(vram_breakdown.values())``.

    When ``fits`` is False the layout is the one the budget was measured against (the minimum layout when VRAM is
    short, the layout VRAM alone would pick when RAM is short) and ``reason`` says why. ``min_vram_bytes`` is the
    smallest VRAM budget that fits (with the RAM given), also when the plan fits; None when no VRAM budget can fit
    the RAM given.
    """

    resident_expert_layers: list[int]
    streamed_expert_layers: list[int]
    slot_pool_experts: int
    vram_bytes: int
    vram_breakdown: dict[str, int]
    ram_bytes: int
    fits: bool
    reason: str
    min_vram_bytes: int | None
    predicted_tok_s: dict[str, float]
    assumptions: dict[str, Any]
    # Beyond the DESIGN.md contract:
    budget_vram_bytes: int = 0
    ram_available_bytes: int | None = None
    ram_breakdown: dict[str, int] = field(default_factory=dict)
    ctx_tokens: int = 0
    prefill_chunk_tokens: int = 0  # the engine must not prefill more tokens per forward (its scratch is planned)
    model: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Facts:
    """What make_plan derives once from a manifest."""

    geo: ModelGeometry
    layers: tuple[int, ...]  # MoE layers, ascending
    layer_bytes: dict[int, int]
    slot_bytes: int
    expert_params: float  # params of one routed expert
    non_expert_gpu: int
    non_expert_gpu_params: int
    embed_ram: int
    dequant_dense_max_params: int  # largest quantized non-expert matrix on the GPU (dequantized whole per forward)
    dequant_dense_params: tuple[int, ...]  # every quantized non-expert matrix on the GPU
    experts_quantized: bool


def _facts(manifest: Manifest) -> _Facts:
    geo = manifest.geometry
    layer_bytes = manifest.expert_layer_bytes()
    e = geo.num_experts
    if layer_bytes and e <= 0:
        raise PlanError(f"{manifest.source}: num_experts is {e} but the manifest has expert tensors")
    slot = max((-(-b // e) for b in layer_bytes.values()), default=0)
    # from the geometry, not the shapes: a packed manifest may list byte-shaped tensors
    expert_params = float(3 * geo.hidden_size * geo.moe_intermediate_size) if layer_bytes else 0.0
    tied_embed_on_gpu = geo.tie_word_embeddings and not any(x.kind == "lm_head" for x in manifest)
    gpu = [x for x in manifest if x.kind != "expert" and (x.kind != "embed" or tied_embed_on_gpu)]
    dequant = tuple(x.numel for x in gpu if x.format in ("nf4", "int8"))
    return _Facts(
        geo=geo,
        layers=tuple(layer_bytes),
        layer_bytes=layer_bytes,
        slot_bytes=slot,
        expert_params=expert_params,
        non_expert_gpu=sum(x.bytes for x in gpu),
        non_expert_gpu_params=sum(x.numel for x in gpu),
        embed_ram=0 if tied_embed_on_gpu else manifest.total_bytes(["embed"]),
        dequant_dense_max_params=max(dequant, default=0),
        dequant_dense_params=dequant,
        experts_quantized=any(x.kind == "expert" and x.format in ("nf4", "int8") for x in manifest),
    )


def spread_resident(layers: tuple[int, ...] | list[int], n_resident: int) -> list[int]:
    """Keep ``n_resident`` of ``layers`` resident; the streamed ones are spread evenly over the depth."""
    n = len(layers)
    if not 0 <= n_resident <= n:
        raise PlanError(f"n_resident {n_resident} is outside 0..{n}")
    n_streamed = n - n_resident
    streamed_pos = {int((i + 0.5) * n / n_streamed) for i in range(n_streamed)}
    return [layer for pos, layer in enumerate(layers) if pos not in streamed_pos]


def _widest(geo: ModelGeometry) -> int:
    return max(
        geo.conv_dim + geo.value_dim if geo.gdn_layers else 0,  # in_proj_qkv + in_proj_z outputs
        geo.q_dim * 2,
        geo.hidden_size,
        geo.shared_expert_intermediate_size * 2,
        geo.moe_intermediate_size * 2,
    )


def _prefill_parts(geo: ModelGeometry, chunk: int, ctx: int, attention: str) -> dict[str, int]:
    """Scratch of one prefill forward of ``chunk`` tokens whose last token sees ``ctx`` keys.

    Block-mode prefill passes a block-causal bool mask to SDPA with ``enable_gqa`` (engine.model). In torch 2.13
    GQA runs only on the flash and math kernels and flash takes no mask, so this is the *math* kernel, which keeps
    its intermediates in fp32: scores and probabilities [Hq, T, S], K and V expanded to Hq heads, and the mask as
    an fp32 bias. ``attention="efficient"`` is the same pass on a kernel that materializes none of that."""
    full = bool(geo.full_attention_layers)
    math_path = full and attention == "math"
    return {
        "activations": chunk * _widest(geo) * 4 * ACTIVATION_BUFFERS,
        "attn_scores": 2 * geo.num_attention_heads * chunk * ctx * 4 if math_path else 0,
        "attn_mask": chunk * ctx * (5 if math_path else 1) if full else 0,
        "attn_kv_expanded": 2 * geo.num_attention_heads * ctx * geo.head_dim * 4 if math_path else 0,
    }


def choose_prefill_chunk(geo: ModelGeometry, ctx: int, block: int, attention: str = "math") -> int:
    """The longest prefill forward (a multiple of ``block``, at most :data:`PREFILL_MAX_TOKENS`) whose
    chunk-dependent scratch fits :data:`PREFILL_WORKSPACE_BYTES`; one block at least."""
    top = max(block, PREFILL_MAX_TOKENS // block * block)
    for chunk in range(top, block - 1, -block):
        parts = _prefill_parts(geo, chunk, ctx, attention)
        if sum(parts.values()) - parts["attn_kv_expanded"] <= PREFILL_WORKSPACE_BYTES:
            return chunk
    return block


def _workspace(f: _Facts, ctx: int, block: int, attention: str) -> tuple[dict[str, int], dict[str, Any]]:
    """(workspace parts summing to the workspace, details). Prefill and decoding never run at once: the larger
    of the two counts, plus the dequantize buffers both use."""
    geo = f.geo
    chunk = choose_prefill_chunk(geo, ctx, block, attention)
    prefill = _prefill_parts(geo, chunk, ctx, attention)
    decode = {
        "logits": block * geo.vocab_size * 4,  # fp32 logits of one block
        "activations": block * _widest(geo) * 4 * ACTIVATION_BUFFERS,
        # a single-block pass needs no mask, so SDPA uses flash attention: no score scratch
    }
    parts = {
        "prefill_or_decode": max(sum(prefill.values()), sum(decode.values())),
        # engine.quant.QuantLinear dequantizes its whole weight to bf16 per forward: the largest one (lm_head
        # when quantized: 0.95 GiB for 35B-A3B) is alive while it runs
        "dequant_dense": f.dequant_dense_max_params * 2,
        "dequant_experts": int(EXPERT_DEQUANT_EXPERTS * f.expert_params * 2) if f.experts_quantized else 0,
    }
    details = {"prefill_chunk_tokens": chunk, "attention_path": attention, "prefill": prefill, "decode": decode}
    return parts, details


def _min_slots(n_streamed: int, num_experts: int, min_slot_experts: int | None) -> int:
    if n_streamed == 0:
        return 0
    wanted = 2 * num_experts if min_slot_experts is None else min_slot_experts
    return min(n_streamed * num_experts, wanted)


def _predict(
    f: _Facts,
    streamed: list[int],
    slots: int,
    ctx: int,
    block: int,
    hw: Hardware,
    rl: Roofline,
    prefill_chunk: int,
    attention: str,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Predicted tokens per second for AR decoding, block diffusion and prompt prefill, and the derived numbers
    that went in."""
    geo = f.geo
    e, k = geo.num_experts, geo.num_experts_per_tok
    n_moe, n_layers, s = len(f.layers), geo.num_hidden_layers, len(streamed)
    eb_all = sum(f.layer_bytes.values()) / (n_moe * e) if n_moe else 0.0  # mean bytes of one expert
    eb_str = sum(f.layer_bytes[x] for x in streamed) / (s * e) if s else 0.0
    vram_bw, pcie_bw, flops = hw.vram_gbps * GB, hw.pcie_gbps * GB, rl.compute_tflops * 1e12
    # A dequantized weight larger than L2 is written to VRAM and read back by the GEMM.
    dequant_traffic = sum(4 * n for n in f.dequant_dense_params if 2 * n > rl.l2_bytes)
    base_read = f.non_expert_gpu + dequant_traffic + geo.kv_bytes_per_token * ctx + 2 * geo.gdn_state_bytes
    attn_flops_per_token = 4 * ctx * geo.q_dim * len(geo.full_attention_layers)  # QK^T and PV over the context
    active = f.non_expert_gpu_params + k * n_moe * f.expert_params
    layer_oh, expert_oh = rl.layer_overhead_us * 1e-6, rl.expert_overhead_us * 1e-6

    # AR: one token per pass; its k experts per streamed layer cross PCIe unless still in the pool.
    # Hit rate: uniform routing, LRU pool holding the last slots / (k s) tokens' experts.
    hit = 1.0 - (1.0 - k / e) ** (slots / (k * s)) if s and e else 0.0
    ar_read = base_read + k * n_moe * eb_all
    ar_pcie = s * k * eb_str * (1.0 - hit)
    t_ar_bound = max(ar_read / vram_bw, ar_pcie / pcie_bw, (2 * active + attn_flops_per_token) / flops)
    t_ar = t_ar_bound + n_layers * layer_oh + n_moe * k * expert_oh

    # Diffusion: block / TPF denoising passes (+ the commit pass), each over all `block` positions.
    dp = min(float(e), float(block * k), rl.distinct_experts_per_pass)
    db = min(float(e), dp * rl.block_reuse_factor)
    n_pass = block / rl.tokens_per_pass + (1.0 if rl.commit_pass else 0.0)
    # Streamed layers whose block working set stays pinned in the pool for the whole block (engine.offload pins
    # a block's slots); the rest reload their per-pass union every pass, with two unions in flight.
    if s == 0 or slots >= s * math.ceil(db):
        cached = s
    else:
        cached = min(s, max(0, slots - 2 * math.ceil(dp)) // math.ceil(db))
    pass_read = base_read + n_moe * dp * eb_all
    pass_flops = block * (2 * active + attn_flops_per_token)
    gpu_pass = max(pass_read / vram_bw, pass_flops / flops)
    pass_oh = n_layers * layer_oh + n_moe * dp * expert_oh
    pcie_first = s * dp * eb_str  # every streamed layer loads its first pass's union
    later = max(n_pass - 1.0, 1.0)
    pcie_later = (cached * (db - dp) / later + (s - cached) * dp) * eb_str
    t_block_bound = max(gpu_pass, pcie_first / pcie_bw) + (n_pass - 1.0) * max(gpu_pass, pcie_later / pcie_bw)
    t_block = t_block_bound + n_pass * pass_oh
    # "ar" / "diffusion" / "prefill": with the eager-PyTorch overheads; "*_bound": the hardware roofline alone (what
    # a fused, graph-captured engine approaches).
    # Prefill: forwards of `prefill_chunk` tokens over a prompt that fills the context (mean position ctx / 2).
    # A chunk routes chunk x k token-slots, touching E (1 - (1 - k/E)^chunk) experts per layer (uniform routing);
    # streamed layers reload theirs every forward (the pool cannot hold every streamed layer's full set). The math
    # attention kernel also writes and reads its fp32 scores and expanded K/V.
    c, mean_ctx = prefill_chunk, ctx / 2
    dc = e * (1.0 - (1.0 - k / e) ** c) if e else 0.0
    n_full = len(geo.full_attention_layers)
    math_traffic = 0.0
    if attention == "math" and n_full:
        math_traffic = n_full * (4 * geo.num_attention_heads * c * mean_ctx * 4 + 4 * geo.num_attention_heads * mean_ctx * geo.head_dim * 4)
    pre_read = (
        f.non_expert_gpu + dequant_traffic + geo.kv_bytes_per_token * mean_ctx + 2 * geo.gdn_state_bytes
        + n_moe * dc * eb_all + math_traffic
    )
    pre_flops = c * (2 * active + 4 * mean_ctx * geo.q_dim * n_full)
    t_pre_bound = max(pre_read / vram_bw, s * dc * eb_str / pcie_bw, pre_flops / flops)
    t_pre = t_pre_bound + n_layers * layer_oh + n_moe * dc * expert_oh

    tiny = 1e-12  # a pass always takes some time; guards a zero-byte, zero-overhead toy model
    tok = {
        "ar": 1.0 / max(t_ar, tiny),
        "diffusion": block / max(t_block, tiny),
        "ar_bound": 1.0 / max(t_ar_bound, tiny),
        "diffusion_bound": block / max(t_block_bound, tiny),
        "prefill": c / max(t_pre, tiny),
    }
    derived = {
        "ar_expert_hit_rate": round(hit, 4),
        "ar_pcie_bytes_per_token": int(ar_pcie),
        "ar_vram_bytes_per_token": int(ar_read),
        "distinct_experts_per_pass": dp,
        "distinct_experts_per_block_layer": db,
        "passes_per_block": round(n_pass, 4),
        "cached_block_layers": cached,
        "diffusion_pcie_bytes_per_block": int(pcie_first + (n_pass - 1.0) * pcie_later),
        "diffusion_vram_bytes_per_pass": int(pass_read),
        "diffusion_gflop_per_pass": round(pass_flops / 1e9, 1),
        "diffusion_overhead_ms_per_pass": round(pass_oh * 1e3, 3),
        "dequant_vram_traffic_bytes_per_pass": dequant_traffic,
        "prefill_chunk_tokens": c,
        "prefill_distinct_experts_per_layer": round(dc, 2),
        "prefill_pcie_bytes_per_forward": int(s * dc * eb_str),
    }
    return tok, derived


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class _Option:
    """One resident-layer count with its minimum VRAM and its RAM."""

    n_resident: int
    resident: list[int]
    streamed: list[int]
    min_slots: int
    resident_bytes: int
    min_vram: int
    ram: dict[str, int]

    @property
    def ram_total(self) -> int:
        return sum(self.ram.values())


def make_plan(
    manifest: Manifest | dict[str, Any],
    vram_bytes: int,
    ctx_tokens: int,
    ram_bytes: int | None = None,
    *,
    block_size: int = 32,
    min_slot_experts: int | None = None,
    hardware: Hardware | None = None,
    roofline: Roofline | dict[str, Any] | None = None,
    optimize_for: str = "diffusion",
    attention: str = "math",
    coreset: bool = False,
    tokens_per_pass: float | None = None,
) -> Plan:
    """Place ``manifest`` into ``vram_bytes`` of GPU memory (and ``ram_bytes`` of free host RAM, when given) for
    ``ctx_tokens`` of context; see the module docstring for the rules.

    ``manifest`` may also be the cache-manifest dict (``engine.offload.manifest_from_model``).
    ``hardware`` (default :data:`engine.hardware.DEFAULT_HARDWARE`, the assumed 16 GB RTX card; this function
    never probes) and ``roofline`` only feed the speed prediction, which picks the resident layer count for
    ``optimize_for`` ("diffusion" | "ar"). ``ram_bytes=None`` skips the RAM check. ``coreset`` and
    ``tokens_per_pass`` are JSON-friendly shortcuts that override those two roofline inputs (the worker's ``plan``
    command passes its keys straight through); ``roofline`` may also be a dict of :class:`Roofline` fields.
    ``attention``: "math" is what engine.model's block-mode prefill runs today (see :func:`_prefill_parts`);
    "efficient" plans for a kernel without fp32 score scratch. The plan's ``prefill_chunk_tokens`` is the longest
    prefill forward the engine may run within this plan.
    """
    vram_budget = _check_int("vram_bytes", vram_bytes)
    ctx = _check_int("ctx_tokens", ctx_tokens, 1)
    block = _check_int("block_size", block_size, 1)
    if ram_bytes is not None:
        _check_int("ram_bytes", ram_bytes)
    if min_slot_experts is not None:
        _check_int("min_slot_experts", min_slot_experts, 1)
    if optimize_for not in ("diffusion", "ar"):
        raise PlanError(f"optimize_for must be 'diffusion' or 'ar', got {optimize_for!r}")
    if attention not in ATTENTION_PATHS:
        raise PlanError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {attention!r}")
    if isinstance(roofline, dict):
        unknown = set(roofline) - {f.name for f in dataclasses.fields(Roofline)}
        if unknown:
            raise PlanError(f"roofline has unknown field(s): {', '.join(sorted(unknown))}")
        roofline = Roofline(**roofline)
    rl = roofline or Roofline()
    if coreset:
        rl = dataclasses.replace(rl, distinct_experts_per_pass=CORESET_DISTINCT_EXPERTS_PER_PASS)
    if tokens_per_pass is not None:
        rl = dataclasses.replace(rl, tokens_per_pass=tokens_per_pass)
    if rl.tokens_per_pass > block:
        raise PlanError(f"Roofline.tokens_per_pass {rl.tokens_per_pass} exceeds block_size {block}")
    hw = hardware or DEFAULT_HARDWARE
    if isinstance(manifest, dict):
        manifest = manifest_from_dict(manifest)
    if not isinstance(manifest, Manifest):
        raise PlanError(f"make_plan needs a Manifest or a manifest dict, got {type(manifest).__name__}")

    f = _facts(manifest)
    geo, e = f.geo, f.geo.num_experts
    ctx_alloc = -(-ctx // block) * block  # the KV cache holds whole blocks
    workspace_parts, workspace_details = _workspace(f, ctx_alloc, block, attention)
    chunk = workspace_details["prefill_chunk_tokens"]
    fixed = {
        "non_expert": f.non_expert_gpu,
        "kv_cache": geo.kv_bytes_per_token * ctx_alloc,
        "gdn_state": geo.gdn_state_bytes,
        "workspace": sum(workspace_parts.values()),
        "reserve": CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES,
    }
    fixed_total = sum(fixed.values())

    options: list[_Option] = []
    for r in range(len(f.layers) + 1):
        resident = spread_resident(f.layers, r)
        streamed = [x for x in f.layers if x not in set(resident)]
        min_slots = _min_slots(len(streamed), e, min_slot_experts)
        resident_bytes = sum(f.layer_bytes[x] for x in resident)
        ram = {"streamed_experts": sum(f.layer_bytes[x] for x in streamed), "embed": f.embed_ram, "staging": STAGING_BYTES}
        need = fixed_total + resident_bytes + min_slots * f.slot_bytes
        options.append(_Option(r, resident, streamed, min_slots, resident_bytes, need, ram))

    def ram_ok(o: _Option) -> bool:
        return ram_bytes is None or o.ram_total <= ram_bytes

    def slots_for(o: _Option) -> int:
        if not o.streamed:
            return 0
        extra = (vram_budget - o.min_vram) // f.slot_bytes if vram_budget >= o.min_vram and f.slot_bytes else 0
        return min(len(o.streamed) * e, o.min_slots + extra)  # leftover VRAM becomes cache slots

    def best(pool: list[_Option]) -> tuple[_Option, int, dict[str, float], dict[str, Any]]:
        scored = []
        for o in pool:
            slots = slots_for(o)
            tok, derived = _predict(f, o.streamed, slots, ctx_alloc, block, hw, rl, chunk, attention)
            scored.append((o, slots, tok, derived))
        return max(scored, key=lambda t: (round(t[2][optimize_for], 9), t[0].n_resident))

    min_vram = min((o.min_vram for o in options if ram_ok(o)), default=None)
    in_vram = [o for o in options if o.min_vram <= vram_budget]
    fits_both = [o for o in in_vram if ram_ok(o)]
    reason = ""
    if fits_both:
        chosen, slots, tok, derived = best(fits_both)
    elif in_vram:  # VRAM is enough, RAM is not: the layout VRAM alone would choose
        chosen, slots, tok, derived = best(in_vram)
        reason = (
            f"RAM: the plan needs {format_bytes(chosen.ram_total)} of free system RAM "
            f"({format_bytes(chosen.ram['streamed_experts'])} streamed experts, {format_bytes(chosen.ram['embed'])} "
            f"embedding, {format_bytes(STAGING_BYTES)} staging) but {format_bytes(ram_bytes or 0)} is available"
        )
    else:  # VRAM too small: the minimum layout
        chosen = min([o for o in options if ram_ok(o)] or options, key=lambda o: (o.min_vram, -o.n_resident))
        slots = chosen.min_slots
        tok, derived = _predict(f, chosen.streamed, slots, ctx_alloc, block, hw, rl, chunk, attention)
        reason = (
            f"VRAM: the budget of {format_bytes(vram_budget)} is below the {format_bytes(chosen.min_vram)} "
            f"this model needs with a {ctx:,}-token context"
        )
    fits = not reason
    if not fits:
        if min_vram is None:
            reason += "; no VRAM budget fits the RAM given (the embedding and staging alone need more)"
        else:
            reason += f"; the smallest VRAM budget that fits is {format_bytes(min_vram)} ({min_vram:,} bytes)"

    breakdown = {
        "non_expert": fixed["non_expert"],
        "resident_experts": chosen.resident_bytes,
        "expert_slots": slots * f.slot_bytes,
        "kv_cache": fixed["kv_cache"],
        "gdn_state": fixed["gdn_state"],
        "workspace": fixed["workspace"],
        "reserve": fixed["reserve"],
    }
    assumptions: dict[str, Any] = {
        "gpu_name": hw.gpu_name,
        "hardware_sources": dict(hw.sources),
        "pcie_gbps": round(hw.pcie_gbps, 3),
        "vram_gbps": round(hw.vram_gbps, 3),
        **asdict(rl),
        "block_size": block,
        "optimize_for": optimize_for,
        "kv_context_tokens": ctx_alloc,
        "kv_bytes_per_token": geo.kv_bytes_per_token,
        "expert_slot_bytes": f.slot_bytes,
        "experts_per_layer": e,
        "experts_per_token": geo.num_experts_per_tok,
        "min_slot_experts": chosen.min_slots,
        "workspace_parts": workspace_parts,
        "workspace_details": workspace_details,
        "reserve_parts": {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_slack": ALLOCATOR_SLACK_BYTES},
        "resident_rule": "count: best predicted tok/s (ties: more resident); streamed layers spread evenly",
        "slot_rule": "at least 2 x experts per layer (a block pass can touch all, double-buffered), at most the "
        "streamed experts; leftover VRAM adds cache slots",
        **derived,
    }
    log.debug("plan %s @ %d B: fits=%s, %d resident", manifest.source, vram_budget, fits, len(chosen.resident))
    return Plan(
        resident_expert_layers=list(chosen.resident),
        streamed_expert_layers=list(chosen.streamed),
        slot_pool_experts=slots,
        vram_bytes=sum(breakdown.values()),
        vram_breakdown=breakdown,
        ram_bytes=chosen.ram_total,
        fits=fits,
        reason=reason,
        min_vram_bytes=min_vram,
        predicted_tok_s={mode: round(v, 2) for mode, v in tok.items()},
        assumptions=assumptions,
        budget_vram_bytes=vram_budget,
        ram_available_bytes=ram_bytes,
        ram_breakdown=dict(chosen.ram),
        ctx_tokens=ctx,
        prefill_chunk_tokens=workspace_details["prefill_chunk_tokens"],
        model=manifest.source,
    )


def format_bytes(n: int | float) -> str:
    """Bytes as GiB (>= 1 GiB) or MiB, two / one decimals."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"
