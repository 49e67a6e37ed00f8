#include "core/ports/backend_checks.h"

#include <algorithm>
#include <string>
#include <vector>

namespace specontext {

Status check_working_set(const WorkingSetView& ws, const char* op, bool need_counts) {
  if (ws.kv_heads <= 0 || ws.head_dim <= 0 || ws.slots < 0) {
    return invalid_argument(std::string(op) +
                            ": working set kv_heads and head_dim must be positive, slots >= 0");
  }
  if (!is_kv_dtype(ws.dtype)) {
    return invalid_argument(std::string(op) + ": working set dtype " + std::string(dtype_name(ws.dtype)) +
                            " is not f32, f16 or bf16");
  }
  if (ws.slots > 0 && (ws.k == nullptr || ws.v == nullptr)) {
    return invalid_argument(std::string(op) + ": null working-set K/V");
  }
  if (!need_counts) return Status::ok();
  if (ws.counts == nullptr) return invalid_argument(std::string(op) + ": null working-set counts");
  for (int64_t h = 0; h < ws.kv_heads; ++h) {
    if (ws.counts[h] < 0 || ws.counts[h] > ws.slots) {
      return invalid_argument(std::string(op) + ": counts[" + std::to_string(h) +
                              "] = " + std::to_string(ws.counts[h]) + " outside [0, " +
                              std::to_string(ws.slots) + "]");
    }
  }
  return Status::ok();
}

Status check_gather_entries(const GatherEntry* entries, int64_t n_entries, const WorkingSetView& ws,
                            int64_t capacity, int64_t* min_token, int64_t* max_token) {
  // One bit per destination (head, slot).
  std::vector<uint64_t> taken(static_cast<size_t>((ws.kv_heads * ws.slots + 63) / 64), 0);
  int64_t lo = capacity;
  int64_t hi = -1;
  for (int64_t i = 0; i < n_entries; ++i) {
    const GatherEntry& e = entries[i];
    if (e.kv_head < 0 || e.kv_head >= ws.kv_heads || e.token < 0 || e.token >= capacity || e.slot < 0 ||
        e.slot >= ws.slots) {
      return invalid_argument("kv_gather: entry " + std::to_string(i) + " (head " +
                              std::to_string(e.kv_head) + ", token " + std::to_string(e.token) + ", slot " +
                              std::to_string(e.slot) + ") outside kv_heads " + std::to_string(ws.kv_heads) +
                              ", capacity " + std::to_string(capacity) + ", slots " +
                              std::to_string(ws.slots));
    }
    const int64_t bit = e.kv_head * ws.slots + e.slot;
    uint64_t& word = taken[static_cast<size_t>(bit / 64)];
    const uint64_t mask = uint64_t{1} << (bit % 64);
    if ((word & mask) != 0) {
      return invalid_argument("kv_gather: entry " + std::to_string(i) + " writes head " +
                              std::to_string(e.kv_head) + " slot " + std::to_string(e.slot) +
                              " a second time");
    }
    word |= mask;
    lo = std::min<int64_t>(lo, e.token);
    hi = std::max<int64_t>(hi, e.token);
  }
  if (min_token != nullptr) *min_token = lo;
  if (max_token != nullptr) *max_token = hi;
  return Status::ok();
}

Status check_attention_indexed_args(const IndexedAttentionItem* items, int64_t n_items, int64_t n_heads) {
  const std::string op = "attention_indexed: ";
  if (n_items < 0) return invalid_argument(op + "negative item count");
  if (n_items == 0) return Status::ok();
  if (items == nullptr || n_heads <= 0) return invalid_argument(op + "no items or heads");
  const int64_t head_dim = items[0].kv.head_dim;
  for (int64_t i = 0; i < n_items; ++i) {
    const IndexedAttentionItem& it = items[i];
    const KvLayerView& kv = it.kv;
    const std::string at = op + "items[" + std::to_string(i) + "]";
    if (kv.page_size <= 0 || kv.kv_heads <= 0 || kv.head_dim <= 0 || kv.n_pages < 0) {
      return invalid_argument(at + ".kv: page_size, kv_heads and head_dim must be positive");
    }
    if (kv.n_pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr)) {
      return invalid_argument(at + ".kv: null page tables");
    }
    if (!is_kv_dtype(kv.dtype)) {
      return invalid_argument(at + ".kv.dtype " + std::string(dtype_name(kv.dtype)) + " is not f32, f16 or bf16");
    }
    if (kv.head_dim != head_dim) return invalid_argument(op + "items disagree on head_dim");
    if (n_heads % kv.kv_heads != 0) {
      return invalid_argument(op + "n_heads " + std::to_string(n_heads) + " not a multiple of kv_heads " +
                              std::to_string(kv.kv_heads));
    }
    if (it.n_tokens < 0 || it.token_offset < 0) return invalid_argument(at + " has negative rows");
    if (it.stride < 0) return invalid_argument(at + ".stride is negative");
    if (it.counts == nullptr) return invalid_argument(at + ".counts is null");
    const int64_t capacity = kv.capacity();
    for (int64_t h = 0; h < kv.kv_heads; ++h) {
      const int64_t c = it.counts[h];
      if (c < 0 || c > it.stride) {
        return invalid_argument(at + ".counts[" + std::to_string(h) + "] = " + std::to_string(c) +
                                " outside [0, " + std::to_string(it.stride) + "]");
      }
      if (c > 0 && it.indices == nullptr) return invalid_argument(at + ".indices is null");
      for (int64_t j = 0; j < c; ++j) {
        const int64_t t = it.indices[h * it.stride + j];
        if (t < 0 || t >= capacity) {
          return invalid_argument(at + ".indices[" + std::to_string(h * it.stride + j) + "] = " + std::to_string(t) +
                                  " outside the cache [0, " + std::to_string(capacity) + ")");
        }
      }
    }
  }
  return Status::ok();
}

}  // namespace specontext
