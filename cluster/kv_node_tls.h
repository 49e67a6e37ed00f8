// TLS for the KV node's control plane (cluster/control_protocol.h): the node's certificate and
// key (`kv-node --tls-cert/--tls-key`), the clients' CA (`--kv-node-tls-ca`), and the stream both
// sides read and write lines on, plain TCP or TLS over TCP. TLS 1.2 or later only, OpenSSL through
// Boost.Asio's ssl::context and ssl::stream (the node's context is core/tls make_server_context, as
// the HTTP server's: an encrypted key is refused, a key readable by every user is refused, errors
// name the flag). The client verifies the node's certificate chain against the CA
// and the endpoint's host against the certificate as OpenSSL does it (DNS names with
// SSL_set1_host, IP addresses against the certificate's IP SANs), and sends the host as SNI.
//
// Each side tells the other apart at the first byte, so a mismatch is an error naming the node,
// never a hang: a TLS node answers a plain client's first line with a plain error line ("speaks
// TLS"); a node without TLS closes a connection whose first byte opens a TLS handshake (0x16), and
// the client's handshake error says the node may not speak TLS.
// The UCX data plane is not covered (see cluster/README.md).
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/base/status.h"

namespace specontext::cluster {

// The first byte of a TLS handshake record (RFC 8446 section 5.1, ContentType handshake).
inline constexpr unsigned char kTlsHandshakeByte = 0x16;

// The node's TLS: a PEM certificate chain and its PEM private key (not encrypted, not readable by
// every user). kInvalidArgument naming --tls-cert or --tls-key.
Result<std::shared_ptr<boost::asio::ssl::context>> make_node_tls_context(const std::string& cert_file,
                                                                         const std::string& key_file);

// A client's TLS: nodes' certificates are verified against the PEM CA certificates in `ca_file`.
// Shared by every client of an engine (OpenSSL contexts are safe to use from several threads).
class KvNodeTlsClient {
 public:
  // kInvalidArgument naming --kv-node-tls-ca when the file is missing or holds no certificate.
  static Result<std::shared_ptr<const KvNodeTlsClient>> load(const std::string& ca_file);
  boost::asio::ssl::context& context() const { return *context_; }
  const std::string& ca_file() const { return ca_file_; }

 private:
  std::shared_ptr<boost::asio::ssl::context> context_;
  std::string ca_file_;
};

// A control connection's byte stream: TCP, or TLS over TCP. Asio's composed reads and writes
// (async_read_until, async_write) take it.
class ControlStream {
 public:
  using tcp = boost::asio::ip::tcp;
  using TlsStream = boost::asio::ssl::stream<tcp::socket>;
  using executor_type = tcp::socket::executor_type;

  // `tls`: null for plain TCP.
  ControlStream(tcp::socket socket, boost::asio::ssl::context* tls) {
    if (tls != nullptr) {
      tls_ = std::make_unique<TlsStream>(std::move(socket), *tls);
    } else {
      tcp_.emplace(std::move(socket));
    }
  }
  // A client's: a new socket on `io`.
  ControlStream(boost::asio::io_context& io, boost::asio::ssl::context* tls) {
    if (tls != nullptr) {
      tls_ = std::make_unique<TlsStream>(io, *tls);
    } else {
      tcp_.emplace(io);
    }
  }
  bool is_tls() const { return tls_ != nullptr; }
  TlsStream* tls() { return tls_.get(); }
  tcp::socket& socket() { return tls_ ? tls_->next_layer() : *tcp_; }
  executor_type get_executor() { return socket().get_executor(); }

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

 private:
  std::optional<tcp::socket> tcp_;
  std::unique_ptr<TlsStream> tls_;
};

// Prepares a client's TLS stream for the node at `host`: SNI (for a DNS name) and the name or IP
// address its certificate must carry. kInternal when OpenSSL refuses the name.
Status expect_node_identity(ControlStream::TlsStream& stream, const std::string& host);

// Why a handshake failed, for messages: OpenSSL's reason, and for a certificate the verifier's.
std::string tls_failure_reason(ControlStream::TlsStream& stream, const boost::system::error_code& ec);

}  // namespace specontext::cluster
