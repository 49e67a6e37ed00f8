// How a benchmark leaves its figures: the JSON document at `out` (its folder created) and on
// stdout, and with `plot` the PNG that `plot_script` makes from it (python3 + matplotlib).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace specontext::bench {

void write_report(const nlohmann::json& doc, const std::string& out, bool plot,
                  const std::string& plot_script);

}  // namespace specontext::bench
