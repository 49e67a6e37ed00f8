// STREAM-like triad (a[i] = b[i] + s·c[i]) with oneTBB: the memory bandwidth the roofline uses.
#pragma once

#include <cstddef>

namespace specontext::bench {

struct BandwidthResult {
  double triad_gb_per_s = 0.0;  // best of the repetitions, counting 3 arrays moved per element
  size_t bytes_per_array = 0;
  int threads = 0;
};

BandwidthResult measure_triad(size_t bytes_per_array, int repetitions);

}  // namespace specontext::bench
