// One blocking HTTP/1.1 request to 127.0.0.1:port (Boost.Beast), for the tests that drive a
// `specontext serve` or `router` child process: the status and the body of the answer.
#pragma once

#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cstdint>
#include <string>
#include <utility>

namespace specontext::testing {

inline std::pair<int, std::string> http_call(uint16_t port, boost::beast::http::verb verb, const std::string& target,
                                             const std::string& body) {
  namespace http = boost::beast::http;
  boost::asio::io_context ioc;
  boost::asio::ip::tcp::socket s(ioc);
  s.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "127.0.0.1");
  if (verb == http::verb::post) {
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
  }
  http::write(s, req);
  boost::beast::flat_buffer buf;
  http::response<http::string_body> res;
  http::read(s, buf, res);
  return {static_cast<int>(res.result_int()), res.body()};
}

}  // namespace specontext::testing
