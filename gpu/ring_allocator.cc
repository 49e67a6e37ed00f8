#include "gpu/ring_allocator.h"

#include <cassert>

namespace specontext::gpu {

RingAllocator::RingAllocator(size_t capacity, size_t alignment) : capacity_(capacity), alignment_(alignment) {
  assert(capacity > 0 && alignment > 0 && (alignment & (alignment - 1)) == 0);
}

RingAllocator::Placement RingAllocator::place(size_t n) const {
  assert(n > 0 && n <= capacity_);
  Placement p;
  p.offset = (head_ + alignment_ - 1) & ~(alignment_ - 1);
  if (p.offset > capacity_ || capacity_ - p.offset < n) p.offset = 0;  // wrap around
  const size_t end = p.offset + n;
  for (size_t i = 0; i < regions_.size(); ++i) {
    const auto [b, e] = regions_[i];
    if (b < end && p.offset < e) p.retire = i + 1;
  }
  return p;
}

void RingAllocator::push(size_t offset, size_t n) {
  regions_.emplace_back(offset, offset + n);
  head_ = offset + n;
}

void RingAllocator::pop() {
  assert(!regions_.empty());
  regions_.pop_front();
}

}  // namespace specontext::gpu
