"""AR decode speed of the engine's own quantized cache (the CPU's default policy: NF4 experts, INT8 projections, the
head in Q6_K blocks) on the CPU, with the CPU kernels (``engine.kernels.cpu_quant``) and without them (the
dequantizing path), on a real-width checkpoint: by default the 4-layer one ``clover-desk bench speed --real-width``
builds, its cache beside it (shared with that bench).

    .venv/bin/python scripts/bench_own_cache_ar.py [--checkpoint DIR] [--cache-root DIR] [--new 32] [--repeats 3]
        [--compile] [--heads]

Prints best-of-repeats tokens per second (the machine is shared: the best run is the least disturbed one) and the
greedy tokens' agreement between the two paths. ``--compile``: also the compiled model's cold warm-up (first AR
steps, then the first 32-slot denoising pass, as ``--compile`` compiles the layers) and its AR speed. ``--heads``:
the head alone (ms and GB/s of one token), AR tok/s and bytes per token with the INT8 head (the GPU policy's, and
the CPU's before the Q6_K default) and with the Q6_K head, interleaved, and each head's KL divergence from the
checkpoint's BF16 head over the prompt's next-token distributions (the same hidden states: the head's own cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import cpu_quant, fastpath
from clover_desk.engine.weights.formats import checkpoint_files
from clover_desk.engine.weights.quant import QuantLinear, quantize_tensor
from clover_desk.engine.weights.quant_cache import load_quantized

DEFAULT_CKPT = Path.home() / ".cache" / "clover-desk" / "bench" / "real-width-4L" / "checkpoint"


def ar_tok_s(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings) -> tuple[float, tuple[int, ...]]:
    last = None
    for event in generate_ar(model, prompt, settings):
        last = event
    if not isinstance(last, Finished):
        raise RuntimeError(f"generate_ar ended without Finished: {last!r}")
    return last.tokens_per_s, tuple(last.token_ids)


def best(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings, repeats: int) -> tuple[float, tuple[int, ...]]:
    ar_tok_s(model, prompt, settings)  # warm-up
    runs = [ar_tok_s(model, prompt, settings) for _ in range(repeats)]
    print(f"  runs tok/s: {' '.join(f'{r[0]:.2f}' for r in runs)}", flush=True)
    return max(r[0] for r in runs), runs[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CKPT)
    ap.add_argument("--cache-root", type=Path, default=None, help="default: beside the checkpoint")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--skip-off", action="store_true", help="do not time the dequantizing path")
    ap.add_argument("--skip-eager", action="store_true", help="do not time the eager model (with --compile)")
    ap.add_argument("--heads", action="store_true", help="INT8 against Q6_K head: time, tok/s, bytes, KL from BF16")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    t0 = time.perf_counter()
    model, report = load_quantized(args.checkpoint, cache_root=args.cache_root)  # the CPU's default policy
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s (cache {'rebuilt: ' + report.reason if report.rebuilt else 'used'})")
    config = model.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, min(240_000, config.vocab_size), (args.prompt,), generator=gen).tolist()
    settings = DecodeSettings(mode="ar", max_new_tokens=args.new, block_size=config.block_size,
                              threshold=config.threshold, mask_token_id=config.mask_token_id, eos_token_ids=(),
                              max_positions=config.max_position_embeddings, shift_logits=config.shift_logits)
    kern = cpu_quant.kernels()
    print(f"CPU kernels: {'on (' + ('AVX2' if kern.simd else 'scalar') + ')' if kern.ok else 'off: ' + kern.reason}")
    with torch.no_grad():
        if not args.skip_eager:
            on, toks_on = best(model, prompt, settings, args.repeats)
            print(f"own cache AR, kernels on : {on:7.2f} tok/s (best of {args.repeats})", flush=True)
        if not args.skip_off and not args.skip_eager:
            before = cpu_quant.set_enabled(False)
            try:
                off, toks_off = best(model, prompt, settings, 1)
            finally:
                cpu_quant.set_enabled(before)
            same = sum(a == b for a, b in zip(toks_on, toks_off))
            print(f"own cache AR, kernels off: {off:7.2f} tok/s   ({on / off:.1f}x; greedy tokens equal: {same}/"
                  f"{len(toks_on)})", flush=True)
        if args.compile:
            compiled_ar(model, prompt, settings, args.repeats)
        if args.heads:
            compare_heads(model, args.checkpoint, prompt, settings, args.repeats)
    print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


def checkpoint_head(checkpoint: Path) -> torch.Tensor:
    """The checkpoint's ``lm_head.weight`` as stored (BF16) [V, D]."""
    files, weight_map = checkpoint_files(checkpoint)
    path = checkpoint / weight_map["lm_head.weight"] if weight_map else files[0]
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("lm_head.weight")


def head_bytes(head: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in head.buffers())


def model_bytes_per_token(model: torch.nn.Module) -> int:
    """Weights an AR token reads: everything but the routed experts' banks and the embedding table, plus k of E
    experts per MoE layer."""
    config, total = model.config, 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name:
            continue
        nbytes = t.numel() * t.element_size()
        total += nbytes * config.num_experts_per_tok // config.num_experts if ".mlp.experts." in name else nbytes
    return total


def last_hidden(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """The head's input at every prompt position [T, D] (the final norm's output), through a pre-hook."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    try:
        model.forward(torch.tensor(prompt), 0, model.new_cache(len(prompt)))
    finally:
        hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def kl_from(base: torch.Tensor, logits: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max) KL(base || logits) over positions in nats per token, and the top-1 agreement: [T, V] each."""
    p_log, q_log = base.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return float(kl.mean()), float(kl.max()), float((base.argmax(-1) == logits.argmax(-1)).double().mean())


def compare_heads(model: torch.nn.Module, checkpoint: Path, prompt: list[int], settings: DecodeSettings,
                  repeats: int) -> None:
    """``--heads``: the loaded head (Q6_K under the CPU's default) against an INT8 head of the same BF16 weight."""
    bf16 = checkpoint_head(checkpoint)  # [V, D]
    own = model.lm_head if isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt == "q6_k" else None
    heads = {"int8": quantized_head(bf16, "int8"), "q6_k": own or quantized_head(bf16, "q6_k")}  # own: the cache's
    hidden = last_hidden(model, prompt)  # [T, D]
    base = torch.cat([hidden @ bf16[r:r + 16384].float().T for r in range(0, bf16.shape[0], 16384)], dim=-1)
    del bf16
    x, n_head = hidden[-1:], max(20, repeats)
    best_ms = {n: float("inf") for n in heads}
    for _ in range(n_head):  # interleaved: both heads see the same moments of a shared machine
        for n, h in heads.items():
            t0 = time.perf_counter()
            h(x)
            best_ms[n] = min(best_ms[n], (time.perf_counter() - t0) * 1e3)
    runs: dict[str, list[float]] = {n: [] for n in heads}
    for i in range(repeats + 1):  # AR with each head in place, interleaved; the first round warms up
        for n, h in heads.items():
            model.lm_head = h
            tps = ar_tok_s(model, prompt, settings)[0]
            runs[n] += [tps] if i else []
    for n in heads:
        print(f"  {n} head AR runs tok/s: {' '.join(f'{r:.2f}' for r in runs[n])}")
    tok_s = {n: max(r) for n, r in runs.items()}
    print(f"heads (load average {os.getloadavg()[0]:.2f}): one token, best of {n_head} interleaved; AR best of "
          f"{repeats} interleaved; KL from the BF16 head over {len(prompt)} positions (mean / max nats, top-1)")
    for n, h in heads.items():
        model.lm_head = h
        mean, worst, agree = kl_from(base, h(hidden).float())
        print(f"  {n:5} head {head_bytes(h) / 1e6:6.0f} MB {best_ms[n]:7.2f} ms {head_bytes(h) / best_ms[n] / 1e6:5.1f}"
              f" GB/s | AR {tok_s[n]:6.2f} tok/s, {model_bytes_per_token(model) / 1e6:5.0f} MB/token | KL "
              f"{mean:.2e} / {worst:.2e}, top-1 {agree:.1%}", flush=True)
    model.lm_head = heads["q6_k"]


def quantized_head(w: torch.Tensor, fmt: str, rows: int = 16384) -> QuantLinear:
    """A QuantLinear of ``w`` [V, D] in ``fmt`` ("int8" | "q6_k"), quantized in row chunks as the cache builder
    does (bounded memory)."""
    head = QuantLinear(w.shape[1], w.shape[0], fmt)
    for r in range(0, w.shape[0], rows):
        codes, scales = quantize_tensor(w[r : r + rows], fmt)
        head.codes[r : r + len(codes)] = codes
        if fmt == "int8":
            head.scales[r : r + len(codes)] = scales
    return head


def compiled_ar(model: torch.nn.Module, prompt: list[int], settings: DecodeSettings, repeats: int) -> None:
    """``--compile``'s compile (engine.kernels.fastpath.compile_layers): the cold warm-up of the first AR steps and
    of a 32-slot denoising pass, then AR speed through the compiled step."""
    torch._dynamo.reset()
    fastpath.compile_layers(model)
    try:
        t0 = time.perf_counter()
        ar_tok_s(model, prompt, dataclasses.replace(settings, max_new_tokens=2))
        print(f"compiled: first AR steps, prefill included (cold compile) {time.perf_counter() - t0:.1f} s", flush=True)
        start = len(prompt) // 32 * 32
        cache = model.new_cache(start + 32)
        model.forward(torch.tensor(prompt[:start]), 0, cache, block_size=32)
        block = torch.full((32,), model.config.mask_token_id if model.config.mask_token_id is not None else 3)
        t0 = time.perf_counter()
        model.forward(block, start, cache, block_size=32, write_cache=False)
        print(f"compiled: first 32-slot denoising pass (cold compile) {time.perf_counter() - t0:.1f} s", flush=True)
        tps, _ = best(model, prompt, settings, repeats)
        print(f"own cache AR, compiled, kernels on: {tps:7.2f} tok/s (best of {repeats})", flush=True)
    finally:
        fastpath.uncompile_layers(model)

if __name__ == "__main__":
    main()
