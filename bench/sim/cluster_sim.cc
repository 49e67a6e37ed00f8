#include "bench/sim/cluster_sim.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <limits>
#include <list>
#include <map>
#include <queue>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "planner/plan.h"

namespace specontext::bench::sim {

using json = nlohmann::json;
namespace lg = specontext::bench::loadgen;

namespace {

// ---- a bounded LRU set of chain hashes (a replica's prefix cache, in pages) ----------------------
class LruSet {
 public:
  explicit LruSet(size_t capacity) : capacity_(capacity) {}
  // Leading hashes of `chain` held.
  size_t match(const std::vector<uint64_t>& chain) const {
    size_t k = 0;
    while (k < chain.size() && index_.count(chain[k]) != 0) ++k;
    return k;
  }
  bool holds(uint64_t h) const { return index_.count(h) != 0; }
  // Inserts (or refreshes) every hash; returns how many were new.
  size_t insert(const std::vector<uint64_t>& chain) {
    size_t added = 0;
    for (uint64_t h : chain) {
      auto it = index_.find(h);
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
        continue;
      }
      if (capacity_ == 0) return added;
      lru_.push_front(h);
      index_[h] = lru_.begin();
      ++added;
      while (lru_.size() > capacity_) {
        index_.erase(lru_.back());
        lru_.pop_back();
      }
    }
    return added;
  }

 private:
  size_t capacity_;
  std::list<uint64_t> lru_;
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> index_;
};

size_t common_prefix(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

// A replica's prefix cache as serve keeps it: the KV of up to `slots` finished sequences (LRU), a
// sequence's pages found by any later prompt that starts with them. A new entry that extends an
// older one (the next turn of a conversation) replaces it.
class SequenceCache {
 public:
  explicit SequenceCache(size_t slots) : slots_(slots) {}
  size_t match(const std::vector<uint64_t>& chain) const {
    size_t best = 0;
    for (const auto& e : entries_) best = std::max(best, common_prefix(e, chain));
    return best;
  }
  void insert(std::vector<uint64_t> chain) {
    if (slots_ == 0 || chain.empty()) return;
    entries_.remove_if([&](const std::vector<uint64_t>& e) { return common_prefix(e, chain) == e.size(); });
    entries_.push_front(std::move(chain));
    while (entries_.size() > slots_) entries_.pop_back();
  }

 private:
  size_t slots_;
  std::list<std::vector<uint64_t>> entries_;  // most recent first
};

double uniform01(std::mt19937_64& g) { return (static_cast<double>(g() >> 11) + 0.5) * 0x1.0p-53; }
double standard_normal(std::mt19937_64& g) {
  const double u1 = uniform01(g), u2 = uniform01(g);
  return std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2);
}

enum class EventKind { kArrive, kReach, kEnqueue, kStepDone };
struct Event {
  double t;
  int64_t seq;  // ties: in order of scheduling
  EventKind kind;
  int64_t a;  // request (arrive, reach) or replica (step done)
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

struct Request {
  std::string prompt;
  std::vector<uint64_t> pages;   // chain hashes of the prompt's whole pages
  std::vector<uint64_t> chunks;  // the router's prefix chunks (prefix policy)
  std::vector<bool> tried;       // replicas the router tried (a 503 sends it to another)
  bool started = false;          // counted in the router policy's in-flight (policy_.started)
  bool open = false;             // holds a connection at its replica
  bool via_router = false;       // holds a connection at the router
  bool accepted = false;         // a replica accepted its connection (once: a retry is not counted again)
  int64_t prompt_tokens = 0;
  int64_t replica = -1;
  int64_t produced = 0;
  int64_t ctx = 0;
  double last_token_t = 0;
  bool prefilled = false;
};

struct Replica {
  std::deque<int64_t> waiting;
  std::vector<int64_t> running;   // prefilled, decoding
  std::vector<int64_t> admitted;  // prefilled by the step in progress
  std::vector<int64_t> decoding;  // decoded by the step in progress
  bool busy = false;
  double busy_s = 0;
  SequenceCache cache;
  int64_t chosen = 0, computed = 0, cached = 0, prefix_hits = 0;
  int64_t open = 0;  // connections: requests admitted and not finished
  // Refused: at max_connections (503), at max_connections_per_ip (429), at max_waiting (503).
  int64_t refused_connections = 0, refused_per_ip = 0, refused_waiting = 0;
  explicit Replica(size_t slots) : cache(slots) {}
};

struct Session {
  std::string history;
  int64_t done = 0;
  bool in_flight = false;
  std::deque<int64_t> pending;  // arrived, waiting for the previous turn
};

int64_t checked_int(const json& j, const char* key, int64_t def) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : def;
}
double checked_num(const json& j, const char* key, double def) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : def;
}

class Simulator {
 public:
  // replica_cpus: the cores the replicas share (Topology::cpus less the other processes' share).
  Simulator(const lg::Trace& trace, const Calibration& cal, const Topology& topo, double replica_cpus)
      : trace_(trace), cal_(cal), topo_(topo), replica_cpus_(replica_cpus),
        policy_(topo.policy, static_cast<size_t>(topo.replicas)),
        rng_(topo.seed), noise_(topo.noise < 0 ? cal.noise : topo.noise), store_(std::numeric_limits<size_t>::max()) {
    const size_t slots = topo.prefix_caching ? static_cast<size_t>(std::max<int64_t>(0, topo.prefix_cache_slots)) : 0;
    for (int64_t r = 0; r < topo.replicas; ++r) replicas_.emplace_back(slots);
    page_bytes_ = std::max<size_t>(1, static_cast<size_t>(std::llround(static_cast<double>(cal.page_tokens) *
                                                                        cal.prompt_bytes_per_token)));
    results_.resize(trace.requests.size());
    reqs_.resize(trace.requests.size());
  }

  Result<SimOutput> run() {
    for (size_t i = 0; i < trace_.requests.size(); ++i) {
      const lg::TraceRequest& r = trace_.requests[i];
      lg::RequestResult& res = results_[i];
      res = lg::scheduled_result(r, i, topo_.time_scale);
      push(res.scheduled_at_s, EventKind::kArrive, static_cast<int64_t>(i));
    }
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.t;
      switch (e.kind) {
        case EventKind::kArrive: arrive(e.a); break;
        case EventKind::kReach: reach(e.a); break;
        case EventKind::kEnqueue: enqueue(e.a); break;
        case EventKind::kStepDone: step_done(e.a); break;
      }
    }
    SimOutput out;
    out.wall_s = wall_;
    out.accepted = accepted_;
    out.metrics = metrics();  // before the results move out: it counts the completed ones
    out.results = std::move(results_);
    return out;
  }

 private:
  void push(double t, EventKind k, int64_t a) { events_.push({t, next_seq_++, k, a}); }

  std::vector<uint64_t> pages_of(const std::string& text) const {
    if (text.size() < page_bytes_) return {};
    return router::prefix_chunk_hashes(text, page_bytes_, std::numeric_limits<size_t>::max() / 2);
  }

  void arrive(int64_t i) {
    const lg::TraceRequest& r = trace_.requests[static_cast<size_t>(i)];
    if (!r.session.empty()) {
      Session& s = sessions_[r.session];
      if (s.in_flight || !s.pending.empty()) {
        s.pending.push_back(i);
        return;
      }
      s.in_flight = true;
    }
    dispatch(i);
  }

  // Sends request i now: its prompt as bench_loadgen builds it, the router's choice.
  void dispatch(int64_t i) {
    const lg::TraceRequest& r = trace_.requests[static_cast<size_t>(i)];
    Request& q = reqs_[static_cast<size_t>(i)];
    if (!r.prefix.empty()) q.prompt = trace_.prefixes.at(r.prefix);
    if (!r.session.empty()) {
      const Session& s = sessions_[r.session];
      if (s.done > 0) q.prompt = s.history;
    }
    q.prompt += r.prompt;
    q.prompt_tokens = std::max<int64_t>(
        1, std::llround(static_cast<double>(q.prompt.size()) / cal_.prompt_bytes_per_token));
    q.pages = pages_of(q.prompt);
    lg::RequestResult& res = results_[static_cast<size_t>(i)];
    res.sent_at_s = now_;
    res.prompt_bytes = static_cast<int64_t>(q.prompt.size());
    res.prompt_tokens = q.prompt_tokens;

    if (topo_.policy.policy == router::Policy::kPrefix) {
      q.chunks = router::prefix_chunk_hashes(q.prompt, topo_.policy.chunk_bytes, topo_.policy.max_prefix_bytes);
    }
    q.tried.assign(static_cast<size_t>(topo_.replicas), false);
    if (topo_.router) {
      if (topo_.router_max_connections > 0 && router_open_ >= topo_.router_max_connections) {
        ++router_refused_;
        refuse(i, 503,
               "router at its connection limit (" + std::to_string(topo_.router_max_connections) +
                   " connections are open)");
        return;
      }
      ++router_open_;
      q.via_router = true;
    }
    route(i, true);
  }

  // The router's choice among the replicas not yet tried, and the connection to it (counted from
  // the choice; its overheads follow).
  void route(int64_t i, bool first) {
    Request& q = reqs_[static_cast<size_t>(i)];
    std::vector<bool> usable(static_cast<size_t>(topo_.replicas));
    for (size_t r = 0; r < usable.size(); ++r) usable[r] = !q.tried[r];
    const auto choice = policy_.choose(usable, q.chunks);
    if (!choice) {  // not reached: busy() retries only while a replica is left
      ++router_unavailable_;
      refuse(i, 503, "no replica could take the request");
      return;
    }
    const size_t rep = choice->replica;
    if (!first) ++router_retries_;
    policy_.started(rep);
    q.started = true;
    q.tried[rep] = true;
    q.replica = static_cast<int64_t>(rep);
    Replica& R = replicas_[rep];
    ++R.chosen;
    if (first && !q.chunks.empty()) {
      ++router_lookups_;
      router_prompt_chunks_ += static_cast<int64_t>(q.chunks.size());
      router_matched_chunks_ += static_cast<int64_t>(choice->matched_chunks);
      if (choice->reason == router::ChoiceReason::kPrefixHit) {
        ++router_hits_;
        ++R.prefix_hits;
      }
    }
    // serve's accept: its connection limit (503), then one address's (429).
    if (topo_.max_connections > 0 && R.open >= topo_.max_connections) {
      ++R.refused_connections;
      busy(i, "server at its connection limit (" + std::to_string(topo_.max_connections) +
                  " connections are open); retry later");
      return;
    }
    if (topo_.max_connections_per_ip > 0 && R.open >= topo_.max_connections_per_ip) {
      ++R.refused_per_ip;
      refuse(i, 429,
             "too many connections from 127.0.0.1: " + std::to_string(R.open) +
                 " are open, the most one client address may hold (max_connections_per_ip)");
      return;
    }
    ++R.open;
    q.open = true;
    if (!q.accepted) ++accepted_;
    q.accepted = true;
    const double overhead = cal_.costs.request_overhead_s + (topo_.router ? cal_.costs.router_overhead_s : 0.0);
    push(now_ + overhead, EventKind::kReach, i);
  }

  // A 503 from request i's replica before any byte: the router tries a replica not yet tried,
  // else the 503 reaches the client.
  void busy(int64_t i, const std::string& why) {
    Request& q = reqs_[static_cast<size_t>(i)];
    policy_.finished(static_cast<size_t>(q.replica));
    q.started = false;
    if (q.open) {
      --replicas_[static_cast<size_t>(q.replica)].open;
      q.open = false;
    }
    if (topo_.router && std::find(q.tried.begin(), q.tried.end(), false) != q.tried.end()) {
      route(i, false);
      return;
    }
    refuse(i, 503, why);
  }

  // Request i answered `status` without a completion (an error in the report, as bench_loadgen's).
  void refuse(int64_t i, int status, const std::string& why) {
    fail(i, "HTTP " + std::to_string(status) + ": " + why);
  }

  // At the replica: the part of the prompt's per-token cost that is not the engine's (parsing,
  // tokenizing on request workers, in parallel) delays the request before it queues.
  void reach(int64_t i) {
    const Request& q = reqs_[static_cast<size_t>(i)];
    const double off_engine = 1 - cal_.costs.prefill_serial_fraction;
    if (off_engine > 0) {
      const Replica& R = replicas_[static_cast<size_t>(q.replica)];
      size_t found = R.cache.match(q.pages);
      for (int64_t o : R.running) found = std::max(found, common_prefix(reqs_[static_cast<size_t>(o)].pages, q.pages));
      const int64_t max_pages = (q.prompt_tokens - 1) / cal_.page_tokens;
      const int64_t cached =
          topo_.prefix_caching ? std::min<int64_t>(static_cast<int64_t>(found), max_pages) * cal_.page_tokens : 0;
      const double delay =
          off_engine * (cal_.costs.prefill_base_s +
                        cal_.costs.prefill_per_token_s * static_cast<double>(q.prompt_tokens - cached));
      if (delay > 0) {
        push(now_ + delay, EventKind::kEnqueue, i);
        return;
      }
    }
    enqueue(i);
  }

  void enqueue(int64_t i) {
    const size_t rep = static_cast<size_t>(reqs_[static_cast<size_t>(i)].replica);
    if (topo_.max_waiting > 0 && static_cast<int64_t>(replicas_[rep].waiting.size()) >= topo_.max_waiting) {
      ++replicas_[rep].refused_waiting;
      busy(i, "server busy: " + std::to_string(topo_.max_waiting) + " requests are waiting; retry later");
      return;
    }
    replicas_[rep].waiting.push_back(i);
    start_step(rep);
  }

  // The planner's snapshot of a replica with these live lengths.
  planner::PlannerSnapshot snapshot(const std::vector<int64_t>& lens) const {
    planner::PlannerSnapshot s;
    s.model = cal_.model;
    s.kv_elem_bytes = cal_.kv_elem_bytes;
    s.model_bytes = 0;
    s.head_bytes = 0;
    s.runtime_factor = 1;
    s.budget = 1;  // dense: B = 1 (planner/README.md, the engine's policy)
    s.requests = std::max<int64_t>(topo_.max_batch, static_cast<int64_t>(lens.size()));
    s.device_bytes = topo_.tiers.device_kv_bytes;
    if (topo_.tiers.host_kv_bytes > 0) s.host.push_back({0, topo_.tiers.host_kv_bytes, topo_.tiers.host_bandwidth_bps});
    if (topo_.tiers.remote_kv_bytes > 0) {
      s.remote.push_back({0, topo_.tiers.remote_kv_bytes, topo_.tiers.remote_bandwidth_bps});
    }
    s.retrieval_bytes_per_token = 1;  // dense: no retrieval head
    for (int64_t l : lens) s.seq_lens.push_back((l + cal_.page_tokens - 1) / cal_.page_tokens * cal_.page_tokens);
    return s;
  }
  bool planning() const { return topo_.tiers.device_kv_bytes > 0; }
  // The store's chunk (--prefix-store-chunk) in whole pages.
  int64_t chunk_pages() const {
    return std::max<int64_t>(1, (topo_.store.chunk_tokens + cal_.page_tokens - 1) / cal_.page_tokens);
  }

  std::vector<int64_t> live_lengths(const Replica& R) const {
    std::vector<int64_t> lens;
    for (int64_t j : R.running) lens.push_back(reqs_[static_cast<size_t>(j)].ctx);
    return lens;
  }

  void fail(int64_t i, const std::string& why) {
    lg::RequestResult& res = results_[static_cast<size_t>(i)];
    res.ok = false;
    res.error = why;
    res.latency_s = now_ - res.sent_at_s;
    finish_common(i, std::string());
  }

  void start_step(size_t rep) {
    Replica& R = replicas_[rep];
    if (R.busy) return;
    const StepCosts& c = cal_.costs;
    double cost = 0, io = 0;
    R.admitted.clear();
    R.decoding = R.running;
    // Admission: the queue's head while slots (and, planning, the device and pools) allow.
    while (!R.waiting.empty() && static_cast<int64_t>(R.running.size() + R.admitted.size()) < topo_.max_batch) {
      const int64_t j = R.waiting.front();
      Request& q = reqs_[static_cast<size_t>(j)];
      if (planning()) {
        std::vector<int64_t> lens = live_lengths(R);
        for (int64_t a : R.admitted) lens.push_back(reqs_[static_cast<size_t>(a)].prompt_tokens);
        lens.push_back(q.prompt_tokens);
        if (!planner::plan(snapshot(lens)).is_ok()) {
          if (R.running.empty() && R.admitted.empty()) {
            R.waiting.pop_front();
            fail(j, "does not fit the replica's KV tiers (planner)");
            continue;
          }
          break;
        }
      }
      R.waiting.pop_front();
      // Prefix cache, then the shared store.
      const int64_t page = cal_.page_tokens;
      const int64_t max_pages = (q.prompt_tokens - 1) / page;  // at least one token is computed
      const auto usable_pages = [&](size_t m) { return std::min<int64_t>(static_cast<int64_t>(m), max_pages); };
      // Finished sequences kept, and the prompts of those running (or admitted before it).
      size_t found = R.cache.match(q.pages);
      for (int64_t o : R.running) found = std::max(found, common_prefix(reqs_[static_cast<size_t>(o)].pages, q.pages));
      for (int64_t o : R.admitted) found = std::max(found, common_prefix(reqs_[static_cast<size_t>(o)].pages, q.pages));
      const int64_t local = topo_.prefix_caching ? usable_pages(found) : 0;
      int64_t hit_pages = local;
      if (topo_.store.enabled && local < std::min<int64_t>(max_pages, static_cast<int64_t>(q.pages.size()))) {
        if (!topo_.store.alive) {
          ++store_errors_;
          ++store_misses_;
          io += topo_.store.dead_timeout_s;
        } else {
          io += topo_.store.latency_s;
          const int64_t remote = usable_pages(store_.match(q.pages));
          if (remote > local) {
            ++store_hits_;
            // serve's read (PrefixStore::restore_shared): the whole chunks a kept sequence holds
            // are forked, not read; the chunks after them (the last, shorter one always) are.
            const int64_t chunk = chunk_pages();
            const int64_t kept = topo_.prefix_caching ? static_cast<int64_t>(R.cache.match(q.pages)) : 0;
            const int64_t skip = std::min(kept, remote - 1) / chunk * chunk;
            const int64_t reads = (remote + chunk - 1) / chunk - skip / chunk;
            store_chunks_local_ += skip / chunk;
            store_chunks_read_ += reads;
            io += static_cast<double>(reads) * topo_.store.latency_s;  // one get a chunk
            const double bytes =
                static_cast<double>((remote - skip) * page * cal_.kv_bytes_per_token());
            store_bytes_read_ += bytes;
            io += bytes / topo_.store.bandwidth_bps;
            hit_pages = remote;
          } else {
            ++store_misses_;
          }
        }
      }
      const int64_t cached = hit_pages * page;
      const int64_t computed = q.prompt_tokens - cached;
      results_[static_cast<size_t>(j)].cached_tokens = cached;
      R.cached += cached;
      R.computed += computed;
      cost += c.prefill_serial_fraction * (c.prefill_base_s + c.prefill_per_token_s * static_cast<double>(computed));
      if (topo_.store.enabled && topo_.store.alive) {
        // serve's chunks: whole ones the store holds every page of are skipped; the rest, and a
        // shorter last one, are written whole.
        const auto total = static_cast<int64_t>(q.pages.size());
        const int64_t chunk = chunk_pages();
        std::vector<bool> held(q.pages.size());
        for (size_t i = 0; i < q.pages.size(); ++i) held[i] = store_.holds(q.pages[i]);
        const size_t added = store_.insert(q.pages);
        if (added > 0) {
          int64_t written = 0;
          for (int64_t a = 0; a < total; a += chunk) {
            const int64_t b = std::min(total, a + chunk);
            const bool all = std::all_of(held.begin() + a, held.begin() + b, [](bool h) { return h; });
            if (!all || b - a < chunk) {
              written += b - a;
              ++store_chunks_written_;
            } else {
              ++store_chunks_skipped_;
            }
          }
          ++store_writes_;
          store_bytes_written_ += static_cast<double>(written) * static_cast<double>(page * cal_.kv_bytes_per_token());
        } else {
          store_chunks_skipped_ += (total + chunk - 1) / chunk;  // the store holds every one
        }
      }
      q.ctx = q.prompt_tokens;
      R.admitted.push_back(j);
    }
    if (R.admitted.empty() && R.decoding.empty()) return;
    if (!R.decoding.empty()) {
      double ctx = 0;
      for (int64_t j : R.decoding) ctx += static_cast<double>(reqs_[static_cast<size_t>(j)].ctx);
      cost += c.decode_base_s + c.decode_per_seq_s * static_cast<double>(R.decoding.size()) +
              c.decode_per_ctx_token_s * ctx;
    }
    // Offloaded layers stream from their tier each step (the engine prefetches: overlapped).
    double transfer = 0;
    if (planning() && !R.decoding.empty()) {
      auto p = planner::plan(snapshot(live_lengths(R)));
      if (p.is_ok()) {
        for (const planner::LayerPlacement& l : p->layers) {
          if (l.home.value() == 0) continue;
          const planner::TierInfo& t = p->tiers[static_cast<size_t>(l.home.value())];
          const double bw = t.bandwidth_bps > 0 ? t.bandwidth_bps : 1e9;
          transfer += static_cast<double>(l.kv_bytes) / bw;
          tier_bytes_[t.kind == TierKind::kRemote ? "remote" : "host"] += static_cast<double>(l.kv_bytes);
        }
      }
    }
    cost = std::max(cost, transfer);
    // Replicas on shared cores slow each other.
    ++busy_replicas_;
    if (topo_.cpus > 0) {
      const double demand = static_cast<double>(busy_replicas_ * cal_.threads_per_replica);
      cost *= std::max(1.0, demand / replica_cpus_);
    }
    if (noise_ > 0) cost *= std::exp(noise_ * standard_normal(rng_) - 0.5 * noise_ * noise_);
    cost += io;
    R.busy = true;
    R.busy_s += cost;
    push(now_ + cost, EventKind::kStepDone, static_cast<int64_t>(rep));
  }

  void step_done(int64_t rep_i) {
    const size_t rep = static_cast<size_t>(rep_i);
    Replica& R = replicas_[rep];
    R.busy = false;
    --busy_replicas_;
    std::vector<int64_t> finished;
    for (int64_t j : R.admitted) {
      Request& q = reqs_[static_cast<size_t>(j)];
      lg::RequestResult& res = results_[static_cast<size_t>(j)];
      res.ttft_s = now_ - res.sent_at_s;
      q.produced = 1;
      q.ctx += 1;
      q.last_token_t = now_;
      q.prefilled = true;
      R.running.push_back(j);
    }
    for (int64_t j : R.decoding) {
      Request& q = reqs_[static_cast<size_t>(j)];
      results_[static_cast<size_t>(j)].gaps_s.push_back(now_ - q.last_token_t);
      q.last_token_t = now_;
      q.produced += 1;
      q.ctx += 1;
    }
    for (int64_t j : R.running) {
      if (reqs_[static_cast<size_t>(j)].produced >= trace_.requests[static_cast<size_t>(j)].max_tokens) {
        finished.push_back(j);
      }
    }
    for (int64_t j : finished) {
      R.running.erase(std::find(R.running.begin(), R.running.end(), j));
      complete(j);
    }
    R.admitted.clear();
    R.decoding.clear();
    start_step(rep);
  }

  void complete(int64_t i) {
    Request& q = reqs_[static_cast<size_t>(i)];
    lg::RequestResult& res = results_[static_cast<size_t>(i)];
    res.ok = true;
    res.latency_s = now_ - res.sent_at_s;
    res.completion_tokens = q.produced;
    // The answer: filler text of the calibrated length, distinct per request.
    const size_t bytes = static_cast<size_t>(std::llround(static_cast<double>(q.produced) * cal_.output_bytes_per_token));
    const std::string unit = " a" + std::to_string(i);
    std::string answer;
    while (answer.size() < bytes) answer += unit;
    answer.resize(bytes);
    // A finished request's whole pages stay in its replica's cache.
    if (topo_.prefix_caching) {
      Replica& R = replicas_[static_cast<size_t>(q.replica)];
      R.cache.insert(pages_of(q.prompt + answer));
    }
    finish_common(i, answer);
  }

  void finish_common(int64_t i, const std::string& answer) {
    Request& q = reqs_[static_cast<size_t>(i)];
    wall_ = std::max(wall_, now_);
    if (q.started) policy_.finished(static_cast<size_t>(q.replica));
    q.started = false;
    if (q.open) --replicas_[static_cast<size_t>(q.replica)].open;
    q.open = false;
    if (q.via_router) --router_open_;
    q.via_router = false;
    const lg::TraceRequest& r = trace_.requests[static_cast<size_t>(i)];
    if (r.session.empty()) return;
    Session& s = sessions_[r.session];
    s.history = q.prompt + answer;
    ++s.done;
    s.in_flight = false;
    if (!s.pending.empty()) {
      const int64_t next = s.pending.front();
      s.pending.pop_front();
      s.in_flight = true;
      dispatch(next);
    }
  }

  json metrics() const {
    int64_t computed = 0, cached = 0, completed = 0, generated = 0;
    int64_t rejected = 0, refused_connections = 0, refused_per_ip = 0;
    json reps = json::array();
    for (size_t r = 0; r < replicas_.size(); ++r) {
      const Replica& R = replicas_[r];
      computed += R.computed;
      cached += R.cached;
      rejected += R.refused_waiting;
      refused_connections += R.refused_connections;
      refused_per_ip += R.refused_per_ip;
      reps.push_back({{"replica", r},
                      {"chosen", R.chosen},
                      {"prompt_tokens_computed", R.computed},
                      {"prompt_tokens_cached", R.cached},
                      {"prefix_hits", R.prefix_hits},
                      {"rejected", R.refused_waiting},
                      {"connections_refused", R.refused_connections},
                      {"connections_refused_per_ip", R.refused_per_ip},
                      {"busy_s", R.busy_s},
                      {"utilisation", wall_ > 0 ? R.busy_s / wall_ : 0.0}});
    }
    for (const auto& res : results_) {
      if (res.ok) {
        ++completed;
        generated += res.completion_tokens;
      }
    }
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    json serve = {
        {"completed", completed},
        {"rejected", rejected},                        // max_waiting (serve's requests_rejected_total)
        {"connections_refused", refused_connections},  // max_connections
        {"connections_refused_per_ip", refused_per_ip},
        {"generated_tokens", generated},
        {"prompt_tokens_computed", computed},
        {"prompt_tokens_cached", cached},
        {"prefix_cache_hit_rate", ratio(static_cast<double>(cached), static_cast<double>(cached + computed))},
        {"shared_store",
         {{"enabled", topo_.store.enabled},
          {"alive", topo_.store.alive},
          {"hits", store_hits_},
          {"misses", store_misses_},
          {"hit_rate", ratio(static_cast<double>(store_hits_), static_cast<double>(store_hits_ + store_misses_))},
          {"writes", store_writes_},
          {"bytes_read", store_bytes_read_},
          {"bytes_written", store_bytes_written_},
          {"chunks_read", store_chunks_read_},
          {"chunks_local", store_chunks_local_},
          {"chunks_written", store_chunks_written_},
          {"chunks_skipped", store_chunks_skipped_},
          {"errors", store_errors_}}},
        {"tiers",
         {{"host", {{"bytes_read", tier_bytes_.count("host") ? tier_bytes_.at("host") : 0.0}}},
          {"remote", {{"bytes_read", tier_bytes_.count("remote") ? tier_bytes_.at("remote") : 0.0}}}}},
        {"replicas", reps}};
    json out = {{"serve", serve}};
    if (topo_.router) {
      out["router"] = {{"policy", router::policy_name(topo_.policy.policy)},
                       {"requests", static_cast<int64_t>(results_.size())},
                       {"retries", router_retries_},
                       {"unavailable", router_unavailable_},
                       {"connections_refused", router_refused_},
                       {"prefix_lookups", router_lookups_},
                       {"prefix_hits", router_hits_},
                       {"prefix_hit_rate", ratio(static_cast<double>(router_hits_), static_cast<double>(router_lookups_))},
                       {"prefix_matched_chunk_rate", ratio(static_cast<double>(router_matched_chunks_),
                                                           static_cast<double>(router_prompt_chunks_))}};
    }
    return out;
  }

  const lg::Trace& trace_;
  const Calibration& cal_;
  const Topology& topo_;
  double replica_cpus_ = 0;
  router::RoutingPolicy policy_;
  std::mt19937_64 rng_;
  double noise_ = 0;
  std::vector<Replica> replicas_;
  LruSet store_;
  size_t page_bytes_ = 1;
  std::vector<lg::RequestResult> results_;
  std::vector<Request> reqs_;
  std::map<std::string, Session> sessions_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  int64_t next_seq_ = 0;
  double now_ = 0, wall_ = 0;
  int64_t busy_replicas_ = 0;
  int64_t router_lookups_ = 0, router_hits_ = 0, router_prompt_chunks_ = 0, router_matched_chunks_ = 0;
  int64_t router_open_ = 0, router_refused_ = 0, router_retries_ = 0, router_unavailable_ = 0;
  size_t accepted_ = 0;  // requests a replica accepted a connection for
  int64_t store_hits_ = 0, store_misses_ = 0, store_writes_ = 0, store_errors_ = 0;
  // serve's prefix_shared_chunks_{read,local,written,skipped}
  int64_t store_chunks_read_ = 0, store_chunks_local_ = 0, store_chunks_written_ = 0, store_chunks_skipped_ = 0;
  double store_bytes_read_ = 0, store_bytes_written_ = 0;
  std::map<std::string, double> tier_bytes_;
};

// Least squares with non-negative coefficients by dropping negative ones and refitting. x: rows of
// regressors; returns one coefficient per column.
std::vector<double> nonneg_least_squares(const std::vector<std::vector<double>>& x, const std::vector<double>& y) {
  const size_t m = x.empty() ? 0 : x[0].size();
  std::vector<bool> active(m, true);
  std::vector<double> beta(m, 0);
  for (size_t round = 0; round <= m; ++round) {
    std::vector<size_t> cols;
    for (size_t k = 0; k < m; ++k) {
      if (active[k]) cols.push_back(k);
    }
    const size_t n = cols.size();
    if (n == 0) break;
    std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0));
    for (size_t r = 0; r < x.size(); ++r) {
      for (size_t i = 0; i < n; ++i) {
        for (size_t j = 0; j < n; ++j) a[i][j] += x[r][cols[i]] * x[r][cols[j]];
        a[i][n] += x[r][cols[i]] * y[r];
      }
    }
    for (size_t i = 0; i < n; ++i) a[i][i] += 1e-12 * (1 + a[i][i]);  // ridge against singular columns
    for (size_t i = 0; i < n; ++i) {  // Gauss-Jordan with partial pivoting
      size_t piv = i;
      for (size_t r = i + 1; r < n; ++r) {
        if (std::fabs(a[r][i]) > std::fabs(a[piv][i])) piv = r;
      }
      std::swap(a[i], a[piv]);
      if (std::fabs(a[i][i]) < 1e-300) continue;
      for (size_t r = 0; r < n; ++r) {
        if (r == i) continue;
        const double f = a[r][i] / a[i][i];
        for (size_t k = i; k <= n; ++k) a[r][k] -= f * a[i][k];
      }
    }
    std::fill(beta.begin(), beta.end(), 0);
    bool negative = false;
    size_t worst = 0;
    double worst_v = 0;
    for (size_t i = 0; i < n; ++i) {
      beta[cols[i]] = std::fabs(a[i][i]) < 1e-300 ? 0 : a[i][n] / a[i][i];
      if (beta[cols[i]] < worst_v) {
        worst_v = beta[cols[i]];
        worst = cols[i];
        negative = true;
      }
    }
    if (!negative) break;
    active[worst] = false;
  }
  for (double& b : beta) b = std::max(0.0, b);
  return beta;
}

const json* find_path(const json& j, std::initializer_list<const char*> path) {
  const json* p = &j;
  for (const char* k : path) {
    if (!p->is_object()) return nullptr;
    auto it = p->find(k);
    if (it == p->end()) return nullptr;
    p = &*it;
  }
  return p;
}

}  // namespace

// ---- calibration files ---------------------------------------------------------------------------

json calibration_to_json(const Calibration& c) {
  return {{"source", c.source},
          {"costs",
           {{"request_overhead_s", c.costs.request_overhead_s},
            {"router_overhead_s", c.costs.router_overhead_s},
            {"prefill_base_s", c.costs.prefill_base_s},
            {"prefill_per_token_s", c.costs.prefill_per_token_s},
            {"prefill_serial_fraction", c.costs.prefill_serial_fraction},
            {"decode_base_s", c.costs.decode_base_s},
            {"decode_per_seq_s", c.costs.decode_per_seq_s},
            {"decode_per_ctx_token_s", c.costs.decode_per_ctx_token_s}}},
          {"noise", c.noise},
          {"prompt_bytes_per_token", c.prompt_bytes_per_token},
          {"output_bytes_per_token", c.output_bytes_per_token},
          {"page_tokens", c.page_tokens},
          {"threads_per_replica", c.threads_per_replica},
          {"cpu_per_request",
           {{"router_s", c.cpu_per_request.router_s},
            {"loadgen_s", c.cpu_per_request.loadgen_s},
            {"store_s", c.cpu_per_request.store_s},
            {"replica_s", c.cpu_per_request.replica_s}}},
          {"model",
           {{"layers", c.model.layers},
            {"kv_heads", c.model.kv_heads},
            {"head_dim", c.model.head_dim},
            {"q_heads", c.model.q_heads}}},
          {"kv_elem_bytes", c.kv_elem_bytes},
          {"max_context", c.max_context}};
}

Result<Calibration> calibration_from_json(const json& j) {
  if (!j.is_object()) return invalid_argument("calibration: not a JSON object");
  Calibration c;
  if (j.contains("source") && j["source"].is_string()) c.source = j["source"].get<std::string>();
  const json costs = j.value("costs", json::object());
  if (!costs.is_object()) return invalid_argument("calibration: 'costs' must be an object");
  StepCosts& s = c.costs;
  struct Field {
    const char* name;
    double* v;
  };
  for (const Field& f : {Field{"request_overhead_s", &s.request_overhead_s}, Field{"router_overhead_s", &s.router_overhead_s},
                         Field{"prefill_base_s", &s.prefill_base_s}, Field{"prefill_per_token_s", &s.prefill_per_token_s},
                         Field{"decode_base_s", &s.decode_base_s}, Field{"decode_per_seq_s", &s.decode_per_seq_s},
                         Field{"decode_per_ctx_token_s", &s.decode_per_ctx_token_s}}) {
    *f.v = checked_num(costs, f.name, 0);
    if (!std::isfinite(*f.v) || *f.v < 0 || *f.v > 3600) {
      return invalid_argument(std::string("calibration: costs.") + f.name + " must be in [0, 3600] seconds");
    }
  }
  s.prefill_serial_fraction = checked_num(costs, "prefill_serial_fraction", 1);
  if (!(s.prefill_serial_fraction >= 0 && s.prefill_serial_fraction <= 1)) {
    return invalid_argument("calibration: costs.prefill_serial_fraction must be in [0, 1]");
  }
  c.noise = checked_num(j, "noise", 0);
  if (!(c.noise >= 0 && c.noise <= 2)) return invalid_argument("calibration: noise must be in [0, 2]");
  c.prompt_bytes_per_token = checked_num(j, "prompt_bytes_per_token", c.prompt_bytes_per_token);
  c.output_bytes_per_token = checked_num(j, "output_bytes_per_token", c.output_bytes_per_token);
  if (!(c.prompt_bytes_per_token > 0 && c.prompt_bytes_per_token < 1e6) ||
      !(c.output_bytes_per_token >= 0 && c.output_bytes_per_token < 1e6)) {
    return invalid_argument("calibration: prompt_bytes_per_token must be in (0, 1e6), output_bytes_per_token in [0, 1e6)");
  }
  c.page_tokens = checked_int(j, "page_tokens", c.page_tokens);
  c.threads_per_replica = checked_int(j, "threads_per_replica", c.threads_per_replica);
  c.kv_elem_bytes = checked_int(j, "kv_elem_bytes", c.kv_elem_bytes);
  c.max_context = checked_int(j, "max_context", c.max_context);
  if (c.page_tokens < 1 || c.page_tokens > 1 << 20 || c.threads_per_replica < 1 || c.threads_per_replica > 4096 ||
      c.kv_elem_bytes < 1 || c.kv_elem_bytes > 8 || c.max_context < 1) {
    return invalid_argument("calibration: page_tokens, threads_per_replica, kv_elem_bytes or max_context out of range");
  }
  if (j.contains("cpu_per_request")) {
    const json& p = j["cpu_per_request"];
    if (!p.is_object()) return invalid_argument("calibration: 'cpu_per_request' must be an object");
    using Share = std::pair<const char*, double*>;
    for (const Share& f : {Share{"router_s", &c.cpu_per_request.router_s}, Share{"loadgen_s", &c.cpu_per_request.loadgen_s},
                           Share{"store_s", &c.cpu_per_request.store_s}, Share{"replica_s", &c.cpu_per_request.replica_s}}) {
      *f.second = checked_num(p, f.first, 0);
      if (!std::isfinite(*f.second) || *f.second < 0 || *f.second > 3600) {
        return invalid_argument(std::string("calibration: cpu_per_request.") + f.first + " must be in [0, 3600] seconds");
      }
    }
  }
  if (j.contains("model")) {
    const json& m = j["model"];
    c.model.layers = checked_int(m, "layers", c.model.layers);
    c.model.kv_heads = checked_int(m, "kv_heads", c.model.kv_heads);
    c.model.head_dim = checked_int(m, "head_dim", c.model.head_dim);
    c.model.q_heads = checked_int(m, "q_heads", c.model.q_heads);
    if (c.model.layers < 1 || c.model.kv_heads < 1 || c.model.head_dim < 1 || c.model.q_heads < c.model.kv_heads ||
        c.model.layers > 100000 || c.model.kv_heads > 100000 || c.model.head_dim > 100000) {
      return invalid_argument("calibration: model shape out of range");
    }
  }
  return c;
}

Result<Calibration> load_calibration(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("calibration " + path + ": cannot be opened");
  const json j = json::parse(f, nullptr, false);
  if (j.is_discarded()) return invalid_argument("calibration " + path + ": not JSON");
  auto c = calibration_from_json(j);
  if (!c.is_ok()) return c.status().with_context(path);
  return c;
}

// ---- the simulation ------------------------------------------------------------------------------

Result<SimOutput> simulate(const lg::Trace& trace, const Calibration& cal, const Topology& topo) {
  if (topo.replicas < 1 || topo.replicas > 100000) return invalid_argument("replicas must be in [1, 100000]");
  if (topo.max_batch < 1) return invalid_argument("max batch must be at least 1");
  if (!(topo.time_scale > 0) || !std::isfinite(topo.time_scale)) return invalid_argument("time scale must be > 0");
  if (topo.cpus < 0 || topo.noise > 2) return invalid_argument("cpus must be ≥ 0, noise at most 2");
  if (topo.store.enabled && !(topo.store.bandwidth_bps > 0)) return invalid_argument("store bandwidth must be > 0");
  if (topo.policy.chunk_bytes < 1) return invalid_argument("router chunk bytes must be ≥ 1");
  const double per_request = overhead_cpu_per_request(cal, topo);
  if (per_request <= 0 || trace.requests.empty()) return Simulator(trace, cal, topo, topo.cpus).run();
  // The router, load generator, store and the replicas' work beyond their engines' steps take o
  // cores for the whole run: o = per_request × the
  // requests ÷ the wall time of the run the replicas make on cpus − o. That wall time grows with o,
  // so o − per_request · n / wall(o) rises with o: bisection finds where it crosses 0.
  const double n = static_cast<double>(trace.requests.size());
  const double max_o = 0.99 * topo.cpus;  // the replicas keep 1% of the cores at least
  auto run_with = [&](double o) -> Result<SimOutput> {
    auto out = Simulator(trace, cal, topo, topo.cpus - o).run();
    if (out.is_ok()) out->overhead_cores = o;
    return out;
  };
  // A request refused at its connection (429, or 503 at every replica tried) costs the replicas and
  // the store nothing: their shares count the requests a replica accepted.
  const double served_only = cal.cpu_per_request.replica_s +
                             (topo.store.enabled && topo.store.alive ? cal.cpu_per_request.store_s : 0.0);
  auto demand = [&](const SimOutput& out) {
    const double cpu_s = per_request * n - served_only * static_cast<double>(trace.requests.size() - out.accepted);
    return out.wall_s > 0 ? cpu_s / out.wall_s : max_o;
  };
  double lo = 0, hi = max_o;
  for (int k = 0; k < 40 && hi - lo > 1e-6 * topo.cpus; ++k) {
    const double mid = 0.5 * (lo + hi);
    auto out = run_with(mid);
    if (!out.is_ok()) return out.status();
    (mid < demand(*out) ? lo : hi) = mid;
  }
  return run_with(hi);
}

double overhead_cpu_per_request(const Calibration& cal, const Topology& topo) {
  if (!(topo.cpus > 0)) return 0;
  const ProcessCpu& p = cal.cpu_per_request;
  return (topo.router ? p.router_s : 0.0) + p.loadgen_s + (topo.store.enabled && topo.store.alive ? p.store_s : 0.0) +
         p.replica_s;
}

double engine_busy_s(const SimOutput& out) {
  double busy = 0;
  if (const json* reps = find_path(out.metrics, {"serve", "replicas"}); reps != nullptr && reps->is_array()) {
    for (const json& r : *reps) busy += r.value("busy_s", 0.0);
  }
  return busy;
}

Result<ProcessCpu> process_cpu_from_runs(const std::vector<CpuRun>& runs) {
  double requests = 0, store_requests = 0, replica_requests = 0, router = 0, loadgen = 0, store = 0, replica = 0;
  for (size_t k = 0; k < runs.size(); ++k) {
    const json* n = find_path(runs[k].report, {"summary", "requests"});
    const json* procs = find_path(runs[k].cpu, {"procs"});
    if (n == nullptr || !n->is_number() || n->get<double>() <= 0 || procs == nullptr || !procs->is_object()) {
      return invalid_argument("CPU run " + std::to_string(k + 1) + ": no summary.requests or no procs");
    }
    auto cpu_of = [&](const char* role, double& sum) -> Status {
      const json* v = find_path(*procs, {role, "cpu_s_run"});
      if (v == nullptr || !v->is_number() || !(v->get<double>() >= 0)) {
        return invalid_argument("CPU run " + std::to_string(k + 1) + ": no " + role + ".cpu_s_run");
      }
      sum += v->get<double>();
      return Status::ok();
    };
    if (auto st = cpu_of("router", router); !st.is_ok()) return st;
    if (auto st = cpu_of("loadgen", loadgen); !st.is_ok()) return st;
    requests += n->get<double>();
    if (procs->contains("redis")) {
      if (auto st = cpu_of("redis", store); !st.is_ok()) return st;
      store_requests += n->get<double>();
    } else if (runs[k].engine_busy_s >= 0) {
      double serve = 0;
      int64_t replicas = 0;
      for (const auto& [role, v] : procs->items()) {
        if (role.rfind("serve", 0) != 0) continue;
        if (auto st = cpu_of(role.c_str(), serve); !st.is_ok()) return st;
        ++replicas;
      }
      if (replicas > 0) {
        replica += serve - runs[k].engine_busy_s;
        replica_requests += n->get<double>();
      }
    }
  }
  if (!(requests > 0)) return invalid_argument("CPU runs: none given");
  ProcessCpu p;
  p.router_s = router / requests;
  p.loadgen_s = loadgen / requests;
  p.store_s = store_requests > 0 ? store / store_requests : 0;
  p.replica_s = replica_requests > 0 ? std::max(0.0, replica / replica_requests) : 0;
  return p;
}

json report(const SimOutput& out, const Topology& topo, const lg::Slo& slo) {
  json t = {{"replicas", topo.replicas},
            {"policy", router::policy_name(topo.policy.policy)},
            {"router", topo.router},
            {"max_batch", topo.max_batch},
            {"prefix_caching", topo.prefix_caching},
            {"prefix_cache_slots", topo.prefix_cache_slots},
            {"max_connections", topo.max_connections},
            {"max_connections_per_ip", topo.max_connections_per_ip},
            {"max_waiting", topo.max_waiting},
            {"router_max_connections", topo.router_max_connections},
            {"cpus", topo.cpus},
            {"store", {{"enabled", topo.store.enabled}, {"alive", topo.store.alive},
                       {"bandwidth_bps", topo.store.bandwidth_bps}, {"latency_s", topo.store.latency_s},
                       {"chunk_tokens", topo.store.chunk_tokens}}},
            {"tiers", {{"device_kv_bytes", topo.tiers.device_kv_bytes}, {"host_kv_bytes", topo.tiers.host_kv_bytes},
                       {"host_bandwidth_bps", topo.tiers.host_bandwidth_bps},
                       {"remote_kv_bytes", topo.tiers.remote_kv_bytes},
                       {"remote_bandwidth_bps", topo.tiers.remote_bandwidth_bps}}},
            {"time_scale", topo.time_scale},
            {"noise", topo.noise},
            {"seed", topo.seed}};
  json metrics = out.metrics;
  if (out.overhead_cores > 0) {  // the cores the router, load generator, store and replicas' own work took
    metrics["cpu"] = {{"overhead_cores", out.overhead_cores}, {"replica_cores", topo.cpus - out.overhead_cores}};
  }
  return {{"topology", t}, {"summary", lg::summarize(out.results, out.wall_s, slo)}, {"metrics", metrics}};
}

// ---- calibration from a measured run ---------------------------------------------------------------

Result<Calibration> calibrate_from_loadgen(const json& rep, const lg::Trace& trace, Calibration base) {
  return calibrate_from_loadgen(std::vector<MeasuredRun>{{rep, trace}}, std::move(base));
}

Result<Calibration> calibrate_from_loadgen(const std::vector<MeasuredRun>& runs, Calibration base, int64_t max_batch) {
  struct Rec {
    double sent, ttft, latency, prompt_tokens, cached, completion, bytes;
    int64_t index;
    size_t run;
  };
  std::vector<Rec> recs;
  double answer_bytes = 0, answer_tokens = 0;
  for (size_t k = 0; k < runs.size(); ++k) {
    const json* reqs = find_path(runs[k].report, {"requests"});
    if (reqs == nullptr || !reqs->is_array() || reqs->empty()) {
      return invalid_argument("calibration: loadgen report " + std::to_string(k + 1) + " has no 'requests' records");
    }
    const size_t first = recs.size();
    for (const json& r : *reqs) {
      if (!r.value("ok", false)) continue;
      recs.push_back({r.value("sent_at_s", 0.0), r.value("ttft_ms", 0.0) / 1e3, r.value("latency_s", 0.0),
                      r.value("prompt_tokens", 0.0), r.value("cached_tokens", 0.0), r.value("completion_tokens", 0.0),
                      r.value("prompt_bytes", 0.0), r.value("index", int64_t{-1}), k});
    }
    // Answer bytes: a session's next prompt less its previous prompt and its own text.
    std::map<int64_t, size_t> by_index;
    for (size_t i = first; i < recs.size(); ++i) by_index[recs[i].index] = i;
    std::map<std::string, int64_t> last_of_session;
    const lg::Trace& trace = runs[k].trace;
    for (size_t i = 0; i < trace.requests.size(); ++i) {
      const lg::TraceRequest& t = trace.requests[i];
      if (t.session.empty()) continue;
      auto prev = last_of_session.find(t.session);
      if (prev != last_of_session.end() && by_index.count(prev->second) && by_index.count(static_cast<int64_t>(i))) {
        const Rec& a = recs[by_index[prev->second]];
        const Rec& b = recs[by_index[static_cast<int64_t>(i)]];
        const double ans = b.bytes - a.bytes - static_cast<double>(t.prompt.size());
        if (ans >= 0 && a.completion > 0) {
          answer_bytes += ans;
          answer_tokens += a.completion;
        }
      }
      last_of_session[t.session] = static_cast<int64_t>(i);
    }
  }
  if (recs.size() < 3) return invalid_argument("calibration: fewer than 3 finished requests in the reports");
  // Bytes per prompt token.
  double bytes = 0, tokens = 0;
  for (const Rec& r : recs) {
    bytes += r.bytes;
    tokens += r.prompt_tokens;
  }
  if (tokens > 0) base.prompt_bytes_per_token = bytes / tokens;
  if (answer_tokens > 0) base.output_bytes_per_token = answer_bytes / answer_tokens;
  // In flight at time t (for the decode fit): requests between their send and their end.
  auto concurrency = [&](const Rec& self, double from, double to) {
    if (!(to > from)) return 0.0;
    double overlap = 0;
    for (const Rec& o : recs) {
      if (&o == &self || o.run != self.run) continue;
      const double lo = std::max(from, o.sent), hi = std::min(to, o.sent + o.latency);
      if (hi > lo) overlap += hi - lo;
    }
    return overlap / (to - from);
  };
  // TTFT = a + b · computed tokens, from requests that found the replica idle (else all).
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (int pass = 0; pass < 2 && x.size() < 3; ++pass) {
    x.clear();
    y.clear();
    for (const Rec& r : recs) {
      if (pass == 0 && concurrency(r, r.sent, r.sent + r.ttft) > 0.05) continue;
      x.push_back({1.0, r.prompt_tokens - r.cached});
      y.push_back(r.ttft);
    }
  }
  const auto ttft = nonneg_least_squares(x, y);
  const size_t ttft_records = y.size();
  // Time per output token after the first = decode base + per seq · batch + per ctx · Σ context.
  x.clear();
  y.clear();
  for (const Rec& r : recs) {
    if (r.completion < 2) continue;
    const double tpot = (r.latency - r.ttft) / (r.completion - 1);
    // Requests in flight past the replica's slots wait in its queue, not in the step.
    const double batch = std::min(static_cast<double>(max_batch), 1 + concurrency(r, r.sent + r.ttft, r.sent + r.latency));
    const double ctx = r.prompt_tokens + r.completion / 2;
    x.push_back({1.0, batch, batch * ctx});
    y.push_back(tpot);
  }
  const auto tpot = x.size() >= 3 ? nonneg_least_squares(x, y) : std::vector<double>{0, 0, 0};
  base.costs.request_overhead_s = ttft[0] - base.costs.router_overhead_s > 0 ? ttft[0] - base.costs.router_overhead_s : 0;
  base.costs.prefill_base_s = 0;
  base.costs.prefill_per_token_s = ttft[1];
  base.costs.decode_base_s = tpot[0];
  base.costs.decode_per_seq_s = tpot[1];
  base.costs.decode_per_ctx_token_s = tpot[2];
  // Noise: the spread of the lone requests' TTFT around the fit (log-normal sigma).
  {
    double sum = 0, sum2 = 0;
    int64_t n = 0;
    for (const Rec& r : recs) {
      const double fit = ttft[0] + ttft[1] * (r.prompt_tokens - r.cached);
      if (concurrency(r, r.sent, r.sent + r.ttft) > 0.05 || !(fit > 0) || !(r.ttft > 0)) continue;
      const double e = std::log(r.ttft / fit);
      sum += e;
      sum2 += e * e;
      ++n;
    }
    base.noise = n > 2 ? std::min(2.0, std::sqrt(std::max(0.0, sum2 / static_cast<double>(n) - (sum / n) * (sum / n)))) : 0;
  }
  // The engine's share of the prefill cost: the one whose simulation of these runs (one replica
  // behind the router, no noise) comes closest to their TTFT and latency medians.
  {
    double best = std::numeric_limits<double>::infinity();
    double best_f = 1;
    for (int step = 20; step >= 1; --step) {  // ties keep the larger share
      Calibration c = base;
      c.costs.prefill_serial_fraction = step / 20.0;
      double err = 0;
      for (const MeasuredRun& run : runs) {
        Topology topo;
        topo.noise = 0;
        topo.max_batch = max_batch;
        auto out = simulate(run.trace, c, topo);
        if (!out.is_ok()) return out.status();
        const json ps = lg::summarize(out->results, out->wall_s, lg::Slo{});
        const json& ms = run.report.contains("summary") ? run.report["summary"] : json::object();
        for (const char* k : {"ttft_ms", "latency_s"}) {
          const json* m = find_path(ms, {k, "p50"});
          const double pv = ps[k]["p50"].get<double>();
          if (m != nullptr && m->is_number() && m->get<double>() > 0 && pv > 0) err += std::fabs(std::log(pv / m->get<double>()));
        }
      }
      if (err < best) {
        best = err;
        best_f = c.costs.prefill_serial_fraction;
      }
    }
    base.costs.prefill_serial_fraction = best_f;
  }
  base.source = "calibrate_from_loadgen: " + std::to_string(recs.size()) + " requests in " +
                std::to_string(runs.size()) + " run(s); TTFT fit on " + std::to_string(ttft_records) +
                " (those alone in the server), decode on " + std::to_string(y.size());
  return base;
}

// ---- measured beside predicted ---------------------------------------------------------------------

json compare(const json& measured, const json& predicted) {
  json rows = json::array();
  auto add = [&](const std::string& name, const json* m, const json* p) {
    if (m == nullptr || p == nullptr || !m->is_number() || !p->is_number()) return;
    const double mv = m->get<double>(), pv = p->get<double>();
    json row = {{"metric", name}, {"measured", mv}, {"predicted", pv}};
    row["error"] = mv != 0 ? json((pv - mv) / std::fabs(mv)) : json(nullptr);
    rows.push_back(row);
  };
  const json& ms = measured.contains("summary") ? measured["summary"] : measured;
  const json& ps = predicted.contains("summary") ? predicted["summary"] : predicted;
  for (const char* k : {"requests_per_s", "output_tokens_per_s", "goodput_requests_per_s", "goodput_fraction",
                        "wall_s", "cached_fraction"}) {
    add(k, find_path(ms, {k}), find_path(ps, {k}));
  }
  for (const char* k : {"ttft_ms", "itl_ms", "tpot_ms", "latency_s"}) {
    for (const char* q : {"p50", "p99"}) add(std::string(k) + "." + q, find_path(ms, {k, q}), find_path(ps, {k, q}));
  }
  // The router's prefix hit rate: the first scraped endpoint with router rows.
  const json* pm = find_path(predicted, {"metrics", "router", "prefix_hit_rate"});
  if (const json* metrics = find_path(measured, {"metrics"}); metrics != nullptr && metrics->is_object()) {
    for (const auto& [target, m] : metrics->items()) {
      if (const json* hr = find_path(m, {"router", "prefix_hit_rate"}); hr != nullptr) {
        add("router.prefix_hit_rate", hr, pm);
        break;
      }
    }
  }
  return rows;
}

}  // namespace specontext::bench::sim
