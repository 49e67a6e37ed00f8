// `specontext router` as a process in front of two `specontext serve` processes: it prints where
// it listens, answers with the replicas' text, spreads requests by least-load, keeps answering
// when a replica is killed, exits 0 on SIGTERM with its counters, and bad flags are clear errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/serving/http_call.h"
#include "tests/serving/serve_process.h"
#include "tests/tests_common.h"

namespace specontext::router {
namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using json = nlohmann::json;
using specontext::testing::repo_path;

using Process = specontext::testing::SpecontextProcess;

Process serve() {
  return Process({"serve", "-m", repo_path("models/stories260K/stories260K.bin"), "--served-model-name", "stories",
                  "--listen", "127.0.0.1:0"});
}

TEST(RouterProcess, RoutesToServeProcessesAndKeepsAnsweringWhenOneIsKilled) {
  Process a = serve();
  Process b = serve();
  ASSERT_NE(a.port(), 0) << a.first_line();
  ASSERT_NE(b.port(), 0) << b.first_line();
  Process router({"router", "--replica", "http://127.0.0.1:" + std::to_string(a.port()), "--replica",
                  "127.0.0.1:" + std::to_string(b.port()), "--policy", "least-load", "--port", "0",
                  "--health-interval", "0"});
  ASSERT_NE(router.port(), 0) << router.first_line();
  const json listening = json::parse(router.first_line());
  EXPECT_EQ(listening["event"], "listening");
  EXPECT_EQ(listening["policy"], "least-load");
  EXPECT_EQ(listening["replicas"].size(), 2u);

  const std::string body = json{{"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 0}}.dump();
  const auto direct = testing::http_call(a.port(), http::verb::post, "/v1/completions", body);
  ASSERT_EQ(direct.first, 200) << direct.second;
  const std::string expected = json::parse(direct.second)["choices"][0]["text"];
  for (int i = 0; i < 2; ++i) {
    const auto r = testing::http_call(router.port(), http::verb::post, "/v1/completions", body);
    ASSERT_EQ(r.first, 200) << r.second;
    EXPECT_EQ(json::parse(r.second)["choices"][0]["text"], expected);
  }
  a.wait(SIGKILL);  // gone without a goodbye
  for (int i = 0; i < 3; ++i) {
    const auto r = testing::http_call(router.port(), http::verb::post, "/v1/completions", body);
    ASSERT_EQ(r.first, 200) << r.second;
    EXPECT_EQ(json::parse(r.second)["choices"][0]["text"], expected);
  }
  const auto metrics = testing::http_call(router.port(), http::verb::get, "/metrics", "");
  EXPECT_NE(metrics.second.find("\nspecontext_router_replicas_up 1\n"), std::string::npos) << metrics.second;
  const Process::Exit e = router.wait(SIGTERM);
  EXPECT_EQ(e.code, 0) << e.err;
  const json stopped = json::parse(e.out, nullptr, false);
  ASSERT_TRUE(stopped.is_object()) << e.out;
  EXPECT_EQ(stopped["event"], "stopped");
  EXPECT_EQ(stopped["requests"], 6);  // five completions and /metrics
  EXPECT_EQ(stopped["proxied"], 5);
  EXPECT_EQ(stopped["unavailable"], 0);
  EXPECT_NE(e.err.find("marked down"), std::string::npos) << e.err;
}

TEST(RouterProcess, BadFlagsAreClearErrors) {
  {
    Process p({"router", "--replica", "https://127.0.0.1:9", "--port", "0"});
    const Process::Exit e = p.wait(0);
    EXPECT_EQ(e.code, 1);
    EXPECT_NE(e.err.find("--replica"), std::string::npos) << e.err;
    EXPECT_NE(e.err.find("https:// replicas are not supported"), std::string::npos) << e.err;
  }
  {
    Process p({"router", "--replica", "127.0.0.1:nope", "--port", "0"});
    const Process::Exit e = p.wait(0);
    EXPECT_EQ(e.code, 1);
    EXPECT_NE(e.err.find("expected http://HOST:PORT"), std::string::npos) << e.err;
  }
  {
    Process p({"router", "--port", "0"});
    const Process::Exit e = p.wait(0);
    EXPECT_NE(e.code, 0);
    EXPECT_NE(e.err.find("--replica"), std::string::npos) << e.err;
  }
  {
    Process p({"router", "--replica", "127.0.0.1:9", "--policy", "random"});
    const Process::Exit e = p.wait(0);
    EXPECT_NE(e.code, 0);
    EXPECT_NE(e.err.find("--policy"), std::string::npos) << e.err;
  }
}

}  // namespace
}  // namespace specontext::router
