"""``clover-desk bench speed --real-width``: the engine and llama.cpp on the very same Q4_K file, at Clover's real
widths (hidden 2048, 256 experts of 512, vocab 248,320; ``--layers`` of them, 4 by default: 3 Gated DeltaNet + 1
full attention).

Built once and kept in ``~/.cache/clover-desk/bench/real-width-<N>L`` (``CLOVER_DESK_BENCH_CACHE`` moves it): the
random real-width checkpoint (``make-tiny --shape clover-35b-a3b``) and its Q4_K GGUF in upstream llama.cpp's layout
(~11 GB of disk, ~15 minutes on 2 cores the first time). llama.cpp is timed when llama-cpp-python is installed (not a
dependency: ``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python``).

Then, in this process, interleaved (best of ``--repeats``): prefill of ``--prompt-tokens`` and greedy AR decode of
``--decode-tokens`` by llama.cpp and by the engine reading that file, plus the engine's 32-slot block pass
(bidirectional inside the block, as a denoising pass; the upstream file lacks Clover's four diffusion tensors per
GDN layer, a few KB that change no cost). For each: the weight bytes the step reads (from the file's header:
everything but the embedding, routed experts counted as used) and the GB/s that makes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from engine.decode.events import Finished
from engine.decode.generate import DecodeSettings, generate_ar
from engine.kernels import cpu_quant
from engine.model.clover import CloverModel
from engine.weights.gguf.file import open_gguf
from engine.weights.gguf.model import load_gguf_model
from engine.weights.gguf.writer import write_gguf
from engine.weights.tiny import make_real_shape

BLOCK = 32


def cache_root(layers: int) -> Path:
    base = os.environ.get("CLOVER_DESK_BENCH_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "clover-desk" / "bench"
    return root / f"real-width-{layers}L"


def _llama_cpp() -> Any:
    """llama-cpp-python, or None (the engine's figures alone, with a line saying how to get the comparison)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def build_inputs(layers: int, say: Callable[[str], None]) -> tuple[Path, Path]:
    """(checkpoint folder, Q4_K file), built once: each step is skipped when its output exists. The file is written in
    upstream llama.cpp's layout (arch qwen35moe) by the engine's own K-quant writer (Q4_K where rows hold whole
    256-value blocks, ggml's fallbacks elsewhere), so llama.cpp and the engine read the very same bytes."""
    root = cache_root(layers)
    folder = root / "checkpoint"
    if not (folder / "config.json").is_file():
        say(f"writing a real-width {layers}-layer checkpoint to {folder} (once)")
        make_real_shape(folder, layers=layers)
    q4k = root / "model-Q4_K-upstream.gguf"
    if not q4k.is_file():
        say(f"writing {q4k.name} (once)")
        tmp = q4k.with_suffix(".part.gguf")
        write_gguf(folder, tmp, "Q4_K", layout="upstream", arch="qwen35moe")
        tmp.replace(q4k)
    return folder, q4k


def step_bytes(path: Path, experts_used: int) -> dict[str, int]:
    """Weight bytes one AR step reads from the file: the head, each layer's dense tensors, ``experts_used`` routed
    experts per layer (the embedding is a row look-up and counts nothing)."""
    gf = open_gguf(path)
    per_expert = 0
    dense = head = 0
    n_experts = gf.config.num_experts
    for name, t in gf.tensors.items():
        if name == "token_embd.weight":
            continue
        if name == "output.weight":
            head = t.nbytes
        elif "_exps." in name:
            per_expert += t.nbytes // n_experts
        else:
            dense += t.nbytes
    layers = gf.config.num_hidden_layers
    return {"head": head, "dense": dense, "per_expert_all_layers": per_expert,
            "ar_total": head + dense + per_expert * experts_used, "layers": layers}


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _distinct_experts(model: CloverModel, run: Callable[[], Any]) -> list[int]:
    """Distinct routed experts per layer that ``run`` used (forward pre-hooks on the expert banks)."""
    seen: list[set[int]] = [set() for _ in model.layers]
    hooks = []
    for i, layer in enumerate(model.layers):
        def pre(_mod: Any, args: tuple[Any, ...], i: int = i) -> None:
            seen[i].update(args[1].reshape(-1).tolist())  # (x, topk_idx, topk_w)
        hooks.append(layer.mlp.experts.register_forward_pre_hook(pre))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return [len(s) for s in seen]


def run_real_width(args: argparse.Namespace) -> int:
    llama_cpp = _llama_cpp()
    layers = args.layers or 4
    threads = torch.get_num_threads()

    def say(line: str) -> None:
        print(f"[real-width] {line}", flush=True)

    _folder, path = build_inputs(layers, say)
    prompt_len = args.prompt_tokens or 128
    n_new = args.decode_tokens
    repeats = max(1, min(args.repeats, 5))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(16, 240_000, (prompt_len,), generator=gen).tolist()
    kernels = (f"on ({'AVX2' if cpu_quant.kernels().simd else 'scalar'})" if cpu_quant.available()
               else f"off: {cpu_quant.reason()}")
    say(f"CPU kernels: {kernels}")

    model = load_gguf_model(path, torch.float32, "cpu").model
    config = model.config
    llm = None
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=prompt_len + n_new + 8, n_batch=prompt_len,
                              n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    settings = DecodeSettings(mode="ar", max_new_tokens=n_new, block_size=config.block_size,
                              threshold=config.threshold, mask_token_id=config.mask_token_id, eos_token_ids=(),
                              max_positions=config.max_position_embeddings, shift_logits=config.shift_logits)

    def engine_prefill() -> None:
        model.forward(torch.tensor(prompt), 0, model.new_cache(prompt_len), last_only=True)

    def engine_ar() -> Finished:
        last = None
        for event in generate_ar(model, prompt, settings):
            last = event
        assert isinstance(last, Finished)
        return last

    def llama_prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    def llama_ar() -> tuple[list[int], float]:
        llama_prefill()
        out: list[int] = []
        t0 = time.perf_counter()
        for _ in range(n_new):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            out.append(tok)
            llm.eval([tok])
        return out, time.perf_counter() - t0

    block_start = prompt_len // BLOCK * BLOCK
    block_cache = model.new_cache(block_start + BLOCK)
    if block_start:
        model.forward(torch.tensor(prompt[:block_start]), 0, block_cache, block_size=BLOCK)
    block = torch.full((BLOCK,), config.mask_token_id if config.mask_token_id is not None else 3)

    def engine_pass() -> None:
        model.forward(block, block_start, block_cache, block_size=BLOCK, write_cache=False)

    # warm-ups, then interleaved timed runs (a slow minute on this shared machine costs both sides, not one)
    engine_prefill()
    engine_ar()
    engine_pass()
    if llm is not None:
        llama_ar()
    t: dict[str, list[float]] = {k: [] for k in ("engine_prefill", "llama_prefill", "engine_ar", "llama_ar", "engine_pass")}
    engine_tokens: tuple[int, ...] = ()
    llama_tokens: list[int] = []
    for _ in range(repeats):
        if llm is not None:
            t["llama_prefill"].append(_best(llama_prefill, 1))
            llama_tokens, dt = llama_ar()
            t["llama_ar"].append(dt)
        t["engine_prefill"].append(_best(engine_prefill, 1))
        done = engine_ar()
        engine_tokens = done.token_ids
        t["engine_ar"].append(n_new / done.tokens_per_s)
        t["engine_pass"].append(_best(engine_pass, 1))
    best = {k: min(v) for k, v in t.items() if v}
    pass_experts = _distinct_experts(model, engine_pass)
    b = step_bytes(path, config.num_experts_per_tok)
    per_expert_layer = b["per_expert_all_layers"] / layers
    pass_bytes = b["head"] + b["dense"] + sum(pass_experts) * per_expert_layer
    rss = psutil.Process().memory_info().rss / 2**30  # GiB

    who = f"llama.cpp {llama_cpp.__version__} (llama-cpp-python)" if llama_cpp else "llama.cpp not installed"
    print(f"== real widths, {layers} layers, one Q4_K file ({path.stat().st_size / 2**30:.2f} GiB), {threads} threads, "
          f"best of {repeats} interleaved runs; {who}")
    print(f"prompt {prompt_len} tokens, {n_new} greedy AR tokens; weights read per AR token {b['ar_total'] / 1e6:.0f} MB "
          f"(head {b['head'] / 1e6:.0f} MB, dense {b['dense'] / 1e6:.0f} MB, 8 experts in each of {layers} layers "
          f"{per_expert_layer * 8 * layers / 1e6:.0f} MB)")
    ar_e, pf_e = n_new / best["engine_ar"], prompt_len / best["engine_prefill"]
    if llm is not None:
        ar_l, pf_l = n_new / best["llama_ar"], prompt_len / best["llama_prefill"]
        print(f"AR decode   llama.cpp {ar_l:8.2f} tok/s ({b['ar_total'] * ar_l / 1e9:5.1f} GB/s)   engine {ar_e:8.2f} "
              f"tok/s ({b['ar_total'] * ar_e / 1e9:5.1f} GB/s)   {ar_e / ar_l:.2f}x")
        print(f"prefill     llama.cpp {pf_l:8.1f} tok/s   engine {pf_e:8.1f} tok/s   {pf_e / pf_l:.2f}x")
        same = sum(a == c for a, c in zip(engine_tokens, llama_tokens))
        print(f"greedy tokens, engine vs llama.cpp on this file: {same}/{n_new} identical (both round activations to "
              f"int8 blocks, in their own orders)")
    else:
        print(f"AR decode   engine {ar_e:8.2f} tok/s ({b['ar_total'] * ar_e / 1e9:5.1f} GB/s)")
        print(f"prefill     engine {pf_e:8.1f} tok/s")
        print("(for llama.cpp side by side: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --no-binary llama-cpp-python "
              "llama-cpp-python)")
    print(f"block pass  engine {best['engine_pass'] * 1e3:8.1f} ms per 32-slot pass (32 masks after the prompt: "
          f"random weights route them alike); distinct experts per layer "
          f"{pass_experts}; reads {pass_bytes / 1e6:.0f} MB ({pass_bytes / best['engine_pass'] / 1e9:.1f} GB/s; an AR "
          f"step {b['ar_total'] * ar_e / 1e9:.1f} GB/s)")
    print(f"RSS of this process at the end (the engine{' and llama.cpp' if llm is not None else ''} loaded): {rss:.2f} GiB")
    return 0
