"""Damaged and hostile model folders and prompts: one line naming the file (or flag), the field or tensor and what is
allowed; the CLI exits 2 and the real worker process answers with an error record and keeps serving. Never noise,
a traceback or a big allocation.

Every model here is a tiny checkpoint written by engine.weights.tiny.make_tiny, then damaged on disk the way a bad
download, a bad conversion or a hostile upload would leave it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_tiny import copy_model, one_torch_thread, tiny_clover_dir  # noqa: F401
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from worker_proc import WorkerProc

from clover_desk.cli import main as cli
from clover_desk.engine.decode.limits import GENERATION_LIMITS, MAX_PROMPT_BYTES

CLOVER_DESK = str(Path(sys.executable).with_name("clover-desk"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PLANNED = ["--vram-gb", "4", "--ctx", "256"]  # the quantized-cache path: plan, convert, place


def _expect_error(capsys: pytest.CaptureFixture[str], args: list[str], *needles: str) -> str:
    """Run the CLI in process: exit status 2 and one error line holding every needle (no traceback)."""
    code = cli.main(args)
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("clover-desk generate: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _generate(folder: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", *extra]


def _config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def model(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:  # noqa: F811
    """A private copy of the tiny model whose json files the tests change (each test restores what it changed)."""
    folder = copy_model(tiny_clover_dir, tmp_path_factory.mktemp("hostile") / "m")
    yield folder


@pytest.fixture
def restore(model: Path) -> Iterator[None]:
    saved = {p: p.read_bytes() for p in model.iterdir() if p.is_file()}
    yield
    for path, data in saved.items():
        path.write_bytes(data)


# ---- generation_config.json: one schema, checked before anything is used -------------------------------------------

VOCAB_END = "outside the vocabulary (0 to {top})"
BAD_GENERATION: list[tuple[str, object, str]] = [
    ("temperature", -0.5, GENERATION_LIMITS["temperature"].allowed),
    ("temperature", 1e-300, GENERATION_LIMITS["temperature"].allowed),
    ("temperature", "0.7", GENERATION_LIMITS["temperature"].allowed),
    ("top_p", 0, GENERATION_LIMITS["top_p"].allowed),
    ("top_p", 1.5, GENERATION_LIMITS["top_p"].allowed),
    ("top_k", -1, GENERATION_LIMITS["top_k"].allowed),
    ("top_k", 40.5, GENERATION_LIMITS["top_k"].allowed),
    ("threshold", 2, GENERATION_LIMITS["threshold"].allowed),
    ("block_size", 0, GENERATION_LIMITS["block_size"].allowed),
    ("block_size", 10**6, GENERATION_LIMITS["block_size"].allowed),
    ("max_new_tokens", 0, GENERATION_LIMITS["max_new_tokens"].allowed),
    ("max_new_tokens", "lots", GENERATION_LIMITS["max_new_tokens"].allowed),
    ("max_new_tokens", 1e12, GENERATION_LIMITS["max_new_tokens"].allowed),
    ("repetition_penalty", 0, GENERATION_LIMITS["repetition_penalty"].allowed),
    ("presence_penalty", math.nan, GENERATION_LIMITS["presence_penalty"].allowed),
    ("presence_penalty", 1e300, GENERATION_LIMITS["presence_penalty"].allowed),
    ("dllm_length_penalty", math.inf, GENERATION_LIMITS["dllm_length_penalty"].allowed),
    ("dllm_length_penalty_start", -8192, GENERATION_LIMITS["dllm_length_penalty_start"].allowed),
    ("dllm_think_end_bias_window", 4096.5, GENERATION_LIMITS["dllm_think_end_bias_window"].allowed),
    ("do_sample", "yes", "true or false"),
    ("do_sample", 1, "true or false"),
    ("eos_token_id", [2, 10**6], VOCAB_END),
    ("eos_token_id", "<|im_end|>", "must be a token id or a list of token ids"),
    ("pad_token_id", 10**6, VOCAB_END),
    ("pad_token_id", -1, "must be a token id"),
    ("bos_token_id", True, "must be a token id"),
    ("mask_token_id", 99_999, VOCAB_END),
]


@pytest.mark.parametrize("field, value, allowed", BAD_GENERATION, ids=[f"{f}={v!r}" for f, v, _ in BAD_GENERATION])
def test_generation_config_values_are_checked_before_use(
    model: Path, restore: None, capsys: pytest.CaptureFixture[str], field: str, value: object, allowed: str
) -> None:
    path = model / "generation_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, field: value}))
    top = _config(model)["vocab_size"] - 1
    shown = str(value[-1]) if isinstance(value, list) else repr(value)[:12]  # an id list names its bad id
    _expect_error(capsys, _generate(model), f"{path}: field '{field}'", allowed.format(top=top), shown)


def test_the_shipped_generation_config_passes(model: Path, one_torch_thread: None) -> None:  # noqa: F811
    from clover_desk.engine.model.config import load_config, load_generation_defaults

    defaults = load_generation_defaults(model, load_config(model))
    assert defaults.presence_penalty == 0.9 and defaults.dllm_length_penalty == 10.0


# ---- files that are not UTF-8 ----------------------------------------------------------------------------------------


def test_json_and_template_files_that_are_not_utf8(model: Path, restore: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("config.json", "generation_config.json"):
        path = model / name
        good = path.read_bytes()
        offset = good.index(b'"') + 1
        path.write_bytes(good[:offset] + b"\xff" + good[offset:])  # one stray byte right after the first quote
        _expect_error(capsys, _generate(model), f"{path}: not UTF-8 text (byte 0xff at offset {offset})")
        path.write_bytes(good)
    jinja = model / "chat_template.jinja"
    text = jinja.read_bytes()
    jinja.write_bytes("{# café #}".encode("latin-1") + text)  # a template saved in Latin-1
    _expect_error(capsys, _generate(model), f"{jinja}: not UTF-8 text (byte 0xe9 at offset 6)")
    jinja.unlink()  # now the template comes from tokenizer_config.json
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_bytes(json.dumps(config).encode().replace(b"{", b"{\x80", 1))
    _expect_error(capsys, _generate(model), f"{config_path}: not UTF-8 text (byte 0x80 at offset 1)")
    config_path.write_text(json.dumps({**config, "chat_template": "{{ messages[0].content }}\ud800"}))
    _expect_error(capsys, _generate(model), str(config_path), "a lone surrogate U+D800 at character 25")


# ---- weights that are NaN or infinite ----------------------------------------------------------------------------


def _poison(folder: Path, suffix: str, poison: Any) -> tuple[Path, str]:
    """Overwrite part of the tensor whose name ends in ``suffix`` in its shard; returns (shard, full name)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith(suffix))
    shard = folder / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    poison(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard, name


def _all_nan(t: torch.Tensor) -> None:
    t.fill_(float("nan"))


def _one_inf_in_row_7(t: torch.Tensor) -> None:
    t[7, 3] = float("inf")


def _nan_in_expert_3(t: torch.Tensor) -> None:
    t[3, 1, 2] = float("nan")


NON_FINITE = [
    ("layers.1.mlp.shared_expert.down_proj.weight", _all_nan, ("NaN values", "row 0")),
    ("embed_tokens.weight", _one_inf_in_row_7, ("1 infinite value", "row 7")),
    ("layers.2.mlp.experts.gate_up_proj", _nan_in_expert_3, ("1 NaN value", "row 3")),
]


@pytest.fixture(scope="module")
def poisoned(
    tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
) -> dict[str, tuple[Path, Path, str]]:
    """One damaged copy of the tiny model per case: suffix -> (folder, shard, tensor name)."""
    out = {}
    for i, (suffix, poison, _) in enumerate(NON_FINITE):
        folder = copy_model(tiny_clover_dir, tmp_path_factory.mktemp("nan") / f"m{i}")
        out[suffix] = (folder, *_poison(folder, suffix, poison))
    return out


@pytest.mark.parametrize("path", ["direct", "planned"])
@pytest.mark.parametrize("suffix, poison, needles", NON_FINITE, ids=[s for s, _, _ in NON_FINITE])
def test_non_finite_weights_are_refused_naming_the_tensor(
    poisoned: dict[str, tuple[Path, Path, str]], capsys: pytest.CaptureFixture[str],
    one_torch_thread: None,  # noqa: F811
    suffix: str, poison: Any, needles: tuple[str, ...], path: str,
) -> None:
    folder, shard, name = poisoned[suffix]
    _expect_error(capsys, _generate(folder, *(PLANNED if path == "planned" else ())),
                  f"{shard}: tensor {name!r} holds", *needles, "would generate noise")
    assert not list(folder.glob(".clover-cache/*/manifest.json"))  # no cache of damaged weights was left behind


def test_the_worker_reports_non_finite_weights_and_keeps_serving(
    poisoned: dict[str, tuple[Path, Path, str]], tiny_clover_dir: Path,  # noqa: F811
) -> None:
    folder, shard, name = poisoned["layers.1.mlp.shared_expert.down_proj.weight"]
    w = WorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir=str(folder))
        refused = w.expect_event("error", op="load")
        assert refused["kind"] == "CheckpointError" and refused["fatal"] is False
        assert f"{shard}: tensor {name!r} holds" in refused["message"] and "\n" not in refused["message"]
        w.send(cmd="load", model_dir=str(tiny_clover_dir))
        w.expect_event("loaded")
        w.send(cmd="generate", id="ok", prompt_ids=[10, 11, 12], raw=True, params={"max_new_tokens": 2, "mode": "ar"})
        assert w.expect(lambda r: r.get("id") == "ok" and r["event"] in ("finished", "error"))["event"] == "finished"
    finally:
        w.close()


# ---- config.json sizes the checkpoint does not have ---------------------------------------------------------------


def _claim(folder: Path, **sizes: int) -> None:
    (folder / "config.json").write_text(json.dumps({**_config(folder), **sizes}))


SHAPE_ERROR = re.compile(
    r"^clover-desk generate: error: (?P<file>\S+): tensor '(?P<name>[^']+)' has shape (?P<real>\[[\d, ]*\]), "
    r"(?:the model expects|but config.json's sizes make it) (?P<claimed>\[[\d, ]*\])"
)


def _check_shape_error(line: str, folder: Path, claimed_numbers: set[int]) -> None:
    """The line names a real tensor, its real shape (as the file's header has it) and the shape config.json claims,
    which holds one of the claimed sizes."""
    match = SHAPE_ERROR.match(line)
    assert match, line
    with safe_open(match["file"], framework="pt") as f:
        assert json.loads(match["real"]) == list(f.get_slice(match["name"]).get_shape())
    assert Path(match["file"]).parent == folder
    claimed = json.loads(match["claimed"])
    assert claimed != json.loads(match["real"]) and claimed_numbers & set(claimed), line


@pytest.mark.parametrize("path", ["direct", "planned"])
@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_experts", "moe_intermediate_size"])
def test_config_sizes_are_checked_against_the_tensors(
    model: Path, restore: None, capsys: pytest.CaptureFixture[str], one_torch_thread: None,  # noqa: F811
    field: str, path: str,
) -> None:
    value = _config(model)[field]
    _claim(model, **{field: 2 * value})
    line = _expect_error(capsys, _generate(model, *(PLANNED if path == "planned" else ())), "has shape")
    _check_shape_error(line, model, {2 * value, 4 * value})  # gate_up_proj holds 2 * moe_intermediate_size rows
    assert not list(model.glob(".clover-cache/*/manifest.json"))


@pytest.mark.parametrize("path", ["direct", "planned"])
def test_absurd_config_sizes_are_refused_before_any_allocation(model: Path, restore: None, path: str) -> None:
    """hidden 65,536 and 4,096 experts of 262,144 (inside config.json's bounds): sized as claimed, the experts alone
    would be petabytes. A real process, so its peak memory can be read (os.wait4)."""
    _claim(model, hidden_size=65_536, num_experts=4096, moe_intermediate_size=262_144,
           shared_expert_intermediate_size=262_144)
    proc = subprocess.Popen([CLOVER_DESK, *_generate(model, *(PLANNED if path == "planned" else ()))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    timer = threading.Timer(120, proc.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.stderr is not None and proc.stdout is not None
    err = proc.stderr.read().decode()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and proc.stdout.read() == b"", err
    _check_shape_error(errors[0], model, {65_536, 4096, 262_144, 2 * 262_144})
    assert usage.ru_maxrss < 2 * 1024 * 1024, f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB"  # KiB: torch alone


# ---- prompts that are not UTF-8 ------------------------------------------------------------------------------------


def test_prompt_file_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
    tiny_clover_dir: Path, one_torch_thread: None,  # noqa: F811
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"hello \xff world")
    # before the model is read: the model folder does not even exist
    _expect_error(capsys, ["generate", "--model", str(tmp_path / "none"), "--prompt-file", str(prompt)],
                  f"--prompt-file {prompt}: not UTF-8 text (byte 0xff at offset 6)")
    (tmp_path / "big.txt").write_bytes(b"")
    os.truncate(tmp_path / "big.txt", MAX_PROMPT_BYTES + 1)  # sparse: nothing is written
    _expect_error(capsys, ["generate", "--model", str(tmp_path / "none"), "--prompt-file", str(tmp_path / "big.txt")],
                  f"longer than {MAX_PROMPT_BYTES:,} bytes")
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt-file", str(tmp_path / "missing")],
                  f"--prompt-file {tmp_path / 'missing'}: cannot read (No such file or directory)")
    prompt.write_text("Grüße aus Zürich", encoding="utf-8")
    assert cli.main(["generate", "--model", str(tiny_clover_dir), "--prompt-file", str(prompt), "--max-new-tokens", "2",
                     "--mode", "ar", "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert events[-1]["event"] == "finished"


def test_stdin_and_argv_that_are_not_utf8(tiny_clover_dir: Path) -> None:  # noqa: F811
    """Real processes: stdin bytes, and argv bytes Python hands over as lone surrogates."""
    stdin = subprocess.run([CLOVER_DESK, "generate", "--model", str(tiny_clover_dir), "--prompt-file", "-"],
                           input=b"abc\xfe\xfe", capture_output=True, env=ENV, timeout=120)
    assert stdin.returncode == 2 and stdin.stdout == b""
    assert stdin.stderr.decode().strip() == (
        "clover-desk generate: error: --prompt-file - (stdin): not UTF-8 text (byte 0xfe at offset 3)"
    )
    argv = subprocess.run([CLOVER_DESK.encode(), b"generate", b"--model", bytes(tiny_clover_dir), b"--prompt",
                           b"caf\xe9 au lait"], capture_output=True, env=ENV, timeout=120)
    assert argv.returncode == 2 and argv.stdout == b""
    assert argv.stderr.decode().strip() == (
        "clover-desk generate: error: --prompt: not UTF-8 text (byte 0xe9 at character 3)"
    )


def test_the_worker_refuses_text_that_is_not_utf8_and_keeps_serving(tiny_clover_dir: Path) -> None:  # noqa: F811
    """JSON can carry lone surrogates ("\\udcff"): through the real worker and the real engine they are one
    PromptError naming where they are, never an internal error."""
    w = WorkerProc()
    try:
        w.expect_event("ready")
        w.send(cmd="load", model_dir=str(tiny_clover_dir))
        w.expect_event("loaded")
        bad = [{"role": "system", "content": "ok"}, {"role": "user", "content": "caf\udce9"}]
        w.send(cmd="generate", id="m", messages=bad, params={"max_new_tokens": 2})
        answer = w.expect(lambda r: r.get("id") == "m")
        assert (answer["event"], answer["kind"], answer["fatal"]) == ("error", "PromptError", False), answer
        assert answer["message"] == "messages[1]['content']: not UTF-8 text (byte 0xe9 at character 3)"
        w.send(cmd="generate", id="p", prompt="hi \ud800", raw=True, params={"max_new_tokens": 2})
        answer = w.expect(lambda r: r.get("id") == "p")
        assert answer["kind"] == "PromptError", answer
        assert answer["message"] == "prompt: not UTF-8 text (a lone surrogate U+D800 at character 3)"
        w.send(cmd="generate", id="ok", messages=[{"role": "user", "content": "café"}],
               params={"max_new_tokens": 2, "mode": "ar"})
        assert w.expect(lambda r: r.get("id") == "ok" and r["event"] in ("finished", "error"))["event"] == "finished"
    finally:
        w.close()
