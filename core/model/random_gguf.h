// Random-weight GGUF files with llama.cpp's mixed "file types" (llama_ftype): the per-tensor type
// choice `llama_model_quantize` makes for Q4_K_M and Q5_K_M (llama.cpp src/llama-quant.cpp,
// llama_tensor_get_type), so that decode benchmarks run on files shaped like the common
// downloads. Random weights: speed, never quality. write_random_gguf (synthetic.h) writes one
// type for every matrix; this header is apart so that adding it rebuilt only synthetic.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/model/model.h"

namespace specontext {

enum class GgufMix {
  kQ4_K_M,  // LLAMA_FTYPE_MOSTLY_Q4_K_M = 15: Q4_K, some tensors Q6_K
  kQ5_K_M,  // LLAMA_FTYPE_MOSTLY_Q5_K_M = 17: Q5_K, some tensors Q6_K
};

// "q4_k_m" / "q5_k_m" (case as written), else nullopt.
std::optional<GgufMix> gguf_mix_from_name(std::string_view name);
std::string_view gguf_mix_name(GgufMix mix);
// The llama_ftype value written to general.file_type: 15 (Q4_K_M), 17 (Q5_K_M).
uint32_t gguf_mix_file_type(GgufMix mix);

// llama.cpp's use_more_bits: the first and last eighth of the layers and every third between.
bool gguf_mix_use_more_bits(int64_t layer, int64_t n_layers);

// The type of matrix `name` (GGUF tensor names as write_random_gguf writes them: token_embd.weight,
// output.weight, blk.N.attn_q/k/v/output.weight, blk.N.ffn_gate/up/down.weight) in a `mix` file of
// `config`'s shapes, by llama_tensor_get_type's rules for a dense llama-architecture model:
// - output.weight, or token_embd.weight when the embeddings are tied (there is no output.weight):
//   Q6_K (Q8_0 when its rows are not whole 256-element blocks);
// - blk.N.attn_v.weight and blk.N.ffn_down.weight: Q6_K where use_more_bits(N, n_layers);
// - everything else (an untied token_embd included): the mix's base type, Q4_K or Q5_K.
// Not modelled (no such synthetic shape): the 70B attn_v bump to Q5_K, the 8-expert rules, and the
// Q5_0 / Q5_1 / Q8_0 fallbacks for k-quant matrices whose rows are not whole blocks (the writer
// refuses those shapes instead).
DType gguf_mix_tensor_type(GgufMix mix, const ModelConfig& config, const std::string& name);

// write_random_gguf's file with each matrix of gguf_mix_tensor_type's type and general.file_type
// set to gguf_mix_file_type (general.quantization_version 2, as llama.cpp writes). Weights drawn as
// write_random_gguf draws them for each type. kInvalidArgument when a matrix's rows are not whole
// 256-element blocks.
Status write_random_gguf_mix(const std::string& path, const ModelConfig& config, GgufMix mix, uint64_t seed);

}  // namespace specontext
