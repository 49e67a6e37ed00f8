// RedisPrefixStore: a SharedPrefixStore on a Redis or Valkey server (hiredis), the shared prefix
// level servers of one model find each other's prompts in (`--prefix-store redis://HOST:PORT/DB`;
// LMCache's Redis remote backend). Each value (a chunk of a prompt, core/engine/prefix_chunk.h) is one
// string under PrefixKey::text(), written with `SET key value EX ttl`: it expires ttl seconds after its
// last write; what the server drops for room is its maxmemory-policy's choice (run it with
// `maxmemory-policy allkeys-lru`: with the default noeviction, writes fail once it is full, and
// are counted errors).
//
// Hostile network: every reply is read through a bounded loop (at most max_blob_bytes plus 64 KiB
// buffered, a deadline of command_timeout on the whole command, socket timeouts of the same on
// each read and write); values are read with GETRANGE 0..max_blob_bytes, so an honest server never
// sends more. Authentication: AUTH [user] password, the password from a file or the environment
// (load_redis_password), never a flag's value or the URL. No TLS (rediss://): the password,
// prompts' KV and keys cross the network in clear.
//
// A dead store costs recomputation only: when the connection fails (or a command times out) the
// call is kUnavailable, the store logs one line for the outage and does not try again before a
// backoff (retry_min, doubling to retry_max) has passed; calls meanwhile fail at once. The first
// call after it reconnects (and logs that it is back). Configuration errors found at create (a
// refused password, a server that wants one, cluster mode, no server at all) are errors there.
//
// Cluster mode is not supported: there is no hash-slot routing. create refuses a server whose
// INFO says cluster_enabled:1, and a MOVED or ASK reply later is kUnimplemented saying so (logged
// once). Use a standalone server, or a proxy that routes by slot.
//
// Not synchronized (SharedPrefixStore): the scheduler's thread alone uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "core/ports/shared_prefix_store.h"

struct redisContext;

namespace specontext::cluster {

struct RedisPrefixStoreOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  int db = 0;
  std::string user;      // ACL user; empty: AUTH with the password alone (the default user)
  std::string password;  // empty: no AUTH
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds command_timeout{2000};
  int64_t ttl_seconds = 3600;                   // EX of every write; at least 1
  uint64_t max_blob_bytes = uint64_t{1} << 30;  // largest value written or read
  std::chrono::milliseconds retry_min{250};     // backoff after a failure, doubling...
  std::chrono::milliseconds retry_max{10000};   // ...up to this
  // Where outage and recovery lines go (one line each, no newline); null: stderr.
  std::function<void(const std::string&)> log;
};

// "redis://[USER@]HOST:PORT[/DB]" into host, port, db and user (the rest of `base` kept). A
// password in the URL (redis://USER:PASSWORD@...) is refused: it would be on the command line.
// kInvalidArgument naming what is wrong.
Result<RedisPrefixStoreOptions> parse_redis_url(std::string_view url, RedisPrefixStoreOptions base = {});

// The password: the file's first line when `file` is given (at most 4 KiB; a file others may
// read is refused), else SPECONTEXT_PREFIX_STORE_PASSWORD, else empty (no AUTH).
inline constexpr const char* kRedisPasswordEnv = "SPECONTEXT_PREFIX_STORE_PASSWORD";
Result<std::string> load_redis_password(const std::string& file);

class RedisPrefixStore final : public SharedPrefixStore {
 public:
  // Connects, authenticates, selects the database and checks the server (PING; cluster mode
  // refused; a noeviction policy warned about). kUnavailable naming the endpoint when it cannot
  // be reached; kInvalidArgument when the password is refused or the server wants one;
  // kUnimplemented for cluster mode.
  static Result<std::unique_ptr<RedisPrefixStore>> create(RedisPrefixStoreOptions options);
  ~RedisPrefixStore() override;
  RedisPrefixStore(const RedisPrefixStore&) = delete;
  RedisPrefixStore& operator=(const RedisPrefixStore&) = delete;

  const std::string& name() const override { return name_; }
  Status put(const PrefixKey& key, std::span<const std::byte> blob) override;
  Result<std::vector<std::byte>> get(const PrefixKey& key) override;
  Result<std::vector<bool>> contains(std::span<const PrefixKey> keys) override;

  bool connected() const { return ctx_ != nullptr; }
  int64_t outages() const { return outages_; }  // times it went from reachable to not
  const RedisPrefixStoreOptions& options() const { return options_; }

 private:
  struct ContextFree {
    void operator()(redisContext* c) const;
  };
  explicit RedisPrefixStore(RedisPrefixStoreOptions options);
  // A fresh connection, authenticated and on its database, into ctx_.
  Status connect_now();
  // ctx_, reconnecting when the backoff allows; kUnavailable while it does not.
  Status ensure_connected();
  // The connection failed: closed, one log line per outage, the next attempt after the backoff.
  Status lost(const std::string& why);
  void log(const std::string& line) const;
  // Sends the commands in one write and reads one reply each (bounded); kUnavailable (after
  // lost()) on any I/O error or timeout.
  struct Reply;
  Result<std::vector<Reply>> run(const std::vector<std::vector<std::string_view>>& commands, uint64_t max_reply);
  // A reply that is an error: MOVED / ASK become kUnimplemented (cluster mode), others kUnavailable.
  Status reply_error(std::string_view command, const std::string& message);

  RedisPrefixStoreOptions options_;
  std::string name_;
  std::unique_ptr<redisContext, ContextFree> ctx_;
  bool started_ = false;  // create() done: outages are logged from then on
  bool down_ = false;
  bool said_cluster_ = false;
  int64_t outages_ = 0;
  int64_t failed_attempts_ = 0;
  std::chrono::milliseconds backoff_;
  std::chrono::steady_clock::time_point next_attempt_{};
};

}  // namespace specontext::cluster
