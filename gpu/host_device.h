// SPX_HD marks functions that nvcc compiles for the host and the device and g++ for the host, so
// kernels and their host mirrors (tests) share one definition; plus the float <-> bits views they
// use. Plain C++; no core headers.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPX_HD __host__ __device__ __forceinline__
#else
#define SPX_HD inline
#endif

namespace specontext::gpu::kernels {

SPX_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b = 0;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

SPX_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x = 0.0f;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

}  // namespace specontext::gpu::kernels
