#include "core/base/region_allocator.h"

#include <algorithm>
#include <string>

namespace specontext {

RegionAllocator::RegionAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity / alignment * alignment), alignment_(alignment) {
  if (capacity_ > 0) free_ranges_.emplace(0, capacity_);
}

Result<uint64_t> RegionAllocator::allocate(uint64_t bytes) {
  if (bytes == 0) return invalid_argument("region allocator: zero-byte allocation");
  if (bytes > capacity_) {
    return resource_exhausted("cannot place " + std::to_string(bytes) + " bytes in a region of " +
                              std::to_string(capacity_));
  }
  const uint64_t need = (bytes + alignment_ - 1) / alignment_ * alignment_;
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_ranges_.erase(it);
    if (rest > 0) free_ranges_.emplace(offset + need, rest);
    used_ranges_.emplace(offset, need);
    used_ += need;
    return offset;
  }
  return resource_exhausted("cannot place " + std::to_string(bytes) + " bytes: " + std::to_string(free_bytes()) +
                            " of " + std::to_string(capacity_) + " free, largest free range " +
                            std::to_string(largest_free()));
}

Result<uint64_t> RegionAllocator::allocate_top(uint64_t bytes) {
  if (bytes == 0) return invalid_argument("region allocator: zero-byte allocation");
  if (bytes > capacity_) {  // also keeps the rounding below from overflowing
    return resource_exhausted("cannot place " + std::to_string(bytes) + " bytes in a region of " +
                              std::to_string(capacity_));
  }
  const uint64_t need = (bytes + alignment_ - 1) / alignment_ * alignment_;
  for (auto it = free_ranges_.rbegin(); it != free_ranges_.rend(); ++it) {
    if (it->second < need) continue;
    const uint64_t start = it->first, size = it->second;
    free_ranges_.erase(start);
    if (size > need) free_ranges_.emplace(start, size - need);
    const uint64_t offset = start + size - need;
    used_ranges_.emplace(offset, need);
    used_ += need;
    return offset;
  }
  return allocate(bytes);  // the same error message
}

Status RegionAllocator::free(uint64_t offset) {
  auto it = used_ranges_.find(offset);
  if (it == used_ranges_.end()) {
    return invalid_argument("region allocator: offset " + std::to_string(offset) + " is not allocated");
  }
  uint64_t start = offset, size = it->second;
  used_ -= size;
  used_ranges_.erase(it);
  // Coalesce with the free neighbours.
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.end() && next->first == start + size) {
    size += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_ranges_.erase(prev);
    }
  }
  free_ranges_.emplace(start, size);
  return Status::ok();
}

uint64_t RegionAllocator::largest_free() const {
  uint64_t best = 0;
  for (const auto& [off, size] : free_ranges_) best = std::max(best, size);
  return best;
}

uint64_t RegionAllocator::size_at(uint64_t offset) const {
  auto it = used_ranges_.find(offset);
  return it == used_ranges_.end() ? 0 : it->second;
}

Status RegionAllocator::check() const {
  std::map<uint64_t, uint64_t> all(free_ranges_);
  for (const auto& [off, size] : used_ranges_) {
    if (!all.emplace(off, size).second) return internal_error("region allocator: range used and free at " + std::to_string(off));
  }
  uint64_t at = 0, used = 0;
  for (const auto& [off, size] : all) {
    if (off != at) return internal_error("region allocator: gap or overlap at " + std::to_string(off));
    at += size;
  }
  for (const auto& [off, size] : used_ranges_) used += size;
  if (at != capacity_ || used != used_) return internal_error("region allocator: ranges do not cover the region");
  return Status::ok();
}

}  // namespace specontext
