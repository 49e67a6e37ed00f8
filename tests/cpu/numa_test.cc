// hwloc topology, node-bound buffers and worker pinning.
#include "cpu/numa.h"

#include <gtest/gtest.h>

#include <oneapi/tbb/parallel_for.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>

namespace specontext::cpu {
namespace {

TEST(Topology, LoadsAndCounts) {
  auto topo = Topology::load();
  ASSERT_TRUE(topo.is_ok()) << topo.status().to_string();
  const int nodes = topo->num_numa_nodes();
  ASSERT_GE(nodes, 1);
  int total_pus = 0;
  for (int n = 0; n < nodes; ++n) {
    EXPECT_GE(topo->cores_in_node(n), 0);
    EXPECT_GE(topo->pus_in_node(n), topo->cores_in_node(n));
    total_pus += topo->pus_in_node(n);
  }
  EXPECT_GE(topo->cores_in_node(0), 1);
  EXPECT_GE(total_pus, 1);
  EXPECT_EQ(topo->cores_in_node(nodes), 0);  // beyond the last node
  EXPECT_EQ(topo->cores_in_node(-1), 0);
  const int here = topo->node_of_current_thread();
  EXPECT_GE(here, 0);
  EXPECT_LT(here, nodes);
  EXPECT_EQ(topo->bind_current_thread_to_node(nodes).code(), StatusCode::kInvalidArgument);
}

TEST(Topology, SystemTopologyIsShared) {
  auto a = system_topology();
  auto b = system_topology();
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(*a, *b);
}

TEST(NumaBuffer, AllocateWriteReadMove) {
  const size_t bytes = (size_t{1} << 20) + 123;  // not a page multiple
  auto buf = NumaBuffer::allocate(bytes, 0);
  ASSERT_TRUE(buf.is_ok()) << buf.status().to_string();
  NumaBuffer b = std::move(buf).value();
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(b.size(), bytes);
  EXPECT_EQ(b.node(), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);  // page aligned
  EXPECT_EQ(b.bound(), memory_binding_supported());
  auto* p = static_cast<uint8_t*>(b.data());
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(i * 7);
  size_t bad = 0;
  for (size_t i = 0; i < bytes; ++i) bad += p[i] != static_cast<uint8_t>(i * 7);
  EXPECT_EQ(bad, 0u);

  NumaBuffer moved(std::move(b));
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(moved.data(), p);
  NumaBuffer assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.data(), p);
  EXPECT_EQ(static_cast<uint8_t*>(assigned.data())[bytes - 1], static_cast<uint8_t>((bytes - 1) * 7));
  assigned = NumaBuffer();  // frees
  EXPECT_TRUE(assigned.empty());
}

TEST(NumaBuffer, EdgeCases) {
  auto empty = NumaBuffer::allocate(0, 0);
  ASSERT_TRUE(empty.is_ok());
  EXPECT_TRUE(empty->empty());
  auto default_node = NumaBuffer::allocate(64, -1);
  ASSERT_TRUE(default_node.is_ok());
  EXPECT_EQ(default_node->node(), 0);
  auto topo = system_topology();
  ASSERT_TRUE(topo.is_ok());
  const int nodes = (*topo)->num_numa_nodes();
  EXPECT_EQ(NumaBuffer::allocate(64, nodes).status().code(), StatusCode::kInvalidArgument);
  // Every node of the machine can hold a buffer.
  for (int n = 0; n < nodes; ++n) {
    auto b = NumaBuffer::allocate(3 * 4096, n);
    ASSERT_TRUE(b.is_ok()) << "node " << n;
    std::memset(b->data(), 0xab, b->size());
    EXPECT_EQ(b->node(), n);
  }
}

TEST(NumaBuffer, RawAllocFree) {
  void* p = numa_alloc(10000, 0);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 10000);
  numa_free(p, 10000);
  EXPECT_EQ(numa_alloc(0, 0), nullptr);
  numa_free(nullptr, 0);  // no-op
  auto topo = system_topology();
  ASSERT_TRUE(topo.is_ok());
  EXPECT_EQ(numa_alloc(64, (*topo)->num_numa_nodes()), nullptr);
}

TEST(NodePinningObserver, PinsWorkersToTheNode) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs a TBB worker thread";
  auto topo = system_topology();
  ASSERT_TRUE(topo.is_ok());
  tbb::task_arena arena(2);
  arena.initialize();
  std::atomic<int> worker_tasks{0}, worker_tasks_bound{0};
  const std::thread::id caller = std::this_thread::get_id();
  {
    NodePinningObserver observer(arena, **topo, 0);
    arena.execute([&] {
      tbb::parallel_for(0, 64, [&](int) {
        // Long enough that the worker wakes up and takes some of the iterations.
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        if (std::this_thread::get_id() != caller) {
          worker_tasks.fetch_add(1);
          if ((*topo)->current_thread_bound_within(0)) worker_tasks_bound.fetch_add(1);
        }
      });
    });
    EXPECT_GE(observer.pinned_entries(), 1);
    EXPECT_EQ(observer.failed_entries(), 0);
  }
  EXPECT_GT(worker_tasks.load(), 0);
  EXPECT_EQ(worker_tasks_bound.load(), worker_tasks.load());
}

}  // namespace
}  // namespace specontext::cpu
