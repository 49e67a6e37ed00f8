#include "research/eval_tasks.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "core/base/utf8.h"
#include "core/ports/sampler.h"
#include "research/eval_internal.h"

namespace specontext {

namespace {

using Clock = std::chrono::steady_clock;
using eval_internal::seconds_since;
using eval_internal::splitmix64;

// A small deterministic generator for one prompt.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return splitmix64(state_); }
  int64_t below(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  std::string number() { return std::to_string(10000 + below(90000)); }  // five digits
  // n distinct entries of the pool (n <= pool size).
  std::vector<std::string> sample(const std::vector<std::string>& pool, size_t n) {
    std::vector<size_t> idx(pool.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    for (size_t i = 0; i < n; ++i) std::swap(idx[i], idx[i + static_cast<size_t>(below(static_cast<int64_t>(idx.size() - i)))]);
    std::vector<std::string> out;
    for (size_t i = 0; i < n; ++i) out.push_back(pool[idx[i]]);
    return out;
  }

 private:
  uint64_t state_;
};

using Fields = std::map<std::string, std::string>;

// template with every {name} replaced by fields[name].
std::string fill(const std::string& tpl, const Fields& f) {
  std::string out;
  for (size_t i = 0; i < tpl.size();) {
    if (tpl[i] == '{') {
      const size_t close = tpl.find('}', i);
      if (close != std::string::npos) {
        auto it = f.find(tpl.substr(i + 1, close - i - 1));
        if (it != f.end()) {
          out += it->second;
          i = close + 1;
          continue;
        }
      }
    }
    out += tpl[i++];
  }
  return out;
}

// The template's text before the last {field}, filled, without trailing spaces: the prompt's end.
std::string before_answer(const std::string& tpl, const std::string& field, const Fields& f) {
  std::string prefix = fill(tpl.substr(0, tpl.rfind("{" + field + "}")), f);
  while (!prefix.empty() && prefix.back() == ' ') prefix.pop_back();
  return prefix;
}

std::string join_list(const std::vector<std::string>& xs) {
  std::string out;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i > 0) out += i + 1 == xs.size() ? " and " : ", ";
    out += xs[i];
  }
  return out;
}

// As train.py's ends_sentence: the token ends a sentence or a quotation after one.
bool ends_sentence(const Tokenizer& tok, TokenId ctx, TokenId id) {
  const std::string p = tok.decode_token(ctx, id);
  if (p.empty()) return false;
  const char c = p.back();
  return c == '.' || c == '!' || c == '?' || c == '\n' || p == "\"" || (p.size() >= 2 && p.ends_with(".\""));
}

struct Needle {
  std::string text;
  double depth = 0.0;
  bool target = false;
};

struct Spec {
  std::vector<Needle> needles;
  std::string query;                 // the prompt's last text (ends before the answer)
  std::vector<std::string> answers;
  bool ordered = true;
  std::string answer_text;           // the whole expected answer, to size the decode
};

Spec make_spec(TaskKind kind, const TaskSuite& s, double depth, Rng& rng) {
  const auto& T = s.templates;
  Spec sp;
  auto anywhere = [&]() { return rng.unit(); };
  switch (kind) {
    case TaskKind::kPasskey: {
      const Fields f{{"num", rng.number()}};
      sp.needles.push_back({fill(T.at("passkey_needle"), f), depth, true});
      sp.query = before_answer(T.at("passkey_query"), "num", f);
      sp.answers = {" " + f.at("num")};
      sp.answer_text = sp.answers[0] + ".";
      break;
    }
    case TaskKind::kMultiKey: {
      const auto keys = rng.sample(s.keys, std::min<size_t>(6, s.keys.size()));
      for (size_t i = 0; i < keys.size(); ++i) {
        const Fields f{{"key", keys[i]}, {"val", s.values[static_cast<size_t>(rng.below(static_cast<int64_t>(s.values.size())))]}};
        sp.needles.push_back({fill(T.at("word_needle"), f), i == 0 ? depth : anywhere(), i == 0});
        if (i == 0) {
          sp.query = before_answer(T.at("word_query"), "val", f);
          sp.answers = {" " + f.at("val")};
        }
      }
      sp.answer_text = sp.answers[0] + ".";
      break;
    }
    case TaskKind::kMultiValue: {
      const auto keys = rng.sample(s.keys, std::min<size_t>(3, s.keys.size()));
      const auto vals = rng.sample(s.values, std::min<size_t>(4, s.values.size()));
      for (size_t i = 0; i < vals.size(); ++i) {
        sp.needles.push_back({fill(T.at("multivalue_needle"), {{"key", keys[0]}, {"val", vals[i]}}),
                              i == 0 ? depth : anywhere(), i == 0});
      }
      for (size_t k = 1; k < keys.size(); ++k) {
        const std::string v = s.values[static_cast<size_t>(rng.below(static_cast<int64_t>(s.values.size())))];
        sp.needles.push_back({fill(T.at("multivalue_needle"), {{"key", keys[k]}, {"val", v}}), anywhere(), false});
      }
      const Fields f{{"key", keys[0]}, {"vals", join_list(vals)}};
      sp.query = before_answer(T.at("multivalue_query"), "vals", f);
      sp.answers = vals;
      sp.ordered = false;
      sp.answer_text = " " + f.at("vals") + ".";
      break;
    }
    case TaskKind::kKvLookup: {
      const auto keys = rng.sample(s.keys, std::min<size_t>(12, s.keys.size()));
      for (size_t i = 0; i < keys.size(); ++i) {
        const Fields f{{"key", keys[i]}, {"val", s.values[static_cast<size_t>(rng.below(static_cast<int64_t>(s.values.size())))]}};
        sp.needles.push_back({fill(T.at("code_fact"), f), i == 0 ? depth : anywhere(), i == 0});
        if (i == 0) {
          sp.query = before_answer(T.at("code_query"), "val", f);
          sp.answers = {" " + f.at("val")};
        }
      }
      sp.answer_text = sp.answers[0] + ".";
      break;
    }
    case TaskKind::kVarTracking: {
      const std::string num = rng.number();
      const auto vars = rng.sample(s.vars, std::min<size_t>(3, s.vars.size()));
      sp.needles.push_back({fill(T.at("var_first"), {{"var", vars[0]}, {"num", num}}), depth, true});
      for (size_t i = 1; i < vars.size(); ++i) {
        sp.needles.push_back({fill(T.at("var_next"), {{"var", vars[i]}, {"prev", vars[i - 1]}}), anywhere(), false});
      }
      const Fields f{{"num", num}, {"vars", join_list(vars)}};
      sp.query = before_answer(T.at("var_query"), "vars", f);
      sp.answers = vars;
      sp.ordered = false;
      sp.answer_text = " " + f.at("vars") + ".";
      break;
    }
  }
  return sp;
}

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

}  // namespace

std::string_view task_kind_name(TaskKind k) {
  switch (k) {
    case TaskKind::kPasskey: return "passkey";
    case TaskKind::kMultiKey: return "multikey";
    case TaskKind::kMultiValue: return "multivalue";
    case TaskKind::kKvLookup: return "kv";
    case TaskKind::kVarTracking: return "vt";
  }
  return "?";
}

std::vector<TaskKind> all_task_kinds() {
  return {TaskKind::kPasskey, TaskKind::kMultiKey, TaskKind::kMultiValue, TaskKind::kKvLookup, TaskKind::kVarTracking};
}

Result<TaskKind> parse_task_kind(std::string_view name) {
  for (TaskKind k : all_task_kinds()) {
    if (task_kind_name(k) == name) return k;
  }
  return invalid_argument("unknown task \"" + std::string(name) + "\" (passkey, multikey, multivalue, kv, vt)");
}

Result<TaskSuite> parse_task_suite(std::string_view json_text, const std::string& source) {
  const auto j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(source + ": not a JSON object");
  TaskSuite s;
  auto tpl = j.find("templates");
  if (tpl == j.end() || !tpl->is_object()) return invalid_argument(source + ": field \"templates\": expected an object");
  for (const char* name : {"passkey_needle", "passkey_query", "word_needle", "word_query", "multivalue_needle",
                           "multivalue_query", "code_fact", "code_query", "var_first", "var_next", "var_query"}) {
    auto it = tpl->find(name);
    if (it == tpl->end() || !it->is_string()) {
      return invalid_argument(source + ": field \"templates." + name + "\": expected a string");
    }
    s.templates[name] = it->get<std::string>();
  }
  for (auto [field, pool] : {std::pair{"keys", &s.keys}, std::pair{"values", &s.values}, std::pair{"vars", &s.vars}}) {
    auto it = j.find(field);
    if (it == j.end() || !it->is_array() || it->empty()) {
      return invalid_argument(source + ": field \"" + field + "\": expected a non-empty array of words");
    }
    for (const auto& w : *it) {
      if (!w.is_string() || w.get<std::string>().empty()) {
        return invalid_argument(source + ": field \"" + field + "\": expected words");
      }
      pool->push_back(w.get<std::string>());
    }
  }
  if (s.keys.size() < 12 || s.values.size() < 4 || s.vars.size() < 3) {
    return invalid_argument(source + ": the pools need at least 12 keys, 4 values and 3 vars");
  }
  return s;
}

std::string normalize_paragraphs(std::string_view raw) {
  std::string out, para;
  auto flush = [&]() {
    if (para.empty()) return;
    if (!out.empty()) out += "\n\n";
    out += para;
    para.clear();
  };
  size_t pos = 0;
  while (pos <= raw.size()) {
    size_t end = raw.find('\n', pos);
    if (end == std::string_view::npos) end = raw.size();
    std::string_view line = raw.substr(pos, end - pos);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.remove_suffix(1);
    if (line.empty()) {
      flush();
    } else {
      if (!para.empty()) para += ' ';
      para += line;
    }
    pos = end + 1;
  }
  flush();
  return out;
}

Result<std::vector<TaskPrompt>> build_task_prompts(const Tokenizer& tok, const TaskSuite& suite,
                                                   const std::vector<TokenId>& filler, const TaskPromptOptions& o) {
  if (o.trials < 1) return invalid_argument("eval tasks: trials must be at least 1");
  for (double d : o.depths) {
    if (!(d >= 0.0 && d <= 1.0)) return invalid_argument("eval tasks: depths must lie in [0, 1]");
  }
  const bool bos = tok.add_bos_by_default() && tok.bos_id() >= 0;
  const TokenId ctx = filler.empty() ? 0 : filler.front();
  std::vector<TaskPrompt> out;
  for (TaskKind kind : o.kinds) {
    for (int64_t length : o.lengths) {
      for (size_t di = 0; di < o.depths.size(); ++di) {
        for (int64_t trial = 0; trial < o.trials; ++trial) {
          Rng rng(o.seed * 0x2545F4914F6CDD1Dull + static_cast<uint64_t>(kind) * 1000003u +
                  static_cast<uint64_t>(length) * 7919u + di * 104729u + static_cast<uint64_t>(trial) * 15485863u);
          const double depth = o.depths[di];
          Spec sp = make_spec(kind, suite, depth, rng);
          std::stable_sort(sp.needles.begin(), sp.needles.end(),
                           [](const Needle& a, const Needle& b) { return a.depth < b.depth; });
          std::vector<std::vector<TokenId>> needle_ids;
          int64_t needle_tokens = 0;
          for (const Needle& n : sp.needles) {
            SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ids, tok.encode(n.text, false));
            needle_tokens += static_cast<int64_t>(ids.size());
            needle_ids.push_back(std::move(ids));
          }
          SPX_ASSIGN_OR_RETURN(std::vector<TokenId> query, tok.encode(sp.query, false));
          SPX_ASSIGN_OR_RETURN(std::vector<TokenId> answer, tok.encode(sp.answer_text, false));
          TaskPrompt p;
          p.kind = kind;
          p.length = length;
          p.depth = depth;
          p.answers = sp.answers;
          p.ordered = sp.ordered;
          p.answer_tokens = static_cast<int64_t>(answer.size()) + 2;
          p.trial = trial;
          const int64_t n_fill = length - (bos ? 1 : 0) - needle_tokens - static_cast<int64_t>(query.size()) - p.answer_tokens;
          if (n_fill < 16) {
            return invalid_argument("eval tasks: length " + std::to_string(length) + " leaves no room for filler (" +
                                    std::string(task_kind_name(kind)) + ")");
          }
          if (static_cast<int64_t>(filler.size()) < n_fill + 1) {
            return invalid_argument("eval tasks: the filler text has " + std::to_string(filler.size()) +
                                    " tokens, fewer than the " + std::to_string(n_fill) + " length " +
                                    std::to_string(length) + " needs");
          }
          const int64_t start = rng.below(static_cast<int64_t>(filler.size()) - n_fill);
          const std::span<const TokenId> fill(filler.data() + start, static_cast<size_t>(n_fill));
          if (bos) p.prompt.push_back(tok.bos_id());
          int64_t cut = 0;
          for (size_t i = 0; i < sp.needles.size(); ++i) {
            int64_t at = std::max(cut, static_cast<int64_t>(std::llround(sp.needles[i].depth * static_cast<double>(n_fill))));
            while (at > 0 && at < n_fill && !ends_sentence(tok, ctx, fill[static_cast<size_t>(at - 1)])) ++at;
            at = std::min(at, n_fill);
            p.prompt.insert(p.prompt.end(), fill.begin() + cut, fill.begin() + at);
            cut = at;
            if (sp.needles[i].target) p.needle_at = static_cast<int64_t>(p.prompt.size());
            p.prompt.insert(p.prompt.end(), needle_ids[i].begin(), needle_ids[i].end());
          }
          p.prompt.insert(p.prompt.end(), fill.begin() + cut, fill.end());
          p.prompt.insert(p.prompt.end(), query.begin(), query.end());
          out.push_back(std::move(p));
        }
      }
    }
  }
  return out;
}

namespace {

// The whole words of `generated` before its first '.'.
std::set<std::string> words_before_period(std::string_view generated) {
  const std::string_view head = generated.substr(0, generated.find('.'));
  std::set<std::string> words;
  for (size_t i = 0; i < head.size();) {
    if (!is_word_char(head[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < head.size() && is_word_char(head[j])) ++j;
    words.emplace(head.substr(i, j - i));
    i = j;
  }
  return words;
}

bool ordered_answer_correct(const TaskPrompt& p, std::string_view generated) {
  if (p.answers.empty()) return false;
  const std::string& a = p.answers[0];
  return generated.starts_with(a) && (generated.size() == a.size() || !is_word_char(generated[a.size()]));
}

}  // namespace

bool task_answer_correct(const TaskPrompt& p, std::string_view generated) {
  if (p.ordered) return ordered_answer_correct(p, generated);
  return !p.answers.empty() && task_answer_score(p, generated) == 1.0;
}

double task_answer_score(const TaskPrompt& p, std::string_view generated) {
  if (p.answers.empty()) return 0.0;
  if (p.ordered) return ordered_answer_correct(p, generated) ? 1.0 : 0.0;
  const std::set<std::string> words = words_before_period(generated);
  int64_t found = 0;
  for (const std::string& a : p.answers) found += words.contains(a) ? 1 : 0;
  return static_cast<double>(found) / static_cast<double>(p.answers.size());
}

Result<TaskReport> run_task_eval(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                                 const Tokenizer& tok, const std::vector<TaskPrompt>& prompts,
                                 const TaskPromptOptions& po, const TaskEvalOptions& o) {
  const auto t_all = Clock::now();
  if (!model || !backend) return invalid_argument("eval tasks: model and backend are required");
  const ModelConfig& c = model->config;
  for (const TaskPrompt& p : prompts) {
    if (static_cast<int64_t>(p.prompt.size()) + p.answer_tokens > c.max_seq_len) {
      return out_of_range("eval tasks: a length-" + std::to_string(p.length) + " prompt does not fit max_seq_len " +
                          std::to_string(c.max_seq_len));
    }
  }
  TaskReport rep;
  rep.lengths = po.lengths;
  rep.depths = po.depths;
  rep.budgets = o.budgets;
  rep.trials = po.trials;
  rep.sinks = o.sinks;
  rep.window = o.window;
  rep.quest_page_size = o.quest_page_size;
  const double token_bytes = 2.0 * static_cast<double>(c.head_dim) * 4.0;  // K + V of one KV head, f32

  struct Run {
    std::vector<std::vector<TokenId>> answers;
    std::map<int64_t, TaskSpeed> speed;  // by length
  };
  auto run_config = [&](const SparseOptions& sp, int64_t budget) -> Result<Run> {
    SPX_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         eval_internal::make_eval_engine(model, backend, sp, o.page_size, o.head));
    Engine& e = *engine;
    Run run;
    for (const TaskPrompt& p : prompts) {
      TaskSpeed& sp_rec = run.speed[p.length];
      sp_rec.method = sp.method;
      sp_rec.budget = budget;
      sp_rec.length = p.length;
      SPX_ASSIGN_OR_RETURN(SeqId seq, e.memory().add_sequence());
      auto body = [&]() -> Result<std::vector<TokenId>> {
        const auto t0 = Clock::now();
        // Every answer token, the first included, comes from a sparse decode step: the prompt's
        // last token is decoded, not prefilled (a prefilled last token would answer single-token
        // tasks with dense attention for every method).
        const std::span<const TokenId> prompt(p.prompt);
        SPX_RETURN_IF_ERROR(
            eval_internal::prefill(e, seq, prompt.first(prompt.size() - 1), o.prefill_chunk, false).status());
        sp_rec.prefill_seconds += seconds_since(t0);
        e.reset_sparse_stats();
        std::vector<TokenId> out;
        const auto t1 = Clock::now();
        int64_t pos = static_cast<int64_t>(prompt.size()) - 1;
        while (static_cast<int64_t>(out.size()) < p.answer_tokens) {
          const int64_t sparse_before = e.sparse_stats().sparse_steps;
          const int64_t selected_before = e.sparse_stats().tokens_selected;
          const TokenId* next = out.empty() ? &prompt.back() : &out.back();
          StepRequest r{seq, std::span<const TokenId>(next, 1), LogitsMode::kLast};
          SPX_ASSIGN_OR_RETURN(StepOutput so, e.forward(std::span<const StepRequest>(&r, 1)));
          out.push_back(argmax(so.row(0)));
          const SparseStats& st = e.sparse_stats();
          const double attended = st.sparse_steps > sparse_before
                                      ? static_cast<double>(st.tokens_selected - selected_before)
                                      : static_cast<double>((pos + 1) * c.n_layers * c.n_kv_heads);
          sp_rec.attended_bytes_per_token += attended * token_bytes;  // a sum until the end
          ++pos;
          ++sp_rec.decode_tokens;
        }
        sp_rec.decode_seconds += seconds_since(t1);
        sp_rec.bytes_loaded_per_token += static_cast<double>(e.sparse_stats().bytes_loaded);  // a sum too
        return out;
      };
      auto res = body();
      SPX_RETURN_IF_ERROR(e.memory().remove_sequence(seq));
      if (!res.is_ok()) return res.status();
      run.answers.push_back(std::move(*res));
    }
    for (auto& [len, s] : run.speed) {
      if (s.decode_tokens > 0) {
        s.attended_bytes_per_token /= static_cast<double>(s.decode_tokens);
        s.bytes_loaded_per_token /= static_cast<double>(s.decode_tokens);
      }
    }
    return run;
  };

  auto ctx_of = [&](const TaskPrompt& p) { return p.prompt.back(); };
  auto add_records = [&](SparseMethod m, int64_t budget, const Run& run, const Run& ref) {
    std::map<std::tuple<int, int64_t, double>, TaskRecord> cells;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const TaskPrompt& p = prompts[i];
      TaskRecord& r = cells[{static_cast<int>(p.kind), p.length, p.depth}];
      r.method = m;
      r.budget = budget;
      r.kind = p.kind;
      r.length = p.length;
      r.depth = p.depth;
      ++r.trials;
      const std::string text = eval_internal::decode_inline(tok, run.answers[i], ctx_of(p));
      const bool correct = task_answer_correct(p, text);
      r.correct += correct ? 1 : 0;
      r.score += task_answer_score(p, text);
      rep.prompts[i].answers.push_back({m, budget, text, correct});
      r.same_as_dense += run.answers[i] == ref.answers[i] ? 1 : 0;
    }
    int64_t correct = 0;
    for (auto& [k, r] : cells) {
      correct += r.correct;
      rep.records.push_back(r);
    }
    for (const auto& [len, s] : run.speed) rep.speed.push_back(s);
    if (o.on_progress) {
      char line[200];
      std::snprintf(line, sizeof(line), "tasks %-10s budget %5lld  accuracy %.3f (%lld prompts)",
                    std::string(sparse_method_name(m)).c_str(), static_cast<long long>(budget),
                    static_cast<double>(correct) / static_cast<double>(std::max<size_t>(1, prompts.size())),
                    static_cast<long long>(prompts.size()));
      o.on_progress(line);
    }
  };

  SPX_ASSIGN_OR_RETURN(Run ref, run_config(SparseOptions{}, 0));
  for (const TaskPrompt& p : prompts) {
    TaskReport::PromptResult& pr = rep.prompts.emplace_back();
    pr.kind = p.kind;
    pr.length = p.length;
    pr.trial = p.trial;
    pr.needle_at = p.needle_at;
    pr.tokens = static_cast<int64_t>(p.prompt.size());
    pr.depth = p.depth;
    for (const std::string& a : p.answers) pr.want += (pr.want.empty() ? "" : " | ") + a;
  }
  if (std::find(o.methods.begin(), o.methods.end(), SparseMethod::kDense) != o.methods.end()) {
    add_records(SparseMethod::kDense, 0, ref, ref);
  }
  for (const eval_internal::SweepPoint& pt :
       eval_internal::sparse_sweep(o.methods, o.budgets, o.sinks, o.window, o.quest_page_size, o.head != nullptr,
                                   "tasks: specontext skipped: no retrieval head", rep.notes)) {
    auto run = run_config(pt.options, pt.budget);
    if (!run.is_ok()) {
      return run.status().with_context("eval tasks " + std::string(sparse_method_name(pt.method)) + " budget " +
                                       std::to_string(pt.budget));
    }
    add_records(pt.method, pt.budget, *run, ref);
  }
  rep.notes.push_back(
      "tasks: prefill is dense for every method; the answer tokens decode sparsely once the context exceeds the "
      "budget. attended_bytes_per_token: K+V the attention reads per decode token over all layers (f32); "
      "bytes_loaded_per_token: elastic loads into working sets.");
  rep.seconds = seconds_since(t_all);
  return rep;
}

std::string task_prompts_to_jsonl(const std::vector<TaskPrompt>& prompts) {
  std::string out;
  for (const TaskPrompt& p : prompts) {
    out += nlohmann::json{{"task", task_kind_name(p.kind)}, {"length", p.length}, {"depth", p.depth},
                          {"trial", p.trial}, {"needle_at", p.needle_at}, {"answers", p.answers},
                          {"ordered", p.ordered}, {"answer_tokens", p.answer_tokens}, {"tokens", p.prompt}}
               .dump();
    out += '\n';
  }
  return out;
}

nlohmann::json task_report_to_json(const TaskReport& r) {
  using json = nlohmann::json;
  json records = json::array();
  json summary = json::object();
  // (method, budget, task) -> (correct, score sum, trials)
  std::map<std::tuple<std::string, int64_t, std::string>, std::tuple<int64_t, double, int64_t>> pooled;
  for (const TaskRecord& t : r.records) {
    records.push_back({{"method", sparse_method_name(t.method)},
                       {"budget", t.budget},
                       {"task", task_kind_name(t.kind)},
                       {"length", t.length},
                       {"depth", t.depth},
                       {"trials", t.trials},
                       {"correct", t.correct},
                       {"accuracy", static_cast<double>(t.correct) / static_cast<double>(std::max<int64_t>(1, t.trials))},
                       {"ruler_score", t.score / static_cast<double>(std::max<int64_t>(1, t.trials))},
                       {"same_as_dense", t.same_as_dense}});
    auto& [correct, score, trials] =
        pooled[{std::string(sparse_method_name(t.method)), t.budget, std::string(task_kind_name(t.kind))}];
    correct += t.correct;
    score += t.score;
    trials += t.trials;
  }
  json ruler_summary = json::object();
  for (const auto& [k, v] : pooled) {
    const auto& [m, b, kind] = k;
    const auto& [correct, score, trials] = v;
    const double n = static_cast<double>(std::max<int64_t>(1, trials));
    summary[m][std::to_string(b)][kind] = static_cast<double>(correct) / n;
    ruler_summary[m][std::to_string(b)][kind] = score / n;
  }
  json speed = json::array();
  for (const TaskSpeed& s : r.speed) {
    speed.push_back({{"method", sparse_method_name(s.method)},
                     {"budget", s.budget},
                     {"length", s.length},
                     {"decode_tokens", s.decode_tokens},
                     {"decode_tokens_per_s", s.decode_seconds > 0 ? static_cast<double>(s.decode_tokens) / s.decode_seconds : 0.0},
                     {"prefill_seconds", s.prefill_seconds},
                     {"bytes_loaded_per_token", s.bytes_loaded_per_token},
                     {"attended_bytes_per_token", s.attended_bytes_per_token}});
  }
  json prompts = json::array();
  for (const TaskReport::PromptResult& p : r.prompts) {
    json answers = json::array();
    for (const TaskReport::Answer& a : p.answers) {
      answers.push_back({{"method", sparse_method_name(a.method)},
                         {"budget", a.budget},
                         {"text", sanitize_utf8(a.text)},
                         {"correct", a.correct}});
    }
    prompts.push_back({{"task", task_kind_name(p.kind)}, {"length", p.length}, {"depth", p.depth},
                       {"trial", p.trial}, {"needle_at", p.needle_at}, {"tokens", p.tokens},
                       {"want", p.want}, {"answers", std::move(answers)}});
  }
  return {{"lengths", r.lengths}, {"depths", r.depths}, {"budgets", r.budgets}, {"trials", r.trials},
          {"sinks", r.sinks}, {"window", r.window}, {"quest_page_size", r.quest_page_size},
          {"records", records}, {"summary", summary}, {"summary_ruler_score", ruler_summary},
          {"speed", speed}, {"prompts", prompts},
          {"notes", r.notes}, {"seconds", r.seconds}};
}

namespace {

// One table of a per-prompt value (`value(record)` summed, divided by trials) by method x budget,
// with a column per task kind and per length.
std::string format_task_value_table(const TaskReport& r, const std::string& title,
                                    const std::function<double(const TaskRecord&)>& value) {
  // (method, budget) -> kind -> (sum, trials), and -> length -> (sum, trials)
  std::map<std::pair<std::string, int64_t>, std::map<std::string, std::pair<double, int64_t>>> by_kind;
  std::map<std::pair<std::string, int64_t>, std::map<int64_t, std::pair<double, int64_t>>> by_len;
  std::vector<std::pair<std::string, int64_t>> order;
  for (const TaskRecord& t : r.records) {
    const std::pair<std::string, int64_t> key{std::string(sparse_method_name(t.method)), t.budget};
    if (std::find(order.begin(), order.end(), key) == order.end()) order.push_back(key);
    auto& a = by_kind[key][std::string(task_kind_name(t.kind))];
    a.first += value(t);
    a.second += t.trials;
    auto& l = by_len[key][t.length];
    l.first += value(t);
    l.second += t.trials;
  }
  std::string out = title + "\nmethod      budget";
  for (TaskKind k : all_task_kinds()) {
    char h[24];
    std::snprintf(h, sizeof(h), " %10s", std::string(task_kind_name(k)).c_str());
    out += h;
  }
  for (int64_t len : r.lengths) {
    char h[24];
    std::snprintf(h, sizeof(h), " %7lld", static_cast<long long>(len));
    out += h;
  }
  out += "\n";
  for (const auto& key : order) {
    char row[64];
    std::snprintf(row, sizeof(row), "%-10s %7lld", key.first.c_str(), static_cast<long long>(key.second));
    out += row;
    for (TaskKind k : all_task_kinds()) {
      auto it = by_kind[key].find(std::string(task_kind_name(k)));
      char cell[24];
      if (it == by_kind[key].end()) {
        std::snprintf(cell, sizeof(cell), " %10s", "-");
      } else {
        std::snprintf(cell, sizeof(cell), " %10.3f", it->second.first / static_cast<double>(it->second.second));
      }
      out += cell;
    }
    for (int64_t len : r.lengths) {
      auto it = by_len[key].find(len);
      char cell[24];
      std::snprintf(cell, sizeof(cell), " %7.3f",
                    it == by_len[key].end() ? 0.0 : it->second.first / static_cast<double>(it->second.second));
      out += cell;
    }
    out += "\n";
  }
  return out;
}

}  // namespace

std::string format_task_table(const TaskReport& r) {
  std::string out = format_task_value_table(r, "task accuracy (all lengths and depths)", [](const TaskRecord& t) {
    return static_cast<double>(t.correct);
  });
  const bool multi_word = std::any_of(r.records.begin(), r.records.end(), [](const TaskRecord& t) {
    return t.kind == TaskKind::kMultiValue || t.kind == TaskKind::kVarTracking;
  });
  if (multi_word) {
    out += "\n" + format_task_value_table(r, "RULER score (fraction of the answer words found, string_match_all)",
                                          [](const TaskRecord& t) { return t.score; });
  }
  return out;
}

}  // namespace specontext
