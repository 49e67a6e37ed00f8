// Host-side planning of one attention call: argument checks, the split-K decision and the
// metadata the kernels read (items, block and row prefixes, page tables). Pure C++ with no CUDA
// calls, so the decomposition is unit-tested on machines without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "core/base/status.h"
#include "core/ports/backend.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

struct AttentionPlan {
  std::vector<kernels::AttentionItemMeta> items;
  std::vector<int64_t> block_begin;  // [n_items + 1]
  std::vector<int64_t> row_begin;    // [n_items + 1]
  std::vector<void*> pages;          // per item: K page pointers, then V page pointers
  // Shapes and the split are filled in; the device pointers (q, out, metadata, partials) are
  // left null for the caller. launch.total_blocks == 0: nothing to compute.
  kernels::AttentionLaunch launch;
  // Floats of split-K scratch: partial outputs and (max, sum) pairs; 0 without a split.
  size_t partial_o_floats() const;
  size_t partial_ml_floats() const;
};

// Split-K aims at this many resident blocks per SM before it stops splitting.
inline constexpr int64_t kAttentionTargetBlocksPerSm = 4;
// Chunks shorter than this cost more in partial writes and merging than they gain.
inline constexpr int64_t kAttentionMinChunk = 256;

// Checks the batch (kv views, capacities, GQA divisibility, head_dim <= 256, uniform kv_heads,
// head_dim and KV dtype, which must be f32, f16 or bf16) and plans the launch for a device with
// `sm_count` multiprocessors; launch.kv_type records the dtype.
Result<AttentionPlan> plan_attention(const AttentionItem* items, int64_t n_items, int64_t n_heads,
                                     int sm_count);

}  // namespace specontext::gpu
