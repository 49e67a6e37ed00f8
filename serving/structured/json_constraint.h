// Constrained decoding: a request whose tokens must spell a JSON object (the OpenAI API's
// response_format {"type":"json_object"}).
//   JsonGrammar     a byte-level pushdown automaton for RFC 8259 JSON (strings with escapes and
//                   surrogate pairs, UTF-8 checked as RFC 3629 does, numbers, literals), fed one
//                   byte at a time; it says whether the bytes so far begin some JSON document.
//   TokenConstraint what the scheduler asks of any constraint: mask the logits of tokens that may
//                   not come next, accept the drawn token, say when the text must end.
//   JsonObjectConstraint  a JsonGrammar over a vocabulary's token bytes (VocabularyBytes).
// Pure CPU code, no threads; one constraint belongs to one request.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"
#include "core/tokenizer/tokenizer.h"

namespace specontext {

class JsonGrammar {
 public:
  static constexpr int kMaxDepth = 128;         // deeper nesting is refused
  static constexpr int kMaxWhitespaceRun = 20;  // as llama.cpp's json.gbnf: no endless blank lines
  // require_object: the document must be an object (json_object mode), not any value.
  explicit JsonGrammar(bool require_object = true) : require_object_(require_object) {}
  // False (and the grammar unchanged) when `byte` cannot continue a JSON document here.
  bool feed(uint8_t byte);
  bool feed(std::string_view bytes);           // all or nothing: unchanged when a byte is refused
  bool accepts(std::string_view bytes) const;  // whether feed(bytes) would succeed
  // The bytes so far are a whole document (nothing but its end may follow, for an object; a
  // top-level number could still grow).
  bool complete() const;
  // A whole document that no byte can extend: the text must end here.
  bool closed() const { return state_ == State::kDone; }
  int depth() const { return depth_; }
  // Inside a string, between characters: any printable ASCII but '"' and '\\' may come.
  bool between_string_characters() const { return state_ == State::kString && utf8_left_ == 0; }

 private:
  enum class State : uint8_t {
    kValue,        // a value must come (document start, after ':' or an array's ',')
    kArrayFirst,   // after '[': a value or ']'
    kObjectFirst,  // after '{': a key or '}'
    kKey,          // after an object's ',': a key
    kColon,        // after a key
    kAfterValue,   // ',' or the container's close
    kString,
    kEscape,        // after '\'
    kUnicode,       // in \uXXXX (hex_left digits to go)
    kLowBackslash,  // after a high surrogate's \uXXXX: '\' of the low one must follow
    kLowU,          // then 'u'
    kNumMinus,      // after '-'
    kNumZero,       // a leading 0
    kNumInt,
    kNumDot,  // after '.'
    kNumFrac,
    kNumExp,      // after e/E
    kNumExpSign,  // after the exponent's sign
    kNumExpDigits,
    kLiteral,  // in true / false / null
    kDone,
  };
  bool feed_one(uint8_t byte);
  bool feed_all(std::string_view bytes);   // no rollback: callers work on a copy
  bool start_unicode(bool low_surrogate);  // after "\\u"
  bool value_start(uint8_t byte);
  bool end_value();  // a value just ended: kAfterValue, or kDone at depth 0
  bool close(uint8_t byte);
  bool push(bool object);
  bool top_is_object() const;
  static bool is_space(uint8_t b) { return b == ' ' || b == '\t' || b == '\n' || b == '\r'; }

  bool require_object_ = true;
  State state_ = State::kValue;
  int depth_ = 0;
  uint64_t stack_bits_[2] = {0, 0};  // bit d: container at depth d+1 is an object
  bool string_is_key_ = false;
  uint8_t hex_left_ = 0;
  bool want_low_surrogate_ = false;          // the \u being read must be DC00..DFFF
  uint16_t code_unit_ = 0;                   // of the \u being read
  uint8_t utf8_left_ = 0;                    // continuation bytes still due
  uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // range of the next continuation byte
  uint8_t literal_ = 0, literal_at_ = 0;     // which of true/false/null, and bytes matched
  uint8_t spaces_ = 0;                       // whitespace bytes in the current run
};

// A constraint on the tokens a request may produce. The scheduler asks for the mask before each
// draw, then accepts the drawn token; when closed() the request ends (finish reason "stop").
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets the logits of the tokens that may not come next to -inf. kOutOfRange when no token may
  // (the vocabulary cannot continue the text): the request fails instead of drawing from nothing.
  [[nodiscard]] virtual Status mask(std::span<float> logits) const = 0;
  // kInvalidArgument when `token` is not allowed (it was masked).
  [[nodiscard]] virtual Status accept(TokenId token) = 0;
  virtual bool closed() const = 0;
  // A fresh copy in the same state (each request of `n` choices gets its own).
  virtual std::unique_ptr<TokenConstraint> clone() const = 0;
};

// Every token's bytes as decoded mid-text (Tokenizer::decode_token after an ordinary token).
// Built once per tokenizer, shared by the constraints. Control tokens (EOS among them) are empty,
// so a constraint never allows them: the request ends when the object closes.
struct VocabularyBytes {
  std::vector<std::string> bytes;  // by token id
  // Printable ASCII without '"' or '\\': such a token may follow anywhere inside a string, so the
  // mask allows it there without running the grammar (most of a vocabulary, most of a JSON text).
  std::vector<bool> plain_in_string;
  static std::shared_ptr<const VocabularyBytes> build(const Tokenizer& tokenizer);
  static std::shared_ptr<const VocabularyBytes> from_pieces(std::vector<std::string> bytes);
};

class JsonObjectConstraint final : public TokenConstraint {
 public:
  // kInvalidArgument naming what is missing when the vocabulary has no way to write '{', '}', '"',
  // ':' or ',' (every token-by-token JSON needs them).
  static Result<std::unique_ptr<JsonObjectConstraint>> create(
      std::shared_ptr<const VocabularyBytes> vocabulary);
  Status mask(std::span<float> logits) const override;
  Status accept(TokenId token) override;
  bool closed() const override { return grammar_.closed(); }
  std::unique_ptr<TokenConstraint> clone() const override;
  const JsonGrammar& grammar() const { return grammar_; }

 private:
  explicit JsonObjectConstraint(std::shared_ptr<const VocabularyBytes> vocabulary);
  bool allowed(TokenId id, const JsonGrammar& g) const;
  std::shared_ptr<const VocabularyBytes> vocabulary_;
  JsonGrammar grammar_{true};
};

}  // namespace specontext
