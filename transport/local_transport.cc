#include "transport/local_transport.h"

#include <cstring>
#include <string>

namespace specontext::transport {

LocalTransport::LocalTransport() : tiers_("local") {}

Capabilities LocalTransport::capabilities() const {
  Capabilities caps;
  for (MemoryKind s : {MemoryKind::kHost, MemoryKind::kPinnedHost}) {
    for (MemoryKind d : {MemoryKind::kHost, MemoryKind::kPinnedHost}) caps.add(s, d);
  }
  return caps;
}

Status LocalTransport::register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) {
  std::lock_guard lock(mu_);
  return tiers_.add(tier, kind, static_cast<std::byte*>(base), bytes,
                    {MemoryKind::kHost, MemoryKind::kPinnedHost});
}

Result<TransferHandle> LocalTransport::prepare(const TransferBatch& batch) {
  std::lock_guard lock(mu_);
  Op op;
  SPX_RETURN_IF_ERROR(tiers_.resolve(batch, capabilities(), op.copies));
  const uint64_t id = next_id_++;
  ops_.emplace(id, std::move(op));
  return make_handle(id);
}

Result<LocalTransport::Op*> LocalTransport::find(const TransferHandle& handle) {
  if (!handle.valid() || handle.owner() != this) {
    return invalid_argument("local: handle is not a live transfer of this transport");
  }
  auto it = ops_.find(handle.id());
  if (it == ops_.end()) return invalid_argument("local: handle was released");
  return &it->second;
}

Status LocalTransport::post(TransferHandle& handle) {
  std::vector<ResolvedCopy> copies;
  {
    std::lock_guard lock(mu_);
    SPX_ASSIGN_OR_RETURN(Op * op, find(handle));
    if (op->posted) return invalid_argument("local: transfer posted twice");
    op->posted = true;
    copies = op->copies;
  }
  // Copy outside the lock so other threads can prepare/poll meanwhile; the caller owns the
  // handle, so it cannot be released concurrently.
  for (const ResolvedCopy& c : copies) {
    if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
  }
  return Status::ok();
}

Status LocalTransport::poll(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  SPX_ASSIGN_OR_RETURN(Op * op, find(handle));
  if (!op->posted) return invalid_argument("local: poll of a transfer that was not posted");
  return Status::ok();
}

void LocalTransport::release(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  if (handle.valid() && handle.owner() == this) ops_.erase(handle.id());
  reset_handle(handle);
}

}  // namespace specontext::transport
