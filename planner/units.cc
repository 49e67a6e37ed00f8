#include "planner/units.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>
#include <utility>

namespace specontext::planner {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split_commas(std::string_view text) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    parts.push_back(trim(text.substr(start, comma == std::string_view::npos ? text.npos : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return parts;
}

// Parses a leading non-negative decimal number; returns the rest in `rest`.
bool parse_number_prefix(std::string_view s, double& value, std::string_view& rest) {
  size_t n = 0;
  bool digits = false, dot = false;
  while (n < s.size() && (std::isdigit(static_cast<unsigned char>(s[n])) || (s[n] == '.' && !dot))) {
    if (s[n] == '.') dot = true; else digits = true;
    ++n;
  }
  if (!digits) return false;
  // from_chars for double is available in libstdc++ 11+.
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + n, value);
  if (ec != std::errc() || ptr != s.data() + n) return false;
  rest = s.substr(n);
  return true;
}

}  // namespace

Result<int64_t> parse_size(std::string_view text) {
  const std::string_view t = trim(text);
  double value = 0;
  std::string_view rest;
  if (!parse_number_prefix(t, value, rest)) {
    return invalid_argument("size '" + std::string(text) + "': expected a number with an optional "
                            "suffix such as 80GiB, 80G, 512MiB or 80GB");
  }
  const std::string suffix = lower(trim(rest));
  double mult = 0;
  if (suffix.empty() || suffix == "b") mult = 1;
  else if (suffix == "k" || suffix == "kib") mult = 1024.0;
  else if (suffix == "m" || suffix == "mib") mult = 1024.0 * 1024;
  else if (suffix == "g" || suffix == "gib") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "t" || suffix == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (suffix == "kb") mult = 1e3;
  else if (suffix == "mb") mult = 1e6;
  else if (suffix == "gb") mult = 1e9;
  else if (suffix == "tb") mult = 1e12;
  else {
    return invalid_argument("size '" + std::string(text) + "': unknown suffix '" + std::string(trim(rest)) +
                            "' (use B, KiB/K, MiB/M, GiB/G, TiB/T, or KB/MB/GB/TB for powers of 1000)");
  }
  const long double bytes = static_cast<long double>(value) * mult;
  if (bytes >= 9.0e18L) return invalid_argument("size '" + std::string(text) + "' is too large");
  return static_cast<int64_t>(std::floor(bytes));
}

Result<std::vector<int64_t>> parse_size_list(std::string_view text) {
  std::vector<int64_t> out;
  for (std::string_view part : split_commas(text)) {
    SPX_ASSIGN_OR_RETURN(int64_t v, parse_size(part));
    out.push_back(v);
  }
  return out;
}

Result<std::vector<double>> parse_number_list(std::string_view text) {
  std::vector<double> out;
  for (std::string_view part : split_commas(text)) {
    double v = 0;
    std::string_view rest;
    if (!parse_number_prefix(part, v, rest) || !rest.empty()) {
      std::string msg = "number list '";  // built stepwise: GCC 12 warns falsely on "'" + string
      msg.append(text).append("': '").append(part).append("' is not a non-negative number");
      return invalid_argument(std::move(msg));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace specontext::planner
