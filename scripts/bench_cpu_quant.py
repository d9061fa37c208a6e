"""Microbenchmark of engine.kernels.cpu_quant at Clover-35B-A3B's widths, against the current path (dequantize the
GGUF blocks to fp32 with torch ops, then a matmul).

    .venv/bin/python scripts/bench_cpu_quant.py [--threads 2] [--reps 5] [--quick] [--only gguf|own]

Prints, per case: best-of-reps milliseconds of the kernel and of the current path, the weight bytes read per
second (bytes of the blocks the call reads / time) and the speed-up; the machine's read bandwidth for scale; and the
kernels' max error relative to an fp64 reference at K = 2048 for each format. ``--only own``: the engine's own cache
formats (NF4 experts, per-row INT8 head and projections) against that cache's current path (bitsandbytes NF4
dequantize + matmul; ``_weight_int8pack_mm`` for a few INT8 rows, dequantize + matmul for more).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.gguf import quants as gq

HIDDEN, EXPERT_I, VOCAB, EXPERTS, TOP_K = 2048, 512, 248_320, 256, 8


def best_ms(fn: Callable[[], object], reps: int, budget_s: float = 0.5) -> float:
    """Best of ``reps`` runs, or of as many as fit in ``budget_s`` when that is more (short calls on a shared
    machine: the best run is the one no other process interrupted)."""
    fn()
    best = float("inf")
    start = time.perf_counter()
    n = 0
    while n < reps or (time.perf_counter() - start < budget_s and n < 1000):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best * 1e3


def weights(qtype: int, n: int, k: int, seed: int = 0) -> Tensor:
    """n rows of real blocks: 2048 quantized random rows repeated (distinct memory, same values)."""
    base_rows = min(n, 2048)
    g = torch.Generator().manual_seed(seed)
    base = gq.quantize(torch.randn(base_rows, k, generator=g), qtype)  # [base_rows, row_bytes]
    reps = -(-n // base_rows)
    return base.repeat(reps, 1)[:n].contiguous()


def current_qmatmul(x: Tensor, w: Tensor, qtype: int) -> Tensor:
    return x @ gq.dequantize(w, qtype, x.shape[1]).T


def current_moe(x: Tensor, banks: tuple[Tensor, Tensor, Tensor], qtypes: tuple[int, int, int], idx: Tensor,
                wts: Tensor) -> Tensor:
    """The dequantizing path: each used expert's three matrices to fp32, then its tokens through the MLP."""
    gate, up, down = banks
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        xs = x[tok]
        g = xs @ gq.dequantize(gate[e], qtypes[0], HIDDEN).T
        u = xs @ gq.dequantize(up[e], qtypes[1], HIDDEN).T
        y = (torch.nn.functional.silu(g) * u) @ gq.dequantize(down[e], qtypes[2], EXPERT_I).T
        out.index_add_(0, tok, y * wts[tok, slot][:, None])
    return out


def row(name: str, nbytes: int, ms_new: float, ms_old: float | None, note: str = "") -> None:
    gbs = nbytes / ms_new / 1e6
    old = f"{ms_old:10.2f}" if ms_old is not None else f"{'-':>10}"
    ratio = f"{ms_old / ms_new:8.1f}x" if ms_old is not None else f"{'-':>9}"
    print(f"{name:<44} {nbytes / 1e6:9.1f} {ms_new:9.3f} {gbs:8.2f} {old} {ratio}  {note}")


def bandwidth(reps: int) -> None:
    big = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8)
    ms = best_ms(lambda: big.sum(), 1, 0.0)
    print(f"read bandwidth: torch uint8 .sum() over 1 GiB: {big.numel() / ms / 1e6:6.2f} GB/s "
          f"({ms:.0f} ms; torch sums uint8 slowly, so also:)")
    ms = best_ms(lambda: big.view(torch.int64).sum(), reps)
    print(f"read bandwidth: the same bytes as int64 .sum():    {big.numel() / ms / 1e6:6.2f} GB/s ({ms:.0f} ms)")


def accuracy() -> None:
    print("\nmax |y - exact| / max |exact| vs fp64 (x @ dequantize(w).T, unrounded x), K = 2048, N = 256, T = 8:")
    import gguf
    import numpy as np

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, HIDDEN, generator=g)
    for qt in (cq.Q4_K, cq.Q6_K, cq.Q8_0, cq.Q5_K, cq.Q4_0):
        wf = torch.randn(256, HIDDEN, generator=g)
        if qt in (cq.Q8_0, cq.Q4_0):
            w = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(wf.numpy(), gguf.GGMLQuantizationType(qt))))
        else:
            w = gq.quantize(wf, qt)
        exact = x.double() @ gq.dequantize(w, qt, HIDDEN).double().T
        y = cq.qmatmul(x, w, qt).double()
        err = (y - exact).abs()
        print(f"  {cq.TYPE_NAMES[qt]:<5} max rel (of max |exact|) {float(err.max() / exact.abs().max()):.2e}   "
              f"median elementwise rel {float((err / exact.abs()).median()):.2e}")


def own_linear_old(x: Tensor, layer: wq.QuantLinear) -> Tensor:
    """The own cache's QuantLinear path before the kernels (cpu_quant switched off for the call)."""
    before = cq.set_enabled(False)
    try:
        return layer(x)
    finally:
        cq.set_enabled(before)


def own_layer(fmt: str, n: int, k: int, seed: int) -> wq.QuantLinear:
    """A QuantLinear [n, k] of random weights; big ones repeat 2048 quantized rows (distinct memory)."""
    g = torch.Generator().manual_seed(seed)
    base = min(n, 2048)
    small = wq.QuantLinear(k, base, fmt)
    small.set_weight(torch.randn(base, k, generator=g) * 0.02)
    layer = wq.QuantLinear(k, n, fmt)
    reps = -(-n // base)
    if fmt == "nf4":
        layer.codes = small.codes.view(base, -1).repeat(reps, 1)[:n].reshape(-1).contiguous()
        layer.scales = small.scales.view(base, -1).repeat(reps, 1)[:n].reshape(-1).contiguous()
    else:
        layer.codes = small.codes.repeat(reps, 1)[:n].contiguous()
        layer.scales = small.scales.repeat(reps)[:n].contiguous()
    return layer


def own_head(args: argparse.Namespace) -> None:
    """The INT8 output head (508 MB): its own function, so it is freed before the next cases."""
    reps = args.reps
    head = own_layer("int8", VOCAB, HIDDEN, 1)
    nbytes = head.codes.numel() + head.scales.numel() * 4
    for t in (1, 32):
        x = torch.randn(t, HIDDEN)
        ms = best_ms(lambda: head(x), reps, 0.0)
        if args.quick:
            old = None
        elif t <= wq.INT8_GEMV_MAX_ROWS:
            old = best_ms(lambda: own_linear_old(x, head), reps, 0.0)
        else:
            part = own_layer("int8", VOCAB // 8, HIDDEN, 1)
            old = best_ms(lambda: own_linear_old(x, part), 1, 0.0) * 8
        row(f"head {VOCAB}x{HIDDEN} INT8 T={t}", nbytes, ms, old)


def own_cache(args: argparse.Namespace) -> None:
    reps = args.reps
    print("\nthe engine's own cache (NF4 / INT8 codes + fp32 scales):")
    print(f"{'case':<44} {'MB read':>9} {'ms':>9} {'GB/s':>8} {'old ms':>10} {'speed-up':>9}")
    own_head(args)
    cases = (("expert gate/up 1024x2048 NF4", "nf4", 2 * EXPERT_I, HIDDEN),
             ("expert down 2048x512 NF4", "nf4", HIDDEN, EXPERT_I),
             ("attention-ish 2048x4096 INT8", "int8", 2048, 4096),
             ("attention-ish 2048x4096 NF4", "nf4", 2048, 4096))
    for name, fmt, n, kk in cases:
        layer = own_layer(fmt, n, kk, 2)
        nbytes = layer.codes.numel() + layer.scales.numel() * 4
        for t in (1, 32):
            x = torch.randn(t, kk)
            ms = best_ms(lambda: layer(x), reps * 4)
            old = best_ms(lambda: own_linear_old(x, layer), reps)
            row(f"{name} T={t}", nbytes, ms, old, "(hot in cache)")
    g = torch.Generator().manual_seed(0)
    layout = wq.ExpertLayout.build(EXPERTS, HIDDEN, EXPERT_I, "nf4", 64)
    one = wq.QuantExpertBank.from_dense(torch.randn(1, 2 * EXPERT_I, HIDDEN, generator=g) * 0.02,
                                        torch.randn(1, HIDDEN, EXPERT_I, generator=g) * 0.02)
    bank = wq.QuantExpertBank(layout, packed=one.packed.repeat(EXPERTS, 1))  # 256 rows, distinct memory
    for t in (1, 32):
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, TOP_K, generator=g), -1)
        x = torch.randn(t, HIDDEN, generator=g)
        used = idx.unique().numel()
        ms = best_ms(lambda: bank(x, idx, wts), reps * 2)

        def old_path() -> Tensor:
            before = cq.set_enabled(False)
            try:
                return bank(x, idx, wts)
            finally:
                cq.set_enabled(before)

        old = best_ms(old_path, max(1, reps // 2), 0.0)
        row(f"moe E={EXPERTS} k={TOP_K} T={t} NF4 ({used} experts used)", used * layout.nbytes, ms, old)
    print("\nmax |y - exact| / max |exact| vs fp64 (x @ dequantize(w).T, unrounded x), K = 2048, N = 256, T = 8:")
    x = torch.randn(8, HIDDEN, generator=g)
    for fmt in ("nf4", "int8"):
        layer = own_layer(fmt, 256, HIDDEN, 3)
        exact = x.double() @ layer.dequantized(torch.float32).double().T
        err = (layer(x).double() - exact).abs()
        print(f"  {fmt.upper():<5} max rel (of max |exact|) {float(err.max() / exact.abs().max()):.2e}   "
              f"median elementwise rel {float((err / exact.abs()).median()):.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="skip the slow current-path timings of the big cases")
    ap.add_argument("--only", choices=("gguf", "own"), help="only the GGUF formats, or only the own cache's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = cq.kernels()
    if not k.ok:
        raise SystemExit(f"cpu_quant unavailable: {k.reason}")
    print(f"cpu_quant: {k.path.name} simd={k.isa} flags={' '.join(k.flags)} "
          f"threads={torch.get_num_threads()}")
    print("load average at start (other processes share these cores): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    bandwidth(args.reps)
    if args.only != "gguf":
        own_cache(args)
    if args.only == "own":
        print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        return
    print(f"\n{'case':<44} {'MB read':>9} {'ms':>9} {'GB/s':>8} {'old ms':>10} {'speed-up':>9}")
    reps = args.reps

    head = weights(cq.Q6_K, VOCAB, HIDDEN, seed=1)
    eighth = head[: VOCAB // 8]
    for t in (1, 32):
        x = torch.randn(t, HIDDEN)
        ms = best_ms(lambda: cq.qmatmul(x, head, cq.Q6_K), reps, 0.0)
        old = None if args.quick else best_ms(lambda: current_qmatmul(x, eighth, cq.Q6_K), 1, 0.0) * 8
        row(f"head {VOCAB}x{HIDDEN} Q6_K T={t}", head.numel(), ms, old, "(old: 1/8 of the rows, x8)")
    rows = torch.randint(0, VOCAB, (4096,))
    x = torch.randn(1, HIDDEN)
    ms = best_ms(lambda: cq.qmatmul_rows(x, head, cq.Q6_K, rows), reps)
    row("head 4096 selected rows Q6_K T=1", 4096 * head.shape[1], ms, None)
    head = eighth = torch.empty(0, dtype=torch.uint8)  # 417 MB back before the next cases

    cases = (("expert gate/up 512x2048 Q4_K", cq.Q4_K, EXPERT_I, HIDDEN),
             ("expert down 2048x512 Q4_K", cq.Q4_K, HIDDEN, EXPERT_I),
             ("attention-ish 2048x4096 Q4_K", cq.Q4_K, 2048, 4096),
             ("attention-ish 2048x4096 Q6_K", cq.Q6_K, 2048, 4096),
             ("expert gate/up 512x2048 Q8_0", cq.Q8_0, EXPERT_I, HIDDEN),
             ("expert gate/up 512x2048 Q5_K", cq.Q5_K, EXPERT_I, HIDDEN),
             ("expert gate/up 512x2048 Q4_0", cq.Q4_0, EXPERT_I, HIDDEN))
    for name, qt, n, kk in cases:
        if qt in (cq.Q8_0, cq.Q4_0):
            import gguf
            import numpy as np

            wf = torch.randn(n, kk)
            w = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(wf.numpy(), gguf.GGMLQuantizationType(qt))))
        else:
            w = weights(qt, n, kk)
        for t in (1, 32):
            x = torch.randn(t, kk)
            ms = best_ms(lambda: cq.qmatmul(x, w, qt), reps * 4)
            old = best_ms(lambda: current_qmatmul(x, w, qt), reps)
            row(f"{name} T={t}", w.numel(), ms, old, "(hot in cache)")

    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q4_K)
    gate = weights(cq.Q4_K, EXPERTS * EXPERT_I, HIDDEN, seed=2).reshape(EXPERTS, EXPERT_I, -1)
    up = weights(cq.Q4_K, EXPERTS * EXPERT_I, HIDDEN, seed=3).reshape(EXPERTS, EXPERT_I, -1)
    down = weights(cq.Q4_K, EXPERTS * HIDDEN, EXPERT_I, seed=4).reshape(EXPERTS, HIDDEN, -1)
    per_expert = gate[0].numel() + up[0].numel() + down[0].numel()
    g = torch.Generator().manual_seed(0)
    for t in (1, 32):
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, TOP_K, generator=g), -1)
        x = torch.randn(t, HIDDEN, generator=g)
        used = idx.unique().numel()
        ms = best_ms(lambda: cq.moe(x, gate, up, down, qtypes, idx, wts), reps * 2)
        old = best_ms(lambda: current_moe(x, (gate, up, down), qtypes, idx, wts), max(1, reps // 2), 0.0)
        row(f"moe E={EXPERTS} k={TOP_K} T={t} Q4_K ({used} experts used)", used * per_expert, ms, old)
    accuracy()
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
