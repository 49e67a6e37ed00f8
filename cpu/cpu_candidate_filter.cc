#include "cpu/cpu_candidate_filter.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <new>
#include <numeric>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/sparse/candidate_select.h"
#include "cpu/numa.h"

namespace specontext::cpu {

namespace {

constexpr std::string_view kWho = "CpuCandidateFilter";
// Summaries grow in chunks of about this size: no copy on growth (a vector would copy and
// briefly hold twice the memory) and each chunk is bound to the node on allocation.
constexpr size_t kChunkBytes = size_t{1} << 20;
// Pages per task of the bound pass: 64 pages × a group of query heads × head_dim is large enough
// to pay for a task and small enough to balance a few thousand pages over the workers.
constexpr int64_t kBoundPagesPerTask = 64;
// Below this many floats an append runs inline on the calling thread (one decode token).
constexpr int64_t kInlineAppendFloats = int64_t{1} << 16;

template <typename F>
Status guarded(const char* op, F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(kWho) + ": " + op + ": out of memory");
  } catch (const std::exception& e) {
    return internal_error(std::string(kWho) + ": " + op + ": " + e.what());
  } catch (...) {
    return internal_error(std::string(kWho) + ": " + op + ": unknown exception");
  }
}

}  // namespace

struct CpuCandidateFilter::Impl {
  struct Sequence {
    int64_t length = 0;
    // Chunk c holds pages [c·ppc, (c+1)·ppc): min [ppc][kv_dim], then max [ppc][kv_dim].
    std::vector<NumaBuffer> chunks;
  };

  CandidateFilterOptions o;
  int node = 0;
  int threads = 1;
  int64_t kvd = 0;
  int64_t pages_per_chunk = 1;
  std::unordered_map<SeqId, Sequence> seqs;
  // Declaration order is destruction order reversed: the observer must go before the arena.
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<NodePinningObserver> pinning;
  std::vector<float> bounds;  // shortlist scratch [kv_heads][pages]

  float* page_min(Sequence& s, int64_t p) const {
    return static_cast<float*>(s.chunks[static_cast<size_t>(p / pages_per_chunk)].data()) +
           (p % pages_per_chunk) * kvd;
  }
  float* page_max(Sequence& s, int64_t p) const { return page_min(s, p) + pages_per_chunk * kvd; }

  // f(begin, end) over [0, n) in tasks of `grain`, on the arena; inline when one task would do.
  template <typename F>
  void parallel(int64_t n, int64_t grain, F&& f) {
    if (n <= 0) return;
    if (n <= grain || threads <= 1) {
      f(int64_t{0}, n);
      return;
    }
    arena->execute([&] {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, static_cast<size_t>(grain)),
                        [&](const tbb::blocked_range<int64_t>& r) { f(r.begin(), r.end()); });
    });
  }
};

CpuCandidateFilter::CpuCandidateFilter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuCandidateFilter::~CpuCandidateFilter() = default;

Result<std::unique_ptr<CpuCandidateFilter>> CpuCandidateFilter::create(
    const CpuCandidateFilterOptions& options) {
  SPX_RETURN_IF_ERROR(check_candidate_filter_options(options.filter, kWho));
  if (options.num_threads < 0) {
    return invalid_argument(std::string(kWho) + ": CpuCandidateFilterOptions.num_threads must be >= 0 (got " +
                            std::to_string(options.num_threads) + ")");
  }
  std::unique_ptr<Impl> impl;
  Status st = guarded("create", [&]() -> Status {
    impl = std::make_unique<Impl>();
    auto topo = system_topology();
    const int nodes = topo.is_ok() ? (*topo)->num_numa_nodes() : 1;
    if (options.numa_node < 0 || options.numa_node >= nodes) {
      return invalid_argument(std::string(kWho) + ": CpuCandidateFilterOptions.numa_node " +
                              std::to_string(options.numa_node) + " does not exist (machine has " +
                              std::to_string(nodes) + " NUMA node" + (nodes == 1 ? "" : "s") + ")");
    }
    int threads = options.num_threads;
    if (threads == 0 && topo.is_ok()) threads = (*topo)->cores_in_node(options.numa_node);
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    impl->o = options.filter;
    impl->node = options.numa_node;
    impl->threads = threads;
    impl->kvd = options.filter.n_kv_heads * options.filter.head_dim;
    impl->pages_per_chunk = std::max<int64_t>(
        1, static_cast<int64_t>(kChunkBytes / (2 * sizeof(float) * static_cast<size_t>(impl->kvd))));
    impl->arena = std::make_unique<tbb::task_arena>(threads);
    impl->arena->initialize();
    // On one node pinning changes nothing but costs a syscall per worker entry: skip it.
    if (topo.is_ok() && nodes > 1) {
      impl->pinning = std::make_unique<NodePinningObserver>(*impl->arena, **topo, options.numa_node);
    }
    if (verbose_logging()) {
      std::fprintf(stderr,
                   "[specontext cpu] candidate filter: node %d of %d, %d threads, %lld pages per chunk\n",
                   options.numa_node, nodes, threads, static_cast<long long>(impl->pages_per_chunk));
    }
    return Status::ok();
  });
  if (!st.is_ok()) return st;
  auto* f = new (std::nothrow) CpuCandidateFilter(std::move(impl));
  if (f == nullptr) return resource_exhausted(std::string(kWho) + ": out of memory");
  return std::unique_ptr<CpuCandidateFilter>(f);
}

int64_t CpuCandidateFilter::length(SeqId seq) const {
  auto it = impl_->seqs.find(seq);
  return it == impl_->seqs.end() ? 0 : it->second.length;
}

int64_t CpuCandidateFilter::summary_bytes(SeqId seq) const {
  auto it = impl_->seqs.find(seq);
  if (it == impl_->seqs.end()) return 0;
  int64_t b = 0;
  for (const NumaBuffer& c : it->second.chunks) b += static_cast<int64_t>(c.size());
  return b;
}

int CpuCandidateFilter::num_threads() const { return impl_->threads; }
int CpuCandidateFilter::numa_node() const { return impl_->node; }
bool CpuCandidateFilter::memory_bound() const { return memory_binding_supported(); }

void CpuCandidateFilter::drop(SeqId seq) { impl_->seqs.erase(seq); }

Status CpuCandidateFilter::append_keys(SeqId seq, const float* keys, int64_t start, int64_t n) {
  Impl& m = *impl_;
  SPX_RETURN_IF_ERROR(check_append(kWho, seq, keys, start, n, length(seq), m.o, /*check_values=*/false));
  if (n == 0) return Status::ok();
  return guarded("append_keys", [&]() -> Status {
    const int64_t P = m.o.page_size, hd = m.o.head_dim, nkv = m.o.n_kv_heads;
    // Finiteness in parallel (a bulk append is hundreds of MiB); the serial check runs only to
    // name the first bad key.
    std::atomic<bool> bad{false};
    m.parallel(n, n * m.kvd < kInlineAppendFloats ? n : 256, [&](int64_t b, int64_t e) {
      bool ok = true;
      for (int64_t i = b * m.kvd; i < e * m.kvd; ++i) ok &= std::isfinite(keys[i]);
      if (!ok) bad.store(true, std::memory_order_relaxed);
    });
    if (bad.load()) return check_append(kWho, seq, keys, start, n, start, m.o, /*check_values=*/true);
    const int64_t end = start + n;
    const int64_t pages = (end + P - 1) / P;
    const int64_t chunks = (pages + m.pages_per_chunk - 1) / m.pages_per_chunk;
    // Allocate first: on failure nothing changed (a new sequence is not even created).
    auto it = m.seqs.find(seq);
    const size_t have = it == m.seqs.end() ? 0 : it->second.chunks.size();
    std::vector<NumaBuffer> fresh;
    for (int64_t c = static_cast<int64_t>(have); c < chunks; ++c) {
      SPX_ASSIGN_OR_RETURN(
          NumaBuffer b,
          NumaBuffer::allocate(2 * sizeof(float) * static_cast<size_t>(m.pages_per_chunk * m.kvd), m.node));
      fresh.push_back(std::move(b));
    }
    Impl::Sequence& s = it == m.seqs.end() ? m.seqs[seq] : it->second;
    s.chunks.reserve(static_cast<size_t>(chunks));
    for (NumaBuffer& b : fresh) s.chunks.push_back(std::move(b));
    // One task per (page, KV head) touched; each walks its tokens in order, so a page's first
    // token initialises it and the result does not depend on how appends were split.
    const int64_t p0 = start / P, n_items = (pages - p0) * nkv;
    m.parallel(n_items, n * m.kvd < kInlineAppendFloats ? n_items : 1, [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const int64_t p = p0 + item / nkv, g = item % nkv;
        float* mn = m.page_min(s, p) + g * hd;
        float* mx = m.page_max(s, p) + g * hd;
        for (int64_t t = std::max(start, p * P); t < std::min(end, (p + 1) * P); ++t) {
          const float* k = keys + (t - start) * m.kvd + g * hd;
          if (t == p * P) {
            std::copy_n(k, hd, mn);
            std::copy_n(k, hd, mx);
          } else {
            for (int64_t i = 0; i < hd; ++i) {
              mn[i] = std::min(mn[i], k[i]);
              mx[i] = std::max(mx[i], k[i]);
            }
          }
        }
      }
    });
    s.length = end;
    return Status::ok();
  });
}

Status CpuCandidateFilter::shortlist(SeqId seq, const float* q, int64_t length, int64_t shortlist_tokens,
                                     const SelectionOptions& selection, Candidates& out) {
  Impl& m = *impl_;
  auto it = m.seqs.find(seq);
  if (it == m.seqs.end()) {
    return invalid_argument(std::string(kWho) + ": shortlist of unknown sequence " +
                            std::to_string(seq.value()));
  }
  Impl::Sequence& s = it->second;
  SPX_RETURN_IF_ERROR(check_shortlist(kWho, seq, q, length, s.length, shortlist_tokens, selection, m.o));
  return guarded("shortlist", [&]() -> Status {
    const int64_t nkv = m.o.n_kv_heads, hd = m.o.head_dim, P = m.o.page_size;
    const int64_t group = m.o.n_heads / nkv;
    if (length <= shortlist_tokens) {
      all_candidates(nkv, length, out);
      return Status::ok();
    }
    const int64_t n_pages = (length + P - 1) / P;
    m.bounds.resize(static_cast<size_t>(nkv * n_pages));

    // 1. Bound of every (KV head, page): tasks over page blocks of every head.
    const int64_t blocks = (n_pages + kBoundPagesPerTask - 1) / kBoundPagesPerTask;
    m.parallel(nkv * blocks, 1, [&](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) {
        const int64_t g = item / blocks, blk = item % blocks;
        float* dst = m.bounds.data() + g * n_pages;
        for (int64_t p = blk * kBoundPagesPerTask; p < std::min(n_pages, (blk + 1) * kBoundPagesPerTask);
             ++p) {
          const float* mn = m.page_min(s, p) + g * hd;
          const float* mx = m.page_max(s, p) + g * hd;
          float best = -INFINITY;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            best = std::max(best, quest_page_bound(q + h * hd, mn, mx, hd));
          }
          dst[p] = best;
        }
      }
    });

    // 2. Per KV head: forced pages (two ranges: the sinks' and the window's), then the best of
    //    the middle pages. Only the first k0 of the ranking can be taken (every page but the
    //    last holds P tokens), so a partial selection plus a sort of k0 pages gives the prefix
    //    the reference's full stable sort would.
    const FixedTokens fixed = fixed_tokens(selection);
    const int64_t sink_tokens = std::min(fixed.sinks, length);
    const int64_t sink_pages_end = sink_tokens > 0 ? (sink_tokens - 1) / P + 1 : 0;
    const int64_t w0 = std::max(fixed.sinks, length - fixed.window);
    const int64_t window_pages_begin = std::max(sink_pages_end, w0 < length ? w0 / P : n_pages);
    auto page_tokens = [&](int64_t p) { return std::min(length, (p + 1) * P) - p * P; };
    const int64_t forced_count =
        std::min(length, sink_pages_end * P) + (length - std::min(length, window_pages_begin * P));
    std::vector<std::vector<std::pair<int64_t, int64_t>>> picked(static_cast<size_t>(nkv));  // (page, tokens)
    m.parallel(nkv, 1, [&](int64_t b, int64_t e) {
      std::vector<int64_t> mid;
      for (int64_t g = b; g < e; ++g) {
        auto& pk = picked[static_cast<size_t>(g)];
        for (int64_t p = 0; p < sink_pages_end; ++p) pk.emplace_back(p, page_tokens(p));
        int64_t need = shortlist_tokens - forced_count;
        const int64_t n_mid = window_pages_begin - sink_pages_end;
        if (need > 0 && n_mid > 0) {
          const float* bound = m.bounds.data() + g * n_pages;
          auto better = [&](int64_t a, int64_t c) {
            return bound[a] > bound[c] || (bound[a] == bound[c] && a < c);
          };
          mid.resize(static_cast<size_t>(n_mid));
          std::iota(mid.begin(), mid.end(), sink_pages_end);
          const int64_t k0 = std::min(n_mid, (need + P - 1) / P + 1);
          if (k0 < n_mid) {
            std::nth_element(mid.begin(), mid.begin() + (k0 - 1), mid.end(), better);
            mid.resize(static_cast<size_t>(k0));
          }
          std::sort(mid.begin(), mid.end(), better);
          for (int64_t p : mid) {
            const int64_t take = std::min(need, page_tokens(p));
            pk.emplace_back(p, take);  // the last one taken keeps its oldest `take` tokens
            need -= take;
            if (need == 0) break;
          }
        }
        for (int64_t p = window_pages_begin; p < n_pages; ++p) pk.emplace_back(p, page_tokens(p));
        std::sort(pk.begin(), pk.end());
      }
    });

    // 3. CSR, ascending positions per head.
    out.kv_heads = nkv;
    out.length = length;
    out.offsets.assign(static_cast<size_t>(nkv + 1), 0);
    for (int64_t g = 0; g < nkv; ++g) {
      int64_t c = 0;
      for (const auto& [p, n] : picked[static_cast<size_t>(g)]) c += n;
      out.offsets[static_cast<size_t>(g + 1)] = out.offsets[static_cast<size_t>(g)] + c;
    }
    out.tokens.resize(static_cast<size_t>(out.offsets.back()));
    m.parallel(nkv, 1, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) {
        int32_t* dst = out.tokens.data() + out.offsets[static_cast<size_t>(g)];
        for (const auto& [p, n] : picked[static_cast<size_t>(g)]) {
          for (int64_t t = p * P; t < p * P + n; ++t) *dst++ = static_cast<int32_t>(t);
        }
      }
    });
    return Status::ok();
  });
}

}  // namespace specontext::cpu
