"""Clover-35B-A3B / Qwen3.5-MoE text model in plain PyTorch: one file for the whole architecture.

Math: the Qwen3.5-MoE causal model (gated attention, Gated DeltaNet, MoE with a shared expert) and Clover's block
mode; every alternative reading of Clover's extras is a config switch (engine/model/config.py).

Letters used in shape comments:
  T tokens in this pass, P committed prefix length (cache.length), S = P + T keys, D hidden size, V vocab,
  Hq / Hkv attention query / key-value heads, hd attention head dim, rd rotary dims,
  Hk / Hv GDN key / value heads, dk / dv GDN key / value head dims, C conv channels (2*Hk*dk + Hv*dv),
  K conv kernel, Kr right-conv taps, B block size (also the GDN chunk length in block mode), n chunks / blocks,
  E experts, k experts per token, I expert intermediate size.

The model runs one sequence at a time: ``ids`` is a 1-D LongTensor. See :meth:`CloverModel.forward`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.errors import PromptError
from clover_desk.engine.kernels import gdn_kernels
from clover_desk.engine.model.config import CloverConfig
from clover_desk.engine.model.experts import DenseExpertBank, ExpertBank
from clover_desk.engine.weights.formats import FP32_PARAMS

log = logging.getLogger(__name__)

GDN_CHUNK = 32  # delta-rule chunk length in causal mode (chunks aligned to absolute position 0)
_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------------------------
# norms and small helpers
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


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


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row product (an AR step), when compiled for the CPU, is written as multiply-and-sum
    over the input features: inductor then generates the matrix-vector product inside the layer's own kernel,
    reading the weight rows straight through, instead of calling the BLAS ``mm`` (measured: MKL's one-row product
    costs ~10 us a call on the deep-narrow shape, 7 calls a layer, and reads weights not in cache at ~10 GB/s against
    ~18 GB/s for the generated loop on one core). Eager, CUDA and multi-row passes call ``F.linear``: same math,
    another summation order."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
            y = (x[:, None, :] * self.weight[None, :, :]).sum(-1)  # [1, O]
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / transformers convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rotate_half(x: Tensor) -> Tensor:
    """NeoX rotation: pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """positions [T] (long) -> cos, sin [T, rd] in fp32 (NeoX layout: the rd/2 frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rd]
    return emb.cos(), emb.sin()


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, hd]: rotate the first rd dims (cos/sin [T, rd]); the remaining dims pass through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rd]
    xr = xr * c + rotate_half(xr) * s
    return torch.cat((xr.to(x.dtype), xp), dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------------------------


class ModelCache:
    """Per-sequence state: KV of the full-attention layers (preallocated to ``max_len``, grows by writes) and, per
    GDN layer, the conv state (last K-1 raw pre-conv rows) and the recurrent state S (fp32).

    ``length`` is the number of committed tokens. Only :meth:`CloverModel.forward` with ``write_cache=True``
    changes anything here.
    """

    def __init__(self, config: CloverConfig, max_len: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.max_len = max_len
        self.length = 0
        n = config.num_hidden_layers
        self.key: list[Tensor | None] = [None] * n  # [Hkv, max_len, hd] per full-attention layer
        self.value: list[Tensor | None] = [None] * n
        self.conv: list[Tensor | None] = [None] * n  # [K-1, C] per GDN layer (model dtype)
        self.state: list[Tensor | None] = [None] * n  # [Hv, dk, dv] fp32 per GDN layer
        for i in range(n):
            if config.is_full_attention(i):
                shape = (config.num_key_value_heads, max_len, config.head_dim)
                self.key[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.value[i] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                self.conv[i] = torch.zeros(config.linear_conv_kernel_dim - 1, config.conv_dim, dtype=dtype, device=device)
                self.state[i] = torch.zeros(
                    config.linear_num_value_heads,
                    config.linear_key_head_dim,
                    config.linear_value_head_dim,
                    dtype=torch.float32,
                    device=device,
                )

    def tensors(self) -> list[Tensor]:
        """Every state tensor (for byte accounting and equality checks)."""
        return [t for group in (self.key, self.value, self.conv, self.state) for t in group if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset(self) -> None:
        """Forget everything (length 0, zero state)."""
        self.length = 0
        for t in self.tensors():
            t.zero_()

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s own state: (key, value) of a full-attention layer, (conv, state) of a GDN layer. Layers are
        handed these tensors rather than an index, so one compiled layer serves every layer of its kind."""
        first, second = (self.key[i], self.value[i]) if self.key[i] is not None else (self.conv[i], self.state[i])
        assert first is not None and second is not None
        return first, second

    def gdn_snapshot(self) -> list[Tensor]:
        """Copies of the Gated DeltaNet conv and recurrent states: with ``length``, all that a cache-writing pass
        changes which later passes read (key and value rows past ``length`` are scratch). For :meth:`roll_back`."""
        return [t.clone() for group in (self.conv, self.state) for t in group if t is not None]

    def roll_back(self, snapshot: list[Tensor], length: int) -> None:
        """Back to what :meth:`gdn_snapshot` saw, at ``length`` committed tokens (the length then): the states
        copied back in place (a recorded CUDA graph keeps its addresses); the key and value rows past ``length``
        become scratch again."""
        live = [t for group in (self.conv, self.state) for t in group if t is not None]
        for t, saved in zip(live, snapshot, strict=True):
            t.copy_(saved)
        self.length = length

    def clone(self) -> "ModelCache":
        """A deep copy (tests, snapshots)."""
        other = object.__new__(ModelCache)
        other.max_len, other.length = self.max_len, self.length
        for name in ("key", "value", "conv", "state"):
            setattr(other, name, [None if t is None else t.clone() for t in getattr(self, name)])
        return other


# ----------------------------------------------------------------------------------------------------------------
# one forward pass: what every layer needs to know
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Pass:
    start_pos: int
    length: int  # T
    block_size: int | None  # None = causal (AR)
    cache: ModelCache | None
    write_cache: bool
    cos: Tensor  # [T, rd] fp32
    sin: Tensor
    attn_mask: Tensor | None  # [T, S] bool (True = may attend) or None
    attn_causal: bool  # use SDPA's is_causal (keys == queries, plain causal)
    coreset: bool  # apply the MoE block coreset in this pass
    # A static pass (CloverModel.static_pass: an AR step or a whole block): the positions as a device tensor [T]
    # (long), the keys read up to a fixed length kv_len (past the last position; attn_mask hides the rest), so that
    # nothing in the pass depends on a host int.
    pos: Tensor | None = None
    kv_len: int = 0
    # Attention by groups of query rows (:meth:`CloverModel._attention_mask`): (first row, end row, key end) each, the
    # keys past a group's end hidden from all its rows; attn_mask, when set, is sliced to the group. Empty: one call.
    # by_rows says which; such a pass runs its full-attention layers eagerly (CloverModel._forward_pass), so no
    # compiled graph is guarded on the groups.
    attn_rows: tuple[tuple[int, int, int], ...] = ()
    by_rows: bool = False

    @property
    def block_mode(self) -> bool:
        return self.block_size is not None


# ----------------------------------------------------------------------------------------------------------------
# gated full attention
# ----------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Gated full attention with partial RoPE, q/k norms and GQA (module name ``self_attn``)."""

    def __init__(self, config: CloverConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = Linear(d, self.num_heads * hd * 2, bias=bias)  # per head: [query(hd), gate(hd)]
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = Linear(d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x: Tensor, p: _Pass, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's (key, value) cache buffers [Hkv, max_len, hd] (None without a cache)."""
        t, hd = x.shape[0], self.head_dim
        qg = self.q_proj(x).view(t, self.num_heads, 2 * hd)  # [T, Hq, 2hd]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, self.num_heads * hd)  # [T, Hq, hd], [T, Hq*hd]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, hd))  # [T, Hkv, hd]
        v = self.v_proj(x).view(t, self.num_kv_heads, hd)  # [T, Hkv, hd]
        q, k = apply_partial_rope(q, p.cos, p.sin), apply_partial_rope(k, p.cos, p.sin)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, hd]

        saved: tuple[Tensor, Tensor] | None = None
        if st is not None:
            kbuf, vbuf = st
            lo, hi = p.start_pos, p.start_pos + t
            if p.pos is not None:  # a static pass: written where the position tensor says, read to a fixed length
                if not p.write_cache:  # the same scratch use as below, at the positions the tensor holds
                    saved = (kbuf.index_select(1, p.pos), vbuf.index_select(1, p.pos))
                kbuf.index_copy_(1, p.pos, k.to(kbuf.dtype))
                vbuf.index_copy_(1, p.pos, v.to(vbuf.dtype))
                hi = p.kv_len
            else:
                if not p.write_cache:
                    # The slots past cache.length are scratch: use them for this pass, then put back what was there
                    # so a read-only pass leaves the cache bit-identical.
                    saved = (kbuf[:, lo:hi].clone(), vbuf[:, lo:hi].clone())
                kbuf[:, lo:hi] = k.to(kbuf.dtype)
                vbuf[:, lo:hi] = v.to(vbuf.dtype)
            keys, values = kbuf[:, :hi], vbuf[:, :hi]  # [Hkv, S, hd]
        else:
            keys, values = k, v
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        g = self.num_heads // self.num_kv_heads
        if t == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
            # One query (an AR step), compiled for the CPU: the scores, softmax and weighted sum written out, so that
            # inductor generates them inside the layer's kernels instead of calling the flash kernel (an OpenMP
            # region per call: ~35 us at these sizes, and a stall whenever the other cores are busy).
            qf = q.reshape(self.num_kv_heads, g, hd).float()  # [Hkv, G, hd]
            scores = (qf[:, :, None, :] * keys.float()[:, None, :, :]).sum(-1) * hd**-0.5  # [Hkv, G, S]
            if p.attn_mask is not None:  # [1, S]: a static step's keys past its position
                scores = scores.masked_fill(~p.attn_mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = (probs[..., None] * values.float()[:, None, :, :]).sum(-2)  # [Hkv, G, hd]
            o = o.to(q.dtype).reshape(self.num_heads, 1, hd)  # [Hq, 1, hd]
        elif p.by_rows:  # a pass over several blocks (a prefill segment): a group of rows at a time
            o = _attention_by_rows(q, keys, values, p, g)
        elif p.attn_causal:  # keys == queries, plain causal: SDPA's own causal mask (it handles GQA itself)
            o = F.scaled_dot_product_attention(
                q[None], keys[None], values[None], is_causal=True, scale=hd**-0.5, enable_gqa=g > 1
            )[0]  # [Hq, T, hd]
        else:
            # GQA by folding: the g query heads that share a KV head become g*T query rows of that head. Exact (every
            # head of a group sees the same keys and the same mask), and SDPA then runs plain multi-head attention:
            # its enable_gqa path is ~100x slower on the CPU for one query, and on CUDA a mask with GQA forces the
            # math kernel (fp32 scores); without GQA the memory-efficient kernel takes the mask.
            qf = q.reshape(self.num_kv_heads, g * t, hd)  # [Hkv, G*T, hd]; kv head j serves q heads j*G..j*G+G-1
            mask = p.attn_mask.repeat(g, 1) if p.attn_mask is not None and g > 1 else p.attn_mask  # [G*T, S]
            o = F.scaled_dot_product_attention(qf[None], keys[None], values[None], attn_mask=mask, scale=hd**-0.5)
            o = o[0].reshape(self.num_heads, t, hd)  # [Hq, T, hd]
        if saved is not None:
            if p.pos is not None:
                kbuf.index_copy_(1, p.pos, saved[0])
                vbuf.index_copy_(1, p.pos, saved[1])
            else:
                kbuf[:, lo:hi], vbuf[:, lo:hi] = saved
        o = o.transpose(0, 1).reshape(t, self.num_heads * hd) * torch.sigmoid(gate)  # [T, Hq*hd]
        return self.o_proj(o)


ATTENTION_ROWS = 64  # query rows per attention call in a causal pass over many rows after cached keys


@torch.compiler.disable
def _attention_by_rows(q: Tensor, keys: Tensor, values: Tensor, p: _Pass, g: int) -> Tensor:
    """Attention of q [Hq, T, hd] over keys / values [Hkv, S, hd], one group of query rows at a time
    (``p.attn_rows``): each group reads the keys up to its own key end, so a block of a block-causal pass needs no
    mask at all (every row of a block sees the whole prefix and the whole block), and a causal pass only its group's
    rows of ``p.attn_mask`` [T, S].

    A whole [T, S] mask would cost T x S bytes per folded head, and SDPA's memory-efficient kernel turns it into a
    padded bias in the compute dtype: 1 + 5G bytes per (row, key), ~280 MB for a 416-token prefill segment at a
    16K context with the 35B-A3B heads; here a block's call takes flash attention with no scratch, and it reads
    only the keys it sees (half the score work of a masked segment). Never traced: the groups are host ints, which
    would recompile a compiled layer for every segment length (CloverModel._forward_pass runs such a pass's
    full-attention layers eagerly)."""
    mask, rows = p.attn_mask, p.attn_rows
    hq, _, hd = q.shape
    h_kv = hq // g
    outs = []
    for r0, r1, kend in rows:
        n = r1 - r0
        qf = q[:, r0:r1].reshape(h_kv, g * n, hd)  # [Hkv, G*n, hd]: the G query heads of a KV head as rows
        m = None
        if mask is not None:
            m = mask[r0:r1, :kend]  # [n, kend]
            m = m.repeat(g, 1) if g > 1 else m  # [G*n, kend]
        o = F.scaled_dot_product_attention(qf[None], keys[None, :, :kend], values[None, :, :kend], attn_mask=m,
                                           scale=hd**-0.5)
        outs.append(o[0].reshape(hq, n, hd))  # [Hq, n, hd]
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [Hq, T, hd]


# ----------------------------------------------------------------------------------------------------------------
# gated delta rule (chunked + recurrent), fp32
# ----------------------------------------------------------------------------------------------------------------


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
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [H, n, C, dv]
    w = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
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


def chunk_scan(ch: _Chunked, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part: a loop over chunks (not tokens).

    state [H, dk, dv] fp32 -> (states at each chunk start [H, n, dk, dv], corrected values V' [H, n, C, dv],
    final state [H, dk, dv]).

    Compiled (``engine.kernels.fastpath``), a scan over several chunks (a prompt's prefill) runs eagerly: traced, the loop
    would be unrolled once per chunk count, a new graph for every prompt length. One chunk (a block pass) is traced.
    """
    if ch.u.shape[1] > 1 and torch.compiler.is_compiling():
        return _chunk_scan_eager(ch.u, ch.w, ch.chunk_decay, ch.k_tail, state)
    return _chunk_scan(ch.u, ch.w, ch.chunk_decay, ch.k_tail, state)


def _chunk_scan(u: Tensor, w: Tensor, chunk_decay: Tensor, k_tail: Tensor, state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`chunk_scan` on the chunk tensors (u, w [H, n, C, dv|dk], chunk_decay [H, n], k_tail [H, n, C, dk])."""
    starts, corrected = [], []
    for i in range(u.shape[1]):
        starts.append(state)
        v_new = u[:, i] - w[:, i] @ state  # [H, C, dv]
        corrected.append(v_new)
        state = state * chunk_decay[:, i, None, None] + k_tail[:, i].transpose(-1, -2) @ v_new
    return torch.stack(starts, 1), torch.stack(corrected, 1), state


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


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet (+ Clover block-mode extras)
# ----------------------------------------------------------------------------------------------------------------


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
    def forward(self, x: Tensor, p: _Pass, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's (conv state [K-1, C], recurrent state [Hv, dk, dv] fp32) (None without a cache)."""
        cfg = self.config
        t, dtype = x.shape[0], x.dtype
        hv, dk, dv = self.num_v_heads, self.dk, self.dv
        mixed = self.in_proj_qkv(x)  # [T, C] raw (pre-conv)
        z = self.in_proj_z(x).view(t, hv, dv)  # [T, Hv, dv]
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # [T, Hv] <= 0

        if st is not None:
            conv0, state0 = st
        else:
            conv0 = torch.zeros(self.kernel - 1, self.conv_dim, dtype=dtype, device=x.device)
            state0 = torch.zeros(hv, dk, dv, dtype=torch.float32, device=x.device)

        # short convolution: causal (left) branch over [conv state ; X], then the Clover right branch in block mode
        xpad = torch.cat([conv0.to(dtype), mixed], 0)  # [K-1+T, C]
        wl = self.conv1d.weight[:, 0, :].float()  # [C, K]
        left = sum(xpad[j : j + t].float() * wl[:, j] for j in range(self.kernel))  # [T, C] fp32
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
            if act_state is act:
                starts, corrected, final = chunk_scan(ch, state0)
            else:
                # states from the causal-only conv outputs; this pass's outputs from the right-inclusive ones
                qs, ks, vs = self._qkv(act_state)
                starts, _, final = chunk_scan(chunk_prepare(qs, ks, vs, g, beta, chunk, offset), state0)
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

    def _right_conv(self, mixed: Tensor, block: int) -> Tensor:
        """Right-context taps inside each block: out_t[c] = sum_k Wr[c, k] X_{t + off(k)}[c], zero past the block
        end (a block never sees the next one). mixed [T, C] raw -> [T, C] fp32."""
        wr = self.conv1d.weight_right
        assert wr is not None
        kr = wr.shape[1]
        taps = self.config.bd_right_conv_taps
        if taps not in _RIGHT_TAP_OFFSETS:
            raise ValueError(f"bd_right_conv_taps {taps!r} is not one of {sorted(_RIGHT_TAP_OFFSETS)}")
        offsets = [_RIGHT_TAP_OFFSETS[taps](j, kr) for j in range(kr)]
        t = mixed.shape[0]
        n = (t + block - 1) // block
        xb = F.pad(mixed.float(), (0, 0, 0, n * block - t)).view(n, block, -1)  # [n, B, C]
        xb = F.pad(xb, (0, 0, 0, max(offsets)))  # [n, B + max_off, C]: zeros past each block's end
        wrf = wr.float()
        out = sum(xb[:, o : o + block] * wrf[:, j] for j, o in enumerate(offsets))  # [n, B, C]
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


# ----------------------------------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """SwiGLU MLP (the shared expert)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def block_coreset_topk(
    probs: Tensor, block_size: int, k: int, top_p: float, restrict: str = "R-a"
) -> tuple[Tensor, Tensor]:
    """MoE block coreset, vectorized over blocks.

    probs [T, E] fp32 router softmax; tokens are grouped in consecutive blocks of ``block_size``. Per block the
    coreset C is the smallest set of experts covering ``top_p`` of the block's top-k candidate mass, and at least k
    experts (the block's k most massive ones when fewer cover ``top_p``). Each token is
    then routed inside C: "R-a" re-routes to the top-k of its probabilities restricted to C, "R-b" keeps its
    original top-k ∩ C (the best expert of C when empty). Weights are renormalized. Slots left over when fewer than
    k experts qualify point at the token's first expert with weight 0, so a block never touches an expert outside C.
    Returns (weights [T, k] fp32, ids [T, k] long).
    """
    t, e = probs.shape
    n = (t + block_size - 1) // block_size
    pb = F.pad(probs, (0, 0, 0, n * block_size - t)).view(n, block_size, e)  # [n, B, E]; pad rows have 0 mass
    top_v, top_i = pb.topk(k, dim=-1)  # [n, B, k]
    mass = torch.zeros(n, e, dtype=probs.dtype, device=probs.device)
    mass.scatter_add_(1, top_i.reshape(n, -1), top_v.reshape(n, -1))  # [n, E] candidate mass per expert
    sorted_mass, order = mass.sort(-1, descending=True)  # [n, E]
    cum = sorted_mass.cumsum(-1) / sorted_mass.sum(-1, keepdim=True).clamp_min(1e-30)
    # at least k experts: a block whose router rows agree would otherwise route every token to 1-2 experts and drop
    # the rest of its top-k (dMoE keeps at least 16); with k in C every token keeps k experts
    count = (1 + (cum < top_p).sum(-1)).clamp(min=min(k, e), max=e)  # [n]
    keep_sorted = torch.arange(e, device=probs.device)[None, :] < count[:, None]  # [n, E]
    in_core = torch.zeros(n, e, dtype=torch.bool, device=probs.device).scatter_(1, order, keep_sorted)  # [n, E]
    masked = pb.masked_fill(~in_core[:, None, :], -1.0)  # [n, B, E]; outside C below any probability
    if restrict == "R-a":
        w, idx = masked.topk(k, dim=-1)  # [n, B, k]
        ok = w >= 0
    elif restrict == "R-b":
        w, idx = top_v, top_i
        ok = in_core.gather(1, top_i.reshape(n, -1)).view(n, block_size, k)  # [n, B, k]
        best = masked.argmax(-1, keepdim=True)  # [n, B, 1] best expert inside C
        none = ~ok.any(-1, keepdim=True)  # [n, B, 1]
        first = torch.zeros_like(ok)
        first[..., 0] = True
        idx = torch.where(none & first, best, idx)
        w = torch.where(none & first, pb.gather(-1, best).expand_as(w), w)
        ok = ok | (none & first)
    else:
        raise ValueError(f"coreset_restrict {restrict!r} is not one of 'R-a', 'R-b'")
    w = torch.where(ok, w, torch.zeros_like(w))
    first_valid = torch.gather(idx, -1, ok.float().argmax(-1, keepdim=True))  # [n, B, 1] (every row has one)
    idx = torch.where(ok, idx, first_valid)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    return w.reshape(n * block_size, k)[:t], idx.reshape(n * block_size, k)[:t]


class SparseMoe(nn.Module):
    """Routed experts + shared expert (module name ``mlp``).

    After each forward, ``last_topk_idx`` [T, k] and ``last_topk_w`` [T, k] hold the routing it used. Before a
    streamed bank runs, ``experts.prepare_for(x, idx)`` reads which experts this forward touches (one host read)
    and hands their sorted ids (CPU LongTensor) to ``experts.prepare``.
    """

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.gate = Linear(d, config.num_experts, bias=False)  # router
        self.experts: ExpertBank = DenseExpertBank(config.num_experts, d, config.moe_intermediate_size)
        self.shared_expert = MLP(d, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(d, 1, bias=False)
        self.last_topk_idx: Tensor | None = None
        self.last_topk_w: Tensor | None = None

    def route(self, x: Tensor, p: _Pass) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, k] fp32, ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] fp32
        if p.coreset and p.block_size is not None:
            cfg = self.config
            return block_coreset_topk(probs, p.block_size, self.top_k, cfg.moe_block_coreset_top_p, cfg.coreset_restrict)
        w, idx = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.config.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w, idx

    def forward(self, x: Tensor, p: _Pass) -> Tensor:
        w, idx = self.route(x, p)
        return self.combine(x, self.routed(x, w, idx))

    def routed(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        """The routed experts' part: x [T, D], the routing (w, idx) [T, k] from :meth:`route` -> [T, D]. The one
        part of a layer that may read the host (a streamed bank's fetch, a quantized bank's group sizes):
        ``engine.kernels.step_graphs`` runs it eagerly between recorded pieces when it does."""
        self.last_topk_idx, self.last_topk_w = idx, w
        # a streamed bank fetches its experts first (a host read) unless it reads them in place; resident ones don't
        if self.experts.needs_prepare and self.experts.fetches(idx.numel()):
            self.experts.prepare_for(x, idx)
        return self.experts(x, idx, w)  # [T, D]

    def combine(self, x: Tensor, routed: Tensor) -> Tensor:
        """The routed part plus the gated shared expert: -> [T, D]."""
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))  # [T, D]
        return routed + shared


# ----------------------------------------------------------------------------------------------------------------
# decoder
# ----------------------------------------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int, clover_extras: bool) -> None:
        super().__init__()
        self.is_full_attention = config.is_full_attention(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_full_attention:
            self.self_attn = Attention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx, clover_extras)
        self.mlp = SparseMoe(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, p: _Pass, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's cache tensors (``ModelCache.layer``), None without a cache."""
        h, x, w, idx = self.front(h, p, st)
        return self.back(h, x, self.mlp.routed(x, w, idx))

    def front(self, h: Tensor, p: _Pass, st: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to its routed experts: the token mixer and its residual, the MoE input norm and the routing.
        Returns (h [T, D] after the mixer, x [T, D] the MoE input, w [T, k] fp32, idx [T, k] long)."""
        mixer = self.self_attn if self.is_full_attention else self.linear_attn
        h = h + mixer(self.input_layernorm(h), p, st)
        x = self.post_attention_layernorm(h)
        w, idx = self.mlp.route(x, p)
        return h, x, w, idx

    def back(self, h: Tensor, x: Tensor, routed: Tensor) -> Tensor:
        """The layer after its routed experts (``routed`` [T, D] from ``mlp.routed``): shared expert and residual."""
        return h + self.mlp.combine(x, routed)


class CloverModel(nn.Module):
    """The text model. Parameter names equal the checkpoint names with the weight prefix removed
    (``embed_tokens.weight``, ``layers.N....``, ``norm.weight``, ``lm_head.weight``).

    Construction allocates uninitialized storage (no random init): weights come from ``engine.weights.checkpoint``.
    Pass ``device="meta"`` for a shape-only skeleton. ``clover_extras`` (default: config.is_diffusion) creates the
    four Clover GDN tensors per linear-attention layer.
    """

    def __init__(
        self,
        config: CloverConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        clover_extras: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        extras = config.is_diffusion if clover_extras is None else clover_extras
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i, extras) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # model dtype everywhere except the fp32 GDN decay parameters
        for name, param in self.named_parameters():
            param.requires_grad_(False)
            if not name.endswith(FP32_PARAMS):
                param.data = param.data.to(dtype)
        if str(device) != "meta":
            self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.dtype = dtype
        # longest single pass when writing the cache; longer inputs are split into whole-block segments
        self.max_pass_tokens = 2048
        # engine.kernels.fastpath: what runs the AR steps (is_hot_pass) as one call (a compiled graph or CUDA graphs)
        self.step_graph: Callable[..., Tensor] | None = None
        # engine.kernels.fastpath on a GPU: what runs a whole block after the cache (denoising and commit passes) as CUDA
        # graphs (engine.kernels.step_graphs)
        self.pass_graph: Callable[..., Tensor] | None = None
        self._kept_cache: ModelCache | None = None  # new_cache, while the passes replay CUDA graphs

    @property
    def device(self) -> torch.device:
        """Where the layers run. The embedding table may live elsewhere (host RAM under a VRAM plan)."""
        return self.norm.weight.device

    def new_cache(self, max_len: int) -> ModelCache:
        """An empty cache for up to ``max_len`` tokens.

        When the passes replay CUDA graphs (``engine.kernels.step_graphs``, whose graphs belong to one cache), the model
        keeps one cache and hands it out again, emptied, to every request that fits in it (sized up to a multiple
        of 256 tokens: at most 255 more than asked, so a plan's context budget holds), so that a request replays the
        graphs the previous one recorded instead of recording them again before its first token (a few eager passes
        and the captures per pass kind and key bucket). One generation runs at a time, so one cache serves them
        all; a longer request replaces it."""
        if not getattr(self.step_graph, "keeps_cache", False):
            return ModelCache(self.config, max_len, self.dtype, self.device)
        kept = self._kept_cache
        if kept is None or kept.max_len < max_len:
            size = max(max_len, min(-(-max_len // 256) * 256, self.config.max_position_embeddings))
            # the old cache and the graphs recorded for it go before the longer one is allocated
            self._kept_cache = None
            self.step_graph.forget()  # type: ignore[union-attr]
            kept = self._kept_cache = ModelCache(self.config, size, self.dtype, self.device)
        else:
            kept.reset()
        return kept

    def hands_out(self, cache: ModelCache) -> bool:
        """Whether a request may go on in ``cache`` (engine.decode.prompt_cache.PromptCache): any cache, unless the model keeps
        one cache for its CUDA graphs and that is another one now (a longer request replaced it)."""
        return not getattr(self.step_graph, "keeps_cache", False) or cache is self._kept_cache

    def segment_tokens(self, block_size: int | None) -> int:
        """Length of the segments a cache-writing pass longer than ``max_pass_tokens`` is split into: whole blocks
        in block mode, whole GDN chunks in causal mode (every segment then starts where the math needs it to)."""
        unit = block_size or GDN_CHUNK
        return max(unit, self.max_pass_tokens // unit * unit)

    def moe_layers(self) -> list[SparseMoe]:
        return [layer.mlp for layer in self.layers]

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        start_pos: int = 0,
        cache: ModelCache | None = None,
        block_size: int | None = None,
        write_cache: bool = True,
        last_only: bool = False,
        *,
        prefill: bool = False,
        causal_inside_block: bool = False,
    ) -> Tensor:
        """Run ``ids`` [T] at absolute positions start_pos..start_pos+T-1 after the cached prefix.

        block_size None: causal (AR); T == 1 with a cache uses the recurrent GDN step.
        block_size B: block mode (start_pos % B == 0; only the last block may be partial): bidirectional attention
          inside each block, causal across blocks, Clover GDN extras and (if enabled) the MoE block coreset active.
        write_cache: append the tokens to the cache (KV, conv and recurrent state); False leaves it bit-identical.
        last_only: return only the last position's logits.
        prefill (keyword): this pass is the prompt prefill; the coreset applies only if config.coreset_in_prefill.
        causal_inside_block (keyword, for tests): causal attention inside blocks in block mode.
        Returns fp32 logits [T, V] (or [1, V]).
        """
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        t = ids.shape[0]
        if cache is not None:
            if start_pos != cache.length:
                raise ValueError(f"start_pos {start_pos} != cache.length {cache.length}")
            if start_pos + t > cache.max_len:
                raise PromptError(f"context full: {start_pos} + {t} tokens exceed the cache size {cache.max_len}")
        if block_size is not None and (block_size <= 0 or start_pos % block_size):
            raise ValueError(f"block mode needs start_pos ({start_pos}) to be a multiple of block_size ({block_size})")
        if cache is not None and write_cache and t > self.max_pass_tokens:
            # A long prefill runs as consecutive whole-block segments through the cache: the same math (blocks only
            # look back), with bounded attention-mask and activation memory. (engine.decode.generate runs a long prompt's
            # segments itself, to report progress and honour a cancel between them.)
            seg = self.segment_tokens(block_size)
            outs = [
                self._forward_pass(ids[s : s + seg], start_pos + s, cache, block_size, True, last_only, prefill,
                                   causal_inside_block)
                for s in range(0, t, seg)
            ]
            return outs[-1] if last_only else torch.cat(outs)
        placement = getattr(self, "_offload_runtime", None)  # engine.placement.offload's runtime: its device tables
        if placement is not None:
            placement.before_pass(t, block_size)
        run = self._forward_pass
        if self.step_graph is not None and cache is not None and self.is_hot_pass(t, block_size, write_cache):
            run = self.step_graph
        elif (self.pass_graph is not None and cache is not None and block_size == t and not prefill
              and not causal_inside_block):
            run = self.pass_graph
        return run(ids, start_pos, cache, block_size, write_cache, last_only, prefill, causal_inside_block)

    @staticmethod
    def is_hot_pass(t: int, block_size: int | None, write_cache: bool) -> bool:
        """Whether a cached pass is an AR step (one token, causal, written to the cache): the pass a decode loop
        repeats hundreds of times, which :func:`engine.kernels.fastpath.compile_layers` compiles whole. (A denoising pass
        compiled whole measured no faster than layer by layer, 19.5 against 18-20 passes/s on the deep-narrow
        shape, and its variants took minutes to compile: its 32 rows are work, not overhead.)"""
        return t == 1 and block_size is None and write_cache

    def _forward_pass(
        self,
        ids: Tensor,
        start_pos: int,
        cache: ModelCache | None,
        block_size: int | None,
        write_cache: bool,
        last_only: bool,
        prefill: bool,
        causal_inside_block: bool,
    ) -> Tensor:
        t = ids.shape[0]
        cfg = self.config
        device = self.device
        ids = ids.to(device)
        positions = torch.arange(start_pos, start_pos + t, device=device)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        mask, causal, rows = self._attention_mask(
            positions, start_pos, t, cache is not None, block_size, causal_inside_block
        )
        coreset = (
            block_size is not None and cfg.moe_block_coreset_enabled and (not prefill or cfg.coreset_in_prefill)
        )
        p = _Pass(start_pos, t, block_size, cache, write_cache, cos, sin, mask, causal, coreset, attn_rows=rows,
                  by_rows=bool(rows))
        h = self.embed(ids)  # [T, D]
        for i, layer in enumerate(self.layers):
            st = cache.layer(i) if cache is not None else None
            if p.by_rows and layer.is_full_attention:
                # attention by row groups (host ints that a compiled layer would recompile for): the layer runs
                # eagerly, with its hooks (nn.Module._call_impl bypasses only torch.compile)
                h = layer._call_impl(h, p, st)
            else:
                h = layer(h, p, st)
        if last_only:
            h = h[-1:]
        logits = self.head(h)  # [T, V]
        if cache is not None and write_cache:
            cache.length = start_pos + t
        return logits

    def head(self, h: Tensor) -> Tensor:
        """The final norm and the LM head: h [T, D] -> fp32 logits [T, V] (``engine.kernels.fastpath`` compiles it with the
        layers when the head is a plain linear)."""
        return self.lm_head(self.norm(h)).float()

    def static_step(self, h: Tensor, pos: Tensor, cache: ModelCache, kv_len: int) -> Tensor:
        """One AR step with nothing that depends on a host int, for capture as a CUDA graph (engine.kernels.step_graphs):
        ``h`` [1, D] the embedded token (in the model dtype, on the device), ``pos`` [1] long its position on the
        device, ``kv_len`` a fixed key length > pos (the full-attention layers read that many keys and mask the
        ones past ``pos``). Writes the cache like an AR step but leaves ``cache.length`` to the caller. Returns fp32
        logits [1, V]; the same as ``forward(ids, pos, cache, last_only=True)`` up to summation order."""
        p = self.static_pass(pos, cache, kv_len)
        return self.head(self.static_layers(h, p, cache, 0, len(self.layers)))

    def static_pass(
        self, pos: Tensor, cache: ModelCache, kv_len: int, t: int = 1, block_size: int | None = None,
        write_cache: bool = True,
    ) -> _Pass:
        """The pass of :meth:`static_step`, or of a whole block (``t == block_size``: a denoising pass with
        ``write_cache=False``, a commit pass with True), with nothing that depends on a host int: ``pos`` [1] long is
        the first position on the device, the rotary angles and the key mask [T, kv_len] are computed from it there.
        A block starts at a multiple of ``block_size`` (as :meth:`forward` requires), so the Gated DeltaNet chunk
        offset is 0 whatever the position."""
        if block_size is not None and t != block_size:
            raise ValueError(f"a static block pass runs one whole block ({block_size} tokens), not {t}")
        cfg = self.config
        positions = pos + torch.arange(t, device=pos.device)  # [T]
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        keys = torch.arange(kv_len, device=pos.device)  # [S]
        if block_size is None:
            mask = keys[None, :] <= positions[:, None]  # [T, S]
        else:  # the prefix and the whole block
            mask = (keys[None, :] // block_size) <= (positions[:, None] // block_size)  # [T, S]
        coreset = block_size is not None and cfg.moe_block_coreset_enabled
        return _Pass(0, t, block_size, cache, write_cache, cos, sin, mask, False, coreset, pos=positions,
                     kv_len=kv_len)

    def static_layers(self, h: Tensor, p: _Pass, cache: ModelCache, lo: int, hi: int) -> Tensor:
        """Layers ``lo``..``hi - 1`` of a static pass (``p`` from :meth:`static_pass`): h [T, D] -> [T, D]."""
        for i in range(lo, hi):
            h = self.layers[i](h, p, cache.layer(i))
        return h

    def embed(self, ids: Tensor) -> Tensor:
        """ids [T] -> hidden states [T, D] on the layers' device, in the model dtype. A host-side table (kept in its
        stored dtype) sends only T rows over."""
        table = self.embed_tokens.weight
        return self.embed_tokens(ids.to(table.device)).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def _attention_rows(
        start_pos: int, t: int, first_key: int, block_size: int | None
    ) -> tuple[tuple[int, int, int], ...]:
        """The query row groups of a masked pass (see :func:`_attention_by_rows`): blocks in block mode, groups of
        :data:`ATTENTION_ROWS` in a causal one; (first row, end row, end of the keys any row of the group sees) each,
        keys counted from ``first_key``, the first key the pass reads."""
        size = block_size or ATTENTION_ROWS
        groups = []
        for r0 in range(0, t, size):
            r1 = min(t, r0 + size)
            # block mode: the block's own end (start_pos is a multiple of the block size); causal: the last row's
            # own position; never past the pass's last key
            last = start_pos + (r0 + size if block_size else r1)
            groups.append((r0, r1, min(last, start_pos + t) - first_key))
        return tuple(groups)

    @staticmethod
    def _attention_mask(
        positions: Tensor, start_pos: int, t: int, has_cache: bool, block_size: int | None, causal_inside: bool
    ) -> tuple[Tensor | None, bool, tuple[tuple[int, int, int], ...]]:
        """Boolean [T, S] mask (True = attend) or None, whether SDPA's is_causal covers it, and the query row groups
        attention runs in (:meth:`_attention_rows`; empty: one call). A block-causal pass over several blocks needs
        no mask: each block of rows reads exactly the keys up to its end."""
        first_key = 0 if has_cache else start_pos
        if block_size is None or causal_inside:
            if t == 1:
                return None, False, ()
            if first_key == start_pos:
                return None, True, ()  # keys == queries: plain causal
        elif (start_pos % block_size) + t <= block_size:
            return None, False, ()  # one block: every query sees the whole prefix and the whole block
        rows = CloverModel._attention_rows(start_pos, t, first_key, block_size)
        if block_size is not None and not causal_inside:
            return None, False, rows
        keys = torch.arange(first_key, start_pos + t, device=positions.device)  # [S]
        if block_size is None:
            return keys[None, :] <= positions[:, None], False, rows
        allowed = (keys[None, :] // block_size) <= (positions[:, None] // block_size)  # block-causal
        allowed &= keys[None, :] <= positions[:, None]  # and causal inside the blocks (causal_inside)
        return allowed, False, rows
