// Finds the tokenizer that belongs to a model. Kept apart from the loaders so that code using
// only model loading does not pull in the tokenizer implementations.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/model/gguf.h"
#include "core/model/loader_internal.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"

namespace specontext {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool has_gguf_magic(const std::string& path) {
  auto f = MappedFile::open(path);
  return f.is_ok() && (*f)->size() >= 4 && std::memcmp((*f)->data(), "GGUF", 4) == 0;
}

// tokenizer.bin, else the first tok*.bin (sorted, so the choice is stable); empty if none.
std::string find_llama2c_tokenizer(const std::string& dir) {
  if (loader_internal::is_regular_file(dir + "/tokenizer.bin")) return dir + "/tokenizer.bin";
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("tok", 0) == 0 && ends_with(name, ".bin") && e.is_regular_file(ec)) {
      found.push_back(e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  return found.empty() ? std::string() : found.front();
}

std::string parent_dir(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string parent = p.has_parent_path() ? p.parent_path().string() : ".";
  return parent.empty() ? "." : parent;
}

Result<std::unique_ptr<Tokenizer>> load_gguf_vocab(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<GgufFile> g, GgufFile::open(path));
  return load_gguf_tokenizer(*g);
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_tokenizer_for(const Model& model,
                                                      const std::string& explicit_path) {
  const auto vocab = static_cast<int32_t>(model.config.vocab_size);
  if (!explicit_path.empty()) {
    if (ends_with(explicit_path, ".json")) return load_hf_tokenizer(explicit_path);
    if (has_gguf_magic(explicit_path)) return load_gguf_vocab(explicit_path);
    return load_llama2c_tokenizer(explicit_path, vocab);
  }
  if (model.format == "gguf") return load_gguf_vocab(model.source);
  if (model.format == "safetensors") {
    const std::string& dir = model.source;
    if (loader_internal::is_regular_file(dir + "/tokenizer.json")) {
      return load_hf_tokenizer(dir + "/tokenizer.json");
    }
    // Small llama2.c-derived HF copies ship without tokenizer.json; use the llama2.c vocabulary
    // next to them or one level up.
    for (const std::string& d : {dir, parent_dir(dir)}) {
      const std::string tok = find_llama2c_tokenizer(d);
      if (!tok.empty()) return load_llama2c_tokenizer(tok, vocab);
    }
    return not_found(dir +
                     ": no tokenizer.json, tokenizer.bin or tok*.bin here or in the parent "
                     "directory; pass the tokenizer explicitly");
  }
  if (model.format == "llama2c") {
    const std::string dir = parent_dir(model.source);
    const std::string tok = find_llama2c_tokenizer(dir);
    if (!tok.empty()) return load_llama2c_tokenizer(tok, vocab);
    return not_found(model.source + ": no tokenizer.bin or tok*.bin in " + dir +
                     "; pass the tokenizer explicitly");
  }
  return not_found(model.source + ": model format \"" + model.format +
                   "\" has no associated tokenizer; pass one explicitly");
}

}  // namespace specontext
