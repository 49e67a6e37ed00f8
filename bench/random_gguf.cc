// Writes a GGUF file with random weights and the shapes of a synthetic model (core/model/
// synthetic.h), every big matrix in one type, or mixed per tensor as llama.cpp's quantizer mixes
// Q4_K_M / Q5_K_M files (core/model/random_gguf.h), for decode benchmarks on quantised files
// (issue #30: "a Llama-3.2-1B body cut to 4 layers, random weights, the stories260K vocabulary"):
//
//   bench_random_gguf --synthetic llama-3.2-1b --layers 4 --vocab 512 --type q4_k --out q4_k.gguf
//   bench_random_gguf --synthetic llama-3.2-1b --layers 4 --vocab 512 --type q4_k_m --out q4_k_m.gguf
//
// Prints the matrices per type on stderr.
// The file has no tokenizer: run it with `--tokenizer models/stories260K/tok512.bin` (vocab 512).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>

#include "core/model/random_gguf.h"
#include "core/model/synthetic.h"

int main(int argc, char** argv) {
  using namespace specontext;
  CLI::App app{"write a random-weight GGUF file"};
  std::string synthetic = "llama-3.2-1b", type = "q8_0", out;
  int64_t layers = 4, vocab = 512;
  uint64_t seed = 1;
  app.add_option("--synthetic", synthetic, "shapes of this synthetic model")->capture_default_str();
  app.add_option("--layers", layers, "cut the depth to N layers (0: all)")->capture_default_str();
  app.add_option("--vocab", vocab, "vocabulary size (0: the model's)")->capture_default_str();
  app.add_option("--type", type, "matrix type: f32, q8_0, q4_0, q4_k, q5_k, q6_k, or a llama.cpp mix: q4_k_m, q5_k_m")
      ->check(CLI::IsMember({"f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m"}))
      ->capture_default_str();
  app.add_option("--seed", seed, "weight seed")->capture_default_str();
  app.add_option("--out", out, "output path")->required();
  CLI11_PARSE(app, argc, argv);
  auto config = synthetic_config(synthetic);
  if (!config.is_ok()) {
    std::fprintf(stderr, "error: %s\n", config.status().to_string().c_str());
    return 1;
  }
  if (layers > 0) config->n_layers = std::min(layers, config->n_layers);
  if (vocab > 0) {
    config->vocab_size = vocab;
    config->bos_token_id = 1;
    config->eos_token_id = 2;
  }
  config->rope_scaling = {};  // the GGUF carries no rope scaling keys
  const std::optional<GgufMix> mix = gguf_mix_from_name(type);
  const Status s = mix ? write_random_gguf_mix(out, *config, *mix, seed)
                       : write_random_gguf(out, *config, *dtype_from_name(type), seed);
  if (!s.is_ok()) {
    std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
    return 1;
  }
  std::map<std::string, int> per_type;
  auto count = [&](const std::string& name) {
    ++per_type[std::string(dtype_name(mix ? gguf_mix_tensor_type(*mix, *config, name) : *dtype_from_name(type)))];
  };
  count("token_embd.weight");
  for (int64_t l = 0; l < config->n_layers; ++l) {
    for (const char* m : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}) {
      count("blk." + std::to_string(l) + "." + m + ".weight");
    }
  }
  if (!config->tie_embeddings) count("output.weight");
  std::fprintf(stderr, "%s: %s, matrices", out.c_str(), type.c_str());
  for (const auto& [t, n] : per_type) std::fprintf(stderr, " %s %d", t.c_str(), n);
  if (mix) std::fprintf(stderr, ", general.file_type %u", gguf_mix_file_type(*mix));
  std::fprintf(stderr, "\n");
  return 0;
}
