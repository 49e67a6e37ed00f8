#include "serving/scheduler.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <tuple>

#include "core/engine/prefix_file.h"

namespace specontext {
namespace {

// A prefix file `name` read back is of this engine (Engine::kv_identity), else kDataLoss naming
// the field.
Result<PrefixFile> of_identity(PrefixFile f, uint64_t identity, const std::string& name) {
  if (f.identity != identity) {
    return data_loss("prefix file " + name + ": field 'identity' is of another model or KV layout");
  }
  return f;
}

}  // namespace

Scheduler::Scheduler(Engine& engine, const GeneratorOptions& options) : engine_(engine), options_(options) {
  if (const auto& store = options_.prefix_blob_store) {
    const uint64_t capacity = store->capacity();
    options_.prefix_disk_bytes =
        options_.prefix_disk_bytes == 0 ? capacity : std::min(options_.prefix_disk_bytes, capacity);
  }
}

Scheduler::~Scheduler() {
  for (Entry& e : running_) release(e);
  if (disk_lock_.held()) {
    persist_prefixes();
    return;
  }
  while (evict_cached(SeqId(), /*offload=*/false)) {
  }
  for (const OffloadedPrefix& p : offloaded_) {  // a store may outlive the scheduler
    if (p.blob && !p.gone) options_.prefix_blob_store->remove(*p.blob);
  }
  if (!disk_dir_.empty()) {
    std::error_code ignored;  // a destructor does not fail: what cannot be removed stays
    std::filesystem::remove_all(disk_dir_, ignored);
  }
}

uint64_t Scheduler::identity() {
  if (!identity_) identity_ = engine_.kv_identity();
  return *identity_;
}

Result<PrefixFile> Scheduler::read_own_prefix_file(const std::string& path, bool header_only) {
  SPX_ASSIGN_OR_RETURN(PrefixFile f, read_prefix_file(path, header_only));
  return of_identity(std::move(f), identity(), path);
}

Result<PrefixFile> Scheduler::read_back(const OffloadedPrefix& p) {
  std::string name = p.file;
  Result<PrefixFile> r = [&]() -> Result<PrefixFile> {
    if (!p.blob) return read_own_prefix_file(p.file, /*header_only=*/false);
    PrefixBlobStore& store = *options_.prefix_blob_store;
    name = store.name() + " blob " + std::to_string(*p.blob);
    SPX_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, store.get(*p.blob));
    SPX_ASSIGN_OR_RETURN(PrefixFile f, parse_prefix_file(bytes, name));
    return of_identity(std::move(f), identity(), name);  // a store shared by mistake
  }();
  if (r.is_ok() && r->tokens != p.tokens) {
    return data_loss("prefix file " + name + ": field 'token_ids' holds other tokens than were written");
  }
  return r;
}

Status Scheduler::write_lower(OffloadedPrefix& p, std::span<const std::byte> encoded) {
  if (const auto& store = options_.prefix_blob_store) {
    SPX_ASSIGN_OR_RETURN(const uint64_t key, store->put(encoded));
    p.blob = key;
  } else {
    const std::string path =
        (std::filesystem::path(disk_dir_) / (std::to_string(next_file_++) + ".spxprefix")).string();
    SPX_RETURN_IF_ERROR(write_prefix_file(path, encoded));
    p.file = path;
  }
  p.file_bytes = encoded.size();
  disk_bytes_ += p.file_bytes;
  return Status::ok();
}

Status Scheduler::open_prefix_disk() {
  namespace fs = std::filesystem;
  if (!options_.prefix_disk_persist || disk_lock_.held()) return Status::ok();
  if (options_.prefix_blob_store) {
    return invalid_argument("keeping prefix files across restarts needs a directory, not " +
                            options_.prefix_blob_store->name());
  }
  if (options_.prefix_disk_bytes == 0 || options_.prefix_disk_dir.empty()) {
    return invalid_argument("keeping prefix files across restarts needs a disk budget and a directory");
  }
  char name[32];
  std::snprintf(name, sizeof(name), "specontext-%016llx", static_cast<unsigned long long>(identity()));
  const fs::path dir = fs::path(options_.prefix_disk_dir) / name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return unavailable("prefix disk: cannot create " + dir.string() + ": " + ec.message());
  auto lock = FileLock::acquire((dir / "lock").string());
  if (!lock.is_ok()) {
    return unavailable("prefix disk: " + dir.string() + " is in use (" + lock.status().message() + ")");
  }
  struct Found {
    fs::file_time_type time;
    int64_t number = 0;
    OffloadedPrefix prefix;
  };
  std::vector<Found> found;
  const auto drop = [&](const fs::path& path, const std::string& why) {
    ++stats_.prefix_disk_errors;
    last_disk_error_ = why;
    fs::remove(path, ec);
  };
  std::error_code listing;
  for (fs::directory_iterator it(dir, listing), end; !listing && it != end; it.increment(listing)) {
    const fs::directory_entry& entry = *it;
    const fs::path& path = entry.path();
    if (path.extension() == ".partial") {  // a write cut short
      fs::remove(path, ec);
      continue;
    }
    if (path.extension() != ".spxprefix" || !entry.is_regular_file(ec)) continue;
    auto header = read_own_prefix_file(path.string(), /*header_only=*/true);
    if (!header.is_ok()) {
      drop(path, header.status().to_string());
      continue;
    }
    Found f;
    f.time = entry.last_write_time(ec);
    const std::string stem = path.stem().string();
    f.number = std::strtoll(stem.c_str(), nullptr, 10);
    next_file_ = std::max(next_file_, f.number + 1);
    f.prefix.tokens = std::move(header->tokens);
    f.prefix.file = path.string();
    f.prefix.file_bytes = entry.file_size(ec);
    found.push_back(std::move(f));
  }
  if (listing) return unavailable("prefix disk: cannot list " + dir.string() + ": " + listing.message());
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return std::tie(a.time, a.number) < std::tie(b.time, b.number);
  });
  disk_dir_ = dir.string();
  disk_lock_ = std::move(*lock);
  for (Found& f : found) {
    disk_bytes_ += f.prefix.file_bytes;
    offloaded_.push_back(std::move(f.prefix));
  }
  // As offload() keeps the store: no prefix that another one extends, within the budget.
  for (auto it = offloaded_.begin(); it != offloaded_.end();) {
    const bool extended = std::any_of(offloaded_.begin(), offloaded_.end(), [&](const OffloadedPrefix& o) {
      return &o != &*it && o.tokens.size() > it->tokens.size() &&
             std::equal(it->tokens.begin(), it->tokens.end(), o.tokens.begin());
    });
    if (extended || disk_bytes_ > options_.prefix_disk_bytes) {
      forget(*it, /*remove_file=*/true);
      it = offloaded_.erase(it);
      ++stats_.prefix_disk_drops;
    } else {
      ++it;
    }
  }
  stats_.prefix_disk_found = static_cast<int64_t>(offloaded_.size());
  stats_.prefix_disk_peak_bytes = static_cast<int64_t>(disk_bytes_);
  return Status::ok();
}

void Scheduler::persist_prefixes() {
  if (!disk_lock_.held()) return;
  while (evict_cached(SeqId(), /*offload=*/true)) {  // least recently used first, as in use
  }
  for (OffloadedPrefix& p : offloaded_) {
    if (!p.on_disk() && !p.gone) (void)move_to_disk(p);
  }
  // Times one millisecond apart in store order, so that the next process sorts them as this one
  // held them (a file's own time is when it was written, not when it was last used).
  const auto now = std::filesystem::file_time_type::clock::now();
  std::chrono::milliseconds step{0};
  for (const OffloadedPrefix& p : offloaded_) {
    if (!p.on_disk() || p.gone) continue;
    std::error_code ignored;
    std::filesystem::last_write_time(p.file, now + step, ignored);
    step += std::chrono::milliseconds(1);
  }
}

size_t Scheduler::offloaded_prefixes() const {
  return static_cast<size_t>(
      std::count_if(offloaded_.begin(), offloaded_.end(), [](const OffloadedPrefix& p) { return !p.on_disk(); }));
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
  waiting_.push_back(std::move(e));
  return waiting_.back().id;
}

bool Scheduler::cancel(RequestId id, bool keep_cached) {
  auto match = [id](const Entry& e) { return e.id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), match); it != waiting_.end()) {
    waiting_.erase(it);
    return true;
  }
  if (auto it = std::find_if(running_.begin(), running_.end(), match); it != running_.end()) {
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
  if (e.seq.valid()) (void)engine_.remove_sequence(e.seq);
  e.seq = SeqId();
}

void Scheduler::cache_or_release(Entry& e) {
  const int64_t length = e.seq.valid() ? engine_.sequence_length(e.seq) : 0;
  if (!options_.prefix_caching || length == 0 || e.request.synthetic_context > 0) {
    release(e);
    return;
  }
  (void)engine_.release_working_sets(e.seq);  // device memory a waiting sequence does not use
  CachedSequence c{e.seq, {}};
  c.tokens.assign(e.request.prompt.begin(),
                  e.request.prompt.begin() + static_cast<std::ptrdiff_t>(e.prompt_size));
  c.tokens.insert(c.tokens.end(), e.produced.begin(), e.produced.end());
  c.tokens.resize(std::min(c.tokens.size(), static_cast<size_t>(length)));  // the last token was never fed
  cached_.push_back(std::move(c));
  e.seq = SeqId();
}

bool Scheduler::evict_cached(SeqId keep, bool offload_it) {
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    // `keep` goes last, and only when nothing is running (else waiting lets that finish).
    if (it->seq == keep && (cached_.size() > 1 || !running_.empty())) continue;
    if (offload_it) offload(*it);
    (void)engine_.remove_sequence(it->seq);
    cached_.erase(it);
    ++stats_.prefix_cache_evictions;
    return true;
  }
  return false;
}

bool Scheduler::offload(const CachedSequence& c) {
  if (options_.prefix_offload_bytes == 0 && options_.prefix_disk_bytes == 0) return false;
  const int64_t unit = engine_.fork_granularity();
  const int64_t whole = static_cast<int64_t>(c.tokens.size()) / unit * unit;
  if (whole == 0) return false;
  const std::span<const TokenId> tokens(c.tokens.data(), static_cast<size_t>(whole));
  auto starts = [](std::span<const TokenId> longer, std::span<const TokenId> shorter) {
    return shorter.size() <= longer.size() && std::equal(shorter.begin(), shorter.end(), longer.begin());
  };
  for (auto it = offloaded_.begin(); it != offloaded_.end();) {
    if (starts(it->tokens, tokens)) {
      // An offloaded prefix holds these tokens already: it becomes the most recently used.
      OffloadedPrefix kept = std::move(*it);
      offloaded_.erase(it);
      offloaded_.push_back(std::move(kept));
      return true;
    }
    if (starts(tokens, it->tokens)) {  // extended by this one
      ++(it->on_disk() ? stats_.prefix_disk_drops : stats_.prefix_offload_drops);
      forget(*it, /*remove_file=*/true);
      it = offloaded_.erase(it);
    } else {
      ++it;
    }
  }
  auto snapshot = engine_.export_prefix(c.seq, whole);
  if (!snapshot.is_ok()) return false;
  OffloadedPrefix p;
  p.tokens.assign(tokens.begin(), tokens.end());
  p.snapshot = std::move(*snapshot);
  if (p.snapshot.bytes() > options_.prefix_offload_bytes) {
    // Larger than host memory allows: straight to disk, or not kept.
    if (!write_to_disk(p)) {
      settle_offloaded();  // files it removed for room are erased
      return false;
    }
    p.snapshot = PrefixSnapshot();
  } else {
    offloaded_bytes_ += p.snapshot.bytes();
    ++stats_.prefix_offloads;
  }
  offloaded_.push_back(std::move(p));
  settle_offloaded();  // older ones give way: this one is within the budget alone
  return true;
}

bool Scheduler::write_to_disk(OffloadedPrefix& p) {
  if (options_.prefix_disk_bytes == 0) return false;
  const auto fail = [&](const std::string& why) {
    ++stats_.prefix_disk_errors;
    last_disk_error_ = why;
    return false;
  };
  if (options_.prefix_disk_persist && !disk_lock_.held()) {
    return fail("prefix disk: the persistent directory was not opened (Scheduler::open_prefix_disk)");
  }
  if (disk_dir_.empty() && !options_.prefix_blob_store) {
    std::error_code ec;
    const std::filesystem::path base = options_.prefix_disk_dir.empty()
                                           ? std::filesystem::temp_directory_path(ec)
                                           : std::filesystem::path(options_.prefix_disk_dir);
    if (ec) return fail("prefix disk: no temporary directory: " + ec.message());
    std::string pattern = (base / "specontext-prefixes-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      return fail("prefix disk: cannot create a directory under " + base.string() + ": " + std::strerror(errno));
    }
    disk_dir_ = pattern;
  }
  const std::vector<std::byte> bytes = encode_prefix_file(p.tokens, p.snapshot, identity());
  if (bytes.size() > options_.prefix_disk_bytes) return false;  // could never fit
  // Room first, least recently used files out, so that the disk never holds more than its
  // budget. They are marked gone (settle_offloaded erases them): p may be in offloaded_.
  const auto drop_oldest = [&] {
    for (OffloadedPrefix& old : offloaded_) {
      if (&old == &p || !old.on_disk() || old.gone) continue;
      forget(old, /*remove_file=*/true);
      old.gone = true;
      ++stats_.prefix_disk_drops;
      return true;
    }
    return false;
  };
  while (disk_bytes_ + bytes.size() > options_.prefix_disk_bytes && drop_oldest()) {
  }
  if (disk_bytes_ + bytes.size() > options_.prefix_disk_bytes) return false;  // held by a file being read back
  Status st = write_lower(p, bytes);
  // A blob store's free space may be in pieces too small for it: older ones out until it fits.
  while (st.code() == StatusCode::kResourceExhausted && drop_oldest()) st = write_lower(p, bytes);
  if (st.code() == StatusCode::kResourceExhausted) return false;
  if (!st.is_ok()) return fail(st.to_string());
  ++stats_.prefix_disk_writes;
  stats_.prefix_disk_peak_bytes = std::max(stats_.prefix_disk_peak_bytes, static_cast<int64_t>(disk_bytes_));
  return true;
}

bool Scheduler::move_to_disk(OffloadedPrefix& p) {
  const uint64_t held = p.snapshot.bytes();
  if (!write_to_disk(p)) return false;
  offloaded_bytes_ -= held;
  p.snapshot = PrefixSnapshot();
  return true;
}

void Scheduler::forget(const OffloadedPrefix& p, bool remove_file) {
  if (p.on_disk()) {
    disk_bytes_ -= p.file_bytes;
    if (remove_file && p.blob) {
      options_.prefix_blob_store->remove(*p.blob);
    } else if (remove_file) {
      std::remove(p.file.c_str());
    }
  } else {
    offloaded_bytes_ -= p.snapshot.bytes();
  }
}

void Scheduler::settle_offloaded() {
  const auto sweep = [&] { std::erase_if(offloaded_, [](const OffloadedPrefix& p) { return p.gone; }); };
  while (offloaded_bytes_ > options_.prefix_offload_bytes) {
    auto it = std::find_if(offloaded_.begin(), offloaded_.end(), [](const OffloadedPrefix& p) { return !p.on_disk(); });
    if (move_to_disk(*it)) {
      sweep();
    } else {
      forget(*it, /*remove_file=*/false);
      offloaded_.erase(it);
      ++stats_.prefix_offload_drops;
    }
  }
  sweep();
  stats_.prefix_offload_peak_bytes =
      std::max(stats_.prefix_offload_peak_bytes, static_cast<int64_t>(offloaded_bytes_));
}

bool Scheduler::restore_offloaded(size_t index) {
  // Out of the store while cached sequences are evicted (and offloaded) for its room. A file
  // keeps counting against the disk while it is read back.
  OffloadedPrefix p = std::move(offloaded_[index]);
  offloaded_.erase(offloaded_.begin() + static_cast<std::ptrdiff_t>(index));
  PrefixFile read;
  const PrefixSnapshot* snapshot = &p.snapshot;
  if (p.on_disk()) {
    auto r = read_back(p);
    if (!r.is_ok()) {  // the request computes its prompt instead
      ++stats_.prefix_disk_errors;
      last_disk_error_ = r.status().to_string();
      forget(p, /*remove_file=*/true);
      return false;
    }
    read = std::move(*r);
    snapshot = &read.snapshot;
  } else {
    forget(p, /*remove_file=*/false);
  }
  while (true) {
    auto seq = engine_.import_prefix(*snapshot);
    if (seq.is_ok()) {
      (void)engine_.release_working_sets(*seq);  // it waits, as a cached sequence does
      ++stats_.prefix_restores;
      if (p.on_disk()) {
        ++stats_.prefix_disk_restores;
        forget(p, /*remove_file=*/true);
      }
      cached_.push_back({*seq, std::move(p.tokens)});
      return true;
    }
    if (seq.status().code() == StatusCode::kResourceExhausted && evict_cached()) continue;
    break;
  }
  // Back in the store as the most recently used (a file stays where it is).
  if (!p.on_disk()) offloaded_bytes_ += p.snapshot.bytes();
  offloaded_.push_back(std::move(p));
  settle_offloaded();
  return false;
}

void Scheduler::finish(Entry& e, FinishReason reason, std::string error,
                       std::vector<SchedulerEvent>& events) {
  e.done = true;
  if (reason == FinishReason::kLength || reason == FinishReason::kStop || reason == FinishReason::kContext) {
    cache_or_release(e);
  } else {
    release(e);  // a failed step's sequence is not trusted
  }
  push_event(e, {e.id, -1, true, reason, std::move(error), std::nullopt, {}}, events);
}

bool Scheduler::forks(const Entry& e) const {
  return options_.prefix_caching && engine_.can_fork() && e.request.synthetic_context == 0 &&
         !wants_prompt_logprobs(e);
}

Scheduler::PrefixSource Scheduler::find_prefix(const Entry& e) const {
  // The longest shared prefix in whole fork units, short of the prompt's last token (whose logits
  // are needed): over the running requests' caches and the cached finished ones; `pending` also
  // counts what running requests still prefilling will have cached.
  const std::vector<TokenId>& prompt = e.request.prompt;
  const int64_t unit = engine_.fork_granularity();
  const auto limit = static_cast<int64_t>(prompt.size()) - 1;
  auto usable = [&](int64_t cached, auto&& token_at) {
    const int64_t cap = std::min(cached, limit);
    int64_t k = 0;
    while (k < cap && token_at(k) == prompt[static_cast<size_t>(k)]) ++k;
    return k / unit * unit;
  };
  PrefixSource best;
  for (const Entry& r : running_) {
    if (!r.seq.valid() || r.request.synthetic_context > 0) continue;
    auto token_at = [&](int64_t k) {
      const auto i = static_cast<size_t>(k);
      return i < r.prompt_size ? r.request.prompt[i] : r.produced[i - r.prompt_size];
    };
    const int64_t now = usable(engine_.sequence_length(r.seq), token_at);
    if (now > best.tokens) best.tokens = now, best.seq = r.seq, best.from_cache.reset();
    const auto will_have = static_cast<int64_t>(r.prompt_size + r.produced.size());
    best.pending = std::max(best.pending, usable(will_have, token_at));
  }
  for (size_t c = 0; c < cached_.size(); ++c) {
    const std::vector<TokenId>& tokens = cached_[c].tokens;
    const int64_t m = usable(static_cast<int64_t>(tokens.size()),
                             [&](int64_t k) { return tokens[static_cast<size_t>(k)]; });
    if (m > best.tokens) best.tokens = m, best.seq = cached_[c].seq, best.from_cache = c;
  }
  best.pending = std::max(best.pending, best.tokens);
  int64_t offloaded_best = best.pending;
  for (size_t o = 0; o < offloaded_.size(); ++o) {
    const std::vector<TokenId>& tokens = offloaded_[o].tokens;
    const int64_t m = usable(static_cast<int64_t>(tokens.size()),
                             [&](int64_t k) { return tokens[static_cast<size_t>(k)]; });
    if (m > offloaded_best) offloaded_best = m, best.from_offload = o;
  }
  if (best.from_cache) {
    const int64_t whole = static_cast<int64_t>(cached_[*best.from_cache].tokens.size()) / unit * unit;
    best.supersedes = best.tokens == whole;
  }
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
    const auto at = cached_.begin() + static_cast<std::ptrdiff_t>(*best.from_cache);
    if (!engine_.truncate_sequence(at->seq, best.tokens, promised).is_ok()) return std::nullopt;
    const SeqId seq = at->seq;
    cached_.erase(at);
    took(best.tokens);
    return seq;
  };
  // The request would take every whole page of it, and forks only ever take whole pages (the
  // next turn of a conversation): it takes the sequence over.
  if (best.tokens > 0 && best.from_cache && best.supersedes) {
    if (auto seq = take_over()) return *seq;
  }
  if (best.tokens > 0) {
    auto fork = engine_.fork_sequence(best.seq, best.tokens, promised);
    // No slot for a fork, and the source is the only cached sequence left to give way (one slot,
    // as in `generate`): evicted, it would take the prefix with it. Its longer tokens go to the
    // offload store, when there is one, and the request takes the rest over.
    if (!fork.is_ok() && fork.status().code() == StatusCode::kResourceExhausted && best.from_cache &&
        cached_.size() == 1) {
      (void)offload(cached_.front());
      if (auto seq = take_over()) return *seq;
    }
    if (fork.is_ok()) {
      if (best.from_cache) {  // now the most recently used
        const auto at = cached_.begin() + static_cast<std::ptrdiff_t>(*best.from_cache);
        CachedSequence used = std::move(*at);
        cached_.erase(at);
        cached_.push_back(std::move(used));
      }
      took(best.tokens);
      return fork;
    }
    // Out of slots: the caller makes room or waits. Anything else: compute the prompt instead.
    if (fork.status().code() == StatusCode::kResourceExhausted) return fork.status();
  }
  return engine_.add_sequence(promised);
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
    const bool others = engine_.live_sequences() > 0;
    // A running request is still computing more of this prompt than any cache holds (the n
    // choices of one request, the same prompt sent twice at once): wait for it, then fork.
    PrefixSource source = forks(e) ? find_prefix(e) : PrefixSource{};
    // An offloaded prefix longer than any the cache has or will have: back into the cache, then
    // look again (it is found there). Failing, it may have evicted the source found.
    // Under kPreempt, not before its prompt fits beside the running requests: restored while it
    // still waits, the prefix would be evicted again (and offloaded again) before it is used.
    if (source.from_offload && options_.admission == AdmissionPolicy::kPreempt && others &&
        !engine_.fits(near_lengths(SeqId(), /*without_cached=*/true), near_length(e, r.synthetic_context))
             .is_ok()) {
      break;
    }
    if (source.from_offload && restored_for != e.id && restore_offloaded(*source.from_offload)) {
      restored_for = e.id;
      continue;
    }
    if (source.from_offload) {
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
      if (seq.status().code() == StatusCode::kResourceExhausted && engine_.live_sequences() > 0) break;
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
  lens.reserve(running_.size() + cached_.size());
  for (const Entry& e : running_) lens.push_back(near_length(e, engine_.sequence_length(e.seq)));
  for (const CachedSequence& c : cached_) {
    lens.push_back(c.seq == taken_over || without_cached ? 0 : engine_.sequence_length(c.seq));
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
  return options_.swap_preempted && e.seq.valid() && forks(e) &&
         (options_.prefix_offload_bytes > 0 || options_.prefix_disk_bytes > 0);
}

void Scheduler::swap_out(const Entry& e) {
  // What its cache holds: the prompt as submitted, then its tokens (the last one not yet fed).
  CachedSequence c{e.seq, {}};
  c.tokens.assign(e.request.prompt.begin(),
                  e.request.prompt.begin() + static_cast<std::ptrdiff_t>(e.prompt_size));
  c.tokens.insert(c.tokens.end(), e.produced.begin(), e.produced.end());
  c.tokens.resize(std::min(c.tokens.size(), static_cast<size_t>(engine_.sequence_length(e.seq))));
  if (offload(c)) ++stats_.preemption_swaps;
}

void Scheduler::requeue(Entry e) {
  release(e);
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
  while (evict_cached(SeqId(), /*offload=*/false)) {  // their KV is partly gone; offloaded prefixes stay
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
      if (!e->done) finish(*e, FinishReason::kError, out.status().message(), events);
    }
    std::erase_if(running_, [](const Entry& e) { return e.done; });
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
    } else if (engine_.sequence_length(e.seq) + 1 > engine_.max_context()) {
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
  stats_.kv_bytes_peak = std::max(stats_.kv_bytes_peak, engine_.kv_bytes_in_use());
  std::erase_if(running_, [](const Entry& e) { return e.done; });
  return status;
}

}  // namespace specontext
