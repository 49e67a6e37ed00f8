#include "cluster/replica_healer.h"

#include <algorithm>

namespace specontext::cluster {

namespace {
using Clock = std::chrono::steady_clock;
constexpr size_t kMaxEvents = 256;  // the log keeps the latest; repeated failures are one event each
}  // namespace

ReplicaHealer::~ReplicaHealer() = default;  // the futures of std::async wait for their attempts

void ReplicaHealer::watch(transport::UcxRemoteTransport* transport, std::vector<Endpoint> endpoints,
                          uint64_t region_bytes, std::vector<std::unique_ptr<KvNodeClient>> sessions) {
  Watched w;
  w.transport = transport;
  w.region_bytes = region_bytes;
  const size_t n = endpoints.size();
  w.endpoints = std::move(endpoints);
  w.sessions = std::move(sessions);
  w.sessions.resize(n);
  w.attempts.resize(n);
  w.ready.resize(n);
  w.next_try.assign(n, Clock::now());
  watched_.push_back(std::move(w));
}

void ReplicaHealer::record(const Watched& w, size_t replica, bool rejoined, std::string message) {
  const int32_t tier = w.transport->tier().value();
  const auto last = std::find_if(events_.rbegin(), events_.rend(),
                                 [&](const HealerEvent& e) { return e.tier == tier && e.replica == replica; });
  if (!rejoined && last != events_.rend() && !last->rejoined && last->message == message) {
    ++last->attempts;
    return;
  }
  if (events_.size() == kMaxEvents) events_.erase(events_.begin());
  events_.push_back(HealerEvent{w.transport->tier().value(), replica, w.endpoints[replica].text(), rejoined,
                                std::move(message)});
}

Result<ReplicaHealer::Attempt> ReplicaHealer::find_region(std::vector<Endpoint> candidates, uint64_t bytes,
                                                          std::chrono::milliseconds timeout,
                                                          KvNodeAccess access) {
  std::string failures;
  for (const Endpoint& endpoint : candidates) {
    auto session = KvNodeClient::connect(endpoint, timeout, access);
    Status failed = session.status();
    if (session.is_ok()) {
      auto region = (*session)->allocate(bytes);
      if (region.is_ok()) return Attempt{std::move(session).value(), std::move(region).value(), endpoint};
      failed = region.status();
    }
    failures += (failures.empty() ? "" : "; ") + failed.to_string();
  }
  return unavailable("no KV node to rejoin on: " + failures);
}

void ReplicaHealer::adopt(Watched& w, size_t replica, Attempt& attempt) {
  w.sessions[replica] = std::move(attempt.session);
  const std::string old = w.endpoints[replica].text();
  if (attempt.endpoint.text() == old) return;
  // Moved to a spare: the spare is taken, and the old address may come back as one.
  auto& spares = options_.spares;
  spares.erase(std::remove_if(spares.begin(), spares.end(),
                              [&](const Endpoint& e) { return e.text() == attempt.endpoint.text(); }),
               spares.end());
  spares.push_back(w.endpoints[replica]);
  w.endpoints[replica] = attempt.endpoint;
}

void ReplicaHealer::maintain() {
  const Clock::time_point now = Clock::now();
  for (Watched& w : watched_) {
    const std::vector<transport::ReplicaReport> reports = w.transport->replicas();
    // With no live replica the tier is lost: there is nothing to copy into a new region.
    if (std::none_of(reports.begin(), reports.end(), [](const auto& r) { return r.alive; })) continue;
    for (size_t i = 0; i < reports.size() && i < w.endpoints.size(); ++i) {
      if (reports[i].alive) continue;
      if (w.attempts[i].valid()) {
        if (w.attempts[i].wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
        Result<Attempt> attempt = w.attempts[i].get();
        if (!attempt.is_ok()) {
          record(w, i, false, attempt.status().to_string());
          continue;
        }
        w.ready[i] = std::make_unique<Attempt>(std::move(attempt).value());
      }
      if (w.ready[i] != nullptr) {
        const Status s = w.transport->rejoin(i, w.ready[i]->region);
        if (s.code() == StatusCode::kInProgress) continue;  // transfers in flight: at the next step
        if (s.is_ok()) {
          adopt(w, i, *w.ready[i]);
          record(w, i, true, "");
        } else {
          record(w, i, false, s.to_string());
        }
        w.ready[i].reset();  // on failure its session goes, and with it the region
        continue;
      }
      if (now < w.next_try[i]) continue;
      w.next_try[i] = now + options_.retry_interval;
      // The old region is never used again; if its node still lives, closing the session frees it.
      w.sessions[i].reset();
      // Its own address first (a restarted node), then the spares that hold no replica of the tier.
      std::vector<Endpoint> candidates{w.endpoints[i]};
      for (const Endpoint& spare : options_.spares) {
        if (std::none_of(w.endpoints.begin(), w.endpoints.end(),
                         [&](const Endpoint& e) { return e.text() == spare.text(); })) {
          candidates.push_back(spare);
        }
      }
      w.attempts[i] = std::async(std::launch::async, &ReplicaHealer::find_region, std::move(candidates),
                                 w.region_bytes, options_.timeout, options_.access);
    }
  }
}

}  // namespace specontext::cluster
