#include "cluster/control_protocol.h"

#include <algorithm>
#include <charconv>

#include "core/base/json_depth.h"

namespace specontext::cluster {

std::string hex_encode(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

Result<std::vector<uint8_t>> hex_decode(std::string_view text, std::string_view field) {
  if (text.size() % 2 != 0) return invalid_argument(std::string(field) + ": odd number of hex digits");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::vector<uint8_t> out(text.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(text[2 * i]);
    const int lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return invalid_argument(std::string(field) + ": not a hex string");
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

namespace {

Status field_error(std::string_view field, std::string_view what) {
  return invalid_argument("control request: field '" + std::string(field) + "' " + std::string(what));
}

Result<uint64_t> positive_u64(const nlohmann::json& j, std::string_view field) {
  auto it = j.find(field);
  if (it == j.end()) return field_error(field, "is missing");
  if (!it->is_number_unsigned() || it->get<uint64_t>() == 0)
    return field_error(field, "must be a positive integer");
  return it->get<uint64_t>();
}

Status reply_error(std::string_view node, std::string_view what) {
  return data_loss("kv node " + std::string(node) + ": malformed reply: " + std::string(what));
}

Result<uint64_t> reply_u64(const nlohmann::json& j, std::string_view field, std::string_view node) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_number_unsigned()) {
    return reply_error(node, "field '" + std::string(field) + "' missing or not an unsigned integer");
  }
  return it->get<uint64_t>();
}

Result<std::vector<uint8_t>> reply_hex(const nlohmann::json& j, std::string_view field,
                                       std::string_view node) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
    return reply_error(node, "field '" + std::string(field) + "' missing or not a hex string");
  }
  auto bytes = hex_decode(it->get_ref<const std::string&>(), field);
  if (!bytes.is_ok()) return reply_error(node, bytes.status().message());
  return bytes;
}

StatusCode code_from_name(std::string_view name) {
  for (StatusCode c : {StatusCode::kInvalidArgument, StatusCode::kNotFound, StatusCode::kOutOfRange,
                       StatusCode::kResourceExhausted, StatusCode::kUnavailable, StatusCode::kUnimplemented,
                       StatusCode::kDataLoss}) {
    if (status_code_name(c) == name) return c;
  }
  return StatusCode::kInternal;
}

}  // namespace

Result<ControlRequest> parse_control_request(std::string_view line) {
  if (line.size() > kMaxControlLine) return invalid_argument("control request: line longer than 64 KiB");
  if (json_too_deep(line)) {
    return invalid_argument("control request: nests arrays and objects deeper than " +
                            std::to_string(kMaxJsonDepth) + " levels");
  }
  nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument("control request: not valid JSON");
  if (!j.is_object()) return invalid_argument("control request: not a JSON object");
  auto op = j.find("op");
  if (op == j.end() || !op->is_string()) return field_error("op", "must be a string");
  const std::string& name = op->get_ref<const std::string&>();
  ControlRequest r;
  if (name == "hello") {
    r.op = ControlOp::kHello;
    if (j.contains("version")) {
      SPX_ASSIGN_OR_RETURN(const uint64_t v, positive_u64(j, "version"));
      if (v > 1000000) return field_error("version", "is not a protocol version");
      r.version = static_cast<int64_t>(v);
    }
    if (auto client = j.find("client"); client != j.end()) {
      if (!client->is_string() || !valid_client_id(client->get_ref<const std::string&>())) {
        return field_error("client", "must be 1 to " + std::to_string(kMaxClientIdBytes) +
                                         " of A-Z a-z 0-9 . _ -");
      }
      r.client = client->get<std::string>();
    }
  } else if (name == "auth") {
    r.op = ControlOp::kAuth;
    auto mac = j.find("mac");
    if (mac == j.end() || !mac->is_string() ||
        mac->get_ref<const std::string&>().size() != 2 * r.mac.size()) {
      return field_error("mac", "must be " + std::to_string(2 * r.mac.size()) + " hex digits");
    }
    SPX_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes,
                         hex_decode(mac->get_ref<const std::string&>(), "control request: field 'mac'"));
    std::copy(bytes.begin(), bytes.end(), r.mac.begin());
    auto nonce = j.find("nonce");
    if (nonce == j.end() || !nonce->is_string() ||
        nonce->get_ref<const std::string&>().size() != 2 * r.nonce.size()) {
      return field_error("nonce", "must be " + std::to_string(2 * r.nonce.size()) + " hex digits");
    }
    SPX_ASSIGN_OR_RETURN(const std::vector<uint8_t> challenge,
                         hex_decode(nonce->get_ref<const std::string&>(), "control request: field 'nonce'"));
    std::copy(challenge.begin(), challenge.end(), r.nonce.begin());
  } else if (name == "alloc") {
    r.op = ControlOp::kAlloc;
    SPX_ASSIGN_OR_RETURN(r.bytes, positive_u64(j, "bytes"));
  } else if (name == "free") {
    r.op = ControlOp::kFree;
    SPX_ASSIGN_OR_RETURN(r.region, positive_u64(j, "region"));
  } else if (name == "stats") {
    r.op = ControlOp::kStats;
  } else {
    return field_error("op", "is not one of hello, auth, alloc, free, stats: '" + name.substr(0, 64) + "'");
  }
  return r;
}

std::string control_request_line(const ControlRequest& r) {
  nlohmann::json j;
  switch (r.op) {
    case ControlOp::kHello:
      j = {{"op", "hello"}, {"version", kControlVersion}};
      if (!r.client.empty()) j["client"] = r.client;
      break;
    case ControlOp::kAuth:
      j = {{"op", "auth"}, {"mac", hex_encode(r.mac)}, {"nonce", hex_encode(r.nonce)}};
      break;
    case ControlOp::kAlloc:
      j = {{"op", "alloc"}, {"bytes", r.bytes}};
      break;
    case ControlOp::kFree:
      j = {{"op", "free"}, {"region", r.region}};
      break;
    case ControlOp::kStats:
      j = {{"op", "stats"}};
      break;
  }
  return j.dump() + "\n";
}

std::string control_error_line(const Status& status) {
  nlohmann::json j = {
      {"ok", false}, {"code", std::string(status_code_name(status.code()))}, {"error", status.message()}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Result<nlohmann::json> parse_control_reply(std::string_view line, std::string_view node) {
  if (line.size() > kMaxControlLine) return reply_error(node, "line longer than 64 KiB");
  nlohmann::json j = parse_json_bounded(line);
  if (j.is_discarded() || !j.is_object()) return reply_error(node, "not a JSON object (or nested too deep)");
  auto ok = j.find("ok");
  if (ok == j.end() || !ok->is_boolean()) return reply_error(node, "field 'ok' missing or not a boolean");
  if (!ok->get<bool>()) {
    auto err = j.find("error");
    auto code = j.find("code");
    const std::string msg = err != j.end() && err->is_string() ? err->get<std::string>() : "(no message)";
    const StatusCode c = code != j.end() && code->is_string() ? code_from_name(code->get<std::string>())
                                                              : StatusCode::kInternal;
    return Status(c, "kv node " + std::string(node) + ": " + msg);
  }
  return j;
}

Result<HelloReply> parse_hello_reply(const nlohmann::json& j, std::string_view node) {
  HelloReply h;
  auto version = j.find("version");
  const int64_t v = version != j.end() && version->is_number_integer() ? version->get<int64_t>() : 1;
  if (v != kControlVersion) {
    return unimplemented("kv node " + std::string(node) + " speaks control protocol " + std::to_string(v) +
                         ", this client " + std::to_string(kControlVersion) +
                         ": run the same release on both");
  }
  h.version = v;
  auto name = j.find("node");
  if (name == j.end() || !name->is_string()) return reply_error(node, "field 'node' missing or not a string");
  h.node = name->get<std::string>();
  auto auth = j.find("auth");
  if (auth == j.end() || !auth->is_string()) return reply_error(node, "field 'auth' missing or not a string");
  const std::string& scheme = auth->get_ref<const std::string&>();
  if (scheme == "hmac-sha256") {
    h.auth_required = true;
    SPX_ASSIGN_OR_RETURN(const std::vector<uint8_t> nonce, reply_hex(j, "nonce", node));
    if (nonce.size() != h.nonce.size()) {
      return reply_error(node, "field 'nonce' is not " + std::to_string(2 * h.nonce.size()) + " hex digits");
    }
    std::copy(nonce.begin(), nonce.end(), h.nonce.begin());
    return h;
  }
  if (scheme != "none" && scheme != "done") {
    return reply_error(node,
                       "field 'auth' is not one of none, hmac-sha256, done: '" + scheme.substr(0, 64) + "'");
  }
  if (scheme == "done") {
    SPX_ASSIGN_OR_RETURN(const std::vector<uint8_t> proof, reply_hex(j, "proof", node));
    if (proof.size() != h.proof.size()) {
      return reply_error(node, "field 'proof' is not " + std::to_string(2 * h.proof.size()) + " hex digits");
    }
    std::copy(proof.begin(), proof.end(), h.proof.begin());
    h.has_proof = true;
  }
  SPX_ASSIGN_OR_RETURN(h.capacity, reply_u64(j, "capacity", node));
  SPX_ASSIGN_OR_RETURN(h.free, reply_u64(j, "free", node));
  SPX_ASSIGN_OR_RETURN(h.quota, reply_u64(j, "quota", node));
  SPX_ASSIGN_OR_RETURN(h.worker_address, reply_hex(j, "worker_address", node));
  auto rma = j.find("rma");
  if (rma == j.end() || !rma->is_boolean()) return reply_error(node, "field 'rma' missing or not a boolean");
  h.rma = rma->get<bool>();
  if (auto why = j.find("rma_refused"); why != j.end() && why->is_string())
    h.rma_refused = why->get<std::string>();
  return h;
}

Result<AllocReply> parse_alloc_reply(const nlohmann::json& j, std::string_view node) {
  AllocReply a;
  SPX_ASSIGN_OR_RETURN(a.region, reply_u64(j, "region", node));
  SPX_ASSIGN_OR_RETURN(a.address, reply_u64(j, "address", node));
  SPX_ASSIGN_OR_RETURN(a.bytes, reply_u64(j, "bytes", node));
  if (j.contains("rkey")) {
    SPX_ASSIGN_OR_RETURN(a.rkey, reply_hex(j, "rkey", node));
  }
  SPX_ASSIGN_OR_RETURN(const std::vector<uint8_t> key, reply_hex(j, "key", node));
  if (key.size() != a.key.size()) {
    return reply_error(node, "field 'key' is not " + std::to_string(2 * a.key.size()) + " hex digits");
  }
  std::copy(key.begin(), key.end(), a.key.begin());
  if (transport::ucx_wire::is_zero_key(a.key)) return reply_error(node, "field 'key' is 0");
  return a;
}

Result<Endpoint> parse_endpoint(std::string_view text, bool allow_any_port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return invalid_argument("endpoint '" + std::string(text) + "': expected HOST:PORT");
  }
  Endpoint e;
  e.host = std::string(text.substr(0, colon));
  const std::string_view port = text.substr(colon + 1);
  unsigned value = 0;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || p != port.data() + port.size() || value > 65535 ||
      (value == 0 && !allow_any_port)) {
    return invalid_argument("endpoint '" + std::string(text) + "': port must be 1..65535");
  }
  e.port = static_cast<uint16_t>(value);
  return e;
}

}  // namespace specontext::cluster
