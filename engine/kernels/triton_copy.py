"""The device pool's kernels (``engine.placement.device_pool``) in Triton, two launches per streamed layer and AR step or
block pass, whose grids do not depend on the routing (so a CUDA graph records them once):

- ``place``: the slot tables' look-up, victim choice and writes (``DeviceSlotTables._place``: ~45 tensor ops) in
  one program: k entries and the S + 1 stamps in registers, the k oldest found by k arg-min passes;
- ``place_set``: the same for a block pass's whole set of experts (a presence mask over E, the block's pins): the S
  slots packed as (class, stamp, slot) and sorted once, each missing expert's victim read at its rank;
- ``copy_rows``: the expert rows that missed, copied from the host rows mapped into the device's address space
  into their pool slots.

``copy_rows`` runs one program per (expert of the fetch, chunk of ``BLOCK`` words); a program whose expert was
present returns at once, so only the missing rows cross PCIe. Rows are copied as 4-byte words when their size
allows (fewer, wider loads over the link), else byte by byte.

Tested on the CPU with ``TRITON_INTERPRET=1`` against the tensor ops (``tests/engine/test_device_pool.py``: the same
tables, counters and slots over random steps); not measured on a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

# The slot tables' stamp encoding (``engine.placement.device_pool``'s tensor-ops path reads the same constants):
BIG = 1 << 62  # the stamp of a slot that cannot be a victim (the scratch cell; this fetch's own slots)
STAMP_STRIDE = 1 << 10  # stamps: tick * STAMP_STRIDE + rank within the fetch (k < STAMP_STRIDE)


class SlotTables(Protocol):
    """What the programs read and write of ``engine.placement.device_pool.DeviceSlotTables`` (its tensors)."""

    counts: Tensor
    fresh: Tensor
    gate: Tensor
    key_of: Tensor
    order_scratch: Tensor
    pinned: Tensor
    seen: Tensor
    slot_of: Tensor
    stamp: Tensor
    tick: Tensor

BLOCK = 4096  # words per program: 16 KiB of a row at 4-byte words


def copy_rows(src: Tensor, dst: Tensor, src_rows: Tensor, dst_rows: Tensor, need: Tensor) -> None:
    """``dst[dst_rows[j]] = src[src_rows[j]]`` for every ``j`` with ``need[j]``: ``src`` [E, R] / ``dst`` [S, R]
    uint8 (rows contiguous), the three index tensors [k]."""
    from clover_desk.engine.kernels.triton_copy_kernels import copy_rows_kernel

    if (src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != torch.uint8
            or dst.dtype != torch.uint8):
        raise ValueError(f"copy_rows: rows [E, R] and slots [S, R] of uint8, got {tuple(src.shape)} {src.dtype} and "
                         f"{tuple(dst.shape)} {dst.dtype}")
    width = 4 if src.shape[1] % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0 else 1
    words = src.shape[1] // width
    if width == 4:
        src, dst = src.view(torch.int32), dst.view(torch.int32)
    k = src_rows.shape[0]
    grid = (k, -(-words // BLOCK))
    flags = need.view(torch.int8) if need.dtype == torch.bool else need.to(torch.int8)  # (a bool's view: no kernel)
    copy_rows_kernel[grid](src, dst, src_rows.to(torch.int64), dst_rows.to(torch.int64), flags, words, BLOCK)


def place(tables: SlotTables, lp: int, idx: Tensor, touch: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`engine.placement.device_pool.DeviceSlotTables._place` as one Triton program (``place_kernel``): the same tables,
    counters and result as its tensor ops, in one launch instead of ~45."""
    from clover_desk.engine.kernels.triton_copy_kernels import place_kernel

    k = idx.shape[0]
    block_k = max(2, 1 << (k - 1).bit_length())
    block_s = 1 << tables.S.bit_length()  # > S: the scratch cell too
    out = torch.empty(2, k, dtype=torch.long, device=idx.device)  # [ascending experts; their slots]
    need = torch.empty(k, dtype=torch.int8, device=idx.device)
    place_kernel[(1,)](
        idx.to(torch.long), tables.slot_of, tables.key_of, tables.stamp, tables.fresh.view(torch.int8), tables.tick,
        tables.counts, out[0], out[1], need, k, lp * tables.E, tables.S, BIG, touch, lp == 0, STAMP_STRIDE, block_k,
        block_s,
    )
    return out[0], out[1], need.view(torch.bool)  # (the kernel stores 0 / 1: a view, no conversion kernel)


def place_set(tables: SlotTables, lp: int, present: Tensor, fetch: bool) -> tuple[Tensor, Tensor]:
    """:meth:`engine.placement.device_pool.DeviceSlotTables._place_set` as one Triton program (``place_set_kernel``): the
    same tables, counters and result as its ~70 tensor ops, in one launch (a prefetch reads the tables' gate)."""
    from clover_desk.engine.kernels.triton_copy_kernels import place_set_kernel

    E, S = tables.E, tables.S
    block_e = max(16, 1 << (E - 1).bit_length())
    block_s = max(16, 1 << (S - 1).bit_length())  # the S slots (the scratch cell is never a victim)
    slot_bits = block_s.bit_length() - 1
    target = torch.empty(E, dtype=torch.long, device=present.device)
    need = torch.empty(E, dtype=torch.int8, device=present.device)
    order = tables.order_scratch(fetch, block_s)
    place_set_kernel[(1,)](
        present.view(torch.int8), tables.gate.view(torch.int8), tables.slot_of, tables.key_of, tables.stamp,
        tables.fresh.view(torch.int8), tables.pinned.view(torch.int8), tables.seen.view(torch.int8), tables.tick,
        tables.counts, order, target, need, E, lp * E, S, fetch, lp == 0, STAMP_STRIDE, slot_bits, block_e, block_s,
    )
    return target, need.view(torch.bool)
