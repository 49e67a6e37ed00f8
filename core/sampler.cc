#include "core/sampler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <unordered_set>

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

TokenId Sampler::sample(std::span<float> logits, std::span<const TokenId> history) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params_.repetition_penalty != 1.0f && !history.empty()) {
    std::unordered_set<TokenId> seen(history.begin(), history.end());
    for (TokenId t : seen) {
      if (t < 0 || t >= n) continue;
      float& l = logits[static_cast<size_t>(t)];
      l = l > 0.0f ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }
  if (params_.temperature == 0.0f) return argmax(logits);

  // softmax(logits / T), in float like llama2.c
  float max_logit = logits[0];
  for (int32_t i = 0; i < n; ++i) {
    logits[static_cast<size_t>(i)] /= params_.temperature;
  }
  max_logit = *std::max_element(logits.begin(), logits.end());
  float sum = 0.0f;
  for (auto& l : logits) {
    l = std::exp(l - max_logit);
    sum += l;
  }
  for (auto& l : logits) l /= sum;

  if (params_.top_k > 0 && params_.top_k < n) {
    // Keep the k most probable tokens, renormalise.
    candidates_.clear();
    for (int32_t i = 0; i < n; ++i) candidates_.emplace_back(logits[static_cast<size_t>(i)], i);
    std::nth_element(candidates_.begin(), candidates_.begin() + params_.top_k - 1, candidates_.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    const float kth = candidates_[static_cast<size_t>(params_.top_k - 1)].first;
    int32_t kept_equal = 0;
    float kept_sum = 0.0f;
    int32_t above = 0;
    for (int32_t i = 0; i < n; ++i) above += logits[static_cast<size_t>(i)] > kth ? 1 : 0;
    for (int32_t i = 0; i < n; ++i) {
      float& p = logits[static_cast<size_t>(i)];
      const bool keep = p > kth || (p == kth && above + kept_equal++ < params_.top_k);
      if (!keep) p = 0.0f;
      kept_sum += p;
    }
    for (auto& p : logits) p /= kept_sum;
  }

  const float coin = random_f32();
  if (params_.top_p >= 1.0f) {  // sample from the full distribution
    float cdf = 0.0f;
    for (int32_t i = 0; i < n; ++i) {
      cdf += logits[static_cast<size_t>(i)];
      if (coin < cdf) return i;
    }
    return n - 1;
  }
  // top-p as llama2.c sample_topp: drop tokens below (1 - p) / (n - 1), sort descending,
  // keep the smallest prefix whose mass exceeds p.
  const float cutoff = (1.0f - params_.top_p) / static_cast<float>(n - 1);
  candidates_.clear();
  for (int32_t i = 0; i < n; ++i) {
    if (logits[static_cast<size_t>(i)] >= cutoff) candidates_.emplace_back(logits[static_cast<size_t>(i)], i);
  }
  std::stable_sort(candidates_.begin(), candidates_.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  float cumulative = 0.0f;
  size_t last = candidates_.size() - 1;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    cumulative += candidates_[i].first;
    if (cumulative > params_.top_p) {
      last = i;
      break;
    }
  }
  const float r = coin * cumulative;
  float cdf = 0.0f;
  for (size_t i = 0; i <= last; ++i) {
    cdf += candidates_[i].first;
    if (r < cdf) return candidates_[i].second;
  }
  return candidates_[last].second;
}

}  // namespace specontext
