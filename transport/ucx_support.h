// RAII for UCX handles and the one check macro that turns a ucs_status_t into a Status. Only
// transport/ and cluster/ include this (core/ never sees a UCX header).
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"

namespace specontext::transport {

// kUnavailable for link and peer failures (the copy engine retries those, the replicated remote
// transport fails over), kResourceExhausted for NO_MEMORY / NO_RESOURCE, kInternal otherwise.
Status ucx_status(ucs_status_t status, std::string_view what);

#define SPX_UCX_CHECK(expr, what)                                                         \
  do {                                                                                    \
    const ucs_status_t spx_ucs_ = (expr);                                                 \
    if (spx_ucs_ != UCS_OK) return ::specontext::transport::ucx_status(spx_ucs_, (what)); \
  } while (0)

// A UCP context with one worker (active messages, and RMA when asked). Transports are TCP by
// default: peer failure is a connection reset there, detected at once (see transport/README.md);
// UCX_TLS overrides it.
class UcxWorker {
 public:
  // `wakeup`: the worker can block on its event fd between progress calls (KV nodes). `rma`: the
  // context has UCP_FEATURE_RMA, which a worker needs to issue one-sided get / put. It also
  // installs UCP's software RMA handlers, which copy to and from any address a peer names (a key
  // that names none of a lane's memory domains, or a transport without hardware RMA, lands there),
  // so a worker that peers may reach must never have it: KV nodes create theirs without.
  static Result<std::unique_ptr<UcxWorker>> create(std::string_view who, bool wakeup = false,
                                                   bool rma = false);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // This worker's address, for peers to connect to.
  Result<std::vector<uint8_t>> address() const;
  // The names of the transports its context opened ("tcp", "rc_mlx5", ...), each once, as
  // ucp_context_print_info lists them (UCX 1.13 has no query for them).
  std::vector<std::string> transports() const;

 private:
  UcxWorker() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
};

// A registered memory range (ucp_mem_map of existing memory) and its packed remote key.
class UcxMemory {
 public:
  static Result<std::unique_ptr<UcxMemory>> map(const UcxWorker& worker, void* base, uint64_t bytes);
  ~UcxMemory();
  UcxMemory(const UcxMemory&) = delete;
  UcxMemory& operator=(const UcxMemory&) = delete;
  ucp_mem_h handle() const { return memh_; }
  Result<std::vector<uint8_t>> packed_rkey() const;

 private:
  UcxMemory() = default;
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

// Whether a NIC checks every one-sided access over these transports against the remote key's
// region: true only when each is an InfiniBand / RoCE verbs transport (rc_verbs, rc_mlx5, dc_mlx5,
// and ud_verbs / ud_mlx5, which carry no RMA). UCX's TCP, shared-memory (posix, sysv, cma, knem,
// xpmem) and self transports check no key: an access goes to whatever address the peer names.
bool transports_enforce_rkeys(const std::vector<std::string>& transports);
// "tcp, sysv" (or "none") for messages.
std::string transport_list(const std::vector<std::string>& transports);

// Waits for a request from a UCX non-blocking call, progressing the worker; frees it. For setup
// and teardown paths only (the data path polls).
Status ucx_wait(ucp_worker_h worker, ucs_status_ptr_t request, std::string_view what);

}  // namespace specontext::transport
