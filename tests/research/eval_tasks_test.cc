// The long-context task suite (research/eval_tasks.h): tasks.json parsing, prompt construction
// (lengths, needle placement, determinism) and answer scoring, with the bundled long-context
// model's own tokenizer and task file.
#include "research/eval_tasks.h"

#include <map>

#include <gtest/gtest.h>

#include "core/model/model_loader.h"
#include "cpu/cpu_backend.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;

class EvalTasksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = load_hf_tokenizer(repo_path("models/longctx/tokenizer.json"));
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    tok_ = std::move(*t);
    auto s = parse_task_suite(read_text_file(repo_path("models/longctx/tasks.json")), "tasks.json");
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    suite_ = *s;
    // The first 60 kB of the held-out novel: ~20K tokens, more than the longest prompt here.
    auto f = tok_->encode(normalize_paragraphs(read_text_file(repo_path("data/austen/persuasion.txt")).substr(0, 60000)), false);
    ASSERT_TRUE(f.is_ok());
    filler_ = *f;
  }
  // A passkey and a kv prompt of 512 tokens, needle at depth 0.
  static TaskPromptOptions short_prompts() {
    TaskPromptOptions po;
    po.kinds = {TaskKind::kPasskey, TaskKind::kKvLookup};
    po.lengths = {512};
    po.depths = {0.0};
    po.trials = 1;
    return po;
  }
  // The bundled long-context model on the CPU over `prompts`, budget 64.
  Result<TaskReport> run_short(const std::vector<TaskPrompt>& prompts, const TaskPromptOptions& po,
                                      std::vector<SparseMethod> methods) {
    SPX_ASSIGN_OR_RETURN(auto m, load_model(repo_path("models/longctx/hf")));
    SPX_ASSIGN_OR_RETURN(auto b, cpu::create_cpu_backend(cpu::CpuBackendOptions{}));
    TaskEvalOptions o;
    o.methods = std::move(methods);
    o.budgets = {64};
    return run_task_eval(m, std::shared_ptr<Backend>(std::move(b)), *tok_, prompts, po, o);
  }
  std::unique_ptr<Tokenizer> tok_;
  TaskSuite suite_;
  std::vector<TokenId> filler_;
};

TEST_F(EvalTasksTest, PromptsHaveTheirLengthAndTheNeedleAtItsDepth) {
  TaskPromptOptions o;
  o.lengths = {512, 2048};
  o.depths = {0.0, 0.5, 1.0};
  o.trials = 2;
  auto prompts = build_task_prompts(*tok_, suite_, filler_, o);
  ASSERT_TRUE(prompts.is_ok()) << prompts.status().to_string();
  ASSERT_EQ(prompts->size(), 5u * 2 * 3 * 2);
  for (const TaskPrompt& p : *prompts) {
    const int64_t n = static_cast<int64_t>(p.prompt.size());
    EXPECT_LE(n + p.answer_tokens, p.length);
    EXPECT_GT(n + p.answer_tokens, p.length - 64) << "the filler should take up the rest";
    EXPECT_EQ(p.prompt.front(), tok_->bos_id());
    // The needle's tokens start at needle_at, near its depth in the prompt (at 512 tokens the
    // other needles are a large share of the prompt and shift it).
    const double at = static_cast<double>(p.needle_at) / static_cast<double>(n);
    if (p.length >= 2048) {
      EXPECT_NEAR(at, p.depth, 0.1) << task_kind_name(p.kind) << " length " << p.length << " depth " << p.depth;
    }
    const std::string from_needle = tok_->decode(std::vector<TokenId>(p.prompt.begin() + p.needle_at, p.prompt.end()));
    const std::string text = tok_->decode(p.prompt);
    if (p.ordered) {  // the asked needle holds the answer
      ASSERT_EQ(p.answers.size(), 1u);
      EXPECT_NE(from_needle.find(p.answers[0] + "."), std::string::npos) << task_kind_name(p.kind);
    } else {  // every value (multivalue) or variable (vt) is somewhere in the text
      for (const std::string& a : p.answers) EXPECT_NE(text.find(" " + a), std::string::npos) << a;
    }
    EXPECT_NE(text.find(p.kind == TaskKind::kPasskey ? "pass key" : p.kind == TaskKind::kVarTracking ? "VAR" : "for "),
              std::string::npos);
  }
  // Deterministic from the seed; another seed gives other prompts.
  auto again = build_task_prompts(*tok_, suite_, filler_, o);
  ASSERT_TRUE(again.is_ok());
  for (size_t i = 0; i < prompts->size(); ++i) EXPECT_EQ((*prompts)[i].prompt, (*again)[i].prompt);
  o.seed = 2;
  auto other = build_task_prompts(*tok_, suite_, filler_, o);
  ASSERT_TRUE(other.is_ok());
  size_t same = 0;
  for (size_t i = 0; i < prompts->size(); ++i) same += (*prompts)[i].prompt == (*other)[i].prompt;
  EXPECT_EQ(same, 0u);
}

TEST_F(EvalTasksTest, PasskeyPromptEndsWithTheQuestion) {
  TaskPromptOptions o;
  o.kinds = {TaskKind::kPasskey};
  o.lengths = {1024};
  o.depths = {0.5};
  o.trials = 1;
  auto prompts = build_task_prompts(*tok_, suite_, filler_, o);
  ASSERT_TRUE(prompts.is_ok());
  const TaskPrompt& p = prompts->front();
  const std::string text = tok_->decode(p.prompt);
  EXPECT_TRUE(text.ends_with(" What is the pass key? The pass key is")) << text.substr(text.size() - 80);
  ASSERT_EQ(p.answers.size(), 1u);
  EXPECT_EQ(p.answers[0].size(), 6u);  // " " + five digits
  EXPECT_NE(text.find("The pass key is" + p.answers[0] + ". Remember it."), std::string::npos);
}

TEST_F(EvalTasksTest, TooShortFillerOrLengthIsAnError) {
  TaskPromptOptions o;
  o.lengths = {8192};
  ASSERT_GT(filler_.size(), 8192u);
  std::vector<TokenId> short_filler(filler_.begin(), filler_.begin() + 1000);
  auto r = build_task_prompts(*tok_, suite_, short_filler, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("filler"), std::string::npos);
  o.lengths = {40};
  r = build_task_prompts(*tok_, suite_, filler_, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("no room"), std::string::npos);
}

TEST(EvalTasks, AnswersAreScoredAsWholeWords) {
  TaskPrompt ordered;
  ordered.answers = {" 38896"};
  EXPECT_TRUE(task_answer_correct(ordered, " 38896."));
  EXPECT_TRUE(task_answer_correct(ordered, " 38896"));
  EXPECT_FALSE(task_answer_correct(ordered, " 388961."));
  EXPECT_FALSE(task_answer_correct(ordered, " 3889"));
  EXPECT_FALSE(task_answer_correct(ordered, "38896."));
  TaskPrompt unordered;
  unordered.ordered = false;
  unordered.answers = {"ALWAYS", "AUNT", "ARE"};
  EXPECT_TRUE(task_answer_correct(unordered, " AUNT, ARE and ALWAYS."));
  EXPECT_TRUE(task_answer_correct(unordered, " ALWAYS, AUNT and ARE. More"));
  EXPECT_FALSE(task_answer_correct(unordered, " ALWAYS, AUNT. ARE"));  // after the sentence's end
  EXPECT_FALSE(task_answer_correct(unordered, " ALWAYS, AUNTS and ARE."));
  unordered.answers.clear();
  EXPECT_FALSE(task_answer_correct(unordered, " anything."));
}

TEST(EvalTasks, RulerScoreIsTheFractionOfAnswerWordsFound) {
  TaskPrompt unordered;
  unordered.ordered = false;
  unordered.answers = {"ALWAYS", "AUNT", "ARE", "ASK"};
  EXPECT_DOUBLE_EQ(task_answer_score(unordered, " ASK, AUNT, ARE and ALWAYS."), 1.0);
  EXPECT_DOUBLE_EQ(task_answer_score(unordered, " AUNT, AUNT, ARE and THE."), 0.5);
  EXPECT_DOUBLE_EQ(task_answer_score(unordered, " ALWAYS. AUNT, ARE and ASK."), 0.25);  // the rest after '.'
  EXPECT_DOUBLE_EQ(task_answer_score(unordered, " AUNTS."), 0.0);
  TaskPrompt ordered;
  ordered.answers = {" 38896"};
  EXPECT_DOUBLE_EQ(task_answer_score(ordered, " 38896."), 1.0);
  EXPECT_DOUBLE_EQ(task_answer_score(ordered, " 388961."), 0.0);
  unordered.answers.clear();
  EXPECT_DOUBLE_EQ(task_answer_score(unordered, " anything."), 0.0);
}

TEST(EvalTasks, SuiteFilesAreCheckedFieldByField) {
  auto bad = parse_task_suite("[1]", "t.json");
  ASSERT_FALSE(bad.is_ok());
  bad = parse_task_suite(R"({"templates": {"passkey_needle": "x"}})", "t.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("templates.passkey_query"), std::string::npos) << bad.status().message();
  EXPECT_FALSE(parse_task_kind("needle").is_ok());
  EXPECT_EQ(*parse_task_kind("vt"), TaskKind::kVarTracking);
}

TEST(EvalTasks, ParagraphsAreJoinedAsTheTrainingScriptJoinsThem) {
  EXPECT_EQ(normalize_paragraphs("Chapter 1\n\n\nIt is a truth\n  universally acknowledged.\n\n\"Yes.\"\n"),
            "Chapter 1\n\nIt is a truth universally acknowledged.\n\n\"Yes.\"");
  EXPECT_EQ(normalize_paragraphs(""), "");
}

TEST_F(EvalTasksTest, EveryAnswerTokenIsDecodedByTheMethodNotPrefilledDensely) {
  // The prompt's last token is decoded under the method, so even the first answer token (the
  // whole answer of a single-token task) comes from sparse attention, not from dense prefill.
  const TaskPromptOptions po = short_prompts();
  auto prompts = build_task_prompts(*tok_, suite_, filler_, po);
  ASSERT_TRUE(prompts.is_ok()) << prompts.status().to_string();
  auto rep = run_short(*prompts, po, {SparseMethod::kStreaming});
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  int64_t answer_tokens = 0;
  for (const TaskPrompt& p : *prompts) answer_tokens += p.answer_tokens;
  ASSERT_FALSE(rep->speed.empty());
  for (const TaskSpeed& sp : rep->speed) {
    EXPECT_EQ(sp.decode_tokens, answer_tokens) << sparse_method_name(sp.method) << " budget " << sp.budget;
  }
}

TEST_F(EvalTasksTest, EveryPromptReportsEachMethodsAnswerAndTheJsonlHoldsItsTokens) {
  const TaskPromptOptions po = short_prompts();
  auto prompts = build_task_prompts(*tok_, suite_, filler_, po);
  ASSERT_TRUE(prompts.is_ok()) << prompts.status().to_string();
  auto rep = run_short(*prompts, po, {SparseMethod::kDense, SparseMethod::kStreaming});
  ASSERT_TRUE(rep.is_ok()) << rep.status().to_string();
  ASSERT_EQ(rep->prompts.size(), prompts->size());
  // Per prompt, one answer per run, in run order; the records' counts are the sums of its flags.
  std::map<std::string, int64_t> correct_by_run;
  for (size_t i = 0; i < prompts->size(); ++i) {
    const TaskReport::PromptResult& pr = rep->prompts[i];
    EXPECT_EQ(pr.kind, (*prompts)[i].kind);
    EXPECT_EQ(pr.tokens, static_cast<int64_t>((*prompts)[i].prompt.size()));
    EXPECT_EQ(pr.needle_at, (*prompts)[i].needle_at);
    ASSERT_EQ(pr.answers.size(), 2u);
    EXPECT_EQ(pr.answers[0].method, SparseMethod::kDense);
    EXPECT_EQ(pr.answers[1].method, SparseMethod::kStreaming);
    EXPECT_EQ(pr.answers[1].budget, 64);
    for (const TaskReport::Answer& a : pr.answers) {
      EXPECT_FALSE(a.text.empty());
      EXPECT_EQ(a.correct, task_answer_correct((*prompts)[i], a.text));
      correct_by_run[std::string(sparse_method_name(a.method))] += a.correct ? 1 : 0;
    }
  }
  std::map<std::string, int64_t> correct_in_records;
  for (const TaskRecord& r : rep->records) correct_in_records[std::string(sparse_method_name(r.method))] += r.correct;
  EXPECT_EQ(correct_by_run, correct_in_records);
  const nlohmann::json j = task_report_to_json(*rep);
  ASSERT_EQ(j["prompts"].size(), prompts->size());
  EXPECT_EQ(j["prompts"][1]["task"], "kv");
  EXPECT_EQ(j["prompts"][1]["answers"][1]["method"], "streaming");
  // The JSONL: one line per prompt with its tokens.
  const std::string lines = task_prompts_to_jsonl(*prompts);
  size_t at = 0;
  for (const TaskPrompt& p : *prompts) {
    const size_t end = lines.find('\n', at);
    ASSERT_NE(end, std::string::npos);
    const nlohmann::json line = nlohmann::json::parse(lines.substr(at, end - at));
    EXPECT_EQ(line["tokens"].get<std::vector<TokenId>>(), p.prompt);
    EXPECT_EQ(line["needle_at"], p.needle_at);
    EXPECT_EQ(line["answers"].get<std::vector<std::string>>(), p.answers);
    at = end + 1;
  }
  EXPECT_EQ(at, lines.size());
}

}  // namespace
}  // namespace specontext
