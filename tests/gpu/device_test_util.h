// Helpers of the device tests (tests/gpu/cuda_*_test.cc): the fixture holding a CUDA backend and
// the CPU reference backend, device buffers between sentinel guard regions, random inputs, and the
// relative-L2 comparison with its NaN/inf and non-zero checks. Infrastructure failures (not the
// code under test) abort loudly.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/ports/backend.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"

namespace specontext::gpu::device_test {

// Test infrastructure failures (not the code under test) abort loudly.
inline void cuda_or_die(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(err));
  std::abort();
}

// A fixture with the CUDA backend of device 0 (gpu_) and the CPU reference backend (ref_); every
// case skips without a device ("no CUDA device"). A fixture deriving from it that overrides SetUp
// calls BackendTest::SetUp() first and returns if IsSkipped() or HasFatalFailure().
class BackendTest : public ::testing::Test {
 public:
  // Waits for the GPU's queued work and checks it ran without a fault.
  void sync() {
    const Status s = gpu_->synchronize();
    ASSERT_TRUE(s.is_ok()) << "device fault: " << s.to_string();
  }

 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    auto gpu = CudaBackend::create(0);
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    gpu_ = std::move(gpu).value();
    auto ref = cpu::create_cpu_backend(cpu::CpuBackendOptions{.reference = true});
    ASSERT_TRUE(ref.is_ok()) << ref.status().to_string();
    ref_ = std::move(ref).value();
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> ref_;
};

// n elements of T in device memory with kGuard elements of sentinel bytes on each side.
template <typename T>
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kSentinel = 0xA5;

  explicit Guarded(size_t n) : n_(n) {
    cuda_or_die(cudaMalloc(&base_, total_bytes()), "cudaMalloc");
    cuda_or_die(cudaMemset(base_, kSentinel, total_bytes()), "cudaMemset");
    cuda_or_die(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  explicit Guarded(const std::vector<T>& host) : Guarded(host.size()) { upload(host); }
  ~Guarded() { cudaFree(base_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;

  T* data() { return base_ + kGuard; }
  size_t size() const { return n_; }

  void upload(const std::vector<T>& host) {
    if (host.size() != n_) std::abort();
    cuda_or_die(cudaMemcpy(data(), host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
    // A pageable H2D cudaMemcpy may return before the DMA lands; the backend's stream is
    // non-blocking, so make the data visible to it explicitly.
    cuda_or_die(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    cuda_or_die(cudaMemcpy(host.data(), base_ + kGuard, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  bool guards_intact() const {
    std::vector<uint8_t> bytes(total_bytes());
    cuda_or_die(cudaMemcpy(bytes.data(), base_, bytes.size(), cudaMemcpyDeviceToHost), "download");
    const size_t guard_bytes = kGuard * sizeof(T);
    for (size_t i = 0; i < guard_bytes; ++i) {
      if (bytes[i] != kSentinel || bytes[bytes.size() - 1 - i] != kSentinel) return false;
    }
    return true;
  }

 private:
  size_t total_bytes() const { return (n_ + 2 * kGuard) * sizeof(T); }
  size_t n_;
  T* base_ = nullptr;
};

inline std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline int64_t pick(std::mt19937& rng, std::initializer_list<int64_t> choices) {
  std::uniform_int_distribution<size_t> dist(0, choices.size() - 1);
  return *(choices.begin() + dist(rng));
}

inline int64_t uniform(std::mt19937& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Relative L2 error of `got` against `want`, with the checks that make it meaningful.
inline ::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want,
                                        double tolerance) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  double num = 0.0;
  double den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      return ::testing::AssertionFailure() << "non-finite output " << got[i] << " at " << i;
    }
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (!(den > 0.0)) return ::testing::AssertionFailure() << "reference is all zero";
  const double rel = std::sqrt(num / den);
  if (rel > tolerance) {
    size_t worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::fabs(got[i] - want[i]) > std::fabs(got[worst] - want[worst])) worst = i;
    }
    return ::testing::AssertionFailure() << "rel L2 " << rel << " > " << tolerance << "; worst at " << worst
                                         << ": " << got[worst] << " vs " << want[worst];
  }
  return ::testing::AssertionSuccess() << "rel L2 " << rel;
}

// The inputs and outputs of a failed case, written to <gtest TempDir>/<case>.txt (one named array
// per line) so that the failure can be replayed off the device. write() returns the path.
class CaseDump {
 public:
  explicit CaseDump(std::string name) : name_(std::move(name)) {}
  template <typename T>
  CaseDump& add(const char* what, const std::vector<T>& values) {
    std::ostringstream line;
    line.precision(9);  // round-trips a float
    line << what << ":";
    for (const T& v : values) line << " " << v;
    text_ += line.str() + "\n";
    return *this;
  }
  std::string write() const {
    std::string file = name_;
    for (char& c : file) {
      if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    }
    const std::string path = ::testing::TempDir() + file + ".txt";
    std::ofstream(path) << text_;
    return path;
  }

 private:
  std::string name_;
  std::string text_;
};

}  // namespace specontext::gpu::device_test
