"""The Triton kernel of :mod:`engine.kernels.triton_copy` (imported only when Triton is; see that module)."""

import triton
import triton.language as tl


@triton.jit
def copy_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, need_ptr, words, BLOCK: tl.constexpr):
    """Chunk ``program_id(1)`` of row ``src_rows[j]`` into row ``dst_rows[j]`` (``j = program_id(0)``) if
    ``need[j]``."""
    j = tl.program_id(0)
    if tl.load(need_ptr + j) != 0:
        s = tl.load(src_rows_ptr + j)
        d = tl.load(dst_rows_ptr + j)
        w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = w < words
        tl.store(dst_ptr + d * words + w, tl.load(src_ptr + s * words + w, mask=ok), mask=ok)


@triton.jit
def _count(counts_ptr, hit, need, evict, was_fresh, FETCH: tl.constexpr, FIRST: tl.constexpr):
    """The counters both placing programs add to (engine.placement.device_pool.COUNTS): a fetch's hits, misses and hits on
    prefetched slots (and its first layer's step), a prefetch's copies; both, the prefetched slots evicted unused
    and all evictions."""
    n_need = tl.sum(need.to(tl.int64), axis=0)
    if FETCH:
        tl.store(counts_ptr + 0, tl.load(counts_ptr + 0) + tl.sum(hit.to(tl.int64), axis=0))
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + n_need)
        tl.store(counts_ptr + 3, tl.load(counts_ptr + 3) + tl.sum((hit & was_fresh).to(tl.int64), axis=0))
        if FIRST:
            tl.store(counts_ptr + 6, tl.load(counts_ptr + 6) + 1)
    else:
        tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + n_need)
    tl.store(counts_ptr + 4, tl.load(counts_ptr + 4) + tl.sum((evict & was_fresh).to(tl.int64), axis=0))
    tl.store(counts_ptr + 5, tl.load(counts_ptr + 5) + tl.sum(evict.to(tl.int64), axis=0))


@triton.jit
def place_kernel(
    idx_ptr, slot_of_ptr, key_of_ptr, stamp_ptr, fresh_ptr, tick_ptr, counts_ptr, sorted_ptr, target_ptr, need_ptr,
    k, base, S, BIG, TOUCH: tl.constexpr, FIRST: tl.constexpr, STRIDE: tl.constexpr, K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """engine.placement.device_pool.DeviceSlotTables._place in one program: look up the k experts ``idx`` of the layer whose
    keys start at ``base``, choose the absent ones' slots (the smallest stamps, the hits' slots excluded), write the
    tables and counters, and store the experts, their slots and which were absent in ascending expert order
    (``sorted``, ``target``, ``need``). Ascending order without a sort: an entry's place is how many sort before it."""
    j = tl.arange(0, K)
    jm = j < k
    e = tl.load(idx_ptr + j, mask=jm, other=0)  # [K] int64
    key = e + base
    s = tl.load(slot_of_ptr + key, mask=jm, other=-1)
    hit = (s >= 0) & jm
    need = (s < 0) & jm
    before = (e[None, :] < e[:, None]) & jm[None, :]  # [K, K]: entry j sorts before entry i
    rank = tl.sum(before.to(tl.int32), axis=1)  # [K] place in ascending order
    miss_rank = tl.sum((before & need[None, :]).to(tl.int32), axis=1)  # absent entries before it
    offs = tl.arange(0, BLOCK_S)
    st = tl.load(stamp_ptr + offs, mask=offs <= S, other=BIG)  # [BLOCK_S] (the scratch cell S holds BIG)
    for r in tl.static_range(K):  # a hit's slot is not a victim (one pass per entry: no [K, S] tile in registers)
        s_r = tl.max(tl.where((j == r) & hit, s, -1), axis=0)
        st = tl.where(offs == s_r, BIG, st)
    victims = tl.zeros([K], dtype=tl.int64)
    for r in tl.static_range(K):  # the K oldest, oldest first (stamps are unique)
        v = tl.argmin(st, axis=0).to(tl.int64)
        victims = tl.where(j == r, v, victims)
        st = tl.where(offs == v, BIG, st)
    pick = tl.sum(tl.where(j[None, :] == miss_rank[:, None], victims[None, :], 0), axis=1)  # victims[miss_rank]
    target = tl.where(need, pick, s)
    old = tl.load(key_of_ptr + target, mask=jm, other=-1)
    evict = need & (old >= 0)
    was_fresh = tl.load(fresh_ptr + target, mask=jm, other=0) != 0
    if TOUCH:
        upd = jm
    else:
        upd = need
    tick = tl.load(tick_ptr)
    tl.store(slot_of_ptr + old, tl.full([K], -1, tl.int64), mask=evict)
    tl.store(slot_of_ptr + key, target, mask=upd)
    tl.store(key_of_ptr + target, key, mask=upd)
    tl.store(stamp_ptr + target, tick * STRIDE + rank, mask=upd)
    if TOUCH:
        fresh = tl.zeros([K], dtype=tl.int8)
    else:
        fresh = tl.full([K], 1, tl.int8)
    tl.store(fresh_ptr + target, fresh, mask=upd)
    tl.store(tick_ptr, tick + 1)
    _count(counts_ptr, hit, need, evict, was_fresh, TOUCH, FIRST)
    tl.store(sorted_ptr + rank, e, mask=jm)
    tl.store(target_ptr + rank, target, mask=jm)
    tl.store(need_ptr + rank, need.to(tl.int8), mask=jm)


@triton.jit
def place_set_kernel(
    present_ptr, gate_ptr, slot_of_ptr, key_of_ptr, stamp_ptr, fresh_ptr, pinned_ptr, seen_ptr, tick_ptr, counts_ptr,
    order_ptr, target_ptr, need_ptr, E, base, S, FETCH: tl.constexpr, FIRST: tl.constexpr, STRIDE: tl.constexpr,
    SLOT_BITS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """engine.placement.device_pool.DeviceSlotTables._place_set in one program: the experts ``present`` [E] of the layer
    whose keys start at ``base`` (a prefetch: only where ``gate`` is set), their victims in the host pool's order
    (free slots lowest first, then unpinned, then, for a fetch only, pinned ones, oldest first), the tables and
    counters written; stores each expert's slot (S: none) and whether it is copied. The victims' order comes from
    one sort of the S slots packed as (class, stamp, slot) in an int64 (stamps below 2^(58 - SLOT_BITS)),
    written to ``order`` and read back at each missing expert's rank."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    pres = (tl.load(present_ptr + e, mask=em, other=0) != 0) & em
    if not FETCH:
        pres = pres & (tl.load(gate_ptr) != 0)
    key = e + base
    s = tl.load(slot_of_ptr + key, mask=em, other=-1)
    hit = pres & (s >= 0)
    need = pres & (s < 0)
    offs = tl.arange(0, BLOCK_S)
    om = offs < S
    st = tl.load(stamp_ptr + offs, mask=om, other=0)
    pin = (tl.load(pinned_ptr + offs, mask=om, other=0) != 0) & om
    ko = tl.load(key_of_ptr + offs, mask=om, other=-1)
    mine = (ko >= base) & (ko < base + E) & om
    used = (tl.load(present_ptr + (ko - base), mask=mine, other=0) != 0) & mine  # a hit's slot: not a victim
    if not FETCH:
        used = used & (tl.load(gate_ptr) != 0)
    cls = tl.where(st < 0, 0, tl.where(pin, 2, 1)).to(tl.int64)  # free, unpinned, pinned
    if FETCH:
        out = used | ~om
    else:
        out = used | ~om | pin  # a prefetch never takes a pinned slot
    cls = tl.where(out, 3, cls)
    val = tl.where(cls == 1, st, tl.where(cls == 2, st, 0)).to(tl.int64)
    packed = (cls << 58) | (val << SLOT_BITS) | offs.to(tl.int64)
    tl.store(order_ptr + offs, tl.sort(packed, 0))
    tl.debug_barrier()  # every load of the tables above happens before the writes below
    rank = tl.cumsum(need.to(tl.int32), 0) - 1
    v = tl.load(order_ptr + rank, mask=need.to(tl.int32) != 0, other=3 << 58)
    need = need & ((v >> 58) < 3)
    target = tl.where(need, v & ((1 << SLOT_BITS) - 1), tl.where(hit, s, S))
    old = tl.load(key_of_ptr + target, mask=need.to(tl.int32) != 0, other=-1)
    evict = need & (old >= 0)
    was_fresh = (tl.load(fresh_ptr + target, mask=pres.to(tl.int32) != 0, other=0) != 0) & pres
    was_pinned = (tl.load(pinned_ptr + target, mask=need.to(tl.int32) != 0, other=0) != 0) & need
    if FETCH:
        upd = hit | need
    else:
        upd = need
    rank_new = (tl.cumsum(upd.to(tl.int32), 0) - 1).to(tl.int64)
    tick = tl.load(tick_ptr)
    tl.store(slot_of_ptr + old, tl.full([BLOCK_E], -1, tl.int64), mask=evict.to(tl.int32) != 0)
    tl.store(slot_of_ptr + key, target, mask=upd.to(tl.int32) != 0)
    tl.store(key_of_ptr + target, key, mask=upd.to(tl.int32) != 0)
    tl.store(stamp_ptr + target, tick * STRIDE + rank_new, mask=upd.to(tl.int32) != 0)
    if FETCH:
        tl.store(fresh_ptr + target, tl.zeros([BLOCK_E], dtype=tl.int8), mask=upd.to(tl.int32) != 0)
        tl.store(pinned_ptr + target, tl.full([BLOCK_E], 1, tl.int8), mask=upd.to(tl.int32) != 0)
        tl.store(seen_ptr + key, tl.full([BLOCK_E], 1, tl.int8), mask=pres.to(tl.int32) != 0)
    else:
        tl.store(fresh_ptr + target, tl.full([BLOCK_E], 1, tl.int8), mask=upd.to(tl.int32) != 0)
    tl.store(tick_ptr, tick + 1)
    _count(counts_ptr, hit, need, evict, was_fresh, FETCH, FIRST)
    if FETCH:  # a block's own pins taken (block_pin_evictions)
        tl.store(counts_ptr + 7, tl.load(counts_ptr + 7) + tl.sum((evict & was_pinned).to(tl.int64), axis=0))
    tl.store(target_ptr + e, target, mask=em)
    tl.store(need_ptr + e, need.to(tl.int8), mask=em)
