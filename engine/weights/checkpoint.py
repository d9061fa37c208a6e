"""Hugging Face safetensors checkpoints: reading (index, shards, header validation), the one ``sanitize`` place
for names and shapes, loading into :class:`engine.model.clover.CloverModel`, and the in-memory writer for tests /
tiny models (checkpoints too big to hold in memory: :mod:`engine.weights.streaming_writer`).

Checkpoint names (official): ``model.language_model.*`` (qwen3_5_moe / clover_moe) or ``model.*``
(qwen3_5_moe_text), plus ``lm_head.weight``; ``model.visual.*`` and ``mtp.*`` are ignored. Experts come fused
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]) or per expert
(``mlp.experts.N.{gate,up,down}_proj.weight``, what transformers' save_pretrained writes); both load.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError, CheckpointError
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import CloverConfig, load_config
from clover_desk.engine.model.gdn import GatedDeltaNet, ParamHolder
from clover_desk.engine.weights.formats import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    TORCH_DTYPE_NAMES,
    HeaderEntry,
    checkpoint_files,
)
from clover_desk.engine.weights.formats import read_safetensors_header as read_safetensors_header_raw

log = logging.getLogger(__name__)


# safetensors tag -> torch dtype, derived from the one dtype table (engine.weights.formats)
TORCH_DTYPES: dict[str, torch.dtype] = {
    tag: getattr(torch, TORCH_DTYPE_NAMES[fmt]) for tag, (fmt, _) in SAFETENSORS_DTYPES.items()
}
_CLOVER_EXTRAS = ("bd_history.weight", "bd_history.bias", "bd_logit_scale.weight", "conv1d.weight_right")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# ----------------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------------


TensorEntry = HeaderEntry  # one tensor as the file header describes it (engine.weights.formats)


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors header; a truncated or malformed file is a CheckpointError naming it."""
    return read_safetensors_header_raw(path)[0]


def check_finite(tensor: Tensor, file: Path | str, name: str, first_row: int = 0) -> None:
    """Refuse weights holding NaN or infinity: such a model generates noise without a word, so loading stops with
    one line naming the file and the tensor. ``tensor`` may be rows ``first_row..`` of the tensor ``name``.

    One fp32-accumulated sum is the whole cost for a healthy tensor (a NaN or an infinity anywhere makes it
    non-finite); only then are the bad values counted (a sum that merely overflowed finds none, and passes)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    if math.isfinite(float(torch.sum(tensor, dtype=torch.float32))):
        return
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    if count == 0:
        return
    first = int(bad.reshape(-1).nonzero()[0, 0])
    row = first_row + (first // max(math.prod(tensor.shape[1:]), 1) if tensor.dim() > 1 else first)
    where = f"row {row}" if tensor.dim() > 1 else f"index {row}"
    nans = int(torch.isnan(tensor).sum())
    kinds = " and ".join(k for k, n in (("NaN", nans), ("infinite", count - nans)) if n)
    raise CheckpointError(
        f"{file}: tensor {name!r} holds {count:,} {kinds} value{'s' if count > 1 else ''} (the first in {where}): "
        f"the weights are damaged and would generate noise"
    )


class StateDictSource:
    """An in-memory state dict behind the :class:`CheckpointReader` interface (``entries``, ``read``)."""

    def __init__(self, state_dict: dict[str, Tensor], label: str = "<state dict>") -> None:
        self.model_dir = Path(label)
        self._sd = state_dict
        self.entries = {
            name: TensorEntry(name, self.model_dir, str(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            for name, t in state_dict.items()
        }

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> Tensor:
        return self._sd[name]


class CheckpointReader:
    """All tensors of a model folder, read lazily one at a time. Headers are validated up front."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        files, weight_map = checkpoint_files(self.model_dir)
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            for name, entry in read_safetensors_header(path).items():
                self.entries[name] = entry
        if weight_map is not None:
            for name, fname in weight_map.items():
                entry = self.entries.get(name)
                if entry is None or entry.file.name != Path(fname).name:
                    raise CheckpointError(f"{self.model_dir / fname}: tensor {name!r} is listed in {INDEX_NAME} but not in the file")
        self._handles: dict[Path, Any] = {}

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def names(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str) -> Tensor:
        """The tensor ``name`` (CPU, stored dtype)."""
        entry = self.entries[name]
        handle = self._handles.get(entry.file)
        if handle is None:
            try:
                handle = safe_open(str(entry.file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error type for a bad file
                raise CheckpointError(f"{entry.file}: cannot open ({exc})") from None
            self._handles[entry.file] = handle
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error type for a bad file
            raise CheckpointError(f"{entry.file}: cannot read tensor {name!r} ({exc})") from None
        check_finite(tensor, entry.file, name)
        return tensor

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# sanitize: every name / shape fix in one place
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: model parameter ``name``, and ``index`` into it for per-expert pieces
    (``(expert, row_slice)`` or ``(expert,)``), None for the whole parameter."""

    name: str
    index: tuple | None = None


def sanitize_name(name: str, config: CloverConfig) -> Target | None:
    """Map a checkpoint name to a model parameter, or None for tensors the text model does not use."""
    if name == "lm_head.weight":
        return Target(name)
    if name.startswith(("model.visual.", "mtp.", "visual.")):
        return None
    stripped = None
    for prefix in (config.weight_prefix, "model.language_model.", "model."):
        if prefix and name.startswith(prefix):
            stripped = name[len(prefix) :]
            break
    if stripped is None and name.startswith(("layers.", "embed_tokens.", "norm.")):
        stripped = name  # already without prefix (a state dict from random_state_dict)
    if stripped is None:
        return None
    m = _PER_EXPERT.match(stripped)
    if m:
        base, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        inter = config.moe_intermediate_size
        if proj == "gate_proj":
            return Target(f"{base}.gate_up_proj", (expert, slice(0, inter)))
        if proj == "up_proj":
            return Target(f"{base}.gate_up_proj", (expert, slice(inter, 2 * inter)))
        return Target(f"{base}.down_proj", (expert,))
    # Clover spellings seen in GGUF-style exports, mapped to the module names
    stripped = stripped.replace(".linear_attn.ssm_bd_history.", ".linear_attn.bd_history.")
    stripped = stripped.replace(".linear_attn.ssm_bd_logit_scale.", ".linear_attn.bd_logit_scale.")
    if stripped.endswith(".linear_attn.bd_logit_scale"):
        stripped += ".weight"
    return Target(stripped)


def sanitize_shape(target: Target, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a checkpoint tensor has after :func:`sanitize_tensor`."""
    if target.name.endswith("linear_attn.conv1d.weight") and len(shape) == 2:
        return (shape[0], 1, shape[1])
    if target.name.endswith("linear_attn.conv1d.weight_right") and len(shape) == 3 and shape[1] == 1:
        return (shape[0], shape[2])
    if target.name.endswith("linear_attn.bd_logit_scale.weight") and len(shape) == 0:
        return (1,)
    return shape


def sanitize_tensor(target: Target, tensor: Tensor) -> Tensor:
    """Shape fixes: conv1d.weight [C, K] -> [C, 1, K]; weight_right [C, 1, Kr] -> [C, Kr]; scalar scale -> [1]."""
    return tensor.reshape(sanitize_shape(target, tuple(tensor.shape)))


def sanitize(name: str, tensor: Tensor, config: CloverConfig) -> tuple[Target, Tensor] | None:
    """One checkpoint tensor -> (target parameter, fixed tensor), or None when the text model ignores it."""
    target = sanitize_name(name, config)
    if target is None:
        return None
    return target, sanitize_tensor(target, tensor)


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = TORCH_DTYPE_NAMES.get(dtype, dtype)  # "bf16" or "bfloat16"
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not one of float32, bfloat16, float16 (or fp32, bf16, fp16)")
    return getattr(torch, name)


def _slice_shape(full: tuple[int, ...], index: tuple | None) -> tuple[int, ...]:
    if index is None:
        return full
    return tuple(torch.empty(full, device="meta")[index].shape)


@dataclass
class LoadPlan:
    """Which checkpoint tensor fills which parameter (shapes already checked)."""

    targets: dict[str, Target]  # checkpoint name -> target
    ignored: list[str]
    neutral_layers: list[int]  # GDN layers without Clover extras


def plan_load(model: CloverModel, reader: CheckpointReader) -> LoadPlan:
    """Check names and shapes against ``model`` (which may live on the meta device) before reading any data.

    Adapts Clover extras to the shapes the checkpoint has and drops absent ones (neutral).
    Raises CheckpointError naming the tensor, the file and both shapes on a mismatch, or the missing tensor.
    """
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, Target] = {}
    ignored: list[str] = []
    covered: dict[str, set] = {}
    for name, entry in reader.entries.items():
        target = sanitize_name(name, config)
        if target is None or target.name not in params and not _is_extra(target.name):
            ignored.append(name)
            continue
        shape = sanitize_shape(target, entry.shape)
        if _is_extra(target.name):
            _adapt_extra(model, target.name, shape, entry)
            params = dict(model.named_parameters(remove_duplicate=False))
        param = params[target.name]
        want = _slice_shape(tuple(param.shape), target.index)
        if shape != want:
            raise CheckpointError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, the model expects {list(want)} "
                f"for {target.name}"
            )
        targets[name] = target
        covered.setdefault(target.name, set()).add(None if target.index is None else target.index[0])
    # what is missing
    neutral_layers: list[int] = []
    tied = config.tie_word_embeddings
    for pname, param in list(model.named_parameters(remove_duplicate=False)):
        got = covered.get(pname)
        if pname == "lm_head.weight" and tied:
            continue
        if _is_extra(pname):
            if got is None:
                layer = int(pname.split(".")[1])
                _drop_extra(model, pname)
                if layer not in neutral_layers:
                    neutral_layers.append(layer)
            continue
        if got is None:
            raise CheckpointError(f"{reader.model_dir}: tensor {pname!r} is missing from the checkpoint")
        if None not in got:  # per-expert pieces: every expert must be there
            experts = param.shape[0]
            if len(got) != experts:
                lost = min(set(range(experts)) - got)
                raise CheckpointError(f"{reader.model_dir}: tensor {pname!r} is missing expert {lost} (per-expert layout)")
    if neutral_layers:
        log.info("checkpoint has no Clover block-mode tensors for GDN layers %s: they run neutral", neutral_layers)
    if ignored:
        log.info("ignoring %d checkpoint tensors the text model does not use (e.g. %s)", len(ignored), ignored[0])
    return LoadPlan(targets, ignored, sorted(neutral_layers))


def meta_model(config: CloverConfig, reader: CheckpointReader, dtype: torch.dtype = torch.float32) -> CloverModel:
    """The model ``config`` describes on the meta device (no memory), with Clover's block-mode tensors when the
    config is Clover's or the checkpoint has them: what :func:`plan_load` checks a checkpoint against."""
    extras = config.is_diffusion or any(".bd_history." in n or n.endswith("weight_right") for n in reader.entries)
    return CloverModel(config, dtype=dtype, device="meta", clover_extras=extras)


def check_checkpoint(model_dir: str | Path, config: CloverConfig) -> LoadPlan:
    """Check every tensor's name and shape (headers only) against the sizes config.json claims, before anything is
    sized from either; a mismatch is a CheckpointError naming the tensor, the file and both shapes."""
    with CheckpointReader(model_dir) as reader:
        return plan_load(meta_model(config, reader), reader)


def _is_extra(pname: str) -> bool:
    return ".linear_attn." in pname and pname.endswith(_CLOVER_EXTRAS)


def _gdn_of(model: CloverModel, pname: str) -> GatedDeltaNet:
    layer = int(pname.split(".")[1])
    return model.layers[layer].linear_attn


def _adapt_extra(model: CloverModel, pname: str, shape: tuple[int, ...], entry: TensorEntry) -> None:
    """Give a Clover tensor the checkpoint's shape if it is one of the accepted forms."""
    parts = pname.split(".")
    if not (parts[0] == "layers" and parts[2] == "linear_attn") or not hasattr(model.layers[int(parts[1])], "linear_attn"):
        raise CheckpointError(f"{entry.file}: tensor {entry.name!r} names a linear-attention layer that does not exist")
    gdn = _gdn_of(model, pname)
    rel = ".".join(parts[3:])
    accepted = gdn.accepted_extra_shapes(rel)
    if shape not in accepted:
        raise CheckpointError(
            f"{entry.file}: tensor {entry.name!r} has shape {list(entry.shape)}, expected one of "
            f"{[list(s) for s in accepted[:5]]}{' ...' if len(accepted) > 5 else ''}"
        )
    ref = gdn.in_proj_b.weight
    new = torch.nn.Parameter(torch.empty(shape, dtype=ref.dtype, device=ref.device), requires_grad=False)
    if rel == "conv1d.weight_right":
        gdn.conv1d.weight_right = new
        return
    holder_name, leaf = rel.split(".")
    holder = getattr(gdn, holder_name)
    if holder is None:
        holder = ParamHolder(shape, shape if leaf == "bias" else None).to(device=ref.device, dtype=ref.dtype)
        setattr(gdn, holder_name, holder)
    setattr(holder, leaf, new)


def _drop_extra(model: CloverModel, pname: str) -> None:
    gdn = _gdn_of(model, pname)
    rel = ".".join(pname.split(".")[3:])
    if rel == "conv1d.weight_right":
        gdn.conv1d.weight_right = None
    elif rel == "bd_history.bias" and gdn.bd_history is not None:
        gdn.bd_history.bias = None
    elif rel in ("bd_history.weight",):
        gdn.bd_history = None
    elif rel == "bd_logit_scale.weight":
        gdn.bd_logit_scale = None


def materialize(model: CloverModel, device: torch.device | str) -> None:
    """Allocate (uninitialized) storage on ``device`` for every parameter still on the meta device; parameters
    that already live somewhere (e.g. a swapped-in expert bank) are left alone."""
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[pname] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False
                )
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def load_state(
    model: CloverModel,
    reader: CheckpointReader,
    plan: LoadPlan,
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    consume: Callable[[str, Target, Tensor], bool] | None = None,
) -> None:
    """Copy every planned tensor into ``model`` (already materialized), one tensor at a time.

    ``consume(checkpoint_name, target, tensor)``, when given, sees each sanitized tensor first; returning True
    means it took the tensor (e.g. an expert store) and nothing is copied into the model.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    total = sum(reader.entries[n].nbytes for n in plan.targets)
    done = 0
    for name, target in plan.targets.items():
        if cancel is not None and cancel.is_set():
            raise CancelledError(f"loading {reader.model_dir} was cancelled")
        tensor = sanitize_tensor(target, reader.read(name))
        if consume is None or not consume(name, target, tensor):
            param = params.get(target.name)
            if param is None:
                raise CheckpointError(f"{reader.entries[name].file}: tensor {name!r} has no parameter {target.name!r} in the model")
            dst = param.data if target.index is None else param.data[target.index]
            dst.copy_(tensor)  # converts dtype and device in one copy
        done += reader.entries[name].nbytes
        if progress is not None:
            progress(LoadProgress(stage="reading", done_bytes=done, total_bytes=total, current=name))


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    config: CloverConfig | None = None,
) -> CloverModel:
    """Read a Hugging Face model folder into a :class:`CloverModel` on ``device`` in ``dtype``.

    Internal: the layer ``engine.api.Engine.load`` reads an unquantized precision with ("f32", "bf16", "f16");
    engines are built by ``Engine.load`` (docs/loading.md), this is called by it and by the tests of this layer.

    Every expected tensor must be present with the right shape (else CheckpointError naming tensor, file and
    shapes); ``progress`` gets LoadProgress(stage="reading", bytes done/total, tensor name) per tensor, then
    stage "done"; setting ``cancel`` raises CancelledError between tensors.
    """
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    dtype = _as_dtype(dtype)
    with CheckpointReader(model_dir) as reader:
        model = meta_model(config, reader, dtype)
        plan = plan_load(model, reader)
        if cancel is not None and cancel.is_set():
            raise CancelledError(f"loading {model_dir} was cancelled")
        materialize(model, device)
        load_state(model, reader, plan, progress, cancel)
    if progress is not None:
        total = sum(reader.entries[n].nbytes for n in plan.targets)
        progress(LoadProgress(stage="done", done_bytes=total, total_bytes=total, current=""))
    model.eval()
    return model


def model_from_state_dict(
    config: CloverConfig,
    state_dict: dict[str, Tensor],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> CloverModel:
    """Build a model straight from a state dict (names with or without the weight prefix), with the same checks
    and sanitizing as :func:`load_model`."""
    source = StateDictSource(state_dict)
    extras = config.is_diffusion or any(".bd_history." in n or n.endswith("weight_right") for n in source.entries)
    model = CloverModel(config, dtype=_as_dtype(dtype), device="meta", clover_extras=extras)
    plan = plan_load(model, source)  # type: ignore[arg-type]
    materialize(model, device)
    load_state(model, source, plan)  # type: ignore[arg-type]
    return model.eval()


# ----------------------------------------------------------------------------------------------------------------
# writing (tests, tiny models)
# ----------------------------------------------------------------------------------------------------------------


def random_state_dict(
    config: CloverConfig,
    seed: int = 0,
    clover_extras: bool | str = True,
    expert_layout: str = "fused",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """Random weights for ``config`` with realistic scales (outputs are not degenerate), names without the weight
    prefix (``embed_tokens.weight``, ``layers.N...``, ``lm_head.weight``): :func:`write_checkpoint` adds it.

    clover_extras: True = non-zero Clover tensors per GDN layer; "neutral" = present but neutral (right conv 0,
    history logit +1e4 so the history unit takes all the weight); False = absent.
    expert_layout: "fused" (gate_up_proj / down_proj) or "per_expert" (experts.N.{gate,up,down}_proj.weight).
    """
    if expert_layout not in ("fused", "per_expert"):
        raise ValueError(f"expert_layout {expert_layout!r} is not 'fused' or 'per_expert'")
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def uniform(*shape: int, lo: float, hi: float) -> Tensor:
        return (torch.rand(*shape, generator=gen) * (hi - lo) + lo).to(dtype)

    c = config
    d, v = c.hidden_size, c.vocab_size
    sd: dict[str, Tensor] = {"embed_tokens.weight": normal(v, d, std=1.0)}
    for i in range(c.num_hidden_layers):
        pre = f"layers.{i}."
        sd[pre + "input_layernorm.weight"] = normal(d, std=0.1)
        sd[pre + "post_attention_layernorm.weight"] = normal(d, std=0.1)
        if c.is_full_attention(i):
            a, hd = pre + "self_attn.", c.head_dim
            sd[a + "q_proj.weight"] = normal(c.num_attention_heads * hd * 2, d, std=d**-0.5)
            sd[a + "k_proj.weight"] = normal(c.num_key_value_heads * hd, d, std=d**-0.5)
            sd[a + "v_proj.weight"] = normal(c.num_key_value_heads * hd, d, std=d**-0.5)
            sd[a + "o_proj.weight"] = normal(d, c.num_attention_heads * hd, std=0.5 * (c.num_attention_heads * hd) ** -0.5)
            sd[a + "q_norm.weight"] = normal(hd, std=0.1)
            sd[a + "k_norm.weight"] = normal(hd, std=0.1)
        else:
            g, hv = pre + "linear_attn.", c.linear_num_value_heads
            sd[g + "in_proj_qkv.weight"] = normal(c.conv_dim, d, std=d**-0.5)
            sd[g + "in_proj_z.weight"] = normal(c.value_dim, d, std=d**-0.5)
            sd[g + "in_proj_b.weight"] = normal(hv, d, std=d**-0.5)
            sd[g + "in_proj_a.weight"] = normal(hv, d, std=d**-0.5)
            sd[g + "conv1d.weight"] = normal(c.conv_dim, 1, c.linear_conv_kernel_dim, std=0.5)
            sd[g + "dt_bias"] = uniform(hv, lo=-1.0, hi=1.0).float()
            sd[g + "A_log"] = uniform(hv, lo=math.log(0.05), hi=math.log(2.0)).float()
            sd[g + "norm.weight"] = uniform(c.linear_value_head_dim, lo=0.5, hi=1.5)
            sd[g + "out_proj.weight"] = normal(d, c.value_dim, std=0.5 * c.value_dim**-0.5)
            if clover_extras:
                neutral = clover_extras == "neutral"
                sd[g + "bd_history.weight"] = normal(hv, d, std=d**-0.5)
                sd[g + "bd_history.bias"] = torch.full((hv,), 1e4, dtype=dtype) if neutral else normal(hv, std=1.0)
                sd[g + "bd_logit_scale.weight"] = uniform(hv, lo=0.8, hi=1.2)
                kr = c.linear_conv_kernel_dim
                sd[g + "conv1d.weight_right"] = (
                    torch.zeros(c.conv_dim, kr, dtype=dtype) if neutral else normal(c.conv_dim, kr, std=0.3)
                )
        m, e, inter = pre + "mlp.", c.num_experts, c.moe_intermediate_size
        sd[m + "gate.weight"] = normal(e, d, std=2.0 * d**-0.5)
        gate_up = normal(e, 2 * inter, d, std=d**-0.5)
        down = normal(e, d, inter, std=0.5 * inter**-0.5)
        if expert_layout == "fused":
            sd[m + "experts.gate_up_proj"] = gate_up
            sd[m + "experts.down_proj"] = down
        else:
            for j in range(e):
                sd[m + f"experts.{j}.gate_proj.weight"] = gate_up[j, :inter].clone()
                sd[m + f"experts.{j}.up_proj.weight"] = gate_up[j, inter:].clone()
                sd[m + f"experts.{j}.down_proj.weight"] = down[j].clone()
        si = c.shared_expert_intermediate_size
        sd[m + "shared_expert.gate_proj.weight"] = normal(si, d, std=d**-0.5)
        sd[m + "shared_expert.up_proj.weight"] = normal(si, d, std=d**-0.5)
        sd[m + "shared_expert.down_proj.weight"] = normal(d, si, std=0.5 * si**-0.5)
        sd[m + "shared_expert_gate.weight"] = normal(1, d, std=d**-0.5)
    sd["norm.weight"] = normal(d, std=0.1)
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = normal(v, d, std=d**-0.5)
    return sd


def checkpoint_prefix(config_dict: dict[str, Any]) -> str:
    """The official weight prefix for a config.json dict."""
    if config_dict.get("model_type") == "qwen3_5_moe_text":
        return "model."
    return str(config_dict.get("weight_prefix", "model.language_model."))


def write_checkpoint(
    model_dir: str | Path,
    state_dict: dict[str, Tensor],
    config_dict: dict[str, Any] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> list[Path]:
    """Write ``state_dict`` (names without prefix) as sharded safetensors with the official names, plus
    ``config.json`` when ``config_dict`` is given. One shard -> ``model.safetensors``; more -> numbered shards and
    ``model.safetensors.index.json``. Returns the shard paths."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    prefix = checkpoint_prefix(config_dict or {})
    named: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        full = name if name == "lm_head.weight" or name.startswith(("model.", "mtp.")) else prefix + name
        named[full] = tensor.detach().contiguous().cpu()
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    paths: list[Path] = []
    if len(shards) == 1:
        paths.append(model_dir / SINGLE_NAME)
        _save_shard(shards[0], paths[0])
    else:
        weight_map: dict[str, str] = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            _save_shard(shard, model_dir / fname)
            paths.append(model_dir / fname)
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in named.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (model_dir / INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    if config_dict is not None:
        (model_dir / "config.json").write_text(json.dumps(config_dict, indent=2), encoding="utf-8")
    return paths


def _save_shard(tensors: dict[str, Tensor], path: Path) -> None:
    """safetensors' ``save_file``, its file then given the mode every other file gets (0666 less the umask): the
    library creates it 0600, so a model folder was half private (the shards) and half not."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """This process's umask (Linux: read from /proc, without changing it; elsewhere set and put back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def iter_model_tensors(model_dir: str | Path, config: CloverConfig) -> Iterator[tuple[Target, Tensor]]:
    """Every text-model tensor of a folder, sanitized, one at a time (for quantizers / offload stores)."""
    with CheckpointReader(model_dir) as reader:
        for name in reader.names():
            target = sanitize_name(name, config)
            if target is not None:
                yield target, sanitize_tensor(target, reader.read(name))
