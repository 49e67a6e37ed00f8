// KV tiers in the engine: applying placements (layer migrations), asking the policy before a
// step, per-tier reports, and the synthetic fill that writes pages wherever they live.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "core/engine/engine.h"

namespace specontext {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct SyntheticValues {
  uint64_t state;
  float next() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const uint32_t r = static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 40);
    return static_cast<float>(r) / 8388608.0f - 1.0f;
  }
};

}  // namespace

PlacementInput Engine::placement_input(const std::vector<int64_t>& seq_lens) const {
  PlacementInput in;
  in.seq_lens = seq_lens;
  in.current = memory_->placement_;
  for (const TierMemory& t : kv_->tiers()) {
    in.tiers.push_back(t.desc);
    if (is_abandoned(t.desc.id)) {
      in.tiers.back().capacity_bytes = 0;  // lost: nothing is placed there again
    }
    in.tier_used_bytes.push_back(kv_->tier_used_bytes(t.desc.id));
  }
  // What the planner's model does not count on the device. It must not depend on the placement,
  // or moving a layer would change the room the planner sees and the plan would oscillate: so it
  // is everything used beyond what the model counts — resident KV chunks, the head's key blocks
  // (its (1 + α) term) and the working sets of offloaded layers (its staging term i·R·B·H·D·kvc;
  // device-homed layers have none) —, i.e. staging and alignment, plus what the coming step may
  // take at once: a chunk per layer for each sequence's next page, a head key block per sequence.
  const ModelConfig& c = config();
  const TierId device(0);
  uint64_t modelled = memory_->working_set_bytes_in_use();
  for (int64_t l = 0; l < kv_->n_layers(); ++l) {
    const LayerId layer(static_cast<int32_t>(l));
    if (kv_->resident(layer)) modelled += kv_->layer_bytes(layer);
  }
  uint64_t growth = 0;
  for (const auto& [id, s] : memory_->sequences_) {
    if (!s.head_blocks.empty() && s.head_tier == device)
      modelled += s.head_blocks.size() * memory_->head_block_bytes();
    growth += static_cast<uint64_t>(c.n_layers) * kv_->chunk_bytes();
    if (options_.sparse.method == SparseMethod::kSpeContext) growth += memory_->head_block_bytes();
  }
  const uint64_t used = kv_->tier_used_bytes(device);
  in.device_other_bytes = (used > modelled ? used - modelled : 0) + growth + staging_reserve(seq_lens);
  return in;
}

uint64_t Engine::staging_reserve(std::span<const int64_t> lengths) const {
  // Under a shared selection a sequence stages whole pages only while it is within the budget,
  // before it has working sets; the planner's staging term reserves those working sets (B tokens
  // per offloaded layer and request), which exceed the staging (at most staging_layers layers of
  // B tokens, and a page per remote layer). Past the budget its remote layers load elastic into
  // working sets.
  if (shares_selection(options_.sparse.method)) return 0;
  bool stages = false;  // a tier the backend cannot read, so its layers are staged
  for (const TierMemory& t : kv_->tiers()) {
    stages |= t.desc.id != TierId(0) && !is_abandoned(t.desc.id) && !memory_->backend_reads(t.desc.id);
  }
  if (!stages) return 0;
  // Counted whether or not a layer is remote now, so that the room the planner sees does not
  // depend on the placement: the ring holds the sequence's whole cached pages, each remote layer
  // a tail page for the token the step appends.
  const int64_t ps = kv_->page_size();
  uint64_t pages = 0;
  for (int64_t len : lengths) {
    pages += static_cast<uint64_t>(options_.tiering.staging_layers * (len / ps) + kv_->n_layers());
  }
  return pages * kv_->page_bytes();
}

Status Engine::set_placement_policy(std::shared_ptr<PlacementPolicy> policy) {
  if (policy && kv_->n_tiers() < 2) return invalid_argument("a placement policy needs host or remote tiers");
  options_.tiering.policy = std::move(policy);
  return Status::ok();
}

Status Engine::rebalance(std::span<const StepRequest> requests) {
  std::vector<int64_t> lens;
  lens.reserve(memory_->sequences_.size());
  for (const auto& [id, s] : memory_->sequences_) {
    int64_t len = s.length;
    for (const StepRequest& r : requests) {
      if (r.seq == id) len += static_cast<int64_t>(r.tokens.size());
    }
    lens.push_back(len);
  }
  return rebalance_for(lens);
}

Status Engine::rebalance_for(const std::vector<int64_t>& seq_lens) {
  SPX_ASSIGN_OR_RETURN(PlacementDecision d, options_.tiering.policy->decide(placement_input(seq_lens)));
  if (!d.changed || d.placement == memory_->placement_) return Status::ok();
  return apply_placement(d.placement, d.reasons);
}

Status Engine::apply_placement(const KvPlacement& target, const std::vector<std::string>& reasons) {
  const int64_t n_layers = kv_->n_layers();
  if (static_cast<int64_t>(target.layer_home.size()) != n_layers) {
    return invalid_argument("placement names " + std::to_string(target.layer_home.size()) + " layers, the model has " +
                            std::to_string(n_layers));
  }
  for (TierId t : target.layer_home) {
    if (!t.valid() || t.value() >= kv_->n_tiers()) return invalid_argument("placement names tier " + std::to_string(t.value()) + ", which does not exist");
    if (is_abandoned(t)) {
      return invalid_argument("placement names tier " + std::to_string(t.value()) + ", which was lost (" +
                              lost_tier_error(t) + ")");
    }
  }
  const TierId head_home = target.head_cache_home;
  if (!head_home.valid() || head_home.value() >= kv_->n_tiers() || !memory_->backend_reads(head_home)) {
    return invalid_argument("placement puts the retrieval head's keys on tier " + std::to_string(head_home.value()) +
                            ", which the backend cannot read");
  }
  CopyQueue* copies = options_.tiering.copies.get();
  const TierId device(0);
  PlacementEvent ev;
  ev.forward = forwards_;
  for (const auto& [id, s] : memory_->sequences_) ev.seq_lens.push_back(s.length);
  ev.reasons = reasons;
  ev.cpu_filtering = target.cpu_filtering;
  const Clock::time_point start = Clock::now();
  // Layers leaving the device first (they free room), then moves between other tiers, then
  // layers coming back.
  std::vector<int64_t> order;
  for (int pass = 0; pass < 3; ++pass) {
    for (int64_t l = 0; l < n_layers; ++l) {
      const TierId from = kv_->home(LayerId(static_cast<int32_t>(l)));
      const TierId to = target.layer_home[static_cast<size_t>(l)];
      if (from == to) continue;
      const int p = from == device ? 0 : to == device ? 2 : 1;
      if (p == pass) order.push_back(l);
    }
  }
  Status result;
  if (!order.empty() && copies != nullptr) {
    // The copy queue moves pages on the transport's own stream (or thread), which does not wait
    // for the backend's queue: ops still enqueued there (a step's KV append, fill_synthetic's
    // copies) could write a page while it moves, or a page freed by a move could be rewritten
    // before they read it. So the backend drains first; migrations are rare and block anyway.
    result = backend_->synchronize();
    if (!result.is_ok()) result = result.with_context("waiting for the backend before moving layers");
  }
  for (int64_t l : order) {
    if (!result.is_ok()) break;
    const LayerId layer(static_cast<int32_t>(l));
    const TierId from = kv_->home(layer), to = target.layer_home[static_cast<size_t>(l)];
    if (copies == nullptr) {
      result = invalid_argument("moving layer " + std::to_string(l) + " needs a copy queue (no tiers configured)");
      break;
    }
    auto moves = kv_->begin_move(layer, to);
    if (!moves.is_ok()) {
      result = moves.status();
      break;
    }
    uint64_t bytes = 0;
    for (const TransferRequest& r : *moves) bytes += r.bytes;
    Status st;
    if (!moves->empty()) {
      auto ticket = copies->submit(layer, CopyDirection::kMigrate, std::move(*moves));
      st = ticket.is_ok() ? copies->wait(*ticket) : ticket.status();
    }
    if (!st.is_ok()) {
      kv_->abort_move(layer);
      result = st.with_context("moving layer " + std::to_string(l) + " from " +
                               kv_->tiers()[static_cast<size_t>(from.value())].desc.name + " to " +
                               kv_->tiers()[static_cast<size_t>(to.value())].desc.name);
      break;
    }
    SPX_RETURN_IF_ERROR(kv_->commit_move(layer));
    memory_->placement_.layer_home[static_cast<size_t>(l)] = to;
    ++ev.layers_moved;
    ev.bytes_moved += bytes;
    total_traffic_[static_cast<size_t>(from.value())].bytes_out += bytes;
    total_traffic_[static_cast<size_t>(to.value())].bytes_in += bytes;
  }
  if (result.is_ok() && head_home != memory_->placement_.head_cache_home)
    result = move_head_caches(head_home);
  if (result.is_ok()) {
    if (memory_->placement_.cpu_filtering && !target.cpu_filtering && options_.tiering.candidate_filter) {
      for (auto& [id, s] : memory_->sequences_) {
        options_.tiering.candidate_filter->drop(id);
        s.filter_tokens = 0;
      }
    }
    memory_->placement_.cpu_filtering = target.cpu_filtering;
  }
  ev.seconds = seconds_since(start);
  if (!result.is_ok()) ev.error = result.to_string();
  events_.push_back(std::move(ev));
  return result;
}

std::vector<TierId> Engine::lost_tiers() const {
  std::vector<TierId> lost;
  if (options_.tiering.transport == nullptr) return lost;
  for (const TierMemory& t : kv_->tiers()) {
    const TierId id = t.desc.id;
    if (t.desc.kind != TierKind::kRemote) continue;
    if (is_abandoned(id)) continue;
    if (options_.tiering.transport->tier_lost(id)) lost.push_back(id);
  }
  return lost;
}

std::string Engine::lost_tier_error(TierId tier) const {
  for (size_t i = 0; i < abandoned_.size(); ++i) {
    if (abandoned_[i] != tier) continue;
    return "tier " + kv_->tiers()[static_cast<size_t>(tier.value())].desc.name + " was lost: " + abandoned_why_[i];
  }
  return {};
}

Status Engine::with_lost_tiers(Status refusal) const {
  if (refusal.code() != StatusCode::kResourceExhausted || abandoned_.empty()) return refusal;
  std::string lost;
  for (TierId t : abandoned_) lost += (lost.empty() ? "" : "; ") + lost_tier_error(t);
  return resource_exhausted(refusal.message() + " (" + lost + ")");
}

Status Engine::abandon_tier(TierId tier) {
  const std::string what = "abandon_tier " + std::to_string(tier.value());
  if (!tier.valid() || tier.value() >= kv_->n_tiers()) return invalid_argument(what + ": no such tier");
  const TierMemory& t = kv_->tiers()[static_cast<size_t>(tier.value())];
  if (t.desc.kind != TierKind::kRemote) return invalid_argument(what + ": " + t.desc.name + " is not remote");
  if (is_abandoned(tier)) {
    return invalid_argument(what + ": abandoned already");
  }
  if (kv_->used_pages() != 0) {
    return invalid_argument(what + ": " + std::to_string(kv_->used_pages()) +
                            " KV pages are in use; drop every sequence first");
  }
  // With no page in use no layer has chunks, so re-homing moves nothing from the lost memory.
  int64_t rehomed = 0;
  for (int64_t l = 0; l < kv_->n_layers(); ++l) {
    const LayerId layer(static_cast<int32_t>(l));
    if (kv_->home(layer) != tier) continue;
    SPX_ASSIGN_OR_RETURN(std::vector<TransferRequest> moves, kv_->begin_move(layer, TierId(0)));
    if (!moves.empty()) {
      kv_->abort_move(layer);
      return internal_error(what + ": layer " + std::to_string(l) + " holds chunks with no page in use");
    }
    SPX_RETURN_IF_ERROR(kv_->commit_move(layer));
    memory_->placement_.layer_home[static_cast<size_t>(l)] = TierId(0);
    ++rehomed;
  }
  std::string why = options_.tiering.transport ? options_.tiering.transport->tier_loss(tier) : std::string();
  if (why.empty()) why = "the transport reports its memory gone";
  abandoned_.push_back(tier);
  abandoned_why_.push_back(why);
  PlacementEvent ev;
  ev.forward = forwards_;
  ev.cpu_filtering = memory_->placement_.cpu_filtering;
  ev.reasons.push_back("tier " + t.desc.name + " lost (" + why + "): its layers come back to the device");
  ev.layers_moved = rehomed;
  events_.push_back(std::move(ev));
  return Status::ok();
}

Status Engine::move_head_caches(TierId to) {
  // The backend reads both tiers (checked by apply_placement), so blocks move with copy_rows.
  const uint64_t bytes = memory_->head_block_bytes();
  for (auto& [id, s] : memory_->sequences_) {
    if (s.head_blocks.empty() || s.head_tier == to) continue;
    std::vector<uint64_t> moved;
    Status st;
    for (uint64_t off : s.head_blocks) {
      auto dst = kv_->allocate(to, bytes);
      if (!dst.is_ok()) { st = dst.status(); break; }
      moved.push_back(*dst);
      st = backend_->copy_rows(kv_->address(to, *dst), bytes, kv_->address(s.head_tier, off), bytes, bytes, 1);
      if (!st.is_ok()) break;
    }
    if (st.is_ok()) st = backend_->synchronize();
    if (!st.is_ok()) {
      for (uint64_t off : moved) (void)kv_->release(to, off);
      return st.with_context("moving the retrieval head's keys");
    }
    const uint64_t total = bytes * s.head_blocks.size();
    total_traffic_[static_cast<size_t>(s.head_tier.value())].bytes_out += total;
    total_traffic_[static_cast<size_t>(to.value())].bytes_in += total;
    memory_->release_head_cache(s);
    s.head_blocks = std::move(moved);
    s.head_tier = to;
  }
  memory_->placement_.head_cache_home = to;
  return Status::ok();
}

std::vector<TierReport> Engine::tier_report() const {
  std::vector<TierReport> out;
  for (const TierMemory& t : kv_->tiers()) {
    TierReport r;
    r.desc = t.desc;
    r.used_bytes = kv_->tier_used_bytes(t.desc.id);
    r.peak_used_bytes = std::max(r.used_bytes, peak_used_[static_cast<size_t>(t.desc.id.value())]);
    for (int64_t l = 0; l < kv_->n_layers(); ++l) {
      const LayerId layer(static_cast<int32_t>(l));
      if (kv_->home(layer) != t.desc.id) continue;
      ++r.layers;
      r.kv_bytes += kv_->layer_bytes(layer);
    }
    r.last_step = step_traffic_[static_cast<size_t>(t.desc.id.value())];
    r.total = total_traffic_[static_cast<size_t>(t.desc.id.value())];
    out.push_back(std::move(r));
  }
  return out;
}

Status Engine::fill_synthetic(SeqId seq, int64_t n_tokens, uint64_t seed) {
  auto it = memory_->sequences_.find(seq);
  if (it == memory_->sequences_.end()) return invalid_argument("fill_synthetic: unknown sequence");
  Sequence& s = it->second;
  if (s.length != 0) return invalid_argument("fill_synthetic: sequence is not empty");
  if (n_tokens <= 0 || n_tokens > max_context_) {
    return out_of_range("fill_synthetic: " + std::to_string(n_tokens) + " tokens outside (0, " +
                        std::to_string(max_context_) + "]");
  }
  if (options_.tiering.policy) {
    // The placement for the length the fill reaches, as a step of that many tokens would get:
    // layers leave the device first, or a fill longer than the device holds fails.
    std::vector<int64_t> lens;
    for (const auto& [id, other] : memory_->sequences_) lens.push_back(id == seq ? n_tokens : other.length);
    SPX_RETURN_IF_ERROR_CTX(rebalance_for(lens), "fill_synthetic");
  }
  std::vector<PageId> fresh;
  Status st = memory_->reserve_pages(s, n_tokens, fresh);
  if (!st.is_ok()) {
    for (PageId p : fresh) kv_->free_page(p);
    s.pages.clear();
    return st;
  }
  const ModelConfig& c = config();
  const int64_t layers = kv_->n_layers();
  const int64_t pf = kv_->page_elements();
  // Page contents come from a pool of random pages (K block then V block, as in a page slot):
  // page p of layer l holds pool page (131·l + p) mod kPoolPages. Filling then costs copies, not
  // random numbers: on a GPU one upload and device-to-device copies instead of gigabytes of
  // host-generated uploads.
  constexpr int64_t kPoolPages = 64;
  // `pool` holds the values as f32 after rounding to the cache's dtype (what Quest's bounds see),
  // `pool_elems` the same values as stored.
  const DType kvt = kv_->dtype();
  std::vector<float> pool(static_cast<size_t>(kPoolPages * 2 * pf));
  std::vector<unsigned char> pool_elems(pool.size() * dtype_size(kvt));
  {
    SyntheticValues r{seed * 0x9E3779B97F4A7C15ull + 1};
    for (float& x : pool) x = r.next();
    convert_from_f32(kvt, pool.data(), pool_elems.data(), pool.size());
    convert_to_f32(kvt, pool_elems.data(), pool.data(), pool.size());
  }
  const size_t page_bytes = kv_->page_bytes();
  auto pool_index = [&](int64_t l, size_t p) { return ((131 * l + static_cast<int64_t>(p)) % kPoolPages) * 2 * pf; };
  auto pool_page = [&](int64_t l, size_t p) { return pool.data() + pool_index(l, p); };
  auto pool_page_elems = [&](int64_t l, size_t p) { return element_at(pool_elems.data(), kvt, pool_index(l, p)); };
  const void* pool_dev = nullptr;
  if (backend_->memory_kind() != MemoryKind::kHost) {
    auto dev = fit(fill_pool_, pool_elems.size());
    st = dev.is_ok() ? backend_->upload(*dev, pool_elems.data(), pool_elems.size()) : dev.status();
    if (st.is_ok()) pool_dev = *dev;
  }
  for (int64_t l = 0; l < layers && st.is_ok(); ++l) {
    const LayerId layer(static_cast<int32_t>(l));
    const TierId home = kv_->home(layer);
    for (size_t p = 0; p < s.pages.size() && st.is_ok(); ++p) {
      const PageLocation loc = kv_->locate(layer, s.pages[p]);
      if (home == TierId(0) && pool_dev != nullptr) {
        const void* src = element_at(pool_dev, kvt, pool_index(l, p));
        st = backend_->copy_rows(kv_->address(loc.tier, loc.offset), page_bytes, src, page_bytes, page_bytes, 1);
      } else if (memory_->host_visible(home) &&
                 (home != TierId(0) || backend_->memory_kind() == MemoryKind::kHost)) {
        std::memcpy(kv_->address(loc.tier, loc.offset), pool_page_elems(l, p), page_bytes);
      } else {
        st = memory_->write_block(loc.tier, loc.offset, pool_page_elems(l, p), page_bytes);
      }
    }
  }
  // Sparse methods keep state derived from the cache: the head's keys, the fused features of
  // the last position, Quest's page bounds.
  if (st.is_ok() && options_.sparse.method == SparseMethod::kSpeContext) {
    const auto& hc = options_.retrieval_head->config;
    SyntheticValues r{seed * 0xD1B54A32D192ED03ull + 7};
    st = memory_->ensure_head_capacity(s, n_tokens);
    std::vector<float> keys(static_cast<size_t>(memory_->head_block_tokens_ * hc.n_kv_heads * hc.head_dim));
    std::vector<std::byte> stored(memory_->head_block_bytes());  // the keys in the KV dtype
    for (size_t b = 0; b < s.head_blocks.size() && st.is_ok(); ++b) {
      for (auto& x : keys) x = r.next();
      convert_from_f32(options_.kv_dtype, keys.data(), stored.data(), keys.size());
      st = memory_->write_block(s.head_tier, s.head_blocks[b], stored.data(), stored.size());
    }
    if (st.is_ok()) {
      std::vector<float> fused(static_cast<size_t>(3 * c.dim));
      for (auto& x : fused) x = r.next();
      auto mem = backend_->allocate(fused.size() * sizeof(float));
      st = mem.is_ok() ? backend_->upload(mem->get(), fused.data(), fused.size() * sizeof(float)) : mem.status();
      if (st.is_ok()) s.last_fused = *mem;
    }
  } else if (st.is_ok() && options_.sparse.method == SparseMethod::kQuest) {
    std::vector<float> block(static_cast<size_t>(2 * pf)), rows(static_cast<size_t>(c.kv_dim()));
    const int64_t ps = kv_->page_size();
    for (int64_t l = 0; l < layers && st.is_ok(); ++l) {
      const LayerId layer(static_cast<int32_t>(l));
      for (size_t p = 0; p < s.pages.size() && st.is_ok(); ++p) {
        std::copy_n(pool_page(l, p), 2 * pf, block.data());  // the values written above
        for (int64_t slot = 0; slot < ps && st.is_ok(); ++slot) {
          const int64_t t = static_cast<int64_t>(p) * ps + slot;
          if (t >= n_tokens) break;
          for (int64_t h = 0; h < c.n_kv_heads; ++h) {
            std::copy_n(block.data() + (h * ps + slot) * c.head_dim, c.head_dim, rows.data() + h * c.head_dim);
          }
          st = update_quest_bounds(s, layer, rows.data(), t, 1);
        }
      }
    }
  }
  if (!st.is_ok()) {
    for (PageId p : s.pages) kv_->free_page(p);
    s.pages.clear();
    memory_->drop_sparse_state(s);
    memory_->release_head_cache(s);
    return st;
  }
  s.length = n_tokens;
  return Status::ok();
}

}  // namespace specontext
