#include "core/ports/selection.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace specontext {

namespace {

void prepare(Selection& out, int64_t n_kv_heads, int64_t budget) {
  out.kv_heads = n_kv_heads;
  out.budget = budget;
  out.indices.resize(static_cast<size_t>(n_kv_heads * budget));
  out.counts.assign(static_cast<size_t>(n_kv_heads), 0);
}

// Writes sinks [0, s) and window [length − w, length) into dst (ascending), returns count.
int32_t fixed_part(int64_t length, int64_t sinks, int64_t window, int32_t* dst) {
  int32_t n = 0;
  for (int64_t t = 0; t < std::min(sinks, length); ++t) dst[n++] = static_cast<int32_t>(t);
  for (int64_t t = std::max(sinks, length - window); t < length; ++t) dst[n++] = static_cast<int32_t>(t);
  return n;
}

// A context that fits the budget is kept whole: writes 0 .. length − 1 to dst and its count.
bool keep_all_within_budget(int64_t length, int64_t budget, int32_t* dst, int32_t& count) {
  if (length > budget) return false;
  std::iota(dst, dst + length, 0);
  count = static_cast<int32_t>(length);
  return true;
}

}  // namespace

void select_streaming(int64_t n_kv_heads, int64_t length, const SelectionOptions& o, Selection& out) {
  const int64_t budget = std::max<int64_t>(o.budget, 1);
  prepare(out, n_kv_heads, budget);
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    int32_t* dst = out.indices.data() + h * budget;
    if (keep_all_within_budget(length, budget, dst, out.counts[static_cast<size_t>(h)])) continue;
    const int64_t sinks = std::min(o.sinks, budget);
    out.counts[static_cast<size_t>(h)] = fixed_part(length, sinks, budget - sinks, dst);
  }
}

void select_from_group_scores(std::span<const float> group_scores, int64_t n_kv_heads, int64_t length,
                              const SelectionOptions& o, Selection& out) {
  const int64_t budget = std::max<int64_t>(o.budget, 1);
  prepare(out, n_kv_heads, budget);
  std::vector<int32_t> order;
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    int32_t* dst = out.indices.data() + h * budget;
    if (keep_all_within_budget(length, budget, dst, out.counts[static_cast<size_t>(h)])) continue;
    // Sinks and window shrink to fit a small budget: sinks first, then the window.
    const int64_t sinks = std::min(o.sinks, budget);
    const int64_t window = std::min(o.window, budget - sinks);
    int32_t n = fixed_part(length, sinks, window, dst);
    // The middle [sinks, length − window) competes for the rest of the budget.
    const int64_t lo = sinks, hi = length - window;
    const int64_t take = std::min(budget - n, hi - lo);
    if (take > 0) {
      const float* score = group_scores.data() + h * length;
      order.resize(static_cast<size_t>(hi - lo));
      std::iota(order.begin(), order.end(), static_cast<int32_t>(lo));
      auto better = [&](int32_t a, int32_t b) {
        const float sa = score[a], sb = score[b];
        return sa > sb || (sa == sb && a < b);
      };
      std::nth_element(order.begin(), order.begin() + take - 1, order.end(), better);
      for (int64_t i = 0; i < take; ++i) dst[n++] = order[static_cast<size_t>(i)];
    }
    std::sort(dst, dst + n);
    out.counts[static_cast<size_t>(h)] = n;
  }
}

void reduce_group_scores(std::span<const float> scores, int64_t n_q_heads, int64_t n_kv_heads, int64_t length,
                         const SelectionOptions& o, GroupReduce reduce, std::vector<float>& group_scores) {
  const int64_t group = n_q_heads / n_kv_heads;
  group_scores.assign(static_cast<size_t>(std::max<int64_t>(n_kv_heads * length, 0)), 0.0f);
  if (reduce == GroupReduce::kMax) {
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      float* dst = group_scores.data() + h * length;
      for (int64_t g = 0; g < group; ++g) {
        const float* row = scores.data() + (h * group + g) * length;
        for (int64_t t = 0; t < length; ++t) dst[t] = std::max(dst[t], row[t]);
      }
    }
    return;
  }
  // kTurns: the middle as select_from_group_scores bounds it; the fixed tokens score 0 (kept anyway).
  const int64_t budget = std::max<int64_t>(o.budget, 1);
  const int64_t sinks = std::min(o.sinks, budget);
  const int64_t window = std::min(o.window, budget - sinks);
  const int64_t lo = std::min(sinks, length), hi = std::max(lo, length - window);
  // Only the first `take` ranks can be selected (one head's alone fill the free slots), so each
  // head sorts only those; every later rank scores -take.
  const int64_t take = std::clamp<int64_t>(budget - (lo + length - hi), 0, hi - lo);
  std::vector<int32_t> middle(static_cast<size_t>(hi - lo));
  std::iota(middle.begin(), middle.end(), static_cast<int32_t>(lo));
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    score_group_by_turns(scores.data() + h * group * length, length, group, take, middle,
                         group_scores.data() + h * length);
  }
}

void score_group_by_turns(const float* weights, int64_t stride, int64_t group, int64_t take,
                          std::span<const int32_t> middle, float* score) {
  for (int32_t i : middle) score[i] = -static_cast<float>(take);
  std::vector<int32_t> order;
  for (int64_t j = 0; j < group; ++j) {
    const float* w = weights + j * stride;
    order.assign(middle.begin(), middle.end());
    std::partial_sort(order.begin(), order.begin() + take, order.end(),
                      [&](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
    for (int64_t rank = 0; rank < take; ++rank) {
      float& s = score[order[static_cast<size_t>(rank)]];
      s = std::max(s, -static_cast<float>(rank));
    }
  }
}

void select_tokens(std::span<const float> scores, int64_t n_q_heads, int64_t n_kv_heads, int64_t length,
                   const SelectionOptions& o, Selection& out) {
  std::vector<float> group_max;
  reduce_group_scores(scores, n_q_heads, n_kv_heads, length, o, GroupReduce::kMax, group_max);
  select_from_group_scores(group_max, n_kv_heads, length, o, out);
}

void select_quest(const float* q, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                  const float* page_min, const float* page_max, int64_t page_size, int64_t length,
                  const SelectionOptions& o, Selection& out) {
  const int64_t budget = std::max<int64_t>(o.budget, 1);
  prepare(out, n_kv_heads, budget);
  const int64_t group = n_q_heads / n_kv_heads;
  const int64_t n_pages = (length + page_size - 1) / page_size;
  std::vector<float> bound(static_cast<size_t>(n_pages));
  std::vector<int32_t> order(static_cast<size_t>(n_pages));
  std::vector<char> chosen(static_cast<size_t>(length));
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    int32_t* dst = out.indices.data() + h * budget;
    if (keep_all_within_budget(length, budget, dst, out.counts[static_cast<size_t>(h)])) continue;
    const int64_t sinks = std::min(o.sinks, budget);
    const int64_t window = std::min(o.window, budget - sinks);
    std::fill(chosen.begin(), chosen.end(), 0);
    int64_t n = 0;
    for (int64_t t = 0; t < sinks; ++t) { chosen[static_cast<size_t>(t)] = 1; ++n; }
    for (int64_t t = std::max(sinks, length - window); t < length; ++t) { chosen[static_cast<size_t>(t)] = 1; ++n; }
    for (int64_t p = 0; p < n_pages; ++p) {
      float best = -INFINITY;
      const float* mn = page_min + (p * n_kv_heads + h) * head_dim;
      const float* mx = page_max + (p * n_kv_heads + h) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = q + (h * group + g) * head_dim;
        float b = 0.0f;
        for (int64_t i = 0; i < head_dim; ++i) b += std::max(qh[i] * mn[i], qh[i] * mx[i]);
        best = std::max(best, b);
      }
      bound[static_cast<size_t>(p)] = best;
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return bound[static_cast<size_t>(a)] > bound[static_cast<size_t>(b)];
    });
    for (int32_t p : order) {
      if (n >= budget) break;
      for (int64_t t = p * page_size; t < std::min(length, (p + 1) * page_size) && n < budget; ++t) {
        if (!chosen[static_cast<size_t>(t)]) { chosen[static_cast<size_t>(t)] = 1; ++n; }
      }
    }
    int32_t c = 0;
    for (int64_t t = 0; t < length; ++t) {
      if (chosen[static_cast<size_t>(t)]) dst[c++] = static_cast<int32_t>(t);
    }
    out.counts[static_cast<size_t>(h)] = c;
  }
}

}  // namespace specontext
