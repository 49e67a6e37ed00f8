// The engine's KV memory (as llama.cpp's llama_memory_i stands beside llama_context::decode):
// the paged KV store across tiers, every live sequence's page table and length, the state each
// sequence derives from its KV (retrieval-head key blocks, fused features at page boundaries,
// Quest bounds, sparse working sets), forks, truncation and prefix snapshots. The Engine runs the
// forward pass over it (Engine::memory()); the placement of layers across tiers is decided by the
// engine's policy and applied by the engine (engine_tiers.cc), which records it here.
//
// Ownership: a KvMemory owns its KvStore and the store's bounce buffer; the tiers' memory is
// owned as KvStore says. It keeps the backend (the memory it allocates fused features in) and the
// model alive. Thread model: as the Engine's, one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/engine/engine_options.h"
#include "core/engine/kv_store.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/ports/placement.h"
#include "core/ports/selection.h"
#include "core/sparse/elastic.h"

namespace specontext {

// The first whole pages of a sequence copied out of the KV cache into plain host memory, with
// the state the sparse method derives from them (the prefix cache's offload store,
// GeneratorOptions::prefix_offload_bytes). KvMemory::import_prefix makes a sequence of it again in
// any engine of the same model, page size, KV dtype and sparse method, wherever its layers live.
struct PrefixSnapshot {
  int64_t tokens = 0;
  // What import_prefix checks the snapshot against (the engine's layout when exported).
  int64_t page_size = 0;
  int64_t layers = 0;
  uint64_t page_bytes = 0;  // K + V of one page of one layer
  DType kv_dtype = DType::kF32;
  SparseMethod method = SparseMethod::kDense;
  std::vector<std::byte> kv;  // [layers][pages][K block, V block], as the pages are stored
  // SpeContext: the retrieval head's key blocks covering the tokens ([blocks][T][head kv_dim]),
  // as f32 (the engine keeps them in kv_dtype: export widens them, import rounds them back, which
  // gives the same values), and per page the fused features of its last position ([3·dim]; empty
  // where none were kept).
  std::vector<float> head_keys;
  std::vector<std::vector<float>> boundary_fused;
  // Quest: per layer, the page bounds of the tokens ([pages][kv_heads][head_dim] each).
  std::vector<std::vector<float>> quest_min, quest_max;
  uint64_t bytes() const;  // host memory it holds
};

// An allocation in one tier of the KV store.
struct KvSlice {
  TierId tier;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool valid() const { return bytes > 0; }
};
// Per-layer sparse-decode state of one sequence.
struct KvLayerSparseState {
  ElasticWorkingSet ws;                   // per-layer selections (Quest, oracle) only: the slot map
  // [kv_heads][budget][head_dim] each, in the device tier, only while the layer's home is not the
  // device (a device-homed layer is attended in place by index, Backend::attention_indexed).
  KvSlice ws_k, ws_v;
  bool ws_fresh = false;                  // allocated this step: loads every slot of its map, not the diff
  Selection selection;                    // per-layer methods (Quest, oracle)
  std::vector<float> page_min, page_max;  // Quest key bounds [pages][kv_heads][head_dim]
};
// One live sequence: its page table and length, and the state derived from its KV.
struct KvSequence {
  int64_t length = 0;
  int64_t admitted_length = 0;  // the final length it was admitted for (add_sequence)
  std::vector<PageId> pages;
  // Retrieval head K cache, paged: block b holds tokens [b·T, (b+1)·T) token-major
  // ([T][head kv_dim]), T = KvMemory::head_block_tokens(), all blocks in tier head_tier. Fixed-size
  // blocks (the size of one working-set slice) never fragment their tier and never copy.
  std::vector<uint64_t> head_blocks;
  TierId head_tier{0};
  int64_t filter_tokens = 0;         // head keys handed to the candidate filter so far
  std::shared_ptr<void> last_fused;  // fused features of the last cached position [3·dim], backend memory
  // prefix_sharing: entry k = fused features of position (k+1)·page_size − 1, read-only (forks
  // hold the same buffers).
  std::vector<std::shared_ptr<const void>> boundary_fused;
  Selection shared_selection;  // SpeContext / streaming: one per step, all layers
  // With a shared selection every layer's working set has the same slot map, so one diff per
  // step (computed before layer 0) drives the copies of every layer.
  ElasticWorkingSet shared_ws;
  ElasticStats shared_stats;
  std::vector<GatherEntry> shared_loads;
  std::vector<KvLayerSparseState> layers;  // allocated when the sequence first decodes sparsely
};

// Whether the method's selection is made once per step for every layer (SpeContext, streaming).
inline bool shares_selection(SparseMethod m) {
  return m == SparseMethod::kSpeContext || m == SparseMethod::kStreaming;
}

class KvMemory {
 public:
  // Before a sequence appears at a length at once (import_prefix): the owner re-plans where
  // layers live for the live sequences' lengths plus that one (`lengths`). Null: nothing.
  using Replan = std::function<Status(const std::vector<int64_t>& lengths)>;

  // `store` holds every tier; `bounce` (with its transport id) is the host buffer reads and
  // writes of remote tiers go through (null without remote tiers). head_block_tokens: tokens per
  // block of the retrieval head's key cache (0 without SpeContext).
  KvMemory(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend, const EngineOptions& options,
           int64_t max_context, int64_t head_block_tokens, std::unique_ptr<KvStore> store,
           std::shared_ptr<void> bounce, TierId bounce_tier);
  KvMemory(const KvMemory&) = delete;
  KvMemory& operator=(const KvMemory&) = delete;

  // New empty sequence; ResourceExhausted when max_sequences are live. `final_length` (0 = not
  // known) is the length it was admitted for: Engine::admit() counts live sequences at the larger
  // of their length and it, so that requests admitted together fit together when they have grown.
  Result<SeqId> add_sequence(int64_t final_length = 0);
  // A new sequence holding the first `prefix_tokens` tokens of `source` without computing them
  // (prefix caching): it shares source's pages of those tokens (full pages, never written again:
  // both sequences append to pages of their own) and copies its retrieval-head keys and Quest
  // bounds. prefix_tokens must be a positive multiple of fork_granularity() and at most source's
  // length; with SpeContext EngineOptions::prefix_sharing must be on. Admission counts a shared
  // page once per holder (conservative).
  Result<SeqId> fork_sequence(SeqId source, int64_t prefix_tokens, int64_t final_length = 0);
  // Token multiple of the prefixes fork_sequence takes: the page size (and Quest's page size).
  int64_t fork_granularity() const;
  // Whether fork_sequence can work at all (SpeContext needs prefix_sharing).
  bool can_fork() const {
    return options_.sparse.method != SparseMethod::kSpeContext || options_.prefix_sharing;
  }
  // Drops the sequence's tokens from `length` on (llama.cpp's seq_rm at the end), so that it can
  // go on from there: length must be a positive multiple of fork_granularity() below its length
  // (or equal to it: nothing changes but final_length). final_length: as add_sequence's, from now
  // on. The prefix cache reuses a finished sequence this way for the request that supersedes it.
  Status truncate_sequence(SeqId seq, int64_t length, int64_t final_length = 0);
  // Prefix offloading: copies the first `tokens` tokens of the sequence (a positive multiple of
  // fork_granularity(), at most its length; under SpeContext with prefix_sharing) out of the
  // cache, from whatever tiers its layers live in. The sequence is unchanged.
  Result<PrefixSnapshot> export_prefix(SeqId seq, int64_t tokens);
  // A new sequence holding a snapshot's tokens, written into the layers' homes without computing
  // them; then as one fork_sequence made. kInvalidArgument naming the field when the snapshot
  // does not match this memory; kResourceExhausted (nothing changed) when a slot, the pool or a
  // tier is short.
  Result<SeqId> import_prefix(const PrefixSnapshot& snapshot, int64_t final_length = 0);
  // A new sequence holding `source`'s first `prefix_tokens` tokens, shared as fork_sequence shares
  // them, then `rest`'s tokens written as import_prefix writes a snapshot's (the shared prefix
  // store's chunks past what the prefix cache holds). `rest` is laid out as a prefix chunk's piece
  // (core/engine/prefix_chunk.h): its pages' KV, its tokens' head key rows only (token-major, no
  // block padding), a boundary_fused row per page, its pages' Quest bounds. Errors as
  // fork_sequence's and import_prefix's; on any, nothing changed.
  Result<SeqId> import_prefix_after(SeqId source, int64_t prefix_tokens, const PrefixSnapshot& rest,
                                    int64_t final_length = 0);
  // Gives back the device memory of the sequence's sparse working sets (allocated again at its next
  // sparse step, reloaded from scratch): for sequences that wait, such as finished ones kept for
  // prefix caching.
  Status release_working_sets(SeqId seq);
  // Frees the sequence's pages (those it shares: its references). Unknown ids are an InvalidArgument.
  Status remove_sequence(SeqId seq);
  // Tokens cached for the sequence (0 for unknown ids).
  int64_t sequence_length(SeqId seq) const;
  int64_t live_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // Bytes of KV held by live sequences (pages in use × page bytes) and per token of context.
  int64_t kv_bytes_in_use() const;
  int64_t kv_bytes_per_token() const {
    return model_->config.kv_bytes_per_token(static_cast<int64_t>(dtype_size(options_.kv_dtype)));
  }
  const KvStore& kv_store() const { return *kv_; }
  // Where every layer's KV and the retrieval head's keys live now.
  const KvPlacement& placement() const { return placement_; }
  // Checks the KV store's invariants, that every live sequence's pages are distinct and in use,
  // and that every layer is where the placement says.
  Status check_invariants() const;

 private:
  // The Engine's forward pass and tier moves read and grow the sequences' state directly.
  friend class Engine;

  const ModelConfig& config() const { return model_->config; }
  Status reserve_pages(KvSequence& seq, int64_t new_length, std::vector<PageId>& newly_allocated);
  // Takes the pages of a failed step back from every sequence and frees them.
  void give_back_pages(const std::vector<PageId>& newly_allocated);
  // fork_sequence / truncate_sequence: whether s can go on from `tokens` (a whole fork unit, with
  // SpeContext the fused features of its last position kept), and making it do so.
  Status check_prefix(SeqId seq, const KvSequence& s, int64_t tokens, std::string_view what) const;
  Status resume_fused_at(KvSequence& s, const std::shared_ptr<const void>& boundary);
  size_t quest_bound_elements(int64_t tokens) const;  // Quest bounds of whole pages of `tokens`
  // Every sparse step, before the selection's diff: slot maps for every layer (kept by device-homed
  // layers too: the order their indexed attention reads, and the elastic statistics); a working set
  // for each layer not homed on the device (allocated when missing and marked ws_fresh: that step
  // loads every slot of the map, so it holds what the map says), none for a device-homed one
  // (released when it came back). On failure the working sets allocated so far stay (the next
  // step or remove_sequence gives them back).
  Status ensure_sparse_state(KvSequence& s);
  void ensure_layers(KvSequence& s);                             // the per-layer state vector (Quest's bounds)
  void release_slices(std::vector<KvLayerSparseState>& layers);  // their working-set memory, and maps
  void drop_sparse_state(KvSequence& s);
  void invalidate_working_sets(KvSequence& s);
  Status ensure_head_capacity(KvSequence& s, int64_t tokens);
  int64_t head_block_tokens() const { return head_block_tokens_; }
  int64_t head_capacity(const KvSequence& s) const {
    return static_cast<int64_t>(s.head_blocks.size()) * head_block_tokens_;
  }
  // Bytes of one block of the retrieval head's keys: head_block_tokens · n_kv_heads · head_dim
  // elements of the KV dtype (EngineOptions::kv_dtype; the head's keys are rounded to it as stored).
  uint64_t head_block_bytes() const;
  size_t head_row_elements() const;  // one token's key row: the head's n_kv_heads · head_dim
  size_t head_row_bytes() const;     // that row in the KV dtype
  // Bytes of K (or V) of one (sequence, layer) working set: kv_heads · budget · head_dim elements.
  uint64_t working_set_bytes() const;
 public:
  // Device-tier bytes held by working sets now (K + V of every offloaded layer of every sequence
  // that has decoded sparsely): the planner's staging term i·R·B·H·D·kvc when all R decode.
  uint64_t working_set_bytes_in_use() const;
 private:
  void* head_row(const KvSequence& s, int64_t token) const;  // address of token's key row (KV dtype)
  const void* const* head_block_table(const KvSequence& s);  // backend pointers, valid until the next call
  void release_head_cache(KvSequence& s);
  bool host_visible(TierId tier) const;   // the engine thread may read/write it directly
  bool backend_reads(TierId tier) const;  // backend ops may take pointers into it
  Status write_block(TierId tier, uint64_t offset, const void* host, uint64_t bytes);
  Status read_block(TierId tier, uint64_t offset, void* host, uint64_t bytes);
  // A remote tier's bytes to (kLoad) or from (kStore) host memory, in bounce-buffer pieces.
  Status through_bounce(TierId tier, uint64_t offset, void* host, uint64_t bytes, CopyDirection direction);

  std::shared_ptr<const Model> model_;
  std::shared_ptr<Backend> backend_;
  EngineOptions options_;
  int64_t max_context_ = 0;
  int64_t head_block_tokens_ = 0;
  std::unique_ptr<KvStore> kv_;
  std::shared_ptr<void> bounce_;  // host staging for reads and writes of remote tiers
  TierId bounce_tier_;
  KvPlacement placement_;
  Replan replan_;
  int64_t next_seq_id_ = 0;
  std::unordered_map<SeqId, KvSequence> sequences_;
  std::vector<const void*> head_table_;
};

}  // namespace specontext
