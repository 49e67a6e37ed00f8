// UcxRemoteTransport: one remote KV tier held by one or more KV nodes (cluster/kv_node.h), reached
// with UCX RMA (ucp_get_nbx / ucp_put_nbx into memory the node registered) or with node-side
// gather / scatter active messages (UcxTransferMode, transport/ucx_wire.h). The tier may be
// mirrored on several nodes (replicas): writes go to every live replica and complete when each
// has flushed them; reads come from the first live replica and fail over to the next when it
// dies, so a dead node loses nothing while one replica lives. A replica that failed is not used
// again until rejoin() gives it a fresh region (on the node that came back, or on a spare) and
// copies the whole tier into it from a live replica (cluster/replica_healer.h drives this).
//
// Which memory: exactly the one kRemote tier named in the config (other kRemote ids answer
// kUnimplemented, so a TransportRouter with one UcxRemoteTransport per remote tier routes each
// tier to its own transport), and any number of local host / pinned-host tiers (registered with
// ucp_mem_map). Pairs: local → remote and remote → local.
//
// Failure detection: the endpoint's error handler (UCP_ERR_HANDLING_MODE_PEER; over TCP a killed
// node is a connection reset, seen at the next progress), a failed flush, or a replica silent for
// op_timeout (then its endpoint is force-closed, which completes everything posted to it). Every
// failure is kUnavailable naming the tier and the node; once no replica lives, every transfer of
// the tier fails with the list of what happened to each.
//
// Requests of one transfer are issued sorted by remote offset, and rows adjacent on both sides are
// merged into one RMA operation (elastic loads are rows of a few hundred bytes); so the order in
// which overlapping destination ranges of one transfer are written is unspecified.
//
// Threads: internally synchronized by one mutex that also serialises every call into the UCX
// worker (UCS_THREAD_MODE_SERIALIZED); the worker progresses only inside post / poll / release.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/ports/transport.h"
#include "transport/ucx_support.h"
#include "transport/ucx_wire.h"

namespace specontext::transport {

// A byte range of a KV node's memory, as its control plane describes it (cluster/kv_node.h).
struct RemoteRegion {
  std::string node;                     // "host:port", for messages
  std::vector<uint8_t> worker_address;  // the node's UCX worker
  std::vector<uint8_t> rkey;            // packed remote key of the region (RMA); empty: the node serves none
  std::string rma_refused;              // when rkey is empty, why the node serves no RMA (for messages)
  uint64_t address = 0;                 // remote virtual address of the region's first byte
  uint64_t bytes = 0;
  uint64_t region = 0;  // the node's id for it (control plane "free"; named by node-side gathers)
  ucx_wire::RegionKey key{};  // its key (128 random bits), sent with every node-side gather / scatter
};

// kRma: one-sided get/put per merged row range (the right choice on RDMA NICs). kNodeGather: one
// active message per chunk lists the ranges and the node packs (or unpacks) the rows, so a batch of
// scattered rows costs a few round trips instead of one per row (what TCP needs).
enum class UcxTransferMode { kRma, kNodeGather };

struct UcxRemoteConfig {
  TierId tier;                                 // the kRemote tier this transport serves
  std::vector<RemoteRegion> replicas;          // 1..kMaxReplicas copies of the tier, each >= its size
  std::chrono::milliseconds op_timeout{5000};  // a replica silent this long is declared dead
  UcxTransferMode mode = UcxTransferMode::kRma;
  // rejoin reads the next chunk while it writes the last; false copies one chunk at a time (for
  // benchmarks that measure what the overlap gives).
  bool rejoin_overlap = true;
};

struct ReplicaReport {
  std::string node;
  bool alive = true;
  std::string error;            // why it was declared dead
  uint64_t bytes_read = 0;      // including what rejoin() copied from it
  uint64_t bytes_written = 0;   // including what rejoin() copied to it
  int64_t rejoins = 0;          // times it came back (rejoin)
  uint64_t bytes_resynced = 0;  // copied to it by those rejoins
};

class UcxRemoteTransport final : public Transport {
 public:
  static constexpr size_t kMaxReplicas = 8;
  static Result<std::unique_ptr<UcxRemoteTransport>> create(UcxRemoteConfig config);
  ~UcxRemoteTransport() override;
  UcxRemoteTransport(const UcxRemoteTransport&) = delete;
  UcxRemoteTransport& operator=(const UcxRemoteTransport&) = delete;

  std::string_view name() const override { return "ucx"; }
  Capabilities capabilities() const override;
  Status register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) override;
  Result<TransferHandle> prepare(const TransferBatch& batch) override;
  Status post(TransferHandle& handle) override;
  Status poll(TransferHandle& handle) override;
  void release(TransferHandle& handle) override;

  TierId tier() const { return config_.tier; }
  // Brings dead replica `index` back on `region` (a node restarted at the same address, or a
  // spare): copies the whole registered tier into it from a live replica, then sends it writes
  // and fails reads over to it again. Call it between transfers: it answers kInProgress while a
  // transfer is in flight (that transfer's writes did not go to the region; try again later),
  // and every transfer posted meanwhile waits for the copy. kInvalidArgument for a replica that
  // is alive or a bad region, kResourceExhausted for a region smaller than the tier,
  // kUnavailable when no replica lives (there is nothing to copy from: the tier is lost) or
  // when the region fails during the copy (the replica stays dead).
  Status rejoin(size_t index, RemoteRegion region);
  bool tier_lost(TierId tier) const override;  // the served tier, with no replica alive
  // For a lost tier: "no replica alive (node A: why; node B: why)".
  std::string tier_loss(TierId tier) const override;
  std::vector<ReplicaReport> replicas() const;
  int64_t failovers() const;  // reads re-issued on another replica
  // Requests prepared, and the RMA operations they became after adjacent rows were merged.
  struct Counts {
    int64_t requests = 0;
    int64_t operations = 0;
  };
  Counts counts() const;

 private:
  explicit UcxRemoteTransport(UcxRemoteConfig config);
  struct Replica {
    ReplicaReport report;
    ucp_ep_h ep = nullptr;
    ucp_rkey_h rkey = nullptr;
    uint64_t address = 0;
    uint64_t region = 0;  // the node's id and key of the region (kNodeGather requests name them)
    ucx_wire::RegionKey key{};
    bool joining = false;  // alive, being filled by rejoin: takes no reads and no transfers' writes
    bool serves() const { return report.alive && !joining; }  // reads and transfers' writes go to it
  };
  struct LocalTier {
    MemoryKind kind = MemoryKind::kHost;
    std::byte* base = nullptr;
    uint64_t bytes = 0;
    std::unique_ptr<UcxMemory> memory;
  };
  struct Part {
    uint64_t remote_offset = 0;
    std::byte* local = nullptr;
    uint64_t bytes = 0;
    ucp_mem_h memh = nullptr;
  };
  enum class State : uint8_t { kPrepared, kRunning, kDone, kFailed };
  struct Leg {  // the reads, or the writes to one replica, and what completes them
    int replica = -1;
    ucs_status_ptr_t flush = nullptr;  // kRma
    int64_t chunks_left = 0;           // kNodeGather: replies still to come
    uint32_t attempt = 0;              // kNodeGather: replies of earlier attempts are ignored
    std::string refused;               // kNodeGather: the node refused a chunk (not a peer failure)
    std::chrono::steady_clock::time_point started;
    bool finished = false;
    bool ok = false;
  };
  struct Pending {  // one kNodeGather chunk in flight
    uint64_t op = 0;
    int leg = -1;  // -1: the reads, else op.write[leg]
    uint32_t attempt = 0;
    size_t first = 0, end = 0;  // its parts
  };
  struct Op {
    uint64_t id = 0;
    std::vector<Part> reads;   // remote → local
    std::vector<Part> writes;  // local → remote
    State state = State::kPrepared;
    Status error;
    Leg read;
    std::vector<Leg> write;  // one per replica alive at post time
  };
  static void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  // kRma only where a NIC checks every access against the region's key: this worker's transports
  // all do (transports_enforce_rkeys) and each region came with a remote key. kInvalidArgument
  // saying why not.
  Status rma_allowed(const std::vector<RemoteRegion>& regions) const;
  Status connect_replicas();  // in create
  // Endpoint and remote key of `region` for replica `index` (still marked dead). Requires mu_.
  Status connect_replica(size_t index, const RemoteRegion& region);
  // rejoin's copy of the tier from replica `source` to `target`, through a registered bounce
  // buffer in two halves (the next chunk is read while the last is written). Requires mu_ and
  // no transfer in flight.
  Status copy_replica(int source, int target);
  // Runs transfers built by copy_replica together to their end (bounded by op_timeout per leg);
  // the first failure.
  Status run_internal(std::vector<Op> ops);
  static void coalesce(std::vector<Part>& parts);
  static void split_parts(std::vector<Part>& parts);
  Op* find(const TransferHandle& handle);  // requires mu_
  // Issues the leg's RMA operations and its flush; false (replica marked dead) on a failed issue.
  bool start_leg(Op& op, int leg_index);
  bool start_rma(Leg& leg, const std::vector<Part>& parts, bool reading);
  bool start_chunks(Op& op, int leg_index);
  // Advances a leg; true once it has finished (ok or not). Requires mu_.
  bool advance_leg(Op& op, int leg_index);
  ucs_status_t leg_status(Leg& leg);
  void forget_chunks(uint64_t op, int leg_index);  // drops the leg's (or with -2, the op's) pending chunks
  struct SendBuffer {
    UcxRemoteTransport* owner;
    std::vector<uint8_t> bytes;
  };
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t on_reply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  void advance(Op& op);
  void mark_dead(int replica, const std::string& why);
  void force_close(Replica& r);  // closes its endpoint now (completing what was posted to it), not waited for
  int first_live() const;
  std::string replicas_text() const;
  std::string who() const;
  void drain(Op& op);  // waits until no leg of op is in flight (bounded by op_timeout)

  const UcxRemoteConfig config_;
  mutable std::mutex mu_;  // guards everything below, and every call into worker_
  std::unique_ptr<UcxWorker> worker_;
  std::vector<Replica> replicas_;
  uint64_t remote_bytes_ = 0;  // registered size of the remote tier (0 until registered)
  std::unordered_map<TierId, LocalTier> local_;
  std::unordered_map<uint64_t, Op> ops_;
  std::unordered_map<uint64_t, Pending> pending_;  // kNodeGather chunks by token
  std::unordered_map<uint64_t, int> awaiting_;     // every unanswered chunk (also released ones) → replica
  uint64_t next_id_ = 1;
  uint64_t next_token_ = 1;
  int64_t sends_in_flight_ = 0;
  int64_t failovers_ = 0;
  int64_t requests_ = 0;
  int64_t rma_parts_ = 0;
};

}  // namespace specontext::transport
