// Test certificates for the KV node's TLS, made with OpenSSL's API in a fresh directory: a CA
// (self-signed, P-256) and node certificates it signs for chosen subject alternative names; keys
// are written mode 0600. RAII for every OpenSSL handle; the directory goes with the object.
#pragma once

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

namespace specontext::cluster::testing {

using PKey = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using Cert = std::unique_ptr<X509, decltype(&X509_free)>;

class TlsDir {
 public:
  TlsDir() {
    static std::atomic<int> counter{0};
    dir_ = std::filesystem::temp_directory_path() /
           ("spx_kv_tls_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(dir_);
  }
  ~TlsDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TlsDir(const TlsDir&) = delete;
  TlsDir& operator=(const TlsDir&) = delete;
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A CA: its certificate at NAME.pem, its key kept for signing.
  struct Ca {
    std::string cert_file;
    PKey key{nullptr, &EVP_PKEY_free};
    Cert cert{nullptr, &X509_free};
  };
  Ca make_ca(const std::string& name) {
    Ca ca;
    ca.key.reset(EVP_EC_gen("P-256"));
    ca.cert = new_cert(ca.key.get(), name, 1);
    X509_set_issuer_name(ca.cert.get(), X509_get_subject_name(ca.cert.get()));
    add_ext(ca.cert.get(), ca.cert.get(), NID_basic_constraints, "critical,CA:TRUE");
    add_ext(ca.cert.get(), ca.cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
    EXPECT_GT(X509_sign(ca.cert.get(), ca.key.get(), EVP_sha256()), 0);
    ca.cert_file = path(name + ".pem");
    write_cert(ca.cert.get(), ca.cert_file);
    return ca;
  }

  // A node certificate signed by `ca` for `san` (e.g. "IP:127.0.0.1,DNS:localhost"), and its key.
  struct Leaf {
    std::string cert_file, key_file;
  };
  Leaf make_leaf(const Ca& ca, const std::string& name, const std::string& san) {
    PKey key(EVP_EC_gen("P-256"), &EVP_PKEY_free);
    Cert cert = new_cert(key.get(), name, ++serial_);
    X509_set_issuer_name(cert.get(), X509_get_subject_name(ca.cert.get()));
    add_ext(ca.cert.get(), cert.get(), NID_basic_constraints, "critical,CA:FALSE");
    add_ext(ca.cert.get(), cert.get(), NID_ext_key_usage, "serverAuth");
    add_ext(ca.cert.get(), cert.get(), NID_subject_alt_name, san);
    EXPECT_GT(X509_sign(cert.get(), ca.key.get(), EVP_sha256()), 0);
    Leaf leaf{path(name + ".pem"), path(name + ".key")};
    write_cert(cert.get(), leaf.cert_file);
    FILE* k = std::fopen(leaf.key_file.c_str(), "w");
    EXPECT_NE(k, nullptr);
    ::chmod(leaf.key_file.c_str(), 0600);
    PEM_write_PrivateKey(k, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
    std::fclose(k);
    return leaf;
  }

 private:
  static Cert new_cert(EVP_PKEY* key, const std::string& cn, long serial) {
    Cert cert(X509_new(), &X509_free);
    X509_set_version(cert.get(), 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), serial);
    X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
    X509_gmtime_adj(X509_getm_notAfter(cert.get()), 24 * 3600);
    X509_set_pubkey(cert.get(), key);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(cert.get()), "CN", MBSTRING_ASC,
                               reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
    return cert;
  }
  static void add_ext(X509* issuer, X509* cert, int nid, const std::string& value) {
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
    std::unique_ptr<X509_EXTENSION, decltype(&X509_EXTENSION_free)> ext(
        X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()), &X509_EXTENSION_free);
    ASSERT_NE(ext, nullptr) << value;
    X509_add_ext(cert, ext.get(), -1);
  }
  static void write_cert(X509* cert, const std::string& file) {
    FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr) << file;
    PEM_write_X509(f, cert);
    std::fclose(f);
  }

  std::filesystem::path dir_;
  long serial_ = 100;
};

}  // namespace specontext::cluster::testing
