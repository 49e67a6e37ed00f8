#include "cluster/replica_events.h"

#include <algorithm>
#include <cstdio>

namespace specontext::cluster {

namespace {

std::string bytes_text(uint64_t bytes) {
  char buf[48];
  if (bytes >= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  } else if (bytes >= (uint64_t{1} << 10)) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

std::string why(const transport::ReplicaReport& r) { return r.error.empty() ? "no reason given" : r.error; }

}  // namespace

std::vector<std::string> ReplicaEventLog::update(const std::vector<TierReplicas>& tiers) {
  std::vector<std::string> lines;
  for (const TierReplicas& t : tiers) {
    const std::string tier = "kv-node: tier " + t.name;
    const auto& now = t.replicas;
    auto [it, fresh] = last_.try_emplace(t.tier);
    std::vector<transport::ReplicaReport>& before = it->second;
    if (fresh) {
      before = now;
      for (auto& r : before) {
        r.alive = true;
        r.error.clear();
      }
    }
    before.resize(now.size());  // a fixed count; guards against a caller that changes it
    std::vector<size_t> died;
    for (size_t i = 0; i < now.size(); ++i) {
      const transport::ReplicaReport& b = before[i];
      const transport::ReplicaReport& n = now[i];
      const bool rejoined = n.rejoins > b.rejoins;
      if (rejoined) {
        std::string line = tier + ": replica " + std::to_string(i) + " rejoined on " + n.node;
        if (!b.node.empty() && b.node != n.node) line += " (a spare; it was on " + b.node + ")";
        line += ": " + bytes_text(n.bytes_resynced - std::min(n.bytes_resynced, b.bytes_resynced)) +
                " copied from a live replica";
        lines.push_back(std::move(line));
      }
      if (!n.alive && (b.alive || rejoined)) died.push_back(i);
    }
    deaths_ += static_cast<int64_t>(died.size());
    std::vector<std::string> live;
    for (const auto& r : now) {
      if (r.alive) live.push_back(r.node);
    }
    if (!live.empty()) {
      reported_lost_[t.tier] = false;
      std::string goes_on;
      for (const std::string& n : live) goes_on += (goes_on.empty() ? "" : ", ") + n;
      for (size_t i : died) {
        lines.push_back(tier + ": replica " + std::to_string(i) + " on " + now[i].node + " is dead (" + why(now[i]) +
                        "); reads fail over, the tier goes on on " + goes_on);
      }
    } else if (!now.empty() && (!died.empty() || !reported_lost_[t.tier])) {
      std::string dead;
      for (const auto& r : now) dead += (dead.empty() ? "" : "; ") + r.node + ": " + why(r);
      lines.push_back(tier + " lost: no replica alive (" + dead + ")" +
                      (t.lost_note.empty() ? "" : "; " + t.lost_note));
      reported_lost_[t.tier] = true;
    }
    before = now;
  }
  return lines;
}

}  // namespace specontext::cluster
