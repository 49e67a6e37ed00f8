// The optimised CPU backend (the default) and the one switch that picks it or the reference.
// Every op runs on oneTBB inside a task_arena owned by the backend and pinned (on multi-node
// machines) to one NUMA node; matmul runs single-threaded oneDNN primitives as its tasks, one
// output slice each. See cpu/README.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/base/status.h"
#include "core/ports/backend.h"

namespace specontext::cpu {

struct CpuBackendOptions {
  bool reference = false;  // the naive oracle instead (also SPECONTEXT_CPU_REFERENCE=1)
  int num_threads = 0;     // 0 = all cores of the NUMA node
  int numa_node = -1;      // -1 = the node the calling thread runs on (node 0 if unknown)
  // Tuning knob, mostly for tests: keys per split-K attention chunk. 0 = automatic (split long
  // contexts only when (sequence, token tile, kv head) tasks are too few to fill the threads).
  int64_t attention_chunk = 0;
  // Tests and debugging: skip oneDNN and use the TBB fallback matmul loops.
  bool force_matmul_fallback = false;
};

// The default backend, or ReferenceBackend when options.reference or SPECONTEXT_CPU_REFERENCE=1.
Result<std::unique_ptr<Backend>> create_cpu_backend(const CpuBackendOptions& options = {});

class CpuBackend final : public Backend {
 public:
  static Result<std::unique_ptr<CpuBackend>> create(const CpuBackendOptions& options = {});
  ~CpuBackend() override;
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string_view name() const override { return "cpu"; }
  bool supports(BackendOp op, DType weight_dtype) const override;
  // KV pages and working sets: NumaBuffers on this backend's node (cpu/cpu_placement.cc).
  Result<std::shared_ptr<void>> allocate(size_t bytes) override;
  // Binds (and migrates) the weights' pages to this backend's node where hwloc can.
  Status place_weights(const Model& model) override;
  // Weight bytes place_weights bound to the node (0 where binding is unsupported).
  int64_t weight_bytes_bound() const { return weight_bytes_bound_; }

  // Block-type tables (is_block_dtype) have the rows asked for dequantised.
  Status embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) override;
  // Thread-safe, but concurrent matmuls serialise (one primitive cache, per-slot streams).
  // Block-type weights: quant_gemv (cpu/quant_gemv.h) for up to 16 input rows, else tiles of
  // weight rows dequantised to f32 and multiplied on the f32 path.
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
  // Entries are copied in parallel; destinations must be distinct (checked).
  Status kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                   const WorkingSetView& ws) override;
  // Same task split as attention() over the working set, without the causal mask. A head with
  // counts[h] == 0 gets a zero output row.
  Status attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items, int64_t n_heads,
                          float* out) override;
  // Same task split and key blocks as attention_sparse over the selected positions of the paged
  // cache: a block of consecutive positions within one page is read in place, any other copied
  // (as stored) into a per-thread block first; f32 / f16 / bf16 as attention(). Over indices in a
  // working set's slot order the result equals attention_sparse's bit for bit. counts[h] == 0
  // gives zeros.
  Status attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items, int64_t n_heads,
                           float* out) override;

  // The host default's arithmetic (core/base/host_math.h), bit for bit: the dot products spread
  // over the arena by token range, then each head's softmax whole on one thread (its normaliser
  // summed in token order), the heads spread over the arena.
  Status retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype, int64_t block_tokens,
                                int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                float* out) override;
  // select_from_group_scores (core/ports/selection.h) of each KV head, the heads spread over the
  // arena, reading the scores in place (the host default copies them first): the same selection.
  Status select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                           const SelectionOptions& options, Selection& out) override;
  int num_threads() const;
  int numa_node() const;
  // Which path the last matmul of this dtype took: "onednn:<impl>", "rows:small-batch" or
  // "fallback"; for any block type (one record for all of them) "quant_gemv:<path>" or
  // "dequantised-tiles+<f32 path>" (diagnostics).
  std::string matmul_path(DType dtype) const;

 private:
  struct Impl;
  Status embed_blocks(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out);
  explicit CpuBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int64_t weight_bytes_bound_ = 0;
};

}  // namespace specontext::cpu
