"""GGUF model files (llama.cpp format) without torch: open one file or a split set, check it, turn its metadata into a
:class:`~engine.model.config.CloverConfig`, map its tensor names to the model's, rebuild the embedded tokenizer, and count
its bytes for the planner (:func:`engine.placement.manifest.manifest_from_gguf`).

Read with the ``gguf`` package (``GGUFReader``: memory-mapped, nothing is read until a tensor's bytes are touched).
Two layouts exist for Clover's GGUF files, told apart by what the file holds:

* ``fork``: DiffuSpace's own llama.cpp fork wrote the official files: ``general.architecture`` ``clover_moe``, the 120
  diffusion tensors (``ssm_bd_history.weight/.bias``, ``ssm_bd_logit_scale.weight``, ``ssm_conv1d.weight_right``)
  present, ``ssm_a`` holding raw ``A_log``. Block diffusion runs.
* ``upstream``: upstream llama.cpp's converter (or ``clover-desk gguf-fix``): no diffusion tensors, ``ssm_a`` holding
  ``-exp(A_log)``. AR only: the block-diffusion tensors are not in the file.

Detection: the diffusion tensors present -> ``fork``, absent -> ``upstream``; ``layout=`` overrides it. An
``upstream`` file whose ``ssm_a`` holds a value >= 0 cannot be ``-exp(A_log)`` and is refused (name the layout).

Name and value transforms undone on load (the converter's facts):

* every zero-centred RMSNorm weight (``attn_norm``, ``post_attention_norm``, ``output_norm``, ``attn_q_norm``,
  ``attn_k_norm``) is stored as ``1 + w``: the loader subtracts 1. ``ssm_norm`` is stored plain.
* Gated DeltaNet value heads are stored *tiled* (``[K0v0, K1v0, .., K0v1, K1v1, ..]``) where the Hugging Face layout
  groups them by key head (``[K0v0, K0v1, K1v0, ..]``): gguf head ``p`` = hf head ``(p % Hk) * r + p // Hk`` with
  ``r = Hv / Hk``. Undone on the V rows of ``attn_qkv``, the rows of ``attn_gate``, ``ssm_alpha``, ``ssm_beta``,
  ``ssm_a``, ``ssm_dt.bias``, the V channels of ``ssm_conv1d``, and the input columns of ``ssm_out``.
* ``ssm_conv1d.weight`` is ``[C, K]`` (the model keeps ``[C, 1, K]``), ``ffn_gate_inp_shexp.weight`` is ``[D]``
  (the model keeps ``[1, D]``), routed experts come as ``ffn_gate_exps`` + ``ffn_up_exps`` (or a fused
  ``ffn_gate_up_exps``) and ``ffn_down_exps``.

Assumptions where the reference is silent (each round-trips against :mod:`engine.weights.gguf.writer`):

* the fork stores its per-value-head diffusion tensors tiled like the other GDN tensors: the rows of a ``[Hv, D]``
  ``ssm_bd_history.weight``, a ``[Hv]`` bias and logit scale, the V channels of ``ssm_conv1d.weight_right``
  (``bd_tiled=False`` reads them in Hugging Face order);
* the fork's raw ``ssm_a`` is tiled too (its first entry equals ``A_log[0]`` either way);
* ``{arch}.block_count`` counts MTP layers (``{arch}.nextn_predict_layers``), as llama.cpp does for models with a
  next-token head; the text model has ``block_count - nextn_predict_layers`` layers;
* diffusion settings come from ``diffusion.shift_logits``, ``tokenizer.ggml.mask_token_id`` and, when present,
  ``{arch}.diffusion.block_size`` / ``{arch}.diffusion.threshold`` (else 32 and 0.95, the published values).
"""

from __future__ import annotations

import logging
import mmap
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clover_desk.engine.decode.tokenizer import CloverTokenizer
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover_desk.engine.errors import ConfigError
from clover_desk.engine.model.config import CloverConfig, parse_config
from clover_desk.engine.weights.gguf.header import read_header

log = logging.getLogger(__name__)

ARCHITECTURES = ("clover_moe", "qwen35moe")
LAYOUTS = ("auto", "fork", "upstream")
# ggml types the engine computes with (engine.weights.gguf.quants); the file may hold others only in tensors it ignores
SUPPORTED_TYPES = {0: "F32", 1: "F16", 30: "BF16", 8: "Q8_0", 2: "Q4_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
FLOAT_TYPES = (0, 1, 30)
FORMAT_OF_TYPE = {0: "fp32", 1: "fp16", 30: "bf16", 8: "gguf_q8_0", 2: "gguf_q4_0", 12: "gguf_q4_k", 13: "gguf_q5_k",
                  14: "gguf_q6_k"}
DIFFUSION_SUFFIXES = ("ssm_bd_history.weight", "ssm_bd_history.bias", "ssm_bd_logit_scale.weight",
                      "ssm_conv1d.weight_right")
SPLIT_RE = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# The Hugging Face pre-tokenizer regexes of llama.cpp's tokenizer.ggml.pre names (llama-vocab.cpp).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT, "gpt-2": None, "gpt2": None, "default": None}


# ---------------------------------------------------------------------------------------------------------------
# opening
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as a GGUF header describes it, shape in torch order (reversed ``ne``)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    data: Any  # numpy memmap view of the bytes (uint8 or the float dtype), shape as the reader gives it

    @property
    def type_name(self) -> str:
        return SUPPORTED_TYPES.get(self.qtype, f"type {self.qtype}")


def release_pages(view: Any) -> bool:
    """Drop the pages under ``view`` (a contiguous numpy view of a read-only memory-mapped file) from this process's
    resident set once they have been copied out: the OS keeps them in its page cache, the process stops counting
    them, so a load that copies the file into memory peaks near the copy's size instead of twice it. Anything else (an
    array not backed by a read-only map, a platform without ``madvise``) is left alone; returns whether pages went."""
    if not hasattr(mmap.mmap, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or not view.flags.c_contiguous:
        return False
    root, base = view, view.base
    while base is not None and not isinstance(base, mmap.mmap):
        root, base = base, getattr(base, "base", None)
    if base is None or getattr(root, "mode", None) != "r" or view.nbytes == 0:
        return False  # only a read-only file map: DONTNEED on anonymous or writable memory would lose data
    offset = getattr(root, "offset", 0)
    start = root.ctypes.data - (offset - offset % mmap.ALLOCATIONGRANULARITY)
    rel = view.ctypes.data - start
    lo = rel - rel % mmap.PAGESIZE
    hi = min(rel + view.nbytes, len(base))
    base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return True


def split_parts(path: Path) -> list[Path]:
    """The files of a model: ``path`` alone, or every part of a ``-0000k-of-0000N.gguf`` split set (any part may be
    given). A missing part is a ConfigError naming it."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('base')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ConfigError(f"{path}: split part(s) missing: {', '.join(missing)} (all {count} parts must sit together)")
    return parts


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    if magic != b"GGUF":
        raise ConfigError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    check_header(path)  # every count and offset bounded by the file first: GGUFReader trusts them
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as exc:
        # numpy's own wording (a reshape or view that does not fit) says nothing useful: name the likely cause
        log.debug("GGUFReader failed on %s: %s", path, exc)
        raise ConfigError(f"{path}: truncated or damaged GGUF file (its header or tensor data do not fit in the "
                          f"file's {path.stat().st_size:,} bytes)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def check_header(path: Path) -> None:
    """Check one GGUF file's header with the bounded reader (:mod:`engine.weights.gguf.header`): a damaged or hostile
    header is one :class:`~engine.weights.gguf.header.GGUFFormatError` line, raised before GGUFReader reads it."""
    try:
        read_header(path, keep_arrays=False)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def check_gguf_model(path: str | Path) -> None:
    """If ``path`` is a GGUF file, check the headers of its parts (cheap, torch-free: the CLI runs it before it loads
    torch, so that a bad file costs a fraction of a second)."""
    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return
    for part in split_parts(path):
        check_header(part)


@dataclass
class GGUFModelFile:
    """An opened GGUF model (one file or a split set): metadata, tensors, layout and config."""

    path: Path  # the file given (first part of a split set)
    parts: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    arch: str
    layout: str  # "fork" | "upstream"
    config: CloverConfig
    bd_tiled: bool = True
    readers: list[Any] = field(default_factory=list, repr=False)

    @property
    def has_diffusion(self) -> bool:
        return any(name.endswith(DIFFUSION_SUFFIXES) for name in self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def tensor_bytes(self, name: str) -> Any:
        """The raw bytes of a tensor as a numpy uint8 array [rows..., row_bytes] (a memmap view, not a copy)."""
        import numpy as np

        t = self.tensors[name]
        data = np.asarray(t.data)
        flat = data.view(np.uint8)
        rows = t.shape[:-1] if len(t.shape) > 1 else ()
        return flat.reshape(*rows, -1)


def open_gguf(path: str | Path, layout: str = "auto", bd_tiled: bool = True) -> GGUFModelFile:
    """Open a GGUF model file (or the split set it belongs to), check it and build its config.

    Every problem is one :class:`ConfigError` line naming the file: not GGUF, truncated, another architecture, a
    missing split part, a tensor type the engine cannot compute with, a missing metadata key."""
    path = Path(path)
    if layout not in LAYOUTS:
        raise ConfigError(f"GGUF layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    parts = split_parts(path)
    readers = [_reader(p) for p in parts]
    metadata: dict[str, Any] = {}
    for name, fld in readers[0].fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = fld.contents()
        except (UnicodeDecodeError, ValueError):
            metadata[name] = None
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{parts[0]}: general.architecture is {arch!r}; this engine reads {', '.join(ARCHITECTURES)} GGUF files"
        )
    count = metadata.get("split.count")
    if count is not None and int(count) != len(parts):
        raise ConfigError(f"{parts[0]}: split.count says {count} parts, the file name says {len(parts)}")
    tensors: dict[str, GGUFTensor] = {}
    for part, reader in zip(parts, readers):
        for t in reader.tensors:
            qtype = int(t.tensor_type)
            shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
            if t.name in tensors:
                raise ConfigError(f"{part}: tensor {t.name!r} appears in more than one split part")
            tensors[t.name] = GGUFTensor(t.name, qtype, shape, int(t.n_bytes), part, t.data)
    expected = metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(tensors):
        raise ConfigError(f"{parts[0]}: split.tensors.count says {expected} tensors, the parts hold {len(tensors)}")
    for t in tensors.values():
        if t.qtype not in SUPPORTED_TYPES and _hf_name(t.name) is not None:
            raise ConfigError(
                f"{t.file}: tensor {t.name!r} has ggml type {_type_name(t.qtype)}, which this engine does not read "
                f"(supported: {', '.join(SUPPORTED_TYPES.values())})"
            )
    diffusion = any(n.endswith(DIFFUSION_SUFFIXES) for n in tensors)
    chosen = layout if layout != "auto" else ("fork" if diffusion else "upstream")
    config = config_from_metadata(metadata, tensors, arch, chosen, parts[0])
    gf = GGUFModelFile(path, parts, metadata, tensors, arch, chosen, config, bd_tiled, readers)
    if chosen == "upstream":
        _check_upstream_ssm_a(gf)
        log.info("%s: upstream llama.cpp layout (no diffusion tensors): autoregressive decoding only", path)
    return gf


def _type_name(qtype: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"{qtype} (unknown)"


def _check_upstream_ssm_a(gf: GGUFModelFile) -> None:
    import numpy as np

    for name, t in gf.tensors.items():
        if name.endswith(".ssm_a") and t.qtype in FLOAT_TYPES:
            values = np.asarray(t.data).view({0: np.float32, 1: np.float16}.get(t.qtype, np.uint16))
            if t.qtype == 30:
                values = (values.astype(np.uint32) << 16).view(np.float32)
            if (values.astype(np.float32) >= 0).any():
                raise ConfigError(
                    f"{t.file}: {name} holds values >= 0, so it is raw A_log, not upstream's -exp(A_log), but the "
                    f"file has no diffusion tensors: open it with layout 'fork' (--gguf-layout fork)"
                )


def config_from_metadata(
    md: dict[str, Any], tensors: dict[str, GGUFTensor], arch: str, layout: str, source: Path
) -> CloverConfig:
    """A :class:`CloverConfig` from GGUF metadata (config.json names; checked by :func:`engine.model.config.parse_config`)."""

    def key(name: str, default: Any = ..., *, prefix: bool = True) -> Any:
        full = f"{arch}.{name}" if prefix else name
        value = md.get(full)
        if value is None:
            if default is ...:
                raise ConfigError(f"{source}: metadata key {full!r} is missing")
            return default
        return value

    def top(value: Any) -> Any:
        return max(value) if isinstance(value, list) else value

    def f32(value: Any) -> float:
        """A float32 metadata value as the decimal it was written from (1e-6, not 9.99999997e-07)."""
        import numpy as np

        return float(str(np.float32(value)))  # numpy prints the shortest decimal that reads back as this float32

    nextn = int(key("nextn_predict_layers", 0))
    n_layers = int(key("block_count")) - nextn
    heads = int(top(key("attention.head_count")))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // max(heads, 1)))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ConfigError(f"{source}: tensor 'token_embd.weight' is missing")
    hv = int(key("ssm.time_step_rank"))
    rope_dims = int(key("rope.dimension_count", head_dim // 4))
    tokens = md.get("tokenizer.ggml.tokens") or []
    index = {tok: i for i, tok in enumerate(tokens)} if tokens else {}
    eos = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
    eos_ids = [int(e) for e in dict.fromkeys(eos) if e is not None]
    diffusion = layout == "fork"
    data: dict[str, Any] = {
        "model_type": "clover_moe" if diffusion else "qwen3_5_moe_text",
        "vocab_size": int(embd.shape[0]),
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(top(key("attention.head_count_kv"))),
        "head_dim": head_dim,
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": hv,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // max(hv, 1),
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel", 4)),
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length", 0)),
        "full_attention_interval": int(key("full_attention_interval", 4)),
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": f32(key("rope.freq_base", 10_000_000.0)),
                            "partial_rotary_factor": rope_dims / head_dim if head_dim else 0.25},
        "max_position_embeddings": int(key("context_length", 131_072)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "weight_prefix": "",
    }
    if eos_ids:
        data["eos_token_id"] = eos_ids
    think_end = index.get("</think>")
    if think_end is not None:
        data["think_end_token_id"] = think_end
    if diffusion:
        mask = md.get("tokenizer.ggml.mask_token_id")
        if mask is not None:
            data["mask_token_id"] = int(mask)
        data["shift_logits"] = bool(md.get("diffusion.shift_logits", False))
        data["block_size"] = int(md.get(f"{arch}.diffusion.block_size", md.get("diffusion.block_size", DEFAULT_BLOCK_SIZE)))
        data["threshold"] = f32(md.get(f"{arch}.diffusion.threshold", md.get("diffusion.threshold", DEFAULT_THRESHOLD)))
    return parse_config(data, source=str(source))


# ---------------------------------------------------------------------------------------------------------------
# names and transforms
# ---------------------------------------------------------------------------------------------------------------

_NORM_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ssm_bd_history.weight": "linear_attn.bd_history.weight",
    "ssm_bd_history.bias": "linear_attn.bd_history.bias",
    "ssm_bd_logit_scale.weight": "linear_attn.bd_logit_scale.weight",
    "ssm_conv1d.weight_right": "linear_attn.conv1d.weight_right",
}
GGUF_OF_HF = {hf: g for g, hf in _LAYER_NAMES.items() if g not in ("ffn_gate_exps.weight", "ffn_up_exps.weight",
                                                                     "ffn_gate_up_exps.weight")}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(name: str) -> str | None:
    """GGUF tensor name -> the model's parameter name (no prefix), or None for a tensor the text model ignores."""
    if name == "token_embd.weight":
        return "embed_tokens.weight"
    if name == "output_norm.weight":
        return "norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = _BLK.match(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        return None
    return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def gguf_name_of(hf_name: str) -> str:
    """The model's parameter name -> the GGUF name (experts: the down bank only; gate/up are two tensors)."""
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, layer, rest = hf_name.split(".", 2)
    return f"blk.{layer}.{GGUF_OF_HF[rest]}"


def tiled_to_hf_heads(num_k_heads: int, num_v_heads: int) -> list[int]:
    """idx with hf_head[h] = gguf_head[idx[h]] (GGUF tiles value heads, Hugging Face groups them by key head)."""
    r = num_v_heads // num_k_heads
    return [(h % r) * num_k_heads + h // r for h in range(num_v_heads)]


def hf_to_tiled_heads(num_k_heads: int, num_v_heads: int) -> list[int]:
    """idx with gguf_head[p] = hf_head[idx[p]] (the converter's direction)."""
    r = num_v_heads // num_k_heads
    return [(p % num_k_heads) * r + p // num_k_heads for p in range(num_v_heads)]


def _expand(heads: list[int], width: int, base: int = 0) -> list[int]:
    return [base + h * width + j for h in heads for j in range(width)]


@dataclass(frozen=True)
class TensorMap:
    """How one GGUF tensor becomes (part of) a model parameter.

    ``rows`` / ``cols``: index lists into the GGUF tensor's first / last dim giving Hugging Face order (None: as
    stored). ``post``: "minus_one" (a 1 + w norm), "a_log_from_neg_exp" (upstream ssm_a), "" otherwise. ``piece``:
    for split expert banks, "gate" / "up" (halves of gate_up_proj), "" for a whole parameter."""

    gguf_name: str
    hf_name: str
    rows: tuple[int, ...] | None = None
    cols: tuple[int, ...] | None = None
    post: str = ""
    piece: str = ""


def tensor_map(gf: GGUFModelFile, name: str) -> TensorMap | None:
    """The transform of GGUF tensor ``name`` (None: the text model ignores it; MTP layers included)."""
    hf = _hf_name(name)
    if hf is None:
        return None
    cfg = gf.config
    m = _BLK.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return None  # next-token-prediction (MTP) layers
    leaf = m.group(2) if m else name
    t = gf.tensors[name]
    post = ""
    if leaf in _NORM_PLUS_ONE or name == "output_norm.weight":
        post = "minus_one"
    if leaf == "ssm_a" and gf.layout == "upstream":
        post = "a_log_from_neg_exp"
    piece = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up"}.get(leaf, "")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    heads = tiled_to_hf_heads(hk, hv)
    dv, kd = cfg.linear_value_head_dim, cfg.key_dim
    rows = cols = None
    per_head_rows = ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a")
    bd_per_head = ("ssm_bd_history.weight", "ssm_bd_history.bias", "ssm_bd_logit_scale.weight")
    if hk != hv:
        if leaf in per_head_rows or (leaf in bd_per_head and gf.bd_tiled and t.shape and t.shape[0] == hv):
            rows = tuple(heads)
        elif leaf == "attn_gate.weight":
            rows = tuple(_expand(heads, dv))
        elif leaf in ("attn_qkv.weight", "ssm_conv1d.weight") or (leaf == "ssm_conv1d.weight_right" and gf.bd_tiled):
            rows = tuple(list(range(2 * kd)) + _expand(heads, dv, 2 * kd))
        elif leaf == "ssm_out.weight":
            cols = tuple(_expand(heads, dv))
    return TensorMap(name, hf, rows, cols, post, piece)


# ---------------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------------


def tokenizer_json(md: dict[str, Any], source: Path) -> dict[str, Any]:
    """A Hugging Face ``tokenizer.json`` dict equivalent to the GGUF's embedded byte-level BPE (``gpt2`` model)."""
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConfigError(f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is read")
    tokens = md.get("tokenizer.ggml.tokens")
    merges = md.get("tokenizer.ggml.merges") or []
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens or [])
    if not tokens:
        raise ConfigError(f"{source}: metadata key 'tokenizer.ggml.tokens' is missing")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{source}: tokenizer.ggml.pre {pre!r} is not one of {', '.join(PRE_TOKENIZERS)}")
    split = PRE_TOKENIZERS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": split is None}
    if split is None:
        pre_tok: dict[str, Any] = byte_level
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == 3}
        for i, tok in enumerate(tokens) if types[i] in (3, 4)  # CONTROL, USER_DEFINED
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"} if split is not None else None,
        "pre_tokenizer": pre_tok,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def load_tokenizer(gf: GGUFModelFile) -> Any:
    """The embedded tokenizer and chat template as an :class:`engine.decode.tokenizer.CloverTokenizer`."""
    import json

    from tokenizers import Tokenizer


    spec = tokenizer_json(gf.metadata, gf.path)
    try:
        tok = Tokenizer.from_str(json.dumps(spec))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed spec
        raise ConfigError(f"{gf.path}: the embedded tokenizer cannot be built ({exc})") from None
    return CloverTokenizer(tok, gf.metadata.get("tokenizer.chat_template"), source=str(gf.path))

