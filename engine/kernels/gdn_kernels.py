"""Gated DeltaNet on CUDA through flash-linear-attention's Triton kernels (the ``fla-core`` package), in place of
the pure-PyTorch rule in :mod:`engine.model.clover` for the forwards that have no Clover extras:

- an AR step (one token, causal, with a cache): ``fused_recurrent_gated_delta_rule``, one kernel for the decay,
  the delta update and the read, instead of ~8 small torch ops;
- a causal prefill (an AR prompt): ``chunk_gated_delta_rule``, a handful of kernels for the whole prompt, instead of
  the PyTorch loop over 32-token chunks (one iteration per chunk, each a few kernels).

On the CPU, an AR step (eager, the CPU kernels built) takes one C call instead (:func:`cpu_step`,
``clover_gdn_step`` in ``csrc/quant_cpu.c``): the decay, S^T k, the delta update and the read in two sweeps over
each head's state (in the rule's order of operations), the update written in place into the cache. At the real
widths (32 heads of 128 x 128, a 2 MiB fp32 state) the torch rule made ~8 passes over the state, each into a
fresh 2 MiB temporary. A float32 layer goes further (:func:`cpu_token`, ``clover_gdn_conv`` and
``clover_gdn_token``): between its input projections and ``out_proj``, the short convolution is one C call and
the l2norms, the step and the gated RMSNorm another, around four torch ops (the SiLUs, the gates), in place of
~60 small torch ops (each a few microseconds of dispatch and a fresh tensor). Both follow the torch forward's
order of operations, sums included (:func:`cpu_token`), so the tokens are the torch forward's.

Block-mode forwards (the diffusion prompt, the 32-slot denoising and commit passes) keep the PyTorch rule on a GPU:
they need each block's start state and its pure read for the history unit, and the right convolution's state path,
which fla's kernels do not return. On the CPU they take one C call for the mixer between its projections
(:mod:`engine.kernels.cpu_block`); the PyTorch rule stays the reference.

Layouts: ours are q, k [T, Hv, dk] (l2-normed, q already scaled, so ``scale=1``), v [T, Hv, dv], g (log decay),
beta [T, Hv], state [Hv, dk, dv], all float32; fla's add a batch dimension in front and keep the state [K, V]
(``state_v_first=False``), the same as ours. Both are wrapped as ``torch.library`` custom ops with fake
implementations, so a compiled layer traces through them as one opaque op each (no graph break), and a CUDA graph
records them like any kernel.

Status: tested on the CPU with ``TRITON_INTERPRET=1`` (``tests/engine/test_gdn_kernels.py``: equal to the PyTorch rule
within float32 rounding, greedy tokens identical on a tiny model, a compiled layer traces with ``fullgraph=True``);
**not measured on a GPU**, so it is opt-in: ``engine.settings.GpuPaths.fla_gdn`` (the switch ``CLOVER_DESK_FLA_GDN=1``) with ``fla-core`` installed
(``pip install 'clover-desk[cuda]'``). Under Triton's interpreter (``TRITON_INTERPRET=1``) the same switch takes the
kernels on the CPU too, which is how the tests run them. ``clover-desk bench speed --moe-only`` on CUDA times one GDN
layer's AR step and prefill both ways at the 35B shape.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from clover_desk.engine.kernels import cpu_quant
from clover_desk.engine.kernels.torch_lanes import torch_lanes

# engine.settings.GpuPaths.fla_gdn, set by engine.kernels.switches.use at load (set_enabled): a module constant, so a
# compiled layer sees a constant, not a lookup per forward. TRITON_INTERPRET is Triton's own switch, read as Triton does.
OPTED_IN = False
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Read once at import: a compiled layer sees constants.
AVAILABLE = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def set_enabled(on: bool) -> bool:
    """Turn fla's kernels on or off for this process (``GpuPaths.fla_gdn``); returns the previous setting."""
    global OPTED_IN
    before, OPTED_IN = OPTED_IN, bool(on)
    return before


def enabled(x: Tensor) -> bool:
    """Whether a GDN forward on ``x``'s device takes fla's kernels (see the module: opted in, fla installed, and
    CUDA, or the CPU under Triton's interpreter)."""
    return OPTED_IN and AVAILABLE and (x.is_cuda or INTERPRETED)


def cpu_step_enabled(x: Tensor) -> bool:
    """Whether a GDN AR step on ``x`` takes the fused C step (``cpu_quant.gdn_step``): the CPU, eager (a compiled
    layer keeps the torch rule, which inductor fuses itself), and the CPU kernels on and built
    (``GpuPaths.cpu_kernels``)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and cpu_quant.usable()


def cpu_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
             in_place: bool) -> Tensor:
    """One token through the gated delta rule on the CPU in one C call (q, k [1, H, dk], v [1, H, dv], g, beta
    [1, H], state [H, dk, dv] fp32) -> O [1, H, dv]. ``in_place``: the state is updated where it lies (an AR step
    that writes its cache); else it is left as it is and the final state is not computed (a forward that writes
    no cache). Equal to :func:`engine.model.clover.recurrent_gated_delta_rule` within float32 rounding."""
    return cpu_quant.gdn_step(q[0], k[0], v[0], g[0], beta[0], state, state if in_place else None)[None]


def cpu_token_ready(x: Tensor, *tensors: Tensor) -> bool:
    """Whether a GDN layer's one-token mixer on ``x`` takes the C calls (:func:`cpu_token`): the C step's conditions
    (:func:`cpu_step_enabled`), fla's kernels not taken, and ``x`` and every one of ``tensors`` (its states and
    parameters) contiguous float32."""
    return not enabled(x) and cpu_step_enabled(x) and all(
        t.dtype == torch.float32 and t.is_contiguous() for t in (x, *tensors))


def cpu_token(mixed: Tensor, z: Tensor, beta: Tensor, g: Tensor, conv: tuple[Tensor, Tensor],
              norm: tuple[Tensor, float], state: Tensor, in_place: bool) -> Tensor:
    """A GDN layer's one-token mixer between its input projections (mixed [1, C] raw, z [1, Hv * dv]) and its
    gates (beta, g [1, Hv]) and ``out_proj``: the short convolution (``conv``: weight [C, K], state [K-1, C]; one C
    call), its SiLU and SiLU(z) (torch), then the l2norms, the delta rule and the gated RMSNorm (``norm``: weight
    [dv], eps; one C call) -> y [1, Hv * dv]. Every sum and product in the torch forward's order, so the results are
    its bits where torch's sums run over vectors of ``torch_lanes()`` floats. ``in_place``: the recurrent state and the
    conv state are updated where they lie (an AR step that writes its cache); else both are left as they are."""
    weight, conv_state = conv
    left = cpu_quant.gdn_conv(mixed.reshape(-1), weight, conv_state, conv_state if in_place else None)
    y = cpu_quant.gdn_token(F.silu(left), F.silu(z.reshape(-1)), beta.reshape(-1), g.reshape(-1), norm, state,
                            state if in_place else None, torch_lanes())
    return y[None]


def _fla():  # imported on first use only: fla warns on import where no GPU backend is active
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> None:
    t, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (t, h) or g.shape != (t, h) or beta.shape != (t, h) \
            or state.shape != (h, dk, dv):
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, state {tuple(state.shape)} do not match [T, H, dk], [T, H, dv], [T, H], "
            "[H, dk, dv]"
        )


def _run(kernel: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence through fla's ``kernel`` ("chunked" | "recurrent"): our layouts in, a batch of one for fla."""
    _check(q, k, v, g, beta, state)
    chunk, fused = _fla()
    o, final = (chunk if kernel == "chunked" else fused)(
        q[None], k[None], v[None], g=g[None], beta=beta[None], scale=1.0, initial_state=state[None],
        output_final_state=True,
    )
    return o[0], final[0]


@torch.library.custom_op("clover_desk::gdn_recurrent", mutates_args=())
def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (fla's fused recurrent kernel). Same arguments and results as
    :func:`engine.model.clover.recurrent_gated_delta_rule`: (O [T, H, dv], final state [H, dk, dv])."""
    return _run("recurrent", q, k, v, g, beta, state)


@torch.library.custom_op("clover_desk::gdn_chunked", mutates_args=())
def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule (fla's chunk kernels, 64-token chunks from the first token). Same arguments and
    results as :func:`engine.model.clover.chunk_gated_delta_rule`; equal to it up to float rounding (the chunk boundaries
    differ when the prompt does not start at a multiple of 64, which changes only the order of the sums)."""
    return _run("chunked", q, k, v, g, beta, state)


def _fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    return v.new_empty(v.shape), state.new_empty(state.shape)


recurrent.register_fake(_fake)
chunked.register_fake(_fake)
