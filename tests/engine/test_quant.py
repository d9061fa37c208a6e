"""Quantization formats, the policy table, and the module swap (engine/weights/quant.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from clover_desk.engine.model.experts import DenseExpertBank
from clover_desk.engine.weights.formats import CPU_POLICY, CPU_Q6_DENSE_POLICY, policy_for
from clover_desk.engine.weights.quant import (
    DEFAULT_POLICY,
    NF4_CODE,
    ExpertLayout,
    QuantExpertBank,
    QuantLinear,
    applied_formats,
    dequantize_int8,
    dequantize_int8_reference,
    dequantize_nf4,
    dequantize_nf4_reference,
    dequantize_tensor,
    error_bound,
    make_policy,
    quantize_int8,
    quantize_model_,
    quantize_nf4,
    quantize_tensor,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels_off")


@pytest.mark.parametrize("shape", [(8, 128), (8, 96), (3, 50), (64, 64, 2), (1000,)])
def test_nf4_reference_dequantize_is_bit_exact_with_bitsandbytes(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.02
    codes, absmax = quantize_nf4(w, 64)
    fast = dequantize_nf4(codes, absmax, shape, 64, torch.float32)
    ref = dequantize_nf4_reference(codes, absmax, shape, 64)
    assert fast.shape == w.shape
    assert torch.equal(fast, ref)
    # every dequantized value is a code value times its block's absmax
    blocks = torch.arange(w.numel()) // 64
    ratio = ref.reshape(-1) / absmax[blocks]
    table = torch.tensor(NF4_CODE)
    assert torch.allclose((ratio[:, None] - table[None]).abs().amin(dim=1), torch.zeros(w.numel()), atol=1e-6)


def test_nf4_packing_puts_the_first_element_in_the_high_nibble() -> None:
    w = torch.zeros(64)
    w[0], w[1] = -1.0, 1.0  # codes 0 and 15
    codes, absmax = quantize_nf4(w, 64)
    assert codes[0].item() == 0x0F
    assert absmax[0].item() == 1.0


def test_nf4_bf16_dequantize_matches_reference_rounded() -> None:
    torch.manual_seed(1)
    w = torch.randn(16, 256)
    codes, absmax = quantize_nf4(w, 64)
    fast = dequantize_nf4(codes, absmax, (16, 256), 64, torch.bfloat16)
    ref = dequantize_nf4_reference(codes, absmax, (16, 256), 64, torch.float32)
    assert fast.dtype == torch.bfloat16
    assert torch.allclose(fast.float(), ref, rtol=2**-7, atol=0)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quantization_error_is_within_the_format_bound(fmt: str) -> None:
    torch.manual_seed(2)
    w = torch.randn(48, 192) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different scale
    codes, scales = quantize_tensor(w, fmt, 64)
    back = dequantize_tensor(codes, scales, tuple(w.shape), fmt, 64, torch.float32)
    err = (back - w).abs()
    bound = error_bound(w, fmt, 64)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert err.max().item() > 0  # it did quantize
    # a wrong bound (a quarter of it) would be violated: the check can fail
    assert not bool((err <= bound / 4).all())


def test_q6_k_round_trip_is_llama_cpps_format_within_its_step() -> None:
    """q6_k codes are ggml Q6_K blocks [O, N / 256 * 210]: gguf-py's reference dequantize (numpy, independent of
    the engine) reads them to the values the engine's dequantize gives, bit for bit, and each value lies within
    ~one step (1/32 of its 256-block's absmax) of the weight; a 4x tighter bound fails, so the check can."""
    torch.manual_seed(3)
    w = torch.randn(40, 512) * torch.logspace(-1, 0, 40)[:, None]  # rows of different scale (fp16 d stays normal)
    codes, scales = quantize_tensor(w, "q6_k")
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (40, 2 * 210) and scales.numel() == 0
    back = dequantize_tensor(codes, scales, (40, 512), "q6_k", 64, torch.float32)
    ref = gguf.quants.dequantize(codes.numpy(), gguf.GGMLQuantizationType.Q6_K)
    assert np.array_equal(back.numpy(), ref.reshape(40, 512))
    assert torch.equal(dequantize_tensor(codes, scales, (40, 512), "q6_k", 64, reference=True), back)
    bound = w.reshape(-1, 256).abs().amax(-1, keepdim=True).expand(-1, 256).reshape(40, 512) / 32 * 1.15
    err = (back - w).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    assert not bool((err <= bound / 4).all())
    with pytest.raises(ValueError, match="256"):
        quantize_tensor(torch.randn(4, 96), "q6_k")


def test_q6_k_quant_linear_without_the_kernels_dequantizes_in_row_chunks() -> None:
    """The path a GPU (or a CPU without the kernels) runs for a q6_k QuantLinear: the blocks dequantized with the
    GGUF path's torch dequantize in row chunks, then F.linear: equal to the whole weight's product."""
    torch.manual_seed(8)
    lin = nn.Linear(256, 37, bias=True)
    q = QuantLinear.from_linear(lin, "q6_k")
    assert tuple(q.codes.shape) == (37, 210) and q.scales.numel() == 0
    x = torch.randn(3, 256)
    whole = q(x)
    torch.testing.assert_close(whole, nn.functional.linear(x, q.weight, lin.bias), rtol=1e-6, atol=1e-6)
    q.chunk_elems = 5 * 256
    assert q._chunk_rows() == 5
    torch.testing.assert_close(q(x), whole, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert 0 < float((whole - lin(x)).abs().max()) < 0.05


def test_the_cpu_default_policy_keeps_the_head_in_q6_k_and_gpus_keep_int8() -> None:
    from clover_desk.engine.errors import ConfigError

    assert policy_for("cpu").format_of("lm_head.weight", (248320, 2048)) == "q6_k"
    assert policy_for(torch.device("cpu")).hash == policy_for("cpu").hash != DEFAULT_POLICY.hash
    assert policy_for("cuda:0") is DEFAULT_POLICY
    assert DEFAULT_POLICY.format_of("lm_head.weight", (248320, 2048)) == "int8"
    # rows that are not whole Q6_K blocks (the tiny models' heads) fall back to int8
    assert policy_for("cpu").format_of("lm_head.weight", (128, 64)) == "int8"
    # everything else is the GPU policy's
    p = "model.language_model.layers.3."
    for name in (f"{p}mlp.experts.gate_up_proj", f"{p}self_attn.q_proj.weight", f"{p}mlp.gate.weight"):
        assert policy_for("cpu").format_of(name, (512, 2048)) == DEFAULT_POLICY.format_of(name, (512, 2048))
    with pytest.raises(ConfigError, match="expert format"):
        make_policy(experts="q6_k")
    with pytest.raises(ValueError, match="expert format"):
        ExpertLayout.build(4, 256, 256, "q6_k")


def test_the_q6_k_dense_policy_puts_every_projection_in_q6_k_where_rows_are_whole_blocks() -> None:
    """``CPU_Q6_DENSE_POLICY``: the CPU default plus the attention, Gated DeltaNet and shared-expert projections in
    Q6_K at Clover's real widths; rows that are not whole 256-value blocks stay INT8; experts, the router and the
    GDN a / b inputs are the CPU default's."""
    p = "model.language_model.layers.3."
    real = {  # Clover-35B-A3B's shapes
        f"{p}self_attn.q_proj.weight": (8192, 2048), f"{p}self_attn.o_proj.weight": (2048, 4096),
        f"{p}linear_attn.in_proj_qkv.weight": (8192, 2048), f"{p}linear_attn.in_proj_z.weight": (4096, 2048),
        f"{p}linear_attn.out_proj.weight": (2048, 4096), f"{p}mlp.shared_expert.down_proj.weight": (2048, 512),
        f"{p}mlp.shared_expert.gate_proj.weight": (512, 2048), "lm_head.weight": (248320, 2048),
    }
    for name, shape in real.items():
        assert CPU_Q6_DENSE_POLICY.format_of(name, shape) == "q6_k", name
    assert CPU_Q6_DENSE_POLICY.format_of(f"{p}mlp.shared_expert.down_proj.weight", (64, 32)) == "int8"
    assert CPU_Q6_DENSE_POLICY.format_of(f"{p}self_attn.o_proj.weight", (2048, 4096 + 64)) == "int8"
    for name, shape in ((f"{p}mlp.experts.gate_up_proj", (256, 1024, 2048)), (f"{p}mlp.gate.weight", (256, 2048)),
                        (f"{p}linear_attn.in_proj_a.weight", (32, 2048))):
        assert CPU_Q6_DENSE_POLICY.format_of(name, shape) == CPU_POLICY.format_of(name, shape), name
    assert len({CPU_Q6_DENSE_POLICY.hash, CPU_POLICY.hash, DEFAULT_POLICY.hash}) == 3  # each its own cache folder


def test_int8_reference_and_fast_dequantize_agree() -> None:
    torch.manual_seed(3)
    w = torch.randn(7, 33)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (7,)
    assert int(q.abs().max()) == 127
    assert torch.equal(dequantize_int8(q, s, (7, 33), torch.float32), dequantize_int8_reference(q, s, (7, 33)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_dequantize_rounds_once_and_writes_only_its_result(dtype: torch.dtype) -> None:
    """Bit for bit the widen-to-fp32, multiply, cast form, in one op that writes only the result (no fp32 copy)."""
    from clover_desk.bench.count import _forward_ops

    torch.manual_seed(4)
    q, s = quantize_int8(torch.randn(64, 96))
    widened = (q.to(torch.float32) * s.view(-1, 1)).to(dtype)
    assert torch.equal(dequantize_int8(q, s, (64, 96), dtype), widened)
    count = _forward_ops(lambda: dequantize_int8(q, s, (64, 96), dtype))
    assert count["written"] == 64 * 96 * widened.element_size() and count["ops"] <= 3, count


def test_int8_zero_row_is_exact() -> None:
    w = torch.zeros(2, 8)
    q, s = quantize_int8(w)
    assert torch.equal(dequantize_int8(q, s, (2, 8), torch.float32), w)


def test_policy_table_formats_for_real_tensor_names() -> None:
    pol = make_policy(attention="int8", shared_expert="nf4", lm_head="int8")
    p = "model.language_model.layers.3."
    cases = {
        f"{p}mlp.experts.gate_up_proj": "nf4",
        f"{p}mlp.experts.down_proj": "nf4",
        f"{p}mlp.experts.17.up_proj.weight": "nf4",
        f"{p}mlp.gate.weight": "keep",
        f"{p}mlp.shared_expert.gate_proj.weight": "nf4",
        f"{p}mlp.shared_expert_gate.weight": "keep",
        f"{p}linear_attn.in_proj_qkv.weight": "int8",
        f"{p}linear_attn.out_proj.weight": "int8",
        f"{p}linear_attn.in_proj_a.weight": "keep",
        f"{p}linear_attn.A_log": "keep",
        f"{p}linear_attn.dt_bias": "keep",
        f"{p}linear_attn.conv1d.weight": "keep",
        f"{p}linear_attn.conv1d.weight_right": "keep",
        f"{p}linear_attn.ssm_bd_history.weight": "keep",
        f"{p}linear_attn.norm.weight": "keep",
        f"{p}self_attn.q_proj.weight": "int8",
        f"{p}self_attn.q_norm.weight": "keep",
        f"{p}input_layernorm.weight": "keep",
        "lm_head.weight": "int8",
        "model.language_model.embed_tokens.weight": "keep",
    }
    for name, fmt in cases.items():
        assert pol.format_of(name, (64, 64)) == fmt, name
    assert pol.placement_of("model.language_model.embed_tokens.weight") == "host"
    assert pol.format_of(f"{p}self_attn.q_proj.weight", (64,)) == "keep"  # 1-D never quantized
    assert make_policy(attention="nf4").hash != pol.hash
    assert type(pol).from_dict(pol.to_dict()).hash == pol.hash


def test_policy_rejects_unknown_format() -> None:
    from clover_desk.engine.errors import ConfigError
    from clover_desk.engine.weights.quant import QuantPolicy, Rule

    with pytest.raises(ConfigError, match="int3"):
        QuantPolicy("bad", (Rule("x", "int3"),))


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quant_linear_keeps_the_linear_interface(fmt: str) -> None:
    torch.manual_seed(4)
    lin = nn.Linear(128, 64, bias=True)
    q = QuantLinear.from_linear(lin, fmt)
    assert (q.in_features, q.out_features) == (128, 64)
    x = torch.randn(5, 128)
    expect = nn.functional.linear(x, q.weight, lin.bias)
    assert torch.allclose(q(x), expect, atol=1e-6)
    err = (q(x) - lin(x)).abs().max().item()
    bound = (x.abs().sum(dim=1).max() * error_bound(lin.weight.data, fmt).max()).item()
    assert 0 < err <= bound
    assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_expert_layout_matches_the_35b_byte_count() -> None:
    lay = ExpertLayout.build(256, 2048, 512, "nf4", 64)
    assert lay.nbytes == 1_769_472  # 1.57 MB codes + 0.20 MB fp32 absmax
    lay8 = ExpertLayout.build(4, 64, 32, "int8")
    assert lay8.nbytes >= 3 * 64 * 32 + (64 + 64) * 4
    assert type(lay).from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_quant_expert_bank_equals_dense_bank_on_dequantized_weights(fmt: str) -> None:
    torch.manual_seed(5)
    e, d, i = 6, 64, 32
    dense = DenseExpertBank(e, d, i)
    dense.gate_up_proj.data.normal_(0, 0.05)
    dense.down_proj.data.normal_(0, 0.05)
    qbank = QuantExpertBank.from_dense(dense.gate_up_proj.data, dense.down_proj.data, fmt)
    assert qbank.packed.shape == (e, qbank.layout.nbytes)
    deq = DenseExpertBank(e, d, i)
    for k in range(e):
        gu, dn = qbank.layout.unpack(qbank.packed[k], torch.float32)
        gu_ref, dn_ref = qbank.layout.unpack(qbank.packed[k], torch.float32, reference=True)
        assert torch.equal(gu, gu_ref) and torch.equal(dn, dn_ref)
        deq.gate_up_proj.data[k] = gu
        deq.down_proj.data[k] = dn
    x = torch.randn(9, d)
    idx = torch.randint(0, e, (9, 2))
    w = torch.softmax(torch.randn(9, 2), -1)
    assert torch.equal(qbank(x, idx, w), deq(x, idx, w))
    full = dense(x, idx, w)
    rel = ((qbank(x, idx, w) - full).norm() / full.norm()).item()
    assert 0 < rel < {"nf4": 0.2, "int8": 0.02}[fmt]  # relative error of a 4-bit / 8-bit SwiGLU MLP


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        blk = nn.Module()
        blk.self_attn = nn.Module()
        blk.self_attn.q_proj = nn.Linear(64, 64, bias=False)
        blk.mlp = nn.Module()
        blk.mlp.gate = nn.Linear(64, 4, bias=False)
        blk.mlp.experts = DenseExpertBank(4, 64, 32)
        blk.mlp.experts.gate_up_proj.data.normal_()
        blk.mlp.experts.down_proj.data.normal_()
        blk.input_layernorm = nn.LayerNorm(64)
        self.layers.append(blk)
        self.lm_head = nn.Linear(64, 10, bias=False)


def test_module_swap_applies_the_policy_and_reads_back() -> None:
    torch.manual_seed(6)
    model = _Tiny()
    pol = make_policy(attention="int8", lm_head="nf4")
    applied = quantize_model_(model, pol)
    formats = applied_formats(model)
    for name, fmt in formats.items():
        expect = pol.format_of(name, (64, 64))
        if expect == "keep":
            assert fmt in ("fp32", "bf16"), name
        else:
            assert fmt == expect, name
    assert formats["layers.0.self_attn.q_proj.weight"] == "int8"
    assert formats["layers.0.mlp.experts.gate_up_proj"] == "nf4"
    assert formats["layers.0.mlp.gate.weight"] == "fp32"
    assert formats["lm_head.weight"] == "nf4"
    assert set(applied) == {n for n, f in formats.items() if f in ("nf4", "int8")}
    assert isinstance(model.layers[0].mlp.experts, QuantExpertBank)
    assert DEFAULT_POLICY.format_of("lm_head.weight", (10, 64)) == "int8"


@pytest.mark.parametrize("fmt,n_in", [("nf4", 96), ("nf4", 128), ("int8", 50)])
def test_quant_linear_dequantizes_big_weights_in_row_chunks(fmt: str, n_in: int) -> None:
    torch.manual_seed(7)
    lin = nn.Linear(n_in, 37, bias=True)
    q = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(3, n_in)
    whole = q(x)
    q.chunk_elems = 5 * n_in  # a few rows at a time (NF4: whole blocks only)
    assert q._chunk_rows() < q.out_features
    chunked = q(x)
    assert torch.allclose(chunked, whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(q.dequantized(rows=(0, q._chunk_rows())), q.weight[: q._chunk_rows()])


def test_nf4_dequantize_works_in_a_fresh_process() -> None:
    """A process that only reads an existing cache never called quantize: the bitsandbytes ops must still load."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from clover_desk.engine.weights.quant import dequantize_nf4\n"
        "codes = torch.full((32,), 0x7F, dtype=torch.uint8); absmax = torch.ones(1)\n"
        "out = dequantize_nf4(codes, absmax, (64,), 64, torch.float32)\n"
        "print(out.shape[0], float(out.abs().max()))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    n, top = res.stdout.split()[-2:]
    assert int(n) == 64 and float(top) == 1.0  # NF4 code 15 (0xF) is +1.0, code 7 is 0.0 -> max |value| is absmax


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_int8_gemv_matches_the_reference_dequantize_and_matmul(
    rows: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clover_desk.engine.weights import quant
    from clover_desk.engine.weights.quant import QuantLinear, dequantize_tensor

    gen = torch.Generator().manual_seed(5)
    layer = QuantLinear.from_linear(nn.Linear(96, 200, bias=True), "int8")
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    assert quant._int8_gemv_applies(layer, x)  # the fused kernel runs for these shapes
    w = dequantize_tensor(layer.codes, layer.scales, (200, 96), "int8", 64, torch.float32, reference=True)
    want = x.float() @ w.T + layer.bias.float()
    got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 summation order; bf16 output rounding (8 bits)
    assert got.dtype == dtype and (got.float() - want).abs().max() <= tol * want.abs().max()
    monkeypatch.setattr(quant, "INT8_GEMV_MAX_ROWS", 0)  # the dequantize-then-matmul path: same numbers
    assert not quant._int8_gemv_applies(layer, x)
    assert (layer(x).float() - got.float()).abs().max() <= tol * want.abs().max()


def test_bitsandbytes_kernel_warning_we_cannot_use_is_not_shown() -> None:
    """The first NF4 use imports bitsandbytes, whose CPU backend warns that its optional gemm_4bit kernel is missing;
    the engine never calls gemm_4bit, so the line is dropped (only that one: the logger's other records pass)."""
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(); import torch; from clover_desk.engine.weights.quant import quantize_nf4; "
            "quantize_nf4(torch.randn(128)); logging.getLogger('bitsandbytes.backends.cpu.ops').warning('other')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gemm_4bit_forward" not in res.stderr and "other" in res.stderr, res.stderr


def test_bench_line_of_torchs_int8_matmul_times_it_and_reports_its_difference() -> None:
    """``bench speed --moe-only``'s third LM-head candidate on a GPU, run here on the CPU (where the op exists): a
    time and the difference from the module's own path, which is float rounding; a device or dtype the op refuses
    is named, not a traceback."""
    import re

    from clover_desk.bench.moe_only import _torch_int8pack_line
    from clover_desk.engine.weights.quant import QuantLinear

    head = QuantLinear.from_linear(nn.Linear(256, 300, bias=False), "int8")  # an LM head: no bias
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    line = _torch_int8pack_line(head, x, 2, "cpu")
    found = re.fullmatch(r"torch\._weight_int8pack_mm +([0-9.]+) ms \(codes +[0-9.]+ GB/s\), max \|diff\| (\S+)", line)
    assert found, line
    assert float(found[1]) > 0 and float(found[2]) <= 1e-4 * head(x).abs().max().item()
    refused = _torch_int8pack_line(head, x.to(torch.float64), 1, "cpu")  # a dtype the op does not take
    assert refused.startswith("torch._weight_int8pack_mm: not run here ("), refused


def test_fused_int8_gemv_leaves_greedy_tokens_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from clover_desk.engine.decode.generate import generate
    from clover_desk.engine.decode.settings import DecodeSettings
    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.weights import quant
    from clover_desk.engine.weights.checkpoint import random_state_dict
    from clover_desk.engine.weights.quant import make_policy, quantize_model_
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    text = tiny_text_config(vocab_size=128, layers=4, hidden=64, experts=16, experts_per_tok=4)
    cfg = parse_config(config_dict_for("clover_moe", text, {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}))
    model = CloverModel(cfg)
    model.load_state_dict(random_state_dict(cfg, seed=7))
    quantize_model_(model, make_policy())
    s = DecodeSettings(mode="ar", max_new_tokens=24, mask_token_id=3, eos_token_ids=(), max_positions=128)

    def tokens() -> tuple[int, ...]:
        return list(generate(model, [5, 17, 33, 9], s))[-1].token_ids

    fused = tokens()
    monkeypatch.setattr(quant, "INT8_GEMV_MAX_ROWS", 0)
    assert tokens() == fused and len(fused) == 24


def test_nf4_dequantize_runs_inside_an_inductor_graph() -> None:
    """torch.compile plans the op's output by its fake, which follows the shape asked; the CPU kernel returned
    [1, numel] for a flat shape, so every compiled NF4 forward failed there (a one-row shape now, same blocks)."""
    from clover_desk.engine.weights.quant import dequantize_nf4, quantize_nf4

    w = torch.randn(6, 40)  # 240 values: 3 blocks of 64 and a partial one
    codes, absmax = quantize_nf4(w, 64)
    want = dequantize_nf4(codes, absmax, (6, 40), 64, torch.float32)
    assert (want - w).abs().max() < 0.5 * w.abs().max()
    torch._dynamo.reset()
    compiled = torch.compile(lambda c, a: dequantize_nf4(c, a, (6, 40), 64, torch.float32) * 2, fullgraph=True)
    assert torch.equal(compiled(codes, absmax), want * 2)
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_compiled_block_pass_dequantizes_each_used_expert_once(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled 32-slot pass gathers one expert per pair only where that is a plain gather (dense banks): from
    quantized rows each pair would dequantize its own copy, 256 experts for a pass whose block routes to a few
    (measured on the deep-narrow shape, NF4 experts: compiled passes 2.6x slower than eager before). Here 32 tokens
    x top-8 over 12 used experts: every expert the compiled pass dequantizes is a distinct used one, and its output
    equals the eager pass's."""
    torch.manual_seed(7)
    e, d, i, t, k = 24, 64, 32, 32, 8
    dense = DenseExpertBank(e, d, i)
    dense.gate_up_proj.data.normal_(0, 0.05)
    dense.down_proj.data.normal_(0, 0.05)
    qbank = QuantExpertBank.from_dense(dense.gate_up_proj.data, dense.down_proj.data, fmt)
    used = torch.randperm(e)[:12]
    idx = torch.stack([used[torch.randperm(12)[:k]] for _ in range(t)])  # [T, K] distinct experts per token
    x, w = torch.randn(t, d), torch.softmax(torch.randn(t, k), -1)
    want = qbank(x, idx, w)

    asked: list[int] = []
    unpack = type(qbank.layout).unpack_rows

    def counting(self, source, rows, dtype):  # type: ignore[no-untyped-def]
        asked.append(int(rows.shape[0]))  # traced: the pairs' count; run eagerly: one group's used experts
        return unpack(self, source, rows, dtype)

    monkeypatch.setattr(type(qbank.layout), "unpack_rows", counting)
    torch._dynamo.reset()
    try:
        got = torch.compile(qbank, backend="eager", dynamic=False)(x, idx, w)
    finally:
        torch._dynamo.reset()
    assert asked and sum(asked) == 12, asked  # not t * k = 256
    torch.testing.assert_close(got, want, rtol=0, atol=0)
