// How a benchmark leaves its figures: the JSON document at `out` (its folder created) and on
// stdout, and with `plot` the PNG that `plot_script` makes from it (python3 + matplotlib).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/base/status.h"

namespace specontext::bench {

void write_report(const nlohmann::json& doc, const std::string& out, bool plot,
                  const std::string& plot_script);

// The --out PATH and --plot options every report-writing benchmark has.
inline void add_report_options(CLI::App& app, std::string& out, bool& plot) {
  app.add_option("--out", out, "JSON output path");
  app.add_flag("--plot", plot, "also write a PNG next to the JSON (python3 + matplotlib)");
}

// main()'s exit for a failed step: the error on stderr, status 1.
inline int report_failure(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.to_string().c_str());
  return 1;
}

}  // namespace specontext::bench
