// Move-only owners of CUDA resources. Creation is fallible and goes through static
// create(...) returning Result; destructors never throw (a failed release is logged to stderr
// and ignored, since there is nobody to return it to). A default-constructed or moved-from
// object is empty and releases nothing.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "core/base/status.h"
#include "gpu/cublas_loader.h"
#include "gpu/cuda_check.h"

namespace specontext::gpu {

class CudaStream {
 public:
  // Non-blocking by default: no implicit ordering with the legacy default stream, so work of
  // other libraries on stream 0 never serialises ours (callers order explicitly via events).
  static Result<CudaStream> create(unsigned flags = cudaStreamNonBlocking, int priority = 0);

  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  // nullptr when empty. Note nullptr is also the legacy default stream: check empty() first.
  cudaStream_t get() const { return stream_; }
  bool empty() const { return stream_ == nullptr; }
  Status synchronize() const;

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  // Timing off by default: such events are cheaper to record and to wait on.
  static Result<CudaEvent> create(unsigned flags = cudaEventDisableTiming);

  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  bool empty() const { return event_ == nullptr; }
  Status record(cudaStream_t stream);
  Status synchronize() const;
  // OK when all work before the record has finished, kInProgress while it is still pending
  // (query_status: the "not ready" is not left in the runtime's last-error slot).
  Status query() const;
  // Milliseconds between two recorded timing events (both created without DisableTiming).
  static Result<float> elapsed_ms(const CudaEvent& start, const CudaEvent& end);

 private:
  explicit CudaEvent(cudaEvent_t e) : event_(e) {}
  cudaEvent_t event_ = nullptr;
};

namespace detail {
Result<void*> device_alloc(size_t bytes);
void device_free(void* ptr) noexcept;
}  // namespace detail

// `count` elements of T in device memory of the current device (cudaMalloc, so at least 256-byte
// aligned). Contents are uninitialised.
template <typename T>
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> create(size_t count) {
    if (count == 0) return DeviceBuffer();
    SPX_ASSIGN_OR_RETURN(void* p, detail::device_alloc(count * sizeof(T)));
    return DeviceBuffer(static_cast<T*>(p), count);
  }

  DeviceBuffer() = default;
  ~DeviceBuffer() { detail::device_free(data_); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      detail::device_free(data_);
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return data_ == nullptr; }

  // Stream-ordered copies of the first n elements. Host memory may be pageable; see
  // gpu/README.md for what that means for asynchrony.
  Status upload(const T* host, size_t n, cudaStream_t stream) {
    if (n > count_) return out_of_range("DeviceBuffer::upload beyond the buffer");
    SPX_CUDA_CHECK(cudaMemcpyAsync(data_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    return Status::ok();
  }
  Status download(T* host, size_t n, cudaStream_t stream) const {
    if (n > count_) return out_of_range("DeviceBuffer::download beyond the buffer");
    SPX_CUDA_CHECK(cudaMemcpyAsync(host, data_, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    return Status::ok();
  }

 private:
  DeviceBuffer(T* p, size_t n) : data_(p), count_(n) {}
  T* data_ = nullptr;
  size_t count_ = 0;
};

// Page-locked host memory (cudaHostAlloc): the only host memory a copy engine reads or writes
// truly asynchronously.
class PinnedHostBuffer {
 public:
  static Result<PinnedHostBuffer> create(size_t bytes, unsigned flags = cudaHostAllocDefault);

  PinnedHostBuffer() = default;
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }

 private:
  PinnedHostBuffer(void* p, size_t n) : data_(p), bytes_(n) {}
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locks an existing host range [base, base + bytes) that someone else allocated (the engine's
// NUMA host pools), with cudaHostRegister, and unlocks it (cudaHostUnregister) on destruction.
// Default flags: Portable (pinned for every CUDA context, not only the current device's) and
// Mapped (the GPU can address the range directly: device_pointer()), which the transport's gather
// kernel needs. Move-only; the range itself is not owned and must outlive the registration.
// Errors: kInvalidArgument for a null / empty range or a range that is already registered
// (cudaErrorHostMemoryAlreadyRegistered), kUnavailable without a device, other CUDA errors as
// cuda_status maps them.
class PinnedHostRegistration {
 public:
  static constexpr unsigned kDefaultFlags = cudaHostRegisterPortable | cudaHostRegisterMapped;
  static Result<PinnedHostRegistration> create(void* base, size_t bytes, unsigned flags = kDefaultFlags);

  PinnedHostRegistration() = default;
  ~PinnedHostRegistration();
  PinnedHostRegistration(PinnedHostRegistration&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)),
        device_(std::exchange(other.device_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  PinnedHostRegistration& operator=(PinnedHostRegistration&& other) noexcept;
  PinnedHostRegistration(const PinnedHostRegistration&) = delete;
  PinnedHostRegistration& operator=(const PinnedHostRegistration&) = delete;

  void* host() const { return base_; }
  // The address kernels use for host(); nullptr when registered without cudaHostRegisterMapped.
  void* device_pointer() const { return device_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return base_ == nullptr; }

 private:
  PinnedHostRegistration(void* base, void* device, size_t bytes) : base_(base), device_(device), bytes_(bytes) {}
  void* base_ = nullptr;
  void* device_ = nullptr;
  size_t bytes_ = 0;
};

// Makes `device` current for one scope and restores the caller's device afterwards, so that a
// thread driving several GPUs keeps its own notion of the current one. status() reports a failed
// cudaSetDevice; the destructor never fails (a failed restore is cleared and ignored).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  bool changed_ = false;
  Status status_;
};

class CublasHandle {
 public:
  // A handle bound to `stream` (every call made with it is ordered on that stream).
  static Result<CublasHandle> create(cudaStream_t stream);

  CublasHandle() = default;
  ~CublasHandle();
  CublasHandle(CublasHandle&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), api_(other.api_) {}
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t get() const { return handle_; }
  bool empty() const { return handle_ == nullptr; }
  // The loaded cuBLAS functions (gpu/cublas_loader.h); valid while the handle is not empty.
  const CublasApi& api() const { return *api_; }

 private:
  CublasHandle(cublasHandle_t h, const CublasApi* api) : handle_(h), api_(api) {}
  cublasHandle_t handle_ = nullptr;
  const CublasApi* api_ = nullptr;
};

}  // namespace specontext::gpu
