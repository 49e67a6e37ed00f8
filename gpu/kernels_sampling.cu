// Sampling on the device (Backend::sample_rows, semantics of sample_with_coin in core/ports/sampler.cc).
//
// Per group of rows (gpu/sampling_plan.h): sample_prepare_kernel (block per row) applies the
// repetition penalty, then either the greedy argmax (host semantics: first index of the max, 0
// when logit 0 is NaN) or logits / T in place, the softmax written over the row, and then the
// index-order CDF draw (no top-k, no top-p) or the row's sort keys (gpu/sample_keys.h: distinct
// 64-bit keys ordering probability descending, lower index first) into the row's sort slot: all
// indices for top-k, only the llama2.c candidates p >= cutoff for top-p (compacted, any order:
// keys are distinct). It also writes the argmax as a fallback token (a top-p row without any
// candidate takes it, as on the host). A CUB segmented radix sort orders each slot. sample_topk
// (block per top-k row) takes the k-th key and the kept sum from the sorted prefix; top-k alone
// then draws in index order over the kept set (membership: key >= k-th key); with top-p it writes
// the keys of the renormalised kept probabilities >= cutoff to the slot again for a second sort.
// sample_topp (block per top-p row) finds the smallest prefix of mass > top_p and draws from it.
//
// The draws are "first index whose running sum exceeds x" searches: every warp owns a contiguous
// range; pass 1 sums the ranges and a sequential scan of the warp totals gives each its carry;
// pass 2 walks the range 32 values at a time (warp inclusive scan + carry, ballot). The smallest
// hit over the warps wins. A search repeated with the same length reuses the carries and sees the
// identical running sums (top-p's prefix then its draw). Sums differ from the host's sequential
// float sums only by their order.
#include <cub/device/device_segmented_radix_sort.cuh>

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/kernels.h"
#include "gpu/sample_keys.h"

namespace specontext::gpu::kernels {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = kSampleThreads;
constexpr int kWarps = kThreads / 32;
// 3 blocks of 512 threads per SM: at most 40 registers (without the hint ptxas picked 32 and
// spilled 4 bytes in sample_topk_kernel on sm_90).
constexpr int kMinBlocks = 3;
// sample_prepare_kernel does more (penalty, argmax, softmax, CDF draw or keys): at 40 registers it
// spilled 8 / 16 bytes (sm_80 / sm_90); 2 blocks per SM allow 64. A block serves one row, so a
// batch of rows fills the SMs either way.
constexpr int kPrepareMinBlocks = 2;
constexpr int64_t kNone = INT64_MAX;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// (v, i) beats (w, j) when larger, or equal with a lower index; NaN never wins.
__device__ __forceinline__ void argmax_merge(float& v, int64_t& i, float w, int64_t j) {
  if (w > v || (w == v && j < i)) {
    v = w;
    i = j;
  }
}

struct BlockShared {
  float f[kWarps];
  int64_t i[kWarps];
  float carry[kWarps];
  float total;
  int64_t hit;
  float hit_cdf;
  int count;
};

// Block-wide sum (every thread gets it). Ends with a barrier-free read; callers may reuse sh.
__device__ float block_sum(float v, BlockShared& sh) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) sh.f[warp] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += sh.f[w];
  __syncthreads();
  return s;
}

// Block-wide (max, first index of the max), every thread gets it; i = kNone when all are NaN.
__device__ void block_argmax(float& v, int64_t& i, BlockShared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float w = __shfl_xor_sync(kFullMask, v, offset);
    const int64_t j = __shfl_xor_sync(kFullMask, i, offset);
    argmax_merge(v, i, w, j);
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    sh.f[warp] = v;
    sh.i[warp] = i;
  }
  __syncthreads();
  v = sh.f[0];
  i = sh.i[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) argmax_merge(v, i, sh.f[w], sh.i[w]);
  __syncthreads();
}

// First j in [0, len) with pred(cdf_j, j), where cdf_j is the running sum of value(0..j) (warp
// partitioned, see the file comment). Returns j (kNone without a hit); *cdf gets cdf_j, or the
// total without a hit. With carries_ready the warp carries of an earlier search over the same
// len and values are reused. Every thread of the block must call it.
template <typename Value, typename Pred>
__device__ int64_t first_crossing(int64_t len, Value value, Pred pred, bool carries_ready, BlockShared& sh,
                                  float* cdf) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t span = ((len + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int64_t begin = warp * span;
  const int64_t end = begin + span < len ? begin + span : len;
  if (!carries_ready) {
    float s = 0.0f;
    for (int64_t j = begin + lane; j < end; j += 32) s += value(j);
    s = warp_sum(s);
    if (lane == 0) sh.f[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      float c = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        sh.carry[w] = c;
        c += sh.f[w];
      }
      sh.total = c;
    }
    __syncthreads();
  }
  float run = sh.carry[warp];
  int64_t mine = kNone;
  float mine_cdf = 0.0f;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t j = base + lane;
    const bool in = j < end;
    const float x = in ? value(j) : 0.0f;
    float incl = x;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_up_sync(kFullMask, incl, offset);
      if (lane >= offset) incl += y;
    }
    const float c = run + incl;
    const unsigned hits = __ballot_sync(kFullMask, in && pred(c, j));
    if (hits != 0) {
      const int first = __ffs(hits) - 1;
      mine = base + first;
      mine_cdf = __shfl_sync(kFullMask, c, first);
      break;
    }
    run += __shfl_sync(kFullMask, incl, 31);
  }
  if (lane == 0) {
    sh.i[warp] = mine;
    sh.f[warp] = mine_cdf;
  }
  __syncthreads();
  int64_t best = kNone;
  float best_cdf = sh.total;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (sh.i[w] < best) {
      best = sh.i[w];
      best_cdf = sh.f[w];
    }
  }
  __syncthreads();
  *cdf = best_cdf;
  return best;
}

__global__ void __launch_bounds__(kThreads, kPrepareMinBlocks) sample_prepare_kernel(const SampleLaunch a) {
  __shared__ BlockShared sh;
  const int64_t r = a.row_begin + blockIdx.x;
  const SampleRowMeta m = a.meta[r];
  const int64_t n = a.vocab;
  float* row = a.logits + r * n;

  if (m.n_penalized > 0) {  // distinct ids: no two threads touch one logit
    const int32_t* ids = a.penalized + m.penalized_offset;
    for (int j = threadIdx.x; j < m.n_penalized; j += kThreads) {
      float& l = row[ids[j]];
      l = l > 0.0f ? l / m.penalty : l * m.penalty;
    }
    __syncthreads();
  }

  if (m.mode == kSampleGreedy) {
    float v = -INFINITY;
    int64_t i = kNone;
    for (int64_t k = threadIdx.x; k < n; k += kThreads) argmax_merge(v, i, row[k], k);
    block_argmax(v, i, sh);
    if (threadIdx.x == 0) a.tokens[r] = isnan(row[0]) || i == kNone ? 0 : static_cast<int32_t>(i);
    return;
  }

  // logits / T in place; max (and its index: the fallback token).
  float vmax = -INFINITY;
  int64_t imax = kNone;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) {
    const float x = row[k] / m.temperature;
    row[k] = x;
    argmax_merge(vmax, imax, x, k);
  }
  block_argmax(vmax, imax, sh);
  if (threadIdx.x == 0) a.tokens[r] = imax == kNone ? 0 : static_cast<int32_t>(imax);

  float s = 0.0f;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) s += expf(row[k] - vmax);
  const float sum = block_sum(s, sh);

  const bool all_keys = m.mode == kSampleTopK || m.mode == kSampleTopKTopP;
  const bool candidates = m.mode == kSampleTopP;
  uint64_t* keys = all_keys || candidates ? a.keys_a + static_cast<int64_t>(m.slot) * n : nullptr;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < n; k += kThreads) {
    const float p = expf(row[k] - vmax) / sum;
    row[k] = p;
    if (all_keys) {
      keys[k] = sample_key(p, k, n, a.key_shift);
    } else if (candidates && p >= m.cutoff) {
      keys[atomicAdd(&sh.count, 1)] = sample_key(p, k, n, a.key_shift);
    }
  }
  __syncthreads();
  if (all_keys || candidates) {
    if (threadIdx.x == 0) a.end1[m.slot] = a.begin1[m.slot] + (all_keys ? static_cast<int32_t>(n) : sh.count);
    return;
  }
  // kSampleIndexCdf: first i with coin < cdf_i, else n - 1.
  float cdf = 0.0f;
  const float coin = m.coin;
  const int64_t hit = first_crossing(
      n, [&](int64_t j) { return row[j]; }, [&](float c, int64_t) { return coin < c; }, false, sh, &cdf);
  if (threadIdx.x == 0) a.tokens[r] = static_cast<int32_t>(hit == kNone ? n - 1 : hit);
}

__global__ void __launch_bounds__(kThreads, kMinBlocks)
    sample_topk_kernel(const SampleLaunch a, const uint64_t* sorted, uint64_t* keys2) {
  __shared__ BlockShared sh;
  const int64_t r = a.rows_topk[blockIdx.x];
  const SampleRowMeta m = a.meta[r];
  const int64_t n = a.vocab;
  const int shift = a.key_shift;
  const float* row = a.logits + r * n;
  const int64_t base = static_cast<int64_t>(m.slot) * n;
  const uint64_t* keys = sorted + base;
  const int64_t k = m.top_k;
  const uint64_t kth = keys[k - 1];
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < k; j += kThreads) s += sample_key_prob(keys[j], shift);
  const float kept_sum = block_sum(s, sh);

  if (m.mode == kSampleTopK) {
    float cdf = 0.0f;
    const float coin = m.coin;
    const int64_t hit = first_crossing(
        n,
        [&](int64_t i) {
          const float p = row[i];
          return sample_key(p, i, n, shift) >= kth ? p / kept_sum : 0.0f;
        },
        [&](float c, int64_t) { return coin < c; }, false, sh, &cdf);
    if (threadIdx.x == 0) a.tokens[r] = static_cast<int32_t>(hit == kNone ? n - 1 : hit);
    return;
  }
  // kSampleTopKTopP: the kept set renormalised, candidates p' >= cutoff, keyed for sort 2.
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  uint64_t* out = keys2 + base;
  for (int64_t j = threadIdx.x; j < k; j += kThreads) {
    const uint64_t key = keys[j];
    const float p = sample_key_prob(key, shift) / kept_sum;
    if (p >= m.cutoff) out[atomicAdd(&sh.count, 1)] = sample_key(p, sample_key_index(key, n, shift), n, shift);
  }
  __syncthreads();
  if (threadIdx.x == 0) a.end2[m.seg2] = a.begin2[m.seg2] + sh.count;
}

__global__ void __launch_bounds__(kThreads, kMinBlocks)
    sample_topp_kernel(const SampleLaunch a, const uint64_t* sorted1, const uint64_t* sorted2) {
  __shared__ BlockShared sh;
  const int64_t r = a.rows_topp[blockIdx.x];
  const SampleRowMeta m = a.meta[r];
  const int64_t n = a.vocab;
  const int shift = a.key_shift;
  const int64_t base = static_cast<int64_t>(m.slot) * n;
  const bool second = m.mode == kSampleTopKTopP;
  const uint64_t* keys = (second ? sorted2 : sorted1) + base;
  const int64_t count = (second ? a.end2[m.seg2] : a.end1[m.slot]) - base;
  if (count <= 0) return;  // no candidate: the argmax stays, as on the host
  auto prob = [&](int64_t j) { return sample_key_prob(keys[j], shift); };
  // The smallest prefix whose mass exceeds top_p (else every candidate).
  float cumulative = 0.0f;
  const float top_p = m.top_p;
  int64_t last = first_crossing(count, prob, [&](float c, int64_t) { return c > top_p; }, false, sh, &cumulative);
  if (last == kNone) last = count - 1;
  const float x = m.coin * cumulative;
  float cdf = 0.0f;
  int64_t hit = first_crossing(
      count, prob, [&](float c, int64_t j) { return j <= last && x < c; }, true, sh, &cdf);
  if (hit == kNone) hit = last;
  if (threadIdx.x == 0) a.tokens[r] = static_cast<int32_t>(sample_key_index(keys[hit], n, shift));
}

cudaError_t segmented_sort(void* temp, size_t& temp_bytes, cub::DoubleBuffer<uint64_t>& keys, int64_t items,
                           int32_t segments, const int32_t* begin, const int32_t* end, int key_shift,
                           cudaStream_t stream) {
  return cub::DeviceSegmentedRadixSort::SortKeysDescending(temp, temp_bytes, keys, static_cast<int>(items), segments,
                                                           begin, end, 0, sample_key_bits(key_shift), stream);
}

}  // namespace

cudaError_t sample_sort_temp_bytes(int64_t vocab, int32_t n_slots, int32_t n_seg2, int key_shift, size_t* bytes) {
  clear_stale_error();
  *bytes = 0;
  if (n_slots <= 0) return cudaSuccess;
  cub::DoubleBuffer<uint64_t> keys(nullptr, nullptr);
  const int32_t* none = nullptr;
  size_t b1 = 0;
  cudaError_t err = segmented_sort(nullptr, b1, keys, vocab * n_slots, n_slots, none, none, key_shift, nullptr);
  if (err != cudaSuccess) return err;
  size_t b2 = 0;
  if (n_seg2 > 0) {
    err = segmented_sort(nullptr, b2, keys, vocab * n_slots, n_seg2, none, none, key_shift, nullptr);
    if (err != cudaSuccess) return err;
  }
  *bytes = b1 > b2 ? b1 : b2;
  return cudaSuccess;
}

cudaError_t launch_sample_rows(const SampleLaunch& a, cudaStream_t stream) {
  clear_stale_error();
  if (a.n_rows <= 0) return cudaSuccess;
  sample_prepare_kernel<<<static_cast<unsigned>(a.n_rows), kThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.n_slots == 0) return err;

  const int64_t items = a.vocab * a.n_slots;
  cub::DoubleBuffer<uint64_t> sort1(a.keys_a, a.keys_b);
  size_t temp_bytes = a.sort_temp_bytes;
  err = segmented_sort(a.sort_temp, temp_bytes, sort1, items, a.n_slots, a.begin1, a.end1, a.key_shift, stream);
  if (err != cudaSuccess) return err;
  const uint64_t* sorted1 = sort1.Current();
  const uint64_t* sorted2 = nullptr;
  if (a.n_topk > 0) {
    uint64_t* spare = sort1.Alternate();
    sample_topk_kernel<<<static_cast<unsigned>(a.n_topk), kThreads, 0, stream>>>(a, sorted1, spare);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (a.n_seg2 > 0) {
      // The spare buffer holds the new keys; the second sort may use sorted1's top-k slots (done
      // with) as its other half and leaves every other slot alone.
      cub::DoubleBuffer<uint64_t> sort2(spare, sort1.Current());
      temp_bytes = a.sort_temp_bytes;
      err = segmented_sort(a.sort_temp, temp_bytes, sort2, items, a.n_seg2, a.begin2, a.end2, a.key_shift, stream);
      if (err != cudaSuccess) return err;
      sorted2 = sort2.Current();
    }
  }
  if (a.n_topp > 0) {
    sample_topp_kernel<<<static_cast<unsigned>(a.n_topp), kThreads, 0, stream>>>(a, sorted1, sorted2);
    err = cudaGetLastError();
  }
  return err;
}

}  // namespace specontext::gpu::kernels
