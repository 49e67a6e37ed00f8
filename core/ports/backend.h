// The compute interface a forward pass needs. cpu::CpuBackend is the reference and default;
// gpu::CudaBackend mirrors it. All pointers are in the backend's own memory space (host memory
// for the CPU backend, device memory for CUDA). Shapes are validated by the caller (the engine);
// a backend returns a non-OK Status only for conditions it cannot handle (unsupported dtype,
// device failure).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "core/base/ids.h"
#include "core/base/memory.h"
#include "core/base/status.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/ports/sampler.h"
#include "core/ports/selection.h"

namespace specontext {

enum class BackendOp {
  kEmbed, kMatmul, kRmsNorm, kRope, kSwiglu, kAdd, kKvAppend, kAttention,
  kKvGather, kAttentionSparse, kRetrievalScores, kAttentionIndexed,
};

// RoPE frequencies after scaling (llama3 / yarn / linear), computed once per model.
struct RopeParams {
  int64_t head_dim = 0;
  RopeStyle style = RopeStyle::kHalf;
  std::vector<float> inv_freq;  // [head_dim / 2], scaling already applied
  float mscale = 1.0f;          // YaRN attention factor multiplying cos and sin
};
RopeParams make_rope_params(const ModelConfig& config);

// Paged KV cache of one layer of one sequence. Page p of K (and of V) holds
// [kv_heads][page_size][head_dim] elements of `dtype` (f32, f16 or bf16: is_kv_dtype), so one KV
// head's tokens are contiguous inside a page. Token t lives in page t / page_size, slot
// t % page_size. kv_append rounds to the dtype (nearest even); attention widens to f32.
struct KvLayerView {
  void* const* k_pages = nullptr;
  void* const* v_pages = nullptr;
  int64_t n_pages = 0;
  int64_t page_size = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  DType dtype = DType::kF32;
  int64_t capacity() const { return n_pages * page_size; }
};

// Row `token` of KV head `head` of a paged view in HOST memory, K (values = false) or V, as f32:
// f32 pages are read in place, f16 / bf16 rows are widened into buf [head_dim].
const float* kv_row_f32(const KvLayerView& kv, bool values, int64_t head, int64_t token, float* buf);

// One sequence's slice of a batched forward.
struct AttentionItem {
  int64_t token_offset = 0;  // first row of this sequence in q / out
  int64_t n_tokens = 0;      // new tokens of this sequence in this forward
  int64_t start_pos = 0;     // position of the first new token (tokens cached before)
  KvLayerView kv;            // already holds the new tokens (kv_append runs first)
};

// A compact per-sequence, per-layer working set: for each KV head, `slots` rows of head_dim
// elements of `dtype` (the KV cache's: kv_gather copies elements unchanged) for K and for V
// ([kv_heads][slots][head_dim]); the first counts[h] slots of head h are valid. Slot order is
// arbitrary (softmax does not care), so elastic loading can refill slots in place.
struct WorkingSetView {
  void* k = nullptr;
  void* v = nullptr;
  int64_t kv_heads = 0;
  int64_t slots = 0;
  int64_t head_dim = 0;
  const int32_t* counts = nullptr;  // [kv_heads]
  DType dtype = DType::kF32;
};

// One copy of a cached token of one KV head into a working-set slot.
struct GatherEntry {
  int32_t kv_head = 0;
  int32_t token = 0;  // position in the paged cache
  int32_t slot = 0;   // destination slot of that head
};

// One sequence's decode tokens attending over its working set.
struct SparseAttentionItem {
  int64_t token_offset = 0;  // first row of this sequence in q / out
  int64_t n_tokens = 0;      // rows (each attends to the whole working set)
  WorkingSetView ws;
};

// One sequence's decode rows attending, in place, to selected tokens of its paged cache (a layer
// whose KV lives in backend memory needs no working-set copy). `indices` and `counts` are HOST
// arrays (descriptions, as GatherEntry): KV head h attends to the cached positions
// indices[h·stride + j], j < counts[h] (any order; each < kv.capacity()).
struct IndexedAttentionItem {
  int64_t token_offset = 0;          // first row of this sequence in q / out
  int64_t n_tokens = 0;              // rows (each attends to every selected token)
  KvLayerView kv;                    // the paged cache, backend memory
  const int32_t* indices = nullptr;  // host [kv_heads][stride]
  const int32_t* counts = nullptr;   // host [kv_heads], each in [0, stride]
  int64_t stride = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual bool supports(BackendOp op, DType weight_dtype) const = 0;

  // Memory in the backend's space for KV pages and activations (NUMA-local host memory for the
  // CPU backend, device memory for CUDA). The default is 64-byte aligned host memory.
  virtual Result<std::shared_ptr<void>> allocate(size_t bytes);
  // Places a model's weights where this backend reads them best (the CPU backend binds them to
  // its NUMA node). Called once by the engine; the default leaves them where they are.
  virtual Status place_weights(const Model& model);

  // ---- memory between the host and the backend's space ----
  // What allocate() returns: kHost for the CPU backends, kDevice for CUDA.
  virtual MemoryKind memory_kind() const { return MemoryKind::kHost; }
  // Whether ops may take pointers into memory of `kind` directly (zero-copy): the CPU backends
  // read host and pinned host memory; CUDA reads device memory and mapped pinned host memory.
  virtual bool addressable(MemoryKind kind) const {
    return kind == MemoryKind::kHost || kind == MemoryKind::kPinnedHost;
  }
  // A copy of `bytes` of host weight data that this backend's ops can read. The CPU backends
  // return `host` itself; a device backend uploads it once and owns the copy for its lifetime.
  virtual Result<const void*> import_weights(const void* host, size_t bytes);
  // host → backend memory. May be asynchronous on device backends, but `host_src` may be reused
  // as soon as the call returns. Default: memcpy.
  virtual Status upload(void* dst, const void* host_src, size_t bytes);
  // backend memory → host. Returns once `host_dst` holds the bytes (ordered after every op
  // enqueued before it). Default: memcpy.
  virtual Status download(void* host_dst, const void* src, size_t bytes);
  // rows × row_bytes within backend memory, each side with its own stride in bytes.
  // Default: memcpy per row.
  virtual Status copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                           size_t row_bytes, int64_t rows);
  // Waits until every op enqueued so far has finished; device backends report execution errors
  // here. Default: OK (host backends are synchronous).
  virtual Status synchronize();

  // out[i, :] = table[ids[i], :] as f32.
  virtual Status embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) = 0;
  // y[m, w.rows] = x[m, w.cols] · wᵀ (+ bias[w.rows] when bias != nullptr).
  virtual Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                        float* y) = 0;
  // y[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · weight; y may alias x.
  virtual Status rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                         float* y) = 0;
  // In place on x[n_tokens, n_heads, head_dim]; token i has position positions[i].
  virtual Status rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
                      const RopeParams& params) = 0;
  // out[i] = silu(gate[i]) · up[i]; out may alias gate.
  virtual Status swiglu(const float* gate, const float* up, int64_t n, float* out) = 0;
  // x[i] += y[i]
  virtual Status add(float* x, const float* y, int64_t n) = 0;
  // Writes k, v [n_tokens, kv_heads·head_dim] at positions start_pos.. of the paged cache.
  virtual Status kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                           const KvLayerView& kv) = 0;
  // Causal dense attention for a batch of sequences. q and out are [T, n_heads·head_dim];
  // token i of an item attends to cached positions [0, start_pos + i]; GQA maps query head h
  // to KV head h / (n_heads / kv_heads). Scale 1/sqrt(head_dim).
  virtual Status attention(const float* q, const AttentionItem* items, int64_t n_items,
                           int64_t n_heads, float* out) = 0;

  // ---- sparse decode (SpeContext); optional: supports(kKvGather / kAttentionSparse) says ----
  // Copies K and V of the listed (head, token) pairs from the paged cache into working-set slots.
  virtual Status kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                           const WorkingSetView& ws);
  // Attention of each item's rows over its working set only (no causal mask: the working set
  // holds exactly the tokens to attend). GQA as in attention(). Scale 1/sqrt(head_dim).
  virtual Status attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items,
                                  int64_t n_heads, float* out);
  // Attention of each item's rows over the selected (head, token) pairs of its paged cache, read
  // in place (no mask: the indices name exactly the tokens to attend). GQA and scale as in
  // attention(); a head with counts[h] == 0 gets zeros. Optional: supports(kAttentionIndexed).
  virtual Status attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items,
                                   int64_t n_heads, float* out);

  // ---- retrieval head (SpeContext); optional: supports(kRetrievalScores) says ----
  // Scores of one decode query of the retrieval head against its K cache, reduced over each GQA
  // group: out[g][t] = max over the query heads h of group g of softmax_t(q_h · k_t / √head_dim).
  // q [n_heads · head_dim] and out [n_kv_heads][length] in backend memory. The K cache is paged
  // like the KV cache: k_blocks is a HOST array of backend pointers, block b holding tokens
  // [b·block_tokens, (b+1)·block_tokens) token-major ([block_tokens][n_kv_heads · head_dim]),
  // elements of k_dtype (the KV dtype: f32, f16 or bf16), widened to f32 as they are loaded for
  // the dot products (no f32 copy of the cache). Default: host loops.
  virtual Status retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                        int64_t block_tokens, int64_t length, int64_t n_heads,
                                        int64_t n_kv_heads, int64_t head_dim, float* out);
  // Per KV head: sinks ∪ window ∪ the best of the rest by group score (ties prefer the older
  // token), ascending, as select_from_group_scores (core/ports/selection.h) defines. group_scores in
  // backend memory; `out` is host memory. Default: download + select_from_group_scores.
  virtual Status select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                                   const SelectionOptions& options, Selection& out);

  // ---- sampling ----
  // One token per row of logits [rows][vocab] (backend memory, modified in place): row r is
  // decided by draws[r] exactly as sample_with_coin (core/ports/sampler.h) defines; tokens is host
  // memory [rows]. Default: download (when not host memory) + sample_with_coin per row.
  virtual Status sample_rows(float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                             TokenId* tokens);
};

}  // namespace specontext
