// specontext router: the OpenAI API in front of N `specontext serve` replicas
// (serving/router/router.h). Prints one JSON line when it listens ({"event":"listening","port":P,
// ...}), routes until SIGINT/SIGTERM, then prints its counters ({"event":"stopped",...}).
#include <csignal>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bin/commands.h"
#include "serving/router/router.h"

namespace specontext::cli {

void register_router(CLI::App& app, RouterArgs& a) {
  CLI::App* cmd = app.add_subcommand(
      "router", "route OpenAI API requests to `serve` replicas (round-robin, least-load or prefix-aware)");
  cmd->add_option("--replica", a.replicas, "a replica's http://HOST:PORT (repeatable, at least one)")->required();
  cmd->add_option("--policy", a.policy,
                  "rr (round-robin), least-load (fewest requests in flight) or prefix (the replica holding "
                  "the longest prefix of the prompt, least-load when the match is short or it is overloaded)")
      ->check(CLI::IsMember({"rr", "round-robin", "least-load", "prefix"}))
      ->capture_default_str();
  cmd->add_option("--host", a.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", a.port, "port to listen on (0: any free port, printed at start)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--prefix-chunk-bytes", a.chunk_bytes, "prefix policy: bytes of prompt text per hashed chunk")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--prefix-match-ratio", a.match_ratio,
                  "prefix policy: least share of the prompt's chunks a replica must match to be chosen by it")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--balance-threshold", a.balance_threshold,
                  "prefix policy: requests in flight beyond the least loaded replica past which a match is "
                  "overruled by least-load")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--health-interval", a.health_interval, "seconds between health checks of every replica (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--connect-timeout", a.connect_timeout, "seconds a replica may take to accept a connection")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--upstream-timeout", a.upstream_timeout,
                  "seconds a replica may stay silent in an answer (a non-streamed answer: all of it)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--max-connections", a.max_connections,
                  "client connections at once; one more is answered 503 and closed (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", a.max_body_bytes, "largest request body (more: 413)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  add_api_key_options(*cmd, a.api_key, "the header is passed on to the replicas");
  cmd->add_option("--tls-cert", a.tls_cert, "PEM certificate chain: HTTPS towards clients (with --tls-key)");
  cmd->add_option("--tls-key", a.tls_key, "PEM private key of --tls-cert");
}

int run_router(const RouterArgs& a) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
    return 1;
  };
  router::RouterOptions o;
  o.host = a.host;
  o.port = static_cast<uint16_t>(a.port);
  for (const std::string& url : a.replicas) {
    auto r = router::parse_replica_url(url);
    if (!r.is_ok()) return fail(r.status().with_context("--replica"));
    o.replicas.push_back(*r);
  }
  o.policy.policy = *router::parse_policy(a.policy);
  o.policy.chunk_bytes = static_cast<size_t>(a.chunk_bytes);
  o.policy.match_ratio = a.match_ratio;
  o.policy.balance_abs_threshold = a.balance_threshold;
  auto ms = [](double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); };
  o.health_interval = ms(a.health_interval);
  o.connect_timeout = ms(a.connect_timeout);
  o.upstream_timeout = ms(a.upstream_timeout);
  o.max_connections = static_cast<size_t>(a.max_connections);
  o.max_body_bytes = static_cast<size_t>(a.max_body_bytes);
  {
    auto keys = api_keys_of(a.api_key);
    if (!keys.is_ok()) return fail(keys.status());
    o.api_keys = std::move(*keys);
  }
  o.tls_cert_file = a.tls_cert;
  o.tls_key_file = a.tls_key;
  // The stop signals blocked before the router's threads start: only sigwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  auto r = router::Router::start(o);
  if (!r.is_ok()) return fail(r.status());
  nlohmann::json replicas = nlohmann::json::array();
  for (const auto& u : o.replicas) replicas.push_back(u.name());
  nlohmann::json listening{{"event", "listening"},        {"host", o.host},
                           {"port", (*r)->port()},        {"policy", router::policy_name(o.policy.policy)},
                           {"replicas", replicas},        {"api_key_required", !o.api_keys.empty()}};
  if (!o.tls_cert_file.empty()) listening["tls"] = true;
  std::cout << listening.dump() << std::endl;
  int sig = 0;
  sigwait(&stop_signals, &sig);
  (*r)->stop();
  const router::RouterCounters c = (*r)->counters();
  nlohmann::json stopped{{"event", "stopped"},
                         {"signal", sig},
                         {"requests", c.requests},
                         {"proxied", c.proxied},
                         {"retries", c.retries},
                         {"unavailable", c.unavailable},
                         {"failed_mid_answer", c.failed_mid_answer},
                         {"prefix_hit_rate", router::prefix_hit_rate(c)}};
  std::cout << stopped.dump() << std::endl;
  return 0;
}

}  // namespace specontext::cli
