// libFuzzer target for the tokenizers. The first input byte picks a mode, the rest is either
// text to encode with a fixed tokenizer or a vocabulary file to parse and then use:
//   0 llama2.c encode (synthetic vocab, or models/stories260K/tok512.bin when
//     SPECONTEXT_SOURCE_DIR is set in the environment), round trip checked
//   1 SentencePiece encode (synthetic vocab), round trip checked
//   2 byte-level BPE encode (in-memory Llama-3 style tokenizer.json), round trip checked
//   3 the input as a llama2.c tokenizer.bin
//   4 the input as a tokenizer.json
//   5 the input as a GGUF file holding a vocabulary
//   6 the input as lines of an SPM vocabulary ("<type digit><piece>")
//   7 the input as lines of a BPE vocabulary (line 0: pre-tokenizer regex, then pieces)
// Invariants: no crash, no sanitizer report, ids within the vocabulary, exact round trips
// where the tokenizer is lossless.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/mapped_file.h"
#include "core/model/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_internal.h"

namespace {

using namespace specontext;  // NOLINT
namespace ti = specontext::tokenizer_internal;

constexpr std::string_view kSample =
    "Once upon a time, the cat sat.\n  Lily's 12345 日本語 🙂 \xff\xc3<|eot_id|><s> ▁x";

[[noreturn]] void fail(const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_tokenizer: %s (%zu bytes of text)\n", what, text.size());
  std::abort();
}

void check_ids(const Tokenizer& tok, const std::vector<TokenId>& ids, std::string_view text) {
  for (TokenId id : ids) {
    if (id < 0 || id >= tok.vocab_size()) fail("id out of range", text);
  }
}

// Encodes, checks the ids, decodes token by token (the decoded text is only exercised).
void exercise(const Tokenizer& tok, std::string_view text, bool bos, bool special) {
  auto ids = tok.encode(text, bos, special);
  if (!ids.is_ok()) return;  // e.g. a hostile regex hitting the match limit
  check_ids(tok, *ids, text);
  (void)tok.decode(*ids);
  (void)tok.stop_ids();
  (void)tok.piece_to_id(text);
}

void round_trip(const Tokenizer& tok, std::string_view text, bool bos) {
  auto ids = tok.encode(text, bos, /*parse_special=*/false);
  if (!ids.is_ok()) fail("encode failed", text);
  check_ids(tok, *ids, text);
  if (tok.decode(*ids) != text) fail("decode(encode(x)) != x", text);
}

std::string llama2c_image() {
  std::vector<std::pair<std::string, float>> v = {{"<unk>", 0}, {"\n<s>\n", 0}, {"\n</s>\n", 0}};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.emplace_back(buf, 0);
  }
  float s = 0;
  for (const char* p : {" ",  "a",   "b",    "ab", " a", " b",   "t",    "h",  "e",  "th",
                        "he", "the", " the", " t", "é",  "日本", "\xff", "  ", "ba", "aba"}) {
    v.emplace_back(p, s -= 1);
  }
  int32_t max_len = 8;
  std::string out(reinterpret_cast<const char*>(&max_len), 4);
  for (const auto& [piece, score] : v) {
    const auto len = static_cast<int32_t>(piece.size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += piece;
  }
  return out;
}

std::unique_ptr<Tokenizer> make_llama2c() {
  const std::string img = llama2c_image();
  auto r = ti::parse_llama2c_tokenizer(reinterpret_cast<const uint8_t*>(img.data()), img.size(), 279,
                                       "synthetic.bin");
  if (!r.is_ok()) fail("synthetic llama2.c vocab", r.status().message());
  return std::move(r).value();
}

std::unique_ptr<Tokenizer> make_llama2c_from_repo() {
  const char* dir = std::getenv("SPECONTEXT_SOURCE_DIR");
  if (dir == nullptr) return nullptr;
  auto r = load_llama2c_tokenizer(std::string(dir) + "/models/stories260K/tok512.bin", 512);
  return r.is_ok() ? std::move(r).value() : nullptr;
}

std::unique_ptr<Tokenizer> make_spm() {
  ti::SpmVocab v;
  v.source = "synthetic-spm";
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.tokens.emplace_back(buf);
    v.types.push_back(6);
  }
  for (const char* p :
       {"\xE2\x96\x81", "a", "b", "ab",
        "\xE2\x96\x81"
        "a",
        "t", "h", "e", "th", "the", "\xE2\x96\x81the", "é", "日本", "<", "s", ">", "<s", "[U]"}) {
    v.tokens.emplace_back(p);
    v.types.push_back(std::string_view(p) == "[U]" ? 4 : 1);
  }
  v.types[v.types.size() - 5] = 5;  // "<" unused: exercises re-segmentation
  v.scores.resize(v.tokens.size());
  for (size_t i = 0; i < v.scores.size(); ++i) v.scores[i] = -static_cast<float>(i % 7);
  v.bos = 1, v.eos = 2, v.unk = 0;
  auto r = ti::make_spm_tokenizer(v);
  if (!r.is_ok()) fail("synthetic spm vocab", r.status().message());
  return std::move(r).value();
}

std::string byte_char(int b) {
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int i = 0; i < b; ++i) {
      if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174)) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  ti::append_utf8(s, static_cast<uint32_t>(cp));
  return s;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      o += buf;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o;
}

// Llama-3 style tokenizer.json: 256 byte characters, a few merges, special tokens.
std::string bpe_json() {
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    vocab += "\"" + json_escape(byte_char(b)) + "\": " + std::to_string(b) + ",";
  }
  const std::string sp = byte_char(' ');
  vocab += "\"" + sp + "t\": 256, \"he\": 257, \"" + sp + "the\": 258, \"" + sp + "th\": 259, \"" + sp + sp +
           "\": 260";
  const std::string merges = "[\"" + sp + " t\", \"h e\", [\"" + sp + "t\", \"h\"], [\"" + sp +
                             "th\", \"e\"], [\"" + sp + "\", \"" + sp + "\"]]";
  return std::string(R"({"added_tokens": [
      {"id": 261, "content": "<|begin_of_text|>", "special": true},
      {"id": 262, "content": "<|eot_id|>", "special": true},
      {"id": 263, "content": "<|eot_id|><|eot_id|>", "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": ")") +
         json_escape(ti::kLlama3Regex) + R"("}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "ignore_merges": true, "vocab": {)" +
         vocab + "}, \"merges\": " + merges + "}}";
}

std::unique_ptr<Tokenizer> make_bpe() {
  auto r = ti::parse_hf_tokenizer_json(bpe_json(), "synthetic.json");
  if (!r.is_ok()) fail("synthetic tokenizer.json", r.status().message());
  return std::move(r).value();
}

std::vector<std::string_view> lines(std::string_view s) {
  std::vector<std::string_view> out;
  while (!s.empty() && out.size() < 512) {
    const size_t nl = s.find('\n');
    out.push_back(s.substr(0, nl));
    if (nl == std::string_view::npos) break;
    s.remove_prefix(nl + 1);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto l2c = make_llama2c();
  static const auto l2c_repo = make_llama2c_from_repo();
  static const auto spm = make_spm();
  static const auto bpe = make_bpe();
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool flag = (mode & 0x80) != 0;
  switch (mode & 7) {
    case 0:
      round_trip(*l2c, rest, flag);
      if (l2c_repo) exercise(*l2c_repo, rest, flag, false);
      break;
    case 1:
      // U+2581 decodes as a space; the user-defined "[U]" gets a dummy-prefix space after it.
      if (rest.find("\xE2\x96\x81") == std::string_view::npos && rest.find("[U]") == std::string_view::npos) {
        round_trip(*spm, rest, flag);
      }
      exercise(*spm, rest, flag, true);
      break;
    case 2:
      round_trip(*bpe, rest, flag);
      exercise(*bpe, rest, flag, true);
      break;
    case 3: {
      if (rest.size() < 2) break;
      const int32_t vocab = 1 + (static_cast<uint8_t>(rest[0]) | (static_cast<uint8_t>(rest[1]) << 8));
      auto r = ti::parse_llama2c_tokenizer(reinterpret_cast<const uint8_t*>(rest.data() + 2), rest.size() - 2,
                                           vocab, "fuzz.bin");
      if (r.is_ok()) exercise(**r, kSample, flag, false);
      break;
    }
    case 4: {
      auto r = ti::parse_hf_tokenizer_json(rest, "fuzz.json", flag ? "{\"add_bos_token\": true}" : "",
                                           "fuzz_config.json");
      if (r.is_ok()) {
        exercise(**r, kSample, true, flag);
        exercise(**r, rest.substr(0, 256), false, !flag);
      }
      break;
    }
    case 5: {
      auto g = GgufFile::parse(reinterpret_cast<const uint8_t*>(rest.data()), rest.size(), "fuzz.gguf");
      if (!g.is_ok()) break;
      auto r = load_gguf_tokenizer(**g);
      if (r.is_ok()) exercise(**r, kSample, flag, true);
      break;
    }
    case 6: {
      ti::SpmVocab v;
      v.source = "fuzz-spm";
      for (std::string_view line : lines(rest)) {
        if (line.empty()) continue;
        v.types.push_back(static_cast<int32_t>(static_cast<uint8_t>(line[0]) % 8));
        v.tokens.emplace_back(line.substr(1));
        v.scores.push_back(static_cast<float>(static_cast<int8_t>(line[0])));
      }
      v.bos = 1, v.eos = 2, v.unk = 0;
      v.add_space_prefix = flag;
      auto r = ti::make_spm_tokenizer(std::move(v));
      if (r.is_ok()) {
        exercise(**r, kSample, true, true);
        exercise(**r, rest.substr(0, 128), false, false);
      }
      break;
    }
    case 7: {
      const auto ls = lines(rest);
      if (ls.empty()) break;
      ti::BpeVocab v;
      v.source = "fuzz-bpe";
      v.pre_steps = {{ti::PreTokenizeStep::kRegexSplit, std::string(ls[0]), "line 0"}};
      if (flag) v.pre_steps.push_back({ti::PreTokenizeStep::kPrefixSpace, "", "flag"});
      for (size_t i = 1; i < ls.size(); ++i) {
        v.tokens.emplace_back(ls[i]);
        if (i >= 2) v.merges.emplace_back(std::string(ls[i - 1]), std::string(ls[i]));
      }
      for (int b = 0; b < 256; ++b) v.tokens.push_back(byte_char(b));
      v.types.assign(v.tokens.size(), 1);
      if (v.types.size() > 2) v.types[1] = 3, v.types[2] = 4;
      v.ignore_merges = flag;
      v.bos = 0, v.eos = 1, v.unk = 2;
      auto r = ti::make_bpe_tokenizer(std::move(v));
      if (r.is_ok()) {
        exercise(**r, kSample, true, true);
        exercise(**r, rest.substr(0, 128), false, flag);
      }
      break;
    }
  }
  return 0;
}
