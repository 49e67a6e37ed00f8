// The OpenAI server's counters: one struct (ServerCounters), one table describing each field
// (its Prometheus name, type and help), and the renderers built from that table, so that a
// counter is named once. A field missing from the table fails to compile (server_counters.cc).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "serving/scheduler.h"

namespace specontext::cluster {

// Counts since start (running/waiting/kv bytes: now).
struct ServerCounters {
  int64_t accepted = 0;       // generation requests queued
  int64_t completed = 0;      // answered with a finish_reason
  int64_t rejected = 0;       // answered 4xx/5xx before or instead of generating; not the 401s
  int64_t unauthorized = 0;   // /v1/ requests without a valid API key (answered 401)
  int64_t cancelled = 0;      // the client went away, or a stop string ended the request
  int64_t failed = 0;         // the engine failed their batch (answered 500)
  int64_t prompt_tokens = 0;  // prefilled
  int64_t generated_tokens = 0;
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t max_batch_sequences = 0;  // most sequences in one forward
  int64_t preemptions = 0;          // running requests preempted to make room (AdmissionPolicy::kPreempt)
  int64_t preemption_swaps = 0;     // of those, swapped out to the offload store (swap_preempted)
  int64_t lost_tiers = 0;  // remote KV tiers lost and abandoned (GeneratorOptions::recompute_lost_tiers)
  int64_t lost_tier_requeues = 0;      // running requests recomputed after such a loss
  int64_t cached_prompt_tokens = 0;    // prompt tokens taken from the prefix cache
  int64_t prefix_cache_evictions = 0;  // cached sequences dropped for room
  int64_t cached_sequences = 0;        // finished requests' sequences held for prefix caching (now)
  // The prefix cache's offload store (GeneratorOptions::prefix_offload_bytes): evicted prefixes
  // kept in host memory, written back for a request, and held now.
  int64_t prefix_offloads = 0;
  int64_t prefix_restores = 0;
  int64_t offloaded_prefixes = 0;
  int64_t offloaded_bytes = 0;
  // Its disk level (GeneratorOptions::prefix_disk_bytes): prefixes written to files, read back for
  // a request, files that failed to be written or read back, and held now.
  int64_t prefix_disk_writes = 0;
  int64_t prefix_disk_restores = 0;
  int64_t prefix_disk_errors = 0;
  int64_t prefixes_on_disk = 0;
  int64_t prefix_disk_bytes = 0;
  // Its lower level on mirrored KV nodes (`--prefix-offload-remote`, PrefixBlobStore::
  // replica_counts): replicas alive as last seen (now), and replicas found dead.
  int64_t prefix_remote_replicas_live = 0;
  int64_t prefix_remote_replica_deaths = 0;
  // The shared prefix store (GeneratorOptions::prefix_shared_store, `--prefix-store`): prompts read
  // back from it, lookups that found none, prompts written, bytes each way, and failed operations
  // (an unreachable store: the prompt is computed).
  int64_t prefix_shared_hits = 0;
  int64_t prefix_shared_misses = 0;
  int64_t prefix_shared_writes = 0;
  int64_t prefix_shared_bytes_read = 0;
  int64_t prefix_shared_bytes_written = 0;
  int64_t prefix_shared_errors = 0;
  // Its chunks (serving/prefix_store.h): written, held already when a prompt was written, read,
  // and not read because a cached sequence held them (forked instead).
  int64_t prefix_shared_chunks_written = 0;
  int64_t prefix_shared_chunks_skipped = 0;
  int64_t prefix_shared_chunks_read = 0;
  int64_t prefix_shared_chunks_local = 0;
  int64_t kv_bytes_in_use = 0;
  // Connections: refused past max_connections (answered 503 and closed), past
  // max_connections_per_ip (429), closed because a request header did not come whole within
  // header_timeout, and open now.
  int64_t connections_refused = 0;
  int64_t connections_refused_per_ip = 0;
  int64_t header_timeouts = 0;
  int64_t open_connections = 0;
  int64_t tls_handshake_failures = 0;  // TLS: connections closed because the handshake failed
  // Request preparation: waiting for a worker and being prepared (now), and refused because
  // request_queue requests were waiting (answered 503).
  int64_t prepare_queued = 0;
  int64_t prepare_running = 0;
  int64_t prepare_refused = 0;
};

// One field of ServerCounters: its name (the field's), its key in the JSON counts (serve's
// "stopped" event; nullptr: not there, as for the gauges), its Prometheus metric (name, "counter"
// or "gauge", help line), and, for those the scheduler counts, the GenerationStats field it is
// taken from (nullptr: the server counts it or reads it elsewhere).
struct CounterSpec {
  const char* name;
  const char* json_key;
  const char* prom_name;
  const char* prom_type;
  const char* help;
  int64_t ServerCounters::*field;
  int64_t GenerationStats::*from_stats;
};

// Every field of ServerCounters, once, in /metrics order.
std::span<const CounterSpec> server_counter_specs();

// The fields the scheduler counts, copied from its stats.
void copy_generation_stats(const GenerationStats& stats, ServerCounters& out);

// /metrics: "# HELP", "# TYPE" and the value, per counter.
std::string render_prometheus(const ServerCounters& c);

// {"<json_key>": value, ...} for every counter that has a JSON key.
nlohmann::json render_json(const ServerCounters& c);

}  // namespace specontext::cluster
