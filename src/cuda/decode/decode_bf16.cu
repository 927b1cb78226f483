// mla_decode kernels with bf16 compute (bf16 queries and cache, or fp8 dequantised to bf16).
#include "cuda/decode/decode_kernel.cuh"

namespace mla::cuda::decode {
template void launch_decode_kernel<__nv_bfloat16, 1>(const DecodeParams&, int, cudaStream_t);
template void launch_decode_kernel<__nv_bfloat16, 2>(const DecodeParams&, int, cudaStream_t);
template void launch_decode_kernel<__nv_bfloat16, 4>(const DecodeParams&, int, cudaStream_t);
}  // namespace mla::cuda::decode
