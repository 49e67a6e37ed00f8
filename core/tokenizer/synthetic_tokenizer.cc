#include "core/tokenizer/synthetic_tokenizer.h"

#include <cctype>
#include <charconv>

namespace specontext {

namespace {

class SyntheticTokenizer final : public Tokenizer {
 public:
  explicit SyntheticTokenizer(int32_t vocab) : vocab_(vocab) {}
  std::string_view kind() const override { return "synthetic"; }
  int32_t vocab_size() const override { return vocab_; }
  TokenId bos_id() const override { return -1; }
  TokenId eos_id() const override { return -1; }
  std::vector<TokenId> stop_ids() const override { return {}; }
  Result<std::vector<TokenId>> encode(std::string_view text, bool, bool) const override {
    std::vector<TokenId> ids;
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      if (i == text.size()) break;
      size_t end = i;
      while (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end]))) ++end;
      const std::string_view word = text.substr(i, end - i);
      TokenId id = -1;
      const auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (ec != std::errc() || ptr != word.data() + word.size() || id < 0 || id >= vocab_) {
        return invalid_argument("synthetic tokenizer: '" + std::string(word.substr(0, 32)) +
                                "' is not a token id in [0, " + std::to_string(vocab_) + ")");
      }
      ids.push_back(id);
      i = end;
    }
    return ids;
  }
  std::string decode_token(TokenId, TokenId id) const override {
    std::string piece = std::to_string(id);
    piece.insert(piece.begin(), ' ');  // not " " + string: GCC 12 warns -Wrestrict inside operator+
    return piece;
  }
  TokenId piece_to_id(std::string_view) const override { return -1; }

 private:
  int32_t vocab_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_synthetic_tokenizer(int32_t vocab_size) {
  return std::make_unique<SyntheticTokenizer>(vocab_size);
}

}  // namespace specontext
