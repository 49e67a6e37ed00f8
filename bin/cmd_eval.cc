// `specontext eval`: fidelity of the sparse decode methods against dense attention (see
// core/eval.h for the protocol), as a JSON file, a table on stderr and optionally a PNG.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "bin/commands.h"
#include "core/eval.h"
#include "core/model_loader.h"
#include "core/retrieval_head.h"
#include "cpu/cpu_backend.h"

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
  cmd->add_option("--seed", a.seed, "seed of the needle digits and of --synthetic-text");
  cmd->add_option("--json", a.json_out, "write the records as JSON to this file ('-' = stdout)");
  cmd->add_flag("--plot", a.plot, "also write a PNG next to the JSON (bench/plot_eval.py, /usr/bin/python3)");
  cmd->add_option("--threads", a.threads, "CPU threads (0 = all cores of the NUMA node)");
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

// bench/plot_eval.py: beside the source tree the binary was built from, or under the cwd.
std::string find_plot_script() {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> roots;
  if (!ec) {
    for (fs::path p = exe.parent_path(); !p.empty() && p != p.root_path(); p = p.parent_path()) roots.push_back(p);
  }
  roots.push_back(fs::current_path(ec));
  for (const fs::path& r : roots) {
    const fs::path cand = r / "bench" / "plot_eval.py";
    if (fs::exists(cand, ec)) return cand.string();
  }
  return {};
}

std::string find_head(const std::string& model_path) {
  namespace fs = std::filesystem;
  const fs::path mp(model_path);
  const fs::path dir = fs::is_directory(mp) ? mp : mp.parent_path();
  for (const fs::path& cand : {dir / "retrieval_head.safetensors", dir.parent_path() / "retrieval_head.safetensors"}) {
    if (fs::exists(cand)) return cand.string();
  }
  return {};
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
  if (!a.text.empty()) {
    std::ifstream f(a.text, std::ios::binary);
    if (!f) return fail(not_found(a.text + ": cannot open --text file"));
    std::stringstream ss;
    ss << f.rdbuf();
    auto ids = encode_stories(*tok, ss.str());
    if (!ids.is_ok()) return fail(ids.status().with_context(a.text));
    in.tokens = std::move(*ids);
    if (in.tokens.empty()) return fail(invalid_argument(a.text + ": the text encodes to no tokens"));
    auto filler = encode_filler(*tok, ss.str());
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
  auto rep = run_eval(model, std::shared_ptr<Backend>(std::move(*backend)), in, o);
  if (!rep.is_ok()) return fail(rep.status());
  rep->notes.insert(rep->notes.begin(), notes.begin(), notes.end());

  std::fprintf(stderr, "\n%s", format_eval_table(*rep).c_str());
  for (const std::string& n : rep->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
  std::fprintf(stderr, "eval took %.1f s\n", rep->seconds);

  nlohmann::json j = eval_report_to_json(*rep);
  j["model"] = synthetic_model ? a.model.synthetic : a.model.model_path;
  j["command"] = command_line();
  j["text"] = a.text.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.text);
  j["head"] = head_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(head_path);
  if (a.json_out == "-") {
    std::cout << j.dump(2) << "\n";
  } else if (!a.json_out.empty()) {
    std::ofstream out(a.json_out);
    if (!out) return fail(not_found(a.json_out + ": cannot write the --json file"));
    out << j.dump(2) << "\n";
    if (!out) return fail(data_loss(a.json_out + ": write failed"));
    std::fprintf(stderr, "wrote %s\n", a.json_out.c_str());
  }
  if (a.plot) {
    if (a.json_out.empty() || a.json_out == "-") return fail(invalid_argument("eval: --plot needs --json FILE"));
    const std::string script = find_plot_script();
    if (script.empty()) return fail(not_found("eval --plot: bench/plot_eval.py not found beside the build or in the cwd"));
    const std::string cmd = "/usr/bin/python3 '" + script + "' '" + a.json_out + "' 1>&2";
    if (std::system(cmd.c_str()) != 0) return fail(unavailable("eval --plot: " + cmd + " failed"));
  }
  return 0;
}

}  // namespace specontext::cli
