// RedisPrefixStore against a real redis-server (started here on a free loopback port, with a
// password, in a temporary directory; stopped at the end; the tests are skipped, saying why, when
// redis-server is not installed): two schedulers on their own engines share prompts through it
// (the second reads the first's back and decodes the same greedy tokens); a wrong or missing
// password and cluster mode are clear errors at create; the server killed mid-run costs only
// recomputation (same tokens), and a restarted one is used again; an expired prefix is a miss;
// values over the size bound are neither written nor read.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cluster/redis_prefix_store.h"
#include "core/model/model_loader.h"
#include "serving/generator.h"
#include "tests/core/tier_test_util.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

using namespace std::chrono_literals;

constexpr const char* kPassword = "test-password-9f3c";

// redis-server's path, or empty when it is not installed.
std::string redis_server_path() {
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/bin:/bin";
  for (size_t at = 0; at <= dirs.size();) {
    const size_t end = std::min(dirs.find(':', at), dirs.size());
    const std::filesystem::path p = std::filesystem::path(dirs.substr(at, end - at)) / "redis-server";
    if (::access(p.c_str(), X_OK) == 0) return p.string();
    at = end + 1;
  }
  return {};
}

// A loopback port nobody listens on now (bound and released: another process could take it
// before redis-server does, which start() reports as a failure to start).
int bind_port(int want) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(want));
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}
// In cluster mode redis-server also listens on port + 10000: both free, the port at most 55535.
int free_port(bool with_bus = false) {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = bind_port(0);
    if (!with_bus) return port;
    if (port > 0 && port <= 55535 && bind_port(port + 10000) == port + 10000) return port;
  }
  return 0;
}

// One redis-server child: config (password included, mode 0600) and log in a temporary directory,
// no persistence, allkeys-lru within 64 MiB. Killed at the end.
class RedisServer {
 public:
  explicit RedisServer(bool cluster_mode = false) : cluster_mode_(cluster_mode) {
    binary_ = redis_server_path();
    dir_ = specontext::testing::temp_dir("spx-redis");
    port_ = free_port(cluster_mode);
  }
  ~RedisServer() {
    kill_now();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  bool installed() const { return !binary_.empty(); }
  int port() const { return port_; }
  std::string log() const { return specontext::testing::read_text_file(dir_ + "/redis.log"); }

  // Starts it and waits until it answers PING (a bounded number of tries); false when it does not.
  bool start() {
    const std::string conf = dir_ + "/redis.conf";
    {
      std::ofstream out(conf);
      out << "port " << port_ << "\nbind 127.0.0.1\nrequirepass " << kPassword << "\ndir " << dir_
          << "\nlogfile " << dir_ << "/redis.log\nsave \"\"\nappendonly no\ndaemonize no\n"
          << "maxmemory 64mb\nmaxmemory-policy allkeys-lru\n";
      if (cluster_mode_) out << "cluster-enabled yes\ncluster-config-file " << dir_ << "/nodes.conf\n";
    }
    ::chmod(conf.c_str(), 0600);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl(binary_.c_str(), binary_.c_str(), conf.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int attempt = 0; attempt < 500; ++attempt) {
      if (auto c = raw(); c != nullptr) return true;
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {  // it exited (its log says why)
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }
  void kill_now() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  struct ContextFree {
    void operator()(redisContext* c) const { redisFree(c); }
  };
  using Context = std::unique_ptr<redisContext, ContextFree>;
  struct ReplyFree {
    void operator()(redisReply* r) const { freeReplyObject(r); }
  };
  using Reply = std::unique_ptr<redisReply, ReplyFree>;
  // An authenticated connection of the test's own, or null.
  Context raw() const {
    Context c(redisConnect("127.0.0.1", port_));
    if (c == nullptr || c->err != 0) return nullptr;
    Reply r(static_cast<redisReply*>(redisCommand(c.get(), "AUTH %s", kPassword)));
    if (r == nullptr || r->type == REDIS_REPLY_ERROR) return nullptr;
    Reply pong(static_cast<redisReply*>(redisCommand(c.get(), "PING")));
    if (pong == nullptr || pong->type == REDIS_REPLY_ERROR) return nullptr;
    return c;
  }
  // A command on a fresh connection of the test's own.
  Reply command(const std::string& text) const {
    Context c = raw();
    if (c == nullptr) return nullptr;
    return Reply(static_cast<redisReply*>(redisCommand(c.get(), text.c_str())));
  }

 private:
  bool cluster_mode_;
  std::string binary_, dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

#define START_REDIS(server)                                                                               \
  do {                                                                                                    \
    if (!(server).installed()) GTEST_SKIP() << "redis-server is not installed (apt-get install redis-server)"; \
    ASSERT_TRUE((server).start()) << "redis-server did not start: " << (server).log();                  \
  } while (0)

RedisPrefixStoreOptions options_for(const RedisServer& server, std::string password = kPassword) {
  RedisPrefixStoreOptions o;
  o.port = server.port();
  o.password = std::move(password);
  o.retry_min = 0ms;  // the next call after a failure tries again (no waiting in tests)
  o.retry_max = 0ms;
  return o;
}

std::shared_ptr<RedisPrefixStore> store_for(const RedisServer& server, std::vector<std::string>* lines = nullptr) {
  RedisPrefixStoreOptions o = options_for(server);
  if (lines != nullptr) o.log = [lines](const std::string& line) { lines->push_back(line); };
  auto s = RedisPrefixStore::create(std::move(o));
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return s.is_ok() ? std::shared_ptr<RedisPrefixStore>(std::move(*s)) : nullptr;
}

// A "server": its own stories260K engine and a Generator over it, one greedy request.
std::vector<TokenId> serve(const std::vector<TokenId>& prompt, std::shared_ptr<SharedPrefixStore> store,
                           GenerationStats* stats = nullptr) {
  auto m = load_model(specontext::testing::repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok());
  if (!m.is_ok()) return {};
  EngineOptions eo;
  eo.max_sequences = 2;
  eo.prefix_sharing = true;
  auto engine = Engine::create(*m, specontext::testing::cpu_backend(), eo);
  EXPECT_TRUE(engine.is_ok());
  if (!engine.is_ok()) return {};
  GeneratorOptions go;
  go.prefix_caching = true;
  go.prefix_shared_store = std::move(store);
  Generator g(**engine, go);
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = 16;
  auto out = g.run({r});
  EXPECT_TRUE(out.is_ok()) << out.status().to_string();
  if (stats != nullptr) *stats = g.stats();
  return out.is_ok() ? (*out)[0].tokens : std::vector<TokenId>{};
}

TEST(RedisPrefixStore, ASecondServerReadsTheFirstsPromptAndDecodesTheSame) {
  RedisServer redis;
  START_REDIS(redis);
  const std::vector<TokenId> prompt = specontext::testing::story_prompt(200);  // 199 wanted: 12 pages
  const std::vector<TokenId> alone = serve(prompt, nullptr);
  ASSERT_EQ(alone.size(), 16u);
  GenerationStats a, b;
  EXPECT_EQ(serve(prompt, store_for(redis), &a), alone);
  EXPECT_EQ(a.prefix_shared_writes, 1);
  EXPECT_EQ(a.prefix_shared_misses, 1);
  EXPECT_EQ(a.prefix_shared_errors, 0);
  EXPECT_EQ(a.cached_prompt_tokens, 0);
  // The second server: another engine, another connection.
  EXPECT_EQ(serve(prompt, store_for(redis), &b), alone);
  EXPECT_EQ(b.prefix_shared_hits, 1);
  EXPECT_EQ(b.cached_prompt_tokens, 192);
  EXPECT_EQ(b.prefix_shared_writes, 0) << "held already";
  EXPECT_EQ(b.prefix_shared_bytes_read, a.prefix_shared_bytes_written);
  EXPECT_EQ(b.prefix_shared_errors, 0);
  // The next turn (the prompt extended) finds it too.
  std::vector<TokenId> next = prompt;
  next.insert(next.end(), alone.begin(), alone.end());
  GenerationStats c;
  (void)serve(next, store_for(redis), &c);
  EXPECT_EQ(c.prefix_shared_hits, 1);
  EXPECT_EQ(c.cached_prompt_tokens, 192);
  auto keys = redis.command("DBSIZE");
  ASSERT_TRUE(keys);
  EXPECT_EQ(keys->integer, 2) << "the first prompt and the next turn's";
}

TEST(RedisPrefixStore, AWrongOrMissingPasswordAndClusterModeAreClearErrors) {
  RedisServer redis;
  START_REDIS(redis);
  auto wrong = RedisPrefixStore::create(options_for(redis, "not-the-password"));
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("authentication refused"), std::string::npos) << wrong.status().message();
  EXPECT_EQ(wrong.status().message().find("not-the-password"), std::string::npos) << "the password is never said";
  auto none = RedisPrefixStore::create(options_for(redis, ""));
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("wants a password"), std::string::npos) << none.status().message();
  RedisPrefixStoreOptions closed = options_for(redis);
  closed.port = free_port();
  auto nobody = RedisPrefixStore::create(closed);
  ASSERT_FALSE(nobody.is_ok());
  EXPECT_EQ(nobody.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(nobody.status().message().find("cannot connect"), std::string::npos) << nobody.status().message();

  RedisServer cluster(/*cluster_mode=*/true);
  ASSERT_TRUE(cluster.start()) << cluster.log();
  auto refused = RedisPrefixStore::create(options_for(cluster));
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(refused.status().message().find("Cluster mode is not supported"), std::string::npos)
      << refused.status().message();
}

TEST(RedisPrefixStore, TheStoreKilledMidRunCostsOnlyRecomputation) {
  RedisServer redis;
  START_REDIS(redis);
  const std::vector<TokenId> prompt = specontext::testing::story_prompt(120);
  const std::vector<TokenId> alone = serve(prompt, nullptr);
  EXPECT_EQ(serve(prompt, store_for(redis)), alone);  // written
  std::vector<std::string> lines;
  std::shared_ptr<RedisPrefixStore> store = store_for(redis, &lines);
  ASSERT_TRUE(store && store->connected());
  std::shared_ptr<RedisPrefixStore> writer = store_for(redis);
  ASSERT_TRUE(writer && writer->connected());
  redis.kill_now();  // while the second server runs: its connection is open
  // A large write into the dead connection: an error, not SIGPIPE ending the process.
  const std::vector<std::byte> big = specontext::testing::random_bytes(uint64_t{8} << 20, 5);
  EXPECT_EQ(writer->put(prefix_key(1, prompt), big).code(), StatusCode::kUnavailable);
  EXPECT_FALSE(writer->connected());
  GenerationStats b;
  EXPECT_EQ(serve(prompt, store, &b), alone) << "the prompt is computed";
  EXPECT_EQ(b.prefix_shared_hits, 0);
  EXPECT_EQ(b.cached_prompt_tokens, 0);
  EXPECT_GE(b.prefix_shared_errors, 2) << "the lookup and the write";
  EXPECT_EQ(store->outages(), 1);
  ASSERT_EQ(lines.size(), 1u) << "one line for the outage";
  EXPECT_NE(lines[0].find("prefixes are computed until it is back"), std::string::npos) << lines[0];
  EXPECT_FALSE(store->connected());
  // Back (empty: no persistence): the same store reconnects, misses and writes again.
  ASSERT_TRUE(redis.start()) << redis.log();
  GenerationStats c;
  EXPECT_EQ(serve(prompt, store, &c), alone);
  EXPECT_EQ(c.prefix_shared_misses, 1);
  EXPECT_EQ(c.prefix_shared_writes, 1);
  EXPECT_EQ(c.prefix_shared_errors, 0);
  EXPECT_TRUE(store->connected());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[1].find("reachable again"), std::string::npos) << lines[1];
}

TEST(RedisPrefixStore, WritesCarryTheTtlAndAnExpiredPrefixIsAMiss) {
  RedisServer redis;
  START_REDIS(redis);
  RedisPrefixStoreOptions o = options_for(redis);
  o.ttl_seconds = 600;
  auto created = RedisPrefixStore::create(o);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  std::shared_ptr<RedisPrefixStore> store = std::move(*created);
  const std::vector<TokenId> prompt = specontext::testing::story_prompt(120);
  const std::vector<TokenId> alone = serve(prompt, store);
  auto keys = redis.command("KEYS spx:prefix:v2:*");
  ASSERT_TRUE(keys);
  ASSERT_EQ(keys->type, REDIS_REPLY_ARRAY);
  ASSERT_EQ(keys->elements, 1u);
  const std::string key(keys->element[0]->str, keys->element[0]->len);
  auto ttl = redis.command("TTL " + key);
  ASSERT_TRUE(ttl);
  EXPECT_GT(ttl->integer, 0);
  EXPECT_LE(ttl->integer, 600);
  // Its expiry time moved into the past: the server drops it as expired.
  auto expired = redis.command("PEXPIREAT " + key + " 1");
  ASSERT_TRUE(expired);
  EXPECT_EQ(expired->integer, 1);
  GenerationStats b;
  EXPECT_EQ(serve(prompt, store, &b), alone);
  EXPECT_EQ(b.prefix_shared_hits, 0);
  EXPECT_EQ(b.prefix_shared_misses, 1);
  EXPECT_EQ(b.prefix_shared_errors, 0);
  EXPECT_EQ(b.prefix_shared_writes, 1) << "written again";
}

TEST(RedisPrefixStore, ValuesOverTheBoundAreNeitherWrittenNorRead) {
  RedisServer redis;
  START_REDIS(redis);
  auto big = RedisPrefixStore::create(options_for(redis));
  RedisPrefixStoreOptions o = options_for(redis);
  o.max_blob_bytes = 1000;
  auto small = RedisPrefixStore::create(o);
  ASSERT_TRUE(big.is_ok() && small.is_ok());
  const std::vector<TokenId> t{1, 2, 3, 4};
  const PrefixKey key = prefix_key(42, t);
  const std::vector<std::byte> blob = specontext::testing::random_bytes(5000, 3);
  EXPECT_EQ((*small)->put(key, blob).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*big)->put(key, blob).is_ok());
  auto read = (*big)->get(key);
  ASSERT_TRUE(read.is_ok()) << read.status().to_string();
  EXPECT_EQ(*read, blob);
  EXPECT_EQ((*small)->get(key).status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE((*small)->connected()) << "a refused value is not an outage";
  auto held = (*small)->contains(std::vector<PrefixKey>{key, prefix_key(43, t)});
  ASSERT_TRUE(held.is_ok());
  EXPECT_EQ(*held, (std::vector<bool>{true, false}));
  EXPECT_EQ((*small)->get(prefix_key(43, t)).status().code(), StatusCode::kNotFound);
}

TEST(RedisPrefixStore, UrlsAndPasswordSources) {
  auto o = parse_redis_url("redis://cache.local:6380/3");
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->host, "cache.local");
  EXPECT_EQ(o->port, 6380);
  EXPECT_EQ(o->db, 3);
  auto user = parse_redis_url("redis://spx@10.0.0.2:6379");
  ASSERT_TRUE(user.is_ok());
  EXPECT_EQ(user->user, "spx");
  EXPECT_EQ(user->db, 0);
  auto secret = parse_redis_url("redis://spx:hunter2@10.0.0.2:6379");
  ASSERT_FALSE(secret.is_ok());
  EXPECT_NE(secret.status().message().find("password does not go in the URL"), std::string::npos);
  EXPECT_EQ(secret.status().message().find("hunter2"), std::string::npos) << "not repeated in the error";
  for (const char* bad : {"http://h:1", "redis://h", "redis://h:0", "redis://h:1/x", "rediss://h:1"}) {
    EXPECT_EQ(parse_redis_url(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  const std::string dir = specontext::testing::temp_dir("spx-redis-password");
  const std::string file = dir + "/password";
  specontext::testing::write_file(file, "s3cret\n");
  ::chmod(file.c_str(), 0600);
  auto p = load_redis_password(file);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(*p, "s3cret");
  ::chmod(file.c_str(), 0644);
  EXPECT_EQ(load_redis_password(file).status().code(), StatusCode::kInvalidArgument) << "others may read it";
  ::setenv(kRedisPasswordEnv, "from-env", 1);
  EXPECT_EQ(*load_redis_password(""), "from-env");
  ::unsetenv(kRedisPasswordEnv);
  EXPECT_EQ(*load_redis_password(""), "");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace specontext::cluster
