// Retrieval-head distillation on the bundled stories260K: corpus handling and the held-out split,
// teacher capture (the layer mean of each GQA group's max attention), the head's forward against
// the engine's, finite-difference gradients of every parameter group, and short training runs
// that must lower the held-out KL, more when every group trains than with wq/wk alone (kept
// small: CI also runs under ASan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/model/safetensors.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "research/distill.h"
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

  // With a BOS (here id 0, the first token), every chunk starts with it: 32, then 1 + 31 each.
  auto led = split_chunks(ids, 32, 4, /*bos=*/0);
  ASSERT_EQ(led.size(), 4u);  // 0..31, 0+32..62, 0+63..93, 0+94..99
  EXPECT_EQ(led[0], std::vector<TokenId>(ids.begin(), ids.begin() + 32));
  for (size_t i = 1; i < led.size(); ++i) EXPECT_EQ(led[i].front(), 0);
  EXPECT_EQ(led[1][1], 32);
  EXPECT_EQ(led[1].size(), 32u);
  EXPECT_EQ(led[3].back(), 99);
  EXPECT_EQ(led[3].size(), 7u);
}

// The default held-out set is whole stories from the end of the corpus, at least 20% of the
// tokens, and a byte suffix of the file that encodes to exactly those tokens (what `specontext
// eval --text` reads); the training tokens are the rest.
TEST(Distill, HeldOutSplitIsTheLastWholeStories) {
  Fixture f = load();
  ASSERT_TRUE(f.tok);
  const std::string text = read_text_file(repo_path("data/tinystories_sample.txt"));
  auto stories = encode_corpus_stories(*f.tok, text);
  ASSERT_TRUE(stories.is_ok()) << stories.status().to_string();
  ASSERT_GE(stories->size(), 3u);
  const CorpusSplit sp = split_heldout_stories(*stories, 0.2);
  EXPECT_EQ(sp.train.size() + sp.heldout.size(), f.corpus.size());
  EXPECT_GE(5 * sp.heldout.size(), f.corpus.size());
  // The fewest stories: without the first held-out story, less than 20% would be held out.
  const size_t first_held = static_cast<size_t>(sp.train_stories);
  EXPECT_LT(5 * (sp.heldout.size() - (*stories)[first_held].tokens.size()), f.corpus.size());
  EXPECT_TRUE(std::equal(sp.train.begin(), sp.train.end(), f.corpus.begin()));
  ASSERT_NE(sp.heldout_byte, std::string_view::npos);
  auto suffix = encode_corpus(*f.tok, std::string_view(text).substr(sp.heldout_byte));
  ASSERT_TRUE(suffix.is_ok());
  EXPECT_EQ(*suffix, sp.heldout);
  auto prefix = encode_corpus(*f.tok, std::string_view(text).substr(0, sp.heldout_byte));
  ASSERT_TRUE(prefix.is_ok());
  EXPECT_EQ(*prefix, sp.train);

  // One story (no separator): a token cut at 80%.
  const CorpusStory one{0, f.corpus};
  const CorpusSplit cut = split_heldout_stories(std::span<const CorpusStory>(&one, 1), 0.2);
  EXPECT_EQ(cut.heldout_byte, std::string_view::npos);
  EXPECT_EQ(cut.heldout.size(), (f.corpus.size() + 4) / 5);
  EXPECT_EQ(cut.train.size() + cut.heldout.size(), f.corpus.size());
}

TEST(Distill, TrainGroupsParse) {
  auto all = parse_distill_train("fc,norms,qk");
  ASSERT_TRUE(all.is_ok());
  EXPECT_TRUE(all->fc && all->norms && all->qk);
  auto qk = parse_distill_train("qk");
  ASSERT_TRUE(qk.is_ok());
  EXPECT_FALSE(qk->fc || qk->norms);
  EXPECT_TRUE(qk->qk);
  EXPECT_EQ(distill_train_names(*qk), "qk");
  EXPECT_EQ(distill_train_names(*all), "fc,norms,qk");
  EXPECT_FALSE(parse_distill_train("fc,v").is_ok());
  EXPECT_FALSE(parse_distill_train("").is_ok());
  EXPECT_EQ(*parse_position_weight("uniform"), PositionWeight::kUniform);
  EXPECT_EQ(*parse_position_weight("far"), PositionWeight::kFar);
  EXPECT_FALSE(parse_position_weight("near").is_ok());
  EXPECT_EQ(DistillObjective{}.position_weight, PositionWeight::kUniform);
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

// Every layer's attention per query head, in double precision, straight from the observer's q
// and KV views: the reference the teacher's reduction is checked against.
class AllHeadsObserver final : public ForwardObserver {
 public:
  explicit AllHeadsObserver(const ModelConfig& c) : c_(c) {}
  void on_attention(LayerId, const float* q, std::span<const AttentionItem> items) override {
    const int64_t n = items[0].n_tokens, hd = c_.head_dim, group = c_.n_heads / c_.n_kv_heads;
    std::vector<double> layer(static_cast<size_t>(c_.n_heads * n * n), 0.0);
    std::vector<float> buf(static_cast<size_t>(hd));
    for (int64_t h = 0; h < c_.n_heads; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        std::vector<double> logits(static_cast<size_t>(t + 1));
        double mx = -INFINITY, z = 0.0;
        for (int64_t j = 0; j <= t; ++j) {
          const float* k = kv_row_f32(items[0].kv, false, h / group, j, buf.data());
          double dotp = 0.0;
          for (int64_t i = 0; i < hd; ++i) dotp += double(q[(t * c_.n_heads + h) * hd + i]) * k[i];
          logits[static_cast<size_t>(j)] = dotp / std::sqrt(double(hd));
          mx = std::max(mx, logits[static_cast<size_t>(j)]);
        }
        for (double& v : logits) z += v = std::exp(v - mx);
        for (int64_t j = 0; j <= t; ++j) layer[static_cast<size_t>((h * n + t) * n + j)] = logits[static_cast<size_t>(j)] / z;
      }
    }
    layers.push_back(std::move(layer));
  }
  std::vector<std::vector<double>> layers;  // [layer][head][t][j]

 private:
  const ModelConfig& c_;
};

// The teacher is, per KV head, the layer mean of the max over the group's query heads (the
// reduction select_tokens applies), renormalised; not the group mean, which kGroupMean gives.
TEST(Distill, TeacherIsTheLayerMeanOfTheGroupMax) {
  Fixture f = load();
  ASSERT_TRUE(f.model && f.backend);
  const ModelConfig& c = f.model->config;
  const int64_t n = 48, group = c.n_heads / c.n_kv_heads;
  ASSERT_GT(group, 1);
  std::vector<TokenId> tokens(f.corpus.begin(), f.corpus.begin() + n);
  auto r = collect_teacher(f.model, f.backend, {tokens});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const DistillChunk& ch = (*r)[0];
  auto rm = collect_teacher(f.model, f.backend, {tokens}, TeacherReduction::kGroupMean);
  ASSERT_TRUE(rm.is_ok()) << rm.status().to_string();
  const DistillChunk& ch_mean = (*rm)[0];

  EngineOptions eo;
  eo.max_sequences = 1;
  eo.max_context = n;
  auto engine = Engine::create(f.model, f.backend, eo);
  ASSERT_TRUE(engine.is_ok());
  AllHeadsObserver obs(c);
  (*engine)->set_observer(&obs);
  auto seq = (*engine)->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  StepRequest req{*seq, std::span<const TokenId>(tokens), LogitsMode::kNone};
  ASSERT_TRUE((*engine)->forward(std::span<const StepRequest>(&req, 1)).is_ok());
  ASSERT_EQ(static_cast<int64_t>(obs.layers.size()), c.n_layers);

  double max_err = 0.0, mean_vs_max = 0.0, mean_err = 0.0;
  for (int64_t g = 0; g < c.n_kv_heads; ++g) {
    for (int64_t t = 1; t < n; ++t) {
      std::vector<double> want(static_cast<size_t>(t + 1), 0.0), mean(want);
      for (const auto& layer : obs.layers) {
        for (int64_t j = 0; j <= t; ++j) {
          double m = 0.0;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const double a = layer[static_cast<size_t>((h * n + t) * n + j)];
            m = std::max(m, a);
            mean[static_cast<size_t>(j)] += a;
          }
          want[static_cast<size_t>(j)] += m;
        }
      }
      double sum = 0.0, msum = 0.0;
      for (int64_t j = 0; j <= t; ++j) sum += want[static_cast<size_t>(j)], msum += mean[static_cast<size_t>(j)];
      const float* row = ch.teacher.data() + g * n * (n + 1) / 2 + t * (t + 1) / 2;
      for (int64_t j = 0; j <= t; ++j) {
        max_err = std::max(max_err, std::abs(row[j] - want[static_cast<size_t>(j)] / sum));
        mean_vs_max = std::max(mean_vs_max, std::abs(row[j] - mean[static_cast<size_t>(j)] / msum));
        const float* mrow = ch_mean.teacher.data() + g * n * (n + 1) / 2 + t * (t + 1) / 2;
        mean_err = std::max(mean_err, std::abs(mrow[j] - mean[static_cast<size_t>(j)] / msum));
      }
    }
  }
  EXPECT_LT(max_err, 1e-5);
  EXPECT_GT(mean_vs_max, 1e-2);  // the group mean is a different target here
  EXPECT_LT(mean_err, 1e-5);  // TeacherReduction::kGroupMean: the old teacher
}

// A small random head whose fc and norms are far from their initial values, so that every
// term of the backward pass is exercised.
std::shared_ptr<RetrievalHead> perturbed_head(const ModelConfig& c, uint64_t seed) {
  auto hr = make_random_head(c, seed);
  EXPECT_TRUE(hr.is_ok());
  std::shared_ptr<RetrievalHead> head = *hr;
  uint32_t s = static_cast<uint32_t>(seed) * 2654435761u + 7u;
  auto next = [&s]() {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>((s >> 8) & 0xffff) / 65536.0f - 0.5f;
  };
  float* fc = const_cast<float*>(static_cast<const float*>(head->fc.data));
  for (int64_t i = 0; i < head->fc.rows * head->fc.cols; ++i) fc[i] += 0.4f * next();
  for (float& w : head->input_norm) w = 1.0f + next();
  for (float& w : head->hidden_norm) w = 1.0f + next();
  return head;
}

// The forward that training differentiates equals the engine's retrieval_qk: the loss over every
// position of a chunk is evaluate_head's KL on it.
TEST(Distill, TrainingForwardMatchesTheEngineHead) {
  Fixture f = load();
  ASSERT_TRUE(f.model && f.backend);
  const int64_t n = 96;
  auto r = collect_teacher(f.model, f.backend, {std::vector<TokenId>(f.corpus.begin(), f.corpus.begin() + n)});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::shared_ptr<RetrievalHead> head = perturbed_head(f.model->config, 3);
  head->config.trained_context = n;
  auto in = head_inputs(*f.backend, *f.model, (*r)[0]);
  ASSERT_TRUE(in.is_ok()) << in.status().to_string();
  std::vector<int64_t> all(static_cast<size_t>(n - 1));
  for (int64_t t = 1; t < n; ++t) all[static_cast<size_t>(t - 1)] = t;
  const double loss = distill_loss_grad(*head, make_head_rope_params(head->config, n), (*r)[0], *in, all, nullptr);
  auto fid = evaluate_head(*f.backend, *f.model, *head, *r, {});
  ASSERT_TRUE(fid.is_ok());
  EXPECT_GT(loss, 0.1);
  EXPECT_NEAR(loss, fid->kl, 1e-4 * fid->kl);
  // The group-max objective over every key is evaluate_head's kl_group, and differs from the
  // per-head KL (the group's two query heads differ).
  DistillObjective group_max;
  group_max.group_loss = GroupLoss::kGroupMax;
  const double gloss =
      distill_loss_grad(*head, make_head_rope_params(head->config, n), (*r)[0], *in, all, nullptr, group_max);
  EXPECT_GT(gloss, 0.01);
  EXPECT_NEAR(gloss, fid->kl_group, 1e-4 * fid->kl_group);
  EXPECT_GT(std::abs(gloss - loss), 1e-3);
  // The mix is the two, weighted.
  DistillObjective mix;
  mix.group_loss = GroupLoss::kMix;
  mix.group_mix = 0.3;
  const double mloss = distill_loss_grad(*head, make_head_rope_params(head->config, n), (*r)[0], *in, all, nullptr, mix);
  EXPECT_NEAR(mloss, 0.7 * fid->kl + 0.3 * fid->kl_group, 1e-4 * mloss);
}

// A small random problem for the loss: a perturbed head of a 4-head (or q_heads), 2-KV-head
// config with YaRN in play, a 12-token chunk with random teacher rows and random inputs.
struct SyntheticProblem {
  std::shared_ptr<RetrievalHead> head;
  RopeParams rope;
  DistillChunk ch;
  HeadInputs in;
  static constexpr int64_t n = 12, d = 8;
};

SyntheticProblem synthetic_problem(int64_t q_heads = 4) {
  ModelConfig c;
  c.dim = 8;
  c.hidden_dim = 16;
  c.n_layers = 4;
  c.n_heads = q_heads;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.vocab_size = 10;
  c.norm_eps = 1e-5f;
  SyntheticProblem p;
  p.head = perturbed_head(c, 9);
  p.head->config.trained_context = 4;  // so that YaRN (mscale > 1) is in play
  p.rope = make_head_rope_params(p.head->config, 12);
  const int64_t n = SyntheticProblem::n, d = SyntheticProblem::d;
  DistillChunk& ch = p.ch;
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
  HeadInputs& in = p.in;
  in.embed.resize(static_cast<size_t>(n * d));
  in.fused_prev.assign(static_cast<size_t>(n * 3 * d), 0.0f);  // row 0: zeros, as for position 0
  for (float& v : in.embed) v = 2.0f * next() - 1.0f;
  for (size_t i = 3 * d; i < in.fused_prev.size(); ++i) in.fused_prev[i] = 4.0f * next() - 2.0f;
  return p;
}

// The analytic gradient of every parameter group (through the softmax, the dot products, RoPE
// with YaRN's mscale, the projections, both RMSNorms with their weights and fc) against central
// finite differences on a small random problem: per entry, and as the relative L2 error of the
// group's sampled entries; then for the masked objective, with uniform and far position weighting.
TEST(Distill, GradientMatchesFiniteDifferences) {
  SyntheticProblem p = synthetic_problem();
  std::shared_ptr<RetrievalHead> head = p.head;
  const RopeParams& rope = p.rope;
  ASSERT_GT(rope.mscale, 1.0f);
  const int64_t d = SyntheticProblem::d;
  const DistillChunk& ch = p.ch;
  const HeadInputs& in = p.in;
  const std::vector<int64_t> positions = {1, 4, 7, 11};
  HeadGradients grads;
  const double loss = distill_loss_grad(*head, rope, ch, in, positions, &grads);
  EXPECT_GT(loss, 0.0);
  auto check = [&](float* data, size_t size, const std::vector<float>& grad, size_t stride, const char* what) {
    ASSERT_EQ(grad.size(), size) << what;
    double diff2 = 0.0, ref2 = 0.0;
    int64_t checked = 0;
    for (size_t i = 0; i < size; i += stride) {
      const float keep = data[i];
      const float eps = 1e-2f;
      data[i] = keep + eps;
      const double up = distill_loss_grad(*head, rope, ch, in, positions, nullptr);
      data[i] = keep - eps;
      const double down = distill_loss_grad(*head, rope, ch, in, positions, nullptr);
      data[i] = keep;
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(grad[i], numeric, 2e-4 + 0.03 * std::abs(numeric)) << what << " entry " << i;
      diff2 += (grad[i] - numeric) * (grad[i] - numeric);
      ref2 += numeric * numeric;
      ++checked;
    }
    EXPECT_GT(ref2, 0.0) << what << ": the loss does not depend on it";
    EXPECT_LT(std::sqrt(diff2 / ref2), 1e-2) << what << " (" << checked << " entries)";
  };
  auto mat = [](const WeightMatrix& w) { return const_cast<float*>(static_cast<const float*>(w.data)); };
  check(mat(head->fc), static_cast<size_t>(d * 3 * d), grads.fc, 5, "fc");
  check(head->input_norm.data(), static_cast<size_t>(d), grads.input_norm, 1, "input_layernorm");
  check(head->hidden_norm.data(), static_cast<size_t>(d), grads.hidden_norm, 1, "hidden_norm");
  check(mat(head->wq), static_cast<size_t>(head->wq.rows * head->wq.cols), grads.wq, 7, "wq");
  check(mat(head->wk), static_cast<size_t>(head->wk.rows * head->wk.cols), grads.wk, 7, "wk");

  // The loss restricted to keys [1, t+1−2): the teacher and the head renormalised there.
  DistillObjective skip{1, 2};
  const double masked = distill_loss_grad(*head, rope, ch, in, positions, &grads, skip);
  EXPECT_GT(masked, 0.0);
  EXPECT_NE(masked, loss);
  auto check_masked = [&](float* data, size_t size, const std::vector<float>& grad, size_t stride, const char* what) {
    for (size_t i = 0; i < size; i += stride) {
      const float keep = data[i];
      const float eps = 1e-2f;
      data[i] = keep + eps;
      const double up = distill_loss_grad(*head, rope, ch, in, positions, nullptr, skip);
      data[i] = keep - eps;
      const double down = distill_loss_grad(*head, rope, ch, in, positions, nullptr, skip);
      data[i] = keep;
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(grad[i], numeric, 2e-4 + 0.03 * std::abs(numeric)) << what << " entry " << i << " (masked)";
    }
  };
  check_masked(mat(head->fc), static_cast<size_t>(d * 3 * d), grads.fc, 5, "fc");
  check_masked(head->hidden_norm.data(), static_cast<size_t>(d), grads.hidden_norm, 1, "hidden_norm");
  check_masked(mat(head->wq), static_cast<size_t>(head->wq.rows * head->wq.cols), grads.wq, 7, "wq");
  check_masked(mat(head->wk), static_cast<size_t>(head->wk.rows * head->wk.cols), grads.wk, 7, "wk");

  // The same with each position weighted by its ranked teacher mass + 0.1 (PositionWeight::kFar).
  skip.position_weight = PositionWeight::kFar;
  skip.weight_floor = 0.1;
  const double far = distill_loss_grad(*head, rope, ch, in, positions, &grads, skip);
  EXPECT_GT(far, 0.0);
  EXPECT_NE(far, masked);
  check_masked(mat(head->fc), static_cast<size_t>(d * 3 * d), grads.fc, 5, "fc (far)");
  check_masked(head->input_norm.data(), static_cast<size_t>(d), grads.input_norm, 1, "input_layernorm (far)");
  check_masked(head->hidden_norm.data(), static_cast<size_t>(d), grads.hidden_norm, 1, "hidden_norm (far)");
  check_masked(mat(head->wq), static_cast<size_t>(head->wq.rows * head->wq.cols), grads.wq, 7, "wq (far)");
  check_masked(mat(head->wk), static_cast<size_t>(head->wk.rows * head->wk.cols), grads.wk, 7, "wk (far)");
}

// The group-max objective (GroupLoss::kGroupMax) on a head with 4 query heads per KV head: its
// gradient against central differences for every group, over every key and masked with far
// weighting, and mixed with the per-head one (kMix); with one query head per KV head it is the
// per-head objective exactly.
TEST(Distill, GroupMaxGradientMatchesFiniteDifferences) {
  SyntheticProblem p = synthetic_problem(/*q_heads=*/8);
  std::shared_ptr<RetrievalHead> head = p.head;
  ASSERT_EQ(head->config.n_heads, 8);
  const int64_t d = SyntheticProblem::d;
  const std::vector<int64_t> positions = {1, 4, 7, 11};
  auto mat = [](const WeightMatrix& w) { return const_cast<float*>(static_cast<const float*>(w.data)); };
  DistillObjective whole;
  whole.group_loss = GroupLoss::kGroupMax;
  DistillObjective masked{1, 2, PositionWeight::kFar, 0.1, GroupLoss::kGroupMax};
  DistillObjective mixed{1, 2, PositionWeight::kFar, 0.1, GroupLoss::kMix, 0.3};
  for (const DistillObjective& o : {whole, masked, mixed}) {
    HeadGradients grads;
    const double loss = distill_loss_grad(*head, p.rope, p.ch, p.in, positions, &grads, o);
    EXPECT_GT(loss, 0.0);
    auto check = [&](float* data, size_t size, const std::vector<float>& grad, size_t stride, const char* what) {
      ASSERT_EQ(grad.size(), size) << what;
      double diff2 = 0.0, ref2 = 0.0;
      for (size_t i = 0; i < size; i += stride) {
        const float keep = data[i];
        const float eps = 1e-3f;
        data[i] = keep + eps;
        const double up = distill_loss_grad(*head, p.rope, p.ch, p.in, positions, nullptr, o);
        data[i] = keep - eps;
        const double down = distill_loss_grad(*head, p.rope, p.ch, p.in, positions, nullptr, o);
        data[i] = keep;
        const double numeric = (up - down) / (2.0 * eps);
        EXPECT_NEAR(grad[i], numeric, 5e-4 + 0.05 * std::abs(numeric)) << what << " entry " << i;
        diff2 += (grad[i] - numeric) * (grad[i] - numeric);
        ref2 += numeric * numeric;
      }
      EXPECT_GT(ref2, 0.0) << what << ": the loss does not depend on it";
      EXPECT_LT(std::sqrt(diff2 / ref2), 2e-2) << what;
    };
    check(mat(head->fc), static_cast<size_t>(d * 3 * d), grads.fc, 5, "fc");
    check(head->input_norm.data(), static_cast<size_t>(d), grads.input_norm, 1, "input_layernorm");
    check(head->hidden_norm.data(), static_cast<size_t>(d), grads.hidden_norm, 1, "hidden_norm");
    check(mat(head->wq), static_cast<size_t>(head->wq.rows * head->wq.cols), grads.wq, 3, "wq");
    check(mat(head->wk), static_cast<size_t>(head->wk.rows * head->wk.cols), grads.wk, 3, "wk");
  }

  SyntheticProblem one = synthetic_problem(/*q_heads=*/2);
  DistillObjective each{1, 2, PositionWeight::kFar, 0.1};
  HeadGradients ga, gb;
  const double l_each = distill_loss_grad(*one.head, one.rope, one.ch, one.in, positions, &ga, each);
  const double l_max = distill_loss_grad(*one.head, one.rope, one.ch, one.in, positions, &gb, masked);
  EXPECT_NEAR(l_max, l_each, 1e-9 * l_each);
  for (size_t i = 0; i < ga.wq.size(); ++i) EXPECT_NEAR(gb.wq[i], ga.wq[i], 1e-5 + 1e-4 * std::abs(ga.wq[i]));
}

bool same_gradients(const HeadGradients& a, const HeadGradients& b) {
  return a.fc == b.fc && a.input_norm == b.input_norm && a.hidden_norm == b.hidden_norm && a.wq == b.wq &&
         a.wk == b.wk;
}

// Position weighting. Uniform (the default) ignores weight_floor: the same loss and gradients,
// bit for bit. Far: a position whose teacher mass lies all in the kept sink and window adds
// nothing to the loss or the gradient (uniform weighting still counts it in the mean), one with
// almost none there almost nothing, and a floor much larger than any mass gives the uniform mean.
TEST(Distill, FarPositionWeightingFollowsTheRankedTeacherMass) {
  SyntheticProblem p = synthetic_problem();
  const RetrievalHead& head = *p.head;
  const int64_t n = SyntheticProblem::n;
  auto row = [&p](int64_t g, int64_t t) {
    return p.ch.teacher.data() + g * n * (n + 1) / 2 + t * (t + 1) / 2;
  };
  const DistillObjective uniform{1, 2};  // ranked keys of row t: [1, t−1)
  DistillObjective uniform_floor = uniform;
  uniform_floor.weight_floor = 0.7;
  DistillObjective far = uniform;
  far.position_weight = PositionWeight::kFar;
  far.weight_floor = 0.0;
  auto loss = [&](std::vector<int64_t> positions, const DistillObjective& o, HeadGradients* g = nullptr) {
    return distill_loss_grad(head, p.rope, p.ch, p.in, positions, g, o);
  };

  HeadGradients ga, gb;
  const std::vector<int64_t> all = {1, 4, 7, 11};
  EXPECT_EQ(loss(all, uniform, &ga), loss(all, uniform_floor, &gb));
  EXPECT_TRUE(same_gradients(ga, gb));
  EXPECT_EQ(loss(all, DistillObjective{1, 2}),
            loss(all, DistillObjective{1, 2, PositionWeight::kUniform, 0.1}));

  // A floor far above every mass: the weights are all but equal, the uniform mean over
  // positions that have ranked keys (t ≥ 3 here).
  DistillObjective flat = far;
  flat.weight_floor = 1e6;
  EXPECT_NEAR(loss({4, 7, 11}, flat), loss({4, 7, 11}, uniform), 1e-5 * loss({4, 7, 11}, uniform));

  // Row 7: half the mass on the sink (key 0), the rest on the window (keys 6, 7).
  for (int64_t g = 0; g < 2; ++g) {
    float* r = row(g, 7);
    std::fill(r, r + 8, 0.0f);
    r[0] = 0.5f;
    r[6] = r[7] = 0.25f;
  }
  EXPECT_EQ(loss({7, 11}, far, &ga), loss({11}, far, &gb));
  EXPECT_TRUE(same_gradients(ga, gb));
  EXPECT_GT(loss({11}, far), 0.0);
  // Uniform weighting still counts row 7 (with no loss) in the mean: half of row 11's.
  EXPECT_NEAR(loss({7, 11}, uniform), 0.5 * loss({11}, uniform), 1e-9);

  // Row 4: a millionth of its mass on the ranked keys 1, 2 (unevenly: a KL the head pays for
  // under uniform weighting), the rest on the sink and the window.
  for (int64_t g = 0; g < 2; ++g) {
    float* r = row(g, 4);
    r[0] = 0.5f;
    r[1] = 0.9e-6f;
    r[2] = 0.1e-6f;
    r[3] = r[4] = 0.25f - 0.5e-6f;
  }
  const double only_11 = loss({11}, far);
  EXPECT_NEAR(loss({4, 11}, far), only_11, 1e-4 * only_11);
  EXPECT_GT(std::abs(loss({4, 11}, uniform) - 0.5 * loss({11}, uniform)), 1e-3);

  // The floor makes such positions count again, as much as any other.
  DistillObjective floored = far;
  floored.weight_floor = 0.1;
  EXPECT_GT(std::abs(loss({4, 11}, floored) - loss({11}, floored)), 1e-4);
}

// Two short distillations of stories260K on the same data, seeds and steps: every parameter
// group, and wq/wk alone (the old procedure). Run once for the tests below.
class DistillRuns : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fixture_ = new Fixture(load());
    Fixture& f = *fixture_;
    if (!f.model || !f.backend) return;
    const size_t cut = f.corpus.size() - f.corpus.size() / 5;
    train_.assign(f.corpus.begin(), f.corpus.begin() + static_cast<std::ptrdiff_t>(cut));
    held_.assign(f.corpus.begin() + static_cast<std::ptrdiff_t>(cut), f.corpus.end());
#if defined(__SANITIZE_ADDRESS__)
    train_.resize(std::min<size_t>(train_.size(), 2 * kContext));
    held_.resize(std::min<size_t>(held_.size(), kContext));
#endif
    all_ = run(DistillTrain{}, &all_reports_);
    qk_ = run(DistillTrain{false, false, true}, nullptr);
    wide_ = run(DistillTrain{}, nullptr, /*q_per_group=*/4, GroupLoss::kGroupMax);
  }
  static void TearDownTestSuite() {
    delete all_;
    delete qk_;
    delete wide_;
    delete fixture_;
    all_ = qk_ = wide_ = nullptr;
    fixture_ = nullptr;
  }
  void SetUp() override {
    if (all_ == nullptr || qk_ == nullptr || wide_ == nullptr) GTEST_SKIP() << "suite set-up failed";
  }

  static DistillReport* run(const DistillTrain& groups, int64_t* reports, int64_t q_per_group = 0,
                            GroupLoss group_loss = GroupLoss::kEach) {
    DistillOptions o;
    o.q_per_group = q_per_group;
    o.objective.group_loss = group_loss;
    o.steps = kSteps;
    o.lr = 1e-2;
    o.context = kContext;
    o.batch_positions = 64;
    o.budgets = {16, 32};
    o.train = groups;
    o.log_every = 10;
    o.on_step = [reports](int64_t, double kl) {
      EXPECT_TRUE(std::isfinite(kl));
      if (reports) ++*reports;
    };
    auto r = distill_retrieval_head(fixture_->model, fixture_->backend, split_chunks(train_, kContext, 8),
                                    split_chunks(held_, kContext, 8), o);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    if (!r.is_ok()) return nullptr;
    std::printf("train %s: held-out KL %.4f -> %.4f, train KL %.4f -> %.4f (%lld steps, context %lld)\n",
                distill_train_names(groups).c_str(), r->before.kl, r->after.kl, r->train_kl_before,
                r->train_kl_after, static_cast<long long>(kSteps), static_cast<long long>(kContext));
    return new DistillReport(std::move(*r));
  }

  static inline Fixture* fixture_ = nullptr;
  static inline std::vector<TokenId> train_, held_;
  static inline DistillReport* all_ = nullptr;
  static inline DistillReport* qk_ = nullptr;
  static inline DistillReport* wide_ = nullptr;  // 4 query heads per KV head, group-max objective
  static inline int64_t all_reports_ = 0;
};

TEST_F(DistillRuns, TrainingLowersHeldOutKl) {
  const DistillReport& rep = *all_;
  EXPECT_EQ(all_reports_, kSteps / 10);
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
}

// Both runs start from the same head; the full run moves fc and both norms, the qk run keeps
// them at [I/3 I/3 I/3] and 1, and the full run ends with the lower held-out KL.
TEST_F(DistillRuns, EveryGroupLowersHeldOutKlMoreThanQkAlone) {
  EXPECT_DOUBLE_EQ(all_->before.kl, qk_->before.kl);
  const int64_t d = fixture_->model->config.dim;
  const std::vector<float> ones(static_cast<size_t>(d), 1.0f);
  const float* fc_qk = static_cast<const float*>(qk_->head->fc.data);
  EXPECT_FLOAT_EQ(fc_qk[0], 1.0f / 3.0f);
  EXPECT_FLOAT_EQ(fc_qk[1], 0.0f);
  EXPECT_EQ(qk_->head->input_norm, ones);
  EXPECT_EQ(qk_->head->hidden_norm, ones);
  const float* fc_all = static_cast<const float*>(all_->head->fc.data);
  double fc_moved = 0.0;
  for (int64_t i = 0; i < 3 * d * d; ++i) {
    const float init = (i % (3 * d)) % d == i / (3 * d) ? 1.0f / 3.0f : 0.0f;
    fc_moved = std::max<double>(fc_moved, std::abs(fc_all[i] - init));
  }
  EXPECT_GT(fc_moved, 1e-2);
  EXPECT_NE(all_->head->input_norm, ones);
  EXPECT_NE(all_->head->hidden_norm, ones);
  EXPECT_LT(all_->after.kl, qk_->after.kl) << "every group " << all_->after.kl << ", wq/wk only " << qk_->after.kl;
}

// A head with 4 query heads per KV head trained on the group-max objective fits the group max
// (what selection ranks by) better than the target-shaped head fitted head by head, and loads
// back with its own width.
TEST_F(DistillRuns, AWiderHeadOnTheGroupMaxFitsWhatSelectionRanks) {
  const ModelConfig& c = fixture_->model->config;
  EXPECT_EQ(wide_->head->config.n_heads, 4 * c.n_kv_heads);
  EXPECT_NE(wide_->head->config.n_heads, c.n_heads);
  EXPECT_LT(wide_->after.kl_group, 0.8 * wide_->before.kl_group);
#if !defined(__SANITIZE_ADDRESS__)
  // Four times the query heads need the release run's data (80% of the TinyStories sample in
  // 256-token chunks, 150 steps): on the sanitizer run's 128 training tokens the wide head
  // overfits (held-out group KL 0.55 against the target-shaped head's 0.48).
  EXPECT_LT(wide_->after.kl_group, all_->after.kl_group)
      << "wide group-max " << wide_->after.kl_group << ", target-shaped per-head " << all_->after.kl_group;
#endif
  const std::string path = testing::temp_dir("spx-distill-wide") + "/head.safetensors";
  ASSERT_TRUE(write_distilled_head(path, *wide_->head, {}).is_ok());
  auto loaded = load_eagle3_head(path, c);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ((*loaded)->config.n_heads, 4 * c.n_kv_heads);
  EXPECT_EQ((*loaded)->config.head_dim, c.head_dim);
}

// The written head loads back, scores the held-out text identically, and carries the extra
// metadata (the training text and split) next to its own.
TEST_F(DistillRuns, WrittenHeadLoadsBackWithItsSplitMetadata) {
  const DistillReport& rep = *all_;
  const std::string path = testing::temp_dir("spx-distill") + "/head.safetensors";
  const std::map<std::string, std::string> extra = {{"train_text", "tinystories_sample.txt"},
                                                     {"train_split", "tokens [0, 10) of 12"}};
  ASSERT_TRUE(write_distilled_head(path, *rep.head, extra).is_ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.is_ok());
  EXPECT_EQ((*file)->metadata().at("train_split"), "tokens [0, 10) of 12");
  EXPECT_EQ((*file)->metadata().at("format"), "specontext-retrieval-head");
  EXPECT_FALSE(write_distilled_head(path, *rep.head, {{"hidden", "3"}}).is_ok());  // the head's own key

  auto loaded = load_eagle3_head(path, fixture_->model->config);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  EXPECT_EQ((*loaded)->config.trained_context, rep.context);
  EXPECT_EQ((*loaded)->draft_parameters, rep.head->draft_parameters);
  EXPECT_EQ((*loaded)->hidden_norm, rep.head->hidden_norm);
  auto held_chunks = collect_teacher(fixture_->model, fixture_->backend, split_chunks(held_, kContext, 8));
  ASSERT_TRUE(held_chunks.is_ok());
  auto again = evaluate_head(*fixture_->backend, *fixture_->model, **loaded, *held_chunks, std::vector<int64_t>{16});
  ASSERT_TRUE(again.is_ok());
  EXPECT_NEAR(again->kl, rep.after.kl, 1e-6);
}

}  // namespace
}  // namespace specontext
