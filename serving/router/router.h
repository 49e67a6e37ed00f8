// A router in front of N `specontext serve` replicas (`specontext router`): the OpenAI API in and
// out. POST /v1/completions and /v1/chat/completions (and GET /v1/models, POST /tokenize,
// /detokenize) go to one replica chosen by the policy (serving/router/router_policy.h); a
// streamed answer (chunked, server-sent events) is relayed piece by piece as it arrives, any
// other answer is read whole (at most max_response_bytes) and then sent. GET /health and
// /metrics are the router's own.
// Failures: a replica that refuses the connection, resets it, times out or closes before its
// answer's header is marked down and skipped (the health check brings it back); a request none of
// whose bytes reached the client is tried on another replica (each at most once); a replica's 503
// (full queue, draining) is tried elsewhere when another replica is up. A streamed answer broken
// off after bytes went out ends with an error event ("data: {"error":...}"), never silently; no
// replica left: 503 naming how many are down. Every case is counted in /metrics.
// Hostile input: the request header (64 KiB) and body (max_body_bytes) are bounded as the
// server's; the body is parsed only for the prefix policy, only to read the prompt / messages,
// with a bounded depth, on a worker thread. Threads: one Asio thread (connections, relaying,
// health checks, the policy under a mutex); parse_workers threads for the prefix policy's parsing.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"
#include "serving/router/router_counters.h"
#include "serving/router/router_policy.h"

namespace specontext::router {

struct ReplicaUrl {
  std::string host;  // an IP address or a name (resolved at start)
  uint16_t port = 0;
  std::string name() const { return host + ":" + std::to_string(port); }
};
// "http://HOST:PORT" (an optional trailing '/') or "HOST:PORT"; https:// is kUnimplemented
// (replicas are reached over plain HTTP), anything else kInvalidArgument naming the text.
Result<ReplicaUrl> parse_replica_url(std::string_view url);

struct RouterOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port (Router::port)
  std::vector<ReplicaUrl> replicas;
  PolicyOptions policy;
  size_t max_body_bytes = 4u << 20;       // larger request bodies get 413 (as serve's)
  size_t max_response_bytes = 64u << 20;  // a non-streamed answer larger than this: 502
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds idle_timeout{15000};
  std::chrono::milliseconds connect_timeout{2000};
  // Longest wait for a replica's next bytes (a non-streamed answer: for all of it).
  std::chrono::milliseconds upstream_timeout{600000};
  // Every replica's GET /health this often (0: never; check_health_now only), each within health_timeout.
  std::chrono::milliseconds health_interval{1000};
  std::chrono::milliseconds health_timeout{1000};
  size_t max_connections = 1024;  // client connections at once (0: no limit); more get 503 and close
  size_t parse_workers = 1;       // prefix policy: threads reading prompts out of bodies
  // With keys, /v1/*, /tokenize and /detokenize need "Authorization: Bearer KEY" (401 before the
  // body is read, as serve); the header is passed on to the replicas either way.
  std::vector<std::string> api_keys;
  std::string tls_cert_file;  // HTTPS towards clients when both are set (core/tls)
  std::string tls_key_file;
};

class Router {
 public:
  // Binds, listens and starts the threads; every replica starts up (the first health check, or
  // the first failure, says otherwise). kInvalidArgument without replicas or with a bad host.
  static Result<std::unique_ptr<Router>> start(const RouterOptions& options);
  ~Router();  // stop()
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  uint16_t port() const;
  // Closes the listener and every connection (answers being relayed are cut); idempotent.
  void stop();
  RouterCounters counters() const;
  std::vector<ReplicaSnapshot> replicas() const;
  std::string metrics_text() const;  // what GET /metrics answers
  // One round of health checks of every replica, returned once all are done.
  void check_health_now();

  struct Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specontext::router
