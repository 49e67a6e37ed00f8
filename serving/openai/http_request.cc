#include "serving/openai/http_request.h"

#include "core/base/private_file.h"

#include <algorithm>
#include <cstdlib>
#include <cctype>

namespace specontext::cluster {

namespace beast = boost::beast;
namespace http = beast::http;

void configure_request_parser(HttpRequestParser& parser, uint64_t max_body_bytes) {
  parser.body_limit(max_body_bytes);
  parser.header_limit(kRequestHeaderLimit);
}

std::string_view path_of(const HttpRequestHeader& req) {
  std::string_view target(req.target().data(), req.target().size());
  return target.substr(0, target.find('?'));
}

bool is_probe(std::string_view path) { return path == "/health" || path == "/metrics"; }

std::optional<std::string_view> bearer_token(std::string_view authorization) {
  constexpr std::string_view kScheme = "bearer";
  if (authorization.size() <= kScheme.size() || authorization[kScheme.size()] != ' ') return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kScheme[i]) return std::nullopt;
  }
  std::string_view token = authorization.substr(kScheme.size());
  token.remove_prefix(std::min(token.find_first_not_of(' '), token.size()));
  return token;
}

bool constant_time_equal(std::string_view given, std::string_view key) {
  uint8_t diff = given.size() == key.size() ? 0 : 1;
  for (size_t i = 0; i < given.size(); ++i) {
    const auto k = key.empty() ? uint8_t{0} : static_cast<uint8_t>(key[i % key.size()]);
    diff |= static_cast<uint8_t>(static_cast<uint8_t>(given[i]) ^ k);
  }
  return diff == 0;
}

bool authorized(const HttpRequestHeader& req, const std::vector<std::string>& api_keys) {
  if (api_keys.empty()) return true;
  const std::string_view path = path_of(req);
  // /health and /metrics stay open, as in vLLM; unlike vLLM, so do not /tokenize and /detokenize.
  if (!path.starts_with("/v1/") && path != "/tokenize" && path != "/detokenize") return true;
  const auto header = req.find(http::field::authorization);
  if (header == req.end()) return false;
  const beast::string_view value = header->value();
  const std::optional<std::string_view> token = bearer_token(std::string_view(value.data(), value.size()));
  if (!token) return false;
  bool match = false;
  for (const std::string& key : api_keys) match |= constant_time_equal(*token, key);  // no early exit
  return match;
}

bool expects_continue(const HttpRequestHeader& req) {
  return beast::iequals(req[http::field::expect], "100-continue");
}

bool refuse_unread(const HttpRequestParser& parser, bool key_ok) {
  if (key_ok || parser.is_done()) return false;
  // content_length() may only be asked once the header was read (Beast asserts it).
  const bool small_body = parser.content_length() && *parser.content_length() <= kUnauthorizedBodyBytes;
  return expects_continue(parser.get()) || !small_body;
}

ApiError unreadable_request_error(const beast::error_code& ec, uint64_t max_body_bytes) {
  if (ec == http::error::body_limit) {
    return {413, "invalid_request_error",
            "request body is larger than " + std::to_string(max_body_bytes) + " bytes", "", ""};
  }
  return {400, "invalid_request_error", "malformed HTTP request: " + ec.message(), "", ""};
}

Routing route_of(http::verb method, std::string_view method_name, std::string_view path) {
  const bool get = method == http::verb::get;
  const bool post = method == http::verb::post;
  auto wrong_method = [&](std::string_view allowed) -> Routing {
    return {std::nullopt,
            {405, "invalid_request_error",
             "method " + std::string(method_name) + " is not allowed on " + std::string(path) + " (use " +
                 std::string(allowed) + ")",
             "", ""}};
  };
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (!post) return wrong_method("POST");
    return {path == "/v1/completions" ? Route::kCompletions : Route::kChatCompletions, {}};
  }
  if (path == "/v1/models" || path == "/health" || path == "/metrics") {
    if (!get) return wrong_method("GET");
    return {path == "/v1/models" ? Route::kModels : path == "/health" ? Route::kHealth : Route::kMetrics, {}};
  }
  if (path == "/tokenize" || path == "/detokenize") {
    if (!post) return wrong_method("POST");
    return {path == "/tokenize" ? Route::kTokenize : Route::kDetokenize, {}};
  }
  return {
      std::nullopt,
      {404, "not_found_error",
       "no route " + std::string(path) +
           " (serving /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, "
           "/metrics)",
       "", ""}};
}

Result<std::vector<std::string>> load_api_keys(const std::string& file) {
  static constexpr size_t kMaxApiKeysFileBytes = 64 * 1024;
  static constexpr std::string_view kSpace = " \t\r";
  std::vector<std::string> keys;
  if (file.empty()) {
    const char* env = std::getenv("SPECONTEXT_API_KEY");
    if (env == nullptr) return keys;
    std::string_view key(env);
    while (!key.empty() && kSpace.find(key.back()) != std::string_view::npos) key.remove_suffix(1);
    if (key.empty()) return invalid_argument("SPECONTEXT_API_KEY: empty; unset it for no key");
    keys.emplace_back(key);
    return keys;
  }
  SPX_ASSIGN_OR_RETURN(std::string text, read_private_file(file, kMaxApiKeysFileBytes, "--api-key-file"));
  std::string_view rest(text);
  while (!rest.empty()) {
    const size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    while (!line.empty() && kSpace.find(line.front()) != std::string_view::npos) line.remove_prefix(1);
    while (!line.empty() && kSpace.find(line.back()) != std::string_view::npos) line.remove_suffix(1);
    if (!line.empty()) keys.emplace_back(line);
  }
  if (keys.empty()) return invalid_argument("--api-key-file " + file + ": holds no key (one per line)");
  return keys;
}

}  // namespace specontext::cluster
