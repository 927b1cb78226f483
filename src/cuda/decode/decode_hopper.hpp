// Host entry of the Hopper (sm_90a, wgmma + TMA) decode kernel; see decode_hopper.cu. Present only
// in builds with MLA_HOPPER_DECODE (sm_90a among the CUDA architectures and the CuTe headers found).
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/decode_params.cuh"

namespace mla::cuda::decode {

// Runs the same work as launch_decode_kernel (same schedule, slots and combine) with rows tiled by
// the plan's block_m (16, 32 or 64; the kernel always computes 64-row tiles). Requires a query
// and a cache of type T, or an fp8 e4m3 cache with a query of type T (or fp8 where T is bf16),
// 16-byte aligned query rows, a page size >= 16 and fewer than 2^31 cache rows: the caller
// (decode_dispatch.cu) checks these.
template <typename T>
void launch_hopper_decode_kernel(const DecodeParams& params, int block_m, int grid, cudaStream_t stream);

}  // namespace mla::cuda::decode
