"""One GGUF file from a repository of several (the official Clover GGUF release's shape), against the Hub stand-in
on 127.0.0.1 with the real huggingface_hub client: only the chosen quantization is fetched, and it is checked
against the Hub's sha256 and, where published, the published size and sha256."""

from __future__ import annotations

import hashlib

import pytest

from clover_desk.downloads import (
    GGUF_REPO_ID,
    OFFICIAL_GGUF,
    ChecksumError,
    DownloadError,
    GgufChoice,
    ModelDownloader,
)
from tests.hf_test_server import FakeHub

Q4_0 = b"GGUF" + bytes(range(256)) * 2000  # ~0.5 MB each, LFS
Q4_K_M = b"GGUF" + hashlib.sha256(b"k").digest() * 9000
Q8_PART1 = b"GGUF" + b"\x01" * 300_000
Q8_PART2 = b"GGUF" + b"\x02" * 200_000
FILES = {
    "README.md": b"# Clover GGUF\n",
    "Clover-35B-A3B-Preview-Q4_0.gguf": Q4_0,
    "Clover-35B-A3B-Preview-Q4_K_M.gguf": Q4_K_M,
    "Q8_0/Clover-35B-A3B-Preview-Q8_0-00001-of-00002.gguf": Q8_PART1,
    "Q8_0/Clover-35B-A3B-Preview-Q8_0-00002-of-00002.gguf": Q8_PART2,
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with FakeHub() as server:
        server.add_repo(GGUF_REPO_ID, FILES, lfs={p for p in FILES if p.endswith(".gguf")})
        yield server


def make(hub: FakeHub, target, choice: GgufChoice) -> ModelDownloader:
    return ModelDownloader(target, GGUF_REPO_ID, endpoint=hub.endpoint, token=False, reserve_bytes=0, gguf=choice)


def test_the_published_figures_of_the_official_files() -> None:
    assert GGUF_REPO_ID == "Diffuspace/Clover-35B-A3B-Preview-GGUF"
    assert [(c.quant, c.size) for c in OFFICIAL_GGUF] == [
        ("Q4_0", 19_586_909_600), ("Q4_K_M", 22_998_009_248), ("Q8_0", 37_863_343_264)]
    assert OFFICIAL_GGUF[0].sha256 == "3e2cf14ca47f6e41c251f08237ac79cd37ad81a2ea2a220fff731e34c66930d5"
    assert [c.label for c in OFFICIAL_GGUF] == ["GGUF Q4_0 (19.6 GB)", "GGUF Q4_K_M (23.0 GB)", "GGUF Q8_0 (37.9 GB)"]


def test_only_the_chosen_file_is_downloaded_and_verified(hub, tmp_path) -> None:
    target = tmp_path / "gguf"
    downloader = make(hub, target, GgufChoice("Q4_0", len(Q4_0), sha(Q4_0)))
    plan = downloader.plan()
    assert [f.path for f in plan.files] == ["Clover-35B-A3B-Preview-Q4_0.gguf"]
    assert plan.total_bytes == len(Q4_0)
    path = downloader.run()
    assert path == target / "Clover-35B-A3B-Preview-Q4_0.gguf" and path.read_bytes() == Q4_0
    assert sorted(p.name for p in target.iterdir() if p.is_file()) == ["Clover-35B-A3B-Preview-Q4_0.gguf"]
    fetched = {p.rsplit("/", 1)[-1] for _, m, p, _ in hub.state.requests if "/cdn/" in p and m == "GET"}
    assert fetched == {sha(Q4_0)}  # nothing else was transferred
    before = len(hub.requests_for("/cdn/"))
    assert make(hub, target, GgufChoice("Q4_0", len(Q4_0), sha(Q4_0))).run() == path  # done: nothing fetched again
    assert len(hub.requests_for("/cdn/")) == before


def test_a_hub_listing_that_disagrees_with_the_published_checksum_is_refused_before_any_transfer(hub, tmp_path) -> None:
    with pytest.raises(ChecksumError, match=r"Q4_0\.gguf: the Hub lists sha256 .* was published"):
        make(hub, tmp_path / "g", GgufChoice("Q4_0", len(Q4_0), "3e2cf14ca47f" + "0" * 52)).run()
    with pytest.raises(ChecksumError, match=r"lists 288,004 bytes for the Q4_K_M file, but 288,005 bytes were"):
        make(hub, tmp_path / "g", GgufChoice("Q4_K_M", len(Q4_K_M) + 1)).run()
    assert hub.requests_for("/cdn/") == []


def test_damaged_bytes_are_caught_by_the_hubs_checksum(hub, tmp_path) -> None:
    hub.state.corrupt_once.add("Clover-35B-A3B-Preview-Q4_K_M.gguf")
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        make(hub, tmp_path / "g", GgufChoice("Q4_K_M", len(Q4_K_M))).run()
    path = make(hub, tmp_path / "g", GgufChoice("Q4_K_M", len(Q4_K_M))).run()  # fetched afresh
    assert path.read_bytes() == Q4_K_M


def test_a_split_set_comes_whole_and_opens_at_its_first_part(hub, tmp_path) -> None:
    path = make(hub, tmp_path / "g", GgufChoice("Q8_0", len(Q8_PART1) + len(Q8_PART2))).run()
    assert path == tmp_path / "g" / "Q8_0" / "Clover-35B-A3B-Preview-Q8_0-00001-of-00002.gguf"
    assert path.read_bytes() == Q8_PART1
    assert path.with_name("Clover-35B-A3B-Preview-Q8_0-00002-of-00002.gguf").read_bytes() == Q8_PART2


def test_a_quantization_the_repository_lacks_is_named(hub, tmp_path) -> None:
    with pytest.raises(DownloadError, match=r"has no Q5_K_M GGUF file \(it has: .*Q4_0\.gguf"):
        make(hub, tmp_path / "g", GgufChoice("Q5_K_M")).plan()
