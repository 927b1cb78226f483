// Host copies of an op's small int32 metadata for its debug mode (`check_metadata`): the checks
// of the CPU path then run on the copies, one set of rules and messages for both devices.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "cuda/cuda_check.hpp"

namespace mla::cuda {

// The copies wait for the stream, which a stream being captured into a CUDA graph cannot do.
inline void require_not_capturing(const char* op, const char* what, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MLA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  MLA_CHECK(capture == cudaStreamCaptureStatusNone, op, ": check_metadata copies ", what,
            " to the host and waits for them, which a stream being captured into a CUDA graph "
            "cannot do; capture without it");
}

// rows x cols int32 values of `src` (rows src_pitch elements apart, each row contiguous) into a
// packed host vector, queued on `stream`: valid once the stream has been synchronised. A pitch
// below cols (rows repeated or laid over each other: a stride of 0 from an expand) is copied row
// by row.
inline std::vector<int32_t> copy_int32_to_host(const TensorView& src, int64_t rows, int64_t cols,
                                               int64_t src_pitch, cudaStream_t stream) {
  std::vector<int32_t> dst(static_cast<size_t>(rows * cols));
  if (dst.empty()) return dst;
  if (src_pitch >= cols) {
    MLA_CUDA_CHECK(cudaMemcpy2DAsync(dst.data(), size_t(cols) * sizeof(int32_t), src.data,
                                     size_t(src_pitch) * sizeof(int32_t), size_t(cols) * sizeof(int32_t),
                                     size_t(rows), cudaMemcpyDeviceToHost, stream));
    return dst;
  }
  for (int64_t r = 0; r < rows; ++r)
    MLA_CUDA_CHECK(cudaMemcpyAsync(dst.data() + r * cols, static_cast<const int32_t*>(src.data) + r * src_pitch,
                                   size_t(cols) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  return dst;
}

// A contiguous index vector (int32 or int64, `n` elements) copied into `storage`, queued on
// `stream`: the returned host view (src's dtype) is valid once the stream has been synchronised.
inline TensorView copy_index_vector_to_host(const TensorView& src, int64_t n, std::vector<int64_t>& storage,
                                            cudaStream_t stream) {
  const size_t bytes = size_t(n) * dtype_size(src.dtype);
  storage.assign((bytes + sizeof(int64_t) - 1) / sizeof(int64_t), 0);
  if (bytes > 0)
    MLA_CUDA_CHECK(cudaMemcpyAsync(storage.data(), src.data, bytes, cudaMemcpyDeviceToHost, stream));
  return TensorView::contiguous(storage.data(), src.dtype, {n}, Device::cpu());
}

// check_metadata of an op with one contiguous index vector (args.*field, n values): the CPU path's
// `check` run on a copy of args whose field is a host copy of it, before anything is launched.
template <typename Args, typename Check>
void check_index_vector_on_host(const char* op, const char* what, const Args& args, TensorView Args::*field,
                                int64_t n, cudaStream_t stream, Check check) {
  require_not_capturing(op, what, stream);
  std::vector<int64_t> storage;
  Args host = args;
  host.*field = copy_index_vector_to_host(args.*field, n, storage, stream);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  check(host);
}

// A contiguous host view of such a copy.
inline TensorView host_int32_view(std::vector<int32_t>& values, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(values.data(), DType::kInt32, shape, Device::cpu());
}

}  // namespace mla::cuda
