"""CPU experts (issue 30, item 5): streamed layers' routed experts computed on the CPU from their host rows, as
llama.cpp's --n-cpu-moe does, per mode ("ar" steps, diffusion "pass"es) as the planner's speed model chooses.

On this CPU-only machine the "device" is the CPU too, so these tests check what does not need a GPU: the tokens never
change, the CPU path neither fetches nor reads the host for its modes (so a GPU's forward would only send the layer's
input and output), graphs are cut around it on a GPU device, the plan carries the choice and the planner makes it
from the hardware figures. The GPU's speed is unmeasured here (no device machine was lent)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from clover_desk.cli import main as cli
from clover_desk.engine.errors import PlanError
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.placement import offload_runtime, placer, streamed_bank
from clover_desk.engine.placement.hardware import Hardware
from clover_desk.engine.placement.manifest import manifest_for_shape
from clover_desk.engine.placement.placer import SimplePlan, apply_plan
from clover_desk.engine.placement.planner import CPU_EXPERT_MODES, Plan, make_plan
from clover_desk.engine.placement.speed import Roofline
from tests.helpers_model import one_thread
from tests.offload_model import (
    EXPERTS,
    ar_steps_counting_host_reads,
    assert_fetched_nothing,
    quantized_model,
    tokens,
)

GIB = 1024**3
STREAMED = (1, 2, 3)
PLAN = SimplePlan((0,), STREAMED, 4 * EXPERTS)


_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)  # tiny matmuls: one thread is fastest


@pytest.fixture(scope="module")
def qmodel() -> CloverModel:
    return quantized_model()


def placed(qmodel: CloverModel, modes: list[str]) -> CloverModel:
    model = copy.deepcopy(qmodel)
    apply_plan(model, PLAN, "cpu", cpu_experts=modes)
    return model


@pytest.mark.parametrize("mode,n", [("ar", 12), ("diffusion", 32)])
@pytest.mark.parametrize("modes", [["ar"], ["pass"], ["ar", "pass"]])
def test_cpu_experts_never_change_the_tokens(qmodel: CloverModel, mode: str, n: int, modes: list[str]) -> None:
    reference = tokens(qmodel, mode, n)
    model = placed(qmodel, modes)
    assert tokens(model, mode, n) == reference
    acc = offload_runtime.accounting(model)
    assert acc["cpu_experts"] == sorted(modes)
    used = ("ar" in modes and mode == "ar") or ("pass" in modes and mode == "diffusion")
    assert (acc["host_computes"] > 0) == used, acc["host_computes"]
    if mode == "diffusion" and "pass" in modes:  # a block's passes compute on the CPU: only the prompt fetched
        assert acc["blocks"] >= 1 and acc["passes_per_block"] > 1
        assert acc["host_computes"] >= len(STREAMED) * acc["passes"] - len(STREAMED) * 2


def test_cpu_ar_steps_neither_fetch_nor_read_the_host(qmodel: CloverModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AR step's streamed layers compute from the host rows: no host read of the experts, no copy, no pool slot; a
    prompt's forward still fetches through the pool; turned off, the step fetches again."""
    model = placed(qmodel, ["ar"])
    cache = model.new_cache(32)
    model(torch.arange(5, 12), 0, cache)  # a 7-token prompt: through the pool
    prompt = offload_runtime.accounting(model)
    assert prompt["host_reads"] == len(STREAMED) and prompt["slot_misses"] > 0 and prompt["host_computes"] == 0
    reads = ar_steps_counting_host_reads(model, cache, range(7, 10), monkeypatch)
    after = offload_runtime.accounting(model)
    assert reads == []  # on a CPU device nothing crosses; on a GPU only the layer's input and output would
    assert_fetched_nothing(prompt, after)
    assert after["host_computes"] == 3 * len(STREAMED)
    placer.set_cpu_experts(model, [])
    model(torch.tensor([10]), 10, cache)
    assert offload_runtime.accounting(model)["host_reads"] == prompt["host_reads"] + len(STREAMED)


def test_a_gpu_forward_cuts_its_graphs_around_cpu_experts(qmodel: CloverModel) -> None:
    """On a CUDA device a CPU-expert layer reads the host (its input and output cross): never recorded in a graph;
    on the CPU it is the same compute as a resident bank's. (The device is only named: no GPU is needed.)"""
    model = placed(qmodel, ["ar"])
    bank = model.layers[STREAMED[0]].mlp.experts
    assert isinstance(bank, streamed_bank.StreamedExpertBank)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    k = model.config.num_experts_per_tok
    assert bank.computes_on_host(k) and not bank.fetches(k)
    assert not bank.compute_sync_free(k, gpu, torch.bfloat16) and not bank.sync_free(k, gpu, torch.bfloat16)
    assert bank.compute_sync_free(k, cpu, torch.float32) == streamed_bank.rows_sync_free(k, cpu, bank.layout)
    assert not bank.computes_on_host(7 * k)  # a prompt streams
    assert not bank.computes_on_host(k, in_block=True)  # "pass" not chosen: a block's passes stream
    placer.set_cpu_experts(model, ["pass"])
    assert bank.computes_on_host(k, in_block=True) and not bank.computes_on_host(k, in_block=False)


def test_the_plan_carries_the_choice_to_the_placement(qmodel: CloverModel) -> None:
    plan = make_plan(manifest_for_shape("clover-35b-a3b"), 16 * GIB, 16384, cpu_experts="always")
    assert plan.cpu_experts == list(CPU_EXPERT_MODES)
    again = Plan.from_dict(plan.to_dict())
    assert again.cpu_experts == plan.cpu_experts
    old = plan.to_dict()
    del old["cpu_experts"]  # a plan written before the field: nothing on the CPU
    assert Plan.from_dict(old).cpu_experts == []
    with pytest.raises(PlanError, match="cpu_experts"):
        Plan.from_dict({**plan.to_dict(), "cpu_experts": ["gpu"]})
    model = copy.deepcopy(qmodel)
    # a plan's own choice (SimplePlan has no field: none) and the placement's argument over it
    assert offload_runtime.runtime_of(model) is None
    rt = apply_plan(model, PLAN, "cpu")
    assert rt.cpu_experts == frozenset()
    placer.set_cpu_experts(model, ["ar"])
    assert rt.cpu_experts == {"ar"}
    with pytest.raises(PlanError, match="unknown"):
        placer.set_cpu_experts(model, ["prefill"])


def _hardware(pcie_gbps: float) -> Hardware:
    return Hardware(gpu_name="RTX 4070 Ti SUPER", vram_total_bytes=16 * GIB, pcie_gbps=pcie_gbps, vram_gbps=672.0,
                    ram_total_bytes=64 * GIB, ram_available_bytes=56 * GIB)


def test_the_speed_model_chooses_per_mode() -> None:
    """A slow link (PCIe 3.0 x4, ~3 GB/s) and a fast CPU: AR steps compute their streamed experts on the CPU, as
    llama.cpp's --n-cpu-moe would; a fast link (PCIe 5.0 x16) and a slow CPU: everything streams. A block pass
    multiplies 32 tokens per expert: on a slow CPU it streams even where AR steps do not."""
    shape = manifest_for_shape("clover-35b-a3b")
    slow_link = make_plan(shape, 16 * GIB, 16384, hardware=_hardware(3.0),
                          roofline=Roofline(cpu_expert_gbps=40.0, cpu_gflops=400.0))
    assert slow_link.streamed_expert_layers and "ar" in slow_link.cpu_experts
    tok = slow_link.predicted_tok_s
    assert tok["ar_cpu_experts"] > tok["ar"]
    fast_link = make_plan(shape, 16 * GIB, 16384, hardware=_hardware(50.0),
                          roofline=Roofline(cpu_expert_gbps=5.0, cpu_gflops=50.0))
    assert fast_link.cpu_experts == []
    assert fast_link.predicted_tok_s["ar_cpu_experts"] < fast_link.predicted_tok_s["ar"]
    assert fast_link.predicted_tok_s["diffusion_cpu_experts"] < fast_link.predicted_tok_s["diffusion"]
    never = make_plan(shape, 16 * GIB, 16384, hardware=_hardware(3.0), cpu_experts="never",
                      roofline=Roofline(cpu_expert_gbps=40.0, cpu_gflops=400.0))
    assert never.cpu_experts == [] and never.streamed_expert_layers == slow_link.streamed_expert_layers
    everything = make_plan(shape, 64 * GIB, 16384, hardware=_hardware(3.0), cpu_experts="always")
    assert everything.streamed_expert_layers == [] and everything.cpu_experts == []  # nothing streamed: nothing to do
    with pytest.raises(PlanError, match="cpu_experts must be one of"):
        make_plan(shape, 16 * GIB, 16384, cpu_experts="sometimes")


def test_more_cpu_bandwidth_never_predicts_a_slower_cpu_path() -> None:
    shape = manifest_for_shape("clover-35b-a3b")
    figures = [make_plan(shape, 16 * GIB, 16384, hardware=_hardware(25.0),
                         roofline=Roofline(cpu_expert_gbps=g, cpu_gflops=10 * g)).predicted_tok_s
               for g in (5.0, 20.0, 80.0)]
    ar = [f["ar_cpu_experts"] for f in figures]
    passes = [f["diffusion_cpu_experts"] for f in figures]
    assert ar == sorted(ar) and ar[0] < ar[-1] and passes == sorted(passes) and passes[0] < passes[-1]
    assert len({f["ar"] for f in figures}) == 1  # the streamed figures do not depend on the CPU's



def test_plan_prints_the_choice_and_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "16", "--ram-gb", "48", "--cpu-experts",
                     "always"]) == 0
    out = capsys.readouterr().out
    assert "experts on the CPU (as llama.cpp's --n-cpu-moe): AR steps and diffusion passes" in out
    assert cli.main(["plan", "--shape", "clover-35b-a3b", "--vram-gb", "16", "--ram-gb", "48", "--cpu-experts",
                     "never", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_experts"] == []
    with pytest.raises(SystemExit) as bad:
        cli.main(["plan", "--shape", "clover-35b-a3b", "--cpu-experts", "sometimes"])
    assert bad.value.code == 2 and "--cpu-experts: invalid choice" in capsys.readouterr().err
