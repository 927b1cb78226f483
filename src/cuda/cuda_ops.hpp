// CUDA implementations (only when built with MLA_WITH_CUDA). Called by the public entries in
// src/ops/ after validation. They must not allocate, must not synchronise with the host, and
// check every launch (MLA_CUDA_CHECK / MLA_CUDA_CHECK_LAUNCH from src/cuda/cuda_check.hpp).
#pragma once

#include <cstddef>

#include "mla/ops.hpp"

namespace mla::cuda {
void append_latent_kv(const AppendLatentKvArgs& args, Stream stream);
void build_block_table(const BuildBlockTableArgs& args, Stream stream);
void rope_quantize(const RopeQuantizeArgs& args, Stream stream);
void mla_decode(const MlaDecodeArgs& args, Stream stream);
const char* mla_decode_kernel_name(const MlaDecodeArgs& args);
void mha_prefill(const MhaPrefillArgs& args, Stream stream);
void merge_states(const MergeStatesArgs& args, Stream stream);

// The shared memory a portable decode block may take: the device's opt-in limit, or less where
// a test emulates a smaller GPU (set_decode_shared_memory_limit; 0 restores the device's).
size_t decode_shared_memory_limit(size_t device_limit);
void set_decode_shared_memory_limit(size_t bytes);
}  // namespace mla::cuda
