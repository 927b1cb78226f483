// merge_states on the CPU against the float64 reference in attention_reference.hpp.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention_reference.hpp"
#include "mla/ops.hpp"
#include "test_util.hpp"

namespace mla::test {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct MergeProblem {
  HostTensor out_a, lse_a, out_b, lse_b, out, lse_out;
  MergeStatesArgs args;
};

// Which sides of a row hold keys.
enum class Sides { kBoth, kOnlyA, kOnlyB, kNone };

// Random partial states over [T, H, Dv]; row r gets sides[r % sides.size()]. A side without keys
// has lse -inf and an output of NaN (which must not leak into the result).
MergeProblem make_problem(int64_t T, int64_t H, int64_t Dv, DType dtype_a, DType dtype_b,
                          DType dtype_out, const std::vector<Sides>& sides, uint64_t seed,
                          float lse_spread = 4.0f) {
  MergeProblem p;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> lse(-lse_spread, lse_spread);
  p.out_a = HostTensor(dtype_a, {T, H, Dv});
  p.out_b = HostTensor(dtype_b, {T, H, Dv});
  p.lse_a = HostTensor(DType::kFP32, {T, H});
  p.lse_b = HostTensor(DType::kFP32, {T, H});
  p.out_a.fill_uniform(rng, -2.0f, 2.0f);
  p.out_b.fill_uniform(rng, -2.0f, 2.0f);
  for (int64_t row = 0; row < T * H; ++row) {
    const Sides side = sides[size_t(row) % sides.size()];
    const bool has_a = side == Sides::kBoth || side == Sides::kOnlyA;
    const bool has_b = side == Sides::kBoth || side == Sides::kOnlyB;
    p.lse_a.set(row, has_a ? lse(rng) : kNegInf);
    p.lse_b.set(row, has_b ? lse(rng) : kNegInf);
    for (int64_t c = 0; c < Dv; ++c) {
      if (!has_a) p.out_a.set(row * Dv + c, kNaN);
      if (!has_b) p.out_b.set(row * Dv + c, kNaN);
    }
  }
  p.out = HostTensor(dtype_out, {T, H, Dv});
  p.lse_out = HostTensor(DType::kFP32, {T, H});
  p.out.fill_nan();
  p.lse_out.fill_nan();
  p.args.out_a = p.out_a.view();
  p.args.lse_a = p.lse_a.view();
  p.args.out_b = p.out_b.view();
  p.args.lse_b = p.lse_b.view();
  p.args.out = p.out.view();
  p.args.lse_out = p.lse_out.view();
  return p;
}

double out_rtol(DType dtype) {
  return dtype == DType::kBF16 ? 4e-3 : dtype == DType::kFP16 ? 1e-3 : 1e-6;
}

void check(const MergeStatesArgs& args, const NaiveAttention& ref) {
  EXPECT_TRUE(all_close(gather_floats(args.out), ref.out, 1e-6, out_rtol(args.out.dtype)));
  if (!args.lse_out.empty())
    EXPECT_TRUE(all_close(gather_floats(args.lse_out), ref.lse, 1e-6, 1e-6));
}

TEST(MergeStatesCpu, RandomStatesAllDtypes) {
  const std::vector<Sides> both = {Sides::kBoth};
  int seed = 1;
  for (DType a : {DType::kFP32, DType::kBF16, DType::kFP16})
    for (DType out : {DType::kFP32, DType::kBF16, DType::kFP16}) {
      SCOPED_TRACE(std::string(dtype_name(a)) + " -> " + std::string(dtype_name(out)));
      MergeProblem p = make_problem(5, 3, 128, a, a == DType::kFP32 ? DType::kBF16 : a, out, both,
                                    uint64_t(seed++));
      const NaiveAttention ref = naive_merge_states(p.args);
      ASSERT_NO_THROW(merge_states(p.args));
      check(p.args, ref);
    }
}

TEST(MergeStatesCpu, SidesWithoutKeys) {
  const std::vector<Sides> mixed = {Sides::kBoth, Sides::kOnlyA, Sides::kOnlyB, Sides::kNone,
                                    Sides::kOnlyB};
  for (DType out : {DType::kFP32, DType::kBF16}) {
    MergeProblem p = make_problem(7, 5, 512, DType::kFP32, DType::kFP32, out, mixed, 11);
    const NaiveAttention ref = naive_merge_states(p.args);
    ASSERT_NO_THROW(merge_states(p.args));
    check(p.args, ref);
    // One side only: that side unchanged (up to output rounding); none: exactly 0 and -inf.
    const std::vector<float> merged = gather_floats(p.args.out);
    for (int64_t row = 0; row < 35; ++row) {
      const Sides side = mixed[size_t(row) % mixed.size()];
      if (side == Sides::kNone) {
        EXPECT_EQ(p.lse_out.get(row), kNegInf);
        for (int64_t c = 0; c < 512; ++c) ASSERT_EQ(merged[size_t(row * 512 + c)], 0.0f);
      } else if (side == Sides::kOnlyA && out == DType::kFP32) {
        EXPECT_EQ(p.lse_out.get(row), p.lse_a.get(row));
        for (int64_t c = 0; c < 512; ++c)
          ASSERT_EQ(merged[size_t(row * 512 + c)], p.out_a.get(row * 512 + c));
      }
    }
  }
}

// Merging with a side of weight 0 (lse -inf, or so far below the other that its weight rounds
// to 0) returns the other side bit for bit, -0 included: the deterministic chunked prefix relies
// on merges with a request's empty chunks changing nothing.
TEST(MergeStatesCpu, AWeightlessSideLeavesEveryBitOfTheOther) {
  const std::vector<Sides> sides = {Sides::kOnlyA, Sides::kOnlyB, Sides::kBoth};
  MergeProblem p = make_problem(3, 4, 64, DType::kFP32, DType::kFP32, DType::kFP32, sides, 13);
  for (int64_t row = 0; row < 12; ++row) {
    if (sides[size_t(row) % sides.size()] == Sides::kBoth) p.lse_b.set(row, p.lse_a.get(row) - 200.0f);
    for (int64_t c = 0; c < 64; c += 3) {  // signed zeros among the values
      p.out_a.set(row * 64 + c, -0.0f);
      p.out_b.set(row * 64 + c, -0.0f);
    }
  }
  ASSERT_NO_THROW(merge_states(p.args));
  for (int64_t row = 0; row < 12; ++row) {
    const bool only_b = sides[size_t(row) % sides.size()] == Sides::kOnlyB;
    const HostTensor& kept = only_b ? p.out_b : p.out_a;
    EXPECT_EQ(0, std::memcmp(static_cast<const float*>(p.out.data()) + row * 64,
                             static_cast<const float*>(kept.data()) + row * 64, 64 * sizeof(float)))
        << "row " << row;
    EXPECT_EQ(p.lse_out.get(row), (only_b ? p.lse_b : p.lse_a).get(row)) << "row " << row;
  }
}

TEST(MergeStatesCpu, FarApartLseIsStable) {
  const std::vector<Sides> both = {Sides::kBoth};
  MergeProblem p = make_problem(4, 4, 64, DType::kFP32, DType::kFP32, DType::kFP32, both, 12, 200.0f);
  const NaiveAttention ref = naive_merge_states(p.args);
  ASSERT_NO_THROW(merge_states(p.args));
  check(p.args, ref);
}

TEST(MergeStatesCpu, InPlaceAliasing) {
  const std::vector<Sides> mixed = {Sides::kBoth, Sides::kOnlyB, Sides::kBoth, Sides::kOnlyA};
  for (DType dtype : {DType::kFP32, DType::kBF16}) {
    for (bool into_a : {true, false}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (into_a ? " into a" : " into b"));
      MergeProblem p = make_problem(6, 4, 128, dtype, dtype, dtype, mixed, 13);
      // A side without keys holds zeros here, as the attention ops produce.
      for (int64_t row = 0; row < 24; ++row)
        for (int64_t c = 0; c < 128; ++c) {
          if (std::isnan(p.out_a.get(row * 128 + c))) p.out_a.set(row * 128 + c, 0.0f);
          if (std::isnan(p.out_b.get(row * 128 + c))) p.out_b.set(row * 128 + c, 0.0f);
        }
      const NaiveAttention ref = naive_merge_states(p.args);
      p.args.out = into_a ? p.args.out_a : p.args.out_b;
      p.args.lse_out = into_a ? p.args.lse_a : p.args.lse_b;
      ASSERT_NO_THROW(merge_states(p.args));
      check(p.args, ref);
    }
  }
}

// Only the very same view may be merged into: an output shifted over an input (row i's result
// would overwrite row i + 1's input before it is read), the same bytes as another dtype, or an
// output over the other kind of input are errors that name both, and nothing is written.
TEST(MergeStatesCpu, PartialOverlapIsAnError) {
  MergeProblem p = make_problem(4, 2, 16, DType::kFP32, DType::kFP32, DType::kFP32, {Sides::kBoth}, 17);
  std::mt19937_64 rng(18);
  HostTensor buffer(DType::kFP32, {5, 2, 16});  // one token more than the states
  buffer.fill_uniform(rng, -2.0f, 2.0f);
  auto a = p.args;
  a.out_a = TensorView::contiguous(buffer.data(), DType::kFP32, {4, 2, 16});
  a.out = TensorView::contiguous(static_cast<float*>(buffer.data()) + 32, DType::kFP32, {4, 2, 16});
  const std::vector<float> before = gather_floats(buffer.view());
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"merge_states: out", "partly overlaps out_a"}));
  EXPECT_EQ(gather_floats(buffer.view()), before);
  a.out = a.out_a;
  a.out.dtype = DType::kBF16;  // the same address, another dtype
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out", "partly overlaps out_a"}));
  a = p.args;
  a.out_b = TensorView::contiguous(buffer.data(), DType::kFP32, {4, 2, 16});
  a.out = TensorView::strided(buffer.data(), DType::kFP32, {4, 2, 16}, {16, 64, 1});  // transposed
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out", "partly overlaps out_b"}));
  a = p.args;
  HostTensor lse_buffer(DType::kFP32, {5, 2});
  lse_buffer.fill_uniform(rng, -2.0f, 2.0f);
  a.lse_a = TensorView::contiguous(lse_buffer.data(), DType::kFP32, {4, 2});
  a.lse_out = TensorView::contiguous(static_cast<float*>(lse_buffer.data()) + 2, DType::kFP32, {4, 2});
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_out", "partly overlaps lse_a"}));
  a = p.args;
  a.lse_b = TensorView::contiguous(buffer.data(), DType::kFP32, {4, 2});  // inside out's bytes
  a.out = TensorView::contiguous(buffer.data(), DType::kFP32, {4, 2, 16});
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out", "overlaps lse_b"}));
  a = p.args;
  a.lse_out = TensorView::contiguous(p.out_a.data(), DType::kFP32, {4, 2});
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_out", "overlaps out_a"}));
}

TEST(MergeStatesCpu, StridedViewsAndNoLse) {
  const std::vector<Sides> mixed = {Sides::kBoth, Sides::kNone, Sides::kOnlyA};
  MergeProblem p = make_problem(3, 4, 64, DType::kFP32, DType::kFP32, DType::kFP32, mixed, 14);
  // out as a head-major view with padding; lse_out omitted.
  HostTensor out_storage(DType::kFP32, {4, 3, 80});
  out_storage.fill_nan();
  p.args.out = TensorView::strided(out_storage.data(), DType::kFP32, {3, 4, 64}, {80, 240, 1});
  p.args.lse_out = TensorView();
  const NaiveAttention ref = naive_merge_states(p.args);
  ASSERT_NO_THROW(merge_states(p.args));
  EXPECT_TRUE(all_close(gather_floats(p.args.out), ref.out, 1e-6, 1e-6));
  int64_t written = 0;
  for (int64_t e = 0; e < out_storage.numel(); ++e) written += !std::isnan(out_storage.get(e));
  EXPECT_EQ(written, 3 * 4 * 64);
}

TEST(MergeStatesCpu, EmptyTokens) {
  MergeProblem p = make_problem(0, 4, 64, DType::kFP32, DType::kFP32, DType::kFP32, {Sides::kBoth}, 15);
  EXPECT_NO_THROW(merge_states(p.args));
}

TEST(MergeStatesCpu, BadArguments) {
  MergeProblem p = make_problem(2, 3, 16, DType::kFP32, DType::kFP32, DType::kFP32, {Sides::kBoth}, 16);
  auto a = p.args;
  a.out_b.shape[2] = 8;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"merge_states", "out_b.shape[2] must be 16"}));
  a = p.args;
  a.out.shape[0] = 3;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out.shape[0] must be 2"}));
  a = p.args;
  a.out_a.dtype = DType::kFP8E4M3;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out_a must be one of bf16/fp16/fp32"}));
  a = p.args;
  a.lse_b.dtype = DType::kBF16;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_b must be fp32"}));
  a = p.args;
  a.lse_a.shape[1] = 2;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_a.shape[1] must be 3"}));
  a = p.args;
  a.out.stride[2] = 2;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out", "contiguous last dimension"}));
  a = p.args;
  a.out.stride[0] = 0;  // every token's rows on the first token's
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"out is an output whose elements overlap"}));
  a = p.args;
  a.lse_out.stride[1] = 0;
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_out is an output whose elements overlap"}));
  a = p.args;
  a.lse_b = TensorView();
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_b is required"}));
  a = p.args;
  a.lse_out.device = Device::cuda(0);
  EXPECT_TRUE(throws_error([&] { merge_states(a); }, {"lse_out is on cuda:0"}));
}

}  // namespace
}  // namespace mla::test
