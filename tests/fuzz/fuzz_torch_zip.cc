// libFuzzer target: PyTorch zip checkpoints (core/model/torch_zip.h) and the pickle subset inside them
// (core/model/torch_pickle.h) must reject any malformed input cleanly.
// The first byte picks what the rest is: even, a whole archive (CRCs unchecked, so mutations reach
// the pickle and the views); odd, a data.pkl wrapped into an archive with storages data/0..data/3
// of 4 KiB each.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/model/torch_zip.h"

namespace {

constexpr size_t kStorages = 4;
constexpr size_t kStorageBytes = 4096;

void parse_and_touch(const std::string& bytes) {
  // 8-byte aligned, as a memory map is: element alignment is checked, not assumed.
  std::vector<uint64_t> words(bytes.size() / 8 + 1);
  if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  const auto* data = reinterpret_cast<const uint8_t*>(words.data());
  auto r = specontext::TorchZipFile::parse(data, bytes.size(), "fuzz.bin", /*verify_crc=*/false);
  if (!r.is_ok()) return;
  // Touch every tensor's bytes so out-of-range views show up under ASan.
  for (const auto& t : (*r)->tensors()) {
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < t.n_bytes(); i += 64) sink = sink ^ t.data[i];
    if (t.n_bytes() > 0) sink = sink ^ t.data[t.n_bytes() - 1];
    (void)t.numel();
    (void)(*r)->find(t.name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 1) == 0) {
    parse_and_touch(rest);
    return 0;
  }
  std::vector<std::pair<std::string, std::string>> entries = {{"archive/data.pkl", rest}};
  for (size_t k = 0; k < kStorages; ++k) {
    entries.push_back(
        {"archive/data/" + std::to_string(k), std::string(kStorageBytes, static_cast<char>(k))});
  }
  parse_and_touch(specontext::make_stored_zip(entries));
  return 0;
}
