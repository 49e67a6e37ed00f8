// In-process KV nodes and clients for the cluster tests (written once: kv_node_test,
// kv_node_security_test).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "cluster/kv_node.h"
#include "cluster/kv_node_client.h"

namespace specontext::cluster::testing {

inline std::unique_ptr<KvNode> start_node(uint64_t capacity = 8 << 20, uint16_t port = 0) {
  KvNodeOptions o;
  o.capacity = capacity;
  o.port = port;
  auto n = KvNode::start(o);
  EXPECT_TRUE(n.is_ok()) << n.status().to_string();
  return n.is_ok() ? std::move(n).value() : nullptr;
}

inline std::unique_ptr<KvNodeClient> connect(const KvNode& node) {
  auto c = KvNodeClient::connect(Endpoint{"127.0.0.1", node.port()}, std::chrono::seconds(2));
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return c.is_ok() ? std::move(c).value() : nullptr;
}

}  // namespace specontext::cluster::testing
