// Transports: advertised capabilities match behaviour, bit-exact random batches, validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/ports/transport.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"

namespace specontext::transport {
namespace {

using Factory = std::function<std::unique_ptr<Transport>()>;

std::unique_ptr<Transport> make_local() { return std::make_unique<LocalTransport>(); }
std::unique_ptr<Transport> make_loopback() {
  auto t = LoopbackRemoteTransport::create();
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return std::move(t).value();
}
std::unique_ptr<Transport> make_fault_loopback() {
  auto t = FaultInjectingTransport::create(make_loopback(), FaultPolicy{});
  EXPECT_TRUE(t.is_ok());
  return std::move(t).value();
}

// post, then poll until terminal (bounded: ~2 s).
Status run_to_end(Transport& t, TransferHandle& h) {
  Status s = t.post(h);
  for (int i = 0; i < 200000 && s.code() == StatusCode::kInProgress; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(10));
    s = t.poll(h);
  }
  return s;
}

void fill(std::vector<std::byte>& buf, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& b : buf) b = static_cast<std::byte>(rng() & 0xff);
}

const MemoryKind kAllKinds[] = {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice,
                                MemoryKind::kRemote};

struct Named {
  const char* name;
  Factory make;
};
const Named kTransports[] = {{"local", make_local},
                             {"loopback", make_loopback},
                             {"fault(loopback)", make_fault_loopback}};

// Every (src kind, dst kind) pair: a transfer works exactly when the pair is advertised.
TEST(TransportCapabilities, EveryPairMatchesAdvertisement) {
  for (const Named& tn : kTransports) {
    for (MemoryKind src : kAllKinds) {
      for (MemoryKind dst : kAllKinds) {
        SCOPED_TRACE(std::string(tn.name) + " " + std::string(memory_kind_name(src)) + " -> " +
                     std::string(memory_kind_name(dst)));
        auto t = tn.make();
        const bool advertised = t->capabilities().supports(src, dst);
        std::vector<std::byte> a(256), b(256);
        fill(a, 7);
        auto reg = [&](TierId id, MemoryKind kind, std::vector<std::byte>& mem) {
          return t->register_tier(id, kind, kind == MemoryKind::kRemote ? nullptr : mem.data(),
                                  mem.size());
        };
        Status ra = reg(TierId(0), src, a);
        Status rb = reg(TierId(1), dst, b);
        if (!ra.is_ok() || !rb.is_ok()) {
          EXPECT_FALSE(advertised) << "advertised but cannot register: " << ra.to_string() << " "
                                   << rb.to_string();
          if (!ra.is_ok()) {
            EXPECT_EQ(ra.code(), StatusCode::kUnimplemented) << ra.to_string();
          }
          if (!rb.is_ok()) {
            EXPECT_EQ(rb.code(), StatusCode::kUnimplemented) << rb.to_string();
          }
          continue;
        }
        auto h = t->prepare({{TierId(0), 0, TierId(1), 64, 128}});
        if (!advertised) {
          ASSERT_FALSE(h.is_ok());
          EXPECT_EQ(h.status().code(), StatusCode::kUnimplemented) << h.status().to_string();
          continue;
        }
        ASSERT_TRUE(h.is_ok()) << h.status().to_string();
        EXPECT_TRUE(run_to_end(*t, *h).is_ok());
        t->release(*h);
        EXPECT_FALSE(h->valid());
        if (src != MemoryKind::kRemote && dst != MemoryKind::kRemote) {
          EXPECT_EQ(std::memcmp(a.data(), b.data() + 64, 128), 0);
        }
      }
    }
  }
  EXPECT_FALSE(LocalTransport().capabilities().remote);
  EXPECT_TRUE(make_loopback()->capabilities().remote);
}

// Random batches of random ranges; the destination is checked byte for byte, and bytes outside
// the copied ranges must be untouched (guard check).
void random_batches(Transport& t, TierId src, const std::vector<std::byte>& src_mem, TierId dst,
                    std::vector<std::byte>& dst_mem, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::byte> expect = dst_mem;
    TransferBatch batch;
    // Non-overlapping destination chunks so the expected image is order-independent.
    const uint64_t chunk = dst_mem.size() / 32;
    for (uint64_t c = 0; c < 32; ++c) {
      if (rng() % 3 == 0) continue;
      const uint64_t bytes = 1 + rng() % chunk;
      const uint64_t dst_off = c * chunk + rng() % (chunk - bytes + 1);
      const uint64_t src_off = rng() % (src_mem.size() - bytes + 1);
      batch.push_back({src, src_off, dst, dst_off, bytes});
      std::memcpy(expect.data() + dst_off, src_mem.data() + src_off, bytes);
    }
    auto h = t.prepare(batch);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    ASSERT_TRUE(run_to_end(t, *h).is_ok());
    EXPECT_TRUE(t.poll(*h).is_ok()) << "poll is idempotent once terminal";
    t.release(*h);
    ASSERT_EQ(std::memcmp(expect.data(), dst_mem.data(), expect.size()), 0) << "round " << round;
  }
}

TEST(TransportData, LocalRandomBatchesBitExact) {
  LocalTransport t;
  std::vector<std::byte> a(1 << 16), b(1 << 16);
  fill(a, 11);
  fill(b, 12);
  ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kPinnedHost, b.data(), b.size()).is_ok());
  random_batches(t, TierId(0), a, TierId(1), b, 13);
}

// host → remote → host round trips: the remote tier must hold exactly what was written.
TEST(TransportData, LoopbackRoundTripBitExact) {
  auto t = make_loopback();
  const uint64_t n = 1 << 16;
  std::vector<std::byte> a(n), back(n);
  fill(a, 21);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kHost, a.data(), n).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kHost, back.data(), n).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(9), MemoryKind::kRemote, nullptr, n).is_ok());
  std::mt19937_64 rng(22);
  for (int round = 0; round < 20; ++round) {
    std::vector<uint64_t> perm(16);
    for (uint64_t i = 0; i < 16; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const uint64_t page = n / 16;
    TransferBatch put, get;
    for (uint64_t i = 0; i < 16; ++i) {
      put.push_back({TierId(0), i * page, TierId(9), perm[i] * page, page});
      get.push_back({TierId(9), perm[i] * page, TierId(1), i * page, page});
    }
    auto hp = t->prepare(put);
    ASSERT_TRUE(hp.is_ok());
    ASSERT_TRUE(run_to_end(*t, *hp).is_ok());
    t->release(*hp);
    std::fill(back.begin(), back.end(), std::byte{0});
    auto hg = t->prepare(get);
    ASSERT_TRUE(hg.is_ok());
    ASSERT_TRUE(run_to_end(*t, *hg).is_ok());
    t->release(*hg);
    ASSERT_EQ(std::memcmp(a.data(), back.data(), n), 0) << "round " << round;
    fill(a, 100 + round);
  }
}

TEST(TransportData, LoopbackRandomBatchesBitExact) {
  auto t = make_loopback();
  std::vector<std::byte> a(1 << 15), b(1 << 15);
  fill(a, 31);
  fill(b, 32);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kPinnedHost, b.data(), b.size()).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(2), MemoryKind::kRemote, nullptr, a.size()).is_ok());
  auto h = t->prepare({{TierId(0), 0, TierId(2), 0, a.size()}});
  ASSERT_TRUE(h.is_ok());
  ASSERT_TRUE(run_to_end(*t, *h).is_ok());
  t->release(*h);
  random_batches(*t, TierId(2), a, TierId(1), b, 33);  // remote now holds a copy of `a`
}

TEST(TransportValidation, ErrorsNameRequestAndTier) {
  LocalTransport t;
  std::vector<std::byte> a(4096), b(1024);
  ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kHost, b.data(), b.size()).is_ok());

  auto expect_error = [&](const TransferBatch& batch, StatusCode code,
                          std::vector<std::string> parts) {
    auto h = t.prepare(batch);
    ASSERT_FALSE(h.is_ok());
    EXPECT_EQ(h.status().code(), code) << h.status().to_string();
    for (const std::string& p : parts) {
      EXPECT_NE(h.status().message().find(p), std::string::npos)
          << "'" << p << "' missing in: " << h.status().message();
    }
  };
  const TransferRequest ok{TierId(0), 0, TierId(1), 0, 512};
  expect_error({ok, {TierId(0), 0, TierId(1), 1000, 100}}, StatusCode::kOutOfRange,
               {"request 1", "dst tier 1", "1024"});
  expect_error({{TierId(0), 4000, TierId(1), 0, 100}}, StatusCode::kOutOfRange,
               {"request 0", "src tier 0"});
  expect_error({ok, ok, {TierId(5), 0, TierId(1), 0, 8}}, StatusCode::kInvalidArgument,
               {"request 2", "src tier 5", "not registered"});
  expect_error({{TierId(0), 0, TierId(6), 0, 8}}, StatusCode::kInvalidArgument,
               {"request 0", "dst tier 6"});
  // offset + bytes would wrap around 2^64
  expect_error({{TierId(0), ~0ull - 4, TierId(1), 0, 8}}, StatusCode::kOutOfRange,
               {"request 0", "src tier 0"});
  expect_error({{TierId(0), 0, TierId(0), 100, 200}}, StatusCode::kInvalidArgument,
               {"request 0", "overlap", "tier 0"});

  // Registration errors.
  EXPECT_EQ(t.register_tier(TierId(0), MemoryKind::kHost, a.data(), 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(t.register_tier(TierId(2), MemoryKind::kHost, nullptr, 8).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(t.register_tier(TierId(3), MemoryKind::kDevice, a.data(), 8).code(),
            StatusCode::kUnimplemented);
  EXPECT_EQ(t.register_tier(TierId(), MemoryKind::kHost, a.data(), 8).code(),
            StatusCode::kInvalidArgument);

  // Handle misuse.
  auto h = t.prepare({ok});
  ASSERT_TRUE(h.is_ok());
  EXPECT_FALSE(t.poll(*h).is_ok()) << "poll before post";
  EXPECT_TRUE(t.post(*h).is_ok());
  EXPECT_FALSE(t.post(*h).is_ok()) << "posted twice";
  TransferHandle copy = *h;
  t.release(*h);
  t.release(*h);  // idempotent
  EXPECT_EQ(t.poll(copy).code(), StatusCode::kInvalidArgument) << "released";
}

// Releasing transfers still queued on the loopback worker cancels them without touching the
// (then freed) buffers; destroying the transport with queued work joins cleanly.
TEST(TransportCancel, LoopbackReleaseQueuedAndDestroy) {
  auto made = LoopbackRemoteTransport::create({std::chrono::milliseconds(5)});
  ASSERT_TRUE(made.is_ok());
  auto t = std::move(made).value();
  auto a = std::make_unique<std::vector<std::byte>>(4096);
  ASSERT_TRUE(t->register_tier(TierId(0), MemoryKind::kHost, a->data(), a->size()).is_ok());
  ASSERT_TRUE(t->register_tier(TierId(1), MemoryKind::kRemote, nullptr, 4096).is_ok());
  std::vector<TransferHandle> hs;
  for (int i = 0; i < 8; ++i) {
    auto h = t->prepare({{TierId(0), 0, TierId(1), 0, 4096}});
    ASSERT_TRUE(h.is_ok());
    EXPECT_EQ(t->post(*h).code(), StatusCode::kInProgress);
    hs.push_back(*h);
  }
  for (int i = 0; i < 4; ++i) t->release(hs[i]);
  const auto start = std::chrono::steady_clock::now();
  t.reset();  // hs[4..7] still queued
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(FaultTransport, RejectsBadPolicy) {
  FaultPolicy p;
  p.failure_rate = 1.5;
  EXPECT_FALSE(FaultInjectingTransport::create(make_local(), p).is_ok());
  EXPECT_FALSE(FaultInjectingTransport::create(nullptr, FaultPolicy{}).is_ok());
}

TEST(FaultTransport, FailAfterNPosts) {
  FaultPolicy p;
  p.fail_after_posts = 2;
  auto made = FaultInjectingTransport::create(make_local(), p);
  ASSERT_TRUE(made.is_ok());
  Transport& t = **made;
  std::vector<std::byte> a(64), b(64);
  ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kHost, a.data(), 64).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kHost, b.data(), 64).is_ok());
  for (int i = 0; i < 4; ++i) {
    auto h = t.prepare({{TierId(0), 0, TierId(1), 0, 64}});
    ASSERT_TRUE(h.is_ok());
    Status s = t.post(*h);
    if (i < 2) {
      EXPECT_TRUE(s.is_ok()) << s.to_string();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable);
      EXPECT_NE(s.message().find("fail after 2"), std::string::npos) << s.message();
    }
    t.release(*h);
  }
  EXPECT_EQ((*made)->injected_failures(), 2);
}

}  // namespace
}  // namespace specontext::transport
