#include "transport/ucx_transport.h"

#include <algorithm>

#include "transport/tier_table.h"
#include "transport/ucx_wire.h"

#include <cstring>

namespace specontext::transport {

namespace {

using Clock = std::chrono::steady_clock;

bool is_local_kind(MemoryKind k) { return k == MemoryKind::kHost || k == MemoryKind::kPinnedHost; }

// Checks a request pointer once; frees it when terminal. INPROGRESS keeps it.
ucs_status_t check_request(ucs_status_ptr_t& request) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) {
    const ucs_status_t s = UCS_PTR_STATUS(request);
    request = nullptr;
    return s;
  }
  const ucs_status_t s = ucp_request_check_status(request);
  if (s != UCS_INPROGRESS) {
    ucp_request_free(request);
    request = nullptr;
  }
  return s;
}

}  // namespace

UcxRemoteTransport::UcxRemoteTransport(UcxRemoteConfig config) : config_(std::move(config)) {}

std::string UcxRemoteTransport::who() const { return "ucx tier " + std::to_string(config_.tier.value()); }

Result<std::unique_ptr<UcxRemoteTransport>> UcxRemoteTransport::create(UcxRemoteConfig config) {
  const std::string who = "ucx tier " + std::to_string(config.tier.value());
  if (!config.tier.valid()) return invalid_argument("ucx: invalid remote tier id");
  if (config.replicas.empty() || config.replicas.size() > kMaxReplicas) {
    return invalid_argument(who + ": needs 1.." + std::to_string(kMaxReplicas) + " replicas, got " +
                            std::to_string(config.replicas.size()));
  }
  if (config.op_timeout.count() <= 0) return invalid_argument(who + ": op_timeout must be positive");
  const bool rma = config.mode == UcxTransferMode::kRma;
  for (const RemoteRegion& r : config.replicas) {
    if (r.worker_address.empty() || r.bytes == 0) {
      return invalid_argument(who + ": replica " + r.node + " has no worker address or size");
    }
  }
  std::unique_ptr<UcxRemoteTransport> t(new UcxRemoteTransport(std::move(config)));
  SPX_ASSIGN_OR_RETURN(t->worker_, UcxWorker::create(who, /*wakeup=*/false, rma));
  if (rma) SPX_RETURN_IF_ERROR(t->rma_allowed(t->config_.replicas));
  SPX_RETURN_IF_ERROR(t->connect_replicas());
  return t;
}

Status UcxRemoteTransport::rma_allowed(const std::vector<RemoteRegion>& regions) const {
  // Over a transport that checks no remote key, a get or put goes to whatever address is named:
  // a key confines nothing, and a client could read and write every other client's KV.
  const std::vector<std::string> tls = worker_->transports();
  if (!transports_enforce_rkeys(tls)) {
    return invalid_argument(
        who() + ": one-sided RMA (--kv-node-mode rma) is refused: this client's UCX transports (" +
        transport_list(tls) +
        ") do not check remote keys, so nothing would confine a client's gets and puts to its "
        "own region; use --kv-node-mode gather");
  }
  for (const RemoteRegion& r : regions) {
    if (r.rkey.empty()) {
      return invalid_argument(
          who() + ": one-sided RMA (--kv-node-mode rma) is refused: kv node " + r.node +
          " hands out no remote keys (" +
          (r.rma_refused.empty() ? std::string("it serves node-side gathers only") : r.rma_refused) +
          "); use --kv-node-mode gather");
    }
  }
  return Status::ok();
}

Status UcxRemoteTransport::connect_replicas() {
  std::lock_guard lock(mu_);
  for (unsigned id : {ucx_wire::kGatherReply, ucx_wire::kScatterReply}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = &UcxRemoteTransport::on_reply;
    hp.arg = this;
    SPX_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_->worker(), &hp), who() + ": active-message handler");
  }
  replicas_.resize(config_.replicas.size());
  // A replica that cannot be reached now starts out dead: the tier is served by the others.
  for (size_t i = 0; i < config_.replicas.size(); ++i) {
    if (Status s = connect_replica(i, config_.replicas[i]); !s.is_ok()) {
      replicas_[i].report.alive = false;
      replicas_[i].report.error = s.message();
    }
  }
  if (first_live() < 0) return unavailable(who() + ": no replica reachable (" + replicas_text() + ")");
  return Status::ok();
}

Status UcxRemoteTransport::connect_replica(size_t index, const RemoteRegion& region) {
  Replica& r = replicas_[index];
  r.report.node = region.node;
  r.address = region.address;
  r.region = region.region;
  r.key = region.key;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(region.worker_address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &UcxRemoteTransport::on_endpoint_error;
  ep.err_handler.arg = this;
  ucs_status_t s = ucp_ep_create(worker_->worker(), &ep, &r.ep);
  if (s != UCS_OK) {
    r.ep = nullptr;
    return unavailable(std::string("cannot connect: ") + ucs_status_string(s));
  }
  if (config_.mode != UcxTransferMode::kRma) return Status::ok();  // gathers name region and key
  s = ucp_ep_rkey_unpack(r.ep, region.rkey.data(), &r.rkey);
  if (s != UCS_OK) {
    r.rkey = nullptr;
    force_close(r);
    return invalid_argument(std::string("bad remote key: ") + ucs_status_string(s));
  }
  return Status::ok();
}

Status UcxRemoteTransport::rejoin(size_t index, RemoteRegion region) {
  std::lock_guard lock(mu_);
  const std::string what = who() + ": rejoin of replica " + std::to_string(index) + " on " + region.node;
  if (index >= replicas_.size()) {
    return invalid_argument(what + ": the tier has " + std::to_string(replicas_.size()) + " replicas");
  }
  Replica& r = replicas_[index];
  if (r.report.alive) return invalid_argument(what + ": it is alive");
  if (region.worker_address.empty()) return invalid_argument(what + ": the region has no worker address");
  if (config_.mode == UcxTransferMode::kRma) SPX_RETURN_IF_ERROR(rma_allowed({region}));
  if (region.bytes < remote_bytes_) {
    return resource_exhausted(what + ": the region holds " + std::to_string(region.bytes) +
                              " bytes, the tier " + std::to_string(remote_bytes_));
  }
  // A transfer in flight chose its replicas when it was posted; its writes would miss the region.
  for (const auto& [id, op] : ops_) {
    if (op.state == State::kRunning)
      return in_progress(what + ": transfers are in flight; rejoin between them");
  }
  const int source = first_live();
  if (source < 0)
    return unavailable(what + ": no live replica to copy the tier from (" + replicas_text() + ")");
  if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
  r.rkey = nullptr;
  if (Status s = connect_replica(index, region); !s.is_ok()) {
    r.report.error = s.message();
    return s.with_context(what);
  }
  r.report.alive = true;
  r.report.error.clear();
  r.joining = true;
  Status copied = copy_replica(source, static_cast<int>(index));
  r.joining = false;
  if (!copied.is_ok()) {
    mark_dead(static_cast<int>(index), "rejoin failed: " + copied.message());
    return unavailable(what + ": " + copied.message());
  }
  ++r.report.rejoins;
  r.report.bytes_resynced += remote_bytes_;
  return Status::ok();
}

Status UcxRemoteTransport::copy_replica(int source, int target) {
  if (remote_bytes_ == 0) return Status::ok();  // the tier is not registered: nothing written yet
  // Two halves of one registered bounce buffer: chunk i+1 is read into one while chunk i is
  // written from the other, so the copy costs about max(read, write) per chunk, not their sum.
  constexpr uint64_t kChunkBytes = 4 << 20;
  const uint64_t chunk = std::min(kChunkBytes, remote_bytes_);
  std::vector<std::byte> bounce(2 * chunk);
  SPX_ASSIGN_OR_RETURN(auto memory, UcxMemory::map(*worker_, bounce.data(), bounce.size()));
  const uint64_t chunks = (remote_bytes_ + chunk - 1) / chunk;
  auto parts_of = [&](uint64_t i) {
    const uint64_t at = i * chunk;
    std::vector<Part> parts{
        Part{at, bounce.data() + (i % 2) * chunk, std::min(chunk, remote_bytes_ - at), memory->handle()}};
    if (config_.mode == UcxTransferMode::kNodeGather) split_parts(parts);
    return parts;
  };
  auto read_op = [&](uint64_t i) {
    Op read;
    read.reads = parts_of(i);
    read.read.replica = source;  // fails over to another live one (never to the joining target)
    return read;
  };
  auto write_op = [&](uint64_t i) {
    Op write;
    write.writes = parts_of(i);
    Leg leg;
    leg.replica = target;
    write.write.push_back(leg);
    return write;
  };
  constexpr const char* kReading = "reading the tier from a live replica";
  constexpr const char* kCopying = "copying the tier from a live replica to the region";
  SPX_RETURN_IF_ERROR_CTX(run_internal({read_op(0)}), kReading);
  for (uint64_t i = 0; i < chunks; ++i) {
    const bool next = i + 1 < chunks;
    if (next && config_.rejoin_overlap) {
      SPX_RETURN_IF_ERROR_CTX(run_internal({write_op(i), read_op(i + 1)}), kCopying);
    } else {
      SPX_RETURN_IF_ERROR_CTX(run_internal({write_op(i)}), kCopying);
      if (next) SPX_RETURN_IF_ERROR_CTX(run_internal({read_op(i + 1)}), kReading);
    }
  }
  return Status::ok();
}

Status UcxRemoteTransport::run_internal(std::vector<Op> built) {
  std::vector<uint64_t> ids;
  for (Op& b : built) {
    const uint64_t id = next_id_++;
    b.id = id;
    b.state = State::kRunning;
    Op& op = ops_.emplace(id, std::move(b)).first->second;  // replies find it by id
    ids.push_back(id);
    if (!op.reads.empty()) (void)start_leg(op, -1);
    for (size_t i = 0; i < op.write.size(); ++i) (void)start_leg(op, static_cast<int>(i));
  }
  for (bool running = true; running;) {
    running = false;
    for (uint64_t id : ids) {
      Op& op = ops_.at(id);
      advance(op);
      running |= op.state == State::kRunning;
    }
  }
  Status result = Status::ok();
  for (uint64_t id : ids) {
    Op& op = ops_.at(id);
    if (result.is_ok() && op.state != State::kDone) {
      result = op.error;
      if (!op.write.empty() && !op.write[0].ok && op.read.refused.empty() && op.write[0].refused.empty()) {
        const Replica& r = replicas_[static_cast<size_t>(op.write[0].replica)];
        result = unavailable("node " + r.report.node + ": " +
                             (r.report.error.empty() ? "failed" : r.report.error));
      }
    }
    drain(op);
    forget_chunks(id, -2);
    ops_.erase(id);
  }
  return result;
}

UcxRemoteTransport::~UcxRemoteTransport() {
  std::lock_guard lock(mu_);
  for (auto& [id, op] : ops_) drain(op);
  ops_.clear();
  pending_.clear();
  // Let live nodes answer what was asked of them (bounded), then close gracefully, so that a node
  // never replies into an endpoint whose peer is half gone.
  const auto until = Clock::now() + config_.op_timeout;
  while ((!awaiting_.empty() || sends_in_flight_ > 0) && Clock::now() < until)
    ucp_worker_progress(worker_->worker());
  for (Replica& r : replicas_) {
    if (r.rkey != nullptr) ucp_rkey_destroy(r.rkey);
    r.rkey = nullptr;
    if (r.ep != nullptr) {
      ucp_request_param_t p{};
      if (!awaiting_.empty()) {  // a node did not answer in time: do not wait for it
        p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      }
      (void)ucx_wait(worker_->worker(), ucp_ep_close_nbx(r.ep, &p), "close");
      r.ep = nullptr;
    }
  }
  // Messages still being sent on force-closed endpoints complete with an error at the next
  // progress; their buffers are freed then.
  const auto sends_until = Clock::now() + config_.op_timeout;
  while (sends_in_flight_ > 0 && Clock::now() < sends_until) ucp_worker_progress(worker_->worker());
  local_.clear();  // unmaps before the worker (declared first) goes
}

void UcxRemoteTransport::on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Runs inside ucp_worker_progress, i.e. under mu_ (every progress call holds it).
  auto* self = static_cast<UcxRemoteTransport*>(arg);
  for (size_t i = 0; i < self->replicas_.size(); ++i) {
    if (self->replicas_[i].ep == ep) {
      self->mark_dead(static_cast<int>(i), std::string("peer failure: ") + ucs_status_string(status));
    }
  }
}

void UcxRemoteTransport::mark_dead(int replica, const std::string& why) {
  Replica& r = replicas_[static_cast<size_t>(replica)];
  if (!r.report.alive) return;
  r.report.alive = false;
  for (auto it = awaiting_.begin(); it != awaiting_.end();) {  // it will not answer them
    it = it->second == replica ? awaiting_.erase(it) : std::next(it);
  }
  r.report.error = why;
  // Force-closing completes (with an error) every flush and RMA operation posted to the node, so
  // no leg waits on a dead peer.
  force_close(r);
}

void UcxRemoteTransport::force_close(Replica& r) {
  // Not waited for: this may run inside progress.
  if (r.ep == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(r.ep, &p);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) ucp_request_free(req);
  r.ep = nullptr;
}

int UcxRemoteTransport::first_live() const {
  for (size_t i = 0; i < replicas_.size(); ++i) {
    if (replicas_[i].serves()) return static_cast<int>(i);
  }
  return -1;
}

std::string UcxRemoteTransport::replicas_text() const {
  std::string out;
  for (const Replica& r : replicas_) {
    if (!out.empty()) out += "; ";
    out += "node " + r.report.node + ": " + (r.report.alive ? "alive" : r.report.error);
  }
  return out;
}

Capabilities UcxRemoteTransport::capabilities() const {
  Capabilities caps;
  for (MemoryKind k : {MemoryKind::kHost, MemoryKind::kPinnedHost}) {
    caps.add(k, MemoryKind::kRemote);
    caps.add(MemoryKind::kRemote, k);
  }
  caps.remote = true;
  return caps;
}

Status UcxRemoteTransport::register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) {
  std::lock_guard lock(mu_);
  const std::string what = who() + ": register tier " + std::to_string(tier.value());
  if (!tier.valid()) return invalid_argument(what + ": invalid tier id");
  if (bytes == 0) return invalid_argument(what + ": zero size");
  if (tier == config_.tier) {
    if (kind != MemoryKind::kRemote) return invalid_argument(what + ": the served tier must be kRemote");
    if (remote_bytes_ != 0) return invalid_argument(what + ": already registered");
    for (const RemoteRegion& r : config_.replicas) {
      if (r.bytes < bytes) {
        return resource_exhausted(what + ": node " + r.node + " holds " + std::to_string(r.bytes) +
                                  " bytes for it, " + std::to_string(bytes) + " asked");
      }
    }
    remote_bytes_ = bytes;
    return Status::ok();
  }
  if (kind == MemoryKind::kRemote) {
    return unimplemented(what + ": this transport serves remote tier " +
                         std::to_string(config_.tier.value()) + " only");
  }
  if (!is_local_kind(kind)) {
    return unimplemented(what + ": memory kind " + std::string(memory_kind_name(kind)) + " is not supported");
  }
  if (base == nullptr) return invalid_argument(what + ": null base");
  if (local_.contains(tier)) return invalid_argument(what + ": already registered");
  LocalTier lt;
  lt.kind = kind;
  lt.base = static_cast<std::byte*>(base);
  lt.bytes = bytes;
  SPX_ASSIGN_OR_RETURN(lt.memory, UcxMemory::map(*worker_, base, bytes));
  local_.emplace(tier, std::move(lt));
  return Status::ok();
}

Result<TransferHandle> UcxRemoteTransport::prepare(const TransferBatch& batch) {
  std::lock_guard lock(mu_);
  Op op;
  const TierInfo remote_info{MemoryKind::kRemote, nullptr, remote_bytes_};
  for (size_t i = 0; i < batch.size(); ++i) {
    const TransferRequest& r = batch[i];
    const std::string where = who() + ": request " + std::to_string(i);
    const bool read = r.src_tier == config_.tier && remote_bytes_ != 0;
    const bool write = r.dst_tier == config_.tier && remote_bytes_ != 0;
    const TierId local_id = read ? r.dst_tier : r.src_tier;
    auto it = local_.find(local_id);
    if (read == write || it == local_.end()) {
      auto known = [&](TierId t) { return (t == config_.tier && remote_bytes_ != 0) || local_.contains(t); };
      if (!known(r.src_tier))
        return invalid_argument(where + ": src tier " + std::to_string(r.src_tier.value()) +
                                " is not registered");
      if (!known(r.dst_tier))
        return invalid_argument(where + ": dst tier " + std::to_string(r.dst_tier.value()) +
                                " is not registered");
      return unimplemented(where + ": tier " + std::to_string(r.src_tier.value()) + " -> tier " +
                           std::to_string(r.dst_tier.value()) + " is not local <-> remote");
    }
    const LocalTier& lt = it->second;
    const TierInfo local_info{lt.kind, lt.base, lt.bytes};
    SPX_RETURN_IF_ERROR(
        check_request_ranges(r, read ? remote_info : local_info, read ? local_info : remote_info, where));
    if (r.bytes == 0) continue;
    Part p;
    p.bytes = r.bytes;
    p.memh = lt.memory->handle();
    if (read) {
      p.remote_offset = r.src_offset;
      p.local = lt.base + r.dst_offset;
      op.reads.push_back(p);
    } else {
      p.remote_offset = r.dst_offset;
      p.local = lt.base + r.src_offset;
      op.writes.push_back(p);
    }
  }
  requests_ += static_cast<int64_t>(op.reads.size() + op.writes.size());
  coalesce(op.reads);
  coalesce(op.writes);
  if (config_.mode == UcxTransferMode::kNodeGather) {
    split_parts(op.reads);
    split_parts(op.writes);
  }
  rma_parts_ += static_cast<int64_t>(op.reads.size() + op.writes.size());
  const uint64_t id = next_id_++;
  op.id = id;
  ops_.emplace(id, std::move(op));
  return make_handle(id);
}

void UcxRemoteTransport::coalesce(std::vector<Part>& parts) {
  // Elastic loads are rows of a few hundred bytes, and over TCP every RMA operation is a round
  // trip of its own; rows adjacent on both sides (a head's consecutive tokens in a page, copied to
  // consecutive working-set slots) become one operation. Order within a transfer is free.
  if (parts.size() < 2) return;
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.remote_offset < b.remote_offset; });
  size_t out = 0;
  for (size_t i = 1; i < parts.size(); ++i) {
    Part& last = parts[out];
    const Part& p = parts[i];
    if (p.memh == last.memh && p.remote_offset == last.remote_offset + last.bytes &&
        p.local == last.local + last.bytes) {
      last.bytes += p.bytes;
    } else {
      parts[++out] = p;
    }
  }
  parts.resize(out + 1);
}

void UcxRemoteTransport::split_parts(std::vector<Part>& parts) {
  // A node-side chunk moves at most kMaxChunkBytes: larger parts (layer migrations) are cut.
  std::vector<Part> out;
  for (const Part& p : parts) {
    for (uint64_t done = 0; done < p.bytes; done += ucx_wire::kMaxChunkBytes) {
      Part piece = p;
      piece.remote_offset += done;
      piece.local += done;
      piece.bytes = std::min(ucx_wire::kMaxChunkBytes, p.bytes - done);
      out.push_back(piece);
    }
  }
  parts = std::move(out);
}

UcxRemoteTransport::Op* UcxRemoteTransport::find(const TransferHandle& handle) {
  if (!handle.valid() || handle.owner() != this) return nullptr;
  auto it = ops_.find(handle.id());
  return it == ops_.end() ? nullptr : &it->second;
}

bool UcxRemoteTransport::start_leg(Op& op, int leg_index) {
  Leg& leg = leg_index < 0 ? op.read : op.write[static_cast<size_t>(leg_index)];
  leg.started = Clock::now();
  leg.finished = false;
  leg.ok = false;
  if (config_.mode == UcxTransferMode::kRma)
    return start_rma(leg, leg_index < 0 ? op.reads : op.writes, leg_index < 0);
  return start_chunks(op, leg_index);
}

bool UcxRemoteTransport::start_rma(Leg& leg, const std::vector<Part>& parts, bool reading) {
  Replica& r = replicas_[static_cast<size_t>(leg.replica)];
  for (const Part& p : parts) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    param.memh = p.memh;
    const uint64_t addr = r.address + p.remote_offset;
    ucs_status_ptr_t req = reading ? ucp_get_nbx(r.ep, p.local, p.bytes, addr, r.rkey, &param)
                                   : ucp_put_nbx(r.ep, p.local, p.bytes, addr, r.rkey, &param);
    if (UCS_PTR_IS_ERR(req)) {
      mark_dead(leg.replica,
                std::string(reading ? "get" : "put") + " failed: " + ucs_status_string(UCS_PTR_STATUS(req)));
      return false;
    }
    // The flush below completes it; the request object itself is not needed.
    if (req != nullptr) ucp_request_free(req);
    if (!r.report.alive) return false;  // the error handler ran meanwhile
  }
  ucp_request_param_t fp{};
  leg.flush = ucp_ep_flush_nbx(r.ep, &fp);
  if (UCS_PTR_IS_ERR(leg.flush)) {
    mark_dead(leg.replica, std::string("flush failed: ") + ucs_status_string(UCS_PTR_STATUS(leg.flush)));
    leg.flush = nullptr;
    return false;
  }
  return true;
}

void UcxRemoteTransport::on_send_done(void* request, ucs_status_t, void* user_data) {
  // Runs inside progress (under mu_): the message's bytes are no longer needed.
  auto* buf = static_cast<SendBuffer*>(user_data);
  --buf->owner->sends_in_flight_;
  delete buf;
  if (request != nullptr) ucp_request_free(request);
}

bool UcxRemoteTransport::start_chunks(Op& op, int leg_index) {
  Leg& leg = leg_index < 0 ? op.read : op.write[static_cast<size_t>(leg_index)];
  const bool reading = leg_index < 0;
  const std::vector<Part>& parts = reading ? op.reads : op.writes;
  Replica& r = replicas_[static_cast<size_t>(leg.replica)];
  ++leg.attempt;
  leg.chunks_left = 0;
  leg.refused.clear();
  size_t first = 0;
  while (first < parts.size()) {
    // One chunk: as many parts as fit kMaxChunkBytes and kMaxChunkRanges (prepare split larger
    // parts), one range each.
    size_t end = first;
    uint64_t bytes = 0;
    while (end < parts.size() && end - first < ucx_wire::kMaxChunkRanges &&
           bytes + parts[end].bytes <= ucx_wire::kMaxChunkBytes) {
      bytes += parts[end].bytes;
      ++end;
    }
    std::vector<ucx_wire::Range> ranges;
    for (size_t i = first; i < end; ++i)
      ranges.push_back({r.address + parts[i].remote_offset, parts[i].bytes});
    const uint64_t token = next_token_++;
    pending_[token] = Pending{op.id, leg_index, leg.attempt, first, end};
    // The message owns its bytes (header first) until UCX reports the send complete.
    auto* sb = new SendBuffer{
        this, std::vector<uint8_t>(sizeof(ucx_wire::RequestHeader) + ranges.size() * sizeof(ucx_wire::Range) +
                                   (reading ? 0 : bytes))};
    std::vector<uint8_t>* buf = &sb->bytes;
    const ucx_wire::RequestHeader hdr{token, static_cast<uint32_t>(ranges.size()), 0, r.region, r.key};
    std::memcpy(buf->data(), &hdr, sizeof hdr);
    uint8_t* at = buf->data() + sizeof hdr;
    std::memcpy(at, ranges.data(), ranges.size() * sizeof(ucx_wire::Range));
    at += ranges.size() * sizeof(ucx_wire::Range);
    if (!reading) {
      // The rows are copied into the message now, so the caller's buffers are free after post.
      for (size_t i = first; i < end; ++i) {
        std::memcpy(at, parts[i].local, parts[i].bytes);
        at += parts[i].bytes;
      }
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    param.cb.send = &UcxRemoteTransport::on_send_done;
    param.user_data = sb;
    ucs_status_ptr_t req =
        ucp_am_send_nbx(r.ep, reading ? ucx_wire::kGather : ucx_wire::kScatter, buf->data(), sizeof hdr,
                        buf->data() + sizeof hdr, buf->size() - sizeof hdr, &param);
    if (req == nullptr) {
      delete sb;  // sent in place; the callback is not called
    } else if (UCS_PTR_IS_ERR(req)) {
      delete sb;
      pending_.erase(token);
      mark_dead(leg.replica, std::string("send failed: ") + ucs_status_string(UCS_PTR_STATUS(req)));
      return false;
    }
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) ++sends_in_flight_;
    awaiting_[token] = leg.replica;
    ++leg.chunks_left;
    if (!r.report.alive) return false;
    first = end;
  }
  return true;
}

void UcxRemoteTransport::forget_chunks(uint64_t op, int leg_index) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.op == op && (leg_index == -2 || it->second.leg == leg_index)) {
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

ucs_status_t UcxRemoteTransport::on_reply(void* arg, const void* header, size_t header_length, void* data,
                                          size_t length, const ucp_am_recv_param_t* param) {
  // Runs inside ucp_worker_progress, i.e. under mu_.
  auto* self = static_cast<UcxRemoteTransport*>(arg);
  if (header_length != sizeof(ucx_wire::ReplyHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    return UCS_OK;  // not ours (or a protocol we never ask for): dropped
  }
  ucx_wire::ReplyHeader hdr;
  std::memcpy(&hdr, header, sizeof hdr);
  self->awaiting_.erase(hdr.token);
  auto it = self->pending_.find(hdr.token);
  if (it == self->pending_.end()) return UCS_OK;  // released, or an earlier attempt
  const Pending p = it->second;
  self->pending_.erase(it);
  auto op_it = self->ops_.find(p.op);
  if (op_it == self->ops_.end()) return UCS_OK;
  Op& op = op_it->second;
  Leg& leg = p.leg < 0 ? op.read : op.write[static_cast<size_t>(p.leg)];
  if (leg.attempt != p.attempt || leg.finished) return UCS_OK;
  const Replica& r = self->replicas_[static_cast<size_t>(leg.replica)];
  if (hdr.status != UCS_OK) {
    leg.refused = "node " + r.report.node + " refused a " + (p.leg < 0 ? "gather" : "scatter") + ": " +
                  ucs_status_string(static_cast<ucs_status_t>(hdr.status));
  } else if (p.leg < 0) {
    uint64_t expect = 0;
    for (size_t i = p.first; i < p.end; ++i) expect += op.reads[i].bytes;
    if (length != expect) {
      leg.refused = "node " + r.report.node + " sent " + std::to_string(length) + " bytes for a gather of " +
                    std::to_string(expect);
    } else {
      const auto* src = static_cast<const uint8_t*>(data);
      for (size_t i = p.first; i < p.end; ++i) {
        std::memcpy(op.reads[i].local, src, op.reads[i].bytes);
        src += op.reads[i].bytes;
      }
    }
  }
  --leg.chunks_left;
  return UCS_OK;
}

ucs_status_t UcxRemoteTransport::leg_status(Leg& leg) {
  if (config_.mode == UcxTransferMode::kRma) return check_request(leg.flush);
  if (leg.chunks_left > 0 && leg.refused.empty()) return UCS_INPROGRESS;
  return UCS_OK;  // a refusal is reported by advance_leg
}

bool UcxRemoteTransport::advance_leg(Op& op, int leg_index) {
  Leg& leg = leg_index < 0 ? op.read : op.write[static_cast<size_t>(leg_index)];
  const bool reading = leg_index < 0;
  const std::vector<Part>& parts = reading ? op.reads : op.writes;
  while (!leg.finished) {
    if (leg.replica >= 0 && replicas_[static_cast<size_t>(leg.replica)].report.alive) {
      const ucs_status_t s = leg_status(leg);
      if (s == UCS_INPROGRESS) {
        if (Clock::now() - leg.started < config_.op_timeout) return false;
        mark_dead(leg.replica, "silent for " + std::to_string(config_.op_timeout.count()) + " ms");
        // The forced close completes the flush with an error at a later progress.
        return false;
      }
      if (!leg.refused.empty()) {
        // The node answered but would not serve the ranges: not a failure of the peer, and no
        // other replica would answer differently.
        forget_chunks(op.id, leg_index);
        leg.finished = true;
        return true;
      }
      if (s == UCS_OK) {
        uint64_t bytes = 0;
        for (const Part& p : parts) bytes += p.bytes;
        ReplicaReport& rep = replicas_[static_cast<size_t>(leg.replica)].report;
        (reading ? rep.bytes_read : rep.bytes_written) += bytes;
        leg.finished = leg.ok = true;
        return true;
      }
      mark_dead(leg.replica, std::string("flush failed: ") + ucs_status_string(s));
    }
    // The leg's replica is dead. Its flush (if any) completes with an error once the forced close
    // has run; until then it may still touch the buffers. Replies of node-side chunks can no
    // longer come (and would be ignored: the attempt changes).
    if (leg.flush != nullptr && check_request(leg.flush) == UCS_INPROGRESS) return false;
    forget_chunks(op.id, leg_index);
    if (!reading) {
      leg.finished = true;
      return true;
    }
    const int next = first_live();
    if (next < 0) {
      leg.finished = true;
      return true;
    }
    if (leg.replica >= 0) ++failovers_;
    leg.replica = next;
    (void)start_leg(op, leg_index);  // on failure the loop sees the replica dead
  }
  return true;
}

void UcxRemoteTransport::advance(Op& op) {
  if (op.state != State::kRunning) return;
  // Progress until nothing more happens now (bounded), so that a large transfer is not paced by
  // the caller's polling interval.
  const Clock::time_point until = Clock::now() + std::chrono::microseconds(200);
  while (ucp_worker_progress(worker_->worker()) != 0 && Clock::now() < until) {
  }
  bool all = true;
  if (!op.reads.empty()) all &= advance_leg(op, -1);
  for (size_t i = 0; i < op.write.size(); ++i) all &= advance_leg(op, static_cast<int>(i));
  if (!all) return;
  auto refusal = [&]() -> std::string {
    if (!op.read.refused.empty()) return op.read.refused;
    for (const Leg& l : op.write) {
      if (!l.refused.empty()) return l.refused;
    }
    return "";
  };
  const bool read_ok = op.reads.empty() || op.read.ok;
  const bool write_ok =
      op.writes.empty() || std::any_of(op.write.begin(), op.write.end(), [](const Leg& l) { return l.ok; });
  if (read_ok && write_ok) {
    op.state = State::kDone;
  } else if (const std::string why = refusal(); !why.empty()) {
    op.state = State::kFailed;
    op.error = data_loss(who() + ": " + why);
  } else {
    op.state = State::kFailed;
    op.error = unavailable(who() + ": no live replica (" + replicas_text() + ")");
  }
}

Status UcxRemoteTransport::post(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  Op* op = find(handle);
  if (op == nullptr) return invalid_argument(who() + ": post of a handle that is not a live transfer");
  if (op->state != State::kPrepared) return invalid_argument(who() + ": transfer posted twice");
  op->state = State::kRunning;
  if (first_live() < 0) {
    op->state = State::kFailed;
    op->error = unavailable(who() + ": no live replica (" + replicas_text() + ")");
    return op->error;
  }
  if (!op->reads.empty()) {
    op->read.replica = first_live();
    (void)start_leg(*op, -1);
  }
  if (!op->writes.empty()) {
    for (size_t i = 0; i < replicas_.size(); ++i) {
      if (!replicas_[i].serves()) continue;
      Leg leg;
      leg.replica = static_cast<int>(i);
      op->write.push_back(leg);
    }
    for (size_t i = 0; i < op->write.size(); ++i) (void)start_leg(*op, static_cast<int>(i));
  }
  advance(*op);
  if (op->state == State::kDone) return Status::ok();
  if (op->state == State::kFailed) return op->error;
  return in_progress("ucx transfer in flight");
}

Status UcxRemoteTransport::poll(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  Op* op = find(handle);
  if (op == nullptr) return invalid_argument(who() + ": poll of a handle that is not a live transfer");
  if (op->state == State::kPrepared)
    return invalid_argument(who() + ": poll of a transfer that was not posted");
  advance(*op);
  if (op->state == State::kDone) return Status::ok();
  if (op->state == State::kFailed) return op->error;
  return in_progress("ucx transfer in flight");
}

void UcxRemoteTransport::drain(Op& op) {
  // Until every flush of the op has completed, UCX may still write the local buffers of its
  // reads (or read those of its writes). A replica that does not answer within op_timeout is
  // declared dead, and its forced close completes what is left.
  auto busy = [&] {
    if (op.read.flush != nullptr && check_request(op.read.flush) == UCS_INPROGRESS) return true;
    for (Leg& l : op.write) {
      if (l.flush != nullptr && check_request(l.flush) == UCS_INPROGRESS) return true;
    }
    return false;
  };
  const Clock::time_point start = Clock::now();
  while (busy()) {
    ucp_worker_progress(worker_->worker());
    if (Clock::now() - start > config_.op_timeout) {
      auto kill = [&](Leg& l) {
        if (l.flush != nullptr && l.replica >= 0)
          mark_dead(l.replica, "did not complete a cancelled transfer");
      };
      kill(op.read);
      for (Leg& l : op.write) kill(l);
    }
  }
}

void UcxRemoteTransport::release(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  if (Op* op = find(handle)) {
    drain(*op);
    forget_chunks(op->id, -2);  // late replies find nothing to write into
    ops_.erase(handle.id());
  }
  reset_handle(handle);
}

std::string UcxRemoteTransport::tier_loss(TierId tier) const {
  std::lock_guard lock(mu_);
  if (tier != config_.tier || first_live() >= 0) return {};
  return "no replica alive (" + replicas_text() + ")";
}

bool UcxRemoteTransport::tier_lost(TierId tier) const {
  std::lock_guard lock(mu_);
  return tier == config_.tier && first_live() < 0;
}

std::vector<ReplicaReport> UcxRemoteTransport::replicas() const {
  std::lock_guard lock(mu_);
  std::vector<ReplicaReport> out;
  for (const Replica& r : replicas_) out.push_back(r.report);
  return out;
}

UcxRemoteTransport::Counts UcxRemoteTransport::counts() const {
  std::lock_guard lock(mu_);
  return Counts{requests_, rma_parts_};
}

int64_t UcxRemoteTransport::failovers() const {
  std::lock_guard lock(mu_);
  return failovers_;
}

}  // namespace specontext::transport
