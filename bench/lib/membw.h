// Memory bandwidth with oneTBB for rooflines: a STREAM-like triad (a[i] = b[i] + s·c[i]) and a
// read-only sum (what a weight-bound decode step does: it reads the weights and writes little).
#pragma once

#include <cstddef>

namespace specontext::bench {

struct BandwidthResult {
  double triad_gb_per_s = 0.0;  // best of the repetitions, counting 3 arrays moved per element
  size_t bytes_per_array = 0;
  int threads = 0;
};

BandwidthResult measure_triad(size_t bytes_per_array, int repetitions);

struct ReadBandwidthResult {
  double read_gb_per_s = 0.0;  // best of the repetitions: bytes read / time
  size_t bytes = 0;
  int threads = 0;
};

// Sums `bytes` of doubles over the current task arena's threads (first touched by them).
ReadBandwidthResult measure_read(size_t bytes, int repetitions);

}  // namespace specontext::bench
