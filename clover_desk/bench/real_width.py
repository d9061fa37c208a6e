"""``clover-desk bench speed --real-width``: the engine and llama.cpp on the very same GGUF file, at Clover's real
widths (hidden 2048, 256 experts of 512, vocab 248,320; ``--layers`` of them, 4 by default: 3 Gated DeltaNet + 1
full attention).

Built once and kept in ``~/.cache/clover-desk/bench/real-width-<N>L`` (``CLOVER_DESK_BENCH_CACHE`` moves it): the
random real-width checkpoint (``make-tiny --shape clover-35b-a3b``); with llama-cpp-python installed (not a dependency:
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python``) its F16 GGUF in upstream
llama.cpp's layout and the Q4_K_M file llama.cpp's own quantizer makes of it, else the engine's own Q4_K file; and the
engine's own quantized cache of the checkpoint (NF4 experts, INT8 dense). ~20 GB of disk, ~20 minutes on 2 cores the
first time.

Then, in this process, interleaved (best of ``--repeats``): prefill of ``--prompt-tokens`` and greedy AR decode of
``--decode-tokens`` by llama.cpp and by the engine reading that file, and by the engine on its own cache; the
engine's 32-slot block pass (bidirectional inside the block, as a denoising pass; the upstream file lacks Clover's
four diffusion tensors per GDN layer, a few KB that change no cost) beside an AR step, per layer and for the head,
with the bytes each reads (everything but the embedding; routed experts counted as used) and the GB/s that makes;
the KL divergence of each one's next-token distributions from llama.cpp's on the F16 file over the prompt (llama.cpp's
own ``--kl-divergence`` method); and each engine's peak RSS, measured alone in a child process.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:
    import resource
except ImportError:  # Windows: no peak RSS figure
    resource = None  # type: ignore[assignment]

from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.weights.gguf.file import open_gguf
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.quant import QuantExpertBank, QuantLinear
from clover_desk.engine.weights.quant_cache import load_quantized
from clover_desk.engine.weights.tiny import make_real_shape

BLOCK = 32
log = logging.getLogger(__name__)


def interleaved(model: CloverModel) -> tuple[int, int]:
    """(expert matrices whose rows the CPU kernels interleaved by 8 at load, all expert matrices) of a GGUF model or
    one read from the own cache (its NF4 banks: gate, up and down together)."""
    gguf = [m for m in model.modules() if isinstance(m, GGUFExpertBank)]
    own = [m for m in model.modules() if isinstance(m, QuantExpertBank)]
    return sum(sum(b.layout.x8) for b in gguf) + 3 * sum(b.layout.x8 for b in own), 3 * (len(gguf) + len(own))


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


def llama_cpp_for(layers: int, say: Callable[[str], None]) -> Any:
    """llama-cpp-python for a ``layers``-layer comparison, or None. Fewer than 4 real-width layers hold no
    full-attention layer (every 4th is one), and llama.cpp's qwen35moe then aborts the process at load (an empty KV
    cache buffer): the engine's figures alone, with a line saying so."""
    llama_cpp = _llama_cpp()
    if llama_cpp is not None and layers < 4:
        say(f"llama.cpp is left out at --layers {layers}: its qwen35moe needs a full-attention layer (>= 4 layers)")
        return None
    return llama_cpp


def build_inputs(layers: int, say: Callable[[str], None], llama_cpp: Any = None) -> tuple[Path, Path]:
    """(checkpoint folder, GGUF file), built once: each step is skipped when its output exists.

    With llama-cpp-python: an F16 GGUF of the checkpoint in upstream llama.cpp's layout (arch qwen35moe, written by the
    engine's writer; llama.cpp's base for KL divergence, as its own perplexity tool uses one), quantized to Q4_K_M by
    llama.cpp's own quantizer (its mix: Q4_K, Q6_K for the head and some down/value projections). Without it: the
    engine's own K-quant writer's Q4_K file. Either way llama.cpp and the engine read the very same bytes."""
    root = cache_root(layers)
    folder = root / "checkpoint"
    if not (folder / "config.json").is_file():
        say(f"writing a real-width {layers}-layer checkpoint to {folder} (once)")
        make_real_shape(folder, layers=layers)
    if llama_cpp is not None:
        q4km = root / "model-Q4_K_M-llama.gguf"
        if not q4km.is_file():
            f16 = _upstream_gguf(folder, root / "model-F16-upstream.gguf", "F16", say)
            say(f"quantizing to {q4km.name} with llama.cpp's quantizer (once)")
            _llama_quantize(llama_cpp, f16, q4km)
        return folder, q4km
    return folder, _upstream_gguf(folder, root / "model-Q4_K-upstream.gguf", "Q4_K", say)


def _upstream_gguf(folder: Path, path: Path, quant: str, say: Callable[[str], None]) -> Path:
    """``path``: the checkpoint in ``folder`` as a ``quant`` GGUF in upstream llama.cpp's layout, written once
    (through a temporary name: an interrupted write is never taken for the file)."""
    if not path.is_file():
        say(f"writing {path.name} (once)")
        tmp = path.with_suffix(".part.gguf")
        write_gguf(folder, tmp, quant, layout="upstream", arch="qwen35moe")
        tmp.replace(path)
    return path


def _llama_quantize(llama_cpp: Any, src: Path, dst: Path) -> None:
    """``src`` (F16 GGUF) -> ``dst`` Q4_K_M by llama.cpp's quantizer, through a temporary name."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = torch.get_num_threads()
    tmp = dst.with_suffix(".part.gguf")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed on {src} (status {rc})")
    tmp.replace(dst)


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


@dataclass(frozen=True)
class StepBytes:
    """The weight bytes a model holds, split as a step reads them (the embedding is a row look-up and counts nothing):
    the head, each layer's dense tensors, one routed expert of each layer, and the rest (the final norm)."""

    head: int
    dense: tuple[int, ...]
    per_expert: tuple[int, ...]
    other: int

    def ar(self, k: int) -> int:
        """One AR step: the head, everything dense, ``k`` experts of each layer."""
        return self.head + self.other + sum(self.dense) + k * sum(self.per_expert)

    def layer(self, i: int, experts: int) -> int:
        return self.dense[i] + experts * self.per_expert[i]


def model_bytes(model: CloverModel) -> StepBytes:
    """:class:`StepBytes` of a loaded model, from its parameters and buffers (any format: GGUF blocks, NF4, INT8)."""
    n = len(model.layers)
    dense, experts = [0] * n, [0] * n
    head = other = 0
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if name.startswith("embed_tokens."):
            continue
        if name.startswith("lm_head."):
            head += nbytes
        elif name.startswith("layers."):
            i = int(name.split(".")[1])
            if ".mlp.experts." in name:
                experts[i] += nbytes
            else:
                dense[i] += nbytes
        else:
            other += nbytes
    per_expert = tuple(b // model.config.num_experts for b in experts)
    return StepBytes(head, tuple(dense), per_expert, other)


def type_mix(path: Path) -> str:
    """The share of a GGUF file's bytes in each ggml type, largest first (``Q4_K 71%, Q6_K 27%, ...``)."""
    by_type: dict[str, int] = {}
    for t in open_gguf(path).tensors.values():
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.nbytes
    total = sum(by_type.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]) if v / total >= 0.005)


def kl_stats(base: Tensor, logits: Tensor) -> tuple[float, float, float]:
    """(mean, max) over positions of KL(base || logits) of the next-token distributions, in nats, and the share of
    positions whose top token agrees: llama.cpp's ``--kl-divergence`` figures. Both [T, V]."""
    p_log = torch.log_softmax(base.double(), dim=-1)
    q_log = torch.log_softmax(logits.double(), dim=-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    agree = (base.argmax(-1) == logits.argmax(-1)).double().mean()
    return float(kl.mean()), float(kl.max()), float(agree)


class LayerClock:
    """Wall time of each decoder layer and of the head inside one forward (pre/post hooks; the CPU runs them in
    order), the best of several runs per module."""

    def __init__(self, model: CloverModel) -> None:
        self.modules: list[torch.nn.Module] = [*model.layers, model.lm_head]
        self.best = [float("inf")] * len(self.modules)
        self._t0 = [0.0] * len(self.modules)

    def run(self, fn: Callable[[], Any], repeats: int) -> list[float]:
        hooks = []
        for j, mod in enumerate(self.modules):
            hooks.append(mod.register_forward_pre_hook(lambda *_a, j=j: self._start(j)))
            hooks.append(mod.register_forward_hook(lambda *_a, j=j: self._stop(j)))
        try:
            for _ in range(repeats):
                fn()
        finally:
            for h in hooks:
                h.remove()
        return list(self.best)

    def _start(self, j: int) -> None:
        self._t0[j] = time.perf_counter()

    def _stop(self, j: int) -> None:
        self.best[j] = min(self.best[j], time.perf_counter() - self._t0[j])


def _peak_rss_bytes() -> int | None:
    """This process's peak resident set: Linux's VmHWM (its own address space's high-water mark; ``ru_maxrss`` would
    carry the parent's peak across fork and exec), else ``ru_maxrss`` (macOS), else None (Windows)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _child_peak(kind: str, path: Path, folder: Path, prompt_len: int) -> float | None:
    """Peak RSS (GiB) of one engine alone: a child process loads it, prefills ``prompt_len`` tokens and decodes 8."""
    cmd = [sys.executable, "-m", "clover_desk.bench.real_width", "--peak", kind, str(path), str(folder), str(prompt_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("peak_rss_bytes "):
            return int(line.split()[1]) / 2**30
    log.warning("peak RSS of %s not measured: %s", kind, (done.stderr.strip().splitlines() or ["no output"])[-1])
    return None


def _peak_main(argv: list[str]) -> int:
    kind, path, folder, prompt_len = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    prompt = [16 + i % 200 for i in range(prompt_len)]  # ids every vocabulary holds, tiny ones too
    if kind == "llama.cpp":
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), n_ctx=prompt_len + 16, n_batch=prompt_len,
                              n_threads=torch.get_num_threads(), verbose=False)
        llm.eval(prompt)
        for _ in range(8):
            llm.eval([_llama_next(llama_cpp, llm)])
    else:
        model = load_gguf_model(path, torch.float32, "cpu").model if kind == "gguf" else load_quantized(folder)[0]
        settings = _ar_settings(model.config, 8)
        for _event in generate_ar(model, prompt, settings):
            pass
    peak = _peak_rss_bytes()
    print(f"peak_rss_bytes {peak}" if peak is not None else "peak_rss_bytes unavailable")
    return 0


def _ar_settings(config: Any, n_new: int) -> DecodeSettings:
    return DecodeSettings(mode="ar", max_new_tokens=n_new, block_size=config.block_size, threshold=config.threshold,
                          mask_token_id=config.mask_token_id, eos_token_ids=(),
                          max_positions=config.max_position_embeddings, shift_logits=config.shift_logits)


def _llama_next(llama_cpp: Any, llm: Any) -> int:
    """The greedy next token after llama.cpp's last eval (its last position's logits; no ``logits_all`` needed)."""
    row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())


class _Engine:
    """One engine's prefill and greedy AR decode over the same prompt."""

    def __init__(self, model: CloverModel, prompt: list[int], n_new: int) -> None:
        self.model, self.prompt, self.n_new = model, prompt, n_new
        self.settings = _ar_settings(model.config, n_new)

    def prefill(self) -> None:
        self.model.forward(torch.tensor(self.prompt), 0, self.model.new_cache(len(self.prompt)), last_only=True)

    def decode(self) -> tuple[list[int], float]:
        last = None
        for event in generate_ar(self.model, self.prompt, self.settings):
            last = event
        assert isinstance(last, Finished)
        return list(last.token_ids), self.n_new / last.tokens_per_s

    def logits(self) -> Tensor:
        return self.model.forward(torch.tensor(self.prompt), 0, self.model.new_cache(len(self.prompt)))


class _Llama:
    """llama.cpp's prefill and greedy AR decode over the same prompt (logits of the last position only, as its own
    tools run; ``logits_all`` would add a full head product per prompt token)."""

    def __init__(self, llama_cpp: Any, path: Path, prompt: list[int], n_new: int, threads: int) -> None:
        self.lib, self.prompt, self.n_new = llama_cpp, prompt, n_new
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n_new + 8, n_batch=len(prompt),
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    def prefill(self) -> None:
        self.llm.reset()
        self.llm.eval(self.prompt)

    def decode(self) -> tuple[list[int], float]:
        self.prefill()
        out: list[int] = []
        t0 = time.perf_counter()
        for _ in range(self.n_new):
            out.append(_llama_next(self.lib, self.llm))
            self.llm.eval([out[-1]])
        return out, time.perf_counter() - t0


def llama_logits(llama_cpp: Any, path: Path, prompt: list[int], threads: int) -> Tensor:
    """llama.cpp's logits at every prompt position on ``path`` [T, V]."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + 8, n_batch=len(prompt), n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(prompt)
    out = torch.from_numpy(np.array(llm.scores[: len(prompt)], copy=True))
    llm.close()
    return out


def run_real_width(args: argparse.Namespace) -> int:
    layers = args.layers or 4
    threads = torch.get_num_threads()

    def say(line: str) -> None:
        print(f"[real-width] {line}", flush=True)

    llama_cpp = llama_cpp_for(layers, say)
    folder, path = build_inputs(layers, say, llama_cpp)
    prompt_len = args.prompt_tokens or 128
    n_new = args.decode_tokens
    repeats = max(1, min(args.repeats, 5))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(16, 240_000, (prompt_len,), generator=gen).tolist()
    kern = cpu_quant.kernels()
    kernels = (f"on ({kern.isa})" if cpu_quant.available()
               else f"off: {cpu_quant.reason()}")
    say(f"CPU kernels: {kernels}; loading the file, then the engine's own cache (built once)")

    gguf_model = load_gguf_model(path, torch.float32, "cpu").model
    cache_model, report = load_quantized(folder)
    sides: dict[str, Any] = {"engine, the file": _Engine(gguf_model, prompt, n_new),
                             "engine, own cache": _Engine(cache_model, prompt, n_new)}
    if llama_cpp is not None:
        sides = {"llama.cpp, the file": _Llama(llama_cpp, path, prompt, n_new, threads), **sides}
    for side in sides.values():  # warm-ups
        side.decode()
    # interleaved timed runs: a slow minute on this shared machine costs every side, not one
    prefill_t = {k: float("inf") for k in sides}
    decode_t = dict(prefill_t)
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, side in sides.items():
            prefill_t[name] = min(prefill_t[name], _best(side.prefill, 1))
            tokens[name], dt = side.decode()
            decode_t[name] = min(decode_t[name], dt)

    if ref_side := sides.get("llama.cpp, the file"):
        ref_side.llm.close()  # its memory back before the KL and peak runs load more
    file_bytes, cache_bytes = model_bytes(gguf_model), model_bytes(cache_model)
    k = gguf_model.config.num_experts_per_tok
    step = {n: (cache_bytes if "cache" in n else file_bytes).ar(k) for n in sides}
    who = f"llama.cpp {llama_cpp.__version__} (llama-cpp-python)" if llama_cpp else "llama.cpp not installed"
    print(f"== real widths, {layers} layers; {path.name} ({path.stat().st_size / 2**30:.2f} GiB: {type_mix(path)}); "
          f"own cache {report.path.name}; {threads} threads; best of {repeats} interleaved runs; {who}")
    (done, total), (own, own_total) = interleaved(gguf_model), interleaved(cache_model)
    int8 = [m for m in cache_model.modules() if isinstance(m, QuantLinear) and m.fmt == "int8"]
    print(f"expert matrices with rows interleaved by 8 for the CPU kernels (engine.kernels.x8): the file's {done} of "
          f"{total}, the own cache's {own} of {own_total}; its INT8 projections {sum(m.x8 for m in int8)} of {len(int8)}")
    print(f"prompt {prompt_len} tokens, {n_new} greedy AR tokens; an AR step reads {file_bytes.ar(k) / 1e6:.0f} MB of the "
          f"file (head {file_bytes.head / 1e6:.0f} MB, dense {sum(file_bytes.dense) / 1e6:.0f} MB, {k} experts x "
          f"{layers} layers {k * sum(file_bytes.per_expert) / 1e6:.0f} MB), {cache_bytes.ar(k) / 1e6:.0f} MB of the cache")
    ref = "llama.cpp, the file" if llama_cpp is not None else None
    print(f"{'':22}{'AR tok/s':>10}{'GB/s':>7}{'prefill tok/s':>15}" + ("   vs llama.cpp: AR, prefill" if ref else ""))
    for name in sides:
        ar, pf = n_new / decode_t[name], prompt_len / prefill_t[name]
        line = f"{name:22}{ar:10.2f}{step[name] * ar / 1e9:7.1f}{pf:15.1f}"
        if ref and name != ref:
            line += f"   {decode_t[ref] / decode_t[name]:.2f}x, {prefill_t[ref] / prefill_t[name]:.2f}x"
        print(line)
    if ref:
        same = {n: sum(a == b for a, b in zip(tokens[n], tokens[ref])) for n in sides if n != ref}
        print("greedy tokens identical to llama.cpp's: " + ", ".join(f"{n} {v}/{n_new}" for n, v in same.items())
              + " (all round activations to int8 blocks, in their own orders; random weights have near ties)")
    _print_pass(gguf_model, file_bytes, prompt, repeats, "engine, the file")
    _print_pass(cache_model, cache_bytes, prompt, repeats, "engine, own cache", alike=False)
    if llama_cpp is not None:
        _print_kl(llama_cpp, path, path.parent / "model-F16-upstream.gguf", prompt, threads,
                  {"engine, the file": sides["engine, the file"], "engine, own cache": sides["engine, own cache"]})
    peaks = {n: _child_peak(kind, path, folder, prompt_len)
             for n, kind in (("llama.cpp, the file", "llama.cpp"), ("engine, the file", "gguf"),
                             ("engine, own cache", "cache")) if n in sides}
    print("peak RSS, each alone in a child process (load, prefill, 8 tokens): "
          + ", ".join(f"{n} {v:.2f} GiB" if v is not None else f"{n} n/a" for n, v in peaks.items()))
    return 0


def _print_pass(model: CloverModel, sb: StepBytes, prompt: list[int], repeats: int, name: str,
                alike: bool = True) -> None:
    """A 32-slot block pass beside one AR step, per layer and for the head: time, bytes touched, GB/s (``alike``:
    also as the random weights route it, the 32 masks alike; always with the slots' experts spread)."""
    config = model.config
    block_start = len(prompt) // BLOCK * BLOCK
    cache = model.new_cache(block_start + BLOCK)
    if block_start:
        model.forward(torch.tensor(prompt[:block_start]), 0, cache, block_size=BLOCK)
    block = torch.full((BLOCK,), config.mask_token_id if config.mask_token_id is not None else 3)
    token = torch.tensor([prompt[block_start % len(prompt)]])

    def one_pass() -> None:
        model.forward(block, block_start, cache, block_size=BLOCK, write_cache=False)

    def one_step() -> None:
        model.forward(token, block_start, cache, write_cache=False)

    one_pass()
    one_step()
    step_t = LayerClock(model).run(one_step, repeats)
    as_run = _best(one_step, repeats)  # unhooked: an AR step's consecutive layers go as one C call (cpu_token.layer_runs)
    if alike:
        pass_t = LayerClock(model).run(one_pass, repeats)
        print(f"block pass vs AR step ({name}; 32 masks after the prompt route alike on random weights):")
        _pass_table(model, sb, step_t, pass_t, _distinct_experts(model, one_pass))
    with _spread_routing(model):  # a trained router spreads a pass's 32 slots: the issue's ~160 experts a layer
        spread_t = LayerClock(model).run(one_pass, repeats)
        spread = _distinct_experts(model, one_pass)
    print(f"{'the same pass' if alike else f'block pass vs AR step ({name})'} with each slot's 8 experts drawn at "
          "random, as a trained router spreads distinct tokens:")
    _pass_table(model, sb, step_t, spread_t, spread)
    print(f"  (the AR rows time each layer's own forward, under the clock's hooks; the AR step as it runs, its layers "
          f"in one C call where they can be: {as_run * 1e3:.2f} ms)")


def _pass_table(model: CloverModel, sb: StepBytes, step_t: list[float], pass_t: list[float], used: list[int]) -> None:
    config, k = model.config, model.config.num_experts_per_tok
    rows = [(f"layer {i} ({config.layer_types[i]})", sb.layer(i, k), sb.layer(i, used[i]), f"{used[i]} experts")
            for i in range(len(model.layers))] + [("head", sb.head, sb.head, "32 rows")]
    for (name, ar_b, pass_b, what), ts, tp in zip(rows, step_t, pass_t):
        ar_gbs, pass_gbs = ar_b / ts / 1e9, pass_b / tp / 1e9
        print(f"  {name:28} AR {ts * 1e3:7.2f} ms {ar_b / 1e6:6.0f} MB {ar_gbs:5.1f} GB/s | pass {tp * 1e3:7.1f} ms "
              f"{pass_b / 1e6:6.0f} MB ({what}) {pass_gbs:5.1f} GB/s = {pass_gbs / ar_gbs:.2f}x")
    total_ar = sum(r[1] for r in rows) / sum(step_t) / 1e9
    total_pass = sum(r[2] for r in rows) / sum(pass_t) / 1e9
    print(f"  {'all':28} AR {sum(step_t) * 1e3:7.2f} ms {total_ar:5.1f} GB/s | pass {sum(pass_t) * 1e3:7.1f} ms "
          f"{total_pass:5.1f} GB/s = {total_pass / total_ar:.2f}x")


@contextmanager
def _spread_routing(model: CloverModel) -> Iterator[None]:
    """Within it every layer's routed experts get, for each token, k distinct experts drawn at random (drawn once per
    routing shape, so the timed calls do no drawing): random weights route a pass's identical masks alike (13-20
    experts a layer), a trained router spreads 32 distinct slots over ~160 of 256; the router's own product and
    top-k still run."""
    n = model.config.num_experts
    drawn: dict[tuple[int, ...], Tensor] = {}

    def pre(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, idx, w = args
        if tuple(idx.shape) not in drawn:
            g = torch.Generator().manual_seed(idx.shape[0])
            rows = [torch.randperm(n, generator=g)[: idx.shape[1]] for _ in range(idx.shape[0])]
            drawn[tuple(idx.shape)] = torch.stack(rows).to(idx.device)
        return x, drawn[tuple(idx.shape)], w

    hooks = [layer.mlp.experts.register_forward_pre_hook(pre) for layer in model.layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _print_kl(llama_cpp: Any, path: Path, f16: Path, prompt: list[int], threads: int, engines: dict[str, _Engine]) -> None:
    """KL divergence from llama.cpp on the F16 file (the BF16 checkpoint's values, F16 holds them exactly here)."""
    if not f16.is_file():
        print(f"KL divergence: skipped ({f16.name} is missing)")
        return
    base = llama_logits(llama_cpp, f16, prompt, threads)
    rows = {"llama.cpp, the file": llama_logits(llama_cpp, path, prompt, threads)}
    rows.update({n: e.logits() for n, e in engines.items()})
    print(f"KL divergence from llama.cpp on the F16 file, {len(prompt)} prompt positions (mean / max nats per token, "
          f"top-1 agreement):")
    for name, logits in rows.items():
        mean, worst, agree = kl_stats(base, logits)
        print(f"  {name:22} {mean:.5f} / {worst:.5f}   {agree:.1%}")


if __name__ == "__main__":
    sys.exit(_peak_main(sys.argv[2:]) if sys.argv[1:2] == ["--peak"] else 2)
