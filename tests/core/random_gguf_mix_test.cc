// Q4_K_M / Q5_K_M random-weight files (core/model/random_gguf.h, bench_random_gguf --type q4_k_m):
// the per-tensor types follow llama.cpp's llama_tensor_get_type (checked against layer lists
// written out by hand from its use_more_bits rule), the file says its llama_ftype, loads with each
// matrix of its own type kept as stored, and the engine decodes it on the CPU backend with the
// logits of the dequantised f32 model within the tolerances of quantized_model_test.cc (prefill
// 1e-5: the same products in another order; decode 6e-2: quant_gemv's 8-bit activations).
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/ggml_quants.h"
#include "core/model/gguf.h"
#include "core/model/model_loader.h"
#include "core/model/random_gguf.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "tests/core/engine_logits_util.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

const char* const kLayerMatrices[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};

// The layers whose attn_v and ffn_down llama.cpp raises to Q6_K, written out by hand:
// n/8 first layers, from 7n/8 on, and every third layer between starting at n/8 + 2.
const std::map<int64_t, std::set<int64_t>> kMoreBitsLayers = {
    {1, {0}},                                   // 1/8 = 0, 7/8 = 0: every layer is >= 0
    {2, {1}},                                   // 14/8 = 1
    {4, {2, 3}},                                // 28/8 = 3; (2 - 0) % 3 == 2
    {8, {0, 3, 6, 7}},                          // 1; 7; 1 + 2, 1 + 5
    {16, {0, 1, 4, 7, 10, 13, 14, 15}},         // Llama-3.2-1B: 2; 14; 4, 7, 10, 13
    {32, {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}},  // Llama-3.1-8B: 4; 28; 6..27
};

TEST(RandomGgufMix, TensorTypesFollowLlamaCppsRules) {
  for (GgufMix mix : {GgufMix::kQ4_K_M, GgufMix::kQ5_K_M}) {
    const DType base = mix == GgufMix::kQ4_K_M ? DType::kQ4_K : DType::kQ5_K;
    for (const auto& [n, more] : kMoreBitsLayers) {
      for (bool tied : {true, false}) {
        SCOPED_TRACE(std::string(gguf_mix_name(mix)) + " layers " + std::to_string(n) + (tied ? " tied" : " untied"));
        const ModelConfig c = testing::small_block_config(n, tied);
        int64_t raised = 0;
        for (int64_t l = 0; l < n; ++l) {
          EXPECT_EQ(gguf_mix_use_more_bits(l, n), more.count(l) == 1) << "layer " << l;
          for (const char* m : kLayerMatrices) {
            const std::string name = "blk." + std::to_string(l) + "." + m + ".weight";
            const bool v_or_down = std::string(m) == "attn_v" || std::string(m) == "ffn_down";
            const DType want = v_or_down && more.count(l) ? DType::kQ6_K : base;
            EXPECT_EQ(gguf_mix_tensor_type(mix, c, name), want) << name;
            raised += want == DType::kQ6_K;
          }
        }
        EXPECT_EQ(raised, 2 * static_cast<int64_t>(more.size()));
        // Tied: the embedding is the output and takes its Q6_K; untied: output Q6_K, embedding base.
        EXPECT_EQ(gguf_mix_tensor_type(mix, c, "token_embd.weight"), tied ? DType::kQ6_K : base);
        EXPECT_EQ(gguf_mix_tensor_type(mix, c, "output.weight"), DType::kQ6_K);
      }
    }
  }
  // Llama-3.2-1B and 3.1-8B (16 / 32 layers): half of attn_v and ffn_down raised.
  EXPECT_EQ(kMoreBitsLayers.at(16).size(), 8u);
  EXPECT_EQ(kMoreBitsLayers.at(32).size(), 16u);
  EXPECT_EQ(gguf_mix_from_name("q4_k_m"), GgufMix::kQ4_K_M);
  EXPECT_EQ(gguf_mix_from_name("q5_k_m"), GgufMix::kQ5_K_M);
  EXPECT_FALSE(gguf_mix_from_name("q4_k").has_value());
  EXPECT_EQ(gguf_mix_file_type(GgufMix::kQ4_K_M), 15u);
  EXPECT_EQ(gguf_mix_file_type(GgufMix::kQ5_K_M), 17u);
}

std::string write_mix(GgufMix mix, int64_t layers, bool tied) {
  const std::string path = testing::temp_dir("random_gguf_mix") + "/" + std::string(gguf_mix_name(mix)) + "_" +
                           std::to_string(layers) + (tied ? "t" : "u") + ".gguf";
  const Status s = write_random_gguf_mix(path, testing::small_block_config(layers, tied), mix, 7);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return path;
}

TEST(RandomGgufMix, FileHoldsEachTensorOfItsTypeAndSaysItsFileType) {
  for (GgufMix mix : {GgufMix::kQ4_K_M, GgufMix::kQ5_K_M}) {
    for (bool tied : {true, false}) {
      SCOPED_TRACE(std::string(gguf_mix_name(mix)) + (tied ? " tied" : " untied"));
      const int64_t layers = 4;
      const ModelConfig c = testing::small_block_config(layers, tied);
      const std::string path = write_mix(mix, layers, tied);
      // The file itself: general.file_type and every tensor's ggml type.
      auto file = GgufFile::open(path);
      ASSERT_TRUE(file.is_ok()) << file.status().to_string();
      auto ft = (*file)->get_int("general.file_type");
      ASSERT_TRUE(ft.is_ok()) << ft.status().to_string();
      EXPECT_EQ(*ft, static_cast<int64_t>(gguf_mix_file_type(mix)));
      EXPECT_EQ(*(*file)->get_int("general.quantization_version"), 2);
      std::map<DType, int64_t> want;
      for (const auto& t : (*file)->tensors()) {
        if (t.dims.size() == 1) {
          EXPECT_EQ(t.ggml_type, 0u) << t.name;  // norms stay f32
          continue;
        }
        const DType d = gguf_mix_tensor_type(mix, c, t.name);
        EXPECT_EQ(t.ggml_type, *ggml_block_type_id(d)) << t.name;
        ++want[d];
      }
      const DType base = mix == GgufMix::kQ4_K_M ? DType::kQ4_K : DType::kQ5_K;
      // 4 layers: attn_v and ffn_down of layers 2 and 3, and the output (tied: the embedding).
      EXPECT_EQ(want, (std::map<DType, int64_t>{{base, tied ? 24 : 25}, {DType::kQ6_K, 5}}));
      // The loader keeps each matrix as stored and reports the mix.
      auto kept = testing::load_kept_or_dequantised(path, true);
      auto plain = testing::load_kept_or_dequantised(path, false);
      ASSERT_TRUE(kept && plain);
      EXPECT_TRUE(kept->validate().is_ok());
      EXPECT_EQ(kept->held_types(), want);
      EXPECT_EQ(kept->lm_head.dtype, DType::kQ6_K);
      EXPECT_EQ(kept->tok_embeddings.dtype, tied ? DType::kQ6_K : base);
      for (int64_t l = 0; l < layers; ++l) {
        const DType raised = (l == 2 || l == 3) ? DType::kQ6_K : base;
        EXPECT_EQ(kept->layers[l].wv.dtype, raised) << "layer " << l;
        EXPECT_EQ(kept->layers[l].w_down.dtype, raised) << "layer " << l;
        EXPECT_EQ(kept->layers[l].wq.dtype, base) << "layer " << l;
        EXPECT_EQ(kept->layers[l].w_gate.dtype, base) << "layer " << l;
      }
      // Each kept matrix decodes to exactly what the dequantising load gives.
      const auto km = kept->matrices();
      const auto pm = plain->matrices();
      ASSERT_EQ(km.size(), pm.size());
      for (size_t i = 0; i < km.size(); ++i) {
        std::vector<float> decoded(static_cast<size_t>(km[i]->rows * km[i]->cols));
        ASSERT_TRUE(ggml_dequantize(*ggml_block_type_id(km[i]->dtype), km[i]->data, decoded.data(),
                                    static_cast<int64_t>(decoded.size()))
                        .is_ok());
        EXPECT_EQ(std::memcmp(decoded.data(), pm[i]->data, decoded.size() * 4), 0) << "matrix " << i;
      }
    }
  }
}

TEST(RandomGgufMix, RowsMustBeWholeSuperBlocks) {
  ModelConfig c = testing::small_block_config(2, true);
  c.dim = 96;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 48;
  const Status s = write_random_gguf_mix(testing::temp_dir("random_gguf_mix") + "/bad.gguf", c, GgufMix::kQ4_K_M, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
}

TEST(RandomGgufMix, EngineDecodesTheMixLikeTheDequantisedF32Model) {
  const std::vector<TokenId> prompt = {1,  5,  9,  17, 33, 2,  64, 80, 12, 7,  44, 91,
                                       3,  8,  27, 55, 60, 71, 19, 23, 38, 47, 88, 95};
  const std::vector<TokenId> decode_ids = {13, 42, 77, 6};
  auto backend_or = cpu::CpuBackend::create(cpu::CpuBackendOptions{.num_threads = 2});
  ASSERT_TRUE(backend_or.is_ok());
  std::shared_ptr<Backend> backend(std::move(*backend_or));
  for (GgufMix mix : {GgufMix::kQ4_K_M, GgufMix::kQ5_K_M}) {
    SCOPED_TRACE(std::string(gguf_mix_name(mix)));
    // 2 layers, as quantized_model_test.cc's tolerance was measured on: layer 1 raised to Q6_K.
    const std::string path = write_mix(mix, 2, true);
    EngineOptions eo;
    eo.max_sequences = 1;
    eo.page_size = 16;
    auto kept = Engine::create(testing::load_kept_or_dequantised(path, true), backend, eo);
    auto plain = Engine::create(testing::load_kept_or_dequantised(path, false), backend, eo);
    ASSERT_TRUE(kept.is_ok() && plain.is_ok());
    const DType base = mix == GgufMix::kQ4_K_M ? DType::kQ4_K : DType::kQ5_K;
    // The engine runs the blocks as stored: 12 base matrices, attn_v + ffn_down of layer 1 and
    // the tied embedding in Q6_K.
    EXPECT_EQ((*kept)->model().held_types(), (std::map<DType, int64_t>{{base, 12}, {DType::kQ6_K, 3}}));
    const testing::PromptLogits q = testing::prompt_then_decode_logits(**kept, prompt, decode_ids);
    const testing::PromptLogits f = testing::prompt_then_decode_logits(**plain, prompt, decode_ids);
    ASSERT_EQ(q.prefill.size(), prompt.size() * 96u);
    ASSERT_EQ(q.prefill.size(), f.prefill.size());
    ASSERT_EQ(q.decode.size(), decode_ids.size() * 96u);
    ASSERT_EQ(q.decode.size(), f.decode.size());
    EXPECT_LT(testing::rel_l2(q.prefill, f.prefill), 1e-5);
    const double decode_err = testing::rel_l2(q.decode, f.decode);
    EXPECT_LT(decode_err, 6e-2);
    EXPECT_GT(decode_err, 0.0) << "decode took the dequantised path, not quant_gemv";
    std::printf("%s: prefill rel-L2 %.2e, decode rel-L2 %.2e\n", std::string(gguf_mix_name(mix)).c_str(),
                testing::rel_l2(q.prefill, f.prefill), decode_err);
  }
}

}  // namespace
}  // namespace specontext
