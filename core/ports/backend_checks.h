// Argument checks that more than one backend makes on the same Backend structs, so that the CPU
// and CUDA backends reject the same inputs with the same messages. Not a public API.
#pragma once

#include <cstdint>

#include "core/base/status.h"
#include "core/ports/backend.h"

namespace specontext {

// Shape of a working set; `need_counts`: the op reads counts (attention), so they must be sane.
// `op` prefixes the messages.
Status check_working_set(const WorkingSetView& ws, const char* op, bool need_counts);

// kv_gather entries: every (head, token, slot) inside ws and a cache of `capacity` tokens, and no
// destination (head, slot) written twice (that would be a write race in parallel backends).
// min_token / max_token, when not null, receive the token range of the entries (n_entries >= 1).
Status check_gather_entries(const GatherEntry* entries, int64_t n_entries, const WorkingSetView& ws,
                            int64_t capacity, int64_t* min_token, int64_t* max_token);

// attention_indexed: every item's view sane (positive shape, page tables, f32 / f16 / bf16), one
// head_dim for all items, n_heads a multiple of each kv_heads, rows >= 0, counts in [0, stride],
// every index in [0, kv.capacity()). All failures are kInvalidArgument naming items[i] and the
// field; O(indices).
Status check_attention_indexed_args(const IndexedAttentionItem* items, int64_t n_items, int64_t n_heads);

}  // namespace specontext
