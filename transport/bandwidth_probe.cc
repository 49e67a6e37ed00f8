#include "transport/bandwidth_probe.h"

#include <algorithm>
#include <limits>
#include <string>
#include <thread>

namespace specontext::transport {

namespace {

using Clock = std::chrono::steady_clock;

// Releases a prepared handle on every path out of a measurement.
class HandleGuard {
 public:
  HandleGuard(Transport& t, TransferHandle h) : t_(t), h_(h) {}
  ~HandleGuard() { t_.release(h_); }
  HandleGuard(const HandleGuard&) = delete;
  HandleGuard& operator=(const HandleGuard&) = delete;
  TransferHandle& handle() { return h_; }

 private:
  Transport& t_;
  TransferHandle h_;
};

// Seconds from the first post to completion (at least one clock tick).
Result<double> timed_transfer(Transport& t, const TransferBatch& batch, const ProbeOptions& o) {
  SPX_ASSIGN_OR_RETURN(TransferHandle prepared, t.prepare(batch));
  HandleGuard guard(t, prepared);
  TransferHandle& h = guard.handle();
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + o.transfer_timeout;
  Status s = t.post(h);
  while (s.code() == StatusCode::kResourceExhausted) {  // back-pressure: post again
    if (Clock::now() > deadline) break;
    std::this_thread::yield();
    s = t.post(h);
  }
  while (s.code() == StatusCode::kInProgress) {
    if (Clock::now() > deadline) break;
    std::this_thread::yield();
    s = t.poll(h);
  }
  const Clock::time_point end = Clock::now();
  if (s.code() == StatusCode::kInProgress || s.code() == StatusCode::kResourceExhausted) {
    // The guard's release cancels it.
    return unavailable("transfer not complete after " +
                       std::to_string(o.transfer_timeout.count()) +
                       " ms (transfer_timeout); cancelled; last status " + s.to_string());
  }
  SPX_RETURN_IF_ERROR(s);
  const Clock::duration took = std::max(end - start, Clock::duration(1));
  return std::chrono::duration<double>(took).count();
}

Status check_options(const ProbeOptions& o) {
  if (o.max_bytes == 0) return invalid_argument("probe: options.max_bytes must be positive");
  if (o.row_bytes == 0) return invalid_argument("probe: options.row_bytes must be positive");
  if (o.row_bytes > o.max_bytes) {
    return invalid_argument("probe: options.row_bytes (" + std::to_string(o.row_bytes) +
                            ") exceeds options.max_bytes (" + std::to_string(o.max_bytes) + ")");
  }
  if (o.block_bytes == 0) return invalid_argument("probe: options.block_bytes must be positive");
  if (o.gather_stride != 0 && o.gather_stride < o.row_bytes) {
    return invalid_argument("probe: options.gather_stride (" + std::to_string(o.gather_stride) +
                            ") is below options.row_bytes (" + std::to_string(o.row_bytes) +
                            "); rows would overlap");
  }
  if (o.max_gather_rows == 0) {
    return invalid_argument("probe: options.max_gather_rows must be positive");
  }
  if (o.repeats < 1) return invalid_argument("probe: options.repeats must be at least 1");
  if (o.time_budget.count() <= 0) return invalid_argument("probe: options.time_budget must be positive");
  if (o.transfer_timeout.count() <= 0) {
    return invalid_argument("probe: options.transfer_timeout must be positive");
  }
  return Status::ok();
}

struct Patterns {
  TransferBatch contiguous, gather, latency;
  uint64_t bytes = 0, gather_rows = 0, gather_bytes = 0;
};

// The three batches of one path; `who` names the path for errors.
Result<Patterns> build_patterns(const ProbePath& p, const ProbeOptions& o, const std::string& who) {
  if (!p.src.valid()) return invalid_argument(who + ": invalid src tier");
  if (!p.dst.valid()) return invalid_argument(who + ": invalid dst tier");
  if (p.bytes < o.row_bytes) {
    return invalid_argument(who + ": bytes (" + std::to_string(p.bytes) +
                            ") must be at least options.row_bytes (" +
                            std::to_string(o.row_bytes) + ")");
  }
  // The transport checks the region against the tiers; these only keep our arithmetic in range.
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  if (p.src_offset > max - p.bytes || p.dst_offset > max - p.bytes) {
    return out_of_range(who + ": offset + bytes overflows");
  }
  Patterns pat;
  const uint64_t n = std::min(p.bytes, o.max_bytes);
  pat.bytes = n;
  for (uint64_t off = 0; off < n; off += o.block_bytes) {
    pat.contiguous.push_back(
        {p.src, p.src_offset + off, p.dst, p.dst_offset + off, std::min(o.block_bytes, n - off)});
  }
  const uint64_t stride = o.gather_stride != 0 ? o.gather_stride : 8 * o.row_bytes;
  const uint64_t rows =
      std::min({o.max_gather_rows, (n - o.row_bytes) / stride + 1, n / o.row_bytes});
  pat.gather.reserve(rows);
  for (uint64_t r = 0; r < rows; ++r) {
    pat.gather.push_back(
        {p.src, p.src_offset + r * stride, p.dst, p.dst_offset + r * o.row_bytes, o.row_bytes});
  }
  pat.gather_rows = rows;
  pat.gather_bytes = rows * o.row_bytes;
  pat.latency.push_back({p.src, p.src_offset, p.dst, p.dst_offset, o.row_bytes});
  return pat;
}

}  // namespace

Result<std::vector<ProbeResult>> probe_bandwidth(Transport& t, const std::vector<ProbePath>& paths,
                                                 const ProbeOptions& o) {
  SPX_RETURN_IF_ERROR(check_options(o));
  std::vector<ProbeResult> results;
  results.reserve(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) {
    const ProbePath& p = paths[i];
    const std::string who = "probe: path " + std::to_string(i) + " '" + p.name + "'";
    if (p.name.empty()) return invalid_argument(who + ": empty name");
    SPX_ASSIGN_OR_RETURN(Patterns pat, build_patterns(p, o, who));
    ProbeResult r;
    r.name = p.name;
    r.src = p.src;
    r.dst = p.dst;
    r.bytes = pat.bytes;
    r.gather_rows = pat.gather_rows;
    r.gather_bytes = pat.gather_bytes;
    double best_contiguous = std::numeric_limits<double>::infinity();
    double best_gather = std::numeric_limits<double>::infinity();
    double best_latency = std::numeric_limits<double>::infinity();
    const Clock::time_point start = Clock::now();
    for (int round = 0; round < o.repeats; ++round) {
      Result<double> c = timed_transfer(t, pat.contiguous, o);
      if (!c.is_ok()) return c.status().with_context(who + " (contiguous)");
      Result<double> g = timed_transfer(t, pat.gather, o);
      if (!g.is_ok()) return g.status().with_context(who + " (gather)");
      Result<double> l = timed_transfer(t, pat.latency, o);
      if (!l.is_ok()) return l.status().with_context(who + " (latency)");
      best_contiguous = std::min(best_contiguous, *c);
      best_gather = std::min(best_gather, *g);
      best_latency = std::min(best_latency, *l);
      r.repeats = round + 1;
      if (Clock::now() - start >= o.time_budget) break;
    }
    r.contiguous_bps = static_cast<double>(pat.bytes) / best_contiguous;
    r.gather_bps = static_cast<double>(pat.gather_bytes) / best_gather;
    r.latency_seconds = best_latency;
    results.push_back(std::move(r));
  }
  return results;
}

nlohmann::json probe_results_to_json(const std::vector<ProbeResult>& results) {
  nlohmann::json out = nlohmann::json::array();
  for (const ProbeResult& r : results) {
    out.push_back({{"name", r.name},
                   {"src_tier", r.src.value()},
                   {"dst_tier", r.dst.value()},
                   {"bytes", r.bytes},
                   {"contiguous_bps", r.contiguous_bps},
                   {"gather_bps", r.gather_bps},
                   {"gather_rows", r.gather_rows},
                   {"gather_bytes", r.gather_bytes},
                   {"latency_seconds", r.latency_seconds},
                   {"repeats", r.repeats}});
  }
  return out;
}

}  // namespace specontext::transport
