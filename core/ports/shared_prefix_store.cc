#include "core/ports/shared_prefix_store.h"

#include <cstdio>

#include "core/base/fnv1a.h"

namespace specontext {
namespace {

// The token id's 4 bytes, little-endian whatever the host's order.
uint64_t add_token(uint64_t h, TokenId t) {
  const auto v = static_cast<uint32_t>(t);
  const unsigned char le[4] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8),
                               static_cast<unsigned char>(v >> 16), static_cast<unsigned char>(v >> 24)};
  return fnv1a64(le, sizeof le, h);
}

}  // namespace

std::string PrefixKey::text() const {
  char buf[128];
  if (chunk_tokens > 0) {
    std::snprintf(buf, sizeof(buf), "spx:prefix:v2:%016llx:c%lld:%lld:%016llx",
                  static_cast<unsigned long long>(identity), static_cast<long long>(chunk_tokens),
                  static_cast<long long>(tokens), static_cast<unsigned long long>(token_hash));
    return buf;
  }
  std::snprintf(buf, sizeof(buf), "spx:prefix:v1:%016llx:%lld:%016llx", static_cast<unsigned long long>(identity),
                static_cast<long long>(tokens), static_cast<unsigned long long>(token_hash));
  return buf;
}

PrefixKey prefix_key(uint64_t identity, std::span<const TokenId> tokens, int64_t chunk_tokens) {
  uint64_t h = kFnv1aBasis;
  for (TokenId t : tokens) h = add_token(h, t);
  return PrefixKey{identity, static_cast<int64_t>(tokens.size()), h, chunk_tokens};
}

std::vector<PrefixKey> prefix_keys(uint64_t identity, std::span<const TokenId> tokens, int64_t unit,
                                   int64_t floor, int64_t chunk_tokens) {
  std::vector<PrefixKey> keys;
  if (unit <= 0) return keys;
  uint64_t h = kFnv1aBasis;
  for (size_t i = 0; i < tokens.size(); ++i) {
    h = add_token(h, tokens[i]);
    const auto n = static_cast<int64_t>(i + 1);
    if (n % unit == 0 && (n > floor || (chunk_tokens > 0 && n % chunk_tokens == 0))) {
      keys.push_back(PrefixKey{identity, n, h, chunk_tokens});
    }
  }
  return keys;
}

}  // namespace specontext
