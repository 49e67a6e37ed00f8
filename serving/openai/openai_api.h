// The OpenAI-compatible HTTP API's request and response bodies, as pure functions (no sockets,
// no engine): JSON body → a validated request, or an ApiError naming the field; results →
// response JSON (whole or as server-sent-event chunks). Fuzzed by tests/fuzz/fuzz_openai.cc.
// What is accepted follows the OpenAI reference and vLLM's extensions (top_k, repetition_penalty,
// ignore_eos, stop_token_ids, min_p, min_tokens); anything we cannot
// honour is refused with a 400 naming the field, never silently ignored (chat echo, suffix,
// chat best_of, tools, guided_regex, ...).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/base/utf8.h"
#include "core/ports/sampler.h"

namespace specontext::cluster {

enum class ApiKind { kCompletion, kChat };

inline constexpr int32_t kMaxChoices = 16;  // most choices ("n") per request

// An error as the client sees it: the HTTP status and OpenAI's error object
//   {"error":{"message":M,"type":T,"param":P|null,"code":C|null}}
struct ApiError {
  int http_status = 400;
  std::string type = "invalid_request_error";  // or "not_found_error", "server_error", ...
  std::string message;                         // names the field: "field 'max_tokens' must be ..."
  std::string param;                           // the offending field; empty = null
  std::string code;  // e.g. "model_not_found", "context_length_exceeded"; empty = null
};
std::string error_body(const ApiError& error);  // the JSON text above

struct ToolCallIn {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text, as the API carries it
};
struct ChatMessageIn {
  std::string role;  // "system", "user", "assistant", "tool" (others are refused naming messages[i].role)
  // A string, or the text parts of an array of {type:"text",text}, joined by "\n" as vLLM does.
  // May be empty (null) for an assistant message with tool_calls.
  std::string content;
  std::vector<ToolCallIn> tool_calls;  // assistant messages that called tools
  std::string tool_call_id;            // tool messages: the call they answer
};

// A chat request's tool: {"type":"function","function":{"name","description","parameters"}}.
struct ToolIn {
  std::string name;                   // [A-Za-z0-9_-]{1,64}, unique in the request
  std::string definition;             // the tool object as JSON text, in the body's key order
  nlohmann::ordered_json parameters;  // its JSON Schema (an empty object schema when absent)
};

// A parsed, validated request. Limits that need the model (context length, vocabulary) are
// checked later by the server, which knows them.
struct ApiRequest {
  ApiKind kind = ApiKind::kCompletion;
  std::string model;  // empty when the client gave none
  // kCompletion: exactly one of these is set ("prompt" as a string, or an array of token ids).
  std::string prompt_text;
  std::vector<TokenId> prompt_ids;
  bool prompt_is_ids = false;
  // kChat: at least one message.
  std::vector<ChatMessageIn> messages;
  std::optional<int64_t> max_tokens;  // max_tokens or max_completion_tokens (> 0); unset = up to the context
  SamplingParams sampling;  // temperature [0,2] (default 1 as OpenAI), top_p (0,1], top_k (-1 or 0 = off,
                            // else > 0), repetition_penalty (> 0), seed (any integer ≥ 0)
  std::vector<std::string> stop;  // "stop": a string or an array of at most 4 non-empty strings
  bool ignore_eos = false;        // vLLM extension
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage (only with stream)
  // Alternatives per token when log-probabilities are asked for, -1 when not: completions
  // "logprobs": N (0..kMaxLogprobs); chat "logprobs": true with "top_logprobs": N (default 0).
  int32_t logprobs = -1;
  // Completions: the answer's text starts with the prompt, and with logprobs the prompt's tokens
  // come first in them (the first with a null logprob), as OpenAI's legacy API and vLLM do.
  bool echo = false;
  // vLLM's prompt_logprobs (both APIs): each prompt token's log-probability and rank with this
  // many alternatives, -1 when not asked (0..kMaxLogprobs).
  int32_t prompt_logprobs = -1;
  // Choices: n independent samples of the same prompt (seeds seed, seed + 1, ...).
  int32_t n = 1;
  // Completions: best_of (n..kMaxChoices) samples are drawn and the n with the highest mean
  // log-probability per token are answered (OpenAI's "best"); equal to n unless asked, and only
  // equal to n when streaming. Chat: always n (best_of must be 1 or absent).
  int32_t best_of = 1;
  // OpenAI's frequency_penalty / presence_penalty ([-2, 2]) and logit_bias ({"id": [-100, 100]});
  // vLLM's stop_token_ids. Ids are checked against the vocabulary by the server.
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  std::vector<std::pair<TokenId, float>> logit_bias;
  std::vector<TokenId> stop_token_ids;
  int64_t min_tokens = 0;  // vLLM: no stop (EOS, stop ids) before this many tokens; <= max_tokens
  float min_p = 0.0f;      // vLLM: [0, 1]
  // Structured output, at most one per request: response_format {"type":"json_object"} (one JSON
  // object, serving/structured/json_constraint.h) or {"type":"json_schema","json_schema":{"name","schema",
  // "strict"}}, vLLM's guided_json (a schema, as an object or JSON text) and guided_choice (the
  // text is one of these strings); schemas and choices are compiled by the server
  // (serving/structured/json_schema.h). {"type":"text"} is the default.
  // Chat tools and tool_choice: "none" (the default without tools: tools are not shown to the
  // model), "required" (the text is a JSON array of {"name", "parameters"} calls, constrained to
  // the tools' schemas) or a named function (the text is its arguments, constrained to its
  // schema) or "auto", the default with tools (the text is free; calls written in the model's
  // own syntax are read back by parse_tool_calls, core/tokenizer/tokenizer.h). Streamed, the calls come as
  // delta.tool_calls (stream_tool_call_chunk): a named function's arguments as they are generated;
  // "auto" and "required" calls whole once the reply has ended, as only then is it known whether
  // they parse ("auto" content before them streams as it comes: tool_call_content_prefix).
  enum class ToolChoice { kNone, kAuto, kRequired, kNamed };
  std::vector<ToolIn> tools;
  ToolChoice tool_choice = ToolChoice::kNone;
  std::string tool_choice_name;  // kNamed
  enum class Structured { kNone, kJsonObject, kJsonSchema, kChoice };
  Structured structured = Structured::kNone;
  std::string structured_field;     // the field that asked for it, for errors
  nlohmann::ordered_json schema;    // kJsonSchema, in the body's own key order
  std::vector<std::string> choices;  // kChoice
  std::string user;            // accepted and ignored
};

// body: the HTTP request body. Errors: malformed JSON (400, param empty), wrong types or ranges
// (400 naming the field), unsupported features (400, e.g. "field 'suffix' must be null or empty"). Unknown fields are
// ignored, as OpenAI does. Never throws. Defaults: temperature 1, top_p 1, top_k off, repetition_penalty 1,
// seed 0 (= time-derived). top_logprobs only for chat and beside "logprobs":
// true; n in [1, kMaxChoices]; best_of in [n, kMaxChoices] (completions, not streamed unless = n); echo (chat) only when false; suffix only when empty;
// tools (chat) as function tools, the legacy functions only when empty, response_format text,
// json_object or json_schema (or guided_json / guided_choice, one of them). null counts as absent for every optional field; integral floats (3.0) pass as
// integers.
struct ParseResult {
  std::optional<ApiRequest> request;
  ApiError error;  // meaningful when !request
};
ParseResult parse_api_request(ApiKind kind, std::string_view body);

// vLLM's POST /tokenize: {"prompt": TEXT} (add_special_tokens, default true: the BOS the
// completions API adds) or {"messages": [...]} (rendered by the chat template, as chat
// completions do; add_special_tokens default false; add_generation_prompt only true), and
// return_token_strs. The answer is {"count", "max_model_len", "tokens"[, "token_strs"]}; the
// ids are those the completions / chat API would compute for the same prompt.
struct TokenizeRequest {
  ApiKind kind = ApiKind::kCompletion;  // kChat: messages
  std::string model;
  std::string prompt;
  std::vector<ChatMessageIn> messages;
  bool add_special_tokens = true;
  bool add_generation_prompt = true;
  bool return_token_strs = false;
};
struct TokenizeParse {
  std::optional<TokenizeRequest> request;
  ApiError error;  // meaningful when !request
};
TokenizeParse parse_tokenize_request(std::string_view body);
nlohmann::json tokenize_response(std::span<const TokenId> tokens, int64_t max_model_len,
                                 const std::vector<std::string>* token_strs);

// vLLM's POST /detokenize: {"tokens": [ids]} → {"prompt": TEXT}. The ids are checked against the
// vocabulary by the server.
struct DetokenizeRequest {
  std::string model;
  std::vector<TokenId> tokens;
};
struct DetokenizeParse {
  std::optional<DetokenizeRequest> request;
  ApiError error;
};
DetokenizeParse parse_detokenize_request(std::string_view body);

// Text as it is generated, with stop strings: feed() each decoded piece and emit what it
// returns. A piece is held back while it could be the start of a stop string or while it ends in
// an incomplete UTF-8 sequence, so streamed text never contains any part of a stop string and
// every chunk is valid UTF-8 (invalid bytes become U+FFFD). Chunks are cut only where decoding
// the whole text would cut too, so text() + finish() without a stop is sanitize_utf8(all pieces).
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Appends `piece`; returns the text now safe to emit. After a stop string matched, stopped()
  // is true, the returned text ends just before the match and later calls return "".
  std::string feed(std::string_view piece);
  // The held-back text (when generation ended without a stop match), made valid UTF-8; it is
  // added to text(). Returns "" after a stop.
  std::string finish();
  bool stopped() const { return stopped_; }
  const std::string& text() const { return text_; }  // everything emitted so far (feed and finish)

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // received, not yet emitted
  std::string text_;
  bool stopped_ = false;
};

// sanitize_utf8, incomplete_utf8_tail and dump_json: core/base/utf8.h.

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // With prefix caching: prompt tokens taken from the cache (prompt_tokens_details.cached_tokens).
  std::optional<int64_t> cached_tokens;
};

struct ResponseMeta {
  std::string id;       // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

// One generated token's log-probabilities as a response shows them (core TokenLogprobs with the
// tokens decoded). Strings are raw bytes; the JSON carries them made valid UTF-8 (chat adds the raw
// "bytes").
struct LogprobEntry {
  std::string token;
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;  // the alternatives, most likely first
  int64_t text_offset = 0;  // completions: code points of the completion's text before this token
  bool has_logprob = true;  // false: the echoed prompt's first token (null logprob and alternatives)
};
// Completions: {"tokens":[..],"token_logprobs":[..],"top_logprobs":[{token: lp} with the chosen
// token and the alternatives],"text_offset":[..]}. Chat: {"content":[{"token","logprob","bytes",
// "top_logprobs":[{"token","logprob","bytes"}]}]}. -inf is sent as -9999.0, as vLLM does.
nlohmann::json logprobs_json(ApiKind kind, std::span<const LogprobEntry> entries);

// Whole (non-streaming) responses: object "text_completion" / "chat.completion", one choice,
// finish_reason "stop" | "length" ("abort" is never sent: the client is gone), usage with
// total_tokens. `logprobs` (null = "logprobs": null) are the entries of the text's tokens.
nlohmann::json completion_response(ApiKind kind, const ResponseMeta& meta, const std::string& text,
                                   const std::string& finish_reason, const Usage& usage,
                                   const std::vector<LogprobEntry>* logprobs = nullptr);
// The same with several choices, index i for choices[i].
struct ToolCallOut {
  std::string id;  // "call_..."
  std::string name;
  std::string arguments;  // JSON text
};
struct ChoiceOut {
  std::string text;  // chat with tool_calls: the message's content is null when empty
  std::string finish_reason;
  const std::vector<LogprobEntry>* logprobs = nullptr;
  const nlohmann::json* prompt_logprobs = nullptr;  // prompt_logprobs_json: in the choice (completions),
                                                    // at the top (chat, the first choice's)
  const std::vector<ToolCallOut>* tool_calls = nullptr;  // chat: message.tool_calls when not empty
};
// vLLM's prompt_logprobs: [null, {"ID": {"logprob": L, "rank": R, "decoded_token": T}, ...}, ...],
// one entry per prompt token; the first has nothing before it to predict it. Each entry holds the
// prompt token (its rank among the vocabulary) and the `top` most likely tokens (ranks 1..top).
// `logprobs[i]` predicts prompt[i + 1]; decode(prev, id) gives a token's text after `prev`.
nlohmann::json prompt_logprobs_json(std::span<const TokenId> prompt, std::span<const TokenLogprobs> logprobs,
                                    int32_t top, const std::function<std::string(TokenId, TokenId)>& decode);
nlohmann::json completion_response(ApiKind kind, const ResponseMeta& meta, std::span<const ChoiceOut> choices,
                                   const Usage& usage);
// Streaming: one "data: {...}\n\n" event. A text delta (finish_reason null), the final delta
// (finish_reason set, empty text; chat: empty delta), the usage-only chunk (choices []), and the
// terminator "data: [DONE]\n\n". For chat, the first chunk's delta carries role "assistant".
// `index`: the choice the chunk belongs to.
// `prompt_logprobs` (prompt_logprobs_json) goes with a choice's first chunk.
std::string stream_chunk(ApiKind kind, const ResponseMeta& meta, const std::string& text, bool first,
                         const std::vector<LogprobEntry>* logprobs = nullptr, int32_t index = 0,
                         const nlohmann::json* prompt_logprobs = nullptr);
// A chat chunk whose delta is part of one tool call: {"tool_calls": [{"index": call_index, "id",
// "type": "function", "function": {"name", "arguments"}}]}, as OpenAI streams them: id, type and
// name only in the call's first delta (`id` not empty), later deltas carry arguments only. The
// client appends a call's arguments in the order they come.
struct ToolCallDelta {
  int32_t call_index = 0;
  std::string id;    // the first delta of a call: its id ("call_...") and its name
  std::string name;
  std::string arguments;  // the next piece of the arguments' JSON text
};
std::string stream_tool_call_chunk(const ResponseMeta& meta, const ToolCallDelta& delta, bool first,
                                   int32_t index = 0);
std::string stream_finish_chunk(ApiKind kind, const ResponseMeta& meta, const std::string& finish_reason,
                                int32_t index = 0);
std::string stream_usage_chunk(ApiKind kind, const ResponseMeta& meta, const Usage& usage);
std::string stream_error_chunk(const ApiError& error);  // "data: {"error":{...}}\n\n"
inline constexpr std::string_view kStreamDone = "data: [DONE]\n\n";

// GET /v1/models: {"object":"list","data":[{"id":NAME,"object":"model","created":T,"owned_by":"specontext",
// "max_model_len":N}]}
nlohmann::json models_response(const std::string& model_name, int64_t created, int64_t max_model_len);

}  // namespace specontext::cluster
