#!/usr/bin/env bash
# The prepared GPU checks of issues 2 and 3, as ONE script for a lent device machine (15 minutes in all).
# Not run by CI (there is no GPU there). Run from the repository root on the GPU machine:
#   bash scripts/gpu_check.sh [STEP...]  (logs go to $OUT, or ./gpu-check-out when OUT is unset; STEPs: only those)
# That machine has torch but not bitsandbytes or fla-core: `bash scripts/gpu_wheels.sh` here puts their wheels and
# this checkout's own wheel in .whl/ (carry it): the NF4 offload and count steps, and the flash-linear-attention GDN
# figures and test. Each step has its own time limit so one hang cannot eat the lease.
set -u
out="${OUT:-./gpu-check-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3
if ! ls .whl/clover_desk-*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: no .whl/clover_desk-*.whl: run bash scripts/gpu_wheels.sh here first and carry .whl" >&2
  exit 2
fi
# this checkout's wheel (clover_desk with its engine and ui) and the wheels the image lacks, first on the path
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
only=" $* "  # step names given as arguments: run only those (a second call finishes what a first one left)
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then return; fi
  echo "== $name (limit ${limit}s)" | tee -a "$out/summary.txt"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log" | tee -a "$out/summary.txt"
  echo "== $name rc=$rc" | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv | tee -a "$out/summary.txt"
bnb=0
$py -c "import bitsandbytes" 2>/dev/null && bnb=1 || echo "== bitsandbytes is not importable (bash scripts/gpu_wheels.sh here, carry .whl): the NF4 steps are skipped" | tee -a "$out/summary.txt"
# Steps in order of what they decide; the sum of their limits is over one call's 10 minutes, so name the rest in a
# second call if the first is cut short (pytest_gpu, card_fast and card_device_pool first: the fast path's AR and
# diffusion figures, with the host pool and with device slot tables).
# The GPU-marked tests: grouped expert compute on CUDA, the CLI's CUDA path, CUDA-graph AR steps and block passes
# (whole and in pieces around the banks that read the host), the int8 kernel, fla's GDN kernels.
step pytest_gpu 100 $py -m pytest -q -m gpu -o addopts="" -p no:cacheprovider tests/engine/test_experts_grouped.py \
  tests/app/test_cli.py tests/engine/test_compile.py tests/engine/test_step_graphs.py tests/engine/test_triton_linear.py tests/engine/test_gdn_kernels.py \
  tests/engine/test_triton_moe.py tests/engine/test_offload.py tests/engine/test_device_pool.py
if [ $bnb = 1 ]; then
  # Issue 8: the 35B shape on the code path a 16 GB card takes (NF4 experts, INT8 dense, the planner's 16 GiB
  # placement: streamed layers in pinned host memory, the process capped at 16 GiB) with the fast path on: fused NF4
  # MoE, INT8 and fla GDN kernels (opt-in), the layers compiled, AR steps and block passes replayed from CUDA graphs
  # cut around the streamed banks (engine.kernels.step_graphs). Prints the kernels-on eager figures, then the compiled ones
  # and how the passes were cut.
  step card_fast 300 env CLOVER_DESK_FUSED_MOE=1 CLOVER_DESK_FUSED_INT8=1 CLOVER_DESK_FLA_GDN=1 \
    $py -m clover_desk.cli.main bench speed --shape clover-35b-a3b --device cuda --dtype bfloat16 --quant card \
    --vram-gb 16 --repeats 3 --compile
  # Issue 8: card_fast with device slot tables (--device-pool): AR steps and block passes keep the slot pool but do
  # its bookkeeping on the GPU, so a step with 17 streamed layers is one CUDA graph, and so is a block pass with the
  # fused MoE kernel (the planner predicts AR ~131 against ~99 tok/s at 16 GiB on a 16 GB card, 292 against 170 on
  # this H200; diffusion 136 against 122, and 227 against 189). Its figures against card_fast's are the decision.
  step card_device_pool 300 env CLOVER_DESK_FUSED_MOE=1 CLOVER_DESK_FUSED_INT8=1 CLOVER_DESK_FLA_GDN=1 \
    $py -m clover_desk.cli.main bench speed --shape clover-35b-a3b --device cuda --dtype bfloat16 --quant card \
    --vram-gb 16 --repeats 3 --compile --device-pool
fi
# Issues 8, 11: one MoE layer at the 35B expert shape, grouped dequantize-then-matmul vs the fused Triton kernels
# (NF4 rows, GGUF Q4_0 blocks), and the dequantizing pass at 4 / 8 / 16 experts per group (16 = 96 MiB, past L2:
# picks engine.model.experts.GROUP_BYTES["cuda"]); the int8 LM head, chunked dequantize-then-matmul vs the fused Triton
# kernel vs torch's own torch._weight_int8pack_mm (the CPU path's op, if this CUDA build has it: a library path that
# would need no opt-in); one GDN layer's AR step and 1024-token prefill, the PyTorch rule vs flash-linear-attention's kernels;
# an AR step's 8 NF4 experts through bitsandbytes' gemv_4bit (16 GEMVs), next to the grouped and fused paths;
# one streamed layer's AR step through the slot pool (every expert missing) vs read in place from mapped page-locked
# rows (zero-copy, CLOVER_DESK_ZERO_COPY) vs resident: the effective GB/s of each (the planner predicts the in-place
# read cannot overlap compute, so AR at 16 GiB drops from ~99 to ~60 tok/s with it; this says whether it is so), and
# through device slot tables (engine.placement.device_pool: the placing and the copy of the missing rows as two Triton programs,
# no host read).
step bench_moe_fused 60 $py -m clover_desk.cli.main bench speed --moe-only --device cuda --repeats 5
# The prompt cache on a GPU (mid shape, bf16): another chat's state moved to host memory and back, and an older message
# edited going back to a checkpoint (GDN states copied to and from host memory): first-token times with and without.
step prompt_cache 90 bash -c "$py scripts/bench_prompt_cache.py --device cuda && $py scripts/bench_prompt_cache.py \
  --device cuda --scenario edit"
if [ $bnb = 1 ]; then
  # Issue 8: card_fast's path eager, kernels off (the baseline): AR tok/s, passes/s, tok/s at 3 tokens per pass,
  # ops and host reads per forward, host-to-device bytes, slot misses and host reads per token, and the implied cost
  # of one eager launch (the planner's Roofline.launch_us).
  step card_path 170 $py -m clover_desk.cli.main bench speed --shape clover-35b-a3b --device cuda --dtype bfloat16 \
    --quant card --vram-gb 16 --repeats 3
fi
if [ $bnb = 1 ]; then
  # Issue 8: ops (launches), host reads (device-to-host copies show on a GPU) and bytes written per forward on the
  # card's path, 4 layers of the 35B shape scaled to 40 (2 streamed), and what CUDA graphs leave eager: the
  # planner's launch figures, on the GPU.
  step count_gpu 45 $py -m clover_desk.cli.main bench speed --count --shape clover-35b-a3b --layers 4 --device cuda \
    --quant card --stream 2
fi
# Issue 8: the decoder layers compiled (engine.kernels.fastpath; Triton kernels, one graph per layer kind; all experts
# resident, so the AR step replays from CUDA graphs, engine.kernels.step_graphs), eager and compiled side by side with token
# equality. 8 layers: the graphs are shared, so depth only scales time.
step bench_speed_compiled 150 $py -m clover_desk.cli.main bench speed --shape clover-35b-a3b --device cuda --dtype bfloat16 \
  --layers 8 --compile --repeats 3
# Issue 2: full-size random 35B-A3B in bf16, all weights resident: AR decode tok/s, diffusion passes/s (one block).
step bench_speed_full 160 $py -m clover_desk.cli.main bench speed --shape clover-35b-a3b --device cuda --dtype bfloat16
if [ $bnb = 1 ]; then
  # Issue 3: the expert path alone, full-size NF4 experts in pinned RAM, capped at 16 GiB: H2D GB/s, coreset load.
  step bench_offload_gpu 120 $py -m clover_desk.cli.main bench offload --gpu --gpu-mem-gb 16
fi
