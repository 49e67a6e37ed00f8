// Long-context task suites for `specontext eval --tasks` (RULER-style, Hsieh et al. 2024):
// prompts of chosen lengths with needles at chosen depths in held-out prose, answered by greedy
// decoding under every sparse method × budget, scored against the inserted answer.
//
// The sentences come from a model's tasks.json (written by the script that trained the model,
// e.g. models/longctx/train.py), so the engine asks exactly what the model was trained to answer:
//   templates  passkey_needle/passkey_query, word_needle/word_query, multivalue_needle/
//              multivalue_query, code_fact/code_query, var_first/var_next/var_query; fields in
//              braces ({num}, {key}, {val}, {vals}, {var}, {prev}, {vars})
//   keys, values, vars   word pools the fields are drawn from
// Tasks (per prompt, everything else random from the seed):
//   passkey     one 5-digit pass key at the depth
//   multikey    6 needles with distinct keys; the asked one at the depth, the others anywhere
//   multivalue  4 values of one key (the first at the depth) and 2 distractor needles; all 4
//               values must be named, in any order
//   kv          12 code facts; the asked one at the depth
//   vt          a chain of 3 variable assignments from a 5-digit value (the first at the depth);
//               all 3 variables must be named, in any order
// A prompt of length L is [BOS] filler-with-needles query-prefix, with the answer's tokens
// fitting inside L; needles go in at the first sentence end at or after their depth.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/base/status.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/ports/backend.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext {

struct TaskSuite {
  std::map<std::string, std::string> templates;
  std::vector<std::string> keys, values, vars;
};

// Parses a tasks.json; every template the tasks use must be there, each pool non-empty.
Result<TaskSuite> parse_task_suite(std::string_view json_text, const std::string& source);

enum class TaskKind { kPasskey, kMultiKey, kMultiValue, kKvLookup, kVarTracking };
std::string_view task_kind_name(TaskKind k);
Result<TaskKind> parse_task_kind(std::string_view name);
std::vector<TaskKind> all_task_kinds();

struct TaskPrompt {
  TaskKind kind = TaskKind::kPasskey;
  int64_t length = 0;           // the L asked for: prompt + answer tokens <= L
  double depth = 0.0;
  std::vector<TokenId> prompt;
  std::vector<std::string> answers;  // what the greedy answer must name
  bool ordered = true;          // one answer, right after the prompt; else all, in any order
  int64_t needle_at = 0;        // token index of the needle at `depth`
  int64_t answer_tokens = 0;    // greedy tokens decoded
  int64_t trial = 0;            // index among the prompts of one kind × length × depth
};

struct TaskPromptOptions {
  std::vector<TaskKind> kinds = all_task_kinds();
  std::vector<int64_t> lengths = {1024, 2048, 4096, 8192};
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};
  int64_t trials = 2;           // prompts per kind × length × depth
  uint64_t seed = 1;
};

// Prompts in kinds × lengths × depths × trials order. `filler`: held-out prose tokens (no BOS),
// long enough for the longest length (else an error names the shortfall).
Result<std::vector<TaskPrompt>> build_task_prompts(const Tokenizer& tok, const TaskSuite& suite,
                                                   const std::vector<TokenId>& filler,
                                                   const TaskPromptOptions& o);

// Whether a greedy answer's text names what the prompt asks: an ordered answer must follow the
// prompt at once and end at a word boundary; unordered ones must each appear as whole words
// before the answer's first '.'.
bool task_answer_correct(const TaskPrompt& p, std::string_view generated);
// RULER's string_match_all, read as task_answer_correct reads: the fraction of the prompt's
// answers found (1 or 0 for an ordered answer). Partial credit for multi-word answers.
double task_answer_score(const TaskPrompt& p, std::string_view generated);

// Paragraphs (blank-line separated) with their lines joined by single spaces, joined by "\n\n":
// the form the training script gives its prose (train.py normalize).
std::string normalize_paragraphs(std::string_view raw);

struct TaskEvalOptions {
  std::vector<SparseMethod> methods = {SparseMethod::kDense, SparseMethod::kStreaming, SparseMethod::kQuest,
                                       SparseMethod::kOracle, SparseMethod::kSpeContext};
  std::vector<int64_t> budgets = {64, 256, 1024};
  int64_t sinks = 4;
  int64_t window = 32;
  int64_t quest_page_size = 16;
  int64_t page_size = 16;
  int64_t prefill_chunk = 512;
  std::shared_ptr<const RetrievalHead> head;  // required by kSpeContext, else it is skipped
  std::function<void(const std::string&)> on_progress;
};

// One cell: method × budget × kind × length × depth.
struct TaskRecord {
  SparseMethod method = SparseMethod::kDense;
  int64_t budget = 0;           // 0 for dense
  TaskKind kind = TaskKind::kPasskey;
  int64_t length = 0;
  double depth = 0.0;
  int64_t trials = 0;
  int64_t correct = 0;
  double score = 0.0;           // sum over trials of task_answer_score (RULER's metric)
  int64_t same_as_dense = 0;    // greedy answer tokens equal to dense's
};

// Decode speed of one method × budget over all its prompts of one length.
struct TaskSpeed {
  SparseMethod method = SparseMethod::kDense;
  int64_t budget = 0;
  int64_t length = 0;
  int64_t decode_tokens = 0;
  double decode_seconds = 0.0;
  double prefill_seconds = 0.0;
  double bytes_loaded_per_token = 0.0;    // elastic K+V loads into working sets, all layers
  double attended_bytes_per_token = 0.0;  // K+V the attention reads per decode token, all layers
};

struct TaskReport {
  std::vector<TaskRecord> records;
  std::vector<TaskSpeed> speed;
  std::vector<int64_t> lengths, budgets;
  std::vector<double> depths;
  int64_t trials = 0, sinks = 0, window = 0, quest_page_size = 0;
  struct Answer {
    SparseMethod method = SparseMethod::kDense;
    int64_t budget = 0;
    std::string text;  // the greedy answer tokens, decoded
    bool correct = false;
  };
  struct PromptResult {  // one per prompt, in prompt order: which prompts each method misses
    TaskKind kind = TaskKind::kPasskey;
    int64_t length = 0, trial = 0, needle_at = 0, tokens = 0;
    double depth = 0.0;
    std::string want;  // the answers asked for, joined by " | "
    std::vector<Answer> answers;  // every method × budget run
  };
  std::vector<PromptResult> prompts;
  std::vector<std::string> notes;
  double seconds = 0.0;
};

Result<TaskReport> run_task_eval(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                                 const Tokenizer& tok, const std::vector<TaskPrompt>& prompts,
                                 const TaskPromptOptions& prompt_options, const TaskEvalOptions& o);

// One JSON line per prompt: kind, length, depth, trial, needle_at, answers and the token ids, for
// analysis outside the engine (models/longctx/attend.py reads it).
std::string task_prompts_to_jsonl(const std::vector<TaskPrompt>& prompts);
// {"records": [...], "speed": [...], "summary": {method: {budget: {kind: accuracy}}}, "prompts": [...], ...}
nlohmann::json task_report_to_json(const TaskReport& r);
// Accuracy per method × budget (rows) and kind (columns), every length and depth pooled, then
// per length.
std::string format_task_table(const TaskReport& r);

}  // namespace specontext
