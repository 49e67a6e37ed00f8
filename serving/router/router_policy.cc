#include "serving/router/router_policy.h"

#include <algorithm>

#include "core/base/fnv1a.h"

namespace specontext::router {

std::optional<Policy> parse_policy(std::string_view name) {
  if (name == "rr" || name == "round-robin") return Policy::kRoundRobin;
  if (name == "least-load") return Policy::kLeastLoad;
  if (name == "prefix") return Policy::kPrefix;
  return std::nullopt;
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kRoundRobin:
      return "rr";
    case Policy::kLeastLoad:
      return "least-load";
    case Policy::kPrefix:
      return "prefix";
  }
  return "?";
}

namespace {
// FNV-1a over the chunk, seeded with the previous chunk's hash (the chain).
uint64_t chain_hash(uint64_t seed, std::string_view chunk) {
  uint64_t h = fnv1a64(chunk, seed ^ kFnv1aBasis);
  // A final mix, so that neighbouring chunks' hashes differ in every bit.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}
}  // namespace

std::vector<uint64_t> prefix_chunk_hashes(std::string_view text, size_t chunk_bytes, size_t max_bytes) {
  std::vector<uint64_t> out;
  if (chunk_bytes == 0 || text.empty()) return out;
  text = text.substr(0, std::min(text.size(), max_bytes));
  if (text.size() < chunk_bytes) {
    out.push_back(chain_hash(0x9e3779b97f4a7c15ull, text));
    return out;
  }
  uint64_t h = 0;
  for (size_t at = 0; at + chunk_bytes <= text.size(); at += chunk_bytes) {
    h = chain_hash(h, text.substr(at, chunk_bytes));
    out.push_back(h);
  }
  return out;
}

RoutingPolicy::RoutingPolicy(PolicyOptions options, size_t replicas)
    : options_(options), replicas_(replicas) {}

std::optional<size_t> RoutingPolicy::least_loaded(const std::vector<bool>& usable) {
  const size_t n = replicas_.size();
  std::optional<size_t> best;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (next_ + k) % n;
    if (!usable[i]) continue;
    if (!best) {
      best = i;
      continue;
    }
    const ReplicaState& a = replicas_[i];
    const ReplicaState& b = replicas_[*best];
    // Fewest in flight; among equals the one holding the fewest chunks (the most room, and the
    // way different prefixes spread), then the first from the rotating start.
    if (a.in_flight < b.in_flight || (a.in_flight == b.in_flight && a.lru.size() < b.lru.size())) best = i;
  }
  return best;
}

std::optional<Choice> RoutingPolicy::choose(const std::vector<bool>& usable, const std::vector<uint64_t>& chunks) {
  const size_t n = replicas_.size();
  if (usable.size() != n || std::none_of(usable.begin(), usable.end(), [](bool u) { return u; }))
    return std::nullopt;
  Choice c;
  switch (options_.policy) {
    case Policy::kRoundRobin: {
      for (size_t k = 0; k < n; ++k) {
        const size_t i = (next_ + k) % n;
        if (usable[i]) {
          c.replica = i;
          break;
        }
      }
      c.reason = ChoiceReason::kRoundRobin;
      next_ = (c.replica + 1) % n;
      return c;
    }
    case Policy::kLeastLoad: {
      c.replica = *least_loaded(usable);
      c.reason = ChoiceReason::kLeastLoad;
      next_ = (c.replica + 1) % n;
      return c;
    }
    case Policy::kPrefix:
      break;
  }
  const size_t least = *least_loaded(usable);
  std::optional<size_t> best;
  size_t best_match = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!usable[i]) continue;
    const size_t m = match(i, chunks);
    // The longest match; among equals the less loaded.
    if (m > best_match || (best && m == best_match && m > 0 && replicas_[i].in_flight < replicas_[*best].in_flight)) {
      best = i;
      best_match = m;
    }
  }
  const bool long_enough = best && best_match >= std::max<size_t>(options_.min_match_chunks, 1) &&
                           static_cast<double>(best_match) >=
                               options_.match_ratio * static_cast<double>(chunks.size());
  if (long_enough &&
      replicas_[*best].in_flight - replicas_[least].in_flight <= options_.balance_abs_threshold) {
    c.replica = *best;
    c.reason = ChoiceReason::kPrefixHit;
    c.matched_chunks = best_match;
  } else {
    c.replica = least;
    c.reason = long_enough ? ChoiceReason::kPrefixOverloaded : ChoiceReason::kPrefixMiss;
    c.matched_chunks = match(least, chunks);
    next_ = (least + 1) % n;
  }
  record(c.replica, chunks);
  return c;
}

void RoutingPolicy::started(size_t replica) { ++replicas_[replica].in_flight; }
void RoutingPolicy::finished(size_t replica) {
  if (replicas_[replica].in_flight > 0) --replicas_[replica].in_flight;
}

void RoutingPolicy::record(size_t replica, const std::vector<uint64_t>& chunks) {
  ReplicaState& r = replicas_[replica];
  for (uint64_t h : chunks) {
    const auto it = r.index.find(h);
    if (it != r.index.end()) {
      r.lru.splice(r.lru.begin(), r.lru, it->second);
      continue;
    }
    r.lru.push_front(h);
    r.index.emplace(h, r.lru.begin());
    while (r.lru.size() > std::max<size_t>(options_.max_chunks_per_replica, 1)) {
      r.index.erase(r.lru.back());
      r.lru.pop_back();
    }
  }
}

void RoutingPolicy::forget(size_t replica) {
  replicas_[replica].lru.clear();
  replicas_[replica].index.clear();
}

size_t RoutingPolicy::match(size_t replica, const std::vector<uint64_t>& chunks) const {
  const ReplicaState& r = replicas_[replica];
  size_t m = 0;
  while (m < chunks.size() && r.index.count(chunks[m]) != 0) ++m;
  return m;
}

}  // namespace specontext::router
