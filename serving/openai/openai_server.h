// An OpenAI-compatible HTTP server over one Engine, with continuous batching: requests arriving
// on any connection join the running batch at the next step (serving/scheduler.h).
//   POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
//   GET /v1/models, GET /health, GET /metrics          (Prometheus text)
// Threads: one Asio thread runs every connection (C++20 coroutines, Boost.Beast); a fixed pool of
// request_workers threads does the CPU-heavy part of a request (parsing the body, the chat
// template, tokenizing, compiling a JSON schema or grammar), so the Asio thread never tokenizes;
// one engine thread owns the Scheduler and the Engine. They meet in a mutex-guarded inbox
// (submit, cancel) and per-request event lists; the engine thread wakes a request's coroutine by
// posting to the Asio thread. A client that disconnects has its request cancelled (its sequence
// freed) at the next step; a stop string cancels the request the same way.
// Access: with API keys set, every /v1/ request needs "Authorization: Bearer <key>" (401
// otherwise; /health and /metrics stay open, as vLLM). Past max_connections open connections (or
// max_connections_per_ip from one address) a new one is answered at once and closed rather than
// left waiting: /health and /metrics with their answer, anything else 503 (429 for the per-IP cap).
// TLS (tls_cert_file, tls_key_file): every connection, refused ones included, is TLS 1.2+; one
// whose handshake fails (plain HTTP to the TLS port) is closed unanswered.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/base/status.h"
#include "core/engine/engine.h"
#include "core/tokenizer/tokenizer.h"
#include "serving/openai/server_counters.h"
#include "serving/scheduler.h"

namespace specontext::cluster {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;                                 // 0 = any free port (see OpenAiServer::port)
  std::string model_name = "specontext";             // what /v1/models lists and requests may name
  ChatTemplate chat_template = ChatTemplate::kNone;  // kNone: /v1/chat/completions answers 400
  std::vector<TokenId> stop_ids;     // end generation (the finish_reason is "stop") unless ignore_eos
  size_t max_waiting = 256;          // requests queued behind the running ones; more get 503
  size_t max_body_bytes = 4u << 20;  // larger bodies get 413
  // A request's header must come whole within header_timeout (nginx's client_header_timeout): on
  // a new connection from its accept, on a kept one from the request's first byte; past it the
  // connection is closed without an answer (counted in header_timeouts), whether part of a header
  // came or nothing did. Between requests a keep-alive connection may be idle for idle_timeout (then it is
  // closed), and a request's body must come whole within idle_timeout of its header.
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds idle_timeout{15000};
  // Accepted keys (vLLM's --api-key); empty = no authentication. A key may not be empty.
  std::vector<std::string> api_keys;
  // Connections served at once (0 = no limit); one more is answered 503 with Retry-After and
  // closed, so that a client gets an answer instead of waiting on a listen backlog.
  size_t max_connections = 1024;
  // Connections served at once from one client address (0 = no limit); one more is answered 429
  // and closed (its /health or /metrics request still answered).
  size_t max_connections_per_ip = 256;
  // Request preparation (parse, chat template, tokenize, schema/grammar compile) runs on
  // request_workers threads (>= 1). Requests waiting for a worker beyond request_queue are
  // answered 503 with Retry-After at once; a request admitted to the queue is answered.
  size_t request_workers = 2;
  size_t request_queue = 64;
  // A prompt (completions' text; chat: the messages' contents and tool calls with the tool
  // definitions) longer than this many bytes is answered 400 naming the field before it is
  // tokenized. 0 = 32 bytes per token of the engine's context.
  size_t max_prompt_bytes = 0;
  // TLS (https) when both are set (serve's --tls-cert, --tls-key): a PEM certificate chain and
  // its PEM private key, which may not be readable by every user. TLS 1.2 or later; no client
  // certificates (the API key is the client's credential). Empty: plain HTTP.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Tests only: runs on a worker before each request's preparation (e.g. blocks until released).
  std::function<void()> before_prepare;
  // Preempting admission, as vLLM: requests without max_tokens (up to the context) would
  // otherwise each reserve a whole context and run few at a time.
  GeneratorOptions scheduling = [] {
    GeneratorOptions g;
    g.admission = AdmissionPolicy::kPreempt;
    g.prefix_caching = true;  // multi-turn chats resend their history
    return g;
  }();
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
