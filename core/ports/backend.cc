// Defaults of the Backend interface: host memory, and "not supported" for optional ops.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/base/host_math.h"
#include "core/ports/backend.h"

namespace specontext {

const float* kv_row_f32(const KvLayerView& kv, bool values, int64_t head, int64_t token, float* buf) {
  // Two statements on purpose: GCC 12 with -fsanitize=address computed a wild address for
  // `(values ? kv.v_pages : kv.k_pages)[i]` here (SEGV in the ASan CI job, fine without ASan).
  void* const* pages = values ? kv.v_pages : kv.k_pages;
  void* page = pages[token / kv.page_size];
  const int64_t first = (head * kv.page_size + token % kv.page_size) * kv.head_dim;
  if (kv.dtype == DType::kF32) return static_cast<const float*>(page) + first;
  convert_to_f32(kv.dtype, element_at(page, kv.dtype, first), buf, static_cast<size_t>(kv.head_dim));
  return buf;
}

Result<std::shared_ptr<void>> Backend::allocate(size_t bytes) {
  const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void* ptr = std::aligned_alloc(64, rounded);
  if (ptr == nullptr) {
    return resource_exhausted("cannot allocate " + std::to_string(bytes) + " bytes of host memory");
  }
  return std::shared_ptr<void>(ptr, [](void* q) { std::free(q); });
}

Status Backend::place_weights(const Model&) { return Status::ok(); }

Result<const void*> Backend::import_weights(const void* host, size_t) { return host; }

Status Backend::upload(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
  return Status::ok();
}

Status Backend::download(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
  return Status::ok();
}

Status Backend::copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                          size_t row_bytes, int64_t rows) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(d + static_cast<size_t>(r) * dst_stride, s + static_cast<size_t>(r) * src_stride, row_bytes);
  }
  return Status::ok();
}

Status Backend::synchronize() { return Status::ok(); }

Status Backend::retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                       int64_t block_tokens, int64_t length, int64_t n_heads, int64_t n_kv_heads,
                                       int64_t head_dim, float* out) {
  if (length <= 0) return Status::ok();
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0 || block_tokens <= 0) {
    return invalid_argument("retrieval_group_scores: " + std::to_string(n_heads) + " query heads, " +
                            std::to_string(n_kv_heads) + " KV heads, head_dim " + std::to_string(head_dim) +
                            ", blocks of " + std::to_string(block_tokens) + " tokens");
  }
  if (!is_head_key_dtype(k_dtype)) {
    return invalid_argument("retrieval_group_scores: keys of dtype " + std::string(dtype_name(k_dtype)) +
                            " (f32, f16 or bf16)");
  }
  std::vector<float> logits(static_cast<size_t>(n_heads * length));
  head_logits(q, k_blocks, k_dtype, block_tokens, 0, length, length, n_heads, n_kv_heads, head_dim, logits.data());
  softmax_rows(logits.data(), n_heads, length);
  group_max(logits.data(), 0, length, length, n_heads, n_kv_heads, out);
  return Status::ok();
}

Status Backend::select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                                  const SelectionOptions& options, Selection& out) {
  std::vector<float> host(static_cast<size_t>(std::max<int64_t>(n_kv_heads * length, 0)));
  SPX_RETURN_IF_ERROR(download(host.data(), group_scores, host.size() * sizeof(float)));
  select_from_group_scores(host, n_kv_heads, length, options, out);
  return Status::ok();
}

Status Backend::sample_rows(float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                            TokenId* tokens) {
  if (rows <= 0) return Status::ok();
  if (vocab <= 0) return invalid_argument("sample_rows: vocabulary of " + std::to_string(vocab) + " tokens");
  std::vector<float> host;
  float* rows_here = logits;
  if (memory_kind() != MemoryKind::kHost) {
    host.resize(static_cast<size_t>(rows * vocab));
    SPX_RETURN_IF_ERROR(download(host.data(), logits, host.size() * sizeof(float)));
    rows_here = host.data();
  }
  std::vector<std::pair<float, int32_t>> scratch;
  for (int64_t r = 0; r < rows; ++r) {
    tokens[r] = sample_with_coin(std::span<float>(rows_here + r * vocab, static_cast<size_t>(vocab)),
                                 draws[r], scratch);
  }
  return Status::ok();
}

Status Backend::kv_gather(const KvLayerView&, const GatherEntry*, int64_t, const WorkingSetView&) {
  return unimplemented("backend " + std::string(name()) + " has no kv_gather");
}

Status Backend::attention_sparse(const float*, const SparseAttentionItem*, int64_t, int64_t, float*) {
  return unimplemented("backend " + std::string(name()) + " has no sparse attention");
}

Status Backend::attention_indexed(const float*, const IndexedAttentionItem*, int64_t, int64_t, float*) {
  return unimplemented("backend " + std::string(name()) + " has no attention_indexed");
}

}  // namespace specontext
