// FNV-1a 64 (Fowler–Noll–Vo): the project's one non-cryptographic byte hash, for content keys
// (prefix keys, the KV identity, the router's chunk chain) and reports. Not for anything an
// attacker may choose to collide with where that matters: it is not keyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace specontext {

inline constexpr uint64_t kFnv1aBasis = 0xcbf29ce484222325ULL;
inline constexpr uint64_t kFnv1aPrime = 0x100000001b3ULL;

// The hash h continued over n bytes (h = kFnv1aBasis starts one).
inline uint64_t fnv1a64(const void* data, size_t n, uint64_t h = kFnv1aBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnv1aPrime;
  return h;
}
inline uint64_t fnv1a64(std::string_view s, uint64_t h = kFnv1aBasis) { return fnv1a64(s.data(), s.size(), h); }

}  // namespace specontext
