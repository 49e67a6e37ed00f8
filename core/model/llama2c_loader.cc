// llama2.c checkpoints (legacy "v0" export): a 7 x int32 header followed by f32 tensors.
// The weights are used in place from the memory map.
#include <cstring>

#include "core/base/mapped_file.h"
#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"

namespace specontext {

namespace {

struct Llama2cHeader {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

std::string header_string(const Llama2cHeader& h) {
  return "dim=" + std::to_string(h.dim) + " hidden_dim=" + std::to_string(h.hidden_dim) +
         " n_layers=" + std::to_string(h.n_layers) + " n_heads=" + std::to_string(h.n_heads) +
         " n_kv_heads=" + std::to_string(h.n_kv_heads) +
         " vocab_size=" + std::to_string(h.vocab_size) + " seq_len=" + std::to_string(h.seq_len);
}

Status check_field(const std::string& path, const char* field, int64_t v) {
  if (v <= 0) {
    return invalid_argument(path + ": header field " + field + " = " + std::to_string(v) +
                            " must be positive (not a llama2.c checkpoint?)");
  }
  return Status::ok();
}

// Walks the f32 payload in file order.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t offset) : base_(base), off_(offset) {}
  const float* take(int64_t n_floats) {
    const float* p = reinterpret_cast<const float*>(base_ + off_);
    off_ += static_cast<size_t>(n_floats) * sizeof(float);
    return p;
  }
  void skip(int64_t n_floats) { off_ += static_cast<size_t>(n_floats) * sizeof(float); }

 private:
  const uint8_t* base_;
  size_t off_;
};

}  // namespace

Result<std::shared_ptr<Model>> load_llama2c_model(const std::string& path,
                                                  const LoadOptions& opts) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> map, MappedFile::open(path));
  Llama2cHeader h{};
  if (map->size() < sizeof(h)) {
    return data_loss(path + ": truncated: file has " + std::to_string(map->size()) +
                     " bytes, the llama2.c header needs " + std::to_string(sizeof(h)));
  }
  std::memcpy(&h, map->data(), sizeof(h));
  SPX_RETURN_IF_ERROR(check_field(path, "dim", h.dim));
  SPX_RETURN_IF_ERROR(check_field(path, "hidden_dim", h.hidden_dim));
  SPX_RETURN_IF_ERROR(check_field(path, "n_layers", h.n_layers));
  SPX_RETURN_IF_ERROR(check_field(path, "n_heads", h.n_heads));
  SPX_RETURN_IF_ERROR(check_field(path, "n_kv_heads", h.n_kv_heads));
  SPX_RETURN_IF_ERROR(check_field(path, "seq_len", h.seq_len));
  if (h.vocab_size == 0 || h.vocab_size == INT32_MIN) {
    return invalid_argument(path + ": header field vocab_size = " + std::to_string(h.vocab_size) +
                            " is invalid");
  }
  if (h.dim % h.n_heads != 0) {
    return invalid_argument(path + ": header field dim = " + std::to_string(h.dim) +
                            " is not a multiple of n_heads = " + std::to_string(h.n_heads));
  }
  if (h.n_kv_heads > h.n_heads || h.n_heads % h.n_kv_heads != 0) {
    return invalid_argument(path + ": header field n_kv_heads = " + std::to_string(h.n_kv_heads) +
                            " does not divide n_heads = " + std::to_string(h.n_heads));
  }

  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = h.dim;
  c.hidden_dim = h.hidden_dim;
  c.n_layers = h.n_layers;
  c.n_heads = h.n_heads;
  c.n_kv_heads = h.n_kv_heads;
  c.head_dim = h.dim / h.n_heads;
  c.vocab_size = h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size;
  c.max_seq_len = h.seq_len;
  c.rope_theta = 10000.0;
  c.rope_style = RopeStyle::kInterleaved;  // llama2.c rotates (2i, 2i+1) pairs
  c.norm_eps = 1e-5f;
  c.tie_embeddings = h.vocab_size > 0;         // a negative vocab_size flags a separate classifier
  c.bos_token_id = c.vocab_size > 1 ? 1 : -1;  // the llama2.c tokenizer's <s> and </s>
  c.eos_token_id = c.vocab_size > 2 ? 2 : -1;
  SPX_RETURN_IF_ERROR(c.validate(path));

  // Expected size in floats; every factor is bounded by validate(), so int64 cannot overflow.
  const int64_t dim = c.dim, hid = c.hidden_dim, L = c.n_layers, kv = c.kv_dim();
  const int64_t hs = c.head_dim;
  const int64_t shared = c.vocab_size * dim + L * dim + L * dim * dim + 2 * L * kv * dim +
                         L * dim * dim + L * dim + 3 * L * hid * dim + dim +
                         c.max_seq_len * (hs / 2) * 2;
  const int64_t n_floats = shared + (c.tie_embeddings ? 0 : c.vocab_size * dim);
  const uint64_t expected = sizeof(h) + static_cast<uint64_t>(n_floats) * sizeof(float);
  if (map->size() != expected) {
    const bool short_file = map->size() < expected;
    const std::string msg = path + (short_file ? ": truncated" : ": size mismatch") +
                            ": header says " + header_string(h) + ", expects " +
                            std::to_string(expected) + " bytes, file has " +
                            std::to_string(map->size());
    return short_file ? data_loss(msg) : invalid_argument(msg);
  }

  auto model = std::make_shared<Model>();
  model->config = c;
  model->source = path;
  model->format = "llama2c";
  model->storage.push_back(map);
  Cursor cur(map->data(), sizeof(h));
  auto mat = [&](const float* p, int64_t rows, int64_t cols,
                 const std::string& what) -> Result<WeightMatrix> {
    return loader_internal::make_matrix(model.get(), DType::kF32, p, rows, cols, opts,
                                        path + ": " + what);
  };
  auto vec = [](const float* p, int64_t n) { return Vec(p, p + n); };

  SPX_ASSIGN_OR_RETURN(model->tok_embeddings,
                       mat(cur.take(c.vocab_size * dim), c.vocab_size, dim, "token_embedding"));
  model->layers.resize(static_cast<size_t>(L));
  // llama2.c stores each weight kind for all layers contiguously: [L, ...].
  for (auto& l : model->layers) l.attn_norm = vec(cur.take(dim), dim);
  for (int64_t i = 0; i < L; ++i) {
    SPX_ASSIGN_OR_RETURN(model->layers[i].wq, mat(cur.take(dim * dim), dim, dim, "wq"));
  }
  for (int64_t i = 0; i < L; ++i) {
    SPX_ASSIGN_OR_RETURN(model->layers[i].wk, mat(cur.take(kv * dim), kv, dim, "wk"));
  }
  for (int64_t i = 0; i < L; ++i) {
    SPX_ASSIGN_OR_RETURN(model->layers[i].wv, mat(cur.take(kv * dim), kv, dim, "wv"));
  }
  for (int64_t i = 0; i < L; ++i) {
    SPX_ASSIGN_OR_RETURN(model->layers[i].wo, mat(cur.take(dim * dim), dim, dim, "wo"));
  }
  for (auto& l : model->layers) l.ffn_norm = vec(cur.take(dim), dim);
  for (int64_t i = 0; i < L; ++i) {  // w1 = gate
    SPX_ASSIGN_OR_RETURN(model->layers[i].w_gate, mat(cur.take(hid * dim), hid, dim, "w1"));
  }
  for (int64_t i = 0; i < L; ++i) {  // w2 = down
    SPX_ASSIGN_OR_RETURN(model->layers[i].w_down, mat(cur.take(dim * hid), dim, hid, "w2"));
  }
  for (int64_t i = 0; i < L; ++i) {  // w3 = up
    SPX_ASSIGN_OR_RETURN(model->layers[i].w_up, mat(cur.take(hid * dim), hid, dim, "w3"));
  }
  model->final_norm = vec(cur.take(dim), dim);
  cur.skip(c.max_seq_len * (hs / 2) * 2);  // freq_cis_real/imag: recomputed by the engine
  if (c.tie_embeddings) {
    model->lm_head = model->tok_embeddings;
  } else {
    SPX_ASSIGN_OR_RETURN(model->lm_head,
                         mat(cur.take(c.vocab_size * dim), c.vocab_size, dim, "wcls"));
  }
  loader_internal::unify_weight_dtype(model.get());  // f32, or bf16 with LoadOptions::force_bf16
  SPX_RETURN_IF_ERROR(model->validate());
  return model;
}

}  // namespace specontext
