// The transport conformance suite: what core/ports/transport.h promises, checked the same way for
// every implementation (UCX's uct_test). A test file includes this header once and instantiates
// TransportConformance with the transports it builds:
//   INSTANTIATE_TEST_SUITE_P(Local, TransportConformance,
//                            ::testing::Values(TransportCase{"local", make_local_rig}),
//                            transport_case_name);
// Cases: advertised capabilities match behaviour for all 16 (src, dst) kind pairs; random batches
// are bit-exact for every advertised direction (remote tiers included) with the bytes around the
// destination ranges untouched; scattered pages round-trip; empty batches and zero-length requests
// complete; out-of-range / unknown-tier requests and bad registrations are refused with the
// documented codes naming the request and tier; handle misuse (poll before post, post twice,
// poll after release); release cancels without touching the buffers afterwards, and destruction
// with transfers in flight is clean. Transport-specific behaviour stays in each transport's file.
// A transport that serves one remote tier only (UCX: the tier of its config) names its id in
// TransportCase::remote_tier, and every remote tier a case registers gets that id.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/ports/transport.h"
#include "tests/tests_common.h"
#include "tests/transport/transport_test_util.h"

namespace specontext::transport_conformance {

// Memory for one tier of one kind. kRemote has no local memory (base() is null).
class TierMemory {
 public:
  virtual ~TierMemory() = default;
  virtual void* base() = 0;
  virtual void write(std::span<const std::byte> bytes) = 0;
  virtual std::vector<std::byte> read_bytes() = 0;
};

class HostTierMemory : public TierMemory {
 public:
  explicit HostTierMemory(uint64_t bytes) : mem_(bytes) {}
  void* base() override { return mem_.data(); }
  void write(std::span<const std::byte> bytes) override {
    std::memcpy(mem_.data(), bytes.data(), std::min(bytes.size(), mem_.size()));
  }
  std::vector<std::byte> read_bytes() override { return mem_; }

 private:
  std::vector<std::byte> mem_;
};

class RemoteTierMemory : public TierMemory {
 public:
  void* base() override { return nullptr; }
  void write(std::span<const std::byte>) override { ADD_FAILURE() << "remote memory is not local"; }
  std::vector<std::byte> read_bytes() override {
    ADD_FAILURE() << "remote memory is not local";
    return {};
  }
};

// A transport under test and the memory of its tiers. The memory is owned here and freed after
// the transport (registered memory must outlive it): derived rigs hold the transport.
class TransportRig {
 public:
  virtual ~TransportRig() = default;
  virtual Transport& transport() = 0;

  TierMemory& memory(MemoryKind kind, uint64_t bytes) {
    memories_.push_back(allocate(kind, bytes));
    return *memories_.back();
  }

 protected:
  // Plain host memory for every local kind (what host-only transports register).
  virtual std::unique_ptr<TierMemory> allocate(MemoryKind kind, uint64_t bytes) {
    if (kind == MemoryKind::kRemote) return std::make_unique<RemoteTierMemory>();
    return std::make_unique<HostTierMemory>(bytes);
  }

 private:
  std::vector<std::unique_ptr<TierMemory>> memories_;
};

// A rig owning its transport and whatever the transport uses (router members): the transport is
// destroyed first, then `parts` in reverse order.
class OwningRig : public TransportRig {
 public:
  explicit OwningRig(std::unique_ptr<Transport> t, std::vector<std::unique_ptr<Transport>> parts = {})
      : parts_(std::move(parts)), t_(std::move(t)) {}
  ~OwningRig() override {
    t_.reset();
    while (!parts_.empty()) parts_.pop_back();
  }
  Transport& transport() override { return *t_; }

 private:
  std::vector<std::unique_ptr<Transport>> parts_;
  std::unique_ptr<Transport> t_;
};

struct TransportCase {
  std::string name;
  // Null when the transport cannot run here (the case is skipped with `unavailable`).
  std::function<std::unique_ptr<TransportRig>()> make;
  // prepare() of a (src, dst) kind pair the transport does not advertise fails with this code.
  StatusCode unsupported_pair = StatusCode::kUnimplemented;
  // Size of the tiers of the random batches.
  uint64_t batch_bytes = uint64_t{1} << 20;
  std::string unavailable = "unavailable";
  // post() of an empty batch returns OK at once (a transport-specific promise, not the contract's).
  bool empty_done_at_post = false;
  // Set for a transport that serves exactly one kRemote tier, of this id (UcxRemoteTransport: the
  // tier of its config; another remote id is refused with kUnimplemented). The cases register
  // their remote tier under it; a second remote tier keeps the case's own id (and is refused).
  // Not one of the ids the cases use otherwise (0-11, 20, 40-47, 1000 and up). Unset: any id.
  std::optional<TierId> remote_tier = std::nullopt;
};

inline void PrintTo(const TransportCase& c, std::ostream* os) { *os << c.name; }

inline std::string transport_case_name(const ::testing::TestParamInfo<TransportCase>& info) {
  std::string out;
  for (char c : info.param.name) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

inline constexpr MemoryKind kAllKinds[] = {MemoryKind::kHost, MemoryKind::kPinnedHost, MemoryKind::kDevice,
                                           MemoryKind::kRemote};

inline bool is_remote(MemoryKind k) { return k == MemoryKind::kRemote; }

class TransportConformance : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    rig_ = GetParam().make();
    if (rig_ == nullptr) GTEST_SKIP() << GetParam().unavailable;
  }

  // Replaces the rig with a fresh one (new transport, no tiers).
  void fresh_rig() {
    tiers_.clear();
    rig_ = GetParam().make();
  }
  Transport& t() { return rig_->transport(); }
  Capabilities caps() { return t().capabilities(); }

  // The id to register a tier of `kind` under: `wanted`, or for a remote tier the case's
  // remote_tier while no registered tier holds it.
  TierId tier_id(MemoryKind kind, TierId wanted) const {
    const std::optional<TierId>& remote = GetParam().remote_tier;
    if (!is_remote(kind) || !remote) return wanted;
    for (const Tier& t : tiers_) {
      if (t.id == *remote) return wanted;
    }
    return *remote;
  }

  // Registers tier `id` of `kind` with fresh memory of `bytes`.
  Status add_tier(TierId id, MemoryKind kind, uint64_t bytes) {
    TierMemory& m = rig_->memory(kind, bytes);
    const Status s = t().register_tier(id, kind, m.base(), bytes);
    if (s.is_ok()) tiers_.push_back({id, kind, bytes, &m});
    return s;
  }

  // Writes / reads a whole tier; a remote tier goes through a local staging tier.
  void write_tier(TierId id, std::span<const std::byte> bytes) {
    const Tier tier = find(id);
    if (!is_remote(tier.kind)) return tier.mem->write(bytes);
    const TierId staging = add_staging(/*to_remote=*/true, tier.bytes);
    find(staging).mem->write(bytes);
    const Status st = run_batch(t(), {{staging, 0, id, 0, tier.bytes}});
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  std::vector<std::byte> read_tier(TierId id) {
    const Tier tier = find(id);
    if (!is_remote(tier.kind)) return tier.mem->read_bytes();
    const TierId staging = add_staging(/*to_remote=*/false, tier.bytes);
    const Status s = run_batch(t(), {{id, 0, staging, 0, tier.bytes}});
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return find(staging).mem->read_bytes();
  }

  // The advertised pairs, optionally only those between local kinds.
  std::vector<std::pair<MemoryKind, MemoryKind>> directions(bool local_only) {
    std::vector<std::pair<MemoryKind, MemoryKind>> out;
    for (MemoryKind s : kAllKinds) {
      for (MemoryKind d : kAllKinds) {
        if (local_only && (is_remote(s) || is_remote(d))) continue;
        if (caps().supports(s, d)) out.emplace_back(s, d);
      }
    }
    return out;
  }

  // One advertised pair for the validation cases: a kind to itself if any, else local to local,
  // else any.
  std::pair<MemoryKind, MemoryKind> some_direction() {
    for (MemoryKind k : kAllKinds) {
      if (!is_remote(k) && caps().supports(k, k)) return {k, k};
    }
    auto local = directions(true);
    if (!local.empty()) return local.front();
    auto all = directions(false);
    EXPECT_FALSE(all.empty()) << "the transport advertises no pair";
    return all.empty() ? std::pair{MemoryKind::kHost, MemoryKind::kHost} : all.front();
  }

  std::unique_ptr<TransportRig> rig_;

 private:
  struct Tier {
    TierId id;
    MemoryKind kind;
    uint64_t bytes;
    TierMemory* mem;
  };
  const Tier& find(TierId id) {
    for (const Tier& t : tiers_) {
      if (t.id == id) return t;
    }
    ADD_FAILURE() << "no tier " << id.value();
    return tiers_.front();
  }
  TierId add_staging(bool to_remote, uint64_t bytes) {
    for (MemoryKind k : kAllKinds) {
      if (is_remote(k)) continue;
      if (to_remote ? caps().supports(k, MemoryKind::kRemote) : caps().supports(MemoryKind::kRemote, k)) {
        const TierId id(next_staging_++);
        EXPECT_TRUE(add_tier(id, k, bytes).is_ok());
        return id;
      }
    }
    ADD_FAILURE() << "no local kind pairs with remote";
    return TierId(0);
  }
  std::vector<Tier> tiers_;
  uint32_t next_staging_ = 1000;
};

// Every (src kind, dst kind) pair on a fresh transport: a transfer works exactly when the pair is
// advertised; registering a kind the transport cannot handle is kUnimplemented.
TEST_P(TransportConformance, EveryPairMatchesAdvertisement) {
  for (MemoryKind src : kAllKinds) {
    for (MemoryKind dst : kAllKinds) {
      SCOPED_TRACE(std::string(memory_kind_name(src)) + " -> " + std::string(memory_kind_name(dst)));
      fresh_rig();
      ASSERT_NE(rig_, nullptr);
      const bool advertised = caps().supports(src, dst);
      const std::vector<std::byte> data = specontext::testing::random_bytes(256, 7);
      const TierId a = tier_id(src, TierId(0));
      const Status ra = add_tier(a, src, 256);
      const TierId b = tier_id(dst, TierId(1));
      const Status rb = add_tier(b, dst, 256);
      if (!ra.is_ok() || !rb.is_ok()) {
        EXPECT_FALSE(advertised) << "advertised but cannot register: " << ra.to_string() << " "
                                 << rb.to_string();
        for (const Status& s : {ra, rb}) {
          if (!s.is_ok()) {
            EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.to_string();
          }
        }
        continue;
      }
      if (!is_remote(src)) write_tier(a, data);
      auto h = t().prepare({{a, 0, b, 64, 128}});
      if (!advertised) {
        ASSERT_FALSE(h.is_ok());
        EXPECT_EQ(h.status().code(), GetParam().unsupported_pair) << h.status().to_string();
        continue;
      }
      ASSERT_TRUE(h.is_ok()) << h.status().to_string();
      const Status done = run_to_end(t(), *h);
      EXPECT_TRUE(done.is_ok()) << done.to_string();
      t().release(*h);
      EXPECT_FALSE(h->valid());
      if (!is_remote(src) && !is_remote(dst)) {
        const std::vector<std::byte> got = read_tier(b);
        EXPECT_EQ(std::memcmp(got.data() + 64, data.data(), 128), 0);
      }
    }
  }
}

// Capabilities::remote is set exactly when some advertised pair has a remote end.
TEST_P(TransportConformance, RemoteFlagMatchesThePairs) {
  bool any_remote = false;
  for (MemoryKind s : kAllKinds) {
    for (MemoryKind d : kAllKinds) any_remote |= (is_remote(s) || is_remote(d)) && caps().supports(s, d);
  }
  EXPECT_EQ(caps().remote, any_remote);
}

// Random batches of rows (1 B .. 12 KiB, any alignment, runs of adjacent source rows) into disjoint
// destination slots, for every advertised direction; the whole destination is compared, so bytes
// between the slots (guards) must keep their old values. poll is idempotent once terminal.
TEST_P(TransportConformance, RandomBatchesBitExactEveryDirection) {
  const uint64_t n = GetParam().batch_bytes;
  uint64_t seed = 100;
  for (const auto& [src_kind, dst_kind] : directions(false)) {
    SCOPED_TRACE(std::string(memory_kind_name(src_kind)) + " -> " + std::string(memory_kind_name(dst_kind)));
    fresh_rig();
    ASSERT_NE(rig_, nullptr);
    const TierId from = tier_id(src_kind, TierId(10));
    ASSERT_TRUE(add_tier(from, src_kind, n).is_ok());
    const TierId to = tier_id(dst_kind, TierId(11));
    ASSERT_TRUE(add_tier(to, dst_kind, n).is_ok());
    const std::vector<std::byte> src = specontext::testing::random_bytes(n, seed++);
    write_tier(from, src);
    std::mt19937_64 rng(seed++);
    for (int round = 0; round < 6; ++round) {
      std::vector<std::byte> want = specontext::testing::random_bytes(n, seed++);
      write_tier(to, want);
      TransferBatch batch;
      uint64_t at = 0;
      const uint64_t row = uint64_t{1} << (7 + round % 6);  // 128 B .. 4 KiB typical rows
      while (true) {
        const uint64_t bytes = rng() % 4 == 0 ? 1 + rng() % 12288 : row;
        const uint64_t d = at + (rng() % 2 == 0 ? 0 : rng() % 64);
        if (d + bytes > n) break;
        uint64_t s = rng() % (n - bytes + 1);
        if (!batch.empty() && rng() % 3 == 0) s = batch.back().src_offset + batch.back().bytes;
        if (s + bytes > n) s = 0;
        batch.push_back({from, s, to, d, bytes});
        std::memcpy(want.data() + d, src.data() + s, bytes);
        at = d + bytes + (rng() % 8 == 0 ? 4096 : 0);
      }
      auto h = t().prepare(batch);
      ASSERT_TRUE(h.is_ok()) << h.status().to_string();
      const Status done = run_to_end(t(), *h);
      ASSERT_TRUE(done.is_ok()) << done.to_string();
      EXPECT_TRUE(t().poll(*h).is_ok()) << "poll is idempotent once terminal";
      t().release(*h);
      const std::vector<std::byte> got = read_tier(to);
      ASSERT_EQ(got.size(), n);
      size_t first_diff = 0;
      while (first_diff < n && got[first_diff] == want[first_diff]) ++first_diff;
      ASSERT_EQ(first_diff, n) << "round " << round << " (" << batch.size()
                               << " requests): first wrong byte at " << first_diff;
    }
  }
}

// Pages scattered out in a random order and gathered back (through a remote tier when the
// transport has one): what comes back is exactly what went out.
TEST_P(TransportConformance, ScatteredPagesRoundTripBitExact) {
  std::optional<std::pair<MemoryKind, MemoryKind>> via;
  for (const auto& [s, m] : directions(false)) {
    if (is_remote(s) || !caps().supports(m, s)) continue;
    if (!via || is_remote(m)) via = std::pair{s, m};
  }
  if (!via) GTEST_SKIP() << "no kind pair both ways";
  const auto [near, far] = *via;
  const uint64_t n = 1 << 16, page = n / 16;
  ASSERT_TRUE(add_tier(TierId(0), near, n).is_ok());
  ASSERT_TRUE(add_tier(TierId(1), near, n).is_ok());
  const TierId mid = tier_id(far, TierId(9));
  ASSERT_TRUE(add_tier(mid, far, n).is_ok());
  std::mt19937_64 rng(22);
  for (int round = 0; round < 20; ++round) {
    const std::vector<std::byte> a = specontext::testing::random_bytes(n, 100 + round);
    write_tier(TierId(0), a);
    write_tier(TierId(1), std::vector<std::byte>(n));
    std::vector<uint64_t> perm(16);
    for (uint64_t i = 0; i < 16; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    TransferBatch put, get;
    for (uint64_t i = 0; i < 16; ++i) {
      put.push_back({TierId(0), i * page, mid, perm[i] * page, page});
      get.push_back({mid, perm[i] * page, TierId(1), i * page, page});
    }
    ASSERT_TRUE(run_batch(t(), put).is_ok());
    ASSERT_TRUE(run_batch(t(), get).is_ok());
    ASSERT_TRUE(read_tier(TierId(1)) == a) << "round " << round;
  }
}

// An empty batch completes (at post where the transport says so); a zero-length request copies nothing and
// its neighbours still arrive.
TEST_P(TransportConformance, EmptyBatchAndZeroLengthRequests) {
  const auto [s, d] = some_direction();
  const TierId x = tier_id(s, TierId(0));
  ASSERT_TRUE(add_tier(x, s, 4096).is_ok());
  const TierId y = tier_id(d, TierId(1));
  ASSERT_TRUE(add_tier(y, d, 4096).is_ok());
  auto empty = t().prepare({});
  ASSERT_TRUE(empty.is_ok()) << empty.status().to_string();
  if (GetParam().empty_done_at_post) {
    EXPECT_TRUE(t().post(*empty).is_ok()) << "nothing to copy: complete at post";
  } else {
    EXPECT_TRUE(run_to_end(t(), *empty).is_ok());
  }
  EXPECT_TRUE(t().poll(*empty).is_ok());
  t().release(*empty);

  const std::vector<std::byte> a = specontext::testing::random_bytes(4096, 5);
  std::vector<std::byte> want(4096);
  write_tier(x, a);
  write_tier(y, want);
  const Status st = run_batch(t(), {{x, 0, y, 0, 0}, {x, 64, y, 128, 256}, {x, 4096, y, 4096, 0}});
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  std::memcpy(want.data() + 128, a.data() + 64, 256);
  EXPECT_TRUE(read_tier(y) == want);
}

// prepare refuses bad requests naming the request and the tier; register_tier refuses bad tiers.
TEST_P(TransportConformance, ValidationNamesRequestAndTier) {
  const auto [s, d] = some_direction();
  const TierId x = tier_id(s, TierId(0));
  ASSERT_TRUE(add_tier(x, s, 4096).is_ok());
  const TierId y = tier_id(d, TierId(1));
  ASSERT_TRUE(add_tier(y, d, 1024).is_ok());
  const std::string src_x = "src tier " + std::to_string(x.value());
  const std::string dst_y = "dst tier " + std::to_string(y.value());
  auto expect_error = [&](const TransferBatch& batch, StatusCode code,
                          const std::vector<std::string>& parts) {
    auto h = t().prepare(batch);
    ASSERT_FALSE(h.is_ok());
    EXPECT_EQ(h.status().code(), code) << h.status().to_string();
    expect_mentions(h.status(), parts);
  };
  const TransferRequest ok{x, 0, y, 0, 512};
  expect_error({ok, {x, 0, y, 1000, 100}}, StatusCode::kOutOfRange, {"request 1", dst_y, "1024"});
  expect_error({{x, 4000, y, 0, 100}}, StatusCode::kOutOfRange, {"request 0", src_x});
  expect_error({ok, ok, {TierId(5), 0, y, 0, 8}}, StatusCode::kInvalidArgument,
               {"request 2", "src tier 5", "not registered"});
  expect_error({{x, 0, TierId(6), 0, 8}}, StatusCode::kInvalidArgument,
               {"request 0", "dst tier 6", "not registered"});
  // offset + bytes would wrap around 2^64
  expect_error({{x, ~0ull - 4, y, 0, 8}}, StatusCode::kOutOfRange, {"request 0", src_x});
  if (s == d && !is_remote(s)) {
    expect_error({{x, 0, x, 100, 200}}, StatusCode::kInvalidArgument, {"request 0", "overlap", "tier 0"});
  }

  // Registration: duplicate id, null base, zero size, invalid id, a kind it cannot handle.
  TierMemory& m = rig_->memory(s, 64);
  EXPECT_EQ(t().register_tier(x, s, m.base(), 64).code(), StatusCode::kInvalidArgument) << "duplicate id";
  if (!is_remote(s)) {
    EXPECT_EQ(t().register_tier(TierId(2), s, nullptr, 64).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t().register_tier(TierId(3), s, m.base(), 0).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(t().register_tier(TierId(), s, m.base(), 64).code(), StatusCode::kInvalidArgument);
  for (MemoryKind k : kAllKinds) {
    bool used = false;
    for (MemoryKind o : kAllKinds) used |= caps().supports(k, o) || caps().supports(o, k);
    if (used || is_remote(k)) continue;
    TierMemory& other = rig_->memory(k, 64);
    EXPECT_EQ(t().register_tier(TierId(4), k, other.base(), 64).code(), StatusCode::kUnimplemented)
        << memory_kind_name(k);
  }
}

// Handle misuse: poll before post and a second post fail; release is idempotent and a released
// handle is refused.
TEST_P(TransportConformance, HandleMisuse) {
  const auto [s, d] = some_direction();
  const TierId x = tier_id(s, TierId(0));
  ASSERT_TRUE(add_tier(x, s, 4096).is_ok());
  const TierId y = tier_id(d, TierId(1));
  ASSERT_TRUE(add_tier(y, d, 4096).is_ok());
  auto h = t().prepare({{x, 0, y, 1024, 512}});
  ASSERT_TRUE(h.is_ok());
  EXPECT_TRUE(h->valid());
  EXPECT_EQ(h->owner(), &t());
  EXPECT_EQ(t().poll(*h).code(), StatusCode::kInvalidArgument) << "poll before post";
  ASSERT_TRUE(run_to_end(t(), *h).is_ok());
  EXPECT_EQ(t().post(*h).code(), StatusCode::kInvalidArgument) << "posted twice";
  TransferHandle copy = *h;
  t().release(*h);
  EXPECT_FALSE(h->valid());
  t().release(*h);  // idempotent
  EXPECT_EQ(t().poll(copy).code(), StatusCode::kInvalidArgument) << "released";
}

// release() of posted transfers: afterwards the transport no longer writes their destinations
// (a sentinel written after release survives while the other transfers finish); destroying the
// transport with transfers in flight is clean. Eight transfers read one source tier.
TEST_P(TransportConformance, ReleaseStopsTouchingTheBuffersAndDestroyIsClean) {
  std::pair<MemoryKind, MemoryKind> dir = some_direction();
  for (const auto& p : directions(false)) {
    if (!is_remote(p.second)) {
      dir = p;
      break;
    }
  }
  const auto [s, d] = dir;
  if (is_remote(d)) GTEST_SKIP() << "no local destination";
  const uint64_t n = GetParam().batch_bytes;
  const std::vector<std::byte> data = specontext::testing::random_bytes(n, 3);
  const std::vector<std::byte> sentinel(n, std::byte{0x5a});
  std::vector<TransferHandle> hs;
  const TierId from = tier_id(s, TierId(20));
  ASSERT_TRUE(add_tier(from, s, n).is_ok());
  write_tier(from, data);
  for (uint32_t i = 0; i < 8; ++i) ASSERT_TRUE(add_tier(TierId(40 + i), d, n).is_ok());
  for (uint32_t i = 0; i < 8; ++i) {
    auto h = t().prepare({{from, 0, TierId(40 + i), 0, n}});
    ASSERT_TRUE(h.is_ok());
    const Status st = t().post(*h);
    EXPECT_TRUE(st.is_ok() || st.code() == StatusCode::kInProgress) << st.to_string();
    hs.push_back(*h);
  }
  for (uint32_t i = 0; i < 4; ++i) {
    t().release(hs[i]);
    EXPECT_FALSE(hs[i].valid());
    write_tier(TierId(40 + i), sentinel);
  }
  for (uint32_t i = 4; i < 8; ++i) {
    Status st = t().poll(hs[i]);
    for (int k = 0; k < 2000000 && st.code() == StatusCode::kInProgress; ++k) {
      std::this_thread::sleep_for(std::chrono::microseconds(10));
      st = t().poll(hs[i]);
    }
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    t().release(hs[i]);
    EXPECT_TRUE(read_tier(TierId(40 + i)) == data) << i;
  }
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(read_tier(TierId(40 + i)) == sentinel) << i;
  // Destroy with four transfers posted and not released.
  for (uint32_t i = 0; i < 4; ++i) {
    auto h = t().prepare({{from, 0, TierId(40 + i), 0, n}});
    ASSERT_TRUE(h.is_ok());
    (void)t().post(*h);
  }
  rig_.reset();
}

}  // namespace specontext::transport_conformance
