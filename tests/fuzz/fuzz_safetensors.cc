// libFuzzer target: the safetensors header parser must reject any malformed input cleanly.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = specontext::SafetensorsFile::parse(data, size, "fuzz.safetensors");
  if (r.is_ok()) {
    // Touch every tensor's bytes so out-of-range pointers show up under ASan.
    for (const auto& t : (*r)->tensors()) {
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < t.n_bytes(); i += 64) sink = sink ^ t.data[i];
      if (t.n_bytes() > 0) sink = sink ^ t.data[t.n_bytes() - 1];
      (void)t.numel();
      (void)(*r)->find(t.name);
    }
  }
  return 0;
}
