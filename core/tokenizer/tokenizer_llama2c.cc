// llama2.c tokenizer.bin: encode/decode exactly as run.c's encode() and decode().
//
// File format: int32 max_token_length, then per token: float32 score, int32 len, len bytes.
// The vocabulary size is not stored; the caller gives it (from the checkpoint header).
#include <cstring>
#include <exception>
#include <new>
#include <queue>

#include "core/base/mapped_file.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"

namespace specontext {
namespace {

using tokenizer_internal::parse_byte_piece;
using tokenizer_internal::PieceMap;

class Llama2cTokenizer final : public Tokenizer {
 public:
  Llama2cTokenizer(std::vector<std::string> pieces, std::vector<float> scores)
      : pieces_(std::move(pieces)), scores_(std::move(scores)) {
    // run.c binary-searches a sorted copy; with unique pieces a hash map finds the same ids.
    // On duplicates keep the first id (deterministic; run.c's choice would be arbitrary).
    for (size_t i = 0; i < pieces_.size(); ++i) {
      lookup_.emplace(pieces_[i], static_cast<TokenId>(i));
    }
    // run.c maps a byte b to id b+3 unconditionally; that is only right when the vocabulary
    // has the 256 "<0xHH>" pieces there. Without them (e.g. tok105.bin) unknown bytes become <unk>.
    has_byte_tokens_ = pieces_.size() >= 259;
    for (int b = 0; has_byte_tokens_ && b < 256; ++b) {
      has_byte_tokens_ = parse_byte_piece(pieces_[static_cast<size_t>(b) + 3]) == b;
    }
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const int b = parse_byte_piece(pieces_[i]);
      byte_value_.push_back(static_cast<int16_t>(b));
    }
  }

  std::string_view kind() const override { return "llama2c"; }
  int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }
  TokenId bos_id() const override { return pieces_.size() > 1 ? 1 : -1; }
  TokenId eos_id() const override { return pieces_.size() > 2 ? 2 : -1; }
  // run.c stops generating at BOS (it delimits sequences in TinyStories); EOS too.
  std::vector<TokenId> stop_ids() const override {
    std::vector<TokenId> ids;
    if (eos_id() >= 0) ids.push_back(eos_id());
    if (bos_id() >= 0) ids.push_back(bos_id());
    return ids;
  }
  bool add_bos_by_default() const override { return true; }

  Result<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                      bool parse_special) const override {
    try {
      return encode_impl(text, add_bos);
    } catch (const std::bad_alloc&) {
      return resource_exhausted("llama2c tokenizer: out of memory encoding " + std::to_string(text.size()) +
                                " bytes");
    } catch (const std::exception& e) {
      return internal_error(std::string("llama2c tokenizer: ") + e.what());
    }
  }

  std::string decode_token(TokenId prev, TokenId id) const override {
    if (id < 0 || static_cast<size_t>(id) >= pieces_.size()) return {};
    // BOS/EOS pieces are "\n<s>\n"/"\n</s>\n" in exported vocabularies; run.c never prints them.
    if (id == bos_id() || id == eos_id()) return {};
    std::string_view piece = pieces_[static_cast<size_t>(id)];
    // After BOS sentencepiece strips the leading space; start of text (prev < 0) counts as BOS.
    if ((prev == bos_id() || prev < 0) && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
    const int b = byte_value_[static_cast<size_t>(id)];
    if (b >= 0) return std::string(1, static_cast<char>(b));
    return std::string(piece);
  }

  TokenId piece_to_id(std::string_view piece) const override {
    auto it = lookup_.find(piece);
    return it == lookup_.end() ? -1 : it->second;
  }

 private:
  TokenId lookup(std::string_view s) const {
    auto it = lookup_.find(s);
    return it == lookup_.end() ? -1 : it->second;
  }

  void push_byte(std::vector<TokenId>& out, uint8_t b) const {
    if (has_byte_tokens_) {
      out.push_back(static_cast<TokenId>(b) + 3);
    } else if (!pieces_.empty()) {
      out.push_back(0);  // <unk>
    }
  }

  Result<std::vector<TokenId>> encode_impl(std::string_view text, bool add_bos) const {
    std::vector<TokenId> tokens;
    tokens.reserve(text.size() + 2);
    if (add_bos && bos_id() >= 0) tokens.push_back(bos_id());
    // add_dummy_prefix: the token for " ", only when the text is non-empty.
    if (!text.empty()) {
      const TokenId dummy = lookup(" ");
      // run.c would write -1 here; a vocabulary without " " simply gets no prefix.
      if (dummy >= 0) tokens.push_back(dummy);
    }
    // Code point by code point (at most 4 bytes), with byte fallback. Same buffer logic as run.c,
    // including its handling of stray continuation bytes.
    std::string buf;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<uint8_t>(text[i]);
      if ((c & 0xC0) != 0x80) buf.clear();
      buf.push_back(static_cast<char>(c));
      const uint8_t next = i + 1 < text.size() ? static_cast<uint8_t>(text[i + 1]) : 0;
      if ((next & 0xC0) == 0x80 && buf.size() < 4) continue;
      const TokenId id = lookup(buf);
      if (id >= 0) {
        tokens.push_back(id);
      } else {
        for (char b : buf) push_byte(tokens, static_cast<uint8_t>(b));
      }
      buf.clear();
    }
    merge(tokens);
    return tokens;
  }

  // run.c repeatedly rescans all adjacent pairs and merges the one whose concatenated piece has
  // the highest score (strictly above -1e10, left-most on ties). A priority queue over a linked
  // list picks the same pair each step in O(n log n) instead of O(n^2).
  void merge(std::vector<TokenId>& tokens) const {
    const size_t n = tokens.size();
    if (n < 2) return;
    struct Sym {
      TokenId id;
      int prev, next;
      bool alive;
    };
    struct Cand {
      float score;
      int left, right;
      TokenId left_id, right_id, merged;
    };
    struct Worse {
      bool operator()(const Cand& a, const Cand& b) const {
        if (a.score != b.score) return a.score < b.score;
        return a.left > b.left;
      }
    };
    std::vector<Sym> syms(n);
    for (size_t i = 0; i < n; ++i) {
      syms[i] = Sym{tokens[i], static_cast<int>(i) - 1, i + 1 < n ? static_cast<int>(i) + 1 : -1, true};
    }
    std::priority_queue<Cand, std::vector<Cand>, Worse> queue;
    std::string joined;
    const auto try_pair = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      joined = pieces_[static_cast<size_t>(syms[l].id)];
      joined += pieces_[static_cast<size_t>(syms[r].id)];
      const TokenId id = lookup(joined);
      if (id < 0) return;
      const float score = scores_[static_cast<size_t>(id)];
      if (!(score > -1e10f)) return;  // run.c's initial best_score; also rejects NaN
      queue.push(Cand{score, l, r, syms[l].id, syms[r].id, id});
    };
    for (size_t i = 0; i + 1 < n; ++i) try_pair(static_cast<int>(i), static_cast<int>(i) + 1);
    while (!queue.empty()) {
      const Cand c = queue.top();
      queue.pop();
      Sym& l = syms[static_cast<size_t>(c.left)];
      Sym& r = syms[static_cast<size_t>(c.right)];
      // Stale: one side merged away or changed since the candidate was queued.
      if (!l.alive || !r.alive || l.next != c.right || l.id != c.left_id || r.id != c.right_id) {
        continue;
      }
      l.id = c.merged;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.left;
      try_pair(l.prev, c.left);
      try_pair(c.left, l.next);
    }
    tokens.clear();
    for (int i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
      tokens.push_back(syms[static_cast<size_t>(i)].id);
    }
  }

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<int16_t> byte_value_;  // -1 unless the piece is "<0xHH>"
  PieceMap lookup_;
  bool has_byte_tokens_ = false;
};

}  // namespace

namespace tokenizer_internal {

Result<std::unique_ptr<Tokenizer>> parse_llama2c_tokenizer(const uint8_t* data, size_t size,
                                                           int32_t vocab_size, const std::string& source) {
  if (vocab_size <= 0) {
    return invalid_argument(source + ": vocab_size must be positive, got " + std::to_string(vocab_size));
  }
  try {
    ByteReader rd(data, size, source);
    int32_t max_len = 0;
    SPX_RETURN_IF_ERROR(rd.read(&max_len, "max_token_length"));
    if (max_len <= 0) {
      return data_loss(source + ": max_token_length is " + std::to_string(max_len));
    }
    std::vector<std::string> pieces;
    std::vector<float> scores;
    // Each entry takes at least 8 bytes: never reserve more than the file can hold.
    const size_t cap = std::min<size_t>(static_cast<size_t>(vocab_size), rd.remaining() / 8);
    pieces.reserve(cap);
    scores.reserve(cap);
    for (int32_t i = 0; i < vocab_size; ++i) {
      const std::string at = "token " + std::to_string(i);
      float score = 0;
      int32_t len = 0;
      SPX_RETURN_IF_ERROR(rd.read(&score, at + " score"));
      SPX_RETURN_IF_ERROR(rd.read(&len, at + " length"));
      if (len < 0) {
        return data_loss(source + ": " + at + " has negative length " + std::to_string(len));
      }
      if (len > max_len) {
        return data_loss(source + ": " + at + " length " + std::to_string(len) +
                         " exceeds max_token_length " + std::to_string(max_len));
      }
      if (static_cast<size_t>(len) > rd.remaining()) {  // before allocating: len is untrusted
        return data_loss(source + ": truncated: " + at + " has length " + std::to_string(len) + " but only " +
                         std::to_string(rd.remaining()) + " bytes remain");
      }
      std::string piece(static_cast<size_t>(len), '\0');
      SPX_RETURN_IF_ERROR(rd.read_bytes(piece.data(), piece.size(), at + " bytes"));
      pieces.push_back(std::move(piece));
      scores.push_back(score);
    }
    return std::unique_ptr<Tokenizer>(new Llama2cTokenizer(std::move(pieces), std::move(scores)));
  } catch (const std::bad_alloc&) {
    return resource_exhausted(source + ": out of memory reading the tokenizer");
  } catch (const std::exception& e) {
    return internal_error(source + ": " + e.what());
  }
}

}  // namespace tokenizer_internal

Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path, int32_t vocab_size) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::open(path));
  return tokenizer_internal::parse_llama2c_tokenizer(file->data(), file->size(), vocab_size, path);
}

}  // namespace specontext
