// The engine: a model, a backend and a paged KV cache serving many sequences at once.
//
// One call to forward() runs one batched forward pass in which every request appends tokens to
// its own sequence: prefill chunks of some sequences and single decode tokens of others are
// mixed freely (continuous batching). Sequences have independent lengths and page tables.
// Thread model: an Engine is used by one thread at a time; the backend parallelises inside ops.
#pragma once

#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/ids.h"
#include "core/kv_cache.h"
#include "core/model.h"
#include "core/status.h"

namespace specontext {

struct EngineOptions {
  int64_t max_sequences = 16;  // live sequences at once
  int64_t max_context = 0;     // tokens per sequence; 0 = the model's max_seq_len
  int64_t page_size = 16;      // tokens per KV page
  int64_t kv_pages = 0;        // pages in the pool; 0 = enough for max_sequences at max_context
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

 private:
  struct Sequence {
    int64_t length = 0;
    std::vector<PageId> pages;
  };
  Engine() = default;
  Status reserve_pages(Sequence& seq, int64_t new_length, std::vector<PageId>& newly_allocated);

  std::shared_ptr<const Model> model_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<KvCache> kv_;
  RopeParams rope_;
  EngineOptions options_;
  int64_t max_context_ = 0;
  int64_t next_seq_id_ = 0;
  std::unordered_map<SeqId, Sequence> sequences_;

  // Workspace reused across calls (resized, never shrunk).
  std::vector<float> x_, xb_, q_, k_, v_, att_, tmp_, gate_, up_, rows_;
  std::vector<TokenId> ids_;
  std::vector<int64_t> positions_;
  std::vector<AttentionItem> items_;
  std::vector<std::vector<float*>> k_ptrs_, v_ptrs_;
};

}  // namespace specontext
