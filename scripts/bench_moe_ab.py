"""A/B timing of the routed-expert and many-row CPU kernels (``engine/kernels/csrc/quant_cpu.c``): the build of a git
revision (``--base``, default main) against the working tree's, at Clover-35B-A3B's real widths (hidden 2048, expert
width 512, 256 experts, top-8), for one token (AR step) and 32 tokens (a diffusion pass), on GGUF Q4_K expert rows
(``moe_packed``) and the engine's own NF4 / INT8 rows (``moe_rows``); then 32 tokens routed to 16 experts (a pass on
random weights, whose masks route alike) and the dense products of a pass (``qmatmul`` / ``smatmul``: a 16,384-row
slice of the Q6_K head, the Q4_K and INT8 in_proj_qkvz 12,288 x 2,048, NF4 4,096 x 2,048).

    python scripts/bench_moe_ab.py [--base main] [--rounds 9] [--calls 5] [--threads 1] [--only T=1]

The two builds run interleaved (the order alternating each round), each round timing ``--calls`` calls and keeping
the best; the table gives the median over rounds in ms per call and new / old. On a shared machine take the medians,
not a single round. Each case also says whether both builds return the same bits (the tiled many-row kernels
change the last bits; tests/engine/test_cpu_quant_ktiles.py holds them to fp64 references).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.gguf import quants as gq

HIDDEN, EXPERT_I, EXPERTS, TOP_K = 2048, 512, 256, 8
DISTINCT = 8  # experts quantized for real; the bank repeats them (distinct memory, same values)
REPO = Path(__file__).resolve().parents[1]
CUT = "# torch custom ops"  # the old module is loaded up to its custom ops (registered once, by the new module)


def old_kernels(rev: str, where: Path) -> cq.Kernels:
    """The Kernels class of ``rev``'s cpu_quant.py over ``rev``'s C source, built in the usual kernel cache."""
    (where / "csrc").mkdir(parents=True, exist_ok=True)
    for rel, dst in (("engine/kernels/csrc/quant_cpu.c", where / "csrc" / "quant_cpu.c"),
                     ("engine/kernels/cpu_quant.py", where / "cpu_quant.py")):
        dst.write_bytes(subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"], check=True,
                                       capture_output=True).stdout)
    text = (where / "cpu_quant.py").read_text()
    mod = types.ModuleType("old_cpu_quant")
    mod.__file__ = str(where / "cpu_quant.py")
    exec(compile(text[: text.index(CUT)], mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - our own file at rev
    kern = mod.Kernels()
    if not kern.ok:
        raise SystemExit(f"the {rev} build failed: {kern.reason}")
    return kern


def q4k_bank() -> Tensor:
    """uint8 [EXPERTS, gate | up | down blocks] of Q4_K experts."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(DISTINCT):
        gate, up = (gq.quantize(torch.randn(EXPERT_I, HIDDEN, generator=g) * 0.02, cq.Q4_K) for _ in range(2))
        down = gq.quantize(torch.randn(HIDDEN, EXPERT_I, generator=g) * 0.02, cq.Q4_K)
        rows.append(torch.cat([gate.reshape(-1), up.reshape(-1), down.reshape(-1)]))
    return torch.stack(rows).repeat(EXPERTS // DISTINCT, 1).contiguous()


def own_bank(fmt: str) -> wq.QuantExpertBank:
    g = torch.Generator().manual_seed(1)
    small = wq.QuantExpertBank.from_dense(torch.randn(DISTINCT, 2 * EXPERT_I, HIDDEN, generator=g) * 0.02,
                                          torch.randn(DISTINCT, HIDDEN, EXPERT_I, generator=g) * 0.02, fmt)
    layout = wq.ExpertLayout.build(EXPERTS, HIDDEN, EXPERT_I, fmt, small.layout.blocksize)
    return wq.QuantExpertBank(layout, packed=small.packed.repeat(EXPERTS // DISTINCT, 1).contiguous())


def routing(t: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(t)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(t)])
    return idx, torch.softmax(torch.randn(t, TOP_K, generator=g), -1)


def cases() -> list[tuple[str, Callable[[cq.Kernels], Tensor]]]:
    out: list[tuple[str, Callable[[cq.Kernels], Tensor]]] = []
    packed = q4k_bank()
    qtypes = (cq.Q4_K, cq.Q4_K, cq.Q4_K)
    banks = {fmt: own_bank(fmt) for fmt in ("nf4", "int8")}
    for t in (1, 32):
        x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(100 + t))
        idx, wts = routing(t)
        out.append((f"Q4_K moe_packed T={t}", lambda k, x=x, i=idx, w=wts: k.moe_packed(x, packed, EXPERT_I, qtypes,
                                                                                        i, w)))
        for fmt, bank in banks.items():
            lay = bank.layout
            offs = (lay.gate_up_codes[0], lay.down_codes[0], lay.gate_up_scales[0], lay.down_scales[0])
            bss = (lay.blocksize, lay.blocksize) if fmt == "nf4" else (HIDDEN, EXPERT_I)
            qt = cq.SPLIT_OF_FORMAT[fmt]
            out.append((f"{fmt.upper()} moe_rows T={t}", lambda k, x=x, i=idx, w=wts, b=bank, o=offs, s=bss, q=qt:
                        k.moe_rows(x, b.packed, o, EXPERT_I, q, s, i, w)))
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(7))
    idx = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(t))[:TOP_K] for t in range(32)])
    wts = torch.softmax(torch.randn(32, TOP_K, generator=torch.Generator().manual_seed(8)), -1)
    out.append(("Q4_K moe_packed T=32, 16 exp", lambda k: k.moe_packed(x, packed, EXPERT_I, qtypes, idx, wts)))
    g = torch.Generator().manual_seed(9)
    for name, qt, rows in (("Q6_K head slice", cq.Q6_K, 16384), ("Q4_K qkvz", cq.Q4_K, 12288)):
        w = gq.quantize(torch.randn(rows, HIDDEN, generator=g) * 0.02, qt)
        out.append((f"{name} qmatmul T=32", lambda k, w=w, q=qt: k.qmatmul(x, w, q)))
    for fmt, rows in (("int8", 12288), ("nf4", 4096)):
        codes, scales = wq.quantize_tensor(torch.randn(rows, HIDDEN, generator=g) * 0.02, fmt, 64)
        bs = 64 if fmt == "nf4" else HIDDEN
        out.append((f"{fmt.upper()} {rows} smatmul T=32", lambda k, c=codes, s=scales, q=cq.SPLIT_OF_FORMAT[fmt],
                    b=bs: k.smatmul(x, c, s, q, b)))
    return out


def best_ms(fn: Callable[[], Tensor], calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="only the cases whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"old": old_kernels(args.base, Path(tmp)), "new": cq.kernels()}
    assert builds["new"].ok, builds["new"].reason
    print(f"old {builds['old'].path}\nnew {builds['new'].path}\nthreads {args.threads}, rounds {args.rounds}, "
          f"best of {args.calls} calls per round")
    print(f"{'case':28s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s}  same bits")
    for name, call in cases():
        if args.only not in name:
            continue
        same = torch.equal(call(builds["old"]), call(builds["new"]))  # also the warm-up
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times[which].append(best_ms(lambda w=which: call(builds[w]), args.calls))
        old, new = (statistics.median(times[w]) for w in ("old", "new"))
        print(f"{name:28s} {old:9.3f} {new:9.3f} {new / old:8.3f}  {same}", flush=True)


if __name__ == "__main__":
    main()
