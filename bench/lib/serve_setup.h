// The model a server benchmark serves: the engine options (synthetic llama-3.2-1b, 4 layers,
// unless --model names weights), with the synthetic tokenizer (prompts are token ids) when the
// weights are synthetic.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

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

// What the report calls the model.
inline std::string served_model_name(const runtime::EngineArgs& args) {
  return args.model.model_path.empty() ? args.model.synthetic : args.model.model_path;
}

}  // namespace specontext::bench
