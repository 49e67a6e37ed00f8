// The router in-process (serving/router/router.h) in front of two in-process OpenAiServer
// replicas over stories260K, and of scripted fake replicas: answers through the router equal the
// direct ones byte for byte (streamed and not, errors too), a stream is relayed piece by piece as
// it arrives, a replica that fails before answering is marked down and the request retried on
// another, one that breaks a stream off is reported to the client in an error event, a stopped
// replica is skipped and comes back after its health check, the prefix policy keeps a
// conversation on one replica (whose prefix cache then serves it), /metrics shows the choices and
// the hit rate, and hostile bodies are bounded.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "serving/openai/openai_server.h"
#include "serving/router/router.h"
#include "tests/cluster/kv_node_tls_util.h"
#include "tests/serving/server_test_util.h"

namespace specontext::router {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

struct Reply {
  int status = 0;
  std::string body;
  std::string content_type;
  json j() const { return json::parse(body, nullptr, false); }
};

Reply send(uint16_t port, http::verb verb, const std::string& target, const std::string& body = "") {
  asio::io_context ioc;
  tcp::socket s(ioc);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  http::write(s, req);
  beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64u << 20);
  beast::error_code ec;
  http::read(s, buf, parser, ec);
  EXPECT_FALSE(ec) << ec.message();
  const auto& res = parser.get();
  return {static_cast<int>(res.result_int()), res.body(), std::string(res[http::field::content_type])};
}
Reply post(uint16_t port, const std::string& target, const json& body) {
  return send(port, http::verb::post, target, body.dump());
}

// A body with its per-request fields (the completion id and creation time) blanked.
std::string without_ids(const std::string& body) {
  static const std::regex id("\"id\":\"[^\"]*\"");
  static const std::regex created("\"created\":[0-9]+");
  return std::regex_replace(std::regex_replace(body, id, "\"id\":\"\""), created, "\"created\":0");
}

// A stream's text (every event's choices[0].text joined) and its ending events (those with a
// finish reason, the usage, [DONE]) without ids: what a stream means, whichever way the
// server grouped its tokens into events (it sends what has come when it writes: timing decides).
std::string stream_text(const std::string& body) {
  std::string text;
  for (size_t at = body.find("data: "); at != std::string::npos; at = body.find("data: ", at + 1)) {
    const json e = json::parse(body.substr(at + 6, body.find("\n\n", at) - at - 6), nullptr, false);
    if (e.is_object() && e.contains("choices") && !e["choices"].empty()) text += e["choices"][0].value("text", "");
  }
  return text;
}
std::string stream_end(const std::string& body) {
  std::string end;
  for (size_t at = body.find("data: "); at != std::string::npos; at = body.find("data: ", at + 1)) {
    const std::string event = body.substr(at, body.find("\n\n", at) + 2 - at);
    const json e = json::parse(event.substr(6), nullptr, false);
    const bool ending = event == "data: [DONE]\n\n" ||
                        (e.is_object() && (!e.contains("choices") || e["choices"].empty() ||
                                           !e["choices"][0]["finish_reason"].is_null()));
    if (ending) end += without_ids(event);
  }
  return end;
}

// The value of a /metrics line "NAME VALUE" (NAME may carry labels), or -1 when absent.
double metric(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size(), text.find('\n', at + key.size()) - at - key.size()));
}

std::vector<TokenId> stop_ids(const Tokenizer& tok) {
  std::vector<TokenId> ids = tok.stop_ids();
  ids.push_back(tok.bos_id());
  return ids;
}

// One in-process replica over its own stories260K engine.
struct Replica {
  testing::ServedModel f;
  cluster::ServerOptions options;
  std::unique_ptr<cluster::OpenAiServer> server;
  uint16_t port = 0;

  explicit Replica(bool prefix_caching) : f(testing::serve_stories260k(4)) {
    options.model_name = "stories";
    options.stop_ids = stop_ids(*f.tokenizer);
    options.scheduling.prefix_caching = prefix_caching;
    start();
  }
  void start() {
    options.port = port;  // 0 at first; the same port when restarted
    auto s = cluster::OpenAiServer::start(*f.engine, *f.tokenizer, options);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (!s.is_ok()) return;
    server = std::move(*s);
    port = server->port();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }
};

RouterOptions router_options(Policy policy, const std::vector<std::string>& urls) {
  RouterOptions o;
  o.policy.policy = policy;
  for (const std::string& u : urls) {
    auto r = parse_replica_url(u);
    EXPECT_TRUE(r.is_ok());
    if (r.is_ok()) o.replicas.push_back(*r);
  }
  o.health_interval = std::chrono::milliseconds(0);  // the tests call check_health_now
  return o;
}

std::unique_ptr<Router> start_router(const RouterOptions& o) {
  auto r = Router::start(o);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(*r) : nullptr;
}

// A scripted replica: serves connections one at a time on its own thread, each by `mode`.
class FakeReplica {
 public:
  enum class Mode {
    kCloseBeforeAnswer,  // reads the request, closes
    kBreakMidStream,     // an SSE header and one event, then closes
    kHoldMidStream,      // an SSE header and one event, waits for release(), a second event, the end
    kScript,             // an SSE header, then each of script() as its own chunk, then the end
  };
  // What kScript sends: events cut at odd places (inside an event, inside a UTF-8 character).
  static std::vector<std::string> script() {
    return {"data: {\"text\":\"Once\"}\n\n", "data: {\"text\":\" up", "on\"}\n\ndata: {\"text\":\"\xC3",
            "\xA9t\xC3\xA9\"}\n\n", ": a comment line\n\n", "data: [DONE]\n\n"};
  }
  explicit FakeReplica(Mode mode) : mode_(mode), acceptor_(ioc_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeReplica() {
    stopping_ = true;
    release();
    beast::error_code ec;
    tcp::socket s(ioc_);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port_), ec);  // unblocks accept
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  void release() {
    std::call_once(released_once_, [this] { released_.set_value(); });
  }
  int requests() const { return requests_.load(); }
  // kHoldMidStream: whether the second event waited for release() (false: it gave up waiting).
  bool held_until_released() const { return held_until_released_.load(); }

 private:
  void serve() {
    for (;;) {
      beast::error_code ec;
      tcp::socket s(ioc_);
      acceptor_.accept(s, ec);
      if (ec || stopping_) return;
      beast::flat_buffer buf;
      http::request<http::string_body> req;
      http::read(s, buf, req, ec);
      if (ec) continue;
      ++requests_;
      if (mode_ == Mode::kCloseBeforeAnswer) continue;  // closed unanswered
      const std::string head =
          "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
      auto chunk = [](const std::string& data) {
        char size[16];
        std::snprintf(size, sizeof(size), "%zx", data.size());
        return std::string(size) + "\r\n" + data + "\r\n";
      };
      if (mode_ == Mode::kScript) {
        asio::write(s, asio::buffer(head), ec);
        for (const std::string& piece : script()) asio::write(s, asio::buffer(chunk(piece)), ec);
        asio::write(s, asio::buffer(std::string("0\r\n\r\n")), ec);
        continue;
      }
      asio::write(s, asio::buffer(head + chunk("data: {\"x\":1}\n\n")), ec);
      if (mode_ == Mode::kBreakMidStream) continue;
      // The test releases this once its client has read the first event through the router; a
      // router that held the first event back would be stuck here (given up after a minute).
      held_until_released_ =
          released_.get_future().wait_for(std::chrono::seconds(60)) == std::future_status::ready && !stopping_;
      asio::write(s, asio::buffer(chunk("data: {\"x\":2}\n\n") + chunk("data: [DONE]\n\n") + "0\r\n\r\n"), ec);
    }
  }

  Mode mode_;
  asio::io_context ioc_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> requests_{0};
  std::promise<void> released_;
  std::once_flag released_once_;
  std::atomic<bool> held_until_released_{false};
};

const char* kPrompt = "Once upon a time";

TEST(RouterEndToEnd, AnswersThroughTheRouterAreByteIdenticalToDirectOnes) {
  Replica a(false), b(false);
  auto router = start_router(router_options(Policy::kRoundRobin, {a.url(), b.url()}));
  ASSERT_TRUE(router);
  const json streamed = {{"model", "stories"},
                         {"prompt", kPrompt},
                         {"max_tokens", 40},
                         {"temperature", 0},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  const json whole = {{"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0}};
  const json chat = {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}, {"max_tokens", 4}};
  const json bad = {{"prompt", kPrompt}, {"max_tokens", -3}};
  int sent = 0;
  for (const auto& [target, body] : std::vector<std::pair<std::string, json>>{{"/v1/completions", streamed},
                                                                               {"/v1/completions", whole},
                                                                               {"/v1/chat/completions", chat},
                                                                               {"/v1/completions", bad}}) {
    // Through the router twice (once to each replica, round-robin), and direct.
    for (int k = 0; k < 2; ++k) {
      const Reply via = post(router->port(), target, body);
      const Reply direct = post(k == 0 ? a.port : b.port, target, body);
      ++sent;
      EXPECT_EQ(via.status, direct.status) << body.dump();
      EXPECT_EQ(via.content_type, direct.content_type);
      if (body.contains("stream")) {
        // Events group tokens by timing on the replica, so the events' text and their ending
        // (finish reason, usage, [DONE]) are compared; the byte-identical relay of a fixed stream
        // is AStreamIsRelayedByteForByte.
        EXPECT_EQ(via.status, 200);
        EXPECT_EQ(via.content_type, "text/event-stream");
        EXPECT_FALSE(stream_text(via.body).empty());
        EXPECT_EQ(stream_text(via.body), stream_text(direct.body));
        EXPECT_EQ(stream_end(via.body), stream_end(direct.body));
        EXPECT_NE(stream_end(via.body).find("\"usage\""), std::string::npos);
        EXPECT_TRUE(via.body.ends_with("data: [DONE]\n\n"));
      } else {
        EXPECT_EQ(without_ids(via.body), without_ids(direct.body)) << body.dump();
      }
    }
  }
  const RouterCounters c = router->counters();
  EXPECT_EQ(c.requests, sent);
  EXPECT_EQ(c.proxied, sent);
  EXPECT_EQ(c.retries, 0);
  const auto rs = router->replicas();
  ASSERT_EQ(rs.size(), 2u);
  EXPECT_EQ(rs[0].counters.chosen, sent / 2);
  EXPECT_EQ(rs[1].counters.chosen, sent / 2);
  EXPECT_EQ(rs[0].counters.in_flight + rs[1].counters.in_flight, 0);
  // GET /v1/models is passed through; /health is the router's own.
  const Reply models = send(router->port(), http::verb::get, "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_EQ(models.j()["data"][0]["id"], "stories");
  const Reply health = send(router->port(), http::verb::get, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.j()["replicas_up"], 2);
}

TEST(RouterEndToEnd, AStreamIsRelayedPieceByPieceAsItArrives) {
  FakeReplica fake(FakeReplica::Mode::kHoldMidStream);
  auto router = start_router(router_options(Policy::kRoundRobin, {fake.url()}));
  ASSERT_TRUE(router);
  asio::io_context ioc;
  tcp::socket s(ioc);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), router->port()));
  const std::string body = R"({"prompt":"x","stream":true})";
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  asio::write(s, asio::buffer(req));
  // The first event comes through while the replica still holds the second.
  std::string got;
  std::array<char, 4096> buf{};
  beast::error_code ec;
  while (got.find("data: {\"x\":1}") == std::string::npos && !ec) got.append(buf.data(), s.read_some(asio::buffer(buf), ec));
  ASSERT_FALSE(ec) << ec.message();
  EXPECT_EQ(got.find("data: {\"x\":2}"), std::string::npos);
  fake.release();
  while (got.find("\r\n0\r\n\r\n") == std::string::npos && !ec) got.append(buf.data(), s.read_some(asio::buffer(buf), ec));
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_TRUE(fake.held_until_released()) << "the router held the first event back until the stream ended";
  EXPECT_NE(got.find("data: {\"x\":2}\n\n"), std::string::npos);
  EXPECT_NE(got.find("data: [DONE]\n\n"), std::string::npos);
  EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos);
  EXPECT_EQ(router->counters().proxied, 1);
}

TEST(RouterEndToEnd, AStreamIsRelayedByteForByte) {
  FakeReplica fake(FakeReplica::Mode::kScript);
  auto router = start_router(router_options(Policy::kPrefix, {fake.url()}));
  ASSERT_TRUE(router);
  std::string expected;
  for (const std::string& piece : FakeReplica::script()) expected += piece;
  const Reply r = post(router->port(), "/v1/completions", {{"prompt", "x"}, {"stream", true}});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.content_type, "text/event-stream");
  EXPECT_EQ(r.body, expected);
  // An HTTP/1.0 client gets the same bytes unchunked, the end of the stream its end.
  asio::io_context ioc;
  tcp::socket s(ioc);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), router->port()));
  const std::string body = R"({"prompt":"x","stream":true})";
  asio::write(s, asio::buffer("POST /v1/completions HTTP/1.0\r\nContent-Length: " + std::to_string(body.size()) +
                              "\r\n\r\n" + body));
  std::string got;
  std::array<char, 4096> buf{};
  beast::error_code ec;
  while (!ec) got.append(buf.data(), s.read_some(asio::buffer(buf), ec));
  EXPECT_EQ(ec, asio::error::eof);
  const size_t head_end = got.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos);
  EXPECT_EQ(got.substr(head_end + 4), expected);
  EXPECT_EQ(got.find("chunked"), std::string::npos);
  EXPECT_EQ(router->counters().proxied, 2);
}

TEST(RouterEndToEnd, AFailureBeforeAnyByteIsRetriedElsewhereAndABrokenStreamIsReported) {
  Replica a(false);
  FakeReplica closes(FakeReplica::Mode::kCloseBeforeAnswer);
  auto router = start_router(router_options(Policy::kRoundRobin, {closes.url(), a.url()}));
  ASSERT_TRUE(router);
  const json whole = {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0}};
  const Reply direct = post(a.port, "/v1/completions", whole);
  ASSERT_EQ(direct.status, 200);
  // Round-robin sends the first to the fake, which closes unanswered: retried on the real one.
  const Reply first = post(router->port(), "/v1/completions", whole);
  EXPECT_EQ(first.status, 200);
  EXPECT_EQ(without_ids(first.body), without_ids(direct.body));
  EXPECT_EQ(closes.requests(), 1);
  RouterCounters c = router->counters();
  EXPECT_EQ(c.retries, 1);
  EXPECT_EQ(c.unavailable, 0);
  auto rs = router->replicas();
  EXPECT_EQ(rs[0].counters.failures, 1);
  EXPECT_EQ(rs[0].counters.marked_down, 1);
  EXPECT_EQ(rs[0].counters.up, 0);
  // Marked down: skipped until a health check passes (the fake answers none).
  for (int i = 0; i < 3; ++i) EXPECT_EQ(post(router->port(), "/v1/completions", whole).status, 200);
  EXPECT_EQ(closes.requests(), 1);
  router->check_health_now();
  rs = router->replicas();
  EXPECT_EQ(rs[0].counters.up, 0);
  EXPECT_EQ(rs[0].counters.chosen, 1);
  EXPECT_EQ(rs[1].counters.chosen, 4);

  // A stream broken off after its first event: the client gets an error event, never a silent end.
  FakeReplica breaks(FakeReplica::Mode::kBreakMidStream);
  auto alone = start_router(router_options(Policy::kLeastLoad, {breaks.url()}));
  ASSERT_TRUE(alone);
  const Reply broken = post(alone->port(), "/v1/completions", {{"prompt", "x"}, {"stream", true}});
  EXPECT_EQ(broken.status, 200);
  const size_t first_event = broken.body.find("data: {\"x\":1}\n\n");
  const size_t error_event = broken.body.find("data: {\"error\":");
  EXPECT_NE(first_event, std::string::npos) << broken.body;
  ASSERT_NE(error_event, std::string::npos) << broken.body;
  EXPECT_LT(first_event, error_event);
  EXPECT_NE(broken.body.find("failed mid-answer"), std::string::npos);
  c = alone->counters();
  EXPECT_EQ(c.failed_mid_answer, 1);
  // Its only replica is down now: 503 naming it, counted.
  const Reply none = post(alone->port(), "/v1/completions", {{"prompt", "x"}});
  EXPECT_EQ(none.status, 503);
  EXPECT_NE(none.body.find("1 of 1 replicas down"), std::string::npos) << none.body;
  EXPECT_EQ(alone->counters().unavailable, 1);
  EXPECT_EQ(send(alone->port(), http::verb::get, "/health").status, 503);
}

TEST(RouterEndToEnd, AStoppedReplicaIsSkippedAndComesBackAfterItsHealthCheck) {
  Replica a(false), b(false);
  auto router = start_router(router_options(Policy::kRoundRobin, {a.url(), b.url()}));
  ASSERT_TRUE(router);
  const json whole = {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0}};
  const json streamed = {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0}, {"stream", true}};
  const std::string expected = post(a.port, "/v1/completions", whole).body;
  const std::string expected_stream = post(a.port, "/v1/completions", streamed).body;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(post(router->port(), "/v1/completions", whole).status, 200);
  // Gone: its listener closed, connections refused from now on (stop() alone may leave the
  // listening socket open until the server is destroyed).
  b.server.reset();
  // Six more, half of them streamed: every one answered in full by a.
  for (int i = 0; i < 6; ++i) {
    const bool stream = i % 2 == 1;
    const Reply r = post(router->port(), "/v1/completions", stream ? streamed : whole);
    EXPECT_EQ(r.status, 200) << r.body;
    if (stream) {
      EXPECT_EQ(stream_text(r.body), stream_text(expected_stream)) << i;
      EXPECT_EQ(stream_end(r.body), stream_end(expected_stream)) << i;
    } else {
      EXPECT_EQ(without_ids(r.body), without_ids(expected)) << i;
    }
  }
  RouterCounters c = router->counters();
  EXPECT_EQ(c.unavailable, 0);
  EXPECT_EQ(c.retries, 1) << "one request found b down; the rest skipped it";
  EXPECT_EQ(c.replicas_up, 1);
  auto rs = router->replicas();
  EXPECT_EQ(rs[1].counters.marked_down, 1);
  EXPECT_EQ(rs[1].counters.chosen, 2);
  EXPECT_EQ(rs[0].counters.chosen, 7);
  // b back on its port: the health check brings it back, and round-robin uses it again.
  b.start();
  ASSERT_TRUE(b.server);
  router->check_health_now();
  EXPECT_EQ(router->counters().replicas_up, 2);
  for (int i = 0; i < 2; ++i) {
    const Reply r = post(router->port(), "/v1/completions", whole);
    EXPECT_EQ(without_ids(r.body), without_ids(expected));
  }
  rs = router->replicas();
  EXPECT_EQ(rs[1].counters.chosen, 3);
  EXPECT_EQ(rs[1].counters.up, 1);
  const std::string m = send(router->port(), http::verb::get, "/metrics").body;
  const std::string label_b = "{replica=\"127.0.0.1:" + std::to_string(b.port) + "\"}";
  EXPECT_EQ(metric(m, "specontext_router_replica_up" + label_b), 1);
  EXPECT_EQ(metric(m, "specontext_router_replica_marked_down_total" + label_b), 1);
  EXPECT_EQ(metric(m, "specontext_router_replica_chosen_total" + label_b), 3);
  EXPECT_EQ(metric(m, "specontext_router_retries_total"), 1);
  EXPECT_GE(metric(m, "specontext_router_health_checks_total"), 2);
}

TEST(RouterEndToEnd, PrefixPolicyKeepsAConversationOnOneReplicaAndMetricsShowTheHitRate) {
  Replica a(true), b(true);
  RouterOptions o = router_options(Policy::kPrefix, {a.url(), b.url()});
  o.policy.chunk_bytes = 16;
  auto router = start_router(o);
  ASSERT_TRUE(router);
  const std::string story = "Once upon a time, there was a little girl named Lily. She loved to play outside";
  const std::string other = "The little dog ran to the park with his friend Tom, and they played all day long";
  auto ask = [&](const std::string& prompt) {
    const Reply r = post(router->port(), "/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_EQ(r.status, 200) << r.body;
    return r.j();
  };
  ask(story);
  const json next = ask(story + " in the sun with her ball");  // the next turn: the same replica
  ask(other);                                                  // another conversation: the other one
  EXPECT_GT(next["usage"].value("prompt_tokens_details", json::object()).value("cached_tokens", int64_t{0}), 0)
      << "the replica the next turn went to held its prefix: " << next.dump();
  auto rs = router->replicas();
  EXPECT_EQ(rs[0].counters.chosen + rs[1].counters.chosen, 3);
  EXPECT_TRUE((rs[0].counters.chosen == 2 && rs[1].counters.chosen == 1) ||
              (rs[0].counters.chosen == 1 && rs[1].counters.chosen == 2));
  EXPECT_EQ(rs[0].counters.prefix_hits + rs[1].counters.prefix_hits, 1);
  // A chat conversation: its second turn (the history plus a reply) goes where the first went.
  auto chat_turn = [&](const json& messages) {
    post(router->port(), "/v1/chat/completions", {{"messages", messages}, {"max_tokens", 4}});
    return router->replicas();
  };
  json history = json::array({{{"role", "user"}, {"content", story + story}}});
  const auto before = chat_turn(history);
  history.push_back({{"role", "assistant"}, {"content", "She smiled."}});
  history.push_back({{"role", "user"}, {"content", "And then?"}});
  const auto after = chat_turn(history);
  const RouterCounters c = router->counters();
  EXPECT_EQ(c.prefix_lookups, 5);
  EXPECT_EQ(c.prefix_hits, 2);
  EXPECT_GT(c.prefix_matched_chunks, 0);
  const std::string m = send(router->port(), http::verb::get, "/metrics").body;
  EXPECT_EQ(metric(m, "specontext_router_prefix_lookups_total"), 5);
  EXPECT_EQ(metric(m, "specontext_router_prefix_hits_total"), 2);
  EXPECT_DOUBLE_EQ(metric(m, "specontext_router_prefix_hit_rate"), 0.4);
  double chosen = 0;
  for (const auto& r : after) chosen += metric(m, "specontext_router_replica_chosen_total{replica=\"" + r.name + "\"}");
  EXPECT_EQ(chosen, 5);
  // The second chat turn went to the replica the first one did.
  for (size_t i = 0; i < 2; ++i) {
    const int64_t first_turn = before[i].counters.chosen - rs[i].counters.chosen;
    const int64_t second_turn = after[i].counters.chosen - before[i].counters.chosen;
    EXPECT_EQ(first_turn, second_turn) << "replica " << i;
  }
}

TEST(RouterEndToEnd, HostileBodiesAreBoundedAndUnreadablePromptsRouteByLoad) {
  Replica a(false);
  RouterOptions o = router_options(Policy::kPrefix, {a.url()});
  o.max_body_bytes = 4096;
  auto router = start_router(o);
  ASSERT_TRUE(router);
  // Too large: 413 from the router, the replica never asked.
  const Reply big = post(router->port(), "/v1/completions", {{"prompt", std::string(8192, 'a')}});
  EXPECT_EQ(big.status, 413);
  EXPECT_NE(big.body.find("larger than 4096 bytes"), std::string::npos);
  EXPECT_EQ(router->replicas()[0].counters.chosen, 0);
  // Not JSON, and JSON nested past the bound: not parsed for the prompt (counted), passed on, and
  // the replica's own 400 comes back.
  const Reply garbage = send(router->port(), http::verb::post, "/v1/completions", "{\"prompt\": nope");
  EXPECT_EQ(garbage.status, 400);
  const Reply deep =
      send(router->port(), http::verb::post, "/v1/completions", std::string(2000, '[') + std::string(2000, ']'));
  EXPECT_EQ(deep.status, 400);
  const RouterCounters c = router->counters();
  EXPECT_EQ(c.body_parse_errors, 2);
  EXPECT_EQ(c.prefix_lookups, 0);
  EXPECT_EQ(c.proxied, 2);
  EXPECT_EQ(c.rejected, 1);
  // Unknown routes and wrong methods: the router's own 404 / 405.
  EXPECT_EQ(send(router->port(), http::verb::get, "/v2/nothing").status, 404);
  EXPECT_EQ(send(router->port(), http::verb::get, "/v1/completions").status, 405);
  EXPECT_EQ(router->replicas()[0].counters.chosen, 2);
}

TEST(RouterEndToEnd, ApiKeysAndTlsGuardTheRouterItself) {
  Replica a(false);
  cluster::testing::TlsDir dir;
  const auto ca = dir.make_ca("ca");
  const auto leaf = dir.make_leaf(ca, "router", "IP:127.0.0.1");
  RouterOptions o = router_options(Policy::kRoundRobin, {a.url()});
  o.api_keys = {"sesame"};
  o.tls_cert_file = leaf.cert_file;
  o.tls_key_file = leaf.key_file;
  auto router = start_router(o);
  ASSERT_TRUE(router);
  const std::string body = json{{"prompt", kPrompt}, {"max_tokens", 12}, {"temperature", 0}}.dump();
  const Reply direct = post(a.port, "/v1/completions", json::parse(body));
  ASSERT_EQ(direct.status, 200);
  // Over TLS, the CA checked: without the key 401 from the router; with it, the replica's answer.
  auto https = [&](const std::string& authorization) {
    asio::io_context ioc;
    asio::ssl::context ctx(asio::ssl::context::tls_client);
    ctx.load_verify_file(ca.cert_file);
    ctx.set_verify_mode(asio::ssl::verify_peer);
    beast::ssl_stream<beast::tcp_stream> s(ioc, ctx);
    beast::get_lowest_layer(s).connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), router->port()));
    s.handshake(asio::ssl::stream_base::client);
    http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
    req.set(http::field::host, "127.0.0.1");
    if (!authorization.empty()) req.set(http::field::authorization, authorization);
    req.body() = body;
    req.prepare_payload();
    http::write(s, req);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(s, buf, res);
    return Reply{static_cast<int>(res.result_int()), res.body(), std::string(res[http::field::content_type])};
  };
  const Reply refused = https("");
  EXPECT_EQ(refused.status, 401);
  EXPECT_EQ(router->replicas()[0].counters.chosen, 0);
  const Reply wrong = https("Bearer open");
  EXPECT_EQ(wrong.status, 401);
  const Reply ok = https("Bearer sesame");
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(without_ids(ok.body), without_ids(direct.body));
  EXPECT_EQ(router->replicas()[0].counters.chosen, 1);
  // Plain HTTP to the TLS port: closed unanswered, counted.
  {
    asio::io_context ioc;
    tcp::socket s(ioc);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), router->port()));
    asio::write(s, asio::buffer(std::string("GET /health HTTP/1.1\r\nHost: x\r\n\r\n")));
    std::array<char, 256> buf{};
    beast::error_code ec;
    size_t got = 0;
    while (!ec) got += s.read_some(asio::buffer(buf), ec);
    EXPECT_EQ(std::string(buf.data(), std::min<size_t>(got, 4)).find("HTTP"), std::string::npos);
  }
  EXPECT_EQ(router->counters().tls_handshake_failures, 1);
}

}  // namespace
}  // namespace specontext::router
