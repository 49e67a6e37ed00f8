// TransportRouter: one Transport over several member transports in preference order (the
// selector of STYLE.md §8.1: walk the list, take the first that supports the request). The
// engine's copy engine drives one transport; the router lets one batch mix host↔host copies
// (LocalTransport), host↔remote transfers (loopback, later UCX) and, later, device copies.
//
// Routing rules:
//   - capabilities() is the union of the members' (remote when any member is remote).
//   - register_tier registers the tier on every member that accepts its memory kind; members
//     answering kUnimplemented are skipped; kUnimplemented when none accepts it. The router
//     checks the id (valid, not yet registered), base and size itself first, so a member fails
//     only for its own reasons; if one does, its error is returned (with the member's name) and
//     the members that already accepted the tier keep it (tiers cannot be unregistered), while
//     the router does not know the tier. Caveat: a kRemote tier accepted by two loopback members
//     is two separate fake nodes; real remote transports resolve the same memory.
//   - prepare routes each request to the first member (in preference order) that supports its
//     (src kind, dst kind) pair and holds both tiers, then prepares one sub-transfer per member
//     (requests in batch order). Ranges are checked by the router before the split, so errors
//     name the caller's request index. A request that no member serves is kInvalidArgument
//     naming the request index and both tiers with their kinds; nothing is prepared then.
//
// Aggregation of one transfer's sub-transfers:
//   - post posts every sub-transfer in member order. All complete now: OK. All NO_RESOURCE:
//     kResourceExhausted (nothing started; the handle stays prepared and may be posted again,
//     as core/ports/transport.h requires). Some started and others got NO_RESOURCE: the transfer has
//     started, so post returns kInProgress and poll re-posts the waiting sub-transfers (each poll
//     tries each waiting one once; while any waits, poll reports kInProgress, so the caller's
//     timeout bounds endless back-pressure). Counted in partial_no_resource().
//   - poll: OK when every sub-transfer is complete, kInProgress while any runs or waits. The
//     first error of any sub-transfer (from post, re-post or poll) fails the whole transfer:
//     the other sub-transfers are released (cancelled) at once, and post/poll return that error
//     with the member's name in front; poll keeps returning it (idempotent once terminal).
//   - release releases every sub-transfer (each member cancels its part as core/ports/transport.h
//     says: parts not started are dropped, a part being copied finishes first), so when it
//     returns no member touches the transfer's buffers. Idempotent; destroying the router
//     releases everything still held.
//
// Threads: internally synchronized; one handle is used by one thread at a time. mu_ guards the
// tier table and the op map; it is never held across a member call (no lock nesting), so a
// synchronous member copy (LocalTransport::post) does not block other threads' prepares. The
// members must outlive the router and stay registered through it only.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"
#include "transport/tier_table.h"

namespace specontext::transport {

class TransportRouter final : public Transport {
 public:
  static constexpr size_t kMaxMembers = 32;
  // `members` in preference order; not owned; non-null, distinct, 1..kMaxMembers.
  static Result<std::unique_ptr<TransportRouter>> create(std::vector<Transport*> members);
  ~TransportRouter() override;
  TransportRouter(const TransportRouter&) = delete;
  TransportRouter& operator=(const TransportRouter&) = delete;

  std::string_view name() const override { return "router"; }
  Capabilities capabilities() const override { return capabilities_; }
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;
  bool tier_lost(TierId tier) const override;  // any member says so
  std::string tier_loss(TierId tier) const override;  // the first member that says why

  // Which member a request would go to (its index in the preference list), or the routing error
  // prepare would give for it. For tests and logs.
  Result<size_t> route(const TransferRequest& request) const;
  // Transfers whose post started some sub-transfers while others answered NO_RESOURCE.
  int64_t partial_no_resource() const;

 private:
  explicit TransportRouter(std::vector<Transport*> members);
  struct RoutedTier {
    TierInfo info;          // kind and size (base unused: members resolve memory)
    uint32_t members = 0;   // bit m: registered on member m
  };
  enum class SubState : uint8_t { kPrepared, kWaiting, kRunning, kDone };
  struct Sub {
    size_t member = 0;
    TransferHandle handle;
    SubState state = SubState::kPrepared;  // kWaiting: NO_RESOURCE after the transfer started
  };
  enum class OpState : uint8_t { kPrepared, kRunning, kDone, kFailed };
  struct Op {
    std::vector<Sub> subs;  // in member order
    OpState state = OpState::kPrepared;
    Status error;           // when kFailed
  };

  Result<size_t> route_locked(const TransferRequest& r, size_t index) const;  // requires mu_
  Op* find(const TransferHandle& handle);  // requires mu_; nodes are stable
  // Fails `op` with `error` from sub-transfer `sub` and cancels the others; returns the error.
  Status fail(Op& op, const Sub& sub, const Status& error);

  const std::vector<Transport*> members_;
  const Capabilities capabilities_;
  std::vector<Capabilities> member_caps_;  // constant after construction
  mutable std::mutex mu_;  // guards tiers_, ops_, next_id_, partial_no_resource_
  std::unordered_map<TierId, RoutedTier> tiers_;
  std::unordered_map<uint64_t, Op> ops_;
  uint64_t next_id_ = 1;
  int64_t partial_no_resource_ = 0;
};

}  // namespace specontext::transport
