// KV nodes as separate processes (`specontext kv-node`), used by `specontext generate --kv-node`:
// the text equals the all-device run's; a mirrored tier survives SIGKILL of one node mid-run with
// the same text; a node restarted mid-run rejoins its tier and carries it when the other dies;
// losing the only node recomputes without it (the all-device text under dense attention), or with
// --lost-tier fail is a clear error naming it, as an unreachable node or a bad spec is; never a hang.
// The README's kv-node example runs as README.md writes it; secrets never reach a command line.
#include <fcntl.h>
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
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "cluster/kv_node_client.h"
#include "tests/cluster/kv_node_tls_util.h"
#include "tests/serving/http_call.h"
#include "tests/serving/serve_process.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

using namespace std::chrono_literals;
using specontext::testing::repo_path;
using specontext::testing::write_owner_only;

// A `specontext kv-node` child; its port is read from the first line it prints. `extra` flags
// follow the capacity and address; stderr goes to `stderr_path` when one is given.
class NodeProcess {
 public:
  explicit NodeProcess(const std::string& capacity = "16MiB", const std::string& listen = "127.0.0.1:0",
                       const std::vector<std::string>& extra = {}, const std::string& stderr_path = "") {
    std::vector<std::string> args = {"kv-node", "--capacity", capacity, "--listen", listen};
    args.insert(args.end(), extra.begin(), extra.end());
    start(args, stderr_path, "");
  }
  // `specontext ARGS...` (ARGS from "kv-node" on) run in the directory `cwd`.
  struct Argv {
    std::vector<std::string> args;
    std::string cwd;
  };
  explicit NodeProcess(const Argv& a) { start(a.args, "", a.cwd); }
  ~NodeProcess() {
    kill_now();
    if (out_ != nullptr) fclose(out_);
  }
  pid_t pid() const { return pid_; }
  uint16_t port() const { return port_; }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  void kill_now() {
    stats_client_.reset();
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  // SIGTERM: the node stops cleanly; returns its exit code and what it printed after listening.
  std::pair<int, std::string> terminate() {
    stats_client_.reset();
    ::kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    std::string rest;
    std::array<char, 512> line{};
    while (out_ != nullptr && fgets(line.data(), line.size(), out_) != nullptr) rest += line.data();
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, rest};
  }
  // terminate(), expecting exit 0, and the node's stop line as JSON (a discarded value when it
  // printed none: callers ASSERT is_object()).
  nlohmann::json stop() {
    auto [code, out] = terminate();
    EXPECT_EQ(code, 0) << out;
    const auto j = nlohmann::json::parse(out, nullptr, false);
    EXPECT_TRUE(j.is_object()) << out;
    return j;
  }
  // A counter of the node's stats (polled through its control plane); -1 when it does not answer.
  // One connection serves every poll: tests poll every millisecond, and a connection per poll
  // left tens of thousands of sockets in TIME-WAIT, enough to exhaust the ephemeral ports and
  // make the engine's own connections fail ("Destination is unreachable").
  // The node closes a connection idle for its --idle-timeout-ms, so a poll after a quiet spell
  // reconnects once.
  int64_t stat(const char* name, const std::string& secret = {}) const {
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (stats_client_ == nullptr) {
        auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", port_}, 2s, secret);
        if (!c.is_ok()) return -1;
        stats_client_ = std::move(*c);
      }
      auto r = stats_client_->call_line(R"({"op":"stats"})");
      if (r.is_ok()) return r->contains(name) ? (*r)[name].get<int64_t>() : -1;
      stats_client_.reset();  // the node died or closed it
    }
    return -1;
  }
  int64_t regions() const { return stat("regions"); }

 private:
  void start(std::vector<std::string> args, const std::string& stderr_path, const std::string& cwd) {
    int fds[2];
    if (pipe(fds) != 0) return;
    args.insert(args.begin(), SPECONTEXT_BIN);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(126);
      if (!stderr_path.empty()) {
        const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (err >= 0) dup2(err, STDERR_FILENO);
      }
      execv(SPECONTEXT_BIN, argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    std::array<char, 512> line{};
    if (out_ != nullptr && fgets(line.data(), line.size(), out_) != nullptr) {
      auto j = nlohmann::json::parse(line.data(), nullptr, false);
      if (j.is_object() && j.contains("port")) port_ = j["port"].get<uint16_t>();
    }
  }

  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  uint16_t port_ = 0;
  mutable std::unique_ptr<KvNodeClient> stats_client_;
};

// A background `specontext generate`; finish() returns exit code and stdout.
class Generate {
 public:
  explicit Generate(const std::string& args) : Generate(Shell{std::string(SPECONTEXT_BIN) + " generate " + args}) {}
  // A whole shell command line (stderr joins stdout).
  struct Shell {
    std::string line;
  };
  explicit Generate(const Shell& sh) { pipe_ = popen((sh.line + " 2>&1").c_str(), "r"); }
  std::pair<int, std::string> finish() {
    std::string out;
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), pipe_)) > 0) out.append(buf.data(), n);
    const int status = pclose(pipe_);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
  }

 private:
  FILE* pipe_ = nullptr;
};

std::string model_args(int n) {
  return "-m " + repo_path("models/stories260K/stories260K.bin") + " --head " +
         repo_path("models/stories260K/retrieval_head.safetensors") + " -p 'Once upon a time' -B 32 -n " +
         std::to_string(n) + " --json";
}
// A device tier too small for the run, so the planner sends layers to the remote tier.
const char* kTiers = " --device-kv 200KiB --host-kv 64KiB";

nlohmann::json parse_json_tail(const std::string& out) {
  const size_t brace = out.find('{');
  return brace == std::string::npos ? nlohmann::json()
                                    : nlohmann::json::parse(out.substr(brace), nullptr, false);
}

std::string baseline_text(int n) {
  auto [code, out] = Generate(model_args(n)).finish();
  EXPECT_EQ(code, 0) << out;
  return parse_json_tail(out).value("text", "");
}

TEST(KvNodeProcess, GenerateOnAKvNodeGivesTheAllDeviceText) {
  NodeProcess node;
  ASSERT_NE(node.port(), 0);
  const std::string expect = baseline_text(200);
  auto [code, out] = Generate(model_args(200) + kTiers + " --kv-node 1MiB@" + node.endpoint()).finish();
  ASSERT_EQ(code, 0) << out;
  const auto j = parse_json_tail(out);
  EXPECT_EQ(j["text"].get<std::string>(), expect);
  const auto& t = j["tiering"];
  int remote_layers = 0;
  for (int h : t["layer_homes"]) remote_layers += h == 2;
  EXPECT_GT(remote_layers, 0) << t["layer_homes"];
  const auto& rep = t["kv_nodes"][0]["replicas"][0];
  EXPECT_TRUE(rep["alive"].get<bool>());
  EXPECT_GT(rep["bytes_read"].get<uint64_t>(), 0u);
  EXPECT_GT(rep["bytes_written"].get<uint64_t>(), 0u);
}

// The README's tiers at 400 tokens (issue #26, item 8: the README once ran this): 400 tokens need
// CPU filtering, so the head's keys (52 KiB) go to the 64 KiB host pool and the layers to the
// mirrored tier. It used to be refused with "host0 0 B free of 0 B": the planner took a chunk per
// model layer (5 x 16 KiB) off every pool, even one that holds no layer
// (PlannerPolicy.APoolIsChargedForTheGranularityOfWhatItHolds...). The README's own commands:
// KvNodeProcess.TheReadmesKvNodeExampleRunsAsWritten.
// Since device-homed layers have no working sets (issue #30) the README's 200 KiB device holds the
// head's keys at 400 tokens; 160 KiB makes CPU filtering necessary again.
TEST(KvNodeProcess, AMirroredTierWithTheHeadsKeysOnA64KiBHostPoolRunsFourHundredTokens) {
  NodeProcess a("64MiB"), b("64MiB");
  ASSERT_TRUE(a.port() != 0 && b.port() != 0);
  const std::string expect = baseline_text(400);
  auto [code, out] = Generate(model_args(400) + " --device-kv 160KiB --host-kv 64KiB --kv-node 1MiB@" + a.endpoint() +
                              "+" + b.endpoint())
                         .finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(out.find("0 B free of 0 B"), std::string::npos) << out;
  const auto j = parse_json_tail(out);
  EXPECT_EQ(j["refused"].get<int64_t>(), 0) << out;
  EXPECT_EQ(j["text"].get<std::string>(), expect);
  const auto& t = j["tiering"];
  EXPECT_TRUE(t["cpu_filtering"].get<bool>()) << t;
  EXPECT_GT(t["tiers"][1]["peak_used_bytes"].get<uint64_t>(), 0u) << "the head's keys never reached host0: " << t;
  for (const auto& rep : t["kv_nodes"][0]["replicas"]) {
    EXPECT_TRUE(rep["alive"].get<bool>()) << rep;
    EXPECT_GT(rep["bytes_written"].get<uint64_t>(), 0u) << rep;
  }
}

// The command lines of the README's kv-node example (the block under "# KV on remote nodes" in
// README.md's quick start, up to the next comment): backslash continuations joined, comments
// and blank lines left out.
std::vector<std::string> readme_kv_node_example() {
  std::ifstream in(repo_path("README.md"));
  std::vector<std::string> commands;
  std::string line, pending;
  bool in_block = false;
  while (std::getline(in, line)) {
    if (!in_block) {
      in_block = line.starts_with("# KV on remote nodes");
      continue;
    }
    if (pending.empty() && line.starts_with("#")) {
      if (!commands.empty()) break;  // the block's own comment lines come before its commands
      continue;
    }
    if (line.empty() || line.starts_with("```")) break;
    const bool continued = line.ends_with("\\");
    pending += continued ? line.substr(0, line.size() - 1) : line;
    if (!continued) {
      commands.push_back(pending);
      pending.clear();
    }
  }
  return commands;
}

// Whitespace-separated words of a command without quotes, less a trailing "&".
std::vector<std::string> words_of(const std::string& command) {
  std::vector<std::string> words;
  std::istringstream in(command);
  for (std::string w; in >> w;) words.push_back(w);
  if (!words.empty() && words.back() == "&") words.pop_back();
  return words;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

// The README's kv-node example, read from README.md so that the two cannot drift: its commands
// run as written in a directory of their own (models/ a link to the repository's), with two
// changes only: this build's binary for build/release/bin/specontext, and each node's port chosen
// by the system (--listen HOST:0, its printed port put in the engine's --kv-node) so that tests
// running at once do not collide. The secret file the README makes guards both nodes, the engine
// answers with it, the run writes to both replicas and gives the text of the same command without
// the tiers and nodes.
TEST(KvNodeProcess, TheReadmesKvNodeExampleRunsAsWritten) {
  const std::vector<std::string> commands = readme_kv_node_example();
  ASSERT_EQ(commands.size(), 4u) << "expected: make the secret, two kv-nodes, one generate";
  const std::string binary = "build/release/bin/specontext";
  const std::string dir = ::testing::TempDir() + "/kv_node_readme_example";
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(std::filesystem::create_directories(dir));
  std::filesystem::create_directory_symlink(repo_path("models"), dir + "/models");

  // (umask 077; head -c 32 /dev/urandom | base64 > kv.secret)
  ASSERT_EQ(commands[0].find(binary), std::string::npos) << commands[0];
  ASSERT_EQ(std::system(("cd '" + dir + "' && " + commands[0]).c_str()), 0) << commands[0];

  std::vector<std::unique_ptr<NodeProcess>> nodes;
  std::vector<std::pair<std::string, std::string>> endpoints;  // the README's -> this run's
  for (size_t i = 1; i <= 2; ++i) {
    SCOPED_TRACE(commands[i]);
    ASSERT_TRUE(commands[i].ends_with("&")) << "a node runs in the background";
    std::vector<std::string> words = words_of(commands[i]);
    ASSERT_GE(words.size(), 2u);
    ASSERT_EQ(words[0], binary);
    ASSERT_EQ(words[1], "kv-node");
    words.erase(words.begin());
    const auto listen = std::find(words.begin(), words.end(), "--listen");
    ASSERT_TRUE(listen != words.end() && listen + 1 != words.end());
    const std::string readme_endpoint = *(listen + 1);
    const size_t colon = readme_endpoint.rfind(':');
    ASSERT_NE(colon, std::string::npos);
    *(listen + 1) = readme_endpoint.substr(0, colon) + ":0";
    nodes.push_back(std::make_unique<NodeProcess>(NodeProcess::Argv{words, dir}));
    ASSERT_NE(nodes.back()->port(), 0);
    endpoints.emplace_back(readme_endpoint, nodes.back()->endpoint());
  }

  std::string run = commands[3];
  ASSERT_TRUE(run.starts_with(binary + " generate ")) << run;
  ASSERT_NE(run.find("--kv-secret-file"), std::string::npos) << "the README's nodes hold a secret";
  replace_all(run, binary, SPECONTEXT_BIN);
  // Without tiers and nodes: the all-device text.
  std::string alone = run;
  for (const char* flag : {"--device-kv", "--host-kv", "--kv-node", "--kv-secret-file"}) {
    const size_t at = alone.find(std::string(" ") + flag + " ");
    ASSERT_NE(at, std::string::npos) << flag << " in " << run;
    const size_t value_end = alone.find(' ', at + std::strlen(flag) + 2);
    alone.erase(at, (value_end == std::string::npos ? alone.size() : value_end) - at);
  }
  for (const auto& [readme, actual] : endpoints) {
    ASSERT_NE(run.find(readme), std::string::npos) << readme << " in " << run;
    replace_all(run, readme, actual);
  }
  auto [alone_code, alone_out] = Generate(Generate::Shell{"cd '" + dir + "' && " + alone}).finish();
  ASSERT_EQ(alone_code, 0) << alone << "\n" << alone_out;
  const std::string expect = parse_json_tail(alone_out).value("text", "");
  ASSERT_FALSE(expect.empty()) << alone_out;

  auto [code, out] = Generate(Generate::Shell{"cd '" + dir + "' && " + run}).finish();
  ASSERT_EQ(code, 0) << run << "\n" << out;
  const auto j = parse_json_tail(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["refused"].get<int64_t>(), 0) << out;
  EXPECT_EQ(j["text"].get<std::string>(), expect);
  const auto& t = j["tiering"];
  int remote_layers = 0;
  for (int h : t["layer_homes"]) remote_layers += h == 2;
  EXPECT_GT(remote_layers, 0) << t["layer_homes"];
  ASSERT_EQ(t["kv_nodes"][0]["replicas"].size(), 2u) << t;
  for (const auto& rep : t["kv_nodes"][0]["replicas"]) {
    EXPECT_TRUE(rep["alive"].get<bool>()) << rep;
    EXPECT_GT(rep["bytes_written"].get<uint64_t>(), 0u) << rep;
  }
  for (auto& node : nodes) {
    const auto stopped = node->stop();
    ASSERT_TRUE(stopped.is_object());
    EXPECT_EQ(stopped["auth_failures"].get<int64_t>(), 0) << stopped;
    EXPECT_GT(stopped["requests"].get<int64_t>(), 0) << stopped;
  }
  // The nodes demanded the secret: a client without it is refused (checked on a fresh node of the
  // README's first command line, as the nodes above are stopped).
  std::vector<std::string> first = words_of(commands[1]);
  first.erase(first.begin());
  *(std::find(first.begin(), first.end(), "--listen") + 1) = "127.0.0.1:0";
  NodeProcess again(NodeProcess::Argv{first, dir});
  ASSERT_NE(again.port(), 0);
  auto none = KvNodeClient::connect(Endpoint{"127.0.0.1", again.port()}, 2s);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("requires authentication"), std::string::npos)
      << none.status().to_string();
  std::filesystem::remove_all(dir);
}

// Text mode (no --json): what happens to the replicas is printed to stderr, naming the node
// (cluster/replica_events.h). It used to be reported only in --json. The run of KvNodeRejoin
// (Restart): b dies, comes back at its address and is filled, then a dies.
TEST(KvNodeProcess, TextModeNamesTheNodeOfEachFailOverAndRejoin) {
  NodeProcess a, b;
  ASSERT_TRUE(a.port() != 0 && b.port() != 0);
  std::string args = model_args(480);
  args.erase(args.rfind(" --json"));
  Generate gen(args + " --batch 3 --device-kv 600KiB --host-kv 256KiB --kv-node-rejoin-ms 20 --kv-node 2MiB@" +
               a.endpoint() + "+" + b.endpoint());
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while ((a.regions() < 1 || b.regions() < 1) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  const std::string b_address = b.endpoint();
  b.kill_now();
  NodeProcess back("16MiB", b_address);
  ASSERT_EQ(back.endpoint(), b_address);
  while (back.stat("bytes_scattered") < (2 << 20) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  a.kill_now();
  auto [code, out] = gen.finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(out.find('{'), std::string::npos) << "text mode printed JSON: " << out;
  const std::string tier = "kv-node: tier remote0: ";
  const size_t b_dead = out.find(tier + "replica 1 on " + b_address + " is dead (");
  const size_t b_back = out.find(tier + "replica 1 rejoined on " + b_address + ": 2.00 MiB copied from a live replica");
  const size_t a_dead = out.find(tier + "replica 0 on " + a.endpoint() + " is dead (");
  ASSERT_NE(b_dead, std::string::npos) << out;
  ASSERT_NE(b_back, std::string::npos) << out;
  ASSERT_NE(a_dead, std::string::npos) << out;
  EXPECT_LT(b_dead, b_back);
  EXPECT_LT(b_back, a_dead);
  EXPECT_NE(out.find("reads fail over, the tier goes on on " + a.endpoint()), std::string::npos) << out;
  EXPECT_NE(out.find("reads fail over, the tier goes on on " + b_address), std::string::npos) << out;
}

// Text mode, the only node lost mid-run (LosingTheOnlyNodeMidRunRecomputesTheAllDeviceText): the
// loss is printed naming the node and why, and the run recomputes and ends well.
TEST(KvNodeProcess, TextModeNamesTheDeadNodesOfALostTier) {
  NodeProcess node;
  ASSERT_NE(node.port(), 0);
  std::string args = model_args(400);
  args.erase(args.rfind(" --json"));
  Generate gen(args + " --sparse dense --batch 3 --no-probe --device-kv 600KiB --host-kv 512KiB --kv-node 2MiB@" +
               node.endpoint());
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (node.stat("bytes_scattered") <= 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  node.kill_now();
  auto [code, out] = gen.finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("kv-node: tier remote0 lost: no replica alive (" + node.endpoint() + ": "), std::string::npos)
      << out;
}

// The node-side gather (default); one-sided RMA is refused (BadSpecsAndUnreachableNodesAreNamed).
class KvNodeModes : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Modes, KvNodeModes, ::testing::Values("gather"));

TEST_P(KvNodeModes, MirroredTierSurvivesSigkillOfOneNodeMidRun) {
  auto [base_code, base_out] = Generate(model_args(400)).finish();
  ASSERT_EQ(base_code, 0) << base_out;
  const auto base = parse_json_tail(base_out);
  const std::string expect = base.value("text", "");
  // The all-device run's compute time, from its own rates: its wall time also holds the process's
  // start-up (a CUDA build's driver probe alone can take longer than the run), which the tiered
  // run has behind it once the nodes hold its regions.
  const double compute_s = base["prompt_tokens"].get<double>() / base["prefill_tokens_per_s"].get<double>() +
                           base["generated_tokens"].get<double>() / base["decode_tokens_per_s"].get<double>();
  // The kill must land mid-run: after node a took part (the tiered run sends its first layer to
  // the nodes after about 10 % of its time) and before the run ends. The time that takes depends
  // on the machine's load, so a run whose kill missed (the replica never written, or never seen
  // to die) is repeated with the kill moved, up to 4 runs; every run must still give the
  // all-device text and exit 0.
  double kill_at = 0.6;
  for (int attempt = 0; attempt < 4; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt) + ", kill at " + std::to_string(kill_at) + "x");
    NodeProcess a, b;
    ASSERT_TRUE(a.port() != 0 && b.port() != 0);
    // More host memory than kTiers gives: the head's keys move there, and layers may too.
    Generate gen(model_args(400) + " --device-kv 200KiB --host-kv 256KiB --kv-node-mode " + GetParam() +
                 " --kv-node 2MiB@" + a.endpoint() + "+" + b.endpoint());
    // Once both nodes hold the tier's region, set-up is over.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while ((a.regions() < 1 || b.regions() < 1) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(compute_s * kill_at));
    a.kill_now();
    auto [code, out] = gen.finish();
    ASSERT_EQ(code, 0) << out;
    const auto j = parse_json_tail(out);
    ASSERT_EQ(j["text"].get<std::string>(), expect);
    EXPECT_EQ(j["tiering"]["kv_nodes"][0]["mode"], GetParam());
    const auto& reps = j["tiering"]["kv_nodes"][0]["replicas"];
    if (reps[0]["bytes_written"].get<uint64_t>() == 0) {  // killed before it took part
      kill_at *= 1.6;
      continue;
    }
    if (reps[0]["alive"].get<bool>()) {  // the run ended before the kill
      kill_at /= 2;
      continue;
    }
    EXPECT_FALSE(reps[0]["error"].get<std::string>().empty()) << reps;
    EXPECT_TRUE(reps[1]["alive"].get<bool>()) << reps;
    EXPECT_GT(reps[1]["bytes_read"].get<uint64_t>(), 0u) << reps;
    return;
  }
  FAIL() << "no run had its first replica killed mid-run";
}

// SIGKILL of node b mid-run; b's replica comes back on a new `kv-node` at b's address (restart)
// or, with b gone for good, on a spare; then a is killed, and the rejoined replica carries the
// tier to the end with the all-device text.
class KvNodeRejoin : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(RestartOrSpare, KvNodeRejoin, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Restart" : "Spare"; });

TEST_P(KvNodeRejoin, ADeadNodesReplicaComesBackAndCarriesTheTierWhenTheOtherDies) {
  const bool restart = GetParam();
  NodeProcess a, b, spare;
  ASSERT_TRUE(a.port() != 0 && b.port() != 0 && spare.port() != 0);
  const std::string expect = baseline_text(480);
  // Three copies of the request (run one after another) keep the run going well past a node
  // restart on a loaded machine: with one copy the run once ended before the restarted node
  // listened. The text is the first copy's. b dies as soon as both nodes hold the tier's region,
  // possibly still in set-up: a mirrored tier starts without a replica it cannot reach.
  Generate gen(model_args(480) +
               " --batch 3 --device-kv 600KiB --host-kv 256KiB --kv-node-rejoin-ms 20 --kv-node 2MiB@" +
               a.endpoint() + "+" + b.endpoint() + (restart ? "" : " --kv-node-spare " + spare.endpoint()));
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while ((a.regions() < 1 || b.regions() < 1) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  const std::string b_address = b.endpoint();
  b.kill_now();
  std::unique_ptr<NodeProcess> back;
  if (restart) {
    back = std::make_unique<NodeProcess>("16MiB", b_address);  // at the same address, empty
    ASSERT_EQ(back->endpoint(), b_address);
  }
  const NodeProcess& heir = restart ? *back : spare;
  // The engine fills the new region from a (node-side scatters of the whole 2 MiB tier), then a dies.
  while (heir.stat("bytes_scattered") < (2 << 20) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  a.kill_now();
  auto [code, out] = gen.finish();
  ASSERT_EQ(code, 0) << out;
  const auto j = parse_json_tail(out);
  EXPECT_EQ(j["text"].get<std::string>(), expect);
  const auto& node = j["tiering"]["kv_nodes"][0];
  const auto& reps = node["replicas"];
  EXPECT_FALSE(reps[0]["alive"].get<bool>()) << "a died after the run ended: " << reps;
  EXPECT_TRUE(reps[1]["alive"].get<bool>()) << reps;
  EXPECT_EQ(reps[1]["node"].get<std::string>(), heir.endpoint()) << reps;
  EXPECT_EQ(reps[1]["rejoins"].get<int64_t>(), 1) << reps;
  EXPECT_EQ(reps[1]["bytes_resynced"].get<uint64_t>(), 2u << 20) << reps;
  EXPECT_GT(reps[1]["bytes_read"].get<uint64_t>(), 0u) << "never read after a died: " << reps;
  bool rejoined = false;
  for (const auto& e : node["rejoin_events"])
    rejoined |= e["rejoined"].get<bool>() && e["node"] == heir.endpoint();
  EXPECT_TRUE(rejoined) << node["rejoin_events"];
}

// The default, --lost-tier recompute: the only node is SIGKILLed once the engine has written KV
// into it. The tier is abandoned, every request is recomputed from its prompt and the tokens it
// had, and under dense attention (remote layers staged a ring at a time) each still gets exactly
// its all-device text. No start-up probe, so the kill cannot land in it.
TEST(KvNodeProcess, LosingTheOnlyNodeMidRunRecomputesTheAllDeviceText) {
  NodeProcess node;
  ASSERT_NE(node.port(), 0);
  const std::string dense = model_args(400) + " --sparse dense";
  auto [base_code, base_out] = Generate(dense).finish();
  ASSERT_EQ(base_code, 0) << base_out;
  const std::string expect = parse_json_tail(base_out).value("text", "");
  Generate gen(dense + " --batch 3 --no-probe --device-kv 600KiB --host-kv 512KiB --kv-node 2MiB@" + node.endpoint());
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (node.stat("bytes_scattered") <= 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  const bool written = node.stat("bytes_scattered") > 0;
  node.kill_now();
  auto [code, out] = gen.finish();
  ASSERT_TRUE(written) << "no KV reached the node: " << out;
  ASSERT_EQ(code, 0) << out;
  const auto j = parse_json_tail(out);
  EXPECT_EQ(j["text"].get<std::string>(), expect);
  EXPECT_EQ(j["lost_tiers"].get<int64_t>(), 1) << "the node died after the run: " << j["tiering"]["kv_nodes"];
  EXPECT_GE(j["lost_tier_recomputes"].get<int64_t>(), 1);
  EXPECT_EQ(j["refused"].get<int64_t>(), 0);
  EXPECT_EQ(j["generated_tokens"].get<int64_t>(), 3 * parse_json_tail(base_out)["generated_tokens"].get<int64_t>());
  for (int h : j["tiering"]["layer_homes"]) EXPECT_NE(h, 2) << "a layer is still on the lost tier";
  EXPECT_FALSE(j["tiering"]["kv_nodes"][0]["replicas"][0]["alive"].get<bool>());
}

// With --lost-tier fail, losing the only node is a clear error naming it, never a hang.
TEST(KvNodeProcess, LosingTheOnlyNodeIsAClearErrorNotAHang) {
  NodeProcess node;
  ASSERT_NE(node.port(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  Generate gen(model_args(250) + kTiers + " --lost-tier fail --kv-node 1MiB@" + node.endpoint());
  const auto deadline = t0 + 30s;
  while (node.regions() < 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  node.kill_now();
  auto [code, out] = gen.finish();
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(out.find("Unavailable"), std::string::npos) << out;
  EXPECT_NE(out.find(node.endpoint()), std::string::npos) << out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 60s);
}

TEST(KvNodeProcess, ANodeOutlivesClientsKilledMidRun) {
  NodeProcess node("64MiB");
  ASSERT_NE(node.port(), 0);
  for (const char* mode : {"gather"}) {
    // SIGKILL of the engine while it streams rows from the node. A fast machine may finish the
    // run before the kill lands (pkill then finds no process): up to 5 tries, one must be killed.
    int killed = 0;
    for (int attempt = 0; attempt < 5 && killed == 0; ++attempt) {
      Generate gen(model_args(400) + " --device-kv 200KiB --host-kv 256KiB --kv-node-mode " +
                   std::string(mode) + " --kv-node 2MiB@" + node.endpoint() + " --kv-node-timeout-ms 4321");
      (void)gen;
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      while (node.regions() < 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(std::chrono::milliseconds(100 >> attempt));
      // The odd timeout marks this test's engine, so that no other test's process is hit ([4]:
      // not this shell's own command line).
      killed += std::system("pkill -9 -f 'kv-node-timeout-ms [4]321' >/dev/null 2>&1") == 0;
      (void)gen.finish();
      for (int i = 0; i < 200 && node.regions() != 0; ++i) std::this_thread::sleep_for(10ms);
      EXPECT_EQ(node.regions(), 0) << mode << ": the client's region was not freed";
    }
    EXPECT_EQ(killed, 1) << mode << ": no run was still going when it was killed";
  }
  // Still serving.
  auto [code, out] = Generate(model_args(40) + kTiers + " --kv-node 1MiB@" + node.endpoint()).finish();
  EXPECT_EQ(code, 0) << out;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A secret (or keys) file as the node and the engine accept it: `text` and a newline, mode 0600.
// `specontext CMD --help`'s long options that take a value: name -> its help line.
std::map<std::string, std::string> options_with_values(const std::string& command) {
  const std::string cmd = std::string(SPECONTEXT_BIN) + " " + command + " --help 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  if (p != nullptr) {
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    pclose(p);
  }
  // "  -n,--max-tokens INT:POSITIVE ...", "  --secret-file TEXT   file ...", "  --json   emit ...":
  // a value's type is a word in capitals (TEXT, INT:POSITIVE, FLOAT) right after the names.
  static const std::regex option(R"(^  (?:-\w,)?(--[A-Za-z0-9-]+)(?: ([A-Z][A-Z:_]*)\b)?)");
  std::map<std::string, std::string> found;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_search(line, m, option) && m[2].matched) found[m[1]] = line;
  }
  return found;
}

// Issue 26, item 4: a secret comes from a file or the environment, never the command line, where
// every user of the machine reads it (ps, /proc/PID/cmdline). kv-node, serve and generate offer
// no option that takes a secret itself (a name with secret, password, token, key or credential in
// it ends in -file; --tls-key is the PEM file's path; serve's and router's vLLM-style --api-key
// KEY is refused, hidden from --help: ServeProcess.BadFlagsAreClearErrors); and a
// node guarded by --secret-file or --keys-file has none of the secret's bytes in its command line
// (read back from /proc, where the file's path is).
TEST(KvNodeProcess, SecretsNeverTravelOnTheCommandLine) {
  // The options that take a path, not a secret, though named for one.
  const std::set<std::string> paths = {"--tls-key"};
  const std::set<std::string> secret_words = {"secret", "secrets", "password", "passwd", "token",
                                              "key",    "keys",    "credential", "credentials"};
  std::set<std::string> seen;
  for (const char* command : {"kv-node", "serve", "router", "generate"}) {
    SCOPED_TRACE(command);
    const auto options = options_with_values(command);
    ASSERT_GT(options.size(), 3u) << "no options parsed from " << command << " --help";
    for (const auto& [name, line] : options) {
      std::vector<std::string> words;
      std::istringstream parts(name.substr(2));
      for (std::string w; std::getline(parts, w, '-');) words.push_back(w);
      const bool names_a_secret =
          std::any_of(words.begin(), words.end(), [&](const std::string& w) { return secret_words.contains(w); });
      if (!names_a_secret) continue;
      seen.insert(name);
      if (name.ends_with("-file") || paths.contains(name)) continue;
      ADD_FAILURE() << command << " " << name << " takes a secret on the command line: " << line;
    }
  }
  // The parse found the options it should (else the loop above checked nothing).
  for (const char* expected : {"--secret-file", "--keys-file", "--kv-secret-file", "--tls-key", "--api-key-file"})
    EXPECT_TRUE(seen.contains(expected)) << expected;

  const std::string dir = ::testing::TempDir();
  const std::string secret = "cmdline-test-secret-7f3a91c2d4e5b6a8";
  const std::string secret_path = dir + "/kv_node_cmdline_secret";
  const std::string keys_path = dir + "/kv_node_cmdline_keys";
  const std::string client_secret = "cmdline-client-secret-0b1c2d3e4f5a6978";
  ASSERT_TRUE(write_owner_only(secret_path, secret));
  ASSERT_TRUE(write_owner_only(keys_path, "alice " + client_secret + " 1MiB"));
  auto cmdline_of = [](pid_t pid) {
    std::string c = slurp("/proc/" + std::to_string(pid) + "/cmdline");
    std::replace(c.begin(), c.end(), '\0', ' ');
    return c;
  };
  {
    NodeProcess node("1MiB", "127.0.0.1:0", {"--secret-file", secret_path});
    ASSERT_NE(node.port(), 0);
    ASSERT_TRUE(KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, 2s, secret).is_ok())
        << "the node serves with the file's secret";
    const std::string cmdline = cmdline_of(node.pid());
    EXPECT_NE(cmdline.find(secret_path), std::string::npos) << "cmdline not read: " << cmdline;
    EXPECT_EQ(cmdline.find(secret), std::string::npos) << cmdline;
  }
  {
    NodeProcess node("1MiB", "127.0.0.1:0", {"--keys-file", keys_path});
    ASSERT_NE(node.port(), 0);
    ASSERT_TRUE(KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, 2s, KvNodeAccess{client_secret, "alice", nullptr}).is_ok());
    const std::string cmdline = cmdline_of(node.pid());
    EXPECT_NE(cmdline.find(keys_path), std::string::npos) << "cmdline not read: " << cmdline;
    EXPECT_EQ(cmdline.find(client_secret), std::string::npos) << cmdline;
  }
  std::filesystem::remove(secret_path);
  std::filesystem::remove(keys_path);
}

// Issue 26, item 4. Without a secret the node says so on stderr and will not listen beyond
// loopback.
TEST(KvNodeProcess, WithoutASecretTheNodeWarnsAndRefusesANonLoopbackListen) {
  const std::string cmd = std::string("env -u SPECONTEXT_KV_SECRET ") + SPECONTEXT_BIN +
                          " kv-node --capacity 1MiB --listen 0.0.0.0:0 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 512> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 1) << out;
  EXPECT_NE(out.find("WARNING: no secret"), std::string::npos) << out;
  EXPECT_NE(out.find("refusing to listen on 0.0.0.0 without a secret"), std::string::npos) << out;
  EXPECT_EQ(out.find(R"("event":"listening")"), std::string::npos) << out;
}

// With --secret-file: a client with the secret is served, one without or with another is refused;
// the failures are counted in the stop line and logged to stderr with the peer's address; and
// `generate --kv-node` reads the same file (--kv-secret-file) or SPECONTEXT_KV_SECRET.
TEST(KvNodeProcess, ASecretFileGuardsTheNodeAndTheEngineAnswersWithIt) {
  const std::string dir = ::testing::TempDir();
  const std::string secret_path = dir + "/kv_node_process_secret";
  const std::string err_path = dir + "/kv_node_process_stderr";
  const std::string secret = "process test secret 0123456789abcdef";
  ASSERT_TRUE(write_owner_only(secret_path, secret));
  NodeProcess node("16MiB", "127.0.0.1:0", {"--secret-file", secret_path}, err_path);
  ASSERT_NE(node.port(), 0);
  const Endpoint ep{"127.0.0.1", node.port()};
  auto none = KvNodeClient::connect(ep, 2s);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("requires authentication"), std::string::npos)
      << none.status().to_string();
  auto wrong = KvNodeClient::connect(ep, 2s, "not the secret, though long enough");
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.status().message().find("authentication failed"), std::string::npos)
      << wrong.status().to_string();
  auto right = KvNodeClient::connect(ep, 2s, secret);
  ASSERT_TRUE(right.is_ok()) << right.status().to_string();
  EXPECT_TRUE((*right)->allocate(4096).is_ok());
  right->reset();

  auto [refused, refused_out] = Generate("-m " + repo_path("models/stories260K/stories260K.bin") +
                                         " -p 'Once' -n 4 " + kTiers + " --kv-node 1MiB@" + node.endpoint())
                                    .finish();
  EXPECT_NE(refused, 0) << refused_out;
  EXPECT_NE(refused_out.find("requires authentication"), std::string::npos) << refused_out;
  const std::string expect = baseline_text(40);
  auto [code, out] = Generate(model_args(40) + kTiers + " --kv-secret-file " + secret_path +
                              " --kv-node 1MiB@" + node.endpoint())
                         .finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(parse_json_tail(out)["text"].get<std::string>(), expect);

  const auto j = node.stop();
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["auth_failures"].get<int64_t>(), 1) << j;  // the wrong secret (no secret sends no answer)
  const std::string err = slurp(err_path);
  EXPECT_NE(err.find("authentication failed from 127.0.0.1:"), std::string::npos) << err;
  EXPECT_EQ(err.find(secret), std::string::npos) << "the secret reached the log: " << err;
  std::filesystem::remove(secret_path);
  std::filesystem::remove(err_path);
}

// `kv-node --tls-cert/--tls-key` with a secret: `generate --kv-node-tls-ca CA --kv-secret-file` runs
// on it with the all-device text; without the CA the engine's error says the node speaks TLS only;
// the node's listening line says tls, its stop line counts the refused plain connection.
TEST(KvNodeProcess, GenerateReachesATlsNodeThroughItsCa) {
  testing::TlsDir pki;
  const auto ca = pki.make_ca("ca");
  const auto leaf = pki.make_leaf(ca, "node", "IP:127.0.0.1");
  const std::string secret_path = pki.path("secret");
  ASSERT_TRUE(write_owner_only(secret_path, "process tls secret 0123456789abcdef"));
  NodeProcess node("16MiB", "127.0.0.1:0",
                   {"--secret-file", secret_path, "--tls-cert", leaf.cert_file, "--tls-key", leaf.key_file},
                   pki.path("stderr"));
  ASSERT_NE(node.port(), 0);
  auto [plain, plain_out] = Generate(model_args(8) + kTiers + " --kv-secret-file " + secret_path +
                                     " --kv-node 1MiB@" + node.endpoint())
                                .finish();
  EXPECT_NE(plain, 0) << plain_out;
  EXPECT_NE(plain_out.find("speaks TLS only"), std::string::npos) << plain_out;
  const std::string expect = baseline_text(40);
  auto [code, out] = Generate(model_args(40) + kTiers + " --kv-secret-file " + secret_path +
                              " --kv-node-tls-ca " + ca.cert_file + " --kv-node 1MiB@" + node.endpoint())
                         .finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(parse_json_tail(out)["text"].get<std::string>(), expect);
  const auto j = node.stop();
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["tls_failures"].get<int64_t>(), 1) << j;
  EXPECT_EQ(j["auth_failures"].get<int64_t>(), 0) << j;
  const std::string err = slurp(pki.path("stderr"));
  EXPECT_NE(err.find("plain TCP, but this node speaks TLS only"), std::string::npos) << err;
}

// `kv-node --keys-file`: `generate --kv-client-id alice --kv-secret-file` (alice's own secret) runs
// with the all-device text; the same secret under another ID is refused and counted; a quota too
// small for the tier is the engine's error naming the client.
TEST(KvNodeProcess, GenerateAuthenticatesAsAClientOfTheKeysFile) {
  const std::string dir = ::testing::TempDir();
  const std::string keys = dir + "/kv_node_process_keys";
  const std::string alice_secret = dir + "/kv_node_process_alice";
  const std::string tiny_secret = dir + "/kv_node_process_tiny";
  ASSERT_TRUE(write_owner_only(keys, "alice alice-process-secret-0123456789 4MiB 4\n"
                                     "tiny tiny-process-secret-0123456789ab 64KiB"));
  ASSERT_TRUE(write_owner_only(alice_secret, "alice-process-secret-0123456789"));
  ASSERT_TRUE(write_owner_only(tiny_secret, "tiny-process-secret-0123456789ab"));
  NodeProcess node("16MiB", "127.0.0.1:0", {"--keys-file", keys});
  ASSERT_NE(node.port(), 0);
  const std::string expect = baseline_text(40);
  auto [code, out] = Generate(model_args(40) + kTiers + " --kv-client-id alice --kv-secret-file " + alice_secret +
                              " --kv-node 1MiB@" + node.endpoint())
                         .finish();
  ASSERT_EQ(code, 0) << out;
  EXPECT_EQ(parse_json_tail(out)["text"].get<std::string>(), expect);
  auto [wrong, wrong_out] = Generate(model_args(8) + kTiers + " --kv-client-id tiny --kv-secret-file " +
                                     alice_secret + " --kv-node 1MiB@" + node.endpoint())
                                .finish();
  EXPECT_NE(wrong, 0) << wrong_out;
  EXPECT_NE(wrong_out.find("authentication failed"), std::string::npos) << wrong_out;
  auto [small, small_out] = Generate(model_args(8) + kTiers + " --kv-client-id tiny --kv-secret-file " +
                                     tiny_secret + " --kv-node 1MiB@" + node.endpoint())
                                .finish();
  EXPECT_NE(small, 0) << small_out;
  EXPECT_NE(small_out.find("client 'tiny''s quota"), std::string::npos) << small_out;
  const auto j = node.stop();
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["auth_failures"].get<int64_t>(), 1) << j;
  for (const std::string& f : {keys, alice_secret, tiny_secret}) std::filesystem::remove(f);
}

TEST(KvNodeProcess, SigtermStopsTheNodeCleanly) {
  NodeProcess node("1MiB");
  ASSERT_NE(node.port(), 0);
  {
    auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, 2s);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    EXPECT_FALSE((*c)->call_line("{").is_ok());
  }
  const auto j = node.stop();
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["event"], "stopped");
  EXPECT_EQ(j["bad_requests"].get<int64_t>(), 1);
}

// --prefix-offload-remote: the offload store's lower level in a KV node's memory. Requests
// preempted on a pool too small for the batch are swapped out to the node and back, with the text of
// recomputing them; the node's region goes with the client.
TEST(KvNodeProcess, SwappedOutRequestsGoToTheNodeAndComeBack) {
  NodeProcess node("32MiB");
  ASSERT_NE(node.port(), 0);
  const std::string run = "-m " + repo_path("models/stories260K/stories260K.bin") +
                          " -p 'Once upon a time' -n 200 --batch 4 --temperature 0.8 --seed 3 --json"
                          " --device-kv 1MiB --host-kv 2MiB --admission preempt --prefix-caching";
  auto [code, out] = Generate(run + " --preemption-mode recompute").finish();
  ASSERT_EQ(code, 0) << out;
  const std::string expect = parse_json_tail(out).value("text", "");
  ASSERT_FALSE(expect.empty());
  for (const char* mode : {"gather"}) {
    SCOPED_TRACE(mode);
    auto [c, o] =
        Generate(run + " --prefix-offload-remote 8MiB@" + node.endpoint() + " --kv-node-mode " + mode)
            .finish();
    ASSERT_EQ(c, 0) << o;
    const auto j = parse_json_tail(o);
    EXPECT_EQ(j["text"].get<std::string>(), expect);
    EXPECT_GE(j["preemptions"].get<int64_t>(), 1) << j.dump();
    EXPECT_EQ(j["preemption_swaps"].get<int64_t>(), j["preemptions"].get<int64_t>()) << j.dump();
    const auto& d = j["prefix_disk"];
    EXPECT_EQ(d["store"].get<std::string>(), "kv-node " + node.endpoint());
    EXPECT_GE(d["writes"].get<int64_t>(), j["preemption_swaps"].get<int64_t>()) << d.dump();
    EXPECT_EQ(d["restores"].get<int64_t>(), j["preemption_swaps"].get<int64_t>()) << d.dump();
    EXPECT_EQ(d["errors"].get<int64_t>(), 0) << d.dump();
  }
  EXPECT_EQ(node.regions(), 0) << "the clients' regions were freed";
}

// `serve --prefix-offload-remote` on a mirrored pair: prefixes evicted from the cache go to the
// nodes. SIGKILL of one node: the answers stay those given before, stderr names the dead node and
// where the level goes on, /metrics counts it; SIGKILL of the other: the level is lost (stderr
// names both nodes), prompts are computed, the answers stay the same. Polled with generous bounds.
namespace http = boost::beast::http;

std::string http_call(uint16_t port, http::verb verb, const std::string& target, const std::string& body) {
  return specontext::testing::http_call(port, verb, target, body).second;
}

// A /metrics value; -1 when the metric is not there.
int64_t metric(uint16_t port, const std::string& name) {
  const std::string m = http_call(port, http::verb::get, "/metrics", "");
  const size_t at = m.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stoll(m.substr(at + name.size() + 2));
}

TEST(KvNodeProcess, ServeNamesTheDeadNodesOfItsRemotePrefixLevelAndCountsThem) {
  NodeProcess a("16MiB"), b("16MiB");
  ASSERT_NE(a.port(), 0);
  ASSERT_NE(b.port(), 0);
  specontext::testing::ServeProcess server(
      {"-m", repo_path("models/stories260K/stories260K.bin"), "--listen", "127.0.0.1:0", "--sparse", "dense",
       "--max-batch", "1", "--prefix-cache-slots", "1", "--kv-node-timeout-ms", "4000",
       "--prefix-offload-remote", "8MiB@" + a.endpoint() + "+" + b.endpoint()});
  ASSERT_NE(server.port(), 0) << server.first_line();
  const uint16_t port = server.port();
  const std::vector<std::string> prompts = {"Once upon a time there was a cat", "Once upon a time there was a dog",
                                            "Once upon a time there was a boy", "Once upon a time there was a girl"};
  auto ask = [&](const std::string& prompt) {
    const nlohmann::json body = {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}};
    const auto j = nlohmann::json::parse(http_call(port, http::verb::post, "/v1/completions", body.dump()),
                                         nullptr, false);
    const bool ok = j.is_object() && j.contains("choices") && !j["choices"].empty();
    EXPECT_TRUE(ok) << j.dump();
    return ok ? j["choices"][0].value("text", std::string()) : std::string();
  };
  std::vector<std::string> answers;
  for (const std::string& p : prompts) answers.push_back(ask(p));
  for (int round = 0; round < 8 && metric(port, "specontext_prefix_disk_writes_total") < 1; ++round) {
    ask(prompts[round % prompts.size()]);
  }
  ASSERT_GE(metric(port, "specontext_prefix_disk_writes_total"), 1) << "no prefix reached the nodes";
  ASSERT_EQ(metric(port, "specontext_prefix_remote_replicas_live"), 2);
  ASSERT_EQ(metric(port, "specontext_prefix_remote_replica_deaths_total"), 0);

  // Requests until a transfer finds the dead node (writes go to both, reads to one): the answers
  // stay those of before. The deadline is a safety net, not a timing assertion.
  auto ask_until_deaths = [&](int64_t deaths) {
    const auto deadline = std::chrono::steady_clock::now() + 300s;
    for (size_t i = 0; metric(port, "specontext_prefix_remote_replica_deaths_total") < deaths &&
                       std::chrono::steady_clock::now() < deadline;
         ++i) {
      const size_t k = i % prompts.size();
      EXPECT_EQ(ask(prompts[k]), answers[k]) << prompts[k];
      // A new prompt too, so that an eviction writes to the nodes.
      ask(prompts[k] + " number " + std::to_string(deaths * 1000 + static_cast<int64_t>(i)));
    }
    for (size_t k = 0; k < prompts.size(); ++k) EXPECT_EQ(ask(prompts[k]), answers[k]) << prompts[k];
  };
  a.kill_now();
  ask_until_deaths(1);
  EXPECT_EQ(metric(port, "specontext_prefix_remote_replica_deaths_total"), 1);
  EXPECT_EQ(metric(port, "specontext_prefix_remote_replicas_live"), 1);
  b.kill_now();
  ask_until_deaths(2);
  EXPECT_EQ(metric(port, "specontext_prefix_remote_replica_deaths_total"), 2);
  EXPECT_EQ(metric(port, "specontext_prefix_remote_replicas_live"), 0);

  const auto e = server.wait(SIGTERM);
  EXPECT_EQ(e.code, 0) << e.err;
  const std::string level = "kv-node: tier prefix offload (--prefix-offload-remote)";
  EXPECT_NE(e.err.find(level + ": replica 0 on " + a.endpoint() + " is dead ("), std::string::npos) << e.err;
  EXPECT_NE(e.err.find("reads fail over, the tier goes on on " + b.endpoint()), std::string::npos) << e.err;
  const size_t lost = e.err.find(level + " lost: no replica alive (" + a.endpoint() + ": ");
  ASSERT_NE(lost, std::string::npos) << e.err;
  const std::string lost_line = e.err.substr(lost, e.err.find('\n', lost) - lost);
  EXPECT_NE(lost_line.find("; " + b.endpoint() + ": "), std::string::npos) << lost_line;
  EXPECT_NE(lost_line.find("their prompts computed"), std::string::npos) << lost_line;
  // One line per event, not one per transfer that meets the dead nodes.
  const auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = e.err.find(what); at != std::string::npos; at = e.err.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(level + ": replica "), 1u) << e.err;
  EXPECT_EQ(count(level + " lost: "), 1u) << e.err;
}

TEST(KvNodeProcess, BadSpecsAndUnreachableNodesAreNamed) {
  NodeProcess node("1MiB");
  ASSERT_NE(node.port(), 0);
  const std::string base = model_args(8) + kTiers;
  const std::pair<std::string, std::string> cases[] = {
      {" --kv-node 1MiB", "expected SIZE@HOST:PORT"},
      {" --kv-node lots@" + node.endpoint(), "--kv-node lots@"},
      {" --kv-node 1MiB@127.0.0.1", "expected HOST:PORT"},
      {" --kv-node 1MiB@127.0.0.1:1", "127.0.0.1:1"},
      {" --kv-node 64MiB@" + node.endpoint(), "ResourceExhausted"},
      {" --kv-node 1MiB@" + node.endpoint() + " --remote-kv 1MiB", "cannot be combined"},
      {" --kv-node 1MiB@" + node.endpoint() + " --kv-node-spare " + node.endpoint(),
       "spares serve mirrored tiers"},
      {" --kv-node 256KiB@" + node.endpoint() + "+" + node.endpoint() + " --kv-node-spare nowhere",
       "--kv-node-spare nowhere"},
      {" --prefix-caching --prefix-offload-remote 1MiB",
       "--prefix-offload-remote 1MiB: expected SIZE@HOST:PORT"},
      {" --prefix-caching --prefix-offload-remote 1MiB@127.0.0.1:1", "127.0.0.1:1"},
      {" --prefix-caching --prefix-offload-remote 64MiB@" + node.endpoint(), "ResourceExhausted"},
      {" --prefix-offload-remote 1MiB@" + node.endpoint(), "--prefix-offload-remote needs --prefix-caching"},
      {" --prefix-caching --prefix-offload-disk 1MiB --prefix-offload-remote 1MiB@" + node.endpoint(),
       "cannot be combined"},
      // UCX over TCP checks no remote key: one-sided RMA would reach every client's KV.
      {" --kv-node 1MiB@" + node.endpoint() + " --kv-node-mode rma",
       "one-sided RMA (--kv-node-mode rma) is refused: this client's UCX transports (tcp) do not check "
       "remote keys"},
      {" --prefix-caching --prefix-offload-remote 1MiB@" + node.endpoint() + " --kv-node-mode rma",
       "one-sided RMA (--kv-node-mode rma) is refused"},
  };
  for (const auto& [extra, expect] : cases) {
    auto [code, out] = Generate(base + extra + " --kv-node-timeout-ms 2000").finish();
    EXPECT_NE(code, 0) << extra;
    EXPECT_NE(out.find(expect), std::string::npos) << extra << " -> " << out;
  }
}

}  // namespace
}  // namespace specontext::cluster
