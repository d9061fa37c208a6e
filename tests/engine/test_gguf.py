"""Loading GGUF files: both Clover layouts, float and quantized types, split sets, the embedded tokenizer, diffusion
mode, the planner's view, and one clear line for every bad file.

The files are written here from tiny checkpoints (engine.weights.tiny.make_tiny) with engine.weights.gguf.writer, which applies
the converter's transforms; loading must undo them exactly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from fixtures_tiny import one_torch_thread, tiny_clover_dir  # noqa: F401
from helpers_model import greedy

from clover_desk.engine.api import Engine, plan_for
from clover_desk.engine.decode.events import BlockStep, Finished, GenerationParams
from clover_desk.engine.defaults import GIB
from clover_desk.engine.errors import ConfigError, PromptError
from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.placement.manifest import manifest_from_gguf
from clover_desk.engine.placement.planner import plan_model
from clover_desk.engine.weights.checkpoint import load_model, model_from_state_dict
from clover_desk.engine.weights.gguf.file import hf_to_tiled_heads, open_gguf, tiled_to_hf_heads
from clover_desk.engine.weights.gguf.model import (
    GGUFEmbedding,
    GGUFExpertBank,
    GGUFLinear,
    gguf_state_dict,
    load_gguf_model,
)
from clover_desk.engine.weights.gguf.writer import write_gguf
from clover_desk.engine.weights.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
PROMPT = torch.tensor([5, 17, 300, 41, 9, 250, 7, 66, 12, 3, 99, 140])
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ref_model(tiny_clover_dir: Path):  # type: ignore[no-untyped-def]
    return load_model(tiny_clover_dir)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Clover with hidden 256, so matrices over the hidden size hold whole Q4_K blocks."""
    return make_tiny(tmp_path_factory.mktemp("wide"), seed=3, hidden=256, tokenizer_vocab=512)


@pytest.fixture(scope="module")
def files(tiny_clover_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(type, layout) -> a single GGUF file of the tiny Clover."""
    out = tmp_path_factory.mktemp("gguf")
    made = {}
    for qtype in ("F32", "F16", "Q8_0", "Q4_0"):
        for layout in ("fork", "upstream"):
            made[(qtype, layout)] = write_gguf(tiny_clover_dir, out / f"tiny-{qtype}-{layout}.gguf", qtype, layout=layout)[0]
    return made


@pytest.fixture(params=["dequantized", "cpu-kernels"])
def compute(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The two CPU paths of a GGUF model: blocks dequantized per forward (must equal the reference to fp32
    rounding), and the CPU kernels (activations rounded to int8 blocks as llama.cpp does: judged by the KL
    divergence of next-token distributions)."""
    if request.param == "cpu-kernels" and not cpu_quant.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_quant.reason()}")
    before = cpu_quant.set_enabled(request.param == "cpu-kernels")
    yield request.param
    cpu_quant.set_enabled(before)


def mean_kl(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(want) || softmax(got)) in nats: got/want fp32 logits [T, V]."""
    logp_want, logp_got = want.double().log_softmax(-1), got.double().log_softmax(-1)
    return float((logp_want.exp() * (logp_want - logp_got)).sum(-1).mean())


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor, compute: str) -> None:
    if compute == "dequantized":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # the bound for any rounding a re-layout adds: <= 1e-3 nats per token
        assert mean_kl(got, want) <= 1e-3, mean_kl(got, want)
        assert not torch.equal(got, want)  # the kernels did run (their int8 activations round)


def _reference(path: Path):  # type: ignore[no-untyped-def]
    """The model of a GGUF with every tensor dequantized by the gguf package (independent of engine.weights.gguf.quants)."""

    def deq(raw: torch.Tensor, qtype: int) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype)).copy())

    config, sd = gguf_state_dict(path, deq)
    return model_from_state_dict(config, sd)


# ---- head order ------------------------------------------------------------------------------------------------


def test_tiled_head_order_is_the_converter_order() -> None:
    # 16 key heads, 32 value heads (35B-A3B): gguf head p = hf head (p % 16) * 2 + p // 16
    to_tiled = hf_to_tiled_heads(16, 32)
    assert to_tiled[:3] == [0, 2, 4] and to_tiled[16:19] == [1, 3, 5]
    back = tiled_to_hf_heads(16, 32)
    assert [to_tiled[back[h]] for h in range(32)] == list(range(32))


# ---- exact round trips (F32) -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["fork", "upstream"])
def test_f32_gguf_gives_the_safetensors_tokens(files, ref_model, layout: str) -> None:  # type: ignore[no-untyped-def]
    loaded = load_gguf_model(files[("F32", layout)])
    assert loaded.file.layout == layout
    model = loaded.model
    want = ref_model(PROMPT)
    got = model(PROMPT)
    if layout == "fork":
        assert torch.equal(got, want)  # norms (1 + w) - 1, tiled heads, conv squeeze: all undone exactly
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # A_log = log(exp(A_log)) can round
    assert greedy(model, PROMPT, 10) == greedy(ref_model, PROMPT, 10)


def test_f32_fork_block_mode_equals_safetensors(files, ref_model) -> None:  # type: ignore[no-untyped-def]
    """The Clover extras (tiled like the other value-head tensors) come back in Hugging Face order: block-mode
    logits, where they act, are identical."""
    model = load_gguf_model(files[("F32", "fork")]).model
    ids = PROMPT[:8]
    assert torch.equal(model(ids, block_size=4), ref_model(ids, block_size=4))
    gdn = model.layers[0].linear_attn
    assert gdn.bd_history is not None and gdn.conv1d.weight_right is not None


def test_upstream_layout_has_no_diffusion_tensors(files) -> None:  # type: ignore[no-untyped-def]
    model = load_gguf_model(files[("F32", "upstream")]).model
    gdn = model.layers[0].linear_attn
    assert gdn.bd_history is None and gdn.conv1d.weight_right is None and not model.config.is_diffusion


# ---- quantized: the model computes with the blocks ---------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("layout", ["fork", "upstream"])
def test_quantized_gguf_matches_its_dequantized_reference(files, qtype: str, layout: str, compute: str) -> None:  # type: ignore[no-untyped-def]
    path = files[(qtype, layout)]
    loaded = load_gguf_model(path)
    model = loaded.model
    if qtype != "F16":
        assert isinstance(model.layers[0].mlp.experts, GGUFExpertBank)
        assert isinstance(model.layers[0].linear_attn.out_proj, GGUFLinear)
        assert isinstance(model.lm_head, GGUFLinear) and isinstance(model.embed_tokens, GGUFEmbedding)
        assert model.layers[0].linear_attn.out_proj.in_heads is not None  # ssm_out's tiled columns
    ref = _reference(path)
    if qtype == "F16":  # float tensors stay on torch whichever path
        torch.testing.assert_close(model(PROMPT), ref(PROMPT), rtol=1e-4, atol=1e-4)
    else:
        assert_matches_reference(model(PROMPT), ref(PROMPT), compute)
    assert greedy(model, PROMPT, 8) == greedy(ref, PROMPT, 8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_gguf_matches_its_dequantized_reference(wide_dir: Path, tmp_path: Path, qtype: str, compute: str) -> None:
    path = write_gguf(wide_dir, tmp_path / f"wide-{qtype}.gguf", qtype, layout="fork")[0]
    gf = open_gguf(path)
    assert gf.tensors["blk.0.ffn_gate_exps.weight"].type_name == qtype
    assert gf.tensors["blk.0.attn_qkv.weight"].type_name == qtype
    assert gf.tensors["blk.0.ffn_down_exps.weight"].type_name == "Q8_0"  # 32-wide rows fall back
    model = load_gguf_model(path).model
    ref = _reference(path)
    assert_matches_reference(model(PROMPT), ref(PROMPT), compute)
    assert_matches_reference(model(PROMPT[:8], block_size=4), ref(PROMPT[:8], block_size=4), compute)
    assert greedy(model, PROMPT, 6) == greedy(ref, PROMPT, 6)
    # and near the unquantized model it came from (4-6 bit weights of a random model: logits agree in direction)
    want, got = load_model(wide_dir)(PROMPT), model(PROMPT)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.8 and cos.mean() > 0.9


def test_quantized_close_to_the_original(files, ref_model) -> None:  # type: ignore[no-untyped-def]
    """Q8_0 is near-lossless: the same greedy tokens as the checkpoint on this prompt."""
    model = load_gguf_model(files[("Q8_0", "fork")]).model
    assert greedy(model, PROMPT, 6) == greedy(ref_model, PROMPT, 6)


# ---- split sets, tokenizer, engine ---------------------------------------------------------------------------------


def test_split_set_loads_like_one_file(tiny_clover_dir: Path, files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    parts = write_gguf(tiny_clover_dir, tmp_path / "split.gguf", "Q8_0", split_max_tensors=25)
    assert len(parts) >= 3 and parts[0].name == f"split-00001-of-{len(parts):05d}.gguf"
    whole = load_gguf_model(files[("Q8_0", "fork")]).model
    for given in (parts[0], parts[-1]):
        split = load_gguf_model(given).model
        assert torch.equal(split(PROMPT), whole(PROMPT))
    parts[1].unlink()
    with pytest.raises(ConfigError, match=f"missing: {parts[1].name}"):
        load_gguf_model(parts[0])


def test_embedded_tokenizer_and_template(tiny_clover_dir: Path, files) -> None:  # type: ignore[no-untyped-def]
    from clover_desk.engine.decode.tokenizer import CloverTokenizer
    from clover_desk.engine.weights.gguf.file import load_tokenizer

    want = CloverTokenizer.from_dir(tiny_clover_dir)
    got = load_tokenizer(open_gguf(files[("Q8_0", "fork")]))
    text = "Hello, world!\n<|im_start|>user\nwie geht's? 3.14 <think>x</think><|mask|> é漢"
    assert got.encode(text) == want.encode(text)
    assert got.decode(want.encode(text), skip_special_tokens=False) == text
    assert got.chat_template == want.chat_template
    assert (got.mask_token_id, got.eos_token_ids, got.think_end_id) == (want.mask_token_id, want.eos_token_ids, want.think_end_id)
    chat = [{"role": "user", "content": "hi"}]
    assert got.encode_chat(chat) == want.encode_chat(chat)


def test_config_from_metadata(tiny_clover_dir: Path, files) -> None:  # type: ignore[no-untyped-def]
    from clover_desk.engine.model.config import load_config

    want = load_config(tiny_clover_dir)
    fork = open_gguf(files[("Q8_0", "fork")]).config
    same = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "layer_types", "rms_norm_eps", "rope_theta", "partial_rotary_factor", "max_position_embeddings",
            "mask_token_id", "think_end_token_id", "block_size", "threshold", "is_diffusion", "shift_logits")
    assert {k: getattr(fork, k) for k in same} == {k: getattr(want, k) for k in same}
    upstream = open_gguf(files[("Q8_0", "upstream")]).config
    assert not upstream.is_diffusion and upstream.mask_token_id is None


def test_engine_runs_diffusion_from_the_official_layout(files) -> None:  # type: ignore[no-untyped-def]
    engine = Engine.load(files[("Q8_0", "fork")])
    events = list(engine.generate(prompt="Hi there", params=GenerationParams(mode="diffusion", max_new_tokens=8)))
    assert any(isinstance(e, BlockStep) for e in events)
    done = events[-1]
    assert isinstance(done, Finished) and done.tokens == 8


def test_engine_refuses_diffusion_for_the_upstream_layout(files) -> None:  # type: ignore[no-untyped-def]
    engine = Engine.load(files[("Q8_0", "upstream")])
    with pytest.raises(PromptError, match="upstream llama.cpp's layout.*--mode ar"):
        engine.generate(prompt="Hi", params=GenerationParams(mode="diffusion", max_new_tokens=4))
    events = list(engine.generate(prompt="Hi", params=GenerationParams(mode="ar", max_new_tokens=4)))
    assert isinstance(events[-1], Finished) and events[-1].tokens == 4
    upstream = files[("Q8_0", "upstream")]
    planned = Engine.load(upstream, placement=plan_for(upstream, 8 * GIB, dtype="float32"))  # an AR-only file too
    assert planned.plan is not None and planned.ar_only
    with pytest.raises(PromptError, match="upstream llama.cpp's layout"):
        planned.generate(prompt="Hi", params=GenerationParams(mode="diffusion", max_new_tokens=4))


# ---- layout detection and override -------------------------------------------------------------------------------


def test_raw_a_log_without_diffusion_tensors_needs_the_override(tiny_clover_dir: Path, ref_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A fork-layout file stripped of its diffusion tensors: detection says upstream, its ssm_a (raw A_log, some
    values > 0) contradicts that, and the error names the override; with it, the model is the checkpoint's."""
    path = write_gguf(tiny_clover_dir, tmp_path / "stripped.gguf", "F32", layout="fork", diffusion_tensors=False)[0]
    with pytest.raises(ConfigError, match="raw A_log.*layout 'fork'"):
        open_gguf(path)
    model = load_gguf_model(path, layout="fork").model
    assert torch.equal(model(PROMPT), ref_model(PROMPT))
    from clover_desk.cli.main import main

    args = ["generate", "--model", str(path), "--prompt-ids", "5,17,300", "--mode", "ar", "--max-new-tokens", "3"]
    assert main(args) == 2
    assert main([*args, "--gguf-layout", "fork"]) == 0


# ---- the planner reads the header ---------------------------------------------------------------------------------


def test_planner_counts_the_gguf_bytes(files) -> None:  # type: ignore[no-untyped-def]
    path = files[("Q4_0", "fork")]
    reader = gguf.GGUFReader(path)
    manifest = manifest_from_gguf(path)
    assert manifest.total_bytes() == sum(int(t.n_bytes) for t in reader.tensors)
    per_layer = manifest.expert_layer_bytes()
    for layer, nbytes in per_layer.items():
        want = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{layer}.ffn_") and "_exps" in t.name)
        assert nbytes == want
    assert {e.format for e in manifest if e.kind == "expert"} == {"gguf_q4_0"}
    plan = plan_model(path, 4 << 30, 2048)
    assert plan.fits and plan.model == str(path)
    assert plan.vram_breakdown["resident_experts"] == sum(per_layer.values())


# ---- bad files: one line naming the file ------------------------------------------------------------------------


def test_truncated_file(files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = files[("Q8_0", "fork")]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    with pytest.raises(ConfigError, match=f"{bad}: truncated or damaged GGUF file"):
        open_gguf(bad)
    head = tmp_path / "head.gguf"
    head.write_bytes(src.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"{head}: truncated"):
        open_gguf(head)
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        open_gguf(notgguf)


def test_wrong_architecture(tiny_clover_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_clover_dir, tmp_path / "llama.gguf", "F16", arch="llama")[0]
    with pytest.raises(ConfigError, match=f"{path}: general.architecture is 'llama'"):
        open_gguf(path)


def test_unsupported_quant_type(tiny_clover_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_clover_dir, tmp_path / "q5.gguf", "Q8_0", types={"blk.0.attn_qkv.weight": 6})  # Q5_0
    with pytest.raises(ConfigError, match=r"'blk\.0\.attn_qkv\.weight' has ggml type Q5_0"):
        open_gguf(path[0])


def test_cli_bad_gguf_is_one_line_exit_2(files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "cut.gguf"
    src = files[("Q8_0", "fork")]
    bad.write_bytes(src.read_bytes()[:5000])
    out = subprocess.run([sys.executable, "-m", "clover_desk.cli.main", "generate", "--model", str(bad), "--prompt", "hi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0]
