// The CUDA implementation of core/ports/backend.h. Every pointer an op takes is DEVICE memory of this
// backend's device (activations, token ids, positions, norm weights, biases, WeightMatrix::data,
// KV pages, working-set K/V), except the small host-side descriptions: RopeParams, the
// AttentionItem / SparseAttentionItem arrays, the KvLayerView page tables (host arrays holding
// device page pointers), GatherEntry arrays and WorkingSetView::counts.
//
// Ops are asynchronous: they enqueue on the backend's compute stream and return. A returned
// Status reports argument and launch errors; faults during execution surface at the next
// synchronize() (or any later call that synchronises). Callers that touch the same memory from
// other streams must order themselves against stream() (events), or call synchronize().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/base/status.h"
#include "core/ports/backend.h"
#include "gpu/cuda_raii.h"
#include "gpu/retrieval_plan.h"
#include "gpu/staging_ring.h"

namespace specontext::gpu {

// Number of CUDA devices; kUnavailable "no CUDA device ..." when there is none or no usable
// driver (cudart loads libcuda lazily, so this is also what a GPU-less machine answers).
Result<int> cuda_device_count();
bool cuda_device_available();

// The backend on `device_ordinal`, or kUnavailable ("no CUDA device") without a device.
Result<std::unique_ptr<Backend>> create_cuda_backend(int device_ordinal = 0);

// 64-bit hash of `bytes` bytes (import_weights tells a reused host address by it). Pure C++.
uint64_t content_hash(const void* data, size_t bytes);

class CudaBackend final : public Backend {
 public:
  static Result<std::unique_ptr<CudaBackend>> create(int device_ordinal = 0);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  bool supports(BackendOp op, DType weight_dtype) const override;
  // Device memory (cudaMalloc) of this backend's device; freed with cudaFree by the deleter.
  Result<std::shared_ptr<void>> allocate(size_t bytes) override;

  // ---- memory between the host and the device ----
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  // Kernels take device pointers, and pointers into page-locked host memory only where the device
  // reads registered memory at its host address (cudaDevAttrCanUseHostPointerForRegisteredMem;
  // cudaHostAlloc'ed memory always is, but the engine's pools are cudaHostRegister'ed). Elsewhere
  // kPinnedHost is not addressable and the engine stages those tiers through the transport,
  // which uses the mapped device pointer.
  bool addressable(MemoryKind kind) const override {
    return kind == MemoryKind::kDevice || (kind == MemoryKind::kPinnedHost && registered_host_pointers_);
  }
  // Uploads `bytes` of host weights once into a device buffer the backend owns until it is
  // destroyed; the same `host` pointer with the same size and bytes again returns the same copy.
  // Keyed by the pointer and checked by size and content_hash (one read of the host bytes per
  // call): a pointer whose size or bytes changed (memory freed and reused at the same address)
  // gets a fresh copy, and the stale one is freed once the stream has drained, so a caller that
  // changes the bytes behind a pointer must stop using the copy of the old bytes. The copy is
  // stream-ordered before every later op.
  Result<const void*> import_weights(const void* host, size_t bytes) override;
  // host → device on the compute stream through a pinned staging ring (gpu/staging_ring.h):
  // `host_src` (pageable or pinned) is reusable on return; the copy itself is asynchronous.
  Status upload(void* dst, const void* host_src, size_t bytes) override;
  // device → host after everything queued so far; returns when host_dst holds the bytes (waits
  // for the stream, so execution errors of earlier ops surface here).
  Status download(void* host_dst, const void* src, size_t bytes) override;
  // cudaMemcpy2DAsync on the compute stream, direction cudaMemcpyDefault (either side may be
  // device memory or page-locked host memory, e.g. the head's keys moving to a pinned pool). With
  // rows > 1 each stride must be >= row_bytes (kInvalidArgument otherwise: overlapping rows of one
  // copy have no defined order).
  Status copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride, size_t row_bytes,
                   int64_t rows) override;
  // Waits for everything enqueued so far; reports execution errors.
  Status synchronize() override;

  // Ids outside the table produce NaN rows (they cannot be checked without a synchronisation).
  Status embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) override;
  // Block-type tables (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) are decoded row by row as ggml_dequantize
  // decodes them (bit for bit).
  // matmul by the weights' stored type:
  // - f32: cuBLAS, full f32 GEMM (no TF32).
  // - bf16: activations rounded to bf16, f32 accumulation: m <= 16 launch_bf16_gemv (a warp per
  //   weight row), more rows cuBLAS GemmEx (bf16 x bf16, f32 output).
  // - Q8_0, Q4_0, Q4_K, Q5_K, Q6_K as stored (gpu/kernels_quant.cu): m <= 16 activations quantised
  //   per block as ggml's dot products do (Q8_0 blocks for Q8_0 / Q4_0, Q8_K for the K types) and
  //   launch_quant_gemv reading the weight blocks; more rows: tiles of weight rows decoded to f32,
  //   then a true-f32 cuBLAS GEMM each (the CPU backend's split, cpu/README.md). The weights must be
  //   4-byte aligned (import_weights' copies are).
  Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                float* y) override;
  Status rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                 float* y) override;
  // params.inv_freq is uploaded once and cached (compared by content, 1 KiB at most).
  Status rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
              const RopeParams& params) override;
  Status swiglu(const float* gate, const float* up, int64_t n, float* out) override;
  Status add(float* x, const float* y, int64_t n) override;
  Status kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                   const KvLayerView& kv) override;
  // Split-K (flash-decoding) causal attention; head_dim up to 256. out must not alias q (blocks
  // of other heads may still be reading q while one writes its output).
  Status attention(const float* q, const AttentionItem* items, int64_t n_items, int64_t n_heads,
                   float* out) override;
  // `entries` is a HOST array (validated, then uploaded with the touched pages' pointers); the
  // working set's k / v are device memory. One warp per entry.
  Status kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                   const WorkingSetView& ws) override;
  // Split-K attention over each item's working set (k / v device memory, counts a HOST array);
  // head_dim up to 256, one kv_heads / head_dim for the whole batch; out must not alias q. A head
  // with counts == 0 gets zeros.
  Status attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items,
                          int64_t n_heads, float* out) override;
  // attention_sparse's kernel pair over the selected positions of the paged cache, in place
  // (gpu/sparse_plan.h plan_attention_indexed): indices, counts and page tables copied per call.
  Status attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items, int64_t n_heads,
                           float* out) override;

  // ---- retrieval head ----
  // Softmax per query head over the K cache, max over each GQA group (gpu/kernels_retrieval.cu).
  // head_dim <= 256 (kUnimplemented beyond); q, the K blocks and out device memory. Asynchronous. Scratch:
  // n_heads · length floats of logits (grow-only) plus small per-block partials.
  // The paged K cache's block table (a host array of device pointers) travels with the call.
  Status retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype, int64_t block_tokens,
                                int64_t length, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                float* out) override;
  // The exact set of select_from_group_scores (core/ports/selection.h) from device scores, by a radix
  // select on (score, token) keys; `out` is filled on return (synchronises the stream). A context
  // that fits the budget is answered on the host without touching the device. Negative sinks or
  // window are kInvalidArgument (the host version does not check them).
  Status select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                           const SelectionOptions& options, Selection& out) override;

  // ---- sampling ----
  // sample_with_coin (core/ports/sampler.h) per row on the device: penalty, greedy argmax, softmax,
  // top-k and llama2.c's top-p by segmented radix sorts (gpu/kernels_sampling.cu). logits
  // (device memory) are overwritten; draws and tokens are host memory; synchronises (tokens are
  // on the host on return). Greedy tokens are exact; sampled tokens equal the host's except where
  // float summation order moves a CDF boundary across the coin. Beyond the host default's
  // contract: invalid SamplingParams, a coin outside [0, 1) in a sampling row and penalized ids
  // listed twice are kInvalidArgument (gpu/sampling_plan.h). A top-p row in which no token
  // passes the cutoff gets the most probable token, as on the host.
  Status sample_rows(float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                     TokenId* tokens) override;

  cudaStream_t stream() const { return stream_.get(); }
  // Bytes held by import_weights' device copies (block-type matrices keep their stored bytes).
  size_t imported_weight_bytes() const;
  int device_ordinal() const { return device_; }
  int sm_count() const { return sm_count_; }
  SharedMemoryLimits shared_memory_limits() const { return smem_limits_; }

 private:
  struct DeviceTraits {
    int sm_count = 1;
    SharedMemoryLimits smem;
    bool registered_host_pointers = false;
  };
  CudaBackend(int device, DeviceTraits traits, CudaStream stream, CublasHandle cublas);

  // Grows a scratch buffer (never shrinks). Waits for the stream first: queued work may still
  // read the old buffer, and growth is rare (amortised by 1.5x).
  template <typename T>
  Status reserve(DeviceBuffer<T>& buffer, size_t count);
  // Copies meta_host_ to meta_dev_ on the stream through the staging ring, so meta_host_ may be
  // reused at once; the device copy is stream-ordered.
  Status upload_metadata();
  // The block-type branches of embed and matmul (bias added by the caller).
  Status embed_blocks(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out);
  Status matmul_blocks(const float* x, int64_t m, const WeightMatrix& w, float* y);

  int device_ = 0;
  int sm_count_ = 1;
  SharedMemoryLimits smem_limits_;
  bool registered_host_pointers_ = false;  // cudaDevAttrCanUseHostPointerForRegisteredMem
  CudaStream stream_;
  CublasHandle cublas_;

  DeviceBuffer<uint16_t> act_bf16_;   // bf16 activations for bf16 GEMMs
  DeviceBuffer<uint8_t> quant_act_;   // quantised activations (codes, then scales) of block GEMVs
  DeviceBuffer<float> dequant_tile_;  // decoded weight rows of block-type matmuls with m > 16
  DeviceBuffer<uint8_t> meta_dev_;    // page tables and attention item metadata
  std::vector<uint8_t> meta_host_;
  DeviceBuffer<float> partial_o_;     // split-K partial outputs
  DeviceBuffer<float> partial_ml_;    // split-K partial max and sum
  DeviceBuffer<float> rope_inv_freq_;
  std::vector<float> rope_inv_freq_host_;  // what rope_inv_freq_ holds

  // Declared after the scratch it may still copy into: destroyed first, it waits for its copies.
  StagingRing staging_;
  struct ImportedWeights {
    DeviceBuffer<uint8_t> buffer;
    size_t bytes = 0;
    uint64_t hash = 0;  // content_hash of the host bytes uploaded
  };
  std::unordered_map<const void*, ImportedWeights> imported_;

  DeviceBuffer<float> retrieval_logits_;    // [n_heads][length] log2-unit logits
  DeviceBuffer<float> retrieval_partials_;  // block (max, sum) partials, then (max, 1/sum) per head
  DeviceBuffer<uint8_t> select_scratch_;    // histograms, radix states, warp counts
  DeviceBuffer<int32_t> select_out_;        // [n_kv_heads][budget]
  DeviceBuffer<int32_t> sample_tokens_;   // [rows]
  DeviceBuffer<int32_t> sample_ends_;     // end offsets of both sorts
  DeviceBuffer<uint64_t> sample_keys_;    // two key buffers of plan.key_words()
  DeviceBuffer<uint8_t> sample_temp_;     // CUB temporary storage
};

}  // namespace specontext::gpu
