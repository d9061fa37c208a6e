"""Compiled decoder layers (``engine.kernels.fastpath``): one compiled graph per layer kind and pass shape serves every layer
(the count does not grow with depth), and the compiled engine decodes the same tokens as the eager one in both
modes. The graphs go through a counting backend that runs them as traced (no inductor: fast); the inductor run is
``clover-desk bench speed --compile``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from clover_desk.engine.decode.generate import generate_ar, generate_diffusion
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels.fastpath import compile_layers, is_compiled
from tests.helpers_model import BLOCK, CountingBackend, tiny_config, tiny_model

PROMPT = [5, 9, 17, 33, 65, 129, 7, 11, 13, 19, 23]
MASK = 256  # the tiny vocabulary's last id stands in for <|mask|>


def _settings(cfg: Any, mode: str, n: int) -> DecodeSettings:
    return DecodeSettings(
        mode=mode, max_new_tokens=n, block_size=cfg.block_size, threshold=cfg.threshold,
        mask_token_id=MASK, eos_token_ids=(), max_positions=cfg.max_position_embeddings,
        shift_logits=cfg.shift_logits,
    )


def _tokens(model: Any, mode: str, n: int) -> list[int]:
    *_, done = generate_ar(model, PROMPT, _settings(model.config, mode, n)) if mode == "ar" else generate_diffusion(
        model, PROMPT, _settings(model.config, mode, n)
    )
    return list(done.token_ids)


def _compiled_run(layers: int, diffusion: bool) -> tuple[int, list[int], list[int], list[int], list[int]]:
    """(graphs compiled by the AR run, eager AR tokens, compiled AR tokens, eager / compiled diffusion tokens)."""
    kinds = ["linear_attention", "full_attention"] * (layers // 2)
    cfg = tiny_config(num_hidden_layers=layers, layer_types=kinds)
    model = tiny_model(cfg, seed=3)
    eager_ar = _tokens(model, "ar", 4)
    eager_dd = _tokens(model, "diffusion", BLOCK + 2) if diffusion else []
    torch._dynamo.reset()
    backend = CountingBackend()
    assert compile_layers(model, backend=backend) == layers
    assert is_compiled(model)
    ar = _tokens(model, "ar", 4)
    graphs = backend.graphs
    dd = _tokens(model, "diffusion", BLOCK + 2) if diffusion else []
    assert backend.graphs > graphs or not diffusion  # the denoising and commit passes ran compiled too
    torch._dynamo.reset()
    return graphs, eager_ar, ar, eager_dd, dd


@pytest.mark.heavy  # ~65 s of inductor compiles: make test-heavy (test_inductor_compiled_layers_match_eager_logits stays)
def test_compiled_layers_decode_the_eager_tokens_and_share_their_graphs() -> None:
    shallow = _compiled_run(2, diffusion=True)
    deep = _compiled_run(6, diffusion=False)
    for graphs, eager_ar, ar, eager_dd, dd in (shallow, deep):
        assert graphs > 0  # the layers really ran compiled
        assert ar == eager_ar
        assert dd == eager_dd
    # three times the layers, the same graphs: a layer is handed its own cache tensors, never an index into a list
    # (an index, or any per-layer integer the code reads, makes every layer a recompile)
    assert deep[0] == shallow[0], (shallow[0], deep[0])


@pytest.mark.slow
def test_inductor_compiled_layers_match_eager_logits() -> None:
    """The real backend (C++ kernels on the CPU) on a 2-layer model: logits of an AR step and a denoising pass."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = tiny_model(cfg, seed=4)
    prompt = torch.tensor(PROMPT[:BLOCK])
    cache = model.new_cache(64)
    model(prompt, 0, cache, block_size=BLOCK)
    block = torch.tensor([3] + [MASK] * (BLOCK - 1))
    step = torch.tensor([7])
    ref_pass = model(block, BLOCK, cache, block_size=BLOCK, write_cache=False)
    ref_step = model(step, BLOCK, cache, write_cache=False)
    torch._dynamo.reset()
    compile_layers(model)
    try:
        assert (model(block, BLOCK, cache, block_size=BLOCK, write_cache=False) - ref_pass).abs().max() < 1e-4
        assert (model(step, BLOCK, cache, write_cache=False) - ref_step).abs().max() < 1e-4
    finally:
        torch._dynamo.reset()


def _stances_of_ar_forwards(model: Any, n: int) -> list[bool]:
    """Whether dynamo skipped unneeded guards (``skip_guard_eval_unsafe``) during each forward of an AR run."""
    import torch._dynamo.eval_frame as eval_frame

    seen: list[bool] = []
    forward = model.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(bool(eval_frame._stance.skip_guard_eval_unsafe))
        return forward(*args, **kwargs)

    model.forward = recording
    try:
        _tokens(model, "ar", n)
    finally:
        del model.forward
    return seen


def test_a_compiled_ar_run_skips_only_the_guards_of_its_steady_steps() -> None:
    """The prefill and the first two steps evaluate every guard (they may compile); the later steps skip those
    that cannot fail, and the tokens stay the eager ones. An eager model never changes the stance."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = tiny_model(cfg, seed=5)
    eager = _tokens(model, "ar", 6)
    assert not any(_stances_of_ar_forwards(model, 6))
    torch._dynamo.reset()
    compile_layers(model, backend=CountingBackend())
    assert _stances_of_ar_forwards(model, 6) == [False, False, False, True, True, True]  # prefill, steps 1-5
    assert _tokens(model, "ar", 6) == eager
    torch._dynamo.reset()


def test_prompts_of_new_lengths_compile_no_new_graphs() -> None:
    """A prefill's chunk scan runs eagerly under compile: traced, its loop was unrolled per chunk count, one new
    graph per prompt length (a window user would wait for a compile at every new message, and after 64 lengths
    the layers would silently fall back to eager)."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = tiny_model(cfg, seed=1)
    torch._dynamo.reset()
    backend = CountingBackend()
    compile_layers(model, backend=backend)
    counts = []
    with torch.no_grad():
        for n in (40, 70, 100, 170):
            ids = torch.arange(n) % 200
            model.forward(ids, 0, model.new_cache(n + 8), write_cache=True, last_only=True)
            counts.append(backend.graphs)
    torch._dynamo.reset()
    assert counts[0] > 0 and counts[1:] == counts[:1] * 3, counts
