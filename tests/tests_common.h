// Helpers shared by the test executables.
#pragma once

#include <string>
#include <vector>

namespace specontext::testing {

// Absolute path of a file in the source tree, e.g. repo_path("models/stories260K/tok512.bin").
std::string repo_path(const std::string& relative);
// A fresh empty directory under the system temp dir, removed by the OS eventually.
std::string temp_dir(const std::string& prefix);
std::string read_text_file(const std::string& path);
void write_file(const std::string& path, const std::string& bytes);

}  // namespace specontext::testing
