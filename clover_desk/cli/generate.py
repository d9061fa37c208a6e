"""``clover-desk generate``: run one request on a model folder and stream the answer (or JSON events)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from clover_desk.cli import flags
from clover_desk.cli.models import resolve_model
from clover_desk.engine.decode.events import MODES

DIM, RESET = "\x1b[2m", "\x1b[0m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "ask")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="the user message (or the raw text with --raw)")
    source.add_argument("--prompt-file", metavar="PATH", help="the prompt as UTF-8 text from a file ('-': stdin)")
    source.add_argument("--prompt-ids", metavar="1,2,3", help="token ids, comma-separated (sent as is)")
    parser.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    add_local_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object per event per line")
    parser.add_argument("--json-schema", metavar="FILE", default=None,
                        help="structured output: the answer is JSON that this JSON schema (a UTF-8 file) accepts, "
                             "every token masked by it (a local --model only)")
    add_decoding_arguments(parser)


def add_model_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """--model, and --remote / --api-key to ``verb`` a server instead (``generate`` and ``chat``)."""
    parser.add_argument("--model", default=None, metavar="DIR|NAME",
                        help="model folder (config.json, weights, tokenizer) or a .gguf file, or the name of a model "
                             "the window knows (clover-desk models); with --remote, the server's model name "
                             "(default: the first it lists)")
    parser.add_argument("--remote", metavar="URL", default=None,
                        help=f"{verb} an OpenAI-compatible server (clover-desk serve, SGLang ...) at URL, e.g. "
                             "http://127.0.0.1:8000/v1, instead of loading a model here")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="with --remote: the server's API key (default: $CLOVER_DESK_API_KEY)")


def add_local_arguments(parser: argparse.ArgumentParser) -> None:
    """How a model is loaded here (``generate`` and ``chat``), and its decoding mode and thinking switch."""
    parser.add_argument("--mode", choices=MODES, default="diffusion",
                        help="decoding mode (spec: self-speculative, AR greedy's tokens drafted by diffusion)")
    parser.add_argument("--max-new-tokens", type=flags.MAX_NEW_TOKENS, default=None, metavar="N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gguf-layout", choices=("auto", "fork", "upstream"), default="auto",
                        help="a .gguf --model: official fork layout (diffusion) or upstream llama.cpp's (AR only); "
                             "default: detected from the file")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, default=None, help="VRAM budget in GiB: load the quantized cache (NF4 experts, INT8 dense; a .gguf file its own blocks), placed or streamed by the planner's plan")
    parser.add_argument("--ctx", type=flags.TOKENS, default=None, metavar="N",
                        help="with --vram-gb: context (prompt + answer) the plan reserves KV cache for (default 16384)")
    add_quantized_argument(parser)
    parser.add_argument("--compile", action="store_true",
                        help="compile the decoder layers (torch.compile), warmed up while loading: two to three "
                             "minutes on a CPU the first time, under a minute once cached")
    parser.add_argument("--no-think", action="store_true", help="turn thinking off in the chat template")


def add_quantized_argument(parser: argparse.ArgumentParser) -> None:
    """``--quantized`` (``generate``, ``chat``, ``serve``): a folder's own quantized cache without a plan."""
    parser.add_argument("--quantized", action="store_true",
                        help="a model folder: load its quantized cache (NF4 routed experts, INT8 dense, on the CPU a Q6_K head; built next to it on first use, then reused) instead of its float weights: ~4.5 bits a weight, so a 35B folder fits a CPU's RAM (--vram-gb implies it)")


def add_cache_ram_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache-ram`` (``chat`` and ``serve``, as llama.cpp's server spells it): the host memory the prompt cache
    may fill with other chats' states."""
    from clover_desk.engine.defaults import PROMPT_CACHE_RAM_MIB

    parser.add_argument("--cache-ram", type=flags.CACHE_RAM, default=None, metavar="MIB",
                        help="system RAM the prompt cache may hold other chats' states in, in MiB, so that going "
                             f"back to one reads only its new turn (default {PROMPT_CACHE_RAM_MIB}; 0: only the "
                             "last chat's)")


def apply_cache_ram(engine: Any, args: argparse.Namespace) -> Any:
    """``engine`` with its prompt cache limited to ``--cache-ram`` (when given: the engine's default otherwise)."""
    if engine.prompt_cache is not None and args.cache_ram is not None:
        engine.prompt_cache.host_bytes = int(args.cache_ram) << 20
    return engine


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling and diffusion settings of a request (``generate`` and ``chat``)."""
    parser.add_argument("--temperature", type=flags.temperature, default=None, help="> 0 samples (default: greedy)")
    parser.add_argument("--top-p", type=flags.TOP_P, default=None)
    parser.add_argument("--top-k", type=flags.TOP_K, default=None)
    parser.add_argument("--seed", type=flags.SEED, default=None)
    parser.add_argument("--threshold", type=flags.THRESHOLD, default=None, help="diffusion commit threshold (default: config)")
    parser.add_argument("--block-size", type=flags.BLOCK, default=None, help="diffusion block size (default: config)")
    parser.add_argument("--presence-penalty", type=flags.PRESENCE_PENALTY, default=None,
                        help="subtracted from the logits of tokens already generated (default: generation_config.json)")
    parser.add_argument("--repetition-penalty", type=flags.REPETITION_PENALTY, default=None,
                        help="CTRL-style penalty on tokens seen so far, 1 = off (default: generation_config.json)")


def params_from(args: argparse.Namespace) -> Any:
    """The request's GenerationParams from the decoding flags."""
    from clover_desk.engine.decode.events import GenerationParams

    return GenerationParams(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        block_size=args.block_size,
        threshold=args.threshold,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        enable_thinking=not args.no_think,
        seed=args.seed,
    )


def _parse_ids(text: str) -> list[int]:
    from clover_desk.engine.errors import PromptError

    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise PromptError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None


def _prompt_text(args: argparse.Namespace) -> str | None:
    """The prompt of ``--prompt`` or ``--prompt-file`` (read whole, at most ``MAX_PROMPT_BYTES``), checked to be
    UTF-8 text: undecodable bytes are one line naming the flag, the byte and where it is."""
    from clover_desk.engine.decode.limits import MAX_PROMPT_BYTES, check_text, decode_utf8
    from clover_desk.engine.errors import PromptError

    if args.prompt is not None:
        return check_text(args.prompt, "--prompt")
    if args.prompt_file is None:
        return None
    where = "--prompt-file " + ("- (stdin)" if args.prompt_file == "-" else args.prompt_file)
    try:
        if args.prompt_file == "-":
            data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        else:
            with open(args.prompt_file, "rb") as f:
                data = f.read(MAX_PROMPT_BYTES + 1)
    except OSError as exc:
        raise PromptError(f"{where}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_PROMPT_BYTES:
        raise PromptError(f"{where}: longer than {MAX_PROMPT_BYTES:,} bytes, more than any context holds")
    return decode_utf8(data, where)


# C0 controls (but tab and newline), DEL and the C1 controls: a model can write them (ESC sequences that recolour,
# clear or retitle a terminal, a bell, a carriage return that overwrites the line); plain output shows them escaped.
_CONTROL_CHARS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def visible_text(text: str) -> str:
    """``text`` with every control character but tab and newline written as ``\\xNN`` (so it cannot drive the
    terminal); everything else, any script or emoji, unchanged. ``--json`` output is already escaped by JSON."""
    return text.translate(_CONTROL_CHARS)


class _Printer:
    """Plain-text output: the answer as it streams, thinking dimmed on a terminal (prefixed otherwise). The model's
    text is written through :func:`visible_text`: its control bytes are shown, never sent to the terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.channel = "answer"

    def delta(self, text: str, channel: str) -> None:
        if channel != self.channel:
            if channel == "thinking":
                self.out.write(DIM if self.tty else "[thinking] ")
            else:
                self.out.write(RESET + "\n" if self.tty else "\n[answer] ")
            self.channel = channel
        self.out.write(visible_text(text))
        self.out.flush()

    def end(self) -> None:
        if self.tty and self.channel == "thinking":
            self.out.write(RESET)
        self.out.write("\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError

    try:
        return _run_remote(args) if args.remote is not None else _run(args)
    except CloverError as exc:
        print(f"clover-desk generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from clover_desk.engine.decode.events import Finished, to_dict

    if args.model is None:
        print("clover-desk generate: error: --model DIR is required (or --remote URL)", file=sys.stderr)
        return 2
    args.model = resolve_model(args.model)
    check_ctx(args)
    prompt_ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    prompt = _prompt_text(args)  # before the model is read: a bad prompt costs nothing
    params = params_from(args)
    if args.json_schema is not None:
        params = dataclasses.replace(params, structured=structured_from_file(args.json_schema))
    engine = load_engine(args, "generate")
    cancel = threading.Event()
    if prompt_ids is not None:
        events = engine.generate(prompt_ids=prompt_ids, params=params, cancel=cancel)
    else:
        events = engine.generate(prompt=prompt, raw=args.raw, params=params, cancel=cancel)
    return _print_events(events, args.json, cancel, to_dict, Finished, summary_line)


def structured_from_file(path: str) -> str:
    """``--json-schema FILE`` as the request's grammar (``GenerationParams.structured``); a PromptError naming the
    flag, the file and what is wrong with it (not readable, not JSON, a schema the engine cannot enforce)."""
    from clover_desk.engine.decode.grammar import schema_problem, structured_spec
    from clover_desk.engine.decode.limits import decode_utf8
    from clover_desk.engine.errors import PromptError

    where = f"--json-schema {path}"
    try:
        with open(path, "rb") as f:
            text = decode_utf8(f.read(1 << 20), where)
    except OSError as exc:
        raise PromptError(f"{where}: cannot read ({exc.strerror or exc})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    problem = schema_problem(schema)
    if problem is not None:
        raise PromptError(f"{where}: this JSON schema cannot be enforced: {problem}")
    return structured_spec(schema)


def check_ctx(args: argparse.Namespace) -> None:
    """``--ctx`` goes with ``--vram-gb`` only, ``--quantized`` with a model folder only (a ConfigError otherwise),
    said before anything is read."""
    from clover_desk.engine.errors import ConfigError

    precision_of(args.model, None, getattr(args, "quantized", False))

    if args.ctx is not None and args.vram_budget_bytes is None:  # (serve's --ctx caps requests; here the answer's length is
        # bounded by --max-new-tokens already: without a plan there is no KV reservation for --ctx to size)
        raise ConfigError("--ctx sizes the KV cache a --vram-gb plan reserves: add --vram-gb G (without a plan the "
                          "cache holds the prompt and --max-new-tokens)")


def load_engine(args: argparse.Namespace, command: str) -> Any:
    """The Engine the local flags ask for: with ``--vram-gb``, the plan first, from the headers alone (before any
    conversion or load), printed (a JSON record with ``--json``), then that plan placed."""
    from clover_desk.engine.weights.gguf.file import check_gguf_model

    check_gguf_model(args.model)  # a damaged GGUF file is one line before torch is even imported
    from clover_desk.engine.api import Engine, plan_for
    from clover_desk.engine.errors import PlanError

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    plan = None
    if args.vram_budget_bytes is not None:
        plan = plan_for(args.model, args.vram_budget_bytes, args.ctx, dtype, args.gguf_layout, device=args.device)
        if getattr(args, "json", False):
            sys.stdout.write(json.dumps({"event": "plan", **plan.to_dict()}, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            print(_plan_line(plan), file=sys.stderr)
        if not plan.fits:
            raise PlanError(plan.reason)
    precision = precision_of(args.model, plan, args.quantized)
    check_float_load_fits(args.model, precision, dtype, args.device)
    return Engine.load(args.model, device=args.device, precision=precision, placement=plan,
                       dtype=dtype, gguf_layout=args.gguf_layout, compile=args.compile, progress=compile_stage_printer(command) if args.compile else None,
                       gpu_paths=args.gpu_paths)


def precision_of(model: str | Path, plan: Any, quantized: bool = False) -> str | None:
    """The precision ``--vram-gb`` or ``--quantized`` asks for: a model folder's quantized cache ("nf4"), placed by
    the plan if there is one; a .gguf file loads its own blocks (implied by the file; ``--quantized`` with one is
    a ConfigError); otherwise the weights as stored, in ``--dtype`` (None: Engine.load's default for the dtype)."""
    if Path(model).suffix == ".gguf":
        if quantized:
            from clover_desk.engine.errors import ConfigError

            raise ConfigError(f"--quantized applies to a model folder: {Path(model).name} is a .gguf file, whose own "
                              "quantized blocks are read as they are (leave --quantized out)")
        return None
    return "nf4" if plan is not None or quantized else None


def check_float_load_fits(model: str | Path, precision: str | None, dtype: str, device: str) -> None:
    """A model folder loaded unquantized on the CPU whose weights in ``dtype`` are more than the RAM free now: a
    ConfigError naming both sizes and ``--quantized``, before a byte is read (the 35B folder needs 139 GB in float32;
    loading it would swap the machine to a halt). Headers only; a .gguf file, a plan or ``--quantized`` pass."""
    if precision is not None or device != "cpu" or not Path(model).is_dir():
        return
    import math

    from clover_desk.engine.errors import CloverError, ConfigError
    from clover_desk.engine.placement import hardware, planner
    from clover_desk.engine.placement.manifest import manifest_for_model_dir
    from clover_desk.engine.weights.formats import COMPUTE_DTYPES, FORMAT_OF_TORCH_NAME

    free = hardware.probe_hardware().ram_available_bytes
    if not free:
        return
    try:
        stored = manifest_for_model_dir(model, as_stored=True)
    except (CloverError, OSError):  # a damaged folder: the load says what is wrong with it, in its own words
        return
    need = sum(math.prod(e.shape) for e in stored.entries) * COMPUTE_DTYPES.get(FORMAT_OF_TORCH_NAME.get(dtype, ""), 4)
    if need <= free:
        return
    quantized = planner.model_manifest(model).total_bytes()
    gib = 1024**3
    raise ConfigError(f"{Path(model).name}: its weights unquantized in {dtype} need {need / gib:.1f} GiB and "
                      f"{free / gib:.1f} GiB of RAM is free: add --quantized (its quantized cache, about "
                      f"{quantized / gib:.1f} GiB) or load a .gguf file")


def _plan_line(plan: Any) -> str:
    gib = 1024**3
    return (
        f"plan: {len(plan.resident_expert_layers)} expert layers resident, {len(plan.streamed_expert_layers)} "
        f"streamed, {plan.slot_pool_experts} slots; VRAM {plan.vram_used_bytes / gib:.2f} of "
        f"{plan.vram_budget_bytes / gib:.2f} GiB, RAM {plan.ram_bytes / gib:.2f} GiB, context {plan.ctx_tokens:,}"
    )


def summary_line(done: Any) -> str:
    """A local generation's figures, one line (stderr)."""
    ttft = "-" if done.time_to_first_token_s is None else f"{done.time_to_first_token_s:.2f} s"
    cached = f" ({done.cached_tokens} cached)" if done.cached_tokens else ""
    return (
        f"[{done.stop_reason}] {done.tokens} tokens in {done.passes} passes ({done.tokens_per_pass:.2f} tokens/pass), "
        f"{done.tokens_per_s:.1f} tokens/s, prompt {done.prompt_tokens} tokens{cached}, prefill {done.prefill_s:.2f} "
        f"s, first token {ttft}"
    )


# ---- --remote: an OpenAI-compatible server instead of a local model ----

# the flags only a model loaded here uses, with the value that means "not given" (remote_backend refuses the others)
LOCAL_ONLY = (("vram_budget_bytes", "--vram-gb", None), ("ctx", "--ctx", None), ("dtype", "--dtype", None),
              ("device", "--device", "cpu"), ("quantized", "--quantized", False))
_GENERATE_LOCAL_ONLY = (("prompt_ids", "--prompt-ids", None), ("raw", "--raw", False), ("json_schema", "--json-schema", None),
                        *LOCAL_ONLY)


def remote_backend(args: argparse.Namespace, local_only: Sequence[tuple[str, str, Any]] = LOCAL_ONLY) -> Any:
    """The RemoteBackend ``--remote`` names (its API key from ``--api-key`` or $CLOVER_DESK_API_KEY); a flag of
    ``local_only`` given with it is a ConfigError naming it."""
    import os

    from clover_desk.engine.errors import ConfigError
    from clover_desk.worker.remote import RemoteBackend

    for attr, flag, unset in local_only:
        if getattr(args, attr) != unset:
            raise ConfigError(f"{flag} does not apply with --remote (the server holds the model)")
    api_key = args.api_key if args.api_key is not None else os.environ.get("CLOVER_DESK_API_KEY")
    return RemoteBackend(args.remote, api_key=api_key, model=args.model)


def _run_remote(args: argparse.Namespace) -> int:
    """Stream the answer from ``--remote``; what the server does not report is printed as unavailable."""
    from clover_desk.engine.decode.events import TextDelta, to_dict
    from clover_desk.worker.remote import RemoteFinished

    backend = remote_backend(args, _GENERATE_LOCAL_ONLY)
    prompt = _prompt_text(args)
    params = params_from(args)
    cancel = threading.Event()
    events = backend.chat([{"role": "user", "content": prompt}], params, cancel=cancel)
    return _print_events(
        events, args.json, cancel,
        lambda e: to_dict(e) if isinstance(e, TextDelta) else {"event": "remote_finished", **_remote_dict(e)},
        RemoteFinished, remote_summary,
    )


def _print_events(
    events: Any, as_json: bool, cancel: threading.Event, record: Any, finished_type: type, summary: Any
) -> int:
    """Stream a generation's events: JSON lines (``record(event)``), or the text with the ``summary`` of its
    ``finished_type`` event on stderr. Ctrl-C cancels (exit 130)."""
    from clover_desk.engine.decode.events import TextDelta

    printer = _Printer(sys.stdout)
    try:
        for event in events:
            if as_json:
                sys.stdout.write(json.dumps(record(event), ensure_ascii=False) + "\n")
                sys.stdout.flush()
            elif isinstance(event, TextDelta):
                printer.delta(event.text, event.channel)
            elif isinstance(event, finished_type):
                printer.end()
                print(summary(event), file=sys.stderr)
    except KeyboardInterrupt:
        cancel.set()
        print("\nclover-desk generate: interrupted", file=sys.stderr)
        return 130
    return 0


def _remote_dict(done: Any) -> dict[str, Any]:
    import dataclasses

    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(done).items()}


def remote_summary(done: Any) -> str:
    def shown(value: Any, fmt: str = "{}") -> str:
        return "unavailable" if value is None else fmt.format(value)

    ttft = shown(done.client_first_token_s, "{:.2f} s")
    return (
        f"[{done.finish_reason or 'unknown'}] remote {done.model}: {shown(done.completion_tokens)} tokens, "
        f"passes {shown(done.passes)}, tokens/pass {shown(done.tokens_per_pass, '{:.2f}')}, "
        f"mode {shown(done.mode)}, prompt {shown(done.prompt_tokens)} tokens, first token {ttft} and total "
        f"{done.client_elapsed_s:.2f} s (measured here), denoising steps unavailable (remote)"
    )


def compile_stage_printer(command: str) -> Any:
    """A load ``progress`` callback that prints the compile stages (``engine.decode.events.COMPILE_STAGES``: the warm-up
    a compiled load runs, or why a model is not compiled) to stderr, one line each; the other stages stay silent."""
    from clover_desk.engine.decode.events import COMPILE_STAGES

    def progress(p: Any) -> None:
        if p.stage in COMPILE_STAGES:
            print(f"clover-desk {command}: {p.stage}: {p.current}", file=sys.stderr, flush=True)

    return progress
