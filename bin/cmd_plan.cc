// `specontext plan`: the memory model's threshold table (Algorithm 2) and the tier placement at a
// given length, from a model shape and tier sizes. Computes only; allocates no KV and, for
// --synthetic, builds no weights (M_O comes from the config's parameter count).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bin/commands.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "planner/plan.h"
#include "planner/plan_json.h"
#include "planner/units.h"

namespace specontext::cli {

namespace {

using planner::format_bytes;

struct ModelBytes {
  ModelConfig config;
  std::string name;
  int64_t params = 0;
  int64_t model_bytes = 0;       // M_O
  int64_t weight_elem_bytes = 0; // bytes per parameter, for the text
  int64_t head_params = 0;
  int64_t head_bytes = 0;        // M_D
};

Result<ModelBytes> model_bytes_from_args(const PlanArgs& args) {
  ModelBytes mb;
  if (!args.model.synthetic.empty()) {
    // synthetic_config only: building llama-3.1-8b's random weights would take 30 GB.
    SPX_ASSIGN_OR_RETURN(mb.config, synthetic_config(args.model.synthetic));
    if (args.model.layers > 0) mb.config.n_layers = args.model.layers;
    mb.name = args.model.synthetic + " (synthetic)";
    mb.params = planner::model_parameter_count(mb.config);
    mb.weight_elem_bytes = args.model.dtype == "f32" ? 4 : 2;
    mb.model_bytes = mb.params * mb.weight_elem_bytes;
  } else {
    // The model as stored: --dtype (default bf16 here) sizes synthetic models only.
    SPX_ASSIGN_OR_RETURN(std::shared_ptr<Model> model, load_model(args.model.model_path));
    mb.config = model->config;
    mb.name = args.model.model_path;
    mb.params = model->parameter_count();
    const size_t elem = dtype_size(model->weight_dtype);
    // Q8_0 stores 32 weights in 34 bytes; other dtypes have a fixed element size.
    mb.weight_elem_bytes = elem > 0 ? static_cast<int64_t>(elem) : 1;
    mb.model_bytes = elem > 0 ? mb.params * static_cast<int64_t>(elem) : mb.params / 32 * 34;
  }
  mb.head_params = planner::retrieval_head_parameter_count(mb.config);
  // The retrieval head runs in the weights' float dtype; a quantised target still gets a bf16 head.
  const int64_t head_elem = mb.weight_elem_bytes >= 2 ? mb.weight_elem_bytes : 2;
  mb.head_bytes = mb.head_params * head_elem;
  if (!args.head_size.empty()) {
    SPX_ASSIGN_OR_RETURN(mb.head_bytes, planner::parse_size(args.head_size));
  }
  return mb;
}

Result<std::vector<double>> bandwidths(const std::string& text, size_t count, std::string_view flag) {
  if (text.empty()) return std::vector<double>(count, 0.0);
  SPX_ASSIGN_OR_RETURN(std::vector<double> gbps, planner::parse_number_list(text));
  if (gbps.size() == 1) gbps.assign(count, gbps[0]);
  if (gbps.size() != count) {
    return invalid_argument(std::string(flag) + " has " + std::to_string(gbps.size()) + " values for " +
                            std::to_string(count) + " pools");
  }
  for (double& v : gbps) v *= 1e9;  // GB/s → bytes/s
  return gbps;
}

Result<planner::PlannerSnapshot> snapshot_from_args(const PlanArgs& args, const ModelBytes& mb) {
  planner::PlannerSnapshot s;
  SPX_ASSIGN_OR_RETURN(s.model, planner::shape_from_config(mb.config));
  s.kv_elem_bytes = args.kv_dtype == "f32" ? 4 : 2;
  s.model_bytes = mb.model_bytes;
  s.head_bytes = mb.head_bytes;
  s.runtime_factor = args.runtime_factor;
  s.budget = args.budget;
  s.requests = args.requests;
  s.filter_shortlist_tokens = args.shortlist;
  auto device = planner::parse_size(args.hbm);
  if (!device.is_ok()) return device.status().with_context("--hbm");
  s.device_bytes = *device;
  auto host_sizes = planner::parse_size_list(args.host);
  if (!host_sizes.is_ok()) return host_sizes.status().with_context("--host");
  const std::vector<int64_t>& host = *host_sizes;
  SPX_ASSIGN_OR_RETURN(std::vector<double> host_bw, bandwidths(args.host_bw, host.size(), "--host-bw"));
  for (size_t i = 0; i < host.size(); ++i) {
    s.host.push_back({static_cast<int32_t>(i), host[i], host_bw[i]});
  }
  if (!args.remote.empty()) {
    auto remote_sizes = planner::parse_size_list(args.remote);
    if (!remote_sizes.is_ok()) return remote_sizes.status().with_context("--remote");
    const std::vector<int64_t>& remote = *remote_sizes;
    SPX_ASSIGN_OR_RETURN(std::vector<double> remote_bw, bandwidths(args.remote_bw, remote.size(), "--remote-bw"));
    for (size_t i = 0; i < remote.size(); ++i) {
      s.remote.push_back({static_cast<int32_t>(i), remote[i], remote_bw[i]});
    }
  }
  s.host_to_host_bandwidth_bps = args.host_to_host_bw * 1e9;
  if (args.seq >= 0) s.seq_lens.assign(static_cast<size_t>(std::max<int64_t>(args.requests, 0)), args.seq);
  SPX_RETURN_IF_ERROR(planner::validate_snapshot(s));
  return s;
}

void print_placement(const planner::Plan& p) {
  const int64_t L = static_cast<int64_t>(p.layers.size());
  std::printf("\nplacement at S = %lld (%lld requests): %lld of %lld layers offloaded", static_cast<long long>(p.seq_len),
              static_cast<long long>(p.requests), static_cast<long long>(p.offloaded_layers), static_cast<long long>(L));
  if (p.offloaded_layers > 0) {
    std::printf(" (layers %lld-%lld)", static_cast<long long>(L - p.offloaded_layers), static_cast<long long>(L - 1));
  }
  std::printf(", CPU filtering %s\n", p.cpu_filtering ? "ON" : "off");
  if (p.cpu_filtering) {
    std::printf("  S >= S^T_%lld = %lld: even with every layer offloaded the device cannot hold the retrieval\n"
                "  head's K cache; it lives on %s and CPU workers shortlist candidates for the head.\n",
                static_cast<long long>(L), static_cast<long long>(p.thresholds.back()),
                p.tiers[static_cast<size_t>(p.head_cache_home.value())].name.c_str());
  }
  std::printf("  %-14s %-10s %s\n", "layers", "home", "KV per layer");
  for (int64_t a = 0; a < L;) {
    int64_t b = a;
    while (b + 1 < L && p.layers[static_cast<size_t>(b + 1)].home == p.layers[static_cast<size_t>(a)].home) ++b;
    const std::string range = a == b ? std::to_string(a) : std::to_string(a) + "-" + std::to_string(b);
    std::printf("  %-14s %-10s %s\n", range.c_str(),
                p.tiers[static_cast<size_t>(p.layers[static_cast<size_t>(a)].home.value())].name.c_str(),
                format_bytes(p.layers[static_cast<size_t>(a)].kv_bytes).c_str());
    a = b + 1;
  }
  const planner::DeviceUsage& d = p.device;
  std::printf("\ndevice use         %s of %s\n", format_bytes(d.total_bytes).c_str(), format_bytes(d.capacity_bytes).c_str());
  std::printf("  weights+runtime  %s\n", format_bytes(d.weights_bytes).c_str());
  std::printf("  resident KV      %s\n", format_bytes(d.resident_kv_bytes).c_str());
  std::printf("  head+expansion   %s%s\n", format_bytes(d.retrieval_bytes).c_str(),
              p.cpu_filtering ? " (shortlist)" : "");
  std::printf("  staging          %s (%lld layers x %lld requests x B = %lld tokens)\n",
              format_bytes(d.staging_bytes).c_str(), static_cast<long long>(p.offloaded_layers),
              static_cast<long long>(p.requests), static_cast<long long>(p.budget));
  for (const planner::TierInfo& t : p.tiers) {
    if (t.kind == planner::TierKind::kDevice) continue;
    std::printf("%-18s %s of %s\n", t.name.c_str(), format_bytes(t.used_bytes).c_str(),
                format_bytes(t.capacity_bytes).c_str());
  }
}

}  // namespace

void register_plan(CLI::App& app, PlanArgs& args) {
  auto* cmd = app.add_subcommand(
      "plan", "memory model: threshold table S^T_i (paper Algorithm 2) and tier placement at a length");
  args.model.dtype = "bf16";  // weights are served in bf16 unless told otherwise
  add_model_options(*cmd, args.model);
  cmd->add_option("--hbm", args.hbm, "device memory, e.g. 80GiB (G/GiB = 2^30, GB = 10^9)")->required();
  cmd->add_option("--host", args.host, "host memory per NUMA node: SIZE[,SIZE...]")->required();
  cmd->add_option("--remote", args.remote, "remote KV node capacity: SIZE[,SIZE...]");
  cmd->add_option("--host-bw", args.host_bw, "measured host->device GB/s per NUMA node (one value = all)");
  cmd->add_option("--remote-bw", args.remote_bw, "measured remote GB/s per remote node (one value = all)");
  cmd->add_option("--host-host-bw", args.host_to_host_bw, "measured GB/s across NUMA nodes");
  cmd->add_option("--requests,-r", args.requests, "R: concurrent requests")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--budget,-b", args.budget, "B: KV retrieval budget (tokens)")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--seq,-s", args.seq, "S: sequence length to place (all requests)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--kv-dtype", args.kv_dtype, "KV cache dtype")->check(CLI::IsMember({"bf16", "f16", "f32"}));
  cmd->add_option("--head-size", args.head_size, "override M_D, the retrieval head's bytes (default: "
                                                "EAGLE-3 head q/k/fc/norms x weight dtype)");
  cmd->add_option("--runtime-factor", args.runtime_factor, "activation overhead factor on weights (paper: 1.3)");
  cmd->add_option("--filter-shortlist", args.shortlist, "tokens per request on the device when CPU filtering (default 4*B)");
  cmd->add_flag("--json", args.json, "print one JSON object");
}

int run_plan(const PlanArgs& args) {
  auto mb = model_bytes_from_args(args);
  if (!mb.is_ok()) {
    std::fprintf(stderr, "error: %s\n", mb.status().to_string().c_str());
    return 1;
  }
  auto snap = snapshot_from_args(args, *mb);
  if (!snap.is_ok()) {
    std::fprintf(stderr, "error: %s\n", snap.status().to_string().c_str());
    return 1;
  }
  auto th = planner::thresholds(*snap);
  if (!th.is_ok()) {
    std::fprintf(stderr, "error: %s\n", th.status().to_string().c_str());
    return 1;
  }
  Result<planner::Plan> placed = invalid_argument("no --seq");
  if (args.seq >= 0) placed = planner::plan(*snap);

  if (args.json) {
    nlohmann::json j = {
        {"model", {{"name", mb->name}, {"parameters", mb->params}, {"model_bytes", mb->model_bytes},
                   {"head_parameters", mb->head_params}, {"head_bytes", mb->head_bytes}}},
        {"snapshot", planner::snapshot_to_json(*snap)},
        {"thresholds", *th},
    };
    if (args.seq >= 0) {
      if (placed.is_ok()) {
        j["plan"] = planner::plan_to_json(*placed);
      } else {
        j["error"] = {{"code", std::string(status_code_name(placed.status().code()))},
                      {"message", placed.status().message()}};
      }
    }
    // replace: a model path need not be UTF-8, and dump() would throw on it.
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    const planner::PlannerSnapshot& s = *snap;
    const planner::ModelShape& m = s.model;
    std::printf("model              %s: L = %lld, H = %lld KV heads, D = %lld, %lld q heads (alpha = %lld)\n",
                mb->name.c_str(), static_cast<long long>(m.layers), static_cast<long long>(m.kv_heads),
                static_cast<long long>(m.head_dim), static_cast<long long>(m.q_heads),
                static_cast<long long>(m.alpha()));
    std::printf("M_O                %lld B (%.2f GB, %s; %lld params x %lld B)\n",
                static_cast<long long>(s.model_bytes), static_cast<double>(s.model_bytes) / 1e9,
                format_bytes(s.model_bytes).c_str(), static_cast<long long>(mb->params),
                static_cast<long long>(mb->weight_elem_bytes));
    std::printf("M_D                %lld B (%s; retrieval head, %lld params)\n", static_cast<long long>(s.head_bytes),
                format_bytes(s.head_bytes).c_str(), static_cast<long long>(mb->head_params));
    std::printf("KV                 %s (kvc = %lld B), R = %lld, B = %lld\n", args.kv_dtype.c_str(),
                static_cast<long long>(2 * s.kv_elem_bytes), static_cast<long long>(s.requests),
                static_cast<long long>(s.budget));
    std::printf("device             %s (%lld B)\n", format_bytes(s.device_bytes).c_str(),
                static_cast<long long>(s.device_bytes));
    for (const auto& h : s.host) {
      std::printf("host%-14d %s", h.numa_node, format_bytes(h.capacity_bytes).c_str());
      if (h.device_bandwidth_bps > 0) std::printf(", %.1f GB/s to the device", h.device_bandwidth_bps / 1e9);
      std::printf("\n");
    }
    for (const auto& r : s.remote) {
      std::printf("remote%-12d %s", r.rank, format_bytes(r.capacity_bytes).c_str());
      if (r.bandwidth_bps > 0) std::printf(", %.1f GB/s", r.bandwidth_bps / 1e9);
      std::printf("\n");
    }
    std::printf("\nthresholds (Algorithm 2, factor-4 fix): i layers offloaded fit while S < S^T_i\n");
    std::printf("  %4s %10s\n", "i", "S^T_i");
    const int64_t active = args.seq >= 0 ? planner::layers_to_offload(*th, args.seq) : -1;
    for (size_t i = 0; i < th->size(); ++i) {
      std::printf("  %4zu %10lld", i, static_cast<long long>((*th)[i]));
      if (static_cast<int64_t>(i) == active) {
        std::printf("   <- S = %lld < S^T_%zu: %zu layers offloaded", static_cast<long long>(args.seq), i, i);
      }
      std::printf("\n");
    }
    if (args.seq >= 0 && placed.is_ok()) print_placement(*placed);
  }
  if (args.seq >= 0 && !placed.is_ok()) {
    std::fprintf(stderr, "error: %s\n", placed.status().to_string().c_str());
    return 1;
  }
  return 0;
}

}  // namespace specontext::cli
