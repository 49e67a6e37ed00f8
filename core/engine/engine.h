// The engine: a model, a backend and a paged KV cache serving many sequences at once.
//
// One call to forward() runs one batched forward pass in which every request appends tokens to
// its own sequence: prefill chunks of some sequences and single decode tokens of others are
// mixed freely (continuous batching). Sequences have independent lengths and page tables.
// Thread model: an Engine is used by one thread at a time; the backend parallelises inside ops.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/engine/engine_options.h"
#include "core/engine/kv_memory.h"
#include "core/engine/kv_store.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/ports/candidate_filter.h"
#include "core/ports/communicator.h"
#include "core/ports/copy_queue.h"
#include "core/ports/placement.h"
#include "core/ports/selection.h"
#include "core/sparse/elastic.h"
#include "core/sparse/retrieval_head.h"

namespace specontext {

// Read-only view of a forward's internals (evaluation, distillation).
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  // After RoPE and kv_append of `layer`: q [T, n_heads·head_dim] and the items, whose KV views
  // cover each sequence's whole cache including this forward's tokens.
  virtual void on_attention(LayerId layer, const float* q, std::span<const AttentionItem> items) {}
  // The tokens each item attends to in this layer when the step is sparse (per item, per KV
  // head, ascending positions); not called for dense steps.
  virtual void on_sparse_selection(LayerId layer, std::span<const AttentionItem> items,
                                   std::span<const Selection* const> selections) {}
  // EAGLE-3 fused features of every row of this forward: [T, 3·dim].
  virtual void on_fused_hidden(const float* fused, int64_t rows, std::span<const AttentionItem> items) {}
};

// Per-step counters of sparse decoding (summed over sequences and layers).
struct SparseStats {
  int64_t sparse_steps = 0;       // (sequence, step) pairs that decoded sparsely
  int64_t tokens_selected = 0;    // Σ over layers and heads of |S_now|
  int64_t tokens_loaded = 0;      // Σ of |S_now − S_last| (elastic loads)
  int64_t tokens_kept = 0;        // Σ of |S_now ∩ S_last|
  int64_t bytes_loaded = 0;       // K+V bytes gathered into working sets
  int64_t bytes_full_reload = 0;  // what reloading every selected token would have moved
  double overlap() const { return tokens_selected ? double(tokens_kept) / double(tokens_selected) : 0.0; }
};

// Per tier, what the engine holds there and what moved (observability).
struct TierTraffic {
  uint64_t bytes_in = 0;       // written into this tier (stores, migrations in)
  uint64_t bytes_out = 0;      // read from this tier (loads, migrations out)
  int64_t tokens_loaded = 0;   // selected tokens loaded from this tier into working sets
  int64_t tokens_hit = 0;      // selected tokens of layers homed here already in the working set
  TierTraffic& operator+=(const TierTraffic& o);
};
struct TierReport {
  TierDescription desc;
  uint64_t used_bytes = 0;  // everything the engine placed there (pages, working sets, staging, head keys)
  uint64_t peak_used_bytes = 0;  // the most used_bytes was during a forward (staging included)
  uint64_t kv_bytes = 0;    // KV pages of layers homed there
  int64_t layers = 0;       // layers homed there
  TierTraffic last_step, total;
};

// Overlap of copies with compute, per forward and summed.
struct OverlapStats {
  int64_t steps = 0;             // forwards that moved KV between tiers
  double step_seconds = 0;       // wall time of those forwards
  double copy_busy_seconds = 0;  // time at least one of their copies was in flight
  double wait_seconds = 0;       // time the engine loop was blocked on copies (the exposed part)
  // compute = step − wait; a serial schedule would take compute + copy_busy.
  double compute_seconds() const { return step_seconds - wait_seconds; }
  double serial_seconds() const { return compute_seconds() + copy_busy_seconds; }
  double hidden_fraction() const {
    return copy_busy_seconds > 0 ? std::max(0.0, 1.0 - wait_seconds / copy_busy_seconds) : 0.0;
  }
};

// A placement change the engine applied (or could not), with the policy's reasons.
struct PlacementEvent {
  int64_t forward = 0;  // index of the forward before which it happened
  std::vector<int64_t> seq_lens;
  std::vector<std::string> reasons;
  int64_t layers_moved = 0;
  uint64_t bytes_moved = 0;
  double seconds = 0;
  bool cpu_filtering = false;
  std::string error;  // non-empty when a move failed (the layer kept its home)
};

// kSample: the last row's next token is drawn where the logits are (Backend::sample_rows, on the
// device for CUDA) with StepRequest::draw; only the token comes back, not the logits.
enum class LogitsMode { kNone, kLast, kAll, kSample };

struct StepRequest {
  SeqId seq;
  std::span<const TokenId> tokens;
  LogitsMode logits = LogitsMode::kLast;
  const TokenDraw* draw = nullptr;  // required with kSample, ignored otherwise
  // Prompt tokens: attended densely even as a single token (sparse methods sparsify decode steps
  // only), so that how a prompt is chunked, or where a cached prefix ends, changes nothing.
  bool prompt = false;
};

struct StepOutput {
  int64_t vocab = 0;
  std::vector<float> logits;         // [rows, vocab]
  std::vector<int64_t> first_row;    // per request: first logits row, -1 when none
  std::vector<int64_t> n_rows;       // per request: 0, 1 (kLast) or n_tokens (kAll); 0 for kSample
  std::vector<TokenId> tokens;       // per request: the sampled token (kSample), -1 otherwise
  std::span<float> row(size_t request, int64_t k = 0) {
    return {logits.data() + (first_row[request] + k) * vocab, static_cast<size_t>(vocab)};
  }
};

// The model an engine on `backend` computes with: `model` itself when the backend runs every
// dtype it holds (Backend::supports, kEmbed and kMatmul), else a copy whose block-type matrices
// it cannot run are dequantised to model->weight_dtype (dequantize_block_matrices).
// kUnimplemented when a matrix of another dtype is not supported.
Result<std::shared_ptr<const Model>> fit_weights_to_backend(std::shared_ptr<const Model> model,
                                                            const Backend& backend);

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::shared_ptr<const Model> model,
                                                std::shared_ptr<Backend> backend,
                                                const EngineOptions& options);

  // The device tier an engine with these options allocates when TieringOptions::device_bytes is 0:
  // KV chunks of every layer for every sequence at max_context, working sets, the retrieval
  // head's key blocks, alignment slack.
  static uint64_t all_device_bytes(const ModelConfig& config, const EngineOptions& options);

  const Model& model() const { return *model_; }
  const ModelConfig& config() const { return model_->config; }
  Backend& backend() { return *backend_; }
  int64_t max_context() const { return max_context_; }

  // The KV memory the forward pass runs over: sequences, page tables, forks, truncation, prefix
  // snapshots, where layers live (kv_memory.h).
  KvMemory& memory() { return *memory_; }
  const KvMemory& memory() const { return *memory_; }

  // Whether a new sequence that will reach `final_length` tokens can be served: beside the live
  // ones (alone = false) or on an otherwise idle engine (alone = true). kResourceExhausted names
  // what does not fit (the placement policy's answer, or the page pool); kOutOfRange beyond the
  // context limit. taken_over: a live sequence the new one takes over (truncate_sequence, the next
  // turn of a conversation), whose pages the new one's final length counts: not counted again.
  Status admit(int64_t final_length, bool alone, SeqId taken_over = SeqId()) const;
  // Admission without promises, for a scheduler that preempts: whether the live sequences, grown
  // to `grown` tokens (one entry per live sequence, any order), fit the engine's memory, with one
  // more sequence of `new_length` tokens beside them when new_length > 0. Answers as admit().
  Status fits(std::span<const int64_t> grown, int64_t new_length) const;
  // What a snapshot's contents depend on, as a 64-bit FNV-1a hash: the model's config, a sample
  // of every weight tensor (8 evenly spaced 256-byte pieces of each matrix, the norm vectors
  // whole), the retrieval head likewise, the context limit, page size, KV dtype, sparse method,
  // prefix_sharing and the tensor-parallel rank. Persistent prefix files are kept per identity.
  // Sampled, not a checksum of the weights: two checkpoints that differ only between the samples
  // look alike.
  uint64_t kv_identity() const;
  int64_t running_slots() const { return options_.running_slots(); }

  // One batched forward. Either every request is applied or none is: on any error the KV cache
  // and sequence lengths are as before the call.
  Result<StepOutput> forward(std::span<const StepRequest> requests);

  // Fills the sequence's cache with n random KV entries without running the model (benchmarks
  // of decode speed at long context; says nothing about quality). The sequence must be empty.
  Status fill_synthetic(SeqId seq, int64_t n_tokens, uint64_t seed);

  // Per tier: usage and traffic (last forward and total).
  std::vector<TierReport> tier_report() const;
  const OverlapStats& overlap_stats() const { return overlap_; }
  const OverlapStats& last_step_overlap() const { return last_overlap_; }
  // The most device bytes a forward staged remote layers in (TieringOptions::staging_layers).
  uint64_t peak_staging_bytes() const { return peak_staging_; }
  // Device bytes that staging remote layers may take for sequences of these lengths, counted
  // whether or not a layer is remote now (0 when every tier is one the backend reads, and under
  // a shared selection, whose working-set reserve covers it).
  uint64_t staging_reserve(std::span<const int64_t> lengths) const;
  const std::vector<PlacementEvent>& placement_events() const { return events_; }
  // SpeContext selections made from CPU-filtered candidates (placement.cpu_filtering).
  int64_t filtered_steps() const { return filtered_steps_; }
  // Installs (or removes, with null) the policy consulted before every forward; for callers that
  // measure bandwidths over the engine's own tiers first. Needs host or remote tiers.
  Status set_placement_policy(std::shared_ptr<PlacementPolicy> policy);
  // Moves layers (and the retrieval head's keys) to the placement's tiers now, between steps.
  // On a failed move that layer keeps its home and content; the error is returned. Before the
  // first layer moves, the backend is synchronised: the copy queue runs on its own stream or
  // thread, so backend work still queued (a fill_synthetic's copies) must finish first.
  Status apply_placement(const KvPlacement& target, const std::vector<std::string>& reasons = {});
  // Remote tiers whose memory the transport reports gone for good (Transport::tier_lost: every
  // replica died) and that are not abandoned yet.
  std::vector<TierId> lost_tiers() const;
  // Stops using a lost tier: its layers are re-homed on the device (a placement policy moves them
  // on at the next step) and policies see it with no capacity, so nothing goes there again.
  // Every sequence holds KV in every layer, so no page may be in use: the caller drops the
  // sequences first and recomputes them (Scheduler does). kInvalidArgument otherwise, or for a
  // tier that is not remote or was abandoned already.
  Status abandon_tier(TierId tier);
  const std::vector<TierId>& abandoned_tiers() const { return abandoned_; }
  // "tier NAME was lost: WHY" for an abandoned tier, WHY naming the dead nodes as the transport
  // told it (Transport::tier_loss); "" for a tier that was not abandoned. Placement errors and
  // admission refusals after a loss carry it, so that "0 B free of 0 B" is never the whole story.
  std::string lost_tier_error(TierId tier) const;
  // What a placement policy is asked with for these lengths (tiers, usage, device bytes outside
  // its model), and the device bytes one more sequence's first steps take beyond its tokens.
  PlacementInput placement_input(const std::vector<int64_t>& seq_lens) const;
  uint64_t new_sequence_reserve() const;

  void set_observer(ForwardObserver* observer) { observer_ = observer; }
  const SparseOptions& sparse_options() const { return options_.sparse; }
  const SparseStats& sparse_stats() const { return sparse_stats_; }
  void reset_sparse_stats() { sparse_stats_ = SparseStats{}; }

 private:
  // Weights as the backend reads them (CPU: the model's own memory; CUDA: device copies).
  struct LayerPtrs {
    const float* attn_norm = nullptr;
    const float* ffn_norm = nullptr;
    const float* bq = nullptr;
    const float* bk = nullptr;
    const float* bv = nullptr;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    WeightMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
  };
  using Sequence = KvSequence;
  using LayerSparseState = KvLayerSparseState;
  using Slice = KvSlice;
  // Grow-only scratch in backend memory.
  struct Workspace {
    std::shared_ptr<void> mem;
    size_t bytes = 0;
  };
  Engine() = default;
  Status import_weights();
  // forward()'s phases (engine_forward.cc), in the order they run. Before the step: checks that
  // change nothing, page reservation (all or nothing), and what a failed or a done step leaves.
  Status validate_step(std::span<const StepRequest> requests) const;
  Status validate_request(const StepRequest& r, const Sequence& s) const;
  Status reserve_step_pages(std::span<const StepRequest> requests, std::vector<Sequence*>& seqs,
                            std::vector<PageId>& newly_allocated);
  void undo_step(const std::vector<Sequence*>& seqs, const std::vector<PageId>& newly_allocated);
  void record_step_stats(std::chrono::steady_clock::time_point start);  // traffic, peaks, overlap
  // The body of forward() after validation, re-planning and page reservation; forward() undoes
  // the reservation and the working-set updates when it fails. Its phases share a ForwardStep.
  struct ForwardStep;
  Result<StepOutput> run_forward(std::span<const StepRequest> requests, const std::vector<Sequence*>& seqs);
  void lay_out_tokens(ForwardStep& st);  // items_, ids_, positions_, which requests decode sparsely
  Status upload_tokens(ForwardStep& st);
  Status fit_activations(ForwardStep& st);
  Status make_shared_selections(ForwardStep& st);  // SpeContext / streaming, before layer 0
  // Remote layers: the ring and tail buffers they are staged in, and the loads posted up front.
  Status plan_staging(ForwardStep& st);
  Status post_prefetch_loads(ForwardStep& st);
  std::vector<TransferRequest> layer_loads(ForwardStep& st, int64_t l);
  Status post_ring_loads(ForwardStep& st, int64_t l);
  void count_loads(TierId home, const std::vector<TransferRequest>& loads);
  Status wait_ticket(CopyTicket& t);  // and clears it; an invalid ticket is done
  // One layer: q/k/v, the new tokens' KV appended, dense and sparse attention, a staged layer's
  // stores home, attention output and MLP.
  Status run_layer(ForwardStep& st, int64_t l);
  Status capture_fused_input(ForwardStep& st, int64_t l);
  Status project_qkv(ForwardStep& st, int64_t l);
  Status append_kv(ForwardStep& st, int64_t l);  // also sets items_' views and dense_items_
  KvLayerView staged_view(ForwardStep& st, size_t i, int64_t l);
  Status attend_sparse(ForwardStep& st, int64_t l);
  Status add_sparse_item(ForwardStep& st, size_t i, int64_t l);  // selection, gathers, stats
  // Every (head, slot) of a slot map as a load: what a working set allocated this step needs.
  const std::vector<GatherEntry>& all_slots(const ElasticWorkingSet& ws);
  const std::vector<GatherEntry>& sparse_gathers(ForwardStep& st, size_t i, int64_t l, const Selection& sel,
                                                 ElasticStats& es);
  void count_sparse_stats(const ElasticStats& es);
  Status store_staged_layer(ForwardStep& st, int64_t l);
  std::vector<TransferRequest> staged_stores(ForwardStep& st, int64_t l);
  Status attention_out_and_mlp(ForwardStep& st, int64_t l);
  // After the layers: the retrieval head's keys, the fused state, logits and sampled tokens.
  Status update_fused_state(ForwardStep& st);
  Status feed_retrieval_head(ForwardStep& st, size_t i);
  Status keep_boundary_fused(ForwardStep& st, size_t i);
  Result<StepOutput> compute_logits(ForwardStep& st);
  Status gather_output_rows(ForwardStep& st, const StepOutput& out, int64_t n_sample, float* rows);
  Status sample_tokens(ForwardStep& st, const float* rows, int64_t n_sample, StepOutput& out);
  Status project_logits(const float* rows, int64_t n_out, StepOutput& out);
  Result<float*> fit_floats(Workspace& w, int64_t floats);
  Status setup_tiers();
  Result<void*> fit(Workspace& w, size_t bytes);
  bool wants_fused() const;
  bool decodes_sparse(const Sequence& s, const StepRequest& r) const;
  // Retrieval head on tokens whose fused(p−1) is known (backend memory); writes their keys into
  // the head cache at start_pos.. and the query rows to q_out.
  Status run_head(Sequence& s, const TokenId* tokens_dev, const float* fused_prev, const int64_t* positions_dev,
                  int64_t start_pos, int64_t n, float* q_out);
  // The head's q [n, n_heads·head_dim] and k [n, n_kv_heads·head_dim] of n rows, each row its own
  // token, fused(p−1) and position (rows of one sequence or of many: one matmul per weight).
  Status project_head(const TokenId* tokens_dev, const float* fused_prev, const int64_t* positions_dev, int64_t n,
                      float* q_out, float* k_out);
  // k [n, kd] into s's head cache at start_pos.., one run of rows per block touched.
  Status store_head_keys(Sequence& s, const float* k, int64_t start_pos, int64_t n);
  // The shared selection of s's decode token at start_pos; head_q is its head query (SpeContext,
  // computed for the whole step by make_shared_selections), unused for streaming.
  Status shared_selection_for(Sequence& s, SeqId id, const float* head_q, int64_t start_pos);
  Status select_for_layer(Sequence& s, LayerId layer, const AttentionItem& item, const float* q,
                          const Selection** selection);
  Status update_quest_bounds(Sequence& s, LayerId layer, const float* k_rows, int64_t start_pos, int64_t n);
  Status rebalance(std::span<const StepRequest> requests);
  Status rebalance_for(const std::vector<int64_t>& seq_lens);  // the live sequences' lengths to plan for
  Status move_head_caches(TierId to);
  TierTraffic& traffic(TierId tier) { return step_traffic_[static_cast<size_t>(tier.value())]; }

  std::shared_ptr<const Model> model_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<KvMemory> memory_;
  KvStore* kv_ = nullptr;  // memory_'s store (observer)
  std::shared_ptr<void> device_region_;
  RopeParams rope_;
  RopeParams head_rope_;
  EngineOptions options_;
  int64_t max_context_ = 0;
  ForwardObserver* observer_ = nullptr;
  SparseStats sparse_stats_;
  std::array<int64_t, 3> fused_layers_{};
  int64_t forwards_ = 0;
  int64_t filtered_steps_ = 0;
  Candidates candidates_;

  // Weights as the backend reads them.
  WeightMatrix tok_embeddings_, lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<LayerPtrs> layer_ptrs_;
  WeightMatrix head_fc_, head_wq_, head_wk_;
  const float* head_input_norm_ = nullptr;
  const float* head_hidden_norm_ = nullptr;

  // Tiers.
  std::vector<TierId> abandoned_;  // lost remote tiers no longer used (abandon_tier)
  std::vector<std::string> abandoned_why_;  // per abandoned_ entry: Transport::tier_loss when abandoned
  // A policy's refusal with every lost tier's error appended (kResourceExhausted only).
  Status with_lost_tiers(Status refusal) const;
  bool is_abandoned(TierId tier) const {
    return std::find(abandoned_.begin(), abandoned_.end(), tier) != abandoned_.end();
  }
  std::vector<TierTraffic> step_traffic_, total_traffic_;
  std::vector<uint64_t> peak_used_;
  uint64_t peak_staging_ = 0;
  OverlapStats overlap_, last_overlap_;
  std::vector<PlacementEvent> events_;

  // Workspace reused across calls (grow-only).
  Workspace x_, xb_, q_, k_, v_, att_, tmp_, gate_, up_, rows_, fused_, fused_prev_, head_x_, head_q_,
      head_k_rows_, scores_, logits_, ids_dev_, positions_dev_, fill_pool_;
  std::vector<TokenId> ids_;
  std::vector<int64_t> positions_;
  std::vector<TokenDraw> draw_values_;  // kSample rows of this step, in row order
  std::vector<TokenId> sampled_;
  std::vector<float> host_q_, host_rows_;  // downloads for host-side selection (Quest, oracle, filter)
  std::vector<float> host_keys_;          // f16 / bf16 head keys widened for the candidate filter
  std::vector<AttentionItem> items_, dense_items_;
  std::vector<SparseAttentionItem> sparse_items_;    // layers off the device: over working sets
  std::vector<IndexedAttentionItem> indexed_items_;  // device-homed layers: in place, by index
  std::vector<size_t> sparse_index_;  // request index of each sparse item
  std::vector<std::vector<void*>> k_ptrs_, v_ptrs_;
  std::vector<GatherEntry> loads_, current_loads_, full_loads_;
  std::vector<const Selection*> selections_;
};

}  // namespace specontext
