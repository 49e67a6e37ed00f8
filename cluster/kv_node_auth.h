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
// SHA-256 (FIPS 180-4) and HMAC (RFC 2104) are implemented here: the project links no crypto
// library. They are checked against the FIPS 180-4 examples and RFC 4231's HMAC-SHA256 test cases
// (tests/cluster/kv_node_auth_test.cc). Pure code, no sockets: fuzzed with the control protocol.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/base/status.h"

namespace specontext::cluster {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthMacBytes = 32;
// A secret shorter than this is refused (e.g. `head -c 32 /dev/urandom | base64 > kv.secret`);
// longer than kMaxSecretBytes is not a secret file.
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;
inline constexpr const char* kSecretEnv = "SPECONTEXT_KV_SECRET";

using Sha256Digest = std::array<uint8_t, 32>;
using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;

Sha256Digest sha256(std::span<const uint8_t> data);
Sha256Digest hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> message);

// True when a and b hold the same bytes; the time taken depends on the sizes only.
bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);

// Bytes from getrandom (the kernel CSPRNG; blocks only until it is seeded at boot).
Status fill_random(std::span<uint8_t> out);

// The client's answer to `nonce` from node `node_name` (the name its hello reply gave).
Sha256Digest auth_response(std::string_view secret, const AuthNonce& nonce, std::string_view node_name);
// The node's proof, in its auth reply, that it holds the secret: bound to the client's nonce, to
// the node's own challenge (so it cannot be replayed from another session) and to the node's name.
// A different context from auth_response's, so neither side's answer serves as the other's.
Sha256Digest node_proof(std::string_view secret, const AuthNonce& client_nonce, const AuthNonce& node_nonce,
                        std::string_view node_name);

// The shared secret: the file's content when `file` is given (at most kMaxSecretBytes, trailing
// whitespace dropped, readable by its owner only), else SPECONTEXT_KV_SECRET, else "" (none).
// kInvalidArgument naming the file or variable when it is unreadable, too short or too long, or
// the file can be read by group or others.
Result<std::string> load_kv_secret(const std::string& file);

}  // namespace specontext::cluster
