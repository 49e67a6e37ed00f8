// Matrix-vector and small-batch (m <= 16) products with weights read as stored: ggml block types
// (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and bf16; the activation quantisation the block types' dot
// products take (ggml's quantize_row_q8_0_ref / quantize_row_q8_K_ref, bit for bit), and the block
// decoding for embed and the dequantised tiles of larger batches. The per-lane block arithmetic
// is gpu/quant_blocks.h, shared with the host mirror that tests it without a GPU.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "gpu/kernels.h"
#include "gpu/quant_blocks.h"

namespace specontext::gpu::kernels {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kQuantizeWarps = 8;  // activation blocks per thread block of the quantiser
constexpr int kDequantThreads = 256;
constexpr int64_t kMaxGridBlocks = 1 << 16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// f(std::integral_constant<QuantType, T>{}) for the run-time block type (nothing for another value).
template <typename F>
void with_quant_type(QuantType type, F&& f) {
  switch (type) {
    case QuantType::kQ8_0: f(std::integral_constant<QuantType, QuantType::kQ8_0>{}); break;
    case QuantType::kQ4_0: f(std::integral_constant<QuantType, QuantType::kQ4_0>{}); break;
    case QuantType::kQ4_K: f(std::integral_constant<QuantType, QuantType::kQ4_K>{}); break;
    case QuantType::kQ5_K: f(std::integral_constant<QuantType, QuantType::kQ5_K>{}); break;
    case QuantType::kQ6_K: f(std::integral_constant<QuantType, QuantType::kQ6_K>{}); break;
  }
}

// f(std::integral_constant<int, kM>{}) for the GEMVs' activation rows: kM the least of 1, 2, 4, 8
// and 16 that is >= m (16 for any m above).
template <typename F>
void with_batch_rows(int64_t m, F&& f) {
  if (m <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (m <= 2) {
    f(std::integral_constant<int, 2>{});
  } else if (m <= 4) {
    f(std::integral_constant<int, 4>{});
  } else if (m <= 8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 16>{});
  }
}

// Neither NaN nor ±inf (a NaN compares false).
__device__ __forceinline__ bool is_finite(float v) { return fabsf(v) <= 3.402823466e+38f; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// ---- activations ----

// The (row i, block b) the calling warp of a quantiser takes; false past the last (whole warps).
__device__ __forceinline__ bool quantize_task(int64_t m, int64_t nb, int64_t& i, int64_t& b) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + (threadIdx.x >> 5);
  if (task >= m * nb) return false;
  i = task / nb;
  b = task % nb;
  return true;
}

// Block b (32 · kPer elements) of row i: lane l's elements l + 32k (k < kPer) into v, zero past
// cols. Whether the whole block is finite; a block holding a NaN or an infinity gets codes 0 and
// a NaN scale here.
template <int kPer>
__device__ __forceinline__ bool load_finite_block(const float* __restrict__ x, int64_t cols, int64_t nb, int64_t i,
                                                  int64_t b, int lane, float (&v)[kPer], int8_t* __restrict__ q,
                                                  float* __restrict__ act_d) {
  bool finite = true;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t c = b * 32 * kPer + lane + 32 * k;
    v[k] = c < cols ? x[i * cols + c] : 0.0f;
    finite = finite && is_finite(v[k]);
  }
  if (__all_sync(kFullMask, finite)) return true;
#pragma unroll
  for (int k = 0; k < kPer; ++k) q[lane + 32 * k] = 0;
  if (lane == 0) act_d[i * nb + b] = __int_as_float(0x7fc00000);
  return false;
}

// quantize_row_q8_0_ref: one warp per (row, 32-element block), lane j holds element j.
__global__ void quantize_q8_0_kernel(const float* __restrict__ x, int64_t m, int64_t cols, int64_t nb,
                                     int8_t* __restrict__ act_q, float* __restrict__ act_d) {
  const int lane = threadIdx.x & 31;
  int64_t i = 0, b = 0;
  if (!quantize_task(m, nb, i, b)) return;
  int8_t* q = act_q + i * nb * 32 + b * 32;
  float v[1];
  if (!load_finite_block(x, cols, nb, i, b, lane, v, q, act_d)) return;
  float amax = fabsf(v[0]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
  const float d = __fdiv_rn(amax, 127.0f);
  const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
  q[lane] = static_cast<int8_t>(roundf(__fmul_rn(v[0], id)));
  if (lane == 0) act_d[i * nb + b] = __half2float(__float2half_rn(d));
}

// quantize_row_q8_K_ref: one warp per (row, 256-element block), lane l holds elements l + 32k.
__global__ void quantize_q8_k_kernel(const float* __restrict__ x, int64_t m, int64_t cols, int64_t nb,
                                     int8_t* __restrict__ act_q, float* __restrict__ act_d) {
  const int lane = threadIdx.x & 31;
  int64_t i = 0, b = 0;
  if (!quantize_task(m, nb, i, b)) return;
  int8_t* q = act_q + i * nb * 256 + b * 256;
  float v[8];
  if (!load_finite_block(x, cols, nb, i, b, lane, v, q, act_d)) return;
  // The first element of the largest magnitude (the reference keeps a strictly larger one).
  float best = 0.0f;
  float best_v = 0.0f;
  int best_i = INT_MAX;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if (fabsf(v[k]) > best) {
      best = fabsf(v[k]);
      best_v = v[k];
      best_i = lane + 32 * k;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o_best = __shfl_xor_sync(kFullMask, best, offset);
    const float o_v = __shfl_xor_sync(kFullMask, best_v, offset);
    const int o_i = __shfl_xor_sync(kFullMask, best_i, offset);
    if (o_best > best || (o_best == best && o_i < best_i)) {
      best = o_best;
      best_v = o_v;
      best_i = o_i;
    }
  }
  if (best == 0.0f) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[lane + 32 * k] = 0;
    if (lane == 0) act_d[i * nb + b] = 0.0f;
    return;
  }
  const float iscale = __fdiv_rn(-127.0f, best_v);
#pragma unroll
  for (int k = 0; k < 8; ++k) q[lane + 32 * k] = static_cast<int8_t>(min(127, __float2int_rn(__fmul_rn(iscale, v[k]))));
  if (lane == 0) act_d[i * nb + b] = __fdiv_rn(1.0f, iscale);
}

// ---- quantised GEMV ----

template <QuantType T, int kM>
__global__ void __launch_bounds__(kQuantGemvWarps * 32) quant_gemv_kernel(QuantGemvLaunch a) {
  constexpr int kLanes = quant::lanes_per_block(T);
  constexpr int kStep = 32 / kLanes;  // blocks a warp covers per step
  constexpr int kBytes = quant::block_bytes(T);
  constexpr int kElems = quant::block_elems(T);
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantGemvWarps + (threadIdx.x >> 5);
  if (row >= a.rows) return;  // whole warps
  const int t = lane % kLanes;
  const uint8_t* wrow = a.w + row * a.row_bytes;
  const int64_t act_row = a.nb * kElems;
  float acc[kM];
#pragma unroll
  for (int i = 0; i < kM; ++i) acc[i] = 0.0f;
  for (int64_t b = lane / kLanes; b < a.nb; b += kStep) {
    const quant::LaneWords L = quant::lane_words(T, wrow + b * kBytes, t);
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      if (i < a.m) acc[i] += quant::lane_dot(L, a.act_q + i * act_row + b * kElems, a.act_d[i * a.nb + b]);
    }
  }
#pragma unroll
  for (int i = 0; i < kM; ++i) {
    if (i < a.m) {
      const float s = warp_sum(acc[i]);
      if (lane == 0) a.y[i * a.rows + row] = s;
    }
  }
}

// ---- dequantisation ----

template <QuantType T>
__global__ void dequant_rows_kernel(const uint8_t* __restrict__ w, int64_t row_bytes, int64_t table_rows,
                                    const int32_t* __restrict__ ids, int64_t first_row, int64_t n_rows, int64_t cols,
                                    int64_t ld, float* __restrict__ dst) {
  constexpr int kBytes = quant::block_bytes(T);
  constexpr int kElems = quant::block_elems(T);
  const int64_t n = n_rows * cols;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / cols;
    const int64_t c = idx % cols;
    const int64_t r = ids != nullptr ? static_cast<int64_t>(ids[i]) : first_row + i;
    float v = __int_as_float(0x7fc00000);
    if (r >= 0 && r < table_rows) {
      v = quant::dequant_element(T, w + r * row_bytes + (c / kElems) * kBytes, static_cast<int>(c % kElems));
    }
    dst[i * ld + c] = v;
  }
}

// ---- bf16 GEMV ----

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// The 8 bf16 values of a 16-byte word, widened.
__device__ __forceinline__ void widen8(const uint4 raw, float* f) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = bf16_bits_to_float(words[k] & 0xffffu);
    f[2 * k + 1] = bf16_bits_to_float(words[k] >> 16);
  }
}

template <int kM, bool kVec>
__global__ void __launch_bounds__(kQuantGemvWarps * 32)
    bf16_gemv_kernel(const uint16_t* __restrict__ w, const uint16_t* __restrict__ x, int64_t m, int64_t rows,
                     int64_t cols, float* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantGemvWarps + (threadIdx.x >> 5);
  if (row >= rows) return;
  const uint16_t* wr = w + row * cols;
  float acc[kM];
#pragma unroll
  for (int i = 0; i < kM; ++i) acc[i] = 0.0f;
  if constexpr (kVec) {
    for (int64_t c = 8 * lane; c < cols; c += 256) {
      float wf[8];
      widen8(*reinterpret_cast<const uint4*>(wr + c), wf);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        if (i < m) {
          float xf[8];
          widen8(*reinterpret_cast<const uint4*>(x + i * cols + c), xf);
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[i] += xf[k] * wf[k];
        }
      }
    }
  } else {
    for (int64_t c = lane; c < cols; c += 32) {
      const float wf = bf16_bits_to_float(wr[c]);
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        if (i < m) acc[i] += bf16_bits_to_float(x[i * cols + c]) * wf;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kM; ++i) {
    if (i < m) {
      const float s = warp_sum(acc[i]);
      if (lane == 0) y[i * rows + row] = s;
    }
  }
}

template <bool kVec>
void launch_bf16_gemv_vec(const uint16_t* w, const uint16_t* x, int64_t m, int64_t rows, int64_t cols, float* y,
                          cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, kQuantGemvWarps)));
  const dim3 block(kQuantGemvWarps * 32);
  with_batch_rows(m, [&](auto batch) {
    constexpr int kM = decltype(batch)::value;
    bf16_gemv_kernel<kM, kVec><<<grid, block, 0, stream>>>(w, x, m, rows, cols, y);
  });
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

cudaError_t launch_quantize_activations(QuantType type, const float* x, int64_t m, int64_t cols, int64_t nb,
                                        int8_t* act_q, float* act_d, cudaStream_t stream) {
  clear_stale_error();
  const int64_t tasks = m * nb;
  if (tasks <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(ceil_div(tasks, kQuantizeWarps)));
  const dim3 block(kQuantizeWarps * 32);
  if (quant::block_elems(type) == 32) {
    quantize_q8_0_kernel<<<grid, block, 0, stream>>>(x, m, cols, nb, act_q, act_d);
  } else {
    quantize_q8_k_kernel<<<grid, block, 0, stream>>>(x, m, cols, nb, act_q, act_d);
  }
  return cudaGetLastError();
}

cudaError_t launch_quant_gemv(const QuantGemvLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  if (a.rows <= 0 || a.m <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(ceil_div(a.rows, kQuantGemvWarps)));
  const dim3 block(kQuantGemvWarps * 32);
  with_quant_type(a.type, [&](auto type) {
    constexpr QuantType kT = decltype(type)::value;
    with_batch_rows(a.m, [&](auto batch) {
      constexpr int kM = decltype(batch)::value;
      quant_gemv_kernel<kT, kM><<<grid, block, 0, stream>>>(a);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_quant_dequantize_rows(QuantType type, const uint8_t* w, int64_t row_bytes, int64_t table_rows,
                                         const int32_t* ids, int64_t first_row, int64_t n_rows, int64_t cols,
                                         int64_t ld, float* dst, cudaStream_t stream) {
  clear_stale_error();
  const int64_t n = n_rows * cols;
  if (n <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, kDequantThreads), 1, kMaxGridBlocks)));
  const dim3 block(kDequantThreads);
  with_quant_type(type, [&](auto tag) {
    constexpr QuantType kT = decltype(tag)::value;
    dequant_rows_kernel<kT><<<grid, block, 0, stream>>>(w, row_bytes, table_rows, ids, first_row, n_rows, cols, ld,
                                                        dst);
  });
  return cudaGetLastError();
}

cudaError_t launch_bf16_gemv(const uint16_t* w, const uint16_t* x, int64_t m, int64_t rows, int64_t cols, float* y,
                             cudaStream_t stream) {
  clear_stale_error();
  if (m <= 0 || rows <= 0) return cudaSuccess;
  if (cols % 8 == 0 && aligned16(w) && aligned16(x)) {
    launch_bf16_gemv_vec<true>(w, x, m, rows, cols, y, stream);
  } else {
    launch_bf16_gemv_vec<false>(w, x, m, rows, cols, y, stream);
  }
  return cudaGetLastError();
}

}  // namespace specontext::gpu::kernels
