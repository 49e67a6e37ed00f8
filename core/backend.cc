// Defaults of the Backend interface: host memory, and "not supported" for optional ops.
#include <algorithm>
#include <cstdlib>
#include <string>

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

Status Backend::kv_gather(const KvLayerView&, const GatherEntry*, int64_t, const WorkingSetView&) {
  return unimplemented("backend " + std::string(name()) + " has no kv_gather");
}

Status Backend::attention_sparse(const float*, const SparseAttentionItem*, int64_t, int64_t, float*) {
  return unimplemented("backend " + std::string(name()) + " has no sparse attention");
}

}  // namespace specontext
