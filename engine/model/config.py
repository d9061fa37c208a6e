"""Model and generation configuration, read from a Hugging Face model folder.

Accepts Clover (``clover_moe``) and its base models (``qwen3_5_moe`` with a nested ``text_config`` and the
``model.language_model.`` weight prefix; ``qwen3_5_moe_text`` with ``model.``). Unknown keys are ignored; a missing
required field or an unknown ``model_type`` is a :class:`ConfigError` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from clover_desk.engine.decode.limits import GENERATION_LIMITS, decode_utf8
from clover_desk.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_THRESHOLD
from clover_desk.engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("clover_moe", "qwen3_5_moe", "qwen3_5_moe_text")

# Token ids of the real Qwen3.5/3.6 vocabulary, used only when a config does not say.
QWEN_EOS_IDS = (248046, 248044)
QWEN_THINK_END_ID = 248069

# Allowed values of the switches for Clover's unpublished parts.
_SWITCH_VALUES: dict[str, tuple[str, ...]] = {
    "bd_history_form": ("F1", "F2", "history_only"),
    "bd_history_input": ("q", "r"),
    "bd_right_conv_taps": ("R1", "R2", "R3", "R4"),
    "bd_right_conv_join": ("A", "B", "C"),
    "bd_logit_scale_mode": ("ln_len", "temperature"),
    "bd_len_mode": ("block", "tokens"),
    "coreset_restrict": ("R-a", "R-b"),
}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class CloverConfig:
    """Architecture of one Clover / Qwen3.5-MoE text model (names as in config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    norm_topk_prob: bool = True
    # Where the text model's weights live in the checkpoint ("model.language_model." or "model.").
    weight_prefix: str = "model.language_model."
    eos_token_ids: tuple[int, ...] = QWEN_EOS_IDS
    # --- block diffusion (Clover) ---
    is_diffusion: bool = False  # True for clover_moe: block mode is the model's native mode
    block_size: int = DEFAULT_BLOCK_SIZE
    threshold: float = DEFAULT_THRESHOLD
    mask_token_id: int | None = None
    think_end_token_id: int | None = QWEN_THINK_END_ID
    shift_logits: bool = False  # logit row i predicts token i (False) or token i+1 (True)
    moe_block_coreset_enabled: bool = False
    moe_block_coreset_top_p: float = 0.9
    # Switches for the parts of Clover that are not public; defaults = primary proposal.
    bd_history_form: str = "F1"  # "F1" mix with causal GDN output | "F2" pure state read | "history_only" (neutral)
    bd_history_input: str = "q"  # a [Hv, dk] bd_history.weight applies to q̂ ("q") or to the history read ("r")
    bd_right_conv_taps: str = "R1"  # "R1" future taps | "R2" mirrored | "R3" incl. current | "R4" mirrored incl. current
    bd_right_conv_join: str = "A"  # "A" pre-activation sum | "B" SiLU(L)+R | "C" SiLU(L)+SiLU(R)
    bd_logit_scale_mode: str = "ln_len"  # "ln_len": s*ln(L) on the history logit | "temperature": z*s
    bd_len_mode: str = "block"  # "block": L = block_size | "tokens": L = tokens in the softmax
    bd_right_conv_in_state: bool = True  # right branch included in the commit pass's state update
    coreset_restrict: str = "R-a"  # "R-a" re-route inside the coreset | "R-b" keep top-k ∩ coreset
    coreset_in_prefill: bool = False

    # ---- derived sizes ----
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def with_overrides(self, **kwargs: Any) -> "CloverConfig":
        return replace(self, **kwargs)


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json, with Clover's published defaults where a key is absent."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 24_576
    eos_token_ids: tuple[int, ...] = ()
    dllm_length_penalty: float = 0.0
    dllm_length_penalty_start: int = 8192
    dllm_length_penalty_window: int = 8192
    dllm_think_end_bias: float = 0.0
    dllm_think_end_bias_start: int = 4096
    dllm_think_end_bias_window: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path) -> Any:
    """The JSON value in ``path`` (UTF-8): a missing, unreadable, undecodable or malformed file is a ConfigError
    that names it (the model folder's config.json, generation_config.json, tokenizer_config.json)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    text = decode_utf8(raw, str(path), ConfigError)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid JSON (nested too deeply)") from None


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return data


def _as_int_tuple(value: Any, source: str = "config.json", name: str = "eos_token_id") -> tuple[int, ...]:
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ConfigError(f"{source}: field {name!r} must be a token id or a list of token ids, got {value!r}")
    return tuple(items)


# integer fields: (lowest, highest) allowed. The highs are far above any released model and keep a typo (1e9, 1e10)
# from sizing tensors of terabytes or loops of billions before a checkpoint is even read.
_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 4_194_304),
    "hidden_size": (1, 65_536),
    "num_hidden_layers": (1, 1_024),
    "num_attention_heads": (1, 1_024),
    "num_key_value_heads": (1, 1_024),
    "head_dim": (1, 4_096),
    "linear_num_key_heads": (1, 1_024),
    "linear_num_value_heads": (1, 1_024),
    "linear_key_head_dim": (1, 4_096),
    "linear_value_head_dim": (1, 4_096),
    "linear_conv_kernel_dim": (1, 64),
    "num_experts": (1, 4_096),
    "num_experts_per_tok": (1, 4_096),
    "moe_intermediate_size": (1, 262_144),
    "shared_expert_intermediate_size": (0, 262_144),
    "max_position_embeddings": (1, 16_777_216),
    "full_attention_interval": (1, 1_024),
}


# config.json's diffusion defaults are held to the ranges of the request parameters they default
_BLOCK, _THRESHOLD = GENERATION_LIMITS["block_size"], GENERATION_LIMITS["threshold"]


def _checked_int(source: str, name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{source}: field {name!r} must be an integer from {lo:,} to {hi:,}, got {value!r}")
    return value


def _checked_float(source: str, name: str, value: Any, lo: float, hi: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        raise ConfigError(f"{source}: field {name!r} must be a number from {lo:g} to {hi:g}, got {value!r}")
    return float(value)


def parse_config(data: dict[str, Any], source: str = "config.json") -> CloverConfig:
    """Build a :class:`CloverConfig` from a config.json dict. ``source`` names the file in errors."""
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported (expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    text = data
    prefix = "model."
    if model_type == "qwen3_5_moe" or "text_config" in data:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: field 'text_config' is missing or not an object (needed for {model_type})")
        prefix = "model.language_model."
    if model_type == "clover_moe":
        prefix = data.get("weight_prefix", text.get("weight_prefix", "model.language_model."))

    def get(name: str, default: Any = None) -> Any:
        if name in text:
            return text[name]
        return data.get(name, default)

    missing = [name for name in _REQUIRED if get(name) is None]
    if missing:
        raise ConfigError(f"{source}: missing required field(s): {', '.join(missing)}")

    def as_int(name: str, default: Any = None) -> int:
        value = get(name, default)
        lo, hi = _INT_BOUNDS.get(name, (0, 2**31 - 1))
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or int(value) != value or not lo <= value <= hi:
            raise ConfigError(f"{source}: field {name!r} must be an integer from {lo:,} to {hi:,}, got {value!r}")
        return int(value)

    def as_float(name: str, default: float, lo: float, hi: float, container: dict[str, Any] | None = None) -> float:
        value = (container if container is not None else text).get(name, get(name, default))
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not lo <= value <= hi:
            raise ConfigError(f"{source}: field {name!r} must be a number from {lo:g} to {hi:g}, got {value!r}")
        return float(value)

    n_layers = as_int("num_hidden_layers")
    layer_types = get("layer_types")
    if layer_types is None:
        interval = as_int("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ConfigError(f"{source}: field 'layer_types' must be a list of layer type names, got {layer_types!r}")
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"{source}: field 'layer_types' has {len(layer_types)} entries for {n_layers} layers")
    bad = [t for t in layer_types if t not in ("full_attention", "linear_attention")]
    if bad:
        raise ConfigError(f"{source}: field 'layer_types' has unknown layer type {bad[0]!r}")

    rope = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' must be an object, got {rope!r}")
    rope_theta = as_float("rope_theta", 10_000_000.0, 1.0, 1e12, rope)
    partial = as_float("partial_rotary_factor", 0.25, 0.0, 1.0, rope)

    hidden = as_int("hidden_size")
    n_heads = as_int("num_attention_heads")
    head_dim = as_int("head_dim", hidden // max(n_heads, 1))
    eos = _as_int_tuple(get("eos_token_id"), source) or QWEN_EOS_IDS
    is_clover = model_type == "clover_moe"
    dllm = get("dllm_config", {}) or {}

    def opt(name: str, default: Any) -> Any:
        return dllm.get(name, get(name, default))

    cfg = CloverConfig(
        model_type=model_type,
        vocab_size=as_int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=as_int("num_key_value_heads"),
        head_dim=head_dim,
        linear_num_key_heads=as_int("linear_num_key_heads"),
        linear_num_value_heads=as_int("linear_num_value_heads"),
        linear_key_head_dim=as_int("linear_key_head_dim"),
        linear_value_head_dim=as_int("linear_value_head_dim"),
        linear_conv_kernel_dim=as_int("linear_conv_kernel_dim", 4),
        num_experts=as_int("num_experts"),
        num_experts_per_tok=as_int("num_experts_per_tok"),
        moe_intermediate_size=as_int("moe_intermediate_size"),
        shared_expert_intermediate_size=as_int("shared_expert_intermediate_size"),
        layer_types=layer_types,
        rms_norm_eps=as_float("rms_norm_eps", 1e-6, 0.0, 1.0),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        max_position_embeddings=as_int("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", get("tie_word_embeddings", False))),
        attention_bias=bool(get("attention_bias", False)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        weight_prefix=prefix,
        eos_token_ids=eos,
        is_diffusion=is_clover,
        block_size=_checked_int(source, "block_size", opt("block_size", DEFAULT_BLOCK_SIZE), int(_BLOCK.lo), int(_BLOCK.hi)),
        threshold=_checked_float(source, "threshold", opt("threshold", DEFAULT_THRESHOLD), _THRESHOLD.lo, _THRESHOLD.hi),
        mask_token_id=opt("mask_token_id", None),
        think_end_token_id=opt("think_end_token_id", QWEN_THINK_END_ID),
        shift_logits=bool(opt("shift_logits", False)),
        moe_block_coreset_enabled=bool(opt("moe_block_coreset_enabled", is_clover)),
        moe_block_coreset_top_p=_checked_float(source, "moe_block_coreset_top_p", opt("moe_block_coreset_top_p", 0.9), 0.0, 1.0),
    )
    switches = {f.name for f in fields(CloverConfig) if f.name.startswith(("bd_", "coreset_"))}
    overrides = {name: opt(name, None) for name in switches}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        cfg = replace(cfg, **overrides)
    for name, allowed in _SWITCH_VALUES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{source}: field {name!r} is {getattr(cfg, name)!r}; expected one of {', '.join(allowed)}")
    for name, token in (("mask_token_id", cfg.mask_token_id), ("think_end_token_id", opt("think_end_token_id", None))):
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < cfg.vocab_size):
            raise ConfigError(f"{source}: field {name!r} must be a token id from 0 to {cfg.vocab_size - 1}, got {token!r}")
    bad_eos = [t for t in cfg.eos_token_ids if not 0 <= t < cfg.vocab_size]
    if bad_eos and get("eos_token_id") is not None:
        raise ConfigError(f"{source}: field 'eos_token_id' has {bad_eos[0]}, outside the vocabulary (0 to {cfg.vocab_size - 1})")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok {cfg.num_experts_per_tok} > num_experts {cfg.num_experts}")
    if cfg.linear_num_value_heads % max(cfg.linear_num_key_heads, 1):
        raise ConfigError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    return cfg


def load_config(model_dir: str | Path) -> CloverConfig:
    """Read ``config.json`` of a model folder."""
    path = Path(model_dir) / "config.json"
    return parse_config(_read_json(path), source=str(path))


def load_generation_defaults(model_dir: str | Path, config: CloverConfig | None = None) -> GenerationDefaults:
    """Read ``generation_config.json`` (optional: absent means plain greedy with the config's EOS ids)."""
    path = Path(model_dir) / "generation_config.json"
    data = _read_json(path) if path.exists() else {}
    return parse_generation_config(data, str(path), config)


# generation_config.json's token ids: each an id (eos: or a list of ids) inside the vocabulary
_GENERATION_TOKEN_FIELDS = ("eos_token_id", "pad_token_id", "bos_token_id", "mask_token_id", "decoder_start_token_id")


def parse_generation_config(
    data: dict[str, Any], source: str = "generation_config.json", config: CloverConfig | None = None
) -> GenerationDefaults:
    """Build :class:`GenerationDefaults` from a generation_config.json dict, every field checked before any is used:
    numbers against ``engine.decode.limits.GENERATION_LIMITS`` (the ranges requests are held to), ``do_sample`` a boolean,
    token ids inside ``config``'s vocabulary. A bad one is a ConfigError naming ``source``, the field and what is
    allowed. ``null`` means absent; keys this app does not read are kept in ``extra``."""
    for name, value in data.items():
        limit = GENERATION_LIMITS.get(name)
        if value is not None and limit is not None and not limit.accepts(value):
            raise ConfigError(f"{source}: field {name!r} must be {limit.allowed}, got {value!r}")
    if data.get("do_sample") is not None and not isinstance(data["do_sample"], bool):
        raise ConfigError(f"{source}: field 'do_sample' must be true or false, got {data['do_sample']!r}")
    for name in _GENERATION_TOKEN_FIELDS:
        ids = _as_int_tuple(data.get(name), source, name)
        outside = [t for t in ids if config is not None and t >= config.vocab_size]
        if outside:
            raise ConfigError(
                f"{source}: field {name!r} has {outside[0]}, outside the vocabulary (0 to {config.vocab_size - 1})"
            )
    known = {f.name for f in fields(GenerationDefaults)} - {"extra", "eos_token_ids"}
    kwargs: dict[str, Any] = {}
    for name in known:
        if data.get(name) is not None:
            kwargs[name] = type(getattr(GenerationDefaults, name))(data[name])  # int -> float where a float is kept
    eos = _as_int_tuple(data.get("eos_token_id"), source) or (config.eos_token_ids if config else QWEN_EOS_IDS)
    extra = {k: v for k, v in data.items() if k not in known and k != "eos_token_id"}
    return GenerationDefaults(eos_token_ids=eos, extra=extra, **kwargs)
