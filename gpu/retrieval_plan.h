// Host-side planning of the retrieval-head ops of CudaBackend: retrieval_group_scores (argument
// checks, the work split of the score kernel and its shared-memory layout, scratch sizes) and
// select_top_tokens (the sinks / window / middle arithmetic of core/ports/selection.cc, the radix-select
// grid and the initial per-head state). Pure C++ with no CUDA calls, so it is unit-tested without
// a GPU (tests/gpu/retrieval_plan_test.cc runs host mirrors of the kernels from these plans).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/status.h"
#include "core/ports/selection.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

struct RetrievalScoresPlan {
  // Shapes, split and layout filled in; q, k_blocks, out and the scratch pointers are copied from
  // the arguments (q, k_blocks, out) or left null (scratch) for the caller. length == 0: nothing.
  kernels::RetrievalScoresLaunch launch;
  size_t logits_floats = 0;   // [n_heads][length]
  size_t partial_floats = 0;  // partial_m then partial_l: 2 · n_heads · blocks_per_head
  size_t stats_floats = 0;    // 2 · n_heads
  int64_t n_blocks = 0;       // entries of the K block table the length uses
};

// A device's shared memory per block, static and dynamic together: what every launch gets
// (cudaDevAttrMaxSharedMemoryPerBlock, 48 KiB on every supported device) and the most a kernel
// may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin: 163 KiB on sm_80, 227 KiB on sm_90).
// The defaults are sm_80's; CudaBackend passes its device's.
struct SharedMemoryLimits {
  size_t per_block = 48 * 1024;
  size_t per_block_optin = 163 * 1024;
};

// Checks (kInvalidArgument: non-positive or non-dividing heads, head_dim <= 0, null pointers,
// length beyond int32 tokens; kUnimplemented: head_dim > 256, or a GQA group whose queries do not
// fit the shared memory) and plans for `sm_count` multiprocessors. length <= 0: an empty plan.
// Shared memory: launch.smem_bytes (dynamic) plus kRetrievalStaticSmemBytes must fit
// limits.per_block_optin (else kUnimplemented), and launch.smem_opt_in is set when they exceed
// limits.per_block.
// k_blocks is the HOST table of the paged K cache (Backend::retrieval_group_scores), elements of
// k_dtype (f32, f16 or bf16; another dtype: kInvalidArgument); the plan points launch.k_blocks at
// it and CudaBackend replaces that with the uploaded copy.
Result<RetrievalScoresPlan> plan_retrieval_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                                  int64_t block_tokens, int64_t length, int64_t n_heads,
                                                  int64_t n_kv_heads, int64_t head_dim, float* out,
                                                  int sm_count, SharedMemoryLimits limits = {});

struct SelectTopPlan {
  int64_t budget = 1;  // max(options.budget, 1), as the host
  int32_t count = 0;   // tokens per head: min(length, budget)
  // length <= budget (or no heads): every head keeps 0 .. length - 1; filled on the host, no
  // device work at all.
  bool host_only = true;
  // Otherwise: the launch with shapes and the radix grid (device pointers null), and the state
  // each head's radix select starts from (only when launch.take > 0).
  kernels::SelectTopLaunch launch;
  std::vector<kernels::SelectState> initial_state;
  size_t hist_words() const;        // uint32 [n_segments][kSelectMaxBins]
  size_t warp_count_words() const;  // int32 [n_segments][blocks_per_segment · kSelectWarps]
};

// Checks (kInvalidArgument naming the field: negative n_kv_heads, length, options.sinks or
// options.window; length beyond int32 tokens; more than 65535 KV heads) and plans. The result
// is the set select_from_group_scores computes.
Result<SelectTopPlan> plan_select_top_tokens(int64_t n_kv_heads, int64_t length,
                                             const SelectionOptions& options, int sm_count);

// Fills out's shape (kv_heads, budget, counts) for a plan, and the indices when host_only.
void prepare_selection(const SelectTopPlan& plan, int64_t n_kv_heads, int64_t length, Selection& out);

}  // namespace specontext::gpu
