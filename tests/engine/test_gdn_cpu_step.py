"""The fused C step of Gated DeltaNet on the CPU (``engine.kernels.gdn_kernels.cpu_step``, ``clover_gdn_step`` in
``quant_cpu.c``) against the PyTorch rule (``engine.model.gdn.recurrent_gated_delta_rule``), and the float32 layer's
whole one-token mixer in C (``gdn_kernels.cpu_token``: ``clover_gdn_conv`` and ``clover_gdn_token``):

- the step alone, at a tiny width, at dk != dv and at the real width (32 heads of 128 x 128): the output and the
  updated state equal the rule's within float32 rounding; not in place, the state is left as it was;
- one GDN layer's AR step (random weights) through the C mixer and through the torch forward with the C step, at
  tiny widths (Hv = Hk, dk not a multiple of the vector width, dv = 1024 whose norm sums cascade) and at the real
  width (hidden 2048): the same output, state and conv state bit for bit, and a step that writes no cache leaves the
  cache as it was; with the torch rule instead of the C step, equal within float32 rounding;
- a tiny model's greedy AR generation takes the C mixer (counted) and decodes the same tokens as the rule;
- the layer's four input projections (and a shared expert's gate and up) in one C call over GGUF blocks of one type
  (``cpu_quant.qmatmul_many``) give the bits of one call each, at a tiny and at the real width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

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
from clover_desk.engine.weights.gguf import quants as gq
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
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names the C calls taken ("step", "token"; the real kernels still run)."""
    calls: list[str] = []

    def counted(name: str, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            calls.append(name)
            return real(*args)
        return call

    monkeypatch.setattr(cpu_quant, "gdn_step", counted("step", cpu_quant.gdn_step))
    monkeypatch.setattr(cpu_quant, "gdn_token", counted("token", cpu_quant.gdn_token))
    yield calls


REAL = {"hidden_size": 2048}  # the 35B-A3B text config's GDN: 16 k-heads, 32 v-heads of 128 x 128, conv kernel 4


def _layer(**shape: int) -> GatedDeltaNet:
    """A GDN layer of the 35B-A3B text config with ``shape``'s overrides, random weights."""
    config = parse_config({**clover_35b_a3b_text_config(layers=1, vocab_size=256), **shape,
                           "model_type": "qwen3_5_moe_text"})
    layer = GatedDeltaNet(config, 0, clover_extras=False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.5 if name in ("A_log", "dt_bias") else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
        layer.norm.weight.add_(1.0)
    return layer


def _ar_pass(pos: int, write_cache: bool) -> PassContext:
    return PassContext(start_pos=pos, length=1, block_size=None, cache=None, write_cache=write_cache,
                 cos=torch.zeros(1, 0), sin=torch.zeros(1, 0), attn_mask=None, attn_causal=False, coreset=False)


def _step(layer: GatedDeltaNet, write_cache: bool, seed: int = 4) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One AR step of ``layer`` from a random cache: (output, (conv state, recurrent state) after it)."""
    gen = torch.Generator().manual_seed(seed)
    st = (torch.randn(layer.kernel - 1, layer.conv_dim, generator=gen),
          torch.randn(layer.num_v_heads, layer.dk, layer.dv, generator=gen) * 0.1)
    x = torch.randn(1, layer.config.hidden_size, generator=gen)
    with torch.no_grad():
        return layer(x, _ar_pass(7, write_cache), st), st


@pytest.mark.parametrize("shape", [
    {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
     "linear_value_head_dim": 8},
    {"hidden_size": 48, "linear_num_key_heads": 3, "linear_num_value_heads": 3, "linear_key_head_dim": 24,
     "linear_value_head_dim": 40},
    {"hidden_size": 32, "linear_num_key_heads": 8, "linear_num_value_heads": 32, "linear_key_head_dim": 8,
     "linear_value_head_dim": 1024},
    REAL,
], ids=["tiny", "one-head-per-k-head", "wide-v", "real"])
def test_the_c_mixer_steps_as_the_torch_forward_bit_for_bit(
        shape: dict[str, int], monkeypatch: pytest.MonkeyPatch, kernel_calls: list[str]) -> None:
    layer = _layer(**shape)
    _, fresh = _step(layer, write_cache=False)
    out, after = _step(layer, write_cache=True)
    assert kernel_calls == ["token", "token"]
    assert not torch.equal(after[0], fresh[0]) and not torch.equal(after[1], fresh[1])  # both written

    real_ready, real_step = gdn_kernels.cpu_token_ready, gdn_kernels.cpu_step_enabled
    monkeypatch.setattr(gdn_kernels, "cpu_token_ready", lambda *a: False)
    want_out, want_after = _step(layer, write_cache=True)  # the torch forward, with the C step
    assert kernel_calls[2:] == ["step"]
    assert torch.equal(out, want_out)
    assert torch.equal(after[0], want_after[0]) and torch.equal(after[1], want_after[1])

    monkeypatch.setattr(gdn_kernels, "cpu_step_enabled", lambda t: False)  # the torch rule: equal within rounding
    rule_out, rule_after = _step(layer, write_cache=True)
    torch.testing.assert_close(out, rule_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after[1], rule_after[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(after[0], rule_after[0])

    monkeypatch.setattr(gdn_kernels, "cpu_token_ready", real_ready)  # a step that writes no cache leaves it alone
    monkeypatch.setattr(gdn_kernels, "cpu_step_enabled", real_step)
    again, kept = _step(layer, write_cache=False)
    assert kernel_calls[-1] == "token"
    assert torch.equal(again, out) and torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1])


def test_the_c_mixer_refuses_bad_shapes_in_one_line() -> None:
    state = torch.zeros(4, 16, 8)
    with pytest.raises(ValueError, match=r"gdn_token: act has 70 channels"):
        cpu_quant.gdn_token(torch.zeros(70), torch.zeros(32), torch.zeros(4), torch.zeros(4),
                            (torch.ones(8), 1e-6), state, None, 8)
    with pytest.raises(ValueError, match=r"gdn_token: zs must be 32 contiguous float32 values, got \(32,\) "
                                         r"torch.float64"):
        cpu_quant.gdn_token(torch.zeros(96), torch.zeros(32, dtype=torch.float64), torch.zeros(4), torch.zeros(4),
                            (torch.ones(8), 1e-6), state, None, 8)
    with pytest.raises(ValueError, match=r"gdn_conv: state must be 288 contiguous float32 values"):
        cpu_quant.gdn_conv(torch.zeros(96), torch.zeros(96, 4), torch.zeros(96, 3).t(), None)


def test_a_tiny_model_decodes_the_same_tokens_through_the_kernel(
        tiny_clover_dir: Path, one_torch_thread: None, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        kernel_calls: list[str]) -> None:
    engine = Engine.load(tiny_clover_dir, dtype=torch.float32)
    s = DecodeSettings(mode="ar", max_new_tokens=12, eos_token_ids=(), mask_token_id=engine.config.mask_token_id,
                       max_positions=512)
    prompt = [7, 21, 33, 40, 52, 11, 9]

    def tokens() -> tuple[int, ...]:
        done = [e for e in generate_ar(engine.model, prompt, s) if isinstance(e, Finished)]
        return done[-1].token_ids

    with_kernel = tokens()
    gdn_layers = sum(1 for t in engine.config.layer_types if t == "linear_attention")
    assert kernel_calls == ["token"] * gdn_layers * 11  # every AR step after the prefill, every GDN layer
    monkeypatch.setattr(gdn_kernels, "cpu_step_enabled", lambda t: False)
    assert tokens() == with_kernel
    assert len(kernel_calls) == gdn_layers * 11


@pytest.mark.parametrize("k,rows", [(256, (24, 8, 3)), (2048, (8192, 4096, 32, 32))], ids=["tiny", "real"])
def test_projections_of_one_input_in_one_call_give_the_bits_of_one_call_each(k: int, rows: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(k)
    mats = [gq.quantize(torch.randn(n, k, generator=gen) * 0.02, cpu_quant.Q4_K) for n in rows]
    layers = [SimpleNamespace(raw=m, qtype=cpu_quant.Q4_K, in_heads=None) for m in mats]
    x = torch.randn(1, k, generator=gen)
    blocks = cpu_quant.blocks_of(x, *layers)
    assert blocks is not None
    outs = cpu_quant.qmatmul_many(x, *blocks)
    for out, m in zip(outs, mats, strict=True):
        assert torch.equal(out, cpu_quant.qmatmul(x, m, cpu_quant.Q4_K))
    x3 = torch.randn(3, k, generator=gen)  # several rows (a prefill's shared expert) alike
    for out, m in zip(cpu_quant.qmatmul_many(x3, *blocks), mats, strict=True):
        assert torch.equal(out, cpu_quant.qmatmul(x3, m, cpu_quant.Q4_K))


def test_only_cpu_blocks_of_one_type_go_in_one_call() -> None:
    q4 = gq.quantize(torch.randn(8, 256) * 0.02, cpu_quant.Q4_K)
    q8 = gq.quantize(torch.randn(8, 256) * 0.02, cpu_quant.Q8_0)
    x = torch.randn(1, 256)
    layer = SimpleNamespace(raw=q4, qtype=cpu_quant.Q4_K, in_heads=None)
    assert cpu_quant.blocks_of(x, layer, SimpleNamespace(raw=q8, qtype=cpu_quant.Q8_0, in_heads=None)) is None
    assert cpu_quant.blocks_of(x, layer, torch.nn.Linear(256, 8)) is None  # a plain layer
    assert cpu_quant.blocks_of(x, layer, SimpleNamespace(raw=q4, qtype=cpu_quant.Q4_K, in_heads=(2, 4))) is None
    assert cpu_quant.blocks_of(x.to("meta"), layer) is None
