"""``clover-desk gguf-fix``: the copy upstream llama.cpp loads (key added, diffusion tensors dropped, ssm_a rewritten,
the rest byte-identical), streamed, and never a half-written OUT in place of a good file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401

from clover_desk.cli.main import main
from clover_desk.engine.errors import ConfigError
from clover_desk.engine.weights.gguf.file import DIFFUSION_SUFFIXES
from clover_desk.engine.weights.gguf.fix import fix_gguf
from clover_desk.engine.weights.gguf.model import load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def official(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fork-layout ("official") Q8_0 file: no shared-expert key, diffusion tensors, raw A_log in ssm_a."""
    return write_gguf(tiny_clover_dir, tmp_path_factory.mktemp("official") / "clover-Q8_0.gguf", "Q8_0", layout="fork")[0]


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _check_fixed(src_parts: list[Path], out_parts: list[Path]) -> None:
    src = [gguf.GGUFReader(p) for p in src_parts]
    out = [gguf.GGUFReader(p) for p in out_parts]
    before = {t.name: t for r in src for t in r.tensors}
    after = {t.name: t for r in out for t in r.tensors}
    assert "clover_moe.expert_shared_count" not in _fields(src[0])
    assert _fields(out[0])["clover_moe.expert_shared_count"] == 1
    for a, b in zip(src, out):  # every other key unchanged (split.tensors.count counts the kept tensors)
        fa, fb = _fields(a), _fields(b)
        fb.pop("clover_moe.expert_shared_count", None)
        if "split.tensors.count" in fa:
            assert fb.pop("split.tensors.count") == len(after)
            fa.pop("split.tensors.count")
        assert fa == fb
    dropped = [n for n in before if n.endswith(DIFFUSION_SUFFIXES)]
    assert dropped and not any(n.endswith(DIFFUSION_SUFFIXES) for n in after)
    assert set(after) == set(before) - set(dropped)
    n_ssm_a = 0
    for name, t in after.items():
        assert t.tensor_type == before[name].tensor_type and list(t.shape) == list(before[name].shape)
        if name.endswith(".ssm_a"):
            a_log = np.asarray(before[name].data, dtype=np.float32)
            assert np.array_equal(np.asarray(t.data), -np.exp(a_log))
            n_ssm_a += 1
        else:
            assert np.asarray(t.data).tobytes() == np.asarray(before[name].data).tobytes(), name
    assert n_ssm_a == 3  # the tiny model's Gated DeltaNet layers


def test_fix_writes_what_upstream_expects(official: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    out = tmp_path / "fixed.gguf"
    report = fix_gguf(official, out, progress=lambda d, t: seen.append((d, t)), chunk_bytes=1000)
    assert report.outputs == (out,) and report.dropped_tensors == 12 and report.rewritten_ssm_a == 3
    assert report.added_key == "clover_moe.expert_shared_count" and report.bytes_written == out.stat().st_size
    _check_fixed([official], [out])
    assert seen[-1][0] == seen[-1][1] and all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    assert not list(tmp_path.glob(".*partial"))


def test_fix_without_kernel_copy(official: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where copy_file_range is refused (another file system), the buffered copy gives the same bytes."""

    def refuse(*args: object) -> int:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr("clover_desk.engine.weights.gguf.fix.os.copy_file_range", refuse, raising=False)
    out = fix_gguf(official, tmp_path / "fixed.gguf", chunk_bytes=1000).outputs[0]
    _check_fixed([official], [out])


def test_fix_with_short_kernel_copies(official: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_file_range may copy less than asked: the loop resumes at the right source offset."""
    import os

    real = getattr(os, "copy_file_range", None)
    if real is None:
        pytest.skip("no os.copy_file_range here")

    def short(src: int, dst: int, count: int, offset_src: int | None = None, offset_dst: int | None = None) -> int:
        return real(src, dst, min(count, 100), offset_src, offset_dst)

    monkeypatch.setattr("clover_desk.engine.weights.gguf.fix.os.copy_file_range", short)
    out = fix_gguf(official, tmp_path / "fixed.gguf").outputs[0]
    _check_fixed([official], [out])


def test_fixed_file_runs_ar_like_the_official_one(official: Path, tmp_path: Path) -> None:
    out = fix_gguf(official, tmp_path / "fixed.gguf").outputs[0]
    fixed = load_gguf_model(out)
    assert fixed.file.layout == "upstream"
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    orig = load_gguf_model(official).model(ids)
    torch.testing.assert_close(fixed.model(ids), orig, rtol=0, atol=1e-4)  # A_log = log(-(-exp(A_log)))


def test_fix_split_set(tiny_clover_dir: Path, tmp_path: Path) -> None:
    parts = write_gguf(tiny_clover_dir, tmp_path / "official.gguf", "Q8_0", split_max_tensors=30)
    assert len(parts) == 3
    report = fix_gguf(parts[1], tmp_path / "fixed.gguf")
    assert [p.name for p in report.outputs] == [f"fixed-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    _check_fixed(parts, list(report.outputs))
    assert load_gguf_model(report.outputs[2]).file.layout == "upstream"


def test_cli_gguf_fix(official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fixed.gguf"
    assert main(["gguf-fix", str(official), str(out)]) == 0
    captured = capsys.readouterr()
    assert "12 diffusion tensors dropped, 3 ssm_a rewritten" in captured.out and "gguf-fix:" in captured.err
    # a file already in upstream's layout: one line, exit 2
    assert main(["gguf-fix", "--quiet", str(out), str(tmp_path / "again.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and "already in upstream" in err[0]
    assert not (tmp_path / "again.gguf").exists()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(official.read_bytes()[:3000])
    assert main(["gguf-fix", "--quiet", str(cut), str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{cut}: truncated" in err[0]
    assert main(["gguf-fix", "--quiet", str(official), str(official)]) == 2
    assert "overwrite the input" in capsys.readouterr().err


def test_a_failed_fix_never_replaces_a_good_file(official: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "fixed.gguf"
    out.write_bytes(b"a good earlier file")

    def no_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("clover_desk.engine.weights.gguf.fix.os.fsync", no_disk)
    with pytest.raises(OSError, match="No space"):
        fix_gguf(official, out)
    assert out.read_bytes() == b"a good earlier file"
    assert [p.name for p in tmp_path.iterdir()] == ["fixed.gguf"]  # the partial file is gone
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="missing"):
        fix_gguf(tmp_path / "gone-00001-of-00002.gguf", out)
    assert out.read_bytes() == b"a good earlier file"
