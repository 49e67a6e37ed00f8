// libFuzzer target: parse_prefix_file must never crash, allocate past its input, or accept a
// file whose arrays disagree with its header.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/engine/prefix_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = specontext::parse_prefix_file(std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz.spxprefix");
  if (!r.is_ok()) return 0;
  const specontext::PrefixFile& f = *r;
  if (static_cast<int64_t>(f.tokens.size()) != f.snapshot.tokens) __builtin_trap();
  // What parses encodes back to the same bytes.
  const auto again = specontext::encode_prefix_file(f.tokens, f.snapshot, f.identity);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  return 0;
}
