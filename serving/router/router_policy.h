// The router's choice of a replica (serving/router/router.h), without sockets: round-robin,
// least-load (fewest requests in flight) and prefix-aware (the replica that most likely holds the
// longest prefix of the prompt in its prefix cache, as SGLang's cache-aware router). Prefixes are
// approximated per replica by the chained hashes of the prompt text's whole chunks (a hash chain:
// chunk i's hash covers chunks 0..i, so a match of k chunks is a shared prefix of k chunks), kept
// in a bounded LRU set per replica. Not thread-safe: one owner (the router's Asio thread).
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace specontext::router {

enum class Policy { kRoundRobin, kLeastLoad, kPrefix };

// "rr" / "round-robin", "least-load", "prefix" (else nullopt); and back to the first spelling.
std::optional<Policy> parse_policy(std::string_view name);
const char* policy_name(Policy p);

struct PolicyOptions {
  Policy policy = Policy::kRoundRobin;
  // Prefix: bytes per hashed chunk; prompts are hashed up to max_prefix_bytes (the rest is not
  // looked at); each replica remembers at most max_chunks_per_replica chunk hashes (LRU).
  size_t chunk_bytes = 64;
  size_t max_prefix_bytes = 256 * 1024;
  size_t max_chunks_per_replica = 1 << 18;
  // Prefix: a match is used when it covers at least min_match_chunks chunks and at least
  // match_ratio of the prompt's chunks; else, or when the matched replica has more than
  // balance_abs_threshold requests in flight beyond the least loaded one, least-load decides.
  size_t min_match_chunks = 1;
  double match_ratio = 0.5;
  int64_t balance_abs_threshold = 8;
};

// The chained hashes of `text`'s whole chunks of chunk_bytes (at most max_bytes of it); a text
// shorter than one chunk has one hash of all of it. Pure: run it off the I/O thread.
std::vector<uint64_t> prefix_chunk_hashes(std::string_view text, size_t chunk_bytes, size_t max_bytes);

// Why a replica was chosen.
enum class ChoiceReason { kRoundRobin, kLeastLoad, kPrefixHit, kPrefixMiss, kPrefixOverloaded };

struct Choice {
  size_t replica = 0;
  ChoiceReason reason = ChoiceReason::kRoundRobin;
  size_t matched_chunks = 0;  // prefix: chunks the chosen replica (by prefix) matched
};

class RoutingPolicy {
 public:
  RoutingPolicy(PolicyOptions options, size_t replicas);

  const PolicyOptions& options() const { return options_; }
  size_t replicas() const { return replicas_.size(); }

  // A replica among those usable[i] (same size as replicas()), or nullopt when none is. `chunks`:
  // the prompt's prefix_chunk_hashes (prefix policy; empty: no prompt text, least-load decides).
  // Choosing by prefix records the prompt's chunks under the chosen replica (it will cache them).
  std::optional<Choice> choose(const std::vector<bool>& usable, const std::vector<uint64_t>& chunks);

  // In-flight accounting (least-load and the prefix policy's balance check).
  void started(size_t replica);
  void finished(size_t replica);
  int64_t in_flight(size_t replica) const { return replicas_[replica].in_flight; }

  // Records `chunks` as cached on `replica` (choose does it; a retry on another replica calls it).
  void record(size_t replica, const std::vector<uint64_t>& chunks);
  // A replica went down (its cache is gone when it comes back): forget its chunks.
  void forget(size_t replica);
  // Leading chunks of `chunks` that `replica` is believed to hold.
  size_t match(size_t replica, const std::vector<uint64_t>& chunks) const;
  size_t chunks_held(size_t replica) const { return replicas_[replica].lru.size(); }

 private:
  struct ReplicaState {
    int64_t in_flight = 0;
    std::list<uint64_t> lru;  // most recent first
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> index;
  };
  std::optional<size_t> least_loaded(const std::vector<bool>& usable);

  PolicyOptions options_;
  std::vector<ReplicaState> replicas_;
  size_t next_ = 0;  // round-robin position, and where least-load starts among equals
};

}  // namespace specontext::router
