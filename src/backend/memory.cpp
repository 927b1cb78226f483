#include "backend/memory.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "cpu/load_index.hpp"
#include "mla/error.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_check.hpp"
#endif

namespace mla::detail {
namespace {

#if !defined(MLA_WITH_CUDA)
[[noreturn]] void no_cuda(const char* what, Device device) {
  MLA_FAIL(what, ": memory is on ", device_name(device),
           " but this build of mla has no CUDA support (rebuild with nvcc available)");
}
#endif

void check_lengths(const char* op, const char* name, const TensorView& lens) {
  check::ndim(op, name, lens, 1);
  check::dtype_in(op, name, lens, {DType::kInt32, DType::kInt64});
}

}  // namespace

Buffer::Buffer(size_t size_bytes, Device device, Stream stream) : size_(size_bytes), device_(device) {
  if (size_bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    // calloc hands out zeroed pages lazily; align the start by hand.
    allocation_ = std::calloc(size_bytes + kAlignment, 1);
    MLA_CHECK(allocation_ != nullptr, "Buffer: out of host memory allocating ", size_bytes,
              " bytes");
    const auto address = reinterpret_cast<uintptr_t>(allocation_);
    data_ = reinterpret_cast<void*>((address + kAlignment - 1) / kAlignment * kAlignment);
    return;
  }
#if defined(MLA_WITH_CUDA)
  try {
    const cuda::DeviceGuard guard(device);
    MLA_CUDA_CHECK(cudaMalloc(&allocation_, size_bytes));
    data_ = allocation_;
    MLA_CUDA_CHECK(cudaMemsetAsync(data_, 0, size_bytes, cuda::to_cuda(stream)));
    // Without a stream (workspaces, CUDA-graph buffers made at start-up) the zero-fill runs on
    // the legacy default stream, which does not order with non-blocking streams: wait for it, so
    // that work the caller issues later on any stream sees zeroed memory.
    if (stream == nullptr) MLA_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  } catch (const Error& e) {
    if (allocation_ != nullptr) (void)cudaFree(allocation_);
    allocation_ = data_ = nullptr;
    size_ = 0;
    MLA_FAIL("Buffer: allocating ", size_bytes, " bytes on ", device_name(device), " failed: ",
             e.message());
  }
#else
  (void)stream;
  size_ = 0;
  no_cuda("Buffer", device);
#endif
}

Buffer::~Buffer() { reset(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      allocation_(std::exchange(other.allocation_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    allocation_ = std::exchange(other.allocation_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

void Buffer::reset() {
  if (allocation_ != nullptr) {
    if (device_.type == DeviceType::kCPU) {
      std::free(allocation_);
    } else {
#if defined(MLA_WITH_CUDA)
      (void)cudaFree(allocation_);  // a destructor must not throw
#endif
    }
  }
  data_ = nullptr;
  allocation_ = nullptr;
  size_ = 0;
}

void copy_to_device(void* dst, const void* host_src, size_t bytes, Device device, Stream stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memcpy(dst, host_src, bytes);
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(device);
  // From pageable memory this returns once the source has been staged, so it may be reused.
  MLA_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cuda::to_cuda(stream)));
#else
  (void)stream;
  no_cuda("copy_to_device", device);
#endif
}

void copy_on_device(void* dst, const void* src, size_t bytes, Device device, Stream stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memmove(dst, src, bytes);
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(device);
  MLA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda::to_cuda(stream)));
#else
  (void)stream;
  no_cuda("copy_on_device", device);
#endif
}

void copy_to_host(void* host_dst, const void* src, size_t bytes, Device device, Stream stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memcpy(host_dst, src, bytes);
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(device);
  MLA_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cuda::to_cuda(stream)));
  MLA_CUDA_CHECK(cudaStreamSynchronize(cuda::to_cuda(stream)));
#else
  (void)stream;
  no_cuda("copy_to_host", device);
#endif
}

void wait_for_stream(Device device, Stream stream) {
  if (device.type == DeviceType::kCPU) return;
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(device);
  MLA_CUDA_CHECK(cudaStreamSynchronize(cuda::to_cuda(stream)));
#else
  (void)stream;
  no_cuda("wait_for_stream", device);
#endif
}

void fill_zero(void* dst, size_t bytes, Device device, Stream stream) {
  if (bytes == 0) return;
  if (device.type == DeviceType::kCPU) {
    std::memset(dst, 0, bytes);
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(device);
  MLA_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::to_cuda(stream)));
#else
  (void)stream;
  no_cuda("fill_zero", device);
#endif
}

void lengths_to_int32(const char* op, const char* name, const TensorView& lens, int32_t offset,
                      const TensorView& out, Stream stream) {
  check_lengths(op, name, lens);
  check::ndim(op, "out", out, 1);
  check::dim(op, "out", out, 0, lens.shape[0], "as lens");
  check::dtype(op, "out", out, DType::kInt32);
  check::contiguous(op, "out", out);
  check::same_device(op, "out", out, lens.device);
  const int64_t n = lens.shape[0];
  if (n == 0) return;
  if (lens.device.type == DeviceType::kCPU) {
    int32_t* dst = static_cast<int32_t*>(out.data);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = cpu::load_index(lens, i);
      MLA_CHECK(len >= 0 && len + offset <= INT32_MAX, op, ": ", name, "[", i, "] = ", len,
                offset ? " (plus the draft step offset)" : "",
                " is not a length of 0 to 2^31 - 1 tokens");
      dst[i] = int32_t(len + offset);
    }
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(lens.device);
  cuda::lengths_to_int32(lens, offset, out, stream);
#else
  (void)stream;
  no_cuda(op, lens.device);
#endif
}

void prefix_sum_int32(const char* op, const char* name, const TensorView& lens, const TensorView& cu,
                      Stream stream) {
  check_lengths(op, name, lens);
  check::ndim(op, "cu", cu, 1);
  check::dim(op, "cu", cu, 0, lens.shape[0] + 1, "lens.shape[0] + 1");
  check::dtype(op, "cu", cu, DType::kInt32);
  check::contiguous(op, "cu", cu);
  check::same_device(op, "cu", cu, lens.device);
  const int64_t n = lens.shape[0];
  if (lens.device.type == DeviceType::kCPU) {
    int32_t* dst = static_cast<int32_t*>(cu.data);
    int64_t sum = 0;
    dst[0] = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = cpu::load_index(lens, i);
      MLA_CHECK(len >= 0 && len <= INT32_MAX - sum, op, ": ", name, "[", i, "] = ", len,
                len < 0 ? " must be >= 0" : " brings the total past 2^31 - 1");
      sum += len;
      dst[i + 1] = int32_t(sum);
    }
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(lens.device);
  cuda::prefix_sum_int32(lens, cu, stream);
#else
  (void)stream;
  no_cuda(op, lens.device);
#endif
}

void gather_rows(const TensorView& src, const TensorView& index, const TensorView& dst,
                 Stream stream) {
  constexpr const char* op = "gather_rows";
  check::ndim(op, "src", src, 2);
  check::inner_contiguous(op, "src", src);
  check::ndim(op, "index", index, 1);
  check::dtype(op, "index", index, DType::kInt32);
  check::contiguous(op, "index", index);
  check::ndim(op, "dst", dst, 2);
  check::dim(op, "dst", dst, 0, index.shape[0], "rows, as index");
  check::dim(op, "dst", dst, 1, src.shape[1], "row width, as src");
  check::dtype(op, "dst", dst, src.dtype);
  check::inner_contiguous(op, "dst", dst);
  check::same_device(op, "index", index, src.device);
  check::same_device(op, "dst", dst, src.device);
  const int64_t rows = index.shape[0];
  if (rows == 0 || src.shape[1] == 0) return;
  if (src.device.type == DeviceType::kCPU) {
    const size_t elem = dtype_size(src.dtype);
    const size_t row_bytes = size_t(src.shape[1]) * elem;
    const int32_t* idx = static_cast<const int32_t*>(index.data);
    for (int64_t n = 0; n < rows; ++n) {
      MLA_CHECK(idx[n] >= 0 && idx[n] < src.shape[0], op, ": index[", n, "] = ", idx[n],
                " is out of range [0, ", src.shape[0], ")");
      std::memcpy(static_cast<char*>(dst.data) + size_t(n * dst.stride[0]) * elem,
                  static_cast<const char*>(src.data) + size_t(idx[n] * src.stride[0]) * elem,
                  row_bytes);
    }
    return;
  }
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(src.device);
  cuda::gather_rows(src, index, dst, stream);
#else
  (void)stream;
  no_cuda(op, src.device);
#endif
}

}  // namespace mla::detail
