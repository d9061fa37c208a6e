"""Model internals on tiny random weights: GDN forms, block mode, Clover extras, cache semantics, MoE."""

from __future__ import annotations

import logging

import pytest
import torch

from clover_desk.engine.model.experts import DenseExpertBank
from clover_desk.engine.model.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from clover_desk.engine.model.moe import block_coreset_topk
from clover_desk.engine.weights.checkpoint import model_from_state_dict, random_state_dict
from tests.helpers_model import BLOCK, greedy, one_thread, tiny_config, tiny_model

_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

GEN = torch.Generator().manual_seed(1234)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(seed))


def _state_inputs(t: int, h: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1).to(dtype) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1).to(dtype)
    v = torch.randn(t, h, dv, generator=g).to(dtype)
    decay = (-torch.rand(t, h, generator=g) * 0.5).to(dtype)
    beta = torch.rand(t, h, generator=g).to(dtype)
    s0 = torch.randn(h, dk, dv, generator=g).to(dtype) * 0.1
    return q, k, v, decay, beta, s0


# ---------------------------------------------------------------------------------------------------------------
# gated delta rule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 5, 31])
def test_chunked_and_recurrent_delta_rule_agree(offset: int) -> None:
    q, k, v, g, beta, s0 = _state_inputs(70, 3, 16, 8, torch.float64)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=32, offset=offset)
    assert torch.allclose(o_chk, o_rec, atol=1e-12, rtol=0)
    assert torch.allclose(s_chk, s_rec, atol=1e-12, rtol=0)
    q, k, v, g, beta, s0 = (x.float() for x in (q, k, v, g, beta, s0))
    o32, s32 = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=32, offset=offset)
    assert (o32.double() - o_rec).abs().max() < 1e-5
    assert (s32.double() - s_rec).abs().max() < 1e-5


def test_state_at_every_chunk_boundary_is_exact() -> None:
    q, k, v, g, beta, s0 = _state_inputs(64, 2, 8, 8, torch.float64, seed=1)
    _, s_first = recurrent_gated_delta_rule(q[:32], k[:32], v[:32], g[:32], beta[:32], s0)
    _, s_chunk = chunk_gated_delta_rule(q[:32], k[:32], v[:32], g[:32], beta[:32], s0, chunk=32)
    o_rest, s_all = chunk_gated_delta_rule(q[32:], k[32:], v[32:], g[32:], beta[32:], s_chunk, chunk=32)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.allclose(s_chunk, s_first, atol=1e-12)
    assert torch.allclose(o_rest, o_ref[32:], atol=1e-12)
    assert torch.allclose(s_all, s_ref, atol=1e-12)


@pytest.mark.parametrize("t", [20, 70])
def test_a_scan_without_the_final_state_gives_the_same_starts_and_values(t: int) -> None:
    """A pass that writes no cache skips the last chunk's state update: every chunk start and corrected value
    keeps its bits (one chunk: a block pass; three: the earlier chunks' updates still run)."""
    from clover_desk.engine.model.gdn import chunk_prepare, chunk_scan

    q, k, v, g, beta, s0 = _state_inputs(t, 3, 16, 8, torch.float32, seed=2)
    ch = chunk_prepare(q, k, v, g, beta, 32, 5)
    starts, corrected, final = chunk_scan(ch, s0)
    starts_ro, corrected_ro, none = chunk_scan(ch, s0, final=False)
    assert none is None and final is not None
    assert torch.equal(starts, starts_ro) and torch.equal(corrected, corrected_ro)


# ---------------------------------------------------------------------------------------------------------------
# causal model: prefill vs steps
# ---------------------------------------------------------------------------------------------------------------


def test_prefill_equals_token_by_token_steps() -> None:
    model = tiny_model(tiny_config("qwen3_5_moe_text"), seed=1)
    ids = _ids(40)
    full = model(ids)
    cache = model.new_cache(64)
    first = model(ids[:7], 0, cache)
    steps = [model(ids[i : i + 1], i, cache) for i in range(7, 40)]
    assert cache.length == 40
    assert (torch.cat([first, *steps]) - full).abs().max() < 1e-4
    # greedy decoding actually exercises the vocabulary
    assert len(set(greedy(model, ids[:10], 12))) > 2


def test_last_only_returns_the_last_row() -> None:
    model = tiny_model(tiny_config("qwen3_5_moe_text"), seed=1)
    ids = _ids(12)
    assert torch.allclose(model(ids, last_only=True), model(ids)[-1:], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# block mode
# ---------------------------------------------------------------------------------------------------------------


def _neutral_config(**kw):
    return tiny_config("clover_moe", bd_history_form="history_only", moe_block_coreset_enabled=False, **kw)


@pytest.mark.parametrize("form", ["history_only", "F1"])
def test_block_mode_with_neutral_extras_and_causal_attention_is_the_causal_model(form: str) -> None:
    # neutral weights: right conv 0, history logit +1e4 (so F1 puts all weight on the causal GDN output)
    cfg = _neutral_config().with_overrides(bd_history_form=form)
    model = tiny_model(cfg, seed=2, clover_extras="neutral")
    ids = _ids(5 * BLOCK + 3, seed=1)
    causal = model(ids)
    cache = model.new_cache(64)
    block = model(ids, 0, cache, block_size=BLOCK, causal_inside_block=True)
    assert (block - causal).abs().max() < 1e-4
    # the same, block by block through the cache
    cache2 = model.new_cache(64)
    rows = [
        model(ids[s : s + BLOCK], s, cache2, block_size=BLOCK, causal_inside_block=True)
        for s in range(0, ids.numel(), BLOCK)
    ]
    assert (torch.cat(rows) - causal).abs().max() < 1e-4
    # bidirectional attention inside blocks does change things (the switch is real)
    assert (model(ids, 0, None, block_size=BLOCK) - causal).abs().max() > 1e-3


def test_missing_extras_behave_neutral(caplog: pytest.LogCaptureFixture) -> None:
    cfg = tiny_config("clover_moe", moe_block_coreset_enabled=False)
    sd = random_state_dict(cfg, seed=3, clover_extras=False)
    with caplog.at_level(logging.INFO, logger="clover_desk.engine.weights.checkpoint"):
        model = model_from_state_dict(cfg, sd)
    assert any("no Clover block-mode tensors" in r.message for r in caplog.records)
    assert not model.layers[0].linear_attn.has_extras()
    ids = _ids(3 * BLOCK, seed=2)
    assert (model(ids, block_size=BLOCK, causal_inside_block=True) - model(ids)).abs().max() < 1e-4


def test_multi_block_prefill_equals_block_by_block_commits() -> None:
    model = tiny_model(tiny_config("clover_moe"), seed=4)  # non-neutral extras, coreset on
    ids = _ids(4 * BLOCK, seed=3)
    c1 = model.new_cache(64)
    together = model(ids, 0, c1, block_size=BLOCK)
    c2 = model.new_cache(64)
    rows = [model(ids[s : s + BLOCK], s, c2, block_size=BLOCK) for s in range(0, ids.numel(), BLOCK)]
    assert (torch.cat(rows) - together).abs().max() < 1e-4
    assert c1.length == c2.length == ids.numel()
    for a, b in zip(c1.tensors(), c2.tensors()):
        assert (a.float() - b.float()).abs().max() < 1e-4


def test_read_only_pass_leaves_cache_bit_identical_and_matches_the_commit_pass() -> None:
    model = tiny_model(tiny_config("clover_moe"), seed=5)
    ids = _ids(3 * BLOCK, seed=4)
    cache = model.new_cache(64)
    model(ids[: 2 * BLOCK], 0, cache, block_size=BLOCK, prefill=True)
    before = cache.clone()
    denoise = model(ids[2 * BLOCK :], 2 * BLOCK, cache, block_size=BLOCK, write_cache=False)
    assert cache.length == before.length == 2 * BLOCK
    for a, b in zip(cache.tensors(), before.tensors()):
        assert torch.equal(a, b)
    commit = model(ids[2 * BLOCK :], 2 * BLOCK, cache, block_size=BLOCK, write_cache=True)
    assert torch.equal(denoise, commit)
    assert cache.length == 3 * BLOCK
    assert any(not torch.equal(a, b) for a, b in zip(cache.tensors(), before.tensors()))


def test_partial_last_block_runs_and_matches_its_prefix_in_a_full_block() -> None:
    cfg = tiny_config("clover_moe", moe_block_coreset_enabled=False, bd_len_mode="block")
    model = tiny_model(cfg, seed=6)
    ids = _ids(BLOCK + 3, seed=5)
    out = model(ids, 0, model.new_cache(64), block_size=BLOCK)
    assert out.shape == (BLOCK + 3, 257) and torch.isfinite(out).all()


def test_a_block_never_sees_the_next_block() -> None:
    model = tiny_model(tiny_config("clover_moe", moe_block_coreset_enabled=False), seed=7)
    a = _ids(3 * BLOCK, seed=6)
    b = a.clone()
    b[2 * BLOCK :] = (b[2 * BLOCK :] + 1) % 257
    la = model(a, 0, None, block_size=BLOCK)
    lb = model(b, 0, None, block_size=BLOCK)
    assert (la[: 2 * BLOCK] - lb[: 2 * BLOCK]).abs().max() < 1e-5  # float noise only (expert grouping)
    assert (la[2 * BLOCK :] - lb[2 * BLOCK :]).abs().max() > 1e-3
    # and the right conv itself stops at the block end, while it does look right inside the block
    gdn = model.layers[0].linear_attn
    x = torch.randn(2 * BLOCK, gdn.conv_dim, generator=GEN)
    y = x.clone()
    y[BLOCK:] += 1.0
    rx, ry = gdn._right_conv(x, BLOCK), gdn._right_conv(y, BLOCK)
    assert torch.equal(rx[:BLOCK], ry[:BLOCK])
    z = x.clone()
    z[BLOCK - 1] += 1.0  # last token of block 0 is right context for the tokens before it
    assert not torch.equal(gdn._right_conv(z, BLOCK)[: BLOCK - 1], rx[: BLOCK - 1])


VARIANTS = [
    {"bd_history_form": "F1"},
    {"bd_history_form": "F2"},
    {"bd_right_conv_taps": "R2"},
    {"bd_right_conv_taps": "R3"},
    {"bd_right_conv_taps": "R4"},
    {"bd_right_conv_join": "B"},
    {"bd_right_conv_join": "C"},
    {"bd_logit_scale_mode": "temperature"},
    {"bd_len_mode": "tokens"},
    {"bd_right_conv_in_state": False},
]


def test_every_clover_variant_runs_and_the_extras_change_the_output() -> None:
    base = tiny_config("clover_moe", moe_block_coreset_enabled=False)
    sd = random_state_dict(base, seed=8)
    neutral_sd = dict(sd)
    for name in sd:
        if name.endswith("weight_right"):
            neutral_sd[name] = torch.zeros_like(sd[name])
    ids = _ids(2 * BLOCK + 5, seed=7)
    neutral = model_from_state_dict(base.with_overrides(bd_history_form="history_only"), neutral_sd)
    ref = neutral(ids, 0, neutral.new_cache(64), block_size=BLOCK)
    outs = []
    for variant in VARIANTS:
        model = model_from_state_dict(base.with_overrides(**variant), sd)
        cache = model.new_cache(64)
        out = model(ids, 0, cache, block_size=BLOCK)
        assert torch.isfinite(out).all(), variant
        assert (out - ref).abs().max() > 1e-3, variant
        outs.append(out)
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert (outs[i] - outs[j]).abs().max() > 1e-6, (VARIANTS[i], VARIANTS[j])


def test_right_branch_out_of_state_changes_only_the_committed_state() -> None:
    base = tiny_config("clover_moe", moe_block_coreset_enabled=False)
    sd = random_state_dict(base, seed=9)
    ids = _ids(2 * BLOCK, seed=8)
    m_in = model_from_state_dict(base, sd)
    m_out = model_from_state_dict(base.with_overrides(bd_right_conv_in_state=False), sd)
    c_in, c_out = m_in.new_cache(64), m_out.new_cache(64)
    first_in = m_in(ids[:BLOCK], 0, c_in, block_size=BLOCK)
    first_out = m_out(ids[:BLOCK], 0, c_out, block_size=BLOCK)
    assert (first_in - first_out).abs().max() < 1e-5  # the first block's outputs do not depend on the switch
    assert (c_in.state[0] - c_out.state[0]).abs().max() > 1e-4  # its committed state does


@pytest.mark.parametrize(
    "shape_name", ["shared", "per_head_q", "per_head_const"]
)
def test_alternative_history_shapes_load_and_run(shape_name: str) -> None:
    cfg = tiny_config("clover_moe", moe_block_coreset_enabled=False)
    sd = random_state_dict(cfg, seed=10)
    hv, d, dk = cfg.linear_num_value_heads, cfg.hidden_size, cfg.linear_key_head_dim
    shape = {"shared": (1, d), "per_head_q": (hv, dk), "per_head_const": (hv,)}[shape_name]
    for name in list(sd):
        if name.endswith("bd_history.weight"):
            sd[name] = torch.randn(shape, generator=GEN)
    model = model_from_state_dict(cfg, sd)
    assert tuple(model.layers[0].linear_attn.bd_history.weight.shape) == shape
    out = model(_ids(2 * BLOCK), 0, None, block_size=BLOCK)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------


def _naive_experts(bank: DenseExpertBank, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = bank.intermediate_size
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate = bank.gate_up_proj[e, :inter] @ x[t]
            up = bank.gate_up_proj[e, inter:] @ x[t]
            out[t] += w[t, j] * (bank.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_dense_bank_equals_a_per_token_reference() -> None:
    bank = DenseExpertBank(16, 32, 24)
    with torch.no_grad():
        bank.gate_up_proj.normal_(generator=GEN)
        bank.down_proj.normal_(generator=GEN)
    x = torch.randn(11, 32, generator=GEN)
    w, idx = torch.softmax(torch.randn(11, 16, generator=GEN), -1).topk(4)
    idx[3] = torch.tensor([5, 5, 1, 2])  # duplicate expert within a token
    assert torch.allclose(bank(x, idx, w), _naive_experts(bank, x, idx, w), atol=1e-4, rtol=1e-4)


def _naive_coreset(probs: torch.Tensor, k: int, top_p: float) -> set[int]:
    mass = torch.zeros(probs.shape[1], dtype=torch.float64)
    v, i = probs.topk(k)
    for t in range(probs.shape[0]):
        for j in range(k):
            mass[int(i[t, j])] += float(v[t, j])
    order = sorted(range(len(mass)), key=lambda e: -float(mass[e]))
    total, acc, chosen = float(mass.sum()), 0.0, []
    for e in order:
        chosen.append(e)
        acc += float(mass[e])
        if acc / total >= top_p and len(chosen) >= k:  # covers top_p, and never fewer than k experts
            break
    return set(chosen)


@pytest.mark.parametrize("restrict", ["R-a", "R-b"])
def test_block_coreset_restricts_each_block_to_its_coreset(restrict: str) -> None:
    probs = torch.softmax(torch.randn(2 * BLOCK + 3, 16, generator=GEN) * 2.0, -1)
    w, idx = block_coreset_topk(probs, BLOCK, 4, 0.6, restrict)
    assert torch.allclose(w.sum(-1), torch.ones(w.shape[0]), atol=1e-6)
    for s in range(0, probs.shape[0], BLOCK):
        core = _naive_coreset(probs[s : s + BLOCK], 4, 0.6)
        used = set(idx[s : s + BLOCK][w[s : s + BLOCK] > 0].tolist()) | set(idx[s : s + BLOCK].flatten().tolist())
        assert used <= core
        assert len(core) < 16
    if restrict == "R-a":  # each token: its best experts inside the coreset, renormalized
        t0 = probs[0].clone()
        core = _naive_coreset(probs[:BLOCK], 4, 0.6)
        t0[[e for e in range(16) if e not in core]] = 0
        ref_w, ref_i = t0.topk(min(4, len(core)))
        assert set(idx[0][w[0] > 0].tolist()) == set(ref_i.tolist())


def test_model_applies_the_coreset_in_block_mode_only() -> None:
    cfg = tiny_config("clover_moe", moe_block_coreset_enabled=True, moe_block_coreset_top_p=0.5)
    model = tiny_model(cfg, seed=11)
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out.detach().clone()))
    ids = _ids(2 * BLOCK, seed=9)
    model(ids, 0, None, block_size=BLOCK)
    for i, layer in enumerate(model.layers):
        probs = torch.softmax(seen[i].float(), -1)
        for s in (0, BLOCK):
            core = _naive_coreset(probs[s : s + BLOCK], cfg.num_experts_per_tok, 0.5)
            assert set(layer.mlp.last_topk_idx[s : s + BLOCK].flatten().tolist()) <= core
    # causal mode and the prompt prefill (coreset_in_prefill False) route with plain top-k
    model(ids, 0, None, block_size=BLOCK, prefill=True)
    plain = torch.softmax(seen[0].float(), -1).topk(cfg.num_experts_per_tok).indices
    assert torch.equal(model.layers[0].mlp.last_topk_idx, plain)


class _RecordingBank(DenseExpertBank):
    needs_prepare = True  # as a streamed bank

    def __init__(self, other: DenseExpertBank) -> None:
        super().__init__(other.num_experts, other.hidden_size, other.intermediate_size)
        self.gate_up_proj, self.down_proj = other.gate_up_proj, other.down_proj
        self.prepared: list[list[int]] = []

    def prepare(self, expert_ids: torch.Tensor) -> None:
        self.prepared.append(expert_ids.tolist())


def test_bank_prepare_sees_the_experts_before_the_bank_runs() -> None:
    model = tiny_model(tiny_config("qwen3_5_moe_text"), seed=12)
    mlp = model.layers[1].mlp
    mlp.experts = _RecordingBank(mlp.experts)
    model(_ids(9))
    assert mlp.experts.prepared == [sorted(set(mlp.last_topk_idx.flatten().tolist()))]


def test_resident_banks_are_not_prepared() -> None:
    """prepare() costs a host sync (the distinct experts go to the CPU): only banks that stream are asked."""
    model = tiny_model(tiny_config("qwen3_5_moe_text"), seed=12)
    mlp = model.layers[1].mlp
    bank = _RecordingBank(mlp.experts)
    bank.needs_prepare = False
    mlp.experts = bank
    model(_ids(9))
    assert bank.prepared == []


@pytest.mark.parametrize("block_size", [None, BLOCK])
def test_long_cached_pass_is_split_into_segments_with_the_same_result(block_size: int | None) -> None:
    model = tiny_model(tiny_config("clover_moe"), seed=13)
    ids = _ids(6 * BLOCK + 3, seed=10)
    c1 = model.new_cache(64)
    whole = model(ids, 0, c1, block_size=block_size)
    model.max_pass_tokens = 2 * BLOCK  # (causal segments round up to one 32-token chunk)
    c2 = model.new_cache(64)
    split = model(ids, 0, c2, block_size=block_size)
    assert (whole - split).abs().max() < 1e-4
    assert c2.length == ids.numel()
    assert (c1.state[0] - c2.state[0]).abs().max() < 1e-4
    c3 = model.new_cache(64)
    assert (model(ids, 0, c3, block_size=block_size, last_only=True) - whole[-1:]).abs().max() < 1e-4


def test_a_prefill_over_many_blocks_holds_no_mask_of_its_keys() -> None:
    """A block-mode pass over many blocks after a long cache attends a block of rows at a time, each reading the keys
    up to its own end (engine.model.attention_by_rows): its scratch does not grow with the context. A [T, S] mask
    (bool, and repeated for the folded heads) grew by T bytes per key, and on a GPU SDPA made a padded bf16 bias of
    it: ~280 MB for a 416-token prefill segment at a 16K context with the 35B's heads."""
    from clover_desk.bench.count import _forward_ops

    model = tiny_model(tiny_config("clover_moe"), seed=13)
    t = 8 * BLOCK
    ids = _ids(t, seed=4)

    def scratch(ctx: int) -> int:
        cache = model.new_cache(ctx)

        def segment() -> None:
            cache.length = ctx - t  # a long prompt already in the cache (zeros: the shapes set the bytes)
            model(ids, ctx - t, cache, block_size=BLOCK, write_cache=True, last_only=True, prefill=True)

        with torch.inference_mode():
            return _forward_ops(segment)["scratch"]

    short, long = scratch(1024), scratch(8192)
    assert long - short < t * (8192 - 1024) // 8, (short, long)


def test_attention_by_rows_is_the_masked_attention() -> None:
    """Each group of rows against its key prefix (and its slice of a causal mask) == one call over all keys under
    the whole mask, for block-causal and causal passes after cached keys, with query heads folded per KV head."""
    from clover_desk.engine.model.attention import attention_by_rows
    from clover_desk.engine.model.cache import PassContext
    from clover_desk.engine.model.clover import CloverModel

    gen = torch.Generator().manual_seed(3)
    hkv, g, hd, start, t = 2, 3, 16, 64, 3 * BLOCK + 5
    s = start + t
    q = torch.randn(hkv * g, t, hd, generator=gen)
    k, v = torch.randn(hkv, s, hd, generator=gen), torch.randn(hkv, s, hd, generator=gen)
    positions = torch.arange(start, s)
    for block in (BLOCK, None):
        mask, causal, rows = CloverModel._attention_mask(positions, start, t, True, block, False)
        keys = torch.arange(s)
        full = (keys[None, :] // block <= positions[:, None] // block) if block else keys[None, :] <= positions[:, None]
        assert rows and not causal and (mask is None) == (block is not None)
        expect = torch.nn.functional.scaled_dot_product_attention(
            q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None], attn_mask=full, scale=hd**-0.5
        )[0]
        p = PassContext(start, t, block, None, True, q, q, mask, causal, False, attn_rows=rows, by_rows=True)
        got = attention_by_rows(q, k, v, p, g)
        assert (got - expect).abs().max() < 1e-5, block


def _naive_clover_gdn(gdn, x: torch.Tensor, block: int, state: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """The right convolution (R1, join A) and the history unit (F1, ln L with L = block) written token by token, in float64."""
    cfg = gdn.config
    x = x.double()
    t, hv, hk, dk, dv = x.shape[0], gdn.num_v_heads, gdn.num_k_heads, gdn.dk, gdn.dv
    w = {n: p.detach().double() for n, p in gdn.named_parameters()}
    raw = x @ w["in_proj_qkv.weight"].T  # [T, C]
    z = (x @ w["in_proj_z.weight"].T).view(t, hv, dv)
    beta = torch.sigmoid(x @ w["in_proj_b.weight"].T)
    g = -w["A_log"].exp() * torch.nn.functional.softplus(x @ w["in_proj_a.weight"].T + w["dt_bias"])
    hist = torch.cat([conv.double(), raw])  # left context
    kk, kr = gdn.kernel, w["conv1d.weight_right"].shape[1]
    act = torch.zeros_like(raw)
    for i in range(t):
        b0 = i // block * block
        left = sum(w["conv1d.weight"][:, 0, j] * hist[i + j] for j in range(kk))
        right = sum(
            w["conv1d.weight_right"][:, j] * raw[i + 1 + j] for j in range(kr) if i + 1 + j < min(b0 + block, t)
        )
        act[i] = torch.nn.functional.silu(left + right)
    q, k, v = act.split([gdn.key_dim, gdn.key_dim, gdn.value_dim], -1)
    rep = hv // hk
    q = q.view(t, hk, dk).repeat_interleave(rep, 1)
    k = k.view(t, hk, dk).repeat_interleave(rep, 1)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * dk**-0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    v = v.view(t, hv, dv)
    s = state.double().clone()
    o_gdn = torch.zeros(t, hv, dv, dtype=torch.float64)
    for i in range(t):
        s = s * g[i].exp()[:, None, None]
        delta = (v[i] - torch.einsum("hkv,hk->hv", s, k[i])) * beta[i][:, None]
        s = s + k[i][:, :, None] * delta[:, None, :]
        o_gdn[i] = torch.einsum("hkv,hk->hv", s, q[i])
    logit = x @ w["bd_history.weight"].T + w["bd_history.bias"] + w["bd_logit_scale.weight"] * torch.log(
        torch.tensor(float(block), dtype=torch.float64)
    )
    mixed = torch.zeros_like(o_gdn)
    for i in range(t):
        b0 = i // block * block
        js = range(b0, min(b0 + block, t))
        for h in range(hv):
            scores = torch.stack([logit[i, h]] + [q[i, h] @ k[j, h] for j in js])
            a = torch.softmax(scores, 0)
            mixed[i, h] = a[0] * o_gdn[i, h] + sum(a[1 + n] * v[j, h] for n, j in enumerate(js))
    normed = mixed / (mixed.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt()
    y = w["norm.weight"] * normed * torch.nn.functional.silu(z)
    return y.reshape(t, -1) @ w["out_proj.weight"].T


def test_clover_gdn_block_mode_matches_the_written_out_formulas() -> None:
    cfg = tiny_config("clover_moe", moe_block_coreset_enabled=False)
    model = tiny_model(cfg, seed=14)
    gdn = model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(5)
    cache = model.new_cache(64)
    cache.state[0].normal_(generator=gen).mul_(0.3)
    cache.conv[0].normal_(generator=gen)
    cache.length = BLOCK  # pretend one block is committed (only layer 0's state is read here)
    x = torch.randn(BLOCK + 5, cfg.hidden_size, generator=gen)
    from clover_desk.engine.model.attention import rope_cos_sin
    from clover_desk.engine.model.cache import PassContext

    cos, sin = rope_cos_sin(torch.arange(BLOCK, 2 * BLOCK + 5), cfg.rotary_dim, cfg.rope_theta)
    p = PassContext(BLOCK, x.shape[0], BLOCK, cache, False, cos, sin, None, False, False)
    ours = gdn(x, p, cache.layer(0))
    ref = _naive_clover_gdn(gdn, x, BLOCK, cache.state[0], cache.conv[0])
    assert (ours.double() - ref).abs().max() < 1e-4
