// mha_prefill kernel instantiation for fp16 inputs (one file per input type keeps builds parallel).
#include "cuda/prefill/prefill_kernel.cuh"

namespace mla::cuda::prefill {
template void launch_mha_prefill<__half>(const MhaPrefillParams&, int, cudaStream_t);
}  // namespace mla::cuda::prefill
