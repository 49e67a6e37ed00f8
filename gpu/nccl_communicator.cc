#include "gpu/nccl_communicator.h"

#ifdef SPECONTEXT_HAVE_NCCL

#include <algorithm>
#include <string>
#include <utility>

#include "gpu/cuda_backend.h"

namespace specontext::gpu {

namespace {

// Makes `device` current and restores the caller's device on scope exit.
class DeviceGuard {
 public:
  static Result<DeviceGuard> enter(int device) {
    int previous = 0;
    SPX_CUDA_CHECK(cudaGetDevice(&previous));
    SPX_CUDA_CHECK(cudaSetDevice(device));
    return DeviceGuard(previous);
  }
  DeviceGuard(DeviceGuard&& o) noexcept : previous_(std::exchange(o.previous_, -1)) {}
  DeviceGuard& operator=(DeviceGuard&&) = delete;
  ~DeviceGuard() {
    if (previous_ >= 0) {
      const cudaError_t err = cudaSetDevice(previous_);
      if (err != cudaSuccess) log_error(cuda_status(err, "cudaSetDevice"), "restoring the caller's device");
    }
  }

 private:
  explicit DeviceGuard(int previous) : previous_(previous) {}
  int previous_;
};

}  // namespace

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(NcclComm comm, cudaStream_t stream) {
  if (comm.empty()) return invalid_argument("NcclCommunicator: the NcclComm is empty");
  if (stream == nullptr) {
    // The legacy default stream would serialise with every other stream of the device.
    return invalid_argument("NcclCommunicator: a compute stream is required (got the default stream)");
  }
#if CUDART_VERSION >= 12080  // cudaStreamGetDevice appeared in CUDA 12.8
  int stream_device = -1;
  SPX_CUDA_CHECK(cudaStreamGetDevice(stream, &stream_device));
  if (stream_device != comm.device()) {
    return invalid_argument("NcclCommunicator: the stream belongs to device " +
                            std::to_string(stream_device) + ", the communicator to device " +
                            std::to_string(comm.device()));
  }
#endif
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(comm), stream));
}

Status NcclCommunicator::all_reduce_sum(float* data, int64_t count) {
  if (!failure_.is_ok()) {
    return Status(failure_.code(), "NCCL communicator failed earlier: " + failure_.message());
  }
  if (count < 0) return invalid_argument("all_reduce_sum: count = " + std::to_string(count) + " is negative");
  if (count == 0) return Status::ok();
  if (data == nullptr)
    return invalid_argument("all_reduce_sum: null buffer with count " + std::to_string(count));
  SPX_ASSIGN_OR_RETURN(DeviceGuard guard, DeviceGuard::enter(comm_.device()));
  Status st = comm_.all_reduce_sum(data, data, static_cast<size_t>(count), stream_);
  if (!st.is_ok()) failure_ = st;
  return st;
}

Status NcclCommunicator::check_async_error() {
  if (!failure_.is_ok()) return failure_;
  ncclResult_t async = ncclSuccess;
  SPX_NCCL_CHECK(ncclCommGetAsyncError(comm_.get(), &async));
  Status st = nccl_status(async, "ncclCommGetAsyncError (asynchronous communicator error)");
  if (!st.is_ok() && st.code() != StatusCode::kInProgress) failure_ = st;
  return st;
}

Result<std::vector<std::unique_ptr<NcclCommunicator>>> create_nccl_communicators(
    std::span<const int> devices, std::span<const cudaStream_t> streams) {
  if (devices.empty()) return invalid_argument("create_nccl_communicators: no devices");
  if (devices.size() != streams.size()) {
    return invalid_argument("create_nccl_communicators: " + std::to_string(devices.size()) + " devices but " +
                            std::to_string(streams.size()) + " streams");
  }
  SPX_ASSIGN_OR_RETURN(const int n_devices, cuda_device_count());
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= n_devices) {
      return invalid_argument("create_nccl_communicators: devices[" + std::to_string(i) +
                              "] = " + std::to_string(devices[i]) + " is outside [0, " +
                              std::to_string(n_devices) + ")");
    }
    if (std::count(devices.begin(), devices.end(), devices[i]) > 1) {
      return invalid_argument("create_nccl_communicators: device " + std::to_string(devices[i]) +
                              " is listed twice (NCCL takes one rank per GPU)");
    }
  }
  const int n = static_cast<int>(devices.size());
  // One ncclCommInitAll: all ranks or none. A group of per-rank inits that stopped at a failing
  // rank would leave the ranks already queued waiting at ncclGroupEnd for the missing one.
  SPX_ASSIGN_OR_RETURN(std::vector<NcclComm> comms, NcclComm::create_all(devices));
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int i = 0; i < n; ++i) {
    SPX_ASSIGN_OR_RETURN(auto c, NcclCommunicator::create(std::move(comms[static_cast<size_t>(i)]),
                                                          streams[static_cast<size_t>(i)]));
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace specontext::gpu

#endif  // SPECONTEXT_HAVE_NCCL
