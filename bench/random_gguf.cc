// Writes a GGUF file with random weights and the shapes of a synthetic model (core/model/
// synthetic.h), every big matrix in one type, for decode benchmarks on quantised files (issue
// #30: "a Llama-3.2-1B body cut to 4 layers, random weights, the stories260K vocabulary"):
//
//   bench_random_gguf --synthetic llama-3.2-1b --layers 4 --vocab 512 --type q4_k --out q4_k.gguf
//
// The file has no tokenizer: run it with `--tokenizer models/stories260K/tok512.bin` (vocab 512).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

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
  app.add_option("--type", type, "matrix type: f32, q8_0, q4_0, q4_k, q5_k, q6_k")
      ->check(CLI::IsMember({"f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"}))
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
  const Status s = write_random_gguf(out, *config, *dtype_from_name(type), seed);
  if (!s.is_ok()) {
    std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
    return 1;
  }
  return 0;
}
