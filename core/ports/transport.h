// Transport: moves batches of byte ranges between registered memory tiers.
// Lifecycle of one transfer: prepare (validate once) → post (start) → poll (until terminal)
// → release. IN_PROGRESS (kInProgress) and NO_RESOURCE (kResourceExhausted from post) are
// statuses, not errors: the caller polls again, or posts again later.
// Implementations live in transport/ (local, loopback) and gpu/ (CUDA copies, later); this header
// includes no device or fabric header.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/ids.h"
#include "core/base/memory.h"
#include "core/base/status.h"

namespace specontext {

// Copy `bytes` from [src_offset, src_offset + bytes) of tier src_tier to dst_offset of dst_tier.
struct TransferRequest {
  TierId src_tier;
  uint64_t src_offset = 0;
  TierId dst_tier;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};
using TransferBatch = std::vector<TransferRequest>;

// What a transport really implements; a test checks every (src, dst) pair against it.
class Capabilities {
 public:
  constexpr void add(MemoryKind src, MemoryKind dst) { pairs_ |= bit(src, dst); }
  constexpr bool supports(MemoryKind src, MemoryKind dst) const {
    return (pairs_ & bit(src, dst)) != 0;
  }
  // True when the transport can reach memory of another node (kRemote tiers).
  bool remote = false;

 private:
  static constexpr uint32_t bit(MemoryKind src, MemoryKind dst) {
    return 1u << (static_cast<int>(src) * kNumMemoryKinds + static_cast<int>(dst));
  }
  uint32_t pairs_ = 0;
};

class Transport;

// A key for one prepared transfer. The transport owns the transfer's state; the handle only names
// it, so copying a handle does not copy the transfer. Invalid after release().
class TransferHandle {
 public:
  TransferHandle() = default;
  bool valid() const { return id_ != 0; }
  uint64_t id() const { return id_; }
  const Transport* owner() const { return owner_; }

 private:
  friend class Transport;
  TransferHandle(const Transport* owner, uint64_t id) : owner_(owner), id_(id) {}
  const Transport* owner_ = nullptr;
  uint64_t id_ = 0;
};

inline Status in_progress(std::string msg = "in progress",
                          std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kInProgress, std::move(msg), w);
}

// Threading: every method is internally synchronized and may be called from any thread, but one
// handle must not be used by two threads at once. register_tier is meant for setup; tiers cannot
// be unregistered, and registered memory must outlive the transport.
//
// Cancellation: release() of a transfer that has not reached a terminal state cancels it. Parts
// not started are dropped; a part being copied finishes first. When release() returns, the
// transport no longer touches either range of that transfer, so the buffers may be reused (the
// destination content is then unspecified). release() is idempotent (an invalid handle is a
// no-op) and never fails. Destroying a transport cancels and releases everything still held.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view name() const = 0;
  virtual Capabilities capabilities() const = 0;

  // Registers [base, base + bytes) as tier `tier` of memory kind `kind`. `base` is null for
  // kRemote (the transport resolves remote memory itself). kUnimplemented when the transport
  // cannot handle `kind`; kInvalidArgument for a duplicate id, null base, or zero size.
  virtual Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) = 0;

  // Validates every request against the registered tiers (ranges in bounds, no overflow, no
  // overlap of src and dst in one tier, kind pair supported). Errors name the request index and
  // the tier. Nothing is copied yet.
  virtual Result<TransferHandle> prepare(const TransferBatch& batch) = 0;

  // Starts a prepared transfer. OK: already complete. kInProgress: poll until terminal.
  // kResourceExhausted (NO_RESOURCE): nothing was started; the handle stays prepared and may be
  // posted again later. Any other code: the transfer failed. Posting a handle twice is an error.
  virtual Status post(TransferHandle& handle) = 0;

  // OK when complete, kInProgress while running, otherwise the transfer's error (terminal; the
  // handle must still be released). Idempotent once terminal.
  virtual Status poll(TransferHandle& handle) = 0;

  // See "Cancellation" above. Resets `handle` to invalid.
  virtual void release(TransferHandle& handle) = 0;

  // True once the memory of `tier` is gone for good: a remote tier whose every replica died
  // (nothing it held can be read again; the engine abandons the tier and its sequences are
  // recomputed, Engine::abandon_tier). A transient failure is not a loss. Default: never.
  virtual bool tier_lost(TierId tier) const {
    (void)tier;
    return false;
  }
  // Why `tier` was lost, naming what died (a KV node tier: each replica's node and why it was
  // declared dead), for the errors and events that report the loss. Empty when it is not lost
  // or the transport cannot say.
  virtual std::string tier_loss(TierId tier) const {
    (void)tier;
    return {};
  }

 protected:
  TransferHandle make_handle(uint64_t id) const { return TransferHandle(this, id); }
  static void reset_handle(TransferHandle& handle) { handle = TransferHandle(); }
};

}  // namespace specontext
