#include "gpu/sampling_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

namespace specontext::gpu {

namespace {

std::string row_field(int64_t r, const char* field) {
  return "sample_rows: draws[" + std::to_string(r) + "]." + field;
}

}  // namespace

Result<SamplePlan> plan_sample_rows(const float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                                    const TokenId* tokens, int64_t max_sort_keys) {
  SamplePlan plan;
  if (rows <= 0) return plan;
  if (vocab <= 0) return invalid_argument("sample_rows: vocabulary of " + std::to_string(vocab) + " tokens");
  if (vocab > INT32_MAX) {
    return invalid_argument("sample_rows: vocab = " + std::to_string(vocab) + " exceeds int32 token ids");
  }
  if (rows > INT32_MAX) return invalid_argument("sample_rows: rows = " + std::to_string(rows) + " beyond int32");
  if (logits == nullptr) return invalid_argument("sample_rows: null logits");
  if (draws == nullptr) return invalid_argument("sample_rows: null draws");
  if (tokens == nullptr) return invalid_argument("sample_rows: null tokens");

  plan.rows = rows;
  plan.vocab = vocab;
  plan.key_shift = kernels::sample_key_shift(vocab);
  plan.meta.resize(static_cast<size_t>(rows));
  std::vector<uint64_t> seen;  // bitmap of the current row's penalized ids, cleared after each row
  for (int64_t r = 0; r < rows; ++r) {
    const TokenDraw& d = draws[r];
    const SamplingParams& p = d.params;
    const Status valid = p.validate();
    if (!valid.is_ok()) return invalid_argument(row_field(r, "params: ") + valid.message());
    const bool sampling = p.temperature != 0.0f;
    if (sampling && !(d.coin >= 0.0f && d.coin < 1.0f)) {
      return invalid_argument(row_field(r, "coin") + " = " + std::to_string(d.coin) + " outside [0, 1)");
    }
    kernels::SampleRowMeta& m = plan.meta[static_cast<size_t>(r)];
    m = kernels::SampleRowMeta{};
    m.temperature = p.temperature;
    m.top_p = p.top_p;
    m.penalty = p.repetition_penalty;
    m.coin = d.coin;
    m.slot = -1;
    m.seg2 = -1;
    m.penalized_offset = static_cast<int64_t>(plan.penalized.size());
    if (p.repetition_penalty != 1.0f && !d.penalized.empty()) {
      if (seen.empty()) seen.assign(static_cast<size_t>((vocab + 63) / 64), 0);
      const size_t first = plan.penalized.size();
      Status dup = Status::ok();
      for (TokenId t : d.penalized) {
        if (t < 0 || t >= vocab) continue;
        uint64_t& word = seen[static_cast<size_t>(t) / 64];
        const uint64_t bit = uint64_t{1} << (t % 64);
        if ((word & bit) != 0) {
          dup = invalid_argument(row_field(r, "penalized") + " lists token " + std::to_string(t) +
                                 " twice (ids must be distinct)");
          break;
        }
        word |= bit;
        plan.penalized.push_back(t);
      }
      for (size_t j = first; j < plan.penalized.size(); ++j) seen[static_cast<size_t>(plan.penalized[j]) / 64] = 0;
      if (!dup.is_ok()) return dup;
      m.n_penalized = static_cast<int32_t>(plan.penalized.size() - first);
    }
    if (!sampling) {
      m.mode = kernels::kSampleGreedy;
      continue;
    }
    const bool top_k = p.top_k > 0 && p.top_k < vocab;
    const bool top_p = p.top_p < 1.0f;
    m.top_k = top_k ? p.top_k : 0;
    m.mode = top_k ? (top_p ? kernels::kSampleTopKTopP : kernels::kSampleTopK)
                   : (top_p ? kernels::kSampleTopP : kernels::kSampleIndexCdf);
    // Exactly core/ports/sampler.cc's float expression (vocab > 1 whenever the device runs).
    if (top_p && vocab > 1) m.cutoff = (1.0f - p.top_p) / static_cast<float>(vocab - 1);
  }
  plan.host_only = vocab == 1;
  if (plan.host_only) return plan;

  // Groups of consecutive rows with at most max_slots sorted rows each.
  const int64_t max_slots =
      std::clamp<int64_t>(max_sort_keys / vocab, 1, std::max<int64_t>(INT32_MAX / vocab, 1));
  SampleGroupPlan group;
  auto close_group = [&](int64_t next_row) {
    group.n_rows = next_row - group.row_begin;
    plan.max_slots = std::max(plan.max_slots, group.n_slots());
    plan.max_seg2 = std::max(plan.max_seg2, group.n_seg2());
    plan.groups.push_back(std::move(group));
    group = SampleGroupPlan{};
    group.row_begin = next_row;
  };
  for (int64_t r = 0; r < rows; ++r) {
    kernels::SampleRowMeta& m = plan.meta[static_cast<size_t>(r)];
    const bool sorted = m.mode == kernels::kSampleTopK || m.mode == kernels::kSampleTopP ||
                        m.mode == kernels::kSampleTopKTopP;
    if (!sorted) continue;
    if (group.n_slots() == max_slots) close_group(r);
    m.slot = group.n_slots();
    const int32_t begin = static_cast<int32_t>(static_cast<int64_t>(m.slot) * vocab);
    group.begin1.push_back(begin);
    if (m.mode != kernels::kSampleTopP) group.rows_topk.push_back(static_cast<int32_t>(r));
    if (m.mode != kernels::kSampleTopK) group.rows_topp.push_back(static_cast<int32_t>(r));
    if (m.mode == kernels::kSampleTopKTopP) {
      m.seg2 = group.n_seg2();
      group.begin2.push_back(begin);
    }
  }
  close_group(rows);
  return plan;
}

void fill_host_only(const SamplePlan& plan, TokenId* tokens) {
  for (int64_t r = 0; r < plan.rows; ++r) tokens[r] = 0;
}

}  // namespace specontext::gpu
