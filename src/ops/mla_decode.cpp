// mla_decode: public entry — placeholder until its implementation lands.
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {
void mla_decode(const MlaDecodeArgs&, Stream) { MLA_FAIL("mla_decode: not implemented yet"); }
}  // namespace mla
