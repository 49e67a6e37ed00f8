// SharedPrefixStore: a prefix store other processes see (LMCache's remote backend shared by its
// servers): encoded values (serve writes prefix chunks, core/engine/prefix_chunk.h) under a key
// derived from their content, so that a prefix one server wrote is found by another of the same
// model and KV layout (cluster/redis_prefix_store.h, `--prefix-store redis://...`). Unlike
// PrefixBlobStore (private to one scheduler, keys chosen by the store, budget kept by the
// scheduler), what it holds outlives its writer and goes when the store decides (TTL, its own
// eviction); a scheduler never removes anything from it. Not synchronized: the scheduler's thread
// alone uses one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"

namespace specontext {

// Where a prefix's KV is valid and which tokens it holds. identity is the writer's
// Engine::kv_identity (a hash of the model's architecture and weights, RoPE parameters, max
// context, page size, KV dtype, sparse method, prefix sharing, retrieval head and tensor-parallel
// rank: everything that makes reused KV equal to computed KV); token_hash is FNV-1a 64 over the
// first `tokens` token ids (i32 little-endian), `tokens` a multiple of the fork unit. A hash
// collision cannot give wrong KV: the encoded file holds its tokens and identity, which the
// reader compares (a mismatch is a miss).
//
// chunk_tokens > 0: the key of the chunk (core/engine/prefix_chunk.h) of chunk_tokens that ENDS at
// `tokens` (it covers [(tokens - 1) / chunk_tokens · chunk_tokens, tokens)); its hash is still of
// every token before its end, so that equal keys mean equal KV. What serve's shared level writes.
struct PrefixKey {
  uint64_t identity = 0;
  int64_t tokens = 0;
  uint64_t token_hash = 0;
  int64_t chunk_tokens = 0;
  // "spx:prefix:v1:<identity hex>:<tokens>:<token_hash hex>" (a whole prefix file), or with
  // chunk_tokens "spx:prefix:v2:<identity hex>:c<chunk_tokens>:<tokens>:<token_hash hex>" (a
  // chunk): the store's key.
  std::string text() const;
  friend bool operator==(const PrefixKey&, const PrefixKey&) = default;
};

// The key of the first tokens.size() tokens (chunk_tokens: of the chunk ending there).
PrefixKey prefix_key(uint64_t identity, std::span<const TokenId> tokens, int64_t chunk_tokens = 0);
// The keys of every prefix of `tokens` whose length is a multiple of `unit` and more than
// `floor`, and with chunk_tokens (a multiple of unit) also of every multiple of chunk_tokens (the
// whole chunks a longer prefix is assembled from), shortest first (one pass over the tokens).
std::vector<PrefixKey> prefix_keys(uint64_t identity, std::span<const TokenId> tokens, int64_t unit,
                                   int64_t floor, int64_t chunk_tokens = 0);

class SharedPrefixStore {
 public:
  virtual ~SharedPrefixStore() = default;
  // What and where, for messages ("redis 127.0.0.1:6379/0").
  virtual const std::string& name() const = 0;
  // Stores `blob` under `key`, replacing what was there. kInvalidArgument when larger than the
  // store takes; kUnavailable when it cannot be reached (nothing stored).
  virtual Status put(const PrefixKey& key, std::span<const std::byte> blob) = 0;
  // The bytes under `key`: kNotFound when it holds none (never written, expired or evicted),
  // kUnavailable when it cannot be reached, kDataLoss for a value larger than the store takes.
  [[nodiscard]] virtual Result<std::vector<std::byte>> get(const PrefixKey& key) = 0;
  // For each key whether the store holds it (in one round trip where the store allows);
  // kUnavailable when it cannot be reached.
  [[nodiscard]] virtual Result<std::vector<bool>> contains(std::span<const PrefixKey> keys) = 0;
};

}  // namespace specontext
