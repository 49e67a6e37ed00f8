// Block layouts follow ggml-common.h (block_q4_0 ... block_iq4_xs); the decoding follows
// ggml-quants.c (dequantize_row_*), checked bit for bit against gguf-py's numpy decoder in
// tests/core/ggml_quants_test.cc.
#include "core/model/ggml_quants.h"

#include <cstring>
#include <string>
#include <utility>

#include "core/base/dtype.h"

namespace specontext {

namespace {

constexpr GgmlTypeInfo kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 36},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},
};

constexpr int kQK = 256;  // elements of a k-quant super-block

// The non-linear 4-bit code book of IQ4_NL / IQ4_XS (ggml-common.h kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

float f16_at(const uint8_t* p) {
  uint16_t h = 0;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// 6-bit scale and min j (0..7) of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Sub-blocks j and j + 1 of a Q4_K / Q5_K super-block: their scales times d and mins times dmin.
struct ScaleMinPair {
  float d1, m1, d2, m2;
};
ScaleMinPair scale_min_pair(const uint8_t* scales, int j, float d, float dmin) {
  uint8_t sc = 0, mn = 0;
  ScaleMinPair p{};
  scale_min_k4(j, scales, &sc, &mn);
  p.d1 = d * static_cast<float>(sc);
  p.m1 = dmin * static_cast<float>(mn);
  scale_min_k4(j + 1, scales, &sc, &mn);
  p.d2 = d * static_cast<float>(sc);
  p.m2 = dmin * static_cast<float>(mn);
  return p;
}

// block_q4_0: f16 d; u8 qs[16]. Low nibbles are elements 0..15, high nibbles 16..31.
void q4_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// block_q4_1: f16 d, m; u8 qs[16].
void q4_1(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const float m = f16_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// block_q5_0: f16 d; u8 qh[4] (bit i = fifth bit of element i); u8 qs[16].
void q5_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  uint32_t qh = 0;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
    const int hi1 = static_cast<int>((qh >> (j + 16)) & 1u) << 4;
    y[j] = static_cast<float>(((qs[j] & 0xF) | hi0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | hi1) - 16) * d;
  }
}

// block_q5_1: f16 d, m; u8 qh[4]; u8 qs[16].
void q5_1(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const float m = f16_at(b + 2);
  uint32_t qh = 0;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
    const int hi1 = static_cast<int>((qh >> (j + 16)) & 1u) << 4;
    y[j] = static_cast<float>((qs[j] & 0xF) | hi0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | hi1) * d + m;
  }
}

// block_q8_0: f16 d; i8 qs[32] (core/base/dtype.h, where DType::kQ8_0 tensors use it too).
void q8_0(const uint8_t* b, float* y) { dequantize_q8_0_block(b, y); }

// block_q2_K: u8 scales[16] (low nibble scale, high nibble min); u8 qs[64] (2-bit codes);
// f16 d, dmin.
void q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = f16_at(b + 80);
  const float dmin = f16_at(b + 82);
  int is = 0;
  for (int n = 0; n < kQK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0xF);
        const float ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) {
          *y++ = dl * static_cast<float>((q[l + 16 * half] >> shift) & 3) - ml;
        }
      }
    }
    q += 32;
  }
}

// block_q3_K: u8 hmask[32] (third bit, inverted: a clear bit subtracts 4); u8 qs[64];
// u8 scales[12] (sixteen 6-bit scales, biased by 32); f16 d.
void q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 96;
  const float d = f16_at(b + 108);
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (packed[i] & 0xF) : (packed[i - 8] >> 4);
    const int hi = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    scales[i] = static_cast<int8_t>((lo | (hi << 4)) - 32);
  }
  int is = 0;
  int bit = 0;  // the hmask bit of this run of 32
  for (int n = 0; n < kQK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(scales[is++]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int code = ((q[l] >> shift) & 3) - 4 * (((hm[l] >> bit) & 1) ^ 1);
          *y++ = dl * static_cast<float>(code);
        }
      }
      ++bit;
    }
    q += 32;
  }
}

// block_q4_K: f16 d, dmin; u8 scales[12] (eight 6-bit scales and mins); u8 qs[128].
// block_q5_K: the same, with u8 qh[32] (the fifth bit of each element) before qs.
template <bool kFifthBit>
void q45_k(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const float dmin = f16_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + (kFifthBit ? 48 : 16);
  for (int is = 0; is < 8; is += 2) {  // two runs of 32 (low and high nibbles) per step
    const auto [d1, m1, d2, m2] = scale_min_pair(scales, is, d, dmin);
    for (int l = 0; l < 32; ++l) {
      const int hi = kFifthBit ? ((qh[l] >> is) & 1) << 4 : 0;
      *y++ = d1 * static_cast<float>((ql[l] & 0xF) + hi) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      const int hi = kFifthBit ? ((qh[l] >> (is + 1)) & 1) << 4 : 0;
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + hi) - m2;
    }
    ql += 32;
  }
}

// block_q6_K: u8 ql[128] (low 4 bits); u8 qh[64] (high 2 bits); i8 scales[16]; f16 d.
// Each half of 128 elements is four runs of 32: run k takes the low (k < 2) or high nibble of
// ql[32 (k % 2) + l] and bits 2k..2k+1 of qh[l], with the scales of its two halves of 16. Written
// run by run (contiguous stores) rather than as ggml interleaves them; the products are the same.
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  for (int n = 0; n < kQK; n += 128) {
    for (int k = 0; k < 4; ++k) {
      const uint8_t* lo = ql + 32 * (k % 2);
      const int nibble = 4 * (k / 2);
      for (int half = 0; half < 2; ++half) {
        const float ds = d * static_cast<float>(sc[2 * k + half]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = (((lo[l] >> nibble) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
          y[32 * k + l] = ds * static_cast<float>(q);
        }
      }
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// block_iq4_nl: f16 d; u8 qs[16] (indices into kIq4Values).
void iq4_nl(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kIq4Values[qs[j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kIq4Values[qs[j] >> 4]);
  }
}

// block_iq4_xs: f16 d; u16 scales_h (2 high bits per sub-block); u8 scales_l[4] (4 low bits);
// u8 qs[128]. Eight sub-blocks of 32 with 6-bit scales biased by 32.
void iq4_xs(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  uint16_t scales_h = 0;
  std::memcpy(&scales_h, b + 2, 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < kQK / 32; ++ib) {
    const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * static_cast<float>(kIq4Values[qs[j] & 0xF]);
      y[j + 16] = dl * static_cast<float>(kIq4Values[qs[j] >> 4]);
    }
    y += 32;
    qs += 16;
  }
}

using BlockDecoder = void (*)(const uint8_t*, float*);

BlockDecoder decoder_of(uint32_t id) {
  switch (id) {
    case 2:
      return q4_0;
    case 3:
      return q4_1;
    case 6:
      return q5_0;
    case 7:
      return q5_1;
    case 8:
      return q8_0;
    case 10:
      return q2_k;
    case 11:
      return q3_k;
    case 12:
      return q45_k<false>;
    case 13:
      return q45_k<true>;
    case 14:
      return q6_k;
    case 20:
      return iq4_nl;
    case 23:
      return iq4_xs;
    default:
      return nullptr;
  }
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(uint32_t id) {
  for (const auto& t : kTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

namespace {

constexpr std::pair<uint32_t, DType> kBlockDTypes[] = {
    {8, DType::kQ8_0}, {2, DType::kQ4_0}, {12, DType::kQ4_K}, {13, DType::kQ5_K}, {14, DType::kQ6_K}};

}  // namespace

std::optional<DType> ggml_block_dtype(uint32_t id) {
  for (const auto& [ggml_id, dtype] : kBlockDTypes) {
    if (ggml_id == id) return dtype;
  }
  return std::nullopt;
}

std::optional<uint32_t> ggml_block_type_id(DType t) {
  for (const auto& [ggml_id, dtype] : kBlockDTypes) {
    if (dtype == t) return ggml_id;
  }
  return std::nullopt;
}

bool ggml_is_dequantizable(uint32_t id) { return decoder_of(id) != nullptr; }

std::string_view ggml_dequantizable_names() {
  return "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS";
}

Status ggml_dequantize(uint32_t id, const void* src, float* dst, int64_t n) {
  const BlockDecoder decode = decoder_of(id);
  const GgmlTypeInfo* info = ggml_type_info(id);
  if (decode == nullptr || info == nullptr) {
    return invalid_argument(
        "ggml type " + std::to_string(id) + " (" + std::string(info != nullptr ? info->name : "unknown") +
        ") is not a decodable block type (decodable: " + std::string(ggml_dequantizable_names()) + ")");
  }
  if (n < 0 || n % info->block != 0) {
    return invalid_argument(std::to_string(n) + " elements are not a whole number of " +
                            std::string(info->name) + " blocks of " + std::to_string(info->block));
  }
  const auto* bytes = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / info->block; ++b) decode(bytes + b * info->bytes, dst + b * info->block);
  return Status::ok();
}

}  // namespace specontext
