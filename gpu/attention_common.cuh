// The flash-decoding attention of both the dense (kernels_attention.cu) and the sparse
// (kernels_sparse.cu) path: one partial and one merge kernel templated on a KV reader, their
// pieces (warp reductions, the per-tile online-softmax step, the P·V accumulation, the (m, l, o)
// output of a chunk, the merge of the chunks) and the launch layer.
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

// ---- the kernel pair of both attentions ----
// One partial kernel and one merge kernel for dense and sparse attention, templated on a KV
// reader Kv that says how a block reads its keys (kernels_attention.cu's PagedCausalKv: the paged
// cache under the causal mask; kernels_sparse.cu's WorkingSetKv: the first counts[h] rows of a
// working set, no mask):
//   Launch, kCausal;
//   key_range<kQpb>(a, it, chunk, kvh, group, n_pairs, pair0, begin, end): the keys of the
//     block's chunk that some query of its tile sees; false when none (the block exits);
//   no_keys<kQpb>(...): what such a block writes first (sparse without a split: zeros);
//   Rows<T>(a, it, kvh, hd) with at(pos, k, v): where K and V rows of key pos start;
//   query_pos(it, pair, group): causal only, the position of query pair (its last visible key);
//   merge_chunks_of(a, item_idx, r, h, row): the chunks holding keys of batch row r (item item_idx)
//     for head h, and its output row.

// Work split: a block serves one (item, query tile, KV head, key chunk). A query tile is
// kWarps · kQpw consecutive (row, head-of-group) pairs of one item that share the KV head, so
// every K/V tile staged in shared memory is reused by all of them (GQA decode: the group's heads;
// prefill: consecutive rows). Keys are streamed in tiles of 32 (one key per lane for the scores);
// each warp keeps an online softmax (running max m, sum l, unnormalised output o) per query in
// registers, in log2 units (q is pre-scaled by log2(e)/sqrt(head_dim), exp2f). With a single
// chunk the block writes o / l directly, else the partial (m, l, o) for the merge kernel.
// T: element type of the K/V rows (float, __half, __nv_bfloat16), widened to f32 while the tile
// is staged, so shared memory and everything after it are f32 for every T.
// minBlocks 4 lets ptxas use up to 128 registers; without it ptxas picked 64-72 and spilled for
// some instantiations on sm_90.
template <class Kv, int kDpl, int kQpw, typename T>
__global__ void __launch_bounds__(kThreads, 4) split_attention_partial_kernel(const typename Kv::Launch a) {
  constexpr int kQpb = kWarps * kQpw;
  extern __shared__ float smem[];
  const int hd = static_cast<int>(a.head_dim);
  const auto [k_s, v_s, q_s, k_stride] = tile_smem(smem, hd);
  const auto [it, chunk, kvh, group, n_pairs, pair0] = block_work<kQpb>(a);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  int64_t key_begin = 0;
  int64_t key_end = 0;
  if (!Kv::template key_range<kQpb>(a, it, chunk, kvh, group, n_pairs, pair0, key_begin, key_end)) {
    Kv::template no_keys<kQpb>(a, it, kvh, group, n_pairs, pair0, hd, warp, lane);
    return;  // block-uniform
  }
  stage_queries<kQpb>(q_s, a.q, pair0, n_pairs, it.token_offset, group, kvh, a.n_heads, hd, a.scale * kLog2e,
                      warp, lane);

  float m[kQpw];
  float l[kQpw];
  float o[kQpw][kDpl];
  init_softmax(m, l, o);
  // Causal: this warp's queries (tile slots warp * kQpw + s); qpos -1 masks every key (padding).
  int64_t qpos[kQpw];
  if constexpr (Kv::kCausal) {
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      const int64_t pair = pair0 + warp * kQpw + s;
      qpos[s] = pair < n_pairs ? Kv::query_pos(it, pair, group) : -1;
    }
  }

  const typename Kv::template Rows<T> rows(a, it, kvh, hd);
  const float* q_w = q_s + warp * kQpw * hd;

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
    const int n_keys = static_cast<int>(min(static_cast<int64_t>(kKeyTile), key_end - t0));
    __syncthreads();  // q_s is written (first tile) / the previous K/V tile is consumed
    for (int j = warp; j < n_keys; j += kWarps) {
      const T* k_row = nullptr;
      const T* v_row = nullptr;
      rows.at(t0 + j, k_row, v_row);
      stage_kv_row(k_s + j * k_stride, v_s + j * hd, k_row, v_row, hd, lane);
    }
    __syncthreads();

    float sc[kQpw];
    tile_scores(sc, k_s, k_stride, q_w, hd, lane, n_keys);

    const int64_t key_pos = t0 + lane;
    float p[kQpw];
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      bool valid = lane < n_keys;
      if constexpr (Kv::kCausal) valid = valid && key_pos <= qpos[s];
      const float score = valid ? sc[s] : -INFINITY;
      const float tile_max = warp_max(score);
      p[s] = 0.0f;
      // Warp-uniform: no key of this tile for query s (only under a mask; else n_keys >= 1).
      if constexpr (Kv::kCausal) {
        if (tile_max == -INFINITY) continue;
      }
      p[s] = online_softmax_step(valid, score, tile_max, m[s], l[s], o[s]);
    }

    accumulate_pv(o, p, v_s, hd, lane, n_keys);
  }

#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    if constexpr (Kv::kCausal) {
      if (qpos[s] < key_begin) continue;  // padding slot, or no key of this chunk is visible
    }
    const int64_t pair = pair0 + warp * kQpw + s;
    if constexpr (!Kv::kCausal) {
      if (pair >= n_pairs) continue;  // padding slot
    }
    store_query(a, it, pair, group, kvh, chunk, m[s], l[s], o[s], hd, lane);
  }
}

// One warp per (row, head): combines the chunks that hold keys of that query (every such chunk
// was written and has l >= 1); none (an empty working set) gives zeros.
template <class Kv, int kDpl>
__global__ void __launch_bounds__(kThreads) split_attention_merge_kernel(const typename Kv::Launch a) {
  int64_t r = 0;
  int64_t h = 0;
  int64_t item_idx = 0;
  if (!merge_query(a, r, h, item_idx)) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int hd = static_cast<int>(a.head_dim);
  int64_t row = 0;
  const int64_t n = Kv::merge_chunks_of(a, item_idx, r, h, row);
  const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;
  float* dst = a.out + (row * a.n_heads + h) * hd;
  if constexpr (!Kv::kCausal) {
    if (n == 0) {  // empty working set (a causal query always sees itself)
      for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
      return;
    }
  }
  merge_chunks<kDpl>(a, base, n, dst, hd, lane);
}

// Launch layer: the kernel pair over the reader Kv, by K/V element type, head_dim and queries per
// warp.
template <class Kv, int kDpl, int kQpw, typename T>
cudaError_t launch_partial(const typename Kv::Launch& a, cudaStream_t stream) {
  const size_t smem = attention_smem_bytes(a.head_dim, kQpw);
  auto* kernel = split_attention_partial_kernel<Kv, kDpl, kQpw, T>;
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

template <class Kv, int kDpl, typename T>
cudaError_t launch_for_dim(const typename Kv::Launch& a, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (a.queries_per_warp) {
    case 1:
      err = launch_partial<Kv, kDpl, 1, T>(a, stream);
      break;
    case 2:
      err = launch_partial<Kv, kDpl, 2, T>(a, stream);
      break;
    default:
      err = launch_partial<Kv, kDpl, 4, T>(a, stream);
      break;
  }
  if (err != cudaSuccess || a.n_chunks_max == 1) return err;
  // The merge reads f32 partials only: one instance per kDpl, whatever T.
  const int64_t warps = a.total_rows * a.n_heads;
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  auto* merge = split_attention_merge_kernel<Kv, kDpl>;
  merge<<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Dims per lane by head_dim (<= 64, <= 128, <= kAttentionMaxHeadDim).
template <class Kv, typename T>
cudaError_t launch_for_type(const typename Kv::Launch& a, cudaStream_t stream) {
  if (a.head_dim <= 64) return launch_for_dim<Kv, 2, T>(a, stream);
  if (a.head_dim <= 128) return launch_for_dim<Kv, 4, T>(a, stream);
  return launch_for_dim<Kv, 8, T>(a, stream);
}

// By the K/V element type; nothing to do without work.
template <class Kv>
cudaError_t launch_split_attention(const typename Kv::Launch& a, cudaStream_t stream) {
  if (a.total_blocks <= 0 || a.total_rows <= 0) return cudaSuccess;
  switch (a.kv_type) {
    case KvType::kF16:
      return launch_for_type<Kv, __half>(a, stream);
    case KvType::kBF16:
      return launch_for_type<Kv, __nv_bfloat16>(a, stream);
    case KvType::kF32:
      return launch_for_type<Kv, float>(a, stream);
  }
  return cudaErrorInvalidValue;  // not a KvType (the planners never produce one)
}

}  // namespace

}  // namespace specontext::gpu::kernels
