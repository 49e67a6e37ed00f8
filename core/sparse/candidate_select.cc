#include "core/sparse/candidate_select.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <numeric>
#include <string>

#include "core/base/host_math.h"

namespace specontext {

namespace {

std::string num(int64_t v) { return std::to_string(v); }
std::string seq_name(SeqId s) { return "sequence " + num(s.value()); }

// A Status from a body that may throw std::bad_alloc (vector growth): nothing escapes core.
template <typename F>
Status no_throw(std::string_view who, F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(who) + ": out of memory");
  } catch (const std::exception& e) {
    return internal_error(std::string(who) + ": " + e.what());
  } catch (...) {
    return internal_error(std::string(who) + ": unknown exception");
  }
}

Status check_heads(std::string_view who, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                   std::string_view prefix) {
  const std::string p = std::string(who) + ": " + std::string(prefix);
  if (n_heads <= 0) return invalid_argument(p + "n_heads must be >= 1 (got " + num(n_heads) + ")");
  if (n_kv_heads <= 0) return invalid_argument(p + "n_kv_heads must be >= 1 (got " + num(n_kv_heads) + ")");
  if (n_heads % n_kv_heads != 0) {
    return invalid_argument(p + "n_heads (" + num(n_heads) + ") must be a multiple of n_kv_heads (" +
                            num(n_kv_heads) + ")");
  }
  if (head_dim <= 0) return invalid_argument(p + "head_dim must be >= 1 (got " + num(head_dim) + ")");
  return Status::ok();
}

// The CSR must be well formed before anything reads through it.
Status check_candidates(const Candidates& c, int64_t n_kv_heads) {
  const std::string p = "select_among_candidates: ";
  if (c.kv_heads != n_kv_heads) {
    return invalid_argument(p + "cand.kv_heads is " + num(c.kv_heads) + ", n_kv_heads is " + num(n_kv_heads));
  }
  if (c.length < 0) return invalid_argument(p + "cand.length must be >= 0 (got " + num(c.length) + ")");
  if (c.length > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(p + "cand.length " + num(c.length) + " exceeds the int32 positions");
  }
  if (static_cast<int64_t>(c.offsets.size()) != n_kv_heads + 1) {
    return invalid_argument(p + "cand.offsets has " + num(static_cast<int64_t>(c.offsets.size())) +
                            " entries, expected kv_heads + 1 = " + num(n_kv_heads + 1));
  }
  if (c.offsets.front() != 0 || c.offsets.back() != static_cast<int64_t>(c.tokens.size())) {
    return invalid_argument(p + "cand.offsets must start at 0 and end at cand.tokens.size() (" +
                            num(static_cast<int64_t>(c.tokens.size())) + ")");
  }
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    const int64_t b = c.offsets[static_cast<size_t>(h)], e = c.offsets[static_cast<size_t>(h + 1)];
    if (e < b) return invalid_argument(p + "cand.offsets decrease at KV head " + num(h));
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = c.tokens[static_cast<size_t>(i)];
      if (t < 0 || t >= c.length) {
        return invalid_argument(p + "cand.tokens of KV head " + num(h) + " holds position " + num(t) +
                                " outside [0, cand.length = " + num(c.length) + ")");
      }
      if (i > b && t <= c.tokens[static_cast<size_t>(i - 1)]) {
        return invalid_argument(p + "cand.tokens of KV head " + num(h) + " are not strictly ascending at " +
                                num(t));
      }
    }
  }
  return Status::ok();
}

}  // namespace

FixedTokens fixed_tokens(const SelectionOptions& o) {
  FixedTokens f;
  f.sinks = std::min(o.sinks, o.budget);
  f.window = std::min(o.window, o.budget - f.sinks);
  return f;
}

void all_candidates(int64_t n_kv_heads, int64_t length, Candidates& out) {
  out.kv_heads = n_kv_heads;
  out.length = length;
  out.offsets.resize(static_cast<size_t>(n_kv_heads + 1));
  out.tokens.resize(static_cast<size_t>(n_kv_heads * length));
  for (int64_t h = 0; h <= n_kv_heads; ++h) out.offsets[static_cast<size_t>(h)] = h * length;
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    std::iota(out.tokens.begin() + h * length, out.tokens.begin() + (h + 1) * length, 0);
  }
}

float quest_page_bound(const float* q, const float* mn, const float* mx, int64_t head_dim) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= head_dim; i += 16) {
    for (int u = 0; u < 16; ++u) {
      const float a = q[i + u] * mn[i + u], b = q[i + u] * mx[i + u];
      acc[u] += a > b ? a : b;
    }
  }
  for (int w = 8; w >= 1; w /= 2) {
    for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
  }
  float tail = 0.0f;
  for (; i < head_dim; ++i) {
    const float a = q[i] * mn[i], b = q[i] * mx[i];
    tail += a > b ? a : b;
  }
  return acc[0] + tail;
}

Status check_candidate_filter_options(const CandidateFilterOptions& o, std::string_view who) {
  if (o.page_size <= 0) {
    return invalid_argument(std::string(who) + ": CandidateFilterOptions.page_size must be >= 1 (got " +
                            num(o.page_size) + ")");
  }
  return check_heads(who, o.n_heads, o.n_kv_heads, o.head_dim, "CandidateFilterOptions.");
}

Status check_selection_options(const SelectionOptions& o, std::string_view who) {
  const std::string p = std::string(who) + ": SelectionOptions.";
  if (o.budget < 1) return invalid_argument(p + "budget must be >= 1 (got " + num(o.budget) + ")");
  if (o.sinks < 0) return invalid_argument(p + "sinks must be >= 0 (got " + num(o.sinks) + ")");
  if (o.window < 0) return invalid_argument(p + "window must be >= 0 (got " + num(o.window) + ")");
  return Status::ok();
}

Status check_append(std::string_view who, SeqId seq, const float* keys, int64_t start, int64_t n,
                    int64_t seen, const CandidateFilterOptions& o, bool check_values) {
  const std::string p = std::string(who) + ": append_keys of " + seq_name(seq) + ": ";
  if (n < 0) return invalid_argument(p + "n must be >= 0 (got " + num(n) + ")");
  if (start != seen) {
    return invalid_argument(p + "start " + num(start) + " is out of order (the sequence holds " + num(seen) +
                            " tokens; keys must extend it)");
  }
  if (n > 0 && keys == nullptr) return invalid_argument(p + "keys is null");
  if (n > std::numeric_limits<int32_t>::max() - start) {
    return invalid_argument(p + "start + n = " + num(start + n) + " exceeds the int32 positions");
  }
  if (!check_values) return Status::ok();
  const int64_t kvd = o.n_kv_heads * o.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    const float* row = keys + t * kvd;
    for (int64_t i = 0; i < kvd; ++i) {
      if (!std::isfinite(row[i])) {
        return invalid_argument(p + "key of position " + num(start + t) + ", KV head " + num(i / o.head_dim) +
                                " is not finite");
      }
    }
  }
  return Status::ok();
}

Status check_shortlist(std::string_view who, SeqId seq, const float* q, int64_t length, int64_t seen,
                       int64_t shortlist_tokens, const SelectionOptions& selection,
                       const CandidateFilterOptions& o) {
  const std::string p = std::string(who) + ": shortlist of " + seq_name(seq) + ": ";
  if (length < 0) return invalid_argument(p + "length must be >= 0 (got " + num(length) + ")");
  if (length > seen) {
    return invalid_argument(p + "length " + num(length) + " exceeds the " + num(seen) + " tokens appended");
  }
  if (shortlist_tokens < 1) {
    return invalid_argument(p + "shortlist_tokens must be >= 1 (got " + num(shortlist_tokens) + ")");
  }
  SPX_RETURN_IF_ERROR(check_selection_options(selection, who));
  if (q == nullptr) return invalid_argument(p + "q is null");
  for (int64_t i = 0; i < o.n_heads * o.head_dim; ++i) {
    if (!std::isfinite(q[i])) {
      return invalid_argument(p + "q of query head " + num(i / o.head_dim) + " is not finite");
    }
  }
  return Status::ok();
}

// ---- select_among_candidates ----

Status select_among_candidates(const float* q, const float* k_cache, int64_t n_heads, int64_t n_kv_heads,
                               int64_t head_dim, const Candidates& cand, const SelectionOptions& opts,
                               Selection& out, GroupReduce reduce) {
  const void* table[1] = {k_cache};
  return select_among_candidates(q, table, DType::kF32, std::max<int64_t>(cand.length, 1), n_heads, n_kv_heads,
                                 head_dim, cand, opts, out, reduce);
}

Status select_among_candidates(const float* q, const void* const* k_blocks, DType k_dtype, int64_t block_tokens,
                               int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, const Candidates& cand,
                               const SelectionOptions& opts, Selection& out, GroupReduce reduce) {
  constexpr std::string_view kWho = "select_among_candidates";
  if (block_tokens <= 0) return invalid_argument("select_among_candidates: block_tokens must be positive");
  if (!is_head_key_dtype(k_dtype)) {
    return invalid_argument("select_among_candidates: keys of dtype " + std::string(dtype_name(k_dtype)) +
                            " (f32, f16 or bf16)");
  }
  SPX_RETURN_IF_ERROR(check_heads(kWho, n_heads, n_kv_heads, head_dim, ""));
  SPX_RETURN_IF_ERROR(check_selection_options(opts, kWho));
  SPX_RETURN_IF_ERROR(check_candidates(cand, n_kv_heads));
  if (!cand.tokens.empty() && (q == nullptr || k_blocks == nullptr)) {
    return invalid_argument("select_among_candidates: q and k_cache must not be null");
  }
  return no_throw(kWho, [&]() -> Status {
    const int64_t budget = opts.budget;
    const FixedTokens fixed = fixed_tokens(opts);
    const int64_t length = cand.length;
    const int64_t group = n_heads / n_kv_heads;
    const int64_t kvd = n_kv_heads * head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    out.kv_heads = n_kv_heads;
    out.budget = budget;
    out.indices.resize(static_cast<size_t>(n_kv_heads * budget));
    out.counts.assign(static_cast<size_t>(n_kv_heads), 0);
    std::vector<float> row, score;
    std::vector<int32_t> order;
    for (int64_t g = 0; g < n_kv_heads; ++g) {
      const int32_t* tok = cand.tokens.data() + cand.offsets[static_cast<size_t>(g)];
      const int64_t n_cand = cand.count(g);
      int32_t* dst = out.indices.data() + g * budget;
      if (n_cand <= budget) {  // as keep_all_within_budget: every candidate fits
        std::copy_n(tok, n_cand, dst);
        out.counts[static_cast<size_t>(g)] = static_cast<int32_t>(n_cand);
        continue;
      }
      // Forced tokens must be candidates: they are kept without competing, and a filter that
      // dropped one would silently change what the step attends to.
      const int64_t lo = fixed.sinks, hi = length - fixed.window;
      int64_t n_forced = 0;
      for (int64_t i = 0; i < n_cand; ++i) n_forced += (tok[i] < lo || tok[i] >= hi) ? 1 : 0;
      const int64_t want_forced = std::min(fixed.sinks, length) +
                                  std::max<int64_t>(0, length - std::max(fixed.sinks, length - fixed.window));
      if (n_forced != want_forced) {
        return invalid_argument("select_among_candidates: KV head " + num(g) + " lacks some of its sink (" +
                                num(fixed.sinks) + ") or window (" + num(fixed.window) +
                                ") tokens of length " + num(length) + " among its " + num(n_cand) +
                                " candidates");
      }
      // Scores with exactly the arithmetic of Backend::retrieval_group_scores' default (each dot
      // product, the max, the exp, the double sum in ascending order), but token-major: each
      // candidate's key row is gathered once for all query heads of the group.
      row.resize(static_cast<size_t>(group * n_cand));
      score.assign(static_cast<size_t>(n_cand), 0.0f);
      for (int64_t c = 0; c < n_cand; ++c) {
        const int64_t t = tok[c];
        const void* kt = element_at(k_blocks[t / block_tokens], k_dtype, (t % block_tokens) * kvd + g * head_dim);
        group_logits(k_dtype, q + g * group * head_dim, kt, group, head_dim, scale, row.data() + c, n_cand);
      }
      for (int64_t j = 0; j < group; ++j) {
        float* r = row.data() + j * n_cand;
        float mx = -INFINITY;
        for (int64_t c = 0; c < n_cand; ++c) mx = std::max(mx, r[c]);
        double sum = 0.0;
        for (int64_t c = 0; c < n_cand; ++c) sum += (r[c] = std::exp(r[c] - mx));
        // std::max skips a NaN logit, but the sum does not: one check catches NaN and inf.
        if (!std::isfinite(mx) || !std::isfinite(sum)) {
          return invalid_argument("select_among_candidates: scores of query head " + num(g * group + j) +
                                  " are not finite (NaN or inf in q or in the candidates' keys)");
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t c = 0; c < n_cand; ++c) {
          if (reduce == GroupReduce::kTurns) {
            r[c] *= inv;  // this query head's weights, ranked below
          } else {
            score[static_cast<size_t>(c)] = std::max(score[static_cast<size_t>(c)], r[c] * inv);
          }
        }
      }
      // Fixed part, then the best of the middle: the rules of select_from_group_scores, on
      // candidate indices (candidates ascend, so a smaller index is an older token).
      int32_t n = 0;
      order.clear();
      for (int64_t c = 0; c < n_cand; ++c) {
        if (tok[c] < lo || tok[c] >= hi) {
          dst[n++] = tok[c];
        } else {
          order.push_back(static_cast<int32_t>(c));
        }
      }
      const int64_t take = std::min<int64_t>(budget - n, static_cast<int64_t>(order.size()));
      if (take > 0) {
        if (reduce == GroupReduce::kTurns) score_group_by_turns(row.data(), n_cand, group, take, order, score.data());
        auto better = [&](int32_t a, int32_t b) {
          const float sa = score[static_cast<size_t>(a)], sb = score[static_cast<size_t>(b)];
          return sa > sb || (sa == sb && a < b);
        };
        std::nth_element(order.begin(), order.begin() + take - 1, order.end(), better);
        for (int64_t i = 0; i < take; ++i) dst[n++] = tok[order[static_cast<size_t>(i)]];
      }
      std::sort(dst, dst + n);
      out.counts[static_cast<size_t>(g)] = n;
    }
    return Status::ok();
  });
}

// ---- ReferenceCandidateFilter ----

Result<std::unique_ptr<ReferenceCandidateFilter>> ReferenceCandidateFilter::create(
    const CandidateFilterOptions& options) {
  SPX_RETURN_IF_ERROR(check_candidate_filter_options(options, "ReferenceCandidateFilter"));
  auto* f = new (std::nothrow) ReferenceCandidateFilter(options);
  if (f == nullptr) return resource_exhausted("ReferenceCandidateFilter: out of memory");
  return std::unique_ptr<ReferenceCandidateFilter>(f);
}

int64_t ReferenceCandidateFilter::length(SeqId seq) const {
  auto it = keys_.find(seq);
  if (it == keys_.end()) return 0;
  return static_cast<int64_t>(it->second.size()) / (options_.n_kv_heads * options_.head_dim);
}

Status ReferenceCandidateFilter::append_keys(SeqId seq, const float* keys, int64_t start, int64_t n) {
  constexpr std::string_view kWho = "ReferenceCandidateFilter";
  SPX_RETURN_IF_ERROR(check_append(kWho, seq, keys, start, n, length(seq), options_));
  return no_throw(kWho, [&]() -> Status {
    const int64_t kvd = options_.n_kv_heads * options_.head_dim;
    std::vector<float>& v = keys_[seq];
    v.insert(v.end(), keys, keys + n * kvd);
    return Status::ok();
  });
}

void ReferenceCandidateFilter::drop(SeqId seq) { keys_.erase(seq); }

Status ReferenceCandidateFilter::shortlist(SeqId seq, const float* q, int64_t length,
                                           int64_t shortlist_tokens, const SelectionOptions& selection,
                                           Candidates& out) {
  constexpr std::string_view kWho = "ReferenceCandidateFilter";
  auto it = keys_.find(seq);
  if (it == keys_.end()) {
    return invalid_argument(std::string(kWho) + ": shortlist of unknown " + seq_name(seq));
  }
  const int64_t seen = this->length(seq);
  SPX_RETURN_IF_ERROR(check_shortlist(kWho, seq, q, length, seen, shortlist_tokens, selection, options_));
  return no_throw(kWho, [&]() -> Status {
    const int64_t nkv = options_.n_kv_heads, hd = options_.head_dim, kvd = nkv * hd;
    const int64_t group = options_.n_heads / nkv, P = options_.page_size;
    if (length <= shortlist_tokens) {
      all_candidates(nkv, length, out);
      return Status::ok();
    }
    const std::vector<float>& keys = it->second;
    const FixedTokens fixed = fixed_tokens(selection);
    const int64_t n_pages = (length + P - 1) / P;
    out.kv_heads = nkv;
    out.length = length;
    out.offsets.assign(1, 0);
    out.tokens.clear();
    std::vector<float> bound(static_cast<size_t>(n_pages)), mn(static_cast<size_t>(hd)),
        mx(static_cast<size_t>(hd));
    std::vector<char> chosen(static_cast<size_t>(length));
    std::vector<int64_t> order;
    for (int64_t g = 0; g < nkv; ++g) {
      // Each page's summary from its keys: every appended key of the page, in token order.
      for (int64_t p = 0; p < n_pages; ++p) {
        const int64_t end = std::min(seen, (p + 1) * P);
        for (int64_t t = p * P; t < end; ++t) {
          const float* k = keys.data() + t * kvd + g * hd;
          for (int64_t i = 0; i < hd; ++i) {
            mn[static_cast<size_t>(i)] = t == p * P ? k[i] : std::min(mn[static_cast<size_t>(i)], k[i]);
            mx[static_cast<size_t>(i)] = t == p * P ? k[i] : std::max(mx[static_cast<size_t>(i)], k[i]);
          }
        }
        float best = -INFINITY;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          best = std::max(best, quest_page_bound(q + h * hd, mn.data(), mx.data(), hd));
        }
        bound[static_cast<size_t>(p)] = best;
      }
      // Whole pages of the sinks and of the window first.
      std::fill(chosen.begin(), chosen.end(), 0);
      std::vector<char> forced(static_cast<size_t>(n_pages), 0);
      for (int64_t t = 0; t < std::min(fixed.sinks, length); ++t) forced[static_cast<size_t>(t / P)] = 1;
      for (int64_t t = std::max(fixed.sinks, length - fixed.window); t < length; ++t) {
        forced[static_cast<size_t>(t / P)] = 1;
      }
      int64_t count = 0;
      for (int64_t t = 0; t < length; ++t) {
        if (forced[static_cast<size_t>(t / P)]) {
          chosen[static_cast<size_t>(t)] = 1;
          ++count;
        }
      }
      // Then the rest by bound; stable_sort keeps the older page first among equal bounds.
      order.clear();
      for (int64_t p = 0; p < n_pages; ++p) {
        if (!forced[static_cast<size_t>(p)]) order.push_back(p);
      }
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return bound[static_cast<size_t>(a)] > bound[static_cast<size_t>(b)];
      });
      for (int64_t p : order) {
        for (int64_t t = p * P; t < std::min(length, (p + 1) * P) && count < shortlist_tokens; ++t) {
          chosen[static_cast<size_t>(t)] = 1;
          ++count;
        }
        if (count >= shortlist_tokens) break;
      }
      for (int64_t t = 0; t < length; ++t) {
        if (chosen[static_cast<size_t>(t)]) out.tokens.push_back(static_cast<int32_t>(t));
      }
      out.offsets.push_back(static_cast<int64_t>(out.tokens.size()));
    }
    return Status::ok();
  });
}

}  // namespace specontext
