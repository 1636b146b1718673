// Library entry points, device queries, pinned registration, copies and completion.
//
// The CUDA runtime is linked statically (nvcc -cudart static): the .so needs only the
// driver (libcuda.so.1) at run time, which the runtime loads on first use.  Without a
// driver or a device, the first call returns cudaErrorInsufficientDriver /
// cudaErrorNoDevice instead of failing to load, so Python can say why CUDA is off.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvcuda.h"

extern "C" int kvc_abi_version(void) { return KVC_ABI_VERSION; }

extern "C" const char *kvc_error_string(int code) {
  switch (code) {
    case 0: return "no error";
    case KVC_E_ARG: return "invalid argument (kvcuda)";
    case KVC_E_ALIGN: return "misaligned pointer or size (kvcuda)";
    default: break;
  }
  if (code < 0) return "unknown kvcuda error";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

extern "C" const char *kvc_build_info(void) {
  static char info[128];
  if (!info[0])
    snprintf(info, sizeof info, "kvcuda abi %d, CUDA runtime %d.%d (static)", KVC_ABI_VERSION,
             CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
  return info;
}

extern "C" int kvc_runtime_version(int *version) {
  return static_cast<int>(cudaRuntimeGetVersion(version));
}

extern "C" int kvc_driver_version(int *version) {
  // 0 when no driver is installed (that is not an error for this call).
  return static_cast<int>(cudaDriverGetVersion(version));
}

extern "C" int kvc_device_count(int *count) {
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

extern "C" int kvc_set_device(int device) { return static_cast<int>(cudaSetDevice(device)); }

extern "C" int kvc_get_device(int *device) { return static_cast<int>(cudaGetDevice(device)); }

extern "C" int kvc_device_name(int device, char *buf, int buflen) {
  if (buflen < 1) return KVC_E_ARG;
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return static_cast<int>(err);
  snprintf(buf, static_cast<size_t>(buflen), "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
  return 0;
}

// ---------------------------------------------------------------------------- memory

extern "C" int kvc_host_register(void *ptr, int64_t nbytes) {
  if (ptr == nullptr || nbytes <= 0) return KVC_E_ARG;
  // Portable: usable from every device/context; Mapped: kernels can also read it in place.
  return static_cast<int>(cudaHostRegister(ptr, static_cast<size_t>(nbytes),
                                           cudaHostRegisterPortable | cudaHostRegisterMapped));
}

extern "C" int kvc_host_unregister(void *ptr) {
  return static_cast<int>(cudaHostUnregister(ptr));
}

extern "C" int kvc_malloc(void **ptr, int64_t nbytes) {
  *ptr = nullptr;
  if (nbytes <= 0) return KVC_E_ARG;
  return static_cast<int>(cudaMalloc(ptr, static_cast<size_t>(nbytes)));
}

extern "C" int kvc_free(void *ptr) { return static_cast<int>(cudaFree(ptr)); }

extern "C" int kvc_memset_async(void *ptr, int value, int64_t nbytes, uintptr_t stream) {
  if (nbytes < 0) return KVC_E_ARG;
  return static_cast<int>(cudaMemsetAsync(ptr, value, static_cast<size_t>(nbytes),
                                          reinterpret_cast<cudaStream_t>(stream)));
}

extern "C" int kvc_memcpy_async(void *dst, const void *src, int64_t nbytes, uintptr_t stream) {
  if (nbytes < 0) return KVC_E_ARG;
  if (nbytes == 0) return 0;
  return static_cast<int>(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes),
                                          cudaMemcpyDefault,
                                          reinterpret_cast<cudaStream_t>(stream)));
}

extern "C" int kvc_memcpy2d_async(void *dst, int64_t dst_pitch, const void *src,
                                  int64_t src_pitch, int64_t width, int64_t rows,
                                  uintptr_t stream) {
  if (dst_pitch < 0 || src_pitch < 0 || width < 0 || rows < 0) return KVC_E_ARG;
  if (width == 0 || rows == 0) return 0;
  if (width > dst_pitch || width > src_pitch) return KVC_E_ARG;
  return static_cast<int>(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_pitch), src,
                                            static_cast<size_t>(src_pitch),
                                            static_cast<size_t>(width),
                                            static_cast<size_t>(rows), cudaMemcpyDefault,
                                            reinterpret_cast<cudaStream_t>(stream)));
}

// ---------------------------------------------------------------------------- streams

extern "C" int kvc_stream_create(uintptr_t *stream) {
  cudaStream_t s = nullptr;
  // Non-blocking: does not serialise with the legacy default stream other code uses.
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  *stream = reinterpret_cast<uintptr_t>(s);
  return static_cast<int>(err);
}

extern "C" int kvc_stream_destroy(uintptr_t stream) {
  return static_cast<int>(cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream)));
}

extern "C" int kvc_stream_synchronize(uintptr_t stream) {
  return static_cast<int>(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

extern "C" int kvc_stream_query(uintptr_t stream) {
  // 0: all work done; cudaErrorNotReady (600): still running; anything else: the stream
  // (its context) failed.
  return static_cast<int>(cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream)));
}

// Runs on a CUDA runtime thread once the stream reaches it, or once the stream has
// failed.  A stream callback (cudaStreamAddCallback) runs exactly once and is passed the
// stream's status; a cudaLaunchHostFunc function, used before, is never called after an
// error in the context (a "sticky" error such as a kernel's illegal address), and the
// waiter then slept forever.  It may not call CUDA; it writes 1 + status to the eventfd
// (1 = success), which wakes the waiting event loop in every case.
static void CUDART_CB notify_eventfd(cudaStream_t, cudaError_t status, void *arg) {
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(arg));
  const uint64_t value = 1 + static_cast<uint64_t>(status);
  // An eventfd write of 8 bytes cannot be short; EAGAIN only at a counter near 2**64.
  ssize_t n = write(fd, &value, sizeof value);
  (void)n;
}

extern "C" int kvc_notify_eventfd(uintptr_t stream, int fd) {
  if (fd < 0) return KVC_E_ARG;
  return static_cast<int>(cudaStreamAddCallback(reinterpret_cast<cudaStream_t>(stream),
                                                notify_eventfd,
                                                reinterpret_cast<void *>(static_cast<intptr_t>(fd)),
                                                0));
}

// ---------------------------------------------------------------------------- events

extern "C" int kvc_event_create(uintptr_t *event) {
  cudaEvent_t e = nullptr;
  // No timing: recording and waiting stay as cheap as CUDA allows.
  cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  *event = reinterpret_cast<uintptr_t>(e);
  return static_cast<int>(err);
}

extern "C" int kvc_event_destroy(uintptr_t event) {
  // Allowed while recorded work is pending: CUDA frees it once that work completes.
  return static_cast<int>(cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

extern "C" int kvc_event_record(uintptr_t event, uintptr_t stream) {
  return static_cast<int>(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event),
                                          reinterpret_cast<cudaStream_t>(stream)));
}

extern "C" int kvc_stream_wait_event(uintptr_t stream, uintptr_t event) {
  return static_cast<int>(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                              reinterpret_cast<cudaEvent_t>(event), 0));
}

extern "C" int kvc_event_query(uintptr_t event) {
  return static_cast<int>(cudaEventQuery(reinterpret_cast<cudaEvent_t>(event)));
}
