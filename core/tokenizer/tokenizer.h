// Tokenizer interface. Implementations: llama2.c tokenizer.bin, SentencePiece BPE (GGUF vocab),
// byte-level BPE (HF tokenizer.json or GGUF gpt2 vocab). Created through load_tokenizer* below.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"

namespace specontext {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string_view kind() const = 0;  // "llama2c", "spm", "bpe"
  virtual int32_t vocab_size() const = 0;
  virtual TokenId bos_id() const = 0;         // -1 when the vocabulary has none
  virtual TokenId eos_id() const = 0;
  // Extra ids that end generation (e.g. <|eot_id|>, <|im_end|>), eos included.
  virtual std::vector<TokenId> stop_ids() const = 0;
  // Encodes text; BOS is prepended when add_bos and the vocabulary has one.
  // Special tokens written in the text (e.g. "<|im_start|>") are recognised when parse_special.
  virtual Result<std::vector<TokenId>> encode(std::string_view text, bool add_bos,
                                              bool parse_special = false) const = 0;
  // The raw bytes of one token as it appears in decoded text; `prev` is the previous token
  // (llama2.c strips the leading space after BOS). Bytes may be a partial UTF-8 sequence.
  // prev < 0 means start of text and is treated like BOS (the SentencePiece dummy-prefix space
  // is stripped). Control tokens (BOS, EOS, <|eot_id|>, ...) decode to nothing.
  virtual std::string decode_token(TokenId prev, TokenId id) const = 0;
  // Decodes a whole sequence (no BOS stripping subtleties beyond the above).
  std::string decode(const std::vector<TokenId>& ids) const;
  // Looks up a token by its exact piece text; -1 when absent.
  virtual TokenId piece_to_id(std::string_view piece) const = 0;
  // Whether the vocabulary asks for BOS at the start of a prompt (GGUF tokenizer.ggml.add_bos_token,
  // tokenizer.json post-processor / tokenizer_config.json add_bos_token, llama.cpp defaults).
  virtual bool add_bos_by_default() const { return bos_id() >= 0; }
};

// llama2.c tokenizer.bin (vocab_size must be given: the file does not store it).
Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path, int32_t vocab_size);
// HF tokenizer.json (byte-level BPE: Llama-3, Qwen2/3, GPT-2 families).
Result<std::unique_ptr<Tokenizer>> load_hf_tokenizer(const std::string& path);

// Chat templates (hard-coded per family; see core/README.md).
enum class ChatTemplate { kNone, kLlama3, kQwen, kDeepSeekR1 };
// Whether the template renders function tools offered with a request (kDeepSeekR1 has no place
// for them; kNone renders no chat at all).
bool chat_template_renders_tools(ChatTemplate t);
// The family a model's vocabulary and architecture ("llama", "qwen2", ...) belong to: DeepSeek-R1
// when its <｜User｜> and <｜Assistant｜> tokens exist (its distills keep their base's other
// markers), else Qwen for the qwen architectures or a vocabulary with <|im_start|>, else Llama 3
// with <|start_header_id|>, else kNone.
ChatTemplate chat_template_of(const Tokenizer& tok, std::string_view architecture);
// The template family's name: "llama3", "qwen", "deepseek-r1", "none".
std::string_view chat_template_name(ChatTemplate t);
// A function call an assistant turn made; arguments is JSON text (an object, as OpenAI sends it).
struct ChatToolCall {
  std::string name;
  std::string arguments;
};
struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool"
  std::string content;
  std::vector<ChatToolCall> tool_calls = {};  // assistant turns only
};
// Renders messages and the assistant generation prompt.
std::string apply_chat_template(ChatTemplate t, const std::vector<ChatMessage>& messages);
// The same with function tools offered to the model: each of `tools` is one OpenAI tool object as
// JSON text ({"type": "function", "function": {...}}), rendered as the family's own template
// does (Qwen: Hermes <tools>/<tool_call>/<tool_response> blocks; Llama 3.1: the JSON functions in
// the first user message, calls as {"name", "parameters"}, results as ipython turns). kNone
// ignores tools. With no tools this equals the two-argument form.
std::string apply_chat_template(ChatTemplate t, const std::vector<ChatMessage>& messages,
                                const std::vector<std::string>& tools);
// The calls a model wrote in its family's own syntax, for tool_choice "auto" (as vLLM's hermes
// and llama3_json parsers): kQwen, <tool_call>{"name", "arguments"}</tool_call> blocks (the last
// may be unterminated) with the text before the first, less its trailing white space, as content;
// kLlama3, a reply that is [<|python_tag|>] {"name", "parameters"|"arguments"} objects separated
// by ';', with no content. When the text holds no call, or any call is malformed, calls is empty
// and content is the text.
struct ParsedToolCalls {
  std::string content;
  std::vector<ChatToolCall> calls;  // arguments as JSON text
};
ParsedToolCalls parse_tool_calls(ChatTemplate t, std::string_view text);
// JSON text re-written on one line as Jinja's tojson writes it (Python's json.dumps: ", " and ": "
// separators, keys in their order), the form tool-call arguments take; text that is not JSON is
// returned as it is.
std::string tojson_line(std::string_view json_text);
// For streaming under tool_choice "auto": the length of the longest prefix of `text` (a reply
// still being generated) that starts parse_tool_calls(t, text + rest).content for every `rest`,
// so it may be sent as content now. What follows it is held back: on kQwen from the first
// <tool_call> (or a partial one at the end) and the white space before it; on kLlama3 the whole
// reply while it is, or may become, a call (it starts with '{' or <|python_tag|>). Never decreases
// as the text grows. `released`: what it returned for a shorter prefix of the same text (or 0);
// the search resumes there, so a stream that passes it back costs time linear in its length.
size_t tool_call_content_prefix(ChatTemplate t, std::string_view text, size_t released = 0);

}  // namespace specontext

namespace specontext {
class GgufFile;
// Tokenizer from a GGUF vocabulary: tokenizer.ggml.model "llama" (SentencePiece BPE with byte
// fallback) or "gpt2" (byte-level BPE with merges).
Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const GgufFile& gguf);
}  // namespace specontext
