#include "gpu/attention_plan.h"

#include <algorithm>
#include <string>

#include "gpu/plan_internal.h"

namespace specontext::gpu {

namespace {

using plan_internal::ceil_div;

Status check_items(const AttentionItem* items, int64_t n_items, int64_t n_heads) {
  if (items == nullptr || n_heads <= 0) return invalid_argument("attention: no items or heads");
  const int64_t kv_heads = items[0].kv.kv_heads;
  const int64_t head_dim = items[0].kv.head_dim;
  const DType dtype = items[0].kv.dtype;
  for (int64_t i = 0; i < n_items; ++i) {
    const AttentionItem& it = items[i];
    const KvLayerView& kv = it.kv;
    SPX_RETURN_IF_ERROR(plan_internal::check_kv_dtype(
        "attention", "items[" + std::to_string(i) + "].kv.dtype", kv.dtype, dtype));
    if (kv.page_size <= 0 || kv.kv_heads <= 0 || kv.head_dim <= 0 || kv.n_pages < 0) {
      return invalid_argument("attention: KV page_size, kv_heads and head_dim must be positive");
    }
    if (kv.n_pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr)) {
      return invalid_argument("attention: null KV page tables");
    }
    if (kv.head_dim != head_dim || kv.kv_heads != kv_heads) {
      return invalid_argument("attention: items disagree on kv_heads or head_dim");
    }
    if (it.n_tokens < 0 || it.start_pos < 0 || it.token_offset < 0 ||
        it.start_pos + it.n_tokens > kv.capacity()) {
      return out_of_range("attention: item " + std::to_string(i) + " positions [" +
                          std::to_string(it.start_pos) + ", " +
                          std::to_string(it.start_pos + it.n_tokens) + ") exceed cache capacity " +
                          std::to_string(kv.capacity()));
    }
  }
  return plan_internal::check_head_shape("attention", "CUDA attention", n_heads, kv_heads, head_dim);
}

}  // namespace

size_t AttentionPlan::partial_ml_floats() const {
  if (launch.n_chunks_max <= 1) return 0;
  return 2 * static_cast<size_t>(launch.total_rows * launch.n_heads * launch.n_chunks_max);
}

size_t AttentionPlan::partial_o_floats() const {
  return partial_ml_floats() / 2 * static_cast<size_t>(launch.head_dim);
}

Result<AttentionPlan> plan_attention(const AttentionItem* items, int64_t n_items, int64_t n_heads,
                                     int sm_count) {
  AttentionPlan plan;
  if (n_items == 0) return plan;
  SPX_RETURN_IF_ERROR(check_items(items, n_items, n_heads));
  const int64_t kv_heads = items[0].kv.kv_heads;
  const int64_t head_dim = items[0].kv.head_dim;
  const int64_t group = n_heads / kv_heads;

  int64_t max_pairs = 0;
  int64_t max_len = 0;
  for (int64_t i = 0; i < n_items; ++i) {
    max_pairs = std::max(max_pairs, items[i].n_tokens * group);
    if (items[i].n_tokens > 0) max_len = std::max(max_len, items[i].start_pos + items[i].n_tokens);
  }
  if (max_len == 0) return plan;  // only empty items
  const int qpw = plan_internal::queries_per_warp(max_pairs);
  const int64_t queries_per_block = static_cast<int64_t>(kernels::kAttentionWarps) * qpw;
  int64_t base_blocks = 0;
  for (int64_t i = 0; i < n_items; ++i) {
    base_blocks += ceil_div(items[i].n_tokens * group, queries_per_block);
  }
  base_blocks *= kv_heads;

  // Split long contexts only while the unsplit grid would leave SMs idle.
  const int64_t chunk = plan_internal::chunk_size(max_len, base_blocks, sm_count);
  const int64_t n_chunks_max = ceil_div(max_len, chunk);

  plan.items.resize(static_cast<size_t>(n_items));
  plan.block_begin.assign(static_cast<size_t>(n_items) + 1, 0);
  plan.row_begin.assign(static_cast<size_t>(n_items) + 1, 0);
  for (int64_t i = 0; i < n_items; ++i) {
    const size_t ui = static_cast<size_t>(i);
    const AttentionItem& it = items[i];
    const int64_t len = it.start_pos + it.n_tokens;
    kernels::AttentionItemMeta& meta = plan.items[ui];
    meta.token_offset = it.token_offset;
    meta.n_tokens = it.n_tokens;
    meta.start_pos = it.start_pos;
    meta.page_size = it.kv.page_size;
    meta.page_table_offset = static_cast<int64_t>(plan.pages.size());
    meta.n_pages = it.n_tokens > 0 ? ceil_div(len, it.kv.page_size) : 0;
    meta.n_tiles = ceil_div(it.n_tokens * group, queries_per_block);
    meta.n_chunks = it.n_tokens > 0 ? ceil_div(len, chunk) : 1;
    meta.row_begin = plan.row_begin[ui];
    plan.pages.insert(plan.pages.end(), it.kv.k_pages, it.kv.k_pages + meta.n_pages);
    plan.pages.insert(plan.pages.end(), it.kv.v_pages, it.kv.v_pages + meta.n_pages);
    plan.block_begin[ui + 1] = plan.block_begin[ui] + meta.n_tiles * meta.n_chunks;
    plan.row_begin[ui + 1] = plan.row_begin[ui] + it.n_tokens;
  }

  SPX_RETURN_IF_ERROR(plan_internal::fill_launch(plan, "attention", n_items, n_heads, kv_heads, head_dim,
                                                 chunk, n_chunks_max, qpw));
  plan.launch.kv_type = plan_internal::kv_type_of(items[0].kv.dtype);
  return plan;
}

}  // namespace specontext::gpu
