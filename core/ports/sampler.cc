#include "core/ports/sampler.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace specontext {

Status SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return invalid_argument("temperature must be >= 0 (got " + std::to_string(temperature) + ")");
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1] (got " + std::to_string(top_p) + ")");
  }
  if (top_k < 0) return invalid_argument("top_k must be >= 0 (got " + std::to_string(top_k) + ")");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return invalid_argument("repetition_penalty must be > 0 (got " +
                            std::to_string(repetition_penalty) + ")");
  }
  return Status::ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  rng_state_ = params.seed != 0
                   ? params.seed
                   : static_cast<uint64_t>(
                         std::chrono::steady_clock::now().time_since_epoch().count()) | 1u;
}

uint32_t Sampler::random_u32() {  // xorshift* as in llama2.c
  rng_state_ ^= rng_state_ >> 12;
  rng_state_ ^= rng_state_ << 25;
  rng_state_ ^= rng_state_ >> 27;
  return static_cast<uint32_t>((rng_state_ * 0x2545F4914F6CDD1Dull) >> 32);
}

float Sampler::random_f32() { return static_cast<float>(random_u32() >> 8) / 16777216.0f; }

int32_t argmax(std::span<const float> values) {
  int32_t best = 0;
  for (size_t i = 1; i < values.size(); ++i) {
    if (values[i] > values[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best;
}

TokenLogprobs token_logprobs(std::span<const float> logits, TokenId chosen, int32_t top_n) {
  TokenLogprobs out;
  if (logits.empty()) return out;
  float max_logit = logits[0];
  for (float v : logits) max_logit = std::max(max_logit, v);
  double sum = 0.0;  // in double: a 128K-entry sum of floats loses the small terms
  for (float v : logits) sum += std::exp(static_cast<double>(v) - max_logit);
  const double log_norm = max_logit + std::log(sum);
  auto logprob = [&](int32_t id) {
    return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(id)]) - log_norm);
  };
  out.chosen = {chosen, logprob(chosen)};
  const float chosen_logit = logits[static_cast<size_t>(chosen)];
  out.chosen_rank = 1 + static_cast<int32_t>(std::count_if(logits.begin(), logits.end(),
                                                           [&](float v) { return v > chosen_logit; }));
  const auto n = static_cast<size_t>(std::clamp<int64_t>(top_n, 0, static_cast<int64_t>(logits.size())));
  if (n == 0) return out;
  // A bounded min-heap of the best n so far: vocab · log n, no copy of the logits.
  auto better = [&](int32_t a, int32_t b) {
    const float va = logits[static_cast<size_t>(a)], vb = logits[static_cast<size_t>(b)];
    return va > vb || (va == vb && a < b);
  };
  std::vector<int32_t> heap;
  heap.reserve(n + 1);
  for (int32_t id = 0; id < static_cast<int32_t>(logits.size()); ++id) {
    if (heap.size() == n && !better(id, heap.front())) continue;
    heap.push_back(id);
    std::push_heap(heap.begin(), heap.end(), better);
    if (heap.size() > n) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.pop_back();
    }
  }
  std::sort(heap.begin(), heap.end(), better);
  out.top.reserve(n);
  for (int32_t id : heap) out.top.push_back({id, logprob(id)});
  return out;
}

TokenDraw Sampler::next_draw(std::span<const TokenId> history) {
  DistinctTokens distinct;
  if (params_.repetition_penalty != 1.0f) distinct.add(history);
  return next_draw(distinct);
}

TokenDraw Sampler::next_draw(const DistinctTokens& history) {
  TokenDraw draw;
  draw.params = params_;
  if (params_.repetition_penalty != 1.0f) draw.penalized.assign(history.ids().begin(), history.ids().end());
  if (params_.temperature != 0.0f) draw.coin = random_f32();
  return draw;
}

TokenId Sampler::sample(std::span<float> logits, std::span<const TokenId> history) {
  return sample_with_coin(logits, next_draw(history), candidates_);
}

TokenId sample_with_coin(std::span<float> logits, const TokenDraw& draw,
                         std::vector<std::pair<float, int32_t>>& candidates) {
  const SamplingParams& params = draw.params;
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params.repetition_penalty != 1.0f) {
    for (TokenId t : draw.penalized) {
      if (t < 0 || t >= n) continue;
      float& l = logits[static_cast<size_t>(t)];
      l = l > 0.0f ? l / params.repetition_penalty : l * params.repetition_penalty;
    }
  }
  if (params.temperature == 0.0f) return argmax(logits);
  if (n <= 1) return 0;  // (top-p's cutoff divides by n - 1)

  // softmax(logits / T), in float like llama2.c
  float max_logit = logits[0];
  for (int32_t i = 0; i < n; ++i) {
    logits[static_cast<size_t>(i)] /= params.temperature;
  }
  max_logit = *std::max_element(logits.begin(), logits.end());
  float sum = 0.0f;
  for (auto& l : logits) {
    l = std::exp(l - max_logit);
    sum += l;
  }
  for (auto& l : logits) l /= sum;

  if (params.top_k > 0 && params.top_k < n) {
    // Keep the k most probable tokens, renormalise.
    candidates.clear();
    for (int32_t i = 0; i < n; ++i) candidates.emplace_back(logits[static_cast<size_t>(i)], i);
    std::nth_element(candidates.begin(), candidates.begin() + params.top_k - 1, candidates.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    const float kth = candidates[static_cast<size_t>(params.top_k - 1)].first;
    int32_t kept_equal = 0;
    float kept_sum = 0.0f;
    int32_t above = 0;
    for (int32_t i = 0; i < n; ++i) above += logits[static_cast<size_t>(i)] > kth ? 1 : 0;
    for (int32_t i = 0; i < n; ++i) {
      float& p = logits[static_cast<size_t>(i)];
      const bool keep = p > kth || (p == kth && above + kept_equal++ < params.top_k);
      if (!keep) p = 0.0f;
      kept_sum += p;
    }
    for (auto& p : logits) p /= kept_sum;
  }

  const float coin = draw.coin;
  if (params.top_p >= 1.0f) {  // sample from the full distribution
    float cdf = 0.0f;
    for (int32_t i = 0; i < n; ++i) {
      cdf += logits[static_cast<size_t>(i)];
      if (coin < cdf) return i;
    }
    return n - 1;
  }
  // top-p as llama2.c sample_topp: drop tokens below (1 - p) / (n - 1), sort descending,
  // keep the smallest prefix whose mass exceeds p.
  const float cutoff = (1.0f - params.top_p) / static_cast<float>(n - 1);
  candidates.clear();
  for (int32_t i = 0; i < n; ++i) {
    if (logits[static_cast<size_t>(i)] >= cutoff) candidates.emplace_back(logits[static_cast<size_t>(i)], i);
  }
  // With top_p < 1/n every token can fall below the cutoff (llama2.c then reads out of bounds):
  // the most probable token is the limit of the procedure as the kept prefix shrinks.
  if (candidates.empty()) return argmax(logits);
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  float cumulative = 0.0f;
  size_t last = candidates.size() - 1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    cumulative += candidates[i].first;
    if (cumulative > params.top_p) {
      last = i;
      break;
    }
  }
  const float r = coin * cumulative;
  float cdf = 0.0f;
  for (size_t i = 0; i <= last; ++i) {
    cdf += candidates[i].first;
    if (r < cdf) return candidates[i].second;
  }
  return candidates[last].second;
}

}  // namespace specontext
