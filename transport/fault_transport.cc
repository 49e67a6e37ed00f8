#include "transport/fault_transport.h"

#include <string>
#include <vector>

namespace specontext::transport {

Result<std::unique_ptr<FaultInjectingTransport>> FaultInjectingTransport::create(
    std::unique_ptr<Transport> inner, FaultPolicy policy) {
  if (!inner) return invalid_argument("fault: null inner transport");
  auto rate_ok = [](double r) { return r >= 0.0 && r <= 1.0; };
  if (!rate_ok(policy.failure_rate) || !rate_ok(policy.no_resource_rate)) {
    return invalid_argument("fault: rates must be in [0, 1]");
  }
  if (policy.added_delay.count() < 0) return invalid_argument("fault: negative added_delay");
  if (policy.permanent && (policy.fail_after_posts < 0 || !policy.target_tier.valid())) {
    return invalid_argument("fault: permanent needs fail_after_posts and target_tier");
  }
  return std::unique_ptr<FaultInjectingTransport>(
      new FaultInjectingTransport(std::move(inner), policy));
}

FaultInjectingTransport::FaultInjectingTransport(std::unique_ptr<Transport> inner,
                                                 FaultPolicy policy)
    : inner_(std::move(inner)), policy_(policy), rng_(policy.seed) {}

FaultInjectingTransport::~FaultInjectingTransport() {
  // Release inner handles before the inner transport goes (it would release them too; this keeps
  // the order explicit).
  for (auto& [id, op] : ops_) inner_->release(op.inner);
}

Status FaultInjectingTransport::register_tier(TierId tier, MemoryKind kind, void* base,
                                              uint64_t bytes) {
  return inner_->register_tier(tier, kind, base, bytes);
}

Result<TransferHandle> FaultInjectingTransport::prepare(const TransferBatch& batch) {
  SPX_ASSIGN_OR_RETURN(TransferHandle inner, inner_->prepare(batch));
  bool targeted = !policy_.target_tier.valid();
  for (const TransferRequest& r : batch) {
    if (r.src_tier == policy_.target_tier || r.dst_tier == policy_.target_tier) targeted = true;
  }
  std::lock_guard lock(mu_);
  const uint64_t id = next_id_++;
  ops_.emplace(id, Op{inner, false, targeted, Status::ok(), {}});
  return make_handle(id);
}

Status FaultInjectingTransport::post(TransferHandle& handle) {
  TransferHandle inner;
  bool delayed = false;
  {
    std::lock_guard lock(mu_);
    auto it = handle.valid() && handle.owner() == this ? ops_.find(handle.id()) : ops_.end();
    if (it == ops_.end()) return invalid_argument("fault: post of an unknown or released handle");
    Op& op = it->second;
    if (op.posted) return invalid_argument("fault: transfer posted twice");
    const int64_t n = ++posts_;
    if (op.targeted) {
      if (policy_.fail_after_posts >= 0 && n > policy_.fail_after_posts) {
        ++injected_failures_;
        lost_ = policy_.permanent;
        return unavailable("fault: injected failure of post " + std::to_string(n) +
                           " (fail after " + std::to_string(policy_.fail_after_posts) + " posts)");
      }
      std::uniform_real_distribution<double> u(0.0, 1.0);
      // Both draws happen on every targeted post so the fault sequence depends only on the seed
      // and the number of posts.
      const double no_resource_draw = u(rng_);
      const double failure_draw = u(rng_);
      if (no_resource_draw < policy_.no_resource_rate) {
        ++injected_no_resource_;
        return resource_exhausted("fault: injected NO_RESOURCE on post " + std::to_string(n));
      }
      op.ready_at = std::chrono::steady_clock::now() + policy_.added_delay;
      delayed = policy_.added_delay.count() > 0;
      if (failure_draw < policy_.failure_rate) {
        ++injected_failures_;
        op.posted = true;
        op.injected = unavailable("fault: injected transfer failure (seed " +
                                  std::to_string(policy_.seed) + ", post " + std::to_string(n) +
                                  ")");
        return in_progress();
      }
    }
    op.posted = true;
    inner = op.inner;
  }
  Status s = inner_->post(inner);
  if (s.code() == StatusCode::kResourceExhausted) {
    std::lock_guard lock(mu_);
    auto it = ops_.find(handle.id());
    if (it != ops_.end()) it->second.posted = false;  // still prepared: may be posted again
    return s;
  }
  if (s.is_ok() && delayed) return in_progress();
  return s;
}

Status FaultInjectingTransport::poll(TransferHandle& handle) {
  TransferHandle inner;
  {
    std::lock_guard lock(mu_);
    auto it = handle.valid() && handle.owner() == this ? ops_.find(handle.id()) : ops_.end();
    if (it == ops_.end()) return invalid_argument("fault: poll of an unknown or released handle");
    Op& op = it->second;
    if (!op.posted) return invalid_argument("fault: poll of a transfer not posted");
    if (std::chrono::steady_clock::now() < op.ready_at) return in_progress();
    if (!op.injected.is_ok()) return op.injected;
    inner = op.inner;
  }
  return inner_->poll(inner);
}

void FaultInjectingTransport::release(TransferHandle& handle) {
  TransferHandle inner;
  {
    std::lock_guard lock(mu_);
    if (handle.valid() && handle.owner() == this) {
      auto it = ops_.find(handle.id());
      if (it != ops_.end()) {
        inner = it->second.inner;
        ops_.erase(it);
      }
    }
  }
  inner_->release(inner);
  reset_handle(handle);
}

int64_t FaultInjectingTransport::posts() const {
  std::lock_guard lock(mu_);
  return posts_;
}
int64_t FaultInjectingTransport::injected_failures() const {
  std::lock_guard lock(mu_);
  return injected_failures_;
}
int64_t FaultInjectingTransport::injected_no_resource() const {
  std::lock_guard lock(mu_);
  return injected_no_resource_;
}

std::string FaultInjectingTransport::tier_loss(TierId tier) const {
  {
    std::lock_guard lock(mu_);
    if (lost_ && tier == policy_.target_tier) {
      return "fault injection: the node of tier " + std::to_string(tier.value()) + " died for good after " +
             std::to_string(policy_.fail_after_posts) + " posts";
    }
  }
  return inner_->tier_loss(tier);
}

bool FaultInjectingTransport::tier_lost(TierId tier) const {
  {
    std::lock_guard lock(mu_);
    if (lost_ && tier == policy_.target_tier) return true;
  }
  return inner_->tier_lost(tier);
}

}  // namespace specontext::transport
