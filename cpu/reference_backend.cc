#include "cpu/reference_backend.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/ports/backend_checks.h"

namespace specontext::cpu {

// ---------------------------------------------------------------------------------------------
// Argument checks shared with CpuBackend

Status check_matmul_dtype(DType t) {
  if (t == DType::kF32 || t == DType::kBF16) return Status::ok();
  return unimplemented("CPU matmul supports f32 and bf16 weights, not " + std::string(dtype_name(t)) +
                       " (loaders convert f16 to f32)");
}

Status check_embed_args(const TokenId* ids, int64_t n, const WeightMatrix& table) {
  if (table.dtype != DType::kF32 && table.dtype != DType::kBF16 && table.dtype != DType::kF16) {
    return unimplemented("CPU embed supports f32/bf16/f16 tables, not " +
                         std::string(dtype_name(table.dtype)));
  }
  return check_embed_ids(ids, n, table);
}

Status check_embed_ids(const TokenId* ids, int64_t n, const WeightMatrix& table) {
  if (n > 0 && (ids == nullptr || table.data == nullptr)) {
    return invalid_argument("embed: null ids or table");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows) {
      return out_of_range("embed: token id " + std::to_string(ids[i]) + " outside vocabulary of " +
                          std::to_string(table.rows));
    }
  }
  return Status::ok();
}

Status check_rope_params(const RopeParams& params) {
  if (params.head_dim <= 0 || params.head_dim % 2 != 0) {
    return invalid_argument("rope: head_dim must be positive and even, got " +
                            std::to_string(params.head_dim));
  }
  if (static_cast<int64_t>(params.inv_freq.size()) != params.head_dim / 2) {
    return invalid_argument("rope: inv_freq has " + std::to_string(params.inv_freq.size()) +
                            " entries, head_dim/2 = " + std::to_string(params.head_dim / 2));
  }
  return Status::ok();
}

namespace {
Status check_kv_view(const KvLayerView& kv) {
  if (kv.page_size <= 0 || kv.kv_heads <= 0 || kv.head_dim <= 0 || kv.n_pages < 0) {
    return invalid_argument("KV view: page_size, kv_heads and head_dim must be positive");
  }
  if (kv.n_pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr)) {
    return invalid_argument("KV view: null page tables");
  }
  if (!is_kv_dtype(kv.dtype)) {
    return invalid_argument("KV view: dtype " + std::string(dtype_name(kv.dtype)) + " is not f32, f16 or bf16");
  }
  return Status::ok();
}
}  // namespace

Status check_kv_append_args(int64_t n_tokens, int64_t start_pos, const KvLayerView& kv) {
  SPX_RETURN_IF_ERROR(check_kv_view(kv));
  if (n_tokens < 0 || start_pos < 0 || start_pos + n_tokens > kv.capacity()) {
    return out_of_range("kv_append: positions [" + std::to_string(start_pos) + ", " +
                        std::to_string(start_pos + n_tokens) + ") exceed cache capacity " +
                        std::to_string(kv.capacity()));
  }
  return Status::ok();
}

Status check_attention_args(const AttentionItem* items, int64_t n_items, int64_t n_heads) {
  if (n_items == 0) return Status::ok();
  if (items == nullptr || n_heads <= 0) return invalid_argument("attention: no items or heads");
  const int64_t head_dim = items[0].kv.head_dim;
  for (int64_t i = 0; i < n_items; ++i) {
    const AttentionItem& it = items[i];
    SPX_RETURN_IF_ERROR(check_kv_view(it.kv));
    if (it.kv.head_dim != head_dim) {
      return invalid_argument("attention: items disagree on head_dim");
    }
    if (n_heads % it.kv.kv_heads != 0) {
      return invalid_argument("attention: n_heads " + std::to_string(n_heads) +
                              " not a multiple of kv_heads " + std::to_string(it.kv.kv_heads));
    }
    if (it.n_tokens < 0 || it.start_pos < 0 || it.token_offset < 0 ||
        it.start_pos + it.n_tokens > it.kv.capacity()) {
      return out_of_range("attention: item " + std::to_string(i) + " positions [" +
                          std::to_string(it.start_pos) + ", " + std::to_string(it.start_pos + it.n_tokens) +
                          ") exceed cache capacity " + std::to_string(it.kv.capacity()));
    }
  }
  return Status::ok();
}

Status check_kv_gather_args(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                            const WorkingSetView& ws) {
  if (n_entries < 0) return invalid_argument("kv_gather: negative entry count");
  if (n_entries == 0) return Status::ok();
  if (entries == nullptr) return invalid_argument("kv_gather: null entries");
  SPX_RETURN_IF_ERROR(check_kv_view(kv));
  SPX_RETURN_IF_ERROR(check_working_set(ws, "kv_gather", /*need_counts=*/false));
  if (ws.kv_heads != kv.kv_heads || ws.head_dim != kv.head_dim || ws.dtype != kv.dtype) {
    return invalid_argument("kv_gather: working set (kv_heads " + std::to_string(ws.kv_heads) +
                            ", head_dim " + std::to_string(ws.head_dim) + ", " +
                            std::string(dtype_name(ws.dtype)) + ") does not match the cache (" +
                            std::to_string(kv.kv_heads) + ", " + std::to_string(kv.head_dim) + ", " +
                            std::string(dtype_name(kv.dtype)) + ")");
  }
  return check_gather_entries(entries, n_entries, ws, kv.capacity(), /*min_token=*/nullptr,
                              /*max_token=*/nullptr);
}

Status check_attention_sparse_args(const SparseAttentionItem* items, int64_t n_items, int64_t n_heads) {
  if (n_items < 0) return invalid_argument("attention_sparse: negative item count");
  if (n_items == 0) return Status::ok();
  if (items == nullptr || n_heads <= 0) return invalid_argument("attention_sparse: no items or heads");
  const int64_t head_dim = items[0].ws.head_dim;
  for (int64_t i = 0; i < n_items; ++i) {
    const SparseAttentionItem& it = items[i];
    SPX_RETURN_IF_ERROR(check_working_set(it.ws, "attention_sparse", /*need_counts=*/true));
    if (it.ws.head_dim != head_dim) return invalid_argument("attention_sparse: items disagree on head_dim");
    if (n_heads % it.ws.kv_heads != 0) {
      return invalid_argument("attention_sparse: n_heads " + std::to_string(n_heads) +
                              " not a multiple of kv_heads " + std::to_string(it.ws.kv_heads));
    }
    if (it.n_tokens < 0 || it.token_offset < 0) {
      return invalid_argument("attention_sparse: item " + std::to_string(i) + " has negative rows");
    }
  }
  return Status::ok();
}

float weight_element(const WeightMatrix& w, int64_t row, int64_t col) {
  const size_t i = static_cast<size_t>(row * w.cols + col);
  switch (w.dtype) {
    case DType::kF32:
      return static_cast<const float*>(w.data)[i];
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
    default:
      return std::numeric_limits<float>::quiet_NaN();  // callers check dtype first
  }
}

// ---------------------------------------------------------------------------------------------
// Ops

bool ReferenceBackend::supports(BackendOp op, DType weight_dtype) const {
  switch (op) {
    case BackendOp::kMatmul:
      return weight_dtype == DType::kF32 || weight_dtype == DType::kBF16;
    case BackendOp::kEmbed:
      return weight_dtype == DType::kF32 || weight_dtype == DType::kBF16 || weight_dtype == DType::kF16;
    default:
      return true;  // the other ops take no weight matrix; their inputs are f32
  }
}

Status ReferenceBackend::embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) {
  SPX_RETURN_IF_ERROR(check_embed_args(ids, n, table));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < table.cols; ++c) {
      out[i * table.cols + c] = weight_element(table, ids[i], c);
    }
  }
  return Status::ok();
}

Status ReferenceBackend::matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                                float* y) {
  SPX_RETURN_IF_ERROR(check_matmul_dtype(w.dtype));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < w.rows; ++r) {
      double sum = 0.0;
      for (int64_t c = 0; c < w.cols; ++c) {
        sum += static_cast<double>(x[i * w.cols + c]) * weight_element(w, r, c);
      }
      if (bias != nullptr) sum += bias[r];
      y[i * w.rows + r] = static_cast<float>(sum);
    }
  }
  return Status::ok();
}

Status ReferenceBackend::rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                                 float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = xr[i] * scale * weight[i];
  }
  return Status::ok();
}

Status ReferenceBackend::rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
                              const RopeParams& params) {
  SPX_RETURN_IF_ERROR(check_rope_params(params));
  const int64_t d = params.head_dim;
  const int64_t half = d / 2;
  for (int64_t t = 0; t < n_tokens; ++t) {
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        // float angle, float cos/sin: what llama2.c and PyTorch's float32 rotary do.
        const float angle = static_cast<float>(positions[t]) * params.inv_freq[i];
        const float c = std::cos(angle);
        const float s = std::sin(angle);
        const int64_t i0 = params.style == RopeStyle::kInterleaved ? 2 * i : i;
        const int64_t i1 = params.style == RopeStyle::kInterleaved ? 2 * i + 1 : i + half;
        const float x0 = v[i0];
        const float x1 = v[i1];
        v[i0] = (x0 * c - x1 * s) * params.mscale;
        v[i1] = (x0 * s + x1 * c) * params.mscale;
      }
    }
  }
  return Status::ok();
}

Status ReferenceBackend::swiglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
  return Status::ok();
}

Status ReferenceBackend::add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  return Status::ok();
}

Status ReferenceBackend::kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                                   const KvLayerView& kv) {
  SPX_RETURN_IF_ERROR(check_kv_append_args(n_tokens, start_pos, kv));
  const int64_t kv_dim = kv.kv_heads * kv.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t pos = start_pos + t;
    const int64_t page = pos / kv.page_size;
    const int64_t slot = pos % kv.page_size;
    for (int64_t h = 0; h < kv.kv_heads; ++h) {
      for (int64_t d = 0; d < kv.head_dim; ++d) {
        const int64_t dst = (h * kv.page_size + slot) * kv.head_dim + d;
        const int64_t src = t * kv_dim + h * kv.head_dim + d;
        convert_from_f32(kv.dtype, k + src, element_at(kv.k_pages[page], kv.dtype, dst), 1);
        convert_from_f32(kv.dtype, v + src, element_at(kv.v_pages[page], kv.dtype, dst), 1);
      }
    }
  }
  return Status::ok();
}

namespace {
// Attention of every query row of every item, one kernel for both KV layouts; the reader Kv says
// how a query reads its keys: view(item) (kv_heads, head_dim, dtype), n_keys(item, t, kvh)
// (keys 0 .. n_keys - 1 of KV head kvh that token t sees) and row(item, values, kvh, j) (where
// K or V row j of that head starts). Softmax in double; no key (an empty working set) gives zeros.
template <typename Kv, typename Item>
void attend_items(const float* q, const Item* items, int64_t n_items, int64_t n_heads, const Kv& kv,
                  float* out) {
  std::vector<double> scores;
  for (int64_t it = 0; it < n_items; ++it) {
    const auto& view = kv.view(items[it]);
    const int64_t d = view.head_dim;
    const int64_t group = n_heads / view.kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<float> row(static_cast<size_t>(d));
    std::vector<double> acc(static_cast<size_t>(d));
    for (int64_t t = 0; t < items[it].n_tokens; ++t) {
      const int64_t out_row = items[it].token_offset + t;
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t kvh = h / group;
        const int64_t n_keys = kv.n_keys(items[it], t, kvh);
        const float* qh = q + (out_row * n_heads + h) * d;
        scores.assign(static_cast<size_t>(n_keys), 0.0);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n_keys; ++j) {
          convert_to_f32(view.dtype, kv.row(items[it], false, kvh, j), row.data(), row.size());
          double dot = 0.0;
          for (int64_t e = 0; e < d; ++e) dot += static_cast<double>(qh[e]) * row[e];
          scores[j] = dot * scale;
          if (scores[j] > max_score) max_score = scores[j];
        }
        double denom = 0.0;
        for (int64_t j = 0; j < n_keys; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          denom += scores[j];
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < n_keys; ++j) {
          convert_to_f32(view.dtype, kv.row(items[it], true, kvh, j), row.data(), row.size());
          for (int64_t e = 0; e < d; ++e) acc[e] += scores[j] * row[e];
        }
        float* oh = out + (out_row * n_heads + h) * d;
        for (int64_t e = 0; e < d; ++e) oh[e] = n_keys > 0 ? static_cast<float>(acc[e] / denom) : 0.0f;
      }
    }
  }
}

// The paged cache, causal: token t sees itself and everything before.
struct PagedCausalKv {
  static const KvLayerView& view(const AttentionItem& item) { return item.kv; }
  static int64_t n_keys(const AttentionItem& item, int64_t t, int64_t) { return item.start_pos + t + 1; }
  static const void* row(const AttentionItem& item, bool values, int64_t kvh, int64_t j) {
    return row_at(item.kv, values, kvh, j);
  }
  static const void* row_at(const KvLayerView& kv, bool values, int64_t kvh, int64_t j) {
    void* const* pages = values ? kv.v_pages : kv.k_pages;
    return element_at(pages[j / kv.page_size], kv.dtype,
                      (kvh * kv.page_size + j % kv.page_size) * kv.head_dim);
  }
};

// A working set: every token sees the first counts[kvh] rows of its head; no mask.
struct WorkingSetKv {
  static const WorkingSetView& view(const SparseAttentionItem& item) { return item.ws; }
  static int64_t n_keys(const SparseAttentionItem& item, int64_t, int64_t kvh) { return item.ws.counts[kvh]; }
  static const void* row(const SparseAttentionItem& item, bool values, int64_t kvh, int64_t j) {
    const WorkingSetView& ws = item.ws;
    return element_at(values ? ws.v : ws.k, ws.dtype, (kvh * ws.slots + j) * ws.head_dim);
  }
};
// Selected positions of the paged cache, in place: head kvh sees indices[kvh·stride + j], j <
// counts[kvh]; no mask.
struct IndexedPagedKv {
  static const KvLayerView& view(const IndexedAttentionItem& item) { return item.kv; }
  static int64_t n_keys(const IndexedAttentionItem& item, int64_t, int64_t kvh) { return item.counts[kvh]; }
  static const void* row(const IndexedAttentionItem& item, bool values, int64_t kvh, int64_t j) {
    return PagedCausalKv::row_at(item.kv, values, kvh, item.indices[kvh * item.stride + j]);
  }
};
}  // namespace

Status ReferenceBackend::attention(const float* q, const AttentionItem* items, int64_t n_items,
                                   int64_t n_heads, float* out) {
  SPX_RETURN_IF_ERROR(check_attention_args(items, n_items, n_heads));
  attend_items(q, items, n_items, n_heads, PagedCausalKv{}, out);
  return Status::ok();
}

Status ReferenceBackend::kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                                   const WorkingSetView& ws) {
  SPX_RETURN_IF_ERROR(check_kv_gather_args(kv, entries, n_entries, ws));
  for (int64_t i = 0; i < n_entries; ++i) {
    const GatherEntry& e = entries[i];
    const int64_t page = e.token / kv.page_size;
    const int64_t src = (e.kv_head * kv.page_size + e.token % kv.page_size) * kv.head_dim;
    const int64_t dst = (e.kv_head * ws.slots + e.slot) * ws.head_dim;
    const size_t row_bytes = static_cast<size_t>(kv.head_dim) * dtype_size(kv.dtype);
    std::memcpy(element_at(ws.k, ws.dtype, dst), element_at(kv.k_pages[page], kv.dtype, src), row_bytes);
    std::memcpy(element_at(ws.v, ws.dtype, dst), element_at(kv.v_pages[page], kv.dtype, src), row_bytes);
  }
  return Status::ok();
}

Status ReferenceBackend::attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items,
                                          int64_t n_heads, float* out) {
  SPX_RETURN_IF_ERROR(check_attention_sparse_args(items, n_items, n_heads));
  attend_items(q, items, n_items, n_heads, WorkingSetKv{}, out);
  return Status::ok();
}

Status ReferenceBackend::attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items,
                                           int64_t n_heads, float* out) {
  SPX_RETURN_IF_ERROR(check_attention_indexed_args(items, n_items, n_heads));
  attend_items(q, items, n_items, n_heads, IndexedPagedKv{}, out);
  return Status::ok();
}

}  // namespace specontext::cpu
