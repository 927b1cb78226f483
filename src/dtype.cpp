// CPU element conversions, bit-exact with CUDA's round-to-nearest-even intrinsics.
#include "mla/dtype.hpp"

#include <cmath>
#include <cstring>

#include "mla/error.hpp"

namespace mla {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kFP8E4M3: return "fp8e4m3";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16: case DType::kFP16: return 2;
    case DType::kFP32: case DType::kInt32: return 4;
    case DType::kFP8E4M3: return 1;
    case DType::kInt64: return 8;
  }
  return 0;
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kFP16 || dtype == DType::kFP32 ||
         dtype == DType::kFP8E4M3;
}

namespace {
uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace

float bf16_to_float(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }

uint16_t float_to_bf16(float value) {
  uint32_t u = float_bits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // canonical NaN, as CUDA
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // ties to even
  return uint16_t((u + rounding) >> 16);
}

float fp16_to_float(uint16_t bits) {
  uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in float
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t float_to_fp16(float value) {
  uint32_t u = float_bits(value);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fffu;  // canonical NaN, as CUDA
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  int exp = int(abs >> 23) - 127;
  if (exp >= -14) {  // normal half
    uint32_t mant = abs & 0x7fffffu;
    uint32_t half = (uint32_t(exp + 15) << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // carry may bump exponent
    return uint16_t(sign | half);
  }
  // subnormal half (or zero): value / 2^-24 rounded to nearest even integer
  if (exp < -25) return sign;  // below half of the smallest subnormal
  uint32_t mant = (abs & 0x7fffffu) | 0x800000u;  // 24-bit significand, value = mant * 2^(exp-23)
  int shift = -exp - 1;  // value = mant * 2^(exp-23) = (mant >> shift) units of 2^-24
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return uint16_t(sign | q);
}

float fp8e4m3_to_float(uint8_t bits) {
  uint32_t sign = bits & 0x80u;
  uint32_t exp = (bits >> 3) & 0xfu;
  uint32_t mant = bits & 0x7u;
  float v;
  if (exp == 0xf && mant == 0x7) {
    v = std::nanf("");
  } else if (exp == 0) {
    v = std::ldexp(float(mant), -9);  // subnormal: mant/8 * 2^-6
  } else {
    v = std::ldexp(1.0f + float(mant) / 8.0f, int(exp) - 7);
  }
  return sign ? -v : v;
}

uint8_t float_to_fp8e4m3(float value) {
  uint32_t u = float_bits(value);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;  // canonical NaN, as CUDA
  float a = bits_float(abs);
  if (a >= 448.0f) return uint8_t(sign | 0x7eu);          // saturate (inf too)
  // Quantise to the e4m3 grid: spacing 2^(e-3) for normals (e >= -6), 2^-9 for subnormals.
  int e = int(abs >> 23) - 127;
  if (e < -6) e = -6;
  float step = std::ldexp(1.0f, e - 3);
  float q = std::nearbyint(a / step);  // exact division by a power of two; ties to even
  float r = q * step;
  if (r >= 448.0f) return uint8_t(sign | 0x7eu);
  if (r == 0.0f) return sign;
  int re = std::ilogb(r);
  if (re < -6) return uint8_t(sign | uint8_t(r / std::ldexp(1.0f, -9)));  // subnormal code
  uint32_t mant = uint32_t(r / std::ldexp(1.0f, re - 3)) - 8u;
  return uint8_t(sign | uint8_t((re + 7) << 3) | uint8_t(mant));
}

float load_as_float(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFP16: return fp16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFP32: return static_cast<const float*>(data)[index];
    case DType::kFP8E4M3: return fp8e4m3_to_float(static_cast<const uint8_t*>(data)[index]);
    default: MLA_FAIL("load_as_float: dtype must be a float type, got ", dtype_name(dtype));
  }
}

void store_from_float(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kBF16: static_cast<uint16_t*>(data)[index] = float_to_bf16(value); return;
    case DType::kFP16: static_cast<uint16_t*>(data)[index] = float_to_fp16(value); return;
    case DType::kFP32: static_cast<float*>(data)[index] = value; return;
    case DType::kFP8E4M3: static_cast<uint8_t*>(data)[index] = float_to_fp8e4m3(value); return;
    default: MLA_FAIL("store_from_float: dtype must be a float type, got ", dtype_name(dtype));
  }
}

}  // namespace mla
