// PrefixStore: the prefixes a Scheduler keeps apart from its running requests (vLLM keeps its KV
// connector apart from the scheduler; LMCache its storage backends behind one API), in levels:
//   cached      finished requests' sequences in engine memory (least recently used first);
//   host        whole fork units of evicted ones, copied out (Engine::export_prefix), within
//               host_bytes;
//   lower       encoded prefix files (core/engine/prefix_file.h) in a directory of the store's
//               own, or blobs of a PrefixBlobStore (a KV node), within lower_bytes; with
//               `persist` the directory is kept (and locked) across processes.
// Lookup finds the longest cached or stored prefix of a prompt; a stored one is restored into the
// cache (Engine::import_prefix), the cache evicting for its room. A stored prefix another one
// extends is dropped. A file or blob that cannot be written or read back intact is dropped and
// counted (the request computes its prompt). Each prefix's moves go through a StateLog.
//   shared      a SharedPrefixStore other servers see (Redis): every finished request's prompt,
//               in whole fork units, is written there in chunks of shared_chunk_tokens
//               (core/engine/prefix_chunk.h), each under a key of every token up to its end:
//               only the chunks the store does not hold yet are written (publish; a later turn
//               of a conversation writes its new tokens' chunks only). A request no local level
//               serves as far asks it (find_shared) for the longest run of chunks from token 0 and
//               reads them back, checked and joined, into the cache (restore_shared): those past
//               the whole chunks a cached sequence holds, appended to a fork of it. The store
//               decides what it keeps; an unreachable one costs the prompt's computation only
//               (counted).
// Not thread-safe: the Scheduler's thread owns it.
#pragma once

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/engine/prefix_file.h"
#include "core/ports/prefix_blob_store.h"
#include "core/ports/shared_prefix_store.h"
#include "serving/request_state.h"

namespace specontext {

struct PrefixStoreOptions {
  uint64_t host_bytes = 0;   // host level's budget; 0: none
  uint64_t lower_bytes = 0;  // lower level's budget (with a blob store: at most its capacity); 0: none
  std::string disk_dir;      // under which the directory is made; empty: the system's temporary one
  bool persist = false;      // the directory specontext-<kv_identity> kept across restarts
  std::shared_ptr<PrefixBlobStore> blob_store;  // the lower level in blobs, not files
  std::shared_ptr<SharedPrefixStore> shared_store;  // the shared level; null: none
  // The shared level's chunk (rounded up to a whole number of fork units): LMCache's 256.
  int64_t shared_chunk_tokens = 256;
};

// GenerationStats' prefix counters (GenerationStats derives from this).
struct PrefixStoreStats {
  int64_t prefix_cache_evictions = 0;  // cached sequences dropped from the cache for room
  int64_t prefix_offloads = 0;         // prefixes kept in host memory
  int64_t prefix_restores = 0;         // stored prefixes written back into the cache
  int64_t prefix_offload_drops = 0;    // host-memory prefixes dropped for room
  int64_t prefix_offload_peak_bytes = 0;
  int64_t prefix_disk_writes = 0;    // prefixes written to the lower level
  int64_t prefix_disk_restores = 0;  // of prefix_restores, those read back from the lower level
  int64_t prefix_disk_drops = 0;     // files or blobs removed for room
  int64_t prefix_disk_errors = 0;    // files or blobs that could not be written or read back (dropped)
  int64_t prefix_disk_peak_bytes = 0;
  int64_t prefix_disk_found = 0;  // files a previous process left, indexed by open_disk
  // The shared level (PrefixStoreOptions::shared_store).
  int64_t prefix_shared_hits = 0;     // prefixes read back intact from it into the cache
  int64_t prefix_shared_misses = 0;   // lookups that found none, or whose blob was gone when read
  int64_t prefix_shared_writes = 0;   // prompts written to it
  int64_t prefix_shared_bytes_read = 0;
  int64_t prefix_shared_bytes_written = 0;
  int64_t prefix_shared_errors = 0;  // unreachable, refused a write, or a blob not of this engine
  int64_t prefix_shared_chunks_written = 0;  // chunks written (prefix_shared_writes: prompts)
  int64_t prefix_shared_chunks_skipped = 0;  // chunks of published prompts the store held already
  int64_t prefix_shared_chunks_read = 0;     // chunks read back intact
  int64_t prefix_shared_chunks_local = 0;    // chunks of a prefix read back not read: a cached sequence held them
};

// The longest common prefix of `want` and a sequence of `have` tokens (the k-th: at(k)), in
// whole `unit`s.
template <class TokenAt>
int64_t shared_units(std::span<const TokenId> want, int64_t have, int64_t unit, TokenAt&& at) {
  const int64_t cap = std::min(have, static_cast<int64_t>(want.size()));
  int64_t k = 0;
  while (k < cap && at(k) == want[static_cast<size_t>(k)]) ++k;
  return k / unit * unit;
}

class PrefixStore {
 public:
  // A cached sequence; tokens: what its KV holds.
  struct Cached {
    SeqId seq;
    std::vector<TokenId> tokens;
  };
  // The cached sequence sharing the most whole fork units with a prompt.
  struct Match {
    int64_t tokens = 0;  // 0: none longer than asked for
    SeqId seq;
    bool whole = false;  // the prompt shares every whole fork unit of it (the next turn)
  };

  PrefixStore(Engine& engine, PrefixStoreOptions options);
  // Persists when the directory is locked (persist()); else drops the cached sequences, the blobs
  // and the directory (what cannot be removed stays; a destructor does not fail).
  ~PrefixStore();
  PrefixStore(const PrefixStore&) = delete;
  PrefixStore& operator=(const PrefixStore&) = delete;

  // With `persist`: creates and locks the directory and indexes its files (before any other
  // call). Files that are partial, unreadable or of another identity are removed and counted in
  // prefix_disk_errors; the oldest go past lower_bytes. kInvalidArgument with a blob store, or
  // without lower_bytes or disk_dir; kUnavailable naming the directory when it cannot be created
  // or another process holds it. Ok and nothing done without `persist`, or when already open.
  Status open_disk();
  // With the directory open: every cached and host-memory prefix to files, the files' times set
  // in least-recently-used order (which open_disk sorts by). Else nothing.
  void persist();

  // The cache. insert: `seq` (now the store's) becomes the most recently used, coming `from`
  // kFinished or kCancelled; its working sets are released (it waits).
  void insert(SeqId seq, std::vector<TokenId> tokens, RequestState from);
  // Drops the least recently used cached sequence other than `keep` (that one too when it is the
  // last and `keep_may_go`), copying it into the store first when `offload`; false when none.
  bool evict(SeqId keep = SeqId(), bool keep_may_go = true, bool offload = true);
  // The cached `seq` cut to `tokens` (Engine::truncate_sequence with `promised`) leaves the cache
  // for a request; nullopt (nothing changed) when the engine refuses.
  std::optional<SeqId> take(SeqId seq, int64_t tokens, int64_t promised);
  void touch(SeqId seq);  // the cached `seq` becomes the most recently used
  // The cached sequence sharing more than `floor` whole fork units with `want`; tokens 0: none.
  Match longest_cached(std::span<const TokenId> want, int64_t floor) const;
  const std::deque<Cached>& cached() const { return cached_; }

  // The store. offload: copies `seq`'s whole fork units of `tokens` (coming `from` kCached, or a
  // preempted request's state) into host memory, or the lower level when larger than host memory
  // allows; older prefixes give way. True when the store holds them afterwards (also when it did
  // already); `seq` is unchanged.
  bool offload(SeqId seq, std::span<const TokenId> tokens, RequestState from);
  bool has_levels() const { return options_.host_bytes > 0 || options_.lower_bytes > 0; }
  // The stored prefix sharing more than `floor` whole fork units with `want`: an index for
  // restore(), valid until the next call that changes the store.
  std::optional<size_t> longest_stored(std::span<const TokenId> want, int64_t floor) const;
  // Writes stored prefix `index` back as the most recently used cached sequence, evicting others
  // for room; false (it stays stored, or is dropped when it cannot be read back) when not.
  bool restore(size_t index);

  // The shared level. publish: `seq`'s first whole fork units of `tokens` (at most its length)
  // written to the shared store, the chunks it does not hold (asked in one round trip); false
  // when nothing was written (no store, every chunk held already, under one unit, or an error:
  // counted; chunks written before an error stay).
  bool publish(SeqId seq, std::span<const TokenId> tokens);
  // The longest prefix of `want` longer than `floor` in whole fork units the shared store holds
  // every chunk of (from token 0, in one round trip): its length, 0 when none (or no store; an
  // error counts and is 0). The same question twice in a row (a request waiting at the head of
  // the queue) is answered without asking again.
  int64_t find_shared(std::span<const TokenId> want, int64_t floor);
  // Reads the shared prefix of `want`'s first `tokens` back, chunk by chunk, as the most recently
  // used cached sequence, evicting others for room; false (counted: a chunk gone, unreachable, not
  // of this engine, holding other tokens, no room) when not. Each chunk is checked before use
  // (structure, checksum, identity, chunk size, token range and every token up to its end). The
  // whole chunks a cached sequence holds already are not read: the new sequence forks them
  // (prefix_shared_chunks_local) and the chunks read after them are appended.
  bool restore_shared(std::span<const TokenId> want, int64_t tokens);
  bool has_shared() const { return options_.shared_store != nullptr; }
  int64_t shared_chunk_tokens() const;  // the shared level's chunk, in whole fork units
  // Why the last shared-store operation failed; empty when none has.
  const std::string& last_shared_error() const { return last_shared_error_; }

  size_t cached_sequences() const { return cached_.size(); }
  size_t offloaded_prefixes() const;  // in host memory
  uint64_t offloaded_bytes() const { return host_bytes_; }
  size_t prefixes_on_disk() const { return stored_.size() - offloaded_prefixes(); }
  uint64_t disk_bytes() const { return lower_bytes_; }
  const PrefixBlobStore* blob_store() const { return options_.blob_store.get(); }  // null: none
  // Where the files go (made at the first one, or by open_disk); empty before.
  const std::string& prefix_disk_directory() const { return disk_dir_; }
  // Why the last file or blob failed to be written or read back; empty when none has.
  const std::string& last_prefix_disk_error() const { return last_error_; }
  const PrefixStoreStats& stats() const { return stats_; }
  const StateLog& states() const { return log_; }

 private:
  // A stored prefix: in host memory (snapshot) or encoded in the lower level (a file or a blob).
  struct Stored {
    std::vector<TokenId> tokens;   // snapshot.tokens of it
    PrefixSnapshot snapshot;       // empty in the lower level
    std::string file;              // in a file: its path
    std::optional<uint64_t> blob;  // in the blob store: its key
    uint64_t file_bytes = 0;
    RequestState state = RequestState::kNew;  // kOffloaded, kOnDisk, kOnNode; kDropped: to erase
    bool lower() const { return !file.empty() || blob.has_value(); }
  };

  void move(RequestState& state, RequestState to);  // log_.move; a refusal is a bug (asserted)
  // Lower level: p's snapshot to a file or blob, the least recently used ones removed for its room
  // first; false (p unchanged) when there is no lower level, no room or the write fails.
  bool write_lower(Stored& p);
  // Host memory's p to the lower level, its snapshot freed; false (p unchanged) when not.
  bool move_lower(Stored& p);
  // Encodes p into the lower level, at room already made: its path or key into p.
  Status put_lower(Stored& p, std::span<const std::byte> encoded);
  Status make_temp_dir();
  // p's encoded file read back from the lower level, its identity and tokens checked.
  Result<PrefixFile> read_back(const Stored& p);
  // read_prefix_file, and kDataLoss naming 'identity' for a file of another engine.
  Result<PrefixFile> read_own_file(const std::string& path, bool header_only);
  uint64_t identity();  // engine_.kv_identity(), computed once
  // Host memory over host_bytes: its least recently used prefixes go to the lower level (or are
  // dropped); dropped ones erased.
  void settle();
  void forget(const Stored& p, bool remove_file);  // its bytes out of the accounting
  void drop(Stored& p, bool remove_file);          // forget, and kDropped
  bool lower_error(const std::string& why);        // counted and kept; false
  bool shared_error(const std::string& why);       // counted and kept; false
  // The snapshot as a new cached sequence (the most recently used), others evicted for room; with
  // `after` (kept), appended to a fork of its first after_tokens (KvMemory::import_prefix_after).
  std::optional<SeqId> import_evicting(const PrefixSnapshot& snapshot, SeqId after = SeqId(),
                                       int64_t after_tokens = 0);
  void drop_extended();  // open_disk: no prefix that another extends, within the budget

  Engine& engine_;
  PrefixStoreOptions options_;
  PrefixStoreStats stats_;
  StateLog log_;
  std::deque<Cached> cached_;  // least recently used first
  std::deque<Stored> stored_;  // least recently used first
  uint64_t host_bytes_ = 0;    // of stored_ in host memory
  uint64_t lower_bytes_ = 0;   // of stored_ in the lower level
  std::string disk_dir_;
  FileLock disk_lock_;  // persist: held on disk_dir_ while this store lives
  std::optional<uint64_t> identity_;
  int64_t next_file_ = 0;
  std::string last_error_;
  std::string last_shared_error_;
  // find_shared's last question (want's hash and length, floor) and answer.
  struct Probe {
    uint64_t want_hash = 0;
    size_t want_size = 0;
    int64_t floor = 0;
    int64_t found = 0;
  };
  std::optional<Probe> probe_;
};

}  // namespace specontext
