// Prints the measured STREAM-like triad bandwidth and the read-only bandwidth (what a
// weight-bound decode step does) as JSON.
#include <cstdio>
#include <cstdlib>

#include "bench/lib/membw.h"

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 512;
  const auto r = specontext::bench::measure_triad(mib << 20, 10);
  const auto rd = specontext::bench::measure_read(3 * (mib << 20), 10);
  std::printf("{\"triad_gb_per_s\": %.3f, \"bytes_per_array\": %zu, \"read_gb_per_s\": %.3f, \"read_bytes\": %zu, "
              "\"threads\": %d}\n",
              r.triad_gb_per_s, r.bytes_per_array, rd.read_gb_per_s, rd.bytes, r.threads);
  return 0;
}
