#include "core/base/utf8.h"

#include <cstdint>

namespace specontext {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

enum class Utf8Kind { kValid, kInvalid, kTruncated };
struct Utf8Seq {
  size_t len;  // bytes of the sequence, or of its maximal invalid subpart (>= 1)
  Utf8Kind kind;
};

// The sequence at s[i], with Unicode's "maximal subpart" rule for invalid ones (as Python's
// errors="replace"): a lead byte and the continuation bytes that fit it are one U+FFFD.
// kTruncated: a valid start of a sequence cut off by the end of s.
Utf8Seq utf8_seq(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {1, Utf8Kind::kValid};
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // the range of the next byte; narrower after E0, ED, F0, F4
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;  // overlong
    if (b == 0xED) hi = 0x9F;  // surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;  // overlong
    if (b == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {1, Utf8Kind::kInvalid};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {k, Utf8Kind::kTruncated};
    const auto c = static_cast<uint8_t>(s[i + k]);
    if (c < lo || c > hi) return {k, Utf8Kind::kInvalid};
    lo = 0x80;
    hi = 0xBF;
  }
  return {need + 1, Utf8Kind::kValid};
}

}  // namespace

size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto b = static_cast<uint8_t>(s[s.size() - back]);
    if (b >= 0x80 && b <= 0xBF) continue;  // a continuation byte: its lead is further back
    return utf8_seq(s, s.size() - back).kind == Utf8Kind::kTruncated ? back : 0;
  }
  return 0;
}

std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Utf8Seq seq = utf8_seq(s, i);
    if (seq.kind == Utf8Kind::kValid) {
      out.append(s.substr(i, seq.len));
    } else {
      out.append(kReplacement);
    }
    i += seq.len;
  }
  return out;
}

namespace {

template <typename Json>
std::string dump_replacing(const Json& j, int indent) {
  try {
    return j.dump(indent, ' ', false, Json::error_handler_t::replace);
  } catch (...) {
    return "{}";  // only allocation can fail here (replace never throws on bad UTF-8)
  }
}

}  // namespace

std::string dump_json(const nlohmann::json& j, int indent) { return dump_replacing(j, indent); }
std::string dump_json(const nlohmann::ordered_json& j, int indent) { return dump_replacing(j, indent); }

}  // namespace specontext
