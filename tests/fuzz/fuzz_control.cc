// libFuzzer target: the KV node's control plane. Any line gives a request or an error (never a
// throw or crash); a request that parses survives a round trip; any reply line gives a reply or an
// error, and a well-formed hello/auth/alloc reply decodes its hex fields; the authentication's
// HMAC takes any input as secret, nonce, node name and client ID, and binds the ID; any text as a
// keys file gives clients with valid IDs, long enough secrets without whitespace, or an error.
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string_view>

#include "cluster/control_protocol.h"
#include "cluster/kv_node_auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace specontext::cluster;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto req = parse_control_request(text);
  if (req.is_ok()) {
    std::string line = control_request_line(*req);
    line.pop_back();  // the newline
    auto again = parse_control_request(line);
    if (!again.is_ok() || again->op != req->op || again->bytes != req->bytes ||
        again->region != req->region || again->mac != req->mac || again->nonce != req->nonce ||
        again->client != req->client) {
      __builtin_trap();
    }
    if (!req->client.empty() && !valid_client_id(req->client)) __builtin_trap();
  } else {
    (void)control_error_line(req.status());
  }
  auto reply = parse_control_reply(text, "fuzz:1");
  if (reply.is_ok()) {
    (void)parse_hello_reply(*reply, "fuzz:1");
    (void)parse_alloc_reply(*reply, "fuzz:1");
  }
  (void)parse_endpoint(text, size % 2 == 0);
  AuthNonce nonce{};
  for (size_t i = 0; i < size && i < nonce.size(); ++i) nonce[i] = data[i];
  const Sha256Digest mac = auth_response(text, nonce, text.substr(size / 2));
  if (!constant_time_equal(mac, auth_response(text, nonce, text.substr(size / 2)))) __builtin_trap();
  // The node's proof never equals the client's answer for the same nonce (distinct contexts).
  if (constant_time_equal(mac, node_proof(text, nonce, nonce, text.substr(size / 2)))) __builtin_trap();
  // A client's answer is bound to its ID: never the shared secret's answer, never another ID's.
  const std::string_view id = text.substr(0, std::min<size_t>(size, kMaxClientIdBytes));
  if (valid_client_id(id)) {
    const Sha256Digest as_client = auth_response(text, nonce, "node", id);
    if (constant_time_equal(as_client, auth_response(text, nonce, "node"))) __builtin_trap();
    if (constant_time_equal(node_proof(text, nonce, nonce, "node", id), node_proof(text, nonce, nonce, "node")))
      __builtin_trap();
  }
  auto keys = parse_kv_keys(text, "fuzz");
  if (keys.is_ok()) {
    if (keys->size() > kMaxClients) __builtin_trap();
    for (const KvClientKey& k : *keys) {
      if (!valid_client_id(k.id) || k.secret.size() < kMinSecretBytes || k.max_connections < 0) __builtin_trap();
      for (char c : k.secret) {
        if (c == ' ' || c == '\t' || c == '\n' || c == '#') __builtin_trap();
      }
    }
  }
  auto bytes = hex_decode(text, "fuzz");
  if (bytes.is_ok() && hex_encode(*bytes).size() != text.size()) __builtin_trap();
  return 0;
}
