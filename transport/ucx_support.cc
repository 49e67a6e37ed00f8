#include "transport/ucx_support.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace specontext::transport {

Status ucx_status(ucs_status_t status, std::string_view what) {
  std::string msg = std::string(what) + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NOT_CONNECTED:
      return unavailable(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return resource_exhausted(std::move(msg));
    default:
      return internal_error(std::move(msg));
  }
}

Result<std::unique_ptr<UcxWorker>> UcxWorker::create(std::string_view who, bool wakeup, bool rma) {
  const std::string ctx = std::string(who) + ": UCX";
  ucp_config_t* config = nullptr;
  SPX_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config), ctx + " config");
  if (std::getenv("UCX_TLS") == nullptr) {
    const ucs_status_t s = ucp_config_modify(config, "TLS", "tcp");
    if (s != UCS_OK) {
      ucp_config_release(config);
      return ucx_status(s, ctx + " TLS=tcp");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | (rma ? UCP_FEATURE_RMA : 0) | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  const ucs_status_t init = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  SPX_UCX_CHECK(init, ctx + " init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // every owner serialises its calls with a mutex
  SPX_UCX_CHECK(ucp_worker_create(w->context_, &wp, &w->worker_), ctx + " worker");
  return w;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

Result<std::vector<uint8_t>> UcxWorker::address() const {
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  SPX_UCX_CHECK(ucp_worker_get_address(worker_, &addr, &len), "UCX worker address");
  std::vector<uint8_t> out(reinterpret_cast<const uint8_t*>(addr),
                           reinterpret_cast<const uint8_t*>(addr) + len);
  ucp_worker_release_address(worker_, addr);
  return out;
}

std::vector<std::string> UcxWorker::transports() const {
  // Lines "#      resource 0  :  md 0  dev 0  flags -- tcp/lo": the name before the '/'.
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  if (out == nullptr) return {};
  ucp_context_print_info(context_, out);
  std::fclose(out);
  std::vector<std::string> names;
  const std::string_view all(text, size);
  for (size_t at = all.find("resource"); at != std::string_view::npos; at = all.find("resource", at + 1)) {
    const size_t eol = std::min(all.find('\n', at), all.size());
    const std::string_view line = all.substr(at, eol - at);
    const size_t dashes = line.find("-- ");
    if (dashes == std::string_view::npos) continue;
    const std::string_view rest = line.substr(dashes + 3);
    std::string name(rest.substr(0, rest.find('/')));
    if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end())
      names.push_back(std::move(name));
  }
  std::free(text);
  return names;
}

bool transports_enforce_rkeys(const std::vector<std::string>& transports) {
  static constexpr std::string_view kVerbs[] = {"rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5"};
  if (transports.empty()) return false;
  return std::all_of(transports.begin(), transports.end(), [](const std::string& t) {
    return std::find(std::begin(kVerbs), std::end(kVerbs), t) != std::end(kVerbs);
  });
}

std::string transport_list(const std::vector<std::string>& transports) {
  std::string out;
  for (const std::string& t : transports) out += (out.empty() ? "" : ", ") + t;
  return out.empty() ? "none" : out;
}

Result<std::unique_ptr<UcxMemory>> UcxMemory::map(const UcxWorker& worker, void* base, uint64_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = bytes;
  std::unique_ptr<UcxMemory> m(new UcxMemory());
  m->context_ = worker.context();
  SPX_UCX_CHECK(ucp_mem_map(worker.context(), &mp, &m->memh_),
                "UCX mem_map of " + std::to_string(bytes) + " bytes");
  return m;
}

UcxMemory::~UcxMemory() {
  if (memh_ != nullptr) (void)ucp_mem_unmap(context_, memh_);
}

Result<std::vector<uint8_t>> UcxMemory::packed_rkey() const {
  void* buf = nullptr;
  size_t len = 0;
  SPX_UCX_CHECK(ucp_rkey_pack(context_, memh_, &buf, &len), "UCX rkey_pack");
  std::vector<uint8_t> out(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + len);
  ucp_rkey_buffer_release(buf);
  return out;
}

Status ucx_wait(ucp_worker_h worker, ucs_status_ptr_t request, std::string_view what) {
  if (request == nullptr) return Status::ok();
  if (UCS_PTR_IS_ERR(request)) return ucx_status(UCS_PTR_STATUS(request), what);
  ucs_status_t s;
  while ((s = ucp_request_check_status(request)) == UCS_INPROGRESS) ucp_worker_progress(worker);
  ucp_request_free(request);
  return s == UCS_OK ? Status::ok() : ucx_status(s, what);
}

}  // namespace specontext::transport
