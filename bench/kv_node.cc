// The remote KV node's data path, node-side gather (UcxTransferMode::kNodeGather), for scattered
// rows (what elastic loading moves) and contiguous blocks (layer migrations), reads and writes.
// One-sided RMA is refused (cluster/README.md: a node hands out no remote keys); the JSON says
// why in "rma_refused". Against an in-process node (default) or a running `specontext kv-node`
// (--node HOST:PORT). Also the stall of bringing a dead replica back: the time
// UcxRemoteTransport::rejoin takes to copy the whole tier into a new region (in-process nodes).
// Prints JSON (and --plot: PNG via plot_kv_node.py).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#if SPECONTEXT_HAVE_UCX
#include "cluster/kv_node.h"
#include "cluster/kv_node_client.h"
#include "transport/ucx_transport.h"
#endif

namespace {

#if SPECONTEXT_HAVE_UCX
using namespace specontext;
using Clock = std::chrono::steady_clock;

constexpr TierId kLocal{1};
constexpr TierId kRemote{2};

Result<double> timed(Transport& t, const TransferBatch& batch) {
  SPX_ASSIGN_OR_RETURN(TransferHandle h, t.prepare(batch));
  const auto t0 = Clock::now();
  Status s = t.post(h);
  while (s.code() == StatusCode::kInProgress) {
    std::this_thread::yield();
    s = t.poll(h);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t.release(h);
  if (!s.is_ok()) return s;
  return seconds;
}

int run(const std::string& node_endpoint, int64_t rows, const std::vector<int64_t>& row_sizes, int repeats,
        const std::string& out_path, bool plot) {
  const uint64_t max_row = static_cast<uint64_t>(*std::max_element(row_sizes.begin(), row_sizes.end()));
  const uint64_t contiguous = uint64_t{16} << 20;
  const uint64_t remote_bytes = std::max<uint64_t>(2 * max_row * static_cast<uint64_t>(rows), contiguous);
  std::unique_ptr<cluster::KvNode> local_node;
  cluster::Endpoint ep;
  if (node_endpoint.empty()) {
    cluster::KvNodeOptions o;
    o.capacity = 2 * remote_bytes + (1 << 20);
    auto n = cluster::KvNode::start(o);
    if (!n.is_ok()) {
      std::cerr << "bench_kv_node: " << n.status().to_string() << "\n";
      return 1;
    }
    local_node = std::move(n).value();
    ep = {"127.0.0.1", local_node->port()};
  } else {
    auto e = cluster::parse_endpoint(node_endpoint);
    if (!e.is_ok()) {
      std::cerr << "bench_kv_node: --node: " << e.status().to_string() << "\n";
      return 1;
    }
    ep = *e;
  }
  nlohmann::json results = nlohmann::json::array();
  std::string rma_refused;
  for (int run = 0; run < 2; ++run) {
    const auto mode = transport::UcxTransferMode::kNodeGather;
    const char* mode_name = "gather";
    auto client = cluster::KvNodeClient::connect(ep);
    if (!client.is_ok()) {
      std::cerr << "bench_kv_node: " << client.status().to_string() << "\n";
      return 1;
    }
    auto region = (*client)->allocate(remote_bytes);
    if (!region.is_ok()) {
      std::cerr << "bench_kv_node: " << region.status().to_string() << "\n";
      return 1;
    }
    transport::UcxRemoteConfig cfg{kRemote, {*region}, std::chrono::milliseconds(10000), mode};
    if (run == 0) {
      transport::UcxRemoteConfig rma = cfg;
      rma.mode = transport::UcxTransferMode::kRma;
      auto refused = transport::UcxRemoteTransport::create(rma);
      rma_refused = refused.is_ok() ? "" : refused.status().message();
      if (!rma_refused.empty()) std::cerr << "bench_kv_node: rma: " << rma_refused << "\n";
    }
    auto t = transport::UcxRemoteTransport::create(cfg);
    if (!t.is_ok()) {
      std::cerr << "bench_kv_node: " << t.status().to_string() << "\n";
      return 1;
    }
    std::vector<uint8_t> local(remote_bytes, 1);
    Status reg = (*t)->register_tier(kLocal, MemoryKind::kHost, local.data(), local.size());
    if (reg.is_ok()) reg = (*t)->register_tier(kRemote, MemoryKind::kRemote, nullptr, remote_bytes);
    if (!reg.is_ok()) {
      std::cerr << "bench_kv_node: " << reg.to_string() << "\n";
      return 1;
    }
    auto measure = [&](const std::string& pattern, bool read, uint64_t row, int64_t n,
                       const TransferBatch& batch) {
      std::vector<double> times;
      for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up (connection, pages)
        auto s = timed(**t, batch);
        if (!s.is_ok()) {
          std::cerr << "bench_kv_node: " << s.status().to_string() << "\n";
          std::exit(1);
        }
        if (r > 0) times.push_back(*s);
      }
      std::sort(times.begin(), times.end());
      const double median = times[times.size() / 2];
      const double bytes = static_cast<double>(row) * static_cast<double>(n);
      results.push_back({{"mode", mode_name},
                         {"pattern", pattern},
                         {"direction", read ? "read" : "write"},
                         {"row_bytes", row},
                         {"rows", n},
                         {"bytes", bytes},
                         {"median_seconds", median},
                         {"gb_per_s", bytes / median / 1e9},
                         {"us_per_row", median * 1e6 / static_cast<double>(n)}});
      std::fprintf(stderr, "%-6s %-10s %-5s row %6lu x %6ld: %8.3f ms  %7.3f GB/s  %7.2f us/row\n", mode_name,
                   pattern.c_str(), read ? "read" : "write", static_cast<unsigned long>(row),
                   static_cast<long>(n), median * 1e3, bytes / median / 1e9,
                   median * 1e6 / static_cast<double>(n));
    };
    for (int64_t rb : row_sizes) {
      const uint64_t row = static_cast<uint64_t>(rb);
      for (bool read : {true, false}) {
        // Every other row of the node's memory, into consecutive local rows: nothing merges.
        TransferBatch batch;
        for (int64_t i = 0; i < rows; ++i) {
          const uint64_t remote = static_cast<uint64_t>(i) * 2 * row, here = static_cast<uint64_t>(i) * row;
          batch.push_back(read ? TransferRequest{kRemote, remote, kLocal, here, row}
                               : TransferRequest{kLocal, here, kRemote, remote, row});
        }
        measure("scattered", read, row, rows, batch);
      }
    }
    for (bool read : {true, false}) {
      const TransferBatch one{read ? TransferRequest{kRemote, 0, kLocal, 0, contiguous}
                                   : TransferRequest{kLocal, 0, kRemote, 0, contiguous}};
      measure("contiguous", read, contiguous, 1, one);
    }
  }
  // Rejoin: a tier mirrored on the node and on a second in-process node that then stops; a third
  // takes the dead replica's place, and rejoin copies the whole tier into it from the node.
  nlohmann::json rejoins = nlohmann::json::array();
  for (int run = 0; run < 2; ++run) {
    const auto mode = transport::UcxTransferMode::kNodeGather;
    const bool overlap = run % 2 == 0;  // side by side: reads overlapped with writes, and not
    const char* mode_name = "gather";
    auto fail = [](const Status& s) {
      std::cerr << "bench_kv_node: rejoin: " << s.to_string() << "\n";
      std::exit(1);
    };
    cluster::KvNodeOptions o;
    o.capacity = remote_bytes + (1 << 20);
    auto doomed = cluster::KvNode::start(o);
    auto heir = cluster::KvNode::start(o);
    if (!doomed.is_ok()) fail(doomed.status());
    if (!heir.is_ok()) fail(heir.status());
    auto c_main = cluster::KvNodeClient::connect(ep);
    auto c_doomed = cluster::KvNodeClient::connect({"127.0.0.1", (*doomed)->port()});
    auto c_heir = cluster::KvNodeClient::connect({"127.0.0.1", (*heir)->port()});
    if (!c_main.is_ok() || !c_doomed.is_ok() || !c_heir.is_ok()) fail(unavailable("cannot reach the nodes"));
    auto r_main = (*c_main)->allocate(remote_bytes);
    auto r_doomed = (*c_doomed)->allocate(remote_bytes);
    auto r_heir = (*c_heir)->allocate(remote_bytes);
    if (!r_main.is_ok() || !r_doomed.is_ok() || !r_heir.is_ok()) fail(resource_exhausted("cannot allocate"));
    transport::UcxRemoteConfig cfg{kRemote, {*r_main, *r_doomed}, std::chrono::milliseconds(10000), mode};
    cfg.rejoin_overlap = overlap;
    auto t = transport::UcxRemoteTransport::create(cfg);
    if (!t.is_ok()) fail(t.status());
    std::vector<uint8_t> local(remote_bytes, 3);
    Status reg = (*t)->register_tier(kLocal, MemoryKind::kHost, local.data(), local.size());
    if (reg.is_ok()) reg = (*t)->register_tier(kRemote, MemoryKind::kRemote, nullptr, remote_bytes);
    if (!reg.is_ok()) fail(reg);
    (*doomed)->stop();
    // A write finds the stopped node dead (a reset), as the engine's next step would.
    auto w = timed(**t, {TransferRequest{kLocal, 0, kRemote, 0, remote_bytes}});
    if (!w.is_ok()) fail(w.status());
    const auto t0 = Clock::now();
    if (Status s = (*t)->rejoin(1, *r_heir); !s.is_ok()) fail(s);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double bytes = static_cast<double>(remote_bytes);
    rejoins.push_back({{"mode", mode_name},
                       {"overlap", overlap},
                       {"tier_bytes", remote_bytes},
                       {"seconds", seconds},
                       {"gb_per_s", bytes / seconds / 1e9}});
    std::fprintf(stderr, "%-6s rejoin of a %lu-byte tier (%s): %8.3f ms  %7.3f GB/s\n", mode_name,
                 static_cast<unsigned long>(remote_bytes), overlap ? "overlapped" : "one chunk at a time",
                 seconds * 1e3, bytes / seconds / 1e9);
  }
  nlohmann::json doc = {{"node", ep.text()},
                        {"in_process_node", local_node != nullptr},
                        {"ucx_tls", std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "tcp"},
                        {"repeats", repeats},
                        {"rma_refused", rma_refused},
                        {"results", results},
                        {"rejoin", rejoins}};
  std::cout << doc.dump(2) << "\n";
  if (!out_path.empty()) {
    std::ofstream(out_path) << doc.dump(2) << "\n";
    if (plot) {
      const std::string cmd = std::string("/usr/bin/python3 '") + SPECONTEXT_SOURCE_DIR +
                              "/bench/plot_kv_node.py' '" + out_path + "'";
      if (std::system(cmd.c_str()) != 0) std::cerr << "bench_kv_node: plotting failed\n";
    }
  }
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"remote KV node data path: node-side gather (one-sided RMA is refused)"};
  std::string node, out;
  int64_t rows = 16384;
  std::vector<int64_t> row_sizes{128, 512, 4096};
  int repeats = 5;
  bool plot = false;
  app.add_option("--node", node, "HOST:PORT of a running specontext kv-node (default: one in this process)");
  app.add_option("--rows", rows, "rows per scattered batch")->check(CLI::PositiveNumber);
  app.add_option("--row-bytes", row_sizes, "row sizes (bytes)")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "timed repeats (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--out", out, "JSON file");
  app.add_flag("--plot", plot, "PNG beside --out (plot_kv_node.py)");
  CLI11_PARSE(app, argc, argv);
#if SPECONTEXT_HAVE_UCX
  return run(node, rows, row_sizes, repeats, out, plot);
#else
  std::cerr << "bench_kv_node: this build has no UCX (install libucx-dev and rebuild)\n";
  return 1;
#endif
}
