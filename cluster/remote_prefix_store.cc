#include "cluster/remote_prefix_store.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "cluster/kv_node_client.h"

namespace specontext::cluster {
namespace {

constexpr TierId kStaging{0};
constexpr TierId kRegion{1};

}  // namespace

RemotePrefixStore::RemotePrefixStore(RemotePrefixStoreOptions options) : options_(std::move(options)) {}

RemotePrefixStore::~RemotePrefixStore() = default;

Result<std::unique_ptr<RemotePrefixStore>> RemotePrefixStore::create(RemotePrefixStoreOptions options) {
  if (options.replicas.empty() || options.replicas.size() > transport::UcxRemoteTransport::kMaxReplicas) {
    return invalid_argument("remote prefix store: 1 to " +
                            std::to_string(transport::UcxRemoteTransport::kMaxReplicas) + " KV nodes, not " +
                            std::to_string(options.replicas.size()));
  }
  if (options.bytes == 0 || options.staging_bytes == 0) {
    return invalid_argument("remote prefix store: its size and its staging size must be positive");
  }
  std::unique_ptr<RemotePrefixStore> store(new RemotePrefixStore(std::move(options)));
  RemotePrefixStoreOptions& o = store->options_;
  store->name_ = "kv-node ";
  transport::UcxRemoteConfig cfg;
  cfg.tier = kRegion;
  cfg.op_timeout = o.timeout;
  cfg.mode = o.mode;
  for (size_t i = 0; i < o.replicas.size(); ++i) {
    const std::string node = o.replicas[i].text();
    store->name_ += (i ? "+" : "") + node;
    SPX_ASSIGN_OR_RETURN(auto session, KvNodeClient::connect(o.replicas[i], o.timeout, o.access));
    auto region = session->allocate(o.bytes);
    if (!region.is_ok()) return region.status().with_context("remote prefix store on " + node);
    cfg.replicas.push_back(std::move(region).value());
    store->sessions_.push_back(std::move(session));
  }
  SPX_ASSIGN_OR_RETURN(store->transport_, transport::UcxRemoteTransport::create(std::move(cfg)));
  store->staging_.resize(static_cast<size_t>(std::min(o.staging_bytes, o.bytes)));
  SPX_RETURN_IF_ERROR(store->transport_->register_tier(kStaging, MemoryKind::kHost, store->staging_.data(),
                                                       store->staging_.size()));
  SPX_RETURN_IF_ERROR(store->transport_->register_tier(kRegion, MemoryKind::kRemote, nullptr, o.bytes));
  store->allocator_ = RegionAllocator(o.bytes);
  store->counts_.replicas = store->counts_.live = static_cast<int64_t>(o.replicas.size());
  return store;
}

Status RemotePrefixStore::move(bool to_remote, uint64_t offset, uint64_t bytes) {
  // Whatever way it ends (a refused prepare too: a replica may have died in UCX progress since).
  struct Look {
    RemotePrefixStore* store;
    ~Look() { store->look_at_replicas(); }
  } look{this};
  const TransferRequest request = to_remote ? TransferRequest{kStaging, 0, kRegion, offset, bytes}
                                            : TransferRequest{kRegion, offset, kStaging, 0, bytes};
  SPX_ASSIGN_OR_RETURN(TransferHandle handle, transport_->prepare({request}));
  // The transport declares a silent replica dead after `timeout`; this bounds the rest.
  const auto deadline = std::chrono::steady_clock::now() + 2 * options_.timeout + std::chrono::seconds(1);
  const auto before_deadline = [&] { return std::chrono::steady_clock::now() < deadline; };
  Status st = transport_->post(handle);
  while (st.code() == StatusCode::kResourceExhausted && before_deadline()) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    st = transport_->post(handle);
  }
  while (st.code() == StatusCode::kInProgress && before_deadline()) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    st = transport_->poll(handle);
  }
  transport_->release(handle);
  if (st.code() == StatusCode::kInProgress || st.code() == StatusCode::kResourceExhausted) {
    return unavailable(name_ + ": a transfer of " + std::to_string(bytes) + " bytes did not finish in time");
  }
  return st.is_ok() ? st : st.with_context(name_);
}

void RemotePrefixStore::look_at_replicas() {
  TierReplicas now;
  now.tier = kRegion.value();
  now.name = "prefix offload (--prefix-offload-remote)";
  now.replicas = transport_->replicas();
  now.lost_note = "the prefixes offloaded there are dropped and their prompts computed";
  counts_.live = std::count_if(now.replicas.begin(), now.replicas.end(), [](const auto& r) { return r.alive; });
  const std::vector<std::string> lines = events_.update({now});
  counts_.deaths = events_.deaths();
  if (options_.on_event) {
    for (const std::string& line : lines) options_.on_event(line);
  }
}

Result<uint64_t> RemotePrefixStore::put(std::span<const std::byte> blob) {
  if (blob.empty()) return invalid_argument(name_ + ": an empty blob");
  SPX_ASSIGN_OR_RETURN(const uint64_t offset, allocator_.allocate(blob.size()));
  for (uint64_t done = 0; done < blob.size();) {
    const uint64_t n = std::min<uint64_t>(staging_.size(), blob.size() - done);
    std::memcpy(staging_.data(), blob.data() + done, n);
    if (Status st = move(/*to_remote=*/true, offset + done, n); !st.is_ok()) {
      (void)allocator_.free(offset);
      return st;
    }
    done += n;
  }
  sizes_[offset] = blob.size();
  return offset;
}

Result<std::vector<std::byte>> RemotePrefixStore::get(uint64_t key) {
  const auto it = sizes_.find(key);
  if (it == sizes_.end()) return not_found(name_ + ": no blob at key " + std::to_string(key));
  std::vector<std::byte> out(static_cast<size_t>(it->second));
  for (uint64_t done = 0; done < out.size();) {
    const uint64_t n = std::min<uint64_t>(staging_.size(), out.size() - done);
    SPX_RETURN_IF_ERROR(move(/*to_remote=*/false, key + done, n));
    std::memcpy(out.data() + done, staging_.data(), n);
    done += n;
  }
  return out;
}

void RemotePrefixStore::remove(uint64_t key) {
  if (sizes_.erase(key) > 0) (void)allocator_.free(key);
}

}  // namespace specontext::cluster
