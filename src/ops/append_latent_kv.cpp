// append_latent_kv: public entry — placeholder until its implementation lands.
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {
void append_latent_kv(const AppendLatentKvArgs&, Stream) { MLA_FAIL("append_latent_kv: not implemented yet"); }
}  // namespace mla
