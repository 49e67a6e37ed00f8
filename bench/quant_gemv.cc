// Quantised GEMV (cpu/quant_gemv.h) against the memory roofline: per ggml type and kernel path,
// the time of y = W·x (m = 1; --m for the small-batch path) for 2048x2048 and 8192x2048 matrices streamed from DRAM (copies
// of the matrix cycled so the working set exceeds the caches, as a decode step's weights do),
// its GB/s of stored bytes, the tok/s a Llama-3.2-1B body would reach at that speed, and the
// roofline (stored bytes / measured read bandwidth); beside it the current path, the f32 GEMV of
// the dequantised matrix through CpuBackend::matmul (oneDNN). Writes JSON (and a PNG through
// bench/plot_quant_gemv.py with --plot).
//
//   build/release/bench/bench_quant_gemv --threads 2 --out bench_out/quant_gemv.json --plot
#include <oneapi/tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/lib/membw.h"
#include "bench/lib/report.h"
#include "core/base/dtype.h"
#include "core/model/ggml_quants.h"
#include "core/model/model.h"
#include "cpu/cpu_backend.h"
#include "cpu/quant_gemv.h"

using namespace specontext;

namespace {

using Clock = std::chrono::steady_clock;

// Matrix parameters one Llama-3.2-1B decode step reads: 16 layers of q, k, v, o, gate, up, down
// (dim 2048, kv 512, ffn 8192) and the 128256-row LM head.
constexpr double kLlama1BParams = 16.0 * (2 * 2048.0 * 2048 + 2 * 512.0 * 2048 + 3 * 8192.0 * 2048) + 128256.0 * 2048;

// Random codes and scale bytes; f16 scales in a sane range (as the tests build them).
std::vector<uint8_t> random_matrix(uint32_t t, int64_t n, int64_t k, uint32_t seed) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  const int64_t blocks = n * ((k + info->block - 1) / info->block);
  std::vector<uint8_t> w(static_cast<size_t>(blocks * info->bytes));
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= w.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&w[i], &v, 8);
  }
  const uint16_t d = f32_to_f16(0.01f);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* blk = w.data() + b * info->bytes;
    std::memcpy(blk + (t == 14 ? 208 : 0), &d, 2);
    if (t == 12 || t == 13) std::memcpy(blk + 2, &d, 2);
  }
  return w;
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// Best average seconds per call over `passes` passes through every copy (after one warm pass).
template <class Fn>
double time_per_call(int copies, int passes, Fn&& call) {
  for (int c = 0; c < copies; ++c) call(c);
  double best = 1e30;
  for (int p = 0; p < passes; ++p) {
    const auto t0 = Clock::now();
    for (int c = 0; c < copies; ++c) call(c);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / copies);
  }
  return best;
}

nlohmann::json row_json(const std::string& type, const std::string& path, int64_t n, int64_t k, double bytes,
                        double seconds, double read_gbs) {
  const double roofline_s = bytes / (read_gbs * 1e9);
  return {{"shape", std::to_string(n) + "x" + std::to_string(k)},
          {"rows", n},
          {"cols", k},
          {"type", type},
          {"path", path},
          {"bytes", bytes},
          {"us_per_gemv", seconds * 1e6},
          {"gb_per_s", bytes / seconds / 1e9},
          {"tok_per_s_equiv", 1.0 / (seconds / (double(n) * k) * kLlama1BParams)},
          {"roofline_us", roofline_s * 1e6},
          {"fraction_of_roofline", roofline_s / seconds}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"quantised GEMV vs f32 GEMV and the memory roofline"};
  int threads = 2;
  int64_t working_set_mib = 512;
  int passes = 5;
  std::string out = "bench_out/quant_gemv.json";
  bool plot = false;
  int64_t m = 1;
  std::vector<std::string> type_names;
  std::vector<std::string> path_names;
  app.add_option("--m", m, "activation rows per call (1 = decode's GEMV; 2..16 the small-batch path)")
      ->check(CLI::Range(int64_t{1}, int64_t{64}));
  app.add_option("--types", type_names, "only these types (default all; F32 always runs)")
      ->check(CLI::IsMember({"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"}));
  app.add_option("--paths", path_names, "only these kernel paths (default all this CPU has)")
      ->check(CLI::IsMember({"scalar", "avx2", "avx512"}));
  app.add_option("--threads", threads, "threads (oneTBB arena and CpuBackend)");
  app.add_option("--working-set-mib", working_set_mib, "bytes of matrix copies cycled per measurement");
  app.add_option("--passes", passes, "timed passes over the copies (best is reported)");
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);

  tbb::task_arena arena(threads);
  bench::ReadBandwidthResult read{};
  bench::BandwidthResult triad{};
  arena.execute([&] {
    read = bench::measure_read(size_t{1} << 30, 10);
    triad = bench::measure_triad(size_t{256} << 20, 5);
  });
  std::fprintf(stderr, "read %.1f GB/s, triad %.1f GB/s (%d threads)\n", read.read_gb_per_s, triad.triad_gb_per_s,
               threads);

  cpu::CpuBackendOptions bo;
  bo.num_threads = threads;
  auto backend = cpu::CpuBackend::create(bo);
  if (!backend.is_ok()) return bench::report_failure(backend.status());

  const std::pair<int64_t, int64_t> shapes[] = {{2048, 2048}, {8192, 2048}};
  std::vector<uint32_t> types;
  for (uint32_t t : {8u, 2u, 12u, 13u, 14u}) {
    const std::string name(ggml_type_info(t)->name);
    if (type_names.empty() || std::find(type_names.begin(), type_names.end(), name) != type_names.end()) {
      types.push_back(t);
    }
  }
  std::vector<cpu::QuantPath> paths;
  for (cpu::QuantPath p : {cpu::QuantPath::kScalar, cpu::QuantPath::kAvx2, cpu::QuantPath::kAvx512}) {
    const std::string name(cpu::quant_path_name(p));
    if (path_names.empty() || std::find(path_names.begin(), path_names.end(), name) != path_names.end()) {
      paths.push_back(p);
    }
  }
  nlohmann::json results = nlohmann::json::array();
  for (const auto& [n, k] : shapes) {
    const std::vector<float> x = [&] {
      std::vector<float> v(static_cast<size_t>(m * k));
      std::mt19937 rng(1);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (float& e : v) e = u(rng);
      return v;
    }();
    std::vector<float> y(static_cast<size_t>(m * n));
    // The current path: f32 weights (what loading dequantises to) through CpuBackend::matmul.
    {
      const int64_t bytes = n * k * 4;
      const int copies = static_cast<int>(std::max<int64_t>(2, (working_set_mib << 20) / bytes));
      std::vector<std::vector<float>> mats(static_cast<size_t>(copies), std::vector<float>(static_cast<size_t>(n * k), 0.01f));
      Status st;
      const double s = time_per_call(copies, passes, [&](int c) {
        const WeightMatrix w{DType::kF32, n, k, mats[static_cast<size_t>(c)].data()};
        st = (*backend)->matmul(x.data(), m, w, nullptr, y.data());
      });
      if (!st.is_ok()) return bench::report_failure(st);
      results.push_back(row_json("F32", "cpu_backend:" + (*backend)->matmul_path(DType::kF32), n, k, double(bytes),
                                 s, read.read_gb_per_s));
      std::fprintf(stderr, "%s\n", results.back().dump().c_str());
    }
    for (uint32_t t : types) {
      const std::string name(ggml_type_info(t)->name);
      const int64_t bytes = n * cpu::quant_row_bytes(t, k);
      const int copies = static_cast<int>(std::max<int64_t>(2, (working_set_mib << 20) / bytes));
      std::vector<std::vector<uint8_t>> mats;
      for (int c = 0; c < copies; ++c) mats.push_back(random_matrix(t, n, k, static_cast<uint32_t>(c + 1)));
      for (cpu::QuantPath path : paths) {
        if (!cpu::quant_path_available(path)) continue;
        // The scalar path is ~10x slower: fewer copies' worth of passes keeps the run short.
        const int path_passes = path == cpu::QuantPath::kScalar ? 1 : passes;
        Status st;
        const double s = arena.execute([&] {
          return time_per_call(copies, path_passes, [&](int c) {
            const cpu::QuantMatrix w{t, n, k, mats[static_cast<size_t>(c)].data()};
            st = cpu::quant_gemv(w, x.data(), m, y.data(), {path, true});
          });
        });
        if (!st.is_ok()) return bench::report_failure(st);
        results.push_back(
            row_json(name, std::string(cpu::quant_path_name(path)), n, k, double(bytes), s, read.read_gb_per_s));
        std::fprintf(stderr, "%s\n", results.back().dump().c_str());
      }
    }
  }
  // The box may be shared: the read bandwidth is measured again at the end and the better of the
  // two makes the roofline (so fractions are not flattered by a slow first measurement).
  const double read_start = read.read_gb_per_s;
  arena.execute([&] { read.read_gb_per_s = std::max(read_start, bench::measure_read(size_t{1} << 30, 10).read_gb_per_s); });
  for (auto& r : results) {
    const double roofline_s = r["bytes"].get<double>() / (read.read_gb_per_s * 1e9);
    r["roofline_us"] = roofline_s * 1e6;
    r["fraction_of_roofline"] = roofline_s / (r["us_per_gemv"].get<double>() * 1e-6);
  }
  const nlohmann::json doc = {
      {"benchmark", "quant_gemv"},
      {"machine", {{"cpu", cpu_model_name()}, {"threads", threads}}},
      {"read_gb_per_s", read.read_gb_per_s},
      {"read_gb_per_s_first", read_start},
      {"triad_gb_per_s", triad.triad_gb_per_s},
      {"m", m},
      {"working_set_mib", working_set_mib},
      {"tok_per_s_equiv_params", kLlama1BParams},
      {"best_path", std::string(cpu::quant_path_name(cpu::resolve_quant_path(cpu::QuantPath::kAuto)))},
      {"results", results}};
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_quant_gemv.py");
  return 0;
}
