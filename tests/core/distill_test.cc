// Retrieval-head distillation on the bundled stories260K: teacher capture, corpus handling, and
// a short training run that must lower the held-out KL (kept small: CI also runs under ASan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/distill.h"
#include "core/model_loader.h"
#include "cpu/cpu_backend.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;

#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kContext = 64;
constexpr int64_t kSteps = 40;
#else
constexpr int64_t kContext = 256;
constexpr int64_t kSteps = 150;
#endif

struct Fixture {
  std::shared_ptr<Model> model;
  std::unique_ptr<Tokenizer> tok;
  std::shared_ptr<Backend> backend;
  std::vector<TokenId> corpus;
};

Fixture load() {
  Fixture f;
  auto m = load_model(repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  if (!m.is_ok()) return f;
  f.model = *m;
  auto t = load_tokenizer_for(*f.model, repo_path("models/stories260K/tok512.bin"));
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  if (!t.is_ok()) return f;
  f.tok = std::move(*t);
  auto b = cpu::create_cpu_backend();
  EXPECT_TRUE(b.is_ok());
  f.backend = std::shared_ptr<Backend>(std::move(*b));
  auto ids = encode_corpus(*f.tok, read_text_file(repo_path("data/tinystories_sample.txt")));
  EXPECT_TRUE(ids.is_ok()) << ids.status().to_string();
  if (ids.is_ok()) f.corpus = std::move(*ids);
  return f;
}

TEST(Distill, CorpusAndChunks) {
  Fixture f = load();
  ASSERT_TRUE(f.tok);
  const std::string text = read_text_file(repo_path("data/tinystories_sample.txt"));
  size_t stories = 0;
  for (size_t p = text.find("<|endoftext|>"); p != std::string::npos; p = text.find("<|endoftext|>", p + 1))
    ++stories;
  int64_t bos = 0;
  for (TokenId t : f.corpus) bos += t == f.tok->bos_id();
  EXPECT_GE(
      bos, static_cast<int64_t>(stories));  // one BOS per story (a trailing story may follow the last marker)
  EXPECT_LE(bos, static_cast<int64_t>(stories) + 1);
  EXPECT_EQ(f.corpus.front(), f.tok->bos_id());

  std::vector<TokenId> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<TokenId>(i);
  auto chunks = split_chunks(ids, 32, 8);
  ASSERT_EQ(chunks.size(), 3u);  // 32, 32, 32; the trailing 4 tokens are dropped
  EXPECT_EQ(chunks[2].front(), 64);
  EXPECT_EQ(split_chunks(ids, 32, 4).size(), 4u);
}

TEST(Distill, TeacherRowsAreDistributions) {
  Fixture f = load();
  ASSERT_TRUE(f.model && f.backend);
  std::vector<std::vector<TokenId>> chunks = {std::vector<TokenId>(f.corpus.begin(), f.corpus.begin() + 40)};
  auto r = collect_teacher(f.model, f.backend, chunks);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 1u);
  const DistillChunk& ch = (*r)[0];
  const ModelConfig& c = f.model->config;
  EXPECT_EQ(static_cast<int64_t>(ch.fused.size()), 40 * 3 * c.dim);
  ASSERT_EQ(static_cast<int64_t>(ch.teacher.size()), c.n_kv_heads * 40 * 41 / 2);
  for (int64_t g = 0; g < c.n_kv_heads; ++g) {
    for (int64_t t = 0; t < 40; ++t) {
      const float* row = ch.teacher.data() + g * 40 * 41 / 2 + t * (t + 1) / 2;
      double sum = 0;
      for (int64_t j = 0; j <= t; ++j) {
        ASSERT_GE(row[j], 0.0f);
        sum += row[j];
      }
      ASSERT_NEAR(sum, 1.0, 1e-4) << "kv head " << g << " position " << t;
    }
  }
  // Fused slot 0 of row 0 is the residual entering layer 2, not the raw embedding.
  const float* emb = static_cast<const float*>(f.model->tok_embeddings.data);
  double diff = 0;
  for (int64_t i = 0; i < c.dim; ++i)
    diff += std::abs(ch.fused[static_cast<size_t>(i)] - emb[chunks[0][0] * c.dim + i]);
  EXPECT_GT(diff, 1e-3);
}

// The analytic gradient (through the softmax, the dot products and RoPE with YaRN's mscale)
// against central finite differences on a small random problem.
TEST(Distill, GradientMatchesFiniteDifferences) {
  ModelConfig c;
  c.dim = 8;
  c.hidden_dim = 16;
  c.n_layers = 4;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.vocab_size = 10;
  auto hr = make_random_head(c, 9);
  ASSERT_TRUE(hr.is_ok());
  RetrievalHead& head = **hr;
  head.config.trained_context = 4;  // so that YaRN (mscale > 1) is in play
  const RopeParams rope = make_head_rope_params(head.config, 12);
  ASSERT_GT(rope.mscale, 1.0f);
  const int64_t n = 12, d2 = 16, qd = 16, kvd = 8;
  DistillChunk ch;
  ch.tokens.assign(static_cast<size_t>(n), 0);
  ch.teacher.resize(static_cast<size_t>(2 * n * (n + 1) / 2));
  uint32_t s = 12345;
  auto next = [&s]() {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>((s >> 8) & 0xffff) / 65536.0f;
  };
  for (int64_t g = 0; g < 2; ++g) {
    for (int64_t t = 0; t < n; ++t) {
      float* row = ch.teacher.data() + g * n * (n + 1) / 2 + t * (t + 1) / 2;
      float sum = 0;
      for (int64_t j = 0; j <= t; ++j) sum += row[j] = 0.05f + next();
      for (int64_t j = 0; j <= t; ++j) row[j] /= sum;
    }
  }
  std::vector<float> x(static_cast<size_t>(n * d2));
  for (float& v : x) v = 2.0f * next() - 1.0f;
  const std::vector<int64_t> positions = {1, 4, 7, 11};
  std::vector<float> gq(static_cast<size_t>(qd * d2)), gk(static_cast<size_t>(kvd * d2)), sq(gq), sk(gk);
  const double loss = distill_loss_grad(head, rope, ch, x.data(), positions, gq.data(), gk.data());
  EXPECT_GT(loss, 0.0);
  auto check = [&](const WeightMatrix& w, const std::vector<float>& grad, const char* what) {
    float* data = const_cast<float*>(static_cast<const float*>(w.data));
    for (int64_t i = 0; i < w.rows * w.cols; i += 7) {
      const float keep = data[i];
      const float eps = 1e-2f;
      data[i] = keep + eps;
      const double up = distill_loss_grad(head, rope, ch, x.data(), positions, sq.data(), sk.data());
      data[i] = keep - eps;
      const double down = distill_loss_grad(head, rope, ch, x.data(), positions, sq.data(), sk.data());
      data[i] = keep;
      const double numeric = (up - down) / (2.0 * eps);
      ASSERT_NEAR(grad[static_cast<size_t>(i)], numeric, 2e-4 + 0.03 * std::abs(numeric))
          << what << " entry " << i;
    }
  };
  check(head.wq, gq, "wq");
  check(head.wk, gk, "wk");
}

TEST(Distill, TrainingLowersHeldOutKl) {
  Fixture f = load();
  ASSERT_TRUE(f.model && f.backend);
  const size_t cut = f.corpus.size() - f.corpus.size() / 5;
  std::vector<TokenId> train(f.corpus.begin(), f.corpus.begin() + static_cast<std::ptrdiff_t>(cut));
  std::vector<TokenId> held(f.corpus.begin() + static_cast<std::ptrdiff_t>(cut), f.corpus.end());
#if defined(__SANITIZE_ADDRESS__)
  train.resize(std::min<size_t>(train.size(), 2 * kContext));
  held.resize(std::min<size_t>(held.size(), kContext));
#endif
  DistillOptions o;
  o.steps = kSteps;
  o.lr = 1e-2;
  o.context = kContext;
  o.batch_positions = 64;
  o.budgets = {16, 32};
  int64_t reports = 0;
  o.log_every = 10;
  o.on_step = [&](int64_t, double kl) {
    EXPECT_TRUE(std::isfinite(kl));
    ++reports;
  };
  auto r = distill_retrieval_head(f.model, f.backend, split_chunks(train, kContext, 8),
                                  split_chunks(held, kContext, 8), o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const DistillReport& rep = *r;
  std::printf("held-out KL %.4f -> %.4f, train KL %.4f -> %.4f (%lld steps, context %lld)\n", rep.before.kl,
              rep.after.kl, rep.train_kl_before, rep.train_kl_after, static_cast<long long>(kSteps),
              static_cast<long long>(kContext));
  EXPECT_EQ(reports, kSteps / 10);
  EXPECT_GT(rep.before.positions, 0);
  EXPECT_EQ(rep.before.positions, rep.after.positions);
  EXPECT_GT(rep.before.kl, 0.0);
  EXPECT_LT(rep.after.kl, 0.8 * rep.before.kl) << "before " << rep.before.kl << " after " << rep.after.kl;
  EXPECT_LT(rep.train_kl_after, rep.train_kl_before);
  ASSERT_EQ(rep.after.recall.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const BudgetRecall& a = rep.after.recall[i];
    EXPECT_GT(a.positions, 0);
    EXPECT_GT(a.head, rep.before.recall[i].head);
    EXPECT_LE(a.head, a.oracle + 1e-9);  // nothing beats the teacher's own top-B
    EXPECT_LE(a.streaming, a.oracle + 1e-9);
  }
  EXPECT_EQ(rep.head->config.trained_context, rep.context);
  // fc and the norms are frozen at their initial values.
  const float* fc = static_cast<const float*>(rep.head->fc.data);
  EXPECT_FLOAT_EQ(fc[0], 1.0f / 3.0f);
  EXPECT_FLOAT_EQ(fc[1], 0.0f);
  EXPECT_EQ(rep.head->input_norm, std::vector<float>(static_cast<size_t>(f.model->config.dim), 1.0f));

  // The written head loads back and scores the held-out text identically.
  const std::string path = testing::temp_dir("spx-distill") + "/head.safetensors";
  ASSERT_TRUE(write_retrieval_head(path, *rep.head).is_ok());
  auto loaded = load_eagle3_head(path, f.model->config);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ((*loaded)->config.trained_context, rep.context);
  EXPECT_EQ((*loaded)->draft_parameters, rep.head->draft_parameters);
  auto held_chunks = collect_teacher(f.model, f.backend, split_chunks(held, kContext, 8));
  ASSERT_TRUE(held_chunks.is_ok());
  auto again = evaluate_head(*f.backend, *f.model, **loaded, *held_chunks, std::vector<int64_t>{16});
  ASSERT_TRUE(again.is_ok());
  EXPECT_NEAR(again->kl, rep.after.kl, 1e-6);
}

}  // namespace
}  // namespace specontext
