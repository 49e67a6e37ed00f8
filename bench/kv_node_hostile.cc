// A normal kv-node client's latency and data while hostile clients attack the node (issue #26's
// load and fault figures for the KV node; bench_hostile_load has them for the HTTP server). The
// node is a `specontext kv-node` process (its RSS read from /proc), guarded by a secret file, with
// a connection limit and an idle timeout. C normal clients each hold one region and repeat, op by
// op: alloc (a 64 KiB region) and free it, scatter (--rows scattered rows of --row-bytes, a new
// pattern each time, through UcxRemoteTransport's node-side scatter) and gather (read them back and
// compared byte for byte with what was written: a mismatch is a corrupted read). First alone
// (baseline), then while attackers of every kind below hammer the node, each repeating its attack
// until the phase ends, pausing --attack-interval between attacks.
//
// Attack kinds (what the node must do):
//   idle           connect, send nothing                        closed at the idle timeout
//   reconnect      authenticate, alloc 16 KiB, drop unfreed     region freed with the connection
//   malformed      hello, then lines of bad JSON / bad fields   an error line each, served on
//   overlong       a 96 KiB line                                closed (lines stop at 64 KiB)
//   byte_at_a_time hello sent a byte per 5 ms                   answered once
//   wrong_secret   authenticate with another secret             refused, counted, logged
//   forged_key     own region, its key off in one bit           gather and scatter refused
//   out_of_region  own region, a range past its end / the pool  gather and scatter refused
//   conn_flood     --flood connections at once (one thread)     past --max-connections refused
//                                                               with a line; the rest idle-closed
// Reported: per op p50/p99 (ms) in both phases, ops failed and reads corrupted, per attack kind the
// outcomes seen (a forged or out-of-region transfer that succeeds is a "breach"), the node's RSS
// before, after the baseline, at its peak and after the attack, its stop line (counters), and
// whether a new client is served afterwards.
//
//   build/release/bench/bench_kv_node_hostile --out bench_out/kv_node_hostile.json
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <vector>

#include "bench/lib/report.h"
#include "bench/lib/sse_client.h"

#if SPECONTEXT_HAVE_UCX
#include "cluster/control_protocol.h"
#include "cluster/kv_node_client.h"
#include "transport/ucx_transport.h"
#endif

namespace {

#if SPECONTEXT_HAVE_UCX
using namespace specontext;
using Clock = std::chrono::steady_clock;
using bench::percentile;
using transport::RemoteRegion;
using transport::UcxRemoteConfig;
using transport::UcxRemoteTransport;
using transport::UcxTransferMode;

constexpr TierId kLocal{1};
constexpr TierId kRemote{2};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A `specontext kv-node` child: its port from the first line it prints, its stop line at the end.
class NodeProcess {
 public:
  bool start(const std::string& binary, const std::vector<std::string>& flags, const std::string& stderr_path) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    std::vector<std::string> args = {binary, "kv-node"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (err >= 0) dup2(err, STDERR_FILENO);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[1024];
    if (out_ == nullptr || fgets(line, sizeof line, out_) == nullptr) return false;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("port")) return false;
    port_ = j["port"].get<uint16_t>();
    return true;
  }
  ~NodeProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
  }
  uint16_t port() const { return port_; }
  bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0; }
  // VmRSS in MiB (0 when the process is gone).
  double rss_mib() const {
    std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
    }
    return 0;
  }
  // SIGTERM; the exit code and the stop line.
  std::pair<int, nlohmann::json> stop() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    std::string rest;
    char line[1024];
    while (out_ != nullptr && fgets(line, sizeof line, out_) != nullptr) rest += line;
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, nlohmann::json::parse(rest, nullptr, false)};
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  uint16_t port_ = 0;
};

// A raw control connection (no hello) to 127.0.0.1:port, reads bounded by `timeout_ms`.
class Raw {
 public:
  Raw(uint16_t port, int timeout_ms) : timeout_ms_(timeout_ms) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~Raw() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  bool send(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  // "line" (a whole reply line; in `got`), "closed" (end of stream or reset) or "timeout".
  std::string read_line(std::string* got = nullptr) {
    std::string text;
    char c = 0;
    while (true) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, timeout_ms_) != 1) return "timeout";
      if (::recv(fd_, &c, 1, 0) != 1) return "closed";
      if (c == '\n') break;
      text.push_back(c);
    }
    if (got) *got = text;
    return "line";
  }

 private:
  int fd_ = -1;
  int timeout_ms_;
};

// A connection the node refused because its limit is reached (the line it sends, or the error a
// client makes of it).
bool past_limit(const std::string& text) { return text.find("connection limit") != std::string::npos; }

// What each attack kind saw: outcome -> count.
struct Tally {
  std::mutex mu;
  std::map<std::string, std::map<std::string, int64_t>> seen;
  void add(const std::string& kind, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    ++seen[kind][what];
  }
};

// Runs one batch to completion.
Status run_batch(Transport& t, const TransferBatch& batch) {
  SPX_ASSIGN_OR_RETURN(TransferHandle h, t.prepare(batch));
  Status s = t.post(h);
  while (s.code() == StatusCode::kInProgress) {
    std::this_thread::yield();
    s = t.poll(h);
  }
  t.release(h);
  return s;
}

struct Shape {
  int64_t rows = 64;
  uint64_t row_bytes = 1024;
  uint64_t region_bytes() const { return 2 * static_cast<uint64_t>(rows) * row_bytes; }  // every other row
};

// One normal client: its connection, its region and a transport over it.
struct NormalClient {
  std::unique_ptr<cluster::KvNodeClient> control;
  std::unique_ptr<UcxRemoteTransport> data;
  std::vector<uint8_t> out, in;  // what is scattered, where gathers land
  Status open(const cluster::Endpoint& ep, const std::string& secret, const Shape& shape) {
    auto c = cluster::KvNodeClient::connect(ep, std::chrono::seconds(10), secret);
    if (!c.is_ok()) return c.status();
    control = std::move(c).value();
    auto region = control->allocate(shape.region_bytes());
    if (!region.is_ok()) return region.status();
    auto t = UcxRemoteTransport::create(
        UcxRemoteConfig{kRemote, {*region}, std::chrono::milliseconds(10000), UcxTransferMode::kNodeGather});
    if (!t.is_ok()) return t.status();
    data = std::move(t).value();
    const uint64_t local = static_cast<uint64_t>(shape.rows) * shape.row_bytes;
    out.assign(local, 0);
    in.assign(local, 0);
    SPX_RETURN_IF_ERROR(data->register_tier(kLocal, MemoryKind::kHost, out.data(), out.size()));
    SPX_RETURN_IF_ERROR(data->register_tier(TierId(3), MemoryKind::kHost, in.data(), in.size()));
    return data->register_tier(kRemote, MemoryKind::kRemote, nullptr, shape.region_bytes());
  }
};

struct OpTimes {
  std::map<std::string, std::vector<double>> ms;  // op -> latencies of the ops that succeeded
  std::map<std::string, int64_t> failed;
  int64_t corrupted = 0;  // gathers that returned other bytes than the scatter wrote
  int64_t reopened = 0;   // connections re-made after a failure
  int64_t ops = 0;
};

// `iterations` rounds of alloc, free, scatter, gather (verified) by one normal client.
void run_normal(NormalClient& c, const cluster::Endpoint& ep, const std::string& secret, const Shape& shape,
                int64_t iterations, uint32_t seed, OpTimes& t) {
  std::mt19937 rng(seed);
  TransferBatch scatter, gather;
  for (int64_t i = 0; i < shape.rows; ++i) {
    const uint64_t remote = static_cast<uint64_t>(i) * 2 * shape.row_bytes;
    const uint64_t here = static_cast<uint64_t>(i) * shape.row_bytes;
    scatter.push_back({kLocal, here, kRemote, remote, shape.row_bytes});
    gather.push_back({kRemote, remote, TierId(3), here, shape.row_bytes});
  }
  auto timed = [&](const std::string& op, const std::function<Status()>& f) {
    const auto t0 = Clock::now();
    const Status s = f();
    ++t.ops;
    if (s.is_ok()) {
      t.ms[op].push_back(1e3 * seconds_since(t0));
      return true;
    }
    ++t.failed[op];
    std::fprintf(stderr, "normal client: %s failed: %s\n", op.c_str(), s.to_string().c_str());
    return false;
  };
  for (int64_t it = 0; it < iterations; ++it) {
    if (c.control == nullptr || c.data == nullptr) {
      ++t.reopened;
      if (!c.open(ep, secret, shape).is_ok()) {
        ++t.failed["reconnect"];
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
    }
    uint64_t region = 0;
    bool ok = timed("alloc", [&]() -> Status {
      auto r = c.control->allocate(64 << 10);
      if (!r.is_ok()) return r.status();
      region = r->region;
      return Status::ok();
    });
    if (ok) ok = timed("free", [&] { return c.control->free(region); });
    for (auto& b : c.out) b = static_cast<uint8_t>(rng());
    std::fill(c.in.begin(), c.in.end(), 0);
    if (ok) ok = timed("scatter", [&] { return run_batch(*c.data, scatter); });
    if (ok) ok = timed("gather", [&] { return run_batch(*c.data, gather); });
    if (ok && c.in != c.out) ++t.corrupted;
    if (!ok) {  // start again on a new connection and region
      c.data.reset();
      c.control.reset();
    }
  }
}

struct Attack {
  uint16_t port;
  const std::string& secret;
  const std::atomic<bool>& stop;
  Tally& tally;
  int timeout_ms;
  int flood = 0;  // conn_flood's connections

  bool pause(double s) {
    const auto until = Clock::now() + std::chrono::duration<double>(s);
    while (Clock::now() < until) {
      if (stop) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return !stop;
  }

  // A transfer through a transport over `region`, which the node must refuse.
  void refused_transfer(const std::string& kind, const RemoteRegion& region, uint64_t offset) {
    auto spy = UcxRemoteTransport::create(
        UcxRemoteConfig{kRemote, {region}, std::chrono::milliseconds(5000), UcxTransferMode::kNodeGather});
    if (!spy.is_ok()) {
      tally.add(kind, "transport_refused");
      return;
    }
    std::vector<uint8_t> host(4096, 0x5a);
    if (!(*spy)->register_tier(kLocal, MemoryKind::kHost, host.data(), host.size()).is_ok() ||
        !(*spy)->register_tier(kRemote, MemoryKind::kRemote, nullptr, region.bytes).is_ok()) {
      tally.add(kind, "register_refused");
      return;
    }
    for (const bool read : {true, false}) {
      const TransferRequest r =
          read ? TransferRequest{kRemote, offset, kLocal, 0, 4096} : TransferRequest{kLocal, 0, kRemote, offset, 4096};
      const Status s = run_batch(**spy, {r});
      const char* dir = read ? "gather" : "scatter";
      if (s.is_ok())
        tally.add(kind, std::string(dir) + "_breach");
      else if (s.code() == StatusCode::kDataLoss && s.message().find("refused") != std::string::npos)
        tally.add(kind, std::string(dir) + "_refused");
      else
        tally.add(kind, std::string(dir) + "_error");
    }
  }

  // Why KvNodeClient::connect failed, in a word.
  static std::string refusal(const Status& s) {
    if (past_limit(s.message())) return "refused_past_limit";
    if (s.message().find("authentication failed") != std::string::npos) return "auth_refused";
    return "connect_error";
  }

  void once(const std::string& kind, std::mt19937& rng) {
    const cluster::Endpoint ep{"127.0.0.1", port};
    if (kind == "idle") {
      Raw r(port, timeout_ms);
      if (!r.ok()) return tally.add(kind, "connect_failed");
      std::string line;
      const std::string got = r.read_line(&line);
      // A refusal past the connection limit comes as a line, then the close.
      tally.add(kind, got == "line" ? (past_limit(line) ? "refused_past_limit" : "other_line")
                      : got == "closed" ? "closed_by_node" : "timeout");
    } else if (kind == "reconnect") {
      auto c = cluster::KvNodeClient::connect(ep, std::chrono::seconds(10), secret);
      if (!c.is_ok()) return tally.add(kind, refusal(c.status()));
      tally.add(kind, (*c)->allocate(16 << 10).is_ok() ? "alloc_then_dropped" : "alloc_refused");
    } else if (kind == "malformed") {
      Raw r(port, timeout_ms);
      if (!r.ok()) return tally.add(kind, "connect_failed");
      static const char* lines[] = {"not json", "[1,2]", R"({"op":7})", R"({"op":"dance"})",
                                    R"({"op":"alloc","bytes":-5})", R"({"op":"hello","version":"2"})",
                                    "{\"op\":\"st\\u0000ats\"}", "\xff\xfe{}"};
      for (const char* l : lines) {
        if (!r.send(std::string(l) + "\n")) return tally.add(kind, "closed_by_node");
        std::string line;
        const std::string got = r.read_line(&line);
        if (got != "line") return tally.add(kind, got == "closed" ? "closed_by_node" : "timeout");
        if (past_limit(line)) return tally.add(kind, "refused_past_limit");
        const auto j = nlohmann::json::parse(line, nullptr, false);
        tally.add(kind, j.is_object() && !j.value("ok", true) ? "error_line" : "other_line");
      }
    } else if (kind == "overlong") {
      Raw r(port, timeout_ms);
      if (!r.ok()) return tally.add(kind, "connect_failed");
      r.send(std::string(96 << 10, 'x'));
      std::string line;
      const std::string got = r.read_line(&line);
      tally.add(kind, got == "line" ? (line.find("64 KiB") != std::string::npos ? "refused_64KiB"
                                       : past_limit(line)                      ? "refused_past_limit"
                                                                               : "other_line")
                                    : got == "closed" ? "closed_by_node" : "timeout");
    } else if (kind == "byte_at_a_time") {
      Raw r(port, timeout_ms);
      if (!r.ok()) return tally.add(kind, "connect_failed");
      const std::string line = R"({"op":"hello","version":)" + std::to_string(cluster::kControlVersion) + "}\n";
      for (char ch : line) {
        if (!r.send(std::string(1, ch))) return tally.add(kind, "closed_by_node");
        if (!pause(0.005)) break;
      }
      std::string reply;
      const std::string got = r.read_line(&reply);
      tally.add(kind, got == "line" ? (past_limit(reply) ? "refused_past_limit" : "answered")
                      : got == "closed" ? "closed_by_node" : "timeout");
    } else if (kind == "wrong_secret") {
      auto c = cluster::KvNodeClient::connect(ep, std::chrono::seconds(10),
                                              "not the secret, long enough " + std::to_string(rng()));
      tally.add(kind, c.is_ok() ? "accepted" : refusal(c.status()));
    } else if (kind == "conn_flood") {
      std::vector<std::unique_ptr<Raw>> held;
      for (int i = 0; i < flood && !stop; ++i) {
        auto r = std::make_unique<Raw>(port, timeout_ms);
        if (r->ok())
          held.push_back(std::move(r));
        else
          tally.add(kind, "connect_failed");
      }
      for (auto& r : held) {
        std::string line;
        const std::string got = r->read_line(&line);
        tally.add(kind, got == "line" ? (line.find("ResourceExhausted") != std::string::npos ? "refused_past_limit"
                                                                                            : "other_line")
                                      : got == "closed" ? "closed_by_node" : "timeout");
      }
    } else if (kind == "forged_key" || kind == "out_of_region") {
      auto c = cluster::KvNodeClient::connect(ep, std::chrono::seconds(10), secret);
      if (!c.is_ok()) return tally.add(kind, refusal(c.status()));
      auto region = (*c)->allocate(64 << 10);
      if (!region.is_ok()) return tally.add(kind, "alloc_refused");
      RemoteRegion forged = *region;
      uint64_t offset = 0;
      if (kind == "forged_key") {
        forged.key[rng() % forged.key.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
      } else if (rng() % 2 == 0) {
        forged.bytes *= 2;  // a range running past the end of its own region
        offset = region->bytes - 2048;
      } else {
        forged.address += uint64_t{1} << 30;  // past the end of the pool
      }
      refused_transfer(kind, forged, offset);
    }
  }
};

nlohmann::json summarize(const std::vector<OpTimes>& clients) {
  std::map<std::string, std::vector<double>> ms;
  std::map<std::string, int64_t> failed;
  int64_t corrupted = 0, reopened = 0, ops = 0;
  for (const OpTimes& t : clients) {
    for (const auto& [op, v] : t.ms) ms[op].insert(ms[op].end(), v.begin(), v.end());
    for (const auto& [op, n] : t.failed) failed[op] += n;
    corrupted += t.corrupted;
    reopened += t.reopened;
    ops += t.ops;
  }
  nlohmann::json per_op = nlohmann::json::object();
  for (const char* op : {"alloc", "free", "scatter", "gather"}) {
    per_op[op] = {{"ok", ms[op].size()},
                  {"failed", failed[op]},
                  {"p50_ms", percentile(ms[op], 0.5)},
                  {"p99_ms", percentile(ms[op], 0.99)}};
  }
  int64_t failed_total = 0;
  for (const auto& [op, n] : failed) failed_total += n;
  return {{"ops", ops}, {"failed", failed_total}, {"corrupted_reads", corrupted}, {"reconnects", reopened},
          {"per_op", per_op}};
}

std::vector<OpTimes> run_phase(std::vector<NormalClient>& clients, const cluster::Endpoint& ep,
                               const std::string& secret, const Shape& shape, int64_t iterations, uint32_t seed) {
  std::vector<OpTimes> times(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] {
      run_normal(clients[i], ep, secret, shape, iterations, seed + static_cast<uint32_t>(i), times[i]);
    });
  }
  for (auto& t : threads) t.join();
  return times;
}

int run(const std::string& binary, int64_t n_clients, int64_t iterations, const Shape& shape, int64_t attackers,
        int64_t flood, double interval_s, int64_t idle_timeout_ms, int64_t max_connections, const std::vector<std::string>& only,
        const std::string& out, bool plot) {
  const auto fail = [](const std::string& what) {
    std::fprintf(stderr, "bench_kv_node_hostile: %s\n", what.c_str());
    return 1;
  };
  const std::string dir = std::filesystem::temp_directory_path() / ("kv_node_hostile." + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string secret_path = dir + "/secret", log_path = dir + "/node.stderr";
  std::string secret;
  {
    std::random_device rd;
    for (int i = 0; i < 32; ++i) secret += "0123456789abcdef"[rd() % 16];
    std::ofstream(secret_path) << secret << "\n";
    ::chmod(secret_path.c_str(), 0600);
  }
  const uint64_t capacity = uint64_t{256} << 20;
  NodeProcess node;
  if (!node.start(binary,
                  {"--listen", "127.0.0.1:0", "--capacity", "256MiB", "--secret-file", secret_path,
                   "--max-connections", std::to_string(max_connections), "--idle-timeout-ms",
                   std::to_string(idle_timeout_ms)},
                  log_path))
    return fail("the kv-node did not start (" + binary + "; its stderr: " + log_path + ")");
  const cluster::Endpoint ep{"127.0.0.1", node.port()};
  const double rss_start = node.rss_mib();

  std::vector<NormalClient> clients(static_cast<size_t>(n_clients));
  for (auto& c : clients) {
    const Status s = c.open(ep, secret, shape);
    if (!s.is_ok()) return fail("normal client: " + s.to_string());
  }
  std::atomic<bool> monitor_stop{false};
  std::atomic<double> peak_rss{node.rss_mib()};
  std::thread monitor([&] {
    while (!monitor_stop) {
      const double r = node.rss_mib();
      if (r > peak_rss) peak_rss = r;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });

  std::fprintf(stderr, "baseline: %lld clients x %lld rounds\n", static_cast<long long>(n_clients),
               static_cast<long long>(iterations));
  const auto base = run_phase(clients, ep, secret, shape, iterations, 1);
  const double rss_baseline = node.rss_mib();

  const std::vector<std::string> kinds = {"idle",         "reconnect",  "malformed",     "overlong",  "byte_at_a_time",
                                          "wrong_secret", "forged_key", "out_of_region", "conn_flood"};
  const auto wanted = [&](const std::string& k) {
    return only.empty() || std::find(only.begin(), only.end(), k) != only.end();
  };
  Tally tally;
  std::atomic<bool> attack_stop{false};
  std::vector<std::thread> attack_threads;
  const int read_timeout_ms = static_cast<int>(idle_timeout_ms) + 5000;
  const auto attack_start = Clock::now();
  for (const std::string& kind : kinds) {
    if (!wanted(kind)) continue;
    for (int64_t a = 0; a < (kind == "conn_flood" ? 1 : attackers); ++a) {
      attack_threads.emplace_back([&, kind, a] {
        Attack at{node.port(), secret, attack_stop, tally, read_timeout_ms, static_cast<int>(flood)};
        std::mt19937 r(static_cast<uint32_t>(a) * 7919u + static_cast<uint32_t>(kind.size()));
        while (!attack_stop) {
          at.once(kind, r);
          at.pause(interval_s);
        }
      });
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // let the attack build up
  std::fprintf(stderr, "under attack: %zu attacker threads\n", attack_threads.size());
  const auto attacked = run_phase(clients, ep, secret, shape, iterations, 1000);
  // Hold the attack until the idle kind has met the node's timeout at least twice.
  while (seconds_since(attack_start) < 2e-3 * static_cast<double>(idle_timeout_ms) + 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  attack_stop = true;
  for (auto& t : attack_threads) t.join();
  const double attack_s = seconds_since(attack_start);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the node closes what the attackers left
  const double rss_after = node.rss_mib();

  // Afterwards: each normal client's region still holds its last scatter, and a new client is served.
  int64_t final_corrupted = 0;
  for (auto& c : clients) {
    if (c.data == nullptr) continue;
    TransferBatch gather;
    for (int64_t i = 0; i < shape.rows; ++i)
      gather.push_back({kRemote, static_cast<uint64_t>(i) * 2 * shape.row_bytes, TierId(3),
                        static_cast<uint64_t>(i) * shape.row_bytes, shape.row_bytes});
    std::fill(c.in.begin(), c.in.end(), 0);
    if (!run_batch(*c.data, gather).is_ok() || c.in != c.out) ++final_corrupted;
  }
  NormalClient fresh;
  const bool served_after = fresh.open(ep, secret, shape).is_ok() && fresh.control->allocate(4096).is_ok();
  fresh = NormalClient{};
  for (auto& c : clients) c = NormalClient{};
  monitor_stop = true;
  monitor.join();
  const bool alive = node.alive();
  auto [stop_code, stop_line] = node.stop();
  int64_t logged_auth_failures = 0;
  {
    std::ifstream log(log_path);
    for (std::string line; std::getline(log, line);)
      logged_auth_failures += line.find("authentication failed") != std::string::npos;
  }
  std::filesystem::remove_all(dir);

  nlohmann::json kinds_json = nlohmann::json::object();
  int64_t attacks = 0, breaches = 0;
  for (const auto& [kind, m] : tally.seen) {
    kinds_json[kind] = m;
    for (const auto& [what, n] : m) {
      attacks += n;
      if (what.find("breach") != std::string::npos || what == "accepted") breaches += n;
    }
  }
  nlohmann::json doc = {{"node", {{"capacity", capacity},
                                  {"max_connections", max_connections},
                                  {"idle_timeout_ms", idle_timeout_ms},
                                  {"secret_file", true}}},
                        {"normal_clients", n_clients},
                        {"rounds_per_client", iterations},
                        {"rows", shape.rows},
                        {"row_bytes", shape.row_bytes},
                        {"attackers_per_kind", attackers},
                        {"flood_connections", flood},
                        {"attack_interval_s", interval_s},
                        {"attacker_threads", attack_threads.size()},
                        {"baseline", summarize(base)},
                        {"under_attack", summarize(attacked)},
                        {"attack_seconds", attack_s},
                        {"attacks", attacks},
                        {"breaches", breaches},
                        {"outcomes_by_kind", kinds_json},
                        {"final_reads_corrupted", final_corrupted},
                        {"served_after", served_after},
                        {"node_alive_after", alive},
                        {"node_exit_code", stop_code},
                        {"node_stop_line", stop_line},
                        {"node_logged_auth_failures", logged_auth_failures},
                        {"node_rss_mib",
                         {{"started", rss_start},
                          {"after_baseline", rss_baseline},
                          {"peak", peak_rss.load()},
                          {"after_attack", rss_after}}}};
  const auto& b = doc["baseline"]["per_op"];
  const auto& u = doc["under_attack"]["per_op"];
  for (const char* op : {"alloc", "free", "scatter", "gather"}) {
    std::fprintf(stderr, "%-8s p50/p99 ms: baseline %.3f/%.3f, under attack %.3f/%.3f\n", op,
                 b[op]["p50_ms"].get<double>(), b[op]["p99_ms"].get<double>(), u[op]["p50_ms"].get<double>(),
                 u[op]["p99_ms"].get<double>());
  }
  std::fprintf(stderr, "failed %lld, corrupted %lld | %lld attacks, %lld breaches | node alive %s, exit %d\n",
               static_cast<long long>(doc["under_attack"]["failed"].get<int64_t>()),
               static_cast<long long>(doc["under_attack"]["corrupted_reads"].get<int64_t>()),
               static_cast<long long>(attacks), static_cast<long long>(breaches), alive ? "yes" : "no", stop_code);
  if (plot) std::fprintf(stderr, "bench_kv_node_hostile: no plot for this report (the JSON is the figure)\n");
  bench::write_report(doc, out, false, "");
  const bool clean = alive && served_after && stop_code == 0 && breaches == 0 && final_corrupted == 0 &&
                     doc["under_attack"]["corrupted_reads"].get<int64_t>() == 0;
  return clean ? 0 : 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"a normal kv-node client's latency and data while hostile clients attack the node"};
  std::string binary;
  int64_t clients = 2, iterations = 200, attackers = 2, idle_timeout_ms = 1000, max_connections = 64, flood = 80;
  int64_t rows = 64, row_bytes = 1024;
  double interval_s = 0.02;
  std::vector<std::string> only;
  std::string out = "bench_out/kv_node_hostile.json";
  bool plot = false;
  app.add_option("--specontext", binary, "the specontext binary (default: ../bin/specontext beside this program)");
  app.add_option("--clients", clients, "normal clients")->check(CLI::PositiveNumber);
  app.add_option("--rounds", iterations, "rounds of alloc, free, scatter, gather per client per phase")
      ->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "rows per scatter / gather")->check(CLI::PositiveNumber);
  app.add_option("--row-bytes", row_bytes, "bytes per row")->check(CLI::PositiveNumber);
  app.add_option("--attackers", attackers, "attacker threads per attack kind");
  app.add_option("--flood", flood, "connections conn_flood opens at once (past the node's limit)");
  app.add_option("--kinds", only, "attack kinds to run (default: all)")->delimiter(',');
  app.add_option("--attack-interval", interval_s, "seconds each attacker waits between attacks");
  app.add_option("--idle-timeout-ms", idle_timeout_ms, "the node's --idle-timeout-ms");
  app.add_option("--max-connections", max_connections, "the node's --max-connections");
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);
  if (binary.empty()) {
    binary = (std::filesystem::read_symlink("/proc/self/exe").parent_path().parent_path() / "bin" / "specontext")
                 .string();
  }
#if SPECONTEXT_HAVE_UCX
  Shape shape;
  shape.rows = rows;
  shape.row_bytes = static_cast<uint64_t>(row_bytes);
  return run(binary, clients, iterations, shape, attackers, flood, interval_s, idle_timeout_ms, max_connections, only, out,
             plot);
#else
  std::fprintf(stderr, "bench_kv_node_hostile: this build has no UCX (install libucx-dev and rebuild)\n");
  return 1;
#endif
}
