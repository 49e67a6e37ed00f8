// The retrieval-head work split, checked without a GPU. plan_retrieval_scores' layout (parts,
// padded part_dims, k_stride, tokens per block) drives a host mirror of the three score kernels of
// gpu/kernels_retrieval.cu, compared with the host default of Backend::retrieval_group_scores.
// plan_select_top_tokens plus the shared radix arithmetic of gpu/topk_radix.h drive a host mirror
// of the selection kernels (histogram passes, digit choice, ordered per-warp compaction), which
// must give exactly select_from_group_scores' set, ties and -0 included. The CUDA tests
// (cuda_retrieval_test.cc) check the kernels themselves on a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/base/dtype.h"
#include "core/ports/backend.h"
#include "core/ports/selection.h"
#include "cpu/cpu_backend.h"
#include "gpu/kernels.h"
#include "gpu/retrieval_plan.h"
#include "gpu/topk_radix.h"

namespace specontext::gpu {
namespace {

using kernels::SelectState;

std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void merge_ml(float& m, float& l, float om, float ol) {
  const float mn = std::max(m, om);
  if (mn == -INFINITY) return;
  l = l * std::exp2(m - mn) + ol * std::exp2(om - mn);
  m = mn;
}

// Key element i of a staged row as the kernel widens it (k_type: f32, f16 or bf16).
float key_element(const kernels::RetrievalScoresLaunch& a, const void* block, int64_t i) {
  switch (a.k_type) {
    case kernels::KvType::kF16: return f16_to_f32(static_cast<const uint16_t*>(block)[i]);
    case kernels::KvType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(block)[i]);
    default: return static_cast<const float*>(block)[i];
  }
}

// Host mirror of retrieval_logits_kernel, retrieval_stats_kernel and retrieval_group_max_kernel:
// the same staging layout (part-major rows of k_stride floats, zero padding; keys widened to f32
// as staged), dot products from it, and per-block softmax partials.
void emulate_scores(const RetrievalScoresPlan& plan, std::vector<float>& out) {
  const kernels::RetrievalScoresLaunch& a = plan.launch;
  const int tile = a.tile, pd = a.part_dims, ks = a.k_stride, hd = static_cast<int>(a.head_dim);
  const int group = static_cast<int>(a.group), qd = a.parts * pd;
  ASSERT_EQ(tile * a.parts, kernels::kRetrievalThreads);
  ASSERT_EQ(pd % 4, 0);
  ASSERT_EQ(ks % 32, 4) << "row stride must be 4 mod 32 for conflict-free float4 reads";
  ASSERT_GE(ks, pd);
  ASSERT_GE(qd, hd);
  ASSERT_EQ(a.tokens_per_block % tile, 0);
  ASSERT_GE(a.blocks_per_head * a.tokens_per_block, a.length);
  ASSERT_LT((a.blocks_per_head - 1) * a.tokens_per_block, a.length) << "a block without tokens";
  std::vector<float> logits(plan.logits_floats, std::nanf(""));
  std::vector<float> pm(plan.partial_floats / 2, std::nanf("")), pl(plan.partial_floats / 2, std::nanf(""));
  std::vector<float> k_s(static_cast<size_t>(kernels::kRetrievalThreads * ks)),
      q_s(static_cast<size_t>(group * qd));
  const int64_t kvd = a.n_kv_heads * a.head_dim;
  for (int64_t g = 0; g < a.n_kv_heads; ++g) {
    for (int i = 0; i < group * qd; ++i) {
      const int j = i / qd, d = i % qd;
      q_s[static_cast<size_t>(i)] = d < hd ? a.q[(g * group + j) * hd + d] * a.q_scale : 0.0f;
    }
    for (int64_t b = 0; b < a.blocks_per_head; ++b) {
      const int64_t t_begin = b * a.tokens_per_block;
      const int64_t t_end = std::min(t_begin + a.tokens_per_block, a.length);
      for (int64_t t0 = t_begin; t0 < t_end; t0 += tile) {
        const int n_rows = static_cast<int>(std::min<int64_t>(tile, t_end - t0));
        std::fill(k_s.begin(), k_s.end(), std::nanf(""));  // padding words must never be read
        for (int r = 0; r < tile; ++r) {
          for (int d = 0; d < qd; ++d) {
            const int64_t t = t0 + r;
            const float v = r < n_rows && d < hd
                                ? key_element(a, a.k_blocks[t / a.block_tokens], (t % a.block_tokens) * kvd + g * hd + d)
                                : 0.0f;
            const int p = d / pd;
            k_s[static_cast<size_t>((p * tile + r) * ks + (d - p * pd))] = v;
          }
        }
        for (int j0 = 0; j0 < group; j0 += kernels::kRetrievalHeadsPerPass) {
          const int nh = std::min(kernels::kRetrievalHeadsPerPass, group - j0);
          for (int r = 0; r < n_rows; ++r) {
            for (int j = 0; j < nh; ++j) {
              float s = 0.0f;
              for (int p = 0; p < a.parts; ++p) {
                const float* k_row = k_s.data() + (p * tile + r) * ks;
                const float* qp = q_s.data() + (j0 + j) * qd + p * pd;
                float acc = 0.0f;
                for (int d = 0; d < pd; ++d) acc = std::fma(qp[d], k_row[d], acc);
                s = a.parts == 1 ? acc : s + acc;
              }
              logits[static_cast<size_t>((g * group + j0 + j) * a.length + t0 + r)] = s;
            }
          }
        }
      }
      for (int j = 0; j < group; ++j) {
        float m = -INFINITY, l = 0.0f;
        for (int64_t t = t_begin; t < t_end; ++t)
          merge_ml(m, l, logits[static_cast<size_t>((g * group + j) * a.length + t)], 1.0f);
        pm[static_cast<size_t>((g * group + j) * a.blocks_per_head + b)] = m;
        pl[static_cast<size_t>((g * group + j) * a.blocks_per_head + b)] = l;
      }
    }
  }
  std::vector<float> stats(plan.stats_floats);
  for (int64_t h = 0; h < a.n_heads; ++h) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t b = 0; b < a.blocks_per_head; ++b) {
      merge_ml(m, l, pm[static_cast<size_t>(h * a.blocks_per_head + b)],
               pl[static_cast<size_t>(h * a.blocks_per_head + b)]);
    }
    stats[static_cast<size_t>(2 * h)] = m;
    stats[static_cast<size_t>(2 * h + 1)] = 1.0f / l;
  }
  out.assign(static_cast<size_t>(a.n_kv_heads * a.length), std::nanf(""));
  for (int64_t g = 0; g < a.n_kv_heads; ++g) {
    for (int64_t t = 0; t < a.length; ++t) {
      float best = 0.0f;
      for (int64_t j = 0; j < a.group; ++j) {
        const int64_t h = g * a.group + j;
        best = std::max(best, std::exp2(logits[static_cast<size_t>(h * a.length + t)] -
                                        stats[static_cast<size_t>(2 * h)]) *
                                  stats[static_cast<size_t>(2 * h + 1)]);
      }
      out[static_cast<size_t>(g * a.length + t)] = best;
    }
  }
}

double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : INFINITY;
}

TEST(RetrievalScoresPlan, HostMirrorMatchesHostDefault) {
  std::mt19937 rng(7);
  auto ref = cpu::create_cpu_backend(cpu::CpuBackendOptions{.reference = true});
  ASSERT_TRUE(ref.is_ok());
  struct Shape {
    int64_t heads, kv, hd, length;
    int sms;
  };
  const Shape shapes[] = {{4, 4, 64, 300, 132}, {8, 2, 128, 1000, 132}, {8, 1, 256, 517, 8},
                          {2, 2, 7, 33, 1},     {12, 4, 100, 129, 132}, {16, 1, 80, 2100, 4},
                          {1, 1, 1, 1, 132},    {64, 1, 32, 70, 132},   {8, 8, 255, 64, 2}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + " kv " + std::to_string(s.kv) + " hd " +
                 std::to_string(s.hd) + " length " + std::to_string(s.length));
    const std::vector<float> q = random_floats(rng, static_cast<size_t>(s.heads * s.hd), -2.0f, 2.0f);
    const std::vector<float> k = random_floats(rng, static_cast<size_t>(s.length * s.kv * s.hd), -2.0f, 2.0f);
    std::vector<float> out_placeholder(1);
    // Paged as the engine keeps it: blocks of 37 tokens, the table pointing into k in order; the
    // keys in f32, and rounded to f16 and bf16 (the KV dtypes), which the kernel widens as it
    // stages them: the mirror must match the host default over the same stored keys.
    const int64_t bt = 37, kvd = s.kv * s.hd;
    std::vector<uint16_t> k16(k.size());
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(std::string(dtype_name(dt)));
      if (dt != DType::kF32) convert_from_f32(dt, k.data(), k16.data(), k.size());
      std::vector<const void*> table;
      for (int64_t t = 0; t < s.length; t += bt) {
        table.push_back(dt == DType::kF32 ? static_cast<const void*>(k.data() + t * kvd) : k16.data() + t * kvd);
      }
      auto plan = plan_retrieval_scores(q.data(), table.data(), dt, bt, s.length, s.heads, s.kv, s.hd,
                                        out_placeholder.data(), s.sms);
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      EXPECT_EQ(plan->launch.parts, s.hd <= 64 ? 1 : s.hd <= 128 ? 2 : 4);
      // Every block aligned to 4 elements (16 bytes of f32, 8 of f16 / bf16).
      EXPECT_EQ(plan->launch.vec4, s.hd % 4 == 0 && (bt * kvd) % 4 == 0);
      EXPECT_EQ(plan->launch.k_type, dt == DType::kF32   ? kernels::KvType::kF32
                                     : dt == DType::kF16 ? kernels::KvType::kF16
                                                         : kernels::KvType::kBF16);
      EXPECT_LE(plan->launch.smem_bytes + kernels::kRetrievalStaticSmemBytes, SharedMemoryLimits{}.per_block_optin);
      std::vector<float> got;
      emulate_scores(*plan, got);
      std::vector<float> want(static_cast<size_t>(s.kv * s.length));
      ASSERT_TRUE((*ref)
                      ->retrieval_group_scores(q.data(), table.data(), dt, bt, s.length, s.heads, s.kv, s.hd,
                                               want.data())
                      .is_ok());
      EXPECT_LT(rel_l2(got, want), 1e-5);
      for (float v : got) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

TEST(RetrievalScoresPlan, ArgumentChecks) {
  float x = 0.0f;
  const void* table[1] = {&x};
  auto code = [&](int64_t length, int64_t heads, int64_t kv, int64_t hd, const float* q = nullptr) {
    const float* qq = q == nullptr ? &x : q;
    return plan_retrieval_scores(qq, table, DType::kF32, length > 0 ? length : 1, length, heads, kv, hd, &x, 132)
        .status()
        .code();
  };
  EXPECT_EQ(code(0, 0, 0, 0), StatusCode::kOk) << "empty context: nothing to check or do";
  EXPECT_EQ(code(4, 3, 2, 8), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(4, 0, 1, 8), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(4, 2, 1, 0), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(4, 2, 1, 257), StatusCode::kUnimplemented);
  EXPECT_EQ(code(int64_t{1} << 32, 2, 1, 8), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_retrieval_scores(nullptr, table, DType::kF32, 4, 4, 2, 1, 8, &x, 132).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_retrieval_scores(&x, table, DType::kF32, 0, 4, 2, 1, 8, &x, 132).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_retrieval_scores(&x, table, DType::kQ8_0, 4, 4, 2, 1, 8, &x, 132).status().code(),
            StatusCode::kInvalidArgument)
      << "keys are f32, f16 or bf16";
  const void* null_table[1] = {nullptr};
  EXPECT_EQ(plan_retrieval_scores(&x, null_table, DType::kF32, 4, 4, 2, 1, 8, &x, 132).status().code(),
            StatusCode::kInvalidArgument);
  // 512 query heads of 256 dims per KV head cannot stage their queries in shared memory.
  const Status big = plan_retrieval_scores(&x, table, DType::kF32, 4, 4, 512, 1, 256, &x, 132).status();
  EXPECT_EQ(big.code(), StatusCode::kUnimplemented);
  EXPECT_NE(big.message().find("shared memory"), std::string::npos) << big.message();
  // Misaligned K: scalar staging.
  std::vector<float> k(64);
  const void* misaligned[1] = {k.data() + 1};
  auto plan = plan_retrieval_scores(&x, misaligned, DType::kF32, 4, 4, 1, 1, 8, &x, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan->launch.vec4);
  // f16 / bf16 keys load 4 elements (8 bytes) at a time: 8-byte alignment suffices, 2 does not.
  const auto* bytes = reinterpret_cast<const unsigned char*>(k.data());
  for (const DType dt : {DType::kF16, DType::kBF16}) {
    const void* eight[1] = {bytes + 8};
    const void* two[1] = {bytes + 2};
    auto p8 = plan_retrieval_scores(&x, eight, dt, 4, 4, 1, 1, 8, &x, 132);
    auto p2 = plan_retrieval_scores(&x, two, dt, 4, 4, 1, 1, 8, &x, 132);
    ASSERT_TRUE(p8.is_ok() && p2.is_ok());
    EXPECT_TRUE(p8->launch.vec4);
    EXPECT_FALSE(p2->launch.vec4);
  }
}

// The shared memory the score kernel needs, from its layout as kernels_retrieval.cu declares it
// (not from the plan): a [kRetrievalThreads][k_stride] K tile, the group's queries padded to
// parts x part_dims, the cross-part reduction buffer, and the static row_base pointer array.
size_t score_kernel_smem_need(int64_t group, int64_t head_dim) {
  const int64_t parts = head_dim <= 64 ? 1 : head_dim <= 128 ? 2 : 4;
  const int64_t part_dims = (head_dim + parts - 1) / parts;
  const int64_t part_dims4 = (part_dims + 3) / 4 * 4;
  const int64_t k_stride = (part_dims4 + 31) / 32 * 32 + 4;
  const int64_t floats = kernels::kRetrievalThreads * k_stride + group * parts * part_dims4 +
                         (parts > 1 ? kernels::kRetrievalHeadsPerPass * kernels::kRetrievalThreads : 0);
  return static_cast<size_t>(floats) * sizeof(float) + kernels::kRetrievalThreads * sizeof(const float*);
}

// What the CUDA runtime accepts for a launch of a plan: static + dynamic shared memory within
// the default per-block limit, or, after cudaFuncSetAttribute(MaxDynamicSharedMemorySize,
// dynamic) (which the launcher calls when smem_opt_in), within the opt-in limit.
bool launch_accepted(const RetrievalScoresPlan& plan, SharedMemoryLimits device) {
  const size_t total = plan.launch.smem_bytes + kernels::kRetrievalStaticSmemBytes;
  return total <= (plan.launch.smem_opt_in ? device.per_block_optin : device.per_block);
}

// Every GQA ratio from MHA to 320 query heads per KV head, at each head-dim class, on an sm_80
// (163 KiB opt-in) and an sm_90 (227 KiB) device: the plan either launches under the device's
// limits counting the static array, or refuses with kUnimplemented exactly when the need exceeds
// the opt-in limit. Before the static array was counted, 128-dim heads with 19-20 query heads per
// KV head (256: 10; 64: 53-56) planned no opt-in for a launch of more than 48 KiB.
TEST(RetrievalScoresPlan, LaunchFitsTheDeviceSharedMemoryAtEveryGqaRatio) {
  float x = 0.0f;
  std::vector<float> k(64);
  const void* table[1] = {k.data()};
  const SharedMemoryLimits devices[] = {{48 * 1024, 163 * 1024}, {48 * 1024, 227 * 1024}};
  int opt_ins = 0, refusals = 0;
  for (const SharedMemoryLimits& device : devices) {
    for (int64_t hd : {16, 64, 100, 128, 200, 256}) {
      for (int64_t group = 1; group <= 320; ++group) {
        SCOPED_TRACE("head_dim " + std::to_string(hd) + ", " + std::to_string(group) + " query heads per KV head, opt-in " +
                     std::to_string(device.per_block_optin));
        const size_t need = score_kernel_smem_need(group, hd);
        auto plan = plan_retrieval_scores(&x, table, DType::kF32, 4, 4, group * 2, 2, hd, &x, 132, device);
        if (need > device.per_block_optin) {
          ASSERT_EQ(plan.status().code(), StatusCode::kUnimplemented) << need << " bytes";
          EXPECT_NE(plan.status().message().find("shared memory"), std::string::npos);
          ++refusals;
          continue;
        }
        ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
        EXPECT_EQ(plan->launch.smem_bytes + kernels::kRetrievalStaticSmemBytes, need);
        EXPECT_TRUE(launch_accepted(*plan, device)) << need << " bytes";
        EXPECT_EQ(plan->launch.smem_opt_in, need > device.per_block) << need << " bytes";
        opt_ins += plan->launch.smem_opt_in;
      }
    }
  }
  EXPECT_GT(opt_ins, 0);
  EXPECT_GT(refusals, 0);
  // The ratios the issue named: dynamic shared memory at most 48 KiB, the total above it.
  for (auto [hd, group] : {std::pair<int64_t, int64_t>{128, 19}, {128, 20}, {256, 10}, {64, 53}, {64, 56}}) {
    auto plan = plan_retrieval_scores(&x, table, DType::kF32, 4, 4, group, 1, hd, &x, 132, devices[0]);
    ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
    EXPECT_LE(plan->launch.smem_bytes, size_t{48 * 1024}) << hd << " x " << group;
    EXPECT_TRUE(plan->launch.smem_opt_in) << hd << " x " << group;
  }
}

// ---- selection ----

// The digit choice as one thread would make it (the choose kernel does this with a block scan).
SelectState choose_reference(const std::vector<uint32_t>& hist, int p, const SelectState& st) {
  int64_t above = 0;
  for (int d = (1 << kernels::select_pass_bits(p)) - 1; d >= 0; --d) {
    const int64_t c = hist[static_cast<size_t>(d)];
    if (above < st.remaining && st.remaining <= above + c) {
      return kernels::select_advance(st, p, static_cast<uint32_t>(d), above, c);
    }
    above += c;
  }
  ADD_FAILURE() << "no digit holds the remaining key";
  return st;
}

// Host mirror of launch_select_top for one plan: states, passes, counts per warp span, write.
std::vector<int32_t> emulate_select(const SelectTopPlan& plan, const std::vector<float>& scores,
                                    int* passes_run) {
  const kernels::SelectTopLaunch& a = plan.launch;
  std::vector<int32_t> out(static_cast<size_t>(a.n_segments * a.budget), -1);
  std::vector<SelectState> state = plan.initial_state;
  *passes_run = 0;
  const int64_t warps = a.blocks_per_segment * kernels::kSelectWarps;
  EXPECT_EQ(a.warp_span % 128, 0);
  EXPECT_GE(warps * a.warp_span, a.m) << "warp spans must cover the middle";
  for (int64_t seg = 0; seg < a.n_segments; ++seg) {
    const float* s = scores.data() + seg * a.length + a.lo;
    auto key = [&](int64_t i) { return kernels::select_key(s[i], static_cast<uint32_t>(a.lo + i)); };
    int32_t* dst = out.data() + seg * a.budget;
    for (int64_t t = 0; t < a.sinks; ++t) dst[t] = static_cast<int32_t>(t);
    for (int64_t t = 0; t < a.length - a.window_begin; ++t)
      dst[a.sinks + a.take + t] = static_cast<int32_t>(a.window_begin + t);
    if (a.take == 0) continue;
    SelectState& st = state[static_cast<size_t>(seg)];
    for (int p = 0; p < kernels::kSelectPasses && st.done == 0; ++p) {
      std::vector<uint32_t> hist(kernels::kSelectMaxBins, 0);
      for (int64_t i = 0; i < a.m; ++i) {
        if (kernels::select_matches(key(i), st)) ++hist[kernels::select_digit(key(i), p)];
      }
      st = choose_reference(hist, p, st);
      ++*passes_run;
    }
    EXPECT_EQ(st.done, 1) << "six passes always finish (keys are distinct)";
    int64_t at = a.sinks;
    for (int64_t w = 0; w < warps; ++w) {  // warps in order: each continues where the previous stopped
      const int64_t begin = std::min(w * a.warp_span, a.m), end = std::min(begin + a.warp_span, a.m);
      for (int64_t i = begin; i < end; ++i) {
        if (kernels::select_chosen(key(i), st)) dst[at++] = static_cast<int32_t>(a.lo + i);
      }
    }
    EXPECT_EQ(at, a.sinks + a.take) << "segment " << seg;
  }
  return out;
}

void expect_same_selection(const Selection& want, const Selection& got, const std::string& what) {
  ASSERT_EQ(want.kv_heads, got.kv_heads) << what;
  ASSERT_EQ(want.budget, got.budget) << what;
  ASSERT_EQ(want.counts, got.counts) << what;
  for (int64_t h = 0; h < want.kv_heads; ++h) {
    const auto w = want.head(h);
    const auto g = got.head(h);
    ASSERT_TRUE(std::equal(w.begin(), w.end(), g.begin(), g.end())) << what << " head " << h;
  }
}

// Scores with deliberate structure: quantised (many exact ties), -0 and +0, or plain random.
std::vector<float> selection_scores(std::mt19937& rng, int64_t n, int kind) {
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_int_distribution<int> level(0, 7);
  std::uniform_real_distribution<float> real(0.0f, 1.0f);
  for (float& x : v) {
    switch (kind) {
      case 0:
        x = real(rng);
        break;
      case 1:
        x = static_cast<float>(level(rng)) / 8.0f;
        break;  // heavy ties
      case 2:
        x = level(rng) < 4 ? (level(rng) < 4 ? -0.0f : 0.0f) : real(rng) * 1e-30f;
        break;
      default:
        x = real(rng) < 0.5f ? -real(rng) : 1e-7f * real(rng);
        break;  // negatives, tiny values
    }
  }
  return v;
}

TEST(SelectTopPlan, HostMirrorEqualsHostSelection) {
  std::mt19937 rng(11);
  int cases = 0;
  for (int64_t length : {1, 2, 5, 64, 300, 4097, 20000}) {
    for (int64_t budget : {1, 3, 16, 64, 1000, 30000}) {
      for (int64_t sinks : {0, 1, 4}) {
        for (int64_t window : {0, 1, 4}) {
          const int64_t kv = 1 + (cases % 3);
          const int kind = cases % 4;
          ++cases;
          const std::string what = "length " + std::to_string(length) + " budget " + std::to_string(budget) +
                                   " sinks " + std::to_string(sinks) + " window " + std::to_string(window) +
                                   " kind " + std::to_string(kind);
          const SelectionOptions o{budget, sinks, window};
          const std::vector<float> scores = selection_scores(rng, kv * length, kind);
          Selection want;
          select_from_group_scores(scores, kv, length, o, want);
          auto plan = plan_select_top_tokens(kv, length, o, 132);
          ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
          ASSERT_EQ(plan->host_only, length <= budget) << what;
          Selection got;
          prepare_selection(*plan, kv, length, got);
          if (!plan->host_only) {
            int passes = 0;
            const std::vector<int32_t> idx = emulate_select(*plan, scores, &passes);
            std::copy(idx.begin(), idx.end(), got.indices.begin());
          }
          expect_same_selection(want, got, what);
        }
      }
    }
  }
}

TEST(SelectTopPlan, TiesPreferOlderTokensAndStopEarly) {
  // All scores equal: the oldest middle tokens win, after all six passes (every pass ties).
  const int64_t length = 1000;
  std::vector<float> same(static_cast<size_t>(length), 0.25f);
  auto plan = plan_select_top_tokens(1, length, SelectionOptions{10, 1, 2}, 132);
  ASSERT_TRUE(plan.is_ok());
  int passes = 0;
  std::vector<int32_t> idx = emulate_select(*plan, same, &passes);
  EXPECT_EQ(passes, 6);
  EXPECT_EQ(idx, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 998, 999}));
  // Distinct high words: the first pass already isolates the top; later passes are skipped.
  std::vector<float> ramp(static_cast<size_t>(length));
  for (int64_t t = 0; t < length; ++t)
    ramp[static_cast<size_t>(t)] = std::ldexp(1.0f, static_cast<int>(t % 100) - 50);
  ramp[500] = 1e30f;  // the only value in its top-11-bit bin
  plan = plan_select_top_tokens(1, length, SelectionOptions{2, 0, 0}, 132);
  ASSERT_TRUE(plan.is_ok());
  ramp[700] = 1e20f;
  idx = emulate_select(*plan, ramp, &passes);
  EXPECT_LE(passes, 2);
  EXPECT_EQ(idx, (std::vector<int32_t>{500, 700}));
}

TEST(SelectTopPlan, KeyOrder) {
  using kernels::select_key;
  EXPECT_GT(select_key(1.0f, 5), select_key(0.5f, 0));
  EXPECT_GT(select_key(0.5f, 3), select_key(0.5f, 4)) << "equal score: the older token ranks higher";
  EXPECT_EQ(select_key(-0.0f, 9), select_key(0.0f, 9)) << "-0 and +0 are the same score";
  EXPECT_GT(select_key(0.0f, 9), select_key(-1e-30f, 0));
  EXPECT_GT(select_key(-1.0f, 0), select_key(-2.0f, 0));
  EXPECT_GT(select_key(INFINITY, 0), select_key(3e38f, 0));
  EXPECT_GT(select_key(-3e38f, 0), select_key(-INFINITY, 0));
}

TEST(SelectTopPlan, ShapesAndArgumentChecks) {
  auto plan = plan_select_top_tokens(8, 1 << 20, SelectionOptions{2048, 1, 4}, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan->host_only);
  EXPECT_EQ(plan->launch.take, 2048 - 5);
  EXPECT_EQ(plan->launch.m, (1 << 20) - 5);
  EXPECT_EQ(plan->launch.window_begin, (1 << 20) - 4);
  EXPECT_GT(plan->launch.blocks_per_segment, 1) << "a 1M-token head is split over several blocks";
  EXPECT_EQ(plan->initial_state.size(), 8u);
  EXPECT_EQ(plan->count, 2048);
  // Sinks and window larger than the budget shrink to it, sinks first: no middle at all.
  plan = plan_select_top_tokens(2, 100, SelectionOptions{6, 4, 8}, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->launch.sinks, 4);
  EXPECT_EQ(plan->launch.window_begin, 98);
  EXPECT_EQ(plan->launch.take, 0);
  EXPECT_TRUE(plan->initial_state.empty());
  // budget <= 0 behaves as 1 (as the host).
  plan = plan_select_top_tokens(1, 10, SelectionOptions{0, 0, 0}, 132);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->budget, 1);

  auto expect_field = [](const Result<SelectTopPlan>& r, const std::string& field) {
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  };
  expect_field(plan_select_top_tokens(1, 10, SelectionOptions{4, -1, 0}, 132), "options.sinks");
  expect_field(plan_select_top_tokens(1, 10, SelectionOptions{4, 0, -2}, 132), "options.window");
  expect_field(plan_select_top_tokens(-1, 10, SelectionOptions{}, 132), "n_kv_heads");
  expect_field(plan_select_top_tokens(1, -1, SelectionOptions{}, 132), "length");
  expect_field(plan_select_top_tokens(1, int64_t{1} << 31, SelectionOptions{}, 132), "length");
}

}  // namespace
}  // namespace specontext::gpu
