#include "bench/lib/report.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace specontext::bench {

void write_report(const nlohmann::json& doc, const std::string& out, bool plot,
                  const std::string& plot_script) {
  const std::filesystem::path dir = std::filesystem::path(out).parent_path();
  std::filesystem::create_directories(dir.empty() ? std::filesystem::path(".") : dir);
  std::ofstream(out) << doc.dump(2) << "\n";
  std::printf("%s\n", doc.dump().c_str());
  if (!plot) return;
  const std::string cmd = "/usr/bin/python3 '" + plot_script + "' '" + out + "'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "%s: plotting failed\n", plot_script.c_str());
}

}  // namespace specontext::bench
