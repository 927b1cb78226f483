// rope_quantize: public entry — placeholder until its implementation lands.
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {
void rope_quantize(const RopeQuantizeArgs&, Stream) { MLA_FAIL("rope_quantize: not implemented yet"); }
}  // namespace mla
