// The OpenAI server over TLS (ServerOptions::tls_cert_file/tls_key_file; serve --tls-cert,
// --tls-key), on loopback with a self-signed certificate made here with OpenSSL's API: /health and
// a streamed completion are answered over TLS 1.2+, a client that only speaks TLS 1.1 or plain
// HTTP is refused (counted) and the server goes on (a TLS client gone without close_notify is no
// bad request), and a missing, unreadable, mismatched or world-readable key or certificate is a
// startup error naming the flag.
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "serving/openai/openai_server.h"
#include "tests/serving/server_test_util.h"
#include "tests/tests_common.h"

namespace specontext::cluster {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

// A self-signed certificate for 127.0.0.1 (P-256, one day) and its key, as PEM files in a fresh
// directory; the key is mode 0600.
struct TlsFiles {
  std::filesystem::path dir, cert, key;
  TlsFiles() {
    dir = std::filesystem::temp_directory_path() / ("spx_tls_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    cert = dir / "cert.pem";
    key = dir / "key.pem";
    EVP_PKEY* pkey = EVP_EC_gen("P-256");
    X509* x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), -60);
    X509_gmtime_adj(X509_getm_notAfter(x), 24 * 3600);
    X509_set_pubkey(x, pkey);
    X509_NAME* name = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("127.0.0.1"),
                               -1, -1, 0);
    X509_set_issuer_name(x, name);
    X509_sign(x, pkey, EVP_sha256());
    FILE* c = std::fopen(cert.c_str(), "w");
    PEM_write_X509(c, x);
    std::fclose(c);
    FILE* k = std::fopen(key.c_str(), "w");
    ::chmod(key.c_str(), 0600);
    PEM_write_PrivateKey(k, pkey, nullptr, nullptr, 0, nullptr, nullptr);
    std::fclose(k);
    X509_free(x);
    EVP_PKEY_free(pkey);
  }
  ~TlsFiles() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

using Fixture = testing::ServedModel;
Fixture make_fixture() { return testing::serve_stories260k(2); }

ServerOptions tls_options(const Tokenizer& tok, const TlsFiles& files) {
  ServerOptions o;
  o.model_name = "stories";
  o.stop_ids = tok.stop_ids();
  o.tls_cert_file = files.cert.string();
  o.tls_key_file = files.key.string();
  return o;
}

// A TLS client that trusts only the test certificate; `max_version`: the newest it offers.
struct TlsClient {
  asio::io_context ioc;
  ssl::context ctx{ssl::context::tls_client};
  beast::ssl_stream<beast::tcp_stream> stream;
  TlsClient(uint16_t port, const TlsFiles& files, int max_version = 0)
      : stream(ioc, (configure(files, max_version), ctx)) {
    beast::get_lowest_layer(stream).connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    beast::get_lowest_layer(stream).expires_after(std::chrono::seconds(30));
  }
  void configure(const TlsFiles& files, int max_version) {
    ctx.load_verify_file(files.cert.string());
    ctx.set_verify_mode(ssl::verify_peer);
    if (max_version != 0) {  // offered for real: security level 0 lets OpenSSL send an old version
      SSL_CTX_set_security_level(ctx.native_handle(), 0);
      SSL_CTX_set_min_proto_version(ctx.native_handle(), max_version);
      SSL_CTX_set_max_proto_version(ctx.native_handle(), max_version);
    }
  }
  beast::error_code handshake() {
    beast::error_code ec;
    stream.handshake(ssl::stream_base::client, ec);
    return ec;
  }
  http::response<http::string_body> request(http::verb verb, const std::string& target,
                                            const std::string& body = "") {
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, "127.0.0.1");
    if (!body.empty()) req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    http::write(stream, req);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    http::read(stream, buf, res);
    return res;
  }
};

TEST(OpenAiTls, AnswersHealthAndAStreamedCompletionOverTls12OrLater) {
  TlsFiles files;
  Fixture f = make_fixture();
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, tls_options(*f.tokenizer, files));
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();

  TlsClient health(port, files);
  ASSERT_FALSE(health.handshake()) << "the client verified the server's certificate";
  EXPECT_GE(SSL_version(health.stream.native_handle()), TLS1_2_VERSION);
  const auto h = health.request(http::verb::get, "/health");
  EXPECT_EQ(h.result_int(), 200u);
  EXPECT_EQ(h.body(), "{\"status\":\"ok\"}");

  // On a kept connection: the streamed answer's chunks add up to the non-streamed answer's text.
  TlsClient client(port, files);
  ASSERT_FALSE(client.handshake());
  const json body = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}};
  const auto whole = client.request(http::verb::post, "/v1/completions", body.dump());
  ASSERT_EQ(whole.result_int(), 200u) << whole.body();
  const std::string expected = json::parse(whole.body())["choices"][0]["text"];
  json streamed_body = body;
  streamed_body["stream"] = true;
  const auto streamed = client.request(http::verb::post, "/v1/completions", streamed_body.dump());
  ASSERT_EQ(streamed.result_int(), 200u);
  EXPECT_EQ(streamed[http::field::content_type], "text/event-stream");
  std::string text;
  size_t events = 0;
  for (size_t at = 0; (at = streamed.body().find("data: ", at)) != std::string::npos; ++events) {
    const size_t end = streamed.body().find("\n\n", at);
    const std::string data = streamed.body().substr(at + 6, end - at - 6);
    at = end;
    if (data == "[DONE]") break;
    const json chunk = json::parse(data);
    text += chunk["choices"][0].value("text", "");
  }
  EXPECT_GE(events, 2u);  // text (tokens that came together share a chunk), then the finish
  EXPECT_NE(streamed.body().find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(text, expected);
  EXPECT_FALSE(expected.empty());
  (*server)->stop();
}

TEST(OpenAiTls, PlainHttpAndTls11ClientsAreRefusedAndTheServerGoesOn) {
  TlsFiles files;
  Fixture f = make_fixture();
  auto server = OpenAiServer::start(*f.engine, *f.tokenizer, tls_options(*f.tokenizer, files));
  ASSERT_TRUE(server.is_ok()) << server.status().to_string();
  const uint16_t port = (*server)->port();
  {
    // Plain HTTP to the TLS port: closed without an HTTP answer.
    asio::io_context ioc;
    beast::tcp_stream s(ioc);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    s.expires_after(std::chrono::seconds(30));
    http::request<http::string_body> req{http::verb::get, "/health", 11};
    req.set(http::field::host, "127.0.0.1");
    http::write(s, req);
    beast::flat_buffer buf;
    http::response<http::string_body> res;
    beast::error_code ec;
    http::read(s, buf, res, ec);
    EXPECT_TRUE(ec) << "answered " << res.result_int();
    EXPECT_NE(ec, beast::error::timeout);
  }
  {
    TlsClient old(port, files, TLS1_1_VERSION);
    EXPECT_TRUE(old.handshake()) << "a TLS 1.1 handshake succeeded";
  }
  {
    // A TLS client that goes away without close_notify: the end of its connection, not a bad request.
    TlsClient gone(port, files);
    ASSERT_FALSE(gone.handshake());
    beast::get_lowest_layer(gone.stream).close();
  }
  TlsClient client(port, files);
  ASSERT_FALSE(client.handshake());
  EXPECT_EQ(client.request(http::verb::get, "/health").result_int(), 200u);
  // Counted as the server closes them, which may be just after the clients saw the close.
  for (int i = 0; i < 500 && (*server)->counters().tls_handshake_failures < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ((*server)->counters().tls_handshake_failures, 2);
  EXPECT_EQ((*server)->counters().rejected, 0);
  TlsClient metrics(port, files);
  ASSERT_FALSE(metrics.handshake());
  EXPECT_NE(
      metrics.request(http::verb::get, "/metrics").body().find("specontext_tls_handshake_failures_total 2"),
      std::string::npos);
  (*server)->stop();
}

TEST(OpenAiTls, BadCertificateOrKeyIsAStartupErrorNamingTheFlag) {
  TlsFiles files;
  Fixture f = make_fixture();
  const std::string other = (files.dir / "other.pem").string();
  struct Case {
    std::string cert, key, in_error;
  };
  // A key that is not the certificate's: a second key pair.
  {
    EVP_PKEY* pkey = EVP_EC_gen("P-256");
    FILE* k = std::fopen(other.c_str(), "w");
    ::chmod(other.c_str(), 0600);
    PEM_write_PrivateKey(k, pkey, nullptr, nullptr, 0, nullptr, nullptr);
    std::fclose(k);
    EVP_PKEY_free(pkey);
  }
  // The certificate's own key, encrypted with a passphrase: refused, never asked for.
  const std::string encrypted = (files.dir / "encrypted_key.pem").string();
  {
    FILE* in = std::fopen(files.key.c_str(), "r");
    ASSERT_NE(in, nullptr);
    EVP_PKEY* pkey = PEM_read_PrivateKey(in, nullptr, nullptr, nullptr);
    std::fclose(in);
    ASSERT_NE(pkey, nullptr);
    FILE* k = std::fopen(encrypted.c_str(), "w");
    ::chmod(encrypted.c_str(), 0600);
    char pass[] = "a passphrase";
    ASSERT_EQ(PEM_write_PrivateKey(k, pkey, EVP_aes_256_cbc(), nullptr, 0, nullptr, pass), 1);
    std::fclose(k);
    EVP_PKEY_free(pkey);
  }
  const std::string readable = (files.dir / "readable_key.pem").string();
  std::filesystem::copy_file(files.key, readable);
  ::chmod(readable.c_str(), 0644);
  const std::vector<Case> cases = {
      {"/nonexistent/cert.pem", files.key.string(), "--tls-cert /nonexistent/cert.pem"},
      {files.cert.string(), "/nonexistent/key.pem", "--tls-key /nonexistent/key.pem"},
      {files.key.string(), files.key.string(), "--tls-cert"},   // not a certificate
      {files.cert.string(), files.cert.string(), "--tls-key"},  // a certificate, not a key
      {files.cert.string(), other, "--tls-key " + other + ": not the private key of the certificate"},
      {files.cert.string(), readable, "readable by every user"},
      {files.cert.string(), encrypted, "--tls-key " + encrypted + ": not a PEM private key"},
      {files.cert.string(), "", "--tls-key"},
      {"", files.key.string(), "--tls-cert"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.cert + " " + c.key);
    ServerOptions o = tls_options(*f.tokenizer, files);
    o.tls_cert_file = c.cert;
    o.tls_key_file = c.key;
    auto server = OpenAiServer::start(*f.engine, *f.tokenizer, o);
    ASSERT_FALSE(server.is_ok());
    EXPECT_NE(server.status().message().find(c.in_error), std::string::npos) << server.status().to_string();
  }
}

// serve's flags reach the server: a bad path is a clear error (exit 1) naming the flag.
TEST(OpenAiTls, ServeFlagsNameTheBadFile) {
  TlsFiles files;
  const std::string model = testing::repo_path("models/stories260K/stories260K.bin");
  const std::string err = (files.dir / "stderr.txt").string();
  for (const auto& [flags, in_error] : std::vector<std::pair<std::string, std::string>>{
           {"--tls-cert /nonexistent/cert.pem --tls-key " + files.key.string(),
            "--tls-cert /nonexistent/cert.pem"},
           {"--tls-cert " + files.cert.string() + " --tls-key /nonexistent/key.pem",
            "--tls-key /nonexistent/key.pem"},
           {"--tls-cert " + files.cert.string(), "--tls-key"}}) {
    SCOPED_TRACE(flags);
    const std::string cmd = std::string(SPECONTEXT_BIN) + " serve -m " + model + " --listen 127.0.0.1:0 " +
                            flags + " >/dev/null 2>" + err;
    const int status = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    std::string text;
    if (FILE* e = std::fopen(err.c_str(), "r")) {
      std::array<char, 4096> buf{};
      size_t n;
      while ((n = std::fread(buf.data(), 1, buf.size(), e)) > 0) text.append(buf.data(), n);
      std::fclose(e);
    }
    EXPECT_NE(text.find(in_error), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace specontext::cluster
