// A blocking client for the benchmarks of the OpenAI-compatible server: one streaming completion
// over a keep-alive connection, its events timed as their bytes arrive.
#pragma once

#include <utility>  // before Asio: its awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace specontext::bench {

struct RequestTiming {
  double ttft_s = 0;              // request sent → first text event
  std::vector<double> gaps_s;     // between text events
  double latency_s = 0;           // request sent → [DONE]
  int64_t completion_tokens = 0;  // from the usage chunk
  int64_t cached_tokens = 0;      // usage.prompt_tokens_details.cached_tokens (0 when absent)
  int64_t prompt_tokens = 0;      // usage.prompt_tokens (0 when absent)
  int http_status = 0;            // the answer's status (0: none came)
  std::string error;              // why not ok: a non-200 answer's body (its start), an error event
  std::string text;               // the streamed text, concatenated
  bool ok = false;
};

// POSTs `body` (a streaming /v1/completions request with stream_options.include_usage) on
// `socket` and reads until [DONE] and the last chunk. `extra_headers`: more header lines, each
// ending in \r\n (an Authorization). A non-200 answer returns once its body is read (at most
// 64 KiB; the body's start in `error`).
RequestTiming stream_completion(boost::asio::ip::tcp::socket& socket, const std::string& body,
                                const std::string& extra_headers = "");

// `clients` threads; client k sends bodies[k·n, (k+1)·n) (n = bodies.size() / clients) back to back
// over one keep-alive connection to 127.0.0.1:`port`, opening a new one after a failed request.
// The timings in the bodies' order (a request never sent is not ok).
std::vector<RequestTiming> stream_from_clients(uint16_t port, const std::vector<std::string>& bodies,
                                               int64_t clients);

// Nearest-rank percentile, p in [0, 1]; 0 for an empty sample.
double percentile(std::vector<double> v, double p);

}  // namespace specontext::bench
