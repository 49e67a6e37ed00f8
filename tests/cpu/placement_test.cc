// The CPU backend's memory placement: KV allocations are NUMA buffers on the backend's node and
// weights are bound there (where the machine lets hwloc bind memory).
#include <gtest/gtest.h>

#include <cstring>

#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "cpu/numa.h"

namespace specontext::cpu {
namespace {

TEST(CpuPlacement, AllocationsAreUsableAndAligned) {
  auto b = CpuBackend::create({});
  ASSERT_TRUE(b.is_ok());
  auto mem = (*b)->allocate(1 << 20);
  ASSERT_TRUE(mem.is_ok());
  ASSERT_NE(mem->get(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(mem->get()) % 64, 0u);
  std::memset(mem->get(), 0x5a, 1 << 20);  // touches every page
  EXPECT_EQ(static_cast<unsigned char*>(mem->get())[(1 << 20) - 1], 0x5a);
}

TEST(CpuPlacement, WeightsAreBoundToTheBackendNodeWhenSupported) {
  auto model = make_synthetic_model("toy", 0, DType::kF32, 1);
  ASSERT_TRUE(model.is_ok());
  auto b = CpuBackend::create({});
  ASSERT_TRUE(b.is_ok());
  ASSERT_TRUE((*b)->place_weights(**model).is_ok());
  if (!memory_binding_supported()) {
    EXPECT_EQ((*b)->weight_bytes_bound(), 0);
    GTEST_SKIP() << "this machine does not allow memory binding (mbind)";
  }
  // The toy embedding table alone (256 × 64 f32 = 64 KiB) spans whole pages.
  EXPECT_GE((*b)->weight_bytes_bound(), 64 * 1024 - 2 * 4096);
}

}  // namespace
}  // namespace specontext::cpu
