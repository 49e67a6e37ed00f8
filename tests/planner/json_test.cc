// Plans and snapshots through JSON and back, and computed plans against the checked-in fixtures.
// Each fixture holds a description, a list of snapshots (the first is planned, each later one
// re-planned from the previous plan) and the expected final plan. To regenerate after a deliberate
// change: SPECONTEXT_UPDATE_FIXTURES=1 build/.../test_planner_json_test, then review the diff.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "planner/plan.h"
#include "planner/plan_json.h"
#include "tests/tests_common.h"

namespace specontext::planner {
namespace {

using nlohmann::json;

PlannerSnapshot tiny(int64_t seq) {
  PlannerSnapshot s;
  s.model = {4, 1, 4, 2, 0};
  s.model_bytes = 100;
  s.budget = 2;
  s.device_bytes = 1250;
  s.host = {{0, 600, 10e9}, {1, 300, 20e9}};
  s.remote = {{0, 1000, 5e9}};
  s.host_to_host_bandwidth_bps = 8e9;
  s.seq_lens = {seq};
  return s;
}

TEST(PlannerJson, SnapshotRoundTrip) {
  PlannerSnapshot s = tiny(18);
  s.runtime_factor = 1.25;
  s.filter_shortlist_tokens = 77;
  s.model.head_kv_heads = 1;
  auto back = snapshot_from_json(json::parse(snapshot_to_json(s).dump()));
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, s);
}

TEST(PlannerJson, PlanRoundTripWithMigrations) {
  Plan a = *plan(tiny(12));
  auto b = replan(a, tiny(20));  // filtering on: a head migration and layer migrations
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  ASSERT_FALSE(b->migrations.empty());
  const std::string text = plan_to_json(*b).dump(2);
  auto j = parse_json_text(text, "plan");
  ASSERT_TRUE(j.is_ok());
  auto back = plan_from_json(*j);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(*back, *b);
  EXPECT_EQ(plan_to_json(*back), plan_to_json(*b));
}

TEST(PlannerJson, MalformedInputIsAnErrorNotAnException) {
  EXPECT_EQ(parse_json_text("{not json", "x").status().code(), StatusCode::kInvalidArgument);
  json j = plan_to_json(*plan(tiny(12)));
  j.erase("thresholds");
  auto r = plan_from_json(j);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("thresholds"), std::string::npos) << r.status().message();

  j = plan_to_json(*plan(tiny(12)));
  j["layers"][1]["home"] = 9;  // no such tier
  EXPECT_EQ(plan_from_json(j).status().code(), StatusCode::kInvalidArgument);
  j = plan_to_json(*plan(tiny(12)));
  j["offloaded_layers"] = "two";
  EXPECT_EQ(plan_from_json(j).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan_from_json(json::array()).status().code(), StatusCode::kInvalidArgument);

  json s = snapshot_to_json(tiny(12));
  s["model"]["q_heads"] = 3;  // validated after parsing: 3 is not a multiple of 2
  s["model"]["kv_heads"] = 2;
  auto sr = snapshot_from_json(s);
  ASSERT_FALSE(sr.is_ok());
  EXPECT_NE(sr.status().message().find("q_heads"), std::string::npos);
}


// A number too large for an integer parses as a JSON float (the fuzzer's seq_lens of 1.4e30); a
// float, a fraction or an out-of-range integer in an integer field is an error naming the field,
// never a cast (undefined behaviour under UBSan) or a silent truncation.
TEST(PlannerJson, IntegerFieldsTakeOnlyIntegersInRange) {
  auto snapshot_error = [](const std::string& field, const json& value) {
    json s = snapshot_to_json(tiny(12));
    if (field == "seq_lens") s[field] = json::array({value});
    else if (field == "layers") s["model"][field] = value;
    else if (field == "numa_node") s["host"][0][field] = value;
    else s[field] = value;
    auto r = snapshot_from_json(s);
    EXPECT_FALSE(r.is_ok()) << field << " = " << value.dump();
    return r.is_ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(snapshot_error("seq_lens", json::parse("144444444444444444444444444444")).find("'seq_lens'"),
            std::string::npos);
  EXPECT_NE(snapshot_error("seq_lens", 12.5).find("'seq_lens'"), std::string::npos);
  EXPECT_NE(snapshot_error("budget", 1e30).find("'budget'"), std::string::npos);
  EXPECT_NE(snapshot_error("layers", -1e300).find("'layers'"), std::string::npos);
  EXPECT_NE(snapshot_error("numa_node", int64_t{1} << 40).find("'numa_node'"), std::string::npos);
  EXPECT_NE(snapshot_error("filter_shortlist_tokens", 18446744073709551615ULL).find("'filter_shortlist_tokens'"),
            std::string::npos);

  json p = plan_to_json(*plan(tiny(12)));
  p["thresholds"][0] = 3.0e19;
  auto r = plan_from_json(p);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("'thresholds'"), std::string::npos) << r.status().message();
  p = plan_to_json(*plan(tiny(12)));
  p["layers"][0]["layer"] = int64_t{1} << 33;  // would truncate to layer 0
  EXPECT_FALSE(plan_from_json(p).is_ok());
}
TEST(PlannerJson, Fixtures) {
  const std::filesystem::path dir = testing::repo_path("tests/planner/fixtures");
  const bool update = std::getenv("SPECONTEXT_UPDATE_FIXTURES") != nullptr;
  int seen = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    SCOPED_TRACE(entry.path().filename().string());
    auto fixture = parse_json_text(testing::read_text_file(entry.path().string()), entry.path().string());
    ASSERT_TRUE(fixture.is_ok()) << fixture.status().to_string();
    ASSERT_TRUE(fixture->contains("snapshots"));
    std::vector<PlannerSnapshot> snaps;
    for (const json& js : fixture->at("snapshots")) {
      auto s = snapshot_from_json(js);
      ASSERT_TRUE(s.is_ok()) << s.status().to_string();
      snaps.push_back(*s);
    }
    ASSERT_FALSE(snaps.empty());
    auto p = plan(snaps[0]);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    for (size_t i = 1; i < snaps.size(); ++i) {
      p = replan(*p, snaps[i]);
      ASSERT_TRUE(p.is_ok()) << "step " << i << ": " << p.status().to_string();
    }
    if (update) {
      json out = *fixture;
      out["plan"] = plan_to_json(*p);
      std::ofstream(entry.path()) << out.dump(2) << "\n";
      continue;
    }
    ASSERT_TRUE(fixture->contains("plan")) << "fixture has no plan; run with SPECONTEXT_UPDATE_FIXTURES=1";
    auto expected = plan_from_json(fixture->at("plan"));
    ASSERT_TRUE(expected.is_ok()) << expected.status().to_string();
    EXPECT_EQ(*p, *expected);
    EXPECT_EQ(plan_to_json(*p), fixture->at("plan")) << plan_to_json(*p).dump(2);
  }
  EXPECT_GE(seen, 3);
}

}  // namespace
}  // namespace specontext::planner
