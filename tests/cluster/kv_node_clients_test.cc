// Per-client identities on a KV node (issue 26, item 4's "per-client quotas"): a keys file maps
// client ID -> secret -> quota (and connection limit), read under the secret file's rules; a client
// names its ID in the hello and answers with its own secret, bound to the ID. Quotas and usage are
// per client across all its connections (opening more connections gains nothing); a client sees
// only its own usage in stats and cannot free or reach another's regions; an unknown ID and a
// wrong secret look alike to the client and are counted, logged apart and closed; a client at its
// own connection limit is refused; the shared secret keeps working as one client.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cluster/kv_node.h"
#include "cluster/kv_node_auth.h"
#include "cluster/kv_node_client.h"
#include "tests/transport/transport_test_util.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {
namespace {

using namespace std::chrono_literals;
using transport::RemoteRegion;
using transport::UcxRemoteTransport;
using transport::UcxTransferMode;
using transport_conformance::run_batch;

constexpr TierId kLocal{1};
constexpr TierId kRemote{2};

const std::string kAlice = "alice-secret-0123456789abcdef";
const std::string kBob = "bob-secret-0123456789abcdefgh";
const std::string kShared = "the shared secret 0123456789";

struct LogSink {
  std::mutex mu;
  std::string text;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& line) {
      std::lock_guard lock(mu);
      text += line + "\n";
    };
  }
  std::string all() {
    std::lock_guard lock(mu);
    return text;
  }
};

std::vector<KvClientKey> two_clients() {
  return {{"alice", kAlice, 64 << 10, 2}, {"bob", kBob, 1 << 20, 0}};
}

std::unique_ptr<KvNode> start(std::vector<KvClientKey> keys, const std::string& shared = "", LogSink* log = nullptr) {
  KvNodeOptions o;
  o.capacity = 4 << 20;
  o.clients = std::move(keys);
  o.secret = shared;
  o.log = log != nullptr ? log->fn() : [](const std::string&) {};
  auto n = KvNode::start(std::move(o));
  EXPECT_TRUE(n.is_ok()) << n.status().to_string();
  return n.is_ok() ? std::move(n).value() : nullptr;
}

Result<std::unique_ptr<KvNodeClient>> as(const KvNode& node, const std::string& id, const std::string& secret) {
  KvNodeAccess a;
  a.client_id = id;
  a.secret = secret;
  return KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, 10s, a);
}

bool has(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

// ---- the keys file ----

class KeysFile {
 public:
  KeysFile(const std::string& content, mode_t mode) {
    static int counter = 0;
    path_ = (std::filesystem::temp_directory_path() /
             ("kv_keys_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
                .string();
    std::ofstream(path_) << content;
    ::chmod(path_.c_str(), mode);
  }
  ~KeysFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(KvNodeClients, AKeysFileIsReadLineByLine) {
  const std::string text =
      "# id secret quota [max connections]\n"
      "alice " + kAlice + " 64KiB 2\n"
      "\n"
      "  bob\t" + kBob + "  1073741824   # a comment\r\n"
      "carol carol-secret-0123456789abc 0\n";
  auto keys = parse_kv_keys(text, "keys");
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  ASSERT_EQ(keys->size(), 3u);
  EXPECT_EQ((*keys)[0].id, "alice");
  EXPECT_EQ((*keys)[0].secret, kAlice);
  EXPECT_EQ((*keys)[0].quota, 64u << 10);
  EXPECT_EQ((*keys)[0].max_connections, 2);
  EXPECT_EQ((*keys)[1].id, "bob");
  EXPECT_EQ((*keys)[1].quota, 1u << 30);
  EXPECT_EQ((*keys)[1].max_connections, 0);
  EXPECT_EQ((*keys)[2].quota, 0u);
}

TEST(KvNodeClients, ABadKeysFileIsAnErrorNamingTheLineNeverTheSecret) {
  const std::pair<std::string, std::string> bad[] = {
      {"alice " + kAlice + "\n", "line 1: expected ID SECRET QUOTA"},
      {"al/ice " + kAlice + " 1\n", "line 1: the client ID"},
      {std::string(65, 'a') + " " + kAlice + " 1\n", "line 1: the client ID"},
      {"# c\nalice short 1\n", "line 2: client alice's secret must hold at least 16"},
      {"alice " + kAlice + " 1PiB\n", "line 1: client alice's quota"},
      {"alice " + kAlice + " 99999999999999999999\n", "line 1: client alice's quota"},
      {"alice " + kAlice + " 18014398509481984KiB\n", "line 1: client alice's quota"},
      {"alice " + kAlice + " 1 -3\n", "MAX_CONNECTIONS"},
      {"alice " + kAlice + " 1\nalice " + kBob + " 1\n", "line 2: client alice is listed twice"},
  };
  for (const auto& [text, want] : bad) {
    auto keys = parse_kv_keys(text, "keys");
    ASSERT_FALSE(keys.is_ok()) << text;
    EXPECT_TRUE(has(keys.status(), want)) << keys.status().to_string();
    EXPECT_FALSE(has(keys.status(), kAlice)) << keys.status().to_string();
    EXPECT_FALSE(has(keys.status(), kBob)) << keys.status().to_string();
  }
}

TEST(KvNodeClients, TheKeysFileMustBeOwnerReadableOnlyAndComesFromTheFlagOrTheEnvironment) {
  const std::string text = "alice " + kAlice + " 1MiB\n";
  KeysFile open_file(text, 0644);
  auto refused = load_kv_keys(open_file.path());
  ASSERT_FALSE(refused.is_ok());
  EXPECT_TRUE(has(refused.status(), "readable by group or others")) << refused.status().to_string();
  KeysFile good(text, 0600);
  auto keys = load_kv_keys(good.path());
  ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
  EXPECT_EQ(keys->size(), 1u);
  KeysFile empty("# nobody\n", 0600);
  EXPECT_FALSE(load_kv_keys(empty.path()).is_ok());
  ::unsetenv(kKeysFileEnv);
  auto none = load_kv_keys("");
  ASSERT_TRUE(none.is_ok());
  EXPECT_TRUE(none->empty());
  ::setenv(kKeysFileEnv, good.path().c_str(), 1);
  auto from_env = load_kv_keys("");
  ::unsetenv(kKeysFileEnv);
  ASSERT_TRUE(from_env.is_ok()) << from_env.status().to_string();
  EXPECT_EQ(from_env->size(), 1u);
  // The client's ID: the flag, else the environment, validated.
  EXPECT_FALSE(load_kv_client_id("no spaces").is_ok());
  ::setenv(kClientIdEnv, "bob", 1);
  auto id = load_kv_client_id("");
  ::unsetenv(kClientIdEnv);
  ASSERT_TRUE(id.is_ok());
  EXPECT_EQ(*id, "bob");
}

TEST(KvNodeClients, AHelloNamesAValidClientId) {
  auto ok = parse_control_request(R"({"op":"hello","version":5,"client":"alice"})");
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(ok->client, "alice");
  EXPECT_EQ(parse_control_request(control_request_line(*ok))->client, "alice");
  for (const char* bad : {R"({"op":"hello","client":""})", R"({"op":"hello","client":7})",
                          R"({"op":"hello","client":"a b"})", R"({"op":"hello","client":"a\n"})"}) {
    auto r = parse_control_request(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_TRUE(has(r.status(), "field 'client'")) << r.status().to_string();
  }
  // Bound to the ID: alice's answer is not bob's, and the shared secret's answer is unchanged.
  AuthNonce n{};
  ASSERT_TRUE(fill_random(n).is_ok());
  EXPECT_NE(auth_response(kAlice, n, "node", "alice"), auth_response(kAlice, n, "node", "bob"));
  EXPECT_NE(auth_response(kAlice, n, "node", "alice"), auth_response(kAlice, n, "node"));
  EXPECT_EQ(auth_response(kAlice, n, "node", ""), auth_response(kAlice, n, "node"));
}

// ---- the node ----

TEST(KvNodeClients, AQuotaHoldsAcrossAllOfAClientsConnections) {
  auto node = start(two_clients());
  ASSERT_NE(node, nullptr);
  auto a1 = as(*node, "alice", kAlice);
  auto a2 = as(*node, "alice", kAlice);
  ASSERT_TRUE(a1.is_ok() && a2.is_ok()) << a1.status().to_string() << a2.status().to_string();
  EXPECT_EQ((*a1)->hello().quota, 64u << 10);
  auto first = (*a1)->allocate(48 << 10);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  // A second connection gains nothing: the 16 KiB left is all alice has.
  auto over = (*a2)->allocate(32 << 10);
  ASSERT_FALSE(over.is_ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().to_string();
  EXPECT_TRUE(has(over.status(), "client 'alice''s quota (65536 bytes, 49152 held by its 2 connection(s)"))
      << over.status().to_string();
  EXPECT_EQ(node->stats().quota_refusals, 1);
  EXPECT_TRUE((*a2)->allocate(16 << 10).is_ok());
  EXPECT_FALSE((*a2)->allocate(4096).is_ok());
  // Bob's quota is his own.
  auto b = as(*node, "bob", kBob);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_TRUE((*b)->allocate(512 << 10).is_ok());
  // Freed on one connection, usable on the other; a closed connection gives its bytes back.
  ASSERT_TRUE((*a1)->free(first->region).is_ok());
  EXPECT_TRUE((*a2)->allocate(48 << 10).is_ok());
  a2->reset();
  auto again = as(*node, "alice", kAlice);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  for (int i = 0; i < 2000; ++i) {  // the node closes a2 on its own thread
    auto st = (*again)->call_line(R"({"op":"stats"})");
    ASSERT_TRUE(st.is_ok());
    if ((*st)["used"].get<uint64_t>() == 0) break;
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE((*again)->allocate(64 << 10).is_ok());
}

TEST(KvNodeClients, AClientSeesOnlyItsOwnUsageAndCannotTouchAnothersRegions) {
  auto node = start(two_clients(), kShared);
  ASSERT_NE(node, nullptr);
  auto a = as(*node, "alice", kAlice);
  auto b = as(*node, "bob", kBob);
  ASSERT_TRUE(a.is_ok() && b.is_ok()) << a.status().to_string() << b.status().to_string();
  auto alices = (*a)->allocate(32 << 10);
  auto bobs = (*b)->allocate(256 << 10);
  ASSERT_TRUE(alices.is_ok() && bobs.is_ok());
  auto st = (*a)->call_line(R"({"op":"stats"})");
  ASSERT_TRUE(st.is_ok()) << st.status().to_string();
  EXPECT_EQ((*st)["client"], "alice");
  EXPECT_EQ((*st)["used"].get<uint64_t>(), 32u << 10);
  EXPECT_EQ((*st)["regions"].get<int64_t>(), 1);
  EXPECT_EQ((*st)["connections"].get<int64_t>(), 1);
  EXPECT_EQ((*st)["quota"].get<uint64_t>(), 64u << 10);
  for (const char* node_wide : {"auth_failures", "bytes_gathered", "bytes_scattered", "connections_refused",
                                "idle_closed", "quota_refusals", "tls_failures"}) {
    EXPECT_FALSE(st->contains(node_wide)) << node_wide << " in " << st->dump();
  }
  EXPECT_EQ((*a)->hello().free, 64u << 10);  // at most what the quota leaves, not the node's free
  // The shared secret's client is the operator's: it sees the node.
  auto op = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, 10s, kShared);
  ASSERT_TRUE(op.is_ok()) << op.status().to_string();
  auto all = (*op)->call_line(R"({"op":"stats"})");
  ASSERT_TRUE(all.is_ok());
  EXPECT_EQ((*all)["used"].get<uint64_t>(), (32u << 10) + (256u << 10));
  EXPECT_EQ((*all)["regions"].get<int64_t>(), 2);
  // Bob cannot free alice's region, on the control plane ...
  auto steal = (*b)->free(alices->region);
  ASSERT_FALSE(steal.is_ok());
  EXPECT_EQ(steal.code(), StatusCode::kNotFound) << steal.to_string();
  // ... nor reach it on the data plane with his own region's key.
  RemoteRegion forged = *bobs;
  forged.region = alices->region;
  forged.address = alices->address;
  forged.bytes = alices->bytes;
  auto spy = UcxRemoteTransport::create({kRemote, {forged}, 3000ms, UcxTransferMode::kNodeGather});
  ASSERT_TRUE(spy.is_ok()) << spy.status().to_string();
  std::vector<uint8_t> host(4096, 0x5a);
  ASSERT_TRUE((*spy)->register_tier(kLocal, MemoryKind::kHost, host.data(), host.size()).is_ok());
  ASSERT_TRUE((*spy)->register_tier(kRemote, MemoryKind::kRemote, nullptr, forged.bytes).is_ok());
  for (const TransferRequest& r : {TransferRequest{kRemote, 0, kLocal, 0, 4096}, TransferRequest{kLocal, 0, kRemote, 0, 4096}}) {
    Status s = run_batch(**spy, {r});
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  }
  spy->reset();
  auto still = (*a)->call_line(R"({"op":"stats"})");
  ASSERT_TRUE(still.is_ok());
  EXPECT_EQ((*still)["regions"].get<int64_t>(), 1);
}

TEST(KvNodeClients, AnUnknownIdAndAWrongSecretAreCountedLoggedApartAndClosed) {
  LogSink log;
  auto node = start(two_clients(), "", &log);
  ASSERT_NE(node, nullptr);
  auto unknown = as(*node, "mallory", kAlice);
  auto wrong = as(*node, "alice", kBob);
  auto swapped = as(*node, "bob", kAlice);  // alice's secret under bob's name
  for (auto* r : {&unknown, &wrong, &swapped}) {
    ASSERT_FALSE(r->is_ok());
    EXPECT_EQ(r->status().code(), StatusCode::kInvalidArgument) << r->status().to_string();
    EXPECT_TRUE(has(r->status(), "authentication failed: wrong answer to the challenge as client '"))
        << r->status().to_string();
  }
  auto no_id = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, 10s, kAlice);
  ASSERT_FALSE(no_id.is_ok());
  EXPECT_TRUE(has(no_id.status(), "knows its clients by ID")) << no_id.status().to_string();
  EXPECT_EQ(node->stats().auth_failures, 4);
  EXPECT_EQ(node->stats().regions, 0);
  const std::string text = log.all();
  EXPECT_NE(text.find("unknown client 'mallory'"), std::string::npos) << text;
  EXPECT_NE(text.find("wrong answer to the challenge as client 'alice'"), std::string::npos) << text;
  EXPECT_EQ(text.find(kAlice), std::string::npos) << "a secret reached the log: " << text;
  EXPECT_EQ(text.find(kBob), std::string::npos) << "a secret reached the log: " << text;
  // The right ones are served.
  EXPECT_TRUE(as(*node, "alice", kAlice).is_ok());
  EXPECT_TRUE(as(*node, "bob", kBob).is_ok());
}

TEST(KvNodeClients, AClientAtItsConnectionLimitIsRefusedOthersAreNot) {
  LogSink log;
  auto node = start(two_clients(), "", &log);
  ASSERT_NE(node, nullptr);
  auto a1 = as(*node, "alice", kAlice);
  auto a2 = as(*node, "alice", kAlice);
  ASSERT_TRUE(a1.is_ok() && a2.is_ok());
  auto a3 = as(*node, "alice", kAlice);
  ASSERT_FALSE(a3.is_ok());
  EXPECT_EQ(a3.status().code(), StatusCode::kResourceExhausted) << a3.status().to_string();
  EXPECT_TRUE(has(a3.status(), "client 'alice' is at its connection limit (2)")) << a3.status().to_string();
  EXPECT_EQ(node->stats().connections_refused, 1);
  EXPECT_NE(log.all().find("client 'alice' holds its 2 connections already"), std::string::npos) << log.all();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(as(*node, "bob", kBob).is_ok());
  a1->reset();
  std::unique_ptr<KvNodeClient> a4;
  for (int i = 0; i < 2000 && a4 == nullptr; ++i) {  // the node closes a1 on its own thread
    auto c = as(*node, "alice", kAlice);
    if (c.is_ok()) a4 = std::move(c).value();
    else std::this_thread::sleep_for(5ms);
  }
  EXPECT_NE(a4, nullptr);
}

TEST(KvNodeClients, TheSharedSecretKeepsWorkingAsOneClient) {
  KvNodeOptions o;
  o.capacity = 4 << 20;
  o.secret = kShared;
  o.client_quota = 64 << 10;
  o.clients = two_clients();
  o.log = [](const std::string&) {};
  auto node = KvNode::start(o);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  auto c1 = KvNodeClient::connect(Endpoint{"127.0.0.1", (*node)->port()}, 10s, kShared);
  auto c2 = KvNodeClient::connect(Endpoint{"127.0.0.1", (*node)->port()}, 10s, kShared);
  ASSERT_TRUE(c1.is_ok() && c2.is_ok()) << c1.status().to_string() << c2.status().to_string();
  ASSERT_TRUE((*c1)->allocate(48 << 10).is_ok());
  auto over = (*c2)->allocate(32 << 10);
  ASSERT_FALSE(over.is_ok());
  EXPECT_TRUE(has(over.status(), "this client's quota")) << over.status().to_string();
  EXPECT_TRUE(has(over.status(), "--client-quota")) << over.status().to_string();
  // Its secret is no keyed client's: claiming an ID with it fails.
  EXPECT_FALSE(as(**node, "alice", kShared).is_ok());
  // Keys alone: a node listening beyond loopback is allowed (every client authenticates).
  KvNodeOptions wide;
  wide.capacity = 1 << 20;
  wide.host = "0.0.0.0";
  wide.clients = two_clients();
  wide.log = [](const std::string&) {};
  EXPECT_TRUE(KvNode::start(wide).is_ok());
}

}  // namespace
}  // namespace specontext::cluster
