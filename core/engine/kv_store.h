// The KV cache across tiers (core/README.md "KV memory"): global page ids shared by every layer,
// and per layer a home tier holding that layer's pages. Also the sub-allocation of every tier's
// registered region, so that working sets, staging pages and the retrieval head's keys live in
// the same accounted memory as the pages.
//
// Layout. A page holds page_size consecutive positions of one sequence. In a layer's home, pages
// are stored in chunks of chunk_pages pages; page p of layer l lives in chunk p / chunk_pages at
// slot p % chunk_pages, and a page slot is its K block followed by its V block, each
// [kv_heads][page_size][head_dim] elements of the store's dtype (f32, f16 or bf16; one KV head's
// tokens contiguous, so one selected token of one head is head_dim contiguous elements). Chunk storage is allocated when its first page is
// taken and freed when its last page is returned, in every layer at once.
//
// Ownership: the store owns the allocators; the memory of each tier is owned by whoever created
// it (TierMemory::owner keeps it alive). The engine owns page tables. Not thread-safe: the engine
// loop (one thread) calls everything.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/base/ids.h"
#include "core/base/region_allocator.h"
#include "core/base/status.h"
#include "core/model/model_config.h"
#include "core/ports/backend.h"
#include "core/ports/placement.h"
#include "core/ports/transport.h"

namespace specontext {

// One tier's memory: `base` is null for remote tiers (reachable only through a transport).
struct TierMemory {
  TierDescription desc;
  void* base = nullptr;
  std::shared_ptr<void> owner;
};

struct PageLocation {
  TierId tier;
  uint64_t offset = 0;  // of the page slot (its K block); the V block follows at +block_bytes
};

class KvStore {
 public:
  // tiers[i].desc.id must be TierId(i); tier 0 is the device (the memory the backend computes
  // on). Every layer starts homed on the device.
  // chunk_pages = 0 picks about 2 MiB per layer chunk (at most 64 pages, at least 8 chunks).
  // dtype: the element type of K and V (is_kv_dtype).
  static Result<std::unique_ptr<KvStore>> create(const ModelConfig& config, int64_t page_size,
                                                 int64_t n_pages, std::vector<TierMemory> tiers,
                                                 int64_t chunk_pages = 0, DType dtype = DType::kF32);
  // The chunk size create() picks for chunk_pages = 0.
  static int64_t default_chunk_pages(uint64_t page_bytes, int64_t n_pages);

  int64_t page_size() const { return page_size_; }
  int64_t total_pages() const { return n_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t used_pages() const { return n_pages_ - free_pages(); }
  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t chunk_pages() const { return chunk_pages_; }
  DType dtype() const { return dtype_; }
  // Bytes of one token of one KV head (K or V).
  uint64_t row_bytes() const { return static_cast<uint64_t>(head_dim_) * dtype_size(dtype_); }
  // Elements in one K (or V) block of one page of one layer.
  int64_t page_elements() const { return page_size_ * kv_heads_ * head_dim_; }
  uint64_t block_bytes() const { return static_cast<uint64_t>(page_elements()) * dtype_size(dtype_); }
  uint64_t page_bytes() const { return 2 * block_bytes(); }  // K + V of one page of one layer
  uint64_t chunk_bytes() const { return page_bytes() * static_cast<uint64_t>(chunk_pages_); }

  // ---- pages ----
  // A free page id, with chunk storage allocated in every layer's home when it is the first
  // page of its chunk (all or nothing). kResourceExhausted names the pool or the full tier.
  Result<PageId> allocate_page();
  // Pages are reference counted so that sequences forked from a common prefix share its full
  // pages (Engine::fork_sequence): allocate_page hands out one reference, share_page adds one to
  // a page in use, free_page drops one and returns the page to the pool with the last.
  void share_page(PageId page);
  void free_page(PageId page);
  int32_t page_references(PageId page) const { return page_refs_[static_cast<size_t>(page.value())]; }

  TierId home(LayerId layer) const { return layers_[static_cast<size_t>(layer.value())].home; }
  bool resident(LayerId layer) const { return home(layer) == TierId(0); }
  PageLocation locate(LayerId layer, PageId page) const;
  // Compute pointers of a resident layer's page (device memory).
  void* k_page(LayerId layer, PageId page) const;
  void* v_page(LayerId layer, PageId page) const;
  // Per-layer view of a sequence's page table for a RESIDENT layer; k_ptrs/v_ptrs receive the
  // page pointers and must outlive the view.
  KvLayerView view(LayerId layer, const std::vector<PageId>& pages, std::vector<void*>& k_ptrs,
                   std::vector<void*>& v_ptrs) const;

  // ---- moving a layer between tiers (between steps) ----
  // Allocates the layer's chunks in `to` and returns the copies that move its allocated chunks
  // there (one request per chunk). Until commit_move or abort_move the layer stays homed where it
  // was. One move per layer at a time.
  Result<std::vector<TransferRequest>> begin_move(LayerId layer, TierId to);
  // After the copies completed: frees the old chunks, re-homes the layer.
  Status commit_move(LayerId layer);
  // After a failed copy: frees the new chunks; the layer keeps its home and content.
  void abort_move(LayerId layer);

  // ---- other allocations in a tier (working sets, staging, the head's keys) ----
  // Taken from the top of the tier's region, away from the KV chunks at the bottom.
  Result<uint64_t> allocate(TierId tier, uint64_t bytes);
  Status release(TierId tier, uint64_t offset);
  // Host/device address of an offset of a tier with memory (null for remote tiers).
  void* address(TierId tier, uint64_t offset) const;

  const std::vector<TierMemory>& tiers() const { return tiers_; }
  int64_t n_tiers() const { return static_cast<int64_t>(tiers_.size()); }
  uint64_t tier_used_bytes(TierId tier) const;
  // Bytes of KV pages (allocated chunks) of a layer in its home.
  uint64_t layer_bytes(LayerId layer) const;
  // Every allocation lies in its tier's region, no two overlap, chunk use counts equal the pages
  // in use, and every used chunk has storage in each layer's home. kInternal naming the problem.
  Status check_invariants() const;

 private:
  static constexpr uint64_t kNoChunk = ~uint64_t{0};
  struct LayerHome {
    TierId home{0};
    std::vector<uint64_t> chunks;  // offset per chunk index in home (kNoChunk when unallocated)
    TierId moving_to;              // valid during a move
    std::vector<uint64_t> new_chunks;
  };
  KvStore() = default;
  Status allocate_chunk(int64_t chunk);  // in every layer (and pending move targets)
  void free_chunk(int64_t chunk);

  int64_t page_size_ = 0;
  int64_t n_pages_ = 0;
  int64_t kv_heads_ = 0;
  int64_t head_dim_ = 0;
  int64_t chunk_pages_ = 1;
  DType dtype_ = DType::kF32;
  std::vector<TierMemory> tiers_;
  std::vector<RegionAllocator> allocators_;
  std::vector<LayerHome> layers_;
  std::vector<int32_t> chunk_use_;  // pages in use per chunk
  std::vector<int32_t> page_refs_;  // holders per page (0: free)
  // A min-heap: the lowest free id is handed out first, so live pages stay packed in the lowest
  // chunks. (LIFO reuse spread a new sequence's pages over the chunks an old one had used, and the
  // device held two chunks per layer for eleven pages: `generate --batch 4 --device-kv 700KiB`
  // on stories260K ran out of device memory mid-run.)
  std::vector<PageId> free_list_;
};

}  // namespace specontext
