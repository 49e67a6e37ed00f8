// Byte-level BPE (GPT-2, Llama-3, Qwen2 families), from an HF tokenizer.json or a GGUF "gpt2"
// vocabulary. Pipeline as HF tokenizers: split out added/special tokens, pre-tokenize with
// regexes (PCRE2, Unicode properties), map every byte to GPT-2's printable code points, merge
// adjacent symbols by merge rank (lowest first, left-most on ties), look the symbols up.
//
// Invalid UTF-8 never matches a regex (PCRE2_MATCH_INVALID_UTF); the bytes between matches
// become pre-tokens of their own and are byte-level encoded like any other byte, so encoding
// is lossless for any input and decode(encode(x)) == x (byte fallback, no replacement).
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/base/mapped_file.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"

namespace specontext {

namespace tokenizer_internal {
const char* const kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char* const kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* const kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
}  // namespace tokenizer_internal

namespace {

using namespace tokenizer_internal;  // NOLINT: private helpers of this module
using json = nlohmann::json;

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the rest to U+0100 onwards.
struct ByteMap {
  std::array<std::string, 256> to_unicode;  // UTF-8 of the mapped code point
  std::unordered_map<uint32_t, uint8_t> from_unicode;
  ByteMap() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? b : next++;
      append_utf8(to_unicode[b], cp);
      from_unicode[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// A compiled PCRE2 pattern. Matching only reads the code and the match context, so one Regex
// is shared by concurrent encode() calls (each has its own match data).
class Regex {
 public:
  static Result<Regex> compile(const std::string& pattern, const std::string& where) {
    Regex r;
    // Two compilations: text that is valid UTF-8 (checked once per split) is matched with
    // PCRE2_NO_UTF_CHECK by a pattern compiled without PCRE2_MATCH_INVALID_UTF; the latter costs
    // a scan of the rest of the subject on every call (15 s instead of 0.02 s for the 108K
    // matches of a 466 KB novel), so only text with invalid sequences takes it.
    for (bool invalid_ok : {false, true}) {
      int err = 0;
      PCRE2_SIZE err_off = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C |
                                           (invalid_ok ? PCRE2_MATCH_INVALID_UTF : 0u),
                                       &err, &err_off, nullptr);
      if (code == nullptr) {
        std::array<PCRE2_UCHAR, 256> msg{};
        pcre2_get_error_message(err, msg.data(), msg.size());
        return invalid_argument(where + ": regex does not compile at offset " + std::to_string(err_off) + ": " +
                                reinterpret_cast<const char*>(msg.data()));
      }
      (invalid_ok ? r.invalid_utf_code_ : r.code_).reset(code, pcre2_code_free);
    }
    pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
    if (ctx == nullptr) return resource_exhausted(where + ": cannot allocate a PCRE2 match context");
    r.ctx_.reset(ctx, pcre2_match_context_free);
    // Bounds for hostile patterns from a tokenizer.json; real pre-tokenizers stay far below.
    pcre2_set_match_limit(ctx, 10'000'000);
    pcre2_set_heap_limit(ctx, 256 * 1024);  // KiB
    r.where_ = where;
    return r;
  }

  // Appends the matches and the gaps between them (HF "Isolated" split behaviour).
  Status split(std::string_view text, std::vector<std::string>& out) const {
    const bool valid = valid_utf8(text);
    pcre2_code* code = valid ? code_.get() : invalid_utf_code_.get();
    const uint32_t options = valid ? PCRE2_NO_UTF_CHECK : 0u;
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code, nullptr), pcre2_match_data_free);
    if (md == nullptr) return resource_exhausted(where_ + ": cannot allocate PCRE2 match data");
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    const size_t n = text.size();
    size_t gap_start = 0;
    size_t pos = 0;
    while (pos < n) {
      const int rc = pcre2_match(code, subject, n, pos, options, md.get(), ctx_.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        std::array<PCRE2_UCHAR, 256> msg{};
        pcre2_get_error_message(rc, msg.data(), msg.size());
        return resource_exhausted(
            where_ + ": pre-tokenizer regex failed: " + reinterpret_cast<const char*>(msg.data()));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t s = std::clamp<size_t>(ov[0], pos, n);
      const size_t e = std::clamp<size_t>(ov[1], 0, n);
      if (e <= s) {  // empty match: step over one character, it joins the gap
        if (s >= n) break;
        pos = s + utf8_valid_len(text, s);
        continue;
      }
      if (s > gap_start) out.emplace_back(text.substr(gap_start, s - gap_start));
      out.emplace_back(text.substr(s, e - s));
      gap_start = pos = e;
    }
    if (gap_start < n) out.emplace_back(text.substr(gap_start));
    return Status::ok();
  }

 private:
  // RFC 3629 UTF-8 (no overlongs, surrogates or code points past U+10FFFF): what PCRE2's own
  // check accepts, so PCRE2_NO_UTF_CHECK is only ever given text it would accept.
  static bool valid_utf8(std::string_view s) {
    size_t i = 0;
    const size_t n = s.size();
    while (i < n) {
      const auto c = static_cast<unsigned char>(s[i]);
      if (c < 0x80) {
        ++i;
        continue;
      }
      size_t len = 0;
      uint32_t cp = 0;
      if (c >= 0xC2 && c <= 0xDF) {
        len = 2, cp = c & 0x1Fu;
      } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, cp = c & 0x0Fu;
      } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, cp = c & 0x07u;
      } else {
        return false;
      }
      if (n - i < len) return false;
      for (size_t k = 1; k < len; ++k) {
        const auto d = static_cast<unsigned char>(s[i + k]);
        if ((d & 0xC0u) != 0x80u) return false;
        cp = (cp << 6) | (d & 0x3Fu);
      }
      if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
        return false;
      }
      i += len;
    }
    return true;
  }

  std::shared_ptr<pcre2_code> code_;              // valid UTF-8 subjects, PCRE2_NO_UTF_CHECK
  std::shared_ptr<pcre2_code> invalid_utf_code_;  // PCRE2_MATCH_INVALID_UTF, for the rest
  std::shared_ptr<pcre2_match_context> ctx_;
  std::string where_;
};

struct Step {
  PreTokenizeStep::Kind kind;
  std::optional<Regex> regex;
};

class BpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> create(BpeVocab v) {
    std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
    for (const PreTokenizeStep& s : v.pre_steps) {
      Step step{s.kind, std::nullopt};
      if (s.kind == PreTokenizeStep::kRegexSplit) {
        SPX_ASSIGN_OR_RETURN(Regex r, Regex::compile(s.regex, v.source + ": " + s.field));
        step.regex = std::move(r);
      }
      t->steps_.push_back(std::move(step));
    }
    t->init(std::move(v));
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

  std::string_view kind() const override { return "bpe"; }
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
    if (id < 0 || static_cast<size_t>(id) >= decoded_.size()) return {};
    return decoded_[static_cast<size_t>(id)];
  }

  TokenId piece_to_id(std::string_view piece) const override {
    auto it = all_pieces_.find(piece);
    return it == all_pieces_.end() ? -1 : it->second;
  }

 private:
  BpeTokenizer() = default;

  void init(BpeVocab v) {
    v_ = std::move(v);
    const size_t n = v_.tokens.size();
    if (v_.types.size() != n) v_.types.assign(n, kTokNormal);
    decoded_.resize(n);
    const ByteMap& bm = byte_map();
    for (size_t i = 0; i < n; ++i) {
      const std::string& piece = v_.tokens[i];
      const auto id = static_cast<TokenId>(i);
      const int32_t type = v_.types[i];
      if (!piece.empty()) all_pieces_.emplace(piece, id);  // first wins
      switch (type) {
        case kTokControl:
          splitter_.add(piece, id, /*special=*/true);
          break;  // decodes to nothing
        case kTokUserDefined:
          splitter_.add(piece, id, /*special=*/false);
          decoded_[i] = piece;  // added tokens are stored as plain text
          break;
        case kTokUnknown:
          break;
        default: {
          if (!piece.empty()) bpe_pieces_.emplace(piece, id);
          std::string& out = decoded_[i];
          for (size_t pos = 0; pos < piece.size();) {
            const size_t len = utf8_valid_len(piece, pos);
            uint32_t cp = static_cast<uint8_t>(piece[pos]);
            if (len > 1) {
              cp &= 0x7Fu >> len;
              for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (piece[pos + k] & 0x3F);
            }
            auto it = len > 1 || cp < 0x80 ? bm.from_unicode.find(cp) : bm.from_unicode.end();
            if (it != bm.from_unicode.end()) {
              out += static_cast<char>(it->second);
            } else {
              out.append(piece, pos, len);  // not a byte-level character: keep as is
            }
            pos += len;
          }
        }
      }
    }
    for (size_t rank = 0; rank < v_.merges.size(); ++rank) {
      const auto& [a, b] = v_.merges[rank];
      auto ia = bpe_pieces_.find(a);
      auto ib = bpe_pieces_.find(b);
      auto im = bpe_pieces_.find(a + b);
      // Merges whose parts or result are not in the vocabulary can never apply: skip them.
      if (ia == bpe_pieces_.end() || ib == bpe_pieces_.end() || im == bpe_pieces_.end()) continue;
      merges_.emplace(pair_key(ia->second, ib->second),
                      MergeInfo{static_cast<int32_t>(rank), im->second});  // first (lowest) wins
    }
    v_.merges.clear();
    v_.merges.shrink_to_fit();
    stop_ids_ = collect_stop_ids(v_.eos, all_pieces_);
  }

  static uint64_t pair_key(TokenId a, TokenId b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  Result<std::vector<TokenId>> encode_impl(std::string_view text, bool add_bos, bool parse_special) const {
    std::vector<TokenId> out;
    if (add_bos && v_.bos >= 0) out.push_back(v_.bos);
    std::vector<std::string> pieces, next;
    std::string mapped;
    const ByteMap& bm = byte_map();
    for (const auto& frag : splitter_.split(text, parse_special)) {
      if (frag.token >= 0) {
        out.push_back(frag.token);
        continue;
      }
      pieces.assign(1, std::string(frag.text));
      for (const Step& step : steps_) {
        next.clear();
        if (step.kind == PreTokenizeStep::kPrefixSpace) {
          for (std::string& p : pieces) {
            if (p.empty() || p[0] != ' ') p.insert(p.begin(), ' ');
            next.push_back(std::move(p));
          }
        } else {
          for (const std::string& p : pieces) SPX_RETURN_IF_ERROR(step.regex->split(p, next));
        }
        pieces.swap(next);
      }
      for (const std::string& p : pieces) {
        mapped.clear();
        for (char c : p) mapped += bm.to_unicode[static_cast<uint8_t>(c)];
        bpe_word(mapped, out);
      }
    }
    return out;
  }

  struct MergeInfo {
    int32_t rank;
    TokenId merged;
  };

  // BPE on one byte-level encoded pre-token, with a bounded cache (words repeat a lot).
  void bpe_word(const std::string& word, std::vector<TokenId>& out) const {
    if (word.empty()) return;
    if (v_.ignore_merges) {
      auto it = bpe_pieces_.find(word);
      if (it != bpe_pieces_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(cache_mu_);
      auto it = cache_.find(word);
      if (it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<TokenId> ids = bpe_merge(word);
    out.insert(out.end(), ids.begin(), ids.end());
    if (word.size() <= 256) {  // long words are rare and would bloat the cache
      std::lock_guard<std::mutex> lock(cache_mu_);
      if (cache_.size() >= 65536) cache_.clear();
      cache_.emplace(word, std::move(ids));
    }
  }

  std::vector<TokenId> bpe_merge(std::string_view word) const {
    struct Sym {
      TokenId id;  // -1: character not in the vocabulary
      int prev, next;
      bool alive;
    };
    struct Cand {
      int32_t rank;
      int left, right;
      TokenId left_id, right_id, merged;
    };
    struct Worse {
      bool operator()(const Cand& a, const Cand& b) const {
        return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
      }
    };
    std::vector<Sym> syms;
    for (size_t pos = 0; pos < word.size();) {
      const size_t len = std::min(utf8_len(static_cast<uint8_t>(word[pos])), word.size() - pos);
      auto it = bpe_pieces_.find(word.substr(pos, len));
      const int idx = static_cast<int>(syms.size());
      syms.push_back(Sym{it == bpe_pieces_.end() ? -1 : it->second, idx - 1,
                         pos + len == word.size() ? -1 : idx + 1, true});
      pos += len;
    }
    std::priority_queue<Cand, std::vector<Cand>, Worse> queue;
    const auto try_pair = [&](int l, int r) {
      if (l < 0 || r < 0) return;
      const TokenId a = syms[static_cast<size_t>(l)].id;
      const TokenId b = syms[static_cast<size_t>(r)].id;
      if (a < 0 || b < 0) return;
      auto it = merges_.find(pair_key(a, b));
      if (it == merges_.end()) return;
      queue.push(Cand{it->second.rank, l, r, a, b, it->second.merged});
    };
    for (size_t i = 1; i < syms.size(); ++i) try_pair(static_cast<int>(i) - 1, static_cast<int>(i));
    while (!queue.empty()) {
      const Cand c = queue.top();
      queue.pop();
      Sym& l = syms[static_cast<size_t>(c.left)];
      Sym& r = syms[static_cast<size_t>(c.right)];
      if (!l.alive || !r.alive || l.next != c.right || l.id != c.left_id || r.id != c.right_id) {
        continue;  // stale
      }
      l.id = c.merged;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<size_t>(r.next)].prev = c.left;
      try_pair(l.prev, c.left);
      try_pair(c.left, l.next);
    }
    std::vector<TokenId> ids;
    for (int i = syms.empty() ? -1 : 0; i >= 0; i = syms[static_cast<size_t>(i)].next) {
      const TokenId id = syms[static_cast<size_t>(i)].id;
      // A character missing from an incomplete vocabulary: <unk> when there is one, else dropped
      // (HF's behaviour without unk_token).
      if (id >= 0) {
        ids.push_back(id);
      } else if (v_.unk >= 0) {
        ids.push_back(v_.unk);
      }
    }
    return ids;
  }

  BpeVocab v_;
  std::vector<Step> steps_;
  PieceMap all_pieces_;  // every piece, for piece_to_id
  PieceMap bpe_pieces_;  // pieces the model may produce (not control/user-defined/unknown)
  std::unordered_map<uint64_t, MergeInfo> merges_;
  std::vector<std::string> decoded_;  // raw bytes of each token
  SpecialSplitter splitter_;
  std::vector<TokenId> stop_ids_;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<TokenId>> cache_;
};

// ---- tokenizer.json ----

// Field access that names the file and the JSON path in every error.
class JsonReader {
 public:
  explicit JsonReader(const std::string& source) : source_(source) {}

  Status error(const std::string& field, const std::string& what) const {
    return invalid_argument(source_ + ": field \"" + field + "\": " + what);
  }
  Status unsupported(const std::string& field, const std::string& what) const {
    return unimplemented(source_ + ": field \"" + field + "\": " + what);
  }
  Result<const json*> object(const json& parent, const std::string& key, const std::string& field,
                             bool required) const {
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) {
      if (required) return error(field, "missing");
      return static_cast<const json*>(nullptr);
    }
    if (!it->is_object()) return error(field, "expected an object");
    return &*it;
  }
  Result<std::string> string(const json& parent, const std::string& key, const std::string& field,
                             std::optional<std::string> dflt = std::nullopt) const {
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) {
      if (dflt) return *dflt;
      return error(field, "missing");
    }
    if (!it->is_string()) return error(field, "expected a string");
    return it->get<std::string>();
  }
  Result<bool> boolean(const json& parent, const std::string& key, const std::string& field,
                       bool dflt) const {
    auto it = parent.find(key);
    if (it == parent.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) return error(field, "expected true or false");
    return it->get<bool>();
  }
  Result<int64_t> integer(const json& v, const std::string& field) const {
    if (!v.is_number_integer()) return error(field, "expected an integer");
    return v.is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(v.get<uint64_t>(), INT64_MAX))
                                  : v.get<int64_t>();
  }

 private:
  const std::string& source_;
};

// Token ids beyond this are rejected: a vocabulary is a dense table.
constexpr int64_t kMaxTokenId = 1 << 24;

Status parse_pre_tokenizer(const JsonReader& rd, const json& node, const std::string& field,
                           std::vector<PreTokenizeStep>& steps, bool& byte_level) {
  if (!node.is_object()) return rd.error(field, "expected an object");
  SPX_ASSIGN_OR_RETURN(std::string type, rd.string(node, "type", field + ".type"));
  if (type == "Sequence") {
    auto it = node.find("pretokenizers");
    if (it == node.end() || !it->is_array()) {
      return rd.error(field + ".pretokenizers", "expected an array");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      SPX_RETURN_IF_ERROR(parse_pre_tokenizer(
          rd, (*it)[i], field + ".pretokenizers[" + std::to_string(i) + "]", steps, byte_level));
    }
    return Status::ok();
  }
  if (type == "ByteLevel") {
    byte_level = true;
    SPX_ASSIGN_OR_RETURN(bool prefix,
                         rd.boolean(node, "add_prefix_space", field + ".add_prefix_space", false));
    SPX_ASSIGN_OR_RETURN(bool use_regex, rd.boolean(node, "use_regex", field + ".use_regex", true));
    if (prefix) steps.push_back({PreTokenizeStep::kPrefixSpace, "", field + ".add_prefix_space"});
    if (use_regex) steps.push_back({PreTokenizeStep::kRegexSplit, kGpt2Regex, field + ".use_regex"});
    return Status::ok();
  }
  if (type == "Split") {
    SPX_ASSIGN_OR_RETURN(const json* pattern, rd.object(node, "pattern", field + ".pattern", true));
    std::string regex;
    if (pattern->contains("Regex")) {
      SPX_ASSIGN_OR_RETURN(regex, rd.string(*pattern, "Regex", field + ".pattern.Regex"));
    } else if (pattern->contains("String")) {
      SPX_ASSIGN_OR_RETURN(std::string literal, rd.string(*pattern, "String", field + ".pattern.String"));
      if (literal.empty()) return rd.error(field + ".pattern.String", "empty pattern");
      for (char c : literal) {  // escape every ASCII punctuation character
        if (std::ispunct(static_cast<unsigned char>(c))) regex += '\\';
        regex += c;
      }
    } else {
      return rd.error(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    SPX_ASSIGN_OR_RETURN(std::string behavior, rd.string(node, "behavior", field + ".behavior", "Isolated"));
    if (behavior != "Isolated") {
      return rd.unsupported(field + ".behavior", "\"" + behavior + "\" (only Isolated)");
    }
    SPX_ASSIGN_OR_RETURN(bool invert, rd.boolean(node, "invert", field + ".invert", false));
    if (invert) return rd.unsupported(field + ".invert", "true is not supported");
    steps.push_back({PreTokenizeStep::kRegexSplit, regex, field + ".pattern"});
    return Status::ok();
  }
  if (type == "Digits") {
    SPX_ASSIGN_OR_RETURN(bool single,
                         rd.boolean(node, "individual_digits", field + ".individual_digits", false));
    steps.push_back({PreTokenizeStep::kRegexSplit, single ? "\\p{N}" : "\\p{N}+", field});
    return Status::ok();
  }
  return rd.unsupported(field + ".type", "\"" + type + "\" is not supported");
}

Status check_normalizer(const JsonReader& rd, const json& node, const std::string& field) {
  if (node.is_null()) return Status::ok();
  if (!node.is_object()) return rd.error(field, "expected an object or null");
  SPX_ASSIGN_OR_RETURN(std::string type, rd.string(node, "type", field + ".type"));
  // NFC is accepted but not applied (no Unicode tables here); inputs are expected in NFC already,
  // as llama.cpp also assumes.
  if (type == "NFC") return Status::ok();
  if (type == "Sequence") {
    auto it = node.find("normalizers");
    if (it == node.end() || !it->is_array()) return rd.error(field + ".normalizers", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      SPX_RETURN_IF_ERROR(check_normalizer(rd, (*it)[i], field + ".normalizers[" + std::to_string(i) + "]"));
    }
    return Status::ok();
  }
  return rd.unsupported(field + ".type", "normalizer \"" + type + "\" is not supported");
}

// The BOS a TemplateProcessing post-processor puts first in "single", if any.
std::optional<std::string> template_bos(const json& node) {
  if (!node.is_object()) return std::nullopt;
  auto type = node.find("type");
  if (type == node.end() || !type->is_string()) return std::nullopt;
  if (*type == "Sequence") {
    auto procs = node.find("processors");
    if (procs == node.end() || !procs->is_array()) return std::nullopt;
    for (const json& p : *procs) {
      if (auto bos = template_bos(p)) return bos;
    }
    return std::nullopt;
  }
  if (*type != "TemplateProcessing") return std::nullopt;
  auto single = node.find("single");
  if (single == node.end() || !single->is_array() || single->empty()) return std::nullopt;
  const json& first = (*single)[0];
  if (!first.is_object()) return std::nullopt;
  auto st = first.find("SpecialToken");
  if (st == first.end() || !st->is_object()) return std::nullopt;
  auto id = st->find("id");
  if (id == st->end() || !id->is_string()) return std::nullopt;
  return id->get<std::string>();
}

// tokenizer_config.json token fields are a string or {"content": string}.
std::optional<std::string> config_token(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return std::nullopt;
}

Result<std::unique_ptr<Tokenizer>> parse_hf_json_impl(std::string_view text, const std::string& source,
                                                      std::string_view config_text,
                                                      const std::string& config_source) {
  const JsonReader rd(source);
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return invalid_argument(source + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) return rd.error("(root)", "expected an object");

  SPX_ASSIGN_OR_RETURN(const json* model, rd.object(root, "model", "model", true));
  SPX_ASSIGN_OR_RETURN(std::string model_type, rd.string(*model, "type", "model.type", "BPE"));
  if (model_type != "BPE") {
    return rd.unsupported("model.type", "\"" + model_type + "\" (only byte-level BPE)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    SPX_ASSIGN_OR_RETURN(std::string v, rd.string(*model, key, std::string("model.") + key, ""));
    if (!v.empty()) return rd.unsupported(std::string("model.") + key, "must be null or empty");
  }

  BpeVocab v;
  v.source = source;
  SPX_ASSIGN_OR_RETURN(v.ignore_merges, rd.boolean(*model, "ignore_merges", "model.ignore_merges", false));

  // Vocabulary and added tokens, into one dense id table.
  SPX_ASSIGN_OR_RETURN(const json* vocab, rd.object(*model, "vocab", "model.vocab", true));
  std::vector<std::pair<int64_t, std::string>> entries;
  entries.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const std::string field = "model.vocab[\"" + it.key() + "\"]";
    SPX_ASSIGN_OR_RETURN(int64_t id, rd.integer(it.value(), field));
    if (id < 0 || id >= kMaxTokenId) return rd.error(field, "id " + std::to_string(id) + " out of range");
    entries.emplace_back(id, it.key());
  }
  struct Added {
    int64_t id;
    std::string content;
    bool special;
  };
  std::vector<Added> added;
  if (auto it = root.find("added_tokens"); it != root.end() && !it->is_null()) {
    if (!it->is_array()) return rd.error("added_tokens", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const std::string field = "added_tokens[" + std::to_string(i) + "]";
      const json& t = (*it)[i];
      if (!t.is_object()) return rd.error(field, "expected an object");
      auto idv = t.find("id");
      if (idv == t.end()) return rd.error(field + ".id", "missing");
      SPX_ASSIGN_OR_RETURN(int64_t id, rd.integer(*idv, field + ".id"));
      if (id < 0 || id >= kMaxTokenId) {
        return rd.error(field + ".id", "id " + std::to_string(id) + " out of range");
      }
      SPX_ASSIGN_OR_RETURN(std::string content, rd.string(t, "content", field + ".content"));
      if (content.empty()) return rd.error(field + ".content", "empty");
      SPX_ASSIGN_OR_RETURN(bool special, rd.boolean(t, "special", field + ".special", false));
      added.push_back(Added{id, std::move(content), special});
    }
  }
  int64_t max_id = -1;
  for (const auto& e : entries) max_id = std::max(max_id, e.first);
  for (const auto& a : added) max_id = std::max(max_id, a.id);
  if (max_id < 0) return rd.error("model.vocab", "empty vocabulary");
  const size_t count = entries.size() + added.size();
  if (static_cast<size_t>(max_id) > 2 * count + 1024) {
    return rd.error("model.vocab", "ids are too sparse (max id " + std::to_string(max_id) + " for " +
                                       std::to_string(count) + " tokens)");
  }
  const auto n = static_cast<size_t>(max_id) + 1;
  v.tokens.assign(n, std::string());
  v.types.assign(n, kTokUnused);  // holes in the id range decode to nothing
  for (auto& [id, piece] : entries) {
    v.tokens[static_cast<size_t>(id)] = std::move(piece);
    v.types[static_cast<size_t>(id)] = kTokNormal;
  }
  for (auto& a : added) {
    v.tokens[static_cast<size_t>(a.id)] = a.content;
    v.types[static_cast<size_t>(a.id)] = a.special ? kTokControl : kTokUserDefined;
  }

  // Merges: "left right" strings or [left, right] pairs, in rank order.
  auto merges = model->find("merges");
  if (merges == model->end() || !merges->is_array()) return rd.error("model.merges", "expected an array");
  v.merges.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    const json& m = (*merges)[i];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) return rd.error(field, "expected \"left right\"");
      v.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      v.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return rd.error(field, "expected \"left right\" or [left, right]");
    }
  }

  if (auto it = root.find("normalizer"); it != root.end()) {
    SPX_RETURN_IF_ERROR(check_normalizer(rd, *it, "normalizer"));
  }
  bool byte_level = false;
  SPX_ASSIGN_OR_RETURN(const json* pre, rd.object(root, "pre_tokenizer", "pre_tokenizer", false));
  if (pre != nullptr) {
    SPX_RETURN_IF_ERROR(parse_pre_tokenizer(rd, *pre, "pre_tokenizer", v.pre_steps, byte_level));
  }
  if (auto it = root.find("decoder"); it != root.end() && !it->is_null()) {
    if (!it->is_object()) return rd.error("decoder", "expected an object or null");
    SPX_ASSIGN_OR_RETURN(std::string type, rd.string(*it, "type", "decoder.type"));
    if (type != "ByteLevel" && type != "Sequence") {
      return rd.unsupported("decoder.type", "\"" + type + "\" (only ByteLevel)");
    }
    // A lone Split pre-tokenizer with a ByteLevel decoder is still byte-level BPE.
    byte_level = byte_level || type == "ByteLevel";
  }
  if (!byte_level) {
    return rd.unsupported("pre_tokenizer",
                          "no ByteLevel pre-tokenizer or decoder: only byte-level BPE is supported");
  }

  PieceMap pieces;
  for (size_t i = 0; i < n; ++i) {
    if (!v.tokens[i].empty()) pieces.emplace(v.tokens[i], static_cast<TokenId>(i));
  }
  const auto find = [&](const std::string& p) -> TokenId {
    auto it = pieces.find(p);
    return it == pieces.end() ? -1 : it->second;
  };
  SPX_ASSIGN_OR_RETURN(std::string unk, rd.string(*model, "unk_token", "model.unk_token", ""));
  if (!unk.empty()) v.unk = find(unk);

  // BOS: the token the post-processor prepends (Llama-3); EOS: the usual end-of-text pieces.
  if (auto it = root.find("post_processor"); it != root.end()) {
    if (auto bos = template_bos(*it)) {
      v.bos = find(*bos);
      v.add_bos = v.bos >= 0;
    }
  }
  if (v.bos < 0) v.bos = find("<|begin_of_text|>");
  for (const char* name : {"<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>"}) {
    if (v.eos < 0) v.eos = find(name);
  }

  if (!config_text.empty()) {
    json cfg;
    try {
      cfg = json::parse(config_text.begin(), config_text.end());
    } catch (const json::exception& e) {
      return invalid_argument(config_source + ": invalid JSON: " + e.what());
    }
    if (!cfg.is_object()) return invalid_argument(config_source + ": expected a JSON object");
    if (auto bos = config_token(cfg, "bos_token")) v.bos = find(*bos);
    if (auto eos = config_token(cfg, "eos_token")) {
      if (TokenId id = find(*eos); id >= 0) v.eos = id;
    }
    const JsonReader crd(config_source);
    SPX_ASSIGN_OR_RETURN(v.add_bos, crd.boolean(cfg, "add_bos_token", "add_bos_token", v.add_bos));
  }
  return make_bpe_tokenizer(std::move(v));
}

}  // namespace

namespace tokenizer_internal {

Result<std::unique_ptr<Tokenizer>> make_bpe_tokenizer(BpeVocab v) {
  const std::string source = v.source;
  try {
    if (v.tokens.empty()) return invalid_argument(source + ": empty vocabulary");
    if (v.tokens.size() > static_cast<size_t>(INT32_MAX)) {
      return invalid_argument(source + ": vocabulary too large");
    }
    if (!v.types.empty() && v.types.size() != v.tokens.size()) {
      return invalid_argument(source + ": token_type has " + std::to_string(v.types.size()) +
                              " entries for " + std::to_string(v.tokens.size()) + " tokens");
    }
    const auto valid = [&](TokenId id) { return id >= 0 && static_cast<size_t>(id) < v.tokens.size(); };
    if (!valid(v.bos)) v.bos = -1;
    if (!valid(v.eos)) v.eos = -1;
    if (!valid(v.unk)) v.unk = -1;
    return BpeTokenizer::create(std::move(v));
  } catch (const std::bad_alloc&) {
    return resource_exhausted(source + ": out of memory building the tokenizer");
  } catch (const std::exception& e) {
    return internal_error(source + ": " + e.what());
  }
}

Result<std::unique_ptr<Tokenizer>> parse_hf_tokenizer_json(std::string_view json_text,
                                                           const std::string& source,
                                                           std::string_view config_json,
                                                           const std::string& config_source) {
  try {
    return parse_hf_json_impl(json_text, source, config_json, config_source);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(source + ": out of memory parsing the tokenizer");
  } catch (const std::exception& e) {  // nlohmann::json type errors and the like
    return invalid_argument(source + ": " + e.what());
  }
}

}  // namespace tokenizer_internal

// Reads tokenizer.json and, when it sits next to it, tokenizer_config.json (bos/eos names).
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path) {
  SPX_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::open(path));
  std::string config_path;
  std::shared_ptr<MappedFile> config;
  try {
    config_path = (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
    std::error_code ec;
    if (std::filesystem::is_regular_file(config_path, ec)) {
      SPX_ASSIGN_OR_RETURN(config, MappedFile::open(config_path));
    }
  } catch (const std::exception& e) {
    return internal_error(path + ": " + e.what());
  }
  const std::string_view text(reinterpret_cast<const char*>(file->data()), file->size());
  std::string_view config_text;
  if (config) {
    config_text = std::string_view(reinterpret_cast<const char*>(config->data()), config->size());
  }
  return tokenizer_internal::parse_hf_tokenizer_json(text, path, config_text, config_path);
}

}  // namespace specontext
