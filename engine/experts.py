"""Expert seam: the routed experts of one MoE layer, behind one small interface.

The MoE layer (``engine.model.SparseMoe``) computes the router, the optional block coreset and top-k, then calls
``bank.prepare(expert_ids)`` with the distinct experts this forward uses and ``bank(x, topk_idx, topk_w)``.
Quantized and streamed banks (``engine/offload.py``, ``engine/quant.py``) replace ``layer.mlp.experts`` with the
same interface.

Letters: T tokens, K experts per token (top-k), E experts, D hidden size, I expert intermediate size,
N = T*K routed (token, slot) pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ExpertBank(nn.Module):
    """Base class. Subclasses implement :meth:`forward`; :meth:`prepare` is an optional hook."""

    num_experts: int

    def prepare(self, expert_ids: Tensor) -> None:
        """Called by the MoE layer right before :meth:`forward` with the sorted distinct expert ids (a CPU
        LongTensor) this forward will touch, so a streaming bank can fetch them. No-op by default."""

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:  # pragma: no cover - interface
        """x [T, D], topk_idx [T, K] (long), topk_w [T, K] (float) -> [T, D] in x's dtype."""
        raise NotImplementedError


def group_by_expert(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """Sort the N = T*K (token, slot) pairs by expert.

    Returns ``order`` [N] (flat pair index, sorted by expert, stable), ``token`` [N] (the token of each sorted
    pair), and two Python lists ``experts`` / ``counts`` for the experts actually used (one host sync here:
    the per-expert segment lengths are data-dependent).
    """
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)  # [N]
    order = torch.argsort(flat, stable=True)  # [N]
    token = torch.div(order, k, rounding_mode="floor")  # [N]
    counts_all = torch.bincount(flat, minlength=num_experts).cpu()  # [E] host copy: the one sync
    used = counts_all.nonzero().flatten()  # only the experts in use, no loop over all E
    return order, token, used.tolist(), counts_all[used].tolist()


class DenseExpertBank(ExpertBank):
    """All experts resident as two fused tensors, names as in the checkpoint.

    ``gate_up_proj`` [E, 2I, D]: rows 0..I-1 are the gate projection, rows I..2I-1 the up projection.
    ``down_proj`` [E, D, I].
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def expert_forward(self, e: int, xs: Tensor) -> Tensor:
        """One expert's SwiGLU MLP on its tokens: xs [n, D] -> [n, D]."""
        gate, up = F.linear(xs, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[e])  # [n, D]

    def forward(self, x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        order, token, experts, counts = group_by_expert(topk_idx, self.num_experts)
        xs = x[token]  # [N, D] token rows in expert order
        ys = torch.empty_like(xs)  # [N, D]
        start = 0
        for e, n in zip(experts, counts):
            ys[start : start + n] = self.expert_forward(e, xs[start : start + n])
            start += n
        return combine_by_token(ys, order, topk_w)


def combine_by_token(ys: Tensor, order: Tensor, topk_w: Tensor) -> Tensor:
    """Weighted sum of the expert outputs per token, deterministic (no atomics), accumulated in fp32.

    ys [N, D] expert outputs in sorted (expert) order, order [N] from :func:`group_by_expert`, topk_w [T, K].
    Returns [T, D] in ys's dtype.
    """
    t, k = topk_w.shape
    unsorted = torch.empty(ys.shape, dtype=torch.float32, device=ys.device)  # [N, D] back in (token, slot) order
    unsorted[order] = ys.to(torch.float32)
    out = (unsorted.view(t, k, -1) * topk_w.to(torch.float32)[:, :, None]).sum(1)  # [T, D]
    return out.to(ys.dtype)
