// KvNode: a remote KV node. It owns one pool of host memory, hands out regions of it over the
// control plane (cluster/control_protocol.h, Boost.Asio) and serves the clients' node-side gathers
// / scatters into them (the node packs the rows). Clients are kept apart: a gather or scatter must
// name its region (a random id) and that region's key (128 bits from getrandom, compared in
// constant time), and stay inside it; a freed region's pages are returned to the system, so the
// next client over them reads zeros. It serves no one-sided RMA and hands out no remote keys: with
// UCX (1.13) an RMA key confines nothing over TCP or shared memory, and UCP's software RMA (which a
// UCP_FEATURE_RMA worker serves over any transport) reads and writes any address a client names.
// Run in-process (tests) or as `specontext kv-node`.
//
// Threads: the control plane runs on one Asio thread, which alone touches the allocator and the
// sessions; UCX progress runs on a second thread that blocks on the worker's event fd when idle.
// One mutex serialises every call into UCX (progress, memory registration) and guards the region
// table the gather / scatter handlers check.
// stats() reads counters under a mutex. stop() (and the destructor) closes the listener and every
// connection, which peers see as a connection reset, then joins both threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cluster/control_protocol.h"
#include "core/status.h"

namespace specontext::cluster {

struct KvNodeOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;      // 0: any free port (read it back with port())
  uint64_t capacity = 0;  // bytes of the pool
  std::string name;       // in replies and messages; default host:port
};

struct KvNodeStats {
  uint64_t capacity = 0;
  uint64_t used = 0;
  int64_t regions = 0;
  int64_t connections = 0;
  int64_t requests = 0;
  int64_t bad_requests = 0;
  uint64_t bytes_gathered = 0;  // node-side gathers served (UcxTransferMode::kNodeGather)
  uint64_t bytes_scattered = 0;
};

class KvNode {
 public:
  static Result<std::unique_ptr<KvNode>> start(KvNodeOptions options);
  ~KvNode();
  KvNode(const KvNode&) = delete;
  KvNode& operator=(const KvNode&) = delete;

  uint16_t port() const;
  const std::string& name() const;
  KvNodeStats stats() const;
  // Idempotent; after it the node serves nothing and its memory is released.
  void stop();

  class Impl;

 private:
  explicit KvNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specontext::cluster
