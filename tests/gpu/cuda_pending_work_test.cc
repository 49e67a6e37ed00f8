// Work still pending on a device must not turn into errors elsewhere. cudaEventQuery /
// cudaStreamQuery answer cudaErrorNotReady for pending work and leave it in the runtime's
// last-error slot; before query_status cleared it, every launcher's cudaGetLastError (and CUB's
// cudaPeekAtLastError) after a good launch reported that "not ready" as its own failure, and a
// transfer whose enqueue failed that way stored "in progress" as its error and polled forever.
// Pending work is made certain, not timed: a host function holds a stream until the test opens a
// gate (with a 60 s safety release, so a failing test cannot hang the device). Needs a device;
// skips with "no CUDA device" otherwise.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/ports/sampler.h"
#include "core/ports/transport.h"
#include "gpu/cuda_backend.h"
#include "gpu/cuda_check.h"
#include "gpu/cuda_raii.h"
#include "gpu/cuda_transport.h"

namespace specontext::gpu {
namespace {

// A stream held by a host function until open() (or the safety release).
class HeldStream {
 public:
  HeldStream() {
    auto s = CudaStream::create(cudaStreamNonBlocking);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    if (s.is_ok()) stream_ = std::move(*s);
  }
  ~HeldStream() {
    open();
    if (!stream_.empty()) (void)stream_.synchronize();
  }
  HeldStream(const HeldStream&) = delete;
  HeldStream& operator=(const HeldStream&) = delete;

  // Enqueues the hold, then records `done` behind it.
  void hold(CudaEvent& done) {
    ASSERT_EQ(cudaLaunchHostFunc(stream_.get(), &HeldStream::wait, &open_), cudaSuccess);
    ASSERT_TRUE(done.record(stream_.get()).is_ok());
  }
  void open() { open_.store(true); }
  cudaStream_t get() const { return stream_.get(); }

 private:
  static void CUDART_CB wait(void* flag) {
    const auto* open = static_cast<const std::atomic<bool>*>(flag);
    const auto release = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!open->load() && std::chrono::steady_clock::now() < release) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  CudaStream stream_;
  std::atomic<bool> open_{false};
};

class PendingWorkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    (void)cudaGetLastError();
  }
};

TEST_F(PendingWorkTest, AQueryOfPendingWorkIsInProgressAndLeavesNoError) {
  HeldStream held;
  auto done = CudaEvent::create();
  ASSERT_TRUE(done.is_ok());
  held.hold(*done);
  const Status q = done->query();
  EXPECT_EQ(q.code(), StatusCode::kInProgress) << q.to_string();
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "the pending query left an error in the last-error slot";
  EXPECT_EQ(query_status(cudaStreamQuery(held.get()), "cudaStreamQuery").code(), StatusCode::kInProgress);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  held.open();
  ASSERT_TRUE(done->synchronize().is_ok());
  EXPECT_TRUE(done->query().is_ok());
}

// The backend's launchers report their own launches: after a raw cudaEventQuery of pending work
// (which leaves "not ready" in the slot), the ops that launch kernels (add), convert activations
// and call cuBLAS (bf16 matmul) and sort with CUB (top-k sampling) all succeed and compute what
// they computed before.
TEST_F(PendingWorkTest, OpsSucceedAfterARawQueryOfPendingWork) {
  auto created = CudaBackend::create(0);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  CudaBackend& gpu = **created;
  constexpr int64_t n = 4096, rows = 3, in = 64, out = 96, vocab = 1000;
  std::vector<float> x(n), y(n), act(rows * in);
  std::vector<uint16_t> w_bf16(out * in);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 17) * 0.25f;
    y[i] = static_cast<float>(i % 5) - 2.0f;
  }
  for (size_t i = 0; i < act.size(); ++i) act[i] = static_cast<float>(static_cast<int>(i % 11) - 5) * 0.125f;
  for (size_t i = 0; i < w_bf16.size(); ++i) w_bf16[i] = static_cast<uint16_t>(0x3c00 + (i * 37) % 256);  // ~0.0078..0.0156
  std::vector<float> logits(2 * vocab);
  for (int64_t i = 0; i < 2 * vocab; ++i) logits[i] = static_cast<float>((i * 7919) % 1000) * 0.01f;
  auto alloc = [&](size_t bytes) {
    auto p = gpu.allocate(bytes);
    EXPECT_TRUE(p.is_ok());
    return p.is_ok() ? *p : nullptr;
  };
  auto dx = alloc(n * 4), dy = alloc(n * 4), dact = alloc(act.size() * 4), dout = alloc(rows * out * 4),
       dlogits = alloc(logits.size() * 4);
  ASSERT_TRUE(dx && dy && dact && dout && dlogits);
  auto weights = gpu.import_weights(w_bf16.data(), w_bf16.size() * 2);
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
  const WeightMatrix w{DType::kBF16, out, in, *weights};
  std::vector<TokenDraw> draws(2);
  draws[1].params.temperature = 1.0f;
  draws[1].params.top_k = 10;  // a sorted row: CUB's segmented radix sort
  draws[1].coin = 0.5f;
  ASSERT_TRUE(gpu.upload(dact.get(), act.data(), act.size() * 4).is_ok());

  // Every op once before holding the stream: scratch grows now (growing frees device memory,
  // which would wait for the held stream), and these are the results to reproduce.
  auto run_ops = [&](std::vector<float>& sum, std::vector<float>& product, std::vector<TokenId>& tokens) {
    ASSERT_TRUE(gpu.upload(dx.get(), x.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu.upload(dy.get(), y.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu.upload(dlogits.get(), logits.data(), logits.size() * 4).is_ok());
    const Status added = gpu.add(static_cast<float*>(dx.get()), static_cast<const float*>(dy.get()), n);
    ASSERT_TRUE(added.is_ok()) << added.to_string();
    const Status multiplied = gpu.matmul(static_cast<const float*>(dact.get()), rows, w, nullptr,
                                         static_cast<float*>(dout.get()));
    ASSERT_TRUE(multiplied.is_ok()) << multiplied.to_string();
    tokens.assign(2, -1);
    const Status sampled = gpu.sample_rows(static_cast<float*>(dlogits.get()), 2, vocab, draws.data(), tokens.data());
    ASSERT_TRUE(sampled.is_ok()) << sampled.to_string();
    sum.resize(n);
    product.resize(rows * out);
    ASSERT_TRUE(gpu.download(sum.data(), dx.get(), n * 4).is_ok());
    ASSERT_TRUE(gpu.download(product.data(), dout.get(), product.size() * 4).is_ok());
  };
  std::vector<float> sum0, product0, sum1, product1;
  std::vector<TokenId> tokens0, tokens1;
  run_ops(sum0, product0, tokens0);

  HeldStream held;
  auto done = CudaEvent::create();
  ASSERT_TRUE(done.is_ok());
  held.hold(*done);
  ASSERT_EQ(cudaEventQuery(done->get()), cudaErrorNotReady);  // raw: the slot is not cleared here
  run_ops(sum1, product1, tokens1);
  held.open();
  EXPECT_EQ(sum1, sum0);
  EXPECT_EQ(product1, product0);
  EXPECT_EQ(tokens1, tokens0);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sum0[i], x[i] + y[i]) << i;
}

// A transfer ordered after pending work polls kInProgress without leaving an error, then
// completes once the work is done; a later transfer posts and completes normally.
TEST_F(PendingWorkTest, TransportPollsPendingTransfersToCompletion) {
  // The gather kernel: its post uploads a piece list and launches (launch_gather_copy).
  auto created = CudaTransport::create(0, CudaTransportOptions{CopyMethod::kGatherKernel, kDefaultGatherBelowBytes});
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  CudaTransport& t = **created;
  constexpr size_t kBytes = 1 << 16;
  auto a = DeviceBuffer<uint8_t>::create(kBytes), b = DeviceBuffer<uint8_t>::create(kBytes);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  std::vector<uint8_t> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<uint8_t>(i * 31 + 7);
  ASSERT_EQ(cudaMemcpy(a->data(), pattern.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kDevice, a->data(), kBytes).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kDevice, b->data(), kBytes).is_ok());
  const TransferBatch batch{TransferRequest{TierId(0), 0, TierId(1), 0, kBytes}};

  HeldStream held;
  auto done = CudaEvent::create();
  ASSERT_TRUE(done.is_ok());
  held.hold(*done);
  ASSERT_TRUE(t.order_after(held.get()).is_ok());
  auto h = t.prepare(batch);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  ASSERT_EQ(t.post(*h).code(), StatusCode::kInProgress);
  EXPECT_EQ(t.poll(*h).code(), StatusCode::kInProgress);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "a pending poll left an error in the last-error slot";
  // A second transfer posted while the first is pending, right after a raw query left "not
  // ready" in the slot: its launch must succeed (before, its error became "in progress" and it
  // polled forever).
  ASSERT_EQ(cudaEventQuery(done->get()), cudaErrorNotReady);
  auto h2 = t.prepare(batch);
  ASSERT_TRUE(h2.is_ok());
  ASSERT_EQ(t.post(*h2).code(), StatusCode::kInProgress);
  held.open();
  for (TransferHandle* handle : {&*h, &*h2}) {
    Status s = t.poll(*handle);
    // Bounded (~60 s of polls) so that a transfer that never completes fails instead of hanging.
    for (int i = 0; i < 1200000 && s.code() == StatusCode::kInProgress; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      s = t.poll(*handle);
    }
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    t.release(*handle);
  }
  std::vector<uint8_t> back(kBytes);
  ASSERT_EQ(cudaMemcpy(back.data(), b->data(), kBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, pattern);
}

}  // namespace
}  // namespace specontext::gpu
