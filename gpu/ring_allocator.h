// Bookkeeping of a byte ring whose regions are handed out in order and become reusable once the
// work that reads them has finished (for the staging ring: a stream-ordered copy). Pure C++ with
// no CUDA calls, so the placement rules are unit-tested without a GPU
// (tests/gpu/ring_allocator_test.cc). Not thread-safe: the owner serialises calls.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>

namespace specontext::gpu {

class RingAllocator {
 public:
  // capacity > 0 bytes; every region starts at a multiple of `alignment` (a power of two).
  RingAllocator(size_t capacity, size_t alignment);

  struct Placement {
    size_t offset = 0;  // where the new region goes
    size_t retire = 0;  // how many of the oldest in-flight regions must finish (and be pop()ed) first
  };
  // Where n bytes (0 < n <= capacity) go: right after the newest region, or at 0 when they do not
  // fit before the end. retire counts the oldest regions up to the newest one that overlaps the
  // new range, so that after retiring them no in-flight region overlaps it.
  Placement place(size_t n) const;
  // Records [offset, offset + n) (a placement whose retire regions were popped) as in flight.
  void push(size_t offset, size_t n);
  // The oldest in-flight region finished.
  void pop();

  size_t in_flight() const { return regions_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  size_t alignment_;
  size_t head_ = 0;                                // one past the newest region
  std::deque<std::pair<size_t, size_t>> regions_;  // [begin, end), oldest first
};

}  // namespace specontext::gpu
