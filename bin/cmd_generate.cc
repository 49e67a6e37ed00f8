#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bin/commands.h"
#include "core/engine.h"
#include "core/generator.h"
#include "core/model_loader.h"
#include "core/retrieval_head.h"
#include "cpu/cpu_backend.h"
#if SPECONTEXT_HAVE_CUDA
#include "gpu/cuda_backend.h"
#endif

namespace specontext::cli {

void register_generate(CLI::App& app, GenerateArgs& a) {
  auto* cmd = app.add_subcommand("generate", "generate text (streams to stdout, summary to stderr)");
  add_model_options(*cmd, a.model);
  cmd->add_option("--tokenizer", a.tokenizer, "tokenizer file (default: found next to the model)");
  auto* prompt = cmd->add_option("--prompt,-p", a.prompt, "prompt text");
  auto* file = cmd->add_option("--prompt-file,-f", a.prompt_file, "read the prompt from a file");
  prompt->excludes(file);
  cmd->add_option("--system", a.system_prompt, "system message (with --chat)");
  cmd->add_option("-n,--max-tokens", a.n, "tokens to generate")->check(CLI::NonNegativeNumber);
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
  cmd->add_option("--page-size", a.page_size, "tokens per KV page")->check(CLI::PositiveNumber);
  cmd->add_option("--kv-dtype", a.kv_dtype, "KV cache element type: f32, f16 or bf16 (attention computes in f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd->add_option("--prefill-chunk", a.prefill_chunk, "prompt tokens per forward")->check(CLI::PositiveNumber);
  cmd->add_option("--max-context", a.max_context, "context limit per sequence (default: the model's)");
  cmd->add_option("--threads", a.threads, "CPU threads (0 = all cores of the NUMA node)");
  cmd->add_flag("--reference", a.reference, "use the naive reference kernels (slow; for checking)");
  cmd->add_option("--sparse", a.sparse,
                  "decode attention: specontext (default when a retrieval head is found), dense, "
                  "streaming, quest, oracle")
      ->check(CLI::IsMember({"dense", "specontext", "streaming", "quest", "oracle"}));
  cmd->add_option("--head", a.head_path, "retrieval head (EAGLE-3 layout safetensors)");
  cmd->add_option("--budget,-B", a.budget, "tokens attended per KV head in sparse decode")->check(CLI::NonNegativeNumber);
  cmd->add_option("--sinks", a.sinks, "first tokens always attended")->check(CLI::NonNegativeNumber);
  cmd->add_option("--window", a.window, "most recent tokens always attended")->check(CLI::PositiveNumber);
  cmd->add_option("--backend", a.backend, "cpu, or cuda (falls back to cpu when no CUDA device is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_tier_options(*cmd, a.tiers);
}

namespace {

int fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

ChatTemplate template_for(const Model& m, const Tokenizer& tok) {
  if (m.config.arch == Architecture::kQwen2 || m.config.arch == Architecture::kQwen3 ||
      tok.piece_to_id("<|im_start|>") >= 0) {
    return ChatTemplate::kQwen;
  }
  if (tok.piece_to_id("<|start_header_id|>") >= 0) return ChatTemplate::kLlama3;
  return ChatTemplate::kNone;
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
  auto model_r = load_model_from_args(a.model);
  if (!model_r.is_ok()) return fail(model_r.status());
  std::shared_ptr<Model> model = *model_r;
  const bool synthetic = !a.model.synthetic.empty();

  // ---- prompt tokens ----
  std::unique_ptr<Tokenizer> tok;
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
    auto tok_r = load_tokenizer_for(*model, a.tokenizer);
    if (!tok_r.is_ok()) return fail(tok_r.status());
    tok = std::move(*tok_r);
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
      const ChatTemplate t = template_for(*model, *tok);
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
    stop_ids = tok->stop_ids();
    // llama2.c models separate documents with BOS; a BOS mid-generation ends the text (as run.c).
    if (tok->bos_id() >= 0) stop_ids.push_back(tok->bos_id());
  }

  // ---- sparse decode set-up ----
  std::shared_ptr<const RetrievalHead> head;
  std::string head_note;
  if (synthetic) {
    if (a.sparse.empty() || a.sparse == "specontext") {
      auto h = make_random_head(model->config, a.model.weight_seed + 1);
      if (!h.is_ok()) return fail(h.status());
      head = *h;
    }
  } else if (a.sparse.empty() || a.sparse == "specontext") {
    std::string path = a.head_path;
    if (path.empty()) {
      namespace fs = std::filesystem;
      const fs::path model_path(a.model.model_path);
      const fs::path dir = fs::is_directory(model_path) ? model_path : model_path.parent_path();
      for (const fs::path& cand : {dir / "retrieval_head.safetensors", dir.parent_path() / "retrieval_head.safetensors"}) {
        if (fs::exists(cand)) {
          path = cand.string();
          break;
        }
      }
    }
    if (!path.empty()) {
      auto h = load_eagle3_head(path, model->config);
      if (!h.is_ok()) return fail(h.status());
      head = *h;
      head_note = path;
    } else if (a.sparse == "specontext") {
      return fail(not_found("--sparse specontext: no retrieval head given (--head) and none found beside the model; "
                            "make one with `specontext distill`"));
    }
  }
  const std::string method_name = !a.sparse.empty() ? a.sparse : (head ? "specontext" : "dense");
  auto method = parse_sparse_method(method_name);
  if (!method.is_ok()) return fail(method.status());

  // ---- engine ----
  std::unique_ptr<Backend> backend_ptr;
  if (a.backend == "cuda") {
#if SPECONTEXT_HAVE_CUDA
    auto cuda = gpu::create_cuda_backend(0);
    if (cuda.is_ok()) {
      backend_ptr = std::move(*cuda);
    } else {
      std::fprintf(stderr, "note: %s; falling back to the CPU backend\n", cuda.status().message().c_str());
    }
#else
    std::fprintf(stderr, "note: this build has no CUDA backend; falling back to the CPU backend\n");
#endif
  }
  if (!backend_ptr) {
    cpu::CpuBackendOptions bopts;
    bopts.reference = a.reference;
    bopts.num_threads = a.threads;
    auto backend = cpu::create_cpu_backend(bopts);
    if (!backend.is_ok()) return fail(backend.status());
    backend_ptr = std::move(*backend);
  }
  EngineOptions eopts;
  eopts.max_sequences = a.batch;
  eopts.page_size = a.page_size;
  eopts.kv_dtype = dtype_from_name(a.kv_dtype).value_or(DType::kF32);  // CLI11 checked the name
  const int64_t need = a.synthetic_context + static_cast<int64_t>(prompt_ids.size()) + a.n;
  eopts.max_context = a.max_context > 0 ? a.max_context
                                        : std::min<int64_t>(model->config.max_seq_len,
                                                            synthetic ? std::max<int64_t>(need, 1) : model->config.max_seq_len);
  eopts.sparse.method = *method;
  eopts.sparse.selection.budget =
      a.budget > 0 ? a.budget : std::min<int64_t>(2048, std::max<int64_t>(32, model->config.max_seq_len / 8));
  eopts.sparse.selection.sinks = a.sinks;
  eopts.sparse.selection.window = a.window;
  eopts.retrieval_head = head;
  if (head && !a.json) {
    std::fprintf(stderr, "retrieval head: %s (%s)\n", head_note.empty() ? "random (synthetic)" : head_note.c_str(),
                 pruning_report(*head).c_str());
  }
  auto tiers = setup_tiers(a.tiers, *model, *backend_ptr, eopts);
  if (!tiers.is_ok()) return fail(tiers.status());
  std::unique_ptr<TierRuntime> tier_rt = std::move(*tiers);  // outlives the engine
  auto engine = Engine::create(model, std::shared_ptr<Backend>(std::move(backend_ptr)), eopts);
  if (!engine.is_ok()) return fail(engine.status());
  if (tier_rt) {
    const int64_t final_length = std::min<int64_t>(eopts.max_context, need);
    Status st = start_tiers(*tier_rt, **engine, eopts, std::vector<int64_t>(static_cast<size_t>(a.batch), final_length));
    if (!st.is_ok()) return fail(st);
  }

  std::vector<GenerationRequest> reqs(static_cast<size_t>(a.batch));
  for (auto& r : reqs) {
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

  GeneratorOptions gopts;
  gopts.prefill_chunk = a.prefill_chunk;
  Generator gen(**engine, gopts);
  std::string text;
  TokenId prev = prompt_ids.back();
  const bool stream = tok && !a.json && a.batch == 1;
  auto on_token = [&](size_t request, TokenId id) {
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
      {"kv_bytes", st.kv_bytes_peak},
      {"kv_bytes_per_token", (*engine)->kv_bytes_per_token()},
      {"kv_dtype", a.kv_dtype},
      {"backend", std::string((*engine)->backend().name())},
      {"model", synthetic ? a.model.synthetic : a.model.model_path},
      {"sparse", method_name},
  };
  const SparseStats& sps = (*engine)->sparse_stats();
  if (*method != SparseMethod::kDense) {
    summary["budget"] = eopts.sparse.selection.budget;
    summary["sinks"] = eopts.sparse.selection.sinks;
    summary["window"] = eopts.sparse.selection.window;
    summary["sparse_steps"] = sps.sparse_steps;
    summary["mean_overlap"] = sps.overlap();
    const double per = st.decode_tokens > 0 ? 1.0 / static_cast<double>(st.decode_tokens) : 0.0;
    summary["bytes_loaded_per_token"] = static_cast<double>(sps.bytes_loaded) * per;
    summary["bytes_full_reload_per_token"] = static_cast<double>(sps.bytes_full_reload) * per;
  }
  if (tier_rt || eopts.tiering.device_bytes > 0) summary["tiering"] = tiers_json(**engine, tier_rt.get());
  summary["refused"] = refused;
  if (a.json) {
    if (tok) summary["text"] = text;
    std::cout << summary.dump() << "\n";
  } else {
    std::fprintf(stderr,
                 "prompt tokens: %lld | prefill: %.1f tok/s | decode: %.1f tok/s (%lld tokens, batch %lld) | KV: %lld bytes\n",
                 static_cast<long long>(prompt_ids.size()), st.prefill_tokens_per_s(), st.decode_tokens_per_s(),
                 static_cast<long long>(st.generated_tokens), static_cast<long long>(a.batch),
                 static_cast<long long>(st.kv_bytes_peak));
    if (*method != SparseMethod::kDense) {
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
      for (const TierReport& r : (*engine)->tier_report()) {
        homes += (homes.empty() ? "" : ", ") + r.desc.name + ": " + std::to_string(r.layers) + " layers, " +
                 std::to_string(r.peak_used_bytes >> 20) + " MiB peak, " + std::to_string(r.total.bytes_out >> 20) +
                 " MiB read";
      }
      const OverlapStats& o = (*engine)->overlap_stats();
      std::fprintf(stderr, "tiers (%s): %s | %zu placement changes%s\n", a.tiers.placement.c_str(), homes.c_str(),
                   (*engine)->placement_events().size(), (*engine)->placement().cpu_filtering ? " | CPU filtering on" : "");
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
