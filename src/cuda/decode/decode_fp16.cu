// mla_decode kernels with fp16 compute (fp16 queries and cache, or fp8 dequantised to fp16).
#include "cuda/decode/decode_kernel.cuh"

namespace mla::cuda::decode {
template void launch_decode_kernel<__half, 1>(const DecodeParams&, int, cudaStream_t);
template void launch_decode_kernel<__half, 2>(const DecodeParams&, int, cudaStream_t);
template void launch_decode_kernel<__half, 4>(const DecodeParams&, int, cudaStream_t);
}  // namespace mla::cuda::decode
