// Subcommands of the specontext CLI. Each returns the process exit code and prints errors
// (naming the file and field) to stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bin/options.h"
#include "core/base/status.h"
#include "core/model/model.h"

namespace specontext::cli {

struct GenerateArgs {
  EngineArgs engine;
  std::string prompt;
  std::string prompt_file;
  std::string system_prompt;
  int64_t n = 256;
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  bool chat = false;
  bool json = false;
  int64_t synthetic_context = 0;
  int64_t batch = 1;
  int64_t prompt_tokens = 16;  // synthetic prompts: random ids
  std::string response_format = "text";  // or "json_object" (serving/structured/json_constraint.h)
  std::string json_schema_path;           // --json-schema FILE (serving/structured/json_schema.h)
};
void register_generate(CLI::App& app, GenerateArgs& args);
int run_generate(const GenerateArgs& args);

struct InspectArgs {
  std::string path;
  bool json = false;
  std::string dtype = "auto";  // --dtype, as generate's: what the weights are held as
};
// {"bytes": N, "types": {"q4_k": 22, ...}, "text": "..."}: the big matrices as `m` holds them.
nlohmann::json weights_held_json(const Model& m);
void register_inspect(CLI::App& app, InspectArgs& args);
int run_inspect(const InspectArgs& args);

struct PlanArgs {
  ModelArgs model;
  std::string hbm;
  std::string host;          // SIZE[,SIZE per NUMA node]
  std::string remote;        // SIZE[,SIZE per remote node]
  std::string host_bw;       // GB/s per NUMA node to the device
  std::string remote_bw;     // GB/s per remote node
  double host_to_host_bw = 0;  // GB/s across NUMA nodes
  int64_t requests = 0;
  int64_t budget = 0;
  int64_t seq = -1;
  std::string kv_dtype = "bf16";
  std::string head_size;     // overrides the computed retrieval-head bytes M_D
  double runtime_factor = 1.3;
  int64_t shortlist = 0;
  bool json = false;
};
void register_plan(CLI::App& app, PlanArgs& args);
int run_plan(const PlanArgs& args);

struct DistillArgs {
  std::string model_path;
  std::string tokenizer;
  std::vector<std::string> corpus;  // one or more training texts
  std::string heldout;       // default: each corpus's last stories holding 20% of its tokens
  int64_t corpus_tokens = 0;  // > 0: only the first N tokens of each corpus (before the split)
  std::string train = "fc,norms,qk";  // parameter groups distillation updates
  std::string teacher = "max";        // GQA group reduction of the teacher: max or mean
  int64_t exclude_sinks = 1;          // keys the loss leaves out: the first N and the last N,
  int64_t exclude_window = 4;         // which selection keeps anyway (SelectionOptions' defaults)
  std::string position_weight = "uniform";  // uniform, or far: by the teacher mass on the ranked keys
  double weight_floor = 0.1;                // added to every weight under far
  std::string group_loss = "each";          // each query head alone, the group's max, or mix (research/distill.h)
  double group_mix = 0.5;                   // mix: the max term's weight
  int64_t q_per_group = 0;                  // the head's query heads per KV head (0 = the target's)
  std::string out;
  int64_t steps = 800;
  double lr = 5e-3;
  int64_t context = 0;       // tokens per chunk (0 = the model's max_seq_len)
  int64_t batch = 128;       // query positions per step
  uint64_t seed = 1;
  int threads = 0;
  bool json = false;
};
void register_distill(CLI::App& app, DistillArgs& args);
int run_distill(const DistillArgs& args);

struct EvalArgs {
  ModelArgs model;
  std::string tokenizer;
  std::string text;               // evaluation text file
  int64_t synthetic_text = 0;     // >0: random tokens instead of --text
  int64_t context = 0;            // 0 = the model's max context
  int64_t positions = 64;
  std::vector<int64_t> budgets;   // empty = 16,32,64,128
  std::vector<std::string> methods;  // empty = all five
  int64_t sinks = 1;
  int64_t window = 4;
  int64_t quest_page = 16;
  int64_t divergence_tokens = 32;
  int64_t needles = 4;            // passkey trials per depth
  std::string head_path;          // default: retrieval_head.safetensors beside the model
  std::string head_groups;        // --head-groups max | turns; default: the head's select_group
  uint64_t seed = 1;
  std::string json_out;
  bool plot = false;
  int threads = 0;
  // Long-context task suite (research/eval_tasks.h): tasks.json, default the one beside the model.
  std::string tasks;
  std::vector<int64_t> task_lengths;     // empty = 1024,2048,4096,8192 (those that fit)
  std::vector<double> task_depths;       // empty = 0,0.25,0.5,0.75,1
  std::vector<std::string> task_kinds;   // empty = all
  int64_t task_trials = 2;
  std::string task_prompts_out;          // JSONL of the prompts' tokens (task_prompts_to_jsonl)
  bool no_fidelity = false;              // tasks only
  bool no_tasks = false;                 // fidelity only
};
void register_eval(CLI::App& app, EvalArgs& args);
int run_eval(const EvalArgs& args);

struct KvNodeArgs {
  std::string listen = "127.0.0.1:0";
  std::string capacity;
  std::string name;
  std::string secret_file;   // else SPECONTEXT_KV_SECRET; none: loopback only
  std::string keys_file;      // per-client ID SECRET QUOTA lines; else SPECONTEXT_KV_KEYS_FILE
  std::string tls_cert_file;  // TLS of the control plane: certificate chain and key (PEM)
  std::string tls_key_file;
  std::string client_quota;  // SIZE the shared secret's client may hold ("": up to the capacity)
  int64_t max_connections = 64;
  int64_t idle_timeout_ms = 60000;
};
void register_kv_node(CLI::App& app, KvNodeArgs& args);
int run_kv_node(const KvNodeArgs& args);

struct ServeArgs {
  EngineArgs engine;
  std::string listen = "127.0.0.1:8000";
  std::string model_name;
  int64_t max_batch = 8;
  int64_t prefix_cache_slots = 16;  // engine sequence slots beyond max_batch for cached sequences
  int64_t max_batch_tokens = 2048;
  int64_t max_waiting = 256;
  double drain_seconds = 30;
  ApiKeyArgs api_key;  // --api-key-file, else SPECONTEXT_API_KEY
  int64_t max_connections = 1024;     // 0 = no limit
  int64_t max_connections_per_ip = 256;  // 0 = no limit
  double header_timeout = 10;            // seconds
  double idle_timeout = 15;              // seconds
  int64_t request_workers = 2;
  int64_t request_queue = 64;
  int64_t max_prompt_bytes = 0;  // 0 = 32 bytes per token of the context
  std::string tls_cert;          // --tls-cert with --tls-key: HTTPS; none: plain HTTP
  std::string tls_key;
};
void register_serve(CLI::App& app, ServeArgs& args);
int run_serve(const ServeArgs& args);

struct RouterArgs {
  std::vector<std::string> replicas;  // --replica http://HOST:PORT (repeatable)
  std::string policy = "rr";          // rr | least-load | prefix
  std::string host = "127.0.0.1";
  int64_t port = 8080;  // 0: any free port (printed at start)
  int64_t chunk_bytes = 64;
  double match_ratio = 0.5;
  int64_t balance_threshold = 8;
  double health_interval = 1;  // seconds
  double connect_timeout = 2;  // seconds
  double upstream_timeout = 600;
  int64_t max_connections = 1024;
  int64_t max_body_bytes = 4 << 20;
  ApiKeyArgs api_key;
  std::string tls_cert;
  std::string tls_key;
};
void register_router(CLI::App& app, RouterArgs& args);
int run_router(const RouterArgs& args);

}  // namespace specontext::cli
