"""The speed model: predicted tokens per second of a placement, from a roofline and counted launches per layer.

Stdlib only. Time per pass = max(VRAM traffic / VRAM bandwidth, PCIe bytes / PCIe bandwidth, FLOPs / compute)
+ the eager launches of the forward (counted per layer by ``bench speed --count``), or, replayed from CUDA graphs,
one launch per graph and the eager pieces' ops (counted per piece). Every input that is not a hardware fact is a field of
:class:`Roofline`, with its source; :func:`predict` returns the figures and the derived numbers that went in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from clover_desk.engine.errors import PlanError
from clover_desk.engine.placement.hardware import GB, Hardware
from clover_desk.engine.placement.manifest import MiB, ModelFacts

CORESET_DISTINCT_EXPERTS_PER_PASS = 30.0  # [assumption] DES / MoE-Spec: 30-50 % of the raw union
# Experts a quantized bank dequantizes at once without the fused MoE kernel (engine.model.experts.GROUP_BYTES on CUDA:
# 96 MiB of bf16, 16 experts of 35B-A3B); an AR step dequantizes its k experts together.
DEQUANT_GROUP_EXPERTS = 16


@dataclass(frozen=True)
class Roofline:
    """The speed model's inputs that are not hardware. Every default is an assumption to calibrate with
    ``clover-desk bench speed`` / ``bench offload``; each with its source beside it.

    Time per pass = max(VRAM traffic / VRAM bandwidth, PCIe bytes / PCIe bandwidth, FLOPs / compute)
                    + layers x launches per layer x ``launch_us``.
    The overhead is an eager PyTorch forward's (no CUDA graphs): every torch op a forward dispatches is a kernel
    launch on a GPU, with the dispatcher and Python work around it. The launches are counted, not guessed (below);
    the cost of one is the assumption left.
    """

    tokens_per_pass: float = 3.0  # committed per denoising pass: LLaDA2-like TPF 2.5-3.2
    distinct_experts_per_pass: float = 70.0  # per layer, 32-token pass: LLaDA2.0-mini measured 69.5 of 256
    block_reuse_factor: float = 1.3  # block working set / per-pass union across one block's passes
    commit_pass: bool = True  # one extra forward per block writes the caches (Clover's published loop)
    compute_tflops: float = 30.0  # effective bf16 TFLOPS of a 16 GB RTX card on 32-token GEMMs
    # Torch ops (~ kernel launches) per decoder layer, counted at the dispatcher on the 35B shape quantized as on
    # the card (NF4 experts, INT8 projections, shared experts and LM head) and dispatched as on a GPU (its expert
    # groups, no CPU int8 GEMV), the mean over its 30 GDN and 10 attention layers with the ops outside the layers
    # (embedding, final norm, LM head) spread over the 40: `clover-desk bench speed --shape clover-35b-a3b --layers 4
    # --dtype bfloat16 --quant card --count` (CPU, 2026-12-01): AR step ~4,251 ops at 40 layers (GDN layer 106,
    # attention layer 93, outside 141), 0 host reads; a 32-slot denoising pass ~7,841 (209, 143, 141) and 40 host
    # reads (each MoE layer's group sizes: 256 pairs take the eager grouped compute; a sync each on a GPU, not
    # modelled here).
    # A prompt's forward is counted as a pass (its GDN chunk loop adds a few ops per 32 tokens).
    ar_launches_per_layer: float = 106.0
    pass_launches_per_layer: float = 196.0
    # Eager cost of one launch, GPU idle in between (the forward is launch bound at these sizes): an nn.Linear call
    # at tiny sizes takes ~14 us on an RTX 4090 (bitsandbytes issue #605), a bare CUDA kernel
    # launch ~3-5 us; [assumption] 10 us until a GPU run divides (AR step time - roofline) by the ops it counts.
    launch_us: float = 10.0
    # Replayed from CUDA graphs (the layers compiled on a GPU, engine.kernels.step_graphs), a forward costs one launch per
    # graph plus the ops of the pieces left eager, counted piece by piece as a GPU cuts them: `clover-desk bench
    # speed --shape clover-35b-a3b --layers 4 --dtype bfloat16 --quant card --count --stream 2` (CPU, 2026-12-01):
    # a streamed layer's fetch (its one host read, the copies, its slot table) 14 ops in an AR step, 10 in a pass;
    # a routed-expert bank that sizes its groups on the host (a 32-slot pass without the fused MoE kernel) 47 ops.
    fetch_launches: float = 14.0
    bank_launches: float = 47.0
    # Device slot tables (engine.placement.device_pool, opt-in): the AR step, and with the fused MoE kernel a block's pass,
    # replays as one graph; each streamed layer's fetch is two kernels inside it (engine.kernels.triton_copy: the placing,
    # of k experts or of a pass's whole set, and the copy of the missing rows; counted), and the next streamed
    # layer's prefetch runs on a side stream, overlapped. A tiny kernel in a replayed graph still costs
    # its node's latency: [assumption] 3 us until a GPU run measures `bench speed --moe-only`'s device-tables line.
    device_table_kernels: float = 2.0
    graph_kernel_us: float = 3.0
    l2_bytes: int = 48 * MiB  # a dequantized weight larger than this round-trips through VRAM (4070 Ti S: 48 MB)
    # Streamed layers' experts computed on the CPU from host RAM (engine.placement.streamed_bank CPU experts, as llama.cpp's
    # --n-cpu-moe): the CPU kernels (engine.kernels.cpu_quant) read an AR step's k experts per layer at
    # ``cpu_expert_gbps`` and multiply a block pass's tokens at ``cpu_gflops``; each such layer adds a device-to-host
    # round trip of its input and output (a sync) of ``host_roundtrip_us``. [assumption] an 8-core desktop with
    # dual-channel DDR5: 25 GB/s (~40% of its read bandwidth; on this 2-core test machine the routed-expert kernels read
    # 6-8 GB/s at real width) and 200 GFLOP/s of int8 dots (measured here: 2 AVX2 cores, 107 GFLOP/s on the head at
    # 32 rows); 40 us a round trip (two small copies and a stream sync). Calibrate with `bench speed --real-width`.
    cpu_expert_gbps: float = 25.0
    cpu_gflops: float = 200.0
    host_roundtrip_us: float = 40.0

    @classmethod
    def with_coreset(cls, **kwargs: Any) -> "Roofline":
        """Clover's 90 %-mass block coreset: ~25-35 distinct experts per layer and pass."""
        return cls(**{"distinct_experts_per_pass": CORESET_DISTINCT_EXPERTS_PER_PASS, **kwargs})

    def __post_init__(self) -> None:
        for name in ("tokens_per_pass", "distinct_experts_per_pass", "block_reuse_factor", "compute_tflops",
                     "cpu_expert_gbps", "cpu_gflops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise PlanError(f"Roofline.{name} must be positive, got {value!r}")
        if self.block_reuse_factor < 1:
            raise PlanError(f"Roofline.block_reuse_factor must be >= 1, got {self.block_reuse_factor!r}")
        for name in ("ar_launches_per_layer", "pass_launches_per_layer", "launch_us", "l2_bytes", "fetch_launches",
                     "bank_launches", "device_table_kernels", "graph_kernel_us", "host_roundtrip_us"):
            if getattr(self, name) < 0:
                raise PlanError(f"Roofline.{name} must be >= 0, got {getattr(self, name)!r}")


def predict(
    f: ModelFacts,
    streamed: list[int],
    slots: int,
    ctx: int,
    block: int,
    hw: Hardware,
    rl: Roofline,
    prefill_chunk: int,
    attention: str,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Predicted tokens per second for AR decoding, block diffusion and prompt prefill, and the derived numbers
    that went in."""
    geo = f.geo
    e, k = geo.num_experts, geo.num_experts_per_tok
    n_moe, n_layers, s = len(f.layers), geo.num_hidden_layers, len(streamed)
    eb_all = sum(f.layer_bytes.values()) / (n_moe * e) if n_moe else 0.0  # mean bytes of one expert
    eb_str = sum(f.layer_bytes[x] for x in streamed) / (s * e) if s else 0.0
    vram_bw, pcie_bw, flops = hw.vram_gbps * GB, hw.pcie_gbps * GB, rl.compute_tflops * 1e12
    # A dequantized weight larger than L2 is written to VRAM and read back by the GEMM.
    dequant_traffic = sum(4 * n for n in f.dequant_dense_params if 2 * n > rl.l2_bytes)
    base_read = f.non_expert_gpu + dequant_traffic + geo.kv_bytes_per_token * ctx + 2 * geo.gdn_state_bytes
    attn_flops_per_token = 4 * ctx * geo.q_dim * len(geo.full_attention_layers)  # QK^T and PV over the context
    active = f.non_expert_gpu_params + k * n_moe * f.expert_params
    ar_oh = n_layers * rl.ar_launches_per_layer * rl.launch_us * 1e-6  # eager launches of one AR step (seconds)
    pass_oh = n_layers * rl.pass_launches_per_layer * rl.launch_us * 1e-6  # ... of one pass or prompt forward
    # replayed from CUDA graphs: one launch per graph, and the eager pieces between them (streamed fetches; without
    # the fused MoE kernel, every layer's routed experts in a block pass)
    graph_fetch_oh = ((s + 1) + s * rl.fetch_launches) * rl.launch_us * 1e-6
    graph_bank_oh = ((n_moe + 1) + n_moe * rl.bank_launches) * rl.launch_us * 1e-6

    def expert_dequant(experts: float, group: float) -> float:
        """VRAM traffic of dequantizing ``experts`` experts per MoE layer in groups of ``group``, without the fused
        MoE kernel (engine.kernels.triton_moe, which reads the packed rows in registers): a group larger than L2 is written
        to VRAM in bf16 and read back by the matmul, 4 bytes per weight."""
        if not f.experts_quantized or min(group, experts) * f.expert_params * 2 <= rl.l2_bytes:
            return 0.0
        return n_moe * experts * f.expert_params * 4

    # AR: one token per pass; its k experts per streamed layer cross PCIe unless still in the pool.
    # Hit rate: uniform routing, LRU pool holding the last slots / (k s) tokens' experts.
    hit = 1.0 - (1.0 - k / e) ** (slots / (k * s)) if s and e else 0.0
    ar_read = base_read + k * n_moe * eb_all
    ar_pcie = s * k * eb_str * (1.0 - hit)
    ar_flops = (2 * active + attn_flops_per_token) / flops
    t_ar_bound = max(ar_read / vram_bw, ar_pcie / pcie_bw, ar_flops)
    ar_deq = expert_dequant(k, k)
    t_ar_unfused = max((ar_read + ar_deq) / vram_bw, ar_pcie / pcie_bw, ar_flops)
    t_ar = t_ar_unfused + ar_oh
    # AR reading the streamed experts in place (engine.placement.streamed_bank zero-copy): nothing fetches, so the step is one graph,
    # but every step reads all its streamed experts over PCIe (no pool hits), and no read overlaps compute: a layer's
    # router decides what it reads, and the layer waits for it. (The pool's misses above are taken as overlapped,
    # which its prefetch guesses make true only in part: this comparison favours the pool.)
    zc_pcie = s * k * eb_str
    t_ar_zero_copy = (max((ar_read + ar_deq - zc_pcie) / vram_bw, ar_flops) + zc_pcie / pcie_bw
                      + rl.launch_us * 1e-6)
    # AR through device slot tables (engine.placement.device_pool): the pool's hits, misses and prefetch as above, its
    # bookkeeping on the device: one graph launch, and each streamed layer's two kernels in the graph. A block's
    # passes the same way with the fused MoE kernel ("diffusion_graphs_device_pool"): the pass one graph, each
    # streamed layer's placing of its whole set and its copy two kernels in it, the block's pins and the traffic
    # as the host pool's (the first pass's prefetch on a side stream, overlapped).
    graph_table_oh = (rl.launch_us + s * rl.device_table_kernels * rl.graph_kernel_us) * 1e-6
    t_ar_device_pool = t_ar_unfused + graph_table_oh

    # Diffusion: block / TPF denoising passes (+ the commit pass), each over all `block` positions.
    dp = min(float(e), float(block * k), rl.distinct_experts_per_pass)
    db = min(float(e), dp * rl.block_reuse_factor)
    n_pass = block / rl.tokens_per_pass + (1.0 if rl.commit_pass else 0.0)
    # Streamed layers whose block working set stays pinned in the pool for the whole block (engine.placement.slot_pool pins
    # a block's slots); the rest reload their per-pass union every pass, with two unions in flight.
    if s == 0 or slots >= s * math.ceil(db):
        cached = s
    else:
        cached = min(s, max(0, slots - 2 * math.ceil(dp)) // math.ceil(db))
    pass_read = base_read + n_moe * dp * eb_all
    pass_flops = block * (2 * active + attn_flops_per_token)
    pcie_first = s * dp * eb_str  # every streamed layer loads its first pass's union
    later = max(n_pass - 1.0, 1.0)
    pcie_later = (cached * (db - dp) / later + (s - cached) * dp) * eb_str

    def block_time(read: float) -> float:
        gpu_pass = max(read / vram_bw, pass_flops / flops)
        return max(gpu_pass, pcie_first / pcie_bw) + (n_pass - 1.0) * max(gpu_pass, pcie_later / pcie_bw)

    t_block_bound = block_time(pass_read)
    pass_deq = expert_dequant(dp, DEQUANT_GROUP_EXPERTS)
    t_block_unfused = block_time(pass_read + pass_deq)
    t_block = t_block_unfused + n_pass * pass_oh
    # "ar" / "diffusion" / "prefill": the eager engine as it runs by default (PyTorch overheads, experts dequantized
    # before their matmuls); "*_bound": the hardware roofline alone (what a fused, graph-captured engine approaches);
    # "*_graphs": the layers compiled on a GPU, passes replayed from CUDA graphs ("*_graphs_fused": with the fused MoE
    # kernel too, which never writes a dequantized expert).
    # Prefill: forwards of `prefill_chunk` tokens over a prompt that fills the context (mean position ctx / 2).
    # A chunk routes chunk x k token-slots, touching E (1 - (1 - k/E)^chunk) experts per layer (uniform routing);
    # streamed layers reload theirs every forward (the pool cannot hold every streamed layer's full set). SDPA's math
    # kernel (attention="math") also writes and reads fp32 scores and probabilities.
    c, mean_ctx = prefill_chunk, ctx / 2
    dc = e * (1.0 - (1.0 - k / e) ** c) if e else 0.0
    n_full = len(geo.full_attention_layers)
    math_traffic = 0.0
    if attention == "math" and n_full:
        math_traffic = n_full * 4 * geo.num_attention_heads * c * mean_ctx * 4
    pre_read = (
        f.non_expert_gpu + dequant_traffic + geo.kv_bytes_per_token * mean_ctx + 2 * geo.gdn_state_bytes
        + n_moe * dc * eb_all + math_traffic + expert_dequant(dc, DEQUANT_GROUP_EXPERTS)
    )
    pre_flops = c * (2 * active + 4 * mean_ctx * geo.q_dim * n_full)
    t_pre_bound = max(pre_read / vram_bw, s * dc * eb_str / pcie_bw, pre_flops / flops)
    t_pre = t_pre_bound + pass_oh

    # CPU experts: the streamed layers' routed experts run on the CPU from the host rows, the device computes the
    # rest and waits for each such layer (no overlap: the next layer needs its output). Nothing crosses PCIe but the
    # layer's input and output; the pool is not used. AR: the k experts of a token read at cpu_expert_gbps. A block
    # pass: its union of experts read, its block x k (token, expert) products computed, whichever takes longer.
    cpu_bw, cpu_flops = rl.cpu_expert_gbps * GB, rl.cpu_gflops * 1e9
    roundtrips = s * rl.host_roundtrip_us * 1e-6
    streamed_share = s / n_moe if n_moe else 0.0
    ar_dev_read = ar_read - s * k * eb_str
    ar_dev_flops = (2 * (active - s * k * f.expert_params) + attn_flops_per_token) / flops
    t_ar_cpu = (max((ar_dev_read + ar_deq * (1.0 - streamed_share)) / vram_bw, ar_dev_flops)
                + s * k * eb_str / cpu_bw + roundtrips + ar_oh)
    pass_dev_read = pass_read - s * dp * eb_str
    pass_dev_flops = block * (2 * (active - s * k * f.expert_params) + attn_flops_per_token) / flops
    pass_cpu = s * max(dp * eb_str / cpu_bw, block * k * 2 * f.expert_params / cpu_flops) + roundtrips
    t_pass_cpu = (max((pass_dev_read + pass_deq * (1.0 - streamed_share)) / vram_bw, pass_dev_flops) + pass_cpu
                  + pass_oh)
    t_block_cpu = n_pass * t_pass_cpu

    tiny = 1e-12  # a pass always takes some time; guards a zero-byte, zero-overhead toy model
    tok = {
        "ar": 1.0 / max(t_ar, tiny),
        "diffusion": block / max(t_block, tiny),
        "ar_bound": 1.0 / max(t_ar_bound, tiny),
        "diffusion_bound": block / max(t_block_bound, tiny),
        "prefill": c / max(t_pre, tiny),
        "ar_graphs": 1.0 / max(t_ar_unfused + graph_fetch_oh, tiny),
        "ar_graphs_fused": 1.0 / max(t_ar_bound + graph_fetch_oh, tiny),
        "ar_graphs_zero_copy": 1.0 / max(t_ar_zero_copy, tiny),
        "ar_graphs_device_pool": 1.0 / max(t_ar_device_pool, tiny),
        "diffusion_graphs": block / max(t_block_unfused + n_pass * graph_bank_oh, tiny),
        "diffusion_graphs_fused": block / max(t_block_bound + n_pass * graph_fetch_oh, tiny),
        "diffusion_graphs_device_pool": block / max(t_block_bound + n_pass * graph_table_oh, tiny),
        # the streamed layers' experts on the CPU (eager, as "ar" / "diffusion" are): engine.placement.streamed_bank
        "ar_cpu_experts": 1.0 / max(t_ar_cpu, tiny),
        "diffusion_cpu_experts": block / max(t_block_cpu, tiny),
    }
    derived = {
        "ar_expert_hit_rate": round(hit, 4),
        "ar_pcie_bytes_per_token": int(ar_pcie),
        "ar_zero_copy_pcie_bytes_per_token": int(zc_pcie),
        "ar_vram_bytes_per_token": int(ar_read),
        "distinct_experts_per_pass": dp,
        "distinct_experts_per_block_layer": db,
        "passes_per_block": round(n_pass, 4),
        "cached_block_layers": cached,
        "diffusion_pcie_bytes_per_block": int(pcie_first + (n_pass - 1.0) * pcie_later),
        "diffusion_vram_bytes_per_pass": int(pass_read),
        "diffusion_gflop_per_pass": round(pass_flops / 1e9, 1),
        "ar_overhead_ms_per_token": round(ar_oh * 1e3, 3),
        "diffusion_overhead_ms_per_pass": round(pass_oh * 1e3, 3),
        "dequant_vram_traffic_bytes_per_pass": dequant_traffic,
        "expert_dequant_vram_bytes_per_token_ar": int(ar_deq),
        "expert_dequant_vram_bytes_per_pass": int(pass_deq),
        "prefill_chunk_tokens": c,
        "prefill_distinct_experts_per_layer": round(dc, 2),
        "prefill_pcie_bytes_per_forward": int(s * dc * eb_str),
        "ar_cpu_expert_bytes_per_token": int(s * k * eb_str),
        "diffusion_cpu_expert_ms_per_pass": round(pass_cpu * 1e3, 3),
    }
    return tok, derived


