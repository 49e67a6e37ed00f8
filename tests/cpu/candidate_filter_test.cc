// CpuCandidateFilter against ReferenceCandidateFilter: random and tie-heavy keys, MHA/GQA/MQA,
// page sizes 1/16/64, lengths that are not page multiples, incremental vs bulk appends, 1 and 2
// threads; shortlist invariants (sinks, window, sizes); every token as candidates then
// select_among_candidates == select_tokens; argument errors; drop and reuse; failed appends
// change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/ports/selection.h"
#include "core/sparse/candidate_select.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_candidate_filter.h"
#include "cpu/reference_backend.h"

namespace specontext::cpu {
namespace {

struct Shape {
  int64_t n_heads, n_kv_heads, head_dim;
};

// Normal keys, or keys and queries from {-1, 0, 1} so that page bounds tie often.
std::vector<float> make_values(size_t n, uint32_t seed, bool ties) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = ties ? static_cast<float>(static_cast<int>(rng() % 3) - 1) : nd(rng);
  return v;
}

std::unique_ptr<CpuCandidateFilter> make_cpu(const CandidateFilterOptions& o, int threads = 0) {
  auto f = CpuCandidateFilter::create({o, 0, threads});
  EXPECT_TRUE(f.is_ok()) << f.status().to_string();
  return f.is_ok() ? std::move(*f) : nullptr;
}

std::vector<int32_t> cand_vec(const Candidates& c, int64_t h) {
  return {c.tokens.begin() + c.offsets[static_cast<size_t>(h)],
          c.tokens.begin() + c.offsets[static_cast<size_t>(h + 1)]};
}

void expect_same(const Candidates& got, const Candidates& want, const std::string& what) {
  ASSERT_EQ(got.kv_heads, want.kv_heads) << what;
  ASSERT_EQ(got.length, want.length) << what;
  ASSERT_EQ(got.offsets, want.offsets) << what;
  ASSERT_EQ(got.tokens, want.tokens) << what;
}

// What every shortlist must satisfy: ascending unique positions below length, every sink' and
// window' token present, and max(shortlist_tokens, forced pages' tokens) of them per head.
void expect_invariants(const Candidates& c, int64_t length, int64_t page, int64_t shortlist_tokens,
                       const SelectionOptions& sel, const std::string& what) {
  const FixedTokens fx = fixed_tokens(sel);
  std::set<int64_t> forced_pages;
  for (int64_t t = 0; t < std::min(fx.sinks, length); ++t) forced_pages.insert(t / page);
  for (int64_t t = std::max(fx.sinks, length - fx.window); t < length; ++t) forced_pages.insert(t / page);
  int64_t forced_tokens = 0;
  for (int64_t p : forced_pages) forced_tokens += std::min(length, (p + 1) * page) - p * page;
  for (int64_t h = 0; h < c.kv_heads; ++h) {
    const auto v = cand_vec(c, h);
    ASSERT_TRUE(std::is_sorted(v.begin(), v.end())) << what;
    ASSERT_EQ(std::adjacent_find(v.begin(), v.end()), v.end()) << what;
    if (!v.empty()) {
      ASSERT_GE(v.front(), 0) << what;
      ASSERT_LT(v.back(), length) << what;
    }
    const std::set<int32_t> s(v.begin(), v.end());
    for (int64_t t = 0; t < std::min(fx.sinks, length); ++t)
      EXPECT_TRUE(s.count(static_cast<int32_t>(t))) << what;
    for (int64_t t = std::max(fx.sinks, length - fx.window); t < length; ++t) {
      EXPECT_TRUE(s.count(static_cast<int32_t>(t))) << what << " window token " << t;
    }
    const int64_t want = length <= shortlist_tokens ? length : std::max(shortlist_tokens, forced_tokens);
    EXPECT_EQ(static_cast<int64_t>(v.size()), want) << what << " head " << h;
  }
}

TEST(CpuCandidateFilter, MatchesReferenceOnRandomData) {
  const std::vector<Shape> shapes = {{4, 4, 8}, {8, 2, 32}, {4, 1, 16}};
  const std::vector<SelectionOptions> sels = {{64, 1, 4}, {32, 0, 0}, {16, 4, 40}, {3, 1, 4}};
  uint32_t seed = 1;
  int compared = 0;
  for (const Shape& sh : shapes) {
    for (int64_t page : {1, 16, 64}) {
      for (bool ties : {false, true}) {
        const CandidateFilterOptions o{page, sh.n_heads, sh.n_kv_heads, sh.head_dim};
        const int64_t kvd = sh.n_kv_heads * sh.head_dim;
        const int64_t total = 1037;  // not a multiple of any page size but 1
        const auto keys = make_values(static_cast<size_t>(total * kvd), ++seed, ties);
        auto ref = ReferenceCandidateFilter::create(o);
        ASSERT_TRUE(ref.is_ok());
        auto bulk = make_cpu(o), incr = make_cpu(o, 1);
        ASSERT_NE(bulk, nullptr);
        ASSERT_NE(incr, nullptr);
        const SeqId s(42);
        ASSERT_TRUE((*ref)->append_keys(s, keys.data(), 0, total).is_ok());
        ASSERT_TRUE(bulk->append_keys(s, keys.data(), 0, total).is_ok());
        // Incremental appends of random sizes (0, single tokens, across page boundaries).
        std::mt19937 rng(seed);
        for (int64_t at = 0; at < total;) {
          const int64_t n =
              std::min<int64_t>(total - at, rng() % 4 == 0 ? 1 : static_cast<int64_t>(rng() % 150));
          ASSERT_TRUE(incr->append_keys(s, keys.data() + at * kvd, at, n).is_ok());
          at += n;
        }
        ASSERT_EQ(incr->length(s), total);
        for (int64_t length : {int64_t{1}, int64_t{17}, int64_t{100}, int64_t{640}, total}) {
          for (int64_t c : {1, 5, 64, 200, 2000}) {
            const auto q = make_values(static_cast<size_t>(sh.n_heads * sh.head_dim), ++seed, ties);
            const SelectionOptions& sel = sels[static_cast<size_t>(seed) % sels.size()];
            Candidates want, got_bulk, got_incr;
            ASSERT_TRUE((*ref)->shortlist(s, q.data(), length, c, sel, want).is_ok());
            ASSERT_TRUE(bulk->shortlist(s, q.data(), length, c, sel, got_bulk).is_ok());
            ASSERT_TRUE(incr->shortlist(s, q.data(), length, c, sel, got_incr).is_ok());
            const std::string what = "heads " + std::to_string(sh.n_heads) + "/" +
                                     std::to_string(sh.n_kv_heads) + " page " + std::to_string(page) +
                                     (ties ? " ties" : "") + " length " + std::to_string(length) + " C " +
                                     std::to_string(c);
            expect_same(got_bulk, want, what + " (bulk)");
            expect_same(got_incr, want, what + " (incremental, 1 thread)");
            expect_invariants(want, length, page, c, sel, what);
            ++compared;
          }
        }
      }
    }
  }
  EXPECT_EQ(compared, 3 * 3 * 2 * 5 * 5);
}

// shortlist_tokens >= length gives every token, and scoring those candidates is select_tokens.
TEST(CpuCandidateFilter, EveryTokenThenSelectionEqualsSelectTokens) {
  ReferenceBackend backend;
  for (const Shape& sh : std::vector<Shape>{{8, 8, 16}, {8, 2, 32}, {4, 1, 64}}) {
    RetrievalHead head;
    head.config.n_heads = sh.n_heads;
    head.config.n_kv_heads = sh.n_kv_heads;
    head.config.head_dim = sh.head_dim;
    const int64_t length = 533, kvd = sh.n_kv_heads * sh.head_dim;
    const auto keys = make_values(static_cast<size_t>(length * kvd), 5, false);
    auto q = make_values(static_cast<size_t>(sh.n_heads * sh.head_dim), 6, false);
    for (float& x : q) x *= 3.0f;  // sharper softmaxes
    auto f = make_cpu({16, sh.n_heads, sh.n_kv_heads, sh.head_dim});
    ASSERT_NE(f, nullptr);
    ASSERT_TRUE(f->append_keys(SeqId(0), keys.data(), 0, length).is_ok());
    std::vector<float> scores(static_cast<size_t>(sh.n_heads * length));
    retrieval_scores(head, q.data(), keys.data(), length, scores.data());
    for (int64_t c : {length, length + 1, int64_t{100000}}) {
      Candidates cand;
      ASSERT_TRUE(f->shortlist(SeqId(0), q.data(), length, c, {}, cand).is_ok());
      for (int64_t h = 0; h < sh.n_kv_heads; ++h) {
        ASSERT_EQ(cand.count(h), length);
        for (int64_t t = 0; t < length; ++t) ASSERT_EQ(cand_vec(cand, h)[static_cast<size_t>(t)], t);
      }
      for (const SelectionOptions& sel :
           std::vector<SelectionOptions>{{64, 1, 4}, {256, 4, 16}, {600, 1, 4}}) {
        Selection want, got;
        select_tokens(scores, sh.n_heads, sh.n_kv_heads, length, sel, want);
        ASSERT_TRUE(select_among_candidates(q.data(), keys.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim,
                                            cand, sel, got)
                        .is_ok());
        EXPECT_EQ(got.indices, want.indices);
        EXPECT_EQ(got.counts, want.counts);
      }
    }
  }
}

// The filtered selection is a selection among its candidates: within budget and with sinks and
// window, for a shortlist smaller than the sequence.
TEST(CpuCandidateFilter, FilteredSelectionKeepsSinksAndWindow) {
  const Shape sh{8, 2, 32};
  const int64_t length = 900, kvd = sh.n_kv_heads * sh.head_dim;
  const auto keys = make_values(static_cast<size_t>(length * kvd), 9, false);
  const auto q = make_values(static_cast<size_t>(sh.n_heads * sh.head_dim), 10, false);
  auto f = make_cpu({16, sh.n_heads, sh.n_kv_heads, sh.head_dim});
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(f->append_keys(SeqId(5), keys.data(), 0, length).is_ok());
  const SelectionOptions sel{64, 2, 20};
  Candidates cand;
  ASSERT_TRUE(f->shortlist(SeqId(5), q.data(), length, 128, sel, cand).is_ok());
  expect_invariants(cand, length, 16, 128, sel, "C 128");
  Selection out;
  ASSERT_TRUE(
      select_among_candidates(q.data(), keys.data(), sh.n_heads, sh.n_kv_heads, sh.head_dim, cand, sel, out)
          .is_ok());
  for (int64_t h = 0; h < sh.n_kv_heads; ++h) {
    const auto s = out.head(h);
    ASSERT_EQ(static_cast<int64_t>(s.size()), sel.budget);
    const std::set<int32_t> in(s.begin(), s.end());
    const auto cv = cand_vec(cand, h);
    const std::set<int32_t> cs(cv.begin(), cv.end());
    for (int32_t t : s) EXPECT_TRUE(cs.count(t));
    for (int32_t t = 0; t < 2; ++t) EXPECT_TRUE(in.count(t));
    for (int32_t t = static_cast<int32_t>(length) - 20; t < length; ++t) EXPECT_TRUE(in.count(t));
  }
}

void expect_invalid(const Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos)
      << "message: " << st.message() << "\nwanted: " << needle;
}

TEST(CpuCandidateFilter, ArgumentErrorsNameTheField) {
  expect_invalid(CpuCandidateFilter::create({{16, 6, 4, 8}, 0, 0}).status(),
                 "n_heads (6) must be a multiple of n_kv_heads (4)");
  expect_invalid(CpuCandidateFilter::create({{16, 0, 1, 8}, 0, 0}).status(),
                 "CandidateFilterOptions.n_heads");
  expect_invalid(CpuCandidateFilter::create({{16, 4, 4, 0}, 0, 0}).status(),
                 "CandidateFilterOptions.head_dim");
  expect_invalid(CpuCandidateFilter::create({{0, 4, 4, 8}, 0, 0}).status(),
                 "CandidateFilterOptions.page_size");
  expect_invalid(CpuCandidateFilter::create({{16, 4, 4, 8}, 0, -1}).status(), "num_threads");
  expect_invalid(CpuCandidateFilter::create({{16, 4, 4, 8}, 4096, 0}).status(), "numa_node 4096");
  expect_invalid(CpuCandidateFilter::create({{16, 4, 4, 8}, -1, 0}).status(), "numa_node -1");

  auto f = make_cpu({4, 2, 1, 2});
  ASSERT_NE(f, nullptr);
  const auto keys = make_values(40, 3, false);
  const SeqId s(3);
  expect_invalid(f->append_keys(s, keys.data(), 2, 2), "start 2 is out of order");
  EXPECT_EQ(f->length(s), 0);
  ASSERT_TRUE(f->append_keys(s, keys.data(), 0, 6).is_ok());
  expect_invalid(f->append_keys(s, keys.data(), 4, 1),
                 "start 4 is out of order (the sequence holds 6 tokens");
  expect_invalid(f->append_keys(s, keys.data(), 6, -1), "n must be >= 0");
  expect_invalid(f->append_keys(s, nullptr, 6, 1), "keys is null");
  const std::vector<float> q = {1, 2, 3, 4};
  Candidates c;
  expect_invalid(f->shortlist(SeqId(8), q.data(), 1, 2, {}, c), "unknown sequence 8");
  expect_invalid(f->shortlist(s, q.data(), 7, 2, {}, c), "length 7 exceeds the 6 tokens appended");
  expect_invalid(f->shortlist(s, q.data(), -1, 2, {}, c), "length must be >= 0");
  expect_invalid(f->shortlist(s, q.data(), 6, 0, {}, c), "shortlist_tokens must be >= 1");
  expect_invalid(f->shortlist(s, q.data(), 6, 2, {4, -1, 1}, c), "SelectionOptions.sinks");
  expect_invalid(f->shortlist(s, nullptr, 6, 2, {}, c), "q is null");
  const std::vector<float> qn = {1, INFINITY, 3, 4};
  expect_invalid(f->shortlist(s, qn.data(), 6, 2, {}, c), "query head 0 is not finite");
}

TEST(CpuCandidateFilter, FailedAppendChangesNothing) {
  const CandidateFilterOptions o{8, 4, 2, 8};
  const int64_t kvd = 16;
  auto f = make_cpu(o);
  auto ref = ReferenceCandidateFilter::create(o);
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(ref.is_ok());
  auto keys = make_values(static_cast<size_t>(100 * kvd), 11, false);
  ASSERT_TRUE(f->append_keys(SeqId(1), keys.data(), 0, 50).is_ok());
  ASSERT_TRUE((*ref)->append_keys(SeqId(1), keys.data(), 0, 50).is_ok());
  auto poisoned = keys;
  poisoned[static_cast<size_t>(70 * kvd + 9)] = NAN;  // position 70, KV head 1
  expect_invalid(f->append_keys(SeqId(1), poisoned.data() + 50 * kvd, 50, 50), "position 70, KV head 1");
  EXPECT_EQ(f->length(SeqId(1)), 50);
  // A new sequence whose first append fails does not exist afterwards.
  expect_invalid(f->append_keys(SeqId(2), poisoned.data() + 60 * kvd, 0, 20), "position 10, KV head 1");
  EXPECT_EQ(f->length(SeqId(2)), 0);
  Candidates c;
  expect_invalid(f->shortlist(SeqId(2), keys.data(), 1, 1, {}, c), "unknown sequence 2");
  // A bulk append large enough for the parallel finiteness scan names the same first bad key.
  {
    auto big = make_cpu({16, 8, 4, 16});
    ASSERT_NE(big, nullptr);
    auto many = make_values(static_cast<size_t>(3000 * 64), 13, false);
    many[static_cast<size_t>(2100 * 64 + 40)] = -INFINITY;  // position 2100, KV head 2
    many[static_cast<size_t>(2900 * 64 + 1)] = NAN;
    expect_invalid(big->append_keys(SeqId(4), many.data(), 0, 3000),
                   "position 2100, KV head 2 is not finite");
    EXPECT_EQ(big->length(SeqId(4)), 0);
  }
  // The sequence continues as if the failed call never happened.
  ASSERT_TRUE(f->append_keys(SeqId(1), keys.data() + 50 * kvd, 50, 50).is_ok());
  ASSERT_TRUE((*ref)->append_keys(SeqId(1), keys.data() + 50 * kvd, 50, 50).is_ok());
  const auto q = make_values(32, 12, false);
  Candidates want;
  ASSERT_TRUE(f->shortlist(SeqId(1), q.data(), 100, 30, {16, 1, 4}, c).is_ok());
  ASSERT_TRUE((*ref)->shortlist(SeqId(1), q.data(), 100, 30, {16, 1, 4}, want).is_ok());
  expect_same(c, want, "after a failed append");
}

TEST(CpuCandidateFilter, DropThenReuseTheId) {
  const CandidateFilterOptions o{16, 8, 2, 16};
  const int64_t kvd = 32;
  auto f = make_cpu(o);
  ASSERT_NE(f, nullptr);
  const auto a = make_values(static_cast<size_t>(300 * kvd), 21, false);
  const auto b = make_values(static_cast<size_t>(200 * kvd), 22, false);
  const auto q = make_values(128, 23, false);
  ASSERT_TRUE(f->append_keys(SeqId(9), a.data(), 0, 300).is_ok());
  ASSERT_TRUE(f->append_keys(SeqId(10), b.data(), 0, 200).is_ok());
  EXPECT_GT(f->summary_bytes(SeqId(9)), 0);
  f->drop(SeqId(9));
  f->drop(SeqId(9));   // no-op
  f->drop(SeqId(77));  // unknown: no-op
  EXPECT_EQ(f->length(SeqId(9)), 0);
  EXPECT_EQ(f->summary_bytes(SeqId(9)), 0);
  Candidates c, want;
  expect_invalid(f->shortlist(SeqId(9), q.data(), 10, 5, {}, c), "unknown sequence 9");
  // Reuse: the summaries are those of the new keys only.
  ASSERT_TRUE(f->append_keys(SeqId(9), b.data(), 0, 200).is_ok());
  auto ref = ReferenceCandidateFilter::create(o);
  ASSERT_TRUE(ref.is_ok());
  ASSERT_TRUE((*ref)->append_keys(SeqId(9), b.data(), 0, 200).is_ok());
  ASSERT_TRUE(f->shortlist(SeqId(9), q.data(), 200, 48, {32, 1, 4}, c).is_ok());
  ASSERT_TRUE((*ref)->shortlist(SeqId(9), q.data(), 200, 48, {32, 1, 4}, want).is_ok());
  expect_same(c, want, "reused id");
  // The other sequence was untouched: it gives the same as the reused one (same keys).
  Candidates other;
  ASSERT_TRUE(f->shortlist(SeqId(10), q.data(), 200, 48, {32, 1, 4}, other).is_ok());
  expect_same(other, want, "sibling sequence");
}

}  // namespace
}  // namespace specontext::cpu
