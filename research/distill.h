// Distillation of a retrieval head (EAGLE-3 layout) from a target model's own attention, for
// targets that have no EAGLE-3 draft (the bundled tiny models).
//
// Teacher, per position t and KV head g: T_g(t) = the target's attention over keys 0..t, per
// layer the max over the query heads of group g (the group reduction select_tokens applies to
// the head's scores; TeacherReduction::kGroupMean takes their mean instead), averaged over all
// layers and renormalised to sum 1 (obtained from a dense
// prefill of each chunk through ForwardObserver). Student, per query head h of group g:
// P_h(t) = softmax(q_h(t)·k(j)/√head_dim), j ≤ t, with the head's own forward
// (retrieval_head.h): x = RMSNorm_in(embed(t)) ⊕ RMSNorm_hidden(fc · fused(t−1)), q = RoPE(wq·x),
// k = RoPE(wk·x). Loss: mean over positions and query heads of KL(T_g ‖ P_h). Every parameter
// the head keeps is trained (Adam, gradients written by hand through the softmax, RoPE, the
// projections, both RMSNorms with their weights and fc); DistillTrain freezes groups.
//
// Single-threaded by design (the bundled models train in minutes); the target forward uses
// whatever backend the caller passes (host memory only).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext {

// Parameter groups that distillation updates (the others keep their initial values: fc
// [I/3 I/3 I/3], norms 1, random wq/wk).
struct DistillTrain {
  bool fc = true;     // fc.weight [d, 3d]
  bool norms = true;  // input_layernorm and hidden_norm weights [d]
  bool qk = true;     // q_proj and k_proj
};

// "fc,norms,qk" (any subset, comma-separated) -> groups; an unknown name is an error.
Result<DistillTrain> parse_distill_train(std::string_view names);
std::string distill_train_names(const DistillTrain& t);  // the inverse: "fc,norms,qk"

// How the teacher reduces a GQA group's query heads to one distribution per KV head, per layer.
enum class TeacherReduction {
  kGroupMax,   // the max over the group (what select_tokens applies to the head's scores)
  kGroupMean,  // the mean (the group's average attention: what per-head recall averages)
};
Result<TeacherReduction> parse_teacher_reduction(std::string_view name);  // "max" / "mean"

// The keys the loss ranks. Selection always keeps the first sinks and the last window tokens
// (SelectionOptions), so the head's scores only decide among the others; excluding them puts
// the whole KL on that decision (teacher and head renormalised over the remaining keys). 0, 0:
// the whole distribution.
//
// Position weighting: kUniform gives every query position and query head the same weight (the
// loss is their mean). kFar weighs the KL of position t, query head h (group g) by the teacher
// mass T_g(t) puts on the ranked keys plus weight_floor, and divides by the sum of those weights:
// positions whose attention lies in the sinks and the recent window (which selection keeps
// anyway) barely count, positions that look far back count fully (models/longctx/distill.py's
// --head-weight far with --head-weight-floor). Positions with no ranked key are left out of the
// sum. weight_floor applies to kFar only (under kUniform a constant added to every weight would
// not change the mean).
enum class PositionWeight {
  kUniform,
  kFar,
};
Result<PositionWeight> parse_position_weight(std::string_view name);  // "uniform" / "far"

// What each KV head's teacher T_g is compared with. kEach: every query head h of the group on its
// own, KL(T_g ‖ P_h), so the group's heads all learn the same distribution. kGroupMax: the group's
// max over its query heads, renormalised, KL(T_g ‖ max_h P_h / Σ max_h P_h): the scores selection
// ranks by (select_tokens takes the group max), so the heads of a group are free to split the
// teacher's modes (its layers) among them; with more query heads than the target's
// (DistillOptions::q_per_group) that is where they help. kMix: (1 − group_mix)·kEach +
// group_mix·kGroupMax, each head held to the whole teacher while the max is fitted too.
enum class GroupLoss {
  kEach,
  kGroupMax,
  kMix,
};
Result<GroupLoss> parse_group_loss(std::string_view name);  // "each" / "max" / "mix"

struct DistillObjective {
  int64_t exclude_sinks = 0;
  int64_t exclude_window = 0;
  PositionWeight position_weight = PositionWeight::kUniform;
  double weight_floor = 0.1;
  GroupLoss group_loss = GroupLoss::kEach;
  double group_mix = 0.5;  // kMix: the kGroupMax term's weight
};

struct DistillOptions {
  int64_t steps = 800;                          // Adam steps
  double lr = 5e-3;                             // peak learning rate (cosine decay to lr/10)
  int64_t context = 0;                          // tokens per chunk; 0 = the model's max_seq_len
  int64_t batch_positions = 128;                // query positions per step (all of a chunk when fewer)
  uint64_t seed = 1;                            // initial head and minibatch sampling
  std::vector<int64_t> budgets = {16, 32, 64};  // top-B recall budgets of the report
  int64_t min_chunk = 8;                        // shorter trailing chunks are dropped
  int64_t log_every = 100;                      // on_step period
  DistillTrain train;                           // groups updated (default: all)
  TeacherReduction teacher = TeacherReduction::kGroupMax;
  DistillObjective objective;
  int64_t q_per_group = 0;                      // the head's query heads per KV head (0 = the target's)
  std::function<void(int64_t step, double train_kl)> on_step;  // progress (optional)
};

// One chunk's teacher targets and the student's inputs.
struct DistillChunk {
  std::vector<TokenId> tokens;  // positions 0..T−1 of a fresh sequence
  std::vector<float> fused;     // [T, 3d] fused features of each row (EAGLE-3 taps)
  std::vector<float> teacher;   // [kv_heads][T(T+1)/2]: row t holds T_g(t) over keys 0..t (sums to 1)
  int64_t length() const { return static_cast<int64_t>(tokens.size()); }
};

struct BudgetRecall {
  int64_t budget = 0;
  int64_t positions = 0;  // positions with more than `budget` keys (others are trivially 1)
  double head = 0;        // teacher mass on the head's top-B per KV head (max over its group)
  double streaming = 0;   // same for 4 sinks + the most recent B−4 tokens (StreamingLLM)
  double oracle = 0;      // the teacher's own top-B mass (upper bound)
};

struct Fidelity {
  int64_t positions = 0;  // query positions evaluated (t ≥ 1)
  double kl = 0;          // mean over positions and query heads of KL(T_g ‖ P_h), nats
  double kl_group = 0;    // mean over positions and KV heads of KL(T_g ‖ max_h P_h renormalised), nats
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

// The same, story by story: byte_begin is where the story's text starts in `text` (0 or just
// after a separator), so text.substr(byte_begin) encodes to this story and every later one.
struct CorpusStory {
  size_t byte_begin = 0;
  std::vector<TokenId> tokens;
};
Result<std::vector<CorpusStory>> encode_corpus_stories(const Tokenizer& tokenizer, std::string_view text);

// The held-out split of one corpus. With several stories, the held-out set is the last whole
// stories, the fewest that hold at least `fraction` of the tokens (so it is a byte suffix of the
// file: heldout_byte); with one story, the last `fraction` of its tokens (heldout_byte = npos).
struct CorpusSplit {
  std::vector<TokenId> train, heldout;
  size_t heldout_byte = std::string_view::npos;
  int64_t train_stories = 0, stories = 0;
};
CorpusSplit split_heldout_stories(std::span<const CorpusStory> stories, double fraction);

// Consecutive chunks of `context` tokens; a trailing chunk shorter than min_len is dropped. With
// bos >= 0 every chunk starts with it, as a fresh sequence (a prompt, eval's context) does: a
// chunk whose first corpus token is not bos gets it prepended and holds context−1 corpus tokens.
std::vector<std::vector<TokenId>> split_chunks(std::span<const TokenId> tokens, int64_t context,
                                               int64_t min_len, TokenId bos = -1);

// Runs a dense prefill of every chunk and records the teacher attention and fused features.
Result<std::vector<DistillChunk>> collect_teacher(
    std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
    const std::vector<std::vector<TokenId>>& chunks,
    TeacherReduction reduction = TeacherReduction::kGroupMax);

// Held-out fidelity of a head against recorded teacher chunks (q/k through retrieval_qk).
Result<Fidelity> evaluate_head(Backend& backend, const Model& model, const RetrievalHead& head,
                               std::span<const DistillChunk> chunks, std::span<const int64_t> budgets);

// The head's fixed inputs for one chunk: the target's embedding rows of its tokens [T, d] (f32)
// and fused(p−1) of each row [T, 3d] (zeros for position 0).
struct HeadInputs {
  std::vector<float> embed;
  std::vector<float> fused_prev;
};
Result<HeadInputs> head_inputs(Backend& backend, const Model& model, const DistillChunk& chunk);

// Gradients w.r.t. every parameter the head keeps, f32, in the head's layouts.
struct HeadGradients {
  std::vector<float> fc;           // [d, 3d]
  std::vector<float> input_norm;   // [d]
  std::vector<float> hidden_norm;  // [d]
  std::vector<float> wq;           // [n_heads·head_dim, 2d]
  std::vector<float> wk;           // [n_kv_heads·head_dim, 2d]
};

// The training objective on one chunk: mean over `positions` (each t ≥ 1) and query heads of
// KL(T_g(t) ‖ P_h(t)) (weighted mean with PositionWeight::kFar), with the head's forward
// computed here (the same arithmetic as
// retrieval_qk). When grads is not null, its vectors are resized and overwritten with the
// gradient. Exposed for a finite-difference test.
double distill_loss_grad(const RetrievalHead& head, const RopeParams& rope, const DistillChunk& chunk,
                         const HeadInputs& inputs, std::span<const int64_t> positions, HeadGradients* grads,
                         const DistillObjective& objective = {});

// The whole procedure: teacher on both sets, random init (evaluated), training, evaluation.
Result<DistillReport> distill_retrieval_head(std::shared_ptr<const Model> model,
                                             std::shared_ptr<Backend> backend,
                                             const std::vector<std::vector<TokenId>>& train,
                                             const std::vector<std::vector<TokenId>>& heldout,
                                             const DistillOptions& options);

// FNV-1a (64-bit) of bytes: how a head's metadata names its training text
// (train_text_fnv1a64; `specontext eval` refuses a --text with that hash).
uint64_t fnv1a64(std::string_view bytes);

// write_retrieval_head plus extra "__metadata__" entries (the training text and split); an
// extra key that the head's own metadata already holds is an error.
Status write_distilled_head(const std::string& path, const RetrievalHead& head,
                            const std::map<std::string, std::string>& extra);

}  // namespace specontext
