// Small device helpers of the backend's planner (declared in src/backend/memory.hpp): length
// conversion with an offset, an exclusive-start prefix sum, and a row gather. They let the
// decode-family planning stay on the GPU (no host sync) and feed the chunked-prefix path.
// Arguments were checked by the callers in src/backend/memory.cpp.
#include <cstdint>

#include "backend/memory.hpp"
#include "cuda/cuda_check.hpp"

namespace mla::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Len>
__global__ void lengths_to_int32_kernel(const Len* __restrict__ lens, int64_t lens_stride,
                                        int32_t offset, int32_t* __restrict__ out, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = int32_t(lens[i * lens_stride] + offset);
}

// One block: each thread sums a contiguous slice, a shared-memory scan combines the slices,
// then each thread writes its slice's running sums. cu[0] = 0.
template <typename Len>
__global__ void prefix_sum_kernel(const Len* __restrict__ lens, int64_t lens_stride,
                                  int32_t* __restrict__ cu, int64_t n) {
  __shared__ int64_t slice_sums[kThreads];
  const int t = threadIdx.x;
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const int64_t begin = min(n, t * per_thread);
  const int64_t end = min(n, begin + per_thread);
  int64_t sum = 0;
  for (int64_t i = begin; i < end; ++i) sum += lens[i * lens_stride];
  slice_sums[t] = sum;
  __syncthreads();
  // Inclusive Hillis-Steele scan over the slice sums.
  for (int step = 1; step < kThreads; step *= 2) {
    const int64_t add = t >= step ? slice_sums[t - step] : 0;
    __syncthreads();
    slice_sums[t] += add;
    __syncthreads();
  }
  int64_t running = slice_sums[t] - sum;  // exclusive start of this slice
  if (t == 0) cu[0] = 0;
  for (int64_t i = begin; i < end; ++i) {
    running += lens[i * lens_stride];
    cu[i + 1] = int32_t(running);
  }
}

// One block per row; Word is the widest unit the row pitches and pointers allow.
template <typename Word>
__global__ void gather_rows_kernel(const char* __restrict__ src, int64_t src_row_bytes_stride,
                                   int64_t src_rows, const int32_t* __restrict__ index,
                                   char* __restrict__ dst, int64_t dst_row_bytes_stride,
                                   int64_t row_words) {
  const int64_t n = blockIdx.x;
  const int32_t row = index[n];
  Word* out = reinterpret_cast<Word*>(dst + n * dst_row_bytes_stride);
  if (row < 0 || row >= src_rows) {
    for (int64_t w = threadIdx.x; w < row_words; w += blockDim.x) out[w] = Word{};
    return;
  }
  const Word* in = reinterpret_cast<const Word*>(src + int64_t(row) * src_row_bytes_stride);
  for (int64_t w = threadIdx.x; w < row_words; w += blockDim.x) out[w] = in[w];
}

int64_t blocks_for(int64_t n) { return (n + kThreads - 1) / kThreads; }

}  // namespace

void lengths_to_int32(const TensorView& lens, int32_t offset, const TensorView& out, Stream stream) {
  const int64_t n = lens.shape[0];
  if (n == 0) return;
  int32_t* dst = static_cast<int32_t*>(out.data);
  if (lens.dtype == DType::kInt64) {
    lengths_to_int32_kernel<<<blocks_for(n), kThreads, 0, to_cuda(stream)>>>(
        static_cast<const int64_t*>(lens.data), lens.stride[0], offset, dst, n);
  } else {
    lengths_to_int32_kernel<<<blocks_for(n), kThreads, 0, to_cuda(stream)>>>(
        static_cast<const int32_t*>(lens.data), lens.stride[0], offset, dst, n);
  }
  MLA_CUDA_CHECK_LAUNCH();
}

void prefix_sum_int32(const TensorView& lens, const TensorView& cu, Stream stream) {
  const int64_t n = lens.shape[0];
  int32_t* dst = static_cast<int32_t*>(cu.data);
  if (lens.dtype == DType::kInt64) {
    prefix_sum_kernel<<<1, kThreads, 0, to_cuda(stream)>>>(static_cast<const int64_t*>(lens.data),
                                                           lens.stride[0], dst, n);
  } else {
    prefix_sum_kernel<<<1, kThreads, 0, to_cuda(stream)>>>(static_cast<const int32_t*>(lens.data),
                                                           lens.stride[0], dst, n);
  }
  MLA_CUDA_CHECK_LAUNCH();
}

void gather_rows(const TensorView& src, const TensorView& index, const TensorView& dst,
                 Stream stream) {
  const int64_t rows = index.shape[0];
  if (rows == 0) return;
  const int64_t elem = int64_t(dtype_size(src.dtype));
  const int64_t row_bytes = src.shape[1] * elem;
  const int64_t src_pitch = src.stride[0] * elem;
  const int64_t dst_pitch = dst.stride[0] * elem;
  const auto aligned = [&](int64_t unit) {
    return row_bytes % unit == 0 && src_pitch % unit == 0 && dst_pitch % unit == 0 &&
           reinterpret_cast<uintptr_t>(src.data) % unit == 0 &&
           reinterpret_cast<uintptr_t>(dst.data) % unit == 0;
  };
  const char* in = static_cast<const char*>(src.data);
  char* out = static_cast<char*>(dst.data);
  const int32_t* idx = static_cast<const int32_t*>(index.data);
  const dim3 grid(static_cast<unsigned>(rows));
  if (aligned(16)) {
    gather_rows_kernel<uint4><<<grid, 128, 0, to_cuda(stream)>>>(in, src_pitch, src.shape[0], idx,
                                                                 out, dst_pitch, row_bytes / 16);
  } else if (aligned(4)) {
    gather_rows_kernel<uint32_t><<<grid, 128, 0, to_cuda(stream)>>>(in, src_pitch, src.shape[0],
                                                                    idx, out, dst_pitch, row_bytes / 4);
  } else {
    gather_rows_kernel<uint8_t><<<grid, 128, 0, to_cuda(stream)>>>(in, src_pitch, src.shape[0], idx,
                                                                   out, dst_pitch, row_bytes);
  }
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::cuda
