// A fixed list of requests run to completion over the Scheduler (continuous batching, chunked
// prefill, sampling, stop conditions, timing): what `specontext generate` and the benchmarks use.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "serving/scheduler.h"

namespace specontext {

struct GenerationResult {
  std::vector<TokenId> tokens;  // generated tokens (stop token excluded)
  FinishReason finish = FinishReason::kLength;
  std::string error;  // why a kRefused request was refused
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
