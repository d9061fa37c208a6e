"""``clover-desk bench speed --count``: the torch ops, host reads and bytes one forward dispatches, per decoder layer
(the planner's launch figures, engine.placement.speed.Roofline, come from this count at the 35B shape)."""

from __future__ import annotations

import re

import pytest
import torch

from clover_desk.bench.count import _forward_ops
from clover_desk.cli import main as cli

pytestmark = pytest.mark.usefixtures("cpu_kernels_off")


def test_the_count_sees_ops_reads_and_the_bytes_each_op_writes() -> None:
    buf = torch.zeros(1000, 10)
    src = torch.ones(2, 10)
    idx = torch.tensor([3, 7])
    lin = torch.nn.Linear(10, 4)

    def forward() -> None:
        buf.index_copy_(0, idx, src)  # writes 2 rows, not the buffer
        y = lin(buf[:5])  # a view, then one linear: [5, 4]
        int(y.sum())  # host reads: int(), bool(), and .cpu() (which a CPU tensor never dispatches)
        bool(y.any())
        idx.cpu()

    c = _forward_ops(forward, [lin])
    assert c["reads"] == 3 and c["outside_reads"] == 3 and c["layer_reads"] == [0]
    # index_copy_ (2 x 10 floats), linear's [5, 4], sum's scalar (4 bytes), any's (1 byte); the reads return numbers
    assert c["written"] == (2 * 10 + 5 * 4 + 1) * 4 + 1
    assert c["layer_written"] == [5 * 4 * 4] and c["outside_written"] == (2 * 10 + 1) * 4 + 1
    assert c["ops"] == c["outside_ops"] + sum(c["layer_ops"]) and c["layer_ops"][0] >= 1


def test_bench_count_splits_a_forward_by_layer_kind(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["bench", "speed", "--shape", "tiny", "--count", "--quant", "card"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "quant card" in out
    for name in (r"AR step \(1 token\)", r"denoising pass \(32 slots\)", r"prompt forward \(128 tokens, block mode\)"):
        head = re.search(name + r": (\d+) ops, (\d+) host reads, ([\d.]+) MB written", out)
        assert head, out
        ops, reads = int(head[1]), int(head[2])
        # an AR step reads nothing back; a pass or a prompt (64 and 256 pairs: grouped by expert) reads each MoE
        # layer's group sizes once (the eager grouped compute; the fused kernels and grouped mm need none)
        assert reads == (0 if name.startswith("AR") else 4), (name, reads)
        part = re.split(r"\n(?=\S)", out[head.end():])[0]  # up to the next forward's line
        kinds = re.findall(r"per (\w+) layer \(mean of (\d+)\):\s+(\d+) ops", part)
        assert {k for k, _, _ in kinds} == {"linear_attention", "full_attention"}, part
        outside = int(re.search(r"outside the layers .*?: (\d+) ops", part)[1])
        # the tiny shape is built whole, so the layers and the rest add up to the forward
        assert sum(int(n) * int(o) for _, n, o in kinds) + outside == ops
        assert int(re.search(r"at the full 4 layers: ~(\d+) ops", part)[1]) == ops
        assert re.search(r"scratch: [\d.]+ MiB at once \(largest then, MiB: \w+ \(", part), part
    # the planner's workspace holds what the forwards measured (engine.placement.planner.workspace, at its prefill segment)
    seg = re.search(r"prefill segment \((\d+) tokens after ([\d,]+) in the cache, block mode\)", out)
    assert seg and int(seg[1]) + int(seg[2].replace(",", "")) == 16384, out
    for what in ("denoising pass", "prefill segment"):
        line = re.search(what + r".*?: ([\d.]+) MiB measured, ([\d.]+) MiB planned", out)
        assert line and 0 < float(line[1]) <= float(line[2]), (what, out)


def test_the_plan_holds_an_unquantized_models_gathered_experts(capsys: pytest.CaptureFixture[str]) -> None:
    """Unquantized routed experts are gathered (one expert per pair in an AR step, a group by expert in a pass): the
    planner counts them (engine.placement.planner's gather_experts), and the bench plans the model it measures, experts
    included, in its own dtype. Before, an unquantized model's manifest had no experts: a mid-shape denoising pass
    measured 15.0 MiB of scratch against 2.6 MiB planned. Its prefill segment, where the padded by-expert layout of
    a chunk's 16,384 pairs over small experts is the layer's peak (engine.placement.planner._moe_scratch), measured 339.1 MiB
    against 280.0 planned before the planner counted that layout."""
    code = cli.main(["bench", "speed", "--shape", "mid", "--layers", "1", "--count"])
    out = capsys.readouterr().out
    assert code == 0, out
    line = re.search(r"denoising pass: ([\d.]+) MiB measured, ([\d.]+) MiB planned", out)
    assert line and 10 < float(line[1]) <= float(line[2]), out
    line = re.search(r"prefill segment \(2048 tokens\): ([\d.]+) MiB measured, ([\d.]+) MiB planned", out)
    assert line and 200 < float(line[1]) <= float(line[2]), out


def test_bench_count_says_what_cuda_graphs_leave_to_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    """Each piece of a pass, as a GPU cuts it, counted on its own: nothing reads the host inside the graphs; an AR
    step leaves one fetch (one host read) per streamed layer; a dequantizing pass an eager bank per layer; with the
    fused kernel a pass leaves only the fetches."""
    code = cli.main(["bench", "speed", "--shape", "tiny", "--count", "--quant", "card", "--stream", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 of 4 layers streamed, ~2 of 4 at full depth" in out
    line = r"    {}: (\d+) graphs \((\d+) ops recorded, (\d+) host reads in them.*?\); eager: (.*); at full depth ~(\d+) " \
           r"graph launches \+ ~(\d+) eager ops, ~(\d+) host reads"
    ar = re.search(line.format("AR step"), out)
    deq = re.search(line.format("32-slot pass, dequantizing experts"), out)
    fused = re.search(line.format("32-slot pass, fused MoE kernel"), out)
    assert ar and deq and fused, out
    assert (ar[1], ar[3], ar[5], ar[7]) == ("3", "0", "3", "2") and re.fullmatch(r"2 fetches x \d+ ops, 1.0 host reads", ar[4])
    assert (deq[1], deq[3], deq[5], deq[7]) == ("5", "0", "5", "6")  # resident banks read once, streamed twice
    assert re.fullmatch(r"4 banks x \d+ ops, 1.5 host reads", deq[4])
    assert (fused[1], fused[5], fused[7]) == ("3", "3", "2") and fused[4].startswith("2 fetches x ")
    assert 0 < int(ar[6]) < int(ar[2])  # the eager ops are a small part of the step


def test_bench_count_with_device_tables_leaves_an_ar_step_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """--device-pool: the AR step is one graph with nothing eager and no host read, and so is a block pass with the
    fused MoE kernel (the dequantizing one is still cut at every bank); the count says what the device tables add
    per streamed layer of each."""
    code = cli.main(["bench", "speed", "--shape", "tiny", "--count", "--quant", "card", "--stream", "2", "--device-pool"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "device slot tables: on" in out
    ar = re.search(r"    AR step: (\d+) graphs \((\d+) ops recorded, (\d+) host reads in them\); eager: nothing; at full "
                   r"depth ~1 graph launches \+ ~0 eager ops, ~0 host reads", out)
    assert ar and (ar[1], ar[3]) == ("1", "0"), out
    deq = re.search(r"    32-slot pass, dequantizing experts: 5 graphs .*; eager: 4 banks x \d+ ops", out)
    assert deq, out
    fused = re.search(r"    32-slot pass, fused MoE kernel: 1 graphs .*; eager: nothing; at full depth ~1 graph launches "
                      r"\+ ~0 eager ops, ~0 host reads", out)
    assert fused, out
    for what in ("an AR step", "a block pass"):
        tables = re.search(rf"device slot tables, per streamed layer of {what}: fetch tensor ops .* (\d+) ops.*; the "
                           r"next layer's prefetch .* (\d+) ops: (\d+) launches, 0 host reads", out)
        assert tables and int(tables[3]) == int(tables[1]) + int(tables[2]) > 0, (what, out)


def test_a_cpu_count_can_dispatch_as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU an expert group is one expert named by a host read of its id (cheap there, not what a GPU runs):
    the count sees those reads, and counted as on a GPU (the card's group size, no CPU int8 GEMV) there are none."""
    from clover_desk.bench.random_model import _build_random_model, _config, _dispatch_as_on_a_gpu
    from clover_desk.engine.model import experts
    from clover_desk.engine.weights import quant

    _, config = _config("tiny", "clover_moe")
    model = _build_random_model(config, torch.float32, "cpu", 0, "card")
    monkeypatch.setitem(experts.GROUP_BYTES, "cpu", 1)  # one expert per group, as the 35B shape gets on the CPU
    cache = model.new_cache(64)
    with torch.inference_mode():
        model.forward(torch.arange(16, 48), 0, cache, block_size=32, write_cache=True, prefill=True)

    def step() -> None:
        model.forward(torch.tensor([20]), 32, cache, block_size=None, write_cache=False)

    on_cpu = _forward_ops(step, model.layers)
    assert on_cpu["reads"] == 4 * config.num_experts_per_tok  # one per routed expert, in each of the 4 layers
    with _dispatch_as_on_a_gpu():
        as_gpu = _forward_ops(step, model.layers)
        assert quant.INT8_GEMV_MAX_ROWS == 0
    assert as_gpu["reads"] == 0
    assert experts.GROUP_BYTES["cpu"] == 1 and quant.INT8_GEMV_MAX_ROWS > 0  # restored


def test_bench_speed_runs_the_placed_path(capsys: pytest.CaptureFixture[str]) -> None:
    """--quant card --stream N: the experts of the last N layers streamed through a slot pool (the path a 16 GB card
    takes, --vram-gb there), the figures of that path and its traffic; bad combinations refused in one line."""
    code = cli.main(["bench", "speed", "--shape", "tiny", "--quant", "card", "--stream", "1", "--repeats", "1",
                     "--decode-tokens", "8", "--diffusion-tokens", "32", "--prompt-tokens", "40"])
    out = capsys.readouterr().out
    assert code == 0, out
    # the pool holds at least one whole layer's 8 experts (2 tokens' worth of one layer would be 4: refused)
    assert "placed: 3 resident / 1 streamed expert layers, slot pool of 8 experts" in out
    per_token = r"([\d,]+) KiB host-to-device, ([\d.]+) slot misses, ([\d.]+) host reads per token"
    streamed = re.search(rf"streamed experts: AR {per_token}; diffusion {per_token}, slot hit rate ([\d.]+)%", out)
    assert streamed, out
    assert 0 < float(streamed[7]) <= 100
    # one read per forward of the streamed layer: the prefill and 7 steps for 8 tokens; a pass per committed token
    # or fewer, plus the commit passes, plus the passes that fill slots past the budget (they compete for commits so
    # that a shorter budget only cuts the text: 1.6 here)
    assert float(streamed[3]) == 1.0 and 1.0 <= float(streamed[6]) < 2.0
    assert re.search(r"diffusion at 3 committed tokens per pass .*: [\d.]+ tok/s", out)
    code = cli.main(["bench", "speed", "--shape", "tiny", "--quant", "card", "--stream", "1", "--repeats", "1",
                     "--decode-tokens", "8", "--diffusion-tokens", "32", "--prompt-tokens", "40", "--device-pool"])
    out = capsys.readouterr().out
    assert code == 0 and "device slot tables: on" in out, out
    streamed = re.search(rf"streamed experts: AR {per_token}; diffusion {per_token}", out)
    assert streamed and float(streamed[3]) < 1.0, out  # AR: the prompts read the host, the steps do not
    for bad, why in ((["--stream", "2"], "add --quant card"), (["--quant", "card", "--stream", "9"], "allowed: 1..4"),
                     (["--device-pool"], "add --vram-gb G or --stream N"),
                     (["--quant", "card", "--vram-gb", "8"], "plans the clover-35b-a3b shape")):
        code = cli.main(["bench", "speed", "--shape", "tiny", *bad])
        err = capsys.readouterr().err
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1, (bad, err)


def test_the_implied_launch_cost_is_the_time_above_the_bound_per_op() -> None:
    """What a GPU run of the card's path gives the planner's one assumption (Roofline.launch_us): 20 tok/s against a
    bound of 100 tok/s over 4,000 ops is (50 ms - 10 ms) / 4,000 = 10 us."""
    from clover_desk.bench.timing import _launch_cost_line

    line = _launch_cost_line(100.0, {"ar_decode_tok_s": 20.0, "ar_step_ops": 4000})
    assert line.startswith("implied cost of one eager launch: 10.0 us = (1 / 20.0 tok/s - 1 / 100 tok/s"), line
    assert "/ 4000 ops per AR step" in line


def test_the_peak_vram_line_sets_what_torch_held_against_what_the_plan_counted() -> None:
    """gpu_check's card_path prints it: the plan's total less the CUDA context (which torch's allocator never sees)
    is what the allocator may reserve; a GPU run says whether the planner's workspace holds."""
    from clover_desk.bench.timing import _peak_vram_line
    from clover_desk.engine.placement.planner import CUDA_CONTEXT_BYTES, plan_model

    plan = plan_model("shape:clover-35b-a3b", 16 * 2**30, 4096)
    counted = plan.vram_used_bytes - CUDA_CONTEXT_BYTES
    line = _peak_vram_line(counted // 2, counted // 4 * 3, plan)
    assert line.startswith("peak GPU memory (torch): ") and "reserved is 75% of that" in line, line
    assert f"the plan counts {counted / 2**30:.2f} GiB" in line
    assert _peak_vram_line(2**30, 2**31, None) == "peak GPU memory (torch): 1.00 GiB allocated, 2.00 GiB reserved"


def test_the_group_sweep_times_each_group_size_and_puts_group_bytes_back() -> None:
    """--moe-only's sweep: the dequantize-then-matmul pass at 4, 8 and 16 experts per group (what a GPU run picks
    engine.model.experts.GROUP_BYTES by), the module's setting as it was afterwards."""
    from clover_desk.bench.moe_only import _group_sweep_line, _moe_routing, _random_nf4_bank
    from clover_desk.engine.model import experts

    gen = torch.Generator().manual_seed(0)
    e, k, d, i = 32, 4, 64, 64
    bank = _random_nf4_bank(e, d, i, gen)
    idx, w = _moe_routing(16, k, e, 24, gen)
    x = torch.randn(16, d, generator=gen)
    before = dict(experts.GROUP_BYTES)
    line = _group_sweep_line(bank, x, idx, w, 1, "cpu", torch.float32, d, i)
    assert experts.GROUP_BYTES == before
    got = re.match(r"T=16  nf4 dequantized in groups of 4 / 8 / 16 experts: ([\d.]+) / ([\d.]+) / ([\d.]+) ms/layer "
                   r"\(fastest: (\d+); GROUP_BYTES\['cpu'\] holds (\d+) now\)$", line)
    assert got, line
    times = [float(got[n]) for n in (1, 2, 3)]
    # the named fastest has the smallest time as printed (two timings can round to the same figure)
    assert all(t > 0 for t in times) and times[(4, 8, 16).index(int(got[4]))] == min(times)
    assert int(got[5]) == max(1, before["cpu"] // (3 * d * i * 4))


def test_the_zero_copy_line_times_a_streamed_ar_step_four_ways() -> None:
    """--moe-only's AR step of one streamed layer: through a k-slot pool (fresh routing every step, so nearly every
    expert misses), through device slot tables (a 2k-slot pool), in place (zero-copy) and resident, the device tables'
    and in-place outputs equal to the resident one. On the CPU the "mapping" is the host rows themselves."""
    from clover_desk.bench.moe_only import ZERO_COPY_STEPS, _random_nf4_bank, _zero_copy_line

    gen = torch.Generator().manual_seed(0)
    e, k, d, i = 32, 4, 64, 64
    bank = _random_nf4_bank(e, d, i, gen)
    x = torch.randn(1, d, generator=gen)
    line = _zero_copy_line(bank, x, k, 1, "cpu", gen)
    got = re.match(r"T=1   nf4 streamed layer, AR step: through the pool +([\d.]+) ms \(([\d.]+) of 4 experts "
                   r"missing: +([\d.]+) GB/s of rows\) \| device tables +([\d.]+) ms \(([\d.]+) of 4 missing: +([\d.]+) "
                   r"GB/s of rows, no host read\), max \|diff\| ([\d.e+-]+) \| in place \(zero-copy\) +([\d.]+) ms "
                   r"\( *([\d.]+) GB/s of rows, +([\d.]+)x the pool's speed\), max \|diff\| ([\d.e+-]+) \| resident "
                   r"+([\d.]+) ms$", line)
    assert got, line
    # device tables in a pool of 8 (2k): ~1 of the 4 drawn was among the 8 kept; their output is the resident one
    assert 2.0 < float(got[5]) <= 4.0 and float(got[4]) > 0 and float(got[7]) == 0.0
    # each step draws 4 of 32 experts; the pool holds the 4 of the step before: ~0.5 of them hit
    assert 2.0 < float(got[2]) <= 4.0
    assert float(got[11]) == 0.0  # the same bytes, the same gather: the same numbers
    assert ZERO_COPY_STEPS >= 8


def test_the_bnb_gemv_path_reads_each_experts_matrices_from_its_row() -> None:
    """--moe-only's bitsandbytes GEMV line: per expert, gate_up and down addressed in the NF4 row (codes and absmax
    segments, shapes [2I, D] and [D, I]). On the CPU bitsandbytes' own GEMV reads a repacked layout, so the
    addressing is checked with a reference GEMV (dequantize the segment, then multiply): the engine's output."""
    from clover_desk.bench.moe_only import _bnb_gemv_line, _moe_routing, _random_nf4_bank, bnb_gemv_moe
    from clover_desk.engine.weights.quant import dequantize_nf4_reference

    gen = torch.Generator().manual_seed(0)
    e, k, d, i = 32, 4, 64, 96
    bank = _random_nf4_bank(e, d, i, gen)
    idx, w = _moe_routing(1, k, e, 16, gen)
    x = torch.randn(1, d, generator=gen)

    def reference_gemv(a: torch.Tensor, codes: torch.Tensor, shape: list[int], absmax: torch.Tensor,
                       code: torch.Tensor, blocksize: int) -> torch.Tensor:
        assert code.shape == (16,)
        return a @ dequantize_nf4_reference(codes, absmax, tuple(shape), blocksize).T

    got = bnb_gemv_moe(bank, x, idx, w, gemv=reference_gemv)
    want = bank(x, idx, w)
    assert want.abs().max() > 0 and (got - want).abs().max() < 1e-5 * want.abs().max() * 10
    assert _bnb_gemv_line(bank, x, idx, w, 1, "cpu").endswith("not run (CUDA only: on the CPU bitsandbytes' GEMV "
                                                               "reads a layout of its own)")


FUSED_LINE_CHILD = r'''
import torch
from clover_desk.bench.moe_only import FUSED_WARPS, _fused_line, _moe_routing, _random_nf4_bank
from clover_desk.engine.kernels import cpu_quant, triton_moe

cpu_quant.set_enabled(False)  # the line's reference is the grouped dequantize-then-matmul path, not the CPU kernels
gen = torch.Generator().manual_seed(0)
bank = _random_nf4_bank(16, 64, 64, gen)
before = dict(triton_moe.NUM_WARPS)
for t in (1, 16):  # 8 pairs: per pair; 64: grouped
    idx, w = _moe_routing(t, 4 if t > 1 else 8, 16, 12, gen)
    x = torch.randn(t, 64, generator=gen)
    _fused_line("nf4", bank, x, idx, w, 1, "cpu", t, int(torch.unique(idx).numel()))
assert triton_moe.NUM_WARPS == before, triton_moe.NUM_WARPS
assert FUSED_WARPS == (4, 8)
'''


def test_the_fused_line_times_each_warp_count_and_puts_num_warps_back() -> None:
    """--moe-only's fused lines on a GPU time the kernels at 4 and 8 warps per program (what the GPU run picks
    engine.kernels.triton_moe.NUM_WARPS by); run here through Triton's interpreter, which ignores the warp count."""
    pytest.importorskip("triton")
    from tests.triton_child import run_interpreted

    out = run_interpreted(FUSED_LINE_CHILD, expect_ok=False)
    lines = [line for line in out.splitlines() if line.startswith("T=")]
    assert len(lines) == 2, out
    for line, kind, label in zip(lines, ("pair", "grouped"), ("per pair", "grouped tl.dot")):
        got = re.match(rf"T=\d+ +nf4 fused \(Triton, {label}\) distinct experts +\d+: +([\d.]+) ms/layer \(([\d.]+) at 4 "
                       rf"warps, ([\d.]+) at 8 warps; NUM_WARPS\['{kind}'\] is (\d)\), max \|diff\| vs grouped "
                       r"([\d.e+-]+)$", line)
        assert got, line
        assert float(got[5]) < 1e-4  # the fused kernel's output against the grouped dequantize-then-matmul
        assert got[1] == (got[2] if got[4] == "4" else got[3])
