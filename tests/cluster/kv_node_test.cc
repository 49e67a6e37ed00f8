// KV nodes in-process: the control plane; UcxRemoteTransport through the transport conformance
// suite and its own behaviour (merged rows, capabilities, replication and fail-over when a node
// stops, a dead replica rejoining: UcxRemoteTransport::rejoin, ReplicaHealer). Hostile requests
// and clients: tests/cluster/kv_node_hostile_test.cc.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cluster/kv_node.h"
#include "cluster/kv_node_client.h"
#include "tests/cluster/kv_node_test_util.h"
#include "tests/tests_common.h"
#include "tests/transport/transport_conformance.h"
#include "cluster/replica_healer.h"
#include "transport/local_transport.h"
#include "transport/transport_router.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {
namespace {

using transport::RemoteRegion;
using transport::UcxRemoteConfig;
using transport::UcxRemoteTransport;
using transport::UcxTransferMode;
using namespace std::chrono_literals;

constexpr TierId kLocal{1};
constexpr TierId kRemote{2};

using testing::connect;
using testing::start_node;
using specontext::testing::random_bytes;
using transport_conformance::run_batch;
using transport_conformance::run_to_end;
using transport_conformance::TransportCase;
using transport_conformance::TransportConformance;

// A node pair of client + transport over `regions` (one per replica), and a local buffer.
struct Rig {
  std::vector<std::unique_ptr<KvNodeClient>> clients;
  std::unique_ptr<UcxRemoteTransport> ucx;
  std::vector<uint8_t> local;
};

Rig make_rig(UcxTransferMode mode, const std::vector<KvNode*>& nodes, uint64_t remote_bytes,
             size_t local_bytes, std::chrono::milliseconds op_timeout = 3000ms) {
  Rig r;
  UcxRemoteConfig cfg;
  cfg.mode = mode;
  cfg.tier = kRemote;
  cfg.op_timeout = op_timeout;
  for (KvNode* n : nodes) {
    r.clients.push_back(connect(*n));
    auto region = r.clients.back()->allocate(remote_bytes);
    EXPECT_TRUE(region.is_ok()) << region.status().to_string();
    cfg.replicas.push_back(*region);
  }
  auto t = UcxRemoteTransport::create(cfg);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  r.ucx = std::move(t).value();
  r.local.assign(local_bytes, 0);
  EXPECT_TRUE(r.ucx->register_tier(kLocal, MemoryKind::kHost, r.local.data(), local_bytes).is_ok());
  EXPECT_TRUE(r.ucx->register_tier(kRemote, MemoryKind::kRemote, nullptr, remote_bytes).is_ok());
  return r;
}

TEST(KvNodeControl, HelloAllocFreeAndStats) {
  auto node = start_node(1 << 20);
  ASSERT_NE(node, nullptr);
  auto c = connect(*node);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->hello().capacity, 1u << 20);
  EXPECT_FALSE(c->hello().worker_address.empty());
  auto a = c->allocate(100000);
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  EXPECT_GE(a->bytes, 100000u);
  EXPECT_TRUE(a->rkey.empty());  // no one-sided RMA: kv_node_hostile_test
  EXPECT_FALSE(c->hello().rma);
  EXPECT_EQ(node->stats().regions, 1);
  auto too_big = c->allocate(2 << 20);
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kResourceExhausted) << too_big.status().to_string();
  EXPECT_NE(too_big.status().message().find(node->name()), std::string::npos) << too_big.status().to_string();
  auto huge = c->call_line(R"({"op":"alloc","bytes":18446744073709551615})");
  ASSERT_FALSE(huge.is_ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted) << huge.status().to_string();
  ASSERT_TRUE(c->free(a->region).is_ok());
  EXPECT_EQ(node->stats().regions, 0);
  auto again = c->free(a->region);
  EXPECT_EQ(again.code(), StatusCode::kNotFound) << again.to_string();
}

TEST(KvNodeControl, AClientRefusesANodeOfAnotherProtocolVersion) {
  // A release-1 node answers hello without a version; its regions have no keys.
  const auto old =
      nlohmann::json::parse(R"({"ok":true,"node":"n:1","capacity":10,"free":10,"worker_address":"0a"})");
  auto h = parse_hello_reply(old, "n:1");
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(h.status().message().find("kv node n:1 speaks control protocol 1, this client 5"),
            std::string::npos)
      << h.status().to_string();
  auto current = nlohmann::json::parse(old.dump());
  current["version"] = kControlVersion;
  EXPECT_FALSE(parse_hello_reply(current, "n:1").is_ok());  // "auth" is required from version 4
  current["auth"] = "none";
  current["quota"] = 0u;
  EXPECT_FALSE(parse_hello_reply(current, "n:1").is_ok());  // "rma" is required from version 3
  current["rma"] = false;
  EXPECT_TRUE(parse_hello_reply(current, "n:1").is_ok());
  const auto keyless =
      nlohmann::json::parse(R"({"ok":true,"region":1,"address":4096,"bytes":4096,"rkey":"ff"})");
  auto a = parse_alloc_reply(keyless, "n:1");
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("'key'"), std::string::npos) << a.status().to_string();
}

TEST(KvNodeControl, RegionsOfAClosedConnectionAreFreed) {
  auto node = start_node(1 << 20);
  ASSERT_NE(node, nullptr);
  {
    auto c = connect(*node);
    ASSERT_TRUE(c->allocate(500000).is_ok());
    EXPECT_EQ(node->stats().regions, 1);
  }
  for (int i = 0; i < 200 && node->stats().regions != 0; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(node->stats().regions, 0);
  EXPECT_EQ(node->stats().used, 0u);
}

TEST(KvNodeControl, NobodyListeningIsUnavailableNamingTheEndpoint) {
  uint16_t port = 0;
  {
    auto node = start_node(1 << 20);
    port = node->port();
  }  // stopped: the port is free again
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", port}, 1s);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << c.status().to_string();
}

TEST(KvNodeControl, EndpointsAreValidated) {
  EXPECT_TRUE(parse_endpoint("10.0.0.1:7000").is_ok());
  EXPECT_FALSE(parse_endpoint("10.0.0.1").is_ok());
  EXPECT_FALSE(parse_endpoint(":7000").is_ok());
  EXPECT_FALSE(parse_endpoint("h:70000").is_ok());
  EXPECT_FALSE(parse_endpoint("h:0").is_ok());
  EXPECT_TRUE(parse_endpoint("h:0", true).is_ok());
  EXPECT_FALSE(parse_endpoint("h:12x").is_ok());
}

// The conformance suite (tests/transport/transport_conformance.h) over node-side gather / scatter:
// each rig is a KV node of its own, a client holding one region and a UcxRemoteTransport serving
// it as the one remote tier kConformanceRemote. What follows is UCX's own: merged rows, the
// served tier's size, replicas, fail-over, rejoin, the router over two transports.
constexpr TierId kConformanceRemote{77};
constexpr uint64_t kConformanceBytes = 1 << 20;  // TransportCase::batch_bytes, the largest tier

class UcxRig : public transport_conformance::TransportRig {
 public:
  static std::unique_ptr<transport_conformance::TransportRig> make() {
    auto rig = std::make_unique<UcxRig>();
    rig->node_ = start_node(2 * kConformanceBytes);
    if (rig->node_ == nullptr) return nullptr;
    rig->client_ = connect(*rig->node_);
    if (rig->client_ == nullptr) return nullptr;
    auto region = rig->client_->allocate(kConformanceBytes);
    EXPECT_TRUE(region.is_ok()) << region.status().to_string();
    if (!region.is_ok()) return nullptr;
    auto t = UcxRemoteTransport::create(
        {kConformanceRemote, {*region}, std::chrono::milliseconds(3000), UcxTransferMode::kNodeGather});
    EXPECT_TRUE(t.is_ok()) << t.status().to_string();
    if (!t.is_ok()) return nullptr;
    rig->ucx_ = std::move(t).value();
    return rig;
  }
  Transport& transport() override { return *ucx_; }

 private:
  // Destroyed in reverse: the transport, then the client (freeing the region), then the node.
  std::unique_ptr<KvNode> node_;
  std::unique_ptr<KvNodeClient> client_;
  std::unique_ptr<UcxRemoteTransport> ucx_;
};

INSTANTIATE_TEST_SUITE_P(Ucx, TransportConformance,
                         ::testing::Values(TransportCase{.name = "ucx(node_gather)",
                                                         .make = UcxRig::make,
                                                         .unavailable = "the KV node or transport did not start",
                                                         .remote_tier = kConformanceRemote}),
                         transport_conformance::transport_case_name);

// Every data-path case runs with the node-side gather / scatter; one-sided RMA is refused
// (kv_node_hostile_test.cc).
class UcxTransport : public ::testing::TestWithParam<UcxTransferMode> {};
INSTANTIATE_TEST_SUITE_P(Modes, UcxTransport, ::testing::Values(UcxTransferMode::kNodeGather),
                         [](const auto& info) {
                           return info.param == UcxTransferMode::kRma ? "Rma" : "NodeGather";
                         });

// Rows adjacent on both sides become one operation whatever order the batch gives them in;
// each replica counts what it served.
TEST_P(UcxTransport, AdjacentRowsBecomeOneOperation) {
  auto node = start_node();
  ASSERT_NE(node, nullptr);
  constexpr uint64_t kBytes = 1 << 20;
  Rig rig = make_rig(GetParam(), {node.get()}, kBytes, 2 * kBytes);
  const auto src = random_bytes<uint8_t>(kBytes, 7);
  std::memcpy(rig.local.data(), src.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  const auto before = rig.ucx->counts();
  TransferBatch rows;
  for (uint64_t i = 0; i < 512; ++i) rows.push_back({kRemote, i * 128, kLocal, kBytes + i * 128, 128});
  std::mt19937 rng(3);
  std::shuffle(rows.begin(), rows.end(), rng);
  ASSERT_TRUE(run_batch(*rig.ucx, rows).is_ok());
  EXPECT_EQ(0, std::memcmp(rig.local.data() + kBytes, src.data(), 512 * 128));
  const auto after = rig.ucx->counts();
  EXPECT_EQ(after.requests - before.requests, 512);
  EXPECT_EQ(after.operations - before.operations, 1);
  EXPECT_EQ(rig.ucx->replicas()[0].bytes_written, kBytes);
  EXPECT_EQ(rig.ucx->replicas()[0].bytes_read, 512u * 128);
}

// Pairs are local -> remote and remote -> local between host / pinned host and the served tier
// (the suite checks that behaviour matches this); the served tier may not exceed its region.
TEST_P(UcxTransport, AdvertisesLocalRemotePairsAndRefusesATierLargerThanItsRegion) {
  auto node = start_node();
  ASSERT_NE(node, nullptr);
  auto c = connect(*node);
  ASSERT_NE(c, nullptr);
  UcxRemoteConfig cfg;
  cfg.tier = TierId(3);
  cfg.mode = GetParam();
  cfg.replicas.push_back(*c->allocate(4096));
  auto small = UcxRemoteTransport::create(cfg);
  ASSERT_TRUE(small.is_ok()) << small.status().to_string();
  const Capabilities caps = (*small)->capabilities();
  EXPECT_TRUE(caps.remote);
  for (MemoryKind a :
       {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice, MemoryKind::kRemote}) {
    for (MemoryKind b :
         {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice, MemoryKind::kRemote}) {
      const bool expect = (a == MemoryKind::kRemote) != (b == MemoryKind::kRemote) &&
                          a != MemoryKind::kDevice && b != MemoryKind::kDevice;
      EXPECT_EQ(caps.supports(a, b), expect) << memory_kind_name(a) << "->" << memory_kind_name(b);
    }
  }
  const Status big = (*small)->register_tier(TierId(3), MemoryKind::kRemote, nullptr, 1 << 20);
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted) << big.to_string();
  EXPECT_NE(big.message().find(cfg.replicas[0].node), std::string::npos) << big.to_string();
  EXPECT_TRUE((*small)->register_tier(TierId(3), MemoryKind::kRemote, nullptr, 4096).is_ok());
}

TEST_P(UcxTransport, ReplicasReceiveEveryWriteAndReadsFailOverWhenANodeStops) {
  auto a = start_node();
  auto b = start_node();
  ASSERT_TRUE(a && b);
  constexpr uint64_t kBytes = 256 << 10;
  Rig rig = make_rig(GetParam(), {a.get(), b.get()}, kBytes, 2 * kBytes);
  const auto src = random_bytes<uint8_t>(kBytes, 11);
  std::memcpy(rig.local.data(), src.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  for (const auto& r : rig.ucx->replicas()) EXPECT_EQ(r.bytes_written, kBytes) << r.node;
  a->stop();  // the primary dies
  std::memset(rig.local.data() + kBytes, 0, kBytes);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = run_batch(*rig.ucx, {{kRemote, 0, kLocal, kBytes, kBytes}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(0, std::memcmp(rig.local.data() + kBytes, src.data(), kBytes));
  const auto reps = rig.ucx->replicas();
  EXPECT_FALSE(reps[0].alive);
  EXPECT_FALSE(reps[0].error.empty());
  EXPECT_TRUE(reps[1].alive);
  EXPECT_EQ(rig.ucx->failovers(), 1);
  EXPECT_LT(seconds, 3.0) << "fail-over waited for the op timeout instead of the reset";
  EXPECT_FALSE(rig.ucx->tier_lost(kRemote));
  EXPECT_EQ(rig.ucx->tier_loss(kRemote), "") << "one replica lives: nothing is lost";
  // Writes now go to the survivor only, and read back.
  const auto src2 = random_bytes<uint8_t>(kBytes, 12);
  std::memcpy(rig.local.data(), src2.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  ASSERT_TRUE(run_batch(*rig.ucx, {{kRemote, 0, kLocal, kBytes, kBytes}}).is_ok());
  EXPECT_EQ(0, std::memcmp(rig.local.data() + kBytes, src2.data(), kBytes));
  // The last replica dies: a clear error naming both nodes, no hang.
  b->stop();
  Status dead = run_batch(*rig.ucx, {{kRemote, 0, kLocal, kBytes, kBytes}});
  ASSERT_EQ(dead.code(), StatusCode::kUnavailable) << dead.to_string();
  EXPECT_NE(dead.message().find("no live replica"), std::string::npos) << dead.to_string();
  EXPECT_NE(dead.message().find(rig.ucx->replicas()[0].node), std::string::npos) << dead.to_string();
  EXPECT_NE(dead.message().find(rig.ucx->replicas()[1].node), std::string::npos) << dead.to_string();
  Status write_dead = run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, 64}});
  EXPECT_EQ(write_dead.code(), StatusCode::kUnavailable) << write_dead.to_string();
  // The loss, as the engine reports it (Engine::lost_tier_error), names both dead nodes and why.
  ASSERT_TRUE(rig.ucx->tier_lost(kRemote));
  const auto gone = rig.ucx->replicas();
  EXPECT_EQ(rig.ucx->tier_loss(kRemote), "no replica alive (node " + gone[0].node + ": " + gone[0].error + "; node " +
                                             gone[1].node + ": " + gone[1].error + ")");
}

TEST_P(UcxTransport, AReplicaDeadAtSetUpStartsOutDeadTheOthersServe) {
  auto a = start_node();
  auto b = start_node();
  ASSERT_TRUE(a && b);
  auto ca = connect(*a);
  auto cb = connect(*b);
  UcxRemoteConfig cfg{kRemote, {*ca->allocate(65536), *cb->allocate(65536)}, 3000ms, GetParam()};
  a->stop();
  auto t = UcxRemoteTransport::create(cfg);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  std::vector<uint8_t> host(131072);
  const auto src = random_bytes<uint8_t>(65536, 9);
  std::memcpy(host.data(), src.data(), 65536);
  ASSERT_TRUE((*t)->register_tier(kLocal, MemoryKind::kHost, host.data(), host.size()).is_ok());
  ASSERT_TRUE((*t)->register_tier(kRemote, MemoryKind::kRemote, nullptr, 65536).is_ok());
  ASSERT_TRUE(run_batch(**t, {{kLocal, 0, kRemote, 0, 65536}}).is_ok());
  ASSERT_TRUE(run_batch(**t, {{kRemote, 0, kLocal, 65536, 65536}}).is_ok());
  EXPECT_EQ(0, std::memcmp(host.data() + 65536, src.data(), 65536));
  const auto reps = (*t)->replicas();
  EXPECT_FALSE(reps[0].alive);
  EXPECT_TRUE(reps[1].alive);
  EXPECT_EQ(reps[1].bytes_written, 65536u);
  // Both gone at set-up: create fails naming them.
  b->stop();
  auto none = UcxRemoteTransport::create(cfg);
  if (!none.is_ok()) {
    EXPECT_EQ(none.status().code(), StatusCode::kUnavailable) << none.status().to_string();
  } else {
    // UCX may connect lazily; then the first transfer finds both dead.
    ASSERT_TRUE((*none)->register_tier(kLocal, MemoryKind::kHost, host.data(), host.size()).is_ok());
    ASSERT_TRUE((*none)->register_tier(kRemote, MemoryKind::kRemote, nullptr, 65536).is_ok());
    Status s = run_batch(**none, {{kRemote, 0, kLocal, 0, 64}});
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  }
}

// A region is freed when its client goes; the next client given the same range reads zeros.
TEST_P(UcxTransport, ARegionFreedAndGivenAgainReadsZerosNotTheLastClientsBytes) {
  auto node = start_node(1 << 20);
  ASSERT_NE(node, nullptr);
  constexpr uint64_t kBytes = 256 << 10;
  uint64_t first_address = 0;
  {
    Rig rig = make_rig(GetParam(), {node.get()}, kBytes, kBytes);
    const auto bytes = random_bytes<uint8_t>(kBytes, 5);
    std::memcpy(rig.local.data(), bytes.data(), kBytes);
    ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
    auto probe = rig.clients[0]->allocate(4096);  // where the allocator starts: right after the tier
    ASSERT_TRUE(probe.is_ok());
    first_address = probe->address - kBytes;
  }
  for (int i = 0; i < 200 && node->stats().regions != 0; ++i) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(node->stats().regions, 0);
  auto c = connect(*node);
  const RemoteRegion again = *c->allocate(kBytes);
  ASSERT_EQ(again.address, first_address);  // first fit: the same range
  auto t = UcxRemoteTransport::create({kRemote, {again}, 3000ms, GetParam()});
  ASSERT_TRUE(t.is_ok());
  std::vector<uint8_t> host(kBytes, 0x77);
  ASSERT_TRUE((*t)->register_tier(kLocal, MemoryKind::kHost, host.data(), kBytes).is_ok());
  ASSERT_TRUE((*t)->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(run_batch(**t, {{kRemote, 0, kLocal, 0, kBytes}}).is_ok());
  EXPECT_EQ(host, std::vector<uint8_t>(kBytes, 0));
}

TEST_P(UcxTransport, RouterSendsEachRemoteTierToItsOwnNode) {
  auto a = start_node();
  auto b = start_node();
  ASSERT_TRUE(a && b);
  auto ca = connect(*a);
  auto cb = connect(*b);
  UcxRemoteConfig cfg_a{TierId(2), {*ca->allocate(65536)}, 3000ms, GetParam()};
  UcxRemoteConfig cfg_b{TierId(3), {*cb->allocate(65536)}, 3000ms, GetParam()};
  auto ta = UcxRemoteTransport::create(cfg_a);
  auto tb = UcxRemoteTransport::create(cfg_b);
  ASSERT_TRUE(ta.is_ok() && tb.is_ok());
  transport::LocalTransport local;
  auto router = transport::TransportRouter::create({&local, ta->get(), tb->get()});
  ASSERT_TRUE(router.is_ok());
  std::vector<uint8_t> host(65536 * 2);
  const auto src = random_bytes<uint8_t>(65536, 5);
  std::memcpy(host.data(), src.data(), 65536);
  ASSERT_TRUE((*router)->register_tier(TierId(1), MemoryKind::kHost, host.data(), host.size()).is_ok());
  ASSERT_TRUE((*router)->register_tier(TierId(2), MemoryKind::kRemote, nullptr, 65536).is_ok());
  ASSERT_TRUE((*router)->register_tier(TierId(3), MemoryKind::kRemote, nullptr, 65536).is_ok());
  EXPECT_EQ(*(*router)->route({TierId(1), 0, TierId(2), 0, 8}), 1u);
  EXPECT_EQ(*(*router)->route({TierId(3), 0, TierId(1), 0, 8}), 2u);
  ASSERT_TRUE(
      run_batch(**router, {{TierId(1), 0, TierId(2), 0, 65536}, {TierId(1), 0, TierId(3), 0, 32768}}).is_ok());
  ASSERT_TRUE(
      run_batch(**router, {{TierId(2), 0, TierId(1), 65536, 32768}, {TierId(3), 0, TierId(1), 98304, 32768}})
          .is_ok());
  EXPECT_EQ(0, std::memcmp(host.data() + 65536, src.data(), 32768));
  EXPECT_EQ(0, std::memcmp(host.data() + 98304, src.data(), 32768));
  EXPECT_EQ((*ta)->replicas()[0].bytes_written, 65536u);
  EXPECT_EQ((*tb)->replicas()[0].bytes_written, 32768u);
}

// What a tier holds, read back through the transport in one transfer.
std::vector<uint8_t> read_tier(Rig& rig, uint64_t bytes) {
  std::memset(rig.local.data(), 0, bytes);
  Status s = run_batch(*rig.ucx, {{kRemote, 0, kLocal, 0, bytes}});
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return {rig.local.begin(), rig.local.begin() + static_cast<std::ptrdiff_t>(bytes)};
}

TEST_P(UcxTransport, ADeadReplicaRejoinsWithTheWholeTierAndServesWhenTheOtherDies) {
  auto a = start_node(16 << 20);
  auto b = start_node(16 << 20);
  ASSERT_TRUE(a && b);
  constexpr uint64_t kBytes = 6 << 20;  // more than one of rejoin's 4 MiB copies
  Rig rig = make_rig(GetParam(), {a.get(), b.get()}, kBytes, kBytes);
  std::vector<uint8_t> expect = random_bytes<uint8_t>(kBytes, 21);
  std::memcpy(rig.local.data(), expect.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  b->stop();
  // Written while b is down: only a holds it, so a stale copy of b would be caught below.
  const auto later = random_bytes<uint8_t>(kBytes / 2, 22);
  std::memcpy(rig.local.data(), later.data(), later.size());
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, kBytes / 3, later.size()}}).is_ok());
  std::copy(later.begin(), later.end(), expect.begin() + kBytes / 3);
  ASSERT_FALSE(rig.ucx->replicas()[1].alive);

  auto c = start_node(16 << 20);
  ASSERT_NE(c, nullptr);
  auto cc = connect(*c);
  const RemoteRegion region = *cc->allocate(kBytes);
  // Refusals leave everything as it was.
  EXPECT_EQ(rig.ucx->rejoin(0, region).code(), StatusCode::kInvalidArgument);  // alive
  EXPECT_EQ(rig.ucx->rejoin(2, region).code(), StatusCode::kInvalidArgument);  // no such replica
  RemoteRegion small = *cc->allocate(kBytes / 2);
  EXPECT_EQ(rig.ucx->rejoin(1, small).code(), StatusCode::kResourceExhausted);
  {
    // A transfer in flight chose its replicas when posted: rejoin must wait for it.
    auto h = rig.ucx->prepare({{kRemote, 0, kLocal, 0, kBytes}});
    ASSERT_TRUE(h.is_ok());
    Status posted = rig.ucx->post(*h);
    if (posted.code() == StatusCode::kInProgress) {
      EXPECT_EQ(rig.ucx->rejoin(1, region).code(), StatusCode::kInProgress);
    }
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (posted.code() == StatusCode::kInProgress && std::chrono::steady_clock::now() < deadline)
      posted = rig.ucx->poll(*h);
    EXPECT_TRUE(posted.is_ok()) << posted.to_string();
    rig.ucx->release(*h);
  }
  EXPECT_FALSE(rig.ucx->replicas()[1].alive);

  Status joined = rig.ucx->rejoin(1, region);
  ASSERT_TRUE(joined.is_ok()) << joined.to_string();
  auto reps = rig.ucx->replicas();
  EXPECT_TRUE(reps[1].alive);
  EXPECT_TRUE(reps[1].error.empty());
  EXPECT_EQ(reps[1].rejoins, 1);
  EXPECT_EQ(reps[1].bytes_resynced, kBytes);
  EXPECT_EQ(reps[1].node, region.node);
  // Writes go to both again.
  const auto last = random_bytes<uint8_t>(4096, 23);
  std::memcpy(rig.local.data(), last.data(), last.size());
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, kBytes - 4096, 4096}}).is_ok());
  std::copy(last.begin(), last.end(), expect.end() - 4096);
  // Its first life's write, the copy, and this one.
  EXPECT_EQ(rig.ucx->replicas()[1].bytes_written, kBytes + kBytes + 4096);

  a->stop();  // the tier now lives on the rejoined replica only
  EXPECT_TRUE(read_tier(rig, kBytes) == expect);
  reps = rig.ucx->replicas();
  EXPECT_FALSE(reps[0].alive);
  EXPECT_TRUE(reps[1].alive);
  // Nothing lives to copy from: a dead replica cannot rejoin.
  c->stop();
  EXPECT_EQ(run_batch(*rig.ucx, {{kRemote, 0, kLocal, 0, 64}}).code(), StatusCode::kUnavailable);
  auto d = start_node(16 << 20);
  ASSERT_NE(d, nullptr);
  auto cd = connect(*d);
  Status lost = rig.ucx->rejoin(0, *cd->allocate(kBytes));
  EXPECT_EQ(lost.code(), StatusCode::kUnavailable) << lost.to_string();
  EXPECT_NE(lost.message().find("no live replica"), std::string::npos) << lost.to_string();
}

TEST(ReplicaHealer, ANodeRestartedAtItsAddressIsFilledAndUsedAgain) {
  auto a = start_node();
  auto b = start_node();
  ASSERT_TRUE(a && b);
  const uint16_t port_b = b->port();
  constexpr uint64_t kBytes = 512 << 10;
  Rig rig = make_rig(UcxTransferMode::kNodeGather, {a.get(), b.get()}, kBytes, kBytes);
  HealerOptions ho;
  ho.retry_interval = 20ms;
  ho.timeout = 2000ms;
  ReplicaHealer healer(ho);
  healer.watch(rig.ucx.get(), {Endpoint{"127.0.0.1", a->port()}, Endpoint{"127.0.0.1", port_b}}, kBytes,
               std::move(rig.clients));
  std::vector<uint8_t> expect = random_bytes<uint8_t>(kBytes, 31);
  std::memcpy(rig.local.data(), expect.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  healer.maintain();  // all alive: nothing to do
  EXPECT_TRUE(healer.events().empty());

  b->stop();
  expect = random_bytes<uint8_t>(kBytes, 32);
  std::memcpy(rig.local.data(), expect.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  ASSERT_FALSE(rig.ucx->replicas()[1].alive);
  // While the node is down, attempts fail (and are recorded) without disturbing transfers.
  const auto down_until = std::chrono::steady_clock::now() + 10s;
  while (healer.events().empty() && std::chrono::steady_clock::now() < down_until) {
    healer.maintain();
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_FALSE(healer.events().empty());
  EXPECT_FALSE(healer.events()[0].rejoined);
  EXPECT_NE(healer.events()[0].message.find("127.0.0.1:" + std::to_string(port_b)), std::string::npos)
      << healer.events()[0].message;
  EXPECT_FALSE(rig.ucx->replicas()[1].alive);
  // Attempts that fail alike are one event: the log does not grow while the node stays down.
  const size_t logged = healer.events().size();
  const auto retry_until = std::chrono::steady_clock::now() + 10s;
  while (healer.events().back().attempts < 3 && std::chrono::steady_clock::now() < retry_until) {
    healer.maintain();
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_GE(healer.events().back().attempts, 3);
  EXPECT_EQ(healer.events().size(), logged);

  auto restarted = start_node(8 << 20, port_b);
  ASSERT_NE(restarted, nullptr);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!rig.ucx->replicas()[1].alive && std::chrono::steady_clock::now() < deadline) {
    healer.maintain();
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(rig.ucx->replicas()[1].alive);
  EXPECT_TRUE(healer.events().back().rejoined);
  EXPECT_EQ(rig.ucx->replicas()[1].rejoins, 1);
  EXPECT_EQ(restarted->stats().regions, 1);
  EXPECT_EQ(restarted->stats().bytes_scattered, kBytes);  // the copy
  a->stop();
  EXPECT_TRUE(read_tier(rig, kBytes) == expect);
  EXPECT_EQ(restarted->stats().bytes_gathered, kBytes);
  rig.ucx.reset();  // transports go before the healer's sessions (and with them the regions)
}

TEST(ReplicaHealer, ADeadReplicaWhoseNodeStaysDownMovesToASpare) {
  auto a = start_node();
  auto b = start_node();
  auto spare = start_node();
  ASSERT_TRUE(a && b && spare);
  const Endpoint ea{"127.0.0.1", a->port()}, eb{"127.0.0.1", b->port()}, es{"127.0.0.1", spare->port()};
  constexpr uint64_t kBytes = 256 << 10;
  Rig rig = make_rig(UcxTransferMode::kNodeGather, {a.get(), b.get()}, kBytes, kBytes);
  HealerOptions ho;
  ho.retry_interval = 20ms;
  ho.timeout = 2000ms;
  ho.spares = {ea, es};  // a holds a replica of the tier already: never a spare for it
  ReplicaHealer healer(ho);
  healer.watch(rig.ucx.get(), {ea, eb}, kBytes, std::move(rig.clients));
  const std::vector<uint8_t> expect = random_bytes<uint8_t>(kBytes, 41);
  std::memcpy(rig.local.data(), expect.data(), kBytes);
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  b->stop();  // and stays down
  ASSERT_TRUE(run_batch(*rig.ucx, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!rig.ucx->replicas()[1].alive && std::chrono::steady_clock::now() < deadline) {
    healer.maintain();
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_TRUE(rig.ucx->replicas()[1].alive);
  ASSERT_FALSE(healer.events().empty());
  EXPECT_TRUE(healer.events().back().rejoined);
  EXPECT_EQ(healer.events().back().node, es.text());
  EXPECT_EQ(a->stats().regions, 1);  // a was not given a second copy
  EXPECT_EQ(spare->stats().regions, 1);
  a->stop();
  EXPECT_TRUE(read_tier(rig, kBytes) == expect);
  rig.ucx.reset();
}

}  // namespace
}  // namespace specontext::cluster
