// Byte-level BPE: llama.cpp's GPT-2 test vectors, a hand-written tokenizer.json (ids computed
// by hand), the three pre-tokenizer regexes, special tokens and error reporting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/model/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"
#include "tests/core/tokenizer_test_vectors.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using json = nlohmann::json;
using testing::repo_path;

std::unique_ptr<Tokenizer> load_gpt2() {
  auto g = GgufFile::open(repo_path("data/tokenizer-tests/ggml-vocab-gpt-2.gguf"));
  EXPECT_TRUE(g.is_ok()) << g.status().to_string();
  if (!g.is_ok()) return nullptr;
  auto t = load_gguf_tokenizer(**g);
  EXPECT_TRUE(t.is_ok()) << t.status().to_string();
  return t.is_ok() ? std::move(t).value() : nullptr;
}

bool contains(const std::vector<TokenId>& v, TokenId id) {
  return std::find(v.begin(), v.end(), id) != v.end();
}

TEST(TokenizerBpe, Gpt2VocabTestVectors) {
  auto tok = load_gpt2();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->kind(), "bpe");
  EXPECT_EQ(tok->vocab_size(), 50257);
  const auto cases = testing::read_vocab_tests(repo_path("data/tokenizer-tests/ggml-vocab-gpt-2.gguf.inp"),
                                               repo_path("data/tokenizer-tests/ggml-vocab-gpt-2.gguf.out"));
  ASSERT_EQ(cases.size(), 46u);
  int passed = 0;
  for (int round = 0; round < 2; ++round) {  // the second round is served by the word cache
    for (const auto& [text, want] : cases) {
      auto ids = tok->encode(text, /*add_bos=*/false, /*parse_special=*/false);
      ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
      EXPECT_EQ(*ids, want) << "text: \"" << text << "\"";
      EXPECT_EQ(tok->decode(*ids), text);
      if (round == 0) passed += *ids == want ? 1 : 0;
    }
  }
  EXPECT_EQ(passed, 46);
}

TEST(TokenizerBpe, Gpt2SpecialTokenAndStops) {
  auto tok = load_gpt2();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->eos_id(), 50256);
  EXPECT_TRUE(contains(tok->stop_ids(), 50256));
  EXPECT_FALSE(tok->add_bos_by_default());
  auto with = tok->encode("Hi<|endoftext|>there", false, /*parse_special=*/true);
  ASSERT_TRUE(with.is_ok());
  EXPECT_TRUE(contains(*with, 50256));
  EXPECT_EQ(tok->decode(*with), "Hithere");  // control tokens decode to nothing
  auto without = tok->encode("Hi<|endoftext|>there", false, /*parse_special=*/false);
  ASSERT_TRUE(without.is_ok());
  EXPECT_FALSE(contains(*without, 50256));
  EXPECT_EQ(tok->decode(*without), "Hi<|endoftext|>there");
  EXPECT_EQ(tok->piece_to_id("Ġthe"), 262);
  EXPECT_EQ(tok->decode_token(-1, 262), " the");
}

TEST(TokenizerBpe, ArbitraryBytesRoundTrip) {
  auto tok = load_gpt2();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(11);
  for (int iter = 0; iter < 300; ++iter) {
    std::string text;
    const size_t len = rng() % 64;
    for (size_t i = 0; i < len; ++i) {
      text += rng() % 3 == 0 ? static_cast<char>(rng() % 256) : " aZ9'\n\t,é日"[rng() % 12];
    }
    auto ids = tok->encode(text, false);
    ASSERT_TRUE(ids.is_ok()) << ids.status().to_string();
    for (TokenId id : *ids) ASSERT_TRUE(id >= 0 && id < tok->vocab_size());
    EXPECT_EQ(tok->decode(*ids), text);
  }
}

// GPT-2's byte -> code point table, written out independently of the implementation.
std::string byte_char(int b) {
  std::vector<int> bs;
  for (int i = '!'; i <= '~'; ++i) bs.push_back(i);
  for (int i = 0xA1; i <= 0xAC; ++i) bs.push_back(i);
  for (int i = 0xAE; i <= 0xFF; ++i) bs.push_back(i);
  int cp = b;
  if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
    int n = 0;
    for (int i = 0; i < b; ++i) {
      if (std::find(bs.begin(), bs.end(), i) == bs.end()) ++n;
    }
    cp = 256 + n;
  }
  std::string out;
  tokenizer_internal::append_utf8(out, static_cast<uint32_t>(cp));
  return out;
}

// All 256 byte characters (id = byte) plus merges 3+4, Ġ+Ġ and '+S.
std::unique_ptr<Tokenizer> byte_vocab(const char* regex) {
  tokenizer_internal::BpeVocab v;
  v.source = "bytes";
  for (int b = 0; b < 256; ++b) v.tokens.push_back(byte_char(b));
  v.tokens.push_back("34");
  v.tokens.push_back(byte_char(' ') + byte_char(' '));
  v.tokens.push_back("'S");
  v.merges = {{"3", "4"}, {byte_char(' '), byte_char(' ')}, {"'", "S"}};
  v.pre_steps = {{tokenizer_internal::PreTokenizeStep::kRegexSplit, regex, "test"}};
  auto r = tokenizer_internal::make_bpe_tokenizer(std::move(v));
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r).value() : nullptr;
}

std::vector<TokenId> bytes_of(const std::string& s) {
  std::vector<TokenId> ids;
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

TEST(TokenizerBpe, PreTokenizerRegexes) {
  auto gpt2 = byte_vocab(tokenizer_internal::kGpt2Regex);
  auto llama3 = byte_vocab(tokenizer_internal::kLlama3Regex);
  auto qwen2 = byte_vocab(tokenizer_internal::kQwen2Regex);
  ASSERT_TRUE(gpt2 && llama3 && qwen2);
  // Digits: GPT-2 keeps the run together (3+4 merge), Llama-3 splits it 123|45, Qwen2 per digit.
  EXPECT_EQ(*gpt2->encode("12345", false), (std::vector<TokenId>{'1', '2', 256, '5'}));
  EXPECT_EQ(*llama3->encode("12345", false), bytes_of("12345"));
  EXPECT_EQ(*qwen2->encode("12345", false), bytes_of("12345"));
  // "\s+(?!\S)": of three spaces before a word, two stand alone and one joins the word.
  for (const auto* t : {&gpt2, &llama3, &qwen2}) {
    EXPECT_EQ(*(*t)->encode("a   b", false), (std::vector<TokenId>{'a', 257, ' ', 'b'}));
  }
  // Contractions: case-insensitive in Llama-3/Qwen2 ('S is one pre-token), not in GPT-2.
  EXPECT_EQ(*gpt2->encode("A'S", false), bytes_of("A'S"));
  EXPECT_EQ(*llama3->encode("A'S", false), (std::vector<TokenId>{'A', 258}));
  EXPECT_EQ(*qwen2->encode("A'S", false), (std::vector<TokenId>{'A', 258}));
  // Invalid UTF-8 splits the text but every byte is kept.
  const std::string bad =
      "3\xff"
      "4 \xc3(34";
  for (const auto* t : {&gpt2, &llama3, &qwen2}) {
    auto ids = (*t)->encode(bad, false);
    ASSERT_TRUE(ids.is_ok());
    EXPECT_EQ((*t)->decode(*ids), bad);
  }
}

// tokenizer.ggml.pre picks the pre-tokenizer as llama.cpp does (llama-vocab.cpp): the GPT-2
// test vocabulary with its "pre" value rewritten (it holds no tensors, so nothing moves).
TEST(TokenizerBpe, GgufPreNamesPickThePreTokenizer) {
  const std::string original = testing::read_text_file(repo_path("data/tokenizer-tests/ggml-vocab-gpt-2.gguf"));
  const std::string key = "tokenizer.ggml.pre";
  const size_t at = original.find(key);
  ASSERT_NE(at, std::string::npos);
  const size_t len_at = at + key.size() + 4;  // after the key and its u32 value type (string)
  uint64_t old_len = 0;
  std::memcpy(&old_len, original.data() + len_at, 8);
  auto with_pre = [&](const std::string& name) -> Result<std::unique_ptr<Tokenizer>> {
    const uint64_t n = name.size();
    std::string bytes = original.substr(0, len_at) + std::string(reinterpret_cast<const char*>(&n), 8) + name +
                        original.substr(len_at + 8 + old_len);
    auto g = GgufFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "pre.gguf");
    if (!g.is_ok()) return g.status();
    return load_gguf_tokenizer(**g);
  };
  auto pieces = [](const Tokenizer& t, const std::string& text) {
    std::vector<std::string> out;
    const Result<std::vector<TokenId>> ids = t.encode(text, false);
    EXPECT_TRUE(ids.is_ok()) << ids.status().to_string();
    if (ids.is_ok()) {
      for (TokenId id : *ids) out.push_back(t.decode({id}));
    }
    return out;
  };
  const std::vector<std::string> per_digit = {"1", "2", "3", "4", "5"};
  for (const char* name : {"qwen2", "deepseek-r1-qwen"}) {
    auto t = with_pre(name);
    ASSERT_TRUE(t.is_ok()) << name << ": " << t.status().to_string();
    EXPECT_EQ(pieces(**t, "12345"), per_digit) << name;
  }
  for (const char* name : {"llama-bpe", "llama3"}) {
    auto t = with_pre(name);
    ASSERT_TRUE(t.is_ok()) << name << ": " << t.status().to_string();
    EXPECT_EQ(pieces(**t, "12345"), (std::vector<std::string>{"123", "45"})) << name;
  }
  auto unknown = with_pre("tekken");
  EXPECT_EQ(unknown.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(unknown.status().message().find("\"tekken\""), std::string::npos) << unknown.status().to_string();
}

// A Llama-3 style tokenizer.json, small enough to compute the ids by hand.
json hand_tokenizer_json() {
  json j;
  j["version"] = "1.0";
  j["added_tokens"] = json::array({
      {{"id", 100}, {"content", "<|begin_of_text|>"}, {"special", true}},
      {{"id", 101}, {"content", "<|eot_id|>"}, {"special", true}},
      {{"id", 102}, {"content", "<|start_header_id|>"}, {"special", true}},
      {{"id", 103}, {"content", "<|end_header_id|>"}, {"special", true}},
  });
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", tokenizer_internal::kLlama3Regex}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})}};
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"ignore_merges", false},
                {"vocab",
                 {{"h", 0},
                  {"e", 1},
                  {"l", 2},
                  {"o", 3},
                  {"\xC4\xA0", 4},
                  {"w", 5},
                  {"r", 6},
                  {"d", 7},
                  {"he", 8},
                  {"ll", 9},
                  {"llo", 10},
                  {"hello", 11},
                  {"\xC4\xA0w", 12},
                  {"or", 13},
                  {"\xC4\xA0wor", 14},
                  {"!", 15},
                  {"\xC4\xA0world", 16}}},
                // Both merge spellings: "left right" strings and [left, right] pairs.
                {"merges", json::array({"h e", "l l", "ll o", "he llo", json::array({"\xC4\xA0", "w"}),
                                        json::array({"o", "r"}), json::array({"\xC4\xA0w", "or"})})}};
  return j;
}

std::unique_ptr<Tokenizer> parse_json(const json& j, const std::string& source = "hand.json") {
  auto r = tokenizer_internal::parse_hf_tokenizer_json(j.dump(), source);
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r).value() : nullptr;
}

TEST(TokenizerBpe, HandWrittenTokenizerJson) {
  const std::string dir = testing::temp_dir("tok-bpe");
  const std::string path = dir + "/tokenizer.json";
  testing::write_file(path, hand_tokenizer_json().dump(2));
  auto r = load_hf_tokenizer(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto& tok = *r;
  EXPECT_EQ(tok->vocab_size(), 104);
  EXPECT_EQ(tok->bos_id(), 100);  // from the TemplateProcessing post-processor
  EXPECT_TRUE(tok->add_bos_by_default());
  EXPECT_TRUE(contains(tok->stop_ids(), 101));
  // "hello" | " world" | "!":  h e l l o -> he l l o -> he ll o -> he llo -> hello;
  // Ġ w o r l d -> Ġw o r l d -> Ġw or l d -> Ġwor l d.
  EXPECT_EQ(*tok->encode("hello world!", true), (std::vector<TokenId>{100, 11, 14, 2, 7, 15}));
  EXPECT_EQ(tok->decode({100, 11, 14, 2, 7, 15}), "hello world!");
  // Special tokens are ids only when parse_special.
  EXPECT_EQ(*tok->encode("<|start_header_id|>hello<|end_header_id|>", false, true),
            (std::vector<TokenId>{102, 11, 103}));
  auto plain = tok->encode("<|start_header_id|>hello<|eot_id|>", false, false);
  ASSERT_TRUE(plain.is_ok());
  EXPECT_FALSE(contains(*plain, 102));
  EXPECT_FALSE(contains(*plain, 101));
  EXPECT_TRUE(contains(*plain, 11));
  // Longest match: "<|eot_id|>" wins over nothing shorter, adjacent specials split cleanly.
  EXPECT_EQ(*tok->encode("<|eot_id|><|eot_id|>hello", false, true), (std::vector<TokenId>{101, 101, 11}));
  EXPECT_EQ(tok->piece_to_id("<|eot_id|>"), 101);
  EXPECT_EQ(tok->piece_to_id("\xC4\xA0wor"), 14);

  // ignore_merges: a whole pre-token in the vocabulary wins over the merges (Llama-3).
  json j = hand_tokenizer_json();
  j["model"]["ignore_merges"] = true;
  auto ig = parse_json(j);
  ASSERT_NE(ig, nullptr);
  EXPECT_EQ(*ig->encode("hello world", false), (std::vector<TokenId>{11, 16}));

  // tokenizer_config.json next to tokenizer.json names eos and turns BOS off.
  testing::write_file(dir + "/tokenizer_config.json",
                      R"({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
                          "add_bos_token": false})");
  auto with_cfg = load_hf_tokenizer(path);
  ASSERT_TRUE(with_cfg.is_ok()) << with_cfg.status().to_string();
  EXPECT_EQ((*with_cfg)->eos_id(), 101);
  EXPECT_FALSE((*with_cfg)->add_bos_by_default());
}

void expect_error(const json& j, StatusCode code, const std::string& needle) {
  auto r = tokenizer_internal::parse_hf_tokenizer_json(j.dump(), "bad/tokenizer.json");
  ASSERT_FALSE(r.is_ok()) << "expected an error mentioning " << needle;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find("bad/tokenizer.json"), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
}

TEST(TokenizerBpe, TokenizerJsonErrors) {
  // Syntax errors name the file.
  auto syntax = tokenizer_internal::parse_hf_tokenizer_json("{\"model\": [1, 2", "bad/tokenizer.json");
  ASSERT_FALSE(syntax.is_ok());
  EXPECT_EQ(syntax.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(syntax.status().message().find("bad/tokenizer.json"), std::string::npos);
  EXPECT_NE(syntax.status().message().find("invalid JSON"), std::string::npos);

  json j = hand_tokenizer_json();
  j.erase("model");
  expect_error(j, StatusCode::kInvalidArgument, "\"model\"");

  j = hand_tokenizer_json();
  j["model"]["vocab"] = json::array();
  expect_error(j, StatusCode::kInvalidArgument, "model.vocab");

  j = hand_tokenizer_json();
  j["model"]["vocab"]["h"] = "zero";
  expect_error(j, StatusCode::kInvalidArgument, "model.vocab[\"h\"]");

  j = hand_tokenizer_json();
  j["model"]["vocab"]["h"] = -4;
  expect_error(j, StatusCode::kInvalidArgument, "model.vocab[\"h\"]");

  j = hand_tokenizer_json();
  j["model"]["merges"][1] = 42;
  expect_error(j, StatusCode::kInvalidArgument, "model.merges[1]");

  j = hand_tokenizer_json();
  j["model"]["merges"][2] = "nospace";
  expect_error(j, StatusCode::kInvalidArgument, "model.merges[2]");

  j = hand_tokenizer_json();
  j["added_tokens"][0].erase("id");
  expect_error(j, StatusCode::kInvalidArgument, "added_tokens[0].id");

  j = hand_tokenizer_json();
  j["added_tokens"][1]["content"] = 7;
  expect_error(j, StatusCode::kInvalidArgument, "added_tokens[1].content");

  j = hand_tokenizer_json();
  j["model"]["type"] = "Unigram";
  expect_error(j, StatusCode::kUnimplemented, "model.type");

  j = hand_tokenizer_json();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  expect_error(j, StatusCode::kInvalidArgument, "pre_tokenizer.pretokenizers[0].pattern");

  j = hand_tokenizer_json();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  expect_error(j, StatusCode::kUnimplemented, "pre_tokenizer.pretokenizers[0].behavior");

  j = hand_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_error(j, StatusCode::kUnimplemented, "pre_tokenizer.type");

  j = hand_tokenizer_json();
  j["pre_tokenizer"] = nullptr;
  j["decoder"] = nullptr;
  expect_error(j, StatusCode::kUnimplemented, "ByteLevel");

  j = hand_tokenizer_json();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j, StatusCode::kUnimplemented, "decoder.type");

  j = hand_tokenizer_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(j, StatusCode::kUnimplemented, "normalizer.type");

  j = hand_tokenizer_json();
  j["model"]["vocab"]["far"] = 50'000'000;
  expect_error(j, StatusCode::kInvalidArgument, "model.vocab");

  auto missing = load_hf_tokenizer("/nonexistent/dir/tokenizer.json");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/dir/tokenizer.json"), std::string::npos);

  // A broken tokenizer_config.json is reported against its own path.
  const std::string dir = testing::temp_dir("tok-bpe-cfg");
  testing::write_file(dir + "/tokenizer.json", hand_tokenizer_json().dump());
  testing::write_file(dir + "/tokenizer_config.json", "{oops");
  auto cfg = load_hf_tokenizer(dir + "/tokenizer.json");
  ASSERT_FALSE(cfg.is_ok());
  EXPECT_NE(cfg.status().message().find("tokenizer_config.json"), std::string::npos);
}

TEST(TokenizerBpe, LoneSplitWithByteLevelDecoder) {
  json j = hand_tokenizer_json();
  j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0];  // just the Split
  auto tok = parse_json(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(*tok->encode("hello world!", false), (std::vector<TokenId>{11, 14, 2, 7, 15}));
}

TEST(TokenizerBpe, ByteLevelOnlyWithPrefixSpace) {
  // GPT-2 style: ByteLevel with its built-in regex, add_prefix_space on.
  json j = hand_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  j.erase("post_processor");
  auto tok = parse_json(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), 100);  // fallback by name
  EXPECT_FALSE(tok->add_bos_by_default());
  // " world" gets no second space; "world" gets one.
  EXPECT_EQ(*tok->encode("world", false), (std::vector<TokenId>{14, 2, 7}));
  EXPECT_EQ(*tok->encode(" world", false), (std::vector<TokenId>{14, 2, 7}));
}

}  // namespace
}  // namespace specontext
