#include "serving/structured/json_constraint.h"

#include <algorithm>
#include <array>
#include <limits>

namespace specontext {

namespace {

constexpr std::string_view kLiterals[] = {"true", "false", "null"};

int hex_value(uint8_t b) {
  if (b >= '0' && b <= '9') return b - '0';
  if (b >= 'a' && b <= 'f') return b - 'a' + 10;
  if (b >= 'A' && b <= 'F') return b - 'A' + 10;
  return -1;
}

bool is_digit(uint8_t b) { return b >= '0' && b <= '9'; }

}  // namespace

bool JsonGrammar::feed_all(std::string_view bytes) {
  for (char c : bytes) {
    if (!feed_one(static_cast<uint8_t>(c))) return false;
  }
  return true;
}

bool JsonGrammar::feed(uint8_t byte) {
  const char c = static_cast<char>(byte);
  return feed(std::string_view(&c, 1));
}

bool JsonGrammar::feed(std::string_view bytes) {
  JsonGrammar next = *this;
  if (!next.feed_all(bytes)) return false;
  *this = next;
  return true;
}

bool JsonGrammar::accepts(std::string_view bytes) const {
  JsonGrammar next = *this;
  return next.feed_all(bytes);
}

bool JsonGrammar::start_unicode(bool low_surrogate) {
  state_ = State::kUnicode;
  hex_left_ = 4;
  code_unit_ = 0;
  want_low_surrogate_ = low_surrogate;
  return true;
}

bool JsonGrammar::complete() const {
  if (state_ == State::kDone) return true;
  if (depth_ != 0 || require_object_) return false;
  return state_ == State::kNumZero || state_ == State::kNumInt || state_ == State::kNumFrac ||
         state_ == State::kNumExpDigits;
}

bool JsonGrammar::top_is_object() const {
  const int d = depth_ - 1;
  return (stack_bits_[d / 64] >> (d % 64) & 1) != 0;
}

bool JsonGrammar::push(bool object) {
  if (depth_ >= kMaxDepth) return false;
  const uint64_t bit = uint64_t{1} << (depth_ % 64);
  if (object) {
    stack_bits_[depth_ / 64] |= bit;
  } else {
    stack_bits_[depth_ / 64] &= ~bit;
  }
  ++depth_;
  state_ = object ? State::kObjectFirst : State::kArrayFirst;
  return true;
}

bool JsonGrammar::end_value() {
  state_ = depth_ == 0 ? State::kDone : State::kAfterValue;
  return true;
}

bool JsonGrammar::close(uint8_t byte) {
  if (depth_ == 0 || (byte == '}') != top_is_object()) return false;
  --depth_;
  return end_value();
}

bool JsonGrammar::value_start(uint8_t b) {
  if (b == '{') return push(true);
  if (depth_ == 0 && require_object_) return false;
  switch (b) {
    case '[':
      return push(false);
    case '"':
      state_ = State::kString;
      string_is_key_ = false;
      return true;
    case '-':
      state_ = State::kNumMinus;
      return true;
    case '0':
      state_ = State::kNumZero;
      return true;
    case 't':
    case 'f':
    case 'n':
      literal_ = b == 't' ? 0 : b == 'f' ? 1 : 2;
      literal_at_ = 1;
      state_ = State::kLiteral;
      return true;
    default:
      if (b >= '1' && b <= '9') {
        state_ = State::kNumInt;
        return true;
      }
      return false;
  }
}

bool JsonGrammar::feed_one(uint8_t b) {
  switch (state_) {
    case State::kValue:
    case State::kArrayFirst:
    case State::kObjectFirst:
    case State::kKey:
    case State::kColon:
    case State::kAfterValue:
      if (is_space(b)) return ++spaces_ <= kMaxWhitespaceRun;
      spaces_ = 0;
      break;
    case State::kDone:
      // After an object nothing may follow; after another top-level value, whitespace may.
      if (require_object_ || !is_space(b)) return false;
      return ++spaces_ <= kMaxWhitespaceRun;
    default:
      break;
  }
  switch (state_) {
    case State::kValue:
      return value_start(b);
    case State::kArrayFirst:
      return b == ']' ? close(b) : value_start(b);
    case State::kObjectFirst:
    case State::kKey:
      if (b == '}' && state_ == State::kObjectFirst) return close(b);
      if (b != '"') return false;
      state_ = State::kString;
      string_is_key_ = true;
      return true;
    case State::kColon:
      if (b != ':') return false;
      state_ = State::kValue;
      return true;
    case State::kAfterValue:
      if (b == ',') {
        state_ = top_is_object() ? State::kKey : State::kValue;
        return true;
      }
      return (b == '}' || b == ']') && close(b);
    case State::kString:
      if (utf8_left_ > 0) {
        if (b < utf8_lo_ || b > utf8_hi_) return false;
        --utf8_left_;
        utf8_lo_ = 0x80;
        utf8_hi_ = 0xBF;
        return true;
      }
      if (b == '"') {
        if (string_is_key_) {
          state_ = State::kColon;
          return true;
        }
        return end_value();
      }
      if (b == '\\') {
        state_ = State::kEscape;
        return true;
      }
      if (b < 0x20) return false;  // control characters must be escaped
      if (b < 0x80) return true;
      // RFC 3629: the lead byte fixes the count and the range of the first continuation byte
      // (no overlong forms, no surrogates, nothing past U+10FFFF).
      if (b >= 0xC2 && b <= 0xDF) {
        utf8_left_ = 1;
      } else if (b >= 0xE0 && b <= 0xEF) {
        utf8_left_ = 2;
        if (b == 0xE0) utf8_lo_ = 0xA0;
        if (b == 0xED) utf8_hi_ = 0x9F;
      } else if (b >= 0xF0 && b <= 0xF4) {
        utf8_left_ = 3;
        if (b == 0xF0) utf8_lo_ = 0x90;
        if (b == 0xF4) utf8_hi_ = 0x8F;
      } else {
        return false;
      }
      return true;
    case State::kEscape:
      switch (b) {
        case '"':
        case '\\':
        case '/':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          state_ = State::kString;
          return true;
        case 'u':
          return start_unicode(/*low_surrogate=*/false);
        default:
          return false;
      }
    case State::kUnicode: {
      const int h = hex_value(b);
      if (h < 0) return false;
      code_unit_ = static_cast<uint16_t>(code_unit_ << 4 | h);
      --hex_left_;
      if (hex_left_ == 2) {  // the high byte is known: surrogates pair up or not at all
        const bool low = code_unit_ >= 0xDC && code_unit_ <= 0xDF;
        if (low != want_low_surrogate_) return false;
      }
      if (hex_left_ > 0) return true;
      const bool high = code_unit_ >= 0xD800 && code_unit_ <= 0xDBFF;
      state_ = want_low_surrogate_ || !high ? State::kString : State::kLowBackslash;
      want_low_surrogate_ = false;
      return true;
    }
    case State::kLowBackslash:
      if (b != '\\') return false;
      state_ = State::kLowU;
      return true;
    case State::kLowU:
      return b == 'u' && start_unicode(/*low_surrogate=*/true);
    case State::kNumMinus:
      if (b == '0') {
        state_ = State::kNumZero;
        return true;
      }
      if (b >= '1' && b <= '9') {
        state_ = State::kNumInt;
        return true;
      }
      return false;
    case State::kNumZero:
    case State::kNumInt:
    case State::kNumFrac:
      if (is_digit(b) && state_ != State::kNumZero) return true;
      if (b == '.' && state_ != State::kNumFrac) {
        state_ = State::kNumDot;
        return true;
      }
      if (b == 'e' || b == 'E') {
        state_ = State::kNumExp;
        return true;
      }
      return end_value() && feed_one(b);  // the number ended just before b
    case State::kNumDot:
      if (!is_digit(b)) return false;
      state_ = State::kNumFrac;
      return true;
    case State::kNumExp:
      if (b == '+' || b == '-') {
        state_ = State::kNumExpSign;
        return true;
      }
      [[fallthrough]];
    case State::kNumExpSign:
      if (!is_digit(b)) return false;
      state_ = State::kNumExpDigits;
      return true;
    case State::kNumExpDigits:
      if (is_digit(b)) return true;
      return end_value() && feed_one(b);
    case State::kLiteral: {
      const std::string_view word = kLiterals[literal_];
      if (b != static_cast<uint8_t>(word[literal_at_])) return false;
      if (++literal_at_ == word.size()) return end_value();
      return true;
    }
    case State::kDone:
      return false;
  }
  return false;
}

std::shared_ptr<const VocabularyBytes> VocabularyBytes::build(const Tokenizer& tokenizer) {
  const int32_t n = tokenizer.vocab_size();
  // Any token but BOS as the left context: only BOS (or the start) strips a leading space.
  const TokenId context = tokenizer.bos_id() == 0 ? 1 : 0;
  std::vector<std::string> bytes(static_cast<size_t>(n));
  for (TokenId id = 0; id < n; ++id) bytes[static_cast<size_t>(id)] = tokenizer.decode_token(context, id);
  return from_pieces(std::move(bytes));
}

std::shared_ptr<const VocabularyBytes> VocabularyBytes::from_pieces(std::vector<std::string> bytes) {
  auto v = std::make_shared<VocabularyBytes>();
  v->bytes = std::move(bytes);
  v->plain_in_string.resize(v->bytes.size());
  for (size_t i = 0; i < v->bytes.size(); ++i) {
    const std::string& b = v->bytes[i];
    v->plain_in_string[i] = !b.empty() && std::all_of(b.begin(), b.end(), [](char c) {
      return c >= 0x20 && c < 0x7f && c != '"' && c != '\\';
    });
  }
  return v;
}

JsonObjectConstraint::JsonObjectConstraint(std::shared_ptr<const VocabularyBytes> vocabulary)
    : vocabulary_(std::move(vocabulary)) {}

Result<std::unique_ptr<JsonObjectConstraint>> JsonObjectConstraint::create(
    std::shared_ptr<const VocabularyBytes> vocabulary) {
  if (vocabulary == nullptr) return invalid_argument("json constraint: no vocabulary");
  std::string missing;
  for (char c : std::string_view("{}\":,")) {
    bool found = false;
    for (const std::string& b : vocabulary->bytes) found |= b.size() == 1 && b[0] == c;
    if (!found) missing += std::string(missing.empty() ? "" : " ") + "'" + c + "'";
  }
  if (!missing.empty()) {
    return invalid_argument("json constraint: the vocabulary has no token of its own for " + missing +
                            ", so it cannot be made to write JSON");
  }
  return std::unique_ptr<JsonObjectConstraint>(new JsonObjectConstraint(std::move(vocabulary)));
}

bool JsonObjectConstraint::allowed(TokenId id, const JsonGrammar& g) const {
  if (id < 0 || static_cast<size_t>(id) >= vocabulary_->bytes.size()) return false;
  const std::string& b = vocabulary_->bytes[static_cast<size_t>(id)];
  return !b.empty() && g.accepts(b);
}

Status JsonObjectConstraint::mask(std::span<float> logits) const {
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  // Which bytes may come next (256 trials), so that most tokens are decided by their first byte.
  std::array<bool, 256> first{};
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    first[static_cast<size_t>(b)] = grammar_.accepts(std::string_view(&c, 1));
  }
  size_t open = 0;
  const std::vector<std::string>& bytes = vocabulary_->bytes;
  const std::vector<bool>& plain = vocabulary_->plain_in_string;
  const bool in_string = grammar_.between_string_characters();
  for (size_t id = 0; id < logits.size(); ++id) {
    bool ok = false;
    if (id >= bytes.size()) {
      ok = false;
    } else if (in_string && plain[id]) {
      ok = true;
    } else if (!bytes[id].empty() && first[static_cast<uint8_t>(bytes[id][0])]) {
      ok = bytes[id].size() == 1 || grammar_.accepts(bytes[id]);
    }
    if (ok) {
      ++open;
    } else {
      logits[id] = kNever;
    }
  }
  if (open == 0) {
    return out_of_range(
        "response_format json_object: no token of the vocabulary continues the JSON text here");
  }
  return Status::ok();
}

Status JsonObjectConstraint::accept(TokenId token) {
  if (!allowed(token, grammar_)) {
    return invalid_argument("response_format json_object: token " + std::to_string(token) +
                            " does not continue the JSON text");
  }
  (void)grammar_.feed(vocabulary_->bytes[static_cast<size_t>(token)]);
  return Status::ok();
}

std::unique_ptr<TokenConstraint> JsonObjectConstraint::clone() const {
  return std::unique_ptr<TokenConstraint>(new JsonObjectConstraint(*this));
}

}  // namespace specontext
