// PrefixStore's own contract on stories260K (pages of 16 tokens: the fork unit): the longest
// cached prefix, eviction into host memory, files or blobs and back, take-over, persistence; and
// the request state machine (serving/request_state.h): the table refuses what the code never does,
// and every move it allows happens in one of the scenarios below (the Scheduler's and the store's).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <tuple>
#include <string>

#include "core/model/model_loader.h"
#include "serving/generator.h"
#include "serving/prefix_store.h"
#include "serving/request_state.h"
#include "serving/scheduler.h"
#include "tests/core/tier_test_util.h"
#include "tests/serving/scheduler_test_util.h"

namespace specontext {
namespace {

using S = RequestState;
using testing::request;
using testing::story_prompt;

// A PrefixBlobStore in a map: a KV node's memory without the node. `alive` false: get fails as
// a dead node's does.
class MemoryBlobStore : public PrefixBlobStore {
 public:
  explicit MemoryBlobStore(uint64_t capacity) : capacity_(capacity) {}
  const std::string& name() const override { return name_; }
  uint64_t capacity() const override { return capacity_; }
  Result<uint64_t> put(std::span<const std::byte> blob) override {
    if (used_ + blob.size() > capacity_) return resource_exhausted("memory blob store: full");
    used_ += blob.size();
    blobs_[next_] = std::vector<std::byte>(blob.begin(), blob.end());
    return next_++;
  }
  Result<std::vector<std::byte>> get(uint64_t key) override {
    if (!alive) return unavailable("memory blob store: gone");
    auto it = blobs_.find(key);
    if (it == blobs_.end()) return not_found("memory blob store: no blob " + std::to_string(key));
    return it->second;
  }
  void remove(uint64_t key) override {
    auto it = blobs_.find(key);
    if (it == blobs_.end()) return;
    used_ -= it->second.size();
    blobs_.erase(it);
  }
  size_t blobs() const { return blobs_.size(); }
  bool alive = true;

 private:
  std::string name_ = "memory blob store";
  uint64_t capacity_;
  uint64_t used_ = 0;
  uint64_t next_ = 1;
  std::map<uint64_t, std::vector<std::byte>> blobs_;
};

// A SharedPrefixStore in a map, for the state machine and PrefixStore's side of the contract (the
// Redis store itself is tested against a real redis-server: tests/cluster/redis_prefix_store_test.cc).
// `alive` false: every call fails as an unreachable store's does.
class MemorySharedStore : public SharedPrefixStore {
 public:
  const std::string& name() const override { return name_; }
  Status put(const PrefixKey& key, std::span<const std::byte> blob) override {
    if (!alive) return unavailable("memory shared store: gone");
    blobs_[key.text()] = std::vector<std::byte>(blob.begin(), blob.end());
    ++puts;
    return Status::ok();
  }
  Result<std::vector<std::byte>> get(const PrefixKey& key) override {
    if (!alive) return unavailable("memory shared store: gone");
    ++gets;
    auto it = blobs_.find(key.text());
    if (it == blobs_.end()) return not_found("memory shared store: no " + key.text());
    return it->second;
  }
  Result<std::vector<bool>> contains(std::span<const PrefixKey> keys) override {
    if (!alive) return unavailable("memory shared store: gone");
    ++asked;
    std::vector<bool> held;
    for (const PrefixKey& k : keys) held.push_back(blobs_.count(k.text()) > 0);
    return held;
  }
  size_t blobs() const { return blobs_.size(); }
  // What a store that evicts, or a hostile one, does to a value.
  std::vector<std::byte>& blob(const PrefixKey& key) { return blobs_.at(key.text()); }
  void erase(const PrefixKey& key) { blobs_.erase(key.text()); }
  bool alive = true;
  int asked = 0;  // contains calls that reached it
  int puts = 0;   // values written
  int gets = 0;   // values asked for

 private:
  std::string name_ = "memory shared store";
  std::map<std::string, std::vector<std::byte>> blobs_;
};

// stories260K on `slots` sequence slots and a pool of `pages` KV pages (0: enough for all).
std::unique_ptr<Engine> pool_engine(int64_t slots, int64_t pages) {
  auto m = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok());
  if (!m.is_ok()) return nullptr;
  EngineOptions eo;
  eo.max_sequences = slots;
  eo.kv_pages = pages;
  auto engine = Engine::create(*m, testing::cpu_backend(), eo);
  EXPECT_TRUE(engine.is_ok());
  return engine.is_ok() ? std::move(*engine) : nullptr;
}

// A sequence holding `tokens`' KV, computed.
SeqId computed(Engine& engine, const std::vector<TokenId>& tokens) {
  auto seq = engine.memory().add_sequence();
  EXPECT_TRUE(seq.is_ok());
  const StepRequest r{*seq, tokens, LogitsMode::kNone, nullptr, /*prompt=*/true};
  EXPECT_TRUE(engine.forward(std::span<const StepRequest>(&r, 1)).is_ok());
  return *seq;
}

// The tokens a prompt may take from the store: all but its last.
std::span<const TokenId> wanted(const std::vector<TokenId>& prompt) {
  return {prompt.data(), prompt.size() - 1};
}

// Prompts of 40 tokens (2 whole pages) that share nothing but BOS.
std::vector<TokenId> prompt_of(TokenId word, size_t n = 40) {
  std::vector<TokenId> p{1};
  while (p.size() < n) p.push_back(static_cast<TokenId>(word + static_cast<TokenId>(p.size() % 3)));
  return p;
}

uint64_t page_bytes(Engine& engine) {
  return engine.memory().kv_store().page_bytes() * 5;
}  // every layer's page

PrefixStoreOptions disk_options(uint64_t host, uint64_t lower) {
  PrefixStoreOptions o;
  o.host_bytes = host;
  o.lower_bytes = lower;
  o.disk_dir = ::testing::TempDir();
  return o;
}

// ---- PrefixStore ----

TEST(PrefixStore, TheLongestCachedPrefixInWholePagesAndTakingItOver) {
  auto engine = pool_engine(3, 0);
  ASSERT_TRUE(engine);
  PrefixStore store(*engine, PrefixStoreOptions{});
  const std::vector<TokenId> a = story_prompt(40);
  const std::vector<TokenId> b = prompt_of(426);
  store.insert(computed(*engine, a), a, S::kFinished);
  store.insert(computed(*engine, b), b, S::kFinished);
  EXPECT_EQ(store.cached_sequences(), 2u);
  // The next turn shares all 40 tokens: 2 whole pages, every whole page of a's.
  std::vector<TokenId> next = a;
  next.insert(next.end(), {403, 407, 261});
  PrefixStore::Match m = store.longest_cached(wanted(next), 0);
  EXPECT_EQ(m.tokens, 32);
  EXPECT_EQ(m.seq, store.cached().front().seq);
  EXPECT_TRUE(m.whole);
  EXPECT_EQ(store.longest_cached(wanted(next), 32).tokens, 0) << "nothing longer than the floor";
  // A prompt leaving a's at token 20: one page, not every whole page of it.
  std::vector<TokenId> branch(a.begin(), a.begin() + 20);
  branch.insert(branch.end(), 10, 500);
  m = store.longest_cached(wanted(branch), 0);
  EXPECT_EQ(m.tokens, 16);
  EXPECT_FALSE(m.whole);
  // touch: a becomes the most recently used, so b is evicted first (dropped: no levels).
  store.touch(m.seq);
  EXPECT_EQ(store.cached().back().seq, m.seq);
  ASSERT_TRUE(store.evict());
  EXPECT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(store.stats().prefix_cache_evictions, 1);
  EXPECT_EQ(store.stats().prefix_offloads, 0);
  // take: a leaves the cache cut to its first page for the request that takes it over.
  const auto taken = store.take(m.seq, 16, 0);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(engine->memory().sequence_length(*taken), 16);
  EXPECT_EQ(store.cached_sequences(), 0u);
  EXPECT_FALSE(store.evict()) << "nothing left";
  EXPECT_EQ(store.states().count(S::kFinished, S::kCached), 2);
  EXPECT_EQ(store.states().count(S::kCached, S::kDropped), 1);
  EXPECT_EQ(store.states().count(S::kCached, S::kPrefilling), 1);
  EXPECT_EQ(store.states().refused(), 0);
  (void)engine->memory().remove_sequence(*taken);
  EXPECT_TRUE(engine->memory().check_invariants().is_ok());
}

TEST(PrefixStore, TheKeptSequenceGoesLastAndOnlyWhenLetGo) {
  auto engine = pool_engine(2, 0);
  ASSERT_TRUE(engine);
  PrefixStore store(*engine, PrefixStoreOptions{});
  const std::vector<TokenId> a = story_prompt(40);
  const SeqId seq = computed(*engine, a);
  store.insert(seq, a, S::kCancelled);
  EXPECT_FALSE(store.evict(seq, /*keep_may_go=*/false));
  EXPECT_TRUE(store.evict(seq, /*keep_may_go=*/true));
  EXPECT_EQ(engine->memory().live_sequences(), 0);
  EXPECT_EQ(store.states().count(S::kCancelled, S::kCached), 1);
}

TEST(PrefixStore, AnEvictedPrefixGoesToHostMemoryAndIsRestoredIntoTheCache) {
  auto engine = pool_engine(2, 0);
  ASSERT_TRUE(engine);
  const uint64_t page = page_bytes(*engine);
  PrefixStoreOptions o;
  o.host_bytes = 4 * page;  // two prefixes of 2 pages
  PrefixStore store(*engine, o);
  const std::vector<TokenId> a = story_prompt(40);
  store.insert(computed(*engine, a), a, S::kFinished);
  ASSERT_TRUE(store.evict());
  EXPECT_EQ(store.cached_sequences(), 0u);
  EXPECT_EQ(store.offloaded_prefixes(), 1u);
  EXPECT_EQ(store.offloaded_bytes(), 2 * page);
  EXPECT_EQ(store.stats().prefix_offloads, 1);
  EXPECT_FALSE(store.longest_stored(wanted(a), 32).has_value()) << "not longer than the floor";
  const auto found = store.longest_stored(wanted(a), 0);
  ASSERT_TRUE(found.has_value());
  ASSERT_TRUE(store.restore(*found));
  EXPECT_EQ(store.offloaded_prefixes(), 0u);
  EXPECT_EQ(store.offloaded_bytes(), 0u);
  ASSERT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 32);
  EXPECT_EQ(store.stats().prefix_restores, 1);
  // Three prefixes into room for two: the oldest is dropped.
  for (TokenId w : {426, 432, 298}) {
    const std::vector<TokenId> p = prompt_of(w);
    const SeqId seq = computed(*engine, p);
    ASSERT_TRUE(store.offload(seq, p, S::kCached));
    (void)engine->memory().remove_sequence(seq);
  }
  EXPECT_EQ(store.offloaded_prefixes(), 2u);
  EXPECT_EQ(store.stats().prefix_offload_drops, 1);
  EXPECT_EQ(store.stats().prefix_offload_peak_bytes, static_cast<int64_t>(4 * page));
  EXPECT_EQ(store.states().count(S::kCached, S::kOffloaded), 4);
  EXPECT_EQ(store.states().count(S::kOffloaded, S::kCached), 1);
  EXPECT_EQ(store.states().count(S::kOffloaded, S::kDropped), 1);
  EXPECT_EQ(store.states().refused(), 0);
}

TEST(PrefixStore, HostMemoryOverflowsToFilesThatAreReadBackAndRemoved) {
  auto engine = pool_engine(4, 0);
  ASSERT_TRUE(engine);
  const uint64_t page = page_bytes(*engine);
  std::string dir;
  {
    PrefixStore store(*engine, disk_options(2 * page, uint64_t{64} << 20));  // one prefix in host memory
    const std::vector<TokenId> a = story_prompt(40), b = prompt_of(426);
    for (const auto& p : {a, b}) store.insert(computed(*engine, p), p, S::kFinished);
    ASSERT_TRUE(store.evict());
    ASSERT_TRUE(store.evict());
    EXPECT_EQ(store.offloaded_prefixes(), 1u);
    EXPECT_EQ(store.prefixes_on_disk(), 1u) << "a went to disk for b";
    EXPECT_EQ(store.stats().prefix_disk_writes, 1);
    EXPECT_GT(store.disk_bytes(), 2 * page);
    dir = store.prefix_disk_directory();
    ASSERT_FALSE(dir.empty());
    const auto found = store.longest_stored(wanted(a), 0);
    ASSERT_TRUE(found.has_value());
    ASSERT_TRUE(store.restore(*found));
    EXPECT_EQ(store.stats().prefix_disk_restores, 1);
    EXPECT_EQ(store.prefixes_on_disk(), 0u);
    EXPECT_EQ(store.disk_bytes(), 0u);
    EXPECT_EQ(store.states().count(S::kOffloaded, S::kOnDisk), 1);
    EXPECT_EQ(store.states().count(S::kOnDisk, S::kCached), 1);
    EXPECT_EQ(store.stats().prefix_disk_errors, 0) << store.last_prefix_disk_error();
    // Larger than host memory allows: straight to a file. A damaged file is dropped and counted.
    PrefixStore small(*engine, disk_options(page, uint64_t{64} << 20));
    const std::vector<TokenId> c = prompt_of(432);
    const SeqId cs = computed(*engine, c);
    ASSERT_TRUE(small.offload(cs, c, S::kCached));
    (void)engine->memory().remove_sequence(cs);
    EXPECT_EQ(small.prefixes_on_disk(), 1u);
    for (const auto& entry : std::filesystem::directory_iterator(small.prefix_disk_directory())) {
      std::filesystem::resize_file(entry.path(), 100);
    }
    EXPECT_FALSE(small.restore(0));
    EXPECT_EQ(small.stats().prefix_disk_errors, 1);
    EXPECT_NE(small.last_prefix_disk_error().find(small.prefix_disk_directory()), std::string::npos)
        << small.last_prefix_disk_error();
    EXPECT_EQ(small.prefixes_on_disk(), 0u);
    EXPECT_EQ(small.states().count(S::kCached, S::kOnDisk), 1);
    EXPECT_EQ(small.states().count(S::kOnDisk, S::kDropped), 1);
  }
  EXPECT_FALSE(std::filesystem::exists(dir)) << "the store removes its directory";
  EXPECT_EQ(engine->memory().live_sequences(), 0);
}

TEST(PrefixStore, BlobsOnANodeAreReadBackAndALostOneIsDropped) {
  auto engine = pool_engine(3, 0);
  ASSERT_TRUE(engine);
  const uint64_t page = page_bytes(*engine);
  auto blobs = std::make_shared<MemoryBlobStore>(uint64_t{64} << 20);
  PrefixStoreOptions o;
  o.host_bytes = 2 * page;
  o.blob_store = blobs;
  {
    PrefixStore store(*engine, o);
    const std::vector<TokenId> a = story_prompt(40), b = prompt_of(426);
    for (const auto& p : {a, b}) store.insert(computed(*engine, p), p, S::kFinished);
    ASSERT_TRUE(store.evict());
    ASSERT_TRUE(store.evict());
    EXPECT_EQ(store.prefixes_on_disk(), 1u);
    EXPECT_EQ(blobs->blobs(), 1u);
    EXPECT_TRUE(store.prefix_disk_directory().empty()) << "no directory with a blob store";
    ASSERT_TRUE(store.restore(*store.longest_stored(wanted(a), 0)));
    EXPECT_EQ(store.stats().prefix_disk_restores, 1);
    EXPECT_EQ(blobs->blobs(), 0u);
    // A prefix larger than host memory goes straight to a blob; the node dies; it is dropped.
    PrefixStoreOptions no_host = o;
    no_host.host_bytes = 0;
    PrefixStore other(*engine, no_host);
    const std::vector<TokenId> c = prompt_of(432);
    const SeqId cs = computed(*engine, c);
    ASSERT_TRUE(other.offload(cs, c, S::kCached));
    (void)engine->memory().remove_sequence(cs);
    blobs->alive = false;
    EXPECT_FALSE(other.restore(0));
    EXPECT_NE(other.last_prefix_disk_error().find("memory blob store"), std::string::npos);
    EXPECT_EQ(other.prefixes_on_disk(), 0u);
    EXPECT_EQ(store.states().count(S::kOffloaded, S::kOnNode), 1);
    EXPECT_EQ(store.states().count(S::kOnNode, S::kCached), 1);
    EXPECT_EQ(other.states().count(S::kCached, S::kOnNode), 1);
    EXPECT_EQ(other.states().count(S::kOnNode, S::kDropped), 1);
    EXPECT_EQ(store.open_disk().code(), StatusCode::kOk) << "nothing to do without persist";
  }
  EXPECT_EQ(blobs->blobs(), 0u) << "the stores removed their blobs";
}

TEST(PrefixStore, PersistedPrefixesAreFoundByTheNextStore) {
  auto engine = pool_engine(2, 0);
  ASSERT_TRUE(engine);
  const std::filesystem::path base = std::filesystem::path(::testing::TempDir()) / "prefix-store-persist";
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  PrefixStoreOptions o;
  o.lower_bytes = uint64_t{64} << 20;
  o.disk_dir = base.string();
  o.persist = true;
  const std::vector<TokenId> a = story_prompt(40);
  {
    PrefixStore store(*engine, o);
    ASSERT_TRUE(store.open_disk().is_ok());
    store.insert(computed(*engine, a), a, S::kFinished);
  }  // cached a written at the end
  EXPECT_EQ(engine->memory().live_sequences(), 0);
  PrefixStore store(*engine, o);
  ASSERT_TRUE(store.open_disk().is_ok());
  EXPECT_EQ(store.stats().prefix_disk_found, 1);
  EXPECT_EQ(store.states().count(S::kNew, S::kOnDisk), 1);
  ASSERT_TRUE(store.restore(*store.longest_stored(wanted(a), 0)));
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 32);
  PrefixStoreOptions blob = o;
  blob.blob_store = std::make_shared<MemoryBlobStore>(1 << 20);
  EXPECT_EQ(PrefixStore(*engine, blob).open_disk().code(), StatusCode::kInvalidArgument);
}

TEST(PrefixKey, KeysNameIdentityLengthAndTokensAndComeInWholeUnits) {
  const std::vector<TokenId> t = story_prompt(40);
  const PrefixKey k = prefix_key(7, std::span<const TokenId>(t).first(32));
  EXPECT_EQ(k.tokens, 32);
  EXPECT_EQ(k.text().rfind("spx:prefix:v1:0000000000000007:32:", 0), 0u) << k.text();
  EXPECT_NE(prefix_key(8, std::span<const TokenId>(t).first(32)), k) << "another engine";
  std::vector<TokenId> other(t.begin(), t.begin() + 32);
  other[31] += 1;
  EXPECT_NE(prefix_key(7, other).token_hash, k.token_hash);
  const std::vector<PrefixKey> keys = prefix_keys(7, t, 16, 0);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0], prefix_key(7, std::span<const TokenId>(t).first(16)));
  EXPECT_EQ(keys[1], k);
  EXPECT_EQ(prefix_keys(7, t, 16, 16).size(), 1u) << "longer than the floor only";
}

// Server A's prompt, written to the shared store when it finishes, is read back by server B (its
// own engine) instead of computed: same greedy tokens; an unreachable store costs B nothing but
// the computation (and a counted error).
// A store whose shared level is `shared`, in chunks of `chunk_tokens`.
PrefixStoreOptions shared_level(std::shared_ptr<SharedPrefixStore> shared, int64_t chunk_tokens) {
  PrefixStoreOptions o;
  o.shared_store = std::move(shared);
  o.shared_chunk_tokens = chunk_tokens;
  return o;
}

// A request for 12 greedy tokens after `prompt`.
GenerationRequest greedy(const std::vector<TokenId>& prompt) {
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = 12;
  return r;
}

// What a server of its own (a Generator on a fresh 2-slot engine) decodes for greedy(prompt)
// under `o`; its counts in `stats` if given.
std::vector<TokenId> generate(const std::vector<TokenId>& prompt, const GeneratorOptions& o,
                              GenerationStats* stats) {
  auto engine = pool_engine(2, 0);
  EXPECT_TRUE(engine);
  if (!engine) return {};
  Generator g(*engine, o);
  auto out = g.run({greedy(prompt)});
  EXPECT_TRUE(out.is_ok());
  if (stats) *stats = g.stats();
  return out.is_ok() ? (*out)[0].tokens : std::vector<TokenId>{};
}

TEST(PrefixStore, ASecondEngineReadsTheFirstsPromptFromTheSharedStore) {
  const std::vector<TokenId> prompt = story_prompt(60);  // 59 tokens wanted: 3 whole pages
  GeneratorOptions go;
  go.prefix_caching = true;
  const std::vector<TokenId> alone = generate(prompt, go, nullptr);
  ASSERT_EQ(alone.size(), 12u);
  auto shared = std::make_shared<MemorySharedStore>();
  go.prefix_shared_store = shared;
  GenerationStats a, b, c;
  EXPECT_EQ(generate(prompt, go, &a), alone);
  EXPECT_EQ(a.prefix_shared_misses, 1) << "asked, found none";
  EXPECT_EQ(a.prefix_shared_writes, 1);
  EXPECT_GT(a.prefix_shared_bytes_written, 0);
  EXPECT_EQ(a.cached_prompt_tokens, 0);
  EXPECT_EQ(shared->blobs(), 1u);
  EXPECT_EQ(generate(prompt, go, &b), alone) << "the prompt read back decodes as computed";
  EXPECT_EQ(b.prefix_shared_hits, 1);
  EXPECT_EQ(b.prefix_shared_misses, 0);
  EXPECT_EQ(b.prefix_shared_writes, 0) << "held already";
  EXPECT_EQ(b.prefix_shared_bytes_read, a.prefix_shared_bytes_written);
  EXPECT_EQ(b.cached_prompt_tokens, 48);
  EXPECT_EQ(b.prefix_shared_errors, 0);
  shared->alive = false;
  EXPECT_EQ(generate(prompt, go, &c), alone) << "a dead store costs the computation only";
  EXPECT_EQ(c.prefix_shared_hits, 0);
  EXPECT_EQ(c.prefix_shared_misses, 1);
  EXPECT_GE(c.prefix_shared_errors, 1);
  EXPECT_EQ(c.cached_prompt_tokens, 0);
}

TEST(PrefixStore, AFoundPrefixIsAskedOnceAndOneGoneSinceIsAMiss) {
  auto engine = pool_engine(3, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStoreOptions o;
  o.shared_store = shared;
  PrefixStore store(*engine, o);
  const std::vector<TokenId> a = story_prompt(40);
  const SeqId seq = computed(*engine, a);
  EXPECT_EQ(store.find_shared(wanted(a), 0), 0);
  EXPECT_EQ(store.find_shared(wanted(a), 0), 0);
  EXPECT_EQ(shared->asked, 1) << "the same question is answered without asking again";
  EXPECT_TRUE(store.publish(seq, wanted(a)));
  EXPECT_FALSE(store.publish(seq, wanted(a))) << "held already";
  EXPECT_EQ(store.find_shared(wanted(a), 0), 32) << "a write makes it ask again";
  EXPECT_EQ(store.find_shared(wanted(a), 32), 0) << "not longer than the floor";
  (void)engine->memory().remove_sequence(seq);
  ASSERT_TRUE(store.restore_shared(wanted(a), 32));
  ASSERT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 32);
  EXPECT_EQ(store.cached().front().tokens, std::vector<TokenId>(a.begin(), a.begin() + 32));
  // Gone between the question and the read (expired): a miss, not an error.
  const std::vector<TokenId> b = prompt_of(426);
  EXPECT_FALSE(store.restore_shared(wanted(b), 32));
  EXPECT_EQ(store.stats().prefix_shared_hits, 1);
  EXPECT_EQ(store.stats().prefix_shared_misses, 2);
  EXPECT_EQ(store.stats().prefix_shared_errors, 0) << store.last_shared_error();
  EXPECT_EQ(store.states().count(S::kNew, S::kShared), 2);
  EXPECT_EQ(store.states().count(S::kShared, S::kCached), 1);
  EXPECT_EQ(store.states().count(S::kShared, S::kDropped), 1);
  EXPECT_EQ(store.states().refused(), 0);
}

// ---- the shared level in chunks ----

// The key of the chunk of `chunk` tokens ending at `end`.
PrefixKey chunk_key(Engine& engine, const std::vector<TokenId>& tokens, int64_t end, int64_t chunk) {
  return prefix_key(engine.kv_identity(), std::span<const TokenId>(tokens).first(static_cast<size_t>(end)),
                    chunk);
}

// Bytes the shared store holds in the chunks of `chunk` tokens of `tokens` ending at `ends`.
int64_t chunk_bytes(MemorySharedStore& shared, Engine& engine, const std::vector<TokenId>& tokens,
                    std::initializer_list<int64_t> ends, int64_t chunk) {
  int64_t n = 0;
  for (int64_t end : ends) {
    n += static_cast<int64_t>(shared.blob(chunk_key(engine, tokens, end, chunk)).size());
  }
  return n;
}

// A conversation's second turn: the first turn's prompt, then more.
std::vector<TokenId> next_turn(const std::vector<TokenId>& turn, size_t more) {
  std::vector<TokenId> t = turn;
  const std::vector<TokenId> extra = prompt_of(300, more + 1);
  t.insert(t.end(), extra.begin() + 1, extra.end());
  return t;
}

// Issue #31: a prompt that repeats a stored one's first chunks writes only its new chunks.
TEST(PrefixStore, ASecondPromptWritesOnlyTheChunksTheSharedStoreDoesNotHold) {
  auto engine = pool_engine(4, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStore store(*engine, shared_level(shared, 20));  // rounded up to 2 pages
  ASSERT_EQ(store.shared_chunk_tokens(), 32);
  const std::vector<TokenId> turn1 = story_prompt(60);      // 59 wanted: 48 tokens, [0, 32) [32, 48)
  const std::vector<TokenId> turn2 = next_turn(turn1, 50);  // 109 wanted: 96, [0, 32) [32, 64) [64, 96)
  const SeqId one = computed(*engine, turn1);
  ASSERT_TRUE(store.publish(one, wanted(turn1)));
  const PrefixStoreStats first = store.stats();
  EXPECT_EQ(first.prefix_shared_writes, 1);
  EXPECT_EQ(first.prefix_shared_chunks_written, 2);
  EXPECT_EQ(first.prefix_shared_chunks_skipped, 0);
  EXPECT_EQ(first.prefix_shared_bytes_written, chunk_bytes(*shared, *engine, turn1, {32, 48}, 32));
  const SeqId two = computed(*engine, turn2);
  ASSERT_TRUE(store.publish(two, wanted(turn2)));
  const PrefixStoreStats second = store.stats();
  EXPECT_EQ(second.prefix_shared_writes, 2);
  EXPECT_EQ(second.prefix_shared_chunks_written, 4) << "[32, 64) and [64, 96) only";
  EXPECT_EQ(second.prefix_shared_chunks_skipped, 1) << "[0, 32) held already";
  EXPECT_EQ(shared->puts, 4);
  EXPECT_EQ(shared->blobs(), 4u);
  const int64_t new_bytes = second.prefix_shared_bytes_written - first.prefix_shared_bytes_written;
  EXPECT_EQ(new_bytes, chunk_bytes(*shared, *engine, turn2, {64, 96}, 32));
  // What writing the second prompt whole took before: its pages' KV alone is more.
  auto whole = engine->memory().export_prefix(two, 96);
  ASSERT_TRUE(whole.is_ok());
  EXPECT_LT(new_bytes, static_cast<int64_t>(whole->kv.size()));
  EXPECT_GT(new_bytes, static_cast<int64_t>(whole->kv.size()) / 3 * 2 - 1) << "2 of its 3 chunks' KV";
  EXPECT_FALSE(store.publish(two, wanted(turn2))) << "every chunk held";
  EXPECT_EQ(store.stats().prefix_shared_chunks_skipped, 4);
  EXPECT_EQ(store.stats().prefix_shared_chunks_written, 4);
  // An evicted middle chunk is written again, alone.
  shared->erase(chunk_key(*engine, turn2, 64, 32));
  EXPECT_TRUE(store.publish(two, wanted(turn2)));
  EXPECT_EQ(store.stats().prefix_shared_chunks_written, 5);
  EXPECT_EQ(shared->puts, 5);
  EXPECT_EQ(store.stats().prefix_shared_errors, 0) << store.last_shared_error();
}

// Issue #31: servers (engines of their own) read a conversation's turns back from chunks two of
// them wrote and decode what computing the prompt does (greedy); a corrupted chunk is a miss
// (an error, the prompt computed), never wrong KV.
TEST(PrefixStore, EnginesAssembleAPromptFromChunksOthersWroteAndDecodeAsComputed) {
  const std::vector<TokenId> turn1 = story_prompt(60);
  const std::vector<TokenId> turn2 = next_turn(turn1, 50);
  GeneratorOptions go;
  go.prefix_caching = true;
  const std::vector<TokenId> alone1 = generate(turn1, go, nullptr), alone2 = generate(turn2, go, nullptr);
  ASSERT_EQ(alone2.size(), 12u);
  auto shared = std::make_shared<MemorySharedStore>();
  go.prefix_shared_store = shared;
  go.prefix_shared_chunk_tokens = 32;
  GenerationStats a, b, c, d;
  EXPECT_EQ(generate(turn1, go, &a), alone1);
  EXPECT_EQ(a.prefix_shared_chunks_written, 2);
  EXPECT_EQ(generate(turn2, go, &b), alone2) << "turn 1's 48 tokens read back";
  EXPECT_EQ(b.prefix_shared_hits, 1);
  EXPECT_EQ(b.prefix_shared_chunks_read, 2);
  EXPECT_EQ(b.cached_prompt_tokens, 48);
  EXPECT_EQ(b.prefix_shared_chunks_written, 2);
  EXPECT_EQ(b.prefix_shared_chunks_skipped, 1);
  EXPECT_EQ(generate(turn2, go, &c), alone2) << "[0, 32) from the first engine, the rest from the second";
  EXPECT_EQ(c.prefix_shared_hits, 1);
  EXPECT_EQ(c.prefix_shared_chunks_read, 3);
  EXPECT_EQ(c.cached_prompt_tokens, 96);
  auto engine = pool_engine(1, 0);  // for the keys: the same identity
  ASSERT_TRUE(engine);
  EXPECT_EQ(c.prefix_shared_bytes_read, chunk_bytes(*shared, *engine, turn2, {32, 64, 96}, 32));
  EXPECT_EQ(c.prefix_shared_chunks_written, 0);
  EXPECT_EQ(c.prefix_shared_errors, 0);
  // One byte of the middle chunk's KV flipped (its checksum no longer matches): computed instead.
  std::vector<std::byte>& middle = shared->blob(chunk_key(*engine, turn2, 64, 32));
  middle[middle.size() / 2] ^= std::byte{0x40};
  EXPECT_EQ(generate(turn2, go, &d), alone2) << "a corrupt chunk is computed, not used";
  EXPECT_EQ(d.prefix_shared_hits, 0);
  EXPECT_GE(d.prefix_shared_errors, 1);
  EXPECT_EQ(d.cached_prompt_tokens, 0);
}

// Issue #31: a chunk that does not hold what its key says (another prompt's, another place's,
// corrupt) fails the read as a whole: nothing is imported.
TEST(PrefixStore, AChunkOfOtherTokensOrAnotherPlaceIsNeverUsed) {
  auto engine = pool_engine(4, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStore store(*engine, shared_level(shared, 16));
  const std::vector<TokenId> a = story_prompt(60), b = prompt_of(426);  // 48 and 32 tokens
  ASSERT_TRUE(store.publish(computed(*engine, a), wanted(a)));
  ASSERT_TRUE(store.publish(computed(*engine, b), wanted(b)));
  const PrefixKey a32 = chunk_key(*engine, a, 32, 16);
  const std::vector<std::byte> kept = shared->blob(a32);
  int64_t errors = 0;
  const auto refused = [&](const std::vector<std::byte>& value, const std::string& what,
                           const std::string& named) {
    shared->blob(a32) = value;
    EXPECT_EQ(store.find_shared(wanted(a), 0), 48) << what << ": its key is there";
    EXPECT_FALSE(store.restore_shared(wanted(a), 48)) << what;
    EXPECT_EQ(store.stats().prefix_shared_errors, ++errors) << what;
    EXPECT_NE(store.last_shared_error().find(named), std::string::npos)
        << what << ": " << store.last_shared_error();
    EXPECT_EQ(store.cached_sequences(), 0u) << what;
  };
  // A hash collision: b's [16, 32) under a's key (same place, other tokens).
  refused(shared->blob(chunk_key(*engine, b, 32, 16)), "another prompt's chunk", "token_ids");
  refused(shared->blob(chunk_key(*engine, a, 16, 16)), "a's own [0, 16)", "start");
  std::vector<std::byte> flipped = kept;
  flipped[flipped.size() / 2] ^= std::byte{1};
  refused(flipped, "a flipped byte", "crc32");
  refused(std::vector<std::byte>(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(kept.size() / 2)),
          "cut short", "prefix chunk");
  EXPECT_EQ(store.stats().prefix_shared_hits, 0);
  shared->blob(a32) = kept;
  ASSERT_TRUE(store.restore_shared(wanted(a), 48)) << store.last_shared_error();
  EXPECT_EQ(store.stats().prefix_shared_hits, 1);
  EXPECT_EQ(store.stats().prefix_shared_chunks_read, 3);
  EXPECT_EQ(store.stats().prefix_shared_errors, errors);
  ASSERT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 48);
}

// Issue #31: a prefix is found only as far as the run of chunks from token 0 goes: a missing
// middle chunk limits the hit to the chunks before it; one gone between the question and the
// read is a miss.
TEST(PrefixStore, AMissingMiddleChunkLimitsTheHitToTheChunksBeforeIt) {
  auto engine = pool_engine(4, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStore store(*engine, shared_level(shared, 16));
  const std::vector<TokenId> a = story_prompt(70);  // 69 wanted: 64 tokens, 4 chunks
  ASSERT_TRUE(store.publish(computed(*engine, a), wanted(a)));
  EXPECT_EQ(shared->blobs(), 4u);
  shared->erase(chunk_key(*engine, a, 32, 16));
  EXPECT_EQ(store.find_shared(wanted(a), 0), 16) << "[16, 32) is gone: [32, 64) cannot be used";
  EXPECT_EQ(store.find_shared(wanted(a), 16), 0) << "not longer than the floor";
  ASSERT_TRUE(store.restore_shared(wanted(a), 16)) << store.last_shared_error();
  EXPECT_EQ(store.stats().prefix_shared_chunks_read, 1);
  ASSERT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 16);
  // With every chunk there again, found whole; one evicted before it is read: a miss, no error.
  const std::vector<TokenId> b = story_prompt(70);
  ASSERT_TRUE(store.publish(computed(*engine, b), wanted(b)));
  EXPECT_EQ(store.stats().prefix_shared_chunks_written, 5) << "[16, 32) again";
  EXPECT_EQ(store.find_shared(wanted(a), 0), 64);
  shared->erase(chunk_key(*engine, a, 48, 16));
  const int64_t misses = store.stats().prefix_shared_misses;
  EXPECT_FALSE(store.restore_shared(wanted(a), 64));
  EXPECT_EQ(store.stats().prefix_shared_misses, misses + 1);
  EXPECT_EQ(store.stats().prefix_shared_errors, 0) << store.last_shared_error();
  EXPECT_EQ(store.cached_sequences(), 1u);
}

// Issue #31: a cached sequence that holds a prefix's first whole chunks is forked for them and
// only the later chunks are read (each checked, and a bad one makes the read a miss with nothing
// made); without one, every chunk is read from token 0.
TEST(PrefixStore, ACachedSequenceHoldingTheFirstChunksIsForkedAndOnlyTheLaterOnesAreRead) {
  auto engine = pool_engine(6, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStore store(*engine, shared_level(shared, 16));
  const std::vector<TokenId> a = story_prompt(70), b = prompt_of(426, 70);  // 64 tokens: 4 chunks each
  const SeqId computed_a = computed(*engine, a);
  ASSERT_TRUE(store.publish(computed_a, wanted(a)));
  ASSERT_TRUE(store.publish(computed(*engine, b), wanted(b)));
  // Nothing cached: [0, 16) and [16, 32) read.
  ASSERT_TRUE(store.restore_shared(wanted(a), 32)) << store.last_shared_error();
  EXPECT_EQ(shared->gets, 2);
  EXPECT_EQ(store.stats().prefix_shared_chunks_read, 2);
  EXPECT_EQ(store.stats().prefix_shared_chunks_local, 0);
  EXPECT_EQ(store.stats().prefix_shared_bytes_read, chunk_bytes(*shared, *engine, a, {16, 32}, 16));
  ASSERT_EQ(store.cached_sequences(), 1u);
  const SeqId first = store.cached().front().seq;
  // The one chunk read, of another prompt (a hash collision), or the last of two, corrupt: the
  // read is an error and nothing is made; the cached sequence stays as it was.
  const PrefixKey a48 = chunk_key(*engine, a, 48, 16), a64 = chunk_key(*engine, a, 64, 16);
  const std::vector<std::byte> kept48 = shared->blob(a48), kept = shared->blob(a64);
  const int64_t live = engine->memory().live_sequences(), pages = engine->memory().kv_store().used_pages();
  std::vector<std::byte> flipped = kept;
  flipped[flipped.size() / 2] ^= std::byte{1};
  int64_t errors = 0;
  for (const auto& [key, value, tokens, named] :
       {std::tuple{a48, shared->blob(chunk_key(*engine, b, 48, 16)), int64_t{48}, "token_ids"},
        std::tuple{a64, flipped, int64_t{64}, "crc32"}}) {
    shared->blob(a48) = kept48;
    shared->blob(key) = value;
    EXPECT_FALSE(store.restore_shared(wanted(a), tokens)) << named;
    EXPECT_EQ(store.stats().prefix_shared_errors, ++errors) << named;
    EXPECT_NE(store.last_shared_error().find(named), std::string::npos) << store.last_shared_error();
    EXPECT_EQ(store.stats().prefix_shared_hits, 1) << named;
    EXPECT_EQ(store.cached_sequences(), 1u) << named;
    EXPECT_EQ(engine->memory().live_sequences(), live) << named;
    EXPECT_EQ(engine->memory().kv_store().used_pages(), pages) << named;
  }
  shared->blob(a48) = kept48;
  shared->blob(a64) = kept;
  // The cached [0, 32) is forked: [32, 48) and [48, 64) only are read. A chunk it holds may be
  // anything in the store: it is not read.
  shared->blob(chunk_key(*engine, a, 16, 16)) = flipped;
  const int gets = shared->gets;
  const int64_t bytes = store.stats().prefix_shared_bytes_read;
  ASSERT_TRUE(store.restore_shared(wanted(a), 64)) << store.last_shared_error();
  EXPECT_EQ(shared->gets - gets, 2);
  EXPECT_EQ(store.stats().prefix_shared_bytes_read - bytes, chunk_bytes(*shared, *engine, a, {48, 64}, 16));
  EXPECT_EQ(store.stats().prefix_shared_chunks_read, 4);
  EXPECT_EQ(store.stats().prefix_shared_chunks_local, 2);
  EXPECT_EQ(store.stats().prefix_shared_hits, 2);
  EXPECT_EQ(store.stats().prefix_shared_errors, errors);
  ASSERT_EQ(store.cached_sequences(), 2u);
  const SeqId whole = store.cached().back().seq;
  EXPECT_EQ(engine->memory().sequence_length(whole), 64);
  EXPECT_EQ(store.cached().back().tokens, std::vector<TokenId>(a.begin(), a.begin() + 64));
  EXPECT_EQ(engine->memory().kv_store().used_pages(), pages + 2) << "[0, 32)'s pages shared";
  EXPECT_EQ(engine->memory().sequence_length(first), 32) << "the forked one stays";
  auto got = engine->memory().export_prefix(whole, 64);
  auto want = engine->memory().export_prefix(computed_a, 64);
  ASSERT_TRUE(got.is_ok() && want.is_ok());
  EXPECT_TRUE(got->kv == want->kv) << "the prompt's KV as computed";
  ASSERT_TRUE(engine->memory().check_invariants().is_ok()) << engine->memory().check_invariants().to_string();
}

// One sequence slot (as `generate` has): no fork can stand beside the cached sequence holding
// the first chunks, so it gives way and every chunk is read from token 0, as without it.
TEST(PrefixStore, WithNoSlotToForkTheCachedSequenceEveryChunkIsReadFromTokenZero) {
  auto engine = pool_engine(1, 0);
  ASSERT_TRUE(engine);
  auto shared = std::make_shared<MemorySharedStore>();
  PrefixStore store(*engine, shared_level(shared, 16));
  const std::vector<TokenId> a = story_prompt(70);
  const SeqId computed_a = computed(*engine, a);
  ASSERT_TRUE(store.publish(computed_a, wanted(a)));
  ASSERT_TRUE(engine->memory().remove_sequence(computed_a).is_ok());
  ASSERT_TRUE(store.restore_shared(wanted(a), 32)) << store.last_shared_error();
  ASSERT_TRUE(store.restore_shared(wanted(a), 64)) << store.last_shared_error();
  ASSERT_EQ(store.cached_sequences(), 1u);
  EXPECT_EQ(engine->memory().sequence_length(store.cached().front().seq), 64);
  EXPECT_EQ(shared->gets, 2 + 2 + 4) << "[0, 32); [32, 64) for a fork that found no slot; all from 0";
  EXPECT_EQ(store.stats().prefix_shared_chunks_read, shared->gets);
  EXPECT_EQ(store.stats().prefix_shared_chunks_local, 0);
  EXPECT_EQ(store.stats().prefix_shared_hits, 2);
  EXPECT_EQ(store.stats().prefix_shared_errors, 0) << store.last_shared_error();
}

// Issue #31: a server whose prefix cache holds a conversation's first turn reads only the chunks
// of the second turn past it when another server wrote them, and decodes what computing the
// prompt does (greedy); a corrupt later chunk is computed instead; a server holding nothing reads
// every chunk from token 0.
TEST(PrefixStore, AServerHoldingTheFirstTurnReadsOnlyTheLaterChunksAndDecodesAsComputed) {
  const std::vector<TokenId> turn1 = story_prompt(60);      // 59 wanted: 48 tokens
  const std::vector<TokenId> turn2 = next_turn(turn1, 50);  // 109 wanted: [0, 32) [32, 64) [64, 96)
  GeneratorOptions go;
  go.prefix_caching = true;
  const std::vector<TokenId> alone2 = generate(turn2, go, nullptr);
  ASSERT_EQ(alone2.size(), 12u);
  auto shared = std::make_shared<MemorySharedStore>();
  go.prefix_shared_store = shared;
  go.prefix_shared_chunk_tokens = 32;
  // A request of `prompt` on a scheduler that stays (its prefix cache with it): its tokens and
  // the counts it added.
  const auto turn = [&](Scheduler& s, const std::vector<TokenId>& prompt, GenerationStats* added) {
    const GenerationStats before = s.stats();
    std::vector<TokenId> tokens = testing::run_request(s, greedy(prompt));
    const GenerationStats after = s.stats();
    added->prefix_shared_hits = after.prefix_shared_hits - before.prefix_shared_hits;
    added->prefix_shared_errors = after.prefix_shared_errors - before.prefix_shared_errors;
    added->prefix_shared_chunks_read = after.prefix_shared_chunks_read - before.prefix_shared_chunks_read;
    added->prefix_shared_chunks_local = after.prefix_shared_chunks_local - before.prefix_shared_chunks_local;
    added->prefix_shared_bytes_read = after.prefix_shared_bytes_read - before.prefix_shared_bytes_read;
    added->cached_prompt_tokens = after.cached_prompt_tokens - before.cached_prompt_tokens;
    return tokens;
  };
  auto engine_b = pool_engine(3, 0), engine_d = pool_engine(3, 0);
  ASSERT_TRUE(engine_b && engine_d);
  Scheduler b(*engine_b, go), d(*engine_d, go);
  GenerationStats ignored, a_stats, read_later, read_all, corrupt;
  (void)turn(b, turn1, &ignored);  // B computes turn 1 and writes [0, 32) [32, 48)
  (void)turn(d, turn1, &ignored);  // D reads them back
  EXPECT_EQ(generate(turn2, go, &a_stats), alone2);  // A reads 48 tokens, writes [32, 64) [64, 96)
  EXPECT_EQ(a_stats.prefix_shared_chunks_written, 2);
  EXPECT_EQ(turn(b, turn2, &read_later), alone2) << "[0, 32) forked from turn 1's cached sequence";
  EXPECT_EQ(read_later.prefix_shared_hits, 1);
  EXPECT_EQ(read_later.prefix_shared_chunks_read, 2);
  EXPECT_EQ(read_later.prefix_shared_chunks_local, 1);
  EXPECT_EQ(read_later.prefix_shared_bytes_read, chunk_bytes(*shared, *engine_b, turn2, {64, 96}, 32));
  EXPECT_EQ(read_later.cached_prompt_tokens, 96);
  EXPECT_EQ(read_later.prefix_shared_errors, 0);
  // A server holding nothing of it reads all three chunks.
  EXPECT_EQ(generate(turn2, go, &read_all), alone2);
  EXPECT_EQ(read_all.prefix_shared_hits, 1);
  EXPECT_EQ(read_all.prefix_shared_chunks_read, 3);
  EXPECT_EQ(read_all.prefix_shared_chunks_local, 0);
  EXPECT_EQ(read_all.prefix_shared_bytes_read, chunk_bytes(*shared, *engine_b, turn2, {32, 64, 96}, 32));
  EXPECT_EQ(read_all.cached_prompt_tokens, 96);
  std::fprintf(stderr, "turn 2 read from the shared store: %lld bytes holding turn 1, %lld holding nothing\n",
               static_cast<long long>(read_later.prefix_shared_bytes_read),
               static_cast<long long>(read_all.prefix_shared_bytes_read));
  // D holds turn 1 too; turn 2's last chunk is corrupt: computed past D's own 48 tokens.
  std::vector<std::byte>& last = shared->blob(chunk_key(*engine_b, turn2, 96, 32));
  last[last.size() / 2] ^= std::byte{0x40};
  EXPECT_EQ(turn(d, turn2, &corrupt), alone2) << "a corrupt later chunk is computed, not used";
  EXPECT_EQ(corrupt.prefix_shared_hits, 0);
  EXPECT_GE(corrupt.prefix_shared_errors, 1);
  EXPECT_EQ(corrupt.cached_prompt_tokens, 48) << "turn 1's cached pages only";
}

// ---- request states ----

TEST(RequestStates, TheTableRefusesWhatTheCodeNeverDoes) {
  StateLog log;
  for (auto [from, to] : {std::pair{S::kWaiting, S::kDecoding}, std::pair{S::kNew, S::kPrefilling},
                          std::pair{S::kFinished, S::kWaiting}, std::pair{S::kRefused, S::kCached},
                          std::pair{S::kError, S::kCached}, std::pair{S::kDropped, S::kCached},
                          std::pair{S::kDecoding, S::kPrefilling}, std::pair{S::kOnDisk, S::kOffloaded},
                          std::pair{S::kCached, S::kWaiting}, std::pair{S::kWaiting, S::kWaiting}}) {
    RequestState state = from;
    const Status st = log.move(state, to);
    EXPECT_EQ(st.code(), StatusCode::kInternal)
        << request_state_name(from) << " -> " << request_state_name(to);
    EXPECT_NE(st.message().find(std::string(request_state_name(to))), std::string::npos) << st.message();
    EXPECT_EQ(state, from) << "unchanged";
    EXPECT_EQ(log.count(from, to), 0);
  }
  EXPECT_EQ(log.refused(), 10);
  RequestState state = S::kNew;
  for (S to : {S::kWaiting, S::kPrefilling, S::kDecoding, S::kFinished, S::kCached, S::kOffloaded, S::kOnDisk,
               S::kDropped}) {
    EXPECT_TRUE(log.move(state, to).is_ok()) << request_state_name(to);
  }
  EXPECT_EQ(log.count(S::kOnDisk, S::kDropped), 1);
  EXPECT_EQ(log.refused(), 10);
}

// Steps until idle (or `limit` steps); errors of failed forwards are expected in some scenarios.
void run(Scheduler& s, int limit = 5000) {
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < limit && !s.idle(); ++i) {
    ev.clear();
    (void)s.step(ev);
  }
}

// Steps until request `id` has had `tokens` token events.
void run_until(Scheduler& s, RequestId id, int64_t tokens) {
  std::vector<SchedulerEvent> ev;
  int64_t got = 0;
  for (int i = 0; i < 5000 && got < tokens && !s.idle(); ++i) {
    ev.clear();
    (void)s.step(ev);
    for (const SchedulerEvent& e : ev) got += e.request == id && !e.finished;
  }
}

// Submitted, cancelled while waiting, prefilling and decoding (kept cached), refused, a first
// token that is a stop id, a next turn that takes its cache over.
StateLog lifecycle_scenario() {
  StateLog all;
  {
    auto engine = pool_engine(3, 0);
    GeneratorOptions go;
    go.prefix_caching = true;
    go.prefill_chunk = 8;
    Scheduler s(*engine, go);
    const GenerationRequest a = request(story_prompt(40), 10);
    const std::vector<TokenId> first = testing::alone(a);
    GenerationRequest stops = a;
    stops.stop_ids = {first.front()};
    for (const GenerationRequest& r : {a, stops}) {
      EXPECT_TRUE(s.submit(r).is_ok());
      run(s);
    }
    // The next turn takes a's cache over.
    GenerationRequest next = a;
    next.prompt.insert(next.prompt.end(), first.begin(), first.end());
    next.max_new_tokens = 3;
    EXPECT_TRUE(s.submit(next).is_ok());
    run(s);
    auto prefilling = s.submit(request(prompt_of(426, 60), 5));
    std::vector<SchedulerEvent> ev;
    EXPECT_TRUE(s.step(ev).is_ok());
    EXPECT_TRUE(s.cancel(*prefilling));
    auto decoding = s.submit(request(prompt_of(432), 50));
    run_until(s, *decoding, 3);
    EXPECT_TRUE(s.cancel(*decoding, /*keep_cached=*/true));
    auto waiting = s.submit(request({1, 2, 3}, 5));
    EXPECT_TRUE(s.cancel(*waiting));
    all += s.states();
  }
  {
    auto engine = pool_engine(1, 4);  // 64 tokens: a final length of 210 never fits
    Scheduler s(*engine, GeneratorOptions{});
    EXPECT_TRUE(s.submit(request({1, 403, 407}, 207)).is_ok());
    run(s);
    all += s.states();
  }
  return all;
}

// Forwards failing on a dead link (layer 1 on a remote node): during prefill or decode, at
// admission (a synthetic context written there), or for good (a lost tier: recomputed).
StateLog failure_scenario() {
  StateLog all;
  for (int64_t posts : {0, 2, 4, 8, 16}) {
    auto f = testing::failing_link_engine(testing::toy_model(2), posts, 2);
    if (!f.engine) continue;
    Scheduler s(*f.engine, GeneratorOptions{});
    (void)s.submit(request({1, 2, 3, 4, 5, 6, 7, 8}, 20));
    GenerationRequest synthetic = request({9, 10}, 5);
    synthetic.synthetic_context = 64;
    (void)s.submit(synthetic);
    run(s, 100);
    all += s.states();
  }
  for (int64_t posts : {0, 4}) {
    auto f = testing::failing_link_engine(testing::toy_model(2), posts, 2, /*permanent=*/true);
    if (!f.engine) continue;
    GeneratorOptions go;
    go.prefix_caching = true;
    Scheduler s(*f.engine, go);
    (void)s.submit(request({1, 2, 3, 4, 5, 6, 7, 8}, 20));
    run(s, 100);
    all += s.states();
  }
  return all;
}

// Preemption under kPreempt with swap into each kind of store: a request preempted while it
// decodes (three requests too many for the pool), and one preempted while it prefills (a long
// prompt admitted beside a request that grows past the pool).
StateLog preemption_scenario() {
  StateLog all;
  for (int level = 0; level < 4; ++level) {  // recompute, host, disk, node
    GeneratorOptions go;
    go.admission = AdmissionPolicy::kPreempt;
    go.prefix_caching = true;
    go.swap_preempted = level > 0;
    go.prefix_offload_bytes = level == 1 ? uint64_t{64} << 20 : 0;
    go.prefix_disk_bytes = level == 2 ? uint64_t{64} << 20 : 0;
    go.prefix_disk_dir = ::testing::TempDir();
    if (level == 3) go.prefix_blob_store = std::make_shared<MemoryBlobStore>(uint64_t{64} << 20);
    {
      auto engine = pool_engine(3, 20);
      go.prefill_chunk = 64;
      Scheduler s(*engine, go);
      for (const GenerationRequest& r :
           {request({1, 403, 407, 261, 378}, 195), request({1, 426}, 198),
            request({1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315}, 150, 0.8f)}) {
        EXPECT_TRUE(s.submit(r).is_ok());
      }
      run(s);
      all += s.states();
    }
    {
      auto engine = pool_engine(2, 8);  // 128 tokens
      go.prefill_chunk = 8;
      Scheduler s(*engine, go);
      auto grows = s.submit(request({1, 403, 407, 261, 378}, 120));
      run_until(s, *grows, 56);
      EXPECT_TRUE(s.submit(request(prompt_of(426, 60), 5)).is_ok());
      run(s);
      all += s.states();
    }
  }
  return all;
}

// The store's own moves between its levels (as the PrefixStore tests above make them).
StateLog store_scenario() {
  StateLog all;
  auto engine = pool_engine(4, 0);
  const uint64_t page = page_bytes(*engine);
  const std::vector<TokenId> a = story_prompt(40), b = prompt_of(426);
  auto blobs = std::make_shared<MemoryBlobStore>(uint64_t{64} << 20);
  for (int lower = 0; lower < 2; ++lower) {  // files, blobs
    PrefixStoreOptions o = disk_options(2 * page, uint64_t{64} << 20);
    if (lower == 1) o.blob_store = blobs;
    PrefixStore store(*engine, o);
    for (const auto& p : {a, b}) store.insert(computed(*engine, p), p, S::kFinished);
    while (store.evict()) {
    }
    (void)store.restore(*store.longest_stored(wanted(a), 0));  // from the lower level
    (void)store.restore(*store.longest_stored(wanted(b), 0));  // from host memory
    while (store.evict(SeqId(), true, /*offload=*/false)) {
    }
    PrefixStoreOptions no_host = o;
    no_host.host_bytes = 0;
    PrefixStore other(*engine, no_host);
    const SeqId seq = computed(*engine, a);
    (void)other.offload(seq, a, S::kCached);
    (void)engine->memory().remove_sequence(seq);
    blobs->alive = false;
    if (lower == 0) std::filesystem::remove(other.prefix_disk_directory() + "/0.spxprefix");
    (void)other.restore(0);
    blobs->alive = true;
    all += store.states();
    all += other.states();
  }
  // Host memory alone: the older of two prefixes is dropped for the newer.
  PrefixStoreOptions host_only;
  host_only.host_bytes = 2 * page;
  PrefixStore host(*engine, host_only);
  for (const auto& p : {a, b}) {
    const SeqId seq = computed(*engine, p);
    (void)host.offload(seq, p, S::kCached);
    (void)engine->memory().remove_sequence(seq);
  }
  all += host.states();
  return all;
}

// Prefixes persisted by one scheduler and found by the next (a restarted process).
StateLog persistence_scenario() {
  auto engine = pool_engine(2, 0);
  const std::filesystem::path base = std::filesystem::path(::testing::TempDir()) / "request-states-persist";
  std::filesystem::remove_all(base);
  std::filesystem::create_directories(base);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_disk_bytes = uint64_t{64} << 20;
  go.prefix_disk_dir = base.string();
  go.prefix_disk_persist = true;
  StateLog all;
  for (int process = 0; process < 2; ++process) {
    Scheduler s(*engine, go);
    EXPECT_TRUE(s.open_prefix_disk().is_ok());
    EXPECT_TRUE(s.submit(request(story_prompt(40), 10)).is_ok());
    run(s);
    all += s.states();
  }
  std::filesystem::remove_all(base);
  return all;
}

// One scheduler's prompt found in the shared store by the next one's (another server), and one
// gone when it is read.
StateLog shared_scenario() {
  auto engine = pool_engine(2, 0);
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_shared_store = std::make_shared<MemorySharedStore>();
  StateLog all;
  for (int server = 0; server < 2; ++server) {
    Scheduler s(*engine, go);
    EXPECT_TRUE(s.submit(request(story_prompt(40), 4)).is_ok());
    run(s);
    all += s.states();
  }
  PrefixStoreOptions o;
  o.shared_store = go.prefix_shared_store;
  PrefixStore store(*engine, o);
  EXPECT_FALSE(store.restore_shared(wanted(prompt_of(426)), 32));
  all += store.states();
  return all;
}

TEST(RequestStates, EveryAllowedMoveHappensInAScenarioAndNoneIsRefused) {
  StateLog all;
  for (StateLog (*scenario)() :
       {lifecycle_scenario, failure_scenario, preemption_scenario, store_scenario, persistence_scenario,
        shared_scenario}) {
    const StateLog log = scenario();
    EXPECT_EQ(log.refused(), 0);
    all += log;
  }
  int64_t moves = 0;
  for (size_t f = 0; f < kRequestStates; ++f) {
    for (size_t t = 0; t < kRequestStates; ++t) {
      const auto from = static_cast<S>(f), to = static_cast<S>(t);
      if (allowed(from, to)) {
        EXPECT_GT(all.count(from, to), 0) << request_state_name(from) << " -> " << request_state_name(to);
        ++moves;
      }
    }
  }
  std::fprintf(stderr, "%lld allowed moves\n", static_cast<long long>(moves));
}

}  // namespace
}  // namespace specontext
