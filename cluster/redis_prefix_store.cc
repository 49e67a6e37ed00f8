#include "cluster/redis_prefix_store.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace specontext::cluster {
namespace {

constexpr uint64_t kReplySlack = uint64_t{64} << 10;  // beyond the largest value: headers, one read
constexpr uint64_t kSmallReply = uint64_t{1} << 20;   // every reply but a value's (INFO is ~kBs)
constexpr size_t kMaxPasswordBytes = 4096;

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

bool parse_int(std::string_view s, int& out) {
  const auto* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && p == end;
}

// SIGPIPE blocked in this thread while it lives: hiredis write()s without MSG_NOSIGNAL, and a
// write to a server that died would otherwise end the process. A SIGPIPE raised meanwhile is
// taken off the pending set before the mask is restored (the write's EPIPE says it all).
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~SigpipeBlocked() {
    if (!blocked_) return;
    sigset_t pending;
    sigemptyset(&pending);
    if (!was_pending_ && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
  bool blocked_ = false;
};

std::string reply_text(const redisReply* r) { return r->str != nullptr ? std::string(r->str, r->len) : std::string(); }

}  // namespace

struct RedisPrefixStore::Reply {
  ReplyPtr r;
};

void RedisPrefixStore::ContextFree::operator()(redisContext* c) const { redisFree(c); }

Result<RedisPrefixStoreOptions> parse_redis_url(std::string_view url, RedisPrefixStoreOptions o) {
  // The URL as said in errors: whatever precedes '@' (a user, or a password given by mistake) left out.
  const size_t userinfo = url.rfind('@');
  const std::string shown =
      userinfo == std::string_view::npos ? std::string(url) : "redis://...@" + std::string(url.substr(userinfo + 1));
  const auto bad = [&](const std::string& why) {
    return invalid_argument("prefix store '" + shown + "': " + why +
                            " (expected redis://[USER@]HOST:PORT[/DB])");
  };
  constexpr std::string_view kScheme = "redis://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    if (url.substr(0, 9) == "rediss://") return bad("TLS (rediss://) is not supported");
    return bad("not a redis:// URL");
  }
  std::string_view rest = url.substr(kScheme.size());
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view user = rest.substr(0, at);
    if (user.find(':') != std::string_view::npos) {
      return bad("a password does not go in the URL (it would be on the command line); give "
                 "--prefix-store-password-file or " + std::string(kRedisPasswordEnv));
    }
    if (user.empty()) return bad("empty user before '@'");
    o.user = std::string(user);
    rest = rest.substr(at + 1);
  }
  std::string_view hostport = rest;
  o.db = 0;
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    hostport = rest.substr(0, slash);
    const std::string_view db = rest.substr(slash + 1);
    if (!db.empty() && (!parse_int(db, o.db) || o.db < 0)) return bad("database '" + std::string(db) + "' is not a number");
  }
  const size_t colon = hostport.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return bad("no HOST:PORT");
  o.host = std::string(hostport.substr(0, colon));
  if (!parse_int(hostport.substr(colon + 1), o.port) || o.port < 1 || o.port > 65535) {
    return bad("port '" + std::string(hostport.substr(colon + 1)) + "' is not in 1..65535");
  }
  return o;
}

Result<std::string> load_redis_password(const std::string& file) {
  if (file.empty()) {
    const char* env = std::getenv(kRedisPasswordEnv);
    if (env == nullptr) return std::string();
    std::string value(env);
    if (value.size() > kMaxPasswordBytes) {
      return invalid_argument(std::string(kRedisPasswordEnv) + ": longer than " + std::to_string(kMaxPasswordBytes) +
                              " bytes");
    }
    return value;
  }
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return invalid_argument("password file " + file + ": cannot be read");
  if ((st.st_mode & S_IROTH) != 0) {
    return invalid_argument("password file " + file + ": others may read it (chmod 600 " + file + ")");
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > kMaxPasswordBytes) {
    return invalid_argument("password file " + file + ": not a regular file of at most " +
                            std::to_string(kMaxPasswordBytes) + " bytes");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return invalid_argument("password file " + file + ": cannot be read");
  std::string line;
  std::getline(in, line);
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (line.empty()) return invalid_argument("password file " + file + ": empty first line");
  return line;
}

RedisPrefixStore::RedisPrefixStore(RedisPrefixStoreOptions options)
    : options_(std::move(options)), backoff_(options_.retry_min) {
  name_ = "redis " + options_.host + ":" + std::to_string(options_.port) + "/" + std::to_string(options_.db);
}

RedisPrefixStore::~RedisPrefixStore() = default;

Result<std::unique_ptr<RedisPrefixStore>> RedisPrefixStore::create(RedisPrefixStoreOptions options) {
  if (options.ttl_seconds < 1) return invalid_argument("prefix store: the TTL must be at least 1 second");
  if (options.max_blob_bytes == 0) return invalid_argument("prefix store: the largest value must be above 0");
  if (options.connect_timeout.count() <= 0 || options.command_timeout.count() <= 0) {
    return invalid_argument("prefix store: timeouts must be positive");
  }
  std::unique_ptr<RedisPrefixStore> store(new RedisPrefixStore(std::move(options)));
  SPX_RETURN_IF_ERROR(store->connect_now());
  // Cluster mode: keys live on the node owning their hash slot, which this client cannot find.
  SPX_ASSIGN_OR_RETURN(std::vector<Reply> info, store->run({{"INFO", "cluster"}}, kSmallReply));
  if (info[0].r->type == REDIS_REPLY_STRING) {
    if (reply_text(info[0].r.get()).find("cluster_enabled:1") != std::string::npos) {
      return unimplemented(store->name_ +
                           ": Redis Cluster mode is not supported (no hash-slot routing); use a standalone "
                           "server or a proxy that routes by slot");
    }
  }
  // Where eviction is the server's: say so when it evicts nothing (CONFIG may be refused by ACL).
  auto policy = store->run({{"CONFIG", "GET", "maxmemory-policy"}}, kSmallReply);
  if (policy.is_ok() && (*policy)[0].r->type == REDIS_REPLY_ARRAY && (*policy)[0].r->elements == 2 &&
      reply_text((*policy)[0].r->element[1]) == "noeviction") {
    store->log(store->name_ +
               ": maxmemory-policy is noeviction: prefix writes fail once it is full (set allkeys-lru)");
  }
  if (!store->connected()) return unavailable(store->name_ + ": lost while checking the server");
  store->started_ = true;
  return store;
}

void RedisPrefixStore::log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "specontext: prefix store %s\n", line.c_str());
  }
}

Status RedisPrefixStore::connect_now() {
  ctx_.reset();
  std::unique_ptr<redisContext, ContextFree> c(
      redisConnectWithTimeout(options_.host.c_str(), options_.port, to_timeval(options_.connect_timeout)));
  if (c == nullptr) return unavailable(name_ + ": cannot allocate a connection");
  if (c->err != 0) return unavailable(name_ + ": cannot connect: " + c->errstr);
  if (redisSetTimeout(c.get(), to_timeval(options_.command_timeout)) != REDIS_OK) {
    return unavailable(name_ + ": cannot set the socket timeout: " + c->errstr);
  }
  ctx_ = std::move(c);
  const auto checked = [&](const std::vector<std::string_view>& argv, const char* what) -> Status {
    SPX_ASSIGN_OR_RETURN(std::vector<Reply> r, run({argv}, kSmallReply));
    if (r[0].r->type != REDIS_REPLY_ERROR) return Status::ok();
    const std::string message = reply_text(r[0].r.get());
    ctx_.reset();
    if (message.rfind("WRONGPASS", 0) == 0 || message.find("invalid password") != std::string::npos ||
        message.find("invalid username-password") != std::string::npos) {
      return invalid_argument(name_ + ": authentication refused (" + message + ")");
    }
    if (message.rfind("NOAUTH", 0) == 0) {
      return invalid_argument(name_ + ": the server wants a password (--prefix-store-password-file or " +
                              std::string(kRedisPasswordEnv) + "): " + message);
    }
    return invalid_argument(name_ + ": " + what + " refused: " + message);
  };
  if (!options_.password.empty()) {
    std::vector<std::string_view> auth{"AUTH"};
    if (!options_.user.empty()) auth.push_back(options_.user);
    auth.push_back(options_.password);
    SPX_RETURN_IF_ERROR(checked(auth, "AUTH"));
  }
  if (options_.db != 0) {
    const std::string db = std::to_string(options_.db);
    SPX_RETURN_IF_ERROR(checked({"SELECT", db}, "SELECT"));
  }
  SPX_RETURN_IF_ERROR(checked({"PING"}, "PING"));
  return Status::ok();
}

Status RedisPrefixStore::ensure_connected() {
  if (ctx_) return Status::ok();
  const auto now = std::chrono::steady_clock::now();
  if (now < next_attempt_) {
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_attempt_ - now);
    return unavailable(name_ + ": unreachable (next attempt in " + std::to_string(wait.count()) + " ms)");
  }
  if (Status st = connect_now(); !st.is_ok()) {
    ++failed_attempts_;
    ctx_.reset();
    next_attempt_ = now + backoff_;
    backoff_ = std::min(backoff_ * 2, options_.retry_max);
    return unavailable(st.message());
  }
  if (down_) {
    log(name_ + ": reachable again after " + std::to_string(failed_attempts_) + " failed attempts");
    down_ = false;
  }
  failed_attempts_ = 0;
  backoff_ = options_.retry_min;
  return Status::ok();
}

Status RedisPrefixStore::lost(const std::string& why) {
  ctx_.reset();
  const std::string message = name_ + ": " + why;
  if (!down_ && started_) {
    down_ = true;
    ++outages_;
    log(message + "; prefixes are computed until it is back (retried after " +
        std::to_string(options_.retry_min.count()) + " ms, backing off to " +
        std::to_string(options_.retry_max.count()) + " ms)");
  }
  next_attempt_ = std::chrono::steady_clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, options_.retry_max);
  return unavailable(message);
}

Result<std::vector<RedisPrefixStore::Reply>> RedisPrefixStore::run(
    const std::vector<std::vector<std::string_view>>& commands, uint64_t max_reply) {
  if (!ctx_) return unavailable(name_ + ": not connected");
  redisContext* c = ctx_.get();
  const SigpipeBlocked no_sigpipe;
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& command : commands) {
    argv.clear();
    lens.clear();
    for (std::string_view a : command) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
      return lost(std::string("cannot queue a command: ") + c->errstr);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.command_timeout;
  const auto late = [&] { return std::chrono::steady_clock::now() > deadline; };
  int done = 0;
  while (!done) {
    if (redisBufferWrite(c, &done) != REDIS_OK) return lost(std::string("write failed: ") + c->errstr);
    if (!done && late()) return lost("write timed out");
  }
  std::vector<Reply> replies;
  replies.reserve(commands.size());
  while (replies.size() < commands.size()) {
    void* raw = nullptr;
    if (redisReaderGetReply(c->reader, &raw) != REDIS_OK) {
      return lost(std::string("unreadable reply: ") + c->reader->errstr);
    }
    if (raw != nullptr) {
      replies.push_back(Reply{ReplyPtr(static_cast<redisReply*>(raw))});
      continue;
    }
    if (c->reader->len - c->reader->pos > max_reply + kReplySlack) {
      return lost("a reply larger than " + std::to_string(max_reply) + " bytes");
    }
    if (late()) return lost("no reply within " + std::to_string(options_.command_timeout.count()) + " ms");
    if (redisBufferRead(c) != REDIS_OK) {
      return lost(std::string(c->err == REDIS_ERR_EOF ? "closed by the server: " : "read failed: ") + c->errstr);
    }
  }
  return replies;
}

Status RedisPrefixStore::reply_error(std::string_view command, const std::string& message) {
  if (message.rfind("MOVED", 0) == 0 || message.rfind("ASK", 0) == 0) {
    const std::string why = name_ + ": " + std::string(command) + " got '" + message +
                            "': Redis Cluster mode is not supported (no hash-slot routing)";
    if (!said_cluster_) log(why);
    said_cluster_ = true;
    return unimplemented(why);
  }
  return unavailable(name_ + ": " + std::string(command) + " refused: " + message);
}

Status RedisPrefixStore::put(const PrefixKey& key, std::span<const std::byte> blob) {
  if (blob.size() > options_.max_blob_bytes) {
    return invalid_argument(name_ + ": a prefix of " + std::to_string(blob.size()) + " bytes is over the " +
                            std::to_string(options_.max_blob_bytes) + "-byte bound");
  }
  if (blob.empty()) return invalid_argument(name_ + ": an empty value is never written");
  SPX_RETURN_IF_ERROR(ensure_connected());
  const std::string k = key.text();
  const std::string ttl = std::to_string(options_.ttl_seconds);
  const std::string_view value(reinterpret_cast<const char*>(blob.data()), blob.size());
  SPX_ASSIGN_OR_RETURN(std::vector<Reply> r, run({{"SET", k, value, "EX", ttl}}, kSmallReply));
  const redisReply* reply = r[0].r.get();
  if (reply->type == REDIS_REPLY_ERROR) return reply_error("SET", reply_text(reply));
  if (reply->type != REDIS_REPLY_STATUS || reply_text(reply) != "OK") {
    return unavailable(name_ + ": SET answered other than OK");
  }
  return Status::ok();
}

Result<std::vector<std::byte>> RedisPrefixStore::get(const PrefixKey& key) {
  SPX_RETURN_IF_ERROR(ensure_connected());
  const std::string k = key.text();
  // At most max_blob_bytes + 1 bytes: one more than allowed says the value is too large.
  const std::string last = std::to_string(options_.max_blob_bytes);
  SPX_ASSIGN_OR_RETURN(std::vector<Reply> r, run({{"GETRANGE", k, "0", last}}, options_.max_blob_bytes + 1));
  const redisReply* reply = r[0].r.get();
  if (reply->type == REDIS_REPLY_ERROR) return reply_error("GETRANGE", reply_text(reply));
  if (reply->type != REDIS_REPLY_STRING) return data_loss(name_ + ": " + k + " is not a string value");
  if (reply->len == 0) return not_found(name_ + ": no " + k + " (never written, expired or evicted)");
  if (reply->len > options_.max_blob_bytes) {
    return data_loss(name_ + ": " + k + " is larger than the " + std::to_string(options_.max_blob_bytes) +
                     "-byte bound");
  }
  const auto* bytes = reinterpret_cast<const std::byte*>(reply->str);
  return std::vector<std::byte>(bytes, bytes + reply->len);
}

Result<std::vector<bool>> RedisPrefixStore::contains(std::span<const PrefixKey> keys) {
  std::vector<bool> held(keys.size(), false);
  if (keys.empty()) return held;
  SPX_RETURN_IF_ERROR(ensure_connected());
  std::vector<std::string> texts;
  texts.reserve(keys.size());
  for (const PrefixKey& k : keys) texts.push_back(k.text());
  std::vector<std::vector<std::string_view>> commands;
  commands.reserve(keys.size());
  for (const std::string& t : texts) commands.push_back({"EXISTS", t});
  SPX_ASSIGN_OR_RETURN(std::vector<Reply> r, run(commands, kSmallReply));
  for (size_t i = 0; i < r.size(); ++i) {
    const redisReply* reply = r[i].r.get();
    if (reply->type == REDIS_REPLY_ERROR) return reply_error("EXISTS", reply_text(reply));
    if (reply->type != REDIS_REPLY_INTEGER) return unavailable(name_ + ": EXISTS answered other than a number");
    held[i] = reply->integer > 0;
  }
  return held;
}

}  // namespace specontext::cluster
