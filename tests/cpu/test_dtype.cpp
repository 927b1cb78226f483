#include "test_util.hpp"

TEST(DType, RoundTripsSimpleValues) {
  EXPECT_EQ(mla::bf16_to_float(mla::float_to_bf16(1.5f)), 1.5f);
}
