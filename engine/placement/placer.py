"""Plan application: place a model as the planner's plan says, and switch how its streamed experts are fetched.

Placement (``place_model`` / ``apply_plan``): the planner decides which MoE layers keep all their experts on the
device ("resident") and which are "streamed", and how many expert slots the device pool has. Every tensor is read
once from its source (the model itself, the quantized cache, a GGUF file) straight into its final place: the
device, a host row store per streamed layer (``engine.placement.expert_store``), or host RAM (the embedding).
Streamed layers get a :class:`~engine.placement.streamed_bank.StreamedExpertBank` over the one slot pool
(``engine.placement.slot_pool``); the model keeps its :class:`~engine.placement.offload_runtime.OffloadRuntime`.

Expert fetch switches, per placed model (``engine.settings.GpuPaths.expert_fetch``, passed to ``place_model``):
zero-copy reads (``set_zero_copy``, opt-in on CUDA: ``expert_fetch="zero_copy"`` or ``zero_copy=True``), device
slot tables (``set_device_pool``, opt-in on CUDA: ``expert_fetch="device_tables"`` or ``device_pool=True``;
exclusive with zero-copy), and the modes whose experts run on the CPU (``set_cpu_experts``, the plan's
``cpu_experts``). What each does: ``engine.placement.streamed_bank``.

``manifest_from_model`` counts a loaded model as a planner manifest.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from clover_desk.engine.errors import PlanError
from clover_desk.engine.model.experts import DenseExpertBank, ExpertBank
from clover_desk.engine.placement.device_pool import DeviceSlotTables
from clover_desk.engine.placement.expert_store import (
    WINDOWS_PIN_BUDGET,
    HostExpertStore,
    PinBudget,
    StagingRing,
    alloc_host_rows,
    in_place_view,
)
from clover_desk.engine.placement.offload_runtime import OffloadRuntime, runtime_of
from clover_desk.engine.placement.planner import CPU_EXPERT_MODES, Plan
from clover_desk.engine.placement.slot_pool import DeviceLedger, SlotPool
from clover_desk.engine.placement.streamed_bank import StreamedExpertBank
from clover_desk.engine.settings import EXPERT_FETCH
from clover_desk.engine.weights.formats import format_of_torch_dtype
from clover_desk.engine.weights.quant import (
    QuantExpertBank,
    QuantLinear,
    QuantPolicy,
    RowExpertBank,
    set_submodule,
)

log = logging.getLogger(__name__)


@dataclass
class SimplePlan:
    """A plan written by hand (tests, benchmarks): the placement fields of ``engine.placement.planner.Plan``, under
    the same names, without the byte counts a planner makes."""

    resident_expert_layers: tuple[int, ...]
    streamed_expert_layers: tuple[int, ...]
    slot_pool_experts: int
    vram_breakdown: dict[str, int] = field(default_factory=dict)
    fits: bool = True
    reason: str = ""


_LAYER_RX = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")


def expert_banks(model: nn.Module) -> dict[int, tuple[str, ExpertBank]]:
    """{layer index: (module name, bank)} for every ``layers.N.mlp.experts`` bank."""
    out: dict[int, tuple[str, ExpertBank]] = {}
    for name, mod in model.named_modules():
        m = _LAYER_RX.search(name)
        if m and isinstance(mod, ExpertBank):
            out[int(m.group(1))] = (name, mod)
    return dict(sorted(out.items()))


def min_slot_pool(model: nn.Module) -> int:
    """Smallest pool that can run any forward: one whole layer (a prefill or a 32-slot pass may touch all E)."""
    banks = expert_banks(model)
    return max((b.num_experts for _, b in banks.values()), default=0)


def manifest_from_model(model: nn.Module, policy: QuantPolicy | None = None) -> dict[str, Any]:
    """A planner manifest (cache manifest format, ``version`` 1) counted from a loaded model: its quantized banks
    and projections as stored, an unquantized bank's stacked weights as they are (before, such a bank was left
    out, and a model with none quantized planned as if it had no experts)."""
    tensors: dict[str, dict[str, Any]] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, (QuantExpertBank, StreamedExpertBank)):
            lay = mod.layout
            gu = lay.gate_up_codes[1] + lay.gate_up_scales[1]
            e = lay.num_experts
            tensors[f"{prefix}gate_up_proj"] = {"shape": [e, *lay.gate_up_shape], "format": lay.fmt, "bytes": e * gu}
            tensors[f"{prefix}down_proj"] = {
                "shape": [e, *lay.down_shape],
                "format": lay.fmt,
                "bytes": e * (lay.nbytes - gu),
            }
        elif isinstance(mod, QuantLinear):
            nbytes = mod.codes.numel() * mod.codes.element_size() + mod.scales.numel() * 4
            tensors[f"{prefix}weight"] = {
                "shape": [mod.out_features, mod.in_features],
                "format": mod.fmt,
                "bytes": nbytes,
            }
            if mod.bias is not None:
                tensors[f"{prefix}bias"] = _plain_entry(mod.bias)
        elif isinstance(mod, DenseExpertBank) or not isinstance(mod, ExpertBank):
            for pname, p in mod.named_parameters(recurse=False):
                tensors[f"{prefix}{pname}"] = _plain_entry(p)
    return {
        "version": 1,
        "policy": policy.to_dict() if policy else {},
        "source": {"model": type(model).__name__},
        "tensors": tensors,
    }


def _plain_entry(t: Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "format": format_of_torch_dtype(t.dtype), "bytes": t.numel() * t.element_size()}


class TensorSource(Protocol):
    """Where placement reads a tensor's values from: the model's own tensors (:class:`ModelSource`) or the
    quantized cache file (``engine.weights.quant_cache.CacheSource``). Names are the model's state-dict names."""

    def dtype_of(self, name: str) -> torch.dtype: ...

    def fill(self, name: str, dst: Tensor) -> None: ...


class ModelSource:
    """The current tensors of a model already in memory (tests, benchmarks): placement copies from them."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}

    def dtype_of(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def fill(self, name: str, dst: Tensor) -> None:
        dst.copy_(self.tensors[name].detach())


def _iter_tensors(module: nn.Module, skip: set[int]) -> Iterator[tuple[nn.Module, str, str, Tensor, bool]]:
    """(owner module, attr, full name, tensor, is_param) for every param/buffer outside the skipped modules."""
    for mod_name, mod in module.named_modules():
        if id(mod) in skip:
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in mod.named_parameters(recurse=False):
            yield mod, pname, prefix + pname, p, True
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None:
                yield mod, bname, prefix + bname, b, False


def place_model(
    model: nn.Module,
    plan: Plan | SimplePlan,
    device: torch.device | str,
    source: TensorSource,
    *,
    pin: bool = True,
    pin_budget_bytes: int | None = None,
    staging_slots: int = 4,
    device_cap_bytes: int | None = None,
    prefetch: bool = True,
    host_embedding: bool = True,
    staging: bool | None = None,
    zero_copy: bool | None = None,
    device_pool: bool | None = None,
    expert_fetch: str = "pool",
    cpu_experts: list[str] | tuple[str, ...] | None = None,
) -> OffloadRuntime:
    """Place ``model`` exactly as ``plan`` says, reading every tensor once from ``source`` straight into its final
    place: the device (non-expert weights, resident experts, the slot pool), a host row store per streamed layer
    (page-locked on CUDA), or host RAM (the embedding table, kept in its stored dtype; only looked-up rows travel).

    ``model`` may be a skeleton on the meta device (loading from the quantized cache: nothing is in memory twice)
    or a model in memory (:func:`apply_plan`). Transactional: every tensor is created and filled first and the
    model is changed only when all succeeded, so an out-of-memory (real, or past ``device_cap_bytes``) leaves it as
    it was and raises :class:`OutOfMemory`. Never plans: the plan is placed as given.

    ``zero_copy``: AR steps read the streamed experts in place (:func:`set_zero_copy`); None: as ``expert_fetch``
    says ("zero_copy"), on CUDA only. ``device_pool``: AR steps fetch through device tables (:func:`set_device_pool`);
    None: as ``expert_fetch`` says ("device_tables"), on CUDA only. Not both. ``expert_fetch``: one of
    ``engine.settings.EXPERT_FETCH`` (``GpuPaths.expert_fetch``, what ``engine.api.Engine.load`` passes).
    ``cpu_experts``: the modes whose streamed experts run on the CPU where they lie (:func:`set_cpu_experts`);
    None: the plan's ``cpu_experts`` (none for a plan without the field)."""
    dev = torch.device(device)
    if not getattr(plan, "fits", True):
        raise PlanError(f"the plan does not fit: {getattr(plan, 'reason', '') or 'budget below the minimum'}")
    banks = expert_banks(model)
    streamed = tuple(sorted(int(i) for i in plan.streamed_expert_layers))
    unknown = [i for i in streamed if i not in banks]
    if unknown:
        raise PlanError(f"plan streams layers {unknown}, but the model has MoE layers {list(banks)}")
    resident = tuple(i for i in banks if i not in streamed)
    layouts = set()
    for i in streamed:
        bank = banks[i][1]
        if not isinstance(bank, RowExpertBank):  # NF4 / INT8 rows, or GGUF blocks (engine.weights.gguf.model)
            raise PlanError(
                f"layer {i}: only quantized expert banks can be streamed (got {type(bank).__name__}); "
                "load through the quantized cache"
            )
        layouts.add(bank.layout)
    if len(layouts) > 1:
        raise PlanError("streamed layers have different expert layouts; one slot pool needs one row size")
    slots = int(plan.slot_pool_experts) if streamed else 0
    need = min_slot_pool(model)
    if streamed and slots < need:
        raise PlanError(f"slot pool of {slots} experts is below the minimum {need} (one layer's experts)")

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    host_embedding = host_embedding and not tied  # a tied table is also lm_head's weight: it lives on the device
    ledger = DeviceLedger(dev, device_cap_bytes)
    skip = {id(banks[i][1]) for i in streamed}
    placed: list[tuple[nn.Module, str, Tensor, bool]] = []
    host_keep = 0
    done: dict[int, Tensor] = {}  # tied parameters (lm_head = embed_tokens) are placed once
    for owner, attr, name, t, is_param in _iter_tensors(model, skip):
        if id(t) in done:
            placed.append((owner, attr, done[id(t)], is_param))
            continue
        if host_embedding and name.endswith(("embed_tokens.weight", "embed_tokens.raw")):  # raw: GGUF blocks
            new = torch.empty(tuple(t.shape), dtype=source.dtype_of(name))  # stored dtype: rows cast on lookup
            host_keep += new.numel() * new.element_size()
        else:
            kind = "resident_experts" if isinstance(owner, ExpertBank) else "non_expert"
            new = ledger.empty(kind, name, tuple(t.shape), t.dtype)
        source.fill(name, new)
        done[id(t)] = new
        placed.append((owner, attr, new, is_param))

    runtime_pool: SlotPool | None = None
    if streamed:
        runtime_pool = SlotPool(slots, next(iter(layouts)), dev, ledger)
    runtime = OffloadRuntime(dev, runtime_pool, ledger, prefetch)
    runtime.resident_layers, runtime.streamed_layers = resident, streamed
    if pin_budget_bytes is None and os.name == "nt":
        pin_budget_bytes = WINDOWS_PIN_BUDGET  # WDDM caps page-locked memory per process
    budget = PinBudget(pin_budget_bytes)
    for i in streamed:
        name, bank = banks[i]
        assert isinstance(bank, RowExpertBank)
        rows, pinned = alloc_host_rows(tuple(bank.packed.shape), pin and dev.type == "cuda", budget, i)
        source.fill(f"{name}.packed", rows)
        runtime.stores[i] = HostExpertStore(i, rows, pinned)
    unpinned = any(not st.pinned for st in runtime.stores.values())
    # pageable rows go through a pinned staging ring on CUDA (auto); ``staging=True`` forces it (CPU tests)
    if runtime_pool is not None and unpinned and (staging or (staging is None and dev.type == "cuda")):
        runtime_pool.staging = StagingRing(runtime_pool.layout.nbytes, max(staging_slots, 2), dev)

    # --- commit: nothing above touched the model ---
    for owner, attr, t, is_param in placed:
        if is_param:
            setattr(owner, attr, nn.Parameter(t, requires_grad=False))
        else:
            setattr(owner, attr, t)
    if tied and hasattr(model, "lm_head"):
        model.lm_head.weight = model.embed_tokens.weight
    new_banks: dict[int, StreamedExpertBank] = {}
    for i in streamed:
        name, bank = banks[i]
        sb = StreamedExpertBank(i, bank.layout, runtime.stores[i], runtime)  # type: ignore[arg-type]
        set_submodule(model, name, sb)
        new_banks[i] = sb
    for a, b in zip(streamed, streamed[1:]):
        router = _router_of(model, banks[b][0])
        if router is not None:
            new_banks[a].next_router = router
            new_banks[a].next_layer = b
    model._offload_runtime = runtime  # plain attribute (not a submodule)
    if expert_fetch not in EXPERT_FETCH:
        raise PlanError(f"expert_fetch {expert_fetch!r} is not one of {', '.join(EXPERT_FETCH)}")
    if zero_copy is None:
        zero_copy = dev.type == "cuda" and expert_fetch == "zero_copy"
    if device_pool is None:
        device_pool = dev.type == "cuda" and expert_fetch == "device_tables"
    if zero_copy and device_pool:
        raise PlanError("zero-copy reads and device slot tables exclude each other: choose one expert fetch")
    if zero_copy and streamed:
        set_zero_copy(model, True)
    if device_pool and streamed:
        set_device_pool(model, True)
    set_cpu_experts(model, getattr(plan, "cpu_experts", []) if cpu_experts is None else cpu_experts)
    log.info(
        "plan placed: %d resident, %d streamed layers, %d slots, %.1f MiB on %s (+%.1f MiB kept on host)",
        len(resident),
        len(streamed),
        slots,
        ledger.total / 2**20,
        dev,
        host_keep / 2**20,
    )
    return runtime


def apply_plan(model: nn.Module, plan: Plan | SimplePlan, device: torch.device | str = "cuda", **kwargs: Any) -> OffloadRuntime:
    """:func:`place_model` for a model already in memory (its tensors are the source). ``plan`` is a planner
    :class:`~engine.placement.planner.Plan` or a :class:`SimplePlan`; this function never plans."""
    if isinstance(plan, (int, float)):
        raise PlanError("apply_plan places a plan; make one with engine.placement.planner.plan_model")
    kwargs.setdefault("host_embedding", False)
    return place_model(model, plan, device, ModelSource(model), **kwargs)


def set_zero_copy(model: nn.Module, on: bool) -> dict[int, str]:
    """Turn zero-copy reads of streamed experts on or off for ``model``'s AR steps (see the module); returns
    {layer: why not} for the streamed layers whose rows could not be mapped (they keep fetching into the pool).
    Graphs recorded before (CUDA graphs of ``engine.kernels.step_graphs``) are dropped: where the experts are read changed."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("zero-copy reads need a placed model (engine.placement.placer.place_model / apply_plan)")
    if on and rt.tables is not None:
        raise PlanError("zero-copy reads and device slot tables exclude each other: turn the device tables off first")
    if on:
        for i, (_, bank) in expert_banks(model).items():
            if isinstance(bank, StreamedExpertBank) and bank.in_place is None and i not in rt.zero_copy_refused:
                bank.in_place, why = in_place_view(bank.store.rows, rt.device)
                if bank.in_place is None:
                    rt.zero_copy_refused[i] = why
        if rt.zero_copy_refused:
            log.warning("zero-copy: %d streamed layer(s) keep fetching through the pool: %s",
                        len(rt.zero_copy_refused), next(iter(rt.zero_copy_refused.values())))
    if rt.zero_copy != on:
        rt.zero_copy = on
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()
    return dict(rt.zero_copy_refused)


def set_cpu_experts(model: nn.Module, modes: list[str] | tuple[str, ...] | frozenset[str]) -> None:
    """The modes ("ar": AR steps, "pass": diffusion block passes; engine.placement.planner.CPU_EXPERT_MODES) in which
    ``model``'s streamed layers compute their experts on the CPU from the host rows instead of fetching them into
    the pool (:meth:`StreamedExpertBank.computes_on_host`). Graphs recorded before are dropped."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("CPU experts need a placed model (engine.placement.placer.place_model / apply_plan)")
    wanted = frozenset(modes)
    unknown = sorted(wanted - set(CPU_EXPERT_MODES))
    if unknown:
        raise PlanError(f"cpu_experts {', '.join(unknown)} unknown: the modes are {', '.join(CPU_EXPERT_MODES)}")
    if rt.cpu_experts != wanted:
        rt.cpu_experts = wanted
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()


def set_device_pool(model: nn.Module, on: bool) -> str:
    """Turn device slot tables on or off for ``model``'s AR steps (``engine.placement.device_pool``); returns why they were
    refused ("" when on, or off). Refused (and left off, with a warning) when a streamed layer's rows cannot be
    mapped into the device's address space, the pool is under 2 x top-k slots, or Triton is missing on CUDA.
    Turning them off reads the tables back first. Recorded CUDA graphs are dropped."""
    rt = runtime_of(model)
    if rt is None:
        raise PlanError("device slot tables need a placed model (engine.placement.placer.place_model / apply_plan)")
    if on and rt.zero_copy:
        raise PlanError("device slot tables and zero-copy reads exclude each other: turn zero-copy off first")
    changed = on != (rt.tables is not None)
    if on and rt.tables is None:
        top_k = int(model.config.num_experts_per_tok)  # type: ignore[union-attr]
        why = DeviceSlotTables.refusal(rt.pool, top_k, rt.device)
        sources: dict[int, Tensor] = {}
        banks = expert_banks(model)
        for i in rt.streamed_layers:
            if why:
                break
            bank = banks[i][1]
            assert isinstance(bank, StreamedExpertBank)
            view, reason = (bank.in_place, "") if bank.in_place is not None else in_place_view(bank.store.rows, rt.device)
            if view is None:
                why = f"layer {i}: {reason}"
            else:
                sources[i] = view
        if why:
            rt.device_pool_refused = why
            log.warning("device slot tables refused (AR steps keep fetching on the host): %s", why)
            return why
        rt.tables = DeviceSlotTables(rt.pool, rt.streamed_layers, sources, banks[rt.streamed_layers[0]][1].num_experts,
                                     top_k)
        rt.device_pool_refused = ""
    elif not on and rt.tables is not None:
        if rt.tables.on_device:
            rt.tables_to_host()
        rt.tables = None
    if changed:
        forget = getattr(getattr(model, "step_graph", None), "forget", None)
        if callable(forget):
            forget()
    return ""


def _router_of(model: nn.Module, experts_name: str) -> nn.Module | None:
    name = experts_name.rsplit(".", 1)[0] + ".gate"
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
