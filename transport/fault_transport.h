// FaultInjectingTransport: wraps any Transport and injects, from a seeded policy, failures,
// NO_RESOURCE back-pressure, added completion delay, and "fail after N posts". The same seed and
// the same call sequence give the same faults, so a failing test reproduces.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>

#include "core/ports/transport.h"

namespace specontext::transport {

struct FaultPolicy {
  uint64_t seed = 1;
  // Probability that a post is accepted but the transfer then fails (poll returns kUnavailable,
  // the code of a transient fabric error). The inner transport is not posted.
  double failure_rate = 0.0;
  // Probability that a post returns kResourceExhausted (NO_RESOURCE); the handle stays prepared.
  double no_resource_rate = 0.0;
  // Completion is reported no earlier than this long after the post.
  std::chrono::microseconds added_delay{0};
  // When >= 0, every post after the first `fail_after_posts` fails with kUnavailable.
  int64_t fail_after_posts = -1;
  // When valid, faults hit only batches that read or write this tier (one failing node or pool
  // while the others stay healthy); other batches pass through untouched and draw nothing.
  TierId target_tier;
  // With fail_after_posts and target_tier: the failures model a node that died for good, so
  // tier_lost(target_tier) is true from the first failed post on.
  bool permanent = false;
};

class FaultInjectingTransport final : public Transport {
 public:
  static Result<std::unique_ptr<FaultInjectingTransport>> create(std::unique_ptr<Transport> inner,
                                                                 FaultPolicy policy);
  FaultInjectingTransport(const FaultInjectingTransport&) = delete;
  FaultInjectingTransport& operator=(const FaultInjectingTransport&) = delete;
  ~FaultInjectingTransport() override;

  std::string_view name() const override { return "fault"; }
  Capabilities capabilities() const override { return inner_->capabilities(); }
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;
  bool tier_lost(TierId tier) const override;
  std::string tier_loss(TierId tier) const override;

  Transport& inner() { return *inner_; }
  int64_t posts() const;             // posts seen (including rejected ones)
  int64_t injected_failures() const;  // failures and fail-after-N rejections
  int64_t injected_no_resource() const;

 private:
  FaultInjectingTransport(std::unique_ptr<Transport> inner, FaultPolicy policy);
  struct Op {
    TransferHandle inner;
    bool posted = false;
    bool targeted = true;  // faults apply to this transfer
    Status injected;  // not OK when this transfer was chosen to fail
    std::chrono::steady_clock::time_point ready_at;
  };

  std::unique_ptr<Transport> inner_;
  const FaultPolicy policy_;
  mutable std::mutex mu_;  // guards everything below; never held across an inner call
  std::mt19937_64 rng_;
  std::unordered_map<uint64_t, Op> ops_;
  uint64_t next_id_ = 1;
  int64_t posts_ = 0;
  int64_t injected_failures_ = 0;
  int64_t injected_no_resource_ = 0;
  bool lost_ = false;  // permanent: the target tier failed a post
};

}  // namespace specontext::transport
