"""The worker's load and plan work: a checked ``load`` command into an engine (its plan made here from a budget
when the window sent none), a ``plan`` command into a ``plan`` record.

The planner and ``engine.api`` are imported when first used (``importlib``), so starting the worker and reading
commands does not wait for torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from clover_desk.engine.decode.events import LoadProgress, to_dict
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS
from clover_desk.engine.settings import GpuPaths
from clover_desk.worker.protocol import ProtocolError, show_value
from clover_desk.worker.reports import json_safe, plan_dict

LOAD_PROGRESS_INTERVAL_S = 0.05  # at most ~20 load_progress records a second (stage changes always go out)

Emit = Callable[[dict[str, Any]], None]


def device_and_dtype(command: dict[str, Any]) -> tuple[str, str]:
    """A load's device and dtype (null: "cpu", "float32")."""
    return command.get("device") or "cpu", command.get("dtype") or "float32"


def throttled_progress(emit: Emit) -> Callable[[LoadProgress], None]:
    """A load's progress callback: one ``load_progress`` record per stage change, at the end, and otherwise at
    most every :data:`LOAD_PROGRESS_INTERVAL_S`."""
    last = [0.0, ""]

    def progress(p: LoadProgress) -> None:
        now = time.monotonic()
        done = p.stage == "done" or (p.total_bytes > 0 and p.done_bytes >= p.total_bytes)
        if p.stage != last[1] or done or now - last[0] >= LOAD_PROGRESS_INTERVAL_S:
            last[0], last[1] = now, p.stage
            emit(to_dict(p))

    return progress


def load_engine(
    command: dict[str, Any], cancel: threading.Event, factory: Callable[..., Any], gpu_paths: GpuPaths, emit: Emit,
) -> Any:
    """The engine a checked ``load`` asks for, from ``factory`` (Engine.load's signature). Its plan (sent, or made
    here from a budget with the same planning function) goes out as a ``plan`` record before the weights are read.
    Raises whatever the factory raises."""
    model_dir = command["model_dir"]
    device, dtype = device_and_dtype(command)
    plan = command.get("plan")
    vram_budget_bytes = command.get("vram_budget_bytes")
    if plan is None and vram_budget_bytes is not None:  # a budget without the plan: make it here, the same way
        layout = {"gguf_layout": command["gguf_layout"]} if command.get("gguf_layout") is not None else {}
        plan = importlib.import_module("clover_desk.engine.api").plan_for(
            model_dir, vram_budget_bytes, command_ctx(command), dtype, device=device, **layout)
    if plan is not None:
        emit({"event": "plan", "op": "load", "plan": json_safe(plan_dict(plan))})
    extra: dict[str, Any] = {"placement": plan} if plan is not None else {}
    if command.get("precision") is not None:  # how the weights are held (Engine.load): never implied by a plan
        extra["precision"] = command["precision"]
    if command.get("gguf_layout") is not None:
        extra["gguf_layout"] = command["gguf_layout"]
    if command.get("compile"):  # only when asked: an --engine-factory need not know the keyword
        extra["compile"] = True
    if plan is None and command.get("ctx_tokens"):  # no plan: the context asked for still holds
        extra["ctx_tokens"] = int(command["ctx_tokens"])
    return factory(model_dir, device=device, dtype=dtype, progress=throttled_progress(emit), cancel=cancel,
                   gpu_paths=gpu_paths, **extra)


def loaded_record(command: dict[str, Any], engine: Any, load_s: float, gpu_paths: GpuPaths) -> dict[str, Any]:
    """The ``loaded`` record of a model ``command`` loaded as ``engine`` in ``load_s`` seconds."""
    device, dtype = device_and_dtype(command)
    return {
        "event": "loaded",
        "model_dir": str(command["model_dir"]),
        "device": device,
        "dtype": dtype,
        "precision": json_safe(getattr(engine, "precision", None)),  # how the weights are held (engine.defaults.PRECISIONS)
        "vram_budget_bytes": command.get("vram_budget_bytes"),
        "load_s": round(load_s, 3),
        "config": json_safe(getattr(engine, "config", None)),
        "generation_defaults": json_safe(getattr(engine, "generation_defaults", None)),
        "plan": json_safe(plan_dict(getattr(engine, "plan", None))),
        "ctx_tokens": getattr(engine, "ctx_limit", None) or None,  # the context requests are held to
        "ar_only": json_safe(getattr(engine, "ar_only", None)),  # why diffusion is refused, or null
        "compiled": bool(getattr(engine, "compiled", False)),
        "compile_cancelled": bool(getattr(engine, "compile_cancelled", False)),
        "compile_skipped": json_safe(getattr(engine, "compile_skipped", None)),  # why not compiled, or null
        # why quantized weights on the CPU run without the CPU kernels (~30x slower), or null
        "cpu_kernels_missing": json_safe(getattr(engine, "cpu_kernels_missing", None)),
        "gpu_paths": gpu_paths.opt_in(),  # the experimental GPU paths this process runs with
    }


def plan_record(command: dict[str, Any]) -> dict[str, Any]:
    """The ``plan`` record answering a checked ``plan`` command (raises what planning raises)."""
    planner = importlib.import_module("clover_desk.engine.placement.planner")
    args = {k: v for k, v in command.items() if k not in ("cmd", "id", "model_dir")}
    plan, hardware = make_plan(planner, command.get("model_dir"), args)
    return {"event": "plan", "id": command.get("id"), "plan": json_safe(plan_dict(plan)),
            "hardware": json_safe(hardware)}


def command_ctx(command: dict[str, Any]) -> int:
    """The context a command plans for (``ctx`` or ``ctx_tokens``; default engine.defaults.DEFAULT_CTX_TOKENS)."""

    value = command.get("ctx", command.get("ctx_tokens"))
    if value is None:
        return DEFAULT_CTX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ctx_tokens must be a positive number of tokens, got {value!r}")
    return value


def make_plan(planner: Any, model_dir: str | None, args: dict[str, Any]) -> tuple[Any, Any]:
    """``engine.placement.planner.plan_model`` for ``model_dir`` under the command's budgets (VRAM in bytes, RAM in
    GiB; ``None``: what this machine has free). Returns ``(plan, hardware)``; keys other than the budgets and the context go to
    ``make_plan`` as is (``block_size``, ``coreset``, ``optimize_for``...)."""
    if not model_dir:
        raise ProtocolError("plan needs field 'model_dir': a non-empty folder path or shape name (string)")
    options = [
        p.name for p in inspect.signature(planner.make_plan).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "hardware"
    ]
    for key in args:
        if key not in (*options, "vram_budget_bytes", "ram_gb", "ctx", "ctx_tokens"):
            raise ProtocolError(
                f"plan has unknown field {show_value(key)}; its fields are: id, model_dir, vram_budget_bytes, ram_gb, "
                f"ctx, ctx_tokens, {', '.join(options)}"
            )
    hardware = planner.probe_hardware()
    ctx = command_ctx(args)
    vram_budget_bytes, ram_gb = args.pop("vram_budget_bytes", None), args.pop("ram_gb", None)
    for key in ("ctx", "ctx_tokens"):
        args.pop(key, None)
    if ram_gb is not None:
        hardware = dataclasses.replace(hardware, ram_available_bytes=int(float(ram_gb) * 1024**3))
    plan = planner.plan_model(model_dir, vram_budget_bytes, ctx, hardware, **args)
    return plan, hardware
