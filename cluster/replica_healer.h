// ReplicaHealer: brings mirrored KV tiers back to full strength after a node dies. For each
// replica of a watched UcxRemoteTransport found dead, it reconnects in the background (every
// retry_interval) to the replica's node (a KV node restarted at the same address) or, failing
// that, to a spare node that holds no replica of the tier, and allocates a fresh region of the
// tier's size there. A replica moved to a spare lives there from then on, and its old address
// becomes a spare. At the next maintain() after that succeeded (the engine
// calls it between steps: TieringOptions::between_steps), the transport copies the whole tier
// into the region from a live replica and uses it again (UcxRemoteTransport::rejoin).
//
// A tier whose last replica died cannot be healed (there is nothing to copy from): its transfers
// fail as before. The healer owns the control sessions of the watched replicas (a region lives as
// long as its session), so destroy it after the transports.
//
// Threads: maintain(), watch() and report() run on one thread (the engine's). A reconnection
// attempt runs on its own std::async thread (connect + hello + allocate, each bounded by the
// timeout); its result is taken over by maintain() once ready, so a dead node never stalls a step
// for longer than the copy of a tier that came back.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "cluster/control_protocol.h"
#include "cluster/kv_node_client.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {

struct HealerOptions {
  std::chrono::milliseconds retry_interval{1000};  // between attempts on one dead replica
  std::chrono::milliseconds timeout{5000};         // of each control-plane call
  std::vector<Endpoint> spares;                    // KV nodes to re-replicate onto, in this order
  KvNodeAccess access;                             // secret and TLS for the nodes (kv_node_client.h)
};

struct HealerEvent {
  int32_t tier = -1;
  size_t replica = 0;
  std::string node;
  bool rejoined = false;
  std::string message;  // why an attempt failed
  // Failed attempts this event stands for: a replica's attempts that fail in a row for the same
  // reason are one event, so that a node that stays down cannot push a rejoin out of the log.
  int64_t attempts = 1;
};

class ReplicaHealer {
 public:
  explicit ReplicaHealer(HealerOptions options) : options_(options) {}
  ~ReplicaHealer();  // waits for attempts in flight (each bounded by the timeout)
  ReplicaHealer(const ReplicaHealer&) = delete;
  ReplicaHealer& operator=(const ReplicaHealer&) = delete;

  // Watches `transport`'s replicas: replica i lives at endpoints[i], in a region of region_bytes
  // held by sessions[i] (null for one that was unreachable at set-up).
  void watch(transport::UcxRemoteTransport* transport, std::vector<Endpoint> endpoints, uint64_t region_bytes,
             std::vector<std::unique_ptr<KvNodeClient>> sessions);
  // Starts attempts for dead replicas, and rejoins those whose attempt has a region ready.
  void maintain();
  // Every rejoin and every failed attempt, oldest first.
  const std::vector<HealerEvent>& events() const { return events_; }

 private:
  struct Attempt {
    std::unique_ptr<KvNodeClient> session;
    transport::RemoteRegion region;
    Endpoint endpoint;  // where the region is
  };
  struct Watched {
    transport::UcxRemoteTransport* transport = nullptr;
    uint64_t region_bytes = 0;
    std::vector<Endpoint> endpoints;
    std::vector<std::unique_ptr<KvNodeClient>> sessions;
    std::vector<std::future<Result<Attempt>>> attempts;
    std::vector<std::unique_ptr<Attempt>> ready;  // a region waiting for transfers to end
    std::vector<std::chrono::steady_clock::time_point> next_try;
  };
  void record(const Watched& w, size_t replica, bool rejoined, std::string message);
  void adopt(Watched& w, size_t replica, Attempt& attempt);  // after a successful rejoin
  // A region of `bytes` on the first candidate that gives one (runs on an attempt's thread).
  static Result<Attempt> find_region(std::vector<Endpoint> candidates, uint64_t bytes,
                                     std::chrono::milliseconds timeout, KvNodeAccess access);

  HealerOptions options_;
  std::vector<Watched> watched_;
  std::vector<HealerEvent> events_;
};

}  // namespace specontext::cluster
