// Collectives among threads of one process: the Communicator (core/ports/communicator.h) of
// tensor-parallel ranks that are threads, each driving its own Engine and CPU backend.
//
// all_reduce_sum: every rank publishes its buffer and waits until all ranks have joined (the
// join barrier); then rank r sums slice r of the vector (slices of ≈ count / W floats, cut at
// 64-byte boundaries) over the ranks' buffers into a shared scratch vector, in rank order
// 0, 1, …, W−1 for every element; after a second barrier each rank copies the whole scratch
// into its own buffer. Each element is therefore summed once, always in the same order: every
// rank gets bit-identical results, and the same ones on every run, whichever thread computed
// which slice.
//
// Failure (never a hang):
// - A rank that does not join within `timeout` (measured from each waiting rank's arrival)
//   fails the group with kUnavailable naming the missing ranks; every waiting rank returns it.
// - abort(reason), from any rank's communicator or from the group, fails the group with
//   kUnavailable carrying the reason and wakes every waiting rank.
// - Ranks passing different counts to the same collective all get kInvalidArgument listing
//   each rank's count; a null buffer with count > 0 or a negative count fails the group the
//   same way (the other ranks must not wait for a rank that cannot take part).
// - After any failure every later call on any rank returns the failure at once (same code).
// Once the join barrier has completed a collective always finishes (the summing phase does
// not block), so a buffer is never read by another rank after its owner's call has returned.
//
// Threads: each rank's communicator is used by one thread at a time (a second concurrent call
// from the same rank fails the group with kInvalidArgument); abort() and status() may be called
// from any thread. The group and its communicators share one state object; any of them keeps
// it alive.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "core/base/status.h"
#include "core/ports/communicator.h"

namespace specontext::cpu {

struct ThreadCommunicatorOptions {
  // How long a rank waits in a collective for the other ranks to join.
  std::chrono::milliseconds timeout{60000};
};

struct ThreadGroupState;  // cpu/thread_communicator.cc

class ThreadCommunicator final : public Communicator {
 public:
  int rank() const override { return rank_; }
  int world_size() const override;
  Status all_reduce_sum(float* data, int64_t count) override;
  // Fails the whole group (see the top comment); idempotent, the first reason wins.
  void abort(const Status& reason);
  // OK while the group is healthy, its failure afterwards.
  Status status() const;

 private:
  friend class ThreadCommunicatorGroup;
  ThreadCommunicator(std::shared_ptr<ThreadGroupState> state, int rank)
      : state_(std::move(state)), rank_(rank) {}
  std::shared_ptr<ThreadGroupState> state_;
  int rank_;
};

class ThreadCommunicatorGroup {
 public:
  // world in [1, 4096]; timeout > 0.
  static Result<std::unique_ptr<ThreadCommunicatorGroup>> create(
      int world, const ThreadCommunicatorOptions& options = {});
  int world_size() const { return static_cast<int>(comms_.size()); }
  // Rank `rank`'s communicator (the same object on every call); null outside [0, world).
  std::shared_ptr<ThreadCommunicator> communicator(int rank) const;
  void abort(const Status& reason);
  Status status() const;

 private:
  ThreadCommunicatorGroup() = default;
  std::shared_ptr<ThreadGroupState> state_;
  std::vector<std::shared_ptr<ThreadCommunicator>> comms_;
};

}  // namespace specontext::cpu
