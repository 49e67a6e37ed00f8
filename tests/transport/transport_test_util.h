// Step-until-idle helpers for tests that drive a Transport (written once: the conformance suite,
// the transports' own tests, the KV node tests).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/ports/transport.h"

namespace specontext::transport_conformance {

// post, then poll until terminal (bounded: ~20 s).
inline Status run_to_end(Transport& t, TransferHandle& h) {
  Status s = t.post(h);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (s.code() == StatusCode::kInProgress && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(10));
    s = t.poll(h);
  }
  return s;
}

// prepare, run to the end, release.
inline Status run_batch(Transport& t, const TransferBatch& batch) {
  auto h = t.prepare(batch);
  if (!h.is_ok()) return h.status();
  Status s = run_to_end(t, *h);
  t.release(*h);
  return s;
}

inline void expect_mentions(const Status& s, const std::vector<std::string>& parts) {
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' missing in: " << s.message();
  }
}

}  // namespace specontext::transport_conformance
