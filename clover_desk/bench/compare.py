"""``clover-desk bench speed --compare-llama-cpp`` and ``--compare-transformers``: the same random weights through
llama.cpp and through transformers, greedy tokens compared."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clover_desk.bench.random_model import (
    _best,
    _build_random_model,
    _config,
    _finished,
    _settings,
    _sync,
)


def _compare_llama_cpp(args: argparse.Namespace, device: str, dtype: Any, prompt: list[int]) -> None:
    """The same random weights (the causal qwen3_5_moe model: llama.cpp has no block diffusion) written as an F32
    GGUF in the upstream converter's layout, decoded greedily by llama.cpp and by the engine (eager, and compiled
    with --compile), in this process, one after the other."""
    import torch

    from clover_desk.engine.errors import ConfigError

    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(
            "--compare-llama-cpp needs llama-cpp-python, built from source: "
            "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --no-binary llama-cpp-python llama-cpp-python"
        ) from None
    if device != "cpu" or dtype != torch.float32:
        raise ConfigError("--compare-llama-cpp compares float32 on the CPU (the GGUF is written as F32)")
    from clover_desk.engine.decode.generate import generate_ar
    from clover_desk.engine.weights.checkpoint import write_checkpoint
    from clover_desk.engine.weights.gguf.writer import write_gguf
    from clover_desk.engine.weights.tiny import train_tiny_tokenizer

    data, config = _config(args.shape, "qwen3_5_moe", args.layers)
    model = _build_random_model(config, dtype, device, args.seed)
    n_new = args.decode_tokens
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="clover-bench-gguf-") as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, model.state_dict(), data, max_shard_bytes=1 << 40)
        train_tiny_tokenizer(folder, config.vocab_size)  # llama.cpp needs a vocabulary; ids are fed directly
        gguf_path = folder / "model-f32.gguf"
        write_gguf(folder, gguf_path, "F32", layout="upstream", arch="qwen35moe")
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=len(prompt) + n_new + 8, n_batch=len(prompt),
                              n_threads=threads, logits_all=True, verbose=False)

        def llama_greedy() -> tuple[list[int], float]:
            llm.reset()
            llm.eval(prompt)
            out: list[int] = []
            t0 = time.perf_counter()
            for _ in range(n_new):
                tok = int(llm.scores[llm.n_tokens - 1].argmax())
                out.append(tok)
                llm.eval([tok])
            return out, time.perf_counter() - t0

        # Every figure is the best of ``runs`` timed runs after a warm-up, llama.cpp's runs interleaved with the
        # engine's (this machine is shared and noisy: a slow minute then costs both sides, not one).
        runs = max(1, min(args.repeats, 3))
        settings = _settings(config, "ar", n_new)
        llama_greedy()  # warm-up
        llama_runs: list[tuple[list[int], float]] = []

        def best_engine_run() -> tuple[float, tuple[int, ...]]:
            _finished(generate_ar(model, prompt, settings))  # warm-up (compiles the prefill and step variants)
            done = []
            for _ in range(runs):
                llama_runs.append(llama_greedy())
                done.append(_finished(generate_ar(model, prompt, settings)))
            return max(d.tokens_per_s for d in done), done[0].token_ids

        rows = [("engine, eager", *best_engine_run())]
        if args.compile:
            from clover_desk.engine.kernels.fastpath import compile_layers

            compile_layers(model)
            rows.append(("engine, compiled layers", *best_engine_run()))
        llama_tokens, t_llama = llama_runs[0][0], min(t for _, t in llama_runs)
        llm.close()  # its memory back before the engine's figures are printed
    llama_rate = n_new / t_llama
    print(f"== same weights as GGUF F32 (qwen35moe), greedy AR, {n_new} tokens after {len(prompt)}, "
          f"{threads} threads, best of {len(llama_runs)} / {runs} runs, interleaved: llama.cpp {llama_cpp.__version__} (llama-cpp-python)")
    print(f"AR decode, llama.cpp:                 {llama_rate:10.1f} tok/s")
    for name, rate, tokens in rows:
        same = sum(a == b for a, b in zip(tokens, llama_tokens))
        print(f"AR decode, {name + ':':27s}{rate:10.1f} tok/s  ({rate / llama_rate:.2f}x llama.cpp; greedy tokens "
              f"identical {same}/{n_new})")


# ---------------------------------------------------------------------------------------------------------------
# --compare-transformers


def _compare_transformers(args: argparse.Namespace, device: str, dtype: Any, prompt: list[int]) -> None:
    import torch

    from clover_desk.engine.errors import ConfigError

    if device != "cuda":
        # transformers takes fla's GDN kernels whenever fla imports, and they need a GPU: keep it on its own path
        sys.modules.setdefault("fla", None)
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--compare-transformers needs the test dependency transformers (pip install -e '.[test]')"
        ) from None
    from clover_desk.engine.decode.generate import generate_ar
    from clover_desk.engine.weights.checkpoint import load_model

    data, _ = _config(args.shape, "qwen3_5_moe", args.layers)
    text = {k: v for k, v in data["text_config"].items() if k not in ("model_type", "eos_token_id", "dtype")}
    half = int(text["head_dim"] * text["partial_rotary_factor"]) // 2  # rotary frequency pairs
    side = round(half * 11 / 32)  # 35B-A3B: [11, 11, 10]; identical text positions make the split irrelevant
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [side, side, half - 2 * side],
                               "mrope_interleaved": True}
    hf_config = transformers.Qwen3_5MoeTextConfig(**text, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(args.seed)
    hf = transformers.Qwen3_5MoeForCausalLM(hf_config).eval()
    _randomize_hf(hf, args.seed)
    n_new = args.decode_tokens
    P = len(prompt)
    with tempfile.TemporaryDirectory(prefix="clover-bench-") as tmp:
        hf.save_pretrained(tmp)
        hf = hf.to(device=device, dtype=dtype)
        ours = load_model(Path(tmp), dtype=dtype, device=device)
        config = ours.config
        ids = torch.tensor([prompt], device=device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            t_hf_prefill = _best(lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False), args.repeats, device)
            t_our_prefill = _best(
                lambda: ours.forward(ids[0], 0, ours.new_cache(P), write_cache=True, last_only=True),
                args.repeats, device,
            )

            def hf_generate() -> list[int]:
                out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
                return out[0, P:].tolist()

            hf_generate()  # warm-up
            hf_prefill_once = t_hf_prefill
        settings = _settings(config, "ar", n_new)
        # best of ``runs`` timed runs each, transformers' runs interleaved with the engine's (a noisy machine)
        runs = max(1, min(args.repeats, 3))
        hf_times: list[float] = []
        hf_tokens: list[int] = []

        def best_of_runs() -> Any:
            nonlocal hf_tokens
            _finished(generate_ar(ours, prompt, settings))  # warm-up (compiles, when compiled)
            done = []
            for _ in range(runs):
                with torch.inference_mode():
                    _sync(device)
                    t0 = time.perf_counter()
                    hf_tokens = hf_generate()
                    _sync(device)
                    hf_times.append(time.perf_counter() - t0)
                done.append(_finished(generate_ar(ours, prompt, settings)))
            return max(done, key=lambda d: d.tokens_per_s)

        done = best_of_runs()
        compiled = None
        if args.compile:  # the same checkpoint with its layers compiled, next to transformers in this one run
            from clover_desk.engine.kernels.fastpath import compile_layers

            compile_layers(ours)
            compiled = best_of_runs()
        t_hf = min(hf_times)
    # transformers' generate time includes its prefill; subtract one measured prefill for a decode-only rate
    hf_decode = max(t_hf - hf_prefill_once, 1e-9)
    same = sum(a == b for a, b in zip(done.token_ids, hf_tokens))
    print(f"== same checkpoint (Qwen3_5MoeForCausalLM, save_pretrained, {config.model_type}), greedy, {n_new} tokens, "
          f"best of {len(hf_times)} / {runs} runs, interleaved")
    print(f"prefill, causal ({P} tokens):  engine {P / t_our_prefill:10.1f} tok/s | transformers {P / t_hf_prefill:10.1f} tok/s")
    print(f"AR decode:                   engine {done.tokens_per_s:10.1f} tok/s | transformers {n_new / hf_decode:10.1f} tok/s"
          f" (generate incl. prefill: {n_new / t_hf:.1f} tok/s)")
    if compiled is not None:
        same_c = sum(a == b for a, b in zip(compiled.token_ids, hf_tokens))
        print(f"AR decode, compiled layers:  engine {compiled.tokens_per_s:10.1f} tok/s "
              f"({compiled.tokens_per_s * hf_decode / n_new:.2f}x transformers; greedy tokens identical {same_c}/{n_new})")
    print(f"greedy tokens identical: {same}/{n_new}" + ("" if same == n_new else
          f" (first difference at token {next(i for i, (a, b) in enumerate(zip(done.token_ids, hf_tokens)) if a != b)})"))


def _randomize_hf(model: Any, seed: int) -> None:
    """transformers initializes norms to zero and matrices with std 0.02, which makes every logit nearly equal;
    use the same scales as the engine's random model so greedy decoding has clear winners."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # transformers' own init is in range
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(noise * 2.0 * p.shape[-1] ** -0.5)
            else:
                p.copy_(noise * 0.5 * p.shape[-1] ** -0.5)


