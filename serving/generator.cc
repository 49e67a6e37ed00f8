#include "serving/generator.h"

#include <unordered_map>

namespace specontext {

Result<std::vector<GenerationResult>> Generator::run(const std::vector<GenerationRequest>& requests,
                                                     const TokenCallback& on_token,
                                                     const ProgressCallback& on_progress) {
  Scheduler scheduler(engine_, options_);
  SPX_RETURN_IF_ERROR(scheduler.open_prefix_disk());
  // Nothing runs before step(): a request that can never run refuses the whole list.
  std::vector<GenerationResult> results(requests.size());
  std::unordered_map<int64_t, size_t> index_of;  // RequestId → position in `requests`
  int64_t total_prompt = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto id = scheduler.submit(requests[i]);
    if (!id.is_ok()) return id.status().with_context("request " + std::to_string(i));
    index_of.emplace(id->value(), i);
    total_prompt += static_cast<int64_t>(requests[i].prompt.size());
  }
  std::vector<SchedulerEvent> events;
  int64_t prefilled = 0;
  while (!scheduler.idle()) {
    events.clear();
    Status st = scheduler.step(events);
    for (const SchedulerEvent& ev : events) {
      const size_t index = index_of.at(ev.request.value());
      GenerationResult& res = results[index];
      if (!ev.finished) {
        res.tokens.push_back(ev.token);
        if (on_token) on_token(index, ev.token);
        continue;
      }
      res.finish = ev.finish;
      if (ev.finish == FinishReason::kRefused)
        res.error = "request " + std::to_string(index) + " " + ev.error;
    }
    if (!st.is_ok()) {
      stats_ = scheduler.stats();
      return st;  // the scheduler frees the sequences
    }
    if (on_progress && scheduler.stats().prompt_tokens != prefilled) {
      prefilled = scheduler.stats().prompt_tokens;
      on_progress(prefilled, total_prompt);
    }
  }
  scheduler.persist_prefixes();  // here rather than at its end: the writes are in the stats
  stats_ = scheduler.stats();
  return results;
}

}  // namespace specontext
