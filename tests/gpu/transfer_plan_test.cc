// CudaTransport's request planning (gpu/transfer_plan.h), without a GPU: independence checks
// naming both requests, coalescing of neighbours adjacent on both sides, the DMA / kernel choice,
// and the kernel's piece list, which a host mirror of gather_copy_kernel (kernels_copy.cu) runs
// over host memory standing in for device and mapped memory: the result must equal a memcpy per
// request, with guard bytes around every destination untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/kernels.h"
#include "gpu/transfer_plan.h"

namespace specontext::gpu {
namespace {

uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// A host→device style request: src "pinned" (mapped: src_dev == src), dst "device".
CopyRange h2d(uint64_t src, uint64_t dst, uint64_t bytes, size_t request) {
  return CopyRange{src, dst, src, dst, bytes, false, true, request};
}

TEST(TransferPlan, CoalescesNeighboursAdjacentOnBothSides) {
  std::vector<CopyRange> c = {h2d(1000, 5000, 100, 0), h2d(1100, 5100, 50, 1),  // merge
                              h2d(1150, 6000, 10, 2),                           // dst not adjacent
                              h2d(2000, 6010, 10, 3),                           // src not adjacent
                              h2d(2010, 6020, 0, 4),                            // empty: dropped
                              h2d(2010, 6020, 30, 5)};                          // merges with 3
  auto plan = plan_transfer(c, TransferPlanOptions{CopyMethod::kDma, 0});
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  ASSERT_EQ(plan->segments.size(), 3u);
  EXPECT_EQ(plan->segments[0].bytes, 150u);
  EXPECT_EQ(plan->segments[1].request, 2u);
  EXPECT_EQ(plan->segments[2].bytes, 40u);
  EXPECT_EQ(plan->segments[2].request, 3u);
  EXPECT_EQ(plan->total_bytes, 200u);
  EXPECT_EQ(plan->requests, 6u);
  EXPECT_EQ(plan->method, CopyMethod::kDma);
  EXPECT_TRUE(plan->pieces.empty()) << "DMA plans carry no piece list";
  // Different sides (device→device next to host→device) never merge, even when adjacent.
  std::vector<CopyRange> mixed = {h2d(1000, 5000, 100, 0),
                                  CopyRange{1100, 5100, 1100, 5100, 10, true, true, 1}};
  plan = plan_transfer(mixed, TransferPlanOptions{CopyMethod::kDma, 0});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->segments.size(), 2u);
}

TEST(TransferPlan, RejectsDependentRequests) {
  auto expect_pair = [](const std::vector<CopyRange>& c, const std::string& want) {
    auto plan = plan_transfer(c, TransferPlanOptions{});
    ASSERT_FALSE(plan.is_ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(want), std::string::npos) << plan.status().message();
  };
  // Overlapping destinations, given in any order.
  expect_pair({h2d(0, 100, 10, 0), h2d(50, 300, 10, 1), h2d(60, 105, 10, 2)}, "requests 0 and 2");
  expect_pair({h2d(60, 105, 10, 0), h2d(0, 100, 10, 1)}, "requests 0 and 1");
  // Device→device: request 1 reads what request 0 writes.
  const CopyRange d0{1000, 2000, 1000, 2000, 64, true, true, 0};
  const CopyRange d1{2032, 3000, 2032, 3000, 64, true, true, 1};
  expect_pair({d0, d1}, "reads bytes the other writes");
  // Host→device plus device→host over the same pinned bytes: dependent as well.
  const CopyRange up{100, 5000, 100, 5000, 10, false, true, 0};
  const CopyRange down{6000, 105, 6000, 105, 10, true, false, 1};
  expect_pair({up, down}, "requests 0 and 1");
  // Touching but not overlapping is fine; so are zero-byte requests anywhere.
  const std::vector<CopyRange> touching = {h2d(0, 100, 10, 0), h2d(10, 110, 10, 1), h2d(0, 105, 0, 2)};
  auto ok = plan_transfer(touching, TransferPlanOptions{});
  EXPECT_TRUE(ok.is_ok()) << ok.status().to_string();
  // Pure host→device batches never compare sources with destinations (different spaces).
  const std::vector<CopyRange> same_address = {h2d(100, 100, 10, 0)};
  ok = plan_transfer(same_address, TransferPlanOptions{});
  EXPECT_TRUE(ok.is_ok()) << ok.status().to_string();
}

TEST(TransferPlan, AutoChoosesByMeanRequestSize) {
  // Address 0 means "not device-addressable": keep every test address above it.
  const uint64_t base = uint64_t{1} << 32;
  std::vector<CopyRange> small, large;
  for (size_t i = 0; i < 100; ++i) {
    small.push_back(
        h2d(base + i * 1024, base + 1000000 + i * 512, 512, i));  // not adjacent in src: 100 segments
    large.push_back(h2d(base + i * 1000000, base + 200000000 + i * 600000, 500000, i));
  }
  const TransferPlanOptions opts{CopyMethod::kAuto, 32 * 1024};
  auto a = plan_transfer(small, opts);
  auto b = plan_transfer(large, opts);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(a->method, CopyMethod::kGatherKernel);
  EXPECT_EQ(a->pieces.size(), 100u);
  EXPECT_EQ(b->method, CopyMethod::kDma);
  // Coalescing happens first: 100 adjacent 512 B rows are one 51 KiB segment -> DMA.
  std::vector<CopyRange> adjacent;
  for (size_t i = 0; i < 100; ++i) adjacent.push_back(h2d(base + i * 512, base + 1000000 + i * 512, 512, i));
  auto c = plan_transfer(adjacent, opts);
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->segments.size(), 1u);
  EXPECT_EQ(c->method, CopyMethod::kDma);
  // A side without a device address forces DMA under kAuto and is an error for the kernel.
  small[7].src_dev = 0;
  auto d = plan_transfer(small, opts);
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->method, CopyMethod::kDma);
  auto e = plan_transfer(small, TransferPlanOptions{CopyMethod::kGatherKernel, 0});
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("request 7"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("not device-addressable"), std::string::npos);
  // Empty batch: nothing to do, DMA with no segments.
  auto f = plan_transfer({}, opts);
  ASSERT_TRUE(f.is_ok());
  EXPECT_TRUE(f->segments.empty());
  EXPECT_EQ(copy_method_name(CopyMethod::kGatherKernel), "gather_kernel");
}

// Host mirror of gather_copy_kernel: the same unit choice per piece (uint4 / uint32 / bytes
// body, byte tail).
void emulate_gather_copy(const std::vector<kernels::CopyPiece>& pieces) {
  for (const kernels::CopyPiece& p : pieces) {
    ASSERT_LE(p.bytes, kernels::kCopyPieceBytes);
    ASSERT_TRUE(p.align == 16 || p.align == 4 || p.align == 1);
    ASSERT_EQ((p.src | p.dst) % p.align, 0u) << "piece alignment class is wrong";
    auto* src = reinterpret_cast<const unsigned char*>(p.src);
    auto* dst = reinterpret_cast<unsigned char*>(p.dst);
    const uint32_t body = p.align == 1 ? 0 : p.bytes / p.align * p.align;
    std::memcpy(dst, src, body);  // in units of align on the device
    std::memcpy(dst + body, src + body, p.bytes - body);
  }
}

TEST(TransferPlan, PiecesReproduceEveryRequestExactly) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 30; ++round) {
    std::vector<unsigned char> src(1 << 20), dst(1 << 20, 0x5A);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    std::vector<unsigned char> want = dst;
    // Disjoint destination slots of random sizes and alignments (rows of 1 B .. 12 KiB, so some
    // are cut into several pieces), random sources; sometimes a run of adjacent rows.
    std::vector<CopyRange> c;
    uint64_t at = 0;
    while (true) {
      const uint64_t bytes = rng() % 3 == 0 ? 1 + rng() % 12288 : 512;
      const uint64_t gap = rng() % 2 == 0 ? 0 : rng() % 64;
      if (at + gap + bytes > dst.size()) break;
      const uint64_t d = at + gap;
      const uint64_t s = rng() % 4 == 0 && !c.empty() &&
                                 c.back().src + c.back().bytes + bytes <= addr(src.data()) + src.size()
                             ? c.back().src + c.back().bytes - addr(src.data())
                             : rng() % (src.size() - bytes + 1);
      c.push_back(h2d(addr(src.data()) + s, addr(dst.data()) + d, bytes, c.size()));
      std::memcpy(want.data() + d, src.data() + s, bytes);
      at = d + bytes;
    }
    auto plan = plan_transfer(c, TransferPlanOptions{CopyMethod::kGatherKernel, 0});
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    uint64_t piece_bytes = 0;
    for (const auto& p : plan->pieces) piece_bytes += p.bytes;
    EXPECT_EQ(piece_bytes, plan->total_bytes);
    emulate_gather_copy(plan->pieces);
    ASSERT_TRUE(dst == want) << "round " << round;
  }
}

}  // namespace
}  // namespace specontext::gpu
