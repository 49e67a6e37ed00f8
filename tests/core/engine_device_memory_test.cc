// The engine's data flow with a device backend, checked on the CPU: a backend whose memory is
// "device memory" that the host cannot touch. Its allocations are mprotect'ed to PROT_NONE except
// while one of its own ops runs, so any host-side read or write of activations, KV pages, working
// sets or the head's keys by the engine faults; and every pointer an op receives must lie in its
// memory (a host pointer handed to a CUDA kernel would be the same bug). The engine must give the
// CPU backend's logits exactly, for dense and every sparse method, prefill and decode, and with
// synthetic contexts. This is what lets the CUDA path run right the first time a GPU is present.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

#include "core/engine/engine.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "tests/core/tier_test_util.h"

namespace specontext {
namespace {

class ProtectedMemoryBackend final : public Backend {
 public:
  explicit ProtectedMemoryBackend(std::shared_ptr<Backend> inner) : inner_(std::move(inner)) {}
  ~ProtectedMemoryBackend() override { set_access(true); }

  std::string_view name() const override { return "protected"; }
  bool supports(BackendOp op, DType d) const override { return inner_->supports(op, d); }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  bool addressable(MemoryKind kind) const override { return kind == MemoryKind::kDevice; }
  int64_t foreign_pointers() const { return foreign_; }

  Result<std::shared_ptr<void>> allocate(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t len = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    void* p = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return resource_exhausted("mmap failed");
    regions_[static_cast<std::byte*>(p)] = len;
    return std::shared_ptr<void>(p, [this, len](void* q) {
      regions_.erase(static_cast<std::byte*>(q));
      munmap(q, len);
    });
  }
  Result<const void*> import_weights(const void* host, size_t bytes) override {
    auto it = imported_.find(host);
    if (it != imported_.end()) return static_cast<const void*>(it->second.get());
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<void> mem, allocate(bytes));
    set_access(true);
    std::memcpy(mem.get(), host, bytes);
    set_access(false);
    imported_[host] = mem;
    return static_cast<const void*>(mem.get());
  }
  Status upload(void* dst, const void* src, size_t bytes) override {
    check(dst, "upload dst");
    return run([&] { std::memcpy(dst, src, bytes); return Status::ok(); });
  }
  Status download(void* dst, const void* src, size_t bytes) override {
    check(src, "download src");
    return run([&] { std::memcpy(dst, src, bytes); return Status::ok(); });
  }
  Status copy_rows(void* dst, size_t ds, const void* src, size_t ss, size_t rb, int64_t rows) override {
    check(dst, "copy_rows dst");
    check(src, "copy_rows src");
    return run([&] { return inner_->copy_rows(dst, ds, src, ss, rb, rows); });
  }
  Status embed(const TokenId* ids, int64_t n, const WeightMatrix& t, float* out) override {
    check(ids, "embed ids");
    check(t.data, "embed table");
    check(out, "embed out");
    return run([&] { return inner_->embed(ids, n, t, out); });
  }
  Status matmul(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y) override {
    check(x, "matmul x");
    check(w.data, "matmul w");
    if (bias) check(bias, "matmul bias");
    check(y, "matmul y");
    return run([&] { return inner_->matmul(x, m, w, bias, y); });
  }
  Status rmsnorm(const float* x, const float* w, int64_t rows, int64_t dim, float eps, float* y) override {
    check(x, "rmsnorm x");
    check(w, "rmsnorm weight");
    check(y, "rmsnorm y");
    return run([&] { return inner_->rmsnorm(x, w, rows, dim, eps, y); });
  }
  Status rope(float* x, int64_t n, int64_t h, const int64_t* pos, const RopeParams& p) override {
    check(x, "rope x");
    check(pos, "rope positions");
    return run([&] { return inner_->rope(x, n, h, pos, p); });
  }
  Status swiglu(const float* g, const float* u, int64_t n, float* out) override {
    check(g, "swiglu gate");
    check(u, "swiglu up");
    check(out, "swiglu out");
    return run([&] { return inner_->swiglu(g, u, n, out); });
  }
  Status add(float* x, const float* y, int64_t n) override {
    check(x, "add x");
    check(y, "add y");
    return run([&] { return inner_->add(x, y, n); });
  }
  Status kv_append(const float* k, const float* v, int64_t n, int64_t start, const KvLayerView& kv) override {
    check(k, "kv_append k");
    check(v, "kv_append v");
    check_view(kv, start, n);
    return run([&] { return inner_->kv_append(k, v, n, start, kv); });
  }
  Status attention(const float* q, const AttentionItem* items, int64_t n, int64_t heads, float* out) override {
    check(q, "attention q");
    check(out, "attention out");
    for (int64_t i = 0; i < n; ++i) check_view(items[i].kv, 0, items[i].start_pos + items[i].n_tokens);
    return run([&] { return inner_->attention(q, items, n, heads, out); });
  }
  Status kv_gather(const KvLayerView& kv, const GatherEntry* e, int64_t n, const WorkingSetView& ws) override {
    for (int64_t i = 0; i < n; ++i) check_view(kv, e[i].token, 1);
    check(ws.k, "working set k");
    check(ws.v, "working set v");
    return run([&] { return inner_->kv_gather(kv, e, n, ws); });
  }
  Status attention_sparse(const float* q, const SparseAttentionItem* items, int64_t n, int64_t heads,
                          float* out) override {
    check(q, "sparse q");
    check(out, "sparse out");
    for (int64_t i = 0; i < n; ++i) check(items[i].ws.k, "sparse ws");
    return run([&] { return inner_->attention_sparse(q, items, n, heads, out); });
  }
  Status attention_indexed(const float* q, const IndexedAttentionItem* items, int64_t n, int64_t heads,
                           float* out) override {
    check(q, "indexed q");
    check(out, "indexed out");
    for (int64_t i = 0; i < n; ++i) {
      // The indices and counts are host descriptions; every page they name is backend memory.
      for (int64_t h = 0; h < items[i].kv.kv_heads; ++h) {
        for (int64_t j = 0; j < items[i].counts[h]; ++j) {
          check_view(items[i].kv, items[i].indices[h * items[i].stride + j], 1);
        }
      }
    }
    ++indexed_calls_;
    return run([&] { return inner_->attention_indexed(q, items, n, heads, out); });
  }
  int64_t indexed_calls() const { return indexed_calls_; }
  Status retrieval_group_scores(const float* q, const void* const* blocks, DType kt, int64_t bt, int64_t length,
                                int64_t nh, int64_t nkv, int64_t hd, float* out) override {
    check(q, "scores q");
    check(out, "scores out");
    for (int64_t b = 0; b < (length + bt - 1) / bt; ++b) check(blocks[b], "scores key block");
    return run([&] { return Backend::retrieval_group_scores(q, blocks, kt, bt, length, nh, nkv, hd, out); });
  }
  // select_top_tokens: the base class downloads the scores through download() above.

 private:
  template <typename F>
  Status run(F&& f) {
    set_access(true);
    Status s = f();
    set_access(false);
    return s;
  }
  void set_access(bool on) {
    for (const auto& [p, len] : regions_) mprotect(p, len, on ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
  bool inside(const void* p) const {
    const auto* b = static_cast<const std::byte*>(p);
    auto it = regions_.upper_bound(const_cast<std::byte*>(b));
    if (it == regions_.begin()) return false;
    --it;
    return b >= it->first && b < it->first + it->second;
  }
  void check(const void* p, const char* what) {
    if (p != nullptr && !inside(p)) {
      ++foreign_;
      ADD_FAILURE() << what << ": a pointer outside the backend's memory";
    }
  }
  void check_view(const KvLayerView& kv, int64_t from, int64_t n) {
    for (int64_t t = from; t < from + n; t += kv.page_size) {
      check(kv.k_pages[t / kv.page_size], "KV page");
      check(kv.v_pages[t / kv.page_size], "KV page");
    }
  }
  std::shared_ptr<Backend> inner_;
  std::map<std::byte*, size_t> regions_;
  std::map<const void*, std::shared_ptr<void>> imported_;
  int64_t foreign_ = 0;
  int64_t indexed_calls_ = 0;
};

TEST(EngineDeviceMemory, DeviceBackendGivesTheHostLogitsWithoutHostAccess) {
  auto model = testing::toy_model(3);
  auto head = make_random_head(model->config, 9);
  ASSERT_TRUE(head.is_ok());
  for (SparseMethod method : {SparseMethod::kDense, SparseMethod::kSpeContext, SparseMethod::kStreaming,
                              SparseMethod::kQuest}) {
    SCOPED_TRACE(std::string(sparse_method_name(method)));
    EngineOptions o;
    o.max_sequences = 3;
    o.max_context = 256;
    o.page_size = 8;
    o.sparse.method = method;
    o.sparse.selection = {20, 1, 4};
    o.sparse.quest_page_size = 8;
    if (method == SparseMethod::kSpeContext) o.retrieval_head = *head;
    auto protected_backend = std::make_shared<ProtectedMemoryBackend>(testing::cpu_backend());
    auto dev = Engine::create(model, protected_backend, o);
    ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
    auto host = Engine::create(model, testing::cpu_backend(), o);
    ASSERT_TRUE(host.is_ok());
    std::vector<SeqId> ids;
    for (int i = 0; i < 3; ++i) {
      auto a = (*dev)->memory().add_sequence(), b = (*host)->memory().add_sequence();
      ASSERT_TRUE(a.is_ok() && b.is_ok());
      ids.push_back(*a);
    }
    // Sequence 2 starts from a synthetic context (writes pages through upload()).
    ASSERT_TRUE((*dev)->fill_synthetic(ids[2], 40, 5).is_ok());
    ASSERT_TRUE((*host)->fill_synthetic(ids[2], 40, 5).is_ok());
    std::vector<std::vector<TokenId>> toks = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, {5, 6, 7}, {9}};
    for (int step = 0; step < 30; ++step) {
      std::vector<StepRequest> reqs;
      for (int i = 0; i < 3; ++i) reqs.push_back({ids[static_cast<size_t>(i)], toks[static_cast<size_t>(i)], LogitsMode::kLast});
      auto a = (*dev)->forward(reqs);
      auto b = (*host)->forward(reqs);
      ASSERT_TRUE(a.is_ok()) << a.status().to_string();
      ASSERT_TRUE(b.is_ok());
      ASSERT_EQ(testing::max_abs_diff(a->logits, b->logits), 0.0f) << "step " << step;
      for (int i = 0; i < 3; ++i) {
        auto row = b->row(static_cast<size_t>(i));
        toks[static_cast<size_t>(i)] = {static_cast<TokenId>(std::max_element(row.begin(), row.end()) - row.begin())};
      }
    }
    EXPECT_EQ(protected_backend->foreign_pointers(), 0);
    if (method != SparseMethod::kDense) {
      EXPECT_GT((*dev)->sparse_stats().sparse_steps, 0);
      // Every layer is homed on the device: attended in place, by index.
      EXPECT_GT(protected_backend->indexed_calls(), 0);
    }
  }
}

// kSample rows are decided by Backend::sample_rows where the logits are (the base class downloads
// them through download() here). In a batch that mixes the logits modes, the device-memory engine
// must draw the tokens the host engine draws in place, and return the same kAll rows; and a
// sampled token must be the one the host procedure draws from the logits kLast returns.
TEST(EngineDeviceMemory, SampledRowsEqualHostSamplingOfTheReturnedLogits) {
  auto model = testing::toy_model(2);
  EngineOptions o;
  o.max_sequences = 4;
  o.max_context = 128;
  o.page_size = 8;
  auto protected_backend = std::make_shared<ProtectedMemoryBackend>(testing::cpu_backend());
  auto dev = Engine::create(model, protected_backend, o);
  auto host = Engine::create(model, testing::cpu_backend(), o);
  auto plain = Engine::create(model, testing::cpu_backend(), o);  // kLast + the host procedure
  ASSERT_TRUE(dev.is_ok() && host.is_ok() && plain.is_ok());
  std::vector<SeqId> ids;
  for (int i = 0; i < 4; ++i) {
    auto a = (*dev)->memory().add_sequence(), b = (*host)->memory().add_sequence();
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    ids.push_back(*a);
  }
  auto plain_seq = (*plain)->memory().add_sequence();
  ASSERT_TRUE(plain_seq.is_ok());
  ASSERT_EQ(*plain_seq, ids[0]);
  std::vector<SamplingParams> params(3);
  params[0].temperature = 0.8f, params[0].top_p = 0.9f, params[0].seed = 2;
  params[1].temperature = 0.9f, params[1].top_p = 0.8f, params[1].seed = 3;
  params[2].temperature = 1.3f, params[2].top_k = 5, params[2].repetition_penalty = 1.4f, params[2].seed = 4;
  std::vector<Sampler> samplers;
  for (const auto& p : params) samplers.emplace_back(p);
  Sampler plain_sampler(params[0]);
  std::vector<std::vector<TokenId>> history = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9}};
  std::vector<TokenId> plain_history = history[0];
  std::vector<TokenId> kall_tokens = {2, 3, 4};
  std::vector<std::pair<float, int32_t>> scratch;
  for (int step = 0; step < 25; ++step) {
    std::vector<TokenDraw> draws;
    for (size_t i = 0; i < 3; ++i) draws.push_back(samplers[i].next_draw(history[i]));
    std::vector<StepRequest> reqs;
    for (size_t i = 0; i < 3; ++i) {
      const auto toks = step == 0 ? std::span<const TokenId>(history[i]) : std::span<const TokenId>(&history[i].back(), 1);
      reqs.push_back({ids[i], toks, LogitsMode::kSample, &draws[i]});
    }
    // A fourth sequence asks for all its rows, between the sampled ones.
    const auto all = step == 0 ? std::span<const TokenId>(kall_tokens) : std::span<const TokenId>(&kall_tokens.back(), 1);
    reqs.insert(reqs.begin() + 1, {ids[3], all, LogitsMode::kAll});
    auto a = (*dev)->forward(reqs);
    auto b = (*host)->forward(reqs);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    ASSERT_TRUE(b.is_ok());
    ASSERT_EQ(a->n_rows[1], static_cast<int64_t>(all.size()));
    ASSERT_EQ(a->tokens[1], -1);
    ASSERT_EQ(a->logits.size(), all.size() * static_cast<size_t>(a->vocab));  // only the kAll rows come back
    ASSERT_EQ(testing::max_abs_diff(a->logits, b->logits), 0.0f) << "kAll rows, step " << step;
    for (size_t i = 0; i < 3; ++i) {
      const size_t r = i == 0 ? 0 : i + 1;
      EXPECT_EQ(a->n_rows[r], 0);
      ASSERT_EQ(a->tokens[r], b->tokens[r]) << "sequence " << i << ", step " << step;
      ASSERT_GE(a->tokens[r], 0);
      history[i].push_back(a->tokens[r]);
    }
    kall_tokens.push_back(static_cast<TokenId>((step * 7 + 1) % model->config.vocab_size));

    // Sequence 0 alone on a third engine: kLast + sample_with_coin on the returned logits.
    const TokenDraw plain_draw = plain_sampler.next_draw(plain_history);
    ASSERT_EQ(plain_draw.coin, draws[0].coin);
    const auto toks = step == 0 ? std::span<const TokenId>(plain_history) : std::span<const TokenId>(&plain_history.back(), 1);
    StepRequest last{*plain_seq, toks, LogitsMode::kLast};
    auto c = (*plain)->forward(std::span<const StepRequest>(&last, 1));
    ASSERT_TRUE(c.is_ok());
    std::vector<float> logits(c->logits);
    plain_history.push_back(sample_with_coin(logits, plain_draw, scratch));
  }
  // The same draws for sequence 0 alone on the device-memory engine with kSample: both engines
  // then run one-row matmuls (batched rows may round differently), so the texts must be equal.
  {
    auto solo = Engine::create(model, std::make_shared<ProtectedMemoryBackend>(testing::cpu_backend()), o);
    ASSERT_TRUE(solo.is_ok());
    auto s = (*solo)->memory().add_sequence();
    ASSERT_TRUE(s.is_ok());
    Sampler sampler(params[0]);
    std::vector<TokenId> h(plain_history.begin(), plain_history.begin() + 3);
    for (int step = 0; step < 25; ++step) {
      const TokenDraw d = sampler.next_draw(h);
      const auto toks = step == 0 ? std::span<const TokenId>(h) : std::span<const TokenId>(&h.back(), 1);
      StepRequest r{*s, toks, LogitsMode::kSample, &d};
      auto out = (*solo)->forward(std::span<const StepRequest>(&r, 1));
      ASSERT_TRUE(out.is_ok());
      h.push_back(out->tokens[0]);
    }
    EXPECT_EQ(h, plain_history);
  }
  EXPECT_EQ(protected_backend->foreign_pointers(), 0);

  // A sampled row needs a draw, with a coin in [0, 1) and valid parameters.
  auto seq = (*dev)->memory().add_sequence();
  ASSERT_FALSE(seq.is_ok());  // all four slots are in use
  const TokenId t = 1;
  StepRequest missing{ids[0], std::span<const TokenId>(&t, 1), LogitsMode::kSample};
  auto no_draw = (*dev)->forward(std::span<const StepRequest>(&missing, 1));
  ASSERT_FALSE(no_draw.is_ok());
  EXPECT_NE(no_draw.status().message().find("without a draw"), std::string::npos);
  TokenDraw bad_coin;
  bad_coin.params.temperature = 1.0f;
  bad_coin.coin = 1.0f;
  missing.draw = &bad_coin;
  auto coin = (*dev)->forward(std::span<const StepRequest>(&missing, 1));
  ASSERT_FALSE(coin.is_ok());
  EXPECT_NE(coin.status().message().find("coin"), std::string::npos);
  TokenDraw bad_params;
  bad_params.params.top_p = 0.0f;
  missing.draw = &bad_params;
  auto params_error = (*dev)->forward(std::span<const StepRequest>(&missing, 1));
  ASSERT_FALSE(params_error.is_ok());
  EXPECT_NE(params_error.status().message().find("top_p"), std::string::npos);
  // Nothing was accepted: the sequence still continues exactly.
  EXPECT_EQ((*dev)->memory().sequence_length(ids[0]), (*host)->memory().sequence_length(ids[0]));
}

TEST(EngineDeviceMemory, OracleNeedsHostMemory) {
  auto model = testing::toy_model(2);
  EngineOptions o;
  o.max_context = 64;
  o.sparse.method = SparseMethod::kOracle;
  o.sparse.selection = {16, 1, 4};
  auto e = Engine::create(model, std::make_shared<ProtectedMemoryBackend>(testing::cpu_backend()), o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_EQ(e.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(e.status().message().find("oracle"), std::string::npos);
}

}  // namespace
}  // namespace specontext
