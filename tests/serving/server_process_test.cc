// `specontext serve` as a process: it prints where it listens, answers with the text
// `specontext generate` gives, drains an accepted request on SIGTERM before it exits 0 with its
// counters, takes API keys from --api-key-file or SPECONTEXT_API_KEY, passes the connection and
// request-queue flags to the server, and bad flags are clear errors (exit 1), never a hang.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <chrono>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tests/serving/serve_process.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using json = nlohmann::json;
using specontext::testing::repo_path;
using specontext::testing::temp_dir;
using specontext::testing::write_file;
using specontext::testing::write_owner_only;

using specontext::testing::ServeProcess;

std::string get(uint16_t port, const std::string& target) {
  asio::io_context ioc;
  asio::ip::tcp::socket s(ioc);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  http::request<http::string_body> req{http::verb::get, target, 11};
  req.set(http::field::host, "127.0.0.1");
  http::write(s, req);
  boost::beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(s, buf, res);
  return res.body();
}

// The HTTP status of GET `target`, with `authorization` as the Authorization header unless empty.
int status_of(uint16_t port, const std::string& target, const std::string& authorization = "") {
  asio::io_context ioc;
  asio::ip::tcp::socket s(ioc);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  http::request<http::string_body> req{http::verb::get, target, 11};
  req.set(http::field::host, "127.0.0.1");
  if (!authorization.empty()) req.set(http::field::authorization, authorization);
  http::write(s, req);
  boost::beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(s, buf, res);
  return static_cast<int>(res.result_int());
}

json post(uint16_t port, const json& body) {
  asio::io_context ioc;
  asio::ip::tcp::socket s(ioc);
  s.connect({asio::ip::make_address("127.0.0.1"), port});
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, "127.0.0.1");
  req.body() = body.dump();
  req.prepare_payload();
  http::write(s, req);
  boost::beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(s, buf, res);
  return json::parse(res.body(), nullptr, false);
}

// Polls /metrics until it holds one of `any_of` or `limit` passes (a safety net against a hang,
// not a timing assertion: the caller checks what it wanted afterwards).
void wait_for_metrics(uint16_t port, std::initializer_list<std::string_view> any_of,
                      std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const auto shown = [&] {
    const std::string m = get(port, "/metrics");
    return std::any_of(any_of.begin(), any_of.end(),
                       [&](std::string_view s) { return m.find(s) != std::string::npos; });
  };
  while (!shown() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<std::string> model_flags() {
  return {"-m",
          repo_path("models/stories260K/stories260K.bin"),
          "--served-model-name",
          "stories",
          "--listen",
          "127.0.0.1:0"};
}

// `specontext generate`'s greedy text for a prompt (quoted for the shell).
std::string generate_text(const std::string& prompt, int n) {
  std::string quoted = "'";
  for (char ch : prompt) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  quoted += "'";
  FILE* gen =
      popen((std::string(SPECONTEXT_BIN) + " generate -m " + repo_path("models/stories260K/stories260K.bin") +
             " -p " + quoted + " -n " + std::to_string(n) + " --json 2>/dev/null")
                .c_str(),
            "r");
  EXPECT_NE(gen, nullptr);
  if (gen == nullptr) return {};
  std::string gen_out;
  std::array<char, 4096> buf{};
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), gen)) > 0) gen_out.append(buf.data(), got);
  EXPECT_EQ(pclose(gen), 0) << gen_out;
  const json j = json::parse(gen_out, nullptr, false);
  return j.is_object() ? j.value("text", std::string()) : std::string();
}

TEST(ServeProcess, AnswersWithTheTextGenerateGivesAndDrainsOnSigterm) {
  const std::string expected = generate_text("Once upon a time", 40);
  ASSERT_FALSE(expected.empty());

  ServeProcess server(model_flags());
  ASSERT_NE(server.port(), 0) << server.first_line();
  const json listening = json::parse(server.first_line());
  EXPECT_EQ(listening["event"], "listening");
  EXPECT_EQ(listening["model"], "stories");
  EXPECT_EQ(listening["sparse"], "specontext")
      << "the retrieval head beside the model is found, as generate does";
  const json r =
      post(server.port(),
           {{"model", "stories"}, {"prompt", "Once upon a time"}, {"max_tokens", 40}, {"temperature", 0}});
  EXPECT_EQ(r["choices"][0]["text"], expected) << r.dump();
  EXPECT_EQ(listening["prefix_caching"], true);
  EXPECT_EQ(listening["prefix_cache_slots"], 16);
  // The next turn resends the first: answered from the cache (SpeContext: the head's keys and the
  // page-boundary features are forked too) with generate's text for the whole prompt.
  const std::string turn = "Once upon a time" + expected + " Then";
  const json next = post(server.port(), {{"prompt", turn}, {"max_tokens", 20}, {"temperature", 0}});
  EXPECT_GE(next["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 32) << next.dump();
  EXPECT_EQ(next["choices"][0]["text"], generate_text(turn, 20)) << next.dump();

  // SIGTERM while a request runs: it is answered in full, then the server exits 0.
  json drained;
  std::thread client([&] {
    drained =
        post(server.port(), {{"prompt", "Once upon a time"}, {"max_tokens", 400}, {"ignore_eos", true}});
  });
  wait_for_metrics(server.port(), {"specontext_requests_running 1", "specontext_requests_completed_total 3"},
                   std::chrono::seconds(30));
  const ServeProcess::Exit e = server.wait(SIGTERM);
  client.join();
  EXPECT_EQ(e.code, 0) << e.err;
  EXPECT_EQ(drained["usage"]["completion_tokens"], 400) << drained.dump();
  const json stopped = json::parse(e.out, nullptr, false);
  ASSERT_TRUE(stopped.is_object()) << e.out;
  EXPECT_EQ(stopped["event"], "stopped");
  EXPECT_EQ(stopped["completed"], 3);
  EXPECT_GE(stopped["cached_prompt_tokens"].get<int64_t>(), 32);
  EXPECT_EQ(stopped["signal"], SIGTERM);
}

TEST(ServeProcess, ApiKeysComeFromTheKeyFileOrElseTheEnvironment) {
  {
    const std::string keys = temp_dir("serve_api_keys") + "/keys";
    ASSERT_TRUE(write_owner_only(keys, "k1\n\n  k2  "));  // one per line; blanks and spaces ignored
    std::vector<std::string> args = model_flags();
    args.insert(args.end(), {"--api-key-file", keys, "--max-connections", "8"});
    ServeProcess server(args);
    ASSERT_NE(server.port(), 0) << server.first_line();
    const json listening = json::parse(server.first_line());
    EXPECT_EQ(listening["api_key_required"], true);
    EXPECT_EQ(listening["max_connections"], 8);
    EXPECT_EQ(status_of(server.port(), "/v1/models"), 401);
    EXPECT_EQ(status_of(server.port(), "/v1/models", "Bearer k3"), 401);
    EXPECT_EQ(status_of(server.port(), "/v1/models", "Bearer k2"), 200);
    EXPECT_EQ(status_of(server.port(), "/health"), 200);
    const ServeProcess::Exit e = server.wait(SIGTERM);
    EXPECT_EQ(e.code, 0) << e.err;
    const json stopped = json::parse(e.out, nullptr, false);
    ASSERT_TRUE(stopped.is_object()) << e.out;
    EXPECT_EQ(stopped["unauthorized"], 2);
  }
  // Without --api-key-file, SPECONTEXT_API_KEY (the child inherits this process's environment).
  ASSERT_EQ(setenv("SPECONTEXT_API_KEY", "from-env", 1), 0);
  ServeProcess server(model_flags());
  unsetenv("SPECONTEXT_API_KEY");
  ASSERT_NE(server.port(), 0) << server.first_line();
  EXPECT_EQ(status_of(server.port(), "/v1/models"), 401);
  EXPECT_EQ(status_of(server.port(), "/v1/models", "Bearer from-env"), 200);
}

// The connection and request-queue flags reach the server (issue 26, items 5 and 6): the
// listening line reports them, a prompt past --max-prompt-bytes is a 400 naming the field, and
// a header never finished is closed (after --header-timeout; counted in the stopped line).
TEST(ServeProcess, ConnectionAndRequestQueueFlagsReachTheServer) {
  std::vector<std::string> args = model_flags();
  args.insert(args.end(), {"--max-connections-per-ip", "3", "--header-timeout", "3", "--idle-timeout", "60",
                           "--request-workers", "1", "--request-queue", "5", "--max-prompt-bytes", "16"});
  ServeProcess server(args);
  ASSERT_NE(server.port(), 0) << server.first_line();
  const json listening = json::parse(server.first_line());
  EXPECT_EQ(listening["max_connections_per_ip"], 3);
  EXPECT_EQ(listening["request_workers"], 1);
  EXPECT_EQ(listening["request_queue"], 5);
  const json refused = post(server.port(), {{"prompt", std::string(17, 'a')}, {"max_tokens", 1}});
  EXPECT_EQ(refused["error"]["param"], "prompt") << refused.dump();
  const json served = post(server.port(), {{"prompt", "Once upon"}, {"max_tokens", 2}});
  EXPECT_EQ(served["usage"]["completion_tokens"], 2) << served.dump();
  {
    asio::io_context ioc;
    asio::ip::tcp::socket s(ioc);
    s.connect({asio::ip::make_address("127.0.0.1"), server.port()});
    asio::write(s, asio::buffer(std::string("GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")));
    // The server closes it when the header timeout ends the wait (3 s: long enough that the two
    // whole requests above are never cut short on a loaded machine, so exactly one times out).
    std::array<char, 256> sink{};
    boost::system::error_code ec;
    while (!ec) s.read_some(asio::buffer(sink), ec);
    EXPECT_TRUE(ec == asio::error::eof || ec == asio::error::connection_reset) << ec.message();
  }
  // The timer closes the socket before the connection's coroutine resumes and counts the timeout:
  // wait until /metrics shows it, so the SIGTERM cannot overtake the count (a safety net of 60 s,
  // not a timing assertion).
  wait_for_metrics(server.port(), {"specontext_header_timeouts_total 1"}, std::chrono::seconds(60));
  const ServeProcess::Exit e = server.wait(SIGTERM);
  EXPECT_EQ(e.code, 0) << e.err;
  const json stopped = json::parse(e.out, nullptr, false);
  ASSERT_TRUE(stopped.is_object()) << e.out;
  EXPECT_EQ(stopped["header_timeouts"], 1);
}

TEST(ServeProcess, BadFlagsAreClearErrors) {
  const std::string dir = temp_dir("serve_bad_keys");
  const std::string readable_keys = dir + "/readable", empty_keys = dir + "/empty";
  write_file(readable_keys, "k1\n");
  ASSERT_EQ(::chmod(readable_keys.c_str(), 0644), 0);
  ASSERT_TRUE(write_owner_only(empty_keys, " \n"));
  struct Case {
    std::vector<std::string> args;
    std::string in_error;
  };
  const std::vector<Case> cases = {
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--listen", "127.0.0.1:70000"}, "--listen"},
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--listen", "not-an-endpoint"}, "--listen"},
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--listen", "10.255.255.1:0"},
       "cannot listen"},
      // vLLM's --api-key KEY: refused, the key would be in ps; the message names the file flag.
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--api-key", "k1"}, "--api-key-file FILE"},
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--api-key-file", "/nonexistent/keys"},
       "--api-key-file /nonexistent/keys"},
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--api-key-file", readable_keys}, "chmod 600"},
      {{"-m", repo_path("models/stories260K/stories260K.bin"), "--api-key-file", empty_keys}, "holds no key"},
      {{"-m", "/nonexistent/model.bin", "--listen", "127.0.0.1:0"}, "/nonexistent/model.bin"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args[1] + " " + c.args.back());
    ServeProcess p(c.args);
    const ServeProcess::Exit e = p.wait(0);
    EXPECT_EQ(e.code, 1) << e.err;
    EXPECT_NE(e.err.find(c.in_error), std::string::npos) << e.err;
  }
}

}  // namespace
}  // namespace specontext::cluster
