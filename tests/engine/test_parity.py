"""Numerical parity with transformers' Qwen3.5-MoE (tiny random models written by save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clover_desk.engine.weights.checkpoint import load_model
from tests.helpers_model import greedy, one_thread, tiny_text_dict

_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 45  # longer than one 32-token GDN chunk
NEW_TOKENS = 32


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' init (zero norms, tiny std) with weights that make every part matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name or name.endswith(("A_log", "dt_bias")):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
                p.copy_(noise * 0.1)  # zero-centred norms: (1 + w)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + noise * 0.1)  # plain-weight gated norm
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
                p.copy_(noise * 0.3 * p.shape[-1] ** -0.5)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(noise * 2.0 * p.shape[-1] ** -0.5)  # peaky router: top-k matters
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def _make_conditional(path: Path) -> torch.nn.Module:
    cfg = transformers.Qwen3_5MoeConfig(
        text_config=tiny_text_dict(),
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 4, "num_position_embeddings": 16},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    _randomize(model, seed=1)
    model.save_pretrained(path)
    return model


def _make_causal_lm(path: Path) -> torch.nn.Module:
    cfg = transformers.Qwen3_5MoeTextConfig(**tiny_text_dict())
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    _randomize(model, seed=2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_5_moe_text"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _make_conditional(path) if request.param == "qwen3_5_moe" else _make_causal_lm(path)
    return request.param, path, hf, load_model(path, dtype=torch.float32)


def test_save_pretrained_layout_is_what_the_loader_expects(pair) -> None:
    kind, path, _, model = pair
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == kind
    assert model.config.weight_prefix == ("model.language_model." if kind == "qwen3_5_moe" else "model.")
    # transformers 5.23 writes experts per expert; the loader fuses them
    from safetensors import safe_open

    files = list(path.glob("*.safetensors"))
    names = set()
    for f in files:
        with safe_open(str(f), "pt") as s:
            names.update(s.keys())
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    assert model.layers[0].mlp.experts.gate_up_proj.shape == (16, 64, 64)


def test_prefill_logits_match_transformers(pair) -> None:
    _, _, hf, model = pair
    ids = torch.randint(0, 257, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = model(ids)
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    print(f"prefill max abs diff {diff:.2e}, max |logit| {ref.abs().max().item():.2f}")
    assert diff <= 1e-4
    # the routing actually varies: more than top-k distinct experts were used in a layer
    assert torch.unique(model.layers[0].mlp.last_topk_idx).numel() > 4


def test_greedy_tokens_match_transformers_generate(pair) -> None:
    _, _, hf, model = pair
    ids = torch.randint(0, 257, (PROMPT_LEN,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf.generate(
            input_ids=ids[None], attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, PROMPT_LEN:].tolist()
    ours = greedy(model, ids, NEW_TOKENS)
    assert len(ref) == NEW_TOKENS
    assert len(set(ours)) > 3  # not a degenerate repeat of one token
    assert ours == ref
