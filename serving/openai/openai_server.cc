#include "serving/openai/openai_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <cctype>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "core/base/json_depth.h"
#include "core/tls/server_stream.h"
#include "core/tls/tls_context.h"
#include "serving/openai/http_request.h"
#include "serving/openai/openai_api.h"
#include "serving/structured/json_schema.h"

#if !defined(BOOST_ASIO_HAS_CO_AWAIT)
#error "serving/openai/openai_server.cc needs Boost.Asio with C++20 coroutines (GCC >= 10, -std=c++20)"
#endif

namespace specontext::cluster {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr auto kAwait = asio::use_awaitable;
// GCC 12 destroyed a temporary built in a `co_return co_await f(T{...})` expression twice
// (free(): invalid pointer in ~ApiError): arguments of awaited calls are named locals here.

// A scheduler event for one choice of a job.
struct ChoiceEvent {
  size_t choice = 0;
  SchedulerEvent event;
};

// One HTTP generation request, shared by its session (Asio thread) and the engine thread: a
// scheduler request per choice ("n").
struct Job {
  std::vector<GenerationRequest> requests;  // moved into the scheduler by the engine thread
  std::mutex mu;
  std::vector<ChoiceEvent> events;  // engine thread → session, under mu
  std::atomic<bool> cancel_requested{false};  // the whole job
  // Asio thread only.
  asio::steady_timer* waiter = nullptr;  // the session's wake-up timer while it waits
  bool client_gone = false;
  // Engine thread only.
  std::vector<RequestId> ids;  // per choice; invalid until submitted
};

// What the session asks the engine thread to cancel: one choice (a stop string) or all (-1).
struct CancelOrder {
  std::shared_ptr<Job> job;
  int64_t choice = -1;
};

// A connection's byte stream, TCP or TLS over TCP (core/tls/server_stream.h).
using ConnStream = tls::ServerStream;

// A connection: shared with the disconnect watcher, which may complete after the session moved on.
struct Conn {
  Conn(tcp::socket s, asio::ssl::context* tls) : stream(std::move(s), tls) {}
  ConnStream stream;
};

using Request = http::request<http::string_body>;

// Refused connections (past a connection limit) whose request is read to see whether it is a
// probe: at most this many at once, each for at most kRefusedReadTime; the rest are refused unread.
constexpr int64_t kRefusedReads = 64;
constexpr std::chrono::milliseconds kRefusedReadTime{1000};

// A generation request as a worker prepares it: parsed, tokenized, its constraint compiled.
struct PreparedGeneration {
  std::optional<ApiRequest> api;
  std::vector<GenerationRequest> requests;  // one per choice
  std::optional<ApiError> error;            // answer this instead
  std::string echo_text;                    // echo: the prompt's text
};

// Code points of UTF-8 text (lead bytes), where the completions API counts its text_offset.
int64_t code_points(std::string_view s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<uint8_t>(c) & 0xC0) != 0x80; });
}

// A tool call's id, as OpenAI's ("call_" and 24 hex digits).
std::string new_call_id() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::random_device rd;
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kHex[rd() % 16];
  return id;
}

// A streamed choice under a tool_choice that may call: how much of its text is out.
struct ToolStream {
  size_t content_sent = 0;    // bytes of the text sent as content
  std::string named_id;       // a named function: the call's id once its first delta is out
  size_t arguments_sent = 0;  // a named function: bytes of the text sent as its arguments
  bool ended = false;         // the final content and calls are out
};

// One choice of a generation as its events come in. Log-probabilities: an entry per token, sent
// once the text before it is out (streaming) or all at the end; after a stop string only tokens
// that start before it are kept. echo: the prompt leads the text (not seen by the stop strings),
// sent with the first events.
struct GenerationChoice {
  explicit GenerationChoice(const std::vector<std::string>& stops) : matcher(stops) {}
  StopMatcher matcher;
  TokenId prev = -1;
  int64_t completion_tokens = 0;
  double logprob_sum = 0.0;  // of the generated tokens (best_of ranks by the mean)
  std::string text;          // the whole text, when not streaming or with tools
  ToolStream tools;          // streaming with tools
  std::vector<LogprobEntry> logprobs;
  size_t logprobs_sent = 0;
  int64_t raw_code_points = 0;   // of every piece decoded so far
  int64_t sent_code_points = 0;  // of the text released (the echoed prompt, then the matcher's)
  bool echo_pending = false;
  nlohmann::json prompt_logprobs;  // prompt_logprobs_json once its first event came (null before)
  bool first_chunk = true;
  bool done = false;
  std::string finish_reason;  // set when generation ended normally
};

// One generation request from its preparation to its answer (the Asio thread's): its job for the
// engine thread, one GenerationChoice per sample (best_of), and how it ended.
struct Generation {
  Generation(ApiKind k, PreparedGeneration&& prepared)
      : kind(k),
        api(std::move(*prepared.api)),
        job(std::make_shared<Job>()),
        echo_text(std::move(prepared.echo_text)) {
    job->requests = std::move(prepared.requests);
    // Taken before the job is queued: the engine thread moves the requests out.
    const std::vector<TokenId>& queued_prompt = job->requests[0].prompt;
    prompt_len = static_cast<int64_t>(queued_prompt.size());
    // Only echo with logprobs and prompt_logprobs read the prompt's tokens later.
    if ((api.echo && api.logprobs >= 0) || api.prompt_logprobs >= 0) prompt = queued_prompt;
    want_logprobs = api.logprobs >= 0;
    for (int32_t c = 0; c < api.best_of; ++c) {
      choices.emplace_back(api.stop);
      choices.back().prev = queued_prompt.back();
      choices.back().echo_pending = api.echo;
    }
  }
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  ApiKind kind;
  ApiRequest api;
  std::shared_ptr<Job> job;
  int64_t prompt_len = 0;
  std::string echo_text;
  std::vector<TokenId> prompt;  // echo with logprobs and prompt_logprobs only
  bool want_logprobs = false;
  ResponseMeta meta;  // once accepted
  std::vector<GenerationChoice> choices;
  size_t choices_done = 0;
  std::optional<ApiError> failure;  // set when a choice ended in an error: the whole request fails
  int64_t cached_tokens = 0;        // prompt tokens the choices took from the prefix cache
};

// The choices a non-streamed answer shows, in order: best_of keeps the n of the highest mean
// log-probability per token (ties: the first).
std::vector<size_t> best_choices(const Generation& gen) {
  std::vector<size_t> order(gen.choices.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (gen.api.best_of <= gen.api.n) return order;
  auto mean_logprob = [&](size_t c) {
    const GenerationChoice& ch = gen.choices[c];
    return ch.completion_tokens > 0 ? ch.logprob_sum / static_cast<double>(ch.completion_tokens) : 0.0;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return mean_logprob(a) > mean_logprob(b); });
  order.resize(static_cast<size_t>(gen.api.n));
  return order;
}

// A streamed answer's server-sent events. The header goes out with the first event, so that a
// request refused before its first token still gets a proper HTTP error; after a failed write the
// rest are dropped (ok() is false).
class EventStream {
 public:
  EventStream(Conn& conn, const Request& req)
      : conn_(conn),
        head_{http::status::ok, req.version()},
        chunked_(req.version() >= 11),
        keep_alive_(req.keep_alive()) {}
  bool ok() const { return write_ok_; }
  bool head_sent() const { return head_sent_; }

  asio::awaitable<void> write(std::string data) {
    if (!write_ok_) co_return;
    beast::error_code ec;
    if (!head_sent_) {
      head_.set(http::field::server, "specontext");
      head_.set(http::field::content_type, "text/event-stream");
      head_.set(http::field::cache_control, "no-cache");
      head_.keep_alive(chunked_ && keep_alive_);
      if (chunked_) head_.chunked(true);
      head_sent_ = true;
      serializer_.emplace(head_);
      co_await http::async_write_header(conn_.stream, *serializer_, asio::redirect_error(kAwait, ec));
      if (ec) {
        write_ok_ = false;
        co_return;
      }
    }
    if (chunked_) {
      co_await asio::async_write(conn_.stream, http::make_chunk(asio::buffer(data)),
                                 asio::redirect_error(kAwait, ec));
    } else {
      co_await asio::async_write(conn_.stream, asio::buffer(data), asio::redirect_error(kAwait, ec));
    }
    if (ec) write_ok_ = false;
  }

  // After the last event: the last chunk. True when the connection may serve another request
  // (without chunked encoding the end of the stream is the end of the connection).
  asio::awaitable<bool> end() {
    if (!write_ok_ || !chunked_) co_return false;
    beast::error_code ec;
    co_await asio::async_write(conn_.stream, http::make_chunk_last(), asio::redirect_error(kAwait, ec));
    co_return !ec;
  }

 private:
  Conn& conn_;
  http::response<http::empty_body> head_;
  std::optional<http::response_serializer<http::empty_body>> serializer_;
  bool head_sent_ = false;
  const bool chunked_;
  const bool keep_alive_;
  bool write_ok_ = true;
};

std::string error_for_status(const Status& s) {
  return std::string(status_code_name(s.code())) + ": " + s.message();
}

}  // namespace

struct OpenAiServer::Impl {
  Impl(Engine& e, const Tokenizer& t, ServerOptions o)
      : engine(e), tokenizer(t), options(std::move(o)), acceptor(ioc), created(std::time(nullptr)) {}

  Engine& engine;
  const Tokenizer& tokenizer;
  ServerOptions options;
  size_t max_prompt_bytes = 0;  // options.max_prompt_bytes, or its default for the engine's context
  // Asio thread only (declared before ioc: sessions destroyed with ioc still release their entry).
  std::unordered_map<std::string, int64_t> connections_per_ip;  // open connections by client address
  int64_t refused_reads = 0;  // refused connections being read for a probe now
  asio::io_context ioc;
  tcp::acceptor acceptor;
  std::unique_ptr<asio::ssl::context> tls;  // TLS (https); null: plain HTTP
  uint16_t port = 0;
  int64_t created = 0;
  std::atomic<int64_t> next_response_id{1};

  // Inbox, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Job>> submits;
  std::vector<CancelOrder> cancels;
  bool stop_engine = false;

  std::atomic<bool> draining{false};
  std::atomic<int64_t> jobs_in_flight{0};  // accepted and not yet answered
  std::once_flag stopped;

  // Structured output: the vocabulary's token bytes, built on the first request that asks (Asio
  // thread), and json_object's constraint in its initial state, shared by every such request.
  mutable std::once_flag vocabulary_once;
  mutable std::shared_ptr<const VocabularyBytes> vocabulary;
  // The vocabulary's bytes for a constraint (built once, on first use).
  const std::shared_ptr<const VocabularyBytes>& vocabulary_bytes() const {
    std::call_once(vocabulary_once, [this] { vocabulary = VocabularyBytes::build(tokenizer); });
    return vocabulary;
  }
  mutable std::once_flag json_once;
  mutable std::shared_ptr<const TokenConstraint> json_prototype;
  mutable Status json_unavailable;

  // Counters (ServerCounters), written where the event happens.
  std::atomic<int64_t> accepted{0}, completed{0}, rejected{0}, cancelled{0}, failed{0}, unauthorized{0};
  std::atomic<int64_t> open_connections{0}, connections_refused{0}, connections_refused_per_ip{0},
      header_timeouts{0}, tls_handshake_failures{0};  // written by the Asio thread
  // Requests admitted to the workers and not yet prepared, of those being prepared now, and
  // requests refused because the queue was full.
  std::atomic<int64_t> prepare_pending{0}, prepare_running{0}, prepare_refused{0};
  // The counters the engine thread owns (publish()); its other fields stay 0.
  mutable std::mutex published_mu;
  ServerCounters published;
  int64_t waiting_now() const {
    std::lock_guard lk(published_mu);
    return published.waiting;
  }
  ServerCounters snapshot() const;  // every counter, now

  // Made and opened (Scheduler::open_prefix_disk) by start(); then the engine thread's alone.
  std::unique_ptr<Scheduler> scheduler_owned;
  std::thread io_thread;
  std::thread engine_thread;
  // Last: destroyed first, while what its unrun jobs refer to (ioc, the counters) still exists.
  std::unique_ptr<asio::thread_pool> workers;

  // ---- engine thread ----
  void engine_loop();
  void publish(const Scheduler& scheduler);  // the counters the engine thread owns
  void deliver(const std::shared_ptr<Job>& job, size_t choice, std::vector<SchedulerEvent> events);

  // ---- Asio thread ----
  asio::awaitable<void> accept_loop();
  asio::awaitable<void> session(tcp::socket socket, std::string peer);
  // Why a new connection from `peer` is refused (counted), or nothing when it is served.
  std::optional<ApiError> connection_refusal(const std::string& peer);
  void release_peer(const std::string& peer);
  // Past a connection limit: a probe (/health, /metrics) sent at once is answered, anything else
  // gets `refusal`; then the connection is closed.
  asio::awaitable<void> refuse_connection(tcp::socket socket, ApiError refusal);
  asio::awaitable<bool> answer_probe(Conn& conn, const Request& req, std::string_view path);
  // Request preparation on the workers. admit_preparation takes a place in the queue (false,
  // counted, when it is full); on_worker then runs `work` on a worker and resumes here with its result.
  bool admit_preparation();
  ApiError queue_full_error() const;
  template <typename F>
  asio::awaitable<std::invoke_result_t<F&>> on_worker(F work) {
    using R = std::invoke_result_t<F&>;
    auto run = [this, work = std::move(work)]() mutable -> asio::awaitable<R> {
      struct Running {
        Impl& s;
        ~Running() {
          --s.prepare_running;
          --s.prepare_pending;
        }
      } running{*this};
      ++prepare_running;
      if (options.before_prepare) options.before_prepare();
      co_return work();
    };
    co_return co_await asio::co_spawn(*workers, std::move(run), kAwait);
  }
  // ---- workers ----
  PreparedGeneration prepare_generation(ApiKind kind, std::string_view body) const;
  // 400 naming the field when a prompt is longer than max_prompt_bytes (before tokenizing it).
  std::optional<ApiError> prompt_bytes_error(ApiKind kind, const std::string& text,
                                             const std::vector<ChatMessageIn>& messages,
                                             const std::vector<std::string>& tools) const;
  ApiError unauthorized_error(const http::request_header<>& req);  // the 401, counted
  // Shuts the sending side, then drops what the client still sends for up to a second.
  asio::awaitable<void> drain_and_close(Conn& conn);
  // TLS: the handshake, within header_timeout (a failure is counted); true when the connection
  // may be read (always, for plain HTTP).
  asio::awaitable<bool> start_tls(Conn& conn);
  asio::awaitable<bool> handle(std::shared_ptr<Conn> conn, Request& req);
  // POST /tokenize (encode) and /detokenize, on a worker.
  asio::awaitable<bool> tokenize_route(Conn& conn, Request& req, bool encode);
  // POST /v1/completions and /v1/chat/completions: prepare (on a worker), submit, run, answer.
  asio::awaitable<bool> generate(std::shared_ptr<Conn> conn, Request& req, ApiKind kind);
  // Queues the job for the engine thread (counted as accepted), or the 503 to answer instead.
  std::optional<ApiError> submit(const std::shared_ptr<Job>& job);
  ResponseMeta response_meta(ApiKind kind);  // a new response id
  // Takes the job's events until every choice is done, a choice failed or the client went away;
  // streaming, each batch of events goes out as it comes.
  asio::awaitable<void> run_generation(Generation& gen, EventStream& events);
  // One event of a choice: its text goes to `delta`; a finish ends the choice (or fails the request).
  void take_event(Generation& gen, size_t choice, const SchedulerEvent& ev, std::string& delta);
  // On a choice's first event: its prompt_logprobs and the echoed prompt.
  void take_prompt_parts(const Generation& gen, GenerationChoice& ch, const SchedulerEvent& ev,
                         std::string& delta) const;
  // The prompt's entries for echo with logprobs; the first has nothing before it to predict it.
  void echo_logprobs(const Generation& gen, const std::vector<TokenLogprobs>& prompt_lp,
                     std::vector<LogprobEntry>& out) const;
  // A generated token: its text through the stop strings, its log-probabilities.
  void take_token(Generation& gen, size_t choice, const SchedulerEvent& ev, std::string& delta);
  // Streaming: a choice's new text (and tool calls, log-probabilities) as chunks.
  asio::awaitable<void> stream_delta(Generation& gen, size_t choice, const std::string& delta,
                                     EventStream& events);
  // A failed request: its error answer, or (once the stream began) an error event.
  asio::awaitable<bool> answer_failure(Conn& conn, const Request& req, const Generation& gen,
                                       EventStream& events);
  Usage usage_of(const Generation& gen) const;
  std::string completion_body(const Generation& gen, const Usage& usage) const;  // non-streamed
  // Streaming: each choice's finish chunk (after its role chunk, when nothing was sent), usage, [DONE].
  asio::awaitable<void> stream_ending(Generation& gen, EventStream& events, const Usage& usage);
  asio::awaitable<bool> reply(Conn& conn, const Request& req, http::status status, std::string body,
                              std::string_view content_type = "application/json");
  asio::awaitable<bool> reply_error(Conn& conn, const Request& req, const ApiError& error);
  void watch_disconnect(const std::shared_ptr<Conn>& conn, const std::shared_ptr<Job>& job);
  // The client went away (counted as cancelled): every choice.
  void cancel(const std::shared_ptr<Job>& job);
  // One choice ended by a stop string: the engine need not generate past it.
  void cancel_choice(const std::shared_ptr<Job>& job, size_t choice);
  asio::awaitable<std::vector<ChoiceEvent>> next_events(Job& job);
  std::string metrics_text() const;
  // 404 unless `model` is empty or the served name.
  std::optional<ApiError> model_error(const std::string& model) const;
  // A prompt's ids as the completions (text) or chat (messages, through the template) API
  // computes them; add_bos: the tokenizer's BOS first.
  // tools: definitions rendered into a chat prompt (as JSON text).
  std::optional<ApiError> encode_prompt(ApiKind kind, const std::string& text,
                                        const std::vector<ChatMessageIn>& messages, bool add_bos,
                                        std::vector<TokenId>& out, const std::vector<std::string>& tools = {}) const;
  // The constraint of a tool_choice that calls: a named function's arguments, or for "required"
  // a JSON array of {"name", "parameters"} calls of any of the tools.
  std::optional<ApiError> tool_constraint(const ApiRequest& in, std::shared_ptr<const TokenConstraint>& out) const;
  // A choice's tool calls, read from its constrained text (none when it was cut short).
  // The message's content is what remains of the text (nothing when it was all calls), and
  // finish_reason "stop" becomes "tool_calls" when the model chose to call (as OpenAI: a named
  // function stays "stop").
  std::vector<ToolCallOut> tool_calls_of(const ApiRequest& in, const std::string& text, std::string& content,
                                         std::string& finish_reason) const;
  // Streaming with tools, after the choice's text grew (`done`: it is complete): returns the
  // content to send now and appends the tool-call deltas. The whole stream adds up to the
  // answer tool_calls_of gives without streaming: "auto" content streams while it cannot become a
  // call, a named function's arguments as they come, and the rest once the text is complete.
  std::string tool_stream_step(const ApiRequest& in, ToolStream& ts, const std::string& text, bool done,
                               std::string& finish_reason, std::vector<ToolCallDelta>& calls) const;
  // POST /tokenize and /detokenize (vLLM's): the answer's status and body.
  std::pair<int, std::string> tokenize(std::string_view body) const;
  std::pair<int, std::string> detokenize(std::string_view body) const;
  // Builds the engine request from the parsed body, or the error to answer with.
  // One request per choice (best_of, which is n unless asked), seeds seed, seed + 1, ... (a random
  // base when no seed is given).
  std::optional<ApiError> to_generation(const ApiRequest& in, std::vector<GenerationRequest>& out) const;
};

// ---------------------------------------------------------------- engine thread

void OpenAiServer::Impl::deliver(const std::shared_ptr<Job>& job, size_t choice,
                                 std::vector<SchedulerEvent> events) {
  {
    std::lock_guard lk(job->mu);
    for (SchedulerEvent& ev : events) job->events.push_back({choice, std::move(ev)});
  }
  asio::post(ioc, [job] {
    if (job->waiter) job->waiter->cancel();
  });
}

void OpenAiServer::Impl::publish(const Scheduler& scheduler) {
  const PrefixStore& store = scheduler.prefix_store();
  ServerCounters p;
  copy_generation_stats(scheduler.stats(), p);
  p.cached_sequences = static_cast<int64_t>(store.cached_sequences());
  p.offloaded_prefixes = static_cast<int64_t>(store.offloaded_prefixes());
  p.offloaded_bytes = static_cast<int64_t>(store.offloaded_bytes());
  p.prefixes_on_disk = static_cast<int64_t>(store.prefixes_on_disk());
  p.prefix_disk_bytes = static_cast<int64_t>(store.disk_bytes());
  if (const PrefixBlobStore* blobs = store.blob_store()) {
    const PrefixBlobStore::ReplicaCounts r = blobs->replica_counts();
    p.prefix_remote_replicas_live = r.live;
    p.prefix_remote_replica_deaths = r.deaths;
  }
  p.kv_bytes_in_use = engine.memory().kv_bytes_in_use();
  p.waiting = static_cast<int64_t>(scheduler.waiting());
  p.running = static_cast<int64_t>(scheduler.running());
  std::lock_guard lk(published_mu);
  if (p.prefix_disk_errors > published.prefix_disk_errors) {
    std::fprintf(stderr, "serve: a prefix file was dropped (its prompt is computed): %s\n",
                 store.last_prefix_disk_error().c_str());
  }
  published = p;
}

void OpenAiServer::Impl::engine_loop() {
  Scheduler& scheduler = *scheduler_owned;
  struct Live {
    std::shared_ptr<Job> job;
    size_t choice = 0;
  };
  std::unordered_map<int64_t, Live> live;  // by RequestId
  std::vector<SchedulerEvent> events;
  std::unordered_map<int64_t, std::vector<SchedulerEvent>> by_request;
  std::vector<std::shared_ptr<Job>> unqueued;  // submitted as the server stopped
  auto end_with = [&](const std::shared_ptr<Job>& job, size_t choice, FinishReason reason, std::string error) {
    deliver(job, choice, {SchedulerEvent{RequestId(), -1, true, reason, std::move(error), std::nullopt, {}}});
  };
  for (;;) {
    std::vector<std::shared_ptr<Job>> new_jobs;
    std::vector<CancelOrder> cancel_orders;
    {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return stop_engine || !submits.empty() || !cancels.empty() || !scheduler.idle(); });
      if (stop_engine) {
        unqueued.swap(submits);
        break;
      }
      new_jobs.swap(submits);
      cancel_orders.swap(cancels);
    }
    for (auto& job : new_jobs) {
      if (job->cancel_requested) continue;  // gone before it was queued
      job->ids.assign(job->requests.size(), RequestId());
      for (size_t c = 0; c < job->requests.size(); ++c) {
        auto id = scheduler.submit(std::move(job->requests[c]));
        if (!id.is_ok()) {
          end_with(job, c, FinishReason::kError, error_for_status(id.status()));
          continue;
        }
        job->ids[c] = *id;
        live.emplace(id->value(), Live{job, c});
      }
    }
    for (const CancelOrder& order : cancel_orders) {
      for (size_t c = 0; c < order.job->ids.size(); ++c) {
        if (order.choice >= 0 && static_cast<size_t>(order.choice) != c) continue;
        const RequestId id = order.job->ids[c];
        // Its cache is sound (a stop string, a client gone): prefix caching may keep it.
        if (id.valid() && scheduler.cancel(id, /*keep_cached=*/true)) live.erase(id.value());
      }
    }
    publish(scheduler);
    if (scheduler.idle()) continue;

    events.clear();
    if (Status st = scheduler.step(events); !st.is_ok()) {
      std::fprintf(stderr, "serve: step failed, its requests are answered 500: %s\n", st.to_string().c_str());
    }
    publish(scheduler);  // before the answers go out, so that a client sees counters that include its request
    by_request.clear();
    for (SchedulerEvent& ev : events) by_request[ev.request.value()].push_back(std::move(ev));
    for (auto& [id, evs] : by_request) {
      auto it = live.find(id);
      if (it == live.end()) continue;
      const bool finished = evs.back().finished;
      deliver(it->second.job, it->second.choice, std::move(evs));
      if (finished) live.erase(it);
    }
  }
  // Shutting down: whatever is still accepted is answered, then the scheduler frees the sequences.
  for (auto& [id, l] : live) end_with(l.job, l.choice, FinishReason::kCancelled, "Unavailable: server shutting down");
  for (auto& job : unqueued) {
    for (size_t c = 0; c < job->requests.size(); ++c) {
      end_with(job, c, FinishReason::kCancelled, "Unavailable: server shutting down");
    }
  }
  scheduler_owned.reset();  // frees the sequences here (and writes persistent prefixes)
  std::lock_guard lk(published_mu);
  published.running = 0;
  published.waiting = 0;
  published.cached_sequences = 0;
}

// ---------------------------------------------------------------- Asio thread

asio::awaitable<void> OpenAiServer::Impl::accept_loop() {
  for (;;) {
    beast::error_code ec;
    tcp::socket socket = co_await acceptor.async_accept(asio::redirect_error(kAwait, ec));
    if (ec) {
      if (!acceptor.is_open()) co_return;
      continue;  // e.g. too many open files: the next accept may succeed
    }
    beast::error_code peer_ec;
    const tcp::endpoint remote = socket.remote_endpoint(peer_ec);
    std::string peer = peer_ec ? std::string("unknown") : remote.address().to_string();
    if (std::optional<ApiError> refusal = connection_refusal(peer)) {
      asio::co_spawn(ioc, refuse_connection(std::move(socket), std::move(*refusal)), asio::detached);
      continue;
    }
    // Counted here, not in the session, so that the next accept sees it.
    ++open_connections;
    ++connections_per_ip[peer];
    asio::co_spawn(ioc, session(std::move(socket), std::move(peer)), [](std::exception_ptr e) {
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "serve: connection ended by an exception: %s\n", ex.what());
      }
    });
  }
}

std::optional<ApiError> OpenAiServer::Impl::connection_refusal(const std::string& peer) {
  if (options.max_connections > 0 &&
      open_connections.load() >= static_cast<int64_t>(options.max_connections)) {
    ++connections_refused;
    return ApiError{503, "server_error",
                    "server at its connection limit (" + std::to_string(options.max_connections) +
                        " connections are open); retry later",
                    "", ""};
  }
  const auto it = connections_per_ip.find(peer);
  if (options.max_connections_per_ip > 0 && it != connections_per_ip.end() &&
      it->second >= static_cast<int64_t>(options.max_connections_per_ip)) {
    ++connections_refused_per_ip;
    return ApiError{429, "rate_limit_error",
                    "too many connections from " + peer + ": " + std::to_string(it->second) +
                        " are open, the most one client address may hold (max_connections_per_ip); close "
                        "one or retry later",
                    "", "rate_limit_exceeded"};
  }
  return std::nullopt;
}

void OpenAiServer::Impl::release_peer(const std::string& peer) {
  const auto it = connections_per_ip.find(peer);
  if (it != connections_per_ip.end() && --it->second <= 0) connections_per_ip.erase(it);
}

asio::awaitable<void> OpenAiServer::Impl::refuse_connection(tcp::socket socket, ApiError refusal) {
  auto conn = std::make_shared<Conn>(std::move(socket), tls.get());
  Request req;
  req.version(11);
  req.keep_alive(false);
  std::string path;
  bool secured = !conn->stream.is_tls();  // TLS: once its handshake is done, the refusal can be sent
  if (refused_reads < kRefusedReads) {
    // Its request header, if it comes at once: a probe is answered. A timer cancels the read (the
    // stream's own timeout would close the socket, and the refusal could not be sent).
    ++refused_reads;
    struct Reading {
      int64_t& count;
      ~Reading() { --count; }
    } reading{refused_reads};
    beast::flat_buffer buffer;
    http::request_parser<http::empty_body> parser;
    parser.header_limit(8 * 1024);
    auto armed = std::make_shared<bool>(true);
    asio::steady_timer timer(ioc);
    timer.expires_after(std::min<std::chrono::milliseconds>(options.header_timeout, kRefusedReadTime));
    timer.async_wait([conn, armed](const beast::error_code& ec) {
      beast::error_code ignored;
      if (!ec && *armed) conn->stream.socket().cancel(ignored);
    });
    secured = co_await start_tls(*conn);
    beast::error_code ec;
    if (secured)
      co_await http::async_read_header(conn->stream, buffer, parser, asio::redirect_error(kAwait, ec));
    *armed = false;
    timer.cancel();
    if (secured && !ec && parser.get().method() == http::verb::get) {
      req = Request(parser.get().base());
      req.keep_alive(false);
      path = std::string(path_of(req));
    }
  }
  if (!secured) co_return;                              // closed unanswered: no TLS session to answer in
  conn->stream.expires_after(std::chrono::seconds(1));  // a refused client must not hold a socket
  const bool sent =
      is_probe(path) ? co_await answer_probe(*conn, req, path) : co_await reply_error(*conn, req, refusal);
  if (!sent) co_return;
  co_await drain_and_close(*conn);
}

ApiError OpenAiServer::Impl::unauthorized_error(const http::request_header<>& req) {
  ++unauthorized;
  const bool has_header = req.find(http::field::authorization) != req.end();
  // OpenAI's answer to a missing or wrong key.
  return {401, "invalid_request_error",
          has_header ? "incorrect API key provided (send 'Authorization: Bearer <key>' "
                       "with a key the server was started with)"
                     : "no API key provided: send 'Authorization: Bearer <key>'",
          "", "invalid_api_key"};
}

asio::awaitable<void> OpenAiServer::Impl::drain_and_close(Conn& conn) {
  // One second for all of it: a refused client must not hold a socket for long.
  conn.stream.expires_after(std::chrono::seconds(1));
  co_await conn.stream.shutdown_send();
  // Read (and drop) what the client sent until it closes: closing with its request unread would
  // reset the connection, and the reset can discard the answer before the client reads it.
  beast::error_code ec;
  std::array<char, 4096> sink{};
  while (!ec)
    co_await conn.stream.tcp_layer().async_read_some(asio::buffer(sink), asio::redirect_error(kAwait, ec));
}

asio::awaitable<bool> OpenAiServer::Impl::start_tls(Conn& conn) {
  if (!conn.stream.is_tls()) co_return true;
  conn.stream.expires_after(options.header_timeout);
  const beast::error_code ec = co_await conn.stream.handshake();
  if (ec) ++tls_handshake_failures;
  co_return !ec;
}

asio::awaitable<void> OpenAiServer::Impl::session(tcp::socket socket, std::string peer) {
  struct OpenConnection {
    Impl& s;
    std::string peer;
    ~OpenConnection() {
      --s.open_connections;
      s.release_peer(peer);
    }
  } open{*this, std::move(peer)};  // taken by accept_loop
  auto conn = std::make_shared<Conn>(std::move(socket), tls.get());
  if (!co_await start_tls(*conn)) co_return;  // e.g. plain HTTP sent to the TLS port
  beast::flat_buffer buffer;
  const auto end_of_connection = [](const beast::error_code& e) {
    return e == http::error::end_of_stream || e == asio::error::eof || e == beast::error::timeout ||
           e == asio::error::connection_reset || e == asio::error::operation_aborted ||
           e == asio::ssl::error::stream_truncated;  // TLS: closed without close_notify
  };
  for (bool first = true;; first = false) {
    HttpRequestParser parser;
    configure_request_parser(parser, options.max_body_bytes);
    beast::error_code ec;
    if (!first && buffer.size() == 0) {
      // Kept alive between requests: the next one's first byte within idle_timeout, or it closes.
      conn->stream.expires_after(options.idle_timeout);
      const size_t n =
          co_await conn->stream.async_read_some(buffer.prepare(4096), asio::redirect_error(kAwait, ec));
      buffer.commit(n);
      if (ec) break;
    }
    // The header whole within header_timeout (from the accept, for the first request); on
    // timeout the stream closes the socket. The header first: a request without a valid key is
    // refused before its body is read.
    conn->stream.expires_after(options.header_timeout);
    co_await http::async_read_header(conn->stream, buffer, parser, asio::redirect_error(kAwait, ec));
    if (ec == beast::error::timeout) {
      ++header_timeouts;
      co_return;
    }
    if (end_of_connection(ec)) break;
    const bool key_ok = ec || authorized(parser.get(), options.api_keys);
    // Without a valid key, a small body is read (and dropped) so that the connection stays
    // usable; a large or chunked one, or one the client waits for a 100 Continue to send, is not
    // read at all: the 401 goes out and the connection closes.
    if (refuse_unread(parser, key_ok)) {
      Request req(parser.get().base());
      req.keep_alive(false);
      co_await reply_error(*conn, req, unauthorized_error(req));
      co_await drain_and_close(*conn);
      co_return;
    }
    if (!ec && expects_continue(parser.get()) && !parser.is_done()) {
      http::response<http::empty_body> go_on{http::status::continue_, parser.get().version()};
      co_await http::async_write(conn->stream, go_on, asio::redirect_error(kAwait, ec));
      if (ec) break;
    }
    if (!ec && !parser.is_done()) {
      conn->stream.expires_after(options.idle_timeout);
      co_await http::async_read(conn->stream, buffer, parser, asio::redirect_error(kAwait, ec));
      if (end_of_connection(ec)) break;
    }
    conn->stream.expires_never();
    if (ec) {
      // The request cannot be read (too large, not HTTP): answer once, then close.
      Request req;
      req.version(11);
      req.keep_alive(false);
      ++rejected;
      const ApiError error = unreadable_request_error(ec, options.max_body_bytes);
      co_await reply_error(*conn, req, error);
      break;
    }
    Request req = parser.release();
    const bool keep = key_ok ? co_await handle(conn, req) : co_await reply_error(*conn, req, unauthorized_error(req));
    if (!keep || !req.keep_alive()) break;
  }
  co_await conn->stream.shutdown_send();
}

asio::awaitable<bool> OpenAiServer::Impl::reply(Conn& conn, const Request& req, http::status status,
                                                std::string body, std::string_view content_type) {
  http::response<http::string_body> res{status, req.version()};
  res.set(http::field::server, "specontext");
  res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
  if (status == http::status::service_unavailable || status == http::status::too_many_requests) {
    res.set(http::field::retry_after, "1");
  }
  if (status == http::status::unauthorized) res.set(http::field::www_authenticate, "Bearer");
  res.keep_alive(req.keep_alive());
  res.body() = std::move(body);
  res.prepare_payload();
  beast::error_code ec;
  co_await http::async_write(conn.stream, res, asio::redirect_error(kAwait, ec));
  co_return !ec;
}

asio::awaitable<bool> OpenAiServer::Impl::reply_error(Conn& conn, const Request& req, const ApiError& error) {
  std::string body = error_body(error);
  co_return co_await reply(conn, req, static_cast<http::status>(error.http_status), std::move(body));
}

asio::awaitable<bool> OpenAiServer::Impl::handle(std::shared_ptr<Conn> conn, Request& req) {
  const Routing routing = route_of(
      req.method(), std::string_view(req.method_string().data(), req.method_string().size()), path_of(req));
  if (!routing.route) {
    ++rejected;
    co_return co_await reply_error(*conn, req, routing.error);
  }
  switch (*routing.route) {
    case Route::kCompletions:
      co_return co_await generate(conn, req, ApiKind::kCompletion);
    case Route::kChatCompletions:
      co_return co_await generate(conn, req, ApiKind::kChat);
    case Route::kHealth:
    case Route::kMetrics:
      co_return co_await answer_probe(*conn, req, path_of(req));
    case Route::kModels: {
      std::string body = dump_json(models_response(options.model_name, created, engine.max_context()));
      co_return co_await reply(*conn, req, http::status::ok, std::move(body));
    }
    case Route::kTokenize:
    case Route::kDetokenize:
      co_return co_await tokenize_route(*conn, req, *routing.route == Route::kTokenize);
  }
  co_return false;
}

asio::awaitable<bool> OpenAiServer::Impl::tokenize_route(Conn& conn, Request& req, bool encode) {
  if (!admit_preparation()) {
    ++rejected;
    const ApiError error = queue_full_error();
    co_return co_await reply_error(conn, req, error);
  }
  auto work = [this, encode, &req] { return encode ? tokenize(req.body()) : detokenize(req.body()); };
  auto [status, body] = co_await on_worker(std::move(work));
  if (status != 200) ++rejected;
  co_return co_await reply(conn, req, static_cast<http::status>(status), std::move(body));
}

asio::awaitable<bool> OpenAiServer::Impl::answer_probe(Conn& conn, const Request& req,
                                                       std::string_view path) {
  const bool health = path == "/health";
  std::string body = health ? std::string("{\"status\":\"ok\"}") : metrics_text();
  const std::string_view type = health ? "application/json" : "text/plain; version=0.0.4";
  co_return co_await reply(conn, req, http::status::ok, std::move(body), type);
}

bool OpenAiServer::Impl::admit_preparation() {
  const auto bound = static_cast<int64_t>(options.request_workers + options.request_queue);
  if (prepare_pending.load() >= bound) {  // only this thread adds, so the bound holds
    ++prepare_refused;
    return false;
  }
  ++prepare_pending;
  return true;
}

ApiError OpenAiServer::Impl::queue_full_error() const {
  return {503, "server_error",
          "server busy: " + std::to_string(options.request_queue) +
              " requests are waiting for a worker to tokenize them (the request queue is full); retry later",
          "", ""};
}

PreparedGeneration OpenAiServer::Impl::prepare_generation(ApiKind kind, std::string_view body) const {
  PreparedGeneration p;
  ParseResult parsed = parse_api_request(kind, body);
  if (!parsed.request) {
    p.error = std::move(parsed.error);
    return p;
  }
  p.api = std::move(parsed.request);
  p.error = to_generation(*p.api, p.requests);
  if (!p.error && p.api->echo) {
    p.echo_text = p.api->prompt_is_ids ? tokenizer.decode(p.requests[0].prompt) : p.api->prompt_text;
  }
  return p;
}

std::optional<ApiError> OpenAiServer::Impl::prompt_bytes_error(ApiKind kind, const std::string& text,
                                                               const std::vector<ChatMessageIn>& messages,
                                                               const std::vector<std::string>& tools) const {
  auto too_long = [&](const char* field, size_t bytes) -> std::optional<ApiError> {
    if (bytes <= max_prompt_bytes) return std::nullopt;
    return ApiError{400, "invalid_request_error",
                    "field '" + std::string(field) + "' is " + std::to_string(bytes) +
                        " bytes, more than the " + std::to_string(max_prompt_bytes) +
                        " bytes of prompt this server tokenizes (max_prompt_bytes; this model's context is " +
                        std::to_string(engine.max_context()) + " tokens)",
                    field, "context_length_exceeded"};
  };
  if (kind != ApiKind::kChat) return too_long("prompt", text.size());
  size_t bytes = 0;
  for (const ChatMessageIn& m : messages) {
    bytes += m.content.size();
    for (const ToolCallIn& c : m.tool_calls) bytes += c.name.size() + c.arguments.size();
  }
  if (auto err = too_long("messages", bytes)) return err;
  for (const std::string& t : tools) bytes += t.size();
  return too_long("tools", bytes);
}

std::pair<int, std::string> OpenAiServer::Impl::tokenize(std::string_view body) const {
  const TokenizeParse parsed = parse_tokenize_request(body);
  if (!parsed.request) return {parsed.error.http_status, error_body(parsed.error)};
  const TokenizeRequest& in = *parsed.request;
  std::optional<ApiError> err = model_error(in.model);
  std::vector<TokenId> ids;
  if (!err) {
    const bool add_bos = in.add_special_tokens && (in.kind == ApiKind::kChat || tokenizer.add_bos_by_default());
    err = encode_prompt(in.kind, in.prompt, in.messages, add_bos, ids);
  }
  if (err) return {err->http_status, error_body(*err)};
  std::vector<std::string> pieces;
  if (in.return_token_strs) {
    for (size_t i = 0; i < ids.size(); ++i) pieces.push_back(tokenizer.decode_token(i == 0 ? -1 : ids[i - 1], ids[i]));
  }
  return {200,
          dump_json(tokenize_response(ids, engine.max_context(), in.return_token_strs ? &pieces : nullptr))};
}

std::pair<int, std::string> OpenAiServer::Impl::detokenize(std::string_view body) const {
  const DetokenizeParse parsed = parse_detokenize_request(body);
  if (!parsed.request) return {parsed.error.http_status, error_body(parsed.error)};
  const DetokenizeRequest& in = *parsed.request;
  if (auto err = model_error(in.model)) return {err->http_status, error_body(*err)};
  const int64_t vocab = engine.config().vocab_size;
  for (size_t i = 0; i < in.tokens.size(); ++i) {
    if (in.tokens[i] >= vocab) {
      const ApiError err{400, "invalid_request_error",
                         "field 'tokens[" + std::to_string(i) + "]' is token id " + std::to_string(in.tokens[i]) +
                             ", outside the vocabulary of " + std::to_string(vocab),
                         "tokens", ""};
      return {400, error_body(err)};
    }
  }
  nlohmann::json out{{"prompt", sanitize_utf8(tokenizer.decode(in.tokens))}};
  return {200, dump_json(out)};
}

std::optional<ApiError> OpenAiServer::Impl::model_error(const std::string& model) const {
  if (model.empty() || model == options.model_name) return std::nullopt;
  return ApiError{404, "not_found_error",
                  "the model '" + model + "' does not exist (this server serves '" + options.model_name + "')",
                  "model", "model_not_found"};
}

std::optional<ApiError> OpenAiServer::Impl::encode_prompt(ApiKind kind, const std::string& text,
                                                          const std::vector<ChatMessageIn>& messages, bool add_bos,
                                                          std::vector<TokenId>& out,
                                                          const std::vector<std::string>& tools) const {
  if (auto err = prompt_bytes_error(kind, text, messages, tools)) return err;
  if (kind == ApiKind::kChat) {
    if (options.chat_template == ChatTemplate::kNone) {
      return ApiError{400, "invalid_request_error",
                      "this model has no chat template (its tokenizer is not of a known chat family); use "
                      "/v1/completions",
                      "messages", ""};
    }
    if (!tools.empty() && !chat_template_renders_tools(options.chat_template)) {
      return ApiError{400, "invalid_request_error",
                      "tools: this model's chat template (" + std::string(chat_template_name(options.chat_template)) +
                          ") has no place for function tools; send the request without them",
                      "tools", ""};
    }
    std::vector<ChatMessage> msgs;
    for (const ChatMessageIn& m : messages) {
      ChatMessage msg{m.role, m.content, {}};
      for (const ToolCallIn& c : m.tool_calls) msg.tool_calls.push_back({c.name, c.arguments});
      msgs.push_back(std::move(msg));
    }
    // The template writes its own special tokens, so they are parsed.
    auto ids = tokenizer.encode(apply_chat_template(options.chat_template, msgs, tools), add_bos, /*parse_special=*/true);
    if (!ids.is_ok())
      return ApiError{400, "invalid_request_error", "messages: " + ids.status().message(), "messages", ""};
    out = std::move(*ids);
    return std::nullopt;
  }
  auto ids = tokenizer.encode(text, add_bos, /*parse_special=*/false);
  if (!ids.is_ok()) return ApiError{400, "invalid_request_error", "prompt: " + ids.status().message(), "prompt", ""};
  out = std::move(*ids);
  return std::nullopt;
}

std::vector<ToolCallOut> OpenAiServer::Impl::tool_calls_of(const ApiRequest& in, const std::string& text,
                                                            std::string& content, std::string& finish_reason) const {
  std::vector<ToolCallOut> calls;
  content = text;
  if (in.tool_choice == ApiRequest::ToolChoice::kNamed) {
    // The text is the arguments (cut short when max_tokens came first: finish_reason says so).
    calls.push_back({new_call_id(), in.tool_choice_name, text});
    content.clear();
    return calls;
  }
  if (in.tool_choice == ApiRequest::ToolChoice::kAuto) {
    ParsedToolCalls parsed = parse_tool_calls(options.chat_template, text);
    for (ChatToolCall& c : parsed.calls) calls.push_back({new_call_id(), std::move(c.name), std::move(c.arguments)});
    content = std::move(parsed.content);
    if (!calls.empty() && finish_reason == "stop") finish_reason = "tool_calls";
    return calls;
  }
  // "required": the constrained text is an array of {"name", "parameters"}; cut short, it is not,
  // and the text stays the message's content.
  const auto parsed = parse_ordered_json_bounded(text);  // model text: its depth is the model's to choose
  if (!parsed.is_array()) return calls;
  for (const auto& c : parsed) {
    if (!c.is_object() || !c.contains("name") || !c["name"].is_string() || !c.contains("parameters")) return {};
    // In the form "auto" calls take (the model's own tojson style), as vLLM answers both.
    calls.push_back({new_call_id(), c["name"].get<std::string>(), tojson_line(dump_json(c["parameters"]))});
  }
  if (!calls.empty()) {
    content.clear();
    if (finish_reason == "stop") finish_reason = "tool_calls";
  }
  return calls;
}

std::string OpenAiServer::Impl::tool_stream_step(const ApiRequest& in, ToolStream& ts, const std::string& text,
                                                 bool done, std::string& finish_reason,
                                                 std::vector<ToolCallDelta>& calls) const {
  if (ts.ended) return {};
  if (in.tool_choice == ApiRequest::ToolChoice::kNamed) {  // the text is the call's arguments
    ToolCallDelta d{0, "", "", text.substr(ts.arguments_sent)};
    ts.arguments_sent = text.size();
    if (ts.named_id.empty()) {
      ts.named_id = new_call_id();
      d.id = ts.named_id;
      d.name = in.tool_choice_name;
    }
    if (!d.id.empty() || !d.arguments.empty()) calls.push_back(std::move(d));
    ts.ended = done;
    return {};
  }
  if (!done) {
    // "required" holds everything: cut short, its text is the content.
    const size_t ready =
        in.tool_choice == ApiRequest::ToolChoice::kAuto
            ? tool_call_content_prefix(options.chat_template, text, ts.content_sent)
            : 0;
    if (ready <= ts.content_sent) return {};
    std::string out = text.substr(ts.content_sent, ready - ts.content_sent);
    ts.content_sent = ready;
    return out;
  }
  ts.ended = true;
  std::string content;
  const std::vector<ToolCallOut> whole = tool_calls_of(in, text, content, finish_reason);
  for (size_t i = 0; i < whole.size(); ++i) {
    calls.push_back({static_cast<int32_t>(i), whole[i].id, whole[i].name, whole[i].arguments});
  }
  // The content starts with what is out already: tool_call_content_prefix promises it.
  return content.size() > ts.content_sent ? content.substr(ts.content_sent) : std::string();
}

std::optional<ApiError> OpenAiServer::Impl::tool_constraint(const ApiRequest& in,
                                                            std::shared_ptr<const TokenConstraint>& out) const {
  nlohmann::ordered_json schema;
  if (in.tool_choice == ApiRequest::ToolChoice::kNamed) {
    for (const ToolIn& t : in.tools) {
      if (t.name == in.tool_choice_name) schema = t.parameters;
    }
  } else {
    // vLLM's form for "required": [{"name": N, "parameters": {...}}, ...], one or more calls.
    // Each tool's $defs move to the root, where its "#/$defs/..." references point.
    nlohmann::ordered_json any_of = nlohmann::ordered_json::array();
    nlohmann::ordered_json shared = {{"$defs", nlohmann::ordered_json::object()},
                                     {"definitions", nlohmann::ordered_json::object()}};
    for (const ToolIn& t : in.tools) {
      nlohmann::ordered_json params = t.parameters;
      for (const char* key : {"$defs", "definitions"}) {
        if (!params.is_object() || !params.contains(key)) continue;
        if (!params[key].is_object()) {
          return ApiError{400, "invalid_request_error", "tool '" + t.name + "': '" + key + "' must be an object", "tools", ""};
        }
        nlohmann::ordered_json& defs = shared[key];
        for (const auto& [name, def] : params[key].items()) {
          if (defs.contains(name) && defs[name] != def) {
            return ApiError{400, "invalid_request_error",
                            "tools define '" + name + "' differently in their $defs: with tool_choice \"required\" "
                            "they share one schema",
                            "tools", ""};
          }
          defs[name] = def;
        }
        params.erase(key);
      }
      any_of.push_back({{"type", "object"},
                        {"properties", {{"name", {{"enum", {t.name}}}}, {"parameters", params}}},
                        {"required", {"name", "parameters"}},
                        {"additionalProperties", false}});
    }
    schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", any_of}}}};
    for (const char* key : {"$defs", "definitions"}) {
      if (!shared[key].empty()) schema[key] = shared[key];
    }
  }
  auto c = JsonSchemaConstraint::create(schema, vocabulary_bytes());
  if (!c.is_ok()) {
    return ApiError{400, "invalid_request_error", "tools: " + c.status().message(), "tools", ""};
  }
  out = std::move(*c);
  return std::nullopt;
}

std::optional<ApiError> OpenAiServer::Impl::to_generation(const ApiRequest& in,
                                                          std::vector<GenerationRequest>& choices) const {
  choices.assign(1, GenerationRequest{});
  GenerationRequest& out = choices[0];
  const int64_t vocab = engine.config().vocab_size;
  auto outside_vocabulary = [&](const std::string& field, const char* param, TokenId id) {
    return ApiError{400, "invalid_request_error",
                    "field '" + field + "' is token id " + std::to_string(id) + ", outside the vocabulary of " +
                        std::to_string(vocab),
                    param, ""};
  };
  if (auto err = model_error(in.model)) return err;
  if (in.prompt_is_ids) {
    for (size_t i = 0; i < in.prompt_ids.size(); ++i) {
      if (in.prompt_ids[i] < 0 || in.prompt_ids[i] >= vocab) {
        return outside_vocabulary("prompt[" + std::to_string(i) + "]", "prompt", in.prompt_ids[i]);
      }
    }
    out.prompt = in.prompt_ids;
  } else {
    const bool add_bos = in.kind == ApiKind::kCompletion && tokenizer.add_bos_by_default();
    std::vector<std::string> tools;  // shown to the model only when it is to call one
    if (in.tool_choice != ApiRequest::ToolChoice::kNone) {
      for (const ToolIn& t : in.tools) tools.push_back(t.definition);
    }
    if (auto err = encode_prompt(in.kind, in.prompt_text, in.messages, add_bos, out.prompt, tools)) return err;
  }
  const char* prompt_field = in.kind == ApiKind::kChat ? "messages" : "prompt";
  if (out.prompt.empty())
    return ApiError{400, "invalid_request_error", "the prompt encodes to no tokens", prompt_field, ""};
  const int64_t context = engine.max_context();
  const int64_t prompt_len = static_cast<int64_t>(out.prompt.size());
  if (prompt_len >= context || (in.max_tokens && prompt_len + *in.max_tokens > context)) {
    return ApiError{
        400, "invalid_request_error",
        "this model's maximum context length is " + std::to_string(context) + " tokens; the prompt has " +
            std::to_string(prompt_len) + " tokens" +
            (in.max_tokens ? " and max_tokens asks for " + std::to_string(*in.max_tokens) + " more" : ""),
        in.max_tokens && prompt_len < context ? "max_tokens" : prompt_field, "context_length_exceeded"};
  }
  out.max_new_tokens = in.max_tokens ? *in.max_tokens : context - prompt_len;
  out.sampling = in.sampling;
  out.logprobs = in.logprobs;
  // echo with logprobs shows the prompt's tokens with `logprobs` alternatives; prompt_logprobs its own count.
  out.prompt_logprobs = std::max(in.echo && in.logprobs >= 0 ? in.logprobs : -1, in.prompt_logprobs);
  if (!in.ignore_eos) out.stop_ids = options.stop_ids;
  for (TokenId id : in.stop_token_ids) {
    if (id >= vocab) return outside_vocabulary("stop_token_ids", "stop_token_ids", id);
    out.stop_ids.push_back(id);  // ignore_eos leaves these in, as vLLM
  }
  for (const auto& [id, bias] : in.logit_bias) {
    if (id >= vocab) return outside_vocabulary("logit_bias." + std::to_string(id), "logit_bias", id);
  }
  out.logit_bias = in.logit_bias;
  out.frequency_penalty = in.frequency_penalty;
  out.presence_penalty = in.presence_penalty;
  out.min_p = in.min_p;
  out.min_tokens = std::min(in.min_tokens, out.max_new_tokens);
  if (in.tool_choice == ApiRequest::ToolChoice::kRequired || in.tool_choice == ApiRequest::ToolChoice::kNamed) {
    if (auto err = tool_constraint(in, out.constraint)) return err;
  }
  if (in.structured != ApiRequest::Structured::kNone) {
    const std::shared_ptr<const VocabularyBytes>& bytes = vocabulary_bytes();
    auto refused = [&](const Status& st) {
      return ApiError{400, "invalid_request_error", st.message(), in.structured_field, ""};
    };
    switch (in.structured) {
      case ApiRequest::Structured::kJsonObject: {
        std::call_once(json_once, [this] {
          auto c = JsonObjectConstraint::create(vocabulary);
          if (c.is_ok()) {
            json_prototype = std::move(*c);
          } else {
            json_unavailable = c.status();
          }
        });
        if (json_prototype == nullptr) return refused(json_unavailable.with_context("response_format json_object"));
        out.constraint = json_prototype;
        break;
      }
      case ApiRequest::Structured::kJsonSchema: {
        auto c = JsonSchemaConstraint::create(in.schema, bytes);
        if (!c.is_ok()) return refused(c.status().with_context(in.structured_field));
        out.constraint = std::move(*c);
        break;
      }
      case ApiRequest::Structured::kChoice: {
        // One alternative per choice, each spelled exactly.
        GrammarBuilder g;
        std::vector<GrammarSequence> alternatives;
        for (const std::string& choice : in.choices) alternatives.push_back(GrammarBuilder::literal(choice));
        const uint32_t root = g.add("choice", std::move(alternatives));
        auto grammar = g.build(root);
        if (!grammar.is_ok()) return refused(grammar.status().with_context("guided_choice"));
        auto c = JsonSchemaConstraint::create(std::make_shared<const Grammar>(std::move(*grammar)), bytes);
        if (!c.is_ok()) return refused(c.status().with_context("guided_choice"));
        out.constraint = std::move(*c);
        break;
      }
      case ApiRequest::Structured::kNone:
        break;
    }
  }
  // best_of ranks its samples by their tokens' log-probabilities: the chosen one's at least.
  if (in.best_of > in.n) out.logprobs = std::max(out.logprobs, 0);
  if (in.best_of > 1) {
    // Distinct streams per choice; without a seed, a random base (0 would make each time-derived,
    // and choices created in the same tick could coincide).
    uint64_t base = in.sampling.seed;
    if (base == 0) base = (static_cast<uint64_t>(std::random_device{}()) << 32) | std::random_device{}();
    const GenerationRequest proto = out;  // `out` refers into choices, which assign() replaces
    choices.assign(static_cast<size_t>(in.best_of), proto);
    for (int32_t c = 0; c < in.best_of; ++c) {
      const uint64_t seed = base + static_cast<uint64_t>(c);
      choices[static_cast<size_t>(c)].sampling.seed = seed == 0 ? 1 : seed;
    }
  }
  return std::nullopt;
}

void OpenAiServer::Impl::cancel(const std::shared_ptr<Job>& job) {
  if (job->cancel_requested.exchange(true)) return;
  ++cancelled;
  {
    std::lock_guard lk(mu);
    cancels.push_back({job, -1});
  }
  cv.notify_one();
}

void OpenAiServer::Impl::cancel_choice(const std::shared_ptr<Job>& job, size_t choice) {
  {
    std::lock_guard lk(mu);
    cancels.push_back({job, static_cast<int64_t>(choice)});
  }
  cv.notify_one();
}

// A client that closes its connection while its request runs: readable with nothing to read
// means EOF. Data (a pipelined request) ends the watch without consuming it.
void OpenAiServer::Impl::watch_disconnect(const std::shared_ptr<Conn>& conn,
                                          const std::shared_ptr<Job>& job) {
  conn->stream.socket().async_wait(tcp::socket::wait_read, [this, conn, job](const beast::error_code& ec) {
    if (ec == asio::error::operation_aborted) return;
    char byte = 0;
    const ssize_t n = ::recv(conn->stream.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (!ec && n > 0) return;
    if (!ec && n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    job->client_gone = true;
    cancel(job);
    if (job->waiter) job->waiter->cancel();
  });
}

asio::awaitable<std::vector<ChoiceEvent>> OpenAiServer::Impl::next_events(Job& job) {
  asio::steady_timer timer(ioc);
  for (;;) {
    {
      std::lock_guard lk(job.mu);
      if (!job.events.empty() || job.client_gone) co_return std::exchange(job.events, {});
    }
    // The engine thread posts the wake-up after appending, so it cannot slip in before this wait.
    timer.expires_at(asio::steady_timer::time_point::max());
    job.waiter = &timer;
    beast::error_code ec;
    co_await timer.async_wait(asio::redirect_error(kAwait, ec));
    job.waiter = nullptr;
  }
}

asio::awaitable<bool> OpenAiServer::Impl::generate(std::shared_ptr<Conn> conn, Request& req, ApiKind kind) {
  if (!admit_preparation()) {
    ++rejected;
    const ApiError error = queue_full_error();
    co_return co_await reply_error(*conn, req, error);
  }
  ++jobs_in_flight;
  struct InFlight {
    std::atomic<int64_t>& count;
    ~InFlight() { --count; }
  } in_flight{jobs_in_flight};  // from admission until the answer is written: stop() waits for it
  // Parsing, the template, tokenizing and compiling the constraint happen on a worker.
  auto work = [this, kind, &req] { return prepare_generation(kind, req.body()); };
  PreparedGeneration prepared = co_await on_worker(std::move(work));
  if (prepared.error) {
    ++rejected;
    co_return co_await reply_error(*conn, req, *prepared.error);
  }
  Generation gen(kind, std::move(prepared));
  if (std::optional<ApiError> refusal = submit(gen.job)) {
    ++rejected;
    co_return co_await reply_error(*conn, req, *refusal);
  }
  watch_disconnect(conn, gen.job);
  gen.meta = response_meta(kind);
  EventStream events(*conn, req);
  co_await run_generation(gen, events);
  conn->stream.socket().cancel();  // ends the disconnect watch
  if (gen.job->client_gone || !events.ok()) co_return false;
  if (gen.failure) co_return co_await answer_failure(*conn, req, gen, events);
  ++completed;
  const Usage usage = usage_of(gen);
  if (!gen.api.stream) {
    std::string body = completion_body(gen, usage);
    co_return co_await reply(*conn, req, http::status::ok, std::move(body));
  }
  co_await stream_ending(gen, events, usage);
  co_return co_await events.end();
}

std::optional<ApiError> OpenAiServer::Impl::submit(const std::shared_ptr<Job>& job) {
  if (draining) return ApiError{503, "server_error", "server shutting down", "", ""};
  bool busy = false;
  {
    std::lock_guard lk(mu);
    busy = static_cast<size_t>(waiting_now()) + submits.size() >= options.max_waiting;
    if (!busy) submits.push_back(job);
  }
  if (busy) {
    return ApiError{
        503, "server_error",
        "server busy: " + std::to_string(options.max_waiting) + " requests are waiting; retry later", "", ""};
  }
  ++accepted;
  cv.notify_one();
  return std::nullopt;
}

ResponseMeta OpenAiServer::Impl::response_meta(ApiKind kind) {
  ResponseMeta meta;
  meta.id = std::string(kind == ApiKind::kChat ? "chatcmpl-" : "cmpl-") + std::to_string(next_response_id++);
  meta.created = std::time(nullptr);
  meta.model = options.model_name;
  return meta;
}

asio::awaitable<void> OpenAiServer::Impl::run_generation(Generation& gen, EventStream& events) {
  while (gen.choices_done < gen.choices.size() && !gen.failure) {
    std::vector<ChoiceEvent> batch = co_await next_events(*gen.job);
    if (gen.job->client_gone) break;
    std::vector<std::string> deltas(gen.choices.size());
    for (const ChoiceEvent& ce : batch) {
      if (gen.failure || ce.choice >= gen.choices.size()) break;
      if (gen.choices[ce.choice].done) continue;
      take_event(gen, ce.choice, ce.event, deltas[ce.choice]);
    }
    for (size_t c = 0; c < gen.choices.size() && !gen.failure; ++c) {
      GenerationChoice& ch = gen.choices[c];
      ch.sent_code_points += code_points(deltas[c]);
      if (ch.matcher.stopped()) {
        std::erase_if(ch.logprobs, [&](const LogprobEntry& e) { return e.text_offset >= ch.sent_code_points; });
      }
      if (gen.api.stream) {
        co_await stream_delta(gen, c, deltas[c], events);
      } else {
        ch.text += deltas[c];
      }
    }
    if (gen.api.stream && !events.ok()) {
      cancel(gen.job);
      break;
    }
  }
  if (gen.failure) {  // the request fails as a whole: the other choices' sequences are freed at once
    for (size_t c = 0; c < gen.choices.size(); ++c) {
      if (!gen.choices[c].done) cancel_choice(gen.job, c);
    }
  }
}

void OpenAiServer::Impl::take_event(Generation& gen, size_t choice, const SchedulerEvent& ev,
                                    std::string& delta) {
  GenerationChoice& ch = gen.choices[choice];
  gen.cached_tokens = std::max(gen.cached_tokens, ev.cached_prompt_tokens);
  const bool failed_ending =
      ev.finished && (ev.finish == FinishReason::kRefused || ev.finish == FinishReason::kCancelled ||
                      ev.finish == FinishReason::kError);
  if (!failed_ending) take_prompt_parts(gen, ch, ev, delta);
  if (!ev.finished) {
    take_token(gen, choice, ev, delta);
    return;
  }
  ch.done = true;
  ++gen.choices_done;
  switch (ev.finish) {
    case FinishReason::kStop:
    case FinishReason::kLength:
    case FinishReason::kContext:
      delta += ch.matcher.finish();
      ch.finish_reason = ev.finish == FinishReason::kStop ? "stop" : "length";
      break;
    case FinishReason::kRefused:
      gen.failure =
          ApiError{400, "invalid_request_error", "request " + ev.error, "", "context_length_exceeded"};
      break;
    case FinishReason::kCancelled:  // the server is shutting down
      gen.failure = ApiError{503, "server_error", ev.error, "", ""};
      break;
    case FinishReason::kError:
      gen.failure = ApiError{500, "server_error", ev.error, "", ""};
      break;
  }
}

void OpenAiServer::Impl::take_prompt_parts(const Generation& gen, GenerationChoice& ch,
                                           const SchedulerEvent& ev, std::string& delta) const {
  if (gen.api.prompt_logprobs >= 0 && ch.prompt_logprobs.is_null()) {
    ch.prompt_logprobs =
        prompt_logprobs_json(gen.prompt, ev.prompt_logprobs, gen.api.prompt_logprobs,
                             [&](TokenId prev, TokenId id) { return tokenizer.decode_token(prev, id); });
  }
  if (ch.echo_pending) {
    ch.echo_pending = false;
    delta += gen.echo_text;
    if (gen.want_logprobs) echo_logprobs(gen, ev.prompt_logprobs, ch.logprobs);
    ch.raw_code_points = code_points(gen.echo_text);
  }
}

void OpenAiServer::Impl::echo_logprobs(const Generation& gen, const std::vector<TokenLogprobs>& prompt_lp,
                                       std::vector<LogprobEntry>& out) const {
  const std::vector<TokenId>& prompt = gen.prompt;
  int64_t offset = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const TokenId before = i == 0 ? -1 : prompt[i - 1];
    LogprobEntry entry{tokenizer.decode_token(before, prompt[i]), 0.0f, {}, offset, i > 0};
    if (i > 0 && i - 1 < prompt_lp.size()) {
      const TokenLogprobs& lp = prompt_lp[i - 1];
      entry.logprob = lp.chosen.logprob;
      // The scheduler computed max(logprobs, prompt_logprobs) alternatives; echo shows `logprobs`.
      for (size_t k = 0; k < lp.top.size() && k < static_cast<size_t>(gen.api.logprobs); ++k) {
        entry.top.emplace_back(tokenizer.decode_token(before, lp.top[k].token), lp.top[k].logprob);
      }
    }
    offset += code_points(entry.token);
    out.push_back(std::move(entry));
  }
}

void OpenAiServer::Impl::take_token(Generation& gen, size_t choice, const SchedulerEvent& ev,
                                    std::string& delta) {
  GenerationChoice& ch = gen.choices[choice];
  ++ch.completion_tokens;
  if (ev.logprobs) ch.logprob_sum += ev.logprobs->chosen.logprob;
  std::string piece = tokenizer.decode_token(ch.prev, ev.token);
  if (gen.want_logprobs && ev.logprobs) {
    LogprobEntry entry{piece, ev.logprobs->chosen.logprob, {}, ch.raw_code_points};
    for (const TokenLogprob& alt : ev.logprobs->top) {
      entry.top.emplace_back(tokenizer.decode_token(ch.prev, alt.token), alt.logprob);
    }
    ch.logprobs.push_back(std::move(entry));
  }
  ch.raw_code_points += code_points(piece);
  delta += ch.matcher.feed(piece);
  ch.prev = ev.token;
  if (ch.matcher.stopped()) {
    cancel_choice(gen.job, choice);
    ch.finish_reason = "stop";
    ch.done = true;
    ++gen.choices_done;
  }
}

asio::awaitable<void> OpenAiServer::Impl::stream_delta(Generation& gen, size_t c, const std::string& delta,
                                                       EventStream& events) {
  GenerationChoice& ch = gen.choices[c];
  const auto index = static_cast<int32_t>(c);
  std::string content = delta;
  std::vector<ToolCallDelta> call_deltas;
  if (gen.api.tool_choice != ApiRequest::ToolChoice::kNone) {
    ch.text += delta;
    content = tool_stream_step(gen.api, ch.tools, ch.text, ch.done, ch.finish_reason, call_deltas);
  }
  // Entries whose text is out; at the end (no stop) the rest, whose text may be empty.
  std::vector<LogprobEntry> ready;
  while (ch.logprobs_sent < ch.logprobs.size() &&
         (ch.done || ch.logprobs[ch.logprobs_sent].text_offset < ch.sent_code_points)) {
    ready.push_back(std::move(ch.logprobs[ch.logprobs_sent++]));
  }
  if (!content.empty() || !ready.empty()) {
    const nlohmann::json* prompt_lp =
        ch.first_chunk && !ch.prompt_logprobs.is_null() ? &ch.prompt_logprobs : nullptr;
    std::string chunk = stream_chunk(gen.kind, gen.meta, content, std::exchange(ch.first_chunk, false),
                                     gen.want_logprobs ? &ready : nullptr, index, prompt_lp);
    co_await events.write(std::move(chunk));
  }
  if (!call_deltas.empty() && ch.first_chunk && !ch.prompt_logprobs.is_null()) {  // they go first
    std::string chunk = stream_chunk(gen.kind, gen.meta, "", std::exchange(ch.first_chunk, false), nullptr,
                                     index, &ch.prompt_logprobs);
    co_await events.write(std::move(chunk));
  }
  for (const ToolCallDelta& d : call_deltas) {
    std::string chunk = stream_tool_call_chunk(gen.meta, d, std::exchange(ch.first_chunk, false), index);
    co_await events.write(std::move(chunk));
  }
}

asio::awaitable<bool> OpenAiServer::Impl::answer_failure(Conn& conn, const Request& req,
                                                         const Generation& gen, EventStream& events) {
  const ApiError& failure = *gen.failure;
  if (failure.http_status == 500) {
    ++failed;
  } else {
    ++rejected;
  }
  if (!gen.api.stream || !events.head_sent()) co_return co_await reply_error(conn, req, failure);
  std::string error_event = stream_error_chunk(failure);
  co_await events.write(std::move(error_event));
  std::string done_event(kStreamDone);
  co_await events.write(std::move(done_event));
  co_return co_await events.end();
}

Usage OpenAiServer::Impl::usage_of(const Generation& gen) const {
  int64_t completion_tokens = 0;
  for (const GenerationChoice& ch : gen.choices) completion_tokens += ch.completion_tokens;
  Usage usage{gen.prompt_len, completion_tokens, std::nullopt};
  if (options.scheduling.prefix_caching) usage.cached_tokens = std::min(gen.cached_tokens, gen.prompt_len);
  return usage;
}

std::string OpenAiServer::Impl::completion_body(const Generation& gen, const Usage& usage) const {
  const std::vector<size_t> order = best_choices(gen);
  std::vector<ChoiceOut> out;
  std::vector<std::vector<ToolCallOut>> calls(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const GenerationChoice& ch = gen.choices[order[i]];
    out.push_back({ch.text, ch.finish_reason, gen.want_logprobs ? &ch.logprobs : nullptr,
                   ch.prompt_logprobs.is_null() ? nullptr : &ch.prompt_logprobs});
    if (gen.api.tool_choice != ApiRequest::ToolChoice::kNone) {
      calls[i] = tool_calls_of(gen.api, ch.text, out.back().text, out.back().finish_reason);
      if (!calls[i].empty()) out.back().tool_calls = &calls[i];
    }
  }
  return dump_json(completion_response(gen.kind, gen.meta, out, usage));
}

asio::awaitable<void> OpenAiServer::Impl::stream_ending(Generation& gen, EventStream& events,
                                                        const Usage& usage) {
  for (size_t c = 0; c < gen.choices.size(); ++c) {
    const GenerationChoice& ch = gen.choices[c];
    const auto index = static_cast<int32_t>(c);
    if (ch.first_chunk) {
      const nlohmann::json* prompt_lp = ch.prompt_logprobs.is_null() ? nullptr : &ch.prompt_logprobs;
      std::string role =
          stream_chunk(gen.kind, gen.meta, "", true, nullptr, index, prompt_lp);  // the role, for chat
      co_await events.write(std::move(role));
    }
    std::string finish = stream_finish_chunk(gen.kind, gen.meta, ch.finish_reason, index);
    co_await events.write(std::move(finish));
  }
  if (gen.api.include_usage) {
    std::string usage_chunk = stream_usage_chunk(gen.kind, gen.meta, usage);
    co_await events.write(std::move(usage_chunk));
  }
  std::string done_event(kStreamDone);
  co_await events.write(std::move(done_event));
}

std::string OpenAiServer::Impl::metrics_text() const { return render_prometheus(snapshot()); }

// ---------------------------------------------------------------- OpenAiServer

OpenAiServer::OpenAiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<OpenAiServer>> OpenAiServer::start(Engine& engine, const Tokenizer& tokenizer,
                                                          const ServerOptions& options) {
  for (const std::string& key : options.api_keys) {
    if (key.empty()) return invalid_argument("serve: an API key must not be empty");
  }
  if (options.request_workers == 0) return invalid_argument("serve: request_workers must be at least 1");
  auto impl = std::make_unique<Impl>(engine, tokenizer, options);
  if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    auto tls = tls::make_server_context(options.tls_cert_file, options.tls_key_file);
    if (!tls.is_ok()) return tls.status().with_context("serve");
    impl->tls = std::move(*tls);
  }
  impl->max_prompt_bytes = options.max_prompt_bytes > 0
                               ? options.max_prompt_bytes
                               : static_cast<size_t>(std::max<int64_t>(engine.max_context(), 1)) * 32;
  impl->scheduler_owned = std::make_unique<Scheduler>(engine, options.scheduling);
  if (Status st = impl->scheduler_owned->open_prefix_disk(); !st.is_ok()) return st.with_context("serve");
  if (Status st = tls::listen_on(impl->acceptor, options.host, options.port, "serve"); !st.is_ok()) return st;
  impl->port = impl->acceptor.local_endpoint().port();
  Impl* p = impl.get();
  p->workers = std::make_unique<asio::thread_pool>(options.request_workers);
  asio::co_spawn(p->ioc, p->accept_loop(), asio::detached);
  p->engine_thread = std::thread([p] { p->engine_loop(); });
  p->io_thread = std::thread([p] { tls::run_until_stopped(p->ioc, "serve"); });
  return std::unique_ptr<OpenAiServer>(new OpenAiServer(std::move(impl)));
}

OpenAiServer::~OpenAiServer() { stop(); }

uint16_t OpenAiServer::port() const { return impl_->port; }

void OpenAiServer::stop(std::chrono::milliseconds drain) {
  Impl& s = *impl_;
  std::call_once(s.stopped, [&] {
    s.draining = true;
    asio::post(s.ioc, [&s] {
      beast::error_code ec;
      s.acceptor.close(ec);
    });
    const auto deadline = std::chrono::steady_clock::now() + drain;
    while (s.jobs_in_flight > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    {
      std::lock_guard lk(s.mu);
      s.stop_engine = true;
    }
    s.cv.notify_one();
    if (s.engine_thread.joinable()) s.engine_thread.join();
    // Let the sessions write the "shutting down" answers the engine thread just delivered.
    const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (s.jobs_in_flight > 0 && std::chrono::steady_clock::now() < flush_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    s.ioc.stop();
    if (s.io_thread.joinable()) s.io_thread.join();
    // The close posted above may not have run before ioc.stop(): close here, the I/O thread gone,
    // so a new connection is refused now, not accepted into a backlog nobody serves.
    beast::error_code ec;
    s.acceptor.close(ec);
    if (s.workers) {  // a job still queued is dropped; one running finishes
      s.workers->stop();
      s.workers->join();
    }
  });
}

ServerCounters OpenAiServer::Impl::snapshot() const {
  ServerCounters c;
  {
    std::lock_guard lk(published_mu);
    c = published;
  }
  // The counters written where the event happens.
  static constexpr std::pair<int64_t ServerCounters::*, const std::atomic<int64_t> Impl::*> kCounted[] = {
      {&ServerCounters::accepted, &Impl::accepted},
      {&ServerCounters::completed, &Impl::completed},
      {&ServerCounters::rejected, &Impl::rejected},
      {&ServerCounters::cancelled, &Impl::cancelled},
      {&ServerCounters::failed, &Impl::failed},
      {&ServerCounters::unauthorized, &Impl::unauthorized},
      {&ServerCounters::open_connections, &Impl::open_connections},
      {&ServerCounters::connections_refused, &Impl::connections_refused},
      {&ServerCounters::connections_refused_per_ip, &Impl::connections_refused_per_ip},
      {&ServerCounters::header_timeouts, &Impl::header_timeouts},
      {&ServerCounters::tls_handshake_failures, &Impl::tls_handshake_failures},
      {&ServerCounters::prepare_running, &Impl::prepare_running},
      {&ServerCounters::prepare_refused, &Impl::prepare_refused},
  };
  for (const auto& [field, counted] : kCounted) c.*field = (this->*counted).load();
  c.prepare_queued = prepare_pending - prepare_running;
  return c;
}

ServerCounters OpenAiServer::counters() const { return impl_->snapshot(); }

}  // namespace specontext::cluster
