// Sizes as typed on the command line.
#include <gtest/gtest.h>

#include "planner/units.h"

namespace specontext::planner {
namespace {

TEST(PlannerUnits, ParseSize) {
  EXPECT_EQ(*parse_size("80GiB"), 80LL << 30);
  EXPECT_EQ(*parse_size("80G"), 80LL << 30);
  EXPECT_EQ(*parse_size("80gib"), 80LL << 30);
  EXPECT_EQ(*parse_size("512MiB"), 512LL << 20);
  EXPECT_EQ(*parse_size("512M"), 512LL << 20);
  EXPECT_EQ(*parse_size("4K"), 4096);
  EXPECT_EQ(*parse_size("1.5TiB"), 3LL << 39);
  EXPECT_EQ(*parse_size("80GB"), 80'000'000'000);
  EXPECT_EQ(*parse_size("2TB"), 2'000'000'000'000);
  EXPECT_EQ(*parse_size("4096"), 4096);
  EXPECT_EQ(*parse_size("100B"), 100);
  EXPECT_EQ(*parse_size(" 1 GiB "), 1LL << 30);
  EXPECT_EQ(*parse_size("0.5K"), 512);
}

TEST(PlannerUnits, ParseSizeErrors) {
  for (const char* bad : {"", "GiB", "-1G", "80XB", "1e3", "80 G B", "1.2.3G", "99999999999T"}) {
    auto r = parse_size(bad);
    EXPECT_FALSE(r.is_ok()) << bad;
    if (!r.is_ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(PlannerUnits, Lists) {
  auto sizes = parse_size_list("512GiB,256GiB");
  ASSERT_TRUE(sizes.is_ok());
  EXPECT_EQ(*sizes, (std::vector<int64_t>{512LL << 30, 256LL << 30}));
  EXPECT_FALSE(parse_size_list("512GiB,,1G").is_ok());
  auto nums = parse_number_list("50, 25.5");
  ASSERT_TRUE(nums.is_ok());
  EXPECT_EQ(*nums, (std::vector<double>{50, 25.5}));
  EXPECT_FALSE(parse_number_list("50,x").is_ok());
}

}  // namespace
}  // namespace specontext::planner
