// A prefix's KV in chunks (LMCache's chunked storage): the shared prefix store
// (core/ports/shared_prefix_store.h) holds a prompt as chunks of `chunk_tokens` tokens covering
// [start, end), start a multiple of chunk_tokens, end - start at most chunk_tokens (the last chunk
// of a prompt may be shorter). A chunk's key depends on every token of [0, end) (PrefixKey with
// chunk_tokens), so that later turns of a conversation, which repeat the earlier turns' tokens,
// write only the chunks the store does not hold yet; a reader assembles a prefix from the run of
// chunks from token 0 (join_prefix_chunks), or from the first chunk it does not hold itself
// (join_prefix_chunk_tail, appended to a fork of what it holds).
//
// Layout of one chunk (little-endian, no padding): magic "SPXCHNK1", u32 version (1), u64 identity
// (the writer's Engine::kv_identity), i64 chunk_tokens, i64 start, i64 end, i64 page_size, i64
// layers, u64 page_bytes, u8 kv_dtype, u8 method, then length-prefixed (u64 count) arrays: token
// ids of ALL tokens [0, end) (i32: the reader compares them with its prompt, so that a key's hash
// collision can never give wrong KV), kv ([layers][pages of the chunk][page_bytes]), head_keys (f32
// rows of the chunk's tokens, token-major), boundary_fused (a row per page of the chunk),
// quest_min and quest_max (a row per layer: the chunk's Quest pages); last, a u32 CRC-32 (zlib) of
// every byte before it.
//
// The parser checks the structure and the checksum (a chunk from the store is hostile input);
// join_prefix_chunks checks that the chunks follow each other and agree on the layout, and
// Engine::import_prefix checks that the assembled snapshot fits the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/engine/engine.h"

namespace specontext {

struct PrefixChunk {
  uint64_t identity = 0;
  int64_t chunk_tokens = 0;
  int64_t start = 0;
  std::vector<TokenId> tokens;  // every token [0, end): end = tokens.size()
  // The chunk's part of a PrefixSnapshot: piece.tokens = end - start; kv, head_keys,
  // boundary_fused, quest_min and quest_max of those tokens only.
  PrefixSnapshot piece;
  int64_t end() const { return static_cast<int64_t>(tokens.size()); }
};

std::vector<std::byte> encode_prefix_chunk(const PrefixChunk& chunk);
// kDataLoss naming `name` and the field for a truncated, corrupt or inconsistent chunk.
Result<PrefixChunk> parse_prefix_chunk(std::span<const std::byte> bytes, const std::string& name);

// Tokens [start, end) of a whole prefix's snapshot (`tokens`: its token ids, as many as
// whole.tokens) as a chunk: start and end multiples of the snapshot's fork unit (page and Quest
// page), 0 <= start < end <= whole.tokens. head_block_tokens: the retrieval head's key block
// (Engine sparse_options().selection.budget under SpeContext; unused otherwise). kInvalidArgument
// when the snapshot cannot be cut there.
Result<PrefixChunk> cut_prefix_chunk(std::span<const TokenId> tokens, const PrefixSnapshot& whole,
                                     uint64_t identity, int64_t chunk_tokens, int64_t start, int64_t end,
                                     int64_t head_block_tokens);

// The snapshot of tokens [0, last chunk's end) from chunks that follow each other from token 0
// (each one's start the previous one's end, the same identity, chunk_tokens and layout, each
// one's tokens a prefix of the next one's). kDataLoss naming the chunk and what disagrees.
Result<PrefixSnapshot> join_prefix_chunks(std::span<const PrefixChunk> chunks, int64_t head_block_tokens);
// The same checks for chunks that follow each other from the first one's start: tokens [start,
// last chunk's end) laid out as one chunk's piece (head key rows of those tokens only, unpadded),
// what KvMemory::import_prefix_after appends to a fork of the tokens before them (a reader that
// holds the first chunks itself). kDataLoss as join_prefix_chunks.
Result<PrefixSnapshot> join_prefix_chunk_tail(std::span<const PrefixChunk> chunks);

}  // namespace specontext
