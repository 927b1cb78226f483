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
  // Byte ranges of the two views (a negative stride runs down from data): cu is written while
  // lens is read.
  auto range = [](const TensorView& t) {
    const auto data = reinterpret_cast<uintptr_t>(t.data);
    if (t.shape[0] == 0) return std::pair<uintptr_t, uintptr_t>{data, data};
    const int64_t elem = int64_t(dtype_size(t.dtype));
    const int64_t span = (t.shape[0] - 1) * t.stride[0] * elem;  // first to last element
    const uintptr_t lo = span < 0 ? data - uintptr_t(-span) : data;
    const uintptr_t hi = (span < 0 ? data : data + uintptr_t(span)) + uintptr_t(elem);
    return std::pair<uintptr_t, uintptr_t>{lo, hi};
  };
  const auto [lens_begin, lens_end] = range(lens);
  const auto [cu_begin, cu_end] = range(cu);
  MLA_CHECK(lens_begin == lens_end || cu_begin == cu_end || lens_end <= cu_begin || cu_end <= lens_begin,
            op, ": cu (", cu.describe(), ") overlaps lens (", lens.describe(),
            "); give cu its own memory");
  detail::prefix_sum_int32(op, "lens", lens, cu, stream);
}

}  // namespace mla
