/* kvcuda: the C ABI of kvstore's CUDA extension (loaded from Python with ctypes).
 *
 * Plain C types only, so the library does not depend on torch's C++ ABI: pointers are
 * void*, sizes int64_t, a CUDA stream is passed as uintptr_t (0 = the legacy default
 * stream; torch's `torch.cuda.current_stream().cuda_stream` is such an integer).
 * Every function returns 0 on success or an error code: a cudaError_t value (> 0), or one
 * of the KVC_E_* codes below (< 0).  kvc_error_string() turns either into text.
 *
 * Bump KVC_ABI_VERSION whenever a signature or a meaning changes: the Python loader
 * refuses a library built from other sources and asks for a rebuild.
 */
#ifndef KVCUDA_H
#define KVCUDA_H

#include <stdint.h>

#define KVC_ABI_VERSION 3

/* Errors of our own (negative, so they never collide with cudaError_t). */
#define KVC_E_ARG (-1)     /* an argument is out of range (message says which) */
#define KVC_E_ALIGN (-2)   /* a pointer or size is not aligned as required */

/* dtypes of FP8 kernel inputs/outputs (same order as the codec's float dtypes) */
#define KVC_F16 0
#define KVC_BF16 1
#define KVC_F32 2

/* FP8 formats: the codec ids of kvstore/codecs/pipeline.py */
#define KVC_E4M3 1
#define KVC_E5M2 2

#ifdef __cplusplus
extern "C" {
#endif

/* ---- library / device ------------------------------------------------------------ */
int kvc_abi_version(void);
const char *kvc_error_string(int code);
const char *kvc_build_info(void);
int kvc_runtime_version(int *version);
int kvc_driver_version(int *version);
int kvc_device_count(int *count);
int kvc_set_device(int device);
int kvc_get_device(int *device);
int kvc_device_name(int device, char *buf, int buflen);

/* ---- memory ---------------------------------------------------------------------- */
int kvc_host_register(void *ptr, int64_t nbytes);
int kvc_host_unregister(void *ptr);
int kvc_malloc(void **ptr, int64_t nbytes);
int kvc_free(void *ptr);
int kvc_memset_async(void *ptr, int value, int64_t nbytes, uintptr_t stream);
/* cudaMemcpyDefault: the direction follows from the pointers (unified addressing). */
int kvc_memcpy_async(void *dst, const void *src, int64_t nbytes, uintptr_t stream);
/* ABI 3: `rows` runs of `width` bytes, from src + r*src_pitch to dst + r*dst_pitch
 * (cudaMemcpy2DAsync, cudaMemcpyDefault): one DMA that moves one layer of n blocks
 * between a contiguous scratch and block-major staging. */
int kvc_memcpy2d_async(void *dst, int64_t dst_pitch, const void *src, int64_t src_pitch,
                       int64_t width, int64_t rows, uintptr_t stream);

/* ---- streams and completion -------------------------------------------------------- */
int kvc_stream_create(uintptr_t *stream);
int kvc_stream_destroy(uintptr_t stream);
int kvc_stream_synchronize(uintptr_t stream);
/* 0 when all work queued on `stream` has finished, cudaErrorNotReady (600) while some is
 * still running, another error when the stream failed (cudaStreamQuery). */
int kvc_stream_query(uintptr_t stream);
/* When all work queued on `stream` so far has finished, or the stream has failed, write
 * 1 + the stream's cudaError_t to eventfd `fd` (a stream callback: it runs exactly once,
 * also after a sticky error).  The caller keeps `fd` open until it has read that value.
 * ABI 2: ABI 1 wrote 1 from a cudaLaunchHostFunc, never called after an error. */
int kvc_notify_eventfd(uintptr_t stream, int fd);

/* ---- events (ABI 3) -------------------------------------------------------------------
 * Ordering between streams without a host wait: record an event on one stream, make
 * another wait for it (a GPU-side wait).  Events are created without timing. */
int kvc_event_create(uintptr_t *event);
int kvc_event_destroy(uintptr_t event);
int kvc_event_record(uintptr_t event, uintptr_t stream);
int kvc_stream_wait_event(uintptr_t stream, uintptr_t event);
/* 0 when the work before the event's last record has finished, cudaErrorNotReady (600)
 * while it runs (cudaEventQuery: never blocks). */
int kvc_event_query(uintptr_t event);

/* ---- paged KV gather / scatter -------------------------------------------------------
 * Each layer's cache is viewed as [outer, num_blocks, inner_bytes] with byte strides
 * (outer_stride, block_stride) and `inner_bytes` contiguous bytes per (outer, block):
 * vLLM's [2, num_blocks, block_size, heads, head_dim] has outer = 2; the blocks-first
 * layouts ([num_blocks, 2, ...], [num_blocks, ...]) have outer = 1.  Staging block i is
 * contiguous: [n_layers][outer][inner_bytes], at staging + i * n_layers*outer*inner.
 * layer_ptrs (host array) and block_ids (host array) are read before the call returns.
 * gather: cache -> staging; scatter: staging -> cache.  Both pointers may be device
 * memory or registered host memory. */
int kvc_gather(const uint64_t *layer_ptrs, int n_layers, int64_t outer, int64_t outer_stride,
               int64_t block_stride, int64_t inner_bytes, const int64_t *block_ids,
               int64_t n_ids, void *staging, uintptr_t stream);
int kvc_scatter(const uint64_t *layer_ptrs, int n_layers, int64_t outer, int64_t outer_stride,
                int64_t block_stride, int64_t inner_bytes, const int64_t *block_ids,
                int64_t n_ids, const void *staging, uintptr_t stream);

/* ---- FP8 (kvstore/codecs/pipeline.py's algorithm, bit for bit) ---------------------------------
 * x: rows x head_dim elements of `dtype`, C order; row_group[r] in [0, n_groups) names the
 * scale group of row r; scratch: n_groups + 1 uint32 (device memory for the kernels);
 * outputs: scales[n_groups] (int8 exponents k), codes[rows*head_dim].
 * scratch[n_groups] receives status bits: 1 = some element is NaN/Inf (payload flag
 * bit 0), 2 = some finite |x| >= 2**EMAX(dtype) (the codec stores such a block raw). */
int kvc_fp8_encode(const void *x, int dtype, int64_t rows, int64_t head_dim,
                   const int32_t *row_group, int64_t n_groups, int fmt, uint32_t *scratch,
                   int8_t *scales, uint8_t *codes, uintptr_t stream);
int kvc_fp8_decode(const uint8_t *codes, const int8_t *scales, const int32_t *row_group,
                   int64_t rows, int64_t head_dim, int fmt, int dtype, void *out,
                   uintptr_t stream);
/* The same element code run on the CPU (host pointers, synchronous): the kernels' twin,
 * testable without a GPU. */
int kvc_fp8_encode_host(const void *x, int dtype, int64_t rows, int64_t head_dim,
                        const int32_t *row_group, int64_t n_groups, int fmt,
                        uint32_t *scratch, int8_t *scales, uint8_t *codes);
int kvc_fp8_decode_host(const uint8_t *codes, const int8_t *scales, const int32_t *row_group,
                        int64_t rows, int64_t head_dim, int fmt, int dtype, void *out);

#ifdef __cplusplus
}
#endif
#endif /* KVCUDA_H */
