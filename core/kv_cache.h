// Paged KV cache: one arena per layer, pages shared by index across layers.
//
// Layout (see core/README.md): a page holds page_size consecutive token positions of one
// sequence. In every layer, page p has a K block and a V block, each
// [kv_heads][page_size][head_dim] f32, so one KV head's tokens are contiguous inside a page
// (the sparse gather of a later issue reads runs of one head). A sequence owns a page table
// (std::vector<PageId>) that is the same for all layers; a layer's arena can therefore be moved
// to another memory tier as a whole without touching page tables.
#pragma once

#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/ids.h"
#include "core/model_config.h"
#include "core/status.h"

namespace specontext {

class KvCache {
 public:
  // Reserves n_pages pages per layer in the backend's memory. Memory is touched lazily by the
  // OS (first touch), so a large reservation costs address space, not RAM, until used.
  static Result<std::unique_ptr<KvCache>> create(const ModelConfig& config, Backend& backend,
                                                 int64_t page_size, int64_t n_pages);

  int64_t page_size() const { return page_size_; }
  int64_t total_pages() const { return n_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t used_pages() const { return n_pages_ - free_pages(); }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Floats in one K (or V) block of one page of one layer.
  int64_t page_floats() const { return page_size_ * kv_heads_ * head_dim_; }
  // Bytes of one page summed over K, V and all layers.
  int64_t page_bytes_all_layers() const { return 2 * page_floats() * 4 * n_layers(); }

  // ResourceExhausted when no page is free.
  Result<PageId> allocate_page();
  void free_page(PageId page);

  float* k_page(LayerId layer, PageId page) const {
    return layers_[layer.value()].k + page.value() * page_floats();
  }
  float* v_page(LayerId layer, PageId page) const {
    return layers_[layer.value()].v + page.value() * page_floats();
  }

  // Builds the per-layer view of a sequence's page table; `k_ptrs`/`v_ptrs` receive the page
  // pointers and must outlive the view.
  KvLayerView view(LayerId layer, const std::vector<PageId>& pages, std::vector<float*>& k_ptrs,
                   std::vector<float*>& v_ptrs) const;

 private:
  struct LayerArena {
    std::shared_ptr<void> k_storage, v_storage;
    float* k = nullptr;
    float* v = nullptr;
  };
  KvCache() = default;
  int64_t page_size_ = 0;
  int64_t n_pages_ = 0;
  int64_t kv_heads_ = 0;
  int64_t head_dim_ = 0;
  std::vector<LayerArena> layers_;
  std::vector<PageId> free_list_;  // LIFO: recently freed pages are warm in cache
};

}  // namespace specontext
