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
// Who may use it: with a secret (KvNodeOptions::secret), only a client that answers the hello's
// challenge (cluster/kv_node_auth.h) may allocate, free or read stats; a wrong answer or a request
// before authentication is counted (auth_failures), logged with the peer's address, and closes
// the connection. Without a secret the node serves anyone who can reach it, so it listens on a
// loopback address only (start() refuses any other). With a certificate (tls_cert_file,
// tls_key_file) the control plane is TLS 1.2+ (cluster/kv_node_tls.h); the data plane is not.
// Clients of a keys file (`clients`) authenticate with their own secrets, hold at most their own
// quota across all their connections, open at most their own number of connections and see only
// their own usage in `stats`; the shared secret is one client more, with `client_quota`. At most
// `max_connections` are served at once (the next is sent an error line and closed); one that
// sends nothing for `idle_timeout` while holding no region is closed.
//
// Threads: the control plane runs on one Asio thread, which alone touches the allocator and the
// sessions; UCX progress runs on a second thread that blocks on the worker's event fd when idle.
// One mutex serialises every call into UCX (progress, memory registration) and guards the region
// table the gather / scatter handlers check.
// stats() reads counters under a mutex. stop() (and the destructor) closes the listener and every
// connection, which peers see as a connection reset, then joins both threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cluster/control_protocol.h"
#include "core/base/status.h"

namespace specontext::cluster {

struct KvNodeOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;      // 0: any free port (read it back with port())
  uint64_t capacity = 0;  // bytes of the pool
  std::string name;       // in replies and messages; default host:port
  // The shared secret clients must prove at hello; empty: none (then `host` must be loopback).
  std::string secret;
  // TLS for the control plane (cluster/kv_node_tls.h) when both are set: a PEM certificate chain
  // and its PEM private key (not readable by every user). Then every connection is TLS 1.2+; a
  // plain one is sent an error line saying so and closed.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Clients of a keys file (cluster/kv_node_auth.h load_kv_keys), each with its own secret, quota
  // and connection limit; they see their own usage only. With `secret` too, that is one more client
  // (no ID). With either, every client must authenticate.
  std::vector<KvClientKey> clients;
  // Bytes the shared secret's client may hold at once, all its connections together (on an open
  // node: all connections); 0: up to the capacity.
  uint64_t client_quota = 0;
  int64_t max_connections = 64;
  // A connection that sends no request for this long while holding no region is closed (0: never).
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(60)};
  // Where refusals (failed authentication, connection limit) are logged, one line each; default
  // stderr. Called on the node's control thread.
  std::function<void(const std::string&)> log;
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
  int64_t auth_failures = 0;        // wrong or missing answers to the challenge
  int64_t connections_refused = 0;  // past max_connections
  int64_t idle_closed = 0;          // closed by the idle timeout
  int64_t quota_refusals = 0;       // allocs beyond a connection's quota
  int64_t tls_failures = 0;         // failed TLS handshakes; TLS to a plain node, plain to a TLS node
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
