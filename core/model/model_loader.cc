// Format detection: an HF directory, a GGUF file (by magic), or a llama2.c checkpoint.
#include "core/model/model_loader.h"

#include <sys/stat.h>

#include <cstring>
#include <map>

#include "core/base/mapped_file.h"
#include "core/model/ggml_quants.h"
#include "core/model/loader_internal.h"

namespace specontext {

Result<std::shared_ptr<Model>> load_model(const std::string& path, const LoadOptions& opts) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return not_found(path + ": no such file or directory");
  if (S_ISDIR(st.st_mode)) {
    if (!loader_internal::is_regular_file(path + "/config.json")) {
      return not_found(path + ": directory has no config.json (expected a Hugging Face model)");
    }
    return load_hf_model(path, opts);
  }
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> f, MappedFile::open(path));
  if (f->size() >= 4 && std::memcmp(f->data(), "GGUF", 4) == 0) return load_gguf_model(path, opts);
  return load_llama2c_model(path, opts);
}

Result<std::shared_ptr<const Model>> dequantize_block_matrices(std::shared_ptr<const Model> model, DType to,
                                                               const std::function<bool(DType)>& keep) {
  if (!model) return invalid_argument("dequantize_block_matrices: model is null");
  if (to != DType::kF32 && to != DType::kBF16) {
    return invalid_argument("dequantize_block_matrices: target dtype must be f32 or bf16, not " +
                            std::string(dtype_name(to)));
  }
  bool any = false;
  for (const WeightMatrix* w : model->matrices()) any |= is_block_dtype(w->dtype) && !keep(w->dtype);
  if (!any) return model;
  auto out = std::make_shared<Model>(*model);
  out->storage = {std::shared_ptr<const void>(model)};  // the views left as they are point into it
  const LoadOptions opts{.force_f32 = to == DType::kF32, .force_bf16 = to == DType::kBF16};
  std::map<const void*, WeightMatrix> decoded;  // tied matrices share one copy
  auto decode = [&](WeightMatrix* w, const std::string& name) -> Status {
    if (w->empty() || !is_block_dtype(w->dtype) || keep(w->dtype)) return Status::ok();
    auto it = decoded.find(w->data);
    if (it == decoded.end()) {
      SPX_ASSIGN_OR_RETURN(WeightMatrix d,
                           loader_internal::make_dequantized_matrix(out.get(), *ggml_block_type_id(w->dtype), w->data,
                                                                    w->rows, w->cols, opts, model->source + ": " + name));
      it = decoded.emplace(w->data, d).first;
    }
    *w = it->second;
    return Status::ok();
  };
  SPX_RETURN_IF_ERROR(decode(&out->tok_embeddings, "tok_embeddings"));
  SPX_RETURN_IF_ERROR(decode(&out->lm_head, "lm_head"));
  for (size_t i = 0; i < out->layers.size(); ++i) {
    const char* names[] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
    const auto matrices = out->layers[i].matrices();
    for (size_t j = 0; j < matrices.size(); ++j) {
      SPX_RETURN_IF_ERROR(decode(matrices[j], "layers." + std::to_string(i) + "." + names[j]));
    }
  }
  out->weight_dtype = DType::kF32;
  for (const WeightMatrix* w : out->matrices()) {
    if (w->dtype == DType::kBF16) out->weight_dtype = DType::kBF16;
  }
  return std::shared_ptr<const Model>(std::move(out));
}

}  // namespace specontext
