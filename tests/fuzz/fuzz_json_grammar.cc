// libFuzzer target: the JSON grammar of constrained decoding (serving/structured/json_constraint.h) against
// nlohmann::json on arbitrary bytes. What the grammar takes as a whole document nlohmann must
// read (numbers beyond double aside: JSON allows them, nlohmann refuses them); what nlohmann
// reads the grammar must take, unless the text hits the grammar's own limits (whitespace runs,
// nesting) or holds a NUL byte (where nlohmann stops reading). Never a crash.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "serving/structured/json_constraint.h"

namespace {

// nlohmann also stops at a NUL byte (the end of a C string), which JSON does not allow.
bool within_limits(std::string_view text) {
  if (text.find('\0') != std::string_view::npos) return false;
  int run = 0, opens = 0;
  for (char c : text) {
    run = (c == ' ' || c == '\t' || c == '\n' || c == '\r') ? run + 1 : 0;
    if (run > specontext::JsonGrammar::kMaxWhitespaceRun) return false;
    opens += c == '[' || c == '{';
  }
  return opens <= specontext::JsonGrammar::kMaxDepth;
}

bool nlohmann_reads(std::string_view text, bool& overflow) {
  overflow = false;
  try {
    (void)nlohmann::json::parse(text);
    return true;
  } catch (const nlohmann::json::out_of_range&) {
    overflow = true;
  } catch (const nlohmann::json::exception&) {
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (bool object : {false, true}) {
    specontext::JsonGrammar g(object);
    const bool fed = g.feed(text);
    const bool ours = fed && g.complete();
    bool overflow = false;
    const bool reference = nlohmann_reads(text, overflow);
    // nlohmann also takes leading and trailing whitespace around an object; the grammar closes at '}'.
    const bool comparable = !object || (size > 0 && text.front() == '{' && text.back() == '}');
    if (!comparable) continue;
    if (ours && !reference && !overflow) __builtin_trap();
    if (reference && !ours && within_limits(text)) __builtin_trap();
  }
  return 0;
}
