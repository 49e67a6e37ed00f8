// specontext serve: the OpenAI-compatible HTTP server (serving/openai/openai_server.h) over one engine
// built from the same options as `generate`. Prints one JSON line when it listens
// ({"event":"listening","port":P,...}), serves until SIGINT/SIGTERM, then drains and prints its
// counters ({"event":"stopped",...}).
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bin/commands.h"
#include "cluster/control_protocol.h"
#include "core/model/synthetic.h"
#include "core/tokenizer/synthetic_tokenizer.h"
#include "serving/openai/openai_server.h"

namespace specontext::cli {

void register_serve(CLI::App& app, ServeArgs& a) {
  CLI::App* cmd =
      app.add_subcommand("serve", "serve the model over an OpenAI-compatible HTTP API (continuous batching)");
  a.engine.admission = "preempt";  // as vLLM: requests without max_tokens would otherwise reserve the context
  a.engine.prefix_caching = true;  // multi-turn chats resend their history
  add_engine_options(*cmd, a.engine);
  cmd->add_option("--listen", a.listen, "HOST:PORT to listen on (port 0: any free port, printed at start)");
  cmd->add_option("--served-model-name", a.model_name,
                  "the model id clients name (default: the model file's name)");
  cmd->add_option("--max-batch", a.max_batch, "sequences decoded together (the engine's sequence slots)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prefix-cache-slots", a.prefix_cache_slots,
                  "finished requests' sequences the prefix cache may keep beyond --max-batch (they share "
                  "the KV memory of --max-batch sequences and give way when it is wanted)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", a.max_batch_tokens, "most tokens in one forward pass")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-waiting", a.max_waiting, "requests queued behind the running batch before 503")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--drain-seconds", a.drain_seconds,
                  "on SIGTERM, how long accepted requests may take to finish")
      ->check(CLI::NonNegativeNumber);
  add_api_key_options(*cmd, a.api_key, "/health and /metrics stay open");
  cmd->add_option("--max-connections", a.max_connections,
                  "connections served at once; one more is answered 503 and closed, its /health or "
                  "/metrics request answered (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-connections-per-ip", a.max_connections_per_ip,
                  "connections served at once from one client address; one more is answered 429 and "
                  "closed, its /health or /metrics request answered (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--header-timeout", a.header_timeout,
                  "seconds a request header may take to come whole (from the connect, or from its first "
                  "byte on a kept connection); then the connection is closed")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--idle-timeout", a.idle_timeout,
                  "seconds a kept-alive connection may wait for its next request, and a request's body may "
                  "take to come whole; then the connection is closed")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--request-workers", a.request_workers,
                  "threads that parse, template and tokenize requests and compile their schemas (off the "
                  "connection thread)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--request-queue", a.request_queue,
                  "requests waiting for a worker; one more is answered 503 with Retry-After")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--max-prompt-bytes", a.max_prompt_bytes,
                  "longest prompt in bytes (text, or a chat's messages); longer is answered 400 before "
                  "tokenizing (0: 32 bytes per token of the context)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option(
      "--tls-cert", a.tls_cert,
      "PEM certificate chain: serve HTTPS (TLS 1.2 or later) with --tls-key instead of plain HTTP");
  cmd->add_option("--tls-key", a.tls_key,
                  "PEM private key of --tls-cert (refused when every user may read it: chmod 600)");
}

int run_serve(const ServeArgs& a) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
    return 1;
  };
  auto ep = cluster::parse_endpoint(a.listen, /*allow_any_port=*/true);
  if (!ep.is_ok()) return fail(ep.status().with_context("--listen"));
  // Before the model loads: a bad key file is a quick error.
  auto api_keys = api_keys_of(a.api_key);
  if (!api_keys.is_ok()) return fail(api_keys.status());
  if (a.tls_cert.empty() != a.tls_key.empty()) {
    return fail(invalid_argument(a.tls_cert.empty() ? "--tls-cert: a certificate file goes with --tls-key"
                                                    : "--tls-key: a private key file goes with --tls-cert"));
  }
  auto loaded = load_model_and_tokenizer(a.engine);
  if (!loaded.is_ok()) return fail(loaded.status());
  if (!loaded->tokenizer) {
    // Random weights have no vocabulary: prompts are token ids ("5 17 3" or [5,17,3]), text is " 5 17 3".
    loaded->tokenizer = make_synthetic_tokenizer(static_cast<int32_t>(loaded->model->config.vocab_size));
    std::fprintf(stderr,
                 "note: --synthetic weights are random (speed, not quality); prompts are token ids\n");
  }
  // Every slot's KV is allocated up front at the context limit: synthetic shapes (128K contexts)
  // get 4096 unless --max-context says otherwise.
  const int64_t context =
      a.engine.max_context > 0
          ? a.engine.max_context
          : (loaded->synthetic ? std::min<int64_t>(4096, loaded->model->config.max_seq_len)
                               : loaded->model->config.max_seq_len);
  const int64_t cache_slots = a.engine.prefix_caching ? a.prefix_cache_slots : 0;
  auto bundle = build_engine(a.engine, *loaded, a.max_batch, context,
                             std::vector<int64_t>(static_cast<size_t>(a.max_batch), context), /*quiet=*/false,
                             cache_slots);
  if (!bundle.is_ok()) return fail(bundle.status());

  cluster::ServerOptions o;
  o.host = ep->host;
  o.port = ep->port;
  if (!a.model_name.empty()) {
    o.model_name = a.model_name;
  } else {
    o.model_name = loaded->synthetic ? a.engine.model.synthetic
                                     : std::filesystem::path(a.engine.model.model_path).filename().string();
    if (o.model_name.empty()) o.model_name = "specontext";
  }
  o.chat_template = chat_template_for(*loaded->model, *loaded->tokenizer);
  o.stop_ids = generation_stop_ids(*loaded->tokenizer);
  o.max_waiting = static_cast<size_t>(a.max_waiting);
  o.api_keys = std::move(*api_keys);
  o.max_connections = static_cast<size_t>(a.max_connections);
  o.max_connections_per_ip = static_cast<size_t>(a.max_connections_per_ip);
  auto millis = [](double seconds) {
    return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000)));
  };
  o.header_timeout = millis(a.header_timeout);
  o.idle_timeout = millis(a.idle_timeout);
  o.request_workers = static_cast<size_t>(a.request_workers);
  o.request_queue = static_cast<size_t>(a.request_queue);
  o.max_prompt_bytes = static_cast<size_t>(a.max_prompt_bytes);
  o.tls_cert_file = a.tls_cert;
  o.tls_key_file = a.tls_key;
  auto scheduling = scheduling_options(a.engine);
  if (!scheduling.is_ok()) return fail(scheduling.status());
  o.scheduling = *scheduling;
  o.scheduling.max_batch_tokens = a.max_batch_tokens;

  // Block the stop signals before the server's threads start, so that they inherit the mask and
  // only sigwait below sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  auto server = cluster::OpenAiServer::start(*bundle->engine, *loaded->tokenizer, o);
  if (!server.is_ok()) return fail(server.status());
  nlohmann::json listening{{"event", "listening"},
                           {"host", o.host},
                           {"port", (*server)->port()},
                           {"model", o.model_name},
                           {"max_batch", a.max_batch},
                           {"max_context", bundle->engine->max_context()},
                           {"prefix_cache_slots", cache_slots},
                           {"sparse", bundle->method_name},
                           {"chat", o.chat_template != ChatTemplate::kNone},
                           {"admission", a.engine.admission},
                           {"prefix_caching", a.engine.prefix_caching},
                           {"prefix_offload_bytes", o.scheduling.prefix_offload_bytes},
                           {"prefix_disk_bytes", o.scheduling.prefix_disk_bytes},
                           {"api_key_required", !o.api_keys.empty()},
                           {"max_connections", a.max_connections},
                           {"max_connections_per_ip", a.max_connections_per_ip},
                           {"request_workers", a.request_workers},
                           {"request_queue", a.request_queue}};
  if (!o.tls_cert_file.empty()) listening["tls"] = true;  // https://
  if (o.scheduling.prefix_shared_store) listening["prefix_store"] = o.scheduling.prefix_shared_store->name();
  std::cout << listening.dump() << std::endl;
  int sig = 0;
  sigwait(&stop_signals, &sig);
  (*server)->stop(std::chrono::milliseconds(static_cast<int64_t>(a.drain_seconds * 1000)));
  if (bundle->tiers) print_kv_node_events(*bundle->tiers);  // what the last steps saw
  nlohmann::json stopped = cluster::render_json((*server)->counters());
  stopped["event"] = "stopped";
  stopped["signal"] = sig;
  std::cout << stopped.dump() << std::endl;
  return 0;
}

}  // namespace specontext::cli
