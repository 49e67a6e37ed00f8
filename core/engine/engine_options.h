// The engine's options: how decode steps choose their tokens (SparseOptions), where KV lives
// (TieringOptions) and the engine's limits (EngineOptions). Plain data, checked by Engine::create.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "core/base/status.h"
#include "core/engine/kv_store.h"
#include "core/ports/candidate_filter.h"
#include "core/ports/communicator.h"
#include "core/ports/copy_queue.h"
#include "core/ports/placement.h"
#include "core/ports/selection.h"
#include "core/sparse/retrieval_head.h"

namespace specontext {

// How decode steps choose the tokens they attend to.
enum class SparseMethod {
  kDense,       // every cached token
  kSpeContext,  // retrieval head: one selection per step before layer 0, shared by all layers
  kStreaming,   // sinks + recent window (StreamingLLM)
  kQuest,       // per layer, pages ranked by the min/max key bound (Quest)
  kOracle,      // per layer, the true attention's top tokens (upper bound; costs dense attention)
};
std::string_view sparse_method_name(SparseMethod m);
Result<SparseMethod> parse_sparse_method(std::string_view name);

struct SparseOptions {
  SparseMethod method = SparseMethod::kDense;
  SelectionOptions selection;    // budget, sinks, window
  int64_t quest_page_size = 16;  // Quest page granularity (tokens)
};

// KV tiers (issue: tiers, prefetch, planner). Without host or remote tiers every layer lives on
// the device and nothing moves. With them, a PlacementPolicy (planner::PlannerPolicy) decides
// before every step which layers live where; offloaded layers' KV is loaded through `copies`
// while earlier layers compute (SpeContext's asynchronous prefetch with elastic loading).
struct TieringOptions {
  // Bytes of device memory for KV pages, working sets, staging pages and the retrieval head's
  // keys (tier 0). 0 = enough to hold every sequence at max_context on the device.
  uint64_t device_bytes = 0;
  std::vector<TierMemory> host;             // one pool per NUMA node (ids 1..N), memory owned by the caller
  std::vector<TierMemory> remote;           // remote nodes (ids N+1..), no base address
  Transport* transport = nullptr;           // moves bytes between tiers; the engine registers the tiers
  std::shared_ptr<CopyQueue> copies;        // runs transfers on its own thread, over `transport`
  std::shared_ptr<PlacementPolicy> policy;  // null: every layer stays on the device
  std::shared_ptr<CandidateFilter> candidate_filter;  // used while the placement says cpu_filtering
  int64_t shortlist_tokens = 0;  // candidates per KV head with CPU filtering; 0 = 4·budget
  // Remote layers whose whole cached KV is staged on the device at once, for items that read
  // whole pages (dense attention, per-layer selections, sequences not yet past the budget): the
  // loads of remote layer j + staging_layers start once layer j has computed. 1 = no overlap.
  int64_t staging_layers = 2;
  // Called at the start of every forward that passed validation, on the caller's thread, before
  // the step moves anything (transfers of earlier steps may still be in flight on `copies`). The
  // CLI heals mirrored remote tiers here (cluster/replica_healer.h). Null: nothing.
  std::function<void()> between_steps;
};

struct EngineOptions {
  int64_t max_sequences = 16;  // live sequences at once
  // Sequences that decode at once (0 = max_sequences): the KV pool (kv_pages = 0) and the device's
  // working sets and retrieval-head blocks are sized for this many at max_context. The slots
  // beyond it are for sequences that wait (finished ones a prefix cache keeps) and share the pool.
  int64_t max_running = 0;
  int64_t running_slots() const { return max_running > 0 ? max_running : max_sequences; }
  int64_t max_context = 0;     // tokens per sequence; 0 = the model's max_seq_len
  int64_t page_size = 16;      // tokens per KV page
  int64_t kv_pages = 0;        // pages in the pool; 0 = enough for running_slots() at max_context
  int64_t kv_chunk_pages = 0;  // pages per storage chunk of a layer; 0 = about 2 MiB (KvStore)
  // Element type of K and V in the cache and the working sets: f32, f16 or bf16 (is_kv_dtype).
  // Attention widens to f32; kv_append rounds to nearest even.
  DType kv_dtype = DType::kF32;
  SparseOptions sparse;
  std::shared_ptr<const RetrievalHead> retrieval_head;  // required by SparseMethod::kSpeContext
  // Tensor parallelism: this engine runs one rank's slice of the model (shard_model in
  // core/engine/tensor_parallel.h) and sums the attention-out and MLP-down partials over the ranks.
  // Null: a single rank.
  std::shared_ptr<Communicator> communicator;
  TieringOptions tiering;
  // Lets fork_sequence start a sequence from any page boundary of another: with SpeContext the
  // engine then also keeps the fused features at each page's last position (3·dim floats per
  // page in backend memory), which the retrieval head needs to go on from there.
  bool prefix_sharing = false;
};

}  // namespace specontext
