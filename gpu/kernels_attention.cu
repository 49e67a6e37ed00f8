// Causal attention over the paged KV cache, flash-decoding style.
//
// Work split: a block serves one (item, query tile, KV head, key chunk). A query tile is
// kAttentionWarps · kQpw consecutive (row, head-of-group) pairs of one item that share the KV
// head, so every K/V tile staged in shared memory is reused by all of them (GQA decode: the
// group's heads; prefill: consecutive rows). Keys are streamed in tiles of 32 (one key per lane
// for the scores); each warp keeps an online softmax (running max m, sum l, unnormalised output o)
// per query in registers, in log2 units (q is pre-scaled by log2(e)/sqrt(head_dim), exp2f).
//
// With a single chunk (enough blocks without splitting) the block writes o / l directly. Else
// every (query, chunk) writes partial (m, l, o) and the merge kernel combines the chunks of each
// query: out = Σ_c 2^(m_c - M) o_c / Σ_c 2^(m_c - M) l_c with M = max_c m_c. A query at position
// p has keys in chunks 0 .. p / chunk_size, and each of those holds at least one key <= p, so
// every partial that the merge reads was written and has l >= 1.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/attention_common.cuh"
#include "gpu/kernels.h"

namespace specontext::gpu::kernels {

namespace {

// T: element type of the K/V pages (float, __half, __nv_bfloat16), widened to f32 while the tile
// is staged, so shared memory and everything after it are f32 for every T.
// minBlocks 4 lets ptxas use up to 128 registers; without it ptxas picked 64-72 and spilled for
// some instantiations on sm_90.
template <int kDpl, int kQpw, typename T>
__global__ void __launch_bounds__(kThreads, 4) attention_partial_kernel(const AttentionLaunch a) {
  constexpr int kQpb = kWarps * kQpw;
  extern __shared__ float smem[];
  const int hd = static_cast<int>(a.head_dim);
  const auto [k_s, v_s, q_s, k_stride] = tile_smem(smem, hd);
  const auto [it, chunk, kvh, group, n_pairs, pair0] = block_work<kQpb>(a);
  const int64_t last_pair = min(pair0 + kQpb, n_pairs) - 1;
  const int64_t max_qpos = it.start_pos + last_pair / group;
  const int64_t key_begin = chunk * a.chunk_size;
  if (key_begin > max_qpos) return;  // causal: no query of this tile reaches this chunk
  const int64_t key_end = min(key_begin + a.chunk_size, max_qpos + 1);

  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  stage_queries<kQpb>(q_s, a.q, pair0, n_pairs, it.token_offset, group, kvh, a.n_heads, hd, a.scale * kLog2e,
                      warp, lane);

  // This warp's queries: tile slots warp * kQpw + s. qpos -1 masks every key (padding slot).
  int64_t qpos[kQpw];
  float m[kQpw];
  float l[kQpw];
  float o[kQpw][kDpl];
  init_softmax(m, l, o);
#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    const int64_t pair = pair0 + warp * kQpw + s;
    qpos[s] = pair < n_pairs ? it.start_pos + pair / group : -1;
  }

  void* const* k_pages = a.page_table + it.page_table_offset;
  void* const* v_pages = k_pages + it.n_pages;
  const int64_t page_size = it.page_size;
  const float* q_w = q_s + warp * kQpw * hd;

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
    const int n_keys = static_cast<int>(min(static_cast<int64_t>(kKeyTile), key_end - t0));
    __syncthreads();  // q_s is written (first tile) / the previous K/V tile is consumed
    for (int j = warp; j < n_keys; j += kWarps) {
      const int64_t pos = t0 + j;
      const int64_t page = pos / page_size;
      const int64_t off = (kvh * page_size + (pos - page * page_size)) * hd;
      stage_kv_row(k_s + j * k_stride, v_s + j * hd, static_cast<const T*>(k_pages[page]) + off,
                   static_cast<const T*>(v_pages[page]) + off, hd, lane);
    }
    __syncthreads();

    float sc[kQpw];
    tile_scores(sc, k_s, k_stride, q_w, hd, lane, n_keys);

    const int64_t key_pos = t0 + lane;
    float p[kQpw];
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      const bool valid = lane < n_keys && key_pos <= qpos[s];
      const float score = valid ? sc[s] : -INFINITY;
      const float tile_max = warp_max(score);
      p[s] = 0.0f;
      if (tile_max == -INFINITY) continue;  // warp-uniform: no key of this tile for query s
      p[s] = online_softmax_step(valid, score, tile_max, m[s], l[s], o[s]);
    }

    accumulate_pv(o, p, v_s, hd, lane, n_keys);
  }

#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    if (qpos[s] < key_begin) continue;  // padding slot, or no key of this chunk is visible
    const int64_t pair = pair0 + warp * kQpw + s;
    store_query(a, it, pair, group, kvh, chunk, m[s], l[s], o[s], hd, lane);
  }
}

// One warp per (row, head): combines the chunks 0 .. qpos / chunk_size of that query.
template <int kDpl>
__global__ void __launch_bounds__(kThreads) attention_merge_kernel(const AttentionLaunch a) {
  int64_t r = 0;
  int64_t h = 0;
  int64_t item_idx = 0;
  if (!merge_query(a, r, h, item_idx)) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int hd = static_cast<int>(a.head_dim);
  const int64_t local = r - a.row_begin[item_idx];
  const int64_t row = a.items[item_idx].token_offset + local;
  const int64_t qpos = a.items[item_idx].start_pos + local;
  const int64_t n = qpos / a.chunk_size + 1;
  const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;
  merge_chunks<kDpl>(a, base, n, a.out + (row * a.n_heads + h) * hd, hd, lane);
}

// The kernel pair for the shared launch layer of attention_common.cuh.
struct DenseKernels {
  using Launch = AttentionLaunch;
  template <int kDpl, int kQpw, typename T>
  static auto partial() {
    return attention_partial_kernel<kDpl, kQpw, T>;
  }
  template <int kDpl>
  static auto merge() {
    return attention_merge_kernel<kDpl>;
  }
};

}  // namespace

size_t attention_smem_bytes(int64_t head_dim, int queries_per_warp) {
  const int64_t floats = kAttentionKeyTile * (head_dim + 1) + kAttentionKeyTile * head_dim +
                         static_cast<int64_t>(kWarps) * queries_per_warp * head_dim;
  return static_cast<size_t>(floats) * sizeof(float);
}

cudaError_t launch_attention(const AttentionLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  return launch_split_attention<DenseKernels>(a, stream);
}

}  // namespace specontext::gpu::kernels
