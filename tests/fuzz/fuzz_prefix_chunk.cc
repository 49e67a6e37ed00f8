// libFuzzer target: parse_prefix_chunk (a shared prefix store's value: hostile) must never crash,
// allocate past its input, or accept a chunk whose arrays disagree with its header; what parses
// encodes back to the same bytes, and joining it (as chunk 0 when it starts at 0) never crashes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/engine/prefix_chunk.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = specontext::parse_prefix_chunk(std::span(reinterpret_cast<const std::byte*>(data), size),
                                          "fuzz.spxchunk");
  if (!r.is_ok()) return 0;
  const specontext::PrefixChunk& c = *r;
  if (c.end() - c.start != c.piece.tokens || c.piece.tokens <= 0 || c.piece.tokens > c.chunk_tokens)
    __builtin_trap();
  const auto again = specontext::encode_prefix_chunk(c);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  auto joined = specontext::join_prefix_chunks(std::span(&c, 1), 24);
  if (joined.is_ok() &&
      (c.start != 0 || joined->tokens != c.end() || joined->kv.size() != c.piece.kv.size())) {
    __builtin_trap();
  }
  return 0;
}
