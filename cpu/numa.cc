#include "cpu/numa.h"

#include <hwloc.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

namespace specontext::cpu {
namespace {

struct BitmapDeleter {
  void operator()(hwloc_bitmap_s* b) const noexcept { hwloc_bitmap_free(b); }
};
using Bitmap = std::unique_ptr<hwloc_bitmap_s, BitmapDeleter>;

Bitmap make_bitmap() { return Bitmap(hwloc_bitmap_alloc()); }

constexpr size_t kPageBytes = 4096;

hwloc_obj_t numa_obj(hwloc_topology_t t, int node) {
  if (node < 0) return nullptr;
  return hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
}

}  // namespace

bool verbose_logging() {
  const char* v = std::getenv("SPECONTEXT_VERBOSE");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// ---------------------------------------------------------------------------------------------
// Topology

void Topology::Deleter::operator()(hwloc_topology* t) const noexcept { hwloc_topology_destroy(t); }

Result<Topology> Topology::load() {
  hwloc_topology_t t = nullptr;
  if (hwloc_topology_init(&t) != 0) {
    return unavailable(std::string("hwloc_topology_init failed: ") + std::strerror(errno));
  }
  Topology topo(t);  // owns t from here, also on the error path below
  if (hwloc_topology_load(t) != 0) {
    return unavailable(std::string("hwloc_topology_load failed: ") + std::strerror(errno));
  }
  return topo;
}

int Topology::num_numa_nodes() const {
  const int n = hwloc_get_nbobjs_by_type(topo_.get(), HWLOC_OBJ_NUMANODE);
  return n > 0 ? n : 1;  // hwloc 2 always reports one; be safe anyway
}

int Topology::pus_in_node(int node) const {
  hwloc_obj_t obj = numa_obj(topo_.get(), node);
  if (obj == nullptr || obj->cpuset == nullptr) return 0;
  return static_cast<int>(hwloc_get_nbobjs_inside_cpuset_by_type(topo_.get(), obj->cpuset, HWLOC_OBJ_PU));
}

int Topology::cores_in_node(int node) const {
  hwloc_obj_t obj = numa_obj(topo_.get(), node);
  if (obj == nullptr || obj->cpuset == nullptr) return 0;
  const int cores =
      static_cast<int>(hwloc_get_nbobjs_inside_cpuset_by_type(topo_.get(), obj->cpuset, HWLOC_OBJ_CORE));
  return cores > 0 ? cores : pus_in_node(node);
}

int Topology::node_of_current_thread() const {
  Bitmap where = make_bitmap();
  if (!where || hwloc_get_last_cpu_location(topo_.get(), where.get(), HWLOC_CPUBIND_THREAD) != 0) {
    return 0;
  }
  const int n = num_numa_nodes();
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t obj = numa_obj(topo_.get(), i);
    if (obj != nullptr && obj->cpuset != nullptr && hwloc_bitmap_intersects(obj->cpuset, where.get())) {
      return i;
    }
  }
  return 0;
}

Status Topology::bind_current_thread_to_node(int node) const {
  hwloc_obj_t obj = numa_obj(topo_.get(), node);
  if (obj == nullptr || obj->cpuset == nullptr) {
    return invalid_argument("NUMA node " + std::to_string(node) + " does not exist (machine has " +
                            std::to_string(num_numa_nodes()) + ")");
  }
  if (hwloc_set_cpubind(topo_.get(), obj->cpuset, HWLOC_CPUBIND_THREAD) != 0) {
    return unavailable(std::string("hwloc_set_cpubind: ") + std::strerror(errno));
  }
  return Status::ok();
}

bool Topology::current_thread_bound_within(int node) const {
  hwloc_obj_t obj = numa_obj(topo_.get(), node);
  Bitmap set = make_bitmap();
  if (obj == nullptr || obj->cpuset == nullptr || !set) return false;
  if (hwloc_get_cpubind(topo_.get(), set.get(), HWLOC_CPUBIND_THREAD) != 0) return false;
  return hwloc_bitmap_isincluded(set.get(), obj->cpuset) != 0;
}

Result<const Topology*> system_topology() {
  // Leaked on purpose: memory freed during static destruction still needs it.
  static const Result<const Topology*> topo = []() -> Result<const Topology*> {
    auto loaded = Topology::load();
    if (!loaded.is_ok()) return loaded.status();
    return static_cast<const Topology*>(new Topology(std::move(loaded).value()));
  }();
  return topo;
}

// ---------------------------------------------------------------------------------------------
// Memory

bool memory_binding_supported() {
  static const bool supported = [] {
    auto topo = system_topology();
    std::string why;
    bool ok = false;
    if (!topo.is_ok()) {
      why = topo.status().to_string();
    } else {
      hwloc_topology_t t = (*topo)->handle();
      const hwloc_topology_support* sup = hwloc_topology_get_support(t);
      hwloc_obj_t node0 = numa_obj(t, 0);
      if (sup == nullptr || sup->membind == nullptr || !sup->membind->alloc_membind) {
        why = "hwloc reports no alloc_membind support";
      } else if (node0 == nullptr || node0->nodeset == nullptr) {
        why = "no NUMA node object";
      } else {
        // A strict trial tells whether the kernel/container really honours mbind.
        void* p = hwloc_alloc_membind(t, kPageBytes, node0->nodeset, HWLOC_MEMBIND_BIND,
                                      HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT);
        if (p == nullptr) {
          why = std::string("trial hwloc_alloc_membind failed: ") + std::strerror(errno);
        } else {
          hwloc_free(t, p, kPageBytes);
          ok = true;
        }
      }
    }
    if (!ok && verbose_logging()) {
      std::fprintf(stderr, "[specontext cpu] NUMA memory binding unavailable (%s); using aligned_alloc\n",
                   why.c_str());
    }
    return ok;
  }();
  return supported;
}

void* numa_alloc(size_t bytes, int node) {
  if (bytes == 0) return nullptr;
  if (node < 0) node = 0;
  auto topo = system_topology();
  if (topo.is_ok() && node >= (*topo)->num_numa_nodes()) return nullptr;
  if (memory_binding_supported()) {
    hwloc_topology_t t = (*topo)->handle();
    // Not strict: if one range cannot be bound hwloc still returns memory that hwloc_free frees.
    return hwloc_alloc_membind(t, bytes, numa_obj(t, node)->nodeset, HWLOC_MEMBIND_BIND,
                               HWLOC_MEMBIND_BYNODESET);
  }
  if (bytes > SIZE_MAX - kPageBytes) return nullptr;
  const size_t rounded = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  return std::aligned_alloc(kPageBytes, rounded);
}

void numa_free(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  // memory_binding_supported() is fixed for the process, so it names the allocator that was used.
  if (memory_binding_supported()) {
    hwloc_free((*system_topology())->handle(), p, bytes);
  } else {
    std::free(p);
  }
}

NumaBuffer::~NumaBuffer() { release(); }

NumaBuffer::NumaBuffer(NumaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      node_(other.node_),
      bound_(std::exchange(other.bound_, false)) {}

NumaBuffer& NumaBuffer::operator=(NumaBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    node_ = other.node_;
    bound_ = std::exchange(other.bound_, false);
  }
  return *this;
}

void NumaBuffer::release() noexcept {
  numa_free(data_, size_);
  data_ = nullptr;
  size_ = 0;
  bound_ = false;
}

Result<NumaBuffer> NumaBuffer::allocate(size_t bytes, int node) {
  if (node < 0) node = 0;
  auto topo = system_topology();
  if (topo.is_ok() && node >= (*topo)->num_numa_nodes()) {
    return invalid_argument("NUMA node " + std::to_string(node) + " does not exist (machine has " +
                            std::to_string((*topo)->num_numa_nodes()) + ")");
  }
  NumaBuffer buf;
  buf.node_ = node;
  if (bytes == 0) return buf;
  buf.data_ = numa_alloc(bytes, node);
  if (buf.data_ == nullptr) {
    return resource_exhausted("cannot allocate " + std::to_string(bytes) + " bytes on NUMA node " +
                              std::to_string(node));
  }
  buf.size_ = bytes;
  buf.bound_ = memory_binding_supported();
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Thread pinning

namespace {
// Per worker thread: the binding to restore when it leaves a pinned arena. Nesting depth guards
// against an observer seeing entry twice before exit.
thread_local Bitmap t_saved_binding;
thread_local int t_pin_depth = 0;
}  // namespace

NodePinningObserver::NodePinningObserver(tbb::task_arena& arena, const Topology& topology, int node)
    : tbb::task_scheduler_observer(arena), topology_(topology), node_(node) {
  observe(true);
}

NodePinningObserver::~NodePinningObserver() { observe(false); }

void NodePinningObserver::on_scheduler_entry(bool is_worker) {
  if (!is_worker) return;
  if (t_pin_depth++ > 0) return;
  hwloc_topology_t t = topology_.handle();
  if (!t_saved_binding) t_saved_binding = make_bitmap();
  if (!t_saved_binding || hwloc_get_cpubind(t, t_saved_binding.get(), HWLOC_CPUBIND_THREAD) != 0) {
    t_saved_binding.reset();
  }
  if (topology_.bind_current_thread_to_node(node_).is_ok()) {
    pinned_.fetch_add(1, std::memory_order_relaxed);
  } else {
    failed_.fetch_add(1, std::memory_order_relaxed);
  }
}

void NodePinningObserver::on_scheduler_exit(bool is_worker) {
  if (!is_worker || t_pin_depth == 0) return;
  if (--t_pin_depth > 0) return;
  if (t_saved_binding) {
    // Best effort: failure leaves the worker on this node, which is still a valid placement.
    (void)hwloc_set_cpubind(topology_.handle(), t_saved_binding.get(), HWLOC_CPUBIND_THREAD);
  }
}

}  // namespace specontext::cpu
