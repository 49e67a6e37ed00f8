// libFuzzer target: the JSON Schema compiler and grammar matcher (serving/structured/json_schema.h). Input: a
// schema text, a NUL byte, a document text. A schema nlohmann cannot read is skipped; compiling
// may fail (errors are fine); the document is fed byte by byte. Never a crash or a hang; a
// document the matcher takes whole must be one nlohmann reads.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string_view>

#include "serving/structured/json_schema.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  if (split == std::string_view::npos) return 0;
  const std::string_view schema_text = input.substr(0, split);
  const std::string_view doc = input.substr(split + 1);
  nlohmann::ordered_json schema;
  try {
    schema = nlohmann::ordered_json::parse(schema_text);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  auto grammar = specontext::json_schema_to_grammar(schema);
  if (!grammar.is_ok()) return 0;
  auto matcher =
      specontext::GrammarMatcher::create(std::make_shared<const specontext::Grammar>(std::move(*grammar)));
  if (!matcher.is_ok()) return 0;
  for (char c : doc) {
    if (matcher->advance(static_cast<uint8_t>(c)) != specontext::GrammarMatcher::Step::kOk) return 0;
  }
  if (!matcher->accepting()) return 0;
  try {
    (void)nlohmann::json::parse(doc);
  } catch (const nlohmann::json::exception&) {
    __builtin_trap();  // the grammar took a document that is not JSON
  }
  return 0;
}
