#include "cluster/kv_node.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <iostream>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "cluster/kv_node_auth.h"
#include "cluster/kv_node_tls.h"
#include "core/base/region_allocator.h"
#include "transport/ucx_support.h"
#include "transport/ucx_wire.h"

#include <cstring>

namespace specontext::cluster {

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

// Anonymous mapping: pages cost memory only once a client writes them.
struct MappedPool {
  void* base = nullptr;
  uint64_t bytes = 0;
  MappedPool() = default;
  MappedPool(const MappedPool&) = delete;
  MappedPool& operator=(const MappedPool&) = delete;
  ~MappedPool() {
    if (base != nullptr) munmap(base, bytes);
  }
};

}  // namespace

class KvNode::Impl {
 public:
  // Who holds what: quotas and connection limits are per client, across its connections. The
  // shared secret's client (and, on an open node, everyone) has the ID "".
  struct Client {
    std::string id;
    std::string secret;
    uint64_t quota = 0;           // 0: up to the capacity
    int64_t max_connections = 0;  // 0: only the node's limit
    bool keyed = false;           // from the keys file: sees its own stats only
    uint64_t held = 0;            // bytes its connections' regions hold
    int64_t regions = 0;
    int64_t connections = 0;      // authenticated ones
  };
  struct Session : std::enable_shared_from_this<Session> {
    Session(Impl& node, tcp::socket s, asio::ssl::context* tls, std::string peer)
        : node(node), stream(std::move(s), tls), idle(stream.get_executor()), peer(std::move(peer)) {}
    Impl& node;
    ControlStream stream;  // TLS on a node with a certificate
    asio::steady_timer idle;
    std::string peer;  // HOST:PORT of the client, for the log
    std::string in;
    std::string out;
    std::unordered_set<uint64_t> regions;
    uint64_t held_bytes = 0;         // of its regions (its client's quota counts them)
    Client* client = nullptr;        // once authenticated
    std::string claimed;             // the client ID its last hello named
    uint64_t lines = 0;              // requests received; the idle timer checks it moved
    bool started = false;            // its first bytes checked (and, with TLS, its handshake done)
    bool authenticated = false;      // from the start on a node without a secret
    std::optional<AuthNonce> nonce;  // of the last hello, until answered
  };
  // A reply, and whether the connection ends after it (failed authentication, overlong line).
  struct Answer {
    std::string line;
    bool close_after = false;
  };

  KvNodeOptions options;
  std::string name;
  uint16_t bound_port = 0;
  uint64_t page_bytes = 4096;  // regions are whole pages
  MappedPool pool;
  std::unique_ptr<transport::UcxWorker> worker;
  std::string worker_address_hex;
  // Why the node hands out no remote keys for one-sided RMA (hello "rma_refused"); see init().
  std::string rma_refused;

  std::shared_ptr<asio::ssl::context> tls;  // null: plain TCP
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread io_thread;
  std::thread ucx_thread;
  std::atomic<bool> stopping{false};
  bool stopped = false;

  // Touched by the io thread only.
  std::unordered_map<std::string, Client> clients;  // by ID; filled by init(), never grown after
  std::string decoy_secret;  // answers for an unknown ID are checked against it (same work, no match)
  RegionAllocator allocator;
  std::unordered_set<std::shared_ptr<Session>> sessions;

  // What a client may touch: a request names its region (a random id) and that region's key (128
  // random bits), and every range must lie inside the region. Nothing else reaches the pool: the
  // worker has no UCP_FEATURE_RMA and no region is registered for RMA (see init()).
  struct Region {
    uint64_t offset = 0;
    uint64_t bytes = 0;  // as allocated (whole alignment units)
    transport::ucx_wire::RegionKey key{};
  };
  // Guards every call into the UCX worker and context (the progress thread holds it around
  // progress, so the gather / scatter handlers run under it) and `regions`, which the io thread
  // changes and the handlers read.
  std::mutex ucx_mu;
  std::unordered_map<uint64_t, Region> regions;  // region id → region

  mutable std::mutex stats_mu;
  KvNodeStats counters;

  Status init() {
    pool.bytes = options.capacity;
    void* p = mmap(nullptr, options.capacity, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return resource_exhausted("kv node: cannot map " + std::to_string(options.capacity) + " bytes");
    }
    pool.base = p;
    // Regions in whole pages, so that free_region can hand them back with madvise.
    page_bytes = static_cast<uint64_t>(std::max(4096L, sysconf(_SC_PAGESIZE)));
    allocator = RegionAllocator(options.capacity, page_bytes);
    boost::system::error_code ec;
    const auto addr = asio::ip::make_address(options.host, ec);
    if (ec) return invalid_argument("kv node: listen address '" + options.host + "': " + ec.message());
    if (!auth_required() && !addr.is_loopback()) {
      return invalid_argument("kv node: refusing to listen on " + options.host +
                              " without a secret: anyone who reaches it could allocate its memory. Give "
                              "--secret-file PATH (or set " +
                              std::string(kSecretEnv) + "), or listen on a loopback address (127.0.0.1)");
    }
    if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
      SPX_ASSIGN_OR_RETURN(tls, make_node_tls_context(options.tls_cert_file, options.tls_key_file));
    }
    if (!auth_required() || !options.secret.empty()) {
      clients[""] = Client{"", options.secret, options.client_quota, 0, false};
    }
    for (const KvClientKey& k : options.clients) {
      if (!valid_client_id(k.id) || clients.contains(k.id)) {
        return invalid_argument("kv node: client ID '" + k.id.substr(0, kMaxClientIdBytes) +
                                "' is not valid or given twice");
      }
      clients[k.id] = Client{k.id, k.secret, k.quota, k.max_connections, true};
    }
    std::array<uint8_t, 32> decoy{};
    SPX_RETURN_IF_ERROR(fill_random(decoy));
    decoy_secret = hex_encode(decoy);
    const tcp::endpoint ep(addr, options.port);
    acceptor.open(ep.protocol(), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(ep, ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return unavailable("kv node: cannot listen on " + options.host + ":" + std::to_string(options.port) +
                         ": " + ec.message());
    }
    bound_port = acceptor.local_endpoint().port();
    name = options.name.empty() ? options.host + ":" + std::to_string(bound_port) : options.name;
    // No UCP_FEATURE_RMA: with it, UCP's software RMA handlers would copy to and from any address
    // a client names (a client's own region's key, or a forged one, is enough to reach them), over
    // TCP and over an RDMA NIC alike. Without it those requests are dropped, and the node serves
    // node-side gathers only, each checked against its region's key and bounds.
    SPX_ASSIGN_OR_RETURN(worker,
                         transport::UcxWorker::create("kv node " + name, /*wakeup=*/true, /*rma=*/false));
    const std::vector<std::string> tls = worker->transports();
    rma_refused = transport::transports_enforce_rkeys(tls)
                      ? "UCX's software RMA would read and write any address of the node a client names"
                      : "its UCX transports (" + transport::transport_list(tls) +
                            ") check no remote keys: RMA would reach any address of the node";
    SPX_ASSIGN_OR_RETURN(std::vector<uint8_t> waddr, worker->address());
    worker_address_hex = hex_encode(waddr);
    for (bool gather : {true, false}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = gather ? transport::ucx_wire::kGather : transport::ucx_wire::kScatter;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      hp.cb = gather ? &Impl::on_gather : &Impl::on_scatter;
      hp.arg = this;
      SPX_UCX_CHECK(ucp_worker_set_am_recv_handler(worker->worker(), &hp),
                    "kv node " + name + ": active-message handler");
    }
    counters.capacity = options.capacity;
    accept();
    io_thread = std::thread([this] { io.run(); });
    ucx_thread = std::thread([this] { progress_loop(); });
    return Status::ok();
  }

  // ---- node-side gather / scatter (UCX thread) ----
  struct Reply {
    Impl* node;
    std::vector<uint8_t> bytes;  // ReplyHeader, then the packed rows of a gather
  };
  static void on_reply_sent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<Reply*>(user_data);
    if (request != nullptr) ucp_request_free(request);
  }
  static ucs_status_t on_gather(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    static_cast<Impl*>(arg)->serve(true, header, header_length, data, length, param);
    return UCS_OK;
  }
  static ucs_status_t on_scatter(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
    static_cast<Impl*>(arg)->serve(false, header, header_length, data, length, param);
    return UCS_OK;
  }

  // Checks the request against its region (known id, its key, every range inside it, sizes that
  // add up) before touching memory; a bad request gets a refusal status, never a crash or a
  // partial copy. Runs under ucx_mu (inside progress).
  void serve(bool gather, const void* header, size_t header_length, const void* data, size_t length,
             const ucp_am_recv_param_t* param) {
    namespace wire = transport::ucx_wire;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        header_length != sizeof(wire::RequestHeader)) {
      bump([](KvNodeStats& c) { ++c.bad_requests; });
      return;  // nobody to answer
    }
    wire::RequestHeader hdr;
    std::memcpy(&hdr, header, sizeof hdr);
    ucs_status_t status = UCS_OK;
    uint64_t total = 0;
    const size_t list_bytes = static_cast<size_t>(hdr.ranges) * sizeof(wire::Range);
    std::vector<wire::Range> ranges;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || hdr.ranges > wire::kMaxChunkRanges ||
        length < list_bytes) {
      status = UCS_ERR_INVALID_PARAM;
    } else if (auto it = regions.find(hdr.region);
               it == regions.end() || !transport::ucx_wire::same_key(it->second.key, hdr.key)) {
      status = UCS_ERR_REJECTED;  // not a region of this node, or not the caller's
    } else {
      ranges.resize(hdr.ranges);
      std::memcpy(ranges.data(), data, list_bytes);
      const uint64_t base = reinterpret_cast<uint64_t>(pool.base) + it->second.offset;
      const uint64_t size = it->second.bytes;
      for (const wire::Range& r : ranges) {
        if (r.address < base || r.bytes > size || r.address - base > size - r.bytes ||
            r.bytes > wire::kMaxChunkBytes) {
          status = UCS_ERR_INVALID_ADDR;
          break;
        }
        total += r.bytes;
      }
      if (status == UCS_OK && total > wire::kMaxChunkBytes) status = UCS_ERR_EXCEEDS_LIMIT;
      if (status == UCS_OK && !gather && length != list_bytes + total) status = UCS_ERR_INVALID_PARAM;
    }
    auto* reply = new Reply{
        this, std::vector<uint8_t>(sizeof(wire::ReplyHeader) + (gather && status == UCS_OK ? total : 0))};
    if (status == UCS_OK) {
      const auto* in = static_cast<const uint8_t*>(data) + list_bytes;
      uint8_t* out = reply->bytes.data() + sizeof(wire::ReplyHeader);
      for (const wire::Range& r : ranges) {
        auto* mem = reinterpret_cast<uint8_t*>(r.address);
        if (gather) {
          std::memcpy(out, mem, r.bytes);
          out += r.bytes;
        } else {
          std::memcpy(mem, in, r.bytes);
          in += r.bytes;
        }
      }
    }
    bump([&](KvNodeStats& c) {
      if (status != UCS_OK) ++c.bad_requests;
      (gather ? c.bytes_gathered : c.bytes_scattered) += status == UCS_OK ? total : 0;
    });
    const wire::ReplyHeader rh{hdr.token, static_cast<int32_t>(status), 0};
    std::memcpy(reply->bytes.data(), &rh, sizeof rh);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = &Impl::on_reply_sent;
    p.user_data = reply;
    ucs_status_ptr_t req = ucp_am_send_nbx(param->reply_ep, gather ? wire::kGatherReply : wire::kScatterReply,
                                           reply->bytes.data(), sizeof rh, reply->bytes.data() + sizeof rh,
                                           reply->bytes.size() - sizeof rh, &p);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) delete reply;  // done in place, or the client is gone
  }

  void progress_loop() {
    int efd = -1;
    if (ucp_worker_get_efd(worker->worker(), &efd) != UCS_OK) efd = -1;
    while (!stopping.load(std::memory_order_acquire)) {
      std::unique_lock lock(ucx_mu);
      if (ucp_worker_progress(worker->worker()) != 0) continue;
      if (efd < 0) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      const ucs_status_t s = ucp_worker_arm(worker->worker());
      lock.unlock();
      if (s == UCS_ERR_BUSY) continue;
      pollfd pfd{efd, POLLIN, 0};
      (void)::poll(&pfd, 1, 100);
    }
  }

  void accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;  // closed by stop()
      boost::system::error_code peer_ec;
      const tcp::endpoint remote = socket.remote_endpoint(peer_ec);
      std::string peer = peer_ec ? std::string("(unknown peer)")
                                 : remote.address().to_string() + ":" + std::to_string(remote.port());
      if (static_cast<int64_t>(sessions.size()) >= options.max_connections) {
        bump([](KvNodeStats& c) { ++c.connections_refused; });
        log("refused a connection from " + peer + ": " + std::to_string(options.max_connections) +
            " connections (--max-connections) are served already");
        refuse(std::make_shared<Refused>(std::move(socket), tls.get(),
                                         control_error_line(resource_exhausted(
                                             "kv node " + name + ": connection limit (" +
                                             std::to_string(options.max_connections) + ") reached"))));
      } else {
        auto s = std::make_shared<Session>(*this, std::move(socket), tls.get(), std::move(peer));
        if (!auth_required()) {
          s->authenticated = true;
          s->client = &clients.at("");
          ++s->client->connections;
        }
        sessions.insert(s);
        bump([](KvNodeStats& c) { ++c.connections; });
        read(s);
      }
      accept();
    });
  }

  // A refused connection (past max_connections, or plain TCP to a TLS node): one error line, then
  // closed. On a TLS stream the handshake comes first, so that a TLS client reads the line. The node
  // then stops sending and drains what the client sent (its hello) until the client closes, so that
  // closing sends no reset that could overtake the error line; all within a second. At most
  // kMaxLingering refused connections wait so; beyond them a refusal closes as soon as its line is
  // written (plain) or at once (TLS).
  static constexpr int kMaxLingering = 64;
  struct Refused {
    Refused(tcp::socket s, asio::ssl::context* tls, std::string line)
        : stream(std::move(s), tls), timer(stream.get_executor()), line(std::move(line)) {}
    ControlStream stream;
    asio::steady_timer timer;
    std::string line;
    std::array<char, 1024> sink{};
    bool counted = false;  // in `lingering` until end_refusal
  };
  int lingering = 0;  // io thread only

  void refuse(const std::shared_ptr<Refused>& r) {
    boost::system::error_code ignored;
    if (lingering >= kMaxLingering) {
      if (r->stream.is_tls()) {
        r->stream.socket().close(ignored);
        return;
      }
      asio::async_write(r->stream, asio::buffer(r->line), [r](boost::system::error_code, size_t) {
        boost::system::error_code ignored2;
        r->stream.socket().close(ignored2);
      });
      return;
    }
    ++lingering;
    r->counted = true;
    r->timer.expires_after(std::chrono::seconds(1));
    r->timer.async_wait([r](boost::system::error_code) {
      boost::system::error_code ignored2;
      r->stream.socket().close(ignored2);  // whatever is pending ends with operation_aborted
    });
    if (!r->stream.is_tls()) {
      send_refusal(r);
      return;
    }
    r->stream.tls()->async_handshake(asio::ssl::stream_base::server, [this, r](boost::system::error_code ec) {
      if (ec) {
        end_refusal(r);
        return;
      }
      send_refusal(r);
    });
  }

  void send_refusal(const std::shared_ptr<Refused>& r) {
    asio::async_write(r->stream, asio::buffer(r->line), [this, r](boost::system::error_code ec, size_t) {
      if (ec) {
        end_refusal(r);
        return;
      }
      boost::system::error_code ignored;
      r->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
      drain(r);
    });
  }

  void drain(const std::shared_ptr<Refused>& r) {
    r->stream.async_read_some(asio::buffer(r->sink), [this, r](boost::system::error_code ec, size_t) {
      if (!ec) {
        drain(r);
        return;
      }
      end_refusal(r);
    });
  }

  void end_refusal(const std::shared_ptr<Refused>& r) {
    if (!r->counted) return;
    r->counted = false;
    --lingering;
    r->timer.cancel();
    boost::system::error_code ignored;
    r->stream.socket().close(ignored);
  }

  void log(const std::string& line) {
    const std::string text = "kv node " + name + ": " + line;
    if (options.log) {
      options.log(text);
    } else {
      std::cerr << "specontext " << text << std::endl;
    }
  }

  template <typename F>
  void bump(F f) {
    std::lock_guard lock(stats_mu);
    f(counters);
  }

  // Waits for the session's next line; the idle timer runs meanwhile (and bounds the first bytes
  // and the TLS handshake of a new session too).
  void read(const std::shared_ptr<Session>& s) {
    arm_idle(s);
    if (!s->started) {
      start(s);
      return;
    }
    read_line(s);
  }

  // A new session's first byte tells a TLS handshake (0x16) from a control line ('{'): a TLS client
  // of a node without TLS is closed (its handshake fails at once, naming the node), a plain client
  // of a TLS node is sent a plain error line saying so; both counted (tls_failures) and logged. A
  // TLS session then completes its handshake (a failure, e.g. a client that does not trust the
  // node's certificate, is counted and logged too).
  void start(const std::shared_ptr<Session>& s) {
    s->stream.socket().async_wait(tcp::socket::wait_read, [this, s](boost::system::error_code ec) {
      if (ec || !sessions.contains(s)) {
        close(s);
        return;
      }
      unsigned char first = 0;
      boost::system::error_code peek_ec;
      const size_t n = s->stream.socket().receive(asio::buffer(&first, 1), tcp::socket::message_peek, peek_ec);
      if (peek_ec || n == 0) {
        close(s);  // gone before its first byte
        return;
      }
      const bool tls_hello = first == kTlsHandshakeByte;
      if (!s->stream.is_tls()) {
        if (tls_hello) {
          tls_failure(*s, "a TLS handshake, but this node speaks plain TCP (start it with --tls-cert and "
                          "--tls-key, or drop --kv-node-tls-ca from the client)");
          close(s);
          return;
        }
        s->started = true;
        read_line(s);
        return;
      }
      if (!tls_hello) {
        tls_failure(*s, "plain TCP, but this node speaks TLS only");
        auto r = std::make_shared<Refused>(
            std::move(s->stream.socket()), nullptr,
            control_error_line(invalid_argument("kv node " + name +
                                                " speaks TLS only: give the client the CA of its certificate "
                                                "(--kv-node-tls-ca FILE)")));
        close(s);
        refuse(r);
        return;
      }
      s->stream.tls()->async_handshake(asio::ssl::stream_base::server, [this, s](boost::system::error_code hs) {
        if (!sessions.contains(s)) return;  // closed meanwhile (idle timeout, stop)
        if (hs) {
          tls_failure(*s, "TLS handshake failed: " + hs.message());
          close(s);
          return;
        }
        s->started = true;
        read_line(s);
      });
    });
  }

  void tls_failure(const Session& s, const std::string& why) {
    bump([](KvNodeStats& c) { ++c.tls_failures; });
    log("refused a connection from " + s.peer + ": " + why);
  }

  void read_line(const std::shared_ptr<Session>& s) {
    asio::async_read_until(
        s->stream, asio::dynamic_buffer(s->in, kMaxControlLine + 1), '\n',
        [this, s](boost::system::error_code ec, size_t n) {
          ++s->lines;
          s->idle.cancel();
          if (ec == asio::error::not_found) {
            reply(s,
                  {control_error_line(invalid_argument("control request: line longer than 64 KiB")), true});
            return;
          }
          if (ec) {
            close(s);
            return;
          }
          std::string line = s->in.substr(0, n - 1);
          s->in.erase(0, n);
          reply(s, handle(*s, line));
        });
  }

  // A session that sends no whole line for the idle timeout is closed, unless it holds regions
  // (a client using its regions talks to the data plane only, perhaps for hours).
  void arm_idle(const std::shared_ptr<Session>& s) {
    if (options.idle_timeout.count() <= 0) return;
    s->idle.expires_after(options.idle_timeout);
    s->idle.async_wait([this, s, lines = s->lines](boost::system::error_code ec) {
      // A line came (the timer cancelled, or it expired just as the line was read), or the
      // session is gone.
      if (ec || s->lines != lines || !sessions.contains(s)) return;
      if (!s->regions.empty()) {
        arm_idle(s);
        return;
      }
      bump([](KvNodeStats& c) { ++c.idle_closed; });
      close(s);
    });
  }

  void reply(const std::shared_ptr<Session>& s, Answer answer) {
    s->out = std::move(answer.line);
    asio::async_write(s->stream, asio::buffer(s->out),
                      [this, s, close_after = answer.close_after](boost::system::error_code ec, size_t) {
                        if (ec || close_after) {
                          close(s);
                          return;
                        }
                        read(s);
                      });
  }

  // Frees the session's regions and counts it gone before closing its socket, so that whoever
  // sees the connection end sees the node's stats without it.
  void close(const std::shared_ptr<Session>& s) {
    if (!sessions.erase(s)) return;
    s->idle.cancel();
    for (uint64_t id : s->regions) free_region(id);
    if (s->client != nullptr) {
      s->client->held -= std::min(s->client->held, s->held_bytes);
      s->client->regions -= static_cast<int64_t>(s->regions.size());
      --s->client->connections;
      s->client = nullptr;
    }
    s->regions.clear();
    s->held_bytes = 0;
    bump([](KvNodeStats& c) { --c.connections; });
    boost::system::error_code ignored;
    s->stream.socket().close(ignored);
  }

  // Forgets the region (requests naming it are refused from now on) and gives its pages back to
  // the system, so whoever gets the range next reads zeros, never the last client's KV. Returns
  // the region's size (0 when unknown).
  uint64_t free_region(uint64_t id) {
    Region gone;
    {
      std::lock_guard lock(ucx_mu);
      auto it = regions.find(id);
      if (it == regions.end()) return 0;
      gone = it->second;
      regions.erase(it);
    }
    // Offsets and sizes are whole pages (the allocator's alignment).
    if (madvise(static_cast<uint8_t*>(pool.base) + gone.offset, gone.bytes, MADV_DONTNEED) != 0) {
      std::memset(static_cast<uint8_t*>(pool.base) + gone.offset, 0, gone.bytes);
    }
    (void)allocator.free(gone.offset);
    const uint64_t used = allocator.used_bytes();
    bump([used](KvNodeStats& c) {
      --c.regions;
      c.used = used;
    });
    return gone.bytes;
  }

  bool auth_required() const { return !options.secret.empty() || !options.clients.empty(); }

  // Counts and logs a failed authentication; the reply closes the connection. `why` goes to the
  // client; `detail` (default: the same) to the node's log only, so that an unknown client ID and a
  // wrong answer look alike to the client.
  Answer auth_failure(const Session& s, const std::string& why, const std::string& detail = {}) {
    const int64_t failures = [&] {
      std::lock_guard lock(stats_mu);
      return ++counters.auth_failures;
    }();
    log("authentication failed from " + s.peer + ": " + (detail.empty() ? why : detail) + " (" +
        std::to_string(failures) + " so far)");
    return {control_error_line(invalid_argument("kv node " + name + ": authentication failed: " + why)),
            true};
  }

  // What the client may use, after hello (open node) or auth.
  void describe(nlohmann::json& out, const char* scheme, const Client& c) const {
    out["version"] = kControlVersion;
    out["node"] = name;
    out["auth"] = scheme;
    if (c.keyed) out["client"] = c.id;
    out["capacity"] = options.capacity;
    const uint64_t room = c.quota == 0 ? options.capacity : c.quota - std::min(c.held, c.quota);
    out["free"] = std::min(allocator.free_bytes(), room);
    out["quota"] = c.quota;
    out["worker_address"] = worker_address_hex;
    out["rma"] = false;
    out["rma_refused"] = rma_refused;
  }

  Answer hello(Session& s, const ControlRequest& req) {
    if (req.version != 0 && req.version != kControlVersion) {
      return {control_error_line(
          invalid_argument("control request: field 'version': the client speaks control protocol " +
                           std::to_string(req.version) + ", this node " + std::to_string(kControlVersion) +
                           ": run the same release on both"))};
    }
    nlohmann::json out = {{"ok", true}};
    if (!auth_required()) {
      describe(out, "none", *s.client);
      return {out.dump() + "\n"};
    }
    if (s.authenticated) {
      return {control_error_line(
          invalid_argument("control request: hello: this connection is authenticated already"))};
    }
    AuthNonce nonce{};
    if (Status st = fill_random(nonce); !st.is_ok()) {
      return {control_error_line(st.with_context("kv node " + name + ": hello")), true};
    }
    s.nonce = nonce;
    s.claimed = req.client;
    out["version"] = kControlVersion;
    out["node"] = name;
    out["auth"] = "hmac-sha256";
    out["nonce"] = hex_encode(nonce);
    return {out.dump() + "\n"};
  }

  Answer auth(Session& s, const ControlRequest& req) {
    if (!auth_required()) {
      return {control_error_line(
          invalid_argument("control request: auth: this node asks for no authentication"))};
    }
    if (s.authenticated) {
      return {control_error_line(
          invalid_argument("control request: auth: this connection is authenticated already"))};
    }
    if (!s.nonce) return auth_failure(s, "auth without a hello's challenge to answer");
    const AuthNonce challenge = *s.nonce;
    s.nonce.reset();  // one answer per challenge
    // An unknown ID costs the same HMAC and compare as a known one (against a random secret).
    auto it = clients.find(s.claimed);
    const bool known = it != clients.end();
    const Sha256Digest expected = auth_response(known ? it->second.secret : decoy_secret, challenge, name, s.claimed);
    const bool right = constant_time_equal(expected, req.mac);
    if (!right || !known) {
      if (!known && s.claimed.empty()) {
        return auth_failure(s, "this node knows its clients by ID: give one (--kv-client-id or " +
                                   std::string(kClientIdEnv) + ")");
      }
      const std::string as = s.claimed.empty() ? std::string() : " as client '" + s.claimed + "'";
      return auth_failure(s, "wrong answer to the challenge" + as,
                          known ? "wrong answer to the challenge" + as : "unknown client '" + s.claimed + "'");
    }
    Client& c = it->second;
    if (c.max_connections > 0 && c.connections >= c.max_connections) {
      bump([](KvNodeStats& st) { ++st.connections_refused; });
      log("refused a connection from " + s.peer + ": client '" + c.id + "' holds its " +
          std::to_string(c.max_connections) + " connections already");
      return {control_error_line(resource_exhausted("kv node " + name + ": client '" + c.id +
                                                    "' is at its connection limit (" +
                                                    std::to_string(c.max_connections) + ")")),
              true};
    }
    s.authenticated = true;
    s.client = &c;
    ++c.connections;
    nlohmann::json out = {{"ok", true}};
    describe(out, "done", c);
    out["proof"] = hex_encode(node_proof(c.secret, req.nonce, challenge, name, c.id));
    return {out.dump() + "\n"};
  }

  Answer alloc(Session& s, uint64_t bytes) {
    Client& client = *s.client;
    if (client.quota != 0) {
      const uint64_t room = client.quota - std::min(client.held, client.quota);
      const uint64_t pages = bytes > room ? bytes : (bytes + page_bytes - 1) / page_bytes * page_bytes;
      if (pages > room) {
        bump([](KvNodeStats& c) { ++c.quota_refusals; });
        const std::string who = client.keyed ? "client '" + client.id + "'" : std::string("this client");
        return {control_error_line(resource_exhausted(
            "kv node " + name + ": alloc of " + std::to_string(bytes) + " bytes exceeds " + who + "'s quota (" +
            std::to_string(client.quota) + " bytes, " + std::to_string(client.held) + " held by its " +
            std::to_string(client.connections) + " connection(s); " +
            (client.keyed ? "keys file" : "--client-quota") + ")"))};
      }
    }
    auto off = allocator.allocate(bytes);
    if (!off.is_ok()) return {control_error_line(off.status().with_context("kv node " + name + ": alloc"))};
    Region region{*off, allocator.size_at(*off), {}};
    uint64_t id = 0;
    nlohmann::json out = {{"ok", true}};
    {
      std::lock_guard lock(ucx_mu);
      Status random = Status::ok();
      // Neither follows from what a client has seen: a key of 128 random bits (never all zeros),
      // and a random id (never 0, never one in use).
      do random = fill_random(region.key);
      while (random.is_ok() && transport::ucx_wire::is_zero_key(region.key));
      while (random.is_ok() && (id == 0 || regions.contains(id))) {
        random = fill_random(std::span(reinterpret_cast<uint8_t*>(&id), sizeof id));
      }
      if (!random.is_ok()) {
        (void)allocator.free(*off);
        return {control_error_line(random.with_context("kv node " + name + ": alloc"))};
      }
      out["key"] = hex_encode(region.key);
      regions.emplace(id, region);
    }
    s.regions.insert(id);
    s.held_bytes += region.bytes;
    client.held += region.bytes;
    ++client.regions;
    const uint64_t used = allocator.used_bytes();
    bump([used](KvNodeStats& c) {
      ++c.regions;
      c.used = used;
    });
    out["region"] = id;
    out["address"] = reinterpret_cast<uint64_t>(pool.base) + *off;
    out["bytes"] = bytes;
    return {out.dump() + "\n"};
  }

  Answer stats_reply(const Client& c) const {
    if (c.keyed) {  // its own usage, nothing of other clients'
      nlohmann::json out = {{"ok", true},          {"client", c.id},       {"capacity", options.capacity},
                            {"quota", c.quota},    {"used", c.held},       {"regions", c.regions},
                            {"connections", c.connections}};
      return {out.dump() + "\n"};
    }
    const KvNodeStats st = snapshot();
    nlohmann::json out = {{"ok", true},
                          {"capacity", st.capacity},
                          {"used", st.used},
                          {"regions", st.regions},
                          {"connections", st.connections},
                          {"bytes_gathered", st.bytes_gathered},
                          {"bytes_scattered", st.bytes_scattered},
                          {"auth_failures", st.auth_failures},
                          {"connections_refused", st.connections_refused},
                          {"idle_closed", st.idle_closed},
                          {"quota_refusals", st.quota_refusals},
                          {"tls_failures", st.tls_failures}};
    return {out.dump() + "\n"};
  }

  Answer handle(Session& s, std::string_view line) {
    bump([](KvNodeStats& c) { ++c.requests; });
    auto req = parse_control_request(line);
    if (!req.is_ok()) {
      bump([](KvNodeStats& c) { ++c.bad_requests; });
      return {control_error_line(req.status())};
    }
    if (req->op == ControlOp::kHello) return hello(s, *req);
    if (req->op == ControlOp::kAuth) return auth(s, *req);
    if (!s.authenticated) return auth_failure(s, "a request before authentication (hello, then auth)");
    switch (req->op) {
      case ControlOp::kAlloc:
        return alloc(s, req->bytes);
      case ControlOp::kFree:
        if (!s.regions.contains(req->region)) {
          return {
              control_error_line(not_found("control request: field 'region': " + std::to_string(req->region) +
                                           " is not a region of this connection"))};
        }
        {
          s.regions.erase(req->region);
          const uint64_t freed = free_region(req->region);
          s.held_bytes -= std::min(s.held_bytes, freed);
          s.client->held -= std::min(s.client->held, freed);
          --s.client->regions;
        }
        return {"{\"ok\":true}\n"};
      case ControlOp::kStats:
        return stats_reply(*s.client);
      default:
        return {control_error_line(internal_error("control request: unhandled op"))};
    }
  }

  KvNodeStats snapshot() const {
    std::lock_guard lock(stats_mu);
    return counters;
  }

  void stop() {
    if (stopped) return;
    stopped = true;
    if (io_thread.joinable()) {
      asio::post(io, [this] {
        boost::system::error_code ignored;
        acceptor.close(ignored);
        while (!sessions.empty()) {
          const std::shared_ptr<Session> s = *sessions.begin();  // close() erases it from the set
          close(s);
        }
      });
      // The sessions' handlers finish with operation_aborted; run() returns once none is left.
      io_thread.join();
    }
    stopping.store(true, std::memory_order_release);
    if (ucx_thread.joinable()) {
      (void)ucp_worker_signal(worker->worker());
      ucx_thread.join();
    }
    regions.clear();
    worker.reset();
  }
};

KvNode::KvNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<KvNode>> KvNode::start(KvNodeOptions options) {
  if (options.capacity == 0) return invalid_argument("kv node: capacity must be positive");
  if (options.max_connections < 1) return invalid_argument("kv node: max_connections must be positive");
  if (options.idle_timeout.count() < 0) return invalid_argument("kv node: idle_timeout must not be negative");
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  Status st = impl->init();
  if (!st.is_ok()) {
    impl->stop();
    return st;
  }
  return std::unique_ptr<KvNode>(new KvNode(std::move(impl)));
}

KvNode::~KvNode() { stop(); }

uint16_t KvNode::port() const { return impl_->bound_port; }

const std::string& KvNode::name() const { return impl_->name; }
KvNodeStats KvNode::stats() const { return impl_->snapshot(); }
void KvNode::stop() { impl_->stop(); }

}  // namespace specontext::cluster
