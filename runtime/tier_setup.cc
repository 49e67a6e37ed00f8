#include "runtime/tier_setup.h"

#include <algorithm>

#include "core/sparse/candidate_select.h"
#include "cpu/cpu_candidate_filter.h"
#include "cpu/numa.h"
#include "planner/units.h"
#include "transport/local_transport.h"
#include "transport/loopback_transport.h"
#include "transport/transport_router.h"
#if SPECONTEXT_HAVE_UCX
#include "cluster/kv_node_client.h"
#include "cluster/replica_events.h"
#include "cluster/replica_healer.h"
#include "transport/ucx_transport.h"
#endif
#if SPECONTEXT_HAVE_CUDA
#include "gpu/cuda_raii.h"
#include "gpu/cuda_transport.h"
#endif

namespace specontext::runtime {

namespace {

Result<std::vector<int64_t>> sizes(const std::string& text, const std::string& flag) {
  if (text.empty()) return std::vector<int64_t>{};
  auto v = planner::parse_size_list(text);
  if (!v.is_ok()) return v.status().with_context(flag);
  for (int64_t b : *v) {
    if (b <= 0) return invalid_argument(flag + ": sizes must be positive");
  }
  return v;
}

}  // namespace

Result<KvNodeSpec> parse_kv_node_spec(const std::string& flag, const std::string& spec) {
  const std::string named = flag + " " + spec;
  const size_t at = spec.find('@');
  if (at == std::string::npos) return invalid_argument(named + ": expected SIZE@HOST:PORT[+HOST:PORT...]");
  auto size = planner::parse_size(spec.substr(0, at));
  if (!size.is_ok()) return size.status().with_context(named);
  if (*size <= 0) return invalid_argument(named + ": size must be positive");
  KvNodeSpec out;
  out.bytes = static_cast<uint64_t>(*size);
  std::string rest = spec.substr(at + 1);
  while (true) {
    const size_t plus = rest.find('+');
    auto ep = cluster::parse_endpoint(rest.substr(0, plus));
    if (!ep.is_ok()) return ep.status().with_context(named);
    out.endpoints.push_back(*ep);
    if (plus == std::string::npos) break;
    rest = rest.substr(plus + 1);
  }
  return out;
}

Result<std::unique_ptr<TierRuntime>> setup_tiers(const TierArgs& args, const Model& model, const Backend& backend,
                                                 EngineOptions& eopts) {
  SPX_ASSIGN_OR_RETURN(std::vector<int64_t> host, sizes(args.host_kv, "--host-kv"));
  SPX_ASSIGN_OR_RETURN(std::vector<int64_t> remote, sizes(args.remote_kv, "--remote-kv"));
  if (!args.device_kv.empty()) {
    auto d = planner::parse_size(args.device_kv);
    if (!d.is_ok()) return d.status().with_context("--device-kv");
    if (*d <= 0) return invalid_argument("--device-kv must be positive");
    eopts.tiering.device_bytes = static_cast<uint64_t>(*d);
  }
  if (!remote.empty() && !args.kv_nodes.empty()) {
    return invalid_argument("--remote-kv (in-process loopback nodes) and --kv-node cannot be combined");
  }
  eopts.tiering.staging_layers = args.staging_layers;
#if !SPECONTEXT_HAVE_UCX
  if (!args.kv_nodes.empty()) return unimplemented("--kv-node: this build has no UCX (install libucx-dev and rebuild)");
#endif
  if (host.empty() && remote.empty() && args.kv_nodes.empty()) {
    if (!args.device_kv.empty()) {
      return invalid_argument("--device-kv needs --host-kv, --remote-kv or --kv-node to offload to");
    }
    return std::unique_ptr<TierRuntime>();
  }
  auto rt = std::make_unique<TierRuntime>();
  rt->args = args;
  const bool cuda = backend.memory_kind() == MemoryKind::kDevice;
  SPX_ASSIGN_OR_RETURN(const cpu::Topology* topo, cpu::system_topology());
  const int nodes = std::max(1, topo->num_numa_nodes());
  for (size_t i = 0; i < host.size(); ++i) {
    // Pool i on NUMA node i (wrapping when more pools than nodes are asked for): bound there, and
    // touched first there by whoever writes it.
    const int node = static_cast<int>(i) % nodes;
    SPX_ASSIGN_OR_RETURN(cpu::NumaBuffer buf, cpu::NumaBuffer::allocate(static_cast<size_t>(host[i]), node));
    auto owned = std::make_shared<cpu::NumaBuffer>(std::move(buf));
    TierMemory t;
    t.desc.kind = TierKind::kHost;
    t.desc.index = node;
    t.desc.name = "host" + std::to_string(i);
    t.desc.memory = MemoryKind::kHost;
    t.desc.capacity_bytes = static_cast<uint64_t>(host[i]);
    t.base = owned->data();
    t.owner = std::shared_ptr<void>(owned, owned->data());
#if SPECONTEXT_HAVE_CUDA
    if (cuda) {
      // DMA and mapped reads need page-locked memory (this touches every page once). The entry
      // holds the pool too (members destroyed in reverse: unregistered, then freed), so the
      // memory is never freed while registered, whoever drops the engine's reference first.
      struct PinnedPool {
        std::shared_ptr<void> memory;
        gpu::PinnedHostRegistration registration;
      };
      SPX_ASSIGN_OR_RETURN(gpu::PinnedHostRegistration reg,
                           gpu::PinnedHostRegistration::create(t.base, t.desc.capacity_bytes));
      rt->keep_alive.push_back(std::make_shared<PinnedPool>(PinnedPool{t.owner, std::move(reg)}));
      t.desc.memory = MemoryKind::kPinnedHost;
    }
#endif
    eopts.tiering.host.push_back(std::move(t));
  }
  for (size_t i = 0; i < remote.size(); ++i) {
    TierMemory t;
    t.desc.kind = TierKind::kRemote;
    t.desc.index = static_cast<int32_t>(i);
    t.desc.name = "remote" + std::to_string(i);
    t.desc.memory = MemoryKind::kRemote;
    t.desc.capacity_bytes = static_cast<uint64_t>(remote[i]);
    eopts.tiering.remote.push_back(std::move(t));
  }
#if SPECONTEXT_HAVE_UCX
  // KV node tiers: remote tier ids follow the host pools (Engine::create numbers device, host
  // pools, remote tiers in that order), so each transport knows the one tier it serves.
  std::vector<std::unique_ptr<Transport>> node_transports;
  cluster::KvNodeAccess kv_access;
  if (!args.kv_nodes.empty()) {
    SPX_ASSIGN_OR_RETURN(kv_access, cluster::load_kv_node_access(args.kv_secret_file, args.kv_node_tls_ca,
                                                                    args.kv_client_id));
  }
  for (size_t i = 0; i < args.kv_nodes.size(); ++i) {
    const std::string flag = "--kv-node " + args.kv_nodes[i];
    SPX_ASSIGN_OR_RETURN(const KvNodeSpec spec, parse_kv_node_spec("--kv-node", args.kv_nodes[i]));
    transport::UcxRemoteConfig cfg;
    cfg.tier = TierId(static_cast<int32_t>(1 + host.size() + i));
    cfg.op_timeout = std::chrono::milliseconds(args.kv_node_timeout_ms);
    cfg.mode = args.kv_node_mode == "rma" ? transport::UcxTransferMode::kRma : transport::UcxTransferMode::kNodeGather;
    std::vector<cluster::Endpoint> endpoints = spec.endpoints;
    std::vector<std::unique_ptr<cluster::KvNodeClient>> sessions;
    for (const cluster::Endpoint& ep : endpoints) {
      auto client =
          cluster::KvNodeClient::connect(ep, std::chrono::milliseconds(args.kv_node_timeout_ms), kv_access);
      if (!client.is_ok()) return client.status().with_context(flag);
      auto region = (*client)->allocate(spec.bytes);
      if (!region.is_ok()) return region.status().with_context(flag);
      cfg.replicas.push_back(std::move(region).value());
      sessions.push_back(std::move(client).value());
    }
    auto t = transport::UcxRemoteTransport::create(std::move(cfg));
    if (!t.is_ok()) return t.status().with_context(flag);
    rt->kv_node_transports.push_back(t->get());
    rt->kv_node_tier_names.push_back("remote" + std::to_string(i));
    if (args.kv_node_rejoin_ms > 0 && endpoints.size() > 1) {
      if (!rt->healer) {
        cluster::HealerOptions ho;
        ho.retry_interval = std::chrono::milliseconds(args.kv_node_rejoin_ms);
        ho.timeout = std::chrono::milliseconds(args.kv_node_timeout_ms);
        ho.access = kv_access;
        for (const std::string& spare : args.kv_node_spares) {
          auto ep = cluster::parse_endpoint(spare);
          if (!ep.is_ok()) return ep.status().with_context("--kv-node-spare " + spare);
          ho.spares.push_back(*ep);
        }
        rt->healer = std::make_shared<cluster::ReplicaHealer>(ho);
      }
      rt->healer->watch(t->get(), std::move(endpoints), spec.bytes, std::move(sessions));
    } else {
      for (auto& session : sessions)
        rt->node_sessions.push_back(std::shared_ptr<cluster::KvNodeClient>(std::move(session)));
    }
    node_transports.push_back(std::move(t).value());
    TierMemory m;
    m.desc.kind = TierKind::kRemote;
    m.desc.index = static_cast<int32_t>(i);
    m.desc.name = "remote" + std::to_string(i);
    m.desc.memory = MemoryKind::kRemote;
    m.desc.capacity_bytes = spec.bytes;
    eopts.tiering.remote.push_back(std::move(m));
  }
  if (!args.kv_node_spares.empty() && !rt->healer) {
    return invalid_argument(
        "--kv-node-spare: spares serve mirrored tiers (--kv-node SIZE@A+B) with --kv-node-rejoin-ms > 0");
  }
  if (!rt->kv_node_transports.empty()) {
    rt->event_log = std::make_shared<cluster::ReplicaEventLog>();
    // Heal first, so that a rejoin is reported at the step it happened.
    eopts.tiering.between_steps = [runtime = rt.get()] {
      if (runtime->healer) runtime->healer->maintain();
      print_kv_node_events(*runtime);
    };
  }
#endif
  // Members in preference order: the CUDA copy engine for device traffic, memcpy between host
  // pools, the loopback node or the KV nodes for remote tiers.
  std::vector<Transport*> members;
#if SPECONTEXT_HAVE_CUDA
  if (cuda) {
    SPX_ASSIGN_OR_RETURN(auto ct, gpu::CudaTransport::create(0));
    members.push_back(ct.get());
    rt->transports.push_back(std::move(ct));
  }
#endif
  rt->transports.push_back(std::make_unique<transport::LocalTransport>());
  members.push_back(rt->transports.back().get());
  if (!remote.empty()) {
    transport::LoopbackConfig lc;
    lc.latency = std::chrono::microseconds(args.remote_latency_us);
    SPX_ASSIGN_OR_RETURN(auto lb, transport::LoopbackRemoteTransport::create(lc));
    members.push_back(lb.get());
    rt->transports.push_back(std::move(lb));
  }
#if SPECONTEXT_HAVE_UCX
  for (auto& t : node_transports) {
    members.push_back(t.get());
    rt->transports.push_back(std::move(t));
  }
#endif
  SPX_ASSIGN_OR_RETURN(auto router, transport::TransportRouter::create(members));
  rt->router = std::move(router);
  SPX_ASSIGN_OR_RETURN(auto copies, transport::CopyEngine::create(*rt->router));
  rt->copies = std::shared_ptr<transport::CopyEngine>(std::move(copies));
  eopts.tiering.transport = rt->router.get();
  eopts.tiering.copies = rt->copies;
  eopts.tiering.shortlist_tokens = args.shortlist;
  if (eopts.sparse.method == SparseMethod::kSpeContext && eopts.retrieval_head && args.cpu_filter && !cuda) {
    const auto& hc = eopts.retrieval_head->config;
    cpu::CpuCandidateFilterOptions fo;
    fo.filter.page_size = 16;
    fo.filter.n_heads = hc.n_heads;
    fo.filter.n_kv_heads = hc.n_kv_heads;
    fo.filter.head_dim = hc.head_dim;
    fo.numa_node = host.empty() ? 0 : eopts.tiering.host[0].desc.index;
    SPX_ASSIGN_OR_RETURN(auto filter, cpu::CpuCandidateFilter::create(fo));
    eopts.tiering.candidate_filter = std::shared_ptr<CandidateFilter>(std::move(filter));
  }
  (void)model;
  return rt;
}

Status start_tiers(TierRuntime& rt, Engine& engine, const EngineOptions& eopts,
                   const std::vector<int64_t>& final_lengths) {
  const KvStore& kv = engine.memory().kv_store();
  const auto& tiers = kv.tiers();
  const ModelConfig& c = engine.config();
  // ---- bandwidths, over the engine's own (still empty) tiers ----
  if (rt.args.probe) {
    std::vector<transport::ProbePath> paths;
    auto bytes = [&](const TierMemory& a, const TierMemory& b) {
      return std::min<uint64_t>({uint64_t{16} << 20, a.desc.capacity_bytes / 2, b.desc.capacity_bytes / 2});
    };
    const TierMemory& dev = tiers[0];
    for (size_t t = 1; t < tiers.size(); ++t) {
      paths.push_back({tiers[t].desc.name + "->device", tiers[t].desc.id, 0, TierId(0), 0, bytes(tiers[t], dev)});
      paths.push_back({"device->" + tiers[t].desc.name, TierId(0), 0, tiers[t].desc.id, 0, bytes(tiers[t], dev)});
    }
    for (size_t a = 1; a < tiers.size(); ++a) {
      for (size_t b = a + 1; b < tiers.size(); ++b) {
        if (tiers[a].desc.kind == TierKind::kHost && tiers[b].desc.kind == TierKind::kHost) {
          paths.push_back({tiers[a].desc.name + "->" + tiers[b].desc.name, tiers[a].desc.id, 0, tiers[b].desc.id, 0,
                           bytes(tiers[a], tiers[b])});
        }
      }
    }
    transport::ProbeOptions po;
    po.row_bytes = kv.row_bytes();  // one KV head's row of one token
    SPX_ASSIGN_OR_RETURN(rt.probe, transport::probe_bandwidth(*rt.router, paths, po));
  }
  auto measured = [&](TierId src, TierId dst) {
    for (const auto& r : rt.probe) {
      if (r.src == src && r.dst == dst) return r.contiguous_bps;
    }
    return 0.0;
  };

  // ---- the planner's view of this engine ----
  planner::PolicyConfig pc;
  SPX_ASSIGN_OR_RETURN(pc.base.model, planner::shape_from_config(c));
  pc.base.kv_elem_bytes = static_cast<int64_t>(dtype_size(kv.dtype()));
  // The device tier is the KV region alone (weights live outside it), so no weight reserve.
  pc.base.model_bytes = 0;
  pc.base.head_bytes = 0;
  pc.base.runtime_factor = 1.0;
  pc.base.budget = eopts.sparse.method == SparseMethod::kDense ? 1 : eopts.sparse.selection.budget;
  pc.base.requests = eopts.running_slots();
  for (const TierMemory& t : tiers) {
    if (t.desc.kind == TierKind::kHost) {
      pc.base.host.push_back({t.desc.index, static_cast<int64_t>(t.desc.capacity_bytes), measured(t.desc.id, TierId(0))});
    } else if (t.desc.kind == TierKind::kRemote) {
      pc.base.remote.push_back({t.desc.index, static_cast<int64_t>(t.desc.capacity_bytes), measured(t.desc.id, TierId(0))});
    }
  }
  if (pc.base.host.size() > 1) pc.base.host_to_host_bandwidth_bps = measured(TierId(1), TierId(2));
  if (eopts.sparse.method == SparseMethod::kSpeContext && eopts.retrieval_head) {
    const auto& hc = eopts.retrieval_head->config;
    // K only, in the KV dtype (KvMemory::head_row_bytes), no repeat_kv.
    pc.base.retrieval_bytes_per_token = hc.n_kv_heads * hc.head_dim * static_cast<int64_t>(dtype_size(eopts.kv_dtype));
    // Engine::head_block_bytes: the head's keys live in blocks of `budget` tokens per sequence.
    pc.head_block_bytes = static_cast<uint64_t>(pc.base.retrieval_bytes_per_token * eopts.sparse.selection.budget);
  } else {
    pc.base.retrieval_bytes_per_token = 1;  // no retrieval head: (almost) nothing per token
  }
  pc.base.filter_shortlist_tokens = rt.args.shortlist;
  pc.allow_cpu_filtering = rt.args.cpu_filter && eopts.tiering.candidate_filter != nullptr;
  pc.page_size = kv.page_size();
  pc.chunk_bytes = kv.chunk_bytes();
  SPX_ASSIGN_OR_RETURN(auto policy, planner::PlannerPolicy::create(pc));
  rt.policy = std::shared_ptr<planner::PlannerPolicy>(std::move(policy));
  if (rt.args.placement == "dynamic") return engine.set_placement_policy(rt.policy);

  // Static: the plan for the lengths the run will reach, applied once, never revisited.
  PlacementInput in = engine.placement_input(final_lengths);
  in.device_other_bytes += final_lengths.size() * engine.new_sequence_reserve();
  SPX_ASSIGN_OR_RETURN(PlacementDecision d, rt.policy->decide(in));
  const planner::Plan& plan = *rt.policy->last_plan();
  rt.placement_note = "static plan for " + std::to_string(final_lengths.size()) + " sequences at S = " +
                      std::to_string(plan.seq_len) + ": " + std::to_string(plan.offloaded_layers) + " of " +
                      std::to_string(c.n_layers) + " layers offloaded";
  std::vector<std::string> reasons = d.reasons;
  reasons.push_back(rt.placement_note);
  return engine.apply_placement(d.placement, reasons);
}

void print_kv_node_events(TierRuntime& rt) {
#if SPECONTEXT_HAVE_UCX
  if (!rt.print_events || rt.event_log == nullptr) return;
  std::vector<cluster::TierReplicas> now;
  for (size_t i = 0; i < rt.kv_node_transports.size(); ++i) {
    const auto& ucx = static_cast<const transport::UcxRemoteTransport&>(*rt.kv_node_transports[i]);
    now.push_back({ucx.tier().value(), rt.kv_node_tier_names[i], ucx.replicas()});
  }
  for (const std::string& line : rt.event_log->update(now)) std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
#else
  (void)rt;
#endif
}

nlohmann::json tiers_json(const Engine& engine, const TierRuntime* rt) {
  nlohmann::json tiers = nlohmann::json::array();
  auto traffic = [](const TierTraffic& t) {
    return nlohmann::json{{"bytes_in", t.bytes_in}, {"bytes_out", t.bytes_out}, {"tokens_loaded", t.tokens_loaded},
                          {"tokens_hit", t.tokens_hit}};
  };
  for (const TierReport& r : engine.tier_report()) {
    tiers.push_back({{"id", r.desc.id.value()},
                     {"name", r.desc.name},
                     {"kind", std::string(tier_kind_name(r.desc.kind))},
                     {"memory", std::string(memory_kind_name(r.desc.memory))},
                     {"capacity_bytes", r.desc.capacity_bytes},
                     {"used_bytes", r.used_bytes},
                     {"peak_used_bytes", r.peak_used_bytes},
                     {"kv_bytes", r.kv_bytes},
                     {"layers", r.layers},
                     {"last_step", traffic(r.last_step)},
                     {"total", traffic(r.total)}});
  }
  const OverlapStats& o = engine.overlap_stats();
  nlohmann::json events = nlohmann::json::array();
  for (const PlacementEvent& e : engine.placement_events()) {
    events.push_back({{"forward", e.forward},
                      {"seq_lens", e.seq_lens},
                      {"reasons", e.reasons},
                      {"layers_moved", e.layers_moved},
                      {"bytes_moved", e.bytes_moved},
                      {"seconds", e.seconds},
                      {"cpu_filtering", e.cpu_filtering},
                      {"error", e.error}});
  }
  std::vector<int> homes;
  for (TierId t : engine.memory().placement().layer_home) homes.push_back(t.value());
  nlohmann::json j = {
      {"tiers", tiers},
      {"layer_homes", homes},
      {"cpu_filtering", engine.memory().placement().cpu_filtering},
      {"filtered_steps", engine.filtered_steps()},
      {"staging_peak_bytes", engine.peak_staging_bytes()},
      {"overlap",
       {{"steps", o.steps},
        {"step_seconds", o.step_seconds},
        {"compute_seconds", o.compute_seconds()},
        {"copy_busy_seconds", o.copy_busy_seconds},
        {"exposed_wait_seconds", o.wait_seconds},
        {"serial_estimate_seconds", o.serial_seconds()},
        {"hidden_fraction", o.hidden_fraction()}}},
      {"placement_events", events},
  };
  std::vector<int> abandoned;
  for (TierId t : engine.abandoned_tiers()) abandoned.push_back(t.value());
  j["lost_tiers"] = abandoned;
  if (rt != nullptr) {
    j["placement"] = rt->args.placement;
    j["probe"] = transport::probe_results_to_json(rt->probe);
    if (!rt->placement_note.empty()) j["static_plan"] = rt->placement_note;
#if SPECONTEXT_HAVE_UCX
    nlohmann::json nodes = nlohmann::json::array();
    for (Transport* t : rt->kv_node_transports) {
      const auto& ucx = static_cast<const transport::UcxRemoteTransport&>(*t);
      nlohmann::json replicas = nlohmann::json::array();
      for (const transport::ReplicaReport& r : ucx.replicas()) {
        replicas.push_back({{"node", r.node},
                            {"alive", r.alive},
                            {"error", r.error},
                            {"bytes_read", r.bytes_read},
                            {"bytes_written", r.bytes_written},
                            {"rejoins", r.rejoins},
                            {"bytes_resynced", r.bytes_resynced}});
      }
      nlohmann::json healing = nlohmann::json::array();
      for (const cluster::HealerEvent& e :
           rt->healer ? rt->healer->events() : std::vector<cluster::HealerEvent>{}) {
        if (e.tier != ucx.tier().value()) continue;
        healing.push_back(
            {{"replica", e.replica}, {"node", e.node}, {"rejoined", e.rejoined}, {"error", e.message}, {"attempts", e.attempts}});
      }
      const auto counts = ucx.counts();
      nodes.push_back({{"tier", ucx.tier().value()},
                       {"mode", rt->args.kv_node_mode},
                       {"replicas", replicas},
                       {"failovers", ucx.failovers()},
                       {"rejoin_events", healing},
                       {"requests", counts.requests},
                       {"rma_operations", counts.operations}});
    }
    if (!nodes.empty()) j["kv_nodes"] = nodes;
#endif
  }
  return j;
}

}  // namespace specontext::runtime
