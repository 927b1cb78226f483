// mha_prefill kernel instantiation for fp8 inputs (one file per input type keeps builds parallel).
#include "cuda/prefill/prefill_kernel.cuh"

namespace mla::cuda::prefill {
template void launch_mha_prefill<__nv_fp8_e4m3>(const MhaPrefillParams&, int, cudaStream_t);
}  // namespace mla::cuda::prefill
