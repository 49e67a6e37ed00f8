// libFuzzer target: parse_hf_config must return a Status for any text, never throw or crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/model/model_loader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = specontext::parse_hf_config(text, "fuzz/config.json");
  if (r.is_ok()) {
    // A config that parses must also be internally consistent.
    if (!r->validate("fuzz/config.json").is_ok()) __builtin_trap();
    (void)r->kv_bytes_per_token(2);
  }
  return 0;
}
