// LoopbackRemoteTransport: an in-process fake of a remote KV node. A kRemote tier is memory owned
// by the transport (standing in for the peer's memory); transfers between it and host tiers run
// asynchronously on one worker thread, which models a serial link: transfers are served in post
// order, each after `latency` plus its copy time. It exists so that everything above the transport
// (copy engine, engine, cluster logic) is testable without a network.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"
#include "transport/tier_table.h"

namespace specontext::transport {

struct LoopbackConfig {
  // Added before each transfer is served (models one round trip of the link).
  std::chrono::microseconds latency{0};
};

class LoopbackRemoteTransport final : public Transport {
 public:
  static Result<std::unique_ptr<LoopbackRemoteTransport>> create(LoopbackConfig config = {});
  ~LoopbackRemoteTransport() override;
  // Non-movable: the worker thread captures `this`.
  LoopbackRemoteTransport(const LoopbackRemoteTransport&) = delete;
  LoopbackRemoteTransport& operator=(const LoopbackRemoteTransport&) = delete;

  std::string_view name() const override { return "loopback"; }
  Capabilities capabilities() const override;
  // kRemote: `base` must be null; the transport allocates `bytes` (zeroed) for the fake node.
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;

 private:
  explicit LoopbackRemoteTransport(LoopbackConfig config);
  enum class State { kPrepared, kQueued, kCopying, kDone };
  struct Op {
    std::vector<ResolvedCopy> copies;
    State state = State::kPrepared;
  };
  Op* find(const TransferHandle& handle);  // requires mu_
  void worker_loop();

  const LoopbackConfig config_;
  std::mutex mu_;  // guards everything below except worker_
  std::condition_variable cv_;  // queue changes, stop, and end of a copy (for release)
  TierTable tiers_;
  std::vector<std::unique_ptr<std::byte[]>> remote_memory_;
  std::unordered_map<uint64_t, Op> ops_;
  std::deque<uint64_t> queue_;  // posted op ids, in post order
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread worker_;  // started last in the constructor, joined in the destructor
};

}  // namespace specontext::transport
