#include "transport/transport_router.h"

#include <algorithm>
#include <string>

namespace specontext::transport {

namespace {

constexpr MemoryKind kKinds[] = {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice,
                                 MemoryKind::kRemote};

Capabilities union_of(const std::vector<Transport*>& members) {
  Capabilities caps;
  for (const Transport* m : members) {
    const Capabilities c = m->capabilities();
    for (MemoryKind s : kKinds) {
      for (MemoryKind d : kKinds) {
        if (c.supports(s, d)) caps.add(s, d);
      }
    }
    caps.remote = caps.remote || c.remote;
  }
  return caps;
}

std::string tier_kind_text(TierId tier, MemoryKind kind) {
  return "tier " + std::to_string(tier.value()) + " (" + std::string(memory_kind_name(kind)) + ")";
}

}  // namespace

Result<std::unique_ptr<TransportRouter>> TransportRouter::create(std::vector<Transport*> members) {
  if (members.empty()) return invalid_argument("router: no member transports");
  if (members.size() > kMaxMembers) {
    return invalid_argument("router: " + std::to_string(members.size()) + " members; at most " +
                            std::to_string(kMaxMembers));
  }
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == nullptr) {
      return invalid_argument("router: member " + std::to_string(i) + " is null");
    }
    for (size_t j = 0; j < i; ++j) {
      if (members[j] == members[i]) {
        return invalid_argument("router: member " + std::to_string(i) + " (" +
                                std::string(members[i]->name()) + ") is listed twice");
      }
    }
  }
  return std::unique_ptr<TransportRouter>(new TransportRouter(std::move(members)));
}

TransportRouter::TransportRouter(std::vector<Transport*> members)
    : members_(std::move(members)), capabilities_(union_of(members_)) {
  member_caps_.reserve(members_.size());
  for (const Transport* m : members_) member_caps_.push_back(m->capabilities());
}

TransportRouter::~TransportRouter() {
  for (auto& [id, op] : ops_) {
    for (Sub& sub : op.subs) members_[sub.member]->release(sub.handle);
  }
}

Status TransportRouter::register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) {
  const std::string who = "router: register tier " + std::to_string(tier.value());
  if (!tier.valid()) return invalid_argument(who + ": invalid tier id");
  if (kind != MemoryKind::kRemote && base == nullptr) return invalid_argument(who + ": null base");
  if (bytes == 0) return invalid_argument(who + ": zero size");
  {
    std::lock_guard lock(mu_);
    if (tiers_.contains(tier)) return invalid_argument(who + ": already registered");
  }
  uint32_t accepted = 0;
  for (size_t m = 0; m < members_.size(); ++m) {
    Status s = members_[m]->register_tier(tier, kind, base, bytes);
    if (s.is_ok()) {
      accepted |= 1u << m;
    } else if (s.code() != StatusCode::kUnimplemented) {
      return s.with_context(who + " on member " + std::to_string(m) + " (" +
                            std::string(members_[m]->name()) + ")");
    }
  }
  if (accepted == 0) {
    return unimplemented(who + ": no member transport accepts memory kind " +
                         std::string(memory_kind_name(kind)));
  }
  std::lock_guard lock(mu_);
  tiers_.emplace(tier, RoutedTier{TierInfo{kind, static_cast<std::byte*>(base), bytes}, accepted});
  return Status::ok();
}

Result<size_t> TransportRouter::route_locked(const TransferRequest& r, size_t index) const {
  const std::string where = "router: request " + std::to_string(index);
  auto src = tiers_.find(r.src_tier);
  if (src == tiers_.end()) {
    return invalid_argument(where + ": src tier " + std::to_string(r.src_tier.value()) +
                            " is not registered");
  }
  auto dst = tiers_.find(r.dst_tier);
  if (dst == tiers_.end()) {
    return invalid_argument(where + ": dst tier " + std::to_string(r.dst_tier.value()) +
                            " is not registered");
  }
  const MemoryKind sk = src->second.info.kind;
  const MemoryKind dk = dst->second.info.kind;
  const uint32_t both = src->second.members & dst->second.members;
  for (size_t m = 0; m < members_.size(); ++m) {
    if ((both >> m & 1u) != 0 && member_caps_[m].supports(sk, dk)) {
      SPX_RETURN_IF_ERROR(check_request_ranges(r, src->second.info, dst->second.info, where));
      return m;
    }
  }
  return invalid_argument(where + ": no member transport serves " +
                          tier_kind_text(r.src_tier, sk) + " -> " +
                          tier_kind_text(r.dst_tier, dk));
}

Result<size_t> TransportRouter::route(const TransferRequest& request) const {
  std::lock_guard lock(mu_);
  return route_locked(request, 0);
}

Result<TransferHandle> TransportRouter::prepare(const TransferBatch& batch) {
  std::vector<TransferBatch> per_member(members_.size());
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < batch.size(); ++i) {
      SPX_ASSIGN_OR_RETURN(const size_t m, route_locked(batch[i], i));
      per_member[m].push_back(batch[i]);
    }
  }
  Op op;
  for (size_t m = 0; m < members_.size(); ++m) {
    if (per_member[m].empty()) continue;
    Result<TransferHandle> h = members_[m]->prepare(per_member[m]);
    if (!h.is_ok()) {
      for (Sub& sub : op.subs) members_[sub.member]->release(sub.handle);
      // The router checked tiers, kinds and ranges already; this is the member's own reason.
      return h.status().with_context("router: member " + std::to_string(m) + " (" +
                                     std::string(members_[m]->name()) + "), sub-batch of " +
                                     std::to_string(per_member[m].size()) + " requests");
    }
    op.subs.push_back(Sub{m, *h, SubState::kPrepared});
  }
  std::lock_guard lock(mu_);
  const uint64_t id = next_id_++;
  ops_.emplace(id, std::move(op));
  return make_handle(id);
}

TransportRouter::Op* TransportRouter::find(const TransferHandle& handle) {
  if (!handle.valid() || handle.owner() != this) return nullptr;
  auto it = ops_.find(handle.id());
  return it == ops_.end() ? nullptr : &it->second;
}

Status TransportRouter::fail(Op& op, const Sub& failed, const Status& error) {
  const std::string who = "router: member " + std::to_string(failed.member) + " (" +
                          std::string(members_[failed.member]->name()) + ")";
  // Terminal: cancel the other parts now rather than let them run for nothing.
  for (Sub& sub : op.subs) members_[sub.member]->release(sub.handle);
  op.state = OpState::kFailed;
  op.error = error.with_context(who);
  return op.error;
}

Status TransportRouter::post(TransferHandle& handle) {
  Op* op = nullptr;
  {
    std::lock_guard lock(mu_);
    op = find(handle);
    if (op == nullptr) return invalid_argument("router: post of an unknown or released handle");
    if (op->state != OpState::kPrepared) return invalid_argument("router: transfer posted twice");
  }
  // The op's node is stable and only this handle's user touches it, so no lock from here on.
  bool started = false;
  bool waiting = false;
  bool all_done = true;
  Status no_resource;
  for (Sub& sub : op->subs) {
    Status s = members_[sub.member]->post(sub.handle);
    if (s.is_ok()) {
      sub.state = SubState::kDone;
      started = true;
    } else if (s.code() == StatusCode::kInProgress) {
      sub.state = SubState::kRunning;
      started = true;
      all_done = false;
    } else if (s.code() == StatusCode::kResourceExhausted) {
      sub.state = SubState::kWaiting;
      waiting = true;
      all_done = false;
      if (no_resource.is_ok()) no_resource = std::move(s);
    } else {
      return fail(*op, sub, s);
    }
  }
  if (waiting && !started) {
    // Nothing started: still prepared, as the contract for NO_RESOURCE requires.
    for (Sub& sub : op->subs) sub.state = SubState::kPrepared;
    return no_resource.with_context("router: every member answered NO_RESOURCE");
  }
  if (waiting) {
    std::lock_guard lock(mu_);
    ++partial_no_resource_;
  }
  op->state = all_done ? OpState::kDone : OpState::kRunning;
  if (all_done) return Status::ok();
  return in_progress(waiting ? "router: started; some parts wait for resources and are re-posted "
                               "on poll"
                             : "in progress");
}

Status TransportRouter::poll(TransferHandle& handle) {
  Op* op = nullptr;
  {
    std::lock_guard lock(mu_);
    op = find(handle);
    if (op == nullptr) return invalid_argument("router: poll of an unknown or released handle");
  }
  switch (op->state) {
    case OpState::kPrepared: return invalid_argument("router: poll of a transfer not posted");
    case OpState::kFailed: return op->error;
    case OpState::kDone: return Status::ok();
    case OpState::kRunning: break;
  }
  bool all_done = true;
  for (Sub& sub : op->subs) {
    switch (sub.state) {
      case SubState::kDone: continue;
      case SubState::kPrepared:  // not reached once running; treated as waiting
      case SubState::kWaiting: {
        Status s = members_[sub.member]->post(sub.handle);
        if (s.is_ok()) {
          sub.state = SubState::kDone;
        } else if (s.code() == StatusCode::kInProgress) {
          sub.state = SubState::kRunning;
        } else if (s.code() != StatusCode::kResourceExhausted) {
          return fail(*op, sub, s);
        }
        break;
      }
      case SubState::kRunning: {
        Status s = members_[sub.member]->poll(sub.handle);
        if (s.is_ok()) {
          sub.state = SubState::kDone;
        } else if (s.code() != StatusCode::kInProgress) {
          return fail(*op, sub, s);
        }
        break;
      }
    }
    if (sub.state != SubState::kDone) all_done = false;
  }
  if (!all_done) return in_progress();
  op->state = OpState::kDone;
  return Status::ok();
}

void TransportRouter::release(TransferHandle& handle) {
  Op op;
  bool found = false;
  {
    std::lock_guard lock(mu_);
    if (handle.valid() && handle.owner() == this) {
      auto it = ops_.find(handle.id());
      if (it != ops_.end()) {
        op = std::move(it->second);
        ops_.erase(it);
        found = true;
      }
    }
  }
  if (found) {
    for (Sub& sub : op.subs) members_[sub.member]->release(sub.handle);
  }
  reset_handle(handle);
}

int64_t TransportRouter::partial_no_resource() const {
  std::lock_guard lock(mu_);
  return partial_no_resource_;
}

std::string TransportRouter::tier_loss(TierId tier) const {
  for (const Transport* m : members_) {
    std::string why = m->tier_loss(tier);
    if (!why.empty()) return why;
  }
  return {};
}

bool TransportRouter::tier_lost(TierId tier) const {
  for (const Transport* m : members_) {
    if (m->tier_lost(tier)) return true;
  }
  return false;
}

}  // namespace specontext::transport
