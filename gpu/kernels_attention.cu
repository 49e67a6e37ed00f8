// Causal attention over the paged KV cache, flash-decoding style: the kernel pair of
// attention_common.cuh (work split, online softmax, split-K) over the reader PagedCausalKv.
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

// The paged cache under the causal mask: the query of row t (position start_pos + t) sees keys
// 0 .. start_pos + t, through the item's page table.
struct PagedCausalKv {
  using Launch = AttentionLaunch;
  static constexpr bool kCausal = true;

  // Keys of this chunk up to the tile's last query; none when the chunk starts beyond it.
  template <int kQpb>
  __device__ __forceinline__ static bool key_range(const Launch& a, const AttentionItemMeta& it,
                                                   int64_t chunk, int64_t /*kvh*/, int64_t group,
                                                   int64_t n_pairs, int64_t pair0, int64_t& key_begin,
                                                   int64_t& key_end) {
    const int64_t last_pair = min(pair0 + kQpb, n_pairs) - 1;
    const int64_t max_qpos = it.start_pos + last_pair / group;
    key_begin = chunk * a.chunk_size;
    if (key_begin > max_qpos) return false;  // causal: no query of this tile reaches this chunk
    key_end = min(key_begin + a.chunk_size, max_qpos + 1);
    return true;
  }
  template <int kQpb>
  __device__ __forceinline__ static void no_keys(const Launch&, const AttentionItemMeta&, int64_t, int64_t,
                                                 int64_t, int64_t, int, int, int) {}  // nothing to write

  __device__ __forceinline__ static int64_t query_pos(const AttentionItemMeta& it, int64_t pair,
                                                      int64_t group) {
    return it.start_pos + pair / group;
  }

  template <typename T>
  struct Rows {
    void* const* k_pages;
    void* const* v_pages;
    int64_t page_size;
    int64_t kvh;
    int hd;
    __device__ __forceinline__ Rows(const Launch& a, const AttentionItemMeta& it, int64_t kvh_, int hd_)
        : k_pages(a.page_table + it.page_table_offset),
          v_pages(k_pages + it.n_pages),
          page_size(it.page_size),
          kvh(kvh_),
          hd(hd_) {}
    __device__ __forceinline__ void at(int64_t pos, const T*& k, const T*& v) const {
      const int64_t page = pos / page_size;
      const int64_t off = (kvh * page_size + (pos - page * page_size)) * hd;
      k = static_cast<const T*>(k_pages[page]) + off;
      v = static_cast<const T*>(v_pages[page]) + off;
    }
  };

  // A query at position p has keys in chunks 0 .. p / chunk_size, each holding a key <= p.
  __device__ __forceinline__ static int64_t merge_chunks_of(const Launch& a, int64_t item_idx, int64_t r,
                                                            int64_t /*h*/, int64_t& row) {
    const int64_t local = r - a.row_begin[item_idx];
    row = a.items[item_idx].token_offset + local;
    const int64_t qpos = a.items[item_idx].start_pos + local;
    return qpos / a.chunk_size + 1;
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
  return launch_split_attention<PagedCausalKv>(a, stream);
}

}  // namespace specontext::gpu::kernels
