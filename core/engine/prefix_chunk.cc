#include "core/engine/prefix_chunk.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/base/mapped_file.h"
#include "core/engine/prefix_codec.h"

namespace specontext {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'X', 'C', 'H', 'N', 'K', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kMaxHeadRow = size_t{1} << 16;  // floats of one token's retrieval head keys

using prefix_codec::Writer;

Status chunk_error(size_t k, const std::string& why) {
  return data_loss("prefix chunk " + std::to_string(k) + ": " + why);
}

}  // namespace

std::vector<std::byte> encode_prefix_chunk(const PrefixChunk& c) {
  const PrefixSnapshot& s = c.piece;
  Writer w;
  prefix_codec::put_header(w, kMagic, kVersion);
  w.put(c.identity);
  w.put(c.chunk_tokens);
  w.put(c.start);
  w.put(c.end());
  prefix_codec::put_snapshot_layout(w, s);
  w.put_array(std::span<const TokenId>(c.tokens));
  prefix_codec::put_snapshot_arrays(w, s);
  return w.finish();
}

Result<PrefixChunk> parse_prefix_chunk(std::span<const std::byte> bytes, const std::string& name) {
  prefix_codec::Parser in(bytes, "prefix chunk", name);
  SPX_RETURN_IF_ERROR(prefix_codec::get_header(in, bytes, kMagic, kVersion, "chunk", /*check_crc=*/true));
  PrefixChunk c;
  PrefixSnapshot& s = c.piece;
  int64_t end = 0;
  SPX_RETURN_IF_ERROR(in.get(&c.identity, "identity"));
  SPX_RETURN_IF_ERROR(in.get(&c.chunk_tokens, "chunk_tokens"));
  SPX_RETURN_IF_ERROR(in.get(&c.start, "start"));
  SPX_RETURN_IF_ERROR(in.get(&end, "end"));
  SPX_RETURN_IF_ERROR(prefix_codec::get_snapshot_layout(in, s));
  if (c.chunk_tokens <= 0 || s.page_size <= 0 || s.layers <= 0 || s.page_bytes == 0) {
    return in.bad("chunk_tokens", "and page_size, layers, page_bytes must be positive");
  }
  // Each bounded by the bytes: no product below overflows.
  if (c.start < 0 || end <= c.start || end - c.start > c.chunk_tokens || c.start % c.chunk_tokens != 0 ||
      c.start % s.page_size != 0 || (end - c.start) % s.page_size != 0) {
    return in.bad("start", "and end (" + std::to_string(c.start) + ", " + std::to_string(end) +
                               ") are not whole pages of one chunk of " + std::to_string(c.chunk_tokens));
  }
  s.tokens = end - c.start;
  SPX_RETURN_IF_ERROR(in.get_array(&c.tokens, "token_ids"));
  if (c.end() != end) {
    return in.bad("token_ids", "holds " + std::to_string(c.tokens.size()) + " ids, not the " +
                                   std::to_string(end) + " tokens up to the chunk's end");
  }
  SPX_RETURN_IF_ERROR(prefix_codec::get_snapshot_kv(in, s));
  const uint64_t pages = static_cast<uint64_t>(s.tokens / s.page_size);
  SPX_RETURN_IF_ERROR(in.get_array(&s.head_keys, "head_keys"));
  if (s.head_keys.size() % static_cast<uint64_t>(s.tokens) != 0) {
    return in.bad("head_keys", "holds " + std::to_string(s.head_keys.size()) + " floats, not whole rows of " +
                                   std::to_string(s.tokens) + " tokens");
  }
  SPX_RETURN_IF_ERROR(in.get_rows(&s.boundary_fused, "boundary_fused"));
  if (!s.boundary_fused.empty() && s.boundary_fused.size() != pages) {
    return in.bad("boundary_fused", "holds " + std::to_string(s.boundary_fused.size()) + " rows for " +
                                        std::to_string(pages) + " pages");
  }
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_min, "quest_min"));
  SPX_RETURN_IF_ERROR(in.get_rows(&s.quest_max, "quest_max"));
  if ((!s.quest_min.empty() && s.quest_min.size() != static_cast<size_t>(s.layers)) ||
      s.quest_max.size() != s.quest_min.size()) {
    return in.bad("quest_min", "and quest_max hold " + std::to_string(s.quest_min.size()) + " and " +
                                   std::to_string(s.quest_max.size()) + " rows for " +
                                   std::to_string(s.layers) + " layers");
  }
  for (size_t l = 0; l < s.quest_min.size(); ++l) {
    if (s.quest_min[l].size() != s.quest_max[l].size()) {
      return in.bad("quest_max", "row " + std::to_string(l) + " is not as long as quest_min's");
    }
  }
  SPX_RETURN_IF_ERROR(prefix_codec::get_end(in));
  return c;
}

Result<PrefixChunk> cut_prefix_chunk(std::span<const TokenId> tokens, const PrefixSnapshot& whole,
                                     uint64_t identity, int64_t chunk_tokens, int64_t start, int64_t end,
                                     int64_t head_block_tokens) {
  const int64_t n = whole.tokens;
  const auto bad = [&](const std::string& why) {
    return invalid_argument("cut_prefix_chunk [" + std::to_string(start) + ", " + std::to_string(end) +
                            ") of " + std::to_string(n) + " tokens: " + why);
  };
  if (static_cast<int64_t>(tokens.size()) != n)
    return bad("the snapshot's token ids are not as many as its tokens");
  if (whole.page_size <= 0 || whole.layers <= 0 || whole.page_bytes == 0) return bad("no layout");
  if (chunk_tokens <= 0 || start < 0 || end <= start || end > n || end - start > chunk_tokens ||
      start % chunk_tokens != 0 || start % whole.page_size != 0 || end % whole.page_size != 0 ||
      n % whole.page_size != 0) {
    return bad("not whole pages of one chunk of " + std::to_string(chunk_tokens));
  }
  const auto pages = static_cast<size_t>(n / whole.page_size);
  const auto first = static_cast<size_t>(start / whole.page_size),
             last = static_cast<size_t>(end / whole.page_size);
  const size_t pb = whole.page_bytes;
  if (whole.kv.size() != static_cast<size_t>(whole.layers) * pages * pb)
    return bad("kv is not layers × pages");
  PrefixChunk c;
  c.identity = identity;
  c.chunk_tokens = chunk_tokens;
  c.start = start;
  c.tokens.assign(tokens.begin(), tokens.begin() + end);
  PrefixSnapshot& s = c.piece;
  s.tokens = end - start;
  s.page_size = whole.page_size;
  s.layers = whole.layers;
  s.page_bytes = whole.page_bytes;
  s.kv_dtype = whole.kv_dtype;
  s.method = whole.method;
  s.kv.reserve(static_cast<size_t>(whole.layers) * (last - first) * pb);
  for (size_t l = 0; l < static_cast<size_t>(whole.layers); ++l) {
    const std::byte* layer = whole.kv.data() + l * pages * pb;
    s.kv.insert(s.kv.end(), layer + first * pb, layer + last * pb);
  }
  if (!whole.head_keys.empty()) {
    // [blocks][T][row]: token-major rows, the last block padded.
    if (head_block_tokens <= 0) return bad("head keys without a head block size");
    const auto rows =
        static_cast<size_t>((n + head_block_tokens - 1) / head_block_tokens * head_block_tokens);
    if (whole.head_keys.size() % rows != 0) return bad("head_keys are not whole blocks");
    const size_t row = whole.head_keys.size() / rows;
    s.head_keys.assign(
        whole.head_keys.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(start) * row),
        whole.head_keys.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(end) * row));
  }
  if (!whole.boundary_fused.empty()) {
    if (whole.boundary_fused.size() != pages) return bad("boundary_fused is not a row per page");
    s.boundary_fused.assign(whole.boundary_fused.begin() + static_cast<std::ptrdiff_t>(first),
                            whole.boundary_fused.begin() + static_cast<std::ptrdiff_t>(last));
  }
  if (whole.quest_min.size() != whole.quest_max.size()) return bad("quest_min and quest_max differ");
  for (size_t l = 0; l < whole.quest_min.size(); ++l) {
    // Quest pages divide the fork unit: a row's elements are proportional to the tokens.
    const size_t size = whole.quest_min[l].size();
    if (whole.quest_max[l].size() != size ||
        size * static_cast<size_t>(start) % static_cast<size_t>(n) != 0 ||
        size * static_cast<size_t>(end) % static_cast<size_t>(n) != 0) {
      return bad("Quest bounds cannot be cut there");
    }
    const auto from = static_cast<std::ptrdiff_t>(size * static_cast<size_t>(start) / static_cast<size_t>(n));
    const auto to = static_cast<std::ptrdiff_t>(size * static_cast<size_t>(end) / static_cast<size_t>(n));
    s.quest_min.emplace_back(whole.quest_min[l].begin() + from, whole.quest_min[l].begin() + to);
    s.quest_max.emplace_back(whole.quest_max[l].begin() + from, whole.quest_max[l].begin() + to);
  }
  return c;
}

namespace {

// join_prefix_chunks (from token 0, head keys padded to whole blocks of head_block_tokens) and
// join_prefix_chunk_tail (from the first chunk's start, head key rows of its tokens only: tail).
Result<PrefixSnapshot> join_chunks(std::span<const PrefixChunk> chunks, int64_t head_block_tokens, bool tail) {
  if (chunks.empty()) return data_loss("prefix chunks: none to join");
  const PrefixChunk& first = chunks.front();
  const PrefixSnapshot& f = first.piece;
  PrefixSnapshot out;
  out.page_size = f.page_size;
  out.layers = f.layers;
  out.page_bytes = f.page_bytes;
  out.kv_dtype = f.kv_dtype;
  out.method = f.method;
  const size_t head_row = f.tokens > 0 ? f.head_keys.size() / static_cast<size_t>(f.tokens) : 0;
  const bool fused = !f.boundary_fused.empty();
  const size_t quest = f.quest_min.size();
  const int64_t from = tail ? first.start : 0;
  int64_t at = from;
  for (size_t k = 0; k < chunks.size(); ++k) {
    const PrefixChunk& c = chunks[k];
    const PrefixSnapshot& s = c.piece;
    if (c.identity != first.identity || c.chunk_tokens != first.chunk_tokens) {
      return chunk_error(k, "is of another engine or chunk size than chunk 0");
    }
    if (c.start != at || s.tokens <= 0 || c.end() != at + s.tokens) {
      return chunk_error(k, "starts at " + std::to_string(c.start) + ", not where the one before ends (" +
                                std::to_string(at) + ")");
    }
    if (s.page_size != f.page_size || s.layers != f.layers || s.page_bytes != f.page_bytes ||
        s.kv_dtype != f.kv_dtype || s.method != f.method) {
      return chunk_error(k, "has another KV layout than chunk 0");
    }
    if (k > 0 && !std::equal(chunks[k - 1].tokens.begin(), chunks[k - 1].tokens.end(), c.tokens.begin())) {
      return chunk_error(k, "holds other tokens before its start than the chunks before it");
    }
    const auto pages = static_cast<size_t>(s.tokens / s.page_size);
    if (s.kv.size() != static_cast<size_t>(s.layers) * pages * s.page_bytes ||
        s.head_keys.size() != head_row * static_cast<size_t>(s.tokens) ||
        (fused ? s.boundary_fused.size() != pages : !s.boundary_fused.empty()) ||
        s.quest_min.size() != quest || s.quest_max.size() != quest) {
      return chunk_error(k, "holds other arrays than its tokens and chunk 0's layout need");
    }
    at = c.end();
  }
  out.tokens = at - from;
  const auto pages = static_cast<size_t>(out.tokens / f.page_size);
  const size_t pb = f.page_bytes;
  out.kv.reserve(static_cast<size_t>(f.layers) * pages * pb);
  for (size_t l = 0; l < static_cast<size_t>(f.layers); ++l) {
    for (const PrefixChunk& c : chunks) {
      const size_t cp = static_cast<size_t>(c.piece.tokens / f.page_size) * pb;
      const std::byte* layer = c.piece.kv.data() + l * cp;
      out.kv.insert(out.kv.end(), layer, layer + cp);
    }
  }
  if (head_row > 0) {
    if (!tail && head_block_tokens <= 0) return data_loss("prefix chunks: head keys without a head block size");
    // The padding below is allocated from what the chunks claim: bounded (a retrieval head's key
    // row is n_kv_heads × head_dim floats, far under this).
    if (head_row > kMaxHeadRow) {
      return data_loss("prefix chunks: head key rows of " + std::to_string(head_row) + " floats, more than " +
                       std::to_string(kMaxHeadRow));
    }
    for (const PrefixChunk& c : chunks)
      out.head_keys.insert(out.head_keys.end(), c.piece.head_keys.begin(), c.piece.head_keys.end());
    // The last block's rows past the prefix: never read (the sequence's length bounds them).
    if (!tail) {
      const auto rows =
          static_cast<size_t>((at + head_block_tokens - 1) / head_block_tokens * head_block_tokens);
      out.head_keys.resize(rows * head_row, 0.0f);
    }
  }
  for (const PrefixChunk& c : chunks) {
    out.boundary_fused.insert(out.boundary_fused.end(), c.piece.boundary_fused.begin(),
                              c.piece.boundary_fused.end());
  }
  out.quest_min.resize(quest);
  out.quest_max.resize(quest);
  for (size_t l = 0; l < quest; ++l) {
    for (const PrefixChunk& c : chunks) {
      out.quest_min[l].insert(out.quest_min[l].end(), c.piece.quest_min[l].begin(),
                              c.piece.quest_min[l].end());
      out.quest_max[l].insert(out.quest_max[l].end(), c.piece.quest_max[l].begin(),
                              c.piece.quest_max[l].end());
    }
  }
  return out;
}

}  // namespace

Result<PrefixSnapshot> join_prefix_chunks(std::span<const PrefixChunk> chunks, int64_t head_block_tokens) {
  return join_chunks(chunks, head_block_tokens, /*tail=*/false);
}

Result<PrefixSnapshot> join_prefix_chunk_tail(std::span<const PrefixChunk> chunks) {
  return join_chunks(chunks, 0, /*tail=*/true);
}

}  // namespace specontext
