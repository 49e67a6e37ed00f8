// specontext distill: fits a retrieval head (EAGLE-3 layout) to a target model's own attention
// on a text corpus and reports held-out fidelity before and after (logic in core/distill).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bin/commands.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "research/distill.h"

namespace specontext::cli {

void register_distill(CLI::App& app, DistillArgs& a) {
  auto* cmd = app.add_subcommand(
      "distill", "fit a retrieval head to a model's attention on a corpus (writes safetensors)");
  cmd->add_option("--model,-m", a.model_path, "target model: llama2.c .bin, .gguf or HF directory")
      ->required();
  cmd->add_option("--tokenizer", a.tokenizer, "tokenizer file (default: found next to the model)");
  cmd->add_option("--corpus", a.corpus,
                  "training text; stories separated by <|endoftext|> (repeat the option for several files)")
      ->required()
      ->take_all();
  cmd->add_option("--heldout", a.heldout,
                  "held-out text (default: from each corpus, its last whole stories holding >= 20% of its tokens, "
                  "or the last 20% of its tokens when it is one text)");
  cmd->add_option("--corpus-tokens", a.corpus_tokens, "use only the first N tokens of each corpus (0 = all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--out,-o", a.out, "where to write the head (.safetensors)")->required();
  cmd->add_option("--steps", a.steps, "Adam steps")->check(CLI::NonNegativeNumber);
  cmd->add_option("--lr", a.lr, "peak learning rate (cosine decay to lr/10)")->check(CLI::PositiveNumber);
  cmd->add_option("--context", a.context, "tokens per training chunk (default: the model's max_seq_len)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--batch", a.batch, "query positions per step")->check(CLI::PositiveNumber);
  cmd->add_option("--seed", a.seed, "seed of the initial head and of the minibatches");
  cmd->add_option("--train", a.train, "parameter groups to train, comma-separated subset of fc,norms,qk")
      ->capture_default_str();
  cmd->add_option("--teacher", a.teacher,
                  "teacher per KV head, per layer: max (as selection reduces the group) or mean of the group's "
                  "query-head attention")
      ->check(CLI::IsMember({"max", "mean"}))
      ->capture_default_str();
  cmd->add_option("--exclude-sinks", a.exclude_sinks,
                  "leave the first N keys out of the loss (selection's --sinks keeps them anyway)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--exclude-window", a.exclude_window,
                  "leave the last N keys out of the loss (selection's --window keeps them anyway)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--position-weight", a.position_weight,
                  "weight of each query position in the loss: uniform, or far (the teacher mass on the keys the "
                  "loss ranks, plus --weight-floor: positions that look far back count, local ones barely)")
      ->check(CLI::IsMember({"uniform", "far"}))
      ->capture_default_str();
  cmd->add_option("--weight-floor", a.weight_floor,
                  "added to every position's weight with --position-weight far")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--group-loss", a.group_loss,
                  "what each KV head's teacher is fitted with: each query head alone, max (the group's max "
                  "over its query heads, renormalised: the scores selection ranks by), or mix (both, weighted by "
                  "--group-mix)")
      ->check(CLI::IsMember({"each", "max", "mix"}))
      ->capture_default_str();
  cmd->add_option("--group-mix", a.group_mix, "with --group-loss mix: the max term's weight (each has 1 - this)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--q-per-group", a.q_per_group,
                  "the head's query heads per KV head (0 = the target's; more let --group-loss max split the "
                  "teacher's layers among them)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--threads", a.threads, "CPU threads of the target forward (0 = all of the NUMA node)");
  cmd->add_flag("--json", a.json, "print the report as one JSON object on stdout");
}

namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

Result<std::string> read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(path + ": cannot open " + what);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string basename(const std::string& path) { return std::filesystem::path(path).filename().string(); }

// One corpus file, split, with what the head's metadata records about it.
struct LoadedCorpus {
  std::string path;
  CorpusSplit split;
  uint64_t fnv = 0;  // of the file's bytes
  size_t bytes = 0;
  int64_t tokens = 0;  // after --corpus-tokens
  bool truncated = false;  // --corpus-tokens cut the file short
};

// The first `limit` tokens of a corpus (whole stories plus the start of the one it cuts); true
// when that drops any.
bool keep_first_tokens(std::vector<CorpusStory>* stories, int64_t limit) {
  if (limit <= 0) return false;
  int64_t kept = 0;
  for (size_t i = 0; i < stories->size(); ++i) {
    std::vector<TokenId>& t = (*stories)[i].tokens;
    if (kept + static_cast<int64_t>(t.size()) >= limit) {
      const bool dropped = kept + static_cast<int64_t>(t.size()) > limit || i + 1 < stories->size();
      t.resize(static_cast<size_t>(limit - kept));
      stories->resize(i + 1);
      return dropped;
    }
    kept += static_cast<int64_t>(t.size());
  }
  return false;
}

Result<LoadedCorpus> load_corpus(const Tokenizer& tok, const std::string& path, const DistillArgs& a) {
  LoadedCorpus out;
  out.path = path;
  SPX_ASSIGN_OR_RETURN(std::string text, read_text(path, "--corpus"));
  out.fnv = fnv1a64(text);
  out.bytes = text.size();
  auto stories = encode_corpus_stories(tok, text);
  if (!stories.is_ok()) return stories.status().with_context(path);
  out.truncated = keep_first_tokens(&*stories, a.corpus_tokens);
  for (const CorpusStory& st : *stories) out.tokens += static_cast<int64_t>(st.tokens.size());
  if (a.heldout.empty()) {
    out.split = split_heldout_stories(*stories, 0.2);
  } else {
    for (const CorpusStory& st : *stories) out.split.train.insert(out.split.train.end(), st.tokens.begin(), st.tokens.end());
    out.split.stories = out.split.train_stories = static_cast<int64_t>(stories->size());
  }
  return out;
}

std::string fnv_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// How one corpus was split, for the head's train_split.
std::string describe_split(const LoadedCorpus& c, const DistillArgs& a) {
  const CorpusSplit& sp = c.split;
  const std::string n_train = std::to_string(sp.train.size()), total = std::to_string(c.tokens);
  const std::string name = basename(c.path) + ": ";
  const std::string first = c.truncated ? "its first " + total + " tokens; " : std::string();
  if (!a.heldout.empty()) return name + first + "all " + total + " tokens trained on";
  if (sp.heldout_byte != std::string_view::npos && !c.truncated) {
    return name + first + "stories [0, " + std::to_string(sp.train_stories) + ") of " + std::to_string(sp.stories) +
           " = bytes [0, " + std::to_string(sp.heldout_byte) + ") = tokens [0, " + n_train + ") of " + total +
           " trained on; held out: bytes [" + std::to_string(sp.heldout_byte) + ", " + std::to_string(c.bytes) +
           ") = tokens [" + n_train + ", " + total + ")";
  }
  return name + first + "tokens [0, " + n_train + ") of " + total + " trained on; held out: tokens [" + n_train +
         ", " + total + ")";
}

// The loss, for the head's distill_objective ("KL over keys [1, t+1-4)" with uniform weights, as
// before position weighting existed).
std::string objective_description(const DistillArgs& a) {
  std::string out =
      "KL over keys [" + std::to_string(a.exclude_sinks) + ", t+1-" + std::to_string(a.exclude_window) + ")";
  if (a.position_weight == "far") {
    std::ostringstream floor;
    floor << a.weight_floor;
    out += ", each position weighted by the teacher mass on those keys + " + floor.str();
  }
  if (a.group_loss == "max") out += ", against the GQA group's max over the head's query heads";
  if (a.group_loss == "mix") {
    std::ostringstream mix;
    mix << a.group_mix;
    out += ", " + mix.str() + " of it against the GQA group's max over the head's query heads";
  }
  return out;
}

// What the head records about its training text: `specontext eval` refuses a --text whose
// bytes hash to one of train_text_fnv1a64's, and train_split names the parts held out.
std::map<std::string, std::string> split_metadata(const DistillArgs& a, std::span<const LoadedCorpus> corpora) {
  std::string names, hashes, split;
  for (const LoadedCorpus& c : corpora) {
    names += (names.empty() ? "" : ",") + basename(c.path);
    hashes += (hashes.empty() ? "" : ",") + fnv_hex(c.fnv);
    split += (split.empty() ? "" : "; ") + describe_split(c, a);
  }
  if (!a.heldout.empty()) split += "; held out: " + basename(a.heldout);
  return {{"train_text", names},
          {"train_text_fnv1a64", hashes},
          {"train_split", split},
          {"distill_train", a.train},
          {"distill_teacher", "per KV head: layer mean of the GQA group's " + a.teacher + " attention, renormalised"},
          {"distill_objective", objective_description(a)}};
}

// Training and held-out chunks: each corpus is chunked on its own, every chunk led by BOS.
struct Chunks {
  std::vector<std::vector<TokenId>> train, heldout;
};

Result<Chunks> make_chunks(const Tokenizer& tok, std::span<const LoadedCorpus> corpora, const DistillArgs& a,
                           int64_t context, int64_t min_chunk) {
  Chunks out;
  auto append = [&](std::vector<std::vector<TokenId>>* dst, const std::vector<TokenId>& ids) {
    for (auto& ch : split_chunks(ids, context, min_chunk, tok.bos_id())) dst->push_back(std::move(ch));
  };
  for (const LoadedCorpus& c : corpora) {
    append(&out.train, c.split.train);
    append(&out.heldout, c.split.heldout);
  }
  if (!a.heldout.empty()) {
    SPX_ASSIGN_OR_RETURN(std::string held_text, read_text(a.heldout, "--heldout"));
    auto held = encode_corpus(tok, held_text);
    if (!held.is_ok()) return held.status().with_context(a.heldout);
    append(&out.heldout, *held);
  }
  if (out.train.empty()) return invalid_argument("distill: too little --corpus text to train on");
  if (out.heldout.empty()) {
    return invalid_argument("distill: no held-out chunk of at least " + std::to_string(min_chunk) + " tokens");
  }
  return out;
}

nlohmann::json fidelity_json(const Fidelity& f) {
  nlohmann::json recall = nlohmann::json::array();
  for (const BudgetRecall& r : f.recall) {
    recall.push_back({{"budget", r.budget},
                      {"positions", r.positions},
                      {"head", r.head},
                      {"streaming", r.streaming},
                      {"oracle", r.oracle}});
  }
  return {{"positions", f.positions}, {"kl", f.kl}, {"kl_group", f.kl_group}, {"recall", recall}};
}

}  // namespace

int run_distill(const DistillArgs& a) {
  {  // fail before the training, not after it
    const std::filesystem::path parent = std::filesystem::path(a.out).parent_path();
    std::error_code ec;
    if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
      return fail(not_found(a.out + ": --out directory " + parent.string() + " does not exist"));
    }
  }
  auto model_r = load_model(a.model_path);
  if (!model_r.is_ok()) return fail(model_r.status());
  std::shared_ptr<Model> model = *model_r;
  auto tok_r = load_tokenizer_for(*model, a.tokenizer);
  if (!tok_r.is_ok()) return fail(tok_r.status());
  const Tokenizer& tok = **tok_r;

  auto train_groups = parse_distill_train(a.train);
  if (!train_groups.is_ok()) return fail(train_groups.status());
  auto teacher = parse_teacher_reduction(a.teacher);
  if (!teacher.is_ok()) return fail(teacher.status());
  auto position_weight = parse_position_weight(a.position_weight);
  if (!position_weight.is_ok()) return fail(position_weight.status());
  auto group_loss = parse_group_loss(a.group_loss);
  if (!group_loss.is_ok()) return fail(group_loss.status());
  std::vector<LoadedCorpus> corpora;
  for (const std::string& path : a.corpus) {
    auto c = load_corpus(tok, path, a);
    if (!c.is_ok()) return fail(c.status());
    corpora.push_back(std::move(*c));
  }

  const int64_t context = a.context > 0 ? a.context : model->config.max_seq_len;
  if (context > model->config.max_seq_len) {
    return fail(invalid_argument("--context " + std::to_string(context) +
                                 " exceeds the model's max_seq_len " +
                                 std::to_string(model->config.max_seq_len)));
  }
  DistillOptions opts;
  opts.steps = a.steps;
  opts.lr = a.lr;
  opts.context = context;
  opts.batch_positions = a.batch;
  opts.seed = a.seed;
  opts.train = *train_groups;
  opts.teacher = *teacher;
  opts.objective =
      DistillObjective{a.exclude_sinks, a.exclude_window, *position_weight, a.weight_floor, *group_loss, a.group_mix};
  opts.q_per_group = a.q_per_group;
  opts.on_step = [&](int64_t step, double kl) {
    if (!a.json)
      std::fprintf(stderr, "step %lld/%lld  train KL %.4f\n", static_cast<long long>(step),
                   static_cast<long long>(a.steps), kl);
  };
  auto chunks = make_chunks(tok, corpora, a, context, opts.min_chunk);
  if (!chunks.is_ok()) return fail(chunks.status());

  cpu::CpuBackendOptions bopts;
  bopts.num_threads = a.threads;
  auto backend = cpu::create_cpu_backend(bopts);
  if (!backend.is_ok()) return fail(backend.status());
  auto rep_r = distill_retrieval_head(model, std::shared_ptr<Backend>(std::move(*backend)), chunks->train,
                                      chunks->heldout, opts);
  if (!rep_r.is_ok()) return fail(rep_r.status());
  const DistillReport& rep = *rep_r;
  const std::map<std::string, std::string> meta = split_metadata(a, corpora);
  Status w = write_distilled_head(a.out, *rep.head, meta);
  if (!w.is_ok()) return fail(w);

  const RetrievalHeadConfig& hc = rep.head->config;
  if (a.json) {
    nlohmann::json j = {
        {"model", a.model_path},
        {"out", a.out},
        {"head",
         {{"hidden", hc.hidden},
          {"n_heads", hc.n_heads},
          {"n_kv_heads", hc.n_kv_heads},
          {"head_dim", hc.head_dim},
          {"trained_context", hc.trained_context},
          {"fused_layers", hc.fused_layers},
          {"kept_parameters", rep.head->kept_parameters},
          {"draft_parameters", rep.head->draft_parameters}}},
        {"pruning", pruning_report(*rep.head)},
        {"steps", a.steps},
        {"lr", a.lr},
        {"batch", a.batch},
        {"seed", a.seed},
        {"train", a.train},
        {"teacher", a.teacher},
        {"exclude_sinks", a.exclude_sinks},
        {"exclude_window", a.exclude_window},
        {"position_weight", a.position_weight},
        {"weight_floor", a.weight_floor},
        {"group_loss", a.group_loss},
        {"group_mix", a.group_mix},
        {"q_per_group", a.q_per_group},
        {"train_split", meta.at("train_split")},
        {"context", rep.context},
        {"train_tokens", rep.train_tokens},
        {"train_chunks", rep.train_chunks},
        {"heldout_tokens", rep.heldout_tokens},
        {"heldout_chunks", rep.heldout_chunks},
        {"train_kl_before", rep.train_kl_before},
        {"train_kl_after", rep.train_kl_after},
        {"heldout_before", fidelity_json(rep.before)},
        {"heldout_after", fidelity_json(rep.after)},
        {"teacher_seconds", rep.teacher_seconds},
        {"train_seconds", rep.train_seconds},
    };
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "target %s: d %lld, %lld layers, %lld query / %lld KV heads; head fuses layers %lld, %lld, %lld\n",
      a.model_path.c_str(), static_cast<long long>(hc.hidden), static_cast<long long>(model->config.n_layers),
      static_cast<long long>(hc.n_heads), static_cast<long long>(hc.n_kv_heads),
      static_cast<long long>(hc.fused_layers[0]), static_cast<long long>(hc.fused_layers[1]),
      static_cast<long long>(hc.fused_layers[2]));
  std::printf(
      "corpus: %lld training tokens in %lld chunks, %lld held-out tokens in %lld chunks (context %lld)\n",
      static_cast<long long>(rep.train_tokens), static_cast<long long>(rep.train_chunks),
      static_cast<long long>(rep.heldout_tokens), static_cast<long long>(rep.heldout_chunks),
      static_cast<long long>(rep.context));
  std::printf("split: %s\n", meta.at("train_split").c_str());
  std::printf("teacher %.2f s, training %lld steps of %s %.2f s\n", rep.teacher_seconds,
              static_cast<long long>(a.steps), a.train.c_str(), rep.train_seconds);
  std::printf("train    KL(target || head): %.4f -> %.4f nats\n", rep.train_kl_before, rep.train_kl_after);
  std::printf("held-out KL(target || head): %.4f -> %.4f nats (%lld positions)\n", rep.before.kl,
              rep.after.kl, static_cast<long long>(rep.after.positions));
  std::printf("held-out KL(target || group max of the head): %.4f -> %.4f nats\n", rep.before.kl_group,
              rep.after.kl_group);
  std::printf("held-out target attention mass on the top-B tokens per KV head:\n");
  std::printf("  %6s  %9s  %8s  %8s  %9s  %8s\n", "B", "positions", "before", "after", "streaming", "oracle");
  for (size_t i = 0; i < rep.after.recall.size(); ++i) {
    const BudgetRecall& b = rep.before.recall[i];
    const BudgetRecall& r = rep.after.recall[i];
    std::printf("  %6lld  %9lld  %8.3f  %8.3f  %9.3f  %8.3f\n", static_cast<long long>(r.budget),
                static_cast<long long>(r.positions), b.head, r.head, r.streaming, r.oracle);
  }
  std::printf("%s\n", pruning_report(*rep.head).c_str());
  std::printf("wrote %s\n", a.out.c_str());
  return 0;
}

}  // namespace specontext::cli
