#include "tests/tests_common.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace specontext::testing {

std::string repo_path(const std::string& relative) {
  return std::string(SPECONTEXT_SOURCE_DIR) + "/" + relative;
}

std::string temp_dir(const std::string& prefix) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() /
             (prefix + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace specontext::testing
