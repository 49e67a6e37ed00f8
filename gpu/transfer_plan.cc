#include "gpu/transfer_plan.h"

#include <algorithm>
#include <string>

namespace specontext::gpu {

namespace {

struct Interval {
  uint64_t begin;
  uint64_t end;
  size_t request;
};

std::string pair_text(size_t a, size_t b) {
  return "requests " + std::to_string(std::min(a, b)) + " and " + std::to_string(std::max(a, b));
}

// Sorts by begin (skipped when already sorted) and rejects overlapping neighbours.
Status sort_disjoint(std::vector<Interval>& v) {
  const auto by_begin = [](const Interval& a, const Interval& b) { return a.begin < b.begin; };
  if (!std::is_sorted(v.begin(), v.end(), by_begin)) std::sort(v.begin(), v.end(), by_begin);
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i].begin < v[i - 1].end) {
      return invalid_argument("cuda: " + pair_text(v[i - 1].request, v[i].request) +
                              " write overlapping destination bytes");
    }
  }
  return Status::ok();
}

bool mergeable(const CopyRange& a, const CopyRange& b) {
  const auto next_to = [&](uint64_t x, uint64_t y) { return x + a.bytes == y; };
  return a.src_on_device == b.src_on_device && a.dst_on_device == b.dst_on_device && next_to(a.src, b.src) &&
         next_to(a.dst, b.dst) && (a.src_dev == 0) == (b.src_dev == 0) &&
         (a.dst_dev == 0) == (b.dst_dev == 0) && (a.src_dev == 0 || next_to(a.src_dev, b.src_dev)) &&
         (a.dst_dev == 0 || next_to(a.dst_dev, b.dst_dev));
}

uint32_t common_alignment(uint64_t src, uint64_t dst) {
  const uint64_t both = src | dst;
  return (both & 15u) == 0 ? 16u : (both & 3u) == 0 ? 4u : 1u;
}

}  // namespace

std::string_view copy_method_name(CopyMethod method) {
  switch (method) {
    case CopyMethod::kDma:
      return "dma";
    case CopyMethod::kGatherKernel:
      return "gather_kernel";
    case CopyMethod::kAuto:
      return "auto";
  }
  return "unknown";
}

Result<TransferPlan> plan_transfer(std::span<const CopyRange> copies, const TransferPlanOptions& options) {
  TransferPlan plan;
  plan.requests = copies.size();

  // Independence. Host and device addresses never alias (UVA), so sources can only collide with
  // destinations of the same side.
  std::vector<Interval> dst;
  dst.reserve(copies.size());
  bool src_dev = false, src_host = false, dst_dev = false, dst_host = false;
  for (const CopyRange& c : copies) {
    if (c.bytes == 0) continue;
    dst.push_back({c.dst, c.dst + c.bytes, c.request});
    (c.src_on_device ? src_dev : src_host) = true;
    (c.dst_on_device ? dst_dev : dst_host) = true;
  }
  SPX_RETURN_IF_ERROR(sort_disjoint(dst));
  if ((src_dev && dst_dev) || (src_host && dst_host)) {
    for (const CopyRange& c : copies) {
      if (c.bytes == 0) continue;
      // dst is sorted and disjoint, so the ends ascend too: the first interval ending after
      // c.src is the only one that can overlap [c.src, c.src + bytes) first; later ones start later.
      auto it = std::upper_bound(dst.begin(), dst.end(), c.src,
                                 [](uint64_t x, const Interval& d) { return x < d.end; });
      if (it != dst.end() && it->begin < c.src + c.bytes) {
        return invalid_argument(
            "cuda: " + pair_text(c.request, it->request) +
            ": one reads bytes the other writes (requests of a batch must be independent)");
      }
    }
  }

  for (const CopyRange& c : copies) {
    if (c.bytes == 0) continue;
    plan.total_bytes += c.bytes;
    if (!plan.segments.empty() && mergeable(plan.segments.back(), c)) {
      plan.segments.back().bytes += c.bytes;
    } else {
      plan.segments.push_back(c);
    }
  }

  bool mapped = true;
  for (const CopyRange& s : plan.segments) {
    if (s.src_dev == 0 || s.dst_dev == 0) {
      mapped = false;
      if (options.method == CopyMethod::kGatherKernel) {
        return invalid_argument("cuda: request " + std::to_string(s.request) + ": the " +
                                (s.src_dev == 0 ? "source" : "destination") +
                                " tier is not device-addressable (register pinned memory with "
                                "cudaHostRegisterMapped), so the gather kernel cannot reach it");
      }
    }
  }
  switch (options.method) {
    case CopyMethod::kDma:
      plan.method = CopyMethod::kDma;
      break;
    case CopyMethod::kGatherKernel:
      plan.method = CopyMethod::kGatherKernel;
      break;
    case CopyMethod::kAuto: {
      const bool small =
          !plan.segments.empty() && plan.total_bytes < options.gather_below_bytes * plan.segments.size();
      plan.method = mapped && small ? CopyMethod::kGatherKernel : CopyMethod::kDma;
      break;
    }
  }
  if (plan.method == CopyMethod::kGatherKernel) {
    for (const CopyRange& s : plan.segments) {
      for (uint64_t off = 0; off < s.bytes; off += kernels::kCopyPieceBytes) {
        const uint64_t n = std::min<uint64_t>(kernels::kCopyPieceBytes, s.bytes - off);
        plan.pieces.push_back({s.src_dev + off, s.dst_dev + off, static_cast<uint32_t>(n),
                               common_alignment(s.src_dev + off, s.dst_dev + off)});
      }
    }
  }
  return plan;
}

}  // namespace specontext::gpu
