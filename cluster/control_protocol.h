// The KV node's control plane: one JSON object per line over TCP, request → reply, in order.
//   {"op":"hello","version":V[,"client":ID]}
//                                 → an open node (started without a secret, loopback only):
//                                   {"ok":true,"version":V,"node":NAME,"auth":"none",INFO}
//                                   a node with a secret: {"ok":true,"version":V,"node":NAME,
//                                   "auth":"hmac-sha256","nonce":HEX} (32 random bytes, fresh per hello)
//                                   (a version the node does not speak: error naming both versions)
//                                   ID: the client's name in the node's keys file (kv_node_auth.h);
//                                   none: the shared secret's client. Known or not, the reply is the
//                                   same challenge: an unknown ID fails at auth like a wrong answer.
//   {"op":"auth","mac":HEX,"nonce":HEX}
//                                 → {"ok":true,"version":V,"node":NAME,"auth":"done","proof":HEX,INFO};
//                                   MAC is HMAC-SHA256(secret, node nonce ‖ context), the request's nonce
//                                   32 random bytes of the client's, and PROOF the node's answer to it
//                                   (cluster/kv_node_auth.h: mutual authentication). A wrong or missing
//                                   answer: error, and the node closes the connection; a wrong or missing
//                                   proof: the client refuses the node.
//     INFO: "capacity":N,"free":N,"quota":N,"worker_address":HEX,"rma":false,"rma_refused":WHY
//     (quota: the bytes this client, all its connections together, may hold at once; 0: up to the
//     capacity; free: what the node has free, at most what the quota leaves this client)
//   {"op":"alloc","bytes":N}      → {"ok":true,"region":ID,"address":A,"bytes":N,"key":HEX[,"rkey":HEX]}
//   {"op":"free","region":ID}     → {"ok":true}
//   {"op":"stats"}                → a client of the keys file sees its own usage only:
//                                   {"ok":true,"client":ID,"capacity":N,"quota":N,"used":N,
//                                    "regions":N,"connections":N}
//                                   the shared secret's client (or anyone, on an open node) the node's:
//                                   {"ok":true,"capacity":N,"used":N,"regions":N,"connections":N,
//                                    "bytes_gathered":N,"bytes_scattered":N,"auth_failures":N,
//                                    "connections_refused":N,"idle_closed":N,"quota_refusals":N,
//                                    "tls_failures":N}
// alloc, free and stats before authentication (on a node with a secret) count as a failed
// authentication and close the connection. An alloc beyond the client's quota (what its connections
// hold together) is refused (RESOURCE_EXHAUSTED) and allocates nothing; a client at its own
// connection limit is refused at auth (RESOURCE_EXHAUSTED) and closed. A connection past the node's limit is sent one error
// line and closed; one that sends no request for the idle timeout while holding no region is closed.
// Errors: {"ok":false,"error":TEXT} naming the field; the connection stays usable, except after a
// line longer than kMaxControlLine (then the node replies and closes). Regions belong to the
// connection that allocated them and are freed when it closes, so a client that dies leaks
// nothing. A region's id ID (a random 64-bit number) and key K (128 bits from getrandom, 32 hex
// digits) go with every gather / scatter that names it (transport/ucx_wire.h); neither follows
// from the ids and keys a client has seen. "rkey" (a UCX remote key of the region alone) is sent
// only when the node serves one-sided RMA ("rma": true), which it never does where a transport or
// UCX's software RMA would let an RMA key reach beyond its region ("rma_refused" says why). A freed
// region's pages are given back to the system, so the next region over them reads zeros.
// The lines travel over TCP, or TLS (cluster/kv_node_tls.h) when the node has a certificate.
// Parsing is pure (no sockets) and fuzzed (tests/fuzz/fuzz_control.cc).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/kv_node_auth.h"
#include "core/base/status.h"
#include "transport/ucx_wire.h"

namespace specontext::cluster {

inline constexpr size_t kMaxControlLine = 64 * 1024;
// 2: regions have keys and their own rkeys. 3: 128-bit keys as hex, random region ids, rkeys
// only from a node that serves RMA. 4: challenge–response authentication at hello (op "auth").
inline constexpr int kControlVersion = 5;

enum class ControlOp { kHello, kAuth, kAlloc, kFree, kStats };

struct ControlRequest {
  ControlOp op = ControlOp::kHello;
  uint64_t bytes = 0;   // alloc
  uint64_t region = 0;  // free
  int64_t version = 0;  // hello: the client's kControlVersion (0: not given)
  Sha256Digest mac{};   // auth: the answer to the hello's nonce
  AuthNonce nonce{};    // auth: the client's challenge to the node
  std::string client;   // hello: the client's ID ("": the shared secret's client); valid_client_id
};

// kInvalidArgument naming the field ("control request: field 'bytes' ...").
Result<ControlRequest> parse_control_request(std::string_view line);
std::string control_request_line(const ControlRequest& request);  // with the trailing newline

// A hello reply, or an auth reply. When `auth_required`, only node, version and nonce are set:
// answer with an auth request, whose reply gives the rest.
struct HelloReply {
  std::string node;
  int64_t version = 0;
  bool auth_required = false;
  AuthNonce nonce{};
  // An auth reply's proof that the node holds the secret (cluster/kv_node_auth.h node_proof).
  bool has_proof = false;
  Sha256Digest proof{};
  uint64_t capacity = 0;
  uint64_t quota = 0;  // bytes this connection may hold at once (0: up to the capacity)
  uint64_t free = 0;
  std::vector<uint8_t> worker_address;
  bool rma = false;         // the node hands out remote keys for one-sided RMA
  std::string rma_refused;  // when it does not, why
};
struct AllocReply {
  uint64_t region = 0;
  uint64_t address = 0;
  uint64_t bytes = 0;
  std::vector<uint8_t> rkey;  // empty when the node serves no RMA
  transport::ucx_wire::RegionKey key{};
};
// A reply line: the node's error (with its code) when ok is false, kDataLoss naming the field when
// the reply is malformed.
Result<nlohmann::json> parse_control_reply(std::string_view line, std::string_view node);
Result<HelloReply> parse_hello_reply(const nlohmann::json& reply, std::string_view node);
Result<AllocReply> parse_alloc_reply(const nlohmann::json& reply, std::string_view node);

// Serialises an error reply; the code travels as its name so the client can rebuild it.
std::string control_error_line(const Status& status);

// Worker addresses, remote keys and region keys travel as lowercase hex.
std::string hex_encode(std::span<const uint8_t> bytes);
// kInvalidArgument naming `field` for odd length or a non-hex digit.
Result<std::vector<uint8_t>> hex_decode(std::string_view text, std::string_view field);

// "host:port" with a port in 1..65535 (0 allowed when `allow_any_port`, for listening).
struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string text() const { return host + ":" + std::to_string(port); }
};
Result<Endpoint> parse_endpoint(std::string_view text, bool allow_any_port = false);

}  // namespace specontext::cluster
