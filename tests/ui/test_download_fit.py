"""ui.download_fit: a choice's badge and figures, and the default choice (no Qt)."""

from __future__ import annotations

from clover_desk.downloads import RunFit
from clover_desk.engine.errors import PlanError
from clover_desk.ui.download_fit import ChoiceFit, best_choice, choice_fits, existing_parent, free_bytes


def fit(place: str, disk: int | None, free: int | None = 100) -> ChoiceFit:
    return ChoiceFit(RunFit(place, disk, f"{place} line"), free)


def test_badge_and_details_name_the_card_and_the_disk() -> None:
    assert fit("partial", 50).badge() == "partial offload · fits the disk"
    assert fit("gpu", 150).badge() == "full GPU offload · too big for the disk"
    assert fit("ram", None).badge() == "runs from RAM"  # size not published: no disk claim
    assert fit("gpu", 150).details() == "gpu line\nDisk: needs 0.0 GB, 0.0 GB free there: does not fit."
    assert ChoiceFit(None, 100).badge() == "" and ChoiceFit(None, 100).details() == ""
    assert fit("gpu", 50, None).fits_disk is None


def test_the_default_is_the_best_place_that_fits_the_disk_then_the_smaller_download() -> None:
    assert best_choice([fit("partial", 90), fit("partial", 20), fit("over_budget", 23)]) == 1
    assert best_choice([fit("gpu", 150), fit("partial", 20)]) == 1  # the disk first
    assert best_choice([fit("gpu", 90), fit("partial", 20)]) == 0  # then how it runs
    assert best_choice([fit("too_large", 10), fit("over_budget", 40)]) == 1
    assert best_choice([fit("ram", 20), fit("ram", 20)]) == 0  # ties: the first
    assert best_choice([]) == 0


def test_free_bytes_of_a_folder_not_made_yet(tmp_path) -> None:  # noqa: ANN001
    assert existing_parent(tmp_path / "a" / "b") == tmp_path
    assert free_bytes(tmp_path / "a" / "b") is not None


def test_a_choice_the_planner_refuses_gets_no_badge_and_the_others_still_do() -> None:
    def estimate(choice):  # noqa: ANN001, ANN202
        if choice == "long context":
            raise PlanError("context 300,000 tokens is over the model's limit")
        return RunFit("gpu", 10, "line")

    refused, fine = choice_fits(estimate, ["long context", "q4"], 100)
    assert refused.run is None and refused.badge() == "" and fine.badge() == "full GPU offload · fits the disk"
