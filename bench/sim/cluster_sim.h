// A discrete-event simulator of a serving cluster (issue #31 item 5): R `serve` replicas behind a
// router policy (serving/router/router_policy.h, the router's own code), each a continuous-batching
// engine whose steps cost what a calibration file says (prefill per token, decode step as a
// function of batch size and context), a prefix cache per replica and optionally a shared prefix
// store (hits save prefill; the store's latency and link bandwidth cost time; a dead one costs only
// recomputation), KV placement per the planner's memory model (planner/plan.h: what fits on the
// device, what goes to host or remote pools, each offloaded layer's KV charged at its tier's
// bandwidth every decode step), driven by the load generator's trace (bench/lib/loadgen.h, its
// parser) with its session semantics, and reporting the load generator's summary
// (loadgen::summarize) so measurement and prediction sit side by side.
//
// Time is simulated: nothing sleeps, nothing reads a clock; the same inputs and seed give the same
// report. Token counts come from text lengths (bytes per token, calibrated), answers are filler
// text of the calibrated length, so prefix matching works on bytes as the router's does.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/lib/loadgen.h"
#include "core/base/status.h"
#include "planner/snapshot.h"
#include "serving/router/router_policy.h"

namespace specontext::bench::sim {

// Per-step costs of one replica, in seconds (a calibration file's "costs").
struct StepCosts {
  double request_overhead_s = 0;      // per request at its replica before its prefill (HTTP, parse, tokenize)
  double router_overhead_s = 0;       // per request through the router (0 without one)
  double prefill_base_s = 0;          // per prefilled request
  double prefill_per_token_s = 0;     // per computed (not cached) prompt token
  // The share of the prefill cost that occupies the engine (the rest: request workers parsing and
  // tokenizing in parallel, a delay before the request queues). 1: all of it.
  double prefill_serial_fraction = 1;
  double decode_base_s = 0;           // per decode step
  double decode_per_seq_s = 0;        // per sequence in the step
  double decode_per_ctx_token_s = 0;  // per context token, summed over the step's sequences
  bool operator==(const StepCosts&) const = default;
};

// CPU seconds per trace request of the processes that share the replicas' cores (Topology::cpus
// > 0): the router, the load generator, the store (a calibration file's "cpu_per_request", from
// bench/sim/cluster_run.sh's OUT.json.cpu.json of the calibration runs; 0: none, today's model).
struct ProcessCpu {
  double router_s = 0;   // charged when requests pass the router (Topology::router)
  double loadgen_s = 0;  // the load generator, every request
  double store_s = 0;    // the store (redis-server), when it is enabled and alive
  // A replica's CPU beyond its engine's steps (HTTP, parsing and tokenizing on request workers,
  // its other threads): serve's CPU less the simulated engine busy time, per request.
  double replica_s = 0;
  bool operator==(const ProcessCpu&) const = default;
};

// What the simulator knows of the machine and model (JSON: calibration_to_json).
struct Calibration {
  std::string source;  // how it was obtained (free text)
  StepCosts costs;
  double prompt_bytes_per_token = 4;  // prompt text bytes per token (the model's tokenizer)
  double output_bytes_per_token = 4;  // answer text bytes per generated token
  double noise = 0;  // log-normal sigma of the steps seen in the calibration runs (Topology::noise < 0 takes it)
  int64_t page_tokens = 16;           // prefix caching works on whole pages
  int64_t threads_per_replica = 1;    // compute threads of one replica (for --cpus sharing)
  ProcessCpu cpu_per_request;         // the other processes on the replicas' cores (--cpus sharing)
  // The planner's model shape (stories260K by default) and KV element bytes.
  planner::ModelShape model{5, 4, 8, 8, 0};
  int64_t kv_elem_bytes = 4;
  int64_t max_context = 512;
  int64_t kv_bytes_per_token() const { return 2 * kv_elem_bytes * model.layers * model.kv_heads * model.head_dim; }
};

Result<Calibration> calibration_from_json(const nlohmann::json& j);
nlohmann::json calibration_to_json(const Calibration& c);
Result<Calibration> load_calibration(const std::string& path);

// A prefix store shared by all replicas (Redis in serve: --prefix-store).
struct StoreOptions {
  bool enabled = false;
  bool alive = true;            // false: every lookup fails (after dead_timeout_s) and nothing is stored
  double bandwidth_bps = 1e9;   // link to the store, bytes/s
  double latency_s = 0;         // per round trip: one lookup (hit or miss), then one per chunk read
  double dead_timeout_s = 0;    // what a failed lookup costs
  // serve's --prefix-store-chunk (rounded up to whole pages): a prompt writes the chunks the store
  // lacks, and its last, shorter chunk always (the next turn's key for it differs), counted as
  // serve's chunks_written / chunks_skipped. A hit reads
  // the chunks after the whole ones the replica's kept sequences hold (those are forked, as
  // serve's PrefixStore::restore_shared does), from chunk 0 when it keeps none; counted as serve's
  // chunks_read / chunks_local. Not modelled: serve's fallback to a read from 0 when no slot is
  // left for the fork.
  int64_t chunk_tokens = 256;
};

// KV tiers per replica, for the planner (0 device bytes: no limit, no planning).
struct TierOptions {
  int64_t device_kv_bytes = 0;
  int64_t host_kv_bytes = 0;
  double host_bandwidth_bps = 20e9;
  int64_t remote_kv_bytes = 0;
  double remote_bandwidth_bps = 4e9;
};

struct Topology {
  int64_t replicas = 1;
  router::PolicyOptions policy;  // the router's policy (rr, least-load, prefix) and its knobs
  bool router = true;            // requests pass a router (its overhead); false: one replica, direct
  int64_t max_batch = 8;         // sequences a replica runs at once (serve --max-batch)
  bool prefix_caching = true;
  int64_t prefix_cache_slots = 16;  // finished sequences a replica keeps (serve --prefix-cache-slots)
  // serve's admission bounds (their defaults: bin/commands.h ServeArgs; 0: no bound), checked as
  // serve checks them. When the router (or, without one, the load generator) opens a connection
  // to a replica: at max_connections open it is answered 503 ("server at its connection limit"),
  // else at max_connections_per_ip open from one address 429 ("too many connections from ...";
  // every connection comes from one address, the router's or the load generator's). A request
  // holds its connection until its answer ends. When it is submitted after its preparation: with
  // max_waiting requests queued behind the running batch, 503 ("server busy"). The router relays a
  // 429; a 503 it tries on a replica not yet tried (counted as a retry), relaying the 503 when
  // none is left (router.unavailable). router_max_connections: the router's own --max-connections
  // (503 to the client, no replica tried). Refused requests are errors in the report, as
  // bench_loadgen counts them ("HTTP 429: ..." / "HTTP 503: ..."), and a refused turn ends its
  // session's turn without an answer (the next turn goes on, as bench_loadgen's does).
  int64_t max_connections = 1024;
  int64_t max_connections_per_ip = 256;
  int64_t max_waiting = 256;
  int64_t router_max_connections = 1024;
  // Cores the replicas share with the router, the load generator and the store (0: each replica
  // has its own threads_per_replica and the others cost nothing). The others take
  // o = Σ cpu_per_request × (trace requests ÷ the run's wall time) of them for the whole run (o
  // solved with the run it predicts; the store's and the replicas' own shares count only the
  // requests a replica accepted, SimOutput::accepted); the replicas share cpus − o
  // (SimOutput::overhead_cores).
  double cpus = 0;
  StoreOptions store;
  TierOptions tiers;
  double time_scale = 1;         // arrival times multiplied by this (as bench_loadgen --time-scale)
  double noise = 0;              // log-normal sigma multiplying each step (0: exact; < 0: the calibration's)
  uint64_t seed = 1;             // the noise's
};

struct SimOutput {
  std::vector<loadgen::RequestResult> results;  // per trace request, as bench_loadgen's
  double wall_s = 0;
  double overhead_cores = 0;  // cores the router, load generator, store and replicas' own work took (Topology::cpus)
  // Requests a replica accepted a connection for (the others were refused at it: 429, or 503 at
  // every replica tried); the replicas' and the store's CPU per request count these only.
  size_t accepted = 0;
  nlohmann::json metrics;  // prefix cache, router, tiers and store, per replica (the loadgen's names)
};

Result<SimOutput> simulate(const loadgen::Trace& trace, const Calibration& cal, const Topology& topo);

// CPU seconds per request of the processes beside the replicas in this topology (router if any,
// load generator, store if enabled and alive); 0 when topo.cpus is 0.
double overhead_cpu_per_request(const Calibration& cal, const Topology& topo);

// The engine busy seconds of a simulated run, summed over its replicas (metrics.serve.replicas[].busy_s).
double engine_busy_s(const SimOutput& out);

// cpu_per_request from measured runs: each a bench_loadgen report (its summary's "requests") and
// its cluster_run.sh CPU sidecar ({"procs": {"router": {"cpu_s_run": s}, "loadgen": ..., "redis": ...,
// "serve1": ...}}). Router and load generator: their CPU seconds over all runs ÷ all runs'
// requests; the store: over the runs that had one (0 when none did); the replicas: serve's CPU less
// engine_busy_s over the runs without a store that give engine_busy_s (0 when none do).
struct CpuRun {
  nlohmann::json report;
  nlohmann::json cpu;
  double engine_busy_s = -1;  // the simulated engine busy seconds of this run (< 0: unknown)
};
Result<ProcessCpu> process_cpu_from_runs(const std::vector<CpuRun>& runs);

// bench_loadgen's report shape: {"summary": loadgen::summarize(...), "metrics": ..., "topology": ...}.
nlohmann::json report(const SimOutput& out, const Topology& topo, const loadgen::Slo& slo);

// Fills `base`'s costs and byte ratios from a bench_loadgen report of one replica (its per-request
// records) and the trace it ran: TTFT = overhead + prefill per computed token (least squares),
// time per output token = decode base + per sequence in flight + per context token. `base` keeps
// the rest (model shape, page tokens, threads).
Result<Calibration> calibrate_from_loadgen(const nlohmann::json& loadgen_report, const loadgen::Trace& trace,
                                           Calibration base);

// The same from several runs (each report with its trace): the byte ratios and both fits pool
// every run's records (a quiet run pins the overheads, a bursty one the batch slope).
struct MeasuredRun {
  nlohmann::json report;
  loadgen::Trace trace;
};
// `max_batch`: the measured replica's --max-batch (more in flight wait outside the step).
Result<Calibration> calibrate_from_loadgen(const std::vector<MeasuredRun>& runs, Calibration base, int64_t max_batch = 8);

// Measured (a bench_loadgen report) beside predicted (report()): per metric both values and the
// relative error (predicted − measured) / measured.
nlohmann::json compare(const nlohmann::json& measured, const nlohmann::json& predicted);

}  // namespace specontext::bench::sim
