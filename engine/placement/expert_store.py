"""Where streamed experts live on the host: one row store per streamed layer, the pin budget, the staging ring,
and zero-copy views of page-locked rows.

Streamed layers keep their quantized experts in host memory, ONE contiguous row per expert
(``engine.weights.quant.ExpertLayout``), so one copy fills one preallocated device slot
(``engine.placement.slot_pool``). Host rows are pinned when the device is CUDA; where pinning fails or its budget is
spent (Windows/WSL cap pinned memory), rows stay pageable and go through a small pinned staging ring.

Zero-copy: on CUDA the page-locked rows are mapped into the device's address space (:func:`in_place_view`), so a
routed compute gathers its rows over PCIe itself (``engine.placement.streamed_bank``).

Letters: E experts, R row bytes per expert.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GiB = 1024**3
WINDOWS_PIN_BUDGET = 2 * GiB  # pinned host memory a loaded process can usually get under WDDM; the rest is staged


class PinBudget:
    """How many more bytes may be page-locked (None: no cap). Pinning only happens for CUDA devices."""

    def __init__(self, limit_bytes: int | None) -> None:
        self.left = limit_bytes

    def take(self, nbytes: int) -> bool:
        if self.left is None:
            return True
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


class HostExpertStore:
    """One streamed layer's experts in host memory: ``rows`` uint8 [E, R], one contiguous row per expert
    (page-locked when ``pinned``; placement allocates and fills them, see :func:`alloc_host_rows`)."""

    def __init__(self, layer: int, rows: Tensor, pinned: bool) -> None:
        self.layer = layer
        self.rows = rows
        self.pinned = pinned

    def row(self, e: int) -> Tensor:
        return self.rows[e]

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


def alloc_host_rows(shape: tuple[int, int], pin: bool, budget: PinBudget, layer: int) -> tuple[Tensor, bool]:
    """Host memory for one streamed layer's expert rows: page-locked when asked and allowed, else pageable."""
    if pin and budget.take(math.prod(shape)):
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:  # pinning refused (driver cap, WSL) -> pageable + staging ring
            log.warning("layer %d: pinning %d MiB of experts failed (%s); using the staging ring", layer,
                        math.prod(shape) >> 20, exc)
    return torch.empty(shape, dtype=torch.uint8), False


class _MappedRows:
    """Page-locked host rows offered to torch as device memory (``__cuda_array_interface__``): under CUDA's unified
    addressing a page-locked buffer has the same address on the device as on the host. The tensor torch builds
    from it holds this object, and with it the host tensor, alive."""

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows
        self.__cuda_array_interface__ = {
            "shape": tuple(rows.shape),
            "typestr": "|u1",
            "data": (rows.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def in_place_view(rows: Tensor, device: torch.device) -> tuple[Tensor | None, str]:
    """A tensor on ``device`` whose bytes are host ``rows`` [E, R] uint8 where they lie (zero-copy), or None and why
    not. CPU: ``rows`` itself. CUDA: page-locked rows mapped into the device's address space, checked once: the view
    must be at the rows' own address (not a copy in VRAM) and read back the first and last row's first bytes."""
    if device.type == "cpu":
        return rows, ""
    if device.type != "cuda":
        return None, f"no zero-copy reads on {device.type}"
    if not rows.is_pinned():
        return None, "the rows are pageable (pinned memory was refused or its budget spent)"
    try:
        view = torch.as_tensor(_MappedRows(rows), device=device)
        probe = torch.tensor([0, rows.shape[0] - 1])
        n = min(64, rows.shape[1])
        seen = view[probe.to(device), :n].cpu()  # a sync, once per layer at placement
    except Exception as exc:  # noqa: BLE001 - any failure means: copy through the pool as before
        return None, f"mapping page-locked memory failed: {exc}"
    if view.device.type != "cuda" or view.data_ptr() != rows.data_ptr():
        return None, "torch copied the rows instead of mapping them"
    if not torch.equal(seen, rows[probe, :n]):
        return None, "reading the mapped rows through the device gave other bytes"
    return view, ""


class StagingRing:
    """A few pinned buffers of one row each: pageable rows are memcpy'd here first, then copied to the device.

    Pinned when the device is CUDA (``pin`` overrides); if even these few rows cannot be page-locked (a driver cap
    already spent, WSL), they stay pageable with a warning: copies are then synchronous, slower, never wrong."""

    def __init__(self, row_bytes: int, slots: int, device: torch.device, pin: bool | None = None) -> None:
        cuda = device.type == "cuda"
        self.pinned = cuda if pin is None else pin  # False once a pin was refused: the rest stay pageable
        self.buffers: list[Tensor] = []
        for _ in range(slots):
            if self.pinned:
                try:
                    self.buffers.append(torch.empty(row_bytes, dtype=torch.uint8, pin_memory=True))
                    continue
                except RuntimeError as exc:  # page-locked memory refused: pageable staging, no crash
                    log.warning("pinning %d staging rows of %d KiB failed (%s); staging in pageable memory",
                                slots, row_bytes >> 10, exc)
                    self.pinned = False
            self.buffers.append(torch.empty(row_bytes, dtype=torch.uint8))
        self.events: list[Any] = [torch.cuda.Event() if cuda else None for _ in range(slots)]
        self.next = 0

    def stage(self, row: Tensor) -> tuple[Tensor, int]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # the previous H2D copy out of this buffer has finished
        self.buffers[i].copy_(row)
        return self.buffers[i], i
