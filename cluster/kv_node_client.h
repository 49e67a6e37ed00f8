// KvNodeClient: the engine side of a KV node's control plane. Synchronous calls, each bounded by
// the timeout (Asio on a private io_context, run for at most that long). Regions it allocates live
// as long as the client: destroy every transport using them first. Over TLS when its access says
// so (KvNodeAccess::tls, cluster/kv_node_tls.h): the node's certificate is verified, and the
// hello goes only to a node that passed.
// Not synchronized: one thread (set-up code) uses a client.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "cluster/control_protocol.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {

class KvNodeTlsClient;

// How a client reaches its nodes: the secret it answers their challenge with, and TLS.
struct KvNodeAccess {
  std::string secret;  // cluster/kv_node_auth.h (load_kv_secret); empty: for nodes without one
  // The ID the secret belongs to in the nodes' keys file (load_kv_client_id); "": the shared secret.
  std::string client_id;
  // Verifies the nodes' certificates (KvNodeTlsClient::load, --kv-node-tls-ca); null: plain TCP.
  std::shared_ptr<const KvNodeTlsClient> tls;
};
// An engine's access from its flags: the secret from `secret_file` (else SPECONTEXT_KV_SECRET),
// the client ID `client_id` (else SPECONTEXT_KV_CLIENT_ID), TLS when `tls_ca_file` is given.
// Errors name --kv-secret-file, --kv-client-id or --kv-node-tls-ca.
Result<KvNodeAccess> load_kv_node_access(const std::string& secret_file, const std::string& tls_ca_file,
                                         const std::string& client_id = {});

class KvNodeClient {
 public:
  // Connects, says hello and, when the node asks, answers its challenge with `secret`
  // (cluster/kv_node_auth.h; load it with load_kv_secret). kUnavailable naming the endpoint when
  // nothing answers in time; kInvalidArgument when the node wants a secret and none is given, or
  // refuses this one; with TLS, kUnavailable naming the endpoint when the handshake fails (the
  // node's certificate not trusted or not for that host, or a node without TLS), and a plain
  // client of a TLS node gets the node's error saying it speaks TLS only.
  static Result<std::unique_ptr<KvNodeClient>> connect(
      const Endpoint& endpoint, std::chrono::milliseconds timeout = std::chrono::seconds(5),
      const KvNodeAccess& access = {});
  static Result<std::unique_ptr<KvNodeClient>> connect(const Endpoint& endpoint, std::chrono::milliseconds timeout,
                                                       const std::string& secret) {
    return connect(endpoint, timeout, KvNodeAccess{secret, {}, nullptr});
  }
  ~KvNodeClient();
  KvNodeClient(const KvNodeClient&) = delete;
  KvNodeClient& operator=(const KvNodeClient&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  const HelloReply& hello() const { return hello_; }
  // A region of `bytes` on the node, described for UcxRemoteTransport.
  Result<transport::RemoteRegion> allocate(uint64_t bytes);
  Status free(uint64_t region);
  // Sends one raw line (a newline is added) and returns the parsed reply; for tests of the node.
  Result<nlohmann::json> call_line(const std::string& line);

  class Impl;

 private:
  KvNodeClient(std::unique_ptr<Impl> impl, std::string endpoint);
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
  HelloReply hello_;
};

}  // namespace specontext::cluster
