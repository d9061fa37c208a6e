"""CPU matmuls straight from GGUF (ggml) quantized blocks: a small C library (``csrc/quant_cpu.c``) built on first use
with the system C compiler, loaded with ctypes, and exposed as torch custom ops (``clover::qmatmul``,
``clover::qmatmul_rows``, ``clover::moe``, ``clover::moe_packed``) that ``torch.compile`` treats as opaque calls.
The same kernels read the engine's own quantized cache (``engine.weights.quant``): NF4 (bitsandbytes layout) and
per-row INT8 weights, whose codes and fp32 scales lie in separate arrays ("split" formats: ``smatmul``,
``moe_rows``; ops ``clover::smatmul``, ``clover::moe_rows``).

Each activation row is quantized once per call to int8 blocks (256 values with an fp32 scale and int16 sums per 16
for Q4_K / Q5_K / Q6_K weights; 32 values with an fp32 scale for Q8_0 / Q4_0), then each output is an integer dot
product with the weight blocks, accumulated in fp32 (what llama.cpp's CPU backend does). Float weights (F32 / F16 /
BF16) are not handled here: keep them on torch. The split formats use the 32-value activation blocks too: NF4 codes
go through a 16-entry int8 table (round(127 * code), the 1/127 applied per output), INT8 codes are used as they are.
From 8 activation rows on (prefill, diffusion passes) the rows go in tiles of 8, one int32 lane each, and a weight
block decoded once feeds them all 4 values per vpdpbusd (K formats, and NF4 / INT8 of whole 256-value groups); with
3-7 rows each K-format block is decoded once for all rows (:func:`set_tiled`: NF4 at other widths).

Build (:mod:`engine.kernels.cpu_build`): ``$CC`` (else ``gcc``, else ``cc``) with ``-O3 -march=native -fopenmp
-shared -fPIC``, cached per source, flags and compiler. ``-march=native`` picks the dots: AVX2, plus VNNI where the
CPU has it (AVX-512 VNNI's 256-bit forms, or AVX-VNNI on Intel's desktop chips without AVX-512; :attr:`Kernels.isa`
says which). ``engine.settings.GpuPaths.scalar_kernels``
(the switch ``CLOVER_DESK_KERNEL_SCALAR=1``; :func:`set_scalar`) builds the portable scalar dots instead of the
AVX2 ones, and ``GpuPaths.cpu_kernels`` off (:func:`set_enabled`) keeps the dequantizing path. When no compiler
works, :func:`available` is False and :func:`reason` says why; nothing here raises at import.

Layouts (all CPU, contiguous):

* ``x`` float32 ``[T, K]`` (other float dtypes are converted; the result is float32),
* ``w`` uint8 ``[N, row_bytes]``: one ggml row of K values per output row, whole blocks,
* expert banks: ``gate`` / ``up`` uint8 ``[E, I, row_bytes(D)]`` and ``down`` uint8 ``[E, D, row_bytes(I)]``, or
  one packed row per expert ``[E, nbytes]`` = gate, up, down blocks (``moe_packed``, ``GGUFExpertBank.packed``),
  or the own cache's rows (``moe_rows``).
* rows interleaved by 8 (``engine.kernels.x8``): a file's Q4_K / Q6_K experts (:data:`Q4_KX8` / :data:`Q6_KX8`),
  the own cache's NF4 experts (:data:`NF4X8`) and INT8 projections (:data:`INT8X8`, ``smatmul``), in memory.

Letters: T activation rows, K input width, N output rows, E experts, I expert width, D hidden width, k experts per
token.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch
from torch import Tensor

from clover_desk.engine.kernels.cpu_build import (
    BASE_FLAGS,
    FLAG_SETS,
    ISA_NAMES,
    PREBUILT_DIR,
    SOURCE_FILE,
    build,
    cache_dir,
    compiler,
    prebuilt,
)

log = logging.getLogger(__name__)

# ggml type ids (gguf.GGMLQuantizationType values; fixed by the file format)
F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30
TYPE_NAMES = {Q4_0: "Q4_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# type -> (values per block, bytes per block), for the types the kernels compute
BLOCK = {Q8_0: (32, 34), Q4_0: (32, 18), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
SUPPORTED = tuple(BLOCK)
# the engine's own formats (private ids, outside ggml's): codes + a separate fp32 scale per ``blocksize`` values of
# the flattened matrix (NF4: bitsandbytes' absmax blocks, high nibble first; INT8: one scale per row); the X8s: rows
NF4, INT8, Q4_KX8, Q6_KX8, NF4X8, INT8X8 = 200, 201, 212, 214, 220, 221  # interleaved by 8 (engine.kernels.x8)
SPLIT_NAMES = {NF4: "NF4", INT8: "INT8", INT8X8: "INT8X8"}
SPLIT_OF_FORMAT = {"nf4": NF4, "int8": INT8}
SPLIT_STEP = 32  # values per activation block: rows and NF4 blocksizes must be multiples of it

SOURCE = SOURCE_FILE  # the source Kernels builds (a module global: A/B scripts point it at another file)
_ERRORS = {1: "unsupported ggml type", 2: "bad shape (width not a whole number of blocks, or expert index out of "
           "range)", 3: "out of memory"}


_C = {"i": ctypes.c_int64, "n": ctypes.c_int, "p": ctypes.c_void_p, "f": ctypes.c_float}  # int64, int, pointer, float
_SIGNATURES: dict[str, str | None] = {  # the library's functions (all return int) and their argument types
    "clover_simd": None, "clover_vnni": None, "clover_openmp": None,
    "clover_qmatmul": "p i i p i n p i p n",
    "clover_moe": "p i i i i i p i i n p i i n p i i n p p p n",
    "clover_smatmul": "p i i p i p i n p i p n",
    "clover_moe_split": "p i i i i i p i i i i i n i i p p p n n",
    "clover_smatmul_tiled": "p i i p i p i n i p n",
    "clover_gdn_step": "p p p p p p p p i i i n",
    "clover_gdn_conv": "p p p p p i i",
    "clover_rms_norm": "p p f p i i n",
    "clover_rope": "p p p p i i i",
    "clover_qmatmul_many": "p i i n n p p p p n",
    "clover_gdn_token": "p p p p p f p p p i i i i n n",
    "clover_x8_pack": "p i i i i n n n",
    "clover_x8_nf4_pack": "p i i i i i i i n n",
    "clover_x8_i8_pack": "p p i i i n n",
}


def row_bytes(qtype: int, ncols: int) -> int:
    """Bytes of one row of ``ncols`` values of type ``qtype`` (whole blocks)."""
    elems, nbytes = BLOCK[qtype]
    if ncols % elems:
        raise ValueError(f"{TYPE_NAMES[qtype]} rows need a multiple of {elems} values, got {ncols}")
    return ncols // elems * nbytes


class Kernels:
    """One loaded build of the library (``scalar`` forces the portable dots). ``ok`` False: ``reason`` says why.
    Built from :data:`SOURCE` by the C compiler (``cc``, else ``$CC``, gcc, cc); where none builds, the prebuilt
    library for this CPU from ``prebuilt_dir`` (else :data:`PREBUILT_DIR`; :func:`engine.kernels.cpu_build.prebuilt`;
    ``prebuilt`` names the one loaded)."""

    def __init__(self, *, scalar: bool = False, vnni: bool = True, cc: str | None = None,
                 out_dir: Path | None = None, defines: tuple[str, ...] = (),
                 prebuilt_dir: Path | None = None) -> None:
        self.scalar = scalar
        self.ok = False
        self.reason = ""
        self.path: Path | None = None
        self.flags: tuple[str, ...] = ()
        self.prebuilt: str | None = None
        self._lib: ctypes.CDLL | None = None
        cc = cc or compiler()
        reasons = [] if cc else ["no C compiler found (set CC or install gcc)"]
        for extra in FLAG_SETS if cc else ():
            flags = (*BASE_FLAGS, *extra, *(("-DCLOVER_FORCE_SCALAR",) if scalar else ()),
                     *(() if vnni else ("-DCLOVER_NO_VNNI",)), *(f"-D{d}" for d in defines))
            path, why = build(cc, flags, out_dir or cache_dir(), SOURCE)
            if path is None:
                reasons.append(why)
                continue
            if not self._load(path, reasons):
                continue
            self.flags = flags
            if reasons:
                log.warning("cpu_quant built with %s after: %s", " ".join(extra) or "no extra flags", reasons[0])
            return
        if not defines:
            path, why = prebuilt(prebuilt_dir or PREBUILT_DIR, SOURCE, scalar=scalar, vnni=vnni)
            if path is not None:
                if self._load(path, reasons):
                    self.prebuilt = path.name
                    log.info("cpu_quant: %s; loaded the prebuilt %s", reasons[0], path.name)
                    return
                # a prebuilt library that is there but does not load (an older C library, say): say both
                reasons[0] = f"{reasons[0]}; {reasons.pop()}"
            else:
                reasons.append(why)
        self.reason = reasons[0] if reasons else "build failed"
        log.info("cpu_quant kernels unavailable: %s", self.reason)

    def _load(self, path: Path, reasons: list[str]) -> bool:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            reasons.append(f"cannot load {path}: {exc}")
            return False
        self._bind(lib)
        self._lib, self.path, self.ok = lib, path, True
        return True

    @staticmethod
    def _bind(lib: ctypes.CDLL) -> None:
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            if args is not None:
                fn.argtypes = [_C[a] for a in args.split()]

    @property
    def simd(self) -> bool:
        """True when the AVX2 dots are compiled in."""
        return bool(self._lib and self._lib.clover_simd())

    @property
    def vnni(self) -> bool:
        """True when they add their products with VNNI (AVX-512's or AVX-VNNI; ``vnni=False`` builds them without)."""
        return bool(self._lib and self._lib.clover_vnni())

    @property
    def isa(self) -> str:
        """What the dots run on, for reports: "scalar", "AVX2", "AVX2 + AVX-512 VNNI" or "AVX2 + AVX-VNNI"."""
        return ISA_NAMES[int(self.lib().clover_vnni())] if self.simd else "scalar"

    def lib(self) -> ctypes.CDLL:
        """The loaded library (its functions bound); raises where the kernels are unavailable."""
        if self._lib is None:
            raise RuntimeError(f"cpu_quant kernels are unavailable: {self.reason}")
        return self._lib

    # -- the computations (plain tensors in, a new float32 tensor out) ------------------------------------------

    def qmatmul(self, x: Tensor, w: Tensor, qtype: int, rows: Tensor | None = None) -> Tensor:
        """x [T, K] float, w uint8 [N, row_bytes] -> float32 [T, N] (or [T, R] for rows int64 [R])."""
        lib = self.lib()
        x = _as_f32_2d(x)
        w = _check_weights(w, qtype, x.shape[1], 2)
        n = w.shape[0]
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            if rows.dim() != 1:
                raise ValueError(f"rows must be 1-D, got {tuple(rows.shape)}")
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
                raise IndexError(f"rows out of range for {n} weight rows")
        r = n if rows is None else rows.numel()
        out = torch.empty(x.shape[0], r, dtype=torch.float32)
        if x.shape[0] == 0 or r == 0:
            return out
        rc = lib.clover_qmatmul(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), w.stride(0), qtype,
                                None if rows is None else rows.data_ptr(), r, out.data_ptr(), torch.get_num_threads())
        _raise_for(rc, "qmatmul")
        return out

    def smatmul(self, x: Tensor, codes: Tensor, scales: Tensor, qtype: int, blocksize: int) -> Tensor:
        """x [T, K] float; codes of a split-format matrix [N, K] (NF4: uint8, any shape, N * K / 2 bytes; INT8: int8
        [N, K]; :data:`INT8X8`: INT8 rows interleaved by 8, N a multiple of 8); scales fp32, one per ``blocksize``
        values of the flattened matrix -> float32 [T, N]."""
        lib = self.lib()
        x = _as_f32_2d(x)
        k = x.shape[1]
        codes, n = _split_codes(codes, qtype, k)
        scales = _split_scales(scales, n * k, blocksize, "smatmul")
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0] == 0 or n == 0:
            return out
        if qtype == NF4 and _use_tiled(x.shape[0]):
            rc = lib.clover_smatmul_tiled(x.data_ptr(), x.shape[0], k, codes.data_ptr(), codes.stride(0),
                                          scales.data_ptr(), blocksize, qtype, n, out.data_ptr(),
                                          torch.get_num_threads())
        else:
            rc = lib.clover_smatmul(x.data_ptr(), x.shape[0], k, codes.data_ptr(), codes.stride(0),
                                    scales.data_ptr(), blocksize, qtype, None, n, out.data_ptr(),
                                    torch.get_num_threads())
        _raise_for(rc, "smatmul")
        return out

    def moe_rows(self, x: Tensor, packed: Tensor, offsets: tuple[int, int, int, int] | list[int], intermediate: int,
                 qtype: int, blocksizes: tuple[int, int] | list[int], topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """Routed experts from the engine's own expert rows: packed uint8 [E, nbytes], each row
        [gate_up codes [2I, D] | down codes [D, I] | gate_up scales | down scales] at byte ``offsets`` (the
        ``ExpertLayout`` segments), all of split type ``qtype`` (or :data:`NF4X8`: NF4 rows interleaved by 8, each
        row whole scale blocks); ``blocksizes`` (gate_up, down) values per scale."""
        x = _as_f32_2d(x)
        d, i = x.shape[1], int(intermediate)
        if qtype not in (NF4, INT8, NF4X8):
            raise ValueError(f"moe_rows: type {qtype} is not a split format (supported: {sorted(SPLIT_NAMES.values())})")
        bs_gu, bs_dn = (int(b) for b in blocksizes)
        for width, bs in ((d, bs_gu), (i, bs_dn)):
            if width % SPLIT_STEP or bs <= 0 or bs % SPLIT_STEP:
                raise ValueError(f"moe_rows: widths and blocksizes must be multiples of {SPLIT_STEP}, got width "
                                 f"{width}, blocksize {bs}")
        gu_c, dn_c, gu_s, dn_s = (int(o) for o in offsets)
        per = 1 if qtype == INT8 else 2  # values per code byte
        ends = (gu_c + 2 * i * d // per, dn_c + d * i // per, gu_s + 4 * -(-2 * i * d // bs_gu),
                dn_s + 4 * -(-d * i // bs_dn))
        if packed.dtype != torch.uint8 or packed.dim() != 2 or max(ends) > packed.shape[1] or min(offsets) < 0:
            raise ValueError(f"moe_rows: packed must be uint8 [E, >= {max(ends)}], got {tuple(packed.shape)} "
                             f"{packed.dtype}")
        if any(o % 4 for o in (gu_s, dn_s)):
            raise ValueError(f"moe_rows: scale offsets must be 4-byte aligned, got {gu_s}, {dn_s}")
        if packed.stride(1) != 1 or packed.stride(0) % 4 or packed.data_ptr() % 4:
            packed = packed.contiguous()
        lib = self.lib()
        t = x.shape[0]
        idx, wts, out = _routing(x, topk_idx, topk_w)
        if t == 0:
            return out
        rc = lib.clover_moe_split(x.data_ptr(), t, d, i, packed.shape[0], idx.shape[1], packed.data_ptr(),
                                  packed.stride(0), gu_c, dn_c, gu_s, dn_s, qtype, bs_gu, bs_dn, idx.data_ptr(),
                                  wts.data_ptr(), out.data_ptr(), int(qtype == NF4 and _use_tiled(t)),
                                  torch.get_num_threads())
        _raise_for(rc, "moe_rows")
        return out

    def moe(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: tuple[int, int, int] | list[int],
            topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """Routed SiLU-gated experts: gate/up uint8 [E, I, row_bytes(D)], down uint8 [E, D, row_bytes(I)]."""
        x = _as_f32_2d(x)
        qg, qu, qd = (int(q) for q in qtypes)
        if gate.dim() != 3 or up.dim() != 3 or down.dim() != 3:
            raise ValueError("moe: gate, up and down must be [E, rows, row_bytes]")
        e, i, d = gate.shape[0], gate.shape[1], x.shape[1]
        gate = _check_weights(gate, qg, d, 3)
        up = _check_weights(up, qu, d, 3)
        down = _check_weights(down, qd, i, 3)
        if up.shape[:2] != (e, i) or down.shape[:2] != (e, d):
            raise ValueError(f"moe: banks gate {tuple(gate.shape)} up {tuple(up.shape)} down {tuple(down.shape)} "
                             f"disagree for D={d}")
        segs = ((gate.data_ptr(), gate.stride(0), gate.stride(1)), (up.data_ptr(), up.stride(0), up.stride(1)),
                (down.data_ptr(), down.stride(0), down.stride(1)))
        return self._moe(x, e, i, segs, (qg, qu, qd), topk_idx, topk_w, (gate, up, down))

    def moe_packed(self, x: Tensor, packed: Tensor, intermediate: int, qtypes: tuple[int, int, int] | list[int],
                   topk_idx: Tensor, topk_w: Tensor) -> Tensor:
        """Routed experts from one row per expert: packed uint8 [E, nbytes] = [gate [I, D] | up [I, D] | down [D, I]]
        blocks (the layout of GGUFExpertBank)."""
        x = _as_f32_2d(x)
        qg, qu, qd = (int(q) for q in qtypes)
        d, i = x.shape[1], int(intermediate)
        base = [{Q4_KX8: Q4_K, Q6_KX8: Q6_K}.get(q, q) for q in (qg, qu, qd)]  # interleaved rows: the type's bytes
        for q in base:
            if q not in BLOCK:
                raise ValueError(f"ggml type {q} has no cpu_quant kernel (supported: {sorted(TYPE_NAMES.values())})")
        rg, ru, rd = row_bytes(base[0], d), row_bytes(base[1], d), row_bytes(base[2], i)
        nbytes = i * rg + i * ru + d * rd
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != nbytes:
            raise ValueError(f"moe_packed: packed must be uint8 [E, {nbytes}], got {tuple(packed.shape)} "
                             f"{packed.dtype}")
        if packed.stride(1) != 1:
            packed = packed.contiguous()
        base, es = packed.data_ptr(), packed.stride(0)
        segs = ((base, es, rg), (base + i * rg, es, ru), (base + i * (rg + ru), es, rd))
        return self._moe(x, packed.shape[0], i, segs, (qg, qu, qd), topk_idx, topk_w, (packed,))

    def _moe(self, x: Tensor, e: int, i: int, segs: tuple[tuple[int, int, int], ...], qtypes: tuple[int, int, int],
             topk_idx: Tensor, topk_w: Tensor, keep: tuple[Tensor, ...]) -> Tensor:
        lib = self.lib()
        t, d = x.shape
        idx, wts, out = _routing(x, topk_idx, topk_w)
        if t == 0:
            return out
        (g, ges, grs), (u, ues, urs), (dn, des, drs) = segs
        rc = lib.clover_moe(x.data_ptr(), t, d, i, e, idx.shape[1], g, ges, grs, qtypes[0], u, ues, urs, qtypes[1],
                            dn, des, drs, qtypes[2], idx.data_ptr(), wts.data_ptr(), out.data_ptr(),
                            torch.get_num_threads())
        del keep  # the banks stayed alive for the call
        _raise_for(rc, "moe")
        return out


    def gdn_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 state_out: Tensor | None) -> Tensor:
        """One Gated DeltaNet AR step (``clover_gdn_step``): q, k [H, dk], v [H, dv], g, beta [H], state
        [H, dk, dv], all float32 -> o [H, dv]; the updated state is written into ``state_out`` (``state`` itself
        for in place; None: not computed). Same rule as ``engine.model.clover.recurrent_gated_delta_rule``."""
        lib = self.lib()
        h, dk, dv = state.shape
        args = [t.to(torch.float32).contiguous() for t in (q, k, v, g, beta)]
        for name, t, shape in zip(("q", "k", "v", "g", "beta"), args, ((h, dk), (h, dk), (h, dv), (h,), (h,))):
            if t.numel() != h * (shape[1] if len(shape) > 1 else 1):
                raise ValueError(f"gdn_step: {name} has shape {tuple(t.shape)}, the state [{h}, {dk}, {dv}] needs "
                                 f"{list(shape)}")
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(f"gdn_step: the state must be contiguous float32, got {state.dtype}")
        if state_out is not None and (state_out.shape != state.shape or state_out.dtype != torch.float32
                                      or not state_out.is_contiguous()):
            raise ValueError(f"gdn_step: state_out must be contiguous float32 {tuple(state.shape)}")
        out = torch.empty(h, dv, dtype=torch.float32)
        rc = lib.clover_gdn_step(*(t.data_ptr() for t in args), state.data_ptr(),
                                 None if state_out is None else state_out.data_ptr(), out.data_ptr(), h, dk, dv,
                                 torch.get_num_threads())
        _raise_for(rc, "gdn_step")
        return out

    def gdn_conv(self, x: Tensor, weight: Tensor, state: Tensor, state_out: Tensor | None) -> Tensor:
        """A GDN layer's causal short convolution of one token, before its SiLU (``clover_gdn_conv``): x [C] raw,
        weight [C, K], state [K-1, C] (the previous raw rows), all float32 contiguous -> [C]; the new state (the
        last K-1 rows) goes into ``state_out`` (``state`` itself for in place; None: not written)."""
        lib = self.lib()
        c, kernel = weight.shape
        _need_f32("gdn_conv", x=(x, c), weight=(weight, c * kernel), state=(state, (kernel - 1) * c),
                  state_out=(state_out, (kernel - 1) * c))
        out = torch.empty(c, dtype=torch.float32)
        rc = lib.clover_gdn_conv(x.data_ptr(), state.data_ptr(), weight.data_ptr(),
                                 None if state_out is None else state_out.data_ptr(), out.data_ptr(), c, kernel)
        _raise_for(rc, "gdn_conv")
        return out

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, lanes: int) -> Tensor:
        """The model's zero-centred RMSNorm (``clover_rms_norm``) over the last dim of x [..., n] with weight [n],
        float32 contiguous -> a new tensor like x: the torch forward's bits (sums over ``lanes``-float vectors)."""
        lib = self.lib()
        n = x.shape[-1]
        _need_f32("rms_norm", x=(x, x.numel()), weight=(weight, n))
        y = torch.empty_like(x)
        rc = lib.clover_rms_norm(x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), x.numel() // max(n, 1), n, lanes)
        _raise_for(rc, "rms_norm")
        return y

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Partial rotary embedding of one token (``clover_rope``): x [..., hd], cos / sin [1, rd] (one position),
        float32 contiguous -> a new tensor like x, the torch forward's bits (NeoX pairs over the first rd dims)."""
        lib = self.lib()
        hd, rd = x.shape[-1], cos.shape[-1]
        _need_f32("rope", x=(x, x.numel()), cos=(cos, rd), sin=(sin, rd))
        y = torch.empty_like(x)
        rc = lib.clover_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), x.numel() // max(hd, 1), hd, rd)
        _raise_for(rc, "rope")
        return y

    def qmatmul_many(self, x: Tensor, ws: list[Tensor], qtype: int) -> list[Tensor]:
        """x [T, K] float and n <= 8 weight matrices ``ws`` (uint8 [N_i, row_bytes], ggml type ``qtype``) ->
        [x @ dequantize(W_i).T] float32 [T, N_i] each (``clover_qmatmul_many``): x rounded to int8 blocks once for
        all; the same bits as one :meth:`qmatmul` per matrix."""
        lib = self.lib()
        x = _as_f32_2d(x)
        ws = [_check_weights(w, qtype, x.shape[1], 2) for w in ws]
        outs = [torch.empty(x.shape[0], w.shape[0], dtype=torch.float32) for w in ws]
        n = len(ws)
        vp, i64 = ctypes.c_void_p * n, ctypes.c_int64 * n
        rc = lib.clover_qmatmul_many(x.data_ptr(), x.shape[0], x.shape[1], qtype, n,
                                     vp(*(w.data_ptr() for w in ws)), i64(*(w.stride(0) for w in ws)),
                                     i64(*(w.shape[0] for w in ws)), vp(*(o.data_ptr() for o in outs)),
                                     torch.get_num_threads())
        _raise_for(rc, "qmatmul_many")
        return outs

    def gdn_token(self, act: Tensor, zs: Tensor, beta: Tensor, g: Tensor, norm: tuple[Tensor, float], state: Tensor,
                  state_out: Tensor | None, lanes: int) -> Tensor:
        """The rest of a GDN layer's one-token mixer after the convolution's SiLU (``clover_gdn_token``): act [C]
        (q | k | v channels), zs [Hv * dv] = SiLU(z), beta, g [Hv], ``norm`` (the gated RMSNorm's weight [dv] and
        eps), state [Hv, dk, dv], all float32 contiguous -> y [Hv * dv]: the l2norms, the delta rule and the gated
        RMSNorm, in the torch forward's order of operations (sums as torch's over ``lanes``-float vectors); the
        updated state goes into ``state_out`` (``state`` for in place; None: not computed)."""
        lib = self.lib()
        hv, dk, dv = state.shape
        c = act.numel()
        hk = (c - hv * dv) // (2 * dk)
        if hk < 1 or c != 2 * hk * dk + hv * dv:
            raise ValueError(f"gdn_token: act has {c} channels, not 2 Hk {dk} + {hv} x {dv} for the state "
                             f"{tuple(state.shape)}")
        weight, eps = norm
        _need_f32("gdn_token", act=(act, c), zs=(zs, hv * dv), beta=(beta, hv), g=(g, hv), norm=(weight, dv),
                  state=(state, hv * dk * dv), state_out=(state_out, hv * dk * dv))
        y = torch.empty(hv * dv, dtype=torch.float32)
        rc = lib.clover_gdn_token(act.data_ptr(), zs.data_ptr(), beta.data_ptr(), g.data_ptr(), weight.data_ptr(), eps,
                                  state.data_ptr(), None if state_out is None else state_out.data_ptr(), y.data_ptr(),
                                  hk, hv, dk, dv, lanes, torch.get_num_threads())
        _raise_for(rc, "gdn_token")
        return y


def _as_f32_2d(x: Tensor) -> Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, K], got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"cpu_quant runs on CPU tensors, got {x.device}")
    return x.to(torch.float32).contiguous()


def _check_weights(w: Tensor, qtype: int, ncols: int, dims: int) -> Tensor:
    if qtype not in BLOCK:
        raise ValueError(f"ggml type {qtype} has no cpu_quant kernel (supported: {sorted(TYPE_NAMES.values())})")
    if w.dtype != torch.uint8 or w.dim() != dims or w.device.type != "cpu":
        raise ValueError(f"weights must be CPU uint8 with {dims} dims, got {tuple(w.shape)} {w.dtype} {w.device}")
    if w.shape[-1] != row_bytes(qtype, ncols):
        raise ValueError(f"{TYPE_NAMES[qtype]} rows of {ncols} values take {row_bytes(qtype, ncols)} bytes, "
                         f"weights have {w.shape[-1]}")
    if w.stride(-1) != 1 or (dims == 3 and w.stride(1) != w.shape[2]):
        w = w.contiguous()
    return w


def _routing(x: Tensor, topk_idx: Tensor, topk_w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A routed call's (topk_idx int64, topk_w float32), contiguous and checked against x [T, D], and its output,
    an empty float32 [T, D]."""
    t = x.shape[0]
    idx = topk_idx.to(torch.int64).contiguous()
    wts = topk_w.to(torch.float32).contiguous()
    if idx.dim() != 2 or idx.shape[0] != t or wts.shape != idx.shape:
        raise ValueError(f"moe: topk_idx {tuple(idx.shape)} / topk_w {tuple(wts.shape)} must be [T={t}, k]")
    return idx, wts, torch.empty(t, x.shape[1], dtype=torch.float32)


def _split_codes(codes: Tensor, qtype: int, k: int) -> tuple[Tensor, int]:
    """A split-format matrix's codes as uint8 [N, row bytes] (a view when contiguous) and N."""
    if qtype not in SPLIT_NAMES:
        raise ValueError(f"type {qtype} is not a split format (supported: {sorted(SPLIT_NAMES.values())})")
    if codes.device.type != "cpu" or codes.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"codes must be CPU uint8 / int8, got {codes.dtype} {codes.device}")
    if k % SPLIT_STEP:
        raise ValueError(f"{SPLIT_NAMES[qtype]} rows need a multiple of {SPLIT_STEP} values, got {k}")
    rb = k // 2 if qtype == NF4 else k
    flat = codes.contiguous().view(torch.uint8).reshape(-1)
    if flat.numel() % (rb * (8 if qtype == INT8X8 else 1)):
        raise ValueError(f"{SPLIT_NAMES[qtype]} codes of {flat.numel()} bytes are not whole (groups of 8) rows of {k}")
    return flat.view(-1, rb), flat.numel() // rb


def _split_scales(scales: Tensor, numel: int, blocksize: int, what: str) -> Tensor:
    if blocksize <= 0 or blocksize % SPLIT_STEP:
        raise ValueError(f"{what}: blocksize must be a positive multiple of {SPLIT_STEP}, got {blocksize}")
    need = -(-numel // blocksize)
    if scales.dtype != torch.float32 or scales.device.type != "cpu" or scales.numel() < need:
        raise ValueError(f"{what}: scales must be CPU float32 with >= {need} values, got {scales.numel()} "
                         f"{scales.dtype} {scales.device}")
    return scales.contiguous()


def split_usable(qtype: int, *widths: int, blocksize: int | None = None) -> bool:
    """Whether a split-format matrix with rows of these widths (and NF4 ``blocksize``) goes through the kernels."""
    ok = all(w % SPLIT_STEP == 0 for w in widths) and (blocksize is None or blocksize % SPLIT_STEP == 0)
    return ok and usable(qtype)


def _raise_for(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"cpu_quant {what}: {_ERRORS.get(rc, f'error {rc}')}")


# ---------------------------------------------------------------------------------------------------------------
# the process-wide library (built lazily, once)
# ---------------------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_default: Kernels | None = None


def kernels() -> Kernels:
    """The process-wide build (scalar after ``set_scalar(True)``), built on first call."""
    global _default
    if _default is not None:  # built already: no lock
        return _default
    with _lock:
        if _default is None:
            _default = Kernels(scalar=_scalar)
        return _default


_scalar = False  # engine.settings.GpuPaths.scalar_kernels, set by engine.kernels.switches.use at load


def set_scalar(on: bool) -> bool:
    """Build the portable scalar kernels (True) or the SIMD ones (False) from the next call on; a change forgets
    the build made so far. Returns the previous setting (``GpuPaths.scalar_kernels``)."""
    global _scalar
    before, _scalar = _scalar, bool(on)
    if before != _scalar:
        _reset()
    return before


def _reset() -> None:
    """Forget the process-wide build (the next call builds again, as :func:`set_scalar` says)."""
    global _default
    with _lock:
        _default = None


def available() -> bool:
    """True when the library built and loaded (callers keep their dequantizing path otherwise)."""
    return kernels().ok


def usable(*qtypes: int) -> bool:
    """Whether weights of these ggml types (or split formats, :data:`NF4` / :data:`INT8`), on the CPU, go through these kernels: every type supported and the
    library built here (else the caller dequantizes, as before). The engine's one switch for the CPU path."""
    return all(q in BLOCK or q in SPLIT_NAMES for q in qtypes) and _enabled and available()


_enabled = True  # engine.settings.GpuPaths.cpu_kernels (set by engine.kernels.switches.use at load; tests too)


def set_enabled(on: bool) -> bool:
    """Turn the kernels on or off for this process; returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, bool(on)
    return before


# NF4 with several activation rows: each weight row decoded once for all of them (issue 30; the C side does so from 8
# rows of one matrix on, so an expert with fewer tokens keeps the per-row dots); off: decoded again per activation
# row (the same results, kept for comparisons and tests). INT8 codes need no decoding and keep their path.
_tiled = True
TILED_MIN_ROWS = 2  # activation rows from which an NF4 call goes through the decode-once driver (1 row: the AR path)


def set_tiled(on: bool) -> bool:
    """NF4 calls (:meth:`Kernels.smatmul`, :meth:`Kernels.moe_rows`) of :data:`TILED_MIN_ROWS` or more rows of widths
    that are not whole 256-value groups (those take the tiled split kernel either way) decode each weight row once
    (True, the default) or once per row (False): the same results. Returns the previous setting."""
    global _tiled
    before, _tiled = _tiled, bool(on)
    return before


def _use_tiled(rows: int) -> bool:
    return _tiled and rows >= TILED_MIN_ROWS


def reason() -> str:
    """Why :func:`available` is False, in one line ("" when it is True)."""
    return kernels().reason


# ---------------------------------------------------------------------------------------------------------------
# torch custom ops: opaque to torch.compile, shapes from the fake implementations
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("clover::qmatmul", mutates_args=())
def _qmatmul_op(x: Tensor, w: Tensor, qtype: int) -> Tensor:
    return kernels().qmatmul(x, w, qtype)


@_qmatmul_op.register_fake
def _(x: Tensor, w: Tensor, qtype: int) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("clover::qmatmul_rows", mutates_args=())
def _qmatmul_rows_op(x: Tensor, w: Tensor, qtype: int, rows: Tensor) -> Tensor:
    return kernels().qmatmul(x, w, qtype, rows)


@_qmatmul_rows_op.register_fake
def _(x: Tensor, w: Tensor, qtype: int, rows: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], rows.shape[0]), dtype=torch.float32)


@torch.library.custom_op("clover::moe", mutates_args=())
def _moe_op(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: list[int], topk_idx: Tensor,
            topk_w: Tensor) -> Tensor:
    return kernels().moe(x, gate, up, down, qtypes, topk_idx, topk_w)


@_moe_op.register_fake
def _(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: list[int], topk_idx: Tensor,
      topk_w: Tensor) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("clover::moe_packed", mutates_args=())
def _moe_packed_op(x: Tensor, packed: Tensor, intermediate: int, qtypes: list[int], topk_idx: Tensor,
                   topk_w: Tensor) -> Tensor:
    return kernels().moe_packed(x, packed, intermediate, qtypes, topk_idx, topk_w)


@_moe_packed_op.register_fake
def _(x: Tensor, packed: Tensor, intermediate: int, qtypes: list[int], topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("clover::smatmul", mutates_args=())
def _smatmul_op(x: Tensor, codes: Tensor, scales: Tensor, qtype: int, blocksize: int, n: int) -> Tensor:
    return kernels().smatmul(x, codes, scales, qtype, blocksize)


@_smatmul_op.register_fake
def _(x: Tensor, codes: Tensor, scales: Tensor, qtype: int, blocksize: int, n: int) -> Tensor:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


@torch.library.custom_op("clover::moe_rows", mutates_args=())
def _moe_rows_op(x: Tensor, packed: Tensor, offsets: list[int], intermediate: int, qtype: int,
                 blocksizes: list[int], topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    return kernels().moe_rows(x, packed, offsets, intermediate, qtype, blocksizes, topk_idx, topk_w)


@_moe_rows_op.register_fake
def _(x: Tensor, packed: Tensor, offsets: list[int], intermediate: int, qtype: int, blocksizes: list[int],
      topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# public API: the custom ops while torch.compile traces (opaque calls in the graph), the library directly in eager
# code (a custom op's Python dispatch costs ~30 us a call, as much as a 512 x 2048 Q4_K GEMV)
# ---------------------------------------------------------------------------------------------------------------


def _eager() -> bool:
    return not torch.compiler.is_compiling()


def qmatmul(x: Tensor, w: Tensor, qtype: int, rows: Tensor | None = None) -> Tensor:
    """x float [T, K], w uint8 [N, row_bytes] of ggml type ``qtype`` -> float32 [T, N] = x @ dequantize(w).T with
    x rounded to int8 blocks. ``rows`` int64 [R]: only those output rows -> [T, R] (same as :func:`qmatmul_rows`)."""
    if _eager():
        return kernels().qmatmul(x, w, qtype, rows)
    if rows is not None:
        return torch.ops.clover.qmatmul_rows(x, w, qtype, rows)
    return torch.ops.clover.qmatmul(x, w, qtype)


def qmatmul_rows(x: Tensor, w: Tensor, qtype: int, rows: Tensor) -> Tensor:
    """x float [T, K], w uint8 [N, row_bytes], rows int64 [R] -> float32 [T, R] (output column r = weight row
    rows[r]; only those rows are read)."""
    if _eager():
        return kernels().qmatmul(x, w, qtype, rows)
    return torch.ops.clover.qmatmul_rows(x, w, qtype, rows)


def moe(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: tuple[int, int, int] | list[int],
        topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    """Routed experts: x float [T, D]; gate, up uint8 [E, I, row_bytes(D)]; down uint8 [E, D, row_bytes(I)];
    qtypes (gate, up, down) ggml ids; topk_idx int64 [T, k]; topk_w float [T, k] -> float32 [T, D] =
    sum_j topk_w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)). Each used expert's blocks are read once."""
    if _eager():
        return kernels().moe(x, gate, up, down, qtypes, topk_idx, topk_w)
    return torch.ops.clover.moe(x, gate, up, down, list(qtypes), topk_idx, topk_w)


def moe_packed(x: Tensor, packed: Tensor, intermediate: int, qtypes: tuple[int, int, int] | list[int],
               topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    """As :func:`moe` with the experts as one packed uint8 row each, [E, nbytes] = [gate | up | down] blocks
    (``GGUFExpertBank.packed`` / ``GGUFExpertLayout``)."""
    if _eager():
        return kernels().moe_packed(x, packed, intermediate, qtypes, topk_idx, topk_w)
    return torch.ops.clover.moe_packed(x, packed, intermediate, list(qtypes), topk_idx, topk_w)


def smatmul(x: Tensor, codes: Tensor, scales: Tensor, qtype: int, blocksize: int, n: int) -> Tensor:
    """x float [T, K]; a split-format matrix [n, K] (``codes`` + ``scales``, one per ``blocksize`` values of the
    flattened matrix; INT8 rows: blocksize = K) -> float32 [T, n] = x @ dequantize(W).T with x rounded to int8."""
    if _eager():
        return kernels().smatmul(x, codes, scales, qtype, blocksize)
    return torch.ops.clover.smatmul(x, codes, scales, qtype, blocksize, n)


def moe_rows(x: Tensor, packed: Tensor, offsets: tuple[int, int, int, int] | list[int], intermediate: int,
             qtype: int, blocksizes: tuple[int, int] | list[int], topk_idx: Tensor, topk_w: Tensor) -> Tensor:
    """As :func:`moe` over the engine's own expert rows (:meth:`Kernels.moe_rows`); topk_idx holds row numbers."""
    if _eager():
        return kernels().moe_rows(x, packed, offsets, intermediate, qtype, blocksizes, topk_idx, topk_w)
    return torch.ops.clover.moe_rows(x, packed, list(offsets), intermediate, qtype, list(blocksizes), topk_idx,
                                     topk_w)


def gdn_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
             state_out: Tensor | None) -> Tensor:
    """One Gated DeltaNet AR step on the CPU (:meth:`Kernels.gdn_step`; eager callers only: no custom op)."""
    return kernels().gdn_step(q, k, v, g, beta, state, state_out)


def gdn_conv(x: Tensor, weight: Tensor, state: Tensor, state_out: Tensor | None) -> Tensor:
    """A GDN layer's one-token convolution on the CPU (:meth:`Kernels.gdn_conv`; eager callers only)."""
    return kernels().gdn_conv(x, weight, state, state_out)


def gdn_token(act: Tensor, zs: Tensor, beta: Tensor, g: Tensor, norm: tuple[Tensor, float], state: Tensor,
              state_out: Tensor | None, lanes: int) -> Tensor:
    """A GDN layer's one-token mixer after the convolution on the CPU (:meth:`Kernels.gdn_token`; eager callers
    only: no custom op)."""
    return kernels().gdn_token(act, zs, beta, g, norm, state, state_out, lanes)


def rms_norm(x: Tensor, weight: Tensor, eps: float, lanes: int) -> Tensor:
    """The model's RMSNorm on the CPU (:meth:`Kernels.rms_norm`, sums over ``lanes``-float vectors:
    ``engine.kernels.torch_lanes``; eager callers only: no custom op)."""
    return kernels().rms_norm(x, weight, eps, lanes)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One token's partial rotary embedding on the CPU (:meth:`Kernels.rope`; eager callers only: no custom op)."""
    return kernels().rope(x, cos, sin)


def blocks_of(x: Tensor, *mods: object) -> tuple[list[Tensor], int] | None:
    """The GGUF blocks of several linear layers that read the same input x [T, K] (``raw`` uint8 rows and
    ``qtype``, as ``engine.weights.gguf.model.GGUFLinear`` holds them, no input reordering), when x and they are on
    the CPU and all of one type these kernels take: (blocks, type) for :func:`qmatmul_many`, else None (a plain or
    otherwise stored layer, another device, a compiled forward)."""
    if x.device.type != "cpu" or x.dim() != 2 or torch.compiler.is_compiling():
        return None
    raws = [getattr(m, "raw", None) for m in mods]
    qtypes = {getattr(m, "qtype", None) for m in mods}
    if any(not isinstance(r, Tensor) or r.device.type != "cpu" for r in raws) or len(qtypes) != 1 \
            or any(getattr(m, "in_heads", None) is not None for m in mods):
        return None
    qtype = qtypes.pop()
    return (raws, qtype) if qtype in BLOCK and usable(qtype) else None  # type: ignore[return-value]


def qmatmul_many(x: Tensor, ws: list[Tensor], qtype: int) -> list[Tensor]:
    """Several GGUF matrices of one type against the same x on the CPU (:meth:`Kernels.qmatmul_many`; eager callers
    only: no custom op)."""
    return kernels().qmatmul_many(x, ws, qtype)

def _need_f32(what: str, **tensors: tuple[Tensor | None, int]) -> None:
    """Raise ValueError unless each named tensor (None: absent, allowed) is float32, contiguous, of n values."""
    for name, (t, n) in tensors.items():
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n):
            raise ValueError(f"{what}: {name} must be {n} contiguous float32 values, got {tuple(t.shape)} {t.dtype}")
