"""The plan's contract as the tests pin it: restated here, not imported from the planner, so that a change to it
fails a test (shared by tests/engine/test_planner.py, tests/app/test_cmd_plan.py and tests/engine/test_one_plan.py)."""

from __future__ import annotations

# where the experts go and what it costs: every place a plan is shown or used agrees on these
PLACEMENT_KEYS = (
    "resident_expert_layers",
    "streamed_expert_layers",
    "slot_pool_experts",
    "vram_used_bytes",
    "vram_breakdown",
    "ram_bytes",
    "fits",
)
# a plan's JSON (``clover-desk plan --json``, ``Plan.to_dict``)
CONTRACT_KEYS = {*PLACEMENT_KEYS, "reason", "min_vram_bytes", "predicted_tok_s", "assumptions"}
BREAKDOWN_KEYS = {"non_expert", "resident_experts", "expert_slots", "kv_cache", "gdn_state", "workspace", "reserve"}
