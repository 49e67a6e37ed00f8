#include "gpu/retrieval_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>

#include "core/base/dtype.h"
#include "gpu/plan_internal.h"

namespace specontext::gpu {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Blocks per SM the score and selection grids aim for before they stop splitting further.
constexpr int64_t kTargetBlocksPerSm = 2;
constexpr int64_t kMaxTokensPerBlock = 2048;
// A selection block scans at least this many middle elements (fewer: the launch overhead wins).
constexpr int64_t kSelectMinPerBlock = 4096;
constexpr int64_t kSelectMaxBlocksPerSegment = 64;

}  // namespace

// ---- retrieval_group_scores ----

Result<RetrievalScoresPlan> plan_retrieval_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                                  int64_t block_tokens, int64_t length, int64_t n_heads,
                                                  int64_t n_kv_heads, int64_t head_dim, float* out,
                                                  int sm_count, SharedMemoryLimits limits) {
  RetrievalScoresPlan plan;
  if (length <= 0) return plan;
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim <= 0) {
    return invalid_argument("retrieval_group_scores: " + std::to_string(n_heads) + " query heads, " +
                            std::to_string(n_kv_heads) + " KV heads, head_dim " + std::to_string(head_dim));
  }
  if (head_dim > kernels::kRetrievalMaxHeadDim) {
    return unimplemented("CUDA retrieval_group_scores supports head_dim up to " +
                         std::to_string(kernels::kRetrievalMaxHeadDim) + ", got " + std::to_string(head_dim));
  }
  if (q == nullptr || k_blocks == nullptr || out == nullptr) {
    return invalid_argument("retrieval_group_scores: null q, k_blocks or out");
  }
  if (block_tokens <= 0) {
    return invalid_argument("retrieval_group_scores: blocks of " + std::to_string(block_tokens) + " tokens");
  }
  if (!is_kv_dtype(k_dtype)) {
    return invalid_argument("retrieval_group_scores: keys of dtype " + std::string(dtype_name(k_dtype)) +
                            " (f32, f16 or bf16)");
  }
  const kernels::KvType k_type = plan_internal::kv_type_of(k_dtype);
  // 4-element loads: 16 bytes of f32, 8 of f16 / bf16.
  const uintptr_t vec_align = static_cast<uintptr_t>(4 * kernels::kv_type_bytes(k_type)) - 1;
  const int64_t n_blocks = (length + block_tokens - 1) / block_tokens;
  bool blocks_aligned = true;
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (k_blocks[b] == nullptr) {
      return invalid_argument("retrieval_group_scores: K block " + std::to_string(b) + " is null");
    }
    blocks_aligned = blocks_aligned && (reinterpret_cast<uintptr_t>(k_blocks[b]) & vec_align) == 0;
  }
  if (length > INT32_MAX) {
    return invalid_argument("retrieval_group_scores: length " + std::to_string(length) +
                            " exceeds int32 token positions");
  }
  if (n_kv_heads > 65535) return invalid_argument("retrieval_group_scores: more than 65535 KV heads");

  kernels::RetrievalScoresLaunch& a = plan.launch;
  a.q = q;
  a.k_blocks = k_blocks;
  a.k_type = k_type;
  a.block_tokens = block_tokens;
  plan.n_blocks = n_blocks;
  a.out = out;
  a.length = length;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.head_dim = head_dim;
  a.group = n_heads / n_kv_heads;
  // Each thread covers at most 64 dims of a row: registers stay at 8 accumulators + 2 float4.
  a.parts = head_dim <= 64 ? 1 : head_dim <= 128 ? 2 : 4;
  a.tile = kernels::kRetrievalThreads / a.parts;
  a.part_dims = static_cast<int>(round_up(ceil_div(head_dim, a.parts), 4));
  a.k_stride = static_cast<int>(round_up(a.part_dims, 32) + 4);
  a.vec4 = head_dim % 4 == 0 && blocks_aligned;
  a.q_scale = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(head_dim)));

  const int64_t q_floats = a.group * a.parts * a.part_dims;
  const int64_t red_floats = a.parts > 1 ? kernels::kRetrievalHeadsPerPass * kernels::kRetrievalThreads : 0;
  const int64_t smem_floats = kernels::kRetrievalThreads * a.k_stride + q_floats + red_floats;
  a.smem_bytes = static_cast<size_t>(smem_floats) * sizeof(float);
  // The kernel's static array counts against the same per-block limit as the dynamic part.
  const size_t smem_total = a.smem_bytes + kernels::kRetrievalStaticSmemBytes;
  if (smem_total > limits.per_block_optin) {
    return unimplemented("CUDA retrieval_group_scores: " + std::to_string(a.group) +
                         " query heads per KV head of head_dim " + std::to_string(head_dim) + " need " +
                         std::to_string(smem_total) + " bytes of shared memory per block (" +
                         std::to_string(a.smem_bytes) + " dynamic + " +
                         std::to_string(kernels::kRetrievalStaticSmemBytes) + " static; the device allows " +
                         std::to_string(limits.per_block_optin) + ")");
  }
  a.smem_opt_in = smem_total > limits.per_block;

  // Enough blocks to fill the device, but whole tiles and at most kMaxTokensPerBlock per block.
  const int64_t target_blocks = std::max<int64_t>(sm_count, 1) * kTargetBlocksPerSm;
  const int64_t per_block =
      round_up(std::max<int64_t>(ceil_div(length * n_kv_heads, target_blocks), 1), a.tile);
  a.tokens_per_block = std::clamp<int64_t>(per_block, a.tile, kMaxTokensPerBlock);
  a.blocks_per_head = ceil_div(length, a.tokens_per_block);
  if (a.blocks_per_head > INT_MAX) return invalid_argument("retrieval_group_scores: grid too large");

  plan.logits_floats = static_cast<size_t>(n_heads * length);
  plan.partial_floats = static_cast<size_t>(2 * n_heads * a.blocks_per_head);
  plan.stats_floats = static_cast<size_t>(2 * n_heads);
  return plan;
}

// ---- select_top_tokens ----

size_t SelectTopPlan::hist_words() const {
  return static_cast<size_t>(launch.n_segments) * kernels::kSelectMaxBins;
}

size_t SelectTopPlan::warp_count_words() const {
  return static_cast<size_t>(launch.n_segments * launch.blocks_per_segment) * kernels::kSelectWarps;
}

Result<SelectTopPlan> plan_select_top_tokens(int64_t n_kv_heads, int64_t length, const SelectionOptions& o,
                                             int sm_count) {
  if (n_kv_heads < 0)
    return invalid_argument("select_top_tokens: n_kv_heads = " + std::to_string(n_kv_heads) + " < 0");
  if (length < 0) return invalid_argument("select_top_tokens: length = " + std::to_string(length) + " < 0");
  if (o.sinks < 0)
    return invalid_argument("select_top_tokens: options.sinks = " + std::to_string(o.sinks) + " < 0");
  if (o.window < 0) {
    return invalid_argument("select_top_tokens: options.window = " + std::to_string(o.window) + " < 0");
  }
  if (length > INT32_MAX) {
    return invalid_argument("select_top_tokens: length " + std::to_string(length) +
                            " exceeds int32 token positions");
  }
  if (n_kv_heads > 65535) return invalid_argument("select_top_tokens: more than 65535 KV heads");

  SelectTopPlan plan;
  plan.budget = std::max<int64_t>(o.budget, 1);
  plan.count = static_cast<int32_t>(std::min(length, plan.budget));
  plan.host_only = length <= plan.budget || n_kv_heads == 0;
  if (plan.host_only) return plan;

  // As select_from_group_scores: sinks and window shrink to fit the budget (sinks first); the
  // middle [sinks, length - window) fills the rest. length > budget >= sinks + window here.
  kernels::SelectTopLaunch& a = plan.launch;
  a.n_segments = n_kv_heads;
  a.length = length;
  a.budget = plan.budget;
  a.sinks = std::min(o.sinks, plan.budget);
  const int64_t window = std::min(o.window, plan.budget - a.sinks);
  a.lo = a.sinks;
  a.window_begin = length - window;
  a.m = a.window_begin - a.lo;
  a.take = plan.budget - a.sinks - window;  // < m because length > budget

  const int64_t target = std::max<int64_t>(sm_count, 1) * kTargetBlocksPerSm;
  const int64_t by_device = ceil_div(target, n_kv_heads);
  const int64_t by_size = ceil_div(std::max<int64_t>(a.m, 1), kSelectMinPerBlock);
  a.blocks_per_segment = std::clamp<int64_t>(std::min(by_device, by_size), 1, kSelectMaxBlocksPerSegment);
  a.warp_span =
      round_up(std::max<int64_t>(ceil_div(a.m, a.blocks_per_segment * kernels::kSelectWarps), 1), 128);
  if (a.take > 0) {
    plan.initial_state.assign(static_cast<size_t>(n_kv_heads), kernels::SelectState{0, 0, a.take, 0, 0});
  }
  return plan;
}

void prepare_selection(const SelectTopPlan& plan, int64_t n_kv_heads, int64_t length, Selection& out) {
  out.kv_heads = n_kv_heads;
  out.budget = plan.budget;
  out.indices.resize(static_cast<size_t>(std::max<int64_t>(n_kv_heads, 0) * plan.budget));
  out.counts.assign(static_cast<size_t>(std::max<int64_t>(n_kv_heads, 0)), plan.count);
  if (!plan.host_only) return;
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    int32_t* dst = out.indices.data() + h * plan.budget;
    std::iota(dst, dst + std::min(length, plan.budget), 0);
  }
}

}  // namespace specontext::gpu
