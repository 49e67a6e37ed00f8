// The command-line flags of the engine, the model and the KV tiers (CLI11), filling the typed
// options that runtime/ assembles an engine from. Shared by the subcommands and the benchmarks.
#pragma once

#include <CLI/CLI.hpp>

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

}  // namespace specontext::cli
