// PrefixBlobStore: where the prefix offload store's lower level keeps its encoded prefix files
// (core/engine/prefix_file.h) when that level is not a directory: a KV node's memory
// (cluster/remote_prefix_store.h, `--prefix-offload-remote`). The scheduler keeps the index (which
// tokens each blob holds) and the budget; a store only holds bytes under the keys it hands out.
// Not synchronized: the scheduler's thread alone uses one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/base/status.h"

namespace specontext {

class PrefixBlobStore {
 public:
  virtual ~PrefixBlobStore() = default;
  // What and where, for messages ("kv-node 10.0.0.2:7000+10.0.0.3:7000").
  virtual const std::string& name() const = 0;
  // Bytes it holds in all: the scheduler's budget for this level.
  virtual uint64_t capacity() const = 0;
  // Stores `blob` under a new key. kResourceExhausted when no free range holds it (fragmentation:
  // the caller removes older blobs and tries again); kUnavailable when the store cannot be reached.
  [[nodiscard]] virtual Result<uint64_t> put(std::span<const std::byte> blob) = 0;
  // The bytes stored under `key`; kNotFound for a key it does not hold, kUnavailable when the
  // store cannot be reached (the blob is then lost: the caller forgets it).
  [[nodiscard]] virtual Result<std::vector<std::byte>> get(uint64_t key) = 0;
  // Frees `key`'s bytes. Never fails; an unknown key is ignored.
  virtual void remove(uint64_t key) = 0;

  // A store mirrored on KV nodes: its replicas, those alive as last seen (a transfer finds a dead
  // one), and those found dead since it started (none is brought back). All 0 for other stores.
  struct ReplicaCounts {
    int64_t replicas = 0;
    int64_t live = 0;
    int64_t deaths = 0;
  };
  virtual ReplicaCounts replica_counts() const { return {}; }
};

}  // namespace specontext
