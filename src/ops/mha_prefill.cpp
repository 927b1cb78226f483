// mha_prefill: public entry — placeholder until its implementation lands.
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {
void mha_prefill(const MhaPrefillArgs&, Stream) { MLA_FAIL("mha_prefill: not implemented yet"); }
}  // namespace mla
