"""engine.placement.planner: byte-exact manifests, plans whose every byte is accounted, the roofline, the hardware probe.

The expected numbers are the 35B-A3B shapes' published counts, computed independently of this code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from clover_desk.engine.errors import CheckpointError, ConfigError, PlanError
from clover_desk.engine.placement import manifest as manifest_mod
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware, pcie_gbps, probe_hardware, vram_gbps_for_name
from clover_desk.engine.placement.planner import (
    SHAPES,
    GiB,
    MiB,
    ModelGeometry,
    Plan,
    Roofline,
    make_plan,
    manifest_for_geometry,
    manifest_for_shape,
    manifest_from_checkpoint,
    manifest_from_dict,
    manifest_from_quantized_cache,
)
from clover_desk.engine.weights.formats import FORMAT_BYTES, make_policy, placed_bytes
from tests.plan_contract import BREAKDOWN_KEYS, CONTRACT_KEYS

ROOT = Path(__file__).resolve().parents[2]
CTX = 16 * 1024

# the 35B-A3B shapes' published counts
EXPERT_PARAMS = 3_145_728
EXPERT_BYTES_4_5_BIT = 1_769_472
LAYER_EXPERT_BYTES = 452_984_832
ALL_EXPERT_PARAMS = 32_212_254_720
ALL_EXPERT_BYTES = 18_119_393_280
NON_EXPERT_PARAMS = 2_448_355_968
CLOVER_EXTRA_PARAMS = 2_951_040
EMBED_PARAMS = 508_559_360
KV_BYTES_PER_TOKEN = 20_480
GDN_STATE_BYTES = 30 * 32 * 128 * 128 * 4 + 30 * 8192 * 3 * 2


@pytest.fixture(scope="module")
def m35() -> planner.Manifest:
    return manifest_for_shape("clover-35b-a3b")


# ---------------------------------------------------------------------------------------------------------------
# Byte rules and the 35B manifest
# ---------------------------------------------------------------------------------------------------------------


def test_byte_rules() -> None:
    gate_up, down = (1024, 2048), (2048, 512)
    assert FORMAT_BYTES["nf4"](gate_up) + FORMAT_BYTES["nf4"](down) == EXPERT_BYTES_4_5_BIT
    assert FORMAT_BYTES["nf4"]((256, 1024, 2048)) + FORMAT_BYTES["nf4"]((256, 2048, 512)) == LAYER_EXPERT_BYTES
    assert FORMAT_BYTES["nf4"]((65,)) == 33 + 2 * 4  # a partial last block still has its absmax
    assert FORMAT_BYTES["int8"]((512, 2048)) == 512 * 2048 + 512 * 4
    assert FORMAT_BYTES["bf16"]((3, 5)) == 30 and FORMAT_BYTES["fp32"]((3, 5)) == 60


def test_byte_rules_match_engine_quant() -> None:
    """The planner's table (stdlib) and the quantizer (torch) must agree on every shape."""
    pytest.importorskip("torch")
    from clover_desk.engine.weights import quant

    for shape in [(1024, 2048), (2048, 512), (248_320, 2048), (32, 2048), (7, 96), (3, 64, 40)]:
        for fmt in ("nf4", "int8"):
            codes, scales = quant.quantized_sizes(shape, fmt, 64)
            assert codes + scales == FORMAT_BYTES[fmt](shape), (shape, fmt)
    layout = quant.ExpertLayout.build(256, 2048, 512, "nf4", 64)
    assert layout.nbytes == EXPERT_BYTES_4_5_BIT


def test_35b_parameter_counts_match_architecture(m35: planner.Manifest) -> None:
    params = m35.params_by_kind()
    assert params["expert"] == ALL_EXPERT_PARAMS
    assert params["clover_extra"] == CLOVER_EXTRA_PARAMS
    non_expert = sum(v for k, v in params.items() if k not in ("expert", "clover_extra"))
    assert non_expert == NON_EXPERT_PARAMS
    assert params["embed"] == params["lm_head"] == EMBED_PARAMS
    assert params["other"] == 0
    # the official checkpoint has 693 text tensors; Clover adds 4 per GDN layer
    assert len(manifest_for_shape("qwen3.5-35b-a3b")) == 693
    assert len(m35) == 693 + 120
    assert len({e.name for e in m35}) == len(m35)


def test_35b_bytes_follow_the_policy(m35: planner.Manifest) -> None:
    assert m35.total_bytes(["expert"]) == ALL_EXPERT_BYTES
    assert set(m35.expert_layer_bytes().values()) == {LAYER_EXPERT_BYTES}
    by_name = m35.by_name()
    for entry in m35:
        assert entry.bytes == FORMAT_BYTES[entry.format](entry.shape), entry.name
    assert by_name["layers.0.mlp.experts.gate_up_proj"].format == "nf4"
    assert by_name["layers.0.linear_attn.in_proj_qkv.weight"].format == "int8"
    assert by_name["layers.0.linear_attn.in_proj_qkv.weight"].bytes == 8192 * 2048 + 8192 * 4
    assert by_name["layers.3.self_attn.q_proj.weight"].format == "int8"
    assert by_name["layers.0.mlp.shared_expert.down_proj.weight"].format == "int8"
    assert by_name["lm_head.weight"].format == "int8"
    assert by_name["embed_tokens.weight"].format == "bf16"
    assert by_name["layers.0.mlp.gate.weight"].format == "bf16"  # router stays precise
    assert by_name["layers.0.linear_attn.in_proj_a.weight"].format == "bf16"
    assert by_name["layers.0.linear_attn.A_log"].format == "fp32"
    assert by_name["layers.0.linear_attn.conv1d.weight_right"].format == "bf16"
    assert by_name["layers.0.linear_attn.bd_history.weight"].kind == "clover_extra"
    nf4 = manifest_for_shape("clover-35b-a3b", make_policy(attention="nf4", shared_expert="nf4"))
    assert nf4.by_name()["layers.0.linear_attn.in_proj_qkv.weight"].bytes == 8192 * 2048 // 2 + 8192 * 2048 // 64 * 4
    assert nf4.total_bytes() < m35.total_bytes()


def test_classify() -> None:
    assert planner.classify("layers.7.mlp.experts.gate_up_proj") == ("expert", 7)
    assert planner.classify("layers.7.mlp.experts.12.down_proj.weight") == ("expert", 7)
    assert planner.classify("layers.2.mlp.shared_expert_gate.weight") == ("shared_expert", 2)
    assert planner.classify("layers.2.mlp.gate.weight") == ("router", 2)
    assert planner.classify("layers.3.self_attn.k_norm.weight") == ("norm", 3)
    assert planner.classify("layers.0.linear_attn.norm.weight") == ("norm", 0)
    assert planner.classify("layers.0.linear_attn.dt_bias") == ("gdn", 0)
    assert planner.classify("layers.0.linear_attn.bd_logit_scale.weight") == ("clover_extra", 0)
    assert planner.classify("norm.weight") == ("norm", None)
    assert planner.classify("lm_head.weight") == ("lm_head", None)
    assert manifest_mod.strip_prefix("model.language_model.layers.0.mlp.gate.weight") == "layers.0.mlp.gate.weight"
    assert manifest_mod.strip_prefix("model.visual.blocks.0.attn.qkv.weight") is None
    assert manifest_mod.strip_prefix("mtp.fc.weight") is None


def test_geometry_from_shapes_recovers_the_35b_geometry(m35: planner.Manifest) -> None:
    assert manifest_mod.geometry_from_entries(m35.entries) == SHAPES["clover-35b-a3b"]
    assert m35.geometry.kv_bytes_per_token == KV_BYTES_PER_TOKEN
    assert m35.geometry.gdn_state_bytes == GDN_STATE_BYTES


def test_unknown_shape_and_bad_policy_are_named() -> None:
    with pytest.raises(PlanError, match="'clover-9b'"):
        manifest_for_shape("clover-9b")
    with pytest.raises(ConfigError, match="unknown format 'int3'"):
        make_policy(attention="int3")


# ---------------------------------------------------------------------------------------------------------------
# Plans for the 35B shapes
# ---------------------------------------------------------------------------------------------------------------


def _check_accounting(plan: Plan, manifest: planner.Manifest, ctx: int) -> None:
    b = plan.vram_breakdown
    assert set(b) == BREAKDOWN_KEYS
    assert plan.vram_used_bytes == sum(b.values())
    on_gpu = [e for e in manifest if e.kind not in ("expert", "embed")]
    # placed for bf16 compute: plain float tensors in bf16, A_log / dt_bias in fp32, quantized ones as stored
    assert b["non_expert"] == sum(placed_bytes(e.name, e.shape, e.format, e.bytes, "bf16") for e in on_gpu)
    layer_bytes = manifest.expert_layer_bytes()
    assert b["resident_experts"] == sum(layer_bytes[i] for i in plan.resident_expert_layers)
    assert b["expert_slots"] == plan.slot_pool_experts * plan.assumptions["expert_slot_bytes"]
    ctx_alloc = math.ceil(ctx / 32) * 32
    assert b["kv_cache"] == manifest.geometry.kv_bytes_per_token * ctx_alloc
    assert b["gdn_state"] == 2 * manifest.geometry.gdn_state_bytes  # the sequence's, and the prompt cache's copy
    assert b["workspace"] == sum(plan.assumptions["workspace_parts"].values())
    assert b["reserve"] == sum(plan.assumptions["reserve_parts"].values())
    assert sorted(plan.resident_expert_layers + plan.streamed_expert_layers) == sorted(layer_bytes)
    streamed_bytes = sum(layer_bytes[i] for i in plan.streamed_expert_layers)
    assert plan.ram_breakdown["streamed_experts"] == streamed_bytes
    assert plan.ram_bytes == sum(plan.ram_breakdown.values())
    assert plan.ram_breakdown["embed"] == manifest.total_bytes(["embed"])


@pytest.mark.parametrize("gib", [8, 12, 16, 24])
def test_35b_plans_fit_and_account_for_every_byte(m35: planner.Manifest, gib: int) -> None:
    plan = make_plan(m35, gib * GiB, CTX)
    assert plan.fits and plan.reason == ""
    _check_accounting(plan, m35, CTX)
    assert plan.vram_used_bytes <= gib * GiB
    if plan.streamed_expert_layers:
        assert plan.slot_pool_experts >= 2 * 256
        # leftover VRAM goes to slots: less than one slot is unused (unless every streamed expert has one)
        unused = gib * GiB - plan.vram_used_bytes
        capped = plan.slot_pool_experts == 256 * len(plan.streamed_expert_layers)
        assert capped or unused < EXPERT_BYTES_4_5_BIT
    assert plan.vram_breakdown["kv_cache"] == KV_BYTES_PER_TOKEN * CTX


def test_resident_layers_grow_with_the_budget(m35: planner.Manifest) -> None:
    counts = [len(make_plan(m35, g * GiB, CTX).resident_expert_layers) for g in (8, 12, 16, 24)]
    assert counts == sorted(counts) and len(set(counts)) == 4, counts
    assert counts[-1] == 40  # 24 GiB holds every expert
    # and never shrinks on a fine sweep
    sweep = [len(make_plan(m35, int(g * GiB), CTX).resident_expert_layers) for g in np.arange(4.5, 24.01, 0.25)]
    assert all(a <= b for a, b in zip(sweep, sweep[1:])), sweep


def test_streamed_layers_are_spread_evenly() -> None:
    layers = list(range(40))
    for r in (10, 20, 30):
        resident = planner.spread_resident(layers, r)
        streamed = [x for x in layers if x not in resident]
        assert len(resident) == r
        gaps = [b - a for a, b in zip(streamed, streamed[1:])]
        assert max(gaps) - min(gaps) <= 1, (r, streamed)  # evenly spaced
        if r >= 20:
            assert min(gaps) >= 2  # never two streamed layers in a row when half or more are resident


def test_below_the_minimum_refuses_and_the_minimum_fits(m35: planner.Manifest) -> None:
    small = make_plan(m35, 2 * GiB, CTX)
    assert not small.fits
    assert "VRAM" in small.reason and "smallest VRAM budget" in small.reason
    minimum = small.min_vram_bytes
    assert minimum is not None and minimum > 2 * GiB
    assert small.vram_used_bytes == minimum  # the layout shown is the minimum one
    at_min = make_plan(m35, minimum, CTX)
    assert at_min.fits and at_min.vram_used_bytes == minimum
    assert at_min.min_vram_bytes == minimum
    _check_accounting(at_min, m35, CTX)
    below = make_plan(m35, minimum - 1, CTX)
    assert not below.fits and below.min_vram_bytes == minimum
    # the minimum streams every layer through the 2 x E slot pool
    assert at_min.resident_expert_layers == [] and at_min.slot_pool_experts == 512


def test_min_slot_experts_lowers_the_minimum_exactly(m35: planner.Manifest) -> None:
    default = make_plan(m35, 0, CTX).min_vram_bytes
    chunked = make_plan(m35, 0, CTX, min_slot_experts=256).min_vram_bytes
    assert default - chunked == 256 * EXPERT_BYTES_4_5_BIT


def test_ram_shortfall_refuses(m35: planner.Manifest) -> None:
    plan = make_plan(m35, 8 * GiB, CTX, ram_bytes=4 * GiB)
    assert not plan.fits
    assert plan.reason.startswith("RAM") and "available" in plan.reason
    assert plan.ram_bytes > 4 * GiB
    # more VRAM keeps more layers resident, so less RAM is needed: the minimum that fits both is found exactly
    need = plan.min_vram_bytes
    assert need is not None and need > 8 * GiB
    ok = make_plan(m35, need, CTX, ram_bytes=4 * GiB)
    assert ok.fits and ok.ram_bytes <= 4 * GiB
    assert not make_plan(m35, need - 1, CTX, ram_bytes=4 * GiB).fits
    # RAM that cannot even hold the embedding: no VRAM budget helps
    hopeless = make_plan(m35, 64 * GiB, CTX, ram_bytes=100 * MiB)
    assert not hopeless.fits and hopeless.min_vram_bytes is None and "no VRAM budget" in hopeless.reason


def test_context_is_held_in_whole_blocks(m35: planner.Manifest) -> None:
    plan = make_plan(m35, 16 * GiB, 100)
    assert plan.vram_breakdown["kv_cache"] == KV_BYTES_PER_TOKEN * 128
    long = make_plan(m35, 16 * GiB, 131_072)
    assert long.vram_breakdown["kv_cache"] == KV_BYTES_PER_TOKEN * 131_072 == int(2.5 * GiB)
    assert len(long.resident_expert_layers) < len(make_plan(m35, 16 * GiB, CTX).resident_expert_layers)


def test_bad_arguments_are_named(m35: planner.Manifest) -> None:
    with pytest.raises(PlanError, match="vram_budget_bytes.*-1"):
        make_plan(m35, -1, CTX)
    with pytest.raises(PlanError, match="ctx_tokens.*0"):
        make_plan(m35, GiB, 0)
    with pytest.raises(PlanError, match="optimize_for"):
        make_plan(m35, GiB, CTX, optimize_for="speed")
    with pytest.raises(PlanError, match="tokens_per_pass"):
        Roofline(tokens_per_pass=0)


def test_plan_is_frozen_and_json_ready(m35: planner.Manifest) -> None:
    plan = make_plan(m35, 16 * GiB, CTX)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.fits = False  # type: ignore[misc]
    data = json.loads(json.dumps(plan.to_dict()))
    assert CONTRACT_KEYS <= set(data)
    assert set(data["vram_breakdown"]) == BREAKDOWN_KEYS
    assert {"ar", "diffusion"} <= set(data["predicted_tok_s"])
    for key in ("pcie_gbps", "vram_gbps", "tokens_per_pass", "distinct_experts_per_block_layer"):
        assert key in data["assumptions"], key
    assert data["resident_expert_layers"] == plan.resident_expert_layers


# ---------------------------------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------------------------------


def test_roofline_moves_the_right_way(m35: planner.Manifest) -> None:
    p8, p16, p24 = (make_plan(m35, g * GiB, CTX) for g in (8, 16, 24))
    for key in ("ar", "diffusion", "ar_bound", "diffusion_bound"):
        assert 0 < p8.predicted_tok_s[key] <= p16.predicted_tok_s[key] <= p24.predicted_tok_s[key], key
    assert p8.predicted_tok_s["diffusion_bound"] < p24.predicted_tok_s["diffusion_bound"]
    # a cached streamed layer loads its block working set (91 experts) once per block; an uncached one reloads
    # its per-pass union (70) on every pass
    a = p16.assumptions
    assert a["distinct_experts_per_block_layer"] == pytest.approx(70 * 1.3)
    s, cached, passes = len(p16.streamed_expert_layers), a["cached_block_layers"], a["passes_per_block"]
    assert passes == pytest.approx(32 / 3 + 1, rel=1e-4)
    assert 0 < cached <= s
    expected = (cached * 91 + (s - cached) * 70 * passes) * EXPERT_BYTES_4_5_BIT
    assert a["diffusion_pcie_bytes_per_block"] == pytest.approx(expected, rel=1e-4)
    assert p24.assumptions["diffusion_pcie_bytes_per_block"] == 0
    # a faster link helps a streaming plan, the coreset helps diffusion
    gen5 = Hardware(pcie_gen=5, pcie_width=16, pcie_gbps=pcie_gbps(5, 16))
    assert make_plan(m35, 8 * GiB, CTX, hardware=gen5).predicted_tok_s["diffusion"] > p8.predicted_tok_s["diffusion"]
    core = make_plan(m35, 8 * GiB, CTX, roofline=Roofline.with_coreset())
    assert core.predicted_tok_s["diffusion"] > p8.predicted_tok_s["diffusion"]
    # with nothing streamed, AR is bound by VRAM reads: lower bandwidth, lower speed
    slow = Hardware(vram_gbps=336.0)
    assert make_plan(m35, 24 * GiB, CTX, hardware=slow).predicted_tok_s["ar_bound"] < p24.predicted_tok_s["ar_bound"]


def test_replayed_passes_pay_only_for_the_launches_left_eager(m35: planner.Manifest) -> None:
    """Under CUDA graphs a forward costs one launch per graph and the counted ops of its eager pieces: between the
    eager forward and the hardware bound; the fused MoE kernel leaves a pass only its streamed fetches; with the
    launches free, the bound itself."""
    for gib in (8, 16, 24):
        plan = make_plan(m35, gib * GiB, CTX)
        tok, s = plan.predicted_tok_s, len(plan.streamed_expert_layers)
        assert tok["ar"] < tok["ar_graphs"] <= tok["ar_graphs_fused"] < tok["ar_bound"]
        assert tok["diffusion"] < tok["diffusion_graphs"] < tok["diffusion_graphs_fused"] < tok["diffusion_bound"]
        # the AR step's overhead, from the figures: (s + 1) graph launches and s fetches of 14 ops, 10 us each
        overhead = 1 / tok["ar_graphs_fused"] - 1 / tok["ar_bound"]
        assert abs(overhead - ((s + 1) + 14 * s) * 10e-6) < 2e-5  # (the figures are rounded to 0.1 tok/s)
    free = make_plan(m35, 16 * GiB, CTX, roofline=Roofline(launch_us=0.0)).predicted_tok_s
    assert free["ar_graphs_fused"] == pytest.approx(free["ar_bound"])
    assert free["diffusion_graphs_fused"] == pytest.approx(free["diffusion_bound"])


def test_zero_copy_ar_reads_every_streamed_expert_over_pcie_and_waits_for_it(m35: planner.Manifest) -> None:
    """AR reading streamed experts in place (engine.placement.streamed_bank zero-copy) pays no fetch and is one graph, but reads all
    k experts of every streamed layer over PCIe each step (no pool hits) and cannot overlap that read with compute:
    on a 16 GB card at 16 GiB it is predicted well below the pool's replayed figure; with nothing streamed it is the
    replayed step itself, less the fetches that no longer exist."""
    plan = make_plan(m35, 16 * GiB, CTX)
    a, tok, s = plan.assumptions, plan.predicted_tok_s, len(plan.streamed_expert_layers)
    assert a["ar_zero_copy_pcie_bytes_per_token"] == s * 8 * EXPERT_BYTES_4_5_BIT
    assert a["ar_zero_copy_pcie_bytes_per_token"] > a["ar_pcie_bytes_per_token"]  # the pool's hits are lost
    assert tok["ar_graphs_zero_copy"] < 0.7 * tok["ar_graphs"]
    pcie_s = a["ar_zero_copy_pcie_bytes_per_token"] / (a["pcie_gbps"] * 1e9)
    assert 1 / tok["ar_graphs_zero_copy"] > pcie_s + 1 / tok["ar_bound"] - 1e-3  # serial: the read adds to the rest
    whole = make_plan(m35, 40 * GiB, CTX).predicted_tok_s
    assert whole["ar_graphs_zero_copy"] >= whole["ar_graphs_fused"]


def test_device_tables_keep_the_pools_traffic_and_drop_its_fetch_overhead(m35: planner.Manifest) -> None:
    """AR through device slot tables (engine.placement.device_pool): the pool's PCIe traffic (its hits and prefetch kept), one
    graph launch, and each streamed layer's two kernels at a graph node's latency instead of an eager fetch: at 16 GiB
    between the pool's replayed figure and the hardware bound; all resident, the same as the whole-step graph."""
    p = make_plan(m35, 16 * GiB, CTX)
    tok = p.predicted_tok_s
    s = len(p.streamed_expert_layers)
    assert s > 0
    assert tok["ar_graphs"] < tok["ar_graphs_device_pool"] < tok["ar_bound"]
    rl = Roofline()
    overhead = 1 / tok["ar_graphs_device_pool"] - 1 / tok["ar_bound"]
    kernels = s * rl.device_table_kernels * rl.graph_kernel_us
    assert overhead == pytest.approx((rl.launch_us + kernels) * 1e-6, abs=2e-6)  # (the figures are rounded)
    slow = make_plan(m35, 16 * GiB, CTX, roofline={"graph_kernel_us": 100.0}).predicted_tok_s
    assert slow["ar_graphs_device_pool"] < tok["ar_graphs"]  # slow graph nodes would make them lose
    whole = make_plan(m35, 40 * GiB, CTX).predicted_tok_s
    assert whole["ar_graphs_device_pool"] == pytest.approx(whole["ar_graphs_zero_copy"], rel=1e-9)
    # a block's passes through them (with the fused MoE kernel): the same traffic as the host pool's fused figure,
    # each pass one graph launch and two kernels per streamed layer instead of eager fetches
    assert tok["diffusion_graphs_fused"] < tok["diffusion_graphs_device_pool"] < tok["diffusion_bound"]
    a, b = p.assumptions, 32
    n_pass = a["passes_per_block"]
    per_pass = b / tok["diffusion_graphs_device_pool"] / n_pass - b / tok["diffusion_bound"] / n_pass
    assert per_pass == pytest.approx((rl.launch_us + kernels) * 1e-6, rel=0.02)
    assert slow["diffusion_graphs_device_pool"] < tok["diffusion_graphs_fused"]
    assert whole["diffusion_graphs_device_pool"] == pytest.approx(whole["diffusion_graphs_fused"], rel=1e-9)


def test_without_the_fused_moe_kernel_a_pass_writes_and_reads_its_dequantized_experts(m35: planner.Manifest) -> None:
    """The unfused engine dequantizes a pass's experts to bf16 in groups of 16 (96 MiB, past a 48 MiB L2), which the
    matmul reads back: 4 bytes per weight of the 70 experts of each of 40 layers, 35 GB per pass, twice the rest of
    the pass's VRAM traffic. The bound and the fused predictions read the packed rows only. Placement follows the
    bound: the eager figures cost the same under any layout."""
    plan = make_plan(m35, 16 * GiB, CTX)
    a, tok = plan.assumptions, plan.predicted_tok_s
    expert = 3 * 2048 * 512
    assert a["expert_dequant_vram_bytes_per_pass"] == 40 * 70 * expert * 4
    assert a["expert_dequant_vram_bytes_per_pass"] > 2 * a["diffusion_vram_bytes_per_pass"]
    assert a["expert_dequant_vram_bytes_per_token_ar"] == 0  # an AR step's 8 experts, 48 MiB: not past L2
    assert tok["diffusion_graphs"] < tok["diffusion_graphs_fused"] / 3
    # the same layout as when the planner ignored that traffic: 23 resident layers and 1,529 cache slots (1,565
    # before the prompt cache's copy of the GDN states, 63 MiB)
    assert (len(plan.resident_expert_layers), plan.slot_pool_experts) == (23, 1529)
    dense = manifest_for_shape("clover-35b-a3b", make_policy(experts="bf16"))
    assert make_plan(dense, 80 * GiB, CTX).assumptions["expert_dequant_vram_bytes_per_pass"] == 0


def test_ar_optimisation_keeps_the_most_layers_resident(m35: planner.Manifest) -> None:
    ar = make_plan(m35, 12 * GiB, CTX, optimize_for="ar")
    diffusion = make_plan(m35, 12 * GiB, CTX)
    # AR gains nothing from caching block working sets, so it spends VRAM on resident layers instead
    assert len(ar.resident_expert_layers) >= len(diffusion.resident_expert_layers)
    assert ar.predicted_tok_s["ar"] >= diffusion.predicted_tok_s["ar"]


# ---------------------------------------------------------------------------------------------------------------
# Real files
# ---------------------------------------------------------------------------------------------------------------

TINY_CONFIG: dict[str, Any] = {
    "model_type": "clover_moe",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "full_attention_interval": 4,
}
ST_DTYPES = {"BF16": 2, "F32": 4}


def write_safetensors_by_hand(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """The format: 8-byte little-endian header length, JSON header, then the data (zeros here)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * ST_DTYPES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def _tiny_tensors() -> dict[str, tuple[str, tuple[int, ...]]]:
    from clover_desk.engine.model.config import parse_config

    geo = ModelGeometry.from_config(parse_config(TINY_CONFIG))
    out = {}
    for name, shape, stored in manifest_mod._text_tensors(geo):
        full = name if name == "lm_head.weight" else f"model.language_model.{name}"
        out[full] = ("F32" if stored == "fp32" else "BF16", shape)
    return out


def write_tiny_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, tuple[str, tuple[int, ...]]]]:
    """A two-shard tiny Clover checkpoint (one shard by hand, one through safetensors) with config.json and index;
    returns the folder and {name: (dtype, shape)} of everything written."""
    tensors = _tiny_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    shard1 = {n: tensors[n] for n in names[:half]}
    shard2 = {n: tensors[n] for n in names[half:]}
    write_safetensors_by_hand(tmp_path / "model-00001-of-00002.safetensors", shard1)
    # the second shard through the safetensors library (F32 and a bf16-sized stand-in: numpy has no bf16)
    arrays = {}
    for n, (dtype, shape) in shard2.items():
        arrays[n] = np.zeros(shape, dtype=np.float32 if dtype == "F32" else np.float16)
    arrays["mtp.fc.weight"] = np.zeros((32, 64), dtype=np.float16)  # excluded
    arrays["model.visual.patch_embed.weight"] = np.zeros((8, 3), dtype=np.float16)  # excluded
    save_file(arrays, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in shard1}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in arrays})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    written = dict(shard1)
    written.update({n: ("F32" if a.dtype == np.float32 else "F16", a.shape) for n, a in arrays.items()})
    return tmp_path, written


@pytest.fixture()
def tiny_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, tuple[str, tuple[int, ...]]]]:
    return write_tiny_checkpoint(tmp_path)


def test_manifest_from_a_real_checkpoint_matches_what_was_written(tiny_checkpoint: tuple[Path, dict]) -> None:
    folder, written = tiny_checkpoint
    manifest = manifest_from_checkpoint(folder)
    got = manifest.by_name()
    want = {manifest_mod.strip_prefix(n): v for n, v in written.items() if manifest_mod.strip_prefix(n) is not None}
    assert set(got) == set(want)
    assert "mtp.fc.weight" not in got and not any("visual" in n for n in got)
    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    for name, (dtype, shape) in want.items():
        entry = got[name]
        assert entry.shape == tuple(shape), name
        assert entry.bytes == math.prod(shape) * sizes[dtype], name
        assert entry.format == {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}[dtype]
    assert got["layers.3.self_attn.q_proj.weight"].kind == "attn" and got["layers.3.self_attn.q_proj.weight"].layer == 3
    assert manifest.geometry.num_experts == 8 and manifest.geometry.full_attention_layers == (3,)
    assert manifest.geometry == manifest_mod.geometry_from_entries(manifest.entries, experts_per_tok=2)
    plan = make_plan(manifest, GiB, 256)
    assert plan.fits
    _check_accounting(plan, manifest, 256)


def test_checkpoint_errors_name_the_file(tiny_checkpoint: tuple[Path, dict], tmp_path: Path) -> None:
    folder, _ = tiny_checkpoint
    shard = folder / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: truncated safetensors file .header of"):
        manifest_from_checkpoint(folder)
    shard.write_bytes(data[:-16])  # truncated data
    with pytest.raises(CheckpointError, match="ends at byte .* of the data section"):
        manifest_from_checkpoint(folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard file\\(s\\) missing"):
        manifest_from_checkpoint(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(CheckpointError, match="or \\*.safetensors file"):
        manifest_from_checkpoint(empty)
    with pytest.raises(CheckpointError, match="not a directory"):
        manifest_from_checkpoint(tmp_path / "nope")


def _cache_json(manifest: planner.Manifest) -> dict[str, Any]:
    return {
        "version": 1,
        "policy": {"name": "test"},
        "source": {"model_dir": "unused"},
        "tensors": {e.name: {"shape": list(e.shape), "format": e.format, "bytes": e.bytes} for e in manifest},
    }


def test_manifest_from_quantized_cache(tmp_path: Path) -> None:
    from clover_desk.engine.model.config import parse_config

    geo = ModelGeometry.from_config(parse_config(TINY_CONFIG))
    expected = manifest_for_geometry(geo, make_policy())
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(_cache_json(expected)))
    # without config.json: geometry from the shapes (top-k defaults to min(8, E))
    shapes_only = manifest_from_quantized_cache(path)
    assert shapes_only.entries == expected.entries
    assert shapes_only.geometry.num_experts_per_tok == 8 and shapes_only.geometry.num_experts == 8
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with_config = manifest_from_quantized_cache(path)
    assert with_config.geometry == geo and with_config.policy == {"name": "test"}
    assert with_config.total_bytes() == expected.total_bytes()
    assert make_plan(with_config, GiB, 256).fits
    # make_plan also takes the dict itself (engine.placement.placer's manifest_from_model form)
    assert make_plan(_cache_json(expected), GiB, 256).vram_breakdown == make_plan(shapes_only, GiB, 256).vram_breakdown


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=3), "version 1 or 2, got version 3"),
        (lambda d: d.update(tensors={}), "'tensors' is missing or empty"),
        (lambda d: d["tensors"]["norm.weight"].update(format="q3"), "unknown format 'q3'"),
        (lambda d: d["tensors"]["norm.weight"].pop("bytes"), "'norm.weight' needs"),
    ],
)
def test_quantized_cache_errors(tmp_path: Path, mutate: Any, message: str) -> None:
    data = _cache_json(manifest_for_shape("qwen3.5-35b-a3b"))
    mutate(data)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        manifest_from_quantized_cache(path)
    with pytest.raises(PlanError, match="not found"):
        manifest_from_quantized_cache(tmp_path / "missing.json")


def test_dict_manifest_has_the_same_geometry(m35: planner.Manifest) -> None:
    m = manifest_from_dict(_cache_json(m35))
    assert m.geometry == m35.geometry and m.entries == m35.entries


# ---------------------------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------------------------


def _nvml_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any failure here means "no usable NVML"
        return False
    pynvml.nvmlShutdown()
    return True


def test_bandwidth_rules() -> None:
    assert pcie_gbps(4, 16) == pytest.approx(25.2, abs=0.1)  # measured 25.1 on a 4090
    assert pcie_gbps(5, 16) == pytest.approx(50.4, abs=0.1)
    assert pcie_gbps(3, 16) == pytest.approx(12.6, abs=0.1)
    with pytest.raises(ValueError, match="generation 9"):
        pcie_gbps(9, 16)
    assert vram_gbps_for_name("NVIDIA GeForce RTX 4080 SUPER") == 736.0  # the longest name wins
    assert vram_gbps_for_name("NVIDIA GeForce RTX 4080") == 716.8
    assert vram_gbps_for_name("Some Other GPU") is None


@pytest.mark.skipif(_nvml_present(), reason="this machine has a working NVML; the no-GPU path is tested elsewhere")
def test_probe_without_a_gpu_is_a_normal_result() -> None:
    hw = probe_hardware()
    assert hw.gpu_name is None and hw.vram_total_bytes is None
    assert hw.sources["gpu"] == "none"
    assert hw.ram_total_bytes is not None and hw.ram_total_bytes > 0
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes  # type: ignore[operator]
    assert hw.pcie_gbps == pytest.approx(pcie_gbps(4, 16))
    json.dumps(hw.to_dict())


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_present(), reason="needs an NVIDIA GPU with a working driver (NVML)")
def test_probe_with_nvml_reads_the_card() -> None:
    hw = probe_hardware()
    assert hw.gpu_name and hw.sources["gpu"] == "nvml"
    assert hw.vram_total_bytes and 0 < (hw.vram_free_bytes or 0) <= hw.vram_total_bytes
    assert hw.pcie_gbps > 1 and hw.vram_gbps > 100


def test_planner_imports_no_torch_and_no_qt() -> None:
    code = (
        "import json, sys, engine.placement.planner, engine.placement.hardware, clover_desk.cli.plan\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ))
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    heavy = {m for m in loaded if m.split(".")[0] in ("torch", "PySide6", "numpy", "pynvml", "psutil", "safetensors")}
    assert not heavy, heavy


def test_prefill_chunk_keeps_the_attention_scratch_bounded(m35: planner.Manifest) -> None:
    geo = m35.geometry
    for ctx in (2048, CTX, 131_072):
        for attention in ("math", "efficient"):
            chunk = planner.choose_prefill_chunk(geo, ctx, 32, attention)
            assert chunk % 32 == 0 and 32 <= chunk <= planner.PREFILL_MAX_TOKENS

            def variable(c: int) -> int:
                return sum(planner._prefill_parts(geo, c, ctx, attention).values())

            assert variable(chunk) <= planner.PREFILL_WORKSPACE_BYTES or chunk == 32
            if chunk < planner.PREFILL_MAX_TOKENS:
                assert variable(chunk + 32) > planner.PREFILL_WORKSPACE_BYTES  # the longest that fits
    prefill = planner._prefill_parts(geo, 416, CTX, "efficient")
    # one causal bool mask [chunk, ctx] and one group of 64 rows' mask repeated for the 8 folded heads, then as a
    # padded bf16 bias: no [chunk, ctx] per head, no score matrix
    assert prefill["attn_mask"] == 416 * CTX + 64 * 8 * CTX and "attn_scores" not in prefill
    assert prefill["attn_bias"] == 64 * 8 * CTX * 4
    assert planner._prefill_parts(geo, 416, CTX, "math")["attn_scores"] == 2 * 16 * 64 * CTX * 4  # fp32, one group
    efficient = make_plan(m35, 16 * GiB, CTX)
    assert efficient.assumptions["workspace_details"]["attention_path"] == "efficient"  # the engine's kernel
    math_plan = make_plan(m35, 16 * GiB, CTX, attention="math")
    assert math_plan.prefill_chunk_tokens <= efficient.prefill_chunk_tokens
    assert efficient.min_vram_bytes <= math_plan.min_vram_bytes


def test_the_workspace_counts_a_chunk_of_a_quantized_projection_not_the_whole_weight(m35: planner.Manifest) -> None:
    """engine.weights.quant.QuantLinear dequantizes DEQUANT_CHUNK_ELEMS weights at a time (the 0.95 GiB lm_head of the
    35B in 16 MiB chunks), engine.model.experts one group of experts at a time; the planner's constants are the engine's."""
    pytest.importorskip("torch")
    from clover_desk.engine.model import attention, experts
    from clover_desk.engine.weights import quant

    assert planner.DEQUANT_CHUNK_ELEMS == quant.DEQUANT_CHUNK_ELEMS
    assert planner.ATTENTION_ROWS == attention.ATTENTION_ROWS
    facts = planner.model_facts(m35)
    expert_bf16 = facts.expert_params * 2
    assert planner.EXPERT_DEQUANT_EXPERTS == experts.GROUP_BYTES["cuda"] // expert_bf16
    parts, _ = planner.workspace(facts, CTX, 32)
    assert parts["dequant_dense"] == quant.DEQUANT_CHUNK_ELEMS * 2 * 2 < facts.dequant_dense_max_params * 2 // 16
    assert parts["dequant_experts"] == 16 * facts.expert_params * 3
    # the graph pool of compiled runs: a block pass's scratch and the one logits buffer of every key length's passes
    decode = 32 * 248_320 * 4 + 32 * 12_288 * 4 * planner.ACTIVATION_BUFFERS
    assert parts["cuda_graphs"] == decode + parts["dequant_dense"] + 32 * 248_320 * 4


def test_default_policy_numbers(m35: planner.Manifest) -> None:
    """The figures QuantPolicy's docstring gives for choosing NF4 on the dense path."""
    nf4 = manifest_for_shape("clover-35b-a3b", make_policy(attention="nf4", shared_expert="nf4"))
    dense = ["attn", "gdn", "shared_expert"]
    assert m35.total_bytes(dense) - nf4.total_bytes(dense) == 617_390_080  # 0.62 GB, 1.4 expert layers
    nf4_16, int8_16 = make_plan(nf4, 16 * GiB, CTX), make_plan(m35, 16 * GiB, CTX)
    assert (len(nf4_16.resident_expert_layers), len(int8_16.resident_expert_layers)) == (25, 23)
    gain = nf4_16.predicted_tok_s["diffusion_bound"] / int8_16.predicted_tok_s["diffusion_bound"]
    assert 1.05 < gain < 1.12


@pytest.mark.parametrize("dense", ["int8", "nf4"])
def test_shape_manifest_matches_what_the_quantizer_builds(dense: str) -> None:
    """manifest_for_geometry (stdlib arithmetic) against a real tiny model quantized by engine.weights.quant and counted by
    engine.placement.placer: the same tensor names, shapes and, for every quantized tensor, the same bytes."""
    torch = pytest.importorskip("torch")
    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.placement import placer
    from clover_desk.engine.weights.checkpoint import random_state_dict
    from clover_desk.engine.weights.quant import make_policy, quantize_model_
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    text = tiny_text_config(vocab_size=128, layers=4, hidden=64, experts=16, experts_per_tok=4)
    cfg = parse_config(config_dict_for("clover_moe", text, {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}))
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=3), strict=True)
    quantize_model_(model, make_policy(attention=dense, shared_expert=dense))
    counted = manifest_from_dict(placer.manifest_from_model(model))
    planned = manifest_for_geometry(ModelGeometry.from_config(cfg), make_policy(attention=dense, shared_expert=dense))
    got, want = counted.by_name(), planned.by_name()
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.kind == w.kind and g.layer == w.layer, name
        if w.format in ("nf4", "int8") or g.format in ("nf4", "int8"):
            assert (g.format, g.bytes) == (w.format, w.bytes), name
    assert counted.geometry.num_experts == 16 and counted.geometry.full_attention_layers == (3,)


def test_an_unquantized_model_is_planned_with_its_experts_and_their_gather() -> None:
    """``manifest_from_model`` of a model whose experts are not quantized lists them (as stored), and the workspace
    holds what the bank gathers at once: the top-k experts of an AR step, a block pass's group by expert (at most
    engine.model.experts.GROUP_BYTES on a GPU, the layer's experts, a block's pairs)."""
    torch = pytest.importorskip("torch")
    from clover_desk.engine.model import experts
    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.placement import placer
    from clover_desk.engine.weights.checkpoint import random_state_dict
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    text = tiny_text_config(vocab_size=128, layers=2, hidden=64, experts=16, experts_per_tok=4, moe_intermediate=32)
    cfg = parse_config(config_dict_for("clover_moe", text, {"<|endoftext|>": 1, "<|im_end|>": 2, "<|mask|>": 3, "</think>": 4}))
    model = CloverModel(cfg, dtype=torch.float32, device="cpu")
    model.load_state_dict(random_state_dict(cfg, seed=3), strict=True)
    counted = manifest_from_dict(placer.manifest_from_model(model))
    per_expert = 3 * 64 * 32 * 4  # fp32
    assert counted.expert_layer_bytes() == {0: 16 * per_expert, 1: 16 * per_expert}
    facts = planner.model_facts(counted, "fp32")
    assert not facts.experts_quantized and facts.expert_params == 3 * 64 * 32
    parts, _ = planner.workspace(facts, CTX, 32)
    assert parts["gather_experts"] == 16 * per_expert  # a block's 128 pairs could use all 16 experts: one group
    assert parts["dequant_experts"] == 0
    assert planner.GATHER_GROUP_BYTES == experts.GROUP_BYTES["cuda"]
    big = dataclasses.replace(facts, expert_params=float(3 * 2048 * 512))  # the 35B's experts, unquantized in fp32
    assert planner.workspace(big, CTX, 32)[0]["gather_experts"] == (96 << 20) // (3 * 2048 * 512 * 4) * 3 * 2048 * 512 * 4


def test_one_policy_table_for_the_quantizer_and_the_planner() -> None:
    pytest.importorskip("torch")
    from clover_desk.engine.weights import formats, quant

    assert quant.make_policy is formats.make_policy and quant.QuantPolicy is formats.QuantPolicy
    assert planner.make_policy is formats.make_policy
    # the planner counts the bytes the quantizer's table implies, rule by rule
    m = manifest_for_shape("clover-35b-a3b")
    policy = formats.DEFAULT_POLICY
    for e in m:
        if e.kind != "expert":
            stored = "fp32" if e.name.endswith(("A_log", "linear_attn.norm.weight")) else "bf16"
            assert e.format == policy.stored_format(e.name, e.shape, stored), e.name


def test_json_friendly_roofline_shortcuts(m35: planner.Manifest) -> None:
    by_object = make_plan(m35, 12 * GiB, CTX, roofline=Roofline.with_coreset(tokens_per_pass=4.0))
    by_flags = make_plan(m35, 12 * GiB, CTX, coreset=True, tokens_per_pass=4.0)
    by_dict = make_plan(m35, 12 * GiB, CTX, roofline={"distinct_experts_per_pass": 30.0, "tokens_per_pass": 4.0})
    assert by_object.to_dict() == by_flags.to_dict() == by_dict.to_dict()
    assert by_flags.assumptions["distinct_experts_per_pass"] == 30.0
    with pytest.raises(PlanError, match="unknown field.*tpf"):
        make_plan(m35, 12 * GiB, CTX, roofline={"tpf": 3})
    with pytest.raises(ValueError, match="pcie_gbps.*0"):
        Hardware(pcie_gbps=0)


def test_a_model_without_routed_experts_plans_cleanly(m35: planner.Manifest) -> None:
    dense = planner.Manifest(tuple(e for e in m35 if e.kind != "expert"), m35.geometry, "dense")
    plan = make_plan(dense, 8 * GiB, CTX)
    assert plan.fits and plan.resident_expert_layers == plan.streamed_expert_layers == []
    assert plan.slot_pool_experts == 0 and plan.vram_breakdown["resident_experts"] == 0
    assert plan.ram_breakdown["streamed_experts"] == 0
    assert all(v > 0 for v in plan.predicted_tok_s.values())


def test_a_checkpoint_is_planned_as_it_will_be_quantized(tiny_checkpoint: tuple[Path, dict], m35: planner.Manifest) -> None:
    stored_policy = make_policy(experts="bf16", attention="bf16", shared_expert="bf16", lm_head="bf16")
    stored_35b = manifest_for_shape("clover-35b-a3b", stored_policy)
    assert stored_35b.total_bytes(["expert"]) == 2 * ALL_EXPERT_PARAMS
    assert planner.quantize_manifest(stored_35b).entries == m35.entries
    folder, _ = tiny_checkpoint
    as_stored = planner.manifest_for_model_dir(folder, as_stored=True)
    quantized = planner.manifest_for_model_dir(folder)
    assert as_stored.entries == manifest_from_checkpoint(folder).entries
    assert quantized.by_name()["layers.0.mlp.experts.gate_up_proj"].format == "nf4"
    assert quantized.total_bytes(["expert"]) * 3 < as_stored.total_bytes(["expert"])
    assert quantized.by_name()["norm.weight"] == as_stored.by_name()["norm.weight"]
    cache = folder / ".clover-cache" / "0123abcd"  # engine.weights.quant_cache's layout: weights.safetensors + manifest.json
    cache.mkdir(parents=True)
    write_safetensors_by_hand(cache / "weights.safetensors", {"norm.weight": ("BF16", (32,))})
    data = _cache_json(quantized)
    data["source"] = {"model_dir": str(folder)}
    (cache / "manifest.json").write_text(json.dumps(data))
    from_cache = planner.manifest_for_model_dir(cache)
    assert from_cache.entries == quantized.entries
    assert from_cache.geometry == quantized.geometry  # config.json found through source.model_dir
    with pytest.raises(CheckpointError, match="no such file or folder"):
        planner.manifest_for_model_dir(folder / "missing")


def test_a_prefills_peak_is_its_projections_or_its_experts_grouped_by_expert(m35: planner.Manifest) -> None:
    """engine.model.experts._moe_sorted lays a chunk's (token, expert) pairs out by expert, each expert of a group padded
    to the group's busiest: with small experts and top-8 that, not the projections, is a layer's peak (the mid
    shape's measured prefill: bench_count's test). The 35B's Gated DeltaNet projections stay its peak."""
    import dataclasses

    geo = m35.geometry
    widest = 2048 * planner._widest(geo) * 4 * planner.ACTIVATION_BUFFERS
    assert planner._moe_scratch(geo, 2048, 16) < widest
    assert planner._prefill_parts(geo, 2048, CTX, "efficient")["activations"] == widest
    small = dataclasses.replace(geo, hidden_size=512, moe_intermediate_size=256, num_experts=64, linear_num_value_heads=4,
                                linear_num_key_heads=2, num_attention_heads=4, shared_expert_intermediate_size=256)
    pairs, padded = 2048 * 8, 2 * 2048 * 8  # one group of all 64 experts, padded to twice the average
    expected = 4 * (2 * pairs * 512 + padded * (512 + 4 * 256) + 2048 * (3 * 512 + 2 * 64))
    assert planner._moe_scratch(small, 2048, 64) == expected
    assert planner._prefill_parts(small, 2048, CTX, "efficient", 64)["activations"] == expected
    # a group of 16 pads 16 experts at a time: a quarter of the padded rows
    assert planner._moe_scratch(small, 2048, 16) == expected - 4 * (padded * 3 // 4) * (512 + 4 * 256)
    # top-16 over these experts would not fit the prefill budget at 2,048 tokens: the chunk shrinks until it does
    wide = dataclasses.replace(small, num_experts_per_tok=16)
    chunk = planner.choose_prefill_chunk(wide, CTX, 32, "efficient", 64)
    assert planner.choose_prefill_chunk(small, CTX, 32, "efficient", 64) == 2048 and chunk < 2048
    def parts(c: int) -> dict[str, int]:
        return planner._prefill_parts(wide, c, CTX, "efficient", 64)

    assert parts(chunk)["activations"] == planner._moe_scratch(wide, chunk, 64)  # the experts are the peak
    assert sum(parts(chunk).values()) <= planner.PREFILL_WORKSPACE_BYTES < sum(parts(chunk + 32).values())
