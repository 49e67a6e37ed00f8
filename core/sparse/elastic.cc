#include "core/sparse/elastic.h"

#include <algorithm>

namespace specontext {

ElasticWorkingSet::ElasticWorkingSet(int64_t kv_heads, int64_t slots)
    : kv_heads_(kv_heads), slots_(slots), slot_token_(static_cast<size_t>(kv_heads * slots), -1),
      counts_(static_cast<size_t>(kv_heads), 0) {}

void ElasticWorkingSet::clear() {
  std::fill(slot_token_.begin(), slot_token_.end(), -1);
  std::fill(counts_.begin(), counts_.end(), 0);
}

ElasticStats ElasticWorkingSet::update(const Selection& now, std::vector<GatherEntry>& loads) {
  ElasticStats st;
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const auto want = now.head(h);  // ascending
    const size_t head_loads_begin = loads.size();
    int32_t* slot = slot_token_.data() + h * slots_;
    int32_t& count = counts_[static_cast<size_t>(h)];
    const int32_t target = static_cast<int32_t>(std::min<int64_t>(static_cast<int64_t>(want.size()), slots_));
    st.tokens_selected += target;
    // Free the slots whose token left the selection (S_last − S_now).
    std::vector<int32_t>& freed = scratch_;
    freed.clear();
    for (int32_t s = 0; s < count; ++s) {
      if (!std::binary_search(want.begin(), want.begin() + target, slot[s])) {
        freed.push_back(s);
        slot[s] = -1;
      }
    }
    st.tokens_kept += count - static_cast<int32_t>(freed.size());
    // Tokens to load (S_now − S_last): present in want, absent from the kept slots. The kept
    // tokens, sorted, make the membership test a merge.
    std::vector<int32_t> kept;
    kept.reserve(static_cast<size_t>(count));
    for (int32_t s = 0; s < count; ++s) {
      if (slot[s] >= 0) kept.push_back(slot[s]);
    }
    std::sort(kept.begin(), kept.end());
    size_t next_free = 0;
    int32_t next_new_slot = count;
    size_t k = 0;
    for (int32_t i = 0; i < target; ++i) {
      const int32_t tok = want[static_cast<size_t>(i)];
      while (k < kept.size() && kept[k] < tok) ++k;
      if (k < kept.size() && kept[k] == tok) continue;
      const int32_t s = next_free < freed.size() ? freed[next_free++] : next_new_slot++;
      slot[s] = tok;
      loads.push_back({static_cast<int32_t>(h), tok, s});
      ++st.tokens_loaded;
    }
    // If the selection shrank, holes remain below `count`: move the last valid slots down so
    // slots [0, target) are the valid ones. Moved tokens are reloaded from the cache.
    int32_t end = std::max(count, next_new_slot);
    for (; next_free < freed.size(); ++next_free) {
      const int32_t hole = freed[next_free];
      while (end > hole && slot[end - 1] < 0) --end;
      if (end - 1 <= hole) break;
      slot[hole] = slot[end - 1];
      slot[end - 1] = -1;
      // Replace a pending load to the old slot, or load the moved token afresh.
      bool retargeted = false;
      for (size_t i = head_loads_begin; i < loads.size(); ++i) {
        if (loads[i].slot == end - 1) {
          loads[i].slot = hole;
          retargeted = true;
        }
      }
      if (!retargeted) {
        loads.push_back({static_cast<int32_t>(h), slot[hole], hole});
        ++st.tokens_loaded;
      }
      --end;
    }
    count = target;
  }
  return st;
}

}  // namespace specontext
