// The router's policies without sockets (serving/router/router_policy.h): round-robin order over
// the usable replicas, least-load by requests in flight, prefix affinity (the same long prefix
// goes to the same replica, different prefixes spread, a short match or an overloaded replica
// falls back to least-load), the hash chain, replica URLs, and the counters' table and renderer.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "serving/router/router.h"
#include "serving/router/router_counters.h"
#include "serving/router/router_policy.h"

namespace specontext::router {
namespace {

const std::vector<bool> kAll3{true, true, true};

std::vector<size_t> picks(RoutingPolicy& p, const std::vector<bool>& usable, int n) {
  std::vector<size_t> out;
  for (int i = 0; i < n; ++i) {
    auto c = p.choose(usable, {});
    EXPECT_TRUE(c.has_value());
    out.push_back(c ? c->replica : 99);
  }
  return out;
}

TEST(RouterPolicy, RoundRobinCyclesOverTheUsableReplicas) {
  RoutingPolicy p({.policy = Policy::kRoundRobin}, 3);
  EXPECT_EQ(picks(p, kAll3, 7), (std::vector<size_t>{0, 1, 2, 0, 1, 2, 0}));
  // Replica 2 down: skipped, the order of the others kept.
  EXPECT_EQ(picks(p, {true, true, false}, 4), (std::vector<size_t>{1, 0, 1, 0}));
  // Load does not matter to round-robin.
  p.started(0);
  p.started(0);
  EXPECT_EQ(picks(p, kAll3, 3), (std::vector<size_t>{1, 2, 0}));
  EXPECT_FALSE(p.choose({false, false, false}, {}).has_value());
  EXPECT_FALSE(p.choose({true, true}, {}).has_value()) << "a usable vector of the wrong size";
}

TEST(RouterPolicy, LeastLoadTakesTheReplicaWithFewestInFlight) {
  RoutingPolicy p({.policy = Policy::kLeastLoad}, 3);
  p.started(0);
  p.started(0);
  p.started(1);
  auto c = p.choose(kAll3, {});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->replica, 2u);
  EXPECT_EQ(c->reason, ChoiceReason::kLeastLoad);
  p.started(2);
  p.started(2);  // loads 2, 1, 2
  EXPECT_EQ(p.choose(kAll3, {})->replica, 1u);
  p.finished(0);
  p.finished(0);  // loads 0, 1, 2
  EXPECT_EQ(p.choose(kAll3, {})->replica, 0u);
  EXPECT_EQ(p.in_flight(0), 0);
  p.finished(0);  // never below zero
  EXPECT_EQ(p.in_flight(0), 0);
  // The least loaded one down: the next least loaded.
  EXPECT_EQ(p.choose({false, true, true}, {})->replica, 1u);
  // Equal loads: spread in turn, not always the first.
  RoutingPolicy q({.policy = Policy::kLeastLoad}, 3);
  std::set<size_t> seen;
  for (size_t r : picks(q, kAll3, 3)) seen.insert(r);
  EXPECT_EQ(seen.size(), 3u);
}

std::string text_of(char c, size_t n) { return std::string(n, c); }

// A prompt of distinct chunks: `tag` then filler.
std::string prompt(const std::string& tag, size_t bytes) {
  std::string s;
  while (s.size() < bytes) s += tag + " once upon a time " + std::to_string(s.size()) + ". ";
  return s.substr(0, bytes);
}

TEST(RouterPolicy, PrefixChunkHashesAreAChain) {
  const std::string a = prompt("alpha", 640);
  const auto ha = prefix_chunk_hashes(a, 64, 1 << 20);
  ASSERT_EQ(ha.size(), 10u);
  // A longer text with the same beginning: the same first hashes.
  const auto hb = prefix_chunk_hashes(a + "and then more text beyond the first ten chunks, enough for one more",
                                      64, 1 << 20);
  ASSERT_EQ(hb.size(), 11u);
  EXPECT_TRUE(std::equal(ha.begin(), ha.end(), hb.begin()));
  // One byte changed in chunk 3: chunks 0..2 equal, every later one differs (the chain).
  std::string c = a;
  c[3 * 64 + 5] ^= 1;
  const auto hc = prefix_chunk_hashes(c, 64, 1 << 20);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(hc[i], ha[i]) << i;
  for (size_t i = 3; i < ha.size(); ++i) EXPECT_NE(hc[i], ha[i]) << i;
  // The same chunk at another position hashes differently.
  const auto hr = prefix_chunk_hashes(text_of('x', 128), 64, 1 << 20);
  ASSERT_EQ(hr.size(), 2u);
  EXPECT_NE(hr[0], hr[1]);
  // Bounded: no more than max_bytes are hashed; a short text is one hash; empty is none.
  EXPECT_EQ(prefix_chunk_hashes(text_of('y', 1 << 20), 64, 4096).size(), 64u);
  EXPECT_EQ(prefix_chunk_hashes("short", 64, 4096).size(), 1u);
  EXPECT_NE(prefix_chunk_hashes("short", 64, 4096), prefix_chunk_hashes("shorT", 64, 4096));
  EXPECT_TRUE(prefix_chunk_hashes("", 64, 4096).empty());
}

TEST(RouterPolicy, PrefixSendsTheSameLongPrefixToTheSameReplicaAndSpreadsDifferentOnes) {
  PolicyOptions o{.policy = Policy::kPrefix, .chunk_bytes = 64};
  RoutingPolicy p(o, 3);
  auto hashes = [&](const std::string& s) { return prefix_chunk_hashes(s, o.chunk_bytes, o.max_prefix_bytes); };
  // Eight conversations: each first turn goes somewhere, and the eight spread over all three.
  std::map<int, size_t> home;
  std::map<size_t, int> per_replica;
  for (int i = 0; i < 8; ++i) {
    auto c = p.choose(kAll3, hashes(prompt("conversation" + std::to_string(i), 1024)));
    ASSERT_TRUE(c);
    EXPECT_EQ(c->reason, ChoiceReason::kPrefixMiss) << i;
    home[i] = c->replica;
    ++per_replica[c->replica];
  }
  EXPECT_EQ(per_replica.size(), 3u) << "different prefixes spread";
  for (const auto& [r, n] : per_replica) EXPECT_LE(n, 3) << "replica " << r;
  // Their next turns (the history plus more) each go home, by prefix.
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 8; ++i) {
      const std::string turn = prompt("conversation" + std::to_string(i), 1024) + prompt(" reply", 256 * (round + 1));
      auto c = p.choose(kAll3, hashes(turn));
      ASSERT_TRUE(c);
      EXPECT_EQ(c->replica, home[i]) << "conversation " << i << " round " << round;
      EXPECT_EQ(c->reason, ChoiceReason::kPrefixHit);
      EXPECT_GE(c->matched_chunks, 16u);
    }
  }
}

TEST(RouterPolicy, PrefixFallsBackToLeastLoadWhenTheMatchIsShortOrTheReplicaOverloaded) {
  PolicyOptions o{.policy = Policy::kPrefix, .chunk_bytes = 64, .match_ratio = 0.5, .balance_abs_threshold = 2};
  RoutingPolicy p(o, 2);
  auto hashes = [&](const std::string& s) { return prefix_chunk_hashes(s, o.chunk_bytes, o.max_prefix_bytes); };
  const std::string shared = prompt("system", 128);  // two chunks
  auto first = p.choose({true, true}, hashes(shared + prompt("question one", 1024)));
  ASSERT_TRUE(first);
  const size_t home = first->replica;
  // Shares 2 of 18 chunks: too short a match; least-load decides, and the load is equal, so the
  // replica holding fewer chunks (the other one) takes it.
  auto second = p.choose({true, true}, hashes(shared + prompt("question two", 1024)));
  ASSERT_TRUE(second);
  EXPECT_EQ(second->reason, ChoiceReason::kPrefixMiss);
  EXPECT_NE(second->replica, home);
  // A long match whose replica has 2 more in flight than the other (the threshold): the match wins.
  const auto again = hashes(shared + prompt("question one", 1024) + "!");
  p.started(home);
  p.started(home);
  auto hit = p.choose({true, true}, again);
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->reason, ChoiceReason::kPrefixHit);
  EXPECT_EQ(hit->replica, home);
  EXPECT_EQ(hit->matched_chunks, 18u);
  // 3 more (past the threshold): least-load takes it.
  p.started(home);
  auto busy = p.choose({true, true}, again);
  ASSERT_TRUE(busy);
  EXPECT_EQ(busy->reason, ChoiceReason::kPrefixOverloaded);
  EXPECT_NE(busy->replica, home);
  // The home replica down: the prompt goes to the other one.
  auto down = p.choose({home != 0, home != 1}, again);
  ASSERT_TRUE(down);
  EXPECT_NE(down->replica, home);
  // A replica forgotten (it went down and lost its cache) matches nothing.
  EXPECT_GT(p.match(home, again), 0u);
  p.forget(home);
  EXPECT_EQ(p.match(home, again), 0u);
  EXPECT_EQ(p.chunks_held(home), 0u);
  // Without prompt text (an unreadable body) prefix routing is least-load.
  auto none = p.choose({true, true}, {});
  ASSERT_TRUE(none);
  EXPECT_EQ(none->reason, ChoiceReason::kPrefixMiss);
}

TEST(RouterPolicy, PrefixMemoryIsBoundedAndLeastRecentlyUsedGoesFirst) {
  PolicyOptions o{.policy = Policy::kPrefix, .chunk_bytes = 64, .max_chunks_per_replica = 8};
  RoutingPolicy p(o, 1);
  auto hashes = [&](const std::string& s) { return prefix_chunk_hashes(s, o.chunk_bytes, o.max_prefix_bytes); };
  const auto a = hashes(prompt("a", 256));  // 4 chunks
  const auto b = hashes(prompt("b", 256));
  const auto c = hashes(prompt("c", 256));
  p.record(0, a);
  p.record(0, b);
  EXPECT_EQ(p.chunks_held(0), 8u);
  EXPECT_EQ(p.match(0, a), 4u);
  p.record(0, a);  // a used again: b is now the oldest
  p.record(0, c);
  EXPECT_EQ(p.chunks_held(0), 8u);
  EXPECT_EQ(p.match(0, a), 4u);
  EXPECT_EQ(p.match(0, b), 0u);
  EXPECT_EQ(p.match(0, c), 4u);
}

TEST(RouterPolicy, PolicyNamesRoundTrip) {
  for (Policy p : {Policy::kRoundRobin, Policy::kLeastLoad, Policy::kPrefix}) EXPECT_EQ(parse_policy(policy_name(p)), p);
  EXPECT_EQ(parse_policy("round-robin"), Policy::kRoundRobin);
  EXPECT_FALSE(parse_policy("random").has_value());
}

TEST(RouterPolicy, ReplicaUrls) {
  auto a = parse_replica_url("http://127.0.0.1:8000");
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 8000);
  EXPECT_EQ(a->name(), "127.0.0.1:8000");
  auto b = parse_replica_url("localhost:9/");
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(b->host, "localhost");
  EXPECT_EQ(b->port, 9);
  auto c = parse_replica_url("http://[::1]:8001");
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(parse_replica_url("https://h:1").status().code(), StatusCode::kUnimplemented);
  for (const char* bad : {"", "http://", "h", "h:", ":80", "h:0", "h:65536", "h:80x", "http://h:80/v1", "a@b:80"}) {
    auto r = parse_replica_url(bad);
    EXPECT_FALSE(r.is_ok()) << bad;
    if (!r.is_ok()) {
      EXPECT_NE(r.status().message().find("http://HOST:PORT"), std::string::npos) << bad;
    }
  }
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(RouterCounters, EveryFieldHasOneRowAndEachReplicaItsLabel) {
  RouterCounters c;
  int64_t v = 1000;
  std::set<std::string> names;
  for (const auto& s : router_counter_specs()) {
    c.*s.field = v++;
    EXPECT_TRUE(names.insert(s.prom_name).second) << s.prom_name;
  }
  EXPECT_EQ(router_counter_specs().size(), sizeof(RouterCounters) / sizeof(int64_t));
  EXPECT_EQ(replica_counter_specs().size(), sizeof(ReplicaCounters) / sizeof(int64_t));
  c.prefix_lookups = 4;
  c.prefix_hits = 3;
  std::vector<ReplicaSnapshot> rs(2);
  rs[0].name = "127.0.0.1:1";
  rs[1].name = "host\"x:2";
  for (const auto& s : replica_counter_specs()) {
    rs[0].counters.*s.field = v++;
    rs[1].counters.*s.field = v++;
    EXPECT_TRUE(names.insert(s.prom_name).second) << s.prom_name;
  }
  const std::string text = render_router_prometheus(c, rs);
  for (const auto& s : router_counter_specs()) {
    EXPECT_EQ(count_of(text, "# TYPE " + std::string(s.prom_name) + " " + s.prom_type + "\n"), 1u);
    EXPECT_EQ(count_of(text, "\n" + std::string(s.prom_name) + " " + std::to_string(c.*s.field) + "\n"), 1u)
        << s.prom_name;
  }
  EXPECT_EQ(count_of(text, "\nspecontext_router_prefix_hit_rate 0.750000\n"), 1u);
  EXPECT_DOUBLE_EQ(prefix_hit_rate(c), 0.75);
  EXPECT_DOUBLE_EQ(prefix_hit_rate(RouterCounters{}), 0.0);
  for (const auto& s : replica_counter_specs()) {
    const std::string n = s.prom_name;
    EXPECT_EQ(count_of(text, "\n" + n + "{replica=\"127.0.0.1:1\"} " + std::to_string(rs[0].counters.*s.field) + "\n"),
              1u)
        << n;
    EXPECT_EQ(count_of(text, "\n" + n + "{replica=\"host\\\"x:2\"} " + std::to_string(rs[1].counters.*s.field) + "\n"),
              1u)
        << n;
  }
}

}  // namespace
}  // namespace specontext::router
