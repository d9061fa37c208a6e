"""The fused C step of Gated DeltaNet on the CPU (``engine.kernels.gdn_kernels.cpu_step``, ``clover_gdn_step`` in
``quant_cpu.c``) against the PyTorch rule (``engine.model.clover.recurrent_gated_delta_rule``):

- the kernel alone, at a tiny width, at dk != dv and at the real width (32 heads of 128 x 128): the output and the
  updated state equal the rule's within float32 rounding; not in place, the state is left as it was;
- one real-width GDN layer's AR step (hidden 2048, random weights) with and without the kernel: the same output and
  the same cache within float32 rounding, and a step that writes no cache leaves the cache as it was;
- a tiny model's greedy AR generation takes the kernel (counted) and decodes the same tokens as the rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.engine.api import Engine
from clover_desk.engine.decode.events import Finished
from clover_desk.engine.decode.generate import generate_ar
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.kernels import cpu_quant, gdn_kernels
from clover_desk.engine.model.cache import PassContext
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.model.gdn import GatedDeltaNet, l2norm, recurrent_gated_delta_rule
from clover_desk.engine.weights.tiny import clover_35b_a3b_text_config

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler for the CPU kernels")


def _inputs(h: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(1, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(1, h, dk, generator=gen))
    v = torch.randn(1, h, dv, generator=gen)
    g = -torch.rand(1, h, generator=gen) * 3  # log decay <= 0
    beta = torch.rand(1, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("h,dk,dv", [(4, 16, 8), (3, 8, 24), (32, 128, 128)])
def test_the_step_equals_the_pytorch_rule(h: int, dk: int, dv: int) -> None:
    q, k, v, g, beta, state = _inputs(h, dk, dv, seed=h * dk + dv)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)

    kept = state.clone()
    out = gdn_kernels.cpu_step(q, k, v, g, beta, kept, in_place=False)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    assert torch.equal(kept, state)  # not in place: untouched

    updated = state.clone()
    out_in_place = gdn_kernels.cpu_step(q, k, v, g, beta, updated, in_place=True)
    assert torch.equal(out_in_place, out)
    torch.testing.assert_close(updated, want_state, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused_in_one_line() -> None:
    q, k, v, g, beta, state = _inputs(4, 16, 8, seed=0)
    with pytest.raises(ValueError, match=r"gdn_step: v has shape \(4, 9\)"):
        cpu_quant.gdn_step(q[0], k[0], torch.zeros(4, 9), g[0], beta[0], state, None)
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        cpu_quant.gdn_step(q[0], k[0], v[0], g[0], beta[0], state.double(), None)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the C steps taken (the real kernel still runs)."""
    calls: list[int] = []
    real = cpu_quant.gdn_step

    def counted(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_quant, "gdn_step", counted)
    yield calls


def _real_width_layer() -> GatedDeltaNet:
    config = parse_config({**clover_35b_a3b_text_config(layers=1, vocab_size=256), "model_type": "qwen3_5_moe_text"})
    layer = GatedDeltaNet(config, 0, clover_extras=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.5 if name in ("A_log", "dt_bias") else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
        layer.norm.weight.fill_(1.0)
    return layer


def _ar_pass(pos: int, write_cache: bool) -> PassContext:
    return PassContext(start_pos=pos, length=1, block_size=None, cache=None, write_cache=write_cache,
                 cos=torch.zeros(1, 0), sin=torch.zeros(1, 0), attn_mask=None, attn_causal=False, coreset=False)


def test_a_real_width_layer_steps_alike_with_and_without_the_kernel(
        monkeypatch: pytest.MonkeyPatch, kernel_calls: list[int]) -> None:
    layer = _real_width_layer()
    cfg = layer.config
    assert (layer.num_v_heads, layer.dk, layer.dv, cfg.hidden_size) == (32, 128, 128, 2048)
    gen = torch.Generator().manual_seed(4)
    conv = torch.randn(layer.kernel - 1, layer.conv_dim, generator=gen)
    state = torch.randn(layer.num_v_heads, layer.dk, layer.dv, generator=gen) * 0.1
    x = torch.randn(1, cfg.hidden_size, generator=gen)

    caches = {}
    outs = {}
    with torch.no_grad():
        for fused in (False, True):
            monkeypatch.setattr(gdn_kernels, "cpu_step_enabled",
                                (lambda t: True) if fused else (lambda t: False))
            st = (conv.clone(), state.clone())
            outs[fused] = layer(x, _ar_pass(7, write_cache=True), st)
            caches[fused] = st
        assert len(kernel_calls) == 1
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(caches[True][1], caches[False][1], rtol=1e-5, atol=1e-6)
        assert torch.equal(caches[True][0], caches[False][0])

        st = (conv.clone(), state.clone())  # a step that writes no cache leaves it as it was
        again = layer(x, _ar_pass(7, write_cache=False), st)
        assert len(kernel_calls) == 2
        assert torch.equal(again, outs[True])
        assert torch.equal(st[1], state) and torch.equal(st[0], conv)


def test_a_tiny_model_decodes_the_same_tokens_through_the_kernel(
        tiny_clover_dir: Path, one_torch_thread: None, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        kernel_calls: list[int]) -> None:
    engine = Engine.load(tiny_clover_dir, dtype=torch.float32)
    s = DecodeSettings(mode="ar", max_new_tokens=12, eos_token_ids=(), mask_token_id=engine.config.mask_token_id,
                       max_positions=512)
    prompt = [7, 21, 33, 40, 52, 11, 9]

    def tokens() -> tuple[int, ...]:
        done = [e for e in generate_ar(engine.model, prompt, s) if isinstance(e, Finished)]
        return done[-1].token_ids

    with_kernel = tokens()
    gdn_layers = sum(1 for t in engine.config.layer_types if t == "linear_attention")
    assert len(kernel_calls) == gdn_layers * 11  # every AR step after the prefill, every GDN layer
    monkeypatch.setattr(gdn_kernels, "cpu_step_enabled", lambda t: False)
    assert tokens() == with_kernel
    assert len(kernel_calls) == gdn_layers * 11
