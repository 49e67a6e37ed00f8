#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "bin/commands.h"
#include "core/model/model_loader.h"
#include "runtime/engine_setup.h"

namespace specontext::cli {

void register_inspect(CLI::App& app, InspectArgs& args) {
  auto* cmd = app.add_subcommand("inspect", "print a model's architecture, size and KV footprint");
  cmd->add_option("path", args.path, "model file or directory")->required();
  cmd->add_flag("--json", args.json, "print one JSON object");
  cmd->add_option("--dtype", args.dtype,
                  "load the weights as generate --dtype would (auto: GGUF block types kept as stored, "
                  "as the CPU backend holds them; f32; bf16)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
}

nlohmann::json weights_held_json(const Model& m) {
  std::map<std::string, int64_t> types;
  for (const auto& [dtype, count] : m.held_types()) types[std::string(dtype_name(dtype))] = count;
  return {{"bytes", m.weight_bytes()}, {"types", types}, {"text", m.weights_held_text()}};
}

int run_inspect(const InspectArgs& args) {
  auto model = load_model(args.path, runtime::load_options_for_dtype(args.dtype));
  if (!model.is_ok()) {
    std::fprintf(stderr, "error: %s\n", model.status().to_string().c_str());
    return 1;
  }
  const Model& m = **model;
  const ModelConfig& c = m.config;
  nlohmann::json j = {
      {"path", args.path},
      {"format", m.format},
      {"architecture", std::string(architecture_name(c.arch))},
      {"parameters", m.parameter_count()},
      {"dtype", std::string(dtype_name(m.weight_dtype))},
      {"layers", c.n_layers},
      {"hidden_size", c.dim},
      {"intermediate_size", c.hidden_dim},
      {"heads", c.n_heads},
      {"kv_heads", c.n_kv_heads},
      {"head_dim", c.head_dim},
      {"vocab_size", c.vocab_size},
      {"max_context", c.max_seq_len},
      {"rope_theta", c.rope_theta},
      {"tied_embeddings", c.tie_embeddings},
      // The CPU backend keeps KV in f32; the dtype-sized figure is what a bf16 cache needs.
      {"kv_bytes_per_token", c.kv_bytes_per_token(4)},
      {"kv_bytes_per_token_bf16", c.kv_bytes_per_token(2)},
  };
  // A GGUF's matrix types as stored in the file ({"Q4_K": 96, ...}); "weights_held" is what
  // memory holds after loading with --dtype ("dtype" above: the matrices not of a block type).
  if (!m.stored_types.empty()) j["stored_types"] = m.stored_types;
  j["weights_held"] = weights_held_json(m);
  if (!c.rope_freq_factors.empty()) j["rope_freq_factors"] = c.rope_freq_factors.size();
  if (args.json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("path               %s (%s)\n", args.path.c_str(), m.format.c_str());
  std::printf("architecture       %s\n", std::string(architecture_name(c.arch)).c_str());
  std::printf("parameters         %lld\n", static_cast<long long>(m.parameter_count()));
  std::printf("dtype              %s\n", std::string(dtype_name(m.weight_dtype)).c_str());
  if (!m.stored_types.empty()) {
    std::string stored;
    for (const auto& [type, count] : m.stored_types) {
      stored += (stored.empty() ? "" : ", ") + type + " x" + std::to_string(count);
    }
    std::printf("stored as          %s (matrices in the file)\n", stored.c_str());
  }
  std::printf("weights held       %s (--dtype %s)\n", m.weights_held_text().c_str(), args.dtype.c_str());
  std::printf("layers             %lld (hidden %lld, mlp %lld)\n", static_cast<long long>(c.n_layers),
              static_cast<long long>(c.dim), static_cast<long long>(c.hidden_dim));
  std::printf("heads              %lld query, %lld kv, head_dim %lld\n", static_cast<long long>(c.n_heads),
              static_cast<long long>(c.n_kv_heads), static_cast<long long>(c.head_dim));
  std::printf("vocab              %lld\n", static_cast<long long>(c.vocab_size));
  std::printf("max context        %lld tokens\n", static_cast<long long>(c.max_seq_len));
  std::printf("KV bytes / token   %lld (f32 cache), %lld (bf16)\n",
              static_cast<long long>(c.kv_bytes_per_token(4)), static_cast<long long>(c.kv_bytes_per_token(2)));
  return 0;
}

}  // namespace specontext::cli
