#include "planner/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace specontext::planner {

namespace {

// Products such as kvc·(L+1+α)·R·S·H·D can pass 2^63 for absurd inputs; compute wide, check once.
using Wide = __int128;
constexpr Wide kMaxBytes = Wide{1} << 62;
constexpr TierId kDeviceTier{0};

// Derived constants of one snapshot.
struct Derived {
  int64_t L = 0, alpha = 0, R = 0, B = 0;
  int64_t token_bytes = 0;      // one token's K+V in one layer: H·D·kvc, kvc = 2·elem
  int64_t head_token_bytes = 0; // one token of the retrieval head's K cache: H_head·D·elem
  int64_t retrieval_token_bytes = 0;  // device bytes per token for retrieval (paper: (1+α)·token_bytes)
  int64_t weights = 0;          // ceil(runtime_factor · (M_O + M_D))
  int64_t S = 0, T = 0;         // effective per-request length, total tokens
  int64_t shortlist = 0;
};


Derived derive(const PlannerSnapshot& s) {
  Derived d;
  d.L = s.model.layers;
  d.alpha = s.model.alpha();
  d.R = s.requests;
  d.B = s.budget;
  d.token_bytes = s.model.kv_heads * s.model.head_dim * 2 * s.kv_elem_bytes;
  d.head_token_bytes = s.model.retrieval_kv_heads() * s.model.head_dim * s.kv_elem_bytes;
  d.retrieval_token_bytes = s.retrieval_token_bytes();
  d.weights = weights_bytes(s);
  d.S = effective_seq_len(s);
  d.T = total_tokens(s);
  d.shortlist = s.shortlist_tokens();
  return d;
}

std::string pct(double margin) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g%%", margin * 100.0);
  return buf;
}

std::string num(int64_t v) { return std::to_string(v); }

std::string fmt_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// floor(x · (1 − margin)); the nudge keeps 10 · (1 − 0.1) at 9 although 0.1 is not exact in binary.
int64_t relaxed_threshold(int64_t x, double margin) {
  const long double v = static_cast<long double>(x) * (1.0L - static_cast<long double>(margin));
  return static_cast<int64_t>(std::floor(v + 1e-9L * std::max<long double>(1, v)));
}

// Tiers of a snapshot: device, host pools, remote pools, in that id order.
std::vector<TierInfo> make_tiers(const PlannerSnapshot& s) {
  std::vector<TierInfo> tiers;
  tiers.push_back({kDeviceTier, TierKind::kDevice, 0, "device", s.device_bytes, 0, 0});
  for (const HostPool& h : s.host) {
    tiers.push_back({TierId(static_cast<int32_t>(tiers.size())), TierKind::kHost, h.numa_node,
                     "host" + std::to_string(h.numa_node), h.capacity_bytes, 0, h.device_bandwidth_bps});
  }
  for (const RemotePool& r : s.remote) {
    tiers.push_back({TierId(static_cast<int32_t>(tiers.size())), TierKind::kRemote, r.rank,
                     "remote" + std::to_string(r.rank), r.capacity_bytes, 0, r.bandwidth_bps});
  }
  return tiers;
}

// Off-device tiers in preference order: host pools by bandwidth to the device (fastest first),
// then remote pools by bandwidth; ties keep snapshot order so plans are deterministic.
std::vector<size_t> preference_order(const std::vector<TierInfo>& tiers) {
  std::vector<size_t> order;
  for (TierKind kind : {TierKind::kHost, TierKind::kRemote}) {
    std::vector<size_t> part;
    for (size_t t = 0; t < tiers.size(); ++t) if (tiers[t].kind == kind) part.push_back(t);
    std::stable_sort(part.begin(), part.end(),
                     [&](size_t a, size_t b) { return tiers[a].bandwidth_bps > tiers[b].bandwidth_bps; });
    order.insert(order.end(), part.begin(), part.end());
  }
  return order;
}

double path_bandwidth(const PlannerSnapshot& s, const std::vector<TierInfo>& tiers, TierId a, TierId b) {
  const TierInfo& x = tiers[static_cast<size_t>(a.value())];
  const TierInfo& y = tiers[static_cast<size_t>(b.value())];
  auto pair_is = [&](TierKind p, TierKind q) {
    return (x.kind == p && y.kind == q) || (x.kind == q && y.kind == p);
  };
  if (pair_is(TierKind::kDevice, TierKind::kHost)) return x.kind == TierKind::kHost ? x.bandwidth_bps : y.bandwidth_bps;
  if (pair_is(TierKind::kHost, TierKind::kHost)) return s.host_to_host_bandwidth_bps;
  if (pair_is(TierKind::kRemote, TierKind::kRemote)) return std::min(x.bandwidth_bps, y.bandwidth_bps);
  return x.kind == TierKind::kRemote ? x.bandwidth_bps : y.bandwidth_bps;  // remote ↔ host/device
}

std::string free_space_list(const std::vector<TierInfo>& tiers, const std::vector<int64_t>& used,
                            bool host_only) {
  std::string out;
  for (const TierInfo& t : tiers) {
    if (t.kind == TierKind::kDevice || (host_only && t.kind == TierKind::kRemote)) continue;
    const size_t i = static_cast<size_t>(t.id.value());
    out += (out.empty() ? "" : "; ") + t.name + " " + format_bytes(t.capacity_bytes - used[i]) +
           " free of " + format_bytes(t.capacity_bytes);
  }
  if (out.empty()) out = host_only ? "no host tier given" : "no host or remote tier given";
  else if (!host_only && std::none_of(tiers.begin(), tiers.end(),
                                      [](const TierInfo& t) { return t.kind == TierKind::kRemote; })) {
    out += "; no remote tier given";
  }
  return out;
}

Status check_same_layout(const Plan& current, const std::vector<TierInfo>& tiers, int64_t layers) {
  bool same = current.tiers.size() == tiers.size();
  for (size_t i = 0; same && i < tiers.size(); ++i) {
    same = current.tiers[i].kind == tiers[i].kind && current.tiers[i].index == tiers[i].index &&
           current.tiers[i].id == tiers[i].id;
  }
  if (!same) {
    return invalid_argument("replan: the snapshot's tiers (device, host, remote pools) differ from the "
                            "current plan's; build a fresh plan instead");
  }
  if (static_cast<int64_t>(current.layers.size()) != layers) {
    return invalid_argument("replan: the current plan has " + std::to_string(current.layers.size()) +
                            " layers, the snapshot's model has " + std::to_string(layers));
  }
  auto valid_tier = [&](TierId t) { return t.valid() && t.value() >= 0 && static_cast<size_t>(t.value()) < tiers.size(); };
  for (const LayerPlacement& p : current.layers) {
    if (!valid_tier(p.home)) return invalid_argument("replan: the current plan names an unknown tier");
  }
  if (!valid_tier(current.head_cache_home)) return invalid_argument("replan: the current plan names an unknown tier");
  return Status::ok();
}

DeviceUsage device_usage(const Derived& d, int64_t offloaded, bool filtering, int64_t capacity) {
  DeviceUsage u;
  u.capacity_bytes = capacity;
  u.weights_bytes = d.weights;
  u.resident_kv_bytes = (d.L - offloaded) * d.T * d.token_bytes;
  // The paper's (1 + α) rows: the head's K cache and the repeat_kv buffer, both S long. With CPU
  // filtering they shrink to the shortlist the CPU hands over.
  u.retrieval_bytes = (filtering ? d.R * d.shortlist : d.T) * d.retrieval_token_bytes;
  u.staging_bytes = offloaded * d.R * d.B * d.token_bytes;
  u.total_bytes = u.weights_bytes + u.resident_kv_bytes + u.retrieval_bytes + u.staging_bytes;
  return u;
}

// One thing to give an off-device home: the head's K cache or one layer's KV.
struct Item {
  MigrationItem kind = MigrationItem::kLayerKv;
  int64_t layer = -1;
  int64_t offload_index = 0;  // k-th layer offloaded (0 = the last layer)
  int64_t bytes = 0;
  TierId prev;                // home in the current plan when it was already off the device
  TierId chosen;
  std::string reason;         // why it moved, when it moved between off-device tiers
};

std::string item_name(const Item& it) {
  return it.kind == MigrationItem::kHeadKCache ? std::string("the retrieval head's K cache")
                                               : "layer " + std::to_string(it.layer) + "'s KV cache";
}

Result<Plan> build(const PlannerSnapshot& s, const Plan* current, const HysteresisOptions& opts) {
  SPX_RETURN_IF_ERROR(validate_snapshot(s));
  if (!(opts.margin >= 0 && opts.margin < 1)) {
    return invalid_argument("hysteresis margin must be in [0, 1)");
  }
  SPX_ASSIGN_OR_RETURN(std::vector<int64_t> th, thresholds(s));
  const Derived d = derive(s);
  {
    const Wide all = Wide{d.weights} +
                     Wide{d.L} * d.T * d.token_bytes + Wide{d.T} * d.retrieval_token_bytes +
                     Wide{d.L} * d.R * d.B * d.token_bytes +
                     Wide{d.R} * d.shortlist * d.retrieval_token_bytes +
                     Wide{d.T} * d.head_token_bytes + Wide{d.L} * s.layer_slack_bytes + s.head_cache_slack_bytes;
    if (all > kMaxBytes) return invalid_argument("planner snapshot: sizes overflow 64-bit byte counts");
  }
  std::vector<TierInfo> tiers = make_tiers(s);
  if (current) SPX_RETURN_IF_ERROR(check_same_layout(*current, tiers, d.L));
  const std::vector<size_t> pref = preference_order(tiers);
  std::vector<size_t> rank(tiers.size(), 0);
  for (size_t r = 0; r < pref.size(); ++r) rank[pref[r]] = r;

  // ---- how many layers leave the device (Algorithm 1), with hysteresis on the way back ----
  const int64_t n_fit = layers_to_offload(th, d.S);
  bool filtering = n_fit > d.L;
  int64_t n = std::min(n_fit, d.L);
  if (current) {
    const int64_t cur_n = current->offloaded_layers;
    if (!filtering && current->cpu_filtering && d.S >= relaxed_threshold(th[static_cast<size_t>(d.L)], opts.margin)) {
      filtering = true;  // stays on until S is margin below S^T_L
    }
    if (filtering) {
      n = d.L;
    } else if (n_fit < cur_n) {
      int64_t n_relax = d.L + 1;
      for (int64_t i = 0; i <= d.L; ++i) {
        if (d.S < relaxed_threshold(th[static_cast<size_t>(i)], opts.margin)) { n_relax = i; break; }
      }
      n = std::clamp(n_relax, n_fit, cur_n);
    }
  }
  DeviceUsage dev = device_usage(d, n, filtering, s.device_bytes);
  if (dev.total_bytes > s.device_bytes && !filtering && n != n_fit) {
    // Hysteresis kept a state that no longer fits (thresholds that fall with i): take the fit.
    n = n_fit;
    dev = device_usage(d, n, filtering, s.device_bytes);
  }
  if (dev.total_bytes > s.device_bytes) {
    return resource_exhausted(
        "device: " + format_bytes(dev.total_bytes) + " needed but " + format_bytes(s.device_bytes) +
        " available with " + num(n) + " of " + num(d.L) + " layers offloaded" +
        (filtering ? " and CPU candidate filtering (shortlist " + num(d.shortlist) + " tokens)" : "") +
        ": weights and runtime " + format_bytes(dev.weights_bytes) + " (" + fmt_double(s.runtime_factor) +
        " x (M_O + M_D)), staging " + format_bytes(dev.staging_bytes) + " (" + num(d.R) + " requests x " +
        num(d.B) + " tokens x " + num(n) + " layers), retrieval head " + format_bytes(dev.retrieval_bytes) +
        "; use fewer requests, a smaller budget, or a larger device");
  }

  // ---- homes off the device: first fit in preference order, sticky, re-entering with margin ----
  std::vector<Item> items;
  if (filtering) {
    Item it;
    it.kind = MigrationItem::kHeadKCache;
    it.bytes = d.T * d.head_token_bytes + s.head_cache_slack_bytes;
    if (current && current->cpu_filtering) it.prev = current->head_cache_home;
    items.push_back(it);
  }
  for (int64_t k = 0; k < n; ++k) {
    Item it;
    it.layer = d.L - 1 - k;
    it.offload_index = k;
    it.bytes = d.T * d.token_bytes + s.layer_slack_bytes;
    if (current) {
      const TierId h = current->layers[static_cast<size_t>(it.layer)].home;
      if (h != kDeviceTier) it.prev = h;
    }
    items.push_back(it);
  }
  std::vector<int64_t> used(tiers.size(), 0);
  for (Item& it : items) {
    const bool host_only = it.kind == MigrationItem::kHeadKCache;  // CPU filter workers scan it
    auto allowed = [&](size_t t) {
      return tiers[t].kind == TierKind::kHost || (tiers[t].kind == TierKind::kRemote && !host_only);
    };
    auto fits = [&](size_t t) { return used[t] + it.bytes <= tiers[t].capacity_bytes; };
    auto fits_with_margin = [&](size_t t) {
      return used[t] + it.bytes <= relaxed_threshold(tiers[t].capacity_bytes, opts.margin);
    };
    const bool has_prev = it.prev.valid() && allowed(static_cast<size_t>(it.prev.value()));
    if (has_prev) {
      const size_t p = static_cast<size_t>(it.prev.value());
      for (size_t t : pref) {  // a faster tier, only with room to spare
        if (rank[t] >= rank[p]) break;
        if (allowed(t) && fits_with_margin(t)) {
          it.chosen = tiers[t].id;
          it.reason = tiers[t].name + " has room again: " + format_bytes(it.bytes) + " needed, " +
                      format_bytes(tiers[t].capacity_bytes - used[t]) + " free (margin " + pct(opts.margin) + ")";
          break;
        }
      }
      if (!it.chosen.valid() && fits(p)) it.chosen = it.prev;
      if (!it.chosen.valid()) {
        for (size_t t : pref) {
          if (allowed(t) && fits(t)) {
            it.chosen = tiers[t].id;
            it.reason = tiers[p].name + " full: " + format_bytes(it.bytes) + " needed, " +
                        format_bytes(tiers[p].capacity_bytes - used[p]) + " free";
            break;
          }
        }
      }
    } else {
      for (size_t t : pref) {
        if (allowed(t) && fits(t)) { it.chosen = tiers[t].id; break; }
      }
    }
    if (!it.chosen.valid()) {
      return resource_exhausted(
          "cannot place " + item_name(it) + " (" + format_bytes(it.bytes) + " for " +
          num(static_cast<int64_t>(s.seq_lens.size())) + " sequences, " + num(d.T) + " tokens) in any " +
          (host_only ? "host tier (CPU filtering needs it in host memory)" : "host or remote tier") + ": " +
          free_space_list(tiers, used, host_only) +
          "; add host memory or a remote node, or admit fewer or shorter requests");
    }
    used[static_cast<size_t>(it.chosen.value())] += it.bytes;
  }

  // ---- assemble ----
  Plan p;
  p.requests = d.R;
  p.budget = d.B;
  p.kv_elem_bytes = s.kv_elem_bytes;
  p.seq_len = d.S;
  p.total_tokens = d.T;
  p.thresholds = th;
  p.offloaded_layers = n;
  p.cpu_filtering = filtering;
  p.head_cache_bytes = d.T * d.head_token_bytes;
  p.head_cache_home = filtering ? items.front().chosen : kDeviceTier;
  p.layers.resize(static_cast<size_t>(d.L));
  for (int64_t l = 0; l < d.L; ++l) {
    p.layers[static_cast<size_t>(l)] = {LayerId(static_cast<int32_t>(l)), kDeviceTier, d.T * d.token_bytes};
  }
  for (const Item& it : items) {
    if (it.kind == MigrationItem::kLayerKv) p.layers[static_cast<size_t>(it.layer)].home = it.chosen;
  }
  used[0] = dev.total_bytes;
  for (size_t t = 0; t < tiers.size(); ++t) tiers[t].used_bytes = used[t];
  p.tiers = tiers;
  p.device = dev;
  if (!current) return p;

  // ---- migrations relative to the current plan ----
  auto add = [&](MigrationItem kind, int64_t layer, TierId from, TierId to, int64_t bytes, std::string reason) {
    Migration m;
    m.item = kind;
    m.layer = layer >= 0 ? LayerId(static_cast<int32_t>(layer)) : LayerId();
    m.from = from;
    m.to = to;
    m.bytes = bytes;
    const double bw = path_bandwidth(s, tiers, from, to);
    m.est_seconds = bw > 0 ? static_cast<double>(bytes) / bw : 0.0;
    m.reason = std::move(reason);
    p.migrations.push_back(std::move(m));
  };
  const std::string S = "S = " + num(d.S);
  const int64_t stL = th[static_cast<size_t>(d.L)];
  {
    const TierId from = current->cpu_filtering ? current->head_cache_home : kDeviceTier;
    if (from != p.head_cache_home) {
      std::string why;
      if (from == kDeviceTier) {
        why = "CPU filtering on: " + S + " >= S^T_" + num(d.L) + " = " + num(stL) +
              ": with every layer offloaded the device cannot hold the retrieval head's K cache";
      } else if (p.head_cache_home == kDeviceTier) {
        why = "CPU filtering off: " + S + " < S^T_" + num(d.L) + " x (1 - " + pct(opts.margin) + ") = " +
              num(relaxed_threshold(stL, opts.margin)) + ": the retrieval head's K cache fits the device again";
      } else {
        why = items.front().reason;
      }
      add(MigrationItem::kHeadKCache, -1, from, p.head_cache_home, p.head_cache_bytes, why);
    }
  }
  const int64_t per_layer = d.T * d.token_bytes;
  for (int64_t l = d.L - 1; l >= 0; --l) {
    const TierId from = current->layers[static_cast<size_t>(l)].home;
    const TierId to = p.layers[static_cast<size_t>(l)].home;
    if (from == to) continue;
    const int64_t k = d.L - 1 - l;  // this layer's offload index
    std::string why;
    if (from == kDeviceTier) {
      why = "offload: " + S + " >= S^T_" + num(k) + " = " + num(th[static_cast<size_t>(k)]);
    } else if (to == kDeviceTier) {
      why = "return to device: " + S + " < S^T_" + num(n) + " x (1 - " + pct(opts.margin) + ") = " +
            num(relaxed_threshold(th[static_cast<size_t>(n)], opts.margin)) + "; " + num(n) +
            " layers stay offloaded";
    } else {
      for (const Item& it : items) if (it.layer == l) why = it.reason;
    }
    add(MigrationItem::kLayerKv, l, from, to, per_layer, why);
  }
  return p;
}

}  // namespace

int64_t weights_bytes(const PlannerSnapshot& s) {
  const long double w = static_cast<long double>(s.runtime_factor) *
                        (static_cast<long double>(s.model_bytes) + static_cast<long double>(s.head_bytes));
  // 1.3 is not exact in binary: 1.3·100 must give 130, not 131, so snap near-integers first.
  const long double r = std::nearbyint(w);
  if (std::fabs(w - r) <= 1e-12L * std::max<long double>(1, w)) return static_cast<int64_t>(r);
  return static_cast<int64_t>(std::ceil(w));
}

Result<std::vector<int64_t>> thresholds(const PlannerSnapshot& s) {
  SPX_RETURN_IF_ERROR(validate_snapshot(s));
  const Derived d = derive(s);
  const int64_t kvc = 2 * s.kv_elem_bytes;  // the paper's "4" for fp16: K and V, 2 bytes each
  const Wide rhd = Wide{d.R} * s.model.kv_heads * s.model.head_dim;
  const Wide free_bytes = Wide{s.device_bytes} - d.weights;  // Mem − 1.3(M_O + M_D)
  std::vector<int64_t> th;
  th.reserve(static_cast<size_t>(d.L + 1));
  for (int64_t i = 0; i <= d.L; ++i) {
    // S^T_i = floor((Mem − 1.3(M_O+M_D) − kvc·i·B·R·H·D) / (kvc·(L+1+α−i)·R·H·D)); the (1+α)
    // rows are the retrieval term, R·retrieval_token_bytes in general.
    const Wide numerator = free_bytes - Wide{kvc} * i * d.B * rhd;
    const Wide denominator = Wide{kvc} * (d.L - i) * rhd + Wide{d.R} * d.retrieval_token_bytes;  // > 0
    const Wide v = numerator <= 0 ? Wide{0} : numerator / denominator;
    th.push_back(static_cast<int64_t>(std::min<Wide>(v, std::numeric_limits<int64_t>::max())));
  }
  return th;
}

int64_t layers_to_offload(const std::vector<int64_t>& th, int64_t seq_len) {
  for (size_t i = 0; i < th.size(); ++i) {
    if (seq_len < th[i]) return static_cast<int64_t>(i);
  }
  return static_cast<int64_t>(th.size());
}

Result<Plan> plan(const PlannerSnapshot& s) { return build(s, nullptr, HysteresisOptions{}); }

Result<Plan> replan(const Plan& current, const PlannerSnapshot& now, const HysteresisOptions& opts) {
  return build(now, &current, opts);
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  const int64_t mag = bytes < 0 ? -bytes : bytes;
  if (mag >= (int64_t{1} << 40)) std::snprintf(buf, sizeof(buf), "%.2f TiB", b / (1024.0 * 1024 * 1024 * 1024));
  else if (mag >= (int64_t{1} << 30)) std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (mag >= (int64_t{1} << 20)) std::snprintf(buf, sizeof(buf), "%.2f MiB", b / (1024.0 * 1024));
  else if (mag >= (int64_t{1} << 10)) std::snprintf(buf, sizeof(buf), "%.2f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  return buf;
}

}  // namespace specontext::planner
