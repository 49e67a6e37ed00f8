// The whole engine on the CUDA backend against the engine on the CPU backend: the bundled models
// (stories260K, babyllama105, each with its distilled retrieval head) decode greedily, dense and
// SpeContext (budget 32), two sequences of different lengths batched together; and a synthetic
// toy model (f32 and bf16 weights; f32, f16 and bf16 KV) decodes a few steps after fill_synthetic.
// Each engine feeds back its own argmax, so the test checks what a user sees:
//   * logits of every step, while the two token sequences agree, within rel L2 1e-4 (f32 models)
//     of the CPU engine's, finite, the reference non-zero;
//   * the greedy tokens equal for at least the first 64 generated tokens of every sequence (a
//     divergence reports the CPU's top-2 gap at that step, so a near-tie is told from a bug);
//   * for SpeContext, the selection each step makes (layer 0; one selection serves all layers)
//     identical on both backends and the sparse counters equal. A failure lists, per KV head, the
//     tokens only one backend chose: one swapped pair at the budget's boundary means two scores
//     tied within rounding (the kernels sum in another order), anything larger a bug.
// Without a device every case skips ("no CUDA device").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_backend.h"
#include "tests/tests_common.h"

namespace specontext::gpu {
namespace {

// The device check runs these binaries from a copy of the repository at another path than the
// build's: SPECONTEXT_SOURCE_DIR in the environment wins over the compiled-in source dir.
std::string source_path(const std::string& relative) {
  if (const char* dir = std::getenv("SPECONTEXT_SOURCE_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) + "/" + relative;
  }
  return specontext::testing::repo_path(relative);
}

struct Rel {
  double rel = 0.0;
  bool finite = true;
  double ref_norm = 0.0;
};

Rel rel_l2(std::span<const float> got, std::span<const float> want) {
  Rel r;
  double num = 0.0;
  double den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) r.finite = false;
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  r.ref_norm = std::sqrt(den);
  r.rel = den > 0.0 ? std::sqrt(num / den) : INFINITY;
  return r;
}

TokenId argmax(std::span<const float> row) {
  return static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Largest minus second largest logit.
double top2_gap(std::span<const float> row) {
  float a = -INFINITY, b = -INFINITY;
  for (float x : row) {
    if (x > a) {
      b = a;
      a = x;
    } else if (x > b) {
      b = x;
    }
  }
  return static_cast<double>(a) - b;
}

// Layer 0's selection of every sparse decode item, keyed by its row (decode steps have one row
// per request, so the row is the request index). SpeContext makes one selection per step before
// layer 0 and every layer uses it.
class SelectionRecorder final : public ForwardObserver {
 public:
  void on_sparse_selection(LayerId layer, std::span<const AttentionItem> items,
                           std::span<const Selection* const> selections) override {
    if (layer != LayerId(0)) return;
    for (size_t i = 0; i < items.size() && i < selections.size(); ++i) {
      const Selection& s = *selections[i];
      std::vector<int32_t> flat;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const auto head = s.head(h);
        flat.push_back(static_cast<int32_t>(head.size()));
        flat.insert(flat.end(), head.begin(), head.end());
      }
      last[items[i].token_offset] = std::move(flat);
    }
  }
  std::map<int64_t, std::vector<int32_t>> last;  // cleared by the caller before each forward
};

// Per KV head, the tokens only one side selected ("h2: cpu-only {17} cuda-only {23}"). A single
// swap at the budget's boundary is the signature of a near-tie of two scores (the kernels' sums
// run in another order), a wholesale difference that of a bug.
std::string selection_diff(const std::vector<int32_t>& cpu, const std::vector<int32_t>& cuda) {
  auto heads = [](const std::vector<int32_t>& flat) {
    std::vector<std::vector<int32_t>> h;
    for (size_t i = 0; i < flat.size();) {
      const size_t n = static_cast<size_t>(flat[i]);
      h.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(i + 1),
                     flat.begin() + static_cast<std::ptrdiff_t>(std::min(flat.size(), i + 1 + n)));
      i += 1 + n;
    }
    return h;
  };
  const auto a = heads(cpu), b = heads(cuda);
  std::ostringstream os;
  for (size_t h = 0; h < std::max(a.size(), b.size()); ++h) {
    std::vector<int32_t> x = h < a.size() ? a[h] : std::vector<int32_t>{};
    std::vector<int32_t> y = h < b.size() ? b[h] : std::vector<int32_t>{};
    std::sort(x.begin(), x.end());
    std::sort(y.begin(), y.end());
    std::vector<int32_t> only_x, only_y;
    std::set_difference(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(only_x));
    std::set_difference(y.begin(), y.end(), x.begin(), x.end(), std::back_inserter(only_y));
    if (only_x.empty() && only_y.empty()) continue;
    os << " h" << h << ": cpu-only {";
    for (size_t i = 0; i < only_x.size() && i < 8; ++i) os << (i ? "," : "") << only_x[i];
    os << (only_x.size() > 8 ? ",..." : "") << "} cuda-only {";
    for (size_t i = 0; i < only_y.size() && i < 8; ++i) os << (i ? "," : "") << only_y[i];
    os << (only_y.size() > 8 ? ",..." : "") << "}";
  }
  return os.str();
}

std::shared_ptr<Backend> make_cpu_backend() {
  auto b = cpu::create_cpu_backend(cpu::CpuBackendOptions{});
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return b.is_ok() ? std::shared_ptr<Backend>(std::move(*b)) : nullptr;
}

std::shared_ptr<Backend> make_cuda_backend() {
  auto b = CudaBackend::create(0);
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return b.is_ok() ? std::shared_ptr<Backend>(std::move(*b)) : nullptr;
}

struct EnginePair {
  std::unique_ptr<Engine> cpu, cuda;
  SelectionRecorder cpu_sel, cuda_sel;
};

// Both engines from the same options; the recorders watch SpeContext runs only (an observer
// makes a dense engine compute the EAGLE-3 features too, which changes nothing but costs time).
void make_engines(const std::shared_ptr<const Model>& model, const EngineOptions& o, EnginePair& p) {
  auto cpu_backend = make_cpu_backend();
  auto cuda_backend = make_cuda_backend();
  ASSERT_TRUE(cpu_backend && cuda_backend);
  auto c = Engine::create(model, cpu_backend, o);
  ASSERT_TRUE(c.is_ok()) << "CPU engine: " << c.status().to_string();
  auto g = Engine::create(model, cuda_backend, o);
  ASSERT_TRUE(g.is_ok()) << "CUDA engine: " << g.status().to_string();
  p.cpu = std::move(*c);
  p.cuda = std::move(*g);
  if (o.sparse.method == SparseMethod::kSpeContext) {
    p.cpu->set_observer(&p.cpu_sel);
    p.cuda->set_observer(&p.cuda_sel);
  }
}

struct GreedyResult {
  std::vector<int64_t> first_divergence;  // per sequence: generated-token index, -1 = none
  double worst_rel = 0.0;
  int64_t logit_failures = 0;      // compared steps whose logits exceeded the tolerance
  int64_t selection_failures = 0;  // sparse steps whose selections differed
};

// Prefills `prompts` (one forward, all sequences), then decodes `steps` tokens greedily on both
// engines, each feeding back its own argmax. Compares every step's logits while a sequence's
// tokens agree on both engines, and the selections of sparse steps.
void run_greedy(EnginePair& p, const std::vector<std::vector<TokenId>>& prompts, int64_t steps, double tol,
                GreedyResult& out) {
  const size_t n = prompts.size();
  std::vector<SeqId> cpu_ids, cuda_ids;
  for (size_t i = 0; i < n; ++i) {
    auto a = p.cpu->memory().add_sequence();
    auto b = p.cuda->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    cpu_ids.push_back(*a);
    cuda_ids.push_back(*b);
  }
  out.first_divergence.assign(n, -1);
  std::vector<std::vector<TokenId>> cpu_in = prompts, cuda_in = prompts;
  for (int64_t step = 0; step <= steps; ++step) {
    std::vector<StepRequest> rc, rg;
    for (size_t i = 0; i < n; ++i) {
      rc.push_back({cpu_ids[i], cpu_in[i], LogitsMode::kLast});
      rg.push_back({cuda_ids[i], cuda_in[i], LogitsMode::kLast});
    }
    p.cpu_sel.last.clear();
    p.cuda_sel.last.clear();
    auto oc = p.cpu->forward(rc);
    ASSERT_TRUE(oc.is_ok()) << "CPU step " << step << ": " << oc.status().to_string();
    auto og = p.cuda->forward(rg);
    ASSERT_TRUE(og.is_ok()) << "CUDA step " << step << ": " << og.status().to_string();
    for (size_t i = 0; i < n; ++i) {
      const auto want = oc->row(i);
      const auto got = og->row(i);
      if (out.first_divergence[i] < 0) {
        const Rel r = rel_l2(got, want);
        ASSERT_TRUE(r.finite) << "sequence " << i << " step " << step << ": non-finite logits";
        ASSERT_GT(r.ref_norm, 0.0) << "sequence " << i << " step " << step << ": CPU logits all zero";
        out.worst_rel = std::max(out.worst_rel, r.rel);
        // The first few failures are reported in full, the rest counted (a systematic error
        // would otherwise flood the log the device check brings back).
        if (!(r.rel < tol) && ++out.logit_failures <= 3) {
          ADD_FAILURE() << "sequence " << i << " step " << step << " (0 = prefill): logits rel L2 " << r.rel
                        << " >= " << tol;
        }
        if (step > 0) {  // selections of this decode step (rows are request indices)
          const auto sc = p.cpu_sel.last.find(static_cast<int64_t>(i));
          const auto sg = p.cuda_sel.last.find(static_cast<int64_t>(i));
          const bool both = sc != p.cpu_sel.last.end() && sg != p.cuda_sel.last.end();
          const bool same = (sc == p.cpu_sel.last.end()) == (sg == p.cuda_sel.last.end()) &&
                            (!both || sc->second == sg->second);
          if (!same && ++out.selection_failures <= 3) {
            if (both) {
              ADD_FAILURE() << "sequence " << i << " step " << step
                            << ": selections differ:" << selection_diff(sc->second, sg->second);
            } else {
              ADD_FAILURE() << "sequence " << i << " step " << step << ": sparse on one backend only";
            }
          }
        }
      }
      const TokenId tc = argmax(want);
      const TokenId tg = argmax(got);
      if (out.first_divergence[i] < 0 && tc != tg) {
        out.first_divergence[i] = step;
        std::printf("sequence %zu diverges at generated token %lld: CPU %d, CUDA %d; CPU top-2 gap %.3g\n", i,
                    static_cast<long long>(step), tc, tg, top2_gap(want));
      }
      cpu_in[i] = {tc};
      cuda_in[i] = {tg};
    }
  }
}

struct BundledModel {
  const char* name;
  const char* model;
  const char* head;
};

constexpr BundledModel kBundled[] = {
    {"stories260K", "models/stories260K/stories260K.bin", "models/stories260K/retrieval_head.safetensors"},
    {"babyllama105", "models/babyllama105/model5000.bin", "models/babyllama105/retrieval_head.safetensors"},
};

class CudaEngineTest : public ::testing::TestWithParam<std::tuple<int, SparseMethod>> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaEngineTest, GreedyDecodeMatchesCpuEngine) {
  const BundledModel& bm = kBundled[std::get<0>(GetParam())];
  const SparseMethod method = std::get<1>(GetParam());
  auto model = load_model(source_path(bm.model));
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  const ModelConfig& c = (*model)->config;
  constexpr int64_t kSteps = 80;  // at least 64 must agree
  EngineOptions o;
  o.max_sequences = 2;
  o.max_context = std::min<int64_t>(c.max_seq_len, 48 + kSteps + 8);
  o.sparse.method = method;
  o.sparse.selection = {32, 1, 4};
  if (method == SparseMethod::kSpeContext) {
    auto head = load_eagle3_head(source_path(bm.head), c);
    ASSERT_TRUE(head.is_ok()) << head.status().to_string();
    o.retrieval_head = *head;
  }
  // A 40-token prompt (sparse from the first decode step, budget 32) and a 6-token one (dense
  // until it passes 32 tokens), batched together; ids drawn below the vocabulary.
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> id(3, static_cast<int32_t>(c.vocab_size) - 1);
  std::vector<std::vector<TokenId>> prompts(2);
  for (size_t i = 0; i < prompts.size(); ++i) {
    prompts[i].push_back(c.bos_token_id >= 0 && c.bos_token_id < c.vocab_size ? c.bos_token_id : 1);
    for (int k = 1; k < (i == 0 ? 40 : 6); ++k) prompts[i].push_back(id(rng));
  }
  EnginePair p;
  make_engines(*model, o, p);
  ASSERT_TRUE(p.cpu && p.cuda);
  GreedyResult r;
  run_greedy(p, prompts, kSteps, 1e-4, r);
  std::printf("%s %s: worst logits rel L2 %.3g\n", bm.name, std::string(sparse_method_name(method)).c_str(),
              r.worst_rel);
  EXPECT_EQ(r.logit_failures, 0) << "steps with logits beyond rel L2 1e-4 (first three reported above)";
  EXPECT_EQ(r.selection_failures, 0) << "sparse steps whose selections differ (first three reported above)";
  for (size_t i = 0; i < r.first_divergence.size(); ++i) {
    EXPECT_TRUE(r.first_divergence[i] < 0 || r.first_divergence[i] >= 64)
        << "sequence " << i << ": greedy tokens diverge at generated token " << r.first_divergence[i];
  }
  if (method == SparseMethod::kSpeContext) {
    const SparseStats& a = p.cpu->sparse_stats();
    const SparseStats& b = p.cuda->sparse_stats();
    EXPECT_GT(b.sparse_steps, 0);
    if (r.first_divergence[0] < 0 && r.first_divergence[1] < 0) {
      EXPECT_EQ(a.sparse_steps, b.sparse_steps);
      EXPECT_EQ(a.tokens_selected, b.tokens_selected);
      EXPECT_EQ(a.tokens_loaded, b.tokens_loaded);
      EXPECT_EQ(a.tokens_kept, b.tokens_kept);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bundled, CudaEngineTest,
                         ::testing::Combine(::testing::Values(0, 1),
                                            ::testing::Values(SparseMethod::kDense, SparseMethod::kSpeContext)),
                         [](const auto& info) {
                           return std::string(kBundled[std::get<0>(info.param)].name) + "_" +
                                  std::string(sparse_method_name(std::get<1>(info.param)));
                         });

// fill_synthetic writes the same random pages (and head keys) on both backends; a few decode
// steps on top must give the same logits. f32 weights: 1e-4. bf16 weights: both backends round
// the activations to bf16 before every product, but an activation that lands on the other side
// of a rounding boundary differs by 2^-8 of itself; the backend's own bf16 matmul test allows
// 5e-3, and that is the tolerance here. f16 / bf16 KV (third parameter) with f32 weights: the
// filled pages are identical, but the K/V of each new token come from each backend's f32 forward
// and one element within f32 rounding of a 2-byte rounding boundary lands on the neighbouring
// value (2^-11 / 2^-8 of itself): 1e-3.
class CudaEngineSyntheticTest : public ::testing::TestWithParam<std::tuple<DType, SparseMethod, DType>> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaEngineSyntheticTest, FilledContextDecodesAlike) {
  const DType dtype = std::get<0>(GetParam());
  const SparseMethod method = std::get<1>(GetParam());
  const DType kv_dtype = std::get<2>(GetParam());
  auto model = make_synthetic_model("toy", 0, dtype, 11);
  ASSERT_TRUE(model.is_ok()) << model.status().to_string();
  const ModelConfig& c = (*model)->config;
  constexpr int64_t kContext = 1000;
  constexpr int64_t kSteps = 6;
  EngineOptions o;
  o.max_sequences = 3;
  o.max_context = kContext + kSteps + 8;
  o.kv_dtype = kv_dtype;
  o.sparse.method = method;
  o.sparse.selection = {32, 1, 4};
  if (method == SparseMethod::kSpeContext) {
    auto head = make_random_head(c, 12);
    ASSERT_TRUE(head.is_ok()) << head.status().to_string();
    o.retrieval_head = *head;
  }
  EnginePair p;
  make_engines(*model, o, p);
  ASSERT_TRUE(p.cpu && p.cuda);
  // Three sequences: two filled (different lengths, different seeds), one from a short prompt.
  std::vector<SeqId> ids_c, ids_g;
  for (int i = 0; i < 3; ++i) {
    auto a = p.cpu->memory().add_sequence();
    auto b = p.cuda->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    ids_c.push_back(*a);
    ids_g.push_back(*b);
  }
  for (int i = 0; i < 2; ++i) {
    const int64_t n = i == 0 ? kContext : 333;
    const Status sc = p.cpu->fill_synthetic(ids_c[static_cast<size_t>(i)], n, 50 + static_cast<uint64_t>(i));
    const Status sg = p.cuda->fill_synthetic(ids_g[static_cast<size_t>(i)], n, 50 + static_cast<uint64_t>(i));
    ASSERT_TRUE(sc.is_ok()) << sc.to_string();
    ASSERT_TRUE(sg.is_ok()) << sg.to_string();
  }
  const double tol = dtype == DType::kBF16 ? 5e-3 : kv_dtype != DType::kF32 ? 1e-3 : 1e-4;
  std::vector<std::vector<TokenId>> in = {{17}, {42}, {1, 5, 9, 200, 31}};
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<StepRequest> rc, rg;
    for (size_t i = 0; i < in.size(); ++i) {
      rc.push_back({ids_c[i], in[i], LogitsMode::kLast});
      rg.push_back({ids_g[i], in[i], LogitsMode::kLast});
    }
    p.cpu_sel.last.clear();
    p.cuda_sel.last.clear();
    auto oc = p.cpu->forward(rc);
    ASSERT_TRUE(oc.is_ok()) << oc.status().to_string();
    auto og = p.cuda->forward(rg);
    ASSERT_TRUE(og.is_ok()) << "CUDA step " << step << ": " << og.status().to_string();
    for (size_t i = 0; i < in.size(); ++i) {
      const Rel r = rel_l2(og->row(i), oc->row(i));
      ASSERT_TRUE(r.finite) << "sequence " << i << " step " << step;
      ASSERT_GT(r.ref_norm, 0.0);
      EXPECT_LT(r.rel, tol) << "sequence " << i << " step " << step;
      // Teacher forcing with the CPU's token: the comparison stays meaningful at every step.
      in[i] = {argmax(oc->row(i))};
    }
    // Rows are request indices here: the filled sequences decode one token each, first.
    for (const auto& [row, sel] : p.cpu_sel.last) {
      const auto it = p.cuda_sel.last.find(row);
      ASSERT_NE(it, p.cuda_sel.last.end()) << "row " << row << " step " << step << ": sparse on the CPU only";
      EXPECT_TRUE(it->second == sel) << "row " << row << " step " << step
                                     << ": selections differ:" << selection_diff(sel, it->second);
    }
    EXPECT_EQ(p.cpu_sel.last.size(), p.cuda_sel.last.size()) << "step " << step;
  }
  if (method == SparseMethod::kSpeContext) {
    EXPECT_GT(p.cuda->sparse_stats().sparse_steps, 0);
    EXPECT_EQ(p.cpu->sparse_stats().tokens_loaded, p.cuda->sparse_stats().tokens_loaded);
  }
}

std::string synthetic_case_name(
    const ::testing::TestParamInfo<std::tuple<DType, SparseMethod, DType>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" +
         std::string(sparse_method_name(std::get<1>(info.param))) + "_kv_" +
         std::string(dtype_name(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(Toy, CudaEngineSyntheticTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(SparseMethod::kDense,
                                                              SparseMethod::kSpeContext),
                                            ::testing::Values(DType::kF32)),
                         synthetic_case_name);
// The 2-byte KV caches (f32 weights, so the KV rounding is the only difference from Toy).
INSTANTIATE_TEST_SUITE_P(ToyHalfKv, CudaEngineSyntheticTest,
                         ::testing::Combine(::testing::Values(DType::kF32),
                                            ::testing::Values(SparseMethod::kDense,
                                                              SparseMethod::kSpeContext),
                                            ::testing::Values(DType::kF16, DType::kBF16)),
                         synthetic_case_name);

}  // namespace
}  // namespace specontext::gpu
