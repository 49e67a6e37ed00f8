#include "cluster/kv_node_tls.h"

#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <boost/asio/ip/address.hpp>
#include <cerrno>
#include <cstring>

#include "core/tls/tls_context.h"

namespace specontext::cluster {

namespace asio = boost::asio;

Result<std::shared_ptr<asio::ssl::context>> make_node_tls_context(const std::string& cert_file,
                                                                  const std::string& key_file) {
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<asio::ssl::context> ctx, tls::make_server_context(cert_file, key_file));
  return std::shared_ptr<asio::ssl::context>(std::move(ctx));
}

Result<std::shared_ptr<const KvNodeTlsClient>> KvNodeTlsClient::load(const std::string& ca_file) {
  if (ca_file.empty()) return invalid_argument("--kv-node-tls-ca: no CA file given");
  struct stat st {};
  if (::stat(ca_file.c_str(), &st) != 0) {
    return invalid_argument("--kv-node-tls-ca " + ca_file + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) return invalid_argument("--kv-node-tls-ca " + ca_file + ": not a regular file");
  auto ctx = std::make_shared<asio::ssl::context>(asio::ssl::context::tls_client);
  SPX_RETURN_IF_ERROR(tls::require_tls12(*ctx));
  boost::system::error_code ec;
  ctx->load_verify_file(ca_file, ec);
  if (ec) {
    return invalid_argument("--kv-node-tls-ca " + ca_file + ": no PEM CA certificate (" + ec.message() + ")");
  }
  ctx->set_verify_mode(asio::ssl::verify_peer);
  std::shared_ptr<KvNodeTlsClient> out(new KvNodeTlsClient());
  out->context_ = std::move(ctx);
  out->ca_file_ = ca_file;
  return std::shared_ptr<const KvNodeTlsClient>(std::move(out));
}

Status expect_node_identity(ControlStream::TlsStream& stream, const std::string& host) {
  SSL* ssl = stream.native_handle();
  boost::system::error_code ec;
  const asio::ip::address ip = asio::ip::make_address(host, ec);
  if (!ec) {
    // An IP address: matched against the certificate's IP SANs (no SNI for addresses, RFC 6066).
    if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), ip.to_string().c_str()) != 1) {
      return internal_error("TLS: cannot expect the address " + host);
    }
    return Status::ok();
  }
  if (SSL_set1_host(ssl, host.c_str()) != 1 || SSL_set_tlsext_host_name(ssl, host.c_str()) != 1) {
    return internal_error("TLS: cannot expect the host name " + host);
  }
  return Status::ok();
}

std::string tls_failure_reason(ControlStream::TlsStream& stream, const boost::system::error_code& ec) {
  const long verify = SSL_get_verify_result(stream.native_handle());
  if (verify != X509_V_OK) {
    return std::string("the node's certificate is not trusted: ") + X509_verify_cert_error_string(verify);
  }
  return ec.message();
}

}  // namespace specontext::cluster
