// CudaTransport on a device: the conformance suite (tests/transport/transport_conformance.h:
// capabilities match behaviour for all 16 kind pairs, bit-exact random batches for every direction,
// validation, handle misuse, release) once per copy method; which pairs it advertises, the method
// Auto picks, a large sparse gather, release and destruction waiting for the copy stream,
// registration rejecting memory of the wrong kind, PinnedHostRegistration as a tier, and the
// stream ordering helpers. Without a device every case skips ("no CUDA device").
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/ports/transport.h"
#include "gpu/cuda_backend.h"
#include "gpu/cuda_raii.h"
#include "gpu/cuda_transport.h"
#include "tests/gpu/device_test_util.h"
#include "tests/tests_common.h"
#include "tests/transport/transport_conformance.h"

namespace specontext::gpu {
namespace {

using device_test::cuda_or_die;
using specontext::testing::fill_random;
using transport_conformance::run_to_end;
using transport_conformance::TierMemory;
using transport_conformance::TransportCase;
using transport_conformance::TransportConformance;

// Runs everywhere: without a device the transport reports absence instead of failing later.
TEST(CudaTransportDiscovery, CreateWithoutDeviceIsUnavailable) {
  if (cuda_device_available()) {
    auto beyond = CudaTransport::create(*cuda_device_count());
    EXPECT_EQ(beyond.status().code(), StatusCode::kOutOfRange) << beyond.status().to_string();
    return;
  }
  auto t = CudaTransport::create(0);
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status().to_string();
  EXPECT_NE(t.status().message().find("no CUDA device"), std::string::npos) << t.status().message();
  std::vector<uint8_t> host(4096);
  EXPECT_FALSE(PinnedHostRegistration::create(host.data(), host.size()).is_ok()) << "no device, no pinning";
  EXPECT_EQ(PinnedHostRegistration::create(nullptr, 16).status().code(), StatusCode::kInvalidArgument);
  PinnedHostRegistration empty;
  EXPECT_TRUE(empty.empty());
}

class CudaTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
};

std::unique_ptr<CudaTransport> make_transport(CopyMethod method = CopyMethod::kAuto) {
  auto t = CudaTransport::create(0, CudaTransportOptions{method, kDefaultGatherBelowBytes});
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return t.is_ok() ? std::move(t).value() : nullptr;
}

// `bytes` of memory of one kind, filled and read back through plain CUDA copies.
class KindMemory : public TierMemory {
 public:
  KindMemory(MemoryKind kind, size_t bytes) : kind_(kind), bytes_(bytes) {
    switch (kind) {
      case MemoryKind::kHost:
        host_.resize(bytes);
        base_ = host_.data();
        break;
      case MemoryKind::kPinnedHost:
        cuda_or_die(cudaHostAlloc(&base_, bytes, cudaHostAllocDefault), "cudaHostAlloc");
        break;
      case MemoryKind::kDevice:
        cuda_or_die(cudaMalloc(&base_, bytes), "cudaMalloc");
        break;
      case MemoryKind::kRemote:
        break;  // the transport would resolve it; nothing local
    }
  }
  ~KindMemory() override {
    if (kind_ == MemoryKind::kPinnedHost) cudaFreeHost(base_);
    if (kind_ == MemoryKind::kDevice) cudaFree(base_);
  }
  KindMemory(const KindMemory&) = delete;
  KindMemory& operator=(const KindMemory&) = delete;

  void* base() override { return base_; }
  void write(const std::vector<uint8_t>& v) { write(std::as_bytes(std::span<const uint8_t>(v))); }
  void write(std::span<const std::byte> v) override {
    cuda_or_die(cudaMemcpy(base_, v.data(), v.size(), cudaMemcpyDefault), "write");
    cuda_or_die(cudaDeviceSynchronize(), "sync");
  }
  std::vector<std::byte> read_bytes() override {
    std::vector<std::byte> v(bytes_);
    cuda_or_die(cudaDeviceSynchronize(), "sync");
    cuda_or_die(cudaMemcpy(v.data(), base_, bytes_, cudaMemcpyDefault), "read");
    return v;
  }
  std::vector<uint8_t> read() const {
    std::vector<uint8_t> v(bytes_);
    cuda_or_die(cudaDeviceSynchronize(), "sync");
    cuda_or_die(cudaMemcpy(v.data(), base_, bytes_, cudaMemcpyDefault), "read");
    return v;
  }

 private:
  MemoryKind kind_;
  size_t bytes_;
  void* base_ = nullptr;
  std::vector<uint8_t> host_;
};

// A CudaTransport whose tiers get memory of their kind (pinned, device; plain host memory for
// kHost, which it refuses).
class CudaRig : public transport_conformance::TransportRig {
 public:
  explicit CudaRig(std::unique_ptr<CudaTransport> t) : t_(std::move(t)) {}
  ~CudaRig() override { t_.reset(); }
  Transport& transport() override { return *t_; }

 protected:
  std::unique_ptr<TierMemory> allocate(MemoryKind kind, uint64_t bytes) override {
    return std::make_unique<KindMemory>(kind, bytes);
  }

 private:
  std::unique_ptr<CudaTransport> t_;
};

TransportCase cuda_case(CopyMethod method) {
  return TransportCase{.name = std::string("cuda_") + std::string(copy_method_name(method)),
                       .make = [method]() -> std::unique_ptr<transport_conformance::TransportRig> {
                         if (!cuda_device_available()) return nullptr;
                         if (cudaSetDevice(0) != cudaSuccess) return nullptr;
                         auto t = make_transport(method);
                         if (t == nullptr) return nullptr;
                         return std::make_unique<CudaRig>(std::move(t));
                       },
                       .batch_bytes = uint64_t{4} << 20,
                       .unavailable = "no CUDA device",
                       .empty_done_at_post = true};
}

INSTANTIATE_TEST_SUITE_P(Methods, TransportConformance,
                         ::testing::Values(cuda_case(CopyMethod::kDma), cuda_case(CopyMethod::kGatherKernel),
                                           cuda_case(CopyMethod::kAuto)),
                         transport_conformance::transport_case_name);

TEST_F(CudaTransportTest, AdvertisesPinnedAndDevicePairsOnly) {
  const MemoryKind kinds[] = {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice,
                              MemoryKind::kRemote};
  auto t = make_transport();
  ASSERT_NE(t, nullptr);
  int advertised_pairs = 0;
  for (MemoryKind src : kinds) {
    for (MemoryKind dst : kinds) advertised_pairs += t->capabilities().supports(src, dst) ? 1 : 0;
  }
  EXPECT_EQ(advertised_pairs, 3) << "pinned->device, device->pinned, device->device";
  EXPECT_TRUE(t->capabilities().supports(MemoryKind::kPinnedHost, MemoryKind::kDevice));
  EXPECT_TRUE(t->capabilities().supports(MemoryKind::kDevice, MemoryKind::kPinnedHost));
  EXPECT_TRUE(t->capabilities().supports(MemoryKind::kDevice, MemoryKind::kDevice));
  EXPECT_FALSE(t->capabilities().remote);
}

TEST_F(CudaTransportTest, AutoPicksKernelForSmallRowsAndDmaForLarge) {
  auto t = make_transport(CopyMethod::kAuto);
  KindMemory host(MemoryKind::kPinnedHost, 8 << 20), dev(MemoryKind::kDevice, 8 << 20);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, host.base(), 8 << 20).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), 8 << 20).is_ok());
  TransferBatch rows;
  for (uint64_t i = 0; i < 1000; ++i) rows.push_back({TierId(0), (999 - i) * 512, TierId(1), i * 512, 512});
  auto small = t->prepare(rows);
  ASSERT_TRUE(small.is_ok());
  EXPECT_EQ(*t->method_of(*small), CopyMethod::kGatherKernel);
  auto big = t->prepare({{TierId(0), 0, TierId(1), 0, 4 << 20}});
  ASSERT_TRUE(big.is_ok());
  EXPECT_EQ(*t->method_of(*big), CopyMethod::kDma);
  t->release(*small);
  t->release(*big);
}

// 256K rows of 512 B (one KV head's row of one token each), gathered by the kernel: bit-exact.
TEST_F(CudaTransportTest, LargeSparseGatherWithKernel) {
  const uint64_t rows = 256 * 1024, row = 512, n = rows * row;
  KindMemory host(MemoryKind::kPinnedHost, 2 * n), dev(MemoryKind::kDevice, n);
  std::mt19937_64 rng(9);
  const std::vector<uint8_t> data = specontext::testing::random_bytes<uint8_t>(2 * n, 9);
  host.write(data);
  auto t = make_transport(CopyMethod::kGatherKernel);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, host.base(), 2 * n).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), n).is_ok());
  TransferBatch batch;
  std::vector<uint64_t> src_rows(2 * rows);
  for (uint64_t i = 0; i < src_rows.size(); ++i) src_rows[i] = i;
  std::shuffle(src_rows.begin(), src_rows.end(), rng);
  std::vector<uint8_t> want(n);
  for (uint64_t i = 0; i < rows; ++i) {
    batch.push_back({TierId(0), src_rows[i] * row, TierId(1), i * row, row});
    std::memcpy(want.data() + i * row, data.data() + src_rows[i] * row, row);
  }
  auto h = t->prepare(batch);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  ASSERT_TRUE(run_to_end(*t, *h).is_ok());
  t->release(*h);
  EXPECT_TRUE(dev.read() == want);
}

TEST_F(CudaTransportTest, ReleaseWaitsForTheCopies) {
  const size_t n = size_t{256} << 20;
  KindMemory host(MemoryKind::kPinnedHost, n), dev(MemoryKind::kDevice, n);
  const std::vector<uint8_t> data = specontext::testing::random_bytes<uint8_t>(n, 3);
  host.write(data);
  for (CopyMethod method : {CopyMethod::kDma, CopyMethod::kGatherKernel}) {
    SCOPED_TRACE(copy_method_name(method));
    cuda_or_die(cudaMemset(dev.base(), 0, n), "memset");
    cuda_or_die(cudaDeviceSynchronize(), "sync");
    auto t = make_transport(method);
    ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, host.base(), n).is_ok());
    ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), n).is_ok());
    auto h = t->prepare({{TierId(0), 0, TierId(1), 0, n}});
    ASSERT_TRUE(h.is_ok());
    EXPECT_EQ(t->post(*h).code(), StatusCode::kInProgress) << "256 MiB cannot be done at once";
    t->release(*h);  // must wait: afterwards the copy stream no longer touches the buffers
    EXPECT_EQ(cudaStreamQuery(t->stream()), cudaSuccess) << "copy stream still busy after release";
    EXPECT_TRUE(dev.read() == data);
  }
  // Destroying a transport with transfers in flight waits for them too.
  auto t = make_transport(CopyMethod::kDma);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, host.base(), n).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), n).is_ok());
  for (int i = 0; i < 4; ++i) {
    auto h = t->prepare({{TierId(0), 0, TierId(1), 0, n}});
    ASSERT_TRUE(h.is_ok());
    (void)t->post(*h);
  }
  t.reset();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Registration checks the memory is of the kind claimed; requests of one batch must be
// independent (the generic refusals are in the conformance suite).
TEST_F(CudaTransportTest, RegistrationChecksTheKindAndRequestsMustBeIndependent) {
  auto t = make_transport();
  KindMemory host(MemoryKind::kPinnedHost, 4096), dev(MemoryKind::kDevice, 4096);
  std::vector<uint8_t> pageable(4096);
  EXPECT_EQ(t->register_tier(TierId(0), MemoryKind::kPinnedHost, pageable.data(), 4096).code(),
            StatusCode::kInvalidArgument)
      << "pageable memory is not a pinned tier";
  EXPECT_EQ(t->register_tier(TierId(0), MemoryKind::kDevice, host.base(), 4096).code(),
            StatusCode::kInvalidArgument)
      << "pinned host memory is not a device tier";
  EXPECT_EQ(t->register_tier(TierId(0), MemoryKind::kPinnedHost, dev.base(), 4096).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, host.base(), 4096).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), 4096).is_ok());
  auto overlap = t->prepare({{TierId(0), 0, TierId(1), 0, 512}, {TierId(0), 1024, TierId(1), 256, 512}});
  ASSERT_FALSE(overlap.is_ok());
  EXPECT_NE(overlap.status().message().find("requests 0 and 1"), std::string::npos)
      << overlap.status().message();
}

TEST_F(CudaTransportTest, PinnedHostRegistrationServesAsTier) {
  const size_t n = size_t{1} << 20;
  void* raw = std::aligned_alloc(4096, n);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<void, decltype(&std::free)> pool(raw, &std::free);  // the engine's host pool stand-in
  auto* bytes = static_cast<uint8_t*>(raw);
  fill_random(std::span<uint8_t>(bytes, n), 17);
  {
    auto reg = PinnedHostRegistration::create(raw, n);
    ASSERT_TRUE(reg.is_ok()) << reg.status().to_string();
    EXPECT_NE(reg->device_pointer(), nullptr) << "mapped by default";
    auto twice = PinnedHostRegistration::create(raw, n);
    EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument) << twice.status().to_string();
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, raw), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost);
    for (CopyMethod method : {CopyMethod::kDma, CopyMethod::kGatherKernel}) {
      SCOPED_TRACE(copy_method_name(method));
      KindMemory dev(MemoryKind::kDevice, n);
      auto t = make_transport(method);
      ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kPinnedHost, raw, n).is_ok());
      ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kDevice, dev.base(), n).is_ok());
      TransferBatch batch;
      for (uint64_t i = 0; i < n / 512; ++i)
        batch.push_back({TierId(0), i * 512, TierId(1), (n / 512 - 1 - i) * 512, 512});
      auto h = t->prepare(batch);
      ASSERT_TRUE(h.is_ok()) << h.status().to_string();
      ASSERT_TRUE(run_to_end(*t, *h).is_ok());
      t->release(*h);
      const std::vector<uint8_t> got = dev.read();
      for (uint64_t i = 0; i < n / 512; ++i) {
        ASSERT_EQ(std::memcmp(got.data() + (n / 512 - 1 - i) * 512, bytes + i * 512, 512), 0) << "row " << i;
      }
    }
    PinnedHostRegistration moved = std::move(*reg);
    EXPECT_TRUE(reg->empty());
    EXPECT_EQ(moved.host(), raw);
  }
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, raw), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeUnregistered) << "the destructor unregisters";
  EXPECT_EQ(PinnedHostRegistration::create(nullptr, 16).status().code(), StatusCode::kInvalidArgument);
}

// KV written on the compute stream, then offloaded by the transport (order_after); a prefetch
// by the transport, then consumed on the compute stream (make_stream_wait). The producer work is
// long (many passes over 64 MiB) so that missing ordering would show as wrong bytes.
TEST_F(CudaTransportTest, OrdersAgainstTheComputeStream) {
  auto backend = CudaBackend::create(0);
  ASSERT_TRUE(backend.is_ok());
  CudaBackend& be = **backend;
  const int64_t n = 16 << 20;  // floats
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  KindMemory dev_a(MemoryKind::kDevice, bytes), dev_b(MemoryKind::kDevice, bytes),
      host(MemoryKind::kPinnedHost, bytes);
  std::vector<float> ones(static_cast<size_t>(n), 1.0f);
  std::vector<uint8_t> raw(bytes);
  std::memcpy(raw.data(), ones.data(), bytes);
  dev_a.write(raw);
  dev_b.write(raw);
  auto t = make_transport(CopyMethod::kDma);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kDevice, dev_a.base(), bytes).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kPinnedHost, host.base(), bytes).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(2), MemoryKind::kDevice, dev_b.base(), bytes).is_ok());

  auto* a = static_cast<float*>(dev_a.base());
  auto* b = static_cast<float*>(dev_b.base());
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(be.add(a, b, n).is_ok());  // a = 21 everywhere
  ASSERT_TRUE(t->order_after(be.stream()).is_ok());
  auto off = t->prepare({{TierId(0), 0, TierId(1), 0, bytes}});
  ASSERT_TRUE(off.is_ok());
  ASSERT_TRUE(run_to_end(*t, *off).is_ok());
  t->release(*off);
  const auto* h = static_cast<const float*>(host.base());
  for (int64_t i = 0; i < n; i += 4093)
    ASSERT_EQ(h[i], 21.0f) << "offload did not wait for the compute stream";

  // Prefetch host (21) into b, then the compute stream adds b to a: a = 42.
  auto pre = t->prepare({{TierId(1), 0, TierId(2), 0, bytes}});
  ASSERT_TRUE(pre.is_ok());
  EXPECT_EQ(t->post(*pre).code(), StatusCode::kInProgress);
  ASSERT_TRUE(t->make_stream_wait(*pre, be.stream()).is_ok());
  ASSERT_TRUE(be.add(a, b, n).is_ok());
  std::vector<float> back(static_cast<size_t>(n));
  ASSERT_TRUE(be.download(back.data(), a, bytes).is_ok());
  for (int64_t i = 0; i < n; i += 4093)
    ASSERT_EQ(back[static_cast<size_t>(i)], 42.0f) << "add did not wait for the prefetch";
  t->release(*pre);
}

}  // namespace
}  // namespace specontext::gpu
