"""``clover-desk``: the GUI with no arguments, else one subcommand.

Each subcommand lives in its own module ``clover_desk.cmd_<name>`` exposing ``add_arguments(parser)`` and
``run(args) -> int``; ``bench <suite>`` maps to ``clover_desk.cmd_bench_<suite>``. Modules are imported only when
their command runs, so ``clover-desk plan`` never pays for Qt and ``clover-desk preview`` never pays for torch.

The GPU paths and kernel switches (``engine.settings.GpuPaths``) are read from the environment here, once, into
``args.gpu_paths``: a bad switch is one line and exit 2 for the commands that run an engine (:data:`ENGINE_COMMANDS`;
``doctor`` reports it as a finding, the others leave ``args.gpu_paths`` None). The commands
that load a model pass the object on (``Engine.load(gpu_paths=...)``; a benchmark sets the kernels' switches from
it), the window hands it to its engine process.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from clover_desk.engine.settings import GpuPaths, SettingsError

COMMANDS: dict[str, tuple[str, str]] = {
    "gui": ("clover_desk.cli.gui", "open the Clover Desk window (the default)"),
    "doctor": ("clover_desk.cli.doctor", "check torch, the GPU, its driver and bitsandbytes; say what to install"),
    "generate": ("clover_desk.cli.generate", "generate text from a model folder"),
    "chat": ("clover_desk.cli.chat", "chat with a model folder in the terminal"),
    "gguf-fix": ("clover_desk.cli.gguf_fix", "copy an official Clover GGUF into the layout upstream llama.cpp loads"),
    "models": ("clover_desk.cli.models", "list the models the window knows, by the names --model takes"),
    "make-tiny": ("clover_desk.cli.make_tiny", "write a tiny random Clover checkpoint (its output is noise)"),
    "plan": ("clover_desk.cli.plan", "plan VRAM/RAM placement for a model and a budget"),
    "preview": ("clover_desk.cli.preview", "open an HTML file in the sandboxed preview"),
    "serve": ("clover_desk.cli.serve", "serve a model folder over an OpenAI-compatible HTTP API"),
}
BENCH_SUITES: dict[str, tuple[str, str]] = {
    "speed": ("clover_desk.bench.speed", "prefill / AR / diffusion speed on a random config (CPU or GPU)"),
    "offload": ("clover_desk.bench.offload", "host-to-device bytes per token under a VRAM plan"),
    "load": ("clover_desk.bench.load", "convert and load under a plan: peak RSS and placed bytes next to the plan"),
    "gguf": ("clover_desk.bench.gguf", "GGUF dequantize throughput per type, bytes per streamed expert per file type"),
}
# the commands that run an engine (or, the window, start its process): a refused GPU-path switch stops them
ENGINE_COMMANDS = ("gui", "generate", "chat", "serve", "bench")

_TOP_LEVEL_FLAGS = ("-v", "--verbose")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line naming the flag and what is allowed (exit 2), not a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _build_parser(command: str | None, suite: str | None) -> argparse.ArgumentParser:
    parser = _Parser(prog="clover-desk", description="Run Clover block diffusion locally.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(dest="suite", metavar="SUITE", parser_class=_Parser)
    for name, (module, help_text) in BENCH_SUITES.items():
        p = bench_sub.add_parser(name, help=help_text)
        if command == "bench" and name == suite:
            importlib.import_module(module).add_arguments(p)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line; no subcommand means ``gui`` (its options included)."""
    argv = list(argv)
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    known = command in COMMANDS or command == "bench"
    if not known and not (command is None and {"-h", "--help"} & set(argv)):
        # no subcommand (or a gui option such as --model DIR first): open the window with these options
        top = [a for a in argv if a in _TOP_LEVEL_FLAGS]
        argv = [*top, "gui", *(a for a in argv if a not in _TOP_LEVEL_FLAGS)]
        command = "gui"
    suite = words[1] if command == "bench" and len(words) > 1 else None
    parser = _build_parser(command, suite)
    args = parser.parse_args(argv)
    if args.command == "bench" and args.suite is None:  # not a usage block: which suites there are, exit 2
        parser.exit(2, f"clover-desk bench: name a suite: {', '.join(BENCH_SUITES)} "
                       "(e.g. clover-desk bench speed --shape tiny; see clover-desk bench SUITE --help)\n")
    try:
        args.gpu_paths = GpuPaths.from_env()
    except SettingsError as exc:
        if args.command in ENGINE_COMMANDS:  # (the doctor reports it as a finding; the rest run no engine)
            parser.exit(2, f"clover-desk {args.command}: {exc}\n")
        args.gpu_paths = None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    module = BENCH_SUITES[args.suite][0] if args.command == "bench" else COMMANDS[args.command][0]
    try:
        if args.command == "bench":  # benchmarks build their models by hand: the kernels' switches are set here
            from clover_desk.engine.kernels import switches  # torch: only for the benchmarks

            switches.use(args.gpu_paths)
        return int(importlib.import_module(module).run(args) or 0)
    except KeyboardInterrupt:  # Ctrl+C: one line and the shell's status for it, not a traceback (what a command
        # writes goes to a temporary file renamed into place, so nothing half-written is left where a good file was)
        name = f"bench {args.suite}" if args.command == "bench" else args.command
        print(f"\nclover-desk {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (``plan --json | head``): stop quietly, as a shell tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not raise again
        return 128 + 13  # SIGPIPE's shell status


if __name__ == "__main__":
    sys.exit(main())
