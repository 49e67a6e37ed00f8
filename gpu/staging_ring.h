// A page-locked staging ring for host → device copies whose host source must be reusable as soon
// as the call returns (Backend::upload, the backends' per-call metadata, the transport's request
// lists). Each copy first memcpy's the source into the ring, then enqueues a truly asynchronous
// cudaMemcpyAsync from the ring and records an event; a ring region is rewritten only after its
// event has completed. This does not rely on how the driver treats pageable sources (the runtime
// documents pageable cudaMemcpyAsync only as "might be synchronous"), and a pinned source no longer
// has to stay untouched until the copy lands.
//
// Ownership: the ring owns its pinned buffer (allocated on the first copy) and its events. Not
// thread-safe (the backend is single-threaded; the transport calls it under its mutex). The
// device must be current when calling copy(). Destruction waits for every copy still reading it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <deque>
#include <vector>

#include "core/base/status.h"
#include "gpu/cuda_raii.h"
#include "gpu/ring_allocator.h"

namespace specontext::gpu {

class StagingRing {
 public:
  static constexpr size_t kDefaultCapacity = size_t{8} << 20;
  // capacity: bytes of pinned memory; copies larger than a quarter of it travel in chunks.
  explicit StagingRing(size_t capacity = kDefaultCapacity);
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // dst (device memory) ← host [src, src + bytes) on `stream`, asynchronously; `src` may be
  // reused when this returns. Blocks only when the ring is full of copies still in flight.
  Status copy(void* dst, const void* src, size_t bytes, cudaStream_t stream);

  size_t capacity() const { return ring_.capacity(); }
  size_t in_flight() const { return ring_.in_flight(); }

 private:
  Status retire_oldest(bool wait);

  RingAllocator ring_;
  PinnedHostBuffer buffer_;
  std::deque<CudaEvent> pending_;  // one per in-flight ring region, oldest first
  std::vector<CudaEvent> spare_;
};

}  // namespace specontext::gpu
