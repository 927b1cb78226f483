// rope_quantize on the CPU: NeoX and interleaved rotary embedding of q_pe / k_pe, the 576-wide
// query and the key outputs, against a float64 reference; bf16/fp16 outputs and fp8 outputs with
// scales (saturation included), optional k outputs, heads 1..128, int32/int64 positions, strided
// inputs and outputs (padding poisoned with NaN must stay NaN); bad input raises mla::Error.
#include <algorithm>
#include <optional>

#include "mla/ops.hpp"
#include "test_util.hpp"

namespace {

using mla::DType;
using mla::RopeStyle;
using mla::TensorView;
using mla::test::HostTensor;
using mla::test::throws_error;

constexpr int kNope = mla::kKvLoraRank;  // 512
constexpr int kRope = mla::kRopeDim;     // 64
constexpr int kHalf = kRope / 2;         // 32
constexpr int kEntry = mla::kLatentDim;  // 576
constexpr int64_t kMaxPosition = 257;

void* byte_offset(HostTensor& t, int64_t elements) {
  return static_cast<unsigned char*>(t.data()) + elements * int64_t(mla::dtype_size(t.dtype));
}

float log_uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  const double magnitude = std::exp2(exponent(rng));
  return float((rng() & 1) ? -magnitude : magnitude);
}

// Tolerance of one output element against the float64 value it approximates (dequantised for fp8):
// half an ulp of the output format (relative), plus the float rounding of the rotation (inputs
// are below 8 in magnitude) and half the smallest subnormal step.
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance_for(DType out_dtype, double scale) {
  const double rotation = 4e-6;
  switch (out_dtype) {
    case DType::kBF16: return {rotation, 0x1p-8};
    case DType::kFP16: return {rotation + 0x1p-25, 0x1p-11};
    default: return {rotation + 0x1p-10 * scale * 1.0001, 0x1p-4 * 1.0001};
  }
}

double expected_output(double x, DType out_dtype, double scale) {
  return out_dtype == DType::kFP8E4M3 ? std::clamp(x / scale, -448.0, 448.0) * scale : x;
}

// A table of real rotary angles: angle(pos, i) = pos * 10000^(-i / 32); row stride may be padded.
struct CosSinCache {
  HostTensor buf;
  TensorView view;
  CosSinCache(int64_t row_stride) : buf(DType::kFP32, {kMaxPosition, row_stride}) {
    buf.fill_nan();
    for (int64_t pos = 0; pos < kMaxPosition; ++pos)
      for (int i = 0; i < kHalf; ++i) {
        const double angle = double(pos) * std::pow(10000.0, -double(i) / kHalf);
        buf.set(pos * row_stride + i, float(std::cos(angle)));
        buf.set(pos * row_stride + kHalf + i, float(std::sin(angle)));
      }
    view = TensorView::strided(buf.data(), DType::kFP32, {kMaxPosition, kRope}, {row_stride, 1});
  }
  double cos(int64_t pos, int i) const { return buf.get(pos * view.stride[0] + i); }
  double sin(int64_t pos, int i) const { return buf.get(pos * view.stride[0] + kHalf + i); }
};

// Rotates the 64 rope values of one head (read through `at`) in float64.
template <typename At>
std::vector<double> rope_ref(At at, const CosSinCache& cache, int64_t pos, RopeStyle style) {
  std::vector<double> out(kRope);
  for (int i = 0; i < kHalf; ++i) {
    const int i1 = style == RopeStyle::kNeox ? i : 2 * i;
    const int i2 = style == RopeStyle::kNeox ? i + kHalf : 2 * i + 1;
    const double x1 = at(i1), x2 = at(i2), c = cache.cos(pos, i), s = cache.sin(pos, i);
    out[size_t(i1)] = x1 * c - x2 * s;
    out[size_t(i2)] = x2 * c + x1 * s;
  }
  return out;
}

double element(const TensorView& t, int64_t offset) {
  return double(mla::load_as_float(t.data, t.dtype, offset));
}

struct RopeCase {
  int num_tokens;
  int num_heads;
  RopeStyle style;
  DType input_dtype;
  DType q_out_dtype;
  std::optional<DType> k_out_dtype;  // none: no k inputs or outputs
  DType position_dtype;
  float q_scale;
  float k_scale;
  bool strided;
  uint64_t seed;
};

std::string describe(const RopeCase& c) {
  std::ostringstream os;
  os << "T " << c.num_tokens << ", H " << c.num_heads << ", "
     << (c.style == RopeStyle::kNeox ? "neox" : "interleaved") << ", input "
     << mla::dtype_name(c.input_dtype) << ", q_out " << mla::dtype_name(c.q_out_dtype)
     << " (q_scale " << c.q_scale << "), k_out "
     << (c.k_out_dtype ? std::string(mla::dtype_name(*c.k_out_dtype)) : "none") << " (k_scale "
     << c.k_scale << "), positions " << mla::dtype_name(c.position_dtype)
     << (c.strided ? ", strided" : "");
  return os.str();
}

void run_case(const RopeCase& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int64_t T = c.num_tokens, H = c.num_heads;
  const DType in = c.input_dtype;
  const bool with_k = c.k_out_dtype.has_value();

  // Inputs, strided: q_nope rows padded, q_pe heads taken from a wider head dimension, k_nope and
  // k_pe column slices of one buffer. Values 2^-10 .. 8 in magnitude with random signs.
  HostTensor q_nope_buf(in, {T, H, c.strided ? kNope + 8 : kNope});
  HostTensor q_pe_buf(in, {T, c.strided ? H + 1 : H, kRope});
  HostTensor k_buf(in, {T, c.strided ? kEntry + 5 : kNope});
  HostTensor k_pe_buf(in, {T, kRope});
  for (HostTensor* b : {&q_nope_buf, &q_pe_buf, &k_buf, &k_pe_buf})
    for (int64_t i = 0; i < b->numel(); ++i) b->set(i, log_uniform(rng, -10, 3));
  const TensorView q_nope = TensorView::strided(q_nope_buf.data(), in, {T, H, kNope},
                                                {H * q_nope_buf.shape[2], q_nope_buf.shape[2], 1});
  const TensorView q_pe = TensorView::strided(q_pe_buf.data(), in, {T, H, kRope},
                                              {q_pe_buf.shape[1] * kRope, kRope, 1});
  const int64_t k_stride = k_buf.shape[1];
  const TensorView k_nope = TensorView::strided(k_buf.data(), in, {T, kNope}, {k_stride, 1});
  const TensorView k_pe =
      c.strided ? TensorView::strided(byte_offset(k_buf, kNope + 3), in, {T, kRope}, {k_stride, 1})
                : k_pe_buf.view();

  // Outputs poisoned with NaN; strided: q_out rows padded, k outputs as the two parts of one
  // [T, 576] buffer (the layout of a cache entry).
  const int64_t q_out_width = c.strided ? kEntry + 24 : kEntry;
  HostTensor q_out_buf(c.q_out_dtype, {T, H, q_out_width});
  q_out_buf.fill_nan();
  const TensorView q_out = TensorView::strided(q_out_buf.data(), c.q_out_dtype, {T, H, kEntry},
                                               {H * q_out_width, q_out_width, 1});
  const DType k_out_dtype = c.k_out_dtype.value_or(DType::kBF16);
  HostTensor k_out_buf(k_out_dtype, {T, c.strided ? kEntry : kNope});
  HostTensor k_pe_out_buf(k_out_dtype, {T, kRope});
  k_out_buf.fill_nan();
  k_pe_out_buf.fill_nan();
  const int64_t k_out_stride = k_out_buf.shape[1];
  const TensorView k_nope_out =
      TensorView::strided(k_out_buf.data(), k_out_dtype, {T, kNope}, {k_out_stride, 1});
  const TensorView k_pe_out =
      c.strided ? TensorView::strided(byte_offset(k_out_buf, kNope), k_out_dtype, {T, kRope},
                                      {k_out_stride, 1})
                : k_pe_out_buf.view();

  const CosSinCache cache(c.strided ? kRope + 6 : kRope);
  std::vector<int64_t> position(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    position[size_t(t)] = t == 0 ? kMaxPosition - 1 : t == 1 ? 0 : int64_t(rng() % kMaxPosition);
  HostTensor positions(c.position_dtype, {T});
  for (int64_t t = 0; t < T; ++t) {
    if (c.position_dtype == DType::kInt32) positions.i32(t) = int32_t(position[size_t(t)]);
    else positions.i64(t) = position[size_t(t)];
  }

  mla::RopeQuantizeArgs args;
  args.q_nope = q_nope;
  args.q_pe = q_pe;
  if (with_k) {
    args.k_nope = k_nope;
    args.k_pe = k_pe;
    args.k_nope_out = k_nope_out;
    args.k_pe_out = k_pe_out;
  }
  args.cos_sin_cache = cache.view;
  args.positions = positions.view();
  args.style = c.style;
  args.q_out = q_out;
  args.q_scale = c.q_scale;
  args.k_scale = c.k_scale;
  ASSERT_NO_THROW(mla::rope_quantize(args));

  // q_out: every element of the buffer, padding included (must stay NaN).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const bool q_fp8 = c.q_out_dtype == DType::kFP8E4M3;
  std::vector<double> q_expected(size_t(q_out_buf.numel()), nan);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t out = t * q_out.stride[0] + h * q_out.stride[1];
      const int64_t src_nope = t * q_nope.stride[0] + h * q_nope.stride[1];
      const int64_t src_pe = t * q_pe.stride[0] + h * q_pe.stride[1];
      for (int d = 0; d < kNope; ++d)
        q_expected[size_t(out + d)] =
            expected_output(element(q_nope, src_nope + d), c.q_out_dtype, c.q_scale);
      const auto rotated = rope_ref([&](int i) { return element(q_pe, src_pe + i); }, cache,
                                    position[size_t(t)], c.style);
      for (int d = 0; d < kRope; ++d)
        q_expected[size_t(out + kNope + d)] = expected_output(rotated[size_t(d)], c.q_out_dtype, c.q_scale);
    }
  std::vector<float> q_actual = q_out_buf.to_float();
  if (q_fp8)
    for (float& v : q_actual) v *= c.q_scale;
  const Tolerance q_tol = tolerance_for(c.q_out_dtype, c.q_scale);
  EXPECT_TRUE(mla::test::all_close(q_actual, q_expected, q_tol.atol, q_tol.rtol)) << "q_out";

  // k outputs: every element of both buffers; untouched (all NaN) when no k is given.
  std::vector<double> k_expected(size_t(k_out_buf.numel()), nan);
  std::vector<double> k_pe_expected(size_t(k_pe_out_buf.numel()), nan);
  if (with_k) {
    std::vector<double>& pe_expected = c.strided ? k_expected : k_pe_expected;
    for (int64_t t = 0; t < T; ++t) {
      for (int d = 0; d < kNope; ++d)
        k_expected[size_t(t * k_nope_out.stride[0] + d)] =
            expected_output(element(k_nope, t * k_nope.stride[0] + d), k_out_dtype, c.k_scale);
      const auto rotated = rope_ref([&](int i) { return element(k_pe, t * k_pe.stride[0] + i); },
                                    cache, position[size_t(t)], c.style);
      const int64_t pe_base = c.strided ? t * k_out_stride + kNope : t * kRope;
      for (int d = 0; d < kRope; ++d)
        pe_expected[size_t(pe_base + d)] = expected_output(rotated[size_t(d)], k_out_dtype, c.k_scale);
    }
  }
  const bool k_fp8 = with_k && k_out_dtype == DType::kFP8E4M3;
  std::vector<float> k_actual = k_out_buf.to_float(), k_pe_actual = k_pe_out_buf.to_float();
  if (k_fp8) {
    for (float& v : k_actual) v *= c.k_scale;
    for (float& v : k_pe_actual) v *= c.k_scale;
  }
  const Tolerance k_tol = tolerance_for(k_out_dtype, c.k_scale);
  EXPECT_TRUE(mla::test::all_close(k_actual, k_expected, k_tol.atol, k_tol.rtol)) << "k_nope_out";
  EXPECT_TRUE(mla::test::all_close(k_pe_actual, k_pe_expected, k_tol.atol, k_tol.rtol)) << "k_pe_out";
}

TEST(RopeQuantize, StylesHeadsAndOutputDtypes) {
  const DType input_dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  const std::optional<DType> k_out_dtypes[] = {std::nullopt, DType::kBF16, DType::kFP8E4M3,
                                               DType::kFP16};
  uint64_t seed = 100;
  int variant = 0;
  for (int heads : {1, 16, 128})
    for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved})
      for (DType q_out_dtype : {DType::kBF16, DType::kFP16, DType::kFP8E4M3}) {
        ++variant;
        RopeCase c;
        c.num_tokens = heads == 1 ? 13 : heads == 16 ? 5 : 2;
        c.num_heads = heads;
        c.style = style;
        c.input_dtype = input_dtypes[variant % 3];
        c.q_out_dtype = q_out_dtype;
        c.k_out_dtype = k_out_dtypes[variant % 4];
        c.position_dtype = variant % 2 ? DType::kInt32 : DType::kInt64;
        // Scales that make some fp8 values saturate (inputs reach 8) and some go subnormal.
        c.q_scale = variant % 2 ? 0.0125f : 1.0f;
        c.k_scale = variant % 3 ? 0.6f : 0.0155f;
        c.strided = variant % 5 < 2;
        c.seed = seed++;
        run_case(c);
      }
}

TEST(RopeQuantize, OtherHeadCounts) {
  uint64_t seed = 200;
  for (int heads : {2, 12, 24, 96}) {
    run_case({3, heads, RopeStyle::kNeox, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3,
              DType::kInt64, 0.02f, 0.03f, true, seed++});
    run_case({1, heads, RopeStyle::kInterleaved, DType::kFP16, DType::kBF16, DType::kFP16,
              DType::kInt32, 1.0f, 1.0f, false, seed++});
  }
}

TEST(RopeQuantize, SaturatesFp8Outputs) {
  // Scales so small that nearly everything saturates at ±448 * scale.
  run_case({4, 16, RopeStyle::kNeox, DType::kFP32, DType::kFP8E4M3, DType::kFP8E4M3,
            DType::kInt32, 0.001f, 0.0005f, false, 300});
}

// A small valid setup whose fields the error tests break one at a time.
struct Fixture {
  static constexpr int T = 3, H = 2;
  HostTensor q_nope{DType::kBF16, {T, H, kNope}};
  HostTensor q_pe{DType::kBF16, {T, H, kRope}};
  HostTensor k_nope{DType::kBF16, {T, kNope}};
  HostTensor k_pe{DType::kBF16, {T, kRope}};
  HostTensor cos_sin{DType::kFP32, {8, kRope}};
  HostTensor positions = mla::test::int32_tensor({0, 7, 3});
  HostTensor q_out{DType::kFP8E4M3, {T, H, kEntry}};
  HostTensor k_nope_out{DType::kBF16, {T, kNope}};
  HostTensor k_pe_out{DType::kBF16, {T, kRope}};
  mla::RopeQuantizeArgs args;
  Fixture() {
    std::mt19937_64 rng(9);
    for (HostTensor* t : {&q_nope, &q_pe, &k_nope, &k_pe, &cos_sin}) t->fill_uniform(rng, -1, 1);
    for (HostTensor* t : {&q_out, &k_nope_out, &k_pe_out}) t->fill_nan();
    args.q_nope = q_nope.view();
    args.q_pe = q_pe.view();
    args.k_nope = k_nope.view();
    args.k_pe = k_pe.view();
    args.cos_sin_cache = cos_sin.view();
    args.positions = positions.view();
    args.q_out = q_out.view();
    args.k_nope_out = k_nope_out.view();
    args.k_pe_out = k_pe_out.view();
    args.q_scale = 0.5f;
  }
  bool outputs_untouched() const {
    for (const HostTensor* t : {&q_out, &k_nope_out, &k_pe_out})
      for (float v : t->to_float())
        if (!std::isnan(v)) return false;
    return true;
  }
};

TEST(RopeQuantize, FixtureIsValid) {
  Fixture f;
  ASSERT_NO_THROW(mla::rope_quantize(f.args));
  EXPECT_FALSE(std::isnan(f.q_out.get(f.q_out.numel() - 1)));
  EXPECT_FALSE(std::isnan(f.k_pe_out.get(f.k_pe_out.numel() - 1)));
  // Position 0 is angle 0 in a real table; here the table is random, so check one value by hand.
  const double x1 = f.k_pe.get(0), x2 = f.k_pe.get(kHalf);
  const double c = f.cos_sin.get(0), s = f.cos_sin.get(kHalf);
  EXPECT_NEAR(f.k_pe_out.get(0), x1 * c - x2 * s, 1e-2);
}

TEST(RopeQuantize, ZeroTokensIsANoOp) {
  Fixture f;
  HostTensor q_nope(DType::kBF16, {0, 2, kNope}), q_pe(DType::kBF16, {0, 2, kRope});
  HostTensor q_out(DType::kBF16, {0, 2, kEntry}), positions(DType::kInt64, {0});
  HostTensor no_positions(DType::kFP32, {0, kRope});
  f.args = {};
  f.args.q_nope = q_nope.view();
  f.args.q_pe = q_pe.view();
  f.args.q_out = q_out.view();
  f.args.positions = positions.view();
  f.args.cos_sin_cache = no_positions.view();
  EXPECT_NO_THROW(mla::rope_quantize(f.args));
}

TEST(RopeQuantize, OutOfRangePositionsRaiseAndWriteNothing) {
  for (int64_t bad : {int64_t(8), int64_t(-1), int64_t(1) << 35}) {
    Fixture f;
    HostTensor positions(DType::kInt64, {3});
    positions.i64(0) = 1;
    positions.i64(1) = 2;
    positions.i64(2) = bad;
    f.args.positions = positions.view();
    const std::string value = "positions[2] = " + std::to_string(bad);
    EXPECT_TRUE(throws_error([&] { mla::rope_quantize(f.args); },
                             {"rope_quantize", value.c_str(), "out of range", "[0, 8)"}));
    EXPECT_TRUE(f.outputs_untouched()) << bad;
  }
}

TEST(RopeQuantize, BadArgumentsNameTheArgument) {
  auto expect_error = [](auto mutate, std::initializer_list<const char*> fragments) {
    Fixture f;
    mutate(f);
    EXPECT_TRUE(throws_error([&] { mla::rope_quantize(f.args); }, fragments));
    EXPECT_TRUE(f.outputs_untouched());
  };
  constexpr int T = Fixture::T, H = Fixture::H;
  HostTensor big(DType::kBF16, {T, H, 2 * kEntry});
  HostTensor big2(DType::kBF16, {T, 2 * kEntry});
  HostTensor q_nope_129(DType::kBF16, {T, 129, kNope});
  HostTensor q_nope_0(DType::kBF16, {T, 0, kNope});
  HostTensor q_nope_fp8(DType::kFP8E4M3, {T, H, kNope});
  HostTensor q_nope_f32(DType::kFP32, {T, H, kNope});
  HostTensor q_out_f32(DType::kFP32, {T, H, kEntry});
  HostTensor k_f16(DType::kFP16, {T, kNope});
  HostTensor k_out_fp8(DType::kFP8E4M3, {T, kRope});
  HostTensor k_out_f32(DType::kFP32, {T, kNope});
  HostTensor cos_sin_f16(DType::kFP16, {8, kRope});
  HostTensor cos_sin_wide(DType::kFP32, {8, 2 * kRope});
  HostTensor positions_f32(DType::kFP32, {T});
  HostTensor positions_4 = mla::test::int32_tensor({0, 1, 2, 3});
  HostTensor positions_wide = mla::test::int32_tensor({0, 0, 1, 1, 2, 2});

  // q_nope
  expect_error([](Fixture& f) { f.args.q_nope = {}; }, {"rope_quantize", "q_nope", "required"});
  expect_error([](Fixture& f) { f.args.q_nope.ndim = 2; }, {"q_nope", "3 dims"});
  expect_error([&](Fixture& f) { f.args.q_nope = q_nope_129.view(); }, {"q_nope.shape[1]", "heads", "129"});
  expect_error([&](Fixture& f) { f.args.q_nope = q_nope_0.view(); }, {"q_nope.shape[1]", "heads", "got 0"});
  expect_error([](Fixture& f) { f.args.q_nope.shape[2] = 448; }, {"q_nope.shape[2]", "512"});
  expect_error([&](Fixture& f) { f.args.q_nope = q_nope_fp8.view(); }, {"q_nope", "bf16/fp16/fp32", "fp8e4m3"});
  expect_error([&](Fixture& f) {
    f.args.q_nope = TensorView::strided(big.data(), DType::kBF16, {T, H, kNope}, {H * 2 * kEntry, 2 * kEntry, 2});
  }, {"q_nope", "stride"});
  // q_pe
  expect_error([](Fixture& f) { f.args.q_pe = {}; }, {"q_pe", "required"});
  expect_error([](Fixture& f) { f.args.q_pe.shape[0] = 2; }, {"q_pe.shape[0]", "3"});
  expect_error([](Fixture& f) { f.args.q_pe.shape[1] = 1; }, {"q_pe.shape[1]", "heads"});
  expect_error([](Fixture& f) { f.args.q_pe.shape[2] = 32; }, {"q_pe.shape[2]", "64"});
  expect_error([&](Fixture& f) { f.args.q_nope = q_nope_f32.view(); }, {"q_pe", "fp32", "bf16"});
  expect_error([&](Fixture& f) {
    f.args.q_pe = TensorView::strided(big.data(), DType::kBF16, {T, H, kRope}, {H * 2 * kEntry, 2 * kEntry, 2});
  }, {"q_pe", "stride"});
  // q_out
  expect_error([](Fixture& f) { f.args.q_out = {}; }, {"q_out", "required"});
  expect_error([](Fixture& f) { f.args.q_out.shape[1] = 3; }, {"q_out.shape[1]", "heads"});
  expect_error([](Fixture& f) { f.args.q_out.shape[2] = kNope; }, {"q_out.shape[2]", "576"});
  expect_error([&](Fixture& f) { f.args.q_out = q_out_f32.view(); }, {"q_out", "bf16/fp16/fp8e4m3", "fp32"});
  expect_error([&](Fixture& f) {
    f.args.q_out = TensorView::strided(big.data(), DType::kBF16, {T, H, kEntry}, {H * 2 * kEntry, 2 * kEntry, 2});
  }, {"q_out", "stride"});
  // k tensors: all or nothing, shapes and dtypes
  expect_error([](Fixture& f) { f.args.k_pe = {}; }, {"k_pe", "required", "k_nope"});
  expect_error([](Fixture& f) { f.args.k_nope_out = {}; }, {"k_nope_out", "required"});
  expect_error([](Fixture& f) { f.args.k_pe_out = {}; }, {"k_pe_out", "required"});
  expect_error([](Fixture& f) { f.args.k_nope = {}; }, {"k_pe", "given but k_nope is not"});
  expect_error([](Fixture& f) { f.args.k_nope = {}; f.args.k_pe = {}; }, {"k_nope_out", "k_nope is not"});
  expect_error([](Fixture& f) { f.args.k_nope = {}; f.args.k_pe = {}; f.args.k_nope_out = {}; },
               {"k_pe_out", "k_nope is not"});
  expect_error([](Fixture& f) { f.args.k_nope.shape[0] = 4; }, {"k_nope.shape[0]", "3"});
  expect_error([](Fixture& f) { f.args.k_nope.shape[1] = 576; }, {"k_nope.shape[1]", "512"});
  expect_error([&](Fixture& f) { f.args.k_nope = k_f16.view(); }, {"k_nope", "bf16", "fp16"});
  expect_error([](Fixture& f) { f.args.k_pe.ndim = 3; f.args.k_pe.shape[2] = 1; }, {"k_pe", "2 dims"});
  expect_error([](Fixture& f) { f.args.k_pe.shape[1] = 63; }, {"k_pe.shape[1]", "64"});
  expect_error([](Fixture& f) { f.args.k_pe.dtype = DType::kFP32; }, {"k_pe", "bf16"});
  expect_error([&](Fixture& f) {
    f.args.k_nope = TensorView::strided(big2.data(), DType::kBF16, {T, kNope}, {2 * kEntry, 2});
  }, {"k_nope", "stride"});
  expect_error([&](Fixture& f) {
    f.args.k_pe = TensorView::strided(big2.data(), DType::kBF16, {T, kRope}, {2 * kEntry, 2});
  }, {"k_pe", "stride"});
  expect_error([](Fixture& f) { f.args.k_nope_out.shape[0] = 2; }, {"k_nope_out.shape[0]", "3"});
  expect_error([&](Fixture& f) { f.args.k_nope_out = k_out_f32.view(); }, {"k_nope_out", "bf16/fp16/fp8e4m3"});
  expect_error([&](Fixture& f) {
    f.args.k_nope_out = TensorView::strided(big2.data(), DType::kBF16, {T, kNope}, {2 * kEntry, 2});
  }, {"k_nope_out", "stride"});
  expect_error([](Fixture& f) { f.args.k_pe_out.shape[1] = 576; }, {"k_pe_out.shape[1]", "64"});
  // Outputs whose elements share an address (heads laid over each other, a token stride of 0).
  expect_error([&](Fixture& f) {
    f.args.q_out = TensorView::strided(big.data(), DType::kBF16, {T, H, kEntry}, {H * 2 * kEntry, 0, 1});
  }, {"q_out", "overlap", "stride[1]"});
  expect_error([&](Fixture& f) {
    f.args.k_nope_out = TensorView::strided(big2.data(), DType::kBF16, {T, kNope}, {0, 1});
  }, {"k_nope_out", "overlap"});
  expect_error([&](Fixture& f) {
    f.args.k_pe_out = TensorView::strided(big2.data(), DType::kBF16, {T, kRope}, {32, 1});
  }, {"k_pe_out", "overlap"});
  // Outputs over inputs or over each other: an in-place call is not supported.
  expect_error([&](Fixture& f) {
    f.args.q_nope = TensorView::strided(big.data(), DType::kBF16, {T, H, kNope}, {H * 2 * kEntry, 2 * kEntry, 1});
    f.args.q_out = TensorView::strided(big.data(), DType::kBF16, {T, H, kEntry}, {H * 2 * kEntry, 2 * kEntry, 1});
  }, {"rope_quantize: q_out", "overlaps q_nope", "give q_out its own memory"});
  expect_error([](Fixture& f) { f.args.k_nope_out = f.args.k_nope; }, {"k_nope_out", "overlaps k_nope"});
  expect_error([](Fixture& f) { f.args.k_pe_out = f.args.k_pe; }, {"k_pe_out", "overlaps k_pe"});
  expect_error([](Fixture& f) {
    f.args.k_pe_out = TensorView::strided(f.q_pe.data(), DType::kBF16, {T, kRope}, {H * kRope, 1});
  }, {"k_pe_out", "overlaps q_pe"});
  expect_error([&](Fixture& f) {
    f.args.q_out = TensorView::strided(big.data(), DType::kBF16, {T, H, kEntry}, {H * 2 * kEntry, 2 * kEntry, 1});
    f.args.k_pe_out = TensorView::strided(static_cast<uint16_t*>(big.data()) + kNope, DType::kBF16, {T, kRope},
                                          {H * 2 * kEntry, 1});  // head 0's rope columns
  }, {"k_pe_out", "overlaps q_out"});
  expect_error([&](Fixture& f) { f.args.k_pe_out = k_out_fp8.view(); }, {"k_pe_out", "bf16", "fp8e4m3"});
  expect_error([&](Fixture& f) {
    f.args.k_pe_out = TensorView::strided(big2.data(), DType::kBF16, {T, kRope}, {2 * kEntry, 2});
  }, {"k_pe_out", "stride"});
  // cos_sin_cache and positions
  expect_error([](Fixture& f) { f.args.cos_sin_cache = {}; }, {"cos_sin_cache", "required"});
  expect_error([](Fixture& f) { f.args.cos_sin_cache.ndim = 1; }, {"cos_sin_cache", "2 dims"});
  expect_error([](Fixture& f) { f.args.cos_sin_cache.shape[1] = 32; }, {"cos_sin_cache.shape[1]", "64"});
  expect_error([&](Fixture& f) { f.args.cos_sin_cache = cos_sin_f16.view(); }, {"cos_sin_cache", "fp32", "fp16"});
  expect_error([&](Fixture& f) {
    f.args.cos_sin_cache = TensorView::strided(cos_sin_wide.data(), DType::kFP32, {8, kRope}, {2 * kRope, 2});
  }, {"cos_sin_cache", "stride"});
  expect_error([](Fixture& f) { f.args.positions = {}; }, {"positions", "required"});
  expect_error([&](Fixture& f) { f.args.positions = positions_4.view(); }, {"positions.shape[0]", "3"});
  expect_error([&](Fixture& f) { f.args.positions = positions_f32.view(); }, {"positions", "int32/int64", "fp32"});
  expect_error([&](Fixture& f) {
    f.args.positions = TensorView::strided(positions_wide.data(), DType::kInt32, {T}, {2});
  }, {"positions", "stride"});
  // Scalars
  for (float bad : {0.0f, -0.5f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    expect_error([bad](Fixture& f) { f.args.q_scale = bad; }, {"rope_quantize", "q_scale"});
    expect_error([bad](Fixture& f) { f.args.k_scale = bad; }, {"rope_quantize", "k_scale"});
  }
  expect_error([](Fixture& f) { f.args.style = static_cast<RopeStyle>(7); }, {"style", "7"});
  // Devices
  expect_error([](Fixture& f) { f.args.q_out.device = mla::Device::cuda(0); }, {"q_out", "cuda:0", "q_nope"});
  expect_error([](Fixture& f) { f.args.cos_sin_cache.device = mla::Device::cuda(0); }, {"cos_sin_cache", "cuda:0"});
  expect_error([](Fixture& f) { f.args.k_pe_out.device = mla::Device::cuda(0); }, {"k_pe_out", "cuda:0"});
#if !defined(MLA_WITH_CUDA)
  expect_error([](Fixture& f) {
    for (TensorView* t : {&f.args.q_nope, &f.args.q_pe, &f.args.k_nope, &f.args.k_pe,
                          &f.args.cos_sin_cache, &f.args.positions, &f.args.q_out,
                          &f.args.k_nope_out, &f.args.k_pe_out})
      t->device = mla::Device::cuda(0);
  }, {"rope_quantize", "no CUDA support"});
#endif
}

}  // namespace
