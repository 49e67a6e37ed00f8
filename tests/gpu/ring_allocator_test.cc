// The staging ring's placement rules (gpu/ring_allocator.h), without a GPU: regions never overlap
// while in flight, wrap-around happens at the end, and exactly the overlapping oldest regions are
// retired before a placement is used.
#include <gtest/gtest.h>

#include <deque>
#include <random>
#include <utility>

#include "gpu/ring_allocator.h"

namespace specontext::gpu {
namespace {

TEST(RingAllocator, SequentialThenWrap) {
  RingAllocator ring(1024, 256);
  auto p = ring.place(100);
  EXPECT_EQ(p.offset, 0u);
  EXPECT_EQ(p.retire, 0u);
  ring.push(p.offset, 100);
  p = ring.place(300);
  EXPECT_EQ(p.offset, 256u) << "aligned after the first region";
  ring.push(p.offset, 300);
  p = ring.place(400);
  EXPECT_EQ(p.offset, 0u) << "768 + 400 > 1024: wraps";
  EXPECT_EQ(p.retire, 2u) << "[0, 400) overlaps the first and second regions";
  ring.pop();
  ring.pop();
  ring.push(p.offset, 400);
  p = ring.place(1024);
  EXPECT_EQ(p.offset, 0u);
  EXPECT_EQ(p.retire, 1u);
}

TEST(RingAllocator, RandomNeverOverlapsInFlight) {
  std::mt19937 rng(3);
  RingAllocator ring(1 << 16, 256);
  std::deque<std::pair<size_t, size_t>> live;
  for (int i = 0; i < 20000; ++i) {
    const size_t n = 1 + rng() % (1 << 14);
    const auto p = ring.place(n);
    ASSERT_LE(p.offset + n, ring.capacity());
    ASSERT_EQ(p.offset % 256, 0u);
    ASSERT_LE(p.retire, live.size());
    for (size_t r = 0; r < p.retire; ++r) {
      ring.pop();
      live.pop_front();
    }
    for (const auto& [b, e] : live) ASSERT_FALSE(b < p.offset + n && p.offset < e) << "overlap at step " << i;
    ring.push(p.offset, n);
    live.emplace_back(p.offset, p.offset + n);
    // Completion in order, at random moments.
    while (!live.empty() && rng() % 3 == 0) {
      ring.pop();
      live.pop_front();
    }
    ASSERT_EQ(ring.in_flight(), live.size());
  }
}

}  // namespace
}  // namespace specontext::gpu
