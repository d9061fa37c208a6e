"""A Gated DeltaNet layer's block-mode mixer in one C call (``engine.kernels.cpu_block``, ``clover_gdn_block`` in
``quant_cpu.c``) against the layer's torch forward (the chunked rule, the history unit, the convolutions in torch):

- every Clover variant the config can name (history F1 / F2 / history-only, every ``bd_history`` shape, block-length
  and temperature calibration, the four right-tap orders and three joins, no extras at all), one value head per key
  head and two, in a 32-slot pass and in an 80-token block prefill (three chunks, the last one short): the output
  within float32 rounding, the recurrent state too when the pass writes it, the conv state exactly, and a pass that
  writes no cache leaves it as it was;
- a few of them through the portable scalar build (no AVX2) too, and the build for 16 vector registers gives the
  default build's bits;
- the same at Clover's real widths (hidden 2048, 32 value heads of 128), with a cache state of the size it has;
- where the call is not taken (a commit pass whose state must leave the right branch out, a forward that does not
  start on a block boundary, the switch off, heads wider than the kernel takes) the torch forward runs, counted;
- a causal prefill (no extras; the torch rule aligns its 32-token chunks to absolute positions, the call does not)
  from position 0 and from inside a chunk, within rounding of the torch rule;
- a tiny model's block pass takes it in every Gated DeltaNet layer and its logits equal the torch forward's within
  rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.engine.api import Engine
from clover_desk.engine.kernels import cpu_block, cpu_quant
from clover_desk.engine.model.cache import PassContext
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.model.gdn import GatedDeltaNet
from clover_desk.engine.weights.tiny import clover_35b_a3b_text_config

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler for the CPU kernels")

SMALL = {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 8}
ONE_PER_K = {"hidden_size": 48, "linear_num_key_heads": 3, "linear_num_value_heads": 3, "linear_key_head_dim": 24,
             "linear_value_head_dim": 40}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The C block calls taken (their token counts; the real kernel still runs)."""
    taken: list[int] = []
    real = cpu_block.gdn_block

    def counted(mixer: Any, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        taken.append(x.shape[0])
        return real(mixer, x, *rest)

    monkeypatch.setattr(cpu_block, "gdn_block", counted)
    yield taken


def _layer(extras: bool, history: tuple[int, ...] | None = None, bias: tuple[int, ...] | None = None,
           scale: tuple[int, ...] | None = None, right_taps: int = 4, **config: Any) -> GatedDeltaNet:
    """A GDN layer of the 35B-A3B text config with ``config``'s overrides, random weights; ``history`` /
    ``bias`` / ``scale``: the shapes of ``bd_history.weight`` / ``.bias`` / ``bd_logit_scale.weight``."""
    model_type = "clover_moe" if extras else "qwen3_5_moe_text"
    cfg = parse_config({**clover_35b_a3b_text_config(layers=1, vocab_size=256), **config, "model_type": model_type})
    layer = GatedDeltaNet(cfg, 0, clover_extras=extras)
    if extras:
        hv = cfg.linear_num_value_heads
        layer.bd_history.weight = torch.nn.Parameter(torch.empty(history or (hv, cfg.hidden_size)), False)
        layer.bd_history.bias = torch.nn.Parameter(torch.empty(bias or (hv,)), False)
        layer.bd_logit_scale.weight = torch.nn.Parameter(torch.empty(scale or (hv,)), False)
        layer.conv1d.weight_right = torch.nn.Parameter(torch.empty(layer.conv_dim, right_taps), False)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            sd = 0.5 if name in ("A_log", "dt_bias") else 1.0 if "bd_" in name else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * sd)
        layer.norm.weight.add_(1.0)
    return layer


def _forward(layer: GatedDeltaNet, tokens: int, write_cache: bool, cached: bool = True, start: int = 64,
             block: int | None = 32) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """One forward of ``tokens`` rows from a random cache (or none), in block mode (``block`` None: causal):
    (output, the cache after it)."""
    gen = torch.Generator().manual_seed(5)
    st = (torch.randn(layer.kernel - 1, layer.conv_dim, generator=gen),
          torch.randn(layer.num_v_heads, layer.dk, layer.dv, generator=gen) * 0.3)
    x = torch.randn(tokens, layer.config.hidden_size, generator=gen)
    p = PassContext(start_pos=start, length=tokens, block_size=block, cache=None, write_cache=write_cache,
                    cos=torch.zeros(tokens, 0), sin=torch.zeros(tokens, 0), attn_mask=None, attn_causal=False,
                    coreset=False)
    with torch.no_grad():
        return layer(x, p, st if cached else None), st if cached else None


def _both(layer: GatedDeltaNet, tokens: int, write_cache: bool, **how: Any) -> tuple[Any, Any]:
    """(the C call's (output, cache), the torch forward's)."""
    before = cpu_block.set_enabled(False)
    try:
        want = _forward(layer, tokens, write_cache, **how)
    finally:
        cpu_block.set_enabled(before)
    return _forward(layer, tokens, write_cache, **how), want


VARIANTS = {
    "no-extras": dict(extras=False, **SMALL),
    "F1-from-input": dict(extras=True, **SMALL),
    "F1-shared-input-logit": dict(extras=True, history=(1, 64), bias=(1,), scale=(1,), **SMALL),
    "F1-from-q": dict(extras=True, history=(4, 16), **SMALL),
    "F1-from-read": dict(extras=True, history=(4, 8), bd_history_input="r", **SMALL),
    "F2-constant-R3-C": dict(extras=True, history=(4,), bd_history_form="F2", bd_right_conv_taps="R3",
                             bd_right_conv_join="C", **SMALL),
    "temperature-R2-B": dict(extras=True, bd_logit_scale_mode="temperature", bd_right_conv_taps="R2",
                             bd_right_conv_join="B", right_taps=3, **SMALL),
    "tokens-R4": dict(extras=True, bd_len_mode="tokens", bd_right_conv_taps="R4", **SMALL),
    "history-only": dict(extras=True, bd_history_form="history_only", **SMALL),
    "one-v-head-per-k-head": dict(extras=True, **ONE_PER_K),
}


@pytest.mark.parametrize("tokens", [32, 80], ids=["pass", "prefill-3-chunks"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_c_block_mixer_equals_the_torch_forward(variant: str, tokens: int, calls: list[int]) -> None:
    layer = _layer(**VARIANTS[variant])
    (out, after), (want, want_after) = _both(layer, tokens, write_cache=True)
    assert calls == [tokens]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(after[0], want_after[0])  # the conv state: the last raw rows, copied
    torch.testing.assert_close(after[1], want_after[1], rtol=1e-5, atol=1e-6)

    (kept_out, kept), (_, fresh) = _both(layer, tokens, write_cache=False)
    torch.testing.assert_close(kept_out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kept[0], fresh[0]) and torch.equal(kept[1], fresh[1])  # a pass that writes nothing

    (bare, _), (want_bare, _) = _both(layer, tokens, write_cache=False, cached=False)  # no cache: zero states
    torch.testing.assert_close(bare, want_bare, rtol=1e-5, atol=1e-5)
    assert calls == [tokens] * 3


@pytest.mark.parametrize("variant", ["F1-from-read", "F2-constant-R3-C", "one-v-head-per-k-head"])
def test_the_portable_scalar_build_equals_the_torch_forward_too(variant: str, calls: list[int]) -> None:
    """The library without AVX2 (the prebuilt x86-64 variant, ``cpu_quant.set_scalar``): its own loops and ``expf``."""
    layer = _layer(**VARIANTS[variant])
    before = cpu_quant.set_scalar(True)
    try:
        assert not cpu_quant.kernels().simd
        (out, after), (want, want_after) = _both(layer, 80, write_cache=True)
    finally:
        cpu_quant.set_scalar(before)
    assert calls == [80]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[1], want_after[1], rtol=1e-5, atol=1e-6)


def test_the_build_for_16_vector_registers_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2 or AVX-VNNI CPU has 16 vector registers: the products' tiles are half as wide there, each sum in the
    same order (``CLOVER_16_REGS`` on this AVX-512 build compiles that sizing)."""
    default = cpu_quant.kernels()
    if default.isa != "AVX2 + AVX-512 VNNI":
        pytest.skip(f"needs an AVX-512 build to compare against, the kernels here are {default.isa}")
    small = cpu_quant.Kernels(defines=("CLOVER_16_REGS",))
    assert small.ok and "-DCLOVER_16_REGS" in small.flags
    layer = _layer(**VARIANTS["F1-from-read"])
    want, want_after = _forward(layer, 80, write_cache=True)
    monkeypatch.setattr(cpu_quant, "kernels", lambda: small)
    out, after = _forward(layer, 80, write_cache=True)
    assert torch.equal(out, want) and torch.equal(after[1], want_after[1])


def test_the_c_block_mixer_at_the_real_width(calls: list[int]) -> None:
    layer = _layer(extras=True)  # hidden 2048, 16 k-heads, 32 v-heads of 128, 8,192 conv channels
    (out, after), (want, want_after) = _both(layer, 32, write_cache=True)
    assert calls == [32]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after[1], want_after[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(after[0], want_after[0])


@pytest.mark.parametrize("start", [0, 45], ids=["from-0", "inside-a-chunk"])
@pytest.mark.parametrize("variant", ["no-extras", "F1-from-input", "one-v-head-per-k-head"])
def test_a_causal_prefill_takes_it_too(variant: str, start: int, calls: list[int]) -> None:
    layer = _layer(**VARIANTS[variant])
    (out, after), (want, want_after) = _both(layer, 80, write_cache=True, start=start, block=None)
    assert calls == [80]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(after[0], want_after[0])
    torch.testing.assert_close(after[1], want_after[1], rtol=1e-5, atol=1e-6)
    _forward(layer, 1, write_cache=False, block=None)  # one token: the AR step's own calls
    assert calls == [80]


def test_where_the_call_is_not_taken_the_torch_forward_runs(calls: list[int]) -> None:
    outside = _layer(extras=True, bd_right_conv_in_state=False, **SMALL)
    _forward(outside, 32, write_cache=True)  # the commit pass's state needs the conv outputs without the right branch
    assert calls == []
    _forward(outside, 32, write_cache=False)  # a denoising pass writes no state: taken
    assert calls == [32]
    layer = _layer(extras=True, **SMALL)
    _forward(layer, 16, write_cache=False, start=48)  # not on a block boundary
    assert calls == [32]
    before = cpu_block.set_enabled(False)
    try:
        _forward(layer, 32, write_cache=False)
    finally:
        cpu_block.set_enabled(before)
    assert calls == [32]
    wide = _layer(extras=False, hidden_size=32, linear_num_key_heads=1, linear_num_value_heads=1,
                  linear_key_head_dim=8, linear_value_head_dim=1032)  # past the kernel's head width
    _forward(wide, 32, write_cache=False)
    assert calls == [32]


def test_a_tiny_models_block_pass_takes_it_in_every_gdn_layer(
        tiny_clover_dir: Path, one_torch_thread: None, calls: list[int]) -> None:  # noqa: F811
    model = Engine.load(tiny_clover_dir, dtype=torch.float32).model
    block = model.config.block_size or 32
    prompt = torch.arange(5, 5 + 2 * block)
    masks = torch.full((block,), model.config.mask_token_id)

    def logits() -> torch.Tensor:
        cache = model.new_cache(3 * block)
        with torch.no_grad():
            model.forward(prompt, 0, cache, block_size=block)
            return model.forward(masks, 2 * block, cache, block_size=block, write_cache=False)

    got = logits()
    gdn_layers = sum(1 for t in model.config.layer_types if t == "linear_attention")
    assert calls == [2 * block] * gdn_layers + [block] * gdn_layers
    before = cpu_block.set_enabled(False)
    try:
        want = logits()
    finally:
        cpu_block.set_enabled(before)
    assert len(calls) == 2 * gdn_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
