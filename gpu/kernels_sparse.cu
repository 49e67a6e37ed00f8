// Sparse decode (SpeContext): kv_gather fills per-sequence working sets from the paged cache,
// and attention runs over a working set instead of the whole cache, or (attention_indexed, layers
// in device memory) over the selected positions of the paged cache in place.
//
// Attention is the kernel pair of attention_common.cuh (the flash-decoding split of
// kernels_attention.cu) over the reader WorkingSetKv. Differences: the rows of one head are contiguous
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

// A working set ([kv_heads][slots][head_dim], one head's rows contiguous, no page lookup): every
// row of an item sees the first counts[kvh] rows of its KV head; no mask.
struct WorkingSetKv {
  using Launch = SparseAttentionLaunch;
  static constexpr bool kCausal = false;

  // The head's slots in this chunk; none when the chunk starts at or after counts[kvh].
  template <int kQpb>
  __device__ __forceinline__ static bool key_range(const Launch& a, const SparseItemMeta& it, int64_t chunk,
                                                   int64_t kvh, int64_t /*group*/, int64_t /*n_pairs*/,
                                                   int64_t /*pair0*/, int64_t& key_begin, int64_t& key_end) {
    const int64_t count = a.counts[it.counts_offset + kvh];
    key_begin = chunk * a.chunk_size;
    if (key_begin >= count) return false;
    key_end = min(key_begin + a.chunk_size, count);
    return true;
  }
  // No slot of this head in this chunk. Without a split (chunk 0 only) that means an empty
  // working set: the block owns the output and writes zeros. With a split the merge does.
  template <int kQpb>
  __device__ __forceinline__ static void no_keys(const Launch& a, const SparseItemMeta& it, int64_t kvh,
                                                 int64_t group, int64_t n_pairs, int64_t pair0, int hd,
                                                 int warp, int lane) {
    if (a.n_chunks_max != 1) return;
    for (int slot = warp; slot < kQpb; slot += kWarps) {
      const int64_t pair = pair0 + slot;
      if (pair >= n_pairs) break;
      const int64_t row = it.token_offset + pair / group;
      const int64_t h = kvh * group + pair % group;
      float* dst = a.out + (row * a.n_heads + h) * hd;
      for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
    }
  }

  template <typename T>
  struct Rows {
    const T* k_head;
    const T* v_head;
    int hd;
    __device__ __forceinline__ Rows(const Launch&, const SparseItemMeta& it, int64_t kvh, int hd_)
        : k_head(static_cast<const T*>(it.k) + kvh * it.slots * hd_),
          v_head(static_cast<const T*>(it.v) + kvh * it.slots * hd_),
          hd(hd_) {}
    __device__ __forceinline__ void at(int64_t pos, const T*& k, const T*& v) const {
      k = k_head + pos * hd;
      v = v_head + pos * hd;
    }
  };

  // Chunks 0 .. ceil(counts[kvh] / chunk_size) - 1; 0 for an empty working set.
  __device__ __forceinline__ static int64_t merge_chunks_of(const Launch& a, int64_t item_idx, int64_t r,
                                                            int64_t h, int64_t& row) {
    const SparseItemMeta& it = a.items[item_idx];
    row = it.token_offset + (r - a.row_begin[item_idx]);
    const int64_t count = a.counts[it.counts_offset + h / (a.n_heads / a.kv_heads)];
    return (count + a.chunk_size - 1) / a.chunk_size;
  }
};

// attention_indexed: the selected positions of the paged cache, read in place. Ranges, empty
// heads and the merge as WorkingSetKv (counts per head, no mask); key j of head kvh is token
// indices[kvh · slots + j] of the item, found through its page table (K pointers, then V).
struct IndexedPagedKv : WorkingSetKv {
  template <typename T>
  struct Rows {
    const int32_t* idx;
    void* const* k_pages;
    void* const* v_pages;
    int32_t page_size;
    int64_t head_offset;  // elements of the head's rows before its first slot in a page
    int hd;
    __device__ __forceinline__ Rows(const Launch& a, const SparseItemMeta& it, int64_t kvh, int hd_)
        : idx(a.indices + it.indices_offset + kvh * it.slots),
          k_pages(a.page_table + it.pages_offset),
          v_pages(a.page_table + it.pages_offset + it.n_pages),
          page_size(static_cast<int32_t>(it.page_size)),
          head_offset(kvh * it.page_size * hd_),
          hd(hd_) {}
    __device__ __forceinline__ void at(int64_t pos, const T*& k, const T*& v) const {
      const int32_t token = idx[pos];
      // 32-bit division (the planner bounds page_size by INT_MAX), as kv_gather.
      const int32_t page = token / page_size;
      const int64_t offset = head_offset + static_cast<int64_t>(token - page * page_size) * hd;
      k = static_cast<const T*>(k_pages[page]) + offset;
      v = static_cast<const T*>(v_pages[page]) + offset;
    }
  };
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
  return launch_split_attention<WorkingSetKv>(a, stream);
}

cudaError_t launch_attention_indexed(const SparseAttentionLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  return launch_split_attention<IndexedPagedKv>(a, stream);
}

}  // namespace specontext::gpu::kernels
