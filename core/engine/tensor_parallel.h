// Tensor parallelism (Megatron style) across the ranks of one node: rank r of W runs the
// attention heads, KV heads and MLP columns of slice r on its own Engine, and the engine sums
// the attention-out and MLP-down partials over the ranks (EngineOptions::communicator).
// Embeddings, norms and the LM head are replicated; every rank computes identical logits.
//
// Slices (head h of the model belongs to rank h / (n_heads / W), KV head g to g / (n_kv_heads / W),
// MLP unit j to j / (hidden_dim / W); query head h uses KV head h / (n_heads / n_kv_heads), so the
// contiguous slices keep each rank's query heads with their KV heads):
//   wq, wk, wv, w_gate, w_up   row slices    (views into the parent's storage, no copy)
//   bq, bk, bv                 sliced        (small f32 vectors, copied)
//   wo [dim, q_dim], w_down [dim, hidden_dim]  column slices (copied into new storage)
//   q_norm/k_norm ([head_dim]), attn/ffn norms, embeddings, final norm, lm_head   shared
// The shard keeps its parent alive through Model::storage, so the parent may be dropped.
//
// Errors (kInvalidArgument, naming the field and the values): world < 1, rank outside
// [0, world), world not dividing n_heads, n_kv_heads or hidden_dim (the head's n_kv_heads for
// shard_retrieval_head), an invalid parent model. Weight dtypes: f32, f16, bf16; block-type
// matrices (LoadOptions::keep_quantized) are dequantised to the parent's weight_dtype first
// (a column slice would cut blocks), so every shard holds plain matrices. world == 1 returns an
// equivalent model whose matrices are all views of the parent's (or of its dequantised copy).
//
// Thread safety: pure functions of immutable inputs; shards of one model may be made and used
// from several threads at once.
#pragma once

#include <memory>

#include "core/base/status.h"
#include "core/model/model.h"
#include "core/sparse/retrieval_head.h"

namespace specontext {

// Rank `rank` of `world`'s slice of the model (see the top comment).
Result<std::shared_ptr<const Model>> shard_model(std::shared_ptr<const Model> model, int rank, int world);

// The retrieval head of rank `rank`: its query heads and KV heads for the rank's KV heads (the
// head's KV heads are the target's, so they split as the model's do); fc and the norms are
// replicated. Each rank's selection for its KV heads equals the full head's selection
// restricted to them: scores and top-k are per KV head.
Result<std::shared_ptr<const RetrievalHead>> shard_retrieval_head(std::shared_ptr<const RetrievalHead> head,
                                                                  int rank, int world);

}  // namespace specontext
