"""Whether a download choice fits this machine: the disk of the target folder, and the card (or the RAM).

No Qt. The card side comes from the app (``clover_desk.downloads.run_fit``: the planner's count of the published
model under the choice's quantization, or, where the planner cannot count a file before it is on disk, what its
published size says); this module adds the disk, words it, and picks the default choice, as LM Studio's "full GPU
offload possible / partial offload / likely too large" badges do.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from clover_desk.engine.errors import CloverError

log = logging.getLogger(__name__)

BADGES = {
    "gpu": "full GPU offload",
    "partial": "partial offload",
    "ram": "runs from RAM",
    "unknown": "card fit counted once on disk",
    "over_budget": "partial offload at best (by size)",
    "too_large": "likely too large",
}
# How well a choice runs: the default is the best that also fits the disk (ties: the smaller download)
RANKS = {"gpu": 4, "partial": 3, "ram": 3, "unknown": 2, "over_budget": 2, "too_large": 0}


class RunFitLike(Protocol):
    """How a choice would run here (``clover_desk.downloads.RunFit``)."""

    place: str  # a key of BADGES
    disk_bytes: int | None
    text: str


def existing_parent(folder: str | Path) -> Path:
    """``folder``, or its nearest parent that exists (a download folder is made when the download starts)."""
    target = Path(folder).expanduser().absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    return target


def free_bytes(folder: str | Path) -> int | None:
    """Free bytes on the file system that will hold ``folder`` (None: it cannot be read)."""
    try:
        return shutil.disk_usage(existing_parent(folder)).free
    except OSError:
        return None


@dataclass(frozen=True)
class ChoiceFit:
    """One download choice against this machine: ``run`` from the app (None: no estimate), the target's free bytes."""

    run: RunFitLike | None
    free_bytes: int | None

    @property
    def fits_disk(self) -> bool | None:
        need = self.run.disk_bytes if self.run is not None else None
        if need is None or self.free_bytes is None:
            return None
        return need <= self.free_bytes

    def badge(self) -> str:
        """"partial offload · fits the disk": what the choice's item in the list adds to its name."""
        parts = [BADGES.get(self.run.place, self.run.place)] if self.run is not None else []
        if self.fits_disk is not None:
            parts.append("fits the disk" if self.fits_disk else "too big for the disk")
        return " · ".join(parts)

    def details(self) -> str:
        """The figures behind the badge: the card (or RAM) line, then the disk."""
        if self.run is None:
            return ""
        lines = [self.run.text]
        need = self.run.disk_bytes
        if need is not None and self.free_bytes is not None:
            verdict = "fits" if self.fits_disk else "does not fit"
            lines.append(f"Disk: needs {need / 1e9:.1f} GB, {self.free_bytes / 1e9:.1f} GB free there: {verdict}.")
        return "\n".join(lines)

    def rank(self) -> tuple[int, int, int]:
        place = RANKS.get(self.run.place, 0) if self.run is not None else 0
        return (self.fits_disk is not False, place, -(self.run.disk_bytes or 0) if self.run is not None else 0)


def choice_fits(estimate: Callable[[Any], RunFitLike], choices: Sequence[Any], free: int | None) -> list[ChoiceFit]:
    """Each choice as ``estimate`` judges it, with the free bytes of the download folder. A choice the planner
    refuses (e.g. a context over the model's limit) gets no badge, and the others still do."""
    fits = []
    for choice in choices:
        try:
            run: RunFitLike | None = estimate(choice)
        except CloverError as exc:
            log.warning("cannot judge the download %s: %s", choice, exc)
            run = None
        fits.append(ChoiceFit(run, free))
    return fits


def best_choice(fits: Sequence[ChoiceFit]) -> int:
    """The index of the choice to offer first: the best place that fits the disk; ties go to the smaller download,
    then to the earlier choice."""
    return max(range(len(fits)), key=lambda i: (fits[i].rank(), -i), default=0)
