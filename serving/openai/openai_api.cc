#include "serving/openai/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/base/json_depth.h"
#include "serving/structured/grammar.h"

namespace specontext::cluster {

namespace {

using json = nlohmann::json;
using Check = std::optional<ApiError>;  // nullopt = the field is fine

Check field_error(std::string_view field, std::string_view what) {
  ApiError e;
  e.param = std::string(field);
  e.message = "field '" + std::string(field) + "' " + std::string(what);
  return e;
}

std::string indexed(std::string_view field, size_t i) {
  return std::string(field) + "[" + std::to_string(i) + "]";
}

// A present, non-null field; null counts as absent, as for the optional fields of OpenAI's and
// vLLM's schemas.
const json* find_field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

// Integers, and integral floats such as 3.0 (pydantic, behind vLLM, takes those too).
std::optional<int64_t> as_int64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // 2^63 is exact in a double; anything below it converts without overflow.
    if (std::isfinite(d) && d == std::floor(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
      return static_cast<int64_t>(d);
    }
  }
  return std::nullopt;
}


// --- the prompt (completions) -------------------------------------------------------------------

Check parse_token_ids(const json& ids, std::string_view field, std::vector<TokenId>& out) {
  if (ids.empty()) return field_error(field, "must not be empty");
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto id = as_int64(ids[i]);
    if (!id || *id < 0 || *id > std::numeric_limits<TokenId>::max()) {
      return field_error(indexed(field, i), "must be a token id (an integer >= 0)");
    }
    out.push_back(static_cast<TokenId>(*id));
  }
  return std::nullopt;
}

Check parse_prompt(const json& body, ApiRequest& req) {
  static constexpr std::string_view kWhat = "must be a non-empty string or an array of token ids";
  const json* p = find_field(body, "prompt");
  if (!p) return field_error("prompt", "is required: " + std::string(kWhat));
  if (p->is_string()) {
    req.prompt_text = p->get<std::string>();
    if (req.prompt_text.empty()) return field_error("prompt", "must not be empty");
    return std::nullopt;
  }
  if (!p->is_array()) return field_error("prompt", kWhat);
  // A batch of prompts is an array of strings or of token-id arrays; a batch of one is its prompt.
  if (!p->empty() && ((*p)[0].is_string() || (*p)[0].is_array())) {
    if (p->size() > 1) {
      return field_error("prompt",
                         "must be a string or an array of token ids: several prompts per request "
                         "are not supported");
    }
    const json& only = (*p)[0];
    if (only.is_string()) {
      req.prompt_text = only.get<std::string>();
      if (req.prompt_text.empty()) return field_error("prompt[0]", "must not be empty");
      return std::nullopt;
    }
    req.prompt_is_ids = true;
    return parse_token_ids(only, "prompt[0]", req.prompt_ids);
  }
  req.prompt_is_ids = true;
  return parse_token_ids(*p, "prompt", req.prompt_ids);
}

// --- the messages (chat) ------------------------------------------------------------------------

Check parse_content(const json& content, const std::string& field, std::string& out) {
  if (content.is_string()) {
    out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array()) return field_error(field, "must be a string or an array of text parts");
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const std::string name = indexed(field, j);
    if (!part.is_object()) return field_error(name, "must be an object {\"type\": \"text\", \"text\": ...}");
    auto type = part.find("type");
    if (type == part.end() || !type->is_string() || type->get_ref<const std::string&>() != "text") {
      return field_error(name + ".type", "must be \"text\": only text content is supported");
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) return field_error(name + ".text", "must be a string");
    // Parts are joined by newlines, as vLLM joins them for a text-only model.
    if (j > 0) out.push_back('\n');
    out += text->get_ref<const std::string&>();
  }
  return std::nullopt;
}

Check parse_messages(const json& body, ApiRequest& req) {
  static constexpr std::string_view kWhat = "must be a non-empty array of messages";
  const json* msgs = find_field(body, "messages");
  if (!msgs) return field_error("messages", "is required: " + std::string(kWhat));
  if (!msgs->is_array() || msgs->empty()) return field_error("messages", kWhat);
  req.messages.reserve(msgs->size());
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string name = indexed("messages", i);
    if (!m.is_object()) return field_error(name, "must be an object with 'role' and 'content'");
    ChatMessageIn msg;
    auto role = m.find("role");
    if (role != m.end() && role->is_string()) msg.role = role->get<std::string>();
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool") {
      return field_error(name + ".role", "must be one of system, user, assistant, tool");
    }
    const json* calls = find_field(m, "tool_calls");
    if (calls && msg.role != "assistant") return field_error(name + ".tool_calls", "is for assistant messages only");
    if (calls) {
      if (!calls->is_array()) return field_error(name + ".tool_calls", "must be an array of tool calls");
      for (size_t c = 0; c < calls->size(); ++c) {
        const json& call = (*calls)[c];
        const std::string cname = indexed(name + ".tool_calls", c);
        const json* fn = call.is_object() ? find_field(call, "function") : nullptr;
        const json* fname = fn && fn->is_object() ? find_field(*fn, "name") : nullptr;
        const json* args = fn && fn->is_object() ? find_field(*fn, "arguments") : nullptr;
        if (!fname || !fname->is_string() || !args || !args->is_string()) {
          return field_error(cname, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\": string, \"arguments\": JSON text}}");
        }
        ToolCallIn in;
        in.name = fname->get<std::string>();
        in.arguments = args->get<std::string>();
        if (const json* id = find_field(call, "id"); id && id->is_string()) in.id = id->get<std::string>();
        msg.tool_calls.push_back(std::move(in));
      }
    }
    const json* content = find_field(m, "content");
    if (!content && !(msg.role == "assistant" && !msg.tool_calls.empty())) {
      return field_error(name + ".content", "is required: a string or an array of text parts");
    }
    if (content) {
      if (auto e = parse_content(*content, name + ".content", msg.content)) return e;
    }
    if (msg.role == "tool") {
      // As OpenAI: a tool result names the call it answers.
      const json* id = find_field(m, "tool_call_id");
      if (!id) return field_error(name + ".tool_call_id", "is required in a tool message");
      if (!id->is_string()) return field_error(name + ".tool_call_id", "must be a string");
      msg.tool_call_id = id->get<std::string>();
    }
    req.messages.push_back(std::move(msg));
  }
  return std::nullopt;
}

// --- the rest -----------------------------------------------------------------------------------

Check parse_strings(const json& body, ApiRequest& req) {
  if (const json* v = find_field(body, "model")) {
    if (!v->is_string()) return field_error("model", "must be a string");
    req.model = v->get<std::string>();
  }
  if (const json* v = find_field(body, "user")) {
    if (!v->is_string()) return field_error("user", "must be a string");
    req.user = v->get<std::string>();
  }
  return std::nullopt;
}

Check parse_max_tokens(const json& body, ApiRequest& req) {
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    const json* v = find_field(body, key);
    if (!v) continue;
    const auto n = as_int64(*v);
    if (!n || *n <= 0) return field_error(key, "must be a positive integer");
    if (req.max_tokens && *req.max_tokens != *n) {
      return field_error(key, "must equal 'max_tokens' when both are given");
    }
    req.max_tokens = *n;
  }
  return std::nullopt;
}

Check parse_sampling(const json& body, ApiRequest& req) {
  SamplingParams& s = req.sampling;
  s = SamplingParams{};
  s.temperature = 1.0f;  // OpenAI's default; SamplingParams' own default is greedy
  if (const json* v = find_field(body, "temperature")) {
    if (!v->is_number() || !(v->get<double>() >= 0.0 && v->get<double>() <= 2.0)) {
      return field_error("temperature", "must be a number between 0 and 2");
    }
    s.temperature = static_cast<float>(v->get<double>());
  }
  if (const json* v = find_field(body, "top_p")) {
    // Checked after narrowing too: a tiny positive double becomes 0.0f, which the sampler refuses.
    if (!v->is_number() || !(v->get<double>() <= 1.0 && static_cast<float>(v->get<double>()) > 0.0f)) {
      return field_error("top_p", "must be a number greater than 0 and at most 1");
    }
    s.top_p = static_cast<float>(v->get<double>());
  }
  if (const json* v = find_field(body, "top_k")) {
    const auto k = as_int64(*v);
    if (!k || *k < -1) return field_error("top_k", "must be -1 or 0 (off) or a positive integer");
    // Above the vocabulary top-k keeps every token, so clamping keeps the meaning.
    s.top_k = *k <= 0 ? 0 : static_cast<int32_t>(std::min<int64_t>(*k, std::numeric_limits<int32_t>::max()));
  }
  if (const json* v = find_field(body, "repetition_penalty")) {
    const float f = v->is_number() ? static_cast<float>(v->get<double>()) : 0.0f;
    if (!(f > 0.0f) || !std::isfinite(f))
      return field_error("repetition_penalty", "must be a number greater than 0");
    s.repetition_penalty = f;
  }
  if (const json* v = find_field(body, "seed")) {
    std::optional<uint64_t> seed;
    if (v->is_number_unsigned()) {
      seed = v->get<uint64_t>();
    } else if (v->is_number_float()) {
      const double d = v->get<double>();
      if (d >= 0.0 && d < 18446744073709551616.0 && d == std::floor(d)) seed = static_cast<uint64_t>(d);
    }
    if (!seed) return field_error("seed", "must be an integer >= 0");  // negative integers land here too
    s.seed = *seed;
  }
  return std::nullopt;
}

Check parse_stop(const json& body, ApiRequest& req) {
  static constexpr std::string_view kWhat =
      "must be a non-empty string or an array of at most 4 non-empty strings";
  const json* v = find_field(body, "stop");
  if (!v) return std::nullopt;
  if (v->is_string()) {
    if (v->get_ref<const std::string&>().empty()) return field_error("stop", kWhat);
    req.stop.push_back(v->get<std::string>());
    return std::nullopt;
  }
  if (!v->is_array()) return field_error("stop", kWhat);
  if (v->size() > 4) return field_error("stop", "may hold at most 4 strings");
  for (size_t i = 0; i < v->size(); ++i) {
    const json& s = (*v)[i];
    if (!s.is_string() || s.get_ref<const std::string&>().empty()) {
      return field_error(indexed("stop", i), "must be a non-empty string");
    }
    req.stop.push_back(s.get<std::string>());
  }
  return std::nullopt;
}

Check parse_flags(const json& body, ApiRequest& req) {
  for (auto [key, out] : {std::pair{"stream", &req.stream}, std::pair{"ignore_eos", &req.ignore_eos}}) {
    if (const json* v = find_field(body, key)) {
      if (!v->is_boolean()) return field_error(key, "must be a boolean");
      *out = v->get<bool>();
    }
  }
  if (const json* v = find_field(body, "stream_options")) {
    if (!v->is_object()) return field_error("stream_options", "must be an object");
    if (!req.stream) return field_error("stream_options", "is only allowed when 'stream' is true");
    if (const json* u = find_field(*v, "include_usage")) {
      if (!u->is_boolean()) return field_error("stream_options.include_usage", "must be a boolean");
      req.include_usage = u->get<bool>();
    }
  }
  return std::nullopt;
}

// Completions: "logprobs": N alternatives (0 = the chosen token's only). Chat: "logprobs": true,
// with "top_logprobs": N (default 0) only beside it, as OpenAI checks.
Check parse_logprobs(const json& body, ApiRequest& req) {
  const ApiKind kind = req.kind;
  const std::string range = "between 0 and " + std::to_string(kMaxLogprobs);
  auto count = [&](const json& v) -> std::optional<int32_t> {
    const auto n = v.is_boolean() ? std::nullopt : as_int64(v);
    if (!n || *n < 0 || *n > kMaxLogprobs) return std::nullopt;
    return static_cast<int32_t>(*n);
  };
  if (const json* v = find_field(body, "prompt_logprobs")) {  // vLLM's, for both APIs
    const auto n = count(*v);
    if (!n) return field_error("prompt_logprobs", "must be an integer " + range);
    req.prompt_logprobs = *n;
  }
  const json* lp = find_field(body, "logprobs");
  const json* top = find_field(body, "top_logprobs");
  if (kind == ApiKind::kCompletion) {
    if (top) return field_error("top_logprobs", "is a chat field: completions take the count in 'logprobs'");
    if (!lp || (lp->is_boolean() && !lp->get<bool>())) return std::nullopt;
    const auto n = count(*lp);
    if (!n) return field_error("logprobs", "must be an integer " + range);
    req.logprobs = *n;
    return std::nullopt;
  }
  if (lp && !lp->is_boolean()) return field_error("logprobs", "must be a boolean");
  const bool on = lp && lp->get<bool>();
  if (top && !on) return field_error("top_logprobs", "is only allowed when 'logprobs' is true");
  if (!on) return std::nullopt;
  req.logprobs = 0;
  if (top) {
    const auto n = count(*top);
    if (!n) return field_error("top_logprobs", "must be an integer " + range);
    req.logprobs = *n;
  }
  return std::nullopt;
}

// "n" choices, and "echo" (completions only).
Check parse_choices(const json& body, ApiRequest& req) {
  if (const json* v = find_field(body, "n")) {
    const auto n = as_int64(*v);
    if (!n || *n < 1 || *n > kMaxChoices) {
      return field_error("n", "must be an integer between 1 and " + std::to_string(kMaxChoices));
    }
    req.n = static_cast<int32_t>(*n);
  }
  req.best_of = req.n;
  if (const json* v = find_field(body, "best_of")) {
    const auto best_of = as_int64(*v);
    if (req.kind == ApiKind::kChat) {
      if (best_of != 1) return field_error("best_of", "must be 1 for chat completions: best_of is a completions field");
    } else if (!best_of || *best_of < req.n || *best_of > kMaxChoices) {
      return field_error("best_of", "must be an integer between n (" + std::to_string(req.n) + ") and " +
                                        std::to_string(kMaxChoices));
    } else if (req.stream && *best_of > req.n) {
      return field_error("best_of", "must equal n when streaming: the best choices are known only at the end");
    } else {
      req.best_of = static_cast<int32_t>(*best_of);
    }
  }
  if (const json* v = find_field(body, "echo")) {
    if (!v->is_boolean()) return field_error("echo", "must be a boolean");
    if (v->get<bool>() && req.kind == ApiKind::kChat) {
      return field_error("echo", "must be false: chat completions do not echo (completions do)");
    }
    req.echo = v->get<bool>();
  }
  return std::nullopt;
}

// OpenAI's logit adjustments and vLLM's stop_token_ids. Token ids are checked against the
// vocabulary by the server.
Check parse_logit_controls(const json& body, ApiRequest& req) {
  for (auto [key, out] : {std::pair{"frequency_penalty", &req.frequency_penalty},
                          std::pair{"presence_penalty", &req.presence_penalty}}) {
    const json* v = find_field(body, key);
    if (!v) continue;
    if (!v->is_number() || !(v->get<double>() >= -2.0 && v->get<double>() <= 2.0)) {
      return field_error(key, "must be a number between -2 and 2");
    }
    *out = static_cast<float>(v->get<double>());
  }
  if (const json* v = find_field(body, "logit_bias")) {
    if (!v->is_object()) return field_error("logit_bias", "must be an object mapping token ids to biases");
    if (v->size() > 1024) return field_error("logit_bias", "may hold at most 1024 tokens");
    for (const auto& [key, bias] : v->items()) {
      const std::string field = "logit_bias." + key;
      const bool digits = !key.empty() && key.size() <= 9 &&
                          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits) return field_error("logit_bias", "has key '" + key + "', not a token id");
      if (!bias.is_number() || !(bias.get<double>() >= -100.0 && bias.get<double>() <= 100.0)) {
        return field_error(field, "must be a number between -100 and 100");
      }
      req.logit_bias.emplace_back(static_cast<TokenId>(std::stol(key)), static_cast<float>(bias.get<double>()));
    }
  }
  if (const json* v = find_field(body, "min_p")) {
    if (!v->is_number() || !(v->get<double>() >= 0.0 && v->get<double>() <= 1.0)) {
      return field_error("min_p", "must be a number between 0 and 1");
    }
    req.min_p = static_cast<float>(v->get<double>());
  }
  if (const json* v = find_field(body, "min_tokens")) {
    const auto n = as_int64(*v);
    if (!n || *n < 0) return field_error("min_tokens", "must be an integer >= 0");
    if (req.max_tokens && *n > *req.max_tokens) return field_error("min_tokens", "must not exceed 'max_tokens'");
    req.min_tokens = *n;
  }
  if (const json* v = find_field(body, "stop_token_ids")) {
    std::vector<TokenId> ids;
    if (!v->is_array()) return field_error("stop_token_ids", "must be an array of token ids");
    if (!v->empty()) {
      if (Check e = parse_token_ids(*v, "stop_token_ids", ids)) return e;
    }
    req.stop_token_ids = std::move(ids);
  }
  return std::nullopt;
}

// Features we cannot honour: refused unless given as their "off" value, never silently ignored.
Check refuse_unsupported(const json& body) {
  if (const json* v = find_field(body, "suffix")) {
    if (!(v->is_string() && v->get_ref<const std::string&>().empty())) {
      return field_error("suffix", "must be null or empty: inserting before a suffix is not supported");
    }
  }
  // The deprecated function-calling fields (tools and tool_choice replace them).
  if (const json* v = find_field(body, "functions"); v && !(v->is_array() && v->empty())) {
    return field_error("functions", "is not supported: use 'tools'");
  }
  if (const json* v = find_field(body, "function_call"); v && !(v->is_string() && (*v == "none" || *v == "auto"))) {
    return field_error("function_call", "is not supported: use 'tool_choice'");
  }
  for (const char* key : {"use_beam_search", "include_stop_str_in_output"}) {
    const json* v = find_field(body, key);
    if (v && !(v->is_boolean() && !v->get<bool>()))
      return field_error(key, "must be false: it is not supported");
  }
  return std::nullopt;
}

bool valid_tool_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// tools and tool_choice (chat only). The tools' parameters and definitions are taken again from an
// ordered parse (parse_api_request): here their key order is lost.
Check parse_tools(const json& body, ApiRequest& req) {
  const json* tools = find_field(body, "tools");
  if (tools && !tools->is_array()) return field_error("tools", "must be an array of tools");
  const bool any = tools && !tools->empty();
  if (any && req.kind != ApiKind::kChat) return field_error("tools", "is for chat completions only");
  if (any) {
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string field = indexed("tools", i);
      const json* type = t.is_object() ? find_field(t, "type") : nullptr;
      const json* fn = t.is_object() ? find_field(t, "function") : nullptr;
      if (!type || *type != "function" || !fn || !fn->is_object()) {
        return field_error(field, "must be {\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}");
      }
      const json* name = find_field(*fn, "name");
      if (!name || !name->is_string() || !valid_tool_name(name->get<std::string>())) {
        return field_error(field + ".function.name", "must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'");
      }
      for (const ToolIn& earlier : req.tools) {
        if (earlier.name == name->get_ref<const std::string&>()) return field_error(field + ".function.name", "repeats the tool '" + earlier.name + "'");
      }
      if (const json* d = find_field(*fn, "description"); d && !d->is_string()) {
        return field_error(field + ".function.description", "must be a string");
      }
      if (const json* p = find_field(*fn, "parameters"); p && !p->is_object()) {
        return field_error(field + ".function.parameters", "must be a JSON Schema object");
      }
      ToolIn in;
      in.name = name->get<std::string>();
      req.tools.push_back(std::move(in));
    }
  }
  const json* choice = find_field(body, "tool_choice");
  if (!choice || (choice->is_string() && *choice == "auto")) {
    if (any) req.tool_choice = ApiRequest::ToolChoice::kAuto;
    return std::nullopt;
  }
  if (choice->is_string() && *choice == "none") return std::nullopt;
  if (choice->is_string() && *choice == "required") {
    if (!any) return field_error("tool_choice", "\"required\" needs 'tools'");
    req.tool_choice = ApiRequest::ToolChoice::kRequired;
    return std::nullopt;
  }
  const json* fn = choice->is_object() && find_field(*choice, "type") && *find_field(*choice, "type") == "function"
                       ? find_field(*choice, "function")
                       : nullptr;
  const json* name = fn && fn->is_object() ? find_field(*fn, "name") : nullptr;
  if (!name || !name->is_string()) {
    return field_error("tool_choice",
                       "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  const bool known = std::any_of(req.tools.begin(), req.tools.end(), [&](const ToolIn& t) { return t.name == name->get_ref<const std::string&>(); });
  if (!known) return field_error("tool_choice", "names '" + name->get<std::string>() + "', which is not in 'tools'");
  req.tool_choice = ApiRequest::ToolChoice::kNamed;
  req.tool_choice_name = name->get<std::string>();
  return std::nullopt;
}

// Structured output: response_format text (the default), json_object or json_schema; vLLM's
// guided_json and guided_choice. At most one of them. A schema inside the body is taken again
// from an ordered parse (parse_api_request): here its key order is already lost.
Check parse_structured(const json& body, ApiRequest& req) {
  // A tool_choice that calls is constrained output too: nothing else may constrain the text.
  // ("auto" leaves the text free, so it combines with them.)
  const bool calls = req.tool_choice == ApiRequest::ToolChoice::kRequired || req.tool_choice == ApiRequest::ToolChoice::kNamed;
  if (calls) req.structured_field = "tool_choice";
  auto ask = [&](ApiRequest::Structured kind, const char* field) -> Check {
    if (req.structured != ApiRequest::Structured::kNone || calls) {
      return field_error(field, "cannot be combined with '" + req.structured_field +
                                    "': one structured output per request");
    }
    req.structured = kind;
    req.structured_field = field;
    return std::nullopt;
  };
  if (const json* v = find_field(body, "response_format")) {
    const json* type = v->is_object() ? find_field(*v, "type") : nullptr;
    if (!type || !type->is_string()) {
      return field_error("response_format", "must be an object with a string \"type\"");
    }
    if (*type == "json_object") {
      if (Check e = ask(ApiRequest::Structured::kJsonObject, "response_format")) return e;
    } else if (*type == "json_schema") {
      const json* js = find_field(*v, "json_schema");
      const json* schema = js && js->is_object() ? find_field(*js, "schema") : nullptr;
      if (!schema || !(schema->is_object() || schema->is_boolean())) {
        return field_error("response_format",
                           "json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {a JSON Schema}}");
      }
      if (const json* name = find_field(*js, "name"); name && !name->is_string()) {
        return field_error("response_format", "json_schema.name must be a string");
      }
      if (const json* strict = find_field(*js, "strict"); strict && !strict->is_boolean()) {
        return field_error("response_format", "json_schema.strict must be a boolean");
      }
      if (Check e = ask(ApiRequest::Structured::kJsonSchema, "response_format")) return e;
    } else if (*type != "text") {
      return field_error("response_format", "type must be \"text\", \"json_object\" or \"json_schema\"");
    }
  }
  if (const json* v = find_field(body, "guided_json")) {
    if (v->is_string()) {
      // A schema written as JSON text: parsed here, in its own order.
      const std::string& text = v->get_ref<const std::string&>();
      if (auto deep = json_too_deep(text)) {
        return field_error("guided_json", "nests arrays and objects deeper than " +
                                              std::to_string(kMaxJsonDepth) + " levels (at " +
                                              (deep->path.empty() ? "the top" : deep->path) + ")");
      }
      req.schema = nlohmann::ordered_json::parse(text, nullptr, false);
      if (req.schema.is_discarded() || !(req.schema.is_object() || req.schema.is_boolean())) {
        return field_error("guided_json", "must be a JSON Schema: an object, or JSON text of one");
      }
    } else if (!v->is_object() && !v->is_boolean()) {
      return field_error("guided_json", "must be a JSON Schema: an object, or JSON text of one");
    }
    if (Check e = ask(ApiRequest::Structured::kJsonSchema, "guided_json")) return e;
  }
  if (const json* v = find_field(body, "guided_choice")) {
    if (!v->is_array() || v->empty()) return field_error("guided_choice", "must be a non-empty array of strings");
    // Each choice is one parse stack of the grammar matcher at the first byte.
    if (v->size() > GrammarMatcher::kMaxStacks) {
      return field_error("guided_choice", "has " + std::to_string(v->size()) + " values; at most " +
                                              std::to_string(GrammarMatcher::kMaxStacks) + " are supported");
    }
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string() || (*v)[i].get_ref<const std::string&>().empty()) {
        return field_error(indexed("guided_choice", i), "must be a non-empty string");
      }
      req.choices.push_back((*v)[i].get<std::string>());
    }
    if (Check e = ask(ApiRequest::Structured::kChoice, "guided_choice")) return e;
  }
  for (const char* key : {"guided_regex", "guided_grammar"}) {
    if (find_field(body, key)) return field_error(key, "is not supported (guided_json and guided_choice are)");
  }
  return std::nullopt;
}

ParseResult parse_object(ApiKind kind, const json& body) {
  ApiRequest req;
  req.kind = kind;
  Check e = refuse_unsupported(body);
  if (!e) e = kind == ApiKind::kCompletion ? parse_prompt(body, req) : parse_messages(body, req);
  for (auto step : {parse_strings, parse_max_tokens, parse_sampling, parse_stop, parse_flags,
                    parse_logit_controls, parse_logprobs, parse_choices, parse_tools,
                    parse_structured}) {
    if (!e) e = step(body, req);
  }
  if (e) return ParseResult{std::nullopt, std::move(*e)};
  return ParseResult{std::move(req), ApiError{}};
}

std::string dump(const json& j) { return dump_json(j); }

std::string event(const json& j) { return "data: " + dump(j) + "\n\n"; }

const char* object_name(ApiKind kind, bool chunk) {
  if (kind == ApiKind::kCompletion) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}

json envelope(ApiKind kind, const ResponseMeta& meta, bool chunk) {
  return json{{"id", meta.id},
              {"object", object_name(kind, chunk)},
              {"created", meta.created},
              {"model", meta.model}};
}

json usage_json(const Usage& usage) {
  json j{{"prompt_tokens", usage.prompt_tokens},
         {"completion_tokens", usage.completion_tokens},
         {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
  if (usage.cached_tokens) j["prompt_tokens_details"] = json{{"cached_tokens", *usage.cached_tokens}};
  return j;
}

}  // namespace

std::string error_body(const ApiError& error) {
  try {
    json inner{{"message", error.message}, {"type", error.type}, {"param", nullptr}, {"code", nullptr}};
    if (!error.param.empty()) inner["param"] = error.param;
    if (!error.code.empty()) inner["code"] = error.code;
    return dump(json{{"error", std::move(inner)}});
  } catch (...) {
    return R"({"error":{"message":"internal error","type":"server_error","param":null,"code":null}})";
  }
}

// The body as a JSON object, or the 400 to answer with.
std::optional<ApiError> parse_body(std::string_view body, json& out) {
  // Before any tree exists: copying, dumping or destroying one recurses per level.
  if (auto deep = json_too_deep(body)) {
    ApiError err;
    err.param = deep->top_key;
    err.message = (deep->top_key.empty() ? std::string("request body") : "field '" + deep->top_key + "'") +
                  " nests arrays and objects deeper than " + std::to_string(kMaxJsonDepth) + " levels (at " +
                  deep->path + ")";
    return err;
  }
  try {
    out = json::parse(body);
  } catch (const json::parse_error& e) {
    std::string detail = e.what();
    // "[json.exception.parse_error.101] parse error at ..." → "parse error at ...".
    if (auto close = detail.find("] "); detail.starts_with("[json.exception") && close != std::string::npos) {
      detail.erase(0, close + 2);
    }
    ApiError err;
    err.message = "request body is not valid JSON: " + detail;
    return err;
  } catch (const json::out_of_range&) {
    // 406: a number beyond a double's range (1e999), which would be infinite.
    const std::optional<std::string> field = json_error_field(body);
    ApiError err;
    err.param = field.value_or("");
    err.message = (field ? "field '" + *field + "'" : std::string("request body")) +
                  " holds a number too large for a double: it must be finite";
    return err;
  }
  if (!out.is_object()) {
    ApiError err;
    err.message = "request body must be a JSON object";
    return err;
  }
  return std::nullopt;
}

// Runs `parse` over the body's object; nlohmann's own exceptions, which the checks make
// unreachable, become a 400 anyway.
template <typename Result, typename Parse>
Result parse_guarded(std::string_view body, Parse parse) {
  try {
    json j;
    if (auto err = parse_body(body, j)) return Result{std::nullopt, std::move(*err)};
    return parse(j);
  } catch (...) {
    ApiError err;
    err.message = "request body could not be read";
    return Result{std::nullopt, std::move(err)};
  }
}

ParseResult parse_api_request(ApiKind kind, std::string_view body) {
  ParseResult r = parse_guarded<ParseResult>(body, [kind](const json& j) { return parse_object(kind, j); });
  if (r.request && r.request->structured == ApiRequest::Structured::kJsonSchema && r.request->schema.is_null()) {
    // The schema in the body, in its own key order (properties are generated in it).
    const auto ordered = nlohmann::ordered_json::parse(body, nullptr, false);
    const bool in_format = r.request->structured_field == "response_format";
    const nlohmann::ordered_json* at = &ordered;
    for (const char* key : in_format ? std::vector<const char*>{"response_format", "json_schema", "schema"}
                                     : std::vector<const char*>{"guided_json"}) {
      if (!at->is_object() || !at->contains(key)) {
        at = nullptr;
        break;
      }
      at = &(*at)[key];
    }
    if (at == nullptr) return ParseResult{std::nullopt, ApiError{400, "invalid_request_error",
                                                                 "request body could not be read", "", ""}};
    r.request->schema = *at;
  }
  if (r.request && !r.request->tools.empty()) {
    // Each tool as the body wrote it (rendered into the prompt) and its parameters' own order.
    const auto ordered = nlohmann::ordered_json::parse(body, nullptr, false);
    const nlohmann::ordered_json* tools = ordered.is_object() && ordered.contains("tools") ? &ordered["tools"] : nullptr;
    if (tools == nullptr || !tools->is_array() || tools->size() != r.request->tools.size()) {
      return ParseResult{std::nullopt, ApiError{400, "invalid_request_error", "request body could not be read", "", ""}};
    }
    for (size_t i = 0; i < tools->size(); ++i) {
      const nlohmann::ordered_json& fn = (*tools)[i]["function"];
      ToolIn& t = r.request->tools[i];
      t.definition = dump_json((*tools)[i]);
      t.parameters = fn.contains("parameters") && !fn["parameters"].is_null()
                         ? fn["parameters"]
                         : nlohmann::ordered_json{{"type", "object"}, {"properties", nlohmann::ordered_json::object()},
                                                  {"additionalProperties", false}};
    }
  }
  return r;
}

TokenizeParse parse_tokenize_request(std::string_view body) {
  return parse_guarded<TokenizeParse>(body, [](const json& j) -> TokenizeParse {
    TokenizeRequest out;
    ApiRequest req;
    const bool chat = find_field(j, "messages") != nullptr;
    req.kind = chat ? ApiKind::kChat : ApiKind::kCompletion;
    Check e = parse_strings(j, req);
    if (!e && chat) {
      if (find_field(j, "prompt")) e = field_error("prompt", "must not be given with 'messages': one or the other");
      if (!e) e = parse_messages(j, req);
    } else if (!e) {
      const json* p = find_field(j, "prompt");
      if (!p || !p->is_string()) {
        e = field_error("prompt", "is required: a string (or give 'messages' to tokenize a chat)");
      } else {
        req.prompt_text = p->get<std::string>();
      }
    }
    out.add_special_tokens = !chat;  // vLLM's defaults: the chat template writes its own
    for (auto [key, flag] : {std::pair{"add_special_tokens", &out.add_special_tokens},
                             std::pair{"return_token_strs", &out.return_token_strs},
                             std::pair{"add_generation_prompt", &out.add_generation_prompt}}) {
      if (e) break;
      if (const json* v = find_field(j, key)) {
        if (!v->is_boolean()) {
          e = field_error(key, "must be a boolean");
        } else {
          *flag = v->get<bool>();
        }
      }
    }
    if (!e && chat && !out.add_generation_prompt) {
      e = field_error("add_generation_prompt", "must be true: the chat templates here always end with the assistant's turn");
    }
    if (!e && !chat && find_field(j, "add_generation_prompt")) {
      e = field_error("add_generation_prompt", "is for 'messages' only");
    }
    if (e) return TokenizeParse{std::nullopt, std::move(*e)};
    out.kind = req.kind;
    out.model = std::move(req.model);
    out.prompt = std::move(req.prompt_text);
    out.messages = std::move(req.messages);
    return TokenizeParse{std::move(out), ApiError{}};
  });
}

DetokenizeParse parse_detokenize_request(std::string_view body) {
  return parse_guarded<DetokenizeParse>(body, [](const json& j) -> DetokenizeParse {
    DetokenizeRequest out;
    ApiRequest req;
    Check e = parse_strings(j, req);
    const json* t = find_field(j, "tokens");
    if (!e && (!t || !t->is_array())) e = field_error("tokens", "is required: an array of token ids");
    if (!e && !t->empty()) e = parse_token_ids(*t, "tokens", out.tokens);
    if (e) return DetokenizeParse{std::nullopt, std::move(*e)};
    out.model = std::move(req.model);
    return DetokenizeParse{std::move(out), ApiError{}};
  });
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  // An empty stop string would match before any text.
  for (auto& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

std::string StopMatcher::feed(std::string_view piece) {
  if (stopped_) return {};
  pending_.append(piece);
  // Every stop that could have begun in earlier text was held back, so searching what is pending
  // finds any match; the earliest one wins.
  size_t match = std::string::npos;
  for (const auto& s : stops_) match = std::min(match, pending_.find(s));
  std::string out;
  if (match != std::string::npos) {
    out = sanitize_utf8(std::string_view(pending_).substr(0, match));
    stopped_ = true;
    pending_.clear();
  } else {
    // Hold the longest tail that is a proper prefix of a stop string ...
    size_t hold = 0;
    for (const auto& s : stops_) {
      for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k) {
        if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
    // ... and never cut inside a sequence that may still complete: emitted chunks then decode
    // exactly as the whole text would.
    size_t cut = pending_.size() - hold;
    cut -= incomplete_utf8_tail(std::string_view(pending_).substr(0, cut));
    out = sanitize_utf8(std::string_view(pending_).substr(0, cut));
    pending_.erase(0, cut);
  }
  text_ += out;
  return out;
}

std::string StopMatcher::finish() {
  std::string out = sanitize_utf8(pending_);
  pending_.clear();
  text_ += out;
  return out;
}

namespace {

// -inf (a token the model rules out) has no JSON number; vLLM sends -9999.0 in its place.
double json_logprob(float lp) { return std::max(static_cast<double>(lp), -9999.0); }

json utf8_bytes(const std::string& raw) {
  json bytes = json::array();
  for (char c : raw) bytes.push_back(static_cast<uint8_t>(c));
  return bytes;
}

}  // namespace

nlohmann::json logprobs_json(ApiKind kind, std::span<const LogprobEntry> entries) {
  if (kind == ApiKind::kChat) {
    json content = json::array();
    for (const LogprobEntry& e : entries) {
      json top = json::array();
      for (const auto& [raw, lp] : e.top) {
        top.push_back({{"token", sanitize_utf8(raw)}, {"logprob", json_logprob(lp)}, {"bytes", utf8_bytes(raw)}});
      }
      content.push_back({{"token", sanitize_utf8(e.token)},
                         {"logprob", json_logprob(e.logprob)},
                         {"bytes", utf8_bytes(e.token)},
                         {"top_logprobs", std::move(top)}});
    }
    return json{{"content", std::move(content)}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(sanitize_utf8(e.token));
    offsets.push_back(e.text_offset);
    if (!e.has_logprob) {  // the echoed prompt's first token: nothing predicts it
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(json_logprob(e.logprob));
    // The chosen token and the alternatives, as vLLM: up to N + 1 entries.
    json top = json::object();
    top[sanitize_utf8(e.token)] = json_logprob(e.logprob);
    for (const auto& [raw, lp] : e.top) {
      const std::string key = sanitize_utf8(raw);
      if (!top.contains(key)) top[key] = json_logprob(lp);  // two ids, one text: the likelier
    }
    top_logprobs.push_back(std::move(top));
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top_logprobs)},
              {"text_offset", std::move(offsets)}};
}

nlohmann::json prompt_logprobs_json(std::span<const TokenId> prompt, std::span<const TokenLogprobs> logprobs,
                                    int32_t top, const std::function<std::string(TokenId, TokenId)>& decode) {
  json out = json::array();
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i == 0 || i - 1 >= logprobs.size()) {
      out.push_back(nullptr);
      continue;
    }
    const TokenLogprobs& lp = logprobs[i - 1];
    const TokenId before = prompt[i - 1];
    json entry = json::object();
    const size_t k = std::min(lp.top.size(), static_cast<size_t>(std::max(top, 0)));
    for (size_t r = 0; r < k; ++r) {
      entry[std::to_string(lp.top[r].token)] = {
          {"logprob", json_logprob(lp.top[r].logprob)},
          {"rank", r + 1},
          {"decoded_token", sanitize_utf8(decode(before, lp.top[r].token))}};
    }
    entry[std::to_string(prompt[i])] = {{"logprob", json_logprob(lp.chosen.logprob)},
                                        {"rank", lp.chosen_rank},
                                        {"decoded_token", sanitize_utf8(decode(before, prompt[i]))}};
    out.push_back(std::move(entry));
  }
  return out;
}

nlohmann::json completion_response(ApiKind kind, const ResponseMeta& meta, std::span<const ChoiceOut> choices,
                                   const Usage& usage) {
  try {
    json out = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const ChoiceOut& c = choices[i];
      json choice{{"index", i}, {"logprobs", nullptr}, {"finish_reason", c.finish_reason}};
      if (c.logprobs) choice["logprobs"] = logprobs_json(kind, *c.logprobs);
      if (kind == ApiKind::kCompletion) {
        choice["text"] = c.text;
        if (c.prompt_logprobs) choice["prompt_logprobs"] = *c.prompt_logprobs;
      } else {
        choice["message"] = json{{"role", "assistant"}, {"content", c.text}};
        if (c.tool_calls && !c.tool_calls->empty()) {
          json calls = json::array();
          for (const ToolCallOut& t : *c.tool_calls) {
            calls.push_back({{"id", t.id},
                             {"type", "function"},
                             {"function", {{"name", t.name}, {"arguments", sanitize_utf8(t.arguments)}}}});
          }
          if (c.text.empty()) choice["message"]["content"] = nullptr;
          choice["message"]["tool_calls"] = std::move(calls);
        }
      }
      out.push_back(std::move(choice));
    }
    json j = envelope(kind, meta, /*chunk=*/false);
    j["choices"] = std::move(out);
    j["usage"] = usage_json(usage);
    if (kind == ApiKind::kChat && !choices.empty() && choices[0].prompt_logprobs) {
      j["prompt_logprobs"] = *choices[0].prompt_logprobs;
    }
    return j;
  } catch (...) {
    return json::object();
  }
}

nlohmann::json completion_response(ApiKind kind, const ResponseMeta& meta, const std::string& text,
                                   const std::string& finish_reason, const Usage& usage,
                                   const std::vector<LogprobEntry>* logprobs) {
  try {
    const ChoiceOut one{text, finish_reason, logprobs};
    return completion_response(kind, meta, std::span<const ChoiceOut>(&one, 1), usage);
  } catch (...) {
    return json::object();
  }
}

std::string stream_chunk(ApiKind kind, const ResponseMeta& meta, const std::string& text, bool first,
                         const std::vector<LogprobEntry>* logprobs, int32_t index,
                         const json* prompt_logprobs) {
  try {
    json choice{{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
    if (logprobs) choice["logprobs"] = logprobs_json(kind, *logprobs);
    if (kind == ApiKind::kCompletion) {
      choice["text"] = text;
      if (prompt_logprobs) choice["prompt_logprobs"] = *prompt_logprobs;
    } else {
      json delta{{"content", text}};
      if (first) delta["role"] = "assistant";
      choice["delta"] = std::move(delta);
    }
    json j = envelope(kind, meta, /*chunk=*/true);
    j["choices"] = json::array({std::move(choice)});
    if (kind == ApiKind::kChat && prompt_logprobs) j["prompt_logprobs"] = *prompt_logprobs;
    return event(j);
  } catch (...) {
    return {};
  }
}

std::string stream_tool_call_chunk(const ResponseMeta& meta, const ToolCallDelta& delta, bool first, int32_t index) {
  try {
    json call{{"index", delta.call_index}};
    json function{{"arguments", sanitize_utf8(delta.arguments)}};
    if (!delta.id.empty()) {
      call["id"] = delta.id;
      call["type"] = "function";
      function["name"] = delta.name;
    }
    call["function"] = std::move(function);
    json d{{"tool_calls", json::array({std::move(call)})}};
    if (first) {
      d["role"] = "assistant";
      d["content"] = nullptr;
    }
    json choice{{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullptr}, {"delta", std::move(d)}};
    json j = envelope(ApiKind::kChat, meta, /*chunk=*/true);
    j["choices"] = json::array({std::move(choice)});
    return event(j);
  } catch (...) {
    return {};
  }
}

std::string stream_finish_chunk(ApiKind kind, const ResponseMeta& meta, const std::string& finish_reason,
                                int32_t index) {
  try {
    json choice{{"index", index}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
    if (kind == ApiKind::kCompletion) {
      choice["text"] = "";
    } else {
      choice["delta"] = json::object();
    }
    json j = envelope(kind, meta, /*chunk=*/true);
    j["choices"] = json::array({std::move(choice)});
    return event(j);
  } catch (...) {
    return {};
  }
}

std::string stream_usage_chunk(ApiKind kind, const ResponseMeta& meta, const Usage& usage) {
  try {
    json j = envelope(kind, meta, /*chunk=*/true);
    j["choices"] = json::array();
    j["usage"] = usage_json(usage);
    return event(j);
  } catch (...) {
    return {};
  }
}

std::string stream_error_chunk(const ApiError& error) { return "data: " + error_body(error) + "\n\n"; }

nlohmann::json tokenize_response(std::span<const TokenId> tokens, int64_t max_model_len,
                                 const std::vector<std::string>* token_strs) {
  try {
    json out{{"count", tokens.size()}, {"max_model_len", max_model_len},
             {"tokens", std::vector<TokenId>(tokens.begin(), tokens.end())}};
    if (token_strs) {
      json strs = json::array();
      for (const std::string& piece : *token_strs) strs.push_back(sanitize_utf8(piece));
      out["token_strs"] = std::move(strs);
    }
    return out;
  } catch (...) {
    return json::object();
  }
}

nlohmann::json models_response(const std::string& model_name, int64_t created, int64_t max_model_len) {
  try {
    json model{{"id", model_name},
               {"object", "model"},
               {"created", created},
               {"owned_by", "specontext"},
               {"max_model_len", max_model_len}};
    return json{{"object", "list"}, {"data", json::array({std::move(model)})}};
  } catch (...) {
    return json::object();
  }
}

}  // namespace specontext::cluster
