"""VRAM / RAM planner: a byte-exact tensor manifest, a placement plan for a budget, and a roofline speed estimate.

Stdlib only (plus psutil / pynvml inside :func:`engine.hardware.probe_hardware`): the Qt UI imports this module.

Units: sizes are bytes; ``GiB`` = 2**30. Bandwidths are GB/s (10**9 bytes per second), as hardware specs state them.

How a plan is made (:func:`make_plan`)
* Everything that is not a routed expert lives on the GPU (attention, Gated DeltaNet, shared experts, routers, norms,
  Clover extras, lm_head), except the input embedding, which is a row lookup and stays in system RAM.
* Routed experts are placed by whole layers: a layer's experts are either resident on the GPU or streamed from
  pinned host RAM into a pool of expert-sized GPU slots.
* The slot pool is at least ``2 x E`` slots (E = experts per layer) when any layer streams: a block of 32 tokens x
  top-8 can touch all E experts of a layer in one pass, and the next streamed layer's experts load while this one
  computes (double buffering). ``min_slot_experts`` lowers this for an expert bank that computes in chunks. The
  pool never exceeds the number of streamed experts. VRAM the layers cannot use goes to extra slots: they cache
  streamed layers' block working sets, which is what makes streaming and block diffusion work together.
* Which layers stay resident: the number R is chosen by the roofline (highest predicted diffusion tok/s, ties to
  more resident layers), and the streamed ones are spread evenly over the depth, so between two streamed layers
  there are resident layers whose compute hides the next streamed layer's transfer. Streaming a run of adjacent
  layers would leave the copy engine nothing to overlap with.
* Reserve: CUDA context + cuBLAS (500 MiB) and allocator slack (256 MiB). The budget is what this process may use:
  pass the card's free VRAM (what the desktop leaves), not its total.
"""

from __future__ import annotations

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
    "TensorEntry",
    "classify",
    "format_bytes",
    "make_plan",
    "manifest_for_shape",
    "manifest_from_checkpoint",
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


@dataclass(frozen=True)
class QuantPolicy:
    """Storage format per tensor kind. Matmul weights take their kind's format; every other tensor (norms, conv,
    A_log / dt_bias, Clover extras, 1-row gates) keeps its stored dtype.

    Defaults, by the numbers (35B-A3B shapes): routed experts are 93 % of the weights and only 8 of 256 run per
    token, so they take NF4 (18.1 GB -> 16.9 GiB). The dense projections (attention, GDN, shared experts: 1.41 B
    params) run for every token, and llama.cpp's mixes keep them above 4 bits too; int8 costs 0.62 GB more than
    NF4, which is 1.4 expert layers (3-4 resident layers of the 16 GB plan are traded for streamed ones, about 7 %
    diffusion speed) and is the quality-safe default; ``QuantPolicy(attn="nf4", gdn="nf4", shared_expert="nf4")``
    is the small-card option. lm_head int8 (0.51 GB instead of 1.02 GB bf16; NF4 would need a 0.95 GiB bf16
    dequantize buffer for a 32-token block, so it saves nothing). The embedding stays bf16 in system RAM.
    """

    experts: str = "nf4"
    attn: str = "int8"
    gdn: str = "int8"
    shared_expert: str = "int8"
    lm_head: str = "int8"
    embed: str = "bf16"
    router: str = "bf16"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value not in FORMAT_BYTES:
                raise PlanError(f"QuantPolicy.{name} = {value!r} is not a known format ({', '.join(FORMAT_BYTES)})")

    def format_for(self, name: str, kind: str, shape: tuple[int, ...], stored: str) -> str:
        """The storage format of one tensor under this policy."""
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        projection = "proj" in module.rsplit(".", 1)[-1]  # q_proj, in_proj_qkv, out_proj, gate_up_proj, ...
        is_matmul = len(shape) >= 2 and shape[-2] > 1 and (projection or kind in ("lm_head", "embed", "router"))
        if not is_matmul:
            return stored
        by_kind = {
            "expert": self.experts,
            "attn": self.attn,
            "gdn": self.gdn,
            "shared_expert": self.shared_expert,
            "lm_head": self.lm_head,
            "embed": self.embed,
            "router": self.router,
        }
        return by_kind.get(kind, stored)


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


def manifest_for_geometry(geo: ModelGeometry, policy: QuantPolicy | None = None, source: str = "geometry") -> Manifest:
    """The manifest a geometry would have after quantization under ``policy`` (default :class:`QuantPolicy`)."""
    policy = policy or QuantPolicy()
    entries = []
    for name, shape, stored in _text_tensors(geo):
        kind, layer = classify(name)
        fmt = policy.format_for(name, kind, shape, stored)
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


def manifest_from_quantized_cache(manifest_json_path: str | Path) -> Manifest:
    """Read the quantization helper's manifest JSON (``{"version": 1, "policy", "source", "tensors"}``).

    The geometry comes from ``config.json`` next to the manifest file, else from ``source["model_dir"]``."""
    path = Path(manifest_json_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"{path}: quantized-cache manifest not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        version = data.get("version") if isinstance(data, dict) else None
        raise PlanError(f"{path}: expected a manifest object with version 1, got version {version!r}")
    tensors = data.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise PlanError(f"{path}: field 'tensors' is missing or empty")
    entries = []
    for raw_name, meta in tensors.items():
        name = strip_prefix(raw_name)
        if name is None:
            continue
        try:
            shape = tuple(int(x) for x in meta["shape"])
            fmt = str(meta["format"])
            nbytes = int(meta["bytes"])
        except (KeyError, TypeError, ValueError):
            raise PlanError(f"{path}: tensor {raw_name!r} needs 'shape', 'format' and 'bytes', got {meta!r}") from None
        if fmt not in FORMAT_BYTES:
            raise PlanError(f"{path}: tensor {raw_name!r} has unknown format {fmt!r} ({', '.join(FORMAT_BYTES)})")
        if nbytes < 0:
            raise PlanError(f"{path}: tensor {raw_name!r} has negative bytes {nbytes}")
        kind, layer = classify(name)
        entries.append(TensorEntry(name, shape, fmt, nbytes, layer, kind))
    source = data.get("source") if isinstance(data.get("source"), dict) else {}
    config_dir = path.parent
    if not (config_dir / "config.json").exists() and source.get("model_dir"):
        config_dir = Path(str(source["model_dir"]))
    geo = _geometry_near(config_dir, str(path))
    policy = data.get("policy") if isinstance(data.get("policy"), dict) else None
    return Manifest(tuple(entries), geo, str(path), policy)


# ---------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------

CUDA_CONTEXT_BYTES = 500 * MiB  # CUDA context + cuBLAS/cuDNN handles and workspaces (torch, recent drivers)
ALLOCATOR_SLACK_BYTES = 256 * MiB  # caching-allocator fragmentation headroom
STAGING_BYTES = 256 * MiB  # pinned host staging ring (weight upload at load; pinned bounce buffer on Windows)
PREFILL_CHUNK_TOKENS = 512  # prompt tokens per prefill forward
PREFILL_ACTIVATION_BUFFERS = 8  # live fp32 [chunk, widest projection] buffers during a prefill layer
EXPERT_DEQUANT_EXPERTS = 8  # experts dequantized to bf16 at once by the expert bank (T > 1)
DEFAULT_TOKENS_PER_PASS = 3.0  # committed tokens per denoising pass (LLaDA2-like TPF 2.5-3.2, architecture 4.1)
DEFAULT_DISTINCT_EXPERTS_PER_PASS = 70.0  # of 256, a 32-token pass (LLaDA2.0-mini measured 69.5)
CORESET_DISTINCT_EXPERTS_PER_PASS = 30.0  # 90 %-mass block coreset (offload-anchors 2.3: ~25-35) [assumption]
BLOCK_REUSE_FACTOR = 1.3  # block working set / per-pass union, across the passes of one block [assumption]
COMPUTE_TFLOPS = 30.0  # effective bf16 TFLOPS of a 16 GB RTX card on dequant + GEMM at T = 32 [assumption]
LAYER_OVERHEAD_S = 300e-6  # eager PyTorch launches + Python per layer per pass, no CUDA graphs [assumption]

BREAKDOWN_KEYS = ("non_expert", "resident_experts", "expert_slots", "kv_cache", "gdn_state", "workspace", "reserve")


@dataclass(frozen=True)
class Plan:
    """Where every byte goes for one model, budget and context. ``vram_bytes == sum(vram_breakdown.values())``.

    When ``fits`` is False the layout is the one the budget was measured against (the minimum layout when VRAM is
    short) and ``reason`` says why; ``min_vram_bytes`` is the smallest VRAM budget that fits (None when no VRAM
    budget can, e.g. the RAM given cannot even hold the embedding).
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
    # Extras beyond the DESIGN.md contract.
    budget_vram_bytes: int = 0
    ram_available_bytes: int | None = None
    ram_breakdown: dict[str, int] = field(default_factory=dict)
    ctx_tokens: int = 0
    model: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


@dataclass(frozen=True)
class _Facts:
    """What make_plan derives once from a manifest."""

    geo: ModelGeometry
    layers: tuple[int, ...]  # MoE layers, ascending
    layer_bytes: dict[int, int]
    slot_bytes: int
    expert_params: float  # params of one routed expert (mean over layers)
    non_expert_gpu: int
    non_expert_gpu_params: int
    embed_ram: int
    nf4_dense_max_params: int  # largest NF4 non-expert matrix on the GPU (dequantized to bf16 at T > 1)
    experts_quantized: bool


def _facts(manifest: Manifest) -> _Facts:
    geo = manifest.geometry
    layer_bytes = manifest.expert_layer_bytes()
    layer_params = manifest.expert_layer_params()
    e = geo.num_experts
    if layer_bytes and e <= 0:
        raise PlanError(f"{manifest.source}: num_experts is {e} but the manifest has expert tensors")
    slot = max((-(-b // e) for b in layer_bytes.values()), default=0)
    expert_params = sum(layer_params.values()) / (len(layer_params) * e) if layer_params else 0.0
    tied_embed_on_gpu = geo.tie_word_embeddings and not any(x.kind == "lm_head" for x in manifest)
    gpu = [x for x in manifest if x.kind != "expert" and (x.kind != "embed" or tied_embed_on_gpu)]
    embed_ram = 0 if tied_embed_on_gpu else manifest.total_bytes(["embed"])
    nf4_dense = max((x.numel for x in gpu if x.format == "nf4"), default=0)
    return _Facts(
        geo=geo,
        layers=tuple(layer_bytes),
        layer_bytes=layer_bytes,
        slot_bytes=slot,
        expert_params=expert_params,
        non_expert_gpu=sum(x.bytes for x in gpu),
        non_expert_gpu_params=sum(x.numel for x in gpu if x.kind != "embed") + (manifest.total_params(["embed"]) if tied_embed_on_gpu else 0),
        embed_ram=embed_ram,
        nf4_dense_max_params=nf4_dense,
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


def _workspace(f: _Facts, ctx: int, block: int) -> dict[str, int]:
    geo = f.geo
    widest = max(geo.conv_dim if geo.gdn_layers else 0, geo.q_dim * 2, geo.hidden_size, geo.shared_expert_intermediate_size * 2)
    parts = {
        "logits": block * geo.vocab_size * 4,  # fp32 logits of one block
        # one block's attention scores against the whole context (the math SDPA path for a block mask)
        "attn_scores": (geo.num_attention_heads * block * ctx * 4) if geo.full_attention_layers else 0,
        "prefill_activations": PREFILL_CHUNK_TOKENS * widest * 4 * PREFILL_ACTIVATION_BUFFERS,
        # NF4 matmuls at T > 1 dequantize the whole weight to bf16 first; int8 runs as int8 GEMM (no full dequant)
        "dequant_dense": f.nf4_dense_max_params * 2,
        "dequant_experts": int(EXPERT_DEQUANT_EXPERTS * f.expert_params * 2) if f.experts_quantized else 0,
    }
    return parts


def _min_slots(n_streamed: int, num_experts: int, min_slot_experts: int | None) -> int:
    if n_streamed == 0:
        return 0
    wanted = 2 * num_experts if min_slot_experts is None else min_slot_experts
    return min(n_streamed * num_experts, wanted)


def _roofline(
    f: _Facts,
    streamed: list[int],
    slots: int,
    ctx: int,
    block: int,
    hw: Hardware,
    tokens_per_pass: float,
    d_pass: float,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Predicted tokens per second for AR decoding and block diffusion, and the numbers that went in."""
    geo = f.geo
    e, k = geo.num_experts, geo.num_experts_per_tok
    n_moe = len(f.layers)
    n_layers = geo.num_hidden_layers
    s = len(streamed)
    eb_all = sum(f.layer_bytes.values()) / (n_moe * e) if n_moe else 0.0
    eb_str = sum(f.layer_bytes[x] for x in streamed) / (s * e) if s else 0.0
    vram_bw, pcie_bw, flops = hw.vram_gbps * GB, hw.pcie_gbps * GB, COMPUTE_TFLOPS * 1e12
    base_read = f.non_expert_gpu + geo.kv_bytes_per_token * ctx + 2 * geo.gdn_state_bytes
    attn_flops_per_token = 4 * ctx * geo.q_dim * len(geo.full_attention_layers)  # QK^T and PV
    active = f.non_expert_gpu_params + k * n_moe * f.expert_params

    # AR: one token per pass; its k experts per streamed layer come over PCIe unless the slot pool still has them.
    # Hit rate: uniform routing, LRU over the pool, which holds the last slots / (k s) tokens' experts.
    hit = 1.0 - (1.0 - k / e) ** (slots / (k * s)) if s and e else 0.0
    ar_read = base_read + k * n_moe * eb_all
    ar_pcie = s * k * eb_str * (1.0 - hit)
    t_ar = max(ar_read / vram_bw, ar_pcie / pcie_bw, (2 * active + attn_flops_per_token) / flops) + n_layers * LAYER_OVERHEAD_S

    # Diffusion: block/TPF denoising passes + 1 commit pass, each over all `block` positions.
    dp = min(float(e), float(block * k), d_pass)
    db = min(float(e), dp * BLOCK_REUSE_FACTOR)
    n_pass = block / tokens_per_pass + 1.0
    # Streamed layers whose block working set stays in the pool for the whole block; the others thrash and reload
    # their per-pass union every pass. Two per-pass unions of slots are kept for the uncached layers in flight.
    if s == 0 or slots >= s * math.ceil(db):
        cached = s
    else:
        cached = min(s, max(0, slots - 2 * math.ceil(dp)) // math.ceil(db))
    pass_read = base_read + n_moe * dp * eb_all
    pass_flops = block * (2 * active + attn_flops_per_token)
    gpu_pass = max(pass_read / vram_bw, pass_flops / flops)
    pcie_first = s * dp * eb_str  # every streamed layer loads its first pass's union
    later = max(n_pass - 1.0, 1e-9)
    pcie_later = (cached * (db - dp) / later + (s - cached) * dp) * eb_str
    t_block = (
        max(gpu_pass, pcie_first / pcie_bw)
        + (n_pass - 1.0) * max(gpu_pass, pcie_later / pcie_bw)
        + n_pass * n_layers * LAYER_OVERHEAD_S
    )
    tok = {"ar": 1.0 / t_ar, "diffusion": block / t_block}
    inputs = {
        "ar_expert_hit_rate": round(hit, 4),
        "ar_pcie_bytes_per_token": int(ar_pcie),
        "ar_vram_bytes_per_token": int(ar_read),
        "distinct_experts_per_pass": dp,
        "distinct_experts_per_block_layer": db,
        "passes_per_block": n_pass,
        "cached_block_layers": cached,
        "diffusion_pcie_bytes_per_block": int(pcie_first + (n_pass - 1.0) * pcie_later),
        "diffusion_vram_bytes_per_pass": int(pass_read),
        "diffusion_gflop_per_pass": round(pass_flops / 1e9, 1),
    }
    return tok, inputs


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def make_plan(
    manifest: Manifest,
    vram_bytes: int,
    ctx_tokens: int,
    ram_bytes: int | None = None,
    *,
    block_size: int = 32,
    min_slot_experts: int | None = None,
    hardware: Hardware | None = None,
    tokens_per_pass: float = DEFAULT_TOKENS_PER_PASS,
    distinct_experts_per_pass: float | None = None,
    coreset: bool = False,
    optimize_for: str = "diffusion",
) -> Plan:
    """Place ``manifest`` into ``vram_bytes`` of GPU memory (and ``ram_bytes`` of free host RAM, when given) for
    ``ctx_tokens`` of context. See the module docstring for the rules.

    ``hardware`` (default: the assumed 16 GB RTX card of :data:`engine.hardware.DEFAULT_HARDWARE`) only feeds the
    roofline; ``hardware=None`` never probes, so the result depends on the arguments alone.
    ``optimize_for`` ("diffusion" | "ar") picks the mode whose predicted tok/s chooses the resident layer count.
    """
    vram_budget = _check_int("vram_bytes", vram_bytes)
    ctx = _check_int("ctx_tokens", ctx_tokens, 1)
    block = _check_int("block_size", block_size, 1)
    if ram_bytes is not None:
        _check_int("ram_bytes", ram_bytes)
    if min_slot_experts is not None:
        _check_int("min_slot_experts", min_slot_experts, 1)
    if not (isinstance(tokens_per_pass, (int, float)) and 0 < tokens_per_pass <= block):
        raise PlanError(f"tokens_per_pass must be in (0, block_size={block}], got {tokens_per_pass!r}")
    if optimize_for not in ("diffusion", "ar"):
        raise PlanError(f"optimize_for must be 'diffusion' or 'ar', got {optimize_for!r}")
    if distinct_experts_per_pass is None:
        distinct_experts_per_pass = CORESET_DISTINCT_EXPERTS_PER_PASS if coreset else DEFAULT_DISTINCT_EXPERTS_PER_PASS
    if not distinct_experts_per_pass > 0:
        raise PlanError(f"distinct_experts_per_pass must be positive, got {distinct_experts_per_pass!r}")
    hw = hardware or DEFAULT_HARDWARE

    f = _facts(manifest)
    geo = f.geo
    e = geo.num_experts
    ctx_alloc = -(-ctx // block) * block  # the cache holds whole blocks
    workspace_parts = _workspace(f, ctx_alloc, block)
    fixed = {
        "non_expert": f.non_expert_gpu,
        "kv_cache": geo.kv_bytes_per_token * ctx_alloc,
        "gdn_state": geo.gdn_state_bytes,
        "workspace": sum(workspace_parts.values()),
        "reserve": CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES,
    }
    fixed_total = sum(fixed.values())

    # Every resident-layer count, with its minimum VRAM and its RAM.
    options = []
    for r in range(len(f.layers) + 1):
        resident = spread_resident(f.layers, r)
        rs = set(resident)
        streamed = [x for x in f.layers if x not in rs]
        min_slots = _min_slots(len(streamed), e, min_slot_experts)
        resident_bytes = sum(f.layer_bytes[x] for x in resident)
        need = fixed_total + resident_bytes + min_slots * f.slot_bytes
        ram = {"streamed_experts": sum(f.layer_bytes[x] for x in streamed), "embed": f.embed_ram, "staging": STAGING_BYTES}
        options.append((r, resident, streamed, min_slots, resident_bytes, need, ram))

    def ram_ok(opt: tuple) -> bool:
        return ram_bytes is None or sum(opt[6].values()) <= ram_bytes

    ram_feasible = [o for o in options if ram_ok(o)]
    min_vram = min((o[5] for o in ram_feasible), default=None)
    in_vram = [o for o in options if o[5] <= vram_budget]
    d_pass = float(distinct_experts_per_pass)

    def evaluate(opt: tuple) -> tuple[int, dict[str, float], dict[str, Any]]:
        r, resident, streamed, min_slots, resident_bytes, need, ram = opt
        slots = 0
        if streamed:
            extra = (vram_budget - need) // f.slot_bytes if (vram_budget >= need and f.slot_bytes) else 0
            slots = min(len(streamed) * e, min_slots + extra)
        tok, inputs = _roofline(f, streamed, slots, ctx_alloc, block, hw, float(tokens_per_pass), d_pass)
        return slots, tok, inputs

    fits_both = [o for o in in_vram if ram_ok(o)]
    reason = ""
    if fits_both:
        scored = [(o, *evaluate(o)) for o in fits_both]
        best = max(scored, key=lambda t: (round(t[2][optimize_for], 9), t[0][0]))
        chosen, slots, tok, inputs = best
        fits = True
    else:
        fits = False
        if in_vram:  # VRAM is enough, RAM is not: show the layout VRAM alone would choose
            scored = [(o, *evaluate(o)) for o in in_vram]
            chosen, slots, tok, inputs = max(scored, key=lambda t: (round(t[2][optimize_for], 9), t[0][0]))
            ram_need = sum(chosen[6].values())
            reason = (
                f"RAM: the plan needs {format_bytes(ram_need)} of free system RAM "
                f"({format_bytes(chosen[6]['streamed_experts'])} streamed experts, {format_bytes(chosen[6]['embed'])} "
                f"embedding, {format_bytes(STAGING_BYTES)} staging) but only {format_bytes(ram_bytes or 0)} is available"
            )
        else:  # VRAM too small: show the minimum layout
            pool = ram_feasible or options
            chosen = min(pool, key=lambda o: (o[5], -o[0]))
            slots, tok, inputs = chosen[3], *_roofline(f, chosen[2], chosen[3], ctx_alloc, block, hw, float(tokens_per_pass), d_pass)
            reason = (
                f"VRAM: the budget of {format_bytes(vram_budget)} is below the minimum of {format_bytes(chosen[5])} "
                f"for a {ctx:,}-token context"
            )
        if min_vram is None:
            reason += "; no VRAM budget fits the RAM given (the embedding and staging alone need more)"
        elif min_vram > vram_budget or in_vram:
            reason += f"; the smallest VRAM budget that fits is {format_bytes(min_vram)} ({min_vram:,} bytes)"

    r, resident, streamed, min_slots, resident_bytes, need, ram = chosen
    breakdown = {
        "non_expert": fixed["non_expert"],
        "resident_experts": resident_bytes,
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
        "compute_tflops": COMPUTE_TFLOPS,
        "layer_overhead_us": LAYER_OVERHEAD_S * 1e6,
        "tokens_per_pass": float(tokens_per_pass),
        "block_size": block,
        "block_reuse_factor": BLOCK_REUSE_FACTOR,
        "coreset": coreset,
        "commit_pass": True,
        "optimize_for": optimize_for,
        "kv_context_tokens": ctx_alloc,
        "kv_bytes_per_token": geo.kv_bytes_per_token,
        "expert_slot_bytes": f.slot_bytes,
        "experts_per_layer": e,
        "experts_per_token": geo.num_experts_per_tok,
        "min_slot_experts": min_slots,
        "workspace_parts": workspace_parts,
        "reserve_parts": {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_slack": ALLOCATOR_SLACK_BYTES},
        "resident_rule": "count by best predicted tok/s (ties: more resident); streamed layers spread evenly",
        "slot_rule": "min 2 x experts per layer (block worst case, double-buffered), capped at streamed experts; "
        "leftover VRAM adds cache slots",
        **inputs,
    }
    plan = Plan(
        resident_expert_layers=list(resident),
        streamed_expert_layers=list(streamed),
        slot_pool_experts=slots,
        vram_bytes=sum(breakdown.values()),
        vram_breakdown=breakdown,
        ram_bytes=sum(ram.values()),
        fits=fits,
        reason=reason,
        min_vram_bytes=min_vram,
        predicted_tok_s={m: round(v, 2) for m, v in tok.items()},
        assumptions=assumptions,
        budget_vram_bytes=vram_budget,
        ram_available_bytes=ram_bytes,
        ram_breakdown=dict(ram),
        ctx_tokens=ctx,
        model=manifest.source,
    )
    log.debug("plan for %s at %d B: fits=%s resident=%d streamed=%d", manifest.source, vram_budget, fits, len(resident), len(streamed))
    return plan


def format_bytes(n: int | float) -> str:
    """``1536 MiB`` -> ``'1.50 GiB'``; below 1 GiB in MiB."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"
