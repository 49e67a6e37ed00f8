// Shared tokenizer pieces: sequence decoding, chat templates, the GGUF vocabulary dispatcher and
// helpers used by both the SentencePiece and the byte-level BPE implementations.
#include "core/tokenizer/tokenizer.h"

#include <algorithm>
#include <exception>
#include <new>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/base/json_depth.h"
#include "core/model/gguf.h"
#include "core/tokenizer/tokenizer_internal.h"

namespace specontext {

std::string Tokenizer::decode(const std::vector<TokenId>& ids) const {
  std::string out;
  TokenId prev = -1;  // start of text: implementations strip the dummy-prefix space there
  for (TokenId id : ids) {
    out += decode_token(prev, id);
    prev = id;
  }
  return out;
}

// Hard-coded templates (no Jinja):
//  kLlama3: Llama-3 / 3.1 / 3.2 instruct without the default system prompt:
//    <|begin_of_text|>{<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>}...
//    <|start_header_id|>assistant<|end_header_id|>\n\n
//    With tools, Llama 3.1's own template (tools_in_user_message): a system turn opening with
//    "Environment: ipython" and its knowledge/today dates, the functions (JSON, indent 4) put in
//    front of the first user message, calls as {"name": N, "parameters": ARGS} and tool results
//    as ipython turns.
//  kQwen: ChatML as used by Qwen / Qwen2 / Qwen2.5 / Qwen3 (without the default system prompt):
//    {<|im_start|>role\ncontent<|im_end|>\n}... <|im_start|>assistant\n
//    With tools, Qwen's Hermes blocks: a system turn (first system message + "\n\n" + "# Tools"
//    with one <tools> line per tool), <tool_call> blocks in assistant turns, and consecutive tool
//    results in one user turn of <tool_response> blocks.
//  kDeepSeekR1: DeepSeek-R1 and its distills (R1-Distill-Llama, R1-Distill-Qwen), as the
//    chat_template of their tokenizer_config.json renders:
//    <｜begin▁of▁sentence｜> + the last system message, then {<｜User｜>content} and
//    {<｜Assistant｜>text<｜end▁of▁sentence｜>} (an assistant's text after its last </think>);
//    tool results <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r<｜tool▁output▁end｜>
//    (later ones "\n<｜tool▁output▁begin｜>r<｜tool▁output▁end｜>"), closed by
//    <｜tool▁outputs▁end｜> before the next assistant text or at the end; earlier calls as the
//    template writes them (quirks kept: the closing <｜tool▁calls▁end｜><｜end▁of▁sentence｜>
//    follows only the second and later calls). The generation prompt is
//    <｜Assistant｜><think>\n, none after a tool result, as the template does. Tools on offer
//    are not rendered: the template has no place for them.
//  kNone: the contents concatenated as plain text (completion models); tools are ignored.
// Encode the result with parse_special = true and add_bos = false (Llama-3 already has BOS).
// JSON is written as Jinja's tojson writes it (Python's json.dumps: ", " and ": " separators, or
// indent 4), because that is the text the models were trained on.
namespace {

using OrderedJson = nlohmann::ordered_json;

void append_python_json(std::string& out, const OrderedJson& v) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, value] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += OrderedJson(key).dump();
      out += ": ";
      append_python_json(out, value);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ", ";
      append_python_json(out, v[i]);
    }
    out += ']';
  } else {
    out += v.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  }
}

// JSON text re-written as tojson would (indent < 0: one line); text that is not JSON as it is.
std::string as_tojson(const std::string& text, int indent) {
  OrderedJson v = parse_ordered_json_bounded(text);  // from a request: deeper text stays as it is
  if (v.is_discarded()) return text;
  if (indent >= 0) return v.dump(indent, ' ', false, OrderedJson::error_handler_t::replace);
  std::string out;
  append_python_json(out, v);
  return out;
}

std::string qwen_chat(const std::vector<ChatMessage>& messages, const std::vector<std::string>& tools) {
  std::string out;
  size_t first = 0;
  if (!tools.empty()) {
    out = "<|im_start|>system\n";
    if (!messages.empty() && messages[0].role == "system") {
      out += messages[0].content + "\n\n";
      first = 1;
    }
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
    for (const std::string& tool : tools) {
      out += '\n';  // not "\n" + ...: GCC 12 warns falsely (-Wrestrict) on that operator+
      out += as_tojson(tool, -1);
    }
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "tool") {
      if (i == first || messages[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
      if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
      continue;
    }
    out += "<|im_start|>" + m.role + "\n" + m.content;
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      if (c > 0 || !m.content.empty()) out += "\n";
      out += "<tool_call>\n{\"name\": \"" + m.tool_calls[c].name +
             "\", \"arguments\": " + as_tojson(m.tool_calls[c].arguments, -1) + "}\n</tool_call>";
    }
    out += "<|im_end|>\n";
  }
  out += "<|im_start|>assistant\n";
  return out;
}

// Llama 3.1 makes one call per turn; several are written one per line.
std::string llama3_calls(const std::vector<ChatToolCall>& calls) {
  std::string out;
  for (size_t c = 0; c < calls.size(); ++c) {
    if (c) out += "\n";
    out += "{\"name\": \"" + calls[c].name + "\", \"parameters\": " + as_tojson(calls[c].arguments, -1) + "}";
  }
  return out;
}

std::string llama3_header(const std::string& role) { return "<|start_header_id|>" + role + "<|end_header_id|>\n\n"; }

// One turn; earlier calls and their results are written in the template's format with or
// without tools on offer now.
std::string llama3_turn(const ChatMessage& m) {
  if (m.role == "tool") return llama3_header("ipython") + m.content + "<|eot_id|>";
  if (!m.tool_calls.empty()) return llama3_header("assistant") + llama3_calls(m.tool_calls) + "<|eot_id|>";
  return llama3_header(m.role) + m.content + "<|eot_id|>";
}

std::string llama3_chat(const std::vector<ChatMessage>& messages, const std::vector<std::string>& tools) {
  const auto header = llama3_header;
  std::string out = "<|begin_of_text|>";
  if (tools.empty()) {
    for (const ChatMessage& m : messages) out += llama3_turn(m);
    return out + header("assistant");
  }
  out += header("system") +
         "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  size_t first = 0;
  if (!messages.empty() && messages[0].role == "system") {
    out += messages[0].content;
    first = 1;
  }
  out += "<|eot_id|>";
  std::string functions =
      "Given the following functions, please respond with a JSON for a function call with its proper "
      "arguments that best answers the given prompt.\n\n"
      "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
      "its value}.Do not use variables.\n\n";
  for (const std::string& tool : tools) functions += as_tojson(tool, 4) + "\n\n";
  // The functions go in front of the first user message (Llama 3.1's template has no other
  // place for them); without one, they make a user turn of their own.
  size_t first_user = messages.size();
  for (size_t i = first; i < messages.size(); ++i) {
    if (messages[i].role == "user") {
      first_user = i;
      break;
    }
  }
  if (first_user == messages.size()) out += header("user") + functions + "<|eot_id|>";
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out += i == first_user ? header("user") + functions + m.content + "<|eot_id|>" : llama3_turn(m);
  }
  out += header("assistant");
  return out;
}

// DeepSeek-R1's special tokens: fullwidth vertical bars (U+FF5C) and lower one-eighth blocks
// (U+2581) around the words.
constexpr std::string_view kR1Bos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kR1Eos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kR1User = "<｜User｜>";
constexpr std::string_view kR1Assistant = "<｜Assistant｜>";
constexpr std::string_view kR1CallsBegin = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kR1CallsEnd = "<｜tool▁calls▁end｜>";
constexpr std::string_view kR1CallBegin = "<｜tool▁call▁begin｜>";
constexpr std::string_view kR1CallEnd = "<｜tool▁call▁end｜>";
constexpr std::string_view kR1Sep = "<｜tool▁sep｜>";
constexpr std::string_view kR1OutputsBegin = "<｜tool▁outputs▁begin｜>";
constexpr std::string_view kR1OutputsEnd = "<｜tool▁outputs▁end｜>";
constexpr std::string_view kR1OutputBegin = "<｜tool▁output▁begin｜>";
constexpr std::string_view kR1OutputEnd = "<｜tool▁output▁end｜>";

// The DeepSeek-R1 template, state for state (its namespace: is_first, is_tool, is_output_first).
// An assistant turn with calls and no text is the template's "content is none" case.
std::string deepseek_r1_chat(const std::vector<ChatMessage>& messages) {
  std::string system;  // the last system message counts
  for (const ChatMessage& m : messages) {
    if (m.role == "system") system = m.content;
  }
  std::string out = std::string(kR1Bos) + system;
  bool is_first = false, is_tool = false, is_output_first = true;
  auto call = [](const ChatToolCall& c) {
    return std::string(kR1CallBegin) + "function" + std::string(kR1Sep) + c.name + "\n```json\n" + c.arguments +
           "\n```" + std::string(kR1CallEnd);
  };
  for (const ChatMessage& m : messages) {
    if (m.role == "user") {
      is_tool = false;
      out += std::string(kR1User) + m.content;
    } else if (m.role == "assistant" && !m.tool_calls.empty() && m.content.empty()) {
      is_tool = false;
      for (const ChatToolCall& c : m.tool_calls) {
        if (!is_first) {
          out += std::string(kR1Assistant) + std::string(kR1CallsBegin) + call(c);
          is_first = true;
        } else {
          out += "\n" + call(c) + std::string(kR1CallsEnd) + std::string(kR1Eos);
        }
      }
    } else if (m.role == "assistant") {
      if (is_tool) {
        out += std::string(kR1OutputsEnd) + m.content + std::string(kR1Eos);
        is_tool = false;
      } else {
        const size_t think = m.content.rfind("</think>");
        out += std::string(kR1Assistant) +
               (think == std::string::npos ? m.content : m.content.substr(think + 8)) + std::string(kR1Eos);
      }
    } else if (m.role == "tool") {
      is_tool = true;
      out += is_output_first ? std::string(kR1OutputsBegin) + std::string(kR1OutputBegin)
                             : "\n" + std::string(kR1OutputBegin);
      out += m.content + std::string(kR1OutputEnd);
      is_output_first = false;
    }
  }
  if (is_tool) return out + std::string(kR1OutputsEnd);
  return out + std::string(kR1Assistant) + "<think>\n";
}

}  // namespace

std::string apply_chat_template(ChatTemplate t, const std::vector<ChatMessage>& messages,
                                const std::vector<std::string>& tools) {
  switch (t) {
    case ChatTemplate::kLlama3:
      return llama3_chat(messages, tools);
    case ChatTemplate::kQwen:
      return qwen_chat(messages, tools);
    case ChatTemplate::kDeepSeekR1:
      return deepseek_r1_chat(messages);
    case ChatTemplate::kNone:
      break;
  }
  std::string out;
  for (const ChatMessage& m : messages) out += m.content;
  return out;
}

ChatTemplate chat_template_of(const Tokenizer& tok, std::string_view architecture) {
  if (tok.piece_to_id("<｜User｜>") >= 0 && tok.piece_to_id("<｜Assistant｜>") >= 0) return ChatTemplate::kDeepSeekR1;
  if (architecture.starts_with("qwen") || tok.piece_to_id("<|im_start|>") >= 0) return ChatTemplate::kQwen;
  if (tok.piece_to_id("<|start_header_id|>") >= 0) return ChatTemplate::kLlama3;
  return ChatTemplate::kNone;
}

bool chat_template_renders_tools(ChatTemplate t) { return t == ChatTemplate::kLlama3 || t == ChatTemplate::kQwen; }

std::string_view chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kLlama3: return "llama3";
    case ChatTemplate::kQwen: return "qwen";
    case ChatTemplate::kDeepSeekR1: return "deepseek-r1";
    case ChatTemplate::kNone: break;
  }
  return "none";
}

std::string apply_chat_template(ChatTemplate t, const std::vector<ChatMessage>& messages) {
  return apply_chat_template(t, messages, {});
}

namespace {

constexpr std::string_view kSpace = " \t\r\n";
constexpr std::string_view kHermesOpen = "<tool_call>", kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";  // Llama 3.1's call marker

std::string_view trim_space(std::string_view s) {
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

// The length of s without its trailing white space.
size_t trimmed_end(std::string_view s) {
  const size_t last = s.find_last_not_of(kSpace);
  return last == std::string_view::npos ? 0 : last + 1;
}

// {"name": string, <arguments_key>: object} as a call; anything else is not one.
std::optional<ChatToolCall> call_of(const OrderedJson& v, std::initializer_list<const char*> argument_keys) {
  if (!v.is_object()) return std::nullopt;
  auto name = v.find("name");
  if (name == v.end() || !name->is_string()) return std::nullopt;
  for (const char* key : argument_keys) {
    auto args = v.find(key);
    if (args == v.end()) continue;
    if (!args->is_object()) return std::nullopt;
    std::string text;
    append_python_json(text, *args);
    return ChatToolCall{name->get<std::string>(), std::move(text)};
  }
  return std::nullopt;
}

std::optional<std::vector<ChatToolCall>> hermes_calls(std::string_view text, size_t first) {
  std::vector<ChatToolCall> calls;
  size_t at = first;
  while (at != std::string_view::npos) {
    const size_t body = at + kHermesOpen.size();
    const size_t close = text.find(kHermesClose, body);
    const std::string_view inner = text.substr(body, close == std::string_view::npos ? std::string_view::npos : close - body);
    auto call = call_of(parse_ordered_json_bounded(trim_space(inner)), {"arguments"});
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
    if (close == std::string_view::npos) break;
    at = text.find(kHermesOpen, close + kHermesClose.size());
  }
  return calls;
}

std::optional<std::vector<ChatToolCall>> llama3_json_calls(std::string_view text) {
  std::string_view rest = trim_space(text);
  if (rest.starts_with(kPythonTag)) rest = trim_space(rest.substr(kPythonTag.size()));
  if (!rest.starts_with("{")) return std::nullopt;
  std::vector<ChatToolCall> calls;
  for (;;) {
    // One object: the shortest prefix that parses (a ';' inside a string does not split it).
    size_t end = 0;
    OrderedJson v;
    for (size_t pos = rest.find('}'); pos != std::string_view::npos; pos = rest.find('}', pos + 1)) {
      v = parse_ordered_json_bounded(rest.substr(0, pos + 1));
      if (!v.is_discarded()) {
        end = pos + 1;
        break;
      }
    }
    if (end == 0) return std::nullopt;
    auto call = call_of(v, {"parameters", "arguments"});
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
    rest = trim_space(rest.substr(end));
    if (rest.empty()) return calls;
    if (!rest.starts_with(";")) return std::nullopt;
    rest = trim_space(rest.substr(1));
  }
}

}  // namespace

ParsedToolCalls parse_tool_calls(ChatTemplate t, std::string_view text) {
  ParsedToolCalls out{std::string(text), {}};
  if (t == ChatTemplate::kQwen) {
    const size_t first = text.find(kHermesOpen);
    if (first == std::string_view::npos) return out;
    if (auto calls = hermes_calls(text, first)) {
      out.calls = std::move(*calls);
      out.content = std::string(text.substr(0, trimmed_end(text.substr(0, first))));
    }
  } else if (t == ChatTemplate::kLlama3) {
    if (auto calls = llama3_json_calls(text)) {
      out.calls = std::move(*calls);
      out.content.clear();
    }
  }
  return out;
}

std::string tojson_line(std::string_view json_text) { return as_tojson(std::string(json_text), -1); }

size_t tool_call_content_prefix(ChatTemplate t, std::string_view text, size_t released) {
  if (t == ChatTemplate::kQwen) {
    // No marker, whole or partial, starts before `released` (it would have been held then).
    size_t held = text.find(kHermesOpen, std::min(released, text.size()));
    if (held == std::string_view::npos) {
      // A tail that may yet become <tool_call> is held too (the shortest such tail is the latest).
      held = text.size();
      for (size_t start = text.size() > kHermesOpen.size() ? text.size() - kHermesOpen.size() + 1 : 0;
           start < text.size(); ++start) {
        if (kHermesOpen.starts_with(text.substr(start))) {
          held = start;
          break;
        }
      }
    }
    return trimmed_end(text.substr(0, held));
  }
  if (t == ChatTemplate::kLlama3) {
    const size_t b = text.find_first_not_of(kSpace);
    if (b == std::string_view::npos) return 0;
    const std::string_view rest = text.substr(b);
    if (rest.starts_with("{") || rest.starts_with(kPythonTag) || kPythonTag.starts_with(rest)) return 0;
  }
  return text.size();
}

namespace tokenizer_internal {

size_t utf8_len(uint8_t lead) {
  static constexpr size_t kLookup[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLookup[lead >> 4];
}

size_t utf8_valid_len(std::string_view text, size_t pos) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t c = b(pos);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t min_cp;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2, min_cp = 0x80, cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, min_cp = 0x800, cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, min_cp = 0x10000, cp = c & 0x07;
  } else {
    return 1;
  }
  if (pos + n > text.size()) return 1;
  for (size_t i = 1; i < n; ++i) {
    if ((b(pos + i) & 0xC0) != 0x80) return 1;
    cp = (cp << 6) | (b(pos + i) & 0x3F);
  }
  if (cp < min_cp || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 1;
  return n;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

int parse_byte_piece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int v = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = piece[i];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return -1;
    }
    v = v * 16 + d;
  }
  return v;
}

void SpecialSplitter::add(std::string piece, TokenId id, bool special) {
  if (piece.empty()) return;  // an empty piece would match everywhere
  auto& list = by_first_byte_[static_cast<uint8_t>(piece[0])];
  // Keep longest first; equal lengths stay in insertion order (lower ids win).
  auto at = std::upper_bound(list.begin(), list.end(), piece.size(),
                             [](size_t len, const Entry& e) { return len > e.piece.size(); });
  list.insert(at, Entry{std::move(piece), id, special});
  ++count_;
}

std::vector<SpecialSplitter::Fragment> SpecialSplitter::split(std::string_view text,
                                                              bool parse_special) const {
  std::vector<Fragment> out;
  size_t raw_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const Entry* hit = nullptr;
    if (count_ != 0) {
      for (const Entry& e : by_first_byte_[static_cast<uint8_t>(text[pos])]) {
        if (e.special && !parse_special) continue;
        if (text.compare(pos, e.piece.size(), e.piece) == 0) {
          hit = &e;
          break;
        }
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    if (pos > raw_start) out.push_back(Fragment{text.substr(raw_start, pos - raw_start), -1});
    out.push_back(Fragment{{}, hit->id});
    pos += hit->piece.size();
    raw_start = pos;
  }
  if (raw_start < text.size()) out.push_back(Fragment{text.substr(raw_start), -1});
  return out;
}

std::vector<TokenId> collect_stop_ids(TokenId eos, const PieceMap& pieces) {
  std::vector<TokenId> ids;
  if (eos >= 0) ids.push_back(eos);
  for (const char* name : {"<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|end|>"}) {
    auto it = pieces.find(std::string_view(name));
    if (it != pieces.end() && std::find(ids.begin(), ids.end(), it->second) == ids.end()) {
      ids.push_back(it->second);
    }
  }
  return ids;
}

namespace {

// GGUF has no bool getter; accept a bool or an integer value.
bool gguf_bool_or(const GgufFile& gguf, const std::string& key, bool dflt) {
  auto it = gguf.metadata().find(key);
  if (it == gguf.metadata().end() || it->second.is_array()) return dflt;
  if (const bool* b = std::get_if<bool>(&it->second.scalar)) return *b;
  if (const uint64_t* u = std::get_if<uint64_t>(&it->second.scalar)) return *u != 0;
  if (const int64_t* i = std::get_if<int64_t>(&it->second.scalar)) return *i != 0;
  return dflt;
}

// Special token ids: absent, or outside the vocabulary (GGUF writes 0xFFFFFFFF for "none"), -> -1.
Result<TokenId> gguf_token_id(const GgufFile& gguf, const std::string& key, size_t n_tokens, TokenId dflt) {
  if (!gguf.has(key)) return dflt < static_cast<int64_t>(n_tokens) ? dflt : TokenId{-1};
  SPX_ASSIGN_OR_RETURN(int64_t v, gguf.get_int(key));
  if (v < 0 || v >= static_cast<int64_t>(n_tokens)) return TokenId{-1};
  return static_cast<TokenId>(v);
}

Result<std::vector<int32_t>> gguf_token_types(const GgufFile& gguf, size_t n_tokens) {
  const std::string key = "tokenizer.ggml.token_type";
  std::vector<int32_t> types;
  if (!gguf.has(key)) return types;
  SPX_ASSIGN_OR_RETURN(std::vector<int64_t> raw, gguf.get_int_array(key));
  if (raw.size() != n_tokens) {
    return invalid_argument(gguf.source() + ": " + key + " has " + std::to_string(raw.size()) +
                            " entries, tokenizer.ggml.tokens has " + std::to_string(n_tokens));
  }
  types.reserve(raw.size());
  for (int64_t t : raw) types.push_back(static_cast<int32_t>(std::clamp<int64_t>(t, 0, 64)));
  return types;
}

Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer_impl(const GgufFile& gguf) {
  const std::string& src = gguf.source();
  SPX_ASSIGN_OR_RETURN(std::string model, gguf.get_string("tokenizer.ggml.model"));
  SPX_ASSIGN_OR_RETURN(std::vector<std::string> tokens, gguf.get_string_array("tokenizer.ggml.tokens"));
  if (tokens.empty()) return invalid_argument(src + ": tokenizer.ggml.tokens is empty");
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return invalid_argument(src + ": tokenizer.ggml.tokens is too large");
  }
  const size_t n = tokens.size();
  SPX_ASSIGN_OR_RETURN(std::vector<int32_t> types, gguf_token_types(gguf, n));

  if (model == "llama") {
    tokenizer_internal::SpmVocab v;
    v.source = src;
    if (gguf.has("tokenizer.ggml.scores")) {
      SPX_ASSIGN_OR_RETURN(std::vector<double> scores, gguf.get_float_array("tokenizer.ggml.scores"));
      if (scores.size() != n) {
        return invalid_argument(src + ": tokenizer.ggml.scores has " + std::to_string(scores.size()) +
                                " entries, tokenizer.ggml.tokens has " + std::to_string(n));
      }
      v.scores.assign(scores.begin(), scores.end());
    }
    // Defaults as llama.cpp: <unk>=0, <s>=1, </s>=2.
    SPX_ASSIGN_OR_RETURN(v.bos, gguf_token_id(gguf, "tokenizer.ggml.bos_token_id", n, 1));
    SPX_ASSIGN_OR_RETURN(v.eos, gguf_token_id(gguf, "tokenizer.ggml.eos_token_id", n, 2));
    SPX_ASSIGN_OR_RETURN(v.unk, gguf_token_id(gguf, "tokenizer.ggml.unknown_token_id", n, 0));
    v.add_bos = gguf_bool_or(gguf, "tokenizer.ggml.add_bos_token", true);
    v.add_space_prefix = gguf_bool_or(gguf, "tokenizer.ggml.add_space_prefix", true);
    v.tokens = std::move(tokens);
    v.types = std::move(types);
    return make_spm_tokenizer(std::move(v));
  }
  if (model == "gpt2") {
    tokenizer_internal::BpeVocab v;
    v.source = src;
    std::string pre = "default";
    if (gguf.has("tokenizer.ggml.pre")) {
      SPX_ASSIGN_OR_RETURN(pre, gguf.get_string("tokenizer.ggml.pre"));
    }
    if (pre == "default" || pre == "gpt-2" || pre == "gpt2") {
      v.pre_steps = {{PreTokenizeStep::kRegexSplit, kGpt2Regex, "tokenizer.ggml.pre"}};
      v.add_bos = false;
    } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
      v.pre_steps = {{PreTokenizeStep::kRegexSplit, kLlama3Regex, "tokenizer.ggml.pre"}};
      v.ignore_merges = true;  // as Llama-3's tokenizer.json ("ignore_merges": true)
      v.add_bos = true;
    } else if (pre == "qwen2" || pre == "deepseek-r1-qwen") {  // llama.cpp maps both to QWEN2
      v.pre_steps = {{PreTokenizeStep::kRegexSplit, kQwen2Regex, "tokenizer.ggml.pre"}};
      v.add_bos = false;
    } else {
      return unimplemented(src + ": tokenizer.ggml.pre \"" + pre +
                           "\" is not supported (gpt-2, llama-bpe, qwen2, deepseek-r1-qwen)");
    }
    v.add_bos = gguf_bool_or(gguf, "tokenizer.ggml.add_bos_token", v.add_bos);
    SPX_ASSIGN_OR_RETURN(std::vector<std::string> merges, gguf.get_string_array("tokenizer.ggml.merges"));
    v.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      // Split at the first space after the first character, as llama.cpp does.
      const size_t sp = merges[i].find(' ', 1);
      if (sp == std::string::npos) {
        return invalid_argument(src + ": tokenizer.ggml.merges[" + std::to_string(i) +
                                "] is not \"left right\"");
      }
      v.merges.emplace_back(merges[i].substr(0, sp), merges[i].substr(sp + 1));
    }
    SPX_ASSIGN_OR_RETURN(v.bos, gguf_token_id(gguf, "tokenizer.ggml.bos_token_id", n, -1));
    SPX_ASSIGN_OR_RETURN(v.eos, gguf_token_id(gguf, "tokenizer.ggml.eos_token_id", n, -1));
    SPX_ASSIGN_OR_RETURN(v.unk, gguf_token_id(gguf, "tokenizer.ggml.unknown_token_id", n, -1));
    v.tokens = std::move(tokens);
    v.types = std::move(types);
    return make_bpe_tokenizer(std::move(v));
  }
  return unimplemented(src + ": tokenizer.ggml.model \"" + model + "\" is not supported (llama, gpt2)");
}

}  // namespace
}  // namespace tokenizer_internal

Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const GgufFile& gguf) {
  try {
    return tokenizer_internal::load_gguf_tokenizer_impl(gguf);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(gguf.source() + ": out of memory while building the tokenizer");
  } catch (const std::exception& e) {
    return internal_error(gguf.source() + ": tokenizer: " + e.what());
  }
}

}  // namespace specontext
