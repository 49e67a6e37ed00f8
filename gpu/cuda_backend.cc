#include "gpu/cuda_backend.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "gpu/attention_plan.h"
#include "gpu/cuda_check.h"
#include "gpu/kernels.h"
#include "gpu/plan_internal.h"
#include "gpu/quant_plan.h"
#include "gpu/retrieval_plan.h"
#include "gpu/sampling_plan.h"
#include "gpu/sparse_plan.h"

namespace specontext::gpu {

namespace {

#define SPX_ENTER_DEVICE()                    \
  ScopedDevice spx_scoped_device_(device_);   \
  SPX_RETURN_IF_ERROR(spx_scoped_device_.status())

Status check_kv_view(const KvLayerView& kv, const char* op) {
  if (kv.page_size <= 0 || kv.kv_heads <= 0 || kv.head_dim <= 0 || kv.n_pages < 0) {
    return invalid_argument(std::string(op) + ": KV page_size, kv_heads and head_dim must be positive");
  }
  if (kv.n_pages > 0 && (kv.k_pages == nullptr || kv.v_pages == nullptr)) {
    return invalid_argument(std::string(op) + ": null KV page tables");
  }
  SPX_RETURN_IF_ERROR(plan_internal::check_kv_dtype(op, "kv.dtype", kv.dtype, kv.dtype));
  return Status::ok();
}

Status check_int_range(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) {
    return invalid_argument(std::string("matmul: ") + what + " = " + std::to_string(v) +
                            " outside cuBLAS's int range");
  }
  return Status::ok();
}

// Appends a trivially copyable array to a byte staging vector at 16-byte alignment; returns the
// offset.
template <typename T>
size_t append_bytes(std::vector<uint8_t>& bytes, const T* data, size_t count) {
  const size_t offset = (bytes.size() + 15) / 16 * 16;
  bytes.resize(offset + count * sizeof(T));
  if (count > 0) std::memcpy(bytes.data() + offset, data, count * sizeof(T));
  return offset;
}

// Where append_split_metadata put the arrays of a dense or sparse attention plan: the three both
// carry, and the one they differ in (page table or per-head counts).
struct SplitMetaOffsets {
  size_t items = 0;
  size_t blocks = 0;
  size_t rows = 0;
  size_t extra = 0;
};

template <typename Plan, typename Extra>
SplitMetaOffsets append_split_metadata(std::vector<uint8_t>& bytes, const Plan& plan,
                                       const std::vector<Extra>& extra) {
  SplitMetaOffsets at;
  at.items = append_bytes(bytes, plan.items.data(), plan.items.size());
  at.blocks = append_bytes(bytes, plan.block_begin.data(), plan.block_begin.size());
  at.rows = append_bytes(bytes, plan.row_begin.data(), plan.row_begin.size());
  at.extra = append_bytes(bytes, extra.data(), extra.size());
  return at;
}

// Points the fields the dense and sparse launches share at the uploaded metadata (base) and, with
// a split, at the scratch: partial_ml holds [m][l], partial_ml_floats in all.
template <typename Launch>
void bind_split_launch(Launch& a, const float* q, float* out, const uint8_t* base, const SplitMetaOffsets& at,
                       float* partial_o, float* partial_ml, size_t partial_ml_floats) {
  a.q = q;
  a.out = out;
  a.items = reinterpret_cast<decltype(a.items)>(base + at.items);
  a.block_begin = reinterpret_cast<const int64_t*>(base + at.blocks);
  a.row_begin = reinterpret_cast<const int64_t*>(base + at.rows);
  if (a.n_chunks_max > 1) {
    a.partial_o = partial_o;
    a.partial_m = partial_ml;
    a.partial_l = partial_ml + partial_ml_floats / 2;
  }
}

}  // namespace

uint64_t content_hash(const void* data, size_t bytes) {
  // 8-byte words through a multiply-rotate round (xxHash64's), the tail byte-wise, the length
  // last: one pass at memory speed; it tells changed weights apart, it is not a cryptographic hash.
  constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
  constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
  auto round = [](uint64_t acc, uint64_t w) {
    acc += w * kPrime2;
    acc = (acc << 31) | (acc >> 33);
    return acc * kPrime1;
  };
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x27D4EB2F165667C5ull;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = round(h, w);
  }
  for (; i < bytes; ++i) h = round(h, p[i]);
  h = round(h, bytes);
  h ^= h >> 29;
  h *= kPrime2;
  return h ^ (h >> 32);
}

// ---- device discovery ----

Result<int> cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return unavailable(std::string("no CUDA device (") + cudaGetErrorName(err) + ": " +
                       cudaGetErrorString(err) + ")");
  }
  if (count <= 0) return unavailable("no CUDA device (the driver reports 0 devices)");
  return count;
}

bool cuda_device_available() { return cuda_device_count().is_ok(); }

Result<std::unique_ptr<Backend>> create_cuda_backend(int device_ordinal) {
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::create(device_ordinal));
  return std::unique_ptr<Backend>(std::move(backend));
}

// ---- lifetime ----

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(int device_ordinal) {
  SPX_ASSIGN_OR_RETURN(const int count, cuda_device_count());
  if (device_ordinal < 0 || device_ordinal >= count) {
    return out_of_range("CUDA device " + std::to_string(device_ordinal) + " requested, " +
                        std::to_string(count) + " present");
  }
  ScopedDevice scope(device_ordinal);
  SPX_RETURN_IF_ERROR(scope.status());
  int major = 0;
  int minor = 0;
  int sms = 0;
  SPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_ordinal));
  SPX_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_ordinal));
  SPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_ordinal));
  DeviceTraits traits;
  traits.sm_count = std::max(sms, 1);
  int smem_default = 0;
  int smem_optin = 0;
  int host_pointers = 0;
  SPX_CUDA_CHECK(cudaDeviceGetAttribute(&smem_default, cudaDevAttrMaxSharedMemoryPerBlock, device_ordinal));
  SPX_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_ordinal));
  SPX_CUDA_CHECK(
      cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, device_ordinal));
  traits.smem.per_block = static_cast<size_t>(std::max(smem_default, 0));
  traits.smem.per_block_optin = static_cast<size_t>(std::max(smem_optin, smem_default));
  traits.registered_host_pointers = host_pointers == 1;
  if (major < 8) {
    // The kernels are built for sm_80 / sm_90 (bf16, large shared memory).
    return unavailable("CUDA device " + std::to_string(device_ordinal) + " has compute capability " +
                       std::to_string(major) + "." + std::to_string(minor) + "; 8.0+ is required");
  }
  SPX_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::create());
  SPX_ASSIGN_OR_RETURN(CublasHandle cublas, CublasHandle::create(stream.get()));
  // Default math: CUBLAS_COMPUTE_32F stays true f32 (no TF32); bf16 inputs use tensor cores.
  SPX_CUBLAS_CHECK(cublas.api().set_math_mode(cublas.get(), CUBLAS_DEFAULT_MATH));
  SPX_CUBLAS_CHECK(cublas.api().set_pointer_mode(cublas.get(), CUBLAS_POINTER_MODE_HOST));
  return std::unique_ptr<CudaBackend>(new CudaBackend(device_ordinal, traits, std::move(stream), std::move(cublas)));
}

CudaBackend::CudaBackend(int device, DeviceTraits traits, CudaStream stream, CublasHandle cublas)
    : device_(device),
      sm_count_(traits.sm_count),
      smem_limits_(traits.smem),
      registered_host_pointers_(traits.registered_host_pointers),
      stream_(std::move(stream)),
      cublas_(std::move(cublas)) {}

CudaBackend::~CudaBackend() {
  // Scratch buffers may still be read by queued kernels; cudaFree would wait anyway, but an
  // explicit wait reports a pending fault with context instead of at an unrelated free.
  ScopedDevice scope(device_);
  if (!stream_.empty()) log_error(stream_.synchronize(), "CudaBackend teardown");
}

Status CudaBackend::synchronize() {
  SPX_ENTER_DEVICE();
  return stream_.synchronize();
}

template <typename T>
Status CudaBackend::reserve(DeviceBuffer<T>& buffer, size_t count) {
  if (buffer.size() >= count) return Status::ok();
  const size_t grown = std::max(count, buffer.size() + buffer.size() / 2);
  SPX_RETURN_IF_ERROR(stream_.synchronize());
  buffer = DeviceBuffer<T>();  // free first: lower peak memory
  SPX_ASSIGN_OR_RETURN(buffer, DeviceBuffer<T>::create(grown));
  return Status::ok();
}

Status CudaBackend::upload_metadata() {
  SPX_RETURN_IF_ERROR(reserve(meta_dev_, meta_host_.size()));
  return staging_.copy(meta_dev_.data(), meta_host_.data(), meta_host_.size(), stream_.get());
}

bool CudaBackend::supports(BackendOp op, DType weight_dtype) const { return cuda_supports(op, weight_dtype); }

Result<std::shared_ptr<void>> CudaBackend::allocate(size_t bytes) {
  SPX_ENTER_DEVICE();
  SPX_ASSIGN_OR_RETURN(void* p, detail::device_alloc(std::max<size_t>(bytes, 1)));
  return std::shared_ptr<void>(p, [](void* q) { detail::device_free(q); });
}

// ---- memory between the host and the device ----

Result<const void*> CudaBackend::import_weights(const void* host, size_t bytes) {
  if (host == nullptr && bytes > 0) return invalid_argument("import_weights: null host pointer");
  const uint64_t hash = content_hash(host, bytes);
  auto it = imported_.find(host);
  if (it != imported_.end()) {
    if (it->second.bytes == bytes && it->second.hash == hash) {
      return static_cast<const void*>(it->second.buffer.data());
    }
    // Other bytes at a known address: the memory was freed and reused (or rewritten). The old
    // copy is stale; queued kernels may still read it, so wait before freeing it.
    SPX_ENTER_DEVICE();
    SPX_RETURN_IF_ERROR(stream_.synchronize());
    imported_.erase(it);
  }
  SPX_ENTER_DEVICE();
  ImportedWeights copy;
  SPX_ASSIGN_OR_RETURN(copy.buffer, DeviceBuffer<uint8_t>::create(std::max<size_t>(bytes, 1)));
  copy.bytes = bytes;
  copy.hash = hash;
  SPX_RETURN_IF_ERROR(staging_.copy(copy.buffer.data(), host, bytes, stream_.get()));
  const void* device = copy.buffer.data();
  imported_.emplace(host, std::move(copy));
  return device;
}

Status CudaBackend::upload(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  if (dst == nullptr || host_src == nullptr) return invalid_argument("upload: null destination or source");
  SPX_ENTER_DEVICE();
  return staging_.copy(dst, host_src, bytes, stream_.get());
}

Status CudaBackend::download(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::ok();
  if (host_dst == nullptr || src == nullptr) return invalid_argument("download: null destination or source");
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_.get()));
  // Pinned destinations make the copy truly asynchronous: wait for it (and everything before).
  return stream_.synchronize();
}

Status CudaBackend::copy_rows(void* dst, size_t dst_stride, const void* src, size_t src_stride, size_t row_bytes,
                              int64_t rows) {
  if (rows < 0) return invalid_argument("copy_rows: rows = " + std::to_string(rows) + " < 0");
  if (rows == 0 || row_bytes == 0) return Status::ok();
  if (dst == nullptr || src == nullptr) return invalid_argument("copy_rows: null destination or source");
  SPX_ENTER_DEVICE();
  if (rows == 1) {
    SPX_CUDA_CHECK(cudaMemcpyAsync(dst, src, row_bytes, cudaMemcpyDefault, stream_.get()));
    return Status::ok();
  }
  if (dst_stride < row_bytes || src_stride < row_bytes) {
    return invalid_argument("copy_rows: dst_stride " + std::to_string(dst_stride) + " / src_stride " +
                            std::to_string(src_stride) + " smaller than row_bytes " + std::to_string(row_bytes));
  }
  SPX_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, static_cast<size_t>(rows),
                                   cudaMemcpyDefault, stream_.get()));
  return Status::ok();
}

// ---- ops ----

Status CudaBackend::embed(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) {
  kernels::TableType type;
  switch (table.dtype) {
    case DType::kF32: type = kernels::TableType::kF32; break;
    case DType::kF16: type = kernels::TableType::kF16; break;
    case DType::kBF16: type = kernels::TableType::kBF16; break;
    default:
      if (quant_type_of(table.dtype)) return embed_blocks(ids, n, table, out);
      return unimplemented("CUDA embed supports f32/f16/bf16 and Q8_0/Q4_0/Q4_K/Q5_K/Q6_K tables, not " +
                           std::string(dtype_name(table.dtype)));
  }
  if (n <= 0) return Status::ok();
  if (ids == nullptr || table.data == nullptr || out == nullptr) {
    return invalid_argument("embed: null ids, table or output");
  }
  if (n > INT_MAX) return invalid_argument("embed: too many tokens for one launch");
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(kernels::launch_embed(ids, n, table.data, type, table.rows, table.cols, out,
                                       stream_.get()));
  return Status::ok();
}

Status CudaBackend::matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias,
                           float* y) {
  const bool blocks = quant_type_of(w.dtype).has_value();
  if (w.dtype != DType::kF32 && w.dtype != DType::kBF16 && !blocks) {
    return unimplemented("CUDA matmul supports f32, bf16 and Q8_0/Q4_0/Q4_K/Q5_K/Q6_K weights, not " +
                         std::string(dtype_name(w.dtype)));
  }
  if (m <= 0 || w.rows <= 0) return Status::ok();
  SPX_RETURN_IF_ERROR(check_int_range(m, "m"));
  SPX_RETURN_IF_ERROR(check_int_range(w.rows, "rows"));
  SPX_RETURN_IF_ERROR(check_int_range(w.cols, "cols"));
  SPX_ENTER_DEVICE();
  cudaStream_t s = stream_.get();
  if (w.cols == 0) {  // empty reduction: y = bias (or 0)
    SPX_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(m * w.rows) * sizeof(float), s));
  } else if (blocks) {
    SPX_RETURN_IF_ERROR(matmul_blocks(x, m, w, y));
  } else if (w.dtype == DType::kBF16 && m <= kernels::kQuantGemvMaxRows) {
    SPX_RETURN_IF_ERROR(reserve(act_bf16_, static_cast<size_t>(m * w.cols)));
    SPX_CUDA_CHECK(kernels::launch_f32_to_bf16(x, m * w.cols, act_bf16_.data(), s));
    SPX_CUDA_CHECK(kernels::launch_bf16_gemv(static_cast<const uint16_t*>(w.data), act_bf16_.data(), m, w.rows, w.cols,
                                             y, s));
  } else {
    // Row-major y[m, N] = x[m, K] · W[N, K]ᵀ is column-major yᶜ[N, m] = Wᶜᵀ[N, K] · xᶜ[K, m]
    // with W and x read as column-major [K, N] and [K, m] (leading dimension K).
    const int n_out = static_cast<int>(w.rows);
    const int n_in = static_cast<int>(w.cols);
    const int n_tok = static_cast<int>(m);
    const float alpha = 1.0f;
    const float beta = 0.0f;
    const void* b_ptr = x;
    cudaDataType_t ab_type = CUDA_R_32F;
    if (w.dtype == DType::kBF16) {
      const size_t count = static_cast<size_t>(m * w.cols);
      SPX_RETURN_IF_ERROR(reserve(act_bf16_, count));
      SPX_CUDA_CHECK(kernels::launch_f32_to_bf16(x, m * w.cols, act_bf16_.data(), s));
      b_ptr = act_bf16_.data();
      ab_type = CUDA_R_16BF;
    }
    kernels::clear_stale_error();  // cuBLAS may read the last-error slot after its launches
    SPX_CUBLAS_CHECK(cublas_.api().gemm_ex(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, n_out, n_tok, n_in,
                                           &alpha, w.data, ab_type, n_in, b_ptr, ab_type, n_in, &beta, y,
                                           CUDA_R_32F, n_out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  if (bias != nullptr) SPX_CUDA_CHECK(kernels::launch_bias_add(y, bias, m, w.rows, s));
  return Status::ok();
}

Status CudaBackend::embed_blocks(const TokenId* ids, int64_t n, const WeightMatrix& table, float* out) {
  if (n <= 0) return Status::ok();
  if (ids == nullptr || table.data == nullptr || out == nullptr) {
    return invalid_argument("embed: null ids, table or output");
  }
  if (table.rows <= 0 || table.cols <= 0) return invalid_argument("embed: empty table");
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(kernels::launch_quant_dequantize_rows(*quant_type_of(table.dtype),
                                                       static_cast<const uint8_t*>(table.data),
                                                       static_cast<int64_t>(table.row_bytes()), table.rows, ids, 0, n,
                                                       table.cols, table.cols, out, stream_.get()));
  return Status::ok();
}

Status CudaBackend::matmul_blocks(const float* x, int64_t m, const WeightMatrix& w, float* y) {
  SPX_ASSIGN_OR_RETURN(const QuantMatmulPlan plan, plan_quant_matmul(w, m));
  cudaStream_t s = stream_.get();
  const auto* wb = static_cast<const uint8_t*>(w.data);
  if (plan.gemv) {
    SPX_RETURN_IF_ERROR(reserve(quant_act_, plan.scratch_bytes));
    auto* act_q = reinterpret_cast<int8_t*>(quant_act_.data());
    auto* act_d = reinterpret_cast<float*>(quant_act_.data() + plan.act_scales_offset);
    SPX_CUDA_CHECK(kernels::launch_quantize_activations(plan.type, x, m, w.cols, plan.nb, act_q, act_d, s));
    kernels::QuantGemvLaunch a;
    a.type = plan.type;
    a.w = wb;
    a.row_bytes = plan.row_bytes;
    a.rows = w.rows;
    a.nb = plan.nb;
    a.act_q = act_q;
    a.act_d = act_d;
    a.m = m;
    a.y = y;
    SPX_CUDA_CHECK(kernels::launch_quant_gemv(a, s));
    return Status::ok();
  }
  // Larger batches (prefill): f32 tiles of decoded rows, each a true-f32 GEMM into its columns of y
  // (row-major y[m, N]: column-major [N, m], the tile's rows at y + r0, ldc N).
  SPX_RETURN_IF_ERROR(reserve(dequant_tile_, plan.tile_floats));
  const float alpha = 1.0f;
  const float beta = 0.0f;
  for (int64_t t = 0; t < plan.tiles; ++t) {
    const int64_t r0 = t * plan.tile_rows;
    const int64_t rows = std::min(plan.tile_rows, w.rows - r0);
    SPX_CUDA_CHECK(kernels::launch_quant_dequantize_rows(plan.type, wb, plan.row_bytes, w.rows, nullptr, r0, rows,
                                                         plan.padded_cols, plan.padded_cols, dequant_tile_.data(), s));
    kernels::clear_stale_error();
    SPX_CUBLAS_CHECK(cublas_.api().gemm_ex(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows),
                                           static_cast<int>(m), static_cast<int>(w.cols), &alpha, dequant_tile_.data(),
                                           CUDA_R_32F, static_cast<int>(plan.padded_cols), x, CUDA_R_32F,
                                           static_cast<int>(w.cols), &beta, y + r0, CUDA_R_32F,
                                           static_cast<int>(w.rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return Status::ok();
}

size_t CudaBackend::imported_weight_bytes() const {
  size_t total = 0;
  for (const auto& [host, copy] : imported_) total += copy.bytes;
  return total;
}

Status CudaBackend::rmsnorm(const float* x, const float* weight, int64_t rows, int64_t dim,
                            float eps, float* y) {
  if (rows <= 0 || dim <= 0) return Status::ok();
  if (rows > INT_MAX) return invalid_argument("rmsnorm: too many rows for one launch");
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(kernels::launch_rmsnorm(x, weight, rows, dim, eps, y, stream_.get()));
  return Status::ok();
}

Status CudaBackend::rope(float* x, int64_t n_tokens, int64_t n_heads, const int64_t* positions,
                         const RopeParams& params) {
  if (params.head_dim <= 0 || params.head_dim % 2 != 0) {
    return invalid_argument("rope: head_dim must be positive and even, got " +
                            std::to_string(params.head_dim));
  }
  if (static_cast<int64_t>(params.inv_freq.size()) != params.head_dim / 2) {
    return invalid_argument("rope: inv_freq has " + std::to_string(params.inv_freq.size()) +
                            " entries, head_dim/2 = " + std::to_string(params.head_dim / 2));
  }
  if (n_tokens <= 0 || n_heads <= 0) return Status::ok();
  if (n_tokens > INT_MAX || n_heads > 65535) return invalid_argument("rope: shape too large");
  SPX_ENTER_DEVICE();
  if (rope_inv_freq_host_ != params.inv_freq) {
    // Stream-ordered overwrite: kernels queued earlier still read the old table first.
    SPX_RETURN_IF_ERROR(reserve(rope_inv_freq_, params.inv_freq.size()));
    SPX_RETURN_IF_ERROR(
        rope_inv_freq_.upload(params.inv_freq.data(), params.inv_freq.size(), stream_.get()));
    rope_inv_freq_host_ = params.inv_freq;
  }
  SPX_CUDA_CHECK(kernels::launch_rope(x, n_tokens, n_heads, params.head_dim, positions,
                                      rope_inv_freq_.data(),
                                      params.style == RopeStyle::kInterleaved, params.mscale,
                                      stream_.get()));
  return Status::ok();
}

Status CudaBackend::swiglu(const float* gate, const float* up, int64_t n, float* out) {
  if (n <= 0) return Status::ok();
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(kernels::launch_swiglu(gate, up, n, out, stream_.get()));
  return Status::ok();
}

Status CudaBackend::add(float* x, const float* y, int64_t n) {
  if (n <= 0) return Status::ok();
  SPX_ENTER_DEVICE();
  SPX_CUDA_CHECK(kernels::launch_add(x, y, n, stream_.get()));
  return Status::ok();
}

Status CudaBackend::kv_append(const float* k, const float* v, int64_t n_tokens, int64_t start_pos,
                              const KvLayerView& kv) {
  SPX_RETURN_IF_ERROR(check_kv_view(kv, "kv_append"));
  if (n_tokens < 0 || start_pos < 0 || start_pos + n_tokens > kv.capacity()) {
    return out_of_range("kv_append: positions [" + std::to_string(start_pos) + ", " +
                        std::to_string(start_pos + n_tokens) + ") exceed cache capacity " +
                        std::to_string(kv.capacity()));
  }
  if (n_tokens == 0) return Status::ok();
  if (n_tokens > INT_MAX || kv.kv_heads > 65535) {
    return invalid_argument("kv_append: shape too large for one launch");
  }
  SPX_ENTER_DEVICE();
  // Only the pages this append touches travel: [K pointers][V pointers].
  const int64_t first_page = start_pos / kv.page_size;
  const int64_t n_touched = (start_pos + n_tokens - 1) / kv.page_size - first_page + 1;
  std::vector<void*> table(kv.k_pages + first_page, kv.k_pages + first_page + n_touched);
  table.insert(table.end(), kv.v_pages + first_page, kv.v_pages + first_page + n_touched);
  meta_host_.clear();
  append_bytes(meta_host_, table.data(), table.size());
  SPX_RETURN_IF_ERROR(upload_metadata());
  SPX_CUDA_CHECK(kernels::launch_kv_append(k, v, n_tokens, start_pos,
                                           reinterpret_cast<void* const*>(meta_dev_.data()),
                                           plan_internal::kv_type_of(kv.dtype), first_page, n_touched,
                                           kv.page_size, kv.kv_heads, kv.head_dim, stream_.get()));
  return Status::ok();
}

Status CudaBackend::attention(const float* q, const AttentionItem* items, int64_t n_items,
                              int64_t n_heads, float* out) {
  SPX_ASSIGN_OR_RETURN(AttentionPlan plan, plan_attention(items, n_items, n_heads, sm_count_));
  if (plan.launch.total_blocks == 0) return Status::ok();
  SPX_ENTER_DEVICE();
  meta_host_.clear();
  const SplitMetaOffsets at = append_split_metadata(meta_host_, plan, plan.pages);
  // Scratch growth synchronises the stream; do it before the metadata upload is queued.
  SPX_RETURN_IF_ERROR(reserve(partial_o_, plan.partial_o_floats()));
  SPX_RETURN_IF_ERROR(reserve(partial_ml_, plan.partial_ml_floats()));
  SPX_RETURN_IF_ERROR(upload_metadata());

  kernels::AttentionLaunch& a = plan.launch;
  bind_split_launch(a, q, out, meta_dev_.data(), at, partial_o_.data(), partial_ml_.data(),
                    plan.partial_ml_floats());
  a.page_table = reinterpret_cast<void* const*>(meta_dev_.data() + at.extra);
  SPX_CUDA_CHECK(kernels::launch_attention(a, stream_.get()));
  return Status::ok();
}

Status CudaBackend::kv_gather(const KvLayerView& kv, const GatherEntry* entries, int64_t n_entries,
                              const WorkingSetView& ws) {
  SPX_ASSIGN_OR_RETURN(KvGatherPlan plan, plan_kv_gather(kv, entries, n_entries, ws));
  if (plan.launch.n_entries == 0) return Status::ok();
  SPX_ENTER_DEVICE();
  meta_host_.clear();
  const size_t entries_at = append_bytes(meta_host_, entries, static_cast<size_t>(n_entries));
  const size_t pages_at = append_bytes(meta_host_, plan.pages.data(), plan.pages.size());
  SPX_RETURN_IF_ERROR(upload_metadata());
  kernels::KvGatherLaunch& g = plan.launch;
  const uint8_t* base = meta_dev_.data();
  g.entries = reinterpret_cast<const kernels::GatherEntryMeta*>(base + entries_at);
  g.page_table = reinterpret_cast<void* const*>(base + pages_at);
  SPX_CUDA_CHECK(kernels::launch_kv_gather(g, stream_.get()));
  return Status::ok();
}

Status CudaBackend::attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n_items,
                                     int64_t n_heads, float* out) {
  SPX_ASSIGN_OR_RETURN(SparseAttentionPlan plan, plan_attention_sparse(items, n_items, n_heads, sm_count_));
  if (plan.launch.total_blocks == 0) return Status::ok();
  SPX_ENTER_DEVICE();
  meta_host_.clear();
  const SplitMetaOffsets at = append_split_metadata(meta_host_, plan, plan.counts);
  // Scratch growth synchronises the stream; do it before the metadata upload is queued.
  SPX_RETURN_IF_ERROR(reserve(partial_o_, plan.partial_o_floats()));
  SPX_RETURN_IF_ERROR(reserve(partial_ml_, plan.partial_ml_floats()));
  SPX_RETURN_IF_ERROR(upload_metadata());

  kernels::SparseAttentionLaunch& a = plan.launch;
  bind_split_launch(a, q, out, meta_dev_.data(), at, partial_o_.data(), partial_ml_.data(),
                    plan.partial_ml_floats());
  a.counts = reinterpret_cast<const int32_t*>(meta_dev_.data() + at.extra);
  SPX_CUDA_CHECK(kernels::launch_attention_sparse(a, stream_.get()));
  return Status::ok();
}

Status CudaBackend::attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n_items,
                                      int64_t n_heads, float* out) {
  SPX_ASSIGN_OR_RETURN(SparseAttentionPlan plan, plan_attention_indexed(items, n_items, n_heads, sm_count_));
  if (plan.launch.total_blocks == 0) return Status::ok();
  SPX_ENTER_DEVICE();
  meta_host_.clear();
  const SplitMetaOffsets at = append_split_metadata(meta_host_, plan, plan.counts);
  const size_t pages_at = append_bytes(meta_host_, plan.pages.data(), plan.pages.size());
  const size_t indices_at = append_bytes(meta_host_, plan.indices.data(), plan.indices.size());
  // Scratch growth synchronises the stream; do it before the metadata upload is queued.
  SPX_RETURN_IF_ERROR(reserve(partial_o_, plan.partial_o_floats()));
  SPX_RETURN_IF_ERROR(reserve(partial_ml_, plan.partial_ml_floats()));
  SPX_RETURN_IF_ERROR(upload_metadata());

  kernels::SparseAttentionLaunch& a = plan.launch;
  bind_split_launch(a, q, out, meta_dev_.data(), at, partial_o_.data(), partial_ml_.data(),
                    plan.partial_ml_floats());
  a.counts = reinterpret_cast<const int32_t*>(meta_dev_.data() + at.extra);
  a.page_table = reinterpret_cast<void* const*>(meta_dev_.data() + pages_at);
  a.indices = reinterpret_cast<const int32_t*>(meta_dev_.data() + indices_at);
  SPX_CUDA_CHECK(kernels::launch_attention_indexed(a, stream_.get()));
  return Status::ok();
}

// ---- retrieval head ----

Status CudaBackend::retrieval_group_scores(const float* q, const void* const* k_blocks, DType k_dtype,
                                           int64_t block_tokens, int64_t length, int64_t n_heads, int64_t n_kv_heads,
                                           int64_t head_dim, float* out) {
  SPX_ASSIGN_OR_RETURN(RetrievalScoresPlan plan, plan_retrieval_scores(q, k_blocks, k_dtype, block_tokens, length,
                                                                       n_heads, n_kv_heads, head_dim, out, sm_count_,
                                                                       smem_limits_));
  if (plan.launch.length <= 0) return Status::ok();
  SPX_ENTER_DEVICE();
  meta_host_.clear();
  const size_t table_at = append_bytes(meta_host_, k_blocks, static_cast<size_t>(plan.n_blocks));
  SPX_RETURN_IF_ERROR(upload_metadata());
  plan.launch.k_blocks = reinterpret_cast<const void* const*>(meta_dev_.data() + table_at);
  SPX_RETURN_IF_ERROR(reserve(retrieval_logits_, plan.logits_floats));
  SPX_RETURN_IF_ERROR(reserve(retrieval_partials_, plan.partial_floats + plan.stats_floats));
  kernels::RetrievalScoresLaunch& a = plan.launch;
  a.logits = retrieval_logits_.data();
  a.partial_m = retrieval_partials_.data();
  a.partial_l = a.partial_m + plan.partial_floats / 2;
  a.stats = a.partial_m + plan.partial_floats;
  SPX_CUDA_CHECK(kernels::launch_retrieval_scores(a, stream_.get()));
  return Status::ok();
}

Status CudaBackend::select_top_tokens(const float* group_scores, int64_t n_kv_heads, int64_t length,
                                      const SelectionOptions& options, Selection& out) {
  SPX_ASSIGN_OR_RETURN(SelectTopPlan plan, plan_select_top_tokens(n_kv_heads, length, options, sm_count_));
  prepare_selection(plan, n_kv_heads, length, out);
  if (plan.host_only) return Status::ok();
  if (group_scores == nullptr) return invalid_argument("select_top_tokens: null group_scores");
  SPX_ENTER_DEVICE();
  kernels::SelectTopLaunch& a = plan.launch;
  // Scratch layout: histograms (uint32), states (16-byte aligned), warp counts (int32).
  const size_t hist_bytes = plan.hist_words() * sizeof(uint32_t);
  const size_t state_at = (hist_bytes + 15) / 16 * 16;
  const size_t state_bytes = plan.initial_state.size() * sizeof(kernels::SelectState);
  const size_t counts_at = (state_at + state_bytes + 15) / 16 * 16;
  const size_t scratch_bytes = counts_at + plan.warp_count_words() * sizeof(int32_t);
  const size_t out_words = static_cast<size_t>(n_kv_heads * plan.budget);
  SPX_RETURN_IF_ERROR(reserve(select_scratch_, scratch_bytes));
  SPX_RETURN_IF_ERROR(reserve(select_out_, out_words));
  uint8_t* base = select_scratch_.data();
  a.scores = group_scores;
  a.out = select_out_.data();
  if (a.take > 0) {
    a.hist = reinterpret_cast<uint32_t*>(base);
    a.state = reinterpret_cast<kernels::SelectState*>(base + state_at);
    a.warp_counts = reinterpret_cast<int32_t*>(base + counts_at);
    SPX_CUDA_CHECK(cudaMemsetAsync(a.hist, 0, hist_bytes, stream_.get()));
    SPX_RETURN_IF_ERROR(staging_.copy(a.state, plan.initial_state.data(), state_bytes, stream_.get()));
  }
  SPX_CUDA_CHECK(kernels::launch_select_top(a, stream_.get()));
  return download(out.indices.data(), a.out, out_words * sizeof(int32_t));
}

// ---- sampling ----

Status CudaBackend::sample_rows(float* logits, int64_t rows, int64_t vocab, const TokenDraw* draws,
                                TokenId* tokens) {
  SPX_ASSIGN_OR_RETURN(SamplePlan plan, plan_sample_rows(logits, rows, vocab, draws, tokens));
  if (plan.rows == 0) return Status::ok();
  if (plan.host_only) {
    fill_host_only(plan, tokens);
    return Status::ok();
  }
  SPX_ENTER_DEVICE();
  size_t temp_bytes = 0;
  for (const SampleGroupPlan& g : plan.groups) {
    size_t b = 0;
    SPX_CUDA_CHECK(kernels::sample_sort_temp_bytes(vocab, g.n_slots(), g.n_seg2(), plan.key_shift, &b));
    temp_bytes = std::max(temp_bytes, b);
  }
  // Scratch growth synchronises the stream; do it before the metadata upload is queued.
  SPX_RETURN_IF_ERROR(reserve(sample_tokens_, static_cast<size_t>(rows)));
  if (plan.max_slots > 0) {
    SPX_RETURN_IF_ERROR(reserve(sample_keys_, 2 * plan.key_words()));
    SPX_RETURN_IF_ERROR(reserve(sample_ends_, static_cast<size_t>(plan.max_slots + plan.max_seg2)));
    SPX_RETURN_IF_ERROR(reserve(sample_temp_, std::max<size_t>(temp_bytes, 1)));
  }
  meta_host_.clear();
  const size_t meta_at = append_bytes(meta_host_, plan.meta.data(), plan.meta.size());
  const size_t ids_at = append_bytes(meta_host_, plan.penalized.data(), plan.penalized.size());
  struct GroupOffsets {
    size_t begin1, begin2, rows_topk, rows_topp;
  };
  std::vector<GroupOffsets> at;
  at.reserve(plan.groups.size());
  for (const SampleGroupPlan& g : plan.groups) {
    GroupOffsets o{};
    o.begin1 = append_bytes(meta_host_, g.begin1.data(), g.begin1.size());
    o.begin2 = append_bytes(meta_host_, g.begin2.data(), g.begin2.size());
    o.rows_topk = append_bytes(meta_host_, g.rows_topk.data(), g.rows_topk.size());
    o.rows_topp = append_bytes(meta_host_, g.rows_topp.data(), g.rows_topp.size());
    at.push_back(o);
  }
  SPX_RETURN_IF_ERROR(upload_metadata());
  const uint8_t* base = meta_dev_.data();
  // Groups run one after another on the stream and share the scratch (stream-ordered reuse).
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const SampleGroupPlan& g = plan.groups[gi];
    kernels::SampleLaunch a;
    a.logits = logits;
    a.vocab = vocab;
    a.meta = reinterpret_cast<const kernels::SampleRowMeta*>(base + meta_at);
    a.penalized = reinterpret_cast<const int32_t*>(base + ids_at);
    a.tokens = sample_tokens_.data();
    a.key_shift = plan.key_shift;
    a.row_begin = g.row_begin;
    a.n_rows = g.n_rows;
    a.n_slots = g.n_slots();
    a.n_seg2 = g.n_seg2();
    a.n_topk = static_cast<int32_t>(g.rows_topk.size());
    a.n_topp = static_cast<int32_t>(g.rows_topp.size());
    a.rows_topk = reinterpret_cast<const int32_t*>(base + at[gi].rows_topk);
    a.rows_topp = reinterpret_cast<const int32_t*>(base + at[gi].rows_topp);
    a.begin1 = reinterpret_cast<const int32_t*>(base + at[gi].begin1);
    a.begin2 = reinterpret_cast<const int32_t*>(base + at[gi].begin2);
    if (plan.max_slots > 0) {
      a.end1 = sample_ends_.data();
      a.end2 = sample_ends_.data() + plan.max_slots;
      a.keys_a = sample_keys_.data();
      a.keys_b = sample_keys_.data() + plan.key_words();
      a.sort_temp = sample_temp_.data();
      a.sort_temp_bytes = sample_temp_.size();
    }
    SPX_CUDA_CHECK(kernels::launch_sample_rows(a, stream_.get()));
  }
  static_assert(sizeof(TokenId) == sizeof(int32_t));
  return download(tokens, sample_tokens_.data(), static_cast<size_t>(rows) * sizeof(int32_t));
}

}  // namespace specontext::gpu
