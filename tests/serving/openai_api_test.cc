// The OpenAI API's bodies: good completion and chat requests with every field, each refusal naming
// its field (message and param), malformed and non-object bodies; StopMatcher on stops split
// across pieces, earliest-match, released prefixes and UTF-8 split or broken; the response and
// stream-chunk JSON shapes.
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <string>
#include <vector>

#include "serving/openai/openai_api.h"

namespace specontext::cluster {
namespace {

using json = nlohmann::json;

ApiRequest parse_ok(ApiKind kind, const std::string& body) {
  ParseResult r = parse_api_request(kind, body);
  EXPECT_TRUE(r.request.has_value()) << body << " -> " << r.error.message;
  return r.request.value_or(ApiRequest{});
}

// The body is refused naming `param` in both the message and the param.
void expect_refused(ApiKind kind, const std::string& body, const std::string& param,
                    const std::string& message_part = "") {
  ParseResult r = parse_api_request(kind, body);
  ASSERT_FALSE(r.request.has_value()) << body;
  EXPECT_EQ(r.error.http_status, 400) << body;
  EXPECT_EQ(r.error.type, "invalid_request_error") << body;
  EXPECT_EQ(r.error.param, param) << body << " -> " << r.error.message;
  EXPECT_NE(r.error.message.find("field '" + param + "'"), std::string::npos)
      << body << " -> " << r.error.message;
  if (!message_part.empty()) {
    EXPECT_NE(r.error.message.find(message_part), std::string::npos) << body << " -> " << r.error.message;
  }
}

// A completion body {"prompt":"hi", <extra>}.
std::string completion(const std::string& extra) { return R"({"prompt":"hi",)" + extra + "}"; }
std::string chat(const std::string& extra) {
  return R"({"messages":[{"role":"user","content":"hi"}],)" + extra + "}";
}

TEST(OpenAiParse, CompletionWithAllFields) {
  const ApiRequest r = parse_ok(ApiKind::kCompletion, R"({
    "model": "stories", "prompt": "Once upon", "max_tokens": 16, "temperature": 0.5, "top_p": 0.9,
    "top_k": 40, "repetition_penalty": 1.1, "seed": 18446744073709551615, "stop": ["\n", "The end"],
    "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}, "user": "u1",
    "n": 1, "best_of": 1, "echo": false, "logprobs": null, "presence_penalty": 0, "frequency_penalty": 0.0,
    "suffix": "", "logit_bias": {}, "some_future_field": [1, 2, 3]})");
  EXPECT_EQ(r.kind, ApiKind::kCompletion);
  EXPECT_EQ(r.model, "stories");
  EXPECT_EQ(r.prompt_text, "Once upon");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_TRUE(r.prompt_ids.empty());
  EXPECT_TRUE(r.messages.empty());
  ASSERT_TRUE(r.max_tokens.has_value());
  EXPECT_EQ(*r.max_tokens, 16);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.sampling.seed, 18446744073709551615ull);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"\n", "The end"}));
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.user, "u1");
  EXPECT_TRUE(r.sampling.validate().is_ok());
}

TEST(OpenAiParse, CompletionDefaults) {
  const ApiRequest r = parse_ok(ApiKind::kCompletion, R"({"prompt":"x"})");
  EXPECT_EQ(r.model, "");
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.0f);
  EXPECT_EQ(r.sampling.seed, 0u);
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.include_usage);
  EXPECT_FALSE(r.ignore_eos);
}

TEST(OpenAiParse, NullMeansAbsent) {
  const ApiRequest r =
      parse_ok(ApiKind::kCompletion,
               R"({"prompt":"x","model":null,"max_tokens":null,"temperature":null,"stop":null,
                                    "stream":null,"stream_options":null,"n":null,"tools":null,"seed":null})");
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_TRUE(r.stop.empty());
}

TEST(OpenAiParse, PromptForms) {
  ApiRequest r = parse_ok(ApiKind::kCompletion, R"({"prompt":[1, 0, 2147483647]})");
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<TokenId>{1, 0, 2147483647}));
  EXPECT_EQ(r.prompt_text, "");
  // A batch of one is its prompt.
  r = parse_ok(ApiKind::kCompletion, R"({"prompt":["only one"]})");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_text, "only one");
  r = parse_ok(ApiKind::kCompletion, R"({"prompt":[[5, 6]]})");
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<TokenId>{5, 6}));
  // vLLM's prompt_logprobs, in both APIs; json_object output.
  r = parse_ok(ApiKind::kCompletion,
               R"({"prompt":"x","prompt_logprobs":3,"response_format":{"type":"json_object"}})");
  EXPECT_EQ(r.prompt_logprobs, 3);
  EXPECT_EQ(r.structured, ApiRequest::Structured::kJsonObject);
  EXPECT_EQ(parse_ok(ApiKind::kChat, R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":0})")
                .prompt_logprobs,
            0);
  EXPECT_EQ(parse_ok(ApiKind::kCompletion, R"({"prompt":"x","prompt_logprobs":null})").prompt_logprobs, -1);
  // Integral floats pass as integers.
  r = parse_ok(ApiKind::kCompletion, R"({"prompt":[3.0], "max_tokens": 4.0})");
  EXPECT_EQ(r.prompt_ids, (std::vector<TokenId>{3}));
  EXPECT_EQ(r.max_tokens, 4);
}

TEST(OpenAiParse, PromptRefusals) {
  const auto k = ApiKind::kCompletion;
  expect_refused(k, R"({})", "prompt", "is required");
  expect_refused(k, R"({"prompt":null})", "prompt", "is required");
  expect_refused(k, R"({"prompt":""})", "prompt", "must not be empty");
  expect_refused(k, R"({"prompt":[]})", "prompt", "must not be empty");
  expect_refused(k, R"({"prompt":5})", "prompt");
  expect_refused(k, R"({"prompt":{"text":"a"}})", "prompt");
  expect_refused(k, R"({"prompt":["a","b"]})", "prompt", "several prompts per request are not supported");
  expect_refused(k, R"({"prompt":[[1],[2]]})", "prompt", "several prompts");
  expect_refused(k, R"({"prompt":[1,-2]})", "prompt[1]", "token id");
  expect_refused(k, R"({"prompt":[1,2.5]})", "prompt[1]", "token id");
  expect_refused(k, R"({"prompt":[1,"a"]})", "prompt[1]", "token id");
  expect_refused(k, R"({"prompt":[2147483648]})", "prompt[0]", "token id");
  expect_refused(k, R"({"prompt":[""]})", "prompt[0]", "must not be empty");
  expect_refused(k, R"({"prompt":[[1,-1]]})", "prompt[0][1]", "token id");
  // The chat body's field does not stand in for the prompt.
  expect_refused(k, R"({"messages":[{"role":"user","content":"hi"}]})", "prompt");
}

TEST(OpenAiParse, ChatWithAllFields) {
  const ApiRequest r = parse_ok(ApiKind::kChat, R"({
    "model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}], "name": "bob"},
      {"role": "assistant", "content": "Hi!", "tool_calls": []},
      {"role": "user", "content": ""}],
    "max_completion_tokens": 7, "max_tokens": 7, "temperature": 0, "top_p": 1, "top_k": -1,
    "repetition_penalty": 2, "seed": 0, "stop": "###", "stream": false, "logprobs": false,
    "top_logprobs": null, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
    "n": 1.0, "parallel_tool_calls": false})");
  EXPECT_EQ(r.kind, ApiKind::kChat);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[0].content, "Be brief.");
  EXPECT_EQ(r.messages[1].role, "user");
  EXPECT_EQ(r.messages[1].content, "Hello\nthere");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "Hi!");
  EXPECT_EQ(r.messages[3].content, "");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 2.0f);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"###"}));
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.prompt_text, "");
  EXPECT_TRUE(r.sampling.validate().is_ok());
}

TEST(OpenAiParse, MessageRefusals) {
  const auto k = ApiKind::kChat;
  expect_refused(k, R"({"prompt":"hi"})", "messages", "is required");
  expect_refused(k, R"({"messages":[]})", "messages", "non-empty");
  expect_refused(k, R"({"messages":"hi"})", "messages");
  expect_refused(k, R"({"messages":["hi"]})", "messages[0]", "must be an object");
  expect_refused(k, R"({"messages":[{"role":"user","content":"a"},{"role":"function","content":"b"}]})",
                 "messages[1].role", "must be one of system, user, assistant");
  expect_refused(k, R"({"messages":[{"role":"user","content":"a"},{"role":"tool","content":"b"}]})",
                 "messages[1].tool_call_id", "is required");
  expect_refused(k, R"({"messages":[{"content":"a"}]})", "messages[0].role");
  expect_refused(k, R"({"messages":[{"role":1,"content":"a"}]})", "messages[0].role");
  expect_refused(k, R"({"messages":[{"role":"user"}]})", "messages[0].content", "is required");
  expect_refused(k, R"({"messages":[{"role":"user","content":null}]})", "messages[0].content");
  expect_refused(k, R"({"messages":[{"role":"user","content":3}]})", "messages[0].content");
  expect_refused(
      k, R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]}]})",
      "messages[0].content[1].type", "only text content is supported");
  expect_refused(k, R"({"messages":[{"role":"user","content":[{"text":"a"}]}]})",
                 "messages[0].content[0].type");
  expect_refused(k, R"({"messages":[{"role":"user","content":[{"type":"text","text":5}]}]})",
                 "messages[0].content[0].text", "must be a string");
  expect_refused(k, R"({"messages":[{"role":"user","content":["a"]}]})", "messages[0].content[0]");
  expect_refused(k, R"({"messages":[{"role":"assistant","content":"","tool_calls":[{"id":"x"}]}]})",
                 "messages[0].tool_calls[0]");
  expect_refused(k, R"({"messages":[{"role":"user","content":"a","tool_calls":[]}]})", "messages[0].tool_calls",
                 "assistant messages only");
  expect_refused(k, R"({"messages":[{"role":"tool","content":"a","tool_call_id":3}]})",
                 "messages[0].tool_call_id");
}

TEST(OpenAiParse, TypeAndRangeRefusals) {
  const auto k = ApiKind::kCompletion;
  expect_refused(k, completion(R"("model":3)"), "model", "must be a string");
  expect_refused(k, completion(R"("user":false)"), "user", "must be a string");
  expect_refused(k, completion(R"("max_tokens":0)"), "max_tokens", "must be a positive integer");
  expect_refused(k, completion(R"("max_tokens":-5)"), "max_tokens", "must be a positive integer");
  expect_refused(k, completion(R"("max_tokens":1.5)"), "max_tokens", "must be a positive integer");
  expect_refused(k, completion(R"("max_tokens":"8")"), "max_tokens", "must be a positive integer");
  expect_refused(k, completion(R"("max_tokens":18446744073709551615)"), "max_tokens");
  expect_refused(k, completion(R"("max_completion_tokens":0)"), "max_completion_tokens");
  expect_refused(k, completion(R"("max_tokens":8,"max_completion_tokens":9)"), "max_completion_tokens",
                 "must equal 'max_tokens'");
  expect_refused(k, completion(R"("temperature":2.01)"), "temperature", "between 0 and 2");
  expect_refused(k, completion(R"("temperature":-0.1)"), "temperature");
  expect_refused(k, completion(R"("temperature":"hot")"), "temperature");
  expect_refused(k, completion(R"("top_p":0)"), "top_p");
  expect_refused(k, completion(R"("top_p":1.5)"), "top_p");
  expect_refused(k, completion(R"("top_p":1e-300)"), "top_p");
  expect_refused(k, completion(R"("top_k":-2)"), "top_k");
  expect_refused(k, completion(R"("top_k":2.5)"), "top_k");
  expect_refused(k, completion(R"("repetition_penalty":0)"), "repetition_penalty", "greater than 0");
  expect_refused(k, completion(R"("repetition_penalty":-1)"), "repetition_penalty");
  expect_refused(k, completion(R"("repetition_penalty":1e300)"), "repetition_penalty");
  expect_refused(k, completion(R"("seed":-1)"), "seed", "integer >= 0");
  expect_refused(k, completion(R"("seed":1.5)"), "seed");
  expect_refused(k, completion(R"("seed":"7")"), "seed");
  expect_refused(k, completion(R"("stream":1)"), "stream", "must be a boolean");
  expect_refused(k, completion(R"("stream":"true")"), "stream", "must be a boolean");
  expect_refused(k, completion(R"("ignore_eos":0)"), "ignore_eos", "must be a boolean");
  expect_refused(k, completion(R"("stream_options":{"include_usage":true})"), "stream_options",
                 "only allowed when 'stream' is true");
  expect_refused(k, completion(R"("stream":false,"stream_options":{})"), "stream_options");
  expect_refused(k, completion(R"("stream":true,"stream_options":true)"), "stream_options",
                 "must be an object");
  expect_refused(k, completion(R"("stream":true,"stream_options":{"include_usage":1})"),
                 "stream_options.include_usage", "must be a boolean");
}

TEST(OpenAiParse, TopKAndSeedValues) {
  EXPECT_EQ(parse_ok(ApiKind::kCompletion, completion(R"("top_k":0)")).sampling.top_k, 0);
  EXPECT_EQ(parse_ok(ApiKind::kCompletion, completion(R"("top_k":1)")).sampling.top_k, 1);
  EXPECT_EQ(parse_ok(ApiKind::kCompletion, completion(R"("top_k":10000000000)")).sampling.top_k, 2147483647);
  EXPECT_EQ(parse_ok(ApiKind::kCompletion, completion(R"("seed":42)")).sampling.seed, 42u);
  EXPECT_FLOAT_EQ(parse_ok(ApiKind::kCompletion, completion(R"("temperature":2)")).sampling.temperature,
                  2.0f);
  const ApiRequest r = parse_ok(ApiKind::kCompletion, completion(R"("stream":true,"stream_options":{})"));
  EXPECT_TRUE(r.stream);
  EXPECT_FALSE(r.include_usage);
}

TEST(OpenAiParse, StopRefusals) {
  const auto k = ApiKind::kCompletion;
  EXPECT_EQ(parse_ok(k, completion(R"("stop":[])")).stop.size(), 0u);
  EXPECT_EQ(parse_ok(k, completion(R"("stop":["a","b","c","d"])")).stop.size(), 4u);
  expect_refused(k, completion(R"("stop":["a","b","c","d","e"])"), "stop", "may hold at most 4 strings");
  expect_refused(k, completion(R"("stop":"")"), "stop");
  expect_refused(k, completion(R"("stop":5)"), "stop");
  expect_refused(k, completion(R"("stop":["a",""])"), "stop[1]", "non-empty string");
  expect_refused(k, completion(R"("stop":["a",7])"), "stop[1]");
}

TEST(OpenAiParse, BestOfIsACompletionsFieldOfAtLeastNAndNotStreamed) {
  ParseResult plain = parse_api_request(ApiKind::kCompletion, completion(R"("n":3)"));
  ASSERT_TRUE(plain.request) << plain.error.message;
  EXPECT_EQ(plain.request->best_of, 3) << "best_of defaults to n";
  ParseResult best = parse_api_request(ApiKind::kCompletion, completion(R"("n":2,"best_of":5.0)"));
  ASSERT_TRUE(best.request) << best.error.message;
  EXPECT_EQ(best.request->n, 2);
  EXPECT_EQ(best.request->best_of, 5);
  ParseResult streamed_equal =
      parse_api_request(ApiKind::kCompletion, completion(R"("n":2,"best_of":2,"stream":true)"));
  ASSERT_TRUE(streamed_equal.request) << streamed_equal.error.message;
  ParseResult null_best = parse_api_request(ApiKind::kCompletion, completion(R"("n":2,"best_of":null)"));
  ASSERT_TRUE(null_best.request) << null_best.error.message;
  EXPECT_EQ(null_best.request->best_of, 2);
  expect_refused(ApiKind::kCompletion, completion(R"("n":3,"best_of":2)"), "best_of", "between n (3) and 16");
  expect_refused(ApiKind::kCompletion, completion(R"("best_of":17)"), "best_of", "between n (1) and 16");
  expect_refused(ApiKind::kCompletion, completion(R"("best_of":0)"), "best_of");
  expect_refused(ApiKind::kCompletion, completion(R"("best_of":"2")"), "best_of");
  expect_refused(ApiKind::kCompletion, completion(R"("best_of":3,"stream":true)"), "best_of", "when streaming");
  expect_refused(ApiKind::kChat, chat(R"("best_of":2)"), "best_of", "completions field");
  ParseResult chat_one = parse_api_request(ApiKind::kChat, chat(R"("n":2,"best_of":1)"));
  ASSERT_TRUE(chat_one.request) << chat_one.error.message;
  EXPECT_EQ(chat_one.request->best_of, 2) << "chat: always n";
}

TEST(OpenAiParse, StructuredOutputKeepsTheSchemasKeyOrderAndIsOnePerRequest) {
  // The properties come in the body's order (z before a), not nlohmann's sorted one.
  ParseResult r = parse_api_request(
      ApiKind::kCompletion,
      completion(R"("response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,)"
                 R"("schema":{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}}})"));
  ASSERT_TRUE(r.request) << r.error.message;
  EXPECT_EQ(r.request->structured, ApiRequest::Structured::kJsonSchema);
  EXPECT_EQ(r.request->structured_field, "response_format");
  std::vector<std::string> keys;
  for (const auto& [key, value] : r.request->schema["properties"].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"z", "a"}));
  for (const char* guided : {R"("guided_json":{"properties":{"z":{},"a":{}}})",
                             R"("guided_json":"{\"properties\":{\"z\":{},\"a\":{}}}")"}) {
    ParseResult g = parse_api_request(ApiKind::kChat, chat(guided));
    ASSERT_TRUE(g.request) << guided << " -> " << g.error.message;
    EXPECT_EQ(g.request->structured_field, "guided_json");
    keys.clear();
    for (const auto& [key, value] : g.request->schema["properties"].items()) keys.push_back(key);
    EXPECT_EQ(keys, (std::vector<std::string>{"z", "a"})) << guided;
  }
  ParseResult c = parse_api_request(ApiKind::kCompletion, completion(R"("guided_choice":["yes","no"])"));
  ASSERT_TRUE(c.request) << c.error.message;
  EXPECT_EQ(c.request->structured, ApiRequest::Structured::kChoice);
  EXPECT_EQ(c.request->choices, (std::vector<std::string>{"yes", "no"}));
  ParseResult bool_schema = parse_api_request(
      ApiKind::kCompletion, completion(R"("response_format":{"type":"json_schema","json_schema":{"schema":true}})"));
  ASSERT_TRUE(bool_schema.request) << bool_schema.error.message;
  EXPECT_EQ(bool_schema.request->schema, nlohmann::ordered_json(true));

  const ApiKind k = ApiKind::kCompletion;
  expect_refused(k, completion(R"("response_format":{"type":"json_object"},"guided_choice":["a"])"), "guided_choice",
                 "cannot be combined with 'response_format'");
  expect_refused(k, completion(R"("guided_json":{},"guided_choice":["a"])"), "guided_choice", "one structured output");
  expect_refused(k, completion(R"("response_format":{"type":"json_schema","json_schema":{"schema":3}})"),
                 "response_format", "json_schema needs");
  expect_refused(k, completion(R"("response_format":{"type":"json_schema","json_schema":{"schema":{},"name":1}})"),
                 "response_format", "name must be a string");
  expect_refused(k, completion(R"("response_format":{"type":"json_schema","json_schema":{"schema":{},"strict":1}})"),
                 "response_format", "strict must be a boolean");
  expect_refused(k, completion(R"("guided_json":"{not json")"), "guided_json", "must be a JSON Schema");
  expect_refused(k, completion(R"("guided_json":[1])"), "guided_json");
  expect_refused(k, completion(R"("guided_choice":[])"), "guided_choice", "non-empty array");
  expect_refused(k, completion(R"("guided_choice":["a",""])"), "guided_choice[1]", "non-empty string");
  expect_refused(k, completion(R"("guided_choice":["a",2])"), "guided_choice[1]");
  expect_refused(k, completion(R"("guided_regex":"a+")"), "guided_regex", "not supported");
  expect_refused(k, completion(R"("guided_grammar":"root ::= x")"), "guided_grammar", "not supported");
}

TEST(OpenAiParse, ToolsAndToolChoice) {
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","description":"Weather in a city",)"
      R"("parameters":{"type":"object","properties":{"zcity":{"type":"string"},"aunit":{"enum":["c","f"]}},)"
      R"("required":["zcity"]}}},{"type":"function","function":{"name":"now"}}])";
  ParseResult named = parse_api_request(
      ApiKind::kChat, chat(tools + R"(,"tool_choice":{"type":"function","function":{"name":"get_weather"}})"));
  ASSERT_TRUE(named.request) << named.error.message;
  const ApiRequest& r = *named.request;
  EXPECT_EQ(r.tool_choice, ApiRequest::ToolChoice::kNamed);
  EXPECT_EQ(r.tool_choice_name, "get_weather");
  ASSERT_EQ(r.tools.size(), 2u);
  EXPECT_EQ(r.tools[0].name, "get_weather");
  // The body's own key order, in the parameters and the definition shown to the model.
  std::vector<std::string> keys;
  for (const auto& [key, value] : r.tools[0].parameters["properties"].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"zcity", "aunit"}));
  EXPECT_LT(r.tools[0].definition.find("zcity"), r.tools[0].definition.find("aunit")) << r.tools[0].definition;
  EXPECT_TRUE(r.tools[0].definition.starts_with(R"({"type":"function","function":{"name":"get_weather")"))
      << r.tools[0].definition;
  // No parameters: no arguments, {} only.
  EXPECT_EQ(r.tools[1].parameters["additionalProperties"], false);
  ParseResult required = parse_api_request(ApiKind::kChat, chat(tools + R"(,"tool_choice":"required")"));
  ASSERT_TRUE(required.request) << required.error.message;
  EXPECT_EQ(required.request->tool_choice, ApiRequest::ToolChoice::kRequired);
  ParseResult none = parse_api_request(ApiKind::kChat, chat(tools + R"(,"tool_choice":"none")"));
  ASSERT_TRUE(none.request) << none.error.message;
  EXPECT_EQ(none.request->tool_choice, ApiRequest::ToolChoice::kNone);
  // History with calls and their results.
  ParseResult history = parse_api_request(
      ApiKind::kChat,
      R"({"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[)"
      R"({"id":"call_1","type":"function","function":{"name":"now","arguments":"{}"}}]},)"
      R"({"role":"tool","tool_call_id":"call_1","content":"noon"}]})");
  ASSERT_TRUE(history.request) << history.error.message;
  ASSERT_EQ(history.request->messages.size(), 3u);
  ASSERT_EQ(history.request->messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(history.request->messages[1].tool_calls[0].name, "now");
  EXPECT_EQ(history.request->messages[1].tool_calls[0].arguments, "{}");
  EXPECT_EQ(history.request->messages[2].role, "tool");
  EXPECT_EQ(history.request->messages[2].tool_call_id, "call_1");

  const ApiKind k = ApiKind::kChat;
  // "auto" is the default with tools; it leaves the text free, so response_format may join it.
  for (const std::string& extra : {std::string(), std::string(R"(,"tool_choice":"auto")"),
                                   std::string(R"(,"response_format":{"type":"json_object"})")}) {
    ParseResult a = parse_api_request(ApiKind::kChat, chat(tools + extra));
    ASSERT_TRUE(a.request) << extra << ": " << a.error.message;
    EXPECT_EQ(a.request->tool_choice, ApiRequest::ToolChoice::kAuto) << extra;
  }
  ParseResult no_tools = parse_api_request(ApiKind::kChat, chat(R"("tool_choice":"auto")"));
  ASSERT_TRUE(no_tools.request) << no_tools.error.message;
  EXPECT_EQ(no_tools.request->tool_choice, ApiRequest::ToolChoice::kNone);
  ParseResult streamed = parse_api_request(k, chat(tools + R"(,"tool_choice":"required","stream":true)"));
  ASSERT_TRUE(streamed.request) << streamed.error.message;  // the calls come as delta.tool_calls
  EXPECT_TRUE(streamed.request->stream);
  expect_refused(k, chat(tools + R"(,"tool_choice":{"type":"function","function":{"name":"nope"}})"), "tool_choice",
                 "'nope', which is not in 'tools'");
  expect_refused(k, chat(tools + R"(,"tool_choice":"required","response_format":{"type":"json_object"})"),
                 "response_format", "cannot be combined with 'tool_choice'");
  expect_refused(k, chat(tools + R"(,"tool_choice":7)"), "tool_choice");
  expect_refused(k, chat(R"("tools":{},"tool_choice":"required")"), "tools");
  expect_refused(k, chat(R"("tools":[{"type":"function"}],"tool_choice":"required")"), "tools[0]");
  expect_refused(k, chat(R"("tools":[{"type":"code","function":{"name":"f"}}],"tool_choice":"required")"), "tools[0]");
  expect_refused(k, chat(R"("tools":[{"type":"function","function":{"name":"a b"}}],"tool_choice":"required")"),
                 "tools[0].function.name");
  expect_refused(k,
                 chat(R"("tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"f"}}],)"
                      R"("tool_choice":"required")"),
                 "tools[1].function.name", "repeats");
  expect_refused(k, chat(R"("tools":[{"type":"function","function":{"name":"f","parameters":[]}}],"tool_choice":"required")"),
                 "tools[0].function.parameters");
  expect_refused(ApiKind::kCompletion, completion(tools + R"(,"tool_choice":"required")"), "tools", "chat");
}

TEST(OpenAiParse, TokenizeAndDetokenizeBodies) {
  TokenizeParse p = parse_tokenize_request(R"({"prompt":"hi","model":"m"})");
  ASSERT_TRUE(p.request) << p.error.message;
  EXPECT_EQ(p.request->kind, ApiKind::kCompletion);
  EXPECT_EQ(p.request->prompt, "hi");
  EXPECT_EQ(p.request->model, "m");
  EXPECT_TRUE(p.request->add_special_tokens);
  EXPECT_FALSE(p.request->return_token_strs);
  TokenizeParse c = parse_tokenize_request(
      R"({"messages":[{"role":"user","content":"hi"}],"return_token_strs":true,"add_generation_prompt":true})");
  ASSERT_TRUE(c.request) << c.error.message;
  EXPECT_EQ(c.request->kind, ApiKind::kChat);
  ASSERT_EQ(c.request->messages.size(), 1u);
  EXPECT_FALSE(c.request->add_special_tokens) << "vLLM's chat default";
  EXPECT_TRUE(c.request->return_token_strs);
  TokenizeParse empty_prompt = parse_tokenize_request(R"({"prompt":""})");
  ASSERT_TRUE(empty_prompt.request) << "an empty prompt tokenizes to nothing (or the BOS)";
  struct Bad {
    const char* body;
    const char* param;
  };
  for (const Bad& b : std::vector<Bad>{{R"({})", "prompt"},
                                       {R"({"prompt":[1,2]})", "prompt"},
                                       {R"({"prompt":"x","messages":[]})", "prompt"},
                                       {R"({"messages":[]})", "messages"},
                                       {R"({"messages":[{"role":"robot","content":"x"}]})", "messages[0].role"},
                                       {R"({"prompt":"x","return_token_strs":1})", "return_token_strs"},
                                       {R"({"prompt":"x","add_generation_prompt":true})", "add_generation_prompt"},
                                       {R"({"messages":[{"role":"user","content":"x"}],"add_generation_prompt":false})",
                                        "add_generation_prompt"},
                                       {R"({"prompt":"x","model":7})", "model"}}) {
    TokenizeParse r = parse_tokenize_request(b.body);
    ASSERT_FALSE(r.request) << b.body;
    EXPECT_EQ(r.error.http_status, 400) << b.body;
    EXPECT_EQ(r.error.param, b.param) << b.body << " -> " << r.error.message;
  }
  EXPECT_FALSE(parse_tokenize_request("[1]").request);
  EXPECT_FALSE(parse_tokenize_request("{").request);

  DetokenizeParse d = parse_detokenize_request(R"({"tokens":[1,2,3.0]})");
  ASSERT_TRUE(d.request) << d.error.message;
  EXPECT_EQ(d.request->tokens, (std::vector<TokenId>{1, 2, 3}));
  EXPECT_TRUE(parse_detokenize_request(R"({"tokens":[]})").request);
  for (const Bad& b : std::vector<Bad>{{R"({})", "tokens"},
                                       {R"({"tokens":"1 2"})", "tokens"},
                                       {R"({"tokens":[1,-1]})", "tokens[1]"},
                                       {R"({"tokens":[1.5]})", "tokens[0]"}}) {
    DetokenizeParse r = parse_detokenize_request(b.body);
    ASSERT_FALSE(r.request) << b.body;
    EXPECT_EQ(r.error.param, b.param) << b.body << " -> " << r.error.message;
  }
  // The answer's shape.
  const std::vector<TokenId> ids = {1, 5};
  const std::vector<std::string> strs = {"", "\xff"};
  const nlohmann::json a = tokenize_response(ids, 512, &strs);
  EXPECT_EQ(a["count"], 2);
  EXPECT_EQ(a["max_model_len"], 512);
  EXPECT_EQ(a["tokens"], nlohmann::json({1, 5}));
  EXPECT_EQ(a["token_strs"][1], "\xEF\xBF\xBD") << "invalid UTF-8 is replaced";
  EXPECT_FALSE(tokenize_response(ids, 512, nullptr).contains("token_strs"));
}

TEST(OpenAiParse, UnsupportedFeatureRefusals) {
  for (ApiKind k : {ApiKind::kCompletion, ApiKind::kChat}) {
    auto body = [k](const std::string& extra) {
      return k == ApiKind::kCompletion ? completion(extra) : chat(extra);
    };
    expect_refused(k, body(R"("n":17)"), "n", "must be an integer between 1 and 16");
    expect_refused(k, body(R"("n":0)"), "n", "between 1 and 16");
    expect_refused(k, body(R"("n":"1")"), "n", "must be an integer");
    expect_refused(k, body(R"("n":1.5)"), "n", "must be an integer");
    ParseResult n = parse_api_request(k, body(R"("n":4.0)"));
    ASSERT_TRUE(n.request) << n.error.message;
    EXPECT_EQ(n.request->n, 4);
    expect_refused(k, body(R"("echo":"no")"), "echo", "must be a boolean");
    expect_refused(k, body(R"("presence_penalty":2.5)"), "presence_penalty", "between -2 and 2");
    expect_refused(k, body(R"("frequency_penalty":-3)"), "frequency_penalty", "between -2 and 2");
    expect_refused(k, body(R"("frequency_penalty":"0")"), "frequency_penalty", "must be a number");
    expect_refused(k, body(R"("suffix":"end")"), "suffix");
    expect_refused(k, body(R"("suffix":1)"), "suffix");
    if (k == ApiKind::kCompletion) {
      expect_refused(k, body(R"("tools":[{"type":"function","function":{"name":"f"}}])"), "tools");
    } else {  // chat: "auto", the default with tools
      ParseResult t = parse_api_request(k, body(R"("tools":[{"type":"function","function":{"name":"f"}}])"));
      ASSERT_TRUE(t.request) << t.error.message;
      EXPECT_EQ(t.request->tool_choice, ApiRequest::ToolChoice::kAuto);
    }
    expect_refused(k, body(R"("functions":[{"name":"f"}])"), "functions");
    expect_refused(k, body(R"("tool_choice":"required")"), "tool_choice");
    expect_refused(k, body(R"("tool_choice":{"type":"function","function":{"name":"f"}})"), "tool_choice");
    expect_refused(k, body(R"("function_call":{"name":"f"})"), "function_call");
    expect_refused(k, body(R"("response_format":{"type":"json_schema","json_schema":{"name":"x"}})"),
                   "response_format", "json_schema needs");
    expect_refused(k, body(R"("response_format":{"type":"xml"})"), "response_format");
    expect_refused(k, body(R"("response_format":{})"), "response_format");
    expect_refused(k, body(R"("response_format":"text")"), "response_format");
    expect_refused(k, body(R"("logit_bias":{"50256":-101})"), "logit_bias.50256", "between -100 and 100");
    expect_refused(k, body(R"("logit_bias":{"abc":1})"), "logit_bias", "not a token id");
    expect_refused(k, body(R"("logit_bias":{"-5":1})"), "logit_bias", "not a token id");
    expect_refused(k, body(R"("logit_bias":[1])"), "logit_bias", "must be an object");
    expect_refused(k, body(R"("logit_bias":{"7":"x"})"), "logit_bias.7", "must be a number");
    expect_refused(k, body(R"("min_p":1.1)"), "min_p", "between 0 and 1");
    expect_refused(k, body(R"("min_p":"0.1")"), "min_p", "must be a number");
    expect_refused(k, body(R"("min_tokens":-1)"), "min_tokens", "integer >= 0");
    expect_refused(k, body(R"("max_tokens":4,"min_tokens":5)"), "min_tokens", "must not exceed");
    ParseResult mins = parse_api_request(k, body(R"("max_tokens":8,"min_tokens":8,"min_p":0.05)"));
    ASSERT_TRUE(mins.request) << mins.error.message;
    EXPECT_EQ(mins.request->min_tokens, 8);
    EXPECT_FLOAT_EQ(mins.request->min_p, 0.05f);
    expect_refused(k, body(R"("stop_token_ids":[-2])"), "stop_token_ids[0]", "token id");
    expect_refused(k, body(R"("stop_token_ids":3)"), "stop_token_ids", "must be an array");
    ParseResult adj = parse_api_request(k, body(R"("presence_penalty":-0.5,"frequency_penalty":1.25,
                                                    "logit_bias":{"12":-100,"7":3.5},"stop_token_ids":[2,9])"));
    ASSERT_TRUE(adj.request) << adj.error.message;
    EXPECT_FLOAT_EQ(adj.request->presence_penalty, -0.5f);
    EXPECT_FLOAT_EQ(adj.request->frequency_penalty, 1.25f);
    ASSERT_EQ(adj.request->logit_bias.size(), 2u);
    std::map<TokenId, float> bias(adj.request->logit_bias.begin(), adj.request->logit_bias.end());
    EXPECT_FLOAT_EQ(bias[12], -100.0f);
    EXPECT_FLOAT_EQ(bias[7], 3.5f);
    EXPECT_EQ(adj.request->stop_token_ids, (std::vector<TokenId>{2, 9}));
    expect_refused(k, body(R"("use_beam_search":true)"), "use_beam_search");
    expect_refused(k, body(R"("include_stop_str_in_output":true)"), "include_stop_str_in_output");
    expect_refused(k, body(R"("prompt_logprobs":21)"), "prompt_logprobs", "between 0 and 20");
    expect_refused(k, body(R"("prompt_logprobs":-1)"), "prompt_logprobs");
    expect_refused(k, body(R"("prompt_logprobs":true)"), "prompt_logprobs");
    // Their "off" values are accepted.
    parse_ok(k,
             body(R"("n":1,"best_of":1,"echo":false,"presence_penalty":0,"frequency_penalty":0,"suffix":null,
                       "tools":[],"tool_choice":"auto","function_call":"none","response_format":{"type":"text"},
                       "logit_bias":null,"min_p":0,"min_tokens":0,"stop_token_ids":[],"use_beam_search":false,
                       "logprobs":false,"top_logprobs":null)"));
  }
}

// Completions take a count in "logprobs"; chat takes "logprobs": true and "top_logprobs" beside it.
TEST(OpenAiParse, Logprobs) {
  auto parsed = [](ApiKind k, const std::string& body) {
    ParseResult r = parse_api_request(k, body);
    EXPECT_TRUE(r.request) << body << ": " << r.error.message;
    return r.request ? r.request->logprobs : -2;
  };
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("stream":false)")), -1);
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("logprobs":null)")), -1);
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("logprobs":false)")), -1);
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("logprobs":0)")), 0);
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("logprobs":5)")), 5);
  EXPECT_EQ(parsed(ApiKind::kCompletion, completion(R"("logprobs":20.0)")), 20);
  expect_refused(ApiKind::kCompletion, completion(R"("logprobs":21)"), "logprobs", "between 0 and 20");
  expect_refused(ApiKind::kCompletion, completion(R"("logprobs":-1)"), "logprobs", "between 0 and 20");
  expect_refused(ApiKind::kCompletion, completion(R"("logprobs":true)"), "logprobs", "must be an integer");
  expect_refused(ApiKind::kCompletion, completion(R"("logprobs":"3")"), "logprobs", "must be an integer");
  expect_refused(ApiKind::kCompletion, completion(R"("logprobs":1.5)"), "logprobs", "must be an integer");
  expect_refused(ApiKind::kCompletion, completion(R"("top_logprobs":3)"), "top_logprobs", "chat field");

  EXPECT_EQ(parsed(ApiKind::kChat, chat(R"("stream":false)")), -1);
  EXPECT_EQ(parsed(ApiKind::kChat, chat(R"("logprobs":false,"top_logprobs":null)")), -1);
  EXPECT_EQ(parsed(ApiKind::kChat, chat(R"("logprobs":true)")), 0);
  EXPECT_EQ(parsed(ApiKind::kChat, chat(R"("logprobs":true,"top_logprobs":3)")), 3);
  EXPECT_EQ(parsed(ApiKind::kChat, chat(R"("logprobs":true,"top_logprobs":0)")), 0);
  expect_refused(ApiKind::kChat, chat(R"("logprobs":1)"), "logprobs", "must be a boolean");
  expect_refused(ApiKind::kChat, chat(R"("top_logprobs":2)"), "top_logprobs", "only allowed when 'logprobs' is true");
  expect_refused(ApiKind::kChat, chat(R"("logprobs":false,"top_logprobs":2)"), "top_logprobs", "only allowed");
  expect_refused(ApiKind::kChat, chat(R"("logprobs":true,"top_logprobs":21)"), "top_logprobs", "between 0 and 20");
  expect_refused(ApiKind::kChat, chat(R"("logprobs":true,"top_logprobs":true)"), "top_logprobs", "must be an integer");

  // echo: completions only.
  ParseResult echo = parse_api_request(ApiKind::kCompletion, completion(R"("echo":true,"logprobs":1)"));
  ASSERT_TRUE(echo.request) << echo.error.message;
  EXPECT_TRUE(echo.request->echo);
  EXPECT_FALSE(parse_api_request(ApiKind::kCompletion, completion(R"("echo":false)")).request->echo);
  expect_refused(ApiKind::kChat, chat(R"("echo":true)"), "echo", "chat completions do not echo");
  expect_refused(ApiKind::kCompletion, completion(R"("echo":1)"), "echo", "must be a boolean");
}

TEST(OpenAiParse, MalformedAndNonObjectBodies) {
  for (ApiKind k : {ApiKind::kCompletion, ApiKind::kChat}) {
    for (const std::string body :
         {"", "{", R"({"prompt": "a",})", "{'prompt': 'a'}", "nul", "{\"a\":\"\xff\"}"}) {
      ParseResult r = parse_api_request(k, body);
      ASSERT_FALSE(r.request.has_value()) << body;
      EXPECT_EQ(r.error.http_status, 400);
      EXPECT_EQ(r.error.param, "");
      EXPECT_TRUE(r.error.message.starts_with("request body is not valid JSON: ")) << r.error.message;
      EXPECT_GT(r.error.message.size(), std::string("request body is not valid JSON: ").size());
      EXPECT_EQ(r.error.message.find("[json.exception"), std::string::npos) << r.error.message;
    }
    for (const std::string body : {"[]", "null", "42", R"("prompt")", "[{\"prompt\":\"a\"}]"}) {
      ParseResult r = parse_api_request(k, body);
      ASSERT_FALSE(r.request.has_value()) << body;
      EXPECT_EQ(r.error.message, "request body must be a JSON object");
      EXPECT_EQ(r.error.param, "");
    }
  }
}

// 150000 arrays inside each other (about 300 KB). Before the depth check, copying the schema or
// the tool out of the body recursed once per level and overflowed the stack (exit 139).
std::string deep_array() { return std::string(150000, '[') + std::string(150000, ']'); }

TEST(OpenAiParse, DeeplyNestedBodiesAreRefusedNamingTheFieldBeforeAnyTreeIsBuilt) {
  const std::string deep = deep_array();
  const std::string why = "nests arrays and objects deeper than 128 levels";
  expect_refused(ApiKind::kCompletion, completion(R"("guided_json":{"properties":{"a":)" + deep + "}}"),
                 "guided_json", why);
  expect_refused(ApiKind::kChat, chat(R"("guided_json":{"properties":{"a":)" + deep + "}}"), "guided_json",
                 why);
  expect_refused(ApiKind::kCompletion,
                 completion(R"("response_format":{"type":"json_schema","json_schema":{"name":"n","schema":)"
                            R"({"properties":{"a":)" +
                            deep + "}}}}"),
                 "response_format", why);
  expect_refused(
      ApiKind::kChat,
      chat(R"("tools":[{"type":"function","function":{"name":"f","parameters":{"properties":{"a":)" + deep +
           "}}}}]"),
      "tools", why);
  // The message says where (the path's first steps).
  ParseResult r = parse_api_request(
      ApiKind::kChat,
      chat(R"("tools":[{"type":"function","function":{"name":"f","parameters":)" + deep + "}}]"));
  ASSERT_FALSE(r.request);
  EXPECT_NE(r.error.message.find("(at tools[0].function.parameters[0][0]"), std::string::npos)
      << r.error.message;
  // A schema written as JSON text is checked before it is parsed.
  expect_refused(ApiKind::kCompletion, completion(R"("guided_json":")" + deep + R"(")"), "guided_json", why);
  // Anywhere else in the body too, and the tokenize routes; a deep body that is all arrays names
  // no field.
  expect_refused(ApiKind::kCompletion, completion(R"("user_data":)" + deep), "user_data", why);
  TokenizeParse t = parse_tokenize_request(R"({"prompt":"hi","x":)" + deep + "}");
  ASSERT_FALSE(t.request);
  EXPECT_EQ(t.error.param, "x");
  ParseResult all = parse_api_request(ApiKind::kCompletion, deep);
  ASSERT_FALSE(all.request);
  EXPECT_EQ(all.error.param, "");
  EXPECT_NE(all.error.message.find("request body " + why), std::string::npos) << all.error.message;
  // 128 levels are read; 129 are not.
  auto nested = [](int levels) { return std::string(levels, '[') + std::string(levels, ']'); };
  EXPECT_TRUE(parse_api_request(ApiKind::kCompletion, completion(R"("x":)" + nested(127))).request);
  expect_refused(ApiKind::kCompletion, completion(R"("x":)" + nested(128)), "x", why);
}

// Before: 1025 choices passed here and failed when compiled as "an ambiguous grammar"; 1e999 (a
// double's overflow) was "request body could not be read", naming nothing.
TEST(OpenAiParse, ChoicesPastTheMatchersLimitAndNonFiniteNumbersNameTheField) {
  auto choices = [](int n) {
    json list = json::array();
    for (int i = 0; i < n; ++i) {
      std::string c = "c";  // appended: GCC 12 warns falsely (-Wrestrict) on "c" + std::string
      c += std::to_string(i);
      list.push_back(c);
    }
    return R"("guided_choice":)" + list.dump();
  };
  EXPECT_TRUE(parse_api_request(ApiKind::kCompletion, completion(choices(1024))).request);
  expect_refused(ApiKind::kCompletion, completion(choices(1025)), "guided_choice",
                 "has 1025 values; at most 1024 are supported");
  for (const char* field : {"temperature", "top_p", "presence_penalty", "min_p"}) {
    for (const char* number : {"1e999", "-1e999"}) {
      std::string member = "\"";
      member += field;
      member += "\":";
      member += number;
      expect_refused(ApiKind::kCompletion, completion(member), field,
                     "holds a number too large for a double: it must be finite");
    }
  }
  expect_refused(ApiKind::kChat, chat(R"("logit_bias":{"5":1e400})"), "logit_bias", "must be finite");
}

TEST(OpenAiErrors, ErrorBody) {
  ApiError e;
  e.message = "field 'n' must be 1";
  e.param = "n";
  json j = json::parse(error_body(e));
  EXPECT_EQ(j, json::parse(R"({"error":{"message":"field 'n' must be 1","type":"invalid_request_error",
                                        "param":"n","code":null}})"));
  e = ApiError{};
  e.http_status = 404;
  e.type = "not_found_error";
  e.message = "model \xff not found";  // invalid UTF-8 must not throw
  e.code = "model_not_found";
  j = json::parse(error_body(e));
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "model_not_found");
  EXPECT_EQ(j["error"]["type"], "not_found_error");
  EXPECT_EQ(j["error"]["message"], "model \xEF\xBF\xBD not found");
  const std::string chunk = stream_error_chunk(e);
  ASSERT_TRUE(chunk.starts_with("data: "));
  ASSERT_TRUE(chunk.ends_with("\n\n"));
  EXPECT_EQ(json::parse(chunk.substr(6)), j);
}

// --- UTF-8 and StopMatcher ----------------------------------------------------------------------

TEST(Utf8, Sanitize) {
  EXPECT_EQ(sanitize_utf8("plain"), "plain");
  EXPECT_EQ(sanitize_utf8("\xE2\x82\xAC \xF0\x9F\x98\x80 \xC3\xA9"),
            "\xE2\x82\xAC \xF0\x9F\x98\x80 \xC3\xA9");
  EXPECT_EQ(sanitize_utf8("a\xFF"
                          "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(sanitize_utf8("\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // stray continuations: one each
  EXPECT_EQ(sanitize_utf8("\xE2\x82"
                          "A"),
            "\xEF\xBF\xBD"
            "A");                                                    // truncated sequence: one
  EXPECT_EQ(sanitize_utf8("\xE2\x82"), "\xEF\xBF\xBD");              // truncated at the end
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong lead is invalid alone
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(sanitize_utf8("\xF4\x90\x80\x80"),
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // > U+10FFFF
  EXPECT_EQ(sanitize_utf8(std::string("a\0b", 3)), std::string("a\0b", 3));
}

TEST(StopMatcher, StopSplitAcrossThreePieces) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.feed("Hello S"), "Hello ");
  EXPECT_EQ(m.feed("T"), "");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.feed("OP and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.text(), "Hello ");
  EXPECT_EQ(m.feed("later"), "");
  EXPECT_EQ(m.finish(), "");
  EXPECT_EQ(m.text(), "Hello ");
}

TEST(StopMatcher, MatchWithinOnePieceKeepsTextBefore) {
  StopMatcher m({"\n\n"});
  EXPECT_EQ(m.feed("line one\n"), "line one");
  EXPECT_EQ(m.feed("\nline two"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.text(), "line one");
}

TEST(StopMatcher, NoPartOfAStopIsEverEmitted) {
  const std::string text = "abc<|end|>def";
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    StopMatcher m({"<|end|>"});
    std::string out;
    for (size_t i = 0; i < text.size(); i += piece) {
      const std::string chunk = m.feed(std::string_view(text).substr(i, piece));
      EXPECT_EQ(chunk.find('<'), std::string::npos) << "piece " << piece;
      out += chunk;
    }
    EXPECT_TRUE(m.stopped());
    EXPECT_EQ(out, "abc");
    EXPECT_EQ(m.text(), "abc");
  }
}

TEST(StopMatcher, EarliestMatchWins) {
  StopMatcher m({"world", "lo w", "o"});
  EXPECT_EQ(m.feed("hello world"), "hel");  // "lo w" starts first
  EXPECT_TRUE(m.stopped());
  // Two complete matches in the same piece: the earlier start wins, whatever the list order.
  StopMatcher m2({"cd", "bcde"});
  EXPECT_EQ(m2.feed("abcdef"), "a");
  EXPECT_EQ(m2.text(), "a");
}

TEST(StopMatcher, HeldPrefixIsReleasedWhenNoStopFollows) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.feed("the E"), "the ");
  EXPECT_EQ(m.feed("N"), "");
  EXPECT_EQ(m.feed("D"), "");
  EXPECT_TRUE(m.stopped());

  StopMatcher n({"END"});
  EXPECT_EQ(n.feed("the E"), "the ");
  EXPECT_EQ(n.feed("N"), "");
  EXPECT_EQ(n.feed("Dx"), "");  // matched: nothing after
  StopMatcher p({"END"});
  EXPECT_EQ(p.feed("the EN"), "the ");
  EXPECT_EQ(p.feed("x"), "ENx");
  EXPECT_FALSE(p.stopped());
  EXPECT_EQ(p.feed("EEN"), "E");  // "EN" could still start "END"
  EXPECT_EQ(p.finish(), "EN");
  EXPECT_EQ(p.text(), "the ENxEEN");
}

TEST(StopMatcher, FinishReleasesHeldText) {
  StopMatcher m({"</s>"});
  EXPECT_EQ(m.feed("bye </"), "bye ");
  EXPECT_EQ(m.finish(), "</");
  EXPECT_EQ(m.text(), "bye </");
  EXPECT_EQ(m.finish(), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, NoStopsPassesTextThrough) {
  StopMatcher m({});
  EXPECT_EQ(m.feed("abc"), "abc");
  EXPECT_EQ(m.feed(""), "");
  EXPECT_EQ(m.finish(), "");
  EXPECT_EQ(m.text(), "abc");
  StopMatcher e({""});  // an empty stop never matches
  EXPECT_EQ(e.feed("abc"), "abc");
  EXPECT_FALSE(e.stopped());
}

TEST(StopMatcher, MultibyteCharacterSplitAcrossPiecesIsEmittedWhole) {
  StopMatcher m({});
  // U+1F600 (F0 9F 98 80) in three pieces, then U+20AC (E2 82 AC).
  EXPECT_EQ(m.feed("a\xF0"), "a");
  EXPECT_EQ(m.feed("\x9F\x98"), "");
  EXPECT_EQ(m.feed("\x80"
                   "b\xE2\x82"),
            "\xF0\x9F\x98\x80"
            "b");
  EXPECT_EQ(m.feed("\xAC"), "\xE2\x82\xAC");
  EXPECT_EQ(m.finish(), "");
  EXPECT_EQ(m.text(),
            "a\xF0\x9F\x98\x80"
            "b\xE2\x82\xAC");
}

TEST(StopMatcher, MultibyteStopSplitAcrossPieces) {
  StopMatcher m({"\xE3\x80\x82"});  // "。"
  EXPECT_EQ(m.feed("x\xE3"), "x");
  EXPECT_EQ(m.feed("\x80"), "");
  EXPECT_EQ(m.feed("\x82y"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.text(), "x");
}

TEST(StopMatcher, InvalidBytesBecomeReplacementCharacters) {
  StopMatcher m({});
  EXPECT_EQ(m.feed("a\xFF"), "a\xEF\xBF\xBD");
  EXPECT_EQ(m.feed("\x80"
                   "b"),
            "\xEF\xBF\xBD"
            "b");                     // a stray continuation
  EXPECT_EQ(m.feed("\xE2\x82"), "");  // could still complete
  EXPECT_EQ(m.feed("c"),
            "\xEF\xBF\xBD"
            "c");  // it did not
  EXPECT_EQ(m.feed("\xC3"), "");
  EXPECT_EQ(m.finish(), "\xEF\xBF\xBD");  // cut off by the end
  EXPECT_EQ(m.text(),
            "a\xEF\xBF\xBD\xEF\xBF\xBD"
            "b\xEF\xBF\xBD"
            "c\xEF\xBF\xBD");
}

TEST(StopMatcher, AnySplitDecodesLikeTheWhole) {
  const std::string text =
      "x\xE2\x82\xAC\xF0\x9F\x98\x80\xFF\xE2\x82"
      "ab\xC3\xA9\xED\xA0\x80"
      "a";
  const std::string whole = sanitize_utf8(text);
  for (size_t a = 0; a <= text.size(); ++a) {
    for (size_t b = a; b <= text.size(); ++b) {
      StopMatcher m(
          {"\xAC"
           "Q",
           "ab!"});  // stops that never match but hold text back
      std::string out = m.feed(text.substr(0, a));
      out += m.feed(text.substr(a, b - a));
      out += m.feed(text.substr(b));
      out += m.finish();
      ASSERT_EQ(out, whole) << a << " " << b;
      ASSERT_EQ(m.text(), whole);
    }
  }
}

// --- responses ----------------------------------------------------------------------------------

const ResponseMeta kMeta{"cmpl-1", 1700000000, "stories"};

json parse_event(const std::string& chunk) {
  EXPECT_TRUE(chunk.starts_with("data: ")) << chunk;
  EXPECT_TRUE(chunk.ends_with("\n\n")) << chunk;
  return json::parse(chunk.substr(6, chunk.size() - 8));
}

TEST(OpenAiResponse, Completion) {
  const json j =
      completion_response(ApiKind::kCompletion, kMeta, "once", "length", Usage{5, 3, std::nullopt});
  EXPECT_EQ(j,
            json::parse(R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"stories",
    "choices":[{"index":0,"text":"once","logprobs":null,"finish_reason":"length"}],
    "usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}})"));
}

TEST(OpenAiResponse, Chat) {
  const ResponseMeta meta{"chatcmpl-9", 12, "m"};
  const json j = completion_response(ApiKind::kChat, meta, "hi \xff", "stop", Usage{2, 1, std::nullopt});
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"], "chatcmpl-9");
  EXPECT_EQ(j["created"], 12);
  ASSERT_EQ(j["choices"].size(), 1u);
  json expected = json::parse(R"({"index":0,"message":{"role":"assistant","content":""},"logprobs":null,
                                   "finish_reason":"stop"})");
  expected["message"]["content"] = "hi \xff";  // held raw, replaced only when dumped
  EXPECT_EQ(j["choices"][0], expected);
  EXPECT_EQ(j["choices"][0]["index"], 0);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["usage"]["total_tokens"], 3);
  // Invalid UTF-8 in a text is replaced when serialized, never thrown.
  const std::string text = j.dump(-1, ' ', false, json::error_handler_t::replace);
  EXPECT_EQ(json::parse(text)["choices"][0]["message"]["content"], "hi \xEF\xBF\xBD");
}

// Completions: parallel arrays, the chosen token inside its top_logprobs dict (the likelier of two
// ids with one text wins); chat: content entries with the raw bytes. -inf becomes -9999.
TEST(OpenAiResponse, Logprobs) {
  const std::vector<LogprobEntry> entries{
      {"Once", -0.25f, {{"Once", -0.25f}, {" The", -2.0f}}, 0},
      {"\xE2\x82", -1.5f, {{"x", -0.5f}, {"x", -0.75f}}, 4},
      {" up", -std::numeric_limits<float>::infinity(), {}, 5}};
  const std::vector<LogprobEntry> echoed{{"", 0.0f, {}, 0, false}, {"Hi", -3.0f, {{"Hi", -3.0f}}, 0}};
  EXPECT_EQ(logprobs_json(ApiKind::kCompletion, echoed), json::parse(R"({"tokens":["","Hi"],"token_logprobs":[null,-3.0],
    "top_logprobs":[null,{"Hi":-3.0}],"text_offset":[0,0]})"));
  json j = completion_response(ApiKind::kCompletion, kMeta, "Once\xE2\x82 up", "length",
                               Usage{5, 3, std::nullopt}, &entries);
  const json expected = json::parse(R"({"tokens":["Once","\ufffd"," up"],"token_logprobs":[-0.25,-1.5,-9999.0],
    "top_logprobs":[{"Once":-0.25," The":-2.0},{"\ufffd":-1.5,"x":-0.5},{" up":-9999.0}],"text_offset":[0,4,5]})");
  EXPECT_EQ(json::parse(j.dump(-1, ' ', false, json::error_handler_t::replace))["choices"][0]["logprobs"], expected);
  j = parse_event(stream_chunk(ApiKind::kCompletion, kMeta, "Once", true, &entries));
  EXPECT_EQ(j["choices"][0]["logprobs"], expected);

  j = completion_response(ApiKind::kChat, kMeta, "x", "stop", Usage{1, 1, std::nullopt}, &entries);
  const json content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(content[0], json::parse(R"({"token":"Once","logprob":-0.25,"bytes":[79,110,99,101],
    "top_logprobs":[{"token":"Once","logprob":-0.25,"bytes":[79,110,99,101]},
                    {"token":" The","logprob":-2.0,"bytes":[32,84,104,101]}]})"));
  EXPECT_EQ(content[1]["token"], "\xEF\xBF\xBD");
  EXPECT_EQ(content[1]["bytes"], json::parse("[226,130]"));
  EXPECT_EQ(content[1]["top_logprobs"].size(), 2u) << "chat keeps both alternatives";
  EXPECT_EQ(content[2]["logprob"], -9999.0);
  EXPECT_TRUE(content[2]["top_logprobs"].empty());
  j = parse_event(stream_chunk(ApiKind::kChat, kMeta, "", false, &entries));
  EXPECT_EQ(j["choices"][0]["logprobs"]["content"].size(), 3u);
  EXPECT_TRUE(parse_event(stream_chunk(ApiKind::kChat, kMeta, "", false))["choices"][0]["logprobs"].is_null());
}

TEST(OpenAiResponse, CompletionStreamChunks) {
  json j = parse_event(stream_chunk(ApiKind::kCompletion, kMeta, "tok", true));
  EXPECT_EQ(j,
            json::parse(R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"stories",
    "choices":[{"index":0,"text":"tok","logprobs":null,"finish_reason":null}]})"));
  j = parse_event(stream_finish_chunk(ApiKind::kCompletion, kMeta, "stop"));
  EXPECT_EQ(j["choices"], json::parse(R"([{"index":0,"text":"","logprobs":null,"finish_reason":"stop"}])"));
  EXPECT_EQ(j["object"], "text_completion");
  j = parse_event(stream_usage_chunk(ApiKind::kCompletion, kMeta, Usage{4, 6, std::nullopt}));
  EXPECT_EQ(j,
            json::parse(R"({"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"stories",
    "choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}})"));
  EXPECT_EQ(kStreamDone, "data: [DONE]\n\n");
}

TEST(OpenAiResponse, ChatStreamChunks) {
  const ResponseMeta meta{"chatcmpl-2", 7, "m"};
  json j = parse_event(stream_chunk(ApiKind::kChat, meta, "Hel", true));
  EXPECT_EQ(j, json::parse(R"({"id":"chatcmpl-2","object":"chat.completion.chunk","created":7,"model":"m",
    "choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"logprobs":null,"finish_reason":null}]})"));
  j = parse_event(stream_chunk(ApiKind::kChat, meta, "lo", false));
  EXPECT_EQ(j["choices"][0]["delta"], json::parse(R"({"content":"lo"})"));
  j = parse_event(stream_finish_chunk(ApiKind::kChat, meta, "length"));
  EXPECT_EQ(j["choices"],
            json::parse(R"([{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}])"));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  j = parse_event(stream_usage_chunk(ApiKind::kChat, meta, Usage{1, 2, std::nullopt}));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  EXPECT_EQ(j["choices"], json::array());
  EXPECT_EQ(j["usage"], json::parse(R"({"prompt_tokens":1,"completion_tokens":2,"total_tokens":3})"));
  j = parse_event(stream_usage_chunk(ApiKind::kChat, meta, Usage{40, 2, 32}));
  EXPECT_EQ(j["usage"], json::parse(R"({"prompt_tokens":40,"completion_tokens":2,"total_tokens":42,
                                       "prompt_tokens_details":{"cached_tokens":32}})"));
  // A chunk is one event: a single "data:" line, whatever the text holds.
  const std::string chunk = stream_chunk(ApiKind::kChat, meta, "a\n\nb", false);
  EXPECT_EQ(chunk.find('\n'), chunk.size() - 2);
}

// A call's first delta names it (id, type, name); the next ones carry arguments only.
TEST(OpenAiResponse, ToolCallStreamChunks) {
  const ResponseMeta meta{"chatcmpl-3", 7, "m"};
  json j = parse_event(stream_tool_call_chunk(meta, ToolCallDelta{1, "call_x", "get_weather", ""}, true, 2));
  EXPECT_EQ(j, json::parse(R"({"id":"chatcmpl-3","object":"chat.completion.chunk","created":7,"model":"m",
    "choices":[{"index":2,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":1,"id":"call_x",
    "type":"function","function":{"name":"get_weather","arguments":""}}]},"logprobs":null,"finish_reason":null}]})"));
  j = parse_event(stream_tool_call_chunk(meta, ToolCallDelta{1, "", "", "{\"a\": \xff"}, false));
  EXPECT_EQ(j["choices"][0]["delta"],
            json::parse(R"({"tool_calls":[{"index":1,"function":{"arguments":"{\"a\": \ufffd"}}]})"));
}

TEST(OpenAiResponse, Models) {
  EXPECT_EQ(models_response("stories", 5, 512), json::parse(R"({"object":"list","data":[{"id":"stories",
    "object":"model","created":5,"owned_by":"specontext","max_model_len":512}]})"));
}

}  // namespace
}  // namespace specontext::cluster
