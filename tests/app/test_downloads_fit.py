"""How a download choice would run here, before a byte of it exists (clover_desk.downloads.run_fit): the planner's
count of the published shape under the choice's quantization, or what its published size says where no policy has
its bytes."""

from __future__ import annotations

import pytest

from clover_desk.downloads import OFFICIAL_GGUF, PLANNED_AS, RunFit, folder_disk_bytes, run_fit
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.hardware import Hardware

GIB = 1024**3
Q4_0, Q4_K_M, Q8_0 = OFFICIAL_GGUF
CARD_16 = Hardware(gpu_name="NVIDIA GeForce RTX 4080", vram_total_bytes=16 * GIB, ram_total_bytes=64 * GIB,
                   ram_available_bytes=48 * GIB)
NO_GPU = Hardware(gpu_name=None, ram_total_bytes=32 * GIB, ram_available_bytes=24 * GIB)


def test_the_folder_is_planned_as_the_cache_the_first_load_makes_and_counted_with_it_on_disk() -> None:
    fit = run_fit(None, 15 * GIB, 16384, CARD_16)
    plan = planner.plan_model(planner.SHAPE_PREFIX + "clover-35b-a3b", 15 * GIB, 16384, CARD_16)  # the app's plan
    assert fit.place == "partial"
    assert f"{len(plan.resident_expert_layers)} of 40 expert layers on the card" in fit.text
    stored = planner.manifest_for_shape("clover-35b-a3b", None).total_bytes()
    assert 69e9 < stored < 70e9  # "about 69 GB": the planner's count of the BF16 folder
    assert fit.disk_bytes == folder_disk_bytes() > stored + 20e9  # and the NF4 / INT8 cache beside it


def test_q4_0_is_planned_at_its_own_bits_a_weight_and_fits_a_24_gb_card_whole() -> None:
    policy = PLANNED_AS["Q4_0"]
    counted = planner.manifest_for_shape("clover-35b-a3b", policy).total_bytes()
    assert abs(counted - Q4_0.size) / Q4_0.size < 0.05  # the published file, within 5 %
    assert run_fit(Q4_0, 15 * GIB, 16384, CARD_16).place == "partial"
    whole = run_fit(Q4_0, 24 * GIB, 16384, CARD_16)
    assert whole.place == "gpu" and "all 40 expert layers on the card" in whole.text


def test_files_without_a_matching_policy_say_what_their_size_says_and_that_the_planner_has_not_counted() -> None:
    for choice in (Q4_K_M, Q8_0):
        fit = run_fit(choice, 15 * GIB, 16384, CARD_16)
        assert fit.place == "over_budget" and fit.disk_bytes == choice.size
        assert "the planner counts it once the file is on disk" in fit.text
    small_ram = Hardware(gpu_name="x", vram_total_bytes=16 * GIB, ram_total_bytes=16 * GIB, ram_available_bytes=8 * GIB)
    assert run_fit(Q8_0, 15 * GIB, 16384, small_ram).place == "too_large"  # more than the budget and RAM together
    assert run_fit(Q4_K_M, 40 * GIB, 16384, CARD_16).place == "unknown"  # within the budget: not claimed to fit


@pytest.mark.parametrize(("choice", "quantized", "place"), [
    (None, True, "ram"), (None, False, "too_large"), (Q4_0, True, "ram"), (Q4_0, False, "ram"), (Q4_K_M, True, "ram"),
    (Q8_0, True, "too_large"),
])
def test_without_a_gpu_the_weights_are_held_in_ram(choice, quantized, place) -> None:  # noqa: ANN001
    fit = run_fit(choice, None, 16384, NO_GPU, "fp32", quantized=quantized)
    assert isinstance(fit, RunFit) and fit.place == place and fit.text.startswith("No NVIDIA GPU")
    if choice is None and quantized:  # the quantized cache a CPU load of the folder makes (the planner's count)
        counted = planner.manifest_for_shape("clover-35b-a3b", planner.DEFAULT_POLICY).total_bytes()
        assert 20e9 < counted < 22e9 and f"{counted / 1e9:.1f} GB" in fit.text and "quantized cache" in fit.text
    elif choice is None:
        assert "138.7 GB" in fit.text  # unquantized in float32, as a CPU load with "4-bit weights" off holds it
    else:  # a GGUF file is held as stored, whatever the folder's choice
        assert fit == run_fit(choice, None, 16384, NO_GPU, "fp32", quantized=not quantized)
