"""Continuing an answer that was cut short (``GenerationParams.continue_final_message``): the engine's prompt, the
worker protocol and the OpenAI server, on a scripted tiny model (tests/scripted_model.py) whose script is spelled
with whole-word added tokens, so that the text of a cut answer encodes back to the very ids the model wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_tiny import tiny_clover_dir  # noqa: F401 (session fixture)
from scripted_model import ScriptedModel, build_scripted_model
from server_fixtures import client, running_server

from clover_desk.engine.decode.events import Finished, GenerationParams
from clover_desk.engine.decode.tokenizer import continuation_text
from clover_desk.engine.errors import PromptError
from clover_desk.worker.protocol import ProtocolError, check_params
from clover_desk.worker.server import parse_chat_request

WORDS = ["Alpha", " Bravo", " Charlie", " Delta", "Echo", " Foxtrot", " Golf", " Hotel", "India", " Juliet", " Kilo"]
THINKING = "Alpha Bravo Charlie Delta</think>Echo Foxtrot Golf Hotel<|im_end|>"
PLAIN = "India Juliet Kilo<|im_end|>"
USER = [{"role": "user", "content": "Spell it out"}]


@pytest.fixture(scope="module")
def words_model(tmp_path_factory: pytest.TempPathFactory) -> ScriptedModel:
    return build_scripted_model(tmp_path_factory.mktemp("words_model"), thinking=THINKING, no_thinking=PLAIN,
                                extra_tokens=WORDS)


@pytest.fixture(scope="module")
def engine(words_model: ScriptedModel) -> Any:
    from clover_desk.engine.api import Engine

    return Engine.load(words_model.path)


def _done(events: Iterator[Any]) -> Finished:
    *_, done = list(events)
    assert isinstance(done, Finished)
    return done


# ---------------------------------------------------------------------------------------------------------------
# the text of what the model wrote


@pytest.mark.parametrize(
    ("head", "thinking", "answer", "expected"),
    [
        ("<|im_start|>assistant\n<think>\n", "Let me", "", "Let me"),  # cut while thinking
        ("<|im_start|>assistant\n<think>\n", "Let me", "\n\nSure", "Let me</think>\n\nSure"),  # cut in the answer
        ("<|im_start|>assistant\n<think>\n", "", "Sure", "</think>Sure"),  # the thinking closed at once
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "", "Sure", "Sure"),  # thinking off
        ("<|im_start|>assistant\n", "hmm", "", "<think>hmm"),  # the model opened a thinking section itself
        ("<|im_start|>assistant\n", "hmm", "Sure", "<think>hmm</think>Sure"),
    ],
)
def test_continuation_text_is_what_the_model_wrote(head: str, thinking: str, answer: str, expected: str) -> None:
    assert continuation_text(head, thinking, answer, "<think>", "</think>") == expected


def test_continuation_text_without_thinking_markers_joins_the_channels() -> None:
    assert continuation_text("<|im_start|>assistant\n", "a", "b", None, None) == "ab"


# ---------------------------------------------------------------------------------------------------------------
# the engine: a cut answer continued is the uncut answer


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
@pytest.mark.parametrize("cut", [2, 4, 5, 7])  # inside the thinking, at its end, after </think>, in the answer
def test_continuing_a_cut_answer_writes_the_rest_of_it(engine: Any, mode: str, cut: int) -> None:
    whole = _done(engine.generate(messages=USER, params=GenerationParams(mode=mode)))
    assert (whole.thinking, whole.text, whole.stop_reason) == ("Alpha Bravo Charlie Delta", "Echo Foxtrot Golf Hotel",
                                                               "eos")
    first = _done(engine.generate(messages=USER, params=GenerationParams(mode=mode, max_new_tokens=cut)))
    assert first.stop_reason == "max_new_tokens" and first.tokens == cut
    partial = {"role": "assistant", "content": first.text, "reasoning_content": first.thinking}
    rest = _done(engine.generate(messages=[*USER, partial],
                                 params=GenerationParams(mode=mode, continue_final_message=True)))
    assert rest.stop_reason == "eos"
    assert first.thinking + rest.thinking == whole.thinking
    assert first.text + rest.text == whole.text


def test_continuing_with_thinking_off(engine: Any) -> None:
    off = GenerationParams(mode="ar", enable_thinking=False)
    first = _done(engine.generate(messages=USER, params=GenerationParams(mode="ar", enable_thinking=False,
                                                                          max_new_tokens=1)))
    assert (first.thinking, first.text) == ("", "India")
    partial = {"role": "assistant", "content": first.text}
    rest = _done(engine.generate(messages=[*USER, partial], params=GenerationParams(
        mode="ar", enable_thinking=False, continue_final_message=True)))
    assert (rest.thinking, rest.text) == ("", " Juliet Kilo")
    assert first.text + rest.text == _done(engine.generate(messages=USER, params=off)).text


def test_the_prompt_ends_with_the_answer_and_no_end_of_turn(engine: Any) -> None:
    tok = engine.tokenizer
    partial = {"role": "assistant", "content": "Echo", "reasoning_content": "Alpha Bravo"}
    text = tok.continuation_prompt([*USER, partial])
    head = tok.apply_chat_template(USER)
    assert text == head + "Alpha Bravo</think>Echo"
    ids = engine.prompt_ids(messages=[*USER, partial], continue_final=True)
    assert ids == tok.encode(text) and ids[-1] == tok.token_to_id("Echo")


@pytest.mark.parametrize(
    ("messages", "kwargs", "match"),
    [
        (USER, {}, "last message must be the assistant answer to continue, not 'user'"),
        ([*USER, {"role": "assistant", "content": ""}], {}, "the last message is empty"),
        ([{"role": "assistant", "content": "Echo"}], {}, "needs the messages it answers"),
        ([*USER, {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}],
         {}, "ended its turn with tool calls"),
        ([*USER, {"role": "assistant", "content": 5}], {}, "last message's content must be text"),
    ],
)
def test_what_cannot_be_continued_is_one_clear_error(engine: Any, messages: list[dict[str, Any]],
                                                      kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PromptError, match=match):
        engine.generate(messages=messages, params=GenerationParams(continue_final_message=True, **kwargs))


def test_continue_needs_messages(engine: Any) -> None:
    with pytest.raises(PromptError, match="cannot go with prompt_ids"):
        engine.generate(prompt_ids=[1, 2, 3], params=GenerationParams(continue_final_message=True))
    with pytest.raises(PromptError, match="cannot go with prompt"):
        engine.generate(prompt="hi", params=GenerationParams(continue_final_message=True))


def test_the_worker_protocol_carries_the_flag() -> None:
    assert check_params({"continue_final_message": True}).continue_final_message is True
    with pytest.raises(ProtocolError, match="continue_final_message"):
        check_params({"continue_final_message": "yes"})


# ---------------------------------------------------------------------------------------------------------------
# the decode schedules see the written part as output (a random tiny model, where every penalty moves tokens)


@pytest.fixture(scope="module")
def tiny(tiny_clover_dir: Path) -> Any:  # noqa: F811
    from clover_desk.engine.api import Engine

    return Engine.load(tiny_clover_dir)


def _ids(engine: Any, ids: list[int], params: GenerationParams, written: int = 0) -> list[int]:
    return list(_done(engine.generate(prompt_ids=ids, params=params, written=written)).token_ids)


def test_ar_continuation_keeps_the_presence_penalty_of_what_was_written(tiny: Any) -> None:
    prompt = list(range(40, 56))
    plain = dict(mode="ar", do_sample=False, presence_penalty=1.5, repetition_penalty=1.0)
    whole = _ids(tiny, prompt, GenerationParams(max_new_tokens=24, **plain))
    assert len(whole) == 24
    k = 8
    rest = GenerationParams(max_new_tokens=16, **plain)
    assert _ids(tiny, prompt + whole[:k], rest, written=k) == whole[k:]
    # the penalty matters here: counted as prompt, the written tokens would not be penalized, and the rest differs
    assert _ids(tiny, prompt + whole[:k], rest) != whole[k:]


def test_diffusion_continuation_keeps_the_length_ramp_where_it_was(tiny: Any) -> None:
    from clover_desk.engine.decode.generate import generate
    from clover_desk.engine.decode.settings import DecodeSettings, resolve_settings

    base = resolve_settings(GenerationParams(block_size=8, threshold=0.9, do_sample=False), tiny.generation_defaults,
                            tiny.config, tiny.tokenizer)
    eos = base.eos_token_ids[0]
    ramped = DecodeSettings(**{**base.__dict__, "max_new_tokens": 64, "presence_penalty": 0.0,
                               "repetition_penalty": 1.0, "length_penalty": 40.0, "length_penalty_start": 4,
                               "length_penalty_window": 1})

    def run(ids: list[int], written: int = 0, max_new: int = 64) -> list[int]:
        s = DecodeSettings(**{**ramped.__dict__, "max_new_tokens": max_new})
        *_, done = list(generate(tiny.model, ids, s, tiny.tokenizer, written=written))
        return list(done.token_ids)

    prompt = list(range(40, 56))  # two whole blocks of 8: the continuation starts on a block boundary too
    whole = run(prompt)
    assert eos in whole and 8 < len(whole) <= 16  # the ramp (full from 5 tokens) ended it in the second block
    k = 8
    assert run(prompt + whole[:k], written=k) == whole[k:]
    assert eos not in run(prompt + whole[:k], max_new=8)  # from 0 the ramp would not have started yet


def test_written_must_leave_a_prompt(tiny: Any) -> None:
    with pytest.raises(PromptError, match="written must be 0 to 2"):
        tiny.generate(prompt_ids=[5, 6, 7], written=3)
    with pytest.raises(PromptError, match="written goes with prompt_ids"):
        tiny.generate(messages=USER, written=1)


def test_a_continued_chat_counts_its_written_tokens(engine: Any) -> None:
    partial = {"role": "assistant", "content": "Echo", "reasoning_content": "Alpha Bravo"}
    ids, written = engine.encode_request(messages=[*USER, partial], continue_final=True)
    assert written == 4 and ids[-4:] == [engine.tokenizer.token_to_id(t) for t in ("Alpha", " Bravo", "</think>",
                                                                                      "Echo")]
    assert engine.encode_request(messages=USER)[1] == 0


# ---------------------------------------------------------------------------------------------------------------
# the OpenAI server: vLLM's continue_final_message


def test_the_server_continues_an_answer_through_the_openai_client(words_model: ScriptedModel) -> None:
    with running_server(words_model.path) as server:
        api = client(server)
        first = api.chat.completions.create(model="any", messages=USER, max_tokens=2)
        assert first.choices[0].finish_reason == "length"
        cut = first.choices[0].message
        assert (cut.reasoning_content, cut.content or "") == ("Alpha Bravo", "")
        partial = {"role": "assistant", "content": "", "reasoning_content": cut.reasoning_content}
        rest = api.chat.completions.create(model="any", messages=[*USER, partial],
                                           extra_body={"continue_final_message": True,
                                                       "add_generation_prompt": False})
        message = rest.choices[0].message
        assert (message.reasoning_content, message.content) == (" Charlie Delta", "Echo Foxtrot Golf Hotel")
        assert rest.choices[0].finish_reason == "stop" and rest.clover["ignored_fields"] == []
        assert rest.usage.prompt_tokens == first.usage.prompt_tokens + 2  # the two words it wrote, no end of turn


def test_the_server_streams_the_rest_of_a_cut_answer(words_model: ScriptedModel) -> None:
    with running_server(words_model.path) as server:
        api = client(server)
        first = api.chat.completions.create(model="any", messages=USER, max_tokens=7, extra_body={"clover": {
            "mode": "ar"}})
        cut = first.choices[0].message
        assert (cut.reasoning_content, cut.content) == ("Alpha Bravo Charlie Delta", "Echo Foxtrot")
        partial = {"role": "assistant", "content": cut.content, "reasoning_content": cut.reasoning_content}
        chunks = list(api.chat.completions.create(model="any", messages=[*USER, partial], stream=True,
                                                  extra_body={"continue_final_message": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        assert (reasoning, text) == ("", " Golf Hotel")
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": "yes"}, "continue_final_message"),
        ({"add_generation_prompt": 1}, "add_generation_prompt"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"continue_final_message": True}, "messages[0].role"),  # the last message is the user's
    ],
)
def test_the_server_refuses_a_bad_continue_request_naming_the_field(body: dict[str, Any], param: str) -> None:
    from clover_desk.worker.server import ApiError

    with pytest.raises(ApiError) as exc:
        parse_chat_request({"messages": USER, **body})
    assert exc.value.status == 400 and exc.value.param == param


def test_a_plain_request_is_unchanged_by_the_new_fields() -> None:
    request = parse_chat_request({"messages": USER, "add_generation_prompt": True, "continue_final_message": False})
    assert request.continue_final is False and request.ignored_fields == ()
