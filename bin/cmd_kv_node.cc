// specontext kv-node: a remote KV node in its own process (cluster/kv_node.h). Prints one JSON line
// when it listens ({"event":"listening","node":...,"port":...,"auth":...}), then serves until
// SIGINT/SIGTERM. The shared secret comes from --secret-file or SPECONTEXT_KV_SECRET, never from a
// flag's value; without one the node warns on stderr and listens on loopback only.
#include <csignal>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bin/commands.h"
#include "planner/units.h"
#if SPECONTEXT_HAVE_UCX
#include "cluster/kv_node.h"
#endif

namespace specontext::cli {

void register_kv_node(CLI::App& app, KvNodeArgs& a) {
  CLI::App* cmd = app.add_subcommand("kv-node", "serve a remote KV node (UCX data plane, TCP control plane)");
  cmd->add_option("--listen", a.listen, "HOST:PORT to listen on (port 0: any free port, printed at start)");
  cmd->add_option("--capacity", a.capacity, "bytes of KV memory this node holds (e.g. 4GiB)")->required();
  cmd->add_option("--name", a.name, "name in replies and messages (default HOST:PORT)");
  cmd->add_option("--secret-file", a.secret_file,
                  "file holding the shared secret clients must prove at hello (owner-readable only; default: "
                  "the SPECONTEXT_KV_SECRET environment variable; without either, loopback only)");
  cmd->add_option("--keys-file", a.keys_file,
                  "per-client identities, one per line 'ID SECRET QUOTA [MAX_CONNECTIONS]' (owner-readable "
                  "only; default: the SPECONTEXT_KV_KEYS_FILE environment variable): each client answers "
                  "with its own secret (engines' --kv-client-id), holds at most its QUOTA across all its "
                  "connections (e.g. 1GiB; 0: up to the capacity) and sees only its own usage");
  cmd->add_option("--tls-cert", a.tls_cert_file,
                  "PEM certificate chain: the control plane speaks TLS 1.2+ only (clients give "
                  "--kv-node-tls-ca with its CA); the UCX data plane stays unencrypted");
  cmd->add_option("--tls-key", a.tls_key_file, "PEM private key of --tls-cert (not readable by every user)");
  cmd->add_option("--client-quota", a.client_quota,
                  "bytes the shared secret's client (on a node without secret or keys: all connections "
                  "together) may hold at once (e.g. 1GiB; default: up to the capacity)");
  cmd->add_option("--max-connections", a.max_connections, "connections served at once; the next is refused")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--idle-timeout-ms", a.idle_timeout_ms,
                  "close a connection that sends no request for this long while holding no region (0: never)")
      ->check(CLI::NonNegativeNumber);
}

int run_kv_node(const KvNodeArgs& a) {
#if SPECONTEXT_HAVE_UCX
  auto fail = [](const Status& s) {
    std::cerr << "specontext kv-node: " << s.to_string() << "\n";
    return 1;
  };
  auto ep = cluster::parse_endpoint(a.listen, /*allow_any_port=*/true);
  if (!ep.is_ok()) return fail(ep.status().with_context("--listen"));
  auto cap = planner::parse_size(a.capacity);
  if (!cap.is_ok()) return fail(cap.status().with_context("--capacity"));
  if (*cap <= 0) return fail(invalid_argument("--capacity must be positive"));
  int64_t quota = 0;
  if (!a.client_quota.empty()) {
    auto q = planner::parse_size(a.client_quota);
    if (!q.is_ok()) return fail(q.status().with_context("--client-quota"));
    if (*q <= 0) return fail(invalid_argument("--client-quota must be positive"));
    quota = *q;
  }
  auto secret = cluster::load_kv_secret(a.secret_file);
  if (!secret.is_ok()) return fail(secret.status().with_context("--secret-file"));
  auto keys = cluster::load_kv_keys(a.keys_file);
  if (!keys.is_ok()) return fail(keys.status().with_context("--keys-file"));
  if (secret->empty() && keys->empty()) {
    std::cerr << "specontext kv-node: WARNING: no secret (--secret-file PATH or " << cluster::kSecretEnv
              << ") and no keys file (--keys-file PATH or " << cluster::kKeysFileEnv
              << "): any local process can allocate this node's memory; listening on loopback only\n";
  }
  // Block the stop signals before the node's threads start, so that they inherit the mask and
  // only sigwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  cluster::KvNodeOptions o;
  o.host = ep->host;
  o.port = ep->port;
  o.capacity = static_cast<uint64_t>(*cap);
  o.name = a.name;
  o.secret = std::move(secret).value();
  o.clients = std::move(keys).value();
  o.tls_cert_file = a.tls_cert_file;
  o.tls_key_file = a.tls_key_file;
  o.client_quota = static_cast<uint64_t>(quota);
  o.max_connections = a.max_connections;
  o.idle_timeout = std::chrono::milliseconds(a.idle_timeout_ms);
  auto node = cluster::KvNode::start(o);
  if (!node.is_ok()) return fail(node.status());
  std::cout << nlohmann::json{{"event", "listening"},
                              {"node", (*node)->name()},
                              {"port", (*node)->port()},
                              {"capacity", o.capacity},
                              {"auth", o.secret.empty() && o.clients.empty() ? "none" : "hmac-sha256"},
                              {"clients", o.clients.size()},
                              {"tls", !o.tls_cert_file.empty()}}
                   .dump()
            << std::endl;
  int sig = 0;
  sigwait(&stop_signals, &sig);
  const cluster::KvNodeStats st = (*node)->stats();
  (*node)->stop();
  std::cout << nlohmann::json{{"event", "stopped"},
                              {"signal", sig},
                              {"requests", st.requests},
                              {"bad_requests", st.bad_requests},
                              {"auth_failures", st.auth_failures},
                              {"connections_refused", st.connections_refused},
                              {"tls_failures", st.tls_failures},
                              {"regions", st.regions}}
                   .dump()
            << std::endl;
  return 0;
#else
  (void)a;
  std::cerr << "specontext kv-node: this build has no UCX (install libucx-dev and rebuild)\n";
  return 1;
#endif
}

}  // namespace specontext::cli
