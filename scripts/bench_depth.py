"""AR decode at Clover's real depth (40 layers) on the CPU, from the 4- and 8-layer real-width checkpoints that
``clover-desk bench speed --real-width --layers 4`` and ``--layers 8`` built (run those first; llama-cpp-python
installed). The 4-layer bench under-weights the layers against the head and the fixed costs, and no 40-layer
real-width file fits this machine's disk (~100 GB of inputs), so one process, interleaved round by round, times:

* llama.cpp and the engine on the 4- and 8-layer Q4_K_M files: each one's cost per layer and fixed cost (head,
  embedding, sampling), extrapolated to 40 layers (Clover's pattern of 3 Gated DeltaNet + 1 attention layers
  repeats, so the layers cost alike);
* the engine with the 8-layer file's layers repeated 5 times as a 40-layer model (``--own``: also its own cache's):
  the same weights read 5 times a step, 4.5 GB, far past any cache, so each layer costs what a distinct one would;
  measured, not extrapolated. llama.cpp cannot share layers this way. With ``--own`` the process holds ~19 GB
  (llama.cpp's two files, the engine's two, the own cache's 8 layers): on a 24 GB machine close everything else,
  or llama.cpp's pages are evicted and its figures are disk reads.

    python scripts/bench_depth.py [--rounds 5] [--tokens 32] [--threads 2] [--own]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

from clover_desk.bench import real_width as rw
from clover_desk.engine.weights.gguf.model import load_gguf_model
from clover_desk.engine.weights.quant_cache import load_quantized

PROMPT = [16 + (i * 7) % 200 for i in range(128)]


def llama_ms(llama_cpp: Any, llm: Any, n: int) -> float:
    """llama.cpp's mean greedy AR step after the prompt, ms."""
    llm.reset()
    llm.eval(PROMPT)
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([rw._llama_next(llama_cpp, llm)])
    return (time.perf_counter() - t0) / n * 1e3


@torch.no_grad()
def engine_ms(model: Any, n: int) -> float:
    """The engine's mean greedy AR step after the prompt, ms."""
    cache = model.new_cache(len(PROMPT) + n + 4)
    tok = int(model.forward(torch.tensor(PROMPT), 0, cache, last_only=True)[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(model.forward(torch.tensor([tok]), cache.length, cache, last_only=True)[-1].argmax())
    return (time.perf_counter() - t0) / n * 1e3


def repeated(model: Any, times: int) -> Any:
    """A view of ``model`` with its layers repeated ``times`` times: the same modules and weights (no second copy in
    memory), the model itself unchanged; each layer of the view gets a cache of its own."""
    view = copy.copy(model)
    view._modules = dict(model._modules)  # the view's own module table: setting its layers leaves the model's
    layers, cfg = list(model.layers), model.config
    n = len(layers) * times
    view.layers = nn.ModuleList([layers[i % len(layers)] for i in range(n)])
    view.config = cfg.with_overrides(num_hidden_layers=n,
                                     layer_types=tuple(cfg.layer_types[i % len(layers)] for i in range(n)))
    return view


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--own", action="store_true", help="also the own cache's 8 layers repeated to 40")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llama_cpp = rw._llama_cpp()
    files = {n: rw.cache_root(n) / "model-Q4_K_M-llama.gguf" for n in (4, 8)}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if llama_cpp is None or missing:
        print("bench_depth: needs llama-cpp-python and the real-width inputs of --layers 4 and 8: "
              + (", ".join(missing) or "llama_cpp is not installed"))
        return 2
    n_ctx = len(PROMPT) + args.tokens + 8
    llms = {n: llama_cpp.Llama(model_path=str(p), n_ctx=n_ctx, n_batch=len(PROMPT), n_threads=args.threads,
                               n_threads_batch=args.threads, verbose=False) for n, p in files.items()}
    engines = {n: load_gguf_model(p, torch.float32, "cpu").model for n, p in files.items()}
    deep = {"engine 40 (8 x 5)": repeated(engines[8], 5)}
    if args.own:
        deep["own cache 40 (8 x 5)"] = repeated(load_quantized(rw.cache_root(8) / "checkpoint")[0], 5)
    res: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for n in (4, 8):
            res.setdefault(f"llama.cpp {n}", []).append(llama_ms(llama_cpp, llms[n], args.tokens))
            res.setdefault(f"engine {n}", []).append(engine_ms(engines[n], args.tokens))
        for name, model in deep.items():
            res.setdefault(name, []).append(engine_ms(model, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in res.items()), flush=True)
    for how, pick in (("best", min), ("median", statistics.median)):
        d = {k: pick(v) for k, v in res.items()}
        at40 = {}
        for who in ("llama.cpp", "engine"):
            per = (d[f"{who} 8"] - d[f"{who} 4"]) / 4
            fixed = d[f"{who} 4"] - 4 * per
            at40[who] = fixed + 40 * per
            print(f"{how}: {who} 4 layers {d[f'{who} 4']:.2f} ms, 8 layers {d[f'{who} 8']:.2f} ms: {per:.2f} ms a layer "
                  f"+ {fixed:.2f} ms fixed; 40 layers ~{at40[who]:.1f} ms ({1e3 / at40[who]:.2f} tok/s)")
        for name in deep:
            print(f"{how}: {name} measured {d[name]:.1f} ms ({1e3 / d[name]:.2f} tok/s, "
                  f"{at40['llama.cpp'] / d[name]:.2f}x llama.cpp's 40-layer estimate)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
