// bench_loadgen's pieces (bench/lib/loadgen.h): the JSONL trace parser (good lines; bad lines are
// errors naming the line and field), the arrival schedules (Poisson's mean rate and exponential
// gaps from a fixed seed, bursts, determinism), the synthetic trace, the goodput and percentile
// accounting on made-up timings, /metrics deltas, and one run against a real `specontext serve`
// on stories260K (every request answered with its max_tokens, sessions growing, a refused request
// counted as an error with its HTTP status), a silent or absent server costing errors, not a hang,
// SSE events split across HTTP chunks (as the router relays them) all read, and the scheduler's
// own work bounded per request (turns waiting for their session hold no thread and wake no one;
// workers no more than the requests sent at once).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/lib/loadgen.h"
#include "bench/lib/sse_client.h"
#include "tests/serving/serve_process.h"
#include "tests/tests_common.h"

namespace specontext::bench::loadgen {
namespace {

using json = nlohmann::json;

Result<Trace> parse(const std::string& text, const TraceLimits& limits = {}) {
  std::istringstream in(text);
  return parse_trace(in, limits);
}

TEST(LoadgenTrace, ParsesPrefixesRequestsCommentsAndBlankLines) {
  auto t = parse(
      "# a comment\n"
      "{\"define_prefix\": \"sys0\", \"text\": \"System: be brief.\"}\r\n"
      "\n"
      "{\"arrival_s\": 0, \"prompt\": \"Hello\", \"max_tokens\": 8, \"session\": \"s1\", \"prefix\": \"sys0\"}\n"
      "{\"arrival_s\": 0.5, \"prompt\": \"\", \"max_tokens\": 4, \"session\": \"s1\", \"kind\": \"tool\"}\n"
      "{\"arrival_s\": 0.5, \"prompt\": \"alone\", \"max_tokens\": 1}");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_EQ(t->prefixes.size(), 1u);
  EXPECT_EQ(t->prefixes.at("sys0"), "System: be brief.");
  ASSERT_EQ(t->requests.size(), 3u);
  EXPECT_EQ(t->requests[0].line, 4);
  EXPECT_EQ(t->requests[0].prefix, "sys0");
  EXPECT_EQ(t->requests[0].session, "s1");
  EXPECT_EQ(t->requests[0].max_tokens, 8);
  EXPECT_EQ(t->requests[1].kind, "tool");
  EXPECT_DOUBLE_EQ(t->requests[1].arrival_s, 0.5);
  EXPECT_EQ(t->requests[2].line, 6);
  EXPECT_EQ(t->requests[2].prompt, "alone");
}

TEST(LoadgenTrace, BadLinesAreErrorsNamingTheLineAndField) {
  const std::string ok = "{\"arrival_s\": 0, \"prompt\": \"p\", \"max_tokens\": 8}\n";
  struct Case {
    std::string line;
    std::string want;  // in the message
  };
  const std::vector<Case> cases = {
      {"not json", "trace line 2: not a JSON object"},
      {"[1, 2]", "trace line 2: not a JSON object"},
      {"{\"arrival_s\": 1, \"prompt\": {\"a\": [1]}, \"max_tokens\": 8}", "trace line 2: not a JSON object"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_token\": 8}", "trace line 2: field 'max_token': unknown"},
      {"{\"prompt\": \"p\", \"max_tokens\": 8}", "trace line 2: field 'arrival_s': must be a number"},
      {"{\"arrival_s\": -1, \"prompt\": \"p\", \"max_tokens\": 8}", "field 'arrival_s'"},
      {"{\"arrival_s\": \"1\", \"prompt\": \"p\", \"max_tokens\": 8}", "field 'arrival_s'"},
      {"{\"arrival_s\": 1e300, \"prompt\": \"p\", \"max_tokens\": 8}", "field 'arrival_s'"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 0}", "trace line 2: field 'max_tokens': must be an integer"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 1.5}", "field 'max_tokens'"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 99999999}", "field 'max_tokens'"},
      {"{\"arrival_s\": 1, \"max_tokens\": 8}", "trace line 2: field 'prompt': must be a string"},
      {"{\"arrival_s\": 1, \"prompt\": 7, \"max_tokens\": 8}", "field 'prompt'"},
      {"{\"arrival_s\": 1, \"prompt\": \"\", \"max_tokens\": 8}", "field 'prompt': must not be empty"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 8, \"session\": \"a b\"}", "field 'session'"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 8, \"session\": \"\"}", "field 'session'"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 8, \"prefix\": \"nope\"}",
       "field 'prefix': 'nope' is not defined"},
      {"{\"arrival_s\": 1, \"prompt\": \"p\", \"max_tokens\": 8, \"kind\": 3}", "field 'kind'"},
      {"{\"define_prefix\": \"x\"}", "trace line 2: field 'text': must be a non-empty string"},
      {"{\"define_prefix\": \"x\", \"text\": \"t\", \"arrival_s\": 1}", "field 'arrival_s': unknown in a prefix"},
      {"{\"define_prefix\": \"x y\", \"text\": \"t\"}", "field 'define_prefix'"},
  };
  for (const Case& c : cases) {
    auto t = parse(ok + c.line + "\n" + ok);
    ASSERT_FALSE(t.is_ok()) << c.line;
    EXPECT_NE(t.status().message().find(c.want), std::string::npos) << c.line << " → " << t.status().message();
  }
  // Arrivals must not decrease; a prefix is defined once.
  auto back = parse("{\"arrival_s\": 2, \"prompt\": \"p\", \"max_tokens\": 8}\n" + ok);
  ASSERT_FALSE(back.is_ok());
  EXPECT_NE(back.status().message().find("trace line 2: field 'arrival_s'"), std::string::npos);
  auto twice = parse("{\"define_prefix\": \"x\", \"text\": \"t\"}\n{\"define_prefix\": \"x\", \"text\": \"u\"}\n" + ok);
  ASSERT_FALSE(twice.is_ok());
  EXPECT_NE(twice.status().message().find("trace line 2: field 'define_prefix': 'x' is defined twice"),
            std::string::npos);
  // Bounds: line length (the rest of the line unread), request count; no requests at all.
  TraceLimits small;
  small.max_line_bytes = 64;
  auto long_line = parse(ok + "{\"arrival_s\": 1, \"prompt\": \"" + std::string(1 << 20, 'x') + "\"}\n", small);
  ASSERT_FALSE(long_line.is_ok());
  EXPECT_NE(long_line.status().message().find("trace line 2: longer than 64 bytes"), std::string::npos);
  small.max_requests = 2;
  auto many = parse(ok + ok + ok, small);
  ASSERT_FALSE(many.is_ok());
  EXPECT_NE(many.status().message().find("trace line 3: more than 2 requests"), std::string::npos);
  auto none = parse("# nothing\n{\"define_prefix\": \"x\", \"text\": \"t\"}\n");
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("no requests"), std::string::npos);
}

TEST(LoadgenArrivals, PoissonHasTheMeanRateAndExponentialGapsForAFixedSeed) {
  ArrivalOptions a;
  a.rate = 5;
  a.seed = 7;
  const int64_t n = 20000;
  auto t = arrival_times(a, n);
  ASSERT_TRUE(t.is_ok());
  ASSERT_EQ(t->size(), static_cast<size_t>(n));
  std::vector<double> gaps;
  double prev = 0;
  for (double x : *t) {
    ASSERT_GE(x, prev);
    gaps.push_back(x - prev);
    prev = x;
  }
  double mean = 0, var = 0;
  for (double g : gaps) mean += g;
  mean /= n;
  for (double g : gaps) var += (g - mean) * (g - mean);
  var /= n - 1;
  // Rate within 3% (the standard error of the mean gap is 0.7% at n = 20000); exponential: the
  // gaps' standard deviation equals their mean.
  EXPECT_NEAR(static_cast<double>(n) / t->back(), 5.0, 0.15);
  EXPECT_NEAR(std::sqrt(var) / mean, 1.0, 0.05);
  // Deterministic for a seed, different for another.
  auto again = arrival_times(a, n);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *t);
  a.seed = 8;
  auto other = arrival_times(a, n);
  ASSERT_TRUE(other.is_ok());
  EXPECT_NE((*other)[0], (*t)[0]);
}

TEST(LoadgenArrivals, BurstsComeTogetherAtTheMeanRateAndUniformIsEven) {
  ArrivalOptions a;
  a.process = "burst";
  a.rate = 8;
  a.burst_size = 4;
  a.seed = 3;
  const int64_t n = 20000;
  auto t = arrival_times(a, n);
  ASSERT_TRUE(t.is_ok());
  ASSERT_EQ(t->size(), static_cast<size_t>(n));
  for (size_t b = 0; b < t->size(); b += 4) {
    for (size_t k = 1; k < 4; ++k) ASSERT_EQ((*t)[b + k], (*t)[b]) << b;
    if (b > 0) {
      ASSERT_GT((*t)[b], (*t)[b - 1]);
    }
  }
  EXPECT_NEAR(static_cast<double>(n) / t->back(), 8.0, 0.4);  // 5000 bursts: 1.4% standard error

  a.process = "uniform";
  auto u = arrival_times(a, 4);
  ASSERT_TRUE(u.is_ok());
  EXPECT_EQ(*u, (std::vector<double>{0.125, 0.25, 0.375, 0.5}));

  a.process = "zipf";
  EXPECT_FALSE(arrival_times(a, 4).is_ok());
  a.process = "poisson";
  a.rate = 0;
  EXPECT_FALSE(arrival_times(a, 4).is_ok());
}

TEST(LoadgenSynth, TheTraceIsDeterministicParsesAndGrowsSessionsUpToTheirTurns) {
  SynthOptions o;
  o.arrivals.rate = 2;
  o.arrivals.seed = 11;
  o.requests = 30;
  o.sessions = 3;
  o.turns = 4;
  o.prefixes = 2;
  o.agent_fraction = 0.5;
  auto text = synth_trace(o);
  ASSERT_TRUE(text.is_ok());
  auto again = synth_trace(o);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*text, *again);
  auto t = parse(*text);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_EQ(t->prefixes.size(), 2u);
  ASSERT_EQ(t->requests.size(), 30u);
  auto arrivals = arrival_times(o.arrivals, 30);
  ASSERT_TRUE(arrivals.is_ok());
  std::map<std::string, int> turns;
  for (size_t i = 0; i < t->requests.size(); ++i) {
    const TraceRequest& r = t->requests[i];
    EXPECT_NEAR(r.arrival_s, (*arrivals)[i], 1e-6);
    EXPECT_EQ(r.max_tokens, 16);
    EXPECT_FALSE(r.prefix.empty());
    ++turns[r.session];
    EXPECT_TRUE(r.kind == "chat" || r.kind == "task" || r.kind == "tool") << r.kind;
  }
  EXPECT_EQ(turns.size(), 9u);  // 30 requests, 3 at once, 4 turns each: 6 sessions of 4, 3 of 2
  for (const auto& [s, k] : turns) EXPECT_LE(k, 4) << s;
  o.turns = 0;
  EXPECT_FALSE(synth_trace(o).is_ok());
}

RequestResult timed(double ttft, double gap, int64_t tokens, bool ok = true) {
  RequestResult r;
  r.ok = ok;
  r.ttft_s = ttft;
  r.gaps_s.assign(static_cast<size_t>(tokens - 1), gap);
  r.latency_s = ttft + gap * static_cast<double>(tokens - 1);
  r.completion_tokens = tokens;
  r.max_tokens = tokens;
  r.prompt_tokens = 100;
  r.cached_tokens = 25;
  if (!ok) r.error = "HTTP 503: busy";
  return r;
}

TEST(LoadgenAccounting, GoodputAndPercentilesFromMadeUpTimings) {
  Slo slo;
  slo.ttft_s = 0.5;
  slo.tpot_s = 0.05;
  // 10 requests of 11 tokens: TTFT 0.1 .. 1.0 s, gaps 0.02 s (the last two 0.1 s), one failed.
  std::vector<RequestResult> rs;
  for (int i = 0; i < 10; ++i) rs.push_back(timed(0.1 * (i + 1), i >= 8 ? 0.1 : 0.02, 11));
  rs.push_back(timed(0.1, 0.01, 11, /*ok=*/false));
  EXPECT_TRUE(meets_slo(rs[0], slo));
  EXPECT_FALSE(meets_slo(rs[5], slo));   // TTFT 0.6 s
  EXPECT_FALSE(meets_slo(rs[10], slo));  // failed
  slo.latency_s = 0.3;
  EXPECT_FALSE(meets_slo(rs[1], slo));  // 0.2 + 10 × 0.02 = 0.4 s
  slo.latency_s = 0;

  const json s = summarize(rs, /*wall_s=*/10, slo);
  EXPECT_EQ(s["requests"], 11);
  EXPECT_EQ(s["ok"], 10);
  EXPECT_EQ(s["errors"], 1);
  ASSERT_EQ(s["error_messages"].size(), 1u);
  EXPECT_EQ(s["error_messages"][0]["message"], "HTTP 503: busy");
  EXPECT_EQ(s["goodput_requests"], 5);  // TTFT ≤ 0.5 s and TPOT 0.02 s
  EXPECT_DOUBLE_EQ(s["goodput_requests_per_s"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(s["goodput_tokens_per_s"].get<double>(), 5.5);
  EXPECT_DOUBLE_EQ(s["output_tokens_per_s"].get<double>(), 11.0);
  EXPECT_EQ(s["output_tokens"], 110);
  EXPECT_EQ(s["prompt_tokens"], 1000);
  EXPECT_EQ(s["cached_prompt_tokens"], 250);
  EXPECT_EQ(s["answers_shorter_than_max_tokens"], 0);
  // Nearest rank over the 10 TTFTs 0.1 .. 1.0: p50 = the 6th (index round(4.5 + 0.5) = 5), p99 the 10th.
  EXPECT_NEAR(s["ttft_ms"]["p50"].get<double>(), 600, 1e-6);
  EXPECT_NEAR(s["ttft_ms"]["p99"].get<double>(), 1000, 1e-6);
  // 100 gaps: 80 of 20 ms, 20 of 100 ms.
  EXPECT_NEAR(s["itl_ms"]["p50"].get<double>(), 20, 1e-6);
  EXPECT_NEAR(s["itl_ms"]["p99"].get<double>(), 100, 1e-6);
  EXPECT_NEAR(s["tpot_ms"]["p90"].get<double>(), 100, 1e-6);
  EXPECT_EQ(percentile({}, 0.5), 0);
}

TEST(LoadgenMetrics, DeltasOverARunForServeAndRouter) {
  const std::string before =
      "# HELP specontext_prompt_tokens_total x\n# TYPE specontext_prompt_tokens_total counter\n"
      "specontext_prompt_tokens_total 100\nspecontext_prefix_cache_hit_tokens_total 0\n"
      "specontext_prefix_offload_bytes 4096\nspecontext_prefix_store_read_bytes_total 10\n"
      "specontext_router_requests_total 5\nspecontext_router_prefix_lookups_total 4\n"
      "specontext_router_prefix_hits_total 1\n"
      "specontext_router_replica_chosen_total{replica=\"127.0.0.1:81\"} 2\n"
      "garbage line\n";
  const std::string after =
      "specontext_prompt_tokens_total 400\nspecontext_prefix_cache_hit_tokens_total 100\n"
      "specontext_prefix_offload_bytes 8192\nspecontext_prefix_store_read_bytes_total 1010\n"
      "specontext_prefix_store_chunks_written_total 7\n"
      "specontext_router_requests_total 15\nspecontext_router_prefix_lookups_total 14\n"
      "specontext_router_prefix_hits_total 9\n"
      "specontext_router_replica_chosen_total{replica=\"127.0.0.1:81\"} 12\n"
      "specontext_router_prefix_hit_rate 0.5\n";
  const auto b = parse_prometheus(before), a = parse_prometheus(after);
  EXPECT_EQ(b.size(), 8u);  // the garbage line skipped
  EXPECT_EQ(b.at("specontext_router_replica_chosen_total{replica=\"127.0.0.1:81\"}"), 2);
  const json d = metrics_delta(b, a);
  EXPECT_EQ(d["counters"]["specontext_prompt_tokens_total"], 300);
  EXPECT_EQ(d["gauges"]["specontext_router_prefix_hit_rate"]["after"], 0.5);
  EXPECT_EQ(d["serve"]["prompt_tokens_computed"], 300);
  EXPECT_EQ(d["serve"]["prompt_tokens_cached"], 100);
  EXPECT_DOUBLE_EQ(d["serve"]["prefix_cache_hit_rate"].get<double>(), 0.25);
  EXPECT_EQ(d["serve"]["host_tier"]["bytes"]["before"], 4096);
  EXPECT_EQ(d["serve"]["host_tier"]["bytes"]["after"], 8192);
  EXPECT_EQ(d["serve"]["shared_store"]["bytes_read"], 1000);
  EXPECT_EQ(d["serve"]["shared_store"]["chunks_written"], 7);  // none before
  EXPECT_EQ(d["router"]["requests"], 10);
  EXPECT_DOUBLE_EQ(d["router"]["prefix_hit_rate"].get<double>(), 0.8);  // 8 of 10 lookups in the run
  EXPECT_EQ(d["router"]["replicas"]["127.0.0.1:81"]["chosen"], 10);
  EXPECT_TRUE(metrics_delta({}, {}).empty());
}

// A server that accepts (in the kernel's backlog) and never answers costs a request its timeout,
// counted as an error; a refused connection is an error at once. Both end the run.
TEST(LoadgenRun, ASilentServerTimesOutAndARefusedConnectionIsAnError) {
  auto trace = parse("{\"arrival_s\": 0, \"prompt\": \"p\", \"max_tokens\": 8}\n");
  ASSERT_TRUE(trace.is_ok());
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor silent(ioc, {boost::asio::ip::make_address("127.0.0.1"), 0});
  RunOptions o;
  o.port = silent.local_endpoint().port();
  o.timeout_s = 0.2;
  auto run = run_trace(*trace, o);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  ASSERT_EQ(run->results.size(), 1u);
  EXPECT_FALSE(run->results[0].ok);
  EXPECT_EQ(run->results[0].error, "timed out after 0.2 s");

  uint16_t closed_port = 0;
  {
    boost::asio::ip::tcp::acceptor a(ioc, {boost::asio::ip::make_address("127.0.0.1"), 0});
    closed_port = a.local_endpoint().port();
  }
  o.port = closed_port;
  run = run_trace(*trace, o);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  EXPECT_FALSE(run->results[0].ok);
  EXPECT_EQ(run->results[0].error.rfind("connect: ", 0), 0u) << run->results[0].error;

  o.port = 0;
  EXPECT_FALSE(run_trace(*trace, o).is_ok());
}

// A relay (the router) cuts a stream into chunks anywhere: events split across chunks, chunk
// framing in the middle of an event's JSON. Every event still counts (text pieces and usage).
TEST(LoadgenRun, EventsSplitAcrossChunksAreAllRead) {
  auto trace = parse("{\"arrival_s\": 0, \"prompt\": \"p\", \"max_tokens\": 2}\n");
  ASSERT_TRUE(trace.is_ok());
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::acceptor acceptor(ioc, {boost::asio::ip::make_address("127.0.0.1"), 0});
  const std::string events =
      "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
      "data: {\"choices\":[{\"text\":\"b\"}]}\n\n"
      "data: {\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n"
      "data: [DONE]\n\n";
  std::thread server([&] {
    boost::asio::ip::tcp::socket sock(ioc);
    acceptor.accept(sock);
    std::string got;
    char buf[4096];
    boost::system::error_code ec;
    while (got.find("\r\n\r\n") == std::string::npos || got.find("}", got.find("\r\n\r\n")) == std::string::npos) {
      const size_t n = sock.read_some(boost::asio::buffer(buf), ec);
      if (ec) return;
      got.append(buf, n);
    }
    std::string out = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    char hex[16];
    for (size_t i = 0; i < events.size(); i += 7) {
      const std::string piece = events.substr(i, 7);
      std::snprintf(hex, sizeof hex, "%zx\r\n", piece.size());
      out += hex + piece + "\r\n";
    }
    out += "0\r\n\r\n";
    boost::asio::write(sock, boost::asio::buffer(out), ec);
    sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ec);
    while (!ec) sock.read_some(boost::asio::buffer(buf), ec);
  });
  RunOptions o;
  o.port = acceptor.local_endpoint().port();
  o.timeout_s = 10;
  auto run = run_trace(*trace, o);
  server.join();
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  ASSERT_EQ(run->results.size(), 1u);
  const RequestResult& r = run->results[0];
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.completion_tokens, 2);
  EXPECT_EQ(r.prompt_tokens, 3);
  EXPECT_EQ(r.gaps_s.size(), 1u);
  EXPECT_EQ(r.text, "ab") << "the answer's text events, concatenated";
  EXPECT_EQ(r.prompt_hash, fnv1a64("p"));
}

// A server answering every completion with the text "ab" after `delay_ms`, each connection on its
// own thread; counts the requests.
class EchoServer {
 public:
  explicit EchoServer(int delay_ms)
      : delay_ms_(delay_ms), acceptor_(ioc_, {boost::asio::ip::make_address("127.0.0.1"), 0}) {
    thread_ = std::thread([this] { accept_loop(); });
  }
  ~EchoServer() {
    stop_ = true;
    boost::system::error_code ec;
    // Wake the blocking accept with one last connection.
    boost::asio::io_context c;
    boost::asio::ip::tcp::socket s(c);
    s.connect(acceptor_.local_endpoint(), ec);
    thread_.join();
    for (auto& t : conns_) t.join();
  }
  uint16_t port() const { return acceptor_.local_endpoint().port(); }
  int64_t requests() const { return requests_; }

 private:
  void accept_loop() {
    for (;;) {
      auto sock = std::make_shared<boost::asio::ip::tcp::socket>(ioc_);
      boost::system::error_code ec;
      acceptor_.accept(*sock, ec);
      if (stop_ || ec) return;
      conns_.emplace_back([this, sock] { serve(*sock); });
    }
  }
  void serve(boost::asio::ip::tcp::socket& sock) {
    std::string got;
    char buf[4096];
    boost::system::error_code ec;
    for (;;) {
      const size_t head = got.find("\r\n\r\n");
      if (head != std::string::npos) {
        const size_t cl = got.find("Content-Length: ");
        if (cl != std::string::npos && cl < head &&
            got.size() >= head + 4 + std::stoul(got.substr(cl + 16, got.find("\r\n", cl) - cl - 16))) {
          break;
        }
      }
      const size_t n = sock.read_some(boost::asio::buffer(buf), ec);
      if (ec) return;
      got.append(buf, n);
    }
    ++requests_;
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    const std::string events =
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
        "data: {\"choices\":[{\"text\":\"b\"}]}\n\n"
        "data: {\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n"
        "data: [DONE]\n\n";
    const std::string out = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: " +
                            std::to_string(events.size()) + "\r\nConnection: close\r\n\r\n" + events;
    boost::asio::write(sock, boost::asio::buffer(out), ec);
    sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ec);
    while (!ec) sock.read_some(boost::asio::buffer(buf), ec);
  }
  int delay_ms_;
  boost::asio::io_context ioc_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> requests_{0};
  std::vector<std::thread> conns_;
  std::thread thread_;
};

// Many turns of a few conversations arrive at once, so most wait for their session's previous
// turn. Each is sent after that turn with its answer in front (the prompt's hash says so), no
// thread waits for a turn (workers: at most one per conversation, as at most one request of each
// is sent at once), and a request costs at most one wake-up however many wait: the thread per
// request that woke every waiting thread at each completion took thousands here.
TEST(LoadgenRun, WaitingTurnsHoldNoThreadAndWakeNoOne) {
  constexpr int kSessions = 6, kTurns = 20;
  std::string text = "{\"define_prefix\": \"sys\", \"text\": \"S.\"}\n";
  for (int t = 0; t < kTurns; ++t) {
    for (int s = 0; s < kSessions; ++s) {
      text += json{{"arrival_s", 0}, {"session", "s" + std::to_string(s)}, {"prefix", "sys"},
                   {"prompt", " t" + std::to_string(t)}, {"max_tokens", 2}}
                  .dump() +
              "\n";
    }
  }
  auto trace = parse(text);
  ASSERT_TRUE(trace.is_ok()) << trace.status().to_string();
  EchoServer server(2);
  RunOptions o;
  o.port = server.port();
  o.timeout_s = 60;
  auto run = run_trace(*trace, o);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  const int64_t n = kSessions * kTurns;
  ASSERT_EQ(static_cast<int64_t>(run->results.size()), n);
  EXPECT_EQ(server.requests(), n);
  for (int s = 0; s < kSessions; ++s) {
    std::string prompt = "S.";
    for (int t = 0; t < kTurns; ++t) {
      const RequestResult& r = run->results[static_cast<size_t>(t * kSessions + s)];
      ASSERT_TRUE(r.ok) << r.error;
      prompt += " t" + std::to_string(t);
      EXPECT_EQ(r.prompt_hash, fnv1a64(prompt)) << "session " << s << " turn " << t;
      prompt += "ab";
      if (t > 0) {
        const RequestResult& prev = run->results[static_cast<size_t>((t - 1) * kSessions + s)];
        EXPECT_GE(r.sent_at_s, prev.sent_at_s + prev.latency_s - 1e-3) << "session " << s << " turn " << t;
      }
    }
  }
  EXPECT_LE(run->workers, kSessions);
  EXPECT_GE(run->workers, 1);
  EXPECT_LE(run->turns_handed_on, n - kSessions);
  EXPECT_LE(run->wakeups, n + run->workers + 1) << "at most one wake-up a request, one a worker at the end and "
                                                    "the dispatcher's last wait";
}

// Past --max-in-flight arrivals wait for a slot; the workers are never more than the slots.
TEST(LoadgenRun, TheInFlightCapBoundsTheWorkers) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "{\"arrival_s\": 0, \"prompt\": \"p\", \"max_tokens\": 2}\n";
  auto trace = parse(text);
  ASSERT_TRUE(trace.is_ok()) << trace.status().to_string();
  EchoServer server(2);
  RunOptions o;
  o.port = server.port();
  o.timeout_s = 60;
  o.max_in_flight = 3;
  auto run = run_trace(*trace, o);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  ASSERT_EQ(run->results.size(), 40u);
  for (const RequestResult& r : run->results) EXPECT_TRUE(r.ok) << r.error;
  EXPECT_EQ(server.requests(), 40);
  EXPECT_LE(run->workers, 3);
  EXPECT_EQ(run->turns_handed_on, 0);
  EXPECT_LE(run->wakeups, 2 * 40 + run->workers + 1);
}

TEST(LoadgenCompare, FnvIsTheStandardOne) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ULL);
}

// Two runs of one trace, request by request: a changed text is a wrong token; a request that
// failed in the second run is counted by its error; a later turn whose prompt changed (its
// session lost an answer) is not compared.
TEST(LoadgenCompare, SameDifferentFailedAndChangedPromptsAreCountedApart) {
  auto rec = [](int line, bool ok, const std::string& text, const std::string& hash, const std::string& error = "") {
    json j = {{"line", line}, {"ok", ok}, {"text", text}, {"prompt_fnv1a", hash}};
    if (!error.empty()) j["error"] = error;
    return j;
  };
  json base = {{"requests", json::array({rec(3, true, "x y", "01"), rec(4, true, "z", "02"), rec(5, true, "w", "03"),
                                         rec(6, true, "v", "04"), rec(7, false, "", "05", "HTTP 400"),
                                         rec(8, true, "u", "06"), rec(9, true, "t", "07")})}};
  base["requests"][0]["cached_tokens"] = 16;
  base["requests"][1]["cached_tokens"] = 32;
  base["requests"][6]["cached_tokens"] = 0;
  json run = {{"requests", json::array({rec(3, true, "x y", "01"), rec(4, true, "z!", "02"),
                                        rec(5, false, "w", "03", "connect: refused"), rec(6, true, "q", "0f"),
                                        rec(7, true, "s", "05"), rec(8, false, "", "06", "connect: refused"),
                                        rec(9, true, "t", "07")})}};
  run["requests"][0]["cached_tokens"] = 32;  // same text with more of the prompt from a cache
  run["requests"][1]["cached_tokens"] = 48;  // a different text with more of it from a cache
  run["requests"][6]["cached_tokens"] = 0;
  auto c = compare_texts(base, run);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ((*c)["cached_differs"], 2);
  EXPECT_EQ((*c)["different_cached_differs"], 1);
  EXPECT_EQ((*c)["different_same_cached"], 0);
  EXPECT_EQ((*c)["requests"], 7);
  EXPECT_EQ((*c)["same"], 2);
  EXPECT_EQ((*c)["different"], 1);
  EXPECT_EQ((*c)["different_indices"], json::array({1}));
  EXPECT_EQ((*c)["failed"], 2);
  EXPECT_EQ((*c)["failed_errors"]["connect: refused"], 2);
  EXPECT_EQ((*c)["prompt_changed"], 1);
  EXPECT_EQ((*c)["failed_in_baseline"], 1);
  auto self = compare_texts(base, base);
  ASSERT_TRUE(self.is_ok());
  EXPECT_EQ((*self)["same"], 6);
  EXPECT_EQ((*self)["different"], 0);
  EXPECT_EQ((*self)["cached_differs"], 0);
  run["requests"][1]["cached_tokens"] = 32;  // the same cached amount: a wrong token for sure
  auto strict = compare_texts(base, run);
  ASSERT_TRUE(strict.is_ok());
  EXPECT_EQ((*strict)["different_same_cached"], 1);

  json shorter = base;
  shorter["requests"].erase(6);
  EXPECT_FALSE(compare_texts(base, shorter).is_ok());
  json moved = base;
  moved["requests"][2]["line"] = 50;
  EXPECT_FALSE(compare_texts(base, moved).is_ok());
  json untexted = base;
  untexted["requests"][0].erase("text");
  const auto no_text = compare_texts(base, untexted);
  ASSERT_FALSE(no_text.is_ok());
  EXPECT_NE(no_text.status().to_string().find("--record-text"), std::string::npos) << no_text.status().to_string();
}

// The end-to-end case: a real server, a handful of short requests (two sessions of three turns,
// one request the server refuses), every one accounted for.
TEST(LoadgenProcess, RunsATraceAgainstServeAndAccountsForEveryRequest) {
  testing::ServeProcess server({"-m", testing::repo_path("models/stories260K/stories260K.bin"), "--served-model-name",
                                "stories", "--listen", "127.0.0.1:0", "--max-batch", "4"});
  ASSERT_NE(server.port(), 0) << server.first_line();
  std::string text = "{\"define_prefix\": \"sys\", \"text\": \"Once upon a time, there was a little girl.\"}\n";
  for (int i = 0; i < 6; ++i) {
    text += json{{"arrival_s", 0.05 * i},
                 {"session", i % 2 == 0 ? "a" : "b"},
                 {"prefix", "sys"},
                 {"kind", "chat"},
                 {"prompt", " She went to the park."},
                 {"max_tokens", 8}}
                .dump() +
            "\n";
  }
  text += "{\"arrival_s\": 0.3, \"prompt\": \"Too long\", \"max_tokens\": 100000}\n";
  auto trace = parse(text);
  ASSERT_TRUE(trace.is_ok()) << trace.status().to_string();

  RunOptions o;
  o.port = server.port();
  o.model = "stories";
  auto before = http_get("127.0.0.1", server.port(), "/metrics", "", 30);
  ASSERT_TRUE(before.is_ok()) << before.status().to_string();
  auto run = run_trace(*trace, o);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  auto after = http_get("127.0.0.1", server.port(), "/metrics", "", 30);
  ASSERT_TRUE(after.is_ok()) << after.status().to_string();

  ASSERT_EQ(run->results.size(), 7u);
  for (size_t i = 0; i < 6; ++i) {
    const RequestResult& r = run->results[i];
    EXPECT_TRUE(r.ok) << i << ": " << r.error;
    EXPECT_EQ(r.completion_tokens, 8) << i;
    EXPECT_GT(r.ttft_s, 0) << i;
    EXPECT_GE(r.latency_s, r.ttft_s) << i;
    EXPECT_GE(r.sent_at_s, r.scheduled_at_s) << i;
    EXPECT_LE(r.gaps_s.size(), 7u) << i;
    EXPECT_FALSE(r.text.empty()) << i;
    if (i >= 2) {
      // The session's history (its prefix, earlier prompts and answers) went in front.
      EXPECT_GT(r.prompt_tokens, run->results[i - 2].prompt_tokens) << i;
      EXPECT_GE(r.sent_at_s, run->results[i - 2].sent_at_s + run->results[i - 2].latency_s - 1e-3) << i;
    }
  }
  const RequestResult& refused = run->results[6];
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(refused.error.find("HTTP 400"), std::string::npos) << refused.error;

  Slo slo;
  slo.ttft_s = 1e9;
  slo.tpot_s = 1e9;
  const json s = summarize(run->results, run->wall_s, slo);
  EXPECT_EQ(s["requests"], 7);
  EXPECT_EQ(s["ok"], 6);
  EXPECT_EQ(s["errors"], 1);
  EXPECT_EQ(s["goodput_requests"], 6);
  EXPECT_EQ(s["output_tokens"], 48);
  EXPECT_EQ(s["answers_shorter_than_max_tokens"], 0);
  for (const char* key : {"wall_s", "goodput_tokens_per_s", "output_tokens_per_s", "ttft_ms", "itl_ms", "tpot_ms",
                          "latency_s", "send_lag_s", "error_messages", "longest_prompt_tokens"}) {
    EXPECT_TRUE(s.contains(key)) << key;
  }
  for (const char* key : {"p50", "p90", "p99"}) EXPECT_GT(s["ttft_ms"][key].get<double>(), 0) << key;

  const json d = metrics_delta(parse_prometheus(*before), parse_prometheus(*after));
  ASSERT_TRUE(d.contains("serve")) << d.dump();
  EXPECT_EQ(d["serve"]["completed"], 6);
  EXPECT_EQ(d["serve"]["generated_tokens"], 48);
  EXPECT_EQ(d["serve"]["rejected"], 1);
  EXPECT_TRUE(d["serve"].contains("host_tier"));
  EXPECT_FALSE(d.contains("router"));
}

}  // namespace
}  // namespace specontext::bench::loadgen
