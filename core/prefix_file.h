// An offloaded prefix (PrefixSnapshot plus the tokens it holds) as one file: the disk level of the
// scheduler's prefix offload store (GeneratorOptions::prefix_disk_bytes).
//
// Layout (little-endian, no padding): magic "SPXPREF1", u32 version, i64 tokens, i64 page_size,
// i64 layers, u64 page_bytes, u8 kv_dtype, u8 method, then length-prefixed (u64 count) arrays:
// token ids (i32), kv (bytes), head_keys (f32), boundary_fused (count of rows, each a length-
// prefixed f32 array, empty where none was kept), quest_min and quest_max (count of layers, each a
// length-prefixed f32 array); last, a u32 CRC-32 (zlib) of every byte before it.
//
// The parser checks the structure and the checksum only; Engine::import_prefix checks that the
// snapshot fits the engine. A file carries no model identity: it is for the process that wrote
// it (the scheduler keeps its files in a directory of its own and removes them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/ids.h"
#include "core/status.h"

namespace specontext {

struct PrefixFile {
  std::vector<TokenId> tokens;  // snapshot.tokens of them
  PrefixSnapshot snapshot;
};

// The file's bytes for `tokens` and `snapshot` (tokens.size() must equal snapshot.tokens).
std::vector<std::byte> encode_prefix_file(std::span<const TokenId> tokens, const PrefixSnapshot& snapshot);
// kDataLoss naming `name` and the field for a truncated, corrupt or inconsistent file.
Result<PrefixFile> parse_prefix_file(std::span<const std::byte> bytes, const std::string& name);

// Writes encoded bytes through a temporary name and a rename, so that a reader never sees half
// of a file; kUnavailable naming the path when it cannot.
Status write_prefix_file(const std::string& path, std::span<const std::byte> encoded);
Result<PrefixFile> read_prefix_file(const std::string& path);

}  // namespace specontext
