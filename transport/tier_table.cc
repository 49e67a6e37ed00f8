#include "transport/tier_table.h"

#include <algorithm>
#include <string>

namespace specontext::transport {

namespace {

std::string tier_text(TierId tier) { return "tier " + std::to_string(tier.value()); }

}  // namespace

Status check_request_ranges(const TransferRequest& r, const TierInfo& src, const TierInfo& dst,
                            std::string_view who) {
  const std::string where(who);
  // Written as subtractions so that offset + bytes cannot overflow.
  if (r.bytes > src.bytes || r.src_offset > src.bytes - r.bytes) {
    return out_of_range(where + ": src " + tier_text(r.src_tier) + " range [" +
                        std::to_string(r.src_offset) + ", +" + std::to_string(r.bytes) +
                        ") exceeds its " + std::to_string(src.bytes) + " bytes");
  }
  if (r.bytes > dst.bytes || r.dst_offset > dst.bytes - r.bytes) {
    return out_of_range(where + ": dst " + tier_text(r.dst_tier) + " range [" +
                        std::to_string(r.dst_offset) + ", +" + std::to_string(r.bytes) +
                        ") exceeds its " + std::to_string(dst.bytes) + " bytes");
  }
  if (r.src_tier == r.dst_tier && r.bytes > 0 && r.src_offset < r.dst_offset + r.bytes &&
      r.dst_offset < r.src_offset + r.bytes) {
    return invalid_argument(where + ": src and dst ranges overlap in " + tier_text(r.src_tier));
  }
  return Status::ok();
}

Status TierTable::add(TierId tier, MemoryKind kind, std::byte* base, uint64_t bytes,
                      const std::vector<MemoryKind>& kinds_ok) {
  const std::string who = std::string(transport_name_) + ": register " + tier_text(tier);
  if (!tier.valid()) return invalid_argument(who + ": invalid tier id");
  if (std::find(kinds_ok.begin(), kinds_ok.end(), kind) == kinds_ok.end()) {
    return unimplemented(who + ": memory kind " + std::string(memory_kind_name(kind)) +
                         " is not supported");
  }
  if (base == nullptr) return invalid_argument(who + ": null base");
  if (bytes == 0) return invalid_argument(who + ": zero size");
  if (tiers_.contains(tier)) return invalid_argument(who + ": already registered");
  tiers_.emplace(tier, TierInfo{kind, base, bytes});
  return Status::ok();
}

Status TierTable::resolve(const TransferBatch& batch, const Capabilities& caps,
                          std::vector<ResolvedCopy>& out) const {
  out.clear();
  out.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const TransferRequest& r = batch[i];
    const std::string where = std::string(transport_name_) + ": request " + std::to_string(i);
    auto src_it = tiers_.find(r.src_tier);
    if (src_it == tiers_.end()) {
      return invalid_argument(where + ": src " + tier_text(r.src_tier) + " is not registered");
    }
    auto dst_it = tiers_.find(r.dst_tier);
    if (dst_it == tiers_.end()) {
      return invalid_argument(where + ": dst " + tier_text(r.dst_tier) + " is not registered");
    }
    const TierInfo& src = src_it->second;
    const TierInfo& dst = dst_it->second;
    if (!caps.supports(src.kind, dst.kind)) {
      return unimplemented(where + ": " + tier_text(r.src_tier) + " (" +
                           std::string(memory_kind_name(src.kind)) + ") -> " +
                           tier_text(r.dst_tier) + " (" +
                           std::string(memory_kind_name(dst.kind)) + ") is not supported");
    }
    SPX_RETURN_IF_ERROR(check_request_ranges(r, src, dst, where));
    out.push_back(ResolvedCopy{dst.base + r.dst_offset, src.base + r.src_offset, r.bytes});
  }
  return Status::ok();
}

}  // namespace specontext::transport
