"""Compiled decoder layers: ``torch.compile`` applied per layer ("regional" compilation).

Every decoder layer of one kind (Gated DeltaNet or full attention) runs the same code on its own weights and its own
cache tensors (``ModelCache.layer``), so one compiled graph per kind and pass shape serves all 40 layers: compiling
costs a handful of graphs, not 40 copies, and a new position in the cache is a symbolic size (``dynamic=True``),
not a recompile. The layer's parameters are graph inputs (torch's default of inlining built-in modules), so the
placement the plan chose (resident or streamed experts, host or device) is untouched.

What it buys is measured, not assumed: ``clover-desk bench speed --compile`` prints the eager and the compiled
figures side by side with the greedy tokens of both. On the CPU (inductor's C++ kernels, on torch's threads: see
below) the one-row products of an AR step and its one-query attention are written out in the model when compiled
(``engine.model.clover.Linear``, ``Attention``), so they join the generated kernels instead of calling MKL's gemv and the
flash kernel, the AR step runs as one graph over all the layers (``CloverModel.step_graph``) and the loop's
steady steps skip the guards that cannot fail (:func:`steady_state`). Measured on 2 cores, deep-narrow shape: 34
tok/s eager, ~107-120 compiled layer by layer, ~147-168 with the whole-step graph on one thread per kernel, ~188
on two (llama.cpp ~202 on the same weights, same run). On CUDA the same graphs run as Triton kernels, and the AR steps and the whole-block passes (denoising and
commit) are replayed from CUDA graphs (``engine.kernels.step_graphs``: the position as a tensor, the keys read to a fixed
length bucket and masked; cut around the routed experts that read the host); neither is measured yet.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from clover_desk.engine.kernels import step_graphs
from clover_desk.engine.model.experts import grouped_mm_supported
from clover_desk.engine.model.layers import Linear

log = logging.getLogger(__name__)

# Variants of the one layer code object that a run meets: {GDN, attention} x {causal prefill segment, AR step,
# denoising pass, commit pass, short last segment}, each with its own shapes; torch's default limit (8) would make
# the later ones silently fall back to eager.
RECOMPILE_LIMIT = 64


def compile_layers(
    model: Any, *, backend: str = "inductor", mode: str | None = None, whole_step: bool = True
) -> int:
    """Compile every decoder layer of ``model`` in place; returns how many were wrapped. Compiling happens on the
    first forward of each pass shape (tens of seconds on the CPU the first time; inductor caches its kernels on
    disk, so later runs start faster).

    ``whole_step``: also make the AR step one call (``CloverModel.step_graph``, used for the passes
    ``CloverModel.is_hot_pass`` selects). On a GPU that is the step replayed from CUDA graphs
    (``engine.kernels.step_graphs``: one replay instead of ~4,000 launches; the routed experts that read the host, such as
    streamed ones, eager between replays), and the denoising and commit passes are too (``CloverModel.pass_graph``);
    on the CPU without streamed layers, the step compiled as one graph
    over all the layers and the head, with one guard check instead of 40 (the compiled layers are inlined in it):
    deep-narrow shape on 2 CPU cores, ~107-120 tok/s layer by layer, ~147-168 as one graph, same tokens; the
    first compile of that graph takes 1-2 minutes there (under one once inductor's cache has it). The other
    passes (prefill segments, denoising and commit passes) run layer by layer."""
    import torch._dynamo

    limit_name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit_name, max(getattr(torch._dynamo.config, limit_name), RECOMPILE_LIMIT))
    # accumulated_* caps the total over all code objects
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * RECOMPILE_LIMIT))
    if next(model.parameters()).device.type == "cpu":
        import torch._inductor.config as inductor_config

        # Generated CPU kernels run on torch's threads, as the eager ops and the extern matrix products do: an AR
        # step's routed experts are a gather-and-multiply kernel that reads each expert's weights once, bound by
        # memory bandwidth, which one thread leaves half unused. Measured (2 cores, quiet machine, greedy AR,
        # compiled): mid 133 -> 202-225 tok/s, deep-narrow 142 -> 192-195 with 2 threads instead of 1 (mid
        # 94-103 -> 125-131 in an interleaved A/B at a slower hour of this shared machine). With one
        # of the 2 cores busy elsewhere every OpenMP region waits for a descheduled thread: deep-narrow 95-119 on
        # 1 thread against 49-61 on 2 (eager on 2 threads: 50 -> 10). So the thread count is torch's one knob
        # (torch.set_num_threads, OMP_NUM_THREADS), for generated and library kernels alike.
        inductor_config.cpp.threads = torch.get_num_threads()

    # Probed now, eagerly: probed inside the first traced forward, the probe's cache (a dict) was empty there, so that
    # graph was guarded on its emptiness and never matched again (the first request's prefill then recompiled: ~1 s)
    grouped_mm_supported(next(model.parameters()).device, getattr(model, "dtype", torch.float32))
    n = 0
    for layer in model.layers:
        layer.compile(backend=backend, mode=mode, dynamic=True)
        n += 1

    if type(model.lm_head) is Linear:  # a plain head: its one-row product joins the generated kernels too
        model.head = torch.compile(model.head, backend=backend, mode=mode, dynamic=True)
    if whole_step and hasattr(model, "step_graph"):

        # the layers that fetch in an AR step (a zero-copy bank reads its experts in place: traced like a resident one)
        streamed = step_graphs.streamed_layers(model, pairs=model.config.num_experts_per_tok)
        if model.device.type == "cuda":  # CUDA graphs, cut around the experts that read the host
            model.step_graph = model.pass_graph = step_graphs.StepGraphs(model)
        elif streamed:
            # a streamed bank's host-side fetch is never traced: a whole-step graph would be split around every
            # streamed layer, and its pieces' guards differ from step to step; the layers stay compiled one by one
            log.info("AR step not compiled whole: layers %d..%d stream their experts", streamed[0], streamed[-1])
        else:
            model.step_graph = torch.compile(model._forward_pass, backend=backend, mode=mode, dynamic=True)
    model.compiled = True
    log.info("compiled %d decoder layers (backend %s)", n, backend)
    return n


def uncompile_layers(model: Any) -> None:
    """Undo :func:`compile_layers`: the layers, the head and the step run eagerly again (a compile cancelled half way
    leaves a usable model, the same numbers as before it was compiled)."""
    for layer in model.layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set
    if "head" in vars(model):  # the compiled head was set on the instance, over the class's method
        del model.head
    if hasattr(model, "step_graph"):
        model.step_graph = None
    if hasattr(model, "pass_graph"):
        model.pass_graph = None
    model.compiled = False
    log.info("decoder layers uncompiled: running eagerly")


def is_compiled(model: Any) -> bool:
    return bool(getattr(model, "compiled", False))


def steady_state(model: Any) -> contextlib.AbstractContextManager[Any]:
    """Context for one AR step of a compiled model after its first two: dynamo checks only the guards that tell
    its compiled variants apart (``skip_guard_eval_unsafe``), not every parameter's dtype, shape and stride on
    every one of 40 layer calls. The AR loop's inputs are then the same kinds of objects step after step (one
    token, the same cache tensors, a position that is a symbolic size), so no step can need a graph that the first
    two did not already compile or select. Measured on the deep-narrow shape (CPU, 2 threads): ~101 -> ~108 tok/s.
    Not used for diffusion passes, whose shapes (commit, last partial block) can first occur mid-loop.
    A plain context for an eager model."""
    if not is_compiled(model):
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def unavailable(device_type: str) -> str | None:
    """Why :func:`compile_layers` cannot work on this machine for ``device_type`` ("cpu" | "cuda"), or None.
    Inductor generates C++ for the CPU (it needs a C++ compiler: g++ on Linux, clang++ on macOS, MSVC's cl on
    Windows) and Triton for CUDA (bundled with Linux CUDA builds of torch, not always elsewhere). Checked at load, so
    that the window can say why a model runs uncompiled instead of failing at the first request."""
    import importlib.util
    import os
    import shutil

    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on a GPU needs Triton, which is not installed (pip install triton)"
        return None
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++", "cl"]
    if not any(name and shutil.which(name) for name in compilers):
        return "torch.compile on the CPU needs a C++ compiler (g++, clang++ or MSVC's cl), and none was found"
    return None
