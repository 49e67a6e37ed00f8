// Bandwidth probe: measures, at start-up, what the planner needs as bandwidths (device↔host per
// NUMA node, host↔host across nodes, the remote link) over any Transport, with the access
// patterns the engine uses:
//   - contiguous: the path's region in `block_bytes` requests (1 MiB by default), one batch;
//   - gather: many `row_bytes` requests read at `gather_stride` from the source and packed
//     densely at the destination (the sparse-gather pattern: one KV head's row of one token);
//   - latency: one `row_bytes` transfer, post → completion.
// Each figure is the best of up to `repeats` rounds; after each round the probe stops once the
// path's `time_budget` is spent (so at least one round always runs, and a round started within
// the budget finishes). Times run from the first post to the poll that sees completion (prepare
// and release are outside: the engine prepares on submit, off the copy thread's path). A time
// below the clock's resolution counts as one tick, so every figure is positive and finite.
//
// Synchronous: runs on the caller thread (prepare/post/poll/release), spinning with yields while
// a transfer runs; NO_RESOURCE is re-posted. No transfer waits longer than `transfer_timeout`
// (it is then released, i.e. cancelled, and the path fails with kUnavailable), so it cannot hang.
// The tiers must already be registered on `t`; each path names a region inside its src tier
// (read) and its dst tier (overwritten: use scratch memory). Errors name the path.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/ports/transport.h"

namespace specontext::transport {

struct ProbePath {
  std::string name;  // "device<-host0", "host0->host1", "remote0->host0", ...
  TierId src;
  uint64_t src_offset = 0;
  TierId dst;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;  // region size in both tiers; the probe uses min(bytes, max_bytes)
};

struct ProbeOptions {
  uint64_t max_bytes = 16 << 20;
  uint64_t row_bytes = 512;
  int repeats = 3;
  std::chrono::milliseconds time_budget{150};  // per path
  uint64_t block_bytes = 1 << 20;              // request size of the contiguous pattern
  uint64_t gather_stride = 0;                  // source stride of gathered rows; 0 = 8 × row_bytes
  uint64_t max_gather_rows = 8192;
  std::chrono::milliseconds transfer_timeout{5000};
};

struct ProbeResult {
  std::string name;
  TierId src, dst;
  double contiguous_bps = 0;   // bytes per second
  double gather_bps = 0;       // gathered bytes (rows × row_bytes) per second
  double latency_seconds = 0;  // one row_bytes transfer
  uint64_t bytes = 0;          // bytes of the contiguous pattern
  int repeats = 0;             // rounds run
  uint64_t gather_rows = 0;    // requests of the gather pattern
  uint64_t gather_bytes = 0;
};

// One result per path, in order; the first failing path's error (naming it) otherwise.
Result<std::vector<ProbeResult>> probe_bandwidth(Transport& t, const std::vector<ProbePath>& paths,
                                                 const ProbeOptions& o = {});

// [{"name", "src_tier", "dst_tier", "bytes", "contiguous_bps", "gather_bps", "gather_rows",
//   "gather_bytes", "latency_seconds", "repeats"}, ...]
nlohmann::json probe_results_to_json(const std::vector<ProbeResult>& results);

}  // namespace specontext::transport
