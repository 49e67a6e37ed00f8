// CudaTransport: core/ports/transport.h for one GPU. Moves batches between page-locked host memory and
// device memory and within device memory (kPinnedHost → kDevice, kDevice → kPinnedHost,
// kDevice → kDevice; nothing else is advertised or accepted), on its own non-blocking copy
// stream (never the compute stream of a CudaBackend).
//
// Methods (gpu/transfer_plan.h): kDma issues one cudaMemcpyAsync per coalesced request;
// kGatherKernel uploads the batch's piece list once (through a pinned staging ring) and runs one
// kernel that reads and writes every request directly, reaching pinned host tiers through their
// mapped UVA device pointers; kAuto picks the kernel for small mean requests. Requests of one
// batch must be independent (disjoint destinations, no request reading what another writes);
// prepare() rejects batches that are not.
//
// Tiers: register_tier(kPinnedHost) takes page-locked memory (cudaHostAlloc, or a range
// registered with PinnedHostRegistration / cudaHostRegister, e.g. the engine's NUMA host pools);
// pageable memory is kInvalidArgument (a DMA from it would be synchronous and the kernel cannot
// reach it). register_tier(kDevice) takes memory of this transport's device. kHost and kRemote are
// kUnimplemented.
//
// Completion: post() enqueues the copies and records a CudaEvent; it returns kInProgress (OK for
// a batch without bytes). poll() is cudaEventQuery: kInProgress until the copies are done, then
// OK, or the CUDA error (terminal). release() waits for the event before returning — queued GPU
// work cannot be withdrawn, so cancelling means waiting for it — after which both ranges may be
// reused; it never fails (a wait error is logged). Destruction releases everything still held.
//
// Ordering with other streams: the copy stream has no implicit order with any other stream.
// order_after(producer) makes transfers posted later start after the work queued on `producer`
// so far (e.g. KV written by the compute stream before an offload); make_stream_wait(handle,
// consumer) makes `consumer` wait for a posted transfer without blocking the host (e.g. attention
// after a prefetch).
//
// Threads: internally synchronized (one mutex guards tiers, transfers and the pools; CUDA calls
// that enqueue a batch's copies run outside it), so any thread may call any method, but one handle
// must not be used by two threads at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"
#include "gpu/cuda_raii.h"
#include "gpu/staging_ring.h"
#include "gpu/transfer_plan.h"
#include "transport/tier_table.h"

namespace specontext::gpu {

struct CudaTransportOptions {
  CopyMethod method = CopyMethod::kAuto;
  // kAuto: the kernel below this mean coalesced request size (see kDefaultGatherBelowBytes).
  uint64_t gather_below_bytes = kDefaultGatherBelowBytes;
};

class CudaTransport final : public Transport {
 public:
  // kUnavailable without a device; kOutOfRange for a device ordinal that does not exist.
  static Result<std::unique_ptr<CudaTransport>> create(int device_ordinal = 0,
                                                       CudaTransportOptions options = {});
  ~CudaTransport() override;
  CudaTransport(const CudaTransport&) = delete;
  CudaTransport& operator=(const CudaTransport&) = delete;

  std::string_view name() const override { return "cuda"; }
  Capabilities capabilities() const override;
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;

  // The method a prepared transfer resolved to (kDma or kGatherKernel).
  Result<CopyMethod> method_of(const TransferHandle& handle);
  // Transfers posted after this call start after the work enqueued on `producer` so far.
  Status order_after(cudaStream_t producer);
  // `consumer` waits (on the device) until the posted transfer is complete.
  Status make_stream_wait(const TransferHandle& handle, cudaStream_t consumer);

  cudaStream_t stream() const { return stream_.get(); }
  int device_ordinal() const { return device_; }
  const CudaTransportOptions& options() const { return options_; }

 private:
  struct TierAddress {
    uint64_t host = 0;    // base as registered
    uint64_t device = 0;  // device-visible base; 0 when the kernel cannot reach the tier
    bool on_device = false;
  };
  struct Op {
    TransferPlan plan;
    bool posting = false;  // post() is enqueueing outside the lock
    bool posted = false;
    bool has_event = false;
    Status error;  // terminal failure
    CudaEvent done;
    DeviceBuffer<uint8_t> pieces;  // the kernel's piece list (from pieces_pool_)
  };

  CudaTransport(int device, CudaTransportOptions options, CudaStream stream);
  Result<Op*> find(const TransferHandle& handle);                  // mu_ held
  Result<CudaEvent> take_event();                                  // mu_ held
  Result<DeviceBuffer<uint8_t>> take_pieces_buffer(size_t bytes);  // mu_ held
  void recycle(Op& op);                                            // mu_ held; op is complete
  Status enqueue(Op& op);  // no lock; the op is owned by the posting thread

  const int device_;
  const CudaTransportOptions options_;
  CudaStream stream_;

  std::mutex mu_;  // guards everything below
  transport::TierTable tiers_;
  std::unordered_map<TierId, TierAddress> addresses_;
  std::unordered_map<uint64_t, std::unique_ptr<Op>> ops_;
  uint64_t next_id_ = 1;
  StagingRing staging_;
  std::vector<CudaEvent> event_pool_;
  std::vector<DeviceBuffer<uint8_t>> pieces_pool_;
};

}  // namespace specontext::gpu
