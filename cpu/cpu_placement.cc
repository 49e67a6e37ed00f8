// NUMA placement of the memory the CPU backend reads: KV/working-set allocations and weights.
#include <hwloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "cpu/cpu_backend.h"
#include "cpu/numa.h"

namespace specontext::cpu {

Result<std::shared_ptr<void>> CpuBackend::allocate(size_t bytes) {
  auto buf = NumaBuffer::allocate(std::max<size_t>(bytes, 1), numa_node());
  if (!buf.is_ok()) return buf.status();
  auto owner = std::make_shared<NumaBuffer>(std::move(*buf));
  void* data = owner->data();
  return std::shared_ptr<void>(owner, data);
}

namespace {

// Maps the pages of [data, data + bytes) now (they may be a file's memory map, e.g. GGUF blocks
// kept as stored), so that the first forward does not take a page fault per 4 KiB of weights
// inside its matmuls. MADV_POPULATE_READ (Linux 5.14) does it in one call; elsewhere one byte
// per page is read.
void prefault(const void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
#ifdef MADV_POPULATE_READ
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
#endif
  unsigned char sink = 0;
  for (uintptr_t p = reinterpret_cast<uintptr_t>(data); p < end; p = (p / page + 1) * page) {
    sink ^= *reinterpret_cast<const volatile unsigned char*>(p);
  }
  static_cast<void>(sink);
}

}  // namespace

Status CpuBackend::place_weights(const Model& model) {
  weight_bytes_bound_ = 0;
  for (const WeightMatrix* w : model.matrices()) prefault(w->data, w->bytes());
  if (!memory_binding_supported()) return Status::ok();
  auto topo = system_topology();
  if (!topo.is_ok()) return Status::ok();  // placement is an optimisation, never a failure
  hwloc_topology_t t = (*topo)->handle();
  hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(numa_node()));
  if (node == nullptr) return Status::ok();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  auto bind = [&](const void* data, size_t bytes) {
    if (data == nullptr || bytes < page) return;
    // Only whole pages inside the tensor: neighbours may belong to other tensors.
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end <= begin) return;
    const int rc = hwloc_set_area_membind(t, reinterpret_cast<const void*>(begin), end - begin, node->nodeset,
                                          HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_MIGRATE);
    if (rc == 0) {
      weight_bytes_bound_ += static_cast<int64_t>(end - begin);
    } else if (std::getenv("SPECONTEXT_VERBOSE") != nullptr) {
      std::fprintf(stderr, "specontext: could not bind %zu weight bytes to NUMA node %d\n",
                   static_cast<size_t>(end - begin), numa_node());
    }
  };
  auto bind_matrix = [&](const WeightMatrix& w) { bind(w.data, w.bytes()); };
  bind_matrix(model.tok_embeddings);
  for (const auto& l : model.layers) {
    for (const WeightMatrix* w : l.matrices()) bind_matrix(*w);
  }
  if (model.lm_head.data != model.tok_embeddings.data) bind_matrix(model.lm_head);
  return Status::ok();
}

}  // namespace specontext::cpu
