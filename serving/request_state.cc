#include "serving/request_state.h"

#include <string>

namespace specontext {

std::string_view request_state_name(RequestState s) {
  switch (s) {
    case RequestState::kNew:
      return "new";
    case RequestState::kWaiting:
      return "waiting";
    case RequestState::kPrefilling:
      return "prefilling";
    case RequestState::kDecoding:
      return "decoding";
    case RequestState::kFinished:
      return "finished";
    case RequestState::kRefused:
      return "refused";
    case RequestState::kError:
      return "error";
    case RequestState::kCancelled:
      return "cancelled";
    case RequestState::kCached:
      return "cached";
    case RequestState::kOffloaded:
      return "offloaded";
    case RequestState::kOnDisk:
      return "on disk";
    case RequestState::kOnNode:
      return "on a node";
    case RequestState::kShared:
      return "in the shared store";
    case RequestState::kDropped:
      return "dropped";
  }
  return "?";
}

bool allowed(RequestState from, RequestState to) {
  using S = RequestState;
  // Where a prefix goes when it enters the store: host memory, or straight to the lower level.
  const bool into_store = to == S::kOffloaded || to == S::kOnDisk || to == S::kOnNode;
  switch (from) {
    case S::kNew:  // submitted; or a file found at open; or a prefix found in the shared store
      return to == S::kWaiting || to == S::kOnDisk || to == S::kShared;
    case S::kWaiting:  // admitted, refused, failed at admission, cancelled
      return to == S::kPrefilling || to == S::kRefused || to == S::kError || to == S::kCancelled;
    case S::kPrefilling:
    case S::kDecoding:
      // Its first token drawn (prefilling only); ended; cancelled; preempted or requeued after a
      // lost tier; its KV's whole fork units swapped into the store as it is preempted.
      return (to == S::kDecoding && from == S::kPrefilling) || to == S::kFinished || to == S::kError ||
             to == S::kCancelled || to == S::kWaiting || into_store;
    case S::kFinished:
    case S::kCancelled:  // keep_cached
      return to == S::kCached;
    case S::kCached:  // taken over by the next turn, evicted into the store, or dropped
      return to == S::kPrefilling || into_store || to == S::kDropped;
    case S::kOffloaded:  // on to the lower level, restored, dropped
      return to == S::kOnDisk || to == S::kOnNode || to == S::kCached || to == S::kDropped;
    case S::kOnDisk:
    case S::kOnNode:
    case S::kShared:  // read back into the cache, or not (gone, unreadable, no room)
      return to == S::kCached || to == S::kDropped;
    case S::kRefused:
    case S::kError:
    case S::kDropped:
      return false;
  }
  return false;
}

Status StateLog::move(RequestState& state, RequestState to) {
  if (!allowed(state, to)) {
    ++refused_;
    return internal_error("request state: no move from " + std::string(request_state_name(state)) + " to " +
                          std::string(request_state_name(to)));
  }
  ++counts_[static_cast<size_t>(state)][static_cast<size_t>(to)];
  state = to;
  return Status::ok();
}

StateLog& StateLog::operator+=(const StateLog& other) {
  for (size_t f = 0; f < kRequestStates; ++f) {
    for (size_t t = 0; t < kRequestStates; ++t) counts_[f][t] += other.counts_[f][t];
  }
  refused_ += other.refused_;
  return *this;
}

}  // namespace specontext
