#include "cluster/kv_node_auth.h"

#include "core/base/private_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_set>
#include <vector>

namespace specontext::cluster {

namespace {

// ---- SHA-256, FIPS 180-4 section 6.2 ----
constexpr std::array<uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

class Sha256 {
 public:
  void update(std::span<const uint8_t> data) {
    for (uint8_t b : data) {
      block_[fill_++] = b;
      if (fill_ == block_.size()) {
        compress();
        fill_ = 0;
      }
    }
    bits_ += static_cast<uint64_t>(data.size()) * 8;
  }

  Sha256Digest finish() {
    const uint64_t bits = bits_;
    const uint8_t one = 0x80;
    update({&one, 1});
    const uint8_t zero = 0;
    while (fill_ != 56) update({&zero, 1});
    std::array<uint8_t, 8> length{};
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    update(length);
    Sha256Digest out{};
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
    }
    return out;
  }

 private:
  void compress() {
    std::array<uint32_t, 64> w{};
    for (int t = 0; t < 16; ++t) {
      w[t] = uint32_t{block_[4 * t]} << 24 | uint32_t{block_[4 * t + 1]} << 16 |
             uint32_t{block_[4 * t + 2]} << 8 | uint32_t{block_[4 * t + 3]};
    }
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int t = 0; t < 64; ++t) {
      const uint32_t t1 =
          h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + w[t];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += b;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }

  std::array<uint32_t, 8> h_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<uint8_t, 64> block_{};
  size_t fill_ = 0;
  uint64_t bits_ = 0;
};

std::span<const uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

Result<std::string> checked_secret(std::string secret, const std::string& source) {
  while (!secret.empty() && std::strchr(" \t\r\n", secret.back()) != nullptr) secret.pop_back();
  if (secret.size() < kMinSecretBytes) {
    return invalid_argument(source + ": the KV node secret must hold at least " +
                            std::to_string(kMinSecretBytes) +
                            " bytes (e.g. `head -c 32 /dev/urandom | base64`)");
  }
  return secret;
}

Result<std::string> read_secret_file(const std::string& file) {
  SPX_ASSIGN_OR_RETURN(std::string text, read_private_file(file, kMaxSecretBytes, "secret file"));
  return checked_secret(std::move(text), "secret file " + file);
}

// QUOTA of a keys file: bytes, optionally with a binary suffix; 0 allowed.
std::optional<uint64_t> parse_quota(std::string_view text) {
  static constexpr std::pair<std::string_view, int> kSuffixes[] = {{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}};
  int shift = 0;
  for (const auto& [suffix, bits] : kSuffixes) {
    if (text.size() > suffix.size() && text.substr(text.size() - suffix.size()) == suffix) {
      text.remove_suffix(suffix.size());
      shift = bits;
      break;
    }
  }
  uint64_t value = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty()) return std::nullopt;
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) return std::nullopt;
  return value << shift;
}

std::vector<std::string_view> split_fields(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t') ++j;
    if (j > i) out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

}  // namespace

Sha256Digest sha256(std::span<const uint8_t> data) {
  Sha256 h;
  h.update(data);
  return h.finish();
}

// RFC 2104: H((K ^ opad) ‖ H((K ^ ipad) ‖ m)), K hashed first when longer than the block.
Sha256Digest hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> message) {
  std::array<uint8_t, 64> k{};
  if (key.size() > k.size()) {
    const Sha256Digest d = sha256(key);
    std::copy(d.begin(), d.end(), k.begin());
  } else {
    std::copy(key.begin(), key.end(), k.begin());
  }
  std::array<uint8_t, 64> pad{};
  for (size_t i = 0; i < k.size(); ++i) pad[i] = k[i] ^ 0x36;
  Sha256 inner;
  inner.update(pad);
  inner.update(message);
  const Sha256Digest inner_digest = inner.finish();
  for (size_t i = 0; i < k.size(); ++i) pad[i] = k[i] ^ 0x5c;
  Sha256 outer;
  outer.update(pad);
  outer.update(inner_digest);
  return outer.finish();
}

bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  if (a.size() != b.size()) return false;
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

Status fill_random(std::span<uint8_t> out) {
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return internal_error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

// `… ‖ 0 ‖ ID` for a client with an ID; nothing for the shared secret's client.
void bind_client(std::vector<uint8_t>& message, std::string_view client_id) {
  if (client_id.empty()) return;
  message.push_back(0);
  message.insert(message.end(), client_id.begin(), client_id.end());
}

Sha256Digest auth_response(std::string_view secret, const AuthNonce& nonce, std::string_view node_name,
                           std::string_view client_id) {
  // The context binds the answer to this protocol (never valid for another use of the secret)
  // and to the node that asked.
  static constexpr std::string_view kContext = "specontext kv-node auth v5";
  std::vector<uint8_t> message(nonce.begin(), nonce.end());
  message.insert(message.end(), kContext.begin(), kContext.end());
  message.push_back(0);
  message.insert(message.end(), node_name.begin(), node_name.end());
  bind_client(message, client_id);
  return hmac_sha256(bytes_of(secret), message);
}

Sha256Digest node_proof(std::string_view secret, const AuthNonce& client_nonce, const AuthNonce& node_nonce,
                        std::string_view node_name, std::string_view client_id) {
  static constexpr std::string_view kContext = "specontext kv-node proof v5";
  std::vector<uint8_t> message(client_nonce.begin(), client_nonce.end());
  message.insert(message.end(), node_nonce.begin(), node_nonce.end());
  message.insert(message.end(), kContext.begin(), kContext.end());
  message.push_back(0);
  message.insert(message.end(), node_name.begin(), node_name.end());
  bind_client(message, client_id);
  return hmac_sha256(bytes_of(secret), message);
}

Result<std::string> load_kv_secret(const std::string& file) {
  if (!file.empty()) return read_secret_file(file);
  const char* env = std::getenv(kSecretEnv);
  if (env == nullptr || *env == '\0') return std::string();
  const std::string value(env);
  if (value.size() > kMaxSecretBytes) {
    return invalid_argument(std::string(kSecretEnv) + ": longer than " + std::to_string(kMaxSecretBytes) +
                            " bytes");
  }
  return checked_secret(value, kSecretEnv);
}

bool valid_client_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxClientIdBytes) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Result<std::vector<KvClientKey>> parse_kv_keys(std::string_view text, const std::string& source) {
  std::vector<KvClientKey> keys;
  std::unordered_set<std::string> ids;
  size_t line_no = 0;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::vector<std::string_view> f = split_fields(line);
    if (f.empty()) continue;
    const std::string where = source + " line " + std::to_string(line_no);
    if (f.size() < 3 || f.size() > 4) {
      return invalid_argument(where + ": expected ID SECRET QUOTA [MAX_CONNECTIONS], found " +
                              std::to_string(f.size()) + " fields");
    }
    KvClientKey k;
    if (!valid_client_id(f[0])) {
      return invalid_argument(where + ": the client ID must be 1 to " + std::to_string(kMaxClientIdBytes) +
                              " of A-Z a-z 0-9 . _ -");
    }
    k.id = std::string(f[0]);
    if (!ids.insert(k.id).second) return invalid_argument(where + ": client " + k.id + " is listed twice");
    if (f[1].size() < kMinSecretBytes) {
      return invalid_argument(where + ": client " + k.id + "'s secret must hold at least " +
                              std::to_string(kMinSecretBytes) + " bytes");
    }
    k.secret = std::string(f[1]);
    const std::optional<uint64_t> quota = parse_quota(f[2]);
    if (!quota) {
      return invalid_argument(where + ": client " + k.id + "'s quota must be bytes (e.g. 1073741824, 1GiB; 0: up to "
                                                           "the capacity)");
    }
    k.quota = *quota;
    if (f.size() == 4) {
      int64_t n = 0;
      auto [p, ec] = std::from_chars(f[3].data(), f[3].data() + f[3].size(), n);
      if (ec != std::errc() || p != f[3].data() + f[3].size() || n < 0 || n > 1000000) {
        return invalid_argument(where + ": client " + k.id +
                                "'s MAX_CONNECTIONS must be a count (0: only the node's limit)");
      }
      k.max_connections = n;
    }
    keys.push_back(std::move(k));
    if (keys.size() > kMaxClients) {
      return invalid_argument(source + ": more than " + std::to_string(kMaxClients) + " clients");
    }
  }
  return keys;
}

Result<std::vector<KvClientKey>> load_kv_keys(const std::string& file) {
  std::string path = file;
  std::string label = "keys file " + file;
  if (path.empty()) {
    const char* env = std::getenv(kKeysFileEnv);
    if (env == nullptr || *env == '\0') return std::vector<KvClientKey>{};
    path = env;
    label = std::string(kKeysFileEnv) + "=" + path;
  }
  SPX_ASSIGN_OR_RETURN(const std::string text, read_private_file(path, kMaxKeysFileBytes, "keys file"));
  SPX_ASSIGN_OR_RETURN(std::vector<KvClientKey> keys, parse_kv_keys(text, label));
  if (keys.empty()) return invalid_argument(label + ": no client in it");
  return keys;
}

Result<std::string> load_kv_client_id(const std::string& id) {
  std::string value = id;
  std::string source = "--kv-client-id";
  if (value.empty()) {
    const char* env = std::getenv(kClientIdEnv);
    if (env == nullptr || *env == '\0') return std::string();
    value = env;
    source = kClientIdEnv;
  }
  if (!valid_client_id(value)) {
    return invalid_argument(source + ": a client ID is 1 to " + std::to_string(kMaxClientIdBytes) +
                            " of A-Z a-z 0-9 . _ -");
  }
  return value;
}

}  // namespace specontext::cluster
