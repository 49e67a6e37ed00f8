#include "core/tls/tls_context.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace specontext::tls {

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

}  // namespace

Status require_tls12(asio::ssl::context& ctx) {
  ctx.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                  asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 | asio::ssl::context::no_tlsv1_1);
  if (SSL_CTX_set_min_proto_version(ctx.native_handle(), TLS1_2_VERSION) != 1) {
    return internal_error("TLS: cannot require TLS 1.2 or later");
  }
  return Status::ok();
}

Result<std::unique_ptr<asio::ssl::context>> make_server_context(const std::string& cert_file,
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
  auto tls = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_server);
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

}  // namespace specontext::tls
