// A trace-driven open-loop load generator for any OpenAI-compatible endpoint (`specontext serve`,
// `specontext router`, another server): requests go out at the trace's arrival times whatever the
// server does (a session's next turn also waits for its previous answer, which it carries in its
// prompt), each a streaming /v1/completions on its own connection. Reports goodput under an SLO,
// TTFT / ITL / TPOT / latency percentiles, errors, and the deltas of the servers' /metrics over
// the run (prefix cache hits, per-tier traffic, the router's choices and hit rate). JSON (and
// --plot: PNG via plot_loadgen.py). Trace format and semantics: lib/loadgen.h.
//
//   bench_loadgen --make-trace bench_out/trace.jsonl --rate 2 --requests 60 --sessions 8 --turns 4
//   bench_loadgen --target 127.0.0.1:8000 --trace bench_out/trace.jsonl --out bench_out/loadgen.json --plot
//   bench_loadgen --target 127.0.0.1:8000 --rate 2 --requests 60   (the synthetic trace, not written)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "bench/lib/loadgen.h"
#include "bench/lib/report.h"

using namespace specontext;
namespace lg = specontext::bench::loadgen;
using json = nlohmann::json;

namespace {

// HOST:PORT (the port 1..65535).
Result<std::pair<std::string, uint16_t>> host_port(const std::string& s) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    return invalid_argument("'" + s + "': expected HOST:PORT");
  }
  char* end = nullptr;
  const long port = std::strtol(s.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 1 || port > 65535) return invalid_argument("'" + s + "': the port must be 1..65535");
  std::string host = s.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::pair{host, static_cast<uint16_t>(port)};
}

json request_record(const lg::RequestResult& r, const lg::Slo& slo, bool record_text) {
  double itl_mean = 0;
  for (double g : r.gaps_s) itl_mean += g;
  if (!r.gaps_s.empty()) itl_mean /= static_cast<double>(r.gaps_s.size());
  json j = {{"index", r.index},
            {"line", r.line},
            {"session", r.session},
            {"kind", r.kind},
            {"scheduled_at_s", r.scheduled_at_s},
            {"sent_at_s", r.sent_at_s},
            {"ttft_ms", 1e3 * r.ttft_s},
            {"itl_mean_ms", 1e3 * itl_mean},
            {"latency_s", r.latency_s},
            {"prompt_bytes", r.prompt_bytes},
            {"prompt_tokens", r.prompt_tokens},
            {"cached_tokens", r.cached_tokens},
            {"completion_tokens", r.completion_tokens},
            {"max_tokens", r.max_tokens},
            {"ok", r.ok},
            {"within_slo", lg::meets_slo(r, slo)}};
  if (!r.ok) j["error"] = r.error;
  if (record_text) {
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(r.prompt_hash));
    j["text"] = r.text;
    j["prompt_fnv1a"] = hash;
  }
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trace-driven open-loop load generator for an OpenAI-compatible endpoint"};
  std::string target, trace_path, make_trace, model, api_key_file, out = "bench_out/loadgen.json";
  std::vector<std::string> scrape;
  std::vector<std::string> compare;
  bool plot = false, no_ignore_eos = false, record_text = false;
  lg::SynthOptions synth;
  lg::RunOptions run;
  lg::Slo slo;
  double slo_ttft_ms = 1000, slo_tpot_ms = 100;
  app.add_option("--target", target, "HOST:PORT of the OpenAI-compatible endpoint (serve or router)");
  app.add_option("--trace", trace_path, "JSONL trace (lib/loadgen.h); default: the synthetic trace of the options below");
  app.add_option("--make-trace", make_trace, "write the synthetic trace to this file and exit");
  app.add_option("--model", model, "the requests' \"model\" field (default: left out)");
  app.add_option("--api-key-file", api_key_file, "file whose first line is the API key (Authorization: Bearer)");
  app.add_option("--scrape", scrape,
                 "HOST:PORT whose /metrics is read before and after the run (default: the target; repeat for "
                 "the replicas behind a router)");
  app.add_option("--slo-ttft-ms", slo_ttft_ms, "goodput SLO: time to first token");
  app.add_option("--slo-tpot-ms", slo_tpot_ms, "goodput SLO: time per output token after the first");
  app.add_option("--slo-latency-s", slo.latency_s, "goodput SLO: whole request (0: no bound)");
  app.add_option("--timeout-s", run.timeout_s, "per request, from its send");
  app.add_option("--max-in-flight", run.max_in_flight, "requests at once (past it arrivals wait; send lag shows it)");
  app.add_option("--time-scale", run.time_scale, "multiply the trace's arrival times (0.5: twice the rate)");
  app.add_flag("--record-text", record_text,
               "keep each request's answer text and its prompt's fnv1a64 in the report (for --compare-texts)");
  app.add_option("--compare-texts", compare,
                 "BASELINE.json RUN.json: two --record-text reports of one trace, request by request (same text, "
                 "different text, failed, prompt changed after a failed turn); JSON on stdout, exit 3 when a "
                 "text differs")
      ->expected(2);
  app.add_flag("--no-ignore-eos", no_ignore_eos, "let answers stop at EOS (default: ignore_eos, max_tokens each)");
  lg::add_synth_options(app, synth);
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);
  const auto fail = bench::report_failure;

  if (!compare.empty()) {
    json docs[2];
    for (int k = 0; k < 2; ++k) {
      std::ifstream f(compare[k], std::ios::binary);
      docs[k] = json::parse(f, nullptr, false);
      if (!f.is_open() || docs[k].is_discarded()) return fail(invalid_argument("cannot read JSON from " + compare[k]));
    }
    auto c = lg::compare_texts(docs[0], docs[1]);
    if (!c.is_ok()) return fail(c.status());
    std::printf("%s\n", c->dump(2).c_str());
    return (*c)["different"].get<int64_t>() == 0 ? 0 : 3;
  }

  if (!make_trace.empty()) {
    auto text = lg::synth_trace(synth);
    if (!text.is_ok()) return fail(text.status());
    std::ofstream f(make_trace, std::ios::binary);
    f << *text;
    if (!f) return fail(invalid_argument("cannot write " + make_trace));
    std::fprintf(stderr, "wrote %s\n", make_trace.c_str());
    return 0;
  }
  if (target.empty()) return fail(invalid_argument("--target HOST:PORT is required (or --make-trace FILE)"));
  auto hp = host_port(target);
  if (!hp.is_ok()) return fail(hp.status().with_context("--target"));
  run.host = hp->first;
  run.port = hp->second;
  run.model = model;
  run.ignore_eos = !no_ignore_eos;
  slo.ttft_s = slo_ttft_ms / 1e3;
  slo.tpot_s = slo_tpot_ms / 1e3;
  if (!api_key_file.empty()) {
    std::ifstream f(api_key_file);
    if (!f || !std::getline(f, run.api_key)) return fail(invalid_argument("cannot read --api-key-file"));
    if (!run.api_key.empty() && run.api_key.back() == '\r') run.api_key.pop_back();
  }

  auto loaded = lg::trace_or_synth(trace_path, synth);
  if (!loaded.is_ok()) return fail(loaded.status());
  lg::Trace trace = std::move(*loaded);

  if (scrape.empty()) scrape.push_back(target);
  std::vector<std::pair<std::string, uint16_t>> scraped;
  for (const std::string& s : scrape) {
    auto e = host_port(s);
    if (!e.is_ok()) return fail(e.status().with_context("--scrape"));
    scraped.push_back(*e);
  }
  auto scrape_all = [&] {
    std::vector<std::map<std::string, double>> m;
    for (const auto& [h, p] : scraped) {
      auto text = lg::http_get(h, p, "/metrics", run.api_key, 10);
      if (!text.is_ok()) std::fprintf(stderr, "/metrics: %s\n", text.status().to_string().c_str());
      m.push_back(text.is_ok() ? lg::parse_prometheus(*text) : std::map<std::string, double>{});
    }
    return m;
  };
  const auto before = scrape_all();
  std::fprintf(stderr, "%zu requests to %s ...\n", trace.requests.size(), target.c_str());
  auto result = lg::run_trace(trace, run);
  if (!result.is_ok()) return fail(result.status());
  const auto after = scrape_all();

  json metrics = json::object();
  for (size_t k = 0; k < scrape.size(); ++k) metrics[scrape[k]] = lg::metrics_delta(before[k], after[k]);
  const json summary = lg::summarize(result->results, result->wall_s, slo);
  json requests = json::array();
  for (const auto& r : result->results) requests.push_back(request_record(r, slo, record_text));
  json doc = {{"target", target},
              {"trace", trace_path.empty() ? std::string("synthetic") : trace_path},
              {"prefixes", trace.prefixes.size()},
              {"ignore_eos", run.ignore_eos},
              {"temperature", 0},
              {"time_scale", run.time_scale},
              {"threads", std::thread::hardware_concurrency()},
              {"summary", summary},
              {"scheduler",
               {{"workers", result->workers},
                {"turns_handed_on", result->turns_handed_on},
                {"wakeups", result->wakeups},
                {"wakeups_per_request",
                 result->results.empty() ? 0.0
                                         : static_cast<double>(result->wakeups) / result->results.size()}}},
              {"metrics", metrics},
              {"requests", requests}};
  if (trace_path.empty()) {
    doc["synthetic"] = {{"arrival", synth.arrivals.process}, {"rate", synth.arrivals.rate},
                        {"burst_size", synth.arrivals.burst_size}, {"seed", synth.arrivals.seed},
                        {"requests", synth.requests}, {"sessions", synth.sessions},
                        {"turns", synth.turns}, {"prefixes", synth.prefixes},
                        {"prefix_words", synth.prefix_words}, {"turn_words", synth.turn_words},
                        {"tool_words", synth.tool_words}, {"agent_fraction", synth.agent_fraction},
                        {"max_tokens", synth.max_tokens}};
  }
  std::fprintf(stderr,
               "%lld/%lld ok | goodput %.2f req/s (%.0f%% within SLO), %.1f tok/s | TTFT p50 %.0f p99 %.0f ms | "
               "ITL p50 %.0f p99 %.0f ms | wall %.1f s\n",
               static_cast<long long>(summary["ok"].get<int64_t>()),
               static_cast<long long>(summary["requests"].get<int64_t>()),
               summary["goodput_requests_per_s"].get<double>(), 100 * summary["goodput_fraction"].get<double>(),
               summary["goodput_tokens_per_s"].get<double>(), summary["ttft_ms"]["p50"].get<double>(),
               summary["ttft_ms"]["p99"].get<double>(), summary["itl_ms"]["p50"].get<double>(),
               summary["itl_ms"]["p99"].get<double>(), result->wall_s);
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_loadgen.py");
  return summary["errors"].get<int64_t>() == 0 ? 0 : 2;
}
