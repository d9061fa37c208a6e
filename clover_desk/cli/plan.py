"""``clover-desk plan``: where a model's bytes go for a VRAM budget, and the predicted speed.

    clover-desk plan (--model DIR | --shape clover-35b-a3b) [--vram-gb N] [--ctx N] [--ram-gb N] [--json]

``--vram-gb`` / ``--ram-gb`` are GiB (2**30 bytes) the process may use: pass the card's *free* VRAM, not its
total; without it, the card's free VRAM, or a 16 GiB card when no NVIDIA GPU is found. The plan is the one
``engine.placement.planner.plan_model`` makes, the function the window and the engine use, so ``--json`` prints exactly the
plan ``generate --vram-gb N --json`` announces and loads on this machine. ``--model`` takes a Hugging Face model folder (safetensors headers are read, never the weights), a quantized
cache folder (``<model>/.clover-cache/<policy hash>/``, holding ``manifest.json``), or that manifest file itself; a checkpoint is planned as it will be after
quantization (``--dense`` picks the projections' format; ``--as-stored`` plans the bytes in its files).

Exit status: 0 the plan fits; 3 it does not fit (the reason and the smallest budget that fits are printed, and
in ``--json`` the plan has ``"fits": false``); 2 bad input (a missing folder, a malformed file, a bad number).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from clover_desk.cli import flags
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.errors import CloverError
from clover_desk.engine.placement.hardware import DEFAULT_HARDWARE
from clover_desk.engine.placement.planner import (
    CPU_EXPERTS,
    SHAPE_PREFIX,
    SHAPES,
    GiB,
    Manifest,
    MiB,
    Plan,
    Roofline,
    manifest_for_model_dir,
    plan_model,
    probe_hardware,
)
from clover_desk.engine.weights.formats import make_policy

log = logging.getLogger(__name__)

EXIT_FITS = 0
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3

_PARTS = (
    ("non_expert", "non-expert weights"),
    ("resident_experts", "resident experts"),
    ("expert_slots", "expert slot pool"),
    ("kv_cache", "KV cache"),
    ("gdn_state", "GDN state"),
    ("workspace", "workspace"),
    ("reserve", "reserve (CUDA ctx + slack)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, metavar="DIR", help="model folder, quantized cache folder, its manifest.json, or a .gguf file (planned as stored)")
    source.add_argument("--shape", choices=sorted(SHAPES), help="plan a known model shape without its files")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, metavar="N", help="VRAM budget in GiB (default: the card's free memory, or 16 without a GPU)")
    parser.add_argument("--ctx", type=flags.TOKENS, default=DEFAULT_CTX_TOKENS, metavar="N", help=f"context tokens to hold (default {DEFAULT_CTX_TOKENS})")
    parser.add_argument("--ram-gb", type=flags.GIB, metavar="N", help="free system RAM in GiB (default: what is free now)")
    parser.add_argument("--dense", choices=("nf4", "int8"), default="int8", help="format of the attention, GDN and shared-expert projections when quantizing (--shape, or a checkpoint folder; default int8)")
    parser.add_argument("--as-stored", action="store_true", help="plan a checkpoint folder with the bytes in its files instead of as quantized")
    parser.add_argument("--tokens-per-pass", type=flags.TOKENS_PER_PASS, default=Roofline.tokens_per_pass, metavar="X", help="committed tokens per denoising pass (default %(default)s)")
    parser.add_argument("--coreset", action="store_true", help="predict with Clover's block expert coreset (~30 distinct experts per pass instead of ~70)")
    parser.add_argument("--attention", choices=("efficient", "math"), default="efficient", help="prefill attention kernel to plan for: 'efficient' is the engine's (SDPA's memory-efficient kernel, no score matrix), 'math' SDPA's fallback with fp32 score scratch")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype the device part is counted in (default bfloat16, as on a GPU)")
    parser.add_argument("--cpu-experts", choices=CPU_EXPERTS, default="auto", help="compute the streamed layers' experts on the CPU where they lie, as llama.cpp's --n-cpu-moe: 'auto' where the speed model predicts more tok/s, per mode (AR steps, diffusion passes); 'never'; 'always' (default auto)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (Plan.to_dict())")
    parser.add_argument("--budget-table", action="store_true",
                        help="print the README's per-card table for --shape (8/12/16/24 GB cards, the default card's "
                             "bandwidths, RAM not limited)")


def _model(args: argparse.Namespace) -> str | Path | Manifest:
    """What to plan: a known shape, a quantized cache (as written), or a checkpoint (as quantized, or as stored)."""
    if args.shape:
        return SHAPE_PREFIX + args.shape
    path: Path = args.model
    if not path.exists():
        raise FileNotFoundError(f"--model {path}: no such file or folder")
    if args.as_stored:
        return manifest_for_model_dir(path, as_stored=True)
    return path


def _layers(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    if not layers:
        return "none"
    runs: list[str] = []
    start = prev = layers[0]
    for x in [*layers[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(runs)


def format_plan(plan: Plan) -> str:
    """The human table of one plan."""
    a = plan.assumptions
    lines = [
        f"Plan for {plan.model}: VRAM budget {plan.vram_budget_bytes / GiB:.2f} GiB, context {plan.ctx_tokens:,} tokens",
        "",
        f"  {'part':<36}{'MiB':>12}{'GiB':>10}",
    ]
    for key, label in _PARTS:
        n = plan.vram_breakdown[key]
        if key == "expert_slots":
            label = f"{label} ({plan.slot_pool_experts} x {a['expert_slot_bytes'] / MiB:.4g} MiB)"
        lines.append(f"  {label:<36}{n / MiB:>12,.1f}{n / GiB:>10.3f}")
    lines.append(f"  {'total':<36}{plan.vram_used_bytes / MiB:>12,.1f}{plan.vram_used_bytes / GiB:>10.3f}")
    lines.append("")
    n_res, n_str = len(plan.resident_expert_layers), len(plan.streamed_expert_layers)
    lines.append(f"Experts: {n_res} layers resident [{_layers(plan.resident_expert_layers)}]")
    lines.append(f"         {n_str} layers streamed [{_layers(plan.streamed_expert_layers)}]")
    ram = plan.ram_breakdown
    avail = f" of {plan.ram_available_bytes / GiB:.2f} GiB given" if plan.ram_available_bytes is not None else ""
    lines.append(
        f"RAM needed: {plan.ram_bytes / GiB:.2f} GiB{avail} (streamed experts {ram['streamed_experts'] / GiB:.2f}, "
        f"embedding {ram['embed'] / GiB:.2f}, staging {ram['staging'] / GiB:.2f} GiB; not counting the Python/torch "
        f"process itself)"
    )
    tok = plan.predicted_tok_s
    lines.append(
        f"Predicted: AR {tok['ar']:.1f} tok/s, diffusion {tok['diffusion']:.1f} tok/s "
        f"(hardware bound without eager-PyTorch overheads: AR {tok['ar_bound']:.0f}, diffusion {tok['diffusion_bound']:.0f})"
    )
    if "ar_graphs" in tok:
        lines.append(
            f"  layers compiled, passes replayed from CUDA graphs: AR {tok['ar_graphs']:.1f} tok/s, diffusion "
            f"{tok['diffusion_graphs']:.1f} tok/s; with the fused MoE kernel too: AR {tok['ar_graphs_fused']:.1f}, "
            f"diffusion {tok['diffusion_graphs_fused']:.1f}"
            + (f"; AR reading streamed experts in place (zero-copy): {tok['ar_graphs_zero_copy']:.1f}; AR through "
               f"device slot tables: {tok['ar_graphs_device_pool']:.1f}, diffusion through them (fused MoE): "
               f"{tok['diffusion_graphs_device_pool']:.1f}"
               if plan.streamed_expert_layers and "ar_graphs_device_pool" in tok else "")
        )
    if plan.streamed_expert_layers:
        where = {"ar": "AR steps", "pass": "diffusion passes"}
        chosen = " and ".join(where[m] for m in plan.cpu_experts) or "neither mode"
        lines.append(
            f"  streamed layers' experts on the CPU (as llama.cpp's --n-cpu-moe): {chosen}; predicted AR "
            f"{tok['ar_cpu_experts']:.1f} tok/s, diffusion {tok['diffusion_cpu_experts']:.1f} that way "
            f"(CPU {a['cpu_expert_gbps']:g} GB/s, {a['cpu_gflops']:g} GFLOP/s assumed)"
        )
    gpu = a["gpu_name"] or "no GPU detected: assumed 16 GB RTX card"
    lines.append(
        f"  inputs: {gpu}; PCIe {a['pcie_gbps']:.1f} GB/s, VRAM {a['vram_gbps']:.0f} GB/s; {a['tokens_per_pass']:g} tokens/pass; "
        f"{a['distinct_experts_per_pass']:g} distinct experts/layer/pass, {a['distinct_experts_per_block_layer']:g} per block"
    )
    lines.append(
        f"Prefill: {tok['prefill']:.0f} tok/s, at most {plan.prefill_chunk_tokens:,} tokens per forward "
        f"({a['workspace_details']['attention_path']} attention kernel)"
    )
    lines.append("")
    if plan.fits:
        lines.append(f"Fits. Smallest budget that fits: {plan.min_vram_bytes / GiB:.3f} GiB ({plan.min_vram_bytes:,} bytes)")
    else:
        lines.append(f"Does not fit: {plan.reason}")
    return "\n".join(lines)


BUDGET_TABLE_GB = (8, 12, 16, 24)


def budget_table(model: str, ctx: int) -> str:
    """The README's table: for each card size, where the experts go, the RAM they need and the planner's predicted
    speeds (a roofline, not a measurement), on the assumed desktop card (hardware.DEFAULT_HARDWARE) with RAM not
    limited, so the table is the same on every machine."""
    rows = [
        "| card (VRAM budget) | expert layers on the GPU / streamed | RAM needed | predicted AR / diffusion tok/s "
        "(layers compiled, CUDA graphs) |",
        "|---|---|---|---|",
    ]
    for gb in BUDGET_TABLE_GB:
        plan = plan_model(model, gb * GiB, ctx, DEFAULT_HARDWARE)
        if not plan.fits:
            rows.append(f"| {gb} GB | does not fit | | |")
            continue
        tok = plan.predicted_tok_s
        speed = (f"{tok['ar_graphs']:.0f} / {tok['diffusion_graphs']:.0f}" if "ar_graphs" in tok
                 else f"{tok['ar']:.0f} / {tok['diffusion']:.0f}")
        rows.append(f"| {gb} GB | {len(plan.resident_expert_layers)} / {len(plan.streamed_expert_layers)} | "
                    f"{plan.ram_bytes / GiB:.1f} GiB | {speed} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    if args.budget_table:
        if not args.shape:
            print("clover-desk plan: error: --budget-table needs --shape", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(budget_table(_model(args), args.ctx))
        return EXIT_FITS
    try:
        # the flags' types (clover_desk.cli.flags) already refused non-finite, out-of-range and non-positive values
        vram = args.vram_budget_bytes
        ram = None if args.ram_gb is None else int(round(args.ram_gb * GiB))
        hardware = probe_hardware()
        if ram is not None:
            hardware = dataclasses.replace(hardware, ram_available_bytes=ram)
        roofline = Roofline.with_coreset(tokens_per_pass=args.tokens_per_pass) if args.coreset else Roofline(tokens_per_pass=args.tokens_per_pass)
        policy = make_policy(attention=args.dense, shared_expert=args.dense)
        plan = plan_model(
            _model(args), vram, args.ctx, hardware, policy=policy, roofline=roofline, attention=args.attention,
            compute_dtype="bf16" if args.dtype == "bfloat16" else "fp32", cpu_experts=args.cpu_experts,
        )
    except (CloverError, OSError, ValueError) as exc:
        print(f"clover-desk plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT
