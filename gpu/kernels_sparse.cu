// Sparse decode (SpeContext): kv_gather fills per-sequence working sets from the paged cache,
// and attention runs over a working set instead of the whole cache.
//
// Attention uses the flash-decoding split of kernels_attention.cu: a block serves (item, query
// tile, slot chunk) x KV head, stages 32 K/V rows at a time in shared memory for the tile's
// queries (the GQA group's heads of the item's rows), and keeps an online softmax per query in
// registers in log2 units. Differences: the rows of one head are contiguous
// ([kv_heads][slots][head_dim]), so there is no page lookup; there is no causal mask (every row
// sees the whole working set); and the key range of head h is [0, counts[h]), so blocks whose
// chunk starts at or after counts[h] exit, and a head with counts[h] == 0 yields zeros.
// Every chunk the merge reads holds at least one key, so its l >= 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "gpu/attention_common.cuh"
#include "gpu/kernels.h"

namespace specontext::gpu::kernels {

namespace {

constexpr int kGatherThreads = 256;  // 8 entries per block
constexpr int64_t kMaxGatherBlocks = 1 << 16;

// ---- kv_gather ----

// Unit is the copy unit: uint4 (16 bytes; rows of a multiple of 16 bytes, every base 16-byte
// aligned), else the element itself (uint32_t for f32, uint16_t for f16 / bf16), so the copy is
// bit-exact for every element type. A template parameter, and the copy loops are unrolled at most
// twice (256 f32 dims are two uint4 per lane): a runtime branch with fully unrolled loops made
// ptxas spill.
template <typename Unit>
__global__ void __launch_bounds__(kGatherThreads) kv_gather_kernel(const KvGatherLaunch g) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps_per_block = kGatherThreads / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  const int64_t elem_bytes = kv_type_bytes(g.kv_type);
  const int units = static_cast<int>(g.head_dim * elem_bytes / static_cast<int64_t>(sizeof(Unit)));
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5); w < g.n_entries;
       w += stride) {
    const GatherEntryMeta e = g.entries[w];
    // 32-bit division (the planner bounds page_size by INT_MAX); a 64-bit one is a called routine.
    const int32_t page = e.token / static_cast<int32_t>(g.page_size);
    // Byte offsets of the rows (element offsets times the element size).
    const int64_t src = (e.kv_head * g.page_size + (e.token - static_cast<int64_t>(page) * g.page_size)) *
                        g.head_dim * elem_bytes;
    const int64_t dst = (e.kv_head * g.slots + e.slot) * g.head_dim * elem_bytes;
    const Unit* k_src =
        reinterpret_cast<const Unit*>(static_cast<const char*>(g.page_table[page - g.first_page]) + src);
    const Unit* v_src = reinterpret_cast<const Unit*>(
        static_cast<const char*>(g.page_table[g.n_pages + page - g.first_page]) + src);
    Unit* k_dst = reinterpret_cast<Unit*>(static_cast<char*>(g.ws_k) + dst);
    Unit* v_dst = reinterpret_cast<Unit*>(static_cast<char*>(g.ws_v) + dst);
#pragma unroll 2
    for (int i = lane; i < units; i += 32) {
      k_dst[i] = k_src[i];
      v_dst[i] = v_src[i];
    }
  }
}

// ---- sparse attention ----

// T: element type of the working set, widened to f32 while staging (as attention_partial_kernel).
// minBlocks 4 as in attention_partial_kernel: lets ptxas use up to 128 registers without spills.
template <int kDpl, int kQpw, typename T>
__global__ void __launch_bounds__(kThreads, 4)
    sparse_attention_partial_kernel(const SparseAttentionLaunch a) {
  constexpr int kQpb = kWarps * kQpw;
  extern __shared__ float smem[];
  const int hd = static_cast<int>(a.head_dim);
  const auto [k_s, v_s, q_s, k_stride] = tile_smem(smem, hd);
  const auto [it, chunk, kvh, group, n_pairs, pair0] = block_work<kQpb>(a);
  const int64_t count = a.counts[it.counts_offset + kvh];
  const int64_t key_begin = chunk * a.chunk_size;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);

  if (key_begin >= count) {
    // No slot of this head in this chunk. Without a split (chunk 0 only) that means an empty
    // working set: the block owns the output and writes zeros. With a split the merge does.
    if (a.n_chunks_max == 1) {
      for (int slot = warp; slot < kQpb; slot += kWarps) {
        const int64_t pair = pair0 + slot;
        if (pair >= n_pairs) break;
        const int64_t row = it.token_offset + pair / group;
        const int64_t h = kvh * group + pair % group;
        float* dst = a.out + (row * a.n_heads + h) * hd;
        for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
      }
    }
    return;  // block-uniform
  }
  const int64_t key_end = min(key_begin + a.chunk_size, count);
  stage_queries<kQpb>(q_s, a.q, pair0, n_pairs, it.token_offset, group, kvh, a.n_heads, hd, a.scale * kLog2e,
                      warp, lane);

  float m[kQpw];
  float l[kQpw];
  float o[kQpw][kDpl];
  init_softmax(m, l, o);

  const T* k_head = static_cast<const T*>(it.k) + kvh * it.slots * hd;
  const T* v_head = static_cast<const T*>(it.v) + kvh * it.slots * hd;
  const float* q_w = q_s + warp * kQpw * hd;

  for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeyTile) {
    const int n_keys = static_cast<int>(min(static_cast<int64_t>(kKeyTile), key_end - t0));
    __syncthreads();  // q_s is written (first tile) / the previous K/V tile is consumed
    for (int j = warp; j < n_keys; j += kWarps) {
      stage_kv_row(k_s + j * k_stride, v_s + j * hd, k_head + (t0 + j) * hd, v_head + (t0 + j) * hd, hd,
                   lane);
    }
    __syncthreads();

    float sc[kQpw];
    tile_scores(sc, k_s, k_stride, q_w, hd, lane, n_keys);

    // n_keys >= 1, so every tile max is finite (no masked-out queries without a causal mask).
    const bool valid = lane < n_keys;
    float p[kQpw];
#pragma unroll
    for (int s = 0; s < kQpw; ++s) {
      const float score = valid ? sc[s] : -INFINITY;
      p[s] = online_softmax_step(valid, score, warp_max(score), m[s], l[s], o[s]);
    }

    accumulate_pv(o, p, v_s, hd, lane, n_keys);
  }

#pragma unroll
  for (int s = 0; s < kQpw; ++s) {
    const int64_t pair = pair0 + warp * kQpw + s;
    if (pair >= n_pairs) continue;  // padding slot
    store_query(a, it, pair, group, kvh, chunk, m[s], l[s], o[s], hd, lane);
  }
}

// One warp per (row, head): combines chunks 0 .. ceil(counts[kvh] / chunk_size) - 1.
template <int kDpl>
__global__ void __launch_bounds__(kThreads) sparse_attention_merge_kernel(const SparseAttentionLaunch a) {
  int64_t r = 0;
  int64_t h = 0;
  int64_t item_idx = 0;
  if (!merge_query(a, r, h, item_idx)) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int hd = static_cast<int>(a.head_dim);
  const SparseItemMeta& it = a.items[item_idx];
  const int64_t row = it.token_offset + (r - a.row_begin[item_idx]);
  const int64_t count = a.counts[it.counts_offset + h / (a.n_heads / a.kv_heads)];
  const int64_t n = (count + a.chunk_size - 1) / a.chunk_size;
  const int64_t base = (r * a.n_heads + h) * a.n_chunks_max;
  float* dst = a.out + (row * a.n_heads + h) * hd;
  if (n == 0) {  // empty working set
    for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
    return;
  }

  merge_chunks<kDpl>(a, base, n, dst, hd, lane);
}

// The kernel pair for the shared launch layer of attention_common.cuh.
struct SparseKernels {
  using Launch = SparseAttentionLaunch;
  template <int kDpl, int kQpw, typename T>
  static auto partial() {
    return sparse_attention_partial_kernel<kDpl, kQpw, T>;
  }
  template <int kDpl>
  static auto merge() {
    return sparse_attention_merge_kernel<kDpl>;
  }
};

}  // namespace

cudaError_t launch_kv_gather(const KvGatherLaunch& g, cudaStream_t stream) {
  clear_stale_error();
  if (g.n_entries <= 0) return cudaSuccess;
  constexpr int64_t kEntriesPerBlock = kGatherThreads / 32;
  const int64_t blocks = std::min((g.n_entries + kEntriesPerBlock - 1) / kEntriesPerBlock, kMaxGatherBlocks);
  const unsigned grid = static_cast<unsigned>(blocks);
  if (g.vec16) {
    kv_gather_kernel<uint4><<<grid, kGatherThreads, 0, stream>>>(g);
  } else if (kv_type_bytes(g.kv_type) == 4) {
    kv_gather_kernel<uint32_t><<<grid, kGatherThreads, 0, stream>>>(g);
  } else {
    kv_gather_kernel<uint16_t><<<grid, kGatherThreads, 0, stream>>>(g);
  }
  return cudaGetLastError();
}

cudaError_t launch_attention_sparse(const SparseAttentionLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  return launch_split_attention<SparseKernels>(a, stream);
}

}  // namespace specontext::gpu::kernels
