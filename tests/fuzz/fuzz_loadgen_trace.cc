// libFuzzer target for bench_loadgen's (and bench_cluster_sim's) input, the JSONL trace
// (bench/lib/loadgen.h parse_trace): a Status for any bytes, never a throw or a crash, and a trace
// that parses keeps its limits.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "bench/lib/loadgen.h"

namespace lg = specontext::bench::loadgen;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lg::TraceLimits limits;
  limits.max_line_bytes = 4096;
  limits.max_requests = 256;
  limits.max_prefixes = 64;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  auto t = lg::parse_trace(in, limits);
  if (t.is_ok() && static_cast<int64_t>(t->requests.size()) > limits.max_requests) __builtin_trap();
  return 0;
}
