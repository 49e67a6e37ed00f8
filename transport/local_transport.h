// LocalTransport: memcpy between host tiers of this process. post() copies synchronously on the
// calling thread and returns OK (a real local transport would fan large batches out to copy
// threads; the contract already allows kInProgress for that).
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"
#include "transport/tier_table.h"

namespace specontext::transport {

class LocalTransport final : public Transport {
 public:
  LocalTransport();
  LocalTransport(const LocalTransport&) = delete;
  LocalTransport& operator=(const LocalTransport&) = delete;

  std::string_view name() const override { return "local"; }
  Capabilities capabilities() const override;
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;

 private:
  struct Op {
    std::vector<ResolvedCopy> copies;
    bool posted = false;
  };
  Result<Op*> find(const TransferHandle& handle);

  std::mutex mu_;  // guards tiers_, ops_, next_id_
  TierTable tiers_;
  std::unordered_map<uint64_t, Op> ops_;
  uint64_t next_id_ = 1;
};

}  // namespace specontext::transport
