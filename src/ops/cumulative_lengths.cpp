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
  check::disjoint(op, "cu", cu, "lens", lens);  // cu is written while lens is read
  detail::prefix_sum_int32(op, "lens", lens, cu, stream);
}

}  // namespace mla
