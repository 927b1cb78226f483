// append_latent_kv on the CPU: every element of a NaN-poisoned pool checked against a float64
// reference (written slots hold the converted latent, all others stay NaN), for every page size,
// bf16/fp16/fp8 caches (with k_scale and saturation), int32/int64 slots, skipped tokens and strided
// inputs; and every bad argument raises mla::Error naming it.
#include <algorithm>
#include <numeric>

#include "mla/ops.hpp"
#include "test_util.hpp"

namespace {

using mla::DType;
using mla::TensorView;
using mla::test::HostTensor;
using mla::test::throws_error;

constexpr int kNope = mla::kKvLoraRank;  // 512
constexpr int kRope = mla::kRopeDim;     // 64
constexpr int kEntry = mla::kLatentDim;  // 576

// Element tolerance of a stored value against the exact value it should approximate (in the
// dequantised domain for fp8): half a unit in the last place, relative, plus half the smallest
// subnormal step.
struct Tolerance {
  double atol, rtol;
};
Tolerance tolerance_for(DType cache_dtype, double k_scale) {
  switch (cache_dtype) {
    case DType::kBF16: return {1e-38, 0x1p-8};
    case DType::kFP16: return {0x1p-25, 0x1p-11};
    default: return {0x1p-10 * k_scale * 1.0001, 0x1p-4 * 1.0001};
  }
}

void* byte_offset(HostTensor& t, int64_t elements) {
  return static_cast<unsigned char*>(t.data()) + elements * int64_t(mla::dtype_size(t.dtype));
}

// Random magnitude 2^U(lo, hi) with a random sign, so that every binade of the target (subnormals
// and saturation included) is exercised.
float log_uniform(std::mt19937_64& rng, double lo, double hi, double scale) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  const double magnitude = std::exp2(exponent(rng)) * scale;
  return float((rng() & 1) ? -magnitude : magnitude);
}

struct AppendCase {
  DType input_dtype;
  DType cache_dtype;
  DType loc_dtype;
  int page_size;
  int num_pages;
  int num_tokens;
  float k_scale;
  bool strided_inputs;  // k_nope and k_pe as column slices of one [T, 576 + pad] buffer
  uint64_t seed;
};

std::string describe(const AppendCase& c) {
  std::ostringstream os;
  os << "input " << mla::dtype_name(c.input_dtype) << ", cache " << mla::dtype_name(c.cache_dtype)
     << ", loc " << mla::dtype_name(c.loc_dtype) << ", page_size " << c.page_size << ", pages "
     << c.num_pages << ", tokens " << c.num_tokens << ", k_scale " << c.k_scale
     << (c.strided_inputs ? ", strided" : "");
  return os.str();
}

void run_case(const AppendCase& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int64_t T = c.num_tokens, S = c.page_size, P = c.num_pages;
  const bool fp8 = c.cache_dtype == DType::kFP8E4M3;

  // Inputs. fp8: magnitudes from below the smallest subnormal to past 448 (saturation) in units of
  // k_scale; bf16/fp16: magnitudes down into the fp16 subnormal range.
  const int64_t row_stride = c.strided_inputs ? kEntry + 13 : 0;
  HostTensor k_nope_buf, k_pe_buf;
  TensorView k_nope, k_pe;
  if (c.strided_inputs) {
    k_nope_buf = HostTensor(c.input_dtype, {T, row_stride});
    k_nope = TensorView::strided(k_nope_buf.data(), c.input_dtype, {T, kNope}, {row_stride, 1});
    k_pe = TensorView::strided(byte_offset(k_nope_buf, kNope + 5), c.input_dtype, {T, kRope},
                               {row_stride, 1});
  } else {
    k_nope_buf = HostTensor(c.input_dtype, {T, kNope});
    k_pe_buf = HostTensor(c.input_dtype, {T, kRope});
    k_nope = k_nope_buf.view();
    k_pe = k_pe_buf.view();
  }
  auto input_value = [&](int64_t t, int64_t d) {  // element d of token t's 576-wide latent
    const TensorView& src = d < kNope ? k_nope : k_pe;
    return double(mla::load_as_float(src.data, src.dtype, t * src.stride[0] + (d < kNope ? d : d - kNope)));
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < kEntry; ++d) {
      const float v = fp8 ? log_uniform(rng, -12, 9.2, c.k_scale) : log_uniform(rng, -18, 6, 1.0);
      const TensorView& dst = d < kNope ? k_nope : k_pe;
      mla::store_from_float(dst.data, dst.dtype, t * dst.stride[0] + (d < kNope ? d : d - kNope), v);
    }

  // Distinct random slots; about one token in five is padding (-1).
  std::vector<int64_t> slots(size_t(P * S));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int64_t> token_slot(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) token_slot[size_t(t)] = (rng() % 5 == 0) ? -1 : slots[size_t(t)];
  HostTensor loc(c.loc_dtype, {T});
  for (int64_t t = 0; t < T; ++t) {
    if (c.loc_dtype == DType::kInt32) loc.i32(t) = int32_t(token_slot[size_t(t)]);
    else loc.i64(t) = token_slot[size_t(t)];
  }

  HostTensor cache(c.cache_dtype, {P, S, kEntry});
  cache.fill_nan();

  mla::AppendLatentKvArgs args;
  args.k_nope = k_nope;
  args.k_pe = k_pe;
  args.loc = loc.view();
  args.kv_cache = cache.view();
  args.k_scale = c.k_scale;
  ASSERT_NO_THROW(mla::append_latent_kv(args));

  // Float64 reference over the whole pool.
  std::vector<double> expected(size_t(cache.numel()), std::numeric_limits<double>::quiet_NaN());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = token_slot[size_t(t)];
    if (slot < 0) continue;
    const int64_t page = slot / S, offset = slot % S;
    for (int64_t d = 0; d < kEntry; ++d) {
      double x = input_value(t, d);
      if (fp8) x = std::clamp(x / c.k_scale, -448.0, 448.0) * c.k_scale;
      expected[size_t((page * S + offset) * kEntry + d)] = x;
    }
  }
  std::vector<float> actual = cache.to_float();
  if (fp8)
    for (float& v : actual) v *= c.k_scale;
  const Tolerance tol = tolerance_for(c.cache_dtype, c.k_scale);
  EXPECT_TRUE(mla::test::all_close(actual, expected, tol.atol, tol.rtol));
}

TEST(AppendLatentKv, EveryPageSizeAndCacheDtype) {
  const DType input_dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  const DType cache_dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP8E4M3};
  uint64_t seed = 1;
  int variant = 0;
  for (int page_size = 1; page_size <= 128; page_size *= 2) {
    const int num_pages = std::max(2, 96 / page_size) + 1;  // small pools, odd page counts
    const int num_slots = num_pages * page_size;
    for (DType cache_dtype : cache_dtypes) {
      ++variant;
      AppendCase c;
      c.input_dtype = input_dtypes[variant % 3];
      c.cache_dtype = cache_dtype;
      c.loc_dtype = variant % 2 ? DType::kInt32 : DType::kInt64;
      c.page_size = page_size;
      c.num_pages = num_pages;
      c.num_tokens = std::min(num_slots, 1 + variant % 7 * 9);  // 1 .. 55 tokens, odd counts
      c.k_scale = cache_dtype == DType::kFP8E4M3 ? (variant % 2 ? 0.0375f : 3.0f) : 1.0f;
      c.strided_inputs = variant % 4 >= 2;
      c.seed = seed++;
      run_case(c);
    }
  }
}

TEST(AppendLatentKv, FillsAWholePool) {
  // As many tokens as slots: every slot of the pool is written except those of skipped tokens.
  for (DType cache_dtype : {DType::kBF16, DType::kFP8E4M3})
    run_case({DType::kFP32, cache_dtype, DType::kInt64, 16, 5, 80, 0.5f, true, 77});
}

TEST(AppendLatentKv, SingleTokenAndSinglePage) {
  run_case({DType::kBF16, DType::kBF16, DType::kInt32, 1, 1, 1, 1.0f, false, 5});
  run_case({DType::kFP16, DType::kFP16, DType::kInt64, 128, 1, 3, 1.0f, true, 6});
  run_case({DType::kBF16, DType::kFP8E4M3, DType::kInt32, 64, 1, 1, 1.0f, false, 7});
}

// A small valid setup whose fields the error tests break one at a time.
struct Fixture {
  HostTensor k_nope{DType::kBF16, {3, kNope}};
  HostTensor k_pe{DType::kBF16, {3, kRope}};
  HostTensor loc = mla::test::int32_tensor({0, -1, 5});
  HostTensor cache{DType::kBF16, {2, 4, kEntry}};
  mla::AppendLatentKvArgs args;
  Fixture() {
    std::mt19937_64 rng(3);
    k_nope.fill_uniform(rng, -1, 1);
    k_pe.fill_uniform(rng, -1, 1);
    cache.fill_nan();
    args.k_nope = k_nope.view();
    args.k_pe = k_pe.view();
    args.loc = loc.view();
    args.kv_cache = cache.view();
  }
  bool cache_untouched() const {
    for (float v : cache.to_float())
      if (!std::isnan(v)) return false;
    return true;
  }
};

TEST(AppendLatentKv, FixtureIsValid) {
  Fixture f;
  ASSERT_NO_THROW(mla::append_latent_kv(f.args));
  // Slot 0 and slot 5 written, all else NaN.
  const auto v = f.cache.to_float();
  for (int64_t slot = 0; slot < 8; ++slot)
    for (int64_t d = 0; d < kEntry; ++d)
      ASSERT_EQ(std::isnan(v[size_t(slot * kEntry + d)]), slot != 0 && slot != 5) << slot << " " << d;
  EXPECT_EQ(v[size_t(5 * kEntry + 3)], f.k_nope.get(2 * kNope + 3));
  EXPECT_EQ(v[size_t(5 * kEntry + kNope + 63)], f.k_pe.get(2 * kRope + 63));
}

TEST(AppendLatentKv, ZeroTokensIsANoOp) {
  Fixture f;
  HostTensor k_nope(DType::kBF16, {0, kNope}), k_pe(DType::kBF16, {0, kRope});
  HostTensor loc(DType::kInt64, {0});
  f.args.k_nope = k_nope.view();
  f.args.k_pe = k_pe.view();
  f.args.loc = loc.view();
  ASSERT_NO_THROW(mla::append_latent_kv(f.args));
  EXPECT_TRUE(f.cache_untouched());
  // Also with an empty pool.
  HostTensor empty_cache(DType::kBF16, {0, 4, kEntry});
  f.args.kv_cache = empty_cache.view();
  EXPECT_NO_THROW(mla::append_latent_kv(f.args));
}

TEST(AppendLatentKv, AllTokensSkipped) {
  Fixture f;
  f.loc = mla::test::int32_tensor({-1, -1, -1});
  f.args.loc = f.loc.view();
  ASSERT_NO_THROW(mla::append_latent_kv(f.args));
  EXPECT_TRUE(f.cache_untouched());
}

TEST(AppendLatentKv, OutOfRangeSlotsRaiseAndWriteNothing) {
  for (int64_t bad : {int64_t(8), int64_t(1000), int64_t(-2), int64_t(1) << 40}) {
    Fixture f;
    HostTensor loc(DType::kInt64, {3});
    loc.i64(0) = 1;  // valid, before the bad one: must not be written either
    loc.i64(1) = -1;
    loc.i64(2) = bad;
    f.args.loc = loc.view();
    const std::string value = "loc[2] = " + std::to_string(bad);
    EXPECT_TRUE(throws_error([&] { mla::append_latent_kv(f.args); },
                             {"append_latent_kv", value.c_str(), "out of range", "[0, 8)"}));
    EXPECT_TRUE(f.cache_untouched()) << bad;
  }
  Fixture f;
  f.loc = mla::test::int32_tensor({8, 0, 0});
  f.args.loc = f.loc.view();
  EXPECT_TRUE(throws_error([&] { mla::append_latent_kv(f.args); }, {"loc[0] = 8"}));
  EXPECT_TRUE(f.cache_untouched());
}

TEST(AppendLatentKv, BadArgumentsNameTheArgument) {
  auto expect_error = [](auto mutate, std::initializer_list<const char*> fragments) {
    Fixture f;
    mutate(f);
    EXPECT_TRUE(throws_error([&] { mla::append_latent_kv(f.args); }, fragments));
    EXPECT_TRUE(f.cache_untouched());
  };
  HostTensor wide(DType::kBF16, {3, 2 * kEntry});
  HostTensor f32_nope(DType::kFP32, {3, kNope});
  HostTensor i32_nope(DType::kInt32, {3, kNope});
  HostTensor fp8_nope(DType::kFP8E4M3, {3, kNope});
  HostTensor f32_cache(DType::kFP32, {2, 4, kEntry});
  HostTensor cache_96(DType::kBF16, {2, 96, kEntry});
  HostTensor cache_256(DType::kBF16, {1, 256, kEntry});
  HostTensor cache_0(DType::kBF16, {2, 0, kEntry});
  HostTensor cache_512(DType::kBF16, {2, 4, 512});
  HostTensor cache_big(DType::kBF16, {4, 4, kEntry});
  HostTensor loc_f32(DType::kFP32, {3});
  HostTensor loc_2d(DType::kInt32, {3, 1});
  HostTensor loc_4 = mla::test::int32_tensor({0, 1, 2, 3});
  HostTensor loc_wide = mla::test::int32_tensor({0, 9, 1, 9, 2, 9});

  // k_nope
  expect_error([](Fixture& f) { f.args.k_nope = {}; }, {"append_latent_kv", "k_nope", "required"});
  expect_error([](Fixture& f) { f.args.k_nope.ndim = 3; f.args.k_nope.shape[2] = 1; }, {"k_nope", "2 dims"});
  expect_error([](Fixture& f) { f.args.k_nope.shape[1] = 511; }, {"k_nope.shape[1]", "512"});
  expect_error([&](Fixture& f) { f.args.k_nope = i32_nope.view(); }, {"k_nope", "bf16/fp16/fp32", "int32"});
  expect_error([&](Fixture& f) { f.args.k_nope = fp8_nope.view(); }, {"k_nope", "fp8e4m3"});
  expect_error([&](Fixture& f) {
    f.args.k_nope = TensorView::strided(wide.data(), DType::kBF16, {3, kNope}, {2 * kEntry, 2});
  }, {"k_nope", "stride"});
  expect_error([](Fixture& f) { f.args.k_nope.data = nullptr; }, {"k_nope", "null"});
  expect_error([](Fixture& f) { f.args.k_nope.shape[0] = -1; }, {"k_nope.shape[0]", ">= 0"});
  // Inputs inside the cache (entries moved within it): the result would depend on write order.
  expect_error([](Fixture& f) {
    f.args.k_nope = TensorView::strided(f.cache.data(), DType::kBF16, {3, kNope}, {kEntry, 1});
  }, {"append_latent_kv: kv_cache", "overlaps k_nope"});
  // k_pe
  expect_error([](Fixture& f) { f.args.k_pe = {}; }, {"k_pe", "required"});
  expect_error([](Fixture& f) { f.args.k_pe.shape[0] = 2; }, {"k_pe.shape[0]", "3"});
  expect_error([](Fixture& f) { f.args.k_pe.shape[1] = 32; }, {"k_pe.shape[1]", "64"});
  expect_error([](Fixture& f) { f.args.k_pe.dtype = DType::kFP16; }, {"k_pe", "bf16", "fp16"});
  expect_error([&](Fixture& f) { f.args.k_nope = f32_nope.view(); }, {"k_pe", "fp32", "bf16"});
  expect_error([&](Fixture& f) {
    f.args.k_pe = TensorView::strided(wide.data(), DType::kBF16, {3, kRope}, {2 * kEntry, 3});
  }, {"k_pe", "stride"});
  // loc
  expect_error([](Fixture& f) { f.args.loc = {}; }, {"loc", "required"});
  expect_error([&](Fixture& f) { f.args.loc = loc_2d.view(); }, {"loc", "1 dims"});
  expect_error([&](Fixture& f) { f.args.loc = loc_4.view(); }, {"loc.shape[0]", "3"});
  expect_error([&](Fixture& f) { f.args.loc = loc_f32.view(); }, {"loc", "int32/int64", "fp32"});
  expect_error([&](Fixture& f) {
    f.args.loc = TensorView::strided(loc_wide.data(), DType::kInt32, {3}, {2});
  }, {"loc", "stride"});
  // kv_cache
  expect_error([](Fixture& f) { f.args.kv_cache = {}; }, {"kv_cache", "required"});
  expect_error([](Fixture& f) { f.args.kv_cache.ndim = 2; }, {"kv_cache", "3 dims"});
  expect_error([&](Fixture& f) { f.args.kv_cache = cache_96.view(); }, {"kv_cache.shape[1]", "power of two", "96"});
  expect_error([&](Fixture& f) { f.args.kv_cache = cache_256.view(); }, {"kv_cache.shape[1]", "256"});
  expect_error([&](Fixture& f) { f.args.kv_cache = cache_0.view(); }, {"kv_cache.shape[1]", "got 0"});
  expect_error([&](Fixture& f) { f.args.kv_cache = cache_512.view(); }, {"kv_cache.shape[2]", "576"});
  expect_error([&](Fixture& f) { f.args.kv_cache = f32_cache.view(); }, {"kv_cache", "bf16/fp16/fp8e4m3", "fp32"});
  expect_error([&](Fixture& f) {
    // Every other page of a larger pool: not contiguous.
    f.args.kv_cache = TensorView::strided(cache_big.data(), DType::kBF16, {2, 4, kEntry},
                                          {2 * 4 * kEntry, kEntry, 1});
  }, {"kv_cache", "contiguous"});
  // k_scale
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()})
    expect_error([bad](Fixture& f) { f.args.k_scale = bad; }, {"append_latent_kv", "k_scale"});
  // Devices
  expect_error([](Fixture& f) { f.args.kv_cache.device = mla::Device::cuda(0); },
               {"kv_cache", "cuda:0", "k_nope", "cpu"});
  expect_error([](Fixture& f) { f.args.loc.device = mla::Device::cuda(1); }, {"loc", "cuda:1"});
#if !defined(MLA_WITH_CUDA)
  expect_error([](Fixture& f) {
    for (TensorView* t : {&f.args.k_nope, &f.args.k_pe, &f.args.loc, &f.args.kv_cache})
      t->device = mla::Device::cuda(0);
  }, {"append_latent_kv", "no CUDA support"});
#endif
}

}  // namespace
