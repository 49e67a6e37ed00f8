// A growing reasoning trace on a synthetic model with a small device budget: R sequences prefill
// a P-token prompt, then decode until U tokens each. Three placements of the same workload, one
// after the other in one run:
//   dynamic  — the planner re-plans before every step: layers leave the device as the trace grows
//   static   — one plan for the final length U, decided before the run, never revisited
//   device   — everything on the device, no budget (only when it fits --all-device-max)
// Every --sample-every steps: tokens/s over the window, layers offloaded, device bytes, KV bytes
// moved per step, copy/compute overlap. JSON (and a PNG via plot_growing_trace.py with --plot).
//
//   build/release/bench/bench_growing_trace --out bench_out/growing_trace.json --plot
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/engine/engine.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "planner/units.h"
#include "runtime/tier_setup.h"

using namespace specontext;

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int64_t layers = 16, dim = 512, hidden = 1024, heads = 8, kv_heads = 4, head_dim = 64, vocab = 1024;
  int64_t prompt = 2048, until = 32768, requests = 2, budget = 2048, sample_every = 256;
  std::string method = "specontext";
  std::string device_kv = "384MiB", host_kv = "8GiB";
  double all_device_max_gib = 8;
  int threads = 0;
};

Result<nlohmann::json> run(const Config& cfg, const std::string& mode, const std::shared_ptr<Model>& model,
                           const std::shared_ptr<RetrievalHead>& head) {
  cpu::CpuBackendOptions bo;
  bo.num_threads = cfg.threads;
  SPX_ASSIGN_OR_RETURN(auto backend, cpu::create_cpu_backend(bo));
  EngineOptions eo;
  eo.max_sequences = cfg.requests;
  eo.max_context = cfg.until + 1;
  SPX_ASSIGN_OR_RETURN(eo.sparse.method, parse_sparse_method(cfg.method));
  eo.sparse.selection.budget = cfg.budget;
  if (eo.sparse.method == SparseMethod::kSpeContext) eo.retrieval_head = head;
  runtime::TierArgs ta;
  if (mode != "device") {
    ta.device_kv = cfg.device_kv;
    ta.host_kv = cfg.host_kv;
    ta.placement = mode;
  }
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<runtime::TierRuntime> rt, runtime::setup_tiers(ta, *model, *backend, eo));
  SPX_ASSIGN_OR_RETURN(auto engine, Engine::create(model, std::shared_ptr<Backend>(std::move(backend)), eo));
  if (rt) {
    SPX_RETURN_IF_ERROR(runtime::start_tiers(*rt, *engine, eo, std::vector<int64_t>(static_cast<size_t>(cfg.requests), cfg.until)));
  }
  std::mt19937 rng(7);
  std::vector<SeqId> seqs;
  std::vector<std::vector<TokenId>> prompts(static_cast<size_t>(cfg.requests));
  for (auto& p : prompts) {
    p.resize(static_cast<size_t>(cfg.prompt));
    for (auto& t : p) t = static_cast<TokenId>(rng() % static_cast<uint32_t>(cfg.vocab));
  }
  for (int64_t r = 0; r < cfg.requests; ++r) {
    SPX_ASSIGN_OR_RETURN(SeqId s, engine->memory().add_sequence());
    seqs.push_back(s);
  }
  // Prefill in chunks of 256 tokens, all sequences together.
  const auto t_prefill = Clock::now();
  for (int64_t off = 0; off < cfg.prompt; off += 256) {
    std::vector<StepRequest> reqs;
    for (size_t r = 0; r < seqs.size(); ++r) {
      const int64_t n = std::min<int64_t>(256, cfg.prompt - off);
      reqs.push_back({seqs[r], std::span<const TokenId>(prompts[r].data() + off, static_cast<size_t>(n)),
                      off + n >= cfg.prompt ? LogitsMode::kLast : LogitsMode::kNone});
    }
    SPX_RETURN_IF_ERROR(engine->forward(reqs).status());
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t_prefill).count();
  std::vector<TokenId> next(seqs.size(), 1);
  nlohmann::json samples = nlohmann::json::array();
  auto window_start = Clock::now();
  const auto decode_start = window_start;
  int64_t window_tokens = 0;
  uint64_t window_bytes = 0;
  OverlapStats window_overlap_start = engine->overlap_stats();
  int64_t steps = 0;
  for (int64_t len = cfg.prompt; len < cfg.until; ++len, ++steps) {
    std::vector<StepRequest> reqs;
    for (size_t r = 0; r < seqs.size(); ++r) reqs.push_back({seqs[r], std::span<const TokenId>(&next[r], 1), LogitsMode::kLast});
    SPX_ASSIGN_OR_RETURN(StepOutput out, engine->forward(reqs));
    for (size_t r = 0; r < seqs.size(); ++r) {
      const auto row = out.row(r);
      next[r] = static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
    }
    window_tokens += static_cast<int64_t>(seqs.size());
    for (const TierReport& t : engine->tier_report()) window_bytes += t.last_step.bytes_in;
    if ((steps + 1) % cfg.sample_every == 0 || len + 1 == cfg.until) {
      const double secs = std::chrono::duration<double>(Clock::now() - window_start).count();
      const OverlapStats& o = engine->overlap_stats();
      int64_t offloaded = 0;
      for (TierId t : engine->memory().placement().layer_home) offloaded += t != TierId(0) ? 1 : 0;
      const double w_step = o.step_seconds - window_overlap_start.step_seconds;
      const double w_copy = o.copy_busy_seconds - window_overlap_start.copy_busy_seconds;
      const double w_wait = o.wait_seconds - window_overlap_start.wait_seconds;
      samples.push_back({{"length", len + 1},
                         {"tokens_per_s", secs > 0 ? static_cast<double>(window_tokens) / secs : 0.0},
                         {"layers_offloaded", offloaded},
                         {"cpu_filtering", engine->memory().placement().cpu_filtering},
                         {"device_used_bytes", engine->memory().kv_store().tier_used_bytes(TierId(0))},
                         {"bytes_moved_per_step", static_cast<double>(window_bytes) /
                                                      std::max<int64_t>(1, window_tokens / cfg.requests)},
                         {"step_seconds", w_step},
                         {"copy_busy_seconds", w_copy},
                         {"exposed_wait_seconds", w_wait},
                         {"serial_estimate_seconds", w_step - w_wait + w_copy}});
      std::fprintf(stderr, "%-7s len %6lld  %7.1f tok/s  offloaded %2lld  moved %8.0f B/step  wait %.3f of copy %.3f s\n",
                   mode.c_str(), static_cast<long long>(len + 1), samples.back()["tokens_per_s"].get<double>(),
                   static_cast<long long>(offloaded), samples.back()["bytes_moved_per_step"].get<double>(), w_wait, w_copy);
      window_start = Clock::now();
      window_tokens = 0;
      window_bytes = 0;
      window_overlap_start = o;
    }
  }
  const double decode_s = std::chrono::duration<double>(Clock::now() - decode_start).count();
  nlohmann::json j = {{"mode", mode},
                      {"prefill_seconds", prefill_s},
                      {"decode_seconds", decode_s},
                      {"decode_tokens", steps * cfg.requests},
                      {"decode_tokens_per_s", decode_s > 0 ? static_cast<double>(steps * cfg.requests) / decode_s : 0.0},
                      {"mean_overlap", engine->sparse_stats().overlap()},
                      {"samples", samples},
                      {"tiering", runtime::tiers_json(*engine, rt.get())}};
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"growing-trace decode under a small device budget: dynamic vs static placement vs all-device"};
  Config cfg;
  std::string out = "bench_out/growing_trace.json";
  bool plot = false;
  std::vector<std::string> modes = {"dynamic", "static", "device"};
  app.add_option("--layers", cfg.layers, "layers of the synthetic model");
  app.add_option("--dim", cfg.dim, "hidden size");
  app.add_option("--heads", cfg.heads, "query heads");
  app.add_option("--kv-heads", cfg.kv_heads, "KV heads");
  app.add_option("--head-dim", cfg.head_dim, "head dim");
  app.add_option("--prompt", cfg.prompt, "prompt tokens per sequence");
  app.add_option("--until", cfg.until, "decode until each sequence holds this many tokens");
  app.add_option("--requests", cfg.requests, "sequences decoded together");
  app.add_option("--budget", cfg.budget, "SpeContext budget B");
  app.add_option("--method", cfg.method, "sparse method (specontext, dense, streaming, quest)");
  app.add_option("--device-kv", cfg.device_kv, "device tier budget");
  app.add_option("--host-kv", cfg.host_kv, "host pool (one NUMA node)");
  app.add_option("--all-device-max-gib", cfg.all_device_max_gib, "run the all-device placement only below this KV size");
  app.add_option("--sample-every", cfg.sample_every, "decode steps per sample");
  app.add_option("--modes", modes, "placements to run")->delimiter(',');
  app.add_option("--threads", cfg.threads, "CPU threads (0 = all cores of the node)");
  app.add_option("--out", out, "JSON output path");
  app.add_flag("--plot", plot, "also write a PNG (python3 + matplotlib)");
  CLI11_PARSE(app, argc, argv);

  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.dim = cfg.dim;
  c.hidden_dim = cfg.hidden;
  c.n_layers = cfg.layers;
  c.n_heads = cfg.heads;
  c.n_kv_heads = cfg.kv_heads;
  c.head_dim = cfg.head_dim;
  c.vocab_size = cfg.vocab;
  c.max_seq_len = cfg.until + 1;
  auto model = make_random_model(c, DType::kF32, 1);
  if (!model.is_ok()) {
    std::fprintf(stderr, "error: %s\n", model.status().to_string().c_str());
    return 1;
  }
  auto head = make_random_head((*model)->config, 2);
  if (!head.is_ok()) {
    std::fprintf(stderr, "error: %s\n", head.status().to_string().c_str());
    return 1;
  }
  const double kv_gib = static_cast<double>(c.kv_bytes_per_token(4)) * static_cast<double>(cfg.until * cfg.requests) /
                        static_cast<double>(1ull << 30);
  nlohmann::json runs = nlohmann::json::array();
  for (const std::string& mode : modes) {
    if (mode == "device" && kv_gib > cfg.all_device_max_gib) {
      std::fprintf(stderr, "device: skipped, %.2f GiB of KV is above --all-device-max-gib\n", kv_gib);
      runs.push_back({{"mode", mode}, {"skipped", "KV does not fit --all-device-max-gib"}});
      continue;
    }
    auto r = run(cfg, mode, *model, *head);
    if (!r.is_ok()) {
      std::fprintf(stderr, "%s: error: %s\n", mode.c_str(), r.status().to_string().c_str());
      runs.push_back({{"mode", mode}, {"error", r.status().to_string()}});
      continue;
    }
    std::fprintf(stderr, "%s: %.1f decode tok/s overall\n", mode.c_str(), (*r)["decode_tokens_per_s"].get<double>());
    runs.push_back(std::move(*r));
  }
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += (i ? " " : "") + std::string(argv[i]);
  nlohmann::json doc = {{"command", cmd},
                        {"note", "synthetic weights, KV and retrieval head: speed and placement behaviour, not quality; "
                                 "on a CPU the device and host tiers are the same DRAM"},
                        {"model", {{"layers", c.n_layers}, {"dim", c.dim}, {"heads", c.n_heads}, {"kv_heads", c.n_kv_heads},
                                   {"head_dim", c.head_dim}, {"kv_bytes_per_token", c.kv_bytes_per_token(4)}}},
                        {"workload", {{"prompt", cfg.prompt}, {"until", cfg.until}, {"requests", cfg.requests},
                                      {"method", cfg.method}, {"budget", cfg.budget}, {"device_kv", cfg.device_kv},
                                      {"host_kv", cfg.host_kv}, {"kv_gib_at_end", kv_gib}}},
                        {"runs", runs}};
  std::filesystem::create_directories(std::filesystem::path(out).parent_path().empty()
                                          ? std::filesystem::path(".")
                                          : std::filesystem::path(out).parent_path());
  std::ofstream(out) << doc.dump(2) << "\n";
  std::fprintf(stderr, "wrote %s\n", out.c_str());
  if (plot) {
    const std::string script = std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_growing_trace.py";
    const std::string call = "/usr/bin/python3 '" + script + "' '" + out + "'";  // Debian's, with matplotlib
    if (std::system(call.c_str()) != 0) std::fprintf(stderr, "plot failed: %s\n", call.c_str());
  }
  return 0;
}
