"""``logprobs`` on the HTTP server, through the official ``openai`` client against the real local server (both
endpoints, streamed and not), on the scripted tiny model (tests/scripted_model.py): the shapes, and the values
against the engine's own :class:`~engine.decode.events.TokenLogprobs` for the same prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest
from scripted_model import generation_prompt_end
from server_fixtures import (  # noqa: F401 - fixtures
    NO_THINKING,
    chat_model,
    chat_server,
    client,
    endless_model,
    endless_server,
)
from test_server import HI, _error_of, _raw, _template

from clover_desk.engine.decode.events import Finished, GenerationParams, TokenLogprobs

MODES = ["diffusion", "ar", "spec"]


def _engine_logprobs(server: Any, mode: str, top: int, kinds: tuple[str, ...], **prompt: Any) -> list[TokenLogprobs]:
    engine = server.service.engine
    ids, _ = engine.encode_request(**prompt)
    events = engine.generate(prompt_ids=ids, params=GenerationParams(mode=mode, temperature=0.0), logprobs=top)
    out = []
    for e in events:
        if isinstance(e, TokenLogprobs):
            out += [(t, v, e.alternatives(i)) for i, (t, v, k) in
                    enumerate(zip(e.token_ids, e.logprobs, e.channels)) if k in kinds]
    return out


def _check_chat_entries(entries: list[Any], top: int) -> None:
    for entry in entries:
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == top
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:  # the scripted model's token beats every other by ~25 nats: it is the best one, listed first
            assert entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
            assert entry.logprob > -1e-3
        for alt in entry.top_logprobs:
            if "\ufffd" not in alt.token:  # (a piece of a UTF-8 character shows as U+FFFD; its bytes are the piece)
                assert bytes(alt.bytes).decode("utf-8") == alt.token


@pytest.mark.parametrize("mode", MODES)
def test_chat_logprobs_plain_and_streamed(chat_server, mode: str) -> None:  # noqa: ANN001
    c = client(chat_server)
    extra = {"clover": {"mode": mode}}
    answer = c.chat.completions.create(model="x", messages=HI, logprobs=True, top_logprobs=3, extra_body=extra)
    choice = answer.choices[0]
    assert choice.message.content == "Sure thing."
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == "Sure thing."  # the answer's tokens, not the reasoning's
    _check_chat_entries(entries, 3)
    expected = _engine_logprobs(chat_server, mode, 3, ("answer",), messages=HI)
    assert [e.logprob for e in entries] == pytest.approx([v for _, v, _ in expected], abs=1e-6)
    assert [a.logprob for e in entries for a in e.top_logprobs] == pytest.approx(
        [v for _, _, alts in expected for _, v in alts], abs=1e-6)

    chunks = list(c.chat.completions.create(model="x", messages=HI, logprobs=True, top_logprobs=3, stream=True,
                                            extra_body=extra))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Sure thing."


def test_chat_without_logprobs_has_none_and_top_zero_lists_no_alternatives(chat_server) -> None:  # noqa: ANN001
    c = client(chat_server)
    plain = c.chat.completions.create(model="x", messages=HI, extra_body=NO_THINKING)
    assert plain.choices[0].logprobs is None
    chunks = list(c.chat.completions.create(model="x", messages=HI, stream=True, extra_body=NO_THINKING))
    assert all(ch.choices[0].logprobs is None for ch in chunks if ch.choices)
    bare = c.chat.completions.create(model="x", messages=HI, logprobs=True, extra_body=NO_THINKING)
    entries = bare.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == "Plain answer!" and all(e.top_logprobs == [] for e in entries)


def test_tokens_whose_text_is_held_back_come_with_the_last_chunk(endless_server, endless_model) -> None:  # noqa: ANN001
    """An answer that ends in whitespace (trimmed from the content, held back while streaming): its tokens are still
    listed, in the stream's last chunk."""
    c = client(endless_server)
    start = generation_prompt_end(endless_server.service.engine.tokenizer, enable_thinking=False)
    tokens = len(endless_model.chains[start])  # one "tick tock " round (thinking off)
    body = {"extra_body": {**NO_THINKING, "clover": {"mode": "ar"}}, "max_tokens": tokens, "logprobs": True}
    plain = c.chat.completions.create(model="x", messages=HI, **body)
    entries = plain.choices[0].logprobs.content
    assert plain.choices[0].message.content == "tick tock" and "".join(e.token for e in entries) == "tick tock "
    chunks = list(c.chat.completions.create(model="x", messages=HI, stream=True, **body))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].logprobs.content


def test_a_stop_sequence_cuts_the_logprobs_with_the_text(chat_server) -> None:  # noqa: ANN001
    c = client(chat_server)
    for stream in (False, True):
        answer = c.chat.completions.create(model="x", messages=HI, logprobs=True, stop=["thing"], stream=stream,
                                           extra_body={"clover": {"mode": "ar"}})
        if stream:
            chunks = list(answer)
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                       for e in ch.choices[0].logprobs.content]
        else:
            content, entries = answer.choices[0].message.content, answer.choices[0].logprobs.content
        assert content == "Sure"
        tokens = "".join(e.token for e in entries)
        # every token that starts before the stop is listed; the one that reaches it may run into it, none after
        assert tokens.startswith("Sure ") and len(tokens) - len(entries[-1].token) < len("Sure "), (stream, tokens)


@pytest.mark.parametrize("mode", MODES)
def test_completion_logprobs_plain_and_streamed(chat_server, chat_model, mode: str) -> None:  # noqa: ANN001
    c = client(chat_server)
    prompt = _template(chat_model.path)
    extra = {"clover": {"mode": mode}}
    answer = c.completions.create(model="x", prompt=prompt, max_tokens=50, logprobs=2, extra_body=extra)
    choice = answer.choices[0]
    text = "Let me think</think>Sure thing."
    assert choice.text == text
    lp = choice.logprobs
    assert "".join(lp.tokens) == text  # every token of the text, the </think> marker too
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(value) and len(top) <= 3  # the 2 best and the chosen
    expected = _engine_logprobs(chat_server, mode, 2, ("thinking", "answer", "marker"), prompt=prompt, raw=True)
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in expected], abs=1e-6)

    chunks = list(c.completions.create(model="x", prompt=prompt, max_tokens=50, logprobs=2, stream=True,
                                       extra_body=extra))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets from the start of the whole text
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_fields_are_a_400_naming_the_field(chat_server, path: str, extra: dict[str, Any],  # noqa: ANN001
                                                        param: str) -> None:
    body = {"model": "x", **({"prompt": "hi"} if path == "/v1/completions" else {"messages": HI}), **extra}
    status, _, raw = _raw(chat_server, "POST", path, json.dumps(body).encode())
    error = _error_of(raw)
    assert (status, error["param"], error["code"]) == (400, param, "invalid_value"), error
    assert param in error["message"]


def test_spec_mode_reports_its_verify_figures(chat_server) -> None:  # noqa: ANN001
    """The ``clover`` object of a spec answer (plain and streamed): accepted tokens per verify pass, forwards per
    token and the counts, as the engine's Finished has them; the other modes do not carry them."""
    c = client(chat_server)
    engine = chat_server.service.engine
    ids, _ = engine.encode_request(messages=HI)
    done = [e for e in engine.generate(prompt_ids=ids, params=GenerationParams(mode="spec", temperature=0.0))
            if isinstance(e, Finished)][0]
    assert done.verify_passes > 0 and done.accepted_per_verify > 0
    plain = c.chat.completions.create(model="x", messages=HI, extra_body={"clover": {"mode": "spec"}})
    chunks = list(c.chat.completions.create(model="x", messages=HI, stream=True,
                                            extra_body={"clover": {"mode": "spec"}}))
    streamed = [ch.clover for ch in chunks if getattr(ch, "clover", None)]
    for extras in (plain.clover, streamed[-1]):
        assert extras["mode"] == "spec"
        assert extras["verify_passes"] == done.verify_passes == done.spec["verify_passes"]
        assert extras["accepted_per_verify"] == pytest.approx(done.spec["accepted"] / done.spec["verify_passes"],
                                                              abs=1e-4)
        assert extras["forwards_per_token"] == pytest.approx(extras["passes"] / plain.usage.completion_tokens,
                                                             abs=1e-4)
        assert extras["spec"] == done.spec
    for mode in ("ar", "diffusion"):
        other = c.chat.completions.create(model="x", messages=HI, extra_body={"clover": {"mode": mode}})
        assert "accepted_per_verify" not in other.clover and "verify_passes" not in other.clover
