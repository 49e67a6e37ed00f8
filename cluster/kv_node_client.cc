#include "cluster/kv_node_client.h"

#include <boost/asio.hpp>

#include <cstdlib>

#include "cluster/kv_node_tls.h"

namespace specontext::cluster {

namespace asio = boost::asio;
using asio::ip::tcp;

class KvNodeClient::Impl {
 public:
  Impl(std::string endpoint, std::chrono::milliseconds timeout, std::shared_ptr<const KvNodeTlsClient> tls)
      : endpoint(std::move(endpoint)),
        timeout(timeout),
        tls(std::move(tls)),
        stream(io, this->tls ? &this->tls->context() : nullptr) {}
  std::string endpoint;
  std::chrono::milliseconds timeout;
  std::shared_ptr<const KvNodeTlsClient> tls;  // keeps the context alive for the stream
  asio::io_context io;
  ControlStream stream;
  tcp::socket& socket = stream.socket();
  std::string in;

  // Runs the queued operations for at most the timeout; false (socket closed) when they did not
  // finish, so no handler outlives this call.
  bool run_bounded() {
    io.restart();
    io.run_for(timeout);
    if (io.stopped()) return true;
    boost::system::error_code ignored;
    socket.close(ignored);
    io.restart();
    io.run();  // the aborted handlers
    return false;
  }

  Status connect(const Endpoint& ep) {
    tcp::resolver resolver(io);
    boost::system::error_code ec;
    auto results = resolver.resolve(ep.host, std::to_string(ep.port), ec);
    if (ec) return unavailable("kv node " + endpoint + ": cannot resolve: " + ec.message());
    boost::system::error_code result = asio::error::would_block;
    asio::async_connect(socket, results,
                        [&](boost::system::error_code e, const tcp::endpoint&) { result = e; });
    if (!run_bounded()) return unavailable("kv node " + endpoint + ": no connection within " + ms());
    if (result) return unavailable("kv node " + endpoint + ": cannot connect: " + result.message());
    if (!stream.is_tls()) return Status::ok();
    SPX_RETURN_IF_ERROR(expect_node_identity(*stream.tls(), ep.host));
    boost::system::error_code hs = asio::error::would_block;
    stream.tls()->async_handshake(asio::ssl::stream_base::client, [&](boost::system::error_code e) { hs = e; });
    if (!run_bounded()) return unavailable("kv node " + endpoint + ": no TLS handshake within " + ms());
    if (hs) {
      boost::system::error_code ignored;
      socket.close(ignored);
      return unavailable("kv node " + endpoint + ": TLS handshake failed (" + tls_failure_reason(*stream.tls(), hs) +
                         "; CA " + tls->ca_file() +
                         "): is it a node with --tls-cert and --tls-key, and its certificate for " + ep.host + "?");
    }
    return Status::ok();
  }

  std::string ms() const { return std::to_string(timeout.count()) + " ms"; }

  Result<nlohmann::json> call(const std::string& line) {
    if (!socket.is_open()) return unavailable("kv node " + endpoint + ": control connection is closed");
    boost::system::error_code write_ec = asio::error::would_block;
    boost::system::error_code read_ec = asio::error::would_block;
    size_t n = 0;
    asio::async_write(stream, asio::buffer(line), [&](boost::system::error_code e, size_t) {
      write_ec = e;
      if (e) return;
      asio::async_read_until(stream, asio::dynamic_buffer(in, kMaxControlLine + 1), '\n',
                             [&](boost::system::error_code e2, size_t got) {
                               read_ec = e2;
                               n = got;
                             });
    });
    if (!run_bounded()) return unavailable("kv node " + endpoint + ": no reply within " + ms());
    if (write_ec) return unavailable("kv node " + endpoint + ": send failed: " + write_ec.message());
    if (read_ec) {
      boost::system::error_code ignored;
      socket.close(ignored);
      if (read_ec == asio::error::not_found)
        return data_loss("kv node " + endpoint + ": reply longer than 64 KiB");
      return unavailable("kv node " + endpoint + ": connection lost: " + read_ec.message());
    }
    const std::string reply = in.substr(0, n - 1);
    in.erase(0, n);
    return parse_control_reply(reply, endpoint);
  }
};

KvNodeClient::KvNodeClient(std::unique_ptr<Impl> impl, std::string endpoint)
    : impl_(std::move(impl)), endpoint_(std::move(endpoint)) {}

KvNodeClient::~KvNodeClient() {
  boost::system::error_code ignored;
  impl_->socket.close(ignored);
}

Result<std::unique_ptr<KvNodeClient>> KvNodeClient::connect(const Endpoint& endpoint,
                                                            std::chrono::milliseconds timeout,
                                                            const KvNodeAccess& access) {
  const std::string& secret = access.secret;
  auto impl = std::make_unique<Impl>(endpoint.text(), timeout, access.tls);
  SPX_RETURN_IF_ERROR(impl->connect(endpoint));
  std::unique_ptr<KvNodeClient> c(new KvNodeClient(std::move(impl), endpoint.text()));
  ControlRequest hello;
  hello.op = ControlOp::kHello;
  hello.client = access.client_id;
  SPX_ASSIGN_OR_RETURN(nlohmann::json reply, c->impl_->call(control_request_line(hello)));
  SPX_ASSIGN_OR_RETURN(c->hello_, parse_hello_reply(reply, c->endpoint_));
  if (!c->hello_.auth_required) {
    // With a secret, an open node is refused: anything can answer "no authentication".
    if (!secret.empty()) {
      return invalid_argument("kv node " + c->endpoint_ +
                              ": authentication failed: it asks for no authentication, but this client has a "
                              "shared secret (another process at that address, or a node started without "
                              "the secret)");
    }
    return c;
  }
  if (secret.empty()) {
    return invalid_argument(
        "kv node " + c->endpoint_ +
        " requires authentication: give its shared secret in a file (--kv-secret-file PATH) "
        "or in " +
        std::string(kSecretEnv));
  }
  ControlRequest auth;
  auth.op = ControlOp::kAuth;
  auth.mac = auth_response(secret, c->hello_.nonce, c->hello_.node, access.client_id);
  SPX_RETURN_IF_ERROR(fill_random(auth.nonce));
  const AuthNonce node_nonce = c->hello_.nonce;
  SPX_ASSIGN_OR_RETURN(reply, c->impl_->call(control_request_line(auth)));
  SPX_ASSIGN_OR_RETURN(c->hello_, parse_hello_reply(reply, c->endpoint_));
  if (c->hello_.auth_required)
    return data_loss("kv node " + c->endpoint_ + ": malformed reply: a second challenge");
  // The node's side of the mutual authentication: before any KV goes to it.
  const Sha256Digest expected = node_proof(secret, auth.nonce, node_nonce, c->hello_.node, access.client_id);
  if (!c->hello_.has_proof || !constant_time_equal(expected, c->hello_.proof)) {
    return invalid_argument("kv node " + c->endpoint_ +
                            ": authentication failed: the node did not prove it holds the shared secret "
                            "(another process at that address, or a different secret)");
  }
  return c;
}

Result<KvNodeAccess> load_kv_node_access(const std::string& secret_file, const std::string& tls_ca_file,
                                         const std::string& client_id) {
  KvNodeAccess access;
  SPX_ASSIGN_OR_RETURN(access.client_id, load_kv_client_id(client_id));
  if (!access.client_id.empty() && secret_file.empty() && std::getenv(kSecretEnv) == nullptr) {
    return invalid_argument("--kv-client-id " + access.client_id +
                            ": its secret goes in a file (--kv-secret-file PATH) or in " + std::string(kSecretEnv));
  }
  auto secret = load_kv_secret(secret_file);
  if (!secret.is_ok()) return secret.status().with_context("--kv-secret-file");
  access.secret = std::move(secret).value();
  if (!tls_ca_file.empty()) {
    SPX_ASSIGN_OR_RETURN(access.tls, KvNodeTlsClient::load(tls_ca_file));
  }
  return access;
}

Result<transport::RemoteRegion> KvNodeClient::allocate(uint64_t bytes) {
  ControlRequest r;
  r.op = ControlOp::kAlloc;
  r.bytes = bytes;
  SPX_ASSIGN_OR_RETURN(nlohmann::json reply, impl_->call(control_request_line(r)));
  SPX_ASSIGN_OR_RETURN(AllocReply a, parse_alloc_reply(reply, endpoint_));
  if (a.bytes < bytes) {
    return data_loss("kv node " + endpoint_ + ": malformed reply: region of " + std::to_string(a.bytes) +
                     " bytes for " + std::to_string(bytes) + " asked");
  }
  transport::RemoteRegion region;
  region.node = endpoint_;
  region.worker_address = hello_.worker_address;
  region.rkey = std::move(a.rkey);
  region.address = a.address;
  region.bytes = a.bytes;
  region.region = a.region;
  region.key = a.key;
  region.rma_refused = hello_.rma ? std::string() : hello_.rma_refused;
  return region;
}

Status KvNodeClient::free(uint64_t region) {
  ControlRequest r;
  r.op = ControlOp::kFree;
  r.region = region;
  auto reply = impl_->call(control_request_line(r));
  return reply.is_ok() ? Status::ok() : reply.status();
}

Result<nlohmann::json> KvNodeClient::call_line(const std::string& line) { return impl_->call(line + "\n"); }

}  // namespace specontext::cluster
