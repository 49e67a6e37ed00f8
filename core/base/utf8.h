// Model text in JSON. A model's tokens need not decode to valid UTF-8 (byte-fallback tokens emit
// single bytes of a character; a sampled byte may start no character at all), and nlohmann's
// dump() throws (type_error 316) on a string that is not. Everything that puts model text into
// JSON (generate --json, the server's responses, stream chunks, logprobs' tokens, tool-call
// arguments) goes through these: whole text through sanitize_utf8, streams through
// incomplete_utf8_tail (hold the tail back until it completes), and the document through
// dump_json, which never throws on a string.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace specontext {

// Valid UTF-8: each invalid sequence (its maximal subpart, as Unicode recommends and Python's
// errors="replace" does) replaced by one U+FFFD. A sequence cut off by the end of `s` is invalid.
std::string sanitize_utf8(std::string_view s);

// Bytes at the end of `s` that start a sequence not yet complete (0 to 3): what a stream holds
// back until the next piece. A lead byte never continues an earlier sequence, so cutting before it
// leaves the decoding of what follows unchanged.
size_t incomplete_utf8_tail(std::string_view s);

// j.dump(indent) with every string's invalid UTF-8 replaced by U+FFFD (nlohmann's replace
// handler), so it never throws on model text; "{}" if memory runs out.
std::string dump_json(const nlohmann::json& j, int indent = -1);
std::string dump_json(const nlohmann::ordered_json& j, int indent = -1);

}  // namespace specontext
