"""What structured output costs in denoising passes: block diffusion with and without a JSON-schema grammar, on a
tiny random checkpoint (made into a temporary folder), plus AR and spec for scale.

    .venv/bin/python scripts/bench_structured.py [--cases 12] [--max-new 96] [--threads 1]

Prints one line per mode: requests, tokens, passes, passes per token, the requests that ended on their own (EOS)
and, for the constrained runs, how many answers the schema accepted (jsonschema). Under a grammar only a
grammar-valid left prefix of a block commits (engine/decode/diffusion.py, ``_grammar_commit``), so diffusion is at
most as parallel as the model's confident left-to-right runs; on random weights that is one token a pass.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from clover_desk.engine.api import Engine
from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.engine.decode.grammar import structured_spec
from clover_desk.engine.weights.tiny import make_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_structured import random_schema  # noqa: E402 - the tests' schema family


def run(engine: Engine, mode: str, schema: dict[str, Any] | None, content: str, max_new: int) -> Finished:
    params = GenerationParams(mode=mode, max_new_tokens=max_new, temperature=0.0, enable_thinking=False,
                              structured=None if schema is None else structured_spec(schema))
    done = list(engine.generate(messages=[{"role": "user", "content": content}], params=params))[-1]
    assert isinstance(done, Finished)
    return done


def valid(done: Finished, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(done.text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--spec-cases", type=int, default=3, help="spec is slow on random weights (~16 passes a token)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.load(make_tiny(Path(tmp) / "tiny", model_type="clover_moe", seed=0))
        rng = random.Random(2033)
        cases = [(random_schema(rng), f"Case {i}: answer in JSON.") for i in range(args.cases)]
        rows = [("diffusion", False), ("diffusion", True), ("ar", False), ("ar", True), ("spec", True)]
        print(f"tiny clover_moe, block 32, threshold 0.95, greedy, {args.cases} random schemas, max {args.max_new} "
              f"new tokens, {args.threads} thread(s)")
        for mode, constrained in rows:
            n = args.spec_cases if mode == "spec" else args.cases
            tokens = passes = ended = ok = 0
            started = time.perf_counter()
            for schema, content in cases[:n]:
                done = run(engine, mode, schema if constrained else None, content, args.max_new)
                tokens += done.tokens
                passes += done.passes
                ended += done.stop_reason == "eos"
                ok += constrained and valid(done, schema)
                seconds = time.perf_counter() - started
            checked = f", schema accepted {ok}/{n}" if constrained else ""
            print(f"{mode:9s} {'grammar' if constrained else 'free   '}: {n} requests, {tokens} tokens, {passes} passes, "
                  f"{passes / max(tokens, 1):.3f} passes/token, ended by EOS {ended}/{n}{checked}, {seconds:.1f} s")


if __name__ == "__main__":
    main()
