// The CUDA implementation of core/backend.h. Every pointer an op takes is DEVICE memory of this
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
#include <vector>

#include "core/backend.h"
#include "core/status.h"
#include "gpu/cuda_raii.h"

namespace specontext::gpu {

// Number of CUDA devices; kUnavailable "no CUDA device ..." when there is none or no usable
// driver (cudart loads libcuda lazily, so this is also what a GPU-less machine answers).
Result<int> cuda_device_count();
bool cuda_device_available();

// The backend on `device_ordinal`, or kUnavailable ("no CUDA device") without a device.
Result<std::unique_ptr<Backend>> create_cuda_backend(int device_ordinal = 0);

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

  // Ids outside the table produce NaN rows (they cannot be checked without a synchronisation).
  Status embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) override;
  // cuBLAS: f32 weights -> full f32 GEMM (no TF32); bf16 weights -> activations rounded to bf16
  // in a scratch buffer, bf16 x bf16 with f32 accumulation and f32 output.
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

  // Waits for everything enqueued so far; reports execution errors. Not in the core interface.
  Status synchronize();
  cudaStream_t stream() const { return stream_.get(); }
  int device_ordinal() const { return device_; }
  int sm_count() const { return sm_count_; }

 private:
  CudaBackend(int device, int sm_count, CudaStream stream, CublasHandle cublas);

  // Grows a scratch buffer (never shrinks). Waits for the stream first: queued work may still
  // read the old buffer, and growth is rare (amortised by 1.5x).
  template <typename T>
  Status reserve(DeviceBuffer<T>& buffer, size_t count);
  // Copies meta_host_ to meta_dev_ on the stream (pageable source: the runtime stages it before
  // returning, so meta_host_ may be reused at once; the device copy is stream-ordered).
  Status upload_metadata();

  int device_ = 0;
  int sm_count_ = 1;
  CudaStream stream_;
  CublasHandle cublas_;

  DeviceBuffer<uint16_t> act_bf16_;   // bf16 activations for bf16 GEMMs
  DeviceBuffer<uint8_t> meta_dev_;    // page tables and attention item metadata
  std::vector<uint8_t> meta_host_;
  DeviceBuffer<float> partial_o_;     // split-K partial outputs
  DeviceBuffer<float> partial_ml_;    // split-K partial max and sum
  DeviceBuffer<float> rope_inv_freq_;
  std::vector<float> rope_inv_freq_host_;  // what rope_inv_freq_ holds
};

}  // namespace specontext::gpu
