/*
 * FP8 codec kernels for kvstore.codecs.pipeline (CPU).  Plain C, no Python headers: loaded with
 * ctypes, which releases the GIL for the duration of every call.
 *
 * The algorithm is the one in kvstore/codecs/pipeline.py's module docstring; this file only makes
 * its element-wise steps fast.  Python keeps the per-group scale logic (small arrays) and
 * calls three row kernels.  A "row" is one vector along the last axis (head_dim); k[r] is
 * the scale exponent of row r, already expanded from its group.
 *
 *   kvs_row_amax   largest finite |x| per row, and whether any NaN/Inf was seen
 *   kvs_encode     y = float32(x) * 2**k (exact), code = fp8(y), IEEE round-to-nearest-even
 *   kvs_decode     x' = dtype(float32(fp8 value) * 2**-k), one rounding
 *
 * Why the results are bit-identical to the torch reference path:
 *   - amax compares absolute values as integers: for non-negative IEEE floats the order of
 *     the bit patterns is the order of the values, and a pattern below the infinity
 *     pattern is finite.
 *   - multiplying by a power of two is exact in float32 wherever the FP8 result can be
 *     non-zero (the scale keeps |y| <= 448 / 57344), so the product equals torch's.
 *   - float32 -> FP8 rounds the mantissa with the usual "add half minus one plus the lsb"
 *     integer trick on normal results, and lets the FPU round subnormal results by adding
 *     a constant whose ulp is the FP8 subnormal step (2**-9 E4M3, 2**-16 E5M2).  Special
 *     values follow torch 2.13: E4M3FN saturates everything above 448 (Inf included) to
 *     +-448, E5M2 rounds to +-Inf past 57344; every NaN becomes 0x7F.
 *   - decoding multiplies the exact FP8 value by 2**-k in float32 (exact: the smallest
 *     product is 2**-135, a float32 subnormal with room to spare) and rounds once into the
 *     output type.  NaN codes decode to the output type's canonical quiet NaN.
 * tests/test_codecs_native.py checks all of this exhaustively against torch.
 *
 * Never compile with -ffast-math: the subnormal rounding relies on IEEE addition.
 * -fno-trapping-math is safe (nothing here reads the FP exception flags) and needed: it
 * lets GCC evaluate both arms of the normal/subnormal selects, i.e. vectorise the loops.
 * Hot loops are built twice (AVX2 and baseline x86-64) and picked at load time, so the
 * library never executes an instruction the CPU lacks.
 */
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVS_HOT __attribute__((target_clones("avx2", "default")))
#else
#define KVS_HOT
#endif

#define KVS_ABI_VERSION 2

enum { DT_F16 = 0, DT_BF16 = 1, DT_F32 = 2 };
enum { FMT_E4M3 = 1, FMT_E5M2 = 2 };

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* IEEE half -> float, exact for every pattern (Inf and NaN included), branch-free. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    /* Normal and special: re-bias the exponent by 2**112 via one exact multiply. */
    const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    /* Subnormal: place the mantissa under the exponent of 0.5 and subtract 0.5. */
    const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t bits = two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized);
    return u2f(sign | bits);
}

/* float -> IEEE half with round-to-nearest-even; finite or infinite input (NaN is
 * handled by the caller).  The FPU does the rounding: scaling by 2**112 then 2**-110
 * moves the value so that adding 2**(e+..) drops exactly the bits half cannot hold. */
static inline uint16_t f32_to_f16(float f) {
    float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f2u(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f2u(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | nonsign);
}

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f2u(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* float32 -> FP8 for a finite y within the format's range, the case of every element
 * of a block without NaN/Inf (the scale guarantees the range). */
static inline uint32_t f32_to_e4m3_finite(float y) {
    const uint32_t u = f2u(y);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    /* Normal results (|y| >= 2**-6): round 23 mantissa bits to 3, re-bias 127 -> 7. */
    const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
    const uint32_t normal = (r >> 20) - (120u << 3);
    /* Subnormal results: 16384.0f has ulp 2**-9, the E4M3 subnormal step. */
    const uint32_t sub = f2u(u2f(a) + 16384.0f) - 0x46800000u;
    const uint32_t code = a < 0x3C800000u ? sub : normal;
    return code | sign;
}

static inline uint32_t f32_to_e5m2_finite(float y) {
    const uint32_t u = f2u(y);
    const uint32_t sign = (u >> 24) & 0x80u;
    const uint32_t a = u & 0x7FFFFFFFu;
    /* Normal results (|y| >= 2**-14): round to 2 mantissa bits, re-bias 127 -> 15. */
    const uint32_t r = a + 0xFFFFFu + ((a >> 21) & 1u);
    const uint32_t normal = (r >> 21) - (112u << 2);
    /* Subnormal results: 128.0f has ulp 2**-16, the E5M2 subnormal step. */
    const uint32_t sub = f2u(u2f(a) + 128.0f) - 0x43000000u;
    const uint32_t code = a < 0x38800000u ? sub : normal;
    return code | sign;
}

/* Any float32, special values included (twice as slow: two more selects). */
static inline uint32_t f32_to_e4m3(float y) {
    const uint32_t a = f2u(y) & 0x7FFFFFFFu;
    const uint32_t code = a > 0x43E00000u                     /* > 448 (and Inf): saturate */
        ? (0x7Eu | ((f2u(y) >> 24) & 0x80u)) : f32_to_e4m3_finite(y);
    return a > 0x7F800000u ? 0x7Fu : code;
}

static inline uint32_t f32_to_e5m2(float y) {
    const uint32_t a = f2u(y) & 0x7FFFFFFFu;
    const uint32_t code = a >= 0x47700000u                    /* >= 61440 rounds to Inf */
        ? (0x7Cu | ((f2u(y) >> 24) & 0x80u)) : f32_to_e5m2_finite(y);
    return a > 0x7F800000u ? 0x7Fu : code;
}

static inline float pow2f(int k) { return u2f((uint32_t)(127 + k) << 23); }

int kvs_abi_version(void) { return KVS_ABI_VERSION; }

/* ------------------------------------------------------------------ amax */

/* One max reduction of |x| per row (GCC vectorises a plain max, not a max of a select);
 * a row whose max is NaN/Inf -- rare -- is then redone skipping non-finite values.
 * Returns whether any row had one. */
#define AMAX_ROWS(T, ABS_MASK, INF)                                           \
    int special = 0;                                                          \
    for (int64_t r = 0; r < rows; r++) {                                      \
        const T *v = x + r * dim;                                             \
        T m = 0;                                                              \
        for (int64_t i = 0; i < dim; i++) {                                   \
            const T a = v[i] & (ABS_MASK);                                    \
            m = a > m ? a : m;                                                \
        }                                                                     \
        if (m >= (INF)) {                                                     \
            special = 1;                                                      \
            m = 0;                                                            \
            for (int64_t i = 0; i < dim; i++) {                               \
                const T a = v[i] & (ABS_MASK);                                \
                if (a < (INF) && a > m) m = a;                                \
            }                                                                 \
        }                                                                     \
        out[r] = m;                                                           \
    }                                                                         \
    return special;

KVS_HOT static int amax16(const uint16_t *x, int64_t rows, int64_t dim, uint16_t inf,
                          uint16_t *out) { AMAX_ROWS(uint16_t, 0x7FFFu, inf) }

KVS_HOT static int amax32(const uint32_t *x, int64_t rows, int64_t dim, uint32_t *out) {
    AMAX_ROWS(uint32_t, 0x7FFFFFFFu, 0x7F800000u) }

/* amax[r] = largest finite |x| of row r as float32 (0 if none).  Returns 1 when some
 * element is NaN or +-Inf, 0 otherwise, -1 for a bad argument. */
int kvs_row_amax(const void *x, int dtype, int64_t rows, int64_t dim, float *amax) {
    if (rows < 0 || dim <= 0) return -1;
    if (dtype == DT_F32) return amax32((const uint32_t *)x, rows, dim, (uint32_t *)amax);
    if (dtype != DT_F16 && dtype != DT_BF16) return -1;
    /* Reduce to 16-bit patterns in place at the front of `amax`, then widen from the end
     * so nothing is overwritten before it is read. */
    uint16_t *m16 = (uint16_t *)amax;
    const int special = amax16((const uint16_t *)x, rows, dim,
                               dtype == DT_F16 ? 0x7C00u : 0x7F80u, m16);
    for (int64_t r = rows - 1; r >= 0; r--) {
        const uint16_t m = m16[r];
        amax[r] = dtype == DT_F16 ? f16_to_f32(m) : u2f((uint32_t)m << 16);
    }
    return special;
}

/* ------------------------------------------------------------------ encode */

#define ENCODE_LOOP(LOAD, CONVERT)                                            \
    for (int64_t r = 0; r < rows; r++) {                                      \
        const float s = pow2f(k[r]);                                          \
        uint8_t *c = codes + r * dim;                                         \
        for (int64_t i = 0; i < dim; i++) {                                   \
            const int64_t j = r * dim + i;                                    \
            c[i] = (uint8_t)CONVERT(LOAD * s);                                \
        }                                                                     \
    }

#define LOAD_F16 f16_to_f32(((const uint16_t *)x)[j])
#define LOAD_BF16 u2f((uint32_t)((const uint16_t *)x)[j] << 16)
#define LOAD_F32 ((const float *)x)[j]

typedef void (*encode_fn)(const void *, int64_t, int64_t, const int8_t *, uint8_t *);

#define ENCODER(NAME, LOAD, CONVERT)                                          \
    KVS_HOT static void NAME(const void *x, int64_t rows, int64_t dim,        \
                             const int8_t *k, uint8_t *codes) {               \
        ENCODE_LOOP(LOAD, CONVERT)                                            \
    }

ENCODER(enc_f16_e4m3, LOAD_F16, f32_to_e4m3)
ENCODER(enc_bf16_e4m3, LOAD_BF16, f32_to_e4m3)
ENCODER(enc_f32_e4m3, LOAD_F32, f32_to_e4m3)
ENCODER(enc_f16_e5m2, LOAD_F16, f32_to_e5m2)
ENCODER(enc_bf16_e5m2, LOAD_BF16, f32_to_e5m2)
ENCODER(enc_f32_e5m2, LOAD_F32, f32_to_e5m2)
ENCODER(enc_f16_e4m3_finite, LOAD_F16, f32_to_e4m3_finite)
ENCODER(enc_bf16_e4m3_finite, LOAD_BF16, f32_to_e4m3_finite)
ENCODER(enc_f32_e4m3_finite, LOAD_F32, f32_to_e4m3_finite)
ENCODER(enc_f16_e5m2_finite, LOAD_F16, f32_to_e5m2_finite)
ENCODER(enc_bf16_e5m2_finite, LOAD_BF16, f32_to_e5m2_finite)
ENCODER(enc_f32_e5m2_finite, LOAD_F32, f32_to_e5m2_finite)

/* [finite][fmt - 1][dtype] */
static const encode_fn encoders[2][2][3] = {
    {{enc_f16_e4m3, enc_bf16_e4m3, enc_f32_e4m3}, {enc_f16_e5m2, enc_bf16_e5m2, enc_f32_e5m2}},
    {{enc_f16_e4m3_finite, enc_bf16_e4m3_finite, enc_f32_e4m3_finite},
     {enc_f16_e5m2_finite, enc_bf16_e5m2_finite, enc_f32_e5m2_finite}},
};

/* codes[r, i] = fp8(float32(x[r, i]) * 2**k[r]).  k must lie in [-126, 126].
 * `finite` != 0 promises that every x is finite and every |x * 2**k| is within the FP8
 * format's finite range -- true when k comes from the block's own amax and
 * kvs_row_amax found no NaN/Inf -- and selects the faster kernel.
 * Returns 0, or -1 for a bad argument. */
int kvs_encode(const void *x, int dtype, int fmt, int64_t rows, int64_t dim,
               const int8_t *k, uint8_t *codes, int finite) {
    if (rows < 0 || dim <= 0 || dtype < DT_F16 || dtype > DT_F32 ||
        (fmt != FMT_E4M3 && fmt != FMT_E5M2))
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (k[r] < -126 || k[r] > 126) return -1;
    encoders[finite != 0][fmt - 1][dtype](x, rows, dim, k, codes);
    return 0;
}

/* ------------------------------------------------------------------ decode */

/* Exact value of every code; NaN codes hold 0 and are patched by the is-NaN test. */
static float e4m3_values[256], e5m2_values[256];

static void build_tables(void) {
    for (int c = 0; c < 256; c++) {
        const float sign = (c & 0x80) ? -1.0f : 1.0f;
        int e = (c >> 3) & 0xF, m = c & 7;
        e4m3_values[c] = sign * (e ? (float)(8 + m) * pow2f(e - 10) : (float)m * 0x1.0p-9f);
        if ((c & 0x7F) == 0x7F) e4m3_values[c] = 0.0f;
        e = (c >> 2) & 0x1F, m = c & 3;
        e5m2_values[c] = sign * (e ? (float)(4 + m) * pow2f(e - 17) : (float)m * 0x1.0p-16f);
        if (e == 0x1F) e5m2_values[c] = m ? 0.0f : sign * __builtin_inff();
    }
}

__attribute__((constructor)) static void kvs_init(void) { build_tables(); }

/* Any code: exact value from the table, NaN codes replaced by the canonical NaN. */
#define DECODE_LOOP(TABLE, ISNAN, T, STORE, QNAN)                             \
    for (int64_t r = 0; r < rows; r++) {                                      \
        const float s = pow2f(-k[r]);                                         \
        const uint8_t *c = codes + r * dim;                                   \
        T *o = (T *)out + r * dim;                                            \
        for (int64_t i = 0; i < dim; i++) {                                   \
            const uint8_t code = c[i];                                        \
            const T v = STORE(TABLE[code] * s);                               \
            o[i] = ISNAN(code) ? (T)(QNAN) : v;                               \
        }                                                                     \
    }

/* Codes without NaN/Inf (payload flag bit 0 clear): the value comes from bits instead
 * of a table gather, which vectorises better.  E5M2 is float16's top byte; for E4M3
 * ((int8)code << 7) & 0xBF80 is a float16 holding value * 2**-8, subnormals included
 * (the two formats' exponent fields line up).  Both multiplies are exact. */
#define E4M3_VALUE(c) (f16_to_f32((uint16_t)(((uint32_t)(int8_t)(c) << 7) & 0xBF80u)) * 256.0f)
#define E5M2_VALUE(c) f16_to_f32((uint16_t)((uint32_t)(c) << 8))

#define DECODE_FINITE_LOOP(VALUE, T, STORE)                                   \
    for (int64_t r = 0; r < rows; r++) {                                      \
        const float s = pow2f(-k[r]);                                         \
        const uint8_t *c = codes + r * dim;                                   \
        T *o = (T *)out + r * dim;                                            \
        for (int64_t i = 0; i < dim; i++) o[i] = STORE(VALUE(c[i]) * s);      \
    }

#define E4M3_NAN(c) (((c) & 0x7F) == 0x7F)
#define E5M2_NAN(c) (((c) & 0x7F) > 0x7C)
#define STORE_F32_BITS(f) f2u(f)

typedef void (*decode_fn)(const uint8_t *, int64_t, int64_t, const int8_t *, void *);

#define DECODER(NAME, BODY)                                                   \
    KVS_HOT static void NAME(const uint8_t *codes, int64_t rows, int64_t dim, \
                             const int8_t *k, void *out) { BODY }

DECODER(dec_e4m3_f16, DECODE_LOOP(e4m3_values, E4M3_NAN, uint16_t, f32_to_f16, 0x7E00u))
DECODER(dec_e4m3_bf16, DECODE_LOOP(e4m3_values, E4M3_NAN, uint16_t, f32_to_bf16, 0x7FC0u))
DECODER(dec_e4m3_f32, DECODE_LOOP(e4m3_values, E4M3_NAN, uint32_t, STORE_F32_BITS, 0x7FC00000u))
DECODER(dec_e5m2_f16, DECODE_LOOP(e5m2_values, E5M2_NAN, uint16_t, f32_to_f16, 0x7E00u))
DECODER(dec_e5m2_bf16, DECODE_LOOP(e5m2_values, E5M2_NAN, uint16_t, f32_to_bf16, 0x7FC0u))
DECODER(dec_e5m2_f32, DECODE_LOOP(e5m2_values, E5M2_NAN, uint32_t, STORE_F32_BITS, 0x7FC00000u))
DECODER(dec_e4m3_f16_finite, DECODE_FINITE_LOOP(E4M3_VALUE, uint16_t, f32_to_f16))
DECODER(dec_e4m3_bf16_finite, DECODE_FINITE_LOOP(E4M3_VALUE, uint16_t, f32_to_bf16))
DECODER(dec_e4m3_f32_finite, DECODE_FINITE_LOOP(E4M3_VALUE, uint32_t, STORE_F32_BITS))
DECODER(dec_e5m2_f16_finite, DECODE_FINITE_LOOP(E5M2_VALUE, uint16_t, f32_to_f16))
DECODER(dec_e5m2_bf16_finite, DECODE_FINITE_LOOP(E5M2_VALUE, uint16_t, f32_to_bf16))
DECODER(dec_e5m2_f32_finite, DECODE_FINITE_LOOP(E5M2_VALUE, uint32_t, STORE_F32_BITS))

static const decode_fn decoders[2][2][3] = {
    {{dec_e4m3_f16, dec_e4m3_bf16, dec_e4m3_f32}, {dec_e5m2_f16, dec_e5m2_bf16, dec_e5m2_f32}},
    {{dec_e4m3_f16_finite, dec_e4m3_bf16_finite, dec_e4m3_f32_finite},
     {dec_e5m2_f16_finite, dec_e5m2_bf16_finite, dec_e5m2_f32_finite}},
};

/* out[r, i] = dtype(value(codes[r, i]) * 2**-k[r]).  k must lie in [-126, 126].
 * `finite` != 0 promises that no code is NaN/Inf (a corrupted promise yields wrong
 * numbers, never an out-of-bounds access).  Returns 0, or -1 for a bad argument. */
int kvs_decode(const uint8_t *codes, int fmt, int64_t rows, int64_t dim, const int8_t *k,
               void *out, int dtype, int finite) {
    if (rows < 0 || dim <= 0 || dtype < DT_F16 || dtype > DT_F32 ||
        (fmt != FMT_E4M3 && fmt != FMT_E5M2))
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (k[r] < -126 || k[r] > 126) return -1;
    decoders[finite != 0][fmt - 1][dtype](codes, rows, dim, k, out);
    return 0;
}
