// The backend's memory layer: owning zero-initialised device buffers, host <-> device copies on
// a stream, and the three small device-side helpers planning needs beyond the public ops
// (length conversion, prefix sums, row gather). On the CPU everything is plain host memory; on
// CUDA (only #if defined(MLA_WITH_CUDA)) buffers come from cudaMalloc and every call is checked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mla/tensor.hpp"

namespace mla::detail {

// Owning, zero-initialised device memory (CPU: 256-byte aligned host memory).
class Buffer {
 public:
  static constexpr size_t kAlignment = 256;

  Buffer() = default;
  // Allocates `size_bytes` on `device` and zero-fills it (on CUDA: cudaMemsetAsync on `stream`;
  // with no stream, the fill has finished when the constructor returns).
  Buffer(size_t size_bytes, Device device, Stream stream = nullptr);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  Device device() const { return device_; }
  // Frees the memory (the buffer becomes empty).
  void reset();

 private:
  void* data_ = nullptr;
  void* allocation_ = nullptr;  // what was allocated (CPU: before alignment)
  size_t size_ = 0;
  Device device_{};
};

// Copies on `device` in stream order. Host memory is read before copy_to_device returns, so the
// source may be reused right away.
void copy_to_device(void* dst, const void* host_src, size_t bytes, Device device, Stream stream);
void copy_on_device(void* dst, const void* src, size_t bytes, Device device, Stream stream);
// Waits for the copy (for tests, tools and the Backend's debug mode; never on the planning path
// otherwise).
void copy_to_host(void* host_dst, const void* src, size_t bytes, Device device, Stream stream);
void fill_zero(void* dst, size_t bytes, Device device, Stream stream);
// Waits for the work queued on `stream` (on the CPU: nothing to wait for). For uploads made at
// start-up on the legacy default stream, which does not order with non-blocking streams.
void wait_for_stream(Device device, Stream stream);

// out[b] = lens[b] + offset, as int32.   lens [B] int32/int64, out [B] int32 (contiguous).
// On the CPU a result outside [0, 2^31 - 1] is an mla::Error naming op and `name` (the caller's
// argument); on CUDA the values are not seen (no host copy) and are converted as they are.
void lengths_to_int32(const char* op, const char* name, const TensorView& lens, int32_t offset,
                      const TensorView& out, Stream stream);
// cu[0] = 0, cu[b + 1] = cu[b] + lens[b].   lens [B] int32/int64, cu [B + 1] int32; checked
// on the CPU as above (each length and the total).
void prefix_sum_int32(const char* op, const char* name, const TensorView& lens, const TensorView& cu,
                      Stream stream);
// dst[n, :] = src[index[n], :].   src [R, W] and dst [N, W] of one dtype with contiguous rows,
// index [N] int32 in [0, R) (checked on the CPU; on CUDA an index out of range zero-fills the row).
void gather_rows(const TensorView& src, const TensorView& index, const TensorView& dst,
                 Stream stream);

}  // namespace mla::detail

#if defined(MLA_WITH_CUDA)
// CUDA versions of the helpers (src/cuda/backend/backend_kernels.cu); arguments already checked.
namespace mla::cuda {
void lengths_to_int32(const TensorView& lens, int32_t offset, const TensorView& out, Stream stream);
void prefix_sum_int32(const TensorView& lens, const TensorView& cu, Stream stream);
void gather_rows(const TensorView& src, const TensorView& index, const TensorView& dst,
                 Stream stream);
}  // namespace mla::cuda
#endif
