// Gather/scatter of paged KV blocks between an engine's cache and contiguous staging.
//
// One launch moves up to kMaxIds blocks of up to kMaxLayers layers; the layer pointers
// and block ids travel inside the kernel parameters (< 4 KiB, the portable limit), so a
// call needs no device allocation, no H2D of metadata and no synchronisation: it is
// just enqueued on the caller's stream.  Larger requests are split on the host.
// Each CUDA block copies one (block id, layer, outer) run of `inner` contiguous bytes,
// 16 bytes per thread per step when every address and the size allow it.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvcuda.h"

namespace {

constexpr int kMaxLayers = 128;
constexpr int kMaxIds = 320;
constexpr int kThreads = 256;

struct Batch {
  uint64_t layers[kMaxLayers];
  int64_t ids[kMaxIds];
  int64_t outer, outer_stride, block_stride, inner;
  int64_t staging_block;   // bytes per staging block: n_layers_total * outer * inner
  int64_t layer_base;      // index of layers[0] among all layers (staging offset)
  int n_layers;
  int vec16;               // every address and `inner` are multiples of 16
};

template <bool kGather>
__global__ void copy_blocks(const Batch b, char *staging) {
  const int64_t i = blockIdx.x;                        // which id of this batch
  const int64_t lo = blockIdx.y;                       // layer * outer + o
  const int64_t layer = lo / b.outer, o = lo % b.outer;
  char *cache = reinterpret_cast<char *>(b.layers[layer]) + o * b.outer_stride +
                b.ids[i] * b.block_stride;
  char *stage = staging + i * b.staging_block + ((b.layer_base + layer) * b.outer + o) * b.inner;
  char *dst = kGather ? stage : cache;
  const char *src = kGather ? cache : stage;
  if (b.vec16) {
    const int64_t n = b.inner / 16;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      reinterpret_cast<uint4 *>(dst)[j] = reinterpret_cast<const uint4 *>(src)[j];
  } else {
    for (int64_t j = threadIdx.x; j < b.inner; j += blockDim.x) dst[j] = src[j];
  }
}

template <bool kGather>
int run(const uint64_t *layer_ptrs, int n_layers, int64_t outer, int64_t outer_stride,
        int64_t block_stride, int64_t inner, const int64_t *block_ids, int64_t n_ids,
        char *staging, uintptr_t stream) {
  if (n_layers < 1 || outer < 1 || outer > 65535 || inner < 1 || n_ids < 0) return KVC_E_ARG;
  if (n_ids == 0) return 0;
  if (static_cast<int64_t>(n_layers) * outer > 65535) return KVC_E_ARG;  // grid.y limit
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t staging_block = static_cast<int64_t>(n_layers) * outer * inner;
  bool vec = inner % 16 == 0 && outer_stride % 16 == 0 && block_stride % 16 == 0 &&
             reinterpret_cast<uintptr_t>(staging) % 16 == 0;
  for (int l = 0; l < n_layers; ++l) vec = vec && layer_ptrs[l] % 16 == 0;
  Batch b;
  b.outer = outer;
  b.outer_stride = outer_stride;
  b.block_stride = block_stride;
  b.inner = inner;
  b.staging_block = staging_block;
  b.vec16 = vec ? 1 : 0;
  for (int64_t i0 = 0; i0 < n_ids; i0 += kMaxIds) {
    const int64_t ni = n_ids - i0 < kMaxIds ? n_ids - i0 : kMaxIds;
    for (int64_t k = 0; k < ni; ++k) {
      if (block_ids[i0 + k] < 0) return KVC_E_ARG;
      b.ids[k] = block_ids[i0 + k];
    }
    for (int l0 = 0; l0 < n_layers; l0 += kMaxLayers) {
      const int nl = n_layers - l0 < kMaxLayers ? n_layers - l0 : kMaxLayers;
      for (int l = 0; l < nl; ++l) b.layers[l] = layer_ptrs[l0 + l];
      b.n_layers = nl;
      b.layer_base = l0;
      dim3 grid(static_cast<unsigned>(ni), static_cast<unsigned>(nl * outer));
      copy_blocks<kGather><<<grid, kThreads, 0, s>>>(b, staging + i0 * staging_block);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return static_cast<int>(err);
    }
  }
  return 0;
}

}  // namespace

extern "C" int kvc_gather(const uint64_t *layer_ptrs, int n_layers, int64_t outer,
                          int64_t outer_stride, int64_t block_stride, int64_t inner_bytes,
                          const int64_t *block_ids, int64_t n_ids, void *staging,
                          uintptr_t stream) {
  return run<true>(layer_ptrs, n_layers, outer, outer_stride, block_stride, inner_bytes,
                   block_ids, n_ids, static_cast<char *>(staging), stream);
}

extern "C" int kvc_scatter(const uint64_t *layer_ptrs, int n_layers, int64_t outer,
                           int64_t outer_stride, int64_t block_stride, int64_t inner_bytes,
                           const int64_t *block_ids, int64_t n_ids, const void *staging,
                           uintptr_t stream) {
  // The kernel only reads staging when scattering; the cast serves the shared template.
  return run<false>(layer_ptrs, n_layers, outer, outer_stride, block_stride, inner_bytes,
                    block_ids, n_ids, const_cast<char *>(static_cast<const char *>(staging)),
                    stream);
}
