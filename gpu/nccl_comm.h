// RAII NCCL communicator and the collective wrappers the engine needs (all-reduce for tensor
// parallelism). Compiled only when the build found NCCL (SPECONTEXT_HAVE_NCCL); multi-GPU
// tests come with the tensor-parallel work.
#pragma once

#ifdef SPECONTEXT_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <source_location>
#include <span>
#include <utility>
#include <vector>

#include "core/base/status.h"
#include "gpu/cuda_check.h"

namespace specontext::gpu {

// OK for ncclSuccess; ncclInProgress (non-blocking communicators, an operation still being
// issued) maps to kInProgress, peer/network failures to kUnavailable.
Status nccl_status(ncclResult_t result, const char* expr,
                   std::source_location where = std::source_location::current());

// The id rank 0 creates and sends to the other ranks out of band (the cluster's transport).
Result<ncclUniqueId> nccl_unique_id();

class NcclComm {
 public:
  // Collective over all ranks: every rank must call it with the same id and n_ranks.
  // Sets `device` current for the calling thread (NCCL binds the communicator to it).
  static Result<NcclComm> create(int n_ranks, int rank, const ncclUniqueId& id, int device);
  // One process, several GPUs: rank i on devices[i], all created by one ncclCommInitAll, which
  // either creates every rank or none (it cleans up after a failed rank itself, where a group of
  // ncclCommInitRank calls missing a rank would wait at ncclGroupEnd for it). The caller's
  // current device is restored. Arguments are the caller's to check (distinct, valid ordinals).
  static Result<std::vector<NcclComm>> create_all(std::span<const int> devices);

  NcclComm() = default;
  ~NcclComm();
  NcclComm(NcclComm&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)),
        n_ranks_(other.n_ranks_),
        rank_(other.rank_),
        device_(other.device_) {}
  NcclComm& operator=(NcclComm&& other) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  bool empty() const { return comm_ == nullptr; }
  int n_ranks() const { return n_ranks_; }
  int rank() const { return rank_; }
  int device() const { return device_; }

  // recv = Σ over ranks of send (in place when send == recv), enqueued on `stream`.
  Status all_reduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                    ncclRedOp_t op, cudaStream_t stream);
  Status all_reduce_sum(const float* send, float* recv, size_t count, cudaStream_t stream) {
    return all_reduce(send, recv, count, ncclFloat32, ncclSum, stream);
  }

 private:
  NcclComm(ncclComm_t comm, int n_ranks, int rank, int device)
      : comm_(comm), n_ranks_(n_ranks), rank_(rank), device_(device) {}
  ncclComm_t comm_ = nullptr;
  int n_ranks_ = 0;
  int rank_ = -1;
  int device_ = -1;
};

}  // namespace specontext::gpu

#define SPX_NCCL_CHECK(expr) SPX_GPU_CHECK(::specontext::gpu::nccl_status, expr)

#endif  // SPECONTEXT_HAVE_NCCL
