// Device code shared by the dense (kernels_attention.cu) and sparse (kernels_sparse.cu)
// flash-decoding kernels: warp reductions, the per-tile online-softmax step, the P·V
// accumulation, the (m, l, o) output of a chunk, the merge of the chunks and the launch layer.
// Everything is __forceinline__ so each kernel compiles as if written out in place (the register
// budget of __launch_bounds__(kThreads, 4) was tuned for that), and lives in an unnamed namespace
// because each .cu file is its own translation unit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gpu/kernels.h"
#include "gpu/kv_convert.h"

namespace specontext::gpu::kernels {

namespace {

constexpr int kWarps = kAttentionWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyTile = static_cast<int>(kAttentionKeyTile);
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Largest i in [0, n) with begin[i] <= x, for a non-decreasing prefix array with
// begin[0] <= x < begin[n]. Skips empty segments (equal neighbours), since it takes the largest.
__device__ __forceinline__ int64_t find_segment(const int64_t* begin, int64_t n, int64_t x) {
  int64_t lo = 0;
  int64_t hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (begin[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Shared memory of a partial block: the K tile [kKeyTile][hd + 1] (odd stride for even head_dim:
// lane j reading key row j is conflict-free), the V tile [kKeyTile][hd] and the tile's
// pre-scaled queries [kQpb][hd] (attention_smem_bytes).
struct TileSmem {
  float* k_s;
  float* v_s;
  float* q_s;
  int k_stride;
};

__device__ __forceinline__ TileSmem tile_smem(float* smem, int hd) {
  TileSmem t;
  t.k_stride = hd + 1;
  t.k_s = smem;
  t.v_s = t.k_s + kKeyTile * t.k_stride;
  t.q_s = t.v_s + kKeyTile * hd;
  return t;
}

// What a partial block serves: blockIdx.x is (item, query tile, key chunk), blockIdx.y the KV
// head. it is a copy of the item's metadata; the tile's queries are the (row, head-of-group)
// pairs pair0 .. pair0 + kQpb - 1 of the n_pairs of the item.
template <class Item>
struct BlockWork {
  Item it;
  int64_t chunk;
  int64_t kvh;
  int64_t group;
  int64_t n_pairs;
  int64_t pair0;
};

template <int kQpb, class Launch>
__device__ __forceinline__ auto block_work(const Launch& a) {
  using Item = std::remove_const_t<std::remove_pointer_t<decltype(a.items)>>;
  const int64_t item_idx = find_segment(a.block_begin, a.n_items, blockIdx.x);
  BlockWork<Item> w{a.items[item_idx]};
  const int64_t local = static_cast<int64_t>(blockIdx.x) - a.block_begin[item_idx];
  const int64_t tile = local / w.it.n_chunks;
  w.chunk = local - tile * w.it.n_chunks;
  w.kvh = blockIdx.y;
  w.group = a.n_heads / a.kv_heads;
  w.n_pairs = w.it.n_tokens * w.group;
  w.pair0 = tile * kQpb;
  return w;
}

// Stages the tile's query vectors, pre-scaled, in q_s ([kQpb][hd]): slot = (row, head-of-group)
// pair pair0 + slot. Padding slots get zeros (finite scores, never written out).
template <int kQpb>
__device__ __forceinline__ void stage_queries(float* q_s, const float* q, int64_t pair0, int64_t n_pairs,
                                              int64_t token_offset, int64_t group, int64_t kvh,
                                              int64_t n_heads, int hd, float q_scale, int warp, int lane) {
  for (int slot = warp; slot < kQpb; slot += kWarps) {
    const int64_t pair = pair0 + slot;
    float* dst = q_s + slot * hd;
    if (pair < n_pairs) {
      const int64_t row = token_offset + pair / group;
      const int64_t h = kvh * group + pair % group;
      const float* src = q + (row * n_heads + h) * hd;
      for (int d = lane; d < hd; d += 32) dst[d] = src[d] * q_scale;
    } else {
      for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
    }
  }
}

// Stages one key's K and V rows (hd elements of T, widened to f32) into the shared tiles: lane
// owns dims lane + 32i.
template <typename T>
__device__ __forceinline__ void stage_kv_row(float* k_dst, float* v_dst, const T* k_src, const T* v_src,
                                             int hd, int lane) {
  for (int d = lane; d < hd; d += 32) {
    k_dst[d] = kv_to_f32(k_src[d]);
    v_dst[d] = kv_to_f32(v_src[d]);
  }
}

template <int kQpw, int kDpl>
__device__ __forceinline__ void init_softmax(float (&m)[kQpw], float (&l)[kQpw], float (&o)[kQpw][kDpl]) {
#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    m[s] = -INFINITY;
    l[s] = 0.0f;
#pragma unroll
    for (int k = 0; k < kDpl; ++k) o[s][k] = 0.0f;
  }
}

// Scores: lane j computes key t0 + j against every query of the warp (K read once).
template <int kQpw>
__device__ __forceinline__ void tile_scores(float (&sc)[kQpw], const float* k_s, int k_stride,
                                            const float* q_w, int hd, int lane, int n_keys) {
#pragma unroll
  for (int s = 0; s < kQpw; ++s) sc[s] = 0.0f;
  if (lane < n_keys) {
    const float* k_row = k_s + lane * k_stride;
#pragma unroll 4
    for (int d = 0; d < hd; ++d) {
      const float kd = k_row[d];
#pragma unroll
      for (int s = 0; s < kQpw; ++s) sc[s] = fmaf(q_w[s * hd + d], kd, sc[s]);
    }
  }
}

// One online-softmax step of a query over a key tile: score is -inf where !valid, tile_max is
// the warp max of score. Rescales (m, l, o) to the new max and returns this lane's weight p.
template <int kDpl>
__device__ __forceinline__ float online_softmax_step(bool valid, float score, float tile_max, float& m,
                                                     float& l, float (&o)[kDpl]) {
  const float m_new = fmaxf(m, tile_max);
  const float alpha = exp2f(m - m_new);  // 0 on the first visible tile (m = -inf)
  const float p = valid ? exp2f(score - m_new) : 0.0f;
  l = fmaf(l, alpha, warp_sum(p));
#pragma unroll
  for (int k = 0; k < kDpl; ++k) o[k] *= alpha;
  m = m_new;
  return p;
}

// o += P·V: lane owns output dims lane + 32k; key j's weight comes from lane j.
template <int kQpw, int kDpl>
__device__ __forceinline__ void accumulate_pv(float (&o)[kQpw][kDpl], const float (&p)[kQpw],
                                              const float* v_s, int hd, int lane, int n_keys) {
  for (int j = 0; j < n_keys; ++j) {
    float vj[kDpl];
#pragma unroll
    for (int k = 0; k < kDpl; ++k) {
      const int d = lane + 32 * k;
      vj[k] = d < hd ? v_s[j * hd + d] : 0.0f;
    }
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      const float pj = __shfl_sync(kFullMask, p[s], j);
#pragma unroll
      for (int k = 0; k < kDpl; ++k) o[s][k] = fmaf(pj, vj[k], o[s][k]);
    }
  }
}

// Writes the result of query pair `pair` (row pair / group of item `it`, head kvh * group +
// pair % group) for its chunk: o / l straight to out without a split, else the partial (m, l, o).
// Launch / Item: AttentionLaunch / AttentionItemMeta or the Sparse ones (same fields here).
template <int kDpl, class Launch, class Item>
__device__ __forceinline__ void store_query(const Launch& a, const Item& it, int64_t pair, int64_t group,
                                            int64_t kvh, int64_t chunk, float m, float l,
                                            const float (&o)[kDpl], int hd, int lane) {
  const int64_t h = kvh * group + pair % group;
  if (a.n_chunks_max == 1) {
    const float inv = 1.0f / l;
    float* dst = a.out + ((it.token_offset + pair / group) * a.n_heads + h) * hd;
#pragma unroll
    for (int k = 0; k < kDpl; ++k) {
      const int d = lane + 32 * k;
      if (d < hd) dst[d] = o[k] * inv;
    }
  } else {
    const int64_t idx = ((it.row_begin + pair / group) * a.n_heads + h) * a.n_chunks_max + chunk;
    float* dst = a.partial_o + idx * hd;
#pragma unroll
    for (int k = 0; k < kDpl; ++k) {
      const int d = lane + 32 * k;
      if (d < hd) dst[d] = o[k];
    }
    if (lane == 0) {
      a.partial_m[idx] = m;
      a.partial_l[idx] = l;
    }
  }
}

// The query a merge warp serves: row r of the batch (item item_idx) and head h. False for the
// warps past the last query.
template <class Launch>
__device__ __forceinline__ bool merge_query(const Launch& a, int64_t& r, int64_t& h, int64_t& item_idx) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (w >= a.total_rows * a.n_heads) return false;
  r = w / a.n_heads;
  h = w - r * a.n_heads;
  item_idx = find_segment(a.row_begin, a.n_items, r);
  return true;
}

// Combines the partials base + 0 .. n - 1 (n >= 1, each with l >= 1) of one query into dst:
// out = Σ_c 2^(m_c - M) o_c / Σ_c 2^(m_c - M) l_c with M = max_c m_c.
template <int kDpl, class Launch>
__device__ __forceinline__ void merge_chunks(const Launch& a, int64_t base, int64_t n, float* dst, int hd,
                                             int lane) {
  float mx = -INFINITY;
  for (int64_t c = lane; c < n; c += 32) mx = fmaxf(mx, a.partial_m[base + c]);
  mx = warp_max(mx);

  float acc[kDpl];
#pragma unroll
  for (int k = 0; k < kDpl; ++k) acc[k] = 0.0f;
  float denom = 0.0f;
  for (int64_t c = 0; c < n; ++c) {
    const float weight = exp2f(a.partial_m[base + c] - mx);
    denom = fmaf(weight, a.partial_l[base + c], denom);
    const float* src = a.partial_o + (base + c) * hd;
#pragma unroll
    for (int k = 0; k < kDpl; ++k) {
      const int d = lane + 32 * k;
      if (d < hd) acc[k] = fmaf(weight, src[d], acc[k]);
    }
  }
  const float inv = 1.0f / denom;
#pragma unroll
  for (int k = 0; k < kDpl; ++k) {
    const int d = lane + 32 * k;
    if (d < hd) dst[d] = acc[k] * inv;
  }
}

// Launch layer. Kernels names the kernel pair of one file: `using Launch`, and static
// partial<kDpl, kQpw, T>() (T: the K/V element type) and merge<kDpl>() returning the kernels.
template <class Kernels, int kDpl, int kQpw, typename T>
cudaError_t launch_partial(const typename Kernels::Launch& a, cudaStream_t stream) {
  const size_t smem = attention_smem_bytes(a.head_dim, kQpw);
  auto* kernel = Kernels::template partial<kDpl, kQpw, T>();
  if (smem > 48 * 1024) {
    // Opt-in above the 48 KiB default (head_dim 256 with 4 queries per warp: ~80 KiB).
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(a.total_blocks), static_cast<unsigned>(a.kv_heads));
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <class Kernels, int kDpl, typename T>
cudaError_t launch_for_dim(const typename Kernels::Launch& a, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (a.queries_per_warp) {
    case 1:
      err = launch_partial<Kernels, kDpl, 1, T>(a, stream);
      break;
    case 2:
      err = launch_partial<Kernels, kDpl, 2, T>(a, stream);
      break;
    default:
      err = launch_partial<Kernels, kDpl, 4, T>(a, stream);
      break;
  }
  if (err != cudaSuccess || a.n_chunks_max == 1) return err;
  // The merge reads f32 partials only: one instance per kDpl, whatever T.
  const int64_t warps = a.total_rows * a.n_heads;
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  auto* merge = Kernels::template merge<kDpl>();
  merge<<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Dims per lane by head_dim (<= 64, <= 128, <= kAttentionMaxHeadDim).
template <class Kernels, typename T>
cudaError_t launch_for_type(const typename Kernels::Launch& a, cudaStream_t stream) {
  if (a.head_dim <= 64) return launch_for_dim<Kernels, 2, T>(a, stream);
  if (a.head_dim <= 128) return launch_for_dim<Kernels, 4, T>(a, stream);
  return launch_for_dim<Kernels, 8, T>(a, stream);
}

// By the K/V element type; nothing to do without work.
template <class Kernels>
cudaError_t launch_split_attention(const typename Kernels::Launch& a, cudaStream_t stream) {
  if (a.total_blocks <= 0 || a.total_rows <= 0) return cudaSuccess;
  switch (a.kv_type) {
    case KvType::kF16:
      return launch_for_type<Kernels, __half>(a, stream);
    case KvType::kBF16:
      return launch_for_type<Kernels, __nv_bfloat16>(a, stream);
    case KvType::kF32:
      return launch_for_type<Kernels, float>(a, stream);
  }
  return cudaErrorInvalidValue;  // not a KvType (the planners never produce one)
}

}  // namespace

}  // namespace specontext::gpu::kernels
