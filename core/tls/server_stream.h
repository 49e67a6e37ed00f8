// The server side of an accepted connection, TCP or TLS over TCP (serve's HTTP server, the
// router). It reads and writes as a stream (Beast's HTTP reads and writes take it), and the TCP
// layer keeps the timeouts and the socket. Header only: the coroutines are Asio's.
#pragma once

#include <boost/asio/awaitable.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/ssl/ssl_stream.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/base/status.h"

namespace specontext::tls {

class ServerStream {
 public:
  using tcp = boost::asio::ip::tcp;
  using executor_type = boost::beast::tcp_stream::executor_type;
  using TlsStream = boost::beast::ssl_stream<boost::beast::tcp_stream>;

  // `tls`: null for plain TCP.
  ServerStream(tcp::socket socket, boost::asio::ssl::context* tls) {
    if (tls != nullptr) {
      tls_ = std::make_unique<TlsStream>(std::move(socket), *tls);
    } else {
      tcp_.emplace(std::move(socket));
    }
  }
  bool is_tls() const { return tls_ != nullptr; }
  boost::beast::tcp_stream& tcp_layer() { return tls_ ? tls_->next_layer() : *tcp_; }
  executor_type get_executor() { return tcp_layer().get_executor(); }
  tcp::socket& socket() { return tcp_layer().socket(); }
  void expires_after(std::chrono::steady_clock::duration d) { tcp_layer().expires_after(d); }
  void expires_never() { tcp_layer().expires_never(); }

  template <typename Buffers, typename Token>
  auto async_read_some(const Buffers& buffers, Token&& token) {
    if (tls_) return tls_->async_read_some(buffers, std::forward<Token>(token));
    return tcp_->async_read_some(buffers, std::forward<Token>(token));
  }
  template <typename Buffers, typename Token>
  auto async_write_some(const Buffers& buffers, Token&& token) {
    if (tls_) return tls_->async_write_some(buffers, std::forward<Token>(token));
    return tcp_->async_write_some(buffers, std::forward<Token>(token));
  }

  // TLS: the server's side of the handshake (plain TCP: nothing to do).
  boost::asio::awaitable<boost::beast::error_code> handshake() {
    boost::beast::error_code ec;
    if (tls_) {
      co_await tls_->async_handshake(boost::asio::ssl::stream_base::server,
                                     boost::asio::redirect_error(boost::asio::use_awaitable, ec));
    }
    co_return ec;
  }
  // No more to send: TLS sends its close_notify (and waits up to a second for the peer's), then
  // the TCP sending side is shut.
  boost::asio::awaitable<void> shutdown_send() {
    boost::beast::error_code ec;
    if (tls_) {
      expires_after(std::chrono::seconds(1));
      co_await tls_->async_shutdown(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
    }
    socket().shutdown(tcp::socket::shutdown_send, ec);
  }

 private:
  std::optional<boost::beast::tcp_stream> tcp_;
  std::unique_ptr<TlsStream> tls_;
};

// Opens `acceptor` listening on host:port (reuse_address; port 0: any free one). kInvalidArgument
// when `host` is not an IP address, kUnavailable naming host:port when it cannot listen; every
// message starts with `who` (the command: "serve", "router").
inline Status listen_on(boost::asio::ip::tcp::acceptor& acceptor, const std::string& host, uint16_t port,
                        const std::string& who) {
  boost::beast::error_code ec;
  const auto address = boost::asio::ip::make_address(host, ec);
  if (ec) return invalid_argument(who + ": listen host '" + host + "' is not an IP address: " + ec.message());
  const boost::asio::ip::tcp::endpoint endpoint(address, port);
  const std::string where = host + ":" + std::to_string(port);
  if (acceptor.open(endpoint.protocol(), ec); ec)
    return Status(StatusCode::kUnavailable, who + ": " + where + ": " + ec.message());
  acceptor.set_option(boost::asio::socket_base::reuse_address(true), ec);
  if (acceptor.bind(endpoint, ec); ec)
    return Status(StatusCode::kUnavailable, who + ": cannot listen on " + where + ": " + ec.message());
  if (acceptor.listen(boost::asio::socket_base::max_listen_connections, ec); ec)
    return Status(StatusCode::kUnavailable, who + ": cannot listen on " + where + ": " + ec.message());
  return Status::ok();
}

// The I/O thread's body: runs `ioc` until it is stopped; an exception escaping a connection's
// handler is printed ("WHO: what (connection handling goes on)") and the loop runs on.
inline void run_until_stopped(boost::asio::io_context& ioc, const char* who) {
  for (;;) {
    try {
      ioc.run();
      return;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s (connection handling goes on)\n", who, e.what());
    }
  }
}

}  // namespace specontext::tls
