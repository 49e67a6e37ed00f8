// TLS on the KV node's control plane (issue 26, "beyond the defects"): real handshakes on loopback
// with certificates made here (tests/cluster/kv_node_tls_util.h). A client that trusts the node's
// CA is served, over an IP address and over a DNS name, and the challenge–response runs inside
// TLS (right secret served, wrong one refused and counted); a client with another CA, or a node
// certificate for another host, is refused before any line is sent; plain TCP to a TLS node and TLS
// to a plain node are each a quick error naming the node (never the client's timeout); the
// connection limit's refusal reaches a TLS client; junk or silence in a handshake is closed; bad
// certificate, key and CA files are start-up errors naming the flag.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "cluster/kv_node.h"
#include "cluster/kv_node_client.h"
#include "cluster/kv_node_tls.h"
#include "tests/cluster/kv_node_test_util.h"
#include "tests/cluster/kv_node_tls_util.h"

namespace specontext::cluster {
namespace {

using namespace std::chrono_literals;
using testing::TlsDir;

const std::string kSecret = "tls test secret 0123456789abcdef";
// Long enough that a hang would show; every error here must come well before it.
constexpr auto kTimeout = 20s;

struct Pki {
  TlsDir dir;
  TlsDir::Ca ca = dir.make_ca("ca");
  TlsDir::Ca other_ca = dir.make_ca("other_ca");
  TlsDir::Leaf node = dir.make_leaf(ca, "node", "IP:127.0.0.1,DNS:localhost");
  TlsDir::Leaf elsewhere = dir.make_leaf(ca, "elsewhere", "DNS:kv.example.invalid,IP:192.0.2.7");
};

std::unique_ptr<KvNode> start_tls_node(const TlsDir::Leaf& leaf, const std::string& secret = kSecret,
                                       int64_t max_connections = 64) {
  KvNodeOptions o;
  o.capacity = 1 << 20;
  o.secret = secret;
  o.tls_cert_file = leaf.cert_file;
  o.tls_key_file = leaf.key_file;
  o.max_connections = max_connections;
  o.log = [](const std::string&) {};
  auto n = KvNode::start(std::move(o));
  EXPECT_TRUE(n.is_ok()) << n.status().to_string();
  return n.is_ok() ? std::move(n).value() : nullptr;
}

KvNodeAccess access(const std::string& ca_file, const std::string& secret = kSecret) {
  KvNodeAccess a;
  a.secret = secret;
  if (!ca_file.empty()) {
    auto tls = KvNodeTlsClient::load(ca_file);
    EXPECT_TRUE(tls.is_ok()) << tls.status().to_string();
    if (tls.is_ok()) a.tls = *tls;
  }
  return a;
}

// Polls a node counter that the node's thread bumps after the client has its answer.
int64_t wait_for(const KvNode& node, int64_t KvNodeStats::*field, int64_t want) {
  for (int i = 0; i < 4000 && node.stats().*field < want; ++i) std::this_thread::sleep_for(5ms);
  return node.stats().*field;
}

bool contains(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

TEST(KvNodeTls, AClientThatTrustsTheCaIsServedAndAuthenticatesInsideTls) {
  Pki pki;
  auto node = start_tls_node(pki.node);
  ASSERT_NE(node, nullptr);
  for (const char* host : {"127.0.0.1", "localhost"}) {
    auto c = KvNodeClient::connect(Endpoint{host, node->port()}, kTimeout, access(pki.ca.cert_file));
    ASSERT_TRUE(c.is_ok()) << host << ": " << c.status().to_string();
    auto region = (*c)->allocate(8192);
    ASSERT_TRUE(region.is_ok()) << region.status().to_string();
    auto stats = (*c)->call_line(R"({"op":"stats"})");
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    EXPECT_EQ((*stats)["regions"].get<int64_t>(), 1);
    EXPECT_EQ((*stats)["tls_failures"].get<int64_t>(), 0);
    ASSERT_TRUE((*c)->free(region->region).is_ok());
  }
  // The challenge–response inside TLS: a wrong secret is refused and counted as before.
  auto wrong = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout,
                                     access(pki.ca.cert_file, "not the secret but long enough"));
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument) << wrong.status().to_string();
  EXPECT_TRUE(contains(wrong.status(), "authentication failed")) << wrong.status().to_string();
  EXPECT_EQ(node->stats().auth_failures, 1);
  auto none = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.ca.cert_file, ""));
  ASSERT_FALSE(none.is_ok());
  EXPECT_TRUE(contains(none.status(), "requires authentication")) << none.status().to_string();
  EXPECT_EQ(node->stats().tls_failures, 0);
}

TEST(KvNodeTls, AnOpenLoopbackNodeServesTlsToo) {
  Pki pki;
  auto node = start_tls_node(pki.node, "");
  ASSERT_NE(node, nullptr);
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.ca.cert_file, ""));
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_TRUE((*c)->allocate(4096).is_ok());
}

TEST(KvNodeTls, ANodeSignedByAnotherCaIsRefusedBeforeAnyLine) {
  Pki pki;
  auto node = start_tls_node(pki.node);
  ASSERT_NE(node, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.other_ca.cert_file));
  ASSERT_FALSE(c.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kTimeout);  // refused, not timed out
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "kv node 127.0.0.1:" + std::to_string(node->port()))) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "certificate is not trusted")) << c.status().to_string();
  EXPECT_FALSE(contains(c.status(), "no TLS handshake within")) << c.status().to_string();
  // The node saw the failed handshake: counted, nothing authenticated or allocated.
  EXPECT_EQ(wait_for(*node, &KvNodeStats::tls_failures, 1), 1);
  EXPECT_EQ(node->stats().auth_failures, 0);
  EXPECT_EQ(node->stats().requests, 0);
}

TEST(KvNodeTls, ACertificateForAnotherHostIsRefused) {
  Pki pki;
  auto node = start_tls_node(pki.elsewhere);
  ASSERT_NE(node, nullptr);
  for (const char* host : {"127.0.0.1", "localhost"}) {
    auto c = KvNodeClient::connect(Endpoint{host, node->port()}, kTimeout, access(pki.ca.cert_file));
    ASSERT_FALSE(c.is_ok()) << host;
    EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
    EXPECT_TRUE(contains(c.status(), "mismatch")) << host << ": " << c.status().to_string();
  }
  EXPECT_EQ(node->stats().requests, 0);
}

TEST(KvNodeTls, PlainTcpToATlsNodeIsAClearErrorNamingTheNode) {
  Pki pki;
  auto node = start_tls_node(pki.node);
  ASSERT_NE(node, nullptr);
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access("", kSecret));
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "speaks TLS only")) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "--kv-node-tls-ca")) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "kv node 127.0.0.1:" + std::to_string(node->port()))) << c.status().to_string();
  EXPECT_EQ(wait_for(*node, &KvNodeStats::tls_failures, 1), 1);
  EXPECT_EQ(node->stats().requests, 0);  // the plain line was never parsed
  // The node serves TLS clients on.
  auto good = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.ca.cert_file));
  EXPECT_TRUE(good.is_ok()) << good.status().to_string();
}

TEST(KvNodeTls, TlsToAPlainNodeIsAClearErrorNamingTheNode) {
  Pki pki;
  KvNodeOptions o;
  o.capacity = 1 << 20;
  o.secret = kSecret;
  o.log = [](const std::string&) {};
  auto node = KvNode::start(o);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", (*node)->port()}, kTimeout, access(pki.ca.cert_file));
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "TLS handshake failed")) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "--tls-cert")) << c.status().to_string();
  EXPECT_FALSE(contains(c.status(), "no TLS handshake within")) << c.status().to_string();
  EXPECT_TRUE(contains(c.status(), "kv node 127.0.0.1:" + std::to_string((*node)->port())))
      << c.status().to_string();
  EXPECT_EQ(wait_for(**node, &KvNodeStats::tls_failures, 1), 1);
  EXPECT_EQ((*node)->stats().requests, 0);
  auto plain = KvNodeClient::connect(Endpoint{"127.0.0.1", (*node)->port()}, kTimeout, kSecret);
  EXPECT_TRUE(plain.is_ok()) << plain.status().to_string();
}

TEST(KvNodeTls, TheConnectionLimitsRefusalReachesATlsClient) {
  Pki pki;
  auto node = start_tls_node(pki.node, kSecret, 1);
  ASSERT_NE(node, nullptr);
  auto first = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.ca.cert_file));
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  auto second = KvNodeClient::connect(Endpoint{"127.0.0.1", node->port()}, kTimeout, access(pki.ca.cert_file));
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted) << second.status().to_string();
  EXPECT_TRUE(contains(second.status(), "connection limit (1)")) << second.status().to_string();
}

// A TLS node under hostile handshakes: a record header followed by junk is a failed handshake
// (counted, closed), one byte of a handshake and then silence is closed by the idle timeout (a
// handshake is no way around it), and the node serves a real client after both.
TEST(KvNodeTls, JunkOrSilenceInTheHandshakeIsClosedAndTheNodeServesOn) {
  Pki pki;
  KvNodeOptions o;
  o.capacity = 1 << 20;
  o.secret = kSecret;
  o.tls_cert_file = pki.node.cert_file;
  o.tls_key_file = pki.node.key_file;
  o.idle_timeout = 50ms;
  o.log = [](const std::string&) {};
  auto node = KvNode::start(o);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  testing::RawConnection junk((*node)->port());
  ASSERT_TRUE(junk.ok());
  ASSERT_TRUE(junk.send(std::string("\x16\x03\x01\x00\x08junkjunk", 13)));
  bool closed = false;  // after the node's TLS alert, a few bytes
  for (int i = 0; i < 64 && !closed; ++i) closed = junk.closed_by_peer();
  EXPECT_TRUE(closed);
  EXPECT_EQ(wait_for(**node, &KvNodeStats::tls_failures, 1), 1);
  testing::RawConnection silent((*node)->port());
  ASSERT_TRUE(silent.ok());
  ASSERT_TRUE(silent.send(std::string(1, static_cast<char>(kTlsHandshakeByte))));
  EXPECT_TRUE(silent.closed_by_peer());
  EXPECT_EQ(wait_for(**node, &KvNodeStats::idle_closed, 1), 1);
  EXPECT_EQ((*node)->stats().requests, 0);
  auto good = KvNodeClient::connect(Endpoint{"127.0.0.1", (*node)->port()}, kTimeout, access(pki.ca.cert_file));
  ASSERT_TRUE(good.is_ok()) << good.status().to_string();
  EXPECT_TRUE((*good)->allocate(4096).is_ok());
}

TEST(KvNodeTls, BadCertificateKeyOrCaFilesAreErrorsNamingTheFlag) {
  Pki pki;
  KvNodeOptions o;
  o.capacity = 1 << 20;
  o.secret = kSecret;
  o.tls_cert_file = pki.node.cert_file;
  auto no_key = KvNode::start(o);
  ASSERT_FALSE(no_key.is_ok());
  EXPECT_TRUE(contains(no_key.status(), "--tls-key")) << no_key.status().to_string();
  o.tls_key_file = pki.elsewhere.key_file;  // another certificate's key
  auto mismatched = KvNode::start(o);
  ASSERT_FALSE(mismatched.is_ok());
  EXPECT_TRUE(contains(mismatched.status(), "not the private key of the certificate"))
      << mismatched.status().to_string();
  o.tls_key_file = pki.node.key_file;
  ASSERT_EQ(::chmod(pki.node.key_file.c_str(), 0644), 0);
  auto readable = KvNode::start(o);
  ASSERT_FALSE(readable.is_ok());
  EXPECT_TRUE(contains(readable.status(), "readable by every user")) << readable.status().to_string();
  ASSERT_EQ(::chmod(pki.node.key_file.c_str(), 0600), 0);
  o.tls_cert_file = pki.dir.path("missing.pem");
  auto missing = KvNode::start(o);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_TRUE(contains(missing.status(), "--tls-cert")) << missing.status().to_string();
  o.tls_cert_file = pki.node.cert_file;
  EXPECT_TRUE(KvNode::start(o).is_ok());

  auto no_ca = KvNodeTlsClient::load(pki.dir.path("missing_ca.pem"));
  ASSERT_FALSE(no_ca.is_ok());
  EXPECT_TRUE(contains(no_ca.status(), "--kv-node-tls-ca")) << no_ca.status().to_string();
  const std::string junk = pki.dir.path("junk.pem");
  std::ofstream(junk) << "not a certificate\n";
  auto bad_ca = KvNodeTlsClient::load(junk);
  ASSERT_FALSE(bad_ca.is_ok());
  EXPECT_TRUE(contains(bad_ca.status(), "no PEM CA certificate")) << bad_ca.status().to_string();
  auto flags = load_kv_node_access("", junk);
  ASSERT_FALSE(flags.is_ok());
  EXPECT_TRUE(contains(flags.status(), "--kv-node-tls-ca")) << flags.status().to_string();
}

}  // namespace
}  // namespace specontext::cluster
