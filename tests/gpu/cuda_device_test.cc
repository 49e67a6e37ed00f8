// Device discovery, error conversion and RAII owners of the CUDA backend. The first group runs
// on every machine (CI has no GPU: it checks that absence is reported, not crashed on); the
// fixture group needs a device and skips with "no CUDA device" otherwise.
#include <gtest/gtest.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu/cuda_backend.h"
#include "gpu/cublas_loader.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_raii.h"
#ifdef SPECONTEXT_HAVE_NCCL
#include "gpu/nccl_comm.h"
#endif

namespace specontext::gpu {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Runs everywhere.

// cuBLAS is opened on first use, not linked (gpu/cublas_loader.h): a process that never creates
// a CUDA backend never pays for loading it. Kept first in this file, so that in a run of the whole
// binary no earlier test has loaded it (ctest runs each test in a process of its own).
TEST(CublasLoader, NotLoadedUntilFirstUseThenEveryEntryPointResolves) {
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  EXPECT_EQ(dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr) << soname << " is loaded at start";
  auto api = cublas_api();
  ASSERT_TRUE(api.is_ok()) << api.status().to_string();
  const CublasApi& a = **api;
  EXPECT_TRUE(a.create && a.destroy && a.set_stream && a.set_math_mode && a.set_pointer_mode && a.gemm_ex &&
              a.status_name && a.status_string);
  EXPECT_STREQ(a.status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  void* loaded = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(loaded, nullptr);
  if (loaded != nullptr) dlclose(loaded);  // drops only the reference NOLOAD took
  auto again = cublas_api();
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *api);  // opened once per process
}

TEST(CudaDiscovery, CreateWithoutDeviceIsUnavailable) {
  if (cuda_device_available()) {
    auto backend = create_cuda_backend(0);
    ASSERT_TRUE(backend.is_ok()) << backend.status().to_string();
    EXPECT_EQ((*backend)->name(), "cuda");
    auto count = cuda_device_count();
    ASSERT_TRUE(count.is_ok());
    auto beyond = create_cuda_backend(*count);
    EXPECT_EQ(beyond.status().code(), StatusCode::kOutOfRange) << beyond.status().to_string();
    return;
  }
  auto backend = create_cuda_backend();
  ASSERT_FALSE(backend.is_ok());
  EXPECT_EQ(backend.status().code(), StatusCode::kUnavailable) << backend.status().to_string();
  EXPECT_TRUE(contains(backend.status().message(), "no CUDA device")) << backend.status().message();
  // Asking again must give the same answer (nothing half-initialised stays behind).
  auto again = CudaBackend::create(0);
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(cuda_device_count().is_ok());
}

TEST(CudaDiscovery, AllocationWithoutDeviceFailsCleanly) {
  if (cuda_device_available()) GTEST_SKIP() << "a CUDA device is present";
  auto buffer = DeviceBuffer<float>::create(16);
  ASSERT_FALSE(buffer.is_ok());
  EXPECT_NE(buffer.status().code(), StatusCode::kOk);
  auto stream = CudaStream::create();
  EXPECT_FALSE(stream.is_ok());
}

TEST(CudaCheck, SuccessIsOk) {
  EXPECT_TRUE(cuda_status(cudaSuccess, "x").is_ok());
  EXPECT_TRUE(cublas_status(CUBLAS_STATUS_SUCCESS, "x").is_ok());
}

TEST(CudaCheck, CudaErrorBecomesStatusWithExpressionAndLocation) {
  const Status s = cuda_status(cudaErrorMemoryAllocation, "cudaMalloc(&p, n)");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(contains(s.message(), "cudaMalloc(&p, n)")) << s.message();
  EXPECT_TRUE(contains(s.message(), "cudaErrorMemoryAllocation")) << s.message();
  EXPECT_TRUE(contains(s.message(), "cuda_device_test.cc:")) << s.message();
  EXPECT_EQ(cuda_status(cudaErrorNoDevice, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(cuda_status(cudaErrorInvalidValue, "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_status(cudaErrorLaunchFailure, "x").code(), StatusCode::kInternal);
}

// "Not ready" is in progress only as the answer of a completion query; from any other call (a
// launch, a copy) it is a failure, so that a transfer that stored it as its error cannot be
// polled forever. query_status also clears the last-error slot (shown on a device in
// cuda_pending_work_test.cc: without a driver every error is the sticky "insufficient driver").
TEST(CudaCheck, NotReadyIsInProgressOnlyForQueries) {
  const Status pending = query_status(cudaErrorNotReady, "cudaEventQuery(done)");
  EXPECT_EQ(pending.code(), StatusCode::kInProgress);
  EXPECT_TRUE(contains(pending.message(), "cudaEventQuery(done)")) << pending.message();
  EXPECT_TRUE(query_status(cudaSuccess, "x").is_ok());
  EXPECT_EQ(query_status(cudaErrorLaunchFailure, "x").code(), StatusCode::kInternal);
  EXPECT_EQ(query_status(cudaErrorInvalidValue, "x").code(), StatusCode::kInvalidArgument);
  const Status launch = cuda_status(cudaErrorNotReady, "launch_add");
  EXPECT_FALSE(launch.is_ok());
  EXPECT_NE(launch.code(), StatusCode::kInProgress) << launch.to_string();
  EXPECT_TRUE(contains(launch.message(), "cudaErrorNotReady")) << launch.message();
}

Status fails_then_would_continue(bool* reached_end) {
  SPX_CUDA_CHECK(cudaErrorInvalidValue);
  *reached_end = true;
  return Status::ok();
}

Result<int> cublas_fails() {
  SPX_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED);
  return 1;
}

TEST(CudaCheck, MacrosReturnEarly) {
  bool reached_end = false;
  const Status s = fails_then_would_continue(&reached_end);
  EXPECT_FALSE(reached_end);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "cudaErrorInvalidValue")) << s.message();

  auto r = cublas_fails();
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(contains(r.status().message(), "CUBLAS_STATUS_NOT_SUPPORTED")) << r.status().message();
}

TEST(CudaRaii, EmptyOwnersReleaseNothing) {
  DeviceBuffer<float> buffer;
  EXPECT_TRUE(buffer.empty());
  EXPECT_EQ(buffer.size(), 0u);
  auto zero = DeviceBuffer<float>::create(0);  // no CUDA call for zero elements
  ASSERT_TRUE(zero.is_ok());
  EXPECT_TRUE(zero->empty());
  DeviceBuffer<float> moved = std::move(*zero);
  EXPECT_TRUE(moved.empty());
  CudaStream stream;
  CudaEvent event;
  PinnedHostBuffer pinned;
  CublasHandle handle;
  EXPECT_TRUE(stream.empty());
  EXPECT_TRUE(event.empty());
  EXPECT_TRUE(pinned.empty());
  EXPECT_TRUE(handle.empty());
  EXPECT_FALSE(stream.synchronize().is_ok());  // an error, not a sync on the default stream
}

#ifdef SPECONTEXT_HAVE_NCCL
TEST(NcclCheck, ErrorsBecomeStatus) {
  EXPECT_TRUE(nccl_status(ncclSuccess, "x").is_ok());
  const Status s = nccl_status(ncclInvalidArgument, "ncclAllReduce(...)");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "ncclAllReduce(...)")) << s.message();
  EXPECT_EQ(nccl_status(ncclRemoteError, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(nccl_status(ncclInProgress, "x").code(), StatusCode::kInProgress);
  NcclComm empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_FALSE(empty.all_reduce_sum(nullptr, nullptr, 0, nullptr).is_ok());
}
#endif

// ---------------------------------------------------------------------------------------------
// Needs a device.

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

TEST_F(CudaDeviceTest, DeviceBufferRoundTripAndMove) {
  auto stream = CudaStream::create();
  ASSERT_TRUE(stream.is_ok()) << stream.status().to_string();
  auto buffer = DeviceBuffer<int>::create(1000);
  ASSERT_TRUE(buffer.is_ok()) << buffer.status().to_string();
  EXPECT_EQ(buffer->size(), 1000u);
  EXPECT_EQ(buffer->bytes(), 4000u);
  std::vector<int> in(1000);
  for (int i = 0; i < 1000; ++i) in[i] = i * 7 - 3;
  ASSERT_TRUE(buffer->upload(in.data(), in.size(), stream->get()).is_ok());
  DeviceBuffer<int> moved = std::move(*buffer);
  EXPECT_TRUE(buffer->empty());
  std::vector<int> out(1000, 0);
  ASSERT_TRUE(moved.download(out.data(), out.size(), stream->get()).is_ok());
  ASSERT_TRUE(stream->synchronize().is_ok());
  EXPECT_EQ(in, out);
  EXPECT_EQ(moved.upload(in.data(), 1001, stream->get()).code(), StatusCode::kOutOfRange);
}

TEST_F(CudaDeviceTest, HugeAllocationIsResourceExhausted) {
  auto buffer = DeviceBuffer<uint8_t>::create(size_t{1} << 50);  // 1 PiB
  ASSERT_FALSE(buffer.is_ok());
  EXPECT_EQ(buffer.status().code(), StatusCode::kResourceExhausted) << buffer.status().to_string();
  // The error was cleared: the next call works.
  auto small = DeviceBuffer<uint8_t>::create(64);
  EXPECT_TRUE(small.is_ok()) << small.status().to_string();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST_F(CudaDeviceTest, EventsAndPinnedMemory) {
  auto stream = CudaStream::create();
  ASSERT_TRUE(stream.is_ok());
  auto pinned = PinnedHostBuffer::create(4096);
  ASSERT_TRUE(pinned.is_ok()) << pinned.status().to_string();
  EXPECT_EQ(pinned->bytes(), 4096u);
  auto device = DeviceBuffer<float>::create(1024);
  ASSERT_TRUE(device.is_ok());
  float* host = pinned->as<float>();
  for (int i = 0; i < 1024; ++i) host[i] = static_cast<float>(i) * 0.5f;
  ASSERT_TRUE(device->upload(host, 1024, stream->get()).is_ok());
  auto event = CudaEvent::create();
  ASSERT_TRUE(event.is_ok());
  ASSERT_TRUE(event->record(stream->get()).is_ok());
  ASSERT_TRUE(event->synchronize().is_ok());
  EXPECT_TRUE(event->query().is_ok());

  auto start = CudaEvent::create(cudaEventDefault);
  auto end = CudaEvent::create(cudaEventDefault);
  ASSERT_TRUE(start.is_ok() && end.is_ok());
  ASSERT_TRUE(start->record(stream->get()).is_ok());
  ASSERT_TRUE(end->record(stream->get()).is_ok());
  ASSERT_TRUE(end->synchronize().is_ok());
  auto ms = CudaEvent::elapsed_ms(*start, *end);
  ASSERT_TRUE(ms.is_ok()) << ms.status().to_string();
  EXPECT_GE(*ms, 0.0f);
}

TEST_F(CudaDeviceTest, CublasHandleAndBackendAllocate) {
  auto stream = CudaStream::create();
  ASSERT_TRUE(stream.is_ok());
  auto handle = CublasHandle::create(stream->get());
  ASSERT_TRUE(handle.is_ok()) << handle.status().to_string();
  EXPECT_FALSE(handle->empty());

  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok()) << backend.status().to_string();
  EXPECT_GT((*backend)->sm_count(), 0);
  auto memory = (*backend)->allocate(1 << 20);
  ASSERT_TRUE(memory.is_ok()) << memory.status().to_string();
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, memory->get()), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  EXPECT_EQ(cudaMemset(memory->get(), 0, 1 << 20), cudaSuccess);
  EXPECT_TRUE((*backend)->synchronize().is_ok());
}

TEST_F(CudaDeviceTest, SupportsMatchesImplementedDtypes) {
  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok());
  Backend& b = **backend;
  EXPECT_TRUE(b.supports(BackendOp::kMatmul, DType::kF32));
  EXPECT_TRUE(b.supports(BackendOp::kMatmul, DType::kBF16));
  EXPECT_FALSE(b.supports(BackendOp::kMatmul, DType::kF16));
  for (DType t : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {  // read as stored
    EXPECT_TRUE(b.supports(BackendOp::kMatmul, t)) << dtype_name(t);
    EXPECT_TRUE(b.supports(BackendOp::kEmbed, t)) << dtype_name(t);
  }
  EXPECT_FALSE(b.supports(BackendOp::kMatmul, DType::kI32));
  EXPECT_TRUE(b.supports(BackendOp::kEmbed, DType::kF16));
  EXPECT_TRUE(b.supports(BackendOp::kAttention, DType::kF32));
  WeightMatrix w{DType::kF16, 4, 4, reinterpret_cast<const void*>(16)};
  EXPECT_EQ(b.matmul(nullptr, 1, w, nullptr, nullptr).code(), StatusCode::kUnimplemented);
}

// Kernels may take a pointer into page-locked host memory only where the device reads registered
// memory at its host address; the backend says so through addressable(kPinnedHost), and the
// engine stages such tiers through the transport elsewhere. copy_rows moves rows between
// registered host memory and device memory in both directions (cudaMemcpyDefault).
TEST_F(CudaDeviceTest, PinnedHostIsAddressableOnlyWhereRegisteredHostPointersWork) {
  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok()) << backend.status().to_string();
  CudaBackend& gpu = **backend;
  int host_pointers = 0, smem = 0, smem_optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlock, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  EXPECT_EQ(gpu.addressable(MemoryKind::kPinnedHost), host_pointers == 1);
  EXPECT_TRUE(gpu.addressable(MemoryKind::kDevice));
  EXPECT_FALSE(gpu.addressable(MemoryKind::kHost));
  EXPECT_EQ(gpu.shared_memory_limits().per_block, static_cast<size_t>(smem));
  EXPECT_EQ(gpu.shared_memory_limits().per_block_optin, static_cast<size_t>(smem_optin));

  constexpr size_t kRow = 256, kRows = 64, kBytes = kRow * kRows;
  std::vector<uint8_t> pool(2 * kBytes);
  for (size_t i = 0; i < kBytes; ++i) pool[i] = static_cast<uint8_t>(i * 7 + 3);
  auto reg = PinnedHostRegistration::create(pool.data(), pool.size());
  ASSERT_TRUE(reg.is_ok()) << reg.status().to_string();
  auto dev = gpu.allocate(kBytes);
  ASSERT_TRUE(dev.is_ok());
  // Pool -> device (rows, then a single row), then device -> the pool's second half.
  ASSERT_TRUE(gpu.copy_rows(dev->get(), kRow, pool.data(), kRow, kRow, kRows - 1).is_ok());
  ASSERT_TRUE(gpu.copy_rows(static_cast<uint8_t*>(dev->get()) + (kRows - 1) * kRow, kRow,
                            pool.data() + (kRows - 1) * kRow, kRow, kRow, 1)
                  .is_ok());
  const Status back = gpu.copy_rows(pool.data() + kBytes, kRow, dev->get(), kRow, kRow, kRows);
  ASSERT_TRUE(back.is_ok()) << back.to_string();
  ASSERT_TRUE(gpu.synchronize().is_ok());
  EXPECT_TRUE(std::equal(pool.begin(), pool.begin() + kBytes, pool.begin() + kBytes));
}

}  // namespace
}  // namespace specontext::gpu
