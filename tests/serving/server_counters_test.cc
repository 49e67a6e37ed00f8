// ServerCounters' table and renderers: every field has one row, and each renderer shows each
// field once, under its own name, with its own value.

#include "serving/openai/server_counters.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace specontext::cluster {
namespace {

// Distinct values, all of the same width, so that no value is a prefix of another.
ServerCounters distinct_counters() {
  ServerCounters c;
  int64_t v = 1000;
  for (const CounterSpec& s : server_counter_specs()) c.*s.field = v++;
  return c;
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(ServerCounters, EveryFieldHasOneRow) {
  const auto specs = server_counter_specs();
  static_assert(sizeof(ServerCounters) % sizeof(int64_t) == 0);
  EXPECT_EQ(specs.size(), sizeof(ServerCounters) / sizeof(int64_t));
  std::set<std::string> names, prom_names;
  for (const CounterSpec& s : specs) {
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    EXPECT_TRUE(prom_names.insert(s.prom_name).second) << s.prom_name;
    EXPECT_TRUE(std::string(s.prom_type) == "counter" || std::string(s.prom_type) == "gauge") << s.name;
  }
  // Distinct fields: each row writes its own one, so every field got a distinct value.
  const ServerCounters c = distinct_counters();
  std::set<int64_t> values;
  for (const CounterSpec& s : specs) values.insert(c.*s.field);
  EXPECT_EQ(values.size(), specs.size());
}

TEST(ServerCounters, PrometheusShowsEachCounterOnce) {
  const ServerCounters c = distinct_counters();
  const std::string text = render_prometheus(c);
  const auto specs = server_counter_specs();
  EXPECT_EQ(count_of(text, "\n"), 3 * specs.size());
  for (const CounterSpec& s : specs) {
    const std::string name = s.prom_name;
    EXPECT_EQ(count_of(text, "# HELP " + name + " " + s.help + "\n"), 1u) << name;
    EXPECT_EQ(count_of(text, "# TYPE " + name + " " + s.prom_type + "\n"), 1u) << name;
    EXPECT_EQ(count_of(text, "\n" + name + " " + std::to_string(c.*s.field) + "\n"), 1u) << name;
  }
  // The exact bytes /metrics has always begun with.
  EXPECT_EQ(text.rfind("# HELP specontext_requests_running requests in the running batch\n"
                       "# TYPE specontext_requests_running gauge\n"
                       "specontext_requests_running " +
                           std::to_string(c.running) + "\n",
                       0),
            0u)
      << text;
}

TEST(ServerCounters, JsonHasEachCountedFieldUnderItsKey) {
  const ServerCounters c = distinct_counters();
  const nlohmann::json j = render_json(c);
  size_t keyed = 0;
  for (const CounterSpec& s : server_counter_specs()) {
    if (s.json_key == nullptr) continue;
    ++keyed;
    ASSERT_TRUE(j.contains(s.json_key)) << s.name;
    EXPECT_EQ(j[s.json_key].get<int64_t>(), c.*s.field) << s.name;
  }
  EXPECT_EQ(j.size(), keyed);
  // The keys serve's "stopped" event has always printed (the chunk counters since issue #31), and
  // no others.
  const std::set<std::string> stopped_keys = {"accepted",
                                              "completed",
                                              "rejected",
                                              "cancelled",
                                              "failed",
                                              "unauthorized",
                                              "connections_refused",
                                              "connections_refused_per_ip",
                                              "header_timeouts",
                                              "prepare_refused",
                                              "prompt_tokens",
                                              "generated_tokens",
                                              "max_batch_sequences",
                                              "preemptions",
                                              "preemption_swaps",
                                              "lost_tiers",
                                              "lost_tier_recomputes",
                                              "cached_prompt_tokens",
                                              "prefix_cache_evictions",
                                              "prefix_offloads",
                                              "prefix_restores",
                                              "prefix_disk_writes",
                                              "prefix_disk_restores",
                                              "prefix_disk_errors",
                                              "prefix_shared_hits",
                                              "prefix_shared_misses",
                                              "prefix_shared_writes",
                                              "prefix_shared_bytes_read",
                                              "prefix_shared_bytes_written",
                                              "prefix_shared_errors",
                                              "prefix_shared_chunks_written",
                                              "prefix_shared_chunks_skipped",
                                              "prefix_shared_chunks_read",
                                              "prefix_shared_chunks_local"};
  std::set<std::string> keys;
  for (const auto& [key, value] : j.items()) keys.insert(key);
  EXPECT_EQ(keys, stopped_keys);
  EXPECT_EQ(j["lost_tier_recomputes"].get<int64_t>(), c.lost_tier_requeues);
  EXPECT_EQ(j["generated_tokens"].get<int64_t>(), c.generated_tokens);
}

TEST(ServerCounters, CopiesTheSchedulersCountsOnly) {
  GenerationStats st;
  int64_t v = 2000;
  for (const CounterSpec& s : server_counter_specs()) {
    if (s.from_stats != nullptr) st.*s.from_stats = v++;
  }
  ServerCounters c;
  copy_generation_stats(st, c);
  for (const CounterSpec& s : server_counter_specs()) {
    EXPECT_EQ(c.*s.field, s.from_stats != nullptr ? st.*s.from_stats : 0) << s.name;
  }
  EXPECT_EQ(c.prompt_tokens, st.prompt_tokens);
  EXPECT_EQ(c.prefix_disk_errors, st.prefix_disk_errors);  // PrefixStoreStats' fields too
  EXPECT_EQ(c.prefix_shared_hits, st.prefix_shared_hits);
  EXPECT_EQ(c.prefix_shared_errors, st.prefix_shared_errors);
  EXPECT_EQ(c.max_batch_sequences, st.max_batch_sequences);
  EXPECT_EQ(c.accepted, 0);  // the server's own
}

}  // namespace
}  // namespace specontext::cluster
