// Hard-coded chat templates: exact renderings, and that the markers encode as special tokens.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/tokenizer.h"
#include "core/tokenizer_internal.h"

namespace specontext {
namespace {

const std::vector<ChatMessage> kConversation = {
    {"system", "You are terse."},
    {"user", "Hi!"},
    {"assistant", "Hello."},
    {"user", "2+2?"},
};

TEST(ChatTemplate, Llama3Exact) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, kConversation),
            "<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::kLlama3, {}),
            "<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, QwenChatMlExact) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, kConversation),
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi!<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_template(ChatTemplate::kQwen, {}), "<|im_start|>assistant\n");
}

TEST(ChatTemplate, NoneConcatenatesContents) {
  EXPECT_EQ(apply_chat_template(ChatTemplate::kNone, {{"user", "Once upon"}, {"user", " a time"}}),
            "Once upon a time");
}

TEST(ChatTemplate, QwenMarkersEncodeAsSpecialTokens) {
  // Every byte character plus the two ChatML markers.
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  std::vector<int> bs;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    std::string piece;
    tokenizer_internal::append_utf8(piece, printable ? b : 256 + next++);
    vocab[piece] = b;
  }
  nlohmann::json j = {
      {"added_tokens", nlohmann::json::array({{{"id", 256}, {"content", "<|im_start|>"}, {"special", true}},
                                              {{"id", 257}, {"content", "<|im_end|>"}, {"special", true}}})},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers", nlohmann::json::array({{{"type", "Split"},
                                                  {"pattern", {{"Regex", tokenizer_internal::kQwen2Regex}}},
                                                  {"behavior", "Isolated"}},
                                                 {{"type", "ByteLevel"}, {"use_regex", false}}})}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  auto r = tokenizer_internal::parse_hf_tokenizer_json(j.dump(), "qwen.json");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  auto& tok = *r;
  EXPECT_EQ(tok->eos_id(), 257);
  const std::string text = apply_chat_template(ChatTemplate::kQwen, {{"user", "Hi"}});
  auto ids = tok->encode(text, /*add_bos=*/false, /*parse_special=*/true);
  ASSERT_TRUE(ids.is_ok());
  const std::vector<TokenId> want = {256, 'u', 's', 'e', 'r', '\n', 'H', 'i', 257, '\n', 256,
                                     'a', 's', 's', 'i', 's', 't',      'a', 'n', 't', '\n'};
  EXPECT_EQ(*ids, want);
}

}  // namespace
}  // namespace specontext
