"""Engine events survive the JSON round trip the worker process and ``--json`` use."""

from __future__ import annotations

import json

import pytest

from clover_desk.engine.decode.events import BlockStep, Finished, TextDelta, from_dict, to_dict


def test_round_trip_through_json() -> None:
    step = BlockStep(block_index=3, pass_index=1, tokens=(5, 9), texts=("a", "b"), masked=(False, True),
                     confidence=(0.99, 0.2), committed_now=(True, False), prompt_slots=0)
    fin = Finished(token_ids=(1, 2), text="hi", thinking="", stop_reason="eos", tokens=2, passes=3,
                   tokens_per_pass=0.67, tokens_per_s=10.0, time_to_first_token_s=0.1, prompt_tokens=4,
                   prefill_s=0.01, decode_s=0.2, accounting={"h2d_bytes": 7})
    for event in (step, fin, TextDelta("x", "thinking")):
        record = json.loads(json.dumps(to_dict(event)))
        assert from_dict(record) == event
    assert to_dict(fin)["event"] == "finished"


def test_unknown_event_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        from_dict({"event": "nope"})
