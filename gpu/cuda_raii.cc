#include "gpu/cuda_raii.h"

#include <cstdint>
#include <string>

namespace specontext::gpu {

namespace {

// Release failures during process teardown (the runtime already unloaded) are expected noise.
void log_release(cudaError_t err, const char* what) noexcept {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  if (err == cudaErrorCudartUnloading) return;
  log_error(cuda_status(err, what), "release failed");
}

}  // namespace

// ---- CudaStream ----

Result<CudaStream> CudaStream::create(unsigned flags, int priority) {
  cudaStream_t s = nullptr;
  SPX_CUDA_CHECK(cudaStreamCreateWithPriority(&s, flags, priority));
  return CudaStream(s);
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) log_release(cudaStreamDestroy(stream_), "cudaStreamDestroy");
}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) log_release(cudaStreamDestroy(stream_), "cudaStreamDestroy");
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Status CudaStream::synchronize() const {
  if (stream_ == nullptr) return internal_error("synchronize on an empty CudaStream");
  SPX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return Status::ok();
}

// ---- CudaEvent ----

Result<CudaEvent> CudaEvent::create(unsigned flags) {
  cudaEvent_t e = nullptr;
  SPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
  return CudaEvent(e);
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) log_release(cudaEventDestroy(event_), "cudaEventDestroy");
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) log_release(cudaEventDestroy(event_), "cudaEventDestroy");
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

Status CudaEvent::record(cudaStream_t stream) {
  if (event_ == nullptr) return internal_error("record on an empty CudaEvent");
  SPX_CUDA_CHECK(cudaEventRecord(event_, stream));
  return Status::ok();
}

Status CudaEvent::synchronize() const {
  if (event_ == nullptr) return internal_error("synchronize on an empty CudaEvent");
  SPX_CUDA_CHECK(cudaEventSynchronize(event_));
  return Status::ok();
}

Status CudaEvent::query() const {
  if (event_ == nullptr) return internal_error("query on an empty CudaEvent");
  return query_status(cudaEventQuery(event_), "cudaEventQuery");
}

Result<float> CudaEvent::elapsed_ms(const CudaEvent& start, const CudaEvent& end) {
  float ms = 0.0f;
  SPX_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

// ---- DeviceBuffer helpers ----

namespace detail {

Result<void*> device_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return resource_exhausted("cudaMalloc of " + std::to_string(bytes) +
                              " bytes: out of device memory");
  }
  SPX_CUDA_CHECK(err);
  return p;
}

void device_free(void* ptr) noexcept {
  if (ptr != nullptr) log_release(cudaFree(ptr), "cudaFree");
}

}  // namespace detail

// ---- PinnedHostBuffer ----

Result<PinnedHostBuffer> PinnedHostBuffer::create(size_t bytes, unsigned flags) {
  if (bytes == 0) return PinnedHostBuffer();
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, flags);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return resource_exhausted("cudaHostAlloc of " + std::to_string(bytes) +
                              " bytes: out of pinned host memory");
  }
  SPX_CUDA_CHECK(err);
  return PinnedHostBuffer(p, bytes);
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (data_ != nullptr) log_release(cudaFreeHost(data_), "cudaFreeHost");
}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) log_release(cudaFreeHost(data_), "cudaFreeHost");
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

// ---- PinnedHostRegistration ----

Result<PinnedHostRegistration> PinnedHostRegistration::create(void* base, size_t bytes, unsigned flags) {
  if (base == nullptr || bytes == 0) {
    return invalid_argument("PinnedHostRegistration: null base or zero bytes");
  }
  const cudaError_t err = cudaHostRegister(base, bytes, flags);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    (void)cudaGetLastError();
    return invalid_argument("PinnedHostRegistration: [" + std::to_string(reinterpret_cast<uintptr_t>(base)) +
                            ", +" + std::to_string(bytes) + ") overlaps memory that is already page-locked");
  }
  SPX_CUDA_CHECK(err);
  PinnedHostRegistration reg(base, nullptr, bytes);  // unregisters on the error path below
  if ((flags & cudaHostRegisterMapped) != 0) {
    void* device = nullptr;
    SPX_CUDA_CHECK(cudaHostGetDevicePointer(&device, base, 0));
    reg.device_ = device;
  }
  return reg;
}

PinnedHostRegistration::~PinnedHostRegistration() {
  if (base_ != nullptr) log_release(cudaHostUnregister(base_), "cudaHostUnregister");
}

PinnedHostRegistration& PinnedHostRegistration::operator=(PinnedHostRegistration&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) log_release(cudaHostUnregister(base_), "cudaHostUnregister");
    base_ = std::exchange(other.base_, nullptr);
    device_ = std::exchange(other.device_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

// ---- ScopedDevice ----

ScopedDevice::ScopedDevice(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    (void)cudaGetLastError();
    previous_ = -1;
  }
  if (previous_ != device) {
    status_ = cuda_status(cudaSetDevice(device), "cudaSetDevice");
    changed_ = status_.is_ok() && previous_ >= 0;
  }
}

ScopedDevice::~ScopedDevice() {
  if (changed_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
}

// ---- CublasHandle ----

Result<CublasHandle> CublasHandle::create(cudaStream_t stream) {
  SPX_ASSIGN_OR_RETURN(const CublasApi* api, cublas_api());
  cublasHandle_t h = nullptr;
  SPX_CUBLAS_CHECK(api->create(&h));
  CublasHandle handle(h, api);  // owns h from here on, also on the error paths below
  SPX_CUBLAS_CHECK(api->set_stream(h, stream));
  return handle;
}

namespace {
void destroy_cublas(cublasHandle_t h, const CublasApi* api) noexcept {
  if (h == nullptr) return;
  const cublasStatus_t st = api->destroy(h);
  if (st != CUBLAS_STATUS_SUCCESS) log_error(cublas_status(st, "cublasDestroy"), "release failed");
}
}  // namespace

CublasHandle::~CublasHandle() { destroy_cublas(handle_, api_); }

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    destroy_cublas(handle_, api_);
    handle_ = std::exchange(other.handle_, nullptr);
    api_ = other.api_;
  }
  return *this;
}

}  // namespace specontext::gpu
