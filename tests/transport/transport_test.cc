// Transports: local, loopback and fault(loopback) through the conformance suite
// (transport_conformance.h: capabilities match behaviour, bit-exact random batches, validation,
// handle misuse, release); loopback cancellation of queued work; fault injection.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/ports/transport.h"
#include "tests/transport/transport_conformance.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"

namespace specontext::transport {
namespace {

using transport_conformance::OwningRig;
using transport_conformance::TransportCase;
using transport_conformance::TransportConformance;
using transport_conformance::TransportRig;

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

std::unique_ptr<TransportRig> rig(std::unique_ptr<Transport> t) {
  return std::make_unique<OwningRig>(std::move(t));
}

INSTANTIATE_TEST_SUITE_P(
    Transports, TransportConformance,
    ::testing::Values(TransportCase{.name = "local",
                                    .make = [] { return rig(make_local()); },
                                    .empty_done_at_post = true},
                      TransportCase{.name = "loopback", .make = [] { return rig(make_loopback()); }},
                      TransportCase{.name = "fault(loopback)",
                                    .make = [] { return rig(make_fault_loopback()); }}),
    transport_conformance::transport_case_name);

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
