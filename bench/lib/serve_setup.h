// The model a server benchmark serves: what the engine options name, with the synthetic
// tokenizer (prompts are token ids) when the weights are synthetic.
#pragma once

#include "bin/engine_setup.h"
#include "core/synthetic.h"

namespace specontext::bench {

inline Result<cli::LoadedModel> load_served_model(const cli::EngineArgs& args) {
  SPX_ASSIGN_OR_RETURN(cli::LoadedModel loaded, cli::load_model_and_tokenizer(args));
  if (!loaded.tokenizer) {
    loaded.tokenizer = make_synthetic_tokenizer(static_cast<int32_t>(loaded.model->config.vocab_size));
  }
  return loaded;
}

}  // namespace specontext::bench
