// CPU reference implementations. Called by the public entries in src/ops/ after validation, so
// they may assume well-formed arguments (shapes, dtypes, devices checked); data-dependent checks
// (page ids, lengths) that can only be done by reading values are done here and throw mla::Error.
#pragma once

#include "mla/ops.hpp"

namespace mla::cpu {
void append_latent_kv(const AppendLatentKvArgs& args);
void build_block_table(const BuildBlockTableArgs& args);
void rope_quantize(const RopeQuantizeArgs& args);
void mla_decode(const MlaDecodeArgs& args);
void mha_prefill(const MhaPrefillArgs& args);
void merge_states(const MergeStatesArgs& args);
}  // namespace mla::cpu
