// cumulative_lengths: public entry — the memory layer's prefix sum (src/backend/memory.hpp), with
// the argument checks an engine-facing op needs.
#include <cstdint>
#include <utility>

#include "backend/memory.hpp"
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {

void cumulative_lengths(const TensorView& lens, const TensorView& cu, Stream stream) {
  constexpr const char* op = "cumulative_lengths";
  check::ndim(op, "lens", lens, 1);
  check::ndim(op, "cu", cu, 1);
  // Byte ranges of the two views: cu is written while lens is read.
  auto range = [](const TensorView& t) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data);
    const int64_t extent = t.shape[0] == 0 ? 0 : (t.shape[0] - 1) * (t.stride[0] < 0 ? -t.stride[0] : t.stride[0]) + 1;
    return std::pair<uintptr_t, uintptr_t>{begin, begin + uintptr_t(extent) * dtype_size(t.dtype)};
  };
  const auto [lens_begin, lens_end] = range(lens);
  const auto [cu_begin, cu_end] = range(cu);
  MLA_CHECK(lens_begin == lens_end || cu_begin == cu_end || lens_end <= cu_begin || cu_end <= lens_begin,
            op, ": cu (", cu.describe(), ") overlaps lens (", lens.describe(),
            "); give cu its own memory");
  detail::prefix_sum_int32(op, "lens", lens, cu, stream);
}

}  // namespace mla
