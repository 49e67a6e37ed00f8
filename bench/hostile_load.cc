// Normal clients' latency while hostile ones attack the OpenAI-compatible server (issue #26's
// load and fault figures). An in-process server on loopback; C normal clients stream greedy
// completions back to back (from 127.0.0.1), first alone (baseline), then while attackers of
// every kind below hammer the server from other loopback addresses (127.0.0.2-5, so the per-IP
// cap falls on them, not on the normal clients), each attacker repeating its attack until the
// phase ends, pausing --attack-interval between attacks (0: flat out, which on a small machine
// mostly measures the attackers' own CPU use: they run in this process). A probe thread GETs
// /health every 100 ms from 127.0.0.3 throughout.
//
// Attack kinds (what the server must do):
//   idle          connect, send nothing                        closed after header_timeout
//   slowloris     a header trickled a byte per 100 ms          408 (or closed) at header_timeout
//   slow_body     whole header, body trickled                  closed when the body is late
//   oversize      Content-Length: 1 GiB                        413 before reading the body
//   deep_json     guided_json nested 100,000 deep (~200 KB)    400 naming the field
//   huge_prompt   a 3 MiB prompt                               400 naming the field
//   bad_types     {"prompt": 5, "max_tokens": "x"}             400 naming the field
//   garbage       2 KiB of random bytes                        400 or closed
//   conn_flood    80 connections at once from one address      429 past the per-IP cap (32)
//   reconnect     connect and close at once, in a loop          nothing to answer
// Reported: normal clients' TTFT / inter-token / request latency p50 and p99 in both phases,
// failed and wrong requests (texts compared with the baseline's: greedy, so they must match),
// /health latency and failures, per attack kind the answers seen (status code or "closed"),
// the server's counters, RSS before, at peak and after, and whether the server still answers.
//
//   build/release/bench/bench_hostile_load --out bench_out/hostile_load.json --plot
#include <sys/socket.h>
#include <sys/time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench/lib/report.h"
#include "bench/lib/serve_setup.h"
#include "bench/lib/sse_client.h"
#include "runtime/engine_setup.h"
#include "serving/openai/openai_server.h"

using namespace specontext;
using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;
using bench::percentile;
using bench::RequestTiming;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Resident set size of this process (server and clients alike), in MiB.
double rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

// A blocking socket connected to 127.0.0.1:port from `source` (another loopback address), with
// reads that give up after `read_timeout_s`.
struct Conn {
  asio::io_context ioc;
  asio::ip::tcp::socket s{ioc};
  bool open(const char* source, uint16_t port, double read_timeout_s) {
    boost::system::error_code ec;
    s.open(asio::ip::tcp::v4(), ec);
    if (ec) return false;
    s.bind({asio::ip::make_address(source), 0}, ec);
    if (ec) return false;
    timeval tv{static_cast<time_t>(read_timeout_s),
               static_cast<suseconds_t>(1e6 * (read_timeout_s - std::floor(read_timeout_s)))};
    setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    s.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    return !ec;
  }
  bool send(std::string_view bytes) {
    boost::system::error_code ec;
    asio::write(s, asio::buffer(bytes.data(), bytes.size()), ec);
    return !ec;
  }
  // The status code of the answer; "closed" when the server closed without one, "timeout" when
  // nothing came within the read timeout. Plain recv(2): Asio's blocking reads would wait out
  // SO_RCVTIMEO by polling again.
  std::string status() {
    std::string got;
    char buf[4096];
    while (got.find("\r\n") == std::string::npos) {
      const ssize_t n = ::recv(s.native_handle(), buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return got.empty() ? "timeout" : "partial";
      if (n <= 0) return got.empty() ? "closed" : "partial";
      got.append(buf, static_cast<size_t>(n));
    }
    if (got.rfind("HTTP/1.1 ", 0) != 0 || got.size() < 12) return "malformed";
    return got.substr(9, 3);
  }
};

std::string post(const std::string& body, const std::string& extra_headers = "") {
  return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra_headers +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// What each attack kind saw: answer -> count, and attacks made.
struct Tally {
  std::mutex mu;
  std::map<std::string, std::map<std::string, int64_t>> seen;
  void add(const std::string& kind, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    ++seen[kind][what];
  }
};

struct Attack {
  uint16_t port;
  const std::atomic<bool>& stop;
  Tally& tally;
  double timeout_s;  // reads give up after this (longer than the server's timeouts)

  // Sleeps up to `s` seconds, returning early (false) when the phase ends.
  bool pause(double s) {
    const auto until = Clock::now() + std::chrono::duration<double>(s);
    while (Clock::now() < until) {
      if (stop) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return !stop;
  }

  void once(const std::string& kind, const char* source, std::mt19937& rng) {
    Conn c;
    if (!c.open(source, port, timeout_s)) {
      tally.add(kind, "connect_failed");
      pause(0.05);
      return;
    }
    if (kind == "idle") {
      tally.add(kind, c.status());
    } else if (kind == "slowloris") {
      const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";
      bool sent = c.send(head);
      for (int i = 0; sent && !stop && i < 100000; ++i) {
        if (!pause(0.1)) break;
        sent = c.send("a");
      }
      tally.add(kind, c.status());
    } else if (kind == "slow_body") {
      bool sent = c.send(
          "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
          "65536\r\n\r\n{\"prompt\":\"");
      for (int i = 0; sent && !stop && i < 100000; ++i) {
        if (!pause(0.1)) break;
        sent = c.send("aaaaaaaa");
      }
      tally.add(kind, c.status());
    } else if (kind == "oversize") {
      c.send(
          "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
          "1073741824\r\n\r\n{\"prompt\":");
      tally.add(kind, c.status());
    } else if (kind == "deep_json") {
      const int depth = 100000;
      std::string body = "{\"prompt\":\"hi\",\"max_tokens\":1,\"guided_json\":";
      body.append(depth, '[');
      body.append(depth, ']');
      body += "}";
      c.send(post(body));
      tally.add(kind, c.status());
    } else if (kind == "huge_prompt") {
      std::string body = "{\"prompt\":\"";
      body.append(3u << 20, 'a');
      body += "\",\"max_tokens\":1}";
      c.send(post(body));
      tally.add(kind, c.status());
    } else if (kind == "bad_types") {
      c.send(post("{\"prompt\":5,\"max_tokens\":\"x\"}"));
      tally.add(kind, c.status());
    } else if (kind == "garbage") {
      std::string junk(2048, '\0');
      for (char& ch : junk) ch = static_cast<char>(rng());
      c.send(junk);
      tally.add(kind, c.status());
    } else if (kind == "reconnect") {
      tally.add(kind, "connected");
      return;  // closed at once by ~Conn
    }
  }

  // conn_flood: opens `hold` connections from one address back to back, then reads what each
  // was told: past the server's per-IP cap a connection is answered (429) and closed; the others
  // were accepted ("held_open") and are closed by the server's header timeout. Repeats.
  void flood(const char* source, int hold) {
    while (!stop) {
      std::vector<std::unique_ptr<Conn>> held;
      for (int i = 0; i < hold && !stop; ++i) {
        auto c = std::make_unique<Conn>();
        if (c->open(source, port, 0.5))
          held.push_back(std::move(c));
        else
          tally.add("conn_flood", "connect_failed");
      }
      for (auto& c : held) {
        const std::string s = c->status();  // "timeout": accepted and waiting for a request
        tally.add("conn_flood", s == "timeout" ? "held_open" : s);
      }
      pause(1.0);
    }
  }
};

struct PhaseResult {
  std::vector<RequestTiming> timings;  // client k's r-th request at k * per_client + r
  double wall_s = 0;
};

PhaseResult run_clients(uint16_t port, const std::vector<std::string>& bodies, int64_t clients) {
  const auto start = Clock::now();
  PhaseResult r;
  r.timings = bench::stream_from_clients(port, bodies, clients);
  r.wall_s = seconds_since(start);
  return r;
}

nlohmann::json summarize(const PhaseResult& r, const PhaseResult* baseline) {
  std::vector<double> ttft, gaps, latency;
  int64_t failed = 0, wrong = 0;
  for (size_t i = 0; i < r.timings.size(); ++i) {
    const RequestTiming& t = r.timings[i];
    if (!t.ok) {
      ++failed;
      continue;
    }
    if (baseline && baseline->timings[i].ok && baseline->timings[i].text != t.text) ++wrong;
    ttft.push_back(t.ttft_s);
    latency.push_back(t.latency_s);
    gaps.insert(gaps.end(), t.gaps_s.begin(), t.gaps_s.end());
  }
  return {{"requests", r.timings.size()},
          {"failed", failed},
          {"wrong_text", wrong},
          {"wall_s", r.wall_s},
          {"ttft_p50_ms", 1e3 * percentile(ttft, 0.5)},
          {"ttft_p99_ms", 1e3 * percentile(ttft, 0.99)},
          {"itl_p50_ms", 1e3 * percentile(gaps, 0.5)},
          {"itl_p99_ms", 1e3 * percentile(gaps, 0.99)},
          {"latency_p50_ms", 1e3 * percentile(latency, 0.5)},
          {"latency_p99_ms", 1e3 * percentile(latency, 0.99)}};
}

// GET /health every 100 ms on a new connection from 127.0.0.3 until `stop`; latencies in ms per
// phase (the phase index is read at each probe), failures counted, and the peak RSS.
struct HealthProbe {
  uint16_t port;
  const std::atomic<bool>& stop;
  const std::atomic<int>& phase;
  std::vector<double> ms[2];
  int64_t failures[2] = {0, 0};
  double peak_rss_mib = 0;
  void run() {
    while (!stop) {
      const int p = phase;
      const auto t0 = Clock::now();
      Conn c;
      const bool ok = c.open("127.0.0.3", port, 5.0) &&
                      c.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") &&
                      c.status() == "200";
      if (ok)
        ms[p].push_back(1e3 * seconds_since(t0));
      else
        ++failures[p];
      peak_rss_mib = std::max(peak_rss_mib, rss_mib());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"normal clients' latency while hostile clients attack the server"};
  runtime::EngineArgs args;
  bench::add_served_model_options(app, args);
  int64_t clients = 2, per_client = 6;
  bench::ServedShape shape;
  int64_t attackers = 4;  // per kind
  int64_t flood = 80;     // connections conn_flood tries to hold (per-IP cap below: 32)
  double header_timeout_s = 2, idle_timeout_s = 3;
  double interval_s = 0.05;       // each attacker's pause between attacks
  std::vector<std::string> only;  // attack kinds to run (empty: all)
  std::string out = "bench_out/hostile_load.json";
  bool plot = false;
  app.add_option("--clients", clients, "normal clients, each streaming completions back to back");
  app.add_option("--requests-per-client", per_client, "requests per normal client per phase");
  bench::add_served_shape_options(app, shape);
  app.add_option("--attackers", attackers, "attacker threads per attack kind");
  app.add_option("--flood", flood, "connections conn_flood tries to hold open");
  app.add_option("--kinds", only, "attack kinds to run (default: all; conn_flood is one of them)")
      ->delimiter(',');
  app.add_option("--attack-interval", interval_s,
                 "seconds each attacker waits between attacks (0: flat out)");
  app.add_option("--header-timeout", header_timeout_s, "server header timeout (s)");
  app.add_option("--idle-timeout", idle_timeout_s, "server idle timeout (s)");
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);

  const auto fail = bench::report_failure;
  auto served = bench::build_served_engine(args, shape);
  if (!served.is_ok()) return fail(served.status());
  const runtime::LoadedModel& loaded = served->loaded;
  cluster::ServerOptions so;
  so.model_name = "bench";
  so.scheduling.prefill_chunk = args.prefill_chunk;
  so.scheduling.prefix_caching = false;  // both phases send the same prompts: no cache hits
  so.header_timeout = std::chrono::milliseconds(static_cast<int64_t>(1e3 * header_timeout_s));
  so.idle_timeout = std::chrono::milliseconds(static_cast<int64_t>(1e3 * idle_timeout_s));
  so.max_connections_per_ip = 32;
  so.max_connections = 256;
  const double rss_before = rss_mib();
  auto server = cluster::OpenAiServer::start(*served->bundle.engine, *loaded.tokenizer, so);
  if (!server.is_ok()) return fail(server.status());
  const uint16_t port = (*server)->port();

  std::mt19937 rng(1);
  std::vector<std::string> bodies;
  for (int64_t i = 0; i < clients * per_client; ++i) {
    bodies.push_back(bench::random_stream_body(rng, loaded.model->config.vocab_size, shape));
  }

  std::atomic<bool> probe_stop{false}, attack_stop{false};
  std::atomic<int> phase{0};
  HealthProbe probe{port, probe_stop, phase, {}, {0, 0}, 0};
  std::thread probe_thread([&] { probe.run(); });

  std::fprintf(stderr, "baseline: %lld clients x %lld requests\n", static_cast<long long>(clients),
               static_cast<long long>(per_client));
  const PhaseResult base = run_clients(port, bodies, clients);
  const double rss_baseline = rss_mib();

  const std::vector<std::pair<std::string, const char*>> kinds = {
      {"idle", "127.0.0.2"},      {"slowloris", "127.0.0.2"}, {"slow_body", "127.0.0.2"},
      {"oversize", "127.0.0.2"},  {"deep_json", "127.0.0.2"}, {"huge_prompt", "127.0.0.5"},
      {"bad_types", "127.0.0.5"}, {"garbage", "127.0.0.5"},   {"reconnect", "127.0.0.5"}};
  Tally tally;
  std::vector<std::thread> attack_threads;
  phase = 1;
  const auto attack_start = Clock::now();
  const auto wanted = [&](const std::string& kind) {
    return only.empty() || std::find(only.begin(), only.end(), kind) != only.end();
  };
  for (const auto& [kind, source] : kinds) {
    if (!wanted(kind)) continue;
    for (int64_t a = 0; a < attackers; ++a) {
      attack_threads.emplace_back([&, kind = kind, source = source, a] {
        Attack at{port, attack_stop, tally, header_timeout_s + idle_timeout_s + 5};
        std::mt19937 r(static_cast<uint32_t>(a) * 7919u + static_cast<uint32_t>(kind.size()));
        while (!attack_stop) {
          at.once(kind, source, r);
          at.pause(interval_s);
        }
      });
    }
  }
  if (wanted("conn_flood")) {
    attack_threads.emplace_back([&] {
      Attack at{port, attack_stop, tally, 5};
      at.flood("127.0.0.4", static_cast<int>(flood));
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // let the attack build up
  std::fprintf(stderr, "under attack: %zu attacker threads\n", attack_threads.size());
  const PhaseResult attacked = run_clients(port, bodies, clients);
  // Hold the attack until every slow kind has met the server's timeouts at least once.
  while (seconds_since(attack_start) < header_timeout_s + idle_timeout_s + 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  attack_stop = true;
  for (auto& t : attack_threads) t.join();
  const double attack_s = seconds_since(attack_start);
  probe_stop = true;
  probe_thread.join();

  // Still alive and answering after the attack?
  Conn after;
  const bool alive = after.open("127.0.0.3", port, 5.0) &&
                     after.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") &&
                     after.status() == "200";
  const PhaseResult again = run_clients(port, {bodies[0]}, 1);
  const double rss_after = rss_mib();
  const cluster::ServerCounters counters = (*server)->counters();
  (*server)->stop();

  nlohmann::json kinds_json = nlohmann::json::object();
  int64_t attacks = 0;
  for (const auto& [kind, m] : tally.seen) {
    kinds_json[kind] = m;
    for (const auto& [what, n] : m) attacks += n;
  }
  nlohmann::json doc = {{"model", bench::served_model_name(args)},
                        {"layers", loaded.model->config.n_layers},
                        {"clients", clients},
                        {"requests_per_client", per_client},
                        {"prompt_tokens", shape.prompt_tokens},
                        {"max_tokens", shape.max_tokens},
                        {"attackers_per_kind", attackers},
                        {"attack_interval_s", interval_s},
                        {"kinds", only.empty() ? std::vector<std::string>{"all"} : only},
                        {"attacker_threads", attack_threads.size()},
                        {"server",
                         {{"header_timeout_s", header_timeout_s},
                          {"idle_timeout_s", idle_timeout_s},
                          {"max_connections", so.max_connections},
                          {"max_connections_per_ip", so.max_connections_per_ip}}},
                        {"baseline", summarize(base, nullptr)},
                        {"under_attack", summarize(attacked, &base)},
                        {"after_attack_request_ok", !again.timings.empty() && again.timings[0].ok &&
                                                        again.timings[0].text == base.timings[0].text},
                        {"attack_seconds", attack_s},
                        {"attacks", attacks},
                        {"answers_by_kind", kinds_json},
                        {"health",
                         {{"baseline_p50_ms", percentile(probe.ms[0], 0.5)},
                          {"baseline_p99_ms", percentile(probe.ms[0], 0.99)},
                          {"attack_p50_ms", percentile(probe.ms[1], 0.5)},
                          {"attack_p99_ms", percentile(probe.ms[1], 0.99)},
                          {"baseline_probes", probe.ms[0].size()},
                          {"attack_probes", probe.ms[1].size()},
                          {"baseline_failures", probe.failures[0]},
                          {"attack_failures", probe.failures[1]}}},
                        {"server_alive_after", alive},
                        {"counters",
                         {{"rejected", counters.rejected},
                          {"connections_refused", counters.connections_refused},
                          {"connections_refused_per_ip", counters.connections_refused_per_ip},
                          {"header_timeouts", counters.header_timeouts},
                          {"prepare_refused", counters.prepare_refused},
                          {"completed", counters.completed},
                          {"failed", counters.failed}}},
                        {"rss_mib",
                         {{"before_server", rss_before},
                          {"after_baseline", rss_baseline},
                          {"peak", probe.peak_rss_mib},
                          {"after_attack", rss_after}}}};
  const auto& b = doc["baseline"];
  const auto& u = doc["under_attack"];
  std::fprintf(stderr,
               "latency p50/p99 ms: baseline %.0f/%.0f, under attack %.0f/%.0f | TTFT p50/p99 %.0f/%.0f -> "
               "%.0f/%.0f | failed %lld, wrong %lld | %lld attacks | alive %s\n",
               b["latency_p50_ms"].get<double>(), b["latency_p99_ms"].get<double>(),
               u["latency_p50_ms"].get<double>(), u["latency_p99_ms"].get<double>(),
               b["ttft_p50_ms"].get<double>(), b["ttft_p99_ms"].get<double>(), u["ttft_p50_ms"].get<double>(),
               u["ttft_p99_ms"].get<double>(), static_cast<long long>(u["failed"].get<int64_t>()),
               static_cast<long long>(u["wrong_text"].get<int64_t>()), static_cast<long long>(attacks),
               alive ? "yes" : "no");
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_hostile_load.py");
  return alive ? 0 : 1;
}
