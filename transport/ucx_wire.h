// Wire format of the node-side gather / scatter (UcxTransferMode::kNodeGather): UCX active
// messages between UcxRemoteTransport and a KV node (cluster/kv_node.cc). A request lists the
// node-memory ranges (remote virtual addresses, as in RMA); a gather's reply carries the rows
// packed in list order, a scatter's request carries them after the list and its reply only the
// status. Every range must lie inside the region the header names. One request moves at most
// kMaxChunkBytes of rows and kMaxChunkRanges ranges (always
// eager, so each message arrives whole in one callback).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace specontext::transport::ucx_wire {

inline constexpr unsigned kGather = 0x5301;
inline constexpr unsigned kGatherReply = 0x5302;
inline constexpr unsigned kScatter = 0x5303;
inline constexpr unsigned kScatterReply = 0x5304;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 20;
inline constexpr uint32_t kMaxChunkRanges = 16384;

// A region's key: 128 bits from the node's OS random source (getrandom), never all zeros.
inline constexpr size_t kKeyBytes = 16;
using RegionKey = std::array<uint8_t, kKeyBytes>;

// Compares two keys in time that does not depend on where they differ (every byte is looked at,
// the differences OR-ed together, no early exit; volatile keeps the compiler from adding one), so
// a client timing refusals learns nothing about a key's bytes.
inline bool same_key(const RegionKey& a, const RegionKey& b) {
  const volatile uint8_t* x = a.data();
  const volatile uint8_t* y = b.data();
  uint8_t diff = 0;
  for (size_t i = 0; i < kKeyBytes; ++i) diff = static_cast<uint8_t>(diff | (x[i] ^ y[i]));
  return diff == 0;
}
inline bool is_zero_key(const RegionKey& k) { return same_key(k, RegionKey{}); }

struct Range {
  uint64_t address = 0;
  uint64_t bytes = 0;
};
struct RequestHeader {
  uint64_t token = 0;  // echoed in the reply
  uint32_t ranges = 0;
  uint32_t reserved = 0;
  uint64_t region = 0;  // the node's id of the caller's region (control plane "alloc"; random)
  RegionKey key{};      // that region's key: requests without it are refused (UCS_ERR_REJECTED)
};
static_assert(sizeof(RequestHeader) == 40);
struct ReplyHeader {
  uint64_t token = 0;
  int32_t status =
      0;  // ucs_status_t: UCS_OK, or why the node refused (not the caller's region, a range outside it)
  uint32_t reserved = 0;
};

}  // namespace specontext::transport::ucx_wire
