// CPU reference implementations. Called by the public entries in src/ops/ after validation, so
// they may assume well-formed arguments (shapes, dtypes, devices checked); data-dependent checks
// (page ids, lengths) that can only be done by reading values are done here and throw mla::Error.
#pragma once

#include <cstdint>
#include <functional>

#include "mla/ops.hpp"

namespace mla::cpu {
void append_latent_kv(const AppendLatentKvArgs& args);
// Checks every slot of loc (readable on the host) and throws mla::Error naming the first one
// outside [0, P*S) other than -1. The CPU append_latent_kv runs it on every call before writing;
// the GPU one when AppendLatentKvArgs::check_metadata is set, on a host copy.
void check_append_locs(const AppendLatentKvArgs& args);
void build_block_table(const BuildBlockTableArgs& args);
// Checks req_pool_indices and seq_lens (readable on the host) and the token slot of every page in
// use, slot_of(req, pos) = req_to_token[req, pos] (asked only for a request whose index and
// length passed), and throws mla::Error naming the first bad one. The CPU build_block_table runs
// it on every call before writing; the GPU one when BuildBlockTableArgs::check_metadata is set,
// on host copies.
void check_block_table_inputs(const BuildBlockTableArgs& args,
                              const std::function<int64_t(int64_t req, int64_t pos)>& slot_of);
void rope_quantize(const RopeQuantizeArgs& args);
// Checks every position (readable on the host) and throws mla::Error naming the first one
// outside [0, max_position). The CPU rope_quantize runs it on every call before writing; the GPU
// one when RopeQuantizeArgs::check_metadata is set, on a host copy.
void check_rope_positions(const RopeQuantizeArgs& args);
void mla_decode(const MlaDecodeArgs& args);
// Checks every data-dependent value of an mla_decode call as the kernels use it (cu_q_lens,
// kv_lens, the page ids of the keys in use) and throws mla::Error naming the first bad one.
// cu_q_lens, kv_lens and block_table must be readable on the host. The CPU mla_decode runs it
// on every call; the GPU one when MlaDecodeArgs::check_metadata is set, on host copies, with
// the GPU's rule for cu_q_lens[B] (at most T, not equal).
void check_decode_metadata(const MlaDecodeArgs& args, int64_t num_tokens);
void mha_prefill(const MhaPrefillArgs& args);
// Checks cu_q_lens and cu_kv_lens of an mha_prefill call (readable on the host) and throws
// mla::Error naming the first bad value. The CPU mha_prefill runs it on every call; the GPU one
// when MhaPrefillArgs::check_metadata is set, on host copies.
void check_prefill_metadata(const MhaPrefillArgs& args);
void merge_states(const MergeStatesArgs& args);
}  // namespace mla::cpu
