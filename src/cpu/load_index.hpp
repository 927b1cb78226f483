// Reading host index tensors (slot ids, positions, lengths, request ids) of dtype int32 or int64.
#pragma once

#include <cstdint>

#include "mla/tensor.hpp"

namespace mla::cpu {

// Element i of a 1-D int32/int64 tensor in host memory, as int64.
inline int64_t load_index(const TensorView& t, int64_t i) {
  const int64_t offset = i * t.stride[0];
  return t.dtype == DType::kInt64 ? static_cast<const int64_t*>(t.data)[offset]
                                  : static_cast<const int32_t*>(t.data)[offset];
}

}  // namespace mla::cpu
