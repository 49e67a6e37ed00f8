// Host-side planning of the sparse-decode ops (kv_gather, attention_sparse): argument checks,
// the split-K decision and the metadata the kernels of kernels_sparse.cu read. Pure C++ with no
// CUDA calls, so the decomposition is unit-tested on machines without a GPU
// (tests/gpu/sparse_plan_test.cc runs a host mirror of the kernels from these plans).
#pragma once

#include <cstdint>
#include <vector>

#include "core/base/status.h"
#include "core/ports/backend.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

struct KvGatherPlan {
  // K page pointers of the pages the entries touch (launch.first_page .. + launch.n_pages - 1),
  // then the V pointers of the same pages. Only that range travels to the device.
  std::vector<void*> pages;
  // Shapes, page range, working-set pointers, kv_type and vec16 filled in; entries and page_table (device
  // copies) are left null for the caller. launch.n_entries == 0: nothing to do.
  kernels::KvGatherLaunch launch;
};

// Checks (all kInvalidArgument, as the CPU backends): the cache's dtype is f32, f16 or bf16; the
// working set matches the cache's kv_heads, head_dim and dtype; each entry's head < kv_heads,
// token < capacity, slot < slots; destinations (head, slot) distinct. `entries` is a host array; the views'
// data pointers are device pointers.
Result<KvGatherPlan> plan_kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                                    const WorkingSetView& ws);

struct SparseAttentionPlan {
  std::vector<kernels::SparseItemMeta> items;
  std::vector<int64_t> block_begin;  // [n_items + 1]
  std::vector<int64_t> row_begin;    // [n_items + 1]
  std::vector<int32_t> counts;       // [n_items · kv_heads], copied from the host counts
  // attention_indexed only: every item's K then V page pointers, and its indices
  // ([kv_heads][stride] each), as SparseItemMeta's offsets say. Empty for working sets.
  std::vector<void*> pages;
  std::vector<int32_t> indices;
  // Device pointers (q, out, metadata, partials) left null for the caller.
  // launch.total_blocks == 0: nothing to compute.
  kernels::SparseAttentionLaunch launch;
  size_t partial_o_floats() const;
  size_t partial_ml_floats() const;
};

// Checks the batch (kInvalidArgument: counts outside [0, slots], null counts or K/V, n_heads not a
// multiple of kv_heads, items disagreeing on kv_heads, head_dim or dtype (f32, f16 or bf16; one
// per batch, recorded in launch.kv_type), negative rows;
// kUnimplemented: head_dim > 256) and plans the launch for `sm_count` multiprocessors. Splits
// the slots into chunks (flash-decoding) under the same rule as plan_attention: only while the
// unsplit grid has fewer than kAttentionTargetBlocksPerSm blocks per SM.
Result<SparseAttentionPlan> plan_attention_sparse(const SparseAttentionItem* items, int64_t n_items,
                                                  int64_t n_heads, int sm_count);

// attention_indexed: check_attention_indexed_args (core/ports/backend_checks.h), then
// kInvalidArgument for items disagreeing on kv_heads or dtype, a page size or capacity past
// INT_MAX; kUnimplemented for head_dim > 256. The same split as plan_attention_sparse over the
// counts; pages and indices copied from the host arrays.
Result<SparseAttentionPlan> plan_attention_indexed(const IndexedAttentionItem* items, int64_t n_items,
                                                   int64_t n_heads, int sm_count);

}  // namespace specontext::gpu
