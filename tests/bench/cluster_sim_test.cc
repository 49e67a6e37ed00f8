// The cluster simulator (bench/sim/cluster_sim.h): determinism, an exact single-request case,
// M/D/1 queueing, replica scaling, prefix-aware routing, a dead store, the planner's tiers, the
// router / load generator / store CPU taken from the replicas' shared cores, serve's admission
// bounds (429 past the connections from one address, 503 past max_waiting, the router's retry).
#include "bench/sim/cluster_sim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <sstream>

namespace lg = specontext::bench::loadgen;
namespace sim = specontext::bench::sim;
namespace router = specontext::router;
using nlohmann::json;

namespace {

lg::Trace parse(const std::string& text) {
  std::istringstream in(text);
  auto t = lg::parse_trace(in);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return *t;
}

lg::Trace synthetic(lg::SynthOptions o) {
  auto text = lg::synth_trace(o);
  EXPECT_TRUE(text.is_ok());
  return parse(*text);
}

// Requests of `prompt_bytes` bytes each (distinct text), `tokens` output tokens, at `arrivals`.
lg::Trace independent(const std::vector<double>& arrivals, size_t prompt_bytes, int64_t tokens) {
  std::string text;
  for (size_t i = 0; i < arrivals.size(); ++i) {
    std::string p = "q" + std::to_string(i) + " ";
    while (p.size() < prompt_bytes) p += "x";
    text += json{{"arrival_s", arrivals[i]}, {"prompt", p}, {"max_tokens", tokens}}.dump() + "\n";
  }
  return parse(text);
}

sim::Calibration simple_costs() {
  sim::Calibration c;
  c.prompt_bytes_per_token = 1;
  c.output_bytes_per_token = 1;
  c.page_tokens = 16;
  c.costs.request_overhead_s = 0.003;
  c.costs.prefill_base_s = 0.001;
  c.costs.prefill_per_token_s = 0.0001;
  c.costs.decode_base_s = 0.002;
  c.costs.decode_per_seq_s = 0.0005;
  c.costs.decode_per_ctx_token_s = 0;
  return c;
}

// The shared store's trace: 60 requests at 10 a second whose prompts share 64-word prefixes, on
// `replicas` round-robin replicas (only the store finds one replica's prefixes on another).
struct StoreCase {
  lg::Trace trace;
  sim::Topology topo;
};
StoreCase store_case(int64_t replicas) {
  lg::SynthOptions o;
  o.requests = 60;
  o.prefix_words = 64;
  o.arrivals.rate = 10;
  StoreCase c{synthetic(o), {}};
  c.topo.replicas = replicas;
  c.topo.policy.policy = router::Policy::kRoundRobin;
  return c;
}

double mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()); }

}  // namespace

TEST(ClusterSim, SameSeedSameReportAndNoiseFollowsTheSeed) {
  lg::SynthOptions o;
  o.requests = 80;
  o.arrivals.rate = 20;
  const lg::Trace t = synthetic(o);
  sim::Topology topo;
  topo.replicas = 3;
  topo.policy.policy = router::Policy::kPrefix;
  topo.noise = 0.3;
  topo.seed = 7;
  const lg::Slo slo;
  auto a = sim::simulate(t, simple_costs(), topo);
  auto b = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(sim::report(*a, topo, slo).dump(), sim::report(*b, topo, slo).dump());
  topo.seed = 8;
  auto c = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(c.is_ok());
  EXPECT_NE(sim::report(*a, topo, slo)["summary"].dump(), sim::report(*c, topo, slo)["summary"].dump());
}

// One replica, requests far apart: TTFT = overhead + prefill, latency = that + (n − 1) decode steps.
TEST(ClusterSim, OneRequestAtATimeIsExact) {
  const int64_t n = 12;
  const lg::Trace t = independent({0.0, 10.0, 20.0}, 200, n);
  sim::Calibration c = simple_costs();
  sim::Topology topo;
  topo.router = false;
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  for (const lg::RequestResult& q : r->results) {
    ASSERT_TRUE(q.ok);
    EXPECT_EQ(q.prompt_tokens, 200);
    EXPECT_EQ(q.cached_tokens, 0);
    EXPECT_EQ(q.completion_tokens, n);
    const double prefill = c.costs.request_overhead_s + c.costs.prefill_base_s + 200 * c.costs.prefill_per_token_s;
    const double step = c.costs.decode_base_s + c.costs.decode_per_seq_s;
    EXPECT_NEAR(q.ttft_s, prefill, 1e-12);
    EXPECT_NEAR(q.latency_s, prefill + (n - 1) * step, 1e-12);
    ASSERT_EQ(q.gaps_s.size(), static_cast<size_t>(n - 1));
    for (double g : q.gaps_s) EXPECT_NEAR(g, step, 1e-12);
  }
  // With a per-context cost each step grows by one token's worth.
  c.costs.decode_per_ctx_token_s = 1e-5;
  auto g = sim::simulate(t, c, topo);
  ASSERT_TRUE(g.is_ok());
  const lg::RequestResult& q = g->results[0];
  for (size_t k = 0; k < q.gaps_s.size(); ++k) {
    EXPECT_NEAR(q.gaps_s[k], c.costs.decode_base_s + c.costs.decode_per_seq_s + 1e-5 * static_cast<double>(201 + k), 1e-12);
  }
}

// One slot, Poisson arrivals, deterministic service D: the mean wait is ρD / (2(1 − ρ)) (M/D/1).
TEST(ClusterSim, OneSlotQueueingMatchesMD1) {
  lg::ArrivalOptions a;
  a.rate = 50;
  a.seed = 3;
  auto arrivals = lg::arrival_times(a, 4000);
  ASSERT_TRUE(arrivals.is_ok());
  sim::Calibration c;
  c.prompt_bytes_per_token = 1;
  c.costs.prefill_per_token_s = 0.0001;  // 100 tokens: 10 ms
  const lg::Trace t = independent(*arrivals, 100, 1);
  sim::Topology topo;
  topo.router = false;
  topo.max_batch = 1;
  topo.prefix_caching = false;
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  std::vector<double> waits;
  for (const auto& q : r->results) waits.push_back(q.ttft_s - 0.01);
  const double rho = 50 * 0.01;
  const double expected = rho * 0.01 / (2 * (1 - rho));  // 5 ms
  EXPECT_NEAR(mean(waits), expected, 0.15 * expected);
}

// Saturated (all requests at once), round-robin, each replica on its own cores: twice the
// replicas, about twice the throughput.
TEST(ClusterSim, DoublingReplicasAtSaturationDoublesThroughput) {
  const lg::Trace t = independent(std::vector<double>(256, 0.0), 64, 32);
  sim::Topology topo;
  topo.policy.policy = router::Policy::kRoundRobin;
  std::vector<double> tput;
  for (int64_t n : {1, 2, 4}) {
    topo.replicas = n;
    auto r = sim::simulate(t, simple_costs(), topo);
    ASSERT_TRUE(r.is_ok());
    tput.push_back(sim::report(*r, topo, lg::Slo{})["summary"]["output_tokens_per_s"].get<double>());
  }
  EXPECT_NEAR(tput[1] / tput[0], 2.0, 0.2);
  EXPECT_NEAR(tput[2] / tput[1], 2.0, 0.2);
  // On 2 shared cores with 2 threads each, more replicas buy nothing.
  topo.cpus = 2;
  sim::Calibration c = simple_costs();
  c.threads_per_replica = 2;
  topo.replicas = 1;
  auto one = sim::simulate(t, c, topo);
  topo.replicas = 2;
  auto two = sim::simulate(t, c, topo);
  ASSERT_TRUE(one.is_ok() && two.is_ok());
  EXPECT_NEAR(two->wall_s / one->wall_s, 1.0, 0.1);
}

// Conversations sharing system prompts: prefix-aware routing keeps a conversation on its replica.
TEST(ClusterSim, PrefixRoutingRaisesTheHitRate) {
  lg::SynthOptions o;
  o.requests = 120;
  o.sessions = 12;
  o.turns = 5;
  o.prefixes = 3;
  o.prefix_words = 16;
  o.turn_words = 48;
  o.tool_words = 96;
  o.arrivals.rate = 10;
  const lg::Trace t = synthetic(o);
  sim::Topology topo;
  topo.replicas = 8;
  auto hit_rate = [&](router::Policy p) {
    topo.policy.policy = p;
    auto r = sim::simulate(t, simple_costs(), topo);
    EXPECT_TRUE(r.is_ok());
    return r->metrics["serve"]["prefix_cache_hit_rate"].get<double>();
  };
  const double rr = hit_rate(router::Policy::kRoundRobin);
  const double prefix = hit_rate(router::Policy::kPrefix);
  EXPECT_GT(prefix, rr + 0.1) << "rr " << rr << " prefix " << prefix;
  auto r = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(r.is_ok());
  EXPECT_GT(r->metrics["router"]["prefix_hit_rate"].get<double>(), 0.5);
}

// A live store lets round-robin replicas find each other's prefixes; a dead one costs only the
// recomputation: the same report as no store at all.
TEST(ClusterSim, DeadStoreOnlyCostsRecompute) {
  StoreCase sc = store_case(4);
  const lg::Trace& t = sc.trace;
  sim::Topology& topo = sc.topo;
  const lg::Slo slo;
  auto none = sim::simulate(t, simple_costs(), topo);
  topo.store.enabled = true;
  topo.store.alive = false;
  auto dead = sim::simulate(t, simple_costs(), topo);
  topo.store.alive = true;
  auto live = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(none.is_ok() && dead.is_ok() && live.is_ok());
  EXPECT_EQ(sim::report(*none, topo, slo)["summary"].dump(), sim::report(*dead, topo, slo)["summary"].dump());
  EXPECT_EQ(dead->metrics["serve"]["shared_store"]["bytes_read"].get<double>(), 0);
  EXPECT_GT(dead->metrics["serve"]["shared_store"]["errors"].get<int64_t>(), 0);
  EXPECT_GT(live->metrics["serve"]["prefix_cache_hit_rate"].get<double>(),
            none->metrics["serve"]["prefix_cache_hit_rate"].get<double>());
  EXPECT_GT(live->metrics["serve"]["shared_store"]["bytes_read"].get<double>(), 0);
}

// The store counts what serve writes in chunks (--prefix-store-chunk): with one-page chunks only
// the pages new to the store; with chunks longer than any prompt every prompt whole (each turn
// of a conversation writes its earlier turns again); what is found and read is the same (no
// replica here keeps a whole chunk of a prompt the store holds more of).
TEST(ClusterSim, StoreWritesCountWholeChunksTheStoreLacks) {
  StoreCase sc = store_case(2);
  const lg::Trace& t = sc.trace;
  sim::Topology& topo = sc.topo;
  topo.store.enabled = true;
  auto written = [&](int64_t chunk_tokens, nlohmann::json* store) {
    topo.store.chunk_tokens = chunk_tokens;
    auto r = sim::simulate(t, simple_costs(), topo);
    EXPECT_TRUE(r.is_ok());
    if (!r.is_ok()) return 0.0;
    *store = r->metrics["serve"]["shared_store"];
    return (*store)["bytes_written"].get<double>();
  };
  nlohmann::json page_store, mid_store, whole_store;
  const double page = written(simple_costs().page_tokens, &page_store);
  const double mid = written(4 * simple_costs().page_tokens, &mid_store);
  const double whole = written(1 << 20, &whole_store);
  EXPECT_GT(page, 0);
  EXPECT_LT(page, mid);
  EXPECT_LT(mid, whole);
  EXPECT_EQ(page_store["bytes_read"], whole_store["bytes_read"]);
  EXPECT_EQ(page_store["hits"], whole_store["hits"]);
  EXPECT_EQ(page_store["writes"], whole_store["writes"]);
  // Counted in chunks as serve counts them: one-page chunks are the pages written and the pages
  // the store held; a chunk longer than any prompt is one written chunk a write.
  const double page_bytes = static_cast<double>(simple_costs().page_tokens * simple_costs().kv_bytes_per_token());
  EXPECT_EQ(page_store["chunks_written"].get<double>() * page_bytes, page);
  EXPECT_GT(page_store["chunks_skipped"].get<int64_t>(), 0);
  EXPECT_EQ(whole_store["chunks_written"], whole_store["writes"]);
  EXPECT_EQ(whole_store["chunks_skipped"], 0);
}

// serve's read of the store (PrefixStore::restore_shared): the whole chunks a kept sequence holds
// are forked, not read. A conversation on two round-robin replicas, 16-byte pages of one token,
// 4-page chunks: turn 1 (9 pages) on replica 0, turn 2 (20 pages) on replica 1, which holds nothing
// and reads turn 1's 9 pages from chunk 0 (3 chunks); turn 3 back on replica 0, which keeps turn 1
// and its answer (10 pages), finds turn 2's 20 pages in the store and reads pages 8-19 only (3
// chunks read, 2 local). With no slots kept, turn 3 reads all 20 pages from chunk 0 (5 chunks).
// The link (10 ms a page here) charges turn 3's TTFT for the pages read, and the store (1 ms a round
// trip) for one get a chunk read.
TEST(ClusterSim, AReplicaKeepingTheFirstTurnReadsOnlyTheLaterChunksFromTheStore) {
  auto conversation = [](int turns) {
    std::string text;
    for (int k = 0; k < turns; ++k) {
      std::string p = "t" + std::to_string(k) + " ";
      p.resize(k == 0 ? 144 : 160, 'x');
      text += json{{"arrival_s", k}, {"prompt", p}, {"max_tokens", 16}, {"session", "s"}}.dump() + "\n";
    }
    return parse(text);
  };
  const sim::Calibration cal = simple_costs();  // 1 byte a token, 16-token pages
  const double page_bytes = static_cast<double>(cal.page_tokens * cal.kv_bytes_per_token());
  sim::Topology topo;
  topo.replicas = 2;
  topo.policy.policy = router::Policy::kRoundRobin;
  topo.store.enabled = true;
  topo.store.chunk_tokens = 4 * cal.page_tokens;
  topo.store.bandwidth_bps = page_bytes / 0.01;
  topo.store.latency_s = 0.001;
  double last_ttft = 0;
  auto store_of = [&](int turns) {
    auto r = sim::simulate(conversation(turns), cal, topo);
    EXPECT_TRUE(r.is_ok());
    if (!r.is_ok()) return json();
    for (const auto& res : r->results) EXPECT_TRUE(res.ok) << res.error;
    last_ttft = r->results.back().ttft_s;
    EXPECT_EQ(r->metrics["serve"]["replicas"][0]["chosen"], (turns + 1) / 2);
    return r->metrics["serve"]["shared_store"];
  };
  // Turn 2: replica 1 holds nothing, reads from chunk 0.
  const json two = store_of(2);
  EXPECT_EQ(two["hits"], 1);
  EXPECT_EQ(two["bytes_read"].get<double>(), 9 * page_bytes);
  EXPECT_EQ(two["chunks_read"], 3);
  EXPECT_EQ(two["chunks_local"], 0);
  // Turn 3: replica 0 keeps turn 1's first 2 whole chunks; reads the 3 after them.
  const json three = store_of(3);
  EXPECT_EQ(three["hits"], 2);
  EXPECT_EQ(three["bytes_read"].get<double>() - two["bytes_read"].get<double>(), 12 * page_bytes);
  EXPECT_EQ(three["chunks_read"].get<int64_t>() - two["chunks_read"].get<int64_t>(), 3);
  EXPECT_EQ(three["chunks_local"], 2);
  const double kept_ttft = last_ttft;
  // Nothing kept: turn 3 reads every chunk from 0.
  topo.prefix_cache_slots = 0;
  const json unkept = store_of(3);
  EXPECT_EQ(unkept["hits"], 2);
  EXPECT_EQ(unkept["bytes_read"].get<double>(), (9 + 20) * page_bytes);
  EXPECT_EQ(unkept["chunks_read"], 3 + 5);
  EXPECT_EQ(unkept["chunks_local"], 0);
  EXPECT_NEAR(last_ttft - kept_ttft, 8 * 0.01 + (5 - 3) * 0.001, 1e-9);
}

// A device too small for the batch's KV: the planner puts layers on the host pool and every decode
// step reads them at the host bandwidth (bytes counted, time charged).
TEST(ClusterSim, PlannerOffloadsAndChargesTheHostLink) {
  const lg::Trace t = independent(std::vector<double>(4, 0.0), 400, 8);
  sim::Calibration c = simple_costs();  // stories260K's shape: 1280 KV bytes a token
  sim::Topology topo;
  topo.router = false;
  topo.tiers.device_kv_bytes = 1'000'000;
  topo.tiers.host_kv_bytes = 64'000'000;
  topo.tiers.host_bandwidth_bps = 1e6;  // slow enough to dominate
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  EXPECT_GT(r->metrics["serve"]["tiers"]["host"]["bytes_read"].get<double>(), 0);
  topo.tiers.device_kv_bytes = 0;
  auto fits = sim::simulate(t, c, topo);
  ASSERT_TRUE(fits.is_ok());
  EXPECT_GT(r->wall_s, 2 * fits->wall_s);
  // Nothing fits anywhere: the request fails, named.
  topo.tiers.device_kv_bytes = 1000;
  topo.tiers.host_kv_bytes = 0;
  auto refused = sim::simulate(t, c, topo);
  ASSERT_TRUE(refused.is_ok());
  EXPECT_FALSE(refused->results[0].ok);
  EXPECT_NE(refused->results[0].error.find("planner"), std::string::npos);
}

// Calibration: a report generated by the simulator itself is fitted back to its costs.
TEST(ClusterSim, CalibrationRecoversTheCosts) {
  std::string text;
  for (int i = 0; i < 12; ++i) {
    std::string p = "r" + std::to_string(i) + " ";
    while (p.size() < static_cast<size_t>(50 + 40 * i)) p += "y";
    text += json{{"arrival_s", 1.0 * i}, {"prompt", p}, {"max_tokens", 10}}.dump() + "\n";
  }
  const lg::Trace trace = parse(text);
  sim::Calibration truth = simple_costs();
  sim::Topology topo;
  topo.router = false;
  auto r = sim::simulate(trace, truth, topo);
  ASSERT_TRUE(r.is_ok());
  json rep = {{"requests", json::array()}};
  for (const auto& q : r->results) {
    rep["requests"].push_back({{"index", q.index}, {"ok", q.ok}, {"sent_at_s", q.sent_at_s}, {"ttft_ms", 1e3 * q.ttft_s},
                               {"latency_s", q.latency_s}, {"prompt_tokens", q.prompt_tokens},
                               {"cached_tokens", q.cached_tokens}, {"completion_tokens", q.completion_tokens},
                               {"prompt_bytes", q.prompt_bytes}});
  }
  auto fit = sim::calibrate_from_loadgen(rep, trace, sim::Calibration{});
  ASSERT_TRUE(fit.is_ok()) << fit.status().to_string();
  EXPECT_NEAR(fit->prompt_bytes_per_token, 1.0, 1e-9);
  EXPECT_EQ(fit->costs.prefill_serial_fraction, 1.0);  // no summary to search against: all of it
  EXPECT_NEAR(fit->noise, 0.0, 1e-6);
  EXPECT_NEAR(fit->costs.prefill_per_token_s, truth.costs.prefill_per_token_s, 1e-7);
  EXPECT_NEAR(fit->costs.request_overhead_s, truth.costs.request_overhead_s + truth.costs.prefill_base_s, 1e-6);
  // One sequence per step: base + per-seq is what the fit can see.
  EXPECT_NEAR(fit->costs.decode_base_s + fit->costs.decode_per_seq_s,
              truth.costs.decode_base_s + truth.costs.decode_per_seq_s, 1e-6);
  // Round trip through JSON.
  auto back = sim::calibration_from_json(sim::calibration_to_json(*fit));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back->costs, fit->costs);
  EXPECT_FALSE(sim::calibration_from_json(json{{"costs", {{"decode_base_s", -1}}}}).is_ok());
}

// The router, load generator and store on the replicas' cores (Calibration::cpu_per_request): 4
// replicas of 1 thread saturated on 2 cores run their steps 4 ÷ 2 = 2 times slower; with the
// others taking o = 0.5 core they run 4 ÷ 1.5 times slower, so the run takes 4/3 as long and the
// throughput is 3/4 of it. o = c · n ÷ wall with wall = 4/3 · W0 gives c = (2/3) · W0 ÷ n.
TEST(ClusterSim, OverheadPerRequestTakesItsCoresFromTheReplicas) {
  const size_t n = 256;
  const lg::Trace t = independent(std::vector<double>(n, 0.0), 64, 32);
  sim::Topology topo;
  topo.policy.policy = router::Policy::kRoundRobin;
  topo.replicas = 4;
  topo.cpus = 2;
  sim::Calibration c = simple_costs();
  auto base = sim::simulate(t, c, topo);
  ASSERT_TRUE(base.is_ok());
  EXPECT_EQ(base->overhead_cores, 0.0);
  const double w0 = base->wall_s;
  const double x0 = sim::report(*base, topo, lg::Slo{})["summary"]["requests_per_s"].get<double>();
  c.cpu_per_request.loadgen_s = 2.0 / 3.0 * w0 / static_cast<double>(n);
  auto with = sim::simulate(t, c, topo);
  ASSERT_TRUE(with.is_ok());
  const json rep = sim::report(*with, topo, lg::Slo{});
  EXPECT_NEAR(with->overhead_cores, 0.5, 0.01);
  EXPECT_NEAR(rep["metrics"]["cpu"]["replica_cores"].get<double>(), 1.5, 0.01);
  EXPECT_NEAR(with->wall_s / w0, 4.0 / 3.0, 0.01);
  EXPECT_NEAR(rep["summary"]["requests_per_s"].get<double>() / x0, 0.75, 0.01);
  // The share solves o = c · n ÷ wall for the run it predicts.
  EXPECT_NEAR(with->overhead_cores, c.cpu_per_request.loadgen_s * static_cast<double>(n) / with->wall_s, 1e-4);
  // Split between the router, the store and the replicas' own work it is the same sum.
  sim::Calibration split = simple_costs();
  split.cpu_per_request = {c.cpu_per_request.loadgen_s / 4, c.cpu_per_request.loadgen_s / 4, 0,
                           c.cpu_per_request.loadgen_s / 2};
  auto s = sim::simulate(t, split, topo);
  ASSERT_TRUE(s.is_ok());
  EXPECT_NEAR(s->wall_s, with->wall_s, 1e-6 * w0);
  // Without shared cores (cpus 0) the others cost nothing.
  topo.cpus = 0;
  EXPECT_EQ(sim::overhead_cpu_per_request(c, topo), 0.0);
}

// One replica of 2 threads on 2 cores, one request at a time: every step takes 2 ÷ (2 − o) of
// its cost, o = c · 3 requests ÷ the wall time (about 20 s): c = 0.2 s gives o ≈ 0.03.
TEST(ClusterSim, OverheadSlowsEachStepByTheCoresItTakes) {
  const int64_t tokens = 12;
  const lg::Trace t = independent({0.0, 10.0, 20.0}, 200, tokens);
  sim::Calibration c = simple_costs();
  c.threads_per_replica = 2;
  c.cpu_per_request.router_s = 0.2;
  sim::Topology topo;
  topo.cpus = 2;
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  const double o = r->overhead_cores;
  EXPECT_NEAR(o, 0.2 * 3 / r->wall_s, 1e-5);
  EXPECT_NEAR(o, 0.6 / 20.06, 0.001);
  const double slow = 2 / (2 - o);
  const double step = c.costs.decode_base_s + c.costs.decode_per_seq_s;
  for (const lg::RequestResult& q : r->results) {
    ASSERT_TRUE(q.ok);
    EXPECT_NEAR(q.ttft_s, c.costs.request_overhead_s + (c.costs.prefill_base_s + 200 * c.costs.prefill_per_token_s) * slow,
                1e-9);
    for (double g : q.gaps_s) EXPECT_NEAR(g, step * slow, 1e-9);
  }
  // The router's share is charged only when requests pass one; the store's only with a live store.
  topo.router = false;
  EXPECT_EQ(sim::overhead_cpu_per_request(c, topo), 0.0);
  c.cpu_per_request.store_s = 0.1;
  EXPECT_EQ(sim::overhead_cpu_per_request(c, topo), 0.0);
  topo.store.enabled = true;
  EXPECT_EQ(sim::overhead_cpu_per_request(c, topo), 0.1);
  topo.store.alive = false;
  EXPECT_EQ(sim::overhead_cpu_per_request(c, topo), 0.0);
}

// A zero overhead (a calibration file without "cpu_per_request", or with zeros) is today's model:
// the same report, no "cpu" metrics; the exact single-request case holds on shared cores.
TEST(ClusterSim, ZeroOverheadIsTheOldPrediction) {
  auto old_file = sim::calibration_from_json(json{{"costs", {{"decode_per_seq_s", 0.0005}}}});
  ASSERT_TRUE(old_file.is_ok());
  EXPECT_EQ(old_file->cpu_per_request, sim::ProcessCpu{});
  const lg::Trace t = independent({0.0, 10.0, 20.0}, 200, 12);
  sim::Calibration c = simple_costs();
  c.threads_per_replica = 2;
  sim::Topology topo;
  topo.cpus = 2;
  topo.store.enabled = true;
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->overhead_cores, 0.0);
  const json rep = sim::report(*r, topo, lg::Slo{});
  EXPECT_FALSE(rep["metrics"].contains("cpu"));
  const double step = c.costs.decode_base_s + c.costs.decode_per_seq_s;
  for (const lg::RequestResult& q : r->results) {
    EXPECT_NEAR(q.ttft_s, c.costs.request_overhead_s + c.costs.prefill_base_s + 200 * c.costs.prefill_per_token_s, 1e-12);
    for (double g : q.gaps_s) EXPECT_NEAR(g, step, 1e-12);
  }
  // The JSON's zeros read back as zeros and predict the same; a non-zero share does not.
  auto back = sim::calibration_from_json(sim::calibration_to_json(c));
  ASSERT_TRUE(back.is_ok());
  auto again = sim::simulate(t, *back, topo);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(sim::report(*again, topo, lg::Slo{}).dump(), rep.dump());
  c.cpu_per_request.store_s = 0.5;
  auto more = sim::simulate(t, c, topo);
  ASSERT_TRUE(more.is_ok());
  EXPECT_GT(more->wall_s, r->wall_s);
}

// cpu_per_request from CPU sidecars: router and load generator over every run's requests, the
// store over the runs with one, the replicas' CPU less their simulated engine time over the others.
TEST(ClusterSim, ProcessCpuFromRunsDividesBySentRequests) {
  auto summary = [](int64_t n) { return json{{"summary", {{"requests", n}}}}; };
  auto procs = [](double router, double loadgen, double serve, double redis) {
    json p = {{"router", {{"cpu_s_run", router}}}, {"loadgen", {{"cpu_s_run", loadgen}}},
              {"serve1", {{"cpu_s_run", serve}}}};
    if (redis >= 0) p["redis"] = {{"cpu_s_run", redis}};
    return json{{"procs", p}};
  };
  std::vector<sim::CpuRun> runs = {{summary(100), procs(0.2, 0.3, 1.5, -1), 1.0},
                                   {summary(300), procs(0.6, 0.5, 4.0, -1), 2.5},
                                   {summary(200), procs(0.2, 0.4, 9.0, 0.6), 1.0}};
  auto p = sim::process_cpu_from_runs(runs);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_NEAR(p->router_s, 1.0 / 600, 1e-12);
  EXPECT_NEAR(p->loadgen_s, 1.2 / 600, 1e-12);
  EXPECT_NEAR(p->store_s, 0.6 / 200, 1e-12);
  EXPECT_NEAR(p->replica_s, (0.5 + 1.5) / 400, 1e-12);
  sim::Calibration cal;
  cal.cpu_per_request = *p;
  auto back = sim::calibration_from_json(sim::calibration_to_json(cal));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back->cpu_per_request, *p);
  EXPECT_FALSE(sim::process_cpu_from_runs({{summary(10), json{{"procs", {{"router", {{"cpu_s_run", 1}}}}}}, -1}}).is_ok());
  EXPECT_FALSE(sim::calibration_from_json(json{{"cpu_per_request", {{"router_s", -1}}}}).is_ok());
}

// serve's bound on connections from one address (the router's): 300 requests at once at one
// replica, the first 256 hold a connection each, the other 44 are answered 429 at once and
// counted as errors, as bench_loadgen counts them; throughput is the completed ones over the wall.
TEST(ClusterSim, ConnectionsPastServesPerAddressBoundAre429) {
  const lg::Trace t = independent(std::vector<double>(300, 0.0), 64, 4);
  sim::Topology topo;
  ASSERT_EQ(topo.max_connections_per_ip, 256) << "serve's default (bin/commands.h)";
  ASSERT_EQ(topo.max_waiting, 256);
  auto r = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(r.is_ok());
  int64_t refused = 0;
  for (size_t i = 0; i < r->results.size(); ++i) {
    const lg::RequestResult& q = r->results[i];
    if (i < 256) {
      EXPECT_TRUE(q.ok) << i << ": " << q.error;
    } else {
      EXPECT_FALSE(q.ok) << i;
      EXPECT_EQ(q.error.rfind("HTTP 429: ", 0), 0u) << q.error;
      EXPECT_EQ(q.completion_tokens, 0);
      EXPECT_DOUBLE_EQ(q.latency_s, 0.0) << "answered at its connection";
      ++refused;
    }
  }
  EXPECT_EQ(refused, 44);
  const json rep = sim::report(*r, topo, lg::Slo{});
  EXPECT_EQ(rep["summary"]["ok"], 256);
  EXPECT_EQ(rep["summary"]["errors"], 44);
  ASSERT_EQ(rep["summary"]["error_messages"].size(), 1u);
  EXPECT_EQ(rep["summary"]["error_messages"][0]["count"], 44);
  EXPECT_NEAR(rep["summary"]["requests_per_s"].get<double>(), 256 / r->wall_s, 1e-9);
  EXPECT_EQ(rep["metrics"]["serve"]["connections_refused_per_ip"], 44);
  EXPECT_EQ(rep["metrics"]["serve"]["completed"], 256);
  EXPECT_EQ(rep["metrics"]["serve"]["rejected"], 0);
  EXPECT_EQ(rep["metrics"]["router"]["retries"], 0) << "the router relays a 429";
  // Without the bound serve's queue bound refuses (503) what it cannot queue; without both every
  // request is served, over a longer run.
  topo.max_connections_per_ip = 0;
  auto queued = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(queued.is_ok());
  EXPECT_EQ(sim::report(*queued, topo, lg::Slo{})["metrics"]["serve"]["rejected"], 300 - 256 - 1)
      << "the first request runs, 256 wait";
  topo.max_waiting = 0;
  auto all = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(all.is_ok());
  for (const auto& q : all->results) EXPECT_TRUE(q.ok) << q.error;
  EXPECT_GT(all->wall_s, r->wall_s);
}

// serve's queue bound: with max_waiting queued behind the running batch a request is answered 503
// at its submission. One replica: the first request runs, the next 10 wait, the other 19 are
// refused. Two round-robin replicas: each refuses 4 of its 15, the router tries each on the other
// replica (a retry), also full, and relays the 503.
TEST(ClusterSim, RequestsPastMaxWaitingAre503AndTheRouterTriesAnotherReplica) {
  const lg::Trace t = independent(std::vector<double>(30, 0.0), 64, 4);
  sim::Topology topo;
  topo.max_connections_per_ip = 0;
  topo.max_waiting = 10;
  topo.max_batch = 2;
  auto one = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(one.is_ok());
  json rep = sim::report(*one, topo, lg::Slo{});
  EXPECT_EQ(rep["summary"]["ok"], 11);
  EXPECT_EQ(rep["summary"]["errors"], 19);
  for (size_t i = 11; i < 30; ++i) EXPECT_EQ(one->results[i].error.rfind("HTTP 503: server busy", 0), 0u) << i;
  EXPECT_EQ(rep["metrics"]["serve"]["rejected"], 19);
  EXPECT_EQ(rep["metrics"]["router"]["retries"], 0);

  topo.replicas = 2;
  topo.policy.policy = router::Policy::kRoundRobin;
  auto two = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(two.is_ok());
  rep = sim::report(*two, topo, lg::Slo{});
  EXPECT_EQ(rep["summary"]["ok"], 22);
  EXPECT_EQ(rep["summary"]["errors"], 8);
  EXPECT_EQ(rep["metrics"]["router"]["retries"], 8);
  EXPECT_EQ(rep["metrics"]["serve"]["rejected"], 16) << "each of the 8 refused by both replicas";
  EXPECT_EQ(rep["metrics"]["serve"]["replicas"][0]["chosen"], 19);
  EXPECT_EQ(rep["metrics"]["serve"]["replicas"][1]["chosen"], 19);
  // No bound: all served.
  topo.max_waiting = 0;
  auto all = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(all.is_ok());
  for (const auto& q : all->results) EXPECT_TRUE(q.ok) << q.error;
}

// A refused turn ends its turn without an answer: the conversation's next turn goes out with the
// refused prompt (no answer) in front, as bench_loadgen sends it.
TEST(ClusterSim, ARefusedTurnLetsItsConversationGoOn) {
  std::string text;
  for (int i = 0; i < 3; ++i) text += json{{"arrival_s", 0}, {"prompt", "x" + std::string(40, 'a')}, {"max_tokens", 4}}.dump() + "\n";
  text += json{{"arrival_s", 0}, {"session", "s"}, {"prompt", "first turn"}, {"max_tokens", 4}}.dump() + "\n";
  text += json{{"arrival_s", 10}, {"session", "s"}, {"prompt", " second"}, {"max_tokens", 4}}.dump() + "\n";
  const lg::Trace t = parse(text);
  sim::Topology topo;
  topo.max_connections_per_ip = 3;
  auto r = sim::simulate(t, simple_costs(), topo);
  ASSERT_TRUE(r.is_ok());
  EXPECT_FALSE(r->results[3].ok);
  EXPECT_EQ(r->results[3].error.rfind("HTTP 429: ", 0), 0u) << r->results[3].error;
  ASSERT_TRUE(r->results[4].ok) << r->results[4].error;
  EXPECT_EQ(r->results[4].prompt_bytes, static_cast<int64_t>(std::string("first turn second").size()));
}

// A request refused at its connection costs the replica nothing: the replicas' own CPU per
// request counts the accepted ones (256 of 300 at once), the load generator's every one.
TEST(ClusterSim, RefusedRequestsTakeNoReplicaCpu) {
  const lg::Trace t = independent(std::vector<double>(300, 0.0), 64, 4);
  sim::Topology topo;
  topo.cpus = 2;
  sim::Calibration c = simple_costs();
  c.cpu_per_request.replica_s = 0.002;
  auto r = sim::simulate(t, c, topo);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->accepted, 256u);
  EXPECT_NEAR(r->overhead_cores * r->wall_s, 0.002 * 256, 0.002 * 256 * 1e-3);
  c.cpu_per_request.replica_s = 0;
  c.cpu_per_request.loadgen_s = 0.002;
  auto l = sim::simulate(t, c, topo);
  ASSERT_TRUE(l.is_ok());
  EXPECT_EQ(l->accepted, 256u);
  EXPECT_NEAR(l->overhead_cores * l->wall_s, 0.002 * 300, 0.002 * 300 * 1e-3);
}
