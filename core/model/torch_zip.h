// Reader of PyTorch's zip checkpoints (torch.save since 1.6; `pytorch_model.bin` of Hugging Face
// and EAGLE drafts): a zip archive of STORED entries
//   <archive>/data.pkl       the pickled object (a state dict here; see core/model/torch_pickle.h)
//   <archive>/data/<key>     one entry per storage, raw little-endian elements
//   <archive>/version        (and, in newer versions, byteorder, .format_version, ...)
// The central directory is read with bounds on every count, length and offset (ZIP64 records as
// torch writes them are understood); compressed or encrypted entries are refused, as are
// big-endian archives and tensors whose strides are not contiguous. Tensors come out in the
// same form as SafetensorsFile's, pointing into the archive's bytes (no copy).
//
// The legacy format (torch < 1.6, or _use_new_zipfile_serialization=False: a bare pickle stream
// followed by raw storages) is not read: open() says so. Nor are sharded checkpoints
// (pytorch_model.bin.index.json).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/mapped_file.h"
#include "core/base/status.h"
#include "core/model/safetensors.h"

namespace specontext {

class TorchZipFile {
 public:
  // Maps the file and reads it; the map stays alive as long as this object.
  [[nodiscard]] static Result<std::shared_ptr<TorchZipFile>> open(const std::string& path);
  // Reads a buffer holding a whole archive (tests, the fuzzer); the buffer must outlive the
  // object. verify_crc checks the CRC-32 of every entry used (data.pkl, byteorder and each
  // storage a tensor views); the fuzzer turns it off to reach the pickle.
  [[nodiscard]] static Result<std::shared_ptr<TorchZipFile>> parse(const uint8_t* data, size_t size,
                                                                   std::string source,
                                                                   bool verify_crc = true);

  const std::string& source() const { return source_; }
  // The tensors of the pickled dict, sorted by name. begin/end are byte offsets in the archive.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(const std::string& name) const;

 private:
  TorchZipFile() = default;
  std::shared_ptr<const MappedFile> map_;
  std::string source_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
};

// The first bytes of a zip archive (a local file header).
bool is_zip_magic(const uint8_t* data, size_t size);
// The first bytes of torch's legacy (pre-zip) format: a pickle of its magic number.
bool is_legacy_torch_magic(const uint8_t* data, size_t size);

// An archive of STORED entries laid out as torch.save lays them out (each payload 64-byte
// aligned, CRCs set). Tests and the fuzzer wrap hand-made pickles with it. With zip64, every
// size and offset goes through ZIP64 records (as for an archive past 4 GiB); without, none does.
std::string make_stored_zip(const std::vector<std::pair<std::string, std::string>>& entries,
                            bool zip64 = false);

}  // namespace specontext
