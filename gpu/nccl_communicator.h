// The Communicator (core/ports/communicator.h) of tensor-parallel ranks that are GPUs: NCCL
// all-reduce over an NcclComm (gpu/nccl_comm.h), enqueued in place on the rank's compute stream
// (gpu::CudaBackend::stream()) so it is ordered after the matmul that produced the partial and
// before the residual add that consumes it. Compiled only with SPECONTEXT_HAVE_NCCL.
//
// Contract, and where it differs from the interface's:
// - all_reduce_sum returns once the reduction is ENQUEUED; "complete" means complete in stream
//   order (every later op on the stream sees the sum). data is device memory of the
//   communicator's device.
// - NCCL cannot see the other ranks' counts: mismatched counts are the caller's bug (NCCL
//   corrupts or stalls), not a kInvalidArgument. The engine passes [tokens, dim] on every rank.
// - A peer that never joins stalls the stream on the device, not the host call; the host sees
//   it at the next synchronisation. check_async_error() reports a communicator NCCL has marked
//   failed (ncclCommGetAsyncError). No timeout or abort is implemented here (NcclComm has no
//   ncclCommAbort path yet).
// - After an NCCL error every later call returns that error at once.
// Threads: one thread at a time per communicator. Several communicators of one process (one per
// GPU) are used each from its own thread: NCCL requires a single thread that drives several of
// them to wrap the calls in ncclGroupStart/End, which this interface does not do.
#pragma once

#ifdef SPECONTEXT_HAVE_NCCL

#include <cuda_runtime.h>

#include <memory>
#include <span>
#include <vector>

#include "core/base/status.h"
#include "core/ports/communicator.h"
#include "gpu/nccl_comm.h"

namespace specontext::gpu {

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`; `stream` (not owned) must belong to comm.device() and outlive
  // the communicator.
  static Result<std::unique_ptr<NcclCommunicator>> create(NcclComm comm, cudaStream_t stream);

  int rank() const override { return comm_.rank(); }
  int world_size() const override { return comm_.n_ranks(); }
  // In place on the stream; count 0 enqueues nothing. Makes the device current for the call and
  // restores the caller's device.
  Status all_reduce_sum(float* data, int64_t count) override;
  // OK, or the failure NCCL recorded for the communicator (peer or network gone).
  Status check_async_error();

  int device() const { return comm_.device(); }
  cudaStream_t stream() const { return stream_; }

 private:
  NcclCommunicator(NcclComm comm, cudaStream_t stream) : comm_(std::move(comm)), stream_(stream) {}
  NcclComm comm_;
  cudaStream_t stream_;
  Status failure_;
};

// One process driving several GPUs: one communicator per device, rank i on devices[i], its
// collectives on streams[i]. The ranks are created by one ncclCommInitAll (NcclComm::create_all):
// every rank or none, so a rank that fails cannot leave the others blocked.
// Errors: empty or mismatched spans, a device outside [0, device count), a device listed twice
// (NCCL allows one rank per GPU): kInvalidArgument; no device: kUnavailable.
Result<std::vector<std::unique_ptr<NcclCommunicator>>> create_nccl_communicators(
    std::span<const int> devices, std::span<const cudaStream_t> streams);

}  // namespace specontext::gpu

#endif  // SPECONTEXT_HAVE_NCCL
