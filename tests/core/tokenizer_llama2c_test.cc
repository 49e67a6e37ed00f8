// llama2.c tokenizer.bin: golden ids from run.c, equivalence with a literal port of run.c's
// O(n^2) encode(), decoding rules, vocabularies without byte pieces and corrupt files.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <sstream>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;

std::vector<TokenId> parse_ids(const std::string& text) {
  std::vector<TokenId> ids;
  std::istringstream in(text);
  TokenId id;
  while (in >> id) ids.push_back(id);
  return ids;
}

struct RawVocab {
  std::vector<std::string> pieces;
  std::vector<float> scores;
  int32_t max_len = 0;
};

RawVocab read_raw(const std::string& bytes, int32_t n) {
  RawVocab v;
  size_t off = 0;
  std::memcpy(&v.max_len, bytes.data(), 4);
  off = 4;
  for (int32_t i = 0; i < n; ++i) {
    float s;
    int32_t len;
    std::memcpy(&s, bytes.data() + off, 4);
    std::memcpy(&len, bytes.data() + off + 4, 4);
    off += 8;
    v.pieces.emplace_back(bytes.substr(off, static_cast<size_t>(len)));
    v.scores.push_back(s);
    off += static_cast<size_t>(len);
  }
  return v;
}

// Literal port of llama2.c run.c encode(): linear lookups, full rescan per merge.
std::vector<TokenId> run_c_encode(const RawVocab& v, const std::string& text, bool bos) {
  auto lookup = [&](const std::string& s) -> int {
    for (size_t i = 0; i < v.pieces.size(); ++i) {
      if (v.pieces[i] == s) return static_cast<int>(i);
    }
    return -1;
  };
  std::vector<TokenId> tokens;
  if (bos) tokens.push_back(1);
  if (!text.empty()) tokens.push_back(lookup(" "));
  std::string buf;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<uint8_t>(text[i]);
    if ((c & 0xC0) != 0x80) buf.clear();
    buf += static_cast<char>(c);
    const uint8_t next = i + 1 < text.size() ? static_cast<uint8_t>(text[i + 1]) : 0;
    if ((next & 0xC0) == 0x80 && buf.size() < 4) continue;
    const int id = lookup(buf);
    if (id != -1) {
      tokens.push_back(id);
    } else {
      for (char b : buf) tokens.push_back(static_cast<uint8_t>(b) + 3);
    }
    buf.clear();
  }
  while (true) {
    float best_score = -1e10f;
    int best_id = -1, best_idx = -1;
    for (size_t i = 0; i + 1 < tokens.size(); ++i) {
      const int id =
          lookup(v.pieces[static_cast<size_t>(tokens[i])] + v.pieces[static_cast<size_t>(tokens[i + 1])]);
      if (id != -1 && v.scores[static_cast<size_t>(id)] > best_score) {
        best_score = v.scores[static_cast<size_t>(id)];
        best_id = id;
        best_idx = static_cast<int>(i);
      }
    }
    if (best_idx == -1) break;
    tokens[static_cast<size_t>(best_idx)] = best_id;
    tokens.erase(tokens.begin() + best_idx + 1);
  }
  return tokens;
}

std::unique_ptr<Tokenizer> load_stories() {
  auto t = load_llama2c_tokenizer(repo_path("models/stories260K/tok512.bin"), 512);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return t.is_ok() ? std::move(t).value() : nullptr;
}

TEST(TokenizerLlama2c, GoldenPromptIds) {
  auto tok = load_stories();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->kind(), "llama2c");
  EXPECT_EQ(tok->vocab_size(), 512);
  const std::string prompt = read_text_file(repo_path("models/stories260K/golden/prompt.txt"));
  ASSERT_FALSE(prompt.empty());
  ASSERT_NE(prompt.back(), '\n');  // the golden ids were made from the text without a newline
  const std::vector<TokenId> want =
      parse_ids(read_text_file(repo_path("models/stories260K/golden/prompt_ids.txt")));
  ASSERT_EQ(want.size(), 32u);
  auto ids = tok->encode(prompt, /*add_bos=*/true);
  ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
  EXPECT_EQ(*ids, want);
  EXPECT_EQ(tok->decode(*ids), prompt);
}

TEST(TokenizerLlama2c, MatchesRunCEncodeOnRandomText) {
  auto tok = load_stories();
  ASSERT_NE(tok, nullptr);
  const RawVocab raw = read_raw(read_text_file(repo_path("models/stories260K/tok512.bin")), 512);
  const std::string sample = read_text_file(repo_path("data/tinystories_sample.txt"));
  std::mt19937 rng(42);
  const std::vector<std::string> extras = {"é", "日本", "🙂", "\xff", "\x80\x80", "\xe2\x82", "\t\n"};
  for (int iter = 0; iter < 60; ++iter) {
    std::string text;
    if (!sample.empty() && iter % 2 == 0) {
      const size_t start = rng() % sample.size();
      text = sample.substr(start, 1 + rng() % 120);
    }
    for (int k = 0; k < 3; ++k) text += extras[rng() % extras.size()] + "ab c";
    for (bool bos : {true, false}) {
      auto ids = tok->encode(text, bos);
      ASSERT_TRUE(ids.is_ok());
      EXPECT_EQ(*ids, run_c_encode(raw, text, bos)) << "text: " << text;
      // Byte fallback makes the round trip exact, invalid UTF-8 included.
      EXPECT_EQ(tok->decode(*ids), text);
    }
  }
}

TEST(TokenizerLlama2c, EmptyTextAndBos) {
  auto tok = load_stories();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_TRUE(tok->add_bos_by_default());
  EXPECT_EQ(*tok->encode("", true), std::vector<TokenId>{1});
  EXPECT_TRUE(tok->encode("", false)->empty());
  // Non-empty text starts with the dummy prefix merged into the first word.
  auto ids = tok->encode("a", false);
  ASSERT_TRUE(ids.is_ok());
  ASSERT_EQ(ids->size(), 1u);
  EXPECT_EQ(tok->decode_token(-1, (*ids)[0]), "a");
  EXPECT_EQ(tok->decode_token(5, (*ids)[0]), " a");
  const auto stops = tok->stop_ids();
  EXPECT_NE(std::find(stops.begin(), stops.end(), 2), stops.end());
  EXPECT_NE(std::find(stops.begin(), stops.end(), 1), stops.end());  // run.c stops at BOS
}

TEST(TokenizerLlama2c, DecodeTokenRules) {
  auto tok = load_stories();
  ASSERT_NE(tok, nullptr);
  const TokenId the = tok->piece_to_id(" the");
  ASSERT_GE(the, 0);
  EXPECT_EQ(tok->decode_token(1, the), "the");   // after BOS the leading space goes
  EXPECT_EQ(tok->decode_token(-1, the), "the");  // start of text counts as BOS
  EXPECT_EQ(tok->decode_token(100, the), " the");
  EXPECT_EQ(tok->decode_token(100, 'A' + 3), "A");  // <0x41>
  EXPECT_EQ(tok->decode_token(100, 3), std::string(1, '\0'));
  EXPECT_EQ(tok->decode_token(100, 1), "");  // <s>/</s> are never printed
  EXPECT_EQ(tok->decode_token(100, 2), "");
  EXPECT_EQ(tok->decode_token(100, -5), "");
  EXPECT_EQ(tok->decode_token(100, 512), "");
  EXPECT_EQ(tok->piece_to_id("no such piece"), -1);
}

TEST(TokenizerLlama2c, BabyLlamaVocabWithoutBytePieces) {
  auto r = load_llama2c_tokenizer(repo_path("models/babyllama105/tok105.bin"), 105);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto& tok = *r;
  EXPECT_EQ(tok->vocab_size(), 105);
  const std::string text = "Once upon a time, Lily said: \"I like 3 cats!\"";
  auto ids = tok->encode(text, true);
  ASSERT_TRUE(ids.is_ok());
  EXPECT_EQ(tok->decode(*ids), text);
  for (TokenId id : *ids) EXPECT_LT(id, 105);
  // Characters outside the vocabulary become <unk> (0), not out-of-range byte ids.
  auto odd = tok->encode("a\x01日", false);
  ASSERT_TRUE(odd.is_ok());
  for (TokenId id : *odd) EXPECT_LT(id, 105);
  EXPECT_NE(std::find(odd->begin(), odd->end(), 0), odd->end());
}

// Builds a tokenizer.bin image.
std::string make_bin(int32_t max_len, const std::vector<std::pair<std::string, float>>& vocab) {
  std::string out(reinterpret_cast<const char*>(&max_len), 4);
  for (const auto& [piece, score] : vocab) {
    const auto len = static_cast<int32_t>(piece.size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += piece;
  }
  return out;
}

TEST(TokenizerLlama2c, MergeOrderScoresAndTies) {
  // ids: 0 <unk>, 1 <s>, 2 </s>, 3 " ", 4 a, 5 b, 6 ab, 7 " a", 8 "ab ab"? (not reachable)
  const std::string bin = make_bin(8, {{"<unk>", 0},
                                       {"\n<s>\n", 0},
                                       {"\n</s>\n", 0},
                                       {" ", 0},
                                       {"a", 0},
                                       {"b", 0},
                                       {"ab", -1},
                                       {" a", -2},
                                       {"ba", -1},
                                       {"aba", -20},
                                       {"bb", -1e11f}});
  auto r = tokenizer_internal::parse_llama2c_tokenizer(reinterpret_cast<const uint8_t*>(bin.data()),
                                                       bin.size(), 11, "mem.bin");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  // " abab": " " a b a b. "ab" and "ba" tie at -1: the left-most pair wins each round:
  // " " [ab] a b -> " " ab [ab] -> " " ab ab; " a" (-2) lost its "a" to "ab" first.
  EXPECT_EQ(*(*r)->encode("abab", false), (std::vector<TokenId>{3, 6, 6}));
  // "bb" scores below run.c's -1e10 floor: never merged. "bab": [ba] b.
  EXPECT_EQ(*(*r)->encode("bb", false), (std::vector<TokenId>{3, 5, 5}));
  EXPECT_EQ(*(*r)->encode("bab", false), (std::vector<TokenId>{3, 8, 5}));
  // No byte pieces in this vocabulary: unknown bytes become <unk>.
  EXPECT_EQ(*(*r)->encode("c", false), (std::vector<TokenId>{3, 0}));
}

TEST(TokenizerLlama2c, CorruptFilesAreDataLoss) {
  const std::string dir = testing::temp_dir("tok-l2c");
  const std::string good = read_text_file(repo_path("models/stories260K/tok512.bin"));
  ASSERT_GT(good.size(), 100u);
  auto expect_data_loss = [&](const std::string& name, const std::string& bytes, int32_t vocab) {
    const std::string path = dir + "/" + name;
    testing::write_file(path, bytes);
    auto r = load_llama2c_tokenizer(path, vocab);
    ASSERT_FALSE(r.is_ok()) << name;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().to_string();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  };
  for (size_t cut :
       {size_t{0}, size_t{2}, size_t{4}, size_t{7}, size_t{11}, good.size() / 2, good.size() - 1}) {
    expect_data_loss("cut" + std::to_string(cut), good.substr(0, cut), 512);
  }
  expect_data_loss("more_than_file", good, 513);
  expect_data_loss("negative_len", make_bin(4, {{"ab", 0}}).replace(8, 4, "\xff\xff\xff\xff"), 1);
  expect_data_loss("too_long", make_bin(2, {{"abc", 0}}), 1);
  expect_data_loss("zero_max", make_bin(0, {{"", 0}}), 1);

  auto missing = load_llama2c_tokenizer(dir + "/nope.bin", 512);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  auto bad_vocab = load_llama2c_tokenizer(repo_path("models/stories260K/tok512.bin"), 0);
  EXPECT_EQ(bad_vocab.status().code(), StatusCode::kInvalidArgument);
  // A shorter vocab_size than the file holds is fine (run.c reads only what it is told).
  EXPECT_TRUE(load_llama2c_tokenizer(repo_path("models/stories260K/tok512.bin"), 300).is_ok());
}

TEST(TokenizerLlama2c, LongInputIsFast) {
  auto tok = load_stories();
  ASSERT_NE(tok, nullptr);
  std::string text;
  while (text.size() < 200000) text += "Once upon a time, there was a little girl named Lily. ";
  auto ids = tok->encode(text, true);
  ASSERT_TRUE(ids.is_ok());
  EXPECT_EQ(tok->decode(*ids), text);
}

}  // namespace
}  // namespace specontext
