#include "gpu/staging_ring.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "gpu/cuda_check.h"

namespace specontext::gpu {

namespace {
constexpr size_t kAlignment = 256;  // keeps every chunk DMA- and float4-aligned
}

StagingRing::StagingRing(size_t capacity) : ring_(capacity, kAlignment) {}

StagingRing::~StagingRing() {
  // The ring memory must not be freed while a copy still reads it.
  while (!pending_.empty()) {
    log_error(pending_.front().synchronize(), "StagingRing teardown");
    pending_.pop_front();
  }
}

Status StagingRing::retire_oldest(bool wait) {
  CudaEvent& ev = pending_.front();
  if (wait) {
    SPX_RETURN_IF_ERROR(ev.synchronize());
  } else {
    SPX_RETURN_IF_ERROR(ev.query());  // kInProgress: leave it
  }
  spare_.push_back(std::move(ev));
  pending_.pop_front();
  ring_.pop();
  return Status::ok();
}

Status StagingRing::copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::ok();
  if (buffer_.empty()) {
    SPX_ASSIGN_OR_RETURN(buffer_, PinnedHostBuffer::create(ring_.capacity()));
  }
  // Reclaim what has finished (cheap queries), so that later placements rarely have to wait.
  while (!pending_.empty() && retire_oldest(/*wait=*/false).is_ok()) {
  }
  const size_t chunk_max = std::max<size_t>(ring_.capacity() / 4, 1);
  auto* out = static_cast<std::byte*>(dst);
  const auto* in = static_cast<const std::byte*>(src);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(chunk_max, bytes - done);
    const RingAllocator::Placement p = ring_.place(n);
    for (size_t i = 0; i < p.retire; ++i) SPX_RETURN_IF_ERROR(retire_oldest(/*wait=*/true));
    std::byte* stage = static_cast<std::byte*>(buffer_.data()) + p.offset;
    std::memcpy(stage, in + done, n);
    SPX_CUDA_CHECK(cudaMemcpyAsync(out + done, stage, n, cudaMemcpyHostToDevice, stream));
    CudaEvent ev;
    if (spare_.empty()) {
      SPX_ASSIGN_OR_RETURN(ev, CudaEvent::create());
    } else {
      ev = std::move(spare_.back());
      spare_.pop_back();
    }
    // If recording fails the region was still handed to the copy: wait for the stream instead.
    const Status recorded = ev.record(stream);
    if (!recorded.is_ok()) {
      SPX_CUDA_CHECK(cudaStreamSynchronize(stream));
      return recorded;
    }
    pending_.push_back(std::move(ev));
    ring_.push(p.offset, n);
    done += n;
  }
  return Status::ok();
}

}  // namespace specontext::gpu
