// Format detection: an HF directory, a GGUF file (by magic), or a llama2.c checkpoint.
#include "core/model/model_loader.h"

#include <sys/stat.h>

#include <cstring>

#include "core/base/mapped_file.h"
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

}  // namespace specontext
