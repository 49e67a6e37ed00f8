// SentencePiece BPE over a GGUF "llama" vocabulary, following llama.cpp's llm_tokenizer_spm:
// ' ' -> U+2581, a leading U+2581 (add_space_prefix), split into UTF-8 characters, merge the
// adjacent pair whose concatenation is the highest-scoring piece (left-most on ties), byte
// fallback (<0xHH>) for what is left unknown.
//
// Deviations from llama.cpp, all towards SentencePiece / HF (which produced the test vectors):
//  - merges never produce control, unknown or byte pieces ("<s>" typed as text stays text);
//  - an unused piece produced by a merge is re-segmented into the pieces that formed it;
//  - a vocabulary without byte pieces (e.g. babyllama105) emits <unk> per unknown character
//    instead of failing.
// Invalid UTF-8: each invalid byte is a symbol of its own and falls back to its byte piece, so
// decode(encode(x)) == x for any bytes x without U+2581 (which decodes as a space).
#include <algorithm>
#include <exception>
#include <new>
#include <queue>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"

namespace specontext {
namespace {

using namespace tokenizer_internal;  // NOLINT: private helpers of this module

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";   // U+2581 '▁'
constexpr std::string_view kUnknownGlyph = "\xE2\x96\x85";  // U+2585, llama.cpp's rendering of <unk>

class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(SpmVocab v) : v_(std::move(v)) {
    const size_t n = v_.tokens.size();
    for (size_t i = 0; i < n; ++i) {
      const std::string& piece = v_.tokens[i];
      const auto id = static_cast<TokenId>(i);
      const int32_t type = v_.types[i];
      all_pieces_[piece] = id;  // last wins, as llama.cpp's token_to_id
      if (type == kTokNormal || type == kTokUserDefined || type == kTokUnused) {
        merge_pieces_[piece] = id;
      }
      if (type == kTokControl || type == kTokUnknown) splitter_.add(piece, id, /*special=*/true);
      if (type == kTokUserDefined) splitter_.add(piece, id, /*special=*/false);
      if (type == kTokByte) {
        const int b = parse_byte_piece(piece);
        if (b >= 0 && byte_ids_[static_cast<size_t>(b)] < 0) byte_ids_[static_cast<size_t>(b)] = id;
      }
    }
    // llama.cpp's fallback when "<0xHH>" is missing: the byte itself as a piece.
    for (int b = 0; b < 256; ++b) {
      if (byte_ids_[static_cast<size_t>(b)] >= 0) continue;
      auto it = merge_pieces_.find(std::string_view(std::string(1, static_cast<char>(b))));
      if (it != merge_pieces_.end()) byte_ids_[static_cast<size_t>(b)] = it->second;
    }
    stop_ids_ = collect_stop_ids(v_.eos, all_pieces_);
  }

  std::string_view kind() const override { return "spm"; }
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.tokens.size()); }
  TokenId bos_id() const override { return v_.bos; }
  TokenId eos_id() const override { return v_.eos; }
  std::vector<TokenId> stop_ids() const override { return stop_ids_; }
  bool add_bos_by_default() const override { return v_.add_bos && v_.bos >= 0; }

  Result<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                      bool parse_special) const override {
    try {
      return encode_impl(text, add_bos, parse_special);
    } catch (const std::bad_alloc&) {
      return resource_exhausted(v_.source + ": out of memory encoding " + std::to_string(text.size()) +
                                " bytes");
    } catch (const std::exception& e) {
      return internal_error(v_.source + ": " + e.what());
    }
  }

  std::string decode_token(TokenId prev, TokenId id) const override {
    if (id < 0 || static_cast<size_t>(id) >= v_.tokens.size()) return {};
    const std::string& piece = v_.tokens[static_cast<size_t>(id)];
    std::string out;
    switch (v_.types[static_cast<size_t>(id)]) {
      case kTokNormal: {
        // Unescape U+2581 to ' '.
        for (size_t pos = 0; pos < piece.size();) {
          if (piece.compare(pos, kSpaceMarker.size(), kSpaceMarker) == 0) {
            out += ' ';
            pos += kSpaceMarker.size();
          } else {
            out += piece[pos++];
          }
        }
        break;
      }
      case kTokUserDefined:
        out = piece;
        break;
      case kTokByte: {
        const int b = parse_byte_piece(piece);
        if (b >= 0) out = std::string(1, static_cast<char>(b));
        break;
      }
      case kTokUnknown:
        out = std::string(kUnknownGlyph);
        break;
      default:
        return {};  // control, unused
    }
    // The space added by add_space_prefix at the start of the text is removed again.
    if (v_.add_space_prefix && (prev < 0 || prev == v_.bos) && !out.empty() && out[0] == ' ') {
      out.erase(0, 1);
    }
    return out;
  }

  TokenId piece_to_id(std::string_view piece) const override {
    auto it = all_pieces_.find(piece);
    return it == all_pieces_.end() ? -1 : it->second;
  }

 private:
  Result<std::vector<TokenId>> encode_impl(std::string_view text, bool add_bos, bool parse_special) const {
    std::vector<TokenId> out;
    if (add_bos && v_.bos >= 0) out.push_back(v_.bos);
    bool prev_special = true;  // the first fragment gets the space prefix
    std::string escaped;
    for (const auto& frag : splitter_.split(text, parse_special)) {
      if (frag.token >= 0) {
        out.push_back(frag.token);
        prev_special = true;
        continue;
      }
      escaped.clear();
      if (v_.add_space_prefix && prev_special) escaped += kSpaceMarker;
      for (char c : frag.text) {
        if (c == ' ') {
          escaped += kSpaceMarker;
        } else {
          escaped += c;
        }
      }
      tokenize_fragment(escaped, out);
      prev_special = false;
    }
    return out;
  }

  struct Symbol {
    size_t off, n;  // byte range in the fragment; n == 0 once merged away
    int prev, next;
  };
  struct Bigram {
    float score;
    int left, right;
    size_t size;
  };
  struct BigramWorse {
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
  };
  struct RevMerge {
    size_t off, left_n, right_n;
  };

  void tokenize_fragment(std::string_view text, std::vector<TokenId>& out) const {
    std::vector<Symbol> syms;
    for (size_t off = 0; off < text.size();) {
      // Valid characters as llama.cpp; an invalid byte is a symbol of its own (llama.cpp lets a
      // stray lead byte swallow the following bytes, which loses an escaped space to byte pieces).
      const size_t n = utf8_valid_len(text, off);
      const int idx = static_cast<int>(syms.size());
      syms.push_back(Symbol{off, n, idx - 1, off + n == text.size() ? -1 : idx + 1});
      off += n;
    }
    if (syms.empty()) return;
    std::priority_queue<Bigram, std::vector<Bigram>, BigramWorse> queue;
    std::unordered_map<std::string_view, RevMerge> rev_merge;
    const auto try_add = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const Symbol& a = syms[static_cast<size_t>(l)];
      const Symbol& b = syms[static_cast<size_t>(r)];
      const std::string_view joined = text.substr(a.off, a.n + b.n);
      auto it = merge_pieces_.find(joined);
      if (it == merge_pieces_.end()) return;
      const float score = score_of(it->second);
      if (score != score) return;  // NaN would break the queue ordering
      queue.push(Bigram{score, l, r, joined.size()});
      rev_merge[joined] = RevMerge{a.off, a.n, b.n};
    };
    for (size_t i = 1; i < syms.size(); ++i) try_add(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!queue.empty()) {
      const Bigram bg = queue.top();
      queue.pop();
      Symbol& l = syms[static_cast<size_t>(bg.left)];
      Symbol& r = syms[static_cast<size_t>(bg.right)];
      if (l.n == 0 || r.n == 0 || l.next != bg.right || l.n + r.n != bg.size) continue;  // stale
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = bg.left;
      try_add(l.prev, bg.left);
      try_add(bg.left, l.next);
    }
    for (int i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
      const Symbol& s = syms[static_cast<size_t>(i)];
      resegment(text, s.off, s.n, rev_merge, out);
    }
  }

  // Emits the piece for text[off, off+n): itself when usable, else the two pieces that merged
  // into it, else its bytes. Iterative: merge chains of unused pieces can be as long as the text.
  void resegment(std::string_view text, size_t off, size_t n,
                 const std::unordered_map<std::string_view, RevMerge>& rev_merge,
                 std::vector<TokenId>& out) const {
    std::vector<std::pair<size_t, size_t>> stack{{off, n}};
    while (!stack.empty()) {
      const auto [o, len] = stack.back();
      stack.pop_back();
      const std::string_view piece = text.substr(o, len);
      auto it = merge_pieces_.find(piece);
      if (it != merge_pieces_.end() && v_.types[static_cast<size_t>(it->second)] != kTokUnused) {
        out.push_back(it->second);
        continue;
      }
      auto rm = rev_merge.find(piece);
      if (rm != rev_merge.end() && rm->second.left_n + rm->second.right_n == len) {
        // Right half pushed first so the left half is emitted first.
        stack.emplace_back(rm->second.off + rm->second.left_n, rm->second.right_n);
        stack.emplace_back(rm->second.off, rm->second.left_n);
        continue;
      }
      emit_bytes(piece, out);
    }
  }

  void emit_bytes(std::string_view piece, std::vector<TokenId>& out) const {
    bool all_bytes = true;
    for (char c : piece) all_bytes = all_bytes && byte_ids_[static_cast<uint8_t>(c)] >= 0;
    if (all_bytes) {
      for (char c : piece) out.push_back(byte_ids_[static_cast<uint8_t>(c)]);
    } else if (v_.unk >= 0) {
      out.push_back(v_.unk);  // no byte fallback in this vocabulary: one <unk> per character
    }
  }

  float score_of(TokenId id) const { return v_.scores.empty() ? 0.0f : v_.scores[static_cast<size_t>(id)]; }

  SpmVocab v_;
  PieceMap all_pieces_;    // every piece (piece_to_id, stop ids)
  PieceMap merge_pieces_;  // pieces that merges and segmentation may produce
  SpecialSplitter splitter_;
  std::array<TokenId, 256> byte_ids_{[] {
    std::array<TokenId, 256> a{};
    a.fill(-1);
    return a;
  }()};
  std::vector<TokenId> stop_ids_;
};

}  // namespace

namespace tokenizer_internal {

Result<std::unique_ptr<Tokenizer>> make_spm_tokenizer(SpmVocab v) {
  try {
    const size_t n = v.tokens.size();
    if (n == 0) return invalid_argument(v.source + ": tokenizer.ggml.tokens is empty");
    if (n > static_cast<size_t>(INT32_MAX)) {
      return invalid_argument(v.source + ": tokenizer.ggml.tokens is too large");
    }
    if (!v.scores.empty() && v.scores.size() != n) {
      return invalid_argument(v.source + ": tokenizer.ggml.scores has " + std::to_string(v.scores.size()) +
                              " entries for " + std::to_string(n) + " tokens");
    }
    if (v.types.empty()) {
      v.types.reserve(n);
      for (const std::string& t : v.tokens) {
        v.types.push_back(parse_byte_piece(t) >= 0 ? kTokByte : kTokNormal);
      }
    } else if (v.types.size() != n) {
      return invalid_argument(v.source + ": tokenizer.ggml.token_type has " + std::to_string(v.types.size()) +
                              " entries for " + std::to_string(n) + " tokens");
    }
    const auto valid = [&](TokenId id) { return id >= 0 && static_cast<size_t>(id) < n; };
    if (!valid(v.bos)) v.bos = -1;
    if (!valid(v.eos)) v.eos = -1;
    if (!valid(v.unk)) v.unk = -1;
    return std::unique_ptr<Tokenizer>(new SpmTokenizer(std::move(v)));
  } catch (const std::bad_alloc&) {
    return resource_exhausted(v.source + ": out of memory building the tokenizer");
  } catch (const std::exception& e) {
    return internal_error(v.source + ": " + e.what());
  }
}

}  // namespace tokenizer_internal
}  // namespace specontext
