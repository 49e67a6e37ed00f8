#include "serving/openai/server_counters.h"

#include <iterator>

namespace specontext::cluster {
namespace {

constexpr CounterSpec kSpecs[] = {
    {"running", nullptr, "specontext_requests_running", "gauge", "requests in the running batch",
     &ServerCounters::running, nullptr},
    {"waiting", nullptr, "specontext_requests_waiting", "gauge", "requests queued behind the running batch",
     &ServerCounters::waiting, nullptr},
    {"accepted", "accepted", "specontext_requests_accepted_total", "counter", "generation requests queued",
     &ServerCounters::accepted, nullptr},
    {"completed", "completed", "specontext_requests_completed_total", "counter",
     "requests answered with a finish_reason", &ServerCounters::completed, nullptr},
    {"rejected", "rejected", "specontext_requests_rejected_total", "counter",
     "requests answered with a 4xx/503 error, except 401s", &ServerCounters::rejected, nullptr},
    {"unauthorized", "unauthorized", "specontext_unauthorized_requests_total", "counter",
     "/v1/ requests without a valid API key (401)", &ServerCounters::unauthorized, nullptr},
    {"open_connections", nullptr, "specontext_open_connections", "gauge", "client connections open",
     &ServerCounters::open_connections, nullptr},
    {"connections_refused", "connections_refused", "specontext_connections_refused_total", "counter",
     "connections refused at the connection limit (503)", &ServerCounters::connections_refused, nullptr},
    {"connections_refused_per_ip", "connections_refused_per_ip",
     "specontext_connections_refused_per_ip_total", "counter",
     "connections refused at the per-address connection limit (429)",
     &ServerCounters::connections_refused_per_ip, nullptr},
    {"header_timeouts", "header_timeouts", "specontext_header_timeouts_total", "counter",
     "connections closed because a request header did not come whole within the header timeout",
     &ServerCounters::header_timeouts, nullptr},
    {"tls_handshake_failures", nullptr, "specontext_tls_handshake_failures_total", "counter",
     "connections closed because their TLS handshake failed (e.g. plain HTTP sent to the TLS port)",
     &ServerCounters::tls_handshake_failures, nullptr},
    {"prepare_queued", nullptr, "specontext_prepare_queue_depth", "gauge",
     "requests waiting for a worker to tokenize them", &ServerCounters::prepare_queued, nullptr},
    {"prepare_running", nullptr, "specontext_prepare_running", "gauge",
     "requests being parsed and tokenized by a worker", &ServerCounters::prepare_running, nullptr},
    {"prepare_refused", "prepare_refused", "specontext_prepare_refused_total", "counter",
     "requests refused because the request queue was full (503)", &ServerCounters::prepare_refused, nullptr},
    {"cancelled", "cancelled", "specontext_requests_cancelled_total", "counter",
     "requests whose client went away", &ServerCounters::cancelled, nullptr},
    {"failed", "failed", "specontext_requests_failed_total", "counter",
     "requests whose batch failed in the engine (500)", &ServerCounters::failed, nullptr},
    {"prompt_tokens", "prompt_tokens", "specontext_prompt_tokens_total", "counter", "prompt tokens prefilled",
     &ServerCounters::prompt_tokens, &GenerationStats::prompt_tokens},
    {"generated_tokens", "generated_tokens", "specontext_generation_tokens_total", "counter",
     "tokens generated", &ServerCounters::generated_tokens, &GenerationStats::generated_tokens},
    {"max_batch_sequences", "max_batch_sequences", "specontext_batch_sequences_max", "gauge",
     "most sequences in one forward pass", &ServerCounters::max_batch_sequences,
     &GenerationStats::max_batch_sequences},
    {"preemptions", "preemptions", "specontext_preemptions_total", "counter",
     "running requests preempted to make room", &ServerCounters::preemptions, &GenerationStats::preemptions},
    {"preemption_swaps", "preemption_swaps", "specontext_preemption_swaps_total", "counter",
     "of the preempted requests, those whose KV went to the prefix offload store",
     &ServerCounters::preemption_swaps, &GenerationStats::preemption_swaps},
    {"lost_tiers", "lost_tiers", "specontext_kv_tiers_lost_total", "counter",
     "remote KV tiers lost (every replica died) and abandoned", &ServerCounters::lost_tiers,
     &GenerationStats::lost_tiers},
    {"lost_tier_requeues", "lost_tier_recomputes", "specontext_lost_tier_recomputes_total", "counter",
     "running requests recomputed after a KV tier was lost", &ServerCounters::lost_tier_requeues,
     &GenerationStats::lost_tier_requeues},
    {"cached_prompt_tokens", "cached_prompt_tokens", "specontext_prefix_cache_hit_tokens_total", "counter",
     "prompt tokens taken from the prefix cache", &ServerCounters::cached_prompt_tokens,
     &GenerationStats::cached_prompt_tokens},
    {"prefix_cache_evictions", "prefix_cache_evictions", "specontext_prefix_cache_evictions_total", "counter",
     "cached sequences dropped to make room", &ServerCounters::prefix_cache_evictions,
     &GenerationStats::prefix_cache_evictions},
    {"cached_sequences", nullptr, "specontext_prefix_cache_sequences", "gauge",
     "finished requests' sequences kept for prefix caching", &ServerCounters::cached_sequences, nullptr},
    {"prefix_offloads", "prefix_offloads", "specontext_prefix_offloads_total", "counter",
     "evicted cached prefixes kept in host memory", &ServerCounters::prefix_offloads,
     &GenerationStats::prefix_offloads},
    {"prefix_restores", "prefix_restores", "specontext_prefix_restores_total", "counter",
     "offloaded prefixes written back into the KV cache", &ServerCounters::prefix_restores,
     &GenerationStats::prefix_restores},
    {"offloaded_prefixes", nullptr, "specontext_prefix_offload_sequences", "gauge",
     "prefixes held in host memory", &ServerCounters::offloaded_prefixes, nullptr},
    {"offloaded_bytes", nullptr, "specontext_prefix_offload_bytes", "gauge",
     "host memory the offloaded prefixes hold", &ServerCounters::offloaded_bytes, nullptr},
    {"prefix_disk_writes", "prefix_disk_writes", "specontext_prefix_disk_writes_total", "counter",
     "offloaded prefixes written to disk", &ServerCounters::prefix_disk_writes,
     &GenerationStats::prefix_disk_writes},
    {"prefix_disk_restores", "prefix_disk_restores", "specontext_prefix_disk_restores_total", "counter",
     "prefixes read back from disk into the KV cache", &ServerCounters::prefix_disk_restores,
     &GenerationStats::prefix_disk_restores},
    {"prefix_disk_errors", "prefix_disk_errors", "specontext_prefix_disk_errors_total", "counter",
     "prefix files that could not be written or read back intact (dropped; the prompt is computed)",
     &ServerCounters::prefix_disk_errors, &GenerationStats::prefix_disk_errors},
    {"prefixes_on_disk", nullptr, "specontext_prefix_disk_sequences", "gauge", "prefixes held on disk",
     &ServerCounters::prefixes_on_disk, nullptr},
    {"prefix_disk_bytes", nullptr, "specontext_prefix_disk_bytes", "gauge",
     "disk space the prefix files take", &ServerCounters::prefix_disk_bytes, nullptr},
    {"prefix_remote_replicas_live", nullptr, "specontext_prefix_remote_replicas_live", "gauge",
     "KV node replicas of the prefix offload store's remote level (--prefix-offload-remote) alive as last "
     "seen (0 with all dead: its prefixes are computed)",
     &ServerCounters::prefix_remote_replicas_live, nullptr},
    {"prefix_remote_replica_deaths", nullptr, "specontext_prefix_remote_replica_deaths_total", "counter",
     "KV node replicas of --prefix-offload-remote found dead (each named on stderr)",
     &ServerCounters::prefix_remote_replica_deaths, nullptr},
    {"prefix_shared_hits", "prefix_shared_hits", "specontext_prefix_store_hits_total", "counter",
     "prompts whose longest stored prefix was read back from the shared prefix store",
     &ServerCounters::prefix_shared_hits, &GenerationStats::prefix_shared_hits},
    {"prefix_shared_misses", "prefix_shared_misses", "specontext_prefix_store_misses_total", "counter",
     "shared prefix store lookups that found nothing (or a prefix gone when read)",
     &ServerCounters::prefix_shared_misses, &GenerationStats::prefix_shared_misses},
    {"prefix_shared_writes", "prefix_shared_writes", "specontext_prefix_store_writes_total", "counter",
     "prompts written to the shared prefix store", &ServerCounters::prefix_shared_writes,
     &GenerationStats::prefix_shared_writes},
    {"prefix_shared_bytes_read", "prefix_shared_bytes_read", "specontext_prefix_store_read_bytes_total",
     "counter", "bytes read from the shared prefix store", &ServerCounters::prefix_shared_bytes_read,
     &GenerationStats::prefix_shared_bytes_read},
    {"prefix_shared_bytes_written", "prefix_shared_bytes_written",
     "specontext_prefix_store_written_bytes_total", "counter", "bytes written to the shared prefix store",
     &ServerCounters::prefix_shared_bytes_written, &GenerationStats::prefix_shared_bytes_written},
    {"prefix_shared_errors", "prefix_shared_errors", "specontext_prefix_store_errors_total", "counter",
     "shared prefix store operations that failed (unreachable, refused, not of this model; the prompt is "
     "computed)",
     &ServerCounters::prefix_shared_errors, &GenerationStats::prefix_shared_errors},
    {"prefix_shared_chunks_written", "prefix_shared_chunks_written",
     "specontext_prefix_store_chunks_written_total", "counter",
     "chunks written to the shared prefix store (those of a finished prompt it did not hold)",
     &ServerCounters::prefix_shared_chunks_written, &GenerationStats::prefix_shared_chunks_written},
    {"prefix_shared_chunks_skipped", "prefix_shared_chunks_skipped",
     "specontext_prefix_store_chunks_skipped_total", "counter",
     "chunks of finished prompts not written: the shared prefix store held them already",
     &ServerCounters::prefix_shared_chunks_skipped, &GenerationStats::prefix_shared_chunks_skipped},
    {"prefix_shared_chunks_read", "prefix_shared_chunks_read", "specontext_prefix_store_chunks_read_total",
     "counter", "chunks read back intact from the shared prefix store",
     &ServerCounters::prefix_shared_chunks_read, &GenerationStats::prefix_shared_chunks_read},
    {"prefix_shared_chunks_local", "prefix_shared_chunks_local", "specontext_prefix_store_chunks_local_total",
     "counter", "chunks of prefixes read back from the shared prefix store not read: a cached sequence held them",
     &ServerCounters::prefix_shared_chunks_local, &GenerationStats::prefix_shared_chunks_local},
    {"kv_bytes_in_use", nullptr, "specontext_kv_bytes_in_use", "gauge",
     "KV cache bytes held by live sequences", &ServerCounters::kv_bytes_in_use, nullptr},
};

// A field added to ServerCounters and not to kSpecs fails here (every field is an int64_t).
static_assert(sizeof(ServerCounters) == std::size(kSpecs) * sizeof(int64_t),
              "every ServerCounters field needs its row in kSpecs");

}  // namespace

std::span<const CounterSpec> server_counter_specs() { return kSpecs; }

void copy_generation_stats(const GenerationStats& stats, ServerCounters& out) {
  for (const CounterSpec& s : kSpecs) {
    if (s.from_stats != nullptr) out.*s.field = stats.*s.from_stats;
  }
}

std::string render_prometheus(const ServerCounters& c) {
  std::string out;
  for (const CounterSpec& s : kSpecs) {
    const std::string name = s.prom_name;
    out += "# HELP " + name + " " + s.help + "\n# TYPE " + name + " " + s.prom_type + "\n" + name + " " +
           std::to_string(c.*s.field) + "\n";
  }
  return out;
}

nlohmann::json render_json(const ServerCounters& c) {
  nlohmann::json out = nlohmann::json::object();
  for (const CounterSpec& s : kSpecs) {
    if (s.json_key != nullptr) out[s.json_key] = c.*s.field;
  }
  return out;
}

}  // namespace specontext::cluster
