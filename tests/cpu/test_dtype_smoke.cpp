#include "test_util.hpp"

TEST(DTypeSmoke, RoundTripsSimpleValues) {
  EXPECT_EQ(mla::bf16_to_float(mla::float_to_bf16(1.5f)), 1.5f);
  EXPECT_EQ(mla::fp16_to_float(mla::float_to_fp16(-2.25f)), -2.25f);
  EXPECT_EQ(mla::fp8e4m3_to_float(mla::float_to_fp8e4m3(1000.0f)), 448.0f);
}
