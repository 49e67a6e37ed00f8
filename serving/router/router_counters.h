// The router's counters, as serving/openai/server_counters.h does the server's: one struct per
// scope (the router; each replica), one table of rows per struct (Prometheus name, type, help),
// renderers built from the tables; a field without a row fails to compile (router_counters.cc).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace specontext::router {

// Counts since start (gauges: now).
struct RouterCounters {
  int64_t requests = 0;             // requests read whole (every route)
  int64_t proxied = 0;              // answered by a replica, whatever its status
  int64_t retries = 0;              // tries on another replica after one failed before a byte went out
  int64_t unavailable = 0;          // answered 503 because no replica could take it
  int64_t rejected = 0;             // answered 4xx by the router (unreadable, too large, no route)
  int64_t failed_mid_answer = 0;    // a replica failed after bytes went out: ended with an error event / cut
  int64_t client_gone = 0;          // the client went away while its answer was relayed
  int64_t prefix_lookups = 0;       // prefix policy: requests routed with prompt text
  int64_t prefix_hits = 0;          // of those, sent to the replica with a long enough match
  int64_t prefix_overloaded = 0;    // a long enough match whose replica was too loaded (least-load took it)
  int64_t prefix_prompt_chunks = 0;   // chunks hashed over all lookups
  int64_t prefix_matched_chunks = 0;  // of those, matched on the chosen replica
  int64_t body_parse_errors = 0;    // bodies whose prompt could not be read (routed by least-load)
  int64_t health_checks = 0;        // health probes sent to replicas
  int64_t open_connections = 0;     // gauge
  int64_t connections_refused = 0;  // past max_connections (503, closed)
  int64_t header_timeouts = 0;
  int64_t tls_handshake_failures = 0;
  int64_t replicas_up = 0;          // gauge
};

// Per replica (labelled replica="host:port").
struct ReplicaCounters {
  int64_t chosen = 0;       // requests sent to it (each try counts)
  int64_t answered = 0;     // of those, answered (any status)
  int64_t failures = 0;     // connection refused / reset / timed out before or while answering
  int64_t marked_down = 0;  // times marked down
  int64_t prefix_hits = 0;  // chosen for a long enough prefix match
  int64_t in_flight = 0;    // gauge
  int64_t up = 0;           // gauge: 1 up, 0 down
};

template <typename S>
struct RouterCounterSpec {
  const char* prom_name;
  const char* prom_type;  // "counter" or "gauge"
  const char* help;
  int64_t S::*field;
};

std::span<const RouterCounterSpec<RouterCounters>> router_counter_specs();
std::span<const RouterCounterSpec<ReplicaCounters>> replica_counter_specs();

struct ReplicaSnapshot {
  std::string name;  // host:port
  ReplicaCounters counters;
};

// prefix_hits / prefix_lookups (0 without lookups).
double prefix_hit_rate(const RouterCounters& c);

// /metrics: every router row, specontext_router_prefix_hit_rate, then every replica row once per
// replica with its label.
std::string render_router_prometheus(const RouterCounters& c, const std::vector<ReplicaSnapshot>& replicas);

}  // namespace specontext::router
