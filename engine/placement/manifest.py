"""The bytes of a model: a byte-exact manifest of every text-model tensor, and the geometry planning needs.

Stdlib only (the UI imports it through :mod:`engine.placement.planner`). Units: bytes.

Where a manifest comes from (:func:`manifest_for_model_dir` picks):
* a Hugging Face checkpoint's safetensors headers (:func:`manifest_from_checkpoint`, never the data), as stored or
  as it will be after quantization under an :class:`engine.weights.formats.QuantPolicy` (:func:`quantize_manifest`: the
  same entries, formats and bytes the quantized cache's manifest will list, expert banks fused);
* the quantized cache's ``manifest.json`` (:func:`manifest_from_quantized_cache`, or the dict:
  :func:`manifest_from_dict`);
* a known shape under a policy (:func:`manifest_for_shape`: ``clover-35b-a3b``, ``qwen3.5-35b-a3b``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover_desk.engine.errors import CheckpointError, ConfigError, PlanError
from clover_desk.engine.model.config import CloverConfig, load_config
from clover_desk.engine.weights.formats import (
    COMPUTE_DTYPES,
    DEFAULT_POLICY,
    FORMAT_BYTES,
    QUANT_FORMATS,
    SAFETENSORS_DTYPES,
    QuantPolicy,
    checkpoint_files,
    expert_tensor_bytes,
    placed_bytes,
    quantized_sizes,
    read_safetensors_header,
)
from clover_desk.engine.weights.gguf.file import FORMAT_OF_TYPE, open_gguf, tensor_map

MiB = 1 << 20
GiB = 1 << 30

KINDS = ("expert", "attn", "gdn", "shared_expert", "router", "norm", "embed", "lm_head", "clover_extra", "other")
QUANT_MANIFEST_NAME = "manifest.json"  # the quantized cache's manifest inside its folder
MANIFEST_VERSIONS = (1, 2)  # the cache manifest's "tensors" section is the same in both (2 adds data checksums)


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


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
    # the model's context limit (0: unknown; not in any tensor shape, so not part of equality)
    max_position_embeddings: int = field(default=0, compare=False)

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """in_proj_qkv's output width (what the short convolution runs over): q and k, then v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

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

    @property
    def gdn_conv_state_bytes(self) -> int:
        """The bf16 conv-state part of :attr:`gdn_state_bytes` (held in the compute dtype)."""
        return len(self.gdn_layers) * self.conv_dim * (self.linear_conv_kernel_dim - 1) * 2

    @classmethod
    def from_config(cls, cfg: CloverConfig, clover_extras: bool | None = None) -> "ModelGeometry":
        """From an :class:`engine.model.config.CloverConfig`: every field of the same name (:data:`CONFIG_FIELDS`)
        is the config's, the rest are derived from it (:data:`DERIVED_FIELDS`)."""
        full = tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
        return cls(
            **{name: getattr(cfg, name) for name in CONFIG_FIELDS},
            full_attention_layers=full,
            clover_extras=cfg.is_diffusion if clover_extras is None else clover_extras,
        )


# What ModelGeometry takes from CloverConfig as it is (the same names and meanings: config.json's), and what it
# derives: the full-attention layers from layer_types, the Clover extras from is_diffusion (or the tensors), and the
# output gate, which the planner reads from q_proj's rows (CloverConfig has it always).
DERIVED_FIELDS = ("full_attention_layers", "clover_extras", "attn_output_gate")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ModelGeometry) if f.name not in DERIVED_FIELDS)

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
    max_position_embeddings=131_072,
)

# Known shapes for `manifest_for_shape` / `clover-desk plan --shape`: the one definition of the 35B-A3B widths (the
# real-width checkpoints of engine.weights.tiny and the benchmarks' clover-35b-a3b shape are made from it: shape_fields).
SHAPES: dict[str, ModelGeometry] = {
    "clover-35b-a3b": ModelGeometry(**{**asdict(_QWEN35_35B_A3B), "clover_extras": True}),
    "qwen3.5-35b-a3b": _QWEN35_35B_A3B,
}


def shape_fields(shape: str = "clover-35b-a3b") -> dict[str, int]:
    """A known shape (:data:`SHAPES`) as the arguments of ``engine.weights.tiny.tiny_text_config`` (its widths,
    depth, vocabulary and full-attention interval), so a random checkpoint or a benchmark at that shape restates
    none of them."""
    geo = SHAPES[shape]
    interval = geo.full_attention_layers[0] + 1
    if geo.full_attention_layers != tuple(range(interval - 1, geo.num_hidden_layers, interval)) \
            or geo.linear_key_head_dim != geo.linear_value_head_dim:
        raise ValueError(f"shape {shape!r} is not one tiny_text_config can make")
    return dict(
        vocab_size=geo.vocab_size, layers=geo.num_hidden_layers, hidden=geo.hidden_size, experts=geo.num_experts,
        experts_per_tok=geo.num_experts_per_tok, heads=geo.num_attention_heads, kv_heads=geo.num_key_value_heads,
        head_dim=geo.head_dim, linear_key_heads=geo.linear_num_key_heads,
        linear_value_heads=geo.linear_num_value_heads, linear_head_dim=geo.linear_key_head_dim,
        moe_intermediate=geo.moe_intermediate_size, shared_intermediate=geo.shared_expert_intermediate_size,
        full_attention_interval=interval, max_position_embeddings=geo.max_position_embeddings,
    )


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


def _text_tensors(geo: ModelGeometry) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, stored dtype) of every text-model tensor of a geometry."""
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
            if geo.clover_extras:  # Clover extras, primary shapes
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


def manifest_for_geometry(geo: ModelGeometry, policy: QuantPolicy | None = DEFAULT_POLICY, source: str = "geometry") -> Manifest:
    """The manifest a geometry would have: stored in bf16 (``policy=None``) or after quantization under ``policy``."""
    entries = []
    for name, shape, stored in _text_tensors(geo):
        kind, layer = classify(name)
        entries.append(TensorEntry(name, shape, stored, FORMAT_BYTES[stored](shape), layer, kind))
    stored_manifest = Manifest(tuple(entries), geo, source)
    return stored_manifest if policy is None else quantize_manifest(stored_manifest, policy)


def manifest_for_shape(shape: str = "clover-35b-a3b", policy: QuantPolicy | None = DEFAULT_POLICY) -> Manifest:
    """The known shapes of a named model (see :data:`SHAPES`), with bytes under ``policy``."""
    geo = SHAPES.get(shape.lower())
    if geo is None:
        raise PlanError(f"unknown model shape {shape!r} (known: {', '.join(SHAPES)})")
    return manifest_for_geometry(geo, policy, source=f"shape:{shape.lower()}")


# ---- real files ----


def _geometry_near(directory: Path, what: str) -> ModelGeometry:

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
    claimed = {name: shape for name, shape, _ in _text_tensors(geo)}  # what config.json's sizes make each tensor
    for shard in checkpoint_files(model_dir)[0]:
        for raw_name, h in read_safetensors_header(shard)[0].items():
            name = strip_prefix(raw_name)
            if name is None:
                continue
            if name in seen:
                raise CheckpointError(f"{shard}: tensor {name!r} appears in more than one shard")
            seen.add(name)
            kind, layer = classify(name)
            _check_claimed_shape(shard, raw_name, h.shape, claimed.get(name), kind)
            entries.append(TensorEntry(name, h.shape, h.format, h.nbytes, layer, kind))
    if not entries:
        raise CheckpointError(f"{model_dir}: the checkpoint holds no text-model tensors")
    return Manifest(tuple(entries), geo, str(model_dir))


def _check_claimed_shape(
    shard: Path, raw_name: str, shape: tuple[int, ...], claimed: tuple[int, ...] | None, kind: str
) -> None:
    """A config.json that claims sizes the checkpoint does not have (a doubled hidden_size, a typo'd expert count)
    is refused here, naming the tensor and both shapes, before a plan is sized from it (the loader checks every
    tensor again against the model it builds: engine.weights.checkpoint.plan_load). Clover's extras have several accepted
    shapes and a conv1d weight may come as [C, K] or [C, 1, K]: those are left to the loader."""
    if claimed is None or kind == "clover_extra" or tuple(shape) == claimed:
        return
    if raw_name.endswith("conv1d.weight") and math.prod(shape) == math.prod(claimed):
        return
    raise CheckpointError(
        f"{shard}: tensor {raw_name!r} has shape {list(shape)}, but config.json's sizes make it {list(claimed)}"
    )


def manifest_from_dict(
    data: dict[str, Any], source: str = "manifest", geometry: ModelGeometry | None = None
) -> Manifest:
    """A :class:`Manifest` from the cache-manifest dict (``{"version": 1, "policy", "source", "tensors"}``), as
    the quantized cache writes it.

    Without ``geometry`` it is derived from the shapes (:func:`geometry_from_entries`), with the routing top-k from
    ``source["num_experts_per_tok"]`` when present."""
    if not isinstance(data, dict) or data.get("version") not in MANIFEST_VERSIONS:
        version = data.get("version") if isinstance(data, dict) else None
        raise PlanError(f"{source}: expected a manifest object with version 1 or 2, got version {version!r}")
    tensors = data.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise PlanError(f"{source}: field 'tensors' is missing or empty")
    known = set(FORMAT_BYTES) | {fmt for fmt, _ in SAFETENSORS_DTYPES.values()}
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
        if fmt not in known:
            raise PlanError(f"{source}: tensor {raw_name!r} has unknown format {fmt!r} (known: {', '.join(sorted(known))})")
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
    """Read the quantized cache's manifest JSON (``{"version": 1, "policy", "source", "tensors"}``).

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
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def quantize_manifest(manifest: Manifest, policy: QuantPolicy = DEFAULT_POLICY) -> Manifest:
    """The manifest after quantization under ``policy``: what the quantized cache's manifest will list.

    Expert banks become the fused pair ``mlp.experts.gate_up_proj`` / ``down_proj`` (per-expert checkpoints too),
    with the bytes of the cache's packed rows (:func:`engine.weights.formats.expert_tensor_bytes`); other float tensors the
    policy quantizes take its format and bytes; everything else is unchanged."""
    geo = manifest.geometry
    e, d, inter = geo.num_experts, geo.hidden_size, geo.moe_intermediate_size
    entries: list[TensorEntry] = []
    banks_done: set[str] = set()
    for x in manifest:
        if x.kind == "expert":
            m = _PER_EXPERT.match(x.name)
            bank = m.group(1) if m else x.name.rsplit(".", 1)[0]
            if bank in banks_done:
                continue
            banks_done.add(bank)
            shapes = {"gate_up_proj": (e, 2 * inter, d), "down_proj": (e, d, inter)}
            fmt = policy.stored_format(f"{bank}.gate_up_proj", shapes["gate_up_proj"], x.format)
            if fmt in QUANT_FORMATS:
                nbytes = dict(zip(shapes, expert_tensor_bytes(e, d, inter, fmt, policy.blocksize)))
            else:
                nbytes = {leaf: FORMAT_BYTES[fmt](shape) for leaf, shape in shapes.items()}
            for leaf, shape in shapes.items():
                entries.append(TensorEntry(f"{bank}.{leaf}", shape, fmt, nbytes[leaf], x.layer, "expert"))
            continue
        fmt = policy.stored_format(x.name, x.shape, x.format) if x.format in _FLOAT_FORMATS else x.format
        if fmt == x.format:
            entries.append(x)
        elif fmt in QUANT_FORMATS:
            if len(x.shape) != 2:  # the quantizer quantizes matrices only
                entries.append(x)
                continue
            entries.append(dataclasses.replace(x, format=fmt, bytes=sum(quantized_sizes(x.shape, fmt, policy.blocksize))))
        else:
            entries.append(dataclasses.replace(x, format=fmt, bytes=FORMAT_BYTES[fmt](x.shape)))
    return Manifest(tuple(entries), geo, manifest.source, {**policy.to_dict(), "hash": policy.hash})


def manifest_for_model_dir(
    path: str | Path, policy: QuantPolicy = DEFAULT_POLICY, *, as_stored: bool = False
) -> Manifest:
    """The manifest to plan a model with: a quantized cache's ``manifest.json`` (the file, or the cache folder
    holding it) as written; a Hugging Face checkpoint folder as it will be after quantization under ``policy``
    (``as_stored=True``: the bytes in its files)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.suffix == ".gguf":  # planned as stored: the engine keeps GGUF blocks as they are (engine.weights.gguf.model)

        return manifest_from_gguf(path)
    if path.is_file():
        return manifest_from_quantized_cache(path)
    if (path / QUANT_MANIFEST_NAME).is_file():
        return manifest_from_quantized_cache(path / QUANT_MANIFEST_NAME)
    stored = manifest_from_checkpoint(path)
    return stored if as_stored else quantize_manifest(stored, policy)


@dataclass(frozen=True)
class ModelFacts:
    """What placement and the speed model need of a manifest, derived once (:func:`model_facts`)."""

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
    source: str = ""
    compute_dtype: str = "bf16"

    def fingerprint(self) -> str:
        """A short hash of everything a plan depends on in the model: geometry, expert bytes per layer, slot bytes,
        the non-expert bytes on the device and the embedding in RAM. Two manifests of one model (its checkpoint
        headers under a policy, and the quantized cache made from it) have the same fingerprint."""
        blob = {
            "geometry": asdict(self.geo),
            "layer_bytes": sorted(self.layer_bytes.items()),
            "slot_bytes": self.slot_bytes,
            "non_expert_gpu": self.non_expert_gpu,
            "embed_ram": self.embed_ram,
            "dequant": sorted(self.dequant_dense_params),
            "compute_dtype": self.compute_dtype,
        }
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def model_facts(manifest: Manifest, compute_dtype: str = "bf16") -> ModelFacts:
    if compute_dtype not in COMPUTE_DTYPES:
        raise PlanError(f"compute dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
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
    # quantized matrices are dequantized whole per forward (engine.weights.quant, engine.weights.gguf.model: GGUF blocks too)
    dequant = tuple(x.numel for x in gpu if x.format in ("nf4", "int8") or x.format.startswith("gguf_"))
    return ModelFacts(
        geo=geo,
        layers=tuple(layer_bytes),
        layer_bytes=layer_bytes,
        slot_bytes=slot,
        expert_params=expert_params,
        # on the device a plain float tensor takes the compute dtype (engine.model.clover's rule): count it as placed
        non_expert_gpu=sum(placed_bytes(x.name, x.shape, x.format, x.bytes, compute_dtype) for x in gpu),
        non_expert_gpu_params=sum(x.numel for x in gpu),
        embed_ram=0 if tied_embed_on_gpu else manifest.total_bytes(["embed"]),
        dequant_dense_max_params=max(dequant, default=0),
        dequant_dense_params=dequant,
        experts_quantized=any(x.kind == "expert" and (x.format in ("nf4", "int8") or x.format.startswith("gguf_"))
                              for x in manifest),
        source=manifest.source,
        compute_dtype=compute_dtype,
    )


def manifest_from_gguf(path: str | Path, layout: str = "auto") -> Manifest:
    """A :class:`Manifest` of a GGUF model as the engine holds it: quantized tensors keep their GGUF
    blocks (``gguf_q4_k``, ... bytes as stored), float ones are placed in the compute dtype. Expert banks are listed
    as ``gate_up_proj`` (gate + up bytes) and ``down_proj`` per layer. Reads the header only."""
    gf = open_gguf(path, layout)
    merged: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for name, t in gf.tensors.items():
        tm = tensor_map(gf, name)
        if tm is None:
            continue
        fmt = FORMAT_OF_TYPE[t.qtype]
        shape = t.shape
        if tm.hf_name.endswith(".linear_attn.conv1d.weight") and len(shape) == 2:
            shape = (shape[0], 1, shape[1])
        if tm.piece:  # gate + up -> one gate_up_proj entry
            prev = merged.get(tm.hf_name)
            if prev is not None:
                fmt = prev[1] if prev[1] == fmt else f"{prev[1]}+{fmt}"
                shape = (shape[0], prev[0][1] + shape[1], shape[2])
                merged[tm.hf_name] = (shape, fmt, prev[2] + t.nbytes)
                continue
        merged[tm.hf_name] = (shape, fmt, t.nbytes)
    entries = []
    for name, (shape, fmt, nbytes) in merged.items():
        kind, layer = classify(name)
        entries.append(TensorEntry(name, shape, fmt, nbytes, layer, kind))
    geo = ModelGeometry.from_config(gf.config, clover_extras=gf.has_diffusion)
    return Manifest(tuple(entries), geo, str(gf.path))
