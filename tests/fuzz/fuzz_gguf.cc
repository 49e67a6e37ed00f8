// libFuzzer target: GgufFile::parse and its typed getters must never crash on any input, and
// decoding any block-quantised tensor it accepts must stay within the tensor's bytes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/model/ggml_quants.h"
#include "core/model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = specontext::GgufFile::parse(data, size, "fuzz.gguf");
  if (!r.is_ok()) return 0;
  const specontext::GgufFile& g = **r;
  for (const auto& [key, value] : g.metadata()) {
    (void)g.get_string(key);
    (void)g.get_int(key);
    (void)g.get_float(key);
    (void)g.get_string_array(key);
    (void)g.get_float_array(key);
    (void)g.get_int_array(key);
  }
  // Touch the first and last byte of every tensor so a bad bounds check shows up under ASan.
  volatile uint8_t sink = 0;
  for (const auto& t : g.tensors()) {
    if (t.n_bytes > 0) sink = sink ^ t.data[0] ^ t.data[t.n_bytes - 1];
    (void)t.n_elements();
    (void)g.find_tensor(t.name);
    if (specontext::ggml_is_dequantizable(t.ggml_type) && t.n_elements() <= (int64_t{1} << 16)) {
      std::vector<float> out(static_cast<size_t>(t.n_elements()));
      (void)specontext::ggml_dequantize(t.ggml_type, t.data, out.data(), t.n_elements());
    }
  }
  return 0;
}
