"""Load a GGUF file as a :class:`engine.model.CloverModel`, keeping quantized tensors in their GGUF blocks.

Every quantized matrix stays as its raw ggml blocks in memory and is dequantized per forward, then multiplied (the
reference path; a fused kernel can replace the module later with the same interface):

* :class:`GGUFLinear` replaces ``nn.Linear`` (``ssm_out``'s tiled input columns are handled by permuting the
  activations, since a K-quant block spans two value heads and cannot be reordered);
* :class:`GGUFExpertBank` replaces the dense expert bank (gate / up / down blocks per expert, through
  :func:`engine.experts.moe_grouped` like every other bank);
* :class:`GGUFEmbedding` replaces the embedding table (only the looked-up rows are dequantized).

Float tensors (F32 / F16 / BF16) become ordinary parameters in the model dtype, so an F32 GGUF of the fork layout
gives the very model its safetensors checkpoint gives. Everything else (names, shapes, Clover extras, checks) goes
through :mod:`engine.checkpoint`'s plan_load / load_state, fed by :class:`GGUFSource`.

Letters: O/N out/in features, E experts, D hidden, I expert intermediate, T tokens, G experts in a group.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import gguf_quants as gq
from engine.checkpoint import LoadPlan, TensorEntry, _as_dtype, load_state, materialize, plan_load
from engine.errors import CancelledError, CheckpointError
from engine.events import LoadProgress
from engine.experts import ExpertBank, moe_grouped
from engine.gguf_file import FLOAT_TYPES, GGUFModelFile, TensorMap, open_gguf, tensor_map
from engine.model import CloverModel
from engine.quant import set_submodule

log = logging.getLogger(__name__)

DEQUANT_CHUNK_ELEMS = 8 << 20  # GGUFLinear dequantizes at most this many weights at once

# raw uint8 [..., row_bytes] + ggml type -> fp32 [..., ncols]
DequantFn = Callable[[Tensor, int], Tensor]


def torch_dequantize(raw: Tensor, qtype: int) -> Tensor:
    return gq.dequantize(raw, qtype)


def _raw_tensor(gf: GGUFModelFile, name: str) -> Tensor:
    """A GGUF tensor's bytes as an owned uint8 tensor [rows..., row_bytes] (copied out of the memory map)."""
    return torch.from_numpy(np.array(gf.tensor_bytes(name), copy=True))


def _rows(t: Tensor, rows: tuple[int, ...] | None) -> Tensor:
    return t if rows is None else t.index_select(0, torch.tensor(rows, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------------
# the source plan_load / load_state read
# ---------------------------------------------------------------------------------------------------------------


class GGUFSource:
    """A GGUF model behind the :class:`engine.checkpoint.CheckpointReader` interface: ``entries`` / ``read`` under
    the model's parameter names, dequantized to fp32 and transformed to Hugging Face order and values.

    ``dequantize`` picks the dequantizer (tests pass ``gguf.quants.dequantize`` to build an independent reference).
    """

    def __init__(self, gf: GGUFModelFile, dequantize: DequantFn = torch_dequantize) -> None:
        self.gf = gf
        self.model_dir = gf.path
        self._deq = dequantize
        self.maps: dict[str, list[TensorMap]] = {}
        for name in gf.tensors:
            tm = tensor_map(gf, name)
            if tm is not None:
                self.maps.setdefault(tm.hf_name, []).append(tm)
        self.entries: dict[str, TensorEntry] = {}
        for hf, maps in self.maps.items():
            tensors = [gf.tensors[m.gguf_name] for m in maps]
            shape = self._shape(hf, maps, [t.shape for t in tensors])
            self.entries[hf] = TensorEntry(hf, tensors[0].file, tensors[0].type_name, shape, sum(t.nbytes for t in tensors),
                                           0)

    @staticmethod
    def _shape(hf: str, maps: list[TensorMap], shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        if maps[0].piece:  # gate + up banks [E, I, D] -> gate_up [E, 2I, D]
            return (shapes[0][0], sum(s[1] for s in shapes), shapes[0][2])
        if hf.endswith("shared_expert_gate.weight") and len(shapes[0]) == 1:
            return (1, shapes[0][0])
        return shapes[0]

    def names(self) -> list[str]:
        return list(self.entries)

    def transformed(self, tm: TensorMap) -> Tensor:
        """One GGUF tensor dequantized (fp32) and put in Hugging Face order and values."""
        t = self.gf.tensors[tm.gguf_name]
        raw = torch.from_numpy(np.array(self.gf.tensor_bytes(tm.gguf_name), copy=True))
        w = self._deq(raw, t.qtype)
        if not isinstance(w, Tensor):
            w = torch.from_numpy(np.asarray(w, dtype=np.float32).copy())
        w = w.reshape(t.shape)
        w = _rows(w, tm.rows)
        if tm.cols is not None:
            w = w.index_select(-1, torch.tensor(tm.cols, dtype=torch.long))
        if tm.post == "minus_one":
            w = w - 1.0
        elif tm.post == "a_log_from_neg_exp":
            w = torch.log(-w)
        return w

    def read(self, name: str) -> Tensor:
        maps = self.maps[name]
        if maps[0].piece:
            order = {"gate": 0, "up": 1}
            parts = sorted(maps, key=lambda m: order[m.piece])
            return torch.cat([self.transformed(m) for m in parts], dim=1)  # [E, 2I, D]
        w = self.transformed(maps[0])
        return w.reshape(self.entries[name].shape)


def gguf_state_dict(path: str | Path, dequantize: DequantFn = torch_dequantize, layout: str = "auto") -> tuple[Any, dict[str, Tensor]]:
    """(config, {parameter name: fp32 tensor}) of a GGUF model, every tensor dequantized (a reference model)."""
    gf = open_gguf(path, layout)
    src = GGUFSource(gf, dequantize)
    return gf.config, {name: src.read(name) for name in src.names()}


# ---------------------------------------------------------------------------------------------------------------
# modules holding GGUF blocks
# ---------------------------------------------------------------------------------------------------------------


class GGUFLinear(nn.Module):
    """Drop-in for ``nn.Linear`` (no bias) with a GGUF-quantized weight: ``raw`` uint8 [O, row_bytes] in ggml type
    ``qtype``, dequantized to the input dtype per forward in row chunks. ``in_perm`` (long [N], optional) reorders
    the input features first: the weight's columns are stored in another order than the model's activations."""

    chunk_elems: int = DEQUANT_CHUNK_ELEMS

    def __init__(self, raw: Tensor, qtype: int, in_features: int, in_perm: Tensor | None = None) -> None:
        super().__init__()
        if raw.dim() != 2 or raw.dtype != torch.uint8:
            raise CheckpointError(f"GGUFLinear: raw blocks must be uint8 [O, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
        if gq.row_bytes(qtype, in_features) != raw.shape[1]:
            raise CheckpointError(f"GGUFLinear: {raw.shape[1]} bytes per row do not hold {in_features} {gq.TYPE_NAMES[qtype]} values")
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.register_buffer("raw", raw)
        self.in_perm: Tensor | None
        self.register_buffer("in_perm", in_perm)

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> Tensor:
        """The weight [O, N] (or rows r0..r1), in the stored column order, in ``dtype``."""
        r0, r1 = rows or (0, self.out_features)
        return gq.dequantize(self.raw[r0:r1], self.qtype, self.in_features).to(dtype)

    @property
    def weight(self) -> Tensor:
        """The weight [O, N] in the model's column order, fp32 (for code that reads ``linear.weight``)."""
        w = self.dequantized(torch.float32)
        if self.in_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.in_perm, w)
        return w

    def forward(self, x: Tensor) -> Tensor:
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)  # [.., N] in the stored column order
        step = max(1, self.chunk_elems // self.in_features)
        if step >= self.out_features:
            return F.linear(x, self.dequantized(x.dtype))  # [.., O]
        parts = [F.linear(x, self.dequantized(x.dtype, (r0, min(r0 + step, self.out_features))))
                 for r0 in range(0, self.out_features, step)]
        return torch.cat(parts, dim=-1)  # [.., O]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={gq.TYPE_NAMES[self.qtype]}"


class GGUFEmbedding(nn.Module):
    """Drop-in for ``nn.Embedding`` with a GGUF-quantized table: only the looked-up rows are dequantized.

    ``weight`` is the raw block table (uint8 [V, row_bytes]): the model reads only its device from it."""

    def __init__(self, raw: Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype = qtype
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = embedding_dim
        self.out_dtype = dtype
        self.register_buffer("raw", raw)

    @property
    def weight(self) -> Tensor:
        return self.raw

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1))  # [T, row_bytes]
        out = gq.dequantize(rows, self.qtype, self.embedding_dim).to(self.out_dtype)
        return out.reshape(*ids.shape, self.embedding_dim)


class GGUFExpertBank(ExpertBank):
    """The routed experts of one layer as GGUF blocks: ``gate`` / ``up`` uint8 [E, I, rb] and ``down`` uint8
    [E, D, rb'] (each bank its own ggml type, as Q4_K_M mixes them). Used experts are dequantized per group and
    run through :func:`engine.experts.moe_grouped`, so it equals a dense bank holding the dequantized weights."""

    def __init__(self, gate: Tensor, up: Tensor, down: Tensor, qtypes: tuple[int, int, int], hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts = gate.shape[0]
        self.hidden_size = hidden
        self.intermediate_size = inter
        self.qtypes = qtypes
        self.register_buffer("gate", gate)
        self.register_buffer("up", up)
        self.register_buffer("down", down)

    def weights(self, ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """ids [G] -> (gate_up [G, 2I, D], down [G, D, I]) in ``dtype``."""
        gq_, uq, dq = self.qtypes
        gate = gq.dequantize(self.gate.index_select(0, ids), gq_, self.hidden_size)  # [G, I, D]
        up = gq.dequantize(self.up.index_select(0, ids), uq, self.hidden_size)  # [G, I, D]
        down = gq.dequantize(self.down.index_select(0, ids), dq, self.intermediate_size)  # [G, D, I]
        return torch.cat([gate, up], dim=1).to(dtype), down.to(dtype)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        return moe_grouped(x, topk_idx, topk_w, self.num_experts, lambda ids: self.weights(ids, x.dtype),
                           3 * self.intermediate_size)

    def extra_repr(self) -> str:
        names = "/".join(gq.TYPE_NAMES[q] for q in self.qtypes)
        return f"experts={self.num_experts}, D={self.hidden_size}, I={self.intermediate_size}, types={names}"


# ---------------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GGUFLoad:
    """What :func:`load_gguf_model` read: the file (config, layout, tokenizer metadata) and the model."""

    file: GGUFModelFile
    model: CloverModel


def _quantized(gf: GGUFModelFile, maps: list[TensorMap]) -> bool:
    return any(gf.tensors[m.gguf_name].qtype not in FLOAT_TYPES for m in maps)


def _swap_quantized(model: CloverModel, src: GGUFSource, plan: LoadPlan, device: torch.device | str,
                    dtype: torch.dtype) -> set[str]:
    """Replace every module whose weight is GGUF-quantized; returns the parameter names now held as blocks."""
    gf, cfg = src.gf, model.config
    taken: set[str] = set()
    modules = dict(model.named_modules())
    banks: set[str] = set()
    for hf, maps in src.maps.items():
        if hf not in plan.targets or not _quantized(gf, maps):
            continue
        if ".mlp.experts." in hf:
            banks.add(hf.rsplit(".", 1)[0])
            continue
        module_name = hf.rsplit(".", 1)[0]
        module = modules.get(module_name)
        tm = maps[0]
        qtype = gf.tensors[tm.gguf_name].qtype
        raw = _raw_tensor(gf, tm.gguf_name)
        if isinstance(module, nn.Embedding):
            new: nn.Module = GGUFEmbedding(raw, qtype, cfg.hidden_size, dtype)
        elif isinstance(module, nn.Linear) and tm.post == "" and raw.dim() == 2:
            perm = None
            if tm.cols is not None:  # x_stored[p] = x_model[cols^-1 ...]: gather the activations in stored order
                inv = torch.empty(len(tm.cols), dtype=torch.long)
                inv[torch.tensor(tm.cols, dtype=torch.long)] = torch.arange(len(tm.cols))
                perm = inv.to(device)
            new = GGUFLinear(_rows(raw, tm.rows).to(device), qtype, module.in_features, perm)
        else:
            continue  # a quantized vector or conv weight: dequantized into its parameter below
        set_submodule(model, module_name, new.to(device))
        taken.add(hf)
    for bank in banks:
        gate_up, down = src.maps[f"{bank}.gate_up_proj"], src.maps[f"{bank}.down_proj"]
        pieces = {m.piece: m for m in gate_up}
        if "gate" not in pieces:  # a fused ffn_gate_up_exps bank: split its rows
            fused = _raw_tensor(gf, gate_up[0].gguf_name)
            half = fused.shape[1] // 2
            g_raw, u_raw = fused[:, :half].contiguous(), fused[:, half:].contiguous()
            g_t = u_t = gf.tensors[gate_up[0].gguf_name].qtype
        else:
            g_raw, u_raw = _raw_tensor(gf, pieces["gate"].gguf_name), _raw_tensor(gf, pieces["up"].gguf_name)
            g_t, u_t = gf.tensors[pieces["gate"].gguf_name].qtype, gf.tensors[pieces["up"].gguf_name].qtype
        d_raw = _raw_tensor(gf, down[0].gguf_name)
        d_t = gf.tensors[down[0].gguf_name].qtype
        new_bank = GGUFExpertBank(g_raw.to(device), u_raw.to(device), d_raw.to(device), (g_t, u_t, d_t),
                                  cfg.hidden_size, cfg.moe_intermediate_size)
        set_submodule(model, bank, new_bank)
        taken.update({f"{bank}.gate_up_proj", f"{bank}.down_proj"})
    return taken


def load_gguf_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    *,
    layout: str = "auto",
    bd_tiled: bool = True,
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    keep_quantized: bool = True,
) -> GGUFLoad:
    """Read a GGUF model (a file, or any part of a split set) into a :class:`CloverModel` on ``device``.

    ``keep_quantized`` False dequantizes everything into ordinary parameters (a reference model). ``layout``:
    "auto" | "fork" | "upstream" (engine.gguf_file). Problems are one-line ConfigError / CheckpointError."""
    gf = open_gguf(path, layout, bd_tiled)
    dtype = _as_dtype(dtype)
    src = GGUFSource(gf)
    extras = gf.has_diffusion
    model = CloverModel(gf.config, dtype=dtype, device="meta", clover_extras=extras)
    plan = plan_load(model, src)  # type: ignore[arg-type]
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"loading {gf.path} was cancelled")
    taken = _swap_quantized(model, src, plan, device, dtype) if keep_quantized else set()
    materialize(model, device)
    rest = LoadPlan({n: t for n, t in plan.targets.items() if t.name not in taken}, plan.ignored, plan.neutral_layers)
    load_state(model, src, rest, progress, cancel)  # type: ignore[arg-type]
    if progress is not None:
        total = gf.total_bytes
        progress(LoadProgress(stage="done", done_bytes=total, total_bytes=total, current=""))
    log.info("loaded %s (%s layout, %d tensors kept as GGUF blocks)", gf.path, gf.layout, len(taken))
    return GGUFLoad(gf, model.eval())


def load_gguf_engine(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    *,
    layout: str = "auto",
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[CloverModel, Any, Any, Any, str | None]:
    """What :class:`engine.api.Engine` needs of a GGUF file: (model, config, generation defaults, tokenizer, why
    diffusion is refused or None). Generation defaults come from a ``generation_config.json`` next to the file, else
    Clover's published ones for the fork layout, else plain greedy."""
    from engine.config import GenerationDefaults, load_generation_defaults
    from engine.gguf_file import load_tokenizer
    from engine.tiny import CLOVER_GENERATION_DEFAULTS

    loaded = load_gguf_model(path, dtype, device, layout=layout, progress=progress, cancel=cancel)
    gf, config = loaded.file, loaded.file.config
    tokenizer = load_tokenizer(gf)
    folder = Path(path).parent
    if (folder / "generation_config.json").is_file():
        defaults = load_generation_defaults(folder, config)
    elif gf.layout == "fork":
        known = {k: v for k, v in CLOVER_GENERATION_DEFAULTS.items() if k in GenerationDefaults.__dataclass_fields__}
        defaults = GenerationDefaults(eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids, **known)
    else:
        defaults = GenerationDefaults(eos_token_ids=tokenizer.eos_token_ids or config.eos_token_ids)
    ar_only = None
    if gf.layout == "upstream":
        ar_only = (f"{gf.path} is in upstream llama.cpp's layout (no block-diffusion tensors, ssm_a = -exp(A_log)), "
                   f"so it runs autoregressively only")
    return loaded.model, config, defaults, tokenizer, ar_only
