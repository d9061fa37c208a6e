"""The real-width bench's measuring parts on a tiny model (the bench itself needs ~20 GB of inputs and never runs in
CI): the bytes a step reads, the KL figures, the per-layer clock and a child's peak RSS."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures_tiny import tiny_clover_dir  # noqa: F401

from clover_desk.bench import real_width
from clover_desk.bench.real_width import LayerClock, interleaved, kl_stats, llama_cpp_for, model_bytes, type_mix
from clover_desk.engine.kernels import cpu_quant, cpu_token
from clover_desk.engine.weights.gguf.file import open_gguf
from clover_desk.engine.weights.gguf.model import load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.quant_cache import load_quantized
from clover_desk.engine.weights.tiny import make_tiny


@pytest.fixture(scope="module")
def q8_file(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return write_gguf(tiny_clover_dir, tmp_path_factory.mktemp("rw") / "tiny-Q8_0.gguf", "Q8_0", layout="fork")[0]


def test_step_bytes_match_the_files_header(q8_file: Path) -> None:
    model = load_gguf_model(q8_file).model
    sb = model_bytes(model)
    gf = open_gguf(q8_file)
    e, k = gf.config.num_experts, gf.config.num_experts_per_tok
    head = gf.tensors["output.weight"].nbytes
    experts = sum(t.nbytes for n, t in gf.tensors.items() if "_exps." in n)
    rest = sum(t.nbytes for n, t in gf.tensors.items()
               if n not in ("output.weight", "token_embd.weight") and "_exps." not in n)
    assert sb.head == head
    assert sum(sb.per_expert) * e == experts
    assert sb.ar(k) == head + rest + k * experts // e  # the embedding is a look-up: not counted
    assert sb.layer(0, 3) - sb.layer(0, 1) == 2 * sb.per_expert[0]
    assert type_mix(q8_file).startswith("Q8_0 ")


def test_kl_stats() -> None:
    base = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    assert kl_stats(base, base) == pytest.approx((0.0, 0.0, 1.0), abs=1e-12)
    other = torch.tensor([[math.log(3.0), 0.0], [1.0, 3.0]])  # row 0: q = (3/4, 1/4); row 1: the top token flips
    kl0 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    p1 = torch.softmax(base[1].double(), -1)
    q1 = torch.softmax(other[1].double(), -1)
    kl1 = float((p1 * (p1.log() - q1.log())).sum())
    mean, worst, agree = kl_stats(base, other)
    assert mean == pytest.approx((kl0 + kl1) / 2)
    assert worst == pytest.approx(max(kl0, kl1))
    assert agree == pytest.approx(0.5)


def test_layer_clock_times_every_layer_and_the_head(q8_file: Path) -> None:
    model = load_gguf_model(q8_file).model
    ids = torch.arange(5, 13)
    times = LayerClock(model).run(lambda: model.forward(ids, 0, model.new_cache(8)), 2)
    assert len(times) == len(model.layers) + 1
    assert all(0 < t < 10 for t in times)


@torch.no_grad()
def test_the_pass_tables_give_the_ar_step_as_it_runs(q8_file: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the per-layer rows (each layer's own forward, under hooks), the tables say what an AR step takes as it
    runs: unhooked, so with the CPU kernels its layers go as one C call (once to warm up, once per repeat)."""
    model = load_gguf_model(q8_file).model
    calls: list[str] = []
    real_function = cpu_token._function

    def counted(name: str = "clover_moe_token"):  # noqa: ANN202
        fn = real_function(name)
        return lambda *a: calls.append(name) or fn(*a)

    monkeypatch.setattr(cpu_token, "_function", counted)
    real_width._print_pass(model, model_bytes(model), list(range(5, 45)), 3, "engine, the file", alike=False)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "the AR step as it runs" in x)
    assert float(line.rsplit(":", 1)[1].split()[0]) > 0
    assert calls.count("clover_layers_token") == (1 + 3 if cpu_quant.available() else 0)


def test_a_child_reports_its_peak_rss(q8_file: Path, tiny_clover_dir: Path) -> None:  # noqa: F811
    if sys.platform == "win32":
        pytest.skip("peak RSS is POSIX")
    ballast = bytearray(1 << 30)  # a big parent: the child's figure must be its own peak, not inherited
    ballast[:: 1 << 12] = b"\x01" * len(range(0, 1 << 30, 1 << 12))
    out = subprocess.run([sys.executable, "-m", "clover_desk.bench.real_width", "--peak", "gguf", str(q8_file),
                          str(tiny_clover_dir), "8"], capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("peak_rss_bytes ")]
    assert line and 50 * 2**20 < int(line[0].split()[1]) < 0.9 * 2**30, out.stdout + out.stderr
    del ballast


def test_llama_cpp_is_left_out_below_four_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer than 4 real-width layers there is no full-attention layer and llama.cpp would abort the process."""
    fake = object()
    monkeypatch.setattr(real_width, "_llama_cpp", lambda: fake)
    said: list[str] = []
    assert llama_cpp_for(3, said.append) is None
    assert said and "--layers 3" in said[0] and ">= 4 layers" in said[0]
    said.clear()
    assert llama_cpp_for(4, said.append) is fake and not said


def test_spread_routing_draws_each_slot_s_experts(q8_file: Path) -> None:
    """The bench's second pass table: each token's k experts drawn at random (the same draw each call), as a trained
    router spreads a pass's distinct slots; identical masks on random weights route alike otherwise."""
    model = load_gguf_model(q8_file).model
    e, k = model.config.num_experts, model.config.num_experts_per_tok
    ids = torch.full((32,), 3)

    def run() -> torch.Tensor:
        return model.forward(ids, 0, model.new_cache(32))

    alike = real_width._distinct_experts(model, run)
    g = torch.Generator().manual_seed(32)
    drawn = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(32)])
    with real_width._spread_routing(model):
        spread = real_width._distinct_experts(model, run)
        assert torch.equal(run(), run())
    assert spread == [len(drawn.unique())] * len(model.layers)
    assert spread != alike
    assert real_width._distinct_experts(model, run) == alike  # the hooks are gone


def test_the_bench_counts_the_interleaved_expert_matrices(q8_file: Path, tmp_path: Path) -> None:
    if not cpu_quant.usable():
        pytest.skip(f"CPU kernels unavailable: {cpu_quant.reason()}")
    layers = open_gguf(q8_file).config.num_hidden_layers
    assert interleaved(load_gguf_model(q8_file).model) == (0, 3 * layers)  # Q8_0: never interleaved
    wide = make_tiny(tmp_path / "wide", seed=3, hidden=256, tokenizer_vocab=512)  # whole Q4_K blocks
    q4k = write_gguf(wide, tmp_path / "wide-Q4_K.gguf", "Q4_K", layout="fork")[0]
    n = open_gguf(q4k).config.num_hidden_layers
    assert interleaved(load_gguf_model(q4k).model) == (2 * n, 3 * n)  # gate and up; down is Q8_0 (32-wide rows)
    assert interleaved(load_quantized(wide, cache_root=tmp_path / "c1")[0]) == (0, 3 * n)  # 32-wide: no NF4 blocks
    nf4 = make_tiny(tmp_path / "nf4", seed=3, hidden=256, tokenizer_vocab=512, moe_intermediate=64)
    assert interleaved(load_quantized(nf4, cache_root=tmp_path / "c2")[0]) == (3 * n, 3 * n)  # the own cache's NF4
