#include "bench/lib/sse_client.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

namespace specontext::bench {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

RequestTiming stream_completion(asio::ip::tcp::socket& socket, const std::string& body) {
  RequestTiming t;
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  const auto start = Clock::now();
  boost::system::error_code ec;
  asio::write(socket, asio::buffer(req), ec);
  if (ec) return t;
  std::string got;
  size_t scanned = 0;
  auto last = start;
  bool first = true;
  char buf[16384];
  for (;;) {
    const size_t n = socket.read_some(asio::buffer(buf), ec);
    if (ec) return t;
    const auto now = Clock::now();
    got.append(buf, n);
    size_t pos;
    while ((pos = got.find("data: ", scanned)) != std::string::npos) {
      const size_t end = got.find("\n\n", pos);
      if (end == std::string::npos) break;
      const std::string event = got.substr(pos + 6, end - pos - 6);
      scanned = end + 2;
      if (event == "[DONE]") continue;
      const auto j = nlohmann::json::parse(event, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("usage") && j["usage"].is_object()) {
        t.completion_tokens = j["usage"].value("completion_tokens", int64_t{0});
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
    if (got.size() >= 5 && got.compare(got.size() - 5, 5, "0\r\n\r\n") == 0 &&
        got.find("data: [DONE]") != std::string::npos) {
      t.latency_s = std::chrono::duration<double>(now - start).count();
      t.ok = true;
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
