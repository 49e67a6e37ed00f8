// GGUF block types kept as stored (LoadOptions::keep_quantized): for each of Q8_0, Q4_0, Q4_K,
// Q5_K and Q6_K, a small random-weight file (write_random_gguf) loads as views of the file whose
// bytes are the file's, decodes to exactly what the dequantising load gives, reports what it
// holds, and runs through the engine on the CPU backend with the logits of the dequantised f32
// model. Backends that cannot run block types (the reference backend, tensor-parallel shards) get
// dequantised matrices, decided by Backend::supports.
//
// Tolerances (logits, rel-L2 over all positions against the dequantised f32 model on the same
// backend):
// - prefill of 24 tokens: every matmul has m = 24 > 16, so the CPU backend dequantises tiles of
//   weight rows and multiplies them in f32: the same products as the f32 model's, summed in
//   another blocking order: 1e-5.
// - decode steps (m = 1): quant_gemv quantises each activation block to 8 bits as ggml's dot
//   products do (|error| ≤ 0.57·amax/127 per element, tests/cpu/quant_gemv_test.cc), through
//   2 layers and the LM head: measured 0.9-3.1% (rel-L2; Q6_K, Q4_K most: their activations
//   share one scale per 256) on these random models; bound 6e-2. Each
//   decode step feeds both engines the same token, so the error cannot compound by diverging
//   text.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/engine/tensor_parallel.h"
#include "core/model/ggml_quants.h"
#include "core/model/model_loader.h"
#include "core/model/synthetic.h"
#include "cpu/cpu_backend.h"
#include "cpu/reference_backend.h"
#include "tests/core/engine_logits_util.h"
#include "tests/tests_common.h"

namespace specontext {
namespace {

constexpr DType kBlockTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

// A random-weight GGUF of `t` in a fresh directory.
std::string write_file(DType t, bool tied = true) {
  const std::string path = testing::temp_dir("quantized_model") + "/" + std::string(dtype_name(t)) + ".gguf";
  const Status s = write_random_gguf(path, testing::small_block_config(2, tied), t, 7);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return path;
}

size_t file_size(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
  return static_cast<size_t>(st.st_size);
}

using testing::rel_l2;

std::shared_ptr<Backend> cpu_backend() {
  auto b = cpu::CpuBackend::create(cpu::CpuBackendOptions{.num_threads = 2});
  EXPECT_TRUE(b.is_ok()) << b.status().to_string();
  return std::shared_ptr<Backend>(std::move(*b));
}

std::unique_ptr<Engine> make_engine(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend) {
  EngineOptions eo;
  eo.max_sequences = 1;
  eo.page_size = 16;
  auto e = Engine::create(std::move(model), std::move(backend), eo);
  EXPECT_TRUE(e.is_ok()) << e.status().to_string();
  return e.is_ok() ? std::move(*e) : nullptr;
}

TEST(QuantizedModel, KeptMatricesAreViewsOfTheFileAndDecodeToTheDequantisedLoad) {
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const std::string path = write_file(t);
    auto kept = testing::load_kept_or_dequantised(path, true);
    auto plain = testing::load_kept_or_dequantised(path, false);
    ASSERT_TRUE(kept && plain);
    EXPECT_TRUE(kept->validate().is_ok());
    const auto km = kept->matrices();
    const auto pm = plain->matrices();
    ASSERT_EQ(km.size(), pm.size());
    ASSERT_EQ(km.size(), 1u + 2u * 7u);  // tied embeddings once
    for (size_t i = 0; i < km.size(); ++i) {
      ASSERT_EQ(km[i]->dtype, t);
      ASSERT_EQ(pm[i]->dtype, DType::kF32);
      ASSERT_EQ(km[i]->bytes(), static_cast<size_t>(km[i]->rows * km[i]->cols / dtype_block_elements(t)) *
                                    dtype_row_bytes(t, dtype_block_elements(t)));
      std::vector<float> decoded(static_cast<size_t>(km[i]->rows * km[i]->cols));
      ASSERT_TRUE(ggml_dequantize(*ggml_block_type_id(t), km[i]->data, decoded.data(),
                                  static_cast<int64_t>(decoded.size()))
                      .is_ok());
      EXPECT_EQ(std::memcmp(decoded.data(), pm[i]->data, decoded.size() * 4), 0) << "matrix " << i;
    }
    EXPECT_EQ(kept->lm_head.data, kept->tok_embeddings.data);
    // Held bytes: the file minus its header and alignment padding (a few KiB here).
    const size_t held = kept->weight_bytes();
    const size_t file = file_size(path);
    EXPECT_LE(held, file);
    EXPECT_GE(held, file - 8192) << "held " << held << " of a " << file << "-byte file";
    EXPECT_EQ(kept->held_types(), (std::map<DType, int64_t>{{t, 15}}));
    EXPECT_NE(kept->weights_held_text().find(std::string(dtype_name(t)) + " 15"), std::string::npos)
        << kept->weights_held_text();
    EXPECT_GT(plain->weight_bytes(), 3 * held);  // f32: 4 bytes a weight against <= 1.07
  }
}

TEST(QuantizedModel, EngineOnTheCpuBackendMatchesTheDequantisedF32Model) {
  const std::vector<TokenId> prompt = {1,  5,  9,  17, 33, 2,  64, 80, 12, 7,  44, 91,
                                       3,  8,  27, 55, 60, 71, 19, 23, 38, 47, 88, 95};
  const std::vector<TokenId> decode_ids = {13, 42, 77, 6};
  for (DType t : kBlockTypes) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const std::string path = write_file(t);
    auto backend = cpu_backend();
    auto kept = make_engine(testing::load_kept_or_dequantised(path, true), backend);
    auto plain = make_engine(testing::load_kept_or_dequantised(path, false), backend);
    ASSERT_TRUE(kept && plain);
    // The engine computes with the blocks as stored: Backend::supports says the CPU runs them.
    EXPECT_EQ(kept->model().held_types(), (std::map<DType, int64_t>{{t, 15}}));
    const testing::PromptLogits q = testing::prompt_then_decode_logits(*kept, prompt, decode_ids);
    const testing::PromptLogits f = testing::prompt_then_decode_logits(*plain, prompt, decode_ids);
    ASSERT_EQ(q.prefill.size(), f.prefill.size());
    ASSERT_EQ(q.prefill.size(), prompt.size() * 96u);
    ASSERT_EQ(q.decode.size(), f.decode.size());
    ASSERT_EQ(q.decode.size(), decode_ids.size() * 96u);
    EXPECT_LT(rel_l2(q.prefill, f.prefill), 1e-5);
    const double decode_err = rel_l2(q.decode, f.decode);
    EXPECT_LT(decode_err, 6e-2);
    EXPECT_GT(decode_err, 0.0) << "decode took the dequantised path, not quant_gemv";
    std::printf("%s: prefill rel-L2 %.2e, decode rel-L2 %.2e\n", std::string(dtype_name(t)).c_str(),
                rel_l2(q.prefill, f.prefill), decode_err);
  }
}

TEST(QuantizedModel, UntiedLmHeadIsKeptToo) {
  const std::string path = write_file(DType::kQ4_K, /*tied=*/false);
  auto kept = testing::load_kept_or_dequantised(path, true);
  ASSERT_TRUE(kept);
  EXPECT_NE(kept->lm_head.data, kept->tok_embeddings.data);
  EXPECT_EQ(kept->lm_head.dtype, DType::kQ4_K);
  EXPECT_EQ(kept->held_types(), (std::map<DType, int64_t>{{DType::kQ4_K, 16}}));
}

TEST(QuantizedModel, BackendsThatCannotRunBlocksGetDequantisedMatrices) {
  const std::string path = write_file(DType::kQ4_K);
  auto kept = testing::load_kept_or_dequantised(path, true);
  auto plain = testing::load_kept_or_dequantised(path, false);
  ASSERT_TRUE(kept && plain);
  // The capability query decides, not the backend's name.
  cpu::ReferenceBackend reference;
  EXPECT_FALSE(reference.supports(BackendOp::kMatmul, DType::kQ4_K));
  auto fitted = fit_weights_to_backend(kept, reference);
  ASSERT_TRUE(fitted.is_ok()) << fitted.status().to_string();
  EXPECT_NE(fitted->get(), kept.get());
  EXPECT_EQ((*fitted)->held_types(), (std::map<DType, int64_t>{{DType::kF32, 15}}));
  EXPECT_EQ((*fitted)->lm_head.data, (*fitted)->tok_embeddings.data);  // still tied, decoded once
  const auto fm = (*fitted)->matrices();
  const auto pm = plain->matrices();
  for (size_t i = 0; i < fm.size(); ++i) {
    EXPECT_EQ(std::memcmp(fm[i]->data, pm[i]->data, pm[i]->bytes()), 0) << "matrix " << i;
  }
  auto cpu = cpu_backend();
  EXPECT_TRUE(cpu->supports(BackendOp::kMatmul, DType::kQ4_K));
  auto same = fit_weights_to_backend(kept, *cpu);
  ASSERT_TRUE(same.is_ok());
  EXPECT_EQ(same->get(), kept.get());

  // An engine on the reference backend runs the dequantised copy and reports it.
  auto ref_shared = std::make_shared<cpu::ReferenceBackend>();
  auto e = make_engine(kept, ref_shared);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->model().held_types(), (std::map<DType, int64_t>{{DType::kF32, 15}}));

  // bf16 plain matrices make the decoded ones bf16 too.
  auto bf16 = dequantize_block_matrices(kept, DType::kBF16, [](DType) { return false; });
  ASSERT_TRUE(bf16.is_ok());
  EXPECT_EQ((*bf16)->held_types(), (std::map<DType, int64_t>{{DType::kBF16, 15}}));
  EXPECT_EQ((*bf16)->weight_dtype, DType::kBF16);
}

TEST(QuantizedModel, TensorParallelShardsHoldDequantisedMatrices) {
  const std::string path = write_file(DType::kQ8_0);
  auto kept = testing::load_kept_or_dequantised(path, true);
  auto plain = testing::load_kept_or_dequantised(path, false);
  ASSERT_TRUE(kept && plain);
  for (int rank = 0; rank < 2; ++rank) {
    auto a = shard_model(kept, rank, 2);
    auto b = shard_model(plain, rank, 2);
    ASSERT_TRUE(a.is_ok()) << a.status().to_string();
    ASSERT_TRUE(b.is_ok());
    EXPECT_EQ((*a)->held_types(), (std::map<DType, int64_t>{{DType::kF32, 15}}));
    const auto am = (*a)->matrices();
    const auto bm = (*b)->matrices();
    ASSERT_EQ(am.size(), bm.size());
    for (size_t i = 0; i < am.size(); ++i) {
      ASSERT_EQ(am[i]->bytes(), bm[i]->bytes());
      EXPECT_EQ(std::memcmp(am[i]->data, bm[i]->data, bm[i]->bytes()), 0) << "rank " << rank << " matrix " << i;
    }
  }
}

TEST(QuantizedModel, WithoutKeepQuantizedTheLoadDequantisesAsBefore) {
  const std::string path = write_file(DType::kQ6_K);
  auto m = load_model(path, LoadOptions{.force_bf16 = true});
  ASSERT_TRUE(m.is_ok());
  EXPECT_EQ((*m)->held_types(), (std::map<DType, int64_t>{{DType::kBF16, 15}}));
  EXPECT_EQ((*m)->stored_types, (std::map<std::string, int64_t>{{"Q6_K", 15}}));  // token_embd + 2 x 7
}

TEST(QuantizedModel, BlockRowsMustBeWholeBlocks) {
  ModelConfig c = testing::small_block_config(2, true);
  c.dim = 96;  // Q4_K rows are 256-element blocks
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 48;
  const std::string path = testing::temp_dir("quantized_model") + "/bad.gguf";
  const Status s = write_random_gguf(path, c, DType::kQ4_K, 1);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  WeightMatrix w{DType::kQ4_K, 4, 100, &c};
  EXPECT_EQ(dtype_row_bytes(DType::kQ4_K, 100), 144u);  // padded to one block, as GGUF stores it
  EXPECT_EQ(w.bytes(), 4u * 144u);
}

}  // namespace
}  // namespace specontext
