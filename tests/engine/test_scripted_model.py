"""The scripted tiny model the server tests rely on (tests/scripted_model.py): it writes exactly its script, in both
decoding modes, picks the script by the thinking switch, loops when told to, and refuses scripts it cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_model import build_scripted_model, distinct_tokenization, scripted_state_dict
from server_fixtures import CHAT_PLAIN, CHAT_THINKING, TOOL_JSON, chat_model, endless_model, tools_model  # noqa: F401


def _run(model_dir: Path, enable_thinking: bool, mode: str, max_new_tokens: int = 200):  # noqa: ANN202
    from clover_desk.engine.api import Engine
    from clover_desk.engine.decode.events import BlockStep, Finished, GenerationParams

    engine = Engine.load(model_dir)
    params = GenerationParams(mode=mode, enable_thinking=enable_thinking, max_new_tokens=max_new_tokens)
    events = list(engine.generate(messages=[{"role": "user", "content": "Hello there"}], params=params))
    done = events[-1]
    assert isinstance(done, Finished)
    # one slot per pass: the leftmost masked slot follows a committed token, every other one follows a mask
    assert all(sum(e.committed_now) == 1 for e in events if isinstance(e, BlockStep))
    return engine, done


@pytest.mark.parametrize("mode", ["diffusion", "ar"])
def test_writes_its_script_in_both_modes(chat_model, mode: str) -> None:  # noqa: ANN001
    engine, done = _run(chat_model.path, True, mode)
    assert (done.thinking, done.text, done.stop_reason) == ("Let me think", "Sure thing.", "eos")
    start = engine.prompt_ids(messages=[{"role": "user", "content": "x"}], enable_thinking=True)[-1]
    assert done.token_ids == chat_model.chains[start]
    assert engine.tokenizer.decode(done.token_ids, skip_special_tokens=False) == CHAT_THINKING
    _, plain = _run(chat_model.path, False, mode)
    assert (plain.thinking, plain.text) == ("", "Plain answer!")
    assert engine.tokenizer.decode(plain.token_ids, skip_special_tokens=False) == CHAT_PLAIN


def test_a_whole_tool_call_and_a_shared_tail(tools_model) -> None:  # noqa: ANN001
    _, done = _run(tools_model.path, False, "diffusion")
    assert done.text == f"<tool_call>{TOOL_JSON}</tool_call>"
    _, thought = _run(tools_model.path, True, "diffusion")
    assert (thought.thinking, thought.text) == ("Need the weather", f"<tool_call>{TOOL_JSON}</tool_call>")


def test_a_looping_script_never_ends(endless_model) -> None:  # noqa: ANN001
    _, done = _run(endless_model.path, False, "diffusion", max_new_tokens=40)
    assert done.stop_reason == "max_new_tokens" and done.tokens == 40
    assert done.text.startswith("tick tock tick tock tick tock")
    _, call = _run(endless_model.path, True, "ar", max_new_tokens=12)
    assert call.text.startswith("<tool_call>round<tool_call>round") and call.thinking == ""


def test_distinct_tokenization_spells_the_text_with_no_token_twice(chat_model) -> None:  # noqa: ANN001
    from clover_desk.engine.decode.tokenizer import CloverTokenizer

    tok = CloverTokenizer.from_dir(chat_model.path)
    text = "Paris, Paris"
    plain = tok.encode(text)
    assert len(set(plain)) < len(plain)  # the ordinary tokenization repeats tokens
    ids = distinct_tokenization(tok, text)
    assert tok.decode(ids) == text and len(set(ids)) == len(ids)
    avoided = distinct_tokenization(tok, " weather", avoid=set(tok.encode(" weather")))
    assert tok.decode(avoided) == " weather" and not set(avoided) & set(tok.encode(" weather"))
    with pytest.raises(ValueError, match="distinct"):
        distinct_tokenization(tok, "....................")


def test_conflicting_scripts_are_refused(chat_model, tmp_path: Path) -> None:  # noqa: ANN001
    from clover_desk.engine.model.config import load_config

    config = load_config(chat_model.path)
    with pytest.raises(ValueError, match="two successors"):
        scripted_state_dict(config, {10: [11, 12], 20: [11, 13]})
    with pytest.raises(ValueError, match="mask"):
        scripted_state_dict(config, {10: [config.mask_token_id, 12]})
    with pytest.raises(ValueError, match="distinct"):
        build_scripted_model(tmp_path / "m", no_thinking="a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.<|im_end|>")
