// Helpers shared by the test executables.
#pragma once

#include <cstddef>
#include <cstdint>
#include <gtest/gtest.h>
#include <span>
#include <string>
#include <vector>

namespace specontext::testing {

// Absolute path of a file in the source tree, e.g. repo_path("models/stories260K/tok512.bin").
std::string repo_path(const std::string& relative);
// A fresh empty directory under the system temp dir, removed by the OS eventually.
std::string temp_dir(const std::string& prefix);
std::string read_text_file(const std::string& path);
void write_file(const std::string& path, const std::string& bytes);
// A file of secrets as users are told to write them: `text` and a newline, mode 0600.
::testing::AssertionResult write_owner_only(const std::string& path, const std::string& text);
// ‖a − b‖₂ / ‖b‖₂ over a.size() elements (b the reference), in double.
double rel_l2(std::span<const float> a, std::span<const float> b);

// Random data from a seed (std::mt19937_64): the same seed gives the same bytes everywhere.
void fill_random(std::span<std::byte> out, uint64_t seed);
void fill_random(std::span<uint8_t> out, uint64_t seed);
// Uniform in [lo, hi).
void fill_random(std::span<float> out, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
template <class Byte = std::byte>
std::vector<Byte> random_bytes(size_t n, uint64_t seed) {
  std::vector<Byte> v(n);
  fill_random(std::as_writable_bytes(std::span<Byte>(v)), seed);
  return v;
}

}  // namespace specontext::testing
