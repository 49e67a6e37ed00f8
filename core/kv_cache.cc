#include "core/kv_cache.h"

#include <string>

namespace specontext {

Result<std::unique_ptr<KvCache>> KvCache::create(const ModelConfig& config, Backend& backend,
                                                 int64_t page_size, int64_t n_pages) {
  if (page_size <= 0 || n_pages <= 0) {
    return invalid_argument("KV cache: page_size and n_pages must be positive (got " +
                            std::to_string(page_size) + ", " + std::to_string(n_pages) + ")");
  }
  std::unique_ptr<KvCache> cache(new KvCache());
  cache->page_size_ = page_size;
  cache->n_pages_ = n_pages;
  cache->kv_heads_ = config.n_kv_heads;
  cache->head_dim_ = config.head_dim;
  const size_t arena_bytes = static_cast<size_t>(n_pages * cache->page_floats()) * sizeof(float);
  cache->layers_.resize(static_cast<size_t>(config.n_layers));
  for (auto& arena : cache->layers_) {
    SPX_ASSIGN_OR_RETURN(arena.k_storage, backend.allocate(arena_bytes));
    SPX_ASSIGN_OR_RETURN(arena.v_storage, backend.allocate(arena_bytes));
    arena.k = static_cast<float*>(arena.k_storage.get());
    arena.v = static_cast<float*>(arena.v_storage.get());
  }
  cache->free_list_.reserve(static_cast<size_t>(n_pages));
  for (int64_t p = n_pages - 1; p >= 0; --p) cache->free_list_.push_back(PageId(static_cast<int32_t>(p)));
  return cache;
}

Result<PageId> KvCache::allocate_page() {
  if (free_list_.empty()) {
    return resource_exhausted("KV cache full: all " + std::to_string(n_pages_) + " pages of " +
                              std::to_string(page_size_) + " tokens are in use");
  }
  const PageId page = free_list_.back();
  free_list_.pop_back();
  return page;
}

void KvCache::free_page(PageId page) { free_list_.push_back(page); }

KvLayerView KvCache::view(LayerId layer, const std::vector<PageId>& pages,
                          std::vector<float*>& k_ptrs, std::vector<float*>& v_ptrs) const {
  k_ptrs.resize(pages.size());
  v_ptrs.resize(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    k_ptrs[i] = k_page(layer, pages[i]);
    v_ptrs[i] = v_page(layer, pages[i]);
  }
  KvLayerView v;
  v.k_pages = k_ptrs.data();
  v.v_pages = v_ptrs.data();
  v.n_pages = static_cast<int64_t>(pages.size());
  v.page_size = page_size_;
  v.kv_heads = kv_heads_;
  v.head_dim = head_dim_;
  return v;
}

}  // namespace specontext
