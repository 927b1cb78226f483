// Programmatic dependent launch: the kernels of one decode call (decode, combine, and the
// padding rows' zero-fill where asked; the plan before them) are
// launched so that the next one's CTAs may start while the previous one is still running. A kernel
// launched this way must call wait_for_prior_grids() before it reads anything an earlier kernel
// in the stream writes; every kernel of the chain calls allow_dependent_launch() once its CTAs
// have started. On GPUs before sm_90 both are no-ops and launches are ordinary.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_check.hpp"

namespace mla::cuda {

// Blocks until every grid this one depends on has completed and its memory is visible.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream (if launched as a dependent) start its CTAs.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launches `kernel` as a dependent of the previous work in `stream` (sm_90 and later; an ordinary
// launch before). Capturable in a CUDA graph.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = current_device_info().cc_major >= 9 ? 1 : 0;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace mla::cuda
