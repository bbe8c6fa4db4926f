// C ABI of the sgl-pic CUDA kernels, loaded from Python through ctypes.
//
// Every launcher takes raw device (or mapped pinned host) pointers, sizes and a stream,
// enqueues work and returns 0 or an error code; pic_error_string() names a code. No torch
// headers: the library builds with nvcc alone, on a machine with no GPU.
//
// Buffers are addressed per layer in one of two ways, so that both a stacked
// [num_layers, rows, heads, head_dim] tensor and SGLang's list of per-layer pool tensors
// work without a copy: `layer_ptrs` (a device array of num_layers addresses) when not
// null, else `base + layer * layer_stride_bytes`.
//
// `ptr_align` is the largest power of two (<= 16) that divides every base address and
// layer stride the caller passes; the launchers pick their vector width from it.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; the Python loader refuses a mismatch.
#define PIC_ABI_VERSION 1

enum PicStatus {
  PIC_OK = 0,
  // Negative codes are argument errors found by a launcher; positive ones are cudaError_t.
  PIC_ERR_INVALID_ARGUMENT = -1,
  PIC_ERR_UNSUPPORTED_DTYPE = -2,
  PIC_ERR_MISALIGNED = -3,
};

enum PicDtype { PIC_FLOAT32 = 0, PIC_FLOAT16 = 1, PIC_BFLOAT16 = 2 };
enum PicRopeLayout { PIC_ROPE_NEOX = 0, PIC_ROPE_INTERLEAVED = 1 };

int pic_abi_version(void);
const char* pic_error_string(int code);

// For each layer l < num_layers and i < n:
//   dst_layer(l)[dst_ids[i]] = src_layer(l)[src_ids ? src_ids[i] : i]
// where a row is row_bytes contiguous bytes. Gather (src_ids = token ids of a chunk)
// and scatter (src_ids = NULL, src = the recomputed rows) are both this copy. Rows whose
// index falls outside [0, num_src_rows) or [0, num_dst_rows) are skipped, never written.
int pic_copy_rows(const void* src, int64_t src_layer_stride_bytes, int64_t num_src_rows,
                  const int64_t* src_ids, void* dst, int64_t dst_layer_stride_bytes,
                  const int64_t* dst_layer_ptrs, int64_t num_dst_rows, const int64_t* dst_ids,
                  int64_t n, int64_t num_layers, int64_t row_bytes, int64_t ptr_align,
                  cudaStream_t stream);

// Rotates, in place and in every layer, the keys of rows `row_ids[i]` (or row i when
// row_ids is NULL) by the angle (positions[i] - (old_positions ? old_positions[i] : 0))
// * inv_freq[f] for each frequency f < head_dim / 2. With old_positions NULL this is
// deferred RoPE of pre-RoPE keys; with it, re-rotation of post-RoPE keys from old to new
// positions in one pass. cos and sin are multiplied by `scale`. A row is
// [num_heads, head_dim] contiguous elements of `dtype`.
int pic_rope_rows(void* base, int64_t layer_stride_bytes, const int64_t* layer_ptrs,
                  int64_t num_layers, int64_t num_rows, const int64_t* row_ids, int64_t n,
                  const int64_t* positions, const int64_t* old_positions, const float* inv_freq,
                  int64_t num_heads, int64_t head_dim, int dtype, int layout, float scale,
                  int64_t ptr_align, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
