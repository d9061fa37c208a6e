"""Quantized weight cache: convert a Hugging Face checkpoint once, load the quantized model fast afterwards.

Where: ``<model_dir>/.clover-cache/<policy hash>/`` (beside the model, so deleting the model deletes its cache);
when the model folder is not writable, ``$XDG_CACHE_HOME/clover-desk/quant/<hash of the model path>/<policy hash>/``
(default ``~/.cache/...``). ``cache_root`` overrides both.

What: ``weights.safetensors`` (a real safetensors file) + ``manifest.json``::

    {"version": 2,
     "policy": {...QuantPolicy.to_dict(), "hash": ...},
     "source": {"model_dir", "config_sha256", "files": {name: {"size", "mtime_ns", "header_sha256"}}},
     "tensors": {model name: {"shape", "format": "nf4"|"int8"|"q6_k"|"bf16"|"fp32"|"fp16", "bytes", "stored": [keys]}},
     "experts": {bank name: ExpertLayout dict},
     "files": {"weights.safetensors": {"size", "header_sha256", "sha256", "crc32": {key: crc}}},
     "complete": true,
     "checks": ["finite"]}

Stored keys are the quantized model's state-dict names: a quantized linear ``X.weight`` is ``X.codes`` +
``X.scales`` (the :class:`QuantLinear` buffers; a Q6_K matrix's scales are an empty tensor: its blocks hold them);
an expert bank
``layers.N.mlp.experts`` is ``layers.N.mlp.experts.packed`` uint8 [E, R] (one contiguous row per expert, exactly the
host-store layout of ``engine/placement/expert_store.py``); anything else keeps its name.

Conversion (:mod:`engine.weights.quant_cache_build`) streams tensor by tensor into a temporary folder renamed into
place; the files' format, raw reads and writes and the check are :mod:`engine.weights.quant_cache_files`.

On load the cache is checked: missing, incomplete, another policy, another checkpoint, stale (a source file's
size / mtime / header changed), corrupt (size or hash mismatch) or unchecked (written before the conversion refused
NaN / infinite weights: no ``"checks"`` in its manifest) -> the reason is logged, returned, and the cache is rebuilt;
it is never used silently.

Which policy: the caller's, else the device's default (:func:`engine.weights.formats.policy_for`: on the CPU the head
in Q6_K blocks, elsewhere INT8). A cache folder is named by its policy's hash, so a folder built under another policy
(the CPU's INT8 head before the Q6_K default) is never read as this one: it still loads under its own policy (its
manifest names every format), and when this policy's folder is missing the build logs which other caches lie beside
it (left in place: another device may use them; delete them to free the disk).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CheckpointError
from clover_desk.engine.model.clover import CloverModel
from clover_desk.engine.model.config import load_config
from clover_desk.engine.placement import placer
from clover_desk.engine.weights import checkpoint
from clover_desk.engine.weights.formats import policy_for
from clover_desk.engine.weights.quant import (
    QUANT_FORMATS,
    ExpertLayout,
    QuantExpertBank,
    QuantLinear,
    QuantPolicy,
    interleave_for_cpu,
    set_submodule,
)
from clover_desk.engine.weights.quant_cache_build import build_cache
from clover_desk.engine.weights.quant_cache_files import (
    CHUNK_BYTES,
    DATA_NAME,
    DTYPES,
    MANIFEST_NAME,
    O_BINARY,
    Progress,
    ProgressTracker,
    SrcTensor,
    cache_dir_for,
    check_cache,
    expert_bank_of,
    pread_all,
    read_header,
    read_into,
)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheReport:
    """What ``load_quantized`` did: the cache used, whether it was (re)built, and why."""

    path: Path
    rebuilt: bool
    reason: str  # "" when an existing cache was valid and used
    manifest_path: Path


def ensure_cache(
    model_dir: str | Path,
    policy: QuantPolicy | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    cache_root: str | Path | None = None,
    verify: str = "header",
    device: torch.device | str = "cpu",
) -> CacheReport:
    """The checked cache of ``model_dir`` under ``policy`` (None: ``device``'s default, :func:`policy_for`), built
    (or rebuilt, with the reason logged and returned) when needed. Conversion streams tensor by tensor; nothing is
    loaded."""
    model_dir = Path(model_dir)
    policy = policy or policy_for(device)
    cdir = cache_dir_for(model_dir, policy, cache_root)
    reason = check_cache(cdir, model_dir, policy, verify)
    rebuilt = False
    if reason is not None:
        if not reason.startswith("missing"):
            log.warning("quantized cache %s not used: %s; rebuilding", cdir, reason)
        else:
            _log_other_policies(cdir, policy)
        build_cache(model_dir, policy, cdir, progress, cancel)
        rebuilt = True
    return CacheReport(cdir, rebuilt, reason or "", cdir / MANIFEST_NAME)


def _log_other_policies(cdir: Path, policy: QuantPolicy) -> None:
    """Say which caches of other policies lie beside ``cdir`` when this policy's is built (why a model that had a
    cache is converted again: the default policy changed, or another device's default is asked for)."""
    for other in sorted(cdir.parent.glob("*/" + MANIFEST_NAME)) if cdir.parent.is_dir() else ():
        if other.parent.name.startswith("."):  # a conversion under way or interrupted
            continue
        try:
            name = json.loads(other.read_text(encoding="utf-8"))["policy"]["name"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        size = sum(f.stat().st_size for f in other.parent.iterdir() if f.is_file())
        log.warning("building the quantized cache of policy %r; the cache %s of policy %r (%.2f GiB) is left in "
                    "place (it still loads under its own policy; delete it to free the disk)", policy.name,
                    other.parent, name, size / 2**30)


def load_quantized(
    model_dir: str | Path,
    policy: QuantPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    cache_root: str | Path | None = None,
    verify: str = "header",
) -> tuple[nn.Module, CacheReport]:
    """The quantized model of ``model_dir`` whole on the CPU, through the cache (see :func:`ensure_cache`; no
    ``policy``: the CPU's default).

    Internal, as :func:`load_from_cache` is: engines are built by ``engine.api.Engine.load(precision="nf4")``
    (docs/loading.md), which places every tensor directly with :func:`load_from_cache`; this is for the tests of
    this layer and the benchmarks that compare the cache with another format."""
    report = ensure_cache(model_dir, policy, progress, cancel, cache_root, verify)
    model = load_from_cache(report.path, model_dir, dtype, progress, cancel)
    return model, report


class CacheDamaged(CheckpointError):
    """A cached tensor's bytes no longer match the checksum written with them."""


class CacheSource:
    """The cache's ``weights.safetensors`` as a placement source (``engine.placement.placer.TensorSource``): each tensor is
    read once, straight into the tensor placement allocated for it (in bounded chunks when it lives on a GPU or
    needs a dtype cast), with progress and cancel between chunks."""

    def __init__(
        self, data: Path, progress: Progress | None, cancel: threading.Event | None, crcs: dict[str, int] | None = None
    ) -> None:
        self.path = data
        self.crcs = crcs or {}
        self.header, _, _ = read_header(data)
        self.tracker = ProgressTracker(sum(h.nbytes for h in self.header.values()), progress, cancel, "reading")
        self.filled: set[str] = set()
        self.fd = os.open(data, os.O_RDONLY | O_BINARY)

    def close(self) -> None:
        os.close(self.fd)

    def _entry(self, name: str) -> SrcTensor:
        src = self.header.get(name)
        if src is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the cache")
        return src

    def dtype_of(self, name: str) -> torch.dtype:
        return DTYPES[self._entry(name).dtype][0]

    def fill(self, name: str, dst: Tensor) -> None:
        src = self._entry(name)
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(src.shape)}, the model expects {list(dst.shape)}"
            )
        self.tracker.check(f"loading {self.path.parent}")
        dtype, esize, _ = DTYPES[src.dtype]
        if dst.device.type == "cpu" and dst.dtype == dtype and dst.is_contiguous():
            read_into(self.fd, src, dst)  # straight into its place: no second copy
            crc = zlib.crc32(memoryview(dst.reshape(-1).view(torch.uint8).numpy())) if name in self.crcs else None
        else:
            crc = 0
            flat = dst.view(-1)
            per = max(1, CHUNK_BYTES // esize)
            numel = src.nbytes // esize
            for a in range(0, numel, per):
                self.tracker.check(f"loading {self.path.parent}")
                b = min(numel, a + per)
                buf = pread_all(self.fd, src.begin + a * esize, (b - a) * esize, f"{self.path}: tensor {name!r}")
                crc = zlib.crc32(buf, crc)
                flat[a:b].copy_(torch.frombuffer(buf, dtype=dtype))
        if name in self.crcs and crc != self.crcs[name]:
            raise CacheDamaged(f"{self.path}: tensor {name!r} changed since the cache was written (crc32 mismatch)")
        self.filled.add(name)
        self.tracker.advance(src.nbytes, name)

    def check_complete(self) -> None:
        unused = [k for k in self.header if k not in self.filled]
        if unused:
            raise CheckpointError(f"{self.path}: tensor {unused[0]!r} has no place in the model ({len(unused)} unused)")


def load_from_cache(
    cache_dir: str | Path,
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    plan: Any = None,
    device: torch.device | str = "cpu",
    rebuild_on_damage: bool = True,
    **place_options: Any,
) -> nn.Module:
    """Internal: what ``engine.api.Engine.load(precision="nf4")`` reads the cache with (docs/loading.md).

    Build a CloverModel from a (checked) cache: a skeleton with the quantized modules swapped in, then every
    tensor read once from the file straight into where ``plan`` puts it (``engine.placement.placer.place_model``; with no
    plan, everything on ``device``). Peak memory is the placed model plus one read chunk.

    Every tensor's bytes are checked against the crc32 written with the cache as they are read (~4 GB/s); a
    mismatch (a damaged file of the right size and header) is logged, the cache is rebuilt from the checkpoint and
    the model is read again, once."""

    cache_dir = Path(cache_dir)
    manifest = json.loads((cache_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    config = load_config(model_dir)
    tensors: dict[str, dict[str, Any]] = manifest["tensors"]
    extras = config.is_diffusion or any(".bd_history." in n or n.endswith("weight_right") for n in tensors)
    model = CloverModel(config, dtype=dtype, device="meta", clover_extras=extras)
    _adapt_extras(model, tensors)
    # swap quantized modules in (empty, on the meta device: placement allocates them where the plan says)
    for name, meta in tensors.items():
        if meta["format"] not in QUANT_FORMATS:
            continue
        bank = expert_bank_of(name)
        if bank is not None:
            if bank[1] == "gate_up_proj":
                lay = ExpertLayout.from_dict(manifest["experts"][bank[0]])
                set_submodule(model, bank[0], QuantExpertBank(lay, device="meta"))
            continue
        mod_name = name[: -len(".weight")]
        old = model.get_submodule(mod_name)
        if not isinstance(old, nn.Linear):
            raise CheckpointError(
                f"{cache_dir}: {name} is quantized but {mod_name} is a {type(old).__name__}, not a Linear"
            )
        policy_bs = int(manifest["policy"]["blocksize"])
        new = QuantLinear(
            old.in_features, old.out_features, meta["format"], policy_bs, bias=old.bias is not None, device="meta"
        )
        set_submodule(model, mod_name, new)
    if plan is None:  # everything on `device`, the embedding too
        plan = placer.SimplePlan(tuple(placer.expert_banks(model)), (), 0)
        place_options.setdefault("host_embedding", False)
    crcs = manifest.get("files", {}).get(DATA_NAME, {}).get("crc32")
    source = CacheSource(cache_dir / DATA_NAME, progress, cancel, crcs)
    try:
        placer.place_model(model, plan, device, source, **place_options)
        source.check_complete()
    except CacheDamaged as exc:
        if not rebuild_on_damage:
            raise
        log.warning("%s; rebuilding the quantized cache %s", exc, cache_dir)
        policy = QuantPolicy.from_dict({k: v for k, v in manifest["policy"].items() if k != "hash"})
        build_cache(model_dir, policy, cache_dir, progress, cancel)
        return load_from_cache(
            cache_dir, model_dir, dtype, progress, cancel, plan, device, rebuild_on_damage=False, **place_options
        )
    finally:
        source.close()
    if torch.device(device).type == "cpu":  # resident NF4 experts' and INT8 projections' rows interleaved for the CPU
        interleave_for_cpu(model)  # kernels, in memory (the files keep the order a GPU reads)
    if progress is not None:
        total = source.tracker.total
        progress(LoadProgress(stage="done", done_bytes=total, total_bytes=total))
    model.eval()
    return model


def _adapt_extras(model: nn.Module, tensors: dict[str, dict[str, Any]]) -> None:
    """Give the Clover GDN extras the cached shapes, and drop the ones the cache does not have."""

    params = dict(model.named_parameters())
    for name in list(params):
        if not checkpoint._is_extra(name):
            continue
        meta = tensors.get(name)
        if meta is None:
            checkpoint._drop_extra(model, name)
        elif tuple(meta["shape"]) != tuple(params[name].shape):
            entry = checkpoint.TensorEntry(name, Path(MANIFEST_NAME), "BF16", tuple(meta["shape"]), int(meta["bytes"]))
            checkpoint._adapt_extra(model, name, tuple(meta["shape"]), entry)
