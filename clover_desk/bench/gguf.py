"""``clover-desk bench gguf``: GGUF dequantize throughput per ggml type on this CPU, and the bytes one streamed
expert costs per file type at the Clover-35B-A3B shape (gate + up [512, 2048] and down [2048, 512]).

    clover-desk bench gguf [--values N] [--repeat N] [--threads N] [--model FILE.gguf]

``--model`` adds the measured bytes per expert of each MoE layer of a real (or tiny) GGUF file, from its header.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clover_desk.cli import flags

HIDDEN, INTER = 2048, 512  # Clover-35B-A3B expert shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--values", type=flags.integer(2_048, 1 << 28), default=1 << 22, metavar="N",
                        help="values per dequantize call (default 4M; 2048 to 2^28, rounded up to rows of 2048)")
    parser.add_argument("--repeat", type=flags.integer(1, 1_000), default=5, metavar="N", help="timed calls per type (best counts)")
    parser.add_argument("--threads", type=flags.integer(1, 1_024), default=1, metavar="N",
                        help="torch CPU threads (default 1: on a shared 2-core box more threads spin against each other)")
    parser.add_argument("--model", type=Path, default=None, metavar="FILE", help="a .gguf file: its bytes per expert")


def _expert_bytes(gate: int, up: int, down: int) -> int:
    from clover_desk.engine.weights.gguf import quants as gq

    return INTER * gq.row_bytes(gate, HIDDEN) + INTER * gq.row_bytes(up, HIDDEN) + HIDDEN * gq.row_bytes(down, INTER)


def run(args: argparse.Namespace) -> int:
    import torch

    from clover_desk.engine.errors import CloverError
    from clover_desk.engine.weights.formats import expert_row_layout
    from clover_desk.engine.weights.gguf import quants as gq

    manifest = None
    if args.model is not None:  # read first: a file that cannot be read costs no timing runs
        from clover_desk.engine.placement.manifest import manifest_from_gguf

        try:
            manifest = manifest_from_gguf(args.model)
        except CloverError as exc:
            print(f"clover-desk bench gguf: error: {exc}", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    x = torch.randn(-(-args.values // 2048), 2048)  # whole rows of the 35B shape's hidden size
    print(f"dequantize on CPU ({torch.get_num_threads()} threads), {x.numel():,} values per call, best of {args.repeat}:")
    print(f"  {'type':<6}{'bytes/value':>12}{'Mvalues/s':>12}{'GB/s read':>11}")
    for qtype in (gq.F16, gq.BF16, gq.Q8_0, gq.Q4_0, gq.Q4_K, gq.Q5_K, gq.Q6_K):
        raw = gq.quantize(x, qtype)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            gq.dequantize(raw, qtype)
            best = min(best, time.perf_counter() - t0)
        elems, nbytes = gq.BLOCK[qtype]
        print(f"  {gq.TYPE_NAMES[qtype]:<6}{nbytes / elems:>12.4f}{x.numel() / best / 1e6:>12.0f}"
              f"{raw.numel() / best / 1e9:>11.2f}")
    print(f"\nbytes per streamed expert at the 35B-A3B shape ({3 * HIDDEN * INTER:,} weights):")
    rows = [
        ("Q4_0 file", (gq.Q4_0,) * 3),
        ("Q4_K_M file, ffn_down Q4_K", (gq.Q4_K, gq.Q4_K, gq.Q4_K)),
        ("Q4_K_M file, ffn_down Q6_K", (gq.Q4_K, gq.Q4_K, gq.Q6_K)),
        ("Q8_0 file", (gq.Q8_0,) * 3),
        ("BF16 (unquantized)", (gq.BF16,) * 3),
    ]
    for label, types in rows:
        print(f"  {label:<28}{_expert_bytes(*types):>12,} B")
    print(f"  {'NF4 cache row (this engine)':<28}{expert_row_layout(HIDDEN, INTER, 'nf4')[1]:>12,} B")
    if manifest is not None:
        e = manifest.geometry.num_experts
        per = manifest.expert_layer_bytes()
        print(f"\n{args.model}: bytes per expert by MoE layer ({e} experts per layer)")
        for layer, nbytes in per.items():
            fmts = sorted({x.format for x in manifest if x.kind == 'expert' and x.layer == layer})
            print(f"  layer {layer:>3}: {nbytes // max(e, 1):>12,} B  ({', '.join(fmts)})")
    return 0
