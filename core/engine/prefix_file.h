// An offloaded prefix (PrefixSnapshot plus the tokens it holds) as one file: the disk level of the
// scheduler's prefix offload store (GeneratorOptions::prefix_disk_bytes).
//
// Layout (little-endian, no padding): magic "SPXPREF1", u32 version (2), u64 identity (the
// writer's Engine::kv_identity), i64 tokens, i64 page_size, i64 layers, u64 page_bytes, u8
// kv_dtype, u8 method, then length-prefixed (u64 count) arrays: token ids (i32), kv (bytes),
// head_keys (f32), boundary_fused (count of rows, each a length-prefixed f32 array, empty where
// none was kept), quest_min and quest_max (count of layers, each a length-prefixed f32 array);
// last, a u32 CRC-32 (zlib) of every byte before it.
//
// The parser checks the structure and the checksum only; the reader compares the identity with
// its engine's, and Engine::import_prefix checks that the snapshot fits the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/engine/engine.h"

namespace specontext {

struct PrefixFile {
  uint64_t identity = 0;
  std::vector<TokenId> tokens;  // snapshot.tokens of them
  PrefixSnapshot snapshot;      // header_only: the fields before token_ids, no arrays
};

// The file's bytes for `tokens` and `snapshot` (tokens.size() must equal snapshot.tokens).
std::vector<std::byte> encode_prefix_file(std::span<const TokenId> tokens, const PrefixSnapshot& snapshot,
                                          uint64_t identity);
// kDataLoss naming `name` and the field for a truncated, corrupt or inconsistent file.
// header_only: up to the token ids, without the checksum (which needs every byte): what a
// scheduler reopening its directory indexes the files by; the rest is checked when it is read.
Result<PrefixFile> parse_prefix_file(std::span<const std::byte> bytes, const std::string& name,
                                     bool header_only = false);

// Writes encoded bytes through a temporary name and a rename, so that a reader never sees half
// of a file; kUnavailable naming the path when it cannot.
Status write_prefix_file(const std::string& path, std::span<const std::byte> encoded);
Result<PrefixFile> read_prefix_file(const std::string& path, bool header_only = false);

// An exclusive advisory lock (flock) on a file, held while the object lives: a directory of
// prefix files that outlives its process belongs to one process at a time.
class FileLock {
 public:
  FileLock() = default;
  // Creates the file if need be; kUnavailable naming it when it cannot be opened or another
  // process (or another FileLock of this one) holds the lock.
  static Result<FileLock> acquire(const std::string& path);
  FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();
  bool held() const { return fd_ >= 0; }

 private:
  explicit FileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace specontext
