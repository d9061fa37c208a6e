"""Gated DeltaNet: the layer (:class:`GatedDeltaNet`, with Clover's block-mode extras) and the gated delta
rule's reference math in plain PyTorch, fp32: chunked (:func:`chunk_prepare`, :func:`chunk_scan`,
:func:`chunk_output`, :func:`chunk_gated_delta_rule`) and recurrent (:func:`recurrent_gated_delta_rule`). The fast
paths that replace it on some forwards are dispatched from :mod:`engine.kernels.gdn_kernels`. Shape letters:
:mod:`engine.model.clover`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.kernels import cpu_block, cpu_quant, gdn_kernels
from clover_desk.engine.kernels.cpu_token import gdn_mixer_token
from clover_desk.engine.model.cache import PassContext
from clover_desk.engine.model.config import CloverConfig
from clover_desk.engine.model.layers import Linear

GDN_CHUNK = 32  # delta-rule chunk length in causal mode (chunks aligned to absolute position 0)
_NEG_INF = float("-inf")


class GatedRMSNorm(nn.Module):
    """GDN output norm, plain weight: y = w * norm(o) * SiLU(z), per head over dv (fp32 norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, o: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass
class _Chunked:
    """Per-chunk quantities of the chunked gated delta rule. Layout [H, n, C, ...] (C = chunk length)."""

    q: Tensor  # [H, n, C, dk] (l2-normed, scaled)
    k: Tensor  # [H, n, C, dk]
    v: Tensor  # [H, n, C, dv] (not beta-scaled)
    q_decay: Tensor  # [H, n, C, dk]  q * e^{Gamma}
    k_tail: Tensor  # [H, n, C, dk]  k * e^{Gamma_C - Gamma}
    u: Tensor  # [H, n, C, dv]  T (beta v)
    w: Tensor  # [H, n, C, dk]  T (beta k e^{Gamma})
    intra: Tensor  # [H, n, C, C]  (q k^T) * D, lower triangle incl. diagonal
    chunk_decay: Tensor  # [H, n]  e^{Gamma_C}
    offset: int  # padded rows in front of the first token
    length: int  # real tokens


def _to_chunks(x: Tensor, offset: int, n: int, chunk: int) -> Tensor:
    """[T, H, ...] -> [H, n, C, ...] with `offset` zero rows in front and zero rows at the back."""
    t = x.shape[0]
    back = n * chunk - offset - t
    pad = [0, 0] * (x.dim() - 1) + [offset, back]
    x = F.pad(x, pad)  # [n*C, H, ...]
    x = x.view(n, chunk, *x.shape[1:])  # [n, C, H, ...]
    return x.movedim(2, 0)  # [H, n, C, ...]


def _from_chunks(x: Tensor, offset: int, length: int) -> Tensor:
    """[H, n, C, d] -> [T, H, d] (drop padding)."""
    h, n, c = x.shape[:3]
    x = x.movedim(0, 2).reshape(n * c, h, *x.shape[3:])  # [n*C, H, d]
    return x[offset : offset + length]


def chunk_prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int, offset: int = 0) -> _Chunked:
    """The parallel part of the chunked rule.

    q, k [T, H, dk] (already l2-normed; q scaled), v [T, H, dv], g, beta [T, H], all fp32. Chunks are aligned so that
    token 0 sits at row ``offset`` of chunk 0 (padding rows: k = v = 0, g = 0, beta = 0 leave the state unchanged).
    """
    t = q.shape[0]
    n = (offset + t + chunk - 1) // chunk
    qc, kc, vc = (_to_chunks(x, offset, n, chunk) for x in (q, k, v))  # [H, n, C, d]
    gc, bc = (_to_chunks(x, offset, n, chunk) for x in (g, beta))  # [H, n, C]
    gamma = gc.cumsum(-1)  # [H, n, C] local cumulative log-decay
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, _NEG_INF).exp()  # [H, n, C, C] = D
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    system = (k_beta @ kc.transpose(-1, -2)) * decay  # [H, n, C, C]; solved as (I + strictly_lower(system))
    # T = (I + strictly_lower(system))^-1 once, then two products: 2.6x faster on the CPU than two triangular solves
    # (LAPACK's small-matrix calls), as accurate against fp64 (5e-8 on a block pass's 32 heads)
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)  # [H, n, C, C]
    u = inverse @ v_beta  # [H, n, C, dv]
    w = inverse @ (k_beta * gamma.exp()[..., None])
    intra = (qc @ kc.transpose(-1, -2)) * decay  # [H, n, C, C]
    last = gamma[..., -1:]  # [H, n, 1]
    return _Chunked(
        q=qc,
        k=kc,
        v=vc,
        q_decay=qc * gamma.exp()[..., None],
        k_tail=kc * (last - gamma).exp()[..., None],
        u=u,
        w=w,
        intra=intra,
        chunk_decay=last[..., 0].exp(),
        offset=offset,
        length=t,
    )


def chunk_scan(ch: _Chunked, state: Tensor, final: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """The sequential part: a loop over chunks (not tokens).

    state [H, dk, dv] fp32 -> (states at each chunk start [H, n, dk, dv], corrected values V' [H, n, C, dv],
    final state [H, dk, dv], or None without ``final``: a pass that writes no cache skips the last chunk's state
    update, a third of a block pass's delta-rule products).

    Compiled (``engine.kernels.fastpath``), a scan over several chunks (a prompt's prefill) runs eagerly: traced, the loop
    would be unrolled once per chunk count, a new graph for every prompt length. One chunk (a block pass) is traced.
    """
    if ch.u.shape[1] > 1 and torch.compiler.is_compiling():
        return _chunk_scan_eager(ch.u, ch.w, ch.chunk_decay, ch.k_tail, state, final)
    return _chunk_scan(ch.u, ch.w, ch.chunk_decay, ch.k_tail, state, final)


def _chunk_scan(u: Tensor, w: Tensor, chunk_decay: Tensor, k_tail: Tensor, state: Tensor,
                final: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`chunk_scan` on the chunk tensors (u, w [H, n, C, dv|dk], chunk_decay [H, n], k_tail [H, n, C, dk])."""
    starts, corrected = [], []
    n = u.shape[1]
    for i in range(n):
        starts.append(state)
        v_new = u[:, i] - w[:, i] @ state  # [H, C, dv]
        corrected.append(v_new)
        if i + 1 < n or final:
            state = state * chunk_decay[:, i, None, None] + k_tail[:, i].transpose(-1, -2) @ v_new
    return torch.stack(starts, 1), torch.stack(corrected, 1), state if final else None


_chunk_scan_eager = torch.compiler.disable(_chunk_scan)


def chunk_output(ch: _Chunked, starts: Tensor, corrected: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Outputs given each chunk's start state (all chunks at once).

    Returns O [H, n, C, dv] (the delta-rule output) and R [H, n, C, dv] = e^{Gamma} S_startᵀ q (the pure read of
    the incoming state, used by the Clover history unit).
    """
    if corrected is None:
        corrected = ch.u - ch.w @ starts  # [H, n, C, dv]
    read = ch.q_decay @ starts  # [H, n, C, dv]
    return read + ch.intra @ corrected, read


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = GDN_CHUNK, offset: int = 0
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule. q, k [T, H, dk], v [T, H, dv], g, beta [T, H] (fp32, q/k normalized, q scaled),
    state [H, dk, dv]. Returns (O [T, H, dv], final state [H, dk, dv])."""
    ch = chunk_prepare(q, k, v, g, beta, chunk, offset)
    starts, corrected, final = chunk_scan(ch, state)
    out, _ = chunk_output(ch, starts, corrected)
    assert final is not None
    return _from_chunks(out, ch.offset, ch.length), final


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Token-by-token form (used for single-token AR steps, and as the reference in tests). Same args as
    :func:`chunk_gated_delta_rule`. S <- e^g S; S <- S + k ((v - Sᵀk) beta)ᵀ; o = Sᵀ q."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]  # [H, dk, dv]
        kv_mem = (state * k[t][:, :, None]).sum(-2)  # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]  # [H, dv]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(-2))  # [H, dv]
    return torch.stack(outs, 0), state


class DepthwiseConv(nn.Module):
    """The GDN short convolution (module name ``conv1d``): ``weight`` [C, 1, K] (causal, left context) and, for
    Clover, ``weight_right`` [C, Kr] (right context inside a block; None when absent)."""

    def __init__(self, channels: int, kernel: int, right_taps: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.weight_right: nn.Parameter | None = None
        if right_taps:
            self.weight_right = nn.Parameter(torch.empty(channels, right_taps), requires_grad=False)


class ParamHolder(nn.Module):
    """A module that only holds parameters (``weight`` and optional ``bias``), shapes set by the checkpoint."""

    def __init__(self, weight_shape: tuple[int, ...], bias_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(weight_shape), requires_grad=False)
        self.bias: nn.Parameter | None = None
        if bias_shape is not None:
            self.bias = nn.Parameter(torch.empty(bias_shape), requires_grad=False)


_RIGHT_TAP_OFFSETS = {
    # offset of tap k (0-based) relative to the current token t, given Kr taps
    "R1": lambda k, kr: 1 + k,  # future taps X_{t+1+k}
    "R2": lambda k, kr: kr - k,  # mirrored X_{t+Kr-k}
    "R3": lambda k, kr: k,  # including the current token X_{t+k}
    "R4": lambda k, kr: kr - 1 - k,  # mirrored, including the current token
}


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (module name ``linear_attn``), with Clover's four block-mode tensors.

    Clover extras (shapes dispatched at run time):
      ``bd_history.weight`` [Hv, D] (+ ``bd_history.bias`` [Hv] or [1]): history logit per v-head from the layer
        input; also accepted: [1, D] (shared), [Hv, dk] (from q per head), [Hv, dv] (from the history read r),
        [Hv] (a constant per head). When dk == dv the [Hv, dk] form is read as q unless the config's
        ``bd_history_input`` (getattr, default "q") says "r".
      ``bd_logit_scale.weight`` [Hv] or [1]: coefficient on ln(L) (or a temperature on the in-block logits).
      ``conv1d.weight_right`` [C, Kr]: right-context conv branch, never crossing the end of a block.
    Any of them may be None (absent from the checkpoint): that part is neutral.
    """

    def __init__(self, config: CloverConfig, layer_idx: int, clover_extras: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.key_dim = config.key_dim
        self.value_dim = config.value_dim
        self.conv_dim = config.conv_dim
        self.kernel = config.linear_conv_kernel_dim
        d, hv = config.hidden_size, self.num_v_heads
        self.in_proj_qkv = Linear(d, self.conv_dim, bias=False)  # rows: q | k | v
        self.in_proj_z = Linear(d, self.value_dim, bias=False)
        self.in_proj_b = Linear(d, hv, bias=False)
        self.in_proj_a = Linear(d, hv, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, self.kernel if clover_extras else None)
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, d, bias=False)
        self.bd_history: ParamHolder | None = None
        self.bd_logit_scale: ParamHolder | None = None
        if clover_extras:
            self.bd_history = ParamHolder((hv, d), (hv,))
            self.bd_logit_scale = ParamHolder((hv,))

    # ---- Clover extras: accepted shapes (used by the loader) ----
    def accepted_extra_shapes(self, name: str) -> list[tuple[int, ...]]:
        """Shapes the checkpoint may give the Clover tensor ``name`` (a name relative to this module)."""
        hv, d = self.num_v_heads, self.config.hidden_size
        if name == "bd_history.weight":
            return [(hv, d), (1, d), (hv, self.dk), (hv, self.dv), (hv,)]
        if name == "bd_history.bias":
            return [(hv,), (1,)]
        if name == "bd_logit_scale.weight":
            return [(hv,), (1,)]
        if name == "conv1d.weight_right":
            return [(self.conv_dim, kr) for kr in range(1, 17)]
        return []

    def has_extras(self) -> bool:
        return self.bd_history is not None or self.bd_logit_scale is not None or self.conv1d.weight_right is not None

    # ---- forward ----
    def forward(self, x: Tensor, p: PassContext, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's (conv state [K-1, C], recurrent state [Hv, dk, dv] fp32) (None without a cache)."""
        if st is not None and not p.block_mode and x.shape[0] == 1 and gdn_kernels.cpu_token_ready(
                x, *st, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight):
            return self._cpu_token(x, p, st)
        cfg = self.config
        t, dtype = x.shape[0], x.dtype
        hv, dk, dv = self.num_v_heads, self.dk, self.dv
        mixed = self.in_proj_qkv(x)  # [T, C] raw (pre-conv)
        z = self.in_proj_z(x).view(t, hv, dv)  # [T, Hv, dv]
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        if t > 1 and cpu_block.usable(self, x, p, st):  # the rest in one C call (a CPU pass or prefill)
            roff = self._right_offsets() if p.block_mode and self.conv1d.weight_right is not None else None
            chunk = p.block_size if p.block_mode else GDN_CHUNK
            return self.out_proj(cpu_block.gdn_block(self, x, mixed, z, b, a, roff, p, st, chunk).to(dtype))
        beta, g = self._gates(b, a)

        if st is not None:
            conv0, state0 = st
        else:
            conv0 = torch.zeros(self.kernel - 1, self.conv_dim, dtype=dtype, device=x.device)
            state0 = torch.zeros(hv, dk, dv, dtype=torch.float32, device=x.device)

        # short convolution: causal (left) branch over [conv state ; X], then the Clover right branch in block mode
        xpad = torch.cat([conv0.to(dtype), mixed], 0)  # [K-1+T, C]
        wl = self.conv1d.weight[:, 0, :].float().t().contiguous()  # [K, C]: each tap's row contiguous (a strided
        # column made each product ~10x slower at 8,192 channels; the same values either way)
        left = sum(xpad[j : j + t].float() * wl[j] for j in range(self.kernel))  # [T, C] fp32
        right = None
        if p.block_mode and self.conv1d.weight_right is not None:
            right = self._right_conv(mixed, p.block_size)  # [T, C] fp32
        act = self._join(left, right).to(dtype)  # [T, C]
        # state path: the right branch may be excluded from the committed state (bd_right_conv_in_state False)
        act_state = act
        if right is not None and not cfg.bd_right_conv_in_state:
            act_state = F.silu(left).to(dtype)

        q, k, v = self._qkv(act)  # [T, Hv, dk], [T, Hv, dk], [T, Hv, dv] fp32
        history_form = cfg.bd_history_form if p.block_mode else "history_only"
        fla = gdn_kernels.enabled(x)  # fla's CUDA kernels for the causal forwards (opt-in, engine.kernels.gdn_kernels)
        if not p.block_mode and t == 1 and st is not None and not fla and gdn_kernels.cpu_step_enabled(x) \
                and state0.dtype == torch.float32 and state0.is_contiguous():
            # one C pass over the state, updated in place when the cache is written (then nothing to copy below)
            out, final = gdn_kernels.cpu_step(q, k, v, g, beta, state0, in_place=p.write_cache), state0
        elif not p.block_mode and t == 1 and st is not None:
            out, final = (gdn_kernels.recurrent if fla else recurrent_gated_delta_rule)(q, k, v, g, beta, state0)
        elif not p.block_mode and fla:
            out, final = gdn_kernels.chunked(q, k, v, g, beta, state0)  # [T, Hv, dv]
        else:
            chunk = p.block_size if p.block_mode else GDN_CHUNK
            offset = p.start_pos % chunk
            ch = chunk_prepare(q, k, v, g, beta, chunk, offset)
            keep = st is not None and p.write_cache  # the state after the pass: only a pass that writes it needs it
            if act_state is act:
                starts, corrected, final = chunk_scan(ch, state0, keep)
            else:
                # states from the causal-only conv outputs; this pass's outputs from the right-inclusive ones
                qs, ks, vs = self._qkv(act_state)
                starts, _, final = chunk_scan(chunk_prepare(qs, ks, vs, g, beta, chunk, offset), state0, keep)
                corrected = None
            o_c, read_c = chunk_output(ch, starts, corrected)  # [Hv, n, B, dv] each
            if p.block_mode and history_form != "history_only" and self._history_active():
                o_c = self._history_mix(x, ch, o_c, read_c, history_form, p.block_size)
            out = _from_chunks(o_c, ch.offset, ch.length)  # [T, Hv, dv]

        if st is not None and p.write_cache:
            conv_buf, state_buf = st
            conv_buf.copy_(xpad[-(self.kernel - 1) :])  # last K-1 raw rows, in place
            if final is not state_buf:
                state_buf.copy_(final)
        y = self.norm(out.reshape(t * hv, dv), z.reshape(t * hv, dv), dtype)  # [T*Hv, dv]
        return self.out_proj(y.view(t, self.value_dim))

    def _gates(self, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """in_proj_b's and in_proj_a's outputs [T, Hv] -> (beta [T, Hv] in (0, 1), g [T, Hv] <= 0 the log decay),
        fp32."""
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return beta, g

    def _cpu_token(self, x: Tensor, p: PassContext, st: tuple[Tensor, Tensor]) -> Tensor:
        """A causal one-token step on the CPU, float32 (``gdn_kernels.cpu_token``): the four input projections (one
        C call for GGUF blocks of one type: ``cpu_quant.qmatmul_many``, the same bits as four) and the gates, two C
        calls for the rest of the mixer (the caches updated in place when ``p.write_cache``), ``out_proj``."""
        conv_buf, state_buf = st
        one = gdn_mixer_token(self, x, st, p.write_cache)  # all of it in one C call where every weight allows
        if one is not None:
            return one.to(x.dtype)
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        blocks = cpu_quant.blocks_of(x, *projections)
        mixed, z, b, a = cpu_quant.qmatmul_many(x, *blocks) if blocks else (m(x) for m in projections)
        beta, g = self._gates(b, a)
        conv = (self.conv1d.weight.view(self.conv_dim, self.kernel), conv_buf)
        y = gdn_kernels.cpu_token(mixed, z, beta, g, conv, (self.norm.weight, self.norm.eps), state_buf,
                                  in_place=p.write_cache)
        return self.out_proj(y)

    def _qkv(self, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Split conv outputs, repeat q/k to v-heads (HF layout: v-head h uses k-head h // (Hv/Hk)), l2norm, scale."""
        t = act.shape[0]
        q, k, v = torch.split(act, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = q.reshape(t, self.num_k_heads, self.dk).float()
        k = k.reshape(t, self.num_k_heads, self.dk).float()
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)  # [T, Hv, dk]
        q = l2norm(q) * self.dk**-0.5
        k = l2norm(k)
        return q, k, v.reshape(t, self.num_v_heads, self.dv).float()

    def _join(self, left: Tensor, right: Tensor | None) -> Tensor:
        if right is None:
            return F.silu(left)
        join = self.config.bd_right_conv_join
        if join == "A":
            return F.silu(left + right)
        if join == "B":
            return F.silu(left) + right
        if join == "C":
            return F.silu(left) + F.silu(right)
        raise ValueError(f"bd_right_conv_join {join!r} is not one of 'A', 'B', 'C'")

    def _right_offsets(self) -> list[int]:
        """Each right tap's offset from the current token (``bd_right_conv_taps``)."""
        wr = self.conv1d.weight_right
        assert wr is not None
        kr = wr.shape[1]
        taps = self.config.bd_right_conv_taps
        if taps not in _RIGHT_TAP_OFFSETS:
            raise ValueError(f"bd_right_conv_taps {taps!r} is not one of {sorted(_RIGHT_TAP_OFFSETS)}")
        return [_RIGHT_TAP_OFFSETS[taps](j, kr) for j in range(kr)]

    def _right_conv(self, mixed: Tensor, block: int) -> Tensor:
        """Right-context taps inside each block: out_t[c] = sum_k Wr[c, k] X_{t + off(k)}[c], zero past the block
        end (a block never sees the next one). mixed [T, C] raw -> [T, C] fp32."""
        wr = self.conv1d.weight_right
        assert wr is not None
        offsets = self._right_offsets()
        t = mixed.shape[0]
        n = (t + block - 1) // block
        xb = F.pad(mixed.float(), (0, 0, 0, n * block - t)).view(n, block, -1)  # [n, B, C]
        xb = F.pad(xb, (0, 0, 0, max(offsets)))  # [n, B + max_off, C]: zeros past each block's end
        wrf = wr.float().t().contiguous()  # [Kr, C] (each tap's row contiguous, as the left taps')
        out = sum(xb[:, o : o + block] * wrf[j] for j, o in enumerate(offsets))  # [n, B, C]
        return out.reshape(n * block, -1)[:t]

    def _history_active(self) -> bool:
        return self.bd_history is not None

    def _history_logit(self, x: Tensor, ch: _Chunked, read: Tensor, block: int) -> Tensor:
        """History logit l [Hv, n, B] (before the ln L calibration)."""
        hist = self.bd_history
        assert hist is not None
        w = hist.weight
        hv, d = self.num_v_heads, self.config.hidden_size
        bias = hist.bias.float() if hist.bias is not None else torch.zeros(1, device=x.device)
        if w.dim() == 1:  # [Hv]: a constant per head
            const = (w.float() + bias)[:, None, None]  # [Hv, 1, 1]
            return const.expand(hv, read.shape[1], read.shape[2])
        if w.shape[1] == d:  # [Hv, D] or [1, D]: from the layer input
            logit = (x.float() @ w.float().t()) + bias  # [T, Hv] or [T, 1]
            logit = logit.expand(x.shape[0], hv)
            return _to_chunks(logit, 0, read.shape[1], block)  # [Hv, n, B]
        use_r = w.shape[1] == self.dv and (w.shape[1] != self.dk or getattr(self.config, "bd_history_input", "q") == "r")
        src = read if use_r else ch.q  # [Hv, n, B, dv|dk]
        return (src * w.float()[:, None, None, :]).sum(-1) + bias[:, None, None]

    def _history_mix(
        self, x: Tensor, ch: _Chunked, out: Tensor, read: Tensor, form: str, block: int
    ) -> Tensor:
        """Clover history unit (F1 / F2): for each v-head and block query i, softmax over [l_i, z_i1..z_iL] with
        z_ij = q_i·k_j over the block's own tokens; o~_i = a_iH h_i + sum_j a_ij v_j, h = O (F1) or R (F2)."""
        cfg = self.config
        if form not in ("F1", "F2"):
            raise ValueError(f"bd_history_form {form!r} is not one of 'F1', 'F2', 'history_only'")
        hv, n = out.shape[0], out.shape[1]
        valid = torch.arange(n * block, device=x.device).view(n, block) < ch.length  # [n, B] real tokens
        scale = self.bd_logit_scale.weight.float() if self.bd_logit_scale is not None else None  # [Hv] | [1]
        z = ch.q @ ch.k.transpose(-1, -2)  # [Hv, n, B, B]
        logit_h = self._history_logit(x, ch, read, block)  # [Hv, n, B]
        if cfg.bd_logit_scale_mode == "temperature":
            if scale is not None:
                z = z * scale.expand(hv)[:, None, None, None]
        elif cfg.bd_logit_scale_mode == "ln_len":
            if scale is not None:
                if cfg.bd_len_mode == "block":
                    ln_len = torch.full((n,), math.log(block), device=x.device)
                elif cfg.bd_len_mode == "tokens":
                    ln_len = valid.sum(-1).float().log()  # [n]
                else:
                    raise ValueError(f"bd_len_mode {cfg.bd_len_mode!r} is not one of 'block', 'tokens'")
                logit_h = logit_h + scale.expand(hv)[:, None, None] * ln_len[None, :, None]
        else:
            raise ValueError(f"bd_logit_scale_mode {cfg.bd_logit_scale_mode!r} is not one of 'ln_len', 'temperature'")
        z = z.masked_fill(~valid[None, :, None, :], _NEG_INF)
        alpha = torch.softmax(torch.cat([logit_h[..., None], z], -1), dim=-1)  # [Hv, n, B, 1+B]
        hist = out if form == "F1" else read
        return alpha[..., :1] * hist + alpha[..., 1:] @ ch.v  # [Hv, n, B, dv]
