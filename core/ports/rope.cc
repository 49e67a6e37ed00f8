// RoPE frequency tables, including the llama3 and YaRN context-extension schemes, following the
// formulas of Hugging Face transformers (modeling_rope_utils.py) so HF checkpoints match.
#include <algorithm>
#include <cmath>

#include "core/ports/backend.h"

namespace specontext {

namespace {

constexpr double kPi = 3.14159265358979323846;

// YaRN: the dimension index at which a rotation count is reached within max_pos positions.
double yarn_correction_dim(double num_rotations, double dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (num_rotations * 2.0 * kPi))) / (2.0 * std::log(base));
}

}  // namespace

RopeParams make_rope_params(const ModelConfig& c) {
  RopeParams p;
  p.head_dim = c.head_dim;
  p.style = c.rope_style;
  const int64_t half = c.head_dim / 2;
  const double base = c.rope_theta;
  const double dim = static_cast<double>(c.head_dim);
  std::vector<double> inv(half);
  for (int64_t i = 0; i < half; ++i) inv[i] = 1.0 / std::pow(base, (2.0 * i) / dim);

  const RopeScaling& s = c.rope_scaling;
  switch (s.type) {
    case RopeScalingType::kNone:
      break;
    case RopeScalingType::kLinear:
      for (auto& f : inv) f /= s.factor;
      break;
    case RopeScalingType::kLlama3: {
      const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_ctx / s.low_freq_factor;
      const double high_wavelen = old_ctx / s.high_freq_factor;
      for (auto& f : inv) {
        const double wavelen = 2.0 * kPi / f;
        if (wavelen > low_wavelen) {
          f = f / s.factor;
        } else if (wavelen >= high_wavelen) {
          const double smooth =
              (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1.0 - smooth) * f / s.factor + smooth * f;
        }
      }
      break;
    }
    case RopeScalingType::kYarn: {
      const double max_pos = static_cast<double>(s.original_max_position_embeddings > 0
                                                     ? s.original_max_position_embeddings
                                                     : c.max_seq_len);
      double low = std::floor(yarn_correction_dim(s.beta_fast, dim, base, max_pos));
      double high = std::ceil(yarn_correction_dim(s.beta_slow, dim, base, max_pos));
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;  // avoid a zero-width ramp
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation_weight = 1.0 - ramp;
        const double extrapolated = inv[i];
        const double interpolated = inv[i] / s.factor;
        inv[i] = interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight;
      }
      p.mscale = static_cast<float>(s.attention_factor > 0.0
                                        ? s.attention_factor
                                        : (s.factor > 1.0 ? 0.1 * std::log(s.factor) + 1.0 : 1.0));
      break;
    }
  }
  if (!c.rope_freq_factors.empty()) {  // ggml_rope_ext: theta / freq_factors[i]
    for (int64_t i = 0; i < half; ++i) inv[i] /= c.rope_freq_factors[static_cast<size_t>(i)];
  }
  p.inv_freq.assign(inv.begin(), inv.end());
  return p;
}

}  // namespace specontext
