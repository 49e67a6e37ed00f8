// The oracle: every op as the plainest scalar loops, single threaded, no caching, no tricks.
// Tests compare every other backend against it; SPECONTEXT_CPU_REFERENCE=1 makes the engine
// run on it. Dot products and the attention sums accumulate in double so that the oracle is
// more accurate than what it checks; RMSNorm sums squares in float like llama2.c.
#pragma once

#include "core/ports/backend.h"

namespace specontext::cpu {

class ReferenceBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu-reference"; }
  bool supports(BackendOp op, DType weight_dtype) const override;

  Status embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) override;
  Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y) override;
  Status rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                 float* y) override;
  Status rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
              const RopeParams& params) override;
  Status swiglu(const float* gate, const float* up, int64_t n, float* out) override;
  Status add(float* x, const float* y, int64_t n) override;
  Status kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                   const KvLayerView& kv) override;
  Status attention(const float* q, const AttentionItem* items, int64_t n_items, int64_t n_heads,
                   float* out) override;
  Status kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                   const WorkingSetView& ws) override;
  // A head whose working set is empty (counts[h] == 0) gets a zero output row.
  Status attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items, int64_t n_heads,
                          float* out) override;
  // Over the selected positions of the paged cache, read in place; softmax in double. A head with
  // counts[h] == 0 gets a zero output row.
  Status attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items, int64_t n_heads,
                           float* out) override;
};

// Checks shared by both CPU backends (cheap, O(items)); the engine validates shapes too, these
// catch what would otherwise be an out-of-bounds access.
Status check_matmul_dtype(DType t);
// The table's dtype is f32, bf16 or f16, and check_embed_ids.
Status check_embed_args(const TokenId* ids, int64_t n, const WeightMatrix& table);
// Non-null ids and table when n > 0, every id inside [0, table.rows).
Status check_embed_ids(const TokenId* ids, int64_t n, const WeightMatrix& table);
Status check_rope_params(const RopeParams& params);
Status check_kv_append_args(int64_t n_tokens, int64_t start_pos, const KvLayerView& kv);
Status check_attention_args(const AttentionItem* items, int64_t n_items, int64_t n_heads);
// kv_gather: the working set matches the cache's kv_heads / head_dim, every entry names an
// existing head, a token inside the capacity and a slot inside the working set, and no two
// entries write the same (head, slot) (parallel copies would race; the result would depend on
// the backend). All failures are kInvalidArgument.
Status check_kv_gather_args(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                            const WorkingSetView& ws);
// attention_sparse: per item a valid working set (0 <= counts[h] <= slots), n_heads a multiple
// of its kv_heads, one head_dim for all items. All failures are kInvalidArgument.
Status check_attention_sparse_args(const SparseAttentionItem* items, int64_t n_items, int64_t n_heads);

// Reads element i of a weight row of dtype f32/bf16/f16 as f32.
float weight_element(const WeightMatrix& w, int64_t row, int64_t col);

}  // namespace specontext::cpu
