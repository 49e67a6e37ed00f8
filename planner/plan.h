// Memory model (paper §6, Eq. 6–8, Algorithms 1–2) generalised to three tiers: device HBM, host
// NUMA nodes, remote nodes. Pure functions: snapshot in, plan out. See planner/README.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/placement.h"
#include "planner/snapshot.h"

namespace specontext::planner {

// Tier kinds are core's (core/ports/placement.h), so plans and the engine's tiers speak one vocabulary.
using specontext::TierKind;
using specontext::tier_kind_name;

// Tier ids are stable for a given snapshot layout: 0 = device, 1..N = host pools in snapshot order,
// N+1.. = remote pools in snapshot order. Preference order (by bandwidth) is separate.
struct TierInfo {
  TierId id;
  TierKind kind = TierKind::kDevice;
  int32_t index = 0;          // NUMA node or remote rank
  std::string name;           // "device", "host0", "remote1"
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;     // what this plan puts there
  double bandwidth_bps = 0;   // to the device (host: measured; remote: its link)
  bool operator==(const TierInfo&) const = default;
};

struct LayerPlacement {
  LayerId layer;
  TierId home;
  int64_t kv_bytes = 0;  // this layer's full K+V for all live sequences: Σ S_r · H · D · 2 · elem
  bool operator==(const LayerPlacement&) const = default;
};

// Device bytes by purpose. The paper's Eq. 7 with the factor-4 fix, kvc = 2·elem_bytes:
// weights + kvc·H·D·[(L − i)·ΣS + (1 + α)·ΣS + i·R·B].
struct DeviceUsage {
  int64_t capacity_bytes = 0;
  int64_t weights_bytes = 0;       // ceil(runtime_factor · (M_O + M_D))
  int64_t resident_kv_bytes = 0;   // layers whose home is the device
  int64_t retrieval_bytes = 0;     // (1+α) term: head K cache + GQA expansion (shortlist-sized when filtering)
  int64_t staging_bytes = 0;       // B-token buffer per offloaded layer per request
  int64_t total_bytes = 0;
  bool operator==(const DeviceUsage&) const = default;
};

enum class MigrationItem : uint8_t { kLayerKv, kHeadKCache };

struct Migration {
  MigrationItem item = MigrationItem::kLayerKv;
  LayerId layer;  // invalid for kHeadKCache
  TierId from;
  TierId to;
  int64_t bytes = 0;
  double est_seconds = 0;  // bytes / measured bandwidth of the path; 0 when unmeasured
  std::string reason;
  bool operator==(const Migration&) const = default;
};

struct Plan {
  int64_t requests = 0;
  int64_t budget = 0;
  int64_t kv_elem_bytes = 0;
  int64_t seq_len = 0;       // effective S = ceil(Σ S_r / R)
  int64_t total_tokens = 0;  // Σ S_r
  std::vector<int64_t> thresholds;  // S^T_0 .. S^T_L
  int64_t offloaded_layers = 0;     // the last `offloaded_layers` layers live off the device
  bool cpu_filtering = false;       // retrieval head's K cache on host; CPU shortlists candidates
  TierId head_cache_home;           // device, or a host tier when cpu_filtering
  int64_t head_cache_bytes = 0;     // Σ S_r · H_head · D · elem (K only)
  std::vector<LayerPlacement> layers;
  std::vector<TierInfo> tiers;      // indexed by TierId value
  DeviceUsage device;
  std::vector<Migration> migrations;  // what replan() changed relative to the previous plan
  bool operator==(const Plan&) const = default;
};

struct HysteresisOptions {
  // Layers come back (and tiers are re-entered) only with this much room: S < S^T_i · (1 − margin).
  double margin = 0.10;
};

// Algorithm 2 with the factor-4 fix; element i is S^T_i for i = 0..L, the longest per-request length
// below which i offloaded layers fit the device is S^T_i − 1 (Algorithm 1 offloads when S ≥ S^T_i).
// Clamped at 0 (0 = not even an empty context fits).
Result<std::vector<int64_t>> thresholds(const PlannerSnapshot& s);

// Smallest i with S < S^T_i, or L + 1 when even all layers offloaded do not fit.
int64_t layers_to_offload(const std::vector<int64_t>& thresholds, int64_t seq_len);

// A fresh plan for the snapshot. ResourceExhausted names what fits nowhere.
Result<Plan> plan(const PlannerSnapshot& s);

// The next plan from the current one: offloads at once when S crosses S^T_i, brings layers (and the
// head's K cache, and items on slower tiers) back only with `margin` of room. Every change is a
// Migration with a reason. The snapshot must describe the same tiers as `current`.
Result<Plan> replan(const Plan& current, const PlannerSnapshot& now, const HysteresisOptions& opts = {});

// The device reserve W = ceil(runtime_factor · (M_O + M_D)) that the thresholds subtract (exact
// integers are kept: 1.3 · 100 is 130).
int64_t weights_bytes(const PlannerSnapshot& s);

// "1.50 GiB"-style rendering for messages and tables.
std::string format_bytes(int64_t bytes);

}  // namespace specontext::planner
