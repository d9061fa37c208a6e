"""The random model ``clover-desk bench speed`` times: its shapes (built from a config, no checkpoint), the
random init, the quantized card variant, and the timing helpers the bench's modules share."""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from clover_desk.engine.placement.manifest import shape_fields

SHAPES: dict[str, dict[str, Any]] = {
    "mid": dict(
        vocab_size=4096, layers=8, hidden=512, experts=64, experts_per_tok=8, heads=8, kv_heads=2, head_dim=64,
        linear_key_heads=4, linear_value_heads=8, linear_head_dim=64, moe_intermediate=256, shared_intermediate=256,
    ),
    "deep-narrow": dict(  # the full depth and expert count at tiny widths: a token costs ~no arithmetic, so the
        # figures are the per-token framework overhead (the one-plan / fast-path issues' comparison shape)
        vocab_size=4096, layers=40, hidden=128, experts=256, experts_per_tok=8, heads=4, kv_heads=2, head_dim=32,
        linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, moe_intermediate=64, shared_intermediate=64,
    ),
    "tiny": dict(  # for tests of this command
        vocab_size=512, layers=4, hidden=64, experts=8, experts_per_tok=2, heads=4, kv_heads=2, head_dim=16,
        linear_key_heads=2, linear_value_heads=4, linear_head_dim=16, moe_intermediate=32, shared_intermediate=32,
    ),
    "clover-35b-a3b": shape_fields("clover-35b-a3b"),  # the planner's shape (engine.placement.manifest.SHAPES)
}
# Special ids for the random vocabularies (any ids work for speed; these mirror the tiny tokenizer's order).
SPECIAL = {"<|endoftext|>": 0, "<|im_end|>": 2, "</think>": 4, "<|mask|>": 5}

MIB = 2**20


def _config(shape: str, model_type: str, layers: int | None = None) -> tuple[dict[str, Any], Any]:
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["layers"] = layers
    text = tiny_text_config(**fields)
    data = config_dict_for(model_type, text, SPECIAL)
    return data, parse_config(data, source=f"bench shape {shape}")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], repeats: int, device: str) -> float:
    """Best wall time of ``repeats`` calls after one warm-up (seconds)."""
    fn()
    _sync(device)
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _random_init_(model: Any, seed: int) -> None:
    """Fill a model's (uninitialized) parameters in place, on their own device, with scales that keep activations
    and logits in a realistic range: fan-in scaled matrices, small zero-centred norms, GDN decays in range."""
    import torch

    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(math.log(0.05), math.log(2.0), generator=gen)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0, generator=gen)
            elif name.endswith("linear_attn.norm.weight") or name.endswith("bd_logit_scale.weight"):
                p.uniform_(0.8, 1.2, generator=gen)  # plain-weight norm / ln(L) coefficient
            elif p.dim() == 1:
                p.normal_(0.0, 0.1, generator=gen)  # zero-centred (1 + w) norms, history bias
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 2.0 * p.shape[-1] ** -0.5, generator=gen)  # a peaky router
            else:
                p.normal_(0.0, 0.5 * p.shape[-1] ** -0.5, generator=gen)


def _build_random_model(config: Any, dtype: Any, device: str, seed: int, quant: str = "none") -> Any:
    from clover_desk.engine.model.clover import CloverModel

    model = CloverModel(config, dtype=dtype, device=device)
    _random_init_(model, seed)
    if quant == "card":
        from clover_desk.engine.weights.quant import quantize_model_

        quantize_model_(model)  # the default policy: NF4 experts, INT8 projections / shared experts / LM head
    return model.eval()


@contextlib.contextmanager
def _dispatch_as_on_a_gpu() -> Iterator[None]:
    """Within: the choices engine code makes by device type made as on a GPU, so that a CPU count describes the
    card's forward: expert groups sized by ``engine.model.experts.GROUP_BYTES["cuda"]`` (on the CPU a group is one expert,
    named by a host read of its id), and no CPU int8 GEMV (``engine.weights.quant.INT8_GEMV_MAX_ROWS``) for projections
    and the LM head, which a GPU dequantizes in chunks."""
    from clover_desk.engine.model import experts
    from clover_desk.engine.weights import quant

    groups, gemv = experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS
    experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS = experts.GROUP_BYTES["cuda"], 0
    try:
        yield
    finally:
        experts.GROUP_BYTES["cpu"], quant.INT8_GEMV_MAX_ROWS = groups, gemv


def _device_dtype(args: argparse.Namespace) -> tuple[str, Any]:
    """``--device`` (refused in one line when CUDA is asked for and absent) and ``--dtype`` (default: bf16 on CUDA,
    fp32 on the CPU)."""
    import torch

    from clover_desk.engine.api import parse_dtype
    from clover_desk.engine.errors import ConfigError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but CUDA is not available here")
    return args.device, parse_dtype(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))



def _settings(config: Any, mode: str, max_new: int) -> Any:
    from clover_desk.engine.decode.settings import DecodeSettings

    return DecodeSettings(
        mode=mode, max_new_tokens=max_new, block_size=config.block_size, threshold=config.threshold,
        mask_token_id=config.mask_token_id, eos_token_ids=(), max_positions=config.max_position_embeddings,
        shift_logits=config.shift_logits,
    )


def _finished(events: Any) -> Any:
    from clover_desk.engine.decode.events import Finished

    last = None
    for event in events:
        last = event
    assert isinstance(last, Finished)
    return last




def _check_stream(args: argparse.Namespace, config: Any) -> None:
    """``--stream N`` names at most the model's layers (checked from the config, before the model is built)."""
    from clover_desk.engine.errors import ConfigError

    n = config.num_hidden_layers
    if args.stream is not None and args.stream > n:
        raise ConfigError(f"--stream {args.stream}: the model has {n} layers (allowed: 1..{n})")


def _place(model: Any, config: Any, args: argparse.Namespace, device: str) -> Any:
    """Place the experts as a plan says (``--vram-gb``: the planner's plan for the shape; ``--stream N``: the last N
    layers streamed), and on CUDA cap the process at ``--vram-gb``. Returns the plan (None for ``--stream``). The
    flags' combinations and ``--stream``'s range were checked before the model was built (``_run``)."""
    import torch

    from clover_desk.engine.errors import ConfigError
    from clover_desk.engine.placement import placer

    n = config.num_hidden_layers
    if args.stream is not None:
        plan = None
        streamed = list(range(n - args.stream, n))
        # two tokens' experts per streamed layer, and at least one whole layer's (a prompt or a pass may touch all)
        slots = max(2 * config.num_experts_per_tok * len(streamed), config.num_experts)
    else:
        from clover_desk.engine.placement.planner import SHAPE_PREFIX, plan_model, probe_hardware

        plan = plan_model(SHAPE_PREFIX + args.shape, args.vram_budget_bytes, 4096, probe_hardware())
        if not plan.fits:
            raise ConfigError(f"--vram-gb {args.vram_budget_bytes / 2**30:g}: {plan.reason}")
        streamed = [i for i in plan.streamed_expert_layers if i < n]
        slots = plan.slot_pool_experts
    resident = [i for i in range(n) if i not in streamed]
    # the planner keeps the embedding table in host memory (a lookup sends T rows): so does the card's path
    rt = placer.apply_plan(model, placer.SimplePlan(tuple(resident), tuple(streamed), slots), device,
                            host_embedding=args.vram_budget_bytes is not None, device_pool=args.device_pool)
    print(f"placed: {len(resident)} resident / {len(streamed)} streamed expert layers, slot pool of {slots} experts")
    if args.device_pool:
        print(f"device slot tables: {'on' if rt.tables is not None else 'refused: ' + rt.device_pool_refused}")
    if device == "cuda" and args.vram_budget_bytes is not None:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_budget_bytes / total))
        print(f"process capped at {args.vram_budget_bytes / 2**30:g} GiB of {total / 2**30:.0f} GiB")
    return plan


