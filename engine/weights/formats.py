"""File formats and byte rules, one of each, in plain Python (no torch): the torch side (checkpoint loading, the
quantizer and its cache) and the torch-free planner both import this module.

* :data:`SAFETENSORS_DTYPES`: the one dtype table (safetensors tag -> format name, bytes per element); the torch
  side maps format names to torch dtypes by name (:data:`TORCH_DTYPE_NAMES`).
* :func:`read_safetensors_header`: the one validating header parser (never reads the data).
* :func:`checkpoint_files`: the one shard discovery of a Hugging Face model folder (index, single file, or glob).
* Byte rules of the quantized formats (:func:`quantized_sizes`, :func:`expert_row_layout`, :data:`FORMAT_BYTES`).
* The quantization policy table (:class:`QuantPolicy`, :func:`make_policy`, :data:`DEFAULT_POLICY`): which tensor
  gets which format, by name. The quantizer applies it; the planner counts the bytes it implies.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover_desk.engine.errors import CheckpointError, ConfigError

__all__ = [
    "CPU_POLICY",
    "CPU_Q6_DENSE_POLICY",
    "DEFAULT_POLICY",
    "FORMAT_BYTES",
    "HeaderEntry",
    "INDEX_NAME",
    "QuantPolicy",
    "Rule",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "checkpoint_files",
    "expert_row_layout",
    "make_policy",
    "policy_for",
    "quantized_sizes",
    "read_safetensors_header",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # a real 35B shard's header is ~100 KiB; larger is a damaged or hostile file

# safetensors dtype tag -> (format name, bytes per element). The only dtype table of the project.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("fp64", 8),
    "F32": ("fp32", 4),
    "F16": ("fp16", 2),
    "BF16": ("bf16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("fp8_e4m3", 1),
    "F8_E5M2": ("fp8_e5m2", 1),
}
TAG_OF_FORMAT: dict[str, str] = {fmt: tag for tag, (fmt, _) in SAFETENSORS_DTYPES.items()}
# parameters the model keeps in fp32 whatever its compute dtype (Gated DeltaNet's decay: exp / softplus inputs)
FP32_PARAMS = ("A_log", "dt_bias")
FLOAT_FORMATS = ("bf16", "fp16", "fp32")
COMPUTE_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}  # compute dtype -> bytes per element


def placed_bytes(name: str, shape: tuple[int, ...], fmt: str, nbytes: int, compute: str) -> int:
    """Bytes of a tensor once placed for compute in ``compute``: a plain float tensor takes the compute dtype (fp32
    for :data:`FP32_PARAMS`); quantized and integer tensors keep their bytes."""
    if fmt not in FLOAT_FORMATS:
        return nbytes
    return math.prod(shape) * (4 if name.endswith(FP32_PARAMS) else COMPUTE_DTYPES[compute])


# format name -> attribute of the torch module (the torch side resolves these; this module never imports torch)
TORCH_DTYPE_NAMES: dict[str, str] = {
    "fp64": "float64",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
FORMAT_OF_TORCH_NAME: dict[str, str] = {name: fmt for fmt, name in TORCH_DTYPE_NAMES.items()}


def format_of_torch_dtype(dtype: object) -> str:
    """``torch.bfloat16`` -> "bf16" (any torch dtype; unknown ones keep torch's own name)."""
    name = str(dtype).removeprefix("torch.")
    return FORMAT_OF_TORCH_NAME.get(name, name)


# ---------------------------------------------------------------------------------------------------------------
# safetensors headers and shards
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a safetensors header describes it."""

    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # absolute byte offset of the tensor's data in ``file``

    @property
    def format(self) -> str:
        return SAFETENSORS_DTYPES[self.dtype][0]


def read_safetensors_header(path: Path) -> tuple[dict[str, HeaderEntry], bytes]:
    """(entries, raw header bytes) of one safetensors file; the data starts at ``8 + len(raw)``.

    Validates everything the data offsets imply (a known dtype, bytes = numel x element size, inside the file), so
    a truncated or malformed file is a :class:`CheckpointError` naming the file and tensor, never a later crash."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file is {size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes (at most {MAX_HEADER_BYTES} allowed)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_len = size - 8 - n
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        def ints(value: Any) -> bool:
            return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)

        if not (
            isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and ints(info.get("shape"))
            and ints(info.get("data_offsets"))
            and len(info["data_offsets"]) == 2
            and min(info["shape"], default=0) >= 0
        ):
            raise CheckpointError(
                f"{path}: tensor {name!r} has a malformed header entry (needs dtype: a string, shape: a list of "
                f"non-negative integers, data_offsets: [begin, end] integers)"
            )
        dtype, shape = info["dtype"], tuple(info["shape"])
        begin, end = info["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})"
            )
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]
        if end - begin != expected or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - begin} bytes, its shape {list(shape)} {dtype} needs {expected}"
            )
        if end > data_len:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} of the data section, "
                f"which has only {data_len} bytes"
            )
        entries[name] = HeaderEntry(name, path, dtype, shape, end - begin, 8 + n + begin)
    return entries, raw


def checkpoint_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(shard files in order, the index's weight map or None) of a Hugging Face model folder: the files the
    ``model.safetensors.index.json`` names, else ``model.safetensors``, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = {str(k): str(v) for k, v in dict(index["weight_map"]).items()}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise CheckpointError(f"{index_path}: not a valid safetensors index (needs a 'weight_map' object)") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: shard file(s) missing: {', '.join(missing)}")
        return files, weight_map
    if (model_dir / SINGLE_NAME).is_file():
        return [model_dir / SINGLE_NAME], None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors file")
    return files, None


# ---------------------------------------------------------------------------------------------------------------
# Byte rules
# ---------------------------------------------------------------------------------------------------------------

QUANT_FORMATS = ("nf4", "int8", "q6_k")
EXPERT_FORMATS = ("nf4", "int8")  # the formats of an expert row (q6_k is for dense matrices: the head)
PLAIN_FORMATS = ("bf16", "fp32", "keep")
Q6_K_BLOCK = (256, 210)  # ggml's Q6_K: values and bytes per block (16 int8 sub-scales and the fp16 d inside)
FORMATS = QUANT_FORMATS + PLAIN_FORMATS
ROW_ALIGN = 16  # bytes; expert-row segments start aligned so fp32 views are legal (and GPU vector loads aligned)


def nf4_sizes(numel: int, blocksize: int) -> tuple[int, int]:
    """Bytes of packed codes (two per byte) and of fp32 absmax (one per block) for ``numel`` NF4 values."""
    return (numel + 1) // 2, math.ceil(numel / blocksize) * 4


def int8_sizes(shape: tuple[int, ...]) -> tuple[int, int]:
    """Bytes of int8 codes and of fp32 per-row scales for a 2-D (or [..., N]) weight."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return math.prod(shape), rows * 4


def q6_k_sizes(shape: tuple[int, ...]) -> tuple[int, int]:
    """Bytes of the Q6_K blocks of a [..., N] weight (N a multiple of 256) and of its separate scales (none: each
    block holds its own)."""
    elems, nbytes = Q6_K_BLOCK
    return math.prod(shape) // elems * nbytes, 0


def quantized_sizes(shape: tuple[int, ...], fmt: str, blocksize: int = 64) -> tuple[int, int]:
    """(code bytes, scale bytes) of a tensor of ``shape`` in ``fmt``."""
    if fmt == "nf4":
        return nf4_sizes(math.prod(shape), blocksize)
    if fmt == "int8":
        return int8_sizes(shape)
    if fmt == "q6_k":
        return q6_k_sizes(shape)
    raise ValueError(f"not a quantized format: {fmt!r}")


def _align(n: int, a: int = ROW_ALIGN) -> int:
    return (n + a - 1) // a * a


def expert_row_layout(
    hidden_size: int, intermediate_size: int, fmt: str, blocksize: int = 64
) -> tuple[tuple[tuple[int, int], ...], int]:
    """((offset, nbytes) of [gate_up codes, down codes, gate_up scales, down scales], row bytes) of one quantized
    expert as the cache and the offload slots store it: gate_up [2I, D], down [D, I], each segment aligned."""
    gu_c, gu_s = quantized_sizes((2 * intermediate_size, hidden_size), fmt, blocksize)
    dn_c, dn_s = quantized_sizes((hidden_size, intermediate_size), fmt, blocksize)
    off, segs = 0, []
    for n in (gu_c, dn_c, gu_s, dn_s):
        segs.append((off, n))
        off = _align(off + n)
    return tuple(segs), off


def expert_tensor_bytes(
    num_experts: int, hidden_size: int, intermediate_size: int, fmt: str, blocksize: int = 64
) -> tuple[int, int]:
    """(gate_up bytes, down bytes) of a quantized fused expert bank, counted as the cache manifest records them:
    gate_up = its codes + scales per expert, down = the rest of the row (alignment padding included)."""
    segs, row = expert_row_layout(hidden_size, intermediate_size, fmt, blocksize)
    gu = segs[0][1] + segs[2][1]
    return num_experts * gu, num_experts * (row - gu)


def _elems(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# format -> bytes of a plain (non-expert) tensor of that shape in that format
FORMAT_BYTES: dict[str, Callable[[tuple[int, ...]], int]] = {
    "nf4": lambda s: sum(nf4_sizes(_elems(s), 64)),
    "int8": lambda s: sum(int8_sizes(s)),
    "q6_k": lambda s: sum(q6_k_sizes(s)),
    "bf16": lambda s: 2 * _elems(s),
    "fp16": lambda s: 2 * _elems(s),
    "fp32": lambda s: 4 * _elems(s),
}


# ---------------------------------------------------------------------------------------------------------------
# The quantization policy table
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row of the policy table: tensors whose name matches ``pattern`` (``re.search``) get ``fmt``."""

    pattern: str
    fmt: str  # "nf4" | "int8" | "q6_k" | "bf16" | "fp32" | "keep"
    placement: str = "device"  # "device" | "host" (the embedding lookup can stay in system RAM)
    why: str = ""


@dataclass(frozen=True)
class QuantPolicy:
    """Declarative quantization policy: first matching rule wins; no match means ``keep`` on the device."""

    name: str
    rules: tuple[Rule, ...]
    blocksize: int = 64
    _compiled: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for rule in self.rules:
            if rule.fmt not in FORMATS:
                raise ConfigError(f"quant policy {self.name!r}: rule {rule.pattern!r} has unknown format {rule.fmt!r}")
            if rule.placement not in ("device", "host"):
                raise ConfigError(
                    f"quant policy {self.name!r}: rule {rule.pattern!r} has unknown placement {rule.placement!r}"
                )
        object.__setattr__(self, "_compiled", tuple(re.compile(r.pattern) for r in self.rules))

    def rule_for(self, name: str) -> Rule | None:
        for rx, rule in zip(self._compiled, self.rules):
            if rx.search(name):
                return rule
        return None

    def format_of(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        """Format for a tensor. Quantized formats apply only to tensors with >= 2 dims and an even size; q6_k only
        to 2-D rows of whole 256-value blocks (else int8: the tiny models' narrow heads)."""
        rule = self.rule_for(name)
        fmt = rule.fmt if rule else "keep"
        if fmt in QUANT_FORMATS and shape is not None and (len(shape) < 2 or math.prod(shape) % 2):
            return "keep"
        if fmt == "q6_k" and shape is not None and (len(shape) != 2 or shape[-1] % Q6_K_BLOCK[0]):
            return "int8"
        return fmt

    def stored_format(self, name: str, shape: tuple[int, ...], stored: str) -> str:
        """The format a tensor stored as ``stored`` ends up in ("keep" resolved to the stored format)."""
        fmt = self.format_of(name, shape)
        return stored if fmt == "keep" else fmt

    def placement_of(self, name: str) -> str:
        rule = self.rule_for(name)
        return rule.placement if rule else "device"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "blocksize": self.blocksize, "rules": [asdict(r) for r in self.rules]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantPolicy":
        return cls(name=data["name"], blocksize=int(data["blocksize"]), rules=tuple(Rule(**r) for r in data["rules"]))

    @property
    def hash(self) -> str:
        """Short stable hash of the policy (names the cache folder)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def make_policy(
    experts: str = "nf4",
    attention: str = "int8",
    shared_expert: str = "int8",
    lm_head: str = "int8",
    embedding_on_host: bool = True,
    blocksize: int = 64,
    name: str | None = None,
) -> QuantPolicy:
    """The policy table. Arguments pick the format of each quantizable group; the rest is fixed:
    router, norms, A_log, dt_bias, conv1d, GDN a/b projections and Clover extras stay unquantized.

    By the numbers (35B-A3B shapes, 16K context):
    * routed experts are 93 % of the weights and only 8 of 256 run per token: NF4 (4.5 bits), 16.9 GiB.
    * dense projections (attention + GDN + shared experts, 1.41 B params): int8 1.42 GB, NF4 0.80 GB. The 0.62 GB
      is 1.4 expert layers: at 16 GiB NF4 keeps 25 layers resident against int8's 23. int8 is the default anyway:
      this path runs for every token of every denoising pass, and block diffusion commits a position only above
      0.95 confidence, so noise here costs tokens per pass; expert error is averaged over 8 experts and a shared
      one. ``attention="nf4", shared_expert="nf4"`` is the small-card option.
    * lm_head int8: 0.51 GB instead of 1.02 GB bf16, above 4 bits as llama.cpp's Q4_K_M keeps its output head.
      ``lm_head="q6_k"`` (llama.cpp's Q6_K blocks, 6.56 bits): 0.42 GB, read by the CPU kernels; the CPU default
      (:func:`policy_for`).
    """
    if experts not in EXPERT_FORMATS + PLAIN_FORMATS:
        raise ConfigError(f"expert format must be one of {EXPERT_FORMATS + PLAIN_FORMATS}, got {experts!r}")
    rules = (
        # --- kept precise: small, and errors here change routing or recurrence decay ---
        Rule(r"mlp\.gate\.weight$", "keep", why="router: top-k choice is sensitive"),
        Rule(r"shared_expert_gate\.weight$", "keep", why="shared expert gate: [1, D]"),
        Rule(r"(norm|layernorm)\.weight$", "keep", why="norms"),
        Rule(r"\.(A_log|dt_bias)$", "keep", why="GDN decay parameters"),
        Rule(r"conv1d\.weight", "keep", why="GDN short conv (incl. Clover weight_right)"),
        Rule(r"ssm_bd_|bd_history|bd_logit_scale", "keep", why="Clover block-diffusion extras"),
        Rule(r"linear_attn\.in_proj_(a|b|ba)\.weight$", "keep", why="GDN beta/decay inputs: [32, D]"),
        # --- quantized ---
        Rule(r"mlp\.experts\.(gate_up_proj|down_proj)$", experts, why="routed experts, fused [E, ., .]"),
        Rule(r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", experts, why="routed experts, per expert"),
        Rule(r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$", shared_expert, why="shared expert"),
        Rule(r"linear_attn\.(in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)\.weight$", attention, why="GDN projections"),
        Rule(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", attention, why="attention projections"),
        Rule(r"(^|\.)lm_head\.weight$", lm_head, why="output head"),
        Rule(r"embed_tokens\.weight$", "keep", placement="host" if embedding_on_host else "device", why="lookup only"),
    )
    auto = name or f"experts-{experts}.attn-{attention}.shared-{shared_expert}.head-{lm_head}.bs{blocksize}"
    return QuantPolicy(name=auto, rules=rules, blocksize=blocksize)


DEFAULT_POLICY = make_policy()
# The CPU's default: the head in Q6_K blocks, read in place by the CPU kernels (engine.kernels.cpu_quant) as the GGUF
# path reads llama.cpp's Q6_K head: 417 MB a token at Clover's vocabulary against INT8's 509 (docs/STATUS.md, "The
# engine's own cache on the same kernels"). GPUs keep DEFAULT_POLICY's INT8 head (fused int8 kernel, opt-in; a Q6_K
# head there would be dequantized per forward) and the planner, which plans cards, counts it.
CPU_POLICY = make_policy(lm_head="q6_k")
# The head and the dense projections (attention, Gated DeltaNet, shared experts) in Q6_K blocks, all read by the same
# CPU kernel: ~6.56 bits a weight against INT8's 8 + a per-row scale. Rows that are not whole 256-value blocks stay
# INT8 (QuantPolicy.format_of). Not the default: at 4 real-width layers it reads 601 MB a token against 626 and AR
# runs ~1.06x, but its KL from the BF16 weights is 1.89e-3 against 1.54e-3, further above the 1e-3 bound
# (docs/STATUS.md, "The dense projections in Q6_K too").
CPU_Q6_DENSE_POLICY = make_policy(attention="q6_k", shared_expert="q6_k", lm_head="q6_k")


def policy_for(device: object = "cpu") -> QuantPolicy:
    """The default policy of the quantized cache for a model placed on ``device`` ("cpu", "cuda:0", a torch device):
    :data:`CPU_POLICY` on the CPU, :data:`DEFAULT_POLICY` elsewhere. Each policy has its own cache folder."""
    return CPU_POLICY if str(device).split(":")[0] == "cpu" else DEFAULT_POLICY


def is_expert_tensor(name: str) -> bool:
    return re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$|mlp\.experts\.\d+\.", name) is not None


# The 16 NF4 code values (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) normalized to [-1, 1], with an exact 0.
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
