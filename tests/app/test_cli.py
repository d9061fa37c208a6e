"""The ``generate`` and ``make-tiny`` commands: real subprocesses for the end-to-end runs, ``cli.main`` in-process
for the error cases (exit code 2, one message on stderr, never a traceback)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_tiny import copy_model, one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.cli import main as cli

CLOVER_DESK = str(Path(sys.executable).with_name("clover-desk"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # 2 shared cores: no spinning thread pools


def clover_desk(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLOVER_DESK, *args], capture_output=True, text=True, env=ENV, timeout=300)


def json_events(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


# ---- end to end (subprocess) ---------------------------------------------------------------------------------------


def test_generate_json_diffusion(tiny_clover_dir: Path) -> None:
    proc = clover_desk("generate", "--model", str(tiny_clover_dir), "--prompt", "Tell me about the harbour town.",
                       "--max-new-tokens", "12", "--block-size", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    events = json_events(proc.stdout)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "prompt" and kinds[-1] == "finished" and kinds.count("finished") == 1
    assert "block_step" in kinds and "block_committed" in kinds
    done = events[-1]
    for key in ("token_ids", "text", "passes", "tokens_per_pass", "tokens_per_s", "stop_reason"):
        assert key in done
    assert 1 <= len(done["token_ids"]) <= 12 and done["passes"] >= 2
    assert done["tokens_per_pass"] == pytest.approx(len(done["token_ids"]) / done["passes"])
    answer = "".join(e["text"] for e in events if e["event"] == "delta" and e["channel"] == "answer")
    thinking = "".join(e["text"] for e in events if e["event"] == "delta" and e["channel"] == "thinking")
    assert answer == done["text"] and thinking == done["thinking"]
    committed = [t for e in events if e["event"] == "block_committed" for t in e["token_ids"]]
    assert committed == done["token_ids"]


def test_generate_json_ar_from_prompt_ids(tiny_clover_dir: Path) -> None:
    proc = clover_desk("generate", "--model", str(tiny_clover_dir), "--prompt-ids", "10,11,12,13", "--mode", "ar",
                       "--max-new-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    events = json_events(proc.stdout)
    assert events[0] == {"event": "prompt", "prompt_tokens": 4, "block_size": 1, "first_block": 4, "tail": 0,
                         "cached_tokens": 0}
    done = events[-1]
    assert done["event"] == "finished" and done["passes"] == len(done["token_ids"]) <= 5
    assert not any(e["event"] == "block_step" for e in events)


def test_missing_model_dir_exits_2_without_traceback(tmp_path: Path) -> None:
    proc = clover_desk("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "nowhere: model folder not found" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_make_tiny_command(tmp_path: Path) -> None:
    proc = clover_desk("make-tiny", str(tmp_path / "q"), "--model-type", "qwen3_5_moe", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe"
    assert (tmp_path / "q" / "model.safetensors.index.json").is_file()
    assert "wrote a tiny qwen3_5_moe model" in proc.stdout


# ---- in-process: plain output and every error path -----------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plain_output_streams_the_text(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path,
                                       one_torch_thread: None) -> None:
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_clover_dir), "--prompt", "Hi", "--no-think",
                             "--max-new-tokens", "6", "--block-size", "8")
    assert code == 0
    assert "tokens/pass" in err and "tokens/s" in err  # the summary goes to stderr
    # the same request in --json mode gives the same answer text (greedy is deterministic)
    code, js, _ = run_cli(capsys, "generate", "--model", str(tiny_clover_dir), "--prompt", "Hi", "--no-think",
                          "--max-new-tokens", "6", "--block-size", "8", "--json")
    done = json_events(js)[-1]
    assert code == 0
    assert done["text"].strip() in out
    assert ("[thinking]" in out) == (done["thinking"] != "")  # thinking is marked off from the answer


def _expect_error(capsys: pytest.CaptureFixture[str], args: list[str], *needles: str) -> str:
    code, out, err = run_cli(capsys, *args)
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    for needle in needles:
        assert needle in err
    return err


def test_bad_config_field(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["num_experts"] = "many"
    (folder / "config.json").write_text(json.dumps(config))
    _expect_error(capsys, ["generate", "--model", str(folder), "--prompt", "hi"], "config.json", "num_experts", "many")


def test_truncated_safetensors(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path, tmp_path: Path,
                               one_torch_thread: None) -> None:
    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _expect_error(capsys, ["generate", "--model", str(folder), "--prompt", "hi"], shard.name)


def test_empty_prompt(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path, one_torch_thread: None) -> None:
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt", ""], "empty prompt")
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt-ids", ","], "empty prompt")
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt-ids", "1,x"], "--prompt-ids")


def test_prompt_longer_than_the_context(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path, tmp_path: Path,
                                        one_torch_thread: None) -> None:
    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    ids = ",".join(str(10 + i % 50) for i in range(70))
    _expect_error(capsys, ["generate", "--model", str(folder), "--prompt-ids", ids], "70 tokens", "context holds 64")
    _expect_error(capsys, ["generate", "--model", str(folder), "--prompt-ids", ids, "--mode", "ar"], "context holds 64")


def test_ctx_without_a_plan_is_refused_not_ignored(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path,
                                                   one_torch_thread: None) -> None:
    """``generate --ctx`` sizes the plan's KV reservation; alone it used to be dropped without a word (a 16-token
    prompt then ran past a --ctx of 4)."""
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt", "hi", "--ctx", "4"],
                  "--ctx sizes the KV cache a --vram-gb plan reserves: add --vram-gb G")


def test_cuda_device_without_cuda_is_a_clear_error(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path) -> None:
    if sys.modules.get("torch") is not None and __import__("torch").cuda.is_available():
        pytest.skip("CUDA is present here")
    _expect_error(capsys, ["generate", "--model", str(tiny_clover_dir), "--prompt", "hi", "--device", "cuda"],
                  "CUDA is not available")


@pytest.mark.usefixtures("sigint_deliverable")
def test_ctrl_c_is_one_line_and_status_130_not_a_traceback() -> None:
    """Ctrl+C (SIGINT) during a long command: one line naming it, exit status 130 (the shell's for SIGINT)."""
    import signal

    proc = subprocess.Popen([CLOVER_DESK, "bench", "speed", "--shape", "mid", "--repeats", "50"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**ENV, "PYTHONUNBUFFERED": "1"})
    try:
        first = proc.stdout.readline()  # printed before the model is built: the command is under way
        assert first.startswith("bench speed: shape mid"), first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "clover-desk bench speed: interrupted", err


# ---- bench speed ---------------------------------------------------------------------------------------------------


def test_bench_speed_prints_every_figure(capsys: pytest.CaptureFixture[str], one_torch_thread: None) -> None:
    code, out, err = run_cli(capsys, "bench", "speed", "--shape", "tiny", "--prompt-tokens", "40", "--repeats", "1",
                             "--decode-tokens", "4", "--diffusion-tokens", "8")
    assert code == 0, err
    for label in ("prefill, block mode (40 tokens)", "prefill, causal", "AR decode (greedy, 4 tokens)",
                  "diffusion pass, one 32-slot block", "diffusion run (8 tokens"):
        assert label in out
    figures = [float(w) for line in out.splitlines() for w in line.split() if w.replace(".", "", 1).isdigit()]
    assert figures and all(math.isfinite(f) for f in figures)


def test_bench_speed_compare_transformers(capsys: pytest.CaptureFixture[str], one_torch_thread: None) -> None:
    pytest.importorskip("transformers")
    code, out, err = run_cli(capsys, "bench", "speed", "--shape", "tiny", "--prompt-tokens", "40", "--repeats", "1",
                             "--decode-tokens", "8", "--diffusion-tokens", "4", "--compare-transformers")
    assert code == 0, err
    assert "transformers" in out and "greedy tokens identical: 8/8" in out


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_generate_and_bench_on_cuda(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path) -> None:
    for mode in ("diffusion", "ar"):
        code, out, err = run_cli(capsys, "generate", "--model", str(tiny_clover_dir), "--prompt", "hi", "--device", "cuda",
                                 "--dtype", "bfloat16", "--mode", mode, "--max-new-tokens", "40", "--json")
        assert code == 0, err
        assert json_events(out)[-1]["tokens"] >= 1
    code, out, err = run_cli(capsys, "bench", "speed", "--shape", "tiny", "--device", "cuda", "--repeats", "2",
                             "--decode-tokens", "8", "--diffusion-tokens", "8")
    assert code == 0, err
    assert "device cuda" in out and "passes/s" in out


def test_quantized_loads_the_folder_s_quantized_cache(capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path,
                                                      tmp_path: Path, one_torch_thread: None) -> None:
    """``--quantized``: a folder's own quantized cache without a plan (what fits a 35B folder in a CPU's RAM), built
    next to the model on first use; without the flag the float weights, and no cache."""
    from clover_desk.engine.weights.formats import policy_for
    from clover_desk.engine.weights.quant_cache_files import cache_dir_for

    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    cache = cache_dir_for(folder, policy_for("cpu"))
    args = ["generate", "--model", str(folder), "--prompt", "Hi", "--no-think", "--max-new-tokens", "4",
            "--block-size", "8", "--json"]
    code, plain, err = run_cli(capsys, *args)
    assert code == 0, err
    assert not cache.exists()
    code, quant, err = run_cli(capsys, *args, "--quantized")
    assert code == 0, err
    assert (cache / "manifest.json").is_file()
    assert json_events(quant)[-1]["event"] == "finished"


def test_float_weights_larger_than_the_free_ram_are_one_line_naming_quantized(
        capsys: pytest.CaptureFixture[str], tiny_clover_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        one_torch_thread: None) -> None:
    """A folder whose float weights are more than the RAM free (the 35B folder: 139 GB in float32) is refused before
    a byte is read, with both sizes and --quantized; --quantized then loads it. The machine's RAM, as probed, is the
    one thing replaced here: no test machine has too little for a tiny model."""
    from clover_desk.engine.placement import hardware
    from clover_desk.engine.placement.manifest import manifest_for_model_dir

    folder = copy_model(tiny_clover_dir, tmp_path / "m")
    elements = sum(math.prod(e.shape) for e in manifest_for_model_dir(folder, as_stored=True).entries)
    free = elements * 3  # between the weights in bfloat16 (2 bytes each) and in float32 (4)
    monkeypatch.setattr(hardware, "probe_hardware", lambda *_a: hardware.Hardware(ram_available_bytes=free))
    base = ["generate", "--model", str(folder), "--prompt", "Hi", "--no-think", "--max-new-tokens", "2",
            "--block-size", "8"]
    err = _expect_error(capsys, base, "m: its weights unquantized in float32 need", "of RAM is free",
                        "add --quantized")
    assert f"{elements * 4 / 1024**3:.1f} GiB" in err
    assert not (folder / ".clover-cache").exists()  # nothing was read or built
    for fits in (["--dtype", "bfloat16"], ["--quantized"]):  # half the bytes fit; the quantized cache does too
        code, _out, err = run_cli(capsys, *base, *fits)
        assert code == 0, err


def test_quantized_with_a_gguf_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    _expect_error(capsys, ["generate", "--model", str(model), "--prompt", "hi", "--quantized"],
                  "--quantized applies to a model folder", "model.gguf")
