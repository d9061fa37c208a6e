"""Gated full attention with partial RoPE, q/k norms and GQA (:class:`Attention`), the rotary helpers, and the
attention by groups of query rows that bounds a long pass's mask and activation memory (:func:`attention_by_rows`).
Shape letters: :mod:`engine.model.clover`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.cache import PassContext
from clover_desk.engine.model.config import CloverConfig
from clover_desk.engine.model.layers import Linear, RMSNorm


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
    if _one_token_rope(x, cos, sin):
        return cpu_quant.rope(x, cos, sin)
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rd]
    xr = xr * c + rotate_half(xr) * s
    return torch.cat((xr.to(x.dtype), xp), dim=-1)


def _one_token_rope(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether :func:`apply_partial_rope` is one C call (``cpu_quant.rope``, the same bits as the torch ops): one
    position, eager, on the CPU with its kernels on, all float32 and contiguous."""
    return (cos.shape[0] == 1 and x.device.type == "cpu" and not torch.compiler.is_compiling() and cpu_quant.usable()
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (x, cos, sin)))


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

    def forward(self, x: Tensor, p: PassContext, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's (key, value) cache buffers [Hkv, max_len, hd] (None without a cache)."""
        t, hd = x.shape[0], self.head_dim
        blocks = cpu_quant.blocks_of(x, self.q_proj, self.k_proj)
        # GGUF blocks of one type on the CPU: q and k in one C call, x quantized once (the same bits as two)
        qg, k = cpu_quant.qmatmul_many(x, *blocks) if blocks else (self.q_proj(x), self.k_proj(x))
        qg = qg.view(t, self.num_heads, 2 * hd)  # [T, Hq, 2hd]
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, self.num_heads * hd)  # [T, Hq, hd], [T, Hq*hd]
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, hd))  # [T, Hkv, hd]
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
            o = attention_by_rows(q, keys, values, p, g)
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
def attention_by_rows(q: Tensor, keys: Tensor, values: Tensor, p: PassContext, g: int) -> Tensor:
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
