"""VRAM / RAM planner: where every byte of a model goes for a budget and a context. The one planning function is
:func:`plan_model`: the CLI, the VRAM panel, the worker and the engine all call it (the engine only to check a
plan it is handed, never to make another).

Stdlib only (plus psutil / pynvml inside :func:`engine.placement.hardware.probe_hardware`): the Qt UI imports this module.
Units: sizes are bytes, ``GiB`` = 2**30; bandwidths are GB/s (10**9 bytes per second), as hardware specs state them.

Manifests (:class:`Manifest`): every text-model tensor with its exact bytes and a kind. From a checkpoint's
safetensors headers (:func:`manifest_from_checkpoint`, never the data), from the quantized cache's manifest JSON
(:func:`manifest_from_quantized_cache`, or the same dict: :func:`manifest_from_dict`), or from a known shape under a
:class:`QuantPolicy` (:func:`manifest_for_shape`; the byte rules are the one table :data:`FORMAT_BYTES`).

How a plan is made (:func:`make_plan`); every VRAM byte is in ``Plan.vram_breakdown``:
* ``non_expert``: everything that is not a routed expert (attention, Gated DeltaNet, shared experts, routers,
  norms, Clover extras, lm_head) lives on the GPU, except the input embedding: a row lookup, kept in system RAM.
* ``resident_experts`` / ``expert_slots``: routed experts are placed by whole layers, either resident or streamed
  from pinned host RAM into a pool of expert-sized slots. The pool is at least ``2 x E`` slots (E experts per
  layer) when any layer streams: one 32-token pass can touch all E experts of a layer, and the next streamed
  layer loads while this one computes (double buffering); ``min_slot_experts`` lowers it for a bank that computes
  in chunks (engine.placement.placer accepts E). It never exceeds the streamed experts. VRAM left over after the layers
  becomes extra slots: they hold streamed layers' block working sets across a block's denoising passes.
* Which layers stay resident: the count R with the best hardware-bound tok/s for ``optimize_for`` (ties: more
  resident); the streamed layers are spread evenly over the depth, so resident layers sit between streamed ones
  and their compute hides the next streamed layer's copy (a run of adjacent streamed layers leaves the copy
  engine nothing to overlap with).
* ``kv_cache``: bf16 K and V of every full-attention layer for the context, rounded up to whole blocks.
* ``gdn_state``: fp32 recurrent state + bf16 conv state per GDN layer, twice: the sequence's and the copy the prompt
  cache keeps for a chat's next turn (``engine.decode.prompt_cache.PromptCache``); denoising passes read it without writing.
* ``workspace``: the larger of a prefill forward's scratch and a decoding pass's (fp32 block logits, activations),
  plus the dequantize buffers (a chunk of a quantized projection, a group of experts) and the memory pool of passes
  replayed from CUDA graphs. The prefill scratch depends on the attention kernel and on the routed experts'
  by-expert layout (the peak of a small-expert model: :func:`_moe_scratch`), and sets ``Plan.prefill_chunk_tokens``
  (:func:`choose_prefill_chunk`). ``clover-desk bench speed --count`` measures the
  forwards' scratch next to these figures (35B widths as on a GPU: a 32-slot pass 64 MiB, an 864-token prefill
  segment at a 16K context 361 MiB, against 223 and 675 MiB planned).
* ``reserve``: CUDA context + cuBLAS (500 MiB) and caching-allocator slack (256 MiB). The budget is what this
  process may use: pass the card's free VRAM (what the desktop leaves), not its total.

RAM (``Plan.ram_bytes``): the streamed layers' experts (pinned), the embedding and a pinned staging area; not the
Python/torch process itself. Speed: :class:`Roofline` (time per pass = max(VRAM traffic / VRAM bandwidth, PCIe
bytes / PCIe bandwidth, FLOPs / compute) + the eager launches per layer, counted).

The planner is split by job: the bytes of a model (:mod:`engine.placement.manifest`), placement (this module) and the speed
model (:mod:`engine.placement.speed`). The names most callers need are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_CARD_BYTES, DEFAULT_CTX_TOKENS
from clover_desk.engine.errors import PlanError
from clover_desk.engine.placement.hardware import DEFAULT_HARDWARE, Hardware, probe_hardware
from clover_desk.engine.placement.manifest import (
    KINDS,
    QUANT_MANIFEST_NAME,
    SHAPES,
    GiB,
    Manifest,
    MiB,
    ModelFacts,
    ModelGeometry,
    TensorEntry,
    classify,
    manifest_for_geometry,
    manifest_for_model_dir,
    manifest_for_shape,
    manifest_from_checkpoint,
    manifest_from_dict,
    manifest_from_quantized_cache,
    model_facts,
    quantize_manifest,
)
from clover_desk.engine.placement.speed import (
    CORESET_DISTINCT_EXPERTS_PER_PASS,
    DEQUANT_GROUP_EXPERTS,
    Roofline,
    predict,
)
from clover_desk.engine.weights.formats import COMPUTE_DTYPES, DEFAULT_POLICY, QuantPolicy, make_policy

__all__ = [
    "DEFAULT_CARD_BYTES",
    "DEFAULT_CTX_TOKENS",
    "KINDS",
    "QUANT_MANIFEST_NAME",
    "SHAPES",
    "Hardware",
    "Manifest",
    "ModelGeometry",
    "Plan",
    "QuantPolicy",
    "Roofline",
    "TensorEntry",
    "check_plan",
    "classify",
    "format_bytes",
    "make_plan",
    "make_policy",
    "manifest_for_geometry",
    "manifest_for_model_dir",
    "manifest_for_shape",
    "manifest_from_checkpoint",
    "manifest_from_dict",
    "manifest_from_quantized_cache",
    "plan_model",
    "probe_hardware",
    "quantize_manifest",
]

log = logging.getLogger(__name__)

CUDA_CONTEXT_BYTES = 500 * MiB  # CUDA context + cuBLAS handles and workspaces (torch, recent drivers)
ALLOCATOR_SLACK_BYTES = 256 * MiB  # caching-allocator fragmentation headroom
STAGING_BYTES = 64 * MiB  # pinned host staging: the offload staging ring + weight-upload buffers at load
PREFILL_MAX_TOKENS = 2048  # engine.model.clover.CloverModel.max_pass_tokens: the longest prefill forward
PREFILL_WORKSPACE_BYTES = 512 * MiB  # what the chunk-dependent part of one prefill forward may take
# Live fp32 [tokens, widest projection] buffers inside one layer. Measured (``bench speed --count``, the scratch
# line, 35B-A3B widths): a Gated DeltaNet layer's block-mode prefill holds 10.3 of them at its peak (93 MiB for
# 192 tokens, 214 MiB for 448), so 11.
ACTIVATION_BUFFERS = 11
# A by-expert group's padded rows over the pairs it gets on average (engine.model.experts._moe_sorted pads every expert of a
# group to its busiest). Measured with ``bench speed --count --shape mid`` (random router, 64 experts in one group,
# 16,384 pairs): 24,128 rows, 1.47; a trained router is less even, so 2.
MOE_PADDING = 2.0
# The prefill attention kernel: "efficient" is what engine.model.clover runs (query heads folded into rows, a group of rows
# at a time: flash or memory-efficient attention, no score matrix); "math" a torch build or GPU where SDPA falls
# back to its math kernel, which writes fp32 scores and probabilities.
ATTENTION_PATHS = ("efficient", "math")
ATTENTION_ROWS = 64  # engine.model.clover.ATTENTION_ROWS: query rows per attention call in a causal pass (32 in block mode)
EXPERT_DEQUANT_EXPERTS = DEQUANT_GROUP_EXPERTS  # experts dequantized to bf16 at once on CUDA (engine.placement.speed)
# Per weight of a dequantized expert group: its bf16 values and the quantized rows gathered for it (at most one byte
# per weight with the scales: int8). Measured for the 35B-A3B NF4 group: 96 MiB of bf16 + 24 MiB of NF4 rows.
EXPERT_DEQUANT_BYTES_PER_PARAM = 3
DEQUANT_CHUNK_ELEMS = 8 << 20  # engine.weights.quant.DEQUANT_CHUNK_ELEMS: QuantLinear dequantizes this many weights at once
# engine.model.experts.GROUP_BYTES["cuda"]: the stored (unquantized) experts a bank gathers at once on a GPU without
# torch's fused grouped mm (every card but 9.x / 10.x in bf16): a block pass's or a prefill's group by expert
GATHER_GROUP_BYTES = 96 * MiB

CPU_EXPERTS = ("auto", "never", "always")  # make_plan's cpu_experts choices
CPU_EXPERT_MODES = ("ar", "pass")  # Plan.cpu_experts' modes: decode steps, diffusion block passes
BREAKDOWN_KEYS = ("non_expert", "resident_experts", "expert_slots", "kv_cache", "gdn_state", "workspace", "reserve")


# Plan keys as plans written before issue 29 named them (``clover-desk plan --json``, saved plan files) -> today's:
# the memory a plan uses had the name the budget has everywhere else, and the budget a name of its own.
_RENAMED_PLAN_KEYS = {"vram_bytes": "vram_used_bytes", "budget_vram_bytes": "vram_budget_bytes"}


@dataclass(frozen=True)
class Plan:
    """Where every byte goes for one model, budget and context. ``vram_used_bytes == sum(vram_breakdown.values())``.

    When ``fits`` is False the layout is the one the budget was measured against (the minimum layout when VRAM is
    short, the layout VRAM alone would pick when RAM is short) and ``reason`` says why. ``min_vram_bytes`` is the
    smallest VRAM budget that fits (with the RAM given), also when the plan fits; None when no VRAM budget can fit
    the RAM given.
    """

    resident_expert_layers: list[int]
    streamed_expert_layers: list[int]
    slot_pool_experts: int
    vram_used_bytes: int  # the GPU memory the plan uses (at most vram_budget_bytes when it fits)
    vram_breakdown: dict[str, int]
    ram_bytes: int
    fits: bool
    reason: str
    min_vram_bytes: int | None
    predicted_tok_s: dict[str, float]
    assumptions: dict[str, Any]
    # Beyond the DESIGN.md contract:
    vram_budget_bytes: int = 0  # the VRAM budget it was made for
    ram_available_bytes: int | None = None
    ram_breakdown: dict[str, int] = field(default_factory=dict)
    ctx_tokens: int = 0
    prefill_chunk_tokens: int = 0  # the engine must not prefill more tokens per forward (its scratch is planned)
    model: str = ""
    model_fingerprint: str = ""  # engine.placement.manifest.ModelFacts.fingerprint() of the model planned
    policy_hash: str = ""  # the quantization policy the bytes were counted under ("" for as-stored bytes)
    gpu_name: str | None = None  # the card planned for (None: no NVIDIA GPU found; planned for vram_budget_bytes)
    compute_dtype: str = "bf16"  # weights, KV cache and activations on the device ("bf16" on a GPU)
    # The modes in which the streamed layers' experts are computed on the CPU from host RAM instead of streamed to the
    # device (engine.placement.streamed_bank): "ar" (decode steps), "pass" (diffusion block passes); chosen per mode by the
    # speed model (predicted_tok_s "ar_cpu_experts" against "ar", "diffusion_cpu_experts" against "diffusion").
    cpu_experts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Flat and JSON-safe: what ``clover-desk plan --json`` prints and the ``plan`` events carry."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        """The plan a ``plan`` event or ``plan --json`` carried (the window's load command sends it back). Plans
        written before the budget's one name (issue 29) are read too: their keys :data:`_RENAMED_PLAN_KEYS`."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        data = {**{_RENAMED_PLAN_KEYS.get(k, k): v for k, v in data.items()},
                **{k: v for k, v in data.items() if k not in _RENAMED_PLAN_KEYS}}
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise PlanError(f"the plan is missing field(s): {', '.join(missing)}")
        plan = cls(**{k: v for k, v in data.items() if k in names})
        try:
            layers = [int(x) for x in plan.resident_expert_layers] + [int(x) for x in plan.streamed_expert_layers]
            if min(layers, default=0) < 0 or int(plan.slot_pool_experts) < 0 or int(plan.ctx_tokens) < 0:
                raise ValueError
            breakdown = {str(k): int(v) for k, v in dict(plan.vram_breakdown).items()}
        except (TypeError, ValueError):
            raise PlanError("the plan has a malformed layer list, slot count, context or VRAM breakdown") from None
        modes = plan.cpu_experts
        if not isinstance(modes, list) or any(m not in CPU_EXPERT_MODES for m in modes):
            raise PlanError(f"the plan's cpu_experts must be a list of {', '.join(CPU_EXPERT_MODES)}, got {modes!r}")
        return dataclasses.replace(plan, vram_breakdown=breakdown)


def spread_resident(layers: tuple[int, ...] | list[int], n_resident: int) -> list[int]:
    """Keep ``n_resident`` of ``layers`` resident; the streamed ones are spread evenly over the depth."""
    n = len(layers)
    if not 0 <= n_resident <= n:
        raise PlanError(f"n_resident {n_resident} is outside 0..{n}")
    n_streamed = n - n_resident
    streamed_pos = {int((i + 0.5) * n / n_streamed) for i in range(n_streamed)}
    return [layer for pos, layer in enumerate(layers) if pos not in streamed_pos]


def _widest(geo: ModelGeometry) -> int:
    return max(
        geo.conv_dim + geo.value_dim if geo.gdn_layers else 0,  # in_proj_qkv + in_proj_z outputs
        geo.q_dim * 2,
        geo.hidden_size,
        geo.shared_expert_intermediate_size * 2,
        geo.moe_intermediate_size * 2,
    )


def _moe_scratch(geo: ModelGeometry, tokens: int, group_experts: int) -> int:
    """fp32 scratch of a routed-expert layer over ``tokens`` tokens grouped by expert (engine.model.experts._moe_sorted),
    at its peak inside one group of ``group_experts`` experts: the pairs' input rows in expert order and their
    outputs ([pairs, D] each), the group's zero-padded layout (each expert's rows padded to the group's busiest:
    [G * C, D] in, [G * C, 2I] gate/up, two [G * C, I] for the SwiGLU), plus the layer's [tokens, D] hidden states
    and its fp32 router logits. The padding is :data:`MOE_PADDING` times the pairs a group gets on average."""
    if not geo.num_experts or not geo.num_experts_per_tok:
        return 0
    d, i, e = geo.hidden_size, geo.moe_intermediate_size, geo.num_experts
    pairs = tokens * geo.num_experts_per_tok
    g = max(1, min(group_experts, e))
    padded = min(g * tokens, math.ceil(pairs * g / e * MOE_PADDING))
    return 4 * (2 * pairs * d + padded * (d + 4 * i) + tokens * (3 * d + 2 * e))


def _prefill_parts(
    geo: ModelGeometry, chunk: int, ctx: int, attention: str, group_experts: int = DEQUANT_GROUP_EXPERTS
) -> dict[str, int]:
    """Scratch of one prefill forward of ``chunk`` tokens whose last token sees ``ctx`` keys.

    engine.model.clover attends a group of query rows at a time (``attention_by_rows``), with the G query heads that
    share a KV head folded into rows: a block of a block-causal prefill needs no mask at all, so SDPA takes flash
    attention. A causal (AR-mode) prefill after cached keys keeps one bool mask [chunk, ctx], and each group of
    :data:`ATTENTION_ROWS` rows repeats its slice G times, which SDPA's memory-efficient kernel turns into a bias in
    the compute dtype padded to a 16-aligned row (``attn_bias``: 2 x 2 bytes per folded row and key). ``attention="math"``:
    SDPA's math kernel instead, which also writes a group's fp32 scores and probabilities.

    A layer's peak is its projections' (:data:`ACTIVATION_BUFFERS` of the widest) or, where the experts are small
    next to top-k times the hidden size, its routed experts' (:func:`_moe_scratch`, ``group_experts`` at a time):
    the larger of the two, not both, since they never live at once."""
    parts = {"activations": max(chunk * _widest(geo) * 4 * ACTIVATION_BUFFERS,
                                _moe_scratch(geo, chunk, group_experts))}
    if geo.full_attention_layers:
        g = max(1, geo.num_attention_heads // max(1, geo.num_key_value_heads))
        parts["attn_mask"] = chunk * ctx + ATTENTION_ROWS * g * ctx  # bool: the pass's, a group's repeated
        parts["attn_bias"] = ATTENTION_ROWS * g * ctx * 2 * 2  # the kernel's: bf16, and its 16-aligned copy
        if attention == "math":
            parts["attn_scores"] = 2 * geo.num_attention_heads * ATTENTION_ROWS * ctx * 4
    return parts


def choose_prefill_chunk(
    geo: ModelGeometry, ctx: int, block: int, attention: str = "efficient", group_experts: int = DEQUANT_GROUP_EXPERTS
) -> int:
    """The longest prefill forward (a multiple of ``block``, at most :data:`PREFILL_MAX_TOKENS`) whose
    chunk-dependent scratch fits :data:`PREFILL_WORKSPACE_BYTES`; one block at least."""
    top = max(block, PREFILL_MAX_TOKENS // block * block)
    for chunk in range(top, block - 1, -block):
        if sum(_prefill_parts(geo, chunk, ctx, attention, group_experts).values()) <= PREFILL_WORKSPACE_BYTES:
            return chunk
    return block


def workspace(f: ModelFacts, ctx: int, block: int, attention: str = "efficient") -> tuple[dict[str, int], dict[str, Any]]:
    """(workspace parts summing to the workspace, details) of model ``f`` for ``ctx`` tokens (``bench speed --count``
    prints them next to the scratch it measures). Prefill and decoding never run at once: the larger of the two
    counts, plus the dequantize buffers both use."""
    geo = f.geo
    group = _group_experts(f)
    chunk = choose_prefill_chunk(geo, ctx, block, attention, group)
    prefill = _prefill_parts(geo, chunk, ctx, attention, group)
    decode = {
        "logits": block * geo.vocab_size * 4,  # fp32 logits of one block
        "activations": block * _widest(geo) * 4 * ACTIVATION_BUFFERS,
        # a single-block pass needs no mask, so SDPA uses flash attention: no score scratch
    }
    # engine.weights.quant.QuantLinear dequantizes a quantized weight to bf16 a chunk of rows at a time (the lm_head of
    # 35B-A3B, 0.95 GiB in bf16, in 61 chunks of 16 MiB), and each chunk's product joins the output
    dense_chunk = min(f.dequant_dense_max_params, DEQUANT_CHUNK_ELEMS) * 2 * 2
    parts = {
        "prefill_or_decode": max(sum(prefill.values()), sum(decode.values())),
        "dequant_dense": dense_chunk,
        "dequant_experts": (
            int(EXPERT_DEQUANT_EXPERTS * f.expert_params * EXPERT_DEQUANT_BYTES_PER_PARAM) if f.experts_quantized else 0
        ),
        "gather_experts": 0 if f.experts_quantized else _expert_gather(f, block),
        # Passes replayed from CUDA graphs (engine.kernels.step_graphs, compiled runs) keep their own memory pool, which the
        # eager prefill cannot borrow from: a block pass's scratch (its quantized projections' dequantize chunks
        # in it) and the logits buffer its head piece writes, shared by every key length
        "cuda_graphs": sum(decode.values()) + dense_chunk + block * geo.vocab_size * 4,
    }
    details = {"prefill_chunk_tokens": chunk, "attention_path": attention, "prefill": prefill, "decode": decode}
    return parts, details


def _group_experts(f: ModelFacts) -> int:
    """How many experts a by-expert pass works on at once: a dequantized group (quantized experts), else as many
    unquantized experts as :data:`GATHER_GROUP_BYTES` holds (engine.model.experts.GROUP_BYTES)."""
    if f.experts_quantized or f.expert_params <= 0:
        return EXPERT_DEQUANT_EXPERTS
    return max(1, GATHER_GROUP_BYTES // int(f.expert_params * COMPUTE_DTYPES[f.compute_dtype]))


def _expert_gather(f: ModelFacts, block: int) -> int:
    """Unquantized routed experts read through a gather (engine.model.experts.moe_grouped): an AR step copies its top-k
    experts' weights (one per (token, slot) pair), a block pass or a prefill up to a group of
    :data:`GATHER_GROUP_BYTES` of them, never more experts than the layer has or its pairs can use. (Found with
    ``bench speed --count --shape mid``: 15 MiB of gathered fp32 experts measured against 2.6 MiB planned.)"""
    if not f.layers or f.expert_params <= 0:
        return 0
    per_expert = int(f.expert_params * COMPUTE_DTYPES[f.compute_dtype])
    k = f.geo.num_experts_per_tok
    return max(k, min(_group_experts(f), f.geo.num_experts, block * k)) * per_expert


def _min_slots(n_streamed: int, num_experts: int, min_slot_experts: int | None) -> int:
    if n_streamed == 0:
        return 0
    wanted = 2 * num_experts if min_slot_experts is None else min_slot_experts
    return min(n_streamed * num_experts, wanted)


def _check_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class _Option:
    """One resident-layer count with its minimum VRAM and its RAM."""

    n_resident: int
    resident: list[int]
    streamed: list[int]
    min_slots: int
    resident_bytes: int
    min_vram: int
    ram: dict[str, int]

    @property
    def ram_total(self) -> int:
        return sum(self.ram.values())


def make_plan(
    manifest: Manifest | dict[str, Any],
    vram_budget_bytes: int,
    ctx_tokens: int,
    ram_bytes: int | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    min_slot_experts: int | None = None,
    hardware: Hardware | None = None,
    roofline: Roofline | dict[str, Any] | None = None,
    optimize_for: str = "diffusion",
    attention: str = "efficient",
    coreset: bool = False,
    tokens_per_pass: float | None = None,
    compute_dtype: str = "bf16",
    cpu_experts: str = "auto",
) -> Plan:
    """Place ``manifest`` into ``vram_budget_bytes`` of GPU memory (and ``ram_bytes`` of free host RAM, when given) for
    ``ctx_tokens`` of context; see the module docstring for the rules.

    ``manifest`` may also be the cache-manifest dict (``engine.placement.placer.manifest_from_model``).
    ``hardware`` (default :data:`engine.placement.hardware.DEFAULT_HARDWARE`, the assumed 16 GB RTX card; this function
    never probes) and ``roofline`` only feed the speed prediction, which picks the resident layer count for
    ``optimize_for`` ("diffusion" | "ar"). ``ram_bytes=None`` skips the RAM check. ``coreset`` and
    ``tokens_per_pass`` are JSON-friendly shortcuts that override those two roofline inputs (the worker's ``plan``
    command passes its keys straight through); ``roofline`` may also be a dict of :class:`Roofline` fields.
    ``attention``: "efficient" is what engine.model.clover's block-mode prefill runs (see :func:`_prefill_parts`); "math"
    plans for SDPA's fallback kernel with fp32 score scratch. The plan's ``prefill_chunk_tokens`` is the longest
    prefill forward the engine may run within this plan.
    ``cpu_experts`` (one of :data:`CPU_EXPERTS`): "auto" lets the speed model choose, per mode, whether the streamed
    layers' experts are streamed to the device or computed on the CPU where they lie (the plan's ``cpu_experts``);
    "never" always streams; "always" computes them on the CPU in AR steps and block passes alike.
    """
    vram_budget = _check_int("vram_budget_bytes", vram_budget_bytes)
    ctx = _check_int("ctx_tokens", ctx_tokens, 1)
    block = _check_int("block_size", block_size, 1)
    if ram_bytes is not None:
        _check_int("ram_bytes", ram_bytes)
    if min_slot_experts is not None:
        _check_int("min_slot_experts", min_slot_experts, 1)
    if optimize_for not in ("diffusion", "ar"):
        raise PlanError(f"optimize_for must be 'diffusion' or 'ar', got {optimize_for!r}")
    if cpu_experts not in CPU_EXPERTS:
        raise PlanError(f"cpu_experts must be one of {', '.join(CPU_EXPERTS)}, got {cpu_experts!r}")
    if attention not in ATTENTION_PATHS:
        raise PlanError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {attention!r}")
    if isinstance(roofline, dict):
        unknown = set(roofline) - {f.name for f in dataclasses.fields(Roofline)}
        if unknown:
            raise PlanError(f"roofline has unknown field(s): {', '.join(sorted(unknown))}")
        roofline = Roofline(**roofline)
    rl = roofline or Roofline()
    if coreset:
        rl = dataclasses.replace(rl, distinct_experts_per_pass=CORESET_DISTINCT_EXPERTS_PER_PASS)
    if tokens_per_pass is not None:
        rl = dataclasses.replace(rl, tokens_per_pass=tokens_per_pass)
    if rl.tokens_per_pass > block:
        raise PlanError(f"Roofline.tokens_per_pass {rl.tokens_per_pass} exceeds block_size {block}")
    hw = hardware or DEFAULT_HARDWARE
    if isinstance(manifest, dict):
        manifest = manifest_from_dict(manifest)
    if not isinstance(manifest, Manifest):
        raise PlanError(f"make_plan needs a Manifest or a manifest dict, got {type(manifest).__name__}")

    f = model_facts(manifest, compute_dtype)  # non-expert weights counted as placed for compute in this dtype
    act_scale = COMPUTE_DTYPES[compute_dtype] / 2  # the KV cache and the conv state are held in the compute dtype
    geo, e = f.geo, f.geo.num_experts
    if geo.max_position_embeddings and ctx > geo.max_position_embeddings:
        raise PlanError(
            f"context {ctx:,} tokens is over the model's limit of {geo.max_position_embeddings:,} "
            f"(config.json max_position_embeddings): choose at most {geo.max_position_embeddings:,}"
        )
    ctx_alloc = -(-ctx // block) * block  # the KV cache holds whole blocks
    workspace_parts, workspace_details = workspace(f, ctx_alloc, block, attention)
    chunk = workspace_details["prefill_chunk_tokens"]
    fixed = {
        "non_expert": f.non_expert_gpu,
        "kv_cache": int(geo.kv_bytes_per_token * ctx_alloc * act_scale),
        # the sequence's states and the prompt cache's copy of them (engine.decode.prompt_cache.PromptCache: a chat's next turn)
        "gdn_state": 2 * (geo.gdn_state_bytes + int(geo.gdn_conv_state_bytes * (act_scale - 1))),
        "workspace": sum(workspace_parts.values()),
        "reserve": CUDA_CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES,
    }
    fixed_total = sum(fixed.values())

    options: list[_Option] = []
    for r in range(len(f.layers) + 1):
        resident = spread_resident(f.layers, r)
        streamed = [x for x in f.layers if x not in set(resident)]
        min_slots = _min_slots(len(streamed), e, min_slot_experts)
        resident_bytes = sum(f.layer_bytes[x] for x in resident)
        ram = {"streamed_experts": sum(f.layer_bytes[x] for x in streamed), "embed": f.embed_ram, "staging": STAGING_BYTES}
        need = fixed_total + resident_bytes + min_slots * f.slot_bytes
        options.append(_Option(r, resident, streamed, min_slots, resident_bytes, need, ram))

    def ram_ok(o: _Option) -> bool:
        return ram_bytes is None or o.ram_total <= ram_bytes

    def slots_for(o: _Option) -> int:
        if not o.streamed:
            return 0
        extra = (vram_budget - o.min_vram) // f.slot_bytes if vram_budget >= o.min_vram and f.slot_bytes else 0
        return min(len(o.streamed) * e, o.min_slots + extra)  # leftover VRAM becomes cache slots

    def best(pool: list[_Option]) -> tuple[_Option, int, dict[str, float], dict[str, Any]]:
        scored = []
        for o in pool:
            slots = slots_for(o)
            tok, derived = predict(f, o.streamed, slots, ctx_alloc, block, hw, rl, chunk, attention)
            scored.append((o, slots, tok, derived))
        # Scored on the hardware bound of the mode: what placement changes. The eager overheads are the same under
        # any placement, and the unfused engine's expert dequantize traffic is too (on the 35B at 16 GiB the layout
        # best for it gains 0.2 eager tok/s, 18.9 against 18.7, and drops the fused engine from 121.6 to 56.7)
        return max(scored, key=lambda t: (round(t[2][f"{optimize_for}_bound"], 9), t[0].n_resident))

    min_vram = min((o.min_vram for o in options if ram_ok(o)), default=None)
    in_vram = [o for o in options if o.min_vram <= vram_budget]
    fits_both = [o for o in in_vram if ram_ok(o)]
    reason = ""
    if fits_both:
        chosen, slots, tok, derived = best(fits_both)
    elif in_vram:  # VRAM is enough, RAM is not: the layout VRAM alone would choose
        chosen, slots, tok, derived = best(in_vram)
        reason = (
            f"RAM: the plan needs {format_bytes(chosen.ram_total)} of free system RAM "
            f"({format_bytes(chosen.ram['streamed_experts'])} streamed experts, {format_bytes(chosen.ram['embed'])} "
            f"embedding, {format_bytes(STAGING_BYTES)} staging) but {format_bytes(ram_bytes or 0)} is available"
        )
    else:  # VRAM too small: the minimum layout
        chosen = min([o for o in options if ram_ok(o)] or options, key=lambda o: (o.min_vram, -o.n_resident))
        slots = chosen.min_slots
        tok, derived = predict(f, chosen.streamed, slots, ctx_alloc, block, hw, rl, chunk, attention)
        reason = (
            f"VRAM: the budget of {format_bytes(vram_budget)} is below the {format_bytes(chosen.min_vram)} "
            f"this model needs with a {ctx:,}-token context"
        )
    fits = not reason
    if not fits:
        if min_vram is None:
            reason += "; no VRAM budget fits the RAM given (the embedding and staging alone need more)"
        else:
            reason += f"; the smallest VRAM budget that fits is {format_bytes(min_vram)} ({min_vram:,} bytes)"

    cpu_modes = _cpu_expert_modes(cpu_experts, chosen.streamed, tok)
    breakdown = {
        "non_expert": fixed["non_expert"],
        "resident_experts": chosen.resident_bytes,
        "expert_slots": slots * f.slot_bytes,
        "kv_cache": fixed["kv_cache"],
        "gdn_state": fixed["gdn_state"],
        "workspace": fixed["workspace"],
        "reserve": fixed["reserve"],
    }
    assumptions: dict[str, Any] = {
        "gpu_name": hw.gpu_name,
        "hardware_sources": dict(hw.sources),
        "pcie_gbps": round(hw.pcie_gbps, 3),
        "vram_gbps": round(hw.vram_gbps, 3),
        **asdict(rl),
        "block_size": block,
        "optimize_for": optimize_for,
        "kv_context_tokens": ctx_alloc,
        "kv_bytes_per_token": geo.kv_bytes_per_token,
        "expert_slot_bytes": f.slot_bytes,
        "experts_per_layer": e,
        "experts_per_token": geo.num_experts_per_tok,
        "min_slot_experts": chosen.min_slots,
        "workspace_parts": workspace_parts,
        "workspace_details": workspace_details,
        "reserve_parts": {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_slack": ALLOCATOR_SLACK_BYTES},
        "resident_rule": "count: best hardware-bound tok/s (ties: more resident); streamed layers spread evenly",
        "slot_rule": "at least 2 x experts per layer (a block pass can touch all, double-buffered), at most the "
        "streamed experts; leftover VRAM adds cache slots",
        "cpu_experts_rule": f"{cpu_experts}: per mode, the CPU computes the streamed layers' experts where the speed "
        "model predicts more tok/s that way (eager figures: ar_cpu_experts vs ar, diffusion_cpu_experts vs diffusion)",
        **derived,
    }
    log.debug("plan %s @ %d B: fits=%s, %d resident", manifest.source, vram_budget, fits, len(chosen.resident))
    return Plan(
        resident_expert_layers=list(chosen.resident),
        streamed_expert_layers=list(chosen.streamed),
        slot_pool_experts=slots,
        vram_used_bytes=sum(breakdown.values()),
        vram_breakdown=breakdown,
        ram_bytes=chosen.ram_total,
        fits=fits,
        reason=reason,
        min_vram_bytes=min_vram,
        predicted_tok_s={mode: round(v, 2) for mode, v in tok.items()},
        assumptions=assumptions,
        vram_budget_bytes=vram_budget,
        ram_available_bytes=ram_bytes,
        ram_breakdown=dict(chosen.ram),
        ctx_tokens=ctx,
        prefill_chunk_tokens=workspace_details["prefill_chunk_tokens"],
        model=manifest.source,
        model_fingerprint=f.fingerprint(),
        policy_hash=str((manifest.policy or {}).get("hash", "")),
        gpu_name=hw.gpu_name,
        compute_dtype=compute_dtype,
        cpu_experts=cpu_modes,
    )


def _cpu_expert_modes(choice: str, streamed: list[int], tok: dict[str, float]) -> list[str]:
    """The modes whose streamed experts run on the CPU: none without streamed layers; per ``choice``."""
    if not streamed or choice == "never":
        return []
    if choice == "always":
        return list(CPU_EXPERT_MODES)
    pairs = {"ar": ("ar_cpu_experts", "ar"), "pass": ("diffusion_cpu_experts", "diffusion")}
    return [mode for mode in CPU_EXPERT_MODES if tok[pairs[mode][0]] > tok[pairs[mode][1]]]


def format_bytes(n: int | float) -> str:
    """Bytes as GiB (>= 1 GiB) or MiB, two / one decimals."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


# ---------------------------------------------------------------------------------------------------------------
# The one planning function, and the check of a plan against the model and the machine
# ---------------------------------------------------------------------------------------------------------------

SHAPE_PREFIX = "shape:"


def model_manifest(model: str | Path | Manifest, policy: QuantPolicy = DEFAULT_POLICY) -> Manifest:
    """The manifest :func:`plan_model` plans: a :class:`Manifest` as given; ``"shape:NAME"`` a known shape under
    ``policy``; a checkpoint folder as the quantized cache will hold it under ``policy`` (headers only: the plan
    exists before any conversion or load); a quantized cache folder or its manifest.json as written."""
    if isinstance(model, Manifest):
        return model
    text = str(model)
    if text.startswith(SHAPE_PREFIX):
        return manifest_for_shape(text[len(SHAPE_PREFIX) :], policy)
    return manifest_for_model_dir(Path(model), policy)


def plan_model(
    model: str | Path | Manifest,
    vram_budget_bytes: int | None = None,
    ctx_tokens: int = DEFAULT_CTX_TOKENS,
    hardware: Hardware | None = None,
    *,
    policy: QuantPolicy = DEFAULT_POLICY,
    **options: Any,
) -> Plan:
    """THE planning function: the plan for ``model`` (see :func:`model_manifest`) under a VRAM budget and a context
    on a machine. The CLI (``plan``, ``generate --vram-gb``), the VRAM panel, the worker and the benchmarks call it;
    the engine places the plan it is handed and only checks it (:func:`check_plan`).

    ``vram_budget_bytes=None``: the card's free VRAM, else its total, else :data:`DEFAULT_CARD_BYTES`. ``hardware`` (default:
    probed now) gives the GPU facts for the speed model and the free RAM the plan must fit in
    (``ram_available_bytes``; None skips the RAM check). ``options`` go to :func:`make_plan` (``block_size``,
    ``optimize_for``, ``attention``, ``coreset``, ``tokens_per_pass``, ``roofline``, ``min_slot_experts``)."""
    hw = hardware if hardware is not None else probe_hardware()
    if vram_budget_bytes is None:
        vram_budget_bytes = hw.vram_free_bytes or hw.vram_total_bytes or DEFAULT_CARD_BYTES
    manifest = model_manifest(model, policy)
    return make_plan(manifest, int(vram_budget_bytes), ctx_tokens, hw.ram_available_bytes, hardware=hw, **options)


def check_plan(
    plan: Plan | dict[str, Any],
    manifest: Manifest,
    *,
    ram_available_bytes: int | None = None,
    vram_available_bytes: int | None = None,
) -> Plan:
    """The plan, if it was made for this model (same :meth:`ModelFacts.fingerprint`) and this machine can hold it
    now; else :class:`PlanError` with one line saying what changed and what to do. Never makes another plan."""
    if not isinstance(plan, Plan):
        plan = Plan.from_dict(plan)
    facts = model_facts(manifest, plan.compute_dtype)
    mine = facts.fingerprint()
    if plan.model_fingerprint != mine:
        raise PlanError(
            f"the plan was made for another model or quantization (plan {plan.model_fingerprint or 'unmarked'}, "
            f"{manifest.source} is {mine}): plan again for this model"
        )
    if not plan.fits:
        raise PlanError(f"the plan does not fit: {plan.reason or 'budget below the minimum'}")
    banks = set(facts.layers)
    layers = [int(x) for x in plan.resident_expert_layers] + [int(x) for x in plan.streamed_expert_layers]
    if sorted(layers) != sorted(banks):
        raise PlanError(f"the plan places expert layers {sorted(layers)}, the model has {sorted(banks)}")
    if ram_available_bytes is not None and plan.ram_bytes > ram_available_bytes:
        raise PlanError(
            f"the plan needs {format_bytes(plan.ram_bytes)} of free system RAM (streamed experts, embedding, "
            f"staging) but {format_bytes(ram_available_bytes)} is free now: close other programs, or plan with a "
            f"larger VRAM budget so fewer layers stream"
        )
    if vram_available_bytes is not None and plan.vram_used_bytes > vram_available_bytes:
        raise PlanError(
            f"the plan needs {format_bytes(plan.vram_used_bytes)} of GPU memory but {format_bytes(vram_available_bytes)} "
            f"is free now: plan again with a budget of at most {vram_available_bytes / GiB:.2f} GiB"
        )
    return plan
