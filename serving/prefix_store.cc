#include "serving/prefix_store.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <tuple>

#include "core/engine/prefix_chunk.h"

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

bool starts_with(std::span<const TokenId> longer, std::span<const TokenId> shorter) {
  return shorter.size() <= longer.size() && std::equal(shorter.begin(), shorter.end(), longer.begin());
}

}  // namespace

PrefixStore::PrefixStore(Engine& engine, PrefixStoreOptions options)
    : engine_(engine), options_(std::move(options)) {
  if (const auto& store = options_.blob_store) {
    const uint64_t capacity = store->capacity();
    options_.lower_bytes = options_.lower_bytes == 0 ? capacity : std::min(options_.lower_bytes, capacity);
  }
  // The shared store's keys need the identity (a hash of every weight: about a second per GB):
  // computed now, with the scheduler (serve: at start), not in the first request's time to its
  // first token.
  if (options_.shared_store) (void)identity();
}

PrefixStore::~PrefixStore() {
  if (disk_lock_.held()) {
    persist();
    return;
  }
  while (evict(SeqId(), /*keep_may_go=*/true, /*offload=*/false)) {
  }
  for (const Stored& p : stored_) {  // a blob store may outlive the store
    if (p.blob && p.state != RequestState::kDropped) options_.blob_store->remove(*p.blob);
  }
  if (!disk_dir_.empty()) {
    std::error_code ignored;  // what cannot be removed stays
    std::filesystem::remove_all(disk_dir_, ignored);
  }
}

void PrefixStore::move(RequestState& state, RequestState to) {
  const Status st = log_.move(state, to);
  SPX_ASSERT(st.is_ok());
  (void)st;
}

uint64_t PrefixStore::identity() {
  if (!identity_) identity_ = engine_.kv_identity();
  return *identity_;
}

Result<PrefixFile> PrefixStore::read_own_file(const std::string& path, bool header_only) {
  SPX_ASSIGN_OR_RETURN(PrefixFile f, read_prefix_file(path, header_only));
  return of_identity(std::move(f), identity(), path);
}

Result<PrefixFile> PrefixStore::read_back(const Stored& p) {
  std::string name = p.file;
  Result<PrefixFile> r = [&]() -> Result<PrefixFile> {
    if (!p.blob) return read_own_file(p.file, /*header_only=*/false);
    PrefixBlobStore& store = *options_.blob_store;
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

Status PrefixStore::put_lower(Stored& p, std::span<const std::byte> encoded) {
  if (const auto& store = options_.blob_store) {
    SPX_ASSIGN_OR_RETURN(const uint64_t key, store->put(encoded));
    p.blob = key;
  } else {
    const std::string path =
        (std::filesystem::path(disk_dir_) / (std::to_string(next_file_++) + ".spxprefix")).string();
    SPX_RETURN_IF_ERROR(write_prefix_file(path, encoded));
    p.file = path;
  }
  p.file_bytes = encoded.size();
  lower_bytes_ += p.file_bytes;
  move(p.state, p.blob ? RequestState::kOnNode : RequestState::kOnDisk);
  return Status::ok();
}

Status PrefixStore::open_disk() {
  namespace fs = std::filesystem;
  if (!options_.persist || disk_lock_.held()) return Status::ok();
  if (options_.blob_store) {
    return invalid_argument("keeping prefix files across restarts needs a directory, not " +
                            options_.blob_store->name());
  }
  if (options_.lower_bytes == 0 || options_.disk_dir.empty()) {
    return invalid_argument("keeping prefix files across restarts needs a disk budget and a directory");
  }
  char name[32];
  std::snprintf(name, sizeof(name), "specontext-%016llx", static_cast<unsigned long long>(identity()));
  const fs::path dir = fs::path(options_.disk_dir) / name;
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
    Stored prefix;
  };
  std::vector<Found> found;
  std::error_code listing;
  for (fs::directory_iterator it(dir, listing), end; !listing && it != end; it.increment(listing)) {
    const fs::directory_entry& entry = *it;
    const fs::path& path = entry.path();
    if (path.extension() == ".partial") {  // a write cut short
      fs::remove(path, ec);
      continue;
    }
    if (path.extension() != ".spxprefix" || !entry.is_regular_file(ec)) continue;
    auto header = read_own_file(path.string(), /*header_only=*/true);
    if (!header.is_ok()) {
      (void)lower_error(header.status().to_string());
      fs::remove(path, ec);
      continue;
    }
    Found f;
    f.time = entry.last_write_time(ec);
    f.number = std::strtoll(path.stem().string().c_str(), nullptr, 10);
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
    lower_bytes_ += f.prefix.file_bytes;
    move(f.prefix.state, RequestState::kOnDisk);
    stored_.push_back(std::move(f.prefix));
  }
  drop_extended();
  stats_.prefix_disk_found = static_cast<int64_t>(stored_.size());
  stats_.prefix_disk_peak_bytes = static_cast<int64_t>(lower_bytes_);
  return Status::ok();
}

void PrefixStore::drop_extended() {
  // As offload() keeps the store: no prefix that another one extends, within the budget.
  for (auto it = stored_.begin(); it != stored_.end();) {
    const bool extended = std::any_of(stored_.begin(), stored_.end(), [&](const Stored& o) {
      return &o != &*it && o.tokens.size() > it->tokens.size() && starts_with(o.tokens, it->tokens);
    });
    if (extended || lower_bytes_ > options_.lower_bytes) {
      drop(*it, /*remove_file=*/true);
      it = stored_.erase(it);
      ++stats_.prefix_disk_drops;
    } else {
      ++it;
    }
  }
}

void PrefixStore::persist() {
  if (!disk_lock_.held()) return;
  while (evict(SeqId(), /*keep_may_go=*/true, /*offload=*/true)) {  // least recently used first, as in use
  }
  for (Stored& p : stored_) {
    if (!p.lower() && p.state != RequestState::kDropped) (void)move_lower(p);
  }
  // Times one millisecond apart in store order, so that the next process sorts them as this one
  // held them (a file's own time is when it was written, not when it was last used).
  const auto now = std::filesystem::file_time_type::clock::now();
  std::chrono::milliseconds step{0};
  for (const Stored& p : stored_) {
    if (!p.lower() || p.state == RequestState::kDropped) continue;
    std::error_code ignored;
    std::filesystem::last_write_time(p.file, now + step, ignored);
    step += std::chrono::milliseconds(1);
  }
}

size_t PrefixStore::offloaded_prefixes() const {
  return static_cast<size_t>(
      std::count_if(stored_.begin(), stored_.end(), [](const Stored& p) { return !p.lower(); }));
}

void PrefixStore::insert(SeqId seq, std::vector<TokenId> tokens, RequestState from) {
  (void)engine_.memory().release_working_sets(seq);  // device memory a waiting sequence does not use
  move(from, RequestState::kCached);
  cached_.push_back({seq, std::move(tokens)});
}

bool PrefixStore::evict(SeqId keep, bool keep_may_go, bool offload_it) {
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    // `keep` goes last, and only when the caller lets it.
    if (it->seq == keep && (cached_.size() > 1 || !keep_may_go)) continue;
    if (!(offload_it && offload(it->seq, it->tokens, RequestState::kCached))) {
      RequestState state = RequestState::kCached;
      move(state, RequestState::kDropped);
    }
    (void)engine_.memory().remove_sequence(it->seq);
    cached_.erase(it);
    ++stats_.prefix_cache_evictions;
    return true;
  }
  return false;
}

std::optional<SeqId> PrefixStore::take(SeqId seq, int64_t tokens, int64_t promised) {
  const auto at = std::find_if(cached_.begin(), cached_.end(), [&](const Cached& c) { return c.seq == seq; });
  if (at == cached_.end() || !engine_.memory().truncate_sequence(seq, tokens, promised).is_ok())
    return std::nullopt;
  cached_.erase(at);
  RequestState state = RequestState::kCached;
  move(state, RequestState::kPrefilling);
  return seq;
}

void PrefixStore::touch(SeqId seq) {
  const auto at = std::find_if(cached_.begin(), cached_.end(), [&](const Cached& c) { return c.seq == seq; });
  if (at == cached_.end()) return;
  Cached used = std::move(*at);
  cached_.erase(at);
  cached_.push_back(std::move(used));
}

PrefixStore::Match PrefixStore::longest_cached(std::span<const TokenId> want, int64_t floor) const {
  const int64_t unit = engine_.memory().fork_granularity();
  Match best;
  best.tokens = floor;
  for (const Cached& c : cached_) {
    const int64_t m = shared_units(want, static_cast<int64_t>(c.tokens.size()), unit,
                                   [&](int64_t k) { return c.tokens[static_cast<size_t>(k)]; });
    if (m > best.tokens) {
      best.tokens = m;
      best.seq = c.seq;
      best.whole = m == static_cast<int64_t>(c.tokens.size()) / unit * unit;
    }
  }
  if (!best.seq.valid()) best.tokens = 0;
  return best;
}

std::optional<size_t> PrefixStore::longest_stored(std::span<const TokenId> want, int64_t floor) const {
  const int64_t unit = engine_.memory().fork_granularity();
  std::optional<size_t> best;
  for (size_t o = 0; o < stored_.size(); ++o) {
    const std::vector<TokenId>& tokens = stored_[o].tokens;
    const int64_t m = shared_units(want, static_cast<int64_t>(tokens.size()), unit,
                                   [&](int64_t k) { return tokens[static_cast<size_t>(k)]; });
    if (m > floor) floor = m, best = o;
  }
  return best;
}

bool PrefixStore::offload(SeqId seq, std::span<const TokenId> all, RequestState from) {
  if (!has_levels()) return false;
  const int64_t unit = engine_.memory().fork_granularity();
  const int64_t whole = static_cast<int64_t>(all.size()) / unit * unit;
  if (whole == 0) return false;
  const std::span<const TokenId> tokens = all.first(static_cast<size_t>(whole));
  for (auto it = stored_.begin(); it != stored_.end();) {
    if (starts_with(it->tokens, tokens)) {
      // A stored prefix holds these tokens already: it becomes the most recently used.
      Stored kept = std::move(*it);
      stored_.erase(it);
      RequestState state = from;
      move(state, kept.state);
      stored_.push_back(std::move(kept));
      return true;
    }
    if (starts_with(tokens, it->tokens)) {  // extended by this one
      ++(it->lower() ? stats_.prefix_disk_drops : stats_.prefix_offload_drops);
      drop(*it, /*remove_file=*/true);
      it = stored_.erase(it);
    } else {
      ++it;
    }
  }
  auto snapshot = engine_.memory().export_prefix(seq, whole);
  if (!snapshot.is_ok()) return false;
  Stored p;
  p.tokens.assign(tokens.begin(), tokens.end());
  p.snapshot = std::move(*snapshot);
  p.state = from;
  if (p.snapshot.bytes() > options_.host_bytes) {
    // Larger than host memory allows: straight to the lower level, or not kept.
    if (!write_lower(p)) {
      settle();  // files it removed for room are erased
      return false;
    }
    p.snapshot = PrefixSnapshot();
  } else {
    host_bytes_ += p.snapshot.bytes();
    ++stats_.prefix_offloads;
    move(p.state, RequestState::kOffloaded);
  }
  stored_.push_back(std::move(p));
  settle();  // older ones give way: this one is within the budget alone
  return true;
}

bool PrefixStore::lower_error(const std::string& why) {
  ++stats_.prefix_disk_errors;
  last_error_ = why;
  return false;
}

Status PrefixStore::make_temp_dir() {
  std::error_code ec;
  const std::filesystem::path base = options_.disk_dir.empty() ? std::filesystem::temp_directory_path(ec)
                                                               : std::filesystem::path(options_.disk_dir);
  if (ec) return unavailable("prefix disk: no temporary directory: " + ec.message());
  std::string pattern = (base / "specontext-prefixes-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return unavailable("prefix disk: cannot create a directory under " + base.string() + ": " +
                       std::strerror(errno));
  }
  disk_dir_ = pattern;
  return Status::ok();
}

bool PrefixStore::write_lower(Stored& p) {
  if (options_.lower_bytes == 0) return false;
  if (options_.persist && !disk_lock_.held()) {
    return lower_error("prefix disk: the persistent directory was not opened (Scheduler::open_prefix_disk)");
  }
  if (disk_dir_.empty() && !options_.blob_store) {
    if (Status st = make_temp_dir(); !st.is_ok()) return lower_error(st.message());
  }
  const std::vector<std::byte> bytes = encode_prefix_file(p.tokens, p.snapshot, identity());
  if (bytes.size() > options_.lower_bytes) return false;  // could never fit
  // Room first, least recently used ones out, so that the level never holds more than its
  // budget. They are marked dropped (settle erases them): p may be in stored_.
  const auto drop_oldest = [&] {
    for (Stored& old : stored_) {
      if (&old == &p || !old.lower() || old.state == RequestState::kDropped) continue;
      drop(old, /*remove_file=*/true);
      ++stats_.prefix_disk_drops;
      return true;
    }
    return false;
  };
  while (lower_bytes_ + bytes.size() > options_.lower_bytes && drop_oldest()) {
  }
  if (lower_bytes_ + bytes.size() > options_.lower_bytes) return false;  // held by a file being read back
  Status st = put_lower(p, bytes);
  // A blob store's free space may be in pieces too small for it: older ones out until it fits.
  while (st.code() == StatusCode::kResourceExhausted && drop_oldest()) st = put_lower(p, bytes);
  if (st.code() == StatusCode::kResourceExhausted) return false;
  if (!st.is_ok()) return lower_error(st.to_string());
  ++stats_.prefix_disk_writes;
  stats_.prefix_disk_peak_bytes = std::max(stats_.prefix_disk_peak_bytes, static_cast<int64_t>(lower_bytes_));
  return true;
}

bool PrefixStore::move_lower(Stored& p) {
  const uint64_t held = p.snapshot.bytes();
  if (!write_lower(p)) return false;
  host_bytes_ -= held;
  p.snapshot = PrefixSnapshot();
  return true;
}

void PrefixStore::forget(const Stored& p, bool remove_file) {
  if (p.lower()) {
    lower_bytes_ -= p.file_bytes;
    if (remove_file && p.blob) {
      options_.blob_store->remove(*p.blob);
    } else if (remove_file) {
      std::remove(p.file.c_str());
    }
  } else {
    host_bytes_ -= p.snapshot.bytes();
  }
}

void PrefixStore::drop(Stored& p, bool remove_file) {
  forget(p, remove_file);
  move(p.state, RequestState::kDropped);
}

void PrefixStore::settle() {
  const auto sweep = [&] {
    std::erase_if(stored_, [](const Stored& p) { return p.state == RequestState::kDropped; });
  };
  while (host_bytes_ > options_.host_bytes) {
    auto it = std::find_if(stored_.begin(), stored_.end(), [](const Stored& p) { return !p.lower(); });
    if (move_lower(*it)) {
      sweep();
    } else {
      drop(*it, /*remove_file=*/false);
      stored_.erase(it);
      ++stats_.prefix_offload_drops;
    }
  }
  sweep();
  stats_.prefix_offload_peak_bytes =
      std::max(stats_.prefix_offload_peak_bytes, static_cast<int64_t>(host_bytes_));
}

bool PrefixStore::restore(size_t index) {
  // Out of the store while cached sequences are evicted (and offloaded) for its room. A file
  // keeps counting against the lower level while it is read back.
  Stored p = std::move(stored_[index]);
  stored_.erase(stored_.begin() + static_cast<std::ptrdiff_t>(index));
  PrefixFile read;
  const PrefixSnapshot* snapshot = &p.snapshot;
  if (p.lower()) {
    auto r = read_back(p);
    if (!r.is_ok()) {  // the request computes its prompt instead
      (void)lower_error(r.status().to_string());
      drop(p, /*remove_file=*/true);
      return false;
    }
    read = std::move(*r);
    snapshot = &read.snapshot;
  } else {
    forget(p, /*remove_file=*/false);
  }
  if (const std::optional<SeqId> seq = import_evicting(*snapshot)) {
    ++stats_.prefix_restores;
    if (p.lower()) {
      ++stats_.prefix_disk_restores;
      forget(p, /*remove_file=*/true);
    }
    move(p.state, RequestState::kCached);
    cached_.push_back({*seq, std::move(p.tokens)});
    return true;
  }
  // Back in the store as the most recently used (a file stays where it is).
  if (!p.lower()) host_bytes_ += p.snapshot.bytes();
  stored_.push_back(std::move(p));
  settle();
  return false;
}

std::optional<SeqId> PrefixStore::import_evicting(const PrefixSnapshot& snapshot, SeqId after,
                                                  int64_t after_tokens) {
  while (true) {
    auto seq = after.valid() ? engine_.memory().import_prefix_after(after, after_tokens, snapshot)
                             : engine_.memory().import_prefix(snapshot);
    if (seq.is_ok()) {
      (void)engine_.memory().release_working_sets(*seq);  // it waits, as a cached sequence does
      return *seq;
    }
    if (seq.status().code() == StatusCode::kResourceExhausted && evict(after, /*keep_may_go=*/!after.valid())) {
      continue;
    }
    return std::nullopt;
  }
}

bool PrefixStore::shared_error(const std::string& why) {
  ++stats_.prefix_shared_errors;
  last_shared_error_ = why;
  return false;
}

int64_t PrefixStore::shared_chunk_tokens() const {
  const int64_t unit = engine_.memory().fork_granularity();
  const int64_t want = std::max<int64_t>(options_.shared_chunk_tokens, 1);
  return (want + unit - 1) / unit * unit;
}

namespace {

// The retrieval head's key block (KvMemory::head_block_tokens: the budget under SpeContext).
int64_t head_block_tokens(const Engine& engine) {
  const SparseOptions& s = engine.sparse_options();
  return s.method == SparseMethod::kSpeContext ? s.selection.budget : 0;
}

}  // namespace

bool PrefixStore::publish(SeqId seq, std::span<const TokenId> tokens) {
  SharedPrefixStore* store = options_.shared_store.get();
  if (store == nullptr || !seq.valid()) return false;
  const int64_t unit = engine_.memory().fork_granularity();
  const int64_t held = std::min(static_cast<int64_t>(tokens.size()), engine_.memory().sequence_length(seq));
  const int64_t whole = held / unit * unit;
  if (whole == 0) return false;
  const std::span<const TokenId> prefix = tokens.first(static_cast<size_t>(whole));
  const int64_t chunk = shared_chunk_tokens();
  // Its chunks' keys: every whole chunk, and the last (shorter) one ending at `whole`.
  const std::vector<PrefixKey> keys = prefix_keys(identity(), prefix, unit, whole - 1, chunk);
  const auto held_already = store->contains(keys);
  if (!held_already.is_ok()) return shared_error(held_already.status().to_string());
  if (held_already->size() != keys.size())
    return shared_error(store->name() + ": contains answered another count");
  const auto missing = static_cast<int64_t>(std::count(held_already->begin(), held_already->end(), false));
  stats_.prefix_shared_chunks_skipped += static_cast<int64_t>(keys.size()) - missing;
  if (missing == 0) return false;
  auto snapshot = engine_.memory().export_prefix(seq, whole);
  if (!snapshot.is_ok()) return shared_error(snapshot.status().to_string());
  probe_.reset();  // a miss asked about may be there now
  bool wrote = false;
  for (size_t k = 0; k < keys.size(); ++k) {
    if ((*held_already)[k]) continue;
    const int64_t start = k == 0 ? 0 : keys[k - 1].tokens;
    auto piece = cut_prefix_chunk(prefix, *snapshot, identity(), chunk, start, keys[k].tokens,
                                  head_block_tokens(engine_));
    if (!piece.is_ok()) return shared_error(piece.status().to_string());
    const std::vector<std::byte> bytes = encode_prefix_chunk(*piece);
    if (Status st = store->put(keys[k], bytes); !st.is_ok()) return shared_error(st.to_string());
    ++stats_.prefix_shared_chunks_written;
    stats_.prefix_shared_bytes_written += static_cast<int64_t>(bytes.size());
    if (!wrote) ++stats_.prefix_shared_writes;
    wrote = true;
  }
  return wrote;
}

int64_t PrefixStore::find_shared(std::span<const TokenId> want, int64_t floor) {
  SharedPrefixStore* store = options_.shared_store.get();
  if (store == nullptr) return 0;
  const Probe question{prefix_key(0, want).token_hash, want.size(), floor, 0};
  if (probe_ && probe_->want_hash == question.want_hash && probe_->want_size == question.want_size &&
      probe_->floor == question.floor) {
    return probe_->found;
  }
  const int64_t chunk = shared_chunk_tokens();
  const std::vector<PrefixKey> keys =
      prefix_keys(identity(), want, engine_.memory().fork_granularity(), floor, chunk);
  if (keys.empty()) return 0;
  const auto held = store->contains(keys);
  if (!held.is_ok() || held->size() != keys.size()) {
    (void)shared_error(held.is_ok() ? store->name() + ": contains answered another count"
                                    : held.status().to_string());
    ++stats_.prefix_shared_misses;
    return 0;  // asked again next time: the store may be back
  }
  probe_ = question;
  // A prefix is there when the chunk ending at it and every whole chunk before it are: the run
  // from token 0 stops at the first whole chunk missing.
  bool whole_chunks = true;
  for (size_t k = 0; k < keys.size(); ++k) {
    const int64_t n = keys[k].tokens;
    const bool there = whole_chunks && (*held)[k];
    if (n % chunk == 0) whole_chunks = there;
    if (there && n > floor) probe_->found = n;
  }
  if (probe_->found == 0) ++stats_.prefix_shared_misses;
  return probe_->found;
}

bool PrefixStore::restore_shared(std::span<const TokenId> want, int64_t tokens) {
  SharedPrefixStore* store = options_.shared_store.get();
  probe_.reset();  // what is found next is asked afresh
  const int64_t unit = engine_.memory().fork_granularity();
  if (store == nullptr || tokens <= 0 || tokens > static_cast<int64_t>(want.size()) || tokens % unit != 0) {
    return false;
  }
  const std::span<const TokenId> prefix = want.first(static_cast<size_t>(tokens));
  const int64_t chunk = shared_chunk_tokens();
  const std::vector<PrefixKey> keys = prefix_keys(identity(), prefix, unit, tokens - 1, chunk);
  // The whole chunks a cached sequence of this engine holds already are not read: the new sequence
  // forks them and the chunks after them are appended (the last chunk is always read).
  const Match local = longest_cached(prefix, 0);
  const int64_t held = std::min(local.tokens, tokens - 1) / chunk * chunk;
  RequestState state = RequestState::kNew;
  move(state, RequestState::kShared);
  // The chunks from token `skip` on (keys[skip / chunk] on: those before end at or before it).
  // Every chunk read and checked before any is used: a chunk that is gone, of another engine or
  // of other tokens makes the whole read a miss (the request computes its prompt).
  const auto read_from = [&](int64_t skip) -> Result<PrefixSnapshot> {
    std::vector<PrefixChunk> chunks;
    for (size_t k = static_cast<size_t>(skip / chunk); k < keys.size(); ++k) {
      const PrefixKey& key = keys[k];
      const std::string name = store->name() + " key " + key.text();
      SPX_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, store->get(key));
      stats_.prefix_shared_bytes_read += static_cast<int64_t>(bytes.size());
      SPX_ASSIGN_OR_RETURN(PrefixChunk c, parse_prefix_chunk(bytes, name));
      if (c.identity != identity()) {
        return data_loss("prefix chunk " + name + ": field 'identity' is of another model or KV layout");
      }
      const int64_t start = chunks.empty() ? skip : chunks.back().end();
      if (c.chunk_tokens != chunk || c.start != start || c.end() != key.tokens) {
        return data_loss("prefix chunk " + name + ": fields 'chunk_tokens', 'start' and 'end' are " +
                         std::to_string(c.chunk_tokens) + ", " + std::to_string(c.start) + " and " +
                         std::to_string(c.end()) + ", not " + std::to_string(chunk) + ", " +
                         std::to_string(start) + " and " + std::to_string(key.tokens));
      }
      if (!std::equal(c.tokens.begin(), c.tokens.end(), prefix.begin())) {
        return data_loss("prefix chunk " + name +
                         ": field 'token_ids' holds other tokens (a hash collision)");
      }
      chunks.push_back(std::move(c));
    }
    return skip == 0 ? join_prefix_chunks(chunks, head_block_tokens(engine_)) : join_prefix_chunk_tail(chunks);
  };
  const auto failed = [&](const Status& why) {  // the request computes its prompt instead
    if (why.code() == StatusCode::kNotFound) {
      ++stats_.prefix_shared_misses;  // expired or evicted since it was found
    } else {
      (void)shared_error(why.to_string());
    }
    move(state, RequestState::kDropped);
    return false;
  };
  Result<PrefixSnapshot> read = read_from(held);
  if (!read.is_ok()) return failed(read.status());
  ++stats_.prefix_shared_hits;
  stats_.prefix_shared_chunks_read += static_cast<int64_t>(keys.size()) - held / chunk;
  stats_.prefix_shared_chunks_local += held / chunk;
  std::optional<SeqId> seq = held == 0 ? import_evicting(*read) : import_evicting(*read, local.seq, held);
  if (!seq && held > 0) {
    // No room for a fork beside the sequence it forks (one slot, or a full pool): read from 0,
    // that sequence may give way.
    read = read_from(0);
    if (!read.is_ok()) return failed(read.status());
    stats_.prefix_shared_chunks_read += static_cast<int64_t>(keys.size());  // the later ones twice
    stats_.prefix_shared_chunks_local -= held / chunk;
    seq = import_evicting(*read);
  }
  if (seq) {
    ++stats_.prefix_restores;
    move(state, RequestState::kCached);
    cached_.push_back({*seq, std::vector<TokenId>(prefix.begin(), prefix.end())});
    return true;
  }
  move(state, RequestState::kDropped);  // no room (or a snapshot this engine refuses): it stays in the store
  return false;
}

}  // namespace specontext
