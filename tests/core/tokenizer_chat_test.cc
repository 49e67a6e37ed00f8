// Hard-coded chat templates: exact renderings (DeepSeek-R1's against its own Jinja template,
// rendered by jinja2: tests/data/chat_deepseek_r1.json), and that the markers encode as special
// tokens.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

const std::vector<ChatMessage> kConversation = {
    {"system", "You are terse."},
    {"user", "Hi!"},
    {"assistant", "Hello."},
    {"user", "2+2?"},
};

TEST(ChatTemplate, Llama3Exact) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, kConversation),
            "<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, {}),
            "<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, QwenChatMlExact) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, kConversation),
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, {}), "<|im_start|>assistant\n");
}

TEST(ChatTemplate, NoneConcatenatesContents) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kNone, {{"user", "Once upon"}, {"user", " a time"}}),
            "Once upon a time");
}

// A weather lookup: tools, a call, its result, and the next question.
const std::vector<std::string> kTools = {
    R"({"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}})"};
const std::vector<ChatMessage> kToolConversation = {
    {"system", "Be brief."},
    {"user", "Weather in Paris?"},
    {"assistant", "", {{"get_weather", R"({"city":"Paris"})"}}},
    {"tool", R"({"temp":21})"},
    {"user", "And Rome?"},
};
const char* kToolJson =
    R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})";

TEST(ChatTemplate, QwenToolsAreHermesBlocks) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, kToolConversation, kTools),
            std::string("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
                        "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
                        "XML tags:\n<tools>\n") +
                kToolJson +
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
                "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                "\"Paris\"}}\n</tool_call><|im_end|>\n"
                "<|im_start|>user\n<tool_response>\n{\"temp\":21}\n</tool_response><|im_end|>\n"
                "<|im_start|>user\nAnd Rome?<|im_end|>\n"
                "<|im_start|>assistant\n");
}

TEST(ChatTemplate, QwenGroupsToolResultsAndSeparatesCallsFromText) {
  const std::vector<ChatMessage> msgs = {
      {"user", "Both?"},
      {"assistant", "Looking.", {{"f", "{}"}, {"g", R"({"a":[1,2]})"}}},
      {"tool", "1"},
      {"tool", "2"},
  };
  // Without tools on offer, earlier calls and results are still written in Hermes form.
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, msgs, {}),
            "<|im_start|>user\nBoth?<|im_end|>\n"
            "<|im_start|>assistant\nLooking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, msgs), apply_chat_template(ChatTemplate::kQwen, msgs, {}));
}

TEST(ChatTemplate, Llama31ToolsGoInTheFirstUserMessage) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, kToolConversation, kTools),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge "
            "Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
            "for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
            "format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use "
            "variables.\n\n"
            "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        "
            "\"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n                "
            "\"city\": {\n                    \"type\": \"string\"\n                }\n            },\n            "
            "\"required\": [\n                \"city\"\n            ]\n        }\n    }\n}\n\n"
            "Weather in Paris?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": "
            "\"Paris\"}}<|eot_id|>"
            "<|start_header_id|>ipython<|end_header_id|>\n\n{\"temp\":21}<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nAnd Rome?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, ToolsWithoutAUserMessageOrOnAPlainModel) {
  const std::string llama = apply_chat_template(ChatTemplate::kLlama3, {{"system", "S"}}, kTools);
  EXPECT_NE(llama.find("S<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions"),
            std::string::npos)
      << llama;
  EXPECT_TRUE(llama.ends_with("}\n\n<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")) << llama;
  EXPECT_EQ(apply_chat_template(ChatTemplate::kNone, {{"user", "Once"}}, kTools), "Once");
  // Tools are the only difference: no tools means the plain template.
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, kConversation, {}),
            apply_chat_template(ChatTemplate::kLlama3, kConversation));
}

// Replies that hold no well-formed call: no calls, and the whole text as content.
void expect_all_text(ChatTemplate family, std::initializer_list<const char*> texts) {
  for (const char* text : texts) {
    SCOPED_TRACE(text);
    const ParsedToolCalls p = parse_tool_calls(family, text);
    EXPECT_TRUE(p.calls.empty());
    EXPECT_EQ(p.content, text);
  }
}

// Every conversation of tests/data/chat_deepseek_r1.json as the model's own template renders it
// (make_chat_deepseek_r1.py: jinja2 over the chat_template of DeepSeek-R1-Distill's
// tokenizer_config.json): thinking stripped from earlier answers, the last system message first,
// calls and results with the template's quirks, no generation prompt after a tool result.
TEST(ChatTemplate, DeepSeekR1MatchesItsJinjaTemplate) {
  const auto doc =
      nlohmann::json::parse(testing::read_text_file(testing::repo_path("tests/data/chat_deepseek_r1.json")));
  ASSERT_GE(doc["cases"].size(), 5u);
  for (const auto& c : doc["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"]) {
      ChatMessage msg{m["role"], m["content"].is_null() ? "" : m["content"].get<std::string>()};
      if (m.contains("tool_calls")) {
        for (const auto& t : m["tool_calls"]) msg.tool_calls.push_back({t["function"]["name"], t["function"]["arguments"]});
      }
      messages.push_back(std::move(msg));
    }
    const std::string expected = c["expected"];
    EXPECT_EQ(apply_chat_template(ChatTemplate::kDeepSeekR1, messages), expected);
    // Tools on offer have no place in this template.
    EXPECT_EQ(apply_chat_template(ChatTemplate::kDeepSeekR1, messages, {R"({"type": "function"})"}), expected);
  }
  EXPECT_FALSE(chat_template_renders_tools(ChatTemplate::kDeepSeekR1));
  EXPECT_TRUE(chat_template_renders_tools(ChatTemplate::kQwen));
  EXPECT_EQ(chat_template_name(ChatTemplate::kDeepSeekR1), "deepseek-r1");
}

TEST(ToolCallParser, QwenHermesBlocks) {
  ParsedToolCalls p = parse_tool_calls(
      ChatTemplate::kQwen,
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}");  // the last one cut before its end tag
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.content, "Let me look.");
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(p.calls[1].name, "now");
  EXPECT_EQ(p.calls[1].arguments, "{}");
  // No call, a malformed one, or arguments that are not an object: all text, no calls.
  expect_all_text(ChatTemplate::kQwen, {"Just words.", "<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>",
                                        "<tool_call>{\"name\": \"f\", \"arguments\": \"x\"}</tool_call>",
                                        "<tool_call>{\"arguments\": {}}</tool_call>"});
  // The Llama syntax is not a call on Qwen.
  EXPECT_TRUE(parse_tool_calls(ChatTemplate::kQwen, R"({"name": "f", "parameters": {}})").calls.empty());
}

// Model text and request arguments 150000 levels deep: before the depth bound, reading them back
// (parse_tool_calls) or rewriting them for the template (tojson) recursed per level and overflowed
// the stack. Now they are not calls, and arguments are written as they came.
TEST(ToolCallParser, DeeplyNestedTextIsNoCallAndArgumentsStayAsWritten) {
  const std::string deep = std::string(150000, '[') + std::string(150000, ']');
  const std::string args = R"({"a":)" + deep + "}";
  for (const auto& [family, text] :
       {std::pair{ChatTemplate::kQwen,
                  "<tool_call>{\"name\": \"f\", \"arguments\": " + args + "}</tool_call>"},
        std::pair{ChatTemplate::kLlama3, "{\"name\": \"f\", \"parameters\": " + args + "}"}}) {
    const ParsedToolCalls p = parse_tool_calls(family, text);
    EXPECT_TRUE(p.calls.empty());
    EXPECT_TRUE(p.content == text);
  }
  EXPECT_EQ(tojson_line(args), args);
  const std::vector<ChatMessage> history = {{"user", "go"}, {"assistant", "", {{"f", args}}}, {"tool", "1"}};
  for (ChatTemplate t : {ChatTemplate::kQwen, ChatTemplate::kLlama3}) {
    EXPECT_NE(apply_chat_template(t, history, {}).find(args), std::string::npos);
  }
  // 128 levels are still read as a call.
  const std::string ok_args = R"({"a":)" + std::string(126, '[') + std::string(126, ']') + "}";
  ParsedToolCalls p = parse_tool_calls(
      ChatTemplate::kQwen, "<tool_call>{\"name\": \"f\", \"arguments\": " + ok_args + "}</tool_call>");
  EXPECT_EQ(p.calls.size(), 1u);
}

TEST(ToolCallParser, Llama3JsonObjects) {
  ParsedToolCalls p = parse_tool_calls(
      ChatTemplate::kLlama3, R"(<|python_tag|>{"name": "f", "parameters": {"q": "a;b}"}}; {"name": "g", "arguments": {}})");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.content, "");
  EXPECT_EQ(p.calls[0].name, "f");
  EXPECT_EQ(p.calls[0].arguments, R"({"q": "a;b}"})");
  EXPECT_EQ(p.calls[1].name, "g");
  expect_all_text(ChatTemplate::kLlama3, {"The answer is 4.", R"({"name": "f"})",
                                          R"({"name": "f", "parameters": {}} and more)", R"({"city": "Paris"})", "{"});
  EXPECT_TRUE(parse_tool_calls(ChatTemplate::kNone, R"({"name": "f", "parameters": {}})").calls.empty());
}

// Streaming "auto": every prefix of a reply releases content that the whole reply's parse starts
// with, never less than before (the same when the search resumes there), and holds back what may
// still become a call.
void expect_streamable(ChatTemplate family, std::string_view text) {
  const std::string final_content = parse_tool_calls(family, text).content;
  size_t before = 0;
  for (size_t end = 0; end <= text.size(); ++end) {
    const size_t ready = tool_call_content_prefix(family, text.substr(0, end));
    ASSERT_EQ(tool_call_content_prefix(family, text.substr(0, end), before), ready) << "resumed at " << before;
    ASSERT_LE(ready, end);
    ASSERT_GE(ready, before) << "at " << end;
    ASSERT_TRUE(final_content.starts_with(text.substr(0, ready))) << "at " << end << ": " << text.substr(0, ready);
    before = ready;
  }
}

TEST(ToolCallParser, StreamedContentIsWhatTheWholeReplyParsesTo) {
  for (const char* text :
       {"Let me look.  \n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "Just <words> <tool_",
        "a <tool_call>{\"name\": 1}</tool_call>", "  <tool_call>\n{\"name\": \"f\", \"arguments\": {}}", "x<<tool_call>y",
        "<tool_ca", ""}) {
    SCOPED_TRACE(text);
    expect_streamable(ChatTemplate::kQwen, text);
  }
  for (const char* text : {R"( <|python_tag|>{"name": "f", "parameters": {}})", R"({"name": "f"} no)",
                           "The answer", "<|pyth", "<|pytho no", "  "}) {
    SCOPED_TRACE(text);
    expect_streamable(ChatTemplate::kLlama3, text);
  }
  // Content keeps its leading white space (it went out before a call could follow), not the
  // trailing one before the call.
  EXPECT_EQ(parse_tool_calls(ChatTemplate::kQwen, " Hi \n<tool_call>{\"name\": \"f\", \"arguments\": {}}").content,
            " Hi");
  // Text that cannot be a call goes out as it comes; what may be one is held.
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kQwen, "Let me look. \n<tool_"), 12u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kQwen, "Let me look. \n<tool_call>{"), 12u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kQwen, "a <tool_cal b"), 13u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kLlama3, "The answer"), 10u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kLlama3, " {\"name\""), 0u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kLlama3, "<|py"), 0u);
  EXPECT_EQ(tool_call_content_prefix(ChatTemplate::kNone, "{\"name\""), 7u);
}

TEST(ToolCallParser, ArgumentsAreWrittenAsTojsonDoes) {
  EXPECT_EQ(tojson_line(R"({"a":[1,2],"b":{"c":"d"}})"), R"({"a": [1, 2], "b": {"c": "d"}})");
  EXPECT_EQ(tojson_line("not json"), "not json");
}

// A byte-level tokenizer.json: one token per byte (ids 0..255) plus `added` special tokens from
// id 256 on, pre-tokenised with the Qwen2 regex.
std::unique_ptr<Tokenizer> byte_tokenizer(const std::vector<std::string>& added) {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    std::string piece;
    tokenizer_internal::append_utf8(piece, printable ? b : 256 + next++);
    vocab[piece] = b;
  }
  nlohmann::json tokens = nlohmann::json::array();
  for (size_t i = 0; i < added.size(); ++i) {
    tokens.push_back({{"id", 256 + static_cast<int>(i)}, {"content", added[i]}, {"special", true}});
  }
  nlohmann::json j = {
      {"added_tokens", tokens},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers", nlohmann::json::array({{{"type", "Split"},
                                                  {"pattern", {{"Regex", tokenizer_internal::kQwen2Regex}}},
                                                  {"behavior", "Isolated"}},
                                                 {{"type", "ByteLevel"}, {"use_regex", false}}})}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  auto r = tokenizer_internal::parse_hf_tokenizer_json(j.dump(), "bytes.json");
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(*r) : nullptr;
}

TEST(ChatTemplate, QwenMarkersEncodeAsSpecialTokens) {
  auto tok = byte_tokenizer({"<|im_start|>", "<|im_end|>"});
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->eos_id(), 257);
  const std::string text = apply_chat_template(ChatTemplate::kQwen, {{"user", "Hi"}});
  auto ids = tok->encode(text, /*add_bos=*/false, /*parse_special=*/true);
  ASSERT_TRUE(ids.is_ok());
  const std::vector<TokenId> want = {256, 'u', 's', 'e', 'r', '\n', 'H', 'i', 257, '\n', 256,
                                     'a', 's', 's', 'i', 's', 't',      'a', 'n', 't', '\n'};
  EXPECT_EQ(*ids, want);
}

// DeepSeek-R1 distills keep their base's markers (R1-Distill-Qwen: <|im_start|>; R1-Distill-Llama:
// <|start_header_id|>): their own tokens decide, and its markers encode as special tokens.
TEST(ChatTemplate, DeepSeekR1IsDetectedBeforeItsBasesTemplateAndEncodesItsMarkers) {
  const std::vector<std::string> r1 = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                       "<｜Assistant｜>"};
  for (const std::string base : {"<|im_start|>", "<|start_header_id|>"}) {
    std::vector<std::string> added = r1;
    added.push_back(base);
    auto tok = byte_tokenizer(added);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(chat_template_of(*tok, "qwen2"), ChatTemplate::kDeepSeekR1) << base;
    EXPECT_EQ(chat_template_of(*tok, "llama"), ChatTemplate::kDeepSeekR1) << base;
    auto ids = tok->encode(apply_chat_template(ChatTemplate::kDeepSeekR1, {{"user", "Hi"}}), false, true);
    ASSERT_TRUE(ids.is_ok());
    EXPECT_EQ(*ids, (std::vector<TokenId>{256, 258, 'H', 'i', 259, '<', 't', 'h', 'i', 'n', 'k', '>', '\n'}));
  }
  auto qwen = byte_tokenizer({"<|im_start|>", "<|im_end|>"});
  auto llama = byte_tokenizer({"<|start_header_id|>", "<|end_header_id|>"});
  auto plain = byte_tokenizer({});
  EXPECT_EQ(chat_template_of(*qwen, "llama"), ChatTemplate::kQwen);
  EXPECT_EQ(chat_template_of(*plain, "qwen3"), ChatTemplate::kQwen);
  EXPECT_EQ(chat_template_of(*llama, "llama"), ChatTemplate::kLlama3);
  EXPECT_EQ(chat_template_of(*plain, "llama"), ChatTemplate::kNone);
}

}  // namespace
}  // namespace specontext
