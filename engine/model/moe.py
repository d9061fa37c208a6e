"""The mixture of experts: the router's block coreset and top-k (:func:`block_coreset_topk`), the sparse MoE
layer with its shared expert (:class:`SparseMoe`, experts in an :mod:`engine.model.experts` bank) and the dense
:class:`MLP`. Shape letters: :mod:`engine.model.clover`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.cache import PassContext
from clover_desk.engine.model.config import CloverConfig
from clover_desk.engine.model.experts import DenseExpertBank, ExpertBank
from clover_desk.engine.model.layers import Linear


class MLP(nn.Module):
    """SwiGLU MLP (the shared expert)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        blocks = cpu_quant.blocks_of(x, self.gate_proj, self.up_proj)
        # GGUF blocks of one type on the CPU: gate and up in one C call, x quantized once (the same bits as two)
        gate, up = cpu_quant.qmatmul_many(x, *blocks) if blocks else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


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

    def route(self, x: Tensor, p: PassContext) -> tuple[Tensor, Tensor]:
        """x [T, D] -> (weights [T, k] fp32, ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] fp32
        if p.coreset and p.block_size is not None:
            cfg = self.config
            return block_coreset_topk(probs, p.block_size, self.top_k, cfg.moe_block_coreset_top_p, cfg.coreset_restrict)
        w, idx = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.config.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w, idx

    def forward(self, x: Tensor, p: PassContext) -> Tensor:
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
