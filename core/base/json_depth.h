// Bounds on the nesting of JSON that comes from outside (request bodies, schemas written as JSON
// text, model output read back as tool calls, the KV node's control lines). nlohmann's parser is
// iterative, but copying, dumping, comparing and our own walks of a tree recurse once per level, so
// a document 150000 levels deep overflows the stack in whatever touches it next. These check the
// depth while parsing, with a SAX pass that builds no tree, so a document that is too deep is
// refused before any tree of it exists.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace specontext {

// Arrays and objects inside each other, the outermost counting 1. Request bodies nest about 10
// levels around a schema; the schema compiler refuses schemas deeper than 64 of its own levels.
inline constexpr size_t kMaxJsonDepth = 128;

struct JsonTooDeep {
  // The member of the outermost object that holds the deep part ("guided_json", "tools"); empty
  // when the outermost value is an array.
  std::string top_key;
  // Where the nesting passes the bound, as a path from the outermost value
  // ("tools[0].function.parameters.a[0][0]"), its first 8 steps then "...".
  std::string path;
};

// nullopt when `text` nests no deeper than max_depth, or is not JSON at all (parsing it then says
// why); else where it passes the bound. Reads `text` once and allocates only its keys and strings.
std::optional<JsonTooDeep> json_too_deep(std::string_view text, size_t max_depth = kMaxJsonDepth);

// The member of the outermost object in whose value `text` stops being JSON (a syntax error, or a
// number too large for a double: 1e999, which nlohmann refuses with out_of_range 406), for the
// message to name it; nullopt when the text is JSON, nests too deep or is not an object there.
std::optional<std::string> json_error_field(std::string_view text);

// nlohmann's parse(text, nullptr, /*allow_exceptions=*/false), discarded also when `text` nests
// deeper than max_depth.
nlohmann::json parse_json_bounded(std::string_view text, size_t max_depth = kMaxJsonDepth);
nlohmann::ordered_json parse_ordered_json_bounded(std::string_view text, size_t max_depth = kMaxJsonDepth);

// Whether a tree already built nests deeper than max_depth (an iterative walk, for trees handed
// over by callers: json_schema_to_grammar checks its schema so).
bool json_deeper_than(const nlohmann::json& j, size_t max_depth);
bool json_deeper_than(const nlohmann::ordered_json& j, size_t max_depth);

}  // namespace specontext
