"""No host sync inside a forward, proven by the compiler: the AR step and the 32-slot denoising pass of a tiny model
(all experts resident) trace as one graph under ``torch.compile(fullgraph=True)`` (a graph break, which any
``.item()`` / ``.tolist()`` / ``.cpu()`` / data-dependent Python branch causes, fails the test), and the compiled
forward equals the eager one (fp32, CPU)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from clover_desk.engine.kernels import cpu_block, cpu_quant, cpu_token
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.weights.checkpoint import random_state_dict
from clover_desk.engine.weights.quant import make_policy, quantize_model_
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

SPECIAL = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
BLOCK = 8


@pytest.fixture(scope="module")
def primed() -> tuple[CloverModel, Any]:
    """A 2-layer Clover model (one Gated DeltaNet, one full-attention layer) with one committed block."""
    text = tiny_text_config(vocab_size=256, layers=2, hidden=64, experts=8, experts_per_tok=2)
    cfg = parse_config(config_dict_for("clover_moe", text, SPECIAL))
    cfg = cfg.with_overrides(layer_types=("linear_attention", "full_attention"), block_size=BLOCK)
    model = CloverModel(cfg, dtype=torch.float32)
    model.load_state_dict(random_state_dict(cfg, seed=1))
    model.eval()
    cache = model.new_cache(64)
    model(torch.arange(5, 5 + BLOCK), 0, cache, block_size=BLOCK, write_cache=True)
    return model, cache


def _forwards(model: CloverModel, cache: Any) -> dict[str, tuple[Callable[..., torch.Tensor], tuple[Any, ...]]]:
    def ar_step(tok: torch.Tensor) -> torch.Tensor:
        return model(tok, BLOCK, cache, block_size=None, write_cache=False)

    def denoise_pass(block: torch.Tensor) -> torch.Tensor:
        return model(block, BLOCK, cache, block_size=BLOCK, write_cache=False)

    masked = torch.tensor([9] + [SPECIAL["<|mask|>"]] * (BLOCK - 1))
    return {"ar_step": (ar_step, (torch.tensor([7]),)), "denoise_pass": (denoise_pass, (masked,))}


@pytest.mark.parametrize("name", ["ar_step", "denoise_pass"])
def test_the_forward_traces_as_one_graph(primed: tuple[CloverModel, Any], name: str) -> None:
    model, cache = primed
    fn, args = _forwards(model, cache)[name]
    torch._dynamo.reset()
    # explain() counts every break, scalar reads (.item(), int(tensor)) included; fullgraph=True alone lets torch 2.13
    # turn some of those into in-graph scalar captures, which would still be a host sync on a GPU
    explained = torch._dynamo.explain(fn)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # tracing only: fast
    # (traced, a pass gathers one expert per (token, slot) pair instead of grouping by expert: same math, other
    # summation order)
    assert (compiled(*args) - fn(*args)).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["ar_step", "denoise_pass"])
def test_the_quantized_forward_traces_as_one_graph(primed: tuple[CloverModel, Any], name: str) -> None:
    """The engine's own quantized weights (NF4 experts, INT8 projections and head) on the CPU go through the
    cpu_quant custom ops: no ``.item()`` where the dequantizing experts sized their groups on the host (the denoising
    pass's 16 pairs are past the pairwise gather), so no graph break and no recompilation of a second call."""
    if not cpu_quant.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_quant.reason()}")
    model, cache = primed
    quantized = copy.deepcopy(model)
    quantize_model_(quantized, make_policy())
    fn, args = _forwards(quantized, cache)[name]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    # eager, an AR step's MoE is one C call (engine.kernels.cpu_token) and a pass's GDN mixer another
    # (engine.kernels.cpu_block), never traced
    one_call = fn(*args)
    before, before_block = cpu_token.set_enabled(False), cpu_block.set_enabled(False)
    try:
        want = fn(*args)  # the separate ops, as the trace calls them
    finally:
        cpu_token.set_enabled(before)
        cpu_block.set_enabled(before_block)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(compiled(*args), want)  # the same library calls, through the ops
        assert torch.equal(compiled(*args), want)  # a second call: guards hold, nothing recompiles
    torch.testing.assert_close(one_call, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.slow
def test_compiled_forward_equals_eager(primed: tuple[CloverModel, Any]) -> None:
    model, cache = primed
    torch._dynamo.reset()
    for fn, args in _forwards(model, cache).values():
        compiled = torch.compile(fn, fullgraph=True)  # inductor: generated kernels
        assert (compiled(*args) - fn(*args)).abs().max() < 1e-5


@pytest.mark.gpu
def test_no_host_sync_in_the_forward_on_cuda(primed: tuple[CloverModel, Any]) -> None:
    """Every sync raises under set_sync_debug_mode("error"). bf16 with all experts resident: on a GPU where
    torch._grouped_mm has its fused kernel (H100/H200) the denoising pass groups without reading counts back;
    elsewhere the pass's group sizes still come back to the host (the fused grouped kernel of the fast-path issue)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from clover_desk.engine.model.experts import grouped_mm_supported

    gpu = torch.device("cuda")
    model = copy.deepcopy(primed[0]).to(gpu, torch.bfloat16)  # the fixture's model stays on the CPU
    model.dtype = torch.bfloat16
    gcache = model.new_cache(64)
    model(torch.arange(5, 5 + BLOCK, device=gpu), 0, gcache, block_size=BLOCK, write_cache=True)
    fns = _forwards(model, gcache)
    for name, (fn, args) in fns.items():
        args = tuple(a.to(gpu) for a in args)
        fn(*args)  # warm-up: lazy CUDA / cuBLAS initialisation may sync once
        torch.cuda.synchronize()
        if name == "denoise_pass" and not grouped_mm_supported(gpu, torch.bfloat16):
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_the_denoising_policy_traces_as_one_graph() -> None:
    """The decode policy of a pass (penalties, length and think-end biases, proposal, commit rule, EOS limit) reads
    nothing back to the host: on a GPU it queues behind the forward and the loop reads its outcome once."""
    from clover_desk.engine.decode import decoding
    from clover_desk.engine.decode.diffusion import denoise_policy
    from clover_desk.engine.decode.settings import DecodeSettings

    V, B, mask = 64, 8, 63
    s = DecodeSettings(
        mode="diffusion", max_new_tokens=100, block_size=B, threshold=0.9, mask_token_id=mask, eos_token_ids=(1, 2),
        max_positions=256, repetition_penalty=1.2, presence_penalty=0.5, length_penalty=2.0, length_penalty_start=0,
        length_penalty_window=0, think_end_id=4, think_start_id=5, think_end_bias=3.0, think_end_bias_start=0,
        think_end_bias_window=0,
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=gen) * 4
    x = torch.tensor([9, 5, 2, mask, mask, 11, mask, mask])
    conf = torch.tensor([1.0, 1.0, 0.97, 0.0, 0.0, 0.99, 0.0, 0.0])
    seen = (decoding.seen_mask([9, 10], V), torch.zeros(V, dtype=torch.bool))

    def policy(logits: torch.Tensor, x: torch.Tensor, conf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return denoise_policy(logits, x, conf, s, start=1, seen=seen, n_at_entry=3, thinking_at_entry=True)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(policy)(logits, x, conf)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
