"""ModelDownloader against a Hub stand-in on 127.0.0.1, with the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import namedtuple
from pathlib import Path

import pytest

from clover_desk.downloads import (
    STATE_DIR,
    ChecksumError,
    DiskSpaceError,
    DownloadError,
    DownloadProgress,
    ModelDownloader,
)
from clover_desk.engine.errors import CancelledError
from tests.hf_test_server import FakeHub

REPO = "Diffuspace/Clover-Test"
CONFIG = json.dumps({"model_type": "clover_moe"}).encode()
WEIGHTS = bytes(range(256)) * 4096 * 3  # 3 MiB, LFS
SHARD2 = hashlib.sha256(b"seed").digest() * 40_000  # 1.28 MB, LFS


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    # Small reads, so cancelling and progress happen within a test-sized file (the client reads 10 MB at a time).
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 256 * 1024)
    with FakeHub() as server:
        server.add_repo(REPO, {"config.json": CONFIG, "model-00001-of-00002.safetensors": WEIGHTS,
                               "sub/model-00002-of-00002.safetensors": SHARD2, "tokenizer.json": b'{"v": 1}',
                               "clover-q4.gguf": b"GGUF" * 10},
                        lfs={"model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors",
                             "clover-q4.gguf"})
        yield server


def make(hub: FakeHub, target: Path, **kwargs) -> ModelDownloader:
    return ModelDownloader(target, REPO, endpoint=hub.endpoint, token=False, reserve_bytes=0, **kwargs)


def test_plan_lists_sizes_hashes_and_sets_gguf_aside(hub, tmp_path) -> None:
    plan = make(hub, tmp_path / "m").plan()
    assert plan.revision == hub.state.repos[REPO].sha
    by_path = {f.path: f for f in plan.files}
    assert set(by_path) == {"config.json", "model-00001-of-00002.safetensors", "sub/model-00002-of-00002.safetensors",
                            "tokenizer.json"}
    assert by_path["model-00001-of-00002.safetensors"].sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert by_path["model-00001-of-00002.safetensors"].size == len(WEIGHTS)
    assert by_path["config.json"].sha256 is None and by_path["config.json"].git_oid
    assert [f.path for f in plan.unsupported] == ["clover-q4.gguf"]
    assert plan.total_bytes == len(CONFIG) + len(WEIGHTS) + len(SHARD2) + len(b'{"v": 1}')


def test_full_download_with_progress(hub, tmp_path) -> None:
    events: list[DownloadProgress] = []
    target = tmp_path / "model"
    result = make(hub, target, progress=events.append).run()
    assert result == target
    assert (target / "config.json").read_bytes() == CONFIG
    assert (target / "model-00001-of-00002.safetensors").read_bytes() == WEIGHTS
    assert (target / "sub" / "model-00002-of-00002.safetensors").read_bytes() == SHARD2
    assert not (target / "clover-q4.gguf").exists()
    assert not list((target / STATE_DIR).rglob("*.part"))
    assert events[0].state == "planning" and events[-1].state == "done"
    assert events[-1].done_bytes == events[-1].total_bytes > 4_000_000
    downloading = [e for e in events if e.state == "downloading"]
    assert {e.file for e in downloading} >= {"model-00001-of-00002.safetensors"}
    assert all(a.done_bytes <= b.done_bytes for a, b in zip(events, events[1:]))  # monotonic
    assert any(e.speed_bps > 0 and e.eta_s is not None for e in events)
    # LFS bytes came from the "CDN", after a HEAD on /resolve that answered with the redirect.
    assert hub.requests_for("/resolve/", method="HEAD")
    assert hub.requests_for("/cdn/")


def test_second_run_fetches_nothing(hub, tmp_path) -> None:
    target = tmp_path / "model"
    make(hub, target).run()
    before = len(hub.requests_for("/cdn/")) + len(hub.requests_for("/resolve/"))
    make(hub, target).run()
    after = len(hub.requests_for("/cdn/")) + len(hub.requests_for("/resolve/"))
    assert after == before


def test_cut_connection_is_resumed_with_a_range_request(hub, tmp_path) -> None:
    hub.state.cut_after["model-00001-of-00002.safetensors"] = 1_000_000
    target = tmp_path / "model"
    make(hub, target).run()
    assert (target / "model-00001-of-00002.safetensors").read_bytes() == WEIGHTS
    ranges = [h.get("range") for h in hub.requests_for("/cdn/") if h.get("range")]
    assert ranges and ranges[0].startswith("bytes=") and int(ranges[0][6:].split("-")[0]) >= 1_000_000 - 300_000


def test_cancel_keeps_partial_bytes_and_a_new_run_resumes_them(hub, tmp_path) -> None:
    hub.state.chunk_delay_s = 0.01
    cancel = threading.Event()
    target = tmp_path / "model"

    def on_progress(p: DownloadProgress) -> None:
        if p.file == "model-00001-of-00002.safetensors" and p.state == "downloading" and p.done_bytes > 1_000_000:
            cancel.set()

    with pytest.raises(CancelledError):
        make(hub, target, progress=on_progress, cancel=cancel).run()
    parts = list((target / STATE_DIR).rglob("*.part"))
    assert len(parts) == 1
    kept = parts[0].stat().st_size
    assert 0 < kept < len(WEIGHTS)
    assert not (target / "model-00001-of-00002.safetensors").exists()

    # "After a restart": a new downloader, same folder.
    hub.state.chunk_delay_s = 0.0
    make(hub, target).run()
    assert (target / "model-00001-of-00002.safetensors").read_bytes() == WEIGHTS
    assert f"bytes={kept}-" in [h.get("range") for h in hub.requests_for("/cdn/")]


def test_corrupted_file_is_detected_removed_and_fetched_again(hub, tmp_path) -> None:
    hub.state.corrupt_once.add("model-00001-of-00002.safetensors")
    target = tmp_path / "model"
    with pytest.raises(ChecksumError, match="checksum mismatch") as excinfo:
        make(hub, target).run()
    assert "model-00001-of-00002.safetensors" in str(excinfo.value)
    assert not (target / "model-00001-of-00002.safetensors").exists()
    assert not list((target / STATE_DIR).rglob("*.part"))  # the bad bytes are gone
    make(hub, target).run()  # retry
    assert (target / "model-00001-of-00002.safetensors").read_bytes() == WEIGHTS


def test_small_file_checked_against_git_blob_id(hub, tmp_path) -> None:
    hub.state.corrupt_once.add("config.json")
    with pytest.raises(ChecksumError, match="config.json"):
        make(hub, tmp_path / "model").run()


def test_not_enough_disk_space_is_a_clear_error_before_any_transfer(hub, tmp_path) -> None:
    usage = namedtuple("usage", "total used free")
    downloader = make(hub, tmp_path / "model", disk_usage=lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DiskSpaceError, match=r"needs 4\.\d MB more .* 1\.0 KB is free"):
        downloader.run()
    assert hub.requests_for("/cdn/") == []


def test_unknown_repository_is_a_clear_error(hub, tmp_path) -> None:
    downloader = ModelDownloader(tmp_path / "m", "nobody/nothing", endpoint=hub.endpoint, token=False)
    with pytest.raises(DownloadError, match="nobody/nothing not found"):
        downloader.plan()
    with pytest.raises(DownloadError, match="not a Hub repository id"):
        ModelDownloader(tmp_path / "m", "just-a-name", endpoint=hub.endpoint, token=False).plan()


def test_unreachable_hub_is_a_clear_error(tmp_path) -> None:
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    downloader = ModelDownloader(tmp_path / "m", REPO, endpoint=f"http://127.0.0.1:{port}", token=False)
    with pytest.raises(DownloadError, match="cannot reach"):
        downloader.plan()
