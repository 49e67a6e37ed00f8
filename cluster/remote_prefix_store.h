// RemotePrefixStore: the prefix offload store's lower level in KV node memory
// (`--prefix-offload-remote SIZE@HOST:PORT[+HOST:PORT...]`; LMCache's remote backend). One region
// of SIZE on each node (more than one node: mirrored, as a --kv-node tier is), sub-allocated here
// first-fit (core/base/region_allocator.h); blobs move through a registered host staging buffer a chunk
// at a time with UcxRemoteTransport, so writes reach every live replica and reads fail over.
//
// Private to its client: the node keeps clients apart (keyed regions), so two servers do not
// share prefixes through it. A replica that dies is not brought back (no healer); once none lives
// every put and get is kUnavailable naming the nodes, and the scheduler computes the prompts.
// Every transfer is bounded by `timeout` (never a hang on a silent node).
//
// A replica found dead by a transfer (and the loss of the last one) is told to `on_event` as one
// line naming the node, in cluster/replica_events.h's words ("kv-node: tier prefix offload
// (--prefix-offload-remote): replica 0 on HOST:PORT is dead (why); reads fail over, ..."), and
// counted in replica_counts() (serve's /metrics).
//
// Not synchronized (PrefixBlobStore): the scheduler's thread alone uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cluster/control_protocol.h"
#include "cluster/kv_node_client.h"
#include "cluster/replica_events.h"
#include "core/base/region_allocator.h"
#include "core/ports/prefix_blob_store.h"
#include "transport/ucx_transport.h"

namespace specontext::cluster {

class KvNodeClient;

struct RemotePrefixStoreOptions {
  std::vector<Endpoint> replicas;  // 1..UcxRemoteTransport::kMaxReplicas nodes, each holding a copy
  uint64_t bytes = 0;              // the region on each
  std::chrono::milliseconds timeout{5000};
  KvNodeAccess access;  // secret and TLS for the nodes (cluster/kv_node_client.h)
  transport::UcxTransferMode mode = transport::UcxTransferMode::kNodeGather;
  uint64_t staging_bytes = uint64_t{8} << 20;  // host bytes moved per transfer
  // Fail-over and loss lines (ReplicaEventLog), on the caller's thread after the transfer that
  // found them; null: none (replica_counts() counts them still).
  std::function<void(const std::string&)> on_event;
};

class RemotePrefixStore final : public PrefixBlobStore {
 public:
  // Connects to every node and allocates its region: kUnavailable naming a node that does not
  // answer, kResourceExhausted from one without room, kInvalidArgument for no node or no size.
  static Result<std::unique_ptr<RemotePrefixStore>> create(RemotePrefixStoreOptions options);
  ~RemotePrefixStore() override;
  RemotePrefixStore(const RemotePrefixStore&) = delete;
  RemotePrefixStore& operator=(const RemotePrefixStore&) = delete;

  const std::string& name() const override { return name_; }
  uint64_t capacity() const override { return allocator_.capacity(); }
  Result<uint64_t> put(std::span<const std::byte> blob) override;
  Result<std::vector<std::byte>> get(uint64_t key) override;
  void remove(uint64_t key) override;

  size_t blobs() const { return sizes_.size(); }
  uint64_t used_bytes() const { return allocator_.used_bytes(); }
  std::vector<transport::ReplicaReport> replicas() const { return transport_->replicas(); }
  ReplicaCounts replica_counts() const override { return counts_; }

 private:
  explicit RemotePrefixStore(RemotePrefixStoreOptions options);
  // Copies `bytes` between the staging buffer and the region at `offset`, one transfer.
  Status move(bool to_remote, uint64_t offset, uint64_t bytes);
  // After a transfer: counts the replicas it found dead and tells on_event.
  void look_at_replicas();

  RemotePrefixStoreOptions options_;
  std::string name_;
  // Declared before the transport: regions live as long as their sessions, and the staging
  // buffer stays registered until the transport is gone.
  std::vector<std::unique_ptr<KvNodeClient>> sessions_;
  std::vector<std::byte> staging_;
  std::unique_ptr<transport::UcxRemoteTransport> transport_;
  RegionAllocator allocator_;
  std::map<uint64_t, uint64_t> sizes_;  // key (offset in the region) → blob bytes
  ReplicaEventLog events_;  // also counts the deaths
  ReplicaCounts counts_;    // live and deaths as of the last look
};

}  // namespace specontext::cluster
