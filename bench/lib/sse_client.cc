#include "bench/lib/sse_client.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

namespace specontext::bench {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

RequestTiming stream_completion(asio::ip::tcp::socket& socket, const std::string& body,
                                const std::string& extra_headers) {
  RequestTiming t;
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n" + extra_headers +
      "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  const auto start = Clock::now();
  boost::system::error_code ec;
  asio::write(socket, asio::buffer(req), ec);
  if (ec) return t;
  std::string got;
  // The body de-chunked: a relay (the router) cuts a stream into chunks anywhere, so an event can
  // span chunks and chunk framing must not be read as event text.
  std::string body_text;
  size_t raw_pos = 0;  // next unread byte of `got` (a chunk-size line or chunk data)
  bool chunked = false, body_done = false;
  size_t scanned = 0;
  auto last = start;
  bool first = true;
  char buf[16384];
  for (;;) {
    const size_t n = socket.read_some(asio::buffer(buf), ec);
    if (ec) return t;
    const auto now = Clock::now();
    got.append(buf, n);
    if (t.http_status == 0) {
      const size_t head_end = got.find("\r\n\r\n");
      if (head_end == std::string::npos) {
        if (got.size() > 65536) return t;
        continue;
      }
      const size_t sp = got.find(' ');
      t.http_status = sp != std::string::npos && sp < head_end ? std::atoi(got.c_str() + sp + 1) : -1;
      raw_pos = head_end + 4;
      {
        std::string lower = got.substr(0, head_end);
        for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        chunked = lower.find("transfer-encoding: chunked") != std::string::npos;
      }
      if (t.http_status != 200) {
        // The body: Content-Length bytes, or until the end of a chunked body or the close.
        std::string lower = got.substr(0, head_end);
        for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        const size_t cl = lower.find("content-length:");
        const size_t want = cl != std::string::npos ? std::strtoull(lower.c_str() + cl + 15, nullptr, 10) : 65536;
        while (got.size() - (head_end + 4) < std::min<size_t>(want, 65536) &&
               got.find("0\r\n\r\n", head_end) == std::string::npos) {
          const size_t m = socket.read_some(asio::buffer(buf), ec);
          if (ec) break;
          got.append(buf, m);
        }
        t.error = "HTTP " + std::to_string(t.http_status) + ": " + got.substr(head_end + 4, 300);
        return t;
      }
    }
    if (!chunked) {
      body_text.append(got, raw_pos, std::string::npos);
      raw_pos = got.size();
    }
    while (chunked && !body_done) {
      const size_t eol = got.find("\r\n", raw_pos);
      if (eol == std::string::npos) break;
      const size_t size = std::strtoull(got.c_str() + raw_pos, nullptr, 16);
      if (size == 0) {
        body_done = true;
        break;
      }
      if (got.size() < eol + 2 + size + 2) break;
      body_text.append(got, eol + 2, size);
      raw_pos = eol + 2 + size + 2;
    }
    size_t pos;
    while ((pos = body_text.find("data: ", scanned)) != std::string::npos) {
      const size_t end = body_text.find("\n\n", pos);
      if (end == std::string::npos) break;
      const std::string event = body_text.substr(pos + 6, end - pos - 6);
      scanned = end + 2;
      if (event == "[DONE]") continue;
      const auto j = nlohmann::json::parse(event, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        const auto& e = j["error"];
        t.error = e.is_object() && e.contains("message") && e["message"].is_string()
                      ? e["message"].get<std::string>()
                      : e.dump();
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        t.completion_tokens = j["usage"].value("completion_tokens", int64_t{0});
        t.prompt_tokens = j["usage"].value("prompt_tokens", int64_t{0});
        if (j["usage"].contains("prompt_tokens_details")) {
          t.cached_tokens = j["usage"]["prompt_tokens_details"].value("cached_tokens", int64_t{0});
        }
      }
      if (!j.contains("choices") || j["choices"].empty() || !j["choices"][0].contains("text")) continue;
      const std::string piece = j["choices"][0]["text"].get<std::string>();
      if (piece.empty()) continue;
      t.text += piece;
      const double since = std::chrono::duration<double>(now - (first ? start : last)).count();
      if (first) {
        t.ttft_s = since;
        first = false;
      } else {
        t.gaps_s.push_back(since);
      }
      last = now;
    }
    const bool done_seen = body_text.find("data: [DONE]") != std::string::npos;
    if (body_done || (!chunked && done_seen)) {
      t.latency_s = std::chrono::duration<double>(now - start).count();
      t.ok = t.error.empty() && done_seen;
      if (!done_seen && t.error.empty()) t.error = "the stream ended without data: [DONE]";
      return t;
    }
  }
}

std::vector<RequestTiming> stream_from_clients(uint16_t port, const std::vector<std::string>& bodies,
                                               int64_t clients) {
  std::vector<RequestTiming> timings(bodies.size());
  const size_t per_client = clients > 0 ? bodies.size() / static_cast<size_t>(clients) : 0;
  const asio::ip::tcp::endpoint server(asio::ip::make_address("127.0.0.1"), port);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < static_cast<size_t>(clients); ++k) {
    threads.emplace_back([&, k] {
      asio::io_context ioc;
      asio::ip::tcp::socket s(ioc);
      boost::system::error_code ec;
      s.connect(server, ec);
      for (size_t i = k * per_client; i < (k + 1) * per_client && !ec; ++i) {
        timings[i] = stream_completion(s, bodies[i]);
        if (!timings[i].ok) {  // a new connection for the next one
          s = asio::ip::tcp::socket(ioc);
          s.connect(server, ec);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return timings;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5)];
}

}  // namespace specontext::bench
