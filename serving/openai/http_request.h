// The OpenAI server's HTTP request handling that needs no socket (serving/openai/openai_server.h):
// the request parser as the server configures it, API-key checks, the decision to refuse a
// request before its body is read, and routing. Pure functions, fuzzed
// (tests/fuzz/fuzz_http_request.cc) with the parser exactly as the server sets it up.
#pragma once

#include <boost/beast/http.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "serving/openai/openai_api.h"

namespace specontext::cluster {

using HttpRequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;
using HttpRequestHeader = boost::beast::http::request_header<>;

// The most a request header may take; a larger one is a malformed request.
inline constexpr uint64_t kRequestHeaderLimit = 64 * 1024;
// A request without a valid key may have this much body read, so its connection stays open.
inline constexpr uint64_t kUnauthorizedBodyBytes = 64 * 1024;

// Sets a new parser's limits as the server does: the body (max_body_bytes: more is 413) and the
// header (kRequestHeaderLimit).
void configure_request_parser(HttpRequestParser& parser, uint64_t max_body_bytes);

// The target's path (without the query).
std::string_view path_of(const HttpRequestHeader& req);
// The routes answered on every connection, past the connection limits too.
bool is_probe(std::string_view path);

// The token of "Authorization: Bearer <token>" (the scheme is case-insensitive, RFC 7235), or
// nothing when the header is absent or of another scheme.
std::optional<std::string_view> bearer_token(std::string_view authorization);
// Equal without an early exit: the time depends on the given token's length only, not on where
// (or whether) it differs from the key, so a client cannot find a key byte by byte by timing.
bool constant_time_equal(std::string_view given, std::string_view key);
// True when no keys are set, the target is outside /v1/ (and not /tokenize or /detokenize), or
// the Bearer token is one of the keys (each compared in full).
bool authorized(const HttpRequestHeader& req, const std::vector<std::string>& api_keys);

// The API keys clients must send: one per line of `file` (--api-key-file; blank lines and
// surrounding whitespace ignored; the file readable by its owner only, at most 64 KiB, at least
// one key), else the SPECONTEXT_API_KEY variable (one key), else none. Never from the command
// line, where every local user reads it (ps, /proc/PID/cmdline). kInvalidArgument naming
// --api-key-file or the variable.
Result<std::vector<std::string>> load_api_keys(const std::string& file);

// Once a request's header is read (parser.is_header_done()): true when it must be refused (401)
// unread and its connection closed: without a valid key, a body that is large, chunked, or waits
// for a 100 Continue is not read.
bool refuse_unread(const HttpRequestParser& parser, bool key_ok);
// True when the client waits for "100 Continue" before it sends the body.
bool expects_continue(const HttpRequestHeader& req);

// The answer to a request that cannot be read: 413 past the body limit, else 400.
ApiError unreadable_request_error(const boost::beast::error_code& ec, uint64_t max_body_bytes);

enum class Route { kCompletions, kChatCompletions, kModels, kHealth, kMetrics, kTokenize, kDetokenize };
// A request's route by its path and method, or the error to answer: 404 for an unknown path,
// 405 for a method the route does not take.
struct Routing {
  std::optional<Route> route;
  ApiError error;  // without a route
};
Routing route_of(boost::beast::http::verb method, std::string_view method_name, std::string_view path);

}  // namespace specontext::cluster
