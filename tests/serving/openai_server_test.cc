// The OpenAI-compatible server in-process over stories260K: answers equal the Generator's,
// streaming chunks add up to the whole answer, concurrent requests are batched and each gets the
// tokens it gets alone, stop strings and disconnects end requests and free their sequences, bad
// requests get OpenAI error objects naming the field, a full queue gets 503, stop() drains, API
// keys guard /v1/ (401, before a large body is read), connections past the limit get 503 and are closed.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <tuple>

#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "core/tokenizer/synthetic_tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "serving/generator.h"
#include "serving/openai/openai_api.h"
#include "serving/openai/openai_server.h"
#include "tests/core/tier_test_util.h"
#include "tests/serving/server_test_util.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

using Fixture = testing::ServedModel;
Fixture make_fixture(int64_t max_sequences) { return testing::serve_stories260k(max_sequences); }

std::vector<TokenId> stop_ids(const Tokenizer& tok) {
  std::vector<TokenId> ids = tok.stop_ids();
  ids.push_back(tok.bos_id());
  return ids;
}

// Prefix caching off: these tests check that a finished or cancelled request's KV is freed;
// the prefix-caching tests turn it on.
ServerOptions options_for(const Tokenizer& tok) {
  ServerOptions o;
  o.model_name = "stories";
  o.stop_ids = stop_ids(tok);
  o.scheduling.prefix_caching = false;
  return o;
}

// The pieces (decode_token of each token, as the server's stream appends them) the Generator
// gives a prompt alone: greedy, or sampled at `temperature` with `seed`.
std::vector<std::string> generator_pieces(const std::string& prompt, int64_t n, float temperature = 0.0f,
                                          uint64_t seed = 0,
                                          const std::vector<std::pair<TokenId, float>>& logit_bias = {}) {
  Fixture f = make_fixture(1);
  auto ids = f.tokenizer->encode(prompt, f.tokenizer->add_bos_by_default(), false);
  EXPECT_TRUE(ids.is_ok());
  GenerationRequest r;
  r.prompt = *ids;
  r.max_new_tokens = n;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.logit_bias = logit_bias;
  r.stop_ids = stop_ids(*f.tokenizer);
  Generator g(*f.engine, GeneratorOptions{});
  auto res = g.run({r});
  EXPECT_TRUE(res.is_ok());
  std::vector<std::string> pieces;
  TokenId prev = r.prompt.back();
  for (TokenId t : (*res)[0].tokens) {
    pieces.push_back(f.tokenizer->decode_token(prev, t));
    prev = t;
  }
  return pieces;
}

// Their concatenation: the raw bytes of the text (not necessarily valid UTF-8).
std::string generator_text(const std::string& prompt, int64_t n, float temperature = 0.0f, uint64_t seed = 0) {
  std::string text;
  for (const std::string& p : generator_pieces(prompt, n, temperature, seed)) text += p;
  return text;
}

struct Reply {
  int status = 0;
  std::string body;
  std::string content_type;
  std::string retry_after;
  std::string www_authenticate;
  json j() const { return json::parse(body, nullptr, false); }
};

Reply reply_of(const http::response<http::string_body>& res) {
  return {static_cast<int>(res.result_int()), res.body(), std::string(res[http::field::content_type]),
          std::string(res[http::field::retry_after]), std::string(res[http::field::www_authenticate])};
}

// One request on a fresh connection, or on `socket` when given (keep-alive); `authorization`:
// the Authorization header's value (none when empty).
Reply send(uint16_t port, http::verb verb, const std::string& target, const std::string& body = "",
           tcp::socket* socket = nullptr, const std::string& authorization = "") {
  asio::io_context ioc;
  tcp::socket own(ioc);
  tcp::socket& s = socket ? *socket : own;
  if (!socket) s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  if (!authorization.empty()) req.set(http::field::authorization, authorization);
  req.body() = body;
  req.prepare_payload();
  http::write(s, req);
  beast::flat_buffer buf;
  http::response<http::string_body> res;
  beast::error_code ec;
  http::read(s, buf, res, ec);
  EXPECT_FALSE(ec) << ec.message();
  return reply_of(res);
}

Reply post(uint16_t port, const std::string& target, const json& body) {
  return send(port, http::verb::post, target, body.dump());
}
Reply post_on(tcp::socket& socket, uint16_t port, const std::string& target, const json& body) {
  return send(port, http::verb::post, target, body.dump(), &socket);
}

// The data lines of an event stream, without "data: ".
std::vector<std::string> events_of(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const size_t end = body.find("\n\n", pos);
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end;
  }
  return out;
}

template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

// A stories260K server with `slots` sequence slots; the fixture outlives the server.
struct Served {
  Fixture f;
  std::unique_ptr<OpenAiServer> server;
  uint16_t port = 0;
};
Served serve_stories(int64_t slots) {
  Served s{make_fixture(slots), nullptr, 0};
  auto server = OpenAiServer::start(*s.f.engine, *s.f.tokenizer, options_for(*s.f.tokenizer));
  EXPECT_TRUE(server.is_ok()) << server.status().to_string();
  if (server.is_ok()) {
    s.server = std::move(*server);
    s.port = s.server->port();
  }
  return s;
}

const char* kPrompt = "Once upon a time";

TEST(OpenAiServer, CompletionEqualsTheGeneratorAndStreamingAddsUpToIt) {
  const std::string expected = generator_text(kPrompt, 48);
  ASSERT_FALSE(expected.empty());
  Fixture f = make_fixture(4);
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();

  Reply r = post(port, "/v1/completions",
                 {{"model", "stories"}, {"prompt", kPrompt}, {"max_tokens", 48}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.j();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "stories");
  EXPECT_EQ(j["choices"][0]["text"], expected);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);  // BOS + 4 pieces
  EXPECT_EQ(j["usage"]["completion_tokens"], 48);
  EXPECT_EQ(j["usage"]["total_tokens"], 53);

  Reply s = post(port, "/v1/completions",
                 {{"prompt", kPrompt},
                  {"max_tokens", 48},
                  {"temperature", 0},
                  {"stream", true},
                  {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_EQ(s.content_type, "text/event-stream");
  const auto events = events_of(s.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string streamed;
  size_t text_chunks = 0;
  for (size_t i = 0; i + 3 < events.size(); ++i) {
    const json c = json::parse(events[i]);
    EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    streamed += c["choices"][0]["text"].get<std::string>();
    ++text_chunks;
  }
  // Events that are ready together go out as one delta: on a loaded machine all 48 tokens can be
  // ready before the connection's coroutine runs, so this counts at least one chunk. That text
  // leaves before generation ends is AClientThatDisconnectsMidStreamHasItsRequestCancelled's check.
  EXPECT_GE(text_chunks, 1u);
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(json::parse(events[events.size() - 3])["choices"][0]["finish_reason"], "length");
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 48);

  // Token ids as the prompt give the same text.
  auto ids = f.tokenizer->encode(kPrompt, true, false);
  ASSERT_TRUE(ids.is_ok());
  Reply by_ids = post(port, "/v1/completions", {{"prompt", *ids}, {"max_tokens", 48}, {"temperature", 0}});
  ASSERT_EQ(by_ids.status, 200) << by_ids.body;
  EXPECT_EQ(by_ids.j()["choices"][0]["text"], expected);
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.accepted, 3);
  EXPECT_EQ(c.completed, 3);
  EXPECT_EQ(c.generated_tokens, 3 * 48);
}

TEST(OpenAiServer, ConcurrentRequestsAreBatchedAndEachGetsItsAloneText) {
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog", "Lily and Ben went",
                                            "One day",          "The sun was",    "Tom had a big"};
  std::vector<std::string> expected;
  for (const auto& p : prompts) expected.push_back(generator_text(p, 40));
  Fixture f = make_fixture(4);  // six requests, four slots: two wait and join as others finish
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  std::vector<std::string> got(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      json body = {{"prompt", prompts[i]}, {"max_tokens", 40}, {"temperature", 0}, {"stream", i % 2 == 1}};
      Reply r = post(port, "/v1/completions", body);
      if (r.status != 200) return;
      if (i % 2 == 0) {
        got[i] = r.j()["choices"][0]["text"];
        return;
      }
      for (const std::string& e : events_of(r.body)) {
        if (e == "[DONE]") break;
        got[i] += json::parse(e)["choices"][0]["text"].get<std::string>();
      }
    });
  }
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], expected[i]) << "request " << i;
  const ServerCounters c = (*server)->counters();
  EXPECT_GT(c.max_batch_sequences, 1) << "the requests ran in one batch";
  EXPECT_LE(c.max_batch_sequences, 4);
  EXPECT_EQ(c.completed, 6);
  EXPECT_EQ(c.running, 0);
  EXPECT_EQ(c.kv_bytes_in_use, 0);
}

TEST(OpenAiServer, StopStringsEndTheTextBeforeThemAndFreeTheSequence) {
  const std::string expected = generator_text(kPrompt, 60);
  const std::string stop = " named";
  const size_t at = expected.find(stop);
  ASSERT_NE(at, std::string::npos) << expected;
  Fixture f = make_fixture(2);
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    Reply r = post(port, "/v1/completions",
                   {{"prompt", kPrompt},
                    {"max_tokens", 60},
                    {"temperature", 0},
                    {"stop", {"zzz", stop}},
                    {"stream", stream}});
    ASSERT_EQ(r.status, 200) << r.body;
    std::string text, finish;
    if (!stream) {
      text = r.j()["choices"][0]["text"];
      finish = r.j()["choices"][0]["finish_reason"];
    } else {
      for (const std::string& e : events_of(r.body)) {
        if (e == "[DONE]") break;
        const json c = json::parse(e);
        text += c["choices"][0]["text"].get<std::string>();
        if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
      }
    }
    EXPECT_EQ(text, expected.substr(0, at));
    EXPECT_EQ(finish, "stop");
  }
  EXPECT_TRUE(eventually([&] { return (*server)->counters().running == 0; }));
  EXPECT_EQ((*server)->counters().cancelled, 0) << "a stop string is an ending, not a cancellation";
}

TEST(OpenAiServer, AClientThatDisconnectsMidStreamHasItsRequestCancelled) {
  Fixture f = make_fixture(2);
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  for (bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    const int64_t cancelled_before = (*server)->counters().cancelled;
    {
      asio::io_context ioc;
      tcp::socket s(ioc);
      s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
      const std::string body =
          json{{"prompt", kPrompt}, {"max_tokens", 400}, {"ignore_eos", true}, {"stream", stream}}.dump();
      const std::string req =
          "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body;
      asio::write(s, asio::buffer(req));
      if (stream) {
        std::string got;
        char buf[256];
        while (got.find("data: ") == std::string::npos) {
          const size_t n = s.read_some(asio::buffer(buf));
          got.append(buf, n);
        }
      } else {
        ASSERT_TRUE(eventually([&] { return (*server)->counters().running == 1; }));
      }
    }  // the client closes its connection mid-generation
    EXPECT_TRUE(eventually([&] { return (*server)->counters().cancelled == cancelled_before + 1; }));
    EXPECT_TRUE(eventually([&] { return (*server)->counters().running == 0; }));
    EXPECT_TRUE(eventually([&] { return (*server)->counters().kv_bytes_in_use == 0; }));
    EXPECT_LT((*server)->counters().generated_tokens, 800) << "generation stopped well before max_tokens";
  }
  // The server goes on serving.
  Reply r = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 5}});
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST(OpenAiServer, BadRequestsGetOpenAiErrorsNamingTheFieldAndTheConnectionStaysUsable) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_body_bytes = 4096;
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  asio::io_context ioc;
  tcp::socket keep(ioc);
  keep.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  struct Case {
    http::verb verb;
    std::string target;
    std::string body;
    int status;
    std::string param;       // expected error param ("" = null)
    std::string in_message;  // expected in the message
  };
  const std::string long_prompt = json(std::vector<int>(600, 5)).dump();
  const std::vector<Case> cases = {
      {http::verb::post, "/v1/completions", "{not json", 400, "", "not valid JSON"},
      {http::verb::post, "/v1/completions", "[1,2]", 400, "", "object"},
      {http::verb::post, "/v1/completions", R"({"prompt":"x","max_tokens":-3})", 400, "max_tokens",
       "max_tokens"},
      {http::verb::post, "/v1/completions", R"({"prompt":"x","temperature":"hot"})", 400, "temperature",
       "temperature"},
      {http::verb::post, "/v1/completions", R"({"prompt":"x","n":17})", 400, "n", "n"},
      {http::verb::post, "/v1/completions", R"({"max_tokens":3})", 400, "prompt", "prompt"},
      {http::verb::post, "/v1/completions", R"({"prompt":[1,2,99999]})", 400, "prompt", "vocabulary"},
      {http::verb::post, "/v1/completions", R"({"prompt":"x","model":"gpt-4"})", 404, "model", "gpt-4"},
      {http::verb::post, "/v1/completions", R"({"prompt":)" + long_prompt + "}", 400, "prompt",
       "maximum context length"},
      {http::verb::post, "/v1/completions", R"({"prompt":"x","max_tokens":100000})", 400, "max_tokens",
       "maximum context length"},
      {http::verb::post, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}]})", 400,
       "messages", "chat template"},
      {http::verb::get, "/v1/completions", "", 405, "", "POST"},
      {http::verb::post, "/v1/models", "", 405, "", "GET"},
      {http::verb::get, "/v2/nothing", "", 404, "", "/v2/nothing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.target + " " + c.body.substr(0, 60));
    Reply r = send(port, c.verb, c.target, c.body, &keep);
    EXPECT_EQ(r.status, c.status) << r.body;
    const json j = r.j();
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(c.in_message), std::string::npos) << r.body;
    if (c.param.empty()) {
      EXPECT_TRUE(j["error"]["param"].is_null()) << r.body;
    } else {
      EXPECT_EQ(j["error"]["param"], c.param) << r.body;
    }
  }
  // Still the same connection, and it still generates.
  Reply ok = send(port, http::verb::post, "/v1/completions", R"({"prompt":"Once","max_tokens":3})", &keep);
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.j()["usage"]["completion_tokens"], 3);
  // A body over the limit gets 413 and that connection is closed.
  Reply big = send(port, http::verb::post, "/v1/completions", std::string(5000, ' '));
  EXPECT_EQ(big.status, 413) << big.body;
  // The models list, health and metrics.
  Reply models = send(port, http::verb::get, "/v1/models");
  EXPECT_EQ(models.j()["data"][0]["id"], "stories");
  EXPECT_EQ(models.j()["data"][0]["max_model_len"], f.engine->max_context());
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200);
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_NE(metrics.body.find("specontext_requests_completed_total 1"), std::string::npos) << metrics.body;
  EXPECT_EQ((*server)->counters().accepted, 1);
}

// 150000 arrays inside each other in each field that holds a schema: before the depth check one
// such request overflowed the stack of the server's Asio thread and killed the process (139).
TEST(OpenAiServer, ADeeplyNestedBodyIsA400NamingTheFieldAndTheServerGoesOn) {
  Served s = serve_stories(1);
  ASSERT_NE(s.server, nullptr);
  const std::string deep = std::string(150000, '[') + std::string(150000, ']');
  const std::string messages = R"("messages":[{"role":"user","content":"hi"}])";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"/v1/completions", R"({"prompt":"x","guided_json":{"properties":{"a":)" + deep + "}}}", "guided_json"},
      {"/v1/completions",
       R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"items":)" +
           deep + "}}}}",
       "response_format"},
      {"/v1/chat/completions",
       "{" + messages + R"(,"tools":[{"type":"function","function":{"name":"f","parameters":{"items":)" +
           deep + "}}}]}",
       "tools"},
      {"/v1/completions", R"({"prompt":"x","guided_json":")" + deep + R"("})", "guided_json"},
  };
  for (const auto& [target, body, field] : cases) {
    SCOPED_TRACE(field);
    Reply r = send(s.port, http::verb::post, target, body);
    EXPECT_EQ(r.status, 400) << r.body.substr(0, 300);
    const json j = r.j();
    ASSERT_TRUE(j.contains("error")) << r.body.substr(0, 300);
    EXPECT_EQ(j["error"]["param"], field);
    EXPECT_NE(j["error"]["message"].get<std::string>().find("deeper than 128 levels"), std::string::npos)
        << j.dump();
  }
  Reply ok = post(s.port, "/v1/completions", json{{"prompt", kPrompt}, {"max_tokens", 3}});
  EXPECT_EQ(ok.status, 200) << ok.body;
}

TEST(OpenAiServer, AFullQueueAnswers503AndNothingAcceptedIsLost) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_waiting = 1;
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  // One running (the only slot), one waiting: the third is refused.
  std::vector<Reply> first(2);
  std::thread a([&] {
    first[0] =
        post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 300}, {"ignore_eos", true}});
  });
  ASSERT_TRUE(eventually([&] { return (*server)->counters().running == 1; }));
  std::thread b([&] {
    first[1] = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 20}, {"temperature", 0}});
  });
  ASSERT_TRUE(eventually([&] { return (*server)->counters().waiting == 1; }));
  Reply third = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 20}});
  EXPECT_EQ(third.status, 503) << third.body;
  EXPECT_NE(third.j()["error"]["message"].get<std::string>().find("busy"), std::string::npos);
  a.join();
  b.join();
  EXPECT_EQ(first[0].status, 200);
  EXPECT_EQ(first[0].j()["usage"]["completion_tokens"], 300);
  EXPECT_EQ(first[1].status, 200);
  EXPECT_EQ(first[1].j()["choices"][0]["text"], generator_text(kPrompt, 20));
}

TEST(OpenAiServer, StopDrainsAcceptedRequestsThenRefusesAndWithoutDrainEndsStreamsWithAnError) {
  Fixture f = make_fixture(2);
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  Reply drained;
  std::thread a([&] {
    drained = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 100}, {"ignore_eos", true}});
  });
  ASSERT_TRUE(eventually([&] { return (*server)->counters().running == 1; }));
  (*server)->stop(std::chrono::seconds(60));
  a.join();
  EXPECT_EQ(drained.status, 200) << drained.body;
  EXPECT_EQ(drained.j()["usage"]["completion_tokens"], 100);
  // The listener is closed.
  asio::io_context ioc;
  tcp::socket s(ioc);
  beast::error_code ec;
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port), ec);
  EXPECT_TRUE(ec) << "connected after stop()";

  // No drain time: a running stream ends with an error event and [DONE]. stories260K writes its
  // 400 tokens in well under a second, so on a loaded machine the stream can end before stop()
  // lands; then the case is tried again (it did not test anything).
  bool stopped_mid_stream = false;
  for (int attempt = 0; attempt < 10 && !stopped_mid_stream; ++attempt) {
    Fixture g = make_fixture(1);
    auto server2 = OpenAiServer::start(*g.engine, *g.tokenizer, options_for(*g.tokenizer));
    ASSERT_TRUE(server2.is_ok());
    Reply cut;
    std::thread c([&] {
      cut = post((*server2)->port(), "/v1/completions",
                 {{"prompt", kPrompt}, {"max_tokens", 400}, {"ignore_eos", true}, {"stream", true}});
    });
    ASSERT_TRUE(eventually([&] { return (*server2)->counters().generated_tokens > 3; }));
    (*server2)->stop();
    c.join();
    // On a loaded machine the connection's coroutine may not have written the stream's headers
    // before stop(): the tokens and the cancellation then arrive together and the answer is a
    // plain 503 naming the shutdown. Correct, but not the case under test: try again.
    if (cut.status == 503) {
      EXPECT_NE(cut.body.find("shutting down"), std::string::npos) << cut.body;
      continue;
    }
    ASSERT_EQ(cut.status, 200) << cut.body;
    const auto events = events_of(cut.body);
    ASSERT_GE(events.size(), 2u);
    EXPECT_EQ(events.back(), "[DONE]");
    if ((*server2)->counters().completed == 1) continue;  // it finished first
    stopped_mid_stream = true;
    const json err = json::parse(events[events.size() - 2]);
    EXPECT_NE(err["error"]["message"].get<std::string>().find("shutting down"), std::string::npos) << cut.body;
  }
  EXPECT_TRUE(stopped_mid_stream) << "ten streams all finished, or were refused whole, before stop()";
}

// A byte-level ChatML tokenizer (256 byte tokens + <|im_start|> 256 + <|im_end|> 257) over a
// random model of that vocabulary: /v1/chat/completions renders the Qwen template, answers a
// chat.completion whose content is the Generator's text for the same ids, and streams chunks
// whose first delta carries the role.
// A byte-level ChatML (Qwen) tokenizer over 256 byte tokens and <|im_start|> / <|im_end|>, and a
// random model of its vocabulary: chat without a bundled chat model.
struct ChatToy {
  std::unique_ptr<Tokenizer> tok;
  std::shared_ptr<Model> model;
};
ChatToy chat_toy(int64_t max_seq_len = 2048) {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    std::string piece;
    tokenizer_internal::append_utf8(piece, printable ? b : 256 + next++);
    vocab[piece] = b;
  }
  const json tj = {
      {"added_tokens", json::array({{{"id", 256}, {"content", "<|im_start|>"}, {"special", true}},
                                    {{"id", 257}, {"content", "<|im_end|>"}, {"special", true}}})},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers", json::array({{{"type", "Split"},
                                        {"pattern", {{"Regex", tokenizer_internal::kQwen2Regex}}},
                                        {"behavior", "Isolated"}},
                                       {{"type", "ByteLevel"}, {"use_regex", false}}})}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
  auto tok = tokenizer_internal::parse_hf_tokenizer_json(tj.dump(), "chatml.json");
  EXPECT_TRUE(tok.is_ok()) << tok.status().to_string();
  auto config = synthetic_config("toy");
  EXPECT_TRUE(config.is_ok());
  config->vocab_size = 258;
  config->max_seq_len = max_seq_len;
  auto model = make_random_model(*config, DType::kF32, 5);
  EXPECT_TRUE(model.is_ok());
  return {std::move(*tok), std::move(*model)};
}

// A Qwen-template server on the random ChatML model, prefix caching off so that every
// sequence's KV is freed at the end; server null (and a failure reported) when it cannot start.
struct ToolServer {
  ChatToy toy;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<OpenAiServer> server;
};
ToolServer tool_server(ChatTemplate chat_template = ChatTemplate::kQwen) {
  ToolServer out{chat_toy(), nullptr, nullptr};
  EngineOptions eo;
  eo.max_sequences = 4;
  auto engine = Engine::create(out.toy.model, testing::cpu_backend(), eo);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  if (!engine.is_ok()) return out;
  out.engine = std::move(*engine);
  ServerOptions o;
  o.chat_template = chat_template;
  o.stop_ids = out.toy.tok->stop_ids();
  o.scheduling.prefix_caching = false;
  auto server = OpenAiServer::start(*out.engine, *out.toy.tok, o);
  EXPECT_TRUE(server.is_ok()) << server.status().to_string();
  if (server.is_ok()) out.server = std::move(*server);
  return out;
}

// A chat template with no place for tools (DeepSeek-R1's) refuses a request that offers them,
// rather than answering as if the model had seen them; without tools, or with tool_choice
// "none" (the tools are then not rendered anyway), it answers.
TEST(OpenAiServer, ToolsOnATemplateWithoutThemAreRefused) {
  ToolServer ts = tool_server(ChatTemplate::kDeepSeekR1);
  ASSERT_TRUE(ts.server) << "see the failure above";
  const uint16_t port = ts.server->port();
  const std::string start = R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"max_tokens":2,)";
  const std::string tools = R"("tools":[{"type":"function","function":{"name":"now"}}],)";
  for (const char* choice : {R"("auto")", R"("required")", R"({"type":"function","function":{"name":"now"}})"}) {
    Reply r = send(port, http::verb::post, "/v1/chat/completions",
                   start + tools + R"("tool_choice":)" + choice + "}");
    EXPECT_EQ(r.status, 400) << choice << ": " << r.body;
    EXPECT_EQ(r.j()["error"]["param"], "tools") << r.body;
    EXPECT_NE(r.body.find("deepseek-r1"), std::string::npos) << r.body;
  }
  EXPECT_EQ(send(port, http::verb::post, "/v1/chat/completions", start + tools + R"("tool_choice":"none"})").status, 200);
  Reply plain = send(port, http::verb::post, "/v1/chat/completions", start + R"("temperature":0})");
  ASSERT_EQ(plain.status, 200) << plain.body;
  // The prompt is the R1 rendering, encoded as the server encodes chats.
  auto ids = ts.toy.tok->encode(apply_chat_template(ChatTemplate::kDeepSeekR1, {{"user", "Weather in Paris?"}}),
                                false, true);
  ASSERT_TRUE(ids.is_ok());
  EXPECT_EQ(plain.j()["usage"]["prompt_tokens"].get<int64_t>(), static_cast<int64_t>(ids->size())) << plain.body;
}

// tool_choice with a named function: the text is its arguments, valid against its parameters
// (keys in the schema's order), answered as message.tool_calls with a null content and "stop";
// "required": an array of calls of the tools, answered as tool_calls with "tool_calls"; "auto":
// free text, calls in the model's own syntax read back. The tools are rendered into the prompt
// unless tool_choice is "none"; a history of calls and results is rendered too.
TEST(OpenAiServer, ToolChoiceCallsANamedFunctionOrTheRequiredOnes) {
  ToolServer ts = tool_server();
  ASSERT_TRUE(ts.server) << "see the failure above";
  const uint16_t port = ts.server->port();
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","description":"The weather in a city",)"
      R"("parameters":{"type":"object","properties":{"zcity":{"type":"string","maxLength":8},"unit":{"enum":["c","f"]}},)"
      R"("required":["zcity","unit"],"additionalProperties":false}}},{"type":"function","function":{"name":"now"}}])";
  const std::string messages = R"("messages":[{"role":"user","content":"Weather in Paris?"}])";
  auto body = [&](const std::string& rest) { return "{" + messages + "," + tools + "," + rest + "}"; };
  auto valid_weather = [](const nlohmann::ordered_json& a) {
    return a.is_object() && a.size() == 2 && a.begin().key() == "zcity" && a["zcity"].is_string() &&
           a["zcity"].get<std::string>().size() <= 8 * 4 && (a["unit"] == "c" || a["unit"] == "f");
  };

  Reply named = send(port, http::verb::post, "/v1/chat/completions",
                     body(R"("tool_choice":{"type":"function","function":{"name":"get_weather"}},"max_tokens":80,"temperature":0)"));
  ASSERT_EQ(named.status, 200) << named.body;
  const json nj = named.j();
  const json& message = nj["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null()) << named.body;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << named.body;
  const json& call = message["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("call_")) << call;
  EXPECT_EQ(call["function"]["name"], "get_weather");
  const auto args = nlohmann::ordered_json::parse(call["function"]["arguments"].get<std::string>(), nullptr, false);
  EXPECT_TRUE(valid_weather(args)) << call;
  EXPECT_EQ(nj["choices"][0]["finish_reason"], "stop");

  // The tools reach the prompt unless tool_choice is "none".
  Reply none = send(port, http::verb::post, "/v1/chat/completions",
                    body(R"("tool_choice":"none","max_tokens":2,"temperature":0)"));
  ASSERT_EQ(none.status, 200) << none.body;
  EXPECT_FALSE(none.j()["choices"][0]["message"].contains("tool_calls"));
  EXPECT_GT(nj["usage"]["prompt_tokens"].get<int64_t>(), none.j()["usage"]["prompt_tokens"].get<int64_t>() + 100);

  // "required", sampled; ']' pushed up so that a random model ends its list of calls.
  Reply required = send(port, http::verb::post, "/v1/chat/completions",
                        body(R"("tool_choice":"required","max_tokens":300,"temperature":1,"n":3,"seed":7,)"
                             R"("logit_bias":{"93":6})"));
  ASSERT_EQ(required.status, 200) << required.body;
  const json rj = required.j();
  int called = 0;
  for (const json& c : rj["choices"]) {
    if (c["finish_reason"] != "tool_calls") {
      EXPECT_EQ(c["finish_reason"], "length") << c;
      EXPECT_FALSE(c["message"]["content"].get<std::string>().empty()) << c;
      continue;
    }
    ++called;
    EXPECT_TRUE(c["message"]["content"].is_null()) << c;
    ASSERT_GE(c["message"]["tool_calls"].size(), 1u) << c;
    for (const json& tc : c["message"]["tool_calls"]) {
      const auto a = nlohmann::ordered_json::parse(tc["function"]["arguments"].get<std::string>(), nullptr, false);
      if (tc["function"]["name"] == "now") {
        EXPECT_EQ(a, nlohmann::ordered_json::object()) << tc;
      } else {
        EXPECT_EQ(tc["function"]["name"], "get_weather") << tc;
        EXPECT_TRUE(valid_weather(a)) << tc;
      }
    }
  }
  EXPECT_GE(called, 1) << required.body;

  // "auto", the default with tools: they are shown as for a call and the text is free; calls
  // the model writes in its own syntax (here Qwen's, forced by guided_choice) are read back.
  Reply auto_free = send(port, http::verb::post, "/v1/chat/completions", body(R"("max_tokens":4,"temperature":0)"));
  ASSERT_EQ(auto_free.status, 200) << auto_free.body;
  EXPECT_EQ(auto_free.j()["usage"]["prompt_tokens"], nj["usage"]["prompt_tokens"]);
  EXPECT_FALSE(auto_free.j()["choices"][0]["message"].contains("tool_calls")) << auto_free.body;
  EXPECT_TRUE(auto_free.j()["choices"][0]["message"]["content"].is_string()) << auto_free.body;
  Reply auto_call = send(
      port, http::verb::post, "/v1/chat/completions",
      body(R"("tool_choice":"auto","max_tokens":200,"guided_choice":["Checking.\n<tool_call>\n{\"name\": \"get_weather\", )"
           R"(\"arguments\": {\"zcity\": \"Rome\", \"unit\": \"c\"}}\n</tool_call>"])"));
  ASSERT_EQ(auto_call.status, 200) << auto_call.body;
  const json auto_body = auto_call.j();
  const json& auto_choice = auto_body["choices"][0];
  EXPECT_EQ(auto_choice["finish_reason"], "tool_calls") << auto_call.body;
  EXPECT_EQ(auto_choice["message"]["content"], "Checking.") << auto_call.body;
  ASSERT_EQ(auto_choice["message"]["tool_calls"].size(), 1u) << auto_call.body;
  EXPECT_EQ(auto_choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(auto_choice["message"]["tool_calls"][0]["function"]["arguments"], R"({"zcity": "Rome", "unit": "c"})");

  // A history of a call and its result is rendered (longer prompt), and the answer goes on.
  const std::string history =
      R"({"messages":[{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":null,)"
      R"("tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather",)"
      R"("arguments":"{\"zcity\": \"Paris\", \"unit\": \"c\"}"}}]},)"
      R"({"role":"tool","tool_call_id":"call_1","content":"21 degrees"}],"max_tokens":2,"temperature":0})";
  Reply after = send(port, http::verb::post, "/v1/chat/completions", history);
  ASSERT_EQ(after.status, 200) << after.body;
  EXPECT_GT(after.j()["usage"]["prompt_tokens"].get<int64_t>(), none.j()["usage"]["prompt_tokens"].get<int64_t>() + 40);
  EXPECT_TRUE(eventually([&] { return ts.server->counters().kv_bytes_in_use == 0; }));
}

// A chat stream put together as a client does: per choice the content, the tool calls (id and
// name from a call's first delta, its arguments appended in order) and the finish reason; each
// tool_calls delta's event position in `first_call_event`, the first content's in `first_content_event`.
struct AssembledChoice {
  std::string content;
  json calls = json::array();  // [{"name", "arguments"}], ids checked and dropped
  std::string finish_reason;
  int arguments_deltas = 0;
  size_t first_content_event = SIZE_MAX;
  size_t first_call_event = SIZE_MAX;
};
std::vector<AssembledChoice> assemble_chat_stream(const std::string& body) {
  std::vector<AssembledChoice> out;
  const std::vector<std::string> events = events_of(body);
  for (size_t e = 0; e < events.size() && events[e] != "[DONE]"; ++e) {
    const json chunk = json::parse(events[e]);
    for (const json& c : chunk["choices"]) {
      const size_t i = c["index"];
      if (out.size() <= i) out.resize(i + 1);
      AssembledChoice& a = out[i];
      const json& d = c["delta"];
      if (d.contains("content") && d["content"].is_string() && !d["content"].get<std::string>().empty()) {
        a.content += d["content"].get<std::string>();
        a.first_content_event = std::min(a.first_content_event, e);
      }
      for (const json& tc : d.value("tool_calls", json::array())) {
        a.first_call_event = std::min(a.first_call_event, e);
        const size_t k = tc["index"];
        if (k == a.calls.size()) {
          EXPECT_TRUE(tc["id"].get<std::string>().starts_with("call_")) << tc;
          EXPECT_EQ(tc["type"], "function") << tc;
          a.calls.push_back({{"name", tc["function"]["name"]}, {"arguments", ""}});
        } else {
          EXPECT_LT(k, a.calls.size()) << "a call's deltas come in order: " << tc;
          EXPECT_FALSE(tc.contains("id")) << "only a call's first delta names it: " << tc;
          if (k >= a.calls.size()) continue;
        }
        const std::string piece = tc["function"]["arguments"];
        a.arguments_deltas += piece.empty() ? 0 : 1;
        a.calls[k]["arguments"] = a.calls[k]["arguments"].get<std::string>() + piece;
      }
      if (!c["finish_reason"].is_null()) a.finish_reason = c["finish_reason"];
    }
  }
  return out;
}

// Streamed, every tool_choice adds up to the answer it gets without streaming (ids aside): a
// named function's arguments in pieces as they are generated; "auto" content before the call
// while it is generated, the calls once the reply is complete; "required" sampled with n = 3.
TEST(OpenAiServer, StreamedToolCallsAddUpToTheWholeAnswer) {
  ToolServer ts = tool_server();
  ASSERT_TRUE(ts.server) << "see the failure above";
  const uint16_t port = ts.server->port();
  const json base = json::parse(
      R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"tools":[{"type":"function","function":)"
      R"({"name":"get_weather","parameters":{"type":"object","properties":{"zcity":{"type":"string","maxLength":8},)"
      R"("unit":{"enum":["c","f"]}},"required":["zcity","unit"],"additionalProperties":false}}},)"
      R"({"type":"function","function":{"name":"now"}}]})");
  const json cases[] = {
      {{"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}, {"max_tokens", 80}, {"temperature", 0}},
      {{"tool_choice", "required"}, {"max_tokens", 300}, {"temperature", 1}, {"n", 3}, {"seed", 7}, {"logit_bias", {{"93", 6}}}},
      {{"tool_choice", "auto"}, {"max_tokens", 200},
       {"guided_choice", {"Checking the weather now.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"zcity\": \"Rome\", \"unit\": \"c\"}}\n</tool_call>"}}},
      {{"max_tokens", 6}, {"temperature", 0}},  // "auto" by default, a free reply
  };
  int called = 0;
  for (const json& extra : cases) {
    SCOPED_TRACE(extra.dump());
    json whole_body = base;
    whole_body.update(extra);
    Reply whole = post(port, "/v1/chat/completions", whole_body);
    ASSERT_EQ(whole.status, 200) << whole.body;
    json stream_body = whole_body;
    stream_body["stream"] = true;
    Reply streamed = post(port, "/v1/chat/completions", stream_body);
    ASSERT_EQ(streamed.status, 200) << streamed.body;
    const std::vector<AssembledChoice> got = assemble_chat_stream(streamed.body);
    const json want = whole.j()["choices"];
    ASSERT_EQ(got.size(), want.size()) << streamed.body;
    for (size_t i = 0; i < got.size(); ++i) {
      const json& m = want[i]["message"];
      EXPECT_EQ(got[i].content, m["content"].is_null() ? "" : m["content"].get<std::string>()) << streamed.body;
      EXPECT_EQ(got[i].finish_reason, want[i]["finish_reason"]) << streamed.body;
      json want_calls = json::array();
      for (const json& tc : m.value("tool_calls", json::array())) {
        want_calls.push_back({{"name", tc["function"]["name"]}, {"arguments", tc["function"]["arguments"]}});
      }
      EXPECT_EQ(got[i].calls, want_calls) << streamed.body;
      called += want_calls.empty() ? 0 : 1;
    }
    if (extra.contains("tool_choice") && extra["tool_choice"].is_object()) {
      // The arguments come as deltas of what was generated since the last write: one per token on
      // an idle machine, fewer when the I/O thread falls behind the engine (a loaded 2-core CI
      // machine gave one delta in 3 of 4 full runs), so more than one cannot be required.
      EXPECT_GE(got[0].arguments_deltas, 1) << "the arguments come as tool_calls deltas";
    }
    if (extra.contains("guided_choice")) {
      EXPECT_EQ(got[0].content, "Checking the weather now.");
      EXPECT_LT(got[0].first_content_event, got[0].first_call_event) << streamed.body;
      EXPECT_EQ(got[0].finish_reason, "tool_calls");
    }
  }
  EXPECT_GE(called, 3) << "named, auto and at least one required choice called";
}

TEST(OpenAiServer, ChatCompletionsRenderTheTemplateAndEqualTheGenerator) {
  ChatToy toy = chat_toy(256);
  const std::unique_ptr<Tokenizer>* tok = &toy.tok;  // as Results are used below
  const std::shared_ptr<Model>* model = &toy.model;
  auto make = [&](int64_t slots) {
    EngineOptions eo;
    eo.max_sequences = slots;
    auto e = Engine::create(*model, testing::cpu_backend(), eo);
    EXPECT_TRUE(e.is_ok());
    return std::move(*e);
  };
  const std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Hi there"}};
  auto ids = (*tok)->encode(apply_chat_template(ChatTemplate::kQwen, msgs), false, true);
  ASSERT_TRUE(ids.is_ok());
  GenerationRequest gr;
  gr.prompt = *ids;
  gr.max_new_tokens = 24;
  gr.stop_ids = (*tok)->stop_ids();
  auto alone_engine = make(1);
  Generator g(*alone_engine, GeneratorOptions{});
  auto res = g.run({gr});
  ASSERT_TRUE(res.is_ok());
  std::string raw;
  TokenId prev = gr.prompt.back();
  for (TokenId t : (*res)[0].tokens) {
    raw += (*tok)->decode_token(prev, t);
    prev = t;
  }
  const std::string expected = sanitize_utf8(raw);
  ASSERT_GT((*res)[0].tokens.size(), 3u) << "a reply worth comparing";

  auto engine = make(2);
  ServerOptions o;
  o.chat_template = ChatTemplate::kQwen;
  o.stop_ids = (*tok)->stop_ids();
  auto server = OpenAiServer::start(*engine, **tok, o);
  ASSERT_TRUE(server.is_ok());
  const json body = {{"messages", {{{"role", "system"}, {"content", "Be brief."}},
                                   {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi there"}}}}}}},
                     {"max_tokens", 24},
                     {"temperature", 0}};
  Reply r = post((*server)->port(), "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.j();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], expected);
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int64_t>(ids->size()));
  EXPECT_EQ(j["choices"][0]["finish_reason"], (*res)[0].finish == FinishReason::kStop ? "stop" : "length");
  // /tokenize of the same messages gives the ids the chat API computed (the template's own
  // special tokens parsed, no BOS added); token_strs spell the rendered conversation as text
  // decodes (control tokens are empty).
  Reply tokenized = post((*server)->port(), "/tokenize",
                         {{"messages", body["messages"]}, {"return_token_strs", true}});
  ASSERT_EQ(tokenized.status, 200) << tokenized.body;
  EXPECT_EQ(tokenized.j()["tokens"], json(*ids));
  EXPECT_EQ(tokenized.j()["count"], ids->size());
  std::string spelled;
  const json tokenized_json = tokenized.j();  // alive across the loop
  for (const json& piece : tokenized_json["token_strs"]) spelled += piece.get<std::string>();
  std::string rendered = apply_chat_template(ChatTemplate::kQwen, msgs);
  for (const std::string special : {"<|im_start|>", "<|im_end|>"}) {
    for (size_t at; (at = rendered.find(special)) != std::string::npos;) rendered.erase(at, special.size());
  }
  EXPECT_EQ(spelled, rendered) << tokenized.body;
  EXPECT_EQ(post((*server)->port(), "/tokenize", {{"messages", body["messages"]}, {"add_generation_prompt", false}})
                .status,
            400);

  json sbody = body;
  sbody["stream"] = true;
  Reply s = post((*server)->port(), "/v1/chat/completions", sbody);
  ASSERT_EQ(s.status, 200) << s.body;
  const auto events = events_of(s.body);
  ASSERT_GE(events.size(), 3u);
  const json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string streamed;
  for (const std::string& e : events) {
    if (e == "[DONE]") break;
    const json c = json::parse(e);
    if (c["choices"][0]["delta"].contains("content")) streamed += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, expected);

  // The next turn (the history, the reply, a new question) is answered from the cache (prefix
  // caching is on by default) with the Generator's reply to the whole rendered conversation.
  const std::vector<ChatMessage> turn2 = {
      {"system", "Be brief."}, {"user", "Hi there"}, {"assistant", expected}, {"user", "And then?"}};
  auto ids2 = (*tok)->encode(apply_chat_template(ChatTemplate::kQwen, turn2), false, true);
  ASSERT_TRUE(ids2.is_ok());
  GenerationRequest gr2 = gr;
  gr2.prompt = *ids2;
  auto res2 = g.run({gr2});
  ASSERT_TRUE(res2.is_ok());
  std::string raw2;
  prev = gr2.prompt.back();
  for (TokenId t : (*res2)[0].tokens) {
    raw2 += (*tok)->decode_token(prev, t);
    prev = t;
  }
  json body2 = body;
  body2["messages"].push_back({{"role", "assistant"}, {"content", expected}});
  body2["messages"].push_back({{"role", "user"}, {"content", "And then?"}});
  Reply r2 = post((*server)->port(), "/v1/chat/completions", body2);
  ASSERT_EQ(r2.status, 200) << r2.body;
  EXPECT_EQ(r2.j()["choices"][0]["message"]["content"], sanitize_utf8(raw2));
  EXPECT_EQ(r2.j()["usage"]["prompt_tokens"], static_cast<int64_t>(ids2->size()));
  EXPECT_GE(r2.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(),
            static_cast<int64_t>(ids->size()) / 16 * 16)
      << r2.body;

  // Logprobs, streamed: every token once, its raw bytes adding up to the reply's bytes (tokens of
  // this byte-level vocabulary split UTF-8 sequences, so only the bytes add up exactly).
  sbody["logprobs"] = true;
  sbody["top_logprobs"] = 2;
  Reply l = post((*server)->port(), "/v1/chat/completions", sbody);
  ASSERT_EQ(l.status, 200) << l.body;
  std::string bytes, lp_streamed;
  size_t entries = 0;
  for (const std::string& e : events_of(l.body)) {
    if (e == "[DONE]") break;
    const json c = json::parse(e);
    if (c["choices"].empty()) continue;
    if (c["choices"][0]["delta"].contains("content")) lp_streamed += c["choices"][0]["delta"]["content"].get<std::string>();
    if (c["choices"][0]["logprobs"].is_null()) continue;
    for (const json& entry : c["choices"][0]["logprobs"]["content"]) {
      ++entries;
      for (const json& b : entry["bytes"]) bytes.push_back(static_cast<char>(b.get<int>()));
      EXPECT_LE(entry["logprob"].get<double>(), 0.0);
      ASSERT_EQ(entry["top_logprobs"].size(), 2u);
      EXPECT_EQ(entry["top_logprobs"][0]["logprob"], entry["logprob"]) << "greedy: the chosen token is the top";
    }
  }
  EXPECT_EQ(lp_streamed, expected);
  EXPECT_EQ(entries, (*res)[0].tokens.size());
  EXPECT_EQ(bytes, raw);

  // vLLM's prompt_logprobs: at the top of a chat answer, one entry per prompt token (the first
  // null), and on the first chunk of a stream.
  json pbody = body;
  pbody["prompt_logprobs"] = 1;
  Reply p = post((*server)->port(), "/v1/chat/completions", pbody);
  ASSERT_EQ(p.status, 200) << p.body;
  const json plp = p.j()["prompt_logprobs"];
  ASSERT_EQ(plp.size(), ids->size()) << p.body;
  EXPECT_TRUE(plp[0].is_null());
  for (size_t i = 1; i < ids->size(); ++i) EXPECT_TRUE(plp[i].contains(std::to_string((*ids)[i]))) << i;
  EXPECT_EQ(p.j()["choices"][0]["message"]["content"], expected) << "the answer is unchanged";
  pbody["stream"] = true;
  Reply ps = post((*server)->port(), "/v1/chat/completions", pbody);
  ASSERT_EQ(ps.status, 200);
  const auto pevents = events_of(ps.body);
  ASSERT_FALSE(pevents.empty());
  EXPECT_EQ(json::parse(pevents[0])["prompt_logprobs"], plp);
  for (size_t e = 1; e < pevents.size() && pevents[e] != "[DONE]"; ++e) {
    EXPECT_FALSE(json::parse(pevents[e]).contains("prompt_logprobs")) << "only the first chunk";
  }
}

// A KV pool too small for three requests at their final lengths: the server's preempting
// admission runs them together, recomputes the one that gives way, and each gets its alone text;
// with reserving admission they run one at a time. With prefix caching and an offload store the
// one that gives way is swapped out to the store and back (specontext_preemption_swaps_total).
TEST(OpenAiServer, PreemptingAdmissionBatchesWhatReservingRunsOneAtATime) {
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog", "Lily and Ben went"};
  std::vector<std::string> expected;
  for (const auto& p : prompts) expected.push_back(generator_text(p, 190));
  for (const bool swap : {false, true}) {
    for (AdmissionPolicy policy : {AdmissionPolicy::kPreempt, AdmissionPolicy::kReserve}) {
      if (swap && policy == AdmissionPolicy::kReserve) continue;  // nothing is preempted
      SCOPED_TRACE(swap ? "preempt, swap" : policy == AdmissionPolicy::kPreempt ? "preempt" : "reserve");
      Fixture f;
      auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
      ASSERT_TRUE(m.is_ok());
      f.model = *m;
      auto t = load_tokenizer_for(*f.model, "");
      ASSERT_TRUE(t.is_ok());
      f.tokenizer = std::move(*t);
      EngineOptions eo;
      eo.max_sequences = 3;
      eo.kv_pages = 20;  // 320 tokens; each request reaches about 195
      auto e = Engine::create(f.model, testing::cpu_backend(), eo);
      ASSERT_TRUE(e.is_ok());
      f.engine = std::move(*e);
      ServerOptions o = options_for(*f.tokenizer);
      o.scheduling.admission = policy;
      o.scheduling.prefix_caching = swap;
      o.scheduling.prefix_offload_bytes = swap ? uint64_t{8} << 20 : 0;
      auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
      ASSERT_TRUE(server.is_ok());
      const uint16_t port = (*server)->port();
      std::vector<std::string> got(prompts.size());
      std::vector<std::thread> clients;
      for (size_t i = 0; i < prompts.size(); ++i) {
        clients.emplace_back([&, i] {
          Reply r =
              post(port, "/v1/completions",
                   {{"prompt", prompts[i]}, {"max_tokens", 190}, {"temperature", 0}, {"ignore_eos", false}});
          if (r.status == 200) got[i] = r.j()["choices"][0]["text"];
        });
      }
      for (auto& c : clients) c.join();
      for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], expected[i]) << "request " << i;
      const ServerCounters c = (*server)->counters();
      EXPECT_EQ(c.completed, 3);
      if (policy == AdmissionPolicy::kPreempt) {
        EXPECT_GE(c.max_batch_sequences, 2);
        EXPECT_GE(c.preemptions, 1);
        EXPECT_EQ(c.preemption_swaps, swap ? c.preemptions : 0);
        EXPECT_EQ(c.prefix_restores, c.preemption_swaps) << "each swapped-out request came back once";
      } else {
        EXPECT_EQ(c.max_batch_sequences, 1);
        EXPECT_EQ(c.preemptions, 0);
      }
      if (swap) {
        const Reply metrics = send(port, http::verb::get, "/metrics");
        EXPECT_NE(
            metrics.body.find("specontext_preemption_swaps_total " + std::to_string(c.preemption_swaps)),
            std::string::npos)
            << metrics.body;
      } else {
        EXPECT_TRUE(eventually([&] { return (*server)->counters().kv_bytes_in_use == 0; }));
      }
    }
  }
}

// Completions logprobs: one entry per token, tokens adding up to the text, offsets into it, the
// greedy token on top of its alternatives; streamed equal to whole; the text itself unchanged;
// after a stop string only the tokens that start before it.
TEST(OpenAiServer, CompletionLogprobsDescribeEveryTokenOfTheText) {
  const std::string expected = generator_text(kPrompt, 40);
  Served served = serve_stories(2);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  const json body = {{"prompt", kPrompt}, {"max_tokens", 40}, {"temperature", 0}, {"logprobs", 3}};
  Reply r = post(port, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json choice = r.j()["choices"][0];
  EXPECT_EQ(choice["text"], expected);
  const json lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 40u);
  ASSERT_EQ(lp["token_logprobs"].size(), 40u);
  ASSERT_EQ(lp["top_logprobs"].size(), 40u);
  ASSERT_EQ(lp["text_offset"].size(), 40u);
  std::string joined;
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_EQ(lp["text_offset"][i], static_cast<int64_t>(joined.size())) << i;  // ASCII: bytes = code points
    joined += lp["tokens"][i].get<std::string>();
    const double chosen = lp["token_logprobs"][i];
    EXPECT_LE(chosen, 0.0);
    const json& top = lp["top_logprobs"][i];
    EXPECT_GE(top.size(), 1u);
    EXPECT_LE(top.size(), 4u);
    EXPECT_EQ(top[lp["tokens"][i].get<std::string>()], chosen);
    for (const auto& [tok, v] : top.items()) EXPECT_LE(v.get<double>(), chosen + 1e-6) << "greedy takes the top";
  }
  EXPECT_EQ(joined, expected);

  json sbody = body;
  sbody["stream"] = true;
  Reply s = post(port, "/v1/completions", sbody);
  ASSERT_EQ(s.status, 200) << s.body;
  json streamed_logprobs = json::array();
  std::string streamed;
  for (const std::string& e : events_of(s.body)) {
    if (e == "[DONE]") break;
    const json c = json::parse(e);
    streamed += c["choices"][0]["text"].get<std::string>();
    if (c["choices"][0]["logprobs"].is_null()) continue;
    for (const json& v : c["choices"][0]["logprobs"]["token_logprobs"]) streamed_logprobs.push_back(v);
  }
  EXPECT_EQ(streamed, expected);
  EXPECT_EQ(streamed_logprobs, lp["token_logprobs"]);

  const std::string stop = " named";
  const size_t at = expected.find(stop);
  ASSERT_NE(at, std::string::npos) << expected;
  json stopped = body;
  stopped["stop"] = stop;
  Reply t = post(port, "/v1/completions", stopped);
  ASSERT_EQ(t.status, 200) << t.body;
  EXPECT_EQ(t.j()["choices"][0]["text"], expected.substr(0, at));
  const json tl = t.j()["choices"][0]["logprobs"];
  ASSERT_GE(tl["tokens"].size(), 1u);
  std::string kept;
  for (const json& tok : tl["tokens"]) kept += tok.get<std::string>();
  EXPECT_TRUE(kept.starts_with(expected.substr(0, at))) << kept;
  EXPECT_LT(tl["text_offset"].back().get<int64_t>(), static_cast<int64_t>(at)) << "no token of the stop string";
}

// Model text that is not UTF-8, end to end (issue #26, item 9). As in Cli.GenerateJsonReplaces-
// InvalidUtf8InsteadOfAborting, stories260K emits its byte-fallback tokens (<0x80>...<0xFF>): here a
// logit_bias of +18 on each mixes them into its words at temperature 1 (the API caps it at 2). The seed is
// the first whose text holds both an invalid sequence and a valid character whose bytes come in
// separate tokens. Whole, streamed and chat answers are JSON that parses, every invalid sequence is
// one U+FFFD (sanitize_utf8 of the raw bytes the Generator gives), the stream holds a character's
// first bytes back until it completes, and the streamed chunks add up to the whole text.
TEST(OpenAiServer, TextThatIsNotUtf8ReachesEveryAnswerAsReplacementCharactersAndNeverBreaksTheJson) {
  const int64_t n = 64;
  const float temperature = 1.0f;
  Fixture probe = make_fixture(1);
  std::vector<std::pair<TokenId, float>> bias;
  json bias_json = json::object();
  for (int b = 0x80; b <= 0xFF; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", b);
    const TokenId id = probe.tokenizer->piece_to_id(piece);
    ASSERT_GE(id, 0) << piece << " is not in the vocabulary";
    bias.emplace_back(id, 18.0f);
    bias_json[std::to_string(id)] = 18;
  }
  // A lead byte alone in its piece, completed by the next pieces: a character split across tokens.
  auto split_character = [](const std::vector<std::string>& pieces) -> std::string {
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i].size() != 1) continue;
      const auto lead = static_cast<unsigned char>(pieces[i][0]);
      const size_t len = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC2 ? 2 : 0;
      if (len == 0 || i + len > pieces.size()) continue;
      std::string c;
      for (size_t k = 0; k < len; ++k) c += pieces[i + k];
      if (c.size() == len && sanitize_utf8(c) == c) return c;
    }
    return "";
  };
  uint64_t seed = 0;
  std::string raw, split;
  for (uint64_t s = 1; s <= 16 && split.empty(); ++s) {
    const std::vector<std::string> pieces = generator_pieces(kPrompt, n, temperature, s, bias);
    std::string text;
    for (const std::string& p : pieces) text += p;
    if (sanitize_utf8(text) == text) continue;
    split = split_character(pieces);
    if (!split.empty()) {
      seed = s;
      raw = text;
    }
  }
  ASSERT_NE(seed, 0u) << "no seed in 1..16 gives invalid UTF-8 and a character split across tokens: nothing tested";
  const std::string expected = sanitize_utf8(raw);
  ASSERT_NE(expected, raw) << "the raw text is valid UTF-8: nothing tested";
  ASSERT_NE(expected.find("\xEF\xBF\xBD"), std::string::npos);
  ASSERT_NE(expected.find(split), std::string::npos) << "the split character survives sanitizing";
  // A body parses only if every string in it is valid UTF-8 (nlohmann's parser checks).
  auto parse = [](const std::string& text) {
    const json j = json::parse(text, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << text;
    return j;
  };

  Served served = serve_stories(2);
  ASSERT_TRUE(served.server);
  const json body = {{"prompt", kPrompt},  {"max_tokens", n},       {"temperature", temperature},
                     {"seed", seed},       {"logprobs", 2},         {"logit_bias", bias_json}};
  Reply whole = post(served.port, "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json wj = parse(whole.body);
  ASSERT_TRUE(wj.is_object());
  const std::string whole_text = wj["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(whole_text, expected);
  EXPECT_EQ(wj["choices"][0]["logprobs"]["tokens"].size(), wj["usage"]["completion_tokens"].get<size_t>())
      << "byte tokens' strings too";

  json sbody = body;
  sbody["stream"] = true;
  Reply stream = post(served.port, "/v1/completions", sbody);
  ASSERT_EQ(stream.status, 200) << stream.body;
  const std::vector<std::string> events = events_of(stream.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string streamed;
  size_t chunks = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    SCOPED_TRACE("event " + std::to_string(i));
    const json c = parse(events[i]);
    ASSERT_TRUE(c.is_object());
    const std::string piece = c["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(sanitize_utf8(piece), piece);
    streamed += piece;
    ++chunks;
  }
  // At least a text chunk and the finish chunk: how many text chunks depends on how many tokens
  // were ready together when the connection's coroutine ran (one, on a loaded machine).
  EXPECT_GE(chunks, 2u);
  EXPECT_EQ(streamed, whole_text);

  // The chat API over the same model (a ChatML template; stories260K spells its tags in pieces):
  // the reply's content, whole and streamed as deltas.
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.chat_template = ChatTemplate::kQwen;
  auto chat_server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(chat_server.is_ok()) << chat_server.status().to_string();
  const uint16_t chat_port = (*chat_server)->port();
  json chat = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
               {"max_tokens", n},
               {"temperature", temperature},
               {"seed", seed},
               {"logit_bias", bias_json}};
  Reply cw = post(chat_port, "/v1/chat/completions", chat);
  ASSERT_EQ(cw.status, 200) << cw.body;
  const json cj = parse(cw.body);
  ASSERT_TRUE(cj.is_object());
  const std::string content = cj["choices"][0]["message"]["content"].get<std::string>();
  EXPECT_NE(content.find("\xEF\xBF\xBD"), std::string::npos) << "the chat reply held invalid bytes too";
  chat["stream"] = true;
  Reply cs = post(chat_port, "/v1/chat/completions", chat);
  ASSERT_EQ(cs.status, 200) << cs.body;
  const std::vector<std::string> chat_events = events_of(cs.body);
  ASSERT_GE(chat_events.size(), 3u);
  EXPECT_EQ(chat_events.back(), "[DONE]");
  std::string deltas;
  for (size_t i = 0; i + 1 < chat_events.size(); ++i) {
    SCOPED_TRACE("chat event " + std::to_string(i));
    const json c = parse(chat_events[i]);
    ASSERT_TRUE(c.is_object());
    const json& delta = c["choices"][0]["delta"];
    if (!delta.contains("content") || delta["content"].is_null()) continue;
    const std::string piece = delta["content"].get<std::string>();
    EXPECT_EQ(sanitize_utf8(piece), piece);
    deltas += piece;
  }
  EXPECT_EQ(deltas, content);
}

// echo with logprobs, as evaluation harnesses score text (lm-eval's local-completions: echo,
// logprobs 1, max_tokens 1): the text starts with the prompt, every prompt token after the first
// has the logprob a dense forward gives it, and streaming sends the prompt first.
TEST(OpenAiServer, EchoWithLogprobsScoresThePrompt) {
  Served served = serve_stories(2);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  const std::string completion = generator_text(kPrompt, 1);
  const json body = {{"prompt", kPrompt}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 1}, {"echo", true}};
  Reply r = post(port, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json choice = r.j()["choices"][0];
  EXPECT_EQ(choice["text"], std::string(kPrompt) + completion);
  const json lp = choice["logprobs"];
  auto ids = served.f.tokenizer->encode(kPrompt, true, false);
  ASSERT_TRUE(ids.is_ok());
  ASSERT_EQ(lp["tokens"].size(), ids->size() + 1);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  std::string joined;
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i], static_cast<int64_t>(joined.size())) << i;
    joined += lp["tokens"][i].get<std::string>();
  }
  EXPECT_EQ(joined, choice["text"]);
  // Against a dense forward over the prompt on a fresh engine.
  Fixture d = make_fixture(1);
  auto seq = d.engine->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  const std::vector<StepRequest> step{{*seq, *ids, LogitsMode::kAll, nullptr}};
  auto out = d.engine->forward(step);
  ASSERT_TRUE(out.is_ok());
  for (size_t i = 1; i < ids->size(); ++i) {
    const auto row = out->row(0, static_cast<int64_t>(i - 1));
    double sum = 0;
    for (float v : row) sum += std::exp(static_cast<double>(v));
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), row[static_cast<size_t>((*ids)[i])] - std::log(sum), 1e-3) << i;
    EXPECT_LE(lp["top_logprobs"][i].size(), 2u);
  }
  json sbody = body;
  sbody["stream"] = true;
  Reply s = post(port, "/v1/completions", sbody);
  ASSERT_EQ(s.status, 200) << s.body;
  const auto events = events_of(s.body);
  ASSERT_GE(events.size(), 2u);
  const json first = json::parse(events[0]);
  EXPECT_TRUE(first["choices"][0]["text"].get<std::string>().starts_with(kPrompt));
  json streamed = json::array();
  for (const std::string& e : events) {
    if (e == "[DONE]") break;
    const json c = json::parse(e);
    if (c["choices"][0]["logprobs"].is_null()) continue;
    for (const json& v : c["choices"][0]["logprobs"]["token_logprobs"]) streamed.push_back(v);
  }
  EXPECT_EQ(streamed, lp["token_logprobs"]);
  // vLLM's prompt_logprobs: the same log-probabilities per prompt token (keyed by id, with rank and
  // decoded text), the first token null, the top alternatives with ranks 1..k; streamed, in the
  // first chunk; several choices each carry them.
  const json pbody = {
      {"prompt", kPrompt}, {"max_tokens", 2}, {"temperature", 0}, {"prompt_logprobs", 2}, {"n", 2}};
  Reply p = post(port, "/v1/completions", pbody);
  ASSERT_EQ(p.status, 200) << p.body;
  for (int c = 0; c < 2; ++c) {
    const json plp = p.j()["choices"][c]["prompt_logprobs"];
    ASSERT_EQ(plp.size(), ids->size()) << p.body;
    EXPECT_TRUE(plp[0].is_null());
    EXPECT_TRUE(p.j()["choices"][c]["logprobs"].is_null()) << "logprobs were not asked";
    for (size_t i = 1; i < ids->size(); ++i) {
      const json& entry = plp[i];
      const json& self = entry[std::to_string((*ids)[i])];
      EXPECT_NEAR(self["logprob"].get<double>(), lp["token_logprobs"][i].get<double>(), 1e-6) << i;
      EXPECT_EQ(self["decoded_token"], lp["tokens"][i]) << i;
      const auto rank = self["rank"].get<int64_t>();
      EXPECT_GE(rank, 1);
      EXPECT_EQ(entry.size(), rank <= 2 ? 2u : 3u) << entry.dump();
      std::vector<int64_t> ranks;
      for (const auto& [id, v] : entry.items()) {
        if (id != std::to_string((*ids)[i])) ranks.push_back(v["rank"].get<int64_t>());
        EXPECT_LE(v["logprob"].get<double>(), 0.0);
      }
      for (int64_t r : ranks) EXPECT_TRUE(r == 1 || r == 2) << entry.dump();
    }
  }
  json pstream = pbody;
  pstream["stream"] = true;
  pstream["n"] = 1;
  Reply ps = post(port, "/v1/completions", pstream);
  ASSERT_EQ(ps.status, 200);
  const auto pevents = events_of(ps.body);
  ASSERT_FALSE(pevents.empty());
  // Alone rather than batched with a second choice, so equal up to the GEMM's rounding.
  const json first_plp = json::parse(pevents[0])["choices"][0]["prompt_logprobs"];
  const json whole_plp = p.j()["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(first_plp.size(), whole_plp.size());
  for (size_t i = 1; i < whole_plp.size(); ++i) {
    ASSERT_EQ(first_plp[i].size(), whole_plp[i].size()) << i;
    for (const auto& [id, v] : whole_plp[i].items()) {
      EXPECT_NEAR(first_plp[i][id]["logprob"].get<double>(), v["logprob"].get<double>(), 1e-4) << i;
      EXPECT_EQ(first_plp[i][id]["rank"], v["rank"]) << i;
    }
  }
  // echo without logprobs: the text only.
  Reply plain = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 1}, {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.j()["choices"][0]["text"], std::string(kPrompt) + completion);
  EXPECT_TRUE(plain.j()["choices"][0]["logprobs"].is_null());
}

// n choices: each sampled with seed, seed + 1, ... as a request alone would be; streamed chunks
// carry their choice's index and add up to the whole answer's; usage sums the choices.
TEST(OpenAiServer, SeveralChoicesAreSampledIndependentlyWholeAndStreamed) {
  std::vector<std::string> expected;
  for (uint64_t c = 0; c < 3; ++c) expected.push_back(generator_text(kPrompt, 24, 0.8f, 11 + c));
  EXPECT_NE(expected[0], expected[1]);
  Served served = serve_stories(4);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  const json body = {{"prompt", kPrompt}, {"max_tokens", 24}, {"temperature", 0.8}, {"seed", 11}, {"n", 3}};
  Reply r = post(port, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = r.j();
  ASSERT_EQ(j["choices"].size(), 3u);
  int64_t tokens = 0;
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(j["choices"][c]["index"], c);
    EXPECT_EQ(j["choices"][c]["text"], expected[c]) << "choice " << c;
    tokens += j["choices"][c]["finish_reason"] == "length" ? 24 : 0;
  }
  EXPECT_GE(j["usage"]["completion_tokens"].get<int64_t>(), tokens);
  EXPECT_GT(served.server->counters().max_batch_sequences, 1) << "the choices ran in one batch";

  json sbody = body;
  sbody["stream"] = true;
  Reply s = post(port, "/v1/completions", sbody);
  ASSERT_EQ(s.status, 200) << s.body;
  std::vector<std::string> streamed(3);
  std::vector<std::string> finish(3);
  for (const std::string& e : events_of(s.body)) {
    if (e == "[DONE]") break;
    const json c = json::parse(e);
    if (c["choices"].empty()) continue;
    const size_t index = c["choices"][0]["index"];
    ASSERT_LT(index, 3u);
    streamed[index] += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish[index] = c["choices"][0]["finish_reason"];
  }
  for (size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(streamed[c], expected[c]) << "choice " << c;
    EXPECT_EQ(finish[c], j["choices"][c]["finish_reason"]);
  }
  // Greedy choices are all the same text.
  Reply g = post(port, "/v1/chat/completions",
                 {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"n", 2}, {"max_tokens", 4}});
  EXPECT_EQ(g.status, 400) << "stories has no chat template: refused before any choice runs";
  Reply greedy = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 16}, {"temperature", 0}, {"n", 2}});
  ASSERT_EQ(greedy.status, 200);
  EXPECT_EQ(greedy.j()["choices"][0]["text"], greedy.j()["choices"][1]["text"]);
  EXPECT_EQ(greedy.j()["choices"][0]["text"], generator_text(kPrompt, 16));
  EXPECT_TRUE(eventually([&] { return served.server->counters().kv_bytes_in_use == 0; }));
}

// vLLM's /tokenize and /detokenize: the ids the completions API computes for a prompt (its
// usage counts them, and sending them as the prompt gives the same text), their pieces, and the
// text back; bad bodies get errors naming the field.
TEST(OpenAiServer, TokenizeGivesTheCompletionsIdsAndDetokenizeTheTextBack) {
  Served served = serve_stories(1);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  Reply t = post(port, "/tokenize", {{"prompt", kPrompt}, {"return_token_strs", true}});
  ASSERT_EQ(t.status, 200) << t.body;
  const json tj = t.j();
  const std::vector<TokenId> ids = tj["tokens"].get<std::vector<TokenId>>();
  ASSERT_GT(ids.size(), 2u);
  EXPECT_EQ(tj["count"], ids.size());
  EXPECT_EQ(tj["max_model_len"], 512);
  EXPECT_EQ(ids[0], 1) << "the BOS the completions API adds";
  ASSERT_EQ(tj["token_strs"].size(), ids.size());
  Reply by_text = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(by_text.status, 200) << by_text.body;
  EXPECT_EQ(by_text.j()["usage"]["prompt_tokens"], ids.size());
  Reply by_ids = post(port, "/v1/completions", {{"prompt", ids}, {"max_tokens", 8}, {"temperature", 0}});
  ASSERT_EQ(by_ids.status, 200) << by_ids.body;
  EXPECT_EQ(by_ids.j()["choices"][0]["text"], by_text.j()["choices"][0]["text"]);
  Reply plain = post(port, "/tokenize", {{"prompt", kPrompt}, {"add_special_tokens", false}});
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.j()["tokens"], json(std::vector<TokenId>(ids.begin() + 1, ids.end()))) << "no BOS";
  EXPECT_FALSE(plain.j().contains("token_strs"));

  Reply d = post(port, "/detokenize", {{"tokens", ids}});
  ASSERT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(d.j()["prompt"], kPrompt);
  EXPECT_EQ(post(port, "/detokenize", {{"tokens", json::array()}}).j()["prompt"], "");

  struct Bad {
    const char* route;
    json body;
    const char* param;
  };
  const std::vector<Bad> bad = {
      {"/tokenize", json::object(), "prompt"},
      {"/tokenize", {{"prompt", 3}}, "prompt"},
      {"/tokenize", {{"prompt", "x"}, {"add_special_tokens", "yes"}}, "add_special_tokens"},
      {"/tokenize", {{"prompt", "x"}, {"messages", json::array()}}, "prompt"},
      {"/tokenize", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, "messages"},  // no template
      {"/tokenize", {{"prompt", "x"}, {"model", "other"}}, "model"},
      {"/detokenize", json::object(), "tokens"},
      {"/detokenize", {{"tokens", {1, -2}}}, "tokens[1]"},
      {"/detokenize", {{"tokens", {1, 512}}}, "tokens"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(std::string(b.route) + " " + b.body.dump());
    Reply r = post(port, b.route, b.body);
    EXPECT_TRUE(r.status == 400 || r.status == 404) << r.status << " " << r.body;
    ASSERT_TRUE(r.j().contains("error")) << r.body;
    EXPECT_EQ(r.j()["error"]["param"], b.param) << r.body;
  }
  EXPECT_EQ(send(port, http::verb::post, "/tokenize", "{").status, 400);
  EXPECT_EQ(send(port, http::verb::get, "/tokenize").status, 405);
}

// best_of: the n of best_of samples with the highest mean log-probability per token, in that
// order; the samples are those n = best_of gives (same seeds), and usage counts all of them.
TEST(OpenAiServer, BestOfAnswersTheMostLikelyOfItsSamples) {
  Served served = serve_stories(4);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  const json base = {{"prompt", kPrompt}, {"max_tokens", 16}, {"temperature", 1.0}, {"seed", 5}};
  json all_body = base;
  all_body["n"] = 5;
  all_body["logprobs"] = 0;
  Reply all = post(port, "/v1/completions", all_body);
  ASSERT_EQ(all.status, 200) << all.body;
  const json samples = all.j()["choices"];
  ASSERT_EQ(samples.size(), 5u);
  std::vector<std::pair<double, size_t>> ranked;  // (-mean logprob, index): best first
  for (size_t c = 0; c < samples.size(); ++c) {
    const json& lp = samples[c]["logprobs"]["token_logprobs"];
    ASSERT_FALSE(lp.empty());
    double sum = 0.0;
    for (const json& v : lp) sum += v.get<double>();
    ranked.emplace_back(-sum / static_cast<double>(lp.size()), c);
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](auto& a, auto& b) { return a.first < b.first; });
  ASSERT_FALSE(ranked[0].second == 0 && ranked[1].second == 1)
      << "the seed must make the best two differ from the first two, or the test could not fail";

  json best_body = base;
  best_body["n"] = 2;
  best_body["best_of"] = 5;
  Reply best = post(port, "/v1/completions", best_body);
  ASSERT_EQ(best.status, 200) << best.body;
  const json j = best.j();
  ASSERT_EQ(j["choices"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], samples[ranked[i].second]["text"]) << "rank " << i;
    EXPECT_EQ(j["choices"][i]["finish_reason"], samples[ranked[i].second]["finish_reason"]);
    EXPECT_TRUE(j["choices"][i]["logprobs"].is_null()) << "not asked for";
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], all.j()["usage"]["completion_tokens"]) << "all five were generated";
  // With logprobs asked, the answer carries the winners' own.
  best_body["logprobs"] = 1;
  Reply with_lp = post(port, "/v1/completions", best_body);
  ASSERT_EQ(with_lp.status, 200) << with_lp.body;
  EXPECT_EQ(with_lp.j()["choices"][0]["logprobs"]["token_logprobs"],
            samples[ranked[0].second]["logprobs"]["token_logprobs"]);
  json streamed = best_body;
  streamed["stream"] = true;
  EXPECT_EQ(post(port, "/v1/completions", streamed).status, 400);
  EXPECT_TRUE(eventually([&] { return served.server->counters().kv_bytes_in_use == 0; }));
}

// logit_bias, penalties and stop_token_ids reach the engine: banning the greedy first token
// changes the text, a stop token id ends it, ids outside the vocabulary are a 400 naming the field.
TEST(OpenAiServer, LogitControlsAndStopTokenIdsChangeTheText) {
  const std::string plain = generator_text(kPrompt, 20);
  Served served = serve_stories(2);
  ASSERT_TRUE(served.server);
  const uint16_t port = served.port;
  const json base = {{"prompt", kPrompt}, {"max_tokens", 20}, {"temperature", 0}, {"logprobs", 0}};
  Reply r = post(port, "/v1/completions", base);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j()["choices"][0]["text"], plain);
  const std::string first = r.j()["choices"][0]["logprobs"]["tokens"][0];
  const std::string second = r.j()["choices"][0]["logprobs"]["tokens"][1];
  const TokenId first_id = served.f.tokenizer->piece_to_id(first);
  ASSERT_GE(first_id, 0) << first;

  json banned = base;
  banned["logit_bias"] = {{std::to_string(first_id), -100}};
  Reply b = post(port, "/v1/completions", banned);
  ASSERT_EQ(b.status, 200) << b.body;
  EXPECT_NE(b.j()["choices"][0]["logprobs"]["tokens"][0], first);

  json penalized = base;
  penalized["max_tokens"] = 80;
  penalized["frequency_penalty"] = 2.0;
  penalized["presence_penalty"] = 1.0;
  Reply p = post(port, "/v1/completions", penalized);
  ASSERT_EQ(p.status, 200) << p.body;
  json unpenalized = base;
  unpenalized["max_tokens"] = 80;
  r = post(port, "/v1/completions", unpenalized);
  ASSERT_EQ(r.status, 200) << r.body;
  std::map<std::string, int> plain_counts, penalized_counts;
  const json plain_body = r.j(), penalized_body = p.j();  // range-for would not keep a temporary alive
  for (const json& t : plain_body["choices"][0]["logprobs"]["tokens"]) ++plain_counts[t.get<std::string>()];
  for (const json& t : penalized_body["choices"][0]["logprobs"]["tokens"]) ++penalized_counts[t.get<std::string>()];
  auto most = [](const std::map<std::string, int>& m) {
    int best = 0;
    for (const auto& [k, v] : m) best = std::max(best, v);
    return best;
  };
  EXPECT_LE(most(penalized_counts), most(plain_counts)) << "penalties repeat tokens no more often";
  EXPECT_NE(p.j()["choices"][0]["text"], r.j()["choices"][0]["text"]);

  const TokenId second_id = served.f.tokenizer->piece_to_id(second);
  ASSERT_GE(second_id, 0) << second;
  json stopped = base;
  stopped["stop_token_ids"] = {second_id};
  Reply s = post(port, "/v1/completions", stopped);
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_EQ(s.j()["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(s.j()["usage"]["completion_tokens"], 1) << "ends before the stop token";

  // min_tokens holds the stop token back for three tokens.
  stopped["min_tokens"] = 3;
  Reply held = post(port, "/v1/completions", stopped);
  ASSERT_EQ(held.status, 200) << held.body;
  EXPECT_GE(held.j()["usage"]["completion_tokens"].get<int64_t>(), 3);
  for (size_t i = 1; i < 3; ++i) EXPECT_NE(held.j()["choices"][0]["logprobs"]["tokens"][i], second) << i;

  json outside = base;
  outside["logit_bias"] = {{"100000", 1}};
  Reply o = post(port, "/v1/completions", outside);
  EXPECT_EQ(o.status, 400);
  EXPECT_EQ(o.j()["error"]["param"], "logit_bias");
  outside = base;
  outside["stop_token_ids"] = {100000};
  o = post(port, "/v1/completions", outside);
  EXPECT_EQ(o.status, 400);
  EXPECT_EQ(o.j()["error"]["param"], "stop_token_ids");
}

// response_format json_object: the text is a JSON object (nlohmann reads it), streamed or not,
// for every choice; json_schema without a schema is a 400 naming the field.
TEST(OpenAiServer, JsonObjectResponseFormatGivesAnObject) {
  Served served = serve_stories(4);
  ASSERT_TRUE(served.server);
  // Tokens that write '}' and '"' alone, pushed up so that the tiny model closes its object soon.
  auto id_of = [&](std::string_view piece) {
    for (TokenId t = 0; t < served.f.tokenizer->vocab_size(); ++t) {
      if (served.f.tokenizer->decode_token(1, t) == piece) return t;
    }
    return TokenId(-1);
  };
  const TokenId close = id_of("}"), quote = id_of("\"");
  ASSERT_TRUE(close >= 0 && quote >= 0);
  const json body = {{"prompt", kPrompt},
                     {"max_tokens", 120},
                     {"temperature", 0},
                     {"response_format", {{"type", "json_object"}}},
                     {"logit_bias", {{std::to_string(close), 8}, {std::to_string(quote), 4}}}};
  Reply r = post(served.port, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const std::string text = r.j()["choices"][0]["text"];
  EXPECT_EQ(r.j()["choices"][0]["finish_reason"], "stop") << text;
  const json parsed = json::parse(text, nullptr, false);
  EXPECT_TRUE(parsed.is_object()) << text;
  // The same request unconstrained writes something else (a story).
  json plain = body;
  plain.erase("response_format");
  Reply p = post(served.port, "/v1/completions", plain);
  ASSERT_EQ(p.status, 200);
  EXPECT_FALSE(json::parse(p.j()["choices"][0]["text"].get<std::string>(), nullptr, false).is_object());
  // Streamed, and sampled choices: each closes its object or is cut by max_tokens.
  json streamed = body;
  streamed["stream"] = true;
  Reply st = post(served.port, "/v1/completions", streamed);
  ASSERT_EQ(st.status, 200);
  std::string joined;
  for (const std::string& e : events_of(st.body)) {
    if (e == "[DONE]") break;
    const json chunk = json::parse(e);
    joined += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, text);
  json sampled = body;
  sampled["temperature"] = 1.0;
  sampled["n"] = 3;
  sampled["seed"] = 11;
  Reply n = post(served.port, "/v1/completions", sampled);
  ASSERT_EQ(n.status, 200) << n.body;
  const json sampled_body = n.j();  // range-for would not keep a temporary alive
  for (const json& c : sampled_body["choices"]) {
    const std::string t = c["text"];
    if (c["finish_reason"] == "stop") {
      EXPECT_TRUE(json::parse(t, nullptr, false).is_object()) << t;
    } else {
      EXPECT_EQ(c["finish_reason"], "length") << t;
      EXPECT_NE(t.find('{'), std::string::npos) << t;
    }
  }
  json schema = body;
  schema["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}};
  Reply s = post(served.port, "/v1/completions", schema);
  EXPECT_EQ(s.status, 400);
  EXPECT_EQ(s.j()["error"]["param"], "response_format");
}

// response_format json_schema (and vLLM's guided_json): every answer, greedy, sampled or
// streamed, is a document valid against the schema, properties in the schema's own order (the
// body is sent as text: "zebra" before "age"); guided_choice answers one of its strings; a
// keyword outside the subset is a 400 naming it.
// 1024 choices are served, 1025 are a 400 naming the field and the limit; an enum of more than
// 1023 values (one stack is the space before a value) likewise. Before, 1025 choices were "an
// ambiguous grammar" and a 1024-value enum was accepted and failed mid-request (500) when
// generation reached it.
TEST(OpenAiServer, ChoicesAndEnumsPastTheMatchersLimitAre400sNamingTheLimit) {
  Served s = serve_stories(1);
  ASSERT_NE(s.server, nullptr);
  auto values = [](int n) {
    json list = json::array();
    for (int i = 0; i < n; ++i) {
      std::string c = "c";  // appended: GCC 12 warns falsely (-Wrestrict) on "c" + std::string
      c += std::to_string(i);
      list.push_back(c);
    }
    return list;
  };
  Reply served =
      post(s.port, "/v1/completions",
           json{{"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 0}, {"guided_choice", values(1024)}});
  ASSERT_EQ(served.status, 200) << served.body;
  const json choice = served.j()["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop") << served.body;
  const json all = values(1024);
  EXPECT_NE(std::find(all.begin(), all.end(), choice["text"]), all.end()) << served.body;
  const json schema = {{"type", "object"},
                       {"properties", {{"k", {{"enum", values(1024)}}}}},
                       {"required", {"k"}},
                       {"additionalProperties", false}};
  const std::vector<std::tuple<json, std::string, std::string>> cases = {
      {json{{"guided_choice", values(1025)}}, "guided_choice", "has 1025 values; at most 1024 are supported"},
      {json{{"response_format",
             {{"type", "json_schema"}, {"json_schema", {{"name", "e"}, {"schema", schema}}}}}},
       "response_format", "has 1024 values; at most 1023 are supported"},
      {json{{"guided_json", schema}}, "guided_json", "has 1024 values; at most 1023 are supported"},
  };
  for (const auto& [extra, field, why] : cases) {
    SCOPED_TRACE(field);
    json body = {{"prompt", kPrompt}, {"max_tokens", 16}};
    body.update(extra);
    Reply r = post(s.port, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << r.body.substr(0, 400);
    const json j = r.j();
    ASSERT_TRUE(j.contains("error")) << r.body.substr(0, 400);
    EXPECT_EQ(j["error"]["param"], field);
    EXPECT_NE(j["error"]["message"].get<std::string>().find(why), std::string::npos) << j.dump();
  }
}

TEST(OpenAiServer, JsonSchemaAndGuidedChoiceConstrainTheText) {
  Served served = serve_stories(4);
  ASSERT_TRUE(served.server);
  const std::string schema =
      R"({"type":"object","properties":{"zebra":{"type":"string","maxLength":12},"age":{"type":"integer"},)"
      R"("kind":{"enum":["cat","dog"]}},"required":["zebra","age","kind"],"additionalProperties":false})";
  auto valid = [](const std::string& text) {
    const json j = json::parse(text, nullptr, false);
    if (!j.is_object() || j.size() != 3 || !j.contains("zebra") || !j.contains("age") || !j.contains("kind")) return false;
    const std::string zebra = j["zebra"].is_string() ? j["zebra"].get<std::string>() : std::string(13, 'x');
    size_t chars = 0;
    for (unsigned char ch : zebra) chars += (ch & 0xC0) != 0x80;
    return chars <= 12 && j["age"].is_number_integer() && (j["kind"] == "cat" || j["kind"] == "dog");
  };
  auto body_with = [&](const std::string& structured, const std::string& extra) {
    return R"({"prompt":"Once upon a time","max_tokens":80,)" + structured + extra + "}";
  };
  const std::string format = R"("response_format":{"type":"json_schema","json_schema":{"name":"animal","strict":true,"schema":)" +
                             schema + "}}";
  Reply greedy = send(served.port, http::verb::post, "/v1/completions", body_with(format, R"(,"temperature":0)"));
  ASSERT_EQ(greedy.status, 200) << greedy.body;
  const std::string text = greedy.j()["choices"][0]["text"];
  EXPECT_TRUE(valid(text)) << text;
  EXPECT_EQ(greedy.j()["choices"][0]["finish_reason"], "stop") << text;
  EXPECT_TRUE(text.starts_with(R"({"zebra")")) << "the schema's order, not the sorted one: " << text;
  EXPECT_LT(text.find("\"age\""), text.find("\"kind\"")) << text;

  Reply streamed = send(served.port, http::verb::post, "/v1/completions",
                        body_with(format, R"(,"temperature":0,"stream":true)"));
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  std::string joined;
  for (const std::string& e : events_of(streamed.body)) {
    if (e == "[DONE]") break;
    const json chunk = json::parse(e);
    if (!chunk["choices"].empty()) joined += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(joined, text);

  const std::string guided = R"("guided_json":)" + schema;
  Reply sampled = send(served.port, http::verb::post, "/v1/completions",
                       body_with(guided, R"(,"temperature":1.0,"n":3,"seed":5)"));
  ASSERT_EQ(sampled.status, 200) << sampled.body;
  const json sampled_body = sampled.j();
  for (const json& c : sampled_body["choices"]) {
    const std::string t = c["text"];
    if (c["finish_reason"] == "stop") {
      EXPECT_TRUE(valid(t)) << t;
    } else {
      EXPECT_TRUE(t.starts_with(R"({"zebra")")) << t;  // cut by max_tokens
    }
  }

  Reply choice = post(served.port, "/v1/completions",
                      {{"prompt", kPrompt}, {"max_tokens", 10}, {"temperature", 1.0}, {"n", 4}, {"seed", 3},
                       {"guided_choice", {"happy", "sad", "a big red ball"}}});
  ASSERT_EQ(choice.status, 200) << choice.body;
  const json choice_body = choice.j();
  for (const json& c : choice_body["choices"]) {
    const std::string t = c["text"];
    EXPECT_TRUE(t == "happy" || t == "sad" || t == "a big red ball") << t;
    EXPECT_EQ(c["finish_reason"], "stop") << t;
  }

  Reply pattern = send(served.port, http::verb::post, "/v1/completions",
                       body_with(R"("guided_json":{"type":"string","pattern":"^a+$"})", ""));
  EXPECT_EQ(pattern.status, 400) << pattern.body;
  EXPECT_EQ(pattern.j()["error"]["param"], "guided_json");
  EXPECT_NE(pattern.j()["error"]["message"].get<std::string>().find("'pattern'"), std::string::npos) << pattern.body;
  EXPECT_TRUE(eventually([&] { return served.server->counters().kv_bytes_in_use == 0; }));
}

// An engine whose remote KV link is dead: each request's batch fails, the client gets a 500
// naming the layer (a stream too, since nothing was sent yet), and the server goes on serving.
TEST(OpenAiServer, AFailedEngineStepIsA500AndTheServerGoesOn) {
  auto model = testing::toy_model(2);
  testing::FailingLinkEngine f = testing::failing_link_engine(model, /*fail_after_posts=*/0, 2);
  ASSERT_TRUE(f.engine);
  auto tok = make_synthetic_tokenizer(static_cast<int32_t>(model->config.vocab_size));
  auto server = OpenAiServer::start(*f.engine, *tok, ServerOptions{});
  ASSERT_TRUE(server.is_ok());
  const uint16_t port = (*server)->port();
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    Reply r = post(port, "/v1/completions", {{"prompt", "1 2 3 4"}, {"max_tokens", 4}, {"stream", stream}});
    EXPECT_EQ(r.status, 500) << r.body;
    const json j = r.j();
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_EQ(j["error"]["type"], "server_error");
    EXPECT_NE(j["error"]["message"].get<std::string>().find("layer"), std::string::npos) << r.body;
  }
  EXPECT_EQ((*server)->counters().failed, 2);
  EXPECT_EQ((*server)->counters().running, 0);
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200);
  // Text that is not token ids is refused by the synthetic tokenizer, naming the word.
  Reply bad = post(port, "/v1/completions", {{"prompt", "1 two 3"}});
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_NE(bad.body.find("two"), std::string::npos) << bad.body;
}

// Prefix caching (on by default in ServerOptions): the next turn of a conversation resends the
// history and is answered from the cache for its whole pages, with the text of computing it all;
// a request ended by a stop string keeps its cache too.
TEST(OpenAiServer, PrefixCachingAnswersTheNextTurnFromTheCache) {
  Fixture f = make_fixture(4);
  ServerOptions o = options_for(*f.tokenizer);
  o.scheduling.prefix_caching = true;
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  auto cached_of = [](const Reply& r) {
    return r.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  };

  Reply first = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 60}, {"temperature", 0}});
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(cached_of(first), 0);
  const std::string turn = kPrompt + first.j()["choices"][0]["text"].get<std::string>() + " Then";
  Reply second = post(port, "/v1/completions", {{"prompt", turn}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(second.j()["choices"][0]["text"], generator_text(turn, 20));
  const int64_t cached = cached_of(second);
  EXPECT_GE(cached, 32) << "most of the first turn's 64 tokens, in pages of 16";
  EXPECT_EQ(cached % 16, 0);
  EXPECT_LT(cached, second.j()["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_EQ((*server)->counters().cached_prompt_tokens, cached);
  EXPECT_GT((*server)->counters().kv_bytes_in_use, 0) << "finished requests stay cached";
  EXPECT_EQ((*server)->counters().cached_sequences, 1) << "the second turn took the first's sequence over";
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_NE(metrics.body.find("specontext_prefix_cache_hit_tokens_total " + std::to_string(cached)),
            std::string::npos)
      << metrics.body;

  // A stop string ends the request; its sequence stays cached for the turn after it.
  const std::string other = "The little dog";
  const std::string full = generator_text(other, 60);
  ASSERT_GT(full.size(), 150u);
  const std::string stop = full.substr(140, 6);
  Reply stopped =
      post(port, "/v1/completions",
           {{"prompt", other}, {"max_tokens", 60}, {"temperature", 0}, {"stop", stop}, {"stream", true}});
  ASSERT_EQ(stopped.status, 200);
  std::string text;
  for (const std::string& e : events_of(stopped.body)) {
    if (e == "[DONE]") break;
    text += json::parse(e)["choices"][0]["text"].get<std::string>();
  }
  ASSERT_EQ(text, full.substr(0, full.find(stop)));
  const std::string next = other + text + " Then";
  Reply after = post(port, "/v1/completions", {{"prompt", next}, {"max_tokens", 10}, {"temperature", 0}});
  ASSERT_EQ(after.status, 200);
  EXPECT_GE(cached_of(after), 16) << "from the stopped request's cache";
  EXPECT_EQ(after.j()["choices"][0]["text"], generator_text(next, 10));
}

// One sequence slot: another conversation evicts the first's cache, which --prefix-offload keeps
// in host memory (or --prefix-offload-disk in a file); the first's next turn gets it back and is
// answered as without any eviction.
TEST(OpenAiServer, AnOffloadedPrefixAnswersTheNextTurnAfterEviction) {
  for (const bool disk : {false, true}) {
    SCOPED_TRACE(disk ? "disk" : "host memory");
    Fixture f = make_fixture(1);
    ServerOptions o = options_for(*f.tokenizer);
    o.scheduling.prefix_caching = true;
    (disk ? o.scheduling.prefix_disk_bytes : o.scheduling.prefix_offload_bytes) = uint64_t{16} << 20;
    o.scheduling.prefix_disk_dir = disk ? ::testing::TempDir() : "";
    auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
    ASSERT_TRUE(server.is_ok()) << server.status().to_string();
    const uint16_t port = (*server)->port();
    Reply first = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 60}, {"temperature", 0}});
    ASSERT_EQ(first.status, 200) << first.body;
    Reply other = post(port, "/v1/completions", {{"prompt", "The little dog"}, {"max_tokens", 30}, {"temperature", 0}});
    ASSERT_EQ(other.status, 200) << other.body;
    ServerCounters c = (*server)->counters();
    EXPECT_EQ(disk ? c.prefix_disk_writes : c.prefix_offloads, 1) << "the first turn's cache gave way to the other";
    EXPECT_EQ(disk ? c.prefixes_on_disk : c.offloaded_prefixes, 1);
    const std::string turn = kPrompt + first.j()["choices"][0]["text"].get<std::string>() + " Then";
    Reply second = post(port, "/v1/completions", {{"prompt", turn}, {"max_tokens", 20}, {"temperature", 0}});
    ASSERT_EQ(second.status, 200) << second.body;
    EXPECT_EQ(second.j()["choices"][0]["text"], generator_text(turn, 20));
    const int64_t cached = second.j()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
    EXPECT_GE(cached, 32) << "most of the first turn's tokens, in pages of 16";
    c = (*server)->counters();
    EXPECT_EQ(c.prefix_restores, 1);
    EXPECT_EQ(c.prefix_disk_restores, disk ? 1 : 0);
    EXPECT_EQ(c.prefix_disk_errors, 0);
    EXPECT_EQ(disk ? c.prefix_disk_writes : c.prefix_offloads, 2) << "the other conversation's cache went in turn";
    Reply metrics = send(port, http::verb::get, "/metrics");
    EXPECT_NE(metrics.body.find("specontext_prefix_restores_total 1"), std::string::npos) << metrics.body;
    EXPECT_NE(metrics.body.find(disk ? "specontext_prefix_disk_sequences 1" : "specontext_prefix_offload_sequences 1"),
              std::string::npos)
        << metrics.body;
  }
}

TEST(OpenAiServer, ApiKeysGuardEveryV1RouteAndLeaveHealthAndMetricsOpen) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.api_keys = {"key-one", "key-two"};
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const std::string completion = R"({"prompt":"Once","max_tokens":3})";
  asio::io_context ioc;
  tcp::socket keep(ioc);
  keep.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  // Absent, another scheme, a prefix of a key, a key with more after it, a wrong case, empty.
  const std::vector<std::string> refused = {
      "",       "Basic key-one", "Bearer key-on", "Bearer key-one2", "Bearer KEY-ONE", "Bearer wrong",
      "Bearer", "key-one"};
  int64_t unauthorized = 0;
  for (const std::string& authorization : refused) {
    SCOPED_TRACE("Authorization: " + authorization);
    for (auto [verb, target] : {std::pair{http::verb::post, "/v1/completions"},
                                {http::verb::post, "/v1/chat/completions"},
                                {http::verb::get, "/v1/models"},
                                {http::verb::post, "/tokenize"},
                                {http::verb::post, "/detokenize?x=1"}}) {
      SCOPED_TRACE(target);
      Reply r = send(port, verb, target, verb == http::verb::post ? completion : "", &keep, authorization);
      ++unauthorized;
      EXPECT_EQ(r.status, 401) << r.body;
      EXPECT_EQ(r.www_authenticate, "Bearer");
      const json j = r.j();
      ASSERT_TRUE(j.contains("error")) << r.body;
      EXPECT_EQ(j["error"]["type"], "invalid_request_error");
      EXPECT_EQ(j["error"]["code"], "invalid_api_key");
      EXPECT_TRUE(j["error"]["param"].is_null());
      EXPECT_NE(j["error"]["message"].get<std::string>().find("API key"), std::string::npos) << r.body;
      EXPECT_EQ(r.body.find("key-one"), std::string::npos) << "no key is echoed";
    }
  }
  EXPECT_EQ((*server)->counters().accepted, 0) << "nothing unauthorized reached the engine";
  // Either key works, on the connection that was refused before; the scheme is case-insensitive.
  Reply ok = send(port, http::verb::post, "/v1/completions", completion, &keep, "Bearer key-one");
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.j()["usage"]["completion_tokens"], 3);
  EXPECT_FALSE(ok.j()["choices"][0]["text"].get<std::string>().empty());
  Reply models = send(port, http::verb::get, "/v1/models", "", nullptr, "bearer key-two");
  ASSERT_EQ(models.status, 200) << models.body;
  EXPECT_EQ(models.j()["data"][0]["id"], "stories");
  // Open without a key, as vLLM; routes outside /v1/ are not guarded (404 as before).
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200);
  EXPECT_EQ(send(port, http::verb::get, "/v2/nothing").status, 404);
  Reply metrics = send(port, http::verb::get, "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("specontext_unauthorized_requests_total " + std::to_string(unauthorized)),
            std::string::npos)
      << metrics.body;
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.unauthorized, unauthorized);
  EXPECT_EQ(c.rejected, 1) << "only the 404: 401s are counted apart";
  EXPECT_EQ(c.accepted, 1);
  EXPECT_EQ(c.completed, 1);

  // An empty key would let the empty token in.
  ServerOptions empty = options_for(*f.tokenizer);
  empty.api_keys = {"fine", ""};
  auto refused_start = OpenAiServer::start(*f.engine, *f.tokenizer, empty);
  ASSERT_FALSE(refused_start.is_ok());
  EXPECT_EQ(refused_start.status().code(), StatusCode::kInvalidArgument);
}

// Reads from `s` until `until` has come (or the connection ends, or 10 s pass); what came.
std::string read_until(tcp::socket& s, const std::string& until) {
  std::string got;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  s.non_blocking(true);
  while (got.find(until) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    char chunk[4096];
    beast::error_code ec;
    const size_t n = s.read_some(asio::buffer(chunk), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (ec) break;
    got.append(chunk, n);
  }
  s.non_blocking(false);
  return got;
}

TEST(OpenAiServer, AKeylessRequestIsRefusedBeforeItsBodyAndExpectContinueIsHonoured) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.api_keys = {"key-one"};
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), (*server)->port());
  asio::io_context ioc;
  const std::string body = R"({"prompt":"Once","max_tokens":3})";
  auto header = [&](const std::string& authorization, size_t length, bool expect_continue) {
    std::string h = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n";
    if (!authorization.empty()) h += "Authorization: " + authorization + "\r\n";
    if (expect_continue) h += "Expect: 100-continue\r\n";
    return h + "Content-Length: " + std::to_string(length) + "\r\n\r\n";
  };
  {
    // 3 MiB announced and none sent: the 401 comes at once and the connection closes.
    tcp::socket s(ioc);
    s.connect(where);
    asio::write(s, asio::buffer(header("", 3u << 20, false)));
    const std::string answer = read_until(s, "\"invalid_api_key\"");
    EXPECT_TRUE(answer.starts_with("HTTP/1.1 401")) << answer;
    EXPECT_NE(answer.find("Connection: close"), std::string::npos) << answer;
    EXPECT_NE(answer.find("invalid_api_key"), std::string::npos) << answer;
    char byte = 0;
    beast::error_code ec;
    s.read_some(asio::buffer(&byte, 1), ec);
    EXPECT_EQ(ec, asio::error::eof) << "closed after the 401";
  }
  {
    // A wrong key with Expect: 100-continue: no 100, the 401 instead, and the body is never sent.
    tcp::socket s(ioc);
    s.connect(where);
    asio::write(s, asio::buffer(header("Bearer wrong", body.size(), true)));
    const std::string answer = read_until(s, "\"invalid_api_key\"");
    EXPECT_TRUE(answer.starts_with("HTTP/1.1 401")) << answer;
    EXPECT_EQ(answer.find("100 Continue"), std::string::npos) << answer;
  }
  {
    // The right key with Expect: 100-continue: "100 Continue", then the body, then the answer.
    tcp::socket s(ioc);
    s.connect(where);
    asio::write(s, asio::buffer(header("Bearer key-one", body.size(), true)));
    const std::string interim = read_until(s, "\r\n\r\n");
    EXPECT_TRUE(interim.starts_with("HTTP/1.1 100 Continue\r\n")) << interim;
    asio::write(s, asio::buffer(body));
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    beast::error_code ec;
    http::read(s, buf, res, ec);
    ASSERT_FALSE(ec) << ec.message();
    ASSERT_EQ(res.result_int(), 200u) << res.body();
    EXPECT_EQ(json::parse(res.body())["usage"]["completion_tokens"], 3);
  }
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.unauthorized, 2);
  EXPECT_EQ(c.accepted, 1);
  EXPECT_EQ(c.completed, 1);
}

// Two keep-alive connections to 127.0.0.1:port, each answered once (/health) so that the server
// has surely taken them; the first in an optional, for a test to close it.
std::pair<std::optional<tcp::socket>, tcp::socket> two_kept_connections(asio::io_context& ioc,
                                                                        uint16_t port) {
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  std::pair<std::optional<tcp::socket>, tcp::socket> kept(std::nullopt, tcp::socket(ioc));
  kept.first.emplace(ioc);
  kept.first->connect(where);
  kept.second.connect(where);
  EXPECT_EQ(send(port, http::verb::get, "/health", "", &*kept.first).status, 200);
  EXPECT_EQ(send(port, http::verb::get, "/health", "", &kept.second).status, 200);
  return kept;
}

TEST(OpenAiServer, ConnectionsPastTheLimitGet503AndAClosedOneMakesRoom) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_connections = 2;
  o.idle_timeout = std::chrono::minutes(10);  // the kept connections stay for the whole test
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context ioc;
  auto [first, second] = two_kept_connections(ioc, port);
  EXPECT_EQ((*server)->counters().open_connections, 2);

  // A third is answered at once and closed, with or without a request sent.
  Reply third = post(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(third.status, 503) << third.body;
  EXPECT_EQ(third.retry_after, "1");
  ASSERT_TRUE(third.j().contains("error")) << third.body;
  EXPECT_NE(third.j()["error"]["message"].get<std::string>().find("connection limit (2"), std::string::npos)
      << third.body;
  {
    tcp::socket silent(ioc);
    silent.connect(where);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    beast::error_code ec;
    http::read(silent, buf, res, ec);  // without writing anything: no hang
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_EQ(res.result_int(), 503u);
    EXPECT_FALSE(res.keep_alive());
    char byte = 0;
    silent.read_some(asio::buffer(&byte, 1), ec);
    EXPECT_EQ(ec, asio::error::eof) << "the refused connection is closed";
  }
  EXPECT_EQ((*server)->counters().connections_refused, 2);
  EXPECT_EQ((*server)->counters().accepted, 0);
  EXPECT_EQ((*server)->counters().open_connections, 2) << "refused connections are not counted open";

  // Closing one makes room: a new connection is served, and the kept one still is.
  first.reset();
  ASSERT_TRUE(eventually([&] { return (*server)->counters().open_connections == 1; }));
  Reply served = post(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(served.status, 200) << served.body;
  EXPECT_EQ(served.j()["usage"]["completion_tokens"], 3);
  EXPECT_EQ(send(port, http::verb::get, "/health", "", &second).status, 200);
  ASSERT_TRUE(eventually([&] { return (*server)->counters().open_connections == 1; }));
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_NE(metrics.body.find("specontext_connections_refused_total 2"), std::string::npos) << metrics.body;
  EXPECT_NE(metrics.body.find("specontext_open_connections 2"), std::string::npos)
      << metrics.body;  // the kept connection and this one
  EXPECT_EQ((*server)->counters().connections_refused, 2);
}

// ---------------------------------------------------------------- hostile and slow clients

// Holds the server's request workers (ServerOptions::before_prepare) until released.
struct WorkerGate {
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  void wait() {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return released; });
  }
  void release() {
    {
      std::lock_guard lk(mu);
      released = true;
    }
    cv.notify_all();
  }
};

// Whether the server closes `s`: reads (and drops) until EOF or a reset. False only if a minute
// passes with the connection open, a bound no passing run comes near.
bool closed_by_server(tcp::socket& s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  s.non_blocking(true);
  while (std::chrono::steady_clock::now() < deadline) {
    char chunk[4096];
    beast::error_code ec;
    s.read_some(asio::buffer(chunk), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (ec) return ec == asio::error::eof || ec == asio::error::connection_reset;
  }
  return false;
}

// A tokenizer that counts encode() calls (from any thread) and otherwise is `inner`.
class CountingTokenizer : public Tokenizer {
 public:
  explicit CountingTokenizer(const Tokenizer& inner) : inner_(inner) {}
  std::string_view kind() const override { return inner_.kind(); }
  int32_t vocab_size() const override { return inner_.vocab_size(); }
  TokenId bos_id() const override { return inner_.bos_id(); }
  TokenId eos_id() const override { return inner_.eos_id(); }
  std::vector<TokenId> stop_ids() const override { return inner_.stop_ids(); }
  Result<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                      bool parse_special) const override {
    ++encodes;
    return inner_.encode(text, add_bos, parse_special);
  }
  std::string decode_token(TokenId prev, TokenId id) const override { return inner_.decode_token(prev, id); }
  TokenId piece_to_id(std::string_view piece) const override { return inner_.piece_to_id(piece); }
  bool add_bos_by_default() const override { return inner_.add_bos_by_default(); }
  mutable std::atomic<int64_t> encodes{0};

 private:
  const Tokenizer& inner_;
};

// Issue 26, item 5: a request is parsed and tokenized on a worker, so while one is being
// prepared (held there by the gate) /health and /metrics are answered; a full request queue is a
// 503 with Retry-After; what was admitted is answered once the worker goes on.
TEST(OpenAiServer, RequestsArePreparedOnWorkersSoHealthAnswersWhileOneIsTokenized) {
  Fixture f = make_fixture(2);
  WorkerGate gate;
  ServerOptions o = options_for(*f.tokenizer);
  o.request_workers = 1;
  o.request_queue = 1;
  o.before_prepare = [&gate] { gate.wait(); };
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  Reply completion, tokenized;
  std::jthread a, b;
  struct Release {
    WorkerGate& gate;
    ~Release() { gate.release(); }  // before the threads are joined, whatever failed
  } release{gate};
  a = std::jthread([&] {
    completion = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 3}, {"temperature", 0}});
  });
  ASSERT_TRUE(eventually([&] { return (*server)->counters().prepare_running == 1; }));
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200) << "the connection thread is free";

  b = std::jthread([&] { tokenized = post(port, "/tokenize", {{"prompt", kPrompt}}); });
  ASSERT_TRUE(eventually([&] { return (*server)->counters().prepare_queued == 1; }));
  Reply refused = post(port, "/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 3}});
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_EQ(refused.retry_after, "1");
  ASSERT_TRUE(refused.j().contains("error")) << refused.body;
  EXPECT_NE(refused.j()["error"]["message"].get<std::string>().find("request queue is full"),
            std::string::npos)
      << refused.body;
  Reply refused_tokenize = post(port, "/tokenize", {{"prompt", kPrompt}});
  EXPECT_EQ(refused_tokenize.status, 503) << refused_tokenize.body;
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_NE(metrics.body.find("specontext_prepare_running 1"), std::string::npos) << metrics.body;
  EXPECT_NE(metrics.body.find("specontext_prepare_queue_depth 1"), std::string::npos) << metrics.body;
  EXPECT_NE(metrics.body.find("specontext_prepare_refused_total 2"), std::string::npos) << metrics.body;

  gate.release();
  a.join();
  b.join();
  EXPECT_EQ(completion.status, 200) << completion.body;
  EXPECT_EQ(completion.j()["usage"]["completion_tokens"], 3);
  EXPECT_EQ(tokenized.status, 200) << tokenized.body;
  EXPECT_EQ(tokenized.j()["count"], 5);  // BOS + 4 pieces
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.prepare_refused, 2);
  EXPECT_EQ(c.prepare_queued, 0);
  EXPECT_EQ(c.prepare_running, 0);
  EXPECT_EQ(c.accepted, 1);
  EXPECT_EQ(c.completed, 1);
}

// Issue 26, item 5: a prompt longer than max_prompt_bytes is a 400 naming the field, and the
// tokenizer never sees it; the default is 32 bytes per token of the context.
TEST(OpenAiServer, APromptPastTheByteLimitIsA400NamingTheFieldBeforeTokenizing) {
  Fixture f = make_fixture(1);
  CountingTokenizer counting(*f.tokenizer);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_prompt_bytes = 64;
  auto server = OpenAiServer::start(*f.engine, counting, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const std::string over(65, 'a');
  struct Case {
    const char* route;
    json body;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"/v1/completions", {{"prompt", over}, {"max_tokens", 1}}, "prompt"},
      {"/tokenize", {{"prompt", over}}, "prompt"},
      {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", over}}}}}, "messages"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.route);
    Reply r = post(port, c.route, c.body);
    ASSERT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(r.j()["error"]["param"], c.field) << r.body;
    const std::string message = r.j()["error"]["message"];
    const std::string expected = std::string("field '") + c.field + "' is 65 bytes";
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_NE(message.find("64"), std::string::npos) << message;
  }
  EXPECT_EQ(counting.encodes.load(), 0) << "refused before tokenizing";
  Reply fits = post(port, "/v1/completions", {{"prompt", std::string(64, 'a')}, {"max_tokens", 1}});
  EXPECT_EQ(fits.status, 200) << fits.body;
  EXPECT_GT(counting.encodes.load(), 0);
  server->reset();

  // Default: 32 bytes per token of the engine's context.
  auto defaulted = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
  ASSERT_TRUE(defaulted.is_ok());
  const size_t limit = static_cast<size_t>(f.engine->max_context()) * 32;
  Reply r = post((*defaulted)->port(), "/v1/completions", {{"prompt", std::string(limit + 1, 'a')}});
  ASSERT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(r.j()["error"]["param"], "prompt");
  EXPECT_NE(r.j()["error"]["message"].get<std::string>().find(std::to_string(limit)), std::string::npos)
      << r.body;
}

// Issue 26, item 6: connections that never send a request fill the limit; /health and /metrics
// are still answered on a new connection, anything else gets the 503 naming the limit.
// Once stop() returns, the listening port refuses connections (a router in front of the server
// sees it down at once instead of waiting on a backlog nobody serves; the close stop() posted to
// the I/O thread could be dropped by ioc.stop() before it ran). Several start/stop cycles, with
// and without a connection open, since that was a race.
TEST(OpenAiServer, AfterStopTheListeningPortRefusesConnections) {
  Fixture f = make_fixture(1);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(round);
    auto server = OpenAiServer::start(*f.engine, *f.tokenizer, options_for(*f.tokenizer));
    ASSERT_TRUE(server.is_ok()) << server.status().to_string();
    const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), (*server)->port());
    asio::io_context ioc;
    tcp::socket open(ioc);
    if (round % 2 == 1) {
      open.connect(where);
      ASSERT_TRUE(eventually([&] { return (*server)->counters().open_connections == 1; }));
    }
    (*server)->stop(std::chrono::milliseconds(0));
    tcp::socket late(ioc);
    beast::error_code ec;
    late.connect(where, ec);
    EXPECT_EQ(ec, asio::error::connection_refused) << ec.message();
  }
}

TEST(OpenAiServer, HealthAndMetricsAnswerWhileIdleConnectionsFillTheLimit) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_connections = 2;
  o.header_timeout = std::chrono::minutes(10);  // the idle ones stay for the whole test
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context ioc;
  tcp::socket idle1(ioc), idle2(ioc);
  idle1.connect(where);
  idle2.connect(where);
  ASSERT_TRUE(eventually([&] { return (*server)->counters().open_connections == 2; }));

  Reply health = send(port, http::verb::get, "/health");
  EXPECT_EQ(health.status, 200) << health.body;
  EXPECT_EQ(health.j()["status"], "ok");
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_EQ(metrics.status, 200) << metrics.body;
  EXPECT_NE(metrics.body.find("specontext_open_connections 2"), std::string::npos) << metrics.body;
  Reply work = post(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(work.status, 503) << work.body;
  EXPECT_NE(work.body.find("connection limit (2"), std::string::npos) << work.body;
  EXPECT_EQ((*server)->counters().connections_refused, 3);
  EXPECT_EQ((*server)->counters().open_connections, 2);
}

// Issue 26, item 6: a request header that does not come whole within header_timeout closes the
// connection (counted); so does a new connection that sends nothing; others are served.
TEST(OpenAiServer, AHeaderNotWholeWithinTheHeaderTimeoutClosesTheConnection) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.header_timeout = std::chrono::seconds(2);  // whole requests are never cut short on a loaded machine
  o.idle_timeout = std::chrono::minutes(10);  // only the header timeout can close them
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context ioc;
  {
    tcp::socket partial(ioc);
    partial.connect(where);
    asio::write(partial, asio::buffer(std::string("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")));
    EXPECT_TRUE(closed_by_server(partial));
  }
  {
    tcp::socket silent(ioc);
    silent.connect(where);
    EXPECT_TRUE(closed_by_server(silent));
  }
  {
    // Kept alive after a request: idle is allowed (idle_timeout), a started header is not.
    tcp::socket kept(ioc);
    kept.connect(where);
    EXPECT_EQ(send(port, http::verb::get, "/health", "", &kept).status, 200);
    asio::write(kept, asio::buffer(std::string("GET /hea")));
    EXPECT_TRUE(closed_by_server(kept));
  }
  EXPECT_TRUE(eventually([&] { return (*server)->counters().header_timeouts == 3; }));
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200);
  Reply metrics = send(port, http::verb::get, "/metrics");
  EXPECT_NE(metrics.body.find("specontext_header_timeouts_total 3"), std::string::npos) << metrics.body;
}

// Issue 26, item 6 (slow and idle clients): a kept-alive connection idle for idle_timeout is
// closed, and so is one whose body does not come whole within idle_timeout of its header or whose
// client goes away mid-body; none of them is a request, and the server serves on.
TEST(OpenAiServer, AnIdleConnectionOrABodyNotWholeWithinTheIdleTimeoutIsClosed) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.header_timeout = std::chrono::minutes(10);  // only the idle timeout can close them
  o.idle_timeout = std::chrono::seconds(2);     // whole requests are never cut short on a loaded machine
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context ioc;
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: 64\r\n\r\n{\"prompt\": \"Once\"";  // 17 of its 64 body bytes
  {
    tcp::socket kept(ioc);
    kept.connect(where);
    EXPECT_EQ(send(port, http::verb::get, "/health", "", &kept).status, 200);
    EXPECT_TRUE(closed_by_server(kept)) << "an idle kept-alive connection";
  }
  {
    tcp::socket slow_body(ioc);
    slow_body.connect(where);
    asio::write(slow_body, asio::buffer(head));
    EXPECT_TRUE(closed_by_server(slow_body)) << "a body that stops coming";
  }
  {
    tcp::socket gone(ioc);
    gone.connect(where);
    asio::write(gone, asio::buffer(head));
  }  // the client goes away mid-body
  EXPECT_TRUE(eventually([&] { return (*server)->counters().open_connections == 0; }));
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.accepted, 0);
  EXPECT_EQ(c.header_timeouts, 0);
  Reply served = post(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(served.status, 200) << served.body;
  EXPECT_EQ((*server)->counters().accepted, 1);
}

// Issue 26, item 6: one address may hold max_connections_per_ip connections; one more gets a
// 429 naming the address and is closed (a probe on it is answered); closing one makes room.
TEST(OpenAiServer, ConnectionsPastThePerIpCapGet429) {
  Fixture f = make_fixture(1);
  ServerOptions o = options_for(*f.tokenizer);
  o.max_connections_per_ip = 2;
  o.idle_timeout = std::chrono::minutes(10);
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  const tcp::endpoint where(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context ioc;
  auto [first, second] = two_kept_connections(ioc, port);

  tcp::socket third(ioc);
  third.connect(where);
  Reply refused = post_on(third, port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(refused.status, 429) << refused.body;
  EXPECT_EQ(refused.retry_after, "1");
  ASSERT_TRUE(refused.j().contains("error")) << refused.body;
  EXPECT_EQ(refused.j()["error"]["code"], "rate_limit_exceeded");
  EXPECT_NE(refused.body.find("too many connections from 127.0.0.1: 2 are open"), std::string::npos)
      << refused.body;
  EXPECT_TRUE(closed_by_server(third));
  EXPECT_EQ(send(port, http::verb::get, "/health").status, 200) << "a probe past the cap is answered";
  const ServerCounters c = (*server)->counters();
  EXPECT_EQ(c.connections_refused_per_ip, 2);
  EXPECT_EQ(c.connections_refused, 0);
  EXPECT_EQ(c.accepted, 0);

  first.reset();
  ASSERT_TRUE(eventually([&] { return (*server)->counters().open_connections == 1; }));
  Reply served = post(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}});
  EXPECT_EQ(served.status, 200) << served.body;
  EXPECT_EQ(send(port, http::verb::get, "/health", "", &second).status, 200);
}

}  // namespace
}  // namespace specontext::cluster
