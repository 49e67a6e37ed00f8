// Tensor parallelism: W threads, each with its own single-threaded CPU backend, its shard of the
// model (and of the retrieval head) and its rank's ThreadCommunicator, run the same requests as
// one unsharded engine; logits must match it (rel L2 < 1e-5) at every step and be bit-identical
// across ranks. Sparse SpeContext decode: each rank's selection equals the full selection
// restricted to its KV heads. Also the shard layout (views, copies, lifetime), argument errors,
// and a rank failing or missing mid-forward (every rank returns an error, none hangs).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "core/engine/engine.h"
#include "core/engine/tensor_parallel.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "cpu/thread_communicator.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::repo_path;
using Clock = std::chrono::steady_clock;
using Tokens = std::vector<std::vector<TokenId>>;  // [step or prompt][sequence]

using testing::rel_l2;

std::shared_ptr<Backend> make_backend() {
  cpu::CpuBackendOptions o;
  o.num_threads = 1;
  auto b = cpu::create_cpu_backend(o);
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return b.is_ok() ? std::shared_ptr<Backend>(std::move(*b)) : nullptr;
}

// Records SpeContext's per-step selection (one per step, shared by all layers: layer 0's).
class SelectionRecorder : public ForwardObserver {
 public:
  void on_sparse_selection(LayerId layer, std::span<const AttentionItem> items,
                           std::span<const Selection* const> selections) override {
    if (layer.value() != 0) return;
    for (size_t i = 0; i < items.size(); ++i) recorded.push_back(*selections[i]);
  }
  std::vector<Selection> recorded;
};

struct RunOutput {
  Status status;
  std::vector<std::vector<std::vector<float>>> logits;  // [forward][sequence][vocab]
  Tokens fed;                                           // [decode step][sequence]
  std::vector<Selection> selections;
  int64_t sparse_steps = 0;
};

// One prefill forward holding every prompt, then `steps` decode forwards. The token fed at each
// decode step is forced[step] when given, else rank 0's argmax broadcast through `comm` (or the
// engine's own argmax without one).
void run_script(Engine& e, const Tokens& prompts, int steps, Communicator* comm, const Tokens* forced,
                RunOutput& out) {
  SelectionRecorder recorder;
  e.set_observer(&recorder);
  std::vector<SeqId> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto s = e.memory().add_sequence();
    if (!s.is_ok()) {
      out.status = s.status();
      return;
    }
    seqs.push_back(*s);
  }
  Tokens inputs = prompts;
  for (int step = 0; step <= steps; ++step) {
    std::vector<StepRequest> reqs;
    for (size_t i = 0; i < seqs.size(); ++i) reqs.push_back({seqs[i], inputs[i], LogitsMode::kLast});
    auto o = e.forward(reqs);
    if (!o.is_ok()) {
      out.status = o.status();
      return;
    }
    std::vector<std::vector<float>> rows;
    std::vector<float> next(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) {
      auto row = o->row(i);
      rows.emplace_back(row.begin(), row.end());
      next[i] = static_cast<float>(std::max_element(row.begin(), row.end()) - row.begin());
    }
    out.logits.push_back(std::move(rows));
    if (step == steps) break;
    std::vector<TokenId> feed(seqs.size());
    if (forced != nullptr) {
      feed = (*forced)[static_cast<size_t>(step)];
    } else {
      if (comm != nullptr) {
        // Broadcast from rank 0 as a sum: the others contribute zeros (token ids are exact floats).
        if (comm->rank() != 0) std::fill(next.begin(), next.end(), 0.0f);
        Status st = comm->all_reduce_sum(next.data(), static_cast<int64_t>(next.size()));
        if (!st.is_ok()) {
          out.status = st;
          return;
        }
      }
      for (size_t i = 0; i < seqs.size(); ++i) feed[i] = static_cast<TokenId>(next[i]);
    }
    out.fed.push_back(feed);
    for (size_t i = 0; i < seqs.size(); ++i) inputs[i] = {feed[i]};
  }
  out.sparse_steps = e.sparse_stats().sparse_steps;
  out.selections = std::move(recorder.recorded);
  e.set_observer(nullptr);
}

EngineOptions engine_options(const SparseOptions& sparse, std::shared_ptr<const RetrievalHead> head,
                             size_t n_seqs) {
  EngineOptions o;
  o.max_sequences = static_cast<int64_t>(n_seqs);
  o.max_context = 64;
  o.page_size = 8;
  o.sparse = sparse;
  o.retrieval_head = std::move(head);
  return o;
}

// W ranks on W threads; each returns its run. The group's timeout bounds any hang.
std::vector<RunOutput> run_sharded(std::shared_ptr<const Model> model,
                                   std::shared_ptr<const RetrievalHead> head, const SparseOptions& sparse,
                                   int world, const Tokens& prompts, int steps) {
  cpu::ThreadCommunicatorOptions co;
  co.timeout = std::chrono::milliseconds(20000);
  auto group = cpu::ThreadCommunicatorGroup::create(world, co);
  EXPECT_TRUE(group.is_ok());
  std::vector<RunOutput> outs(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      RunOutput& out = outs[static_cast<size_t>(r)];
      auto comm = (*group)->communicator(r);
      auto fail = [&](const Status& s) {
        out.status = s;
        comm->abort(s);  // the other ranks must not wait for this one
      };
      auto shard = shard_model(model, r, world);
      if (!shard.is_ok()) return fail(shard.status());
      std::shared_ptr<const RetrievalHead> shead;
      if (head) {
        auto h = shard_retrieval_head(head, r, world);
        if (!h.is_ok()) return fail(h.status());
        shead = *h;
      }
      EngineOptions eo = engine_options(sparse, shead, prompts.size());
      eo.communicator = comm;
      auto backend = make_backend();
      if (!backend) return fail(internal_error("no backend"));
      auto e = Engine::create(*shard, backend, eo);
      if (!e.is_ok()) return fail(e.status());
      run_script(**e, prompts, steps, comm.get(), nullptr, out);
      if (!out.status.is_ok()) comm->abort(out.status);
    });
  }
  for (auto& t : threads) t.join();
  return outs;
}

RunOutput run_unsharded(std::shared_ptr<const Model> model, std::shared_ptr<const RetrievalHead> head,
                        const SparseOptions& sparse, const Tokens& prompts, const Tokens& forced) {
  RunOutput out;
  auto e = Engine::create(model, make_backend(), engine_options(sparse, head, prompts.size()));
  if (!e.is_ok()) {
    out.status = e.status();
    return out;
  }
  run_script(**e, prompts, static_cast<int>(forced.size()), nullptr, &forced, out);
  return out;
}

Tokens make_prompts(int64_t vocab, std::initializer_list<int> lengths, uint32_t seed) {
  Tokens p;
  uint32_t s = seed;
  for (int n : lengths) {
    std::vector<TokenId> t;
    for (int i = 0; i < n; ++i) {
      s = s * 1664525u + 1013904223u;
      t.push_back(static_cast<TokenId>((s >> 8) % static_cast<uint32_t>(vocab)));
    }
    p.push_back(std::move(t));
  }
  return p;
}

// The whole comparison: sharded ranks against the unsharded engine fed the same tokens.
void expect_matches_unsharded(std::shared_ptr<const Model> model, std::shared_ptr<const RetrievalHead> head,
                              const SparseOptions& sparse, int world, double tolerance) {
  constexpr int kSteps = 10;
  const Tokens prompts = make_prompts(model->config.vocab_size, {19, 11}, 7u + static_cast<uint32_t>(world));
  const std::vector<RunOutput> ranks = run_sharded(model, head, sparse, world, prompts, kSteps);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(ranks[static_cast<size_t>(r)].status.is_ok())
        << "rank " << r << ": " << ranks[static_cast<size_t>(r)].status.to_string();
  }
  const RunOutput ref = run_unsharded(model, head, sparse, prompts, ranks[0].fed);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  ASSERT_EQ(ref.logits.size(), static_cast<size_t>(kSteps + 1));
  int argmax_agree = 0, argmax_total = 0;
  for (int r = 0; r < world; ++r) {
    const RunOutput& o = ranks[static_cast<size_t>(r)];
    ASSERT_EQ(o.logits.size(), ref.logits.size());
    EXPECT_EQ(o.fed, ranks[0].fed) << "rank " << r << " was fed other tokens";
    for (size_t step = 0; step < ref.logits.size(); ++step) {
      for (size_t i = 0; i < prompts.size(); ++i) {
        const auto& got = o.logits[step][i];
        const auto& want = ref.logits[step][i];
        double norm = 0;
        for (float x : want) {
          ASSERT_TRUE(std::isfinite(x));
          norm += std::fabs(x);
        }
        ASSERT_GT(norm, 0.0);
        const double err = rel_l2(got, want);
        EXPECT_LT(err, tolerance) << "rank " << r << " of " << world << ", forward " << step << ", sequence "
                                  << i;
        // Replicated LM head over bit-identical residual streams: the ranks agree exactly.
        EXPECT_EQ(std::memcmp(got.data(), ranks[0].logits[step][i].data(), got.size() * sizeof(float)), 0)
            << "rank " << r << " differs from rank 0 at forward " << step << ", sequence " << i;
        if (r == 0 && step + 1 < ref.logits.size()) {
          ++argmax_total;
          argmax_agree += std::max_element(want.begin(), want.end()) - want.begin() == ranks[0].fed[step][i];
        }
      }
    }
  }
  // The greedy tokens the ranks chose are the unsharded engine's (ties aside).
  EXPECT_GE(argmax_agree, argmax_total - 1);

  if (sparse.method == SparseMethod::kDense) return;
  // Every decode step of both sequences was sparse on every rank and in the reference.
  const int64_t want_sparse = static_cast<int64_t>(kSteps * prompts.size());
  EXPECT_EQ(ref.sparse_steps, want_sparse);
  if (sparse.method != SparseMethod::kSpeContext) return;
  ASSERT_EQ(ref.selections.size(), static_cast<size_t>(want_sparse));
  const int64_t kv_per_rank = model->config.n_kv_heads / world;
  for (int r = 0; r < world; ++r) {
    const RunOutput& o = ranks[static_cast<size_t>(r)];
    EXPECT_EQ(o.sparse_steps, want_sparse);
    ASSERT_EQ(o.selections.size(), ref.selections.size());
    for (size_t k = 0; k < ref.selections.size(); ++k) {
      ASSERT_EQ(o.selections[k].kv_heads, kv_per_rank);
      for (int64_t h = 0; h < kv_per_rank; ++h) {
        const auto mine = o.selections[k].head(h);
        const auto full = ref.selections[k].head(r * kv_per_rank + h);
        EXPECT_TRUE(std::equal(mine.begin(), mine.end(), full.begin(), full.end()))
            << "rank " << r << " selection " << k << " KV head " << h
            << " differs from the full selection's head " << r * kv_per_rank + h;
      }
    }
  }
}

std::shared_ptr<const Model> stories260k() {
  auto m = load_model(repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.is_ok() ? std::shared_ptr<const Model>(*m) : nullptr;
}

std::shared_ptr<const RetrievalHead> stories260k_head(const Model& model) {
  auto h = load_eagle3_head(repo_path("models/stories260K/retrieval_head.safetensors"), model.config);
  EXPECT_TRUE(h.is_ok()) << h.status().to_string();
  return h.is_ok() ? std::shared_ptr<const RetrievalHead>(*h) : nullptr;
}

ModelConfig small_config(int64_t dim, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  ModelConfig c;
  c.dim = dim;
  c.hidden_dim = hidden;
  c.n_layers = 3;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.vocab_size = 96;
  c.max_seq_len = 128;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  return c;
}

std::shared_ptr<const Model> random_model(const ModelConfig& c, DType dtype = DType::kF32) {
  auto m = make_random_model(c, dtype, 1234);
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return m.is_ok() ? std::shared_ptr<const Model>(*m) : nullptr;
}

std::shared_ptr<const RetrievalHead> random_head(const ModelConfig& c) {
  auto h = make_random_head(c, 99);
  EXPECT_TRUE(h.is_ok()) << h.status().to_string();
  return h.is_ok() ? std::shared_ptr<const RetrievalHead>(*h) : nullptr;
}

// GQA with q_dim (8·8 = 64) != dim (48): shards must not assume dim = n_heads·head_dim.
ModelConfig gqa_config() { return small_config(48, 96, 8, 4, 8); }
ModelConfig mha_config() { return small_config(64, 96, 4, 4, 16); }
ModelConfig qwen_config() {  // attention bias (sliced) and per-head q/k norms (shared)
  ModelConfig c = small_config(64, 128, 4, 2, 16);
  c.arch = Architecture::kQwen3;
  c.attention_bias = true;
  c.qk_norm = true;
  return c;
}

SparseOptions dense() { return {}; }
SparseOptions specontext_sparse() {
  SparseOptions s;
  s.method = SparseMethod::kSpeContext;
  s.selection.budget = 8;
  s.selection.sinks = 1;
  s.selection.window = 2;
  return s;
}

constexpr double kTol = 1e-5;

TEST(TensorParallel, Stories260KDense) {
  auto m = stories260k();
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->config.n_heads, 8);  // 8 heads, 4 KV heads, hidden 172: worlds 2 and 4 divide
  ASSERT_EQ(m->config.n_kv_heads, 4);
  ASSERT_EQ(m->config.hidden_dim, 172);
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_matches_unsharded(m, nullptr, dense(), world, kTol);
  }
}

TEST(TensorParallel, Stories260KSpeContext) {
  auto m = stories260k();
  ASSERT_NE(m, nullptr);
  auto head = stories260k_head(*m);
  ASSERT_NE(head, nullptr);
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_matches_unsharded(m, head, specontext_sparse(), world, kTol);
  }
}

TEST(TensorParallel, SyntheticGqaDense) {
  auto m = random_model(gqa_config());
  ASSERT_NE(m, nullptr);
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_matches_unsharded(m, nullptr, dense(), world, kTol);
  }
}

TEST(TensorParallel, SyntheticMhaDense) {
  auto m = random_model(mha_config());
  ASSERT_NE(m, nullptr);
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_matches_unsharded(m, nullptr, dense(), world, kTol);
  }
}

TEST(TensorParallel, SyntheticBiasAndQkNormDense) {
  auto m = random_model(qwen_config());
  ASSERT_NE(m, nullptr);
  expect_matches_unsharded(m, nullptr, dense(), 2, kTol);
}

TEST(TensorParallel, SyntheticBf16Dense) {
  auto m = random_model(gqa_config(), DType::kBF16);
  ASSERT_NE(m, nullptr);
  expect_matches_unsharded(m, nullptr, dense(), 2, kTol);
}

TEST(TensorParallel, SyntheticGqaSpeContext) {
  const ModelConfig c = gqa_config();
  auto m = random_model(c);
  auto head = random_head(c);
  ASSERT_NE(m, nullptr);
  ASSERT_NE(head, nullptr);
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    expect_matches_unsharded(m, head, specontext_sparse(), world, kTol);
  }
}

TEST(TensorParallel, SyntheticMhaSpeContext) {
  const ModelConfig c = mha_config();
  auto m = random_model(c);
  auto head = random_head(c);
  ASSERT_NE(m, nullptr);
  ASSERT_NE(head, nullptr);
  expect_matches_unsharded(m, head, specontext_sparse(), 4, kTol);
}

TEST(TensorParallel, WorldOneIsTheSameModel) {
  auto m = stories260k();
  ASSERT_NE(m, nullptr);
  auto s = shard_model(m, 0, 1);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  const Model& shard = **s;
  EXPECT_EQ(shard.config.n_heads, m->config.n_heads);
  EXPECT_EQ(shard.config.hidden_dim, m->config.hidden_dim);
  for (size_t l = 0; l < m->layers.size(); ++l) {
    const auto a = m->layers[l].matrices();
    const auto b = shard.layers[l].matrices();
    for (size_t k = 0; k < a.size(); ++k)
      EXPECT_EQ(a[k]->data, b[k]->data) << "layer " << l << " matrix " << k;
  }
  // Same weights, same shapes: the logits are bit-identical, with and without a communicator.
  const Tokens prompts = make_prompts(m->config.vocab_size, {9}, 3);
  const std::vector<RunOutput> one = run_sharded(m, nullptr, dense(), 1, prompts, 2);
  ASSERT_TRUE(one[0].status.is_ok()) << one[0].status.to_string();
  const RunOutput plain = run_unsharded(*s, nullptr, dense(), prompts, one[0].fed);
  const RunOutput ref = run_unsharded(m, nullptr, dense(), prompts, one[0].fed);
  ASSERT_TRUE(plain.status.is_ok()) << plain.status.to_string();
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  ASSERT_EQ(ref.logits.size(), 3u);
  for (size_t step = 0; step < ref.logits.size(); ++step) {
    EXPECT_EQ(one[0].logits[step][0], ref.logits[step][0]) << "forward " << step;
    EXPECT_EQ(plain.logits[step][0], ref.logits[step][0]) << "forward " << step;
  }
}

TEST(TensorParallel, ShardLayout) {
  ModelConfig c = qwen_config();
  auto parent = random_model(c);
  ASSERT_NE(parent, nullptr);
  const int world = 2, rank = 1;
  auto s = shard_model(parent, rank, world);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  std::shared_ptr<const Model> shard = *s;
  const ModelConfig& sc = shard->config;
  EXPECT_EQ(sc.n_heads, 2);
  EXPECT_EQ(sc.n_kv_heads, 1);
  EXPECT_EQ(sc.hidden_dim, 64);
  EXPECT_EQ(sc.dim, c.dim);
  EXPECT_EQ(sc.head_dim, c.head_dim);
  const int64_t qd = sc.q_dim(), kvd = sc.kv_dim(), hd = sc.hidden_dim;
  for (size_t l = 0; l < parent->layers.size(); ++l) {
    const LayerWeights& p = parent->layers[l];
    const LayerWeights& w = shard->layers[l];
    auto f = [](const WeightMatrix& m) { return static_cast<const float*>(m.data); };
    // Row slices: views into the parent's memory.
    EXPECT_EQ(f(w.wq), f(p.wq) + rank * qd * c.dim);
    EXPECT_EQ(f(w.wk), f(p.wk) + rank * kvd * c.dim);
    EXPECT_EQ(f(w.wv), f(p.wv) + rank * kvd * c.dim);
    EXPECT_EQ(f(w.w_gate), f(p.w_gate) + rank * hd * c.dim);
    EXPECT_EQ(f(w.w_up), f(p.w_up) + rank * hd * c.dim);
    // Column slices: copies holding the parent's columns.
    ASSERT_EQ(w.wo.rows, c.dim);
    ASSERT_EQ(w.wo.cols, qd);
    for (int64_t i = 0; i < c.dim; ++i) {
      for (int64_t j = 0; j < qd; ++j) {
        ASSERT_EQ(f(w.wo)[i * qd + j], f(p.wo)[i * c.q_dim() + rank * qd + j]);
      }
      for (int64_t j = 0; j < hd; ++j) {
        ASSERT_EQ(f(w.w_down)[i * hd + j], f(p.w_down)[i * c.hidden_dim + rank * hd + j]);
      }
    }
    EXPECT_EQ(w.bq, Vec(p.bq.begin() + rank * qd, p.bq.begin() + (rank + 1) * qd));
    EXPECT_EQ(w.bk, Vec(p.bk.begin() + rank * kvd, p.bk.begin() + (rank + 1) * kvd));
    EXPECT_EQ(w.bv, Vec(p.bv.begin() + rank * kvd, p.bv.begin() + (rank + 1) * kvd));
    EXPECT_EQ(w.q_norm, p.q_norm);
    EXPECT_EQ(w.k_norm, p.k_norm);
  }
  EXPECT_EQ(shard->tok_embeddings.data, parent->tok_embeddings.data);
  EXPECT_EQ(shard->lm_head.data, parent->lm_head.data);
  // The shard keeps the parent's storage alive: drop the parent and run it (ASan checks).
  const float first = static_cast<const float*>(shard->layers[0].wq.data)[0];
  parent.reset();
  EXPECT_EQ(static_cast<const float*>(shard->layers[0].wq.data)[0], first);
  EXPECT_TRUE(shard->validate().is_ok());
}

TEST(TensorParallel, Bf16ColumnSlices) {
  auto parent = random_model(gqa_config(), DType::kBF16);
  ASSERT_NE(parent, nullptr);
  auto s = shard_model(parent, 1, 4);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  const WeightMatrix& pw = parent->layers[1].w_down;
  const WeightMatrix& sw = (*s)->layers[1].w_down;
  ASSERT_EQ(sw.dtype, DType::kBF16);
  ASSERT_EQ(sw.cols, pw.cols / 4);
  const auto* p = static_cast<const uint16_t*>(pw.data);
  const auto* q = static_cast<const uint16_t*>(sw.data);
  for (int64_t i = 0; i < sw.rows; ++i) {
    for (int64_t j = 0; j < sw.cols; ++j) ASSERT_EQ(q[i * sw.cols + j], p[i * pw.cols + sw.cols + j]);
  }
}

TEST(TensorParallel, RetrievalHeadShard) {
  const ModelConfig c = gqa_config();  // 8 query heads, 4 KV heads
  auto head = random_head(c);
  ASSERT_NE(head, nullptr);
  auto s = shard_retrieval_head(head, 3, 4);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  const RetrievalHead& h = **s;
  EXPECT_EQ(h.config.n_heads, 2);
  EXPECT_EQ(h.config.n_kv_heads, 1);
  EXPECT_EQ(h.wq.rows, 2 * c.head_dim);
  EXPECT_EQ(h.wk.rows, c.head_dim);
  EXPECT_EQ(h.wq.data, static_cast<const float*>(head->wq.data) + 3 * 2 * c.head_dim * 2 * c.dim);
  EXPECT_EQ(h.wk.data, static_cast<const float*>(head->wk.data) + 3 * c.head_dim * 2 * c.dim);
  EXPECT_EQ(h.fc.data, head->fc.data);
  EXPECT_EQ(h.input_norm, head->input_norm);
}

void expect_invalid(const Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.to_string();
}

TEST(TensorParallel, RejectsWorldsThatDoNotDivide) {
  auto m = stories260k();
  ASSERT_NE(m, nullptr);
  expect_invalid(shard_model(m, 0, 3).status(), "n_heads = 8 is not divisible by world = 3");
  expect_invalid(shard_model(random_model(small_config(64, 128, 8, 2, 8)), 0, 4).status(),
                 "n_kv_heads = 2 is not divisible by world = 4");
  expect_invalid(shard_model(random_model(small_config(64, 130, 4, 4, 16)), 0, 4).status(),
                 "hidden_dim = 130 is not divisible by world = 4");
  auto head = stories260k_head(*m);
  ASSERT_NE(head, nullptr);
  expect_invalid(shard_retrieval_head(head, 0, 8).status(), "n_kv_heads = 4 is not divisible by world = 8");
}

TEST(TensorParallel, RejectsBadRanks) {
  auto m = stories260k();
  ASSERT_NE(m, nullptr);
  expect_invalid(shard_model(m, 2, 2).status(), "rank = 2 is outside [0, 2)");
  expect_invalid(shard_model(m, -1, 2).status(), "rank = -1 is outside [0, 2)");
  expect_invalid(shard_model(m, 0, 0).status(), "world = 0 must be at least 1");
  expect_invalid(shard_model(nullptr, 0, 1).status(), "model is null");
  auto head = stories260k_head(*m);
  ASSERT_NE(head, nullptr);
  expect_invalid(shard_retrieval_head(head, 4, 4).status(), "rank = 4 is outside [0, 4)");
  expect_invalid(shard_retrieval_head(nullptr, 0, 1).status(), "head is null");
}

// Wraps a rank's communicator and fails it on its n-th call, as a rank dying mid-forward would.
class FailingCommunicator : public Communicator {
 public:
  FailingCommunicator(std::shared_ptr<cpu::ThreadCommunicator> inner, int fail_on_call)
      : inner_(std::move(inner)), fail_on_(fail_on_call) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Status all_reduce_sum(float* data, int64_t count) override {
    if (++calls_ == fail_on_)
      inner_->abort(internal_error("injected failure in rank " + std::to_string(rank())));
    return inner_->all_reduce_sum(data, count);
  }

 private:
  std::shared_ptr<cpu::ThreadCommunicator> inner_;
  int fail_on_;
  int calls_ = 0;
};

// Runs one prefill forward per rank; rank `odd` gets `make_comm` instead of its plain communicator
// or, with skip, never calls forward. Returns each rank's forward status and time.
struct ForwardResult {
  Status status;
  double ms = 0;
};
std::vector<ForwardResult> forward_each_rank(int world, std::chrono::milliseconds timeout, int odd, bool skip,
                                             int fail_on_call) {
  auto m = stories260k();
  cpu::ThreadCommunicatorOptions co;
  co.timeout = timeout;
  auto group = cpu::ThreadCommunicatorGroup::create(world, co);
  EXPECT_TRUE(group.is_ok());
  std::vector<ForwardResult> res(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto shard = shard_model(m, r, world);
      EXPECT_TRUE(shard.is_ok());
      EngineOptions eo = engine_options(dense(), nullptr, 1);
      std::shared_ptr<Communicator> comm = (*group)->communicator(r);
      if (r == odd && !skip)
        comm = std::make_shared<FailingCommunicator>((*group)->communicator(r), fail_on_call);
      eo.communicator = comm;
      auto e = Engine::create(*shard, make_backend(), eo);
      EXPECT_TRUE(e.is_ok()) << e.status().to_string();
      if (r == odd && skip) return;  // never joins
      auto seq = (*e)->memory().add_sequence();
      const std::vector<TokenId> prompt = {1, 5, 9, 13, 17, 21};
      StepRequest req{*seq, prompt, LogitsMode::kLast};
      const auto t0 = Clock::now();
      auto out = (*e)->forward(std::span<const StepRequest>(&req, 1));
      res[static_cast<size_t>(r)].ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      res[static_cast<size_t>(r)].status = out.status();
    });
  }
  for (auto& t : threads) t.join();
  return res;
}

TEST(TensorParallel, RankFailingMidForwardFailsEveryRank) {
  // Rank 1 fails on its 3rd all-reduce (layer 1, after attention-out); the timeout is long, so
  // the others must be woken by the failure, not by the clock.
  for (int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const auto res = forward_each_rank(world, std::chrono::milliseconds(60000), 1, false, 3);
    for (int r = 0; r < world; ++r) {
      const ForwardResult& f = res[static_cast<size_t>(r)];
      EXPECT_EQ(f.status.code(), StatusCode::kUnavailable) << "rank " << r << ": " << f.status.to_string();
      EXPECT_NE(f.status.message().find("injected failure in rank 1"), std::string::npos)
          << f.status.to_string();
      EXPECT_LT(f.ms, 10000.0) << "rank " << r;
    }
  }
}

TEST(TensorParallel, MissingRankTimesOutEveryForward) {
  const auto res = forward_each_rank(4, std::chrono::milliseconds(300), 2, true, 0);
  for (int r : {0, 1, 3}) {
    const ForwardResult& f = res[static_cast<size_t>(r)];
    EXPECT_EQ(f.status.code(), StatusCode::kUnavailable) << "rank " << r << ": " << f.status.to_string();
    EXPECT_NE(f.status.message().find("rank 2 did not join"), std::string::npos) << f.status.to_string();
    EXPECT_LT(f.ms, 300.0 + 5000.0) << "rank " << r;
  }
}

}  // namespace
}  // namespace specontext
