// In-process KV nodes and clients for the cluster tests (written once: kv_node_test,
// kv_node_hostile_test, kv_node_auth_test), and a raw line-speaking control connection.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

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

// A control connection that speaks raw lines (no automatic hello), with blocking reads bounded
// generously so that a broken node fails the test instead of hanging it.
class RawConnection {
 public:
  explicit RawConnection(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }
  // The reply as JSON; discarded when the connection closed first.
  nlohmann::json call(const std::string& line) {
    if (!send(line + "\n")) return nlohmann::json::value_t::discarded;
    return read_line();
  }
  bool send(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
  }
  nlohmann::json read_line() {
    std::string text;
    char c = 0;
    while (wait_readable() && ::recv(fd_, &c, 1, 0) == 1) {
      if (c == '\n') return nlohmann::json::parse(text, nullptr, false);
      text.push_back(c);
    }
    return nlohmann::json::value_t::discarded;
  }
  // True once the node has closed the connection (end of stream or reset).
  bool closed_by_peer() {
    char c = 0;
    if (!wait_readable()) return false;
    return ::recv(fd_, &c, 1, 0) <= 0;
  }

 private:
  bool wait_readable() {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, 60000) == 1;  // a safety net against a hang, not a timing assertion
  }
  int fd_ = -1;
};

}  // namespace specontext::cluster::testing
