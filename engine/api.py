"""``Engine``: the one entry point the CLI and the worker process use.

    engine = Engine.load(model_dir, device="cpu", precision="f32")
    engine = Engine.load(model_dir, device="cuda", precision="nf4", placement=plan_for(model_dir, 14 * GIB))
    for event in engine.generate(messages=[{"role": "user", "content": "hi"}], params=GenerationParams()):
        ...

``generate`` checks the request (prompt, parameters, context room) when it is called and raises
:class:`~engine.errors.PromptError` at once; it then returns an iterator of :mod:`engine.decode.events`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from clover_desk.engine.decode.events import Event, Finished, GenerationParams, LoadProgress
from clover_desk.engine.decode.generate import generate
from clover_desk.engine.decode.limits import check_generation_params
from clover_desk.engine.decode.loop_parts import LoopHooks, loop_hooks
from clover_desk.engine.decode.prompt_cache import PromptCache
from clover_desk.engine.decode.settings import resolve_settings
from clover_desk.engine.decode.tokenizer import CloverTokenizer
from clover_desk.engine.defaults import DEFAULT_CTX_TOKENS, DTYPE_OF_PRECISION, PRECISIONS
from clover_desk.engine.errors import CancelledError, ConfigError, PlanError, PromptError
from clover_desk.engine.kernels import cpu_quant, fastpath, switches
from clover_desk.engine.model.config import CloverConfig, GenerationDefaults, load_config, load_generation_defaults
from clover_desk.engine.placement import offload_runtime, planner
from clover_desk.engine.placement.manifest import manifest_from_gguf
from clover_desk.engine.placement.planner import Plan, plan_model, probe_hardware
from clover_desk.engine.settings import GpuPaths
from clover_desk.engine.weights import quant_cache
from clover_desk.engine.weights.checkpoint import load_model
from clover_desk.engine.weights.formats import TORCH_DTYPE_NAMES, format_of_torch_dtype, policy_for
from clover_desk.engine.weights.gguf.model import load_gguf_engine

COMPILE_CANCELLED = "compiling was cancelled: the model runs uncompiled"
log = logging.getLogger(__name__)

# the prompt cache scope of this process's own chats (the window's, the CLI's); the HTTP server's clients have their own
LOCAL_SCOPE = "local"
MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)

# What a compiled load runs before it returns (Engine.warm_up): AR decoding of a few tokens (the prefill, the first
# steps, and a step in the steady stance of engine.kernels.fastpath.steady_state), then two diffusion blocks after a prompt
# one block and a few tokens long (a prefill of whole blocks, a denoising pass over a block holding the prompt's
# tail, its commit pass, a denoising pass over the next block).
WARM_UP_AR_TOKENS = 4
WARM_UP_PROMPT_TAIL = 3  # prompt tokens past the first whole block
_WARM_UP_TEXT = "Hello! These few tokens warm up the compiled layers before the first request. "


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TORCH_NAME_OF_FORMAT = {fmt: name for fmt, name in TORCH_DTYPE_NAMES.items() if name in DTYPES}
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPES.items()}

_PRECISION_OF_DTYPE = {name: precision for precision, name in DTYPE_OF_PRECISION.items()}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def plan_for(
    source: str | Path,
    vram_budget_bytes: int,
    ctx_tokens: int | None = None,
    dtype: str | torch.dtype = "bfloat16",
    gguf_layout: str = "auto",
    device: str = "cpu",
) -> Plan:
    """The plan for a model folder (its quantized cache, precision "nf4") or a .gguf file (read in ``gguf_layout``)
    under a VRAM budget of ``vram_budget_bytes`` on this machine, for compute in ``dtype``:
    ``engine.placement.planner.plan_model`` with the probed hardware (what ``generate --vram-gb`` prints and then
    hands to :meth:`Engine.load` as its ``placement``). ``device``: where that load runs (:meth:`Engine.load`'s
    default too): a folder's cache is quantized by that device's policy (``policy_for``: the CPU's head in Q6_K
    blocks), and the plan counts those bytes, so that the load accepts it."""

    model: Any = source
    if Path(source).suffix == ".gguf" and gguf_layout != "auto":
        model = manifest_from_gguf(source, gguf_layout)  # the header read as the load will read it
    compute = format_of_torch_dtype(parse_dtype(dtype))
    return plan_model(
        model, int(vram_budget_bytes), int(ctx_tokens or DEFAULT_CTX_TOKENS), probe_hardware(), compute_dtype=compute,
        policy=policy_for(device),
    )


def resolve_precision(
    source: Path, precision: str | None, dtype: str | torch.dtype | None, plan: Plan | None
) -> tuple[str, str]:
    """(precision, compute dtype name) of a load (:meth:`Engine.load`), or one line saying why the combination is
    refused: a precision not in :data:`PRECISIONS`; "gguf" with a folder, or another precision with a ``.gguf``
    file; an unquantized precision with a dtype of its own or with a placement; a placement made for another
    dtype."""
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    wanted = None if dtype is None else _NAME_OF_DTYPE[parse_dtype(dtype)]
    if source.suffix == ".gguf":
        if precision not in (None, "gguf"):
            raise ConfigError(f"{source}: a .gguf file loads as precision 'gguf' (its own blocks), not {precision!r}")
        precision = "gguf"
    elif precision == "gguf":
        raise ConfigError(f"{source}: precision 'gguf' goes with a .gguf file; for a model folder use one of "
                          f"{', '.join(p for p in PRECISIONS if p != 'gguf')}")
    elif precision is None:
        precision = _PRECISION_OF_DTYPE[wanted or "float32"]
    if precision in DTYPE_OF_PRECISION:
        if wanted is not None and wanted != DTYPE_OF_PRECISION[precision]:
            raise ConfigError(f"precision {precision!r} computes in {DTYPE_OF_PRECISION[precision]}, not {wanted}: "
                              "give one of the two")
        if plan is not None:
            raise PlanError(f"a placement places quantized weights (the plan counts the quantized cache's bytes), "
                            f"but precision {precision!r} keeps them unquantized: load with precision 'nf4', or "
                            "without a placement")
        return precision, DTYPE_OF_PRECISION[precision]
    if plan is not None:
        planned = _TORCH_NAME_OF_FORMAT.get(plan.compute_dtype, plan.compute_dtype)
        if wanted is not None and wanted != _NAME_OF_DTYPE[parse_dtype(planned)]:
            raise PlanError(
                f"the plan counts the device's weights and KV cache in {planned}, but dtype {wanted} was asked "
                f"for: plan again for {wanted}"
            )
        return precision, _NAME_OF_DTYPE[parse_dtype(planned)]
    return precision, wanted or "float32"


def _check_plan_here(plan: Any, manifest: Any, device: str) -> None:
    """``engine.placement.planner.check_plan`` against ``manifest`` (the model as the load will place it) and what this
    machine has free now (on a CPU device the plan's "device" part takes RAM as well)."""
    import psutil


    ram_free = psutil.virtual_memory().available
    vram_free = None
    if str(device).startswith("cuda"):
        vram_free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        b = plan.vram_breakdown
        ram_free -= sum(int(b.get(k, 0)) for k in ("non_expert", "resident_experts", "expert_slots", "kv_cache"))
    planner.check_plan(plan, manifest, ram_available_bytes=ram_free, vram_available_bytes=vram_free)


def _load_quantized_placed(
    folder: Path,
    plan: Plan | None,
    device: str,
    dtype: torch.dtype,
    progress: Callable[[LoadProgress], None] | None,
    cancel: threading.Event | None,
    expert_fetch: str = "pool",
) -> Any:
    """Precision "nf4": the model's quantized cache (built first when needed: it streams tensor by tensor), each
    tensor read once into its place: where ``plan`` puts it (checked first against the cache and this machine), or
    on ``device`` without a plan."""

    report = quant_cache.ensure_cache(folder, progress=progress, cancel=cancel, device=device)  # its policy
    log.info("quantized cache %s (%s)", report.path, "rebuilt" if report.rebuilt else "reused")
    if plan is not None:
        _check_plan_here(plan, planner.manifest_from_quantized_cache(report.manifest_path), device)
    return quant_cache.load_from_cache(report.path, folder, dtype, progress, cancel, plan=plan, device=device,
                                       expert_fetch=expert_fetch)


class Engine:
    """A loaded model with its tokenizer and generation defaults."""

    def __init__(
        self,
        model: Any,
        config: CloverConfig,
        generation_defaults: GenerationDefaults,
        tokenizer: CloverTokenizer | None,
        model_dir: Path | None = None,
        plan: Any = None,
        hooks: LoopHooks | None = None,
        ar_only: str | None = None,
        compile_skipped: str | None = None,
        gpu_paths: GpuPaths | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.generation_defaults = generation_defaults
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.plan = plan
        self._hooks = hooks
        self.ar_only = ar_only  # why diffusion mode is refused (a GGUF without the diffusion tensors), or None
        self.compile_skipped = compile_skipped  # why compile=True left the model uncompiled, or None
        # the last prompt's prefill, for a chat's next turn (it starts with the same tokens): engine.decode.generate
        self.prompt_cache = PromptCache()
        self.ctx_limit: int = getattr(plan, "ctx_tokens", 0) or 0  # requests are held to it (0: the model's own)
        self.compile_cancelled = False  # Cancel came during the compile's warm-up: loaded, running uncompiled
        self.gpu_paths = gpu_paths or switches.current()  # the GPU paths and kernel switches it runs with
        self.precision = "f32"  # how the weights are held (PRECISIONS; Engine.load sets it)
        # why quantized weights on the CPU run without the CPU kernels (unpacked every forward, ~30x slower), or None
        self.cpu_kernels_missing: str | None = None

    @property
    def compiled(self) -> bool:
        """Whether the decoder layers run compiled (:mod:`engine.kernels.fastpath`)."""
        return fastpath.is_compiled(self.model)

    @classmethod
    def load(
        cls,
        source: str | Path,
        *,
        device: str = "cpu",
        precision: str | None = None,
        placement: Plan | dict[str, Any] | None = None,
        dtype: str | torch.dtype | None = None,
        ctx_tokens: int | None = None,
        progress: Callable[[LoadProgress], None] | None = None,
        cancel: threading.Event | None = None,
        gguf_layout: str = "auto",
        compile: bool = False,
        compile_backend: Any = "inductor",
        gpu_paths: GpuPaths | None = None,
    ) -> Engine:
        """Load a model: the one way the CLI, the worker, the benches and the tests build an engine
        (docs/loading.md). ``source`` is a model folder (config, generation config, tokenizer, safetensors) or a
        ``.gguf`` file (or any part of a split set).

        ``precision`` says how the weights are held, never implied by anything else (:data:`PRECISIONS`):

        * ``"f32"`` / ``"bf16"`` / ``"f16"``: a folder's weights as they are, cast to that dtype, computing in it
          (None for a folder: ``dtype``'s, else ``"f32"``);
        * ``"nf4"``: a folder's own quantized cache (NF4 routed experts, INT8 projections, shared experts and LM head;
          built next to the model on first use, :mod:`engine.weights.quant_cache`): what the app loads for a card;
        * ``"gguf"``: a ``.gguf`` file's own blocks (:mod:`engine.weights.gguf.model`), implied by such a source
          (None means it; any other precision for a ``.gguf`` source is refused). ``gguf_layout`` ("auto" | "fork"
          | "upstream") overrides the layout detection.

        ``placement``: an ``engine.placement.planner.Plan`` (or its dict, as ``clover-desk plan --json`` and the VRAM
        panel make it), placed exactly as planned (expert streaming, :mod:`engine.placement.offload`) after a check
        against the model and the machine (a stale one is refused with one line; never re-made); None: everything on
        ``device``. Plans place quantized weights (the planner counts the quantized cache's bytes, or the GGUF file's):
        a placement goes with ``"nf4"`` or ``"gguf"``, and with an unquantized precision (or none, for a folder) it is
        refused with one line (:class:`~engine.errors.PlanError`), never a switch to quantization. Requests are then
        held to the planned context: the KV cache and the prefill scratch were sized for it. To plan under a budget,
        :func:`plan_for` (what ``generate --vram-gb`` prints and then loads).

        ``dtype``: the compute dtype ("float32" | "bfloat16" | "float16"). With ``"f32"``/``"bf16"``/``"f16"`` it is
        the precision's (a different one is refused); with ``"nf4"``/``"gguf"`` it defaults to the placement's, else
        float32, and a placement made for another dtype is refused, since it counted the device's weights and KV
        cache in its own.

        ``compile``: compile the decoder layers (:mod:`engine.kernels.fastpath`), then :meth:`warm_up` them, so the compile
        time (two to three minutes on a 2-core CPU the first time, measured on the demo model; under a minute once
        inductor's kernels are cached on disk: dynamo still traces the graphs in each new process) is
        paid here, reported through ``progress`` (``engine.decode.events.COMPILE_STAGES``) and stopped by ``cancel``
        between its stages, rather than by the first request. Where compiling cannot work on this machine (no C++
        compiler for the CPU, no Triton for CUDA: ``engine.kernels.fastpath.unavailable``) the load says so (a warning, a
        "compile-skipped" progress event, ``Engine.compile_skipped``) and runs the model uncompiled. A ``cancel``
        during the warm-up (the weights are in place by then) stops the compile, not the load: the layers are
        uncompiled (``engine.kernels.fastpath.uncompile_layers``) and the engine returned with ``compile_cancelled``.
        ``ctx_tokens`` without a placement: the context requests are held to (``Engine.ctx_limit``; a plan's own
        otherwise). ``compile_backend``: the ``torch.compile`` backend (tests pass a cheap one that runs the traced
        graphs).

        ``gpu_paths``: the GPU paths and kernel switches (``engine.settings.GpuPaths``, read once where the process
        started: ``GpuPaths.from_env()``): the kernels' switches are set from it (``engine.kernels.switches.use``)
        and streamed experts are fetched as its ``expert_fetch`` says. None: the process's switches as they are
        (the defaults unless something set them) and the slot pool.
        """
        folder = Path(source)
        is_gguf = folder.suffix == ".gguf"  # a GGUF file (or the first part of a split set): engine.weights.gguf.model
        plan = Plan.from_dict(placement) if isinstance(placement, dict) else placement
        precision, dtype = resolve_precision(folder, precision, dtype, plan)
        if not is_gguf:
            if not folder.is_dir():
                raise ConfigError(f"{folder}: model folder not found")
            config = load_config(folder)
            defaults = load_generation_defaults(folder, config)
            tokenizer = CloverTokenizer.from_dir(folder)
            if tokenizer.vocab_size > config.vocab_size:
                raise ConfigError(
                    f"{folder / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, more than config.json's vocab_size "
                    f"{config.vocab_size}"
                )
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} was asked for, but CUDA is not available here")
        hooks = None
        ar_only = None
        if gpu_paths is not None:
            switches.use(gpu_paths)
        fetch = gpu_paths.expert_fetch if gpu_paths is not None else "pool"
        torch_dtype = parse_dtype(dtype)
        if is_gguf:
            if plan is not None:
                _check_plan_here(plan, manifest_from_gguf(folder, gguf_layout), device)
            model, config, defaults, tokenizer, ar_only = load_gguf_engine(
                folder, device=device, dtype=torch_dtype, layout=gguf_layout, progress=progress, cancel=cancel,
                plan=plan, expert_fetch=fetch,
            )
        elif precision == "nf4":
            model = _load_quantized_placed(folder, plan, device, torch_dtype, progress, cancel, fetch)
        else:
            model = load_model(
                folder, dtype=torch_dtype, device=device, progress=progress, cancel=cancel, config=config
            )
        if plan is not None and plan.prefill_chunk_tokens:
            model.max_pass_tokens = plan.prefill_chunk_tokens  # the planned attention scratch
        if plan is not None or offload_runtime.runtime_of(model) is not None:  # placed (the quantized cache always is)
            hooks = loop_hooks(model)
        log.info(
            "loaded %s (%s, %d layers) on %s, precision %s, computing in %s", folder, config.model_type,
            config.num_hidden_layers, device, precision, dtype,
        )
        compile_skipped = None
        if compile and compile_backend == "inductor":
            compile_skipped = fastpath.unavailable(model.device.type)
            if compile_skipped:
                log.warning("not compiling %s: %s", folder.name, compile_skipped)
                if progress is not None:
                    progress(LoadProgress(stage="compile-skipped", done_bytes=0, total_bytes=0,
                                          current=compile_skipped))
        engine = cls(model, config, defaults, tokenizer, folder, plan, hooks, ar_only, compile_skipped,
                     dataclasses.replace(switches.current(), expert_fetch=fetch))
        engine.precision = precision
        if torch.device(device).type == "cpu" and (is_gguf or precision == "nf4") and not cpu_quant.available():
            engine.cpu_kernels_missing = cpu_quant.reason()
            log.warning("quantized weights on the CPU without the CPU kernels (~30x slower): %s",
                        engine.cpu_kernels_missing)
        if plan is None and ctx_tokens:  # no plan (system RAM): the context the load was asked for, all the same
            engine.ctx_limit = int(ctx_tokens)
        if compile and not compile_skipped:
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"loading {folder} was cancelled")
            fastpath.compile_layers(model, backend=compile_backend)
            try:
                engine.warm_up(progress, cancel)
            except CancelledError:  # the weights are in place: a cancelled compile leaves the model, uncompiled
                fastpath.uncompile_layers(model)
                engine.compile_skipped = COMPILE_CANCELLED
                engine.compile_cancelled = True
                log.warning("compiling %s was cancelled: the model runs uncompiled", folder.name)
        return engine

    # ---- warm-up ----
    def warm_up_stages(self) -> list[str]:
        """The stages :meth:`warm_up` runs: "compiling-ar", then "compiling-diffusion" when this model decodes in
        diffusion mode too (not a GGUF file without the diffusion tensors; a mask token known)."""
        stages = ["compiling-ar"]
        settings = resolve_settings(GenerationParams(), self.generation_defaults, self.config, self.tokenizer)
        if self.ar_only is None and settings.mask_token_id is not None:
            stages.append("compiling-diffusion")
        return stages

    def warm_up(
        self, progress: Callable[[LoadProgress], None] | None = None, cancel: threading.Event | None = None
    ) -> list[str]:
        """Run a short generation in each decoding mode the model has, so that a compiled model compiles the passes a
        request meets (the prefill, the AR step, the denoising and commit passes) now rather than during the first
        request. Before each stage ``progress`` gets ``LoadProgress(stage, 0, 0, current=what runs)``; ``cancel``
        is checked before each stage and between the passes of one (a pass being compiled finishes first), and a
        cancelled warm-up raises :class:`~engine.errors.CancelledError`, as a cancelled load does. The warm-up is
        greedy, ignores EOS and keeps nothing. Returns the stages run (:meth:`warm_up_stages`)."""
        stages = self.warm_up_stages()
        for index, stage in enumerate(stages):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"loading {self.model_dir} was cancelled (while compiling)")
            ar = stage == "compiling-ar"
            what = f"{WARM_UP_AR_TOKENS} tokens of AR decoding" if ar else "2 blocks of block diffusion"
            if progress is not None:
                progress(LoadProgress(stage=stage, done_bytes=0, total_bytes=0,
                                      current=f"one-time warm-up {index + 1} of {len(stages)}: {what}"))
            started = time.perf_counter()
            for ids in self._warm_up_prompts(ar):
                done = None
                for event in generate(self.model, ids, self._warm_up_settings(ar, len(ids)), None, cancel,
                                      vocab_size=self.config.vocab_size, hooks=self._hooks):
                    if isinstance(event, Finished):
                        done = event
                if done is None or done.stop_reason == "cancelled":
                    raise CancelledError(f"loading {self.model_dir} was cancelled (while compiling)")
            log.info("warm-up %s: %.1f s", stage, time.perf_counter() - started)

        runtime = offload_runtime.runtime_of(self.model)
        if runtime is not None:  # the first request's expert-streaming figures count that request alone
            runtime.reset_stats()
        return stages

    def _warm_up_prompts(self, ar: bool) -> list[list[int]]:
        """The prompts of a warm-up stage, so that a request of any length finds its prefill compiled: a prompt's
        prefill is one graph for a single chunk (or block) and another for several (the chunk scan then runs
        eagerly, any count). AR: :meth:`_warm_up_prompt`, then a short prompt (one chunk); diffusion: prompts three
        and two blocks long, :meth:`_warm_up_prompt` (one whole block prefilled) and the short one."""
        ids = self._warm_up_prompt()
        block = self.config.block_size
        # The longer prompt first: its prefill splits a layer's graph at the chunk scan, and the layer's graph traced
        # then serves every later prefill, the GDN part resuming in a graph of its own, guarded on the chunk count.
        # In the other order the request's first short prompt met that split graph and compiled the one-chunk GDN
        # variant then (measured: a 21-token prompt's prefill 0.64 s after warm-up, 0.01 s in this order).
        short = ids[: max(2, block // 4)]
        if ar:
            return [ids, short]
        # diffusion: two multi-block lengths (the second turns the prefill's length into a symbol), one block, and
        # a prompt shorter than a block: its first denoising and commit passes are at position 0, which inductor's
        # compiled graphs are guarded against (seen with TORCH_LOGS=recompiles: a 21-token chat prompt's first
        # diffusion request compiled two graphs, 2.9 s, without it; the counting backend of the tests adds no such
        # guard, so only that log shows it)
        return [(ids * 4)[: 3 * block + WARM_UP_PROMPT_TAIL], (ids * 3)[: 2 * block + WARM_UP_PROMPT_TAIL], ids, short]

    def _warm_up_prompt(self) -> list[int]:
        """A prompt one block and :data:`WARM_UP_PROMPT_TAIL` tokens long: ordinary text's tokens when there is a
        tokenizer (never a special token such as the mask), else low ids."""
        n = self.config.block_size + WARM_UP_PROMPT_TAIL
        ids: list[int] = []
        if self.tokenizer is not None:
            ids = [i for i in self.tokenizer.encode(_WARM_UP_TEXT) if 0 <= i < self.config.vocab_size]
        if not ids:
            ids = list(range(1, min(n, self.config.vocab_size - 1) + 1))
        return (ids * (n // len(ids) + 1))[:n]

    def _warm_up_settings(self, ar: bool, prompt_tokens: int) -> Any:
        """Greedy settings for a warm-up generation, EOS ignored so every planned pass runs. Diffusion commits every
        slot of a block in its first pass (threshold 0: the policy runs outside the compiled layers, so the passes
        have the same shapes) and asks for one token past the block holding the prompt's tail, so that block's
        commit pass and a second block run."""
        params = GenerationParams(mode="ar" if ar else "diffusion", do_sample=False, enable_thinking=False)
        settings = resolve_settings(params, self.generation_defaults, self.config, self.tokenizer)
        block = settings.block_size
        new = WARM_UP_AR_TOKENS if ar else -(-prompt_tokens // block) * block - prompt_tokens + 1
        planned_ctx = self.ctx_limit
        return dataclasses.replace(
            settings, max_new_tokens=new, eos_token_ids=(), threshold=0.0,
            max_positions=min(settings.max_positions, planned_ctx) if planned_ctx else settings.max_positions,
        )

    # ---- prompts ----
    def prompt_ids(self, *args: Any, **kwargs: Any) -> list[int]:
        """The token ids a request decodes from: :meth:`encode_request`'s (the same arguments) without the count of
        the model's own."""
        return self.encode_request(*args, **kwargs)[0]

    def encode_request(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        raw: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool = True,
        continue_final: bool = False,
    ) -> tuple[list[int], int]:
        """The token ids a request decodes from, and how many of its last ids the model wrote itself (a continued
        answer's: the ``written`` of :meth:`generate`; 0 otherwise). ``raw`` sends ``prompt`` as is (no chat
        template); ``continue_final`` goes on with the last of ``messages``, an assistant answer
        (``GenerationParams.continue_final_message``)."""
        sources = (("messages", messages), ("prompt", prompt), ("prompt_ids", prompt_ids))
        given = [name for name, value in sources if value is not None]
        if len(given) != 1:
            raise PromptError(f"give exactly one of messages, prompt, prompt_ids (got {', '.join(given) or 'none'})")
        if continue_final and messages is None:
            raise PromptError(
                f"continue_final_message continues the last of the messages; it cannot go with {given[0]}")
        written = 0
        if prompt_ids is not None:
            try:
                ids = [int(i) for i in prompt_ids]
            except (TypeError, ValueError):
                raise PromptError("prompt_ids must be a list of integers") from None
        else:
            if prompt is not None and not prompt.strip():
                raise PromptError("empty prompt: nothing to generate from")
            if self.tokenizer is None:
                raise PromptError("this engine has no tokenizer: give prompt_ids")
            if prompt is not None and raw:
                ids = self.tokenizer.encode(prompt)
            else:
                chat = [{"role": "user", "content": prompt}] if prompt is not None else list(messages or [])
                if continue_final:
                    head, tail = self.tokenizer.continuation_parts(chat, tools, enable_thinking)
                    ids = self.tokenizer.encode(head + tail)
                    written = max(0, len(ids) - len(self.tokenizer.encode(head)))
                else:
                    ids = self.tokenizer.encode_chat(chat, tools=tools, enable_thinking=enable_thinking)
        if not ids:
            raise PromptError("empty prompt: nothing to generate from")
        return ids, min(written, len(ids) - 1)

    # ---- generation ----
    def generate(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        raw: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
        written: int = 0,
        *,
        prefill_only: bool = False,
        cache_scope: str = LOCAL_SCOPE,
        logprobs: int | None = None,
    ) -> Iterator[Event]:
        """Check the request now (PromptError), then return the event iterator (PromptInfo ... Finished).
        ``written``: with ``prompt_ids``, how many of its last ids are the model's answer so far (what
        :meth:`encode_request` says of a continued answer; ``messages`` with ``continue_final_message`` count
        their own). ``prefill_only``: :meth:`read_chat`. ``cache_scope``: whose prompt cache entries the request
        may go on from (:meth:`engine.decode.prompt_cache.PromptCache.scoped`; the HTTP server gives each client
        its own, the window's and the CLI's chats are :data:`LOCAL_SCOPE`). ``logprobs``: None (nothing computed), or
        send a :class:`~engine.decode.events.TokenLogprobs` before each commit's text, with that many alternatives
        (0 to :data:`MAX_TOP_LOGPROBS`) per token."""
        params = params or GenerationParams()
        check_generation_params(params)  # the ranges the CLI's flags and the worker check too (engine.decode.limits)
        if self.ar_only and params.mode in ("diffusion", "spec"):
            raise PromptError(f"{params.mode} mode is not available: {self.ar_only} (use --mode ar)")
        ids, own = self.encode_request(messages, prompt, prompt_ids, raw, tools, params.enable_thinking,
                                       params.continue_final_message)
        if written and prompt_ids is None:
            raise PromptError("written goes with prompt_ids (messages with continue_final_message count their own)")
        settings = resolve_settings(params, self.generation_defaults, self.config, self.tokenizer)
        if prefill_only:
            settings = dataclasses.replace(settings, prefill_only=True)
        if logprobs is not None:
            if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise PromptError(f"logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS} (alternatives per "
                                  f"token), got {logprobs!r}")
            settings = dataclasses.replace(settings, logprobs=logprobs)
        if self.ctx_limit:
            settings = dataclasses.replace(settings, max_positions=min(settings.max_positions, self.ctx_limit))
        return generate(
            self.model, ids, settings, self.tokenizer, cancel, vocab_size=self.config.vocab_size, hooks=self._hooks,
            written=written or own,
            prompt_cache=None if self.prompt_cache is None else self.prompt_cache.scoped(cache_scope),
        )

    def read_chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: GenerationParams | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        """Read a chat so far (its last answer included) into the prompt cache and stop there, so that its next
        turn reads only the new message: what the window does while the engine is idle, after an answer and when a
        chat is opened. The events of :meth:`generate` up to the prompt (PromptInfo, PrefillProgress*), then
        Finished with stop_reason "prefilled" ("cancelled" when ``cancel`` was set between two segments). The
        prompt is the chat with the generation prompt, as its next turn's starts: what is kept stops before it
        (``engine.decode.prompt_cache.PromptCache``)."""
        return self.generate(messages=messages, tools=tools, params=params, cancel=cancel, prefill_only=True)
