// An OpenAI-compatible HTTP server over one Engine, with continuous batching: requests arriving
// on any connection join the running batch at the next step (core/scheduler.h).
//   POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
//   GET /v1/models, GET /health, GET /metrics          (Prometheus text)
// Threads: one Asio thread runs every connection (C++20 coroutines, Boost.Beast); one engine
// thread owns the Scheduler and the Engine. They meet in a mutex-guarded inbox (submit, cancel)
// and per-request event lists; the engine thread wakes a request's coroutine by posting to the
// Asio thread. A client that disconnects has its request cancelled (its sequence freed) at the
// next step; a stop string cancels the request the same way.
// Access: with API keys set, every /v1/ request needs "Authorization: Bearer <key>" (401
// otherwise; /health and /metrics stay open, as vLLM). Past max_connections open connections a
// new one is answered 503 and closed rather than left waiting.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/scheduler.h"
#include "core/status.h"
#include "core/tokenizer.h"

namespace specontext::cluster {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                                 // 0 = any free port (see OpenAiServer::port)
  std::string model_name = "specontext";             // what /v1/models lists and requests may name
  ChatTemplate chat_template = ChatTemplate::kNone;  // kNone: /v1/chat/completions answers 400
  std::vector<TokenId> stop_ids;     // end generation (the finish_reason is "stop") unless ignore_eos
  size_t max_waiting = 256;          // requests queued behind the running ones; more get 503
  size_t max_body_bytes = 4u << 20;  // larger bodies get 413
  std::chrono::milliseconds idle_timeout{60000};  // an idle keep-alive connection is closed after this
  // Accepted keys (vLLM's --api-key); empty = no authentication. A key may not be empty.
  std::vector<std::string> api_keys;
  // Connections served at once (0 = no limit); one more is answered 503 with Retry-After and
  // closed, so that a client gets an answer instead of waiting on a listen backlog.
  size_t max_connections = 1024;
  // Preempting admission, as vLLM: requests without max_tokens (up to the context) would
  // otherwise each reserve a whole context and run few at a time.
  GeneratorOptions scheduling = [] {
    GeneratorOptions g;
    g.admission = AdmissionPolicy::kPreempt;
    g.prefix_caching = true;  // multi-turn chats resend their history
    return g;
  }();
};

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
  int64_t kv_bytes_in_use = 0;
  // Connections: refused past max_connections (answered 503 and closed), and open now.
  int64_t connections_refused = 0;
  int64_t open_connections = 0;
};

class OpenAiServer {
 public:
  // Binds, listens and starts both threads. `engine` and `tokenizer` must outlive the server;
  // until stop() only the server's engine thread may use the engine. An empty API key is
  // InvalidArgument (it would make the empty Bearer token valid).
  static Result<std::unique_ptr<OpenAiServer>> start(Engine& engine, const Tokenizer& tokenizer,
                                                     const ServerOptions& options);
  ~OpenAiServer();  // stop() with no drain time
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  uint16_t port() const;
  // Closes the listener and answers new requests with 503; waits up to `drain` for the accepted
  // ones to finish; the rest are answered 503 "server shutting down" (or end their stream with an
  // error event). Then both threads stop. Idempotent.
  void stop(std::chrono::milliseconds drain = std::chrono::milliseconds(0));
  ServerCounters counters() const;

  struct Impl;

 private:
  explicit OpenAiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specontext::cluster
