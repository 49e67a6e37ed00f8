// Generation loop over the Engine: continuous batching of many requests, chunked prefill,
// sampling, stop conditions and timing. The serving layer will drive the same scheduler.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/sampler.h"

namespace specontext {

struct GenerationRequest {
  std::vector<TokenId> prompt;        // must be non-empty
  SamplingParams sampling;
  int64_t max_new_tokens = 256;
  std::vector<TokenId> stop_ids;      // generation ends after emitting none of these
  int64_t synthetic_context = 0;      // >0: KV prefilled with random entries (speed runs only)
};

// kRefused: the request can never fit the engine's memory (any tier), even alone; nothing ran.
enum class FinishReason { kLength, kStop, kContext, kRefused };

struct GenerationResult {
  std::vector<TokenId> tokens;  // generated tokens (stop token excluded)
  FinishReason finish = FinishReason::kLength;
  std::string error;            // why a kRefused request was refused
};

struct GenerationStats {
  int64_t prompt_tokens = 0;     // tokens run through prefill
  int64_t generated_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  int64_t decode_tokens = 0;     // tokens produced by decode steps (first token comes from prefill)
  int64_t decode_steps = 0;
  int64_t kv_bytes_peak = 0;
  double prefill_tokens_per_s() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0; }
  double decode_tokens_per_s() const { return decode_seconds > 0 ? decode_tokens / decode_seconds : 0.0; }
};

struct GeneratorOptions {
  int64_t prefill_chunk = 256;     // most prompt tokens of one sequence in one forward
  int64_t max_batch_tokens = 2048; // most tokens in one forward
};

class Generator {
 public:
  using TokenCallback = std::function<void(size_t request, TokenId token)>;
  using ProgressCallback = std::function<void(int64_t prefilled, int64_t total)>;

  Generator(Engine& engine, const GeneratorOptions& options) : engine_(engine), options_(options) {}

  // Runs all requests to completion, batching them together. Requests beyond the engine's free
  // sequence slots, or whose KV would not fit beside the running ones (Engine::admit), wait and
  // are admitted, in order, as others finish. A request whose KV cannot fit in any tier even
  // alone is refused (FinishReason::kRefused with the reason) and the others run. A request whose
  // prompt cannot fit the context is refused up front with a clear error; nothing runs then.
  Result<std::vector<GenerationResult>> run(const std::vector<GenerationRequest>& requests,
                                            const TokenCallback& on_token = {},
                                            const ProgressCallback& on_progress = {});
  const GenerationStats& stats() const { return stats_; }

 private:
  Engine& engine_;
  GeneratorOptions options_;
  GenerationStats stats_;
};

}  // namespace specontext
