// Preemption on a KV pool too small for every request at its final length, measured side by side
// in one run: R requests of P prompt tokens generating G tokens each, admitted by prompt
// (AdmissionPolicy::kPreempt) on a pool of --pool-fraction of R·(P+G) tokens, so that running
// requests give way as they grow. Modes: a preempted request is recomputed from its prompt and
// tokens; its whole pages are swapped out to the prefix offload store in host memory and back
// (GeneratorOptions::swap_preempted); with --disk SIZE, swapped out to disk only. Per mode: wall
// time, generated tokens/s, prompt tokens computed, preemptions, swaps, bytes swapped, and
// whether the tokens equal the recompute mode's (greedy). JSON (and --plot: PNG via
// plot_preemption.py).
//
//   build/release/bench/bench_preemption --out bench_out/preemption.json --plot
//   ... --disk 4GiB: the third mode
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench/lib/report.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "planner/units.h"
#include "serving/generator.h"

using namespace specontext;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  std::string model = "llama-3.2-1b";
  int64_t layers = 4;
  int64_t requests = 6, prompt = 256, generate = 256, page_size = 16;
  double pool_fraction = 0.4;
  std::string offload = "4GiB";
  std::string disk = "0";
  int threads = 0;
};

struct ModeResult {
  nlohmann::json json;
  std::vector<std::vector<TokenId>> tokens;
  double wall_s = 0;
  int64_t prompt_tokens = 0;
};

Result<ModeResult> run_mode(const Config& cfg, const std::shared_ptr<Model>& model, const std::string& name,
                            bool swap, uint64_t offload_bytes, uint64_t disk_bytes,
                            const std::vector<GenerationRequest>& requests) {
  cpu::CpuBackendOptions bo;
  bo.num_threads = cfg.threads;
  SPX_ASSIGN_OR_RETURN(auto backend, cpu::create_cpu_backend(bo));
  EngineOptions eo;
  eo.max_sequences = cfg.requests + 1;  // a slot for a cached sequence beside the running ones
  eo.max_running = cfg.requests;
  eo.page_size = cfg.page_size;
  eo.max_context = cfg.prompt + cfg.generate + 1;
  eo.prefix_sharing = true;
  const double pool_tokens =
      cfg.pool_fraction * static_cast<double>(cfg.requests * (cfg.prompt + cfg.generate));
  eo.kv_pages = std::max<int64_t>(static_cast<int64_t>(pool_tokens) / cfg.page_size,
                                  (cfg.prompt + cfg.generate) / cfg.page_size + 2);  // one fits alone
  SPX_ASSIGN_OR_RETURN(auto engine, Engine::create(model, std::shared_ptr<Backend>(std::move(backend)), eo));
  GeneratorOptions go;
  go.admission = AdmissionPolicy::kPreempt;
  go.prefix_caching = true;  // the store's path back in; the prompts share no whole page
  go.swap_preempted = swap;
  go.prefix_offload_bytes = offload_bytes;
  go.prefix_disk_bytes = disk_bytes;
  Generator g(*engine, go);
  const auto t0 = Clock::now();
  SPX_ASSIGN_OR_RETURN(std::vector<GenerationResult> results, g.run(requests));
  ModeResult out;
  out.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const GenerationStats& st = g.stats();
  out.prompt_tokens = st.prompt_tokens;
  for (GenerationResult& r : results) out.tokens.push_back(std::move(r.tokens));
  out.json = {{"mode", name},
              {"swap_preempted", swap},
              {"prefix_offload_bytes", offload_bytes},
              {"prefix_disk_bytes", disk_bytes},
              {"kv_pages", eo.kv_pages},
              {"wall_s", out.wall_s},
              {"generated_tokens", st.generated_tokens},
              {"generated_tokens_per_s",
               out.wall_s > 0 ? static_cast<double>(st.generated_tokens) / out.wall_s : 0.0},
              {"prompt_tokens_computed", st.prompt_tokens},
              {"prompt_tokens_restored", st.cached_prompt_tokens},
              {"prefill_seconds", st.prefill_seconds},
              {"decode_seconds", st.decode_seconds},
              {"decode_steps", st.decode_steps},
              {"max_batch_sequences", st.max_batch_sequences},
              {"preemptions", st.preemptions},
              {"preemption_swaps", st.preemption_swaps},
              {"prefix_restores", st.prefix_restores},
              {"prefix_disk_restores", st.prefix_disk_restores},
              {"prefix_disk_errors", st.prefix_disk_errors},
              {"swap_peak_host_bytes", st.prefix_offload_peak_bytes},
              {"swap_peak_disk_bytes", st.prefix_disk_peak_bytes}};
  std::fprintf(stderr,
               "%s: %.2f s, %lld prompt tokens computed, %lld restored, %lld preemptions, %lld swapped out\n",
               name.c_str(), out.wall_s, static_cast<long long>(st.prompt_tokens),
               static_cast<long long>(st.cached_prompt_tokens), static_cast<long long>(st.preemptions),
               static_cast<long long>(st.preemption_swaps));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"preemption on a tight KV pool: recompute vs swap to the prefix offload store"};
  Config cfg;
  std::string out = "bench_out/preemption.json";
  bool plot = false;
  app.add_option("--synthetic", cfg.model, "synthetic model shape (random weights)")->capture_default_str();
  app.add_option("--layers", cfg.layers, "layers of the synthetic model")->capture_default_str();
  app.add_option("--requests", cfg.requests, "requests, all submitted at once")->capture_default_str();
  app.add_option("--prompt-len", cfg.prompt, "prompt tokens per request")->capture_default_str();
  app.add_option("--max-tokens", cfg.generate, "tokens generated per request")->capture_default_str();
  app.add_option("--pool-fraction", cfg.pool_fraction,
                 "KV pool as a fraction of every request at its final length")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  app.add_option("--offload", cfg.offload, "host memory of the swap mode's store (SIZE)")
      ->capture_default_str();
  app.add_option("--disk", cfg.disk, "a third mode, when not 0: swapped out to this much disk (SIZE) only")
      ->capture_default_str();
  app.add_option("--threads", cfg.threads, "CPU threads (0 = all cores of the NUMA node)");
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);
  const auto fail = bench::report_failure;
  auto offload_bytes = planner::parse_size(cfg.offload);
  if (!offload_bytes.is_ok() || *offload_bytes <= 0)
    return fail(invalid_argument("--offload: " + cfg.offload));
  auto disk_bytes = planner::parse_size(cfg.disk);
  if (!disk_bytes.is_ok() || *disk_bytes < 0) return fail(invalid_argument("--disk: " + cfg.disk));
  auto model = make_synthetic_model(cfg.model, cfg.layers, DType::kF32, /*seed=*/1);
  if (!model.is_ok()) return fail(model.status());

  std::mt19937 rng(5);
  std::vector<GenerationRequest> requests(static_cast<size_t>(cfg.requests));
  for (GenerationRequest& r : requests) {
    r.prompt.resize(static_cast<size_t>(cfg.prompt));
    for (TokenId& t : r.prompt) t = static_cast<TokenId>(3 + rng() % ((*model)->config.vocab_size - 3));
    r.max_new_tokens = cfg.generate;
    r.sampling.temperature = 0.0f;
  }
  std::vector<ModeResult> modes;
  auto recompute = run_mode(cfg, *model, "recompute", false, 0, 0, requests);
  if (!recompute.is_ok()) return fail(recompute.status());
  modes.push_back(std::move(*recompute));
  auto host =
      run_mode(cfg, *model, "swap to host memory", true, static_cast<uint64_t>(*offload_bytes), 0, requests);
  if (!host.is_ok()) return fail(host.status());
  modes.push_back(std::move(*host));
  if (*disk_bytes > 0) {
    auto disk = run_mode(cfg, *model, "swap to disk", true, 0, static_cast<uint64_t>(*disk_bytes), requests);
    if (!disk.is_ok()) return fail(disk.status());
    modes.push_back(std::move(*disk));
  }
  nlohmann::json doc = {{"model", cfg.model},
                        {"layers", cfg.layers},
                        {"requests", cfg.requests},
                        {"prompt_tokens", cfg.prompt},
                        {"max_tokens", cfg.generate},
                        {"pool_fraction", cfg.pool_fraction},
                        {"threads", std::thread::hardware_concurrency()},
                        {"modes", nlohmann::json::array()}};
  for (ModeResult& m : modes) {
    m.json["same_tokens_as_recompute"] = m.tokens == modes[0].tokens;
    m.json["wall_ratio_recompute_over_this"] = m.wall_s > 0 ? modes[0].wall_s / m.wall_s : 0.0;
    doc["modes"].push_back(m.json);
  }
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_preemption.py");
  return 0;
}
