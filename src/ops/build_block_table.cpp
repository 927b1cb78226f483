// build_block_table: public entry — placeholder until its implementation lands.
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {
void build_block_table(const BuildBlockTableArgs&, Stream) { MLA_FAIL("build_block_table: not implemented yet"); }
}  // namespace mla
