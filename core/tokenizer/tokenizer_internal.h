// Private to the tokenizer implementations (core/tokenizer*.cc), their tests and the fuzzer:
// parse-from-memory entry points, plain vocabulary structs and helpers shared by SPM and BPE.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tokenizer/tokenizer.h"

namespace specontext::tokenizer_internal {

// GGUF token types (tokenizer.ggml.token_type); llama.cpp's numbering.
enum TokenType : int32_t {
  kTokNormal = 1,
  kTokUnknown = 2,
  kTokControl = 3,
  kTokUserDefined = 4,
  kTokUnused = 5,
  kTokByte = 6,
};

// Length of the UTF-8 sequence announced by a lead byte (1 for continuation/invalid bytes),
// as llama.cpp's unicode_len_utf8 does.
size_t utf8_len(uint8_t lead);
// Length of the valid UTF-8 character at text[pos], or 1 when the bytes there are not one.
size_t utf8_valid_len(std::string_view text, size_t pos);
// Appends the UTF-8 encoding of a code point.
void append_utf8(std::string& out, uint32_t cp);
// "<0xHH>" -> HH; -1 when the piece is not in that exact form.
int parse_byte_piece(std::string_view piece);

// Transparent hash so maps keyed by std::string accept string_view lookups.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using PieceMap = std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>>;

// Splits text on literal special/added tokens, leftmost-longest. Tokens marked `special` are
// matched only when parse_special (control tokens); the others (user-defined / non-special added
// tokens) always, as llama.cpp and HF tokenizers do.
class SpecialSplitter {
 public:
  struct Fragment {
    std::string_view text;  // raw text when token < 0
    TokenId token = -1;
  };
  void add(std::string piece, TokenId id, bool special);
  bool empty() const { return count_ == 0; }
  std::vector<Fragment> split(std::string_view text, bool parse_special) const;

 private:
  struct Entry {
    std::string piece;
    TokenId id;
    bool special;
  };
  std::array<std::vector<Entry>, 256> by_first_byte_;  // each sorted longest first
  size_t count_ = 0;
};

// Ids of the usual end-of-turn tokens present in a vocabulary, plus eos (deduplicated).
std::vector<TokenId> collect_stop_ids(TokenId eos, const PieceMap& pieces);

// ---- llama2.c tokenizer.bin ----
Result<std::unique_ptr<Tokenizer>> parse_llama2c_tokenizer(const uint8_t* data, size_t size,
                                                           int32_t vocab_size, const std::string& source);

// ---- SentencePiece BPE (GGUF "llama" vocabularies) ----
struct SpmVocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;   // empty: all 0
  std::vector<int32_t> types;  // empty: inferred ("<0xHH>" is a byte token, else normal)
  TokenId bos = -1, eos = -1, unk = -1;
  bool add_space_prefix = true;
  bool add_bos = true;
  std::string source;  // names the vocabulary in errors
};
Result<std::unique_ptr<Tokenizer>> make_spm_tokenizer(SpmVocab vocab);

// ---- byte-level BPE (GPT-2 / Llama-3 / Qwen2; tokenizer.json or GGUF "gpt2") ----
// One pre-tokenizer step, applied to every piece the previous steps produced.
struct PreTokenizeStep {
  enum Kind { kRegexSplit, kPrefixSpace } kind = kRegexSplit;
  std::string regex;  // kRegexSplit: matches and the text between them both become pieces
  std::string field;  // where the step came from, for error messages
};
struct BpeVocab {
  std::vector<std::string> tokens;  // byte-level encoded pieces ("Ġthe"); added tokens raw
  std::vector<int32_t> types;       // empty: all normal
  std::vector<std::pair<std::string, std::string>> merges;  // in rank order
  std::vector<PreTokenizeStep> pre_steps;
  bool ignore_merges = false;  // a whole pre-token found in the vocab is emitted as is
  TokenId bos = -1, eos = -1, unk = -1;
  bool add_bos = false;
  std::string source;
};
Result<std::unique_ptr<Tokenizer>> make_bpe_tokenizer(BpeVocab vocab);

// Parses tokenizer.json text. `config_json` is the optional tokenizer_config.json text (empty:
// none), read for bos_token / eos_token / add_bos_token.
Result<std::unique_ptr<Tokenizer>> parse_hf_tokenizer_json(std::string_view json_text,
                                                           const std::string& source,
                                                           std::string_view config_json = {},
                                                           const std::string& config_source = {});

// The pre-tokenizer regexes used for GGUF "gpt2" vocabularies, by tokenizer.ggml.pre.
extern const char* const kGpt2Regex;
extern const char* const kLlama3Regex;
extern const char* const kQwen2Regex;

}  // namespace specontext::tokenizer_internal
