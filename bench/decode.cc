// Dense decode tokens/s versus context length and batch on a synthetic model, next to the
// measured memory bandwidth and the roofline (bytes that must be read per step ÷ bandwidth).
// Writes JSON (and a PNG through bench/plot_decode.py when --plot is given).
//
//   build/release/bench/bench_decode --out bench_out/decode.json --plot
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bench/lib/membw.h"
#include "bench/lib/report.h"
#include "core/engine/engine.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"

using namespace specontext;

namespace {

int64_t matrix_bytes(const WeightMatrix& w) { return static_cast<int64_t>(w.bytes()); }

// Weight bytes one decode step must read: every layer matrix and the LM head (the embedding
// table contributes one row per token).
int64_t weight_bytes_per_step(const Model& m) {
  int64_t b = matrix_bytes(m.lm_head);
  for (const auto& l : m.layers) {
    for (const WeightMatrix* w : l.matrices()) b += matrix_bytes(*w);
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dense decode throughput vs context and batch"};
  std::string model_name = "llama-3.2-1b";
  int64_t layers = 4;
  std::vector<int64_t> contexts = {1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<int64_t> batches = {1, 4, 16};
  int steps = 4;
  std::string out = "bench_out/decode.json";
  std::string dtype = "f32";
  std::string kv_dtype = "f32";
  bool plot = false;
  app.add_option("--synthetic", model_name, "synthetic model shape");
  app.add_option("--layers", layers, "layers kept");
  app.add_option("--contexts", contexts, "context lengths")->delimiter(',');
  app.add_option("--batches", batches, "batch sizes")->delimiter(',');
  app.add_option("--steps", steps, "timed decode steps per point");
  app.add_option("--dtype", dtype, "weight dtype (f32, bf16)")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--kv-dtype", kv_dtype, "KV cache dtype (f32, f16, bf16)")->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--out", out, "JSON output path");
  app.add_flag("--plot", plot, "also write a PNG next to the JSON (python3 + matplotlib)");
  CLI11_PARSE(app, argc, argv);

  const auto bw = bench::measure_triad(size_t{512} << 20, 10);
  std::fprintf(stderr, "triad bandwidth: %.2f GB/s (%d threads)\n", bw.triad_gb_per_s, bw.threads);

  auto model = make_synthetic_model(model_name, layers, dtype == "bf16" ? DType::kBF16 : DType::kF32, 1);
  if (!model.is_ok()) {
    std::fprintf(stderr, "error: %s\n", model.status().to_string().c_str());
    return 1;
  }
  const int64_t weight_bytes = weight_bytes_per_step(**model);
  nlohmann::json results = nlohmann::json::array();
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  for (int64_t batch : batches) {
    auto backend = cpu::create_cpu_backend({});
    if (!backend.is_ok()) {
      std::fprintf(stderr, "error: %s\n", backend.status().to_string().c_str());
      return 1;
    }
    EngineOptions eo;
    eo.max_sequences = batch;
    eo.max_context = max_ctx + steps + 2;
    eo.kv_dtype = dtype_from_name(kv_dtype).value_or(DType::kF32);  // CLI11 checked the name
    auto engine = Engine::create(*model, std::shared_ptr<Backend>(std::move(*backend)), eo);
    if (!engine.is_ok()) {
      std::fprintf(stderr, "error: %s\n", engine.status().to_string().c_str());
      return 1;
    }
    Engine& e = **engine;
    for (int64_t ctx : contexts) {
      std::vector<SeqId> seqs;
      for (int64_t i = 0; i < batch; ++i) {
        auto s = e.memory().add_sequence();
        if (!s.is_ok() || !e.fill_synthetic(*s, ctx, static_cast<uint64_t>(i + 1)).is_ok()) {
          std::fprintf(stderr, "error: cannot set up batch %lld context %lld\n", (long long)batch, (long long)ctx);
          return 1;
        }
        seqs.push_back(*s);
      }
      std::vector<TokenId> tokens(static_cast<size_t>(batch), 1);
      std::vector<StepRequest> reqs;
      for (int64_t i = 0; i < batch; ++i) reqs.push_back({seqs[i], std::span<const TokenId>(&tokens[i], 1), LogitsMode::kLast});
      double seconds = 0.0;
      for (int s = 0; s <= steps; ++s) {  // step 0 warms up
        const auto t0 = std::chrono::steady_clock::now();
        auto r = e.forward(reqs);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!r.is_ok()) {
          std::fprintf(stderr, "error: %s\n", r.status().to_string().c_str());
          return 1;
        }
        if (s > 0) seconds += dt;
      }
      const double step_s = seconds / steps;
      const int64_t kv_bytes = batch * (ctx + steps / 2) * e.memory().kv_bytes_per_token();
      const double bytes = static_cast<double>(weight_bytes + kv_bytes);
      const double roofline_step_s = bytes / (bw.triad_gb_per_s * 1e9);
      nlohmann::json row = {
          {"batch", batch}, {"context", ctx}, {"step_seconds", step_s},
          {"tokens_per_s", batch / step_s}, {"bytes_per_step", bytes},
          {"weight_bytes", weight_bytes}, {"kv_bytes", kv_bytes},
          {"roofline_tokens_per_s", batch / roofline_step_s},
          {"fraction_of_roofline", roofline_step_s / step_s},
          {"achieved_gb_per_s", bytes / step_s / 1e9}};
      std::fprintf(stderr, "batch %3lld context %6lld: %8.2f tok/s  (roofline %8.2f, %.0f%%, %.1f GB/s)\n",
                   (long long)batch, (long long)ctx, batch / step_s, batch / roofline_step_s,
                   100.0 * roofline_step_s / step_s, bytes / step_s / 1e9);
      results.push_back(row);
      for (SeqId s : seqs) (void)e.memory().remove_sequence(s);
    }
  }
  nlohmann::json doc = {
      {"command", "bench_decode"},
      {"model", model_name}, {"layers", layers}, {"dtype", dtype}, {"kv_dtype", kv_dtype},
      {"triad_gb_per_s", bw.triad_gb_per_s}, {"threads", bw.threads},
      {"note", "synthetic weights and random KV: measures speed, not quality"},
      {"results", results}};
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_decode.py");
  return 0;
}
