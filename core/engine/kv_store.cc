#include "core/engine/kv_store.h"

#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <utility>

namespace specontext {

std::string_view tier_kind_name(TierKind kind) {
  switch (kind) {
    case TierKind::kDevice: return "device";
    case TierKind::kHost: return "host";
    case TierKind::kRemote: return "remote";
  }
  return "?";
}

int64_t KvStore::default_chunk_pages(uint64_t page_bytes, int64_t n_pages) {
  // About 2 MiB per layer chunk: large enough that a layer move is a few big copies, small
  // enough that a short sequence does not reserve much.
  // At least 8 chunks per layer, so that a small pool is not one indivisible arena.
  const int64_t p = std::clamp<int64_t>(static_cast<int64_t>((uint64_t{2} << 20) / std::max<uint64_t>(page_bytes, 1)), 1, 64);
  return std::max<int64_t>(1, std::min(p, n_pages / 8));
}

Result<std::unique_ptr<KvStore>> KvStore::create(const ModelConfig& config, int64_t page_size, int64_t n_pages,
                                                 std::vector<TierMemory> tiers, int64_t chunk_pages, DType dtype) {
  if (!is_kv_dtype(dtype)) {
    return invalid_argument("KV store: dtype " + std::string(dtype_name(dtype)) + " is not f32, f16 or bf16");
  }
  if (page_size <= 0 || n_pages <= 0) {
    return invalid_argument("KV store: page_size and n_pages must be positive (got " + std::to_string(page_size) +
                            ", " + std::to_string(n_pages) + ")");
  }
  if (tiers.empty() || tiers[0].desc.kind != TierKind::kDevice) {
    return invalid_argument("KV store: tier 0 must be the device");
  }
  for (size_t i = 0; i < tiers.size(); ++i) {
    const TierMemory& t = tiers[i];
    if (t.desc.id != TierId(static_cast<int32_t>(i))) {
      return invalid_argument("KV store: tier " + t.desc.name + " has id " + std::to_string(t.desc.id.value()) +
                              ", expected " + std::to_string(i));
    }
    if ((t.base == nullptr) != (t.desc.kind == TierKind::kRemote)) {
      return invalid_argument("KV store: tier " + t.desc.name + (t.base ? " is remote but has an address"
                                                                          : " has no memory"));
    }
  }
  std::unique_ptr<KvStore> s(new KvStore());
  s->page_size_ = page_size;
  s->n_pages_ = n_pages;
  s->kv_heads_ = config.n_kv_heads;
  s->head_dim_ = config.head_dim;
  s->dtype_ = dtype;
  if (chunk_pages < 0) return invalid_argument("KV store: chunk_pages must not be negative");
  s->chunk_pages_ = chunk_pages > 0 ? std::min(chunk_pages, n_pages) : default_chunk_pages(s->page_bytes(), n_pages);
  for (const TierMemory& t : tiers) s->allocators_.emplace_back(t.desc.capacity_bytes);
  s->tiers_ = std::move(tiers);
  const int64_t n_chunks = (n_pages + s->chunk_pages_ - 1) / s->chunk_pages_;
  s->layers_.resize(static_cast<size_t>(config.n_layers));
  for (LayerHome& l : s->layers_) l.chunks.assign(static_cast<size_t>(n_chunks), kNoChunk);
  s->chunk_use_.assign(static_cast<size_t>(n_chunks), 0);
  s->page_refs_.assign(static_cast<size_t>(n_pages), 0);
  s->free_list_.reserve(static_cast<size_t>(n_pages));
  for (int64_t p = 0; p < n_pages; ++p) s->free_list_.push_back(PageId(static_cast<int32_t>(p)));  // sorted: a min-heap
  return s;
}

Status KvStore::allocate_chunk(int64_t chunk) {
  const size_t c = static_cast<size_t>(chunk);
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerHome& lh = layers_[l];
    auto off = allocators_[static_cast<size_t>(lh.home.value())].allocate(chunk_bytes());
    Result<uint64_t> moving = uint64_t{0};
    if (off.is_ok() && lh.moving_to.valid()) {
      moving = allocators_[static_cast<size_t>(lh.moving_to.value())].allocate(chunk_bytes());
      if (!moving.is_ok()) (void)allocators_[static_cast<size_t>(lh.home.value())].free(*off);
    }
    if (!off.is_ok() || !moving.is_ok()) {
      for (size_t j = 0; j < l; ++j) {  // roll back the layers done so far
        LayerHome& done = layers_[j];
        (void)allocators_[static_cast<size_t>(done.home.value())].free(done.chunks[c]);
        done.chunks[c] = kNoChunk;
        if (done.moving_to.valid()) {
          (void)allocators_[static_cast<size_t>(done.moving_to.value())].free(done.new_chunks[c]);
          done.new_chunks[c] = kNoChunk;
        }
      }
      const TierId full = !off.is_ok() ? lh.home : lh.moving_to;
      const Status& why = !off.is_ok() ? off.status() : moving.status();
      return resource_exhausted("KV tier " + tiers_[static_cast<size_t>(full.value())].desc.name +
                                " is full (layer " + std::to_string(l) + "): " + why.message());
    }
    lh.chunks[c] = *off;
    if (lh.moving_to.valid()) lh.new_chunks[c] = *moving;
  }
  return Status::ok();
}

void KvStore::free_chunk(int64_t chunk) {
  const size_t c = static_cast<size_t>(chunk);
  for (LayerHome& lh : layers_) {
    if (lh.chunks[c] != kNoChunk) (void)allocators_[static_cast<size_t>(lh.home.value())].free(lh.chunks[c]);
    lh.chunks[c] = kNoChunk;
    if (lh.moving_to.valid() && lh.new_chunks[c] != kNoChunk) {
      (void)allocators_[static_cast<size_t>(lh.moving_to.value())].free(lh.new_chunks[c]);
      lh.new_chunks[c] = kNoChunk;
    }
  }
}

Result<PageId> KvStore::allocate_page() {
  if (free_list_.empty()) {
    return resource_exhausted("KV cache full: all " + std::to_string(n_pages_) + " pages of " +
                              std::to_string(page_size_) + " tokens are in use");
  }
  const PageId page = free_list_.front();  // the lowest free id
  const int64_t chunk = page.value() / chunk_pages_;
  if (chunk_use_[static_cast<size_t>(chunk)] == 0) SPX_RETURN_IF_ERROR(allocate_chunk(chunk));
  ++chunk_use_[static_cast<size_t>(chunk)];
  std::pop_heap(free_list_.begin(), free_list_.end(), std::greater<>());
  free_list_.pop_back();
  page_refs_[static_cast<size_t>(page.value())] = 1;
  return page;
}

void KvStore::share_page(PageId page) { ++page_refs_[static_cast<size_t>(page.value())]; }

void KvStore::free_page(PageId page) {
  if (--page_refs_[static_cast<size_t>(page.value())] > 0) return;
  const int64_t chunk = page.value() / chunk_pages_;
  if (--chunk_use_[static_cast<size_t>(chunk)] == 0) free_chunk(chunk);
  free_list_.push_back(page);
  std::push_heap(free_list_.begin(), free_list_.end(), std::greater<>());
}

PageLocation KvStore::locate(LayerId layer, PageId page) const {
  const LayerHome& lh = layers_[static_cast<size_t>(layer.value())];
  const uint64_t chunk = lh.chunks[static_cast<size_t>(page.value() / chunk_pages_)];
  return {lh.home, chunk + static_cast<uint64_t>(page.value() % chunk_pages_) * page_bytes()};
}

void* KvStore::k_page(LayerId layer, PageId page) const {
  const PageLocation loc = locate(layer, page);
  return address(loc.tier, loc.offset);
}

void* KvStore::v_page(LayerId layer, PageId page) const {
  const PageLocation loc = locate(layer, page);
  return address(loc.tier, loc.offset + block_bytes());
}

KvLayerView KvStore::view(LayerId layer, const std::vector<PageId>& pages, std::vector<void*>& k_ptrs,
                          std::vector<void*>& v_ptrs) const {
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
  v.dtype = dtype_;
  return v;
}

Result<std::vector<TransferRequest>> KvStore::begin_move(LayerId layer, TierId to) {
  if (!layer.valid() || layer.value() >= n_layers()) return invalid_argument("KV store: no layer " + std::to_string(layer.value()));
  if (!to.valid() || to.value() >= n_tiers()) return invalid_argument("KV store: no tier " + std::to_string(to.value()));
  LayerHome& lh = layers_[static_cast<size_t>(layer.value())];
  if (lh.moving_to.valid()) return invalid_argument("KV store: layer " + std::to_string(layer.value()) + " is already moving");
  if (lh.home == to) return std::vector<TransferRequest>{};
  RegionAllocator& dst = allocators_[static_cast<size_t>(to.value())];
  lh.new_chunks.assign(lh.chunks.size(), kNoChunk);
  std::vector<TransferRequest> copies;
  for (size_t c = 0; c < lh.chunks.size(); ++c) {
    if (lh.chunks[c] == kNoChunk) continue;
    auto off = dst.allocate(chunk_bytes());
    if (!off.is_ok()) {
      for (size_t j = 0; j < c; ++j) {
        if (lh.new_chunks[j] != kNoChunk) (void)dst.free(lh.new_chunks[j]);
      }
      lh.new_chunks.clear();
      return resource_exhausted("cannot move layer " + std::to_string(layer.value()) + " to " +
                                tiers_[static_cast<size_t>(to.value())].desc.name + ": " + off.status().message());
    }
    lh.new_chunks[c] = *off;
    copies.push_back(TransferRequest{lh.home, lh.chunks[c], to, *off, chunk_bytes()});
  }
  lh.moving_to = to;
  return copies;
}

Status KvStore::commit_move(LayerId layer) {
  LayerHome& lh = layers_[static_cast<size_t>(layer.value())];
  if (!lh.moving_to.valid()) return Status::ok();
  RegionAllocator& src = allocators_[static_cast<size_t>(lh.home.value())];
  for (size_t c = 0; c < lh.chunks.size(); ++c) {
    if (lh.chunks[c] != kNoChunk) SPX_RETURN_IF_ERROR(src.free(lh.chunks[c]));
  }
  lh.chunks = std::move(lh.new_chunks);
  lh.new_chunks.clear();
  lh.home = lh.moving_to;
  lh.moving_to = TierId();
  return Status::ok();
}

void KvStore::abort_move(LayerId layer) {
  LayerHome& lh = layers_[static_cast<size_t>(layer.value())];
  if (!lh.moving_to.valid()) return;
  RegionAllocator& dst = allocators_[static_cast<size_t>(lh.moving_to.value())];
  for (uint64_t off : lh.new_chunks) {
    if (off != kNoChunk) (void)dst.free(off);
  }
  lh.new_chunks.clear();
  lh.moving_to = TierId();
}

Result<uint64_t> KvStore::allocate(TierId tier, uint64_t bytes) {
  if (!tier.valid() || tier.value() >= n_tiers()) return invalid_argument("KV store: no tier " + std::to_string(tier.value()));
  auto off = allocators_[static_cast<size_t>(tier.value())].allocate_top(bytes);
  if (!off.is_ok()) {
    return resource_exhausted("KV tier " + tiers_[static_cast<size_t>(tier.value())].desc.name + " is full: " +
                              off.status().message());
  }
  return *off;
}

Status KvStore::release(TierId tier, uint64_t offset) {
  if (!tier.valid() || tier.value() >= n_tiers()) return invalid_argument("KV store: no tier " + std::to_string(tier.value()));
  return allocators_[static_cast<size_t>(tier.value())].free(offset);
}

void* KvStore::address(TierId tier, uint64_t offset) const {
  void* base = tiers_[static_cast<size_t>(tier.value())].base;
  return base == nullptr ? nullptr : static_cast<std::byte*>(base) + offset;
}

uint64_t KvStore::tier_used_bytes(TierId tier) const { return allocators_[static_cast<size_t>(tier.value())].used_bytes(); }

uint64_t KvStore::layer_bytes(LayerId layer) const {
  const LayerHome& lh = layers_[static_cast<size_t>(layer.value())];
  uint64_t n = 0;
  for (uint64_t off : lh.chunks) n += off != kNoChunk ? chunk_bytes() : 0;
  return n;
}

Status KvStore::check_invariants() const {
  for (size_t t = 0; t < allocators_.size(); ++t) {
    Status s = allocators_[t].check();
    if (!s.is_ok()) return s.with_context("tier " + tiers_[t].desc.name);
  }
  // Chunk use counts against the free list.
  std::vector<int32_t> use(chunk_use_.size(), 0);
  std::vector<char> is_free(static_cast<size_t>(n_pages_), 0);
  for (PageId p : free_list_) {
    if (is_free[static_cast<size_t>(p.value())]++) return internal_error("KV store: page " + std::to_string(p.value()) + " is free twice");
  }
  for (int64_t p = 0; p < n_pages_; ++p) {
    if (!is_free[static_cast<size_t>(p)]) ++use[static_cast<size_t>(p / chunk_pages_)];
    if ((page_refs_[static_cast<size_t>(p)] == 0) != (is_free[static_cast<size_t>(p)] != 0)) {
      return internal_error("KV store: page " + std::to_string(p) + " has " +
                            std::to_string(page_refs_[static_cast<size_t>(p)]) + " references but is " +
                            (is_free[static_cast<size_t>(p)] ? "free" : "in use"));
    }
  }
  if (use != chunk_use_) return internal_error("KV store: chunk use counts differ from the pages in use");
  // Every used chunk has storage in every layer's home, exactly the allocation of its size, and
  // no allocation backs two (layer, chunk) pairs.
  std::set<std::pair<int32_t, uint64_t>> owners;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerHome& lh = layers_[l];
    const RegionAllocator& a = allocators_[static_cast<size_t>(lh.home.value())];
    for (size_t c = 0; c < lh.chunks.size(); ++c) {
      const bool used = chunk_use_[c] > 0;
      if (used != (lh.chunks[c] != kNoChunk)) {
        return internal_error("KV store: layer " + std::to_string(l) + " chunk " + std::to_string(c) +
                              (used ? " in use without storage" : " has storage but no pages"));
      }
      if (used && a.size_at(lh.chunks[c]) < chunk_bytes()) {
        return internal_error("KV store: layer " + std::to_string(l) + " chunk " + std::to_string(c) +
                              " is not an allocation of " + tiers_[static_cast<size_t>(lh.home.value())].desc.name);
      }
      if (used && !owners.emplace(lh.home.value(), lh.chunks[c]).second) {
        return internal_error("KV store: layer " + std::to_string(l) + " chunk " + std::to_string(c) +
                              " shares its storage with another layer's chunk");
      }
    }
  }
  return Status::ok();
}

}  // namespace specontext
