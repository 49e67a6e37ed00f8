// Elastic loading (SpeContext §2.3): the working set of a (sequence, layer) holds, per KV head,
// the tokens selected at the previous step in fixed slots. A new selection loads only
// S_now − S_last, into the slots freed by S_last − S_now, in place.
#pragma once

#include <cstdint>
#include <vector>

#include "core/ports/backend.h"
#include "core/ports/selection.h"

namespace specontext {

struct ElasticStats {
  int64_t tokens_selected = 0;  // Σ_heads |S_now|
  int64_t tokens_loaded = 0;    // Σ_heads |S_now − S_last|
  int64_t tokens_kept = 0;      // Σ_heads |S_now ∩ S_last|
  double overlap() const { return tokens_selected ? double(tokens_kept) / double(tokens_selected) : 0.0; }
};

class ElasticWorkingSet {
 public:
  ElasticWorkingSet() = default;
  ElasticWorkingSet(int64_t kv_heads, int64_t slots);

  // Computes the loads that turn the slot contents into `now` and updates the slot map as if they
  // were done. Appends GatherEntry{head, token, slot} to `loads`; returns this update's stats.
  // After the loads, slots [0, counts[h]) of head h hold exactly the tokens of now.head(h).
  ElasticStats update(const Selection& now, std::vector<GatherEntry>& loads);

  int64_t kv_heads() const { return kv_heads_; }
  int64_t slots() const { return slots_; }
  const std::vector<int32_t>& counts() const { return counts_; }
  // Token held by a slot (-1 when empty).
  int32_t token_at(int64_t head, int64_t slot) const { return slot_token_[static_cast<size_t>(head * slots_ + slot)]; }
  // The whole slot map, [kv_heads][slots] (-1 where empty): the indices of the tokens a working set
  // holds, in slot order (Backend::attention_indexed reads a device-homed layer's KV by it).
  const std::vector<int32_t>& slot_tokens() const { return slot_token_; }
  void clear();

 private:
  int64_t kv_heads_ = 0;
  int64_t slots_ = 0;
  std::vector<int32_t> slot_token_;  // [kv_heads][slots]
  std::vector<int32_t> counts_;      // [kv_heads]
  std::vector<int32_t> scratch_;
};

}  // namespace specontext
