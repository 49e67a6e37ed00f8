// One error vocabulary for the whole project: Status and Result<T>.
// No exceptions cross module boundaries; every fallible call returns one of these.
#pragma once

#include <cassert>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace specontext {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // bad input from a user or a file
  kNotFound,          // file, tensor, key missing
  kOutOfRange,        // index/length beyond a limit (e.g. prompt longer than context)
  kUnimplemented,     // a feature or dtype this build does not support
  kResourceExhausted, // out of memory / capacity; also back-pressure (NO_RESOURCE)
  kInProgress,        // asynchronous operation not finished yet (not an error)
  kUnavailable,       // device or peer not present / dead
  kDataLoss,          // truncated or corrupt data
  kInternal,          // invariant broken inside the project
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message,
         std::source_location where = std::source_location::current())
      : code_(code), message_(std::move(message)), file_(where.file_name()),
        line_(static_cast<int>(where.line())) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: <message>"; the source location is added only in debug text.
  std::string to_string() const;
  std::string debug_string() const;
  // Prefixes context ("while loading X: ") keeping the original code.
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  const char* file_ = "";
  int line_ = 0;
};

inline Status invalid_argument(std::string msg,
                               std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kInvalidArgument, std::move(msg), w);
}
inline Status data_loss(std::string msg, std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kDataLoss, std::move(msg), w);
}
inline Status not_found(std::string msg, std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kNotFound, std::move(msg), w);
}
inline Status unimplemented(std::string msg,
                            std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kUnimplemented, std::move(msg), w);
}
inline Status out_of_range(std::string msg,
                           std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kOutOfRange, std::move(msg), w);
}
inline Status internal_error(std::string msg,
                             std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kInternal, std::move(msg), w);
}
inline Status resource_exhausted(std::string msg,
                                 std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kResourceExhausted, std::move(msg), w);
}
inline Status unavailable(std::string msg,
                          std::source_location w = std::source_location::current()) {
  return Status(StatusCode::kUnavailable, std::move(msg), w);
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).is_ok() && "Result built from an OK status");
  }
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace specontext

#define SPX_CONCAT_INNER(a, b) a##b
#define SPX_CONCAT(a, b) SPX_CONCAT_INNER(a, b)

#define SPX_RETURN_IF_ERROR(expr)                         \
  do {                                                    \
    ::specontext::Status spx_status_ = (expr);            \
    if (!spx_status_.is_ok()) return spx_status_;         \
  } while (0)

// Adds context while keeping the original code: SPX_RETURN_IF_ERROR_CTX(load(), "while loading X")
#define SPX_RETURN_IF_ERROR_CTX(expr, context)                                \
  do {                                                                        \
    ::specontext::Status spx_status_ = (expr);                                \
    if (!spx_status_.is_ok()) return spx_status_.with_context(context);       \
  } while (0)

#define SPX_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)     \
  auto tmp = (expr);                                  \
  if (!tmp.is_ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#define SPX_ASSIGN_OR_RETURN(lhs, expr) \
  SPX_ASSIGN_OR_RETURN_IMPL(SPX_CONCAT(spx_result_, __LINE__), lhs, expr)

// Internal invariants only, never input validation.
#define SPX_ASSERT(cond) assert(cond)
