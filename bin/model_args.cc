#include <filesystem>

#include "bin/commands.h"
#include "core/model_loader.h"
#include "core/synthetic.h"

namespace specontext::cli {

void add_model_options(CLI::App& cmd, ModelArgs& args) {
  auto* model = cmd.add_option("--model,-m", args.model_path,
                               "model: llama2.c .bin, .gguf, or a Hugging Face directory");
  auto* synth = cmd.add_option("--synthetic", args.synthetic,
                               "random weights with the shapes of a named model (llama-3.2-1b, "
                               "llama-3.1-8b, qwen3-8b, toy): measures speed, not quality");
  model->excludes(synth);
  cmd.add_option("--layers", args.layers, "with --synthetic: cut the depth to N layers");
  cmd.add_option("--dtype", args.dtype, "with --synthetic: weight dtype (f32, bf16)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd.add_option("--weight-seed", args.weight_seed, "with --synthetic: seed of the random weights");
}

Result<std::shared_ptr<Model>> load_model_from_args(const ModelArgs& args) {
  if (!args.synthetic.empty()) {
    return make_synthetic_model(args.synthetic, args.layers,
                                args.dtype == "bf16" ? DType::kBF16 : DType::kF32, args.weight_seed);
  }
  if (args.model_path.empty()) return invalid_argument("give --model PATH or --synthetic NAME");
  return load_model(args.model_path);
}

}  // namespace specontext::cli
