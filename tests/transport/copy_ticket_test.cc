// CopyEngine tickets: out-of-order completion, per-ticket errors, retries under injected faults,
// timeouts and cancellation, window statistics (busy time is a union). Every wait is bounded by
// the engine's configured timeouts, so a bug shows up as a failure, not a hang.
#include <gtest/gtest.h>

#include <algorithm>
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
#include "transport/transport_router.h"

namespace specontext::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPage = 1024;
constexpr uint64_t kPages = 64;
constexpr uint64_t kBytes = kPage * kPages;
const TierId kHome(0), kWork(1), kRemote(2), kOtherHome(3);

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Host tiers: home (0, seeded pattern), work (1, zeroed), other home (3, another pattern).
struct Memory {
  std::vector<std::byte> home = std::vector<std::byte>(kBytes);
  std::vector<std::byte> work = std::vector<std::byte>(kBytes);
  std::vector<std::byte> other = std::vector<std::byte>(kBytes);
  Memory() {
    std::mt19937_64 rng(42);
    for (auto& b : home) b = static_cast<std::byte>(rng() & 0xff);
    for (auto& b : other) b = static_cast<std::byte>(rng() & 0xff);
  }
  void register_on(Transport& t) {
    ASSERT_TRUE(t.register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
    ASSERT_TRUE(t.register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
    ASSERT_TRUE(t.register_tier(kOtherHome, MemoryKind::kHost, other.data(), kBytes).is_ok());
  }
};

// Pages [first, first + n) of `src` into the same pages of `dst`, in reversed page order within
// the range (a permutation, so a wrong offset shows).
std::vector<TransferRequest> pages(TierId src, TierId dst, uint64_t first, uint64_t n) {
  std::vector<TransferRequest> out;
  for (uint64_t p = 0; p < n; ++p) {
    out.push_back({src, (first + n - 1 - p) * kPage, dst, (first + p) * kPage, kPage});
  }
  return out;
}
bool pages_exact(const std::vector<std::byte>& src, const std::vector<std::byte>& dst,
                 uint64_t first, uint64_t n) {
  for (uint64_t p = 0; p < n; ++p) {
    if (std::memcmp(dst.data() + (first + p) * kPage, src.data() + (first + n - 1 - p) * kPage,
                    kPage) != 0) {
      return false;
    }
  }
  return true;
}

CopyEngineConfig fast_config() {
  CopyEngineConfig c;
  c.retry_backoff = 10us;
  c.layer_timeout = 3000ms;
  c.wait_timeout = 4000ms;
  return c;
}

std::unique_ptr<LoopbackRemoteTransport> loopback(std::chrono::microseconds latency = 0us) {
  auto t = LoopbackRemoteTransport::create({latency});
  EXPECT_TRUE(t.is_ok());
  return std::move(t).value();
}

std::unique_ptr<CopyEngine> engine_on(Transport& t, CopyEngineConfig c = fast_config()) {
  auto e = CopyEngine::create(t, c);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return std::move(e).value();
}

// Runs one batch to completion directly on `t` (for seeding tiers outside the engine).
void run_direct(Transport& t, const TransferBatch& batch) {
  auto h = t.prepare(batch);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  Status s = t.post(*h);
  for (int i = 0; i < 200000 && s.code() == StatusCode::kInProgress; ++i) {
    std::this_thread::sleep_for(10us);
    s = t.poll(*h);
  }
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  t.release(*h);
}

TEST(CopyTicket, LocalTicketsExactAndCountedPerDirection) {
  Memory m;
  LocalTransport t;
  m.register_on(t);
  auto e = engine_on(t);
  e->reset_window();
  auto load = e->submit(LayerId(0), CopyDirection::kLoad, pages(kHome, kWork, 0, 16));
  auto store = e->submit(LayerId(1), CopyDirection::kStore, pages(kOtherHome, kWork, 16, 8));
  auto migrate = e->submit(LayerId(2), CopyDirection::kMigrate, pages(kHome, kOtherHome, 32, 4));
  ASSERT_TRUE(load.is_ok() && store.is_ok() && migrate.is_ok());
  EXPECT_NE(load->id, store->id);
  EXPECT_EQ(e->outstanding(), 3u);
  ASSERT_TRUE(e->wait(*store).is_ok());
  ASSERT_TRUE(e->wait(*load).is_ok());
  ASSERT_TRUE(e->wait(*migrate).is_ok());
  EXPECT_EQ(e->outstanding(), 0u);
  EXPECT_TRUE(pages_exact(m.home, m.work, 0, 16));
  EXPECT_TRUE(pages_exact(m.other, m.work, 16, 8));
  for (uint64_t p = 0; p < 4; ++p) {
    EXPECT_EQ(std::memcmp(m.other.data() + (32 + p) * kPage, m.home.data() + (35 - p) * kPage,
                          kPage), 0);
  }

  const CopyWindowStats w = e->window_stats();
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kLoad)], 16 * kPage);
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kStore)], 8 * kPage);
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kMigrate)], 4 * kPage);
  EXPECT_EQ(w.requests[static_cast<int>(CopyDirection::kLoad)], 16u);
  EXPECT_EQ(w.requests[static_cast<int>(CopyDirection::kStore)], 8u);
  EXPECT_EQ(w.requests[static_cast<int>(CopyDirection::kMigrate)], 4u);
  EXPECT_EQ(w.failures, 0);
  EXPECT_EQ(w.retries, 0);
  EXPECT_GT(w.busy_seconds, 0.0);
  EXPECT_EQ(e->stats().bytes_moved, 28 * kPage);

  e->reset_window();
  const CopyWindowStats z = e->window_stats();
  EXPECT_EQ(z.bytes[0] + z.bytes[1] + z.bytes[2], 0u);
  EXPECT_EQ(z.busy_seconds, 0.0);
  EXPECT_EQ(z.wait_seconds, 0.0);
}

TEST(CopyTicket, MisuseIsRejectedClearly) {
  Memory m;
  LocalTransport t;
  m.register_on(t);
  auto e = engine_on(t);

  // A bad batch fails synchronously, names layer and request, and submits nothing.
  std::vector<TransferRequest> bad = pages(kHome, kWork, 0, 8);
  bad[5].src_offset = kBytes;  // past the end
  auto r = e->submit(LayerId(7), CopyDirection::kLoad, bad);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(r.status().message().find("layer 7"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("request 5"), std::string::npos) << r.status().message();
  EXPECT_EQ(e->outstanding(), 0u);

  EXPECT_EQ(e->submit(LayerId(), CopyDirection::kLoad, pages(kHome, kWork, 0, 1)).status().code(),
            StatusCode::kInvalidArgument);

  // Unknown, never-issued and already waited tickets.
  EXPECT_EQ(e->wait(CopyTicket{}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->wait(CopyTicket{12345}).code(), StatusCode::kInvalidArgument);
  auto ok = e->submit(LayerId(0), CopyDirection::kLoad, pages(kHome, kWork, 0, 4));
  ASSERT_TRUE(ok.is_ok());
  ASSERT_TRUE(e->wait(*ok).is_ok());
  Status again = e->wait(*ok);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.message().find("already waited"), std::string::npos) << again.message();
  EXPECT_EQ(e->is_complete(*ok).status().code(), StatusCode::kInvalidArgument);

  // An empty batch is complete at once and still yields a ticket.
  auto empty = e->submit(LayerId(3), CopyDirection::kStore, {});
  ASSERT_TRUE(empty.is_ok());
  EXPECT_TRUE(empty->valid());
  auto done = e->is_complete(*empty);
  ASSERT_TRUE(done.is_ok());
  EXPECT_TRUE(*done);
  EXPECT_TRUE(e->wait(*empty).is_ok());
  EXPECT_TRUE(e->wait_all().is_ok()) << "nothing outstanding";
}

// A slow remote ticket (loopback latency) submitted first, a local one second: the local one
// completes and is waited while the remote one is still in flight; both arrive bit-exact.
TEST(CopyTicket, TicketsCompleteOutOfOrder) {
  Memory m;
  LocalTransport local;
  auto remote = loopback(300ms);
  auto router = TransportRouter::create({&local, remote.get()});
  ASSERT_TRUE(router.is_ok());
  m.register_on(**router);
  ASSERT_TRUE((*router)->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  auto e = engine_on(**router);
  e->reset_window();
  const Clock::time_point start = Clock::now();
  auto slow = e->submit(LayerId(0), CopyDirection::kStore, pages(kHome, kRemote, 0, 32));
  auto fast = e->submit(LayerId(1), CopyDirection::kLoad, pages(kHome, kWork, 32, 32));
  ASSERT_TRUE(slow.is_ok() && fast.is_ok());
  ASSERT_TRUE(e->wait(*fast).is_ok());
  const double fast_done = since(start);
  EXPECT_TRUE(pages_exact(m.home, m.work, 32, 32));
  auto slow_done = e->is_complete(*slow);
  ASSERT_TRUE(slow_done.is_ok());
  EXPECT_FALSE(*slow_done) << "the remote ticket is still in flight after " << fast_done << " s";
  EXPECT_LT(fast_done, 0.3) << "the local ticket did not wait for the remote one";
  ASSERT_TRUE(e->wait(*slow).is_ok());
  EXPECT_GE(since(start), 0.3);
  // Read the remote pages back (undoing the permutation) and compare with home.
  auto back = e->submit(LayerId(0), CopyDirection::kLoad, pages(kRemote, kWork, 0, 32));
  ASSERT_TRUE(back.is_ok());
  ASSERT_TRUE(e->wait(*back).is_ok());
  EXPECT_EQ(std::memcmp(m.work.data(), m.home.data(), 32 * kPage), 0);
  const CopyWindowStats w = e->window_stats();
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kStore)], 32 * kPage);
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kLoad)], 64 * kPage);
  EXPECT_GE(w.busy_seconds, 0.6) << "two serial remote round trips of 300 ms";
  EXPECT_GT(w.wait_seconds, 0.25);
}

// Layer 2 reads a tier whose transfers always fail: its wait returns the error naming layer 2
// after the retries; the other tickets succeed bit-exact; wait_all reports the first error.
TEST(CopyTicket, FailedTicketNamesItsLayerWhileOthersSucceed) {
  Memory m;
  FaultPolicy p;
  p.failure_rate = 1.0;
  p.target_tier = kOtherHome;
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  m.register_on(**ft);
  CopyEngineConfig c = fast_config();
  c.max_retries = 2;
  auto e = engine_on(**ft, c);
  for (int round = 0; round < 2; ++round) {
    std::fill(m.work.begin(), m.work.end(), std::byte{0});
    e->reset_window();
    std::vector<CopyTicket> tickets;
    for (int l = 0; l < 4; ++l) {
      auto t = e->submit(LayerId(l), CopyDirection::kLoad,
                         pages(l == 2 ? kOtherHome : kHome, kWork, l * 16, 16));
      ASSERT_TRUE(t.is_ok());
      tickets.push_back(*t);
    }
    if (round == 1) {  // wait_all: the first error in submission order is layer 2's
      Status s = e->wait_all();
      EXPECT_EQ(s.code(), StatusCode::kUnavailable);
      EXPECT_NE(s.message().find("layer 2"), std::string::npos) << s.message();
      EXPECT_EQ(e->wait(tickets[0]).code(), StatusCode::kInvalidArgument) << "consumed";
    } else {
      for (int l = 3; l >= 0; --l) {  // any order
        Status s = e->wait(tickets[l]);
        if (l != 2) {
          EXPECT_TRUE(s.is_ok()) << s.to_string();
          continue;
        }
        EXPECT_EQ(s.code(), StatusCode::kUnavailable);
        EXPECT_NE(s.message().find("layer 2 (load)"), std::string::npos) << s.message();
        EXPECT_NE(s.message().find("injected transfer failure"), std::string::npos) << s.message();
        EXPECT_NE(s.message().find("after 2 retries"), std::string::npos) << s.message();
      }
    }
    for (int l = 0; l < 4; ++l) {
      if (l != 2) {
        EXPECT_TRUE(pages_exact(m.home, m.work, l * 16, 16)) << "layer " << l;
      }
    }
    const CopyWindowStats w = e->window_stats();
    EXPECT_EQ(w.failures, 1);
    EXPECT_EQ(w.retries, 2);
    EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kLoad)], 3 * 16 * kPage);
  }
  EXPECT_EQ(e->outstanding(), 0u);
}

// NO_RESOURCE, transient failures and delays together, over a remote link: with enough retries
// every ticket arrives bit-exact, and the retries are counted.
TEST(CopyTicket, InjectedFaultsRetryToBitExactData) {
  Memory m;
  FaultPolicy p;
  p.seed = 77;
  p.no_resource_rate = 0.3;
  p.failure_rate = 0.2;
  p.added_delay = 200us;
  auto ft = FaultInjectingTransport::create(loopback(50us), p);
  ASSERT_TRUE(ft.is_ok());
  m.register_on(**ft);
  ASSERT_TRUE((*ft)->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  run_direct((*ft)->inner(), {{kHome, 0, kRemote, 0, kBytes}});  // remote = home, no faults
  CopyEngineConfig c = fast_config();
  c.max_retries = 60;  // 0.2^61: a transient failure never exhausts them
  auto e = engine_on(**ft, c);
  int64_t retries = 0, no_resource = 0;
  for (int round = 0; round < 6; ++round) {
    std::fill(m.work.begin(), m.work.end(), std::byte{0});
    e->reset_window();
    std::vector<CopyTicket> tickets;
    for (int l = 0; l < 8; ++l) {
      auto t = e->submit(LayerId(l), CopyDirection::kLoad, pages(kRemote, kWork, l * 8, 8));
      ASSERT_TRUE(t.is_ok());
      tickets.push_back(*t);
    }
    for (CopyTicket t : tickets) ASSERT_TRUE(e->wait(t).is_ok());
    for (int l = 0; l < 8; ++l) {
      ASSERT_TRUE(pages_exact(m.home, m.work, l * 8, 8)) << "round " << round << " layer " << l;
    }
    const CopyWindowStats w = e->window_stats();
    EXPECT_EQ(w.failures, 0);
    EXPECT_EQ(w.bytes[0], kBytes);
    retries += w.retries;
    no_resource += w.no_resource;
  }
  EXPECT_GT(retries, 0);
  EXPECT_GT(no_resource, 0);
  EXPECT_EQ(no_resource, (*ft)->injected_no_resource()) << "every NO_RESOURCE was re-posted";
  EXPECT_EQ(retries, (*ft)->injected_failures()) << "every injected failure was retried";
}

// A transport that fails for good (every post after the second): tickets end with a clear error
// naming the layer and the retries, promptly.
TEST(CopyTicket, HardFailureIsAClearErrorNotAHang) {
  Memory m;
  FaultPolicy p;
  p.fail_after_posts = 2;
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  m.register_on(**ft);
  CopyEngineConfig c = fast_config();
  c.max_retries = 3;
  auto e = engine_on(**ft, c);
  const Clock::time_point start = Clock::now();
  std::vector<CopyTicket> tickets;
  for (int l = 0; l < 4; ++l) {
    auto t = e->submit(LayerId(l), CopyDirection::kLoad, pages(kHome, kWork, l * 16, 16));
    ASSERT_TRUE(t.is_ok());
    tickets.push_back(*t);
  }
  for (int l = 0; l < 4; ++l) {
    Status s = e->wait(tickets[l]);
    if (l < 2) {
      EXPECT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_TRUE(pages_exact(m.home, m.work, l * 16, 16));
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("layer " + std::to_string(l)), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("fail after 2 posts"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("after 3 retries"), std::string::npos) << s.message();
  }
  EXPECT_LT(since(start), 2.0);
  EXPECT_EQ(e->window_stats().failures, 2);
}

// layer_timeout cancels on the copy thread; wait_timeout cancels from the waiter. In both cases
// the wait returns kUnavailable naming the layer, the ticket is consumed, and the transport never
// writes the destination afterwards.
TEST(CopyTicket, TimeoutsCancelAndReleaseTheBuffers) {
  Memory m;
  auto t = loopback(150ms);  // a link that answers too late for the timeouts below
  m.register_on(*t);
  ASSERT_TRUE(t->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  {
    CopyEngineConfig c = fast_config();
    c.layer_timeout = 30ms;
    auto e = engine_on(*t, c);
    const Clock::time_point start = Clock::now();
    auto tk = e->submit(LayerId(4), CopyDirection::kLoad, pages(kRemote, kWork, 0, 8));
    ASSERT_TRUE(tk.is_ok());
    Status s = e->wait(*tk);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("layer 4"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("layer_timeout"), std::string::npos) << s.message();
    EXPECT_LT(since(start), 2.0);
    EXPECT_EQ(e->window_stats().failures, 1);
  }
  {
    CopyEngineConfig c = fast_config();
    c.layer_timeout = 2s;
    c.wait_timeout = 30ms;
    auto e = engine_on(*t, c);
    const Clock::time_point start = Clock::now();
    auto a = e->submit(LayerId(5), CopyDirection::kLoad, pages(kRemote, kWork, 8, 8));
    auto b = e->submit(LayerId(6), CopyDirection::kLoad, pages(kRemote, kWork, 16, 8));
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    Status s = e->wait(*a);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_NE(s.message().find("layer 5"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("wait_timeout"), std::string::npos) << s.message();
    EXPECT_EQ(e->wait(*a).code(), StatusCode::kInvalidArgument) << "consumed";
    Status all = e->wait_all();  // b: the same, through wait_all
    EXPECT_NE(all.message().find("layer 6"), std::string::npos) << all.message();
    EXPECT_EQ(e->outstanding(), 0u);
    EXPECT_LT(since(start), 2.0);
  }
  // Uncancelled, the three transfers would land 150, 300 and 450 ms after their posts.
  std::this_thread::sleep_for(500ms);
  for (std::byte b : m.work) ASSERT_EQ(b, std::byte{0});
}

// Two 50 ms transfers in flight together count their union, not 100 ms; two in sequence
// count 100 ms, and the gap between them does not count.
TEST(CopyTicket, BusySecondsIsTheUnionOfIntervals) {
  Memory m;
  FaultPolicy p;
  p.added_delay = 50ms;
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  m.register_on(**ft);
  auto e = engine_on(**ft);

  e->reset_window();
  std::vector<LayerBatch> step;
  step.push_back({LayerId(0), pages(kHome, kWork, 0, 16)});
  step.push_back({LayerId(1), pages(kHome, kWork, 16, 16)});
  ASSERT_TRUE(e->submit_step(std::move(step)).is_ok());  // handed to the copy thread together
  ASSERT_TRUE(e->wait_all().is_ok());
  const CopyWindowStats together = e->window_stats();
  const CopyStats st = e->stats();
  ASSERT_EQ(st.layers.size(), 2u);
  EXPECT_GE(st.layers[0].copy_seconds + st.layers[1].copy_seconds, 0.1);
  EXPECT_GE(together.busy_seconds, 0.05);
  // Both were submitted at once and each layer's copy_seconds runs from that submission to its
  // end, so their union lies within the longer one (a sum would exceed it by the other's >= 50 ms).
  // No wall-clock bound: a loaded machine may post the second late.
  EXPECT_LE(together.busy_seconds, std::max(st.layers[0].copy_seconds, st.layers[1].copy_seconds) + 1e-3)
      << "overlapping intervals were summed";
  EXPECT_GT(together.wait_seconds, 0.03);
  EXPECT_LE(together.wait_seconds, together.busy_seconds + 0.01);

  e->reset_window();
  const Clock::time_point start = Clock::now();
  auto a = e->submit(LayerId(0), CopyDirection::kLoad, pages(kHome, kWork, 0, 16));
  ASSERT_TRUE(a.is_ok());
  ASSERT_TRUE(e->wait(*a).is_ok());
  std::this_thread::sleep_for(30ms);  // idle: not busy
  auto b = e->submit(LayerId(1), CopyDirection::kLoad, pages(kHome, kWork, 16, 16));
  ASSERT_TRUE(b.is_ok());
  ASSERT_TRUE(e->wait(*b).is_ok());
  const double window = since(start);
  const CopyWindowStats serial = e->window_stats();
  EXPECT_GE(serial.busy_seconds, 0.1);
  EXPECT_LE(serial.busy_seconds, window - 0.029) << "the idle gap counted as busy";
}

// submit_step and tickets share one mechanism: wait_all covers both, wait_layer after wait_all
// returns the cached status, and window stats count the step's batches.
TEST(CopyTicket, StepsAndTicketsCoexist) {
  Memory m;
  LocalTransport t;
  m.register_on(t);
  auto e = engine_on(t);
  e->reset_window();
  std::vector<LayerBatch> step;
  step.push_back({LayerId(1), pages(kHome, kWork, 0, 8)});
  step.push_back({LayerId(0), pages(kHome, kWork, 8, 8), CopyDirection::kStore});
  step.push_back({LayerId(2), {}});  // empty: complete at once
  ASSERT_TRUE(e->submit_step(std::move(step)).is_ok());
  auto extra = e->submit(LayerId(9), CopyDirection::kMigrate, pages(kHome, kWork, 16, 8));
  ASSERT_TRUE(extra.is_ok());
  EXPECT_EQ(e->outstanding(), 4u);
  ASSERT_TRUE(e->wait_all().is_ok());
  EXPECT_EQ(e->outstanding(), 0u);
  EXPECT_TRUE(e->wait_layer(LayerId(1)).is_ok());
  EXPECT_TRUE(e->wait_layer(LayerId(2)).is_ok());
  EXPECT_EQ(e->wait(*extra).code(), StatusCode::kInvalidArgument) << "wait_all consumed it";
  EXPECT_TRUE(pages_exact(m.home, m.work, 0, 8));
  EXPECT_TRUE(pages_exact(m.home, m.work, 8, 8));
  EXPECT_TRUE(pages_exact(m.home, m.work, 16, 8));
  const CopyWindowStats w = e->window_stats();
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kLoad)], 8 * kPage);
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kStore)], 8 * kPage);
  EXPECT_EQ(w.bytes[static_cast<int>(CopyDirection::kMigrate)], 8 * kPage);
  const CopyStats s = e->stats();
  ASSERT_EQ(s.layers.size(), 3u);
  EXPECT_EQ(s.layers[0].layer, LayerId(0));
  EXPECT_EQ(s.layers[0].bytes, 8 * kPage);
  EXPECT_EQ(s.layers[2].bytes, 0u);

  // The next step drops the previous one; its layers are no longer waitable.
  ASSERT_TRUE(e->submit_step({{LayerId(5), pages(kHome, kWork, 0, 4)}}).is_ok());
  EXPECT_TRUE(e->wait_layer(LayerId(1)).is_ok()) << "no batch for layer 1 in this step";
  EXPECT_TRUE(e->wait_layer(LayerId(5)).is_ok());
  EXPECT_EQ(e->stats().steps, 2u);
}

// A transport whose post blocks (a broken fabric): stands in for a copy thread stuck in a call.
class BlockingPostTransport final : public Transport {
 public:
  explicit BlockingPostTransport(std::chrono::milliseconds block) : block_(block) {}
  std::string_view name() const override { return "blocking"; }
  Capabilities capabilities() const override { return inner_.capabilities(); }
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override {
    return inner_.register_tier(tier, kind, base, bytes);
  }
  Result<TransferHandle> prepare(const TransferBatch& batch) override {
    return inner_.prepare(batch);
  }
  Status post(TransferHandle& h) override {
    std::this_thread::sleep_for(block_);
    return inner_.post(h);
  }
  Status poll(TransferHandle& h) override { return inner_.poll(h); }
  void release(TransferHandle& h) override { inner_.release(h); }

 private:
  LocalTransport inner_;
  const std::chrono::milliseconds block_;
};

// The wait cannot cancel a ticket whose transport call blocks; it says so (kInternal, ticket
// still outstanding) instead of hanging, and once the call returns the ticket can be waited.
TEST(CopyTicket, StuckTransportCallIsReportedNotAHang) {
  Memory m;
  BlockingPostTransport t(400ms);
  m.register_on(t);
  CopyEngineConfig c = fast_config();
  c.wait_timeout = 30ms;
  auto e = engine_on(t, c);
  const Clock::time_point start = Clock::now();
  auto tk = e->submit(LayerId(3), CopyDirection::kLoad, pages(kHome, kWork, 0, 8));
  ASSERT_TRUE(tk.is_ok());
  Status s = e->wait(*tk);
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.to_string();
  EXPECT_NE(s.message().find("layer 3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("stays outstanding"), std::string::npos) << s.message();
  EXPECT_LT(since(start), 0.3);
  EXPECT_EQ(e->outstanding(), 1u);
  std::this_thread::sleep_for(500ms);  // the post returns (OK) meanwhile
  EXPECT_TRUE(e->wait(*tk).is_ok());
  EXPECT_TRUE(pages_exact(m.home, m.work, 0, 8));
  EXPECT_EQ(e->outstanding(), 0u);
}

TEST(CopyTicket, DestructionWithOutstandingTicketsJoins) {
  for (int round = 0; round < 3; ++round) {
    auto m = std::make_unique<Memory>();
    auto t = loopback(5ms);
    m->register_on(*t);
    ASSERT_TRUE(t->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
    auto e = engine_on(*t);
    for (int l = 0; l < 6; ++l) {
      ASSERT_TRUE(e->submit(LayerId(l), CopyDirection::kStore, pages(kHome, kRemote, l * 8, 8))
                      .is_ok());
    }
    if (round == 1) std::this_thread::sleep_for(7ms);
    const Clock::time_point start = Clock::now();
    e.reset();
    EXPECT_LT(since(start), 1.0);
    m.reset();  // buffers may go: the engine released every handle
    t.reset();
  }
}

}  // namespace
}  // namespace specontext::transport
