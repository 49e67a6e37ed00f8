// The sparse-decode ops (kv_gather, attention_sparse): CpuBackend against ReferenceBackend on
// random shapes (GQA 8/2, MQA 8/1, MHA 4/4; head_dim 8, 64, 128; per-head counts including 0
// and == slots; items of 1 and 2 rows), and both against independent definitions:
//  * kv_gather copies cache rows bit-exactly and writes nothing else (sentinel slots and guard
//    regions survive);
//  * a working set holding every token [0, L) gives exactly the dense causal attention of a
//    decode token at position L - 1 ("sparse attention with B = length equals dense");
//  * a working set holding a subset gives dense attention restricted to those positions (a
//    scalar loop written here, independent of both backends).
// Working-set slots beyond counts[h] hold NaN, so reading one fails the finiteness checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/host_math.h"
#include "core/ports/selection.h"
#include "core/sparse/elastic.h"
#include "cpu/cpu_backend.h"
#include "cpu/reference_backend.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::cpu {
namespace {

using testing::all_finite;
using testing::expect_close;
using testing::GuardedBuffer;
using testing::l2_norm;
using testing::make_cpu;
using testing::PagedKv;
using testing::random_floats;
using testing::rel_l2;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

struct HeadShape {
  int64_t n_heads, kv_heads;
};
constexpr HeadShape kHeadShapes[] = {{8, 2}, {8, 1}, {4, 4}};  // GQA, MQA, MHA
constexpr int64_t kHeadDims[] = {8, 64, 128};

std::string shape_name(const HeadShape& s, int64_t head_dim) {
  return "heads " + std::to_string(s.n_heads) + "/" + std::to_string(s.kv_heads) + " head_dim " +
         std::to_string(head_dim);
}

// One working set ([kv_heads][slots][head_dim] K and V) between guard regions, every slot NaN
// (or `fill`) until written.
struct WorkingSet {
  int64_t kv_heads, slots, head_dim;
  GuardedBuffer k, v;
  std::vector<int32_t> counts;

  WorkingSet(int64_t kvh, int64_t n_slots, int64_t hd, float fill = kNan)
      : kv_heads(kvh),
        slots(n_slots),
        head_dim(hd),
        k(static_cast<size_t>(kvh * n_slots * hd), fill),
        v(static_cast<size_t>(kvh * n_slots * hd), fill),
        counts(static_cast<size_t>(kvh), 0) {}
  WorkingSetView view() { return {k.data(), v.data(), kv_heads, slots, head_dim, counts.data()}; }
  float* k_row(int64_t h, int64_t s) { return k.data() + (h * slots + s) * head_dim; }
  float* v_row(int64_t h, int64_t s) { return v.data() + (h * slots + s) * head_dim; }
};

// Dense attention of one query vector restricted to the cache positions `keys` of KV head
// `kvh`, as a plain double loop (independent of both backends). Empty `keys` gives zeros.
void restricted_dense(const float* qh, PagedKv& cache, int64_t kvh, const std::vector<int32_t>& keys,
                      float* out) {
  const int64_t d = cache.view.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s(keys.size());
  double mx = -std::numeric_limits<double>::infinity();
  for (size_t j = 0; j < keys.size(); ++j) {
    const float* k = cache.k_at(keys[j], kvh);
    double dot = 0.0;
    for (int64_t e = 0; e < d; ++e) dot += static_cast<double>(qh[e]) * k[e];
    s[j] = dot * scale;
    mx = std::max(mx, s[j]);
  }
  double denom = 0.0;
  for (double& x : s) {
    x = std::exp(x - mx);
    denom += x;
  }
  for (int64_t e = 0; e < d; ++e) {
    double acc = 0.0;
    for (size_t j = 0; j < keys.size(); ++j) acc += s[j] * cache.v_at(keys[j], kvh)[e];
    out[e] = keys.empty() ? 0.0f : static_cast<float>(acc / denom);
  }
}

// Distinct random positions of [0, length), `n` of them, in random order.
std::vector<int32_t> random_subset(std::mt19937& rng, int64_t length, int64_t n) {
  std::vector<int32_t> all(static_cast<size_t>(length));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(n));
  return all;
}

// ---------------------------------------------------------------------------------------------

TEST(SparseOpsTest, BothCpuBackendsSupportTheSparseOps) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  for (const Backend* b : {static_cast<const Backend*>(&ref), static_cast<const Backend*>(cpu.get())}) {
    EXPECT_TRUE(b->supports(BackendOp::kKvGather, DType::kF32)) << b->name();
    EXPECT_TRUE(b->supports(BackendOp::kAttentionSparse, DType::kF32)) << b->name();
  }
}

// (a) kv_gather: written slots equal the cache rows bit for bit, all other slots keep their
// sentinel, nothing is written outside the working set, and both backends agree bit for bit.
TEST(SparseOpsTest, KvGatherCopiesCacheRowsBitExactly) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  std::mt19937 rng(7);
  const float kSentinel = 4242.0f;
  for (const HeadShape& hs : kHeadShapes) {
    for (int64_t d : kHeadDims) {
      for (int64_t page_size : {1, 5, 16}) {
        SCOPED_TRACE(shape_name(hs, d) + " page " + std::to_string(page_size));
        const int64_t length = std::uniform_int_distribution<int64_t>(1, 300)(rng);
        const int64_t slots = std::uniform_int_distribution<int64_t>(1, 96)(rng);
        PagedKv cache((length + page_size - 1) / page_size, page_size, hs.kv_heads, d, rng());
        cache.fill(length, rng());
        // Random distinct destinations, a random share of all (head, slot) pairs.
        std::vector<GatherEntry> entries;
        for (int64_t h = 0; h < hs.kv_heads; ++h) {
          for (int64_t s = 0; s < slots; ++s) {
            if (rng() % 3 == 0) continue;
            entries.push_back(
                {static_cast<int32_t>(h),
                 static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, length - 1)(rng)),
                 static_cast<int32_t>(s)});
          }
        }
        std::shuffle(entries.begin(), entries.end(), rng);
        const int64_t n = static_cast<int64_t>(entries.size());
        WorkingSet got(hs.kv_heads, slots, d, kSentinel);
        WorkingSet want(hs.kv_heads, slots, d, kSentinel);
        ASSERT_TRUE(cpu->kv_gather(cache.view, entries.data(), n, got.view()).is_ok());
        ASSERT_TRUE(ref.kv_gather(cache.view, entries.data(), n, want.view()).is_ok());
        EXPECT_TRUE(got.k.intact() && got.v.intact()) << "kv_gather wrote outside the working set";
        EXPECT_TRUE(want.k.intact() && want.v.intact()) << "reference wrote outside the working set";
        EXPECT_EQ(std::memcmp(got.k.data(), want.k.data(), got.k.size() * 4), 0);
        EXPECT_EQ(std::memcmp(got.v.data(), want.v.data(), got.v.size() * 4), 0);
        std::vector<int32_t> token_of(static_cast<size_t>(hs.kv_heads * slots), -1);
        for (const GatherEntry& e : entries)
          token_of[static_cast<size_t>(e.kv_head * slots + e.slot)] = e.token;
        const size_t row_bytes = static_cast<size_t>(d) * 4;
        for (int64_t h = 0; h < hs.kv_heads; ++h) {
          for (int64_t s = 0; s < slots; ++s) {
            const int32_t tok = token_of[static_cast<size_t>(h * slots + s)];
            if (tok >= 0) {
              EXPECT_EQ(std::memcmp(got.k_row(h, s), cache.k_at(tok, h), row_bytes), 0) << h << "/" << s;
              EXPECT_EQ(std::memcmp(got.v_row(h, s), cache.v_at(tok, h), row_bytes), 0) << h << "/" << s;
            } else {
              for (int64_t e = 0; e < d; ++e) {
                ASSERT_EQ(got.k_row(h, s)[e], kSentinel) << "unlisted slot " << h << "/" << s << " written";
                ASSERT_EQ(got.v_row(h, s)[e], kSentinel) << "unlisted slot " << h << "/" << s << " written";
              }
            }
          }
        }
      }
    }
  }
  // Zero entries: nothing to do, even with null pointers.
  EXPECT_TRUE(cpu->kv_gather(KvLayerView{}, nullptr, 0, WorkingSetView{}).is_ok());
  EXPECT_TRUE(ref.kv_gather(KvLayerView{}, nullptr, 0, WorkingSetView{}).is_ok());
}

// CpuBackend vs ReferenceBackend on random batches: several items of 1 or 2 rows, per-head
// counts that differ (including 0 and == slots), NaN in every slot beyond counts[h], gap rows
// between items that must stay untouched; automatic, forced-split and single-thread paths.
TEST(SparseOpsTest, AttentionSparseMatchesReference) {
  ReferenceBackend ref;
  std::vector<std::pair<std::string, std::unique_ptr<CpuBackend>>> backends;
  backends.emplace_back("auto", make_cpu());
  backends.emplace_back("1 thread", make_cpu({.num_threads = 1}));
  backends.emplace_back("chunk 7", make_cpu({.attention_chunk = 7}));
  backends.emplace_back("chunk 64", make_cpu({.attention_chunk = 64}));
  for (auto& [name, b] : backends) ASSERT_NE(b, nullptr) << name;
  std::mt19937 rng(11);
  const float kUntouched = 777.0f;
  for (const HeadShape& hs : kHeadShapes) {
    for (int64_t d : kHeadDims) {
      for (int trial = 0; trial < 3; ++trial) {
        SCOPED_TRACE(shape_name(hs, d) + " trial " + std::to_string(trial));
        const int64_t n_items = std::uniform_int_distribution<int64_t>(1, 4)(rng);
        std::vector<std::unique_ptr<WorkingSet>> sets;
        std::vector<SparseAttentionItem> items;
        std::vector<int64_t> zero_heads_rows;  // (row, kv head) pairs with an empty working set
        int64_t rows = 0;
        for (int64_t i = 0; i < n_items; ++i) {
          // Long working sets on the last trial so that the automatic split-K path runs too.
          const int64_t slots = trial == 2 ? std::uniform_int_distribution<int64_t>(600, 1500)(rng)
                                           : std::uniform_int_distribution<int64_t>(1, 200)(rng);
          sets.push_back(std::make_unique<WorkingSet>(hs.kv_heads, slots, d));
          WorkingSet& ws = *sets.back();
          for (int64_t h = 0; h < hs.kv_heads; ++h) {
            const int pick = static_cast<int>(rng() % 4);
            const int64_t c = pick == 0   ? 0
                              : pick == 1 ? slots
                                          : std::uniform_int_distribution<int64_t>(0, slots)(rng);
            ws.counts[static_cast<size_t>(h)] = static_cast<int32_t>(c);
            const auto k = random_floats(static_cast<size_t>(c * d), rng(), -2.0f, 2.0f);
            const auto v = random_floats(static_cast<size_t>(c * d), rng());
            std::copy(k.begin(), k.end(), ws.k_row(h, 0));
            std::copy(v.begin(), v.end(), ws.v_row(h, 0));
          }
          if (i == 0) ws.counts[0] = 0;                                          // always one empty head
          if (i == n_items - 1) ws.counts.back() = static_cast<int32_t>(slots);  // and one full one
          for (int64_t h = 0; h < hs.kv_heads; ++h) {  // refill what the overrides exposed
            for (int64_t s = 0; s < ws.counts[static_cast<size_t>(h)]; ++s) {
              for (int64_t e = 0; e < d; ++e) {
                if (std::isnan(ws.k_row(h, s)[e])) ws.k_row(h, s)[e] = 0.5f;
                if (std::isnan(ws.v_row(h, s)[e])) ws.v_row(h, s)[e] = -0.25f;
              }
            }
          }
          const int64_t n_tokens = 1 + static_cast<int64_t>(rng() % 2);
          rows += 1;  // gap row
          items.push_back({rows, n_tokens, ws.view()});
          rows += n_tokens;
        }
        const size_t row_floats = static_cast<size_t>(hs.n_heads * d);
        const auto q = random_floats(static_cast<size_t>(rows) * row_floats, rng(), -2.0f, 2.0f);
        GuardedBuffer want(static_cast<size_t>(rows) * row_floats, kUntouched);
        ASSERT_TRUE(ref.attention_sparse(q.data(), items.data(), n_items, hs.n_heads, want.data()).is_ok());
        for (auto& [name, b] : backends) {
          SCOPED_TRACE(name);
          GuardedBuffer got(static_cast<size_t>(rows) * row_floats, kUntouched);
          ASSERT_TRUE(b->attention_sparse(q.data(), items.data(), n_items, hs.n_heads, got.data()).is_ok());
          EXPECT_TRUE(got.intact()) << "attention_sparse wrote outside out";
          std::vector<float> got_rows, want_rows;
          for (const SparseAttentionItem& it : items) {
            EXPECT_EQ(got[static_cast<size_t>(it.token_offset - 1) * row_floats], kUntouched)
                << "gap row written";
            const size_t b0 = static_cast<size_t>(it.token_offset) * row_floats;
            const size_t b1 = b0 + static_cast<size_t>(it.n_tokens) * row_floats;
            got_rows.insert(got_rows.end(), got.data() + b0, got.data() + b1);
            want_rows.insert(want_rows.end(), want.data() + b0, want.data() + b1);
            // Heads with an empty working set: exactly zero in both.
            const int64_t group = hs.n_heads / hs.kv_heads;
            for (int64_t t = 0; t < it.n_tokens; ++t) {
              for (int64_t h = 0; h < hs.n_heads; ++h) {
                if (it.ws.counts[h / group] != 0) continue;
                const float* o = got.data() + ((it.token_offset + t) * hs.n_heads + h) * d;
                const float* w = want.data() + ((it.token_offset + t) * hs.n_heads + h) * d;
                for (int64_t e = 0; e < d; ++e) {
                  ASSERT_EQ(o[e], 0.0f) << "empty head " << h;
                  ASSERT_EQ(w[e], 0.0f) << "empty head " << h << " (reference)";
                }
              }
            }
          }
          expect_close(got_rows.data(), want_rows.data(), got_rows.size(), 1e-5, "attention_sparse");
          for (size_t r = 0; r < got_rows.size() / row_floats; ++r) {
            if (l2_norm(want_rows.data() + r * row_floats, row_floats) == 0.0) continue;
            EXPECT_LT(rel_l2(got_rows.data() + r * row_floats, want_rows.data() + r * row_floats, row_floats),
                      1e-4)
                << "row " << r;
          }
        }
      }
    }
  }
}

// (b) B = length: gather every token [0, L) of each sequence (into shuffled slots: order must
// not matter), and attention_sparse of a decode token at position L - 1 equals dense attention.
TEST(SparseOpsTest, SparseWithFullBudgetEqualsDense) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  auto cpu_split = make_cpu({.attention_chunk = 37});
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(cpu_split, nullptr);
  std::mt19937 rng(23);
  for (const HeadShape& hs : kHeadShapes) {
    for (int64_t d : kHeadDims) {
      SCOPED_TRACE(shape_name(hs, d));
      const std::vector<int64_t> lengths = {1, 37, 300, 1100};
      std::vector<std::unique_ptr<PagedKv>> caches;
      std::vector<std::unique_ptr<WorkingSet>> sets;
      std::vector<AttentionItem> dense;
      std::vector<SparseAttentionItem> sparse;
      for (size_t i = 0; i < lengths.size(); ++i) {
        const int64_t len = lengths[i];
        const int64_t page_size = i % 2 == 0 ? 16 : 5;
        caches.push_back(std::make_unique<PagedKv>((len + page_size - 1) / page_size + 1, page_size,
                                                   hs.kv_heads, d, rng()));
        caches.back()->fill(len, rng(), /*k_scale=*/2.0f);
        sets.push_back(std::make_unique<WorkingSet>(hs.kv_heads, len + 3, d));  // 3 spare NaN slots
        WorkingSet& ws = *sets.back();
        std::vector<GatherEntry> entries;
        for (int64_t h = 0; h < hs.kv_heads; ++h) {
          const std::vector<int32_t> slot_of = random_subset(rng, len, len);
          for (int64_t t = 0; t < len; ++t) {
            entries.push_back(
                {static_cast<int32_t>(h), static_cast<int32_t>(t), slot_of[static_cast<size_t>(t)]});
          }
          ws.counts[static_cast<size_t>(h)] = static_cast<int32_t>(len);
        }
        ASSERT_TRUE(cpu->kv_gather(caches.back()->view, entries.data(), static_cast<int64_t>(entries.size()),
                                   ws.view())
                        .is_ok());
        dense.push_back({static_cast<int64_t>(i), 1, len - 1, caches.back()->view});
        sparse.push_back({static_cast<int64_t>(i), 1, ws.view()});
      }
      const int64_t n = static_cast<int64_t>(lengths.size());
      const size_t out_floats = static_cast<size_t>(n * hs.n_heads * d);
      const auto q = random_floats(out_floats, rng(), -2.0f, 2.0f);
      std::vector<float> want(out_floats), want_ref(out_floats);
      ASSERT_TRUE(cpu->attention(q.data(), dense.data(), n, hs.n_heads, want.data()).is_ok());
      ASSERT_TRUE(ref.attention(q.data(), dense.data(), n, hs.n_heads, want_ref.data()).is_ok());
      for (Backend* b : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(cpu_split.get()),
                         static_cast<Backend*>(&ref)}) {
        SCOPED_TRACE(b->name());
        std::vector<float> got(out_floats);
        ASSERT_TRUE(b->attention_sparse(q.data(), sparse.data(), n, hs.n_heads, got.data()).is_ok());
        expect_close(got.data(), want.data(), out_floats, 1e-5, "sparse (B = L) vs CPU dense");
        expect_close(got.data(), want_ref.data(), out_floats, 1e-5, "sparse (B = L) vs reference dense");
      }
    }
  }
}

// (c) A subset: per KV head a random subset of [0, L) (empty, partial, or all of it) gathered
// into the working set; both backends equal dense attention restricted to those positions.
TEST(SparseOpsTest, SparseSubsetEqualsRestrictedDense) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  auto cpu_split = make_cpu({.attention_chunk = 16});
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(cpu_split, nullptr);
  std::mt19937 rng(31);
  for (const HeadShape& hs : kHeadShapes) {
    for (int64_t d : kHeadDims) {
      SCOPED_TRACE(shape_name(hs, d));
      const int64_t group = hs.n_heads / hs.kv_heads;
      const std::vector<int64_t> lengths = {9, 130, 700};
      std::vector<std::unique_ptr<PagedKv>> caches;
      std::vector<std::unique_ptr<WorkingSet>> sets;
      std::vector<std::vector<std::vector<int32_t>>> selected;  // [item][kv head] positions
      std::vector<SparseAttentionItem> items;
      int64_t rows = 0;
      for (size_t i = 0; i < lengths.size(); ++i) {
        const int64_t len = lengths[i];
        const int64_t page_size = 8;
        const int64_t slots = std::min<int64_t>(len, 64);
        caches.push_back(
            std::make_unique<PagedKv>((len + page_size - 1) / page_size, page_size, hs.kv_heads, d, rng()));
        caches.back()->fill(len, rng(), /*k_scale=*/2.0f);
        sets.push_back(std::make_unique<WorkingSet>(hs.kv_heads, slots, d));
        WorkingSet& ws = *sets.back();
        selected.emplace_back();
        std::vector<GatherEntry> entries;
        for (int64_t h = 0; h < hs.kv_heads; ++h) {
          // Head 0 of the first item is empty; the last head is full; the others in between.
          int64_t c = std::uniform_int_distribution<int64_t>(1, slots)(rng);
          if (i == 0 && h == 0) c = 0;
          if (h == hs.kv_heads - 1) c = slots;
          selected.back().push_back(random_subset(rng, len, c));
          for (int64_t s = 0; s < c; ++s) {
            entries.push_back({static_cast<int32_t>(h), selected.back().back()[static_cast<size_t>(s)],
                               static_cast<int32_t>(s)});
          }
          ws.counts[static_cast<size_t>(h)] = static_cast<int32_t>(c);
        }
        ASSERT_TRUE(ref.kv_gather(caches.back()->view, entries.data(), static_cast<int64_t>(entries.size()),
                                  ws.view())
                        .is_ok());
        const int64_t n_tokens = 1 + static_cast<int64_t>(i % 2);
        items.push_back({rows, n_tokens, ws.view()});
        rows += n_tokens;
      }
      const size_t out_floats = static_cast<size_t>(rows * hs.n_heads * d);
      const auto q = random_floats(out_floats, rng(), -2.0f, 2.0f);
      std::vector<float> want(out_floats);
      for (size_t i = 0; i < items.size(); ++i) {
        for (int64_t t = 0; t < items[i].n_tokens; ++t) {
          for (int64_t h = 0; h < hs.n_heads; ++h) {
            const size_t at = static_cast<size_t>(((items[i].token_offset + t) * hs.n_heads + h) * d);
            restricted_dense(q.data() + at, *caches[i], h / group,
                             selected[i][static_cast<size_t>(h / group)], want.data() + at);
          }
        }
      }
      for (Backend* b : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(cpu_split.get()),
                         static_cast<Backend*>(&ref)}) {
        SCOPED_TRACE(b->name());
        std::vector<float> got(out_floats);
        ASSERT_TRUE(b->attention_sparse(q.data(), items.data(), static_cast<int64_t>(items.size()),
                                        hs.n_heads, got.data())
                        .is_ok());
        expect_close(got.data(), want.data(), out_floats, 1e-5, "sparse vs restricted dense");
      }
    }
  }
}

// Elastic loading end to end: successive selections refill the working set in place through
// ElasticWorkingSet::update + kv_gather; after each step the slots hold exactly the selected
// tokens and attention_sparse equals dense attention restricted to the selection.
TEST(SparseOpsTest, ElasticRefillInPlaceMatchesRestrictedDense) {
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  std::mt19937 rng(41);
  const int64_t n_heads = 8, kv_heads = 2, d = 64, page_size = 16, budget = 48;
  const int64_t max_len = 400;
  PagedKv cache(max_len / page_size, page_size, kv_heads, d, rng());
  cache.fill(max_len, rng(), 2.0f);
  WorkingSet ws(kv_heads, budget, d);
  ElasticWorkingSet elastic(kv_heads, budget);
  int64_t len = 30;
  for (int step = 0; step < 12; ++step, len += 29) {
    SCOPED_TRACE("step " + std::to_string(step) + " length " + std::to_string(len));
    Selection sel;
    sel.kv_heads = kv_heads;
    sel.budget = budget;
    sel.indices.assign(static_cast<size_t>(kv_heads * budget), -1);
    sel.counts.assign(static_cast<size_t>(kv_heads), 0);
    for (int64_t h = 0; h < kv_heads; ++h) {
      // Overlapping selections: the recent window plus random older tokens; step 5 shrinks.
      const int64_t c = std::min<int64_t>(len, step == 5 ? budget / 3 : budget);
      std::vector<int32_t> pick = random_subset(rng, len, c);
      std::sort(pick.begin(), pick.end());
      std::copy(pick.begin(), pick.end(), sel.indices.begin() + h * budget);
      sel.counts[static_cast<size_t>(h)] = static_cast<int32_t>(c);
    }
    std::vector<GatherEntry> loads;
    elastic.update(sel, loads);
    const Status st = cpu->kv_gather(cache.view, loads.data(), static_cast<int64_t>(loads.size()), ws.view());
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    for (int64_t h = 0; h < kv_heads; ++h) {
      ws.counts[static_cast<size_t>(h)] = elastic.counts()[static_cast<size_t>(h)];
      ASSERT_EQ(ws.counts[static_cast<size_t>(h)], sel.counts[static_cast<size_t>(h)]);
      std::vector<int32_t> held;
      for (int64_t s = 0; s < ws.counts[static_cast<size_t>(h)]; ++s) {
        const int32_t tok = elastic.token_at(h, s);
        held.push_back(tok);
        ASSERT_GE(tok, 0);
        ASSERT_EQ(std::memcmp(ws.k_row(h, s), cache.k_at(tok, h), static_cast<size_t>(d) * 4), 0)
            << "slot " << s;
      }
      std::sort(held.begin(), held.end());
      const auto want_tokens = sel.head(h);
      ASSERT_TRUE(std::equal(held.begin(), held.end(), want_tokens.begin(), want_tokens.end()));
    }
    const auto q = random_floats(static_cast<size_t>(n_heads * d), rng(), -2.0f, 2.0f);
    std::vector<float> got(q.size()), want(q.size());
    SparseAttentionItem item{0, 1, ws.view()};
    ASSERT_TRUE(cpu->attention_sparse(q.data(), &item, 1, n_heads, got.data()).is_ok());
    for (int64_t h = 0; h < n_heads; ++h) {
      const auto toks = sel.head(h / (n_heads / kv_heads));
      restricted_dense(q.data() + h * d, cache, h / (n_heads / kv_heads), {toks.begin(), toks.end()},
                       want.data() + h * d);
    }
    expect_close(got.data(), want.data(), got.size(), 1e-5, "elastic sparse vs restricted dense");
  }
}

// Impossible requests are refused with kInvalidArgument by both backends, before any write.
// CpuBackend::retrieval_group_scores (dot products over token ranges, each head's softmax on one
// thread, heads spread over the threads) gives the bits of the host default (ReferenceBackend
// keeps Backend's), for head counts that do and do not divide among the threads and lengths
// that end inside a block.
TEST(SparseOpsTest, RetrievalGroupScoresEqualReferenceBitExactly) {
  ReferenceBackend ref;
  CpuBackendOptions o;
  o.num_threads = 2;
  auto cpu = make_cpu(o);
  ASSERT_NE(cpu, nullptr);
  struct Case {
    int64_t n_heads, n_kv_heads, head_dim, length, block_tokens;
  };
  for (const Case& c : {Case{32, 8, 64, 5000, 512}, Case{6, 2, 16, 777, 64}, Case{3, 1, 8, 33, 16},
                        Case{4, 4, 32, 1, 8}}) {
    SCOPED_TRACE(std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv_heads) + " heads, length " +
                 std::to_string(c.length));
    const int64_t kd = c.n_kv_heads * c.head_dim;
    const int64_t n_blocks = (c.length + c.block_tokens - 1) / c.block_tokens;
    const std::vector<float> q = random_floats(static_cast<size_t>(c.n_heads * c.head_dim), 5, -2.0f, 2.0f);
    std::vector<std::vector<float>> blocks;
    std::vector<const void*> table;
    for (int64_t b = 0; b < n_blocks; ++b) {
      blocks.push_back(random_floats(static_cast<size_t>(c.block_tokens * kd), static_cast<uint32_t>(100 + b)));
    }
    for (int64_t b = n_blocks - 1; b >= 0; --b) table.push_back(blocks[static_cast<size_t>(b)].data());  // out of order
    std::vector<float> want(static_cast<size_t>(c.n_kv_heads * c.length), -1.0f), got(want.size(), -2.0f);
    ASSERT_TRUE(ref.retrieval_group_scores(q.data(), table.data(), DType::kF32, c.block_tokens, c.length, c.n_heads,
                                           c.n_kv_heads, c.head_dim, want.data())
                    .is_ok());
    ASSERT_TRUE(cpu->retrieval_group_scores(q.data(), table.data(), DType::kF32, c.block_tokens, c.length,
                                            c.n_heads, c.n_kv_heads, c.head_dim, got.data())
                    .is_ok());
    int64_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += std::memcmp(&want[i], &got[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0) << "of " << want.size();
    // Group 0's scores are the maximum of softmax rows over its heads: they sum to at least 1.
    double sum0 = 0.0;
    for (int64_t t = 0; t < c.length; ++t) sum0 += got[static_cast<size_t>(t)];
    EXPECT_GE(sum0, 1.0 - 1e-4);
  }
}

// The f16 widenings of the head's key loads (core/base/host_math.h: the inline bit trick, and
// widen_key_row, F16C where the CPU has it, over rows of every length 0..40 and one of all values)
// are core's f16_to_f32 for every one of the 65536 bit patterns (NaN for NaN: the payload is not
// compared); bf16's is a shift, checked the same way.
TEST(SparseOpsTest, HeadKeyF16WideningIsExactForEveryValue) {
  auto same = [](float want, float got) {
    return std::isnan(want) ? std::isnan(got) : std::memcmp(&want, &got, sizeof(float)) == 0;
  };
  std::vector<uint16_t> all(1u << 16);
  std::iota(all.begin(), all.end(), uint16_t{0});
  std::vector<float> row(all.size());
  int64_t differ = 0, differ_row = 0, differ_bf16 = 0;
  widen_key_row<DType::kF16>(all.data(), row.data(), static_cast<int64_t>(all.size()));
  for (size_t h = 0; h < all.size(); ++h) {
    const float want = f16_to_f32(all[h]);
    differ += same(want, f16_bits_to_f32(all[h])) ? 0 : 1;
    differ_row += same(want, row[h]) ? 0 : 1;
  }
  widen_key_row<DType::kBF16>(all.data(), row.data(), static_cast<int64_t>(all.size()));
  for (size_t h = 0; h < all.size(); ++h) differ_bf16 += same(bf16_to_f32(all[h]), row[h]) ? 0 : 1;
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(differ_row, 0);
  EXPECT_EQ(differ_bf16, 0);
  // Short rows and tails (the vector loop's remainder), at odd offsets.
  for (int64_t n = 0; n <= 40; ++n) {
    std::vector<float> out(static_cast<size_t>(n) + 1, -7.0f);
    widen_key_row<DType::kF16>(all.data() + 15000 + n, out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same(f16_to_f32(all[static_cast<size_t>(15000 + n + i)]), out[static_cast<size_t>(i)])) << n;
    }
    EXPECT_EQ(out[static_cast<size_t>(n)], -7.0f) << "wrote past the row of " << n;
  }
}

// Head keys stored in f16 / bf16 (the KV dtype): retrieval_group_scores widens each element as it
// loads it. (1) CpuBackend gives the bits of the host default (ReferenceBackend) for the same
// stored keys; (2) both give the bits of the f32 path over the keys widened beforehand (the
// conversion is exact and the arithmetic the same); (3) against the f32 reference over the
// unrounded keys the scores stay within the bound the rounding allows: with δ = max over (h, t)
// of (Σ_i |q_hi|·|k_ti − k̃_ti| + the f32 dot products' rounding) / √head_dim, every logit moves
// by at most δ, so every softmax
// probability (and so each group's max) by a factor within [e^−2δ, e^2δ]; the tolerance is
// want·(e^2δ − 1) + 1e-6·want + 1e-9 (float rounding of the softmax itself). Scores are finite,
// each group's row sums to at least 1, and they are not all equal.
TEST(SparseOpsTest, RetrievalGroupScoresOfF16AndBf16KeysMatchTheF32Reference) {
  ReferenceBackend ref;
  CpuBackendOptions o;
  o.num_threads = 2;
  auto cpu = make_cpu(o);
  ASSERT_NE(cpu, nullptr);
  struct Case {
    int64_t n_heads, n_kv_heads, head_dim, length, block_tokens;
  };
  for (const DType dt : {DType::kF16, DType::kBF16}) {
    for (const Case& c : {Case{32, 8, 64, 3000, 512}, Case{6, 2, 16, 777, 64}, Case{3, 1, 13, 33, 16},
                          Case{4, 4, 32, 1, 8}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + std::to_string(c.n_heads) + "/" +
                   std::to_string(c.n_kv_heads) + " heads, head_dim " + std::to_string(c.head_dim) + ", length " +
                   std::to_string(c.length));
      const int64_t kd = c.n_kv_heads * c.head_dim;
      const int64_t n_blocks = (c.length + c.block_tokens - 1) / c.block_tokens;
      const size_t block_elems = static_cast<size_t>(c.block_tokens * kd);
      const std::vector<float> q = random_floats(static_cast<size_t>(c.n_heads * c.head_dim), 7, -2.0f, 2.0f);
      std::vector<std::vector<float>> exact, widened;
      std::vector<std::vector<uint16_t>> stored;
      for (int64_t b = 0; b < n_blocks; ++b) {
        exact.push_back(random_floats(block_elems, static_cast<uint32_t>(300 + b), -3.0f, 3.0f));
        stored.emplace_back(block_elems);
        convert_from_f32(dt, exact.back().data(), stored.back().data(), block_elems);
        widened.emplace_back(block_elems);
        convert_to_f32(dt, stored.back().data(), widened.back().data(), block_elems);
      }
      std::vector<const void*> t_exact, t_stored, t_widened;
      for (int64_t b = n_blocks - 1; b >= 0; --b) {  // out of order
        const size_t i = static_cast<size_t>(b);
        t_exact.push_back(exact[i].data());
        t_stored.push_back(stored[i].data());
        t_widened.push_back(widened[i].data());
      }
      // The table lists the blocks in reverse: token t is in table[t / bt], i.e. block n_blocks-1-t/bt.
      auto key = [&](const std::vector<std::vector<float>>& v, int64_t t, int64_t e) {
        return v[static_cast<size_t>(n_blocks - 1 - t / c.block_tokens)][static_cast<size_t>((t % c.block_tokens) * kd + e)];
      };
      const size_t n_out = static_cast<size_t>(c.n_kv_heads * c.length);
      std::vector<float> want(n_out, -1.0f), ref_got(n_out, -2.0f), cpu_got(n_out, -3.0f), via_f32(n_out, -4.0f);
      auto call = [&](Backend& be, const std::vector<const void*>& table, DType kt, std::vector<float>& out) {
        return be.retrieval_group_scores(q.data(), table.data(), kt, c.block_tokens, c.length, c.n_heads,
                                         c.n_kv_heads, c.head_dim, out.data());
      };
      ASSERT_TRUE(call(ref, t_exact, DType::kF32, want).is_ok());
      ASSERT_TRUE(call(ref, t_stored, dt, ref_got).is_ok());
      ASSERT_TRUE(call(*cpu, t_stored, dt, cpu_got).is_ok());
      ASSERT_TRUE(call(*cpu, t_widened, DType::kF32, via_f32).is_ok());
      int64_t differ_ref = 0, differ_f32 = 0;
      for (size_t i = 0; i < n_out; ++i) {
        differ_ref += std::memcmp(&cpu_got[i], &ref_got[i], sizeof(float)) != 0;
        differ_f32 += std::memcmp(&cpu_got[i], &via_f32[i], sizeof(float)) != 0;
      }
      EXPECT_EQ(differ_ref, 0) << "CPU vs host default, of " << n_out;
      EXPECT_EQ(differ_f32, 0) << "stored keys vs the same keys widened beforehand, of " << n_out;
      // The rounding's bound.
      const int64_t group = c.n_heads / c.n_kv_heads;
      double delta = 0.0;
      for (int64_t t = 0; t < c.length; ++t) {
        for (int64_t h = 0; h < c.n_heads; ++h) {
          const int64_t g = h / group;
          double d = 0.0, mag = 0.0;
          for (int64_t i = 0; i < c.head_dim; ++i) {
            const int64_t e = g * c.head_dim + i;
            const double qa = std::abs(static_cast<double>(q[static_cast<size_t>(h * c.head_dim + i)]));
            d += qa * std::abs(static_cast<double>(key(exact, t, e)) - key(widened, t, e));
            mag += qa * std::abs(static_cast<double>(key(exact, t, e)));
          }
          // Plus the f32 dot products' own rounding on both sides: (head_dim + 2)·2^-24·Σ|q||k| each.
          const double roundoff = 2.0 * static_cast<double>(c.head_dim + 2) * std::ldexp(1.0, -24) * mag;
          delta = std::max(delta, (d + roundoff) / std::sqrt(static_cast<double>(c.head_dim)));
        }
      }
      EXPECT_GT(delta, 0.0) << "the keys were rounded";
      const double factor = std::expm1(2.0 * delta);
      int64_t outside = 0, non_finite = 0;
      double worst = 0.0;
      for (size_t i = 0; i < n_out; ++i) {
        if (!std::isfinite(cpu_got[i])) ++non_finite;
        const double err = std::abs(static_cast<double>(cpu_got[i]) - want[i]);
        const double tol = want[i] * (factor + 1e-6) + 1e-9;
        outside += err > tol ? 1 : 0;
        worst = std::max(worst, err);
      }
      EXPECT_EQ(non_finite, 0);
      EXPECT_EQ(outside, 0) << "of " << n_out << "; δ = " << delta << ", worst |Δ| = " << worst;
      for (int64_t g = 0; g < c.n_kv_heads; ++g) {
        double sum = 0.0;
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t t = 0; t < c.length; ++t) {
          const float v = cpu_got[static_cast<size_t>(g * c.length + t)];
          sum += v;
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        EXPECT_GE(sum, 1.0 - 1e-4) << "group " << g;
        if (c.length > 1) {
          EXPECT_LT(lo, hi) << "group " << g;
        }
      }
    }
  }
  // A dtype that is not a KV dtype is refused by both.
  float x = 0.0f;
  const void* one[1] = {&x};
  std::vector<float> out(1);
  EXPECT_EQ(ref.retrieval_group_scores(&x, one, DType::kQ8_0, 1, 1, 1, 1, 1, out.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->retrieval_group_scores(&x, one, DType::kQ8_0, 1, 1, 1, 1, 1, out.data()).code(),
            StatusCode::kInvalidArgument);
}

// CpuBackend::select_top_tokens (the KV heads spread over the threads, scores read in place)
// selects what the host default (ReferenceBackend keeps Backend's) selects, head by head: scores
// with many ties (ties prefer the older token), budgets below, near and above the length, sinks
// and window larger than the budget.
TEST(SparseOpsTest, SelectTopTokensEqualsReference) {
  ReferenceBackend ref;
  CpuBackendOptions o;
  o.num_threads = 2;
  auto cpu = make_cpu(o);
  ASSERT_NE(cpu, nullptr);
  std::mt19937 rng(31);
  struct Case {
    int64_t kv, length;
    SelectionOptions opts;
  };
  for (const Case& c : {Case{8, 5000, {256, 1, 4}}, Case{3, 200, {64, 2, 8}}, Case{5, 40, {64, 1, 4}},
                        Case{4, 100, {6, 4, 8}}, Case{1, 300, {32, 1, 4}}, Case{7, 1, {16, 1, 4}}}) {
    SCOPED_TRACE(std::to_string(c.kv) + " heads, length " + std::to_string(c.length) + ", budget " +
                 std::to_string(c.opts.budget));
    // Scores on a coarse grid (ties are common), another grid per head.
    std::vector<float> scores(static_cast<size_t>(c.kv * c.length));
    for (int64_t h = 0; h < c.kv; ++h) {
      std::uniform_int_distribution<int> level(0, static_cast<int>(4 + 6 * h));
      for (int64_t t = 0; t < c.length; ++t) scores[static_cast<size_t>(h * c.length + t)] = 0.01f * level(rng);
    }
    Selection want, got;
    got.indices.assign(3, 99);  // stale contents must not leak
    ASSERT_TRUE(ref.select_top_tokens(scores.data(), c.kv, c.length, c.opts, want).is_ok());
    ASSERT_TRUE(cpu->select_top_tokens(scores.data(), c.kv, c.length, c.opts, got).is_ok());
    ASSERT_EQ(got.kv_heads, want.kv_heads);
    ASSERT_EQ(got.budget, want.budget);
    for (int64_t h = 0; h < c.kv; ++h) {
      const auto a = got.head(h), b = want.head(h);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << "head " << h;
    }
  }
}

TEST(SparseOpsTest, RejectsImpossibleShapes) {
  ReferenceBackend ref;
  auto cpu = make_cpu();
  ASSERT_NE(cpu, nullptr);
  PagedKv cache(2, 4, 2, 8, 1);  // capacity 8
  cache.fill(8, 2);
  for (Backend* b : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&ref)}) {
    SCOPED_TRACE(b->name());
    WorkingSet ws(2, 4, 8, 1.0f);
    auto gather = [&](GatherEntry e, WorkingSetView view) {
      return b->kv_gather(cache.view, &e, 1, view).code();
    };
    EXPECT_EQ(gather({0, 7, 3}, ws.view()), StatusCode::kOk);
    EXPECT_EQ(gather({0, 8, 0}, ws.view()), StatusCode::kInvalidArgument);   // token >= capacity
    EXPECT_EQ(gather({0, -1, 0}, ws.view()), StatusCode::kInvalidArgument);  // negative token
    EXPECT_EQ(gather({0, 0, 4}, ws.view()), StatusCode::kInvalidArgument);   // slot >= slots
    EXPECT_EQ(gather({2, 0, 0}, ws.view()), StatusCode::kInvalidArgument);   // head >= kv_heads
    WorkingSetView wrong_dim = ws.view();
    wrong_dim.head_dim = 4;
    EXPECT_EQ(gather({0, 0, 0}, wrong_dim), StatusCode::kInvalidArgument);
    WorkingSetView wrong_heads = ws.view();
    wrong_heads.kv_heads = 1;
    EXPECT_EQ(gather({0, 0, 0}, wrong_heads), StatusCode::kInvalidArgument);
    const GatherEntry dup[] = {{1, 0, 2}, {0, 0, 2}, {1, 5, 2}};  // head 1 slot 2 twice
    EXPECT_EQ(b->kv_gather(cache.view, dup, 3, ws.view()).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(b->kv_gather(cache.view, dup, 2, ws.view()).code(), StatusCode::kOk);
    EXPECT_EQ(b->kv_gather(cache.view, nullptr, 1, ws.view()).code(), StatusCode::kInvalidArgument);

    std::vector<float> q(4 * 8, 0.5f), out(4 * 8, 0.0f);
    auto attend = [&](WorkingSetView view, int64_t n_heads) {
      SparseAttentionItem item{0, 1, view};
      return b->attention_sparse(q.data(), &item, 1, n_heads, out.data()).code();
    };
    ws.counts = {4, 0};
    EXPECT_EQ(attend(ws.view(), 4), StatusCode::kOk);
    ws.counts = {5, 0};
    EXPECT_EQ(attend(ws.view(), 4), StatusCode::kInvalidArgument);  // counts > slots
    ws.counts = {-1, 0};
    EXPECT_EQ(attend(ws.view(), 4), StatusCode::kInvalidArgument);
    ws.counts = {1, 1};
    EXPECT_EQ(attend(ws.view(), 3), StatusCode::kInvalidArgument);  // 3 heads over 2 KV heads
    WorkingSetView no_counts = ws.view();
    no_counts.counts = nullptr;
    EXPECT_EQ(attend(no_counts, 4), StatusCode::kInvalidArgument);
    SparseAttentionItem bad_rows{-1, 1, ws.view()};
    EXPECT_EQ(b->attention_sparse(q.data(), &bad_rows, 1, 4, out.data()).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(b->attention_sparse(q.data(), nullptr, 0, 4, out.data()).code(), StatusCode::kOk);
  }
}

// Timing (not a correctness test; run with --gtest_also_run_disabled_tests): attention_sparse
// over 16 sequences x 8 KV heads x 2048 slots x head_dim 128 (32 query heads, one decode row
// each) with 1 and 2 threads, next to dense attention at context 2048 with the same shape, for
// f32, bf16 and f16 K/V (the same values, rounded; 16-bit rows move half the bytes).
TEST(SparseOpsTest, DISABLED_Timing) {
  const int64_t n_seq = 16, kv_heads = 8, n_heads = 32, slots = 2048, d = 128, page_size = 16;
  std::vector<std::unique_ptr<WorkingSet>> sets;
  std::vector<std::unique_ptr<PagedKv>> caches;
  for (int64_t i = 0; i < n_seq; ++i) {
    sets.push_back(std::make_unique<WorkingSet>(kv_heads, slots, d));
    WorkingSet& ws = *sets.back();
    const auto k = random_floats(ws.k.size(), static_cast<uint32_t>(2 * i + 1));
    const auto v = random_floats(ws.v.size(), static_cast<uint32_t>(2 * i + 2));
    std::copy(k.begin(), k.end(), ws.k.data());
    std::copy(v.begin(), v.end(), ws.v.data());
    std::fill(ws.counts.begin(), ws.counts.end(), static_cast<int32_t>(slots));
    caches.push_back(
        std::make_unique<PagedKv>(slots / page_size, page_size, kv_heads, d, static_cast<uint32_t>(i)));
    caches.back()->fill(slots, static_cast<uint32_t>(100 + i));
  }
  const auto q = random_floats(static_cast<size_t>(n_seq * n_heads * d), 5);
  std::vector<float> out(q.size());
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    // 16-bit copies of the same caches and working sets.
    std::vector<std::unique_ptr<PagedKv>> narrow;
    std::vector<std::vector<uint16_t>> ws_bits;
    std::vector<SparseAttentionItem> sparse;
    std::vector<AttentionItem> dense;
    for (int64_t i = 0; i < n_seq; ++i) {
      WorkingSet& ws = *sets[static_cast<size_t>(i)];
      PagedKv& cache = *caches[static_cast<size_t>(i)];
      if (t == DType::kF32) {
        sparse.push_back({i, 1, ws.view()});
        dense.push_back({i, 1, slots - 1, cache.view});
        continue;
      }
      ws_bits.emplace_back(ws.k.size());
      convert_from_f32(t, ws.k.data(), ws_bits.back().data(), ws.k.size());
      uint16_t* kb = ws_bits.back().data();
      ws_bits.emplace_back(ws.v.size());
      convert_from_f32(t, ws.v.data(), ws_bits.back().data(), ws.v.size());
      uint16_t* vb = ws_bits.back().data();
      sparse.push_back({i, 1, WorkingSetView{kb, vb, kv_heads, slots, d, ws.counts.data(), t}});
      narrow.push_back(std::make_unique<PagedKv>(slots / page_size, page_size, kv_heads, d,
                                                 static_cast<uint32_t>(i), t));
      const size_t page_elems = static_cast<size_t>(kv_heads * page_size * d);
      for (int64_t p = 0; p < slots / page_size; ++p) {
        convert_from_f32(t, static_cast<const float*>(cache.k_pages[static_cast<size_t>(p)]),
                         narrow.back()->k_pages[static_cast<size_t>(p)], page_elems);
        convert_from_f32(t, static_cast<const float*>(cache.v_pages[static_cast<size_t>(p)]),
                         narrow.back()->v_pages[static_cast<size_t>(p)], page_elems);
      }
      dense.push_back({i, 1, slots - 1, narrow.back()->view});
    }
    for (int threads : {1, 2}) {
      auto cpu = make_cpu({.num_threads = threads});
      ASSERT_NE(cpu, nullptr);
      auto time_ms = [&](auto&& op) {
        for (int i = 0; i < 3; ++i) ASSERT_TRUE(op().is_ok());  // warm-up
        std::vector<double> ms;
        const std::clock_t cpu0 = std::clock();
        for (int i = 0; i < 15; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          ASSERT_TRUE(op().is_ok());
          ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        }
        // Process CPU time per call: about threads x wall when the threads really ran in parallel
        // (on a loaded machine they may not get their cores).
        const double cpu_ms = 1000.0 * static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC / 15;
        std::sort(ms.begin(), ms.end());
        std::printf("  %s KV, %d thread(s): median %.2f ms, min %.2f ms, cpu %.2f ms/call\n", std::string(dtype_name(t)).c_str(),
                    threads, ms[ms.size() / 2], ms[0], cpu_ms);
      };
      std::printf("attention_sparse (16 x 8 x 2048 x 128):\n");
      time_ms([&] { return cpu->attention_sparse(q.data(), sparse.data(), n_seq, n_heads, out.data()); });
      ASSERT_TRUE(all_finite(out.data(), out.size()));
      std::printf("dense attention, context 2048:\n");
      time_ms([&] { return cpu->attention(q.data(), dense.data(), n_seq, n_heads, out.data()); });
      ASSERT_TRUE(all_finite(out.data(), out.size()));
    }
  }
}

}  // namespace
}  // namespace specontext::cpu
