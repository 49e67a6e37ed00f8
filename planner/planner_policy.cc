#include "planner/planner_policy.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace specontext::planner {

namespace {

}  // namespace

KvPlacement placement_of(const Plan& plan) {
  KvPlacement p;
  for (const LayerPlacement& l : plan.layers) p.layer_home.push_back(l.home);
  p.head_cache_home = plan.head_cache_home.valid() ? plan.head_cache_home : TierId(0);
  p.cpu_filtering = plan.cpu_filtering;
  return p;
}

Result<std::unique_ptr<PlannerPolicy>> PlannerPolicy::create(const PolicyConfig& config) {
  if (config.page_size <= 0) return invalid_argument("planner policy: page_size must be positive");
  PlannerSnapshot probe = config.base;
  probe.seq_lens.clear();
  if (probe.device_bytes <= 0) probe.device_bytes = 1;
  SPX_RETURN_IF_ERROR_CTX(validate_snapshot(probe), "planner policy");
  return std::unique_ptr<PlannerPolicy>(new PlannerPolicy(config));
}

Result<PlannerSnapshot> PlannerPolicy::snapshot_for(const PlacementInput& in, const std::vector<int64_t>& lens) const {
  PlannerSnapshot s = config_.base;
  const size_t n_host = s.host.size(), n_remote = s.remote.size();
  if (in.tiers.size() < 1 + n_host + n_remote) {
    return invalid_argument("planner policy: the engine has " + std::to_string(in.tiers.size()) + " tiers, the plan " +
                            std::to_string(1 + n_host + n_remote));
  }
  const int64_t reserve = weights_bytes(s);
  const int64_t device = static_cast<int64_t>(in.tiers[0].capacity_bytes) - static_cast<int64_t>(in.device_other_bytes);
  if (device <= 0 && reserve <= 0) {
    return resource_exhausted("the device tier (" + format_bytes(static_cast<int64_t>(in.tiers[0].capacity_bytes)) +
                              ") is not larger than what the engine needs there beside KV pages and the head's keys (" +
                              format_bytes(static_cast<int64_t>(in.device_other_bytes)) +
                              ": working sets, staging, growth reserve); give the device more memory, or use fewer "
                              "requests or a smaller budget");
  }
  s.device_bytes = std::max<int64_t>(device, 0) + reserve;
  // The pools' own capacities: allocation granularity is charged to what each pool is given (a
  // chunk per layer placed there, a key block per sequence for the head's keys), not taken off
  // every pool for every layer. That took 5 chunks (80 KiB) off a 64 KiB host pool that only had
  // to hold the head's keys, and refused the run as "host0 0 B free of 0 B".
  for (size_t i = 0; i < n_host; ++i) s.host[i].capacity_bytes = static_cast<int64_t>(in.tiers[1 + i].capacity_bytes);
  for (size_t i = 0; i < n_remote; ++i) {
    s.remote[i].capacity_bytes = static_cast<int64_t>(in.tiers[1 + n_host + i].capacity_bytes);
  }
  s.layer_slack_bytes = static_cast<int64_t>(config_.chunk_bytes);
  s.head_cache_slack_bytes = static_cast<int64_t>(config_.head_block_bytes * lens.size());
  s.seq_lens.clear();
  for (int64_t len : lens) s.seq_lens.push_back((len + config_.page_size - 1) / config_.page_size * config_.page_size);
  return s;
}

Result<PlacementDecision> PlannerPolicy::decide(const PlacementInput& in) {
  SPX_ASSIGN_OR_RETURN(PlannerSnapshot s, snapshot_for(in, in.seq_lens));
  Result<Plan> p = last_ ? replan(*last_, s, config_.hysteresis) : plan(s);
  if (!p.is_ok()) return p.status();
  if (p->cpu_filtering && !config_.allow_cpu_filtering) {
    return resource_exhausted("the retrieval head's keys no longer fit the device and CPU filtering is off (S = " +
                              std::to_string(p->seq_len) + " >= S^T_L = " + std::to_string(p->thresholds.back()) + ")");
  }
  PlacementDecision d;
  d.placement = placement_of(*p);
  d.changed = !(d.placement == in.current);
  for (const Migration& m : p->migrations) d.reasons.push_back(m.reason);
  if (!last_ && d.changed) {
    d.reasons.push_back("initial plan at S = " + std::to_string(p->seq_len) + ": " + std::to_string(p->offloaded_layers) +
                        " layers offloaded (S^T_0 = " + std::to_string(p->thresholds.front()) + ")");
  }
  last_ = *p;
  last_snapshot_ = s;
  return d;
}

Status PlannerPolicy::admit(const PlacementInput& in, int64_t final_length, bool alone) {
  std::vector<int64_t> lens = alone ? std::vector<int64_t>{} : in.seq_lens;
  lens.push_back(final_length);
  Result<PlannerSnapshot> snap = snapshot_for(in, lens);
  if (snap.status().code() == StatusCode::kResourceExhausted) {
    return resource_exhausted("a sequence of " + std::to_string(final_length) + " tokens cannot be placed: " +
                              snap.status().message());
  }
  SPX_ASSIGN_OR_RETURN(PlannerSnapshot s, std::move(snap));
  if (static_cast<int64_t>(lens.size()) > s.requests) {
    return resource_exhausted("the plan is sized for " + std::to_string(s.requests) + " requests");
  }
  Result<Plan> p = plan(s);
  if (!p.is_ok()) {
    return resource_exhausted("a sequence of " + std::to_string(final_length) + " tokens cannot be placed" +
                              (alone ? "" : " beside the " + std::to_string(in.seq_lens.size()) + " live ones") + ": " +
                              p.status().message());
  }
  if (p->cpu_filtering && !config_.allow_cpu_filtering) {
    return resource_exhausted("a sequence of " + std::to_string(final_length) +
                              " tokens needs CPU filtering, which is off");
  }
  return Status::ok();
}

}  // namespace specontext::planner
