#include "serving/router/router.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <charconv>
#include <cstdio>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "core/base/json_depth.h"
#include "core/tls/server_stream.h"
#include "core/tls/tls_context.h"
#include "serving/openai/http_request.h"
#include "serving/openai/openai_api.h"

#if !defined(BOOST_ASIO_HAS_CO_AWAIT)
#error "serving/router/router.cc needs Boost.Asio with C++20 coroutines"
#endif

namespace specontext::router {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using cluster::ApiError;

namespace {

constexpr auto kAwait = asio::use_awaitable;

// A connection's byte stream, TCP or TLS over TCP (core/tls/server_stream.h).
using ClientStream = tls::ServerStream;

using Request = http::request<http::string_body>;
using UpstreamParser = http::response_parser<http::buffer_body>;

// Hop-by-hop headers (RFC 9110 7.6.1) and those the router sets itself: never copied across.
bool hop_by_hop(http::field f) {
  switch (f) {
    case http::field::connection:
    case http::field::keep_alive:
    case http::field::proxy_authenticate:
    case http::field::proxy_authorization:
    case http::field::te:
    case http::field::trailer:
    case http::field::transfer_encoding:
    case http::field::upgrade:
    case http::field::content_length:
    case http::field::host:
    case http::field::expect:
      return true;
    default:
      return false;
  }
}

template <typename From, typename To>
void copy_end_to_end_headers(const From& from, To& to) {
  for (const auto& h : from) {
    if (h.name() == http::field::unknown) {
      const beast::string_view n = h.name_string();
      if (beast::iequals(n, "proxy-connection")) continue;
      to.insert(n, h.value());
    } else if (!hop_by_hop(h.name())) {
      to.insert(h.name(), h.value());
    }
  }
}

bool end_of_connection(const beast::error_code& e) {
  return e == http::error::end_of_stream || e == asio::error::eof || e == beast::error::timeout ||
         e == asio::error::connection_reset || e == asio::error::operation_aborted ||
         e == asio::ssl::error::stream_truncated;
}

// The text the prefix policy hashes: completions' prompt (a string; strings joined; token ids as
// their JSON), chat's messages (role and content of each, content parts' text). At most
// `max_bytes` of it. nullopt: the body is not such JSON (least-load decides).
std::optional<std::string> prompt_text(std::string_view body, bool chat, size_t max_bytes) {
  const nlohmann::json j = parse_json_bounded(body);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  std::string text;
  auto add = [&](std::string_view s) {
    if (text.size() < max_bytes) text.append(s.substr(0, max_bytes - text.size()));
  };
  if (!chat) {
    const auto it = j.find("prompt");
    if (it == j.end()) return std::nullopt;
    if (it->is_string()) {
      add(it->get_ref<const std::string&>());
    } else if (it->is_array() && !it->empty() && (*it)[0].is_string()) {
      for (const auto& p : *it) {
        if (p.is_string()) add(p.get_ref<const std::string&>());
        add("\x1e");
      }
    } else if (it->is_array()) {
      add(it->dump());
    } else {
      return std::nullopt;
    }
    return text;
  }
  const auto it = j.find("messages");
  if (it == j.end() || !it->is_array()) return std::nullopt;
  for (const auto& m : *it) {
    if (!m.is_object()) return std::nullopt;
    if (const auto r = m.find("role"); r != m.end() && r->is_string()) add(r->get_ref<const std::string&>());
    add("\x1f");
    if (const auto c = m.find("content"); c != m.end()) {
      if (c->is_string()) {
        add(c->get_ref<const std::string&>());
      } else if (c->is_array()) {
        for (const auto& part : *c) {
          if (part.is_object()) {
            if (const auto t = part.find("text"); t != part.end() && t->is_string())
              add(t->get_ref<const std::string&>());
          }
        }
      }
    }
    add("\x1e");
    if (text.size() >= max_bytes) break;
  }
  return text;
}

}  // namespace

Result<ReplicaUrl> parse_replica_url(std::string_view url) {
  std::string_view rest = url;
  if (rest.starts_with("https://"))
    return Status(StatusCode::kUnimplemented,
                  "replica '" + std::string(url) + "': https:// replicas are not supported (use http://)");
  if (rest.starts_with("http://")) rest.remove_prefix(7);
  if (rest.ends_with("/")) rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  auto bad = [&](const std::string& why) {
    return invalid_argument("replica '" + std::string(url) + "': " + why + " (expected http://HOST:PORT)");
  };
  if (colon == std::string_view::npos || colon == 0) return bad("no HOST:PORT");
  std::string_view host = rest.substr(0, colon);
  const std::string_view port_text = rest.substr(colon + 1);
  if (host.starts_with("[") && host.ends_with("]")) host = host.substr(1, host.size() - 2);
  if (host.empty() || host.find_first_of("/?#@ ") != std::string_view::npos) return bad("bad host");
  unsigned port = 0;
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 || port > 65535)
    return bad("bad port");
  return ReplicaUrl{std::string(host), static_cast<uint16_t>(port)};
}

struct Router::Impl {
  explicit Impl(RouterOptions o)
      : options(std::move(o)), policy(options.policy, options.replicas.size()), acceptor(ioc) {}

  RouterOptions options;
  std::vector<tcp::endpoint> endpoints;  // per replica
  // Under mu: the policy, the counters and which replicas are up.
  mutable std::mutex mu;
  RoutingPolicy policy;
  RouterCounters counters;
  std::vector<ReplicaCounters> replica_counters;
  std::vector<bool> up;
  // Declared before ioc: sessions destroyed with ioc still count themselves out.
  std::atomic<int64_t> open_connections{0};

  asio::io_context ioc;
  tcp::acceptor acceptor;
  std::unique_ptr<asio::ssl::context> tls;
  std::unique_ptr<asio::thread_pool> workers;
  std::unique_ptr<asio::steady_timer> health_timer;
  std::thread io_thread;
  std::once_flag stopped;
  uint16_t port = 0;

  asio::awaitable<void> accept_loop();
  asio::awaitable<void> refuse(tcp::socket socket);
  asio::awaitable<void> session(tcp::socket socket);
  asio::awaitable<bool> handle(ClientStream& conn, Request& req);
  asio::awaitable<bool> reply(ClientStream& conn, unsigned version, bool keep_alive, http::status status,
                              std::string body, std::string_view content_type = "application/json");
  asio::awaitable<bool> reply_error(ClientStream& conn, unsigned version, bool keep_alive, const ApiError& e);
  asio::awaitable<bool> proxy(ClientStream& conn, Request& req, cluster::Route route);
  // After an answer to a request whose body was not read whole: no more to send, and what the
  // client still sends read and dropped (a second at most), so that closing with its bytes unread
  // does not reset the connection before the client reads the answer.
  asio::awaitable<void> drain_and_close(ClientStream& conn);

  // How one try on one replica ended.
  enum class TryEnd {
    kAnswered,     // the answer went out (keep: whether the client connection may go on)
    kRetry,        // nothing reached the client: the replica failed (marked down)
    kBusy,         // nothing reached the client: the replica answered 503 and another one is up
    kBrokenOff,    // bytes went out, then the replica failed (the client was told)
    kClientGone,   // the client went away
  };
  struct TryResult {
    TryEnd end = TryEnd::kRetry;
    bool keep = false;
    std::string why;  // kRetry / kBrokenOff
    bool settled = false;  // counted and out of the in-flight count (settle)
  };
  // Counts how a try on replica r ended and takes it out of the in-flight count, once. Called
  // before the last bytes go to the client, so that a client that has its answer sees it counted.
  void settle(size_t r, TryResult& res);
  asio::awaitable<TryResult> try_replica(ClientStream& conn, const Request& req, size_t replica,
                                         const std::vector<bool>& tried);
  asio::awaitable<bool> probe_replica(size_t replica);
  asio::awaitable<void> health_round();
  asio::awaitable<void> health_loop();

  void mark_down(size_t replica, const std::string& why);  // under mu
  void mark_up(size_t replica);                            // under mu
  std::string metrics_text() const;
  std::string health_body(bool& ok) const;

  template <typename F>
  asio::awaitable<std::invoke_result_t<F&>> on_worker(F work) {
    using R = std::invoke_result_t<F&>;
    auto run = [work = std::move(work)]() mutable -> asio::awaitable<R> { co_return work(); };
    co_return co_await asio::co_spawn(*workers, std::move(run), kAwait);
  }
};

void Router::Impl::mark_down(size_t r, const std::string& why) {
  if (!up[r]) return;
  up[r] = false;
  ++replica_counters[r].marked_down;
  policy.forget(r);  // a replica that comes back may have lost its cache
  std::fprintf(stderr, "router: replica %s marked down: %s\n", options.replicas[r].name().c_str(), why.c_str());
}

void Router::Impl::mark_up(size_t r) {
  if (up[r]) return;
  up[r] = true;
  std::fprintf(stderr, "router: replica %s is up again\n", options.replicas[r].name().c_str());
}

std::string Router::Impl::metrics_text() const {
  std::lock_guard lk(mu);
  RouterCounters c = counters;
  c.open_connections = open_connections.load();
  c.replicas_up = static_cast<int64_t>(std::count(up.begin(), up.end(), true));
  std::vector<ReplicaSnapshot> rs;
  for (size_t i = 0; i < replica_counters.size(); ++i) {
    ReplicaSnapshot s{options.replicas[i].name(), replica_counters[i]};
    s.counters.in_flight = policy.in_flight(i);
    s.counters.up = up[i] ? 1 : 0;
    rs.push_back(std::move(s));
  }
  return render_router_prometheus(c, rs);
}

std::string Router::Impl::health_body(bool& ok) const {
  std::lock_guard lk(mu);
  const auto n_up = std::count(up.begin(), up.end(), true);
  ok = n_up > 0;
  nlohmann::json j{{"status", ok ? "ok" : "unavailable"},
                   {"replicas", up.size()},
                   {"replicas_up", n_up},
                   {"policy", policy_name(options.policy.policy)}};
  return j.dump();
}

// ------------------------------------------------------------------ client side

asio::awaitable<void> Router::Impl::accept_loop() {
  for (;;) {
    beast::error_code ec;
    tcp::socket socket = co_await acceptor.async_accept(asio::redirect_error(kAwait, ec));
    if (ec) {
      if (!acceptor.is_open()) co_return;
      continue;
    }
    if (options.max_connections > 0 && open_connections.load() >= static_cast<int64_t>(options.max_connections)) {
      {
        std::lock_guard lk(mu);
        ++counters.connections_refused;
      }
      asio::co_spawn(ioc, refuse(std::move(socket)), asio::detached);
      continue;
    }
    ++open_connections;
    asio::co_spawn(ioc, session(std::move(socket)), [](std::exception_ptr e) {
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "router: connection ended by an exception: %s\n", ex.what());
      }
    });
  }
}

asio::awaitable<void> Router::Impl::refuse(tcp::socket socket) {
  ClientStream conn(std::move(socket), tls.get());
  conn.expires_after(std::chrono::seconds(1));  // a refused client holds a socket for a second at most
  if (conn.is_tls() && co_await conn.handshake()) co_return;
  const ApiError e{503, "server_error",
                   "router at its connection limit (" + std::to_string(options.max_connections) +
                       " connections are open); retry later",
                   "", ""};
  if (!co_await reply_error(conn, 11, false, e)) co_return;
  co_await conn.shutdown_send();
}

asio::awaitable<void> Router::Impl::session(tcp::socket socket) {
  struct Open {
    std::atomic<int64_t>& n;
    ~Open() { --n; }
  } open{open_connections};
  ClientStream conn(std::move(socket), tls.get());
  if (conn.is_tls()) {
    conn.expires_after(options.header_timeout);
    if (co_await conn.handshake()) {
      std::lock_guard lk(mu);
      ++counters.tls_handshake_failures;
      co_return;
    }
  }
  beast::flat_buffer buffer;
  for (bool first = true;; first = false) {
    cluster::HttpRequestParser parser;
    cluster::configure_request_parser(parser, options.max_body_bytes);
    beast::error_code ec;
    if (!first && buffer.size() == 0) {
      conn.expires_after(options.idle_timeout);
      const size_t n = co_await conn.async_read_some(buffer.prepare(4096), asio::redirect_error(kAwait, ec));
      buffer.commit(n);
      if (ec) break;
    }
    conn.expires_after(options.header_timeout);
    co_await http::async_read_header(conn, buffer, parser, asio::redirect_error(kAwait, ec));
    if (ec == beast::error::timeout) {
      std::lock_guard lk(mu);
      ++counters.header_timeouts;
      co_return;
    }
    if (end_of_connection(ec)) break;
    const bool key_ok = ec || cluster::authorized(parser.get(), options.api_keys);
    if (cluster::refuse_unread(parser, key_ok)) {
      {
        std::lock_guard lk(mu);
        ++counters.rejected;
      }
      const ApiError e{401, "invalid_request_error", "no valid API key: send 'Authorization: Bearer <key>'", "",
                       "invalid_api_key"};
      co_await reply_error(conn, parser.get().version(), false, e);
      co_await drain_and_close(conn);
      co_return;
    }
    if (!ec && cluster::expects_continue(parser.get()) && !parser.is_done()) {
      http::response<http::empty_body> go_on{http::status::continue_, parser.get().version()};
      co_await http::async_write(conn, go_on, asio::redirect_error(kAwait, ec));
      if (ec) break;
    }
    if (!ec && !parser.is_done()) {
      conn.expires_after(options.idle_timeout);
      co_await http::async_read(conn, buffer, parser, asio::redirect_error(kAwait, ec));
      if (end_of_connection(ec)) break;
    }
    conn.expires_never();
    if (ec) {
      {
        std::lock_guard lk(mu);
        ++counters.rejected;
      }
      const ApiError e = cluster::unreadable_request_error(ec, options.max_body_bytes);
      co_await reply_error(conn, 11, false, e);
      co_await drain_and_close(conn);
      co_return;
    }
    Request req = parser.release();
    {
      std::lock_guard lk(mu);
      ++counters.requests;
    }
    bool keep = false;
    if (!key_ok) {
      {
        std::lock_guard lk(mu);
        ++counters.rejected;
      }
      const ApiError e{401, "invalid_request_error", "no valid API key: send 'Authorization: Bearer <key>'", "",
                       "invalid_api_key"};
      keep = co_await reply_error(conn, req.version(), req.keep_alive(), e);
    } else {
      keep = co_await handle(conn, req);
    }
    if (!keep || !req.keep_alive()) break;
  }
  co_await conn.shutdown_send();
}

asio::awaitable<void> Router::Impl::drain_and_close(ClientStream& conn) {
  conn.expires_after(std::chrono::seconds(1));
  co_await conn.shutdown_send();
  beast::error_code ec;
  std::array<char, 4096> sink{};
  while (!ec) co_await conn.tcp_layer().async_read_some(asio::buffer(sink), asio::redirect_error(kAwait, ec));
}

asio::awaitable<bool> Router::Impl::reply(ClientStream& conn, unsigned version, bool keep_alive,
                                          http::status status, std::string body, std::string_view content_type) {
  http::response<http::string_body> res{status, version};
  res.set(http::field::server, "specontext-router");
  res.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
  if (status == http::status::service_unavailable) res.set(http::field::retry_after, "1");
  if (status == http::status::unauthorized) res.set(http::field::www_authenticate, "Bearer");
  res.keep_alive(keep_alive);
  res.body() = std::move(body);
  res.prepare_payload();
  beast::error_code ec;
  conn.expires_after(options.idle_timeout);  // a client that reads nothing does not hold the router
  co_await http::async_write(conn, res, asio::redirect_error(kAwait, ec));
  conn.expires_never();
  co_return !ec && keep_alive;
}

asio::awaitable<bool> Router::Impl::reply_error(ClientStream& conn, unsigned version, bool keep_alive,
                                                const ApiError& e) {
  std::string body = cluster::error_body(e);
  co_return co_await reply(conn, version, keep_alive, static_cast<http::status>(e.http_status), std::move(body));
}

asio::awaitable<bool> Router::Impl::handle(ClientStream& conn, Request& req) {
  const std::string_view path = cluster::path_of(req);
  const cluster::Routing routing =
      cluster::route_of(req.method(), std::string_view(req.method_string().data(), req.method_string().size()), path);
  if (!routing.route) {
    {
      std::lock_guard lk(mu);
      ++counters.rejected;
    }
    co_return co_await reply_error(conn, req.version(), req.keep_alive(), routing.error);
  }
  if (*routing.route == cluster::Route::kHealth) {
    bool ok = false;
    std::string body = health_body(ok);
    co_return co_await reply(conn, req.version(), req.keep_alive(),
                             ok ? http::status::ok : http::status::service_unavailable, std::move(body));
  }
  if (*routing.route == cluster::Route::kMetrics) {
    co_return co_await reply(conn, req.version(), req.keep_alive(), http::status::ok, metrics_text(),
                             "text/plain; version=0.0.4");
  }
  co_return co_await proxy(conn, req, *routing.route);
}

asio::awaitable<bool> Router::Impl::proxy(ClientStream& conn, Request& req, cluster::Route route) {
  const size_t n = options.replicas.size();
  std::vector<uint64_t> chunks;
  const bool by_prefix = options.policy.policy == Policy::kPrefix &&
                         (route == cluster::Route::kCompletions || route == cluster::Route::kChatCompletions);
  if (by_prefix) {
    const bool chat = route == cluster::Route::kChatCompletions;
    const PolicyOptions po = options.policy;
    std::optional<std::vector<uint64_t>> hashed = co_await on_worker([&req, chat, po] {
      std::optional<std::string> text = prompt_text(req.body(), chat, po.max_prefix_bytes);
      if (!text) return std::optional<std::vector<uint64_t>>();
      return std::optional<std::vector<uint64_t>>(prefix_chunk_hashes(*text, po.chunk_bytes, po.max_prefix_bytes));
    });
    std::lock_guard lk(mu);
    if (hashed) {
      chunks = std::move(*hashed);
    } else {
      ++counters.body_parse_errors;
    }
  }
  std::vector<bool> tried(n, false);
  std::string last_failure;
  for (size_t attempt = 0;; ++attempt) {
    std::optional<Choice> choice;
    {
      std::lock_guard lk(mu);
      std::vector<bool> usable(n);
      for (size_t i = 0; i < n; ++i) usable[i] = up[i] && !tried[i];
      choice = policy.choose(usable, chunks);
      if (choice) {
        if (attempt > 0) ++counters.retries;
        if (by_prefix && !chunks.empty() && attempt == 0) {
          ++counters.prefix_lookups;
          counters.prefix_prompt_chunks += static_cast<int64_t>(chunks.size());
          counters.prefix_matched_chunks += static_cast<int64_t>(choice->matched_chunks);
          if (choice->reason == ChoiceReason::kPrefixHit) {
            ++counters.prefix_hits;
            ++replica_counters[choice->replica].prefix_hits;
          }
          if (choice->reason == ChoiceReason::kPrefixOverloaded) ++counters.prefix_overloaded;
        }
        ++replica_counters[choice->replica].chosen;
        policy.started(choice->replica);
      }
    }
    if (!choice) break;
    const size_t r = choice->replica;
    tried[r] = true;
    TryResult result = co_await try_replica(conn, req, r, tried);
    settle(r, result);
    if (result.end == TryEnd::kRetry) last_failure = options.replicas[r].name() + ": " + result.why;
    if (result.end == TryEnd::kBusy) last_failure = options.replicas[r].name() + ": busy (503)";
    if (result.end == TryEnd::kRetry || result.end == TryEnd::kBusy) continue;
    co_return result.end == TryEnd::kAnswered && result.keep;
  }
  int64_t down = 0;
  {
    std::lock_guard lk(mu);
    ++counters.unavailable;
    down = static_cast<int64_t>(std::count(up.begin(), up.end(), false));
  }
  const ApiError e{503, "server_error",
                   "no replica could take the request (" + std::to_string(down) + " of " + std::to_string(n) +
                       " replicas down" + (last_failure.empty() ? "" : "; last failure " + last_failure) + ")",
                   "", ""};
  co_return co_await reply_error(conn, req.version(), req.keep_alive(), e);
}

void Router::Impl::settle(size_t r, TryResult& res) {
  if (res.settled) return;
  res.settled = true;
  std::lock_guard lk(mu);
  policy.finished(r);
  switch (res.end) {
    case TryEnd::kAnswered:
      ++replica_counters[r].answered;
      ++counters.proxied;
      break;
    case TryEnd::kRetry:
      ++replica_counters[r].failures;
      mark_down(r, res.why);
      break;
    case TryEnd::kBusy:
      ++replica_counters[r].answered;
      break;
    case TryEnd::kBrokenOff:
      ++replica_counters[r].failures;
      ++counters.failed_mid_answer;
      mark_down(r, res.why);
      break;
    case TryEnd::kClientGone:
      ++replica_counters[r].answered;
      ++counters.client_gone;
      break;
  }
}

asio::awaitable<Router::Impl::TryResult> Router::Impl::try_replica(ClientStream& conn, const Request& req,
                                                                   size_t r, const std::vector<bool>& tried) {
  TryResult res;
  beast::tcp_stream upstream(ioc);
  beast::error_code ec;
  upstream.expires_after(options.connect_timeout);
  co_await upstream.async_connect(endpoints[r], asio::redirect_error(kAwait, ec));
  if (ec) {
    res.why = "connect: " + ec.message();
    co_return res;
  }
  {
    http::request<http::string_body> out{req.method(), req.target(), 11};
    copy_end_to_end_headers(req, out);
    out.set(http::field::host, options.replicas[r].name());
    out.keep_alive(false);
    out.body() = req.body();
    out.prepare_payload();
    upstream.expires_after(options.upstream_timeout);
    co_await http::async_write(upstream, out, asio::redirect_error(kAwait, ec));
    if (ec) {
      res.why = "send: " + ec.message();
      co_return res;
    }
  }
  beast::flat_buffer ubuf;
  UpstreamParser parser;
  parser.header_limit(cluster::kRequestHeaderLimit);
  // Streamed answers have no end known in advance; one read whole is bounded below. (Not
  // boost::none: Boost 1.74 compares a Content-Length with an empty limit as exceeding it.)
  parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  upstream.expires_after(options.upstream_timeout);
  co_await http::async_read_header(upstream, ubuf, parser, asio::redirect_error(kAwait, ec));
  if (ec) {
    res.why = "answer header: " + ec.message();
    co_return res;
  }
  const auto& head = parser.get();
  if (head.result() == http::status::service_unavailable) {
    std::lock_guard lk(mu);
    for (size_t i = 0; i < up.size(); ++i) {
      if (up[i] && !tried[i]) {
        res.end = TryEnd::kBusy;
        co_return res;
      }
    }
  }
  const bool event_stream = beast::iequals(head[http::field::content_type], "text/event-stream");
  const bool streamed = event_stream || parser.chunked();
  std::array<char, 16 * 1024> piece{};
  // Reads the next piece of the body into `piece`: its size, or an error (done: the body ended).
  auto read_piece = [&](beast::error_code& e) -> asio::awaitable<size_t> {
    parser.get().body().data = piece.data();
    parser.get().body().size = piece.size();
    upstream.expires_after(options.upstream_timeout);
    co_await http::async_read_some(upstream, ubuf, parser, asio::redirect_error(kAwait, e));
    if (e == http::error::need_buffer) e = {};
    co_return piece.size() - parser.get().body().size;
  };

  if (!streamed) {
    // Read whole (bounded), so that a replica failing before its end is retried elsewhere.
    std::string body;
    while (!parser.is_done()) {
      const size_t got = co_await read_piece(ec);
      body.append(piece.data(), got);
      if (body.size() > options.max_response_bytes) {
        const ApiError e{502, "server_error",
                         "replica " + options.replicas[r].name() + " answered more than " +
                             std::to_string(options.max_response_bytes) + " bytes",
                         "", ""};
        res.end = TryEnd::kAnswered;
        settle(r, res);
        res.keep = co_await reply_error(conn, req.version(), req.keep_alive(), e);
        co_return res;
      }
      if (ec) {
        res.why = "answer body: " + ec.message();
        co_return res;
      }
    }
    http::response<http::string_body> out{parser.get().result(), req.version()};
    copy_end_to_end_headers(parser.get(), out);
    out.keep_alive(req.keep_alive());
    out.body() = std::move(body);
    out.prepare_payload();
    res.end = TryEnd::kAnswered;
    settle(r, res);
    conn.expires_after(options.idle_timeout);
    co_await http::async_write(conn, out, asio::redirect_error(kAwait, ec));
    conn.expires_never();
    res.keep = !ec && req.keep_alive();
    co_return res;
  }

  // Streamed: the header now, then each piece as it arrives (chunked to HTTP/1.1 clients).
  const bool chunked = req.version() >= 11;
  http::response<http::empty_body> out_head{parser.get().result(), req.version()};
  copy_end_to_end_headers(parser.get(), out_head);
  out_head.keep_alive(chunked && req.keep_alive());
  if (chunked) out_head.chunked(true);
  http::response_serializer<http::empty_body> serializer(out_head);
  conn.expires_after(options.idle_timeout);
  co_await http::async_write_header(conn, serializer, asio::redirect_error(kAwait, ec));
  if (ec) {
    res.end = TryEnd::kClientGone;
    co_return res;
  }
  auto send = [&](asio::const_buffer data) -> asio::awaitable<bool> {
    beast::error_code we;
    conn.expires_after(options.idle_timeout);
    if (chunked) {
      co_await asio::async_write(conn, http::make_chunk(data), asio::redirect_error(kAwait, we));
    } else {
      co_await asio::async_write(conn, data, asio::redirect_error(kAwait, we));
    }
    co_return !we;
  };
  while (!parser.is_done()) {
    beast::error_code re;
    const size_t got = co_await read_piece(re);
    if (got > 0 && !co_await send(asio::buffer(piece.data(), got))) {
      res.end = TryEnd::kClientGone;  // the upstream socket closes here: the replica cancels
      co_return res;
    }
    if (re) {
      res.end = TryEnd::kBrokenOff;
      res.why = "answer broken off: " + re.message();
      settle(r, res);
      const ApiError e{502, "server_error",
                       "replica " + options.replicas[r].name() + " failed mid-answer (" + re.message() + ")", "",
                       ""};
      if (event_stream) co_await send(asio::buffer(cluster::stream_error_chunk(e)));
      if (chunked) {
        beast::error_code we;
        co_await asio::async_write(conn, http::make_chunk_last(), asio::redirect_error(kAwait, we));
      }
      conn.expires_never();
      co_return res;  // keep = false: the connection closes
    }
  }
  res.end = TryEnd::kAnswered;
  settle(r, res);
  if (chunked) {
    co_await asio::async_write(conn, http::make_chunk_last(), asio::redirect_error(kAwait, ec));
  }
  conn.expires_never();
  res.keep = chunked && !ec && req.keep_alive();
  co_return res;
}

// ------------------------------------------------------------------ health checks

asio::awaitable<bool> Router::Impl::probe_replica(size_t r) {
  beast::tcp_stream s(ioc);
  beast::error_code ec;
  s.expires_after(options.health_timeout);
  co_await s.async_connect(endpoints[r], asio::redirect_error(kAwait, ec));
  if (ec) co_return false;
  http::request<http::empty_body> req{http::verb::get, "/health", 11};
  req.set(http::field::host, options.replicas[r].name());
  req.keep_alive(false);
  co_await http::async_write(s, req, asio::redirect_error(kAwait, ec));
  if (ec) co_return false;
  beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  parser.header_limit(16 * 1024);
  parser.body_limit(16 * 1024);
  co_await http::async_read(s, buf, parser, asio::redirect_error(kAwait, ec));
  co_return !ec && parser.get().result() == http::status::ok;
}

asio::awaitable<void> Router::Impl::health_round() {
  const size_t n = options.replicas.size();
  // Every probe at once; the round ends when all have.
  auto remaining = std::make_shared<size_t>(n);
  auto done = std::make_shared<asio::steady_timer>(ioc, std::chrono::steady_clock::time_point::max());
  for (size_t r = 0; r < n; ++r) {
    asio::co_spawn(
        ioc,
        [this, r, remaining, done]() -> asio::awaitable<void> {
          const bool ok = co_await probe_replica(r);
          {
            std::lock_guard lk(mu);
            ++counters.health_checks;
            if (ok) {
              mark_up(r);
            } else {
              if (up[r]) ++replica_counters[r].failures;
              mark_down(r, "health check failed");
            }
          }
          if (--*remaining == 0) done->cancel();
        },
        asio::detached);
  }
  beast::error_code ec;
  if (*remaining > 0) co_await done->async_wait(asio::redirect_error(kAwait, ec));
}

asio::awaitable<void> Router::Impl::health_loop() {
  for (;;) {
    beast::error_code ec;
    health_timer->expires_after(options.health_interval);
    co_await health_timer->async_wait(asio::redirect_error(kAwait, ec));
    if (ec) co_return;  // stopped
    co_await health_round();
  }
}

// ------------------------------------------------------------------ Router

Result<std::unique_ptr<Router>> Router::start(const RouterOptions& options) {
  if (options.replicas.empty()) return invalid_argument("router: at least one --replica is needed");
  if (options.parse_workers == 0) return invalid_argument("router: parse_workers must be at least 1");
  if (options.policy.chunk_bytes == 0) return invalid_argument("router: the prefix chunk size must be positive");
  for (const std::string& key : options.api_keys) {
    if (key.empty()) return invalid_argument("router: an API key must not be empty");
  }
  auto impl = std::make_unique<Impl>(options);
  if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
    auto t = tls::make_server_context(options.tls_cert_file, options.tls_key_file);
    if (!t.is_ok()) return t.status().with_context("router");
    impl->tls = std::move(*t);
  }
  tcp::resolver resolver(impl->ioc);
  for (const ReplicaUrl& u : options.replicas) {
    beast::error_code ec;
    const auto results = resolver.resolve(u.host, std::to_string(u.port), ec);
    if (ec || results.empty())
      return invalid_argument("router: replica " + u.name() + ": cannot resolve '" + u.host + "': " + ec.message());
    impl->endpoints.push_back(results.begin()->endpoint());
  }
  impl->replica_counters.resize(options.replicas.size());
  impl->up.assign(options.replicas.size(), true);
  if (Status st = tls::listen_on(impl->acceptor, options.host, options.port, "router"); !st.is_ok()) return st;
  impl->port = impl->acceptor.local_endpoint().port();
  Impl* p = impl.get();
  p->workers = std::make_unique<asio::thread_pool>(options.parse_workers);
  p->health_timer = std::make_unique<asio::steady_timer>(p->ioc);
  asio::co_spawn(p->ioc, p->accept_loop(), asio::detached);
  if (options.health_interval.count() > 0) asio::co_spawn(p->ioc, p->health_loop(), asio::detached);
  p->io_thread = std::thread([p] { tls::run_until_stopped(p->ioc, "router"); });
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Router::~Router() { stop(); }

uint16_t Router::port() const { return impl_->port; }

void Router::stop() {
  Impl& s = *impl_;
  std::call_once(s.stopped, [&] {
    s.ioc.stop();
    if (s.io_thread.joinable()) s.io_thread.join();
    beast::error_code ec;
    s.acceptor.close(ec);
    if (s.workers) {
      s.workers->stop();
      s.workers->join();
    }
  });
}

RouterCounters Router::counters() const {
  std::lock_guard lk(impl_->mu);
  RouterCounters c = impl_->counters;
  c.open_connections = impl_->open_connections.load();
  c.replicas_up = static_cast<int64_t>(std::count(impl_->up.begin(), impl_->up.end(), true));
  return c;
}

std::vector<ReplicaSnapshot> Router::replicas() const {
  std::lock_guard lk(impl_->mu);
  std::vector<ReplicaSnapshot> out;
  for (size_t i = 0; i < impl_->replica_counters.size(); ++i) {
    ReplicaSnapshot s{impl_->options.replicas[i].name(), impl_->replica_counters[i]};
    s.counters.in_flight = impl_->policy.in_flight(i);
    s.counters.up = impl_->up[i] ? 1 : 0;
    out.push_back(std::move(s));
  }
  return out;
}

std::string Router::metrics_text() const { return impl_->metrics_text(); }

void Router::check_health_now() {
  std::promise<void> done;
  auto fut = done.get_future();
  asio::co_spawn(
      impl_->ioc,
      [this, &done]() -> asio::awaitable<void> {
        co_await impl_->health_round();
        done.set_value();
      },
      asio::detached);
  fut.wait();
}

}  // namespace specontext::router
