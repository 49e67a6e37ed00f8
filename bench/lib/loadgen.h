// The pieces of bench_loadgen (issue #31 item 4), a trace-driven open-loop load generator for any
// OpenAI-compatible endpoint (`specontext serve`, `specontext router`): the JSONL trace and its
// parser (bounded, errors naming the line and field), arrival schedules (Poisson, bursts,
// uniform) and a synthetic trace from a seed, the run itself (a connection per request on a pool of
// worker threads, streaming completions timed by lib/sse_client), the report's accounting (goodput under
// an SLO, TTFT / ITL / latency percentiles) and /metrics deltas over the run.
//
// Trace lines (JSON objects, one a line; blank lines and lines starting with '#' skipped):
//   {"define_prefix": "sys0", "text": "You are ..."}      a shared prefix, before its first use
//   {"arrival_s": 0.25, "prompt": "...", "max_tokens": 16,  a request: sent at arrival_s (from the
//    "session": "s3", "prefix": "sys0", "kind": "tool"}     start), prompt text, output length
// A request of a session is sent when its arrival comes and the session's previous request has
// finished, with the session's conversation so far (its prefix, each earlier prompt and answer)
// in front of its own prompt; a first request (or one without a session) gets its prefix's text
// in front. `kind` is a label ("chat", "tool", ...) carried into the per-request records.
#pragma once

#include <cstdint>
#include <istream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/base/fnv1a.h"
#include "core/base/status.h"

namespace CLI {
class App;
}  // namespace CLI

namespace specontext::bench::loadgen {

struct TraceRequest {
  int64_t line = 0;  // 1-based line in the trace file
  double arrival_s = 0;
  std::string prompt;
  int64_t max_tokens = 0;
  std::string session;  // empty: none
  std::string prefix;   // empty: none
  std::string kind;     // empty: none
};

struct Trace {
  std::map<std::string, std::string> prefixes;  // id → text
  std::vector<TraceRequest> requests;           // in file order, arrivals non-decreasing
};

// Bounds on what a trace may hold; past one the parser stops with the line and field.
struct TraceLimits {
  size_t max_line_bytes = size_t{1} << 20;
  int64_t max_requests = 1'000'000;
  int64_t max_prefixes = 65'536;
  int64_t max_tokens = 1'000'000;
  double max_arrival_s = 1e7;
  size_t max_id_bytes = 128;  // session, prefix and kind: [A-Za-z0-9_.:-]
};

Result<Trace> parse_trace(std::istream& in, const TraceLimits& limits = {});
Result<Trace> load_trace(const std::string& path, const TraceLimits& limits = {});

// When requests arrive, in seconds from the start: "poisson" (exponential gaps, mean 1/rate),
// "burst" (bursts of burst_size requests at once, the bursts a Poisson process of rate
// rate / burst_size, so the mean rate is `rate`), "uniform" (1/rate apart). The first arrival is
// one gap after 0. Deterministic for a seed (mt19937_64, inverse-CDF exponentials).
struct ArrivalOptions {
  std::string process = "poisson";
  double rate = 1;  // requests per second
  int64_t burst_size = 8;
  uint64_t seed = 1;
};
Result<std::vector<double>> arrival_times(const ArrivalOptions& a, int64_t n);

// A synthetic trace: `requests` arrivals from `arrivals`; request i goes to conversation slot
// i mod `sessions`, a slot's session running `turns` requests before the slot starts a new one
// (so a conversation grows to about prefix_words + turns·(turn words + max_tokens)). Session k
// starts with system prompt k mod `prefixes` (prefix_words words each); agent sessions (a
// fraction agent_fraction) append tool_words words of tool output a turn, chat sessions
// turn_words of user text. Deterministic for the seed.
struct SynthOptions {
  ArrivalOptions arrivals;
  int64_t requests = 60;
  int64_t sessions = 8;
  int64_t turns = 4;
  int64_t prefixes = 2;
  int64_t prefix_words = 32;
  int64_t turn_words = 8;
  int64_t tool_words = 24;
  double agent_fraction = 0.5;
  int64_t max_tokens = 16;
};
Result<std::string> synth_trace(const SynthOptions& o);  // JSONL

// The synthetic trace's command-line options (--arrival, --rate, ..., --max-tokens), shared by
// bench_loadgen and bench_cluster_sim.
void add_synth_options(CLI::App& app, SynthOptions& o);

// The trace in `path`, or the synthetic one of `o` when `path` is empty.
Result<Trace> trace_or_synth(const std::string& path, const SynthOptions& o);

// What one request did. Times in seconds; *_at_s from the run's start.
struct RequestResult {
  int64_t index = 0;  // in the trace
  int64_t line = 0;
  std::string session, kind;
  double scheduled_at_s = 0;  // its arrival
  double sent_at_s = 0;       // when it went out (later: its session's previous turn, the in-flight cap)
  double ttft_s = 0, latency_s = 0;
  std::vector<double> gaps_s;
  int64_t max_tokens = 0;
  int64_t prompt_bytes = 0;
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // usage
  bool ok = false;
  std::string error;
  std::string text;          // the answer as streamed (the text events, concatenated)
  uint64_t prompt_hash = 0;  // fnv1a64 (core/base/fnv1a.h) of the prompt sent (its session's history in front)
};

// The result record of trace request `index` before it runs: its identity, output length and
// arrival (arrival_s × time_scale). Shared by the load generator and the simulator.
RequestResult scheduled_result(const TraceRequest& r, size_t index, double time_scale);

// Service-level objective for goodput: a request counts when it finished, its TTFT is at most
// ttft_s and its time per output token after the first at most tpot_s (and latency at most
// latency_s; 0: no bound on that one).
struct Slo {
  double ttft_s = 1.0;
  double tpot_s = 0.1;
  double latency_s = 0;
};
bool meets_slo(const RequestResult& r, const Slo& slo);

// The report's "summary": requests, ok, errors (with the first few messages), goodput
// (requests/s and output tokens/s of the requests within the SLO), throughput, TTFT / ITL / TPOT /
// latency p50 / p90 / p99, send lag, prompt and cached tokens, the longest prompt.
nlohmann::json summarize(const std::vector<RequestResult>& results, double wall_s, const Slo& slo);

// Prometheus text → {"name{labels}": value} (comments and unparsable lines skipped).
std::map<std::string, double> parse_prometheus(const std::string& text);
// Deltas over a run from two /metrics scrapes: every counter (`_total`) as after − before, every
// gauge before and after, and the derived rows (serve: prefix cache hit tokens and rate, host /
// disk / shared-store tier traffic; router: prefix lookups, hits and hit rate, per-replica
// choices). Empty object when neither scrape had any.
nlohmann::json metrics_delta(const std::map<std::string, double>& before, const std::map<std::string, double>& after);

struct RunOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string model;    // the body's "model" (empty: left out)
  std::string api_key;  // Authorization: Bearer (empty: none)
  bool ignore_eos = true;
  double timeout_s = 600;        // per request, from its send
  int64_t max_in_flight = 1024;  // requests at once (sending or waiting for their session's previous turn)
  double time_scale = 1;         // arrival times are multiplied by this
};
struct RunOutput {
  std::vector<RequestResult> results;
  double wall_s = 0;
  // The scheduler's own work, the same per request whatever the load: a request waiting for its
  // session's previous turn holds no thread (the worker that finishes that turn sends it:
  // turns_handed_on), a worker thread is started only when none is idle (workers: the most
  // requests sent at once, at most max_in_flight), and a thread is woken only to take a request
  // or a free slot (wakeups: every return from a condition-variable wait, at most one per request
  // plus one per worker at the end and the dispatcher's waits for a slot).
  int64_t workers = 0;
  int64_t turns_handed_on = 0;
  int64_t wakeups = 0;
};
Result<RunOutput> run_trace(const Trace& trace, const RunOptions& o);

// Two bench_loadgen reports of one trace, each run with --record-text (every request record holds
// "text" and "prompt_fnv1a"), compared request by request ("no wrong token" under faults):
// "same" (both answered, same prompt, same text), "different" (both answered the same prompt with
// different text: a wrong token; their indices in "different_indices", the first 20), "failed"
// (answered in `baseline`, not in `run`: counted by error message in "failed_errors"),
// "prompt_changed" (both answered but the prompts differ: an earlier turn of the session failed
// in one run, so the history in front differs; not comparable), "failed_in_baseline"; of the
// requests compared (both answered the same prompt), "cached_differs" took a different number of
// prompt tokens from a prefix cache or store in the two runs (records' "cached_tokens"), and the
// different ones are split into "different_cached_differs" and "different_same_cached". An error
// when the reports are not of one trace (request counts or lines differ) or hold no text.
Result<nlohmann::json> compare_texts(const nlohmann::json& baseline, const nlohmann::json& run);

// GET `target` from host:port (plain HTTP/1.1, closed after); the body of a 200.
Result<std::string> http_get(const std::string& host, uint16_t port, const std::string& target,
                             const std::string& api_key, double timeout_s);

}  // namespace specontext::bench::loadgen
