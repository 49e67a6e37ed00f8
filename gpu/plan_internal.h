// Helpers shared by plan_attention and plan_attention_sparse, which split work the same way
// (flash-decoding over tiles of kAttentionKeyTile keys). Not a public API.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/base/dtype.h"
#include "core/base/status.h"
#include "gpu/attention_plan.h"
#include "gpu/kernels.h"

namespace specontext::gpu::plan_internal {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Queries per warp: enough that one block covers the largest item's (row, head) pairs of a KV
// head (decode: the GQA group), at most 4 (prefill).
inline int queries_per_warp(int64_t max_pairs) {
  return max_pairs <= kernels::kAttentionWarps ? 1 : max_pairs <= 2 * kernels::kAttentionWarps ? 2 : 4;
}

// Keys per chunk for up to max_keys keys per query: one chunk, split only while the unsplit grid
// (base_blocks) would leave SMs idle (flash-decoding), never below kAttentionMinChunk.
inline int64_t chunk_size(int64_t max_keys, int64_t base_blocks, int sm_count) {
  int64_t chunk = round_up(std::max<int64_t>(max_keys, 1), kernels::kAttentionKeyTile);
  const int64_t target = static_cast<int64_t>(std::max(sm_count, 1)) * kAttentionTargetBlocksPerSm;
  if (base_blocks < target && max_keys > kAttentionMinChunk) {
    const int64_t splits = std::min(ceil_div(target, base_blocks), ceil_div(max_keys, kAttentionMinChunk));
    chunk = round_up(ceil_div(max_keys, splits), kernels::kAttentionKeyTile);
  }
  return chunk;
}

// The kernels' element type of a KV dtype; only for is_kv_dtype(t) (check_kv_dtype first).
inline kernels::KvType kv_type_of(DType t) {
  return t == DType::kF16    ? kernels::KvType::kF16
         : t == DType::kBF16 ? kernels::KvType::kBF16
                             : kernels::KvType::kF32;
}

// The KV dtype of batch element `index` (`field` names it, "items[3].kv.dtype") against the
// batch's (`first`, items[0]'s): f32, f16 or bf16, and one dtype per batch since a launch
// instantiates the kernels for one element type. op names the call.
inline Status check_kv_dtype(const char* op, const std::string& field, DType t, DType first) {
  if (!is_kv_dtype(t)) {
    return invalid_argument(std::string(op) + ": " + field + " is " + std::string(dtype_name(t)) +
                            ", not a KV dtype (f32, f16 or bf16)");
  }
  if (t != first) {
    return invalid_argument(std::string(op) + ": " + field + " is " + std::string(dtype_name(t)) +
                            " but items[0] has " + std::string(dtype_name(first)) +
                            " (one KV dtype per batch)");
  }
  return Status::ok();
}

// The head-shape checks both plans make: GQA divisibility, the kernels' head_dim limit and the
// grid's y limit. op names the call, kernel the kernel family ("CUDA attention").
inline Status check_head_shape(const char* op, const char* kernel, int64_t n_heads, int64_t kv_heads,
                               int64_t head_dim) {
  if (n_heads % kv_heads != 0) {
    return invalid_argument(std::string(op) + ": n_heads " + std::to_string(n_heads) +
                            " not a multiple of kv_heads " + std::to_string(kv_heads));
  }
  if (head_dim > kernels::kAttentionMaxHeadDim) {
    return unimplemented(std::string(kernel) + " supports head_dim up to " +
                         std::to_string(kernels::kAttentionMaxHeadDim) + ", got " + std::to_string(head_dim));
  }
  if (kv_heads > 65535) return invalid_argument(std::string(op) + ": too many KV heads for one launch");
  return Status::ok();
}

// Fills the shape fields of a launch (AttentionLaunch or SparseAttentionLaunch) from the plan's
// prefixes, and rejects grids beyond the int range of one launch. op names the call in errors.
template <typename Plan>
Status fill_launch(Plan& plan, const char* op, int64_t n_items, int64_t n_heads, int64_t kv_heads,
                   int64_t head_dim, int64_t chunk, int64_t n_chunks_max, int qpw) {
  auto& a = plan.launch;
  a.n_items = n_items;
  a.n_heads = n_heads;
  a.kv_heads = kv_heads;
  a.head_dim = head_dim;
  a.chunk_size = chunk;
  a.n_chunks_max = n_chunks_max;
  a.total_blocks = plan.block_begin.back();
  a.total_rows = plan.row_begin.back();
  a.queries_per_warp = qpw;
  a.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (a.total_blocks > INT_MAX || ceil_div(a.total_rows * n_heads, kernels::kAttentionWarps) > INT_MAX) {
    return invalid_argument(std::string(op) + ": batch too large for one launch");
  }
  return Status::ok();
}

}  // namespace specontext::gpu::plan_internal
