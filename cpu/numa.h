// NUMA placement with hwloc: the machine's topology, node-bound memory (NumaBuffer) and pinning
// of a TBB arena's worker threads to one node's cores. NUMA nodes are named by their hwloc
// *logical* index 0..num_numa_nodes()-1 (OS indexes may have holes).
#pragma once

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <atomic>
#include <cstddef>
#include <memory>

#include "core/base/status.h"

// hwloc stays out of this header: the engine includes it for NumaBuffer only.
struct hwloc_topology;
struct hwloc_bitmap_s;

namespace specontext::cpu {

// Owns a loaded hwloc topology. Read-only after load(), so one instance may be shared by threads.
class Topology {
 public:
  static Result<Topology> load();

  int num_numa_nodes() const;
  // Physical cores (falls back to hardware threads when hwloc reports no core objects) whose
  // PUs belong to `node` and that this process may run on. 0 for an unknown node.
  int cores_in_node(int node) const;
  // Hardware threads (PUs) of `node` this process may run on.
  int pus_in_node(int node) const;
  // The node whose cores the calling thread last ran on; 0 when it cannot be told.
  int node_of_current_thread() const;
  // Binds the calling thread to all PUs of `node` (the OS still balances inside the node).
  Status bind_current_thread_to_node(int node) const;
  // True when the calling thread's CPU binding lies inside `node`'s PUs.
  bool current_thread_bound_within(int node) const;

  hwloc_topology* handle() const { return topo_.get(); }

 private:
  struct Deleter {
    void operator()(hwloc_topology* t) const noexcept;
  };
  explicit Topology(hwloc_topology* t) : topo_(t) {}
  std::unique_ptr<hwloc_topology, Deleter> topo_;
};

// The process-wide topology, loaded on first use and never unloaded, so buffers and observers
// that outlive main()'s locals can still free memory / unbind through it.
Result<const Topology*> system_topology();

// Whether hwloc can bind memory to nodes here (decided once per process by a trial allocation;
// containers often forbid mbind). When false, numa_alloc uses aligned_alloc.
bool memory_binding_supported();

// Move-only owning buffer, page aligned, placed on a NUMA node when memory binding is supported
// and in ordinary memory otherwise. Contents are uninitialised. Used by the engine for weights
// and KV pages.
class NumaBuffer {
 public:
  NumaBuffer() = default;
  ~NumaBuffer();
  NumaBuffer(NumaBuffer&& other) noexcept;
  NumaBuffer& operator=(NumaBuffer&& other) noexcept;
  NumaBuffer(const NumaBuffer&) = delete;
  NumaBuffer& operator=(const NumaBuffer&) = delete;

  // bytes == 0 gives an empty buffer (data() == nullptr). node < 0 means node 0.
  static Result<NumaBuffer> allocate(size_t bytes, int node);

  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t size() const { return size_; }
  int node() const { return node_; }
  // True when the pages were requested bound to node(); false for the aligned_alloc fallback.
  bool bound() const { return bound_; }
  bool empty() const { return data_ == nullptr; }

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t size_ = 0;
  int node_ = 0;
  bool bound_ = false;
};

// Free-function form of NumaBuffer for callers managing raw pointers; free with numa_free
// passing the same size. Page aligned. Returns nullptr on failure (bytes == 0 also gives
// nullptr). node < 0 means node 0; a node beyond the machine's is an error (nullptr).
void* numa_alloc(size_t bytes, int node);
void numa_free(void* p, size_t bytes) noexcept;

// Pins the worker threads that join `arena` to the PUs of `node` and restores their previous
// binding when they leave (TBB workers are shared by all arenas of the process). The thread that calls
// arena.execute() is not touched: it belongs to the application. Destroy before the arena.
class NodePinningObserver final : public tbb::task_scheduler_observer {
 public:
  NodePinningObserver(tbb::task_arena& arena, const Topology& topology, int node);
  ~NodePinningObserver() override;
  NodePinningObserver(const NodePinningObserver&) = delete;
  NodePinningObserver& operator=(const NodePinningObserver&) = delete;

  void on_scheduler_entry(bool is_worker) override;
  void on_scheduler_exit(bool is_worker) override;
  // How many worker entries were pinned successfully / failed (for tests and diagnostics).
  int64_t pinned_entries() const { return pinned_.load(std::memory_order_relaxed); }
  int64_t failed_entries() const { return failed_.load(std::memory_order_relaxed); }

 private:
  const Topology& topology_;
  int node_;
  std::atomic<int64_t> pinned_{0};
  std::atomic<int64_t> failed_{0};
};

// True when SPECONTEXT_VERBOSE is set to anything but "" or "0".
bool verbose_logging();

}  // namespace specontext::cpu
