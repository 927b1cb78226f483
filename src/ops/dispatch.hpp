// Device dispatch for the public ops: one place decides CPU vs CUDA.
#pragma once

#include <initializer_list>

#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace mla::detail {

// The device shared by all given (non-empty) tensors; throws naming the first that differs.
struct NamedTensor {
  const char* name;
  const TensorView* tensor;
};
inline Device common_device(const char* op, std::initializer_list<NamedTensor> tensors) {
  const NamedTensor* first = nullptr;
  for (const NamedTensor& t : tensors) {
    if (t.tensor->empty()) continue;
    if (!first) {
      first = &t;
      continue;
    }
    MLA_CHECK(t.tensor->device == first->tensor->device, op, ": ", t.name, " is on ",
              device_name(t.tensor->device), " but ", first->name, " is on ",
              device_name(first->tensor->device), "; all tensors must be on one device");
  }
  return first ? first->tensor->device : Device::cpu();
}

// Runs cpu_fn() on the CPU, cuda_fn() on CUDA (or throws when built without CUDA).
template <typename CpuFn, typename CudaFn>
void run_on([[maybe_unused]] const char* op, Device device, CpuFn&& cpu_fn,
            [[maybe_unused]] CudaFn&& cuda_fn) {
  if (device.type == DeviceType::kCPU) {
    cpu_fn();
    return;
  }
#if defined(MLA_WITH_CUDA)
  cuda_fn();
#else
  MLA_FAIL(op, ": tensors are on ", device_name(device),
           " but this build of mla has no CUDA support (rebuild with nvcc available)");
#endif
}

}  // namespace mla::detail
