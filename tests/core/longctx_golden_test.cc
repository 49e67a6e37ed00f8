// The bundled long-context model (models/longctx) against its training script's own PyTorch
// forward (float64): logits at positions up to the full 8192-token context, for the HF
// safetensors and the GGUF copies, and the script's tokenization of sample texts for both
// tokenizers (tokenizer.json and the GGUF vocabulary).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

using testing::read_text_file;
using testing::repo_path;

template <typename T>
std::vector<T> read_le(const std::string& path) {
  const std::string bytes = read_text_file(path);
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

class LongCtxGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(LongCtxGolden, LogitsMatchThePyTorchForwardAcrossTheWholeContext) {
  const auto meta = nlohmann::json::parse(read_text_file(repo_path("models/longctx/golden/golden.json")));
  const auto ids = read_le<int32_t>(repo_path("models/longctx/golden/ids_i32le.bin"));
  const auto golden = read_le<float>(repo_path("models/longctx/golden/logits_f32le.bin"));
  const auto positions = meta["positions"].get<std::vector<int64_t>>();
  const size_t vocab = meta["vocab_size"].get<size_t>();
  ASSERT_EQ(ids.size(), meta["n_tokens"].get<size_t>());
  ASSERT_EQ(golden.size(), positions.size() * vocab);

  auto m = load_model(repo_path(GetParam()));
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  EXPECT_GE((*m)->config.max_seq_len, static_cast<int64_t>(ids.size()));
  EXPECT_EQ((*m)->config.rope_theta, 1e8);
  auto b = cpu::create_cpu_backend(cpu::CpuBackendOptions{});
  ASSERT_TRUE(b.is_ok());
  EngineOptions eo;
  eo.max_sequences = 1;
  eo.max_context = static_cast<int64_t>(ids.size());
  auto e = Engine::create(*m, std::shared_ptr<Backend>(std::move(*b)), eo);
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  auto seq = (*e)->memory().add_sequence();
  ASSERT_TRUE(seq.is_ok());
  std::vector<float> at_positions(golden.size());
  const size_t chunk = 1024;
  for (size_t off = 0; off < ids.size(); off += chunk) {
    const size_t n = std::min(chunk, ids.size() - off);
    StepRequest r{*seq, std::span<const TokenId>(ids.data() + off, n), LogitsMode::kAll};
    auto out = (*e)->forward(std::span<const StepRequest>(&r, 1));
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
    for (size_t k = 0; k < positions.size(); ++k) {
      const size_t p = static_cast<size_t>(positions[k]);
      if (p >= off && p < off + n) {
        std::memcpy(at_positions.data() + k * vocab, out->logits.data() + (p - off) * vocab, vocab * sizeof(float));
      }
    }
  }
  for (size_t k = 0; k < positions.size(); ++k) {
    const double err = rel_l2(at_positions.data() + k * vocab, golden.data() + k * vocab, vocab);
    EXPECT_LT(err, 1e-4) << "position " << positions[k];
  }
}

TEST_P(LongCtxGolden, TokenizerEncodesAsTheTrainingScript) {
  auto m = load_model(repo_path(GetParam()));
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  auto tok = load_tokenizer_for(**m, "");
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  EXPECT_TRUE((*tok)->add_bos_by_default());
  EXPECT_EQ((*tok)->bos_id(), (*tok)->piece_to_id("<|endoftext|>"));
  const auto cases = nlohmann::json::parse(read_text_file(repo_path("models/longctx/golden/tokenizer.json")));
  ASSERT_GE(cases.size(), 3u);
  for (const auto& c : cases) {
    auto got = (*tok)->encode(c["text"].get<std::string>(), /*add_bos=*/false, /*parse_special=*/true);
    ASSERT_TRUE(got.is_ok());
    EXPECT_EQ(*got, c["ids"].get<std::vector<TokenId>>()) << c["text"].get<std::string>().substr(0, 60);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, LongCtxGolden, ::testing::Values("models/longctx/hf", "models/longctx/longctx.gguf"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param.find(".gguf") != std::string::npos ? std::string("gguf")
                                                                                 : std::string("safetensors");
                         });

}  // namespace
}  // namespace specontext
