// The SpeContext retrieval head: an EAGLE-3 draft pruned to what attention weights need —
// fused-feature fc, the two RMSNorms and the Q/K projections (the embedding is the target's).
//
// Input of token t at position p (EAGLE-3 convention):
//   x = concat( RMSNorm_input(embed(token_t)), RMSNorm_hidden(fc(fused(p−1))) )       [2d]
//   fused(p−1) = concat of the target's residual stream entering layers 2, L/2, L−3 at
//   position p−1 (zeros for p = 0)                                                    [3d]
//   q = RoPE(wq · x, p)  [n_heads·head_dim],  k = RoPE(wk · x, p)  [n_kv_heads·head_dim]
// The head keeps its own one-layer K cache of every token; scores of the newest token are
// softmax(q·Kᵀ/√head_dim) per query head.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "core/base/status.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/ports/backend.h"
#include "core/ports/selection.h"

namespace specontext {

struct RetrievalHeadConfig {
  int64_t hidden = 0;      // the target's hidden size d
  int64_t n_heads = 0;     // query heads of the head
  int64_t n_kv_heads = 0;  // must equal the target's KV heads: selection is per target KV head
  int64_t head_dim = 0;
  double rope_theta = 10000.0;
  int64_t trained_context = 2048;  // EAGLE-3 drafts are trained to 2K; YaRN extends beyond
  RopeScaling rope_scaling;        // YaRN set up by make_head_rope_params for long targets
  float norm_eps = 1e-5f;
  std::array<int64_t, 3> fused_layers{};  // target layer indices (2, L/2, L−3)
  // How selection combines a group's query heads (metadata "select_group": "max" or "turns"):
  // kTurns for a head whose query heads each learned one target layer (models/longctx/distill.py
  // --head-teacher layers). EAGLE-3 drafts and heads without the field: kMax.
  GroupReduce select_group = GroupReduce::kMax;
};

struct RetrievalHead {
  RetrievalHeadConfig config;
  WeightMatrix fc;   // [d, 3d]
  Vec input_norm;    // [d]  (EAGLE-3 midlayer.input_layernorm)
  Vec hidden_norm;   // [d]  (EAGLE-3 midlayer.hidden_norm)
  WeightMatrix wq;   // [n_heads·head_dim, 2d]
  WeightMatrix wk;   // [n_kv_heads·head_dim, 2d]
  int64_t draft_parameters = 0;  // parameters of the checkpoint before pruning (embedding excluded)
  int64_t kept_parameters = 0;   // fc + norms + wq + wk
  std::string load_note;         // a warning of load_eagle3_head (e.g. no rope_theta: 10000 used)
  std::vector<std::shared_ptr<const void>> storage;
};

// EAGLE-3 fused-layer indices for a target of n_layers (clamped into range for tiny models).
std::array<int64_t, 3> eagle3_fused_layers(int64_t n_layers);

// RoPE of the head for a target context: YaRN (factor = context / trained_context) when the
// target runs beyond the head's trained window, plain RoPE otherwise.
RopeParams make_head_rope_params(const RetrievalHeadConfig& c, int64_t target_context);

// The head's input x [n, 2d] = RMSNorm_input(embed(token)) ⊕ RMSNorm_hidden(fc · fused_prev)
// (the part of retrieval_qk before the Q/K projections; distillation trains on it).
Status retrieval_inputs(Backend& backend, const RetrievalHead& head,
                        const WeightMatrix& target_embeddings, const TokenId* tokens,
                        const float* fused_prev, int64_t n, float* x);

// q [n, n_heads·head_dim] and k [n, n_kv_heads·head_dim] of n tokens (see the top comment).
// fused_prev [n, 3d] holds fused(p−1) of each row (the caller passes zeros for position 0);
// target_embeddings is the target's token embedding table. Host memory (CPU backend) only:
// scratch is allocated with std::vector.
Status retrieval_qk(Backend& backend, const RetrievalHead& head, const RopeParams& rope,
                    const WeightMatrix& target_embeddings, const TokenId* tokens,
                    const float* fused_prev, const int64_t* positions, int64_t n, float* q,
                    float* k);

// Scores of one query q [n_heads·head_dim] against the head's K cache k_cache
// [length, n_kv_heads·head_dim] (token-major): softmax(q_h·kᵀ/√head_dim) per query head,
// written to scores [n_heads, length] — the layout select_tokens expects.
void retrieval_scores(const RetrievalHead& head, const float* q, const float* k_cache,
                      int64_t length, float* scores);

// The shared selection of a head whose group combines by GroupReduce::kTurns: each query head's
// softmax scores (Backend::retrieval_group_scores, one query head of every group at a time, so
// any backend serves it), downloaded, reduced by reduce_group_scores and selected on the host.
// hq [n_heads·head_dim] and k_blocks / k_dtype as retrieval_group_scores takes them; scratch is backend
// memory of select_by_turns_scratch_floats (the caller's workspace: nothing is allocated per step).
Status select_by_turns(Backend& backend, const RetrievalHeadConfig& c, const float* hq,
                       const void* const* k_blocks, DType k_dtype, int64_t block_tokens, int64_t length,
                       const SelectionOptions& options, float* scratch, Selection& out);
int64_t select_by_turns_scratch_floats(const RetrievalHeadConfig& c, int64_t length);

// Loads an EAGLE-3 draft checkpoint and prunes it to the retrieval head. `path` is a weights file
// (safetensors, or PyTorch's zip checkpoint `pytorch_model.bin` as official drafts ship: see
// core/model/torch_zip.h; told apart by content) or a directory holding model.safetensors or else
// pytorch_model.bin, and an optional config.json.
// target supplies d, the KV-head count (must match) and the fused-layer indices.
Result<std::shared_ptr<RetrievalHead>> load_eagle3_head(const std::string& path,
                                                        const ModelConfig& target);

// Writes a head in the layout load_eagle3_head reads (kept tensors only, f32) with the head
// config in "__metadata__".
Status write_retrieval_head(const std::string& path, const RetrievalHead& head);

// A random EAGLE-3-shaped head for a target (for --synthetic runs): fc = [I/3 I/3 I/3] + noise,
// norms 1, wq/wk ~ N(0, 1/(2d)). draft_parameters counts a full EAGLE-3 draft of that shape.
Result<std::shared_ptr<RetrievalHead>> make_random_head(const ModelConfig& target, uint64_t seed);

// "retrieval head keeps 1.2M of 12.3M draft parameters (90.2% pruned)"
std::string pruning_report(const RetrievalHead& head);

}  // namespace specontext
