// Element types and their CPU conversions.
//
// The conversions are bit-exact with CUDA's intrinsics (__float2bfloat16_rn, __float2half_rn,
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)):
//   * float -> bf16 / fp16: round to nearest, ties to even; overflow gives inf; NaN gives the
//     canonical NaN 0x7fff.
//   * float -> fp8 e4m3: round to nearest even, saturating to ±448 (finite inputs and ±inf);
//     NaN gives the canonical NaN 0x7f.
//   * narrow -> float: exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mla {

enum class DType : uint8_t { kBF16, kFP16, kFP32, kFP8E4M3, kInt32, kInt64 };

std::string_view dtype_name(DType dtype);
size_t dtype_size(DType dtype);
bool is_float_dtype(DType dtype);

float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);
float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);
float fp8e4m3_to_float(uint8_t bits);
uint8_t float_to_fp8e4m3(float value);  // saturating to ±448

// Reads element `index` of a buffer of `dtype` as float (float dtypes only).
float load_as_float(const void* data, DType dtype, int64_t index);
// Writes `value` into element `index`, converting (and for fp8, saturating) to `dtype`.
void store_from_float(void* data, DType dtype, int64_t index, float value);

}  // namespace mla
