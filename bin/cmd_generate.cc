#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bin/commands.h"
#include "core/base/json_depth.h"
#include "core/base/utf8.h"
#include "core/engine/engine.h"
#include "serving/generator.h"
#include "serving/structured/json_schema.h"

namespace specontext::cli {

void register_generate(CLI::App& app, GenerateArgs& a) {
  auto* cmd = app.add_subcommand("generate", "generate text (streams to stdout, summary to stderr)");
  add_engine_options(*cmd, a.engine);
  auto* prompt = cmd->add_option("--prompt,-p", a.prompt, "prompt text");
  auto* file = cmd->add_option("--prompt-file,-f", a.prompt_file, "read the prompt from a file");
  prompt->excludes(file);
  cmd->add_option("--system", a.system_prompt, "system message (with --chat)");
  cmd->add_option("-n,--max-tokens", a.n, "tokens to generate")->check(CLI::PositiveNumber);
  cmd->add_option("--temperature,-t", a.temperature, "0 = greedy");
  cmd->add_option("--top-p", a.top_p, "nucleus sampling threshold (1 = off)");
  cmd->add_option("--top-k", a.top_k, "keep the k most probable tokens (0 = off)");
  cmd->add_option("--repetition-penalty", a.repetition_penalty, "1 = off");
  cmd->add_option("--seed,-s", a.seed, "random seed (0 = time)");
  cmd->add_flag("--chat", a.chat, "wrap the prompt in the model family's chat template");
  cmd->add_flag("--json", a.json, "print the text and the summary as one JSON object on stdout");
  cmd->add_option("--synthetic-context", a.synthetic_context,
                  "fill each sequence's KV cache with N random entries instead of prefill (speed only)");
  cmd->add_option("--batch", a.batch, "sequences decoded together")->check(CLI::PositiveNumber);
  cmd->add_option("--prompt-tokens", a.prompt_tokens, "with --synthetic: random prompt length");
  cmd->add_option("--response-format", a.response_format,
                  "json_object: the text is one JSON object (as the API's response_format); text: free")
      ->check(CLI::IsMember({"text", "json_object"}));
  cmd->add_option("--json-schema", a.json_schema_path,
                  "a JSON Schema file: the text is a document valid against it (as the API's json_schema)")
      ->excludes("--response-format");
}

namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

void draw_progress(int64_t done, int64_t total) {
  constexpr int kWidth = 40;
  const int filled = total > 0 ? static_cast<int>(kWidth * done / total) : kWidth;
  std::string bar(static_cast<size_t>(filled), '=');
  bar.resize(kWidth, ' ');
  std::fprintf(stderr, "\rprefill [%s] %lld/%lld", bar.c_str(), static_cast<long long>(done),
               static_cast<long long>(total));
  if (done >= total) std::fprintf(stderr, "\r%*s\r", kWidth + 40, "");
  std::fflush(stderr);
}

}  // namespace

int run_generate(const GenerateArgs& a) {
  auto loaded_r = load_model_and_tokenizer(a.engine);
  if (!loaded_r.is_ok()) return fail(loaded_r.status());
  LoadedModel loaded = std::move(*loaded_r);
  const std::shared_ptr<Model>& model = loaded.model;
  const Tokenizer* tok = loaded.tokenizer.get();
  const bool synthetic = loaded.synthetic;

  // ---- prompt tokens ----
  std::vector<TokenId> prompt_ids;
  std::vector<TokenId> stop_ids;
  if (synthetic) {
    if (!a.prompt.empty() || !a.prompt_file.empty()) {
      return fail(invalid_argument("--synthetic models have no tokenizer: use --prompt-tokens N"));
    }
    uint64_t s = a.seed ? a.seed : 42;
    for (int64_t i = 0; i < std::max<int64_t>(1, a.prompt_tokens); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      prompt_ids.push_back(static_cast<TokenId>((s >> 33) % static_cast<uint64_t>(model->config.vocab_size)));
    }
  } else {
    std::string text = a.prompt;
    if (!a.prompt_file.empty()) {
      std::ifstream in(a.prompt_file, std::ios::binary);
      if (!in) return fail(not_found(a.prompt_file + ": cannot open prompt file"));
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    bool add_bos = tok->add_bos_by_default();
    if (a.chat) {
      const ChatTemplate t = chat_template_for(*model, *tok);
      if (t == ChatTemplate::kNone) {
        return fail(invalid_argument("--chat: no chat template is known for this model's tokenizer"));
      }
      std::vector<ChatMessage> msgs;
      if (!a.system_prompt.empty()) msgs.push_back({"system", a.system_prompt});
      msgs.push_back({"user", text});
      text = apply_chat_template(t, msgs);
      add_bos = false;  // the templates write their own begin token where the family uses one
    }
    auto ids = tok->encode(text, add_bos, /*parse_special=*/a.chat);
    if (!ids.is_ok()) return fail(ids.status());
    prompt_ids = std::move(*ids);
    if (prompt_ids.empty()) return fail(invalid_argument("the prompt encodes to no tokens"));
    stop_ids = generation_stop_ids(*tok);
  }

  // ---- engine ----
  const int64_t need = a.synthetic_context + static_cast<int64_t>(prompt_ids.size()) + a.n;
  const int64_t max_context =
      a.engine.max_context > 0 ? a.engine.max_context
                               : std::min<int64_t>(model->config.max_seq_len,
                                                   synthetic ? std::max<int64_t>(need, 1) : model->config.max_seq_len);
  auto bundle_r = build_engine(a.engine, loaded, a.batch, max_context,
                               std::vector<int64_t>(static_cast<size_t>(a.batch), std::min(max_context, need)), a.json);
  if (!bundle_r.is_ok()) return fail(bundle_r.status());
  EngineBundle bundle = std::move(*bundle_r);
  Engine* engine = bundle.engine.get();
  const EngineOptions& eopts = bundle.options;
  const std::string& method_name = bundle.method_name;
  const SparseMethod method = bundle.method;
  TierRuntime* tier_rt = bundle.tiers.get();

  std::shared_ptr<const TokenConstraint> constraint;
  if (a.response_format == "json_object") {
    if (!tok) return fail(invalid_argument("--response-format json_object needs the model's tokenizer"));
    auto c = JsonObjectConstraint::create(VocabularyBytes::build(*tok));
    if (!c.is_ok()) return fail(c.status().with_context("--response-format json_object"));
    constraint = std::move(*c);
  }
  if (!a.json_schema_path.empty()) {
    if (!tok) return fail(invalid_argument("--json-schema needs the model's tokenizer"));
    std::ifstream in(a.json_schema_path);
    if (!in) return fail(not_found("--json-schema: cannot open " + a.json_schema_path));
    std::stringstream text;
    text << in.rdbuf();
    // Ordered: properties are generated in the file's order.
    const auto schema = parse_ordered_json_bounded(text.str());
    if (schema.is_discarded())
      return fail(invalid_argument("--json-schema: " + a.json_schema_path +
                                   " is not JSON (or nests deeper than " + std::to_string(kMaxJsonDepth) +
                                   " levels)"));
    auto c = JsonSchemaConstraint::create(schema, VocabularyBytes::build(*tok));
    if (!c.is_ok()) return fail(c.status().with_context("--json-schema " + a.json_schema_path));
    constraint = std::move(*c);
  }
  std::vector<GenerationRequest> reqs(static_cast<size_t>(a.batch));
  for (auto& r : reqs) {
    r.constraint = constraint;
    r.prompt = prompt_ids;
    r.max_new_tokens = a.n;
    r.stop_ids = stop_ids;
    r.synthetic_context = a.synthetic_context;
    r.sampling.temperature = a.temperature;
    r.sampling.top_p = a.top_p;
    r.sampling.top_k = a.top_k;
    r.sampling.repetition_penalty = a.repetition_penalty;
    r.sampling.seed = a.seed;
  }
  if (a.synthetic_context > 0) {
    std::fprintf(stderr, "note: --synthetic-context fills the KV cache with random entries: this measures speed, not quality\n");
  } else if (synthetic) {
    std::fprintf(stderr, "note: --synthetic weights are random: this measures speed, not quality\n");
  }

  auto gopts = scheduling_options(a.engine);
  if (!gopts.is_ok()) return fail(gopts.status());
  Generator gen(*engine, *gopts);
  std::string text;
  TokenId prev = prompt_ids.back();
  const bool stream = tok && !a.json && a.batch == 1;
  // Time to the first token of any request, from the run's start (model loading excluded; a
  // prefix read back from --prefix-store included).
  const auto run_start = std::chrono::steady_clock::now();
  double first_token_s = -1.0;
  auto on_token = [&](size_t request, TokenId id) {
    if (first_token_s < 0) {
      first_token_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    }
    if (!tok || request != 0) return;
    const std::string piece = tok->decode_token(prev, id);
    prev = id;
    text += piece;
    if (stream) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  };
  const bool show_progress = isatty(fileno(stderr)) && prompt_ids.size() >= 256 && !a.json;
  auto on_progress = [&](int64_t done, int64_t total) {
    if (show_progress) draw_progress(done, total);
  };
  auto results = gen.run(reqs, on_token, on_progress);
  if (tier_rt) print_kv_node_events(*tier_rt);  // what the last step saw (text mode)
  if (!results.is_ok()) return fail(results.status());
  int refused = 0;
  for (const GenerationResult& r : *results) {
    if (r.finish != FinishReason::kRefused) continue;
    ++refused;
    std::fprintf(stderr, "error: %s\n", r.error.c_str());
  }
  if (stream) {
    std::fputc('\n', stdout);
    std::fflush(stdout);  // the summary goes to stderr right after
  }
  const GenerationStats& st = gen.stats();
  nlohmann::json summary = {
      {"prompt_tokens", static_cast<int64_t>(prompt_ids.size())},
      {"batch", a.batch},
      {"synthetic_context", a.synthetic_context},
      {"generated_tokens", st.generated_tokens},
      {"prefill_tokens_per_s", st.prefill_tokens_per_s()},
      {"decode_tokens_per_s", st.decode_tokens_per_s()},
      {"decode_steps", st.decode_steps},
      {"max_batch_sequences", st.max_batch_sequences},
      {"preemptions", st.preemptions},
      {"preemption_swaps", st.preemption_swaps},
      {"lost_tiers", st.lost_tiers},
      {"lost_tier_recomputes", st.lost_tier_requeues},
      {"cached_prompt_tokens", st.cached_prompt_tokens},
      {"time_to_first_token_s", first_token_s},
      {"kv_bytes", st.kv_bytes_peak},
      {"kv_bytes_per_token", engine->memory().kv_bytes_per_token()},
      {"kv_dtype", a.engine.kv_dtype},
      {"weight_dtype", std::string(dtype_name(engine->model().weight_dtype))},
      {"weights_held", weights_held_json(engine->model())},
      {"backend", std::string(engine->backend().name())},
      {"model", synthetic ? a.engine.model.synthetic : a.engine.model.model_path},
      {"sparse", method_name},
  };
  const SparseStats& sps = engine->sparse_stats();
  if (method != SparseMethod::kDense) {
    summary["budget"] = eopts.sparse.selection.budget;
    summary["sinks"] = eopts.sparse.selection.sinks;
    summary["window"] = eopts.sparse.selection.window;
    summary["sparse_steps"] = sps.sparse_steps;
    summary["mean_overlap"] = sps.overlap();
    const double per = st.decode_tokens > 0 ? 1.0 / static_cast<double>(st.decode_tokens) : 0.0;
    summary["bytes_loaded_per_token"] = static_cast<double>(sps.bytes_loaded) * per;
    summary["bytes_full_reload_per_token"] = static_cast<double>(sps.bytes_full_reload) * per;
  }
  if (tier_rt || eopts.tiering.device_bytes > 0) summary["tiering"] = tiers_json(*engine, tier_rt);
  if (gopts->prefix_disk_bytes > 0) {
    summary["prefix_disk"] = {
        {"found", st.prefix_disk_found},
        {"writes", st.prefix_disk_writes},
        {"restores", st.prefix_disk_restores},
        {"drops", st.prefix_disk_drops},
        {"errors", st.prefix_disk_errors},
        {"persist", gopts->prefix_disk_persist},
        {"store", gopts->prefix_blob_store ? gopts->prefix_blob_store->name() : "files"}};
  }
  if (gopts->prefix_shared_store) {
    summary["prefix_store"] = {{"store", gopts->prefix_shared_store->name()},
                               {"hits", st.prefix_shared_hits},
                               {"misses", st.prefix_shared_misses},
                               {"writes", st.prefix_shared_writes},
                               {"bytes_read", st.prefix_shared_bytes_read},
                               {"bytes_written", st.prefix_shared_bytes_written},
                               {"errors", st.prefix_shared_errors},
                               {"chunks_written", st.prefix_shared_chunks_written},
                               {"chunks_skipped", st.prefix_shared_chunks_skipped},
                               {"chunks_read", st.prefix_shared_chunks_read},
                               {"chunks_local", st.prefix_shared_chunks_local},
                               {"cached_prompt_tokens", st.cached_prompt_tokens}};
  }
  summary["refused"] = refused;
  if (a.json) {
    // Byte-fallback tokens need not decode to valid UTF-8: U+FFFD, never an abort in dump().
    if (tok) summary["text"] = sanitize_utf8(text);
    std::cout << dump_json(summary) << "\n";
  } else {
    std::fprintf(stderr, "weights held: %s\n", engine->model().weights_held_text().c_str());
    std::fprintf(stderr,
                 "prompt tokens: %lld | prefill: %.1f tok/s | decode: %.1f tok/s (%lld tokens, batch %lld) | KV: %lld bytes\n",
                 static_cast<long long>(prompt_ids.size()), st.prefill_tokens_per_s(), st.decode_tokens_per_s(),
                 static_cast<long long>(st.generated_tokens), static_cast<long long>(a.batch),
                 static_cast<long long>(st.kv_bytes_peak));
    if (method != SparseMethod::kDense) {
      const double per = st.decode_tokens > 0 ? 1.0 / static_cast<double>(st.decode_tokens) : 0.0;
      std::fprintf(stderr,
                   "sparse: %s, budget %lld | %lld sparse steps | overlap %.1f%% | loaded %.0f B/token (full reload %.0f B/token)\n",
                   method_name.c_str(), static_cast<long long>(eopts.sparse.selection.budget),
                   static_cast<long long>(sps.sparse_steps), 100.0 * sps.overlap(),
                   static_cast<double>(sps.bytes_loaded) * per, static_cast<double>(sps.bytes_full_reload) * per);
    } else {
      std::fprintf(stderr, "attention: dense\n");
    }
    if (tier_rt) {
      std::string homes;
      for (const TierReport& r : engine->tier_report()) {
        homes += (homes.empty() ? "" : ", ") + r.desc.name + ": " + std::to_string(r.layers) + " layers, " +
                 std::to_string(r.peak_used_bytes >> 20) + " MiB peak, " + std::to_string(r.total.bytes_out >> 20) +
                 " MiB read";
      }
      const OverlapStats& o = engine->overlap_stats();
      std::fprintf(stderr, "tiers (%s): %s | %zu placement changes%s\n", a.engine.tiers.placement.c_str(),
                   homes.c_str(), engine->placement_events().size(),
                   engine->memory().placement().cpu_filtering ? " | CPU filtering on" : "");
      if (o.steps > 0) {
        std::fprintf(stderr,
                     "overlap: %lld steps moved KV | step %.3f s vs compute %.3f s + copies %.3f s (serial %.3f s) | "
                     "exposed wait %.3f s, %.0f%% of copy time hidden\n",
                     static_cast<long long>(o.steps), o.step_seconds, o.compute_seconds(), o.copy_busy_seconds,
                     o.serial_seconds(), o.wait_seconds, 100.0 * o.hidden_fraction());
      }
    }
  }
  return refused > 0 ? 1 : 0;
}

}  // namespace specontext::cli
