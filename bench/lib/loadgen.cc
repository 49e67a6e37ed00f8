#include "bench/lib/loadgen.h"

#include <CLI/CLI.hpp>

#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <boost/beast.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "bench/lib/sse_client.h"
#include "core/base/json_depth.h"

namespace specontext::bench::loadgen {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// ---- the trace ---------------------------------------------------------------------------------

std::string shown(const json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 40) + "..." : s;
}

Status line_error(int64_t line, const std::string& field, const std::string& what) {
  return invalid_argument("trace line " + std::to_string(line) +
                          (field.empty() ? std::string(": ") : ": field '" + field + "': ") + what);
}

bool is_id(const std::string& s, size_t max_bytes) {
  if (s.empty() || s.size() > max_bytes) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' || c == '-';
  });
}

// The optional id field `key` of `j` into `out`.
Status read_id(const json& j, const char* key, int64_t line, size_t max_bytes, std::string& out) {
  const auto it = j.find(key);
  if (it == j.end()) return Status::ok();
  if (!it->is_string() || !is_id(it->get<std::string>(), max_bytes)) {
    return line_error(line, key,
                      "must be a string of 1 to " + std::to_string(max_bytes) +
                          " characters from [A-Za-z0-9_.:-], got " + shown(*it));
  }
  out = it->get<std::string>();
  return Status::ok();
}

// One line of `in` into `line`, at most max_bytes (longer: too_long, the rest unread). False at
// the end of the input.
bool read_bounded_line(std::istream& in, size_t max_bytes, std::string& line, bool& too_long) {
  line.clear();
  too_long = false;
  std::streambuf* sb = in.rdbuf();
  bool any = false;
  for (;;) {
    const int c = sb->sbumpc();
    if (c == std::char_traits<char>::eof()) break;
    any = true;
    if (c == '\n') break;
    if (line.size() >= max_bytes) {
      too_long = true;
      break;
    }
    line.push_back(static_cast<char>(c));
  }
  return any;
}

// ---- randomness --------------------------------------------------------------------------------

double uniform01(std::mt19937_64& g) { return static_cast<double>(g() >> 11) * 0x1.0p-53; }
double exponential(std::mt19937_64& g, double rate) { return -std::log1p(-uniform01(g)) / rate; }

constexpr const char* kWords[] = {
    "the",  "a",     "little", "girl",  "boy",   "cat",   "dog",  "sun",   "tree",  "ball", "park",
    "happy", "big",  "red",    "blue",  "played", "saw",  "ran",  "went",  "found", "said", "friend",
    "mom",  "day",   "home",   "box",   "bird",  "fish",  "car",  "toy",   "sky",   "water", "garden",
    "small", "funny", "kind",  "jumped", "looked", "wanted", "liked", "and",  "with",  "to",  "in"};

std::string words(std::mt19937_64& g, int64_t n) {
  std::string s;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) s += (i % 8 == 0) ? ". " : " ";
    s += kWords[g() % std::size(kWords)];
  }
  if (n > 0) s += ".";
  return s;
}

// ---- the run -----------------------------------------------------------------------------------

// Shuts down (both ways) the sockets of requests past their deadline, which wakes their blocking
// reads; a socket leaves before it is closed, so a shut-down descriptor is never someone else's.
class Watchdog {
 public:
  Watchdog() : thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void add(int64_t id, int fd, Clock::time_point deadline) {
    std::lock_guard<std::mutex> l(mu_);
    live_[id] = {fd, deadline};
  }
  // Whether it fired.
  bool remove(int64_t id) {
    std::lock_guard<std::mutex> l(mu_);
    live_.erase(id);
    return fired_.erase(id) > 0;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    while (!stop_) {
      cv_.wait_for(l, std::chrono::milliseconds(50));
      const auto now = Clock::now();
      for (auto it = live_.begin(); it != live_.end();) {
        if (it->second.second <= now) {
          ::shutdown(it->second.first, SHUT_RDWR);
          fired_.insert(it->first);
          it = live_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<int64_t, std::pair<int, Clock::time_point>> live_;
  std::set<int64_t> fired_;
  std::thread thread_;
};

double delta(const std::map<std::string, double>& before, const std::map<std::string, double>& after,
             const std::string& key) {
  const auto a = after.find(key);
  const auto b = before.find(key);
  return (a != after.end() ? a->second : 0.0) - (b != before.end() ? b->second : 0.0);
}
double value_of(const std::map<std::string, double>& m, const std::string& key) {
  const auto it = m.find(key);
  return it != m.end() ? it->second : 0.0;
}
double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

}  // namespace

// ---- trace parsing -----------------------------------------------------------------------------

Result<Trace> parse_trace(std::istream& in, const TraceLimits& L) {
  Trace t;
  std::string line;
  bool too_long = false;
  int64_t n = 0;
  double last_arrival = 0;
  while (read_bounded_line(in, L.max_line_bytes, line, too_long)) {
    ++n;
    if (too_long) return line_error(n, "", "longer than " + std::to_string(L.max_line_bytes) + " bytes");
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    // Trace lines are flat: an object of strings and numbers.
    const json j = parse_json_bounded(line, 2);
    if (j.is_discarded() || !j.is_object()) {
      return line_error(n, "", "not a JSON object of strings and numbers (one object a line)");
    }
    if (j.contains("define_prefix")) {
      for (const auto& [k, v] : j.items()) {
        if (k != "define_prefix" && k != "text") {
          return line_error(n, k, "unknown in a prefix definition (define_prefix, text)");
        }
      }
      std::string id;
      SPX_RETURN_IF_ERROR(read_id(j, "define_prefix", n, L.max_id_bytes, id));
      const auto text = j.find("text");
      if (text == j.end() || !text->is_string() || text->get<std::string>().empty()) {
        return line_error(n, "text", "must be a non-empty string");
      }
      if (t.prefixes.count(id) != 0) return line_error(n, "define_prefix", "'" + id + "' is defined twice");
      if (static_cast<int64_t>(t.prefixes.size()) >= L.max_prefixes) {
        return line_error(n, "define_prefix", "more than " + std::to_string(L.max_prefixes) + " prefixes");
      }
      t.prefixes[id] = text->get<std::string>();
      continue;
    }
    TraceRequest r;
    r.line = n;
    for (const auto& [k, v] : j.items()) {
      if (k != "arrival_s" && k != "prompt" && k != "max_tokens" && k != "session" && k != "prefix" && k != "kind") {
        return line_error(n, k, "unknown (arrival_s, prompt, max_tokens, session, prefix, kind; or define_prefix, text)");
      }
    }
    const auto arrival = j.find("arrival_s");
    if (arrival == j.end() || !arrival->is_number() || !std::isfinite(arrival->get<double>()) ||
        arrival->get<double>() < 0 || arrival->get<double>() > L.max_arrival_s) {
      return line_error(n, "arrival_s",
                        "must be a number of seconds in [0, " + shown(json(L.max_arrival_s)) + "], got " +
                            (arrival == j.end() ? std::string("nothing") : shown(*arrival)));
    }
    r.arrival_s = arrival->get<double>();
    if (r.arrival_s < last_arrival) {
      return line_error(n, "arrival_s",
                        shown(*arrival) + " is before the previous request's " + shown(json(last_arrival)) +
                            " (arrivals must not decrease)");
    }
    last_arrival = r.arrival_s;
    const auto max_tokens = j.find("max_tokens");
    if (max_tokens == j.end() || !max_tokens->is_number_integer() || max_tokens->get<int64_t>() < 1 ||
        max_tokens->get<int64_t>() > L.max_tokens) {
      return line_error(n, "max_tokens",
                        "must be an integer in [1, " + std::to_string(L.max_tokens) + "], got " +
                            (max_tokens == j.end() ? std::string("nothing") : shown(*max_tokens)));
    }
    r.max_tokens = max_tokens->get<int64_t>();
    SPX_RETURN_IF_ERROR(read_id(j, "session", n, L.max_id_bytes, r.session));
    SPX_RETURN_IF_ERROR(read_id(j, "prefix", n, L.max_id_bytes, r.prefix));
    SPX_RETURN_IF_ERROR(read_id(j, "kind", n, L.max_id_bytes, r.kind));
    if (!r.prefix.empty() && t.prefixes.count(r.prefix) == 0) {
      return line_error(n, "prefix", "'" + r.prefix + "' is not defined by an earlier define_prefix line");
    }
    const auto prompt = j.find("prompt");
    if (prompt == j.end() || !prompt->is_string()) {
      return line_error(n, "prompt", "must be a string, got " + (prompt == j.end() ? std::string("nothing") : shown(*prompt)));
    }
    r.prompt = prompt->get<std::string>();
    if (r.prompt.empty() && r.prefix.empty() && r.session.empty()) {
      return line_error(n, "prompt", "must not be empty without a prefix or a session");
    }
    if (static_cast<int64_t>(t.requests.size()) >= L.max_requests) {
      return line_error(n, "", "more than " + std::to_string(L.max_requests) + " requests");
    }
    t.requests.push_back(std::move(r));
  }
  if (t.requests.empty()) return invalid_argument("trace: no requests (" + std::to_string(n) + " lines)");
  return t;
}

Result<Trace> load_trace(const std::string& path, const TraceLimits& limits) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return not_found("trace " + path + ": cannot be opened");
  auto t = parse_trace(f, limits);
  if (!t.is_ok()) return t.status().with_context(path);
  return t;
}

// ---- arrivals and synthetic traces -------------------------------------------------------------

Result<std::vector<double>> arrival_times(const ArrivalOptions& a, int64_t n) {
  if (!(a.rate > 0) || !std::isfinite(a.rate) || a.rate > 1e6) {
    return invalid_argument("arrival rate must be in (0, 1e6] requests/s");
  }
  if (n < 0 || n > 10'000'000) return invalid_argument("requests must be in [0, 1e7]");
  if (a.burst_size < 1 || a.burst_size > 1'000'000) return invalid_argument("burst size must be in [1, 1e6]");
  std::mt19937_64 g(a.seed);
  std::vector<double> t;
  t.reserve(static_cast<size_t>(n));
  double now = 0;
  if (a.process == "poisson") {
    for (int64_t i = 0; i < n; ++i) t.push_back(now += exponential(g, a.rate));
  } else if (a.process == "uniform") {
    for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<double>(i + 1) / a.rate);
  } else if (a.process == "burst") {
    const double burst_rate = a.rate / static_cast<double>(a.burst_size);
    while (static_cast<int64_t>(t.size()) < n) {
      now += exponential(g, burst_rate);
      for (int64_t k = 0; k < a.burst_size && static_cast<int64_t>(t.size()) < n; ++k) t.push_back(now);
    }
  } else {
    return invalid_argument("arrival process '" + a.process + "': poisson, burst or uniform");
  }
  return t;
}

Result<std::string> synth_trace(const SynthOptions& o) {
  auto in = [](int64_t v, int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  if (!in(o.sessions, 1, 1'000'000) || !in(o.turns, 1, 1'000'000) || !in(o.prefixes, 0, 65'536) ||
      !in(o.prefix_words, 0, 1'000'000) || !in(o.turn_words, 1, 1'000'000) || !in(o.tool_words, 1, 1'000'000) ||
      !in(o.max_tokens, 1, 1'000'000) || !(o.agent_fraction >= 0 && o.agent_fraction <= 1)) {
    return invalid_argument(
        "synthetic trace: sessions, turns, turn/tool words and max tokens must be in [1, 1e6], prefixes in "
        "[0, 65536], prefix words in [0, 1e6], agent fraction in [0, 1]");
  }
  SPX_ASSIGN_OR_RETURN(const std::vector<double> arrivals, arrival_times(o.arrivals, o.requests));
  std::mt19937_64 g(o.arrivals.seed ^ 0x9e3779b97f4a7c15ULL);
  std::string out;
  const int64_t prefixes = o.prefix_words > 0 ? o.prefixes : 0;
  for (int64_t p = 0; p < prefixes; ++p) {
    out += json{{"define_prefix", "sys" + std::to_string(p)}, {"text", "System: " + words(g, o.prefix_words)}}.dump() +
           "\n";
  }
  struct Slot {
    std::string id;
    int64_t turns = 0;
    bool agent = false;
    int64_t prefix = -1;
  };
  std::vector<Slot> slots(static_cast<size_t>(o.sessions));
  int64_t next_session = 0;
  for (size_t i = 0; i < arrivals.size(); ++i) {
    Slot& s = slots[i % slots.size()];
    if (s.id.empty() || s.turns == o.turns) {
      s.id = "s" + std::to_string(next_session);
      s.turns = 0;
      s.agent = uniform01(g) < o.agent_fraction;
      s.prefix = prefixes > 0 ? next_session % prefixes : -1;
      ++next_session;
    }
    std::string prompt, kind;
    if (!s.agent) {
      kind = "chat";
      prompt = "\nUser: " + words(g, o.turn_words) + "\nAssistant:";
    } else if (s.turns == 0) {
      kind = "task";
      prompt = "\nTask: " + words(g, o.turn_words) + "\nAssistant:";
    } else {
      kind = "tool";
      prompt = "\nTool output: " + words(g, o.tool_words) + "\nAssistant:";
    }
    json r = {{"arrival_s", std::round(arrivals[i] * 1e6) / 1e6},
              {"session", s.id},
              {"kind", kind},
              {"prompt", prompt},
              {"max_tokens", o.max_tokens}};
    if (s.prefix >= 0) r["prefix"] = "sys" + std::to_string(s.prefix);
    out += r.dump() + "\n";
    ++s.turns;
  }
  return out;
}

// ---- accounting --------------------------------------------------------------------------------

bool meets_slo(const RequestResult& r, const Slo& slo) {
  if (!r.ok || r.ttft_s > slo.ttft_s) return false;
  if (r.completion_tokens > 1 &&
      (r.latency_s - r.ttft_s) / static_cast<double>(r.completion_tokens - 1) > slo.tpot_s) {
    return false;
  }
  return slo.latency_s <= 0 || r.latency_s <= slo.latency_s;
}

json summarize(const std::vector<RequestResult>& results, double wall_s, const Slo& slo) {
  std::vector<double> ttft, itl, tpot, latency, lag;
  int64_t ok = 0, good = 0, tokens = 0, good_tokens = 0, prompt_tokens = 0, cached = 0, longest = 0, short_answers = 0;
  std::map<std::string, int64_t> errors;
  for (const RequestResult& r : results) {
    lag.push_back(r.sent_at_s - r.scheduled_at_s);
    if (!r.ok) {
      ++errors[r.error.empty() ? std::string("no answer") : r.error.substr(0, 200)];
      continue;
    }
    ++ok;
    ttft.push_back(r.ttft_s);
    latency.push_back(r.latency_s);
    itl.insert(itl.end(), r.gaps_s.begin(), r.gaps_s.end());
    if (r.completion_tokens > 1) {
      tpot.push_back((r.latency_s - r.ttft_s) / static_cast<double>(r.completion_tokens - 1));
    }
    tokens += r.completion_tokens;
    prompt_tokens += r.prompt_tokens;
    cached += r.cached_tokens;
    longest = std::max(longest, r.prompt_tokens);
    if (r.completion_tokens != r.max_tokens) ++short_answers;
    if (meets_slo(r, slo)) {
      ++good;
      good_tokens += r.completion_tokens;
    }
  }
  auto pcts = [](const std::vector<double>& v, double scale) {
    return json{{"p50", scale * percentile(v, 0.5)}, {"p90", scale * percentile(v, 0.9)},
                {"p99", scale * percentile(v, 0.99)}, {"max", v.empty() ? 0.0 : scale * *std::max_element(v.begin(), v.end())}};
  };
  json error_list = json::array();
  for (const auto& [msg, count] : errors) {
    if (error_list.size() < 8) error_list.push_back({{"count", count}, {"message", msg}});
  }
  const auto n = static_cast<int64_t>(results.size());
  return {{"requests", n},
          {"ok", ok},
          {"errors", n - ok},
          {"error_messages", error_list},
          {"wall_s", wall_s},
          {"slo", {{"ttft_ms", 1e3 * slo.ttft_s}, {"tpot_ms", 1e3 * slo.tpot_s}, {"latency_s", slo.latency_s}}},
          {"goodput_requests", good},
          {"goodput_fraction", ratio(static_cast<double>(good), static_cast<double>(n))},
          {"goodput_requests_per_s", ratio(static_cast<double>(good), wall_s)},
          {"goodput_tokens_per_s", ratio(static_cast<double>(good_tokens), wall_s)},
          {"requests_per_s", ratio(static_cast<double>(ok), wall_s)},
          {"output_tokens", tokens},
          {"output_tokens_per_s", ratio(static_cast<double>(tokens), wall_s)},
          {"answers_shorter_than_max_tokens", short_answers},
          {"prompt_tokens", prompt_tokens},
          {"cached_prompt_tokens", cached},
          {"cached_fraction", ratio(static_cast<double>(cached), static_cast<double>(prompt_tokens))},
          {"longest_prompt_tokens", longest},
          {"ttft_ms", pcts(ttft, 1e3)},
          {"itl_ms", pcts(itl, 1e3)},
          {"tpot_ms", pcts(tpot, 1e3)},
          {"latency_s", pcts(latency, 1)},
          {"send_lag_s", pcts(lag, 1)}};
}

// ---- /metrics ----------------------------------------------------------------------------------

std::map<std::string, double> parse_prometheus(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    size_t name_end = line.find('}');
    name_end = name_end != std::string::npos ? name_end + 1 : line.find(' ');
    if (name_end == std::string::npos || name_end >= line.size()) continue;
    const char* v = line.c_str() + name_end;
    char* end = nullptr;
    const double value = std::strtod(v, &end);
    if (end == v) continue;
    out[line.substr(0, name_end)] = value;
  }
  return out;
}

json metrics_delta(const std::map<std::string, double>& before, const std::map<std::string, double>& after) {
  json counters = json::object(), gauges = json::object();
  std::set<std::string> keys;
  for (const auto& [k, v] : before) keys.insert(k);
  for (const auto& [k, v] : after) keys.insert(k);
  for (const std::string& k : keys) {
    const std::string base = k.substr(0, k.find('{'));
    if (base.size() > 6 && base.compare(base.size() - 6, 6, "_total") == 0) {
      counters[k] = delta(before, after, k);
    } else {
      gauges[k] = {{"before", value_of(before, k)}, {"after", value_of(after, k)}};
    }
  }
  if (keys.empty()) return json::object();
  json out = {{"counters", counters}, {"gauges", gauges}};
  auto d = [&](const std::string& name) { return delta(before, after, name); };
  auto g = [&](const std::string& name) {
    return json{{"before", value_of(before, name)}, {"after", value_of(after, name)}};
  };
  if (after.count("specontext_prompt_tokens_total") != 0) {
    const std::string p = "specontext_";
    const double computed = d(p + "prompt_tokens_total"), cached = d(p + "prefix_cache_hit_tokens_total");
    const double hits = d(p + "prefix_store_hits_total"), misses = d(p + "prefix_store_misses_total");
    out["serve"] = {
        {"completed", d(p + "requests_completed_total")},
        {"rejected", d(p + "requests_rejected_total")},
        {"failed", d(p + "requests_failed_total")},
        {"generated_tokens", d(p + "generation_tokens_total")},
        {"prompt_tokens_computed", computed},
        {"prompt_tokens_cached", cached},
        {"prefix_cache_hit_rate", ratio(cached, cached + computed)},
        {"preemptions", d(p + "preemptions_total")},
        {"kv_bytes_in_use", g(p + "kv_bytes_in_use")},
        {"host_tier",
         {{"offloads", d(p + "prefix_offloads_total")},
          {"restores", d(p + "prefix_restores_total")},
          {"bytes", g(p + "prefix_offload_bytes")}}},
        {"disk_tier",
         {{"writes", d(p + "prefix_disk_writes_total")},
          {"restores", d(p + "prefix_disk_restores_total")},
          {"errors", d(p + "prefix_disk_errors_total")},
          {"bytes", g(p + "prefix_disk_bytes")}}},
        {"shared_store",
         {{"hits", hits},
          {"misses", misses},
          {"hit_rate", ratio(hits, hits + misses)},
          {"writes", d(p + "prefix_store_writes_total")},
          {"bytes_read", d(p + "prefix_store_read_bytes_total")},
          {"bytes_written", d(p + "prefix_store_written_bytes_total")},
          {"chunks_written", d(p + "prefix_store_chunks_written_total")},
          {"chunks_skipped", d(p + "prefix_store_chunks_skipped_total")},
          {"chunks_read", d(p + "prefix_store_chunks_read_total")},
          {"chunks_local", d(p + "prefix_store_chunks_local_total")},
          {"errors", d(p + "prefix_store_errors_total")}}}};
  }
  if (after.count("specontext_router_requests_total") != 0) {
    const std::string p = "specontext_router_";
    const double lookups = d(p + "prefix_lookups_total"), hits = d(p + "prefix_hits_total");
    json replicas = json::object();
    const std::string chosen = p + "replica_chosen_total{replica=\"";
    for (const std::string& k : keys) {
      if (k.rfind(chosen, 0) != 0) continue;
      const std::string label = k.substr(chosen.size(), k.size() - chosen.size() - 2);
      const std::string sel = "{replica=\"" + label + "\"}";
      replicas[label] = {{"chosen", d(k)},
                         {"answered", d(p + "replica_answered_total" + sel)},
                         {"failures", d(p + "replica_failures_total" + sel)},
                         {"prefix_hits", d(p + "replica_prefix_hits_total" + sel)}};
    }
    out["router"] = {{"requests", d(p + "requests_total")},
                     {"proxied", d(p + "proxied_total")},
                     {"retries", d(p + "retries_total")},
                     {"unavailable", d(p + "unavailable_total")},
                     {"failed_mid_answer", d(p + "failed_mid_answer_total")},
                     {"prefix_lookups", lookups},
                     {"prefix_hits", hits},
                     {"prefix_hit_rate", ratio(hits, lookups)},
                     {"prefix_matched_chunk_rate",
                      ratio(d(p + "prefix_matched_chunks_total"), d(p + "prefix_prompt_chunks_total"))},
                     {"replicas", replicas}};
  }
  return out;
}

Result<std::string> http_get(const std::string& host, uint16_t port, const std::string& target,
                             const std::string& api_key, double timeout_s) {
  asio::io_context ioc;
  beast::tcp_stream stream(ioc);
  asio::ip::tcp::resolver resolver(ioc);
  boost::system::error_code ec;
  const auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  const std::string where = "GET http://" + host + ":" + std::to_string(port) + target;
  if (ec) return unavailable(where + ": " + ec.message());
  http::request<http::empty_body> req{http::verb::get, target, 11};
  req.set(http::field::host, host);
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  http::response_parser<http::string_body> parser;
  parser.body_limit(64u << 20);
  beast::flat_buffer buf;
  stream.expires_after(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3)));
  stream.async_connect(endpoints, [&](boost::system::error_code e, const auto&) {
    if (e) {
      ec = e;
      return;
    }
    http::async_write(stream, req, [&](boost::system::error_code e2, size_t) {
      if (e2) {
        ec = e2;
        return;
      }
      http::async_read(stream, buf, parser, [&](boost::system::error_code e3, size_t) { ec = e3; });
    });
  });
  ioc.run();
  if (ec) return unavailable(where + ": " + ec.message());
  if (parser.get().result_int() != 200) {
    return unavailable(where + ": HTTP " + std::to_string(parser.get().result_int()));
  }
  return parser.get().body();
}

// ---- the run -----------------------------------------------------------------------------------

Result<RunOutput> run_trace(const Trace& trace, const RunOptions& o) {
  if (o.port == 0) return invalid_argument("the target's port must not be 0");
  if (!(o.timeout_s > 0) || !(o.time_scale >= 0) || o.max_in_flight < 1) {
    return invalid_argument("timeout must be > 0, time scale >= 0, max in flight >= 1");
  }
  if (o.api_key.find_first_of("\r\n") != std::string::npos) return invalid_argument("the API key holds a line break");
  asio::io_context resolve_ctx;
  asio::ip::tcp::resolver resolver(resolve_ctx);
  boost::system::error_code ec;
  const auto resolved = resolver.resolve(o.host, std::to_string(o.port), ec);
  if (ec || resolved.empty()) return unavailable("cannot resolve " + o.host + ": " + ec.message());
  const asio::ip::tcp::endpoint endpoint = *resolved.begin();
  const std::string headers = o.api_key.empty() ? std::string() : "Authorization: Bearer " + o.api_key + "\r\n";

  const size_t n = trace.requests.size();
  std::vector<int64_t> turn(n);
  {
    std::map<std::string, int64_t> count;
    for (size_t i = 0; i < n; ++i) {
      if (!trace.requests[i].session.empty()) turn[i] = count[trace.requests[i].session]++;
    }
  }
  // The scheduler (all under `mu`). The dispatcher (this thread) sleeps until each arrival and
  // takes an in-flight slot; a request whose session's previous turn is still running waits in
  // that session's queue (no thread), any other goes to a worker. A worker that finishes a turn
  // runs the session's next turn itself when it has already arrived (handed on: no wake-up),
  // else it parks on its own condition variable until the dispatcher hands it a request. So each
  // request costs at most one wake-up, and threads are the most requests ever sent at once (at
  // most max_in_flight), created once and joined at the end.
  struct Session {
    std::string history;        // prefix, prompts and answers so far
    int64_t done = 0;           // turns finished
    std::deque<size_t> queued;  // arrived turns waiting for the previous one, in turn order
  };
  struct Worker {
    std::condition_variable cv;
    std::optional<size_t> task;
    bool stop = false;
    std::thread thread;
  };
  std::map<std::string, Session> sessions;
  std::mutex mu;
  std::condition_variable dispatcher_cv;
  bool dispatcher_waiting = false;
  int64_t dispatcher_until = 0;  // it waits for in_flight <= this
  int64_t in_flight = 0;         // requests dispatched and not finished (queued in a session or sent)
  std::deque<std::unique_ptr<Worker>> workers;
  std::vector<Worker*> idle;
  Watchdog watchdog;
  RunOutput out;
  out.results.resize(n);
  const auto start = Clock::now();
  const auto since_start = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };

  // Request i, its session's history already read; the new history (empty without a session).
  auto send = [&](size_t i, std::string prompt) {
    const TraceRequest& r = trace.requests[i];
    RequestResult& res = out.results[i];
    prompt += r.prompt;
    res.prompt_bytes = static_cast<int64_t>(prompt.size());
    json body = {{"prompt", prompt},
                 {"max_tokens", r.max_tokens},
                 {"temperature", 0},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    if (o.ignore_eos) body["ignore_eos"] = true;
    if (!o.model.empty()) body["model"] = o.model;
    const std::string text = body.dump(-1, ' ', false, json::error_handler_t::replace);
    res.sent_at_s = since_start();
    asio::io_context ioc;
    asio::ip::tcp::socket socket(ioc);
    boost::system::error_code oec;
    socket.open(endpoint.protocol(), oec);
    RequestTiming t;
    if (!oec) {
      watchdog.add(static_cast<int64_t>(i), socket.native_handle(),
                   Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1e3)));
      boost::system::error_code cec;
      socket.connect(endpoint, cec);
      if (!cec) {
        t = stream_completion(socket, text, headers);
      } else {
        t.error = "connect: " + cec.message();
      }
      if (watchdog.remove(static_cast<int64_t>(i))) {
        t.ok = false;
        t.error = "timed out after " + shown(json(o.timeout_s)) + " s";
      }
      socket.close(cec);
    } else {
      t.error = "socket: " + oec.message();
    }
    res.ok = t.ok;
    res.error = t.ok ? std::string() : (t.error.empty() ? std::string("the stream ended without [DONE]") : t.error);
    res.ttft_s = t.ttft_s;
    res.latency_s = t.latency_s;
    res.gaps_s = std::move(t.gaps_s);
    res.prompt_tokens = t.prompt_tokens;
    res.completion_tokens = t.completion_tokens;
    res.cached_tokens = t.cached_tokens;
    res.text = t.text;
    res.prompt_hash = fnv1a64(prompt);
    return r.session.empty() ? std::string() : prompt + (t.ok ? t.text : std::string());
  };
  // The prompt's start for request i (under mu): its session's history, or its prefix's text.
  auto history_of = [&](size_t i) {
    const TraceRequest& r = trace.requests[i];
    if (!r.session.empty()) {
      const Session& s = sessions[r.session];
      if (s.done > 0) return s.history;
    }
    return r.prefix.empty() ? std::string() : trace.prefixes.at(r.prefix);
  };
  auto worker_loop = [&](Worker* w) {
    std::unique_lock<std::mutex> l(mu);
    for (;;) {
      while (!w->task && !w->stop) {
        w->cv.wait(l);
        ++out.wakeups;
      }
      if (!w->task) return;
      size_t i = *w->task;
      w->task.reset();
      for (;;) {  // i and the turns handed on after it
        std::string prompt = history_of(i);
        l.unlock();
        std::string history = send(i, std::move(prompt));
        l.lock();
        --in_flight;
        if (dispatcher_waiting && in_flight <= dispatcher_until) dispatcher_cv.notify_one();
        const std::string& session = trace.requests[i].session;
        if (session.empty()) break;
        Session& s = sessions[session];
        s.history = std::move(history);
        ++s.done;
        if (s.queued.empty()) break;
        i = s.queued.front();
        s.queued.pop_front();
        ++out.turns_handed_on;
      }
      idle.push_back(w);
    }
  };
  // Under mu: request i to an idle worker, or to a new one.
  auto start_request = [&](size_t i) {
    if (!idle.empty()) {
      Worker* w = idle.back();
      idle.pop_back();
      w->task = i;
      w->cv.notify_one();
      return;
    }
    workers.push_back(std::make_unique<Worker>());
    Worker* w = workers.back().get();
    w->task = i;
    w->thread = std::thread(worker_loop, w);
    ++out.workers;
  };
  auto dispatcher_wait = [&](std::unique_lock<std::mutex>& l, int64_t until) {
    dispatcher_until = until;
    while (in_flight > until) {
      dispatcher_waiting = true;
      dispatcher_cv.wait(l);
      ++out.wakeups;
    }
    dispatcher_waiting = false;
  };

  for (size_t i = 0; i < n; ++i) {
    const TraceRequest& r = trace.requests[i];
    out.results[i] = scheduled_result(r, i, o.time_scale);
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(out.results[i].scheduled_at_s)));
    std::unique_lock<std::mutex> l(mu);
    dispatcher_wait(l, o.max_in_flight - 1);
    ++in_flight;
    if (!r.session.empty()) {
      Session& s = sessions[r.session];
      if (s.done < turn[i]) {  // its previous turn is queued or running: the one that finishes it sends this
        s.queued.push_back(i);
        continue;
      }
    }
    start_request(i);
  }
  {
    std::unique_lock<std::mutex> l(mu);
    dispatcher_wait(l, 0);
    out.wall_s = since_start();
    for (auto& w : workers) {
      w->stop = true;
      w->cv.notify_one();
    }
  }
  for (auto& w : workers) w->thread.join();
  return out;
}

Result<json> compare_texts(const json& baseline, const json& run) {
  const auto requests = [](const json& doc, const char* which) -> Result<const json*> {
    if (!doc.is_object() || !doc.contains("requests") || !doc["requests"].is_array()) {
      return invalid_argument(std::string(which) + ": not a bench_loadgen report (no \"requests\" array)");
    }
    for (const json& r : doc["requests"]) {
      if (!r.is_object() || !r.contains("text") || !r["text"].is_string() || !r.contains("prompt_fnv1a") ||
          !r.contains("ok") || !r.contains("line")) {
        return invalid_argument(std::string(which) + ": a request without \"text\" (run bench_loadgen with --record-text)");
      }
    }
    return &doc["requests"];
  };
  SPX_ASSIGN_OR_RETURN(const json* a, requests(baseline, "baseline"));
  SPX_ASSIGN_OR_RETURN(const json* b, requests(run, "run"));
  if (a->size() != b->size()) {
    return invalid_argument("the reports are not of one trace: " + std::to_string(a->size()) + " vs " +
                            std::to_string(b->size()) + " requests");
  }
  int64_t same = 0, different = 0, failed = 0, failed_in_baseline = 0, prompt_changed = 0;
  int64_t cached_differ = 0, different_cached_differ = 0;
  json different_indices = json::array(), failed_errors = json::object();
  for (size_t i = 0; i < a->size(); ++i) {
    const json& x = (*a)[i];
    const json& y = (*b)[i];
    if (x["line"] != y["line"]) {
      return invalid_argument("the reports are not of one trace: request " + std::to_string(i) + " is line " +
                              x["line"].dump() + " vs " + y["line"].dump());
    }
    if (!x["ok"].get<bool>()) {
      ++failed_in_baseline;
    } else if (!y["ok"].get<bool>()) {
      ++failed;
      const std::string msg = y.value("error", std::string("no answer")).substr(0, 200);
      failed_errors[msg] = failed_errors.value(msg, int64_t{0}) + 1;
    } else if (x["prompt_fnv1a"] != y["prompt_fnv1a"]) {
      ++prompt_changed;
    } else {
      const bool cached_differs = x.contains("cached_tokens") && y.contains("cached_tokens") &&
                                  x["cached_tokens"] != y["cached_tokens"];
      cached_differ += cached_differs;
      if (x["text"] == y["text"]) {
        ++same;
      } else {
        ++different;
        different_cached_differ += cached_differs;
        if (different_indices.size() < 20) different_indices.push_back(i);
      }
    }
  }
  return json{{"requests", a->size()},
              {"same", same},
              {"different", different},
              {"different_indices", different_indices},
              {"cached_differs", cached_differ},
              {"different_cached_differs", different_cached_differ},
              {"different_same_cached", different - different_cached_differ},
              {"failed", failed},
              {"failed_errors", failed_errors},
              {"prompt_changed", prompt_changed},
              {"failed_in_baseline", failed_in_baseline}};
}

RequestResult scheduled_result(const TraceRequest& r, size_t index, double time_scale) {
  RequestResult res;
  res.index = static_cast<int64_t>(index);
  res.line = r.line;
  res.session = r.session;
  res.kind = r.kind;
  res.max_tokens = r.max_tokens;
  res.scheduled_at_s = r.arrival_s * time_scale;
  return res;
}

void add_synth_options(CLI::App& app, SynthOptions& o) {
  app.add_option("--arrival", o.arrivals.process, "poisson, burst or uniform");
  app.add_option("--rate", o.arrivals.rate, "requests per second (mean)");
  app.add_option("--burst-size", o.arrivals.burst_size, "requests per burst (--arrival burst)");
  app.add_option("--seed", o.arrivals.seed, "arrivals and text");
  app.add_option("--requests", o.requests, "requests in the trace");
  app.add_option("--sessions", o.sessions, "conversations going on at once");
  app.add_option("--turns", o.turns, "requests per conversation (its context grows each turn)");
  app.add_option("--prefixes", o.prefixes, "distinct system prompts the conversations share (0: none)");
  app.add_option("--prefix-words", o.prefix_words, "words per system prompt");
  app.add_option("--turn-words", o.turn_words, "words of user text per chat turn (and per agent task)");
  app.add_option("--tool-words", o.tool_words, "words of tool output an agent turn appends");
  app.add_option("--agent-fraction", o.agent_fraction, "fraction of conversations that are agent trajectories");
  app.add_option("--max-tokens", o.max_tokens, "output tokens per request");
}

Result<Trace> trace_or_synth(const std::string& path, const SynthOptions& o) {
  if (!path.empty()) return load_trace(path);
  auto text = synth_trace(o);
  if (!text.is_ok()) return text.status();
  std::istringstream in(*text);
  return parse_trace(in);
}

}  // namespace specontext::bench::loadgen
