// What one client of a KV node can reach of another's KV, tried as a hostile client would: with
// the control protocol's JSON and UCX's own API, not only through the project's client classes.
//   - No region comes with a UCX remote key, and one-sided RMA at another client's region, with
//     the attacker's own region's key or a key it forged, reads and writes nothing there (the
//     node's worker has no UCP_FEATURE_RMA, whose software RMA handlers copy to and from any
//     address; UCX over TCP checks no key).
//   - The client refuses --kv-node-mode rma over transports that check no remote key.
//   - Region keys are 128 random bits and region ids random, so neither follows from the ones a
//     client has seen (a key off by one bit is refused: UcxNodeGather.AClientReachesOnlyItsOwnRegion).
#include <gtest/gtest.h>

#include <ucp/api/ucp.h>

#include <bit>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "cluster/kv_node.h"
#include "cluster/kv_node_client.h"
#include "tests/cluster/kv_node_test_util.h"
#include "tests/transport/transport_test_util.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {
namespace {

using transport::RemoteRegion;
using transport::UcxRemoteTransport;
using transport::UcxTransferMode;
using namespace std::chrono_literals;

constexpr TierId kLocal{1};
constexpr TierId kRemote{2};

using testing::connect;
using testing::start_node;
using transport_conformance::run_batch;

// A UCX worker of the attacker's own, with RMA (as any client may build one), over TCP.
class RawUcx {
 public:
  RawUcx() {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    EXPECT_EQ(ucp_config_modify(config, "TLS", "tcp"), UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
  }
  ~RawUcx() {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    if (ep_ != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &p);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
        ucp_request_free(r);
      }
    }
    for (void* r : unanswered_) ucp_request_free(r);  // released now, or when UCX completes it
    if (own_memory_ != nullptr) ucp_mem_unmap(context_, own_memory_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  void connect(const std::vector<uint8_t>& node_address) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(node_address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ASSERT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  // The key the node handed out with the attacker's own region, or, when it hands out none, one
  // forged from a registration of the attacker's own memory (UCX accepts it for any endpoint).
  void use_key(const std::vector<uint8_t>& packed) {
    std::vector<uint8_t> key = packed;
    if (key.empty()) {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = own_.data();
      mp.length = own_.size();
      ASSERT_EQ(ucp_mem_map(context_, &mp, &own_memory_), UCS_OK);
      void* buf = nullptr;
      size_t len = 0;
      ASSERT_EQ(ucp_rkey_pack(context_, own_memory_, &buf, &len), UCS_OK);
      key.assign(static_cast<uint8_t*>(buf), static_cast<uint8_t*>(buf) + len);
      ucp_rkey_buffer_release(buf);
    }
    ASSERT_EQ(ucp_ep_rkey_unpack(ep_, key.data(), &rkey_), UCS_OK);
  }
  // Runs a get / put / flush for at most `limit`; whether it completed with UCS_OK. A request the
  // node never answers is cancelled.
  bool run(ucs_status_ptr_t r, std::chrono::milliseconds limit) {
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (ucp_request_check_status(r) == UCS_INPROGRESS) {
      unanswered_.push_back(r);  // completed (cancelled) when the endpoint is closed
      return false;
    }
    const bool ok = ucp_request_check_status(r) == UCS_OK;
    ucp_request_free(r);
    return ok;
  }
  bool get(void* out, size_t bytes, uint64_t address) {
    ucp_request_param_t p{};
    return run(ucp_get_nbx(ep_, out, bytes, address, rkey_, &p), 2000ms);
  }
  bool put_and_flush(const void* in, size_t bytes, uint64_t address) {
    ucp_request_param_t p{};
    const bool sent = run(ucp_put_nbx(ep_, in, bytes, address, rkey_, &p), 2000ms);
    ucp_request_param_t f{};
    const bool flushed = run(ucp_ep_flush_nbx(ep_, &f), 2000ms);  // the node's acknowledgement
    return sent && flushed;
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  ucp_mem_h own_memory_ = nullptr;
  std::vector<void*> unanswered_;
  std::vector<uint8_t> own_ = std::vector<uint8_t>(65536);
};

// Before: every alloc reply carried an rkey, and with it (UCX over TCP checks no RMA address)
// ucp_get_nbx / ucp_put_nbx at another client's region read and overwrote its KV.
TEST(KvNodeSecurity, NoRemoteKeyIsHandedOutAndRmaReachesNoOtherRegion) {
  auto node = start_node();
  ASSERT_NE(node, nullptr);
  auto owner = connect(*node);
  auto attacker = connect(*node);
  ASSERT_TRUE(owner && attacker);
  // The node says it serves no RMA, and why.
  auto hello = attacker->call_line(R"({"op":"hello"})");
  ASSERT_TRUE(hello.is_ok()) << hello.status().to_string();
  EXPECT_EQ(hello->value("rma", true), false) << hello->dump();
  EXPECT_NE(hello->value("rma_refused", std::string()).find("(tcp) check no remote keys"), std::string::npos)
      << hello->dump();

  // The owner's KV.
  constexpr uint64_t kBytes = 65536;
  const RemoteRegion mine = *owner->allocate(kBytes);
  std::vector<uint8_t> secret(kBytes);
  std::mt19937 rng(5);
  for (auto& b : secret) b = static_cast<uint8_t>(rng() | 1);  // never 0
  auto t = UcxRemoteTransport::create({kRemote, {mine}, 3000ms, UcxTransferMode::kNodeGather});
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  std::vector<uint8_t> local = secret;
  ASSERT_TRUE((*t)->register_tier(kLocal, MemoryKind::kHost, local.data(), kBytes).is_ok());
  ASSERT_TRUE((*t)->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(run_batch(**t, {{kLocal, 0, kRemote, 0, kBytes}}).is_ok());

  // The attacker's own region: no remote key comes with it.
  auto theirs = attacker->call_line(R"({"op":"alloc","bytes":65536})");
  ASSERT_TRUE(theirs.is_ok()) << theirs.status().to_string();
  EXPECT_FALSE(theirs->contains("rkey")) << theirs->dump();
  std::vector<uint8_t> handed_out;
  if (theirs->contains("rkey")) handed_out = *hex_decode((*theirs)["rkey"].get<std::string>(), "rkey");

  // One-sided RMA at the owner's region, with that key or a forged one.
  RawUcx ucx;
  ucx.connect(attacker->hello().worker_address);
  ucx.use_key(handed_out);
  std::vector<uint8_t> stolen(4096, 0);
  const bool got = ucx.get(stolen.data(), stolen.size(), mine.address);
  EXPECT_FALSE(got);
  EXPECT_NE(std::memcmp(stolen.data(), secret.data(), stolen.size()), 0) << "read the owner's KV";
  std::vector<uint8_t> junk(4096, 0);
  EXPECT_FALSE(ucx.put_and_flush(junk.data(), junk.size(), mine.address));
  // Past the region, anywhere in the node's memory: the same.
  EXPECT_FALSE(ucx.get(stolen.data(), 64, mine.address + (1 << 20)));

  // The owner's KV is as it wrote it.
  std::fill(local.begin(), local.end(), 0);
  ASSERT_TRUE(run_batch(**t, {{kRemote, 0, kLocal, 0, kBytes}}).is_ok());
  EXPECT_TRUE(local == secret) << "the owner's KV was overwritten";
}

// --kv-node-mode rma over TCP is refused by the client, naming the transports and what to use.
TEST(KvNodeSecurity, TheClientRefusesRmaOverTransportsThatCheckNoKey) {
  auto node = start_node();
  ASSERT_NE(node, nullptr);
  auto c = connect(*node);
  ASSERT_NE(c, nullptr);
  auto region = c->allocate(65536);
  ASSERT_TRUE(region.is_ok()) << region.status().to_string();
  auto t = UcxRemoteTransport::create({kRemote, {*region}, 3000ms, UcxTransferMode::kRma});
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  for (const char* part : {"one-sided RMA (--kv-node-mode rma) is refused", "transports (tcp)",
                           "do not check remote keys", "use --kv-node-mode gather"}) {
    EXPECT_NE(t.status().message().find(part), std::string::npos) << t.status().message();
  }
  // The gather path over the same region works.
  EXPECT_TRUE(UcxRemoteTransport::create({kRemote, {*region}, 3000ms, UcxTransferMode::kNodeGather}).is_ok());
}

// Before: keys came from std::mt19937_64 (64 bits; its state follows from 312 outputs) and region
// ids counted 1, 2, 3, ...
TEST(KvNodeSecurity, RegionKeysAre128RandomBitsAndRegionIdsAreUnguessable) {
  std::set<std::string> keys;
  std::set<uint64_t> ids;
  std::vector<uint64_t> in_order;
  int64_t ones = 0;
  for (int n = 0; n < 2; ++n) {
    auto node = start_node();
    ASSERT_NE(node, nullptr);
    for (int conn = 0; conn < 2; ++conn) {
      auto c = connect(*node);
      ASSERT_NE(c, nullptr);
      for (int i = 0; i < 8; ++i) {
        auto a = c->call_line(R"({"op":"alloc","bytes":4096})");
        ASSERT_TRUE(a.is_ok()) << a.status().to_string();
        ASSERT_TRUE((*a)["key"].is_string()) << a->dump();
        const std::string key = (*a)["key"].get<std::string>();
        ASSERT_EQ(key.size(), 32u) << key;  // 128 bits as hex
        auto bytes = hex_decode(key, "key");
        ASSERT_TRUE(bytes.is_ok()) << key;
        for (uint8_t b : *bytes) ones += std::popcount(b);
        keys.insert(key);
        ASSERT_TRUE((*a)["region"].is_number_unsigned()) << a->dump();
        const uint64_t id = (*a)["region"].get<uint64_t>();
        ids.insert(id);
        in_order.push_back(id);
        // The id frees the region.
        if (i == 7) {
          EXPECT_TRUE(c->free(id).is_ok());
        }
      }
      // The typed client reads the same form.
      auto r = c->allocate(4096);
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    }
  }
  EXPECT_EQ(keys.size(), 32u);  // all differ, across regions, connections and nodes
  EXPECT_EQ(ids.size(), 32u);
  // 4096 random bits: 2048 ones give or take 32 (one standard deviation).
  EXPECT_GT(ones, 2048 - 6 * 32);
  EXPECT_LT(ones, 2048 + 6 * 32);
  // Not a count: no two ids within 2^32 of each other (for random ids, about 1 in 10^7 runs).
  for (uint64_t a : ids) {
    for (uint64_t b : ids) {
      if (a != b) {
        EXPECT_GT(a > b ? a - b : b - a, uint64_t{1} << 32) << a << " " << b;
      }
    }
  }
}

}  // namespace
}  // namespace specontext::cluster
