"""Checkpoint reading, sanitizing, loading and writing on real safetensors files in tmp dirs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers_model import CancelAfter
from safetensors.torch import save_file

from clover_desk.engine.decode.events import LoadProgress
from clover_desk.engine.errors import CancelledError, CheckpointError
from clover_desk.engine.model.config import parse_config
from clover_desk.engine.weights.checkpoint import (
    CheckpointReader,
    load_model,
    model_from_state_dict,
    random_state_dict,
    sanitize,
    write_checkpoint,
)
from tests.helpers_model import BLOCK, one_thread, tiny_config, tiny_text_dict

_single_thread = pytest.fixture(autouse=True, scope="module")(one_thread)


def _clover_dict() -> dict:
    return {"model_type": "clover_moe", "block_size": BLOCK, **tiny_text_dict()}


def _write(tmp_path: Path, config_dict: dict | None = None, **kw) -> tuple[Path, dict]:
    config_dict = config_dict or _clover_dict()
    cfg = parse_config(config_dict)
    sd = random_state_dict(cfg, seed=0, **kw)
    write_checkpoint(tmp_path, sd, config_dict, max_shard_bytes=300_000)
    return tmp_path, sd


def test_sharded_round_trip_uses_official_names(tmp_path: Path) -> None:
    path, sd = _write(tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "lm_head.weight" in names
    assert "model.language_model.layers.0.linear_attn.bd_history.weight" in names
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in names
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(path)
    assert torch.equal(model.layers[0].linear_attn.conv1d.weight_right, sd["layers.0.linear_attn.conv1d.weight_right"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    ref = model_from_state_dict(model.config, sd)
    ids = torch.arange(20) % 257
    assert torch.equal(model(ids, block_size=BLOCK), ref(ids, block_size=BLOCK))


def test_per_expert_layout_loads_like_the_fused_one(tmp_path: Path) -> None:
    cfg_dict = {"model_type": "qwen3_5_moe_text", **tiny_text_dict()}
    a, _ = _write(tmp_path / "fused", cfg_dict, expert_layout="fused")
    b, _ = _write(tmp_path / "split", cfg_dict, expert_layout="per_expert")
    ma, mb = load_model(a), load_model(b)
    assert torch.equal(ma.layers[2].mlp.experts.gate_up_proj, mb.layers[2].mlp.experts.gate_up_proj)
    assert torch.equal(ma.layers[2].mlp.experts.down_proj, mb.layers[2].mlp.experts.down_proj)
    assert "model.layers.0.input_layernorm.weight" in CheckpointReader(b).names()


def test_sanitize_drops_vision_and_mtp_and_strips_prefixes() -> None:
    cfg = tiny_config("qwen3_5_moe")
    t = torch.zeros(3)
    assert sanitize("model.visual.blocks.0.attn.qkv.weight", t, cfg) is None
    assert sanitize("mtp.fc.weight", t, cfg) is None
    target, _ = sanitize("model.language_model.norm.weight", t, cfg)
    assert target.name == "norm.weight"
    target, _ = sanitize("lm_head.weight", t, cfg)
    assert target.name == "lm_head.weight"
    target, fixed = sanitize("model.language_model.layers.0.linear_attn.conv1d.weight", torch.zeros(8, 4), cfg)
    assert target.name == "layers.0.linear_attn.conv1d.weight" and fixed.shape == (8, 1, 4)
    target, _ = sanitize("model.language_model.layers.3.mlp.experts.7.up_proj.weight", t, cfg)
    assert target.name == "layers.3.mlp.experts.gate_up_proj"
    assert target.index == (7, slice(cfg.moe_intermediate_size, 2 * cfg.moe_intermediate_size))


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=shard.name) as err:
        load_model(path)
    assert "truncated" in str(err.value)


def _load_error(tmp_path: Path, changes: dict[str, torch.Tensor | None], config_dict: dict | None = None,
                **kw) -> str:
    """What load_model says of a checkpoint written from a random state dict with ``changes`` (None: left out)."""
    config_dict = config_dict or {"model_type": "qwen3_5_moe_text", **tiny_text_dict()}
    sd = random_state_dict(parse_config(config_dict), seed=0, **kw)
    for name, tensor in changes.items():
        if tensor is None:
            del sd[name]
        else:
            sd[name] = tensor
    write_checkpoint(tmp_path, sd, config_dict)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path)
    return str(err.value)


def test_wrong_shape_names_tensor_file_and_both_shapes(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)})
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "[16, 64]" in msg and "[32, 64]" in msg


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    assert "layers.2.linear_attn.A_log" in _load_error(tmp_path, {"layers.2.linear_attn.A_log": None})


def test_missing_expert_piece_is_named(tmp_path: Path) -> None:
    changes = {"layers.0.mlp.experts.5.down_proj.weight": None}
    assert "expert 5" in _load_error(tmp_path, changes, expert_layout="per_expert")


def test_index_pointing_at_a_missing_shard(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(path)


def test_garbage_header_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_clover_dict()))
    (tmp_path / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"not json at all....." + b"\0" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


def test_progress_reports_bytes_and_names_then_done(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    events: list[LoadProgress] = []
    load_model(path, progress=events.append)
    reading = [e for e in events if e.stage == "reading"]
    assert reading and events[-1].stage == "done"
    assert all(b.done_bytes >= a.done_bytes for a, b in zip(reading, reading[1:]))
    assert reading[-1].done_bytes == reading[-1].total_bytes > 0
    assert any(e.current.endswith("lm_head.weight") for e in reading)


def test_cancel_stops_loading(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    progress = CancelAfter(3)
    with pytest.raises(CancelledError):
        load_model(path, progress=progress, cancel=progress.cancel)
    assert len(progress.seen) == 3


def test_bf16_load_keeps_decay_parameters_in_fp32(tmp_path: Path) -> None:
    path, sd = _write(tmp_path)
    model = load_model(path, dtype="bfloat16")
    gdn = model.layers[0].linear_attn
    assert gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert gdn.A_log.dtype == torch.float32 and torch.equal(gdn.A_log, sd["layers.0.linear_attn.A_log"])
    out = model(torch.arange(BLOCK), 0, model.new_cache(16), block_size=BLOCK)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_extra_tensor_with_an_unknown_shape_is_named(tmp_path: Path) -> None:
    msg = _load_error(tmp_path, {"layers.0.linear_attn.bd_logit_scale.weight": torch.ones(3)}, _clover_dict())
    assert re.search(r"bd_logit_scale\.weight.*\[3\]", msg)


def test_single_file_without_index(tmp_path: Path) -> None:
    cfg_dict = {"model_type": "qwen3_5_moe_text", **tiny_text_dict()}
    cfg = parse_config(cfg_dict)
    sd = random_state_dict(cfg, seed=1)
    write_checkpoint(tmp_path, sd, cfg_dict)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    # an unrelated extra tensor is ignored, not an error
    save_file({"model.visual.patch.weight": torch.zeros(2)}, str(tmp_path / "extra.safetensors"))
    model = load_model(tmp_path)
    assert torch.equal(model.norm.weight, sd["norm.weight"])


def test_tied_embeddings_need_no_lm_head(tmp_path: Path) -> None:
    cfg_dict = {"model_type": "qwen3_5_moe_text", **tiny_text_dict(), "tie_word_embeddings": True}
    cfg = parse_config(cfg_dict)
    sd = random_state_dict(cfg, seed=2)
    assert "lm_head.weight" not in sd
    write_checkpoint(tmp_path, sd, cfg_dict)
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, sd["embed_tokens.weight"])


def test_consume_hook_takes_expert_tensors_instead_of_the_model(tmp_path: Path) -> None:
    from clover_desk.engine.model.clover import CloverModel
    from clover_desk.engine.weights.checkpoint import CheckpointReader, load_state, materialize, plan_load

    path, sd = _write(tmp_path, {"model_type": "qwen3_5_moe_text", **tiny_text_dict()})
    cfg = parse_config(json.loads((path / "config.json").read_text()))
    taken: dict[str, torch.Tensor] = {}

    def consume(name, target, tensor) -> bool:
        if ".mlp.experts." in target.name:
            taken[target.name] = tensor
            return True
        return False

    with CheckpointReader(path) as reader:
        model = CloverModel(cfg, device="meta")
        plan = plan_load(model, reader)
        materialize(model, "cpu")
        load_state(model, reader, plan, consume=consume)
    assert torch.equal(taken["layers.1.mlp.experts.down_proj"], sd["layers.1.mlp.experts.down_proj"])
    assert len(taken) == 2 * cfg.num_hidden_layers
    assert torch.equal(model.norm.weight, sd["norm.weight"])
