// The command-line flags of the engine, the model and the KV tiers (CLI11), filling the typed
// options that runtime/ assembles an engine from. Shared by the subcommands and the benchmarks.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "runtime/engine_setup.h"
#include "runtime/tier_setup.h"

namespace specontext::cli {

// The typed options and the assembly live in runtime/; the CLI fills them.
using namespace specontext::runtime;

// --model/--synthetic, --layers, --dtype, --weight-seed.
void add_model_options(CLI::App& cmd, ModelArgs& args);
// --model/--synthetic, --tokenizer, the sparse, backend, KV and tier options.
void add_engine_options(CLI::App& cmd, EngineArgs& args);
// --device-kv, --host-kv, --remote-kv, --kv-node and the other tier flags.
void add_tier_options(CLI::App& cmd, TierArgs& args);

// The keys HTTP clients must send (serve, router): --api-key-file FILE, else SPECONTEXT_API_KEY.
struct ApiKeyArgs {
  std::string file;
  std::vector<std::string> inline_keys;  // a hidden --api-key KEY, refused: ps shows it to everyone
};
void add_api_key_options(CLI::App& cmd, ApiKeyArgs& args, const std::string& help);
// The keys (serving/openai load_api_keys), or kInvalidArgument naming the flag.
Result<std::vector<std::string>> api_keys_of(const ApiKeyArgs& args);

}  // namespace specontext::cli
