// The KV node's authentication and limits (issue 26, item 4): SHA-256 and HMAC-SHA256 against
// FIPS 180-4 and RFC 4231; the secret from a file or SPECONTEXT_KV_SECRET; challenge–response at
// hello (right secret served; wrong or missing secret refused, counted and logged with the peer;
// an answer to one nonce refused for another; the node proves the secret back, and a client
// refuses a node that cannot); the protocol version in hello; the shared secret's client's
// quota (across its connections); the connection limit; no secret, no listening beyond loopback.
// (Idle and slow clients: tests/cluster/kv_node_hostile_test.cc.)
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cluster/kv_node.h"
#include "cluster/kv_node_auth.h"
#include "cluster/kv_node_client.h"
#include "tests/cluster/kv_node_test_util.h"

namespace specontext::cluster {
namespace {

using namespace std::chrono_literals;
using testing::RawConnection;

const std::string kSecret = "correct horse battery staple 0123456789";

std::span<const uint8_t> bytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}
std::string hex(std::span<const uint8_t> b) { return hex_encode(b); }

// ---- SHA-256 / HMAC-SHA256 known answers ----

TEST(KvNodeAuthCrypto, Sha256MatchesFips180Examples) {
  EXPECT_EQ(hex(sha256(bytes("abc"))), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha256(bytes(""))), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256(bytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(sha256(bytes(std::string(1000000, 'a')))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(KvNodeAuthCrypto, Sha256AroundTheBlockAndPaddingBoundaries) {
  // Python's hashlib.sha256(bytes(i % 256 for i in range(n))).
  const std::pair<size_t, const char*> cases[] = {
      {55, "463eb28e72f82e0a96c0a4cc53690c571281131f672aa229e0d45ae59b598b59"},
      {56, "da2ae4d6b36748f2a318f23e7ab1dfdf45acdc9d049bd80e59de82a60895f562"},
      {63, "29af2686fd53374a36b0846694cc342177e428d1647515f078784d69cdb9e488"},
      {64, "fdeab9acf3710362bd2658cdc9a29e8f9c757fcf9811603a8c447cd1d9151108"},
      {65, "4bfd2c8b6f1eec7a2afeb48b934ee4b2694182027e6d0fc075074f2fabb31781"},
      {119, "da18797ed7c3a777f0847f429724a2d8cd5138e6ed2895c3fa1a6d39d18f7ec6"},
      {120, "f52b23db1fbb6ded89ef42a23ce0c8922c45f25c50b568a93bf1c075420bbb7c"},
      {128, "471fb943aa23c511f6f72f8d1652d9c880cfa392ad80503120547703e56a2be5"},
  };
  for (const auto& [n, want] : cases) {
    std::vector<uint8_t> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>(i);
    EXPECT_EQ(hex(sha256(data)), want) << n << " bytes";
  }
}

TEST(KvNodeAuthCrypto, HmacSha256MatchesRfc4231) {
  const std::vector<uint8_t> k20(20, 0x0b), kaa20(20, 0xaa), dd50(50, 0xdd), kaa131(131, 0xaa);
  EXPECT_EQ(hex(hmac_sha256(k20, bytes("Hi There"))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmac_sha256(bytes("Jefe"), bytes("what do ya want for nothing?"))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex(hmac_sha256(kaa20, dd50)),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(hex(hmac_sha256(kaa131, bytes("Test Using Larger Than Block-Size Key - Hash Key First"))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(
      hex(hmac_sha256(kaa131, bytes("This is a test using a larger than block-size key and a larger than "
                                    "block-size data. The key needs to be hashed before being used by the "
                                    "HMAC algorithm."))),
      "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST(KvNodeAuthCrypto, ConstantTimeEqualComparesEveryByteAndTheSize) {
  const std::vector<uint8_t> a = {1, 2, 3, 4}, b = {1, 2, 3, 4}, c = {1, 2, 3, 5}, d = {0, 2, 3, 4};
  EXPECT_TRUE(constant_time_equal(a, b));
  EXPECT_FALSE(constant_time_equal(a, c));
  EXPECT_FALSE(constant_time_equal(a, d));
  EXPECT_FALSE(constant_time_equal(a, std::span(b).first(3)));
}

TEST(KvNodeAuthCrypto, TheAnswerDependsOnSecretNonceAndNode) {
  AuthNonce n1{}, n2{};
  ASSERT_TRUE(fill_random(n1).is_ok());
  ASSERT_TRUE(fill_random(n2).is_ok());
  ASSERT_NE(n1, n2);
  const Sha256Digest base = auth_response(kSecret, n1, "node:1");
  EXPECT_EQ(base, auth_response(kSecret, n1, "node:1"));
  EXPECT_NE(base, auth_response(kSecret, n2, "node:1"));
  EXPECT_NE(base, auth_response(kSecret + "x", n1, "node:1"));
  EXPECT_NE(base, auth_response(kSecret, n1, "node:2"));
}

// ---- the secret's sources ----

class SecretFile {
 public:
  SecretFile(const std::string& content, mode_t mode) {
    path_ = (std::filesystem::temp_directory_path() /
             ("kv_secret_" + std::to_string(getpid()) + "_" + std::to_string(counter_++)))
                .string();
    std::ofstream(path_) << content;
    ::chmod(path_.c_str(), mode);
  }
  ~SecretFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

class ScopedEnv {
 public:
  explicit ScopedEnv(const char* value) {
    if (const char* old = std::getenv(kSecretEnv)) old_ = old, had_ = true;
    if (value != nullptr) {
      ::setenv(kSecretEnv, value, 1);
    } else {
      ::unsetenv(kSecretEnv);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(kSecretEnv, old_.c_str(), 1);
    } else {
      ::unsetenv(kSecretEnv);
    }
  }

 private:
  std::string old_;
  bool had_ = false;
};

TEST(KvNodeAuthSecret, FromAnOwnerOnlyFileTrailingNewlineDropped) {
  ScopedEnv env("an environment secret that loses to the file");
  SecretFile f(kSecret + "\n", 0600);
  auto s = load_kv_secret(f.path());
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(*s, kSecret);
}

TEST(KvNodeAuthSecret, RefusesAFileOthersCanReadOneTooShortOrMissing) {
  SecretFile open_file(kSecret, 0644);
  auto s = load_kv_secret(open_file.path());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("chmod 600"), std::string::npos) << s.status().to_string();
  SecretFile short_file("short\n", 0600);
  s = load_kv_secret(short_file.path());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("at least 16 bytes"), std::string::npos) << s.status().to_string();
  SecretFile long_file(std::string(kMaxSecretBytes + 1, 'x'), 0600);
  s = load_kv_secret(long_file.path());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("longer than"), std::string::npos) << s.status().to_string();
  s = load_kv_secret("/nonexistent/kv.secret");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("/nonexistent/kv.secret"), std::string::npos) << s.status().to_string();
}

TEST(KvNodeAuthSecret, FromTheEnvironmentElseNone) {
  {
    ScopedEnv env(kSecret.c_str());
    auto s = load_kv_secret("");
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    EXPECT_EQ(*s, kSecret);
  }
  {
    ScopedEnv env("tiny");
    auto s = load_kv_secret("");
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.status().message().find(kSecretEnv), std::string::npos) << s.status().to_string();
  }
  ScopedEnv env(nullptr);
  auto s = load_kv_secret("");
  ASSERT_TRUE(s.is_ok());
  EXPECT_TRUE(s->empty());
}

// ---- the node ----

// Lines the node logs, kept for the test.
struct LogSink {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& line) {
      std::lock_guard lock(mu);
      lines.push_back(line);
    };
  }
  std::string all() {
    std::lock_guard lock(mu);
    std::string out;
    for (const auto& l : lines) out += l + "\n";
    return out;
  }
};

KvNodeOptions options(const std::string& secret = kSecret) {
  KvNodeOptions o;
  o.capacity = 1 << 20;
  o.secret = secret;
  return o;
}

std::unique_ptr<KvNode> start(KvNodeOptions o) {
  auto n = KvNode::start(std::move(o));
  EXPECT_TRUE(n.is_ok()) << n.status().to_string();
  return n.is_ok() ? std::move(n).value() : nullptr;
}

Result<std::unique_ptr<KvNodeClient>> connect(const KvNode& node, const std::string& secret) {
  return KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, 5s, secret);
}

AuthNonce nonce_of(const nlohmann::json& hello) {
  AuthNonce n{};
  auto b = hex_decode(hello.value("nonce", std::string()), "nonce");
  if (b.is_ok() && b->size() == n.size()) std::copy(b->begin(), b->end(), n.begin());
  return n;
}

// An auth request answering with `mac` and challenging the node with `client_nonce`.
std::string auth_line(const Sha256Digest& mac, const AuthNonce& client_nonce = AuthNonce{}) {
  return R"({"op":"auth","mac":")" + hex_encode(mac) + R"(","nonce":")" + hex_encode(client_nonce) + R"("})";
}

// The hello request of this protocol version.
std::string hello_line() { return R"({"op":"hello","version":)" + std::to_string(kControlVersion) + "}"; }

TEST(KvNodeAuth, TheRightSecretIsServed) {
  auto node = start(options());
  ASSERT_NE(node, nullptr);
  auto c = connect(*node, kSecret);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_FALSE((*c)->hello().auth_required);
  EXPECT_EQ((*c)->hello().capacity, 1u << 20);
  auto region = (*c)->allocate(8192);
  ASSERT_TRUE(region.is_ok()) << region.status().to_string();
  auto stats = (*c)->call_line(R"({"op":"stats"})");
  ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
  EXPECT_EQ(stats->value("regions", -1), 1);
  EXPECT_EQ(stats->value("auth_failures", -1), 0);
  EXPECT_EQ(node->stats().auth_failures, 0);
}

TEST(KvNodeAuth, AWrongSecretIsRefusedCountedAndLoggedWithThePeer) {
  LogSink log;
  KvNodeOptions o = options();
  o.log = log.fn();
  auto node = start(o);
  ASSERT_NE(node, nullptr);
  auto c = connect(*node, "a wrong secret of enough length");
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
  EXPECT_NE(c.status().message().find("authentication failed"), std::string::npos) << c.status().to_string();
  EXPECT_EQ(node->stats().auth_failures, 1);
  EXPECT_EQ(node->stats().regions, 0);
  const std::string logged = log.all();
  EXPECT_NE(logged.find("authentication failed from 127.0.0.1:"), std::string::npos) << logged;
  EXPECT_NE(logged.find(node->name()), std::string::npos) << logged;
}

TEST(KvNodeAuth, NoSecretOnANodeThatRequiresOneIsRefused) {
  auto node = start(options());
  ASSERT_NE(node, nullptr);
  auto c = connect(*node, "");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("requires authentication"), std::string::npos)
      << c.status().to_string();
  EXPECT_NE(c.status().message().find(kSecretEnv), std::string::npos) << c.status().to_string();
  // A client that skips the challenge gets nothing: refused, counted, disconnected.
  for (const char* line :
       {R"({"op":"alloc","bytes":4096})", R"({"op":"stats"})", R"({"op":"free","region":1})"}) {
    RawConnection raw(node->port());
    ASSERT_TRUE(raw.ok());
    auto r = raw.call(line);
    ASSERT_TRUE(r.is_object()) << line;
    EXPECT_EQ(r.value("ok", true), false) << r.dump();
    EXPECT_NE(r.value("error", std::string()).find("before authentication"), std::string::npos) << r.dump();
    EXPECT_TRUE(raw.closed_by_peer()) << line;
  }
  EXPECT_EQ(node->stats().auth_failures, 3);
  EXPECT_EQ(node->stats().regions, 0);
  EXPECT_EQ(node->stats().used, 0u);
  // Nor does one that answers without having been challenged.
  RawConnection raw(node->port());
  auto r = raw.call(auth_line(Sha256Digest{}));
  EXPECT_NE(r.value("error", std::string()).find("without a hello"), std::string::npos) << r.dump();
  EXPECT_EQ(node->stats().auth_failures, 4);
}

TEST(KvNodeAuth, AnAnswerIsGoodForItsOwnNonceOnly) {
  auto node = start(options());
  ASSERT_NE(node, nullptr);
  RawConnection first(node->port());
  const nlohmann::json h1 = first.call(hello_line());
  ASSERT_EQ(h1.value("auth", std::string()), "hmac-sha256") << h1.dump();
  EXPECT_FALSE(h1.contains("capacity")) << "nothing about the node before authentication: " << h1.dump();
  const Sha256Digest answer = auth_response(kSecret, nonce_of(h1), h1.value("node", std::string()));
  const nlohmann::json ok = first.call(auth_line(answer));
  ASSERT_EQ(ok.value("ok", false), true) << ok.dump();
  EXPECT_EQ(ok.value("auth", std::string()), "done");
  EXPECT_EQ(ok.value("capacity", 0u), 1u << 20);

  // Replayed on another connection, which was sent another nonce.
  RawConnection second(node->port());
  const nlohmann::json h2 = second.call(hello_line());
  ASSERT_NE(nonce_of(h2), nonce_of(h1));
  const nlohmann::json replay = second.call(auth_line(answer));
  EXPECT_EQ(replay.value("ok", true), false) << replay.dump();
  EXPECT_NE(replay.value("error", std::string()).find("wrong answer"), std::string::npos) << replay.dump();
  EXPECT_TRUE(second.closed_by_peer());
  EXPECT_EQ(node->stats().auth_failures, 1);

  // A second hello replaces the challenge: the answer to the first no longer counts.
  RawConnection third(node->port());
  const nlohmann::json h3 = third.call(hello_line());
  const nlohmann::json h4 = third.call(hello_line());
  ASSERT_NE(nonce_of(h3), nonce_of(h4));
  const nlohmann::json stale = third.call(auth_line(auth_response(kSecret, nonce_of(h3), node->name())));
  EXPECT_EQ(stale.value("ok", true), false) << stale.dump();
  EXPECT_EQ(node->stats().auth_failures, 2);
}

TEST(KvNodeAuth, TheNodeProvesItHoldsTheSecretToEachChallenge) {
  auto node = start(options());
  ASSERT_NE(node, nullptr);
  RawConnection raw(node->port());
  const nlohmann::json h = raw.call(hello_line());
  const AuthNonce node_nonce = nonce_of(h);
  AuthNonce mine{};
  ASSERT_TRUE(fill_random(mine).is_ok());
  const nlohmann::json done = raw.call(auth_line(auth_response(kSecret, node_nonce, node->name()), mine));
  ASSERT_EQ(done.value("ok", false), true) << done.dump();
  auto proof = hex_decode(done.value("proof", std::string()), "proof");
  ASSERT_TRUE(proof.is_ok()) << done.dump();
  const Sha256Digest want = node_proof(kSecret, mine, node_nonce, node->name());
  EXPECT_TRUE(constant_time_equal(*proof, want));
  // The proof answers this client nonce, this node challenge and this secret only.
  AuthNonce other = mine;
  other[0] ^= 1;
  EXPECT_FALSE(constant_time_equal(*proof, node_proof(kSecret, other, node_nonce, node->name())));
  EXPECT_FALSE(constant_time_equal(*proof, node_proof(kSecret, mine, other, node->name())));
  EXPECT_FALSE(constant_time_equal(
      *proof, node_proof("another secret of enough length", mine, node_nonce, node->name())));
  // And it is never the client's own answer under another name.
  EXPECT_FALSE(constant_time_equal(*proof, auth_response(kSecret, node_nonce, node->name())));
  // An auth request without the client's challenge is malformed.
  RawConnection bare(node->port());
  bare.call(hello_line());
  const nlohmann::json r = bare.call(R"({"op":"auth","mac":")" + hex_encode(Sha256Digest{}) + R"("})");
  EXPECT_NE(r.value("error", std::string()).find("'nonce'"), std::string::npos) << r.dump();
}

// A process posing as a KV node on loopback: answers each control line with `reply(line)`.
class FakeNode {
 public:
  explicit FakeNode(std::function<std::string(const nlohmann::json&)> reply) : reply_(std::move(reply)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listener_, 4) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeNode() {
    ::shutdown(listener_, SHUT_RDWR);
    ::close(listener_);
    if (thread_.joinable()) thread_.join();
  }
  uint16_t port() const { return port_; }

 private:
  void serve() {
    const int fd = ::accept(listener_, nullptr, nullptr);
    if (fd < 0) return;
    std::string line;
    char c = 0;
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, 60000) == 1 && ::recv(fd, &c, 1, 0) == 1) {
      if (c != '\n') {
        line.push_back(c);
        continue;
      }
      const std::string out = reply_(nlohmann::json::parse(line, nullptr, false)) + "\n";
      line.clear();
      if (::send(fd, out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size())) break;
    }
    ::close(fd);
  }
  std::function<std::string(const nlohmann::json&)> reply_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

// What a fake node says: a challenge at hello, then at auth "done" with `proof` (none when empty).
std::function<std::string(const nlohmann::json&)> impostor(const std::optional<std::string>& proof_secret) {
  return [proof_secret](const nlohmann::json& req) {
    nlohmann::json out = {{"ok", true}, {"version", kControlVersion}, {"node", "fake:1"}};
    if (req.value("op", std::string()) == "hello") {
      out["auth"] = "hmac-sha256";
      out["nonce"] = hex_encode(AuthNonce{});
      return out.dump();
    }
    out["auth"] = "done";
    if (proof_secret) {
      AuthNonce theirs{};
      auto b = hex_decode(req.value("nonce", std::string()), "nonce");
      if (b.is_ok() && b->size() == theirs.size()) std::copy(b->begin(), b->end(), theirs.begin());
      out["proof"] = hex_encode(node_proof(*proof_secret, theirs, AuthNonce{}, "fake:1"));
    }
    for (const char* k : {"capacity", "free", "quota"}) out[k] = 1 << 20;
    out["worker_address"] = "0a0b";
    out["rma"] = false;
    return out.dump();
  };
}

TEST(KvNodeAuth, AClientRefusesANodeThatCannotProveTheSecret) {
  const auto refused = [](FakeNode& fake, const std::string& secret) {
    return KvNodeClient::connect(Endpoint{"127.0.0.1", fake.port()}, 5s, secret);
  };
  {  // accepts any answer, proves with another secret
    FakeNode fake(impostor(std::string("a different secret of enough length")));
    auto c = refused(fake, kSecret);
    ASSERT_FALSE(c.is_ok());
    EXPECT_NE(c.status().message().find("did not prove it holds the shared secret"), std::string::npos)
        << c.status().to_string();
  }
  {  // proves with the right secret: served (the fake is then a node that knows the secret)
    FakeNode fake(impostor(kSecret));
    auto c = refused(fake, kSecret);
    EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  }
  {  // no proof at all
    FakeNode fake(impostor(std::nullopt));
    auto c = refused(fake, kSecret);
    ASSERT_FALSE(c.is_ok());
    EXPECT_NE(c.status().message().find("'proof'"), std::string::npos) << c.status().to_string();
  }
  {  // "no authentication" to a client that holds a secret
    FakeNode fake([](const nlohmann::json&) {
      return nlohmann::json{{"ok", true},       {"version", kControlVersion},
                            {"node", "fake:1"}, {"auth", "none"},
                            {"capacity", 1},    {"free", 1},
                            {"quota", 0},       {"worker_address", "0a0b"},
                            {"rma", false}}
          .dump();
    });
    auto c = refused(fake, kSecret);
    ASSERT_FALSE(c.is_ok());
    EXPECT_NE(c.status().message().find("asks for no authentication"), std::string::npos)
        << c.status().to_string();
  }
}

TEST(KvNodeAuth, AnotherProtocolVersionIsAClearError) {
  auto node = start(options());
  ASSERT_NE(node, nullptr);
  RawConnection raw(node->port());
  const nlohmann::json r = raw.call(R"({"op":"hello","version":3})");
  EXPECT_EQ(r.value("ok", true), false) << r.dump();
  EXPECT_NE(r.value("error", std::string())
                .find("control protocol 3, this node " + std::to_string(kControlVersion)),
            std::string::npos)
      << r.dump();
  // A version-3 node's hello reply (no "auth") is refused by this client, naming both versions.
  auto h = parse_hello_reply(nlohmann::json::parse(R"({"ok":true,"version":3,"node":"n:1"})"), "n:1");
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(
      h.status().message().find("speaks control protocol 3, this client " + std::to_string(kControlVersion)),
      std::string::npos)
      << h.status().to_string();
}

TEST(KvNodeAuth, AnAllocBeyondTheQuotaIsRefusedAndAllocatesNothing) {
  KvNodeOptions o = options();
  o.client_quota = 64 << 10;
  auto node = start(o);
  ASSERT_NE(node, nullptr);
  auto c = connect(*node, kSecret);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ((*c)->hello().quota, 64u << 10);
  auto first = (*c)->allocate(48 << 10);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  const uint64_t used = node->stats().used;
  auto over = (*c)->allocate(32 << 10);
  ASSERT_FALSE(over.is_ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().to_string();
  EXPECT_NE(over.status().message().find("quota"), std::string::npos) << over.status().to_string();
  EXPECT_EQ(node->stats().regions, 1);
  EXPECT_EQ(node->stats().used, used);
  EXPECT_EQ(node->stats().quota_refusals, 1);
  auto huge = (*c)->call_line(R"({"op":"alloc","bytes":18446744073709551615})");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_NE(huge.status().message().find("quota"), std::string::npos) << huge.status().to_string();
  // The quota is per client: another connection with the same secret is the same client, and
  // freeing on one gives the room back to both (tests/cluster/kv_node_clients_test.cc: per ID).
  auto other = connect(*node, kSecret);
  ASSERT_TRUE(other.is_ok());
  EXPECT_FALSE((*other)->allocate(48 << 10).is_ok());
  ASSERT_TRUE((*c)->free(first->region).is_ok());
  EXPECT_TRUE((*other)->allocate(64 << 10).is_ok());
}

TEST(KvNodeAuth, TheConnectionPastTheLimitIsRefused) {
  LogSink log;
  KvNodeOptions o = options();
  o.max_connections = 2;
  o.log = log.fn();
  auto node = start(o);
  ASSERT_NE(node, nullptr);
  auto a = connect(*node, kSecret);
  auto b = connect(*node, kSecret);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  auto third = connect(*node, kSecret);
  ASSERT_FALSE(third.is_ok());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted) << third.status().to_string();
  EXPECT_NE(third.status().message().find("connection limit (2)"), std::string::npos)
      << third.status().to_string();
  EXPECT_EQ(node->stats().connections_refused, 1);
  EXPECT_EQ(node->stats().connections, 2);
  EXPECT_NE(log.all().find("refused a connection from 127.0.0.1:"), std::string::npos) << log.all();
  // A slot freed is a slot served.
  a->reset();
  for (int i = 0; i < 2000 && node->stats().connections != 1; ++i) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(node->stats().connections, 1);
  auto again = connect(*node, kSecret);
  EXPECT_TRUE(again.is_ok()) << again.status().to_string();
}

TEST(KvNodeAuth, WithoutASecretTheNodeListensOnLoopbackOnly) {
  KvNodeOptions o = options("");
  o.host = "0.0.0.0";
  auto refused = KvNode::start(o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("without a secret"), std::string::npos)
      << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("--secret-file"), std::string::npos)
      << refused.status().to_string();
  o.host = "::1";
  auto loopback6 = KvNode::start(o);
  EXPECT_TRUE(loopback6.is_ok() || loopback6.status().message().find("without a secret") == std::string::npos)
      << loopback6.status().to_string();
  o.host = "127.0.0.1";
  auto open = start(o);
  ASSERT_NE(open, nullptr);
  auto c = connect(*open, "");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_TRUE((*c)->allocate(4096).is_ok());
  o.host = "0.0.0.0";
  o.secret = kSecret;
  auto with_secret = start(o);
  EXPECT_NE(with_secret, nullptr);
}

}  // namespace
}  // namespace specontext::cluster
