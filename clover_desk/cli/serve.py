"""``clover-desk serve``: an OpenAI-compatible HTTP server over one model folder (:mod:`clover_desk.worker.server`).

The port is bound first (a port in use fails at once, not after the load), the model loaded (with ``--compile``,
its layers compiled and warmed up, each warm-up stage a line on stderr), then ``listening on http://HOST:PORT/v1``
is printed on stdout. SIGTERM stops it (exit 0); Ctrl-C too, with one line and exit status 130. Either way the
answers in progress end with an error (a stream's last event), not as if they were complete.

Who may use it (:mod:`clover_desk.worker.http_guards`): requests must address this machine (``Host``: a loopback
name, the bound address, or ``--allowed-hosts``); browser pages only from this machine or ``--allowed-origins``.
Listening on an address other machines reach needs an API key (``--api-key``, repeatable: one per client, whose
prompt caches are then kept apart), or ``--insecure-no-api-key`` to say that no key is wanted.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from typing import Any

from clover_desk.cli import flags
from clover_desk.cli import generate as cmd_generate
from clover_desk.cli.models import resolve_model

API_KEY_ENV = "CLOVER_DESK_API_KEY"
PORT = flags.integer(0, 65535, "a port number from 0 (any free port) to 65535")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR|NAME",
                        help="model folder (config.json, weights, tokenizer) or .gguf file, or the name of a model the "
                             "window knows (clover-desk models)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    parser.add_argument("--port", type=PORT, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--api-key", type=_api_key, action="append", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY'; give it again for more clients, each with a key "
                             f"of its own (their prompt caches are kept apart) (default: ${API_KEY_ENV}, else no key)")
    parser.add_argument("--insecure-no-api-key", action="store_true",
                        help="listen on an address other machines reach without an API key (refused otherwise)")
    parser.add_argument("--allowed-hosts", type=_hosts, action="append", default=[], metavar="NAMES",
                        help="more Host names clients may address this server by, comma-separated (e.g. llm.lan, "
                             "*.lan; * for any); loopback names and the bound address are always allowed")
    parser.add_argument("--allowed-origins", type=_origins, action="append", default=[], metavar="ORIGINS",
                        help="browser pages allowed to call this server, comma-separated scheme://host[:port] (or "
                             "*); pages on this machine are always allowed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--vram-gb", dest="vram_budget_bytes", type=flags.vram_budget, default=None,
                        help="VRAM budget in GiB: quantize, then place or stream experts by the planner")
    parser.add_argument("--ctx", type=flags.TOKENS, default=None, metavar="N",
                        help="context (prompt + answer) a request may use; with --vram-gb the plan reserves KV cache "
                             "for it (default 16384 there, else the model's maximum)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the decoder layers (torch.compile) for faster decoding; the load then warms "
                             "them up before listening: two to three minutes on a CPU the first time, under a minute "
                             "once cached")
    cmd_generate.add_quantized_argument(parser)
    cmd_generate.add_cache_ram_argument(parser)


def _api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty key is not a key: give a non-empty KEY, or leave --api-key out "
                                         "(a server reachable only from this machine needs none)")
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in text):
        raise argparse.ArgumentTypeError("must be printable ASCII characters without spaces")
    return text


def _hosts(text: str) -> list[str]:
    from clover_desk.worker.http_guards import check_host_name

    try:
        return [check_host_name(name) for name in text.split(",") if name.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _origins(text: str) -> list[str]:
    from clover_desk.worker.http_guards import normalize_origin

    try:
        return [normalize_origin(origin) for origin in text.split(",") if origin.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from clover_desk.engine.errors import CloverError

    try:
        return _run(args)
    except CloverError as exc:
        print(f"clover-desk serve: error: {exc}", file=sys.stderr)
        return 2


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _run(args: argparse.Namespace) -> int:
    from clover_desk.worker.server import OpenAIServer

    args.model = resolve_model(args.model)
    keys = args.api_key if args.api_key is not None else [k for k in [os.environ.get(API_KEY_ENV)] if k]
    if not _is_loopback(args.host) and not keys and not args.insecure_no_api_key:
        print(f"clover-desk serve: error: --host {args.host} is reachable from other machines: give --api-key KEY "
              "(or --insecure-no-api-key to serve anyone who can reach it)", file=sys.stderr)
        return 2
    try:
        server = OpenAIServer(None, host=args.host, port=args.port, api_key=keys, ctx_tokens=args.ctx,
                              allowed_hosts=[h for hs in args.allowed_hosts for h in hs],
                              allowed_origins=[o for os_ in args.allowed_origins for o in os_])
    except OSError as exc:
        print(f"clover-desk serve: error: cannot listen on {args.host}:{args.port} ({exc.strerror or exc})",
              file=sys.stderr)
        return 2
    logging.getLogger("clover_desk.access").setLevel(logging.INFO)  # one line per request on stderr
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()  # /health answers "loading" while the model loads; the API answers 503 until it is ready
    try:
        if not _is_loopback(server.host) and not keys:
            print(f"clover-desk serve: warning: listening on {server.host} without an API key "
                  "(--insecure-no-api-key): anyone who can reach this machine can use the model", file=sys.stderr)
        server.attach(_load(args))
        print(f"listening on {server.url}", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:  # the answers in progress end with an error; main() prints one line, exit 130
        server.close("the server was interrupted (Ctrl+C); the answer was cut short")
        raise
    finally:
        server.close()
        signal.signal(signal.SIGTERM, previous)
    return 0


def _load(args: argparse.Namespace) -> Any:
    from clover_desk.engine.api import Engine, plan_for
    from clover_desk.engine.errors import PlanError

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    plan = None
    if args.vram_budget_bytes is not None:
        plan = plan_for(args.model, args.vram_budget_bytes, args.ctx, dtype, device=args.device)
        if not plan.fits:
            raise PlanError(plan.reason)
    precision = cmd_generate.precision_of(args.model, plan, args.quantized)
    cmd_generate.check_float_load_fits(args.model, precision, dtype, args.device)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    engine = Engine.load(args.model, device=args.device, precision=precision,
                         placement=plan, dtype=dtype, compile=args.compile,
                         progress=cmd_generate.compile_stage_printer("serve") if args.compile else None,
                         gpu_paths=args.gpu_paths)
    return cmd_generate.apply_cache_ram(engine, args)
