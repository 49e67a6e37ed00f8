// CopyEngine over real and fault-injecting transports: per-layer completion, errors, retries,
// ordering, timeouts and shutdown. Every wait is bounded by a configured timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/copy_engine.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"

namespace specontext::transport {
namespace {

using namespace std::chrono_literals;

constexpr int kLayers = 4;
constexpr uint64_t kLayerBytes = 16 * 1024;

// A host "home" tier (0) with a seeded pattern, a host "working set" tier (1), and on loopback a
// remote tier (2) preloaded with the same pattern.
struct Fixture {
  std::vector<std::byte> home = std::vector<std::byte>(kLayers * kLayerBytes);
  std::vector<std::byte> work = std::vector<std::byte>(kLayers * kLayerBytes);

  Fixture() {
    std::mt19937_64 rng(42);
    for (auto& b : home) b = static_cast<std::byte>(rng() & 0xff);
  }
  void register_host(Transport& t) {
    ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kHost, home.data(), home.size()).is_ok());
    ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kHost, work.data(), work.size()).is_ok());
  }
  // Layer l: 16 pages of 1 KiB from `src` (reversed page order) into layer l's slice of tier 1.
  std::vector<LayerBatch> step(TierId src) const {
    std::vector<LayerBatch> out;
    const uint64_t page = kLayerBytes / 16;
    for (int l = 0; l < kLayers; ++l) {
      LayerBatch b{LayerId(l), {}};
      for (uint64_t p = 0; p < 16; ++p) {
        b.requests.push_back({src, l * kLayerBytes + (15 - p) * page, TierId(1),
                              l * kLayerBytes + p * page, page});
      }
      out.push_back(std::move(b));
    }
    return out;
  }
  bool layer_exact(int l) const {
    const uint64_t page = kLayerBytes / 16;
    for (uint64_t p = 0; p < 16; ++p) {
      if (std::memcmp(work.data() + l * kLayerBytes + p * page,
                      home.data() + l * kLayerBytes + (15 - p) * page, page) != 0) {
        return false;
      }
    }
    return true;
  }
};

std::unique_ptr<LoopbackRemoteTransport> loopback(std::chrono::microseconds latency = 0us) {
  auto t = LoopbackRemoteTransport::create({latency});
  EXPECT_TRUE(t.is_ok());
  return std::move(t).value();
}

// Registers remote tier 2 through `t` and loads the home pattern into it through `data` (the
// transport under a fault wrapper, so that seeding draws no faults).
void seed_remote(Transport& t, Transport& data, Fixture& f) {
  ASSERT_TRUE(t.register_tier(TierId(2), MemoryKind::kRemote, nullptr, f.home.size()).is_ok());
  auto h = data.prepare({{TierId(0), 0, TierId(2), 0, f.home.size()}});
  ASSERT_TRUE(h.is_ok());
  Status s = data.post(*h);
  for (int i = 0; i < 100000 && s.code() == StatusCode::kInProgress; ++i) {
    std::this_thread::sleep_for(10us);
    s = data.poll(*h);
  }
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  data.release(*h);
}

CopyEngineConfig fast_config() {
  CopyEngineConfig c;
  c.retry_backoff = 10us;
  c.layer_timeout = 3000ms;
  c.wait_timeout = 4000ms;
  return c;
}

TEST(CopyEngine, LocalStepIsExactAndCounted) {
  Fixture f;
  LocalTransport t;
  f.register_host(t);
  auto engine = CopyEngine::create(t, fast_config());
  ASSERT_TRUE(engine.is_ok());
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE((*engine)->submit_step(f.step(TierId(0))).is_ok());
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE((*engine)->wait_layer(LayerId(l)).is_ok());
      EXPECT_TRUE(f.layer_exact(l)) << "layer " << l;
    }
  }
  EXPECT_TRUE((*engine)->wait_layer(LayerId(99)).is_ok()) << "no batch: nothing to wait for";
  CopyStats s = (*engine)->stats();
  EXPECT_EQ(s.steps, 3u);
  EXPECT_EQ(s.bytes_moved, 3 * kLayers * kLayerBytes);
  ASSERT_EQ(s.layers.size(), static_cast<size_t>(kLayers));
  for (const LayerCopyStats& l : s.layers) EXPECT_EQ(l.bytes, kLayerBytes);
}

TEST(CopyEngine, SubmitValidatesWholeStep) {
  Fixture f;
  LocalTransport t;
  f.register_host(t);
  auto engine = CopyEngine::create(t, fast_config());
  ASSERT_TRUE(engine.is_ok());
  std::vector<LayerBatch> bad = f.step(TierId(0));
  bad[2].requests[3].bytes = 1 << 30;  // out of range
  Status s = (*engine)->submit_step(std::move(bad));
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("layer 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("request 3"), std::string::npos) << s.message();
  EXPECT_EQ((*engine)->stats().steps, 0u) << "nothing accepted";

  std::vector<LayerBatch> dup = f.step(TierId(0));
  dup[1].layer = LayerId(0);
  EXPECT_EQ((*engine)->submit_step(std::move(dup)).code(), StatusCode::kInvalidArgument);
}

TEST(CopyEngine, FailureRateOneSurfacesErrorForThatLayerOnly) {
  Fixture f;
  // Layer 2 loads from tier 3 (a second home pool); faults target only that tier, at rate 1.
  std::vector<std::byte> other_home(f.home);
  FaultPolicy p;
  p.failure_rate = 1.0;
  p.seed = 5;
  p.target_tier = TierId(3);
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  f.register_host(**ft);
  ASSERT_TRUE((*ft)->register_tier(TierId(3), MemoryKind::kHost, other_home.data(),
                                   other_home.size()).is_ok());
  CopyEngineConfig c = fast_config();
  c.max_retries = 2;
  auto engine = CopyEngine::create(**ft, c);
  ASSERT_TRUE(engine.is_ok());
  std::vector<LayerBatch> step = f.step(TierId(0));
  for (TransferRequest& r : step[2].requests) r.src_tier = TierId(3);
  ASSERT_TRUE((*engine)->submit_step(std::move(step)).is_ok());
  for (int l = 0; l < kLayers; ++l) {
    Status s = (*engine)->wait_layer(LayerId(l));
    if (l != 2) {
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_TRUE(f.layer_exact(l)) << "layer " << l;
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("layer 2"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("injected transfer failure"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("after 2 retries"), std::string::npos) << s.message();
  }
  EXPECT_EQ((*ft)->injected_failures(), 3) << "first try + 2 retries";
  CopyStats s = (*engine)->stats();
  EXPECT_EQ(s.bytes_moved, (kLayers - 1) * kLayerBytes);
  EXPECT_EQ(s.layers[2].retries, 2);
}

// fail_after_posts with no retries: the layers after the first post fail, each naming itself.
TEST(CopyEngine, FailAfterFirstPostFailsLaterLayers) {
  Fixture f;
  FaultPolicy p;
  p.fail_after_posts = 1;  // only the first post (layer 0) succeeds...
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  f.register_host(**ft);
  CopyEngineConfig c = fast_config();
  c.max_retries = 0;
  auto engine = CopyEngine::create(**ft, c);
  ASSERT_TRUE(engine.is_ok());
  ASSERT_TRUE((*engine)->submit_step(f.step(TierId(0))).is_ok());
  EXPECT_TRUE((*engine)->wait_layer(LayerId(0)).is_ok());
  EXPECT_TRUE(f.layer_exact(0));
  for (int l = 1; l < kLayers; ++l) {
    Status s = (*engine)->wait_layer(LayerId(l));
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("layer " + std::to_string(l)), std::string::npos) << s.message();
  }
  CopyStats s = (*engine)->stats();
  EXPECT_EQ(s.bytes_moved, kLayerBytes);
  // The engine is reusable after a failed step, and wait_all reports the first failure.
  ASSERT_TRUE((*engine)->submit_step(f.step(TierId(0))).is_ok());
  EXPECT_EQ((*engine)->wait_all().code(), StatusCode::kUnavailable);
}

TEST(CopyEngine, NoResourceHalfTheTimeRetriesAndIsExact) {
  Fixture f;
  FaultPolicy p;
  p.no_resource_rate = 0.5;
  p.seed = 1234;
  auto ft = FaultInjectingTransport::create(loopback(), p);
  ASSERT_TRUE(ft.is_ok());
  f.register_host(**ft);
  seed_remote(**ft, (*ft)->inner(), f);
  auto engine = CopyEngine::create(**ft, fast_config());
  ASSERT_TRUE(engine.is_ok());
  int no_resource = 0;
  for (int step = 0; step < 5; ++step) {
    std::fill(f.work.begin(), f.work.end(), std::byte{0});
    ASSERT_TRUE((*engine)->submit_step(f.step(TierId(2))).is_ok());
    for (int l = 0; l < kLayers; ++l) {
      Status s = (*engine)->wait_layer(LayerId(l));
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_TRUE(f.layer_exact(l)) << "step " << step << " layer " << l;
    }
    for (const LayerCopyStats& l : (*engine)->stats().layers) no_resource += l.no_resource;
  }
  EXPECT_GT((*ft)->injected_no_resource(), 0);
  EXPECT_EQ(no_resource, (*ft)->injected_no_resource()) << "every NO_RESOURCE was re-posted";
}

// A serial link (loopback latency) plus an added delay: layer 0 is ready long before layer 3, and
// waiting for layer 0 does not wait for layer 3.
TEST(CopyEngine, WaitLayerZeroReturnsBeforeLayerThreeCompletes) {
  Fixture f;
  FaultPolicy p;
  p.added_delay = 2ms;
  auto ft = FaultInjectingTransport::create(loopback(15ms), p);
  ASSERT_TRUE(ft.is_ok());
  f.register_host(**ft);
  auto engine = CopyEngine::create(**ft, fast_config());
  ASSERT_TRUE(engine.is_ok());
  // Host → host is not a loopback pair; go through the remote tier.
  seed_remote(**ft, (*ft)->inner(), f);
  ASSERT_TRUE((*engine)->submit_step(f.step(TierId(2))).is_ok());
  ASSERT_TRUE((*engine)->wait_layer(LayerId(0)).is_ok());
  const auto layer0_returned = std::chrono::steady_clock::now();
  EXPECT_TRUE(f.layer_exact(0));
  ASSERT_TRUE((*engine)->wait_layer(LayerId(3)).is_ok());
  EXPECT_TRUE(f.layer_exact(3));
  CopyStats s = (*engine)->stats();
  ASSERT_EQ(s.layers.size(), static_cast<size_t>(kLayers));
  EXPECT_LT(s.layers[0].completed_at, layer0_returned);
  EXPECT_GT(s.layers[3].completed_at, layer0_returned);
  for (int l = 1; l < kLayers; ++l) {
    EXPECT_LT(s.layers[l - 1].completed_at, s.layers[l].completed_at) << "layer order";
  }
  EXPECT_GT(s.layers[3].wait_seconds, 0.0);
  EXPECT_GT(s.wait_seconds, 0.0);
}

TEST(CopyEngine, TimeoutCannotHang) {
  Fixture f;
  FaultPolicy p;
  p.added_delay = 60s;  // never completes within the test
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  f.register_host(**ft);
  CopyEngineConfig c = fast_config();
  c.layer_timeout = 50ms;
  c.wait_timeout = 500ms;
  auto engine = CopyEngine::create(**ft, c);
  ASSERT_TRUE(engine.is_ok());
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE((*engine)->submit_step(f.step(TierId(0))).is_ok());
  Status s = (*engine)->wait_layer(LayerId(1));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("layer 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("layer_timeout"), std::string::npos) << s.message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);

  // The caller-side bound alone: a wait shorter than the layer timeout gives up on its own.
  CopyEngineConfig c2 = fast_config();
  c2.layer_timeout = 200ms;
  c2.wait_timeout = 20ms;
  auto engine2 = CopyEngine::create(**ft, c2);
  ASSERT_TRUE(engine2.is_ok());
  ASSERT_TRUE((*engine2)->submit_step(f.step(TierId(0))).is_ok());
  Status s2 = (*engine2)->wait_layer(LayerId(0));
  EXPECT_EQ(s2.code(), StatusCode::kUnavailable);
  EXPECT_NE(s2.message().find("wait_timeout"), std::string::npos) << s2.message();
  EXPECT_EQ((*engine2)->submit_step(f.step(TierId(0))).code(), StatusCode::kInvalidArgument)
      << "previous step still in flight";
}

TEST(CopyEngine, DestructionWithInFlightWorkJoins) {
  for (int round = 0; round < 3; ++round) {
    auto f = std::make_unique<Fixture>();
    auto t = loopback(5ms);
    f->register_host(*t);
    seed_remote(*t, *t, *f);
    auto engine = CopyEngine::create(*t, fast_config());
    ASSERT_TRUE(engine.is_ok());
    ASSERT_TRUE((*engine)->submit_step(f->step(TierId(2))).is_ok());
    if (round == 1) {
      ASSERT_TRUE((*engine)->wait_layer(LayerId(0)).is_ok());
    }
    const auto start = std::chrono::steady_clock::now();
    engine->reset();  // runs ~CopyEngine with work in flight
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
    // Buffers may go now: the engine released (cancelled) every handle before returning.
    f.reset();
    t.reset();
  }
}

TEST(CopyEngine, RejectsBadConfig) {
  LocalTransport t;
  CopyEngineConfig c;
  c.max_retries = -1;
  EXPECT_FALSE(CopyEngine::create(t, c).is_ok());
  c = CopyEngineConfig{};
  c.wait_timeout = 0ms;
  EXPECT_FALSE(CopyEngine::create(t, c).is_ok());
}

}  // namespace
}  // namespace specontext::transport
