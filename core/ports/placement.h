// Where the KV cache lives: the engine's tiers as plain values, the placement it applies, and the
// policy interface the planner implements (planner::PlannerPolicy). The engine applies
// placements; it never decides them itself (DESIGN.md: the planner is pure, the engine applies).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/base/ids.h"
#include "core/base/memory.h"
#include "core/base/status.h"

namespace specontext {

enum class TierKind : uint8_t { kDevice, kHost, kRemote };
std::string_view tier_kind_name(TierKind kind);  // "device", "host", "remote"

// One memory pool of the engine. TierId values follow the planner's scheme: 0 = device,
// 1..N = host pools (NUMA nodes) in the order given, N+1.. = remote nodes.
struct TierDescription {
  TierId id;
  TierKind kind = TierKind::kDevice;
  int32_t index = 0;  // NUMA node, or remote rank
  std::string name;   // "device", "host0", "remote0"
  MemoryKind memory = MemoryKind::kHost;
  uint64_t capacity_bytes = 0;
  double bandwidth_bps = 0;  // measured to the device (probe); 0 = unknown
};

// What the engine applies: the home tier of every layer's KV, and of the retrieval head's keys.
struct KvPlacement {
  std::vector<TierId> layer_home;  // [n_layers]
  TierId head_cache_home{0};       // device, or a host pool when CPU filtering is on
  bool cpu_filtering = false;      // CPU workers shortlist the head's candidates
  bool operator==(const KvPlacement&) const = default;
};

// What a policy sees between steps.
struct PlacementInput {
  std::vector<int64_t> seq_lens;  // live sequences
  KvPlacement current;
  std::vector<TierDescription> tiers;
  std::vector<uint64_t> tier_used_bytes;  // [tiers], what the engine holds in each now
  // Device bytes the engine holds beyond what the planner's memory model counts (working sets of
  // resident layers, staging pages, allocation rounding): the policy plans with that much less.
  uint64_t device_other_bytes = 0;
};

struct PlacementDecision {
  KvPlacement placement;
  bool changed = false;
  std::vector<std::string> reasons;  // one per change, for logs and JSON
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  // The placement for the lengths in `in` (called after every forward). Errors only for
  // conditions nothing can fix (the engine reports them); a tight fit is the planner's job.
  virtual Result<PlacementDecision> decide(const PlacementInput& in) = 0;
  // Whether one more sequence that will reach `final_length` tokens fits beside the live ones.
  // kResourceExhausted names what does not fit. `alone` asks the same with no other sequence
  // live (a request refused alone can never run).
  virtual Status admit(const PlacementInput& in, int64_t final_length, bool alone) = 0;
};

}  // namespace specontext
