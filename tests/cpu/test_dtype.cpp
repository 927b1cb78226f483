// Element conversions (mla/dtype.hpp): every code of bf16, fp16 and fp8 e4m3 decoded, and float ->
// narrow rounding checked on millions of inputs, against references derived here from the format
// definitions (sign, exponent with bias, mantissa, subnormals, specials; round to nearest with ties
// to even by search over the table of representable values). When the CUDA toolkit headers are
// available, the same inputs are also compared with CUDA's own host-side conversions.
#include <algorithm>
#include <cfloat>
#include <cstdio>
#include <functional>

#include "mla/ops.hpp"
#include "test_util.hpp"

#if defined(MLA_TEST_HAVE_CUDA_HEADERS)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace {

uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

double pow2(int k) {
  double p = 1.0;
  for (; k > 0; --k) p *= 2.0;
  for (; k < 0; ++k) p *= 0.5;
  return p;
}

// A binary floating-point format: 1 sign bit, exp_bits exponent bits with bias, mant_bits
// mantissa bits. IEEE formats use the all-ones exponent for inf (mantissa 0) and NaN; e4m3 has no
// inf and only S.1111.111 is NaN, and float -> e4m3 saturates to the largest finite value.
struct Format {
  const char* name;
  int exp_bits;
  int mant_bits;
  int bias;
  bool ieee;
  int width() const { return 1 + exp_bits + mant_bits; }
  uint32_t num_codes() const { return 1u << width(); }
  uint32_t sign_bit() const { return 1u << (width() - 1); }
};
constexpr Format kBF16{"bf16", 8, 7, 127, true};
constexpr Format kFP16{"fp16", 5, 10, 15, true};
constexpr Format kE4M3{"fp8e4m3", 4, 3, 7, false};

// The value of `code` by the format rules (exact in double).
double decode_ref(const Format& f, uint32_t code) {
  const bool negative = (code & f.sign_bit()) != 0;
  const uint32_t exp_all_ones = (1u << f.exp_bits) - 1;
  const uint32_t mant_all_ones = (1u << f.mant_bits) - 1;
  const uint32_t e = (code >> f.mant_bits) & exp_all_ones;
  const uint32_t m = code & mant_all_ones;
  double magnitude;
  if (f.ieee && e == exp_all_ones)
    magnitude = m == 0 ? std::numeric_limits<double>::infinity()
                       : std::numeric_limits<double>::quiet_NaN();
  else if (!f.ieee && e == exp_all_ones && m == mant_all_ones)
    magnitude = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0)  // subnormal: 0.m * 2^(1 - bias)
    magnitude = double(m) * pow2(1 - f.bias - f.mant_bits);
  else  // normal: 1.m * 2^(e - bias)
    magnitude = double((1u << f.mant_bits) + m) * pow2(int(e) - f.bias - f.mant_bits);
  return negative ? -magnitude : magnitude;
}

// Round to nearest, ties to even code, by search over the sorted non-negative representable
// values. For IEEE formats the table ends with the first power of two past the largest finite
// value, standing for inf (its code, the inf code, is even): so inputs at or above the midpoint
// between the largest finite value and that power of two overflow to inf, as IEEE rounding
// prescribes. For e4m3 the table ends at 448 and anything larger saturates to it.
class RoundingReference {
 public:
  explicit RoundingReference(const Format& f) : format_(f) {
    for (uint32_t code = 0; code < f.sign_bit(); ++code) {
      const double v = decode_ref(f, code);
      if (std::isnan(v)) continue;
      if (std::isinf(v)) {  // the inf code stands at the value 2^(emax + 1), emax = bias
        values_.push_back(pow2(f.bias + 1));
        codes_.push_back(code);
        continue;
      }
      values_.push_back(v);
      codes_.push_back(code);
    }
    for (size_t i = 1; i < values_.size(); ++i) EXPECT_LT(values_[i - 1], values_[i]);
  }

  // Returns the code of x (not NaN) rounded to the format.
  uint32_t round(float x) const {
    const uint32_t sign = std::signbit(x) ? format_.sign_bit() : 0u;
    const double a = std::fabs(double(x));
    if (a >= values_.back()) return sign | codes_.back();
    const size_t hi = size_t(std::upper_bound(values_.begin(), values_.end(), a) - values_.begin());
    const size_t lo = hi - 1;
    const double mid = 0.5 * (values_[lo] + values_[hi]);  // exact: few significant bits
    size_t pick;
    if (a < mid) pick = lo;
    else if (a > mid) pick = hi;
    else pick = (codes_[lo] & 1u) == 0 ? lo : hi;
    return sign | codes_[pick];
  }

  const std::vector<double>& values() const { return values_; }
  const std::vector<uint32_t>& codes() const { return codes_; }

 private:
  Format format_;
  std::vector<double> values_;
  std::vector<uint32_t> codes_;
};

// Inputs for float -> narrow: uniformly random bit patterns (all exponents, NaN payloads, inf,
// subnormal floats), random values with exponents in [exp_lo, exp_hi] (the interesting range of
// the target format), the midpoints between adjacent representable values (ties) and the floats
// just either side of each midpoint and each value, and special values.
std::vector<float> conversion_inputs(const RoundingReference& ref, uint64_t seed, size_t num_bits,
                                     size_t num_in_range, int exp_lo, int exp_hi) {
  std::mt19937_64 rng(seed);
  std::vector<float> inputs;
  inputs.reserve(num_bits + num_in_range + 8 * ref.values().size() + 64);
  for (size_t i = 0; i < num_bits; ++i) inputs.push_back(float_of(uint32_t(rng())));
  std::uniform_int_distribution<int> exponent(exp_lo, exp_hi);
  for (size_t i = 0; i < num_in_range; ++i) {
    const uint32_t sign = uint32_t(rng() & 1u) << 31;
    const uint32_t mant = uint32_t(rng()) & 0x7fffffu;
    inputs.push_back(float_of(sign | (uint32_t(exponent(rng) + 127) << 23) | mant));
  }
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<double>& values = ref.values();
  for (size_t i = 0; i < values.size(); ++i) {
    std::vector<float> around = {float(values[i])};
    if (i + 1 < values.size()) around.push_back(float(0.5 * (values[i] + values[i + 1])));
    for (float v : around) {
      if (std::isinf(v)) continue;
      for (float w : {v, std::nextafter(v, inf), std::nextafter(v, -inf)}) {
        inputs.push_back(w);
        inputs.push_back(-w);
      }
    }
  }
  for (float v : {0.0f, -0.0f, inf, -inf, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, FLT_TRUE_MIN,
                  -FLT_TRUE_MIN, std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(), float_of(0x7f800001u),
                  float_of(0xff800001u), float_of(0x7fbfffffu), float_of(0x7fffffffu),
                  float_of(0xffc00000u), 448.0f, 449.0f, 464.0f, 465.0f, 480.0f, 1e4f, 65504.0f,
                  65519.996f, 65520.0f, 65536.0f, 1e30f})
    inputs.push_back(v);
  return inputs;
}

// Collects mismatches and prints the first few.
struct Mismatches {
  size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 8) first += "\n  " + what;
  }
  ::testing::AssertionResult result(size_t total) const {
    if (count == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << count << " of " << total << " differ:" << first;
  }
};

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%x", v);
  return buf;
}

std::string describe_input(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (bits 0x%08x)", double(x), bits_of(x));
  return buf;
}

// narrow -> float for every code: the exact value, sign of zero, NaN exactly where the format has
// NaN.
::testing::AssertionResult decodes_every_code(const Format& f,
                                              const std::function<float(uint32_t)>& decode) {
  Mismatches bad;
  for (uint32_t code = 0; code < f.num_codes(); ++code) {
    const double expected = decode_ref(f, code);
    const float got = decode(code);
    const bool ok = std::isnan(expected)
                        ? std::isnan(got)
                        : (double(got) == expected && std::signbit(got) == std::signbit(expected));
    if (!ok) bad.add(std::string(f.name) + " " + hex(code) + ": got " + describe_input(got));
  }
  return bad.result(f.num_codes());
}

// float -> narrow against the rounding reference; for NaN inputs only NaN-ness is compared.
::testing::AssertionResult encodes_like_reference(const Format& f, const RoundingReference& ref,
                                                  const std::vector<float>& inputs,
                                                  const std::function<uint32_t(float)>& encode) {
  Mismatches bad;
  for (float x : inputs) {
    const uint32_t got = encode(x);
    if (std::isnan(x)) {
      if (!std::isnan(decode_ref(f, got)))
        bad.add(describe_input(x) + " -> " + hex(got) + ", not NaN");
      continue;
    }
    const uint32_t expected = ref.round(x);
    if (got != expected)
      bad.add(describe_input(x) + " -> " + hex(got) + ", expected " + hex(expected));
  }
  return bad.result(inputs.size());
}

// ---- fp8 e4m3 --------------------------------------------------------------------------------

TEST(DTypeFp8, FormatTableHasTheKnownValues) {
  EXPECT_EQ(decode_ref(kE4M3, 0x7e), 448.0);
  EXPECT_EQ(decode_ref(kE4M3, 0x38), 1.0);
  EXPECT_EQ(decode_ref(kE4M3, 0x08), 1.0 / 64);   // smallest normal 2^-6
  EXPECT_EQ(decode_ref(kE4M3, 0x01), 1.0 / 512);  // smallest subnormal 2^-9
  EXPECT_EQ(decode_ref(kE4M3, 0x07), 7.0 / 512);  // largest subnormal
  EXPECT_EQ(decode_ref(kE4M3, 0x78), 256.0);      // exponent 15 is a normal binade in e4m3
  EXPECT_EQ(decode_ref(kE4M3, 0xfe), -448.0);
  EXPECT_TRUE(std::isnan(decode_ref(kE4M3, 0x7f)));
  EXPECT_TRUE(std::isnan(decode_ref(kE4M3, 0xff)));
  int nan_codes = 0;
  for (uint32_t c = 0; c < 256; ++c) nan_codes += std::isnan(decode_ref(kE4M3, c)) ? 1 : 0;
  EXPECT_EQ(nan_codes, 2);
  EXPECT_EQ(double(mla::kFp8E4M3Max), 448.0);
}

TEST(DTypeFp8, DecodesEveryCode) {
  EXPECT_TRUE(decodes_every_code(kE4M3, [](uint32_t c) { return mla::fp8e4m3_to_float(uint8_t(c)); }));
  EXPECT_TRUE(std::signbit(mla::fp8e4m3_to_float(0x80)));
  EXPECT_EQ(mla::fp8e4m3_to_float(0x80), 0.0f);
}

TEST(DTypeFp8, EveryCodeReencodesToItself) {
  for (uint32_t code = 0; code < 256; ++code) {
    const float v = mla::fp8e4m3_to_float(uint8_t(code));
    const uint8_t back = mla::float_to_fp8e4m3(v);
    if (std::isnan(v))
      EXPECT_TRUE(back == 0x7f || back == 0xff) << hex(code) << " -> " << hex(back);
    else
      EXPECT_EQ(uint32_t(back), code) << "value " << v;
  }
}

TEST(DTypeFp8, TiesGoToTheEvenCode) {
  const RoundingReference ref(kE4M3);
  const auto& values = ref.values();
  ASSERT_EQ(values.size(), 127u);  // 0 .. 448
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    const float mid = float(0.5 * (values[i] + values[i + 1]));
    ASSERT_EQ(double(mid), 0.5 * (values[i] + values[i + 1]));
    const uint32_t even = (i % 2 == 0) ? uint32_t(i) : uint32_t(i + 1);  // code == index here
    EXPECT_EQ(uint32_t(mla::float_to_fp8e4m3(mid)), even) << "midpoint " << mid;
    EXPECT_EQ(uint32_t(mla::float_to_fp8e4m3(-mid)), 0x80u | even) << "midpoint " << -mid;
    EXPECT_EQ(uint32_t(mla::float_to_fp8e4m3(std::nextafter(mid, 1e9f))), i + 1) << mid;
    EXPECT_EQ(uint32_t(mla::float_to_fp8e4m3(std::nextafter(mid, -1e9f))), i) << mid;
  }
}

TEST(DTypeFp8, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, std::nextafter(448.0f, inf), 449.0f, 464.0f, 465.0f, 480.0f, 1e4f,
                  1e30f, FLT_MAX, inf}) {
    EXPECT_EQ(mla::float_to_fp8e4m3(v), 0x7e) << v;
    EXPECT_EQ(mla::float_to_fp8e4m3(-v), 0xfe) << -v;
  }
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const uint8_t code = mla::float_to_fp8e4m3(float_of(bits));
    EXPECT_TRUE(code == 0x7f || code == 0xff) << hex(bits) << " -> " << hex(code);
  }
  // Below half the smallest subnormal (2^-10) rounds to zero, keeping the sign; exactly 2^-10 is a
  // tie that goes to the even code 0.
  EXPECT_EQ(mla::float_to_fp8e4m3(0x1p-10f), 0x00);
  EXPECT_EQ(mla::float_to_fp8e4m3(-0x1p-10f), 0x80);
  EXPECT_EQ(mla::float_to_fp8e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(mla::float_to_fp8e4m3(FLT_TRUE_MIN), 0x00);
  EXPECT_EQ(mla::float_to_fp8e4m3(-0.0f), 0x80);
}

TEST(DTypeFp8, EncodesRandomInputsLikeTheReference) {
  const RoundingReference ref(kE4M3);
  const auto inputs = conversion_inputs(ref, 0xf8, 1'000'000, 3'000'000, -12, 9);
  EXPECT_TRUE(encodes_like_reference(kE4M3, ref, inputs,
                                     [](float x) { return uint32_t(mla::float_to_fp8e4m3(x)); }));
}

// ---- bf16 and fp16 ---------------------------------------------------------------------------

TEST(DTypeBf16, DecodesEveryCode) {
  EXPECT_TRUE(decodes_every_code(kBF16, [](uint32_t c) { return mla::bf16_to_float(uint16_t(c)); }));
}

TEST(DTypeFp16, DecodesEveryCode) {
  EXPECT_TRUE(decodes_every_code(kFP16, [](uint32_t c) { return mla::fp16_to_float(uint16_t(c)); }));
  EXPECT_EQ(mla::fp16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(mla::fp16_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(mla::fp16_to_float(0x0400), 0x1p-14f);
}

TEST(DTypeBf16, EveryCodeReencodesToItself) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float v = mla::bf16_to_float(uint16_t(code));
    const uint16_t back = mla::float_to_bf16(v);
    if (std::isnan(v))
      ASSERT_TRUE(std::isnan(mla::bf16_to_float(back))) << hex(code) << " -> " << hex(back);
    else
      ASSERT_EQ(uint32_t(back), code);
  }
}

TEST(DTypeFp16, EveryCodeReencodesToItself) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float v = mla::fp16_to_float(uint16_t(code));
    const uint16_t back = mla::float_to_fp16(v);
    if (std::isnan(v))
      ASSERT_TRUE(std::isnan(mla::fp16_to_float(back))) << hex(code) << " -> " << hex(back);
    else
      ASSERT_EQ(uint32_t(back), code);
  }
}

TEST(DTypeBf16, EncodesRandomInputsLikeTheReference) {
  const RoundingReference ref(kBF16);
  const auto inputs = conversion_inputs(ref, 0xbf16, 3'000'000, 1'000'000, -140, 127);
  EXPECT_TRUE(encodes_like_reference(kBF16, ref, inputs,
                                     [](float x) { return uint32_t(mla::float_to_bf16(x)); }));
}

TEST(DTypeFp16, EncodesRandomInputsLikeTheReference) {
  const RoundingReference ref(kFP16);
  const auto inputs = conversion_inputs(ref, 0xf16, 2'000'000, 3'000'000, -26, 16);
  EXPECT_TRUE(encodes_like_reference(kFP16, ref, inputs,
                                     [](float x) { return uint32_t(mla::float_to_fp16(x)); }));
}

TEST(DTypeFp16, RoundsAtTheEdges) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mla::float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(mla::float_to_fp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(mla::float_to_fp16(65520.0f), 0x7c00);  // tie between 65504 (odd) and 2^16 -> inf
  EXPECT_EQ(mla::float_to_fp16(-65520.0f), 0xfc00);
  EXPECT_EQ(mla::float_to_fp16(inf), 0x7c00);
  EXPECT_EQ(mla::float_to_fp16(0x1p-25f), 0x0000);  // tie between 0 and 2^-24 -> 0
  EXPECT_EQ(mla::float_to_fp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(mla::float_to_fp16(0x1.8p-24f), 0x0002);  // tie 1.5 units -> 2
  EXPECT_EQ(mla::float_to_fp16(0x1.4p-24f), 0x0001);
  EXPECT_EQ(mla::float_to_fp16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(mla::fp16_to_float(mla::float_to_fp16(std::nanf("")))));
}

TEST(DTypeBf16, RoundsAtTheEdges) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mla::float_to_bf16(FLT_MAX), 0x7f80);  // above the last midpoint -> inf
  EXPECT_EQ(mla::float_to_bf16(float_of(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(mla::float_to_bf16(float_of(0x7f7f8000u)), 0x7f80);  // tie, 0x7f7f odd -> inf
  EXPECT_EQ(mla::float_to_bf16(-inf), 0xff80);
  EXPECT_EQ(mla::float_to_bf16(float_of(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(mla::float_to_bf16(float_of(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(mla::float_to_bf16(float_of(0x00008000u)), 0x0000);  // subnormal tie -> 0
  EXPECT_EQ(mla::float_to_bf16(float_of(0x00018000u)), 0x0002);
  EXPECT_EQ(mla::float_to_bf16(-0.0f), 0x8000);
  for (uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu})
    EXPECT_TRUE(std::isnan(mla::bf16_to_float(mla::float_to_bf16(float_of(bits))))) << hex(bits);
}

TEST(DTypeHelpers, LoadAndStoreConvert) {
  std::vector<unsigned char> buf(16);
  mla::store_from_float(buf.data(), mla::DType::kFP8E4M3, 3, 1000.0f);
  EXPECT_EQ(mla::load_as_float(buf.data(), mla::DType::kFP8E4M3, 3), 448.0f);
  mla::store_from_float(buf.data(), mla::DType::kBF16, 1, 1.5f);
  EXPECT_EQ(mla::load_as_float(buf.data(), mla::DType::kBF16, 1), 1.5f);
  mla::store_from_float(buf.data(), mla::DType::kFP16, 2, -2.25f);
  EXPECT_EQ(mla::load_as_float(buf.data(), mla::DType::kFP16, 2), -2.25f);
  mla::store_from_float(buf.data(), mla::DType::kFP32, 3, 0.1f);
  EXPECT_EQ(mla::load_as_float(buf.data(), mla::DType::kFP32, 3), 0.1f);
  EXPECT_TRUE(mla::test::throws_error(
      [&] { mla::load_as_float(buf.data(), mla::DType::kInt32, 0); }, {"load_as_float", "int32"}));
  EXPECT_TRUE(mla::test::throws_error(
      [&] { mla::store_from_float(buf.data(), mla::DType::kInt64, 0, 1.0f); },
      {"store_from_float", "int64"}));
  EXPECT_EQ(mla::dtype_size(mla::DType::kFP8E4M3), 1u);
  EXPECT_EQ(mla::dtype_name(mla::DType::kBF16), "bf16");
}

// ---- CUDA's host-side conversions as a second reference --------------------------------------

#if defined(MLA_TEST_HAVE_CUDA_HEADERS)

uint32_t cuda_float_to_bf16(float x) {
  __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}
float cuda_bf16_to_float(uint32_t code) {
  __nv_bfloat16_raw r;
  r.x = uint16_t(code);
  return __bfloat162float(__nv_bfloat16(r));
}
uint32_t cuda_float_to_fp16(float x) {
  __half_raw r = __float2half_rn(x);
  return r.x;
}
float cuda_fp16_to_float(uint32_t code) {
  __half_raw r;
  r.x = uint16_t(code);
  return __half2float(__half(r));
}
uint32_t cuda_float_to_fp8(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
float cuda_fp8_to_float(uint32_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3)));
}

// Bit-identical results for every input, NaN included (both give the canonical NaN code).
::testing::AssertionResult same_as_cuda(const std::vector<float>& inputs,
                                        const std::function<uint32_t(float)>& ours,
                                        const std::function<uint32_t(float)>& cuda,
                                        const std::function<float(uint32_t)>& decode) {
  Mismatches bad;
  for (float x : inputs) {
    const uint32_t a = ours(x), b = cuda(x);
    const bool ok = a == b && (!std::isnan(x) || std::isnan(decode(a)));
    if (!ok) bad.add(describe_input(x) + ": mla " + hex(a) + ", cuda " + hex(b));
  }
  return bad.result(inputs.size());
}

::testing::AssertionResult decodes_same_as_cuda(uint32_t num_codes,
                                                const std::function<float(uint32_t)>& ours,
                                                const std::function<float(uint32_t)>& cuda) {
  Mismatches bad;
  for (uint32_t code = 0; code < num_codes; ++code) {
    const float a = ours(code), b = cuda(code);
    const bool ok = std::isnan(a) || std::isnan(b) ? std::isnan(a) && std::isnan(b)
                                                   : bits_of(a) == bits_of(b);
    if (!ok) bad.add(hex(code) + ": mla " + describe_input(a) + ", cuda " + describe_input(b));
  }
  return bad.result(num_codes);
}

TEST(DTypeCudaHost, DecodesEveryCodeLikeCuda) {
  EXPECT_TRUE(decodes_same_as_cuda(256, [](uint32_t c) { return mla::fp8e4m3_to_float(uint8_t(c)); },
                                   cuda_fp8_to_float));
  EXPECT_TRUE(decodes_same_as_cuda(65536, [](uint32_t c) { return mla::bf16_to_float(uint16_t(c)); },
                                   cuda_bf16_to_float));
  EXPECT_TRUE(decodes_same_as_cuda(65536, [](uint32_t c) { return mla::fp16_to_float(uint16_t(c)); },
                                   cuda_fp16_to_float));
}

TEST(DTypeCudaHost, EncodesLikeCuda) {
  {
    const auto inputs = conversion_inputs(RoundingReference(kE4M3), 0xc8, 500'000, 1'500'000, -12, 9);
    EXPECT_TRUE(same_as_cuda(inputs, [](float x) { return uint32_t(mla::float_to_fp8e4m3(x)); },
                             cuda_float_to_fp8,
                             [](uint32_t c) { return mla::fp8e4m3_to_float(uint8_t(c)); }));
  }
  {
    const auto inputs = conversion_inputs(RoundingReference(kBF16), 0xcbf, 1'500'000, 500'000, -140, 127);
    EXPECT_TRUE(same_as_cuda(inputs, [](float x) { return uint32_t(mla::float_to_bf16(x)); },
                             cuda_float_to_bf16,
                             [](uint32_t c) { return mla::bf16_to_float(uint16_t(c)); }));
  }
  {
    const auto inputs = conversion_inputs(RoundingReference(kFP16), 0xcf1, 1'000'000, 1'000'000, -26, 16);
    EXPECT_TRUE(same_as_cuda(inputs, [](float x) { return uint32_t(mla::float_to_fp16(x)); },
                             cuda_float_to_fp16,
                             [](uint32_t c) { return mla::fp16_to_float(uint16_t(c)); }));
  }
}

#else

TEST(DTypeCudaHost, DISABLED_CudaHeadersNotFound) {}

#endif

}  // namespace
