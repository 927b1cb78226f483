// Host entry points of the decode kernels, shared by the dispatch and the schedule code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/decode/decode_params.cuh"

namespace mla::cuda::decode {

// Shared memory of the portable kernel with one K stage (16-bit cache, or fp8 through registers)
// for row tiles of block_m rows: Q and P (block_m x (576 + 64) values of 2 bytes), the row
// statistics (1,024 bytes) and one 64-key tile (73,728). decode_kernel.cuh checks it against
// the kernel's layout.
constexpr size_t portable_one_stage_bytes(int block_m) {
  return size_t(block_m) * (kHeadDim + kBlockN) * 2 + 1024 + size_t(kBlockN) * kHeadDim * 2;
}

// The widest row tile (64, 32 or 16 rows) whose portable kernel fits blocks of `limit` bytes of
// shared memory (16 where none fits: the launch then names the bytes). 64 on Hopper and A100;
// 16 on sm_86 / sm_89 (101,376 bytes).
constexpr int widest_row_tile(size_t limit) {
  return portable_one_stage_bytes(64) <= limit ? 64 : portable_one_stage_bytes(32) <= limit ? 32 : 16;
}

// widest_row_tile of the current device (or of the limit a test emulates): the plan and the
// decode kernels cut rows into tiles of at most this many.
int device_row_tile_cap();

// Rows per tile for requests of at most max_rows = max_q_len * H rows: the smallest of 16, 32, 64
// that holds them (the widest the device runs for more rows, which are then cut into several
// tiles).
inline int block_m_for_rows(int64_t max_rows, int cap = 64) {
  const int want = max_rows <= 16 ? 16 : max_rows <= 32 ? 32 : 64;
  return want < cap ? want : cap;
}

// Main kernel: grid CTAs (persistent over their work lists when params.has_schedule).
template <typename T, int kRowTiles>
void launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream);

// Combine kernel: merges the pieces of every split unit of a planned schedule.
void launch_combine_kernel(const DecodeParams& params, cudaStream_t stream);

// MlaDecodeArgs::zero_padding_rows: writes the rows past cu_q_lens[B] (layout.cu_q_lens given),
// after the call's other kernels.
void launch_zero_padding_rows(const DecodeParams& params, cudaStream_t stream);

// Plan kernel: writes the schedule of one batch into the workspace.
void launch_plan_kernel(const PlanParams& params, cudaStream_t stream);

}  // namespace mla::cuda::decode
