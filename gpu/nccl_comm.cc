#include "gpu/nccl_comm.h"

#ifdef SPECONTEXT_HAVE_NCCL

#include <string>

namespace specontext::gpu {

namespace {

StatusCode nccl_code(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    case ncclSystemError:
    case ncclRemoteError:
      return StatusCode::kUnavailable;  // a peer or the network went away
    case ncclInProgress:
      return StatusCode::kInProgress;
    default:
      return StatusCode::kInternal;
  }
}

void destroy_comm(ncclComm_t comm) noexcept {
  if (comm == nullptr) return;
  const ncclResult_t r = ncclCommDestroy(comm);
  if (r != ncclSuccess) log_error(nccl_status(r, "ncclCommDestroy"), "release failed");
}

}  // namespace

Status nccl_status(ncclResult_t result, const char* expr, std::source_location where) {
  if (result == ncclSuccess) return Status::ok();
  std::string msg = std::string(expr) + " failed: " + ncclGetErrorString(result);
  if (result == ncclUnhandledCudaError) {
    const cudaError_t err = cudaGetLastError();  // NCCL leaves the CUDA error behind; clear it
    if (err != cudaSuccess) msg += std::string(" (CUDA ") + cudaGetErrorName(err) + ")";
  }
  msg += " at " + short_location(where);
  return Status(nccl_code(result), std::move(msg), where);
}

Result<ncclUniqueId> nccl_unique_id() {
  ncclUniqueId id;
  SPX_NCCL_CHECK(ncclGetUniqueId(&id));
  return id;
}

Result<NcclComm> NcclComm::create(int n_ranks, int rank, const ncclUniqueId& id, int device) {
  if (n_ranks <= 0 || rank < 0 || rank >= n_ranks) {
    return invalid_argument("NcclComm: rank " + std::to_string(rank) + " of " +
                            std::to_string(n_ranks));
  }
  SPX_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  SPX_NCCL_CHECK(ncclCommInitRank(&comm, n_ranks, id, rank));
  return NcclComm(comm, n_ranks, rank, device);
}

Result<std::vector<NcclComm>> NcclComm::create_all(std::span<const int> devices) {
  if (devices.empty()) return invalid_argument("NcclComm::create_all: no devices");
  const int n = static_cast<int>(devices.size());
  int previous = 0;
  SPX_CUDA_CHECK(cudaGetDevice(&previous));
  std::vector<ncclComm_t> raw(devices.size(), nullptr);
  const ncclResult_t r = ncclCommInitAll(raw.data(), n, devices.data());
  const cudaError_t restore = cudaSetDevice(previous);
  SPX_NCCL_CHECK(r);
  std::vector<NcclComm> comms;
  comms.reserve(devices.size());
  for (int i = 0; i < n; ++i) comms.push_back(NcclComm(raw[static_cast<size_t>(i)], n, i, devices[static_cast<size_t>(i)]));
  SPX_CUDA_CHECK(restore);  // the communicators are owned above and destroyed on this path
  return comms;
}

NcclComm::~NcclComm() { destroy_comm(comm_); }

NcclComm& NcclComm::operator=(NcclComm&& other) noexcept {
  if (this != &other) {
    destroy_comm(comm_);
    comm_ = std::exchange(other.comm_, nullptr);
    n_ranks_ = other.n_ranks_;
    rank_ = other.rank_;
    device_ = other.device_;
  }
  return *this;
}

Status NcclComm::all_reduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                            ncclRedOp_t op, cudaStream_t stream) {
  if (comm_ == nullptr) return internal_error("all_reduce on an empty NcclComm");
  SPX_NCCL_CHECK(ncclAllReduce(send, recv, count, type, op, comm_, stream));
  return Status::ok();
}

}  // namespace specontext::gpu

#endif  // SPECONTEXT_HAVE_NCCL
