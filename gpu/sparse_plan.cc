#include "gpu/sparse_plan.h"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/ports/backend_checks.h"
#include "gpu/attention_plan.h"
#include "gpu/plan_internal.h"

namespace specontext::gpu {

// The backend uploads the caller's GatherEntry array as is and the kernel reads it as
// GatherEntryMeta: the layouts must agree.
static_assert(std::is_standard_layout_v<GatherEntry> &&
              sizeof(GatherEntry) == sizeof(kernels::GatherEntryMeta));
static_assert(offsetof(GatherEntry, kv_head) == offsetof(kernels::GatherEntryMeta, kv_head) &&
              offsetof(GatherEntry, token) == offsetof(kernels::GatherEntryMeta, token) &&
              offsetof(GatherEntry, slot) == offsetof(kernels::GatherEntryMeta, slot));

namespace {

using plan_internal::ceil_div;
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// ---- kv_gather ----

Result<KvGatherPlan> plan_kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                                    const WorkingSetView& ws) {
  KvGatherPlan plan;
  if (n_entries < 0) return invalid_argument("kv_gather: negative entry count");
  if (n_entries == 0) return plan;
  if (entries == nullptr) return invalid_argument("kv_gather: null entries");
  if (kv.page_size <= 0 || kv.kv_heads <= 0 || kv.head_dim <= 0 || kv.n_pages < 0) {
    return invalid_argument("kv_gather: KV page_size, kv_heads and head_dim must be positive");
  }
  if (kv.n_pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr)) {
    return invalid_argument("kv_gather: null KV page tables");
  }
  SPX_RETURN_IF_ERROR(plan_internal::check_kv_dtype("kv_gather", "kv.dtype", kv.dtype, kv.dtype));
  SPX_RETURN_IF_ERROR(check_working_set(ws, "kv_gather", /*need_counts=*/false));
  if (ws.kv_heads != kv.kv_heads || ws.head_dim != kv.head_dim) {
    return invalid_argument("kv_gather: working set (kv_heads " + std::to_string(ws.kv_heads) +
                            ", head_dim " + std::to_string(ws.head_dim) + ") does not match the cache (" +
                            std::to_string(kv.kv_heads) + ", " + std::to_string(kv.head_dim) + ")");
  }
  if (ws.dtype != kv.dtype) {
    return invalid_argument("kv_gather: ws.dtype " + std::string(dtype_name(ws.dtype)) +
                            " differs from kv.dtype " + std::string(dtype_name(kv.dtype)) +
                            " (the gather copies elements unchanged)");
  }
  if (n_entries > INT_MAX || kv.page_size > INT_MAX) {
    return invalid_argument("kv_gather: too many entries or too large pages for one launch");
  }
  // Duplicate destinations would race between warps; the token range bounds the pages to upload.
  int64_t min_token = 0;
  int64_t max_token = 0;
  SPX_RETURN_IF_ERROR(check_gather_entries(entries, n_entries, ws, kv.capacity(), &min_token, &max_token));
  const int64_t first_page = min_token / kv.page_size;
  const int64_t n_pages = max_token / kv.page_size - first_page + 1;
  plan.pages.assign(kv.k_pages + first_page, kv.k_pages + first_page + n_pages);
  plan.pages.insert(plan.pages.end(), kv.v_pages + first_page, kv.v_pages + first_page + n_pages);
  // 16-byte copies when every row is a whole number of uint4 and every base is aligned: rows then
  // start at multiples of 16 bytes too (row offsets are multiples of the row size).
  const kernels::KvType type = plan_internal::kv_type_of(kv.dtype);
  bool vec16 = kv.head_dim * kernels::kv_type_bytes(type) % 16 == 0 && aligned16(ws.k) && aligned16(ws.v);
  for (const void* p : plan.pages) vec16 = vec16 && aligned16(p);

  kernels::KvGatherLaunch& g = plan.launch;
  g.ws_k = ws.k;
  g.ws_v = ws.v;
  g.kv_type = type;
  g.n_entries = n_entries;
  g.first_page = first_page;
  g.n_pages = n_pages;
  g.page_size = kv.page_size;
  g.slots = ws.slots;
  g.head_dim = kv.head_dim;
  g.vec16 = vec16;
  return plan;
}

// ---- attention_sparse ----

size_t SparseAttentionPlan::partial_ml_floats() const {
  if (launch.n_chunks_max <= 1) return 0;
  return 2 * static_cast<size_t>(launch.total_rows * launch.n_heads * launch.n_chunks_max);
}

size_t SparseAttentionPlan::partial_o_floats() const {
  return partial_ml_floats() / 2 * static_cast<size_t>(launch.head_dim);
}

namespace {

// One item as the split planner sees it: rows, per-head key counts, and where the keys are.
struct SplitItem {
  int64_t token_offset = 0;
  int64_t n_tokens = 0;
  const int32_t* counts = nullptr;  // host [kv_heads]
  int64_t slots = 0;                // working set: slots; indexed: the stride of the indices
  const void* k = nullptr;          // working set only
  const void* v = nullptr;
  const IndexedAttentionItem* indexed = nullptr;
};

// The split-K plan shared by attention_sparse and attention_indexed (checks done by the caller).
Result<SparseAttentionPlan> plan_over_counts(const char* op, const std::vector<SplitItem>& items, int64_t n_heads,
                                             int64_t kv_heads, int64_t head_dim, DType dtype, int sm_count) {
  SparseAttentionPlan plan;
  const auto n_items = static_cast<int64_t>(items.size());
  SPX_RETURN_IF_ERROR(plan_internal::check_head_shape(op, "CUDA sparse attention", n_heads, kv_heads, head_dim));
  const int64_t group = n_heads / kv_heads;

  int64_t max_pairs = 0;
  int64_t max_count = 0;
  int64_t total_rows = 0;
  for (const SplitItem& it : items) {
    if (it.n_tokens == 0) continue;
    total_rows += it.n_tokens;
    max_pairs = std::max(max_pairs, it.n_tokens * group);
    for (int64_t h = 0; h < kv_heads; ++h) max_count = std::max<int64_t>(max_count, it.counts[h]);
  }
  if (total_rows == 0) return plan;  // only empty items
  const int qpw = plan_internal::queries_per_warp(max_pairs);
  const int64_t queries_per_block = static_cast<int64_t>(kernels::kAttentionWarps) * qpw;
  int64_t base_blocks = 0;
  for (const SplitItem& it : items) base_blocks += ceil_div(it.n_tokens * group, queries_per_block);
  base_blocks *= kv_heads;

  // Split the slots only while the unsplit grid would leave SMs idle (as plan_attention).
  const int64_t chunk = plan_internal::chunk_size(max_count, base_blocks, sm_count);
  const int64_t n_chunks_max = std::max<int64_t>(1, ceil_div(max_count, chunk));

  plan.items.resize(static_cast<size_t>(n_items));
  plan.block_begin.assign(static_cast<size_t>(n_items) + 1, 0);
  plan.row_begin.assign(static_cast<size_t>(n_items) + 1, 0);
  plan.counts.reserve(static_cast<size_t>(n_items * kv_heads));
  for (int64_t i = 0; i < n_items; ++i) {
    const size_t ui = static_cast<size_t>(i);
    const SplitItem& it = items[ui];
    int64_t item_max = 0;
    for (int64_t h = 0; h < kv_heads; ++h) item_max = std::max<int64_t>(item_max, it.counts[h]);
    kernels::SparseItemMeta& meta = plan.items[ui];
    meta.k = it.k;
    meta.v = it.v;
    meta.token_offset = it.token_offset;
    meta.n_tokens = it.n_tokens;
    meta.slots = it.slots;
    meta.counts_offset = static_cast<int64_t>(plan.counts.size());
    meta.n_tiles = ceil_div(it.n_tokens * group, queries_per_block);
    meta.n_chunks = std::max<int64_t>(1, ceil_div(item_max, chunk));
    meta.row_begin = plan.row_begin[ui];
    if (it.indexed != nullptr) {
      // Only the item's indices and its page table travel to the device.
      const KvLayerView& kv = it.indexed->kv;
      meta.pages_offset = static_cast<int64_t>(plan.pages.size());
      meta.n_pages = kv.n_pages;
      meta.page_size = kv.page_size;
      meta.indices_offset = static_cast<int64_t>(plan.indices.size());
      plan.pages.insert(plan.pages.end(), kv.k_pages, kv.k_pages + kv.n_pages);
      plan.pages.insert(plan.pages.end(), kv.v_pages, kv.v_pages + kv.n_pages);
      if (it.slots > 0) {
        plan.indices.insert(plan.indices.end(), it.indexed->indices, it.indexed->indices + kv_heads * it.slots);
      }
    }
    plan.counts.insert(plan.counts.end(), it.counts, it.counts + kv_heads);
    plan.block_begin[ui + 1] = plan.block_begin[ui] + meta.n_tiles * meta.n_chunks;
    plan.row_begin[ui + 1] = plan.row_begin[ui] + it.n_tokens;
  }

  SPX_RETURN_IF_ERROR(plan_internal::fill_launch(plan, op, n_items, n_heads, kv_heads, head_dim, chunk,
                                                 n_chunks_max, qpw));
  plan.launch.kv_type = plan_internal::kv_type_of(dtype);
  return plan;
}

}  // namespace

Result<SparseAttentionPlan> plan_attention_sparse(const SparseAttentionItem* items, int64_t n_items,
                                                  int64_t n_heads, int sm_count) {
  if (n_items < 0) return invalid_argument("attention_sparse: negative item count");
  if (n_items == 0) return SparseAttentionPlan{};
  if (items == nullptr || n_heads <= 0) return invalid_argument("attention_sparse: no items or heads");
  const int64_t kv_heads = items[0].ws.kv_heads;
  const int64_t head_dim = items[0].ws.head_dim;
  const DType dtype = items[0].ws.dtype;
  std::vector<SplitItem> split(static_cast<size_t>(n_items));
  for (int64_t i = 0; i < n_items; ++i) {
    const SparseAttentionItem& it = items[i];
    SPX_RETURN_IF_ERROR(plan_internal::check_kv_dtype(
        "attention_sparse", "items[" + std::to_string(i) + "].ws.dtype", it.ws.dtype, dtype));
    SPX_RETURN_IF_ERROR(check_working_set(it.ws, "attention_sparse", /*need_counts=*/true));
    if (it.ws.kv_heads != kv_heads || it.ws.head_dim != head_dim) {
      return invalid_argument("attention_sparse: items disagree on kv_heads or head_dim");
    }
    if (it.n_tokens < 0 || it.token_offset < 0) {
      return invalid_argument("attention_sparse: item " + std::to_string(i) + " has negative rows");
    }
    split[static_cast<size_t>(i)] = {it.token_offset, it.n_tokens, it.ws.counts, it.ws.slots, it.ws.k, it.ws.v, nullptr};
  }
  return plan_over_counts("attention_sparse", split, n_heads, kv_heads, head_dim, dtype, sm_count);
}

Result<SparseAttentionPlan> plan_attention_indexed(const IndexedAttentionItem* items, int64_t n_items,
                                                   int64_t n_heads, int sm_count) {
  SPX_RETURN_IF_ERROR(check_attention_indexed_args(items, n_items, n_heads));
  if (n_items == 0) return SparseAttentionPlan{};
  const int64_t kv_heads = items[0].kv.kv_heads;
  const int64_t head_dim = items[0].kv.head_dim;
  const DType dtype = items[0].kv.dtype;
  std::vector<SplitItem> split(static_cast<size_t>(n_items));
  for (int64_t i = 0; i < n_items; ++i) {
    const IndexedAttentionItem& it = items[i];
    SPX_RETURN_IF_ERROR(plan_internal::check_kv_dtype(
        "attention_indexed", "items[" + std::to_string(i) + "].kv.dtype", it.kv.dtype, dtype));
    if (it.kv.kv_heads != kv_heads) return invalid_argument("attention_indexed: items disagree on kv_heads");
    if (it.kv.page_size > INT_MAX || it.kv.capacity() > INT_MAX) {
      return invalid_argument("attention_indexed: items[" + std::to_string(i) + "].kv too large for one launch");
    }
    split[static_cast<size_t>(i)] = {it.token_offset, it.n_tokens, it.counts, it.stride, nullptr, nullptr, &it};
  }
  return plan_over_counts("attention_indexed", split, n_heads, kv_heads, head_dim, dtype, sm_count);
}

}  // namespace specontext::gpu
