// libFuzzer target: parse_prefix_chunk (a shared prefix store's value: hostile) must never crash,
// allocate past its input, or accept a chunk whose arrays disagree with its header; what parses
// encodes back to the same bytes, and joining it (as chunk 0 when it starts at 0) never crashes.
// Each input is tried as it is and with its last 4 bytes replaced by the CRC-32 of the rest, so
// that mutations reach the fields behind the checksum.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/engine/prefix_chunk.h"

namespace {

void check(std::span<const std::byte> bytes) {
  auto r = specontext::parse_prefix_chunk(bytes, "fuzz.spxchunk");
  if (!r.is_ok()) return;
  const specontext::PrefixChunk& c = *r;
  if (c.end() - c.start != c.piece.tokens || c.piece.tokens <= 0 || c.piece.tokens > c.chunk_tokens) {
    __builtin_trap();
  }
  const auto again = specontext::encode_prefix_chunk(c);
  if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), bytes.size()) != 0)
    __builtin_trap();
  auto joined = specontext::join_prefix_chunks(std::span(&c, 1), 24);
  if (joined.is_ok() &&
      (c.start != 0 || joined->tokens != c.end() || joined->kv.size() != c.piece.kv.size())) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* bytes = reinterpret_cast<const std::byte*>(data);
  check(std::span(bytes, size));
  if (size < 4) return 0;
  std::vector<std::byte> fixed(bytes, bytes + size);
  const auto crc = static_cast<uint32_t>(crc32(crc32(0L, Z_NULL, 0), data, static_cast<uInt>(size - 4)));
  std::memcpy(fixed.data() + size - 4, &crc, sizeof(crc));
  check(fixed);
  return 0;
}
