// NcclCommunicator: argument errors everywhere; with one GPU a world-1 group (the sum over one
// rank is the input, ordered on the backend's stream); with two or more GPUs, one thread per
// device all-reducing rank-dependent data against the host sum. Each device case skips with a
// message saying what it needs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gpu/cuda_backend.h"
#include "gpu/cuda_raii.h"
#ifdef SPECONTEXT_HAVE_NCCL
#include "gpu/nccl_communicator.h"
#endif

namespace specontext::gpu {
namespace {

#ifdef SPECONTEXT_HAVE_NCCL

float value(int rank, size_t i) {
  return static_cast<float>((static_cast<int64_t>(i) * 7 + rank * 13) % 101) / 64.0f - 0.75f;
}

int device_count() {
  auto n = cuda_device_count();
  return n.is_ok() ? *n : 0;
}

TEST(NcclCommunicator, FactoryRejectsBadArguments) {
  auto none = create_nccl_communicators({}, {});
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status().to_string();
  const int devices[] = {0, 1};
  const cudaStream_t streams[] = {nullptr};
  auto mismatched = create_nccl_communicators(devices, streams);
  ASSERT_FALSE(mismatched.is_ok());
  EXPECT_EQ(mismatched.status().code(), StatusCode::kInvalidArgument) << mismatched.status().to_string();
  EXPECT_NE(mismatched.status().message().find("2 devices but 1 streams"), std::string::npos);
  if (!cuda_device_available()) {
    const int one[] = {0};
    auto absent = create_nccl_communicators(one, streams);
    ASSERT_FALSE(absent.is_ok());
    EXPECT_EQ(absent.status().code(), StatusCode::kUnavailable) << absent.status().to_string();
  }
}

class NcclOneDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NcclOneDevice, DuplicateAndOutOfRangeDevices) {
  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok()) << backend.status().to_string();
  const cudaStream_t s = (*backend)->stream();
  const int twice[] = {0, 0};
  const cudaStream_t two[] = {s, s};
  auto dup = create_nccl_communicators(twice, two);
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument) << dup.status().to_string();
  const int beyond[] = {device_count()};
  const cudaStream_t one[] = {s};
  auto out = create_nccl_communicators(beyond, one);
  EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << out.status().to_string();
}

TEST_F(NcclOneDevice, WorldOneIsTheIdentityInStreamOrder) {
  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok()) << backend.status().to_string();
  const cudaStream_t stream = (*backend)->stream();
  const int devices[] = {0};
  const cudaStream_t streams[] = {stream};
  auto comms = create_nccl_communicators(devices, streams);
  ASSERT_TRUE(comms.is_ok()) << comms.status().to_string();
  ASSERT_EQ(comms->size(), 1u);
  NcclCommunicator& c = *(*comms)[0];
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  EXPECT_EQ(c.stream(), stream);
  constexpr size_t kN = 4099;
  std::vector<float> host(kN), back(kN, 0.0f);
  for (size_t i = 0; i < kN; ++i) host[i] = value(0, i);
  auto buf = DeviceBuffer<float>::create(kN);
  ASSERT_TRUE(buf.is_ok());
  // Upload, reduce and download on one stream without synchronising in between.
  ASSERT_TRUE(buf->upload(host.data(), kN, stream).is_ok());
  ASSERT_TRUE(c.all_reduce_sum(buf->data(), static_cast<int64_t>(kN)).is_ok());
  ASSERT_TRUE(buf->download(back.data(), kN, stream).is_ok());
  ASSERT_TRUE((*backend)->synchronize().is_ok());
  EXPECT_EQ(back, host);
  EXPECT_TRUE(c.all_reduce_sum(buf->data(), 0).is_ok());
  EXPECT_EQ(c.all_reduce_sum(buf->data(), -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.all_reduce_sum(nullptr, 4).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.check_async_error().is_ok());
}

TEST(NcclMultiDevice, SumsAcrossDevicesOneThreadEach) {
  const int n = device_count();
  if (n < 2) GTEST_SKIP() << "needs at least 2 CUDA devices (found " << n << ")";
  const int world = std::min(n, 4);
  std::vector<std::unique_ptr<CudaBackend>> backends;
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;
  for (int d = 0; d < world; ++d) {
    auto b = CudaBackend::create(d);
    ASSERT_TRUE(b.is_ok()) << b.status().to_string();
    streams.push_back((*b)->stream());
    devices.push_back(d);
    backends.push_back(std::move(*b));
  }
#if CUDART_VERSION >= 12080
  {  // A stream of another device is refused.
    const int pair[] = {0, 1};
    const cudaStream_t swapped[] = {streams[1], streams[0]};
    auto wrong = create_nccl_communicators(pair, swapped);
    ASSERT_FALSE(wrong.is_ok());
    EXPECT_NE(wrong.status().message().find("the stream belongs to device 1"), std::string::npos)
        << wrong.status().to_string();
  }
#endif
  auto comms = create_nccl_communicators(devices, streams);
  ASSERT_TRUE(comms.is_ok()) << comms.status().to_string();
  constexpr size_t kN = (size_t{1} << 20) + 3;
  std::vector<std::vector<float>> results(static_cast<size_t>(world));
  std::vector<Status> st(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const auto rr = static_cast<size_t>(r);
      auto buf = DeviceBuffer<float>::create(kN);
      if (!buf.is_ok()) {
        st[rr] = buf.status();
        return;
      }
      std::vector<float> host(kN);
      for (size_t i = 0; i < kN; ++i) host[i] = value(r, i);
      results[rr].assign(kN, 0.0f);
      Status s = buf->upload(host.data(), kN, streams[rr]);
      if (s.is_ok()) s = (*comms)[rr]->all_reduce_sum(buf->data(), static_cast<int64_t>(kN));
      if (s.is_ok()) s = buf->download(results[rr].data(), kN, streams[rr]);
      if (s.is_ok()) s = backends[rr]->synchronize();
      st[rr] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(st[static_cast<size_t>(r)].is_ok())
        << "rank " << r << ": " << st[static_cast<size_t>(r)].to_string();
    for (size_t i = 0; i < kN; ++i) {
      double want = 0;
      for (int q = 0; q < world; ++q) want += value(q, i);
      ASSERT_NEAR(results[static_cast<size_t>(r)][i], want, 1e-5) << "rank " << r << " element " << i;
    }
  }
}

#else

TEST(NcclCommunicator, NotBuilt) { GTEST_SKIP() << "built without NCCL (SPECONTEXT_HAVE_NCCL unset)"; }

#endif  // SPECONTEXT_HAVE_NCCL

}  // namespace
}  // namespace specontext::gpu
