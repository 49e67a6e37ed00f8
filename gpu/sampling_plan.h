// Host-side planning of CudaBackend::sample_rows: argument checks (naming the field), each row's
// mode (greedy, index-order CDF, top-k, top-p, both), the in-range penalty ids, the cutoff of
// llama2.c's top-p pre-filter (computed here in float exactly as core/ports/sampler.cc does), which rows
// need a sort and their slots, the groups that bound the sort buffers, and the scratch sizes.
// Pure C++ with no CUDA calls: tests/gpu/sampling_plan_test.cc runs a host mirror of the kernels
// from these plans and requires sample_with_coin's tokens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/sampler.h"
#include "gpu/kernels.h"
#include "gpu/sample_keys.h"

namespace specontext::gpu {

// Keys of one sort buffer per group (before the buffers of a group would exceed it, a new group
// starts; a row longer than this still gets one slot). 2^24 keys = 128 MiB per buffer.
inline constexpr int64_t kSampleMaxSortKeys = int64_t{1} << 24;

struct SampleGroupPlan {
  int64_t row_begin = 0;
  int64_t n_rows = 0;
  std::vector<int32_t> begin1;     // [n_slots] slot · vocab
  std::vector<int32_t> begin2;     // [n_seg2] slot · vocab of the kSampleTopKTopP rows
  std::vector<int32_t> rows_topk;  // rows of modes kSampleTopK / kSampleTopKTopP (absolute)
  std::vector<int32_t> rows_topp;  // rows of modes kSampleTopP / kSampleTopKTopP (absolute)
  int32_t n_slots() const { return static_cast<int32_t>(begin1.size()); }
  int32_t n_seg2() const { return static_cast<int32_t>(begin2.size()); }
};

struct SamplePlan {
  // rows == 0, or vocab == 1 (every row's token is 0, as the host: argmax of one value, or
  // "n <= 1 -> 0"): nothing runs on the device; tokens are written by fill_host_only.
  bool host_only = true;
  int64_t rows = 0;
  int64_t vocab = 0;
  int key_shift = 1;
  std::vector<kernels::SampleRowMeta> meta;  // [rows]
  std::vector<int32_t> penalized;            // the rows' in-range ids, concatenated
  std::vector<SampleGroupPlan> groups;
  int32_t max_slots = 0;  // largest n_slots of a group
  int32_t max_seg2 = 0;   // largest n_seg2 of a group
  size_t key_words() const { return static_cast<size_t>(max_slots) * static_cast<size_t>(vocab); }
};

// Checks (kInvalidArgument naming the field): vocab <= 0 or beyond int32; rows beyond int32; null
// logits / draws / tokens with rows > 0; draws[r].params failing SamplingParams::validate(); a
// coin outside [0, 1) in a sampling row (temperature != 0); a penalized id listed twice while the
// penalty is on (core/ports/sampler.h requires them distinct; applying one twice has no parallel
// meaning). Ids outside [0, vocab) are dropped, as the host ignores them. rows <= 0: empty plan.
// max_sort_keys bounds a group's sort buffers (tests use small values to get many groups).
Result<SamplePlan> plan_sample_rows(const float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                                    const TokenId* tokens, int64_t max_sort_keys = kSampleMaxSortKeys);

// host_only plans: tokens[r] = 0 for every row.
void fill_host_only(const SamplePlan& plan, TokenId* tokens);

}  // namespace specontext::gpu
