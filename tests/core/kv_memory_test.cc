// KvMemory (core/engine/kv_memory.h) through Engine::memory(): the sequence table and its slot
// limit, forks sharing whole pages, truncation freeing the tail, snapshots moving a prefix into
// another engine, and the placement the memory records.
#include <gtest/gtest.h>

#include <random>

#include "core/engine/kv_memory.h"
#include "tests/core/tier_test_util.h"

namespace specontext {
namespace {

EngineOptions memory_options() {
  EngineOptions o;
  o.max_sequences = 2;
  o.max_context = 128;
  o.page_size = 8;
  o.kv_chunk_pages = 4;
  return o;
}

std::unique_ptr<Engine> make_engine(const std::shared_ptr<Model>& model, EngineOptions o = memory_options()) {
  auto made = Engine::create(model, testing::cpu_backend(), o);
  EXPECT_TRUE(made.is_ok()) << made.status().to_string();
  return made.is_ok() ? std::move(*made) : nullptr;
}

// Runs `n` random tokens through the sequence as one prompt chunk.
void prefill(Engine& e, SeqId seq, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<TokenId> tokens(n);
  for (auto& t : tokens) t = static_cast<TokenId>(rng() % static_cast<uint32_t>(e.config().vocab_size));
  const StepRequest r{seq, tokens, LogitsMode::kNone};
  auto out = e.forward(std::span<const StepRequest>(&r, 1));
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
}

TEST(KvMemory, HoldsAtMostMaxSequencesAndForgetsRemovedOnes) {
  auto engine = make_engine(testing::toy_model(2));
  ASSERT_NE(engine, nullptr);
  KvMemory& m = engine->memory();
  auto a = m.add_sequence();
  auto b = m.add_sequence();
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(m.live_sequences(), 2);
  EXPECT_EQ(m.add_sequence().status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(m.remove_sequence(*a).is_ok());
  EXPECT_EQ(m.remove_sequence(*a).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.sequence_length(*a), 0);
  EXPECT_EQ(m.live_sequences(), 1);
  EXPECT_TRUE(m.add_sequence().is_ok());
  EXPECT_TRUE(m.check_invariants().is_ok());
}

TEST(KvMemory, ForksShareWholePagesAndTruncationFreesTheTail) {
  auto engine = make_engine(testing::toy_model(2));
  ASSERT_NE(engine, nullptr);
  KvMemory& m = engine->memory();
  ASSERT_EQ(m.fork_granularity(), 8);
  EXPECT_TRUE(m.can_fork());
  auto source = m.add_sequence();
  ASSERT_TRUE(source.is_ok());
  prefill(*engine, *source, 20, 1);  // 3 pages
  EXPECT_EQ(m.sequence_length(*source), 20);
  EXPECT_EQ(m.kv_store().used_pages(), 3);
  EXPECT_EQ(m.kv_bytes_in_use(), 3 * static_cast<int64_t>(m.kv_store().page_bytes()) * 2);

  EXPECT_EQ(m.fork_sequence(*source, 12).status().code(),
            StatusCode::kInvalidArgument);  // not a page boundary
  auto fork = m.fork_sequence(*source, 16);
  ASSERT_TRUE(fork.is_ok()) << fork.status().to_string();
  EXPECT_EQ(m.sequence_length(*fork), 16);
  EXPECT_EQ(m.kv_store().used_pages(), 3);  // shared, not copied
  ASSERT_TRUE(m.check_invariants().is_ok()) << m.check_invariants().to_string();

  ASSERT_TRUE(m.truncate_sequence(*source, 8).is_ok());
  EXPECT_EQ(m.sequence_length(*source), 8);
  EXPECT_EQ(m.kv_store().used_pages(), 2);  // page 2 was the source's alone; page 1 the fork still holds
  ASSERT_TRUE(m.check_invariants().is_ok()) << m.check_invariants().to_string();
  ASSERT_TRUE(m.remove_sequence(*fork).is_ok());
  ASSERT_TRUE(m.remove_sequence(*source).is_ok());
  EXPECT_EQ(m.kv_store().used_pages(), 0);
}

TEST(KvMemory, APrefixSnapshotBecomesASequenceInAnotherEngine) {
  const auto model = testing::toy_model(2);
  auto from = make_engine(model);
  auto to = make_engine(model);
  ASSERT_TRUE(from && to);
  auto seq = from->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  prefill(*from, *seq, 20, 2);
  auto snap = from->memory().export_prefix(*seq, 16);
  ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
  EXPECT_EQ(snap->tokens, 16);
  EXPECT_EQ(snap->layers, 2);
  EXPECT_EQ(snap->kv.size(), 2 * 2 * snap->page_bytes);  // 2 layers x 2 pages

  auto imported = to->memory().import_prefix(*snap);
  ASSERT_TRUE(imported.is_ok()) << imported.status().to_string();
  EXPECT_EQ(to->memory().sequence_length(*imported), 16);
  EXPECT_EQ(to->memory().kv_store().used_pages(), 2);
  ASSERT_TRUE(to->memory().check_invariants().is_ok());
  auto back = to->memory().export_prefix(*imported, 16);
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back->kv, snap->kv);  // the same bytes, page for page

  PrefixSnapshot other = *snap;
  other.page_size = 16;
  auto refused = to->memory().import_prefix(other);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().to_string().find("page_size"), std::string::npos);
  EXPECT_EQ(to->memory().live_sequences(), 1);  // the refused import left nothing behind
}

TEST(KvMemory, RecordsEveryLayerOnTheDeviceWithoutTiers) {
  auto engine = make_engine(testing::toy_model(3));
  ASSERT_NE(engine, nullptr);
  const KvPlacement& p = engine->memory().placement();
  ASSERT_EQ(p.layer_home.size(), 3u);
  for (TierId t : p.layer_home) EXPECT_EQ(t, TierId(0));
  EXPECT_EQ(p.head_cache_home, TierId(0));
  EXPECT_FALSE(p.cpu_filtering);
  EXPECT_EQ(engine->memory().kv_bytes_per_token(), engine->config().kv_bytes_per_token(4));
}

}  // namespace
}  // namespace specontext
