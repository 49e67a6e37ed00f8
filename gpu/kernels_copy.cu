// The transport's gather kernel: one warp per piece of up to kCopyPieceBytes. Pieces come from
// gpu/transfer_plan.cc; their addresses are device memory or mapped pinned host memory (UVA
// device pointers), so host rows are read over the bus by the SMs without a DMA call per row.
// Every lane issues all its loads (8 x 16 bytes for a 4 KiB piece) before its stores, to keep
// enough bytes in flight for the latency of host memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "gpu/kernels.h"

namespace specontext::gpu::kernels {

namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int64_t kMaxCopyBlocks = 1 << 16;

template <typename Word>
__device__ __forceinline__ void copy_words(const Word* __restrict__ src, Word* __restrict__ dst, uint32_t n,
                                           int lane) {
  constexpr int kPerLane = static_cast<int>(kCopyPieceBytes / sizeof(Word) / 32);
  static_assert(kPerLane >= 1);
  if constexpr (kPerLane <= 8) {
    Word r[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const uint32_t i = static_cast<uint32_t>(lane + 32 * k);
      if (i < n) r[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const uint32_t i = static_cast<uint32_t>(lane + 32 * k);
      if (i < n) dst[i] = r[k];
    }
  } else {
    // Narrow words (bytes, misaligned pieces): 8 loads in flight per round.
    for (uint32_t base = 0; base < n; base += 32 * 8) {
      Word r[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t i = base + static_cast<uint32_t>(lane + 32 * k);
        if (i < n) r[k] = src[i];
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint32_t i = base + static_cast<uint32_t>(lane + 32 * k);
        if (i < n) dst[i] = r[k];
      }
    }
  }
}

__global__ void __launch_bounds__(kCopyThreads)
    gather_copy_kernel(const CopyPiece* __restrict__ pieces, int64_t n) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCopyWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kCopyWarps + (threadIdx.x >> 5); w < n; w += stride) {
    const CopyPiece p = pieces[w];
    const auto* src = reinterpret_cast<const unsigned char*>(p.src);
    auto* dst = reinterpret_cast<unsigned char*>(p.dst);
    uint32_t body = 0;
    if (p.align == 16) {
      body = p.bytes / 16 * 16;
      copy_words(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), p.bytes / 16, lane);
    } else if (p.align == 4) {
      body = p.bytes / 4 * 4;
      copy_words(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint32_t*>(dst), p.bytes / 4, lane);
    }
    if (body < p.bytes) copy_words(src + body, dst + body, p.bytes - body, lane);
  }
}

}  // namespace

cudaError_t launch_gather_copy(const CopyPiece* pieces, int64_t n_pieces, cudaStream_t stream) {
  clear_stale_error();
  if (n_pieces <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n_pieces + kCopyWarps - 1) / kCopyWarps, kMaxCopyBlocks);
  gather_copy_kernel<<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(pieces, n_pieces);
  return cudaGetLastError();
}

}  // namespace specontext::gpu::kernels
