#include "planner/plan_json.h"

#include <string>

namespace specontext::planner {

using nlohmann::json;

namespace {

json tier_id_json(TierId id) { return id.valid() ? json(id.value()) : json(nullptr); }

TierId tier_id_from(const json& j) {
  return j.is_null() ? TierId() : TierId(j.get<int32_t>());
}

std::string_view item_name(MigrationItem m) {
  return m == MigrationItem::kHeadKCache ? "head_k_cache" : "layer";
}

}  // namespace

json snapshot_to_json(const PlannerSnapshot& s) {
  json host = json::array();
  for (const HostPool& h : s.host) {
    host.push_back({{"numa_node", h.numa_node}, {"capacity_bytes", h.capacity_bytes},
                    {"device_bandwidth_bps", h.device_bandwidth_bps}});
  }
  json remote = json::array();
  for (const RemotePool& r : s.remote) {
    remote.push_back({{"rank", r.rank}, {"capacity_bytes", r.capacity_bytes}, {"bandwidth_bps", r.bandwidth_bps}});
  }
  return {
      {"model", {{"layers", s.model.layers}, {"kv_heads", s.model.kv_heads}, {"head_dim", s.model.head_dim},
                 {"q_heads", s.model.q_heads}, {"head_kv_heads", s.model.head_kv_heads}}},
      {"kv_elem_bytes", s.kv_elem_bytes},
      {"model_bytes", s.model_bytes},
      {"head_bytes", s.head_bytes},
      {"runtime_factor", s.runtime_factor},
      {"budget", s.budget},
      {"requests", s.requests},
      {"device_bytes", s.device_bytes},
      {"host", host},
      {"remote", remote},
      {"host_to_host_bandwidth_bps", s.host_to_host_bandwidth_bps},
      {"seq_lens", s.seq_lens},
      {"filter_shortlist_tokens", s.filter_shortlist_tokens},
      {"retrieval_bytes_per_token", s.retrieval_bytes_per_token},
      {"layer_slack_bytes", s.layer_slack_bytes},
      {"head_cache_slack_bytes", s.head_cache_slack_bytes},
  };
}

Result<PlannerSnapshot> snapshot_from_json(const json& j) {
  try {
    PlannerSnapshot s;
    const json& m = j.at("model");
    s.model.layers = m.at("layers").get<int64_t>();
    s.model.kv_heads = m.at("kv_heads").get<int64_t>();
    s.model.head_dim = m.at("head_dim").get<int64_t>();
    s.model.q_heads = m.at("q_heads").get<int64_t>();
    s.model.head_kv_heads = m.value("head_kv_heads", int64_t{0});
    s.kv_elem_bytes = j.at("kv_elem_bytes").get<int64_t>();
    s.model_bytes = j.at("model_bytes").get<int64_t>();
    s.head_bytes = j.at("head_bytes").get<int64_t>();
    s.runtime_factor = j.value("runtime_factor", 1.3);
    s.budget = j.at("budget").get<int64_t>();
    s.requests = j.at("requests").get<int64_t>();
    s.device_bytes = j.at("device_bytes").get<int64_t>();
    for (const json& h : j.value("host", json::array())) {
      s.host.push_back({h.at("numa_node").get<int32_t>(), h.at("capacity_bytes").get<int64_t>(),
                        h.value("device_bandwidth_bps", 0.0)});
    }
    for (const json& r : j.value("remote", json::array())) {
      s.remote.push_back({r.at("rank").get<int32_t>(), r.at("capacity_bytes").get<int64_t>(),
                          r.value("bandwidth_bps", 0.0)});
    }
    s.host_to_host_bandwidth_bps = j.value("host_to_host_bandwidth_bps", 0.0);
    s.seq_lens = j.value("seq_lens", std::vector<int64_t>{});
    s.filter_shortlist_tokens = j.value("filter_shortlist_tokens", int64_t{0});
    s.retrieval_bytes_per_token = j.value("retrieval_bytes_per_token", int64_t{0});
    s.layer_slack_bytes = j.value("layer_slack_bytes", int64_t{0});
    s.head_cache_slack_bytes = j.value("head_cache_slack_bytes", int64_t{0});
    SPX_RETURN_IF_ERROR(validate_snapshot(s));
    return s;
  } catch (const json::exception& e) {
    return invalid_argument(std::string("planner snapshot json: ") + e.what());
  }
}

json plan_to_json(const Plan& p) {
  json tiers = json::array();
  for (const TierInfo& t : p.tiers) {
    tiers.push_back({{"id", tier_id_json(t.id)}, {"kind", std::string(tier_kind_name(t.kind))},
                     {"index", t.index}, {"name", t.name}, {"capacity_bytes", t.capacity_bytes},
                     {"used_bytes", t.used_bytes}, {"bandwidth_bps", t.bandwidth_bps}});
  }
  auto tier_name = [&](TierId id) -> std::string {
    if (id.valid() && id.value() >= 0 && static_cast<size_t>(id.value()) < p.tiers.size()) {
      return p.tiers[static_cast<size_t>(id.value())].name;
    }
    return "?";
  };
  json layers = json::array();
  for (const LayerPlacement& l : p.layers) {
    // "tier" is for people reading fixtures; the reader ignores it.
    layers.push_back({{"layer", l.layer.value()}, {"home", tier_id_json(l.home)}, {"tier", tier_name(l.home)},
                      {"kv_bytes", l.kv_bytes}});
  }
  json migrations = json::array();
  for (const Migration& m : p.migrations) {
    migrations.push_back({{"item", std::string(item_name(m.item))},
                          {"layer", m.layer.valid() ? json(m.layer.value()) : json(nullptr)},
                          {"from", tier_id_json(m.from)}, {"to", tier_id_json(m.to)},
                          {"bytes", m.bytes}, {"est_seconds", m.est_seconds}, {"reason", m.reason}});
  }
  const DeviceUsage& d = p.device;
  return {
      {"requests", p.requests},
      {"budget", p.budget},
      {"kv_elem_bytes", p.kv_elem_bytes},
      {"seq_len", p.seq_len},
      {"total_tokens", p.total_tokens},
      {"thresholds", p.thresholds},
      {"offloaded_layers", p.offloaded_layers},
      {"cpu_filtering", p.cpu_filtering},
      {"head_cache", {{"home", tier_id_json(p.head_cache_home)}, {"bytes", p.head_cache_bytes}}},
      {"device", {{"capacity_bytes", d.capacity_bytes}, {"weights_bytes", d.weights_bytes},
                  {"resident_kv_bytes", d.resident_kv_bytes}, {"retrieval_bytes", d.retrieval_bytes},
                  {"staging_bytes", d.staging_bytes}, {"total_bytes", d.total_bytes}}},
      {"tiers", tiers},
      {"layers", layers},
      {"migrations", migrations},
  };
}

Result<Plan> plan_from_json(const json& j) {
  try {
    Plan p;
    p.requests = j.at("requests").get<int64_t>();
    p.budget = j.at("budget").get<int64_t>();
    p.kv_elem_bytes = j.at("kv_elem_bytes").get<int64_t>();
    p.seq_len = j.at("seq_len").get<int64_t>();
    p.total_tokens = j.at("total_tokens").get<int64_t>();
    p.thresholds = j.at("thresholds").get<std::vector<int64_t>>();
    p.offloaded_layers = j.at("offloaded_layers").get<int64_t>();
    p.cpu_filtering = j.at("cpu_filtering").get<bool>();
    p.head_cache_home = tier_id_from(j.at("head_cache").at("home"));
    p.head_cache_bytes = j.at("head_cache").at("bytes").get<int64_t>();
    const json& d = j.at("device");
    p.device.capacity_bytes = d.at("capacity_bytes").get<int64_t>();
    p.device.weights_bytes = d.at("weights_bytes").get<int64_t>();
    p.device.resident_kv_bytes = d.at("resident_kv_bytes").get<int64_t>();
    p.device.retrieval_bytes = d.at("retrieval_bytes").get<int64_t>();
    p.device.staging_bytes = d.at("staging_bytes").get<int64_t>();
    p.device.total_bytes = d.at("total_bytes").get<int64_t>();
    for (const json& t : j.at("tiers")) {
      TierInfo info;
      info.id = tier_id_from(t.at("id"));
      const std::string kind = t.at("kind").get<std::string>();
      if (kind == "device") info.kind = TierKind::kDevice;
      else if (kind == "host") info.kind = TierKind::kHost;
      else if (kind == "remote") info.kind = TierKind::kRemote;
      else return invalid_argument("plan json: tiers[].kind '" + kind + "' is not device, host or remote");
      info.index = t.at("index").get<int32_t>();
      info.name = t.at("name").get<std::string>();
      info.capacity_bytes = t.at("capacity_bytes").get<int64_t>();
      info.used_bytes = t.at("used_bytes").get<int64_t>();
      info.bandwidth_bps = t.at("bandwidth_bps").get<double>();
      if (info.id != TierId(static_cast<int32_t>(p.tiers.size()))) {
        return invalid_argument("plan json: tiers[" + std::to_string(p.tiers.size()) + "].id must equal its position");
      }
      p.tiers.push_back(std::move(info));
    }
    auto known_tier = [&](TierId id) {
      return id.valid() && id.value() >= 0 && static_cast<size_t>(id.value()) < p.tiers.size();
    };
    for (const json& l : j.at("layers")) {
      LayerPlacement lp{LayerId(l.at("layer").get<int32_t>()), tier_id_from(l.at("home")),
                        l.at("kv_bytes").get<int64_t>()};
      if (lp.layer != LayerId(static_cast<int32_t>(p.layers.size()))) {
        return invalid_argument("plan json: layers[" + std::to_string(p.layers.size()) + "].layer must equal its position");
      }
      if (!known_tier(lp.home)) {
        return invalid_argument("plan json: layers[" + std::to_string(p.layers.size()) + "].home names no tier");
      }
      p.layers.push_back(lp);
    }
    if (!known_tier(p.head_cache_home)) return invalid_argument("plan json: head_cache.home names no tier");
    for (const json& m : j.value("migrations", json::array())) {
      Migration mg;
      const std::string item = m.at("item").get<std::string>();
      if (item == "layer") mg.item = MigrationItem::kLayerKv;
      else if (item == "head_k_cache") mg.item = MigrationItem::kHeadKCache;
      else return invalid_argument("plan json: migrations[].item '" + item + "' is not layer or head_k_cache");
      mg.layer = m.at("layer").is_null() ? LayerId() : LayerId(m.at("layer").get<int32_t>());
      mg.from = tier_id_from(m.at("from"));
      mg.to = tier_id_from(m.at("to"));
      if (!known_tier(mg.from) || !known_tier(mg.to)) {
        return invalid_argument("plan json: a migration names an unknown tier");
      }
      mg.bytes = m.at("bytes").get<int64_t>();
      mg.est_seconds = m.at("est_seconds").get<double>();
      mg.reason = m.at("reason").get<std::string>();
      p.migrations.push_back(std::move(mg));
    }
    return p;
  } catch (const json::exception& e) {
    return invalid_argument(std::string("plan json: ") + e.what());
  }
}

Result<json> parse_json_text(std::string_view text, std::string_view what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(std::string(what) + ": not valid JSON");
  return j;
}

}  // namespace specontext::planner
