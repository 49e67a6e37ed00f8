// Continuous batching over the Engine, one step at a time: requests are submitted and cancelled
// at any time, and each step() admits what fits, runs one batched forward (decode tokens first,
// then prompt chunks in the remaining token budget) and reports the tokens and endings it
// produced. Generator::run (a fixed list) and the OpenAI server (requests arriving over HTTP)
// both drive it. Not thread-safe: one thread owns a Scheduler and its Engine.
#pragma once

#include <deque>
#include <optional>
#include <unordered_map>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/ports/prefix_blob_store.h"
#include "core/ports/sampler.h"
#include "serving/prefix_store.h"
#include "serving/request_state.h"
#include "serving/structured/json_constraint.h"

namespace specontext {

using RequestId = StrongId<struct RequestIdTag, int64_t>;

struct GenerationRequest {
  std::vector<TokenId> prompt;  // must be non-empty
  SamplingParams sampling;
  int64_t max_new_tokens = 256;
  std::vector<TokenId> stop_ids;  // generation ends after emitting none of these
  int64_t synthetic_context = 0;  // >0: KV prefilled with random entries (speed runs only)
  // >= 0: every token event carries its log-probability and this many alternatives (at most
  // kMaxLogprobs). Such a request's logits come back to the host (LogitsMode::kLast) and its
  // token is drawn there by sample_with_coin, the procedure Backend::sample_rows implements.
  int32_t logprobs = -1;
  // >= 0: the log-probability (and rank) of every prompt token after the first, with this many
  // alternatives (at most kMaxLogprobs): the completions API's echo with logprobs, vLLM's
  // prompt_logprobs. Its prompt chunks bring all their logits to the host (kAll).
  int32_t prompt_logprobs = -1;
  // OpenAI's logit adjustments, applied on the host (such a request takes the kLast path too) to
  // the raw logits before sample_with_coin: `logit_bias` adds to the listed tokens' logits;
  // frequency/presence penalties subtract f·count + p·[count > 0] over the tokens generated so far.
  std::vector<std::pair<TokenId, float>> logit_bias;
  float frequency_penalty = 0.0f;  // [-2, 2]
  float presence_penalty = 0.0f;   // [-2, 2]
  // vLLM's: stop ids cannot be drawn before min_tokens tokens; min_p drops tokens less likely than
  // min_p times the likeliest at the request's temperature (a logit cut at max + T·ln(min_p)).
  int64_t min_tokens = 0;
  float min_p = 0.0f;  // [0, 1]
  // Constrained decoding (serving/structured/json_constraint.h), in its initial state: the request works on its
  // own clone, which masks the logits before each draw (first, so nothing else revives a masked
  // token) and ends the request ("stop") once the text is closed. Host path, like logit_bias.
  std::shared_ptr<const TokenConstraint> constraint;
  bool adjusts_logits() const {
    return !logit_bias.empty() || frequency_penalty != 0.0f || presence_penalty != 0.0f || min_tokens > 0 ||
           min_p > 0.0f || constraint != nullptr;
  }
};

// kRefused: the request can never fit the engine's memory (any tier), even alone; nothing ran.
// kError: the forward pass (or set-up) of its batch failed. kCancelled: ended by whoever drives
// the scheduler before it finished (the server when it shuts down); the Scheduler itself never
// reports it, and cancel() is followed by no event.
enum class FinishReason { kLength, kStop, kContext, kRefused, kCancelled, kError };

// The prefix counters (prefix_cache_evictions, prefix_offloads, prefix_restores, the disk ones) are
// the PrefixStore's.
struct GenerationStats : PrefixStoreStats {
  int64_t prompt_tokens = 0;  // tokens run through prefill
  int64_t generated_tokens = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  int64_t decode_tokens = 0;  // tokens produced by decode steps (first token comes from prefill)
  int64_t decode_steps = 0;
  int64_t kv_bytes_peak = 0;
  int64_t max_batch_sequences = 0;  // most sequences in one forward
  int64_t preemptions = 0;          // running requests sent back to wait (AdmissionPolicy::kPreempt)
  int64_t preemption_swaps = 0;     // of those, the ones whose KV went to the offload store (swap_preempted)
  int64_t cached_prompt_tokens = 0;  // prompt tokens taken from the prefix cache, not computed
  int64_t prefix_waits = 0;  // admissions put off a step for a running request to prefill a shared prompt
  int64_t lost_tiers = 0;    // remote tiers lost mid-run and abandoned (recompute_lost_tiers)
  int64_t lost_tier_requeues = 0;  // running requests sent back to be recomputed after such a loss
  double prefill_tokens_per_s() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0; }
  double decode_tokens_per_s() const { return decode_seconds > 0 ? decode_tokens / decode_seconds : 0.0; }
};

// kReserve: a request is admitted only when its KV at its final length (prompt + max_new_tokens)
// fits beside the running ones at theirs, so nothing ever has to give way; requests that may run
// long (max_tokens up to the context) then run few at a time. kPreempt (vLLM's way): admitted when
// its prompt fits beside the running ones at their next lengths; before each step, while the
// running set would not fit the memory after the step, the newest running request is preempted:
// its sequence is freed and it waits again, first in line, to be recomputed from its prompt and
// the tokens it has produced (its random stream goes on where it was, so its output is the one
// it would have had, up to prefill-vs-decode rounding). Requests that cannot fit even alone at
// their final length are refused under both. With an offload store a preempted request's KV is
// swapped out instead (GeneratorOptions::swap_preempted).
enum class AdmissionPolicy { kReserve, kPreempt };

struct GeneratorOptions {
  int64_t prefill_chunk = 256;      // most prompt tokens of one sequence in one forward
  int64_t max_batch_tokens = 2048;  // most tokens in one forward
  AdmissionPolicy admission = AdmissionPolicy::kReserve;
  // Prefix caching (vLLM's automatic prefix caching, over whole sequences): a request starts from
  // the longest prefix of its prompt, in multiples of Engine::fork_granularity(), that a running
  // request or a finished one has in the cache (Engine::fork_sequence); the rest of its prompt is
  // computed. Finished requests' sequences stay cached, least recently used first out, until
  // memory or a sequence slot is wanted; a request that would take every whole page of one (the
  // next turn of a conversation) takes the sequence itself (Engine::truncate_sequence). A request
  // whose prompt a running request is still prefilling waits (in order) until it can fork what
  // that one computes: a prompt sent n times at once is computed once. Under SpeContext the
  // engine needs prefix_sharing on.
  bool prefix_caching = false;
  // Offloading the prefix cache (vLLM's KV offloading to CPU memory): a cached sequence evicted
  // for room is first copied, whole fork units of it, into up to this many bytes of host memory
  // (Engine::export_prefix), least recently used out first; one holding a longer prefix of a
  // request's prompt than any cached or running sequence is written back into the cache
  // (Engine::import_prefix) instead of being recomputed. An offloaded prefix another one extends
  // is dropped. Offloaded prefixes are host memory apart from the KV tiers, so they outlive a
  // lost tier. 0: evicted sequences are dropped.
  uint64_t prefix_offload_bytes = 0;
  // The store's disk level (LMCache's local disk backend): a prefix the host store lets go for
  // room, or one larger than it, is written as a file (core/engine/prefix_file.h) into a directory of
  // the scheduler's own under prefix_disk_dir, up to this many bytes, least recently used out
  // first, and read back when a request wants it. A file that cannot be written, or read back
  // intact (disk full, corrupt), is dropped and the request computes its prompt. The directory
  // goes with the scheduler (unless prefix_disk_persist). 0: no disk level.
  uint64_t prefix_disk_bytes = 0;
  std::string prefix_disk_dir;  // empty: the system's temporary directory
  // Keeps the disk level across restarts (LMCache's persistent local disk): the files go into
  // prefix_disk_dir/specontext-<Engine::kv_identity in hex>, which the scheduler locks (flock)
  // from Scheduler::open_prefix_disk to its end, and stay there. open_prefix_disk indexes the
  // files a previous process of the same model and KV layout left, by their headers, least
  // recently used first; at the end the cached and host-memory prefixes are written there too,
  // within prefix_disk_bytes. Needs prefix_disk_bytes and prefix_disk_dir.
  bool prefix_disk_persist = false;
  // The disk level's files kept in this store instead of a directory (a KV node's memory:
  // cluster/remote_prefix_store.h; LMCache's remote backend, private to this scheduler), within
  // prefix_disk_bytes (0: the store's capacity). What cannot be put, or read back intact (a dead
  // node), is dropped and counted in prefix_disk_errors, as a file is. Not with
  // prefix_disk_persist; prefix_disk_dir is unused.
  std::shared_ptr<PrefixBlobStore> prefix_blob_store;
  // A prefix store other servers share (cluster/redis_prefix_store.h; LMCache's remote backend
  // shared by its servers), with prefix caching: when a request finishes, its prompt's whole fork
  // units (short of its last token, what a request with the same prompt can take) are written
  // there under their content key (PrefixKey: the engine's kv_identity and the tokens'
  // hash) unless it holds them already; a request that no cached, running or stored prefix
  // serves as far asks it for the longest prefix of its prompt and has that read back instead of
  // computed. Stored in chunks of prefix_shared_chunk_tokens (rounded up to whole fork units;
  // PrefixStore's shared level): a prompt writes only the chunks the store does not hold, and a
  // later prompt is served by the run of chunks from its first token the store holds.
  // An unreachable store, or a chunk gone or unreadable, costs the prompt's computation only
  // (counted in prefix_shared_*). Independent of the other levels.
  std::shared_ptr<SharedPrefixStore> prefix_shared_store;
  int64_t prefix_shared_chunk_tokens = 256;
  // Swap preemption (vLLM's preemption_mode "swap"), under kPreempt with prefix caching and an
  // offload store (prefix_offload_bytes or prefix_disk_bytes): a preempted request's whole fork
  // units go to the store as an evicted cached prefix does, and when it is admitted again they
  // are written back (it waits until its prompt fits beside the running requests, so that they
  // are not evicted again at once); only the rest, less than a unit, is computed. A store that
  // has no room, a file that cannot be read back, or off: it is recomputed.
  bool swap_preempted = true;
  // When a forward fails because a remote tier is gone for good (Engine::lost_tiers: every
  // replica of a KV node tier died), the engine abandons the tier and every request is
  // recomputed from its prompt and the tokens it produced, as a preempted one is (its random
  // stream goes back to before the failed step), instead of ending with kError: nothing accepted
  // is lost. Cached prefixes are dropped. Off: the batch's requests end with kError.
  bool recompute_lost_tiers = true;
};

// What one step produced for one request: a token (finished = false), or its ending. A stop
// token ends the request without a token event; kLength/kContext come right after the last
// token's event. Every submitted request gets exactly one finished event, except cancelled ones.
struct SchedulerEvent {
  RequestId request;
  TokenId token = -1;
  bool finished = false;
  FinishReason finish = FinishReason::kLength;
  std::string error;  // why, for kRefused and kError
  std::optional<TokenLogprobs> logprobs;  // token events of requests that asked for them
  // prompt_logprobs requests, on their first event: one per prompt token after the first.
  std::vector<TokenLogprobs> prompt_logprobs;
  // Prompt tokens the request's first admission took from the prefix cache (OpenAI's
  // usage.prompt_tokens_details.cached_tokens); on every event of the request.
  int64_t cached_prompt_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(Engine& engine, const GeneratorOptions& options);
  // Frees the sequences of running requests; then the prefix store ends (with prefix_disk_persist
  // it writes the cached and host-memory prefixes to the directory; what cannot be written is
  // lost, not an error).
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // What submit() would refuse: an empty prompt, bad sampling parameters, a prompt longer than
  // the context (kOutOfRange), max_new_tokens < 1, logprobs above kMaxLogprobs, penalties outside
  // [-2, 2], non-finite biases (ids outside the vocabulary are the caller's to refuse; ignored here).
  Status validate(const GenerationRequest& request) const;
  // PrefixStore::open_disk (prefix_disk_persist; call it before the first step, nothing is
  // persisted without it).
  Status open_prefix_disk() { return store_.open_disk(); }
  // PrefixStore::persist (running requests are left alone). The destructor does it; a caller
  // that wants the writes in stats() calls it when idle.
  void persist_prefixes() { store_.persist(); }
  // Queues a request (FIFO); it is admitted once a sequence slot is free and its KV fits beside the
  // running ones (AdmissionPolicy). One that never fits, even alone, ends with kRefused.
  Result<RequestId> submit(GenerationRequest request);
  // Drops a waiting request or frees a running one's sequence at once. False for unknown or
  // finished ids. No event follows. keep_cached: with prefix caching, a running request's
  // sequence stays cached like a finished one's (the server ending a request at a stop string).
  bool cancel(RequestId id, bool keep_cached = false);

  // Admits, runs one forward, appends the events. A failed forward ends every request of its
  // batch with kError (the engine is unchanged, the other requests go on) and returns the error;
  // waiting requests stay queued. Ok with no events when there is nothing to do, or when the
  // forward failed for a lost tier that was recovered from (recompute_lost_tiers).
  Status step(std::vector<SchedulerEvent>& events);

  bool idle() const { return waiting_.empty() && running_.empty(); }
  size_t waiting() const { return waiting_.size(); }
  size_t running() const { return running_.size(); }
  // The prefix cache and its offload levels (occupancy, directory, last error).
  const PrefixStore& prefix_store() const { return store_; }
  GenerationStats stats() const;  // the scheduler's counters and the store's
  // Every request state change so far, the store's included (serving/README.md, "Request states").
  StateLog states() const;
  Engine& engine() { return engine_; }

 private:
  struct Entry {
    RequestId id;
    GenerationRequest request;
    SeqId seq;
    DistinctTokens history;  // prompt + generated, for the repetition penalty (kept only when on)
    Sampler sampler{SamplingParams{}};
    TokenDraw draw;         // this step's sampling decision, made by the engine where the logits are
    uint64_t stream_before_draw = 0;  // the sampler's stream before this step's draw
    int64_t prefilled = 0;  // prompt tokens already in the cache
    size_t prompt_size = 0;          // of the request as submitted
    std::vector<TokenId> produced;   // its tokens so far (kPreempt: a preempted one's prompt gains them)
    int64_t generated() const { return static_cast<int64_t>(produced.size()); }
    std::vector<TokenLogprobs> prompt_logprobs;  // gathered over its prompt chunks
    std::unordered_map<TokenId, int32_t> output_counts;  // produced tokens (frequency/presence penalties)
    std::unique_ptr<TokenConstraint> constraint;         // request.constraint's clone, at its tokens so far
    bool prompt_logprobs_done = false;           // its first event carried them (not recomputed)
    TokenId next = -1;  // token to feed in the next decode step
    RequestState state = RequestState::kNew;
    bool ended() const {
      return state == RequestState::kFinished || state == RequestState::kRefused ||
             state == RequestState::kError;
    }
    bool admitted_before = false;
    int64_t cached_prompt_tokens = 0;  // of its first admission
  };
  // Moves waiting requests to running while they fit; refused ones get their finished event.
  Status admit(std::vector<SchedulerEvent>& events);
  // kPreempt: the length each running request reaches after its next step or two (a prefilling
  // one: its whole prompt and first token), and the preemption that makes them fit.
  static int64_t near_length(const Entry& e, int64_t cached);
  // taken_over: a cached sequence the new request takes over, counted as 0 (the request is);
  // without_cached: every cached sequence counted as 0 (all of them evicted).
  std::vector<int64_t> near_lengths(SeqId taken_over = SeqId(), bool without_cached = false) const;
  void preempt_until_fits();
  // The least recently used cached sequence other than `keep` evicted (PrefixStore::evict; `keep`
  // too when it is the last and nothing runs).
  bool evict_cached(SeqId keep = SeqId());
  // swap_preempted applies to e: its KV whole fork units into the store (before requeue).
  bool swaps(const Entry& e) const;
  void swap_out(const Entry& e);
  // Frees a running request's sequence and puts it first in line, to be recomputed from its prompt
  // and the tokens it produced.
  void requeue(Entry e);
  // After a failed forward: when a remote tier is lost, abandons it and requeues every request
  // (recompute_lost_tiers). False when there is no lost tier or the engine refused.
  bool recover_lost_tiers(const std::vector<Entry*>& in_batch);
  void finish(Entry& e, FinishReason reason, std::string error, std::vector<SchedulerEvent>& events);
  // Prefix caching: where e's prompt could start from.
  struct PrefixSource {
    int64_t tokens = 0;  // usable now from `seq`
    SeqId seq;
    bool from_cache = false;             // seq is a cached one
    bool supersedes = false;             // a cached seq whose every whole page the request takes
    int64_t pending = 0;                 // usable once running requests have prefilled their prompts
    std::optional<size_t> from_offload;  // PrefixStore::longest_stored: a longer prefix than `pending`
    int64_t from_shared = 0;  // PrefixStore::find_shared: a longer prefix than `pending` (tokens)
  };
  // A sequence for e holding `source`'s prefix (a cached one taken over, or a fork), or an empty
  // one (add_sequence) when there is none to use.
  Result<SeqId> sequence_for(Entry& e, int64_t final_length, const PrefixSource& source);
  bool forks(const Entry& e) const;  // prefix caching applies to e
  PrefixSource find_prefix(const Entry& e) const;
  void release(Entry& e);
  void cache_or_release(Entry& e);  // prefix caching keeps its sequence, else release
  // What e's sequence of `length` tokens holds: the prompt as submitted, then its tokens.
  std::vector<TokenId> held_tokens(const Entry& e, int64_t length) const;
  void set_state(Entry& e, RequestState to);      // log_.move; a refusal is a bug (asserted)
  static LogitsMode sample_mode(const Entry& e);  // how a sampling row of e asks for its logits
  // The request's logit_bias, penalties, min_tokens and min_p applied to a copy of its raw logits.
  // A constraint that leaves no token is an error for the request (it ends kError).
  [[nodiscard]] static Status adjust_logits(const Entry& e, std::span<float> logits);
  static bool wants_prompt_logprobs(const Entry& e) {
    return e.request.prompt_logprobs >= 0 && !e.prompt_logprobs_done;
  }
  void push_event(Entry& e, SchedulerEvent ev, std::vector<SchedulerEvent>& events);

  Engine& engine_;
  GeneratorOptions options_;
  GenerationStats stats_;
  int64_t next_id_ = 1;
  std::vector<float> sample_logits_;                     // a copy the host-side sampling may modify
  std::vector<std::pair<float, int32_t>> sample_scratch_;
  std::deque<Entry> waiting_;
  std::deque<Entry> running_;  // in admission order: the batch order
  PrefixStore store_;
  StateLog log_;
};

}  // namespace specontext
