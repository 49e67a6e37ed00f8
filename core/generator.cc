#include "core/generator.h"

#include <algorithm>
#include <chrono>

namespace specontext {

namespace {

struct Active {
  size_t index = 0;
  SeqId seq;
  DistinctTokens history;  // of prompt + generated, for the repetition penalty (kept only when on)
  int64_t prefilled = 0;         // prompt tokens already in the cache
  TokenId next = -1;             // token to feed in the next decode step
  bool done = false;
  Sampler sampler{SamplingParams{}};
  TokenDraw draw;  // this step's sampling decision, made by the engine where the logits are
};

}  // namespace

Result<std::vector<GenerationResult>> Generator::run(const std::vector<GenerationRequest>& requests,
                                                     const TokenCallback& on_token,
                                                     const ProgressCallback& on_progress) {
  stats_ = GenerationStats{};
  std::vector<GenerationResult> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    if (r.prompt.empty()) return invalid_argument("request " + std::to_string(i) + ": empty prompt");
    SPX_RETURN_IF_ERROR_CTX(r.sampling.validate(), "request " + std::to_string(i));
    const int64_t need = r.synthetic_context + static_cast<int64_t>(r.prompt.size());
    if (need > engine_.max_context()) {
      return out_of_range("request " + std::to_string(i) + ": prompt of " + std::to_string(need) +
                          " tokens is longer than the context limit of " +
                          std::to_string(engine_.max_context()) + " tokens");
    }
  }

  std::vector<Active> active(requests.size());
  auto release_all = [&] {
    for (auto& a : active) {
      if (a.seq.valid()) (void)engine_.remove_sequence(a.seq);
    }
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    active[i].index = i;
    if (requests[i].sampling.repetition_penalty != 1.0f) active[i].history.add(requests[i].prompt);
    active[i].sampler = Sampler(requests[i].sampling);
  }
  // Requests wait until a sequence slot is free (continuous batching): admitted in order.
  size_t next_admit = 0;
  auto admit = [&]() -> Status {
    while (next_admit < requests.size()) {
      const GenerationRequest& r = requests[next_admit];
      const int64_t final_length =
          std::min(engine_.max_context(), r.synthetic_context + static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
      if (Status fits = engine_.admit(final_length, /*alone=*/false); !fits.is_ok()) {
        if (fits.code() != StatusCode::kResourceExhausted) return fits;
        // Wait for running sequences to finish if it fits alone; refuse it if it never can.
        if (engine_.live_sequences() > 0 && engine_.admit(final_length, /*alone=*/true).is_ok()) break;
        results[next_admit].finish = FinishReason::kRefused;
        results[next_admit].error = "request " + std::to_string(next_admit) + " refused: " + fits.message();
        active[next_admit].done = true;
        ++next_admit;
        continue;
      }
      auto seq = engine_.add_sequence();
      if (!seq.is_ok()) {
        if (seq.status().code() == StatusCode::kResourceExhausted && engine_.live_sequences() > 0) break;
        return seq.status();
      }
      Active& a = active[next_admit];
      a.seq = *seq;
      if (requests[next_admit].synthetic_context > 0) {
        SPX_RETURN_IF_ERROR(engine_.fill_synthetic(*seq, requests[next_admit].synthetic_context,
                                                   requests[next_admit].sampling.seed + next_admit + 1));
      }
      ++next_admit;
    }
    return Status::ok();
  };
  int64_t total_prompt = 0;
  for (const auto& r : requests) total_prompt += static_cast<int64_t>(r.prompt.size());

  using Clock = std::chrono::steady_clock;
  std::vector<StepRequest> batch;
  std::vector<Active*> in_batch;
  std::vector<bool> is_prefill;
  std::vector<TokenId> decode_tokens(requests.size());
  int64_t prefilled_total = 0;
  while (true) {
    if (Status st = admit(); !st.is_ok()) {
      release_all();
      return st;
    }
    batch.clear();
    in_batch.clear();
    is_prefill.clear();
    int64_t budget = options_.max_batch_tokens;
    int64_t prefill_tokens = 0, decode_count = 0;
    // Decode tokens first (latency), then prompt chunks fill the rest of the budget.
    for (auto& a : active) {
      if (!a.seq.valid() || a.done || a.prefilled < static_cast<int64_t>(requests[a.index].prompt.size())) continue;
      if (budget <= 0) break;
      decode_tokens[a.index] = a.next;
      a.draw = a.sampler.next_draw(a.history);
      batch.push_back({a.seq, std::span<const TokenId>(&decode_tokens[a.index], 1), LogitsMode::kSample, &a.draw});
      in_batch.push_back(&a);
      is_prefill.push_back(false);
      --budget;
      ++decode_count;
    }
    for (auto& a : active) {
      const auto& prompt = requests[a.index].prompt;
      const int64_t left = static_cast<int64_t>(prompt.size()) - a.prefilled;
      if (!a.seq.valid() || a.done || left <= 0 || budget <= 0) continue;
      const int64_t n = std::min({left, options_.prefill_chunk, budget});
      const bool last_chunk = n == left;
      if (last_chunk) a.draw = a.sampler.next_draw(a.history);
      batch.push_back({a.seq, std::span<const TokenId>(prompt.data() + a.prefilled, static_cast<size_t>(n)),
                       last_chunk ? LogitsMode::kSample : LogitsMode::kNone, last_chunk ? &a.draw : nullptr});
      in_batch.push_back(&a);
      is_prefill.push_back(true);
      budget -= n;
      prefill_tokens += n;
    }
    if (batch.empty()) {
      if (next_admit < requests.size()) {
        if (engine_.live_sequences() == 0) continue;  // the next ones were refused above; admit again
        return internal_error("generator: requests left but none admitted");
      }
      break;
    }

    const auto t0 = Clock::now();
    auto out = engine_.forward(batch);
    if (!out.is_ok()) {
      release_all();
      return out.status();
    }
    // Sampling belongs to the step's time too.
    for (size_t b = 0; b < batch.size(); ++b) {
      Active& a = *in_batch[b];
      if (is_prefill[b]) {
        a.prefilled += static_cast<int64_t>(batch[b].tokens.size());
        prefilled_total += static_cast<int64_t>(batch[b].tokens.size());
      }
      if (batch[b].logits != LogitsMode::kSample) continue;
      const GenerationRequest& r = requests[a.index];
      const TokenId tok = out->tokens[b];
      GenerationResult& res = results[a.index];
      const bool stop = std::find(r.stop_ids.begin(), r.stop_ids.end(), tok) != r.stop_ids.end();
      if (stop) {
        res.finish = FinishReason::kStop;
        a.done = true;
        continue;
      }
      res.tokens.push_back(tok);
      if (r.sampling.repetition_penalty != 1.0f) a.history.add(tok);
      a.next = tok;
      ++stats_.generated_tokens;
      if (!is_prefill[b]) ++stats_.decode_tokens;
      if (on_token) on_token(a.index, tok);
      if (static_cast<int64_t>(res.tokens.size()) >= r.max_new_tokens) {
        res.finish = FinishReason::kLength;
        a.done = true;
      } else if (engine_.sequence_length(a.seq) + 1 > engine_.max_context()) {
        res.finish = FinishReason::kContext;
        a.done = true;
      }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    // A mixed step is split between prefill and decode by token count.
    const double total_tokens = static_cast<double>(prefill_tokens + decode_count);
    stats_.prefill_seconds += seconds * static_cast<double>(prefill_tokens) / total_tokens;
    stats_.decode_seconds += seconds * static_cast<double>(decode_count) / total_tokens;
    if (decode_count > 0) ++stats_.decode_steps;
    stats_.kv_bytes_peak = std::max(stats_.kv_bytes_peak, engine_.kv_bytes_in_use());
    if (on_progress && prefill_tokens > 0) on_progress(prefilled_total, total_prompt);
    for (auto& a : active) {
      if (a.done && a.seq.valid()) {
        (void)engine_.remove_sequence(a.seq);
        a.seq = SeqId();
      }
    }
  }
  stats_.prompt_tokens = total_prompt;
  release_all();
  return results;
}

}  // namespace specontext
