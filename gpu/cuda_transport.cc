#include "gpu/cuda_transport.h"

#include <algorithm>
#include <string>
#include <utility>

#include "gpu/cuda_backend.h"
#include "gpu/cuda_check.h"
#include "gpu/kernels.h"

namespace specontext::gpu {

namespace {

std::string tier_text(TierId tier) { return "tier " + std::to_string(tier.value()); }

uint64_t address(const void* p) { return reinterpret_cast<uint64_t>(p); }

}  // namespace

Result<std::unique_ptr<CudaTransport>> CudaTransport::create(int device_ordinal,
                                                             CudaTransportOptions options) {
  SPX_ASSIGN_OR_RETURN(const int count, cuda_device_count());
  if (device_ordinal < 0 || device_ordinal >= count) {
    return out_of_range("cuda transport: CUDA device " + std::to_string(device_ordinal) + " requested, " +
                        std::to_string(count) + " present");
  }
  ScopedDevice scope(device_ordinal);
  SPX_RETURN_IF_ERROR(scope.status());
  SPX_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::create(cudaStreamNonBlocking));
  return std::unique_ptr<CudaTransport>(new CudaTransport(device_ordinal, options, std::move(stream)));
}

CudaTransport::CudaTransport(int device, CudaTransportOptions options, CudaStream stream)
    : device_(device), options_(options), stream_(std::move(stream)), tiers_("cuda") {}

CudaTransport::~CudaTransport() {
  ScopedDevice scope(device_);
  std::lock_guard lock(mu_);
  for (auto& [id, op] : ops_) {
    if (op->has_event) log_error(op->done.synchronize(), "CudaTransport teardown");
  }
  ops_.clear();
  log_error(stream_.synchronize(), "CudaTransport teardown");
}

Capabilities CudaTransport::capabilities() const {
  Capabilities caps;
  caps.add(MemoryKind::kPinnedHost, MemoryKind::kDevice);
  caps.add(MemoryKind::kDevice, MemoryKind::kPinnedHost);
  caps.add(MemoryKind::kDevice, MemoryKind::kDevice);
  return caps;
}

Status CudaTransport::register_tier(TierId tier, MemoryKind kind, void* base, uint64_t bytes) {
  const std::string who = "cuda: register " + tier_text(tier);
  if (kind != MemoryKind::kPinnedHost && kind != MemoryKind::kDevice) {
    return unimplemented(who + ": memory kind " + std::string(memory_kind_name(kind)) + " is not supported");
  }
  if (base == nullptr) return invalid_argument(who + ": null base");
  if (bytes == 0) return invalid_argument(who + ": zero size");
  ScopedDevice scope(device_);
  SPX_RETURN_IF_ERROR(scope.status());
  // Both ends of the range must be memory of the declared kind (one allocation or registration
  // cannot be proven, but a range running off its allocation usually ends in other memory).
  TierAddress at;
  at.host = address(base);
  for (uint64_t off : {uint64_t{0}, bytes - 1}) {
    cudaPointerAttributes attr{};
    SPX_CUDA_CHECK(cudaPointerGetAttributes(&attr, static_cast<std::byte*>(base) + off));
    if (kind == MemoryKind::kPinnedHost) {
      if (attr.type != cudaMemoryTypeHost) {
        return invalid_argument(
            who + ": byte " + std::to_string(off) +
            " is not page-locked host memory (allocate it with cudaHostAlloc or register it "
            "with PinnedHostRegistration)");
      }
      if (off == 0) at.device = address(attr.devicePointer);  // null: not mapped for this device
    } else {
      if (attr.type != cudaMemoryTypeDevice || attr.device != device_) {
        return invalid_argument(who + ": byte " + std::to_string(off) +
                                " is not device memory of CUDA device " + std::to_string(device_));
      }
      at.device = at.host;
      at.on_device = true;
    }
  }
  std::lock_guard lock(mu_);
  SPX_RETURN_IF_ERROR(tiers_.add(tier, kind, static_cast<std::byte*>(base), bytes,
                                 {MemoryKind::kPinnedHost, MemoryKind::kDevice}));
  addresses_.emplace(tier, at);
  return Status::ok();
}

Result<TransferHandle> CudaTransport::prepare(const TransferBatch& batch) {
  std::lock_guard lock(mu_);
  std::vector<transport::ResolvedCopy> resolved;
  SPX_RETURN_IF_ERROR(tiers_.resolve(batch, capabilities(), resolved));
  std::vector<CopyRange> copies(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const TransferRequest& r = batch[i];
    const TierAddress& src = addresses_.at(r.src_tier);
    const TierAddress& dst = addresses_.at(r.dst_tier);
    CopyRange& c = copies[i];
    c.src = address(resolved[i].src);
    c.dst = address(resolved[i].dst);
    c.src_dev = src.device == 0 ? 0 : src.device + r.src_offset;
    c.dst_dev = dst.device == 0 ? 0 : dst.device + r.dst_offset;
    c.bytes = r.bytes;
    c.src_on_device = src.on_device;
    c.dst_on_device = dst.on_device;
    c.request = i;
  }
  auto op = std::make_unique<Op>();
  SPX_ASSIGN_OR_RETURN(
      op->plan, plan_transfer(copies, TransferPlanOptions{options_.method, options_.gather_below_bytes}));
  const uint64_t id = next_id_++;
  ops_.emplace(id, std::move(op));
  return make_handle(id);
}

Result<CudaTransport::Op*> CudaTransport::find(const TransferHandle& handle) {
  if (!handle.valid() || handle.owner() != this) {
    return invalid_argument("cuda: handle is not a live transfer of this transport");
  }
  auto it = ops_.find(handle.id());
  if (it == ops_.end()) return invalid_argument("cuda: handle was released");
  return it->second.get();
}

Result<CudaEvent> CudaTransport::take_event() {
  if (!event_pool_.empty()) {
    CudaEvent ev = std::move(event_pool_.back());
    event_pool_.pop_back();
    return ev;
  }
  return CudaEvent::create();
}

Result<DeviceBuffer<uint8_t>> CudaTransport::take_pieces_buffer(size_t bytes) {
  // The smallest pooled buffer that fits; a new one (rounded up) when none does.
  auto best = pieces_pool_.end();
  for (auto it = pieces_pool_.begin(); it != pieces_pool_.end(); ++it) {
    if (it->size() >= bytes && (best == pieces_pool_.end() || it->size() < best->size())) best = it;
  }
  if (best != pieces_pool_.end()) {
    DeviceBuffer<uint8_t> buffer = std::move(*best);
    pieces_pool_.erase(best);
    return buffer;
  }
  return DeviceBuffer<uint8_t>::create(std::max<size_t>(bytes + bytes / 2, 4096));
}

void CudaTransport::recycle(Op& op) {
  if (op.has_event) event_pool_.push_back(std::move(op.done));
  op.has_event = false;
  if (!op.pieces.empty()) pieces_pool_.push_back(std::move(op.pieces));
}

Status CudaTransport::post(TransferHandle& handle) {
  Op* op = nullptr;
  {
    std::lock_guard lock(mu_);
    SPX_ASSIGN_OR_RETURN(op, find(handle));
    if (op->posted || op->posting) return invalid_argument("cuda: transfer posted twice");
    if (op->plan.segments.empty()) {  // nothing to copy
      op->posted = true;
      return Status::ok();
    }
    ScopedDevice scope(device_);
    SPX_RETURN_IF_ERROR(scope.status());
    // Resources first: without them nothing has started, which is NO_RESOURCE (post again later).
    Result<CudaEvent> ev = take_event();
    if (!ev.is_ok()) return resource_exhausted("cuda: no event for the transfer: " + ev.status().message());
    if (op->plan.method == CopyMethod::kGatherKernel) {
      const size_t bytes = op->plan.pieces.size() * sizeof(kernels::CopyPiece);
      Result<DeviceBuffer<uint8_t>> buffer = take_pieces_buffer(bytes);
      if (!buffer.is_ok()) {
        event_pool_.push_back(std::move(ev).value());
        return resource_exhausted("cuda: no device memory for the piece list: " + buffer.status().message());
      }
      op->pieces = std::move(buffer).value();
      // The list travels once per transfer, stream-ordered before the kernel that reads it.
      const Status uploaded = staging_.copy(op->pieces.data(), op->plan.pieces.data(), bytes, stream_.get());
      if (!uploaded.is_ok()) {
        pieces_pool_.push_back(std::move(op->pieces));
        event_pool_.push_back(std::move(ev).value());
        return uploaded;
      }
    }
    op->done = std::move(ev).value();
    op->posting = true;
  }
  // Enqueue outside the lock (a DMA batch may be thousands of calls). The caller owns the handle,
  // so nobody releases the op meanwhile, and ops_ holds it by pointer.
  const Status enqueued = enqueue(*op);
  std::lock_guard lock(mu_);
  op->posting = false;
  op->posted = true;
  if (!enqueued.is_ok()) {
    op->error = enqueued;
    return enqueued;
  }
  return in_progress("cuda: transfer enqueued");
}

Status CudaTransport::enqueue(Op& op) {
  ScopedDevice scope(device_);
  SPX_RETURN_IF_ERROR(scope.status());
  Status status;
  if (op.plan.method == CopyMethod::kGatherKernel) {
    status =
        cuda_status(kernels::launch_gather_copy(reinterpret_cast<const kernels::CopyPiece*>(op.pieces.data()),
                                                static_cast<int64_t>(op.plan.pieces.size()), stream_.get()),
                    "launch_gather_copy");
  } else {
    for (const CopyRange& s : op.plan.segments) {
      status =
          cuda_status(cudaMemcpyAsync(reinterpret_cast<void*>(s.dst), reinterpret_cast<const void*>(s.src),
                                      s.bytes, cudaMemcpyDefault, stream_.get()),
                      "cudaMemcpyAsync");
      if (!status.is_ok()) break;
    }
  }
  // Record even after a failure: copies enqueued before it still run, and release() must wait.
  const Status recorded = op.done.record(stream_.get());
  if (recorded.is_ok()) {
    op.has_event = true;
  } else {
    log_error(stream_.synchronize(), "cuda transport: waiting after a failed event record");
    if (status.is_ok()) status = recorded;
  }
  return status;
}

Status CudaTransport::poll(TransferHandle& handle) {
  std::lock_guard lock(mu_);
  SPX_ASSIGN_OR_RETURN(Op * op, find(handle));
  if (op->posting) return in_progress("cuda: transfer being enqueued");
  if (!op->posted) return invalid_argument("cuda: poll of a transfer that was not posted");
  if (!op->error.is_ok()) return op->error;
  if (!op->has_event) return Status::ok();
  const Status s = op->done.query();
  if (s.code() == StatusCode::kInProgress) return s;
  if (!s.is_ok()) op->error = s;
  return s;
}

void CudaTransport::release(TransferHandle& handle) {
  std::unique_ptr<Op> op;
  {
    std::lock_guard lock(mu_);
    if (handle.valid() && handle.owner() == this) {
      auto it = ops_.find(handle.id());
      if (it != ops_.end()) {
        op = std::move(it->second);
        ops_.erase(it);
      }
    }
  }
  reset_handle(handle);
  if (op == nullptr) return;
  if (op->has_event) {
    // The copies cannot be withdrawn from the stream: wait for them, outside the lock.
    ScopedDevice scope(device_);
    const Status waited = op->done.synchronize();
    log_error(waited, "cuda transport: release");
    if (!waited.is_ok()) return;  // a faulted event or buffer is not pooled
  }
  std::lock_guard lock(mu_);
  recycle(*op);
}

Result<CopyMethod> CudaTransport::method_of(const TransferHandle& handle) {
  std::lock_guard lock(mu_);
  SPX_ASSIGN_OR_RETURN(Op * op, find(handle));
  return op->plan.method;
}

Status CudaTransport::order_after(cudaStream_t producer) {
  ScopedDevice scope(device_);
  SPX_RETURN_IF_ERROR(scope.status());
  std::lock_guard lock(mu_);
  SPX_ASSIGN_OR_RETURN(CudaEvent ev, take_event());
  SPX_RETURN_IF_ERROR(ev.record(producer));
  SPX_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ev.get(), 0));
  // The wait captured the event's state at this point: re-recording it later is safe.
  event_pool_.push_back(std::move(ev));
  return Status::ok();
}

Status CudaTransport::make_stream_wait(const TransferHandle& handle, cudaStream_t consumer) {
  std::lock_guard lock(mu_);
  SPX_ASSIGN_OR_RETURN(Op * op, find(handle));
  if (!op->posted || op->posting) return invalid_argument("cuda: make_stream_wait on a transfer not posted");
  if (!op->error.is_ok()) return op->error;
  if (!op->has_event) return Status::ok();
  ScopedDevice scope(device_);
  SPX_RETURN_IF_ERROR(scope.status());
  SPX_CUDA_CHECK(cudaStreamWaitEvent(consumer, op->done.get(), 0));
  return Status::ok();
}

}  // namespace specontext::gpu
