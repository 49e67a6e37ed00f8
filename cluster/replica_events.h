// ReplicaEventLog: what happened to the replicas of KV node tiers between two looks, as lines for
// a person, each naming the node: a replica declared dead and where the tier goes on (fail-over),
// a replica that rejoined (on which node, how much was copied into it), and a tier lost (no
// replica alive: every node named with why it was declared dead). The one place these events are
// rendered: `specontext generate` in text mode and `specontext serve` print its lines to stderr
// between steps and at the end (runtime/tier_setup.h, print_kv_node_events); `generate --json`
// reports the same state as tiering.kv_nodes instead. The `--prefix-offload-remote` store's
// replicas too (cluster/remote_prefix_store.h: after each transfer, lines to stderr in generate
// and serve, JSON mode included).
//
// It compares snapshots (UcxRemoteTransport::replicas()), so it needs no hook inside the
// transport, whose failures are noticed inside UCX progress with its lock held.
//
// Threads: one caller (the engine's thread).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "transport/ucx_transport.h"

namespace specontext::cluster {

// One KV node tier as seen now.
struct TierReplicas {
  int32_t tier = -1;  // the engine's tier id
  std::string name;   // the engine's name for it ("remote0")
  std::vector<transport::ReplicaReport> replicas;
  std::string lost_note = {};  // appended to its loss line: what happens next ("" for none)
};

class ReplicaEventLog {
 public:
  // Lines for what changed since the last call, in replica order, without a trailing newline.
  // The first call compares with every replica alive, so one that started out dead (unreachable
  // at set-up) is reported too. A replica that rejoined and died again since the last call gives
  // both lines. When no replica is alive, the newly dead give one loss line naming every node.
  std::vector<std::string> update(const std::vector<TierReplicas>& tiers);
  // Replicas declared dead by update() so far, over every tier (one that rejoined and died again
  // counts twice).
  int64_t deaths() const { return deaths_; }

 private:
  std::map<int32_t, std::vector<transport::ReplicaReport>> last_;
  std::map<int32_t, bool> reported_lost_;
  int64_t deaths_ = 0;
};

}  // namespace specontext::cluster
