"""Shared constants are defined once (``engine.defaults``): the block-diffusion defaults (block size 32, threshold
0.95) are not written again as literals where a config, a GGUF header, the loop, the planner or the window falls
back to them."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from clover_desk.bench import moe_only, random_model
from clover_desk.engine import defaults
from clover_desk.engine.decode.settings import DecodeSettings
from clover_desk.engine.model.config import CloverConfig, parse_config
from clover_desk.engine.placement import planner
from clover_desk.engine.placement.manifest import CONFIG_FIELDS, DERIVED_FIELDS, SHAPES, ModelGeometry
from clover_desk.engine.weights.tiny import MAX_LAYERS, clover_35b_a3b_text_config, config_dict_for, tiny_text_config
from clover_desk.ui.generation import GenerationSettings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "clover_desk", "ui")
# 0.95 written for another meaning: the denoising view's legend colour, the offload simulation's AR stand-in
OTHER_095 = {"ui/denoise_view.py", "clover_desk/bench/offload.py"}
SPECIAL_IDS = {"<|im_end|>": 2, "<|endoftext|>": 0, "<|mask|>": 5, "</think>": 4}


def _code_files() -> list[tuple[str, ast.AST]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out.append((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _literal_defaults(tree: ast.AST, names: set[str]) -> list[tuple[int, str, object]]:
    """(line, name, value) of each numeric literal given as the default of a parameter or class field named in
    ``names``, or as the fallback of a ``get("name", literal)`` / ``opt("name", literal)`` call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(d.lineno, a.arg, d.value) for a, d in pairs
                      if a.arg in names and isinstance(d, ast.Constant) and isinstance(d.value, (int, float))]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float)):
                found.append((node.lineno, node.target.id, node.value.value))
        elif isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            key, fallback = node.args[0].value, node.args[1]
            if isinstance(key, str) and key.rsplit(".", 1)[-1] in names and isinstance(fallback, ast.Constant) \
                    and isinstance(fallback.value, (int, float)):
                found.append((node.lineno, key, fallback.value))
    return found


def test_the_diffusion_defaults_are_read_from_one_place() -> None:
    assert (defaults.DEFAULT_BLOCK_SIZE, defaults.DEFAULT_THRESHOLD) == (32, 0.95)
    for owner in (CloverConfig, DecodeSettings, GenerationSettings):
        fields = owner.__dataclass_fields__
        assert fields["block_size"].default == defaults.DEFAULT_BLOCK_SIZE, owner
        assert fields["threshold"].default == defaults.DEFAULT_THRESHOLD, owner
    written = [f"{rel}:{line} {name}={value}" for rel, tree in _code_files() if rel != "engine/defaults.py"
               for line, name, value in _literal_defaults(tree, {"block_size", "threshold"})]
    assert written == []
    assert planner.make_plan.__kwdefaults__["block_size"] == defaults.DEFAULT_BLOCK_SIZE


def test_the_threshold_literal_is_written_nowhere_else() -> None:
    """0.95 as a number (docstrings and comments aside) only in engine/defaults.py and the listed other meanings."""
    places = sorted(
        f"{rel}:{node.lineno}" for rel, tree in _code_files() if rel != "engine/defaults.py" and rel not in OTHER_095
        for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value == 0.95
        and not isinstance(node.value, bool)
    )
    assert places == []


def test_the_35b_shape_is_defined_once() -> None:
    """The planner's shape (engine.placement.manifest.SHAPES), the real-width random checkpoints' config.json
    (engine.weights.tiny) and the benchmarks' shape are one definition: the config read back gives the geometry,
    and the widths are written as literals nowhere else."""
    data = config_dict_for("clover_moe", clover_35b_a3b_text_config(), SPECIAL_IDS)
    assert ModelGeometry.from_config(parse_config(data, source="35b")) == SHAPES["clover-35b-a3b"]
    assert MAX_LAYERS == SHAPES["clover-35b-a3b"].num_hidden_layers
    assert tiny_text_config(**random_model.SHAPES["clover-35b-a3b"]) == clover_35b_a3b_text_config()
    geo = SHAPES["clover-35b-a3b"]
    assert moe_only.HEAD_SHAPE == (geo.vocab_size, geo.hidden_size)
    assert moe_only.MOE_SHAPE == dict(experts=geo.num_experts, top_k=geo.num_experts_per_tok, hidden=geo.hidden_size,
                                   intermediate=geo.moe_intermediate_size)
    places = sorted(
        f"{rel}:{node.lineno}" for rel, tree in _code_files() if rel != "engine/placement/manifest.py"
        for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value == geo.vocab_size
    )
    assert places == []


def test_model_geometry_takes_the_configs_fields_as_they_are() -> None:
    """ModelGeometry restates no CloverConfig field: each of its fields is either CloverConfig's of the same name
    and type (copied by from_config) or one of the few it derives."""
    config_fields = {f.name: f for f in dataclasses.fields(CloverConfig)}
    geometry_fields = {f.name: f for f in dataclasses.fields(ModelGeometry)}
    assert set(CONFIG_FIELDS) | set(DERIVED_FIELDS) == set(geometry_fields)
    for name in CONFIG_FIELDS:
        assert name in config_fields, name
        assert geometry_fields[name].type == config_fields[name].type, name
    assert not set(DERIVED_FIELDS) & set(config_fields)
    cfg = parse_config(config_dict_for("clover_moe", clover_35b_a3b_text_config(layers=8), SPECIAL_IDS), source="8")
    geo = ModelGeometry.from_config(cfg)
    assert all(getattr(geo, name) == getattr(cfg, name) for name in CONFIG_FIELDS)
    assert geo.full_attention_layers == (3, 7) and geo.clover_extras
