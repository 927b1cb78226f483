// mla::Error and its message formatting (no iostreams: std::to_chars for numbers).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace {

using mla::detail::format_message;

TEST(ErrorMessage, FormatsEveryKindOfPart) {
  const std::string s = "str";
  EXPECT_EQ(format_message("a ", s, ' ', std::string_view("view"), ' ', true, ' ', false), "a str view true false");
  EXPECT_EQ(format_message(0, ' ', -7, ' ', int64_t(1) << 40, ' ', uint64_t(18446744073709551615ull)),
            "0 -7 1099511627776 18446744073709551615");
  EXPECT_EQ(format_message(short(-3), ' ', (unsigned char)200, ' ', size_t(12)), "-3 200 12");
  // Floating point as %g: 6 significant digits.
  EXPECT_EQ(format_message(0.0, ' ', 0.1, ' ', 1.0f / 3.0f, ' ', 1e20, ' ', -2.5e-7), "0 0.1 0.333333 1e+20 -2.5e-07");
  EXPECT_EQ(format_message(std::numeric_limits<double>::infinity(), ' ', -std::numeric_limits<float>::infinity()),
            "inf -inf");
  // Pointers print as addresses, not as bool; a null C string as (null).
  const int x = 0;
  const std::string address = format_message(&x);
  EXPECT_EQ(address.rfind("0x", 0), 0u) << address;
  EXPECT_GT(address.size(), 2u);
  EXPECT_EQ(format_message(static_cast<const void*>(nullptr)), "0x0");
  EXPECT_EQ(format_message(static_cast<const char*>(nullptr)), "(null)");
  EXPECT_EQ(format_message(nullptr), "nullptr");
}

TEST(ErrorMessage, CheckThrowsWithMessageAndLocation) {
  try {
    MLA_CHECK(1 + 1 == 3, "op: x must be ", 3, ", got ", 2);
    FAIL() << "MLA_CHECK did not throw";
  } catch (const mla::Error& e) {
    EXPECT_EQ(e.message(), "op: x must be 3, got 2");
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("op: x must be 3, got 2 [", 0), 0u) << what;
    EXPECT_NE(what.find("test_error.cpp:"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(MLA_CHECK(true, "never"));
}

}  // namespace

// A hand-built view whose ndim is past what a TensorView holds is an error naming it, and is
// never walked past its shape array.
TEST(TensorChecks, ViewsWithImpossibleDimCountsAreErrors) {
  float storage[4] = {};
  for (int bad : {5, 100, -1}) {
    mla::TensorView t = mla::TensorView::contiguous(storage, mla::DType::kFP32, {4}, mla::Device::cpu());
    t.ndim = bad;
    try {
      mla::check::ndim("op", "x", t, 3);
      ADD_FAILURE() << "ndim " << bad << " was accepted";
    } catch (const mla::Error& e) {
      EXPECT_NE(std::string(e.what()).find("x.ndim must be in [0, 4]"), std::string::npos) << e.what();
    }
    EXPECT_NE(t.describe().find("dims"), std::string::npos);
  }
}

// check::non_overlapping: every dense, padded or transposed layout passes; a stride of 0 or rows
// laid over each other fail; a tensor with no elements writes nothing and passes.
TEST(TensorChecks, NonOverlappingOutputs) {
  float storage[64] = {};
  auto view = [&](std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride) {
    return mla::TensorView::strided(storage, mla::DType::kFP32, shape, stride, mla::Device::cpu());
  };
  const auto ok = [](const mla::TensorView& t) {
    try {
      mla::check::non_overlapping("op", "out", t);
      return true;
    } catch (const mla::Error&) {
      return false;
    }
  };
  EXPECT_TRUE(ok(view({2, 3, 4}, {12, 4, 1})));   // dense
  EXPECT_TRUE(ok(view({2, 3, 4}, {4, 8, 1})));    // head-major
  EXPECT_TRUE(ok(view({2, 3}, {1, 2})));          // transposed
  EXPECT_TRUE(ok(view({2, 1, 4}, {5, 0, 1})));    // size-1 dim with stride 0, padded rows
  EXPECT_TRUE(ok(view({0, 16, 4}, {4, 0, 1})));   // no elements
  EXPECT_FALSE(ok(view({2, 3, 4}, {12, 0, 1})));  // a broadcast dim
  EXPECT_FALSE(ok(view({3, 4}, {2, 1})));         // rows laid over each other
}

// check::disjoint / same_or_disjoint: apart spans pass; rows side by side in one buffer pass
// (k_nope_out and k_pe_out over a cache row) unless their columns meet; any shared byte fails and
// names both arguments; the very same view passes same_or_disjoint only (in place), a shifted one
// or another dtype over the same bytes fails it.
TEST(TensorChecks, DisjointOutputsAndInputs) {
  alignas(16) float storage[1024] = {};
  auto view = [&](int64_t offset, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> stride, mla::DType dtype = mla::DType::kFP32) {
    return mla::TensorView::strided(storage + offset, dtype, shape, stride, mla::Device::cpu());
  };
  const auto message = [](bool in_place, const mla::TensorView& out, const mla::TensorView& in) {
    try {
      if (in_place)
        mla::check::same_or_disjoint("op", "out", out, "in", in);
      else
        mla::check::disjoint("op", "out", out, "in", in);
      return std::string();
    } catch (const mla::Error& e) {
      return std::string(e.what());
    }
  };
  const mla::TensorView rows = view(64, {4, 8}, {8, 1});
  EXPECT_EQ(message(false, rows, view(96, {4, 8}, {8, 1})), "");  // right after it
  EXPECT_EQ(message(false, rows, view(32, {4, 8}, {8, 1})), "");  // right before it
  const std::string last = message(false, rows, view(95, {1, 1}, {1, 1}));
  EXPECT_EQ(last.find("op: out ([4, 8] fp32 cpu) overlaps in ([1, 1] fp32 cpu); give out its own memory"), 0u)
      << last;
  EXPECT_NE(message(false, rows, view(56, {4, 8}, {8, 1})), "");  // shifted back by one row
  // Side by side: [T, 576]-like rows of pitch 12, columns [0, 8) and [8, 12).
  const mla::TensorView left = view(0, {5, 8}, {12, 1});
  EXPECT_EQ(message(false, left, view(8, {5, 4}, {12, 1})), "");
  EXPECT_EQ(message(false, view(8, {5, 4}, {12, 1}), left), "");
  EXPECT_NE(message(false, left, view(7, {5, 4}, {12, 1})), "");   // column 7 shared
  EXPECT_NE(message(false, left, view(8, {5, 5}, {12, 1})), "");   // reaches the next row's column 0
  EXPECT_NE(message(false, left, view(8, {5, 4}, {10, 1})), "");   // another pitch: spans decide
  EXPECT_EQ(message(false, view(0, {2, 3, 8}, {36, 12, 1}), view(8, {2, 3, 4}, {36, 12, 1})), "");
  // Negative strides run down from data.
  EXPECT_NE(message(false, view(64, {4, 8}, {-8, 1}), view(40, {1, 8}, {8, 1})), "");
  EXPECT_EQ(message(false, view(64, {4, 8}, {-8, 1}), view(72, {1, 8}, {8, 1})), "");
  // Nothing written or read: no overlap.
  EXPECT_EQ(message(false, view(64, {0, 8}, {8, 1}), rows), "");
  // In place.
  EXPECT_EQ(message(true, rows, rows), "");
  EXPECT_EQ(message(false, rows, rows).empty(), false);
  const std::string shifted = message(true, rows, view(72, {4, 8}, {8, 1}));
  EXPECT_NE(shifted.find("op: out ([4, 8] fp32 cpu) partly overlaps in"), std::string::npos) << shifted;
  EXPECT_NE(message(true, rows, view(64, {4, 8}, {8, 1}, mla::DType::kInt32)), "");
  EXPECT_NE(message(true, rows, view(64, {4, 4}, {8, 1})), "");
}

// check::rows_aligned16: the base and every outer stride (over a dim of more than one element)
// a multiple of 16 bytes; the message names the argument, the stride and who needs it.
TEST(TensorChecks, RowsAlignedTo16Bytes) {
  alignas(16) uint16_t storage[512] = {};
  auto view = [&](int64_t offset, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> stride) {
    return mla::TensorView::strided(storage + offset, mla::DType::kBF16, shape, stride,
                                    mla::Device::cpu());
  };
  const auto message = [](const mla::TensorView& t) -> std::string {
    try {
      mla::check::rows_aligned16("op", "args.out", t, "on the GPU");
      return "";
    } catch (const mla::Error& e) {
      return e.what();
    }
  };
  EXPECT_EQ(message(view(0, {4, 2, 8}, {16, 8, 1})), "");
  EXPECT_EQ(message(view(0, {1, 1, 8}, {3, 5, 1})), "");  // size-1 dims are never stepped
  const std::string base = message(view(1, {4, 8}, {8, 1}));
  EXPECT_NE(base.find("args.out must be 16-byte aligned on the GPU"), std::string::npos) << base;
  const std::string stride = message(view(0, {4, 2, 8}, {20, 8, 1}));
  EXPECT_NE(stride.find("args.out.stride[0] must be a multiple of 16 bytes (8 elements) on the GPU, got 20"),
            std::string::npos) << stride;
}
