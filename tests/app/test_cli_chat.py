"""``clover-desk chat``: a conversation in the terminal, run as a real subprocess on scripted tiny models
(:mod:`scripted_model`) with its input piped: turns, commands, the prompt cache's figures on stderr, a message the
context cannot hold, and Ctrl-C (SIGINT) stopping an answer without ending the chat."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_fixtures import chat_model, chat_server, endless_model  # noqa: F401 - fixtures

from clover_desk.engine.decode.tokenizer import CloverTokenizer

CLOVER_DESK = str(Path(sys.executable).with_name("clover-desk"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SYSTEM = "You are a patient guide to lighthouses, their keepers and the islands they lived on. " * 3


def chat(model: Path, text: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLOVER_DESK, "chat", "--model", str(model), *flags], input=text, capture_output=True,
                          text=True, env=ENV, timeout=300)


def test_turns_commands_and_what_the_prompt_cache_read(chat_model) -> None:  # noqa: ANN001, F811
    from clover_desk.engine.api import Engine

    script = "Hello there\nAnd then?\n/think off\nOne more\\\nline\n/bogus\n/mode fast\n/reset\n/mode ar\nHi\n"
    proc = chat(chat_model.path, script, "--system", SYSTEM)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [  # (the piped output marks the channels; a terminal dims the thinking)
        "[thinking] Let me think", "[answer] Sure thing.", "[thinking] Let me think", "[answer] Sure thing.",
        "Plain answer!", "Plain answer!"]
    figures = [line for line in proc.stderr.splitlines() if line.startswith("[eos]")]
    assert len(figures) == 4
    prompts = [int(re.search(r"prompt (\d+) tokens", line)[1]) for line in figures]
    cached = [int(m[1]) if (m := re.search(r"\((\d+) cached\)", line)) else 0 for line in figures]
    engine = Engine.load(chat_model.path)
    first = engine.prompt_ids(messages=[{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": "Hello there"}])
    assert prompts[0] == len(first) and cached[0] == 0
    turn = len(first) - 1 - first[::-1].index(first[0])  # the generation prompt's <|im_start|>
    assert cached[1] == turn // 32 * 32 > 0 and prompts[1] > prompts[0]  # the second turn read only what was new
    assert cached[2] > cached[1] and prompts[2] > prompts[1]  # the two-line message, thinking off
    assert cached[3] == 0 and "(a new chat)" in proc.stderr  # /reset, then AR mode
    assert "clover-desk chat: unknown command /bogus (/help lists them)" in proc.stderr
    assert "clover-desk chat: /mode takes one of diffusion, ar, spec (got 'fast')" in proc.stderr


def test_a_message_the_context_cannot_hold_is_one_line_and_the_chat_goes_on(chat_model) -> None:  # noqa: ANN001, F811
    long = "lighthouse " * 1500
    proc = chat(chat_model.path, f"{long}\nHello there\n", "--no-think")
    assert proc.returncode == 0, proc.stderr
    refused = [line for line in proc.stderr.splitlines() if line.startswith("clover-desk chat: ")]
    assert len(refused) == 1 and "the context holds" in refused[0], proc.stderr
    assert proc.stdout.strip() == "Plain answer!"


def test_an_answer_cut_while_thinking_says_so_and_leaves_its_question_out(chat_model) -> None:  # noqa: ANN001, F811
    proc = chat(chat_model.path, "Hello there\nAnd then?\n", "--max-new-tokens", "2")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("(no answer")]
    assert notes == ["(no answer: it was still thinking at the token limit (raise --max-new-tokens, or /think off); "
                     "this question is left out of the chat)"] * 2
    prompts = [int(m[1]) for m in re.finditer(r"prompt (\d+) tokens", proc.stderr)]
    tok = CloverTokenizer.from_dir(chat_model.path)
    assert prompts == [len(tok.encode_chat([{"role": "user", "content": q}])) for q in ("Hello there", "And then?")]


def test_bad_flags_are_one_line_and_exit_2(chat_model, tmp_path: Path) -> None:  # noqa: ANN001, F811
    proc = chat(chat_model.path, "", "--ctx", "4096")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("clover-desk chat: error: --ctx sizes the KV")
    proc = chat(tmp_path / "missing", "")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "missing" in proc.stderr
    proc = chat(chat_model.path, "", "--cache-ram", "lots")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--cache-ram" in proc.stderr


def test_cache_ram_zero_keeps_only_the_last_chats_state(chat_model) -> None:  # noqa: ANN001, F811
    """/reset, another question, then the first chat's question and answer again: with the default --cache-ram
    the first chat's state waited in RAM; with 0 only the last chat's is kept."""
    first = "Tell me about the lighthouse keepers of the northern islands, please. " * 3
    script = f"{first}\n/reset\nSomething else entirely: how do the tides work, and why twice a day?\n/reset\n{first}\n"
    cached = {}
    for flags in ((), ("--cache-ram", "0")):
        proc = chat(chat_model.path, script, "--no-think", *flags)
        assert proc.returncode == 0, proc.stderr
        figures = [line for line in proc.stderr.splitlines() if line.startswith("[eos]")]
        cached[flags] = [int(m[1]) if (m := re.search(r"\((\d+) cached\)", line)) else 0 for line in figures]
    assert cached[()][2] > 0 and cached[("--cache-ram", "0")][2] == 0, cached


@pytest.mark.usefixtures("sigint_deliverable")
def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(endless_model) -> None:  # noqa: ANN001, F811
    """The endless model writes "tick tock ..." until stopped: SIGINT stops that answer (what it wrote stays in the
    chat), at the prompt it drops the line being typed, and the chat ends only with /bye."""
    proc = subprocess.Popen([CLOVER_DESK, "chat", "--model", str(endless_model.path), "--no-think", "--mode", "ar"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("Go\n")
        proc.stdin.flush()
        seen = ""
        while seen.count("tick") < 3:  # it is writing
            seen += proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # at the prompt now: the line being typed goes, the chat stays
        time.sleep(0.5)
        out, err = proc.communicate("/bye\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "(stopped)" in err and "Traceback" not in err
    assert "tick tock" in seen + out


def test_on_a_terminal_it_prompts_dims_the_thinking_and_ends_with_ctrl_d(chat_model) -> None:  # noqa: ANN001, F811
    """Under a pseudo-terminal (what a user's terminal is): the ">>> " prompt with line editing, the thinking
    dimmed, the answer, and Ctrl-D at an empty prompt ending the chat."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([CLOVER_DESK, "chat", "--model", str(chat_model.path)], stdin=slave, stdout=slave,
                            stderr=slave, env={**ENV, "TERM": "xterm"}, close_fds=True)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, times: int = 1, timeout: float = 120.0) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while seen.count(marker) < times:
            assert time.monotonic() < end, seen[-300:]
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break

    tokenizer = CloverTokenizer.from_dir(chat_model.path)

    def kept(chat: list) -> int:  # whole blocks before the generation prompt: what the prompt cache keeps
        ids = tokenizer.encode_chat(chat)
        return (len(ids) - 1 - ids[::-1].index(ids[0])) // 32 * 32

    answer = {"role": "assistant", "content": "Sure thing."}
    question = next(q for q in ("Hello there " * n for n in range(4, 40))  # the answer reaches another block
                    if kept([{"role": "user", "content": q}, answer]) > kept([{"role": "user", "content": q}]))
    try:
        read_until(b">>> ")
        os.write(master, question.encode() + b"\r")
        read_until(b"Sure thing.")
        read_until(b">>> ", times=2)  # the next prompt
        time.sleep(2)  # typing: meanwhile the engine reads the chat ahead, the answer included
        os.write(master, b"And then?\r")
        read_until(b"Sure thing.", times=2)
        read_until(b">>> ", times=3)
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    assert b"\x1b[2mLet me think" in seen and b"[thinking]" not in seen  # dimmed, not labelled
    assert b"/help for commands" in seen
    cached = [int(n) for n in re.findall(rb"\((\d+) cached\)", seen)]
    assert cached == [kept([{"role": "user", "content": question}, answer])]  # the second turn: all but its message


def test_chat_with_a_server(chat_server) -> None:  # noqa: ANN001, F811
    """``--remote URL``: the same conversation, answered by an OpenAI-compatible server (here ``clover-desk
    serve``'s, in this process); its figures come from the server and what it does not report is unavailable."""
    proc = subprocess.run([CLOVER_DESK, "chat", "--remote", chat_server.url], input="Hello there\n/think off\nMore\n",
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[thinking] Let me think", "[answer] Sure thing.", "Plain answer!"]
    figures = [line for line in proc.stderr.splitlines() if line.startswith("[stop] remote ")]
    assert len(figures) == 2 and "mode diffusion" in figures[0] and "denoising steps unavailable" in figures[1]
    proc = subprocess.run([CLOVER_DESK, "chat", "--remote", chat_server.url, "--vram-gb", "8"], input="",
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "clover-desk chat: error: --vram-gb does not apply with --remote (the server holds the model)")
    proc = subprocess.run([CLOVER_DESK, "chat", "--remote", chat_server.url, "--cache-ram", "0"], input="",
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "clover-desk chat: error: --cache-ram does not apply with --remote (the server holds the model)")


def test_a_chat_past_the_context_leaves_its_oldest_turns_out_and_goes_on(chat_model) -> None:  # noqa: ANN001, F811
    """Turns of some 900 tokens each in a 4,096-token context: once the chat no longer fits, the oldest turns are
    left out (a line says so, the chat goes on), enough of them for later sends to start at the same message, so
    the prompt cache still reads only what is new."""
    tok = CloverTokenizer.from_dir(chat_model.path)
    words = ["lighthouse", "keeper", "island", "storm", "lamp", "winter", "harbour", "tide"]
    texts = [" ".join(f"{words[(i + k) % 8]}{k % 10}" for k in range(200)) for i in range(7)]
    size = len(tok.encode_chat([{"role": "user", "content": texts[0]}]))
    assert 600 < size < 1200, size
    proc = chat(chat_model.path, "".join(t + "\n" for t in texts), "--no-think")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["Plain answer!"] * 7  # every turn answered, none refused
    assert "clover-desk chat:" not in proc.stderr
    figures = [line for line in proc.stderr.splitlines() if line.startswith("[eos]")]
    prompts = [int(re.search(r"prompt (\d+) tokens", line)[1]) for line in figures]
    cached = [int(m[1]) if (m := re.search(r"\((\d+) cached\)", line)) else 0 for line in figures]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("(the context holds 4,096 tokens")]
    assert notes and len(notes) < 4 and all(p <= 4096 - 1024 for p in prompts), (notes, prompts)
    shifted = [i for i in range(1, 7) if prompts[i] < prompts[i - 1]]  # the sends that left more out
    assert shifted and len(shifted) == len(notes)
    steady = [i for i in range(1, 7) if i not in shifted]  # the others went on from the last send's start
    assert steady and all(cached[i] > prompts[i - 1] // 2 for i in steady), (prompts, cached)


def test_a_line_that_is_not_utf8_is_one_line_and_the_chat_goes_on(chat_model) -> None:  # noqa: ANN001, F811
    proc = subprocess.run([CLOVER_DESK, "chat", "--model", str(chat_model.path), "--no-think"],
                          input=b"Hi \xff there\nHello there\n", capture_output=True, env=ENV, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("clover-desk chat:")] == [
        "clover-desk chat: messages[0]['content']: not UTF-8 text (byte 0xff at character 3)"]
    assert proc.stdout.decode().splitlines() == ["Plain answer!"]
