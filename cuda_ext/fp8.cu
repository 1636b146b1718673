// FP8 quantize/dequantize, bit-identical to kvstore/codecs/pipeline.py (its module docstring is
// the specification; the step numbers below are its steps).
//
// Why the bits equal the CPU codec's:
// * amax (step 1) is a max over |x| of finite elements; for non-negative floats the
//   order of values is the order of their bit patterns, so it is taken on uint32 bits
//   (atomicMax on the device), exactly, with no rounding anywhere.
// * k (steps 2-3) is computed from amax's bits with integer operations only
//   (exponent_k), including float32-subnormal amax from bfloat16/float32 inputs.
// * y = float32(x) * 2**k (step 4) is one IEEE float32 multiply by a power of two built
//   from bits.  nvcc without --use_fast_math does not flush denormals (-ftz=false), so
//   the product is the same float the CPU computes (exact except below float32's
//   normal range, and then rounded the same IEEE way).
// * fp8(y) uses __nv_cvt_float_to_fp8 with __NV_SATFINITE: round-to-nearest-even on
//   every path (the sm_89+ cvt.rn.satfinite instruction and the header's software path
//   used for sm_80 and on the host).  Finite y never exceeds the largest FP8 value by
//   construction, so saturation only ever acts on infinities, and those (and NaN) are
//   settled before the conversion exactly as the codec specifies: NaN -> 0x7F, +-Inf ->
//   0x7E/0xFE in E4M3 (torch saturates), 0x7C/0xFC in E5M2; -0.0 keeps its sign.
// * Decoding builds the FP8 value as an exact float32 from the code's bits, multiplies by
//   2**-k (exact: the smallest result, 2**-9 * 2**-126, is a float32 subnormal that is
//   still representable with the code's 3 fraction bits) and rounds once into the output
//   dtype with the RNE intrinsics, the codec's "one round-to-nearest-even".
// The same __host__ __device__ functions run in the *_host entry points, so the CPU
// tests exercise the very element code that the kernels run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "kvcuda.h"

namespace {

constexpr int kThreads = 256;

__host__ __device__ inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

__host__ __device__ inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Exact 2**k for k in [-126, 127] (a normal float32 built from its bits).
__host__ __device__ inline float pow2f(int k) { return u2f(static_cast<uint32_t>(k + 127) << 23); }

__host__ __device__ inline int clz32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __clz(static_cast<int>(v));
#else
  return __builtin_clz(v);
#endif
}

__host__ __device__ inline float load(const void *x, int dtype, int64_t i) {
  if (dtype == KVC_F32) return static_cast<const float *>(x)[i];
  const uint16_t bits = static_cast<const uint16_t *>(x)[i];
  if (dtype == KVC_BF16) return u2f(static_cast<uint32_t>(bits) << 16);  // exact
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));  // exact, subnormals included
}

// NaN is written as the output type's canonical quiet NaN, whatever its sign and payload
// (kvstore/codecs/pipeline.py: float32 0x7FC00000, bfloat16 0x7FC0, float16 0x7E00).
__host__ __device__ inline void store(void *out, int dtype, int64_t i, float v) {
  if (v != v) {
    if (dtype == KVC_F32)
      static_cast<uint32_t *>(out)[i] = 0x7FC00000u;
    else
      static_cast<uint16_t *>(out)[i] = dtype == KVC_BF16 ? 0x7FC0u : 0x7E00u;
  } else if (dtype == KVC_F32) {
    static_cast<float *>(out)[i] = v;
  } else if (dtype == KVC_BF16) {
    __nv_bfloat16_raw r = __float2bfloat16_rn(v);
    static_cast<uint16_t *>(out)[i] = r.x;
  } else {
    __half_raw r = __float2half_rn(v);
    static_cast<uint16_t *>(out)[i] = r.x;
  }
}

__host__ __device__ inline int emax8(int fmt) { return fmt == KVC_E4M3 ? 8 : 15; }

// Steps 2-3: k from the bits of amax (>= 0, finite).
__host__ __device__ inline int exponent_k(uint32_t a, int fmt, int kmin, int kmax) {
  if (a == 0) return 0;
  int e = static_cast<int>(a >> 23);
  uint32_t frac = a & 0x7FFFFFu;
  int E;
  if (e == 0) {  // subnormal: normalise so that the leading 1 sits at bit 23
    const int s = clz32(frac) - 8;
    E = -126 - s;
    frac = (frac << s) & 0x7FFFFFu;
  } else {
    E = e - 127;
  }
  int k = emax8(fmt) - E - (frac > 0x600000u ? 1 : 0);  // M > 1.75 <=> fraction > 0.75
  return k < kmin ? kmin : (k > kmax ? kmax : k);
}

// Step 4's conversion with the codec's special-value rules.
__host__ __device__ inline uint8_t to_fp8(float y, int fmt) {
  const uint32_t b = f2u(y);
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7F;  // every NaN, whatever its sign
  if (mag == 0x7F800000u) {
    const uint8_t sign = static_cast<uint8_t>((b >> 31) << 7);
    return static_cast<uint8_t>((fmt == KVC_E4M3 ? 0x7E : 0x7C) | sign);
  }
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(y, __NV_SATFINITE, fmt == KVC_E4M3 ? __NV_E4M3 : __NV_E5M2));
}

// The exact float32 value of an FP8 code.
__host__ __device__ inline float fp8_value(uint8_t c, int fmt) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  uint32_t e, m;
  if (fmt == KVC_E4M3) {
    e = (c >> 3) & 0xFu;
    m = c & 0x7u;
    if ((c & 0x7F) == 0x7F) return u2f(sign | 0x7FC00000u);
    if (e == 0) return u2f(f2u(static_cast<float>(m) * pow2f(-9)) | sign);
    return u2f(sign | ((e - 7 + 127) << 23) | (m << 20));
  }
  e = (c >> 2) & 0x1Fu;
  m = c & 0x3u;
  if (e == 31) return u2f(sign | (m ? 0x7FC00000u : 0x7F800000u));
  if (e == 0) return u2f(f2u(static_cast<float>(m) * pow2f(-16)) | sign);
  return u2f(sign | ((e - 15 + 127) << 23) | (m << 21));
}

__host__ __device__ inline void k_range(int dtype, int *kmin, int *kmax) {
  *kmin = dtype == KVC_F16 ? -15 : -126;
  *kmax = -*kmin;
}

// Bits of 2**EMAX(dtype): a finite |x| at or above it makes the codec store the block raw.
__host__ __device__ inline uint32_t lossless_bits(int dtype) {
  return dtype == KVC_F16 ? 0x47000000u /* 2**15 */ : 0x7F000000u /* 2**127 */;
}

// ------------------------------------------------------------------------- kernels

// One warp per row: finite amax (as bits) into its group, status bits.
__global__ void rows_amax(const void *x, int dtype, int64_t rows, int64_t head_dim,
                          const int32_t *row_group, int64_t n_groups, uint32_t *scratch) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; r < rows;
       r += warps) {
    uint32_t m = 0;
    bool special = false;
    for (int64_t j = lane; j < head_dim; j += 32) {
      const uint32_t a = f2u(load(x, dtype, r * head_dim + j)) & 0x7FFFFFFFu;
      if (a < 0x7F800000u) {
        m = a > m ? a : m;
      } else {
        special = true;
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(0xFFFFFFFFu, m, off);
      m = o > m ? o : m;
    }
    const bool any_special = __any_sync(0xFFFFFFFFu, special);
    if (lane == 0) {
      atomicMax(&scratch[row_group[r]], m);
      const uint32_t status = (any_special ? 1u : 0u) | (m >= lossless_bits(dtype) ? 2u : 0u);
      if (status) atomicOr(&scratch[n_groups], status);
    }
  }
}

__global__ void group_scales(const uint32_t *scratch, int64_t n_groups, int fmt, int dtype,
                             int8_t *scales) {
  int kmin, kmax;
  k_range(dtype, &kmin, &kmax);
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < n_groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x)
    scales[g] = static_cast<int8_t>(exponent_k(scratch[g], fmt, kmin, kmax));
}

__global__ void encode_codes(const void *x, int dtype, int64_t n, int64_t head_dim,
                             const int32_t *row_group, const int8_t *scales, int fmt,
                             uint8_t *codes) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int k = scales[row_group[i / head_dim]];
    codes[i] = to_fp8(load(x, dtype, i) * pow2f(k), fmt);
  }
}

__global__ void decode_codes(const uint8_t *codes, const int8_t *scales, const int32_t *row_group,
                             int64_t n, int64_t head_dim, int fmt, int dtype, void *out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int k = scales[row_group[i / head_dim]];
    store(out, dtype, i, fp8_value(codes[i], fmt) * pow2f(-k));
  }
}

unsigned grid_for(int64_t n) {
  const int64_t g = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 ? 65535 : g));
}

bool bad_args(int dtype, int64_t rows, int64_t head_dim, int fmt) {
  return dtype < KVC_F16 || dtype > KVC_F32 || rows < 1 || head_dim < 1 ||
         (fmt != KVC_E4M3 && fmt != KVC_E5M2);
}

}  // namespace

extern "C" int kvc_fp8_encode(const void *x, int dtype, int64_t rows, int64_t head_dim,
                              const int32_t *row_group, int64_t n_groups, int fmt,
                              uint32_t *scratch, int8_t *scales, uint8_t *codes,
                              uintptr_t stream) {
  if (bad_args(dtype, rows, head_dim, fmt) || n_groups < 1) return KVC_E_ARG;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(scratch, 0, static_cast<size_t>(n_groups + 1) * 4, s);
  if (err != cudaSuccess) return static_cast<int>(err);
  rows_amax<<<grid_for(rows * 32), kThreads, 0, s>>>(x, dtype, rows, head_dim, row_group,
                                                      n_groups, scratch);
  group_scales<<<grid_for(n_groups), kThreads, 0, s>>>(scratch, n_groups, fmt, dtype, scales);
  encode_codes<<<grid_for(rows * head_dim), kThreads, 0, s>>>(x, dtype, rows * head_dim,
                                                              head_dim, row_group, scales, fmt,
                                                              codes);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int kvc_fp8_decode(const uint8_t *codes, const int8_t *scales,
                              const int32_t *row_group, int64_t rows, int64_t head_dim, int fmt,
                              int dtype, void *out, uintptr_t stream) {
  if (bad_args(dtype, rows, head_dim, fmt)) return KVC_E_ARG;
  decode_codes<<<grid_for(rows * head_dim), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      codes, scales, row_group, rows * head_dim, head_dim, fmt, dtype, out);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int kvc_fp8_encode_host(const void *x, int dtype, int64_t rows, int64_t head_dim,
                                   const int32_t *row_group, int64_t n_groups, int fmt,
                                   uint32_t *scratch, int8_t *scales, uint8_t *codes) {
  if (bad_args(dtype, rows, head_dim, fmt) || n_groups < 1) return KVC_E_ARG;
  for (int64_t r = 0; r < rows; ++r)
    if (row_group[r] < 0 || row_group[r] >= n_groups) return KVC_E_ARG;
  memset(scratch, 0, static_cast<size_t>(n_groups + 1) * 4);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t m = 0;
    for (int64_t j = 0; j < head_dim; ++j) {
      const uint32_t a = f2u(load(x, dtype, r * head_dim + j)) & 0x7FFFFFFFu;
      if (a < 0x7F800000u) {
        m = a > m ? a : m;
      } else {
        scratch[n_groups] |= 1u;
      }
    }
    if (m >= lossless_bits(dtype)) scratch[n_groups] |= 2u;
    uint32_t *g = &scratch[row_group[r]];
    *g = m > *g ? m : *g;
  }
  int kmin, kmax;
  k_range(dtype, &kmin, &kmax);
  for (int64_t g = 0; g < n_groups; ++g)
    scales[g] = static_cast<int8_t>(exponent_k(scratch[g], fmt, kmin, kmax));
  for (int64_t i = 0; i < rows * head_dim; ++i)
    codes[i] = to_fp8(load(x, dtype, i) * pow2f(scales[row_group[i / head_dim]]), fmt);
  return 0;
}

extern "C" int kvc_fp8_decode_host(const uint8_t *codes, const int8_t *scales,
                                   const int32_t *row_group, int64_t rows, int64_t head_dim,
                                   int fmt, int dtype, void *out) {
  if (bad_args(dtype, rows, head_dim, fmt)) return KVC_E_ARG;
  for (int64_t r = 0; r < rows; ++r)
    if (row_group[r] < 0) return KVC_E_ARG;
  for (int64_t i = 0; i < rows * head_dim; ++i)
    store(out, dtype, i, fp8_value(codes[i], fmt) * pow2f(-scales[row_group[i / head_dim]]));
  return 0;
}
