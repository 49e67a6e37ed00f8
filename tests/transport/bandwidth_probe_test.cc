// Bandwidth probe over local, loopback and routed paths: positive finite figures, the copy
// really happens, the time budget bounds the rounds, and bad paths or options are named.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transport/bandwidth_probe.h"
#include "transport/fault_transport.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"
#include "transport/transport_router.h"

namespace specontext::transport {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBytes = 4 << 20;

std::unique_ptr<LoopbackRemoteTransport> loopback(std::chrono::microseconds latency = 0us) {
  auto t = LoopbackRemoteTransport::create({latency});
  EXPECT_TRUE(t.is_ok());
  return std::move(t).value();
}

void expect_sane(const ProbeResult& r, const ProbePath& p, const ProbeOptions& o) {
  SCOPED_TRACE(r.name);
  EXPECT_EQ(r.name, p.name);
  EXPECT_EQ(r.src, p.src);
  EXPECT_EQ(r.dst, p.dst);
  for (double v : {r.contiguous_bps, r.gather_bps, r.latency_seconds}) {
    EXPECT_TRUE(std::isfinite(v)) << v;
    EXPECT_GT(v, 0.0);
  }
  EXPECT_EQ(r.bytes, std::min(p.bytes, o.max_bytes));
  EXPECT_GE(r.repeats, 1);
  EXPECT_LE(r.repeats, o.repeats);
  EXPECT_GT(r.gather_rows, 1u);
  EXPECT_EQ(r.gather_bytes, r.gather_rows * o.row_bytes);
}

TEST(BandwidthProbe, LocalAndLoopbackPathsGivePositiveFiniteFigures) {
  LocalTransport local;
  auto remote = loopback();
  auto router = TransportRouter::create({&local, remote.get()});
  ASSERT_TRUE(router.is_ok());
  Transport& t = **router;
  std::vector<std::byte> a(kBytes), b(kBytes);
  std::mt19937_64 rng(1);
  for (auto& x : a) x = static_cast<std::byte>(rng() & 0xff);
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kHost, a.data(), kBytes).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(2), MemoryKind::kPinnedHost, b.data(), kBytes).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(5), MemoryKind::kRemote, nullptr, kBytes).is_ok());
  ProbeOptions o;
  o.max_bytes = 2 << 20;
  o.repeats = 2;
  const std::vector<ProbePath> paths = {
      {"host1->host2", TierId(1), 0, TierId(2), 0, kBytes},
      {"host1->remote5", TierId(1), 0, TierId(5), 0, kBytes},
      {"remote5->host2", TierId(5), 0, TierId(2), 0, kBytes},
  };
  auto results = probe_bandwidth(t, paths, o);
  ASSERT_TRUE(results.is_ok()) << results.status().to_string();
  ASSERT_EQ(results->size(), paths.size());
  for (size_t i = 0; i < paths.size(); ++i) expect_sane((*results)[i], paths[i], o);
  // The contiguous pattern really copied the first max_bytes (the last one read them back from
  // the remote copy, after the gather pattern had overwritten the start of b).
  const uint64_t n = o.max_bytes;
  EXPECT_EQ(std::memcmp(b.data() + n / 2, a.data() + n / 2, n / 2), 0);

  const nlohmann::json j = probe_results_to_json(*results);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), paths.size());
  EXPECT_EQ(j[1]["name"], "host1->remote5");
  EXPECT_EQ(j[1]["src_tier"], 1);
  EXPECT_EQ(j[1]["dst_tier"], 5);
  EXPECT_GT(j[1]["contiguous_bps"].get<double>(), 0.0);
  EXPECT_GT(j[1]["gather_bps"].get<double>(), 0.0);
  EXPECT_GT(j[1]["latency_seconds"].get<double>(), 0.0);
  EXPECT_EQ(j[1]["bytes"], n);
  const nlohmann::json parsed = nlohmann::json::parse(j.dump());
  EXPECT_EQ(parsed, j);
}

// A slow link: every transfer takes at least the latency, so the latency figure is at least it,
// and a 20 ms budget stops after the first round (each round is three transfers of >= 10 ms).
TEST(BandwidthProbe, LatencyAndTimeBudget) {
  auto remote = loopback(10ms);
  std::vector<std::byte> a(1 << 20);
  ASSERT_TRUE(remote->register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE(remote->register_tier(TierId(1), MemoryKind::kRemote, nullptr, a.size()).is_ok());
  ProbeOptions o;
  o.repeats = 50;
  o.time_budget = 20ms;
  const std::vector<ProbePath> paths = {{"host->remote", TierId(0), 0, TierId(1), 0, a.size()}};
  auto results = probe_bandwidth(*remote, paths, o);
  ASSERT_TRUE(results.is_ok()) << results.status().to_string();
  const ProbeResult& r = (*results)[0];
  expect_sane(r, paths[0], o);
  EXPECT_GE(r.latency_seconds, 0.010);
  EXPECT_EQ(r.repeats, 1);
  EXPECT_LE(r.contiguous_bps, static_cast<double>(a.size()) / 0.010);
}

TEST(BandwidthProbe, NoResourceIsRepostedAndNeverHangs) {
  FaultPolicy p;
  p.no_resource_rate = 0.5;
  auto ft = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), p);
  ASSERT_TRUE(ft.is_ok());
  std::vector<std::byte> a(1 << 20), b(1 << 20);
  ASSERT_TRUE((*ft)->register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE((*ft)->register_tier(TierId(1), MemoryKind::kHost, b.data(), b.size()).is_ok());
  const std::vector<ProbePath> paths = {{"h2h", TierId(0), 0, TierId(1), 0, a.size()}};
  auto ok = probe_bandwidth(**ft, paths, {});
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_GT((*ft)->injected_no_resource(), 0);

  // A transfer that never completes is cancelled after transfer_timeout, naming the path.
  FaultPolicy stuck;
  stuck.added_delay = 60s;
  auto st = FaultInjectingTransport::create(std::make_unique<LocalTransport>(), stuck);
  ASSERT_TRUE(st.is_ok());
  ASSERT_TRUE((*st)->register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE((*st)->register_tier(TierId(1), MemoryKind::kHost, b.data(), b.size()).is_ok());
  ProbeOptions o;
  o.transfer_timeout = 30ms;
  auto timed_out = probe_bandwidth(**st, paths, o);
  ASSERT_FALSE(timed_out.is_ok());
  EXPECT_EQ(timed_out.status().code(), StatusCode::kUnavailable);
  const std::string& msg = timed_out.status().message();
  EXPECT_NE(msg.find("path 0 'h2h'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("transfer_timeout"), std::string::npos) << msg;
}

TEST(BandwidthProbe, BadPathsAndOptionsAreNamed) {
  LocalTransport t;
  std::vector<std::byte> a(1 << 16), b(1 << 16);
  ASSERT_TRUE(t.register_tier(TierId(0), MemoryKind::kHost, a.data(), a.size()).is_ok());
  ASSERT_TRUE(t.register_tier(TierId(1), MemoryKind::kHost, b.data(), b.size()).is_ok());
  const ProbePath good{"good", TierId(0), 0, TierId(1), 0, a.size()};
  auto expect_error = [&](std::vector<ProbePath> paths, const ProbeOptions& o,
                          std::vector<std::string> parts) {
    auto r = probe_bandwidth(t, paths, o);
    ASSERT_FALSE(r.is_ok());
    for (const std::string& p : parts) {
      EXPECT_NE(r.status().message().find(p), std::string::npos)
          << "'" << p << "' missing in: " << r.status().message();
    }
  };
  expect_error({good, {"to-nowhere", TierId(0), 0, TierId(7), 0, 4096}}, {},
               {"path 1 'to-nowhere'", "tier 7", "not registered"});
  expect_error({{"too-long", TierId(0), 0, TierId(1), 1024, a.size()}}, {},
               {"path 0 'too-long'", "dst tier 1", "exceeds"});
  expect_error({{"tiny", TierId(0), 0, TierId(1), 0, 100}}, {}, {"path 0 'tiny'", "row_bytes"});
  expect_error({{"", TierId(0), 0, TierId(1), 0, 4096}}, {}, {"path 0", "empty name"});
  expect_error({{"same", TierId(0), 0, TierId(0), 1024, 4096}}, {}, {"path 0 'same'", "overlap"});
  expect_error({{"wrap", TierId(0), ~0ull - 10, TierId(1), 0, 4096}}, {}, {"path 0 'wrap'"});
  ProbeOptions o;
  o.repeats = 0;
  expect_error({good}, o, {"options.repeats"});
  o = ProbeOptions{};
  o.row_bytes = 0;
  expect_error({good}, o, {"options.row_bytes"});
  o = ProbeOptions{};
  o.gather_stride = 16;
  expect_error({good}, o, {"options.gather_stride"});
  o = ProbeOptions{};
  o.time_budget = 0ms;
  expect_error({good}, o, {"options.time_budget"});
  // No paths: nothing to do.
  auto none = probe_bandwidth(t, {}, {});
  ASSERT_TRUE(none.is_ok());
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace specontext::transport
