"""Download a model repository from the Hugging Face Hub into a folder: resumable, verified, cancellable.

:class:`ModelDownloader` is a plain class (no Qt): the UI runs :meth:`ModelDownloader.run` on a worker thread,
passes a progress callback and a :class:`threading.Event` to cancel. It uses the real ``huggingface_hub``
client for every request: ``HfApi.model_info`` pins the revision to a commit, ``HfApi.list_repo_tree`` gives
each file's size and, for LFS files, its sha256; ``get_hf_file_metadata`` (HEAD on ``/resolve``) finds where the
bytes live; ``http_get`` transfers them, retrying a broken connection with an HTTP ``Range`` request.

Why not ``hf_hub_download``: since huggingface_hub 1.x it writes to a process-unique temporary file and deletes it
when the download fails, so a 70 GB download interrupted by a crash or a closed laptop would start again from
zero. Here each file goes to ``<folder>/.clover-download/<name>.part`` first and the next run continues from the
bytes already there (``Range: bytes=N-``), across restarts of the app.

Every finished file is checked before it is moved into place: LFS files against the sha256 the Hub lists, small
files against their git blob id (sha1 of ``"blob <size>\\0" + bytes``). A mismatch deletes the partial file and
raises :class:`ChecksumError`; running again downloads that file afresh. Files already in place and recorded in
``<folder>/.clover-download/manifest.json`` with the same hash are not fetched again.

Before anything is fetched, the free space of the target's file system is compared with what is still missing
(:class:`DiskSpaceError`). GGUF files in a safetensors repository are listed in the plan but not downloaded.

One GGUF file instead: ``ModelDownloader(target, GGUF_REPO_ID, gguf=choice)`` downloads only the file (or split set)
of one quantization (:data:`OFFICIAL_GGUF`: Q4_0, Q4_K_M, Q8_0 of the official repository), checked against the
sha256 the Hub lists and, where DiffuSpace published them, the published size and sha256 (a Hub listing that
disagrees with them is refused before any byte is fetched); :meth:`ModelDownloader.run` then returns the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from clover_desk.engine.errors import CancelledError, CloverError
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware
from clover_desk.engine.weights.formats import COMPUTE_DTYPES, DEFAULT_POLICY, QuantPolicy, make_policy

log = logging.getLogger(__name__)

DEFAULT_REPO_ID = "Diffuspace/Clover-35B-A3B-Preview"
STATE_DIR = ".clover-download"
MANIFEST = "manifest.json"
DEFAULT_RESERVE_BYTES = 512 * 1024**2  # keep this much free after the download
PROGRESS_INTERVAL_S = 0.2  # at most five progress callbacks a second (plus the first and the last)
SPEED_WINDOW_S = 5.0
HASH_BLOCK = 8 * 1024**2
UNSUPPORTED_SUFFIXES = (".gguf",)
GGUF_REPO_ID = "Diffuspace/Clover-35B-A3B-Preview-GGUF"
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class DownloadError(CloverError):
    """The download cannot go on: the repository, the network, or the disk."""


class DiskSpaceError(DownloadError):
    """Not enough free space for the files still missing."""


class ChecksumError(DownloadError):
    """A downloaded file does not match the hash the Hub lists (it was removed; run again to fetch it anew)."""


@dataclass(frozen=True)
class GgufChoice:
    """One quantization of a GGUF repository: its tag in the file name, and what was published about it."""

    quant: str  # "Q4_0": matched in the file name, case-insensitively, not as part of a longer tag
    size: int | None = None  # bytes, as published (None: not published)
    sha256: str | None = None  # of the single file, as published (None: not published)

    @property
    def label(self) -> str:
        return f"GGUF {self.quant}" + (f" ({self.size / 1e9:.1f} GB)" if self.size else "")

    def matches(self, path: str) -> bool:
        name = PurePosixPath(path).name
        if not name.lower().endswith(".gguf"):
            return False
        tag = re.escape(self.quant)
        return re.search(rf"(?<![A-Za-z0-9]){tag}(?![A-Za-z0-9_])", name, re.IGNORECASE) is not None


# The official files (DiffuSpace's llama.cpp fork layout: they run block diffusion here). Sizes and the Q4_0
# checksum as published with the release.
OFFICIAL_GGUF = (
    GgufChoice("Q4_0", 19_586_909_600, "3e2cf14ca47f6e41c251f08237ac79cd37ad81a2ea2a220fff731e34c66930d5"),
    GgufChoice("Q4_K_M", 22_998_009_248),
    GgufChoice("Q8_0", 37_863_343_264),
)


# ---------------------------------------------------------------------------------------------------------------
# Whether a choice fits this machine, before a byte of it exists: the planner's count where it can make one
# ---------------------------------------------------------------------------------------------------------------

SHAPE_NAME = "clover-35b-a3b"  # the published model's shape (engine.placement.manifest.SHAPES)
CLOVER_SHAPE = planner.SHAPE_PREFIX + SHAPE_NAME
# A GGUF choice is planned as the 35B shape under a policy whose bytes are the file's own: Q4_0's blocks (18 bytes
# per 32 weights) and NF4 at block size 64 (half a byte a weight + a 4-byte scale per 64) are both 4.5 bits a
# weight. Q4_K_M (4.5- and 6.5-bit blocks mixed) and Q8_0 (8.5 bits, against int8's 8 and a scale per row) have no
# such policy: the planner counts them only once the file is on disk, and until then their published size speaks.
PLANNED_AS: dict[str, QuantPolicy] = {"Q4_0": make_policy("nf4", "nf4", "nf4", "nf4", name="gguf-q4_0-as-nf4")}
RUN_PLACES = ("gpu", "partial", "ram", "unknown", "over_budget", "too_large")


@dataclass(frozen=True)
class RunFit:
    """How one download choice would run here (``clover_desk.app`` hands these to the model manager's choices)."""

    place: str  # RUN_PLACES: the whole model on the card, some expert layers streamed from RAM, no GPU and the model
    # fits the RAM; not counted by the planner before it is on disk (its size: within the budget, or over it); too large
    disk_bytes: int | None  # what it takes on disk once downloaded (None: not published)
    text: str  # the figure behind ``place`` and where it comes from, one line


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB"


def folder_disk_bytes() -> int:
    """The safetensors folder on disk: its BF16 weights and the quantized cache the first load writes beside them."""
    return planner.manifest_for_shape(SHAPE_NAME, None).total_bytes() + planner.model_manifest(CLOVER_SHAPE).total_bytes()


def run_fit(choice: GgufChoice | None, vram_budget_bytes: int | None, ctx_tokens: int, hardware: Hardware,
            compute_dtype: str = "bf16", quantized: bool = True) -> RunFit:
    """How ``choice`` (None: the safetensors folder, loaded through the NF4 / INT8 cache) runs on ``hardware``
    with ``vram_budget_bytes`` of the card and ``ctx_tokens`` of context (``vram_budget_bytes=None``: no GPU, the
    model runs from system RAM: the folder through its quantized cache, or unquantized in ``compute_dtype`` when
    not ``quantized``)."""
    disk = folder_disk_bytes() if choice is None else choice.size
    if not vram_budget_bytes:
        place, text = _ram_fit(choice, hardware.ram_total_bytes, compute_dtype, quantized)
        return RunFit(place, disk, text)
    policy = DEFAULT_POLICY if choice is None else PLANNED_AS.get(choice.quant)
    if policy is None:
        place, text = _size_fit(choice, vram_budget_bytes, hardware.ram_available_bytes)
        return RunFit(place, disk, text)
    plan = planner.plan_model(CLOVER_SHAPE, vram_budget_bytes, ctx_tokens, hardware, policy=policy,
                              compute_dtype=compute_dtype)
    how = ("the planner, the 35B shape as the quantized cache will hold it" if choice is None else
           f"the planner, the 35B shape at {choice.quant}'s 4.5 bits a weight")
    layers = len(plan.resident_expert_layers) + len(plan.streamed_expert_layers)
    if not plan.fits:
        return RunFit("too_large", disk, f"Too large here: {plan.reason} ({how})")
    used = f"{planner.format_bytes(plan.vram_used_bytes)} of the {planner.format_bytes(vram_budget_bytes)} budget"
    if not plan.streamed_expert_layers:
        return RunFit("gpu", disk, f"Full GPU offload: all {layers} expert layers on the card, {used} ({how})")
    return RunFit("partial", disk, f"Partial offload: {len(plan.resident_expert_layers)} of {layers} expert layers "
                                   f"on the card, {len(plan.streamed_expert_layers)} streamed from "
                                   f"{planner.format_bytes(plan.ram_bytes)} of RAM; {used} ({how})")


def _ram_fit(choice: GgufChoice | None, ram_bytes: int | None, compute_dtype: str, quantized: bool) -> tuple[str, str]:
    """No GPU: the weights are held in system RAM (the folder through its quantized cache or unquantized in the
    compute dtype, a GGUF file as stored)."""
    if choice is None and quantized:
        need = planner.manifest_for_shape(SHAPE_NAME, DEFAULT_POLICY).total_bytes()
        what = "the 35B weights in the quantized cache, 4-bit experts and 8-bit dense layers (the planner's count)"
    elif choice is None:
        need = planner.manifest_for_shape(SHAPE_NAME, None).total_bytes() * COMPUTE_DTYPES.get(compute_dtype, 4) // 2
        what = f"the 35B weights unquantized in {compute_dtype} (the planner's count)"
    elif choice.size is None:
        return "unknown", "No NVIDIA GPU: it would run from RAM; its size is not published"
    else:
        need, what = choice.size, "the file's blocks as stored (its published size)"
    if ram_bytes is None:
        return "unknown", f"No NVIDIA GPU: it would run from RAM, about {_gb(need)} for {what}; RAM size unknown"
    place = "ram" if need <= ram_bytes else "too_large"
    verdict = "runs from RAM" if place == "ram" else "too large for the RAM"
    return place, f"No NVIDIA GPU: {verdict}: about {_gb(need)} for {what}, {_gb(ram_bytes)} of RAM here"


def _size_fit(choice: GgufChoice, vram_budget_bytes: int, ram_available: int | None) -> tuple[str, str]:
    """No policy has this file's bytes: what its published size alone says, and that the planner has not counted."""
    later = "the planner counts it once the file is on disk"
    if choice.size is None:
        return "unknown", f"Its size is not published; {later}"
    size, budget = _gb(choice.size), planner.format_bytes(vram_budget_bytes)
    if ram_available is not None and choice.size > vram_budget_bytes + ram_available:
        return "too_large", (f"Likely too large: the file's {size} is more than the {budget} budget and the "
                             f"{_gb(ram_available)} of free RAM together; {later}")
    if choice.size > vram_budget_bytes:
        return "over_budget", f"The file's {size} is more than the {budget} budget: part of it would stream from RAM; {later}"
    return "unknown", f"The file's {size} is within the {budget} budget; whether the context fits too, {later}"


@dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the repository, "/"-separated
    size: int
    sha256: str | None  # LFS files
    git_oid: str | None  # small (non-LFS) files: git blob id

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class DownloadPlan:
    repo_id: str
    revision: str  # the commit the files are pinned to
    files: tuple[RemoteFile, ...]  # what will be downloaded
    unsupported: tuple[RemoteFile, ...]  # listed, not downloaded (GGUF: the engine does not read it yet)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class DownloadProgress:
    """A snapshot for the UI. Bytes count the whole plan (files already present included)."""

    state: str  # "planning" | "checking" | "downloading" | "verifying" | "done"
    file: str
    file_index: int  # 0-based
    file_count: int
    done_bytes: int
    total_bytes: int
    speed_bps: float  # over the last few seconds of transfer
    eta_s: float | None  # None while the speed is unknown

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


ProgressCallback = Callable[[DownloadProgress], None]


@dataclass
class _Meter:
    """Bytes done and a sliding-window speed."""

    total: int
    done: int = 0
    samples: deque = field(default_factory=deque)  # (monotonic time, done)

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        self.samples.append((now, self.done))
        while len(self.samples) > 2 and now - self.samples[0][0] > SPEED_WINDOW_S:
            self.samples.popleft()

    def speed(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return max(d1 - d0, 0) / (t1 - t0) if t1 > t0 else 0.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# Windows' reserved device names: "CON", "nul.txt", "COM1.tar.gz" open the device, whatever the folder
_DEVICE_NAMES = frozenset({"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
                          | {f"{dev}{n}" for dev in ("COM", "LPT") for n in (*"123456789", "\u00b9", "\u00b2", "\u00b3")})
_WINDOWS_FORBIDDEN = set('<>"|?*')


def unsafe_name_reason(path: str) -> str | None:
    """Why a repository path cannot be written below the target folder on POSIX *and* Windows (None: it can).

    Refused: absolute paths, backslashes (a separator on Windows), colons (drive letters ``C:x``, alternate data
    streams), empty, ``.`` or ``..`` parts, control characters, characters Windows cannot store, parts ending in a
    dot or a space (Windows drops them, so two names meet), reserved device names with any extension."""
    if not path:
        return "it is empty"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "it holds a control character"
    if "\\" in path:
        return "it holds a backslash (a folder separator on Windows)"
    if ":" in path:
        return "it holds a colon (a drive letter or stream on Windows)"
    if path.startswith("/"):
        return "it is absolute"
    bad_chars = sorted(_WINDOWS_FORBIDDEN.intersection(path))
    if bad_chars:
        return f"it holds {''.join(bad_chars)!r}, which Windows cannot store in a file name"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"it has an {'empty' if not part else repr(part)} part"
        if part[-1] in ". ":
            return f"its part {part!r} ends in a dot or a space"
        if part.split(".", 1)[0].rstrip(" ").upper() in _DEVICE_NAMES:
            return f"its part {part!r} is a reserved device name on Windows"
    if PureWindowsPath(path).anchor or PurePosixPath(path).is_absolute():  # belt and braces: both say relative
        return "it is absolute"
    return None


def _safe_relative(path: str) -> PurePosixPath:
    """A repository path as a relative path that cannot leave the target folder, under POSIX or Windows rules."""
    why = unsafe_name_reason(path)
    if why is not None:
        raise DownloadError(f"refusing unsafe file name from the Hub: {path!r} ({why})")
    return PurePosixPath(path)


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class ModelDownloader:
    """Downloads ``repo_id`` at ``revision`` into ``target_dir``. One instance per attempt; not thread-safe.

    ``progress`` is called on the calling (worker) thread; ``cancel`` is polled between chunks (the client reads
    in chunks of ``huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE``, 10 MB), and what was downloaded is kept for
    the next attempt. ``endpoint`` defaults to ``HF_ENDPOINT`` / the Hub.
    """

    def __init__(
        self,
        target_dir: str | Path,
        repo_id: str = DEFAULT_REPO_ID,
        *,
        revision: str = "main",
        endpoint: str | None = None,
        token: str | bool | None = None,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
        gguf: GgufChoice | None = None,
    ) -> None:
        self.target_dir = Path(target_dir)
        self.gguf = gguf  # one GGUF file (or split set) of this quantization instead of the safetensors model
        self.repo_id = repo_id.strip()
        self.revision = revision
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.token = token
        self.progress = progress
        self.cancel = cancel or threading.Event()
        self.reserve_bytes = reserve_bytes
        self._disk_usage = disk_usage
        self._meter = _Meter(total=0)
        self._last_report = 0.0
        self._current = ("planning", "", 0, 0)
        self._commit = revision  # replaced by the commit id once planned

    # ---- planning ------------------------------------------------------------------------------------------

    def plan(self) -> DownloadPlan:
        """Ask the Hub for the commit and the file list (sizes and hashes)."""
        import httpx2
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
        from huggingface_hub.hf_api import RepoFile

        if self.repo_id.count("/") != 1 or not all(self.repo_id.split("/")):
            raise DownloadError(f"{self.repo_id!r} is not a Hub repository id (expected owner/name)")
        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            info = api.model_info(self.repo_id, revision=self.revision)
            commit = info.sha or self.revision
            entries = list(api.list_repo_tree(self.repo_id, revision=commit, recursive=True))
        except RepositoryNotFoundError:
            raise DownloadError(
                f"repository {self.repo_id} not found on {self._endpoint_name()} (or it is private/gated and needs "
                "a token: run `hf auth login`)") from None
        except RevisionNotFoundError:
            raise DownloadError(f"revision {self.revision!r} not found in {self.repo_id}") from None
        except HfHubHTTPError as exc:
            raise DownloadError(f"the Hub refused the file list of {self.repo_id}: {exc}") from None
        except (httpx2.HTTPError, OSError) as exc:  # connection refused, DNS, TLS, timeouts
            raise DownloadError(f"cannot reach {self._endpoint_name()}: {exc}") from None
        files: list[RemoteFile] = []
        unsupported: list[RemoteFile] = []
        for entry in entries:
            if not isinstance(entry, RepoFile):
                continue  # a folder
            lfs = entry.lfs
            remote = RemoteFile(path=entry.path, size=int(entry.size),
                                sha256=lfs.sha256 if lfs is not None else None,
                                git_oid=None if lfs is not None else entry.blob_id)
            _safe_relative(remote.path)
            if self.gguf is not None:
                (files if self.gguf.matches(remote.path) else unsupported).append(remote)
            elif remote.path.lower().endswith(UNSUPPORTED_SUFFIXES):
                unsupported.append(remote)
            else:
                files.append(remote)
        if self.gguf is not None:
            return DownloadPlan(self.repo_id, commit, self._check_gguf(files, unsupported), tuple(unsupported))
        if not any(f.path == "config.json" for f in files):
            raise DownloadError(f"{self.repo_id} has no config.json: it is not a model the engine can load")
        return DownloadPlan(self.repo_id, commit, tuple(files), tuple(unsupported))

    def _check_gguf(self, files: list[RemoteFile], others: list[RemoteFile]) -> tuple[RemoteFile, ...]:
        """The one file, or the one complete split set, of the chosen quantization, as published."""
        choice = self.gguf
        assert choice is not None
        if not files:
            listed = ", ".join(PurePosixPath(f.path).name for f in others if f.path.lower().endswith(".gguf"))
            raise DownloadError(f"{self.repo_id} has no {choice.quant} GGUF file"
                                + (f" (it has: {listed})" if listed else " (it has no GGUF file at all)"))
        files.sort(key=lambda f: f.path)
        parts = [_SPLIT_PART.search(f.path) for f in files]
        if len(files) > 1:
            stems = {_SPLIT_PART.sub("", f.path) for f in files}
            counts = {int(m.group(2)) for m in parts if m}
            if len(stems) != 1 or not all(parts) or counts != {len(files)}:
                raise DownloadError(f"{self.repo_id} has several {choice.quant} GGUF files that are not one split set "
                                    f"({', '.join(f.path for f in files)}); download the one you want by hand")
        total = sum(f.size for f in files)
        if choice.size is not None and total != choice.size:
            raise ChecksumError(f"{self.repo_id}: the Hub lists {total:,} bytes for the {choice.quant} file, but "
                                f"{choice.size:,} bytes were published; not downloading it")
        if choice.sha256 is not None and len(files) == 1 and files[0].sha256 != choice.sha256:
            raise ChecksumError(f"{files[0].path}: the Hub lists sha256 {str(files[0].sha256)[:12]}…, but "
                                f"{choice.sha256[:12]}… was published; not downloading it")
        return tuple(files)

    def _endpoint_name(self) -> str:
        from huggingface_hub import constants

        return self.endpoint or constants.ENDPOINT

    # ---- disk ----------------------------------------------------------------------------------------------

    def missing_bytes(self, plan: DownloadPlan) -> int:
        """Bytes still to fetch: the plan minus finished files and partial bytes already on disk."""
        manifest = self._read_manifest()
        missing = 0
        for f in plan.files:
            if self._is_complete(f, manifest, verify=False):
                continue
            part = self._part_path(f)
            have = part.stat().st_size if part.exists() else 0
            missing += max(f.size - min(have, f.size), 0)
        return missing

    def free_bytes(self) -> int:
        return int(self._disk_usage(str(_existing_ancestor(self.target_dir))).free)

    def check_disk(self, plan: DownloadPlan) -> None:
        need = self.missing_bytes(plan)
        free = self.free_bytes()
        if need + self.reserve_bytes > free:
            raise DiskSpaceError(
                f"not enough free space in {_existing_ancestor(self.target_dir)}: the download needs "
                f"{human_bytes(need)} more (plus {human_bytes(self.reserve_bytes)} to spare), "
                f"{human_bytes(free)} is free")

    # ---- the download --------------------------------------------------------------------------------------

    def run(self, plan: DownloadPlan | None = None) -> Path:
        """Download everything in ``plan`` (made now if None). Returns the model folder."""
        self._report("planning", "", 0, 0, force=True)
        plan = plan or self.plan()
        self._check_cancel()
        self.target_dir.mkdir(parents=True, exist_ok=True)
        self.check_disk(plan)
        manifest = self._read_manifest()
        if manifest.get("repo_id") not in (None, plan.repo_id) or manifest.get("revision") not in (None,
                                                                                                    plan.revision):
            log.info("%s held %s@%s; now downloading %s@%s", self.target_dir, manifest.get("repo_id"),
                     manifest.get("revision"), plan.repo_id, plan.revision)
            manifest = {}
        manifest.update({"repo_id": plan.repo_id, "revision": plan.revision})
        manifest.setdefault("files", {})
        self._meter = _Meter(total=plan.total_bytes)
        self._commit = plan.revision
        count = len(plan.files)
        for index, remote in enumerate(plan.files):
            self._check_cancel()
            self._current = ("checking", remote.path, index, count)
            self._report(*self._current, force=True)
            if self._is_complete(remote, manifest, verify=True):
                self._meter.done += remote.size
                continue
            self._download_file(remote, index, count)
            manifest["files"][remote.path] = {"size": remote.size, "sha256": remote.sha256, "git_oid": remote.git_oid}
            self._write_manifest(manifest)
        self._report("done", "", count, count, force=True)
        log.info("downloaded %s@%s into %s", plan.repo_id, plan.revision, self.target_dir)
        if self.gguf is not None:  # the file to open (the first part of a split set)
            return self.target_dir / _safe_relative(plan.files[0].path)
        return self.target_dir

    def _download_file(self, remote: RemoteFile, index: int, count: int) -> None:
        import httpx2
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo_id, remote.path, revision=self._commit, endpoint=self.endpoint)
        headers = build_hf_headers(token=self.token, library_name="clover-desk")
        try:
            meta = get_hf_file_metadata(url, token=self.token, library_name="clover-desk", endpoint=self.endpoint)
        except HfHubHTTPError as exc:
            raise DownloadError(f"{remote.path}: the Hub refused the download: {exc}") from None
        except (httpx2.HTTPError, OSError) as exc:
            raise DownloadError(f"{remote.path}: cannot reach {self._endpoint_name()}: {exc}") from None
        if meta.size is not None and meta.size != remote.size:
            raise DownloadError(f"{remote.path}: the Hub lists {remote.size} bytes but serves {meta.size}")
        location = url if meta.xet_file_data is not None else meta.location
        if location != url:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the Hub

        part = self._part_path(remote)
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > remote.size:
            log.warning("%s: partial file is larger than the file (%d > %d); starting again", remote.path, have,
                        remote.size)
            part.unlink()
            have = 0
        self._current = ("downloading", remote.path, index, count)
        self._meter.add(have)  # bytes kept from an earlier attempt count as done (but not towards the speed)
        self._meter.samples.clear()
        self._report(*self._current, force=True)
        if have < remote.size:
            mode = "r+b" if part.exists() else "wb"
            try:
                with open(part, mode) as f:
                    f.seek(have)
                    http_get(location, f, resume_size=have, headers=headers, expected_size=remote.size,
                             displayed_filename=remote.path, tqdm_class=self._progress_class())
            except CancelledError:
                raise
            except HfHubHTTPError as exc:
                raise DownloadError(f"{remote.path}: download failed: {exc}") from None
            except (httpx2.HTTPError, OSError) as exc:
                # Network errors after the client's own retries, a short file, or a full disk. The bytes so far
                # stay in the .part file: the next attempt continues from there.
                raise DownloadError(f"{remote.path}: download interrupted ({exc}); run again to resume") from None
        self._current = ("verifying", remote.path, index, count)
        self._report(*self._current, force=True)
        digest = self._hash(part, "sha256" if remote.is_lfs else "git")
        expected = remote.sha256 if remote.is_lfs else remote.git_oid
        if expected and digest != expected:
            part.unlink(missing_ok=True)
            self._meter.done -= remote.size
            raise ChecksumError(
                f"{remote.path}: checksum mismatch (expected {expected[:12]}…, got {digest[:12]}…); the corrupted "
                "file was removed, run the download again to fetch it anew")
        destination = self.target_dir / _safe_relative(remote.path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, destination)

    # ---- progress hook for huggingface_hub's http_get ------------------------------------------------------

    def _progress_class(self) -> type:
        downloader = self

        class _Hook:
            """What http_get expects of a tqdm class: a context manager with update(n)."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def __enter__(self) -> "_Hook":
                return self

            def __exit__(self, *exc: object) -> None:
                return None

            def close(self) -> None:
                return None

            def update(self, n: float | None = 1) -> None:
                downloader._on_bytes(int(n or 0))

        return _Hook

    def _on_bytes(self, n: int) -> None:
        self._meter.add(n)
        self._report(*self._current)
        self._check_cancel()  # raising here aborts http_get between chunks; the .part file keeps the bytes

    # ---- helpers -------------------------------------------------------------------------------------------

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise CancelledError("download cancelled; what was downloaded is kept, resume to continue")

    def _report(self, state: str, file: str, index: int, count: int, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if not force and now - self._last_report < PROGRESS_INTERVAL_S:
            return
        self._last_report = now
        speed = self._meter.speed()
        left = max(self._meter.total - self._meter.done, 0)
        eta = left / speed if speed > 0 else None
        self.progress(DownloadProgress(state, file, index, count, self._meter.done, self._meter.total, speed, eta))

    def _state_dir(self) -> Path:
        return self.target_dir / STATE_DIR

    def _part_path(self, remote: RemoteFile) -> Path:
        # The hash in the name: a changed file on the Hub never resumes onto the old bytes.
        tag = (remote.sha256 or remote.git_oid or "nohash")[:16]
        rel = _safe_relative(remote.path)
        return self._state_dir() / rel.parent / f"{rel.name}.{tag}.part"

    def _read_manifest(self) -> dict[str, Any]:
        path = self._state_dir() / MANIFEST
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        path = self._state_dir() / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)

    def _is_complete(self, remote: RemoteFile, manifest: dict[str, Any], verify: bool) -> bool:
        destination = self.target_dir / _safe_relative(remote.path)
        if not destination.is_file() or destination.stat().st_size != remote.size:
            return False
        recorded = manifest.get("files", {}).get(remote.path)
        if recorded and recorded.get("sha256") == remote.sha256 and recorded.get("git_oid") == remote.git_oid:
            return True
        if not verify:
            return False
        # A file we did not write (copied in by hand, or from an older run): hash it once.
        self._current = ("verifying", remote.path, self._current[2], self._current[3])
        self._report(*self._current, force=True)
        digest = self._hash(destination, "sha256" if remote.is_lfs else "git")
        ok = digest == (remote.sha256 if remote.is_lfs else remote.git_oid)
        if ok:
            manifest.setdefault("files", {})[remote.path] = {"size": remote.size, "sha256": remote.sha256,
                                                             "git_oid": remote.git_oid}
            self._write_manifest(manifest)
        return ok

    def _hash(self, path: Path, kind: str) -> str:
        h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
                self._check_cancel()
        return h.hexdigest()
