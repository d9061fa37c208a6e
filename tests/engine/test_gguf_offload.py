"""A GGUF model under a VRAM plan: planned from the file's header, placed as planned (resident layers keep their
GGUF expert banks on the device, streamed layers' experts stay in host rows and stream through the slot pool), one
streamed expert moving exactly its bytes in the file, and the same tokens whatever the plan streams.

Tiny models from clover_desk.engine.weights.tiny.make_tiny written as GGUF (fork layout) with engine.weights.gguf.writer; hidden 256 so that the
gate / up banks hold whole Q4_K blocks (the down bank's 32-wide rows fall back to Q8_0: a mixed-type expert row).
The CPU is the device.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from fixtures_tiny import one_torch_thread  # noqa: F401

from clover_desk.engine.api import Engine, plan_for
from clover_desk.engine.decode.events import Finished, GenerationParams, LoadProgress
from clover_desk.engine.errors import CancelledError, ConfigError, PlanError
from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware, probe_hardware
from clover_desk.engine.placement.offload_runtime import runtime_of
from clover_desk.engine.placement.streamed_bank import StreamedExpertBank
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, GGUFExpertLayout, load_gguf_model
from clover_desk.engine.weights.gguf.quants import Q4_0, Q4_K, Q6_K
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
CTX = 128
TYPES = ("Q8_0", "Q4_0", "Q4_K")
PROMPT = [5, 9, 14, 3, 22, 17, 40]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def machine() -> Hardware:
    """This machine as probed, with 16 GiB of free RAM (the plans must not depend on what is free right now)."""
    return dataclasses.replace(probe_hardware(), ram_available_bytes=16 * GIB)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("gguf-offload") / "wide", seed=3, hidden=256, tokenizer_vocab=512)


@pytest.fixture(scope="module")
def files(wide_dir: Path) -> dict[str, Path]:
    return {q: write_gguf(wide_dir, wide_dir.parent / f"wide-{q}.gguf", q, layout="fork")[0] for q in TYPES}


def plans_for(path: Path) -> dict[str, planner.Plan]:
    """Plans over a range of budgets: every layer resident, one layer resident, every layer streamed (the
    minimum). Compute in fp32, as the CPU loads run."""
    hw = machine()
    facts = planner.model_facts(planner.model_manifest(path), "fp32")
    floor = planner.plan_model(path, 0, CTX, hw, compute_dtype="fp32").min_vram_bytes
    assert floor
    layer = max(facts.layer_bytes.values())
    budgets = {"resident": floor + 64 * layer, "some": floor + layer + 5 * facts.slot_bytes, "all": floor}
    return {name: planner.plan_model(path, b, CTX, hw, compute_dtype="fp32") for name, b in budgets.items()}


def file_bytes_per_expert(path: Path, layer: int) -> tuple[int, list[bytes]]:
    """(bytes of one expert of ``layer`` in the file, expert 0's gate | up | down bytes), read with the gguf
    package (independent of the engine's reader)."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    banks = [tensors[f"blk.{layer}.ffn_{part}_exps.weight"] for part in ("gate", "up", "down")]
    experts = int(banks[0].shape[-1])  # ne2: the expert count
    total = sum(int(t.n_bytes) for t in banks)
    assert total % experts == 0
    return total // experts, [t.data.reshape(experts, -1)[0].tobytes() for t in banks]


def tokens(engine: Engine, mode: str) -> tuple[int, ...]:
    params = GenerationParams(mode=mode, max_new_tokens=16, block_size=8, threshold=0.3)
    done = [e for e in engine.generate(prompt_ids=PROMPT, params=params) if isinstance(e, Finished)]
    return done[0].token_ids


# ---- the plan is the file's ------------------------------------------------------------------------------------


def test_the_slot_is_one_experts_file_bytes_at_the_35b_shape() -> None:
    """The figures of ``clover-desk bench gguf``: a streamed expert is its bytes in the file."""
    assert GGUFExpertLayout(256, 2048, 512, (Q4_0, Q4_0, Q4_0)).nbytes == 1_769_472
    assert GGUFExpertLayout(256, 2048, 512, (Q4_K, Q4_K, Q6_K)).nbytes == 2_039_808  # Q4_K_M, ffn_down Q6_K


def test_bench_gguf_prints_the_files_bytes_per_expert(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    """``clover-desk bench gguf --model FILE``: every MoE layer's bytes per expert as the gguf package reads them
    from the file, after the dequantize figures of every type; a file that is not a GGUF is one line and exit 2,
    before any timing."""
    from clover_desk.cli import main as cli

    path = files["Q4_K"]
    assert cli.main(["bench", "gguf", "--values", "2048", "--repeat", "1", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    for name in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"):
        assert f"\n  {name} " in out, out
    layers = json.loads((files["Q4_K"].parent / "wide" / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        per_expert, _ = file_bytes_per_expert(path, layer)
        assert f"layer {layer:>3}: {per_expert:>12,} B" in out, out

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    assert cli.main(["bench", "gguf", "--values", "2048", "--repeat", "1", "--model", str(junk)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and str(junk) in err, (out, err)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_plan_reads_the_files_expert_bytes(files: dict[str, Path], qtype: str) -> None:
    path = files[qtype]
    per_expert, _ = file_bytes_per_expert(path, 0)
    plan = plans_for(path)["some"]
    assert plan.fits and plan.streamed_expert_layers and plan.resident_expert_layers, plan.reason
    assert plan.assumptions["expert_slot_bytes"] == per_expert
    assert plan.model_fingerprint == planner.model_facts(planner.model_manifest(path), "fp32").fingerprint()
    assert plan.policy_hash == ""  # no conversion, no quantized cache: the file as stored


# ---- placement ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_placed_bytes_are_the_planned_bytes(files: dict[str, Path], qtype: str) -> None:
    path = files[qtype]
    per_expert, _ = file_bytes_per_expert(path, 0)
    for name, plan in plans_for(path).items():
        engine = Engine.load(path, placement=plan.to_dict())  # the dict a plan event carries
        rt = runtime_of(engine.model)
        assert rt is not None and engine.plan is not None
        for kind in ("non_expert", "resident_experts", "expert_slots"):  # every device byte, as planned
            assert rt.ledger.by_kind.get(kind, 0) == plan.vram_breakdown[kind], (name, kind)
        assert sum(s.nbytes for s in rt.stores.values()) == plan.ram_breakdown["streamed_experts"], name
        embed = engine.model.embed_tokens.weight  # the GGUF blocks (or floats), kept in host RAM
        assert embed.device.type == "cpu" and embed.numel() * embed.element_size() == plan.ram_breakdown["embed"]
        assert list(rt.streamed_layers) == plan.streamed_expert_layers
        assert (rt.pool.num_slots if rt.pool else 0) == plan.slot_pool_experts
        for i, layer in enumerate(engine.model.layers):
            bank = layer.mlp.experts
            if i in plan.streamed_expert_layers:
                assert isinstance(bank, StreamedExpertBank) and "packed" not in dict(bank.named_buffers())
                assert bank.store.rows.shape == (bank.num_experts, per_expert)
            else:
                assert isinstance(bank, GGUFExpertBank) and bank.packed.shape == (bank.num_experts, per_expert)
        if rt.pool is not None:  # one slot holds one expert's GGUF bytes, gate | up | down as the file has them
            assert rt.pool.layout.nbytes == rt.pool.buf.shape[1] == per_expert
            first = plan.streamed_expert_layers[0]
            _, expert0 = file_bytes_per_expert(path, first)
            assert rt.stores[first].rows[0].numpy().tobytes() == b"".join(expert0)


@pytest.mark.parametrize("qtype", TYPES)
def test_streaming_never_changes_a_token(files: dict[str, Path], qtype: str) -> None:
    """AR and diffusion greedy tokens are the same whatever the plan streams, and the same as the model loaded
    without a plan; the streamed model's logits are the dequantized reference's."""
    path = files[qtype]
    per_expert, _ = file_bytes_per_expert(path, 0)
    unplanned = Engine.load(path)
    want = {mode: tokens(unplanned, mode) for mode in ("ar", "diffusion")}
    reference = load_gguf_model(path, keep_quantized=False).model  # every tensor dequantized, dense banks
    ids = torch.tensor(PROMPT)
    for name, plan in plans_for(path).items():
        engine = Engine.load(path, placement=plan)
        for mode in ("ar", "diffusion"):
            assert tokens(engine, mode) == want[mode], (name, mode)
        acc = runtime_of(engine.model).accounting()  # type: ignore[union-attr]
        if plan.streamed_expert_layers:
            assert acc["h2d_bytes"] > 0 and acc["h2d_bytes"] == (acc["slot_misses"] + acc["prefetched"]) * per_expert
            assert acc["blocks"] >= 1  # the diffusion loop's block hooks reached the slot pool
        # the same kernels on the same bytes whatever the plan: equal to the model loaded without one
        torch.testing.assert_close(engine.model(ids), unplanned.model(ids), rtol=1e-5, atol=1e-5)
        before = cpu_quant.set_enabled(False)  # the dequantizing path: equal to the dense reference
        try:
            torch.testing.assert_close(engine.model(ids), reference(ids), rtol=1e-4, atol=1e-4)
        finally:
            cpu_quant.set_enabled(before)


def test_loading_under_a_plan_reports_progress_and_can_be_cancelled(files: dict[str, Path]) -> None:
    import threading

    path = files["Q4_0"]
    plan = plans_for(path)["some"]
    seen: list[LoadProgress] = []
    Engine.load(path, placement=plan, progress=seen.append)
    assert seen[-1].stage == "done" and seen[-1].done_bytes == seen[-1].total_bytes > 0
    reading = [p for p in seen if p.stage == "reading"]
    assert reading[-1].done_bytes == reading[-1].total_bytes
    cancel = threading.Event()

    def stop(p: LoadProgress) -> None:
        cancel.set()

    with pytest.raises(CancelledError, match="cancelled"):
        Engine.load(path, placement=plan, progress=stop, cancel=cancel)


# ---- a plan for another model is refused ---------------------------------------------------------------------


def test_a_plan_for_another_file_or_the_folder_is_refused_in_one_line(files: dict[str, Path], wide_dir: Path) -> None:
    q8, q4 = plans_for(files["Q8_0"])["some"], plans_for(files["Q4_0"])["some"]
    assert q8.model_fingerprint != q4.model_fingerprint
    with pytest.raises(PlanError, match="made for another model") as err:
        Engine.load(files["Q4_0"], placement=q8)
    assert "\n" not in str(err.value)
    folder_plan = planner.plan_model(wide_dir, 4 * GIB, CTX, machine(), compute_dtype="fp32")
    assert folder_plan.fits
    with pytest.raises(PlanError, match="made for another model") as err:  # NF4 cache bytes, not the file's
        Engine.load(files["Q4_0"], placement=folder_plan)
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="made for another model"):
        Engine.load(wide_dir, precision="nf4", placement=q4)


def test_the_layout_override_plans_and_loads(wide_dir: Path, tmp_path: Path) -> None:
    """A fork-layout file without its diffusion tensors opens only with ``gguf_layout="fork"``: the plan is made
    from the header read that way too."""
    path = write_gguf(wide_dir, tmp_path / "stripped.gguf", "Q8_0", layout="fork", diffusion_tensors=False)[0]
    with pytest.raises(ConfigError, match="layout 'fork'"):
        Engine.load(path, placement=plan_for(path, 4 * GIB, CTX, "float32"))
    engine = Engine.load(path, placement=plan_for(path, 4 * GIB, CTX, "float32", "fork"), gguf_layout="fork")
    assert engine.plan is not None and engine.plan.fits
    assert tokens(engine, "ar") == tokens(Engine.load(path, gguf_layout="fork"), "ar")


# ---- the CLI -------------------------------------------------------------------------------------------------


def test_generate_with_a_vram_budget_prints_the_plan_then_streams(files: dict[str, Path]) -> None:
    path = files["Q4_0"]
    floor = planner.plan_model(path, 0, CTX, machine(), compute_dtype="fp32").min_vram_bytes
    assert floor
    budget = floor + 3 * planner.model_facts(planner.model_manifest(path), "fp32").slot_bytes  # all layers stream
    out = subprocess.run(
        [sys.executable, "-m", "clover_desk.cli.main", "generate", "--model", str(path), "--prompt-ids", "5,9,14",
         "--max-new-tokens", "8", "--mode", "diffusion", "--vram-gb", repr(budget / GIB), "--ctx", str(CTX),
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    events: list[dict[str, Any]] = [json.loads(line) for line in out.stdout.splitlines()]
    assert events[0]["event"] == "plan" and events[-1]["event"] == "finished"
    assert events[0]["model"] == str(path) and events[0]["streamed_expert_layers"] == [0, 1, 2, 3]
    accounting = events[-1]["accounting"]
    assert accounting["streamed_layers"] == events[0]["streamed_expert_layers"]
    assert accounting["expert_row_bytes"] == events[0]["assumptions"]["expert_slot_bytes"]
    assert accounting["h2d_bytes"] > 0


def test_zero_copy_reads_a_gguf_files_streamed_experts_in_place(files: dict[str, Path]) -> None:
    """A streamed GGUF layer's rows (one expert's blocks in the file's types each) read in place by AR steps
    (engine.placement.placer.set_zero_copy): the tokens of the pool, and no AR step fetches."""
    from clover_desk.engine.placement import placer

    path = files["Q4_K"]
    plan = next(p for p in plans_for(path).values() if p.streamed_expert_layers)
    engine = Engine.load(path, placement=plan)
    want = tokens(engine, "ar")
    assert placer.set_zero_copy(engine.model, True) == {}
    rt = runtime_of(engine.model)
    assert rt is not None
    rt.reset_stats()
    assert tokens(engine, "ar") == want
    # only the prompt's forward went through the pool: one host read per streamed layer
    assert rt.accounting()["host_reads"] == len(plan.streamed_expert_layers)


def test_device_tables_fetch_a_gguf_files_streamed_experts(files: dict[str, Path]) -> None:
    """A streamed GGUF layer's rows through device slot tables (engine.placement.placer.set_device_pool): the host pool's
    tokens, the experts found where the tables say, and only the prompt's forward reading the host."""
    from clover_desk.engine.placement import placer

    path = files["Q4_K"]
    plan = next(p for p in plans_for(path).values() if p.streamed_expert_layers)
    engine = Engine.load(path, placement=plan)
    want = tokens(engine, "ar")
    assert placer.set_device_pool(engine.model, True) == ""
    rt = runtime_of(engine.model)
    assert rt is not None and rt.tables is not None
    rt.reset_stats()
    assert tokens(engine, "ar") == want
    acc = rt.accounting()
    assert acc["host_reads"] == len(plan.streamed_expert_layers) and acc["device_pool"]
    assert acc["slot_hits"] + acc["slot_misses"] > 0 and rt.tables.check() == []
