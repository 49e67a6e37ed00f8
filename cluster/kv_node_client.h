// KvNodeClient: the engine side of a KV node's control plane. Synchronous calls, each bounded by
// the timeout (Asio on a private io_context, run for at most that long). Regions it allocates live
// as long as the client: destroy every transport using them first.
// Not synchronized: one thread (set-up code) uses a client.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "cluster/control_protocol.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {

class KvNodeClient {
 public:
  // Connects, says hello and, when the node asks, answers its challenge with `secret`
  // (cluster/kv_node_auth.h; load it with load_kv_secret). kUnavailable naming the endpoint when
  // nothing answers in time; kInvalidArgument when the node wants a secret and none is given, or
  // refuses this one.
  static Result<std::unique_ptr<KvNodeClient>> connect(
      const Endpoint& endpoint, std::chrono::milliseconds timeout = std::chrono::seconds(5),
      const std::string& secret = {});
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
