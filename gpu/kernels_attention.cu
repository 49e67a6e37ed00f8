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

#include "gpu/kernels.h"

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

// minBlocks 4 lets ptxas use up to 128 registers; without it ptxas picked 64-72 and spilled for
// some instantiations on sm_90.
template <int kDpl, int kQpw>
__global__ void __launch_bounds__(kThreads, 4) attention_partial_kernel(const AttentionLaunch a) {
  constexpr int kQpb = kWarps * kQpw;
  extern __shared__ float smem[];
  const int hd = static_cast<int>(a.head_dim);
  const int k_stride = hd + 1;  // odd stride (even head_dim): lane j reading key row j is conflict-free
  float* k_s = smem;                      // [kKeyTile][hd + 1]
  float* v_s = k_s + kKeyTile * k_stride;  // [kKeyTile][hd]
  float* q_s = v_s + kKeyTile * hd;        // [kQpb][hd], pre-scaled

  const int64_t item_idx = find_segment(a.block_begin, a.n_items, blockIdx.x);
  const AttentionItemMeta it = a.items[item_idx];
  const int64_t local = static_cast<int64_t>(blockIdx.x) - a.block_begin[item_idx];
  const int64_t tile = local / it.n_chunks;
  const int64_t chunk = local - tile * it.n_chunks;
  const int64_t kvh = blockIdx.y;
  const int64_t group = a.n_heads / a.kv_heads;
  const int64_t n_pairs = it.n_tokens * group;
  const int64_t pair0 = tile * kQpb;
  const int64_t last_pair = min(pair0 + kQpb, n_pairs) - 1;
  const int64_t max_qpos = it.start_pos + last_pair / group;
  const int64_t key_begin = chunk * a.chunk_size;
  if (key_begin > max_qpos) return;  // causal: no query of this tile reaches this chunk
  const int64_t key_end = min(key_begin + a.chunk_size, max_qpos + 1);

  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  const float q_scale = a.scale * kLog2e;

  for (int slot = warp; slot < kQpb; slot += kWarps) {
    const int64_t pair = pair0 + slot;
    float* dst = q_s + slot * hd;
    if (pair < n_pairs) {
      const int64_t row = it.token_offset + pair / group;
      const int64_t h = kvh * group + pair % group;
      const float* src = a.q + (row * a.n_heads + h) * hd;
      for (int d = lane; d < hd; d += 32) dst[d] = src[d] * q_scale;
    } else {
      for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
    }
  }

  // This warp's queries: tile slots warp * kQpw + s. qpos -1 masks every key (padding slot).
  int64_t qpos[kQpw];
  float m[kQpw];
  float l[kQpw];
  float o[kQpw][kDpl];
#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    const int64_t pair = pair0 + warp * kQpw + s;
    qpos[s] = pair < n_pairs ? it.start_pos + pair / group : -1;
    m[s] = -INFINITY;
    l[s] = 0.0f;
#pragma unroll
    for (int k = 0; k < kDpl; ++k) o[s][k] = 0.0f;
  }

  float* const* k_pages = a.page_table + it.page_table_offset;
  float* const* v_pages = k_pages + it.n_pages;
  const int64_t page_size = it.page_size;
  const float* q_w = q_s + warp * kQpw * hd;

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
    const int n_keys = static_cast<int>(min(static_cast<int64_t>(kKeyTile), key_end - t0));
    __syncthreads();  // q_s is written (first tile) / the previous K/V tile is consumed
    for (int j = warp; j < n_keys; j += kWarps) {
      const int64_t pos = t0 + j;
      const int64_t page = pos / page_size;
      const int64_t off = (kvh * page_size + (pos - page * page_size)) * hd;
      const float* k_src = k_pages[page] + off;
      const float* v_src = v_pages[page] + off;
      for (int d = lane; d < hd; d += 32) {
        k_s[j * k_stride + d] = k_src[d];
        v_s[j * hd + d] = v_src[d];
      }
    }
    __syncthreads();

    // Scores: lane j computes key t0 + j against every query of the warp (K read once).
    float sc[kQpw];
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

    const int64_t key_pos = t0 + lane;
    float p[kQpw];
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      const bool valid = lane < n_keys && key_pos <= qpos[s];
      const float score = valid ? sc[s] : -INFINITY;
      const float tile_max = warp_max(score);
      p[s] = 0.0f;
      if (tile_max == -INFINITY) continue;  // warp-uniform: no key of this tile for query s
      const float m_new = fmaxf(m[s], tile_max);
      const float alpha = exp2f(m[s] - m_new);  // 0 on the first visible tile (m = -inf)
      p[s] = valid ? exp2f(score - m_new) : 0.0f;
      l[s] = fmaf(l[s], alpha, warp_sum(p[s]));
#pragma unroll
      for (int k = 0; k < kDpl; ++k) o[s][k] *= alpha;
      m[s] = m_new;
    }

    // o += P·V: lane owns output dims lane + 32k; key j's weight comes from lane j.
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

#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    if (qpos[s] < key_begin) continue;  // padding slot, or no key of this chunk is visible
    const int64_t pair = pair0 + warp * kQpw + s;
    const int64_t row = it.token_offset + pair / group;
    const int64_t h = kvh * group + pair % group;
    if (a.n_chunks_max == 1) {
      const float inv = 1.0f / l[s];
      float* dst = a.out + (row * a.n_heads + h) * hd;
#pragma unroll
      for (int k = 0; k < kDpl; ++k) {
        const int d = lane + 32 * k;
        if (d < hd) dst[d] = o[s][k] * inv;
      }
    } else {
      const int64_t idx = ((it.row_begin + pair / group) * a.n_heads + h) * a.n_chunks_max + chunk;
      float* dst = a.partial_o + idx * hd;
#pragma unroll
      for (int k = 0; k < kDpl; ++k) {
        const int d = lane + 32 * k;
        if (d < hd) dst[d] = o[s][k];
      }
      if (lane == 0) {
        a.partial_m[idx] = m[s];
        a.partial_l[idx] = l[s];
      }
    }
  }
}

// One warp per (row, head): combines the chunks 0 .. qpos / chunk_size of that query.
template <int kDpl>
__global__ void __launch_bounds__(kThreads) attention_merge_kernel(const AttentionLaunch a) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (w >= a.total_rows * a.n_heads) return;
  const int hd = static_cast<int>(a.head_dim);
  const int64_t r = w / a.n_heads;
  const int64_t h = w - r * a.n_heads;
  const int64_t item_idx = find_segment(a.row_begin, a.n_items, r);
  const int64_t local = r - a.row_begin[item_idx];
  const int64_t row = a.items[item_idx].token_offset + local;
  const int64_t qpos = a.items[item_idx].start_pos + local;
  const int64_t n = qpos / a.chunk_size + 1;
  const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;

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
  float* dst = a.out + (row * a.n_heads + h) * hd;
#pragma unroll
  for (int k = 0; k < kDpl; ++k) {
    const int d = lane + 32 * k;
    if (d < hd) dst[d] = acc[k] * inv;
  }
}

template <int kDpl, int kQpw>
cudaError_t launch_partial(const AttentionLaunch& a, cudaStream_t stream) {
  const size_t smem = attention_smem_bytes(a.head_dim, kQpw);
  auto* kernel = attention_partial_kernel<kDpl, kQpw>;
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

template <int kDpl>
cudaError_t launch_for_dim(const AttentionLaunch& a, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  switch (a.queries_per_warp) {
    case 1: err = launch_partial<kDpl, 1>(a, stream); break;
    case 2: err = launch_partial<kDpl, 2>(a, stream); break;
    default: err = launch_partial<kDpl, 4>(a, stream); break;
  }
  if (err != cudaSuccess || a.n_chunks_max == 1) return err;
  const int64_t warps = a.total_rows * a.n_heads;
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  attention_merge_kernel<kDpl><<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

size_t attention_smem_bytes(int64_t head_dim, int queries_per_warp) {
  const int64_t floats = kAttentionKeyTile * (head_dim + 1) + kAttentionKeyTile * head_dim +
                         static_cast<int64_t>(kWarps) * queries_per_warp * head_dim;
  return static_cast<size_t>(floats) * sizeof(float);
}

cudaError_t launch_attention(const AttentionLaunch& a, cudaStream_t stream) {
  if (a.total_blocks <= 0 || a.total_rows <= 0) return cudaSuccess;
  if (a.head_dim <= 64) return launch_for_dim<2>(a, stream);
  if (a.head_dim <= 128) return launch_for_dim<4>(a, stream);
  return launch_for_dim<8>(a, stream);
}

}  // namespace specontext::gpu::kernels
