#include "runtime/engine_setup.h"

#if SPECONTEXT_HAVE_UCX
#include "cluster/remote_prefix_store.h"
#endif

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "cluster/redis_prefix_store.h"

#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "planner/units.h"
#if SPECONTEXT_HAVE_CUDA
#include "gpu/cuda_backend.h"
#endif

namespace specontext::runtime {

Result<std::shared_ptr<Model>> load_model_from_args(const ModelArgs& args) {
  if (!args.synthetic.empty()) {
    return make_synthetic_model(args.synthetic, args.layers,
                                args.dtype == "bf16" ? DType::kBF16 : DType::kF32, args.weight_seed);
  }
  if (args.model_path.empty()) return invalid_argument("give --model PATH or --synthetic NAME");
  return load_model(args.model_path, load_options_for_dtype(args.dtype));
}

LoadOptions load_options_for_dtype(const std::string& dtype) {
  return LoadOptions{
      .force_f32 = dtype == "f32", .force_bf16 = dtype == "bf16", .keep_quantized = dtype == "auto"};
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
    SPX_ASSIGN_OR_RETURN(o.access, cluster::load_kv_node_access(a.tiers.kv_secret_file, a.tiers.kv_node_tls_ca,
                                                                   a.tiers.kv_client_id));
    o.mode = a.tiers.kv_node_mode == "rma" ? transport::UcxTransferMode::kRma
                                           : transport::UcxTransferMode::kNodeGather;
    o.on_event = [](const std::string& line) {  // fail-over and loss lines, as the KV tiers' (tier_setup.h)
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
    };
    auto store = cluster::RemotePrefixStore::create(std::move(o));
    if (!store.is_ok()) return store.status().with_context(flag + " " + a.prefix_remote);
    g.prefix_blob_store = std::move(store).value();
    g.prefix_disk_bytes = spec.bytes;
#else
    return unimplemented(flag + ": this build has no UCX (install libucx-dev and rebuild)");
#endif
  }
  if (a.prefix_store.empty()) {
    if (!a.prefix_store_password_file.empty()) {
      return invalid_argument("--prefix-store-password-file needs --prefix-store");
    }
    return g;
  }
  const std::string flag = "--prefix-store";
  if (!a.prefix_caching) return invalid_argument(flag + " needs --prefix-caching");
  SPX_ASSIGN_OR_RETURN(cluster::RedisPrefixStoreOptions o, cluster::parse_redis_url(a.prefix_store));
  auto password = cluster::load_redis_password(a.prefix_store_password_file);
  if (!password.is_ok()) return password.status().with_context("--prefix-store-password-file");
  o.password = std::move(password).value();
  if (a.prefix_store_ttl_s < 1) return invalid_argument("--prefix-store-ttl must be at least 1 second");
  o.ttl_seconds = a.prefix_store_ttl_s;
  if (a.prefix_store_timeout_ms < 1) return invalid_argument("--prefix-store-timeout-ms must be positive");
  o.connect_timeout = o.command_timeout = std::chrono::milliseconds(a.prefix_store_timeout_ms);
  auto bound = planner::parse_size(a.prefix_store_max_value);
  if (!bound.is_ok()) return bound.status().with_context("--prefix-store-max-value");
  if (*bound < 1) return invalid_argument("--prefix-store-max-value must be positive");
  o.max_blob_bytes = static_cast<uint64_t>(*bound);
  if (a.prefix_store_chunk < 1) return invalid_argument("--prefix-store-chunk must be at least 1 token");
  g.prefix_shared_chunk_tokens = a.prefix_store_chunk;
  auto store = cluster::RedisPrefixStore::create(std::move(o));
  if (!store.is_ok()) return store.status().with_context(flag + " " + a.prefix_store);
  g.prefix_shared_store = std::move(store).value();
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

}  // namespace specontext::runtime
