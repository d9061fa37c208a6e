"""A sequence's state and one forward pass's facts: :class:`ModelCache` (the full-attention layers' keys and
values, the Gated DeltaNet conv and recurrent states) and :class:`PassContext` (what every layer needs to know about the
pass it runs in: positions, mode, mask, cache). Shape letters: :mod:`engine.model.clover`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from clover_desk.engine.model.config import CloverConfig


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


@dataclass
class PassContext:
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
