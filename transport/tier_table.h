// Registered tiers of one transport and the validation every transport shares. Not synchronized:
// the owning transport holds its lock around every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"

namespace specontext::transport {

struct TierInfo {
  MemoryKind kind = MemoryKind::kHost;
  std::byte* base = nullptr;  // for kRemote: the memory standing in for the remote node
  uint64_t bytes = 0;
};

// One request resolved to raw pointers after validation.
struct ResolvedCopy {
  std::byte* dst = nullptr;
  const std::byte* src = nullptr;
  uint64_t bytes = 0;
};

// Checks one request's ranges against its two tiers: offset + bytes within each tier (written so
// that it cannot overflow) and no src/dst overlap inside one tier. `who` names the caller and the
// request ("local: request 3"); errors name the tier as well. Shared with TransportRouter, which
// validates before it splits a batch so that errors keep the caller's request index.
Status check_request_ranges(const TransferRequest& r, const TierInfo& src, const TierInfo& dst,
                            std::string_view who);

class TierTable {
 public:
  explicit TierTable(std::string_view transport_name) : transport_name_(transport_name) {}

  // `kinds_ok` lists the kinds the transport can register; `base` is the memory to use (for a
  // remote tier the transport passes memory it owns).
  Status add(TierId tier, MemoryKind kind, std::byte* base, uint64_t bytes,
             const std::vector<MemoryKind>& kinds_ok);

  // Checks every request; on success fills `out` (one entry per request, in order).
  Status resolve(const TransferBatch& batch, const Capabilities& caps,
                 std::vector<ResolvedCopy>& out) const;

 private:
  std::string_view transport_name_;
  std::unordered_map<TierId, TierInfo> tiers_;
};

}  // namespace specontext::transport
