// RemotePrefixStore (cluster/remote_prefix_store.h): blobs in KV node memory, bit-exact through a
// staging buffer smaller than they are, mirrored with fail-over; and the scheduler's prefix
// offload store using it as its lower level, down to a node that dies.
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <vector>

#include "cluster/kv_node.h"
#include "cluster/remote_prefix_store.h"
#include "core/model/model_loader.h"
#include "serving/generator.h"
#include "serving/scheduler.h"
#include "tests/core/tier_test_util.h"
#include "tests/serving/scheduler_test_util.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

using testing::alone;
using testing::run_request;
using testing::story_prompt;

using namespace std::chrono_literals;

std::unique_ptr<KvNode> start_node(uint64_t capacity) {
  KvNodeOptions o;
  o.capacity = capacity;
  auto node = KvNode::start(o);
  EXPECT_TRUE(node.is_ok()) << node.status().to_string();
  return node.is_ok() ? std::move(node).value() : nullptr;
}

std::unique_ptr<RemotePrefixStore> make_store(const std::vector<KvNode*>& nodes, uint64_t bytes,
                                              uint64_t staging = uint64_t{8} << 20,
                                              std::vector<std::string>* events = nullptr) {
  RemotePrefixStoreOptions o;
  if (events != nullptr) o.on_event = [events](const std::string& line) { events->push_back(line); };
  for (KvNode* n : nodes) o.replicas.push_back(Endpoint{"127.0.0.1", n->port()});
  o.bytes = bytes;
  o.staging_bytes = staging;
  o.timeout = 2000ms;
  auto s = RemotePrefixStore::create(o);
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? std::move(s).value() : nullptr;
}

std::vector<std::byte> random_blob(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

TEST(RemotePrefixStore, BlobsLargerThanTheStagingBufferRoundTripBitExact) {
  auto node = start_node(1 << 20);
  ASSERT_TRUE(node);
  auto store = make_store({node.get()}, 256 << 10, /*staging=*/4096);
  ASSERT_TRUE(store);
  EXPECT_EQ(store->capacity(), uint64_t{256} << 10);
  EXPECT_NE(store->name().find(std::to_string(node->port())), std::string::npos) << store->name();
  std::vector<std::pair<uint64_t, std::vector<std::byte>>> held;
  for (size_t n : {1u, 4095u, 4096u, 4097u, 50000u, 100000u}) {
    auto blob = random_blob(n, static_cast<uint32_t>(n));
    auto key = store->put(blob);
    ASSERT_TRUE(key.is_ok()) << key.status().to_string();
    held.emplace_back(*key, std::move(blob));
  }
  EXPECT_EQ(store->blobs(), held.size());
  for (const auto& [key, blob] : held) {
    auto back = store->get(key);
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(*back, blob) << "key " << key;
  }
  // Full: the next large one does not fit until one is removed.
  EXPECT_EQ(store->put(random_blob(100000, 9)).status().code(), StatusCode::kResourceExhausted);
  store->remove(held.back().first);
  EXPECT_EQ(store->get(held.back().first).status().code(), StatusCode::kNotFound);
  store->remove(held.back().first);  // twice: ignored
  auto again = store->put(random_blob(100000, 9));
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(*store->get(*again), random_blob(100000, 9));
  EXPECT_EQ(store->put({}).status().code(), StatusCode::kInvalidArgument);
}

TEST(RemotePrefixStore, AMirroredStoreReadsFromTheSurvivorAndFailsCleanlyWhenNoneLives) {
  auto a = start_node(1 << 20);
  auto b = start_node(1 << 20);
  ASSERT_TRUE(a && b);
  std::vector<std::string> events;
  auto store = make_store({a.get(), b.get()}, 128 << 10, 8192, &events);
  ASSERT_TRUE(store);
  const std::string node_a = "127.0.0.1:" + std::to_string(a->port());
  const std::string node_b = "127.0.0.1:" + std::to_string(b->port());
  const auto blob = random_blob(30000, 5);
  auto key = store->put(blob);
  ASSERT_TRUE(key.is_ok()) << key.status().to_string();
  EXPECT_EQ(store->replica_counts().replicas, 2);
  EXPECT_EQ(store->replica_counts().live, 2);
  EXPECT_TRUE(events.empty());
  a->stop();
  auto back = store->get(*key);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, blob);
  // The death is told once, naming the node and where the level goes on, and counted.
  ASSERT_TRUE(store->put(blob).is_ok());
  EXPECT_EQ(store->replica_counts().live, 1);
  EXPECT_EQ(store->replica_counts().deaths, 1);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].rfind("kv-node: tier prefix offload (--prefix-offload-remote): replica 0 on " + node_a +
                                " is dead (",
                            0),
            0u)
      << events[0];
  EXPECT_NE(events[0].find("the tier goes on on " + node_b), std::string::npos) << events[0];
  b->stop();
  const auto t0 = std::chrono::steady_clock::now();
  auto lost = store->get(*key);
  EXPECT_EQ(lost.status().code(), StatusCode::kUnavailable) << lost.status().to_string();
  EXPECT_EQ(store->put(blob).status().code(), StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s) << "bounded by the timeout, no hang";
  EXPECT_EQ(store->replica_counts().live, 0);
  EXPECT_EQ(store->replica_counts().deaths, 2);
  ASSERT_EQ(events.size(), 2u);  // one loss line, not one per failed transfer
  EXPECT_EQ(events[1].rfind("kv-node: tier prefix offload (--prefix-offload-remote) lost: no replica alive (" +
                                node_a + ": ",
                            0),
            0u)
      << events[1];
  EXPECT_NE(events[1].find("; " + node_b + ": "), std::string::npos) << events[1];
  EXPECT_NE(events[1].find("their prompts computed"), std::string::npos) << events[1];
}

TEST(RemotePrefixStore, CreateNamesWhatIsWrong) {
  RemotePrefixStoreOptions o;
  o.bytes = 1 << 20;
  EXPECT_EQ(RemotePrefixStore::create(o).status().code(), StatusCode::kInvalidArgument);
  o.replicas.push_back(Endpoint{"127.0.0.1", 1});  // nothing listens there
  o.timeout = 500ms;
  auto none = RemotePrefixStore::create(o);
  EXPECT_EQ(none.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find("127.0.0.1:1"), std::string::npos) << none.status().to_string();
  auto small = start_node(1 << 16);
  ASSERT_TRUE(small);
  o.replicas = {Endpoint{"127.0.0.1", small->port()}};
  EXPECT_FALSE(RemotePrefixStore::create(o).is_ok()) << "a region larger than the node";
}

// ---- the scheduler's offload store in KV node memory ----

GenerationRequest request(std::vector<TokenId> prompt, int64_t n) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = n;
  r.sampling.temperature = 0.0f;
  return r;
}

// One sequence slot: each new conversation evicts the last one, whose prefix goes to the node
// (no host memory for the store) and comes back for its next turn; once the node is gone the
// next turn computes its prompt, with the error counted, and gets the same tokens.
TEST(RemotePrefixStore, TheSchedulersOffloadedPrefixesLiveOnTheNodeAndOutliveItsDeath) {
  auto node = start_node(64 << 20);
  ASSERT_TRUE(node);
  std::shared_ptr<RemotePrefixStore> store = make_store({node.get()}, 16 << 20);
  ASSERT_TRUE(store);
  auto engine = testing::stories_engine(1);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_blob_store = store;
  Scheduler s(*engine, go);
  const GenerationRequest a = request(story_prompt(40), 30);
  const std::vector<TokenId> ta = run_request(s, a);
  const GenerationRequest b = request({1, 426, 298}, 20);  // 22 tokens cached: 16 whole
  const std::vector<TokenId> tb = run_request(s, b);       // evicts A: to the node
  EXPECT_EQ(s.stats().prefix_disk_writes, 1);
  EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 1u);
  EXPECT_EQ(store->blobs(), 1u);
  EXPECT_GT(store->used_bytes(), engine->memory().kv_store().page_bytes() * 5 * 4) << "4 pages of 5 layers";
  GenerationRequest next = a;
  next.prompt.insert(next.prompt.end(), ta.begin(), ta.end());
  next.prompt.push_back(403);
  next.max_new_tokens = 10;
  int64_t cached = -1;
  EXPECT_EQ(run_request(s, next, &cached), alone(next));
  EXPECT_EQ(cached, 64) << "A's 4 whole pages came from the node";
  EXPECT_EQ(s.stats().prefix_disk_restores, 1);
  EXPECT_EQ(s.stats().prefix_disk_errors, 0) << s.prefix_store().last_prefix_disk_error();

  // B is on the node now (evicted for the turn); the node dies. B's next turn cannot read it
  // back, and the turn before it cannot be written there when it gives way: two errors.
  EXPECT_EQ(store->blobs(), 1u);
  node->stop();
  GenerationRequest b_next = b;
  b_next.prompt.insert(b_next.prompt.end(), tb.begin(), tb.end());
  b_next.prompt.push_back(407);
  b_next.max_new_tokens = 10;
  cached = -1;
  EXPECT_EQ(run_request(s, b_next, &cached), alone(b_next));
  EXPECT_EQ(cached, 0);
  EXPECT_EQ(s.stats().prefix_disk_restores, 1);
  EXPECT_EQ(s.stats().prefix_disk_errors, 2);
  EXPECT_NE(s.prefix_store().last_prefix_disk_error().find("kv-node"), std::string::npos)
      << s.prefix_store().last_prefix_disk_error();
  EXPECT_EQ(s.prefix_store().prefixes_on_disk(), 0u) << "the lost blob is forgotten";
  EXPECT_TRUE(engine->memory().check_invariants().is_ok());
}

TEST(RemotePrefixStore, PersistingPrefixesNeedsADirectory) {
  auto node = start_node(1 << 20);
  ASSERT_TRUE(node);
  auto engine = testing::stories_engine(1);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_blob_store = make_store({node.get()}, 1 << 16);
  go.prefix_disk_persist = true;
  go.prefix_disk_dir = ::testing::TempDir();
  Scheduler s(*engine, go);
  EXPECT_EQ(s.open_prefix_disk().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specontext::cluster
