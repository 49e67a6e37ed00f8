// Distillation of a retrieval head (EAGLE-3 layout) from a target model's own attention, for
// targets that have no EAGLE-3 draft (the bundled tiny models).
//
// Teacher, per position t and KV head g: T_g(t) = the target's attention distribution over keys
// 0..t, averaged over all layers and over the query heads of group g (obtained from a dense
// prefill of each chunk through ForwardObserver). Student, per query head h of group g:
// P_h(t) = softmax(q_h(t)·k(j)/√head_dim), j ≤ t, with q and k from retrieval_qk. Loss:
// mean over positions and query heads of KL(T_g ‖ P_h). Only wq and wk are trained (Adam,
// analytic gradients through the dot products and RoPE); fc stays [I/3 I/3 I/3] and both norms
// stay 1: the KL pins down attention logits, which wq/wk alone parameterise fully for a fixed
// input x, and freezing the input keeps the inputs precomputable (one pass over the corpus).
//
// Single-threaded by design (the bundled models train in seconds); the target forward uses
// whatever backend the caller passes (host memory only).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/backend.h"
#include "core/model.h"
#include "core/retrieval_head.h"
#include "core/status.h"
#include "core/tokenizer.h"

namespace specontext {

struct DistillOptions {
  int64_t steps = 800;                          // Adam steps
  double lr = 5e-3;                             // peak learning rate (cosine decay to lr/10)
  int64_t context = 0;                          // tokens per chunk; 0 = the model's max_seq_len
  int64_t batch_positions = 128;                // query positions per step (all of a chunk when fewer)
  uint64_t seed = 1;                            // initial head and minibatch sampling
  std::vector<int64_t> budgets = {16, 32, 64};  // top-B recall budgets of the report
  int64_t min_chunk = 8;                        // shorter trailing chunks are dropped
  int64_t log_every = 100;                      // on_step period
  std::function<void(int64_t step, double train_kl)> on_step;  // progress (optional)
};

// One chunk's teacher targets and the student's inputs.
struct DistillChunk {
  std::vector<TokenId> tokens;  // positions 0..T−1 of a fresh sequence
  std::vector<float> fused;     // [T, 3d] fused features of each row (EAGLE-3 taps)
  std::vector<float> teacher;   // [kv_heads][T(T+1)/2]: row t holds T_g(t) over keys 0..t
  int64_t length() const { return static_cast<int64_t>(tokens.size()); }
};

struct BudgetRecall {
  int64_t budget = 0;
  int64_t positions = 0;  // positions with more than `budget` keys (others are trivially 1)
  double head = 0;        // target mass on the head's top-B per KV head (max over its group)
  double streaming = 0;   // same for 4 sinks + the most recent B−4 tokens (StreamingLLM)
  double oracle = 0;      // the teacher's own top-B mass (upper bound)
};

struct Fidelity {
  int64_t positions = 0;  // query positions evaluated (t ≥ 1)
  double kl = 0;          // mean over positions and query heads of KL(T_g ‖ P_h), nats
  std::vector<BudgetRecall> recall;
};

struct DistillReport {
  std::shared_ptr<RetrievalHead> head;
  Fidelity before;                                 // random initial head on the held-out chunks
  Fidelity after;                                  // trained head on the held-out chunks
  double train_kl_before = 0, train_kl_after = 0;  // same metric on the training chunks
  int64_t train_tokens = 0, heldout_tokens = 0;
  int64_t train_chunks = 0, heldout_chunks = 0;
  int64_t context = 0;
  double teacher_seconds = 0, train_seconds = 0;
};

// Stories separated by "<|endoftext|>", each encoded with BOS (when the vocabulary has one) and
// concatenated, as llama2.c pretokenises TinyStories.
Result<std::vector<TokenId>> encode_corpus(const Tokenizer& tokenizer, std::string_view text);

// Consecutive chunks of `context` tokens; a trailing chunk shorter than min_len is dropped.
std::vector<std::vector<TokenId>> split_chunks(std::span<const TokenId> tokens, int64_t context,
                                               int64_t min_len);

// Runs a dense prefill of every chunk and records the teacher attention and fused features.
Result<std::vector<DistillChunk>> collect_teacher(std::shared_ptr<const Model> model,
                                                  std::shared_ptr<Backend> backend,
                                                  const std::vector<std::vector<TokenId>>& chunks);

// Held-out fidelity of a head against recorded teacher chunks (q/k through retrieval_qk).
Result<Fidelity> evaluate_head(Backend& backend, const Model& model, const RetrievalHead& head,
                               std::span<const DistillChunk> chunks, std::span<const int64_t> budgets);

// The training objective on one chunk: mean over `positions` (each t ≥ 1) and query heads of
// KL(T_g(t) ‖ P_h(t)), and its gradient w.r.t. head.wq and head.wk (f32, same layouts;
// overwritten). x [T, 2d] are the head's inputs (retrieval_inputs). Exposed for a
// finite-difference test.
double distill_loss_grad(const RetrievalHead& head, const RopeParams& rope, const DistillChunk& chunk,
                         const float* x, std::span<const int64_t> positions, float* grad_q, float* grad_k);

// The whole procedure: teacher on both sets, random init (evaluated), training, evaluation.
Result<DistillReport> distill_retrieval_head(std::shared_ptr<const Model> model,
                                             std::shared_ptr<Backend> backend,
                                             const std::vector<std::vector<TokenId>>& train,
                                             const std::vector<std::vector<TokenId>>& heldout,
                                             const DistillOptions& options);

}  // namespace specontext
