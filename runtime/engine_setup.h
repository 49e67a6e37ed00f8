// The model, tokenizer, retrieval head, backend, KV tiers and engine that `generate` and `serve`
// build from the same command-line options.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/base/status.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer.h"
#include "runtime/tier_setup.h"
#include "serving/scheduler.h"

namespace specontext::runtime {

// Where the model comes from: a path or a synthetic shape.
struct ModelArgs {
  std::string model_path;
  std::string synthetic;
  int64_t layers = 0;
  std::string dtype = "auto";  // --dtype: auto, f32, bf16 (weights in memory)
  uint64_t weight_seed = 1;
};
Result<std::shared_ptr<Model>> load_model_from_args(const ModelArgs& args);
// --dtype's load policy: "auto" keeps GGUF Q8_0/Q4_0/Q4_K/Q5_K/Q6_K matrices as stored (the engine
// dequantises them for a backend that cannot run them), "f32" / "bf16" convert every matrix.
LoadOptions load_options_for_dtype(const std::string& dtype);

struct EngineArgs {
  ModelArgs model;
  std::string tokenizer;
  int64_t page_size = 16;
  int64_t prefill_chunk = 256;
  std::string admission = "reserve";  // "reserve" or "preempt" (AdmissionPolicy); serve: preempt
  bool prefix_caching = false;        // --prefix-caching (GeneratorOptions::prefix_caching); serve: on
  std::string preemption_mode = "swap";  // or "recompute" (GeneratorOptions::swap_preempted)
  std::string prefix_offload = "0";   // --prefix-offload SIZE (GeneratorOptions::prefix_offload_bytes)
  std::string prefix_disk = "0";      // --prefix-offload-disk SIZE (GeneratorOptions::prefix_disk_bytes)
  std::string prefix_disk_dir;        // --prefix-offload-dir DIR (GeneratorOptions::prefix_disk_dir)
  bool prefix_disk_persist = false;   // --prefix-offload-persist (GeneratorOptions::prefix_disk_persist)
  std::string
      prefix_remote;  // --prefix-offload-remote SIZE@HOST:PORT[+...] (GeneratorOptions::prefix_blob_store)
  std::string lost_tier = "recompute";  // "recompute" or "fail" (GeneratorOptions::recompute_lost_tiers)
  // --prefix-store redis://[USER@]HOST:PORT[/DB] (GeneratorOptions::prefix_shared_store) and its
  // password file (else SPECONTEXT_PREFIX_STORE_PASSWORD), TTL, timeout and value bound.
  std::string prefix_store;
  std::string prefix_store_password_file;
  int64_t prefix_store_ttl_s = 3600;
  int64_t prefix_store_timeout_ms = 2000;
  std::string prefix_store_max_value = "512MiB";
  // --prefix-store-chunk TOKENS (GeneratorOptions::prefix_shared_chunk_tokens)
  int64_t prefix_store_chunk = 256;
  int64_t max_context = 0;
  int threads = 0;
  bool reference = false;
  std::string sparse;     // "" = specontext when a retrieval head is found, else dense
  std::string head_path;  // retrieval head (default: retrieval_head.safetensors beside the model)
  int64_t budget = 0;     // 0 = 2048, or the model's max context / 8 when smaller (at least 32)
  int64_t sinks = 1;
  int64_t window = 4;
  std::string backend = "cpu";   // cpu | cuda (falls back to cpu without a device)
  std::string kv_dtype = "f32";  // f32 | f16 | bf16: the KV cache's element type
  TierArgs tiers;
};

// The scheduler's options from --prefill-chunk, --admission, --preemption-mode, --prefix-caching,
// --prefix-offload, --prefix-offload-disk, --prefix-offload-dir, --prefix-store and --lost-tier;
// kInvalidArgument naming the flag when they do not go together. With --prefix-store it connects to
// the store (an unreachable one, a refused password or cluster mode is an error here).
Result<GeneratorOptions> scheduling_options(const EngineArgs& args);

struct LoadedModel {
  std::shared_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;  // null for synthetic models
  bool synthetic = false;
};
Result<LoadedModel> load_model_and_tokenizer(const EngineArgs& args);

// The chat template the model's family uses (kNone when unknown).
ChatTemplate chat_template_for(const Model& model, const Tokenizer& tokenizer);
// The tokenizer's stop ids; llama2.c models separate documents with BOS, so a BOS mid-generation
// ends the text (as run.c).
std::vector<TokenId> generation_stop_ids(const Tokenizer& tokenizer);

struct EngineBundle {
  std::unique_ptr<TierRuntime> tiers;  // declared before the engine: outlives it
  std::unique_ptr<Engine> engine;
  EngineOptions options;
  std::string method_name;  // "specontext", "dense", ...
  SparseMethod method = SparseMethod::kDense;
  std::string head_note;  // where the retrieval head came from ("" = none)
};
// max_context: 0 = the model's; final_lengths: the lengths a static placement plans for.
// `quiet`: no notes on stderr (JSON output). waiting_slots: sequence slots beyond max_sequences
// for sequences that wait (EngineOptions::max_running = max_sequences when > 0).
Result<EngineBundle> build_engine(const EngineArgs& args, const LoadedModel& loaded, int64_t max_sequences,
                                  int64_t max_context, const std::vector<int64_t>& final_lengths, bool quiet,
                                  int64_t waiting_slots = 0);

}  // namespace specontext::runtime
