// The SpeContext sparse decode step phase by phase (issue #30: "the sparse step profiled phase by
// phase ... against each phase's own bytes and flops"), for batch 1 and 16 at a long context, on
// a synthetic model's shapes (random retrieval head, random keys and KV: speed, not quality).
// It calls what Engine::forward calls for a SpeContext decode step (core/engine/engine_sparse.cc,
// engine_forward.cc), in the engine's order:
//   per step:     head    retrieval_qk (fc, wq, wk: the engine's project_head, one row per sequence,
//                         one call for the batch; --head-per-sequence: one call per sequence)
//   per sequence: score   Backend::retrieval_group_scores over the head's paged K cache
//                 topk    Backend::select_top_tokens (per KV head top-B, sinks, window)
//                 diff    ElasticWorkingSet::update (S_now − S_last → gather entries)
//   per layer:    gather  Backend::kv_gather, one call per sequence (its loads, K and V)
//                 attend  Backend::attention_sparse, one call for the batch
// and times each call. Between steps, and before each layer's gathers, it reads --evict-mib of
// another buffer (untimed): the dense work of a real step (the layer's weights) runs there and
// leaves nothing of the sparse state in the caches.
//
// The selection alternates between two queries q_A and q_B = q_A + drift·noise (|noise| = |q_A|),
// so that each step's elastic diff loads what a step with that overlap loads (the overlap is
// reported). Each phase's bytes are what it must move at least (weights once per step, each key
// of the head cache once, each gathered row read and written once, working sets read once);
// `bytes_as_called` counts the head's weights once per call as the bench calls them. Roofline
// time = bytes ÷ read bandwidth (bench/lib/membw.h measure_read, in this run); the fraction is
// roofline time ÷ measured time. Flops: 2 per multiply-add, exp counted as one.
//
// KV memory: each (sequence, layer) has its own page table into one pool of --kv-pool-mib; when
// batch × layers × context needs more, the page tables wrap around the pool (reported as
// `kv_pool_aliasing`; a gathered row is then rarely in a cache anyway: the pool is ≫ the L3).
//
//   build/release/bench/bench_sparse_phases --context 32768 --batches 1,16 --out bench_out/sparse_phases.json --plot
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench/lib/membw.h"
#include "bench/lib/report.h"
#include "core/base/dtype.h"
#include "core/model/synthetic.h"
#include "core/ports/backend.h"
#include "core/ports/selection.h"
#include "core/sparse/elastic.h"
#include "core/sparse/retrieval_head.h"
#include "cpu/cpu_backend.h"

using namespace specontext;

namespace {

const char* const kPhases[] = {"head", "score", "topk", "diff", "gather", "attend"};
constexpr int kNumPhases = 6;

void fail(const Status& s, const char* what) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "error: %s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

// 64-byte aligned storage that frees itself.
struct Buffer {
  std::vector<uint8_t> bytes;
  uint8_t* data = nullptr;
  explicit Buffer(size_t n = 0) : bytes(n + 64) {
    data = bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
  }
  float* f32() { return reinterpret_cast<float*>(data); }
};

// Fills n floats with small random values (a tile of random numbers repeated: cheap for GiBs).
void fill_random(float* p, size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> tile(size_t{1} << 16);
  for (float& v : tile) v = u(rng);
  const size_t step = tile.size() - 64;
  for (size_t i = 0; i < n; i += step) {
    std::memcpy(p + i, tile.data() + (rng() % 64), std::min(step, n - i) * sizeof(float));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

volatile double g_sink = 0.0;
void evict(const Buffer& b, size_t n) {
  const auto* p = reinterpret_cast<const uint64_t*>(b.data);
  uint64_t s = 0;
  for (size_t i = 0; i < n / 8; i += 8) s += p[i];  // one word per 64-byte line
  g_sink = g_sink + static_cast<double>(s);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"SpeContext sparse decode step, phase by phase, against each phase's roofline"};
  std::string model_name = "llama-3.2-1b";
  int64_t layers = 4, context = 32768, budget = 0, sinks = 1, window = 4, page_size = 16;
  std::vector<int64_t> batches = {1, 16};
  int steps = 6, threads = 2;
  double drift = 0.3;
  int64_t kv_pool_mib = 2048, evict_mib = 256;
  std::string kv_dtype_name = "f32", out = "bench_out/sparse_phases.json";
  bool plot = false, head_per_sequence = false;
  app.add_option("--synthetic", model_name, "synthetic model shape")->capture_default_str();
  app.add_option("--layers", layers, "layers")->capture_default_str();
  app.add_option("--context", context, "tokens cached per sequence")->capture_default_str();
  app.add_option("--batches", batches, "batch sizes")->delimiter(',')->capture_default_str();
  app.add_option("--budget", budget, "tokens per KV head (0: the engine's default, min(2048, context / 8))")
      ->capture_default_str();
  app.add_option("--sinks", sinks, "attention sinks")->capture_default_str();
  app.add_option("--window", window, "recent window")->capture_default_str();
  app.add_option("--page-size", page_size, "KV page size (tokens)")->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype_name, "KV cache dtype")->check(CLI::IsMember({"f32", "f16", "bf16"}))
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps per batch (after one warm-up)")->capture_default_str();
  app.add_option("--threads", threads, "backend threads")->capture_default_str();
  app.add_option("--drift", drift, "q_B = q_A + drift·noise: sets the step-to-step overlap")->capture_default_str();
  app.add_option("--kv-pool-mib", kv_pool_mib, "KV page pool (MiB)")->capture_default_str();
  app.add_option("--evict-mib", evict_mib, "buffer read between phases (untimed)")->capture_default_str();
  app.add_option("--out", out, "JSON output path")->capture_default_str();
  app.add_flag("--head-per-sequence", head_per_sequence,
               "head phase: one retrieval_qk call per sequence (the engine before its batching) instead of one per step");
  app.add_flag("--plot", plot, "also write a PNG next to the JSON (bench/plot_sparse_phases.py)");
  CLI11_PARSE(app, argc, argv);

  auto cfg = synthetic_config(model_name);
  fail(cfg.status(), "synthetic config");
  ModelConfig c = *cfg;
  c.n_layers = layers;
  if (budget <= 0) budget = std::min<int64_t>(2048, context / 8);
  const DType kv_dtype = *dtype_from_name(kv_dtype_name);
  const size_t esz = dtype_size(kv_dtype);
  auto head_or = make_random_head(c, 7);
  fail(head_or.status(), "make_random_head");
  const RetrievalHead& head = **head_or;
  const RetrievalHeadConfig& hc = head.config;
  const int64_t d = hc.hidden, qd = hc.n_heads * hc.head_dim, kd = hc.n_kv_heads * hc.head_dim;
  const RopeParams rope = make_head_rope_params(hc, context + 1);
  auto backend_or = cpu::CpuBackend::create(cpu::CpuBackendOptions{.num_threads = threads});
  fail(backend_or.status(), "cpu backend");
  Backend& be = **backend_or;

  const auto rd = bench::measure_read(size_t{1} << 30, 5);
  std::fprintf(stderr, "read bandwidth %.2f GB/s (%d threads)\n", rd.read_gb_per_s, rd.threads);
  const double read_bw = rd.read_gb_per_s * 1e9;

  // The target's embedding table: only the rows of the step's tokens are read (vocab 512 here).
  const int64_t vocab = 512;
  Buffer emb(static_cast<size_t>(vocab * d) * 4);
  fill_random(emb.f32(), static_cast<size_t>(vocab * d), 11, 0.05f);
  const WeightMatrix embeddings{DType::kF32, vocab, d, emb.data};
  const int64_t head_weight_bytes = static_cast<int64_t>(head.fc.bytes() + head.wq.bytes() + head.wk.bytes());

  const SelectionOptions sel_opts{budget, sinks, window};
  const int64_t length = context;  // tokens attended this step (the current one included)
  const int64_t n_pages = (length + page_size - 1) / page_size;
  const size_t page_bytes = static_cast<size_t>(page_size * kd) * esz;
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t pool_pages = std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>((size_t(kv_pool_mib) << 20) / (2 * page_bytes)), max_batch * layers * n_pages));
  Buffer pool(static_cast<size_t>(pool_pages) * 2 * page_bytes);
  fill_random(pool.f32(), pool.bytes.size() / 4 - 16, 13, 1.0f);  // f16 / bf16: random bit patterns of small floats
  if (kv_dtype != DType::kF32) {
    // Keep the values finite: a bit pattern of two small f32 halves is not always a finite f16.
    auto* h = reinterpret_cast<uint16_t*>(pool.data);
    for (size_t i = 0; i < pool.bytes.size() / 2 - 64; ++i) h[i] = kv_dtype == DType::kF16 ? (h[i] & 0x33ff) : (h[i] & 0xbf7f);
  }
  Buffer evict_buf(static_cast<size_t>(evict_mib) << 20);
  std::memset(evict_buf.data, 1, evict_buf.bytes.size() - 64);

  nlohmann::json results = nlohmann::json::array();
  nlohmann::json batch_info = nlohmann::json::array();
  for (int64_t batch : batches) {
    std::fprintf(stderr, "batch %lld: setting up\n", static_cast<long long>(batch));
    // Per sequence: the head's K cache (blocks of `budget` tokens of the KV dtype, as the engine
    // pages it).
    const int64_t block_tokens = budget;
    const int64_t n_blocks = (length + block_tokens - 1) / block_tokens;
    const size_t block_elems = static_cast<size_t>(block_tokens * kd);
    std::vector<Buffer> head_cache;
    std::vector<std::vector<const void*>> head_tables(static_cast<size_t>(batch));
    std::vector<float> keys_f32(static_cast<size_t>(n_blocks) * block_elems);  // one sequence's, rounded into its cache
    for (int64_t s = 0; s < batch; ++s) {
      head_cache.emplace_back(keys_f32.size() * esz);
      fill_random(keys_f32.data(), keys_f32.size(), 100 + s, 1.0f);
      convert_from_f32(kv_dtype, keys_f32.data(), head_cache.back().data, keys_f32.size());
      for (int64_t b = 0; b < n_blocks; ++b) {
        head_tables[s].push_back(head_cache.back().data + static_cast<size_t>(b) * block_elems * esz);
      }
    }
    // Per (sequence, layer): page tables into the pool, a working set.
    std::vector<std::vector<void*>> kpages(static_cast<size_t>(batch * layers)), vpages(kpages.size());
    std::vector<Buffer> ws_k, ws_v;
    for (int64_t s = 0; s < batch; ++s) {
      for (int64_t l = 0; l < layers; ++l) {
        const size_t i = static_cast<size_t>(s * layers + l);
        for (int64_t p = 0; p < n_pages; ++p) {
          const int64_t pp = ((s * layers + l) * n_pages + p) % pool_pages;
          kpages[i].push_back(pool.data + static_cast<size_t>(2 * pp) * page_bytes);
          vpages[i].push_back(pool.data + static_cast<size_t>(2 * pp + 1) * page_bytes);
        }
        ws_k.emplace_back(static_cast<size_t>(hc.n_kv_heads * budget * hc.head_dim) * esz);
        ws_v.emplace_back(static_cast<size_t>(hc.n_kv_heads * budget * hc.head_dim) * esz);
      }
    }
    std::vector<ElasticWorkingSet> elastic(static_cast<size_t>(batch), ElasticWorkingSet(hc.n_kv_heads, budget));
    std::vector<Selection> selection(static_cast<size_t>(batch));
    std::vector<std::vector<GatherEntry>> loads(static_cast<size_t>(batch));
    Buffer scores(static_cast<size_t>(hc.n_kv_heads * length) * 4);
    // Queries: q_A from the head itself, q_B = q_A + drift · noise of q_A's norm, per sequence.
    std::vector<std::vector<float>> q_ab(static_cast<size_t>(2 * batch), std::vector<float>(static_cast<size_t>(qd)));
    std::vector<float> fused(static_cast<size_t>(batch * 3 * d)), k_new(static_cast<size_t>(batch * kd)),
        q_new(static_cast<size_t>(batch * qd));
    fill_random(fused.data(), fused.size(), 17, 1.0f);
    std::vector<TokenId> step_tokens(static_cast<size_t>(batch));
    const std::vector<int64_t> positions(static_cast<size_t>(batch), length - 1);
    std::mt19937_64 rng(23);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t s = 0; s < batch; ++s) {
      const TokenId tok = static_cast<TokenId>(s % vocab);
      const int64_t pos = length - 1;
      fail(retrieval_qk(be, head, rope, embeddings, &tok, fused.data() + s * 3 * d, &pos, 1, q_ab[2 * s].data(),
                        k_new.data()),
           "retrieval_qk");
      double norm = 0.0, nn = 0.0;
      std::vector<float> noise(static_cast<size_t>(qd));
      for (int64_t i = 0; i < qd; ++i) {
        norm += double(q_ab[2 * s][i]) * q_ab[2 * s][i];
        noise[i] = normal(rng);
        nn += double(noise[i]) * noise[i];
      }
      const float f = static_cast<float>(drift * std::sqrt(norm / nn));
      for (int64_t i = 0; i < qd; ++i) q_ab[2 * s + 1][i] = q_ab[2 * s][i] + f * noise[i];
    }
    // Attention queries / outputs of the target layer: [batch][n_heads · head_dim] (random).
    std::vector<float> q_att(static_cast<size_t>(batch * c.q_dim())), out_att(q_att.size());
    fill_random(q_att.data(), q_att.size(), 29, 0.5f);

    std::vector<std::vector<double>> phase_s(kNumPhases);
    double loads_total = 0.0, selected_total = 0.0, kept_total = 0.0;
    std::vector<double> loads_per_step;
    for (int step = 0; step <= steps + 1; ++step) {  // steps 0 (full load) and 1 warm up
      double t[kNumPhases] = {};
      int64_t step_loads = 0, step_selected = 0, step_kept = 0;
      evict(evict_buf, evict_buf.bytes.size() - 64);
      // head: q and k of every sequence's token; one call for the batch (one row a sequence) as
      // the engine's make_shared_selections does, or with --head-per-sequence one call a sequence
      // (the engine before #30's batching). Each key row goes into its sequence's cache.
      {
        const int64_t pos = length - 1;
        for (int64_t s = 0; s < batch; ++s) step_tokens[s] = static_cast<TokenId>((s + step) % vocab);
        auto t0 = std::chrono::steady_clock::now();
        if (head_per_sequence) {
          for (int64_t s = 0; s < batch; ++s) {
            fail(retrieval_qk(be, head, rope, embeddings, &step_tokens[s], fused.data() + s * 3 * d, &positions[s], 1,
                              q_new.data() + s * qd, k_new.data() + s * kd),
                 "retrieval_qk");
          }
        } else {
          fail(retrieval_qk(be, head, rope, embeddings, step_tokens.data(), fused.data(), positions.data(), batch,
                            q_new.data(), k_new.data()),
               "retrieval_qk");
        }
        for (int64_t s = 0; s < batch; ++s) {
          convert_from_f32(kv_dtype, k_new.data() + s * kd, head_cache[s].data + static_cast<size_t>(pos * kd) * esz,
                           static_cast<size_t>(kd));
        }
        t[0] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      for (int64_t s = 0; s < batch; ++s) {
        auto t1 = std::chrono::steady_clock::now();
        const float* q = q_ab[static_cast<size_t>(2 * s + (step % 2))].data();
        fail(be.retrieval_group_scores(q, head_tables[s].data(), kv_dtype, block_tokens, length, hc.n_heads, hc.n_kv_heads,
                                       hc.head_dim, scores.f32()),
             "retrieval_group_scores");
        auto t2 = std::chrono::steady_clock::now();
        fail(be.select_top_tokens(scores.f32(), hc.n_kv_heads, length, sel_opts, selection[s]), "select_top_tokens");
        auto t3 = std::chrono::steady_clock::now();
        loads[s].clear();
        const ElasticStats st = elastic[s].update(selection[s], loads[s]);
        auto t4 = std::chrono::steady_clock::now();
        t[1] += std::chrono::duration<double>(t2 - t1).count();
        t[2] += std::chrono::duration<double>(t3 - t2).count();
        t[3] += std::chrono::duration<double>(t4 - t3).count();
        step_loads += st.tokens_loaded;
        step_selected += st.tokens_selected;
        step_kept += st.tokens_kept;
      }
      for (int64_t l = 0; l < layers; ++l) {
        evict(evict_buf, evict_buf.bytes.size() - 64);
        std::vector<SparseAttentionItem> items;
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t s = 0; s < batch; ++s) {
          const size_t i = static_cast<size_t>(s * layers + l);
          const KvLayerView kv{kpages[i].data(), vpages[i].data(), n_pages, page_size, hc.n_kv_heads, hc.head_dim, kv_dtype};
          const WorkingSetView ws{ws_k[i].data, ws_v[i].data, hc.n_kv_heads, budget, hc.head_dim,
                                  elastic[s].counts().data(), kv_dtype};
          fail(be.kv_gather(kv, loads[s].data(), static_cast<int64_t>(loads[s].size()), ws), "kv_gather");
          items.push_back(SparseAttentionItem{s, 1, ws});
        }
        auto t1 = std::chrono::steady_clock::now();
        fail(be.attention_sparse(q_att.data(), items.data(), batch, c.n_heads, out_att.data()), "attention_sparse");
        auto t2 = std::chrono::steady_clock::now();
        t[4] += std::chrono::duration<double>(t1 - t0).count();
        t[5] += std::chrono::duration<double>(t2 - t1).count();
      }
      if (step >= 2) {
        for (int p = 0; p < kNumPhases; ++p) phase_s[p].push_back(t[p]);
        loads_total += static_cast<double>(step_loads);
        selected_total += static_cast<double>(step_selected);
        kept_total += static_cast<double>(step_kept);
        loads_per_step.push_back(static_cast<double>(step_loads));
      }
      std::fprintf(stderr, "  step %d: head %.2f score %.2f topk %.2f diff %.3f gather %.2f attend %.2f ms, loads %lld\n",
                   step, t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3, t[4] * 1e3, t[5] * 1e3,
                   static_cast<long long>(step_loads));
    }
    // The phases did what the engine's do: after the last step, every layer's working set of the
    // first and last sequences holds, in its first counts[h] slots, exactly the K and V rows of
    // the tokens selected for head h, and the attention output is finite.
    for (int64_t s : {int64_t{0}, batch - 1}) {
      for (int64_t l = 0; l < layers; ++l) {
        const size_t i = static_cast<size_t>(s * layers + l);
        for (int64_t h = 0; h < hc.n_kv_heads; ++h) {
          const auto want = selection[s].head(h);
          std::vector<int32_t> held;
          for (int64_t j = 0; j < elastic[s].counts()[h]; ++j) {
            const int32_t tok = elastic[s].token_at(h, j);
            held.push_back(tok);
            const size_t src = static_cast<size_t>((h * page_size + tok % page_size) * hc.head_dim) * esz;
            const size_t dst = static_cast<size_t>((h * budget + j) * hc.head_dim) * esz;
            const size_t rb = static_cast<size_t>(hc.head_dim) * esz;
            if (std::memcmp(ws_k[i].data + dst, static_cast<uint8_t*>(kpages[i][tok / page_size]) + src, rb) != 0 ||
                std::memcmp(ws_v[i].data + dst, static_cast<uint8_t*>(vpages[i][tok / page_size]) + src, rb) != 0) {
              std::fprintf(stderr, "error: working set row of sequence %lld layer %lld head %lld slot %lld is not token %d's\n",
                           (long long)s, (long long)l, (long long)h, (long long)j, tok);
              return 1;
            }
          }
          std::sort(held.begin(), held.end());
          if (!std::equal(held.begin(), held.end(), want.begin(), want.end())) {
            std::fprintf(stderr, "error: working set of sequence %lld head %lld does not hold its selection\n",
                         (long long)s, (long long)h);
            return 1;
          }
        }
      }
    }
    for (float v : out_att) {
      if (!std::isfinite(v)) {
        std::fprintf(stderr, "error: attention output not finite\n");
        return 1;
      }
    }
    const double loads_step = loads_total / steps;  // Σ over sequences of rows per KV head loaded
    const double selected_step = selected_total / steps;
    const double row = static_cast<double>(hc.head_dim) * static_cast<double>(esz);
    const double B = static_cast<double>(batch), L = static_cast<double>(length);
    const double nh = static_cast<double>(hc.n_heads), nkv = static_cast<double>(hc.n_kv_heads);
    const double hdim = static_cast<double>(hc.head_dim), NL = static_cast<double>(layers);
    const double head_params = static_cast<double>(head.fc.rows * head.fc.cols + head.wq.rows * head.wq.cols +
                                                   head.wk.rows * head.wk.cols);
    const double per_seq_io = 4.0 * (3 * d + d + qd + 2 * kd);  // fused, embedding row, q, k (+ its cache row)
    struct Cost {
      double bytes, bytes_as_called, flops, calls;
    };
    const Cost cost[kNumPhases] = {
        // head: weights once per step; the engine's calls (one per sequence) read them B times.
        {static_cast<double>(head_weight_bytes) + B * per_seq_io,
         head_per_sequence ? B * (static_cast<double>(head_weight_bytes) + per_seq_io)
                           : static_cast<double>(head_weight_bytes) + B * per_seq_io,
         B * 2.0 * head_params, head_per_sequence ? B : 1.0},
        // score: every key of every sequence's head cache once, the group scores written once.
        {B * (L * kd * static_cast<double>(esz) + qd * 4.0 + nkv * L * 4.0), 0, B * (2.0 * nh * hdim * L + 4.0 * nh * L + nh * L), B},
        // topk: the group scores read once, the selection written.
        {B * (nkv * L * 4.0 + nkv * budget * 4.0), 0, B * nkv * L, B},
        // diff: the selection read, the slot map read and written, the loads written (12 bytes each).
        {B * (3.0 * nkv * budget * 4.0) + loads_step * 12.0, 0, 0.0, B},
        // gather: each loaded K and V row read once and written once, every layer.
        {NL * loads_step * 2.0 * row * 2.0, 0, 0.0, NL * B},
        // attend: each working set's K and V rows read once (q and out too), every layer.
        {NL * (selected_step * 2.0 * row + B * 2.0 * c.q_dim() * 4.0), 0, NL * selected_step * (nh / nkv) * hdim * 4.0, NL},
    };
    double total_s = 0.0, total_roof = 0.0;
    for (int p = 0; p < kNumPhases; ++p) {
      const double sec = median(phase_s[p]);
      const double roof = cost[p].bytes / read_bw;
      total_s += sec;
      total_roof += roof;
      nlohmann::json r = {{"batch", batch},
                          {"phase", kPhases[p]},
                          {"seconds", sec},
                          {"seconds_min", *std::min_element(phase_s[p].begin(), phase_s[p].end())},
                          {"seconds_max", *std::max_element(phase_s[p].begin(), phase_s[p].end())},
                          {"bytes", cost[p].bytes},
                          {"bytes_as_called", cost[p].bytes_as_called > 0 ? cost[p].bytes_as_called : cost[p].bytes},
                          {"flops", cost[p].flops},
                          {"calls_per_step", cost[p].calls},
                          {"gb_per_s", cost[p].bytes / sec / 1e9},
                          {"gflop_per_s", cost[p].flops / sec / 1e9},
                          {"roofline_seconds", roof},
                          {"fraction_of_roofline", roof / sec}};
      std::fprintf(stderr,
                   "batch %2lld %-6s %9.3f ms  %10.2f MB  %9.3f GFLOP  %6.2f GB/s  %7.2f GFLOP/s  roofline %8.3f ms  %.3f\n",
                   static_cast<long long>(batch), kPhases[p], sec * 1e3, cost[p].bytes / 1e6, cost[p].flops / 1e9,
                   cost[p].bytes / sec / 1e9, cost[p].flops / sec / 1e9, roof * 1e3, roof / sec);
      results.push_back(r);
    }
    std::fprintf(stderr, "batch %2lld total  %9.3f ms  roofline %.3f ms  %.3f; overlap %.3f, loads %.0f of %.0f rows a step\n",
                 static_cast<long long>(batch), total_s * 1e3, total_roof * 1e3, total_roof / total_s,
                 kept_total / selected_total, loads_step, selected_step);
    batch_info.push_back({{"batch", batch},
                          {"sparse_seconds", total_s},
                          {"roofline_seconds", total_roof},
                          {"fraction_of_roofline", total_roof / total_s},
                          {"overlap", kept_total / selected_total},
                          {"rows_loaded_per_step", loads_step},
                          {"rows_selected_per_step", selected_step},
                          {"kv_pool_aliasing", static_cast<double>(batch * layers * n_pages) / static_cast<double>(pool_pages)}});
  }
  nlohmann::json doc = {{"command", "bench_sparse_phases"},
                        {"model", model_name},
                        {"layers", layers},
                        {"context", context},
                        {"budget", budget},
                        {"sinks", sinks},
                        {"window", window},
                        {"page_size", page_size},
                        {"kv_dtype", kv_dtype_name},
                        {"threads", threads},
                        {"steps", steps},
                        {"drift", drift},
                        {"evict_mib", evict_mib},
                        {"kv_pool_mib", kv_pool_mib},
                        {"read_gb_per_s", rd.read_gb_per_s},
                        {"head_weight_bytes", head_weight_bytes},
                        {"head_calls", head_per_sequence ? "per sequence" : "one per step (batched)"},
                        {"note", "random head, keys and KV: measures speed, not quality; seconds are medians per step"},
                        {"batches", batch_info},
                        {"results", results}};
  bench::write_report(doc, out, plot, std::string(SPECONTEXT_SOURCE_DIR) + "/bench/plot_sparse_phases.py");
  return 0;
}
