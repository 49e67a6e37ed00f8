// bench_gpu_decode: steady-state decode tokens/s of the engine on the CUDA backend, on a
// synthetic model with a real shape (default llama-3.1-8b, bf16 random weights), for every
// context × requests × method. One process builds the model once and uses ONE CudaBackend, so
// the weights are uploaded once (import_weights caches by host pointer) and shared by the engines
// created one after another. Per configuration: an engine (max_sequences = R, max_context =
// ctx + steps + 8), R sequences filled with fill_synthetic(ctx) (random KV instead of a prefill),
// one warm-up decode step, then `steps` timed decode steps of all R sequences (greedy argmax on
// the host); tokens/s = steps·R / seconds.
//
// KV pages and working sets hold --kv-dtype elements (default bf16, as the HF baseline: 128 KiB
// per token for llama-3.1-8b; f32 doubles that), so large configurations do not fit the device:
// then the KV tiers are set up as `specontext generate` does (bin/tier_setup: a pinned
// host pool, the CUDA transport, the planner's static plan for the final lengths), and where even
// that cannot hold it the configuration is recorded as {"status": "does not fit"} with the bytes
// it needs. Every configuration's errors (out of memory included) are caught and recorded; the
// JSON is rewritten after each one, so a run stopped from outside keeps what it measured.
// Without a CUDA device it says so, writes a JSON saying that no figures were produced, exits 0.
//
//   bench_gpu_decode --out bench_out/gpu_decode.json [--contexts 16384,32768 --requests 1,8,32
//                    --methods dense,specontext --steps 32 --kv-dtype bf16 --time-budget-s 150]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/engine/engine.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "gpu/cuda_backend.h"
#include "runtime/tier_setup.h"

namespace {

using namespace specontext;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

struct Options {
  std::string model = "llama-3.1-8b";
  int64_t layers = 0;  // 0 = the model's depth
  std::vector<int64_t> contexts = {16384, 32768};
  std::vector<int64_t> requests = {1, 8, 32};
  std::vector<std::string> methods = {"dense", "specontext"};
  int64_t steps = 32;
  int64_t budget = 2048;
  std::string kv_dtype_name = "bf16";  // --kv-dtype: f32, f16 or bf16
  DType kv_dtype = DType::kBF16;       // kv_dtype_name parsed
  double time_budget_s = 0;            // 0 = none
  double reserve_gib = 10;   // device memory left outside the KV tier (workspaces, cuBLAS, fragmentation)
  double host_kv_max_gib = 96;
  int device = 0;
  uint64_t seed = 1;
  std::string out = "bench_out/gpu_decode.json";
};

struct DeviceMemory {
  uint64_t free = 0, total = 0;
};
DeviceMemory device_memory() {
  DeviceMemory m;
  size_t f = 0, t = 0;
  if (cudaMemGetInfo(&f, &t) == cudaSuccess) {
    m.free = f;
    m.total = t;
  } else {
    (void)cudaGetLastError();
  }
  return m;
}

// Bytes of the big matrices (what import_weights uploads, norms aside).
uint64_t weight_bytes(const Model& m) {
  uint64_t b = m.tok_embeddings.bytes();
  if (m.lm_head.data != m.tok_embeddings.data) b += m.lm_head.bytes();
  for (const LayerWeights& l : m.layers) {
    for (const WeightMatrix* w : l.matrices()) b += w->bytes();
  }
  return b;
}

json sparse_json(const SparseStats& s, int64_t tokens) {
  const double per = tokens > 0 ? 1.0 / static_cast<double>(tokens) : 0.0;
  return {{"sparse_steps", s.sparse_steps},
          {"tokens_selected", s.tokens_selected},
          {"tokens_loaded", s.tokens_loaded},
          {"tokens_kept", s.tokens_kept},
          {"overlap", s.overlap()},
          {"bytes_loaded_per_token", static_cast<double>(s.bytes_loaded) * per},
          {"bytes_full_reload_per_token", static_cast<double>(s.bytes_full_reload) * per}};
}

json overlap_json(const OverlapStats& now, const OverlapStats& before) {
  OverlapStats d;
  d.steps = now.steps - before.steps;
  d.step_seconds = now.step_seconds - before.step_seconds;
  d.copy_busy_seconds = now.copy_busy_seconds - before.copy_busy_seconds;
  d.wait_seconds = now.wait_seconds - before.wait_seconds;
  return {{"steps_moving_kv", d.steps},
          {"step_seconds", d.step_seconds},
          {"compute_seconds", d.compute_seconds()},
          {"copy_busy_seconds", d.copy_busy_seconds},
          {"exposed_wait_seconds", d.wait_seconds},
          {"serial_estimate_seconds", d.serial_seconds()},
          {"hidden_fraction", d.hidden_fraction()}};
}

struct Run {
  const Options& opt;
  std::shared_ptr<const Model> model;
  std::shared_ptr<const RetrievalHead> head;
  std::shared_ptr<Backend> backend;
  Clock::time_point start;
  bool over_budget() const { return opt.time_budget_s > 0 && seconds_since(start) > opt.time_budget_s; }
};

// One configuration; fills `j` as it goes, so a failure keeps what was known before it.
Status run_config(const Run& run, int64_t ctx, int64_t requests, SparseMethod method, json& j) {
  const Options& opt = run.opt;
  const ModelConfig& c = run.model->config;
  EngineOptions eo;
  eo.max_sequences = requests;
  eo.max_context = ctx + opt.steps + 8;
  eo.sparse.method = method;
  eo.sparse.selection.budget = opt.budget;  // sinks 1, window 4 (the defaults)
  eo.kv_dtype = opt.kv_dtype;
  if (method == SparseMethod::kSpeContext) eo.retrieval_head = run.head;
  const uint64_t needed = Engine::all_device_bytes(c, eo);
  const DeviceMemory mem = device_memory();
  const uint64_t reserve = static_cast<uint64_t>(opt.reserve_gib * kGiB);
  const uint64_t device_room = mem.free > reserve ? mem.free - reserve : 0;
  const uint64_t host_max = static_cast<uint64_t>(opt.host_kv_max_gib * kGiB);
  j["needed_all_device_bytes"] = needed;
  j["device_free_bytes_before"] = mem.free;
  j["device_kv_room_bytes"] = device_room;
  j["kv_dtype"] = opt.kv_dtype_name;
  j["kv_bytes_per_token"] = c.kv_bytes_per_token(static_cast<int64_t>(dtype_size(opt.kv_dtype)));

  runtime::TierArgs ta;
  if (needed > device_room) {
    // Offloaded layers need room on the device as well (staging, working sets), so a host pool
    // only as large as the overflow is not always enough: a quarter more, plus 4 GiB.
    const uint64_t overflow = needed - device_room;
    if (device_room == 0 || overflow > host_max) {
      j["status"] = "does not fit";
      j["needed_bytes"] = needed;
      j["reason"] = "needs " + std::to_string(needed) + " bytes of KV, working sets and head keys; the device has room for " +
                    std::to_string(device_room) + " (free minus a " + num(opt.reserve_gib) +
                    " GiB reserve) and the host pool is capped at " + num(opt.host_kv_max_gib) + " GiB";
      return Status::ok();
    }
    const uint64_t host = std::min<uint64_t>(host_max, overflow + overflow / 4 + (uint64_t{4} << 30));
    ta.device_kv = std::to_string(device_room);
    ta.host_kv = std::to_string(host);
    ta.placement = "static";  // planned once for the final lengths, before the fill writes any page
  }
  const auto t_setup = Clock::now();
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<runtime::TierRuntime> rt, runtime::setup_tiers(ta, *run.model, *run.backend, eo));
  j["tier_setup_seconds"] = seconds_since(t_setup);
  const auto t_engine = Clock::now();
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(run.model, run.backend, eo));
  // The engine borrows the tiers' transport and copy engine: destroy it first.
  struct Teardown {
    std::unique_ptr<Engine>& e;
    std::unique_ptr<runtime::TierRuntime>& r;
    ~Teardown() {
      e.reset();
      r.reset();
    }
  } teardown{engine, rt};
  if (rt) {
    SPX_RETURN_IF_ERROR(runtime::start_tiers(*rt, *engine, eo,
                                         std::vector<int64_t>(static_cast<size_t>(requests), ctx + 1 + opt.steps)));
    j["static_plan"] = rt->placement_note;
  }
  j["engine_setup_seconds"] = seconds_since(t_engine);

  std::vector<SeqId> seqs;
  const auto t_fill = Clock::now();
  for (int64_t r = 0; r < requests; ++r) {
    SPX_ASSIGN_OR_RETURN(SeqId s, engine->memory().add_sequence());
    seqs.push_back(s);
    SPX_RETURN_IF_ERROR_CTX(engine->fill_synthetic(s, ctx, opt.seed * 1000 + static_cast<uint64_t>(r)),
                            "fill_synthetic of sequence " + std::to_string(r));
  }
  SPX_RETURN_IF_ERROR(run.backend->synchronize());
  j["fill_seconds"] = seconds_since(t_fill);  // the "prefill": random KV written once, no model compute

  std::mt19937 rng(static_cast<uint32_t>(opt.seed + static_cast<uint64_t>(ctx + requests)));
  std::vector<TokenId> next(seqs.size());
  for (TokenId& t : next) t = static_cast<TokenId>(rng() % static_cast<uint32_t>(c.vocab_size));
  auto step = [&]() -> Status {
    std::vector<StepRequest> reqs;
    reqs.reserve(seqs.size());
    for (size_t r = 0; r < seqs.size(); ++r) reqs.push_back({seqs[r], std::span<const TokenId>(&next[r], 1), LogitsMode::kLast});
    SPX_ASSIGN_OR_RETURN(StepOutput out, engine->forward(reqs));  // logits on the host: the step is complete
    for (size_t r = 0; r < seqs.size(); ++r) {
      const auto row = out.row(r);
      next[r] = static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
    }
    return Status::ok();
  };
  const auto t_warm = Clock::now();
  SPX_RETURN_IF_ERROR_CTX(step(), "warm-up step");
  j["warmup_seconds"] = seconds_since(t_warm);
  j["warmup_sparse"] = sparse_json(engine->sparse_stats(), requests);
  engine->reset_sparse_stats();
  const OverlapStats overlap_before = engine->overlap_stats();

  std::vector<double> step_s;
  const auto t0 = Clock::now();
  for (int64_t s = 0; s < opt.steps; ++s) {
    const auto ts = Clock::now();
    SPX_RETURN_IF_ERROR_CTX(step(), "timed step " + std::to_string(s));
    step_s.push_back(seconds_since(ts));
    if (run.over_budget() && s + 1 < opt.steps) {
      j["stopped_early"] = "time budget reached after " + std::to_string(s + 1) + " timed steps";
      break;
    }
  }
  const double secs = seconds_since(t0);
  const int64_t done = static_cast<int64_t>(step_s.size());
  std::vector<double> sorted = step_s;
  std::sort(sorted.begin(), sorted.end());
  const DeviceMemory after = device_memory();

  j["status"] = "ok";
  j["steps"] = done;
  j["seconds"] = secs;
  j["tokens_per_s"] = secs > 0 ? static_cast<double>(done * requests) / secs : 0.0;
  j["step_seconds"] = {{"min", sorted.front()}, {"median", sorted[sorted.size() / 2]}, {"max", sorted.back()}};
  j["device_used_bytes"] = after.total - after.free;  // everything on the device: weights, KV tier, workspaces
  j["kv_bytes"] = engine->memory().kv_bytes_in_use();
  uint64_t host_cap = 0, host_peak = 0;
  for (const TierReport& t : engine->tier_report()) {
    if (t.desc.id == TierId(0)) {
      j["device_tier_bytes"] = t.desc.capacity_bytes;
      j["device_tier_peak_bytes"] = t.peak_used_bytes;
    } else {
      host_cap += t.desc.capacity_bytes;
      host_peak += t.peak_used_bytes;
    }
  }
  j["host_tier_bytes"] = host_cap;
  j["host_tier_peak_bytes"] = host_peak;
  int64_t offloaded = 0;
  for (TierId t : engine->memory().placement().layer_home) offloaded += t != TierId(0) ? 1 : 0;
  j["placement"] = {{"layers", c.n_layers}, {"layers_offloaded", offloaded}, {"tiered", rt != nullptr}};
  j["sparse"] = sparse_json(engine->sparse_stats(), done * requests);
  j["overlap"] = overlap_json(engine->overlap_stats(), overlap_before);
  if (rt) j["tiering"] = runtime::tiers_json(*engine, rt.get());
  return Status::ok();
}

void write_json(const std::string& path, const json& doc) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (!p.parent_path().empty()) fs::create_directories(p.parent_path(), ec);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << doc.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench_gpu_decode: cannot write %s\n", tmp.c_str());
      return;
    }
  }
  fs::rename(tmp, p, ec);
  if (ec) std::fprintf(stderr, "bench_gpu_decode: cannot rename %s: %s\n", tmp.c_str(), ec.message().c_str());
}

std::string fmt_gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(bytes) / kGiB);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decode tokens/s of the engine on the CUDA backend (synthetic model, dense and SpeContext)"};
  Options opt;
  app.add_option("--model", opt.model, "synthetic model name (llama-3.1-8b, llama-3.2-1b, qwen3-8b, toy)");
  app.add_option("--layers", opt.layers, "cut the model to this many layers (0 = all)")->check(CLI::NonNegativeNumber);
  app.add_option("--contexts", opt.contexts, "context lengths (tokens of random KV per sequence)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--requests", opt.requests, "sequences decoded together")->delimiter(',')->check(CLI::PositiveNumber);
  app.add_option("--methods", opt.methods, "dense, specontext")
      ->delimiter(',')
      ->check(CLI::IsMember({"dense", "specontext", "streaming", "quest"}));
  app.add_option("--steps", opt.steps, "timed decode steps (after one warm-up step)")->check(CLI::PositiveNumber);
  app.add_option("--budget", opt.budget, "SpeContext budget B (tokens per KV head)")->check(CLI::PositiveNumber);
  app.add_option("--kv-dtype", opt.kv_dtype_name,
                 "element type of the KV cache and working sets (f32, f16, bf16)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--time-budget-s", opt.time_budget_s,
                 "stop launching configurations after this many seconds (they are recorded as skipped); 0 = none")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--reserve-gib", opt.reserve_gib, "device memory kept outside the KV tier")->check(CLI::NonNegativeNumber);
  app.add_option("--host-kv-max-gib", opt.host_kv_max_gib, "largest pinned host KV pool")->check(CLI::NonNegativeNumber);
  app.add_option("--device", opt.device, "CUDA device ordinal")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", opt.seed, "seed of weights, KV and tokens");
  app.add_option("--out", opt.out, "JSON output file");
  CLI11_PARSE(app, argc, argv);
  opt.kv_dtype = dtype_from_name(opt.kv_dtype_name).value_or(DType::kBF16);  // CLI11 checked the name

  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  json doc = {{"command", command},
              {"note",
               "synthetic weights (bf16, random), random KV via fill_synthetic and a random retrieval head: "
               "speed, not quality; KV pages and working sets are " +
                   opt.kv_dtype_name},
              {"kv_dtype", opt.kv_dtype_name},
              {"figures_produced", false}};

  auto count = gpu::cuda_device_count();
  if (!count.is_ok() || opt.device >= *count) {
    const std::string why = !count.is_ok() ? count.status().message()
                                           : "no CUDA device " + std::to_string(opt.device) + " (" +
                                                 std::to_string(*count) + " present)";
    std::fprintf(stderr, "bench_gpu_decode: %s; no figures were produced\n", why.c_str());
    doc["status"] = "no device";
    doc["reason"] = why;
    write_json(opt.out, doc);
    return 0;
  }
  const auto start = Clock::now();
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, opt.device) == cudaSuccess) {
    doc["device"] = {{"name", prop.name}, {"sm_count", prop.multiProcessorCount},
                     {"memory_bytes", prop.totalGlobalMem}, {"compute_capability", std::to_string(prop.major) + "." + std::to_string(prop.minor)}};
  }
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  doc["cuda_runtime"] = runtime;
  doc["cuda_driver"] = driver;
  doc["status"] = "running";
  write_json(opt.out, doc);

  // ---- model, head, backend: once ----
  const auto t_model = Clock::now();
  auto model = make_synthetic_model(opt.model, opt.layers, DType::kBF16, opt.seed);
  // A set-up failure is still a document: status "error" with the reason.
  auto fail = [&](const Status& st) {
    std::fprintf(stderr, "bench_gpu_decode: %s\n", st.to_string().c_str());
    doc["status"] = "error";
    doc["error"] = st.to_string();
    write_json(opt.out, doc);
    return 1;
  };
  if (!model.is_ok()) return fail(model.status());
  const ModelConfig& c = (*model)->config;
  doc["model"] = {
      {"name", opt.model},
      {"layers", c.n_layers},
      {"dim", c.dim},
      {"hidden", c.hidden_dim},
      {"heads", c.n_heads},
      {"kv_heads", c.n_kv_heads},
      {"head_dim", c.head_dim},
      {"vocab", c.vocab_size},
      {"weights", "bf16"},
      {"weight_bytes", weight_bytes(**model)},
      {"kv_dtype", opt.kv_dtype_name},
      {"kv_bytes_per_token", c.kv_bytes_per_token(static_cast<int64_t>(dtype_size(opt.kv_dtype)))},
      {"build_seconds", seconds_since(t_model)}};
  std::shared_ptr<const RetrievalHead> head;
  if (std::find(opt.methods.begin(), opt.methods.end(), "specontext") != opt.methods.end()) {
    auto h = make_random_head(c, opt.seed + 1);
    if (!h.is_ok()) {
      std::fprintf(stderr, "bench_gpu_decode: retrieval head: %s\n", h.status().to_string().c_str());
      doc["head_error"] = h.status().to_string();
    } else {
      head = *h;
    }
  }
  auto be = gpu::CudaBackend::create(opt.device);
  if (!be.is_ok()) return fail(be.status());
  Run run{opt, *model, head, std::shared_ptr<Backend>(std::move(*be)), start};

  // Upload the weights once with a small engine (model and head), so every configuration sees
  // the device memory that is really left for its KV.
  {
    const DeviceMemory before = device_memory();
    const auto t = Clock::now();
    EngineOptions eo;
    eo.max_sequences = 1;
    eo.max_context = std::min<int64_t>(4096, c.max_seq_len);
    eo.kv_dtype = opt.kv_dtype;
    if (head) {
      eo.sparse.method = SparseMethod::kSpeContext;
      eo.sparse.selection.budget = opt.budget;
      eo.retrieval_head = head;
    }
    auto e = Engine::create(run.model, run.backend, eo);
    Status st = e.is_ok() ? run.backend->synchronize() : e.status();
    const DeviceMemory after = device_memory();
    doc["weights_upload"] = {{"seconds", seconds_since(t)}, {"ok", st.is_ok()},
                             {"device_bytes", before.free > after.free ? before.free - after.free : 0}};
    if (!st.is_ok()) {
      std::fprintf(stderr, "bench_gpu_decode: weight upload: %s\n", st.to_string().c_str());
      doc["weights_upload"]["error"] = st.to_string();
    }
  }
  std::fprintf(stderr, "bench_gpu_decode: %s (%lld layers, %s GiB bf16 weights, %s KV) on %s, %s GiB free\n",
               opt.model.c_str(), static_cast<long long>(c.n_layers), fmt_gib(weight_bytes(**model)).c_str(),
               opt.kv_dtype_name.c_str(), prop.name, fmt_gib(device_memory().free).c_str());

  json configs = json::array();
  bool any_ok = false;
  for (int64_t ctx : opt.contexts) {
    for (int64_t requests : opt.requests) {
      for (const std::string& mname : opt.methods) {
        json j = {{"ctx", ctx}, {"requests", requests}, {"method", mname}};
        if (mname == "specontext") j["budget"] = opt.budget;
        auto method = parse_sparse_method(mname);
        const auto t = Clock::now();
        if (run.over_budget()) {
          j["status"] = "skipped";
          j["reason"] = "time budget of " + num(opt.time_budget_s) + " s reached before this configuration";
        } else if (!method.is_ok()) {
          j["status"] = "error";
          j["error"] = method.status().to_string();
        } else if (*method == SparseMethod::kSpeContext && !head) {
          j["status"] = "error";
          j["error"] = "no retrieval head";
        } else {
          try {
            Status st = run_config(run, ctx, requests, *method, j);
            if (!st.is_ok()) {
              j["status"] = "error";
              j["error"] = st.to_string();
            }
          } catch (const std::exception& e) {  // std::bad_alloc of a host buffer, and the like
            j["status"] = "error";
            j["error"] = std::string("exception: ") + e.what();
          }
          // Leave the device clean for the next configuration; a sticky CUDA error shows here.
          Status sync = run.backend->synchronize();
          if (!sync.is_ok()) j["sync_error_after"] = sync.to_string();
        }
        j["wall_seconds"] = seconds_since(t);
        const std::string status = j["status"].get<std::string>();
        any_ok = any_ok || status == "ok";
        if (status == "ok") {
          std::fprintf(stderr, "ctx %6lld  R %3lld  %-10s  %9.1f tok/s  (%lld steps, %.3f s; offloaded %lld/%lld; device %s GiB)\n",
                       static_cast<long long>(ctx), static_cast<long long>(requests), mname.c_str(),
                       j["tokens_per_s"].get<double>(), static_cast<long long>(j["steps"].get<int64_t>()),
                       j["seconds"].get<double>(), static_cast<long long>(j["placement"]["layers_offloaded"].get<int64_t>()),
                       static_cast<long long>(c.n_layers), fmt_gib(j["device_used_bytes"].get<uint64_t>()).c_str());
        } else {
          const std::string why = j.contains("error") ? j["error"].get<std::string>()
                                  : j.contains("reason") ? j["reason"].get<std::string>() : "";
          std::fprintf(stderr, "ctx %6lld  R %3lld  %-10s  %s: %.300s\n", static_cast<long long>(ctx),
                       static_cast<long long>(requests), mname.c_str(), status.c_str(), why.c_str());
        }
        configs.push_back(std::move(j));
        doc["configs"] = configs;
        doc["figures_produced"] = any_ok;
        doc["elapsed_seconds"] = seconds_since(start);
        write_json(opt.out, doc);
      }
    }
  }
  doc["status"] = "done";
  doc["elapsed_seconds"] = seconds_since(start);
  write_json(opt.out, doc);
  std::fprintf(stderr, "wrote %s\n", opt.out.c_str());
  return 0;
}
