#include "transport/loopback_transport.h"

#include <cstring>
#include <new>

namespace specontext::transport {

Result<std::unique_ptr<LoopbackRemoteTransport>> LoopbackRemoteTransport::create(
    LoopbackConfig config) {
  if (config.latency.count() < 0) return invalid_argument("loopback: negative latency");
  return std::unique_ptr<LoopbackRemoteTransport>(new LoopbackRemoteTransport(config));
}

LoopbackRemoteTransport::LoopbackRemoteTransport(LoopbackConfig config)
    : config_(config), tiers_("loopback") {
  worker_ = std::thread([this] { worker_loop(); });
}

LoopbackRemoteTransport::~LoopbackRemoteTransport() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

Capabilities LoopbackRemoteTransport::capabilities() const {
  Capabilities caps;
  caps.remote = true;
  for (MemoryKind local : {MemoryKind::kHost, MemoryKind::kPinnedHost}) {
    caps.add(local, MemoryKind::kRemote);
    caps.add(MemoryKind::kRemote, local);
  }
  return caps;
}

Status LoopbackRemoteTransport::register_tier(TierId tier, MemoryKind kind, void* base,
                                              uint64_t bytes) {
  const std::vector<MemoryKind> kinds = {MemoryKind::kHost, MemoryKind::kPinnedHost,
                                         MemoryKind::kRemote};
  std::lock_guard lock(mu_);
  if (kind != MemoryKind::kRemote) {
    return tiers_.add(tier, kind, static_cast<std::byte*>(base), bytes, kinds);
  }
  if (base != nullptr) {
    return invalid_argument("loopback: register tier " + std::to_string(tier.value()) +
                            ": a remote tier takes a null base (its memory is the peer's)");
  }
  if (bytes == 0) {
    return invalid_argument("loopback: register tier " + std::to_string(tier.value()) +
                            ": zero size");
  }
  std::unique_ptr<std::byte[]> memory(new (std::nothrow) std::byte[bytes]());
  if (!memory) {
    return resource_exhausted("loopback: cannot allocate " + std::to_string(bytes) +
                              " bytes for remote tier " + std::to_string(tier.value()));
  }
  SPX_RETURN_IF_ERROR(tiers_.add(tier, kind, memory.get(), bytes, kinds));
  remote_memory_.push_back(std::move(memory));
  return Status::ok();
}

Result<TransferHandle> LoopbackRemoteTransport::prepare(const TransferBatch& batch) {
  std::lock_guard lock(mu_);
  Op op;
  SPX_RETURN_IF_ERROR(tiers_.resolve(batch, capabilities(), op.copies));
  const uint64_t id = next_id_++;
  ops_.emplace(id, std::move(op));
  return make_handle(id);
}

LoopbackRemoteTransport::Op* LoopbackRemoteTransport::find(const TransferHandle& handle) {
  if (!handle.valid() || handle.owner() != this) return nullptr;
  auto it = ops_.find(handle.id());
  return it == ops_.end() ? nullptr : &it->second;
}

Status LoopbackRemoteTransport::post(TransferHandle& handle) {
  {
    std::lock_guard lock(mu_);
    Op* op = find(handle);
    if (op == nullptr) return invalid_argument("loopback: post of an unknown or released handle");
    if (op->state != State::kPrepared) return invalid_argument("loopback: transfer posted twice");
    op->state = State::kQueued;
    queue_.push_back(handle.id());
  }
  cv_.notify_all();
  return in_progress();
}

Status LoopbackRemoteTransport::poll(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  Op* op = find(handle);
  if (op == nullptr) return invalid_argument("loopback: poll of an unknown or released handle");
  switch (op->state) {
    case State::kPrepared: return invalid_argument("loopback: poll of a transfer not posted");
    case State::kQueued:
    case State::kCopying: return in_progress();
    case State::kDone: return Status::ok();
  }
  return internal_error("loopback: bad transfer state");
}

void LoopbackRemoteTransport::release(TransferHandle& handle) {
  std::unique_lock lock(mu_);
  if (Op* op = find(handle)) {
    // A copy in flight reads/writes the caller's buffers: wait for it (bounded by one copy).
    cv_.wait(lock, [&] { return op->state != State::kCopying; });
    // A queued id left in queue_ is skipped by the worker once the op is gone.
    ops_.erase(handle.id());
  }
  reset_handle(handle);
}

void LoopbackRemoteTransport::worker_loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const uint64_t id = queue_.front();
    if (!ops_.contains(id)) {  // released before it was served
      queue_.pop_front();
      continue;
    }
    // The link latency: interruptible by stop; the op may be released while we wait.
    if (config_.latency.count() > 0) {
      const auto deadline = std::chrono::steady_clock::now() + config_.latency;
      if (cv_.wait_until(lock, deadline, [&] { return stop_; })) return;
    }
    queue_.pop_front();
    auto it = ops_.find(id);
    if (it == ops_.end()) continue;
    Op& op = it->second;  // unordered_map nodes are stable; release waits for kCopying to end
    op.state = State::kCopying;
    const std::vector<ResolvedCopy> copies = op.copies;
    lock.unlock();
    for (const ResolvedCopy& c : copies) {
      if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
    }
    lock.lock();
    op.state = State::kDone;
    cv_.notify_all();
  }
}

}  // namespace specontext::transport
