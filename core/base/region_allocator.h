// Sub-allocation of one registered memory region (a tier): byte ranges [offset, offset + size)
// handed out first-fit and coalesced on free. The region's memory is never touched here, so the
// same allocator serves device memory, host NUMA pools and remote nodes (offsets only).
// Not thread-safe: owned by the engine loop (one thread).
#pragma once

#include <cstdint>
#include <map>

#include "core/base/status.h"

namespace specontext {

class RegionAllocator {
 public:
  RegionAllocator() = default;
  // A region of `capacity` bytes; every allocation is aligned to `alignment` (a power of two).
  RegionAllocator(uint64_t capacity, uint64_t alignment = 256);

  // First fit. kResourceExhausted when no free range is large enough (the message gives the
  // request, the free total and the largest free range). bytes == 0 is an InvalidArgument.
  Result<uint64_t> allocate(uint64_t bytes);
  // The same from the top of the region (last fit): callers keep equal-sized, frequent
  // allocations (KV chunks) at the bottom and variable ones (working sets, head caches) at the
  // top, so that neither class fragments the other.
  Result<uint64_t> allocate_top(uint64_t bytes);
  // Returns a range from allocate(); kInvalidArgument for an offset that is not allocated.
  Status free(uint64_t offset);

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t largest_free() const;
  int64_t allocations() const { return static_cast<int64_t>(used_ranges_.size()); }
  // Size of the allocation at `offset`, 0 when none.
  uint64_t size_at(uint64_t offset) const;
  // Free and used ranges are disjoint, sorted and cover [0, capacity) exactly.
  Status check() const;

 private:
  uint64_t capacity_ = 0;
  uint64_t alignment_ = 256;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_ranges_;  // offset → size
  std::map<uint64_t, uint64_t> used_ranges_;  // offset → size (rounded)
};

}  // namespace specontext
