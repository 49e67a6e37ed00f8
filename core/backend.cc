// Defaults of the Backend interface: host memory, and "not supported" for optional ops.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.h"

namespace specontext {

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

Status Backend::retrieval_group_scores(const float* q, const float* const* k_blocks, int64_t block_tokens,
                                       int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                       float* out) {
  if (length <= 0) return Status::ok();
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0 || block_tokens <= 0) {
    return invalid_argument("retrieval_group_scores: " + std::to_string(n_heads) + " query heads, " +
                            std::to_string(n_kv_heads) + " KV heads, head_dim " + std::to_string(head_dim) +
                            ", blocks of " + std::to_string(block_tokens) + " tokens");
  }
  const int64_t group = n_heads / n_kv_heads;
  const int64_t kvd = n_kv_heads * head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> row(static_cast<size_t>(length));
  std::fill(out, out + n_kv_heads * length, 0.0f);
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t g = h / group;
    const float* qh = q + h * head_dim;
    float mx = -INFINITY;
    for (int64_t t = 0; t < length; ++t) {
      const float* kt = k_blocks[t / block_tokens] + (t % block_tokens) * kvd + g * head_dim;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= head_dim; i += 8) {
        for (int u = 0; u < 8; ++u) acc[u] += qh[i + u] * kt[i + u];
      }
      float dot = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < head_dim; ++i) dot += qh[i] * kt[i];
      row[static_cast<size_t>(t)] = dot * scale;
      mx = std::max(mx, row[static_cast<size_t>(t)]);
    }
    double sum = 0.0;
    for (int64_t t = 0; t < length; ++t) sum += (row[static_cast<size_t>(t)] = std::exp(row[static_cast<size_t>(t)] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    float* dst = out + g * length;
    for (int64_t t = 0; t < length; ++t) dst[t] = std::max(dst[t], row[static_cast<size_t>(t)] * inv);
  }
  return Status::ok();
}

Status Backend::select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                                  const SelectionOptions& options, Selection& out) {
  std::vector<float> host(static_cast<size_t>(std::max<int64_t>(n_kv_heads * length, 0)));
  SPX_RETURN_IF_ERROR(download(host.data(), group_scores, host.size() * sizeof(float)));
  select_from_group_scores(host, n_kv_heads, length, options, out);
  return Status::ok();
}

Status Backend::kv_gather(const KvLayerView&, const GatherEntry*, int64_t, const WorkingSetView&) {
  return unimplemented("backend " + std::string(name()) + " has no kv_gather");
}

Status Backend::attention_sparse(const float*, const SparseAttentionItem*, int64_t, int64_t, float*) {
  return unimplemented("backend " + std::string(name()) + " has no sparse attention");
}

}  // namespace specontext
