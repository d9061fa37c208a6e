/*
 * CPU matmul kernels over GGUF (ggml) quantized weight blocks, read in place.
 *
 * Each activation row is quantized once per call into int8 blocks, then every output value is an integer dot
 * product of those blocks with the weight blocks of one weight row, scaled and accumulated in fp32:
 *
 *   - K formats (Q4_K, Q5_K, Q6_K): activations as "A8K" blocks of 256 values (fp32 d, int8 q[256], int16 sums of
 *     each 16 values) so a weight block's offsets (the mins of Q4_K/Q5_K, the -32 of Q6_K) cost one small dot with
 *     the sums instead of touching every value.
 *   - Q8_0 / Q4_0: activations as "A8" blocks of 32 values (fp32 d, fp32 s = d * sum(q), int8 q[32]).
 *
 * Weights: uint8 rows of whole blocks, one ggml row (K values) per output row, `row_stride` bytes apart.
 * Output rows are split across OpenMP threads; for T > 1 activation rows the loop over T sits inside the loop over
 * weight rows, so each weight row is read from memory once per call and reused from L1 for every activation row.
 *
 * Two implementations of every dot: AVX2 (+FMA, F16C) when compiled with -march=native on such a CPU, and a
 * portable scalar one (also forced with -DCLOVER_FORCE_SCALAR, which the tests use to compare both).
 * Integer parts are exact in both, so the two agree up to the order of fp32 additions.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(CLOVER_FORCE_SCALAR)
#define CLOVER_AVX2 1
#include <immintrin.h>
#else
#define CLOVER_AVX2 0
#endif
/* VNNI: vpdpwssd adds the int16 pair products to the int32 sums in one instruction where AVX2 needs madd + add, and
   vpdpbusd the unsigned x signed byte products where AVX2 needs maddubs + madd; the same integers (both wrap mod
   2^32; these sums stay far inside). CLOVER_VNNI 1: AVX-512 VNNI's 256-bit forms (AVX512VL: AMD Zen 4 on, Intel
   Xeon / Ice Lake on); 2: AVX-VNNI's VEX forms, the same operation (Intel Alder Lake on, with no AVX-512). */
#if CLOVER_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(CLOVER_NO_VNNI)
#define CLOVER_VNNI 1
#define dpbusd256 _mm256_dpbusd_epi32
#define dpwssd256 _mm256_dpwssd_epi32
#elif CLOVER_AVX2 && defined(__AVXVNNI__) && !defined(CLOVER_NO_VNNI)
#define CLOVER_VNNI 2
#define dpbusd256 _mm256_dpbusd_avx_epi32
#define dpwssd256 _mm256_dpwssd_avx_epi32
#else
#define CLOVER_VNNI 0
#endif
/* vector registers: 32 with AVX-512 (AVX512VL gives the ymm forms all of them), else 16. CLOVER_16_REGS sizes the
   kernels for 16 on an AVX-512 build (what an AVX-VNNI build runs, checkable where AVX-VNNI is not) */
#if CLOVER_AVX2 && defined(__AVX512VL__) && !defined(CLOVER_16_REGS)
#define CLOVER_REGS 32
#else
#define CLOVER_REGS 16
#endif

/* ggml type ids (fixed by the file format) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

/*
 * "Split" formats: the engine's own quantized cache (engine/weights/quant.py). Codes and fp32 scales lie in two
 * separate arrays; value v of a flattened matrix (row r, column j: v = r * K + j) has the scale s[v / bs]. Private
 * ids, outside ggml's range:
 *   - T_NF4: bitsandbytes NF4, two 4-bit codes per byte (value 2i in the HIGH nibble of byte i, 2i+1 in the low),
 *     x = NF4_CODE[q] * absmax of its block (bs values, blocks over the flattened matrix, no nested absmax);
 *   - T_I8:  int8 codes, x = q * scale (the cache's per-row int8: bs = K, one scale per row).
 * Activations are A8 blocks of 32 values (as for Q8_0); bs must be a multiple of 32, so a 32-value chunk never
 * straddles two scales even where an NF4 block straddles two rows.
 */
enum { T_NF4 = 200, T_I8 = 201 };

/*
 * T_Q4_KX8: Q4_K rows interleaved in groups of 8 for the routed experts (the end of the file; engine.kernels.x8 packs
 * and unpacks it): the same 144 bytes a row and a block, arranged so that one 32-byte load holds 4 values of each of
 * 8 rows. Rows 8g .. 8g+7 of a matrix start at 8g * the row stride; their block b (1152 bytes) at b * 1152:
 *   [0:16] the 8 rows' fp16 d, [16:32] their fp16 dmin, [32:128] the packed scales: dword k (0-2) of row r at
 *   32 + 32k + 4r, [128:1152] the nibbles: bytes 4i .. 4i+3 of chunk c (Q4_K's 32-byte chunks) of row r at
 *   128 + ((8c + i) * 8 + r) * 4.
 */
enum { T_Q4_KX8 = 212 };
#define X8_BLOCK 1152
/*
 * T_Q6_KX8: Q6_K rows in groups of 8 likewise, 210 bytes a row and a block, the 6-bit values re-packed so that each
 * takes at most 4 operations to unpack (Q6_K's ql / qh take 17 for 4 vectors). Block b of a group (1680 bytes) at
 * b * 1680: [0:16] the 8 rows' fp16 d, [16:144] their int8 scales (scale j of row r at 16 + 8j + r), [144:1680] for
 * each half h (values 128h ..) and quad i (0-7), three 32-byte vectors t = 0, 1, 2 at 144 + ((8h + i) * 3 + t) * 32,
 * byte 4r + k of vector t = v_t | ((v_3 >> 2t) & 3) << 6, where v_m is value 128h + 32m + 4i + k of row r.
 */
enum { T_Q6_KX8 = 214 };
#define X8_BLOCK6 1680
/*
 * T_NF4X8: the own cache's NF4 expert rows (T_NF4, one fp32 scale per bs values, bs a multiple of 32 dividing the
 * row width K) in groups of 8 likewise. Rows 8g .. 8g+7 keep their codes' bytes (8 K / 2 from row 8g) and their
 * scales (8 K / bs floats from row 8g's first). The codes of 32-value step c (values 32c .. 32c+31 of each row) lie
 * in 128 bytes at 128c: four 32-byte vectors v = 0..3, whose byte 4r + k holds the code of value 32c + 4v + k of row
 * r in its low nibble and that of value 32c + 16 + 4v + k in its high nibble; the scales as [block j][row r]
 * (scale j of row r at 8j + r). The codes (4 bits) are unchanged: only their places move.
 */
enum { T_NF4X8 = 220 };
/*
 * T_I8X8: the own cache's per-row INT8 matrices (T_I8: the dense projections) in groups of 8 rows likewise. Rows
 * 8g .. 8g+7 keep their 8 K code bytes and their scales (as T_NF4X8's: [block j][row r], unchanged for one scale a
 * row); the codes of 32-value step c lie in 256 bytes at 256c: eight 32-byte vectors v = 0..7, whose byte 4r + k is
 * the code of value 32c + 4v + k of row r. Dense products take it (qmatmul_run), not the routed experts (moe_run).
 */
enum { T_I8X8 = 221 };
/* the split formats' interleaved types: their own kernel (x8_rows_split) at any token count, kts's bits */
static inline int is_x8_split(int qt) { return qt == T_NF4X8 || qt == T_I8X8; }
static inline int is_x8_type(int qt) { return qt == T_Q4_KX8 || qt == T_Q6_KX8 || qt == T_NF4X8; }
/* interleaved types that take their own kernel at any token count (the tiled kernels' bits, no tiles) */
static inline int x8_always(int qt) { return qt == T_Q6_KX8 || qt == T_NF4X8; }

/* error codes returned to Python */
enum { OK = 0, ERR_TYPE = 1, ERR_SHAPE = 2, ERR_ALLOC = 3 };

#define QK 256   /* values per K-format block */
#define QS 32    /* values per Q8_0 / Q4_0 block */

/* ------------------------------------------------------------------------------------------------------------ */
/* activation blocks                                                                                            */
/* ------------------------------------------------------------------------------------------------------------ */

/* 256 activation values: x ~ d * q; bsums[j] = sum of q[16j .. 16j+15] */
typedef struct {
    float d;
    int8_t q[QK];
    int16_t bsums[QK / 16];
} a8k_t;

/* 32 activation values: x ~ d * q; s = d * sum(q) (for Q4_0's -8 offset), off = -128 sum(q) (T_NF4X8's, whose VNNI
   dots read w + 128) */
typedef struct {
    float d;
    float s;
    int32_t off;
    int8_t q[QS];
} a8_t;

static inline int is_k_type(int qt) {
    return qt == T_Q4_K || qt == T_Q5_K || qt == T_Q6_K || qt == T_Q4_KX8 || qt == T_Q6_KX8;
}

static inline int is_split_type(int qt) { return qt == T_NF4 || qt == T_I8; }

static inline int block_values(int qt) { return is_k_type(qt) ? QK : QS; }

static inline int block_bytes(int qt) {
    switch (qt) {
    case T_Q4_0: return 18;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q4_KX8: return 144; /* a row's share of its group's block */
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_Q6_KX8: return 210;
    default: return 0;
    }
}

/* bytes of one quantized activation block for weights of type qt */
static inline size_t act_block_size(int qt) { return is_k_type(qt) ? sizeof(a8k_t) : sizeof(a8_t); }

/* ------------------------------------------------------------------------------------------------------------ */
/* small helpers                                                                                                */
/* ------------------------------------------------------------------------------------------------------------ */

/* little-endian fp16 at p -> fp32 */
static inline float load_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(CLOVER_FORCE_SCALAR)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/*
 * Q4_K / Q5_K packed scales: 12 bytes -> eight 6-bit scales sc[0..7] and mins m[0..7].
 * bytes 0-3: sc[0..3] in the low 6 bits, the top 2 bits of sc[4..7];
 * bytes 4-7: m[0..3] in the low 6 bits, the top 2 bits of m[4..7];
 * bytes 8-11: low nibble = low 4 bits of sc[4..7], high nibble = low 4 bits of m[4..7].
 * Done on 32-bit words: four values per operation.
 */
static inline void unpack_k4_scales(const uint8_t *p, uint8_t sc[8], uint8_t m[8]) {
    uint32_t s0, s1, s2, v;
    memcpy(&s0, p, 4);
    memcpy(&s1, p + 4, 4);
    memcpy(&s2, p + 8, 4);
    v = s0 & 0x3f3f3f3fu;
    memcpy(sc, &v, 4);
    v = (s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u);
    memcpy(sc + 4, &v, 4);
    v = s1 & 0x3f3f3f3fu;
    memcpy(m, &v, 4);
    v = ((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u);
    memcpy(m + 4, &v, 4);
}

/* a 144-byte Q4_K block <-> row r (0-7) of an interleaved group's block (T_Q4_KX8): to_group 1 writes the group's */
static void x8_q4_row(uint8_t *one, int r, uint8_t *blk, int to_group) {
#define X8_MOVE(at, from, n) (to_group ? memcpy(blk + (at), one + (from), n) : memcpy(one + (from), blk + (at), n))
    X8_MOVE(2 * r, 0, 2);
    X8_MOVE(16 + 2 * r, 2, 2);
    for (int k = 0; k < 3; k++) X8_MOVE(32 + 32 * k + 4 * r, 4 + 4 * k, 4);
    for (int ci = 0; ci < 32; ci++) X8_MOVE(128 + (ci * 8 + r) * 4, 16 + 4 * ci, 4); /* ci = 8c + i */
#undef X8_MOVE
}

/* value v (0-255) of a 210-byte Q6_K block, 0-63 (the Q6_K comment's order) */
static inline int q6_value(const uint8_t *one, int v) {
    const int h = v / 128, m = v % 128 / 32, l = v % 32;
    const uint8_t lo = one[64 * h + l + 32 * (m & 1)], hb = one[128 + 32 * h + l];
    return (m < 2 ? lo & 15 : lo >> 4) | ((hb >> (2 * m)) & 3) << 4;
}

/* a 210-byte Q6_K block <-> row r (0-7) of an interleaved group's block (T_Q6_KX8): to_group 1 writes the group's */
static void x8_q6_row(uint8_t *one, int r, uint8_t *blk, int to_group) {
    if (to_group) {
        memcpy(blk + 2 * r, one + 208, 2);
        for (int j = 0; j < 16; j++) blk[16 + 8 * j + r] = one[192 + j];
        for (int h = 0; h < 2; h++)
            for (int m = 0; m < 3; m++) /* vector m of quad l / 4: v_m and two bits of v_3 */
                for (int l = 0; l < 32; l++) {
                    const int v3 = q6_value(one, 128 * h + 96 + l);
                    blk[144 + ((8 * h + l / 4) * 3 + m) * 32 + 4 * r + l % 4] =
                        (uint8_t)(q6_value(one, 128 * h + 32 * m + l) | ((v3 >> (2 * m)) & 3) << 6);
                }
        return;
    }
    memcpy(one + 208, blk + 2 * r, 2);
    for (int j = 0; j < 16; j++) one[192 + j] = blk[16 + 8 * j + r];
    memset(one, 0, 192);
    for (int v = 0; v < QK; v++) {
        const int h = v / 128, m = v % 128 / 32, l = v % 32, i = l / 4, k = l % 4;
        const uint8_t *t = blk + 144 + (8 * h + i) * 3 * 32 + 4 * r + k; /* vector 0's byte; 1 and 2 at +32, +64 */
        const int q = m < 3 ? t[32 * m] & 63 : (t[0] >> 6) | (t[32] >> 6) << 2 | (t[64] >> 6) << 4;
        one[64 * h + l + 32 * (m & 1)] |= (uint8_t)(m < 2 ? q & 15 : (q & 15) << 4);
        one[128 + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * m));
    }
}

#if CLOVER_AVX2
/* acc + madd(p, s): int32 sums of the int16 pair products p * s */
static inline __m256i madd_acc(__m256i acc, __m256i p, __m256i s) {
#if CLOVER_VNNI
    return dpwssd256(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* unsigned u . signed s over 32 bytes -> 8 int32 sums of 4 products each: maddubs + madd by ones, or one vpdpbusd
   (the same integers: no pair of products here reaches maddubs' int16 saturation, |u| <= 128, |s| <= 127) */
static inline __m256i dot_us(__m256i u, __m256i s) {
#if CLOVER_VNNI
    return dpbusd256(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* signed int8 w . signed int8 x over 32 values -> 8 int32 partial sums (|w| as the unsigned side, the sign of w
   moved onto x) */
static inline __m256i dot32_i8(__m256i w, const int8_t *xq) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/* activation quantization                                                                                      */
/* ------------------------------------------------------------------------------------------------------------ */

/* n values -> int8 with scale amax/127 (round half to even in both paths, so both give the same bytes) */
static void quantize_block(const float *x, int n, int8_t *q, float *d_out) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    if (amax == 0.0f) {
        memset(q, 0, (size_t)n);
        *d_out = 0.0f;
        return;
    }
    const float iscale = 127.0f / amax;
#if CLOVER_AVX2
    const __m256 vs = _mm256_set1_ps(iscale);
    for (int i = 0; i < n; i += 32) { /* n is 32 or 256 */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vs),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vs),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vs),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs work per 128-bit lane: fix the order with one dword permute at the end */
        __m256i p01 = _mm256_packs_epi32(i0, i1);
        __m256i p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), p);
    }
#else
    for (int i = 0; i < n; i++) {
        float v = nearbyintf(x[i] * iscale);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
    }
#endif
    *d_out = amax / 127.0f;
}

/* one activation row of K values -> K/256 A8K blocks */
static void quantize_row_a8k(const float *x, int64_t K, a8k_t *out) {
    for (int64_t b = 0; b < K / QK; b++) {
        a8k_t *blk = out + b;
        quantize_block(x + b * QK, QK, blk->q, &blk->d);
        for (int j = 0; j < QK / 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += blk->q[16 * j + l];
            blk->bsums[j] = (int16_t)s;
        }
    }
}

/* one activation row of K values -> K/32 A8 blocks */
static void quantize_row_a8(const float *x, int64_t K, a8_t *out) {
    for (int64_t b = 0; b < K / QS; b++) {
        a8_t *blk = out + b;
        quantize_block(x + b * QS, QS, blk->q, &blk->d);
        int s = 0;
        for (int l = 0; l < QS; l++) s += blk->q[l];
        blk->s = blk->d * (float)s;
        blk->off = -128 * s;
    }
}

/* a row in the activation form of weight type qt, written at dst (act_block_size(qt) * K / block_values bytes) */
static void quantize_row_for(int qt, const float *x, int64_t K, void *dst) {
    if (is_k_type(qt)) quantize_row_a8k(x, K, (a8k_t *)dst);
    else quantize_row_a8(x, K, (a8_t *)dst);
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Q4_K: 144 bytes per 256 values                                                                               */
/*   [0:2] fp16 d, [2:4] fp16 dmin, [4:16] packed 6-bit scales/mins (unpack_k4_scales), [16:144] nibbles:      */
/*   32-byte chunk c holds sub-block 2c (32 values) in its low nibbles and sub-block 2c+1 in its high nibbles.  */
/*   x = d * sc[j] * q - dmin * m[j] for a value q of sub-block j.                                              */
/*   dot = d*da * sum_j sc[j] * sum(q*a) - dmin*da * sum_j m[j] * (bsums[2j] + bsums[2j+1])                      */
/* Q5_K: 176 bytes per 256 values                                                                               */
/*   [0:2] fp16 d, [2:4] fp16 dmin, [4:16] packed scales/mins as Q4_K, [16:48] qh, [48:176] nibbles as Q4_K.    */
/*   Value l (0..31) of sub-block j: low 4 bits from the nibbles, bit 4 = bit j of qh[l]. x = d*sc*q - dmin*m.  */
/* One body for both (q5: the qh bits), inlined into dot_q4k / dot_q5k with q5 a constant, so each compiles to    */
/* its own loop with no test of q5 inside.                                                                      */
/* ------------------------------------------------------------------------------------------------------------ */

/* the most activation rows one direct K dot takes at once (dot_q45k_n, dot_q6k_n): each weight block is unpacked
   once for them. 4 rows of Q4_K hold 16 of the 32 AVX-512 vector registers in accumulators (an AVX2-only build has
   16 and spills some; it still gains over single dots) */
#define DOT_ROWS 4
/* the most activation rows one interleaved INT8 dot takes (x8_dots_split): 2 chains of sums a row in registers (32 of
   them with AVX-512, 16 without); 8 rows only where VNNI's single instruction leaves no temporaries */
#if CLOVER_VNNI && CLOVER_REGS == 32
#define X8_I8_ROWS 8
#else
#define X8_I8_ROWS 4
#endif

/* how many of `left` (> 0) activation rows the next multi-row dot takes: groups of DOT_ROWS, and of 3 rather than
   4 + 1 (5 rows: 3 + 2, 6: 3 + 3, 7: 4 + 3) */
static inline int64_t dot_group(int64_t left) { return left == 5 || left == 6 ? 3 : left < DOT_ROWS ? left : DOT_ROWS; }

#if CLOVER_AVX2
/* Q4_K / Q5_K values 64c .. 64c+31 (lo) and 64c+32 .. 64c+63 (hi) of a block: the nibbles of qs[32c ..], and with
   q5 bit 4 from qh (bit 2c of qh[l] for lo, 2c+1 for hi). The dots, row_dots' decoder and kt's share it. */
static inline __attribute__((always_inline)) void q45k_values(const uint8_t *qs, __m256i qh, int c, int q5,
                                                              __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    __m256i l = _mm256_and_si256(q, low4), h = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    if (q5) { /* bit 4 where bit j of qh is set */
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const __m256i m0 = _mm256_set1_epi8((char)(1 << (2 * c))), m1 = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
        l = _mm256_or_si256(l, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m0), m0), bit4));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, m1), m1), bit4));
    }
    *lo = l;
    *hi = h;
}

/* Q6_K values 128h .. 128h+127 of a block as four 32-byte vectors v[0..3] (the order the Q6_K comment gives):
   low nibbles from ql[64h ..], the 2-bit highs from qh[32h ..]. The dot, row_dots' decoder and kt's share it. */
static inline __attribute__((always_inline)) void q6k_values(const uint8_t *w, int h, __m256i v[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i m03 = _mm256_set1_epi8(0x03), m0c = _mm256_set1_epi8(0x0c), m30 = _mm256_set1_epi8(0x30);
    const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
    v[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(hb, m03), 4));
    v[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(hb, m0c), 2));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, m30));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
}

/* dot_q45k for na (1 to DOT_ROWS, a constant) activation rows at once: the weight block's nibbles and scales are
   unpacked once for all; each row's operations are dot_q45k's, in its order (the same bits as na single dots) */
static inline __attribute__((always_inline)) void dot_q45k_n(const uint8_t *w, const a8k_t *const *as, const int na,
                                                             int64_t nb, const int q5, float *out) {
    const int64_t bb = q5 ? 176 : 144, qs_at = q5 ? 48 : 16; /* block bytes, offset of the nibbles */
    __m256 acc[DOT_ROWS];
    __m128 acc_min[DOT_ROWS]; /* the mins' part, kept in 4 lanes until the end of the row */
    for (int j = 0; j < na; j++) acc[j] = _mm256_setzero_ps(), acc_min[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bb) {
        uint8_t sc8[8], m8[8];
        unpack_k4_scales(w + 4, sc8, m8);
        uint64_t sc64, m64;
        memcpy(&sc64, sc8, 8);
        memcpy(&m64, m8, 8);
        /* each sub-block's scale twice in an int32 (the int16 pair a madd multiplies), stored so that a broadcast
           is one dword load: 8 broadcasts from a register took two instructions each (pextrw, pbroadcastw) */
        int32_t sc2[8] __attribute__((aligned(32)));
        {
            const __m256i s32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)sc64));
            _mm256_store_si256((__m256i *)sc2, _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16)));
        }
        const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        const uint8_t *qs = w + qs_at;
        __m256i sumi[DOT_ROWS], sumi1[DOT_ROWS]; /* two chains a row: the low and the high nibbles' */
        for (int j = 0; j < na; j++) {
            const a8k_t *a = as[j] + b;
            const float da = a->d;
            const float dmin = load_f16(w + 2) * da;
            /* mins: eight pair sums of bsums times m */
            __m256i bs = _mm256_loadu_si256((const __m256i *)a->bsums);
            __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            __m128i mins = _mm_madd_epi16(pairs, _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)m64)));
            acc_min[j] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins), acc_min[j]);
            sumi[j] = sumi1[j] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            q45k_values(qs, qh, c, q5, &lo, &hi);
            for (int j = 0; j < na; j++) {
                const a8k_t *a = as[j] + b;
                __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(a->q + 64 * c)));
                __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a->q + 64 * c + 32)));
                sumi[j] = madd_acc(sumi[j], p0, _mm256_set1_epi32(sc2[2 * c]));
                sumi1[j] = madd_acc(sumi1[j], p1, _mm256_set1_epi32(sc2[2 * c + 1]));
            }
        }
        for (int j = 0; j < na; j++) {
            const float d = load_f16(w) * as[j][b].d;
            const __m256i si = _mm256_add_epi32(sumi[j], sumi1[j]); /* integers: the same sums in any order */
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(si), acc[j]);
        }
    }
    for (int j = 0; j < na; j++) out[j] = hsum_ps(_mm256_sub_ps(acc[j], _mm256_set_m128(_mm_setzero_ps(), acc_min[j])));
}
#endif

static inline __attribute__((always_inline)) float dot_q45k(const uint8_t *w, const void *av, int64_t nb,
                                                            const int q5) {
    const a8k_t *a = (const a8k_t *)av;
#if CLOVER_AVX2
    float o;
    dot_q45k_n(w, &a, 1, nb, q5, &o);
    return o;
#else
    const int64_t bb = q5 ? 176 : 144, qs_at = q5 ? 48 : 16; /* block bytes, offset of the nibbles */
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bb, a++) {
        const float d = load_f16(w) * a->d, dmin = load_f16(w + 2) * a->d;
        uint8_t sc[8], m[8];
        unpack_k4_scales(w + 4, sc, m);
        const uint8_t *qh = w + 16, *qs = w + qs_at;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) summ += m[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
        for (int c = 0; c < 4; c++) {
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 0x0f, hi = qs[32 * c + l] >> 4;
                if (q5) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                s0 += lo * a->q[64 * c + l];
                s1 += hi * a->q[64 * c + 32 + l];
            }
            sumi += sc[2 * c] * s0 + sc[2 * c + 1] * s1;
        }
        acc += d * (float)sumi - dmin * (float)summ;
    }
    return acc;
#endif
}

static float dot_q4k(const uint8_t *w, const void *av, int64_t nb) { return dot_q45k(w, av, nb, 0); }

static float dot_q5k(const uint8_t *w, const void *av, int64_t nb) { return dot_q45k(w, av, nb, 1); }

/* ------------------------------------------------------------------------------------------------------------ */
/* Q6_K: 210 bytes per 256 values                                                                               */
/*   [0:128] ql low nibbles, [128:192] qh 2-bit highs, [192:208] int8 scales (one per 16 values), [208:210] d.  */
/*   Half h (values 128h..128h+127) uses ql[64h..], qh[32h..]; for l < 32:                                       */
/*     value l      = ql[l] & 15      | (qh[l] >> 0 & 3) << 4                                                    */
/*     value l + 32 = ql[l + 32] & 15 | (qh[l] >> 2 & 3) << 4                                                    */
/*     value l + 64 = ql[l] >> 4      | (qh[l] >> 4 & 3) << 4                                                    */
/*     value l + 96 = ql[l + 32] >> 4 | (qh[l] >> 6 & 3) << 4                                                    */
/*   x = d * scale[v / 16] * (q - 32); the -32 is taken out through the activation's 16-value sums.             */
/* ------------------------------------------------------------------------------------------------------------ */

#if CLOVER_AVX2
/* dot_q6k for na (1 to DOT_ROWS, a constant) activation rows at once: the weight block's values and scales are
   unpacked once for all; each row's operations are dot_q6k's, in its order (the same bits as na single dots) */
static inline __attribute__((always_inline)) void dot_q6k_n(const uint8_t *w, const a8k_t *const *as, const int na,
                                                            int64_t nb, float *out) {
    /* pshufb masks over 8 int16 scales broadcast to both lanes: vector i takes scale 2i (low lane), 2i+1 (high) */
    const __m256i pick[4] = {
        _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3),
        _mm256_setr_epi8(4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7),
        _mm256_setr_epi8(8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10,
                         11, 10, 11, 10, 11),
        _mm256_setr_epi8(12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14,
                         15, 14, 15, 14, 15, 14, 15, 14, 15),
    };
    __m256 acc[DOT_ROWS];
    for (int j = 0; j < na; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i sc16all = _mm256_cvtepi8_epi16(sc8);
        __m256i sumi[DOT_ROWS];
        for (int j = 0; j < na; j++) { /* offset: 32 * sum_j scale[j] * bsums[j] */
            __m256i offs = _mm256_madd_epi16(sc16all, _mm256_loadu_si256((const __m256i *)as[j][b].bsums));
            sumi[j] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offs, 5));
        }
        for (int h = 0; h < 2; h++) {
            __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h))));
            __m256i v[4], sc[4];
            q6k_values(w, h, v);
            for (int i = 0; i < 4; i++) sc[i] = _mm256_shuffle_epi8(scv, pick[i]);
            for (int j = 0; j < na; j++) {
                const int8_t *aq = as[j][b].q + 128 * h;
                __m256i p0 = _mm256_maddubs_epi16(v[0], _mm256_loadu_si256((const __m256i *)aq));
                __m256i p1 = _mm256_maddubs_epi16(v[1], _mm256_loadu_si256((const __m256i *)(aq + 32)));
                __m256i p2 = _mm256_maddubs_epi16(v[2], _mm256_loadu_si256((const __m256i *)(aq + 64)));
                __m256i p3 = _mm256_maddubs_epi16(v[3], _mm256_loadu_si256((const __m256i *)(aq + 96)));
                sumi[j] = madd_acc(sumi[j], p0, sc[0]);
                sumi[j] = madd_acc(sumi[j], p1, sc[1]);
                sumi[j] = madd_acc(sumi[j], p2, sc[2]);
                sumi[j] = madd_acc(sumi[j], p3, sc[3]);
            }
        }
        for (int j = 0; j < na; j++) {
            const float d = load_f16(w + 208) * as[j][b].d;
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
        }
    }
    for (int j = 0; j < na; j++) out[j] = hsum_ps(acc[j]);
}
#endif

static float dot_q6k(const uint8_t *w, const void *av, int64_t nb) {
    const a8k_t *a = (const a8k_t *)av;
#if CLOVER_AVX2
    float o;
    dot_q6k_n(w, &a, 1, nb, &o);
    return o;
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 210, a++) {
        const float d = load_f16(w + 208) * a->d;
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t sumi = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const int8_t *aq = a->q + 128 * h;
            int32_t s[8] = {0}; /* per 16-value group of this half */
            for (int l = 0; l < 32; l++) {
                int q0 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q1 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                s[0 + l / 16] += q0 * aq[l];
                s[2 + l / 16] += q1 * aq[l + 32];
                s[4 + l / 16] += q2 * aq[l + 64];
                s[6 + l / 16] += q3 * aq[l + 96];
            }
            for (int g = 0; g < 8; g++) sumi += sc[8 * h + g] * s[g];
        }
        acc += d * (float)sumi;
    }
    return acc;
#endif
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Q8_0: 34 bytes per 32 values: [0:2] fp16 d, [2:34] int8 q; x = d * q                                         */
/* ------------------------------------------------------------------------------------------------------------ */

static float dot_q8_0(const uint8_t *w, const void *av, int64_t nb) {
    const a8_t *a = (const a8_t *)av;
#if CLOVER_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34, a++) {
        const __m256i s = dot32_i8(_mm256_loadu_si256((const __m256i *)(w + 2)), a->q);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(w) * a->d), _mm256_cvtepi32_ps(s), acc);
    }
    return hsum_ps(acc);
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 34, a++) {
        const int8_t *q = (const int8_t *)(w + 2);
        int32_t s = 0;
        for (int l = 0; l < QS; l++) s += q[l] * a->q[l];
        acc += load_f16(w) * a->d * (float)s;
    }
    return acc;
#endif
}

/* ------------------------------------------------------------------------------------------------------------ */
/* Q4_0: 18 bytes per 32 values: [0:2] fp16 d, [2:18] nibbles: value i < 16 in the low nibble of byte i, value */
/*   16 + i in its high nibble; x = d * (q - 8). dot = d*da*sum(q*a) - 8*d*s (s = da*sum(a)).                   */
/* ------------------------------------------------------------------------------------------------------------ */

static float dot_q4_0(const uint8_t *w, const void *av, int64_t nb) {
    const a8_t *a = (const a8_t *)av;
#if CLOVER_AVX2
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    float acc_off = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 18, a++) {
        const float d = load_f16(w);
        __m128i raw = _mm_loadu_si128((const __m128i *)(w + 2));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        __m256i s = dot_us(q, _mm256_loadu_si256((const __m256i *)a->q));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(s), acc);
        acc_off += d * a->s;
    }
    return hsum_ps(acc) - 8.0f * acc_off;
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += 18, a++) {
        const uint8_t *qs = w + 2;
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += (qs[l] & 0x0f) * a->q[l] + (qs[l] >> 4) * a->q[l + 16];
        const float d = load_f16(w);
        acc += d * a->d * (float)s - 8.0f * d * a->s;
    }
    return acc;
#endif
}


/* ------------------------------------------------------------------------------------------------------------ */
/* split formats (NF4, I8): 32 values per step, one fp32 scale per bs values (see T_NF4 / T_I8 above)            */
/*   NF4 codes go through a 16-entry int8 table, NF4_I8[c] = round(127 * NF4_CODE[c]) (the 1/127 is applied at  */
/*   the end of the row), so the dot is the same signed int8 dot as Q8_0's.                                     */
/* ------------------------------------------------------------------------------------------------------------ */

static const int8_t NF4_I8[16] = {-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127};

/* the scale walk: value v0 starts the row; each 32-value step moves to the next scale every bs values */
typedef float (*sdot_fn)(const uint8_t *q, const float *s, int64_t v0, int64_t bs, const a8_t *a, int64_t nb);

#if CLOVER_AVX2
/* 32 NF4 codes (16 bytes, high nibble first) -> their int8 table values in value order */
static inline __m256i nf4_values(const uint8_t *q, __m256i lut) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4), lo = _mm_and_si128(raw, low4);
    return _mm256_shuffle_epi8(lut, _mm256_set_m128i(_mm_unpackhi_epi8(hi, lo), _mm_unpacklo_epi8(hi, lo)));
}

/* 64 NF4 codes (32 bytes) -> the table values of the first and the second 32 in value order (nf4_values twice, with
   the unpacking done on whole registers) */
static inline void nf4_values64(const uint8_t *q, __m256i lut, __m256i *v0, __m256i *v1) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), lo = _mm256_and_si256(raw, low4);
    const __m256i a = _mm256_unpacklo_epi8(hi, lo), b = _mm256_unpackhi_epi8(hi, lo); /* per 128-bit lane */
    *v0 = _mm256_shuffle_epi8(lut, _mm256_permute2x128_si256(a, b, 0x20));
    *v1 = _mm256_shuffle_epi8(lut, _mm256_permute2x128_si256(a, b, 0x31));
}
#endif

/* the scale of the next 32-value step, then the walk moves on */
static inline float next_scale(const float *s, int64_t bs, int64_t *blk, int64_t *rem) {
    const float v = s[*blk];
    *rem += 32;
    if (*rem == bs) *rem = 0, (*blk)++;
    return v;
}

static float dot_nf4(const uint8_t *q, const float *s, int64_t v0, int64_t bs, const a8_t *a, int64_t nb) {
    int64_t blk = v0 / bs, rem = v0 % bs;
#if CLOVER_AVX2
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NF4_I8));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* two chains: the FMA latency overlaps */
    int64_t b = 0;
    if (rem == 0 && bs % 64 == 0) { /* whole scale blocks of whole pairs (the cache's blocksize 64): one load a pair */
        const int64_t pairs_per_scale = bs / 64;
        for (int64_t j = 0; b + 1 < nb; b += 2, q += 32, a += 2) {
            __m256i v0, v1;
            nf4_values64(q, lut, &v0, &v1);
            const __m256i p0 = dot32_i8(v0, a[0].q), p1 = dot32_i8(v1, a[1].q);
            const float sc = s[blk];
            if (++j == pairs_per_scale) j = 0, blk++;
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(sc * a[0].d), _mm256_cvtepi32_ps(p0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(sc * a[1].d), _mm256_cvtepi32_ps(p1), acc1);
        }
    }
    for (; b + 1 < nb; b += 2, q += 32, a += 2) {
        const __m256i p0 = dot32_i8(nf4_values(q, lut), a[0].q), p1 = dot32_i8(nf4_values(q + 16, lut), a[1].q);
        const float s0 = next_scale(s, bs, &blk, &rem), s1 = next_scale(s, bs, &blk, &rem);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0 * a[0].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1 * a[1].d), _mm256_cvtepi32_ps(p1), acc1);
    }
    if (b < nb) {
        const __m256i p0 = dot32_i8(nf4_values(q, lut), a->q);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(next_scale(s, bs, &blk, &rem) * a->d), _mm256_cvtepi32_ps(p0), acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1)) * (1.0f / 127.0f);
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, q += 16, a++) {
        int32_t sum = 0;
        for (int l = 0; l < 16; l++) sum += NF4_I8[q[l] >> 4] * a->q[2 * l] + NF4_I8[q[l] & 0x0f] * a->q[2 * l + 1];
        acc += next_scale(s, bs, &blk, &rem) * a->d * (float)sum;
    }
    return acc * (1.0f / 127.0f);
#endif
}

#if CLOVER_AVX2
/* dot_nf4 for na (1 to DOT_ROWS, a constant) activation rows at once, on its first path: whole pairs of 32-value
   steps in whole scale blocks (nf4_rows_ok: the cache's rows). Each pair's codes are unpacked once for all rows;
   each row's operations are dot_nf4's, in its order (the same bits as na single dots). */
static inline __attribute__((always_inline)) void dot_nf4_n(const uint8_t *q, const float *s, int64_t blk, int64_t bs,
                                                            const a8_t *const *as, const int na, int64_t nb, float *out) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NF4_I8));
    __m256 acc0[DOT_ROWS], acc1[DOT_ROWS];
    for (int j = 0; j < na; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();
    const int64_t pairs_per_scale = bs / 64;
    int64_t k = 0;
    for (int64_t b = 0; b + 1 < nb; b += 2, q += 32) {
        __m256i v0, v1;
        nf4_values64(q, lut, &v0, &v1);
        const float sc = s[blk];
        if (++k == pairs_per_scale) k = 0, blk++;
        for (int j = 0; j < na; j++) {
            const a8_t *a = as[j] + b;
            const __m256i p0 = dot32_i8(v0, a[0].q), p1 = dot32_i8(v1, a[1].q);
            acc0[j] = _mm256_fmadd_ps(_mm256_set1_ps(sc * a[0].d), _mm256_cvtepi32_ps(p0), acc0[j]);
            acc1[j] = _mm256_fmadd_ps(_mm256_set1_ps(sc * a[1].d), _mm256_cvtepi32_ps(p1), acc1[j]);
        }
    }
    for (int j = 0; j < na; j++) out[j] = hsum_ps(_mm256_add_ps(acc0[j], acc1[j])) * (1.0f / 127.0f);
}
#endif

/* whether dot_nf4_n takes a row whose first value is v0: whole scale blocks of whole 64-value pairs */
static inline int nf4_rows_ok(int64_t v0, int64_t bs, int64_t nb) { return v0 % bs == 0 && bs % 64 == 0 && nb % 2 == 0; }

static float dot_i8(const uint8_t *q, const float *s, int64_t v0, int64_t bs, const a8_t *a, int64_t nb) {
    int64_t blk = v0 / bs, rem = v0 % bs;
#if CLOVER_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, q += 64, a += 2) {
        const __m256i p0 = dot32_i8(_mm256_loadu_si256((const __m256i *)q), a[0].q);
        const __m256i p1 = dot32_i8(_mm256_loadu_si256((const __m256i *)(q + 32)), a[1].q);
        const float s0 = next_scale(s, bs, &blk, &rem), s1 = next_scale(s, bs, &blk, &rem);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0 * a[0].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1 * a[1].d), _mm256_cvtepi32_ps(p1), acc1);
    }
    if (b < nb) {
        const __m256i p0 = dot32_i8(_mm256_loadu_si256((const __m256i *)q), a->q);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(next_scale(s, bs, &blk, &rem) * a->d), _mm256_cvtepi32_ps(p0), acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
#else
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, q += 32, a++) {
        const int8_t *w = (const int8_t *)q;
        int32_t sum = 0;
        for (int l = 0; l < QS; l++) sum += w[l] * a->q[l];
        acc += next_scale(s, bs, &blk, &rem) * a->d * (float)sum;
    }
    return acc;
#endif
}

/* ------------------------------------------------------------------------------------------------------------ */
/* many activation rows against one weight row (prefill, diffusion passes, experts with several tokens)         */
/*                                                                                                              */
/* A K-format block is decoded once into a common form, then dotted with every activation row:                  */
/*   q[256]     unsigned values in block order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63),                            */
/*   sc[i][16]  int16 multipliers for values 32i..32i+31 as maddubs leaves them: lanes 0-7 the 16-value group 2i,*/
/*              lanes 8-15 group 2i+1,                                                                           */
/*   mn[16]     int16 offset per 16-value group, applied through the activation's 16-value sums,                */
/*   x = d * sc * q - dmin * mn   (Q6_K: mn = 32 * scale, dmin = d).                                            */
/* Decoding costs about one direct dot, so it pays from a few rows on.                                          */
/* ------------------------------------------------------------------------------------------------------------ */

#define DEC_MIN_ROWS 8 /* fewer activation rows than this: direct dots, up to DOT_ROWS at once */
#define DEC_TILE 64    /* activation rows per accumulator tile */

#if CLOVER_AVX2
typedef struct {
    uint8_t q[QK];
    int16_t sc[8][16];
    int16_t mn[16];
    float d, dmin;
} kdec_t;

/* Q4_K (hb = NULL) or Q5_K (hb = the 32 qh bytes) nibbles and scales -> kdec */
static void decode_q45k(const uint8_t *w, const uint8_t *qs, const uint8_t *hb, kdec_t *o) {
    uint8_t sc[8], m[8];
    o->d = load_f16(w);
    o->dmin = load_f16(w + 2);
    unpack_k4_scales(w + 4, sc, m);
    const __m256i qh = hb ? _mm256_loadu_si256((const __m256i *)hb) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        q45k_values(qs, qh, c, hb != NULL, &lo, &hi);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c), lo);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c + 32), hi);
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)o->sc[j], _mm256_set1_epi16((short)sc[j]));
    /* mn[2j] = mn[2j+1] = m[j], written with one 32-byte store: the dots read it back with one 32-byte load, which
       store-to-load forwarding serves only from a single store of that size (16 small stores stall it) */
    uint64_t m64;
    memcpy(&m64, m, 8);
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)m64));
    _mm256_storeu_si256((__m256i *)o->mn, _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16)));
}

/* Q6_K -> kdec (value order as in dot_q6k) */
static void decode_q6k(const uint8_t *w, kdec_t *o) {
    const int8_t *sc = (const int8_t *)(w + 192);
    o->d = o->dmin = load_f16(w + 208);
    for (int h = 0; h < 2; h++) {
        __m256i v[4];
        q6k_values(w, h, v);
        for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(o->q + 128 * h + 32 * k), v[k]);
    }
    for (int i = 0; i < 8; i++) {
        __m128i a = _mm_set1_epi16(sc[2 * i]), b = _mm_set1_epi16(sc[2 * i + 1]);
        _mm256_storeu_si256((__m256i *)o->sc[i], _mm256_set_m128i(b, a));
    }
    /* mn = 32 * scale, one 32-byte store (see decode_q45k) */
    _mm256_storeu_si256((__m256i *)o->mn,
                        _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192))), 5));
}

static void decode_k(int qt, const uint8_t *w, kdec_t *o) {
    if (qt == T_Q4_K) decode_q45k(w, w + 16, NULL, o);
    else if (qt == T_Q5_K) decode_q45k(w, w + 48, w + 16, o);
    else decode_q6k(w, o);
}

/* acc += the decoded block . one activation block (8 fp32 lanes, summed at the end of the row) */
static inline __m256 dot_dec(const kdec_t *k, const a8k_t *a, __m256 acc) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        __m256i p0 = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(k->q + 32 * i)),
                                          _mm256_loadu_si256((const __m256i *)(a->q + 32 * i)));
        __m256i p1 = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(k->q + 32 * i + 32)),
                                          _mm256_loadu_si256((const __m256i *)(a->q + 32 * i + 32)));
        s0 = madd_acc(s0, p0, _mm256_loadu_si256((const __m256i *)k->sc[i]));
        s1 = madd_acc(s1, p1, _mm256_loadu_si256((const __m256i *)k->sc[i + 1]));
    }
    __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)k->mn),
                                     _mm256_loadu_si256((const __m256i *)a->bsums));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(k->d * a->d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc);
    return _mm256_fnmadd_ps(_mm256_set1_ps(k->dmin * a->d), _mm256_cvtepi32_ps(mins), acc);
}

/* as dot_dec for two activation blocks at once: each decoded vector and scale is loaded once for both */
static inline void dot_dec2(const kdec_t *k, const a8k_t *a, const a8k_t *b, __m256 *acc_a, __m256 *acc_b) {
    __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(k->q + 32 * i));
        const __m256i sc = _mm256_loadu_si256((const __m256i *)k->sc[i]);
        __m256i pa = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(a->q + 32 * i)));
        __m256i pb = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(b->q + 32 * i)));
        sa = madd_acc(sa, pa, sc);
        sb = madd_acc(sb, pb, sc);
    }
    const __m256i mn = _mm256_loadu_si256((const __m256i *)k->mn);
    __m256i ma = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)a->bsums));
    __m256i mb = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)b->bsums));
    __m256 x = _mm256_fmadd_ps(_mm256_set1_ps(k->d * a->d), _mm256_cvtepi32_ps(sa), *acc_a);
    __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(k->d * b->d), _mm256_cvtepi32_ps(sb), *acc_b);
    *acc_a = _mm256_fnmadd_ps(_mm256_set1_ps(k->dmin * a->d), _mm256_cvtepi32_ps(ma), x);
    *acc_b = _mm256_fnmadd_ps(_mm256_set1_ps(k->dmin * b->d), _mm256_cvtepi32_ps(mb), y);
}
#endif

#if CLOVER_AVX2
/* one K-format weight row with na (1 to DOT_ROWS) activation rows: each row's bits are its single dot's */
#define K_DOTS(na)                                                                                                 \
    static inline __attribute__((always_inline)) void k_dots_##na(int qt, const uint8_t *wr,                     \
                                                                  const a8k_t *const *as, int64_t nb, float *o) {  \
        if (qt == T_Q4_K) dot_q45k_n(wr, as, na, nb, 0, o);                                                      \
        else if (qt == T_Q5_K) dot_q45k_n(wr, as, na, nb, 1, o);                                                 \
        else dot_q6k_n(wr, as, na, nb, o);                                                                       \
    }
K_DOTS(1)
K_DOTS(2)
K_DOTS(3)
K_DOTS(4)
#undef K_DOTS

static inline __attribute__((always_inline)) void k_dots(int qt, const uint8_t *wr, const a8k_t *const *as, int na,
                                                         int64_t nb, float *o) {
    switch (na) { /* a constant row count in each: the loops over rows unroll */
    case 1: k_dots_1(qt, wr, as, nb, o); break;
    case 2: k_dots_2(qt, wr, as, nb, o); break;
    case 3: k_dots_3(qt, wr, as, nb, o); break;
    default: k_dots_4(qt, wr, as, nb, o); break;
    }
}
#endif

/* dot of one weight row (nb blocks of type qt) with one quantized activation row */
typedef float (*dot_fn)(const uint8_t *w, const void *a, int64_t nb);
static dot_fn dot_for(int qt);

/*
 * out[i * ostride] = dot(weight row wr, activation row tidx[i] (or i when tidx is NULL)) for i < n; activation
 * row t at act + t * arow. Direct dots for a few rows or non-K types; the decoded path otherwise.
 */
static void row_dots(int qt, const uint8_t *wr, int64_t nb, const char *act, size_t arow, const int64_t *tidx,
                     int64_t n, float *out, int64_t ostride) {
#if CLOVER_AVX2
    if (n >= DEC_MIN_ROWS && is_k_type(qt)) { /* (where the tiled kernels do not take them) */
        const int bb = block_bytes(qt);
        kdec_t dec;
        __m256 acc[DEC_TILE];
        for (int64_t i0 = 0; i0 < n; i0 += DEC_TILE) {
            const int64_t m = n - i0 < DEC_TILE ? n - i0 : DEC_TILE;
            for (int64_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                decode_k(qt, wr + b * bb, &dec);
                int64_t i = 0;
                for (; i + 1 < m; i += 2) { /* two activation rows per pass over the decoded block */
                    const int64_t t0 = tidx ? tidx[i0 + i] : i0 + i, t1 = tidx ? tidx[i0 + i + 1] : i0 + i + 1;
                    dot_dec2(&dec, (const a8k_t *)(act + (size_t)t0 * arow) + b,
                             (const a8k_t *)(act + (size_t)t1 * arow) + b, &acc[i], &acc[i + 1]);
                }
                if (i < m) {
                    const int64_t t = tidx ? tidx[i0 + i] : i0 + i;
                    acc[i] = dot_dec(&dec, (const a8k_t *)(act + (size_t)t * arow) + b, acc[i]);
                }
            }
            for (int64_t i = 0; i < m; i++) out[(i0 + i) * ostride] = hsum_ps(acc[i]);
        }
        return;
    }
    if (n == 2 && is_k_type(qt)) { /* (the most frequent case first: a weight row's work is ~100 ns here) */
        const a8k_t *as[2] = {(const a8k_t *)(act + (size_t)(tidx ? tidx[0] : 0) * arow),
                              (const a8k_t *)(act + (size_t)(tidx ? tidx[1] : 1) * arow)};
        float o[2];
        k_dots(qt, wr, as, 2, nb, o);
        out[0] = o[0];
        out[ostride] = o[1];
        return;
    }
    if (n > 2 && is_k_type(qt)) { /* each block unpacked once for up to DOT_ROWS rows: each row's own bits */
        for (int64_t i0 = 0; i0 < n;) {
            const int64_t m = dot_group(n - i0);
            const a8k_t *as[DOT_ROWS];
            float o[DOT_ROWS];
            for (int64_t i = 0; i < m; i++) as[i] = (const a8k_t *)(act + (size_t)(tidx ? tidx[i0 + i] : i0 + i) * arow);
            k_dots(qt, wr, as, (int)m, nb, o);
            for (int64_t i = 0; i < m; i++) out[(i0 + i) * ostride] = o[i];
            i0 += m;
        }
        return;
    }
#endif
    dot_fn dot = dot_for(qt);
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = tidx ? tidx[i] : i;
        out[i * ostride] = dot(wr, act + (size_t)t * arow, nb);
    }
}

/* ------------------------------------------------------------------------------------------------------------ */
/* dispatch                                                                                                     */
/* ------------------------------------------------------------------------------------------------------------ */

static dot_fn dot_for(int qt) {
    switch (qt) {
    case T_Q4_K: return dot_q4k;
    case T_Q5_K: return dot_q5k;
    case T_Q6_K: return dot_q6k;
    case T_Q8_0: return dot_q8_0;
    case T_Q4_0: return dot_q4_0;
    default: return NULL;
    }
}

#ifdef _OPENMP /* used in the pragmas only */
static int threads_for(int nth, int64_t work) {
    if (nth < 1) nth = 1;
    if (work < nth) nth = (int)(work > 0 ? work : 1);
    return nth;
}

/*
 * Rows per dynamically scheduled chunk: about 32 chunks per thread, so a thread the OS preempts (a busy or shared
 * machine) holds back at most a small piece of the call, while each chunk still streams >= 16 adjacent rows.
 */
static int chunk_for(int64_t work, int nth) {
    int64_t c = work / ((int64_t)(nth > 0 ? nth : 1) * 32);
    return (int)(c < 16 ? 16 : c);
}

/*
 * chunk_for for rows of `row_bytes` each, read from memory: equal chunks, 2 to 32 per thread, each of at least
 * CHUNK_MIN_BYTES where the matrix allows. Every chunk starts a new stream the hardware prefetcher must pick up
 * again: a 4,096 x 2,048 Q4_K matrix (4.7 MB, 2 threads) read in chunks of 64 rows at 21 GB/s, in four chunks of
 * 1,024 at 26-27 (the 248,320-row head, 32 chunks a thread of ~3,900 rows, at 29-34). Rows that jump around, and
 * products of more than STREAM_MAX_T activation rows (bound by their multiplies, where small chunks keep the threads
 * balanced), pass row_bytes 0: chunk_for.
 */
#define CHUNK_MIN_BYTES (1 << 20)
#define STREAM_MAX_T 4 /* activation rows up to which a product is bound by its reads (more: by its multiplies) */
static int chunk_rows(int64_t work, int nth, int64_t row_bytes) {
    if (row_bytes <= 0) return chunk_for(work, nth);
    if (nth < 1) nth = 1;
    int64_t per = work * row_bytes / ((int64_t)nth * CHUNK_MIN_BYTES); /* chunks per thread at the minimum size */
    per = per < 2 ? 2 : per > 32 ? 32 : per;
    const int64_t c = (work + nth * per - 1) / (nth * per);
    return (int)(c < 1 ? 1 : c);
}
#endif

/* x [T, K] fp32 rows -> quantized activation rows for type qt, in a fresh buffer (NULL on failure) */
static void *quantize_rows(int qt, const float *x, int64_t T, int64_t K, int nth) {
    const int64_t nb = K / block_values(qt);
    const size_t row_size = act_block_size(qt) * (size_t)nb;
    char *buf = (char *)malloc(row_size * (size_t)(T > 0 ? T : 1));
    if (!buf) return NULL;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, T / 4)) schedule(static) if (T >= 8)
    for (int64_t t = 0; t < T; t++) quantize_row_for(qt, x + t * K, K, buf + (size_t)t * row_size);
    return buf;
}

/* ------------------------------------------------------------------------------------------------------------ */
/* public entry points                                                                                          */
/* ------------------------------------------------------------------------------------------------------------ */

/* 1 when the AVX2 dots were compiled in, 0 for the scalar ones */
int clover_simd(void) { return CLOVER_AVX2; }

/* 0: no VNNI, 1: AVX-512 VNNI (256-bit forms), 2: AVX-VNNI */
int clover_vnni(void) { return CLOVER_VNNI; }

/* 1 when built with OpenMP */
int clover_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------------------------ */
/* one weight matrix, either family                                                                             */
/* ------------------------------------------------------------------------------------------------------------ */

typedef struct {
    int qt;           /* ggml type, or T_NF4 / T_I8 */
    const uint8_t *w; /* row r of expert e at w + e * es + r * rs (ggml: whole blocks; split: the codes) */
    int64_t es, rs;
    const uint8_t *s; /* split formats: expert e's fp32 scales at s + e * ses, one per bs values from value v0 on */
    int64_t ses, bs, v0;
} mat_t;

static sdot_fn sdot_for(int qt) { return qt == T_NF4 ? dot_nf4 : qt == T_I8 ? dot_i8 : NULL; }

/* whether rows of K values of this matrix can be computed here */
static int mat_ok(const mat_t *m, int64_t K) {
    if (is_x8_split(m->qt)) /* whole scale blocks in each row, rows of K / 2 (NF4) or K (INT8) code bytes */
        return K % QS == 0 && m->bs > 0 && m->bs % QS == 0 && K % m->bs == 0 && m->v0 % m->bs == 0 &&
               m->rs == (m->qt == T_I8X8 ? K : K / 2);
    if (is_split_type(m->qt)) return K % QS == 0 && m->bs > 0 && m->bs % QS == 0;
    if (is_x8_type(m->qt)) return K % QK == 0 && m->rs == K / QK * block_bytes(m->qt); /* whole groups of 8 rows */
    return dot_for(m->qt) != NULL && K % block_values(m->qt) == 0;
}

/* bytes of one row of K values (what a row's prefetch touches) */
static int64_t mat_row_bytes(const mat_t *m, int64_t K) {
    if (m->qt == T_NF4 || m->qt == T_NF4X8) return K / 2;
    if (m->qt == T_I8 || m->qt == T_I8X8) return K;
    return K / block_values(m->qt) * block_bytes(m->qt);
}

/* row_dots for row r of expert e of matrix m (K values per row) */
static void mat_row_dots(const mat_t *m, int64_t e, int64_t r, int64_t K, const char *act, size_t arow,
                         const int64_t *tidx, int64_t n, float *out, int64_t ostride) {
    const uint8_t *wr = m->w + e * m->es + r * m->rs;
    if (!is_split_type(m->qt)) {
        row_dots(m->qt, wr, K / block_values(m->qt), act, arow, tidx, n, out, ostride);
        return;
    }
    const sdot_fn dot = sdot_for(m->qt);
    const float *sc = (const float *)(m->s + e * m->ses);
    const int64_t v0 = m->v0 + r * K;
#if CLOVER_AVX2
    if (n >= 2 && m->qt == T_NF4 && nf4_rows_ok(v0, m->bs, K / QS)) { /* the codes unpacked once for up to 4 rows */
        for (int64_t i0 = 0; i0 < n;) {
            const int64_t g = dot_group(n - i0);
            const a8_t *as[DOT_ROWS];
            float o[DOT_ROWS];
            for (int64_t i = 0; i < g; i++) as[i] = (const a8_t *)(act + (size_t)(tidx ? tidx[i0 + i] : i0 + i) * arow);
            switch (g) { /* a constant row count in each: the loops over rows unroll */
            case 1: dot_nf4_n(wr, sc, v0 / m->bs, m->bs, as, 1, K / QS, o); break;
            case 2: dot_nf4_n(wr, sc, v0 / m->bs, m->bs, as, 2, K / QS, o); break;
            case 3: dot_nf4_n(wr, sc, v0 / m->bs, m->bs, as, 3, K / QS, o); break;
            default: dot_nf4_n(wr, sc, v0 / m->bs, m->bs, as, 4, K / QS, o); break;
            }
            for (int64_t i = 0; i < g; i++) out[(i0 + i) * ostride] = o[i];
            i0 += g;
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = tidx ? tidx[i] : i;
        out[i * ostride] = dot(wr, sc, v0, m->bs, (const a8_t *)(act + (size_t)t * arow), K / QS);
    }
}

static int kt_wanted(int qt, int64_t T);
static int kts_wanted(const mat_t *m, int64_t K, int64_t T);
/* the 8 interleaved rows r0 .. r0+7 of expert e of m (T_Q4_KX8 / T_Q6_KX8 / T_NF4X8 / T_I8X8, the end of the file)
   against n activation rows (tidx or plain) -> out[i * ostride + r] */
static void x8_rows(const mat_t *m, int64_t e, int64_t r0, int64_t K, const char *act, const int64_t *tidx, int64_t n,
                    float *out, int64_t ostride);
static int kt_matmul(const mat_t *m, int64_t K, const char *act, size_t arow, int64_t T, const int64_t *rows,
                     int64_t R, float *out, int64_t ostride, int nth);

static int qmatmul_run(const float *x, int64_t T, int64_t K, const mat_t *m, const int64_t *rows, int64_t R,
                       float *out, int nth) {
    if (!is_split_type(m->qt) && !dot_for(m->qt) && m->qt != T_I8X8) return ERR_TYPE;
    if (!mat_ok(m, K) || (m->qt == T_I8X8 && (rows || R % 8))) return ERR_SHAPE; /* interleaved: whole groups */
    const size_t arow = act_block_size(m->qt) * (size_t)(K / block_values(m->qt));
    const int64_t rb = mat_row_bytes(m, K);
    char *act = (char *)quantize_rows(m->qt, x, T, K, nth);
    if (!act) return ERR_ALLOC;
    if (m->qt == T_I8X8) { /* interleaved INT8 rows: their kernel, a group of 8 rows a task, at any T */
        const int64_t G = R / 8;
#pragma omp parallel for num_threads(threads_for(nth, R)) schedule(dynamic, chunk_rows(G, nth, T > STREAM_MAX_T ? 0 : 8 * rb))
        for (int64_t g = 0; g < G; g++) x8_rows(m, 0, 8 * g, K, act, NULL, T, out + 8 * g, R);
        free(act);
        return OK;
    }
    if (kt_wanted(m->qt, T) || kts_wanted(m, K, T)) { /* many activation rows: the tiled kernels (end of the file) */
        const int rc = kt_matmul(m, K, act, arow, T, rows, R, out, R, nth);
        free(act);
        return rc;
    }
#pragma omp parallel for num_threads(threads_for(nth, R)) schedule(dynamic, chunk_rows(R, nth, rows || T > STREAM_MAX_T ? 0 : rb))
    for (int64_t r = 0; r < R; r++) {
        if (rows && r + 1 < R) { /* selected rows jump around: fetch the next one while this one computes */
            const char *next = (const char *)(m->w + rows[r + 1] * m->rs);
            for (int64_t o = 0; o < rb; o += 64) __builtin_prefetch(next + o, 0, 0);
        }
        mat_row_dots(m, 0, rows ? rows[r] : r, K, act, arow, NULL, T, out + r, R);
    }
    free(act);
    return OK;
}

/*
 * out[t, r] = dot(x[t, :], W[row r, :]) for t < T, r < R, where row r is rows[r] (or r when rows is NULL).
 * x: fp32 [T, K] contiguous; w: uint8, row n at w + n * row_stride, K / block_values blocks of type qt;
 * out: fp32 [T, R] contiguous. Returns 0 or an error code.
 */
int clover_qmatmul(const float *x, int64_t T, int64_t K, const uint8_t *w, int64_t row_stride, int qt,
                   const int64_t *rows, int64_t R, float *out, int nth) {
    if (is_split_type(qt)) return ERR_TYPE; /* those need their scales: clover_smatmul */
    const mat_t m = {qt, w, 0, row_stride, NULL, 0, 0, 0};
    return qmatmul_run(x, T, K, &m, rows, R, out, nth);
}

/*
 * As clover_qmatmul for a split-format matrix (T_NF4 / T_I8): codes row n at codes + n * row_stride, the fp32
 * scales of the whole matrix at scales (one per bs values of the flattened [N, K] matrix).
 */
int clover_smatmul(const float *x, int64_t T, int64_t K, const uint8_t *codes, int64_t row_stride,
                   const float *scales, int64_t bs, int qt, const int64_t *rows, int64_t R, float *out, int nth) {
    if (!is_split_type(qt) && qt != T_I8X8) return ERR_TYPE;
    const mat_t m = {qt, codes, 0, row_stride, (const uint8_t *)scales, 0, bs, 0};
    return qmatmul_run(x, T, K, &m, rows, R, out, nth);
}

static void mat_rows_tiled(const mat_t *m, int64_t e, int64_t r0, int64_t nr, int64_t K, const char *act,
                           size_t arow, const int64_t *tidx, int64_t n, float *out, int64_t ostride);

#define TILE_R 4 /* weight rows per task of the tiled drivers */

#ifdef _OPENMP /* used in the pragmas only */
/* tasks per dynamically scheduled chunk for tasks of `tile` weight rows of `row_bytes` each (bound by their reads:
   chunk_rows of the tasks' bytes; row_bytes 0, bound by their multiplies: chunk_for's rows) */
static int moe_chunk(int64_t tasks, int nth, int64_t tile, int64_t row_bytes) {
    if (row_bytes > 0 || tile == 1) return chunk_rows(tasks, nth, tile * row_bytes);
    return chunk_for(tasks, nth) / (int)tile + 1;
}
#endif

#define KT_ROWS 8     /* activation rows per tile: the int32 lanes of a 256-bit vector */
#define KT_MIN_T 8    /* fewer activation rows: row_dots */
#define KT_X8_MIN_T 16 /* T_Q4_KX8 experts with fewer tokens keep the x8 kernel (8 tokens: 1.4x kt; 16: even) */
#define KT_WROWS 8    /* weight rows per task */
#define KT_GROUP 8    /* tiles per pass over a task's blocks (64 activation rows: a block of them, 19 KB, stays in L1) */


/* the tiled K formats for an expert's tokens (end of the file): kt_expert_tiles builds the tiles of every used expert
   with >= KT_MIN_T tokens (off[e]: its first tile, -1 for the others), kt_expert_rows multiplies rows with them */
static int kt_moe_wanted(const mat_t *g, const mat_t *u, const mat_t *dn, int64_t T, int64_t D, int64_t I);
static void *kt_expert_tiles(const char *act, size_t arow, const int64_t *tidx, const int64_t *count,
                             const int64_t *used, int64_t U, int64_t E, int64_t nb, int split, int64_t min_t,
                             int64_t *off, int nth);
/* the fewest tokens an expert's rows of type qt take the tiled kernels from */
static inline int64_t kt_min_for(int qt) { return qt == T_Q4_KX8 ? KT_X8_MIN_T : KT_MIN_T; }
static void kt_expert_rows(const mat_t *m, int64_t e, int64_t r0, int64_t nr, int64_t K, const void *tiles,
                           int64_t off, int64_t n, float *out, int64_t ostride);

/*
 * Routed MoE: out[t] = sum_j topk_w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_idx[t, j], over the
 * matrices g [I, D], u [I, D], dn [D, I] of each expert. Each used expert's blocks are read once: the loops run
 * over (expert, tile of weight rows: one, or TILE_R when tiled) with the expert's tokens inside.
 * x: fp32 [T, D]; topk_idx: int64 [T, k] in [0, E); topk_w: fp32 [T, k]; out: fp32 [T, D]. Returns 0 or an error.
 */
static int moe_run(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t k, const mat_t *g,
                   const mat_t *u, const mat_t *dn, const int64_t *topk_idx, const float *topk_w, float *out,
                   int tiled, int nth) {
    const int qg = g->qt, qu = u->qt, qd = dn->qt;
    for (int j = 0; j < 3; j++) {
        const int q = j == 0 ? qg : j == 1 ? qu : qd;
        if (!is_split_type(q) && !dot_for(q) && !is_x8_type(q)) return ERR_TYPE;
    }
    /* interleaved rows (T_Q4_KX8, T_Q6_KX8, T_NF4X8): gate and up both or neither, whole groups of 8 rows */
    const int x8gu = is_x8_type(qg), x8d = is_x8_type(qd);
    if (x8gu != is_x8_type(qu)) return ERR_TYPE;
    if ((x8gu && I % 8) || (x8d && D % 8)) return ERR_SHAPE;
    if (!mat_ok(g, D) || !mat_ok(u, D) || !mat_ok(dn, I)) return ERR_SHAPE;
    const int64_t P = T * k; /* (token, slot) pairs */
    for (int64_t p = 0; p < P; p++)
        if (topk_idx[p] < 0 || topk_idx[p] >= E) return ERR_SHAPE;
    const size_t arow_g = act_block_size(qg) * (size_t)(D / block_values(qg));
    const size_t arow_u = act_block_size(qu) * (size_t)(D / block_values(qu));
    const size_t arow_d = act_block_size(qd) * (size_t)(I / block_values(qd));

    /* group the pairs by expert (counting sort, stable: token order within an expert) */
    int64_t *count = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *slot_of = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P + 1)); /* pair -> sorted slot */
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P + 1));     /* sorted slot -> token */
    int64_t *used = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));     /* used experts, ascending */
    int64_t *fill = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));     /* next free slot per expert */
    float *h = (float *)malloc(sizeof(float) * (size_t)(P * I + 1));            /* [P sorted, I] */
    float *hu = (float *)malloc(sizeof(float) * (size_t)(P * I + 1));           /* [P sorted, I] up outputs */
    float *y = (float *)malloc(sizeof(float) * (size_t)(P * D + 1));            /* [P sorted, D] */
    char *ag = (char *)quantize_rows(qg, x, T, D, nth);
    char *au = (is_k_type(qu) == is_k_type(qg)) ? ag : (char *)quantize_rows(qu, x, T, D, nth);
    char *ah = NULL;
    void *tx = NULL, *th = NULL; /* the kt tiles of x (gate and up) and of h (down) */
    int64_t *offx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * E + 1)), *offh = offx ? offx + E : NULL;
    int rc = OK;
    if (!count || !slot_of || !tok || !used || !fill || !h || !hu || !y || !ag || !au || !offx) {
        rc = ERR_ALLOC;
        goto done;
    }
    for (int64_t p = 0; p < P; p++) count[topk_idx[p] + 1]++;
    int64_t U = 0;
    for (int64_t e = 0; e < E; e++) {
        if (count[e + 1]) used[U++] = e;
        count[e + 1] += count[e]; /* count[e] = first sorted slot of expert e */
    }
    memcpy(fill, count, sizeof(int64_t) * (size_t)E);
    int64_t most = 0; /* the most tokens on one expert */
    for (int64_t i = 0; i < U; i++) {
        const int64_t n = count[used[i] + 1] - count[used[i]];
        most = n > most ? n : most;
    }
    /* an expert with >= KT_MIN_T tokens takes the tiled kernels (kt / kts) in tasks of KT_WROWS rows (interleaved
       Q4_K rows from KT_X8_MIN_T: the same bits, the faster kernel either side); interleaved rows go in their groups
       of 8 (KT_WROWS: both kernels' tasks are one group) */
    const int kt = most >= KT_MIN_T && kt_moe_wanted(g, u, dn, T, D, I);
    /* interleaved Q6_K and NF4 take their own kernel at any token count (kt's bits): no tiles for their side */
    const int kt_gu = kt && !x8_always(qg), kt_d = kt && !x8_always(qd);
    const int64_t tile = kt_gu ? KT_WROWS : x8gu ? 8 : tiled ? TILE_R : 1;
    const int64_t tile_d = kt_d ? KT_WROWS : x8d ? 8 : tiled ? TILE_R : 1;
    const int64_t GI = (I + tile - 1) / tile, GD = (D + tile_d - 1) / tile_d; /* row tiles per matrix */
    for (int64_t p = 0; p < P; p++) {
        int64_t s = fill[topk_idx[p]]++;
        slot_of[p] = s;
        tok[s] = p / k;
    }

    /*
     * gate and up: one task per (used expert, tile of rows i); h[s, i] = silu(g) * u for the expert's slots s. Tiles
     * are KT_WROWS rows where kt (an expert with >= KT_MIN_T tokens takes the tiled K formats, the others row_dots),
     * else TILE_R (tiled) or 1. The branch on the tile is the same for the whole call (predicted); tasks of one row
     * go straight to mat_row_dots, because
     * at T = 1 a task is one short row and anything more per task shows (measured on Q4_K at T = 1 against the two
     * copied drivers this replaces: a rows-function pointer with a loop over the tile 1.14-1.19x the time, one
     * mat_rows(tiled, ...) helper with that loop 1.07-1.09x, this 1.02-1.03x, where the same build against itself
     * reads 0.97-1.01x on this shared machine; scripts/bench_moe_ab.py).
     */
    if (kt_gu && !(tx = kt_expert_tiles(ag, arow_g, tok, count, used, U, E, D / QK, is_split_type(qg), kt_min_for(qg),
                                        offx, nth))) {
        rc = ERR_ALLOC;
        goto done;
    }
    /* few tokens: tasks bound by their reads, chunked by bytes (so are interleaved rows' tasks, below kt's tokens) */
    const int stream = T <= STREAM_MAX_T;
    const int64_t gu_bytes = stream || (x8gu && !kt) ? mat_row_bytes(g, D) + mat_row_bytes(u, D) : 0;
    const int64_t dn_bytes = stream || (x8d && !kt) ? mat_row_bytes(dn, I) : 0;
#pragma omp parallel for num_threads(threads_for(nth, U * GI)) schedule(dynamic, moe_chunk(U * GI, nth, tile, gu_bytes))
    for (int64_t task = 0; task < U * GI; task++) {
        const int64_t e = used[task / GI], s0 = count[e], n = count[e + 1] - s0;
        if (tile == 1) {
            const int64_t i = task % GI;
            mat_row_dots(g, e, i, D, ag, arow_g, tok + s0, n, h + s0 * I + i, I);
            mat_row_dots(u, e, i, D, au, arow_u, tok + s0, n, hu + s0 * I + i, I);
            for (int64_t s = s0; s < s0 + n; s++) h[s * I + i] = silu(h[s * I + i]) * hu[s * I + i];
            continue;
        }
        const int64_t i0 = (task % GI) * tile, nr = I - i0 < tile ? I - i0 : tile;
        if (kt_gu && offx[e] >= 0) { /* ag is au: both K formats */
            kt_expert_rows(g, e, i0, nr, D, tx, offx[e], n, h + s0 * I + i0, I);
            kt_expert_rows(u, e, i0, nr, D, tx, offx[e], n, hu + s0 * I + i0, I);
        } else if (x8gu) {
            x8_rows(g, e, i0, D, ag, tok + s0, n, h + s0 * I + i0, I);
            x8_rows(u, e, i0, D, au, tok + s0, n, hu + s0 * I + i0, I);
        } else {
            mat_rows_tiled(g, e, i0, nr, D, ag, arow_g, tok + s0, n, h + s0 * I + i0, I);
            mat_rows_tiled(u, e, i0, nr, D, au, arow_u, tok + s0, n, hu + s0 * I + i0, I);
        }
        for (int64_t s = s0; s < s0 + n; s++)
            for (int64_t i = i0; i < i0 + nr; i++) h[s * I + i] = silu(h[s * I + i]) * hu[s * I + i];
    }

    ah = (char *)quantize_rows(qd, h, P, I, nth);
    if (!ah || (kt_d && !(th = kt_expert_tiles(ah, arow_d, NULL, count, used, U, E, I / QK, is_split_type(qd),
                                               kt_min_for(qd), offh, nth)))) {
        rc = ERR_ALLOC;
        goto done;
    }

    /* down: one task per (used expert, tile of rows j); y[s, j] for the expert's slots s (adjacent rows of ah) */
#pragma omp parallel for num_threads(threads_for(nth, U * GD)) schedule(dynamic, moe_chunk(U * GD, nth, tile_d, dn_bytes))
    for (int64_t task = 0; task < U * GD; task++) {
        const int64_t e = used[task / GD], s0 = count[e], n = count[e + 1] - s0;
        const char *as = ah + (size_t)s0 * arow_d;
        if (tile_d == 1) {
            const int64_t j = task % GD;
            mat_row_dots(dn, e, j, I, as, arow_d, NULL, n, y + s0 * D + j, D);
            continue;
        }
        const int64_t j0 = (task % GD) * tile_d, nr = D - j0 < tile_d ? D - j0 : tile_d;
        if (kt_d && offh[e] >= 0) kt_expert_rows(dn, e, j0, nr, I, th, offh[e], n, y + s0 * D + j0, D);
        else if (x8d) x8_rows(dn, e, j0, I, as, NULL, n, y + s0 * D + j0, D);
        else mat_rows_tiled(dn, e, j0, nr, I, as, arow_d, NULL, n, y + s0 * D + j0, D);
    }

    /* weighted sum over each token's slots, in slot order */
#pragma omp parallel for num_threads(threads_for(nth, T)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        for (int64_t j = 0; j < D; j++) o[j] = 0.0f;
        for (int64_t c = 0; c < k; c++) {
            const float wt = topk_w[t * k + c];
            const float *ys = y + slot_of[t * k + c] * D;
            for (int64_t j = 0; j < D; j++) o[j] += wt * ys[j];
        }
    }

done:
    if (au != ag) free(au);
    free(ag);
    free(ah);
    free(tx);
    free(th);
    free(offx);
    free(count);
    free(slot_of);
    free(tok);
    free(used);
    free(fill);
    free(h);
    free(hu);
    free(y);
    return rc;
}

/*
 * moe_run over ggml banks: expert e's gate matrix [I, D] has row i at gate + e * g_es + i * g_rs (likewise up
 * [I, D], down [D, I]); the banks may be three tensors [E, rows, row_bytes] or one packed row per expert (only the
 * strides differ).
 */
int clover_moe(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t k,
               const uint8_t *gate, int64_t g_es, int64_t g_rs, int qg,
               const uint8_t *up, int64_t u_es, int64_t u_rs, int qu,
               const uint8_t *down, int64_t d_es, int64_t d_rs, int qd,
               const int64_t *topk_idx, const float *topk_w, float *out, int nth) {
    if (is_split_type(qg) || is_split_type(qu) || is_split_type(qd)) return ERR_TYPE;
    const mat_t g = {qg, gate, g_es, g_rs, NULL, 0, 0, 0}, u = {qu, up, u_es, u_rs, NULL, 0, 0, 0};
    const mat_t dn = {qd, down, d_es, d_rs, NULL, 0, 0, 0};
    return moe_run(x, T, D, I, E, k, &g, &u, &dn, topk_idx, topk_w, out, 0, nth);
}

/* ============================================================================================================ */
/* Gated DeltaNet AR step (issue 30, AR decode): one token's recurrent update in one pass over each head's state */
/* (engine.kernels.gdn_kernels.cpu_step; the torch rule is engine.model.gdn.recurrent_gated_delta_rule), and the */
/* whole token mixer between the input projections and out_proj (gdn_kernels.cpu_token)                        */
/* ============================================================================================================ */

/*
 * One head of one token: q, k [dk] (q normed and scaled, k normed), v [dv], decay = e^g, beta b, S [dk, dv];
 * o [dv], the updated state written to D [dk, dv] unless it is NULL. The rule in the torch rule's order of
 * operations (each sum over dk taken in order, so the rounding follows the rule's formulas, not a rewrite of them):
 *   S1 = e^g S;  kv = S1^T k;  delta = (v - kv) beta;  S2 = S1 + k delta^T;  o = S2^T q.
 * Two sweeps over the head's S (64 KiB at dk = dv = 128: the second one from L2): kv, then S2 and o. dv <= 1024.
 */
/* no fused multiply-adds here: each product rounded on its own, as the torch rule's separate ops round it */
__attribute__((optimize("fp-contract=off")))
static void gdn_head(const float *qh, const float *kh, const float *vh, float decay, float b, const float *S,
                     float *D, float *oh, int64_t dk, int64_t dv) {
    float kv[1024], delta[1024];
    for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float ki = kh[i];
        const float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) kv[j] += (decay * row[j]) * ki;
    }
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = (vh[j] - kv[j]) * b;
        oh[j] = 0.0f;
    }
    for (int64_t i = 0; i < dk; i++) {
        const float ki = kh[i], qi = qh[i];
        const float *row = S + i * dv;
        if (D) {
            float *drow = D + i * dv;
            for (int64_t j = 0; j < dv; j++) {
                const float s2 = decay * row[j] + ki * delta[j];
                drow[j] = s2;
                oh[j] += s2 * qi;
            }
        } else {
            for (int64_t j = 0; j < dv; j++) oh[j] += (decay * row[j] + ki * delta[j]) * qi;
        }
    }
}

/*
 * One token, H heads: q, k [H, dk], v [H, dv], g (log decay) and beta [H], state [H, dk, dv], all fp32 and
 * contiguous (gdn_head per head). state_out may be state (in place) or NULL (the final state is not needed: a
 * forward that writes no cache). out [H, dv]. Heads are split over nth threads.
 */
int clover_gdn_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    const float *state, float *state_out, float *out, int64_t H, int64_t dk, int64_t dv,
                    int nth) {
    if (H < 1 || dk < 1 || dv < 1 || dv > 1024) return ERR_SHAPE;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, H)) schedule(static)
    for (int64_t h = 0; h < H; h++)
        gdn_head(q + h * dk, k + h * dk, v + h * dv, expf(g[h]), beta[h], state + h * dk * dv,
                 state_out ? state_out + h * dk * dv : NULL, out + h * dv, dk, dv);
    return 0;
}

/*
 * sum(x[0 .. n-1]) in the order of torch's CPU sum over a contiguous last dim (ATen's cascade_sum:
 * vectorized_inner_sum, row_sum, multi_row_sum), with torch's vector width of `lanes` floats (8 where it runs its
 * AVX2 kernels, 16 under AVX-512): so a sum here rounds as the torch forward's. n >= lanes, lanes <= 16.
 * Vector V_i = x[lanes i ..]; four accumulators take V_{4r + c} (rows of four, cascaded every 16 rows), the
 * leftover vectors go to the first, the four are folded in order, then the scalar tail, then the lanes in order.
 */
__attribute__((optimize("fp-contract=off")))
static float torch_sum(const float *x, int64_t n, int lanes) {
    enum { LEVELS = 4, ILP = 4, MAXL = 16 };
    const int64_t nvec = n / lanes, rows = nvec / ILP;
    int64_t power = 4; /* multi_row_sum: level_power = max(4, ceil(log2(rows)) / LEVELS) */
    int64_t lg = 0;
    while (((int64_t)1 << lg) < rows) lg++;
    if (lg / LEVELS > power) power = lg / LEVELS;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][MAXL];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + step <= rows;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int c = 0; c < ILP; c++)
                for (int l = 0; l < lanes; l++) acc[0][c][l] += x[((i * ILP) + c) * lanes + l];
        for (int j = 1; j < LEVELS; j++) {
            for (int c = 0; c < ILP; c++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][c][l] += acc[j - 1][c][l];
                    acc[j - 1][c][l] = 0.0f;
                }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int c = 0; c < ILP; c++)
            for (int l = 0; l < lanes; l++) acc[0][c][l] += x[((i * ILP) + c) * lanes + l];
    for (int j = 1; j < LEVELS; j++)
        for (int c = 0; c < ILP; c++)
            for (int l = 0; l < lanes; l++) acc[0][c][l] += acc[j][c][l];
    for (int64_t v = rows * ILP; v < nvec; v++) /* row_sum: vectors left over after the rows of four */
        for (int l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l];
    for (int c = 1; c < ILP; c++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][c][l];
    float total = 0.0f;
    for (int64_t k = nvec * lanes; k < n; k++) total += x[k];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* x [n] -> (x * (1 / sqrt(sum(x^2) + eps))) * scale: the model's l2norm (eps 1e-6; scale dk^-0.5 for q, else 1)
 * and, with scale 1, the RMS part of the gated norm with sum / n (n a power of two: the same as torch's mean) */
__attribute__((optimize("fp-contract=off")))
static void norm_scaled(float *x, int64_t n, float divisor, float eps, float scale, int lanes) {
    float sq[1024];
    for (int64_t i = 0; i < n; i++) sq[i] = x[i] * x[i];
    const float r = 1.0f / sqrtf(torch_sum(sq, n, lanes) / divisor + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * scale;
}

/*
 * The causal short convolution of one token, before its SiLU: conv_state [K-1, C] (the K-1 previous raw rows),
 * x [C] (this token's raw row), w [C, K] -> out[c] = sum_j row_j[c] w[c, j] with rows = [conv_state; x], each
 * product rounded on its own and summed in order j = 0 .. K-1 (the torch forward's). conv_out: the new state
 * [K-1, C] (the last K-1 rows; conv_state itself for in place, NULL: not written), written after the sums.
 */
__attribute__((optimize("fp-contract=off")))
int clover_gdn_conv(const float *x, const float *conv_state, const float *w, float *conv_out, float *out, int64_t C,
                    int64_t K) {
    if (C < 1 || K < 1) return ERR_SHAPE;
    for (int64_t j = 0; j < K; j++) { /* tap by tap over all channels: the same order per channel, vectorized */
        const float *row = j < K - 1 ? conv_state + j * C : x;
        if (j == 0)
            for (int64_t c = 0; c < C; c++) out[c] = row[c] * w[c * K];
        else
            for (int64_t c = 0; c < C; c++) out[c] += row[c] * w[c * K + j];
    }
    if (conv_out && K > 1) {
        memmove(conv_out, conv_state + C, (size_t)((K - 2) * C) * sizeof(float));
        memcpy(conv_out + (K - 2) * C, x, (size_t)C * sizeof(float));
    }
    return 0;
}

/*
 * The rest of a GDN layer's T = 1 token mixer after its convolution's SiLU (engine.model.gdn.GatedDeltaNet,
 * causal, one token), one C call for what the torch forward does in ~40 small ops:
 *   act [C] = [q (Hk dk) | k (Hk dk) | v (Hv dv)] (SiLU of the convolution), zs [Hv dv] = SiLU(z), beta, g [Hv];
 *   norm_w [dv], eps; state [Hv, dk, dv].
 * Per v-head h (k-head h / (Hv / Hk), as repeat_interleave): l2norm of q (then times dk^-0.5) and of k, the delta
 * rule (gdn_head), then the gated RMSNorm y = (norm_w * (o / sqrt(mean(o^2) + eps))) * zs into y [Hv dv]. Every
 * product, sum and quotient in the torch forward's order (sums: torch_sum with torch's `lanes`), so y and the state
 * equal the torch forward's bit for bit. state_out: the updated state (state itself: in place; NULL: not computed).
 */
__attribute__((optimize("fp-contract=off")))
int clover_gdn_token(const float *act, const float *zs, const float *beta, const float *g, const float *norm_w,
                     float eps, const float *state, float *state_out, float *y, int64_t Hk, int64_t Hv, int64_t dk,
                     int64_t dv, int lanes, int nth) {
    if (Hk < 1 || Hv < Hk || Hv % Hk || dk < lanes || dk > 1024 || dv < lanes || dv > 1024 || lanes < 1
        || lanes > 16) return ERR_SHAPE;
    const int64_t rep = Hv / Hk;
    const float qscale = (float)pow((double)dk, -0.5); /* the float Python's dk**-0.5 rounds to */
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, Hv)) schedule(static)
    for (int64_t h = 0; h < Hv; h++) {
        float q[1024], k[1024], o[1024];
        const int64_t kh = h / rep;
        memcpy(q, act + kh * dk, (size_t)dk * sizeof(float));
        memcpy(k, act + (Hk + kh) * dk, (size_t)dk * sizeof(float));
        norm_scaled(q, dk, 1.0f, 1e-6f, qscale, lanes);
        norm_scaled(k, dk, 1.0f, 1e-6f, 1.0f, lanes);
        gdn_head(q, k, act + 2 * Hk * dk + h * dv, expf(g[h]), beta[h], state + h * dk * dv,
                 state_out ? state_out + h * dk * dv : NULL, o, dk, dv);
        norm_scaled(o, dv, (float)dv, eps, 1.0f, lanes);
        const float *zh = zs + h * dv;
        float *yh = y + h * dv;
        for (int64_t j = 0; j < dv; j++) yh[j] = (norm_w[j] * o[j]) * zh[j];
    }
    return 0;
}

/*
 * Gated DeltaNet in block mode (engine.model.gdn.GatedDeltaNet: a diffusion block pass, a block-mode prefill):
 * everything between the input projections and out_proj, in one call, for what the torch forward does in ~80 ops
 * (the convolutions and their join, the l2norms, the gates, the chunked delta rule's prepare / scan / output, the
 * Clover history unit, the gated RMSNorm), each a fresh tensor. The same formulas, summed in another order: equal
 * to the torch forward within float32 rounding, not bit for bit.
 *
 * Also the causal rule of a prefill (no extras; its chunks' boundaries change only the order of the sums). Per
 * v-head and chunk of `block` tokens (chunk c holds tokens c * block ..; a block-mode forward starts on a block
 * boundary), with gamma_i the chunk's cumulative log decay and S the state at the chunk's start:
 *   V'_i = beta_i (v_i - e^{gamma_i} S^T k_i) - sum_{j<i} beta_i (k_i.k_j) e^{gamma_i - gamma_j} V'_j
 *     (the rule's corrected values: (I + strictly_lower(beta K K^T D))^-1 (beta V - beta K e^gamma S), solved by
 *     forward substitution in place of the torch rule's explicit inverse),
 *   R_i = e^{gamma_i} S^T q_i (the pure read), O_i = R_i + sum_{j<=i} (q_i.k_j) e^{gamma_i - gamma_j} V'_j,
 *   S <- e^{gamma_last} S + sum_i e^{gamma_last - gamma_i} k_i V'_i^T (for the next chunk and the state out).
 * History unit (form 1: F1, the mix with O; 2: F2, with R): a softmax over [l_i, t_h (q_i.k_j) for the chunk's
 * tokens j], l_i = hlogit[i, h] (+ q_i.hw_h or R_i.hw_h), t_h = temp[h] or 1; o~_i = a_iH (O_i | R_i) + sum_j a_ij v_j.
 * Then y = norm_w * (o~ / sqrt(mean(o~^2) + eps)) * SiLU(z) per head.
 */
typedef struct {
    int64_t T, C, K, Kr, Hk, Hv, dk, dv, block;
    const float *mixed;   /* [T, C] in_proj_qkv's rows, before the convolution: q (Hk dk) | k (Hk dk) | v (Hv dv) */
    const float *conv0;   /* [K-1, C] the raw rows before them (the conv state) */
    const float *wl;      /* [K, C] the causal taps: out_t = sum_j row_{t+j} wl[j] over [conv0; mixed] */
    const float *wr;      /* [Kr, C] the right taps (NULL: none): + sum_j mixed[t + roff[j]] wr[j] inside t's block */
    const int64_t *roff;  /* [Kr] */
    int64_t join;         /* 0: SiLU(L + R), 1: SiLU(L) + R, 2: SiLU(L) + SiLU(R) */
    const float *b, *a;   /* [T, Hv] in_proj_b's and in_proj_a's outputs */
    const float *a_log, *dt_bias; /* [Hv]: g = -e^{A_log} softplus(a + dt_bias), beta = sigmoid(b) */
    const float *z;       /* [T, Hv dv] in_proj_z's output */
    const float *state;   /* [Hv, dk, dv] the state before the first token */
    float *state_out;     /* NULL, or the state after the last one (may be `state`: in place) */
    int64_t form;         /* 0: no history unit, 1: F1, 2: F2 */
    const float *hlogit;  /* [T, Hv] the history logits (form > 0), or the part of them besides hw's term */
    const float *hw;      /* NULL or [Hv, dk] (hsrc 1: q_i . hw_h) or [Hv, dv] (hsrc 2: R_i . hw_h) */
    int64_t hsrc;
    const float *temp;    /* NULL or [Hv]: the block logits times temp[h] */
    const float *norm_w;  /* [dv] */
    float eps;
    float *y;             /* [T, Hv dv] */
} gdn_block_t;

/* out [R, N] = X [R, Kd] (rows ldx apart) @ M [Kd, N] (rows ldm apart), or out += that with `add`: rows by 4,
   columns by 16 (AVX2: by 8 NV), the sums in registers */
static void block_mm(const float *X, int64_t ldx, int64_t R, int64_t Kd, const float *M, int64_t ldm, int64_t N,
                     float *out, int add) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        int64_t c0 = 0;
#if CLOVER_AVX2
        enum { NV = CLOVER_REGS == 32 ? 4 : 2 };
        for (; c0 + 8 * NV <= N; c0 += 8 * NV) {
            __m256 acc[4][NV];
            for (int rr = 0; rr < 4; rr++)
                for (int v = 0; v < NV; v++)
                    acc[rr][v] = add ? _mm256_loadu_ps(out + (r + rr) * N + c0 + 8 * v) : _mm256_setzero_ps();
            for (int64_t d = 0; d < Kd; d++) {
                __m256 m[NV];
                for (int v = 0; v < NV; v++) m[v] = _mm256_loadu_ps(M + d * ldm + c0 + 8 * v);
                for (int rr = 0; rr < 4; rr++) {
                    const __m256 x = _mm256_broadcast_ss(X + (r + rr) * ldx + d);
                    for (int v = 0; v < NV; v++) acc[rr][v] = _mm256_fmadd_ps(x, m[v], acc[rr][v]);
                }
            }
            for (int rr = 0; rr < 4; rr++)
                for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + (r + rr) * N + c0 + 8 * v, acc[rr][v]);
        }
#endif
        for (; c0 + 16 <= N; c0 += 16) {
            float acc[4][16];
            for (int rr = 0; rr < 4; rr++)
                for (int cc = 0; cc < 16; cc++) acc[rr][cc] = add ? out[(r + rr) * N + c0 + cc] : 0.0f;
            for (int64_t d = 0; d < Kd; d++) {
                const float *m = M + d * ldm + c0;
                for (int rr = 0; rr < 4; rr++) {
                    const float x = X[(r + rr) * ldx + d];
                    for (int cc = 0; cc < 16; cc++) acc[rr][cc] += x * m[cc];
                }
            }
            for (int rr = 0; rr < 4; rr++) memcpy(out + (r + rr) * N + c0, acc[rr], sizeof(acc[rr]));
        }
        for (; c0 < N; c0++)
            for (int rr = 0; rr < 4; rr++) {
                float s = add ? out[(r + rr) * N + c0] : 0.0f;
                for (int64_t d = 0; d < Kd; d++) s += X[(r + rr) * ldx + d] * M[d * ldm + c0];
                out[(r + rr) * N + c0] = s;
            }
    }
    for (; r < R; r++) {
        float *o = out + r * N;
        if (!add)
            for (int64_t c = 0; c < N; c++) o[c] = 0.0f;
        for (int64_t d = 0; d < Kd; d++) {
            const float x = X[r * ldx + d];
            const float *m = M + d * ldm;
            for (int64_t c = 0; c < N; c++) o[c] += x * m[c];
        }
    }
}

/* y [n] -= sum_j coef[j] rows[j] (rows[j] = V + j * n, j < m): the sums in registers, y read and written once */
static void sub_rows(float *y, const float *coef, const float *V, int64_t m, int64_t n) {
    int64_t c0 = 0;
#if CLOVER_AVX2
    for (; c0 + 32 <= n; c0 += 32) {
        __m256 acc[4];
        for (int v = 0; v < 4; v++) acc[v] = _mm256_loadu_ps(y + c0 + 8 * v);
        for (int64_t j = 0; j < m; j++) {
            const __m256 c = _mm256_set1_ps(coef[j]);
            for (int v = 0; v < 4; v++) acc[v] = _mm256_fnmadd_ps(c, _mm256_loadu_ps(V + j * n + c0 + 8 * v), acc[v]);
        }
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(y + c0 + 8 * v, acc[v]);
    }
#endif
    for (; c0 < n; c0++) {
        float s = y[c0];
        for (int64_t j = 0; j < m; j++) s -= coef[j] * V[j * n + c0];
        y[c0] = s;
    }
}

static inline float softplus20(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

#if CLOVER_AVX2
/* e^x for 8 floats: x = n ln2 + r (|r| <= ln2 / 2), e^r by Cephes' degree-6 polynomial, 2^n from the exponent bits;
   within a few ulp of expf for x in [-87, 88] (clamped there: ~0 below, ~3.4e38 above) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* x[i] = e^{x[i]} */
static void exp_inplace(float *x, int64_t n) {
    int64_t i = 0;
#if CLOVER_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = expf(x[i]);
}

/* y[i] = SiLU(x[i]) (y may be x) */
static void silu_rows(const float *x, float *y, int64_t n) {
    int64_t i = 0;
#if CLOVER_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, v)))));
    }
#endif
    for (; i < n; i++) y[i] = silu(x[i]);
}

static float sumsq(const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if CLOVER_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    s = hsum_ps(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) y[j] += a * x[j];
}

/* token t's convolutions, their join and SiLU -> act [T, C] row t; then the l2norms of q (times dk^-0.5) and k */
static void block_conv(const gdn_block_t *P, float *act, int64_t t) {
    enum { TILE = 256 };
    const int64_t C = P->C, K = P->K, Kr = P->wr ? P->Kr : 0;
    const int64_t end0 = (t / P->block + 1) * P->block, end = end0 < P->T ? end0 : P->T; /* t's block ends there */
    float *o = act + t * C;
    for (int64_t c0 = 0; c0 < C; c0 += TILE) {
        const int64_t nc = C - c0 < TILE ? C - c0 : TILE;
        float left[TILE], right[TILE];
        for (int64_t c = 0; c < nc; c++) left[c] = right[c] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t r = t + j; /* row r of [conv0; mixed] */
            const float *row = (r < K - 1 ? P->conv0 + r * C : P->mixed + (r - (K - 1)) * C) + c0, *w = P->wl + j * C + c0;
            for (int64_t c = 0; c < nc; c++) left[c] += row[c] * w[c];
        }
        for (int64_t j = 0; j < Kr; j++) {
            const int64_t s = t + P->roff[j];
            if (s >= end) continue;
            const float *row = P->mixed + s * C + c0, *w = P->wr + j * C + c0;
            for (int64_t c = 0; c < nc; c++) right[c] += row[c] * w[c];
        }
        if (Kr && P->join == 0)
            for (int64_t c = 0; c < nc; c++) left[c] += right[c];
        silu_rows(left, o + c0, nc);
        if (Kr && P->join == 2) silu_rows(right, right, nc);
        if (Kr && P->join > 0)
            for (int64_t c = 0; c < nc; c++) o[c0 + c] += right[c];
    }
    const float qscale = (float)pow((double)P->dk, -0.5);
    for (int64_t h = 0; h < 2 * P->Hk; h++) { /* q heads, then k heads */
        float *x = o + h * P->dk;
        const float r = 1.0f / sqrtf(sumsq(x, P->dk) + 1e-6f) * (h < P->Hk ? qscale : 1.0f);
        for (int64_t i = 0; i < P->dk; i++) x[i] *= r;
    }
}

/* one v-head through all chunks (scratch: see gdn_block_scratch) */
static void block_head(const gdn_block_t *P, const float *act, int64_t h, float *scratch) {
    const int64_t T = P->T, C = P->C, B = P->block, dk = P->dk, dv = P->dv, Hv = P->Hv;
    const int64_t kh = h / (Hv / P->Hk);
    float *Sw = scratch, *qc = Sw + dk * dv, *kc = qc + B * dk, *kT = kc + B * dk, *KSt = kT + dk * B;
    float *QSt = KSt + B * dv, *V = QSt + B * dv, *O = V + B * dv, *AV = O + B * dv, *qk = AV + B * dv;
    float *kk = qk + B * B, *dec = kk + B * B, *A = dec + B * B, *gam = A + B * B, *beta = gam + B, *ah = beta + B;
    float *zs = ah + B, *lg = zs + dv, *coef = lg + B + 1;
    const float *S = P->state + h * dk * dv; /* the state at the chunk's start: the input until a chunk updates it */
    const float ea = expf(P->a_log[h]), tmp = P->temp ? P->temp[h] : 1.0f;
    const int64_t vcol = 2 * P->Hk * dk + h * dv;
    for (int64_t t0 = 0, L; t0 < T; t0 += L) {
        L = T - t0 < B ? T - t0 : B;
        const float *vrows = act + t0 * C + vcol; /* v_j at vrows + j * C */
        float acc = 0.0f;
        for (int64_t i = 0; i < L; i++) {
            const float *row = act + (t0 + i) * C;
            memcpy(qc + i * dk, row + kh * dk, (size_t)dk * sizeof(float));
            memcpy(kc + i * dk, row + (P->Hk + kh) * dk, (size_t)dk * sizeof(float));
            for (int64_t d = 0; d < dk; d++) kT[d * L + i] = kc[i * dk + d];
            acc += -ea * softplus20(P->a[(t0 + i) * Hv + h] + P->dt_bias[h]);
            gam[i] = acc;
            beta[i] = 1.0f / (1.0f + expf(-P->b[(t0 + i) * Hv + h]));
        }
        for (int64_t i = 0; i < L; i++) { /* dec_ij = e^{gamma_i - gamma_j}, j <= i */
            for (int64_t j = 0; j <= i; j++) dec[i * L + j] = gam[i] - gam[j];
            exp_inplace(dec + i * L, i + 1);
        }
        block_mm(kc, dk, L, dk, S, dv, dv, KSt, 0);  /* S^T k_i */
        block_mm(qc, dk, L, dk, S, dv, dv, QSt, 0);  /* S^T q_i */
        block_mm(qc, dk, L, dk, kT, L, L, qk, 0);    /* q_i . k_j */
        block_mm(kc, dk, L, dk, kT, L, L, kk, 0);    /* k_i . k_j */
        for (int64_t i = 0; i < L; i++) { /* V'_i by forward substitution; R_i */
            const float *vi = vrows + i * C, eg = expf(gam[i]);
            float *Vi = V + i * dv, *Ri = QSt + i * dv;
            for (int64_t j = 0; j < dv; j++) Vi[j] = beta[i] * (vi[j] - eg * KSt[i * dv + j]);
            for (int64_t j = 0; j < i; j++) coef[j] = beta[i] * kk[i * L + j] * dec[i * L + j];
            sub_rows(Vi, coef, V, i, dv);
            for (int64_t j = 0; j < dv; j++) Ri[j] *= eg;
        }
        for (int64_t i = 0; i < L; i++) /* the masked intra-chunk scores (q_i . k_j) e^{gamma_i - gamma_j}, j <= i */
            for (int64_t j = 0; j < L; j++) A[i * L + j] = j <= i ? qk[i * L + j] * dec[i * L + j] : 0.0f;
        block_mm(A, L, L, L, V, dv, dv, O, 0);
        for (int64_t i = 0; i < L * dv; i++) O[i] += QSt[i]; /* O = R + intra V' */
        if (P->form) { /* the history unit: a_iH (O_i | R_i) + sum_j a_ij v_j */
            for (int64_t i = 0; i < L; i++) {
                lg[0] = P->hlogit[(t0 + i) * Hv + h];
                if (P->hw) {
                    const int64_t m = P->hsrc == 2 ? dv : dk;
                    const float *src = P->hsrc == 2 ? QSt + i * dv : qc + i * dk, *w = P->hw + h * m;
                    for (int64_t d = 0; d < m; d++) lg[0] += src[d] * w[d];
                }
                float mx = lg[0], sum = 0.0f;
                for (int64_t j = 0; j < L; j++) {
                    lg[1 + j] = qk[i * L + j] * tmp;
                    if (lg[1 + j] > mx) mx = lg[1 + j];
                }
                for (int64_t j = 0; j <= L; j++) lg[j] -= mx;
                exp_inplace(lg, L + 1);
                for (int64_t j = 0; j <= L; j++) sum += lg[j];
                const float inv = 1.0f / sum;
                ah[i] = lg[0] * inv;
                for (int64_t j = 0; j < L; j++) A[i * L + j] = lg[1 + j] * inv;
            }
            block_mm(A, L, L, L, vrows, C, dv, AV, 0);
            const float *hist = P->form == 1 ? O : QSt;
            for (int64_t i = 0; i < L; i++)
                for (int64_t j = 0; j < dv; j++) O[i * dv + j] = ah[i] * hist[i * dv + j] + AV[i * dv + j];
        }
        for (int64_t i = 0; i < L; i++) { /* the gated RMSNorm */
            const float *oi = O + i * dv, r = 1.0f / sqrtf(sumsq(oi, dv) / (float)dv + P->eps);
            float *yi = P->y + (t0 + i) * Hv * dv + h * dv;
            silu_rows(P->z + (t0 + i) * Hv * dv + h * dv, zs, dv);
            for (int64_t j = 0; j < dv; j++) yi[j] = P->norm_w[j] * (oi[j] * r) * zs[j];
        }
        if (t0 + L < T || P->state_out) { /* S <- e^{gamma_last} S + sum_i e^{gamma_last - gamma_i} k_i V'_i^T */
            const float last = gam[L - 1], cd = expf(last);
            for (int64_t i = 0; i < L; i++) coef[i] = last - gam[i];
            exp_inplace(coef, L);
            for (int64_t d = 0; d < dk; d++)
                for (int64_t i = 0; i < L; i++) kT[d * L + i] *= coef[i];
            for (int64_t i = 0; i < dk * dv; i++) Sw[i] = cd * S[i]; /* in place after the first chunk */
            block_mm(kT, L, dk, L, V, dv, dv, Sw, 1);
            S = Sw;
        }
    }
    if (P->state_out) memcpy(P->state_out + h * dk * dv, S, (size_t)(dk * dv) * sizeof(float));
}

static int64_t gdn_block_scratch(const gdn_block_t *P) {
    const int64_t B = P->block, dk = P->dk, dv = P->dv;
    return dk * dv + 3 * B * dk + 5 * B * dv + 4 * B * B + 5 * B + 1 + dv;
}

int clover_gdn_block(const gdn_block_t *P, int nth) {
    if (P->T < 1 || P->Hk < 1 || P->Hv < P->Hk || P->Hv % P->Hk || P->dk < 1 || P->dv < 1 || P->dk > 1024
        || P->dv > 1024 || P->K < 1 || P->block < 1 || P->block > 4095
        || P->C != 2 * P->Hk * P->dk + P->Hv * P->dv
        || (P->wr && (P->Kr < 1 || !P->roff)) || P->form < 0 || P->form > 2
        || (P->form && !P->hlogit) || (P->hw && P->hsrc != 1 && P->hsrc != 2))
        return ERR_SHAPE;
    if (P->wr)
        for (int64_t j = 0; j < P->Kr; j++)
            if (P->roff[j] < 0) return ERR_SHAPE;
    float *act = malloc((size_t)(P->T * P->C) * sizeof(float));
    const int64_t per = gdn_block_scratch(P);
    float *scratch = malloc((size_t)(per * P->Hv) * sizeof(float));
    if (!act || !scratch) {
        free(act);
        free(scratch);
        return ERR_ALLOC;
    }
    (void)nth;
#pragma omp parallel num_threads(threads_for(nth, P->Hv))
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < P->T; t++) block_conv(P, act, t);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < P->Hv; h++) block_head(P, act, h, scratch + h * per);
    }
    free(act);
    free(scratch);
    return 0;
}

/*
 * The model's zero-centred RMSNorm over rows of n values (engine.model.layers.RMSNorm, float32):
 * y = (x * (1 / sqrt(sum(x^2) / n + eps))) * (1 + w), each operation rounded as the torch forward's (sums:
 * torch_sum with torch's `lanes`), so y equals its bits. For a step's few rows (one token: the layers' two norms,
 * the attention's q / k norms); rows run in order on the calling thread. n <= 8192.
 */
__attribute__((optimize("fp-contract=off")))
int clover_rms_norm(const float *x, const float *w, float eps, float *y, int64_t rows, int64_t n, int lanes) {
    if (n < lanes || n > 8192 || lanes < 1 || lanes > 16 || rows < 0) return ERR_SHAPE;
    float sq[8192];
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        for (int64_t i = 0; i < n; i++) sq[i] = xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(torch_sum(sq, n, lanes) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
    }
    return 0;
}

/*
 * Partial rotary embedding of one token's heads (engine.model.attention.apply_partial_rope, float32, NeoX pairs
 * (i, i + rd/2)): x [rows, hd], cos / sin [rd] -> y: y[i] = x[i] cos[i] + r[i] sin[i] for i < rd, with
 * r = (-x[rd/2 ..  rd), x[0 .. rd/2)), each product rounded on its own (the torch forward's bits); y[i] = x[i] past rd.
 */
__attribute__((optimize("fp-contract=off")))
int clover_rope(const float *x, const float *cosv, const float *sinv, float *y, int64_t rows, int64_t hd,
                int64_t rd) {
    if (rd < 2 || rd % 2 || rd > hd || rows < 0) return ERR_SHAPE;
    const int64_t half = rd / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hd;
        float *yr = y + r * hd;
        for (int64_t i = 0; i < half; i++) yr[i] = xr[i] * cosv[i] + (-xr[i + half]) * sinv[i];
        for (int64_t i = half; i < rd; i++) yr[i] = xr[i] * cosv[i] + xr[i - half] * sinv[i];
        memcpy(yr + rd, xr + rd, (size_t)(hd - rd) * sizeof(float));
    }
    return 0;
}

/*
 * n GGUF matrices of one type qt against the same activation rows x [T, K] (a GDN layer's four input projections, a
 * shared expert's gate and up): x quantized once, then the rows of all n matrices in one parallel loop; matrix i
 * (ns[i] rows at ws[i], row_strides[i] bytes apart) into outs[i] [T, ns[i]]. The same bits as one clover_qmatmul
 * per matrix (each output row's dot is computed alike), without n - 1 quantizations and calls. n <= 8.
 */
int clover_qmatmul_many(const float *x, int64_t T, int64_t K, int qt, int n, const uint8_t *const *ws,
                        const int64_t *row_strides, const int64_t *ns, float *const *outs, int nth) {
    if (is_split_type(qt) || !dot_for(qt)) return ERR_TYPE;
    if (n < 1 || n > 8) return ERR_SHAPE;
    mat_t m[8];
    int64_t first[9];
    first[0] = 0;
    for (int i = 0; i < n; i++) {
        const mat_t mi = {qt, ws[i], 0, row_strides[i], NULL, 0, 0, 0};
        m[i] = mi;
        if (!mat_ok(&m[i], K) || ns[i] < 0) return ERR_SHAPE;
        first[i + 1] = first[i] + ns[i];
    }
    const int64_t R = first[n];
    const size_t arow = act_block_size(qt) * (size_t)(K / block_values(qt));
    char *act = (char *)quantize_rows(qt, x, T, K, nth);
    if (!act) return ERR_ALLOC;
    (void)nth;
    if (kt_wanted(qt, T)) {
        int rc = OK;
        for (int i = 0; i < n && rc == OK; i++) rc = kt_matmul(&m[i], K, act, arow, T, NULL, ns[i], outs[i], ns[i], nth);
        free(act);
        return rc;
    }
    const int64_t rb = T <= STREAM_MAX_T ? mat_row_bytes(&m[0], K) : 0;
#pragma omp parallel for num_threads(threads_for(nth, R)) schedule(dynamic, chunk_rows(R, nth, rb))
    for (int64_t r = 0; r < R; r++) {
        int i = 0;
        while (r >= first[i + 1]) i++;
        const int64_t lr = r - first[i];
        mat_row_dots(&m[i], 0, lr, K, act, arow, NULL, T, outs[i] + lr, ns[i]);
    }
    free(act);
    return OK;
}

/* ============================================================================================================ */
/* end of the Gated DeltaNet AR step                                                                             */
/* ============================================================================================================ */

/* ============================================================================================================ */
/* Issue 30: NF4 (the own cache's experts) for many activation rows (diffusion passes, prefill segments).      */
/* Its row function, mat_rows_tiled, plugs into the one routed-MoE driver above (moe_run) in tasks of TILE_R    */
/* rows; the rest calls the helpers above (mat_row_dots, nf4_values, quantize_rows, threads_for, chunk_for, ...). */
/*                                                                                                              */
/* For T > 1 activation rows the K formats already decode each weight block once and reuse it for every row    */
/* (row_dots' decoded path); NF4 did not: dot_nf4 unpacked the nibbles through the table again for every       */
/* activation row (~8 of its ~18 instructions per 32 values). Here an NF4 weight row is decoded once into |w|   */
/* (uint8) and w (int8, for the signs) per 32 values with its fp32 scale, then multiplied with every           */
/* activation row. The fp32 operations per (weight row, activation row) are dot_nf4's, in the same order (even  */
/* steps in one accumulator, odd steps in another, summed at the end, times 1/127), and the integer dots are    */
/* exact, so the results are bit-identical to dot_nf4's. INT8 codes need no decoding: they stay on dot_i8.      */
/* Tried and left out (bit-identical, not faster, see docs/STATUS.md): a 2 x 4 / 4 x 2 register tile of decoded */
/* K-format blocks, so each activation block is loaded once per 2-4 weight rows (35-38 GMAC/s per core at      */
/* T = 32 either way), and the decoded copy for INT8 (0.6-0.85x). What did pay, later: one int32 lane per       */
/* activation row (the tiled kernels at the end of the file), which takes NF4 rows of whole 256-value groups.   */
/* ============================================================================================================ */

#define SPLIT_DEC_MAX 8192    /* widest row decoded on the stack (16 KB + scales); wider rows: mat_row_dots */
#define SPLIT_DEC_MIN_ROWS 8 /* fewer activation rows: decoding the whole row first does not pay (measured) */

#if CLOVER_AVX2
/*
 * Row r of expert e of split matrix m (K values) against n >= 1 activation rows (A8 blocks, row tidx[i] or i):
 * out[i * ostride]. K <= SPLIT_DEC_MAX.
 */
static void split_row_tiled(const mat_t *m, int64_t e, int64_t r, int64_t K, const char *act, size_t arow,
                            const int64_t *tidx, int64_t n, float *out, int64_t ostride) {
    const int64_t nb = K / QS;
    __m256i wabs[SPLIT_DEC_MAX / QS], wsgn[SPLIT_DEC_MAX / QS];
    float sc[SPLIT_DEC_MAX / QS];
    const uint8_t *wr = m->w + e * m->es + r * m->rs;
    const float *s = (const float *)(m->s + e * m->ses);
    const int64_t v0 = m->v0 + r * K;
    const int nf4 = m->qt == T_NF4;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NF4_I8));
    int64_t blk = v0 / m->bs, rem = v0 % m->bs;
    for (int64_t b = 0; b < nb; b++) { /* decode once: the table values (NF4) or the codes (INT8), and scales */
        const __m256i w = nf4 ? nf4_values(wr + 16 * b, lut) : _mm256_loadu_si256((const __m256i *)(wr + 32 * b));
        wabs[b] = _mm256_sign_epi8(w, w);
        wsgn[b] = w;
        sc[b] = next_scale(s, m->bs, &blk, &rem);
    }
    const float post = nf4 ? 1.0f / 127.0f : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const a8_t *a = (const a8_t *)(act + (size_t)(tidx ? tidx[i] : i) * arow);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)a[b].q);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)a[b + 1].q);
            const __m256i p0 = dot_us(wabs[b], _mm256_sign_epi8(x0, wsgn[b]));
            const __m256i p1 = dot_us(wabs[b + 1], _mm256_sign_epi8(x1, wsgn[b + 1]));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(sc[b] * a[b].d), _mm256_cvtepi32_ps(p0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(sc[b + 1] * a[b + 1].d), _mm256_cvtepi32_ps(p1), acc1);
        }
        if (b < nb) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)a[b].q);
            const __m256i p0 = dot_us(wabs[b], _mm256_sign_epi8(x0, wsgn[b]));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(sc[b] * a[b].d), _mm256_cvtepi32_ps(p0), acc0);
        }
        const float v = hsum_ps(_mm256_add_ps(acc0, acc1));
        out[i * ostride] = nf4 ? v * post : v;
    }
}
#endif

/*
 * Rows r0 .. r0 + nr - 1 of expert e of matrix m (K values each) against n activation rows: out[r + i * ostride]
 * for row r0 + r. NF4 with >= SPLIT_DEC_MIN_ROWS activation rows: split_row_tiled; everything else (INT8 too:
 * its codes need no decoding, and the decoded copy measured 0.6-0.85x) mat_row_dots.
 */
static void mat_rows_tiled(const mat_t *m, int64_t e, int64_t r0, int64_t nr, int64_t K, const char *act,
                           size_t arow, const int64_t *tidx, int64_t n, float *out, int64_t ostride) {
#if CLOVER_AVX2
    if (m->qt == T_NF4 && n >= SPLIT_DEC_MIN_ROWS && K <= SPLIT_DEC_MAX) {
        for (int64_t r = 0; r < nr; r++) split_row_tiled(m, e, r0 + r, K, act, arow, tidx, n, out + r, ostride);
        return;
    }
#endif
    for (int64_t r = 0; r < nr; r++) mat_row_dots(m, e, r0 + r, K, act, arow, tidx, n, out + r, ostride);
}

/* as qmatmul_run over all N rows (no row selection), through mat_rows_tiled */
static int qmatmul_tiled_run(const float *x, int64_t T, int64_t K, const mat_t *m, int64_t N, float *out, int nth) {
    if (m->qt == T_I8X8) return qmatmul_run(x, T, K, m, NULL, N, out, nth); /* its own kernel decodes nothing */
    if (!is_split_type(m->qt) && !dot_for(m->qt)) return ERR_TYPE;
    if (!mat_ok(m, K)) return ERR_SHAPE;
    const size_t arow = act_block_size(m->qt) * (size_t)(K / block_values(m->qt));
    char *act = (char *)quantize_rows(m->qt, x, T, K, nth);
    if (!act) return ERR_ALLOC;
    if (kts_wanted(m, K, T)) { /* whole 256-value groups: the tiled split kernel (end of the file) */
        const int rc = kt_matmul(m, K, act, arow, T, NULL, N, out, N, nth);
        free(act);
        return rc;
    }
    const int64_t G = (N + TILE_R - 1) / TILE_R; /* row tiles */
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, G)) schedule(dynamic, chunk_for(G, nth))
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = g * TILE_R, nr = N - r0 < TILE_R ? N - r0 : TILE_R;
        mat_rows_tiled(m, 0, r0, nr, K, act, arow, NULL, T, out + r0, N);
    }
    free(act);
    return OK;
}

/* clover_smatmul without row selection, each weight row decoded once for all rows of x (same results) */
int clover_smatmul_tiled(const float *x, int64_t T, int64_t K, const uint8_t *codes, int64_t row_stride,
                         const float *scales, int64_t bs, int qt, int64_t N, float *out, int nth) {
    if (!is_split_type(qt) && qt != T_I8X8) return ERR_TYPE;
    const mat_t m = {qt, codes, 0, row_stride, (const uint8_t *)scales, 0, bs, 0};
    return qmatmul_tiled_run(x, T, K, &m, N, out, nth);
}

/*
 * moe_run over the engine's own expert rows (engine.weights.quant.ExpertLayout): expert e is the byte row
 * base + e * es = [gate_up codes [2I, D] | down codes [D, I] | gate_up scales | down scales] at the given byte
 * offsets, all of split type qt (or T_NF4X8: NF4 rows interleaved by 8); gate is gate_up's rows 0..I-1, up its
 * rows I..2I-1. bs_gu / bs_dn: values per
 * scale of gate_up / down (NF4: the blocksize; I8: the row width, D / I). tiled: tasks of TILE_R rows through
 * mat_rows_tiled (each expert's NF4 rows decoded once for all its tokens), else one row per task through
 * mat_rows_direct; both give the same bits.
 */
int clover_moe_split(const float *x, int64_t T, int64_t D, int64_t I, int64_t E, int64_t k, const uint8_t *base,
                     int64_t es, int64_t gu_codes, int64_t dn_codes, int64_t gu_scales, int64_t dn_scales, int qt,
                     int64_t bs_gu, int64_t bs_dn, const int64_t *topk_idx, const float *topk_w, float *out,
                     int tiled, int nth) {
    if (!is_split_type(qt) && qt != T_NF4X8) return ERR_TYPE;
    const int64_t rg = qt == T_I8 ? D : D / 2, rd = qt == T_I8 ? I : I / 2; /* code bytes per row */
    const mat_t g = {qt, base + gu_codes, es, rg, base + gu_scales, es, bs_gu, 0};
    const mat_t u = {qt, base + gu_codes + I * rg, es, rg, base + gu_scales, es, bs_gu, I * D};
    const mat_t dn = {qt, base + dn_codes, es, rd, base + dn_scales, es, bs_dn, 0};
    return moe_run(x, T, D, I, E, k, &g, &u, &dn, topk_idx, topk_w, out, tiled != 0, nth);
}

/* ============================================================================================================ */
/* One token's whole MoE block (AR steps; engine.kernels.cpu_token): the router, its softmax and top-k, the     */
/* routed experts (moe_run), the shared expert and its gate, in one call instead of ~25 small torch ops and 4-5 */
/* C calls                                                                                                      */
/* ============================================================================================================ */

/* a . b over n floats: 4 vector accumulators (a 2,048-wide router row is memory-bound, not latency-bound) */
static float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float r = 0.0f;
#if CLOVER_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    r = hsum_ps(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#endif
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/*
 * x [D] fp32, the MoE input of one token. router [E, D] fp32: p = softmax(router x); the k largest (ties: the lower
 * expert id first), renormalized to sum 1 when norm_topk; written to idx_out [k] int64 and w_out [k] fp32.
 * routed [3]: the banks' gate [I, D], up [I, D], down [D, I] matrices (mat_t, expert e at e * es); shared [3]: the
 * shared expert's gate [Is, D], up [Is, D], down [D, Is] (es 0), or NULL (Is 0) for none; sgate [D] fp32, the
 * shared expert's gate row, or NULL (a gate of 1). out [D] = routed(x) + shared(x) * sigmoid(sgate . x): the formulas
 * of engine.model.moe.SparseMoe, each product's activations rounded to int8 blocks as in the separate calls.
 */
int clover_moe_token(const float *x, int64_t D, int64_t E, int64_t k, int norm_topk, const float *router, int64_t I,
                     const mat_t *routed, int64_t Is, const mat_t *shared, const float *sgate, float *out,
                     int64_t *idx_out, float *w_out, int nth) {
    if (D <= 0 || E <= 0 || k <= 0 || k > E || (Is > 0 && !shared)) return ERR_SHAPE;
    float *p = (float *)malloc(sizeof(float) * (size_t)E);
    float *hs = (float *)malloc(sizeof(float) * (size_t)(2 * Is + D + 1)); /* shared gate | up, then its output */
    int rc = OK;
    if (!p || !hs) {
        rc = ERR_ALLOC;
        goto done;
    }
#pragma omp parallel for num_threads(threads_for(nth, E / 64)) schedule(static)
    for (int64_t e = 0; e < E; e++) p[e] = dot_f32(router + e * D, x, D);
    float m = p[0], sum = 0.0f;
    for (int64_t e = 1; e < E; e++) m = p[e] > m ? p[e] : m;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - m);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float wsum = 0.0f;
    for (int64_t j = 0; j < k; j++) { /* k <= E small: repeated selection; a taken expert's p is set below 0 */
        int64_t best = 0;
        for (int64_t e = 1; e < E; e++) best = p[e] > p[best] ? e : best;
        idx_out[j] = best;
        w_out[j] = p[best];
        wsum += p[best];
        p[best] = -1.0f;
    }
    if (norm_topk)
        for (int64_t j = 0; j < k; j++) w_out[j] /= wsum;
    rc = moe_run(x, 1, D, I, E, k, &routed[0], &routed[1], &routed[2], idx_out, w_out, out, 0, nth);
    if (rc != OK || Is <= 0) goto done;
    float *hg = hs, *hu = hs + Is, *ys = hs + 2 * Is;
    if ((rc = qmatmul_run(x, 1, D, &shared[0], NULL, Is, hg, nth)) != OK) goto done;
    if ((rc = qmatmul_run(x, 1, D, &shared[1], NULL, Is, hu, nth)) != OK) goto done;
    for (int64_t i = 0; i < Is; i++) hg[i] = silu(hg[i]) * hu[i];
    if ((rc = qmatmul_run(hg, 1, Is, &shared[2], NULL, D, ys, nth)) != OK) goto done;
    const float g = sgate ? 1.0f / (1.0f + expf(-dot_f32(sgate, x, D))) : 1.0f;
    for (int64_t j = 0; j < D; j++) out[j] += ys[j] * g;
done:
    free(p);
    free(hs);
    return rc;
}

/*
 * A Gated DeltaNet layer's whole one-token mixer (engine.kernels.cpu_token.gdn_mixer_token; the torch forward is
 * engine.model.gdn.GatedDeltaNet): x [D], the layer's normed input -> out [D]. C = 2 Hk dk + Hv dv, V = Hv dv.
 * proj [4]: in_proj_qkv [C, D], in_proj_z [V, D], in_proj_b [Hv, D], in_proj_a [Hv, D] as mat_t; b_f32 / a_f32:
 * fp32 rows [Hv, D] used in place of proj[2] / proj[3] where not NULL. The gates beta = sigmoid(b) and
 * g = -exp(A_log) softplus(a + dt_bias) (softplus: torch's, linear past 20), the causal convolution
 * (clover_gdn_conv: conv_w [C, K], conv_state [K-1, C], the new state into conv_out unless NULL), the SiLUs, the
 * delta rule and gated RMSNorm (clover_gdn_token: norm_w [dv], eps, state [Hv, dk, dv] -> state_out unless NULL),
 * then out_proj (outm [D, V]). heads_hk > 0: out_proj's columns are GGUF's tiled order (value head a * Hk + b of
 * the file is head b * (Hv / Hk) + a of the model), so y is put in that order first.
 */
int clover_gdn_mixer_token(const float *x, int64_t D, const mat_t *proj, const float *b_f32, const float *a_f32,
                           const float *A_log, const float *dt_bias, const float *conv_w, int64_t K,
                           const float *conv_state, float *conv_out, const float *norm_w, float eps,
                           const float *state, float *state_out, const mat_t *outm, int64_t heads_hk, float *out,
                           int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int lanes, int nth) {
    if (D <= 0 || Hk < 1 || Hv < Hk || Hv % Hk || dk < 1 || dv < 1 || K < 1 || (heads_hk > 0 && Hv % heads_hk))
        return ERR_SHAPE;
    const int64_t C = 2 * Hk * dk + Hv * dv, V = Hv * dv;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * C + 3 * V + 4 * Hv));
    if (!buf) return ERR_ALLOC;
    float *mixed = buf, *left = mixed + C, *z = left + C, *y = z + V, *yp = y + V, *b = yp + V, *a = b + Hv,
          *beta = a + Hv, *g = beta + Hv;
    int rc = qmatmul_run(x, 1, D, &proj[0], NULL, C, mixed, nth);
    if (rc == OK) rc = qmatmul_run(x, 1, D, &proj[1], NULL, V, z, nth);
    if (rc == OK && !b_f32) rc = qmatmul_run(x, 1, D, &proj[2], NULL, Hv, b, nth);
    if (rc == OK && !a_f32) rc = qmatmul_run(x, 1, D, &proj[3], NULL, Hv, a, nth);
    if (rc != OK) goto done;
    for (int64_t h = 0; h < Hv; h++) {
        if (b_f32) b[h] = dot_f32(b_f32 + h * D, x, D);
        if (a_f32) a[h] = dot_f32(a_f32 + h * D, x, D);
        const float v = a[h] + dt_bias[h];
        beta[h] = 1.0f / (1.0f + expf(-b[h]));
        g[h] = -expf(A_log[h]) * (v > 20.0f ? v : log1pf(expf(v)));
    }
    if ((rc = clover_gdn_conv(mixed, conv_state, conv_w, conv_out, left, C, K)) != OK) goto done;
    for (int64_t c = 0; c < C; c++) left[c] = silu(left[c]);
    for (int64_t j = 0; j < V; j++) z[j] = silu(z[j]);
    rc = clover_gdn_token(left, z, beta, g, norm_w, eps, state, state_out, y, Hk, Hv, dk, dv, lanes, nth);
    if (rc != OK) goto done;
    const float *yo = y;
    if (heads_hk > 0) { /* model order (a, r, e) -> the file's (r, a, e), r = Hv / heads_hk */
        const int64_t r = Hv / heads_hk;
        for (int64_t ai = 0; ai < heads_hk; ai++)
            for (int64_t ri = 0; ri < r; ri++)
                memcpy(yp + (ri * heads_hk + ai) * dv, y + (ai * r + ri) * dv, sizeof(float) * (size_t)dv);
        yo = yp;
    }
    rc = qmatmul_run(yo, 1, V, outm, NULL, D, out, nth);
done:
    free(buf);
    return rc;
}

/*
 * A run of consecutive decoder layers on one token (an AR step), in one call: per layer h += mixer(norm1(h)), then
 * h += moe(norm2(h)) (engine.model.clover.DecoderLayer), h [D] updated in place. The mixer is a Gated DeltaNet
 * (kind 0: clover_gdn_mixer_token's arguments) or gated full attention (kind 1: attn_token below). Every other part
 * is the call the layer makes on its own (clover_rms_norm, clover_moe_token, the residual sums in fp32), so a run of
 * Gated DeltaNet layers gives the per-layer path's bits; what a run saves is the Python, the dispatch and the fresh
 * tensors between them (engine.kernels.cpu_token.LayerRun). Layer j's routing goes to idx_out / w_out, k per layer.
 */
typedef struct {
    int kind;
    const float *norm1;
    float eps1;
    /* Gated DeltaNet */
    const mat_t *proj;
    const float *b_f32, *a_f32, *A_log, *dt_bias, *conv_w;
    int64_t K;
    const float *conv_state;
    float *conv_out;
    const float *gnorm_w;
    float geps;
    const float *state;
    float *state_out;
    const mat_t *outm;
    int64_t heads_hk, Hk, Hv, dk, dv;
    /* full attention: mats q_proj [Hq 2hd, D] (per head its query, then its gate), k_proj, v_proj [Hkv hd, D],
     * o_proj [D, Hq hd]; the per-head q / k norms; the key and value cache [Hkv, max_len, hd] */
    const mat_t *qkvo;
    const float *q_norm, *k_norm;
    float qeps, keps;
    int64_t Hq, Hkv, hd, rd, max_len;
    float *kbuf, *vbuf;
    int write;
    /* the MoE */
    const float *norm2;
    float eps2;
    int64_t E, k;
    int norm_topk;
    const float *router;
    int64_t I;
    const mat_t *routed;
    int64_t Is;
    const mat_t *shared;
    const float *sgate;
} layer_t;

/* Keys per task of attn_token's split over the keys (each task: one KV head, one chunk of its keys). */
#define ATTN_CHUNK 512

/*
 * Gated attention of one token at position pos after pos cached keys (engine.model.attention.Attention): q, gate, k, v
 * from x [D]; RMSNorm of each q and k head (clover_rms_norm), partial RoPE (clover_rope: cosv / sinv [rd] of pos);
 * the key and value written to the cache at pos when l->write (else read from a local copy: the cache untouched);
 * each query head's softmax(q K^T / sqrt(hd)) V over its KV head's pos + 1 keys (GQA: head h reads KV head
 * h / (Hq / Hkv)), times sigmoid(gate), then o_proj -> out [D].
 * The keys are split in chunks of ATTN_CHUNK per KV head, one task each (as flash decoding does): a task reads its
 * keys and values once for the G query heads that share them and keeps each head's running max, sum and weighted
 * values; the chunks are then joined per head. So the cache is read once a step whatever G, and long contexts use
 * every thread. The scores and sums are C's own (torch's SDPA sums in another order): within float32 rounding.
 */
static int attn_token(const layer_t *l, const float *x, int64_t D, int64_t pos, const float *cosv,
                      const float *sinv, float *out, int lanes, int nth) {
    const int64_t Hq = l->Hq, Hkv = l->Hkv, hd = l->hd, S = pos + 1;
    if (Hkv < 1 || Hq % Hkv || hd < 1 || pos < 0 || pos >= l->max_len) return ERR_SHAPE;
    const int64_t G = Hq / Hkv, Q = Hq * hd, KV = Hkv * hd, nc = (S + ATTN_CHUNK - 1) / ATTN_CHUNK, tasks = Hkv * nc;
    /* qg [2Q] | q0 [Q] | q [Q] | o [Q] | k0 [KV] | v [KV] | per task and head: max, sum [2], weighted values [hd] */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(5 * Q + 2 * KV + tasks * G * (hd + 2)));
    if (!buf) return ERR_ALLOC;
    float *qg = buf, *q0 = qg + 2 * Q, *q = q0 + Q, *o = q + Q, *k0 = o + Q, *v = k0 + KV, *part = v + KV;
    const float scale = 1.0f / sqrtf((float)hd);
    int rc = qmatmul_run(x, 1, D, &l->qkvo[0], NULL, 2 * Q, qg, nth);
    if (rc == OK) rc = qmatmul_run(x, 1, D, &l->qkvo[1], NULL, KV, k0, nth);
    if (rc == OK) rc = qmatmul_run(x, 1, D, &l->qkvo[2], NULL, KV, v, nth);
    if (rc != OK) goto done;
    for (int64_t hh = 0; hh < Hq; hh++) memcpy(q0 + hh * hd, qg + hh * 2 * hd, sizeof(float) * (size_t)hd);
    if ((rc = clover_rms_norm(q0, l->q_norm, l->qeps, o, Hq, hd, lanes)) != OK) goto done;
    if ((rc = clover_rope(o, cosv, sinv, q, Hq, hd, l->rd)) != OK) goto done;
    if ((rc = clover_rms_norm(k0, l->k_norm, l->keps, o, Hkv, hd, lanes)) != OK) goto done;
    if ((rc = clover_rope(o, cosv, sinv, k0, Hkv, hd, l->rd)) != OK) goto done; /* k0: the roped key */
    if (l->write)
        for (int64_t j = 0; j < Hkv; j++) {
            memcpy(l->kbuf + (j * l->max_len + pos) * hd, k0 + j * hd, sizeof(float) * (size_t)hd);
            memcpy(l->vbuf + (j * l->max_len + pos) * hd, v + j * hd, sizeof(float) * (size_t)hd);
        }
    int failed = 0;
#pragma omp parallel num_threads(threads_for(nth, tasks))
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(G * ATTN_CHUNK));
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; t++) {
            if (!sc) continue;
            const int64_t j = t / nc, s0 = (t % nc) * ATTN_CHUNK, s1 = s0 + ATTN_CHUNK < S ? s0 + ATTN_CHUNK : S;
            const int64_t n = s1 - s0;
            const float *kj = l->kbuf + j * l->max_len * hd, *vj = l->vbuf + j * l->max_len * hd;
            for (int64_t s2 = s0; s2 < s1; s2++) {
                const float *key = s2 == pos ? k0 + j * hd : kj + s2 * hd;
                for (int64_t g = 0; g < G; g++) sc[g * n + s2 - s0] = dot_f32(q + (j * G + g) * hd, key, hd) * scale;
            }
            for (int64_t g = 0; g < G; g++) {
                float *p = sc + g * n, m = -INFINITY, sum = 0.0f;
                for (int64_t i = 0; i < n; i++) m = p[i] > m ? p[i] : m;
                for (int64_t i = 0; i < n; i++) {
                    p[i] = expf(p[i] - m);
                    sum += p[i];
                }
                float *pt = part + (t * G + g) * (hd + 2);
                pt[0] = m;
                pt[1] = sum;
                for (int64_t e = 0; e < hd; e++) pt[2 + e] = 0.0f;
            }
            for (int64_t s2 = s0; s2 < s1; s2++) {
                const float *val = s2 == pos ? v + j * hd : vj + s2 * hd;
                for (int64_t g = 0; g < G; g++) {
                    const float w = sc[g * n + s2 - s0];
                    float *acc = part + (t * G + g) * (hd + 2) + 2;
                    for (int64_t e = 0; e < hd; e++) acc[e] += w * val[e];
                }
            }
        }
        free(sc);
    }
    if (failed) {
        rc = ERR_ALLOC;
        goto done;
    }
    for (int64_t hh = 0; hh < Hq; hh++) { /* join the chunks of head hh: KV head j = hh / G, its g = hh % G */
        const int64_t j = hh / G, g = hh % G;
        float m = -INFINITY, sum = 0.0f, *oh = o + hh * hd;
        for (int64_t c = 0; c < nc; c++) {
            const float mc = part[((j * nc + c) * G + g) * (hd + 2)];
            m = mc > m ? mc : m;
        }
        for (int64_t e = 0; e < hd; e++) oh[e] = 0.0f;
        for (int64_t c = 0; c < nc; c++) {
            const float *pt = part + ((j * nc + c) * G + g) * (hd + 2), f = expf(pt[0] - m);
            sum += pt[1] * f;
            for (int64_t e = 0; e < hd; e++) oh[e] += pt[2 + e] * f;
        }
        const float *gate = qg + hh * 2 * hd + hd;
        for (int64_t e = 0; e < hd; e++) oh[e] = oh[e] / sum * (1.0f / (1.0f + expf(-gate[e])));
    }
    rc = qmatmul_run(o, 1, Q, &l->qkvo[3], NULL, D, out, nth);
done:
    free(buf);
    return rc;
}

int clover_layers_token(const layer_t *L, int64_t n, float *h, int64_t D, int64_t pos, const float *cosv,
                        const float *sinv, int64_t *idx_out, float *w_out, int lanes, int nth) {
    if (n < 0 || D <= 0) return ERR_SHAPE;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * D));
    if (!buf) return ERR_ALLOC;
    float *x = buf, *y = buf + D;
    int rc = OK;
    int64_t at = 0;
    for (int64_t j = 0; j < n && rc == OK; j++) {
        const layer_t *l = &L[j];
        if ((rc = clover_rms_norm(h, l->norm1, l->eps1, x, 1, D, lanes)) != OK) break;
        if (l->kind == 1)
            rc = attn_token(l, x, D, pos, cosv, sinv, y, lanes, nth);
        else
            rc = clover_gdn_mixer_token(x, D, l->proj, l->b_f32, l->a_f32, l->A_log, l->dt_bias, l->conv_w, l->K,
                                        l->conv_state, l->conv_out, l->gnorm_w, l->geps, l->state, l->state_out,
                                        l->outm, l->heads_hk, y, l->Hk, l->Hv, l->dk, l->dv, lanes, nth);
        if (rc != OK) break;
        for (int64_t i = 0; i < D; i++) h[i] = h[i] + y[i];
        if ((rc = clover_rms_norm(h, l->norm2, l->eps2, x, 1, D, lanes)) != OK) break;
        rc = clover_moe_token(x, D, l->E, l->k, l->norm_topk, l->router, l->I, l->routed, l->Is, l->shared, l->sgate,
                              y, idx_out + at, w_out + at, nth);
        if (rc != OK) break;
        for (int64_t i = 0; i < D; i++) h[i] = h[i] + y[i];
        at += l->k;
    }
    free(buf);
    return rc;
}

/* ============================================================================================================ */
/* end of issue 30's section                                                                                     */
/* ============================================================================================================ */

/* ============================================================================================================ */
/* Issue 30: the K formats against 8 or more activation rows (prefill, denoising passes: the head and the dense  */
/* projections at T = 32 are bound by their multiplies, not their reads).                                       */
/*                                                                                                              */
/* row_dots' decoded path gives each activation row its own 8 lanes and spends two multiplies per 32            */
/* multiply-adds (maddubs, then madd/vpdpwssd by the scales). Here the activation rows are interleaved in tiles */
/* of 8 (kt_tile_t), one int32 lane per row: a 4-byte group of decoded weights is broadcast and one vpdpbusd    */
/* adds 4 products to each row's lane, 32 multiply-adds per instruction; the scales multiply each 16- (Q6_K) or */
/* 32-value (Q4_K, Q5_K) group's int32 sum once (vpmulld), the mins come from the rows' 16-value sums by        */
/* vpdpwssd. Per (weight row, activation row) and block: I = sum_g sc_g S_g and M = sum_g mn_g B_g, exact       */
/* integers, then acc = fma(d * da, I, acc), acc = fnmadd(dmin * da, M, acc) in block order: the same bits for a */
/* row whatever T, its place in a tile, the tile's place in the call or the build (AVX2 without VNNI spells      */
/* vpdpbusd as maddubs + madd by ones and vpdpwssd as madd + add: the same integers, no int16 saturation with   */
/* weights <= 63 and |activations| <= 127). It differs from row_dots (whose 8 lanes per row are converted to    */
/* fp32 separately) in the last bits.                                                                            */
/* Tasks of KT_WROWS weight rows: their blocks are decoded once per block and tile group, and each activation  */
/* tile is read from L1 once per pair of weight rows (the kernel is 2 weight rows x 2 tiles of registers).       */
/* ============================================================================================================ */

#if CLOVER_AVX2
typedef struct {
    int8_t q[QK / 4][KT_ROWS][4]; /* values 4c .. 4c+3 of the tile's row t at q[c][t] */
    int16_t bs[QK / 32][KT_ROWS][2]; /* the 16-value sums of groups 2p and 2p+1 of row t at bs[p][t] */
    float d[KT_ROWS];
} kt_tile_t;

/* a decoded weight block as the tiled kernel reads it: q as kdec_t's; sc: the multiplier of each scale group (16
   values for Q6_K, 32 for Q4_K / Q5_K); mn[p]: the int16 pair (offset of 16-value group 2p, of group 2p + 1) */
typedef struct {
    uint8_t q[QK];
    int32_t sc[QK / 16];
    int32_t mn[QK / 32];
    float d, dmin;
} kt_dec_t;

static void kt_decode(int qt, const uint8_t *w, kt_dec_t *o) {
    if (qt == T_Q6_K) {
        o->d = o->dmin = load_f16(w + 208);
        for (int h = 0; h < 2; h++) {
            __m256i v[4];
            q6k_values(w, h, v);
            for (int k = 0; k < 4; k++) _mm256_storeu_si256((__m256i *)(o->q + 128 * h + 32 * k), v[k]);
        }
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
        _mm256_storeu_si256((__m256i *)o->sc, _mm256_cvtepi8_epi32(sc8));
        _mm256_storeu_si256((__m256i *)(o->sc + 8), _mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
        _mm256_storeu_si256((__m256i *)o->mn, _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5)); /* 32 * scale */
        return;
    }
    const int q5 = qt == T_Q5_K;
    const uint8_t *qs = w + (q5 ? 48 : 16);
    uint8_t sc[8], m[8];
    o->d = load_f16(w);
    o->dmin = load_f16(w + 2);
    unpack_k4_scales(w + 4, sc, m);
    const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        q45k_values(qs, qh, c, q5, &lo, &hi);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c), lo);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * c + 32), hi);
    }
    uint64_t s64, m64;
    memcpy(&s64, sc, 8);
    memcpy(&m64, m, 8);
    _mm256_storeu_si256((__m256i *)o->sc, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)s64)));
    const __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)m64));
    _mm256_storeu_si256((__m256i *)o->mn, _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16))); /* (m, m) pairs */
}

/* activation rows t0 .. t0+7 (tidx or plain indices; rows past n are zeros) of block b -> one tile */
static void kt_fill(const char *act, size_t arow, const int64_t *tidx, int64_t t0, int64_t n, int64_t b,
                    kt_tile_t *o) {
    memset(o, 0, sizeof(*o));
    for (int64_t i = 0; i < KT_ROWS && t0 + i < n; i++) {
        const int64_t t = tidx ? tidx[t0 + i] : t0 + i;
        const a8k_t *a = (const a8k_t *)(act + (size_t)t * arow) + b;
        for (int c = 0; c < QK / 4; c++) memcpy(o->q[c][i], a->q + 4 * c, 4);
        for (int p = 0; p < QK / 32; p++) {
            o->bs[p][i][0] = a->bsums[2 * p];
            o->bs[p][i][1] = a->bsums[2 * p + 1];
        }
        o->d[i] = a->d;
    }
}

/* acc + 4-product sums of unsigned u and signed s bytes per int32 lane */
static inline __m256i kt_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if CLOVER_VNNI
    return dpbusd256(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i kt_bcast(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/*
 * One block: weight rows w[0], w[1] x nt (1-4) consecutive tiles a[0 .. nt-1] (nb apart): acc[r][j] for (row r,
 * tile j). gs: values per scale group (16 or 32). nt and gs are constants at each call: the loops unroll and the
 * 2 x nt chains of sums stay in registers.
 */
static inline __attribute__((always_inline)) void kt_block(const kt_dec_t *w0, const kt_dec_t *w1,
                                                           const kt_tile_t *a, int64_t nb, int nt, int gs,
                                                           __m256 *acc0, __m256 *acc1) {
    __m256i i0[4], i1[4];
    for (int j = 0; j < nt; j++) i0[j] = i1[j] = _mm256_setzero_si256();
    for (int g = 0; g < QK / gs; g++) {
        __m256i p0[4], p1[4];
        for (int j = 0; j < nt; j++) p0[j] = p1[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = g * gs / 4; c < (g + 1) * gs / 4; c++) {
            const __m256i u0 = kt_bcast(w0->q + 4 * c), u1 = kt_bcast(w1->q + 4 * c);
            for (int j = 0; j < nt; j++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)a[j * nb].q[c]);
                p0[j] = kt_dpbusd(p0[j], u0, x);
                p1[j] = kt_dpbusd(p1[j], u1, x);
            }
        }
        const __m256i s0 = _mm256_set1_epi32(w0->sc[g]), s1 = _mm256_set1_epi32(w1->sc[g]);
        for (int j = 0; j < nt; j++) {
            i0[j] = _mm256_add_epi32(i0[j], _mm256_mullo_epi32(p0[j], s0));
            i1[j] = _mm256_add_epi32(i1[j], _mm256_mullo_epi32(p1[j], s1));
        }
    }
    __m256i m0[4], m1[4];
    for (int j = 0; j < nt; j++) m0[j] = m1[j] = _mm256_setzero_si256();
    for (int p = 0; p < QK / 32; p++) {
        const __m256i n0 = _mm256_set1_epi32(w0->mn[p]), n1 = _mm256_set1_epi32(w1->mn[p]);
        for (int j = 0; j < nt; j++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)a[j * nb].bs[p]);
            m0[j] = madd_acc(m0[j], bs, n0);
            m1[j] = madd_acc(m1[j], bs, n1);
        }
    }
    const __m256 wd0 = _mm256_set1_ps(w0->d), wd1 = _mm256_set1_ps(w1->d);
    const __m256 wm0 = _mm256_set1_ps(w0->dmin), wm1 = _mm256_set1_ps(w1->dmin);
    __m256 f0[4], f1[4]; /* both rows' sums read before either is written: acc0 may be acc1 (an odd last row) */
    for (int j = 0; j < nt; j++) {
        const __m256 da = _mm256_loadu_ps(a[j * nb].d);
        f0[j] = _mm256_fmadd_ps(_mm256_mul_ps(wd0, da), _mm256_cvtepi32_ps(i0[j]), acc0[j]);
        f1[j] = _mm256_fmadd_ps(_mm256_mul_ps(wd1, da), _mm256_cvtepi32_ps(i1[j]), acc1[j]);
        f0[j] = _mm256_fnmadd_ps(_mm256_mul_ps(wm0, da), _mm256_cvtepi32_ps(m0[j]), f0[j]);
        f1[j] = _mm256_fnmadd_ps(_mm256_mul_ps(wm1, da), _mm256_cvtepi32_ps(m1[j]), f1[j]);
    }
    for (int j = 0; j < nt; j++) acc0[j] = f0[j];
    for (int j = 0; j < nt; j++) acc1[j] = f1[j];
}

/* kt_block with nt and gs as constants */
static void kt_block_any(const kt_dec_t *w0, const kt_dec_t *w1, const kt_tile_t *a, int64_t nb, int nt, int gs,
                         __m256 *acc0, __m256 *acc1) {
#define KT_CASE(n)                                               \
    case n:                                                      \
        if (gs == 16) kt_block(w0, w1, a, nb, n, 16, acc0, acc1); \
        else kt_block(w0, w1, a, nb, n, 32, acc0, acc1);          \
        break;
    switch (nt) { KT_CASE(1) KT_CASE(2) KT_CASE(3) KT_CASE(4) }
#undef KT_CASE
}

/* c[r] lane i -> c[i] lane r (an 8 x 8 transpose of fp32) */
static inline void kt_transpose8(__m256 c[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(c[2 * k], c[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(c[2 * k], c[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xee);
        u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
        c[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
}

/*
 * A task's sums acc[r][j] (weight row r, tile g0 + j of the call) times post -> out[(t0 + i) * ostride + r] for the
 * tiles' real rows (i < n - t0): 8 weight rows transposed in registers and stored one 8-float row per activation
 * row (64 scattered stores per tile cost 13% of the time), fewer one by one.
 */
static void kt_store(__m256 acc[KT_WROWS][KT_GROUP], int nr, int64_t g0, int64_t ng, int64_t n, float post,
                     float *out, int64_t ostride) {
    const __m256 p = _mm256_set1_ps(post);
    for (int64_t j = 0; j < ng; j++) {
        const int64_t t0 = (g0 + j) * KT_ROWS, m = n - t0 < KT_ROWS ? n - t0 : KT_ROWS;
        if (nr == KT_WROWS) {
            __m256 c[8];
            for (int r = 0; r < 8; r++) c[r] = _mm256_mul_ps(acc[r][j], p);
            kt_transpose8(c);
            for (int64_t i = 0; i < m; i++) _mm256_storeu_ps(out + (t0 + i) * ostride, c[i]);
            continue;
        }
        for (int r = 0; r < nr; r++) {
            float v[KT_ROWS];
            _mm256_storeu_ps(v, _mm256_mul_ps(acc[r][j], p));
            for (int64_t i = 0; i < m; i++) out[(t0 + i) * ostride + r] = v[i];
        }
    }
}

/* row r of a task: ridx[r], else r0 + r */
static inline int64_t kt_row(const int64_t *ridx, int64_t r0, int r) { return ridx ? ridx[r] : r0 + r; }

/*
 * K-format rows of expert e of m (nr <= KT_WROWS: kt_row(ridx, r0, r)) against the nt tiles of a call (tiles[tt *
 * nb + b], n real activation rows): out[t * ostride + r]. Each weight block is decoded once per KT_GROUP tiles,
 * and each tile's block is read from L1 by every pair of rows.
 */
static void kt_rows(const mat_t *m, int64_t e, const int64_t *ridx, int64_t r0, int nr, int64_t K,
                    const kt_tile_t *tiles, int64_t nt, int64_t n, float *out, int64_t ostride) {
    const int qt = m->qt, bb = block_bytes(qt), gs = qt == T_Q6_K ? 16 : 32;
    const int64_t nb = K / QK;
    const uint8_t *wrows[KT_WROWS];
    for (int r = 0; r < nr; r++) wrows[r] = m->w + e * m->es + kt_row(ridx, r0, r) * m->rs;
    /* interleaved Q4_K rows (tasks of one whole group, ridx NULL): each row's block unpacked (T_Q6_KX8 never comes
       here: its own kernel has kt's bits at any token count) */
    const int x8 = qt == T_Q4_KX8;
    const uint8_t *group = m->w + e * m->es + r0 / 8 * 8 * m->rs;
    kt_dec_t dec[KT_WROWS];
    __m256 acc[KT_WROWS][KT_GROUP];
    for (int64_t g0 = 0; g0 < nt; g0 += KT_GROUP) {
        const int64_t ng = nt - g0 < KT_GROUP ? nt - g0 : KT_GROUP;
        for (int r = 0; r < nr; r++)
            for (int64_t j = 0; j < ng; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < nr; r++) {
                if (x8) {
                    uint8_t one[144];
                    if (r == 0 && b + 1 < nb) /* the group's next block */
                        for (int o = 0; o < X8_BLOCK; o += 64) __builtin_prefetch(group + (b + 1) * X8_BLOCK + o, 0, 0);
                    x8_q4_row(one, r, (uint8_t *)(group + b * X8_BLOCK), 0);
                    kt_decode(T_Q4_K, one, &dec[r]);
                    continue;
                }
                kt_decode(qt, wrows[r] + b * bb, &dec[r]);
                if (b + 1 < nb) /* the rows' next blocks: 8 streams are more than the prefetcher follows */
                    for (int o = 0; o < bb; o += 64) __builtin_prefetch(wrows[r] + (b + 1) * bb + o, 0, 0);
            }
            for (int64_t j = 0; j < ng; j += 4) {
                const int mt = (int)(ng - j < 4 ? ng - j : 4);
                for (int r = 0; r < nr; r += 2) {
                    const int r1 = r + 1 < nr ? r + 1 : r; /* an odd last row: computed twice, the same sums */
                    kt_block_any(&dec[r], &dec[r1], tiles + (g0 + j) * nb + b, nb, mt, gs, acc[r] + j, acc[r1] + j);
                }
            }
        }
        kt_store(acc, nr, g0, ng, n, 1.0f, out, ostride); /* times 1: the same bits */
    }
}
#endif

/*
 * Whether qmatmul_run / qmatmul_many take the tiled kernels: a K format (kt; the split formats: kts_wanted),
 * >= KT_MIN_T activation rows, the SIMD build.
 */
static int kt_wanted(int qt, int64_t T) {
    return CLOVER_AVX2 && is_k_type(qt) && T >= KT_MIN_T;
}

#if CLOVER_AVX2
static void *kt_tiles(const char *act, size_t arow, const int64_t *tidx, int64_t n, int64_t nb, int split, int nth);
static void kt_task(const mat_t *m, int64_t e, const int64_t *ridx, int64_t r0, int nr, int64_t K, const void *tiles,
                    int64_t n, float *out, int64_t ostride);
#endif

/* R weight rows (rows[r], or r) of m, K format or split, against the T quantized activation rows act ->
   out[t * ostride + r], in tasks of KT_WROWS rows */
static int kt_matmul(const mat_t *m, int64_t K, const char *act, size_t arow, int64_t T, const int64_t *rows,
                     int64_t R, float *out, int64_t ostride, int nth) {
#if CLOVER_AVX2
    void *tiles = kt_tiles(act, arow, NULL, T, K / QK, is_split_type(m->qt), nth);
    if (!tiles) return ERR_ALLOC;
    const int64_t G = (R + KT_WROWS - 1) / KT_WROWS;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, G)) schedule(dynamic, chunk_for(G, nth) / KT_WROWS + 1)
    for (int64_t g = 0; g < G; g++) {
        const int64_t r0 = g * KT_WROWS;
        kt_task(m, 0, rows ? rows + r0 : NULL, r0, (int)(R - r0 < KT_WROWS ? R - r0 : KT_WROWS), K, tiles, T,
                out + r0, ostride);
    }
    free(tiles);
    return OK;
#else
    (void)m, (void)K, (void)act, (void)arow, (void)T, (void)rows, (void)R, (void)out, (void)ostride, (void)nth;
    return ERR_TYPE;
#endif
}

/* ============================================================================================================ */
/* end of the tiled K formats                                                                                   */
/* ============================================================================================================ */

/* ============================================================================================================ */
/* Issue 30: the split formats (the own cache's NF4 experts and INT8 projections) against 8 or more activation  */
/* rows, as the tiled K formats above: activation rows in tiles of 8 (kts_tile_t: 256 values in 32-value        */
/* blocks, each with its own scale), one int32 lane per row. A weight row's 256 values are decoded once to int8 */
/* (NF4 through its table) with the fp32 scale of each 32 values. Per block of 32 values and (weight row,       */
/* activation row): p = sum w a, exact, then acc = fma(s * da, p, acc), blocks in order; NF4's 1/127 at the     */
/* end. With VNNI vpdpbusd reads u = w + 128 (unsigned) and 128 * sum(a) is taken off each block; AVX2 moves    */
/* the sign of w onto a and multiplies |w| (maddubs pairs <= 2 x 127 x 127): the same integers either way. It   */
/* differs from dot_nf4 / dot_i8 (two fp32 chains) in the last bits.                                            */
/* ============================================================================================================ */

#if CLOVER_AVX2
typedef struct {
    int8_t q[QK / 4][KT_ROWS][4];
    int32_t sa[QK / QS][KT_ROWS]; /* 128 x the sum of each 32-value block (VNNI's offset) */
    float d[QK / QS][KT_ROWS];
} kts_tile_t;

typedef struct {
    uint8_t u[QK]; /* VNNI: w + 128; AVX2: |w| */
    int8_t w[QK];  /* AVX2: the signs */
    float s[QK / QS];
} kts_dec_t;

/* row r of expert e of split matrix m, values 256 b .. 256 b + 255 -> o */
static void kts_decode(const mat_t *m, int64_t e, int64_t r, int64_t K, int64_t b, kts_dec_t *o) {
    const uint8_t *wr = m->w + e * m->es + r * m->rs;
    const float *sc = (const float *)(m->s + e * m->ses);
    const int64_t v = m->v0 + r * K + b * QK;
    int64_t blk = v / m->bs, rem = v % m->bs; /* the scales walked (next_scale), not divided for each step */
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NF4_I8));
    for (int c = 0; c < QK / QS; c++) {
        const __m256i w = m->qt == T_NF4 ? nf4_values(wr + (b * QK + c * QS) / 2, lut)
                                         : _mm256_loadu_si256((const __m256i *)(wr + b * QK + c * QS));
#if CLOVER_VNNI
        _mm256_storeu_si256((__m256i *)(o->u + c * QS), _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)));
#else
        _mm256_storeu_si256((__m256i *)(o->u + c * QS), _mm256_abs_epi8(w));
        _mm256_storeu_si256((__m256i *)(o->w + c * QS), w);
#endif
        o->s[c] = next_scale(sc, m->bs, &blk, &rem);
    }
}

static void kts_fill(const char *act, size_t arow, const int64_t *tidx, int64_t t0, int64_t n, int64_t b,
                     kts_tile_t *o) {
    memset(o, 0, sizeof(*o));
    for (int64_t i = 0; i < KT_ROWS && t0 + i < n; i++) {
        const int64_t t = tidx ? tidx[t0 + i] : t0 + i;
        const a8_t *a = (const a8_t *)(act + (size_t)t * arow) + b * (QK / QS);
        for (int blk = 0; blk < QK / QS; blk++) {
            int32_t sum = 0;
            for (int l = 0; l < QS; l++) sum += a[blk].q[l];
            for (int c = 0; c < QS / 4; c++) memcpy(o->q[blk * (QS / 4) + c][i], a[blk].q + 4 * c, 4);
            o->sa[blk][i] = 128 * sum;
            o->d[blk][i] = a[blk].d;
        }
    }
}

/* acc + sum w a per lane over 4 values: u, w broadcast weights (see kts_dec_t), x the tile's bytes */
static inline __m256i kts_dp(__m256i acc, __m256i u, __m256i w, __m256i x) {
#if CLOVER_VNNI
    (void)w;
    return dpbusd256(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* 256 values of rows w0, w1 x nt consecutive tiles (nb apart) -> acc0[j], acc1[j] (as kt_block) */
static inline __attribute__((always_inline)) void kts_block(const kts_dec_t *w0, const kts_dec_t *w1,
                                                            const kts_tile_t *a, int64_t nb, int nt, __m256 *acc0,
                                                            __m256 *acc1) {
    __m256 f0[4], f1[4];
    for (int j = 0; j < nt; j++) {
        f0[j] = acc0[j];
        f1[j] = acc1[j];
    }
    for (int blk = 0; blk < QK / QS; blk++) {
        __m256i p0[4], p1[4];
        for (int j = 0; j < nt; j++) p0[j] = p1[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = blk * (QS / 4); c < (blk + 1) * (QS / 4); c++) {
            const __m256i u0 = kt_bcast(w0->u + 4 * c), u1 = kt_bcast(w1->u + 4 * c);
#if CLOVER_VNNI
            const __m256i s0 = u0, s1 = u1;
#else
            const __m256i s0 = kt_bcast(w0->w + 4 * c), s1 = kt_bcast(w1->w + 4 * c);
#endif
            for (int j = 0; j < nt; j++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)a[j * nb].q[c]);
                p0[j] = kts_dp(p0[j], u0, s0, x);
                p1[j] = kts_dp(p1[j], u1, s1, x);
            }
        }
        const __m256 s0 = _mm256_set1_ps(w0->s[blk]), s1 = _mm256_set1_ps(w1->s[blk]);
        for (int j = 0; j < nt; j++) {
#if CLOVER_VNNI
            const __m256i off = _mm256_loadu_si256((const __m256i *)a[j * nb].sa[blk]);
            p0[j] = _mm256_sub_epi32(p0[j], off);
            p1[j] = _mm256_sub_epi32(p1[j], off);
#endif
            const __m256 da = _mm256_loadu_ps(a[j * nb].d[blk]);
            f0[j] = _mm256_fmadd_ps(_mm256_mul_ps(s0, da), _mm256_cvtepi32_ps(p0[j]), f0[j]);
            f1[j] = _mm256_fmadd_ps(_mm256_mul_ps(s1, da), _mm256_cvtepi32_ps(p1[j]), f1[j]);
        }
    }
    for (int j = 0; j < nt; j++) acc0[j] = f0[j];
    for (int j = 0; j < nt; j++) acc1[j] = f1[j];
}

static void kts_block_any(const kts_dec_t *w0, const kts_dec_t *w1, const kts_tile_t *a, int64_t nb, int nt,
                          __m256 *acc0, __m256 *acc1) {
    switch (nt) {
    case 1: kts_block(w0, w1, a, nb, 1, acc0, acc1); break;
    case 2: kts_block(w0, w1, a, nb, 2, acc0, acc1); break;
    case 3: kts_block(w0, w1, a, nb, 3, acc0, acc1); break;
    default: kts_block(w0, w1, a, nb, 4, acc0, acc1); break;
    }
}

/* as kt_rows for a split-format matrix */
static void kts_rows(const mat_t *m, int64_t e, const int64_t *ridx, int64_t r0, int nr, int64_t K,
                     const kts_tile_t *tiles, int64_t nt, int64_t n, float *out, int64_t ostride) {
    const int64_t nb = K / QK;
    kts_dec_t dec[KT_WROWS];
    __m256 acc[KT_WROWS][KT_GROUP];
    for (int64_t g0 = 0; g0 < nt; g0 += KT_GROUP) {
        const int64_t ng = nt - g0 < KT_GROUP ? nt - g0 : KT_GROUP;
        for (int r = 0; r < nr; r++)
            for (int64_t j = 0; j < ng; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < nr; r++) kts_decode(m, e, kt_row(ridx, r0, r), K, b, &dec[r]);
            for (int64_t j = 0; j < ng; j += 4) {
                const int mt = (int)(ng - j < 4 ? ng - j : 4);
                for (int r = 0; r < nr; r += 2) {
                    const int r1 = r + 1 < nr ? r + 1 : r;
                    kts_block_any(&dec[r], &dec[r1], tiles + (g0 + j) * nb + b, nb, mt, acc[r] + j, acc[r1] + j);
                }
            }
        }
        kt_store(acc, nr, g0, ng, n, m->qt == T_NF4 ? 1.0f / 127.0f : 1.0f, out, ostride);
    }
}

/* one tile of either family (split: kts_tile_t) */
static void kt_fill_any(int split, const char *act, size_t arow, const int64_t *tidx, int64_t t0, int64_t n,
                        int64_t b, void *o) {
    if (split) kts_fill(act, arow, tidx, t0, n, b, (kts_tile_t *)o);
    else kt_fill(act, arow, tidx, t0, n, b, (kt_tile_t *)o);
}

static size_t kt_tile_bytes(int split) { return split ? sizeof(kts_tile_t) : sizeof(kt_tile_t); }

/* the tiles of n activation rows (tidx or plain) of nb 256-value groups, in a fresh buffer (NULL on failure) */
static void *kt_tiles(const char *act, size_t arow, const int64_t *tidx, int64_t n, int64_t nb, int split, int nth) {
    const int64_t nt = (n + KT_ROWS - 1) / KT_ROWS;
    const size_t tb = kt_tile_bytes(split);
    char *tiles = (char *)malloc(tb * (size_t)(nt * nb));
    if (!tiles) return NULL;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, nt * nb / 8)) schedule(static) if (nt * nb >= 16)
    for (int64_t i = 0; i < nt * nb; i++)
        kt_fill_any(split, act, arow, tidx, (i / nb) * KT_ROWS, n, i % nb, tiles + tb * (size_t)i);
    return tiles;
}

/* nr rows of expert e of m (kt_row(ridx, r0, r)) against the tiles of n activation rows: kt_rows or kts_rows */
static void kt_task(const mat_t *m, int64_t e, const int64_t *ridx, int64_t r0, int nr, int64_t K, const void *tiles,
                    int64_t n, float *out, int64_t ostride) {
    const int64_t nt = (n + KT_ROWS - 1) / KT_ROWS;
    if (is_split_type(m->qt)) kts_rows(m, e, ridx, r0, nr, K, (const kts_tile_t *)tiles, nt, n, out, ostride);
    else kt_rows(m, e, ridx, r0, nr, K, (const kt_tile_t *)tiles, nt, n, out, ostride);
}
#endif

/* whether a split-format product of T rows of K values takes kts: >= KT_MIN_T rows, whole 256-value groups */
static int kts_wanted(const mat_t *m, int64_t K, int64_t T) {
    return CLOVER_AVX2 && is_split_type(m->qt) && T >= KT_MIN_T && K % QK == 0;
}

/* ============================================================================================================ */
/* end of the tiled split formats                                                                               */
/* ============================================================================================================ */

/* ============================================================================================================ */
/* the routed MoE through the tiled kernels: all three matrices K formats (kt) or all split formats with whole  */
/* 256-value groups (kts), and >= KT_MIN_T tokens in the call; an expert with fewer tokens keeps row_dots /    */
/* mat_rows_tiled                                                                                               */
/* ============================================================================================================ */

static int kt_moe_wanted(const mat_t *g, const mat_t *u, const mat_t *dn, int64_t T, int64_t D, int64_t I) {
    if (kt_wanted(g->qt, T)) return is_k_type(u->qt) && is_k_type(dn->qt);
    return kts_wanted(g, D, T) && kts_wanted(u, D, T) && kts_wanted(dn, I, T);
}

/* the tiles of every used expert with >= min_t tokens: off[e] its first tile, -1 for the others */
static void *kt_expert_tiles(const char *act, size_t arow, const int64_t *tidx, const int64_t *count,
                             const int64_t *used, int64_t U, int64_t E, int64_t nb, int split, int64_t min_t,
                             int64_t *off, int nth) {
#if CLOVER_AVX2
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) off[e] = -1;
    for (int64_t i = 0; i < U; i++) {
        const int64_t e = used[i], n = count[e + 1] - count[e];
        if (n < min_t) continue;
        off[e] = total;
        total += (n + KT_ROWS - 1) / KT_ROWS * nb;
    }
    const size_t tb = kt_tile_bytes(split);
    char *tiles = (char *)malloc(tb * (size_t)(total > 0 ? total : 1));
    if (!tiles) return NULL;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, U)) schedule(dynamic, 1) if (total >= 16)
    for (int64_t i = 0; i < U; i++) {
        const int64_t e = used[i], s0 = count[e], n = count[e + 1] - s0;
        if (off[e] < 0) continue;
        const char *base = tidx ? act : act + (size_t)s0 * arow;
        for (int64_t j = 0; j < (n + KT_ROWS - 1) / KT_ROWS * nb; j++)
            kt_fill_any(split, base, arow, tidx ? tidx + s0 : NULL, (j / nb) * KT_ROWS, n, j % nb,
                        tiles + tb * (size_t)(off[e] + j));
    }
    return tiles;
#else
    (void)act, (void)arow, (void)tidx, (void)count, (void)used, (void)U, (void)E, (void)nb, (void)split, (void)min_t,
        (void)off, (void)nth;
    return NULL;
#endif
}

/* rows r0 .. r0 + nr - 1 of expert e of m against its n tokens' tiles (from off) */
static void kt_expert_rows(const mat_t *m, int64_t e, int64_t r0, int64_t nr, int64_t K, const void *tiles,
                           int64_t off, int64_t n, float *out, int64_t ostride) {
#if CLOVER_AVX2
    kt_task(m, e, NULL, r0, (int)nr, K, (const char *)tiles + kt_tile_bytes(is_split_type(m->qt)) * (size_t)off, n,
            out, ostride);
#else
    (void)m, (void)e, (void)r0, (void)nr, (void)K, (void)tiles, (void)off, (void)n, (void)out, (void)ostride;
#endif
}


/* ============================================================================================================ */
/* Issue 30: Q4_K / Q6_K experts with their rows interleaved in groups of 8 (T_Q4_KX8 / T_Q6_KX8, the layouts at */
/* the top of the file), for the few tokens each expert of a pass or an AR step gets.                           */
/*                                                                                                              */
/* A row's direct dot (dot_q45k_n) spends two multiplies per 32 multiply-adds (maddubs, then madd by the        */
/* sub-block's scale broadcast), unpacks the block's scales and sums its 8 lanes per row: ~25 cycles a block    */
/* and a token here, so the spread MoE was bound by its dots, not its reads. With 8 rows in the int32 lanes,     */
/* one 32-byte load holds 4 values of each row, one vpdpbusd against the activation's 4 values (broadcast) adds */
/* 32 products, and each 32-value sub-block's sums are scaled once for the 8 rows (vpmulld by the rows' scales,  */
/* unpacked for all 8 at once). The per-block formula is kt's (I = sum_j sc_j S_j and M = sum_j m_j B_j exact,  */
/* then fma(d * da, I, acc), fnmadd(dmin * da, M, acc) in block order), so a row gives kt's bits whatever the    */
/* number of tokens: a token's experts come out the same alone or in any batch.                                 */
/* ============================================================================================================ */

#if CLOVER_AVX2
/* 8 fp16 at p -> fp32 */
static inline __m256 x8_f16x8(const uint8_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float v[8];
    for (int r = 0; r < 8; r++) v[r] = load_f16(p + 2 * r);
    return _mm256_loadu_ps(v);
#endif
}

/* a group's nb blocks against na (1 to DOT_ROWS, a constant) activation rows: acc[j] lane r = row r . as[j] */
static inline __attribute__((always_inline)) void x8_dots(const uint8_t *grp, int64_t nb, const a8k_t *const *as,
                                                          const int na, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), m3f = _mm256_set1_epi8(0x3f), m30 = _mm256_set1_epi8(0x30);
    const __m256i ff = _mm256_set1_epi32(0xff);
    for (int j = 0; j < na; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, grp += X8_BLOCK) {
        /* the 8 rows' scales and mins as unpack_k4_scales unpacks one row's, four sub-blocks a dword */
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(grp + 32));
        const __m256i s1 = _mm256_loadu_si256((const __m256i *)(grp + 64));
        const __m256i s2 = _mm256_loadu_si256((const __m256i *)(grp + 96));
        const __m256i sc03 = _mm256_and_si256(s0, m3f), m03 = _mm256_and_si256(s1, m3f);
        const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(s2, low4), _mm256_and_si256(_mm256_srli_epi32(s0, 2), m30));
        const __m256i m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 4), low4),
                                            _mm256_and_si256(_mm256_srli_epi32(s1, 2), m30));
        __m256i I[DOT_ROWS], M[DOT_ROWS];
        for (int j = 0; j < na; j++) I[j] = M[j] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i scs = c < 2 ? sc03 : sc47;
            const int sh = 16 * (c & 1);
            const __m256i k0 = _mm256_and_si256(_mm256_srli_epi32(scs, sh), ff);     /* sub-block 2c */
            const __m256i k1 = _mm256_and_si256(_mm256_srli_epi32(scs, sh + 8), ff); /* sub-block 2c + 1 */
            __m256i slo[DOT_ROWS], shi[DOT_ROWS];
            for (int j = 0; j < na; j++) slo[j] = shi[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(grp + 128 + (8 * c + i) * 32));
                const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                for (int j = 0; j < na; j++) {
                    slo[j] = kt_dpbusd(slo[j], lo, kt_bcast(as[j][b].q + 64 * c + 4 * i));
                    shi[j] = kt_dpbusd(shi[j], hi, kt_bcast(as[j][b].q + 64 * c + 32 + 4 * i));
                }
            }
            for (int j = 0; j < na; j++)
                I[j] = _mm256_add_epi32(I[j], _mm256_add_epi32(_mm256_mullo_epi32(slo[j], k0),
                                                               _mm256_mullo_epi32(shi[j], k1)));
        }
        for (int p = 0; p < 8; p++) { /* mins: M = sum_p m_p (bsums[2p] + bsums[2p + 1]) */
            const __m256i mp = _mm256_and_si256(_mm256_srli_epi32(p < 4 ? m03 : m47, 8 * (p & 3)), ff);
            for (int j = 0; j < na; j++)
                M[j] = _mm256_add_epi32(M[j], _mm256_mullo_epi32(mp, _mm256_set1_epi32(as[j][b].bsums[2 * p] +
                                                                                       as[j][b].bsums[2 * p + 1])));
        }
        const __m256 d = x8_f16x8(grp), dmin = x8_f16x8(grp + 16);
        for (int j = 0; j < na; j++) {
            const __m256 da = _mm256_set1_ps(as[j][b].d);
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(I[j]), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(M[j]), acc[j]);
        }
    }
}

/* x8_dots for Q6_K groups (T_Q6_KX8): values 0-63 (the -32 taken out through the activations' 16-value sums, as
   kt does), 16 scales a block */
static inline __attribute__((always_inline)) void x8_dots6(const uint8_t *grp, int64_t nb, const a8k_t *const *as,
                                                           const int na, __m256 *acc) {
    const __m256i m3f = _mm256_set1_epi8(0x3f), m03 = _mm256_set1_epi8(0x03), m0c = _mm256_set1_epi8(0x0c);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    for (int j = 0; j < na; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, grp += X8_BLOCK6) {
        __m256i I[DOT_ROWS], M[DOT_ROWS];
        for (int j = 0; j < na; j++) I[j] = M[j] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) { /* M = sum_j sc_j B_j by int16 pairs (sc_2p, sc_2p+1) per row; times 32 below */
            const __m256i pair = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(grp + 16 + 16 * p)),
                                                                        _mm_loadl_epi64((const __m128i *)(grp + 24 + 16 * p))));
            for (int j = 0; j < na; j++) {
                const int16_t *bs = as[j][b].bsums + 2 * p;
                M[j] = madd_acc(M[j], pair, _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)bs[0] | (uint32_t)(uint16_t)bs[1] << 16)));
            }
        }
        for (int hh = 0; hh < 4; hh++) { /* half h = hh / 2, quads i of 4 * (hh % 2) .. +3: sub-blocks 8h + 2m + hh % 2 */
            const int h = hh / 2;
            __m256i sv[DOT_ROWS][4];
            for (int j = 0; j < na; j++) sv[j][0] = sv[j][1] = sv[j][2] = sv[j][3] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int i = 4 * (hh % 2); i < 4 * (hh % 2) + 4; i++) {
                const uint8_t *t = grp + 144 + (8 * h + i) * 3 * 32;
                const __m256i t0 = _mm256_loadu_si256((const __m256i *)t);
                const __m256i t1 = _mm256_loadu_si256((const __m256i *)(t + 32));
                const __m256i t2 = _mm256_loadu_si256((const __m256i *)(t + 64));
                const __m256i v0 = _mm256_and_si256(t0, m3f), v1 = _mm256_and_si256(t1, m3f);
                const __m256i v2 = _mm256_and_si256(t2, m3f);
                const __m256i v3 = _mm256_or_si256(
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(t0, 6), m03), _mm256_and_si256(_mm256_srli_epi16(t1, 4), m0c)),
                    _mm256_and_si256(_mm256_srli_epi16(t2, 2), m30));
                for (int j = 0; j < na; j++) {
                    const int8_t *aq = as[j][b].q + 128 * h + 4 * i;
                    sv[j][0] = kt_dpbusd(sv[j][0], v0, kt_bcast(aq));
                    sv[j][1] = kt_dpbusd(sv[j][1], v1, kt_bcast(aq + 32));
                    sv[j][2] = kt_dpbusd(sv[j][2], v2, kt_bcast(aq + 64));
                    sv[j][3] = kt_dpbusd(sv[j][3], v3, kt_bcast(aq + 96));
                }
            }
            for (int mm = 0; mm < 4; mm++) {
                const int sub = 8 * h + 2 * mm + hh % 2;
                const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(grp + 16 + 8 * sub)));
                for (int j = 0; j < na; j++) I[j] = _mm256_add_epi32(I[j], _mm256_mullo_epi32(sv[j][mm], sc));
            }
        }
        const __m256 d = x8_f16x8(grp);
        for (int j = 0; j < na; j++) {
            const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(as[j][b].d));
            acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(I[j]), acc[j]);
            acc[j] = _mm256_fnmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_slli_epi32(M[j], 5)), acc[j]);
        }
    }
}
#endif

#if CLOVER_AVX2
/* the split x8 kernels' sums of a step start at -128 sum(a) with VNNI (which reads w + 128): p comes out exact */
static inline __m256i x8_sum0(const a8_t *a) {
#if CLOVER_VNNI
    return _mm256_set1_epi32(a->off);
#else
    (void)a;
    return _mm256_setzero_si256();
#endif
}

/* a step's float part, kts's formula: acc + (s * da) p, the rows' scales s */
static inline __m256 x8_step(__m256 acc, __m256 s, const a8_t *a, __m256i p) {
    return _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a->d)), _mm256_cvtepi32_ps(p), acc);
}

/*
 * x8_dots for the split formats' groups (T_NF4X8, T_I8X8; i8 a constant): steps 32-value steps of a group against
 * na (1 to X8_I8_ROWS for INT8, DOT_ROWS for NF4; a constant) activation rows; sc: the group's scales ([block][row]),
 * per: steps a scale block. NF4: one 32-byte load holds 8 values of each row (4 in the low nibbles, 4 in the high),
 * one table lookup (vpshufb) each turns them into the table's int8 values; INT8: one load holds 4 codes of each row,
 * used as they are, two chains of sums a row (even and odd vectors). The formula is kts's: per step p = sum w a
 * (exact), acc = fma(s * da, p, acc), steps in order, so a token's rows come out the same alone or in any batch, and
 * equal to the tiled kernels' at >= 8 tokens. VNNI reads u = w + 128 (vpdpbusd's unsigned side), its sums starting
 * at -128 sum(a); AVX2 moves the signs of w onto a (maddubs pairs <= 2 x 127 x 127): the same integers (kts_dp).
 */
static inline __attribute__((always_inline)) void x8_dots_split(const uint8_t *grp, const float *sc, int64_t steps,
                                                                int64_t per, const a8_t *const *as, const int na,
                                                                const int i8, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NF4_I8));
    const __m256i lutu = _mm256_xor_si256(lut, flip); /* NF4 with VNNI: the table + 128 */
    (void)lutu, (void)flip;
    for (int j = 0; j < na; j++) acc[j] = _mm256_setzero_ps();
    const float *scale = sc;
    for (int64_t c = 0, left = per; c < steps; c++, grp += i8 ? 256 : 128) {
        if (!left--) { /* the next scale block */
            scale += 8;
            left = per - 1;
        }
        __m256i p0[X8_I8_ROWS], p1[X8_I8_ROWS];
        for (int j = 0; j < na; j++) {
            p0[j] = x8_sum0(&as[j][c]);
            p1[j] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int v = 0; v < (i8 ? 8 : 4); v++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(grp + 32 * v));
            if (i8) {
#if CLOVER_VNNI
                const __m256i u = _mm256_xor_si256(q, flip);
#else
                const __m256i u = _mm256_abs_epi8(q);
#endif
                for (int j = 0; j < na; j++) {
                    const __m256i a = kt_bcast(as[j][c].q + 4 * v);
                    if (v & 1) p1[j] = kts_dp(p1[j], u, q, a);
                    else p0[j] = kts_dp(p0[j], u, q, a);
                }
                continue;
            }
            const __m256i clo = _mm256_and_si256(q, low4), chi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            const __m256i wlo = _mm256_shuffle_epi8(lut, clo), whi = _mm256_shuffle_epi8(lut, chi);
#if CLOVER_VNNI
            const __m256i ulo = _mm256_shuffle_epi8(lutu, clo), uhi = _mm256_shuffle_epi8(lutu, chi);
#else
            const __m256i ulo = _mm256_abs_epi8(wlo), uhi = _mm256_abs_epi8(whi);
#endif
            for (int j = 0; j < na; j++) {
                p0[j] = kts_dp(p0[j], ulo, wlo, kt_bcast(as[j][c].q + 4 * v));
                p1[j] = kts_dp(p1[j], uhi, whi, kt_bcast(as[j][c].q + 16 + 4 * v));
            }
        }
        const __m256 s = _mm256_loadu_ps(scale);
        for (int j = 0; j < na; j++) acc[j] = x8_step(acc[j], s, &as[j][c], _mm256_add_epi32(p0[j], p1[j]));
    }
}
#endif

#if CLOVER_AVX2
/* g activation rows' sums of an interleaved group (acc[i] lane r: row r), times post -> out[i * ostride + r] */
static inline void x8_store(const __m256 *acc, int64_t g, float post, float *out, int64_t ostride) {
    for (int64_t i = 0; i < g; i++) {
        float v[8];
        _mm256_storeu_ps(v, _mm256_mul_ps(acc[i], _mm256_set1_ps(post)));
        for (int r = 0; r < 8; r++) out[i * ostride + r] = v[r];
    }
}
#endif


/* the weight of value l (0-31) of row r in step c's bytes at q of a T_NF4X8 (128 bytes) or T_I8X8 (256) group */
static inline int split_x8_value(int qt, const uint8_t *q, int r, int l) {
    const int quad = l / 4;
    if (qt == T_I8X8) return (int8_t)q[32 * quad + 4 * r + l % 4];
    const int byte = q[32 * (quad % 4) + 4 * r + l % 4];
    return NF4_I8[quad < 4 ? byte & 15 : byte >> 4];
}

/* the 8 interleaved NF4 or INT8 rows r0 .. r0+7 of expert e of m (T_NF4X8 / T_I8X8) against n activation rows -> out */
static void x8_rows_split(const mat_t *m, int64_t e, int64_t r0, int64_t K, const char *act, const int64_t *tidx,
                          int64_t n, float *out, int64_t ostride) {
    const uint8_t *grp = m->w + e * m->es + r0 * m->rs;
    const float *sc = (const float *)(m->s + e * m->ses) + (m->v0 + r0 * K) / m->bs;
    const int64_t steps = K / QS, per = m->bs / QS;
    const size_t arow = sizeof(a8_t) * (size_t)steps;
    const int i8 = m->qt == T_I8X8;
    const float post = i8 ? 1.0f : 1.0f / 127.0f;
#if CLOVER_AVX2
    const int64_t most = i8 ? X8_I8_ROWS : DOT_ROWS;
    for (int64_t i0 = 0; i0 < n;) {
        const int64_t g = n - i0 >= most ? most : dot_group(n - i0);
        const a8_t *as[X8_I8_ROWS];
        __m256 acc[X8_I8_ROWS];
        for (int64_t i = 0; i < g; i++) as[i] = (const a8_t *)(act + (size_t)(tidx ? tidx[i0 + i] : i0 + i) * arow);
        if (i8) {
            switch (g) { /* a constant row count in each: the loops over rows unroll */
            case 1: x8_dots_split(grp, sc, steps, per, as, 1, 1, acc); break;
            case 2: x8_dots_split(grp, sc, steps, per, as, 2, 1, acc); break;
            case 3: x8_dots_split(grp, sc, steps, per, as, 3, 1, acc); break;
            case 4: x8_dots_split(grp, sc, steps, per, as, 4, 1, acc); break;
            default: x8_dots_split(grp, sc, steps, per, as, X8_I8_ROWS, 1, acc); break;
            }
        } else {
            switch (g) {
            case 1: x8_dots_split(grp, sc, steps, per, as, 1, 0, acc); break;
            case 2: x8_dots_split(grp, sc, steps, per, as, 2, 0, acc); break;
            case 3: x8_dots_split(grp, sc, steps, per, as, 3, 0, acc); break;
            default: x8_dots_split(grp, sc, steps, per, as, 4, 0, acc); break;
            }
        }
        x8_store(acc, g, post, out + i0 * ostride, ostride);
        i0 += g;
    }
#else
    const int64_t step_bytes = i8 ? 256 : 128;
    for (int64_t i = 0; i < n; i++) {
        const a8_t *a = (const a8_t *)(act + (size_t)(tidx ? tidx[i] : i) * arow);
        for (int r = 0; r < 8; r++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < steps; c++) {
                int32_t p = 0;
                for (int l = 0; l < QS; l++) p += split_x8_value(m->qt, grp + step_bytes * c, r, l) * a[c].q[l];
                acc = fmaf(sc[8 * (c / per) + r] * a[c].d, (float)p, acc);
            }
            out[i * ostride + r] = acc * post;
        }
    }
#endif
}

#if !CLOVER_AVX2
/* one row's block of an interleaved group in the scalar build: kt's formula, one value at a time */
static float x8_scalar_block(int qt, const uint8_t *blk, int r, const a8k_t *a, float acc) {
    uint8_t one[210];
    int32_t I = 0, M = 0;
    float d, dmin;
    if (qt == T_Q6_KX8) {
        x8_q6_row(one, r, (uint8_t *)blk, 0);
        for (int v = 0; v < QK; v++) I += (int8_t)one[192 + v / 16] * q6_value(one, v) * a->q[v];
        for (int j = 0; j < 16; j++) M += (int8_t)one[192 + j] * 32 * a->bsums[j];
        d = dmin = load_f16(one + 208);
    } else {
        uint8_t sc[8], mn[8];
        x8_q4_row(one, r, (uint8_t *)blk, 0);
        unpack_k4_scales(one + 4, sc, mn);
        for (int v = 0; v < QK; v++) {
            const int c = v / 64, hi = v % 64 >= 32, l = v % 32;
            I += sc[2 * c + hi] * (hi ? one[16 + 32 * c + l] >> 4 : one[16 + 32 * c + l] & 15) * a->q[v];
        }
        for (int p = 0; p < 8; p++) M += mn[p] * (a->bsums[2 * p] + a->bsums[2 * p + 1]);
        d = load_f16(one);
        dmin = load_f16(one + 2);
    }
    acc = fmaf(d * a->d, (float)I, acc);
    return fmaf(-(dmin * a->d), (float)M, acc);
}
#endif

static void x8_rows(const mat_t *m, int64_t e, int64_t r0, int64_t K, const char *act, const int64_t *tidx, int64_t n,
                    float *out, int64_t ostride) {
    if (is_x8_split(m->qt)) {
        x8_rows_split(m, e, r0, K, act, tidx, n, out, ostride);
        return;
    }
    const uint8_t *grp = m->w + e * m->es + r0 / 8 * 8 * m->rs;
    const int64_t nb = K / QK;
    const size_t arow = sizeof(a8k_t) * (size_t)nb;
#if CLOVER_AVX2
    for (int64_t i0 = 0; i0 < n;) {
        const int64_t g = dot_group(n - i0);
        const a8k_t *as[DOT_ROWS];
        __m256 acc[DOT_ROWS];
        for (int64_t i = 0; i < g; i++) as[i] = (const a8k_t *)(act + (size_t)(tidx ? tidx[i0 + i] : i0 + i) * arow);
        const int q6 = m->qt == T_Q6_KX8;
        switch (g) { /* a constant row count in each: the loops over rows unroll */
        case 1: q6 ? x8_dots6(grp, nb, as, 1, acc) : x8_dots(grp, nb, as, 1, acc); break;
        case 2: q6 ? x8_dots6(grp, nb, as, 2, acc) : x8_dots(grp, nb, as, 2, acc); break;
        case 3: q6 ? x8_dots6(grp, nb, as, 3, acc) : x8_dots(grp, nb, as, 3, acc); break;
        default: q6 ? x8_dots6(grp, nb, as, 4, acc) : x8_dots(grp, nb, as, 4, acc); break;
        }
        x8_store(acc, g, 1.0f, out + i0 * ostride, ostride); /* times 1: the same bits */
        i0 += g;
    }
#else
    const int64_t xb = m->qt == T_Q6_KX8 ? X8_BLOCK6 : X8_BLOCK;
    for (int64_t i = 0; i < n; i++) {
        const a8k_t *a0 = (const a8k_t *)(act + (size_t)(tidx ? tidx[i] : i) * arow);
        for (int r = 0; r < 8; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) acc = x8_scalar_block(m->qt, grp + b * xb, r, a0 + b, acc);
            out[i * ostride + r] = acc;
        }
    }
#endif
}

/*
 * Interleave (unpack 0) or restore (unpack 1), in place, the Q4_K or Q6_K (qt) matrices [R, nb blocks] of E experts
 * at w + e * es: T_Q4_KX8's / T_Q6_KX8's groups of 8 rows (R a multiple of 8). Returns 0 or an error.
 */
int clover_x8_pack(uint8_t *w, int64_t E, int64_t es, int64_t R, int64_t nb, int qt, int unpack, int nth) {
    if (qt != T_Q4_K && qt != T_Q6_K) return ERR_TYPE;
    if (E < 0 || R % 8 || nb <= 0) return ERR_SHAPE;
    const int q6 = qt == T_Q6_K;
    const int64_t bb = block_bytes(qt), xb = q6 ? X8_BLOCK6 : X8_BLOCK, rs = nb * bb, G = E * (R / 8);
    int rc = OK;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, G)) schedule(static)
    for (int64_t t = 0; t < G; t++) {
        uint8_t *grp = w + t / (R / 8) * es + t % (R / 8) * 8 * rs, *buf = (uint8_t *)malloc((size_t)(8 * rs));
        if (!buf) {
            rc = ERR_ALLOC;
            continue;
        }
        memcpy(buf, grp, (size_t)(8 * rs));
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++) {
                uint8_t *row = unpack ? grp + r * rs + b * bb : buf + r * rs + b * bb;
                uint8_t *blk = unpack ? buf + b * xb : grp + b * xb;
                (q6 ? x8_q6_row : x8_q4_row)(row, r, blk, !unpack);
            }
        free(buf);
    }
    return rc;
}

/* a group's 8 rows of nsc fp32 scales (4-byte units, any alignment): from (as [row][j]) or back (unpack: as [j][row])
   the interleaved order, buf -> sg */
static void x8_scales_move(uint8_t *sg, const uint8_t *buf, int64_t nsc, int unpack) {
    for (int r = 0; r < 8; r++)
        for (int64_t j = 0; j < nsc; j++) { /* scale j of row r: plain r nsc + j, interleaved 8 j + r */
            const int64_t plain = r * nsc + j, x8 = 8 * j + r;
            memcpy(sg + 4 * (unpack ? plain : x8), buf + 4 * (unpack ? x8 : plain), 4);
        }
}

/*
 * Interleave (unpack 0) or restore (unpack 1), in place, the NF4 matrices [R, K] of E experts: expert e's codes at
 * base + e * es + codes (R * K / 2 bytes, two codes a byte, the first in the high nibble), its fp32 scales at
 * base + e * es + scales (R * K / bs, one per bs values of the flattened matrix) -> T_NF4X8's groups of 8 rows (R a
 * multiple of 8, bs a multiple of 32 dividing K). Returns 0 or an error.
 */
int clover_x8_nf4_pack(uint8_t *base, int64_t E, int64_t es, int64_t codes, int64_t scales, int64_t R, int64_t K,
                       int64_t bs, int unpack, int nth) {
    if (E < 0 || R % 8 || K <= 0 || K % QS || bs <= 0 || bs % QS || K % bs) return ERR_SHAPE;
    const int64_t G = E * (R / 8), cb = 8 * K / 2, nsc = K / bs; /* code bytes a group, scales a row */
    int rc = OK;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, G)) schedule(static)
    for (int64_t t = 0; t < G; t++) {
        uint8_t *row0 = base + t / (R / 8) * es, *grp = row0 + codes + t % (R / 8) * cb;
        uint8_t *sg = row0 + scales + t % (R / 8) * 8 * nsc * 4;
        uint8_t *buf = (uint8_t *)malloc((size_t)(cb + 32 * nsc));
        if (!buf) {
            rc = ERR_ALLOC;
            continue;
        }
        memcpy(buf, grp, (size_t)cb);
        memcpy(buf + cb, sg, (size_t)(32 * nsc));
        memset(grp, 0, (size_t)cb);
        for (int r = 0; r < 8; r++)
            for (int64_t v = 0; v < K; v++) { /* value v of row r: plain byte r K / 2 + v / 2, high nibble when even */
                const int64_t c = v / QS, l = v % QS, quad = l / 4;
                const int64_t at = 128 * c + 32 * (quad % 4) + 4 * r + l % 4, pl = r * K / 2 + v / 2;
                const int xsh = quad < 4 ? 0 : 4, psh = v % 2 ? 0 : 4;
                if (unpack) grp[pl] |= (uint8_t)(((buf[at] >> xsh) & 15) << psh);
                else grp[at] |= (uint8_t)(((buf[pl] >> psh) & 15) << xsh);
            }
        x8_scales_move(sg, buf + cb, nsc, unpack);
        free(buf);
    }
    return rc;
}

/*
 * Interleave (unpack 0) or restore (unpack 1), in place, one INT8 matrix [R, K] (T_I8 -> T_I8X8): its codes (R K
 * bytes, row-major) and its fp32 scales (R K / bs, one per bs values of the flattened matrix; one a row: bs = K),
 * R a multiple of 8, bs a multiple of 32 dividing K. Returns 0 or an error.
 */
int clover_x8_i8_pack(uint8_t *codes, float *scales, int64_t R, int64_t K, int64_t bs, int unpack, int nth) {
    if (R < 0 || R % 8 || K <= 0 || K % QS || bs <= 0 || bs % QS || K % bs) return ERR_SHAPE;
    const int64_t G = R / 8, nsc = K / bs;
    int rc = OK;
    (void)nth;
#pragma omp parallel for num_threads(threads_for(nth, G)) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        uint8_t *grp = codes + g * 8 * K;
        uint8_t *sg = (uint8_t *)(scales + g * 8 * nsc);
        uint8_t *buf = (uint8_t *)malloc((size_t)(8 * K + 32 * nsc));
        if (!buf) {
            rc = ERR_ALLOC;
            continue;
        }
        memcpy(buf, grp, (size_t)(8 * K));
        memcpy(buf + 8 * K, sg, (size_t)(32 * nsc));
        for (int r = 0; r < 8; r++)
            for (int64_t v = 0; v < K; v++) { /* value v of row r: plain r K + v, interleaved 256 c + 32 (l / 4) + 4 r + l % 4 */
                const int64_t l = v % QS, x8 = 256 * (v / QS) + 32 * (l / 4) + 4 * r + l % 4, plain = r * K + v;
                grp[unpack ? plain : x8] = buf[unpack ? x8 : plain];
            }
        x8_scales_move(sg, buf + 8 * K, nsc, unpack);
        free(buf);
    }
    return rc;
}
