#include "serving/router/router_counters.h"

#include <cstdio>
#include <iterator>

namespace specontext::router {
namespace {

using RS = RouterCounterSpec<RouterCounters>;
using PS = RouterCounterSpec<ReplicaCounters>;

constexpr RS kRouterSpecs[] = {
    {"specontext_router_requests_total", "counter", "requests read whole", &RouterCounters::requests},
    {"specontext_router_proxied_total", "counter", "requests answered by a replica (any status)",
     &RouterCounters::proxied},
    {"specontext_router_retries_total", "counter",
     "tries on another replica after one failed before any byte reached the client", &RouterCounters::retries},
    {"specontext_router_unavailable_total", "counter", "requests answered 503: no replica could take them",
     &RouterCounters::unavailable},
    {"specontext_router_rejected_total", "counter",
     "requests answered 4xx by the router (unreadable, too large, unknown route)", &RouterCounters::rejected},
    {"specontext_router_failed_mid_answer_total", "counter",
     "answers a replica broke off after bytes reached the client (streams end with an error event)",
     &RouterCounters::failed_mid_answer},
    {"specontext_router_client_gone_total", "counter", "clients that went away while their answer was relayed",
     &RouterCounters::client_gone},
    {"specontext_router_prefix_lookups_total", "counter", "requests routed by their prompt's prefix",
     &RouterCounters::prefix_lookups},
    {"specontext_router_prefix_hits_total", "counter",
     "of those, sent to the replica holding a long enough prefix", &RouterCounters::prefix_hits},
    {"specontext_router_prefix_overloaded_total", "counter",
     "long enough prefix matches whose replica was too loaded (least-load chose)",
     &RouterCounters::prefix_overloaded},
    {"specontext_router_prefix_prompt_chunks_total", "counter", "prompt chunks hashed for prefix routing",
     &RouterCounters::prefix_prompt_chunks},
    {"specontext_router_prefix_matched_chunks_total", "counter",
     "of those, believed cached on the chosen replica", &RouterCounters::prefix_matched_chunks},
    {"specontext_router_body_parse_errors_total", "counter",
     "bodies whose prompt could not be read for prefix routing (least-load chose)",
     &RouterCounters::body_parse_errors},
    {"specontext_router_health_checks_total", "counter", "health probes sent to replicas",
     &RouterCounters::health_checks},
    {"specontext_router_open_connections", "gauge", "client connections open", &RouterCounters::open_connections},
    {"specontext_router_connections_refused_total", "counter",
     "connections refused at the connection limit (503)", &RouterCounters::connections_refused},
    {"specontext_router_header_timeouts_total", "counter",
     "connections closed because a request header did not come whole in time", &RouterCounters::header_timeouts},
    {"specontext_router_tls_handshake_failures_total", "counter", "connections whose TLS handshake failed",
     &RouterCounters::tls_handshake_failures},
    {"specontext_router_replicas_up", "gauge", "replicas taking requests", &RouterCounters::replicas_up},
};
static_assert(sizeof(RouterCounters) == std::size(kRouterSpecs) * sizeof(int64_t),
              "every RouterCounters field needs its row in kRouterSpecs");

constexpr PS kReplicaSpecs[] = {
    {"specontext_router_replica_chosen_total", "counter", "tries sent to the replica", &ReplicaCounters::chosen},
    {"specontext_router_replica_answered_total", "counter", "tries the replica answered (any status)",
     &ReplicaCounters::answered},
    {"specontext_router_replica_failures_total", "counter",
     "tries that failed at the connection (refused, reset, timed out)", &ReplicaCounters::failures},
    {"specontext_router_replica_marked_down_total", "counter", "times the replica was marked down",
     &ReplicaCounters::marked_down},
    {"specontext_router_replica_prefix_hits_total", "counter", "requests sent for a long enough prefix match",
     &ReplicaCounters::prefix_hits},
    {"specontext_router_replica_in_flight", "gauge", "requests in flight on the replica",
     &ReplicaCounters::in_flight},
    {"specontext_router_replica_up", "gauge", "1 when the replica takes requests, 0 when marked down",
     &ReplicaCounters::up},
};
static_assert(sizeof(ReplicaCounters) == std::size(kReplicaSpecs) * sizeof(int64_t),
              "every ReplicaCounters field needs its row in kReplicaSpecs");

// A Prometheus label value: backslash, double quote and newline escaped.
std::string label_value(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '\\' || ch == '"') out += '\\';
    if (ch == '\n') {
      out += "\\n";
      continue;
    }
    out += ch;
  }
  return out;
}

}  // namespace

std::span<const RS> router_counter_specs() { return kRouterSpecs; }
std::span<const PS> replica_counter_specs() { return kReplicaSpecs; }

double prefix_hit_rate(const RouterCounters& c) {
  return c.prefix_lookups > 0 ? static_cast<double>(c.prefix_hits) / static_cast<double>(c.prefix_lookups) : 0.0;
}

std::string render_router_prometheus(const RouterCounters& c, const std::vector<ReplicaSnapshot>& replicas) {
  std::string out;
  auto head = [&](const std::string& name, const char* type, const char* help) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  for (const RS& s : kRouterSpecs) {
    head(s.prom_name, s.prom_type, s.help);
    out += std::string(s.prom_name) + " " + std::to_string(c.*s.field) + "\n";
  }
  head("specontext_router_prefix_hit_rate", "gauge", "prefix_hits / prefix_lookups (0 before any lookup)");
  char rate[32];
  std::snprintf(rate, sizeof(rate), "%.6f", prefix_hit_rate(c));
  out += std::string("specontext_router_prefix_hit_rate ") + rate + "\n";
  for (const PS& s : kReplicaSpecs) {
    head(s.prom_name, s.prom_type, s.help);
    for (const ReplicaSnapshot& r : replicas) {
      out += std::string(s.prom_name) + "{replica=\"" + label_value(r.name) + "\"} " +
             std::to_string(r.counters.*s.field) + "\n";
    }
  }
  return out;
}

}  // namespace specontext::router
