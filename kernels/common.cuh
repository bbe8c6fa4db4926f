// Helpers shared by the sgl-pic kernels: launch sizing and fixed-width vector packs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sgl_pic_kernels.h"

namespace pic {

// A group of V elements loaded or stored as one access; alignas makes a 16-byte pack
// compile to a single 128-bit load/store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Address of layer `layer`: from the pointer table when the layers are separate
// allocations (SGLang's per-layer pool tensors), else from a base and a stride.
__device__ __forceinline__ char* layer_base(char* base, int64_t stride_bytes,
                                            const int64_t* layer_ptrs, int64_t layer) {
  return layer_ptrs != nullptr ? reinterpret_cast<char*>(layer_ptrs[layer])
                               : base + layer * stride_bytes;
}

// Grid-stride loops cap the grid here: enough resident blocks to fill every SM, without
// launching millions of blocks for long token lists.
inline int64_t max_resident_blocks(int threads_per_block) {
  int device = 0;
  int sms = 0;
  int threads_per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
          cudaSuccess) {
    return 1024;  // a launch failure, if any, is reported by the launch itself
  }
  const int64_t per_sm = threads_per_sm / threads_per_block;
  return static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
}

inline int launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? PIC_OK : static_cast<int>(err);
}

}  // namespace pic
