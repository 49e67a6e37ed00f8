// The model a server benchmark serves: the engine options (synthetic llama-3.2-1b, 4 layers,
// unless --model names weights), with the synthetic tokenizer (prompts are token ids) when the
// weights are synthetic.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bin/options.h"
#include "core/model/synthetic.h"
#include "core/tokenizer/synthetic_tokenizer.h"

namespace specontext::bench {

inline void add_served_model_options(CLI::App& app, runtime::EngineArgs& args) {
  args.model.synthetic = "llama-3.2-1b";
  args.model.layers = 4;
  cli::add_engine_options(app, args);
}

// After parsing: --model wins over the synthetic default.
inline Result<runtime::LoadedModel> load_served_model(runtime::EngineArgs& args) {
  if (!args.model.model_path.empty()) args.model.synthetic.clear();
  SPX_ASSIGN_OR_RETURN(runtime::LoadedModel loaded, runtime::load_model_and_tokenizer(args));
  if (!loaded.tokenizer) {
    loaded.tokenizer = make_synthetic_tokenizer(static_cast<int32_t>(loaded.model->config.vocab_size));
  }
  return loaded;
}

// The requests and server slots a server benchmark uses (--prompt-len, --max-tokens, --max-batch).
struct ServedShape {
  int64_t prompt_tokens = 64;  // random ids
  int64_t max_tokens = 16;     // generated per request
  int64_t max_batch = 8;       // server sequence slots
};
inline void add_served_shape_options(CLI::App& app, ServedShape& s) {
  app.add_option("--prompt-len", s.prompt_tokens, "prompt tokens (random ids)");
  app.add_option("--max-tokens", s.max_tokens, "tokens generated per request");
  app.add_option("--max-batch", s.max_batch, "server sequence slots");
}

// The model and the engine a server benchmark serves: max_batch sequences of up to
// prompt_tokens + max_tokens (+8) tokens each, planned for that length (quiet: no notes).
struct ServedEngine {
  runtime::LoadedModel loaded;
  runtime::EngineBundle bundle;
};
inline Result<ServedEngine> build_served_engine(runtime::EngineArgs& args, const ServedShape& shape) {
  ServedEngine s;
  SPX_ASSIGN_OR_RETURN(s.loaded, load_served_model(args));
  const int64_t context =
      std::min<int64_t>(s.loaded.model->config.max_seq_len, shape.prompt_tokens + shape.max_tokens + 8);
  SPX_ASSIGN_OR_RETURN(
      s.bundle, runtime::build_engine(args, s.loaded, shape.max_batch, context,
                                      std::vector<int64_t>(static_cast<size_t>(shape.max_batch), context),
                                      /*quiet=*/true));
  return s;
}

// A greedy streaming /v1/completions body of shape.prompt_tokens random ids in [3, vocab) that
// generates shape.max_tokens tokens whatever they are (ignore_eos), with the usage chunk.
inline std::string random_stream_body(std::mt19937& rng, int64_t vocab, const ServedShape& shape) {
  std::uniform_int_distribution<int32_t> id(3, static_cast<int32_t>(vocab) - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(shape.prompt_tokens));
  for (auto& t : prompt) t = id(rng);
  return nlohmann::json{{"prompt", prompt}, {"max_tokens", shape.max_tokens},
                        {"temperature", 0}, {"ignore_eos", true},
                        {"stream", true},   {"stream_options", {{"include_usage", true}}}}
      .dump();
}

// What the report calls the model.
inline std::string served_model_name(const runtime::EngineArgs& args) {
  return args.model.model_path.empty() ? args.model.synthetic : args.model.model_path;
}

}  // namespace specontext::bench
