"""Decoding policy on scripted logits: commit rule, penalties, ramps, sampling, EOS cut, coreset."""

from __future__ import annotations

import pytest
import torch

from clover_desk.engine.decode import decoding


def _logits_with_probs(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    """Logits [T, V] whose softmax puts exactly the given probabilities on the given ids (rest spread evenly)."""
    out = torch.empty(len(rows), vocab)
    for r, wanted in enumerate(rows):
        rest = (1.0 - sum(wanted.values())) / (vocab - len(wanted))
        probs = torch.full((vocab,), rest)
        for tok, p in wanted.items():
            probs[tok] = p
        out[r] = probs.log()
    return out


# ---- commit rule -------------------------------------------------------------------------------------------------


def test_threshold_commits_every_masked_slot_strictly_above_threshold() -> None:
    logits = _logits_with_probs([{1: 0.99}, {2: 0.96}, {3: 0.90}, {4: 0.97}, {5: 0.999}])
    masked = torch.tensor([True, True, True, True, False])
    tokens, conf = decoding.propose(logits)
    commit = decoding.threshold_commit(conf, masked, 0.95)
    assert tokens.tolist() == [1, 2, 3, 4, 5]
    # slot 2 is below the threshold; slot 4 is not masked, so it is never committed again.
    assert commit.tolist() == [True, True, False, True, False]


def test_threshold_is_strict() -> None:
    conf = torch.tensor([0.5, 0.75, 0.6])
    commit = decoding.threshold_commit(conf, torch.tensor([True, True, True]), 0.5)
    assert commit.tolist() == [False, True, True]  # exactly at the threshold does not commit


def test_threshold_falls_back_to_the_single_most_confident_masked_slot() -> None:
    logits = _logits_with_probs([{1: 0.99}, {2: 0.30}, {3: 0.60}, {4: 0.50}])
    masked = torch.tensor([False, True, True, True])  # slot 0 is more confident but already committed
    _, conf = decoding.propose(logits)
    commit = decoding.threshold_commit(conf, masked, 0.95)
    assert commit.tolist() == [False, False, True, False]


def test_threshold_commit_without_masks_commits_nothing() -> None:
    commit = decoding.threshold_commit(torch.tensor([0.99, 0.99]), torch.tensor([False, False]), 0.5)
    assert not commit.any()


def test_confidence_is_fp32_softmax_even_for_bf16_logits() -> None:
    logits = _logits_with_probs([{6: 0.97}]).to(torch.bfloat16)
    tokens, conf = decoding.propose(logits)
    assert conf.dtype == torch.float32
    assert tokens.tolist() == [6]
    assert conf.item() == pytest.approx(0.97, abs=0.01)


def test_confidence_is_taken_on_penalized_logits() -> None:
    logits = _logits_with_probs([{1: 0.97}])
    seen = decoding.seen_mask([1], 8)
    penalized = decoding.apply_presence_penalty(logits, seen, 2.0)
    _, raw_conf = decoding.propose(logits)
    tok, conf = decoding.propose(penalized)
    assert raw_conf.item() > 0.95
    assert tok.item() == 1 and conf.item() < 0.95  # the penalty lowered the confidence below the threshold


# ---- penalties ---------------------------------------------------------------------------------------------------


def test_presence_penalty_subtracts_once_per_seen_id() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    seen = decoding.seen_mask([1, 2, 2, 99], 4)  # repeats count once; out-of-vocab ids are ignored
    out = decoding.apply_presence_penalty(logits, seen, 0.9)
    assert torch.allclose(out, torch.tensor([[1.0, 1.1, -1.9, 0.5]]))


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.1, -2.0, 3.0], [0.0, 1.05, -1.0]])
    seen = decoding.seen_mask([0, 1], 3)
    out = decoding.apply_repetition_penalty(logits, seen, 1.05)
    expected = torch.tensor([[2.0, -2.1, 3.0], [0.0, 1.0, -1.0]])
    assert torch.allclose(out, expected)


def test_penalties_are_no_ops_at_their_neutral_values() -> None:
    logits = torch.randn(3, 5)
    seen = decoding.seen_mask([0, 1, 2, 3, 4], 5)
    assert torch.equal(decoding.apply_repetition_penalty(logits, seen, 1.0), logits)
    assert torch.equal(decoding.apply_presence_penalty(logits, seen, 0.0), logits)


# ---- ramps -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "expected"), [(0, 0.0), (8192, 0.0), (8192 + 2048, 0.25), (16384, 1.0), (40000, 1.0)])
def test_ramp_is_zero_then_linear_then_one(n: int, expected: float) -> None:
    assert decoding.ramp(n, 8192, 8192) == pytest.approx(expected)


def test_length_penalty_lifts_eos_only_at_masked_slots() -> None:
    logits = torch.zeros(3, 6)
    masked = torch.tensor([True, False, True])
    out = decoding.apply_length_penalty(logits, masked, [4, 5], 10.0, n_generated=8192 + 4096, start=8192, window=8192)
    assert out[0, 4] == pytest.approx(5.0) and out[0, 5] == pytest.approx(5.0) and out[2, 4] == pytest.approx(5.0)
    assert out[1].abs().sum() == 0  # committed slot untouched
    assert out[:, :4].abs().sum() == 0  # other ids untouched
    before = decoding.apply_length_penalty(logits, masked, [4, 5], 10.0, n_generated=100, start=8192, window=8192)
    assert torch.equal(before, logits)


def test_think_end_bias_only_at_leftmost_masked_slot_and_only_while_thinking() -> None:
    logits = torch.zeros(4, 6)
    masked = torch.tensor([False, True, True, True])
    out = decoding.apply_think_end_bias(logits, masked, 3, 10.0, 4096 + 4096, 4096, 4096, thinking_open=True)
    assert out[1, 3] == pytest.approx(10.0)
    assert out.abs().sum() == pytest.approx(10.0)  # nowhere else
    closed = decoding.apply_think_end_bias(logits, masked, 3, 10.0, 10_000, 4096, 4096, thinking_open=False)
    assert torch.equal(closed, logits)
    early = decoding.apply_think_end_bias(logits, masked, 3, 10.0, 4000, 4096, 4096, thinking_open=True)
    assert torch.equal(early, logits)


def test_forbid_tokens_makes_an_id_unproposable() -> None:
    logits = _logits_with_probs([{2: 0.99}])
    tokens, _ = decoding.propose(decoding.forbid_tokens(logits, [2]))
    assert tokens.item() != 2


def test_shift_logits_moves_rows_down_and_uses_the_previous_row_for_slot_zero() -> None:
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    prev = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    out = decoding.shift_logits(logits, prev)
    assert torch.equal(out[0], prev) and torch.equal(out[1], logits[0]) and torch.equal(out[2], logits[1])


# ---- sampling ----------------------------------------------------------------------------------------------------


def test_greedy_ignores_temperature_when_not_sampling() -> None:
    logits = _logits_with_probs([{3: 0.4, 5: 0.35}])
    tok, conf = decoding.propose(logits, do_sample=False, temperature=5.0)
    assert tok.item() == 3 and conf.item() == pytest.approx(0.4, abs=1e-5)


def test_sampling_is_reproducible_with_a_seeded_generator() -> None:
    logits = torch.randn(16, 50)
    draws = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(1234)
        tok, _ = decoding.propose(logits, do_sample=True, temperature=1.0, generator=gen)
        draws.append(tok.tolist())
    assert draws[0] == draws[1]


def test_top_k_one_is_greedy_and_confidence_is_one() -> None:
    logits = torch.randn(8, 30)
    gen = torch.Generator().manual_seed(0)
    tok, conf = decoding.propose(logits, do_sample=True, temperature=0.7, top_k=1, generator=gen)
    assert tok.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(conf, torch.ones(8))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = _logits_with_probs([{0: 0.5, 1: 0.3, 2: 0.15}], vocab=6)  # ids 3..5 share 0.05
    kept = decoding.filter_top_k_top_p(logits, 0, 0.75)
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False, False, False]
    gen = torch.Generator().manual_seed(3)
    seen = {int(decoding.propose(logits, do_sample=True, top_p=0.75, generator=gen)[0]) for _ in range(50)}
    assert seen <= {0, 1} and seen == {0, 1}


def test_temperature_sharpens_the_distribution() -> None:
    logits = _logits_with_probs([{0: 0.6, 1: 0.39}], vocab=3)
    gen = torch.Generator().manual_seed(0)
    hits = sum(int(decoding.propose(logits, do_sample=True, temperature=0.05, generator=gen)[0]) == 0 for _ in range(40))
    assert hits == 40


# ---- stopping ----------------------------------------------------------------------------------------------------


def test_truncate_at_first_eos_keeps_the_eos() -> None:
    assert decoding.truncate_at_eos([5, 6, 2, 7, 0], [0, 2]) == ([5, 6, 2], True)
    assert decoding.truncate_at_eos([5, 6, 7], [0, 2]) == ([5, 6, 7], False)


def test_eos_resolved_needs_every_earlier_slot_committed() -> None:
    tokens = [9, 9, 4, 2, 4]
    assert decoding.eos_resolved(tokens, [False, False, False, False, True], 1, [2])
    assert not decoding.eos_resolved(tokens, [False, True, False, False, True], 1, [2])
    assert not decoding.eos_resolved([9, 4, 4], [False, False, False], 0, [2])


# ---- coreset -----------------------------------------------------------------------------------------------------


def test_block_coreset_is_the_smallest_prefix_covering_top_p() -> None:
    from clover_desk.engine.model.moe import block_coreset_topk

    probs = torch.tensor([[0.50, 0.30, 0.10, 0.10, 0.00], [0.60, 0.00, 0.20, 0.10, 0.10]])
    # top-2 mass per expert: e0 1.1, e1 0.3, e2 0.2 -> total 1.6; 0.9 of it is 1.44 -> {e0, e1, e2}
    _, idx = block_coreset_topk(probs, 2, 2, 0.9)
    assert set(idx.flatten().tolist()) <= {0, 1, 2}
    assert idx[0].tolist() == [0, 1] and idx[1].tolist() == [0, 2]
    _, idx = block_coreset_topk(probs, 2, 2, 0.5)  # e0 alone covers 0.5, but a coreset keeps at least k = 2
    assert set(idx.flatten().tolist()) == {0, 1} and idx[1].tolist() == [0, 1]


@pytest.mark.parametrize("restrict", ["R-a", "R-b"])
def test_a_block_whose_router_rows_agree_still_routes_every_token_to_k_experts(restrict: str) -> None:
    from clover_desk.engine.model.moe import block_coreset_topk

    e, k, block = 64, 8, 32
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(block, e, generator=gen)
    logits[:, 5] += 12.0  # every row puts ~all its mass on expert 5: a 90 % coreset would be {5}
    w, idx = block_coreset_topk(torch.softmax(logits, -1), block, k, 0.9, restrict)
    assert len(set(idx.flatten().tolist())) >= k  # the coreset keeps at least k experts
    if restrict == "R-a":  # re-routing inside it: every token keeps k distinct, weighted experts
        for row_w, row_i in zip(w, idx):
            assert len(set(row_i.tolist())) == k and bool((row_w > 0).all())


# ---------------------------------------------------------------------------------------------------------------
# the device-side helpers of the denoising policy, against their plain-Python statements


def _thinking_reference(at_entry: bool, tokens: list[int], start_id: int, end_id: int) -> bool:
    state = at_entry
    for tok in tokens:
        if tok == end_id:
            state = False
        elif tok == start_id:
            state = True
    return state


def _limit_reference(tokens: list[int], start: int, needed: int, eos: set[int]) -> int:
    return next((i for i in range(start, needed) if tokens[i] in eos), needed)


def test_device_policy_helpers_equal_their_plain_statements() -> None:
    from clover_desk.engine.decode.decoding import output_limit, seen_mask_of, thinking_open_in

    gen = torch.Generator().manual_seed(7)
    for trial in range(300):
        n = int(torch.randint(0, 10, (1,), generator=gen))
        tokens = torch.randint(0, 8, (n,), generator=gen)
        as_list = tokens.tolist()
        at_entry = bool(trial % 2)
        assert bool(thinking_open_in(tokens, at_entry, 5, 4)) == _thinking_reference(at_entry, as_list, 5, 4)
        assert bool(thinking_open_in(tokens, at_entry, None, None)) == at_entry
        if n:
            start = int(torch.randint(0, n, (1,), generator=gen))
            needed = int(torch.randint(start, n + 1, (1,), generator=gen))
            assert int(output_limit(tokens, start, needed, (1, 2))) == _limit_reference(as_list, start, needed, {1, 2})
        seen = seen_mask_of(tokens, 8, skip_id=3)
        assert seen.tolist() == [i in set(as_list) - {3} for i in range(8)]


def test_threshold_commit_is_strictly_greater_and_falls_back_to_one_slot() -> None:
    conf = torch.tensor([0.95, 0.96, 0.5, 0.99])
    masked = torch.tensor([True, True, True, False])
    assert decoding.threshold_commit(conf, masked, 0.95).tolist() == [False, True, False, False]  # 0.95 is not above 0.95
    assert decoding.threshold_commit(conf, masked, 0.97).tolist() == [False, True, False, False]  # fallback: best masked
    assert decoding.threshold_commit(conf, torch.zeros(4, dtype=torch.bool), 0.5).tolist() == [False] * 4


def test_the_policy_changes_only_its_own_copies_and_the_same_values_as_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The biases after the penalties change the penalized tensor in place (one [B, V] copy less each); the logits
    the loop hands in stay as they were, and every output equals the copying path's bit for bit."""
    from clover_desk.engine.decode.diffusion import denoise_policy
    from clover_desk.engine.decode.loop_parts import penalize
    from clover_desk.engine.decode.settings import DecodeSettings

    v, b, mask = 64, 8, 63
    gen = torch.Generator().manual_seed(0)
    seen = (torch.rand(v, generator=gen) < 0.3, torch.rand(v, generator=gen) < 0.2)
    x = torch.full((b,), mask)
    x[:2] = torch.tensor([3, 10])
    for penalties in ({}, {"repetition_penalty": 1.05, "presence_penalty": 0.9}):
        s = DecodeSettings(mode="diffusion", max_new_tokens=64, block_size=b, threshold=0.95, mask_token_id=mask,
                           eos_token_ids=(5, 6), max_positions=256, shift_logits=False, length_penalty=10.0,
                           length_penalty_start=0, length_penalty_window=8, think_end_bias=10.0,
                           think_end_bias_start=0, think_end_bias_window=0, think_end_id=10, think_start_id=11,
                           **penalties)
        logits = torch.randn(b, v, generator=gen)
        before = logits.clone()
        row = penalize(logits[-1:], s, *seen)  # the AR loop's call: without penalties, forbid_tokens copies
        assert torch.equal(logits, before) and row is not logits[-1:]
        args = dict(start=2, seen=seen, n_at_entry=20, thinking_at_entry=True)
        got = denoise_policy(logits, x, torch.zeros(b), s, **args)
        assert torch.equal(logits, before)
        with monkeypatch.context() as m:
            for name in ("forbid_tokens", "apply_length_penalty", "apply_think_end_bias"):
                plain = getattr(decoding, name)
                m.setattr(decoding, name, lambda *a, plain=plain, **k: plain(*a, **{**k, "inplace": False}))
            want = denoise_policy(logits, x, torch.zeros(b), s, **args)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert got[3].any()  # something was committed: the comparison saw real values


def test_the_greedy_policy_on_the_open_rows_only_gives_the_full_policys_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the host's ``still`` (which slots are masks), greedy proposals are made for those rows only (a later
    pass's policy touches a fraction of the [B, V] logits): x, confidences, what the view shows and the commits equal
    the all-rows policy's bit for bit, with the penalties, the length bias, the think-end bias on the left-most open
    slot, an EOS committed in the block, and a block whose every slot is open."""
    from clover_desk.engine.decode.diffusion import denoise_policy
    from clover_desk.engine.decode.settings import DecodeSettings

    v, b, mask = 4096, 16, 4095
    gen = torch.Generator().manual_seed(1)
    seen = (torch.rand(v, generator=gen) < 0.3, torch.rand(v, generator=gen) < 0.2)
    s = DecodeSettings(mode="diffusion", max_new_tokens=64, block_size=b, threshold=0.3, mask_token_id=mask,
                       eos_token_ids=(5, 6), max_positions=256, shift_logits=False, length_penalty=10.0,
                       length_penalty_start=0, length_penalty_window=8, think_end_bias=10.0, think_end_bias_start=0,
                       think_end_bias_window=0, think_end_id=10, think_start_id=11, repetition_penalty=1.05,
                       presence_penalty=0.9)
    cases = [[3, 10, mask, 7, mask, mask, 9, mask] + [mask] * 8, [mask] * b,
             [mask, 5, mask, mask] + [8] * 10 + [mask, mask], [mask] + [4] * 15]
    rows: list[int] = []  # the rows each proposal was made for
    real = decoding.propose
    monkeypatch.setattr(decoding, "propose", lambda logits, **k: rows.append(logits.shape[0]) or real(logits, **k))
    for tokens in cases:
        x = torch.tensor(tokens)
        logits = torch.randn(b, v, generator=gen) * 4
        conf = torch.where(x == mask, 0.0, 0.9)
        args = dict(start=2, seen=seen, n_at_entry=20, thinking_at_entry=True)
        want = denoise_policy(logits, x, conf, s, **args)
        got = denoise_policy(logits, x, conf, s, **args, still=[t == mask for t in tokens])
        assert all(torch.equal(g, w) for g, w in zip(got, want)), tokens
        assert want[3].any()  # something was committed
        assert rows[-2:] == [b, tokens.count(mask)]
