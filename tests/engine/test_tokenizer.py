"""Tokenizer wrapper, chat template, streaming detokenizer and tiny tokenizer training (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_desk.engine.decode.tokenizer import (
    IM_END,
    MASK,
    THINK_END,
    THINK_START,
    TINY_ADDED_TOKENS,
    TINY_SPECIAL_TOKENS,
    CloverTokenizer,
    StreamDecoder,
    train_tiny_tokenizer,
)
from clover_desk.engine.errors import ConfigError, PromptError

MULTIBYTE = "Zürich — 你好，世界 🚀🌍 café ∑∞"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(out, vocab_size=600)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> CloverTokenizer:
    return CloverTokenizer.from_dir(tok_dir)


# ---- training and special tokens ---------------------------------------------------------------------------------


def test_training_writes_the_three_files_and_the_special_tokens(tok_dir: Path, tok: CloverTokenizer) -> None:
    assert {p.name for p in tok_dir.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == IM_END and config["mask_token"] == MASK
    assert config["chat_template"] == (tok_dir / "chat_template.jinja").read_text()
    for name in TINY_SPECIAL_TOKENS + TINY_ADDED_TOKENS:
        assert tok.token_to_id(name) is not None, name
    assert tok.eos_token_ids == (tok.token_to_id(IM_END), tok.token_to_id("<|endoftext|>"))
    assert tok.think_start_id == tok.token_to_id(THINK_START) and tok.think_end_id == tok.token_to_id(THINK_END)
    assert tok.mask_token_id == tok.token_to_id(MASK)
    assert 300 <= tok.vocab_size <= 600


def test_training_is_deterministic(tmp_path: Path, tok_dir: Path) -> None:
    train_tiny_tokenizer(tmp_path, vocab_size=600)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_vocab_too_small_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="too small"):
        train_tiny_tokenizer(tmp_path, vocab_size=100)


def test_special_tokens_are_single_ids_and_skipped_in_text(tok: CloverTokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think>")
    assert tok.token_to_id("<|im_start|>") == ids[0] and tok.token_to_id(IM_END) in ids
    assert tok.decode(ids) == "user\nhix"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|><think>x</think>"


def test_tool_call_tokens_are_single_ids_that_stay_in_text(tok: CloverTokenizer) -> None:
    ids = tok.encode('<tool_call>\n{"name": "f"}\n</tool_call>')
    assert ids[0] == tok.token_to_id("<tool_call>") and ids[-1] == tok.token_to_id("</tool_call>")
    assert tok.decode(ids) == '<tool_call>\n{"name": "f"}\n</tool_call>'


def test_byte_level_round_trip_of_multibyte_text(tok: CloverTokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    assert len(ids) > len(MULTIBYTE) // 2  # rare characters are split into several byte tokens


def test_missing_or_bad_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json: file not found"):
        CloverTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        CloverTokenizer.from_dir(tmp_path)


# ---- streaming detokenizer -----------------------------------------------------------------------------------------


def test_stream_never_emits_half_a_character(tok: CloverTokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    stream = tok.stream()
    pieces = [stream.push([i]) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens held back bytes of an unfinished character
    assert stream.text == MULTIBYTE


def test_stream_in_uneven_chunks_matches_a_full_decode(tok: CloverTokenizer) -> None:
    text = "def f(x):\n    return x * 2  # 2× faster → ✅\n<p>Grüße</p>"
    ids = tok.encode(text)
    stream = tok.stream()
    out, i, step = [], 0, 1
    while i < len(ids):
        out.append(stream.push(ids[i : i + step]))
        i, step = i + step, step % 4 + 1
    out.append(stream.flush())
    assert "".join(out) == text


def test_stream_keeps_spaces_between_tokens(tok: CloverTokenizer) -> None:
    ids = tok.encode("the harbour town woke slowly")
    stream = tok.stream()
    assert "".join(stream.push([i]) for i in ids) == "the harbour town woke slowly"


def test_stream_flush_shows_a_truly_broken_tail() -> None:
    # a fake decoder over raw bytes: id = byte value
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    stream = StreamDecoder(decode)
    euro = list("€".encode())
    assert stream.push([ord("a")]) == "a"
    assert stream.push(euro[:2]) == ""
    assert stream.push(euro[2:]) == "€"
    assert stream.push(euro[:1]) == ""
    assert stream.flush() == "\ufffd"


# ---- chat template -------------------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_template_renders_chatml_turns_with_thinking_open(tok: CloverTokenizer) -> None:
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_template_prefills_an_empty_thought_when_thinking_is_off(tok: CloverTokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_without_generation_prompt(tok: CloverTokenizer) -> None:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], add_generation_prompt=False
    )
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"


def test_template_lists_tools_and_renders_calls_and_responses(tok: CloverTokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Is it warmer in Lisbon or in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two cities: two calls.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "tool", "content": '{"temp_c": 4}'},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    # the reasoning of the turn after the last user message is kept (an agent's tool loop)
    assert "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n<tool_call>\n" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>\n<tool_call>' in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    # consecutive tool results share one user turn
    assert text.count("<|im_start|>user") == 2
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response>\n<tool_response>\n" in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_template_drops_reasoning_of_earlier_turns(tok: CloverTokenizer) -> None:
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "easy"},
        {"role": "user", "content": "2+2?"},
    ]
    text = tok.apply_chat_template(messages)
    assert "easy" not in text and "<|im_start|>assistant\n2<|im_end|>" in text


def test_template_accepts_content_parts(tok: CloverTokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}])
    assert "<|im_start|>user\nHello<|im_end|>" in text


def test_template_errors_are_prompt_errors(tok: CloverTokenizer) -> None:
    with pytest.raises(PromptError, match="unknown message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(PromptError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(PromptError, match="'role'"):
        tok.apply_chat_template([{"content": "x"}])


def test_template_is_sandboxed(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    evil = CloverTokenizer.from_dir(tmp_path)
    with pytest.raises(PromptError, match="chat template failed"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_from_tokenizer_config_when_no_jinja_file(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert CloverTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ConfigError, match="chat_template"):
        CloverTokenizer.from_dir(tmp_path)


def test_no_template_is_a_clear_error(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="no chat template"):
        CloverTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_encode_chat_is_the_rendered_text_encoded(tok: CloverTokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    ids = tok.encode_chat(messages, tools=TOOLS)
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, tools=TOOLS)


def test_templates_written_for_hugging_face_render(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') | length }}"
    )
    text = CloverTokenizer.from_dir(tmp_path).apply_chat_template(
        [{"role": "user", "content": "Grüße"}, {"role": "user", "content": "second"}]
    )
    assert text == '"Grüße"|4'
