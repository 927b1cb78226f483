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
// With cluster > 1 (sm_90 only; grid.x a multiple of it), CTAs cluster * i ... cluster * i +
// cluster - 1 run as one thread-block cluster (on the SMs of one GPC).
template <typename... Params, typename... Args>
void launch_dependent_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                cudaStream_t stream, int cluster, Args&&... args) {
  const bool sm90 = current_device_info().cc_major >= 9;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = unsigned(cluster);
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = !sm90 ? 0 : cluster > 1 ? 2 : 1;
  MLA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                      cudaStream_t stream, Args&&... args) {
  launch_dependent_clustered(kernel, grid, block, smem_bytes, stream, 1, std::forward<Args>(args)...);
}

}  // namespace mla::cuda
