"""engine.kernels.cpu_token: one token's whole MoE block in one C call (router, softmax, top-k, routed experts, shared
expert and its gate) against the separate ops it replaces, on GGUF blocks and on the own cache's formats; where it
does not apply it steps aside; the decoder layer takes it in AR steps and the tokens stay the separate ops' tokens."""

from __future__ import annotations

import pytest
import torch
from fixtures_tiny import tiny_clover_dir  # noqa: F401
from helpers_model import tiny_config, tiny_model

from clover_desk.engine.kernels import cpu_quant as cq
from clover_desk.engine.kernels import cpu_token
from clover_desk.engine.model.moe import SparseMoe
from clover_desk.engine.weights import quant as wq
from clover_desk.engine.weights.formats import make_policy
from clover_desk.engine.weights.gguf.model import GGUFExpertBank, GGUFExpertLayout, GGUFLinear, load_gguf_model
from clover_desk.engine.weights.gguf.writer import write_gguf
from tests.quant_reference import make_bank, make_weights

pytestmark = pytest.mark.skipif(not cq.available(), reason="the CPU kernels did not build")

D, I, E, K = 256, 256, 8, 3  # K-format rows need whole 256-value blocks


def _moe(seed: int = 0) -> SparseMoe:
    cfg = tiny_config(hidden_size=D, moe_intermediate_size=I, shared_expert_intermediate_size=I, num_experts=E,
                      num_experts_per_tok=K)
    moe = SparseMoe(cfg)
    g = torch.Generator().manual_seed(seed)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    return moe


def gguf_moe(qtypes: tuple[int, int, int]) -> SparseMoe:
    moe = _moe()
    gate, up, down = make_bank(qtypes, E, D, I)
    packed = torch.cat([gate.reshape(E, -1), up.reshape(E, -1), down.reshape(E, -1)], 1).contiguous()
    moe.experts = GGUFExpertBank(GGUFExpertLayout(E, D, I, qtypes), packed)
    for name, (q, n, k) in {"gate_proj": (qtypes[0], I, D), "up_proj": (qtypes[1], I, D),
                            "down_proj": (qtypes[2], D, I)}.items():
        setattr(moe.shared_expert, name, GGUFLinear(make_weights(q, n, k, seed=len(name)), q, k))
    return moe


def own_moe(experts: str, dense: str) -> SparseMoe:
    moe = _moe(1)
    g = torch.Generator().manual_seed(2)
    moe.experts = wq.QuantExpertBank.from_dense(torch.randn(E, 2 * I, D, generator=g) * 0.1,
                                                torch.randn(E, D, I, generator=g) * 0.1, fmt=experts)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(moe.shared_expert, name, wq.QuantLinear.from_linear(getattr(moe.shared_expert, name), dense))
    return moe


def separate_ops(moe: SparseMoe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the layer computed before: the routing, the routed experts, the shared expert and its gate."""
    probs = torch.softmax(moe.gate(x).float(), -1)
    w, idx = probs.topk(K, -1)
    w = w / w.sum(-1, keepdim=True)
    return moe.combine(x, moe.routed(x, w, idx)), idx, w


CASES = {
    "gguf Q4_K/Q4_K/Q6_K": lambda: gguf_moe((cq.Q4_K, cq.Q4_K, cq.Q6_K)),
    "gguf Q8_0": lambda: gguf_moe((cq.Q8_0, cq.Q8_0, cq.Q8_0)),
    "gguf Q4_0/Q4_0/Q5_K": lambda: gguf_moe((cq.Q4_0, cq.Q4_0, cq.Q5_K)),
    "own nf4 + int8": lambda: own_moe("nf4", "int8"),
    "own int8 + q6_k": lambda: own_moe("int8", "q6_k"),
    "own nf4 + nf4": lambda: own_moe("nf4", "nf4"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scalar", [False, True], ids=["simd", "scalar"])
@torch.no_grad()
def test_one_call_equals_the_separate_ops(case: str, scalar: bool) -> None:
    moe = CASES[case]()
    before = cq.set_scalar(scalar)
    try:
        for seed in range(4):
            x = torch.randn(1, D, generator=torch.Generator().manual_seed(seed))
            one = cpu_token.moe_token(moe, x, coreset=False)
            assert one is not None and one.shape == (1, D) and one.dtype == torch.float32
            ref, idx, w = separate_ops(moe, x)
            assert torch.equal(moe.last_topk_idx, idx)  # the same experts, in the same order
            torch.testing.assert_close(moe.last_topk_w, w, rtol=1e-5, atol=1e-6)
            # within float32 rounding of the separate ops (the exponentials and the router's sum order are C's own)
            torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    finally:
        cq.set_scalar(before)


@torch.no_grad()
def test_the_router_top_k_and_the_shared_gate_each_count() -> None:
    """Each part of the block changes the output: a test of the whole block sees each of them."""
    moe = gguf_moe((cq.Q8_0, cq.Q8_0, cq.Q8_0))
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(7))
    base = cpu_token.moe_token(moe, x, coreset=False)
    moe.shared_expert_gate.weight.data.zero_()  # sigmoid(0) = 1/2: the shared expert's part halves
    half = cpu_token.moe_token(moe, x, coreset=False)
    ref, _, _ = separate_ops(moe, x)
    assert not torch.allclose(base, half)
    torch.testing.assert_close(half, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    moe.config = moe.config.with_overrides(norm_topk_prob=False)
    unnormed = cpu_token.moe_token(moe, x, coreset=False)
    probs = torch.softmax(moe.gate(x).float(), -1)
    w, idx = probs.topk(K, -1)
    torch.testing.assert_close(moe.last_topk_w, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unnormed, moe.combine(x, moe.routed(x, w, idx)), rtol=1e-4,
                               atol=1e-4 * float(half.abs().max()))


@torch.no_grad()
def test_it_steps_aside_where_it_does_not_apply() -> None:
    moe = gguf_moe((cq.Q8_0, cq.Q8_0, cq.Q8_0))
    x = torch.randn(1, D)
    assert cpu_token.moe_token(moe, x, coreset=True) is None  # a block coreset routes the block, not the token
    assert cpu_token.moe_token(moe, torch.randn(2, D), coreset=False) is None  # more than one token
    assert cpu_token.moe_token(moe, x.double(), coreset=False) is None
    before = cpu_token.set_enabled(False)
    try:
        assert cpu_token.moe_token(moe, x, coreset=False) is None
    finally:
        cpu_token.set_enabled(before)
    hook = moe.experts.register_forward_pre_hook(lambda *_: None)  # someone watches the bank's calls
    assert cpu_token.moe_token(moe, x, coreset=False) is None
    hook.remove()
    assert cpu_token.moe_token(moe, x, coreset=False) is not None
    assert cpu_token.moe_token(_moe(), x, coreset=False) is None  # unquantized float experts: no in-place layout


@torch.no_grad()
def test_ar_steps_take_it_and_keep_the_tokens(tiny_clover_dir, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A GGUF model's greedy AR tokens with the one call equal those of the separate ops, and its AR steps did
    take the call (each layer once per step)."""
    path = write_gguf(tiny_clover_dir, tmp_path / "cpu-moe-Q8_0.gguf", "Q8_0", layout="fork")[0]
    model = load_gguf_model(path).model
    prompt = torch.arange(5, 17)
    def greedy(on: bool) -> list[int]:
        before = cpu_token.set_enabled(on)
        try:
            cache = model.new_cache(40)
            logits = model(prompt, 0, cache, last_only=True)
            out = []
            for _ in range(12):
                out.append(int(logits[-1].argmax()))
                logits = model(torch.tensor([out[-1]]), cache.length, cache)
            return out
        finally:
            cpu_token.set_enabled(before)

    off = greedy(False)
    taken: list[str] = []
    real_c = cpu_token._function

    def counted(name: str = "clover_moe_token"):  # count the C calls themselves
        fn = real_c(name)
        return lambda *a: taken.append(name) or fn(*a)

    monkeypatch.setattr(cpu_token, "_function", counted)
    on = greedy(True)
    assert on == off
    # every AR step: all four layers (three Gated DeltaNet, one attention) as one run; never the prefill
    assert [layer.is_full_attention for layer in model.layers] == [False, False, False, True]
    assert taken == ["clover_layers_token"] * 12
    taken.clear()
    before = cpu_token.set_runs(False)
    try:
        assert greedy(True) == off
    finally:
        cpu_token.set_runs(before)
    # without runs: every layer's MoE and every Gated DeltaNet mixer, one C call each
    assert taken.count("clover_moe_token") == 12 * 4 and taken.count("clover_gdn_mixer_token") == 12 * 3


def _gguf_model(tiny_dir, tmp_path):  # noqa: ANN001, ANN202
    return load_gguf_model(write_gguf(tiny_dir, tmp_path / "tok-Q8_0.gguf", "Q8_0", layout="fork")[0]).model


def _own_model(tiny_dir, tmp_path):  # noqa: ANN001, ANN202
    model = load_gguf_model(write_gguf(tiny_dir, tmp_path / "tok-F32.gguf", "F32", layout="fork")[0]).model
    wq.quantize_model_(model, make_policy())  # INT8 projections; the GDN a / b rows stay float32
    return model


@torch.no_grad()
@pytest.mark.parametrize("build", [_gguf_model, _own_model], ids=["gguf Q8_0", "own int8"])
def test_the_gdn_mixer_in_one_call_equals_the_separate_ops(build, tiny_clover_dir, tmp_path) -> None:  # noqa: ANN001, F811
    """Each Gated DeltaNet mixer of an AR step: the output within float32 rounding of the separate calls, the conv
    state the same, the recurrent state within rounding; a forward that writes no cache leaves both states as they
    were. The GGUF file's out_proj reads its input in the file's tiled head order (in_heads): covered here."""
    model = build(tiny_clover_dir, tmp_path)
    cache = model.new_cache(32)
    model(torch.arange(5, 17), 0, cache, last_only=True)
    x = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    checked = 0
    for i, layer in enumerate(model.layers):
        if layer.is_full_attention:
            continue
        st, mixer = cache.layer(i), layer.linear_attn
        separate = tuple(t.clone() for t in st)
        before = cpu_token.set_enabled(False)
        try:
            ref = mixer._cpu_token(x, _ctx(), separate)  # the separate calls, the states updated in place
        finally:
            cpu_token.set_enabled(before)
        kept = tuple(t.clone() for t in st)
        assert cpu_token.gdn_mixer_token(mixer, x, kept, write_cache=False) is not None
        assert all(torch.equal(a, b) for a, b in zip(kept, st))  # nothing written
        mine = tuple(t.clone() for t in st)
        one = cpu_token.gdn_mixer_token(mixer, x, mine, write_cache=True)
        assert one is not None
        torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        assert torch.equal(mine[0], separate[0])  # the conv state: raw rows, copied
        assert not torch.equal(mine[1], st[1])  # the recurrent state moved, as the separate calls moved it
        torch.testing.assert_close(mine[1], separate[1], rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked


def _ctx():  # noqa: ANN202
    """The pass facts of one causal AR token that writes its cache."""
    from clover_desk.engine.model.cache import PassContext

    fields = {f: None for f in PassContext.__dataclass_fields__ if f not in ("pos", "kv_len", "attn_rows", "by_rows")}
    return PassContext(**{**fields, "write_cache": True, "coreset": False, "attn_causal": True})


def _step(model, cache, token: int, runs: bool, write_cache: bool = True):  # noqa: ANN001, ANN202
    before = cpu_token.set_runs(runs)
    try:
        logits = model(torch.tensor([token]), cache.length, cache, write_cache=write_cache)
    finally:
        cpu_token.set_runs(before)
    return logits, [(m.mlp.last_topk_idx, m.mlp.last_topk_w) for m in model.layers]


def _states(cache) -> list[torch.Tensor]:  # noqa: ANN001
    return [t.clone() for t in cache.gdn_snapshot()]


@torch.no_grad()
@pytest.mark.parametrize("build", [_gguf_model, _own_model], ids=["gguf Q8_0", "own int8"])
def test_a_run_of_gdn_layers_gives_their_bits(build, tiny_clover_dir, tmp_path) -> None:  # noqa: ANN001, F811
    """AR steps through a run of Gated DeltaNet layers (one C call; the attention layer kept out by a hook) give the
    per-layer path's logits, states and routing bit for bit, step after step; a step that writes no cache leaves
    the states as they were."""
    model = build(tiny_clover_dir, tmp_path)
    handle = model.layers[3].register_forward_pre_hook(lambda *a: None)
    caches = [model.new_cache(32), model.new_cache(32)]
    for c in caches:
        model(torch.arange(5, 17), 0, c, last_only=True)
    for token in (3, 9, 4, 11):
        mine, mine_route = _step(model, caches[0], token, True)
        ref, ref_route = _step(model, caches[1], token, False)
        assert torch.equal(mine, ref)
        assert all(torch.equal(a, b) for a, b in zip(_states(caches[0]), _states(caches[1])))
        for (i0, w0), (i1, w1) in zip(mine_route, ref_route):
            assert torch.equal(i0, i1) and torch.equal(w0, w1)
    runs = list(cpu_token.kept_runs(model).values())
    assert len(runs) == 1 and [(r.start, r.end) for r in runs[0].values()] == [(0, 3)]
    kept = _states(caches[0])
    peek, _ = _step(model, caches[0], 5, True, write_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, _states(caches[0])))
    after, _ = _step(model, caches[0], 5, True)
    assert torch.equal(peek, after)
    handle.remove()


@torch.no_grad()
@pytest.mark.parametrize("build", [_gguf_model, _own_model], ids=["gguf Q8_0", "own int8"])
def test_a_run_with_attention_matches_the_layers(build, tiny_clover_dir, tmp_path) -> None:  # noqa: ANN001, F811
    """A run over every layer, the full-attention one included (its scores and softmax in C): logits, keys, values,
    states and routing within float32 rounding of the per-layer path over 20 steps (the keys grow from 12 to 31);
    a step that writes no cache leaves keys, values and states as they were."""
    model = build(tiny_clover_dir, tmp_path)
    caches = [model.new_cache(40), model.new_cache(40)]
    for c in caches:
        model(torch.arange(5, 17), 0, c, last_only=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        token = int(torch.randint(0, model.config.vocab_size, (1,), generator=g))
        mine, mine_route = _step(model, caches[0], token, True)
        ref, ref_route = _step(model, caches[1], token, False)
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
        for (i0, w0), (i1, w1) in zip(mine_route, ref_route):
            assert torch.equal(i0, i1)
            torch.testing.assert_close(w0, w1, rtol=1e-4, atol=1e-6)
    n = caches[0].length
    key0, value0 = caches[0].layer(3)
    key1, value1 = caches[1].layer(3)
    torch.testing.assert_close(key0[:, :n], key1[:, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(value0[:, :n], value1[:, :n], rtol=1e-4, atol=1e-5)
    assert not torch.equal(key0[:, n - 1], torch.zeros_like(key0[:, n - 1]))
    runs = next(iter(cpu_token.kept_runs(model).values()))
    assert [(r.start, r.end) for r in runs.values()] == [(0, 4)]
    kept = [t.clone() for i in range(4) for t in caches[0].layer(i)]
    peek, _ = _step(model, caches[0], 5, True, write_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, [t for i in range(4) for t in caches[0].layer(i)]))
    after, _ = _step(model, caches[0], 5, True)
    assert torch.equal(peek, after)


@torch.no_grad()
def test_layer_runs_step_aside_and_follow_the_cache(tiny_clover_dir, tmp_path) -> None:  # noqa: F811
    """Runs split around a hooked layer (whose hook then sees its forward), are rebuilt for another cache, and are
    not taken by a prefill, a block pass or with the switch off."""
    model = _gguf_model(tiny_clover_dir, tmp_path)
    cache = model.new_cache(48)
    model(torch.arange(5, 17), 0, cache, last_only=True)
    seen: list[int] = []
    handle = model.layers[1].register_forward_hook(lambda *a: seen.append(1))
    try:
        _step(model, cache, 3, True)
        runs = next(iter(cpu_token.kept_runs(model).values()))
        assert sorted((r.start, r.end) for r in runs.values()) == [(0, 1), (2, 4)] and seen == [1]
    finally:
        handle.remove()
    _step(model, cache, 4, True)
    assert sorted((r.start, r.end) for r in cpu_token.layer_runs(model, model.embed(torch.tensor([4])),
                                                                  _pass(cache, model.config)).values()) == [(0, 4)]
    other = model.new_cache(48)
    model(torch.arange(5, 17), 0, other, last_only=True)
    _step(model, other, 3, True)
    assert len(cpu_token.kept_runs(model)) == 3  # the hooked split, the cache's own runs, the other cache's
    h = model.embed(torch.tensor([4]))
    assert cpu_token.layer_runs(model, h, _pass(cache, model.config, block_size=4)) == {}
    assert cpu_token.layer_runs(model, model.embed(torch.tensor([4, 5])), _pass(cache, model.config)) == {}
    before = cpu_token.set_runs(False)
    try:
        assert cpu_token.layer_runs(model, h, _pass(cache, model.config)) == {}
    finally:
        cpu_token.set_runs(before)


def _pass(cache, config, block_size: int | None = None):  # noqa: ANN001, ANN202
    from clover_desk.engine.model.attention import rope_cos_sin
    from clover_desk.engine.model.cache import PassContext

    cos, sin = rope_cos_sin(torch.tensor([cache.length]), config.rotary_dim, config.rope_theta)
    fields = {f: None for f in PassContext.__dataclass_fields__ if f not in ("pos", "kv_len", "attn_rows", "by_rows")}
    return PassContext(**{**fields, "cache": cache, "block_size": block_size, "write_cache": True, "coreset": False,
                          "attn_causal": True, "cos": cos, "sin": sin, "start_pos": cache.length})


@torch.no_grad()
def test_layer_runs_follow_what_they_were_built_from(tiny_clover_dir, tmp_path) -> None:  # noqa: F811
    """A run points into the cache and the layers it was built for: another cache (another length), a replaced
    expert bank or a dropped cache gets runs of its own, never another's pointers; ``forget`` drops them all."""
    import copy
    import gc

    model = _gguf_model(tiny_clover_dir, tmp_path)
    first = model.new_cache(40)
    model(torch.arange(5, 17), 0, first, last_only=True)
    _step(model, first, 3, True)
    second = model.new_cache(80)
    model(torch.arange(5, 17), 0, second, last_only=True)
    _step(model, second, 3, True)
    built = list(cpu_token.kept_runs(model).values())
    assert len(built) == 2 and [r[0]._structs[3].max_len for r in built] == [40, 80]
    del first, built
    gc.collect()
    third = model.new_cache(40)  # may take the dropped cache's memory: its runs are its own all the same
    model(torch.arange(5, 17), 0, third, last_only=True)
    mine, _ = _step(model, third, 3, True)
    assert len(cpu_token.kept_runs(model)) == 3
    ref_cache = model.new_cache(40)
    model(torch.arange(5, 17), 0, ref_cache, last_only=True)
    ref, _ = _step(model, ref_cache, 3, False)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    bank = model.layers[0].mlp.experts
    model.layers[0].mlp.experts = copy.deepcopy(bank)
    _step(model, third, 4, True)
    assert len(cpu_token.kept_runs(model)) == 4
    cpu_token.forget(model)
    assert cpu_token.kept_runs(model) == {}


@torch.no_grad()
@pytest.mark.parametrize("keys", [511, 512, 1300])
def test_a_run_attends_over_many_keys_in_chunks(keys: int, tiny_clover_dir, tmp_path) -> None:  # noqa: F811
    """Attention over more keys than one chunk of the run's split (512 keys a task, joined per head): logits and
    the written key and value within float32 rounding of the per-layer path (SDPA), at, below and past a chunk."""
    model = _gguf_model(tiny_clover_dir, tmp_path)
    caches = [model.new_cache(keys + 8) for _ in range(2)]
    g = torch.Generator().manual_seed(keys)
    for i in range(4):
        for t in caches[0].layer(i):
            t.normal_(generator=g)
            if not model.layers[i].is_full_attention and t.dim() == 3:
                t.mul_(0.01)  # a recurrent state of a plausible size
    for c in caches:
        for i in range(4):
            for t, src in zip(c.layer(i), caches[0].layer(i)):
                t.copy_(src)
        c.length = keys
    mine, _ = _step(model, caches[0], 7, True)
    ref, _ = _step(model, caches[1], 7, False)
    torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    for a, b in zip(caches[0].layer(3), caches[1].layer(3)):
        torch.testing.assert_close(a[:, : keys + 1], b[:, : keys + 1], rtol=1e-4, atol=1e-5)
    assert [(r.start, r.end) for r in next(iter(cpu_token.kept_runs(model).values())).values()] == [(0, 4)]


@torch.no_grad()
def test_real_width_smoke_of_a_layer_run() -> None:
    """CI smoke of the layer runs at Clover's real widths (hidden 2,048; attention 16 query heads over 2 KV heads of
    256, 64 rotary dims; Gated DeltaNet 16 key / 32 value heads of 128; experts of 512, top 8 of 16 here), the own
    cache's formats (NF4 experts, INT8 projections): a Gated DeltaNet and an attention layer as one run, 6 AR steps
    against the per-layer path, the routing the same. The products round their activations to int8 blocks, so an
    attention output a last bit away from SDPA's can round one activation to the next int8 step (seen: one step of
    six moved its logits by 0.3% of their range): each step's logits within 1% of their range, and at least four
    steps of six within float32 rounding."""
    cfg = tiny_config(hidden_size=2048, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=16,
                      num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                      vocab_size=512)
    model = tiny_model(cfg, seed=4, clover_extras=False)
    wq.quantize_model_(model, make_policy())
    caches = [model.new_cache(24), model.new_cache(24)]
    for c in caches:
        model(torch.arange(5, 15), 0, c, last_only=True)
    close = 0
    for token in (3, 9, 4, 11, 7, 1):
        mine, mine_route = _step(model, caches[0], token, True)
        ref, ref_route = _step(model, caches[1], token, False)
        diff, scale = float((mine - ref).abs().max()), float(ref.abs().max())
        assert diff <= 1e-2 * scale
        close += diff <= 1e-5 * scale
        assert all(torch.equal(a[0], b[0]) for a, b in zip(mine_route, ref_route))
    assert close >= 4
    assert [(r.start, r.end) for r in next(iter(cpu_token.kept_runs(model).values())).values()] == [(0, 2)]
