// Sizes and bandwidths as people type them on a command line.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "core/base/status.h"

namespace specontext::planner {

// "80GiB", "80G", "512MiB", "1.5TiB", "4096", "80GB". Binary suffixes (K, M, G, T with or without
// "iB") are powers of 1024; "KB", "MB", "GB", "TB" are powers of 1000; no suffix or "B" is bytes.
// Case-insensitive. Fractions are allowed and rounded down to whole bytes.
Result<int64_t> parse_size(std::string_view text);

// Comma-separated sizes: "512GiB,256GiB".
Result<std::vector<int64_t>> parse_size_list(std::string_view text);

// Comma-separated non-negative numbers: "50,25.5".
Result<std::vector<double>> parse_number_list(std::string_view text);

}  // namespace specontext::planner
