#include "tests/tests_common.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
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

::testing::AssertionResult write_owner_only(const std::string& path, const std::string& text) {
  std::ofstream(path) << text << "\n";
  if (::chmod(path.c_str(), 0600) != 0) return ::testing::AssertionFailure() << "chmod 0600 " << path;
  return ::testing::AssertionSuccess();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

double rel_l2(std::span<const float> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

void fill_random(std::span<std::byte> out, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(out.data() + i, &r, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<std::byte>(rng() & 0xff);
}

void fill_random(std::span<uint8_t> out, uint64_t seed) {
  fill_random(std::as_writable_bytes(out), seed);
}

void fill_random(std::span<float> out, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (float& f : out) f = dist(rng);
}

}  // namespace specontext::testing
