"""``clover-desk bench speed``: prefill / AR / diffusion speed of the engine on a random model built from a config.

Shapes:
* ``mid`` (default): hidden 512, 8 layers, 64 experts (top 8), vocab 4096 — a few seconds per figure on 2 cores.
* ``clover-35b-a3b``: the full Clover-35B-A3B shape (40 layers, 256 experts, vocab 248,320). Meant for
  ``--device cuda --dtype bfloat16``: all weights resident, random init directly on the GPU, no checkpoint.

Figures: prefill tokens/s (block mode, and causal), AR decode tokens/s (greedy through the cache), diffusion
passes/s for one 32-slot block (read-only denoising pass), and tokens per pass from a real diffusion run on the
random model (random weights are rarely confident, so expect about 1 token per pass: the figure is honest, not
representative of a trained model). ``--compare-transformers`` also runs the same checkpoint (written by
transformers' ``save_pretrained``) through transformers' own greedy ``generate`` and reports whether the tokens
match.

``--moe-only`` times one MoE layer's routed experts alone (``bank.prepare`` + ``bank(x, idx, w)``, what
``engine.model.clover.SparseMoe`` calls) at the Clover-35B-A3B expert shape (E=256, top-8, D=2048, I=512) for T=1 (an AR
step) and T=32 (one diffusion pass), dense and NF4 banks; float32 on CPU, bfloat16 on CUDA. It also times the slow
per-expert loop kept as the reference (``engine.model.experts.routed_reference``, ``engine.weights.quant.routed_reference``) and
prints the largest difference between the two.
"""

from __future__ import annotations

import argparse
import sys

from clover_desk.bench.count import run_count
from clover_desk.bench.moe_only import MOE_SHAPE, run_moe_only
from clover_desk.bench.random_model import SHAPES
from clover_desk.bench.timing import run_timing
from clover_desk.cli import flags

# Bounds of the sizing flags: a benchmark's runs fit in memory and end (a typo such as --decode-tokens 10000000 is
# refused in one line instead of running for days)
MAX_BENCH_PROMPT = 65_536
MAX_BENCH_TOKENS = 4_096
MAX_REPEATS = 1_000
MAX_LAYERS = 1_024  # engine.model.config's bound on num_hidden_layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=tuple(SHAPES), default="mid", help="mid (default), deep-narrow, clover-35b-a3b, tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--prompt-tokens", type=flags.integer(1, MAX_BENCH_PROMPT), default=None, help="prefill length (default 256 mid, 1024 full)")
    parser.add_argument("--decode-tokens", type=flags.integer(1, MAX_BENCH_TOKENS), default=32, help="AR tokens to time")
    parser.add_argument("--diffusion-tokens", type=flags.integer(1, MAX_BENCH_TOKENS), default=64, help="tokens of the real diffusion run")
    parser.add_argument("--mode", choices=("ar-diffusion", "spec"), default="ar-diffusion",
                        help="spec: also a self-speculative run beside AR and diffusion (its tokens checked against AR's)")
    parser.add_argument("--repeats", type=flags.integer(1, MAX_REPEATS), default=5, help="timed repeats of the prefill and block passes")
    parser.add_argument("--layers", type=flags.integer(1, MAX_LAYERS), default=None, help="override the shape's layer count (smoke runs)")
    parser.add_argument("--seed", type=flags.SEED, default=0)
    parser.add_argument("--moe-only", action="store_true",
                        help="time one MoE layer's routed experts (E=256, k=8, D=2048, I=512), T=1 and T=32")
    parser.add_argument("--moe-distinct", type=flags.integer(MOE_SHAPE["top_k"], MOE_SHAPE["experts"]), default=70,
                        help="--moe-only: distinct experts a 32-token pass routes to (default 70, a trained router)")
    parser.add_argument("--count", action="store_true",
                        help="only count what one AR step and one denoising pass dispatch: torch ops (~ GPU kernel "
                             "launches), host reads (syncs on a GPU) and bytes written, per layer kind and scaled to "
                             "the shape's full depth (no timing; the planner's launch and traffic figures)")
    parser.add_argument("--quant", choices=("none", "card"), default="none",
                        help="card: quantize the random model as the app does for a 16 GB card (NF4 experts, INT8 "
                             "projections, shared experts and LM head) before measuring")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, default=None, metavar="G",
                        help="with --quant card: place the experts as the planner does for a G GiB card (the "
                             "clover-35b-a3b shape: streamed layers in pinned host memory, a slot pool), and on CUDA "
                             "cap the process at G GiB: the card's code path")
    parser.add_argument("--stream", type=flags.integer(1, MAX_LAYERS), default=None, metavar="N",
                        help="with --quant card: stream the experts of the last N layers through a slot pool of "
                             "2 x top-k x N experts (any shape; the CPU tests of the placed path)")
    parser.add_argument("--device-pool", action="store_true",
                        help="with --vram-gb / --stream: AR steps and diffusion block passes fetch the streamed "
                             "experts through device-side slot tables (engine.placement.device_pool: no host read, the step one "
                             "CUDA graph, a block pass too with the fused MoE kernel) instead of the host pool's "
                             "bookkeeping")
    parser.add_argument("--compile", action="store_true",
                        help="also time the engine with its decoder layers compiled (engine.kernels.fastpath), same tokens")
    parser.add_argument("--real-width", action="store_true",
                        help="the engine and llama.cpp on the same Q4_K_M file at Clover's real widths (--layers, default "
                             "4; built once, ~14 GB in ~/.cache/clover-desk/bench; needs llama-cpp-python)")
    parser.add_argument("--compare-llama-cpp", action="store_true",
                        help="also run the same weights as an F32 GGUF (upstream qwen35moe layout) through llama.cpp "
                             "(llama-cpp-python, built from source: not a dependency) and compare greedy tokens")
    parser.add_argument("--compare-transformers", action="store_true",
                        help="also run the same checkpoint through transformers' generate (test dependency)")


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError

    try:
        if args.real_width:
            from clover_desk.bench.real_width import run_real_width

            return run_real_width(args)
        _check_flags(args)
        if args.moe_only:
            return run_moe_only(args)
        if args.count:
            return run_count(args)
        return run_timing(args)
    except CloverError as exc:
        print(f"clover-desk bench speed: error: {exc}", file=sys.stderr)
        return 2




def _check_flags(args: argparse.Namespace) -> None:
    """The placing flags' combinations, refused before a model is built (the 35B shape takes minutes to build)."""
    from clover_desk.engine.errors import ConfigError

    if args.device_pool and args.vram_budget_bytes is None and args.stream is None:
        raise ConfigError("--device-pool changes how streamed experts are fetched: add --vram-gb G or --stream N")
    if (args.vram_budget_bytes is not None or args.stream is not None) and args.quant != "card":
        raise ConfigError("--vram-gb / --stream place quantized experts: add --quant card")
    if args.vram_budget_bytes is not None and args.stream is None and args.shape != "clover-35b-a3b":
        raise ConfigError(f"--vram-gb plans the clover-35b-a3b shape, not {args.shape!r} (use --stream N)")
