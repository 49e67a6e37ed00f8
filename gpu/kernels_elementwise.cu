// Memory-bound kernels of the CUDA backend: embed, conversions, RMSNorm, RoPE, SwiGLU, add and
// the paged KV append. All accumulate in f32; indices are 64-bit (activations of long prefills
// exceed 2^31 elements only in theory, but page offsets get close).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "gpu/kernels.h"
#include "gpu/kv_convert.h"

namespace specontext::gpu::kernels {

namespace {

constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxGridBlocks = 1 << 16;  // grid-stride loops beyond this

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline unsigned grid_for(int64_t work_items, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(work_items, threads), 1, kMaxGridBlocks));
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0f;
  v = warp_sum(v);  // every warp reduces the per-warp partials itself: no second barrier
  return v;
}

// ---- embed ----

__device__ __forceinline__ float load_table(const void* table, TableType type, int64_t i) {
  switch (type) {
    case TableType::kF32: return static_cast<const float*>(table)[i];
    case TableType::kF16: return __half2float(static_cast<const __half*>(table)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(table)[i]);
  }
}

__global__ void embed_kernel(const int32_t* __restrict__ ids, const void* __restrict__ table,
                             TableType type, int64_t rows, int64_t cols, float* __restrict__ out) {
  const int64_t i = blockIdx.x;
  const int32_t id = ids[i];
  float* dst = out + i * cols;
  if (id < 0 || id >= rows) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = __int_as_float(0x7fc00000);
    return;
  }
  const int64_t base = static_cast<int64_t>(id) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = load_table(table, type, base + c);
}

// ---- conversions, bias ----

__global__ void f32_to_bf16_kernel(const float* __restrict__ src, int64_t n,
                                   __nv_bfloat16* __restrict__ dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void bias_add_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t rows,
                                int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % cols];
  }
}

// ---- RMSNorm: one block per row ----
// x and y are deliberately not __restrict__: y may alias x. Each element is read and written by
// the same thread, and all reads of the first pass happen before the barrier in block_sum.

template <bool kVec4>
__global__ void rmsnorm_kernel(const float* x, const float* __restrict__ weight, int64_t dim,
                               float eps, float* y) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* yr = y + row * dim;
  float ss = 0.0f;
  if constexpr (kVec4) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t i = threadIdx.x; i < dim / 4; i += blockDim.x) {
      const float4 v = x4[i];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  }
  ss = block_sum(ss, scratch);
  // IEEE sqrt and division (not rsqrtf): matches the reference's rounding of the scale.
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  if constexpr (kVec4) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    float4* y4 = reinterpret_cast<float4*>(yr);
    for (int64_t i = threadIdx.x; i < dim / 4; i += blockDim.x) {
      const float4 v = x4[i];
      const float4 w = w4[i];
      y4[i] = make_float4(v.x * scale * w.x, v.y * scale * w.y, v.z * scale * w.z, v.w * scale * w.w);
    }
  } else {
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * scale * weight[i];
  }
}

// ---- RoPE ----
// Block (tx, ty) serves one token and ty heads; thread x walks the rotation pairs. The angle is
// the float product position · inv_freq (what PyTorch's float32 rotary and the reference do);
// it is then reduced to [-pi, pi] in double so that the fast __sincosf is accurate (|error| <
// 4e-7) for any position, without the local-memory slow path of sincosf.

__global__ void rope_kernel(float* __restrict__ x, int64_t n_heads, int64_t head_dim,
                            const int64_t* __restrict__ positions,
                            const float* __restrict__ inv_freq, bool interleaved, float mscale) {
  const int64_t t = blockIdx.x;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (h >= n_heads) return;
  const int64_t half = head_dim / 2;
  const float pos = static_cast<float>(positions[t]);
  float* v = x + (t * n_heads + h) * head_dim;
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const double angle = static_cast<double>(pos * inv_freq[i]);
    const double turns = rint(angle * (1.0 / kTwoPi));
    const float reduced = static_cast<float>(fma(-turns, kTwoPi, angle));
    float s, c;
    __sincosf(reduced, &s, &c);
    const int64_t i0 = interleaved ? 2 * i : i;
    const int64_t i1 = interleaved ? 2 * i + 1 : i + half;
    const float x0 = v[i0];
    const float x1 = v[i1];
    v[i0] = (x0 * c - x1 * s) * mscale;
    v[i1] = (x0 * s + x1 * c) * mscale;
  }
}

// ---- SwiGLU, add ----
// Vector part over float4 (when every pointer is 16-byte aligned), scalar tail after it.

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

template <bool kVec4>
__global__ void swiglu_kernel(const float* gate, const float* up, int64_t n, float* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec4) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 g = reinterpret_cast<const float4*>(gate)[i];
      const float4 u = reinterpret_cast<const float4*>(up)[i];
      reinterpret_cast<float4*>(out)[i] =
          make_float4(silu_mul(g.x, u.x), silu_mul(g.y, u.y), silu_mul(g.z, u.z), silu_mul(g.w, u.w));
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) out[i] = silu_mul(gate[i], up[i]);
}

template <bool kVec4>
__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec4) {
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 a = reinterpret_cast<float4*>(x)[i];
      const float4 b = reinterpret_cast<const float4*>(y)[i];
      a.x += b.x;
      a.y += b.y;
      a.z += b.z;
      a.w += b.w;
      reinterpret_cast<float4*>(x)[i] = a;
    }
    done = n4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) x[i] += y[i];
}

// ---- KV append: block per (token, kv head); T is the page element type (rounded on store) ----

template <typename T>
__global__ void kv_append_kernel(const float* __restrict__ k, const float* __restrict__ v, int64_t start_pos,
                                 void* const* __restrict__ page_table, int64_t first_page, int64_t n_touched,
                                 int64_t page_size, int64_t kv_heads, int64_t head_dim) {
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t pos = start_pos + t;
  const int64_t page = pos / page_size - first_page;
  const int64_t slot = pos % page_size;
  T* k_dst = static_cast<T*>(page_table[page]) + (h * page_size + slot) * head_dim;
  T* v_dst = static_cast<T*>(page_table[n_touched + page]) + (h * page_size + slot) * head_dim;
  const int64_t src = (t * kv_heads + h) * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    k_dst[d] = kv_from_f32<T>(k[src + d]);
    v_dst[d] = kv_from_f32<T>(v[src + d]);
  }
}

}  // namespace

cudaError_t launch_embed(const int32_t* ids, int64_t n, const void* table, TableType type,
                         int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  clear_stale_error();
  if (n <= 0 || cols <= 0) return cudaSuccess;
  const int threads = static_cast<int>(std::clamp<int64_t>((cols + 31) / 32 * 32, 32, 256));
  embed_kernel<<<static_cast<unsigned>(n), threads, 0, stream>>>(ids, table, type, rows, cols, out);
  return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream) {
  clear_stale_error();
  if (n <= 0) return cudaSuccess;
  f32_to_bf16_kernel<<<grid_for(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      src, n, reinterpret_cast<__nv_bfloat16*>(dst));
  return cudaGetLastError();
}

cudaError_t launch_bias_add(float* y, const float* bias, int64_t rows, int64_t cols,
                            cudaStream_t stream) {
  clear_stale_error();
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  bias_add_kernel<<<grid_for(rows * cols, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      y, bias, rows, cols);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim,
                           float eps, float* y, cudaStream_t stream) {
  clear_stale_error();
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  const bool vec4 = dim % 4 == 0 && aligned16(x) && aligned16(y) && aligned16(weight);
  const int64_t lanes = vec4 ? dim / 4 : dim;
  const int threads = static_cast<int>(std::clamp<int64_t>((lanes + 31) / 32 * 32, 32, 256));
  if (vec4) {
    rmsnorm_kernel<true><<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, weight, dim, eps, y);
  } else {
    rmsnorm_kernel<false><<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, weight, dim, eps, y);
  }
  return cudaGetLastError();
}

cudaError_t launch_rope(float* x, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
                        const int64_t* positions, const float* inv_freq, bool interleaved,
                        float mscale, cudaStream_t stream) {
  clear_stale_error();
  if (n_tokens <= 0 || n_heads <= 0 || head_dim < 2) return cudaSuccess;
  const int64_t half = head_dim / 2;
  const int tx = static_cast<int>(std::clamp<int64_t>((half + 31) / 32 * 32, 32, 128));
  const int ty = std::max(1, 128 / tx);
  const dim3 grid(static_cast<unsigned>(n_tokens), static_cast<unsigned>(ceil_div(n_heads, ty)));
  rope_kernel<<<grid, dim3(tx, ty), 0, stream>>>(x, n_heads, head_dim, positions, inv_freq,
                                                 interleaved, mscale);
  return cudaGetLastError();
}

cudaError_t launch_swiglu(const float* gate, const float* up, int64_t n, float* out,
                          cudaStream_t stream) {
  clear_stale_error();
  if (n <= 0) return cudaSuccess;
  const bool vec4 = aligned16(gate) && aligned16(up) && aligned16(out);
  const unsigned grid = grid_for(vec4 ? ceil_div(n, 4) : n, kElementwiseThreads);
  if (vec4) {
    swiglu_kernel<true><<<grid, kElementwiseThreads, 0, stream>>>(gate, up, n, out);
  } else {
    swiglu_kernel<false><<<grid, kElementwiseThreads, 0, stream>>>(gate, up, n, out);
  }
  return cudaGetLastError();
}

cudaError_t launch_add(float* x, const float* y, int64_t n, cudaStream_t stream) {
  clear_stale_error();
  if (n <= 0) return cudaSuccess;
  const bool vec4 = aligned16(x) && aligned16(y);
  const unsigned grid = grid_for(vec4 ? ceil_div(n, 4) : n, kElementwiseThreads);
  if (vec4) {
    add_kernel<true><<<grid, kElementwiseThreads, 0, stream>>>(x, y, n);
  } else {
    add_kernel<false><<<grid, kElementwiseThreads, 0, stream>>>(x, y, n);
  }
  return cudaGetLastError();
}

cudaError_t launch_kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                             void* const* page_table, KvType type, int64_t first_page, int64_t n_touched,
                             int64_t page_size, int64_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  clear_stale_error();
  if (n_tokens <= 0 || kv_heads <= 0 || head_dim <= 0) return cudaSuccess;
  const int threads = static_cast<int>(std::clamp<int64_t>((head_dim + 31) / 32 * 32, 32, 256));
  const dim3 grid(static_cast<unsigned>(n_tokens), static_cast<unsigned>(kv_heads));
  switch (type) {
    case KvType::kF32:
      kv_append_kernel<float><<<grid, threads, 0, stream>>>(k, v, start_pos, page_table, first_page,
                                                            n_touched, page_size, kv_heads, head_dim);
      break;
    case KvType::kF16:
      kv_append_kernel<__half><<<grid, threads, 0, stream>>>(k, v, start_pos, page_table, first_page,
                                                             n_touched, page_size, kv_heads, head_dim);
      break;
    case KvType::kBF16:
      kv_append_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(k, v, start_pos, page_table, first_page,
                                                                    n_touched, page_size, kv_heads, head_dim);
      break;
    default:
      return cudaErrorInvalidValue;  // not a KvType
  }
  return cudaGetLastError();
}

}  // namespace specontext::gpu::kernels
