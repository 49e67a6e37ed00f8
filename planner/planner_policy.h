// The engine's placement policy (core/ports/placement.h) over the pure planner. This is the one
// stateful piece of planner/: it keeps the last Plan so that replan() can apply hysteresis; it
// still measures, allocates and touches nothing.
#pragma once

#include <memory>
#include <optional>

#include "core/ports/placement.h"
#include "planner/plan.h"
#include "planner/snapshot.h"

namespace specontext::planner {

struct PolicyConfig {
  // Model shape, budget, requests R, M_O, M_D, element bytes, bandwidths, shortlist size. Its
  // device_bytes, host/remote capacities and seq_lens are replaced by the engine's each call:
  // the device capacity becomes the engine's device tier less the bytes the memory model does not
  // count (PlacementInput::device_other_bytes), plus the weight reserve the thresholds subtract.
  PlannerSnapshot base;
  HysteresisOptions hysteresis;
  bool allow_cpu_filtering = true;  // false: a plan that needs filtering is refused instead
  // Tokens per KV page, a layer's chunk bytes and the head's key block bytes of the engine:
  // lengths are rounded up to whole pages; each layer placed off the device is charged one chunk
  // beyond its KV, and the head's keys one block per sequence (allocation granularity,
  // PlannerSnapshot::layer_slack_bytes / head_cache_slack_bytes).
  int64_t page_size = 16;
  uint64_t chunk_bytes = 0;
  uint64_t head_block_bytes = 0;
};

class PlannerPolicy final : public PlacementPolicy {
 public:
  static Result<std::unique_ptr<PlannerPolicy>> create(const PolicyConfig& config);

  Result<PlacementDecision> decide(const PlacementInput& in) override;
  Status admit(const PlacementInput& in, int64_t final_length, bool alone) override;

  // The snapshot the last decide() planned with, and its plan.
  const std::optional<Plan>& last_plan() const { return last_; }
  const PlannerSnapshot& last_snapshot() const { return last_snapshot_; }
  // Thresholds S^T_0..S^T_L for the current device capacity.
  Result<std::vector<int64_t>> current_thresholds() const { return thresholds(last_snapshot_); }

 private:
  explicit PlannerPolicy(const PolicyConfig& config) : config_(config) {}
  Result<PlannerSnapshot> snapshot_for(const PlacementInput& in, const std::vector<int64_t>& lens) const;

  PolicyConfig config_;
  std::optional<Plan> last_;
  PlannerSnapshot last_snapshot_;
};

// Converts a plan's homes into what the engine applies.
KvPlacement placement_of(const Plan& plan);

}  // namespace specontext::planner
