// TransportRouter: capabilities are the union and match behaviour, mixed batches split across
// members and arrive bit-exact, unservable requests are rejected by index, NO_RESOURCE from one
// member after another started, failures and cancellation across members.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/tests_common.h"
#include "tests/transport/transport_conformance.h"
#include "transport/copy_engine.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"
#include "transport/transport_router.h"

namespace specontext::transport {
namespace {

using namespace std::chrono_literals;

using specontext::testing::fill_random;
using transport_conformance::expect_mentions;
using transport_conformance::OwningRig;
using transport_conformance::run_batch;
using transport_conformance::run_to_end;
using transport_conformance::TransportCase;
using transport_conformance::TransportConformance;

constexpr uint64_t kBytes = 1 << 15;
const TierId kHome(0), kWork(1), kRemote(2);

std::unique_ptr<LoopbackRemoteTransport> loopback(std::chrono::microseconds latency = 0us) {
  auto t = LoopbackRemoteTransport::create({latency});
  EXPECT_TRUE(t.is_ok());
  return std::move(t).value();
}

std::unique_ptr<TransportRouter> router(std::vector<Transport*> members) {
  auto r = TransportRouter::create(std::move(members));
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return std::move(r).value();
}

bool all_zero(const std::byte* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    if (p[i] != std::byte{0}) return false;
  }
  return true;
}

TEST(TransportRouter, CreateRejectsBadMemberLists) {
  LocalTransport a;
  EXPECT_EQ(TransportRouter::create({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(TransportRouter::create({&a, nullptr}).status().code(), StatusCode::kInvalidArgument);
  Status dup = TransportRouter::create({&a, &a}).status();
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  expect_mentions(dup, {"member 1", "twice"});
}

// The conformance suite through a router of local and loopback: every pair works exactly when
// advertised; a pair no member serves is kInvalidArgument (the cases below name the members);
// the empty batch is complete at post.
INSTANTIATE_TEST_SUITE_P(
    LocalAndLoopback, TransportConformance,
    ::testing::Values(TransportCase{
        .name = "router(local,loopback)",
        .make = [] {
          std::vector<std::unique_ptr<Transport>> members;
          members.push_back(std::make_unique<LocalTransport>());
          members.push_back(loopback());
          auto r = router({members[0].get(), members[1].get()});
          return std::unique_ptr<transport_conformance::TransportRig>(
              std::make_unique<OwningRig>(std::move(r), std::move(members)));
        },
        .unsupported_pair = StatusCode::kInvalidArgument,
        .empty_done_at_post = true}),
    transport_conformance::transport_case_name);

// Capabilities are the union of the members'; a kind no member takes, or a pair none serves, is
// refused naming that.
TEST(TransportRouter, CapabilitiesAreTheUnionAndRefusalsSayNoMember) {
  const MemoryKind kinds[] = {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice,
                              MemoryKind::kRemote};
  LocalTransport local;
  auto remote = loopback();
  auto r = router({&local, remote.get()});
  const Capabilities lc = local.capabilities(), rc = remote->capabilities(),
                     uc = r->capabilities();
  for (MemoryKind s : kinds) {
    for (MemoryKind d : kinds) EXPECT_EQ(uc.supports(s, d), lc.supports(s, d) || rc.supports(s, d));
  }
  EXPECT_TRUE(uc.remote);
  LocalTransport only;
  EXPECT_FALSE(router({&only})->capabilities().remote);

  std::vector<std::byte> mem(256);
  const Status dev = r->register_tier(TierId(0), MemoryKind::kDevice, mem.data(), mem.size());
  EXPECT_EQ(dev.code(), StatusCode::kUnimplemented) << dev.to_string();
  expect_mentions(dev, {"no member transport accepts memory kind device"});
  ASSERT_TRUE(r->register_tier(TierId(0), MemoryKind::kRemote, nullptr, 256).is_ok());
  ASSERT_TRUE(r->register_tier(TierId(1), MemoryKind::kRemote, nullptr, 256).is_ok());
  auto h = r->prepare({{TierId(0), 0, TierId(1), 64, 128}});
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
  expect_mentions(h.status(), {"request 0", "no member", "tier 0", "tier 1"});
}

// One batch mixing host→host (LocalTransport) and host→remote (loopback) requests, then one
// mixing remote→host and host→host: every byte arrives, nothing outside the ranges changes.
TEST(TransportRouter, MixedBatchSplitsAcrossMembersBitExact) {
  LocalTransport local;
  auto remote = loopback(500us);
  auto r = router({&local, remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes), back(kBytes);
  fill_random(home, 1);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kPinnedHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(TierId(3), MemoryKind::kHost, back.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());

  auto to_local = r->route({kHome, 0, kWork, 0, 8});
  auto to_remote = r->route({kHome, 0, kRemote, 0, 8});
  ASSERT_TRUE(to_local.is_ok() && to_remote.is_ok());
  EXPECT_EQ(*to_local, 0u) << "host -> pinned goes to the first member that serves it";
  EXPECT_EQ(*to_remote, 1u);

  std::mt19937_64 rng(5);
  for (int round = 0; round < 10; ++round) {
    fill_random(home, 100 + round);
    std::fill(work.begin(), work.end(), std::byte{0});
    std::fill(back.begin(), back.end(), std::byte{0});
    // 32 chunks; each goes either home→work directly or home→remote (and later remote→back).
    const uint64_t chunk = kBytes / 32;
    TransferBatch put, get;
    std::vector<bool> via_remote(32);
    for (uint64_t c = 0; c < 32; ++c) {
      const uint64_t src = ((c * 7) % 32) * chunk;  // a permutation of the chunks
      via_remote[c] = rng() % 2 == 0;
      if (via_remote[c]) {
        put.push_back({kHome, src, kRemote, c * chunk, chunk});
        get.push_back({kRemote, c * chunk, TierId(3), c * chunk, chunk - 16});  // guard: 16 B
      } else {
        put.push_back({kHome, src, kWork, c * chunk, chunk});
        get.push_back({kHome, src, TierId(3), c * chunk, chunk - 16});
      }
    }
    ASSERT_TRUE(run_batch(*r, put).is_ok());
    ASSERT_TRUE(run_batch(*r, get).is_ok());
    for (uint64_t c = 0; c < 32; ++c) {
      const uint64_t src = ((c * 7) % 32) * chunk;
      SCOPED_TRACE("round " + std::to_string(round) + " chunk " + std::to_string(c));
      ASSERT_EQ(std::memcmp(back.data() + c * chunk, home.data() + src, chunk - 16), 0);
      ASSERT_TRUE(all_zero(back.data() + (c + 1) * chunk - 16, 16)) << "guard overwritten";
      if (via_remote[c]) {
        ASSERT_TRUE(all_zero(work.data() + c * chunk, chunk)) << "went to the wrong tier";
      } else {
        ASSERT_EQ(std::memcmp(work.data() + c * chunk, home.data() + src, chunk), 0);
      }
    }
  }
}

TEST(TransportRouter, RejectsWhatNoMemberServesNamingTheRequest) {
  LocalTransport local;
  auto remote = loopback();
  auto r = router({&local, remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(TierId(4), MemoryKind::kRemote, nullptr, kBytes).is_ok());
  const TransferRequest h2h{kHome, 0, kWork, 0, 64};
  const TransferRequest h2r{kHome, 0, kRemote, 0, 64};

  auto bad = r->prepare({h2h, h2r, {kRemote, 0, TierId(4), 0, 64}});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  expect_mentions(bad.status(), {"request 2", "tier 2 (remote)", "tier 4 (remote)", "no member"});

  auto unknown = r->prepare({h2h, {kHome, 0, TierId(9), 0, 64}});
  ASSERT_FALSE(unknown.is_ok());
  expect_mentions(unknown.status(), {"request 1", "dst tier 9", "not registered"});

  // Out of range in the second request of the loopback's sub-batch: the caller's index (3), not
  // the sub-batch's (1).
  auto range = r->prepare({h2r, h2h, h2h, {kHome, 0, kRemote, kBytes - 8, 64}});
  ASSERT_FALSE(range.is_ok());
  EXPECT_EQ(range.status().code(), StatusCode::kOutOfRange);
  expect_mentions(range.status(), {"router: request 3", "dst tier 2"});

  auto overlap = r->prepare({{kHome, 0, kHome, 32, 64}});
  ASSERT_FALSE(overlap.is_ok());
  expect_mentions(overlap.status(), {"request 0", "overlap"});

  // Registration (the generic refusals are in the conformance suite).
  Status dev = r->register_tier(TierId(6), MemoryKind::kDevice, home.data(), 8);
  EXPECT_EQ(dev.code(), StatusCode::kUnimplemented);
  // A member's own refusal is reported with the member's name (loopback: remote takes no base).
  Status member = r->register_tier(TierId(7), MemoryKind::kRemote, home.data(), 8);
  EXPECT_EQ(member.code(), StatusCode::kInvalidArgument);
  expect_mentions(member, {"member 1 (loopback)", "null base"});

  // Misuse of a handle spanning both members.
  auto h = r->prepare({h2h, h2r});
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(r->poll(*h).code(), StatusCode::kInvalidArgument) << "poll before post";
  ASSERT_TRUE(run_to_end(*r, *h).is_ok());
  EXPECT_EQ(r->post(*h).code(), StatusCode::kInvalidArgument) << "posted twice";
  EXPECT_TRUE(r->poll(*h).is_ok()) << "idempotent once terminal";
  TransferHandle copy = *h;
  r->release(*h);
  r->release(*h);
  EXPECT_EQ(r->poll(copy).code(), StatusCode::kInvalidArgument) << "released";
  TransferHandle foreign = *local.prepare({h2h});
  EXPECT_EQ(r->post(foreign).code(), StatusCode::kInvalidArgument) << "another transport's handle";
  local.release(foreign);
}

// Member 0 (local behind a fault wrapper) answers NO_RESOURCE half the time, member 1 (loopback)
// always starts: when member 0 refuses after member 1 started, post returns kInProgress and poll
// re-posts member 0's part until it is accepted; the data are exact every time.
TEST(TransportRouter, NoResourceAfterAnotherMemberStartedIsRepostedOnPoll) {
  FaultPolicy p;
  p.no_resource_rate = 0.5;
  p.seed = 99;
  auto flaky = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(flaky.is_ok());
  auto remote = loopback(200us);
  auto r = router({flaky->get(), remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes), back(kBytes);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(TierId(3), MemoryKind::kHost, back.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  const uint64_t half = kBytes / 2;
  int started_with_no_resource = 0;
  for (int round = 0; round < 30; ++round) {
    fill_random(home, 300 + round);
    auto h = r->prepare({{kHome, 0, kWork, 0, half}, {kHome, half, kRemote, 0, half}});
    ASSERT_TRUE(h.is_ok());
    const int64_t before = r->partial_no_resource();
    Status s = r->post(*h);
    ASSERT_NE(s.code(), StatusCode::kResourceExhausted) << "loopback's part always starts";
    for (int i = 0; i < 200000 && s.code() == StatusCode::kInProgress; ++i) {
      std::this_thread::sleep_for(10us);
      s = r->poll(*h);
    }
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    r->release(*h);
    started_with_no_resource += static_cast<int>(r->partial_no_resource() - before);
    ASSERT_TRUE(run_batch(*r, {{kRemote, 0, TierId(3), 0, half}}).is_ok());
    ASSERT_EQ(std::memcmp(work.data(), home.data(), half), 0) << "round " << round;
    ASSERT_EQ(std::memcmp(back.data(), home.data() + half, half), 0) << "round " << round;
  }
  EXPECT_GT(started_with_no_resource, 0) << "the partial case never happened; change the seed";
  EXPECT_EQ(started_with_no_resource, r->partial_no_resource());
}

// Every member refuses: NO_RESOURCE, nothing started, the handle stays prepared. A transfer that
// started on one member while the other refuses for ever keeps reporting kInProgress; release
// cancels the started part, which then never writes its destination.
TEST(TransportRouter, AllNoResourceStaysPreparedAndReleaseCancels) {
  FaultPolicy p;
  p.no_resource_rate = 1.0;
  auto refusing = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(refusing.is_ok());
  auto remote = loopback(60ms);
  auto r = router({refusing->get(), remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes);
  fill_random(home, 3);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(run_batch(*r, {{kHome, 0, kRemote, 0, kBytes}}).is_ok());  // loopback only

  auto only_local = r->prepare({{kHome, 0, kWork, 0, 64}});
  ASSERT_TRUE(only_local.is_ok());
  Status s = r->post(*only_local);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.to_string();
  EXPECT_EQ(r->poll(*only_local).code(), StatusCode::kInvalidArgument) << "still not posted";
  EXPECT_EQ(r->post(*only_local).code(), StatusCode::kResourceExhausted) << "may post again";
  r->release(*only_local);

  const uint64_t half = kBytes / 2;
  auto mixed = r->prepare({{kHome, 0, kWork, 0, half}, {kRemote, half, kWork, half, half}});
  ASSERT_TRUE(mixed.is_ok());
  EXPECT_EQ(r->post(*mixed).code(), StatusCode::kInProgress);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r->poll(*mixed).code(), StatusCode::kInProgress);
  r->release(*mixed);  // before the link's 60 ms: the loopback part is dropped
  std::this_thread::sleep_for(120ms);
  EXPECT_TRUE(all_zero(work.data(), kBytes)) << "a cancelled part wrote its destination";
}

// A failure in one member's part fails the whole transfer with that member's name, cancels the
// other member's part, and stays the poll result.
TEST(TransportRouter, FailureInOneMemberFailsTheTransferAndCancelsTheRest) {
  FaultPolicy p;
  p.failure_rate = 1.0;
  auto failing = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(failing.is_ok());
  auto remote = loopback(60ms);
  auto r = router({failing->get(), remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes);
  fill_random(home, 4);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(run_batch(*r, {{kHome, 0, kRemote, 0, kBytes}}).is_ok());

  const uint64_t half = kBytes / 2;
  auto h = r->prepare({{kRemote, half, kWork, half, half}, {kHome, 0, kWork, 0, half}});
  ASSERT_TRUE(h.is_ok());
  EXPECT_EQ(r->post(*h).code(), StatusCode::kInProgress);
  Status s = r->poll(*h);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  expect_mentions(s, {"router: member 0 (fault)", "injected transfer failure"});
  Status again = r->poll(*h);
  EXPECT_EQ(again.code(), StatusCode::kUnavailable);
  EXPECT_EQ(again.message(), s.message());
  std::this_thread::sleep_for(120ms);
  EXPECT_TRUE(all_zero(work.data() + half, half)) << "the loopback part was not cancelled";
  r->release(*h);
}

// The copy engine over a router whose local member fails transiently: tickets are retried (a
// fresh prepare through the router) and arrive exact.
TEST(TransportRouter, CopyEngineRetriesThroughTheRouter) {
  FaultPolicy p;
  p.failure_rate = 0.3;
  p.seed = 8;
  auto flaky = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(flaky.is_ok());
  auto remote = loopback(100us);
  auto r = router({flaky->get(), remote.get()});
  std::vector<std::byte> home(kBytes), work(kBytes);
  fill_random(home, 6);
  ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kWork, MemoryKind::kHost, work.data(), kBytes).is_ok());
  ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ASSERT_TRUE(run_batch(*r, {{kHome, 0, kRemote, 0, kBytes}}).is_ok());
  CopyEngineConfig c;
  c.max_retries = 60;
  c.retry_backoff = 10us;
  auto e = CopyEngine::create(*r, c);
  ASSERT_TRUE(e.is_ok());
  const uint64_t chunk = kBytes / 8;
  std::vector<CopyTicket> tickets;
  for (int l = 0; l < 8; ++l) {
    // Half of each chunk from home (local member), half from the remote copy (loopback).
    auto t = (*e)->submit(LayerId(l), CopyDirection::kLoad,
                          {{kHome, l * chunk, kWork, l * chunk, chunk / 2},
                           {kRemote, l * chunk + chunk / 2, kWork, l * chunk + chunk / 2, chunk / 2}});
    ASSERT_TRUE(t.is_ok());
    tickets.push_back(*t);
  }
  for (CopyTicket t : tickets) ASSERT_TRUE((*e)->wait(t).is_ok());
  EXPECT_EQ(std::memcmp(work.data(), home.data(), kBytes), 0);
  EXPECT_EQ((*e)->window_stats().retries, (*flaky)->injected_failures());
  EXPECT_GT((*flaky)->injected_failures(), 0);
}

// Destroying the router releases what it still holds, so a member never writes freed memory
// (ASan would report it).
TEST(TransportRouter, DestructionReleasesHeldTransfers) {
  auto remote = loopback(30ms);
  LocalTransport local;
  auto home = std::make_unique<std::vector<std::byte>>(kBytes);
  {
    auto r = router({&local, remote.get()});
    ASSERT_TRUE(r->register_tier(kHome, MemoryKind::kHost, home->data(), kBytes).is_ok());
    ASSERT_TRUE(r->register_tier(kRemote, MemoryKind::kRemote, nullptr, kBytes).is_ok());
    for (int i = 0; i < 3; ++i) {
      auto h = r->prepare({{kRemote, 0, kHome, 0, kBytes}});
      ASSERT_TRUE(h.is_ok());
      EXPECT_EQ(r->post(*h).code(), StatusCode::kInProgress);
    }
  }
  home.reset();
  std::this_thread::sleep_for(100ms);  // the link would have served all three by now
}

}  // namespace
}  // namespace specontext::transport
