// Checked CUDA calls: every runtime call and every launch throws mla::Error with the CUDA error
// string, the failing expression, and the file and line.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "mla/error.hpp"
#include "mla/tensor.hpp"

#define MLA_CUDA_CHECK(expr)                                                                  \
  do {                                                                                        \
    cudaError_t mla_cuda_status_ = (expr);                                                    \
    if (mla_cuda_status_ != cudaSuccess) {                                                    \
      /* cleared, so that the next launch check does not report this error again */           \
      (void)cudaGetLastError();                                                               \
      ::mla::detail::throw_error(__FILE__, __LINE__, "CUDA error in ", #expr, ": ",           \
                                 cudaGetErrorName(mla_cuda_status_), " (",                    \
                                 cudaGetErrorString(mla_cuda_status_), ")");                  \
    }                                                                                         \
  } while (0)

// After a <<<...>>> launch: reports launch-configuration errors without synchronising.
#define MLA_CUDA_CHECK_LAUNCH() MLA_CUDA_CHECK(cudaGetLastError())

namespace mla::cuda {

inline cudaStream_t to_cuda(Stream stream) { return static_cast<cudaStream_t>(stream); }

// Makes `device` current for the lifetime of the guard (no-op when it already is): the ops'
// launches, allocations and device queries then go to the device their tensors are on.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device) {
    MLA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device.index != previous_) MLA_CUDA_CHECK(cudaSetDevice(device.index));
    switched_ = device.index != previous_;
  }
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// Properties of the current device, read once per device and cached.
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  size_t max_smem_per_block_optin = 0;  // bytes, after cudaFuncSetAttribute
  size_t l2_bytes = 0;
};
const DeviceInfo& current_device_info();

// Raises kKernel's dynamic shared-memory limit to `bytes` on the current device, once per
// device (not on every launch).
template <auto kKernel>
void opt_in_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> opted_in{0};
  const int device = current_device_info().device;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (opted_in.load(std::memory_order_acquire) & bit) return;
  MLA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  opted_in.fetch_or(bit, std::memory_order_acq_rel);
}

}  // namespace mla::cuda
