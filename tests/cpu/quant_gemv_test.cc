// quant_gemv (cpu/quant_gemv.h): every SIMD path against the scalar reference, the reference
// against dequantise-then-f32 (core/model/ggml_quants), the non-finite policy, guard regions,
// odd row counts, padded rows, block and batch remainders of the SIMD tiles, the AVX-512 path's
// activation row groups (m = 1..17), the row split over oneTBB and argument errors.
//
// Tolerances (per output element, against B = Σ_j |x_j|·|w_j| with w the dequantised weights):
// - SIMD vs reference: both form the same exact integer block sums; only the float scale
//   products and the order blocks are added in differ (the reference sums in double, the SIMD
//   paths in float lanes): at most nb·2^-24·B ≈ 128·6e-8 = 7.6e-6·B for k = 4096; 1e-5·B.
// - reference vs f32 on the dequantised matrix: the only difference is activation
//   quantisation. Q8_0 activations: |x − q·fp16(d)| ≤ d/2 + 127·|d − fp16(d)| ≤ (0.5 + 127·2^-11)·d
//   = 0.562·d with d = amax/127 of the 32-block; Q8_K: ≤ d/2 with d = amax/127 of the 256-block
//   (f32 scale). So |Δy| ≤ Σ_j |w_j|·0.57·amax(block of j)/127, plus the float term above.
//   Random inputs land far inside it: rel-L2 over the outputs < 1e-2 is also checked.
#include "cpu/quant_gemv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/model/ggml_quants.h"
#include "tests/cpu/cpu_test_util.h"

namespace specontext::cpu {
namespace {

using testing::GuardedBuffer;
using testing::random_floats;

constexpr uint32_t kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr uint32_t kTypes[] = {kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K};
constexpr QuantPath kSimdPaths[] = {QuantPath::kAvx2, QuantPath::kAvx512};

std::string type_name(uint32_t t) { return std::string(ggml_type_info(t)->name); }

void put_f16(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

// n rows of k elements of type t: random codes and scale bytes, f16 scales drawn from a sane
// range (the K types' d and dmin, Q6_K's d at byte 208).
std::vector<uint8_t> random_matrix(uint32_t t, int64_t n, int64_t k, uint32_t seed) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  const int64_t nb = (k + info->block - 1) / info->block;
  std::vector<uint8_t> w(static_cast<size_t>(n * nb * info->bytes));
  std::mt19937 rng(seed);
  for (auto& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(0.002f, 0.02f);
  for (int64_t i = 0; i < n * nb; ++i) {
    uint8_t* blk = w.data() + i * info->bytes;
    if (t == kQ6_K) {
      put_f16(blk + 208, scale(rng));
    } else {
      put_f16(blk, (rng() & 1) ? scale(rng) : -scale(rng));
      if (t == kQ4_K || t == kQ5_K) put_f16(blk + 2, scale(rng));
    }
  }
  return w;
}

// Row-major f32 [n][k] of the matrix (rows decoded whole, then cut to k).
std::vector<float> dequantise(uint32_t t, const std::vector<uint8_t>& w, int64_t n, int64_t k) {
  const GgmlTypeInfo* info = ggml_type_info(t);
  const int64_t nb = (k + info->block - 1) / info->block;
  std::vector<float> row(static_cast<size_t>(nb * info->block)), out(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_TRUE(ggml_dequantize(t, w.data() + r * nb * info->bytes, row.data(), nb * info->block).is_ok());
    std::memcpy(out.data() + r * k, row.data(), static_cast<size_t>(k) * 4);
  }
  return out;
}

struct Problem {
  uint32_t type;
  int64_t n, k, m;
  std::vector<uint8_t> w;
  std::vector<float> x;  // [m][k]
  QuantMatrix matrix() const { return {type, n, k, w.data()}; }
};

Problem make_problem(uint32_t t, int64_t n, int64_t k, int64_t m, uint32_t seed) {
  Problem p{t, n, k, m, random_matrix(t, n, k, seed), random_floats(static_cast<size_t>(m * k), seed + 1)};
  return p;
}

// y [m][n] of `path` in a guarded buffer; the guards are checked here.
std::vector<float> run(const Problem& p, QuantPath path, bool parallel = true) {
  GuardedBuffer y(static_cast<size_t>(p.m * p.n), std::numeric_limits<float>::quiet_NaN());
  const Status s = quant_gemv(p.matrix(), p.x.data(), p.m, y.data(), {path, parallel});
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(y.intact()) << quant_path_name(path) << " wrote outside y";
  return std::vector<float>(y.data(), y.data() + y.size());
}

// B[i][r] = Σ_j |x[i][j]|·|w[r][j]|.
std::vector<double> abs_bound(const Problem& p, const std::vector<float>& wf) {
  std::vector<double> b(static_cast<size_t>(p.m * p.n));
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t r = 0; r < p.n; ++r) {
      double s = 0;
      for (int64_t j = 0; j < p.k; ++j) s += std::fabs(double(p.x[i * p.k + j]) * wf[r * p.k + j]);
      b[i * p.n + r] = s;
    }
  }
  return b;
}

bool skip_unavailable(QuantPath path) { return !quant_path_available(path); }

struct Shape {
  int64_t m, k;
};
constexpr Shape kShapes[] = {{1, 256}, {1, 512}, {1, 4096}, {3, 256}, {3, 512},
                             {3, 4096}, {16, 256}, {16, 512}, {16, 4096}};
constexpr int64_t kOddRows = 67;  // not a multiple of any vector width or the tile of 4

TEST(QuantGemv, EverySimdPathMatchesTheScalarReference) {
  for (QuantPath path : kSimdPaths) {
    if (skip_unavailable(path)) {
      ADD_FAILURE() << "this machine lacks " << quant_path_name(path) << "; the test needs it to check the path";
      continue;
    }
    for (uint32_t t : kTypes) {
      for (const Shape& s : kShapes) {
        SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)) + " m=" + std::to_string(s.m) +
                     " k=" + std::to_string(s.k));
        const Problem p = make_problem(t, kOddRows, s.k, s.m, static_cast<uint32_t>(t * 1000 + s.k + s.m));
        const std::vector<float> ref = run(p, QuantPath::kScalar);
        const std::vector<float> got = run(p, path);
        const std::vector<double> bound = abs_bound(p, dequantise(t, p.w, p.n, p.k));
        int64_t nonzero = 0, bad = 0;
        for (size_t e = 0; e < got.size(); ++e) {
          ASSERT_TRUE(std::isfinite(got[e]) && std::isfinite(ref[e])) << "element " << e;
          nonzero += got[e] != 0.0f;
          if (std::fabs(double(got[e]) - ref[e]) > 1e-5 * bound[e]) {
            if (++bad <= 3) ADD_FAILURE() << "element " << e << ": " << got[e] << " vs " << ref[e];
          }
        }
        EXPECT_EQ(bad, 0);
        EXPECT_GT(nonzero, static_cast<int64_t>(got.size()) * 9 / 10) << "output mostly zero";
      }
    }
  }
}

// The AVX-512 path takes Q8_0/Q4_0 four blocks a step (then the last nb % 4 one at a time) and
// activation rows two at a time (then the odd one): row counts, block counts and m that leave
// every remainder.
TEST(QuantGemv, BlockAndActivationRemaindersMatchTheScalarReference) {
  for (QuantPath path : kSimdPaths) {
    if (skip_unavailable(path)) continue;
    for (uint32_t t : kTypes) {
      const int64_t block = ggml_type_info(t)->block;
      for (int64_t blocks : {1, 2, 3, 5, 6, 7}) {
        for (int64_t m : {1, 2, 5}) {
          const int64_t k = blocks * block - (blocks > 1 ? 3 : 0);  // a partial last block too
          SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)) + " blocks=" + std::to_string(blocks) +
                       " m=" + std::to_string(m));
          const Problem p = make_problem(t, 13, k, m, static_cast<uint32_t>(t * 31 + blocks * 7 + m));
          const std::vector<float> ref = run(p, QuantPath::kScalar);
          const std::vector<float> got = run(p, path);
          const std::vector<double> bound = abs_bound(p, dequantise(t, p.w, p.n, p.k));
          int64_t bad = 0;
          for (size_t e = 0; e < got.size(); ++e) {
            if (!(std::fabs(double(got[e]) - ref[e]) <= 1e-5 * bound[e])) {
              if (++bad <= 3) ADD_FAILURE() << "element " << e << ": " << got[e] << " vs " << ref[e];
            }
          }
          EXPECT_EQ(bad, 0);
        }
      }
    }
  }
}

// Each (weight row, activation row) pair is computed by the same instructions whatever tile it
// falls in: an activation row's outputs are bit-identical alone (m = 1) and inside a batch.
TEST(QuantGemv, AnActivationRowsOutputsDoNotDependOnTheBatch) {
  for (QuantPath path : {QuantPath::kScalar, QuantPath::kAvx2, QuantPath::kAvx512}) {
    if (skip_unavailable(path)) continue;
    for (uint32_t t : kTypes) {
      SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)));
      const Problem batch = make_problem(t, kOddRows, 512, 5, 90 + t);
      const std::vector<float> all = run(batch, path);
      for (int64_t i : {0, 3, 4}) {  // in a pair's first and second place, and the odd last row
        Problem one = batch;
        one.m = 1;
        one.x.assign(batch.x.begin() + i * batch.k, batch.x.begin() + (i + 1) * batch.k);
        const std::vector<float> alone = run(one, path);
        EXPECT_EQ(alone, std::vector<float>(all.begin() + i * batch.n, all.begin() + (i + 1) * batch.n))
            << "activation row " << i;
      }
    }
  }
}

// The AVX-512 path takes activation rows in groups whose arranged blocks fit in L1 (k = 2141:
// 4 rows of Q8_0/Q4_0, 8 of the K types; k = 4096: 2 and 4) and weight rows in blocks of
// 128 KiB (131 rows: two blocks, the second partial, for every type at k = 2141): every m from
// 1 to 17 leaves a different last group (partial, odd), and each row's outputs are still those
// of the row alone, bit for bit.
TEST(QuantGemv, ActivationRowGroupsMatchTheScalarReferenceAndTheRowAlone) {
  for (QuantPath path : kSimdPaths) {
    if (skip_unavailable(path)) continue;
    for (uint32_t t : kTypes) {
      for (int64_t k : {2141, 4096}) {
        const Problem all = make_problem(t, 131, k, 17, static_cast<uint32_t>(t * 57 + k));
        const std::vector<double> bound = abs_bound(all, dequantise(t, all.w, all.n, all.k));
        std::vector<std::vector<float>> alone;  // each activation row's outputs with m = 1
        for (int64_t i = 0; i < all.m; ++i) {
          Problem one = all;
          one.m = 1;
          one.x.assign(all.x.begin() + i * k, all.x.begin() + (i + 1) * k);
          alone.push_back(run(one, path));
        }
        for (int64_t m = 1; m <= all.m; ++m) {
          SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)) + " k=" + std::to_string(k) +
                       " m=" + std::to_string(m));
          Problem p = all;
          p.m = m;
          p.x.resize(static_cast<size_t>(m * k));
          const std::vector<float> ref = run(p, QuantPath::kScalar);
          const std::vector<float> got = run(p, path);
          int64_t bad = 0;
          for (size_t e = 0; e < got.size(); ++e) {
            if (!(std::fabs(double(got[e]) - ref[e]) <= 1e-5 * bound[e])) {
              if (++bad <= 3) ADD_FAILURE() << "element " << e << ": " << got[e] << " vs " << ref[e];
            }
          }
          EXPECT_EQ(bad, 0);
          for (int64_t i = 0; i < m; ++i) {
            EXPECT_EQ(alone[static_cast<size_t>(i)], std::vector<float>(got.begin() + i * p.n, got.begin() + (i + 1) * p.n))
                << "activation row " << i;
          }
        }
      }
    }
  }
}

TEST(QuantGemv, ReferenceMatchesDequantisedF32WithinActivationQuantisation) {
  for (uint32_t t : kTypes) {
    const bool k_type = ggml_type_info(t)->block == 256;
    const int64_t act_block = k_type ? 256 : 32;
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(type_name(t) + " m=" + std::to_string(s.m) + " k=" + std::to_string(s.k));
      const Problem p = make_problem(t, kOddRows, s.k, s.m, static_cast<uint32_t>(t * 77 + s.k + s.m));
      const std::vector<float> wf = dequantise(t, p.w, p.n, p.k);
      const std::vector<float> ref = run(p, QuantPath::kScalar);
      const std::vector<double> bound = abs_bound(p, wf);
      std::vector<float> f32(ref.size());
      int64_t bad = 0;
      for (int64_t i = 0; i < p.m; ++i) {
        const float* x = p.x.data() + i * p.k;
        for (int64_t r = 0; r < p.n; ++r) {
          double dot = 0, qbound = 0;
          for (int64_t b0 = 0; b0 < p.k; b0 += act_block) {
            double amax = 0, wabs = 0;
            for (int64_t j = b0; j < b0 + act_block; ++j) {
              amax = std::max(amax, double(std::fabs(x[j])));
              wabs += std::fabs(wf[r * p.k + j]);
              dot += double(x[j]) * wf[r * p.k + j];
            }
            qbound += 0.57 * amax / 127.0 * wabs;
          }
          f32[i * p.n + r] = static_cast<float>(dot);
          const size_t e = static_cast<size_t>(i * p.n + r);
          if (std::fabs(double(ref[e]) - dot) > qbound + 1e-5 * bound[e]) {
            if (++bad <= 3) ADD_FAILURE() << "row " << i << " out " << r << ": " << ref[e] << " vs " << dot;
          }
        }
      }
      EXPECT_EQ(bad, 0);
      testing::expect_close(ref.data(), f32.data(), ref.size(), 1e-2, "reference vs dequantised f32");
    }
  }
}

TEST(QuantGemv, NonFiniteActivationsMakeTheirOutputRowNaN) {
  for (QuantPath path : {QuantPath::kScalar, QuantPath::kAvx2, QuantPath::kAvx512}) {
    if (skip_unavailable(path)) continue;
    for (uint32_t t : kTypes) {
      SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)));
      Problem p = make_problem(t, kOddRows, 512, 3, 5 + t);
      const std::vector<float> clean = run(p, path);
      p.x[1 * p.k + 300] = std::numeric_limits<float>::quiet_NaN();
      p.x[2 * p.k + 7] = std::numeric_limits<float>::infinity();
      const std::vector<float> y = run(p, path);
      for (int64_t r = 0; r < p.n; ++r) {
        EXPECT_EQ(y[r], clean[r]) << "a clean row changed";
        EXPECT_TRUE(std::isnan(y[1 * p.n + r])) << "NaN row, output " << r;
        EXPECT_TRUE(std::isnan(y[2 * p.n + r])) << "inf row, output " << r;
      }
    }
  }
}

TEST(QuantGemv, NonFiniteWeightScalesReachOnlyTheirOutputs) {
  for (QuantPath path : {QuantPath::kScalar, QuantPath::kAvx2, QuantPath::kAvx512}) {
    if (skip_unavailable(path)) continue;
    for (uint32_t t : kTypes) {
      SCOPED_TRACE(type_name(t) + " " + std::string(quant_path_name(path)));
      Problem p = make_problem(t, kOddRows, 512, 2, 9 + t);
      const int64_t row_bytes = quant_row_bytes(t, p.k);
      const int64_t d_at = t == kQ6_K ? 208 : 0;
      const uint16_t nan16 = 0x7e00;
      std::memcpy(p.w.data() + 5 * row_bytes + d_at, &nan16, 2);  // row 5, block 0
      const std::vector<float> y = run(p, path);
      for (int64_t i = 0; i < p.m; ++i) {
        for (int64_t r = 0; r < p.n; ++r) {
          EXPECT_EQ(std::isfinite(y[i * p.n + r]), r != 5) << "row " << i << " output " << r;
        }
      }
    }
  }
}

TEST(QuantGemv, PaddedRowsReadOnlyTheFirstColsActivations) {
  // k = 280: Q8_0/Q4_0 rows of 9 blocks (288; an odd count, so the AVX-512 path's pairs of blocks
  // end with a single one), K types of 2 super-blocks (512); activations past k count as zero,
  // so the padding codes must not matter.
  for (uint32_t t : kTypes) {
    SCOPED_TRACE(type_name(t));
    const int64_t k = 280, n = 33, m = 2;
    const Problem p = make_problem(t, n, k, m, 40 + t);
    const std::vector<float> ref = run(p, QuantPath::kScalar);
    const int64_t block = ggml_type_info(t)->block, kp = (k + block - 1) / block * block;
    Problem padded = p;  // the same matrix seen as kp columns, x zero-extended
    padded.k = kp;
    padded.x.assign(static_cast<size_t>(m * kp), 0.0f);
    for (int64_t i = 0; i < m; ++i) std::memcpy(padded.x.data() + i * kp, p.x.data() + i * k, k * 4);
    EXPECT_EQ(run(padded, QuantPath::kScalar), ref);
    for (QuantPath path : kSimdPaths) {
      if (skip_unavailable(path)) continue;
      const std::vector<float> got = run(p, path);
      testing::expect_close(got.data(), ref.data(), ref.size(), 1e-5, "padded rows");
    }
  }
}

TEST(QuantGemv, RowSplitOverThreadsIsBitIdenticalToOneThread) {
  for (uint32_t t : kTypes) {
    for (int64_t m : {1, 3}) {
      SCOPED_TRACE(type_name(t) + " m=" + std::to_string(m));
      const Problem p = make_problem(t, 1031, 4096, m, 70 + t);  // > 256 KiB: split
      const QuantPath path = resolve_quant_path(QuantPath::kAuto);
      EXPECT_EQ(run(p, path, true), run(p, path, false));
    }
  }
}

TEST(QuantGemv, AutoPicksTheBestPathThisCpuHas) {
  const QuantPath best = resolve_quant_path(QuantPath::kAuto);
  EXPECT_TRUE(quant_path_available(best));
  if (quant_path_available(QuantPath::kAvx512)) EXPECT_EQ(best, QuantPath::kAvx512);
  else if (quant_path_available(QuantPath::kAvx2)) EXPECT_EQ(best, QuantPath::kAvx2);
  else EXPECT_EQ(best, QuantPath::kScalar);
}

TEST(QuantGemv, BadArgumentsAreRefused) {
  const Problem p = make_problem(kQ8_0, 4, 64, 1, 1);
  float y[4];
  EXPECT_EQ(quant_gemv({3, 4, 64, p.w.data()}, p.x.data(), 1, y).code(), StatusCode::kUnimplemented);  // Q4_1
  EXPECT_EQ(quant_gemv(p.matrix(), p.x.data(), 0, y).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(quant_gemv(p.matrix(), nullptr, 1, y).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(quant_gemv({kQ8_0, 4, 0, p.w.data()}, p.x.data(), 1, y).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(quant_gemv_supports(3));
  EXPECT_EQ(quant_row_bytes(kQ4_K, 300), 2 * 144);
}

}  // namespace
}  // namespace specontext::cpu
