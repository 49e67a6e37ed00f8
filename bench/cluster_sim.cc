// A discrete-event simulator of R `serve` replicas behind the router (issue #31 item 5;
// bench/sim/cluster_sim.h): predicts bench_loadgen's report for a topology from a calibration file
// of per-step costs, on the same trace. A sweep over --replicas writes one report per count.
//
//   bench_cluster_sim --calibrate bench_out/loadgen_r1.json --trace T.jsonl --write-calibration bench/sim/cal.json
//   bench_cluster_sim --calibration bench/sim/cal.json --trace T.jsonl --replicas 2 --policy prefix
//       --cpus 2 --compare bench_out/loadgen_r2.json --out bench_out/sim_r2.json
//   bench_cluster_sim --calibration bench/sim/cal.json --trace T.jsonl --replicas 1,2,4,8,16,32,64 --time-scale 0.05
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "bench/lib/loadgen.h"
#include "bench/lib/report.h"
#include "bench/sim/cluster_sim.h"
#include "planner/units.h"

using namespace specontext;
namespace lg = specontext::bench::loadgen;
namespace sim = specontext::bench::sim;
using json = nlohmann::json;

int main(int argc, char** argv) {
  CLI::App app{"discrete-event simulator of serve replicas behind the router (predicts bench_loadgen's report)"};
  std::vector<std::string> calibrate_from, calibrate_traces, calibrate_cpu;
  std::string trace_path, calibration_path, write_calibration, compare_path, replicas_list = "1";
  std::string policy = "rr", device_kv, host_kv, remote_kv, out = "bench_out/cluster_sim.json";
  bool plot = false, no_router = false, no_prefix_caching = false, store = false, store_dead = false;
  double store_gbps = 1, store_latency_ms = 0.2, store_dead_ms = 0, host_gbps = 20, remote_gbps = 4;
  int64_t store_chunk_tokens = 256;
  double slo_ttft_ms = 1000, slo_tpot_ms = 100;
  int64_t threads_per_replica = 0;
  lg::SynthOptions synth;
  sim::Topology topo;
  lg::Slo slo;
  app.add_option("--trace", trace_path, "JSONL trace (bench/lib/loadgen.h); default: the synthetic trace below");
  app.add_option("--calibration", calibration_path, "calibration JSON (per-step costs; bench/sim/README in bench/README.md)");
  app.add_option("--calibrate", calibrate_from,
                 "fit the costs from bench_loadgen reports of one replica (repeat; each with a --calibrate-trace, "
                 "else --trace); writes --write-calibration");
  app.add_option("--calibrate-trace", calibrate_traces, "the trace of each --calibrate report, in order");
  app.add_option("--calibrate-cpu", calibrate_cpu,
                 "bench_loadgen reports whose REPORT.cpu.json (bench/sim/cluster_run.sh) give the router's, load "
                 "generator's, store's and replicas' CPU seconds per request (repeat; default: each --calibrate report "
                 "that has one); the calibration's cpu_per_request");
  app.add_option("--write-calibration", write_calibration, "where --calibrate writes the calibration");
  app.add_option("--threads-per-replica", threads_per_replica, "compute threads of one replica (--calibrate; default 1)");
  app.add_option("--replicas", replicas_list, "replica count, or a list (1,2,4,...,64) for a sweep");
  app.add_option("--policy", policy, "router policy: rr, least-load or prefix");
  app.add_option("--prefix-chunk-bytes", topo.policy.chunk_bytes, "prefix policy: bytes per hashed chunk (router's 64)");
  app.add_option("--prefix-match-ratio", topo.policy.match_ratio, "prefix policy: least share of chunks matched");
  app.add_option("--balance-threshold", topo.policy.balance_abs_threshold, "prefix policy: in-flight imbalance allowed");
  app.add_flag("--no-router", no_router, "clients talk to the replica directly (no router overhead)");
  app.add_option("--max-batch", topo.max_batch, "sequences per replica at once (serve --max-batch)");
  app.add_flag("--no-prefix-caching", no_prefix_caching, "no prefix cache in the replicas");
  app.add_option("--prefix-cache-slots", topo.prefix_cache_slots, "finished sequences a replica keeps (serve's 16)");
  app.add_option("--max-waiting", topo.max_waiting, "serve --max-waiting: queued requests before 503 (0: no bound)")
      ->capture_default_str();
  app.add_option("--max-connections", topo.max_connections, "serve --max-connections: 503 past it (0: no bound)")
      ->capture_default_str();
  app.add_option("--max-connections-per-ip", topo.max_connections_per_ip,
                 "serve --max-connections-per-ip: 429 past it (0: no bound)")
      ->capture_default_str();
  app.add_option("--router-max-connections", topo.router_max_connections,
                 "router --max-connections: 503 past it (0: no bound)")
      ->capture_default_str();
  app.add_option("--cpus", topo.cpus, "cores the replicas share (0: each has its own)");
  app.add_flag("--store", store, "a shared prefix store (Redis) behind every replica");
  app.add_flag("--store-dead", store_dead, "the store is down: every lookup fails");
  app.add_option("--store-gbps", store_gbps, "link to the store, GB/s");
  app.add_option("--store-latency-ms", store_latency_ms, "per store lookup");
  app.add_option("--store-dead-ms", store_dead_ms, "what a failed lookup costs");
  app.add_option("--store-chunk-tokens", store_chunk_tokens,
                 "serve's --prefix-store-chunk: a prompt writes the chunks the store lacks (and its last one); "
                 "a hit reads those after the whole chunks a kept sequence holds")
      ->capture_default_str();
  app.add_option("--device-kv", device_kv, "device KV bytes per replica (planner; default: unlimited)");
  app.add_option("--host-kv", host_kv, "host KV pool per replica");
  app.add_option("--host-gbps", host_gbps, "host pool ↔ device, GB/s");
  app.add_option("--remote-kv", remote_kv, "remote KV pool per replica");
  app.add_option("--remote-gbps", remote_gbps, "remote pool link, GB/s");
  app.add_option("--time-scale", topo.time_scale, "multiply the trace's arrival times (0.5: twice the rate)");
  app.add_option("--noise", topo.noise, "log-normal sigma on each step (0: exact; -1: the calibration's)");
  app.add_option("--sim-seed", topo.seed, "the noise's seed");
  app.add_option("--slo-ttft-ms", slo_ttft_ms, "goodput SLO: time to first token");
  app.add_option("--slo-tpot-ms", slo_tpot_ms, "goodput SLO: time per output token after the first");
  app.add_option("--compare", compare_path, "a bench_loadgen report to put beside the prediction (one --replicas)");
  lg::add_synth_options(app, synth);
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);
  const auto fail = bench::report_failure;

  auto loaded = lg::trace_or_synth(trace_path, synth);
  if (!loaded.is_ok()) return fail(loaded.status());
  lg::Trace trace = std::move(*loaded);

  sim::Calibration cal;
  if (!calibration_path.empty()) {
    auto c = sim::load_calibration(calibration_path);
    if (!c.is_ok()) return fail(c.status());
    cal = *c;
  }
  if (!calibrate_from.empty()) {
    if (!calibrate_traces.empty() && calibrate_traces.size() != calibrate_from.size()) {
      return fail(invalid_argument("--calibrate-trace: one per --calibrate report"));
    }
    std::vector<sim::MeasuredRun> runs;
    for (size_t k = 0; k < calibrate_from.size(); ++k) {
      std::ifstream f(calibrate_from[k]);
      const json measured = f ? json::parse(f, nullptr, false) : json();
      if (measured.is_discarded() || measured.is_null()) return fail(invalid_argument("cannot read " + calibrate_from[k]));
      lg::Trace t = trace;
      if (!calibrate_traces.empty()) {
        auto ct = lg::load_trace(calibrate_traces[k]);
        if (!ct.is_ok()) return fail(ct.status());
        t = std::move(*ct);
      }
      runs.push_back({measured, std::move(t)});
    }
    if (threads_per_replica > 0) cal.threads_per_replica = threads_per_replica;
    auto c = sim::calibrate_from_loadgen(runs, cal, topo.max_batch);
    if (!c.is_ok()) return fail(c.status());
    for (const auto& f : calibrate_from) c->source += " " + f;
    // The CPU the router, load generator, store and replicas (beyond their engines' steps) took
    // per request: the runs' CPU sidecars; a --calibrate run's engine busy time is simulated.
    std::vector<sim::CpuRun> cpu_runs;
    const bool explicit_cpu = !calibrate_cpu.empty();
    for (const std::string& path : explicit_cpu ? calibrate_cpu : calibrate_from) {
      std::ifstream fc(path + ".cpu.json");
      if (!fc) {
        if (explicit_cpu) return fail(invalid_argument("--calibrate-cpu: cannot read " + path + ".cpu.json"));
        continue;
      }
      sim::CpuRun run{json(), json::parse(fc, nullptr, false), -1};
      std::ifstream fr(path);
      run.report = fr ? json::parse(fr, nullptr, false) : json();
      if (run.cpu.is_discarded() || run.report.is_discarded() || run.report.is_null()) {
        return fail(invalid_argument("cannot read " + path + " or " + path + ".cpu.json"));
      }
      for (size_t k = 0; k < calibrate_from.size(); ++k) {
        if (calibrate_from[k] != path) continue;
        sim::Topology one;
        one.max_batch = topo.max_batch;
        auto out = sim::simulate(runs[k].trace, *c, one);
        if (!out.is_ok()) return fail(out.status());
        run.engine_busy_s = sim::engine_busy_s(*out);
      }
      cpu_runs.push_back(std::move(run));
    }
    if (!cpu_runs.empty()) {
      auto p = sim::process_cpu_from_runs(cpu_runs);
      if (!p.is_ok()) return fail(p.status());
      c->cpu_per_request = *p;
      c->source += "; cpu_per_request from " + std::to_string(cpu_runs.size()) + " CPU sidecar(s)";
    }
    const json j = sim::calibration_to_json(*c);
    if (write_calibration.empty()) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::ofstream o(write_calibration);
      o << j.dump(2) << "\n";
      if (!o) return fail(invalid_argument("cannot write " + write_calibration));
      std::fprintf(stderr, "wrote %s\n", write_calibration.c_str());
    }
    return 0;
  }
  if (calibration_path.empty()) return fail(invalid_argument("--calibration FILE is required (or --calibrate)"));

  auto p = router::parse_policy(policy);
  if (!p) return fail(invalid_argument("--policy: rr, least-load or prefix"));
  topo.policy.policy = *p;
  topo.router = !no_router;
  topo.prefix_caching = !no_prefix_caching;
  topo.store = {store || store_dead, !store_dead, store_gbps * 1e9, store_latency_ms / 1e3, store_dead_ms / 1e3,
                store_chunk_tokens};
  auto size_of = [](const std::string& s, int64_t& v, const char* what) -> Status {
    if (s.empty()) return Status::ok();
    auto r = planner::parse_size(s);
    if (!r.is_ok()) return r.status().with_context(what);
    v = *r;
    return Status::ok();
  };
  for (auto st : {size_of(device_kv, topo.tiers.device_kv_bytes, "--device-kv"),
                  size_of(host_kv, topo.tiers.host_kv_bytes, "--host-kv"),
                  size_of(remote_kv, topo.tiers.remote_kv_bytes, "--remote-kv")}) {
    if (!st.is_ok()) return fail(st);
  }
  topo.tiers.host_bandwidth_bps = host_gbps * 1e9;
  topo.tiers.remote_bandwidth_bps = remote_gbps * 1e9;
  slo.ttft_s = slo_ttft_ms / 1e3;
  slo.tpot_s = slo_tpot_ms / 1e3;
  auto counts = planner::parse_number_list(replicas_list);
  if (!counts.is_ok() || counts->empty()) return fail(invalid_argument("--replicas: a count or a list like 1,2,4"));

  json reports = json::array();
  for (double n : *counts) {
    if (n < 1 || n > 100000 || n != std::floor(n)) return fail(invalid_argument("--replicas: whole numbers in [1, 1e5]"));
    topo.replicas = static_cast<int64_t>(n);
    auto r = sim::simulate(trace, cal, topo);
    if (!r.is_ok()) return fail(r.status());
    json rep = sim::report(*r, topo, slo);
    const json& s = rep["summary"];
    std::fprintf(stderr,
                 "R=%-5lld %lld/%lld ok | %.2f req/s, %.1f tok/s, goodput %.2f req/s | TTFT p50 %.1f p99 %.1f ms | "
                 "ITL p50 %.2f p99 %.2f ms | prefix hit %.2f | wall %.2f s\n",
                 static_cast<long long>(topo.replicas), static_cast<long long>(s["ok"].get<int64_t>()),
                 static_cast<long long>(s["requests"].get<int64_t>()), s["requests_per_s"].get<double>(),
                 s["output_tokens_per_s"].get<double>(), s["goodput_requests_per_s"].get<double>(),
                 s["ttft_ms"]["p50"].get<double>(), s["ttft_ms"]["p99"].get<double>(), s["itl_ms"]["p50"].get<double>(),
                 s["itl_ms"]["p99"].get<double>(), rep["metrics"]["serve"]["prefix_cache_hit_rate"].get<double>(),
                 s["wall_s"].get<double>());
    reports.push_back(std::move(rep));
  }
  json doc = {{"trace", trace_path.empty() ? std::string("synthetic") : trace_path},
              {"calibration", sim::calibration_to_json(cal)}};
  if (reports.size() == 1) {
    doc["summary"] = reports[0]["summary"];
    doc["metrics"] = reports[0]["metrics"];
    doc["topology"] = reports[0]["topology"];
  } else {
    doc["sweep"] = reports;
  }
  if (!compare_path.empty()) {
    if (reports.size() != 1) return fail(invalid_argument("--compare takes one --replicas count"));
    std::ifstream f(compare_path);
    const json measured = f ? json::parse(f, nullptr, false) : json();
    if (measured.is_discarded() || measured.is_null()) return fail(invalid_argument("cannot read " + compare_path));
    doc["compare"] = sim::compare(measured, reports[0]);
    std::fprintf(stderr, "%-28s %12s %12s %8s\n", "metric", "measured", "predicted", "error");
    for (const json& row : doc["compare"]) {
      std::fprintf(stderr, "%-28s %12.4g %12.4g %7s\n", row["metric"].get<std::string>().c_str(),
                   row["measured"].get<double>(), row["predicted"].get<double>(),
                   row["error"].is_null() ? "-"
                                          : (std::to_string(static_cast<int>(std::lround(100 * row["error"].get<double>()))) + "%").c_str());
    }
  }
  if (plot) std::fprintf(stderr, "bench_cluster_sim: no plot (--plot only says so; the JSON has every figure)\n");
  bench::write_report(doc, out, false, "");
  return 0;
}
