"""``clover-desk bench load``: convert and load a model under a plan, and print what it cost next to what the plan
said: peak host RSS of the conversion and of the load (each in its own process), the quantized cache's size, the
plan's RAM figure, and each part's planned bytes next to the bytes placed.

    clover-desk bench load --model DIR --vram-gb N [--ctx N] [--device cpu|cuda] [--dtype ...] [--keep-cache] [--json]

Made for the real-width checkpoints of ``clover-desk make-tiny DIR --shape clover-35b-a3b --layers N``: pick a
budget that streams some layers and keeps others (the plan line says which). The conversion is timed from scratch
unless ``--keep-cache`` (the cache is removed first). Exit status: 0 measured, 2 bad input, 3 the plan does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clover_desk.cli import flags
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.settings import GpuPaths

GIB = 1 << 30
MIB = 1 << 20
LOAD_RSS_LIMIT = int(1.5 * GIB)  # the one-plan issue's bounds: load within cache + 1.5 GiB,
CONVERT_RSS_LIMIT = int(2.5 * GIB)  # conversion within cache + 2.5 GiB
_PARTS = ("non_expert", "resident_experts", "expert_slots")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, metavar="DIR", help="a Hugging Face model folder")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, required=True, metavar="N", help="VRAM budget in GiB to plan for")
    parser.add_argument("--ctx", type=flags.TOKENS, default=DEFAULT_CTX_TOKENS, metavar="N", help=f"context (default {DEFAULT_CTX_TOKENS})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the plan's device part goes")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype (default bfloat16, the dtype the plan counts KV and activations in)")
    parser.add_argument("--keep-cache", action="store_true", help="reuse an existing quantized cache")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def _child(argv: list[str]) -> tuple[dict[str, Any], int, float]:
    """Run one stage in a fresh interpreter: (its JSON result, its peak RSS in bytes, wall seconds)."""
    if not hasattr(os, "wait4"):  # the child's own peak RSS comes from wait4's rusage (Linux/macOS)
        raise SystemExit("clover-desk bench load: needs os.wait4 (Linux or macOS) to measure each stage's peak RSS")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:  # files: a full pipe cannot stall it
        proc = subprocess.Popen([sys.executable, "-m", "clover_desk.bench.load", *argv], stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS, not the parent's
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read().decode(), err_f.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"bench load stage {argv[0]} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}), usage.ru_maxrss * 1024, wall


def _stage(argv: list[str]) -> int:
    """The child side: ``baseline``, ``convert DIR DEVICE`` or ``load DIR PLAN.json DEVICE DTYPE``."""
    import torch

    from clover_desk.engine.weights import quant_cache

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    stage = argv[0]
    if stage == "baseline":
        from clover_desk.engine.api import Engine  # noqa: F401 - what the other stages import before their work

        print(json.dumps({}))
        return 0
    if stage == "convert":
        report = quant_cache.ensure_cache(Path(argv[1]), device=argv[2])
        print(json.dumps({"cache": str(report.path), "rebuilt": report.rebuilt}))
        return 0
    from clover_desk.engine.api import Engine
    from clover_desk.engine.placement.offload_runtime import runtime_of

    plan = json.loads(Path(argv[2]).read_text(encoding="utf-8"))
    engine = Engine.load(argv[1], device=argv[3], precision="nf4", placement=plan, dtype=argv[4],
                         gpu_paths=GpuPaths.from_env())
    rt = runtime_of(engine.model)
    assert rt is not None
    embed = engine.model.embed_tokens.weight  # kept in host RAM by the plan unless tied to lm_head
    host_embed = 0 if engine.config.tie_word_embeddings else embed.numel() * embed.element_size()
    cache = engine.model.new_cache(int(plan["ctx_tokens"]))
    placed = {
        **{k: rt.ledger.by_kind.get(k, 0) for k in _PARTS},
        "streamed_experts_host": sum(s.nbytes for s in rt.stores.values()),
        "pinned_host": sum(s.nbytes for s in rt.stores.values() if s.pinned),
        "embed_host": host_embed,
        "kv_and_state": cache.nbytes(),
    }
    print(json.dumps(placed))
    return 0


def measure(model: Path, vram_budget_bytes: int, ctx: int, device: str, dtype: str, keep_cache: bool) -> dict[str, Any]:
    """Plan, convert, load; every figure the command prints."""
    from clover_desk.engine.placement.planner import plan_model, probe_hardware
    from clover_desk.engine.weights import quant_cache_files
    from clover_desk.engine.weights.formats import policy_for

    # the cache the load will read is quantized by the device's policy (the CPU's head in Q6_K): planned as such
    plan = plan_model(model, vram_budget_bytes, ctx, probe_hardware(), policy=policy_for(device))
    result: dict[str, Any] = {"plan": plan.to_dict()}
    if not plan.fits:
        return result
    cdir = quant_cache_files.cache_dir_for(model)
    if not keep_cache and cdir.exists():
        shutil.rmtree(cdir)
    _, baseline_rss, _ = _child(["baseline"])
    conv, convert_rss, convert_s = _child(["convert", str(model), device])
    cache_bytes = (Path(conv["cache"]) / quant_cache_files.DATA_NAME).stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan.to_dict()), encoding="utf-8")
        placed, load_rss, load_s = _child(["load", str(model), str(plan_file), device, dtype])
    result.update(
        baseline_rss=baseline_rss,
        convert_rss=convert_rss,
        convert_s=round(convert_s, 2),
        converted=bool(conv.get("rebuilt")),
        load_rss=load_rss,
        load_s=round(load_s, 2),
        cache_bytes=cache_bytes,
        placed=placed,
        load_within=load_rss <= cache_bytes + LOAD_RSS_LIMIT,
        convert_within=convert_rss <= cache_bytes + CONVERT_RSS_LIMIT,
    )
    return result


def _g(n: float) -> str:
    return f"{n / GIB:8.3f} GiB"


def format_result(r: dict[str, Any]) -> str:
    p = r["plan"]
    lines = [
        f"plan: {len(p['resident_expert_layers'])} expert layers resident {p['resident_expert_layers']}, "
        f"{len(p['streamed_expert_layers'])} streamed {p['streamed_expert_layers']}, {p['slot_pool_experts']} slots; "
        f"VRAM {p['vram_used_bytes'] / GIB:.3f} of {p['vram_budget_bytes'] / GIB:.3f} GiB; RAM {p['ram_bytes'] / GIB:.3f} GiB",
    ]
    if not p["fits"]:
        return "\n".join([*lines, f"does not fit: {p['reason']}"])
    placed, b = r["placed"], p["vram_breakdown"]
    lines += ["", f"  {'part':<28}{'planned':>14}{'placed':>14}"]
    for key in _PARTS:
        lines.append(f"  {key:<28}{_g(b[key]):>14}{_g(placed[key]):>14}")
    lines.append(f"  {'streamed experts (host)':<28}{_g(p['ram_breakdown']['streamed_experts']):>14}"
                 f"{_g(placed['streamed_experts_host']):>14}")
    lines.append(f"  {'embedding (host)':<28}{_g(p['ram_breakdown']['embed']):>14}{_g(placed['embed_host']):>14}")
    lines.append(f"  {'KV cache + GDN state':<28}{_g(b['kv_cache'] + b['gdn_state']):>14}{_g(placed['kv_and_state']):>14}")
    cache = r["cache_bytes"]
    lines += [
        "",
        f"quantized cache: {_g(cache)}   plan's RAM figure: {_g(p['ram_bytes'])}   python+torch baseline RSS: "
        f"{_g(r['baseline_rss'])}",
        f"conversion: peak RSS {_g(r['convert_rss'])} (cache {(r['convert_rss'] - cache) / GIB:+.3f} GiB; bound cache "
        f"+ 2.5 GiB: {'ok' if r['convert_within'] else 'OVER'}) in {r['convert_s']:.1f} s"
        + ("" if r["converted"] else " (cache reused)"),
        f"load:       peak RSS {_g(r['load_rss'])} (cache {(r['load_rss'] - cache) / GIB:+.3f} GiB; bound cache "
        f"+ 1.5 GiB: {'ok' if r['load_within'] else 'OVER'}) in {r['load_s']:.1f} s",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError

    if not args.model.is_dir():
        print(f"clover-desk bench load: error: --model {args.model}: not a model folder", file=sys.stderr)
        return 2
    if not args.vram_budget_bytes > 0 or args.ctx <= 0:
        print("clover-desk bench load: error: --vram-gb and --ctx must be positive", file=sys.stderr)
        return 2
    try:
        result = measure(args.model, args.vram_budget_bytes, args.ctx, args.device, args.dtype, args.keep_cache)
    except (CloverError, RuntimeError) as exc:
        print(f"clover-desk bench load: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_result(result))
    return 0 if result["plan"]["fits"] else 3


if __name__ == "__main__":
    sys.exit(_stage(sys.argv[1:]))
