// bench_gpu_copy: host→device copy rates of CudaTransport's two methods for sparse row gathers
// (the traffic of SpeContext's elastic loading: one KV head's row of one token per request), as
// a fraction of the measured host→device peak. Prints one line per case to stderr and writes
// JSON to --out; the crossover row size per batch gives kAuto's threshold
// (CudaTransportOptions::gather_below_bytes). Without a CUDA device it says so, produces no
// figures and exits 0.
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/ports/transport.h"
#include "gpu/cuda_backend.h"
#include "gpu/cuda_raii.h"
#include "gpu/cuda_transport.h"

namespace {

using specontext::MemoryKind;
using specontext::Status;
using specontext::StatusCode;
using specontext::TierId;
using specontext::TransferBatch;
using specontext::TransferHandle;
using specontext::gpu::CopyMethod;
using specontext::gpu::CudaTransport;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int fail(const Status& s, const char* what) {
  std::fprintf(stderr, "bench_gpu_copy: %s: %s\n", what, s.to_string().c_str());
  return 1;
}

// Peak of one direction: large cudaMemcpyAsync between pinned host and device memory, timed with
// events; the median of `reps`.
double peak_gb_per_s(void* host, void* dev, size_t bytes, bool to_device, int reps, cudaStream_t stream) {
  cudaEvent_t a = nullptr, b = nullptr;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> rates;
  for (int r = 0; r <= reps; ++r) {  // r == 0 warms up
    cudaEventRecord(a, stream);
    if (to_device) {
      cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream);
    } else {
      cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream);
    }
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0 && ms > 0.0f) rates.push_back(static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(rates);
}

struct CaseResult {
  double prepare_ms = 0.0;
  double transfer_ms = 0.0;  // post → complete, wall clock, median over reps
  bool ok = false;
  std::string error;
};

CaseResult run_case(CudaTransport& t, const TransferBatch& batch, int reps) {
  CaseResult r;
  std::vector<double> times;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up (pools, staging ring, code paths)
    const auto t0 = Clock::now();
    auto h = t.prepare(batch);
    if (!h.is_ok()) {
      r.error = h.status().to_string();
      return r;
    }
    const double prep = seconds_since(t0);
    const auto t1 = Clock::now();
    Status s = t.post(*h);
    while (s.code() == StatusCode::kInProgress) {
      std::this_thread::yield();
      s = t.poll(*h);
    }
    const double took = seconds_since(t1);
    t.release(*h);
    if (!s.is_ok()) {
      r.error = s.to_string();
      return r;
    }
    if (rep > 0) {
      times.push_back(took * 1e3);
      r.prepare_ms += prep * 1e3 / reps;
    }
  }
  r.transfer_ms = median(times);
  r.ok = true;
  return r;
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = text.find(',', at);
    out.push_back(std::stoll(text.substr(at, comma - at)));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"host->device copy rates of CudaTransport (DMA vs gather kernel) for sparse row gathers"};
  std::string out_path = "bench_out/gpu_copy.json";
  std::string row_list = "128,256,512,1024,2048,4096,8192";
  std::string batch_list = "1024,4096,16384,65536,262144";
  int device = 0;
  int reps = 3;
  int64_t peak_mib = 256;
  int64_t max_case_mib = 1024;
  app.add_option("--out", out_path, "JSON output file");
  app.add_option("--row-bytes", row_list, "comma-separated row sizes in bytes");
  app.add_option("--rows", batch_list, "comma-separated rows per batch");
  app.add_option("--device", device, "CUDA device ordinal");
  app.add_option("--reps", reps, "timed repetitions per case (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--peak-mib", peak_mib, "bytes of the peak measurement (MiB)")->check(CLI::PositiveNumber);
  app.add_option("--max-case-mib", max_case_mib, "skip cases moving more than this (MiB)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  std::vector<int64_t> row_sizes, batches;
  try {
    row_sizes = parse_list(row_list);
    batches = parse_list(batch_list);
  } catch (const std::exception&) {
    std::fprintf(stderr, "bench_gpu_copy: --row-bytes and --rows take comma-separated integers\n");
    return 2;
  }
  const auto positive = [](int64_t v) { return v > 0; };
  if (row_sizes.empty() || batches.empty() || !std::all_of(row_sizes.begin(), row_sizes.end(), positive) ||
      !std::all_of(batches.begin(), batches.end(), positive)) {
    std::fprintf(stderr, "bench_gpu_copy: --row-bytes and --rows need positive values\n");
    return 2;
  }

  auto count = specontext::gpu::cuda_device_count();
  if (!count.is_ok()) {
    const std::string msg = "bench_gpu_copy: " + count.status().message() + "; no figures were produced (" +
                            out_path + " not written)";
    std::printf("%s\n", msg.c_str());
    std::fprintf(stderr, "%s\n", msg.c_str());
    return 0;
  }
  if (device < 0 || device >= *count) {
    std::fprintf(stderr, "bench_gpu_copy: --device %d, %d present\n", device, *count);
    return 2;
  }
  if (cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "bench_gpu_copy: cudaSetDevice(%d) failed\n", device);
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, device);

  // Pools: every case's rows live in the first rows × row_bytes bytes of each.
  int64_t pool = int64_t{peak_mib} << 20;
  for (int64_t r : batches) {
    for (int64_t b : row_sizes) {
      if (r * b <= (max_case_mib << 20)) pool = std::max(pool, r * b);
    }
  }
  auto host = specontext::gpu::PinnedHostBuffer::create(static_cast<size_t>(pool));
  if (!host.is_ok()) return fail(host.status(), "pinned host pool");
  auto dev = specontext::gpu::DeviceBuffer<uint8_t>::create(static_cast<size_t>(pool));
  if (!dev.is_ok()) return fail(dev.status(), "device pool");
  std::memset(host->data(), 0x3C, static_cast<size_t>(pool));
  auto stream = specontext::gpu::CudaStream::create();
  if (!stream.is_ok()) return fail(stream.status(), "stream");

  const size_t peak_bytes = static_cast<size_t>(peak_mib) << 20;
  const double h2d_peak = peak_gb_per_s(host->data(), dev->data(), peak_bytes, true, 5, stream->get());
  const double d2h_peak = peak_gb_per_s(host->data(), dev->data(), peak_bytes, false, 5, stream->get());
  std::fprintf(stderr, "%s: host->device peak %.2f GB/s, device->host %.2f GB/s (%lld MiB copies)\n",
               prop.name, h2d_peak, d2h_peak, static_cast<long long>(peak_mib));

  nlohmann::json cases = nlohmann::json::array();
  nlohmann::json crossover = nlohmann::json::array();
  std::mt19937_64 rng(1234);
  const CopyMethod methods[] = {CopyMethod::kDma, CopyMethod::kGatherKernel};
  for (int64_t rows : batches) {
    int64_t dma_wins_from = -1;  // smallest row size at which DMA is at least as fast
    for (int64_t row : row_sizes) {
      const int64_t bytes = rows * row;
      if (bytes > (max_case_mib << 20)) {
        cases.push_back(
            {{"row_bytes", row}, {"rows", rows}, {"bytes", bytes}, {"skipped", "above --max-case-mib"}});
        continue;
      }
      // A gather: random source rows (a permutation, so adjacent requests almost never coalesce)
      // into consecutive destination slots, as a working-set refill does.
      std::vector<int64_t> perm(static_cast<size_t>(rows));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      TransferBatch batch;
      batch.reserve(perm.size());
      for (int64_t i = 0; i < rows; ++i) {
        batch.push_back({TierId(0), static_cast<uint64_t>(perm[static_cast<size_t>(i)] * row), TierId(1),
                         static_cast<uint64_t>(i * row), static_cast<uint64_t>(row)});
      }
      double rate[2] = {0.0, 0.0};
      for (int m = 0; m < 2; ++m) {
        auto t = CudaTransport::create(device, {methods[m], specontext::gpu::kDefaultGatherBelowBytes});
        if (!t.is_ok()) return fail(t.status(), "transport");
        Status reg = (*t)->register_tier(TierId(0), MemoryKind::kPinnedHost, host->data(),
                                         static_cast<uint64_t>(pool));
        if (reg.is_ok())
          reg = (*t)->register_tier(TierId(1), MemoryKind::kDevice, dev->data(), static_cast<uint64_t>(pool));
        if (!reg.is_ok()) return fail(reg, "register tiers");
        const CaseResult r = run_case(**t, batch, reps);
        nlohmann::json c = {{"row_bytes", row},
                            {"rows", rows},
                            {"bytes", bytes},
                            {"method", std::string(specontext::gpu::copy_method_name(methods[m]))}};
        if (!r.ok) {
          c["error"] = r.error;
          std::fprintf(stderr, "%6lld rows x %5lld B %-13s error: %s\n", static_cast<long long>(rows),
                       static_cast<long long>(row), specontext::gpu::copy_method_name(methods[m]).data(),
                       r.error.c_str());
        } else {
          rate[m] = static_cast<double>(bytes) / (r.transfer_ms * 1e-3) / 1e9;
          c["prepare_ms"] = r.prepare_ms;
          c["transfer_ms"] = r.transfer_ms;
          c["gb_per_s"] = rate[m];
          c["fraction_of_peak"] = h2d_peak > 0.0 ? rate[m] / h2d_peak : 0.0;
          std::fprintf(
              stderr,
              "%6lld rows x %5lld B %-13s prepare %8.3f ms  transfer %8.3f ms  %7.2f GB/s  %5.1f%% of peak\n",
              static_cast<long long>(rows), static_cast<long long>(row),
              specontext::gpu::copy_method_name(methods[m]).data(), r.prepare_ms, r.transfer_ms, rate[m],
              h2d_peak > 0.0 ? 100.0 * rate[m] / h2d_peak : 0.0);
        }
        cases.push_back(c);
      }
      if (dma_wins_from < 0 && rate[0] > 0.0 && rate[0] >= rate[1]) dma_wins_from = row;
    }
    crossover.push_back({{"rows", rows},
                         {"smallest_row_bytes_where_dma_wins",
                          dma_wins_from < 0 ? nlohmann::json(nullptr) : nlohmann::json(dma_wins_from)}});
  }

  // kAuto compares the mean coalesced request size with its threshold: the crossover of the
  // largest batch measured is the figure to put into kDefaultGatherBelowBytes.
  nlohmann::json suggested = nullptr;
  for (auto it = crossover.rbegin(); it != crossover.rend(); ++it) {
    if (!(*it)["smallest_row_bytes_where_dma_wins"].is_null()) {
      suggested = (*it)["smallest_row_bytes_where_dma_wins"];
      break;
    }
  }
  nlohmann::json out = {
      {"device", prop.name},
      {"sm_count", prop.multiProcessorCount},
      {"peak", {{"h2d_gb_per_s", h2d_peak}, {"d2h_gb_per_s", d2h_peak}, {"bytes", peak_bytes}}},
      {"reps", reps},
      {"cases", cases},
      {"crossover", crossover},
      {"suggested_gather_below_bytes", suggested},
      {"default_gather_below_bytes", specontext::gpu::kDefaultGatherBelowBytes},
      {"note",
       "transfer_ms is wall time from post to completion (includes the DMA calls' CPU cost and the piece "
       "list upload); prepare_ms is validation and planning. null crossover: the kernel won at every row "
       "size measured."}};
  const std::filesystem::path path(out_path);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << out.dump(2) << "\n";
  std::fprintf(stderr, "wrote %s\n", out_path.c_str());
  return 0;
}
