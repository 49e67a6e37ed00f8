// Helpers for tests of the engine's KV tiers: host pools in plain memory, engines built with a
// transport and copy queue, and a lock-step comparison against an all-device reference engine.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"
#include "serving/generator.h"
#include "tests/tests_common.h"
#include "transport/fault_transport.h"
#include "transport/loopback_transport.h"

namespace specontext::testing {

// A copy queue that runs each batch to completion inside submit() (no thread): the reference
// against which the threaded copy engine must give the same engine outputs. Retries transient
// failures (kUnavailable) up to max_retries times and re-posts NO_RESOURCE.
class InlineCopyQueue final : public CopyQueue {
 public:
  explicit InlineCopyQueue(Transport& t, int max_retries = 8) : t_(t), max_retries_(max_retries) {}
  Result<CopyTicket> submit(LayerId layer, CopyDirection dir, std::vector<TransferRequest> reqs) override {
    const uint64_t id = ++next_;
    Status st = run(reqs);
    if (st.is_ok()) {
      for (const TransferRequest& r : reqs) stats_.bytes[static_cast<size_t>(dir)] += r.bytes;
      stats_.requests[static_cast<size_t>(dir)] += reqs.size();
    } else {
      ++stats_.failures;
      st = st.with_context("copy: layer " + std::to_string(layer.value()));
    }
    results_.emplace(id, st);
    return CopyTicket{id};
  }
  Status wait(CopyTicket t) override {
    auto it = results_.find(t.id);
    if (it == results_.end()) return invalid_argument("unknown ticket");
    Status s = it->second;
    results_.erase(it);
    return s;
  }
  Status wait_all() override {
    Status first;
    for (auto& [id, s] : results_) {
      if (first.is_ok() && !s.is_ok()) first = s;
    }
    results_.clear();
    return first;
  }
  void reset_window() override { stats_ = CopyWindowStats{}; }
  CopyWindowStats window_stats() const override { return stats_; }

 private:
  Status run(const std::vector<TransferRequest>& reqs) {
    if (reqs.empty()) return Status::ok();
    Status last;
    for (int attempt = 0; attempt <= max_retries_; ++attempt) {
      auto h = t_.prepare(reqs);
      if (!h.is_ok()) return h.status();
      Status s = t_.post(*h);
      while (s.code() == StatusCode::kResourceExhausted) s = t_.post(*h);
      while (s.code() == StatusCode::kInProgress) s = t_.poll(*h);
      t_.release(*h);
      if (s.is_ok()) return s;
      last = s;
      if (s.code() != StatusCode::kUnavailable) return s;
      ++stats_.retries;
    }
    return last;
  }
  Transport& t_;
  int max_retries_;
  uint64_t next_ = 0;
  std::unordered_map<uint64_t, Status> results_;
  CopyWindowStats stats_;
};

// Host memory for a tier, zero-filled.
inline TierMemory host_tier(uint64_t bytes, int32_t node = 0) {
  TierMemory t;
  t.desc.kind = TierKind::kHost;
  t.desc.index = node;
  t.desc.memory = MemoryKind::kHost;
  t.desc.capacity_bytes = bytes;
  auto mem = std::shared_ptr<void>(std::calloc(bytes, 1), [](void* p) { std::free(p); });
  t.base = mem.get();
  t.owner = mem;
  return t;
}

inline TierMemory remote_tier(uint64_t bytes, int32_t rank = 0) {
  TierMemory t;
  t.desc.kind = TierKind::kRemote;
  t.desc.index = rank;
  t.desc.memory = MemoryKind::kRemote;
  t.desc.capacity_bytes = bytes;
  return t;
}

// A small GQA model: `layers` layers, dim 64, 4 query heads over 2 KV heads of 16.
inline std::shared_ptr<Model> toy_model(int64_t layers, uint64_t seed = 3) {
  auto c = synthetic_config("toy");
  EXPECT_TRUE(c.is_ok());
  c->n_layers = layers;
  c->max_seq_len = 1024;
  auto m = make_random_model(*c, DType::kF32, seed);
  EXPECT_TRUE(m.is_ok());
  return *m;
}

inline std::shared_ptr<Backend> cpu_backend() {
  cpu::CpuBackendOptions o;
  o.num_threads = 1;
  auto b = cpu::create_cpu_backend(o);
  EXPECT_TRUE(b.is_ok());
  return std::shared_ptr<Backend>(std::move(*b));
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = std::fabs(a[i] - b[i]);
    if (!(x <= d)) d = std::isnan(x) ? INFINITY : x;
  }
  return d;
}

// An engine over the bundled stories260K with `max_sequences` slots (all KV on the "device").
inline std::unique_ptr<Engine> stories_engine(int64_t max_sequences) {
  auto m = load_model(repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok());
  auto b = cpu::create_cpu_backend({});
  EXPECT_TRUE(b.is_ok());
  EngineOptions eo;
  eo.max_sequences = max_sequences;
  auto e = Engine::create(*m, std::shared_ptr<Backend>(std::move(*b)), eo);
  EXPECT_TRUE(e.is_ok());
  return std::move(*e);
}

// The tokens `r` gets run alone on a one-slot stories260K engine: what a request must get
// whatever else the scheduler does around it.
inline std::vector<TokenId> alone(const GenerationRequest& r) {
  auto e = stories_engine(1);
  Generator g(*e, GeneratorOptions{});
  auto res = g.run({r});
  EXPECT_TRUE(res.is_ok());
  return res.is_ok() ? (*res)[0].tokens : std::vector<TokenId>{};
}

// A stories260K prompt of n tokens: BOS, then story words over and over.
inline std::vector<TokenId> story_prompt(size_t n) {
  const std::vector<TokenId> words{403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 426};
  std::vector<TokenId> p{1};
  while (p.size() < n) p.push_back(words[p.size() % words.size()]);
  return p;
}

// An engine whose layer 1 lives on a (loopback) remote node behind a link that fails every post
// after the first `fail_after_posts`, with no retries: forward fails from then on, naming the layer.
// permanent: the node died for good (the link reports tier 1 lost, Transport::tier_lost).
struct FailingLinkEngine {
  std::unique_ptr<Transport> link;
  std::shared_ptr<CopyQueue> copies;
  std::unique_ptr<Engine> engine;  // declared last: destroyed before what it borrows
};
inline FailingLinkEngine failing_link_engine(const std::shared_ptr<Model>& model, int64_t fail_after_posts,
                                             int64_t max_sequences, bool permanent = false) {
  FailingLinkEngine f;
  transport::FaultPolicy fp;
  fp.fail_after_posts = fail_after_posts;
  if (permanent) {
    fp.permanent = true;
    fp.target_tier = TierId(1);
  }
  auto loopback = transport::LoopbackRemoteTransport::create();
  EXPECT_TRUE(loopback.is_ok());
  auto ft = transport::FaultInjectingTransport::create(std::move(*loopback), fp);
  EXPECT_TRUE(ft.is_ok());
  f.link = std::move(*ft);
  f.copies = std::make_shared<InlineCopyQueue>(*f.link, /*max_retries=*/0);
  EngineOptions o;
  o.max_sequences = max_sequences;
  o.tiering.remote.push_back(remote_tier(8 << 20));
  o.tiering.transport = f.link.get();
  o.tiering.copies = f.copies;
  auto engine = Engine::create(model, cpu_backend(), o);
  EXPECT_TRUE(engine.is_ok()) << engine.status().to_string();
  if (!engine.is_ok()) return f;
  KvPlacement place = (*engine)->memory().placement();
  place.layer_home[1] = TierId(1);
  EXPECT_TRUE((*engine)->apply_placement(place).is_ok());
  f.engine = std::move(*engine);
  return f;
}

}  // namespace specontext::testing
