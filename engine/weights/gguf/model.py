"""Load a GGUF file as a :class:`engine.model.clover.CloverModel`, keeping quantized tensors in their GGUF blocks.

Every quantized matrix stays as its raw ggml blocks in memory and is dequantized per forward, then multiplied (the
reference path; a fused kernel can replace the module later with the same interface):

* :class:`GGUFLinear` replaces ``nn.Linear`` (``ssm_out``'s tiled input columns are handled by reordering the
  activations with a reshape and a transpose, since a K-quant block spans two value heads and cannot be reordered);
* :class:`GGUFExpertBank` replaces the dense expert bank: one contiguous byte row per expert holding its gate, up and
  down blocks in the file's types (:class:`GGUFExpertLayout`), computed by :func:`engine.weights.quant.routed_forward`
  like the NF4 banks, so :mod:`engine.placement.placer` streams it like them and a streamed expert moves the file's bytes;
* :class:`GGUFEmbedding` replaces the embedding table (only the looked-up rows are dequantized).

Float tensors (F32 / F16 / BF16) become ordinary parameters in the model dtype, so an F32 GGUF of the fork layout
gives the very model its safetensors checkpoint gives. Names, shapes and Clover extras are checked by
:mod:`engine.weights.checkpoint`'s plan_load against :class:`GGUFSource`; then the model is a meta-device skeleton with the
GGUF modules swapped in, and :func:`engine.placement.placer.place_model` reads every tensor once from the file
(:class:`GGUFPlacement`) into the place a VRAM plan gives it (no plan: everything on the device). Under a plan the
streamed layers' rows are copied out of the memory-mapped file into (pinned) host rows: the file keeps an expert's
gate, up and down blocks in three tensors, so one contiguous row per expert is what lets one copy fill one slot,
and the host memory is exactly the plan's ``ram_breakdown["streamed_experts"]``.

Letters: O/N out/in features, E experts, D hidden, I expert intermediate, T tokens, G experts in a group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError, CheckpointError
from clover_desk.engine.kernels import cpu_quant, x8
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import GenerationDefaults, load_generation_defaults
from clover_desk.engine.placement import placer
from clover_desk.engine.weights.checkpoint import LoadPlan, TensorEntry, _as_dtype, plan_load, sanitize_tensor
from clover_desk.engine.weights.gguf import quants as gq
from clover_desk.engine.weights.gguf.file import (
    FLOAT_TYPES,
    FORMAT_OF_TYPE,
    GGUFModelFile,
    TensorMap,
    load_tokenizer,
    open_gguf,
    release_pages,
    tensor_map,
    tiled_to_hf_heads,
)
from clover_desk.engine.weights.quant import RowExpertBank, set_submodule
from clover_desk.engine.weights.tiny import CLOVER_GENERATION_DEFAULTS

log = logging.getLogger(__name__)

DEQUANT_CHUNK_ELEMS = 8 << 20  # GGUFLinear dequantizes at most this many weights at once
COPY_CHUNK_BYTES = 64 << 20  # placement copies a tensor out of the memory map in pieces of at most this size

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
    """A GGUF model behind the :class:`engine.weights.checkpoint.CheckpointReader` interface: ``entries`` / ``read`` under
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
    ``qtype``, dequantized to the input dtype per forward in row chunks.

    ``in_heads`` (Hk, Hv), when given: the weight's input columns are Hv value heads of N / Hv features in GGUF's
    tiled order (gguf head ``a * Hk + b`` is hf head ``b * r + a``, r = Hv / Hk) while the activations group them by
    key head (``ssm_out``). The activations are put in the stored order by a reshape and a transpose: no index
    tensor, so the module holds exactly the file's bytes."""

    chunk_elems: int = DEQUANT_CHUNK_ELEMS

    def __init__(self, raw: Tensor, qtype: int, in_features: int, in_heads: tuple[int, int] | None = None) -> None:
        super().__init__()
        if raw.dim() != 2 or raw.dtype != torch.uint8:
            raise CheckpointError(f"GGUFLinear: raw blocks must be uint8 [O, row_bytes], got {raw.dtype} {tuple(raw.shape)}")
        if gq.row_bytes(qtype, in_features) != raw.shape[1]:
            raise CheckpointError(f"GGUFLinear: {raw.shape[1]} bytes per row do not hold {in_features} {gq.TYPE_NAMES[qtype]} values")
        if in_heads is not None and (in_heads[1] % in_heads[0] or in_features % in_heads[1]):
            raise CheckpointError(f"GGUFLinear: {in_features} input features are not {in_heads[1]} value heads over "
                                  f"{in_heads[0]} key heads")
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = raw.shape[0]
        self.in_heads = in_heads
        self.register_buffer("raw", raw)

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> Tensor:
        """The weight [O, N] (or rows r0..r1), in the stored column order, in ``dtype``."""
        r0, r1 = rows or (0, self.out_features)
        return gq.dequantize(self.raw[r0:r1], self.qtype, self.in_features).to(dtype)

    @property
    def weight(self) -> Tensor:
        """The weight [O, N] in the model's column order, fp32 (for code that reads ``linear.weight``)."""
        w = self.dequantized(torch.float32)
        if self.in_heads is not None:
            hk, hv = self.in_heads
            # [O, r, Hk, dv] stored (tiled) -> [O, Hk, r, dv]: grouped by key head
            w = w.unflatten(1, (hv // hk, hk, self.in_features // hv)).transpose(1, 2).flatten(1)
        return w

    def forward(self, x: Tensor) -> Tensor:
        if self.in_heads is not None:
            hk, hv = self.in_heads
            # [.., Hk, r, dv] grouped by key head -> [.., r, Hk, dv]: the stored (tiled) column order
            x = x.unflatten(-1, (hk, hv // hk, self.in_features // hv)).transpose(-3, -2).flatten(-3)
        if x.device.type == "cpu" and cpu_quant.usable(self.qtype):
            # straight from the blocks: each row read once per call, x rounded to int8 blocks as llama.cpp does
            y = cpu_quant.qmatmul(x.reshape(-1, self.in_features), self.raw, self.qtype)  # [T, O] fp32
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        step = max(1, self.chunk_elems // self.in_features)
        if step >= self.out_features:
            return F.linear(x, self.dequantized(x.dtype))  # [.., O]
        parts = [F.linear(x, self.dequantized(x.dtype, (r0, min(r0 + step, self.out_features))))
                 for r0 in range(0, self.out_features, step)]
        return torch.cat(parts, dim=-1)  # [.., O]

    def cpu_mat(self, heads_ok: bool = False) -> tuple[int, ...] | None:
        """This weight as the CPU kernels' matrix (``engine.kernels.cpu_token.Mat``), or None where they cannot read it
        in place (another device, a type without a kernel; value heads in the stored order unless ``heads_ok``: the
        caller orders its input as ``in_heads`` says)."""
        raw = self.raw
        if (self.in_heads is not None and not heads_ok) or raw.device.type != "cpu" or raw.stride(1) != 1 \
                or not cpu_quant.usable(self.qtype):
            return None
        return (self.qtype, raw.data_ptr(), 0, raw.stride(0), 0, 0, 0, 0)

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


@dataclass(frozen=True)
class GGUFExpertLayout:
    """One expert's GGUF blocks as one contiguous byte row: ``[gate blocks | up blocks | down blocks]``, gate and up
    [I, D] and down [D, I], one ggml row per matrix row, each bank in its file type (Q4_K_M mixes them). The row is
    the expert's bytes in the file, so a streamed expert moves exactly those (Q4_0 at the 35B shape: 1,769,472 B).
    The :class:`engine.weights.quant.RowLayout` of :class:`GGUFExpertBank` and of its streamed slots."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    qtypes: tuple[int, int, int]  # ggml types of gate, up, down
    x8: tuple[bool, bool, bool] = (False, False, False)  # matrices with rows interleaved by 8 (engine.kernels.x8)

    @property
    def kernel_qtypes(self) -> tuple[int, int, int]:
        """The CPU kernels' types of gate, up, down: ``cpu_quant.Q4_KX8`` / ``Q6_KX8`` for the interleaved ones."""
        return tuple(x8.KERNEL_TYPE[q] if on else q for q, on in zip(self.qtypes, self.x8))  # type: ignore[return-value]

    @property
    def segments(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(offset, nbytes) of the gate, up and down blocks in a row."""
        d, i = self.hidden_size, self.intermediate_size
        gate = i * gq.row_bytes(self.qtypes[0], d)
        up = i * gq.row_bytes(self.qtypes[1], d)
        down = d * gq.row_bytes(self.qtypes[2], i)
        return (0, gate), (gate, up), (gate + up, down)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def fmt(self) -> str:
        """``gguf_q4_0``, or ``gguf_q4_k/gguf_q4_k/gguf_q6_k`` (gate/up/down) when the banks differ."""
        names = [FORMAT_OF_TYPE[q] for q in self.qtypes]
        return names[0] if len(set(names)) == 1 else "/".join(names)

    def unpack_rows(self, source: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The experts in rows ``rows`` [G] (long, on source's device) of ``source`` [S, nbytes] uint8 ->
        (gate_up [G, 2I, D], down [G, D, I]) in ``dtype``: each bank of the group dequantized in one call."""
        d, i = self.hidden_size, self.intermediate_size
        if rows.numel() == 1 and rows.device.type == "cpu":  # one row named on the host: views, no gather
            r = int(rows)
            parts = [source[r : r + 1, off : off + n] for off, n in self.segments]  # [1, n] each
        else:  # each segment gathered straight into a contiguous [G, n] (no copy of whole rows)
            parts = [source[:, off : off + n].index_select(0, rows) for off, n in self.segments]
        g = parts[0].shape[0]
        parts = [x8.unpack(p.reshape(g, rows, -1), q) if on else p  # interleaved rows back in the file's order
                 for p, on, rows, q in zip(parts, self.x8, (i, i, d), self.qtypes)]
        gate = gq.dequantize(parts[0].reshape(g, i, -1), self.qtypes[0], d)  # [G, I, D]
        up = gq.dequantize(parts[1].reshape(g, i, -1), self.qtypes[1], d)  # [G, I, D]
        down = gq.dequantize(parts[2].reshape(g, d, -1), self.qtypes[2], i)  # [G, D, I]
        return torch.cat([gate, up], dim=1).to(dtype), down.to(dtype)


class GGUFExpertBank(RowExpertBank):
    """The routed experts of one layer as GGUF blocks: ``packed`` uint8 [E, layout.nbytes], one row per expert
    (:class:`GGUFExpertLayout`). Used experts are dequantized per group and run through
    :func:`engine.model.experts.moe_grouped` (:func:`engine.weights.quant.routed_forward`), so it equals a dense bank holding the
    dequantized weights, and a streamed layer (:mod:`engine.placement.streamed_bank`) computes the same numbers from its slots."""

    def __init__(self, layout: GGUFExpertLayout, packed: Tensor) -> None:
        super().__init__()
        if tuple(packed.shape) != (layout.num_experts, layout.nbytes) or packed.dtype != torch.uint8:
            raise CheckpointError(f"GGUFExpertBank: packed tensor {tuple(packed.shape)} {packed.dtype} != "
                                  f"{(layout.num_experts, layout.nbytes)} uint8")
        self.layout = layout
        self.num_experts = layout.num_experts
        self.hidden_size = layout.hidden_size
        self.intermediate_size = layout.intermediate_size
        self.register_buffer("packed", packed)

    def interleave(self) -> None:
        """Interleave the bank's Q4_K / Q6_K matrices in groups of 8 rows for the CPU kernels (``engine.kernels.x8``),
        in place, once (the layout says which); nothing where the bank is not on the CPU or the kernels are off."""
        lay = self.layout
        if self.packed.device.type != "cpu" or any(lay.x8) or not cpu_quant.usable(*lay.qtypes):
            return
        rows = (lay.intermediate_size, lay.intermediate_size, lay.hidden_size)
        on = [q in x8.KERNEL_TYPE and r % x8.GROUP == 0 for q, r in zip(lay.qtypes, rows)]
        on[0] = on[1] = on[0] and on[1]  # gate and up: both or neither (one task computes both)
        for flag, (at, n), r, q in zip(on, lay.segments, rows, lay.qtypes):
            if flag:
                x8.pack_bank(self.packed, at, r, n // r, q)
        self.layout = dataclasses.replace(lay, x8=(on[0], on[1], on[2]))

    def extra_repr(self) -> str:
        names = "/".join(gq.TYPE_NAMES[q] for q in self.layout.qtypes)
        return (f"experts={self.num_experts}, D={self.hidden_size}, I={self.intermediate_size}, types={names}, "
                f"row_bytes={self.layout.nbytes}")


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


@dataclass(frozen=True)
class _Fill:
    """How placement fills one tensor of a GGUF block module: the file bytes it reads, and the copy."""

    nbytes: int
    fill: Callable[[Tensor], None]


def _copy_rows(dst: Tensor, src: np.ndarray) -> None:
    """dst [R, n] (any device, may be a column slice) <- src uint8 [R, n] (a view into the memory-mapped file), in
    pieces of at most :data:`COPY_CHUNK_BYTES`: each piece is copied out of the map once, then into its place."""
    step = max(1, COPY_CHUNK_BYTES // max(src.shape[1], 1))
    for r0 in range(0, src.shape[0], step):
        piece = src[r0 : r0 + step]
        dst[r0 : r0 + step].copy_(torch.from_numpy(np.array(piece, copy=True)))
        release_pages(piece)  # copied: the map's pages leave this process (a load peaks near its size, not twice)


def _fill_blocks(gf: GGUFModelFile, tm: TensorMap, dst: Tensor) -> None:
    """A 2-D GGUF tensor's blocks [rows, row_bytes] into ``dst``, rows in Hugging Face order."""
    if tm.rows is None:
        _copy_rows(dst, gf.tensor_bytes(tm.gguf_name))
    else:
        dst.copy_(_rows(_raw_tensor(gf, tm.gguf_name), tm.rows))


def _fill_expert_rows(gf: GGUFModelFile, names: list[str], layout: GGUFExpertLayout, dst: Tensor) -> None:
    """dst [E, nbytes] <- each expert's bytes of the bank tensors ``names`` (gate, up, down; or a fused gate_up and
    down), one after the other: expert e's bytes of a [E, rows, row_bytes] tensor are contiguous in the file."""
    e, off = layout.num_experts, 0
    for name in names:
        per_expert = gf.tensor_bytes(name).reshape(e, -1)  # [E, rows * row_bytes], a view of the map
        n = per_expert.shape[1]
        _copy_rows(dst[:, off : off + n], per_expert)
        off += n
    if off != layout.nbytes:
        raise CheckpointError(f"{gf.path}: expert tensors {', '.join(names)} hold {off} bytes per expert, the layout "
                              f"{layout.nbytes}")


def _in_heads(gf: GGUFModelFile, tm: TensorMap) -> tuple[int, int] | None:
    """(Hk, Hv) when the tensor's input columns are tiled value heads (ssm_out), else None."""
    if tm.cols is None:
        return None
    cfg = gf.config
    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    tiled = tuple(h * dv + j for h in tiled_to_hf_heads(hk, hv) for j in range(dv))
    if tm.cols != tiled:
        raise CheckpointError(f"{gf.path}: {tm.gguf_name}: its column order is not the tiled value-head order")
    return hk, hv


def _swap_gguf_modules(model: CloverModel, src: GGUFSource, plan: LoadPlan, dtype: torch.dtype) -> dict[str, _Fill]:
    """Replace every module of the meta skeleton whose weight is GGUF-quantized by its GGUF module (buffers on the
    meta device: placement allocates them); returns {state name: how to fill it} for those buffers."""
    gf, cfg = src.gf, model.config
    fills: dict[str, _Fill] = {}
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
        t = gf.tensors[tm.gguf_name]
        if len(t.shape) != 2:
            continue  # a quantized vector or conv weight: dequantized into its parameter
        raw = torch.empty((t.shape[0], gq.row_bytes(t.qtype, t.shape[1])), dtype=torch.uint8, device="meta")
        if isinstance(module, nn.Embedding):
            if cfg.tie_word_embeddings:
                raise CheckpointError(f"{gf.path}: a quantized token_embd.weight without output.weight (tied "
                                      f"embeddings) is not supported")
            new: nn.Module = GGUFEmbedding(raw, t.qtype, cfg.hidden_size, dtype)
        elif isinstance(module, nn.Linear) and tm.post == "":
            new = GGUFLinear(raw, t.qtype, module.in_features, _in_heads(gf, tm))
        else:
            continue  # dequantized into its parameter
        set_submodule(model, module_name, new)
        fills[f"{module_name}.raw"] = _Fill(t.nbytes, functools.partial(_fill_blocks, gf, tm))
    for bank in banks:
        gate_up, down = src.maps[f"{bank}.gate_up_proj"], src.maps[f"{bank}.down_proj"]
        pieces = {m.piece: m.gguf_name for m in gate_up}
        d_name = down[0].gguf_name
        if "gate" in pieces:
            names = [pieces["gate"], pieces["up"], d_name]
            qtypes = (gf.tensors[names[0]].qtype, gf.tensors[names[1]].qtype, gf.tensors[d_name].qtype)
        else:  # a fused ffn_gate_up_exps bank: each expert's gate rows, then its up rows
            names = [gate_up[0].gguf_name, d_name]
            fused = gf.tensors[names[0]].qtype
            qtypes = (fused, fused, gf.tensors[d_name].qtype)
        layout = GGUFExpertLayout(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, qtypes)
        packed = torch.empty((layout.num_experts, layout.nbytes), dtype=torch.uint8, device="meta")
        set_submodule(model, bank, GGUFExpertBank(layout, packed))
        nbytes = sum(gf.tensors[n].nbytes for n in names)
        fills[f"{bank}.packed"] = _Fill(nbytes, functools.partial(_fill_expert_rows, gf, names, layout))
    return fills


_TORCH_OF_FLOAT_TYPE = {gq.F32: torch.float32, gq.F16: torch.float16, gq.BF16: torch.bfloat16}


class GGUFPlacement:
    """A GGUF model as an :class:`engine.placement.placer.TensorSource` for :func:`engine.placement.placer.place_model`, under the
    skeleton's state names: GGUF block buffers (``*.raw``, ``*.packed``) are filled with the file's bytes, every
    other tensor dequantized and put in Hugging Face order (:class:`GGUFSource`), with progress and cancel."""

    def __init__(self, src: GGUFSource, plan: LoadPlan, fills: dict[str, _Fill],
                 progress: Callable[[LoadProgress], None] | None, cancel: threading.Event | None) -> None:
        self.src = src
        self.fills = fills
        self.by_param = {target.name: (name, target) for name, target in plan.targets.items()}
        self.total = sum(src.entries[name].nbytes for name in plan.targets)
        self.done = 0
        self.progress = progress
        self.cancel = cancel

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype (a host-kept embedding keeps it): uint8 blocks, or the float type of the file."""
        if name in self.fills:
            return torch.uint8
        qtype = self.src.gf.tensors[self.src.maps[self._entry(name)[0]][0].gguf_name].qtype
        return _TORCH_OF_FLOAT_TYPE.get(qtype, torch.float32)

    def _entry(self, name: str) -> tuple[str, Any]:
        found = self.by_param.get(name)
        if found is None:
            raise CheckpointError(f"{self.src.gf.path}: the file has no tensor for {name!r}")
        return found

    def fill(self, name: str, dst: Tensor) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CancelledError(f"loading {self.src.gf.path} was cancelled")
        block = self.fills.get(name)
        if block is not None:
            block.fill(dst)
            self.done += block.nbytes
        else:
            ckpt, target = self._entry(name)
            dst.copy_(sanitize_tensor(target, self.src.read(ckpt)))  # converts dtype and device in one copy
            self.done += self.src.entries[ckpt].nbytes
        if self.progress is not None:
            self.progress(LoadProgress(stage="reading", done_bytes=self.done, total_bytes=self.total, current=name))


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
    plan: Any = None,
    **place_options: Any,
) -> GGUFLoad:
    """Read a GGUF model (a file, or any part of a split set) into a :class:`CloverModel`, every tensor read once
    from the file into its place (:func:`engine.placement.placer.place_model`).

    ``plan`` (an ``engine.placement.planner.Plan``, checked by the caller against :func:`engine.placement.manifest.manifest_from_gguf`):
    resident expert layers keep their :class:`GGUFExpertBank` on ``device``, streamed layers' rows go to (pinned)
    host memory and stream through the slot pool, the embedding stays in host RAM. No plan: everything on
    ``device``. ``place_options`` go to ``place_model``. ``keep_quantized`` False dequantizes everything into
    ordinary parameters (a reference model). ``layout``: "auto" | "fork" | "upstream" (engine.weights.gguf.file). Problems
    are one-line ConfigError / CheckpointError / PlanError."""
    gf = open_gguf(path, layout, bd_tiled)
    dtype = _as_dtype(dtype)
    src = GGUFSource(gf)
    model = CloverModel(gf.config, dtype=dtype, device="meta", clover_extras=gf.has_diffusion)
    lplan = plan_load(model, src)  # type: ignore[arg-type]
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"loading {gf.path} was cancelled")
    fills = _swap_gguf_modules(model, src, lplan, dtype) if keep_quantized else {}
    if plan is None:
        plan = placer.SimplePlan(tuple(placer.expert_banks(model)), (), 0)
        place_options.setdefault("host_embedding", False)
    source = GGUFPlacement(src, lplan, fills, progress, cancel)
    placer.place_model(model, plan, device, source, **place_options)
    if keep_quantized and torch.device(device).type == "cpu":  # the resident banks' Q4_K / Q6_K rows for the kernels
        for bank in model.modules():
            if isinstance(bank, GGUFExpertBank):
                bank.interleave()
    if progress is not None:
        progress(LoadProgress(stage="done", done_bytes=source.total, total_bytes=source.total, current=""))
    log.info("loaded %s (%s layout, %d tensors kept as GGUF blocks)", gf.path, gf.layout, len(fills))
    return GGUFLoad(gf, model.eval())


def load_gguf_engine(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    *,
    layout: str = "auto",
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    plan: Any = None,
    expert_fetch: str = "pool",
) -> tuple[CloverModel, Any, Any, Any, str | None]:
    """What :class:`engine.api.Engine` needs of a GGUF file: (model, config, generation defaults, tokenizer, why
    diffusion is refused or None), placed under ``plan`` when given (see :func:`load_gguf_model`). Generation
    defaults come from a ``generation_config.json`` next to the file, else Clover's published ones for the fork
    layout, else plain greedy. ``expert_fetch``: how streamed experts reach the GPU (``engine.settings.EXPERT_FETCH``)."""

    loaded = load_gguf_model(path, dtype, device, layout=layout, progress=progress, cancel=cancel, plan=plan,
                             expert_fetch=expert_fetch)
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
