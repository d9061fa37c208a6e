"""A Gated DeltaNet layer's mixer for many tokens on the CPU in one C call (``clover_gdn_block`` in
``csrc/quant_cpu.c``): everything between its input projections and ``out_proj`` in a diffusion block pass, a
block-mode prefill or a causal prefill.

Measured at Clover's real widths (32 value heads of 128, 8,192 conv channels), a 32-slot pass's Gated DeltaNet
layer spent ~3.5-5 ms of its mixer outside the projections, in ~80 small torch ops: the two convolutions and their
join, the l2norms, the gates, the chunked delta rule's prepare / scan / output (an explicit inverse of each chunk's
triangular system, batched small products) and the gated RMSNorm, each into a fresh tensor (docs/STATUS.md). The C
call does the same math per value head, the state read once per chunk, the triangular system solved by forward
substitution (the inverse is never formed). The Clover extras are all taken: the right-context convolution (any tap
order, any join), the history unit (F1 / F2, every accepted ``bd_history`` shape, block-length or temperature
calibration). Its sums run in another order than torch's, so the results equal the torch forward's within float32
rounding, not bit for bit (``tests/engine/test_cpu_block.py``).

Taken for block-mode forwards on the CPU (eager, float32, the kernels built) that start on a block boundary, and for
causal forwards of two tokens or more (an AR prompt's prefill: the same rule without the extras, in chunks of 32 from
its first token, where the torch rule aligns them to absolute positions: only the order of the sums differs); not for
a commit pass whose state update must leave the right branch out (``bd_right_conv_in_state`` false, which needs a
second set of conv outputs). :func:`set_enabled` switches it off (the torch rule then runs, as it does on a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant, gdn_kernels

ENABLED = True
_FORMS = {"F1": 1, "F2": 2}
_JOINS = {"A": 0, "B": 1, "C": 2}
_MAX_HEAD_DIM, _MAX_BLOCK = 1024, 4095  # clover_gdn_block's limits (dk, dv; the block length)


class _Block(ctypes.Structure):  # csrc/quant_cpu.c gdn_block_t
    _fields_ = [(n, ctypes.c_int64) for n in ("T", "C", "K", "Kr", "Hk", "Hv", "dk", "dv", "block")] + [
        (n, ctypes.c_void_p) for n in ("mixed", "conv0", "wl", "wr", "roff")] + [("join", ctypes.c_int64)] + [
        (n, ctypes.c_void_p) for n in ("b", "a", "a_log", "dt_bias", "z", "state", "state_out")] + [
        ("form", ctypes.c_int64), ("hlogit", ctypes.c_void_p), ("hw", ctypes.c_void_p), ("hsrc", ctypes.c_int64),
        ("temp", ctypes.c_void_p), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float), ("y", ctypes.c_void_p)]


_BOUND: dict[int, Any] = {}


def _function() -> Any:
    lib = cpu_quant.kernels().lib()
    fn = _BOUND.get(id(lib))
    if fn is None:
        fn = lib.clover_gdn_block
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Block), ctypes.c_int]
        _BOUND[id(lib)] = fn
    return fn


def set_enabled(on: bool) -> bool:
    """Turn the C mixer for many tokens on or off for this process; returns the previous setting."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    return before


def _f32(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _history(mixer: Any, x: Tensor, t: int, block: int) -> tuple[int, Tensor | None, Tensor | None, int, Tensor | None]:
    """(form, hlogit [T, Hv], hw, hsrc, temp) of ``clover_gdn_block`` for ``mixer``'s history unit, as
    :meth:`engine.model.gdn.GatedDeltaNet._history_logit` and ``_history_mix`` compute it (form 0: no unit)."""
    cfg = mixer.config
    form = _FORMS.get(cfg.bd_history_form, 0) if mixer._history_active() else 0
    if not form:
        return 0, None, None, 0, None
    hist, hv = mixer.bd_history, mixer.num_v_heads
    w = hist.weight.float()
    bias = hist.bias.float() if hist.bias is not None else torch.zeros(1)
    hw, hsrc = None, 0
    if w.dim() == 1:  # a constant per head
        logit = (w + bias).expand(t, hv)
    elif w.shape[1] == cfg.hidden_size:  # from the layer input
        logit = (x.float() @ w.t() + bias).expand(t, hv)
    else:  # from q or from the history read, per head: the kernel adds that term
        use_r = w.shape[1] == mixer.dv and (w.shape[1] != mixer.dk or getattr(cfg, "bd_history_input", "q") == "r")
        hw, hsrc = w.contiguous(), 2 if use_r else 1
        logit = bias.expand(t, hv)
    scale = mixer.bd_logit_scale.weight.float().expand(hv) if mixer.bd_logit_scale is not None else None
    temp = None
    if scale is not None and cfg.bd_logit_scale_mode == "temperature":
        temp = scale.contiguous()
    elif scale is not None:  # ln_len: s * ln(L), L the block size or the tokens of the row's block
        rows = torch.arange(t)
        length = torch.full((t,), block) if cfg.bd_len_mode == "block" else (t - rows // block * block).clamp(max=block)
        logit = logit + scale[None, :] * length.float().log()[:, None]
    return form, logit.contiguous(), hw, hsrc, temp


def usable(mixer: Any, x: Tensor, p: Any, st: tuple[Tensor, Tensor] | None) -> bool:
    """Whether ``mixer``'s forward on x takes :func:`gdn_block` (see the module): a block-mode forward from a block
    boundary, or a causal one of two tokens or more."""
    cfg = mixer.config
    keep = st is not None and p.write_cache
    if not (ENABLED and not torch.compiler.is_compiling() and x.dim() == 2 and _f32(x) and cpu_quant.usable()):
        return False
    if not (p.start_pos % p.block_size == 0 if p.block_mode else x.shape[0] > 1 and not gdn_kernels.enabled(x)):
        return False  # (a causal forward opted in to fla's kernels takes them)
    if p.block_mode and keep and mixer.conv1d.weight_right is not None and not cfg.bd_right_conv_in_state:
        return False
    if max(mixer.dk, mixer.dv) > _MAX_HEAD_DIM or (p.block_size or 0) > _MAX_BLOCK:
        return False  # past the kernel's limits: the torch forward has none
    if cfg.bd_right_conv_join not in _JOINS or cfg.bd_logit_scale_mode not in ("ln_len", "temperature") \
            or cfg.bd_len_mode not in ("block", "tokens") or cfg.bd_history_form not in ("F1", "F2", "history_only"):
        return False  # the torch forward names the value at fault
    return st is None or all(_f32(s) and s.is_contiguous() for s in st)


def gdn_block(mixer: Any, x: Tensor, mixed: Tensor, z: Tensor, b: Tensor, a: Tensor, roff: list[int] | None, p: Any,
              st: tuple[Tensor, Tensor] | None, chunk: int) -> Tensor:
    """``mixer`` (a :class:`engine.model.gdn.GatedDeltaNet`) between its projections and ``out_proj`` for a forward
    that :func:`usable` allows: x [T, D] the layer input, its projections mixed [T, C], z [T, Hv * dv], b, a [T, Hv];
    ``roff`` the right taps' offsets (None without the right branch or outside block mode); ``chunk`` the delta rule's
    chunk length (the block in block mode; a causal forward's chunks change only the order of its sums); ``st`` the
    (conv state, recurrent state) of the cache or None -> y [T, Hv * dv] float32, the caches written when
    ``p.write_cache`` (as the torch forward writes them)."""
    cfg = mixer.config
    t, c, kern = mixed.shape[0], mixer.conv_dim, mixer.kernel
    hv, dk, dv = mixer.num_v_heads, mixer.dk, mixer.dv
    keep = st is not None and p.write_cache
    if st is not None:
        conv0, state = st
    else:
        conv0 = torch.zeros(kern - 1, c)
        state = torch.zeros(hv, dk, dv)
    mixed, z, b, a = (v.float().contiguous() for v in (mixed, z, b, a))
    wl = mixer.conv1d.weight[:, 0, :].float().t().contiguous()  # [K, C]
    wr = offsets = None
    if p.block_mode and mixer.conv1d.weight_right is not None and roff is not None:
        wr = mixer.conv1d.weight_right.float().t().contiguous()  # [Kr, C]
        offsets = torch.tensor(roff, dtype=torch.int64)
    form, hlogit, hw, hsrc, temp = _history(mixer, x, t, chunk) if p.block_mode else (0, None, None, 0, None)
    a_log, dt_bias, norm_w = (v.float().contiguous() for v in (mixer.A_log, mixer.dt_bias, mixer.norm.weight))
    y = torch.empty(t, hv * dv)

    def ptr(v: Tensor | None) -> int | None:
        return None if v is None else v.data_ptr()

    args = _Block(t, c, kern, 0 if wr is None else wr.shape[0], mixer.num_k_heads, hv, dk, dv, chunk,
                  ptr(mixed), ptr(conv0), ptr(wl), ptr(wr), ptr(offsets), _JOINS[cfg.bd_right_conv_join],
                  ptr(b), ptr(a), ptr(a_log), ptr(dt_bias), ptr(z), ptr(state), ptr(state) if keep else None,
                  form, ptr(hlogit), ptr(hw), hsrc, ptr(temp), ptr(norm_w), mixer.norm.eps, ptr(y))
    rc = _function()(ctypes.byref(args), torch.get_num_threads())
    if rc:
        raise ValueError(f"gdn_block: the kernel refused layer {mixer.layer_idx}'s shapes (code {rc})")
    if keep and kern > 1:
        conv0.copy_(torch.cat([conv0, mixed], 0)[-(kern - 1):])  # the last K-1 raw rows, as the torch forward keeps
    return y
