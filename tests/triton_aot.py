"""Compile the engine's Triton kernels for NVIDIA GPUs on a machine without one (run as a script in a child process,
without ``TRITON_INTERPRET``): every launch the engine makes is recorded with its real arguments (the kernels
replaced by recorders, the launching code run on CPU tensors), its signature derived from them, and the kernel
compiled ahead of time for each target with Triton's own compiler and ptxas. Prints one JSON object per compiled
launch: kernel, what launched it, target, and the resource use cuobjdump reports (registers, stack, local memory:
a stack or local figure above zero is registers spilled to memory).

What this catches that the interpreter cannot: code that only fails when lowered to a GPU (types, layouts, tl.dot
shapes, ops the backend lacks), per target, and kernels that spill. It runs nothing on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

# (label, target compute capability): the product's card first
TARGETS = {"sm_89": 89, "sm_90": 90, "sm_120": 120}  # RTX 40 series, H100/H200, RTX 50 series
MOE_SHAPE = (256, 2048, 512)  # experts, hidden, expert intermediate: the 35B shape
TORCH_TO_TRITON = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8",
                   torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64"}


Launch = tuple[Any, str, tuple[Any, ...], dict[str, Any]]  # kernel, what launched it, arguments, launch options


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` records the launch instead of running it."""

    def __init__(self, kernel: Any, launches: list[Launch], label: list[str]) -> None:
        self.kernel, self.launches, self.label = kernel, launches, label

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **options: Any) -> None:  # options: num_warps, num_stages
            self.launches.append((self.kernel, self.label[0], args, options))

        return launch


def launches() -> Iterator[Launch]:
    """Every distinct kernel launch of the engine's fused paths at the 35B shape: NF4 experts for an AR step
    (per pair) and a 32-slot pass (grouped; bf16, and fp32 with IEEE products), the GGUF expert types of the
    official files (Q4_0; Q4_K_M: Q4_K gate/up, Q6_K down; Q8_0) and Q5_K, the int8 LM head at 1 and 32 rows,
    and the GGUF dequantize kernel."""
    import clover_desk.engine.kernels.triton_copy_kernels as copy_kernels
    import clover_desk.engine.kernels.triton_linear_kernels as linear_kernels
    import clover_desk.engine.kernels.triton_moe_kernels as moe_kernels
    from clover_desk.engine.kernels import triton_copy, triton_linear, triton_moe
    from clover_desk.engine.weights.gguf import quants as gq
    from clover_desk.engine.weights.gguf.model import GGUFExpertLayout
    from clover_desk.engine.weights.quant import ExpertLayout

    recorded: list[Launch] = []
    label = [""]
    names = ("gate_up_kernel", "down_kernel", "grouped_gate_up_kernel", "grouped_down_kernel", "gguf_dequant_kernel")
    saved = {name: getattr(moe_kernels, name) for name in names}
    saved_linear = linear_kernels.int8_linear_kernel
    copy_names = ("place_kernel", "place_set_kernel", "copy_rows_kernel")
    saved_copy = {name: getattr(copy_kernels, name) for name in copy_names}
    try:
        for name in copy_names:
            setattr(copy_kernels, name, _Recorder(saved_copy[name], recorded, label))
        for name in names:
            setattr(moe_kernels, name, _Recorder(saved[name], recorded, label))
        linear_kernels.int8_linear_kernel = _Recorder(saved_linear, recorded, label)
        e, d, i = MOE_SHAPE
        gen = torch.Generator().manual_seed(0)

        def moe(name: str, fn: Callable[..., Any], layout: Any, t: int, dtype: torch.dtype) -> None:
            label[0] = f"{name} T={t} {str(dtype).replace('torch.', '')}"
            pool = torch.zeros(16, layout.nbytes, dtype=torch.uint8)
            rows = torch.randint(0, 16, (t, 8), generator=gen)
            fn(torch.zeros(t, d, dtype=dtype), pool, layout, rows, torch.rand(t, 8, generator=gen))

        nf4 = ExpertLayout.build(e, d, i, "nf4", 64)
        for t, dtype in ((1, torch.bfloat16), (32, torch.bfloat16), (32, torch.float32)):
            moe("nf4", triton_moe.fused_nf4_moe, nf4, t, dtype)
        for name, qtypes in (("q4_0", (gq.Q4_0,) * 3), ("q4_k_m", (gq.Q4_K, gq.Q4_K, gq.Q6_K)),
                             ("q8_0", (gq.Q8_0,) * 3), ("q5_k", (gq.Q5_K,) * 3)):
            for t in (1, 32):
                moe(name, triton_moe.fused_gguf_moe, GGUFExpertLayout(e, d, i, qtypes), t, torch.bfloat16)
        codes = torch.zeros(4096, d, dtype=torch.int8)  # the LM head's kernel: its shape is a runtime argument
        for r in (1, 32):
            label[0] = f"int8 head R={r} bfloat16"
            triton_linear.int8_linear(torch.zeros(r, d, dtype=torch.bfloat16), codes, torch.ones(4096))
        label[0] = "gguf dequantize q6_k"
        triton_moe.gguf_dequantize(torch.zeros(4, 210 * d // 256, dtype=torch.uint8), gq.Q6_K, d)
        # the device pool's two kernels (engine.placement.device_pool) at the 16 GiB plan: 17 streamed layers, 1,565 slots
        slots, streamed = 1565, 17
        tables = SimpleNamespace(
            E=e, S=slots, slot_of=torch.full((streamed * e + 1,), -1), key_of=torch.full((slots + 1,), -1),
            stamp=torch.zeros(slots + 1, dtype=torch.long), fresh=torch.zeros(slots + 1, dtype=torch.bool),
            tick=torch.zeros((), dtype=torch.long), counts=torch.zeros(7, dtype=torch.long))
        for touch in (True, False):
            label[0] = f"device pool {'fetch' if touch else 'prefetch'} S={slots} k=8"
            triton_copy.place(tables, 1, torch.arange(8), touch)  # type: ignore[arg-type]
        # a diffusion block's pass: all E experts' presence, the block's pins, its seen set, one sort of the slots
        order = {True: torch.empty(2048, dtype=torch.long), False: torch.empty(2048, dtype=torch.long)}
        tables.pinned = torch.zeros(slots + 1, dtype=torch.bool)
        tables.seen = torch.zeros(streamed * e + 1, dtype=torch.bool)
        tables.gate = torch.ones((), dtype=torch.bool)
        tables.counts = torch.zeros(8, dtype=torch.long)
        tables.order_scratch = lambda fetch, n: order[fetch]
        for fetch in (True, False):
            label[0] = f"device pool block {'fetch' if fetch else 'prefetch'} S={slots} E={e}"
            triton_copy.place_set(tables, 1, torch.rand(e, generator=gen) < 0.4, fetch)  # type: ignore[arg-type]
        label[0] = "device pool copy nf4 rows"
        row = torch.zeros(4, nf4.nbytes, dtype=torch.uint8)
        triton_copy.copy_rows(row, row, torch.arange(4), torch.arange(4), torch.ones(4, dtype=torch.bool))
    finally:
        for name in copy_names:
            setattr(copy_kernels, name, saved_copy[name])
        for name in names:
            setattr(moe_kernels, name, saved[name])
        linear_kernels.int8_linear_kernel = saved_linear
    seen: set[str] = set()
    for kernel, what, args, options in recorded:
        key = json.dumps([kernel.__name__, signature(kernel, args), options], sort_keys=True, default=str)
        if key not in seen:  # (a launch the same as an earlier one compiles to the same code)
            seen.add(key)
            yield kernel, what, args, options


def signature(kernel: Any, args: tuple[Any, ...]) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's signature and constexprs of one launch, from its arguments as the engine passed them."""
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    for param, value in zip(kernel.params, args, strict=True):
        if param.is_constexpr:
            sig[param.name], const[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = TORCH_TO_TRITON[value.dtype]
        elif isinstance(value, bool):
            sig[param.name] = "i1"
        elif isinstance(value, int):
            sig[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[param.name] = "fp32"
    return sig, const


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack / shared / local bytes of a compiled kernel, as cuobjdump reports them."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-500:]}")
    return dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups())))


def main(targets: list[str]) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    for kernel, what, args, options in launches():
        sig, const = signature(kernel, args)
        for target in targets:
            compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", TARGETS[target], 32),
                                      options=options)
            row = {"kernel": kernel.__name__, "launch": what, "target": target,
                   "num_warps": compiled.metadata.num_warps, **resources(compiled.asm["cubin"])}
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(TARGETS)))
