"""Where an AR step's time goes outside the CPU kernels: the real-width checkpoint that ``clover-desk bench speed
--real-width --layers N`` built (run that first), the Q4_K_M file or the engine's own cache, on the CPU. Each round
times AR steps three ways in one process: as they run; with every C call timed (the time inside the kernels, each
function's share, and what is left outside them); with every C call a no-op (the same Python and torch path on
garbage values: the pure overhead). Comparing ``--layers 4`` with ``--layers 8`` splits the overhead into a part per
layer and a fixed part. An AR step's consecutive layers go as one C call (``layers_token``: engine.kernels.cpu_token
layer runs); ``--no-runs`` times the per-layer path instead (each layer's MoE and mixer one call each, the norms and
sums between them in Python), as it was before the runs.

    python scripts/bench_ar_overhead.py [--layers 4] [--which file|own] [--rounds 3] [--steps 30] [--threads 2]
                                        [--no-runs]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from clover_desk.bench import real_width as rw
from clover_desk.engine.kernels import cpu_quant, cpu_token
from clover_desk.engine.weights.gguf.model import load_gguf_model
from clover_desk.engine.weights.quant_cache import load_quantized

QUERIES = ("clover_simd", "clover_vnni", "clover_openmp")  # answered as they are in every mode


class _Library:
    """The kernels' library with each computing function timed into ``spent`` (``noop``: not run, returns 0)."""

    def __init__(self, lib: Any, spent: dict[str, float], noop: bool) -> None:
        self._lib, self._spent, self._noop = lib, spent, noop

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if name in QUERIES or not name.startswith("clover_"):
            return fn
        if self._noop:
            return lambda *args: 0

        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            rc = fn(*args)
            self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t
            return rc

        return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--which", choices=("file", "own"), default="file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-runs", action="store_true", help="the per-layer path (layer runs off)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu_token.set_runs(not args.no_runs)
    root = rw.cache_root(args.layers)
    gguf, folder = root / "model-Q4_K_M-llama.gguf", root / "checkpoint"
    if not (gguf.is_file() and folder.is_dir()):
        print(f"no real-width inputs in {root}: run clover-desk bench speed --real-width --layers {args.layers}")
        return 2
    kern = cpu_quant.kernels()
    if not kern.ok:
        print(f"the CPU kernels are unavailable: {kern.reason}")
        return 2
    model = load_quantized(folder)[0] if args.which == "own" else load_gguf_model(gguf, torch.float32, "cpu").model
    model.eval()
    cache = model.new_cache(64 + args.rounds * args.steps * 3 + 16)
    lib = kern._lib
    with torch.no_grad():
        model.forward(torch.tensor([16 + i % 200 for i in range(64)]), 0, cache)
        pos = 64
        token = torch.tensor([17])

        def step() -> None:
            nonlocal pos
            model.forward(token, pos, cache, last_only=True)
            pos += 1

        def timed_steps(mode: dict[str, float] | None, noop: bool = False) -> list[float]:
            if mode is not None:
                kern._lib = _Library(lib, mode, noop)  # type: ignore[assignment]
                cpu_token._BOUND.clear()  # the one-call steps bind their functions from the library
            try:
                out: list[float] = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    step()
                    out.append(time.perf_counter() - t)
                return out
            finally:
                kern._lib = lib
                cpu_token._BOUND.clear()

        for _ in range(3):
            step()
        ms: Callable[[float], str] = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
        for r in range(args.rounds):
            plain = timed_steps(None)
            spent: dict[str, float] = {}
            timed = timed_steps(spent)
            noop = timed_steps({}, noop=True)
            inside = sum(spent.values()) / args.steps
            mean = sum(timed) / args.steps
            shares = " ".join(f"{n.removeprefix('clover_')} {ms(v / args.steps)}"
                              for n, v in sorted(spent.items(), key=lambda kv: -kv[1]))
            print(f"round {r + 1}: {args.which} {args.layers}L AR step best {ms(min(plain))} ms | timed: mean "
                  f"{ms(mean)}, in C {ms(inside)} ({shares}), outside C {ms(mean - inside)} | C calls no-ops: best "
                  f"{ms(min(noop))} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
