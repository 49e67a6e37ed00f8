// ReplicaEventLog (cluster/replica_events.h): the lines `generate` (text mode) and `serve` print
// to stderr for KV node replicas, each naming the node: a replica declared dead and where the tier
// goes on, a rejoin (on a spare: both nodes), and a lost tier naming every dead node with why; a
// state that did not change prints nothing. The processes' own lines are checked in
// KvNodeProcess.TextMode* (kv_node_process_test.cc).
#include <gtest/gtest.h>

#include "cluster/replica_events.h"

namespace specontext::cluster {
namespace {

transport::ReplicaReport replica(const std::string& node, bool alive, const std::string& error = "",
                                 int64_t rejoins = 0, uint64_t resynced = 0) {
  transport::ReplicaReport r;
  r.node = node;
  r.alive = alive;
  r.error = error;
  r.rejoins = rejoins;
  r.bytes_resynced = resynced;
  return r;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

TEST(ReplicaEvents, FailOverRejoinAndLossNameTheNodes) {
  ReplicaEventLog log;
  const std::string a = "10.0.0.1:7001", b = "10.0.0.2:7002", c = "10.0.0.3:7003";
  auto tier = [](std::vector<transport::ReplicaReport> r) {
    return std::vector<TierReplicas>{{2, "remote0", std::move(r)}};
  };
  EXPECT_TRUE(log.update(tier({replica(a, true), replica(b, true)})).empty());

  auto lines = log.update(tier({replica(a, false, "peer failure: Connection reset by remote peer"), replica(b, true)}));
  ASSERT_EQ(lines.size(), 1u) << joined(lines);
  EXPECT_EQ(lines[0],
            "kv-node: tier remote0: replica 0 on 10.0.0.1:7001 is dead (peer failure: Connection reset by remote "
            "peer); reads fail over, the tier goes on on 10.0.0.2:7002");
  // Unchanged: nothing again.
  EXPECT_TRUE(log.update(tier({replica(a, false, "peer failure: Connection reset by remote peer"), replica(b, true)}))
                  .empty());

  // Replica 0 moved to a spare and was filled from b.
  lines = log.update(tier({replica(c, true, "", 1, 2 << 20), replica(b, true)}));
  ASSERT_EQ(lines.size(), 1u) << joined(lines);
  EXPECT_EQ(lines[0],
            "kv-node: tier remote0: replica 0 rejoined on 10.0.0.3:7003 (a spare; it was on 10.0.0.1:7001): 2.00 MiB "
            "copied from a live replica");

  // Both die between two looks: one loss line naming both nodes and why.
  lines = log.update(tier({replica(c, false, "silent for 5000 ms", 1, 2 << 20),
                           replica(b, false, "peer failure: Endpoint timeout")}));
  ASSERT_EQ(lines.size(), 1u) << joined(lines);
  EXPECT_EQ(lines[0],
            "kv-node: tier remote0 lost: no replica alive (10.0.0.3:7003: silent for 5000 ms; 10.0.0.2:7002: peer "
            "failure: Endpoint timeout)");
  EXPECT_TRUE(log.update(tier({replica(c, false, "silent for 5000 ms", 1, 2 << 20),
                               replica(b, false, "peer failure: Endpoint timeout")}))
                  .empty())
      << "a loss is reported once";  EXPECT_EQ(log.deaths(), 3) << "a, then c and b";
}

TEST(ReplicaEvents, DeadAtTheFirstLookAndRejoinedThenDeadAgainAreBothReported) {
  ReplicaEventLog log;
  // Two tiers; tier 3's second replica was unreachable at set-up.
  auto lines = log.update({{2, "remote0", {replica("h:1", true)}},
                           {3, "remote1", {replica("h:2", true), replica("h:3", false, "cannot connect: x")}}});
  ASSERT_EQ(lines.size(), 1u) << joined(lines);
  EXPECT_EQ(lines[0],
            "kv-node: tier remote1: replica 1 on h:3 is dead (cannot connect: x); reads fail over, the tier goes on on h:2");
  // It rejoins on its own node and dies again before the next look: both lines, in that order.
  lines = log.update({{2, "remote0", {replica("h:1", true)}},
                      {3, "remote1", {replica("h:2", true), replica("h:3", false, "rejoin failed: y", 1, 4096)}}});
  ASSERT_EQ(lines.size(), 2u) << joined(lines);
  EXPECT_EQ(lines[0], "kv-node: tier remote1: replica 1 rejoined on h:3: 4.00 KiB copied from a live replica");
  EXPECT_EQ(lines[1],
            "kv-node: tier remote1: replica 1 on h:3 is dead (rejoin failed: y); reads fail over, the tier goes on on h:2");
  // The only replica of remote0 dies: its loss, naming it.
  lines = log.update({{2, "remote0", {replica("h:1", false, "flush failed: z")}},
                      {3, "remote1", {replica("h:2", true), replica("h:3", false, "rejoin failed: y", 1, 4096)}}});
  ASSERT_EQ(lines.size(), 1u) << joined(lines);
  EXPECT_EQ(lines[0], "kv-node: tier remote0 lost: no replica alive (h:1: flush failed: z)");  EXPECT_EQ(log.deaths(), 3) << "h:3 at the first look and again after its rejoin, then h:1";
}

}  // namespace
}  // namespace specontext::cluster
