// The engine: a model, a backend and a paged KV cache serving many sequences at once.
//
// One call to forward() runs one batched forward pass in which every request appends tokens to
// its own sequence: prefill chunks of some sequences and single decode tokens of others are
// mixed freely (continuous batching). Sequences have independent lengths and page tables.
// Thread model: an Engine is used by one thread at a time; the backend parallelises inside ops.
#pragma once

#include <array>
#include <memory>
#include <string_view>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/communicator.h"
#include "core/ids.h"
#include "core/kv_cache.h"
#include "core/elastic.h"
#include "core/model.h"
#include "core/retrieval_head.h"
#include "core/selection.h"
#include "core/status.h"

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
  SelectionOptions selection;     // budget, sinks, window
  int64_t quest_page_size = 16;   // Quest page granularity (tokens)
};

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

struct EngineOptions {
  int64_t max_sequences = 16;  // live sequences at once
  int64_t max_context = 0;     // tokens per sequence; 0 = the model's max_seq_len
  int64_t page_size = 16;      // tokens per KV page
  int64_t kv_pages = 0;        // pages in the pool; 0 = enough for max_sequences at max_context
  SparseOptions sparse;
  std::shared_ptr<const RetrievalHead> retrieval_head;  // required by SparseMethod::kSpeContext
  // Tensor parallelism: this engine runs one rank's slice of the model (shard_model in
  // core/tensor_parallel.h) and sums the attention-out and MLP-down partials over the ranks.
  // Null: a single rank.
  std::shared_ptr<Communicator> communicator;
};

enum class LogitsMode { kNone, kLast, kAll };

struct StepRequest {
  SeqId seq;
  std::span<const TokenId> tokens;
  LogitsMode logits = LogitsMode::kLast;
};

struct StepOutput {
  int64_t vocab = 0;
  std::vector<float> logits;         // [rows, vocab]
  std::vector<int64_t> first_row;    // per request: first logits row, -1 when none
  std::vector<int64_t> n_rows;       // per request: 0, 1 (kLast) or n_tokens (kAll)
  std::span<float> row(size_t request, int64_t k = 0) {
    return {logits.data() + (first_row[request] + k) * vocab, static_cast<size_t>(vocab)};
  }
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::shared_ptr<const Model> model,
                                                std::shared_ptr<Backend> backend,
                                                const EngineOptions& options);

  const Model& model() const { return *model_; }
  const ModelConfig& config() const { return model_->config; }
  Backend& backend() { return *backend_; }
  int64_t max_context() const { return max_context_; }

  // New empty sequence; ResourceExhausted when max_sequences are live.
  Result<SeqId> add_sequence();
  // Frees the sequence's pages. Unknown ids are an InvalidArgument.
  Status remove_sequence(SeqId seq);
  // Tokens cached for the sequence (0 for unknown ids).
  int64_t sequence_length(SeqId seq) const;
  int64_t live_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // One batched forward. Either every request is applied or none is: on any error the KV cache
  // and sequence lengths are as before the call.
  Result<StepOutput> forward(std::span<const StepRequest> requests);

  // Fills the sequence's cache with n random KV entries without running the model (benchmarks
  // of decode speed at long context; says nothing about quality). The sequence must be empty.
  Status fill_synthetic(SeqId seq, int64_t n_tokens, uint64_t seed);

  // Bytes of KV held by live sequences (pages in use × page bytes) and per token of context.
  int64_t kv_bytes_in_use() const;
  int64_t kv_bytes_per_token() const { return config().kv_bytes_per_token(4); }

  void set_observer(ForwardObserver* observer) { observer_ = observer; }
  const SparseOptions& sparse_options() const { return options_.sparse; }
  const SparseStats& sparse_stats() const { return sparse_stats_; }
  void reset_sparse_stats() { sparse_stats_ = SparseStats{}; }

 private:
  // Per-layer sparse-decode state of one sequence.
  struct LayerSparseState {
    ElasticWorkingSet ws;               // per-layer selections (Quest, oracle) only
    std::shared_ptr<void> ws_k, ws_v;   // [kv_heads][budget][head_dim] each, backend memory
    Selection selection;                // per-layer methods (Quest, oracle)
    std::vector<float> page_min, page_max;  // Quest key bounds [pages][kv_heads][head_dim]
  };
  struct Sequence {
    int64_t length = 0;
    std::vector<PageId> pages;
    std::vector<float> head_k;      // retrieval head K cache [length][head kv_dim]
    std::vector<float> last_fused;  // fused features of the last cached position [3·dim]
    Selection shared_selection;     // SpeContext / streaming: one per step, all layers
    // With a shared selection every layer's working set has the same slot map, so one diff per
    // step (computed before layer 0) drives the copies of every layer.
    ElasticWorkingSet shared_ws;
    ElasticStats shared_stats;
    std::vector<GatherEntry> shared_loads;
    std::vector<LayerSparseState> layers;  // allocated when the sequence first decodes sparsely
  };
  Engine() = default;
  Status reserve_pages(Sequence& seq, int64_t new_length, std::vector<PageId>& newly_allocated);
  bool wants_fused() const;
  static bool shares_selection(SparseMethod m);
  bool decodes_sparse(const Sequence& s, int64_t n_tokens) const;
  Status ensure_sparse_state(Sequence& s);
  // Retrieval head on tokens whose fused(p−1) is known; appends their keys to the head cache.
  Status run_head(Sequence& s, const TokenId* tokens, const float* fused_prev, int64_t start_pos,
                  int64_t n, float* q_out);
  Status select_for_layer(Sequence& s, LayerId layer, const AttentionItem& item, const float* q,
                          const Selection** selection);
  void update_quest_bounds(Sequence& s, LayerId layer, const float* k_rows, int64_t start_pos, int64_t n);

  std::shared_ptr<const Model> model_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<KvCache> kv_;
  RopeParams rope_;
  RopeParams head_rope_;
  EngineOptions options_;
  int64_t max_context_ = 0;
  int64_t next_seq_id_ = 0;
  std::unordered_map<SeqId, Sequence> sequences_;
  ForwardObserver* observer_ = nullptr;
  SparseStats sparse_stats_;
  std::array<int64_t, 3> fused_layers_{};

  // Workspace reused across calls (resized, never shrunk).
  std::vector<float> x_, xb_, q_, k_, v_, att_, tmp_, gate_, up_, rows_, fused_, head_q_, scores_;
  std::vector<TokenId> ids_;
  std::vector<int64_t> positions_;
  std::vector<AttentionItem> items_, dense_items_;
  std::vector<SparseAttentionItem> sparse_items_;
  std::vector<size_t> sparse_index_;  // request index of each sparse item
  std::vector<std::vector<float*>> k_ptrs_, v_ptrs_;
  std::vector<GatherEntry> loads_;
  std::vector<const Selection*> selections_;
};

}  // namespace specontext
