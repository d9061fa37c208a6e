"""Structured output (engine/decode/grammar.py) in the AR, block-diffusion and spec loops, on the tiny random
checkpoint: whatever the random weights prefer, the answer is JSON the schema accepts (unless the budget ran
out), diffusion commits only a grammar-valid left prefix, spec equals constrained AR greedy.

Default run: ~30 s on the shared 2-core test machine. The ``slow`` property tests (40 random schemas per mode,
sampled and greedy, and spec over 4) take ~2.5 min there (measured 134 s)."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.cli import main as cli
from clover_desk.engine.api import Engine
from clover_desk.engine.decode import grammar
from clover_desk.engine.decode.events import BlockStep, Finished, GenerationParams
from clover_desk.engine.decode.generate import generate
from clover_desk.engine.decode.grammar import structured_spec
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.errors import PromptError

NAMES = ("name", "city", "count", "ok", "tags", "color", "score", "id")
WORDS = ("red", "green", "blue", "a b", "zürich", "x")


def random_schema(rng: random.Random) -> dict[str, Any]:
    """An object schema of the small family: string (bounded), integer (bounded), boolean, enum and array fields,
    some of them required, no other keys."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(("string", "integer", "boolean", "enum", "array"))
        if kind == "string":
            field: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 8)}
            if rng.random() < 0.3:
                field["minLength"] = 1
        elif kind == "integer":
            field = {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 500)}
        elif kind == "boolean":
            field = {"type": "boolean"}
        elif kind == "enum":
            field = {"enum": rng.sample(WORDS, rng.randint(1, 4))}
        else:
            items = rng.choice(({"type": "integer", "minimum": 0, "maximum": 9},
                                {"type": "string", "maxLength": 3}, {"type": "boolean"}))
            field = {"type": "array", "items": items, "maxItems": rng.randint(1, 4)}
        props[f"{rng.choice(NAMES)}{i}"] = field
    required = rng.sample(sorted(props), rng.randint(0, len(props)))
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_clover_dir, one_torch_thread) -> Engine:  # noqa: ANN001, F811
    return Engine.load(tiny_clover_dir)


def _run(engine: Engine, schema: dict[str, Any], mode: str, n: int = 96, content: str = "Answer in JSON.",
         **params: Any) -> tuple[list[object], Finished]:
    events = list(engine.generate(
        messages=[{"role": "user", "content": content}],
        params=GenerationParams(mode=mode, max_new_tokens=n, enable_thinking=False,
                                structured=structured_spec(schema), **params)))
    done = events[-1]
    assert isinstance(done, Finished)
    return events, done


def _check_answer(done: Finished, schema: dict[str, Any]) -> bool:
    """The answer validates unless the budget ran out; True when it ended on its own."""
    if done.stop_reason == "max_new_tokens":
        return False
    assert done.stop_reason == "eos", done
    jsonschema.validate(json.loads(done.text), schema)
    return True


def _left_prefix_steps(events: list[object]) -> int:
    """Every pass of a constrained diffusion block commits at least one slot, and its committed slots are a left
    prefix of the block; returns how many passes were checked."""
    steps = [e for e in events if isinstance(e, BlockStep)]
    for step in steps:
        open_slots = list(step.masked[step.prompt_slots:])
        first_open = open_slots.index(True) if True in open_slots else len(open_slots)
        assert not any(open_slots[:first_open]) and all(open_slots[first_open:]), step.masked
        assert any(step.committed_now), step
        now = [i for i, c in enumerate(step.committed_now) if c]
        assert now == list(range(now[0], now[-1] + 1)), step.committed_now  # one run, with no gap
    return len(steps)


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_random_schemas_always_validate(engine: Engine, mode: str) -> None:
    rng = random.Random(33)
    runs = 6
    ended = 0
    for case in range(runs):
        schema = random_schema(rng)
        sampled = case % 2 == 1
        events, done = _run(engine, schema, mode, temperature=0.8 if sampled else 0.0, seed=case)
        ended += _check_answer(done, schema)
        if mode == "diffusion":
            assert _left_prefix_steps(events) >= 1
    assert ended >= runs - 1, f"only {ended} of {runs} answers ended before the budget: the test would be vacuous"


def test_spec_equals_constrained_ar_greedy(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    _, ar = _run(engine, schema, "ar", n=16, temperature=0.0)
    _, spec = _run(engine, schema, "spec", n=16, temperature=0.0)
    assert spec.token_ids == ar.token_ids
    assert _check_answer(spec, schema)


def test_json_object_is_an_object(engine: Engine) -> None:
    """``{"type": "object"}`` (response_format json_object) bounds nothing, so random weights write long keys: two
    prompts whose greedy answers end within the budget."""
    ended = 0
    for case in (4, 5):
        _, done = _run(engine, {"type": "object"}, "ar", n=160, content=f"Some JSON please ({case}).",
                       temperature=0.0)
        assert done.text.startswith("{")
        if done.stop_reason == "eos":
            ended += 1
            assert isinstance(json.loads(done.text), dict)
    assert ended >= 2


def test_the_grammar_changes_the_answer(engine: Engine) -> None:
    """Without the constraint the same request is not JSON: the mask is what makes it so."""
    schema = random_schema(random.Random(1))
    _, constrained = _run(engine, schema, "ar", temperature=0.0)
    events = list(engine.generate(messages=[{"role": "user", "content": "Answer in JSON."}],
                                  params=GenerationParams(mode="ar", max_new_tokens=96, enable_thinking=False,
                                                          temperature=0.0)))
    with pytest.raises(json.JSONDecodeError):
        json.loads(events[-1].text)
    assert _check_answer(constrained, schema)


def test_a_schema_the_engine_cannot_enforce_is_refused_before_any_event(engine: Engine) -> None:
    assert grammar.schema_problem({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert "not" in (grammar.schema_problem({"not": {"type": "string"}}) or "")
    assert "look-around" in (grammar.schema_problem({"type": "string", "pattern": "(?=a)"}) or "")
    with pytest.raises(PromptError, match="uniqueItems"):
        engine.generate(messages=[{"role": "user", "content": "x"}],
                        params=GenerationParams(mode="ar", structured=structured_spec(
                            {"type": "array", "uniqueItems": True})))
    with pytest.raises(PromptError, match="structured output"):
        engine.generate(prompt_ids=[1, 2, 3], params=GenerationParams(mode="ar", structured="[1]"))


def test_open_thinking_is_free_then_the_answer_is_constrained(engine: Engine) -> None:
    """A prompt that ends inside <think>: the grammar takes any text, </think>, blanks, then the JSON."""
    tok = engine.tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = grammar.COMPILER.constraint(structured_spec(schema), tok, engine.config.vocab_size, (2,), tok.think_end_id)
    thinking = tok.encode("Hmm, { not json at all")
    answer = tok.encode('{"a": 7}')
    ids = thinking + [tok.think_end_id] + tok.encode("\n\n") + answer
    assert c.accepts(ids + [2]) == len(ids) + 1
    c.advance(ids)
    assert c.finished and c.accepting
    closed = grammar.COMPILER.constraint(structured_spec(schema), tok, engine.config.vocab_size, (2,))
    assert closed.accepts(thinking) == 0  # without an open thinking section the answer starts at once
    assert not bool(closed.allowed()[tok.think_end_id])


def test_ar_thinks_freely_when_the_prompt_leaves_thinking_open(engine: Engine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("ab") + [tok.think_start_id]
    thinking = tok.encode("Hmm { no JSON here")
    script = thinking + [tok.think_end_id] + tok.encode('\n\n{"a": 1}') + [2]
    model = ScriptedJsonModel(script, len(prompt), engine.config.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s = DecodeSettings(mode="ar", max_new_tokens=40, mask_token_id=5, eos_token_ids=(2,), think_start_id=3,
                       think_end_id=4, structured=structured_spec(schema))
    done = list(generate(model, prompt, s, tok, vocab_size=engine.config.vocab_size))[-1]
    assert list(done.token_ids) == script
    assert done.thinking == "Hmm { no JSON here" and json.loads(done.text) == {"a": 1}


def test_before_and_after_use_the_tokenizer_s_own_tokens(engine: Engine) -> None:
    tok = engine.tokenizer
    start, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    spec = structured_spec({"type": "object", "properties": {"name": {"const": "f"}}, "required": ["name"]},
                           before="<tool_call>\n", after="\n</tool_call>")
    c = grammar.COMPILER.constraint(spec, tok, engine.config.vocab_size, (2,))
    allowed = c.allowed()
    assert bool(allowed[start]) and int(allowed.sum()) == 1
    ids = [start] + tok.encode('\n{"name": "f"}\n') + [end, 2]
    assert c.accepts(ids) == len(ids)
    assert c.accepts(tok.encode('{"name":"f"}')) == 0


def test_masks_along_a_draft_and_the_state_after(engine: Engine) -> None:
    tok = engine.tokenizer
    c = grammar.COMPILER.constraint(structured_spec({"type": "boolean"}), tok, engine.config.vocab_size, (2,))
    before = c.allowed().clone()
    good = tok.encode("true")
    masks = c.masks_along(good + [2, 9])
    assert len(masks) == len(good) + 1  # one before each token of "true"; the EOS ends the run
    assert bool(masks[-1][2]) and int(masks[-1].sum()) == 1  # after "true": only the end
    assert bool((c.allowed() == before).all())  # left as it was
    assert c.accepts(tok.encode("nope")) == 0


class ScriptedJsonModel:
    """A fake model whose row for absolute position p peaks at ``script[p - prompt_len]`` (logit ``margin``, or
    ``low`` at the positions in ``unsure``): random weights never propose several grammar-valid tokens in one pass,
    this does."""

    def __init__(self, script: list[int], prompt_len: int, vocab: int, unsure: tuple[int, ...] = (),
                 margin: float = 30.0, low: float = 0.5) -> None:
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.unsure, self.margin, self.low = unsure, margin, low

    def new_cache(self, max_len: int) -> list[int]:
        return []

    def forward(self, ids: torch.Tensor, start_pos: int, cache: list[int], block_size: int | None = None,
                write_cache: bool = True, last_only: bool = False, prefill: bool = False) -> torch.Tensor:
        logits = torch.zeros(ids.shape[0], self.vocab)
        for i in range(ids.shape[0]):
            k = start_pos + i + 1 - self.prompt_len if block_size is None else start_pos + i - self.prompt_len
            if 0 <= k < len(self.script):
                logits[i, self.script[k]] = self.low if k in self.unsure else self.margin
        if write_cache:
            cache.extend(ids.tolist())
        return logits[-1:] if last_only else logits


def _scripted(engine: Engine, answer: str | list[int], schema: dict[str, Any], unsure: tuple[int, ...] = (),
              n: int = 24) -> tuple[list[int], list[BlockStep], Finished]:
    tok = engine.tokenizer
    prompt = tok.encode("ab")  # inside the first block: its slots start at len(prompt)
    script = (tok.encode(answer) if isinstance(answer, str) else answer) + [2]
    model = ScriptedJsonModel(script, len(prompt), engine.config.vocab_size, unsure)
    s = DecodeSettings(mode="diffusion", max_new_tokens=n, block_size=32, threshold=0.9, mask_token_id=5,
                       eos_token_ids=(2,), structured=structured_spec(schema))
    events = list(generate(model, prompt, s, tok, vocab_size=engine.config.vocab_size))
    assert isinstance(events[-1], Finished)
    return script, [e for e in events if isinstance(e, BlockStep)], events[-1]


def test_diffusion_commits_the_whole_valid_left_prefix_in_one_pass(engine: Engine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
    script, steps, done = _scripted(engine, '{"a": 7, "b": true}', schema)
    assert len(steps) == 1 and sum(steps[0].committed_now) == len(script)  # every slot, the EOS too, at once
    assert list(done.token_ids) == script and json.loads(done.text) == {"a": 7, "b": True}


def test_diffusion_stops_at_the_first_slot_the_grammar_refuses(engine: Engine) -> None:
    """``{"a": oops}``: the pass commits ``{"a": `` only; later passes write what the grammar allows."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    valid = engine.tokenizer.encode('{"a": ')
    script, steps, done = _scripted(engine, valid + engine.tokenizer.encode("oops}"), schema)
    first = [i for i, c in enumerate(steps[0].committed_now) if c]
    assert len(first) == len(valid)
    assert list(done.token_ids[: len(valid)]) == valid and done.stop_reason == "eos"
    jsonschema.validate(json.loads(done.text), schema)
    _left_prefix_steps(steps)


def test_diffusion_stops_at_the_first_slot_the_threshold_leaves_open(engine: Engine) -> None:
    """A slot the threshold rule leaves open stops the run even when the confident ones after it would be valid
    without it (the string's next word)."""
    tok = engine.tokenizer
    head = tok.encode('{"s": "hello')
    answer = head + tok.encode(" world") + tok.encode('"}')
    schema = {"type": "object", "properties": {"s": {"type": "string"}}}
    script, steps, done = _scripted(engine, answer, schema, unsure=(len(head),))
    assert [i for i, c in enumerate(steps[0].committed_now) if c] == list(range(2, 2 + len(head)))
    assert list(done.token_ids) == script and json.loads(done.text) == {"s": "hello world"}
    assert len(steps) == 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_many_random_schemas_always_validate(engine: Engine, mode: str) -> None:
    """~50-60 s per mode on the test machine."""
    rng = random.Random(2033)
    runs, ended = 40, 0
    for case in range(runs):
        schema = random_schema(rng)
        events, done = _run(engine, schema, mode, content=f"Case {case}: JSON.",
                            temperature=0.0 if case % 3 == 0 else 1.0, seed=case)
        ended += _check_answer(done, schema)
        if mode == "diffusion":
            _left_prefix_steps(events)
    assert ended >= runs * 0.85, f"{ended} of {runs} ended before the budget"


@pytest.mark.slow
def test_spec_equals_constrained_ar_over_random_schemas(engine: Engine) -> None:
    """~30 s on the test machine (random weights: spec's drafts are mostly wrong, many passes a token)."""
    rng = random.Random(7)
    for case in range(4):
        schema = random_schema(rng)
        _, ar = _run(engine, schema, "ar", n=40, content=f"Spec case {case}.", temperature=0.0)
        _, spec = _run(engine, schema, "spec", n=40, content=f"Spec case {case}.", temperature=0.0)
        assert spec.token_ids == ar.token_ids
        _check_answer(spec, schema)


def test_generate_json_schema_flag(tiny_clover_dir, tmp_path, capsys) -> None:  # noqa: ANN001, F811
    """``clover-desk generate --json-schema FILE`` (in-process): the answer validates; a file that is not JSON and a
    schema that cannot be enforced are one line each, exit 2, before the model loads."""
    schema = random_schema(random.Random(5))
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    code = cli.main(["generate", "--model", str(tiny_clover_dir), "--prompt", "Answer in JSON.", "--mode", "ar",
                     "--no-think", "--max-new-tokens", "96", "--json-schema", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    done = json.loads(out.splitlines()[-1])
    assert done["event"] == "finished" and done["stop_reason"] == "eos"
    jsonschema.validate(json.loads(done["text"]), schema)
    for text, words in (("{nope", ("not JSON", "line 1")), ('{"type": "object", "not": {}}', ('"not"',))):
        path.write_text(text, encoding="utf-8")
        code = cli.main(["generate", "--model", str(tiny_clover_dir), "--prompt", "x", "--json-schema", str(path)])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and f"--json-schema {path}" in err, err
        assert all(w in err for w in words), err
