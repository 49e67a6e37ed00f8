// Engine::fork_sequence (prefix caching): a sequence forked from another's page boundary gives the
// logits of computing its whole prompt itself, under every sparse method and with layers homed in
// a host tier; the source goes on unharmed; shared pages are counted and freed by reference.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

#include "core/engine/kv_store.h"
#include "core/engine/prefix_chunk.h"
#include "tests/core/tier_test_util.h"
#include "transport/local_transport.h"

namespace specontext {
namespace {

using testing::max_abs_diff;

EngineOptions prefix_options(SparseMethod method, const std::shared_ptr<RetrievalHead>& head,
                             DType kv_dtype = DType::kF32) {
  EngineOptions o;
  o.kv_dtype = kv_dtype;
  o.max_sequences = 4;
  o.max_context = 256;
  o.page_size = 8;
  o.kv_chunk_pages = 4;
  o.sparse.method = method;
  o.sparse.selection = {24, 1, 4};  // sparse decode from 25 tokens on
  o.sparse.quest_page_size = 16;    // fork granularity lcm(8, 16) under Quest
  if (method == SparseMethod::kSpeContext) o.retrieval_head = head;
  o.prefix_sharing = true;
  return o;
}

std::vector<TokenId> random_tokens(size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<TokenId> t(n);
  for (auto& x : t) x = static_cast<TokenId>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

std::vector<float> last_logits(Engine& e, SeqId seq, std::span<const TokenId> tokens) {
  const StepRequest r{seq, tokens, LogitsMode::kLast};
  auto out = e.forward(std::span<const StepRequest>(&r, 1));
  EXPECT_TRUE(out.is_ok()) << out.status().to_string();
  if (!out.is_ok()) return {};
  const auto row = out->row(0);
  return {row.begin(), row.end()};
}

struct Case {
  SparseMethod method;
  bool host_layers;  // layers 1 and 2 homed in a host tier
  DType kv_dtype = DType::kF32;  // KV and, under SpeContext, the retrieval head's keys
};

// The engine under test (layers 1 and 2 in a host tier when asked) and the reference: the same
// model on an engine that never forks or truncates.
class ForkSequence : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case c = GetParam();
    model = testing::toy_model(3);
    auto h = make_random_head(model->config, 9);
    ASSERT_TRUE(h.is_ok());
    head = *h;
    EngineOptions o = prefix_options(c.method, head, c.kv_dtype);
    if (c.host_layers) {
      o.tiering.host.push_back(testing::host_tier(8 << 20));
      o.tiering.transport = &local;
      o.tiering.copies = std::make_shared<testing::InlineCopyQueue>(local);
    }
    auto made = Engine::create(model, testing::cpu_backend(), o);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    engine = std::move(*made);
    if (c.host_layers) {
      KvPlacement place = engine->memory().placement();
      place.layer_home = {TierId(0), TierId(1), TierId(1)};
      ASSERT_TRUE(engine->apply_placement(place).is_ok());
    }
    auto ref_made = Engine::create(model, testing::cpu_backend(), prefix_options(c.method, head, c.kv_dtype));
    ASSERT_TRUE(ref_made.is_ok());
    reference = std::move(*ref_made);
    prompt = random_tokens(40, 1, vocab());
  }
  int32_t vocab() const { return static_cast<int32_t>(model->config.vocab_size); }
  // Tokens per block of the retrieval head's key cache (0 without SpeContext).
  int64_t head_block_tokens() const {
    return engine->sparse_options().method == SparseMethod::kSpeContext
               ? engine->sparse_options().selection.budget
               : 0;
  }
  // A source computing the prompt in the engine under test, a fork of its first `prefix` tokens
  // and their snapshot.
  void fork_and_export(int64_t prefix, SeqId& source, SeqId& fork, PrefixSnapshot& snap) {
    Engine& e = *engine;
    auto s = e.memory().add_sequence();
    ASSERT_TRUE(s.is_ok());
    source = *s;
    (void)last_logits(e, source, prompt);
    auto f = e.memory().fork_sequence(source, prefix);
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    fork = *f;
    auto exported = e.memory().export_prefix(source, prefix);
    ASSERT_TRUE(exported.is_ok()) << exported.status().to_string();
    snap = std::move(*exported);
  }
  // A snapshot of `prefix` tokens made again (joined from chunks, exported again) is `want`: the
  // same pages, fused features, Quest bounds and head keys up to the prefix's rows (the last
  // block's rest is never read).
  void expect_same_snapshot(const PrefixSnapshot& got, const PrefixSnapshot& want, int64_t prefix) const {
    EXPECT_TRUE(got.kv == want.kv);
    EXPECT_EQ(got.boundary_fused, want.boundary_fused);
    EXPECT_EQ(got.quest_min, want.quest_min);
    EXPECT_EQ(got.quest_max, want.quest_max);
    ASSERT_EQ(got.head_keys.size(), want.head_keys.size());
    if (!want.head_keys.empty()) {
      const int64_t block = head_block_tokens();
      const size_t rows = static_cast<size_t>((prefix + block - 1) / block * block);
      const size_t used = want.head_keys.size() / rows * static_cast<size_t>(prefix);
      EXPECT_TRUE(std::equal(got.head_keys.begin(), got.head_keys.begin() + static_cast<std::ptrdiff_t>(used),
                             want.head_keys.begin()));
    }
  }
  // `seq` in `on` goes on exactly as `fork` in the engine under test: the prompt's tokens past the
  // prefix, then `tail` decoded a token at a time.
  void expect_goes_on_as(Engine& on, SeqId seq, SeqId fork, int64_t prefix,
                         const std::vector<TokenId>& tail) {
    auto same = [&](std::span<const TokenId> t, const std::string& what) {
      const std::vector<float> want = last_logits(*engine, fork, t);
      ASSERT_FALSE(want.empty());
      EXPECT_EQ(max_abs_diff(last_logits(on, seq, t), want), 0.0f) << what;
    };
    same(std::span(prompt).subspan(static_cast<size_t>(prefix)), "the rest of the prompt");
    for (size_t i = 0; i < tail.size(); ++i) same(std::span(&tail[i], 1), "decode step " + std::to_string(i));
  }
  transport::LocalTransport local;  // declared first: outlives the engines
  std::shared_ptr<Model> model;
  std::shared_ptr<RetrievalHead> head;
  std::unique_ptr<Engine> engine, reference;
  std::vector<TokenId> prompt;  // 40 random tokens
};

TEST_P(ForkSequence, GivesTheLogitsOfComputingThePromptAndLeavesTheSourceIntact) {
  const Case c = GetParam();
  Engine& e = *engine;
  Engine& ref = *reference;
  const std::vector<TokenId> source_tail = random_tokens(6, 2, vocab());  // source decodes these
  const std::vector<TokenId> fork_tail = random_tokens(8, 3, vocab());    // the fork decodes these
  const int64_t prefix = 32;
  ASSERT_EQ(prefix % e.memory().fork_granularity(), 0);

  auto source = e.memory().add_sequence();
  ASSERT_TRUE(source.is_ok());
  (void)last_logits(e, *source, prompt);
  for (size_t i = 0; i < 3; ++i) (void)last_logits(e, *source, std::span(&source_tail[i], 1));
  const int64_t pages_before = e.memory().kv_store().used_pages();  // 43 tokens: 6 pages

  auto fork = e.memory().fork_sequence(*source, prefix);
  ASSERT_TRUE(fork.is_ok()) << fork.status().to_string();
  EXPECT_EQ(e.memory().sequence_length(*fork), prefix);
  EXPECT_EQ(e.memory().kv_store().used_pages(), pages_before);  // nothing new until the fork grows
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();

  // The fork computes prompt[32..40) and decodes; the reference computes all of it.
  auto whole = ref.memory().add_sequence();
  ASSERT_TRUE(whole.is_ok());
  std::vector<float> got = last_logits(e, *fork, std::span(prompt).subspan(prefix));
  std::vector<float> want = last_logits(ref, *whole, prompt);
  ASSERT_FALSE(want.empty());
  EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "the fork's prompt";
  fprintf(stderr, "DIFF %g\n", max_abs_diff(got, want));
  EXPECT_EQ(e.memory().kv_store().used_pages(), pages_before + 1);  // one page of its own for 32..40
  for (size_t i = 0; i < fork_tail.size(); ++i) {
    got = last_logits(e, *fork, std::span(&fork_tail[i], 1));
    want = last_logits(ref, *whole, std::span(&fork_tail[i], 1));
    EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "fork decode step " << i;
  }
  if (c.method != SparseMethod::kDense) {
    EXPECT_GT(e.sparse_stats().sparse_steps, 0);
  }
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();

  // The source goes on as if never forked.
  auto again = ref.memory().add_sequence();
  ASSERT_TRUE(again.is_ok());
  (void)last_logits(ref, *again, prompt);
  for (size_t i = 0; i < 3; ++i) (void)last_logits(ref, *again, std::span(&source_tail[i], 1));
  for (size_t i = 3; i < source_tail.size(); ++i) {
    got = last_logits(e, *source, std::span(&source_tail[i], 1));
    want = last_logits(ref, *again, std::span(&source_tail[i], 1));
    EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "source decode step " << i;
  }

  // Shared pages outlive the source, and go back to the pool with their last holder.
  ASSERT_TRUE(e.memory().remove_sequence(*source).is_ok());
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
  EXPECT_EQ(e.memory().kv_store().used_pages(), (prefix + 8 + 8 + 7) / 8);
  got = last_logits(e, *fork, std::span(&source_tail[0], 1));
  want = last_logits(ref, *whole, std::span(&source_tail[0], 1));
  EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "fork after its source is gone";
  ASSERT_TRUE(e.memory().remove_sequence(*fork).is_ok());
  EXPECT_EQ(e.memory().kv_store().used_pages(), 0);
  ASSERT_TRUE(e.memory().check_invariants().is_ok());
}

TEST_P(ForkSequence, ATruncatedSequenceGoesOnAsIfItHadStoppedThere) {
  const Case c = GetParam();
  Engine& e = *engine;
  Engine& ref = *reference;
  const std::vector<TokenId> old_tail = random_tokens(12, 2, vocab());
  const std::vector<TokenId> new_tail = random_tokens(8, 3, vocab());
  auto seq = e.memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  (void)last_logits(e, *seq, prompt);
  for (TokenId t : old_tail) (void)last_logits(e, *seq, std::span(&t, 1));  // 52 tokens, sparse decode
  EXPECT_EQ(e.memory().truncate_sequence(*seq, 36).code(), StatusCode::kInvalidArgument)
      << "not a whole fork unit";
  EXPECT_EQ(e.memory().truncate_sequence(*seq, 60).code(), StatusCode::kInvalidArgument)
      << "beyond its length";
  ASSERT_TRUE(e.memory().truncate_sequence(*seq, 32).is_ok());
  EXPECT_EQ(e.memory().sequence_length(*seq), 32);
  EXPECT_EQ(e.memory().kv_store().used_pages(), 4);
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
  // Waiting sequences give their working sets back; the next sparse step allocates them again.
  // Only the layers homed off the device have them: a device-homed layer is attended in place.
  const uint64_t device_before = e.memory().kv_store().tier_used_bytes(TierId(0));
  const bool has_sets = c.method != SparseMethod::kDense && c.host_layers;
  if (has_sets) {
    EXPECT_GT(e.memory().working_set_bytes_in_use(), 0u) << "host-homed layers without working sets";
  } else {
    EXPECT_EQ(e.memory().working_set_bytes_in_use(), 0u) << "a device-homed layer with a working set";
  }
  ASSERT_TRUE(e.memory().release_working_sets(*seq).is_ok());
  EXPECT_EQ(e.memory().working_set_bytes_in_use(), 0u);
  if (has_sets) {
    EXPECT_LT(e.memory().kv_store().tier_used_bytes(TierId(0)), device_before) << "working sets released";
  } else {
    EXPECT_EQ(e.memory().kv_store().tier_used_bytes(TierId(0)), device_before);
  }
  auto whole = ref.memory().add_sequence();
  ASSERT_TRUE(whole.is_ok());
  std::vector<float> got = last_logits(e, *seq, std::span(prompt).subspan(32));
  std::vector<float> want = last_logits(ref, *whole, prompt);
  EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "the prompt again from token 32";
  for (size_t i = 0; i < new_tail.size(); ++i) {
    got = last_logits(e, *seq, std::span(&new_tail[i], 1));
    want = last_logits(ref, *whole, std::span(&new_tail[i], 1));
    EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "decode step " << i;
  }
  ASSERT_TRUE(e.memory().check_invariants().is_ok());
}

// Prefix offloading: a prefix exported to host memory and imported again, into the same engine
// or another with its layers elsewhere, goes on exactly as a fork of the source does.
TEST_P(ForkSequence, AnExportedPrefixImportedAgainGoesOnAsAForkOfTheSource) {
  const Case c = GetParam();
  Engine& e = *engine;
  Engine& ref = *reference;
  const std::vector<TokenId> source_tail = random_tokens(3, 2, vocab());
  const std::vector<TokenId> tail = random_tokens(8, 3, vocab());
  const int64_t prefix = 32;
  auto source = e.memory().add_sequence();
  ASSERT_TRUE(source.is_ok());
  (void)last_logits(e, *source, prompt);
  for (TokenId t : source_tail) (void)last_logits(e, *source, std::span(&t, 1));
  auto fork = e.memory().fork_sequence(*source, prefix);
  ASSERT_TRUE(fork.is_ok()) << fork.status().to_string();
  auto snap = e.memory().export_prefix(*source, prefix);
  ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
  EXPECT_EQ(snap->tokens, prefix);
  EXPECT_EQ(snap->kv.size(), 3u * (prefix / 8) * e.memory().kv_store().page_bytes());
  EXPECT_EQ(e.memory().export_prefix(*source, 36).status().code(), StatusCode::kInvalidArgument)
      << "not a whole unit";
  if (c.method == SparseMethod::kSpeContext) {
    // The snapshot's head keys are f32 whatever the KV dtype, holding the values the engine keeps:
    // rounded to the KV dtype (each one converts to it and back unchanged), and not all zero.
    ASSERT_FALSE(snap->head_keys.empty());
    std::vector<uint16_t> narrow(snap->head_keys.size());
    std::vector<float> back(snap->head_keys.size());
    if (c.kv_dtype != DType::kF32) {
      convert_from_f32(c.kv_dtype, snap->head_keys.data(), narrow.data(), narrow.size());
      convert_to_f32(c.kv_dtype, narrow.data(), back.data(), back.size());
      EXPECT_TRUE(back == snap->head_keys) << "head keys rounded to " << dtype_name(c.kv_dtype);
    }
    const size_t used = snap->head_keys.size() / static_cast<size_t>((prefix + head_block_tokens() - 1) /
                                                                     head_block_tokens() * head_block_tokens()) *
                        static_cast<size_t>(prefix);
    size_t nonzero = 0;
    for (size_t i = 0; i < used; ++i) nonzero += snap->head_keys[i] != 0.0f;
    EXPECT_GT(nonzero, used / 2);
  }
  EXPECT_EQ(e.memory().export_prefix(SeqId(99), 8).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(e.memory().remove_sequence(*source).is_ok());
  const int64_t pages_before = e.memory().kv_store().used_pages();  // the fork's 4 shared pages
  auto here = e.memory().import_prefix(*snap);
  ASSERT_TRUE(here.is_ok()) << here.status().to_string();
  EXPECT_EQ(e.memory().sequence_length(*here), prefix);
  EXPECT_EQ(e.memory().kv_store().used_pages(), pages_before + prefix / 8) << "pages of its own";
  auto there = ref.memory().import_prefix(*snap);  // all layers on the device
  ASSERT_TRUE(there.is_ok()) << there.status().to_string();
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
  auto same = [&](std::span<const TokenId> tokens, const std::string& what) {
    const std::vector<float> want = last_logits(e, *fork, tokens);
    ASSERT_FALSE(want.empty());
    EXPECT_EQ(max_abs_diff(last_logits(e, *here, tokens), want), 0.0f) << what << ", imported here";
    EXPECT_EQ(max_abs_diff(last_logits(ref, *there, tokens), want), 0.0f) << what << ", imported there";
  };
  same(std::span(prompt).subspan(prefix), "the rest of the prompt");
  for (size_t i = 0; i < tail.size(); ++i) same(std::span(&tail[i], 1), "decode step " + std::to_string(i));
  if (c.method != SparseMethod::kDense) {
    EXPECT_GT(e.sparse_stats().sparse_steps, 0);
  }
  // An imported sequence exports and forks like any other.
  auto again = e.memory().export_prefix(*here, prefix);
  ASSERT_TRUE(again.is_ok());
  EXPECT_TRUE(again->kv == snap->kv) << "the same pages";
  expect_same_snapshot(*again, *snap, prefix);  // head keys: rounded on import to what they were
  auto fork_of_import = e.memory().fork_sequence(*here, e.memory().fork_granularity());
  EXPECT_TRUE(fork_of_import.is_ok()) << fork_of_import.status().to_string();
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
}

// The shared prefix store's chunks (core/engine/prefix_chunk.h): a prefix cut into chunks (the
// last one shorter), each encoded and parsed back, and joined again is the exported snapshot
// (head keys up to the prefix's rows: the last block's rest is never read) and, imported into
// another engine, goes on exactly as a fork of the source does.
TEST_P(ForkSequence, APrefixCutIntoChunksAndJoinedAgainGoesOnAsAForkOfTheSource) {
  Engine& e = *engine;
  Engine& ref = *reference;
  const std::vector<TokenId> tail = random_tokens(8, 3, vocab());
  const int64_t prefix = 32;
  const int64_t unit = e.memory().fork_granularity();
  const int64_t chunk = unit == 8 ? 24 : 16;  // [0, 24) [24, 32), or [0, 16) [16, 32) under Quest
  const int64_t head_block = head_block_tokens();
  SeqId source, fork;
  PrefixSnapshot snap;
  ASSERT_NO_FATAL_FAILURE(fork_and_export(prefix, source, fork, snap));
  const std::span<const TokenId> tokens = std::span<const TokenId>(prompt).first(prefix);
  std::vector<PrefixChunk> chunks;
  for (int64_t start = 0; start < prefix; start += chunk) {
    auto cut = cut_prefix_chunk(tokens, snap, 77, chunk, start, std::min(start + chunk, prefix), head_block);
    ASSERT_TRUE(cut.is_ok()) << cut.status().to_string();
    const std::vector<std::byte> bytes = encode_prefix_chunk(*cut);
    auto back = parse_prefix_chunk(bytes, "chunk " + std::to_string(start));
    ASSERT_TRUE(back.is_ok()) << back.status().to_string();
    EXPECT_EQ(back->start, start);
    EXPECT_EQ(back->tokens, std::vector<TokenId>(tokens.begin(), tokens.begin() + back->end()));
    EXPECT_EQ(encode_prefix_chunk(*back), bytes);
    chunks.push_back(std::move(*back));
  }
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(cut_prefix_chunk(tokens, snap, 77, chunk, 0, chunk / 2 + 1, head_block).status().code(),
            StatusCode::kInvalidArgument)
      << "not a whole unit";
  auto joined = join_prefix_chunks(chunks, head_block);
  ASSERT_TRUE(joined.is_ok()) << joined.status().to_string();
  EXPECT_EQ(joined->tokens, prefix);
  expect_same_snapshot(*joined, snap, prefix);
  // Out of order, or the second twice: refused.
  std::vector<PrefixChunk> swapped{chunks[1], chunks[0]};
  EXPECT_EQ(join_prefix_chunks(swapped, head_block).status().code(), StatusCode::kDataLoss);
  std::vector<PrefixChunk> twice{chunks[0], chunks[1], chunks[1]};
  EXPECT_EQ(join_prefix_chunks(twice, head_block).status().code(), StatusCode::kDataLoss);
  auto there = ref.memory().import_prefix(*joined);
  ASSERT_TRUE(there.is_ok()) << there.status().to_string();
  expect_goes_on_as(ref, *there, fork, prefix, tail);
}

// The shared prefix store read past what the prefix cache holds (PrefixStore::restore_shared): the
// later chunks joined from their start (join_prefix_chunk_tail) and appended to a fork of the
// source's first chunk (KvMemory::import_prefix_after) make the source's prefix again (the same
// pages, head key rows, fused features and Quest bounds), sharing the first chunk's pages, and go
// on exactly as a fork of the source does. What it cannot append onto changes nothing.
TEST_P(ForkSequence, LaterChunksAppendedToAForkOfTheFirstGoOnAsAForkOfTheSource) {
  Engine& e = *engine;
  const std::vector<TokenId> tail = random_tokens(8, 3, vocab());
  const int64_t prefix = 32;
  const int64_t chunk = 16;  // a whole fork unit under every method: [0, 16) held, [16, 32) read
  const int64_t head_block = head_block_tokens();
  SeqId source, fork;
  PrefixSnapshot snap;
  ASSERT_NO_FATAL_FAILURE(fork_and_export(prefix, source, fork, snap));
  const std::span<const TokenId> tokens = std::span<const TokenId>(prompt).first(prefix);
  auto cut = cut_prefix_chunk(tokens, snap, 77, chunk, chunk, prefix, head_block);
  ASSERT_TRUE(cut.is_ok()) << cut.status().to_string();
  auto back = parse_prefix_chunk(encode_prefix_chunk(*cut), "chunk 16");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  const std::vector<PrefixChunk> later{*back};
  EXPECT_EQ(join_prefix_chunks(later, head_block).status().code(), StatusCode::kDataLoss)
      << "a prefix starts at token 0";
  auto rest = join_prefix_chunk_tail(later);
  ASSERT_TRUE(rest.is_ok()) << rest.status().to_string();
  EXPECT_EQ(rest->tokens, prefix - chunk);
  const int64_t pages_before = e.memory().kv_store().used_pages();
  const int64_t live_before = e.memory().live_sequences();
  // Refused: a prefix that is not a whole unit or longer than the source, an unknown source, a
  // rest whose KV is short. Nothing made, no page taken.
  EXPECT_EQ(e.memory().import_prefix_after(source, 4, *rest).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.memory().import_prefix_after(source, 48, *rest).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.memory().import_prefix_after(SeqId(99), chunk, *rest).status().code(),
            StatusCode::kInvalidArgument);
  PrefixSnapshot short_kv = *rest;
  short_kv.kv.pop_back();
  EXPECT_EQ(e.memory().import_prefix_after(source, chunk, short_kv).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(e.memory().live_sequences(), live_before);
  EXPECT_EQ(e.memory().kv_store().used_pages(), pages_before);
  auto appended = e.memory().import_prefix_after(source, chunk, *rest);
  ASSERT_TRUE(appended.is_ok()) << appended.status().to_string();
  EXPECT_EQ(e.memory().sequence_length(*appended), prefix);
  EXPECT_EQ(e.memory().kv_store().used_pages(), pages_before + (prefix - chunk) / 8)
      << "the first chunk's pages are shared";
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
  auto again = e.memory().export_prefix(*appended, prefix);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  expect_same_snapshot(*again, snap, prefix);
  expect_goes_on_as(e, *appended, fork, prefix, tail);
  ASSERT_TRUE(e.memory().check_invariants().is_ok()) << e.memory().check_invariants().to_string();
}

INSTANTIATE_TEST_SUITE_P(
    Methods, ForkSequence,
    ::testing::Values(Case{SparseMethod::kDense, false}, Case{SparseMethod::kSpeContext, false},
                      Case{SparseMethod::kQuest, false}, Case{SparseMethod::kStreaming, false},
                      Case{SparseMethod::kSpeContext, true}, Case{SparseMethod::kDense, true},
                      // The head's keys in f16 / bf16 (the KV dtype): forks copy, exports widen,
                      // imports round back.
                      Case{SparseMethod::kSpeContext, false, DType::kF16},
                      Case{SparseMethod::kSpeContext, true, DType::kBF16}),
    [](const auto& info) {
      std::string name(sparse_method_name(info.param.method));
      std::erase_if(name, [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); });
      return name + (info.param.host_layers ? "_host" : "") +
             (info.param.kv_dtype != DType::kF32 ? "_" + std::string(dtype_name(info.param.kv_dtype)) : "");
    });

// The chunk fuzzer's seeds (tests/fuzz/corpus/fuzz_prefix_chunk) are chunks the parser takes:
// the fuzzer starts inside the format, not at its magic.
TEST(PrefixChunk, TheFuzzersSeedsParseAndEncodeBackTheSame) {
  int seeds = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(testing::repo_path("tests/fuzz/corpus/fuzz_prefix_chunk"))) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto bytes = std::as_bytes(std::span(text.data(), text.size()));
    auto c = parse_prefix_chunk(bytes, entry.path().string());
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    const std::vector<std::byte> again = encode_prefix_chunk(*c);
    EXPECT_TRUE(std::equal(again.begin(), again.end(), bytes.begin(), bytes.end())) << entry.path();
    ++seeds;
  }
  EXPECT_GE(seeds, 2);
}

TEST(ForkSequence, RefusesPrefixesItCannotShare) {
  auto model = testing::toy_model(2);
  auto head = make_random_head(model->config, 9);
  ASSERT_TRUE(head.is_ok());
  EngineOptions o = prefix_options(SparseMethod::kSpeContext, *head);
  o.prefix_sharing = false;
  auto e = Engine::create(model, testing::cpu_backend(), o);
  ASSERT_TRUE(e.is_ok());
  auto seq = (*e)->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  const std::vector<TokenId> prompt = random_tokens(20, 1, static_cast<int32_t>(model->config.vocab_size));
  (void)last_logits(**e, *seq, prompt);
  for (int64_t bad : {int64_t{0}, int64_t{12}, int64_t{24}, int64_t{-8}}) {
    auto f = (*e)->memory().fork_sequence(*seq, bad);
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ((*e)->memory().fork_sequence(SeqId(77), 8).status().code(), StatusCode::kInvalidArgument);
  auto off = (*e)->memory().fork_sequence(*seq, 16);
  EXPECT_EQ(off.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(off.status().message().find("prefix_sharing"), std::string::npos) << off.status().to_string();
  EXPECT_EQ((*e)->memory().live_sequences(), 1);
  EXPECT_TRUE((*e)->memory().check_invariants().is_ok());
}

TEST(ImportPrefix, RefusesASnapshotOfAnotherLayoutNamingTheField) {
  auto model = testing::toy_model(2);
  auto head = make_random_head(model->config, 9);
  ASSERT_TRUE(head.is_ok());
  auto e = Engine::create(model, testing::cpu_backend(), prefix_options(SparseMethod::kSpeContext, *head));
  ASSERT_TRUE(e.is_ok());
  auto seq = (*e)->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  (void)last_logits(**e, *seq, random_tokens(20, 1, static_cast<int32_t>(model->config.vocab_size)));
  auto snap = (*e)->memory().export_prefix(*seq, 16);
  ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
  const int64_t pages = (*e)->memory().kv_store().used_pages();
  const std::vector<std::pair<std::string, std::function<void(PrefixSnapshot&)>>> breaks{
      {"page_size", [](PrefixSnapshot& s) { s.page_size = 16; }},
      {"layers", [](PrefixSnapshot& s) { s.layers = 3; }},
      {"kv_dtype", [](PrefixSnapshot& s) { s.kv_dtype = DType::kBF16; }},
      {"method", [](PrefixSnapshot& s) { s.method = SparseMethod::kQuest; }},
      {"tokens", [](PrefixSnapshot& s) { s.tokens = 12; }},
      {"tokens", [](PrefixSnapshot& s) { s.tokens = 0; }},
      {"kv", [](PrefixSnapshot& s) { s.kv.pop_back(); }},
      {"head_keys", [](PrefixSnapshot& s) { s.head_keys.resize(3); }},
      {"boundary_fused", [](PrefixSnapshot& s) { s.boundary_fused.pop_back(); }},
      {"boundary_fused", [](PrefixSnapshot& s) { s.boundary_fused.back().clear(); }},
  };
  for (const auto& [field, spoil] : breaks) {
    PrefixSnapshot bad = *snap;
    spoil(bad);
    auto r = (*e)->memory().import_prefix(bad);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(r.status().message().find("'" + field + "'"), std::string::npos) << r.status().to_string();
    EXPECT_EQ((*e)->memory().live_sequences(), 1) << field;
    EXPECT_EQ((*e)->memory().kv_store().used_pages(), pages) << field;
  }
  // A full engine refuses with kResourceExhausted and keeps nothing.
  EngineOptions one = prefix_options(SparseMethod::kSpeContext, *head);
  one.max_sequences = 1;
  auto small = Engine::create(model, testing::cpu_backend(), one);
  ASSERT_TRUE(small.is_ok());
  ASSERT_TRUE((*small)->memory().import_prefix(*snap).is_ok());
  EXPECT_EQ((*small)->memory().import_prefix(*snap).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ((*small)->memory().live_sequences(), 1);
  EXPECT_TRUE((*small)->memory().check_invariants().is_ok());
}

// Out of a remote node and into one: the snapshot goes through the bounce buffer both ways.
TEST(ImportPrefix, MovesAPrefixBetweenEnginesWhoseLayersLiveOnARemoteNode) {
  for (SparseMethod method : {SparseMethod::kDense, SparseMethod::kQuest, SparseMethod::kSpeContext}) {
    SCOPED_TRACE(std::string(sparse_method_name(method)));
    auto model = testing::toy_model(3);
    auto head = make_random_head(model->config, 9);
    ASSERT_TRUE(head.is_ok());
    std::vector<std::unique_ptr<Transport>> links;
    auto remote_engine = [&](std::vector<TierId> homes) {
      auto lb = transport::LoopbackRemoteTransport::create();
      EXPECT_TRUE(lb.is_ok());
      links.push_back(std::move(*lb));
      EngineOptions o = prefix_options(method, *head);
      o.tiering.remote.push_back(testing::remote_tier(8 << 20));
      o.tiering.transport = links.back().get();
      o.tiering.copies = std::make_shared<testing::InlineCopyQueue>(*links.back());
      auto made = Engine::create(model, testing::cpu_backend(), o);
      EXPECT_TRUE(made.is_ok()) << made.status().to_string();
      KvPlacement place = (*made)->memory().placement();
      place.layer_home = std::move(homes);
      EXPECT_TRUE((*made)->apply_placement(place).is_ok());
      return std::move(*made);
    };
    const TierId dev(0), node(1);
    auto from = remote_engine({node, dev, node});
    auto to = remote_engine({dev, node, node});
    auto ref = Engine::create(model, testing::cpu_backend(), prefix_options(method, *head));
    ASSERT_TRUE(ref.is_ok());
    const std::vector<TokenId> prompt = random_tokens(40, 1, static_cast<int32_t>(model->config.vocab_size));
    auto src = from->memory().add_sequence();
    ASSERT_TRUE(src.is_ok());
    (void)last_logits(*from, *src, prompt);
    auto snap = from->memory().export_prefix(*src, 32);
    ASSERT_TRUE(snap.is_ok()) << snap.status().to_string();
    auto imported = to->memory().import_prefix(*snap);
    ASSERT_TRUE(imported.is_ok()) << imported.status().to_string();
    auto whole = (*ref)->memory().add_sequence();
    ASSERT_TRUE(whole.is_ok());
    std::vector<float> got = last_logits(*to, *imported, std::span(prompt).subspan(32));
    std::vector<float> want = last_logits(**ref, *whole, prompt);
    ASSERT_FALSE(want.empty());
    EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "the rest of the prompt";
    for (TokenId t : random_tokens(6, 3, static_cast<int32_t>(model->config.vocab_size))) {
      got = last_logits(*to, *imported, std::span(&t, 1));
      want = last_logits(**ref, *whole, std::span(&t, 1));
      EXPECT_LE(max_abs_diff(got, want), 1e-4f) << "decode";
    }
    EXPECT_TRUE(to->memory().check_invariants().is_ok()) << to->memory().check_invariants().to_string();
  }
}

}  // namespace
}  // namespace specontext
