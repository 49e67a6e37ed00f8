// specontext kv-node: a remote KV node in its own process (cluster/kv_node.h). Prints one JSON line
// when it listens ({"event":"listening","node":...,"port":...}), then serves until SIGINT/SIGTERM.
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
  auto node = cluster::KvNode::start(o);
  if (!node.is_ok()) return fail(node.status());
  std::cout << nlohmann::json{{"event", "listening"},
                              {"node", (*node)->name()},
                              {"port", (*node)->port()},
                              {"capacity", o.capacity}}
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
