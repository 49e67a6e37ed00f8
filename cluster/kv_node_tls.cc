#include "cluster/kv_node_tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>

#include <boost/asio/ip/address.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace specontext::cluster {

namespace asio = boost::asio;

namespace {

// True when `file` holds a PEM private key (an encrypted one is not read).
bool is_pem_private_key(const std::string& file) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(file.c_str(), "r"), &std::fclose);
  if (f == nullptr) return false;
  auto no_password = [](char*, int, int, void*) { return 0; };
  std::unique_ptr<EVP_PKEY, void (*)(EVP_PKEY*)> key(PEM_read_PrivateKey(f.get(), nullptr, no_password, nullptr),
                                                     &EVP_PKEY_free);
  ERR_clear_error();
  return key != nullptr;
}

// TLS 1.2 or later, nothing older.
Status require_tls12(asio::ssl::context& ctx) {
  ctx.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                  asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 | asio::ssl::context::no_tlsv1_1);
  if (SSL_CTX_set_min_proto_version(ctx.native_handle(), TLS1_2_VERSION) != 1) {
    return internal_error("TLS: cannot require TLS 1.2 or later");
  }
  return Status::ok();
}

}  // namespace

Result<std::shared_ptr<asio::ssl::context>> make_node_tls_context(const std::string& cert_file,
                                                                  const std::string& key_file) {
  if (cert_file.empty()) return invalid_argument("--tls-cert: a certificate file goes with --tls-key");
  if (key_file.empty()) return invalid_argument("--tls-key: a private key file goes with --tls-cert");
  struct stat st {};
  if (::stat(cert_file.c_str(), &st) != 0) {
    return invalid_argument("--tls-cert " + cert_file + ": " + std::strerror(errno));
  }
  if (::stat(key_file.c_str(), &st) != 0) {
    return invalid_argument("--tls-key " + key_file + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) return invalid_argument("--tls-key " + key_file + ": not a regular file");
  if ((st.st_mode & S_IROTH) != 0) {
    return invalid_argument("--tls-key " + key_file + ": the private key is readable by every user (chmod o-r " +
                            key_file + ", e.g. chmod 600)");
  }
  auto tls = std::make_shared<asio::ssl::context>(asio::ssl::context::tls_server);
  SPX_RETURN_IF_ERROR(require_tls12(*tls));
  tls->set_options(asio::ssl::context::single_dh_use);
  // An encrypted key is refused, not asked for at a terminal.
  tls->set_password_callback([](size_t, asio::ssl::context::password_purpose) { return std::string(); });
  boost::system::error_code ec;
  tls->use_certificate_chain_file(cert_file, ec);
  if (ec) {
    return invalid_argument("--tls-cert " + cert_file + ": not a PEM certificate chain (" + ec.message() + ")");
  }
  tls->use_private_key_file(key_file, asio::ssl::context::pem, ec);
  if (ec && is_pem_private_key(key_file)) {
    return invalid_argument("--tls-key " + key_file + ": not the private key of the certificate in " + cert_file);
  }
  if (ec) return invalid_argument("--tls-key " + key_file + ": not a PEM private key (" + ec.message() + ")");
  return tls;
}

Result<std::shared_ptr<const KvNodeTlsClient>> KvNodeTlsClient::load(const std::string& ca_file) {
  if (ca_file.empty()) return invalid_argument("--kv-node-tls-ca: no CA file given");
  struct stat st {};
  if (::stat(ca_file.c_str(), &st) != 0) {
    return invalid_argument("--kv-node-tls-ca " + ca_file + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) return invalid_argument("--kv-node-tls-ca " + ca_file + ": not a regular file");
  auto ctx = std::make_shared<asio::ssl::context>(asio::ssl::context::tls_client);
  SPX_RETURN_IF_ERROR(require_tls12(*ctx));
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
