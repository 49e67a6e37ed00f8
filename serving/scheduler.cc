#include "serving/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace specontext {
namespace {

PrefixStoreOptions store_options(const GeneratorOptions& o) {
  PrefixStoreOptions s;
  s.host_bytes = o.prefix_offload_bytes;
  s.lower_bytes = o.prefix_disk_bytes;
  s.disk_dir = o.prefix_disk_dir;
  s.persist = o.prefix_disk_persist;
  s.blob_store = o.prefix_blob_store;
  s.shared_store = o.prefix_shared_store;
  s.shared_chunk_tokens = o.prefix_shared_chunk_tokens;
  return s;
}

}  // namespace

Scheduler::Scheduler(Engine& engine, const GeneratorOptions& options)
    : engine_(engine), options_(options), store_(engine, store_options(options)) {}

Scheduler::~Scheduler() {
  for (Entry& e : running_) release(e);  // then store_ ends
}

GenerationStats Scheduler::stats() const {
  GenerationStats s = stats_;
  static_cast<PrefixStoreStats&>(s) = store_.stats();
  return s;
}

StateLog Scheduler::states() const {
  StateLog log = log_;
  log += store_.states();
  return log;
}

void Scheduler::set_state(Entry& e, RequestState to) {
  const Status st = log_.move(e.state, to);
  SPX_ASSERT(st.is_ok());
  (void)st;
}

Status Scheduler::validate(const GenerationRequest& r) const {
  if (r.prompt.empty()) return invalid_argument("empty prompt");
  if (r.max_new_tokens < 1) return invalid_argument("max_new_tokens must be at least 1");
  SPX_RETURN_IF_ERROR(r.sampling.validate());
  for (float p : {r.frequency_penalty, r.presence_penalty}) {
    if (!(p >= -2.0f && p <= 2.0f)) return invalid_argument("frequency and presence penalties must be in [-2, 2]");
  }
  for (const auto& [id, bias] : r.logit_bias) {
    if (!std::isfinite(bias)) return invalid_argument("logit_bias of token " + std::to_string(id) + " is not finite");
  }
  if (r.min_tokens < 0 || r.min_tokens > r.max_new_tokens) {
    return invalid_argument("min_tokens must be in [0, max_new_tokens]");
  }
  if (!(r.min_p >= 0.0f && r.min_p <= 1.0f)) return invalid_argument("min_p must be in [0, 1]");
  for (const auto& [name, value] :
       {std::pair{"logprobs", r.logprobs}, std::pair{"prompt_logprobs", r.prompt_logprobs}}) {
    if (value > kMaxLogprobs) {
      return invalid_argument(std::string(name) + " must be at most " + std::to_string(kMaxLogprobs) +
                              " (got " + std::to_string(value) + ")");
    }
  }
  const int64_t need = r.synthetic_context + static_cast<int64_t>(r.prompt.size());
  if (need > engine_.max_context()) {
    return out_of_range("prompt of " + std::to_string(need) + " tokens is longer than the context limit of " +
                        std::to_string(engine_.max_context()) + " tokens");
  }
  return Status::ok();
}

Result<RequestId> Scheduler::submit(GenerationRequest request) {
  SPX_RETURN_IF_ERROR(validate(request));
  Entry e;
  e.id = RequestId(next_id_++);
  if (request.sampling.repetition_penalty != 1.0f) e.history.add(request.prompt);
  e.sampler = Sampler(request.sampling);
  e.prompt_size = request.prompt.size();
  if (request.constraint != nullptr) e.constraint = request.constraint->clone();
  e.request = std::move(request);
  set_state(e, RequestState::kWaiting);
  waiting_.push_back(std::move(e));
  return waiting_.back().id;
}

bool Scheduler::cancel(RequestId id, bool keep_cached) {
  auto match = [id](const Entry& e) { return e.id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), match); it != waiting_.end()) {
    set_state(*it, RequestState::kCancelled);
    waiting_.erase(it);
    return true;
  }
  if (auto it = std::find_if(running_.begin(), running_.end(), match); it != running_.end()) {
    set_state(*it, RequestState::kCancelled);
    if (keep_cached) {
      cache_or_release(*it);
    } else {
      release(*it);
    }
    running_.erase(it);
    return true;
  }
  return false;
}

void Scheduler::release(Entry& e) {
  if (e.seq.valid()) (void)engine_.memory().remove_sequence(e.seq);
  e.seq = SeqId();
}

std::vector<TokenId> Scheduler::held_tokens(const Entry& e, int64_t length) const {
  std::vector<TokenId> tokens(e.request.prompt.begin(),
                              e.request.prompt.begin() + static_cast<std::ptrdiff_t>(e.prompt_size));
  tokens.insert(tokens.end(), e.produced.begin(), e.produced.end());
  tokens.resize(std::min(tokens.size(), static_cast<size_t>(length)));  // the last token was never fed
  return tokens;
}

void Scheduler::cache_or_release(Entry& e) {
  const int64_t length = e.seq.valid() ? engine_.memory().sequence_length(e.seq) : 0;
  if (!options_.prefix_caching || length == 0 || e.request.synthetic_context > 0) {
    release(e);
    return;
  }
  std::vector<TokenId> held = held_tokens(e, length);
  // The prompt short of its last token: what a request with the same prompt takes.
  const size_t published = std::min(held.size(), e.prompt_size > 0 ? e.prompt_size - 1 : 0);
  const SeqId seq = e.seq;
  store_.insert(seq, held, e.state);
  e.seq = SeqId();
  if (store_.has_shared() && forks(e)) {
    (void)store_.publish(seq, std::span<const TokenId>(held).first(published));
  }
}

bool Scheduler::evict_cached(SeqId keep) { return store_.evict(keep, /*keep_may_go=*/running_.empty()); }

void Scheduler::finish(Entry& e, FinishReason reason, std::string error,
                       std::vector<SchedulerEvent>& events) {
  const bool ended_well =
      reason == FinishReason::kLength || reason == FinishReason::kStop || reason == FinishReason::kContext;
  set_state(e, ended_well                         ? RequestState::kFinished
               : reason == FinishReason::kRefused ? RequestState::kRefused
                                                  : RequestState::kError);
  if (ended_well) {
    cache_or_release(e);
  } else {
    release(e);  // a failed step's sequence is not trusted
  }
  push_event(e, {e.id, -1, true, reason, std::move(error), std::nullopt, {}}, events);
}

bool Scheduler::forks(const Entry& e) const {
  return options_.prefix_caching && engine_.memory().can_fork() && e.request.synthetic_context == 0 &&
         !wants_prompt_logprobs(e);
}

Scheduler::PrefixSource Scheduler::find_prefix(const Entry& e) const {
  // The longest shared prefix in whole fork units, short of the prompt's last token (whose logits
  // are needed): over the running requests' caches and the cached finished ones; `pending` also
  // counts what running requests still prefilling will have cached.
  const std::vector<TokenId>& prompt = e.request.prompt;
  const std::span<const TokenId> want(prompt.data(), prompt.size() - 1);
  const int64_t unit = engine_.memory().fork_granularity();
  PrefixSource best;
  for (const Entry& r : running_) {
    if (!r.seq.valid() || r.request.synthetic_context > 0) continue;
    auto token_at = [&](int64_t k) {
      const auto i = static_cast<size_t>(k);
      return i < r.prompt_size ? r.request.prompt[i] : r.produced[i - r.prompt_size];
    };
    const int64_t now = shared_units(want, engine_.memory().sequence_length(r.seq), unit, token_at);
    if (now > best.tokens) best.tokens = now, best.seq = r.seq;
    const auto will_have = static_cast<int64_t>(r.prompt_size + r.produced.size());
    best.pending = std::max(best.pending, shared_units(want, will_have, unit, token_at));
  }
  if (const PrefixStore::Match cached = store_.longest_cached(want, best.tokens); cached.tokens > 0) {
    best.tokens = cached.tokens;
    best.seq = cached.seq;
    best.from_cache = true;
    best.supersedes = cached.whole;
  }
  best.pending = std::max(best.pending, best.tokens);
  best.from_offload = store_.longest_stored(want, best.pending);
  return best;
}

Result<SeqId> Scheduler::sequence_for(Entry& e, int64_t final_length, const PrefixSource& best) {
  const int64_t promised = options_.admission == AdmissionPolicy::kReserve ? final_length : 0;
  const bool first_admission = !e.admitted_before;  // set by admit() once a sequence is had
  auto took = [&](int64_t tokens) {
    e.prefilled = tokens;
    stats_.cached_prompt_tokens += tokens;
    if (first_admission) e.cached_prompt_tokens = tokens;
  };
  // The cached sequence itself, cut to the shared pages.
  auto take_over = [&]() -> std::optional<SeqId> {
    std::optional<SeqId> seq = store_.take(best.seq, best.tokens, promised);
    if (seq) took(best.tokens);
    return seq;
  };
  // The request would take every whole page of it, and forks only ever take whole pages (the
  // next turn of a conversation): it takes the sequence over.
  if (best.tokens > 0 && best.from_cache && best.supersedes) {
    if (auto seq = take_over()) return *seq;
  }
  if (best.tokens > 0) {
    auto fork = engine_.memory().fork_sequence(best.seq, best.tokens, promised);
    // No slot for a fork, and the source is the only cached sequence left to give way (one slot,
    // as in `generate`): evicted, it would take the prefix with it. Its longer tokens go to the
    // offload store, when there is one, and the request takes the rest over.
    if (!fork.is_ok() && fork.status().code() == StatusCode::kResourceExhausted && best.from_cache &&
        store_.cached().size() == 1) {
      const PrefixStore::Cached& only = store_.cached().front();
      (void)store_.offload(only.seq, only.tokens, RequestState::kCached);
      if (auto seq = take_over()) return *seq;
    }
    if (fork.is_ok()) {
      if (best.from_cache) store_.touch(best.seq);  // now the most recently used
      took(best.tokens);
      return fork;
    }
    // Out of slots: the caller makes room or waits. Anything else: compute the prompt instead.
    if (fork.status().code() == StatusCode::kResourceExhausted) return fork.status();
  }
  return engine_.memory().add_sequence(promised);
}

Status Scheduler::admit(std::vector<SchedulerEvent>& events) {
  Status first_error;
  // The request an offloaded prefix was restored for in this call: restored once, so that one
  // evicted again for the request's room (and offloaded) is not restored again in a loop.
  RequestId restored_for;
  while (!waiting_.empty()) {
    // The engine's slots beyond running_slots() hold waiting sequences only (the prefix cache).
    if (static_cast<int64_t>(running_.size()) >= engine_.running_slots()) break;
    Entry& e = waiting_.front();
    const GenerationRequest& r = e.request;
    const int64_t final_length =
        std::min(engine_.max_context(),
                 r.synthetic_context + static_cast<int64_t>(e.prompt_size) + r.max_new_tokens);
    // kReserve asks for its final length beside the running ones' promises and waits when that
    // fits alone; kPreempt refuses only what never fits alone and waits until its prompt fits.
    const bool others = engine_.memory().live_sequences() > 0;
    // A running request is still computing more of this prompt than any cache holds (the n
    // choices of one request, the same prompt sent twice at once): wait for it, then fork.
    PrefixSource source = forks(e) ? find_prefix(e) : PrefixSource{};
    // No local level serves it as far: the shared store may (another server's prompt).
    if (forks(e) && !source.from_offload && store_.has_shared() && restored_for != e.id) {
      source.from_shared =
          store_.find_shared(std::span<const TokenId>(r.prompt.data(), r.prompt.size() - 1), source.pending);
    }
    const bool from_store = source.from_offload || source.from_shared > 0;
    // An offloaded prefix longer than any the cache has or will have: back into the cache, then
    // look again (it is found there). Failing, it may have evicted the source found.
    // Under kPreempt, not before its prompt fits beside the running requests: restored while it
    // still waits, the prefix would be evicted again (and offloaded again) before it is used.
    if (from_store && options_.admission == AdmissionPolicy::kPreempt && others &&
        !engine_.fits(near_lengths(SeqId(), /*without_cached=*/true), near_length(e, r.synthetic_context))
             .is_ok()) {
      break;
    }
    if (from_store && restored_for != e.id &&
        (source.from_offload ? store_.restore(*source.from_offload)
                             : store_.restore_shared(
                                   std::span<const TokenId>(r.prompt.data(), r.prompt.size() - 1),
                                   source.from_shared))) {
      restored_for = e.id;
      continue;
    }
    if (from_store) {
      source = find_prefix(e);
      source.from_offload.reset();
    }
    if (source.pending > source.tokens) {
      ++stats_.prefix_waits;
      break;
    }
    // Cached finished sequences give way first, the one this request forks last; one it takes
    // over (PrefixSource::supersedes) counts as its own.
    const SeqId keep = source.from_cache ? source.seq : SeqId();
    Status verdict;
    bool wait = false;
    if (options_.admission == AdmissionPolicy::kPreempt) {
      verdict = engine_.admit(final_length, /*alone=*/true);
      wait =
          verdict.is_ok() && others &&
          !engine_.fits(near_lengths(source.supersedes ? keep : SeqId()), near_length(e, r.synthetic_context))
               .is_ok();
      if (wait && evict_cached(keep)) continue;
    } else {
      verdict = engine_.admit(final_length, /*alone=*/false, source.supersedes ? keep : SeqId());
      if (verdict.code() == StatusCode::kResourceExhausted && evict_cached(keep)) continue;
      wait = verdict.code() == StatusCode::kResourceExhausted && others &&
             engine_.admit(final_length, /*alone=*/true).is_ok();
    }
    if (wait) break;  // in order, until running requests finish (or make room)
    if (!verdict.is_ok()) {
      const bool refused = verdict.code() == StatusCode::kResourceExhausted;
      finish(e, refused ? FinishReason::kRefused : FinishReason::kError, "refused: " + verdict.message(), events);
      if (!refused && first_error.is_ok()) first_error = verdict;
      waiting_.pop_front();
      continue;
    }
    auto seq = sequence_for(e, final_length, source);
    if (!seq.is_ok()) {
      if (seq.status().code() == StatusCode::kResourceExhausted && evict_cached(keep)) continue;
      if (seq.status().code() == StatusCode::kResourceExhausted && engine_.memory().live_sequences() > 0)
        break;
      finish(e, FinishReason::kError, seq.status().message(), events);
      if (first_error.is_ok()) first_error = seq.status();
      waiting_.pop_front();
      continue;
    }
    e.seq = *seq;
    e.admitted_before = true;
    if (r.synthetic_context > 0) {
      if (Status st = engine_.fill_synthetic(e.seq, r.synthetic_context,
                                             r.sampling.seed + static_cast<uint64_t>(e.id.value()));
          !st.is_ok()) {
        finish(e, FinishReason::kError, st.message(), events);
        if (first_error.is_ok()) first_error = st;
        waiting_.pop_front();
        continue;
      }
    }
    set_state(e, RequestState::kPrefilling);
    running_.push_back(std::move(e));
    waiting_.pop_front();
  }
  return first_error;
}

void Scheduler::push_event(Entry& e, SchedulerEvent ev, std::vector<SchedulerEvent>& events) {
  if (e.request.prompt_logprobs >= 0 && !e.prompt_logprobs_done) {
    ev.prompt_logprobs = std::move(e.prompt_logprobs);
    e.prompt_logprobs_done = true;
  }
  ev.cached_prompt_tokens = e.cached_prompt_tokens;
  events.push_back(std::move(ev));
}

LogitsMode Scheduler::sample_mode(const Entry& e) {
  return e.request.logprobs >= 0 || e.request.adjusts_logits() ? LogitsMode::kLast : LogitsMode::kSample;
}

Status Scheduler::adjust_logits(const Entry& e, std::span<float> logits) {
  const GenerationRequest& r = e.request;
  const auto vocab = static_cast<TokenId>(logits.size());
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  if (e.constraint != nullptr) SPX_RETURN_IF_ERROR(e.constraint->mask(logits));
  for (const auto& [id, bias] : r.logit_bias) {
    if (id >= 0 && id < vocab) logits[static_cast<size_t>(id)] += bias;
  }
  for (const auto& [id, count] : e.output_counts) {
    logits[static_cast<size_t>(id)] -= r.frequency_penalty * static_cast<float>(count) + r.presence_penalty;
  }
  if (e.generated() < r.min_tokens) {
    for (TokenId id : r.stop_ids) {
      if (id >= 0 && id < vocab) logits[static_cast<size_t>(id)] = kNever;
    }
  }
  if (r.min_p > 0.0f && r.sampling.temperature > 0.0f) {
    const float cut = *std::max_element(logits.begin(), logits.end()) + r.sampling.temperature * std::log(r.min_p);
    for (float& l : logits) {
      if (l < cut) l = kNever;
    }
  }
  return Status::ok();
}

int64_t Scheduler::near_length(const Entry& e, int64_t cached) {
  const auto prompt = static_cast<int64_t>(e.request.prompt.size());
  if (e.prefilled < prompt) return e.request.synthetic_context + prompt + 1;
  return cached + 1;
}

std::vector<int64_t> Scheduler::near_lengths(SeqId taken_over, bool without_cached) const {
  std::vector<int64_t> lens;
  lens.reserve(running_.size() + store_.cached().size());
  for (const Entry& e : running_) lens.push_back(near_length(e, engine_.memory().sequence_length(e.seq)));
  for (const PrefixStore::Cached& c : store_.cached()) {
    lens.push_back(c.seq == taken_over || without_cached ? 0 : engine_.memory().sequence_length(c.seq));
  }
  return lens;
}

void Scheduler::preempt_until_fits() {
  // Cached finished sequences go first. The last running one left always fits: it was admitted
  // only if it fits alone at its final length.
  while (!engine_.fits(near_lengths(), 0).is_ok()) {
    if (evict_cached()) continue;
    if (running_.size() <= 1) break;
    Entry e = std::move(running_.back());
    running_.pop_back();
    if (swaps(e)) swap_out(e);
    requeue(std::move(e));
    ++stats_.preemptions;
  }
}

bool Scheduler::swaps(const Entry& e) const {
  return options_.swap_preempted && e.seq.valid() && forks(e) && store_.has_levels();
}

void Scheduler::swap_out(const Entry& e) {
  if (store_.offload(e.seq, held_tokens(e, engine_.memory().sequence_length(e.seq)), e.state))
    ++stats_.preemption_swaps;
}

void Scheduler::requeue(Entry e) {
  release(e);
  set_state(e, RequestState::kWaiting);
  e.request.prompt.resize(e.prompt_size);
  e.request.prompt.insert(e.request.prompt.end(), e.produced.begin(), e.produced.end());
  e.prefilled = 0;
  e.prompt_logprobs.clear();  // gathered again if its first event has not gone out
  waiting_.push_front(std::move(e));
}

bool Scheduler::recover_lost_tiers(const std::vector<Entry*>& in_batch) {
  if (!options_.recompute_lost_tiers) return false;
  const std::vector<TierId> lost = engine_.lost_tiers();
  if (lost.empty()) return false;
  // The failed step's draws are made again when the requests come back.
  for (Entry* e : in_batch) e->sampler.restore_stream(e->stream_before_draw);
  // Every sequence has KV in every layer, some of it on the lost tier: all of them go. The newest
  // running request is requeued first, so the oldest ends up first in line.
  while (!running_.empty()) {
    Entry e = std::move(running_.back());
    running_.pop_back();
    requeue(std::move(e));
    ++stats_.lost_tier_requeues;
  }
  // Their KV is partly gone; offloaded prefixes stay.
  while (store_.evict(SeqId(), /*keep_may_go=*/true, /*offload=*/false)) {
  }
  for (TierId t : lost) {
    if (!engine_.abandon_tier(t).is_ok()) return false;  // sequences the scheduler does not own
    ++stats_.lost_tiers;
  }
  return true;
}

Status Scheduler::step(std::vector<SchedulerEvent>& events) {
  Status status = admit(events);
  if (options_.admission == AdmissionPolicy::kPreempt) preempt_until_fits();

  std::vector<StepRequest> batch;
  std::vector<Entry*> in_batch;
  std::vector<bool> is_prefill;
  int64_t budget = options_.max_batch_tokens;
  int64_t prefill_tokens = 0, decode_count = 0;
  // Decode tokens first (latency), then prompt chunks fill the rest of the budget.
  for (Entry& e : running_) {
    if (e.prefilled < static_cast<int64_t>(e.request.prompt.size())) continue;
    if (budget <= 0) break;
    e.stream_before_draw = e.sampler.stream_state();
    e.draw = e.sampler.next_draw(e.history);
    batch.push_back({e.seq, std::span<const TokenId>(&e.next, 1), sample_mode(e), &e.draw});
    in_batch.push_back(&e);
    is_prefill.push_back(false);
    --budget;
    ++decode_count;
  }
  for (Entry& e : running_) {
    const auto& prompt = e.request.prompt;
    const int64_t left = static_cast<int64_t>(prompt.size()) - e.prefilled;
    if (left <= 0 || budget <= 0) continue;
    const int64_t n = std::min({left, options_.prefill_chunk, budget});
    const bool last_chunk = n == left;
    e.stream_before_draw = e.sampler.stream_state();
    if (last_chunk) e.draw = e.sampler.next_draw(e.history);
    const LogitsMode mode = wants_prompt_logprobs(e) ? LogitsMode::kAll
                            : last_chunk             ? sample_mode(e)
                                                     : LogitsMode::kNone;
    batch.push_back({e.seq, std::span<const TokenId>(prompt.data() + e.prefilled, static_cast<size_t>(n)),
                     mode, last_chunk ? &e.draw : nullptr, /*prompt=*/true});
    in_batch.push_back(&e);
    is_prefill.push_back(true);
    budget -= n;
    prefill_tokens += n;
  }
  if (batch.empty()) return status;

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto out = engine_.forward(batch);
  if (!out.is_ok()) {
    if (recover_lost_tiers(in_batch)) return status;
    // All-or-nothing: the engine is as before; the batch's requests end, the rest go on.
    for (Entry* e : in_batch) {
      if (!e->ended()) finish(*e, FinishReason::kError, out.status().message(), events);
    }
    std::erase_if(running_, [](const Entry& e) { return e.ended(); });
    return status.is_ok() ? out.status() : status;
  }
  // Sampling belongs to the step's time too.
  for (size_t b = 0; b < batch.size(); ++b) {
    Entry& e = *in_batch[b];
    const auto n_tokens = static_cast<int64_t>(batch[b].tokens.size());
    const GenerationRequest& r = e.request;
    if (is_prefill[b]) {
      if (batch[b].logits == LogitsMode::kAll) {
        // Row k predicts the token after the chunk's k-th: prompt logprobs, then on the last
        // chunk the first generated token from its last row.
        for (int64_t k = 0; k < n_tokens; ++k) {
          const auto target = static_cast<size_t>(e.prefilled + k + 1);
          if (target < r.prompt.size()) {
            e.prompt_logprobs.push_back(token_logprobs(out->row(b, k), r.prompt[target], r.prompt_logprobs));
          }
        }
      }
      e.prefilled += n_tokens;
      stats_.prompt_tokens += n_tokens;
      if (batch[b].logits == LogitsMode::kAll && e.prefilled < static_cast<int64_t>(r.prompt.size())) continue;
    }
    if (batch[b].logits == LogitsMode::kNone) continue;
    TokenId tok = out->tokens[b];
    std::optional<TokenLogprobs> logprobs;
    if (batch[b].logits == LogitsMode::kLast || batch[b].logits == LogitsMode::kAll) {
      // Asked for logprobs: drawn here, by the procedure sample_rows implements.
      const std::span<float> row = out->row(b, out->n_rows[b] - 1);
      sample_logits_.assign(row.begin(), row.end());
      if (Status s = adjust_logits(e, sample_logits_); !s.is_ok()) {
        finish(e, FinishReason::kError, s.message(), events);
        continue;
      }
      tok = sample_with_coin(sample_logits_, e.draw, sample_scratch_);
      if (r.logprobs >= 0) logprobs = token_logprobs(row, tok, r.logprobs);
      if (e.constraint != nullptr) {
        if (Status s = e.constraint->accept(tok); !s.is_ok()) {
          finish(e, FinishReason::kError, s.message(), events);
          continue;
        }
      }
    }
    if (std::find(r.stop_ids.begin(), r.stop_ids.end(), tok) != r.stop_ids.end()) {
      finish(e, FinishReason::kStop, {}, events);
      continue;
    }
    push_event(e, {e.id, tok, false, FinishReason::kLength, {}, std::move(logprobs), {}}, events);
    if (e.state == RequestState::kPrefilling) set_state(e, RequestState::kDecoding);  // its first token
    e.produced.push_back(tok);
    if (r.frequency_penalty != 0.0f || r.presence_penalty != 0.0f) ++e.output_counts[tok];
    if (r.sampling.repetition_penalty != 1.0f) e.history.add(tok);
    e.next = tok;
    ++stats_.generated_tokens;
    if (!is_prefill[b]) ++stats_.decode_tokens;
    if (e.constraint != nullptr && e.constraint->closed()) {
      finish(e, FinishReason::kStop, {}, events);
    } else if (e.generated() >= r.max_new_tokens) {
      finish(e, FinishReason::kLength, {}, events);
    } else if (engine_.memory().sequence_length(e.seq) + 1 > engine_.max_context()) {
      finish(e, FinishReason::kContext, {}, events);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  // A mixed step is split between prefill and decode by token count.
  const double total_tokens = static_cast<double>(prefill_tokens + decode_count);
  stats_.prefill_seconds += seconds * static_cast<double>(prefill_tokens) / total_tokens;
  stats_.decode_seconds += seconds * static_cast<double>(decode_count) / total_tokens;
  if (decode_count > 0) ++stats_.decode_steps;
  stats_.max_batch_sequences = std::max(stats_.max_batch_sequences, static_cast<int64_t>(batch.size()));
  stats_.kv_bytes_peak = std::max(stats_.kv_bytes_peak, engine_.memory().kv_bytes_in_use());
  std::erase_if(running_, [](const Entry& e) { return e.ended(); });
  return status;
}

}  // namespace specontext
