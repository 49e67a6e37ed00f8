#include "bin/engine_setup.h"

#if SPECONTEXT_HAVE_UCX
#include "cluster/remote_prefix_store.h"
#endif

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/model_loader.h"
#include "planner/units.h"
#include "core/retrieval_head.h"
#include "core/synthetic.h"
#include "cpu/cpu_backend.h"
#if SPECONTEXT_HAVE_CUDA
#include "gpu/cuda_backend.h"
#endif

namespace specontext::cli {

void add_model_options(CLI::App& cmd, ModelArgs& args) {
  auto* model = cmd.add_option("--model,-m", args.model_path,
                               "model: llama2.c .bin, .gguf, or a Hugging Face directory");
  auto* synth = cmd.add_option("--synthetic", args.synthetic,
                               "random weights with the shapes of a named model (llama-3.2-1b, "
                               "llama-3.1-8b, qwen3-8b, toy): measures speed, not quality");
  model->excludes(synth);
  cmd.add_option("--layers", args.layers, "with --synthetic: cut the depth to N layers");
  cmd.add_option("--dtype", args.dtype,
                 "weights in memory: auto (f32 and bf16 as stored, f16 and GGUF block types converted "
                 "to f32; f32 for --synthetic), f32, or bf16 (everything converted or dequantised to "
                 "bf16: half the memory of f32)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  cmd.add_option("--weight-seed", args.weight_seed, "with --synthetic: seed of the random weights");
}

Result<std::shared_ptr<Model>> load_model_from_args(const ModelArgs& args) {
  if (!args.synthetic.empty()) {
    return make_synthetic_model(args.synthetic, args.layers,
                                args.dtype == "bf16" ? DType::kBF16 : DType::kF32, args.weight_seed);
  }
  if (args.model_path.empty()) return invalid_argument("give --model PATH or --synthetic NAME");
  return load_model(args.model_path,
                    LoadOptions{.force_f32 = args.dtype == "f32", .force_bf16 = args.dtype == "bf16"});
}

void add_engine_options(CLI::App& cmd, EngineArgs& a) {
  add_model_options(cmd, a.model);
  cmd.add_option("--tokenizer", a.tokenizer, "tokenizer file (default: found next to the model)");
  cmd.add_option("--page-size", a.page_size, "tokens per KV page")->check(CLI::PositiveNumber);
  cmd.add_option("--kv-dtype", a.kv_dtype,
                 "KV cache element type: f32, f16 or bf16 (attention computes in f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd.add_option("--prefill-chunk", a.prefill_chunk, "prompt tokens per forward")->check(CLI::PositiveNumber);
  cmd.add_option("--admission", a.admission,
                 "reserve: admit a request when its KV at its final length fits beside the others'; "
                 "preempt: admit when its prompt fits, and recompute the newest request when memory runs short")
      ->check(CLI::IsMember({"reserve", "preempt"}))
      ->capture_default_str();
  cmd.add_option("--preemption-mode", a.preemption_mode,
                 "what a preempted request's KV does (--admission preempt): swap: its whole pages go to the "
                 "prefix offload store (--prefix-offload / --prefix-offload-disk) and come back when it runs "
                 "again; recompute: dropped and computed again (also swap's fallback without a store)")
      ->check(CLI::IsMember({"swap", "recompute"}))
      ->capture_default_str();
  cmd.add_flag("--prefix-caching,!--no-prefix-caching", a.prefix_caching,
               "start each request from the longest cached prefix of its prompt (running or finished "
               "requests' KV, in whole pages; finished ones stay cached until memory is wanted)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload", a.prefix_offload,
                 "host memory (SIZE, e.g. 4GiB) that keeps cached prefixes evicted for room, KV of every layer; "
                 "a request whose prompt starts with one has it written back instead of recomputed (0: off; "
                 "needs prefix caching)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload-disk", a.prefix_disk,
                 "disk space (SIZE) for offloaded prefixes that host memory lets go or cannot hold, read back "
                 "when a request wants one (0: off; needs prefix caching)")
      ->capture_default_str();
  cmd.add_option("--prefix-offload-dir", a.prefix_disk_dir,
                 "directory under which the prefix files go, in a directory of their own removed at exit "
                 "unless --prefix-offload-persist (default: the system's temporary directory)");
  cmd.add_flag("--prefix-offload-persist", a.prefix_disk_persist,
               "keep the prefix files across restarts: in DIR/specontext-<model and KV layout hash>, locked "
               "while this process runs; the cached prefixes are written there at exit and found by the next "
               "run (needs --prefix-offload-disk and --prefix-offload-dir)");
  cmd.add_option("--prefix-offload-remote", a.prefix_remote,
                 "KV node memory for offloaded prefixes instead of disk: SIZE@HOST:PORT[+HOST:PORT...] (a "
                 "`specontext kv-node`; mirrored on each endpoint, reads fail over; --kv-node-timeout-ms and "
                 "--kv-node-mode apply; needs prefix caching)");
  cmd.add_option("--lost-tier", a.lost_tier,
                 "when a remote KV tier is lost for good (every replica of a --kv-node tier died): recompute "
                 "every request without it, or fail the requests of that step")
      ->check(CLI::IsMember({"recompute", "fail"}))
      ->capture_default_str();
  cmd.add_option("--max-context", a.max_context, "context limit per sequence (default: the model's)");
  cmd.add_option("--threads", a.threads, "CPU threads (0 = all cores of the NUMA node)");
  cmd.add_flag("--reference", a.reference, "use the naive reference kernels (slow; for checking)");
  cmd.add_option("--sparse", a.sparse,
                 "decode attention: specontext (default when a retrieval head is found), dense, "
                 "streaming, quest, oracle")
      ->check(CLI::IsMember({"dense", "specontext", "streaming", "quest", "oracle"}));
  cmd.add_option("--head", a.head_path, "retrieval head (EAGLE-3 layout safetensors)");
  cmd.add_option("--budget,-B", a.budget, "tokens attended per KV head in sparse decode")
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--sinks", a.sinks, "first tokens always attended")->check(CLI::NonNegativeNumber);
  cmd.add_option("--window", a.window, "most recent tokens always attended")->check(CLI::PositiveNumber);
  cmd.add_option("--backend", a.backend, "cpu, or cuda (falls back to cpu when no CUDA device is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_tier_options(cmd, a.tiers);
}

Result<GeneratorOptions> scheduling_options(const EngineArgs& a) {
  GeneratorOptions g;
  g.prefill_chunk = a.prefill_chunk;
  g.admission = a.admission == "preempt" ? AdmissionPolicy::kPreempt : AdmissionPolicy::kReserve;
  g.prefix_caching = a.prefix_caching;
  g.recompute_lost_tiers = a.lost_tier == "recompute";
  g.swap_preempted = a.preemption_mode == "swap";
  // A size flag that needs prefix caching when not 0.
  const auto cache_bytes = [&](const std::string& flag, const std::string& value) -> Result<uint64_t> {
    auto bytes = planner::parse_size(value);
    if (!bytes.is_ok()) return bytes.status().with_context(flag);
    if (*bytes < 0) return invalid_argument(flag + " must not be negative");
    if (*bytes > 0 && !a.prefix_caching) return invalid_argument(flag + " needs --prefix-caching");
    return static_cast<uint64_t>(*bytes);
  };
  SPX_ASSIGN_OR_RETURN(g.prefix_offload_bytes, cache_bytes("--prefix-offload", a.prefix_offload));
  SPX_ASSIGN_OR_RETURN(g.prefix_disk_bytes, cache_bytes("--prefix-offload-disk", a.prefix_disk));
  if (!a.prefix_disk_dir.empty()) {
    if (g.prefix_disk_bytes == 0) return invalid_argument("--prefix-offload-dir needs --prefix-offload-disk");
    std::error_code ec;
    if (!std::filesystem::is_directory(a.prefix_disk_dir, ec)) {
      return invalid_argument("--prefix-offload-dir " + a.prefix_disk_dir + " is not a directory");
    }
  }
  if (a.prefix_disk_persist && a.prefix_disk_dir.empty()) {
    return invalid_argument(
        "--prefix-offload-persist needs --prefix-offload-dir (and --prefix-offload-disk)");
  }
  g.prefix_disk_dir = a.prefix_disk_dir;
  g.prefix_disk_persist = a.prefix_disk_persist;
  if (!a.prefix_remote.empty()) {
    const std::string flag = "--prefix-offload-remote";
    if (!a.prefix_caching) return invalid_argument(flag + " needs --prefix-caching");
    if (g.prefix_disk_bytes > 0)
      return invalid_argument(flag + " and --prefix-offload-disk cannot be combined");
#if SPECONTEXT_HAVE_UCX
    SPX_ASSIGN_OR_RETURN(const KvNodeSpec spec, parse_kv_node_spec(flag, a.prefix_remote));
    cluster::RemotePrefixStoreOptions o;
    o.replicas = spec.endpoints;
    o.bytes = spec.bytes;
    o.timeout = std::chrono::milliseconds(a.tiers.kv_node_timeout_ms);
    auto secret = cluster::load_kv_secret(a.tiers.kv_secret_file);
    if (!secret.is_ok()) return secret.status().with_context("--kv-secret-file");
    o.secret = std::move(secret).value();
    o.mode = a.tiers.kv_node_mode == "rma" ? transport::UcxTransferMode::kRma
                                           : transport::UcxTransferMode::kNodeGather;
    auto store = cluster::RemotePrefixStore::create(std::move(o));
    if (!store.is_ok()) return store.status().with_context(flag + " " + a.prefix_remote);
    g.prefix_blob_store = std::move(store).value();
    g.prefix_disk_bytes = spec.bytes;
#else
    return unimplemented(flag + ": this build has no UCX (install libucx-dev and rebuild)");
#endif
  }
  return g;
}

Result<LoadedModel> load_model_and_tokenizer(const EngineArgs& args) {
  LoadedModel out;
  SPX_ASSIGN_OR_RETURN(out.model, load_model_from_args(args.model));
  out.synthetic = !args.model.synthetic.empty();
  if (!out.synthetic) {
    SPX_ASSIGN_OR_RETURN(out.tokenizer, load_tokenizer_for(*out.model, args.tokenizer));
  }
  return out;
}

ChatTemplate chat_template_for(const Model& m, const Tokenizer& tok) {
  return chat_template_of(tok, architecture_name(m.config.arch));
}

std::vector<TokenId> generation_stop_ids(const Tokenizer& tok) {
  std::vector<TokenId> ids = tok.stop_ids();
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  return ids;
}

namespace {

// The retrieval head for --sparse specontext (or the default): --head, else
// retrieval_head.safetensors beside the model or one folder up; random for synthetic models.
Result<std::shared_ptr<const RetrievalHead>> find_head(const EngineArgs& a, const LoadedModel& loaded,
                                                       std::string& note) {
  if (!a.sparse.empty() && a.sparse != "specontext") return std::shared_ptr<const RetrievalHead>();
  if (loaded.synthetic) {
    SPX_ASSIGN_OR_RETURN(auto head, make_random_head(loaded.model->config, a.model.weight_seed + 1));
    return std::shared_ptr<const RetrievalHead>(head);
  }
  std::string path = a.head_path;
  if (path.empty()) {
    namespace fs = std::filesystem;
    const fs::path model_path(a.model.model_path);
    const fs::path dir = fs::is_directory(model_path) ? model_path : model_path.parent_path();
    for (const fs::path& cand :
         {dir / "retrieval_head.safetensors", dir.parent_path() / "retrieval_head.safetensors"}) {
      if (fs::exists(cand)) {
        path = cand.string();
        break;
      }
    }
  }
  if (path.empty()) {
    if (a.sparse == "specontext") {
      return not_found(
          "--sparse specontext: no retrieval head given (--head) and none found beside the model; "
          "make one with `specontext distill`");
    }
    return std::shared_ptr<const RetrievalHead>();
  }
  SPX_ASSIGN_OR_RETURN(auto head, load_eagle3_head(path, loaded.model->config));
  note = path;
  return std::shared_ptr<const RetrievalHead>(head);
}

Result<std::unique_ptr<Backend>> make_backend(const EngineArgs& a) {
  if (a.backend == "cuda") {
#if SPECONTEXT_HAVE_CUDA
    auto cuda = gpu::create_cuda_backend(0);
    if (cuda.is_ok()) return std::move(*cuda);
    std::fprintf(stderr, "note: %s; falling back to the CPU backend\n", cuda.status().message().c_str());
#else
    std::fprintf(stderr, "note: this build has no CUDA backend; falling back to the CPU backend\n");
#endif
  }
  cpu::CpuBackendOptions bopts;
  bopts.reference = a.reference;
  bopts.num_threads = a.threads;
  return cpu::create_cpu_backend(bopts);
}

}  // namespace

Result<EngineBundle> build_engine(const EngineArgs& a, const LoadedModel& loaded, int64_t max_sequences,
                                  int64_t max_context, const std::vector<int64_t>& final_lengths, bool quiet,
                                  int64_t waiting_slots) {
  EngineBundle out;
  const Model& model = *loaded.model;
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<const RetrievalHead> head, find_head(a, loaded, out.head_note));
  out.method_name = !a.sparse.empty() ? a.sparse : (head ? "specontext" : "dense");
  SPX_ASSIGN_OR_RETURN(out.method, parse_sparse_method(out.method_name));
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(a));

  EngineOptions& eopts = out.options;
  eopts.max_sequences = max_sequences + waiting_slots;
  eopts.max_running = waiting_slots > 0 ? max_sequences : 0;
  eopts.page_size = a.page_size;
  eopts.kv_dtype = dtype_from_name(a.kv_dtype).value_or(DType::kF32);  // CLI11 checked the name
  eopts.max_context = max_context > 0 ? max_context : model.config.max_seq_len;
  eopts.sparse.method = out.method;
  eopts.sparse.selection.budget =
      a.budget > 0 ? a.budget : std::min<int64_t>(2048, std::max<int64_t>(32, model.config.max_seq_len / 8));
  eopts.sparse.selection.sinks = a.sinks;
  eopts.sparse.selection.window = a.window;
  eopts.retrieval_head = head;
  eopts.prefix_sharing = a.prefix_caching;
  if (head && !quiet) {
    std::fprintf(stderr, "retrieval head: %s (%s)\n",
                 out.head_note.empty() ? "random (synthetic)" : out.head_note.c_str(),
                 pruning_report(*head).c_str());
    if (!head->load_note.empty()) std::fprintf(stderr, "warning: retrieval head: %s\n", head->load_note.c_str());
  }
  SPX_ASSIGN_OR_RETURN(out.tiers, setup_tiers(a.tiers, model, *backend, eopts));
  if (out.tiers) out.tiers->print_events = !quiet;  // fail-over, rejoin and loss lines on stderr
  SPX_ASSIGN_OR_RETURN(out.engine,
                       Engine::create(loaded.model, std::shared_ptr<Backend>(std::move(backend)), eopts));
  if (out.tiers) {
    SPX_RETURN_IF_ERROR(start_tiers(*out.tiers, *out.engine, eopts, final_lengths));
  }
  return out;
}

}  // namespace specontext::cli
