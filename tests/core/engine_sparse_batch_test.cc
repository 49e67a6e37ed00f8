// SpeContext with several sequences in one step: the retrieval head runs once for all sparse
// sequences of the step (Engine::make_shared_selections), one row each. A batch must select, for
// every sequence, what that sequence selects when it decodes alone, and give its logits; the
// sequences have different contexts and tokens, so a query row given to the wrong sequence or a
// key row stored in the wrong sequence's head cache changes the selections.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "core/engine/engine.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "cpu/reference_backend.h"
#include "tests/core/tier_test_util.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

// Layer 0's selections of a forward (SpeContext shares one selection across layers), by the
// item's row in the forward.
class SelectionRecorder : public ForwardObserver {
 public:
  void on_sparse_selection(LayerId layer, std::span<const AttentionItem> items,
                           std::span<const Selection* const> selections) override {
    if (layer.value() != 0) return;
    for (size_t i = 0; i < items.size(); ++i) by_offset[items[i].token_offset] = *selections[i];
  }
  std::map<int64_t, Selection> by_offset;
};

bool same_selection(const Selection& a, const Selection& b) {
  if (a.kv_heads != b.kv_heads) return false;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    const auto x = a.head(h), y = b.head(h);
    if (!std::equal(x.begin(), x.end(), y.begin(), y.end())) return false;
  }
  return true;
}

std::shared_ptr<Backend> backend_named(const std::string& name) {
  if (name == "reference") return std::make_shared<cpu::ReferenceBackend>();
  cpu::CpuBackendOptions o;
  o.num_threads = 2;
  auto b = cpu::create_cpu_backend(o);
  EXPECT_TRUE(b.is_ok());
  return std::shared_ptr<Backend>(std::move(*b));
}

class EngineSparseBatch : public ::testing::TestWithParam<std::string> {};

// The whole check for a head whose groups combine by `reduce`; `last` gets the batch's
// selections of the last step.
void batch_selects_what_each_sequence_selects_alone(const std::string& backend, GroupReduce reduce,
                                                    std::vector<Selection>& last) {
  auto model = testing::toy_model(2);
  auto head = make_random_head(model->config, 9);
  ASSERT_TRUE(head.is_ok());
  (*head)->config.select_group = reduce;
  EngineOptions o;
  o.max_sequences = 5;
  o.max_context = 256;
  o.page_size = 8;
  o.sparse.method = SparseMethod::kSpeContext;
  o.sparse.selection = {12, 1, 3};
  o.retrieval_head = *head;
  auto alone_or = Engine::create(model, backend_named(backend), o);
  auto batch_or = Engine::create(model, backend_named(backend), o);
  ASSERT_TRUE(alone_or.is_ok() && batch_or.is_ok());
  Engine& alone = **alone_or;
  Engine& batch = **batch_or;
  SelectionRecorder alone_sel, batch_sel;
  alone.set_observer(&alone_sel);
  batch.set_observer(&batch_sel);

  // Three sequences with different prompts and lengths, prefilled one by one in both engines.
  constexpr int kSeqs = 3;
  const int64_t lengths[kSeqs] = {41, 29, 57};
  std::vector<SeqId> a_ids, b_ids;
  std::vector<TokenId> next(kSeqs);
  for (int i = 0; i < kSeqs; ++i) {
    std::vector<TokenId> prompt;
    for (int64_t t = 0; t < lengths[i]; ++t) prompt.push_back(static_cast<TokenId>((7 * t + 13 * i + t * t) % 97 + 1));
    auto a = alone.memory().add_sequence(), b = batch.memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    a_ids.push_back(*a);
    b_ids.push_back(*b);
    StepRequest ra{*a, prompt, LogitsMode::kLast}, rb{*b, prompt, LogitsMode::kLast};
    auto oa = alone.forward(std::span<const StepRequest>(&ra, 1));
    auto ob = batch.forward(std::span<const StepRequest>(&rb, 1));
    ASSERT_TRUE(oa.is_ok() && ob.is_ok());
    auto row = oa->row(0);
    next[static_cast<size_t>(i)] = static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
  }
  // A fourth sequence prefills in the middle of the batch at step 1 (its tokens sit between the
  // decoding rows: the head's inputs are gathered, not read in place).
  const std::vector<TokenId> extra_prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  auto extra = batch.memory().add_sequence();
  ASSERT_TRUE(extra.is_ok());

  int64_t compared = 0;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Alone: each sequence decodes in its own forward.
    std::vector<Selection> want(kSeqs);
    std::vector<std::vector<float>> want_logits(kSeqs);
    for (int i = 0; i < kSeqs; ++i) {
      alone_sel.by_offset.clear();
      StepRequest r{a_ids[static_cast<size_t>(i)], std::span<const TokenId>(&next[static_cast<size_t>(i)], 1),
                    LogitsMode::kLast};
      auto out = alone.forward(std::span<const StepRequest>(&r, 1));
      ASSERT_TRUE(out.is_ok()) << out.status().to_string();
      ASSERT_EQ(alone_sel.by_offset.size(), 1u) << "sequence " << i << " did not decode sparsely";
      want[static_cast<size_t>(i)] = alone_sel.by_offset.begin()->second;
      want_logits[static_cast<size_t>(i)].assign(out->row(0).begin(), out->row(0).end());
    }
    // Batched: all three in one forward (at step 1 with the fourth's prefill between them).
    batch_sel.by_offset.clear();
    std::vector<StepRequest> reqs;
    std::vector<int64_t> offset(kSeqs), out_row(kSeqs);
    int64_t rows = 0, off = 0;
    for (int i = 0; i < kSeqs; ++i) {
      if (step == 1 && i == 1) {
        reqs.push_back({*extra, extra_prompt, LogitsMode::kLast});
        off += static_cast<int64_t>(extra_prompt.size());
        ++rows;
      }
      reqs.push_back({b_ids[static_cast<size_t>(i)], std::span<const TokenId>(&next[static_cast<size_t>(i)], 1),
                      LogitsMode::kLast});
      offset[static_cast<size_t>(i)] = off++;
      out_row[static_cast<size_t>(i)] = rows++;
    }
    auto out = batch.forward(reqs);
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    for (int i = 0; i < kSeqs; ++i) {
      SCOPED_TRACE("sequence " + std::to_string(i));
      auto it = batch_sel.by_offset.find(offset[static_cast<size_t>(i)]);
      ASSERT_NE(it, batch_sel.by_offset.end());
      EXPECT_TRUE(same_selection(it->second, want[static_cast<size_t>(i)]));
      const auto row = out->row(static_cast<size_t>(out_row[static_cast<size_t>(i)]));
      EXPECT_LT(testing::rel_l2(std::vector<float>(row.begin(), row.end()), want_logits[static_cast<size_t>(i)]), 1e-5);
      ++compared;
      const auto& wl = want_logits[static_cast<size_t>(i)];
      next[static_cast<size_t>(i)] = static_cast<TokenId>(std::max_element(wl.begin(), wl.end()) - wl.begin());
    }
  }
  EXPECT_EQ(compared, 5 * kSeqs);
  // The selections differ between the sequences (else a mix-up of rows could go unseen).
  for (const auto& [off, sel] : batch_sel.by_offset) last.push_back(sel);
  ASSERT_EQ(last.size(), static_cast<size_t>(kSeqs));
  EXPECT_FALSE(same_selection(last[0], last[1]));
  EXPECT_FALSE(same_selection(last[1], last[2]));
}

TEST_P(EngineSparseBatch, BatchSelectsWhatEachSequenceSelectsAlone) {
  std::vector<Selection> last;
  batch_selects_what_each_sequence_selects_alone(GetParam(), GroupReduce::kMax, last);
}

// A head whose query heads take turns (select_group "turns") goes through select_by_turns, batched
// as alone, and selects otherwise than the same head's group max at some sequence.
TEST_P(EngineSparseBatch, AHeadWhoseGroupsTakeTurnsSelectsByTurnsBatchedAsAlone) {
  std::vector<Selection> by_max, by_turns;
  batch_selects_what_each_sequence_selects_alone(GetParam(), GroupReduce::kMax, by_max);
  batch_selects_what_each_sequence_selects_alone(GetParam(), GroupReduce::kTurns, by_turns);
  ASSERT_EQ(by_max.size(), by_turns.size());
  bool differ = false;
  for (size_t i = 0; i < by_max.size(); ++i) differ |= !same_selection(by_max[i], by_turns[i]);
  EXPECT_TRUE(differ);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineSparseBatch, ::testing::Values("cpu", "reference"));

}  // namespace
}  // namespace specontext
