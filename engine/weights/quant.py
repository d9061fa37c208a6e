"""Quantization: formats, the policy table, and module swaps.

Formats (one ``quantize_x`` / fast ``dequantize_x`` / slow ``dequantize_x_reference`` triple each, picked by format
in ``quantize_tensor`` / ``dequantize_tensor``; they live in :mod:`engine.weights.codecs`, re-exported here):

* ``nf4``: bitsandbytes NF4, blockwise absmax over the *flattened* tensor (blocksize 64 by default), fp32 absmax,
  no double quantization. Two 4-bit codes per byte, the first element in the high nibble. Quantize and fast
  dequantize go through ``bitsandbytes`` (CUDA or CPU); the reference is pure torch.
* ``int8``: symmetric per-row absmax (scale = absmax / 127), pure torch.
* ``q6_k``: llama.cpp's Q6_K blocks (256 values in 210 bytes, scales inside; ``engine.weights.gguf.quants``), codes
  uint8 [O, row bytes] and no separate scales (an empty fp32 buffer): the head on the CPU, where the kernels read
  the blocks in place as they read a GGUF file's Q6_K head. Rows must be whole blocks (2-D, N % 256 == 0).
* ``bf16`` / ``fp32`` / ``keep``: not quantized (``keep`` leaves the checkpoint dtype).

The policy table (:class:`QuantPolicy`) is a list of regex rules on checkpoint tensor names, first match wins.
Quantized modules keep the interface of what they replace: :class:`QuantLinear` for ``nn.Linear`` and
:class:`QuantExpertBank` for an :class:`engine.model.experts.ExpertBank`. The expert bank stores ONE contiguous byte row
per expert (``[gate_up codes | down codes | gate_up scales | down scales]``, see :class:`ExpertLayout`) so that a
streamed expert is one copy (``engine/placement/offload.py``).

Compute path: weights are dequantized to the activation dtype and multiplied with ``F.linear``. We never use
``bnb.nn.Linear4bit``: on CPUs with AVX512-BF16 its first eval forward repacks the weight in place into a
CPU-only layout, which would corrupt bytes that are later streamed to a GPU. The expert banks gather the byte
rows of a group of used experts, dequantize each tensor of the whole group in one call (:func:`unpack_rows`) and
run :func:`engine.model.experts.moe_grouped`; :func:`routed_forward_reference` keeps the per-expert loop for the tests.

bitsandbytes 0.50.2 CPU caveat (found while writing the tests): ``dequantize_4bit`` on CPU treats blocks as lying
inside rows, so for a 2-D shape whose last dim is not a multiple of the blocksize it returns wrong values. We
always dequantize with the one-row shape ``(1, numel)`` and reshape, which matches how ``quantize_4bit`` blocks.

Letters: E experts, D hidden size, I expert intermediate size, T tokens, K top-k, O/N out/in features.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.errors import CheckpointError
from clover_desk.engine.kernels import cpu_quant, triton_linear, triton_moe, x8
from clover_desk.engine.model.experts import SMALL_SLOTS, ExpertBank, RowLayout, group_by_expert, moe_grouped

# The codecs are weights.codecs'; callers reach them here too.
from clover_desk.engine.weights.codecs import (  # noqa: F401
    NF4_MAX_HALF_GAP,
    dequantize_int8,
    dequantize_int8_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    dequantize_q6_k,
    dequantize_tensor,
    error_bound,
    quantize_int8,
    quantize_nf4,
    quantize_q6_k,
    quantize_tensor,
)

# The policy table is weights.formats' (stdlib only, shared with the planner); the quantizer's callers reach it here
# too, as the same objects (tests/engine/test_planner.py checks the identity).
from clover_desk.engine.weights.formats import (  # noqa: F401
    DEFAULT_POLICY,
    EXPERT_FORMATS,
    FORMATS,
    NF4_CODE,
    PLAIN_FORMATS,
    QUANT_FORMATS,
    QuantPolicy,
    Rule,
    expert_row_layout,
    format_of_torch_dtype,
    int8_sizes,
    is_expert_tensor,
    make_policy,
    nf4_sizes,
    quantized_sizes,
)
from clover_desk.engine.weights.gguf import quants as gq

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# QuantLinear
# ---------------------------------------------------------------------------------------------------------------


DEQUANT_CHUNK_ELEMS = 8 << 20  # QuantLinear dequantizes at most this many weights at once (16 MiB in bf16)


# Token rows at or below which an int8 QuantLinear on the CPU runs torch's fused weight-only int8 GEMV
# (aten._weight_int8pack_mm) instead of dequantize-then-matmul. Measured (2 cores, fp32, 32768 x 2048): 1 row
# 29 ms fused vs 200 ms dequantized; 32 rows 1,012 ms vs 359 ms (the kernel is a GEMV). 0 turns it off.
INT8_GEMV_MAX_ROWS = 4


def _cpu_kernel_type(layer: "QuantLinear", x: Tensor) -> int | None:
    """The split-format id when this layer's matmul runs through the CPU kernels (``engine.kernels.cpu_quant``:
    reads the NF4 / INT8 codes in place, activations rounded to int8 blocks), else None."""
    qtype = cpu_quant.SPLIT_OF_FORMAT.get(layer.fmt)
    if qtype is None or x.device.type != "cpu" or layer.codes.device.type != "cpu":
        return None
    blocksize = layer.blocksize if layer.fmt == "nf4" else None
    return qtype if cpu_quant.split_usable(qtype, layer.in_features, blocksize=blocksize) else None


def _int8_gemv_applies(layer: "QuantLinear", x: Tensor) -> bool:
    return (
        layer.fmt == "int8"
        and not layer.x8
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and layer.codes.dtype == torch.int8
        and layer.codes.dim() == 2
        and math.prod(x.shape[:-1]) <= INT8_GEMV_MAX_ROWS
        and hasattr(torch, "_weight_int8pack_mm")
    )


class QuantLinear(nn.Module):
    """Drop-in for ``nn.Linear`` holding a quantized weight: ``codes`` + ``scales`` buffers, optional ``bias``.

    ``weight`` is a property that dequantizes (for code that reads ``linear.weight``); ``forward`` dequantizes to
    the input dtype and calls ``F.linear``, or reads the codes in place (the CPU kernels).

    ``x8``: an INT8 weight's rows interleaved in groups of 8 for the CPU kernels (:meth:`interleave`, in memory
    only: ``state_dict`` gives the plain codes, and a move off the CPU restores them).
    """

    chunk_elems: int = DEQUANT_CHUNK_ELEMS
    x8: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        blocksize: int = 64,
        bias: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"QuantLinear: format must be one of {QUANT_FORMATS}, got {fmt!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.blocksize = blocksize
        shape = (out_features, in_features)
        n_codes, n_scales = quantized_sizes(shape, fmt, blocksize)
        if fmt == "nf4":
            codes = torch.zeros(n_codes, dtype=torch.uint8, device=device)  # [O*N/2] two codes per byte
        elif fmt == "q6_k":
            codes = torch.zeros(out_features, n_codes // out_features, dtype=torch.uint8, device=device)  # blocks
        else:
            codes = torch.zeros(shape, dtype=torch.int8, device=device)  # [O, N]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", torch.zeros(n_scales // 4, dtype=torch.float32, device=device))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, blocksize: int = 64) -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, fmt, blocksize, bias=linear.bias is not None, device="cpu")
        q.set_weight(linear.weight.data)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.detach().clone(), requires_grad=False)
        return q.to(linear.weight.device)

    def set_weight(self, w: Tensor) -> None:
        """Quantize ``w`` [O, N] into this module's buffers."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise CheckpointError(
                f"QuantLinear: weight shape {tuple(w.shape)} != {(self.out_features, self.in_features)}"
            )
        codes, scales = quantize_tensor(w, self.fmt, self.blocksize)
        self.codes = codes.to(self.codes.device)
        self.scales = scales.to(self.scales.device)
        self.x8 = False

    def interleave(self) -> bool:
        """Interleave an INT8 weight's rows in groups of 8 for the CPU kernels (``engine.kernels.x8``, ``INT8X8``: one
        load holds 4 codes of 8 rows, so a token's dot is 32 products a ``vpdpbusd``, with the tiled kernels' bits at
        any token count), in place, once. Nothing (False) where the weight is not INT8 on the CPU, the kernels cannot
        read it, or its rows are not whole groups of 8 rows of 32-value steps."""
        codes = self.codes
        if (self.x8 or self.fmt != "int8" or codes.device.type != "cpu" or codes.dim() != 2
                or not codes.is_contiguous() or not self.scales.is_contiguous() or self.out_features % x8.GROUP
                or not cpu_quant.split_usable(cpu_quant.INT8X8, self.in_features)):
            return False
        x8.pack_i8(codes, self.scales)
        self.x8 = True
        return True

    def _plain_codes(self, r0: int = 0, r1: int | None = None) -> Tensor:
        """Codes of rows r0..r1 in the cache's row order (a copy where they are interleaved)."""
        r1 = self.out_features if r1 is None else r1
        if not self.x8:
            return self.codes[r0:r1]
        g0, g1 = r0 // x8.GROUP * x8.GROUP, -(-r1 // x8.GROUP) * x8.GROUP  # the groups holding the rows
        plain, _ = x8.i8_unpack(self.codes[g0:g1], self.scales[g0:g1])
        return plain[r0 - g0 : r1 - g0]

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> "QuantLinear":
        was_x8 = self.x8
        out = super()._apply(fn, recurse)
        if was_x8 and self.codes.device.type != "cpu":  # moved off the CPU: the rows back in the cache's order
            self.codes = x8.i8_unpack(self.codes, self.scales)[0]
            self.x8 = False
        return out

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.x8:
            destination[prefix + "codes"] = self._plain_codes()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.x8 = False  # plain codes copied in

    def dequantized(self, dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> Tensor:
        """The weight [O, N] (or output rows r0..r1 of it) in ``dtype``."""
        r0, r1 = rows or (0, self.out_features)
        n = self.in_features
        if self.fmt == "nf4":  # r0 * N is a whole number of blocks (see _chunk_rows)
            codes = self.codes[r0 * n // 2 : r1 * n // 2]
            scales = self.scales[r0 * n // self.blocksize : -(-r1 * n // self.blocksize)]
        elif self.fmt == "q6_k":
            codes, scales = self.codes[r0:r1], self.scales
        else:
            codes, scales = self._plain_codes(r0, r1), self.scales[r0:r1]
        return dequantize_tensor(codes, scales, (r1 - r0, n), self.fmt, self.blocksize, dtype)

    @property
    def weight(self) -> Tensor:
        return self.dequantized(torch.float32)

    def _chunk_rows(self) -> int:
        """Output rows dequantized at once: bounds the bf16 transient of big weights (lm_head is 248320 x 2048)."""
        rows = max(1, self.chunk_elems // self.in_features)
        align = self.blocksize // math.gcd(self.in_features, self.blocksize) if self.fmt == "nf4" else 1
        return max(align, rows // align * align)

    def _in_place(self, x: Tensor) -> Tensor | None:
        """x [R, N] -> [R, O] from the codes read in place (no dequantized weight written), or None where no
        kernel applies: the CPU kernels (NF4 / INT8 split formats; Q6_K blocks through the GGUF path's kernel, as
        ``GGUFLinear`` reads them), else torch's fused weight-only int8 GEMV for a few rows."""
        qtype = _cpu_kernel_type(self, x)
        if qtype is not None:
            qtype = cpu_quant.INT8X8 if self.x8 else qtype
            bs = self.blocksize if self.fmt == "nf4" else self.in_features
            return cpu_quant.smatmul(x, self.codes, self.scales, qtype, bs, self.out_features)
        if self.fmt == "q6_k" and x.device.type == self.codes.device.type == "cpu" and cpu_quant.usable(gq.Q6_K):
            return cpu_quant.qmatmul(x, self.codes, gq.Q6_K)  # x rounded to int8 blocks of 256, as llama.cpp does
        if _int8_gemv_applies(self, x):
            return torch._weight_int8pack_mm(x, self.codes, self.scales.to(x.dtype))
        return None

    def cpu_mat(self) -> tuple[int, ...] | None:
        """This weight as the CPU kernels' matrix (``engine.kernels.cpu_token.Mat``), or None where they cannot read it
        in place (another device, a bias, widths or a blocksize the kernels do not take)."""
        codes, n = self.codes, self.in_features
        if codes.device.type != "cpu" or self.bias is not None or not codes.is_contiguous():
            return None
        if self.fmt == "q6_k":
            return (gq.Q6_K, codes.data_ptr(), 0, codes.stride(0), 0, 0, 0, 0) if cpu_quant.usable(gq.Q6_K) else None
        qtype = cpu_quant.SPLIT_OF_FORMAT.get(self.fmt)
        bs = self.blocksize if self.fmt == "nf4" else n
        if qtype is None or not cpu_quant.split_usable(qtype, n, blocksize=bs) or not self.scales.is_contiguous():
            return None
        qtype = cpu_quant.INT8X8 if self.x8 else qtype
        return (qtype, codes.data_ptr(), 0, n if qtype != cpu_quant.NF4 else n // 2, self.scales.data_ptr(), 0, bs, 0)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        out = self._in_place(x.reshape(-1, self.in_features))  # [R, O] or None
        if out is not None:
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return out + bias if bias is not None else out
        if triton_linear.enabled_for(x, self.fmt, self.codes):  # a GPU, opted in: the fused int8 kernel
            return triton_linear.int8_linear(x, self.codes, self.scales, bias)
        step = self._chunk_rows()
        if step >= self.out_features:
            return F.linear(x, self.dequantized(x.dtype), bias)  # [.., O]
        parts = [
            F.linear(x, self.dequantized(x.dtype, (r0, min(r0 + step, self.out_features))))  # [.., rows]
            for r0 in range(0, self.out_features, step)
        ]
        out = torch.cat(parts, dim=-1)  # [.., O]
        return out + bias if bias is not None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"blocksize={self.blocksize}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Quantized expert bank: one contiguous byte row per expert
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one expert's row: ``[gate_up codes | down codes | gate_up scales | down scales]``.

    gate_up is [2I, D] (rows 0..I-1 gate, I..2I-1 up), down is [D, I]; each segment starts 16-byte aligned.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    fmt: str
    blocksize: int
    gate_up_codes: tuple[int, int]  # (offset, nbytes)
    down_codes: tuple[int, int]
    gate_up_scales: tuple[int, int]
    down_scales: tuple[int, int]
    nbytes: int  # row size
    x8: bool = False  # NF4 rows interleaved by 8 for the CPU kernels (in memory only: QuantExpertBank.interleave)

    @classmethod
    def build(
        cls, num_experts: int, hidden_size: int, intermediate_size: int, fmt: str = "nf4", blocksize: int = 64
    ) -> "ExpertLayout":
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"expert format must be one of {EXPERT_FORMATS}, got {fmt!r}")
        segs, off = expert_row_layout(hidden_size, intermediate_size, fmt, blocksize)
        return cls(num_experts, hidden_size, intermediate_size, fmt, blocksize, *segs, nbytes=off)

    @property
    def gate_up_shape(self) -> tuple[int, int]:
        return (2 * self.intermediate_size, self.hidden_size)

    @property
    def down_shape(self) -> tuple[int, int]:
        return (self.hidden_size, self.intermediate_size)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "x8"}  # the cache's bytes are never interleaved

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExpertLayout":
        d = dict(d)
        for k in ("gate_up_codes", "down_codes", "gate_up_scales", "down_scales"):
            d[k] = tuple(d[k])
        return cls(**d)

    # --- packing ---
    def pack(self, gate_up: Tensor, down: Tensor, out: Tensor | None = None) -> Tensor:
        """Quantize one expert: gate_up [2I, D], down [D, I] -> row uint8 [nbytes] (written into ``out`` if given)."""
        if tuple(gate_up.shape) != self.gate_up_shape or tuple(down.shape) != self.down_shape:
            raise CheckpointError(
                f"expert shapes {tuple(gate_up.shape)}, {tuple(down.shape)} != {self.gate_up_shape}, {self.down_shape}"
            )
        row = out if out is not None else torch.zeros(self.nbytes, dtype=torch.uint8)
        for w, (c_off, c_n), (s_off, s_n) in (
            (gate_up, self.gate_up_codes, self.gate_up_scales),
            (down, self.down_codes, self.down_scales),
        ):
            codes, scales = quantize_tensor(w, self.fmt, self.blocksize)
            row[c_off : c_off + c_n] = codes.reshape(-1).view(torch.uint8).to(row.device)
            row[s_off : s_off + s_n] = scales.reshape(-1).view(torch.uint8).to(row.device)
        return row

    def views(self, row: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(gate_up codes, down codes, gate_up scales fp32, down scales fp32) of ``row`` [nbytes] (views; copies in
        the cache's order where the rows are interleaved)."""
        return tuple(t[0] for t in self._plain(row[None])) if self.x8 else self._segments(row)  # type: ignore[return-value]

    def _segments(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        (a, na), (b, nb), (c, nc), (d, nd) = self.gate_up_codes, self.down_codes, self.gate_up_scales, self.down_scales
        return (rows[..., a : a + na], rows[..., b : b + nb], rows[..., c : c + nc].view(torch.float32),
                rows[..., d : d + nd].view(torch.float32))

    def _plain(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Interleaved rows [G, nbytes] -> their segments [G, n] in the cache's order (``engine.kernels.x8``)."""
        gu_c, dn_c, gu_s, dn_s = self._segments(rows.contiguous())
        (gu_c, gu_s), (dn_c, dn_s) = x8.nf4_unpack(gu_c, gu_s, self.hidden_size), x8.nf4_unpack(dn_c, dn_s, self.intermediate_size)
        return gu_c, dn_c, gu_s, dn_s

    def unpack(self, row: Tensor, dtype: torch.dtype, reference: bool = False) -> tuple[Tensor, Tensor]:
        """row -> (gate_up [2I, D], down [D, I]) in ``dtype``."""
        gu_c, dn_c, gu_s, dn_s = self.views(row)
        gate_up = dequantize_tensor(gu_c, gu_s, self.gate_up_shape, self.fmt, self.blocksize, dtype, reference)
        down = dequantize_tensor(dn_c, dn_s, self.down_shape, self.fmt, self.blocksize, dtype, reference)
        return gate_up, down

    def unpack_rows(self, source: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The row-layout interface :func:`routed_forward` computes through (see :func:`unpack_rows`); another
        layout (``engine.weights.gguf.model.GGUFExpertLayout``) brings its own."""
        return unpack_rows(self, source, rows, dtype)


def expert_mlp(layout: ExpertLayout, row: Tensor, xs: Tensor) -> Tensor:
    """One quantized expert's SwiGLU MLP on its tokens: xs [n, D] -> [n, D] (the reference loop's step)."""
    gate_up, down = layout.unpack(row, xs.dtype)  # [2I, D], [D, I]
    gate, up = F.linear(xs, gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, down)  # [n, D]


def _dequantize_group(
    layout: ExpertLayout, codes: Tensor, scales: Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> Tensor:
    """codes [G, c] uint8 and scales [G, s] fp32 of G experts' copies of one tensor -> [G, *shape] in ``dtype``.

    One dequantize call for the group when each expert's tensor is a whole number of NF4 blocks (INT8 scales are
    per row: always): the concatenated bytes then block exactly as each expert's own bytes do. Otherwise (odd toy
    shapes only) one call per expert."""
    g = codes.shape[0]
    numel = shape[0] * shape[1]
    if layout.fmt == "int8" or numel % layout.blocksize == 0:
        flat = dequantize_tensor(codes.reshape(-1), scales.reshape(-1), (g * shape[0], shape[1]), layout.fmt,
                                 layout.blocksize, dtype)  # [G*O, N]
        return flat.view(g, *shape)
    return torch.stack(
        [dequantize_tensor(codes[j], scales[j], shape, layout.fmt, layout.blocksize, dtype) for j in range(g)]
    )


def unpack_rows(layout: ExpertLayout, source: Tensor, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Dequantize the experts in rows ``rows`` [G] (long, on source's device) of ``source`` [S, nbytes] uint8
    -> (gate_up [G, 2I, D], down [G, D, I]) in ``dtype``. Each segment is gathered straight into a contiguous
    [G, bytes] tensor (no copy of whole rows) and dequantized in one call."""
    (a, na), (b, nb) = layout.gate_up_codes, layout.down_codes
    (c, nc), (d, nd) = layout.gate_up_scales, layout.down_scales
    if layout.x8:  # rows interleaved for the CPU kernels (the kernels since switched off): the cache's order first
        gu_codes, dn_codes, gu_scales, dn_scales = layout._plain(source[rows])
    elif rows.numel() == 1 and rows.device.type == "cpu":  # one row named on the host: views, no gather (a CPU group)
        r = int(rows)
        src = source[r : r + 1]  # [1, nbytes]
        gu_codes, dn_codes, gu_scales, dn_scales = (
            src[:, a : a + na], src[:, b : b + nb], src[:, c : c + nc], src[:, d : d + nd]
        )
    else:
        gu_codes = source[:, a : a + na].index_select(0, rows)  # [G, na]
        dn_codes = source[:, b : b + nb].index_select(0, rows)  # [G, nb]
        gu_scales = source[:, c : c + nc].index_select(0, rows)  # [G, nc]
        dn_scales = source[:, d : d + nd].index_select(0, rows)  # [G, nd]
    if not layout.x8:
        gu_scales, dn_scales = gu_scales.view(torch.float32), dn_scales.view(torch.float32)  # [G, nc/4], [G, nd/4]
    gate_up = _dequantize_group(layout, gu_codes, gu_scales, layout.gate_up_shape, dtype)  # [G, 2I, D]
    down = _dequantize_group(layout, dn_codes, dn_scales, layout.down_shape, dtype)  # [G, D, I]
    return gate_up, down


def routed_forward(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    num_experts: int,
    layout: RowLayout,
    row_of: Callable[[int], Tensor] | None = None,
    *,
    source: Tensor | None = None,
    row_index: Tensor | None = None,
) -> Tensor:
    """The shared MoE compute of every quantized bank (resident or streamed): the same op order for the same bytes,
    so streaming can never change the numbers. x [T, D], topk_idx/topk_w [T, K] -> [T, D].

    Where the expert bytes are: ``source`` [S, nbytes] uint8 with expert e in row ``row_index[e]`` (``row_index``
    [E] long on source's device; None: row e), which needs no host sync to find an expert; or ``row_of(e)`` -> row
    [nbytes], which needs the expert ids on the host (a sync per group on a GPU) and copies each used row once."""
    if source is not None:
        if x.device.type == "cpu" and _own_rows_usable(layout):  # the engine's own NF4 / INT8 rows, read in place
            own = cast(ExpertLayout, layout)
            rows = topk_idx if row_index is None else row_index[topk_idx]  # [T, K] source row of each pair
            y = cpu_quant.moe_rows(x, source, _own_offsets(own), own.intermediate_size, _own_qtype(own),
                                   _own_blocksizes(own), rows, topk_w)
            return y.to(x.dtype)
        qtypes = getattr(layout, "qtypes", None)  # GGUF rows: [gate | up | down] blocks in the file's types
        if x.device.type == "cpu" and qtypes is not None and cpu_quant.usable(*qtypes):
            rows = topk_idx if row_index is None else row_index[topk_idx]  # [T, K] source row of each pair
            kqt = getattr(layout, "kernel_qtypes", qtypes)  # the types of rows interleaved for the kernels
            y = cpu_quant.moe_packed(x, source, layout.intermediate_size, kqt, rows, topk_w)  # [T, D] fp32
            return y.to(x.dtype)
        if triton_moe.enabled_for(x, layout):  # the fused NF4 / GGUF kernel (opt-in on CUDA until measured there)
            rows = topk_idx if row_index is None else row_index[topk_idx]  # [T, K] pool row of each pair
            return triton_moe.fused_moe(x, source, layout, rows, topk_w)

        def weights(ids: Tensor) -> tuple[Tensor, Tensor]:
            rows = ids if row_index is None else row_index[ids]  # [G]
            return layout.unpack_rows(source, rows, x.dtype)
    elif row_of is not None:
        def weights(ids: Tensor) -> tuple[Tensor, Tensor]:
            gathered = torch.stack([row_of(int(e)) for e in ids.tolist()])  # [G, nbytes]
            return layout.unpack_rows(gathered, torch.arange(len(gathered), device=gathered.device), x.dtype)
    else:
        raise ValueError("routed_forward needs source= or row_of")
    # dequantizing weights: a compiled pass's many pairs take the grouped path, each used expert dequantized once
    return moe_grouped(x, topk_idx, topk_w, num_experts, weights, 3 * layout.intermediate_size,
                       compiled_pairwise=False)


def _own_rows_usable(layout: RowLayout) -> bool:
    """Whether the engine's own expert rows (:class:`ExpertLayout`) go through the CPU kernels."""
    if not isinstance(layout, ExpertLayout) or layout.fmt not in cpu_quant.SPLIT_OF_FORMAT:
        return False
    blocksize = layout.blocksize if layout.fmt == "nf4" else None
    return cpu_quant.split_usable(cpu_quant.SPLIT_OF_FORMAT[layout.fmt], layout.hidden_size,
                                  layout.intermediate_size, blocksize=blocksize)


def _own_qtype(layout: ExpertLayout) -> int:
    """The kernels' type of the rows: NF4 / INT8, or NF4 interleaved by 8."""
    return cpu_quant.NF4X8 if layout.x8 else cpu_quant.SPLIT_OF_FORMAT[layout.fmt]


def _own_offsets(layout: ExpertLayout) -> tuple[int, int, int, int]:
    return (layout.gate_up_codes[0], layout.down_codes[0], layout.gate_up_scales[0], layout.down_scales[0])


def _own_blocksizes(layout: ExpertLayout) -> tuple[int, int]:
    """Values per scale of (gate_up, down): the NF4 blocksize, or INT8's one scale per row."""
    if layout.fmt == "nf4":
        return layout.blocksize, layout.blocksize
    return layout.hidden_size, layout.intermediate_size


def routed_forward_reference(
    x: Tensor, topk_idx: Tensor, topk_w: Tensor, num_experts: int, layout: ExpertLayout, row_of: Callable[[int], Tensor]
) -> Tensor:
    """The slow reference: a Python loop over the used experts, one dequantize and two small matmuls each (what
    :func:`routed_forward` did before the grouped compute). x [T, D], topk_idx/topk_w [T, K] -> [T, D]."""
    order, token, experts, counts = group_by_expert(topk_idx, num_experts)
    xs = x[token]  # [N, D] token rows in expert order
    ys = torch.empty_like(xs)  # [N, D]
    start = 0
    for e, n in zip(experts, counts):
        ys[start : start + n] = expert_mlp(layout, row_of(e), xs[start : start + n])
        start += n
    w = topk_w.reshape(-1)[order].to(torch.float32)  # [N]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D] fp32 accumulation
    out.index_add_(0, token, ys.to(torch.float32) * w[:, None])
    return out.to(x.dtype)


def routed_reference(bank: "QuantExpertBank", x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    """:func:`routed_forward_reference` on a resident bank's rows."""
    return routed_forward_reference(x, topk_idx, topk_w, bank.num_experts, bank.layout, bank.packed.__getitem__)


def rows_sync_free(pairs: int, device: torch.device, layout: RowLayout) -> bool:
    """Whether :func:`routed_forward` from a byte-row source over ``pairs`` (token, slot) pairs reads nothing on
    the host: few pairs gather one expert each; more need the fused kernel (``engine.kernels.triton_moe``), which sorts
    them on the device, where the dequantizing path sizes its groups on the host; on the CPU, GGUF rows through
    the CPU kernels (``engine.kernels.cpu_quant``: one opaque call)."""
    qtypes = getattr(layout, "qtypes", None)
    if device.type == "cpu" and qtypes is not None and cpu_quant.usable(*qtypes):
        return True
    if device.type == "cpu" and _own_rows_usable(layout):
        return True
    return pairs <= SMALL_SLOTS or triton_moe.enabled_on(device, layout)


class RowExpertBank(ExpertBank):
    """A bank whose experts are one contiguous byte row each: ``packed`` uint8 [E, layout.nbytes] under a
    :class:`RowLayout`, computed by :func:`routed_forward`. ``engine.placement.streamed_bank`` streams any such bank: a streamed
    layer's rows go to host memory and one copy fills one slot."""

    layout: RowLayout
    packed: Tensor

    def sync_free(self, pairs: int, device: torch.device, dtype: torch.dtype) -> bool:
        return rows_sync_free(pairs, device, self.layout)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        return routed_forward(x, topk_idx, topk_w, self.num_experts, self.layout, source=self.packed)

    def cpu_mats(self) -> tuple[tuple[int, ...], ...] | None:
        """The bank's gate, up and down matrices as the CPU kernels' matrices (``engine.kernels.cpu_token.Mat``, expert
        e at e * the row stride of ``packed``), or None where the kernels cannot read the rows in place."""
        packed, lay = self.packed, self.layout
        if packed.device.type != "cpu" or packed.stride(1) != 1:
            return None
        base, es, d, i = packed.data_ptr(), packed.stride(0), lay.hidden_size, lay.intermediate_size
        qtypes = getattr(lay, "qtypes", None)
        if qtypes is not None and cpu_quant.usable(*qtypes):  # GGUF rows: [gate | up | down] blocks
            return tuple((q, base + at, es, n // rows, 0, 0, 0, 0)
                         for q, (at, n), rows in zip(getattr(lay, "kernel_qtypes", qtypes), lay.segments, (i, i, d)))
        if not _own_rows_usable(lay) or es % 4 or base % 4:
            return None
        own = cast(ExpertLayout, lay)  # the own cache's rows: [gate_up codes | down codes | their scales]
        qt, (gu_c, dn_c, gu_s, dn_s), (bs_gu, bs_dn) = _own_qtype(own), _own_offsets(own), _own_blocksizes(own)
        if gu_s % 4 or dn_s % 4:
            return None
        rg, rd = (d, i) if qt == cpu_quant.INT8 else (d // 2, i // 2)
        return ((qt, base + gu_c, es, rg, base + gu_s, es, bs_gu, 0), (qt, base + gu_c + i * rg, es, rg, base + gu_s, es, bs_gu, i * d),
                (qt, base + dn_c, es, rd, base + dn_s, es, bs_dn, 0))


class QuantExpertBank(RowExpertBank):
    """All experts of one layer, resident, as ``packed`` uint8 [E, nbytes] (one contiguous row per expert)."""

    def __init__(self, layout: ExpertLayout, device: torch.device | str = "cpu", packed: Tensor | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.num_experts = layout.num_experts
        self.hidden_size = layout.hidden_size
        self.intermediate_size = layout.intermediate_size
        if packed is None:
            packed = torch.zeros(layout.num_experts, layout.nbytes, dtype=torch.uint8, device=device)
        if tuple(packed.shape) != (layout.num_experts, layout.nbytes) or packed.dtype != torch.uint8:
            raise CheckpointError(
                f"QuantExpertBank: packed tensor {tuple(packed.shape)} {packed.dtype} != "
                f"{(layout.num_experts, layout.nbytes)} uint8"
            )
        self.register_buffer("packed", packed)

    def interleave(self) -> bool:
        """Interleave the bank's NF4 rows in groups of 8 for the CPU kernels (``engine.kernels.x8``: 1.8-2x the plain
        rows' speed), in place, once; nothing (False) where the bank is not on the CPU, not NF4, or the kernels cannot
        read it. The cache on disk keeps bitsandbytes' layout (a GPU reads it)."""
        lay = self.layout
        if (self.packed.device.type != "cpu" or lay.x8 or lay.fmt != "nf4" or not _own_rows_usable(lay)
                or lay.intermediate_size % x8.GROUP or lay.hidden_size % x8.GROUP
                or lay.hidden_size % lay.blocksize or lay.intermediate_size % lay.blocksize):
            return False
        d, i, bs = lay.hidden_size, lay.intermediate_size, lay.blocksize
        x8.pack_nf4_bank(self.packed, lay.gate_up_codes[0], lay.gate_up_scales[0], 2 * i, d, bs)
        x8.pack_nf4_bank(self.packed, lay.down_codes[0], lay.down_scales[0], d, i, bs)
        self.layout = dataclasses.replace(lay, x8=True)
        return True

    @classmethod
    def from_dense(
        cls, gate_up_proj: Tensor, down_proj: Tensor, fmt: str = "nf4", blocksize: int = 64
    ) -> "QuantExpertBank":
        """Quantize fused dense weights gate_up_proj [E, 2I, D], down_proj [E, D, I]."""
        e, two_i, d = gate_up_proj.shape
        layout = ExpertLayout.build(e, d, two_i // 2, fmt, blocksize)
        bank = cls(layout, device="cpu")
        for i in range(e):
            layout.pack(gate_up_proj[i].cpu(), down_proj[i].cpu(), out=bank.packed[i])
        return bank.to(gate_up_proj.device)

    def extra_repr(self) -> str:
        lay = self.layout
        return (
            f"experts={lay.num_experts}, D={lay.hidden_size}, I={lay.intermediate_size}, fmt={lay.fmt}, "
            f"row_bytes={lay.nbytes}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Module swap
# ---------------------------------------------------------------------------------------------------------------


def quantize_model_(
    model: nn.Module, policy: QuantPolicy = DEFAULT_POLICY, name_of: Callable[[str], str] | None = None
) -> dict[str, str]:
    """Swap in place every ``nn.Linear`` / dense expert bank the policy quantizes. Returns {tensor name: format}
    for what was swapped. ``name_of`` maps a module's parameter name to the checkpoint name the policy sees
    (identity by default)."""
    to_name = name_of or (lambda n: n)
    applied: dict[str, str] = {}
    swaps: list[tuple[str, nn.Module]] = []
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            pname = to_name(f"{mod_name}.weight")
            fmt = policy.format_of(pname, tuple(module.weight.shape))
            if fmt in QUANT_FORMATS:
                swaps.append((mod_name, QuantLinear.from_linear(module, fmt, policy.blocksize)))
                applied[pname] = fmt
        elif isinstance(module, ExpertBank) and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            pname = to_name(f"{mod_name}.gate_up_proj")
            fmt = policy.format_of(pname, tuple(module.gate_up_proj.shape))
            if fmt in QUANT_FORMATS:
                swaps.append(
                    (
                        mod_name,
                        QuantExpertBank.from_dense(
                            module.gate_up_proj.data, module.down_proj.data, fmt, policy.blocksize
                        ),
                    )
                )
                applied[pname] = fmt
                applied[to_name(f"{mod_name}.down_proj")] = fmt
    for mod_name, new in swaps:
        set_submodule(model, mod_name, new)
    log.info("quantized %d tensors with policy %s", len(applied), policy.name)
    return applied


def interleave_for_cpu(model: nn.Module) -> int:
    """Interleave, in memory, the rows of every resident NF4 expert bank and INT8 projection of a model on the CPU for
    the CPU kernels (what loading the cache onto the CPU does); returns how many modules changed."""
    return sum(m.interleave() for m in model.modules() if isinstance(m, (QuantExpertBank, QuantLinear)))


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def applied_formats(model: nn.Module) -> dict[str, str]:
    """Read back from a model which format each weight is in: {param name: "nf4" | "int8" | dtype name}."""
    out: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, QuantLinear):
            out[f"{prefix}weight"] = module.fmt
        elif isinstance(getattr(module, "layout", None), ExpertLayout):  # quantized bank, resident or streamed
            out[f"{prefix}gate_up_proj"] = module.layout.fmt
            out[f"{prefix}down_proj"] = module.layout.fmt
        else:
            for pname, p in module.named_parameters(recurse=False):
                out[f"{prefix}{pname}"] = _dtype_name(p.dtype)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return format_of_torch_dtype(dtype)


def iter_quant_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, QuantExpertBank)):
            yield name, m
