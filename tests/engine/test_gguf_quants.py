"""GGUF block formats: the torch dequantize equals ``gguf.quants.dequantize`` bit for bit on random blocks, and the
K-format writer produces blocks the ``gguf`` package reads back close to the input."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from clover_desk.engine.weights.gguf import quants as gq

QUANT_TYPES = (gq.Q8_0, gq.Q4_0, gq.Q4_K, gq.Q5_K, gq.Q6_K)
# byte offsets of the fp16 scale fields in one block (random bytes there could be NaN / inf, which never compare)
_F16_FIELDS = {gq.Q8_0: (0,), gq.Q4_0: (0,), gq.Q4_K: (0, 2), gq.Q5_K: (0, 2), gq.Q6_K: (208,)}


def _random_blocks(qtype: int, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes in every field (quants, packed 6-bit scales, high bits), finite fp16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = gq.BLOCK[qtype][1]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    for off in _F16_FIELDS[qtype]:
        scale = (rng.normal(size=blocks.shape[0]) * rng.choice([1e-3, 1.0, 30.0], size=blocks.shape[0]))
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: gq.TYPE_NAMES[q])
def test_dequantize_matches_the_gguf_package_bit_for_bit(qtype: int) -> None:
    for seed in range(3):
        raw = _random_blocks(qtype, rows=5, blocks_per_row=3, seed=seed)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        got = gq.dequantize(torch.from_numpy(raw.copy()), qtype).numpy()
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), gq.TYPE_NAMES[qtype]


@pytest.mark.parametrize("qtype", (gq.F32, gq.F16, gq.BF16), ids=lambda q: gq.TYPE_NAMES[q])
def test_float_types_match_the_gguf_package(qtype: int) -> None:
    x = torch.randn(4, 96) * 10
    if qtype == gq.BF16:
        raw = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.BF16)  # the package's own BF16 rounding
    else:
        raw = x.numpy().astype(np.float32 if qtype == gq.F32 else np.float16).view(np.uint8)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    got = gq.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), qtype).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: gq.TYPE_NAMES[q])
def test_writer_blocks_read_back_with_the_gguf_package(qtype: int) -> None:
    """quantize() writes valid blocks: the package decodes them to within the format's step of the input, and to
    exactly what our dequantize gives."""
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(6, 512, generator=gen) * torch.rand(6, 1, generator=gen) * 4  # rows of different scale
    x[2] = 0.0  # an all-zero row: scales 0, no division by zero
    raw = gq.quantize(x, qtype)
    assert raw.shape == (6, gq.row_bytes(qtype, 512))
    back = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype)))
    assert torch.equal(back, gq.dequantize(raw, qtype))
    assert torch.equal(back[2], torch.zeros(512))
    levels = {gq.Q8_0: 254, gq.Q4_0: 15, gq.Q4_K: 15, gq.Q5_K: 31, gq.Q6_K: 63}[qtype]
    span = x.abs().amax(dim=1, keepdim=True) * 2  # each (sub-)block spans at most the row's range
    # half a step of the block's grid, plus the 6-bit rounding of the sub-block scales in the K formats
    slack = 2.0 if qtype in (gq.Q4_K, gq.Q5_K, gq.Q6_K) else 0.6
    assert ((back - x).abs() <= span / levels * slack + 1e-6).all()
    # and it is a real fit, not noise
    assert (back - x).abs().mean() < x.abs().mean() / 4


def test_row_bytes_and_bad_rows() -> None:
    assert gq.row_bytes(gq.Q4_K, 2048) == 8 * 144
    assert gq.row_bytes(gq.Q8_0, 64) == 2 * 34
    with pytest.raises(ValueError, match="multiple of 256"):
        gq.row_bytes(gq.Q6_K, 64)
    with pytest.raises(ValueError, match="not supported"):
        gq.dequantize(torch.zeros(4, dtype=torch.uint8), 6)  # Q5_0
