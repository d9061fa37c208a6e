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
``--policies``: the INT8-projection policy (the head in Q6_K) against the Q6_K-projection one
(``formats.CPU_Q6_DENSE_POLICY``), each from its own cache folder (built once): bytes per AR token, per-layer and
head ms of the decode steps, AR tok/s, interleaved medians, and each whole model's KL from the BF16 weights (fp32
compute) over the prompt's next-token distributions.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import cpu_quant, fastpath
from clover_desk.engine.model.experts import DenseExpertBank, moe_grouped
from clover_desk.engine.weights.checkpoint import load_model
from clover_desk.engine.weights.formats import CPU_Q6_DENSE_POLICY, QuantPolicy, checkpoint_files, make_policy
from clover_desk.engine.weights.quant import QuantLinear, quantize_tensor
from clover_desk.engine.weights.quant_cache import load_quantized

DEFAULT_CKPT = Path.home() / ".cache" / "clover-desk" / "bench" / "real-width-4L" / "checkpoint"


def fixed_text(config: object, n_prompt: int, n_new: int) -> tuple[list[int], DecodeSettings]:
    """The bench's fixed prompt (seeded random ids) and its greedy AR settings."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, min(240_000, config.vocab_size), (n_prompt,), generator=gen).tolist()
    settings = DecodeSettings(mode="ar", max_new_tokens=n_new, block_size=config.block_size,
                              threshold=config.threshold, mask_token_id=config.mask_token_id, eos_token_ids=(),
                              max_positions=config.max_position_embeddings, shift_logits=config.shift_logits)
    return prompt, settings


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
    ap.add_argument("--policies", action="store_true",
                    help="INT8 against Q6_K projections: bytes, layer ms, tok/s, KL from BF16 (medians)")
    ap.add_argument("--no-kl", action="store_true", help="with --policies: skip the BF16 reference (~9 GB, minutes)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.policies:
        compare_policies(args.checkpoint, args.cache_root, args.prompt, args.new, args.repeats, not args.no_kl)
        print("load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        return
    t0 = time.perf_counter()
    model, report = load_quantized(args.checkpoint, cache_root=args.cache_root)  # the CPU's default policy
    model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s (cache {'rebuilt: ' + report.reason if report.rebuilt else 'used'})")
    prompt, settings = fixed_text(model.config, args.prompt, args.new)
    kern = cpu_quant.kernels()
    print(f"CPU kernels: {f'on ({kern.isa})' if kern.ok else 'off: ' + kern.reason}")
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


class _UpcastBank(DenseExpertBank):
    """A BF16 expert bank computed in fp32: the experts an input uses are cast when gathered (the reference keeps
    its 256 experts a layer in BF16 so that the whole checkpoint fits beside nothing else)."""

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = super().gather(ids)
        return gate_up.float(), down.float()

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        return moe_grouped(x, topk_idx, topk_w, self.num_experts, self.gather, 3 * self.intermediate_size)


def bf16_reference_logits(checkpoint: Path, prompt: list[int]) -> torch.Tensor:
    """Logits [T, V] of the checkpoint's BF16 weights over ``prompt``, computed in fp32 (experts cast as used)."""
    model = load_model(checkpoint, dtype=torch.bfloat16)
    for module in model.modules():
        if isinstance(module, DenseExpertBank):
            module.__class__ = _UpcastBank
            continue
        for p in module.parameters(recurse=False):
            p.data = p.data.float()
    model.dtype = torch.float32
    with torch.no_grad():
        logits = model(torch.tensor(prompt), 0, None).float()
    del model
    return logits


def timed_layers(model: torch.nn.Module, ms: dict[str, list[float]]) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks appending each decoder layer's and the head's ms of every one-token forward to ``ms``."""
    handles, start = [], {}
    for name, mod in [*((f"layer {i}", m) for i, m in enumerate(model.layers)), ("head", model.lm_head)]:
        def pre(_m: torch.nn.Module, args: tuple, name: str = name) -> None:
            start[name] = time.perf_counter() if args[0].reshape(-1, args[0].shape[-1]).shape[0] == 1 else None

        def post(_m: torch.nn.Module, _args: tuple, _out: object, name: str = name) -> None:
            if start.get(name) is not None:
                ms.setdefault(name, []).append((time.perf_counter() - start[name]) * 1e3)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def compare_policies(checkpoint: Path, cache_root: Path | None, n_prompt: int, n_new: int, repeats: int,
                     with_kl: bool = True) -> None:
    """``--policies``: INT8 against Q6_K projections (both with the Q6_K head), interleaved medians."""
    policies: dict[str, QuantPolicy] = {"int8 proj": make_policy(lm_head="q6_k"), "q6_k proj": CPU_Q6_DENSE_POLICY}
    config = load_quantized(checkpoint, policies["int8 proj"], cache_root=cache_root)[0].config
    prompt, settings = fixed_text(config, n_prompt, n_new)
    t0 = time.perf_counter()
    base = bf16_reference_logits(checkpoint, prompt) if with_kl else None  # [T, V]
    if base is not None:
        print(f"BF16 reference logits (fp32 compute) in {time.perf_counter() - t0:.1f} s", flush=True)
    models, kl = {}, {}
    for n, policy in policies.items():
        t0 = time.perf_counter()
        model, report = load_quantized(checkpoint, policy, cache_root=cache_root)
        models[n] = model.eval()
        print(f"{n}: {policy.name} ({report.path.name}) loaded in {time.perf_counter() - t0:.1f} s"
              f"{' (built: ' + report.reason + ')' if report.rebuilt else ''}", flush=True)
        with torch.no_grad():
            kl[n] = kl_from(base, model(torch.tensor(prompt), 0, None).float()) if base is not None else None
    runs: dict[str, list[float]] = {n: [] for n in models}
    layer_ms: dict[str, dict[str, list[float]]] = {n: {} for n in models}
    loads = []
    with torch.no_grad():
        for i in range(repeats + 1):  # interleaved; the first round warms up
            for n, model in models.items():
                handles = timed_layers(model, layer_ms[n]) if i else []
                try:
                    tps = ar_tok_s(model, prompt, settings)[0]
                finally:
                    for h in handles:
                        h.remove()
                runs[n] += [tps] if i else []
            loads.append(os.getloadavg()[0])
    print(f"policies, AR {n_prompt} + {n_new}, {repeats} interleaved rounds (1-min load average per round: "
          f"{' '.join(f'{x:.2f}' for x in loads)}); KL from the BF16 weights over {len(prompt)} positions")
    for n, model in models.items():
        kl_text = "KL {:.2e} / {:.2e}, top-1 {:.1%}".format(*kl[n]) if kl[n] else "KL not measured"
        layers = " ".join(f"{k} {statistics.median(layer_ms[n][k]):6.2f}" for k in sorted(layer_ms[n], key=lambda k: (
            k == "head", k)))
        print(f"  {n}: {model_bytes_per_token(model) / 1e6:5.0f} MB/token | AR median {statistics.median(runs[n]):6.2f}"
              f" tok/s (runs {' '.join(f'{r:.2f}' for r in runs[n])}) | median ms: {layers} | {kl_text}", flush=True)


if __name__ == "__main__":
    main()
