"""One plan from the VRAM slider to the device: the panel, ``clover-desk plan --json``, the worker and ``generate
--vram-gb --json`` show the same plan, and the engine places exactly that plan without planning again.

The 35B-A3B reproduction uses a checkpoint folder whose safetensors files carry the real headers over sparse data
(no disk used): the planner reads headers only, so it sees exactly what it would see for the published model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.errors import PlanError
from clover_desk.engine.placement import manifest as manifest_mod
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware, probe_hardware
from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config
from tests.plan_contract import PLACEMENT_KEYS

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
CLI = [sys.executable, "-m", "clover_desk.cli.main"]
# what must agree between every place a plan is shown or used
PLACEMENT_FIELDS = (*PLACEMENT_KEYS, "ctx_tokens", "model_fingerprint")


def placement(plan: Any) -> dict[str, Any]:
    d = plan if isinstance(plan, dict) else plan.to_dict()
    return {k: d[k] for k in PLACEMENT_FIELDS}


def write_header_only_checkpoint(folder: Path, geo: planner.ModelGeometry, shard_bytes: int = 4 * GIB) -> None:
    """A Hugging Face folder of ``geo``'s tensors in the official names and dtypes; each shard's data region is a
    hole (sparse file), so the real 69 GB model costs a few KiB of disk."""
    import torch

    from clover_desk.engine.weights.streaming_writer import TensorSpec, plan_shards, safetensors_header

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    specs = [
        TensorSpec(name if name == "lm_head.weight" else "model.language_model." + name, shape, dtypes[stored])
        for name, shape, stored in manifest_mod._text_tensors(geo)
    ]
    folder.mkdir(parents=True)
    shards = plan_shards(specs, shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        head = safetensors_header(shard)
        with (folder / fname).open("wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(spec.nbytes for spec in shard))  # a hole: no data is written
        weight_map.update({spec.name: fname for spec in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = tiny_text_config(
        vocab_size=geo.vocab_size, layers=geo.num_hidden_layers, hidden=geo.hidden_size, experts=geo.num_experts,
        experts_per_tok=geo.num_experts_per_tok, heads=geo.num_attention_heads, kv_heads=geo.num_key_value_heads,
        head_dim=geo.head_dim, linear_key_heads=geo.linear_num_key_heads, linear_value_heads=geo.linear_num_value_heads,
        linear_head_dim=geo.linear_key_head_dim, moe_intermediate=geo.moe_intermediate_size,
        shared_intermediate=geo.shared_expert_intermediate_size,
    )
    special = {"<|endoftext|>": 248044, "<|im_end|>": 248046, "<|mask|>": 248077, "</think>": 248069}
    (folder / "config.json").write_text(json.dumps(config_dict_for("clover_moe", text, special)))


@pytest.fixture(scope="module")
def clover35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("one-plan") / "Clover-35B-A3B-headers"
    write_header_only_checkpoint(folder, planner.SHAPES["clover-35b-a3b"])
    return folder


def machine(ram_gib: float) -> Hardware:
    """This machine as probed (GPU facts for the speed model), with the free RAM the reproduction had."""
    return dataclasses.replace(probe_hardware(), ram_available_bytes=int(ram_gib * GIB))


def cli_plan(model: Path, vram_gib: float, ctx: int, ram_gb: float) -> dict[str, Any]:
    out = subprocess.run(
        [*CLI, "plan", "--model", str(model), "--vram-gb", str(vram_gib), "--ctx", str(ctx), "--ram-gb", str(ram_gb),
         "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout)


def test_the_checkpoint_is_planned_as_the_cache_will_hold_it(clover35: Path) -> None:
    """Headers under the policy give the published counts, not the BF16 file bytes."""
    m = planner.model_manifest(clover35)
    assert m.total_bytes(["expert"]) == 18_119_393_280  # NF4: 40 layers x 256 experts x 1,769,472 B
    assert planner.model_manifest(planner.SHAPE_PREFIX + "clover-35b-a3b").entries == m.entries
    stored = planner.manifest_for_model_dir(clover35, as_stored=True)
    assert stored.total_bytes(["expert"]) == 2 * 32_212_254_720


def test_panel_cli_and_worker_show_one_plan_for_the_35b_reproduction(clover35: Path, qtbot: Any, tmp_path: Path) -> None:
    """The reproduction of the issue: 35B shape, 16 GiB, 8K context, 48 GiB RAM. The panel said "won't fit, needs
    61 GiB RAM" (it planned the BF16 files) while the engine would have streamed 20 layers."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from tests.fakes_ui import FakeEngineClient

    hw = machine(48)
    app = CloverDeskApp(
        tmp_path, client=FakeEngineClient(), settings=AppSettings(model_dir=str(clover35)), hardware=hw,
        with_preview=False, with_model_manager=False, start_engine=False,
    )
    try:
        for vram_gib, ctx in ((16, 8192), (12, 16_384), (8, 4096), (24, 32_768)):
            panel = app._plan(vram_gib * GIB, ctx)
            assert panel.fits, panel.reason
            assert panel.ram_bytes < 48 * GIB
            cli = cli_plan(clover35, vram_gib, ctx, 48)
            assert placement(cli) == placement(panel), (vram_gib, ctx)
            direct = planner.plan_model(clover35, vram_gib * GIB, ctx, hw)
            assert placement(direct) == placement(panel)
        at16 = app._plan(16 * GIB, 8192)
        assert 0 < len(at16.streamed_expert_layers) < 40 and at16.slot_pool_experts >= 512
    finally:
        app.shutdown(wait_ms=0)


def test_the_worker_plans_with_the_same_function(clover35: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "clover_desk.worker.process"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        command = {"cmd": "plan", "id": "p1", "model_dir": str(clover35), "vram_budget_bytes": 12 * GIB, "ram_gb": 48, "ctx": 16_384}
        proc.stdin.write(json.dumps(command) + "\n")
        proc.stdin.flush()
        record: dict[str, Any] = {}
        for line in proc.stdout:  # ready, then the answer to p1
            record = json.loads(line)
            if record.get("id") == "p1":
                break
        assert record.get("event") == "plan", record
        proc.stdin.write(json.dumps({"cmd": "shutdown"}) + "\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert placement(record["plan"]) == placement(cli_plan(clover35, 12, 16_384, 48))


def test_one_default_context_and_card() -> None:
    """Defined once (engine.defaults): the CLI, the window, the worker and the benchmarks all start from it."""
    import argparse

    from clover_desk import app
    from clover_desk.bench import offload as cmd_bench_offload
    from clover_desk.cli import plan as cmd_plan
    from clover_desk.worker import loading

    assert app.AppSettings().ctx_tokens == DEFAULT_CTX_TOKENS
    assert loading.command_ctx({}) == DEFAULT_CTX_TOKENS
    for module in (cmd_plan, cmd_bench_offload):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.get_default("ctx") == DEFAULT_CTX_TOKENS, module.__name__
    # no budget and no GPU: a plan for the default card
    no_gpu = Hardware(ram_available_bytes=64 * GIB)
    plan = planner.plan_model(planner.SHAPE_PREFIX + "clover-35b-a3b", None, hardware=no_gpu)
    assert plan.vram_budget_bytes == 16 * GIB and plan.ctx_tokens == DEFAULT_CTX_TOKENS and plan.gpu_name is None


def test_a_context_over_the_models_limit_is_refused_with_the_limit(clover35: Path) -> None:
    with pytest.raises(PlanError, match="context 200,000 tokens is over the model's limit of 131,072"):
        planner.plan_model(clover35, 16 * GIB, 200_000, machine(48))


def test_a_budget_below_the_minimum_names_what_would_fit(clover35: Path) -> None:
    plan = planner.plan_model(clover35, 4 * GIB, 16_384, machine(48))
    assert not plan.fits and plan.min_vram_bytes
    assert "below the" in plan.reason and f"{plan.min_vram_bytes:,} bytes" in plan.reason


def test_not_enough_ram_for_the_streamed_experts_names_both_numbers(clover35: Path) -> None:
    plan = planner.plan_model(clover35, 8 * GIB, 16_384, machine(4))
    assert not plan.fits and "RAM: the plan needs" in plan.reason and "4.00 GiB is available" in plan.reason
    fitting = planner.plan_model(clover35, 8 * GIB, 16_384, machine(48))
    with pytest.raises(PlanError, match=r"needs .* GiB of free system RAM .* but 1.00 GiB is free now"):
        planner.check_plan(fitting, planner.model_manifest(clover35), ram_available_bytes=GIB)


# ---------------------------------------------------------------------------------------------------------------
# The engine places the plan it is handed, exactly, and never plans again
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_streaming(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[planner.Plan]]:
    """A tiny Clover folder and plans over a range of budgets: none / some / all expert layers streamed."""
    from clover_desk.engine.weights.tiny import make_tiny

    folder = make_tiny(tmp_path_factory.mktemp("one-plan-tiny"), model_type="clover_moe", seed=3)
    hw = machine(16)
    facts = planner.model_facts(planner.model_manifest(folder))
    slot, layer = facts.slot_bytes, max(facts.layer_bytes.values())

    def plan(extra: int, ctx: int) -> planner.Plan:
        floor = planner.plan_model(folder, 0, ctx, hw).min_vram_bytes
        assert floor
        return planner.plan_model(folder, floor + extra, ctx, hw)

    plans = [plan(extra, ctx) for extra, ctx in ((0, 96), (3 * slot, 128), (layer + 5 * slot, 64), (64 * layer, 96))]
    return folder, plans


def test_the_engine_places_exactly_the_plan_and_never_plans_again(
    tiny_streaming: tuple[Path, list[planner.Plan]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from clover_desk.engine.api import Engine
    from clover_desk.engine.placement.offload_runtime import runtime_of
    from clover_desk.engine.placement.streamed_bank import StreamedExpertBank

    folder, plans = tiny_streaming
    assert {len(p.streamed_expert_layers) for p in plans} >= {0, 4} and len({p.to_dict()["vram_used_bytes"] for p in plans}) == 4

    def no_planning(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the engine planned again")

    monkeypatch.setattr(planner, "make_plan", no_planning)
    for plan in plans:
        assert plan.fits, plan.reason
        engine = Engine.load(folder, device="cpu", precision="nf4", placement=plan.to_dict())  # the dict a plan event carries
        rt = runtime_of(engine.model)
        assert rt is not None and placement(engine.plan) == placement(plan)
        assert list(rt.streamed_layers) == plan.streamed_expert_layers
        assert list(rt.resident_layers) == plan.resident_expert_layers
        assert (rt.pool.num_slots if rt.pool else 0) == plan.slot_pool_experts
        for kind in ("non_expert", "resident_experts", "expert_slots"):  # every placed byte, as planned
            assert rt.ledger.by_kind.get(kind, 0) == plan.vram_breakdown[kind], kind
        for i, layer in enumerate(engine.model.layers):
            assert isinstance(layer.mlp.experts, StreamedExpertBank) == (i in plan.streamed_expert_layers)
        ram = sum(s.nbytes for s in rt.stores.values())
        assert ram == plan.ram_breakdown["streamed_experts"]
        assert engine.model.max_pass_tokens == plan.prefill_chunk_tokens


def test_streaming_under_the_plan_never_changes_a_token(tiny_streaming: tuple[Path, list[planner.Plan]]) -> None:
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import Finished, GenerationParams

    folder, plans = tiny_streaming
    outputs = set()
    for plan in plans:
        engine = Engine.load(folder, device="cpu", precision="nf4", placement=plan)
        for mode in ("diffusion", "ar"):
            params = GenerationParams(mode=mode, max_new_tokens=24, block_size=8, threshold=0.3)
            done = [e for e in engine.generate(prompt_ids=[5, 9, 14, 3, 22], params=params) if isinstance(e, Finished)]
            outputs.add((mode, done[0].token_ids))
    assert len(outputs) == 2  # one token sequence per mode, whatever the plan streams


def test_a_stale_plan_is_refused_with_one_line(tiny_streaming: tuple[Path, list[planner.Plan]], tmp_path: Path) -> None:
    from clover_desk.engine.api import Engine
    from clover_desk.engine.weights.tiny import make_tiny

    folder, plans = tiny_streaming
    other = make_tiny(tmp_path / "other", model_type="clover_moe", seed=3)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_experts_per_tok"] = 2  # another routing: not the model the plan was made for
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="made for another model") as err:
        Engine.load(other, device="cpu", precision="nf4", placement=plans[1])
    assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="does not fit"):
        Engine.load(folder, device="cpu", precision="nf4", placement=planner.plan_model(folder, 1000, 96, machine(16)))
    with pytest.raises(PlanError, match="missing field"):
        Engine.load(folder, device="cpu", precision="nf4", placement={"fits": True})


def test_generate_announces_the_plan_that_plan_json_prints(tiny_streaming: tuple[Path, list[planner.Plan]]) -> None:
    folder, plans = tiny_streaming
    budget_gib = plans[1].vram_budget_bytes / GIB
    gen = subprocess.run(
        [*CLI, "generate", "--model", str(folder), "--prompt-ids", "5,9,14", "--max-new-tokens", "4",
         "--vram-gb", repr(budget_gib), "--ctx", "128", "--dtype", "bfloat16", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert gen.returncode == 0, gen.stderr
    events = [json.loads(line) for line in gen.stdout.splitlines()]
    assert events[0]["event"] == "plan" and events[-1]["event"] == "finished"
    shown = subprocess.run(
        [*CLI, "plan", "--model", str(folder), "--vram-gb", repr(budget_gib), "--ctx", "128", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert placement(events[0]) == placement(json.loads(shown.stdout))
    assert events[0]["streamed_expert_layers"] and events[-1]["accounting"]["streamed_layers"] == events[0]["streamed_expert_layers"]


def test_a_meta_skeleton_holds_no_memory() -> None:
    """Loading builds the model on the meta device and places each tensor once; a skeleton that allocated its
    dense expert banks on the CPU cost 1.5 GiB per real-width layer before the first byte was read (6.3 GiB peak
    for a 4-layer model whose quantized cache is 3.2 GiB)."""
    import torch

    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.model.config import parse_config

    text = tiny_text_config(vocab_size=512, layers=4, hidden=64, experts=16, experts_per_tok=4)
    special = {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}
    model = CloverModel(parse_config(config_dict_for("clover_moe", text, special)), dtype=torch.bfloat16, device="meta")
    real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    assert real == []


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bad_budgets_and_contexts_are_one_line_at_the_cli(clover35: Path, tiny_streaming: tuple[Path, list[planner.Plan]]) -> None:
    over = _cli("plan", "--model", str(clover35), "--vram-gb", "16", "--ctx", "200000")
    assert over.returncode == 2 and over.stderr.count("\n") == 1
    assert "context 200,000 tokens is over the model's limit of 131,072" in over.stderr
    short = _cli("plan", "--model", str(clover35), "--vram-gb", "4", "--ram-gb", "48")
    assert short.returncode == 3 and "the smallest VRAM budget that fits is" in short.stdout
    no_ram = _cli("plan", "--model", str(clover35), "--vram-gb", "8", "--ram-gb", "4")
    assert no_ram.returncode == 3 and "RAM: the plan needs" in no_ram.stdout and "4.00 GiB is available" in no_ram.stdout
    folder, _ = tiny_streaming
    gen = _cli("generate", "--model", str(folder), "--prompt-ids", "5,9", "--vram-gb", "0.1", "--json")
    assert gen.returncode == 2 and gen.stderr.count("\n") == 1 and "Traceback" not in gen.stderr
    assert "below the" in gen.stderr and "smallest VRAM budget that fits is" in gen.stderr


def test_a_model_with_a_shorter_context_is_offered_and_loaded_at_most_its_own(tmp_path: Path, qtbot: Any,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A model whose config allows 8,192 positions, with 32K applied for the last one: the panel offers no longer
    context and plans at 8K (it used to plan 32K, log a planner traceback and show "won't fit"), the load's plan
    is for 8K (it used to load nothing, with an error), and a longer model gets the applied 32K back."""
    from clover_desk.app import AppSettings, CloverDeskApp
    from clover_desk.engine.weights.tiny import make_tiny
    from tests.fakes_ui import FakeEngineClient

    short = make_tiny(tmp_path / "short", model_type="clover_moe", max_position_embeddings=8192)
    long = make_tiny(tmp_path / "long", model_type="clover_moe", seed=1)
    hw = Hardware(gpu_name="NVIDIA GeForce RTX 4080", vram_total_bytes=16 * GIB, ram_total_bytes=64 * GIB,
                  ram_available_bytes=48 * GIB)
    client = FakeEngineClient()
    settings = AppSettings(model_dir=str(short), device="cuda", dtype="bfloat16", vram_budget_bytes=8 * GIB,
                           ctx_tokens=32_768)
    app = CloverDeskApp(tmp_path / "home", client=client, settings=settings, hardware=hw, with_preview=False,
                        with_model_manager=False, start_engine=False)
    try:
        panel = app.vram_panel
        offered = lambda: [panel.ctx_combo.itemData(i) for i in range(panel.ctx_combo.count())]  # noqa: E731
        assert offered() == [4096, 8192] and panel.ctx_tokens() == 8192
        assert panel.plan is not None and panel.plan.fits and panel.plan.ctx_tokens == 8192
        app.load_model()
        assert client.plans[-1] is not None and client.plans[-1]["ctx_tokens"] == 8192
        app.on_model_chosen(str(long))
        assert offered()[-1] == 131_072 and panel.ctx_tokens() == 32_768
        assert panel.plan is not None and panel.plan.ctx_tokens == 32_768
        assert "planner failed" not in caplog.text and "cannot plan" not in caplog.text
    finally:
        app.shutdown(wait_ms=0)


def test_a_read_ahead_adds_forwards_for_turn_checkpoints_only_when_no_expert_is_streamed(
        tiny_streaming: tuple[Path, list[planner.Plan]]) -> None:
    """A read-ahead ends a forward at each chat turn start for a checkpoint there, but not under a plan that streams
    experts: every forward would stream its layers' experts again (~0.3 s at the 35B shape on a 16 GB card)."""
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import GenerationParams

    folder, plans = tiny_streaming
    streamed = next(p for p in plans if p.streamed_expert_layers and p.ctx_tokens >= 96)
    resident = next(p for p in plans if not p.streamed_expert_layers and p.ctx_tokens >= 96)
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(6)]
    params = GenerationParams(mode="diffusion", max_new_tokens=4, do_sample=False, block_size=8)
    seen = {}
    for name, plan in (("streamed", streamed), ("resident", resident)):
        engine = Engine.load(folder, precision="nf4", placement=plan)
        calls: list[int] = []
        forward = engine.model.forward

        def counted(ids: Any, *args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            calls.append(int(ids.shape[-1]))
            return _forward(ids, *args, **kwargs)

        engine.model.forward = counted
        assert len(engine.prompt_ids(messages=chat)) < plan.ctx_tokens
        list(engine.read_chat(chat, params))
        seen[name] = (len(calls), engine.prompt_cache.checkpoint_lengths)
    assert seen["streamed"][1] == [] and len(seen["resident"][1]) >= 3  # the turn starts: checkpoints, or not
    assert seen["resident"][0] == seen["streamed"][0] + len(seen["resident"][1])  # one more forward for each
