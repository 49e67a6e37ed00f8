// libFuzzer target: the OpenAI API's bodies (and /tokenize's, /detokenize's). Any body gives a request or an error naming its field
// (never a throw or crash); a request holds only validated values and its responses serialize to
// JSON; an error body is JSON. StopMatcher, fed the input in pieces with stops cut from the input,
// emits only valid UTF-8 and exactly what a whole-text reference predicts: without a match,
// text() + finish() is sanitize_utf8(input); with one, the text before the earliest match found
// at the first piece boundary where any stop is complete.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "core/tokenizer/tokenizer.h"
#include "serving/openai/openai_api.h"

namespace {

using namespace specontext::cluster;
using specontext::sanitize_utf8;
using json = nlohmann::json;

void check(bool ok) {
  if (!ok) __builtin_trap();
}

// An independent validator: decodes code points and refuses overlongs, surrogates, > U+10FFFF.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if ((b & 0xE0) == 0xC0) {
      n = 1, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 2, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 3, cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // cut off
    for (size_t k = 1; k <= n; ++k) {
      const auto c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = cp << 6 | (c & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

bool parses(const std::string& text) { return !json::parse(text, nullptr, false).is_discarded(); }

void check_event(const std::string& chunk) {
  check(chunk.size() > 8 && chunk.starts_with("data: ") && chunk.ends_with("\n\n"));
  // One event: JSON escapes newlines, so the only blank line is the terminating one.
  check(chunk.find('\n') == chunk.size() - 2);
  check(parses(chunk.substr(6, chunk.size() - 8)));
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void check_request(ApiKind kind, const ApiRequest& r) {
  check(r.kind == kind);
  if (kind == ApiKind::kCompletion) {
    check(r.prompt_is_ids ? !r.prompt_ids.empty() && r.prompt_text.empty()
                          : !r.prompt_text.empty() && r.prompt_ids.empty());
    for (auto id : r.prompt_ids) check(id >= 0);
    check(r.messages.empty());
  } else {
    check(!r.messages.empty());
    for (const auto& m : r.messages) {
      check(m.role == "system" || m.role == "user" || m.role == "assistant" || m.role == "tool");
      check(m.tool_calls.empty() || m.role == "assistant");
    }
  }
  // Tools: chat only; any tool_choice but "none" has tools, a named one is among them.
  check(r.tools.empty() || kind == ApiKind::kChat);
  check(r.tool_choice == ApiRequest::ToolChoice::kNone || !r.tools.empty());
  if (r.tool_choice == ApiRequest::ToolChoice::kNamed) {
    check(std::any_of(r.tools.begin(), r.tools.end(), [&](const auto& t) { return t.name == r.tool_choice_name; }));
  }
  for (const auto& t : r.tools) check(!t.name.empty() && t.parameters.is_object() && parses(t.definition));
  check(!r.stream || r.tool_choice == ApiRequest::ToolChoice::kNone);
  check(!r.max_tokens || *r.max_tokens > 0);
  check(r.sampling.validate().is_ok() && r.sampling.temperature <= 2.0f);
  check(r.stop.size() <= 4);
  for (const auto& s : r.stop) check(!s.empty());
  check(!r.include_usage || r.stream);
  check(r.logprobs >= -1 && r.logprobs <= specontext::kMaxLogprobs);
  check(!r.echo || kind == ApiKind::kCompletion);
  check(r.n >= 1 && r.n <= kMaxChoices);
  check(r.frequency_penalty >= -2.0f && r.frequency_penalty <= 2.0f);
  check(r.presence_penalty >= -2.0f && r.presence_penalty <= 2.0f);
  for (const auto& [id, bias] : r.logit_bias) check(id >= 0 && bias >= -100.0f && bias <= 100.0f);
  for (auto id : r.stop_token_ids) check(id >= 0);
  check(r.min_p >= 0.0f && r.min_p <= 1.0f);
  check(r.min_tokens >= 0 && (!r.max_tokens || r.min_tokens <= *r.max_tokens));

  const ResponseMeta meta{"cmpl-fuzz", 1, r.model};
  const std::string& text = kind == ApiKind::kCompletion ? r.prompt_text : r.messages[0].content;
  check(parses(dump(completion_response(kind, meta, text, "stop", Usage{3, 4, std::nullopt}))));
  // The input's text as token strings (arbitrary bytes), with -inf and NaN-free extremes.
  std::vector<LogprobEntry> entries;
  for (size_t i = 0; i < text.size() && entries.size() < 8; i += 3) {
    entries.push_back({text.substr(i, 3), -static_cast<float>(i), {{text.substr(0, i), -1e30f}}, static_cast<int64_t>(i)});
  }
  entries.push_back({"", -std::numeric_limits<float>::infinity(), {}, 0});
  entries.push_back({text.substr(0, 2), 0.0f, {}, 0, /*has_logprob=*/false});
  check(parses(dump(completion_response(kind, meta, text, "stop", Usage{3, 4, std::nullopt}, &entries))));
  check_event(stream_chunk(kind, meta, text, false, &entries));
  const std::vector<ChoiceOut> several{{text, "stop", &entries}, {"", "length", nullptr}};
  const json both = completion_response(kind, meta, several, Usage{1, 1, std::nullopt});
  check(parses(dump(both)) && both["choices"].size() == 2);
  check_event(stream_chunk(kind, meta, text, false, nullptr, r.n - 1));
  check_event(stream_finish_chunk(kind, meta, "stop", r.n - 1));
  check_event(stream_chunk(kind, meta, text, true));
  check_event(stream_chunk(kind, meta, text, false));
  check_event(stream_finish_chunk(kind, meta, "length"));
  check_event(stream_usage_chunk(kind, meta, Usage{1, 2, std::nullopt}));
}

void check_error(const ApiError& e) {
  check(!e.message.empty());
  if (!e.param.empty()) check(e.message.starts_with("field '" + e.param + "'"));
  check(parses(error_body(e)));
  check_event(stream_error_chunk(e));
}

// Feeds `input` cut at `ends` (cumulative, non-decreasing, last = size) and compares with the
// reference described at the top.
void check_stops(std::string_view input, const std::vector<std::string>& stops,
                 const std::vector<size_t>& ends) {
  StopMatcher m(stops);
  std::string out;
  size_t begin = 0;
  std::string expected;
  bool expect_stop = false;
  for (size_t end : ends) {
    const std::string chunk = m.feed(input.substr(begin, end - begin));
    check(valid_utf8(chunk));
    out += chunk;
    const size_t prev = begin;
    begin = end;
    if (!expect_stop) {
      // No stop was complete before this piece, so a match now ends inside it.
      const std::string_view seen = input.substr(0, end);
      size_t first = std::string_view::npos;
      for (const auto& s : stops) {
        if (!s.empty()) first = std::min(first, seen.find(s, prev + 1 > s.size() ? prev + 1 - s.size() : 0));
      }
      if (first != std::string_view::npos) {
        expect_stop = true;
        expected = sanitize_utf8(seen.substr(0, first));
      }
    }
    check(m.stopped() == expect_stop);
  }
  const std::string rest = m.finish();
  check(valid_utf8(rest));
  if (expect_stop) {
    check(rest.empty());
  } else {
    expected = sanitize_utf8(input);
  }
  check(out + rest == expected);
  check(m.text() == expected);
  check(valid_utf8(expected));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  for (ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
    const ParseResult r = parse_api_request(kind, input);
    if (r.request) {
      check_request(kind, *r.request);
      // The request's own stops on its own text, in pieces of 3 bytes.
      const std::string& text =
          kind == ApiKind::kCompletion ? r.request->prompt_text : r.request->messages[0].content;
      std::vector<size_t> ends;
      for (size_t e = 3; e < text.size(); e += 3) ends.push_back(e);
      ends.push_back(text.size());
      check_stops(text, r.request->stop, ends);
    } else {
      check_error(r.error);
    }
  }
  // The input as a model's reply under tool_choice "auto": calls whose arguments are JSON
  // objects, or no calls and the whole text as content.
  for (specontext::ChatTemplate family :
       {specontext::ChatTemplate::kQwen, specontext::ChatTemplate::kLlama3, specontext::ChatTemplate::kDeepSeekR1}) {
    const specontext::ParsedToolCalls p = specontext::parse_tool_calls(family, input);
    if (p.calls.empty()) check(p.content == input);
    for (const specontext::ChatToolCall& c : p.calls) {
      check(nlohmann::json::parse(c.arguments, nullptr, false).is_object());
    }
    // Streamed: each prefix releases content the whole reply's content starts with, never less
    // than a shorter prefix did (at most 32 cut points, so that long inputs stay fast).
    size_t released = 0;
    const size_t step = std::max<size_t>(1, input.size() / 32);
    for (size_t end = 0; end <= input.size(); end += step) {
      const size_t ready = specontext::tool_call_content_prefix(family, input.substr(0, end));
      check(specontext::tool_call_content_prefix(family, input.substr(0, end), released) == ready);
      check(ready <= end && ready >= released && p.content.starts_with(input.substr(0, ready)));
      released = ready;
    }
    check(specontext::tool_call_content_prefix(family, input) >= released);
  }
  // /tokenize and /detokenize bodies: a request, or an error naming its field.
  const TokenizeParse t = parse_tokenize_request(input);
  if (t.request) {
    check(t.request->kind == ApiKind::kChat ? !t.request->messages.empty() : t.request->messages.empty());
    const std::vector<std::string> strs = {t.request->prompt};
    check(parses(tokenize_response(std::vector<specontext::TokenId>{1, 2}, 8, &strs).dump()));
  } else {
    check_error(t.error);
  }
  const DetokenizeParse d = parse_detokenize_request(input);
  if (d.request) {
    for (specontext::TokenId id : d.request->tokens) check(id >= 0);
  } else {
    check_error(d.error);
  }
  // Stops cut from the input (short, so they match and hold text back), pieces of 0 to 4 bytes.
  std::vector<std::string> stops;
  if (size >= 4) {
    const size_t count = data[0] % 4;
    for (size_t i = 0; i < count; ++i) {
      const size_t off = data[1 + i] % size;
      const size_t len = 1 + data[size - 1 - i] % 5;
      stops.emplace_back(input.substr(off, len));
    }
  }
  std::vector<size_t> ends;
  for (size_t e = 0, j = 0; e < size; ++j) {
    size_t step = data[j % size] % 5;
    if (step == 0 && (j & 1)) step = 1;  // empty pieces too, but never only those
    e = std::min(size, e + step);
    ends.push_back(e);
  }
  if (ends.empty() || ends.back() != size) ends.push_back(size);
  check_stops(input, stops, ends);
  return 0;
}
