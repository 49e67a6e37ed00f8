#include "gpu/cuda_check.h"

#include <cstdio>
#include <string>
#include <string_view>

#include "gpu/cublas_loader.h"

namespace specontext::gpu {

std::string short_location(std::source_location where) {
  std::string_view file = where.file_name();
  size_t cut = file.rfind('/');
  if (cut != std::string_view::npos && cut > 0) {
    const size_t parent = file.rfind('/', cut - 1);
    if (parent != std::string_view::npos) file.remove_prefix(parent + 1);
  }
  return std::string(file) + ":" + std::to_string(where.line());
}

namespace {

StatusCode cuda_code(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
    case cudaErrorCudartUnloading:
      return StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return StatusCode::kInvalidArgument;
    // cudaErrorNotReady reaches here only from a call that is not a query (query_status handles
    // those): a failure like any other, never kInProgress, or a caller would wait for a
    // completion that cannot come.
    default:
      return StatusCode::kInternal;
  }
}

StatusCode cublas_code(cublasStatus_t st) {
  switch (st) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return StatusCode::kResourceExhausted;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return StatusCode::kUnimplemented;
    case CUBLAS_STATUS_INVALID_VALUE:
      return StatusCode::kInvalidArgument;
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return StatusCode::kUnavailable;
    default:
      return StatusCode::kInternal;
  }
}

}  // namespace

Status cuda_status(cudaError_t err, const char* expr, std::source_location where) {
  if (err == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();  // reset the non-sticky error so it is reported once
  std::string msg = std::string(expr) + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ") at " + short_location(where);
  return Status(cuda_code(err), std::move(msg), where);
}

Status query_status(cudaError_t err, const char* expr, std::source_location where) {
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // the query left "not ready" in the last-error slot
    return Status(StatusCode::kInProgress, std::string(expr) + ": not ready", where);
  }
  return cuda_status(err, expr, where);
}

Status cublas_status(cublasStatus_t st, const char* expr, std::source_location where) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  // A cuBLAS failure may hide an earlier asynchronous CUDA error; surface and clear it too.
  const cudaError_t pending = cudaGetLastError();
  // A status comes from a loaded cuBLAS (gpu/cublas_loader.h); its code alone if somehow not.
  const Result<const CublasApi*> api = cublas_api();
  std::string msg = std::string(expr) + " failed: " +
                    (api.is_ok() ? std::string((*api)->status_name(st)) + " (" + (*api)->status_string(st) + ")"
                                 : "cuBLAS status " + std::to_string(static_cast<int>(st)));
  if (pending != cudaSuccess) msg += std::string("; pending CUDA error ") + cudaGetErrorName(pending);
  msg += " at " + short_location(where);
  return Status(cublas_code(st), std::move(msg), where);
}

void log_error(const Status& status, const char* what) noexcept {
  if (status.is_ok()) return;
  std::fprintf(stderr, "specontext gpu: %s: %s\n", what, status.to_string().c_str());
}

}  // namespace specontext::gpu
