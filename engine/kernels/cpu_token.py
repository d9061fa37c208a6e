"""One token's layer parts, each in one C call on the CPU (``csrc/quant_cpu.c``): the MoE block
(:func:`moe_token`, ``clover_moe_token``) and the Gated DeltaNet mixer (:func:`gdn_mixer_token`,
``clover_gdn_mixer_token``).

An AR step's MoE layer was ~25 small torch ops and 4-5 C calls: the router's product (MKL), its softmax and top-k,
the renormalization, the routed experts (``cpu_quant``), the shared expert's three products, its SiLU, its sigmoid
gate and the sums, each with a Python call, a dispatch and a fresh tensor; a Gated DeltaNet mixer was ~20 more
around its 4-5 C calls (the gates, the SiLUs, out_proj's column order). At Clover's real widths that overhead was
more than a third of a layer's time (docs/STATUS.md, "Per layer at depth"). The math is the modules' own, formula
by formula (:class:`engine.model.moe.SparseMoe`: softmax, the k largest, renormalized, SiLU-gated experts, the
shared expert times the sigmoid of its gate; :class:`engine.model.gdn.GatedDeltaNet`: sigmoid and softplus gates,
the same convolution and delta-rule kernels), and every quantized product rounds its activations to int8 blocks as
the separate calls do; the router's product, the exponentials and the SiLUs are C's own, so the results equal the
separate ops' within float32 rounding, not bit for bit (``tests/engine/test_cpu_token.py``).

Used for one token (the AR step, eager, float32, the CPU kernels built) when every weight has an in-place layout the
kernels read (each module's ``cpu_mat`` / ``cpu_mats``: GGUF blocks, the own cache's NF4 / INT8 / Q6_K; float32 rows
where the module keeps them so) and the expert bank is resident. :func:`set_enabled` switches both off (the
separate ops then run, as they do for every other pass).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.kernels.torch_lanes import torch_lanes

# The kernels' mat_t: (ggml type or cpu_quant.NF4 / INT8, codes address, bytes between experts, bytes between rows,
# scales address (split formats), bytes between experts' scales, values per scale, value index of row 0)
Mat = tuple[int, int, int, int, int, int, int, int]

ENABLED = True


class _Mat(ctypes.Structure):
    _fields_ = [("qt", ctypes.c_int), ("w", ctypes.c_void_p), ("es", ctypes.c_int64), ("rs", ctypes.c_int64),
                ("s", ctypes.c_void_p), ("ses", ctypes.c_int64), ("bs", ctypes.c_int64), ("v0", ctypes.c_int64)]


def set_enabled(on: bool) -> bool:
    """Turn both one-call steps on or off for this process; returns the previous setting."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    return before


_BOUND: dict[tuple[int, str], Any] = {}  # (id(library), name) -> the bound function
_ARRAYS: dict[tuple[Mat, ...], Any] = {}  # the matrices of a layer -> their ctypes array (built once)


_ARGS = {  # each function's arguments: p a pointer, i an int64, c an int, f a float
    "clover_moe_token": "piiicpipipppppc",
    "clover_gdn_mixer_token": "pippppppipppfpppipiiiicc",
}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "c": ctypes.c_int, "f": ctypes.c_float}


def _function(name: str = "clover_moe_token") -> Any:
    lib = cpu_quant.kernels().lib()
    fn = _BOUND.get((id(lib), name))
    if fn is None:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_CTYPES[a] for a in _ARGS[name]]
        _BOUND[(id(lib), name)] = fn
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


def _one_token(x: Tensor) -> bool:
    """Whether a forward on x may take a one-call step: eager, switched on, one float32 CPU token [1, D], the kernels
    built."""
    return (not torch.compiler.is_compiling() and ENABLED and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == torch.float32 and x.device.type == "cpu" and cpu_quant.usable())


def _mat(module: Any, **how: Any) -> Mat | None:
    """``module``'s weight as the kernels read it in place (its ``cpu_mat``), or None (none, or not readable)."""
    cpu_mat = getattr(module, "cpu_mat", None)
    return cpu_mat(**how) if cpu_mat is not None else None


def moe_token(moe: Any, x: Tensor, coreset: bool) -> Tensor | None:
    """``moe`` (a :class:`engine.model.moe.SparseMoe`) on one token x [1, D] in one C call -> [1, D] float32, with
    ``moe.last_topk_idx`` / ``last_topk_w`` set as its forward sets them; None where the call does not apply (then
    nothing is set). ``coreset``: the pass routes by block coreset (never one token's plain top-k)."""
    if coreset or not _one_token(x):
        return None
    cfg, bank, shared = moe.config, moe.experts, moe.shared_expert
    d, e, k = x.shape[1], cfg.num_experts, moe.top_k
    router = _f32_rows(moe.gate, e, d)
    sgate = _f32_rows(moe.shared_expert_gate, 1, d)
    if (router is None or sgate is None or bank.needs_prepare or not hasattr(bank, "cpu_mats")
            or bank._forward_pre_hooks or bank._forward_hooks):  # hooked (a bench counting experts): its forward runs
        return None
    routed = bank.cpu_mats()
    parts = [_mat(m) for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    if routed is None or None in parts:
        return None
    x = x.contiguous()
    out = torch.empty(1, d, dtype=torch.float32)
    idx = torch.empty(1, k, dtype=torch.int64)
    w = torch.empty(1, k, dtype=torch.float32)
    rc = _function("clover_moe_token")(x.data_ptr(), d, e, k, int(bool(cfg.norm_topk_prob)), router.data_ptr(),
                     bank.intermediate_size, _array(routed), shared.down_proj.in_features, _array(tuple(parts)),
                     sgate.data_ptr(), out.data_ptr(), idx.data_ptr(), w.data_ptr(), torch.get_num_threads())
    cpu_quant._raise_for(rc, "moe_token")
    moe.last_topk_idx, moe.last_topk_w = idx, w
    return out


def gdn_mixer_token(mixer: Any, x: Tensor, st: tuple[Tensor, Tensor], write_cache: bool) -> Tensor | None:
    """``mixer`` (a :class:`engine.model.gdn.GatedDeltaNet`) on one token x [1, D] in one C call -> [1, D] float32,
    its conv and recurrent states (``st``) updated in place when ``write_cache``; None where the call does not apply
    (then nothing is touched). The caller has checked what the separate C calls need (``gdn_kernels.cpu_token_ready``)."""
    if not _one_token(x):
        return None
    d = x.shape[1]
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.dk, mixer.dv
    mats = [_mat(mixer.in_proj_qkv), _mat(mixer.in_proj_z)]
    rows: list[Tensor | None] = []  # in_proj_b / in_proj_a as float32 rows where they have no quantized layout
    for m in (mixer.in_proj_b, mixer.in_proj_a):
        mats.append(_mat(m))
        rows.append(None if mats[-1] is not None else _f32_rows(m, m.out_features, d))
    if None in mats[:2] or any(mat is None and r is None for mat, r in zip(mats[2:], rows)):
        return None
    out_proj = mixer.out_proj
    heads = getattr(out_proj, "in_heads", None)  # GGUF's ssm_out: its input in the file's tiled head order
    out_mat = _mat(out_proj, heads_ok=True) if heads is not None else _mat(out_proj)
    if out_mat is None or (heads is not None and (heads[1] != hv or out_proj.in_features != hv * dv)):
        return None
    no_mat = (0, 0, 0, 0, 0, 0, 0, 0)  # the kernel reads the rows instead
    conv_state, state = st
    conv_w = mixer.conv1d.weight.view(mixer.conv_dim, mixer.kernel)
    x = x.contiguous()
    out = torch.empty(1, d, dtype=torch.float32)
    rc = _function("clover_gdn_mixer_token")(
        x.data_ptr(), d, _array(tuple(m or no_mat for m in mats)), *(None if r is None else r.data_ptr() for r in rows),
        mixer.A_log.data_ptr(), mixer.dt_bias.data_ptr(), conv_w.data_ptr(), mixer.kernel, conv_state.data_ptr(),
        conv_state.data_ptr() if write_cache else None, mixer.norm.weight.data_ptr(), mixer.norm.eps,
        state.data_ptr(), state.data_ptr() if write_cache else None, _array((out_mat,)), heads[0] if heads else 0,
        out.data_ptr(), hk, hv, dk, dv, torch_lanes(), torch.get_num_threads())
    cpu_quant._raise_for(rc, "gdn_mixer_token")
    return out
