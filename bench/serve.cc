// Continuous batching through the OpenAI-compatible server: C clients, each sending streaming
// completions back to back over one keep-alive connection, against an in-process server. Per
// concurrency: output tokens/s, time to first token, inter-token latency, request latency, and
// the most sequences the engine ran in one forward — tokens/s at C clients over 1 client is the
// batching gain, measured side by side in one run. JSON (and --plot: PNG via plot_serve.py).
//
//   build/cpu/bench/bench_serve --synthetic llama-3.2-1b --layers 4 --out bench_out/serve.json --plot
#include <CLI/CLI.hpp>
#include <algorithm>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "bench/lib/report.h"
#include "bench/lib/serve_setup.h"
#include "bench/lib/sse_client.h"
#include "runtime/engine_setup.h"
#include "serving/openai/openai_server.h"

using namespace specontext;
using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;

using bench::percentile;
using bench::RequestTiming;

int main(int argc, char** argv) {
  CLI::App app{"continuous batching through the OpenAI-compatible server"};
  runtime::EngineArgs args;
  bench::add_served_model_options(app, args);
  std::vector<int64_t> concurrency = {1, 2, 4, 8};
  int64_t per_client = 2;
  bench::ServedShape shape;
  std::string out = "bench_out/serve.json";
  bool plot = false;
  app.add_option("--concurrency", concurrency, "clients sending at once, one point each")->delimiter(',');
  app.add_option("--requests-per-client", per_client, "requests each client sends back to back");
  bench::add_served_shape_options(app, shape);
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);

  const auto fail = bench::report_failure;
  auto served = bench::build_served_engine(args, shape);
  if (!served.is_ok()) return fail(served.status());
  const runtime::LoadedModel& loaded = served->loaded;
  const runtime::EngineBundle& bundle = served->bundle;
  cluster::ServerOptions so;
  so.model_name = "bench";
  so.max_waiting = 4096;
  so.scheduling.prefill_chunk = args.prefill_chunk;
  so.scheduling.prefix_caching = args.prefix_caching;  // random prompts: nothing to share
  auto server = cluster::OpenAiServer::start(*bundle.engine, *loaded.tokenizer, so);
  if (!server.is_ok()) return fail(server.status());
  const uint16_t port = (*server)->port();

  std::mt19937 rng(1);
  auto body_for = [&](std::mt19937& r) {
    return bench::random_stream_body(r, loaded.model->config.vocab_size, shape);
  };

  nlohmann::json points = nlohmann::json::array();
  double base_tps = 0;
  for (int64_t c : concurrency) {
    std::vector<std::string> bodies;
    for (int64_t i = 0; i < c * per_client; ++i) bodies.push_back(body_for(rng));
    const auto start = Clock::now();
    const std::vector<RequestTiming> timings = bench::stream_from_clients(port, bodies, c);
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<double> ttft, gaps, latency;
    int64_t tokens = 0, failed = 0;
    for (const RequestTiming& t : timings) {
      if (!t.ok) {
        ++failed;
        continue;
      }
      ttft.push_back(t.ttft_s);
      latency.push_back(t.latency_s);
      gaps.insert(gaps.end(), t.gaps_s.begin(), t.gaps_s.end());
      tokens += t.completion_tokens;
    }
    const double tps = wall > 0 ? static_cast<double>(tokens) / wall : 0;
    if (base_tps == 0) base_tps = tps;
    nlohmann::json p = {{"concurrency", c},
                        {"requests", c * per_client},
                        {"failed", failed},
                        {"wall_s", wall},
                        {"output_tokens", tokens},
                        {"output_tokens_per_s", tps},
                        {"speedup_vs_first_point", base_tps > 0 ? tps / base_tps : 0},
                        {"ttft_p50_ms", 1e3 * percentile(ttft, 0.5)},
                        {"ttft_p90_ms", 1e3 * percentile(ttft, 0.9)},
                        {"itl_p50_ms", 1e3 * percentile(gaps, 0.5)},
                        {"itl_p90_ms", 1e3 * percentile(gaps, 0.9)},
                        {"latency_p50_s", percentile(latency, 0.5)},
                        {"max_batch_sequences_since_start", (*server)->counters().max_batch_sequences}};
    std::fprintf(
        stderr, "concurrency %lld: %.2f tok/s (x%.2f) | TTFT p50 %.0f ms | ITL p50 %.0f ms | %lld failed\n",
        static_cast<long long>(c), tps, base_tps > 0 ? tps / base_tps : 0.0, p["ttft_p50_ms"].get<double>(),
        p["itl_p50_ms"].get<double>(), static_cast<long long>(failed));
    points.push_back(p);
  }
  (*server)->stop();
  nlohmann::json doc = {{"model", bench::served_model_name(args)},
                        {"layers", loaded.model->config.n_layers},
                        {"sparse", bundle.method_name},
                        {"prompt_tokens", shape.prompt_tokens},
                        {"max_tokens", shape.max_tokens},
                        {"max_batch", shape.max_batch},
                        {"requests_per_client", per_client},
                        {"threads", std::thread::hardware_concurrency()},
                        {"points", points}};
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_serve.py");
  return 0;
}
