"""One token's whole MoE block in one C call on the CPU (``clover_moe_token`` in ``csrc/quant_cpu.c``).

An AR step's MoE layer was ~25 small torch ops and 4-5 C calls: the router's product (MKL), its softmax and top-k,
the renormalization, the routed experts (``cpu_quant``), the shared expert's three products, its SiLU, its sigmoid
gate and the sums, each with a Python call, a dispatch and a fresh tensor. At Clover's real widths that overhead was
more than a third of a layer's time (docs/STATUS.md): this makes it one call. The math is
:class:`engine.model.moe.SparseMoe`'s, formula by formula (softmax, the k largest, renormalized; SiLU-gated experts;
the shared expert times the sigmoid of its gate), and every quantized product rounds its activations to int8 blocks
as the separate calls do; the router's product, the exponentials and the SiLU are C's own, so the result equals the
separate ops' within float32 rounding, not bit for bit (``tests/engine/test_cpu_moe.py``).

Used for one token (the AR step, eager, float32, the CPU kernels built) when every weight has an in-place layout the
kernels read (each module's ``cpu_mat`` / ``cpu_mats``: GGUF blocks, the own cache's NF4 / INT8 / Q6_K), the router
and the shared expert's gate are float32 rows and the bank is resident. :func:`set_enabled` switches it off (the
separate ops then run, as they do for every other pass).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant

# The kernels' mat_t: (ggml type or cpu_quant.NF4 / INT8, codes address, bytes between experts, bytes between rows,
# scales address (split formats), bytes between experts' scales, values per scale, value index of row 0)
Mat = tuple[int, int, int, int, int, int, int, int]

ENABLED = True


class _Mat(ctypes.Structure):
    _fields_ = [("qt", ctypes.c_int), ("w", ctypes.c_void_p), ("es", ctypes.c_int64), ("rs", ctypes.c_int64),
                ("s", ctypes.c_void_p), ("ses", ctypes.c_int64), ("bs", ctypes.c_int64), ("v0", ctypes.c_int64)]


def set_enabled(on: bool) -> bool:
    """Turn the one-call MoE step on or off for this process; returns the previous setting."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    return before


_BOUND: dict[int, Any] = {}  # id(library) -> its bound clover_moe_token
_ARRAYS: dict[tuple[Mat, ...], Any] = {}  # the matrices of a layer -> their ctypes array (built once)


def _function() -> Any:
    lib = cpu_quant.kernels().lib()
    fn = _BOUND.get(id(lib))
    if fn is None:
        fn = lib.clover_moe_token
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
        _BOUND[id(lib)] = fn
    return fn


def _array(mats: tuple[Mat, ...]) -> Any:
    arr = _ARRAYS.get(mats)
    if arr is None:
        if len(_ARRAYS) > 4096:  # models loaded and dropped in one process: never grow without bound
            _ARRAYS.clear()
        arr = _ARRAYS[mats] = (_Mat * len(mats))(*(_Mat(*m) for m in mats))
    return arr


def _f32_rows(linear: Any, rows: int, cols: int) -> Tensor | None:
    """A bias-free float32 linear's weight [rows, cols] when the kernel can read it as is, else None."""
    w = getattr(linear, "weight", None)
    ok = (isinstance(w, Tensor) and getattr(linear, "bias", None) is None and w.dtype == torch.float32
          and w.device.type == "cpu" and tuple(w.shape) == (rows, cols) and w.is_contiguous())
    return w if ok else None


def moe_token(moe: Any, x: Tensor, coreset: bool) -> Tensor | None:
    """``moe`` (a :class:`engine.model.moe.SparseMoe`) on one token x [1, D] in one C call -> [1, D] float32, with
    ``moe.last_topk_idx`` / ``last_topk_w`` set as its forward sets them; None where the call does not apply (then
    nothing is set). ``coreset``: the pass routes by block coreset (never one token's plain top-k)."""
    if torch.compiler.is_compiling() or not ENABLED or coreset:
        return None
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu" or not cpu_quant.usable():
        return None
    cfg, bank, shared = moe.config, moe.experts, moe.shared_expert
    d, e, k = x.shape[1], cfg.num_experts, moe.top_k
    router = _f32_rows(moe.gate, e, d)
    sgate = _f32_rows(moe.shared_expert_gate, 1, d)
    if (router is None or sgate is None or bank.needs_prepare or not hasattr(bank, "cpu_mats")
            or bank._forward_pre_hooks or bank._forward_hooks):  # hooked (a bench counting experts): its forward runs
        return None
    routed = bank.cpu_mats()
    parts = [getattr(m, "cpu_mat", lambda: None)() for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    if routed is None or None in parts:
        return None
    x = x.contiguous()
    out = torch.empty(1, d, dtype=torch.float32)
    idx = torch.empty(1, k, dtype=torch.int64)
    w = torch.empty(1, k, dtype=torch.float32)
    rc = _function()(x.data_ptr(), d, e, k, int(bool(cfg.norm_topk_prob)), router.data_ptr(),
                     bank.intermediate_size, _array(routed), shared.down_proj.in_features, _array(tuple(parts)),
                     sgate.data_ptr(), out.data_ptr(), idx.data_ptr(), w.data_ptr(), torch.get_num_threads())
    cpu_quant._raise_for(rc, "moe_token")
    moe.last_topk_idx, moe.last_topk_w = idx, w
    return out
