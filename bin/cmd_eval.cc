// `specontext eval`: fidelity of the sparse decode methods against dense attention (see
// research/eval.h for the protocol), as a JSON file, a table on stderr and optionally a PNG.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "bin/commands.h"
#include "core/model/model_loader.h"
#include "core/model/safetensors.h"
#include "core/sparse/retrieval_head.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "research/distill.h"
#include "research/eval.h"
#include "research/eval_tasks.h"

namespace specontext::cli {

void register_eval(CLI::App& app, EvalArgs& a) {
  auto* cmd = app.add_subcommand("eval", "fidelity of sparse attention methods vs dense (recall, KL, divergence, needles)");
  add_model_options(*cmd, a.model);
  cmd->add_option("--tokenizer", a.tokenizer, "tokenizer file (default: found next to the model)");
  auto* text = cmd->add_option("--text", a.text, "evaluation text (stories separated by <|endoftext|>)");
  auto* synth = cmd->add_option("--synthetic-text", a.synthetic_text, "use N random tokens from the vocabulary instead")
                    ->check(CLI::PositiveNumber);
  text->excludes(synth);
  cmd->add_option("--context", a.context, "prefix tokens evaluated (default: the model's max context)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--positions", a.positions, "teacher-forced decode positions per method and budget")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--budgets", a.budgets, "comma-separated token budgets (default 16,32,64,128)")->delimiter(',');
  cmd->add_option("--methods", a.methods, "comma-separated methods (default: dense,streaming,quest,oracle,specontext)")
      ->delimiter(',')
      ->check(CLI::IsMember({"dense", "specontext", "streaming", "quest", "oracle"}));
  cmd->add_option("--sinks", a.sinks, "first tokens always attended")->check(CLI::NonNegativeNumber);
  cmd->add_option("--window", a.window, "most recent tokens always attended (top-k methods)")->check(CLI::PositiveNumber);
  cmd->add_option("--quest-page", a.quest_page, "Quest page size (tokens)")->check(CLI::PositiveNumber);
  cmd->add_option("--divergence-tokens", a.divergence_tokens, "greedy tokens compared for the first divergence")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--needles", a.needles, "passkey trials per depth (0 = none)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--head", a.head_path, "retrieval head (default: retrieval_head.safetensors beside the model)");
  cmd->add_option("--head-groups", a.head_groups,
                  "how the head's query heads of a KV group combine: max (the paper's) or turns (each head's best "
                  "ranks in turn); default: the head's metadata select_group, else max")
      ->check(CLI::IsMember({"max", "turns"}));
  cmd->add_option("--seed", a.seed, "seed of the needle digits and of --synthetic-text");
  cmd->add_option("--json", a.json_out, "write the records as JSON to this file ('-' = stdout)");
  cmd->add_flag("--plot", a.plot, "also write a PNG next to the JSON (bench/plot_eval.py, /usr/bin/python3)");
  cmd->add_option("--threads", a.threads, "CPU threads (0 = all cores of the NUMA node)");
  cmd->add_option("--tasks", a.tasks,
                  "long-context task suite (tasks.json; default: the one beside the model): accuracy per method x "
                  "budget x task x length x depth, needles in the --text prose");
  cmd->add_option("--task-lengths", a.task_lengths, "prompt lengths of the task suite (default 1024,2048,4096,8192)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--task-depths", a.task_depths, "needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--task-kinds", a.task_kinds, "tasks (default: passkey,multikey,multivalue,kv,vt)")
      ->delimiter(',')
      ->check(CLI::IsMember({"passkey", "multikey", "multivalue", "kv", "vt"}));
  cmd->add_option("--task-trials", a.task_trials, "prompts per task x length x depth")->check(CLI::PositiveNumber);
  cmd->add_option("--task-prompts-out", a.task_prompts_out,
                  "write every task prompt (kind, depth, trial, needle position, answers, token ids) to this JSONL file");
  cmd->add_flag("--no-fidelity", a.no_fidelity, "run only the task suite (no recall / KL / divergence protocol)");
  cmd->add_flag("--no-tasks", a.no_tasks, "run only the fidelity protocol (not the task suite found beside the model)")
      ->excludes("--no-fidelity")
      ->excludes("--tasks");
}

namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

// The command line as typed (for the JSON record).
std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string out;
  for (char ch : raw) out += ch == '\0' ? ' ' : ch;
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

// bench/<name>: beside the source tree the binary was built from, or under the cwd.
std::string find_plot_script(const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> roots;
  if (!ec) {
    for (fs::path p = exe.parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path()) roots.push_back(p);
  }
  roots.push_back(fs::current_path(ec));
  for (const fs::path& r : roots) {
    const fs::path cand = r / "bench" / name;
    if (fs::exists(cand, ec)) return cand.string();
  }
  return {};
}

// `name` in the model's directory or the one above it (HF copies live in a subdirectory).
std::string find_beside_model(const std::string& model_path, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path mp(model_path);
  const fs::path dir = fs::is_directory(mp) ? mp : mp.parent_path();
  for (const fs::path& cand : {dir / name, dir.parent_path() / name}) {
    if (fs::exists(cand)) return cand.string();
  }
  return {};
}

std::string find_head(const std::string& model_path) {
  return find_beside_model(model_path, "retrieval_head.safetensors");
}

Result<std::string> read_file(const std::string& path, const std::string& what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found(path + ": cannot open " + what);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Status write_file(const std::string& path, const std::string& bytes, const std::string& what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return not_found(path + ": cannot write " + what);
  out << bytes;
  if (!out) return data_loss(path + ": " + what + " write failed");
  std::fprintf(stderr, "wrote %s\n", path.c_str());
  return Status::ok();
}

// A head's metadata names the text it was trained on by FNV-1a (research/distill.h fnv1a64:
// train_text_fnv1a64, written by models/longctx/distill.py and specontext distill; a
// comma-separated list when the head was distilled from several files).

// A head is never scored on the text it was distilled from: refused when its metadata names the
// --text file's bytes as its training text.
Status check_head_not_trained_on(const std::string& head_path, std::string_view text, const std::string& text_path) {
  if (text.empty()) return Status::ok();
  auto f = SafetensorsFile::open(head_path);
  if (!f.is_ok()) return Status::ok();  // a directory checkpoint: no metadata of ours
  const auto& meta = (*f)->metadata();
  auto it = meta.find("train_text_fnv1a64");
  if (it == meta.end()) return Status::ok();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a64(text)));
  // One hash, or several separated by commas (a head distilled from several files).
  const std::string hashes = "," + it->second + ",";
  if (hashes.find(std::string(",") + hex + ",") != std::string::npos) {
    auto name = meta.find("train_text");
    return invalid_argument("eval: --text " + text_path + " is the text the retrieval head " + head_path +
                            " was distilled from (" + (name == meta.end() ? std::string("its metadata") : name->second) +
                            "); evaluate on held-out text");
  }
  return Status::ok();
}

// The task suite: prompts from the tasks.json and the --text prose, run over every method.
Result<TaskReport> run_tasks(const EvalArgs& a, const std::string& tasks_path, const std::string& text,
                             std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend, const Tokenizer& tok,
                             const EvalOptions& eo) {
  SPX_ASSIGN_OR_RETURN(std::string tasks_json, read_file(tasks_path, "--tasks file"));
  SPX_ASSIGN_OR_RETURN(TaskSuite suite, parse_task_suite(tasks_json, tasks_path));
  SPX_ASSIGN_OR_RETURN(std::vector<TokenId> filler, tok.encode(normalize_paragraphs(text), /*add_bos=*/false));
  TaskPromptOptions po;
  if (!a.task_lengths.empty()) {
    po.lengths = a.task_lengths;
  } else {
    po.lengths.clear();
    for (int64_t len : {1024, 2048, 4096, 8192, 16384}) {
      if (len <= model->config.max_seq_len) po.lengths.push_back(len);
    }
  }
  if (!a.task_depths.empty()) po.depths = a.task_depths;
  if (!a.task_kinds.empty()) {
    po.kinds.clear();
    for (const std::string& k : a.task_kinds) {
      SPX_ASSIGN_OR_RETURN(TaskKind kind, parse_task_kind(k));
      po.kinds.push_back(kind);
    }
  }
  po.trials = a.task_trials;
  po.seed = a.seed;
  SPX_ASSIGN_OR_RETURN(std::vector<TaskPrompt> prompts, build_task_prompts(tok, suite, filler, po));
  if (!a.task_prompts_out.empty()) {
    SPX_RETURN_IF_ERROR(write_file(a.task_prompts_out, task_prompts_to_jsonl(prompts), "the --task-prompts-out file"));
  }
  TaskEvalOptions to;
  to.methods = eo.methods;
  to.budgets = eo.budgets;
  to.sinks = eo.sinks;
  to.window = eo.window;
  to.quest_page_size = eo.quest_page_size;
  to.head = eo.head;
  to.on_progress = eo.on_progress;
  std::fprintf(stderr, "tasks: %zu prompts from %s (lengths", prompts.size(), tasks_path.c_str());
  for (int64_t len : po.lengths) std::fprintf(stderr, " %lld", static_cast<long long>(len));
  std::fprintf(stderr, ")\n");
  return run_task_eval(model, backend, tok, prompts, po, to);
}

}  // namespace

int run_eval(const EvalArgs& a) {
  auto model_r = load_model_from_args(a.model);
  if (!model_r.is_ok()) return fail(model_r.status());
  std::shared_ptr<Model> model = *model_r;
  const bool synthetic_model = !a.model.synthetic.empty();
  if (a.text.empty() && a.synthetic_text == 0) {
    return fail(invalid_argument("eval: give --text FILE (e.g. data/tinystories_sample.txt) or --synthetic-text N"));
  }

  // ---- tokens ----
  std::unique_ptr<Tokenizer> tok;
  if (!synthetic_model) {
    auto tok_r = load_tokenizer_for(*model, a.tokenizer);
    if (!tok_r.is_ok()) {
      if (!a.text.empty()) return fail(tok_r.status());
    } else {
      tok = std::move(*tok_r);
    }
  } else if (!a.text.empty()) {
    return fail(invalid_argument("eval: --synthetic models have no tokenizer: use --synthetic-text N"));
  }
  EvalInputs in;
  std::vector<std::string> notes;
  const int64_t max_ctx = model->config.max_seq_len;
  int64_t context = a.context > 0 ? a.context : max_ctx;
  std::string text;
  if (!a.text.empty()) {
    auto text_r = read_file(a.text, "--text file");
    if (!text_r.is_ok()) return fail(text_r.status());
    text = std::move(*text_r);
    auto ids = encode_stories(*tok, text);
    if (!ids.is_ok()) return fail(ids.status().with_context(a.text));
    in.tokens = std::move(*ids);
    if (in.tokens.empty()) return fail(invalid_argument(a.text + ": the text encodes to no tokens"));
    auto filler = encode_filler(*tok, text);
    if (!filler.is_ok()) return fail(filler.status().with_context(a.text));
    in.filler = std::move(*filler);
    if (static_cast<int64_t>(in.tokens.size()) < context) {
      notes.push_back(a.text + " has " + std::to_string(in.tokens.size()) + " tokens; repeated to fill the context of " +
                      std::to_string(context));
      const size_t n = in.tokens.size();
      for (size_t i = n; static_cast<int64_t>(i) < context; ++i) in.tokens.push_back(in.tokens[i % n]);
    }
  } else {
    if (a.context == 0) context = std::min(context, a.synthetic_text);
    if (a.synthetic_text < context) {
      return fail(invalid_argument("eval: --synthetic-text " + std::to_string(a.synthetic_text) +
                                   " is shorter than --context " + std::to_string(context)));
    }
    in.tokens = synthetic_tokens(a.synthetic_text, model->config.vocab_size, a.seed);
    in.filler = in.tokens;
    notes.push_back("--synthetic-text: random tokens; needle filler is random tokens too");
  }
  in.tokenizer = tok.get();

  // ---- options ----
  EvalOptions o;
  o.context = context;
  o.positions = a.positions;
  if (!a.budgets.empty()) o.budgets = a.budgets;
  if (!a.methods.empty()) {
    o.methods.clear();
    for (const std::string& name : a.methods) {
      auto m = parse_sparse_method(name);
      if (!m.is_ok()) return fail(m.status());
      o.methods.push_back(*m);
    }
  }
  o.sinks = a.sinks;
  o.window = a.window;
  o.quest_page_size = a.quest_page;
  o.divergence_tokens = a.divergence_tokens;
  o.needles = a.needles;
  o.seed = a.seed;
  std::string head_path;
  const bool wants_head =
      std::find(o.methods.begin(), o.methods.end(), SparseMethod::kSpeContext) != o.methods.end();
  if (wants_head) {
    if (synthetic_model) {
      auto h = make_random_head(model->config, a.model.weight_seed + 1);
      if (!h.is_ok()) return fail(h.status());
      o.head = *h;
      head_path = "random (synthetic)";
    } else {
      head_path = a.head_path.empty() ? find_head(a.model.model_path) : a.head_path;
      if (!head_path.empty()) {
        auto h = load_eagle3_head(head_path, model->config);
        if (!h.is_ok()) return fail(h.status());
        o.head = *h;
        std::fprintf(stderr, "retrieval head: %s (%s)\n", head_path.c_str(), pruning_report(**h).c_str());
        if (!(*h)->load_note.empty()) std::fprintf(stderr, "warning: %s: %s\n", head_path.c_str(), (*h)->load_note.c_str());
        if (!a.head_groups.empty()) {
          (*h)->config.select_group = a.head_groups == "turns" ? GroupReduce::kTurns : GroupReduce::kMax;
        }
        if (Status st = check_head_not_trained_on(head_path, text, a.text); !st.is_ok()) return fail(st);
      }
    }
  }
  o.on_progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", line.c_str()); };

  cpu::CpuBackendOptions bopts;
  bopts.num_threads = a.threads;
  auto backend = cpu::create_cpu_backend(bopts);
  if (!backend.is_ok()) return fail(backend.status());
  std::fprintf(stderr, "eval: context %lld, positions %lld, budgets", static_cast<long long>(context),
               static_cast<long long>(o.positions));
  for (int64_t b : o.budgets) std::fprintf(stderr, " %lld", static_cast<long long>(b));
  std::fprintf(stderr, "\n");
  std::shared_ptr<Backend> shared_backend(std::move(*backend));
  const std::string tasks_path =
      !a.tasks.empty() ? a.tasks
      : (synthetic_model || a.no_tasks) ? std::string()
                                         : find_beside_model(a.model.model_path, "tasks.json");
  if (a.no_fidelity && tasks_path.empty()) return fail(invalid_argument("eval: --no-fidelity needs a task suite (--tasks)"));
  if (!tasks_path.empty() && (tok == nullptr || text.empty())) {
    return fail(invalid_argument("eval: the task suite needs a tokenizer and --text prose for its filler"));
  }
  nlohmann::json j = nlohmann::json::object();
  if (!a.no_fidelity) {
    auto rep = run_eval(model, shared_backend, in, o);
    if (!rep.is_ok()) return fail(rep.status());
    rep->notes.insert(rep->notes.begin(), notes.begin(), notes.end());
    std::fprintf(stderr, "\n%s", format_eval_table(*rep).c_str());
    for (const std::string& n : rep->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
    std::fprintf(stderr, "eval took %.1f s\n", rep->seconds);
    j = eval_report_to_json(*rep);
  }
  if (!tasks_path.empty()) {
    auto trep = run_tasks(a, tasks_path, text, model, shared_backend, *tok, o);
    if (!trep.is_ok()) return fail(trep.status());
    std::fprintf(stderr, "\n%s", format_task_table(*trep).c_str());
    std::fprintf(stderr, "tasks took %.1f s\n", trep->seconds);
    j["tasks"] = task_report_to_json(*trep);
    j["tasks"]["file"] = tasks_path;
  }
  j["model"] = synthetic_model ? a.model.synthetic : a.model.model_path;
  j["command"] = command_line();
  j["text"] = a.text.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.text);
  j["head"] = head_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(head_path);
  if (o.head) j["head_groups"] = o.head->config.select_group == GroupReduce::kTurns ? "turns" : "max";
  if (a.json_out == "-") {
    std::cout << j.dump(2) << "\n";
  } else if (!a.json_out.empty()) {
    if (Status st = write_file(a.json_out, j.dump(2) + "\n", "the --json file"); !st.is_ok()) return fail(st);
  }
  if (a.plot) {
    if (a.json_out.empty() || a.json_out == "-") return fail(invalid_argument("eval: --plot needs --json FILE"));
    std::vector<std::string> scripts;
    if (j.contains("records")) scripts.push_back("plot_eval.py");
    if (j.contains("tasks")) scripts.push_back("plot_eval_tasks.py");
    for (const std::string& name : scripts) {
      const std::string script = find_plot_script(name);
      if (script.empty()) return fail(not_found("eval --plot: bench/" + name + " not found beside the build or in the cwd"));
      const std::string cmd = "/usr/bin/python3 '" + script + "' '" + a.json_out + "' 1>&2";
      if (std::system(cmd.c_str()) != 0) return fail(unavailable("eval --plot: " + cmd + " failed"));
    }
  }
  return 0;
}

}  // namespace specontext::cli
