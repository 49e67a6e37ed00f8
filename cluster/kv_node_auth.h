// Authentication of the KV node's control plane: a shared secret, never sent, proven by
// challenge–response at hello (cluster/control_protocol.h):
//   node → client: a nonce of kAuthNonceBytes from getrandom (the kernel CSPRNG), fresh per hello;
//   client → node: HMAC-SHA256(secret, nonce ‖ "specontext kv-node auth v<version>" ‖ 0 ‖ node name);
//   the node compares in constant time and closes the connection on a wrong answer;
//   the client sends, with its answer, a nonce of its own (getrandom), and the node proves it
//   holds the secret too: HMAC-SHA256(secret, client nonce ‖ node nonce ‖ "specontext kv-node proof
//   v<version>" ‖ 0 ‖ node name), which the client compares in constant time before it sends KV
//   anywhere (so a process posing as a node at a known address is found out at hello).
// The secret comes from a file (--secret-file / --kv-secret-file) or the environment variable
// SPECONTEXT_KV_SECRET, never from the command line (where `ps` and shell history show it).
//
// Per-client identities: a node may hold a keys file (kv-node --keys-file, or the variable
// SPECONTEXT_KV_KEYS_FILE), one client per line, `ID SECRET QUOTA [MAX_CONNECTIONS]` ('#' starts a
// comment). A client names its ID in the hello (--kv-client-id) and answers with its own secret;
// the answer and the node's proof are bound to the ID too (… ‖ 0 ‖ node name ‖ 0 ‖ ID), so one
// client's answer never serves as another's. The shared secret stays one client without an ID.
//
// SHA-256 (FIPS 180-4) and HMAC (RFC 2104) are implemented here: the project links no crypto
// library. They are checked against the FIPS 180-4 examples and RFC 4231's HMAC-SHA256 test cases
// (tests/cluster/kv_node_auth_test.cc). Pure code, no sockets: fuzzed with the control protocol.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"

namespace specontext::cluster {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthMacBytes = 32;
// A secret shorter than this is refused (e.g. `head -c 32 /dev/urandom | base64 > kv.secret`);
// longer than kMaxSecretBytes is not a secret file.
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;
inline constexpr const char* kSecretEnv = "SPECONTEXT_KV_SECRET";
inline constexpr const char* kKeysFileEnv = "SPECONTEXT_KV_KEYS_FILE";
inline constexpr const char* kClientIdEnv = "SPECONTEXT_KV_CLIENT_ID";
inline constexpr size_t kMaxClientIdBytes = 64;
inline constexpr size_t kMaxKeysFileBytes = 1 << 20;
inline constexpr size_t kMaxClients = 4096;

using Sha256Digest = std::array<uint8_t, 32>;
using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;

Sha256Digest sha256(std::span<const uint8_t> data);
Sha256Digest hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> message);

// True when a and b hold the same bytes; the time taken depends on the sizes only.
bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);

// Bytes from getrandom (the kernel CSPRNG; blocks only until it is seeded at boot).
Status fill_random(std::span<uint8_t> out);

// The client's answer to `nonce` from node `node_name` (the name its hello reply gave), as client
// `client_id` ("" for the shared secret, whose answer is the same as before IDs existed).
Sha256Digest auth_response(std::string_view secret, const AuthNonce& nonce, std::string_view node_name,
                           std::string_view client_id = {});
// The node's proof, in its auth reply, that it holds the secret: bound to the client's nonce, to
// the node's own challenge (so it cannot be replayed from another session) and to the node's name.
// A different context from auth_response's, so neither side's answer serves as the other's.
Sha256Digest node_proof(std::string_view secret, const AuthNonce& client_nonce, const AuthNonce& node_nonce,
                        std::string_view node_name, std::string_view client_id = {});

// The shared secret: the file's content when `file` is given (at most kMaxSecretBytes, trailing
// whitespace dropped, readable by its owner only), else SPECONTEXT_KV_SECRET, else "" (none).
// kInvalidArgument naming the file or variable when it is unreadable, too short or too long, or
// the file can be read by group or others.
Result<std::string> load_kv_secret(const std::string& file);

// A client ID: 1 to kMaxClientIdBytes of [A-Za-z0-9._-] (safe to log and to put in a message).
bool valid_client_id(std::string_view id);

// One client of a keys file.
struct KvClientKey {
  std::string id;
  std::string secret;           // at least kMinSecretBytes, no whitespace
  uint64_t quota = 0;           // bytes all its connections may hold at once; 0: up to the capacity
  int64_t max_connections = 0;  // its connections at once; 0: only the node's limit
};
// The lines of a keys file (`source` names it in errors: line number and field, never a secret).
// QUOTA is bytes, with an optional KiB / MiB / GiB / TiB suffix, or 0. At most kMaxClients, IDs unique.
Result<std::vector<KvClientKey>> parse_kv_keys(std::string_view text, const std::string& source);
// The keys file `file` (else SPECONTEXT_KV_KEYS_FILE; neither: no clients), read under the same
// rules as the secret file (regular, owner-readable only, at most kMaxKeysFileBytes).
Result<std::vector<KvClientKey>> load_kv_keys(const std::string& file);
// The client ID a client names: `id` when given, else SPECONTEXT_KV_CLIENT_ID, else "" (the shared
// secret's client). kInvalidArgument naming --kv-client-id or the variable when not valid.
Result<std::string> load_kv_client_id(const std::string& id);

}  // namespace specontext::cluster
