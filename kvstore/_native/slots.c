/*
 * Slot staging and verification for kvstore.io.slots (CPU): the per-byte work of a put
 * (header build, CRC32C, copy into the arena) and of a get (header checks, CRC32C, copy
 * out), a whole chunk of slots per call.  Plain C, no Python headers: loaded with ctypes
 * (kvstore/io/native_slots.py), which releases the GIL for the duration of every call, so a
 * chunk is staged or verified in parallel with the event loop and other threads.
 *
 * The slot header layout is FORMAT.md, "Slot" (kvstore/disk/format.py, SlotHeader, is the
 * reference implementation; tests/io/test_native_slots.py holds this file to it byte for
 * byte):
 *
 *   0x00 magic "KVSB" | 0x04 u16 version | 0x06 u16 header_len (256) | 0x08 key[16]
 *   0x18 parent[16] | 0x28 u8 flags | 0x29 u8 codec | 0x2a u8 dtype | 0x2b u8 ndim
 *   0x2c u32 payload_crc | 0x30 u64 payload_len | 0x38 u64 raw_len | 0x40 u64 seq
 *   0x48 u64 shape[8] | 0x88 zeros | 0xfc u32 header_crc = CRC32C of [0x00, 0xfc)
 *
 * All integers little-endian; this file assumes a little-endian host (every platform
 * kvstore supports; checked at compile time).
 *
 * CRC32C (Castagnoli, reflected polynomial 0x82f63b78, initial and final XOR 0xffffffff,
 * the `crc32c` package's convention, continuable: crc(b, crc(a)) == crc(a + b)), by one
 * of three paths, chosen once when kvstore/io/native_slots.py loads the library
 * (kvs_crc32c_select: the faster of the two hardware paths on 64 KiB, timed there and
 * then, or the one KVSTORE_CRC32C names):
 *   - "crc32" (x86-64 with SSE4.2): the crc32 instruction on three independent streams
 *     (latency 3, throughput 1 per cycle on Intel), combined with precomputed
 *     "append N zero bytes" tables (Mark Adler's method);
 *   - "pclmul" (x86-64 with PCLMULQDQ and SSE4.2): carry-less multiplication folds four
 *     128-bit lanes over 64-byte strides, then into one 128-bit value, which the crc32
 *     instruction reduces (Intel's "Fast CRC Computation for Generic Polynomials Using
 *     PCLMULQDQ Instruction", reflected form; kvstore/_native/crc32c_constants.py
 *     derives the constants and checks the method).  Faster where crc32 does not
 *     pipeline: Zen 1's takes 3 cycles per 8 bytes whatever the interleaving;
 *   - "table" (anywhere): slicing-by-8 tables.
 * Buffers under PCLMUL_MIN bytes, the bytes before the first 16-byte boundary and the
 * last < 16 go through the crc32 path.  Every path can copy while it checksums (one
 * trip through memory, see crc32c() below): "pclmul" stores each 16 bytes it folds
 * (a single stream: 2.3x faster than copy-then-checksum here); the others copy a
 * cache-sized block, then checksum it from cache.  A word-by-word fused loop (load,
 * crc, store) measured 6x slower than that for "crc32": the stores of three streams
 * 8 KiB apart stall the loads.
 */
#define _POSIX_C_SOURCE 199309L      /* clock_gettime, for the calibration */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvstore's slot code assumes a little-endian host"
#endif

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define KVS_X86 1
#include <nmmintrin.h>
#include <wmmintrin.h>
#else
#define KVS_X86 0
#endif

#define KVS_SLOTS_ABI_VERSION 3

#define POLY 0x82f63b78u
#define HEADER_BYTES 256
#define HEADER_CRC_AT 252
#define FORMAT_VERSION 1
#define MAX_NDIM 8
#define FLAG_HAS_PARENT 0x01
#define CODEC_RAW 0

/* ------------------------------------------------------------------ CRC32C tables */

static uint32_t slice8[8][256];        /* software CRC, slicing-by-8 */
#define LONG_BLOCK 8192                 /* hardware CRC: three streams of this many bytes */
#define SHORT_BLOCK 256                 /* ... and of this many for the tail */
static uint32_t zeros_long[4][256];    /* crc -> crc after LONG_BLOCK zero bytes */
static uint32_t zeros_short[4][256];
static int have_hw;                    /* SSE4.2: the crc32 instruction */
static int have_pclmul;                /* PCLMULQDQ as well */

/* The CRC paths; the numbers are the `path` argument of the exported functions. */
enum { CRC_SELECTED = 0, CRC_TABLE = 1, CRC_CRC32 = 2, CRC_PCLMUL = 3, CRC_PATHS = 4 };
static int crc_path = CRC_TABLE;       /* the path CRC_SELECTED means */
static double calibrated[CRC_PATHS];   /* GB/s each path measured at selection, 0 = not */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The linear operator "append len zero bytes" on a raw CRC register (len a power of
 * two >= 1): squares the one-zero-bit operator until it covers len bytes. */
static void zeros_operator(uint32_t *even, size_t len) {
    uint32_t odd[32];
    odd[0] = POLY;
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd);              /* two zero bits */
    gf2_square(odd, even);              /* four zero bits */
    do {
        gf2_square(even, odd);          /* one byte, then 4, 16, ... */
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);          /* 2 bytes, then 8, 32, ... */
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof odd);
}

static void zeros_table(uint32_t table[4][256], size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        table[0][n] = gf2_times(op, n);
        table[1][n] = gf2_times(op, n << 8);
        table[2][n] = gf2_times(op, n << 16);
        table[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(const uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
           table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

static void init_tables(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ POLY : crc >> 1;
        slice8[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = slice8[0][n];
        for (int k = 1; k < 8; k++) {
            crc = slice8[0][crc & 0xff] ^ (crc >> 8);
            slice8[k][n] = crc;
        }
    }
    zeros_table(zeros_long, LONG_BLOCK);
    zeros_table(zeros_short, SHORT_BLOCK);
#if KVS_X86
    __builtin_cpu_init();
    have_hw = !!__builtin_cpu_supports("sse4.2");
    have_pclmul = have_hw && __builtin_cpu_supports("pclmul");
#endif
    crc_path = have_hw ? CRC_CRC32 : CRC_TABLE;   /* until kvs_crc32c_select chooses */
}

#if defined(__GNUC__) || defined(__clang__)
__attribute__((constructor))
#endif
static void kvs_slots_init(void) { init_tables(); }

static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* ------------------------------------------------------------------ software CRC */

/* crc over src[0, len) on the raw (pre-inverted) register. */
static uint32_t crc_sw(uint32_t crc, const uint8_t *src, size_t len) {
    while (len && ((uintptr_t)src & 7)) {
        crc = slice8[0][(crc ^ *src++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        const uint64_t w = load64(src) ^ crc;
        crc = slice8[7][w & 0xff] ^ slice8[6][(w >> 8) & 0xff] ^
              slice8[5][(w >> 16) & 0xff] ^ slice8[4][(w >> 24) & 0xff] ^
              slice8[3][(w >> 32) & 0xff] ^ slice8[2][(w >> 40) & 0xff] ^
              slice8[1][(w >> 48) & 0xff] ^ slice8[0][w >> 56];
        src += 8;
        len -= 8;
    }
    while (len--) crc = slice8[0][(crc ^ *src++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* ------------------------------------------------------------------ hardware CRC */

#if KVS_X86
/* Three streams of BLOCK bytes at once, then the first two are shifted past the bytes
 * of the next and combined.  BLOCK is a compile-time constant in each expansion. */
#define HW_STREAMS(BLOCK, TABLE)                                                    \
    while (len >= 3 * (size_t)(BLOCK)) {                                            \
        uint64_t c1 = 0, c2 = 0;                                                    \
        const uint8_t *end = src + (BLOCK);                                         \
        do {                                                                        \
            c0 = _mm_crc32_u64(c0, load64(src));                                    \
            c1 = _mm_crc32_u64(c1, load64(src + (BLOCK)));                          \
            c2 = _mm_crc32_u64(c2, load64(src + 2 * (BLOCK)));                      \
            src += 8;                                                               \
        } while (src < end);                                                        \
        c0 = shift(TABLE, (uint32_t)c0) ^ (uint32_t)c1;                             \
        c0 = shift(TABLE, (uint32_t)c0) ^ (uint32_t)c2;                             \
        src += 2 * (BLOCK);                                                         \
        len -= 3 * (size_t)(BLOCK);                                                 \
    }

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *src, size_t len) {
    uint64_t c0 = crc;
    while (len && ((uintptr_t)src & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *src++);
        len--;
    }
    HW_STREAMS(LONG_BLOCK, zeros_long)
    HW_STREAMS(SHORT_BLOCK, zeros_short)
    while (len >= 8) {
        c0 = _mm_crc32_u64(c0, load64(src));
        src += 8;
        len -= 8;
    }
    while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *src++);
    return (uint32_t)c0;
}

/* Folding constants, reflected: {x^(D+31) mod P, x^(D-33) mod P} for a fold over D bits
 * (kvstore/_native/crc32c_constants.py prints them; a test checks they agree). */
#define FOLD_512_H 0x740eef02u
#define FOLD_512_L 0x9e4addf8u
#define FOLD_128_H 0xf20c0dfeu
#define FOLD_128_L 0x493c7d27u
/* Shortest buffer the folding path takes: below it the crc32 path's fixed costs are
 * lower (folding loads constants, aligns, folds four lanes into one, reduces).  On Zen 1
 * folding is ahead from ~96 bytes (128: 6.0 vs 4.1 GB/s aligned, equal 5 bytes off). */
#define PCLMUL_MIN 128
_Static_assert(PCLMUL_MIN - 15 >= 64, "the folding path needs 64 bytes after aligning");

/* x moved forward past the bits of the block the constants k are for, XORed into y:
 * low quadword (top 64 coefficients) times k's low, high quadword times k's high. */
__attribute__((target("pclmul,sse4.2")))
static inline __m128i fold(__m128i x, __m128i k, __m128i y) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), y);
}

/* The 16 bytes at src, also stored at dst unless it is NULL (the copying variant). */
__attribute__((target("pclmul,sse4.2")))
static inline __m128i take(const uint8_t *src, uint8_t *dst, size_t at) {
    const __m128i v = _mm_load_si128((const __m128i *)(src + at));
    if (dst != NULL) _mm_storeu_si128((__m128i *)(dst + at), v);
    return v;
}

/* crc over src[0, len), copying it to dst unless that is NULL.  The copy is made from
 * the very registers that are folded (so the CRC is of the bytes written, as in
 * crc32c() below) in the same pass: no second trip through the cache. */
__attribute__((target("pclmul,sse4.2"), always_inline))
static inline uint32_t pclmul_body(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t len) {
    if (len < PCLMUL_MIN) {
        if (dst == NULL) return crc_hw(crc, src, len);
        memcpy(dst, src, len);
        return crc_hw(crc, dst, len);
    }
    const size_t lead = (size_t)(-(uintptr_t)src & 15);
    if (dst != NULL) {
        memcpy(dst, src, lead);
        crc = crc_hw(crc, dst, lead);
        dst += lead;
    } else {
        crc = crc_hw(crc, src, lead);
    }
    src += lead;
    len -= lead;
    /* The register enters the division as the message's first 32 bits do. */
    __m128i x0 = _mm_xor_si128(take(src, dst, 0), _mm_cvtsi32_si128((int)crc));
    __m128i x1 = take(src, dst, 16);
    __m128i x2 = take(src, dst, 32);
    __m128i x3 = take(src, dst, 48);
    size_t i = 64;
    const __m128i k512 = _mm_set_epi64x(FOLD_512_L, FOLD_512_H);
    for (; i + 64 <= len; i += 64) {
        x0 = fold(x0, k512, take(src, dst, i));
        x1 = fold(x1, k512, take(src, dst, i + 16));
        x2 = fold(x2, k512, take(src, dst, i + 32));
        x3 = fold(x3, k512, take(src, dst, i + 48));
    }
    const __m128i k128 = _mm_set_epi64x(FOLD_128_L, FOLD_128_H);
    __m128i x = fold(fold(fold(x0, k128, x1), k128, x2), k128, x3);
    for (; i + 16 <= len; i += 16) x = fold(x, k128, take(src, dst, i));
    /* x == the message so far (mod P): its raw CRC from a zero register is theirs. */
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
    if (dst == NULL) return crc_hw((uint32_t)c, src + i, len - i);
    memcpy(dst + i, src + i, len - i);
    return crc_hw((uint32_t)c, dst + i, len - i);
}

__attribute__((target("pclmul,sse4.2")))
static uint32_t crc_pclmul(uint32_t crc, const uint8_t *src, size_t len) {
    return pclmul_body(crc, src, NULL, len);
}

__attribute__((target("pclmul,sse4.2")))
static uint32_t crc_pclmul_copy(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t len) {
    return pclmul_body(crc, src, dst, len);
}
#endif

/* Whether this CPU runs `path` (CRC_SELECTED: always). */
static int path_supported(int path) {
    switch (path) {
    case CRC_SELECTED: case CRC_TABLE: return 1;
    case CRC_CRC32: return have_hw;
    case CRC_PCLMUL: return have_pclmul;
    default: return 0;
    }
}

/* crc over src[0, len) on the raw (pre-inverted) register, by `path` (one this CPU
 * supports: the exported functions check). */
static inline uint32_t crc_raw(uint32_t crc, const uint8_t *src, size_t len, int path) {
    if (path == CRC_SELECTED) path = crc_path;
#if KVS_X86
    if (path == CRC_PCLMUL) return crc_pclmul(crc, src, len);
    if (path == CRC_CRC32) return crc_hw(crc, src, len);
#endif
    return crc_sw(crc, src, len);
}

/* Copy granule of the fused copy + CRC: small enough to stay in L1/L2 between the copy
 * and the checksum, large enough for three full hardware streams. */
#define COPY_BLOCK (3 * LONG_BLOCK)

/* Finished CRC32C of src (continuing `crc`, a finished value as the crc32c package takes
 * it).  With dst, the bytes are also copied there, in the folding loop itself or a
 * cache-sized block at a time, and the CRC is taken over the copy (the registers
 * stored, or the block while it is still in cache): one trip through memory, and the
 * checksum is of exactly the bytes written, so a caller changing its tensor meanwhile
 * cannot make the header and the staged payload disagree. */
static uint32_t crc32c(uint32_t crc, const uint8_t *src, uint8_t *dst, size_t len, int path) {
    crc = ~crc;
    if (dst == NULL) return ~crc_raw(crc, src, len, path);
#if KVS_X86
    if ((path == CRC_SELECTED ? crc_path : path) == CRC_PCLMUL)
        return ~crc_pclmul_copy(crc, src, dst, len);
#endif
    for (size_t off = 0; off < len; off += COPY_BLOCK) {
        const size_t m = len - off < COPY_BLOCK ? len - off : COPY_BLOCK;
        memcpy(dst + off, src + off, m);
        crc = crc_raw(crc, dst + off, m, path);
    }
    return ~crc;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ------------------------------------------------------------------ exported API */

int kvs_slots_abi_version(void) { return KVS_SLOTS_ABI_VERSION; }

/* The path CRC_SELECTED means: CRC_TABLE, CRC_CRC32 or CRC_PCLMUL. */
int kvs_crc32c_path(void) { return crc_path; }

/* Whether this CPU runs `path`. */
int kvs_crc32c_supported(int path) { return path_supported(path); }

/* Seconds `calls` back-to-back CRCs (with copies to dst, unless NULL) of len bytes take
 * by `path`: the calibration's clock, and the benchmark's (benchmarks/crc_speed.py), free
 * of the Python call's overhead.  -1 when this CPU does not run `path`. */
double kvs_crc32c_time(int path, const void *buf, void *dst, size_t len, int64_t calls) {
    if (!path_supported(path)) return -1.0;
    volatile uint32_t sink = 0;
    const double t0 = now();
    for (int64_t i = 0; i < calls; i++)
        sink = crc32c(sink, (const uint8_t *)buf, (uint8_t *)dst, len, path);
    return now() - t0;
}

#define CALIBRATE_BYTES 65536
#define CALIBRATE_ROUNDS 5

/* Make `path` the one the kernels use (CRC_SELECTED: calibrate, i.e. the faster of the
 * two hardware paths on CALIBRATE_BYTES, best of CALIBRATE_ROUNDS alternating runs
 * each: ~0.2 ms on Zen 1, since the crc32 path depends on the CPU model more than its
 * flags).  Returns the path now in use, or -1 (nothing changed) if the CPU lacks it. */
int kvs_crc32c_select(int path) {
    if (!path_supported(path)) return -1;
    memset(calibrated, 0, sizeof calibrated);
    if (path != CRC_SELECTED) return crc_path = path;
    crc_path = have_hw ? CRC_CRC32 : CRC_TABLE;
    uint8_t *buf = have_pclmul ? malloc(CALIBRATE_BYTES) : NULL;
    if (buf == NULL) return crc_path;
    for (size_t i = 0; i < CALIBRATE_BYTES; i++) buf[i] = (uint8_t)(i * 2654435761u >> 13);
    double best[CRC_PATHS] = {0};
    for (int round = 0; round < CALIBRATE_ROUNDS; round++) {
        for (int p = CRC_CRC32; p <= CRC_PCLMUL; p++) {
            const double t = kvs_crc32c_time(p, buf, NULL, CALIBRATE_BYTES, 1);
            if (round == 0 || t < best[p]) best[p] = t;
        }
    }
    free(buf);
    for (int p = CRC_CRC32; p <= CRC_PCLMUL; p++)
        calibrated[p] = best[p] > 0 ? CALIBRATE_BYTES / best[p] / 1e9 : 0;
    return crc_path = best[CRC_PCLMUL] < best[CRC_CRC32] ? CRC_PCLMUL : CRC_CRC32;
}

/* GB/s `path` measured when kvs_crc32c_select last calibrated (0: not measured). */
double kvs_crc32c_calibrated(int path) {
    return path >= 0 && path < CRC_PATHS ? calibrated[path] : 0.0;
}

/* CRC32C of buf continuing `crc` (0 to start), like crc32c.crc32c(buf, crc), by `path`
 * (CRC_SELECTED: the selected one; others for tests and benchmarks; one the CPU lacks
 * falls back to the table path). */
uint32_t kvs_crc32c(uint32_t crc, const void *buf, size_t len, int path) {
    return crc32c(crc, (const uint8_t *)buf, NULL, len, path_supported(path) ? path : CRC_TABLE);
}

/* Same as kvs_crc32c, copying buf to dst (not overlapping) in the same pass. */
uint32_t kvs_crc32c_copy(uint32_t crc, const void *buf, void *dst, size_t len, int path) {
    return crc32c(crc, (const uint8_t *)buf, (uint8_t *)dst, len,
                  path_supported(path) ? path : CRC_TABLE);
}

/* One slot of a batch, filled by kvstore/io/native_slots.py (_DESC there mirrors it:
 * 160 bytes, natural alignment, no implicit padding). */
typedef struct {
    uint64_t slot;          /* address of the slot's first byte (in the arena) */
    uint64_t data;          /* stage: payload source, 0 = payload already at slot + 256;
                               verify: destination of the payload, 0 = verify only */
    uint64_t slot_len;      /* stage: bytes of the slot (zero-filled after the payload);
                               verify: bytes readable at `slot` */
    uint64_t payload_len;   /* stage: header value; verify: expected (index entry) */
    uint64_t raw_len;       /* stage: header value; verify: in: bytes at `data`; out: header */
    uint64_t seq;           /* stage: header value; verify: expected in, header's out */
    uint64_t shape[8];      /* stage: header dims (ndim used); verify out: header dims */
    uint8_t key[16];        /* stage: header key; verify: expected in, header's out */
    uint8_t parent[16];     /* stage: header parent (flags bit 0); verify out: header's */
    uint8_t flags;          /* stage in / verify out */
    uint8_t codec;          /* stage: header; verify: expected in, header's out */
    uint8_t dtype;          /* stage: header; verify: expected in, header's out */
    uint8_t ndim;           /* stage in / verify out */
    uint32_t crc;           /* stage out: payload CRC; verify: expected in, header's out */
    int32_t status;         /* out: KVS_OK or a KVS_E* code */
    uint32_t options;       /* verify in: KVS_FRESH_DST; out: KVS_COPIED */
} kvs_slot;

_Static_assert(sizeof(kvs_slot) == 160, "kvs_slot layout is shared with native_slots.py");

enum {
    KVS_OK = 0,
    KVS_EARGS = 1,              /* stage: payload does not fit the slot, ndim > 8 */
    KVS_EHDR_TRUNCATED = 2,     /* verify: fewer than 256 readable bytes */
    KVS_EMAGIC = 3,
    KVS_EHDR_CRC = 4,
    KVS_EVERSION = 5,
    KVS_EHDR_LEN = 6,           /* header_len != 256 or ndim > 8 */
    KVS_EUNKNOWN = 7,           /* codec or dtype this build does not know */
    KVS_EOTHER_BLOCK = 8,       /* the key differs from the one looked up */
    KVS_EENTRY = 9,             /* seq, payload_len, payload_crc, dtype or codec differ
                                   from the index entry */
    KVS_EPAYLOAD_TRUNCATED = 10,/* the payload runs past the readable bytes */
    KVS_EPAYLOAD_CRC = 11,
};

enum { KVS_FRESH_DST = 1, KVS_COPIED = 2 };

static inline void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Stage n slots: copy each payload into its slot (or checksum it in place), zero the
 * padding, write the header.  Returns the number of slots refused (status != 0); a
 * refused slot's bytes are left as they were. */
int64_t kvs_stage(kvs_slot *slots, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        kvs_slot *s = &slots[i];
        uint8_t *slot = (uint8_t *)(uintptr_t)s->slot;
        if (s->ndim > MAX_NDIM || s->slot_len < HEADER_BYTES ||
                s->payload_len > s->slot_len - HEADER_BYTES) {
            s->status = KVS_EARGS;
            bad++;
            continue;
        }
        uint8_t *body = slot + HEADER_BYTES;
        const size_t n_payload = (size_t)s->payload_len;
        s->crc = s->data
            ? crc32c(0, (const uint8_t *)(uintptr_t)s->data, body, n_payload, CRC_SELECTED)
            : crc32c(0, body, NULL, n_payload, CRC_SELECTED);
        memset(body + n_payload, 0, (size_t)(s->slot_len - HEADER_BYTES) - n_payload);

        uint8_t h[HEADER_BYTES];
        memset(h, 0, sizeof h);
        memcpy(h, "KVSB", 4);
        put16(h + 0x04, FORMAT_VERSION);
        put16(h + 0x06, HEADER_BYTES);
        memcpy(h + 0x08, s->key, 16);
        if (s->flags & FLAG_HAS_PARENT) memcpy(h + 0x18, s->parent, 16);
        h[0x28] = s->flags & FLAG_HAS_PARENT;
        h[0x29] = s->codec;
        h[0x2a] = s->dtype;
        h[0x2b] = s->ndim;
        put32(h + 0x2c, s->crc);
        put64(h + 0x30, s->payload_len);
        put64(h + 0x38, s->raw_len);
        put64(h + 0x40, s->seq);
        for (int d = 0; d < s->ndim; d++) put64(h + 0x48 + 8 * d, s->shape[d]);
        put32(h + HEADER_CRC_AT, crc32c(0, h, NULL, HEADER_CRC_AT, CRC_SELECTED));
        memcpy(slot, h, sizeof h);
        s->status = KVS_OK;
    }
    return bad;
}

/* Verify one slot read back; fills the header fields into s as it parses them. */
static int32_t verify_one(kvs_slot *s, const uint8_t known_codec[256],
                          const uint8_t known_dtype[256]) {
    const uint8_t *slot = (const uint8_t *)(uintptr_t)s->slot;
    if (s->slot_len < HEADER_BYTES) return KVS_EHDR_TRUNCATED;
    if (memcmp(slot, "KVSB", 4) != 0) return KVS_EMAGIC;
    if (crc32c(0, slot, NULL, HEADER_CRC_AT, CRC_SELECTED) != get32(slot + HEADER_CRC_AT))
        return KVS_EHDR_CRC;
    if (get16(slot + 0x04) != FORMAT_VERSION) return KVS_EVERSION;
    const uint8_t ndim = slot[0x2b];
    if (get16(slot + 0x06) != HEADER_BYTES || ndim > MAX_NDIM) return KVS_EHDR_LEN;

    const uint64_t want_payload = s->payload_len, want_seq = s->seq, capacity = s->raw_len;
    const uint32_t want_crc = s->crc;
    const uint8_t want_dtype = s->dtype, want_codec = s->codec;
    uint8_t want_key[16];
    memcpy(want_key, s->key, 16);
    /* Report the header's fields (the Python side builds its result or message). */
    memcpy(s->key, slot + 0x08, 16);
    memcpy(s->parent, slot + 0x18, 16);
    s->flags = slot[0x28];
    s->codec = slot[0x29];
    s->dtype = slot[0x2a];
    s->ndim = ndim;
    s->crc = get32(slot + 0x2c);
    s->payload_len = get64(slot + 0x30);
    s->raw_len = get64(slot + 0x38);
    s->seq = get64(slot + 0x40);
    for (int d = 0; d < MAX_NDIM; d++) s->shape[d] = d < ndim ? get64(slot + 0x48 + 8 * d) : 0;

    if (!known_codec[s->codec] || !known_dtype[s->dtype]) return KVS_EUNKNOWN;
    if (memcmp(s->key, want_key, 16) != 0) return KVS_EOTHER_BLOCK;
    if (s->seq != want_seq || s->payload_len != want_payload || s->crc != want_crc ||
            s->dtype != want_dtype || s->codec != want_codec)
        return KVS_EENTRY;
    if (s->payload_len > s->slot_len - HEADER_BYTES) return KVS_EPAYLOAD_TRUNCATED;

    const uint8_t *payload = slot + HEADER_BYTES;
    const size_t n = (size_t)s->payload_len;
    uint8_t *dst = (uint8_t *)(uintptr_t)s->data;
    if (dst == NULL || s->codec != CODEC_RAW || capacity != n) {
        /* Encoded payloads are decoded by the caller, straight from the arena. */
        return crc32c(0, payload, NULL, n, CRC_SELECTED) == s->crc ? KVS_OK : KVS_EPAYLOAD_CRC;
    }
    if (s->options & KVS_FRESH_DST) {
        /* Nobody sees dst unless this succeeds: copy and checksum in one pass. */
        s->options |= KVS_COPIED;
        return crc32c(0, payload, dst, n, CRC_SELECTED) == s->crc ? KVS_OK : KVS_EPAYLOAD_CRC;
    }
    /* The caller's own buffer: never write unverified bytes into it. */
    if (crc32c(0, payload, NULL, n, CRC_SELECTED) != s->crc) return KVS_EPAYLOAD_CRC;
    memcpy(dst, payload, n);
    s->options |= KVS_COPIED;
    return KVS_OK;
}

/* Verify n slots read back against their index entries; raw payloads with a destination
 * are copied there.  known_codec / known_dtype: 256 flags each, non-zero for the ids
 * this build decodes.  Returns the number of slots that failed (status != 0). */
int64_t kvs_verify(kvs_slot *slots, int64_t n, const uint8_t *known_codec,
                   const uint8_t *known_dtype) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        slots[i].status = verify_one(&slots[i], known_codec, known_dtype);
        bad += slots[i].status != KVS_OK;
    }
    return bad;
}
