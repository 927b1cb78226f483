// Host entry points of the decode kernels, shared by the dispatch and the schedule code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/decode_params.cuh"

namespace mla::cuda::decode {

// Rows per tile for requests of at most max_rows = max_q_len * H rows: the smallest of 16, 32, 64
// that holds them (64 for more rows, which are then cut into several tiles).
inline int block_m_for_rows(int64_t max_rows) {
  return max_rows <= 16 ? 16 : max_rows <= 32 ? 32 : 64;
}

// Main kernel: grid CTAs (persistent over their work lists when params.has_schedule).
template <typename T, int kRowTiles>
void launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream);

// Combine kernel: merges the pieces of every split unit of a planned schedule.
void launch_combine_kernel(const DecodeParams& params, cudaStream_t stream);

// Plan kernel: writes the schedule of one batch into the workspace.
void launch_plan_kernel(const PlanParams& params, cudaStream_t stream);

}  // namespace mla::cuda::decode
