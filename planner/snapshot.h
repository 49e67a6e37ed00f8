// The planner's input: everything it may look at, as plain values. The engine (or the CLI) fills a
// snapshot; the planner never measures or allocates anything itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/base/status.h"
#include "core/model/model_config.h"

namespace specontext::planner {

// Shape of the target model as the memory model sees it (paper Table 3).
struct ModelShape {
  int64_t layers = 0;         // L
  int64_t kv_heads = 0;       // H
  int64_t head_dim = 0;       // D
  int64_t q_heads = 0;        // α = q_heads / kv_heads
  int64_t head_kv_heads = 0;  // the retrieval head's K heads (EAGLE-3: = kv_heads); 0 means kv_heads

  int64_t alpha() const { return kv_heads > 0 ? q_heads / kv_heads : 0; }
  int64_t retrieval_kv_heads() const { return head_kv_heads > 0 ? head_kv_heads : kv_heads; }
  bool operator==(const ModelShape&) const = default;
};

// One host memory pool (a NUMA node). Bandwidths are measured elsewhere (a probe); 0 = unknown.
struct HostPool {
  int32_t numa_node = 0;
  int64_t capacity_bytes = 0;
  double device_bandwidth_bps = 0;  // host node ↔ device, bytes/s
  bool operator==(const HostPool&) const = default;
};

// One remote KV node.
struct RemotePool {
  int32_t rank = 0;
  int64_t capacity_bytes = 0;
  double bandwidth_bps = 0;  // remote ↔ this node, bytes/s
  bool operator==(const RemotePool&) const = default;
};

struct PlannerSnapshot {
  ModelShape model;
  int64_t kv_elem_bytes = 2;   // 2 for bf16/f16, 4 for f32; the paper's "4" is 2·elem_bytes
  int64_t model_bytes = 0;     // M_O
  int64_t head_bytes = 0;      // M_D (retrieval head parameters × dtype bytes)
  double runtime_factor = 1.3; // activations ≈ 30% of the weights (paper §6)
  int64_t budget = 2048;       // B, tokens per KV head kept per step
  int64_t requests = 1;        // R, the batch the pools are sized for
  int64_t device_bytes = 0;    // Mem_GPU
  std::vector<HostPool> host;      // in NUMA order; the planner sorts by bandwidth itself
  std::vector<RemotePool> remote;  // optional
  double host_to_host_bandwidth_bps = 0;  // across NUMA nodes; used for migration estimates
  std::vector<int64_t> seq_lens;   // current lengths of the live sequences, at most `requests`
  // With CPU candidate filtering the device keeps a shortlist of this many tokens per request for
  // the retrieval head instead of its full K cache. 0 means 4·budget (our choice, not the paper's).
  int64_t filter_shortlist_tokens = 0;
  // Device bytes per token of context that the retrieval side needs (the head's K cache and
  // whatever buffers its scoring keeps). 0 = the paper's (1 + α)·kvc·H·D: a K cache plus the
  // repeat_kv expansion of a PyTorch implementation. Our engine keeps K only, in the KV dtype, no
  // expansion, and passes H_head·D·kvc (KvMemory::head_block_bytes / head_block_tokens).
  int64_t retrieval_bytes_per_token = 0;
  // Allocation granularity of the off-device pools (the engine's; 0 in the paper's model). An
  // offloaded layer's KV takes up to layer_slack_bytes more than Σ S_r·H·D·kvc in its pool (its
  // last, partly filled chunk), and the head's K cache up to head_cache_slack_bytes more than its
  // Σ S_r tokens (a partly filled key block per sequence). Each item is placed with its own slack,
  // so a pool is charged only for what it is given.
  int64_t layer_slack_bytes = 0;
  int64_t head_cache_slack_bytes = 0;

  int64_t shortlist_tokens() const { return filter_shortlist_tokens > 0 ? filter_shortlist_tokens : 4 * budget; }
  int64_t retrieval_token_bytes() const {
    return retrieval_bytes_per_token > 0 ? retrieval_bytes_per_token
                                         : (1 + model.alpha()) * 2 * kv_elem_bytes * model.kv_heads * model.head_dim;
  }
  bool operator==(const PlannerSnapshot&) const = default;
};

// Parameter count of a decoder-only model from its config alone (no weights built): embeddings,
// untied lm_head, final norm, and per layer q/k/v/o (+bias, +q/k norm), gate/up/down, two norms.
// Matches Model::parameter_count() for the same config.
int64_t model_parameter_count(const ModelConfig& c);

// Parameters of an EAGLE-3-shaped retrieval head of hidden size d = c.dim: q_proj (2d → q_heads·D),
// k_proj (2d → H·D), fc (3d → d) fusing the three target hidden states, and two RMSNorms of d.
// The paper's §4 pruning keeps only these of the draft model (embedding is shared with the target).
int64_t retrieval_head_parameter_count(const ModelConfig& c);

// Model shape of a config (fails on n_heads not a multiple of n_kv_heads).
Result<ModelShape> shape_from_config(const ModelConfig& c);

// Checks ranges and consistency; the message names the field.
Status validate_snapshot(const PlannerSnapshot& s);

// Σ seq_lens, and the effective per-request length S = ceil(Σ / R) the thresholds are compared with.
int64_t total_tokens(const PlannerSnapshot& s);
int64_t effective_seq_len(const PlannerSnapshot& s);

}  // namespace specontext::planner
