// Host-side planning of one CudaTransport transfer: the checks a GPU copy needs beyond the
// TierTable's (transport/tier_table.h: ranges, overflow, kind pairs), coalescing of adjacent
// requests, the choice between DMA and the gather kernel, and the kernel's piece list. Pure C++
// with no CUDA calls, so it is unit-tested without a GPU (tests/gpu/transfer_plan_test.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/base/status.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

// How a CudaTransport moves a batch.
//   kDma: one cudaMemcpyAsync per coalesced request on the copy stream (copy engines, no SMs;
//         ~µs of CPU and GPU overhead per call, so small rows are slow).
//   kGatherKernel: one kernel reads/writes every request directly (device memory and mapped pinned
//         host memory through its UVA device pointer) from a request list uploaded once; uses SMs.
//   kAuto: the kernel when every side is device-addressable and the mean coalesced request is
//         smaller than gather_below_bytes, DMA otherwise.
enum class CopyMethod { kDma, kGatherKernel, kAuto };
std::string_view copy_method_name(CopyMethod method);

// kAuto's default threshold (mean bytes per coalesced request). Not measured yet:
// bench/gpu/copy.cc measures DMA against the kernel per row size on a device; until it has run,
// 32 KiB is an estimate (a DMA call costs a few µs; at ~25 GB/s that is the time to move ~50 KiB).
inline constexpr uint64_t kDefaultGatherBelowBytes = 32 * 1024;

// One request after TierTable validation, as addresses.
struct CopyRange {
  uint64_t src = 0;  // for DMA: the registered host pointer or the device pointer
  uint64_t dst = 0;
  uint64_t src_dev = 0;  // for the kernel: the device-visible address; 0 when that side is not mapped
  uint64_t dst_dev = 0;
  uint64_t bytes = 0;
  bool src_on_device = false;  // the side lives in device memory (else pinned host memory)
  bool dst_on_device = false;
  size_t request = 0;  // index of the (first) request in the batch, for messages
};

struct TransferPlanOptions {
  CopyMethod method = CopyMethod::kAuto;
  uint64_t gather_below_bytes = kDefaultGatherBelowBytes;
};

struct TransferPlan {
  CopyMethod method = CopyMethod::kDma;    // resolved: kDma or kGatherKernel
  std::vector<CopyRange> segments;         // coalesced requests (zero-byte ones dropped), in order
  std::vector<kernels::CopyPiece> pieces;  // kGatherKernel: segments cut into <= kCopyPieceBytes
  uint64_t total_bytes = 0;
  size_t requests = 0;
};

// Checks that the requests are independent, so they may run in any order or concurrently (a
// kernel runs them at once, and coalescing merges them): destination ranges pairwise disjoint,
// and no request reading bytes another writes (kInvalidArgument naming both request indices).
// kGatherKernel with a side that is not device-addressable is kInvalidArgument naming the
// request. Then coalesces neighbours (in request order) adjacent in both src and dst and plans
// the method.
Result<TransferPlan> plan_transfer(std::span<const CopyRange> copies, const TransferPlanOptions& options);

}  // namespace specontext::gpu
