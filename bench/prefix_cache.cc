// Prefix caching through the OpenAI-compatible server, measured side by side in one run: C
// conversations of T turns each, every turn resending the whole history (a shared system prompt,
// then each earlier turn's user tokens and the model's answer) plus new user tokens, as chat
// clients and agent loops do. The same conversations run against a server with prefix caching
// off, one with it on, and one that also offloads evicted prefixes to host memory (which matters
// when there are more conversations than sequence slots: --conversations 8 --max-batch 4), and with
// --disk SIZE a fourth that offloads them to disk only, and with --remote SIZE a fifth that puts
// them in a KV node's memory instead (an in-process `kv-node` over UCX on loopback TCP); per turn: time to
// first token (p50 over conversations); per mode: wall time, prompt tokens computed and taken from the cache.
// JSON (and --plot: PNG via plot_prefix_cache.py).
//
//   build/cpu/bench/bench_prefix_cache --out bench_out/prefix_cache.json --plot  (synthetic llama-3.2-1b, 4
//   layers) build/cpu/bench/bench_prefix_cache --conversations 8 --max-batch 4 --out
//   bench_out/prefix_offload.json --plot
//   ... --disk 1GiB --remote 1GiB: the same with the fourth and fifth modes
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <optional>
#include <sstream>
#include <thread>

#include "bench/lib/report.h"
#include "bench/lib/serve_setup.h"
#include "bench/lib/sse_client.h"
#include "planner/units.h"
#include "runtime/engine_setup.h"
#include "serving/openai/openai_server.h"
#if SPECONTEXT_HAVE_UCX
#include "cluster/kv_node.h"
#include "cluster/remote_prefix_store.h"
#endif

using namespace specontext;
using Clock = std::chrono::steady_clock;
namespace asio = boost::asio;

namespace {

struct Shape {
  int64_t conversations = 4;
  int64_t turns = 6;
  int64_t system_tokens = 256;
  int64_t user_tokens = 32;
  int64_t max_tokens = 16;
  int64_t max_batch = 4;
};

// The answer's token ids, read back from a synthetic tokenizer's text (" id id ..."). With a real
// model's tokenizer the text holds no ids and the answers stay out of the history: the turns then
// resend only the system prompt and the user tokens.
std::vector<int32_t> ids_of(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  for (int64_t v; in >> v;) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

struct ModeResult {
  nlohmann::json json;
  double wall_s = 0;
  double ttft_sum_s = 0;
};

// offload_bytes > 0: prefix caching on, evicted prefixes kept in that much host memory; disk_bytes
// > 0: and on disk (prefix files in the system's temporary directory), or in `store`.
Result<ModeResult> run_mode(runtime::EngineArgs args, const runtime::LoadedModel& loaded, const Shape& shape,
                            bool caching, uint64_t offload_bytes, uint64_t disk_bytes = 0,
                            std::shared_ptr<PrefixBlobStore> store = nullptr) {
  const char* mode = !caching            ? "off"
                     : store             ? "on + remote"
                     : disk_bytes > 0    ? "on + disk"
                     : offload_bytes > 0 ? "on + offload"
                                         : "on";
  args.prefix_caching = caching;
  const int64_t context =
      std::min<int64_t>(loaded.model->config.max_seq_len,
                        shape.system_tokens + shape.turns * (shape.user_tokens + shape.max_tokens) + 8);
  SPX_ASSIGN_OR_RETURN(runtime::EngineBundle bundle,
                       runtime::build_engine(args, loaded, shape.max_batch, context,
                                         std::vector<int64_t>(static_cast<size_t>(shape.max_batch), context),
                                         /*quiet=*/true));
  cluster::ServerOptions so;
  so.model_name = "bench";
  so.max_waiting = 4096;
  so.scheduling.prefill_chunk = args.prefill_chunk;
  so.scheduling.prefix_caching = caching;
  so.scheduling.prefix_offload_bytes = offload_bytes;
  so.scheduling.prefix_disk_bytes = disk_bytes;
  so.scheduling.prefix_blob_store = store;
  SPX_ASSIGN_OR_RETURN(std::unique_ptr<cluster::OpenAiServer> server,
                       cluster::OpenAiServer::start(*bundle.engine, *loaded.tokenizer, so));
  const uint16_t port = server->port();

  // The same token streams in both modes: seeded per conversation.
  const auto vocab = static_cast<int32_t>(loaded.model->config.vocab_size);
  std::vector<int32_t> system(static_cast<size_t>(shape.system_tokens));
  {
    std::mt19937 rng(1);
    for (auto& t : system) t = 3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 3));
  }
  const auto n_conv = static_cast<size_t>(shape.conversations), n_turns = static_cast<size_t>(shape.turns);
  std::vector<std::vector<bench::RequestTiming>> timings(n_conv);
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (size_t c = 0; c < n_conv; ++c) {
    clients.emplace_back([&, c] {
      std::mt19937 rng(static_cast<uint32_t>(100 + c));
      asio::io_context ioc;
      asio::ip::tcp::socket s(ioc);
      boost::system::error_code ec;
      s.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
      if (ec) return;
      std::vector<int32_t> history = system;
      for (size_t t = 0; t < n_turns; ++t) {
        for (int64_t u = 0; u < shape.user_tokens; ++u) {
          history.push_back(3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab - 3)));
        }
        const std::string body =
            nlohmann::json{{"prompt", history}, {"max_tokens", shape.max_tokens},
                           {"temperature", 0},  {"ignore_eos", true},
                           {"stream", true},    {"stream_options", {{"include_usage", true}}}}
                .dump();
        bench::RequestTiming r = bench::stream_completion(s, body);
        const std::vector<int32_t> answer = ids_of(r.text);
        timings[c].push_back(std::move(r));
        history.insert(history.end(), answer.begin(), answer.end());
      }
    });
  }
  for (auto& t : clients) t.join();
  ModeResult out;
  out.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  nlohmann::json turns = nlohmann::json::array();
  int64_t failed = 0, cached = 0;
  for (size_t t = 0; t < n_turns; ++t) {
    std::vector<double> ttft;
    int64_t turn_cached = 0;
    for (size_t c = 0; c < n_conv; ++c) {
      if (t >= timings[c].size() || !timings[c][t].ok) {
        ++failed;
        continue;
      }
      ttft.push_back(timings[c][t].ttft_s);
      out.ttft_sum_s += timings[c][t].ttft_s;
      turn_cached += timings[c][t].cached_tokens;
    }
    cached += turn_cached;
    turns.push_back(
        {{"turn", t + 1},
         {"prompt_tokens", shape.system_tokens + static_cast<int64_t>(t + 1) * shape.user_tokens +
                               static_cast<int64_t>(t) * shape.max_tokens},
         {"ttft_p50_ms", 1e3 * bench::percentile(ttft, 0.5)},
         {"ttft_max_ms", 1e3 * bench::percentile(ttft, 1.0)},
         {"cached_tokens_mean", ttft.empty() ? 0.0 : static_cast<double>(turn_cached) / ttft.size()}});
  }
  server->stop();
  const cluster::ServerCounters counters = server->counters();
  out.json = {{"mode", mode},
              {"prefix_caching", caching},
              {"prefix_offload_bytes", offload_bytes},
              {"prefix_offloads", counters.prefix_offloads},
              {"prefix_restores", counters.prefix_restores},
              {"prefix_disk_bytes", disk_bytes},
              {"prefix_disk_writes", counters.prefix_disk_writes},
              {"prefix_disk_restores", counters.prefix_disk_restores},
              {"prefix_disk_errors", counters.prefix_disk_errors},
              {"wall_s", out.wall_s},
              {"failed", failed},
              {"prompt_tokens_computed", counters.prompt_tokens},
              {"prompt_tokens_cached", counters.cached_prompt_tokens},
              {"cached_tokens_in_usage", cached},
              {"prefix_cache_evictions", counters.prefix_cache_evictions},
              {"max_batch_sequences", counters.max_batch_sequences},
              {"turns", turns}};
  std::fprintf(stderr,
               "prefix caching %s: %.2f s, %lld prompt tokens computed, %lld cached (%lld evictions, %lld "
               "offloaded, %lld restored, %lld from disk), %lld failed\n",
               mode, out.wall_s, static_cast<long long>(counters.prompt_tokens),
               static_cast<long long>(counters.cached_prompt_tokens),
               static_cast<long long>(counters.prefix_cache_evictions),
               static_cast<long long>(counters.prefix_offloads),
               static_cast<long long>(counters.prefix_restores),
               static_cast<long long>(counters.prefix_disk_restores), static_cast<long long>(failed));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"prefix caching through the OpenAI-compatible server: multi-turn conversations, off vs on vs on with offload"};
  runtime::EngineArgs args;
  args.admission = "preempt";
  bench::add_served_model_options(app, args);
  Shape shape;
  std::string out = "bench_out/prefix_cache.json";
  bool plot = false;
  app.add_option("--conversations", shape.conversations, "conversations running at once (one client each)");
  app.add_option("--turns", shape.turns, "turns per conversation");
  app.add_option("--system-len", shape.system_tokens, "system prompt tokens shared by every conversation");
  app.add_option("--user-len", shape.user_tokens, "new user tokens per turn");
  app.add_option("--max-tokens", shape.max_tokens, "answer tokens per turn");
  app.add_option("--max-batch", shape.max_batch, "server sequence slots");
  std::string offload = "1GiB";
  app.add_option("--offload", offload, "host memory for offloaded prefixes in the third mode (SIZE)")
      ->capture_default_str();
  std::string disk = "0";
  app.add_option("--disk", disk,
                 "a fourth mode, when not 0: no host memory for offloaded prefixes, this much disk (SIZE) instead")
      ->capture_default_str();
  std::string remote = "0";
  app.add_option(
         "--remote", remote,
         "a fifth mode, when not 0: no host memory for offloaded prefixes, this much of an in-process "
         "KV node's memory (SIZE) instead")
      ->capture_default_str();
  bench::add_report_options(app, out, plot);
  CLI11_PARSE(app, argc, argv);
  const auto fail = bench::report_failure;
  auto loaded = bench::load_served_model(args);
  if (!loaded.is_ok()) return fail(loaded.status());
  auto offload_bytes = planner::parse_size(offload);
  if (!offload_bytes.is_ok() || *offload_bytes <= 0) return fail(invalid_argument("--offload: " + offload));
  auto disk_bytes = planner::parse_size(disk);
  if (!disk_bytes.is_ok() || *disk_bytes < 0) return fail(invalid_argument("--disk: " + disk));
  auto off = run_mode(args, *loaded, shape, false, 0);
  if (!off.is_ok()) return fail(off.status());
  auto on = run_mode(args, *loaded, shape, true, 0);
  if (!on.is_ok()) return fail(on.status());
  auto offloaded = run_mode(args, *loaded, shape, true, static_cast<uint64_t>(*offload_bytes));
  if (!offloaded.is_ok()) return fail(offloaded.status());
  std::optional<ModeResult> on_disk;
  if (*disk_bytes > 0) {
    auto r = run_mode(args, *loaded, shape, true, 0, static_cast<uint64_t>(*disk_bytes));
    if (!r.is_ok()) return fail(r.status());
    on_disk = std::move(*r);
  }
  auto remote_bytes = planner::parse_size(remote);
  if (!remote_bytes.is_ok() || *remote_bytes < 0) return fail(invalid_argument("--remote: " + remote));
  std::optional<ModeResult> on_remote;
  if (*remote_bytes > 0) {
#if SPECONTEXT_HAVE_UCX
    cluster::KvNodeOptions no;
    no.capacity = static_cast<uint64_t>(*remote_bytes);
    auto node = cluster::KvNode::start(no);
    if (!node.is_ok()) return fail(node.status());
    cluster::RemotePrefixStoreOptions ro;
    ro.replicas = {cluster::Endpoint{"127.0.0.1", (*node)->port()}};
    ro.bytes = static_cast<uint64_t>(*remote_bytes);
    auto store = cluster::RemotePrefixStore::create(ro);
    if (!store.is_ok()) return fail(store.status());
    auto r = run_mode(args, *loaded, shape, true, 0, ro.bytes, std::move(store).value());
    if (!r.is_ok()) return fail(r.status());
    on_remote = std::move(*r);
#else
    return fail(unimplemented("--remote: this build has no UCX"));
#endif
  }
  nlohmann::json doc = {
      {"model", bench::served_model_name(args)},
      {"layers", loaded->model->config.n_layers},
      {"conversations", shape.conversations},
      {"turns", shape.turns},
      {"system_tokens", shape.system_tokens},
      {"user_tokens", shape.user_tokens},
      {"max_tokens", shape.max_tokens},
      {"max_batch", shape.max_batch},
      {"threads", std::thread::hardware_concurrency()},
      {"wall_ratio_off_over_on", on->wall_s > 0 ? off->wall_s / on->wall_s : 0.0},
      {"ttft_ratio_off_over_on", on->ttft_sum_s > 0 ? off->ttft_sum_s / on->ttft_sum_s : 0.0},
      {"wall_ratio_on_over_offload", offloaded->wall_s > 0 ? on->wall_s / offloaded->wall_s : 0.0},
      {"ttft_ratio_on_over_offload", offloaded->ttft_sum_s > 0 ? on->ttft_sum_s / offloaded->ttft_sum_s : 0.0},
      {"modes", {off->json, on->json, offloaded->json}}};
  if (on_disk) {
    doc["wall_ratio_on_over_disk"] = on_disk->wall_s > 0 ? on->wall_s / on_disk->wall_s : 0.0;
    doc["wall_ratio_disk_over_offload"] = offloaded->wall_s > 0 ? on_disk->wall_s / offloaded->wall_s : 0.0;
    doc["ttft_ratio_disk_over_offload"] = offloaded->ttft_sum_s > 0 ? on_disk->ttft_sum_s / offloaded->ttft_sum_s : 0.0;
    doc["modes"].push_back(on_disk->json);
  }
  if (on_remote) {
    doc["wall_ratio_remote_over_offload"] =
        offloaded->wall_s > 0 ? on_remote->wall_s / offloaded->wall_s : 0.0;
    doc["ttft_ratio_remote_over_offload"] =
        offloaded->ttft_sum_s > 0 ? on_remote->ttft_sum_s / offloaded->ttft_sum_s : 0.0;
    if (on_disk)
      doc["wall_ratio_remote_over_disk"] = on_disk->wall_s > 0 ? on_remote->wall_s / on_disk->wall_s : 0.0;
    doc["modes"].push_back(on_remote->json);
  }
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_prefix_cache.py");
  return 0;
}
