// Reads llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf.inp / .out).
#pragma once

#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/base/ids.h"
#include "tests/tests_common.h"

namespace specontext::testing {

// .inp: cases separated by "\n__ggml_vocab_test__\n" (the file ends with one), as llama.cpp's
// test-tokenizer-0 splits it. .out: one line of space-separated ids per case (no BOS).
inline std::vector<std::pair<std::string, std::vector<TokenId>>> read_vocab_tests(
    const std::string& inp_path, const std::string& out_path) {
  const std::string inp = read_text_file(inp_path);
  const std::string out = read_text_file(out_path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  size_t pos = 0;
  while (pos < inp.size()) {
    const size_t at = inp.find(sep, pos);
    if (at == std::string::npos) {
      texts.push_back(inp.substr(pos));
      break;
    }
    texts.push_back(inp.substr(pos, at - pos));
    pos = at + sep.size();
  }
  std::vector<std::vector<TokenId>> ids;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream in(line);
    std::vector<TokenId> row;
    TokenId id;
    while (in >> id) row.push_back(id);
    ids.push_back(std::move(row));
  }
  std::vector<std::pair<std::string, std::vector<TokenId>>> cases;
  for (size_t i = 0; i < texts.size() && i < ids.size(); ++i) cases.emplace_back(texts[i], ids[i]);
  if (texts.size() != ids.size()) cases.clear();  // malformed files: the caller checks the count
  return cases;
}

}  // namespace specontext::testing
