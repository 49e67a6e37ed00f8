#include "core/engine/tensor_parallel.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/model/model_loader.h"

namespace specontext {

namespace {

std::string rank_text(int rank, int world) {
  return "rank " + std::to_string(rank) + " of world " + std::to_string(world);
}

Status check_rank(const char* what, int rank, int world) {
  if (world < 1) {
    return invalid_argument(std::string(what) + ": world = " + std::to_string(world) + " must be at least 1");
  }
  if (rank < 0 || rank >= world) {
    return invalid_argument(std::string(what) + ": rank = " + std::to_string(rank) + " is outside [0, " +
                            std::to_string(world) + ")");
  }
  return Status::ok();
}

Status check_divides(const char* what, const char* field, int64_t value, int world) {
  if (value % world != 0) {
    return invalid_argument(std::string(what) + ": " + field + " = " + std::to_string(value) +
                            " is not divisible by world = " + std::to_string(world));
  }
  return Status::ok();
}

// Element size of a matrix dtype that slices element-wise; block-quantised types are refused
// (shard_model dequantises them before slicing).
Result<size_t> element_bytes(const std::string& name, const WeightMatrix& m) {
  switch (m.dtype) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
      return dtype_size(m.dtype);
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kI32:
    case DType::kI64:
    case DType::kU8:
      break;
  }
  return unimplemented(name + ": dtype " + std::string(dtype_name(m.dtype)) +
                       " cannot be sharded (f32, f16 and bf16 can)");
}

// Rows [row0, row0 + n) as a view of the same memory.
Result<WeightMatrix> row_slice(const std::string& name, const WeightMatrix& m, int64_t row0, int64_t n) {
  SPX_ASSIGN_OR_RETURN(const size_t esz, element_bytes(name, m));
  WeightMatrix out = m;
  out.rows = n;
  out.data = static_cast<const uint8_t*>(m.data) + static_cast<size_t>(row0 * m.cols) * esz;
  return out;
}

// Columns [col0, col0 + n) copied into a new buffer owned by `storage` (a column slice of a
// row-major matrix is strided, and matmul wants a dense [rows, n] matrix).
Result<WeightMatrix> column_slice(const std::string& name, const WeightMatrix& m, int64_t col0, int64_t n,
                                  std::vector<std::shared_ptr<const void>>& storage) {
  SPX_ASSIGN_OR_RETURN(const size_t esz, element_bytes(name, m));
  if (col0 == 0 && n == m.cols) return m;  // world 1: the parent's matrix as it is
  const size_t row_bytes = static_cast<size_t>(n) * esz;
  const size_t bytes = static_cast<size_t>(m.rows) * row_bytes;
  // 64-byte aligned like the loaders' converted buffers (aligned_alloc wants a multiple).
  void* raw = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (raw == nullptr)
    return resource_exhausted(name + ": out of memory for a column slice of " + std::to_string(bytes) +
                              " bytes");
  std::shared_ptr<void> buf(raw, std::free);
  const auto* src = static_cast<const uint8_t*>(m.data);
  auto* dst = static_cast<uint8_t*>(raw);
  const size_t src_row = static_cast<size_t>(m.cols) * esz;
  for (int64_t r = 0; r < m.rows; ++r) {
    std::memcpy(dst + static_cast<size_t>(r) * row_bytes,
                src + static_cast<size_t>(r) * src_row + static_cast<size_t>(col0) * esz, row_bytes);
  }
  WeightMatrix out = m;
  out.cols = n;
  out.data = raw;
  storage.push_back(std::move(buf));
  return out;
}

Vec vec_slice(const Vec& v, int64_t begin, int64_t n) {
  if (v.empty()) return {};
  return Vec(v.begin() + begin, v.begin() + begin + n);
}

}  // namespace

Result<std::shared_ptr<const Model>> shard_model(std::shared_ptr<const Model> model, int rank, int world) {
  constexpr const char* kWhat = "shard_model";
  if (!model) return invalid_argument("shard_model: model is null");
  SPX_RETURN_IF_ERROR(check_rank(kWhat, rank, world));
  SPX_RETURN_IF_ERROR(model->validate());  // shapes are trusted below
  const DType plain = model->weight_dtype;
  SPX_ASSIGN_OR_RETURN(model, dequantize_block_matrices(std::move(model), plain, [](DType) { return false; }));
  const ModelConfig& c = model->config;
  SPX_RETURN_IF_ERROR(check_divides(kWhat, "n_heads", c.n_heads, world));
  SPX_RETURN_IF_ERROR(check_divides(kWhat, "n_kv_heads", c.n_kv_heads, world));
  SPX_RETURN_IF_ERROR(check_divides(kWhat, "hidden_dim", c.hidden_dim, world));

  auto shard = std::make_shared<Model>();
  shard->config = c;
  shard->config.n_heads = c.n_heads / world;
  shard->config.n_kv_heads = c.n_kv_heads / world;
  shard->config.hidden_dim = c.hidden_dim / world;
  shard->tok_embeddings = model->tok_embeddings;
  shard->lm_head = model->lm_head;
  shard->final_norm = model->final_norm;
  shard->source = model->source;
  shard->format = model->format;
  shard->weight_dtype = model->weight_dtype;
  // The views point into the parent's storage: holding the parent holds all of it.
  shard->storage.push_back(std::shared_ptr<const void>(model));

  const int64_t qd = shard->config.q_dim(), kvd = shard->config.kv_dim(), hd = shard->config.hidden_dim;
  const int64_t q0 = rank * qd, kv0 = rank * kvd, h0 = rank * hd;
  shard->layers.resize(model->layers.size());
  for (size_t i = 0; i < model->layers.size(); ++i) {
    const LayerWeights& p = model->layers[i];
    LayerWeights& s = shard->layers[i];
    const std::string prefix = model->source + ": layers." + std::to_string(i) + ".";
    SPX_ASSIGN_OR_RETURN(s.wq, row_slice(prefix + "wq", p.wq, q0, qd));
    SPX_ASSIGN_OR_RETURN(s.wk, row_slice(prefix + "wk", p.wk, kv0, kvd));
    SPX_ASSIGN_OR_RETURN(s.wv, row_slice(prefix + "wv", p.wv, kv0, kvd));
    SPX_ASSIGN_OR_RETURN(s.wo, column_slice(prefix + "wo", p.wo, q0, qd, shard->storage));
    SPX_ASSIGN_OR_RETURN(s.w_gate, row_slice(prefix + "w_gate", p.w_gate, h0, hd));
    SPX_ASSIGN_OR_RETURN(s.w_up, row_slice(prefix + "w_up", p.w_up, h0, hd));
    SPX_ASSIGN_OR_RETURN(s.w_down, column_slice(prefix + "w_down", p.w_down, h0, hd, shard->storage));
    s.bq = vec_slice(p.bq, q0, qd);
    s.bk = vec_slice(p.bk, kv0, kvd);
    s.bv = vec_slice(p.bv, kv0, kvd);
    s.q_norm = p.q_norm;
    s.k_norm = p.k_norm;
    s.attn_norm = p.attn_norm;
    s.ffn_norm = p.ffn_norm;
  }
  Status st = shard->validate();
  if (!st.is_ok())
    return internal_error("shard_model: " + rank_text(rank, world) + " is inconsistent: " + st.to_string());
  return std::shared_ptr<const Model>(std::move(shard));
}

Result<std::shared_ptr<const RetrievalHead>> shard_retrieval_head(std::shared_ptr<const RetrievalHead> head,
                                                                  int rank, int world) {
  constexpr const char* kWhat = "shard_retrieval_head";
  if (!head) return invalid_argument("shard_retrieval_head: head is null");
  SPX_RETURN_IF_ERROR(check_rank(kWhat, rank, world));
  const RetrievalHeadConfig& c = head->config;
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.head_dim <= 0 || c.n_heads % c.n_kv_heads != 0) {
    return invalid_argument("shard_retrieval_head: n_heads = " + std::to_string(c.n_heads) +
                            " is not a positive multiple of n_kv_heads = " + std::to_string(c.n_kv_heads));
  }
  SPX_RETURN_IF_ERROR(check_divides(kWhat, "n_kv_heads", c.n_kv_heads, world));
  const int64_t in = 2 * c.hidden;
  if (head->wq.rows != c.n_heads * c.head_dim || head->wq.cols != in) {
    return invalid_argument("shard_retrieval_head: wq is [" + std::to_string(head->wq.rows) + ", " +
                            std::to_string(head->wq.cols) + "], the config needs [" +
                            std::to_string(c.n_heads * c.head_dim) + ", " + std::to_string(in) + "]");
  }
  if (head->wk.rows != c.n_kv_heads * c.head_dim || head->wk.cols != in) {
    return invalid_argument("shard_retrieval_head: wk is [" + std::to_string(head->wk.rows) + ", " +
                            std::to_string(head->wk.cols) + "], the config needs [" +
                            std::to_string(c.n_kv_heads * c.head_dim) + ", " + std::to_string(in) + "]");
  }
  auto shard = std::make_shared<RetrievalHead>(*head);
  // Query heads follow their KV heads (h / group), so a contiguous block of KV heads owns a
  // contiguous block of query heads.
  shard->config.n_kv_heads = c.n_kv_heads / world;
  shard->config.n_heads = c.n_heads / world;
  const int64_t qd = shard->config.n_heads * c.head_dim, kd = shard->config.n_kv_heads * c.head_dim;
  SPX_ASSIGN_OR_RETURN(shard->wq, row_slice("retrieval head wq", head->wq, rank * qd, qd));
  SPX_ASSIGN_OR_RETURN(shard->wk, row_slice("retrieval head wk", head->wk, rank * kd, kd));
  shard->kept_parameters = head->fc.rows * head->fc.cols + static_cast<int64_t>(head->input_norm.size()) +
                           static_cast<int64_t>(head->hidden_norm.size()) + (qd + kd) * in;
  shard->storage.push_back(std::shared_ptr<const void>(head));
  return std::shared_ptr<const RetrievalHead>(std::move(shard));
}

}  // namespace specontext
