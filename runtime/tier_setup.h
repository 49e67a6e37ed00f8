// Assembles the engine's KV tiers from command-line sizes: host pools on NUMA nodes (first touch
// on the node; pinned when the backend is CUDA), in-process loopback remote nodes, the transport
// router and copy engine over them, the start-up bandwidth probe, the planner policy and the CPU
// candidate filter. Shared by `specontext generate` and the benchmarks.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cluster/control_protocol.h"
#include "core/base/status.h"
#include "core/engine/engine.h"
#include "planner/planner_policy.h"
#include "transport/bandwidth_probe.h"
#include "transport/copy_engine.h"

namespace specontext::cluster {
class ReplicaHealer;
class ReplicaEventLog;
}

namespace specontext::runtime {

struct TierArgs {
  std::string device_kv;  // SIZE: device tier for KV, working sets, staging, head keys ("" = all fits)
  std::string host_kv;    // SIZE[,SIZE per NUMA node]
  std::string remote_kv;  // SIZE[,SIZE per remote node] (in-process loopback nodes)
  // Remote tiers on KV node processes over UCX, one per entry: SIZE@HOST:PORT[+HOST:PORT...]
  // (more than one endpoint: the tier is mirrored on each, and reads fail over).
  std::vector<std::string> kv_nodes;
  int64_t kv_node_timeout_ms = 5000;
  std::string kv_node_mode = "gather";  // gather (node-side, for TCP) | rma (one-sided, for RDMA NICs)
  int64_t kv_node_rejoin_ms = 1000;     // retry interval for bringing a dead replica back (0: never)
  std::vector<std::string> kv_node_spares;  // HOST:PORT of KV nodes a dead replica may move to
  // The KV nodes' shared secret: this file, else SPECONTEXT_KV_SECRET (never a flag's value).
  std::string kv_secret_file;
  // The client ID that secret belongs to in the nodes' keys file ("": SPECONTEXT_KV_CLIENT_ID, else
  // the shared secret's client).
  std::string kv_client_id;
  // PEM CA certificates the KV nodes' TLS certificates are verified against; "": plain TCP.
  std::string kv_node_tls_ca;
  int64_t remote_latency_us = 0;
  std::string placement = "dynamic";  // dynamic (re-plan each step) | static (planned once for the final lengths)
  bool cpu_filter = true;             // let the planner switch CPU candidate filtering on
  int64_t shortlist = 0;              // candidates per KV head when filtering (0 = 4·budget)
  bool probe = true;                  // measure tier bandwidths at start-up
  int64_t staging_layers = 2;         // remote layers staged whole on the device at once
  bool any() const { return !host_kv.empty() || !remote_kv.empty() || !kv_nodes.empty(); }
};

// Everything the engine's tiering borrows; destroy after the engine.
struct TierRuntime {
  // Page-locked host pools: each entry unregisters its pool, then releases the pool's memory.
  // Declared first, so destroyed last: after the transports and the copy engine that may still
  // read the pools (a transfer in flight at teardown), never before them.
  std::vector<std::shared_ptr<void>> keep_alive;
  TierArgs args;
  // Control-plane sessions of KV nodes (their regions live as long as these): declared before
  // the transports so that they are destroyed after them.
  std::vector<std::shared_ptr<void>> node_sessions;
  // Brings dead replicas of mirrored KV node tiers back between steps; owns their sessions.
  std::shared_ptr<cluster::ReplicaHealer> healer;
  std::vector<std::unique_ptr<Transport>> transports;  // local, loopback, cuda (members of the router)
  std::unique_ptr<Transport> router;
  std::shared_ptr<transport::CopyEngine> copies;
  std::shared_ptr<planner::PlannerPolicy> policy;
  std::vector<transport::ProbeResult> probe;
  std::string placement_note;  // what the static plan decided
  std::vector<Transport*> kv_node_transports;  // UcxRemoteTransport members, for the report
  std::vector<std::string> kv_node_tier_names;  // the engine's name of each ("remote0", ...)
  // Fail-over, rejoin and loss of KV node replicas go to stderr, naming the node, between steps
  // and at print_kv_node_events (build_engine sets it unless quiet: generate's text mode, serve).
  bool print_events = false;
  std::shared_ptr<cluster::ReplicaEventLog> event_log;
};

// SIZE@HOST:PORT[+HOST:PORT...] of --kv-node and --prefix-offload-remote: errors name `flag`.
struct KvNodeSpec {
  uint64_t bytes = 0;
  std::vector<cluster::Endpoint> endpoints;  // one per replica
};
Result<KvNodeSpec> parse_kv_node_spec(const std::string& flag, const std::string& spec);

// Fills eopts.tiering (device size, host pools, remote nodes, transport, copy engine, filter).
// Nothing to do (nullptr) when no host or remote size is given.
Result<std::unique_ptr<TierRuntime>> setup_tiers(const TierArgs& args, const Model& model, const Backend& backend,
                                                 EngineOptions& eopts);

// After Engine::create: probes the bandwidths of the engine's tiers, builds the planner policy
// from them and installs it (dynamic) or applies the plan for `final_lengths` once (static).
Status start_tiers(TierRuntime& rt, Engine& engine, const EngineOptions& eopts,
                   const std::vector<int64_t>& final_lengths);

// Prints to stderr what happened to KV node replicas since the last call (cluster/replica_events.h:
// "kv-node: tier remote0: replica 0 on HOST:PORT is dead (why); reads fail over ...", rejoins,
// "kv-node: tier remote0 lost: no replica alive (every node: why)"), when rt.print_events. The
// engine's thread calls it between steps; callers call it once more after the run.
void print_kv_node_events(TierRuntime& rt);

// {"tiers": [...], "overlap": {...}, "placement_events": [...], "probe": [...], ...}
nlohmann::json tiers_json(const Engine& engine, const TierRuntime* rt);

}  // namespace specontext::runtime
