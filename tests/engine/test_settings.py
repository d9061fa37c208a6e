"""One GPU-path settings object (``engine.settings.GpuPaths``): parsed from the environment in that module only, once
where a process starts, and passed down; each setting reaches the code it switches."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures_tiny import one_torch_thread  # noqa: F401

from clover_desk.cli import main as cli
from clover_desk.engine.api import Engine
from clover_desk.engine.kernels import cpu_quant, gdn_kernels, switches, triton_linear, triton_moe
from clover_desk.engine.settings import EXCLUSIVE, OPT_IN, SWITCHES, GpuPaths, SettingsError, opt_in_env
from clover_desk.engine.weights.gguf.model import load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]

# The environment variables engine code may read, each where and why: none is a GPU-path switch (those are read in
# engine/settings.py only). CC / CXX / CLOVER_DESK_KERNEL_CACHE / XDG_CACHE_HOME: compilers and cache folders;
# TRITON_INTERPRET: Triton's own switch, read as Triton reads it; CUDA_VISIBLE_DEVICES / BNB_CUDA_VERSION: facts the
# doctor reports.
ENGINE_ENV_READS = {
    "engine/kernels/fastpath.py": {"CXX"},
    "engine/kernels/cpu_build.py": {"CC", "CLOVER_DESK_KERNEL_CACHE"},
    "engine/kernels/gdn_kernels.py": {"TRITON_INTERPRET"},
    "engine/weights/quant_cache_files.py": {"XDG_CACHE_HOME"},
    "engine/placement/preflight.py": {"CUDA_VISIBLE_DEVICES", "BNB_CUDA_VERSION"},
}


@pytest.fixture
def restore_switches() -> Iterator[None]:
    """The kernels' switches are per process: put back what the test found."""
    before = switches.current()
    yield
    switches.use(before)


# ---------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------


def test_the_defaults_are_the_standard_paths() -> None:
    assert GpuPaths.from_env({}) == GpuPaths() == GpuPaths(
        expert_fetch="pool", fused_moe=False, fused_int8=False, fla_gdn=False, cpu_kernels=True, scalar_kernels=False)
    assert GpuPaths().opt_in() == []


def test_good_values_set_their_fields() -> None:
    env = {"CLOVER_DESK_FUSED_MOE": "1", "CLOVER_DESK_FUSED_INT8": "0", "CLOVER_DESK_FLA_GDN": "1",
           "CLOVER_DESK_DEVICE_POOL": "1", "CLOVER_DESK_ZERO_COPY": "0", "CLOVER_DESK_CPU_KERNELS": "0",
           "CLOVER_DESK_KERNEL_SCALAR": " 1 ", "UNRELATED": "x"}
    paths = GpuPaths.from_env(env)
    assert paths == GpuPaths(expert_fetch="device_tables", fused_moe=True, fla_gdn=True, cpu_kernels=False,
                             scalar_kernels=True)
    assert paths.opt_in() == ["CLOVER_DESK_FUSED_MOE", "CLOVER_DESK_FLA_GDN", "CLOVER_DESK_DEVICE_POOL"]
    assert GpuPaths.from_env({"CLOVER_DESK_ZERO_COPY": "1"}).expert_fetch == "zero_copy"
    assert GpuPaths.from_env({"CLOVER_DESK_FUSED_MOE": ""}) == GpuPaths()  # empty: unset
    for paths in (GpuPaths(), GpuPaths(expert_fetch="zero_copy", fused_int8=True, cpu_kernels=False)):
        env = paths.to_env()
        assert set(env) == set(SWITCHES) and set(env.values()) <= {"0", "1"}
        assert GpuPaths.from_env(env) == paths  # the environment a child process is given says exactly this


@pytest.mark.parametrize("name, value", [("CLOVER_DESK_FUSED_MOE", "yes"), ("CLOVER_DESK_ZERO_COPY", "true"),
                                         ("CLOVER_DESK_CPU_KERNELS", "off"), ("CLOVER_DESK_KERNEL_SCALAR", "2")])
def test_a_bad_value_is_one_line_naming_the_variable_and_what_is_allowed(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as caught:
        GpuPaths.from_env({name: value})
    message = str(caught.value)
    assert message == f"{name}={value!r} is not allowed: set it to 1 (on) or 0 (off), or unset it"
    assert "\n" not in message


def test_the_two_expert_fetches_exclude_each_other() -> None:
    with pytest.raises(SettingsError, match="CLOVER_DESK_ZERO_COPY and CLOVER_DESK_DEVICE_POOL exclude each other"):
        GpuPaths.from_env(dict.fromkeys(EXCLUSIVE, "1"))
    with pytest.raises(SettingsError, match="exclude each other: choose one"):
        opt_in_env(EXCLUSIVE)
    with pytest.raises(SettingsError, match="exclude each other"):
        GpuPaths.from_opt_in(EXCLUSIVE)
    with pytest.raises(SettingsError, match="expert_fetch 'both' is not one of pool, zero_copy, device_tables"):
        GpuPaths(expert_fetch="both")
    with pytest.raises(SettingsError, match="fused_moe 1 is not true or false"):
        GpuPaths(fused_moe=1)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="unknown GPU path 'CLOVER_DESK_TURBO'"):
        GpuPaths.from_opt_in(["CLOVER_DESK_TURBO"])


def test_the_windows_choice_replaces_only_the_opt_in_paths() -> None:
    started = GpuPaths(expert_fetch="zero_copy", fla_gdn=True, cpu_kernels=False)
    chosen = GpuPaths.from_opt_in(["CLOVER_DESK_DEVICE_POOL", "CLOVER_DESK_FUSED_MOE"], base=started)
    assert chosen == GpuPaths(expert_fetch="device_tables", fused_moe=True, cpu_kernels=False)
    assert set(OPT_IN) < set(SWITCHES)


# ---------------------------------------------------------------------------------------------------------------
# read once, in one module
# ---------------------------------------------------------------------------------------------------------------


def _env_reads(tree: ast.AST) -> list[tuple[int, object]]:
    """(line, key) of each ``os.environ.get(k)`` / ``os.environ[k]`` / ``k in os.environ`` / ``os.getenv(k)``; the key
    is the literal (directly or through a module-level constant), or the ast node itself when it is not one (an
    expression hides which variable)."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    constants = {  # the module's NAME = "literal" lines: a read through such a name reads that literal
        t.id: n.value.value for n in getattr(tree, "body", ()) if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets if isinstance(t, ast.Name)
    }

    def key(node: ast.AST) -> object:
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        return node.value if isinstance(node, ast.Constant) else node

    out: list[tuple[int, object]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv":
                out.append((node.lineno, key(node.args[0])))
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            out.append((node.lineno, key(node.slice)))
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            out.append((node.lineno, key(node.left)))
    return out


def test_engine_code_reads_no_gpu_switch_outside_the_settings_module() -> None:
    """Every environment read in engine/ is listed (ENGINE_ENV_READS), by its literal name, and none is a switch
    of engine.settings.SWITCHES: those are parsed in engine/settings.py alone. Nor do the window or the
    application read one: they get the object."""
    found: dict[str, set[str]] = {}
    hidden = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "engine/settings.py":
            continue
        for line, name in _env_reads(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(name, str):
                found.setdefault(rel, set()).add(name)
            else:
                hidden.append(f"{rel}:{line}")
    assert hidden == [], "an environment read whose variable is not a literal"
    assert found == ENGINE_ENV_READS
    others = [
        f"{path.relative_to(ROOT)}:{line} reads {name}"
        for package in ("clover_desk", "ui")
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in _env_reads(ast.parse(path.read_text(encoding="utf-8")))
        if not isinstance(name, str) or name in SWITCHES
    ]
    assert others == []


def test_the_settings_module_is_torch_free() -> None:
    code = "import json, sys, engine.settings; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(m == "torch" or m.startswith("torch.") for m in loaded)


def test_the_cli_reads_the_switches_once_and_refuses_a_bad_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CLOVER_DESK_FUSED_INT8", "1")
    monkeypatch.setenv("CLOVER_DESK_CPU_KERNELS", "0")
    args = cli.parse_args(["serve", "--model", "/models/tiny"])
    assert args.gpu_paths == GpuPaths(fused_int8=True, cpu_kernels=False)
    monkeypatch.setenv("CLOVER_DESK_FLA_GDN", "on")
    for command in (["generate", "--model", "m", "--prompt", "hi"], ["serve", "--model", "m"], ["gui"]):
        with pytest.raises(SystemExit) as caught:
            cli.parse_args(command)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert err == (f"clover-desk {command[0]}: CLOVER_DESK_FLA_GDN='on' is not allowed: set it to 1 (on) or 0 "
                       "(off), or unset it\n")
    assert cli.parse_args(["doctor"]).gpu_paths is None  # the doctor reports it (a finding), the others run no engine
    assert cli.parse_args(["models"]).gpu_paths is None


def test_the_doctor_prints_the_settings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLOVER_DESK_DEVICE_POOL", "1")
    cli.main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["facts"]["gpu_settings"] == GpuPaths(expert_fetch="device_tables").to_dict()
    monkeypatch.setenv("CLOVER_DESK_ZERO_COPY", "1")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "  refused: CLOVER_DESK_ZERO_COPY and CLOVER_DESK_DEVICE_POOL exclude each other" in out


def test_the_worker_reads_them_when_it_starts_and_stops_on_a_bad_one() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLOVER_DESK_FUSED_MOE": "maybe"}
    out = subprocess.run([sys.executable, "-m", "clover_desk.worker.process"], cwd=ROOT, env=env, input="",
                         capture_output=True, text=True, timeout=120)
    first = json.loads(out.stdout.splitlines()[0])
    assert out.returncode == 3 and first["kind"] == "StartupError" and first["fatal"] is True
    assert first["message"].startswith("CLOVER_DESK_FUSED_MOE='maybe' is not allowed")


# ---------------------------------------------------------------------------------------------------------------
# each setting reaches the code it switches
# ---------------------------------------------------------------------------------------------------------------


def test_loading_sets_every_kernel_switch(restore_switches: None) -> None:
    on = GpuPaths(fused_moe=True, fused_int8=True, fla_gdn=True, cpu_kernels=False, scalar_kernels=True)
    switches.use(on)
    assert (triton_moe._enabled, triton_linear._enabled, gdn_kernels.OPTED_IN) == (True, True, True)
    assert (cpu_quant._enabled, cpu_quant._scalar) == (False, True)
    assert switches.current() == on
    switches.use(GpuPaths())
    assert switches.current() == GpuPaths()


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny(tmp_path_factory.mktemp("settings") / "wide", seed=3, hidden=256, tokenizer_vocab=512)
    return write_gguf(folder, folder.parent / "wide-Q4_0.gguf", "Q4_0", layout="fork")[0]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, 0, model.new_cache(64), block_size=None, write_cache=True).float()


def test_cpu_kernels_off_runs_the_dequantizing_path_on_a_gguf(
    q4_gguf: Path, restore_switches: None, one_torch_thread: None,  # noqa: F811
) -> None:
    """The same Q4_0 file loaded with the CPU kernels off (``GpuPaths(cpu_kernels=False)``, what
    ``CLOVER_DESK_CPU_KERNELS=0`` asks) gives the logits of its blocks dequantized into plain weights (to fp32
    rounding), and with them on, the kernels' (activations rounded to int8 blocks: visibly different)."""
    if not cpu_quant.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_quant.reason()}")
    ids = torch.tensor([5, 17, 40, 99, 3, 250, 7, 11])
    reference = _logits(load_gguf_model(q4_gguf, keep_quantized=False).model, ids)
    got = {}
    for on in (False, True):
        engine = Engine.load(q4_gguf, gpu_paths=GpuPaths(cpu_kernels=on))
        assert engine.gpu_paths.cpu_kernels is on and cpu_quant._enabled is on
        got[on] = _logits(engine.model, ids)
    torch.testing.assert_close(got[False], reference, rtol=1e-4, atol=1e-4)
    assert (got[True] - reference).abs().max().item() > 1e-3


def test_without_settings_a_load_keeps_the_process_switches(q4_gguf: Path, restore_switches: None) -> None:
    cpu_quant.set_enabled(False)
    engine = Engine.load(q4_gguf)
    assert engine.gpu_paths == GpuPaths(cpu_kernels=False) and cpu_quant._enabled is False
