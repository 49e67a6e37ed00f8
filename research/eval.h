// Fidelity evaluation of sparse decode methods against dense attention (`specontext eval`).
//
// Protocol, per method × budget (one Engine each, one sequence at a time):
//   1. Teacher forcing. Prefill the first P = context − positions tokens densely, then feed the
//      next `positions` tokens one decode step at a time (a step is sparse when its length
//      exceeds the budget). Per step and layer, an observer recomputes the true attention of
//      the decode query over the whole cache, softmax(q·Kᵀ/√d), and compares it with the
//      selection the engine used: attention-mass recall Σ_{t∈S} w(t) and the relative L2 error
//      of the attention output restricted (and renormalised) to S, per query head. Per step,
//      KL(dense ‖ method) of the next-token distribution and top-1 agreement against the dense
//      engine at the same position with the same prefix.
//   2. First divergence. From the same P-token prefix, greedy generation of G tokens; the first
//      index where the method's token differs from dense's (G when none).
//   3. Needle/passkey. "The secret number is NNNN." inserted into filler at depths 10–90 %,
//      prompt ending with "The secret number is"; accuracy against the digits and agreement of
//      the greedy answer tokens with the dense engine's answer.
// The dense method is the reference: recall 1, error 0, KL 0, top-1 1 by construction.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/base/status.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext {

struct EvalOptions {
  int64_t context = 0;                      // prefix tokens; 0 = the model's max_seq_len
  int64_t positions = 64;                   // teacher-forced decode steps per method × budget
  std::vector<int64_t> budgets = {16, 32, 64, 128};
  std::vector<SparseMethod> methods = {SparseMethod::kDense, SparseMethod::kStreaming, SparseMethod::kQuest,
                                       SparseMethod::kOracle, SparseMethod::kSpeContext};
  int64_t sinks = 1;
  // Small on purpose: at budget 16 a window of 16 would leave no slot for the top-k methods.
  int64_t window = 4;
  int64_t quest_page_size = 16;
  int64_t divergence_tokens = 32;           // G
  int64_t needles = 2;                      // trials per depth (0 = no needle test)
  std::vector<double> needle_depths = {0.1, 0.3, 0.5, 0.7, 0.9};
  uint64_t seed = 1;                        // needle digits and positions
  int64_t page_size = 16;                   // engine KV page size
  int64_t prefill_chunk = 256;              // most prompt tokens per forward
  // Required by SparseMethod::kSpeContext; without it that method is skipped with a note.
  std::shared_ptr<const RetrievalHead> head;
  std::function<void(const std::string&)> on_progress;  // one line per finished record (optional)
};

struct EvalInputs {
  std::vector<TokenId> tokens;          // evaluation stream; at least `context` tokens
  const Tokenizer* tokenizer = nullptr; // needle prompts need it (null: no needle test)
  std::vector<TokenId> filler;          // needle filler tokens (no BOS inside); empty: `tokens`
};

struct EvalRecord {
  SparseMethod method = SparseMethod::kDense;
  int64_t budget = 0;                   // 0 for dense (every cached token)
  double attention_recall = 1.0;        // mean over steps, layers, query heads
  // The same recall for the best single selection serving every layer (same budget, sinks and
  // window) on this run's own queries: an upper bound on any shared selection's recall (SpeContext,
  // streaming), where eval's oracle selects per layer. Mean over the steps whose every layer was
  // sparse; nullopt for dense and when there were none.
  std::optional<double> shared_oracle_recall;
  double output_rel_l2 = 0.0;           // ‖o_S − o‖ / ‖o‖, same mean
  double kl = 0.0;                      // mean over steps of KL(dense ‖ method), nats
  double kl_max = 0.0;
  double top1_agreement = 1.0;
  int64_t first_divergence = 0;         // G when the greedy continuations agree throughout
  std::optional<double> needle_accuracy;   // vs the inserted digits (nullopt: no needle test)
  std::optional<double> needle_agreement;  // answer tokens equal to dense's
  int64_t needle_trials = 0;
  int64_t sparse_steps = 0;             // teacher-forced steps that decoded sparsely
  double mean_overlap = 0.0;            // SparseStats::overlap() of the teacher-forced steps
  double bytes_loaded_per_token = 0.0;  // elastic K+V loads per decode token (all layers)
  double attended_bytes_per_token = 0.0;  // K+V bytes the attention reads per decode token
  double seconds = 0.0;
};

struct EvalReport {
  int64_t context = 0;
  int64_t positions = 0;
  int64_t prefix = 0;                   // P = context − positions
  int64_t divergence_tokens = 0;
  int64_t divergence_prefix = 0;        // prompt length of the first-divergence runs
  int64_t needle_trials = 0;            // prompts per method × budget
  int64_t needle_prompt_tokens = 0;     // longest needle prompt (filler ends at a sentence end)
  std::vector<int64_t> budgets;
  int64_t sinks = 0, window = 0, quest_page_size = 0;
  std::vector<EvalRecord> records;
  // Per needle trial: depth, digits, token index of the needle and the dense engine's answer.
  struct NeedleExample {
    double depth = 0.0;
    std::string digits;
    int64_t needle_at = 0;
    std::string dense_answer;
  };
  std::vector<NeedleExample> needle_examples;
  std::string needle_example_prompt;    // decoded text of the first needle prompt
  std::vector<std::string> notes;       // skipped methods, needle caveats, text repetition
  double seconds = 0.0;
};

// Attention fidelity of one decode query in one layer (exposed for tests).
struct StepFidelity {
  double recall_sum = 0.0;       // Σ over query heads of the attention mass on the selection
  double rel_l2_sum = 0.0;       // Σ over query heads of ‖o_S − o‖ / ‖o‖
  int64_t heads = 0;
  int64_t attended_tokens = 0;   // Σ over KV heads of the tokens attended
};
// q [n_heads·head_dim] (after RoPE) against tokens [0, length) of the view; selection: the
// tokens each KV head attends (null = dense: recall 1, error 0). GQA as in Backend::attention.
StepFidelity attention_fidelity(const float* q, int64_t n_heads, const KvLayerView& kv, int64_t length,
                                const Selection* selection);

// Per query head h (GQA as in Backend::attention), softmax(q_h · K / √head_dim) over tokens
// [0, length) of the view, in double: out [n_heads][length].
void attention_weights(const float* q, int64_t n_heads, const KvLayerView& kv, int64_t length,
                       std::vector<double>& out);
// The best selection shared by every layer of one step and its recall. layer_weights: per layer
// attention_weights' output. Per KV head the sinks and the window are kept (as every selection
// keeps them) and the rest of the budget goes to the tokens of the largest summed weight over all
// layers and the group's query heads, which maximises the summed mass over layers and heads:
// no shared selection with the same options has a higher recall. Returns that recall (mean over
// layers and query heads); `selection` (optional) receives the tokens.
double shared_oracle_recall(std::span<const std::vector<double>> layer_weights, int64_t n_heads, int64_t n_kv_heads,
                            int64_t length, const SelectionOptions& options, Selection* selection = nullptr);
// The recall of a given selection on the same weights (mean over layers and query heads).
double selection_recall(std::span<const std::vector<double>> layer_weights, int64_t n_heads, int64_t n_kv_heads,
                        int64_t length, const Selection& selection);

// Runs the whole protocol. `backend` is shared by every engine (used one at a time).
Result<EvalReport> run_eval(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                            const EvalInputs& inputs, const EvalOptions& options);

// Stories separated by "<|endoftext|>", each encoded with BOS (llama2.c pretokenisation).
Result<std::vector<TokenId>> encode_stories(const Tokenizer& tokenizer, std::string_view text);
// The same text with separators turned into spaces, encoded without BOS (needle filler).
Result<std::vector<TokenId>> encode_filler(const Tokenizer& tokenizer, std::string_view text);
// n tokens uniform in [0, vocab) except control ids 0..2 when the vocabulary is larger than 3.
std::vector<TokenId> synthetic_tokens(int64_t n, int64_t vocab, uint64_t seed);

// {"context", "positions", ..., "records": [{method, budget, attention_recall, ...}], "notes"}.
nlohmann::json eval_report_to_json(const EvalReport& report);
// Human table: one row per record.
std::string format_eval_table(const EvalReport& report);

}  // namespace specontext
