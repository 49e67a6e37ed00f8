// Turns CUDA runtime / cuBLAS error codes into Status. All checks share one generic macro,
// SPX_GPU_CHECK(to_status, expr): to_status(value, "expr text", source_location) -> Status, and
// an early `return` of the failed Status (works in functions returning Status or Result<T>).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <source_location>

#include "core/base/status.h"

namespace specontext::gpu {

// OK for cudaSuccess. Otherwise a Status whose message names the expression, the CUDA error
// name and string, and file:line. Also clears the runtime's last-error slot (cudaGetLastError)
// so a later check does not report the same failure twice; sticky errors (a faulted context)
// cannot be cleared and keep failing every call, which is what we want.
Status cuda_status(cudaError_t err, const char* expr,
                   std::source_location where = std::source_location::current());
Status cublas_status(cublasStatus_t st, const char* expr,
                     std::source_location where = std::source_location::current());

// For the completion queries (cudaEventQuery, cudaStreamQuery). cudaErrorNotReady means "still
// running", not a failure: kInProgress, and the runtime's last-error slot, which the query set,
// is cleared, so that no later check takes it for its own failure (a launcher's cudaGetLastError,
// CUB's cudaPeekAtLastError, cuBLAS; PyTorch clears it the same way after cudaStreamQuery).
// cudaSuccess: OK. Anything else: cuda_status. Only this function maps an error to kInProgress;
// cuda_status never does (a launch that fails is a failure, never "in progress").
Status query_status(cudaError_t err, const char* expr,
                    std::source_location where = std::source_location::current());

// For destructors and other places that cannot return: prints a failed Status to stderr.
void log_error(const Status& status, const char* what) noexcept;

// "dir/file.cc:123" (the last two path components keep messages short but unambiguous).
std::string short_location(std::source_location where);

}  // namespace specontext::gpu

#define SPX_GPU_CHECK(to_status, expr)                                                  \
  do {                                                                                  \
    ::specontext::Status spx_gpu_status_ =                                              \
        to_status((expr), #expr, std::source_location::current());                      \
    if (!spx_gpu_status_.is_ok()) return spx_gpu_status_;                               \
  } while (0)

#define SPX_CUDA_CHECK(expr) SPX_GPU_CHECK(::specontext::gpu::cuda_status, expr)
#define SPX_CUBLAS_CHECK(expr) SPX_GPU_CHECK(::specontext::gpu::cublas_status, expr)
