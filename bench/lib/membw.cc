#include "bench/lib/membw.h"

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace specontext::bench {

BandwidthResult measure_triad(size_t bytes_per_array, int repetitions) {
  const size_t n = bytes_per_array / sizeof(double);
  std::unique_ptr<double[]> a(new double[n]), b(new double[n]), c(new double[n]);
  const tbb::blocked_range<size_t> all(0, n, 1 << 16);
  // First touch in parallel, as the triad will access them.
  tbb::parallel_for(all, [&](const tbb::blocked_range<size_t>& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) { a[i] = 0.0; b[i] = 1.0; c[i] = 2.0; }
  }, tbb::static_partitioner());
  double best = 1e30;
  for (int rep = 0; rep < repetitions; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    tbb::parallel_for(all, [&](const tbb::blocked_range<size_t>& r) {
      for (size_t i = r.begin(); i < r.end(); ++i) a[i] = b[i] + 3.0 * c[i];
    }, tbb::static_partitioner());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  BandwidthResult res;
  res.bytes_per_array = n * sizeof(double);
  res.triad_gb_per_s = 3.0 * static_cast<double>(res.bytes_per_array) / best / 1e9;
  res.threads = tbb::info::default_concurrency();
  return res;
}

ReadBandwidthResult measure_read(size_t bytes, int repetitions) {
  const size_t n = bytes / sizeof(uint64_t);
  std::unique_ptr<uint64_t[]> a(new uint64_t[n]);
  const tbb::blocked_range<size_t> all(0, n, 1 << 16);
  tbb::parallel_for(all, [&](const tbb::blocked_range<size_t>& r) {
    for (size_t i = r.begin(); i < r.end(); ++i) a[i] = i & 7;
  }, tbb::static_partitioner());
  double best = 1e30;
  uint64_t sink = 0;
  for (int rep = 0; rep < repetitions; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    // Integer sums vectorise (they are associative), so the adds never limit the loads.
    sink += tbb::parallel_reduce(all, uint64_t{0}, [&](const tbb::blocked_range<size_t>& r, uint64_t acc) {
      for (size_t i = r.begin(); i < r.end(); ++i) acc += a[i];
      return acc;
    }, std::plus<uint64_t>(), tbb::static_partitioner());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  volatile uint64_t keep = sink;  // the sums are used, so the loads stay
  (void)keep;
  ReadBandwidthResult res;
  res.bytes = n * sizeof(uint64_t);
  res.read_gb_per_s = static_cast<double>(res.bytes) / best / 1e9;
  res.threads = tbb::this_task_arena::max_concurrency();
  return res;
}

}  // namespace specontext::bench
