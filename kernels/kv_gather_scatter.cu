// Sparse row copy between KV buffers: gather of a cached chunk's reused tokens into
// SGLang's pool slots, and scatter of recomputed K/V rows into slots.
//
// Both are byte copies of whole rows ([num_kv_heads, head_dim] elements), so the kernel
// knows no dtype: it moves rows in the widest vector the alignment allows. Threads of a
// block split into groups of `units_per_row` lanes, one group per row, so that a short
// row (384 bytes for 3 heads x 64 fp16) still keeps most lanes busy and each row's
// accesses are contiguous across its lanes.
#include "common.cuh"

namespace pic {
namespace {

constexpr int kCopyThreads = 256;

struct CopyArgs {
  const char* src;
  int64_t src_layer_stride;
  int64_t num_src_rows;
  const int64_t* src_ids;
  char* dst;
  int64_t dst_layer_stride;
  const int64_t* dst_layer_ptrs;
  int64_t num_dst_rows;
  const int64_t* dst_ids;
  int64_t n;
  int64_t row_bytes;
};

template <typename VecT>
__global__ void __launch_bounds__(kCopyThreads) copy_rows_kernel(const CopyArgs a) {
  const int64_t layer = blockIdx.y;
  const char* src = a.src + layer * a.src_layer_stride;
  char* dst = layer_base(a.dst, a.dst_layer_stride, a.dst_layer_ptrs, layer);

  const int units = static_cast<int>(a.row_bytes / static_cast<int64_t>(sizeof(VecT)));
  // Rows wider than the block are copied by the whole block, one row at a time.
  const int rows_per_block = units >= kCopyThreads ? 1 : kCopyThreads / units;
  const int group = units >= kCopyThreads ? 0 : threadIdx.x / units;
  const int first_unit = units >= kCopyThreads ? threadIdx.x : threadIdx.x % units;
  const int unit_stride = units >= kCopyThreads ? kCopyThreads : units;
  if (group >= rows_per_block) return;

  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * rows_per_block;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * rows_per_block + group; i < a.n;
       i += row_stride) {
    const int64_t s = a.src_ids != nullptr ? a.src_ids[i] : i;
    const int64_t d = a.dst_ids[i];
    // The Python boundary rejects such indices; this guard keeps the kernel from ever
    // writing outside the pool if it is called directly.
    if (s < 0 || s >= a.num_src_rows || d < 0 || d >= a.num_dst_rows) continue;
    const VecT* sp = reinterpret_cast<const VecT*>(src + s * a.row_bytes);
    VecT* dp = reinterpret_cast<VecT*>(dst + d * a.row_bytes);
    for (int u = first_unit; u < units; u += unit_stride) dp[u] = sp[u];
  }
}

template <typename VecT>
int launch_copy(const CopyArgs& a, int64_t num_layers, cudaStream_t stream) {
  const int64_t units = a.row_bytes / static_cast<int64_t>(sizeof(VecT));
  const int64_t rows_per_block = units >= kCopyThreads ? 1 : kCopyThreads / units;
  const int64_t wanted = (a.n + rows_per_block - 1) / rows_per_block;
  // Layers already multiply the grid (blockIdx.y), so the per-layer cap shrinks with them.
  int64_t cap = max_resident_blocks(kCopyThreads) * 4 / num_layers;
  if (cap < 1) cap = 1;
  const dim3 grid(static_cast<unsigned>(wanted < cap ? wanted : cap),
                  static_cast<unsigned>(num_layers));
  copy_rows_kernel<VecT><<<grid, kCopyThreads, 0, stream>>>(a);
  return launch_status();
}

}  // namespace
}  // namespace pic

extern "C" int pic_copy_rows(const void* src, int64_t src_layer_stride_bytes,
                             int64_t num_src_rows, const int64_t* src_ids, void* dst,
                             int64_t dst_layer_stride_bytes, const int64_t* dst_layer_ptrs,
                             int64_t num_dst_rows, const int64_t* dst_ids, int64_t n,
                             int64_t num_layers, int64_t row_bytes, int64_t ptr_align,
                             cudaStream_t stream) {
  if (n < 0 || num_layers < 0 || num_layers > 65535 || row_bytes <= 0 ||
      row_bytes > (int64_t{1} << 30) || src == nullptr || dst_ids == nullptr ||
      (dst == nullptr && dst_layer_ptrs == nullptr)) {
    return PIC_ERR_INVALID_ARGUMENT;
  }
  if (n == 0 || num_layers == 0) return PIC_OK;
  const pic::CopyArgs a{static_cast<const char*>(src), src_layer_stride_bytes, num_src_rows,
                        src_ids, static_cast<char*>(dst), dst_layer_stride_bytes,
                        dst_layer_ptrs, num_dst_rows, dst_ids, n, row_bytes};
  // Widest access that divides the row and every address: 16 bytes for any row of
  // 8 fp16 / 4 fp32 multiples in torch-allocated buffers.
  if (ptr_align >= 16 && row_bytes % 16 == 0) return pic::launch_copy<uint4>(a, num_layers, stream);
  if (ptr_align >= 8 && row_bytes % 8 == 0) return pic::launch_copy<uint2>(a, num_layers, stream);
  if (ptr_align >= 4 && row_bytes % 4 == 0) {
    return pic::launch_copy<uint32_t>(a, num_layers, stream);
  }
  if (ptr_align >= 2 && row_bytes % 2 == 0) {
    return pic::launch_copy<uint16_t>(a, num_layers, stream);
  }
  return PIC_ERR_MISALIGNED;
}
