// OpenSSL contexts through Boost.Asio's ssl::context (which owns the SSL_CTX), shared by the HTTP
// server (serving/openai, `serve --tls-cert/--tls-key`) and the kv-node control plane (cluster,
// `kv-node --tls-cert/--tls-key`, clients' `--kv-node-tls-ca`). TLS 1.2 or later only.
#pragma once

#include <boost/asio/ssl/context.hpp>
#include <memory>
#include <string>

#include "core/base/status.h"

namespace specontext::tls {

// Refuses every protocol older than TLS 1.2 on `ctx`. kInternal when OpenSSL will not.
Status require_tls12(boost::asio::ssl::context& ctx);

// A server's TLS: `cert_file` a PEM certificate chain and `key_file` its PEM private key, which
// may be neither encrypted (refused, never asked for at a terminal) nor readable by every user.
// kInvalidArgument naming --tls-cert or --tls-key and the file.
Result<std::unique_ptr<boost::asio::ssl::context>> make_server_context(const std::string& cert_file,
                                                                      const std::string& key_file);

}  // namespace specontext::tls
