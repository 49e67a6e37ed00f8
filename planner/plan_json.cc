#include "planner/plan_json.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace specontext::planner {

using nlohmann::json;

namespace {

// nlohmann's get<int64_t>() casts a float such as 1e30 without a check (undefined behaviour),
// and get<int32_t>() truncates a large integer. Every integer field is read through these, which
// accept only a JSON integer inside T's range and name the field otherwise.
struct FieldError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename T>
T integer(const json& v, std::string_view field) {
  const bool in_range =
      v.is_number_unsigned()
          ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())
          : v.is_number_integer() && v.get<int64_t>() >= std::numeric_limits<T>::min() &&
                v.get<int64_t>() <= std::numeric_limits<T>::max();
  if (!in_range) {
    throw FieldError("'" + std::string(field) + "' must be an integer in [" +
                     std::to_string(std::numeric_limits<T>::min()) + ", " +
                     std::to_string(std::numeric_limits<T>::max()) + "], got " + v.dump());
  }
  return static_cast<T>(v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>()) : v.get<int64_t>());
}

template <typename T>
T integer_at(const json& j, const char* key) { return integer<T>(j.at(key), key); }

int64_t integer_or(const json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it == j.end() ? fallback : integer<int64_t>(*it, key);
}

std::vector<int64_t> integers_at(const json& j, const char* key) {
  std::vector<int64_t> out;
  for (const json& v : j.at(key)) out.push_back(integer<int64_t>(v, key));
  return out;
}

json tier_id_json(TierId id) { return id.valid() ? json(id.value()) : json(nullptr); }

TierId tier_id_from(const json& j) {
  return j.is_null() ? TierId() : TierId(integer<int32_t>(j, "tier id"));
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
    s.model.layers = integer_at<int64_t>(m, "layers");
    s.model.kv_heads = integer_at<int64_t>(m, "kv_heads");
    s.model.head_dim = integer_at<int64_t>(m, "head_dim");
    s.model.q_heads = integer_at<int64_t>(m, "q_heads");
    s.model.head_kv_heads = integer_or(m, "head_kv_heads", 0);
    s.kv_elem_bytes = integer_at<int64_t>(j, "kv_elem_bytes");
    s.model_bytes = integer_at<int64_t>(j, "model_bytes");
    s.head_bytes = integer_at<int64_t>(j, "head_bytes");
    s.runtime_factor = j.value("runtime_factor", 1.3);
    s.budget = integer_at<int64_t>(j, "budget");
    s.requests = integer_at<int64_t>(j, "requests");
    s.device_bytes = integer_at<int64_t>(j, "device_bytes");
    for (const json& h : j.value("host", json::array())) {
      s.host.push_back({integer_at<int32_t>(h, "numa_node"), integer_at<int64_t>(h, "capacity_bytes"),
                        h.value("device_bandwidth_bps", 0.0)});
    }
    for (const json& r : j.value("remote", json::array())) {
      s.remote.push_back({integer_at<int32_t>(r, "rank"), integer_at<int64_t>(r, "capacity_bytes"),
                          r.value("bandwidth_bps", 0.0)});
    }
    s.host_to_host_bandwidth_bps = j.value("host_to_host_bandwidth_bps", 0.0);
    s.seq_lens = j.contains("seq_lens") ? integers_at(j, "seq_lens") : std::vector<int64_t>{};
    s.filter_shortlist_tokens = integer_or(j, "filter_shortlist_tokens", 0);
    s.retrieval_bytes_per_token = integer_or(j, "retrieval_bytes_per_token", 0);
    s.layer_slack_bytes = integer_or(j, "layer_slack_bytes", 0);
    s.head_cache_slack_bytes = integer_or(j, "head_cache_slack_bytes", 0);
    SPX_RETURN_IF_ERROR(validate_snapshot(s));
    return s;
  } catch (const json::exception& e) {
    return invalid_argument(std::string("planner snapshot json: ") + e.what());
  } catch (const FieldError& e) {
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
    p.requests = integer_at<int64_t>(j, "requests");
    p.budget = integer_at<int64_t>(j, "budget");
    p.kv_elem_bytes = integer_at<int64_t>(j, "kv_elem_bytes");
    p.seq_len = integer_at<int64_t>(j, "seq_len");
    p.total_tokens = integer_at<int64_t>(j, "total_tokens");
    p.thresholds = integers_at(j, "thresholds");
    p.offloaded_layers = integer_at<int64_t>(j, "offloaded_layers");
    p.cpu_filtering = j.at("cpu_filtering").get<bool>();
    p.head_cache_home = tier_id_from(j.at("head_cache").at("home"));
    p.head_cache_bytes = integer_at<int64_t>(j.at("head_cache"), "bytes");
    const json& d = j.at("device");
    p.device.capacity_bytes = integer_at<int64_t>(d, "capacity_bytes");
    p.device.weights_bytes = integer_at<int64_t>(d, "weights_bytes");
    p.device.resident_kv_bytes = integer_at<int64_t>(d, "resident_kv_bytes");
    p.device.retrieval_bytes = integer_at<int64_t>(d, "retrieval_bytes");
    p.device.staging_bytes = integer_at<int64_t>(d, "staging_bytes");
    p.device.total_bytes = integer_at<int64_t>(d, "total_bytes");
    for (const json& t : j.at("tiers")) {
      TierInfo info;
      info.id = tier_id_from(t.at("id"));
      const std::string kind = t.at("kind").get<std::string>();
      if (kind == "device") info.kind = TierKind::kDevice;
      else if (kind == "host") info.kind = TierKind::kHost;
      else if (kind == "remote") info.kind = TierKind::kRemote;
      else return invalid_argument("plan json: tiers[].kind '" + kind + "' is not device, host or remote");
      info.index = integer_at<int32_t>(t, "index");
      info.name = t.at("name").get<std::string>();
      info.capacity_bytes = integer_at<int64_t>(t, "capacity_bytes");
      info.used_bytes = integer_at<int64_t>(t, "used_bytes");
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
      LayerPlacement lp{LayerId(integer_at<int32_t>(l, "layer")), tier_id_from(l.at("home")),
                        integer_at<int64_t>(l, "kv_bytes")};
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
      mg.layer = m.at("layer").is_null() ? LayerId() : LayerId(integer_at<int32_t>(m, "layer"));
      mg.from = tier_id_from(m.at("from"));
      mg.to = tier_id_from(m.at("to"));
      if (!known_tier(mg.from) || !known_tier(mg.to)) {
        return invalid_argument("plan json: a migration names an unknown tier");
      }
      mg.bytes = integer_at<int64_t>(m, "bytes");
      mg.est_seconds = m.at("est_seconds").get<double>();
      mg.reason = m.at("reason").get<std::string>();
      p.migrations.push_back(std::move(mg));
    }
    return p;
  } catch (const json::exception& e) {
    return invalid_argument(std::string("plan json: ") + e.what());
  } catch (const FieldError& e) {
    return invalid_argument(std::string("plan json: ") + e.what());
  }
}

Result<json> parse_json_text(std::string_view text, std::string_view what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(std::string(what) + ": not valid JSON");
  return j;
}

}  // namespace specontext::planner
