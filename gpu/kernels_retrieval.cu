// Retrieval head (SpeContext): group scores of one decode query against the head's K cache, the
// per-KV-head top-k selection over them.
//
// Scores: three kernels. (1) A block owns tokens_per_block tokens of one KV head; it stages `tile`
// K rows at a time in shared memory as f32 (coalesced, 4 elements per load when possible; f16 /
// bf16 keys are widened as they are loaded, the only conversion) and each thread scores one
// (row, part) against every query of the GQA group, 8 heads per pass, from the staged rows (float4
// reads, a row stride ≡ 4 mod 32 keeps them conflict-free) and broadcast queries. Logits go to a
// scratch row per query head in log2 units; at the end the block reduces its own logits to a
// (max, Σ exp2) pair per head. (2) One block per head merges the pairs into the softmax max and
// 1 / sum. (3) A grid-stride kernel writes max over the group of exp2(logit - max) / sum.
//
// Selection: a radix select on 64-bit keys (gpu/topk_radix.h) over each head's middle range,
// six passes of (histogram kernel: blocks of a segment add warp-aggregated shared histograms into
// a global one; choose kernel: one block per segment finds the digit with a block scan, updates
// the state and clears the histogram). Segments that are done skip later passes. Then an ordered
// compaction: every warp owns a contiguous span; a count kernel counts its chosen keys, a write
// kernel offsets each warp by the counts before it and writes tokens with ballots, so the output
// is ascending without a sort. Sinks and window are written around the middle.
#include <cub/block/block_scan.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "gpu/kernels.h"
#include "gpu/kv_convert.h"
#include "gpu/topk_radix.h"

namespace specontext::gpu::kernels {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxGridBlocks = 1 << 16;

__device__ __forceinline__ int64_t warp_sum_i64(int64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Combines two softmax partials (max m, Σ exp2(x - m) = l); (-inf, 0) is the empty partial.
__device__ __forceinline__ void merge_ml(float& m, float& l, float om, float ol) {
  const float mn = fmaxf(m, om);
  if (mn == -INFINITY) return;  // both empty
  l = l * exp2f(m - mn) + ol * exp2f(om - mn);
  m = mn;
}

__device__ __forceinline__ void warp_merge_ml(float& m, float& l) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float om = __shfl_xor_sync(kFullMask, m, offset);
    const float ol = __shfl_xor_sync(kFullMask, l, offset);
    merge_ml(m, l, om, ol);
  }
}

// ---- retrieval scores ----

// Four consecutive key elements as f32 (p aligned to four elements).
__device__ __forceinline__ float4 load_key4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_key4(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // element 0 in the low half of u.x
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 load_key4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// T: the keys' element type (float, __half, __nv_bfloat16).
template <typename T>
__global__ void __launch_bounds__(kRetrievalThreads) retrieval_logits_kernel(const RetrievalScoresLaunch a) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int tile = a.tile;
  const int pd = a.part_dims;
  const int ks = a.k_stride;
  const int hd = static_cast<int>(a.head_dim);
  const int group = static_cast<int>(a.group);
  const int qd = a.parts * pd;                // padded query / row length
  float* k_s = smem;                          // [parts][tile][ks]
  float* q_s = k_s + kRetrievalThreads * ks;  // [group][qd], pre-scaled, zero-padded
  float* red = q_s + group * qd;              // [8][parts][tile] when parts > 1
  const int tid = static_cast<int>(threadIdx.x);
  const int part = tid / tile;
  const int row = tid - part * tile;
  const int64_t g = blockIdx.y;

  for (int i = tid; i < group * qd; i += kRetrievalThreads) {
    const int j = i / qd;
    const int d = i - j * qd;
    q_s[i] = d < hd ? a.q[(g * group + j) * hd + d] * a.q_scale : 0.0f;
  }

  const int64_t t_begin = static_cast<int64_t>(blockIdx.x) * a.tokens_per_block;
  const int64_t t_end = min(t_begin + a.tokens_per_block, a.length);
  const int64_t kvd = a.n_kv_heads * a.head_dim;
  const float* k_row = k_s + (part * tile + row) * ks;
  // Where each staged row of this KV head starts in the paged cache (rows may cross blocks).
  __shared__ const T* row_base[kRetrievalThreads];
  static_assert(sizeof(row_base) == kRetrievalStaticSmemBytes, "the plan counts this array");

  for (int64_t t0 = t_begin; t0 < t_end; t0 += tile) {
    const int n_rows = static_cast<int>(min(static_cast<int64_t>(tile), t_end - t0));
    __syncthreads();  // q_s staged (first tile) / the previous tile consumed
    if (tid < n_rows) {
      const int64_t t = t0 + tid;
      row_base[tid] = static_cast<const T*>(a.k_blocks[t / a.block_tokens]) + (t % a.block_tokens) * kvd +
                      g * a.head_dim;
    }
    __syncthreads();
    if (a.vec4) {
      const int n4 = qd / 4;
      for (int i = tid; i < tile * n4; i += kRetrievalThreads) {
        const int r = i / n4;
        const int d = (i - r * n4) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < n_rows && d < hd) v = load_key4(row_base[r] + d);
        const int p = d / pd;
        *reinterpret_cast<float4*>(k_s + (p * tile + r) * ks + (d - p * pd)) = v;
      }
    } else {
      for (int i = tid; i < tile * qd; i += kRetrievalThreads) {
        const int r = i / qd;
        const int d = i - r * qd;
        const float v = r < n_rows && d < hd ? kv_to_f32(row_base[r][d]) : 0.0f;
        const int p = d / pd;
        k_s[(p * tile + r) * ks + (d - p * pd)] = v;
      }
    }
    __syncthreads();

    for (int j0 = 0; j0 < group; j0 += kRetrievalHeadsPerPass) {
      const int nh = min(kRetrievalHeadsPerPass, group - j0);
      float acc[kRetrievalHeadsPerPass];
#pragma unroll
      for (int j = 0; j < kRetrievalHeadsPerPass; ++j) acc[j] = 0.0f;
      const float* q_part = q_s + j0 * qd + part * pd;
      for (int d = 0; d < pd; d += 4) {
        const float4 kv = *reinterpret_cast<const float4*>(k_row + d);
#pragma unroll
        for (int j = 0; j < kRetrievalHeadsPerPass; ++j) {
          if (j < nh) {
            const float4 qv = *reinterpret_cast<const float4*>(q_part + j * qd + d);
            acc[j] = fmaf(qv.x, kv.x, acc[j]);
            acc[j] = fmaf(qv.y, kv.y, acc[j]);
            acc[j] = fmaf(qv.z, kv.z, acc[j]);
            acc[j] = fmaf(qv.w, kv.w, acc[j]);
          }
        }
      }
      if (a.parts == 1) {
        if (row < n_rows) {
#pragma unroll
          for (int j = 0; j < kRetrievalHeadsPerPass; ++j) {
            if (j < nh) a.logits[(g * group + j0 + j) * a.length + t0 + row] = acc[j];
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kRetrievalHeadsPerPass; ++j) {
          if (j < nh) red[(j * a.parts + part) * tile + row] = acc[j];
        }
        __syncthreads();
        for (int i = tid; i < nh * tile; i += kRetrievalThreads) {
          const int j = i / tile;
          const int r = i - j * tile;
          if (r < n_rows) {
            float s = 0.0f;
            for (int p = 0; p < a.parts; ++p) s += red[(j * a.parts + p) * tile + r];
            a.logits[(g * group + j0 + j) * a.length + t0 + r] = s;
          }
        }
        __syncthreads();  // red is rewritten by the next pass
      }
    }
  }

  // The block's softmax partial per head, from the logits it wrote (visible after the barrier).
  __syncthreads();
  const int warp = tid >> 5;
  const int lane = tid & 31;
  for (int j = warp; j < group; j += kRetrievalThreads / 32) {
    const float* lg = a.logits + (g * group + j) * a.length;
    float m = -INFINITY;
    float l = 0.0f;
    for (int64_t t = t_begin + lane; t < t_end; t += 32) merge_ml(m, l, lg[t], 1.0f);
    warp_merge_ml(m, l);
    if (lane == 0) {
      const int64_t at = (g * group + j) * a.blocks_per_head + blockIdx.x;
      a.partial_m[at] = m;
      a.partial_l[at] = l;
    }
  }
}

// One block per query head: the softmax max and 1 / sum from the blocks' partials.
__global__ void __launch_bounds__(kRetrievalThreads) retrieval_stats_kernel(const RetrievalScoresLaunch a) {
  __shared__ float sm[kRetrievalThreads / 32];
  __shared__ float sl[kRetrievalThreads / 32];
  const int64_t h = blockIdx.x;
  float m = -INFINITY;
  float l = 0.0f;
  for (int64_t b = threadIdx.x; b < a.blocks_per_head; b += kRetrievalThreads) {
    merge_ml(m, l, a.partial_m[h * a.blocks_per_head + b], a.partial_l[h * a.blocks_per_head + b]);
  }
  warp_merge_ml(m, l);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRetrievalThreads / 32; ++w) merge_ml(m, l, sm[w], sl[w]);
    a.stats[2 * h] = m;
    a.stats[2 * h + 1] = 1.0f / l;
  }
}

// out[g][t] = max over the group's heads of exp2(logit - max) / sum; blockIdx.y is g.
__global__ void __launch_bounds__(256) retrieval_group_max_kernel(const RetrievalScoresLaunch a) {
  const int64_t g = blockIdx.y;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < a.length; t += stride) {
    float best = 0.0f;
    for (int64_t j = 0; j < a.group; ++j) {
      const int64_t h = g * a.group + j;
      const float p = exp2f(a.logits[h * a.length + t] - a.stats[2 * h]) * a.stats[2 * h + 1];
      best = fmaxf(best, p);
    }
    a.out[g * a.length + t] = best;
  }
}

// ---- select_top_tokens ----

// Histogram of pass p's digit over the keys still matching the segment's prefix. Lanes with the
// same bin add once per warp (__match_any_sync): softmax scores cluster in a few bins, and 32
// shared atomics on one address would serialise.
__global__ void __launch_bounds__(kSelectThreads) select_hist_kernel(const SelectTopLaunch a, int p) {
  __shared__ uint32_t hist[kSelectMaxBins];
  const int64_t seg = blockIdx.y;
  const SelectState st = a.state[seg];
  if (st.done != 0) return;  // block-uniform
  const int bins = 1 << select_pass_bits(p);
  for (int b = static_cast<int>(threadIdx.x); b < bins; b += kSelectThreads) hist[b] = 0;
  __syncthreads();
  const float* s = a.scores + seg * a.length + a.lo;
  const int lane = static_cast<int>(threadIdx.x & 31);
  constexpr int kUnroll = 4;
  const int64_t warp_global = static_cast<int64_t>(blockIdx.x) * kSelectWarps + (threadIdx.x >> 5);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSelectWarps * 32 * kUnroll;
  for (int64_t base = warp_global * 32 * kUnroll; base < a.m; base += stride) {  // warp-uniform
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = i < a.m ? s[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      const uint64_t key = select_key(v[u], static_cast<uint32_t>(a.lo + i));
      const int bin = i < a.m && select_matches(key, st) ? static_cast<int>(select_digit(key, p)) : -1;
      const unsigned peers = __match_any_sync(kFullMask, bin);
      if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
  }
  __syncthreads();
  uint32_t* global = a.hist + seg * kSelectMaxBins;
  for (int b = static_cast<int>(threadIdx.x); b < bins; b += kSelectThreads) {
    if (hist[b] != 0) atomicAdd(&global[b], hist[b]);
  }
}

// One block per segment: the digit whose bin holds the remaining-th largest key. Thread t owns
// the bins [bins - (t + 1)·per, bins - t·per), highest first, so an exclusive scan of the
// per-thread totals counts the keys above each thread's bins.
__global__ void __launch_bounds__(kSelectThreads) select_choose_kernel(const SelectTopLaunch a, int p) {
  using Scan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t seg = blockIdx.x;
  const SelectState st = a.state[seg];
  if (st.done != 0) return;  // block-uniform
  uint32_t* hist = a.hist + seg * kSelectMaxBins;
  const int bins = 1 << select_pass_bits(p);
  const int per = bins / kSelectThreads;  // 8 or 4
  const int top = bins - 1 - static_cast<int>(threadIdx.x) * per;
  uint32_t c[kSelectMaxBins / kSelectThreads];
  uint32_t total = 0;
#pragma unroll
  for (int k = 0; k < kSelectMaxBins / kSelectThreads; ++k) {
    c[k] = k < per ? hist[top - k] : 0u;
    total += c[k];
  }
  uint32_t above = 0;
  Scan(scan_storage).ExclusiveSum(total, above);
  int64_t running = above;
#pragma unroll
  for (int k = 0; k < kSelectMaxBins / kSelectThreads; ++k) {
    if (k < per && running < st.remaining && st.remaining <= running + c[k]) {
      a.state[seg] = select_advance(st, p, static_cast<uint32_t>(top - k), running, c[k]);
    }
    running += c[k];
  }
  // Every thread read its bins before the scan's barriers; clear for the next pass.
  for (int b = static_cast<int>(threadIdx.x); b < bins; b += kSelectThreads) hist[b] = 0;
}

// The contiguous middle span [begin, end) a warp of the compaction owns.
struct WarpSpan {
  int64_t index;  // warp index within the segment
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ WarpSpan warp_span(const SelectTopLaunch& a) {
  WarpSpan w;
  w.index = static_cast<int64_t>(blockIdx.x) * kSelectWarps + (threadIdx.x >> 5);
  w.begin = min(w.index * a.warp_span, a.m);
  w.end = min(w.begin + a.warp_span, a.m);
  return w;
}

// Visits the chosen keys of a warp's span in token order: f(i, chosen, ballot) per 32 elements.
template <class F>
__device__ __forceinline__ void for_each_chosen(const SelectTopLaunch& a, const SelectState& st,
                                                const WarpSpan& w, int lane, F&& f) {
  const float* s = a.scores + blockIdx.y * a.length + a.lo;
  constexpr int kUnroll = 4;
  for (int64_t base = w.begin; base < w.end; base += 32 * kUnroll) {  // warp-uniform
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = i < w.end ? s[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      const bool chosen = i < w.end && select_chosen(select_key(v[u], static_cast<uint32_t>(a.lo + i)), st);
      f(i, chosen, __ballot_sync(kFullMask, chosen));
    }
  }
}

__global__ void __launch_bounds__(kSelectThreads) select_count_kernel(const SelectTopLaunch a) {
  const int64_t seg = blockIdx.y;
  const SelectState st = a.state[seg];
  const int lane = static_cast<int>(threadIdx.x & 31);
  const WarpSpan w = warp_span(a);
  int32_t count = 0;
  for_each_chosen(a, st, w, lane, [&](int64_t, bool, unsigned ballot) { count += __popc(ballot); });
  if (lane == 0) a.warp_counts[seg * a.blocks_per_segment * kSelectWarps + w.index] = count;
}

__global__ void __launch_bounds__(kSelectThreads) select_write_kernel(const SelectTopLaunch a) {
  const int64_t seg = blockIdx.y;
  const int lane = static_cast<int>(threadIdx.x & 31);
  int32_t* out = a.out + seg * a.budget;
  if (blockIdx.x == 0) {  // the fixed part: sinks before the middle, the window after it
    for (int64_t t = threadIdx.x; t < a.sinks; t += kSelectThreads) out[t] = static_cast<int32_t>(t);
    const int64_t window = a.length - a.window_begin;
    for (int64_t t = threadIdx.x; t < window; t += kSelectThreads) {
      out[a.sinks + a.take + t] = static_cast<int32_t>(a.window_begin + t);
    }
  }
  if (a.take == 0) return;  // no middle: state and counts were never set up
  const SelectState st = a.state[seg];
  const WarpSpan w = warp_span(a);
  const int32_t* counts = a.warp_counts + seg * a.blocks_per_segment * kSelectWarps;
  int64_t before = 0;
  for (int64_t k = lane; k < w.index; k += 32) before += counts[k];
  int64_t at = a.sinks + warp_sum_i64(before);
  const unsigned lower = (1u << lane) - 1u;
  for_each_chosen(a, st, w, lane, [&](int64_t i, bool chosen, unsigned ballot) {
    if (chosen) out[at + __popc(ballot & lower)] = static_cast<int32_t>(a.lo + i);
    at += __popc(ballot);
  });
}

}  // namespace

template <typename T>
cudaError_t launch_retrieval_logits(const RetrievalScoresLaunch& a, cudaStream_t stream) {
  if (a.smem_opt_in) {
    const cudaError_t err = cudaFuncSetAttribute(retrieval_logits_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(a.smem_bytes));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(a.blocks_per_head), static_cast<unsigned>(a.n_kv_heads));
  retrieval_logits_kernel<T><<<grid, kRetrievalThreads, a.smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_retrieval_scores(const RetrievalScoresLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  if (a.length <= 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;  // not a KvType
  switch (a.k_type) {
    case KvType::kF32: err = launch_retrieval_logits<float>(a, stream); break;
    case KvType::kF16: err = launch_retrieval_logits<__half>(a, stream); break;
    case KvType::kBF16: err = launch_retrieval_logits<__nv_bfloat16>(a, stream); break;
  }
  if (err != cudaSuccess) return err;
  retrieval_stats_kernel<<<static_cast<unsigned>(a.n_heads), kRetrievalThreads, 0, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t per_head = std::clamp<int64_t>((a.length + 255) / 256, 1, kMaxGridBlocks / 16);
  retrieval_group_max_kernel<<<dim3(static_cast<unsigned>(per_head), static_cast<unsigned>(a.n_kv_heads)),
                               256, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_select_top(const SelectTopLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  if (a.n_segments <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.blocks_per_segment), static_cast<unsigned>(a.n_segments));
  if (a.take > 0) {
    for (int p = 0; p < kSelectPasses; ++p) {
      select_hist_kernel<<<grid, kSelectThreads, 0, stream>>>(a, p);
      select_choose_kernel<<<static_cast<unsigned>(a.n_segments), kSelectThreads, 0, stream>>>(a, p);
    }
    select_count_kernel<<<grid, kSelectThreads, 0, stream>>>(a);
  }
  select_write_kernel<<<grid, kSelectThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace specontext::gpu::kernels
