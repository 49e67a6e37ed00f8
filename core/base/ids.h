// Strong ids: a LayerId cannot be passed where a PageId is expected, nor compared with one.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>

namespace specontext {

template <typename Tag, typename Rep = int32_t>
class StrongId {
 public:
  using rep_type = Rep;
  constexpr StrongId() = default;
  constexpr explicit StrongId(Rep v) : v_(v) {}
  constexpr Rep value() const { return v_; }
  constexpr bool valid() const { return v_ != kInvalid; }
  friend constexpr bool operator==(StrongId a, StrongId b) { return a.v_ == b.v_; }
  friend constexpr auto operator<=>(StrongId a, StrongId b) { return a.v_ <=> b.v_; }
  static constexpr Rep kInvalid = std::numeric_limits<Rep>::max();

 private:
  Rep v_ = kInvalid;
};

using LayerId = StrongId<struct LayerIdTag>;
using PageId = StrongId<struct PageIdTag>;
using TierId = StrongId<struct TierIdTag>;
using NodeRank = StrongId<struct NodeRankTag>;
using SeqId = StrongId<struct SeqIdTag, int64_t>;
using TokenId = int32_t;  // token ids are data (they index embeddings), kept as plain ints

}  // namespace specontext

template <typename Tag, typename Rep>
struct std::hash<specontext::StrongId<Tag, Rep>> {
  size_t operator()(specontext::StrongId<Tag, Rep> id) const noexcept {
    return std::hash<Rep>()(id.value());
  }
};
