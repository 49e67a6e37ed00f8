// The retrieval head: EAGLE-3 checkpoint loading and pruning (parameter counts, errors naming
// the file and field), the writer, q/k against a scalar oracle, scores, and YaRN beyond the
// head's trained window.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "core/base/dtype.h"
#include "core/model/safetensors.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::temp_dir;

// A small GQA target: d = 16, 4 query heads, 2 KV heads, head_dim 4.
ModelConfig small_target() {
  ModelConfig c;
  c.dim = 16;
  c.hidden_dim = 40;
  c.n_layers = 6;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.vocab_size = 50;
  c.max_seq_len = 64;
  c.rope_theta = 10000.0;
  c.norm_eps = 1e-5f;
  return c;
}

std::vector<float> randn(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A full EAGLE-3 draft checkpoint for small_target(), some tensors optional.
struct Checkpoint {
  std::map<std::string, std::vector<float>> f32;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::vector<uint16_t> q_bf16;  // q_proj is stored as bf16 to test conversion
  std::vector<int64_t> d2t;
  int64_t expected_draft = 0;
  int64_t expected_kept = 0;

  explicit Checkpoint(int64_t k_rows = 8) {
    const int64_t d = 16;
    auto add = [&](const std::string& name, std::vector<int64_t> shape, bool kept, uint32_t seed) {
      int64_t n = 1;
      for (int64_t s : shape) n *= s;
      f32[name] = randn(static_cast<size_t>(n), seed, 0.2f);
      shapes[name] = shape;
      expected_draft += n;
      if (kept) expected_kept += n;
    };
    add("fc.weight", {d, 3 * d}, true, 1);
    add("midlayer.input_layernorm.weight", {d}, true, 2);
    add("midlayer.hidden_norm.weight", {d}, true, 3);
    add("midlayer.self_attn.k_proj.weight", {k_rows, 2 * d}, true, 4);
    add("midlayer.self_attn.v_proj.weight", {8, 2 * d}, false, 5);
    add("midlayer.self_attn.o_proj.weight", {d, 16}, false, 6);
    add("midlayer.mlp.gate_proj.weight", {40, d}, false, 7);
    add("midlayer.mlp.up_proj.weight", {40, d}, false, 8);
    add("midlayer.mlp.down_proj.weight", {d, 40}, false, 9);
    add("midlayer.post_attention_layernorm.weight", {d}, false, 10);
    add("norm.weight", {d}, false, 11);
    add("lm_head.weight", {50, d}, false, 12);
    std::vector<float> q = randn(16 * 32, 13, 0.2f);
    for (float v : q) q_bf16.push_back(f32_to_bf16(v));
    expected_draft += 16 * 32;
    expected_kept += 16 * 32;
    d2t.assign(50, 3);  // vocabulary map: recognised, not a parameter
  }

  Status write(const std::string& path, bool with_k = true, bool with_embed = true) {
    std::vector<NamedTensor> t;
    for (auto& [name, v] : f32) {
      if (!with_k && name == "midlayer.self_attn.k_proj.weight") continue;
      t.push_back({name, DType::kF32, shapes[name], v.data()});
    }
    t.push_back({"midlayer.self_attn.q_proj.weight", DType::kBF16, {16, 32}, q_bf16.data()});
    t.push_back({"d2t", DType::kI64, {50}, d2t.data()});
    if (with_embed) {
      embed = randn(50 * 16, 99, 0.1f);
      t.push_back({"embed_tokens.weight", DType::kF32, {50, 16}, embed.data()});
    }
    return write_safetensors(path, t, {{"format", "pt"}});
  }
  std::vector<float> embed;
};

TEST(RetrievalHead, FusedLayers) {
  EXPECT_EQ(eagle3_fused_layers(32), (std::array<int64_t, 3>{2, 16, 29}));
  EXPECT_EQ(eagle3_fused_layers(5), (std::array<int64_t, 3>{2, 2, 2}));
  EXPECT_EQ(eagle3_fused_layers(2), (std::array<int64_t, 3>{1, 1, 0}));
  EXPECT_EQ(eagle3_fused_layers(1), (std::array<int64_t, 3>{0, 0, 0}));
}

TEST(RetrievalHead, LoadsAndPrunesEagle3Checkpoint) {
  const std::string dir = temp_dir("spx-head");
  const std::string path = dir + "/draft.safetensors";
  Checkpoint ck;
  ASSERT_TRUE(ck.write(path).is_ok());
  auto r = load_eagle3_head(path, small_target());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const RetrievalHead& h = **r;
  EXPECT_EQ(h.config.hidden, 16);
  EXPECT_EQ(h.config.head_dim, 4);  // q rows 16 / target's 4 heads
  EXPECT_EQ(h.config.n_heads, 4);
  EXPECT_EQ(h.config.n_kv_heads, 2);
  EXPECT_EQ(h.config.trained_context, 2048);
  EXPECT_EQ(h.config.fused_layers, (std::array<int64_t, 3>{2, 3, 3}));
  // Counted: every float tensor of the draft but the embedding; kept: fc, norms, q, k.
  EXPECT_EQ(h.kept_parameters, 16 * 48 + 16 + 16 + 16 * 32 + 8 * 32);
  EXPECT_EQ(h.kept_parameters, ck.expected_kept);
  EXPECT_EQ(h.draft_parameters, ck.expected_draft);
  EXPECT_EQ(h.wq.dtype, DType::kF32);
  const float* wq = static_cast<const float*>(h.wq.data);
  for (size_t i = 0; i < ck.q_bf16.size(); ++i) ASSERT_EQ(wq[i], bf16_to_f32(ck.q_bf16[i]));
  const float* fc = static_cast<const float*>(h.fc.data);
  for (size_t i = 0; i < ck.f32["fc.weight"].size(); ++i) ASSERT_EQ(fc[i], ck.f32["fc.weight"][i]);
  EXPECT_EQ(h.hidden_norm, ck.f32["midlayer.hidden_norm.weight"]);

  const std::string report = pruning_report(h);
  char expect[160];
  std::snprintf(expect, sizeof expect, "retrieval head keeps %.1fK of %.1fK draft parameters (%.1f%% pruned)",
                h.kept_parameters / 1e3, h.draft_parameters / 1e3,
                100.0 * (1.0 - double(h.kept_parameters) / double(h.draft_parameters)));
  EXPECT_EQ(report, expect);
}

TEST(RetrievalHead, DirectoryWithConfigJson) {
  const std::string dir = temp_dir("spx-head-dir");
  Checkpoint ck;
  ASSERT_TRUE(ck.write(dir + "/model.safetensors").is_ok());
  testing::write_file(dir + "/config.json",
                      R"({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "head_dim": 4, "rope_theta": 500000.0, "max_position_embeddings": 1024,
                          "rms_norm_eps": 1e-6})");
  auto r = load_eagle3_head(dir, small_target());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->config.trained_context, 1024);
  EXPECT_DOUBLE_EQ((*r)->config.rope_theta, 500000.0);
  EXPECT_FLOAT_EQ((*r)->config.norm_eps, 1e-6f);

  // A config.json disagreeing with the tensors is named in the error.
  testing::write_file(dir + "/config.json", R"({"num_attention_heads": 8, "head_dim": 4})");
  auto bad = load_eagle3_head(dir, small_target());
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("config.json"), std::string::npos) << bad.status().to_string();
  EXPECT_NE(bad.status().message().find("num_attention_heads"), std::string::npos);
}

// Official EAGLE-3 drafts ship pytorch_model.bin (torch.save's zip format). The fixtures of
// tests/data/torch_eagle3 were written by torch.save, each with a safetensors twin holding the
// same tensors (tests/data/make_torch_fixtures.py): both load to the same head, weight for weight.
TEST(RetrievalHead, PytorchModelBinLoadsLikeItsSafetensorsTwin) {
  const int64_t kept = 16 * 48 + 16 + 16 + 16 * 32 + 8 * 32;
  // Dropped and counted: v_proj, o_proj, post_attention_layernorm, norm, lm_head [32, 16].
  const int64_t draft = kept + 8 * 32 + 16 * 16 + 16 + 16 + 32 * 16;
  for (const char* name : {"eagle3_f32", "eagle3_f16", "eagle3_bf16"}) {
    SCOPED_TRACE(name);
    const std::string base = testing::repo_path(std::string("tests/data/torch_eagle3/") + name);
    auto pt = load_eagle3_head(base + ".bin", small_target());
    ASSERT_TRUE(pt.is_ok()) << pt.status().to_string();
    auto st = load_eagle3_head(base + ".safetensors", small_target());
    ASSERT_TRUE(st.is_ok()) << st.status().to_string();
    const RetrievalHead& a = **pt;
    const RetrievalHead& b = **st;
    EXPECT_EQ(a.config.hidden, 16);
    EXPECT_EQ(a.config.n_heads, 4);
    EXPECT_EQ(a.config.n_kv_heads, 2);
    EXPECT_EQ(a.config.head_dim, 4);
    EXPECT_EQ(a.config.n_heads, b.config.n_heads);
    EXPECT_EQ(a.config.head_dim, b.config.head_dim);
    EXPECT_DOUBLE_EQ(a.config.rope_theta, b.config.rope_theta);
    EXPECT_EQ(a.config.trained_context, b.config.trained_context);
    EXPECT_EQ(a.config.fused_layers, b.config.fused_layers);
    EXPECT_EQ(a.kept_parameters, kept);
    EXPECT_EQ(a.kept_parameters, b.kept_parameters);
    // bf16 holds only parameters (named_parameters()): the same count, no buffers to skip.
    EXPECT_EQ(a.draft_parameters, draft);
    EXPECT_EQ(a.draft_parameters, b.draft_parameters);
    for (auto [x, y] : {std::pair{&a.fc, &b.fc}, std::pair{&a.wq, &b.wq}, std::pair{&a.wk, &b.wk}}) {
      ASSERT_EQ(x->rows, y->rows);
      ASSERT_EQ(x->cols, y->cols);
      ASSERT_EQ(x->dtype, DType::kF32);
      EXPECT_EQ(std::memcmp(x->data, y->data, x->bytes()), 0);
    }
    EXPECT_EQ(a.input_norm, b.input_norm);
    EXPECT_EQ(a.hidden_norm, b.hidden_norm);
    // And the values are the draft's, not zeros: fc is N(0, 0.2²) noise.
    const float* fc = static_cast<const float*>(a.fc.data);
    EXPECT_NE(fc[0], 0.0f);
    EXPECT_NE(fc[16 * 48 - 1], 0.0f);
  }
}

TEST(RetrievalHead, DirectoryWithPytorchModelBin) {
  const std::string dir = temp_dir("spx-head-pt");
  testing::write_file(dir + "/pytorch_model.bin",
                      testing::read_text_file(testing::repo_path("tests/data/torch_eagle3/eagle3_f16.bin")));
  testing::write_file(dir + "/config.json",
                      R"({"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "rope_theta": 500000.0, "max_position_embeddings": 1024})");
  auto r = load_eagle3_head(dir, small_target());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->config.trained_context, 1024);
  EXPECT_DOUBLE_EQ((*r)->config.rope_theta, 500000.0);
  EXPECT_EQ((*r)->config.head_dim, 4);

  const std::string empty = temp_dir("spx-head-none");
  auto none = load_eagle3_head(empty, small_target());
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("pytorch_model.bin"), std::string::npos)
      << none.status().to_string();
}

TEST(RetrievalHead, PytorchModelBinRefusalsNameTheFile) {
  for (const char* name : {"strided.bin", "legacy.bin", "deflated.bin", "evil_global.bin"}) {
    SCOPED_TRACE(name);
    const std::string path = testing::repo_path(std::string("tests/data/torch_eagle3/") + name);
    auto r = load_eagle3_head(path, small_target());
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  }
}

// EAGLE's draft without rope_theta in its config rotates with base 10000 (EAGLE's default), not
// with the target's base: the loader follows it and says so.
TEST(RetrievalHead, ADraftWithoutRopeThetaUsesEaglesDefaultNotTheTargets) {
  const std::string dir = temp_dir("spx-head-theta");
  Checkpoint ck;
  ASSERT_TRUE(ck.write(dir + "/model.safetensors").is_ok());
  testing::write_file(dir + "/config.json", R"({"hidden_size": 16, "num_attention_heads": 4, "head_dim": 4})");
  ModelConfig target = small_target();
  target.rope_theta = 500000.0;
  auto r = load_eagle3_head(dir, target);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_DOUBLE_EQ((*r)->config.rope_theta, 10000.0);
  EXPECT_NE((*r)->load_note.find("no rope_theta"), std::string::npos) << (*r)->load_note;
  EXPECT_NE((*r)->load_note.find("500000"), std::string::npos) << (*r)->load_note;
  // Named in the config, it is used as it is, without a note.
  testing::write_file(dir + "/config.json",
                      R"({"hidden_size": 16, "num_attention_heads": 4, "head_dim": 4, "rope_theta": 500000.0})");
  r = load_eagle3_head(dir, target);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_DOUBLE_EQ((*r)->config.rope_theta, 500000.0);
  EXPECT_TRUE((*r)->load_note.empty());
}

TEST(RetrievalHead, MissingKProjNamesTheKey) {
  const std::string path = temp_dir("spx-head-miss") + "/draft.safetensors";
  Checkpoint ck;
  ASSERT_TRUE(ck.write(path, /*with_k=*/false).is_ok());
  auto r = load_eagle3_head(path, small_target());
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("midlayer.self_attn.k_proj.weight"), std::string::npos)
      << r.status().to_string();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
}

TEST(RetrievalHead, KvHeadsMismatchIsAnError) {
  const std::string path = temp_dir("spx-head-kv") + "/draft.safetensors";
  Checkpoint ck(/*k_rows=*/16);  // 4 KV heads of 4 for a target with 2
  ASSERT_TRUE(ck.write(path).is_ok());
  auto r = load_eagle3_head(path, small_target());
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find("num_key_value_heads"), std::string::npos) << r.status().to_string();

  // The wrong hidden size for the target is named too.
  ModelConfig wide = small_target();
  wide.dim = 32;
  auto r2 = load_eagle3_head(path, wide);
  ASSERT_FALSE(r2.is_ok());
  EXPECT_NE(r2.status().message().find("fc.weight"), std::string::npos) << r2.status().to_string();
}

TEST(RetrievalHead, WriterRoundTrip) {
  auto made = make_random_head(small_target(), 7);
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  RetrievalHead& h = **made;
  h.config.trained_context = 512;
  h.config.rope_theta = 1234.5;
  const std::string path = temp_dir("spx-head-rt") + "/head.safetensors";
  ASSERT_TRUE(write_retrieval_head(path, h).is_ok());
  auto r = load_eagle3_head(path, small_target());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const RetrievalHead& g = **r;
  EXPECT_EQ(g.config.trained_context, 512);
  EXPECT_DOUBLE_EQ(g.config.rope_theta, 1234.5);
  EXPECT_EQ(g.config.n_heads, h.config.n_heads);
  EXPECT_EQ(g.config.head_dim, h.config.head_dim);
  EXPECT_EQ(g.kept_parameters, h.kept_parameters);
  EXPECT_EQ(g.draft_parameters, h.draft_parameters);  // recorded in the metadata
  EXPECT_EQ(std::memcmp(g.wk.data, h.wk.data, h.wk.bytes()), 0);
  EXPECT_EQ(std::memcmp(g.fc.data, h.fc.data, h.fc.bytes()), 0);
  EXPECT_EQ(g.input_norm, h.input_norm);
  EXPECT_EQ(g.config.select_group, GroupReduce::kMax);

  // A head whose groups take turns says so in its metadata; an unknown rule is refused by name.
  h.config.select_group = GroupReduce::kTurns;
  ASSERT_TRUE(write_retrieval_head(path, h).is_ok());
  auto turns = load_eagle3_head(path, small_target());
  ASSERT_TRUE(turns.is_ok()) << turns.status().to_string();
  EXPECT_EQ((*turns)->config.select_group, GroupReduce::kTurns);
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.is_ok());
  std::map<std::string, std::string> meta = (*file)->metadata();
  meta["select_group"] = "mean";
  std::vector<NamedTensor> tensors;
  for (const SafetensorsTensor& t : (*file)->tensors()) tensors.push_back({t.name, t.dtype, t.shape, t.data});
  const std::string bad = temp_dir("spx-head-rt") + "/bad.safetensors";
  ASSERT_TRUE(write_safetensors(bad, tensors, meta).is_ok());
  auto refused = load_eagle3_head(bad, small_target());
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("select_group"), std::string::npos) << refused.status().to_string();
}

TEST(RetrievalHead, RandomHeadShape) {
  const ModelConfig t = small_target();
  auto r = make_random_head(t, 3);
  ASSERT_TRUE(r.is_ok());
  const RetrievalHead& h = **r;
  const int64_t d = 16, qd = 16, kd = 8;
  EXPECT_EQ(h.wq.rows, qd);
  EXPECT_EQ(h.wk.rows, kd);
  EXPECT_EQ(h.wq.cols, 2 * d);
  EXPECT_EQ(h.kept_parameters, 3 * d * d + 2 * d + qd * 2 * d + kd * 2 * d);
  EXPECT_EQ(h.draft_parameters,
            qd * 2 * d + 2 * kd * 2 * d + d * qd + 3 * d * 40 + 3 * d * d + 4 * d + 50 * d);
  const float* fc = static_cast<const float*>(h.fc.data);
  EXPECT_NEAR(fc[0], 1.0f / 3.0f, 0.01f);
  EXPECT_NEAR(fc[d], 1.0f / 3.0f, 0.01f);
  EXPECT_NEAR(fc[1], 0.0f, 0.01f);
  // Same seed, same head.
  auto r2 = make_random_head(t, 3);
  EXPECT_EQ(std::memcmp((*r2)->wq.data, h.wq.data, h.wq.bytes()), 0);
}

// ---- scalar oracle of the head's q/k ----
void rmsnorm_ref(const float* x, const std::vector<float>& w, int64_t d, float eps, double* out) {
  double ss = 0;
  for (int64_t i = 0; i < d; ++i) ss += double(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / double(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[static_cast<size_t>(i)];
}

void rope_ref(double* v, int64_t pos, const RopeParams& p) {
  const int64_t half = p.head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double a = double(pos) * p.inv_freq[static_cast<size_t>(i)];
    const double x0 = v[i], x1 = v[i + half];
    v[i] = (x0 * std::cos(a) - x1 * std::sin(a)) * p.mscale;
    v[i + half] = (x0 * std::sin(a) + x1 * std::cos(a)) * p.mscale;
  }
}

TEST(RetrievalHead, QkMatchesScalarOracle) {
  const ModelConfig t = small_target();
  auto hr = make_random_head(t, 11);
  ASSERT_TRUE(hr.is_ok());
  RetrievalHead& h = **hr;
  // Non-trivial norms so a swapped norm would show.
  for (size_t i = 0; i < h.input_norm.size(); ++i) h.input_norm[i] = 0.5f + 0.1f * float(i);
  for (size_t i = 0; i < h.hidden_norm.size(); ++i) h.hidden_norm[i] = 1.5f - 0.05f * float(i);
  const int64_t d = 16, n = 5, qd = 16, kd = 8, hd = 4;
  std::vector<float> emb = randn(static_cast<size_t>(t.vocab_size * d), 21, 1.0f);
  WeightMatrix table{DType::kF32, t.vocab_size, d, emb.data()};
  std::vector<TokenId> tokens = {1, 7, 49, 0, 23};
  std::vector<int64_t> positions = {0, 1, 2, 3000, 4095};
  std::vector<float> fused = randn(static_cast<size_t>(n * 3 * d), 22, 2.0f);
  for (int64_t i = 0; i < 3 * d; ++i) fused[static_cast<size_t>(i)] = 0.0f;  // position 0: zeros

  for (int64_t context : {int64_t{512}, int64_t{4096}}) {  // plain RoPE, then YaRN
    const RopeParams rope = make_head_rope_params(h.config, context);
    auto backend = cpu::create_cpu_backend();
    ASSERT_TRUE(backend.is_ok());
    std::vector<float> q(static_cast<size_t>(n * qd)), k(static_cast<size_t>(n * kd));
    ASSERT_TRUE(retrieval_qk(**backend, h, rope, table, tokens.data(), fused.data(), positions.data(), n,
                             q.data(), k.data())
                    .is_ok());
    const float* fc = static_cast<const float*>(h.fc.data);
    const float* wq = static_cast<const float*>(h.wq.data);
    const float* wk = static_cast<const float*>(h.wk.data);
    for (int64_t r = 0; r < n; ++r) {
      std::vector<double> x(static_cast<size_t>(2 * d));
      rmsnorm_ref(emb.data() + tokens[static_cast<size_t>(r)] * d, h.input_norm, d, h.config.norm_eps,
                  x.data());
      std::vector<float> f(static_cast<size_t>(d));
      for (int64_t o = 0; o < d; ++o) {
        double s = 0;
        for (int64_t i = 0; i < 3 * d; ++i)
          s += double(fc[o * 3 * d + i]) * fused[static_cast<size_t>(r * 3 * d + i)];
        f[static_cast<size_t>(o)] = float(s);
      }
      if (r == 0) {
        // RMSNorm of a zero vector is zero (eps keeps it finite).
        for (int64_t o = 0; o < d; ++o) x[static_cast<size_t>(d + o)] = 0.0;
      } else {
        rmsnorm_ref(f.data(), h.hidden_norm, d, h.config.norm_eps, x.data() + d);
      }
      auto project = [&](const float* w, int64_t rows, const float* got, int64_t heads) {
        std::vector<double> y(static_cast<size_t>(rows));
        for (int64_t o = 0; o < rows; ++o) {
          double s = 0;
          for (int64_t i = 0; i < 2 * d; ++i) s += double(w[o * 2 * d + i]) * x[static_cast<size_t>(i)];
          y[static_cast<size_t>(o)] = s;
        }
        for (int64_t hh = 0; hh < heads; ++hh)
          rope_ref(y.data() + hh * hd, positions[static_cast<size_t>(r)], rope);
        for (int64_t o = 0; o < rows; ++o) {
          ASSERT_NEAR(got[o], y[static_cast<size_t>(o)], 2e-3 * (1.0 + std::abs(y[static_cast<size_t>(o)])))
              << "row " << r << " feature " << o << " context " << context;
        }
      };
      project(wq, qd, q.data() + r * qd, 4);
      project(wk, kd, k.data() + r * kd, 2);
    }
  }
}

TEST(RetrievalHead, ScoresAreSoftmaxRowsPerQueryHead) {
  auto hr = make_random_head(small_target(), 5);
  ASSERT_TRUE(hr.is_ok());
  const RetrievalHead& h = **hr;
  const int64_t length = 37, qd = 16, kd = 8, hd = 4;
  std::vector<float> q = randn(static_cast<size_t>(qd), 31, 1.0f);
  std::vector<float> k = randn(static_cast<size_t>(length * kd), 32, 1.0f);
  std::vector<float> scores(static_cast<size_t>(4 * length), -1.0f);
  retrieval_scores(h, q.data(), k.data(), length, scores.data());
  for (int64_t head = 0; head < 4; ++head) {
    double sum = 0;
    const int64_t g = head / 2;
    std::vector<double> logits(static_cast<size_t>(length));
    double mx = -1e30;
    for (int64_t j = 0; j < length; ++j) {
      double s = 0;
      for (int64_t i = 0; i < hd; ++i)
        s += double(q[static_cast<size_t>(head * hd + i)]) * k[static_cast<size_t>(j * kd + g * hd + i)];
      logits[static_cast<size_t>(j)] = s / 2.0;  // √head_dim = 2
      mx = std::max(mx, logits[static_cast<size_t>(j)]);
    }
    double z = 0;
    for (double l : logits) z += std::exp(l - mx);
    for (int64_t j = 0; j < length; ++j) {
      const float p = scores[static_cast<size_t>(head * length + j)];
      EXPECT_GE(p, 0.0f);
      EXPECT_NEAR(p, std::exp(logits[static_cast<size_t>(j)] - mx) / z, 1e-5);
      sum += p;
    }
    EXPECT_NEAR(sum, 1.0, 1e-5) << "head " << head;
  }
}

TEST(RetrievalHead, SelectionByTurnsEqualsTheHostReference) {
  // select_by_turns on the CPU backend over paged keys (blocks out of order) against
  // retrieval_scores + reduce_group_scores(kTurns) + select_from_group_scores on the host.
  auto hr = make_random_head(small_target(), 9);
  ASSERT_TRUE(hr.is_ok());
  RetrievalHead& h = **hr;
  h.config.select_group = GroupReduce::kTurns;
  auto be = cpu::CpuBackend::create(cpu::CpuBackendOptions{.num_threads = 2});
  ASSERT_TRUE(be.is_ok());
  const int64_t length = 300, qd = 16, kd = 8, bt = 32, n_blocks = (length + bt - 1) / bt;
  std::vector<float> q = randn(static_cast<size_t>(qd), 41, 1.0f);
  std::vector<float> k = randn(static_cast<size_t>(length * kd), 42, 1.0f);
  std::vector<std::vector<float>> blocks(static_cast<size_t>(n_blocks), std::vector<float>(static_cast<size_t>(bt * kd)));
  std::vector<const void*> table(static_cast<size_t>(n_blocks));
  for (int64_t b = 0; b < n_blocks; ++b) {
    auto& blk = blocks[static_cast<size_t>(n_blocks - 1 - b)];
    for (int64_t t = b * bt; t < std::min(length, (b + 1) * bt); ++t) {
      std::copy_n(k.data() + t * kd, kd, blk.data() + (t - b * bt) * kd);
    }
    table[static_cast<size_t>(b)] = blk.data();
  }
  std::vector<float> scores(static_cast<size_t>(4 * length));
  retrieval_scores(h, q.data(), k.data(), length, scores.data());
  // The same blocks in f16 (the KV dtype of an f16 cache), and the reference over those keys
  // widened: select_by_turns widens on load, so it selects exactly as over the widened keys.
  std::vector<std::vector<uint16_t>> blocks16(static_cast<size_t>(n_blocks), std::vector<uint16_t>(static_cast<size_t>(bt * kd)));
  std::vector<const void*> table16(static_cast<size_t>(n_blocks));
  for (int64_t b = 0; b < n_blocks; ++b) {
    const auto& blk = blocks[static_cast<size_t>(n_blocks - 1 - b)];
    auto& blk16 = blocks16[static_cast<size_t>(n_blocks - 1 - b)];
    convert_from_f32(DType::kF16, blk.data(), blk16.data(), blk.size());
    table16[static_cast<size_t>(b)] = blk16.data();
  }
  std::vector<uint16_t> k16(k.size());
  std::vector<float> k_widened(k.size()), scores16(scores.size());
  convert_from_f32(DType::kF16, k.data(), k16.data(), k.size());
  convert_to_f32(DType::kF16, k16.data(), k_widened.data(), k.size());
  retrieval_scores(h, q.data(), k_widened.data(), length, scores16.data());
  for (const SelectionOptions o : {SelectionOptions{64, 4, 8}, SelectionOptions{16, 1, 4}, SelectionOptions{400, 1, 4}}) {
    std::vector<float> g, g16;
    reduce_group_scores(scores, 4, 2, length, o, GroupReduce::kTurns, g);
    reduce_group_scores(scores16, 4, 2, length, o, GroupReduce::kTurns, g16);
    Selection want, got, want16, got16;
    select_from_group_scores(g, 2, length, o, want);
    select_from_group_scores(g16, 2, length, o, want16);
    std::vector<float> scratch(static_cast<size_t>(select_by_turns_scratch_floats(h.config, length)));
    ASSERT_TRUE(select_by_turns(**be, h.config, q.data(), table16.data(), DType::kF16, bt, length, o, scratch.data(),
                                got16)
                    .is_ok());
    for (int64_t kv = 0; kv < 2; ++kv) {
      const auto w = want16.head(kv), x = got16.head(kv);
      EXPECT_EQ(std::vector<int32_t>(x.begin(), x.end()), std::vector<int32_t>(w.begin(), w.end()))
          << "f16 keys, budget " << o.budget << " kv head " << kv;
    }
    ASSERT_TRUE(select_by_turns(**be, h.config, q.data(), table.data(), DType::kF32, bt, length, o, scratch.data(), got).is_ok());
    for (int64_t kv = 0; kv < 2; ++kv) {
      const auto w = want.head(kv), x = got.head(kv);
      EXPECT_EQ(std::vector<int32_t>(x.begin(), x.end()), std::vector<int32_t>(w.begin(), w.end()))
          << "budget " << o.budget << " kv head " << kv;
    }
    if (o.budget < length) {  // and not the max rule's selection (the heads disagree somewhere)
      Selection by_max;
      select_tokens(scores, 4, 2, length, o, by_max);
      EXPECT_NE(by_max.indices, got.indices) << "budget " << o.budget;
    }
  }
}

TEST(RetrievalHead, YarnBeyondTrainedContext) {
  RetrievalHeadConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.0;
  c.trained_context = 2048;
  const RopeParams plain = make_head_rope_params(c, 2048);
  const RopeParams yarn = make_head_rope_params(c, 32768);
  ASSERT_EQ(plain.inv_freq.size(), 64u);
  ASSERT_EQ(yarn.inv_freq.size(), 64u);
  EXPECT_EQ(plain.style, RopeStyle::kHalf);
  EXPECT_FLOAT_EQ(plain.mscale, 1.0f);
  EXPECT_GT(yarn.mscale, 1.0f);
  EXPECT_NEAR(yarn.mscale, 0.1 * std::log(16.0) + 1.0, 1e-6);
  // High frequencies are extrapolated (unchanged), low ones interpolated by the factor 16.
  EXPECT_FLOAT_EQ(yarn.inv_freq[0], plain.inv_freq[0]);
  EXPECT_NEAR(yarn.inv_freq[63], plain.inv_freq[63] / 16.0f, 1e-6f * plain.inv_freq[63]);
  int differing = 0;
  for (size_t i = 0; i < 64; ++i) differing += yarn.inv_freq[i] != plain.inv_freq[i];
  EXPECT_GT(differing, 10);
  // Matches make_rope_params with the equivalent HF rope_scaling.
  ModelConfig m;
  m.head_dim = 128;
  m.rope_theta = 500000.0;
  m.rope_scaling.type = RopeScalingType::kYarn;
  m.rope_scaling.factor = 16.0;
  m.rope_scaling.original_max_position_embeddings = 2048;
  const RopeParams hf = make_rope_params(m);
  EXPECT_EQ(hf.inv_freq, yarn.inv_freq);
  EXPECT_EQ(hf.mscale, yarn.mscale);
}

}  // namespace
}  // namespace specontext
