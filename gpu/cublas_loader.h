// cuBLAS opened with dlopen on first use instead of linked. Linking libcublas.so makes every
// process of a CUDA build load it and the 540 MB libcublasLt.so it needs: about 0.3 s at each
// start (measured: 0.32 s for the dlopen alone), paid by CPU-only runs, `kv-node` processes and
// every CLI call, and a binary that cannot start where cuBLAS is missing. Loaded here, cuBLAS
// costs only the processes that create a CUDA backend, and its absence is a Status
// ("no cuBLAS") that sends the engine to the CPU backend like a missing device does.
#pragma once

#include <cublas_v2.h>

#include "core/base/status.h"

namespace specontext::gpu {

// The cuBLAS entry points the backend uses (the _v2 symbols the cublas_v2.h macros name).
struct CublasApi {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  decltype(&::cublasSetStream_v2) set_stream = nullptr;
  decltype(&::cublasSetMathMode) set_math_mode = nullptr;
  decltype(&::cublasSetPointerMode_v2) set_pointer_mode = nullptr;
  // The exported cublasGemmEx (C++ also sees an inline overload taking a cudaDataType compute type).
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                    const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                                    int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                                    cublasGemmAlgo_t);
  GemmEx gemm_ex = nullptr;
  decltype(&::cublasGetStatusName) status_name = nullptr;
  decltype(&::cublasGetStatusString) status_string = nullptr;
};

// Opens libcublas.so.<CUBLAS_VER_MAJOR> once per process (thread-safe; the library stays loaded):
// by soname first (LD_LIBRARY_PATH, the ld.so cache), then in the toolkit's library directory
// found at build time. kUnavailable naming the library and dlerror() when it cannot be opened or
// lacks a symbol; the same answer on every later call.
[[nodiscard]] Result<const CublasApi*> cublas_api();

}  // namespace specontext::gpu
