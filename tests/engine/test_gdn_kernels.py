"""Gated DeltaNet through flash-linear-attention's Triton kernels (``engine.kernels.gdn_kernels``) against the PyTorch rule in
``engine.model.clover``, run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``) with ``CLOVER_DESK_FLA_GDN=1``:

- the two custom ops against ``recurrent_gated_delta_rule`` / ``chunk_gated_delta_rule`` at ragged lengths (one
  token, a few, more than one 64-token chunk), with a non-zero incoming state;
- a tiny model's greedy AR generation: the kernels are really taken (counted at the dispatcher), the prefill's and
  steps' logits equal the PyTorch rule's within float32 rounding, the tokens are identical, and so are the caches;
- an AR step with the kernels traces as one graph (``fullgraph=True``): the ops are opaque to the compiler.

Two shims, for the interpreter only, live in the child script: Triton's autotuner benchmarks its configs through
a GPU driver (here: the first config, unbenchmarked), and the interpreter runs a kernel's ``range`` as Python ints,
on which one fla kernel calls ``.to(tl.int64)`` (here: an int that accepts it).
"""

from __future__ import annotations

import importlib.machinery
from typing import Any

import pytest
import torch

from tests.triton_child import run_interpreted

SHIMS = r'''
import builtins, os
import triton.runtime.autotuner as autotuner

_prune = autotuner.Autotuner.prune_configs
autotuner.Autotuner.prune_configs = lambda self, kwargs, *a, **k: _prune(self, kwargs, *a, **k)[:1]


class _Index(int):
    def to(self, *args, **kwargs):
        return int(self)


def _range(*args):
    return (_Index(i) for i in builtins.range(*(int(a) for a in args)))


import fla.ops.common.chunk_delta_h as chunk_delta_h
chunk_delta_h.range = _range
'''

OPS = SHIMS + r'''
import torch
from clover_desk.engine.kernels import gdn_kernels, switches
from clover_desk.engine.model.gdn import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from clover_desk.engine.settings import GpuPaths

switches.use(GpuPaths.from_env())  # as an engine process starts: CLOVER_DESK_FLA_GDN=1 in this child's environment

assert gdn_kernels.enabled(torch.zeros(1)), "the switch should be on under the interpreter"
torch.manual_seed(0)
for t, h, dk, dv in ((1, 2, 16, 32), (5, 3, 16, 16), (70, 2, 32, 16), (150, 1, 16, 16)):
    q = l2norm(torch.randn(t, h, dk)) * dk**-0.5
    k = l2norm(torch.randn(t, h, dk))
    v = torch.randn(t, h, dv)
    g = -torch.rand(t, h) * 0.3
    beta = torch.rand(t, h)
    state = torch.randn(h, dk, dv) * 0.2
    ref_o, ref_s = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    for name, op in (("recurrent", gdn_kernels.recurrent), ("chunked", gdn_kernels.chunked)):
        o, s = op(q, k, v, g, beta, state)
        assert o.shape == ref_o.shape and s.shape == ref_s.shape, (name, o.shape, s.shape)
        err = max((o - ref_o).abs().max().item(), (s - ref_s).abs().max().item())
        assert err < 2e-5, (name, t, h, dk, dv, err)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state, offset=7)
    assert (o - ref_o).abs().max().item() < 2e-5  # the reference's own chunked form agrees too
print("ok")
'''

MODEL = SHIMS + r'''
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from clover_desk.engine.kernels import gdn_kernels
from tests.engine.test_gdn_kernels import gdn_model

model = gdn_model(64)
prompt = torch.randint(5, 256, (70,), generator=torch.Generator().manual_seed(0))


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("clover_desk."):
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def greedy(fla):
    gdn_kernels.OPTED_IN = fla
    cache = model.new_cache(128)
    with torch.inference_mode(), Count() as seen:
        logits = [model(prompt, 0, cache, block_size=None, write_cache=True)[-1]]
        tokens = [int(logits[-1].argmax())]
        for i in range(6):
            logits.append(model(torch.tensor(tokens[-1:]), len(prompt) + i, cache, block_size=None,
                                write_cache=True)[-1])
            tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits), [c.clone() for c in cache.tensors()], seen.calls


ref_tokens, ref_logits, ref_cache, ref_calls = greedy(False)
tokens, logits, cache, calls = greedy(True)
assert ref_calls == {}, ref_calls
assert calls == {"clover_desk.gdn_chunked": 2, "clover_desk.gdn_recurrent": 12}, calls  # 2 GDN layers
assert tokens == ref_tokens, (tokens, ref_tokens)
err = (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item()
assert err < 1e-5, err
for a, b in zip(cache, ref_cache):
    assert (a - b).abs().max().item() < 1e-4, (a - b).abs().max().item()

# an AR step through the kernels traces as one graph: the custom ops are opaque to dynamo
cache = model.new_cache(128)
with torch.inference_mode():
    model(prompt, 0, cache, block_size=None, write_cache=True)
    step = lambda tok: model(tok, len(prompt), cache, block_size=None, write_cache=False)
    tok = torch.tensor([9])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(tok)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert (compiled(tok) - step(tok)).abs().max().item() < 1e-5
print("ok")
'''


BENCH = SHIMS + r'''
import torch
from clover_desk.bench.moe_only import gdn_lines
gdn_lines("cpu", torch.float32, 1, shape="mid", prompt=70)
'''


def gdn_model(hidden: int) -> Any:
    """A 3-layer Clover model, two of them Gated DeltaNet (fp32, eval), for the kernels' token tests."""
    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.weights.checkpoint import random_state_dict
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    special = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
    text = tiny_text_config(vocab_size=256, layers=3, hidden=hidden, experts=8, experts_per_tok=2)
    cfg = parse_config(config_dict_for("clover_moe", text, special))
    cfg = cfg.with_overrides(layer_types=("linear_attention", "full_attention", "linear_attention"), block_size=8)
    model = CloverModel(cfg, dtype=torch.float32)
    model.load_state_dict(random_state_dict(cfg, seed=3))
    return model.eval()


def _needs_fla() -> None:
    pytest.importorskip("triton")
    if importlib.machinery.PathFinder.find_spec("fla") is None:  # (conftest keeps fla out of this process)
        pytest.skip("fla-core is not installed")


def test_the_fla_ops_equal_the_pytorch_rule() -> None:
    _needs_fla()
    run_interpreted(OPS, env={"CLOVER_DESK_FLA_GDN": "1"})


def test_a_model_through_the_fla_kernels_decodes_the_same_tokens() -> None:
    _needs_fla()
    run_interpreted(MODEL, env={"CLOVER_DESK_FLA_GDN": "1"})


def test_bench_times_a_gdn_layer_both_ways() -> None:
    """``bench speed --moe-only``'s GDN line, interpreted: both paths timed, and their outputs agree."""
    _needs_fla()
    out = run_interpreted(BENCH, env={"CLOVER_DESK_FLA_GDN": "1"}, expect_ok=False)
    line = next(x for x in out.splitlines() if x.startswith("GDN layer (mid"))
    assert "PyTorch rule AR step" in line and "fla kernels AR step" in line, line
    # exactly 0 would mean both runs took the same (PyTorch) path: the kernels round differently
    assert 0 < float(line.rsplit("max |diff| ", 1)[1]) < 1e-4, line


def test_the_kernels_are_taken_only_when_opted_in_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from clover_desk.engine.kernels import gdn_kernels

    monkeypatch.setattr(gdn_kernels, "OPTED_IN", True)
    monkeypatch.setattr(gdn_kernels, "AVAILABLE", True)
    monkeypatch.setattr(gdn_kernels, "INTERPRETED", False)
    assert not gdn_kernels.enabled(torch.zeros(1))  # a CPU tensor, not interpreted: never
    monkeypatch.setattr(gdn_kernels, "INTERPRETED", True)
    assert gdn_kernels.enabled(torch.zeros(1))
    monkeypatch.setattr(gdn_kernels, "OPTED_IN", False)
    assert not gdn_kernels.enabled(torch.zeros(1))


@pytest.mark.gpu
def test_fla_kernels_on_cuda_decode_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on a GPU: fla's kernels (TF32 products inside) against the PyTorch rule, the same tiny model, greedy."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _needs_fla()
    from clover_desk.engine.kernels import gdn_kernels

    model = gdn_model(128).to("cuda")
    prompt = torch.randint(5, 256, (200,), generator=torch.Generator().manual_seed(0)).cuda()

    def greedy(fla: bool) -> tuple[list[int], torch.Tensor]:
        monkeypatch.setattr(gdn_kernels, "OPTED_IN", fla)
        cache = model.new_cache(256)
        with torch.inference_mode():
            logits = [model(prompt, 0, cache, block_size=None, write_cache=True)[-1]]
            tokens = [int(logits[-1].argmax())]
            for i in range(16):
                step = model(torch.tensor(tokens[-1:], device="cuda"), 200 + i, cache, block_size=None, write_cache=True)
                logits.append(step[-1])
                tokens.append(int(logits[-1].argmax()))
        return tokens, torch.stack(logits).float()

    ref_tokens, ref_logits = greedy(False)
    tokens, logits = greedy(True)
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item() < 1e-2
