// In-place rotary embedding of KV rows: deferred RoPE of pre-RoPE keys (rotate to
// `positions`) and re-rotation of post-RoPE keys (rotate by new - old positions), in
// every layer of a buffer, optionally at scattered pool slots.
//
// One warp per token: the warp computes the token's cos/sin once into shared memory and
// reuses them for every head of every layer. Angles are formed and reduced to [-pi, pi]
// in float64 (positions reach 1e6 and more, where a float32 angle is off by whole
// radians), then sincosf runs on the reduced float32 angle. This follows the reference
// (sgl_pic.rope.rope_cos_sin: float64 angles, float32 cos/sin) to float32 rounding.
#include "common.cuh"

namespace pic {
namespace {

constexpr int kRopeWarps = 4;
constexpr int kRopeThreads = kRopeWarps * 32;
constexpr int kMaxHeadDim = 1024;
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInvTwoPi = 0.15915494309189533576888376337251;

struct RopeArgs {
  char* base;
  int64_t layer_stride;
  const int64_t* layer_ptrs;
  int64_t num_layers;
  int64_t num_rows;
  const int64_t* row_ids;
  int64_t n;
  const int64_t* positions;
  const int64_t* old_positions;
  const float* inv_freq;
  int num_heads;
  int head_dim;
  float scale;
};

// Unfused multiply then subtract/add, as the float32 torch reference computes it, so
// the float32 results agree with the reference bit for bit up to cos/sin rounding.
__device__ __forceinline__ float rot_lo(float x1, float x2, float c, float s) {
  return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}
__device__ __forceinline__ float rot_hi(float x1, float x2, float c, float s) {
  return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// V: elements per access. neox pairs element f with f + head_dim / 2, so one access of
// V elements from each half rotates V pairs; interleaved pairs 2f with 2f + 1, so one
// access of V elements holds V / 2 pairs.
template <typename T, int V, bool kNeox>
__global__ void __launch_bounds__(kRopeThreads) rope_rows_kernel(const RopeArgs a) {
  extern __shared__ float2 cos_sin_all[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int half = a.head_dim / 2;
  float2* cos_sin = cos_sin_all + warp * half;

  const int chunks_per_head = kNeox ? half / V : a.head_dim / V;
  const int chunks_per_layer = a.num_heads * chunks_per_head;
  const int64_t items = a.num_layers * chunks_per_layer;
  const int64_t row_elems = static_cast<int64_t>(a.num_heads) * a.head_dim;

  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kRopeWarps + warp; i < a.n;
       i += static_cast<int64_t>(gridDim.x) * kRopeWarps) {
    const int64_t row = a.row_ids != nullptr ? a.row_ids[i] : i;
    // Warp-uniform; the Python boundary already rejects such rows.
    if (row < 0 || row >= a.num_rows) continue;
    const int64_t delta = a.positions[i] - (a.old_positions != nullptr ? a.old_positions[i] : 0);

    __syncwarp();  // the previous token's cos/sin are no longer read
    for (int f = lane; f < half; f += 32) {
      const double angle = static_cast<double>(delta) * static_cast<double>(a.inv_freq[f]);
      const double reduced = angle - rint(angle * kInvTwoPi) * kTwoPi;
      float s;
      float c;
      sincosf(static_cast<float>(reduced), &s, &c);
      cos_sin[f] = make_float2(__fmul_rn(c, a.scale), __fmul_rn(s, a.scale));
    }
    __syncwarp();

    for (int64_t w = lane; w < items; w += 32) {
      const int64_t layer = w / chunks_per_layer;
      const int rem = static_cast<int>(w - layer * chunks_per_layer);
      const int head = rem / chunks_per_head;
      const int chunk = rem - head * chunks_per_head;
      T* x = reinterpret_cast<T*>(layer_base(a.base, a.layer_stride, a.layer_ptrs, layer)) +
             row * row_elems + static_cast<int64_t>(head) * a.head_dim;
      if constexpr (kNeox) {
        auto* p1 = reinterpret_cast<Pack<T, V>*>(x + chunk * V);
        auto* p2 = reinterpret_cast<Pack<T, V>*>(x + half + chunk * V);
        Pack<T, V> lo = *p1;
        Pack<T, V> hi = *p2;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float2 cs = cos_sin[chunk * V + j];
          const float x1 = to_float(lo.v[j]);
          const float x2 = to_float(hi.v[j]);
          lo.v[j] = from_float<T>(rot_lo(x1, x2, cs.x, cs.y));
          hi.v[j] = from_float<T>(rot_hi(x1, x2, cs.x, cs.y));
        }
        *p1 = lo;
        *p2 = hi;
      } else {
        auto* p = reinterpret_cast<Pack<T, V>*>(x + chunk * V);
        Pack<T, V> v = *p;
#pragma unroll
        for (int j = 0; j < V / 2; ++j) {
          const float2 cs = cos_sin[chunk * (V / 2) + j];
          const float x1 = to_float(v.v[2 * j]);
          const float x2 = to_float(v.v[2 * j + 1]);
          v.v[2 * j] = from_float<T>(rot_lo(x1, x2, cs.x, cs.y));
          v.v[2 * j + 1] = from_float<T>(rot_hi(x1, x2, cs.x, cs.y));
        }
        *p = v;
      }
    }
  }
}

template <typename T, int V, bool kNeox>
int launch_rope(const RopeArgs& a, cudaStream_t stream) {
  const int64_t wanted = (a.n + kRopeWarps - 1) / kRopeWarps;
  const int64_t cap = max_resident_blocks(kRopeThreads);
  const unsigned grid = static_cast<unsigned>(wanted < cap ? wanted : cap);
  const size_t shared = sizeof(float2) * kRopeWarps * (a.head_dim / 2);
  rope_rows_kernel<T, V, kNeox><<<grid, kRopeThreads, shared, stream>>>(a);
  return launch_status();
}

// Picks the vector width: 16-byte accesses when the pairs of a head split evenly into
// them and every address allows it, else the narrowest access that still holds a pair.
template <typename T>
int dispatch_rope(const RopeArgs& a, int layout, int64_t ptr_align, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int half = a.head_dim / 2;
  if (layout == PIC_ROPE_NEOX) {
    if (ptr_align >= 16 && half % kVec == 0) return launch_rope<T, kVec, true>(a, stream);
    if (ptr_align >= static_cast<int64_t>(sizeof(T))) return launch_rope<T, 1, true>(a, stream);
    return PIC_ERR_MISALIGNED;
  }
  if (layout == PIC_ROPE_INTERLEAVED) {
    if (ptr_align >= 16 && a.head_dim % kVec == 0) return launch_rope<T, kVec, false>(a, stream);
    if (ptr_align >= static_cast<int64_t>(2 * sizeof(T))) {
      return launch_rope<T, 2, false>(a, stream);
    }
    return PIC_ERR_MISALIGNED;
  }
  return PIC_ERR_UNSUPPORTED_DTYPE;
}

}  // namespace
}  // namespace pic

extern "C" int pic_rope_rows(void* base, int64_t layer_stride_bytes, const int64_t* layer_ptrs,
                             int64_t num_layers, int64_t num_rows, const int64_t* row_ids,
                             int64_t n, const int64_t* positions, const int64_t* old_positions,
                             const float* inv_freq, int64_t num_heads, int64_t head_dim,
                             int dtype, int layout, float scale, int64_t ptr_align,
                             cudaStream_t stream) {
  if (n < 0 || num_layers < 0 || num_rows < 0 || num_heads <= 0 || head_dim < 2 ||
      head_dim % 2 != 0 || head_dim > pic::kMaxHeadDim || num_heads > (1 << 20) ||
      positions == nullptr || inv_freq == nullptr || (base == nullptr && layer_ptrs == nullptr)) {
    return PIC_ERR_INVALID_ARGUMENT;
  }
  if (n == 0 || num_layers == 0) return PIC_OK;
  const pic::RopeArgs a{static_cast<char*>(base), layer_stride_bytes, layer_ptrs, num_layers,
                        num_rows, row_ids, n, positions, old_positions, inv_freq,
                        static_cast<int>(num_heads), static_cast<int>(head_dim), scale};
  switch (dtype) {
    case PIC_FLOAT32:
      return pic::dispatch_rope<float>(a, layout, ptr_align, stream);
    case PIC_FLOAT16:
      return pic::dispatch_rope<__half>(a, layout, ptr_align, stream);
    case PIC_BFLOAT16:
      return pic::dispatch_rope<__nv_bfloat16>(a, layout, ptr_align, stream);
    default:
      return PIC_ERR_UNSUPPORTED_DTYPE;
  }
}
