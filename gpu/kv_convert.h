// Conversions between f32 and the KV element types (KvType in gpu/kernels.h) as the kernels do
// them: kv_append rounds f32 to the cache's type, attention widens back to f32. Shared by the
// kernels and tests/gpu/kv_convert_test.cc, which checks them against core's f32_to_f16 /
// f32_to_bf16 / f16_to_f32 / bf16_to_f32 without a GPU. Host + device code (SPX_HD); no core
// headers.
//
// Rounding is to nearest even through __float2half_rn / __float2bfloat16_rn (the cvt.rn
// instructions on sm_80+: IEEE, subnormals kept, f16 overflow → ±inf). NaN is handled before the
// intrinsic, because cvt returns the canonical NaN while the host keeps the sign (f16: sign | 0x7e00;
// bf16: the high half with the quiet bit set), so the device stores the host's bits exactly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gpu/host_device.h"

namespace specontext::gpu::kernels {

SPX_HD bool kv_is_nan_bits(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }

// f32 → f16 bits, as core's f32_to_f16.
SPX_HD uint16_t kv_round_f16(float x) {
  const uint32_t b = float_bits(x);
  if (kv_is_nan_bits(b)) return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(x));
}

// f32 → bf16 bits, as core's f32_to_bf16.
SPX_HD uint16_t kv_round_bf16(float x) {
  const uint32_t b = float_bits(x);
  if (kv_is_nan_bits(b)) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Widening (exact for every finite value and ±inf) ...
SPX_HD float kv_to_f32(float x) { return x; }
SPX_HD float kv_to_f32(__half x) { return __half2float(x); }
SPX_HD float kv_to_f32(__nv_bfloat16 x) {
  return bits_float(static_cast<uint32_t>(__bfloat16_as_ushort(x)) << 16);
}

// ... and rounding, by the stored element type T (float, __half, __nv_bfloat16).
template <typename T>
SPX_HD T kv_from_f32(float x);
template <>
SPX_HD float kv_from_f32<float>(float x) {
  return x;
}
template <>
SPX_HD __half kv_from_f32<__half>(float x) {
  return __ushort_as_half(kv_round_f16(x));
}
template <>
SPX_HD __nv_bfloat16 kv_from_f32<__nv_bfloat16>(float x) {
  return __ushort_as_bfloat16(kv_round_bf16(x));
}

}  // namespace specontext::gpu::kernels
