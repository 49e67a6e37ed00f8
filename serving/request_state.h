// The life of a request and of the KV it leaves behind, as the Scheduler and its PrefixStore move
// them (serving/README.md, "Request states"): a request waits, runs (prefilling, then decoding)
// and ends; with prefix caching its sequence is then cached in engine memory, and a cached
// sequence evicted for room goes on to the store's lower levels (host memory, then a file or a
// KV node's blob) until a request restores it or it is dropped. A preempted request waits again,
// its whole fork units swapped into the store when it has one.
//
// `allowed` is the table; `StateLog::move` is the one place a state changes: it refuses (and
// counts) a move the table does not have and counts every move it makes. Not thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/base/status.h"

namespace specontext {

enum class RequestState : uint8_t {
  kNew,         // not yet submitted; or a prefix file a previous process left, before open indexes it
  kWaiting,     // queued (FIFO); a preempted or requeued request first in line
  kPrefilling,  // running: prompt chunks still to compute
  kDecoding,    // running: one token a step
  kFinished,    // ended kStop / kLength / kContext; its event went out
  kRefused,     // ended kRefused: never fits, even alone
  kError,       // ended kError (admission, sequence, forward or constraint)
  kCancelled,   // cancel(): no event
  kCached,      // its sequence kept in engine memory (prefix cache)
  kOffloaded,   // its whole fork units in host memory
  kOnDisk,      // in a file
  kOnNode,      // in a PrefixBlobStore's blob (a KV node's memory)
  kShared,      // found in a SharedPrefixStore (another server's, or this one's, earlier write)
  kDropped,     // out of every level: its KV is gone
};
inline constexpr size_t kRequestStates = static_cast<size_t>(RequestState::kDropped) + 1;

std::string_view request_state_name(RequestState s);

// True when a request (or its prefix) may go from `from` to `to`.
bool allowed(RequestState from, RequestState to);

// Makes and counts state changes.
class StateLog {
 public:
  // `state` becomes `to` when the table allows it; else kInternal naming both, `state` unchanged,
  // and the refusal counted.
  Status move(RequestState& state, RequestState to);
  int64_t count(RequestState from, RequestState to) const {
    return counts_[static_cast<size_t>(from)][static_cast<size_t>(to)];
  }
  int64_t refused() const { return refused_; }
  // Adds other's counts (the Scheduler's and its store's together).
  StateLog& operator+=(const StateLog& other);

 private:
  std::array<std::array<int64_t, kRequestStates>, kRequestStates> counts_{};
  int64_t refused_ = 0;
};

}  // namespace specontext
