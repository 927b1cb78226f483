// GPU test helpers: device buffers mirroring HostTensor, and a skip when no GPU is present.
#pragma once

#include <cuda_runtime.h>

#include "test_util.hpp"

namespace mla::test {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define MLA_REQUIRE_GPU()                                              \
  do {                                                                 \
    if (!::mla::test::gpu_available()) GTEST_SKIP() << "no CUDA GPU present; GPU test skipped"; \
  } while (0)

#define MLA_TEST_CUDA(expr)                                                            \
  do {                                                                                 \
    cudaError_t s_ = (expr);                                                           \
    ASSERT_EQ(s_, cudaSuccess) << #expr << ": " << cudaGetErrorString(s_);             \
  } while (0)

// A device copy of a HostTensor (same dtype/shape), freed on destruction.
struct DeviceTensor {
  HostTensor* host = nullptr;
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceTensor() = default;
  explicit DeviceTensor(HostTensor& h) : host(&h), bytes(h.bytes.size()) {
    if (cudaMalloc(&ptr, bytes ? bytes : 16) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
    upload();
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { if (ptr) cudaFree(ptr); }
  void upload() {
    if (bytes && cudaMemcpy(ptr, host->bytes.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy H2D failed");
  }
  // Copies the device contents back into the host tensor (synchronises).
  void download() {
    if (bytes && cudaMemcpy(host->bytes.data(), ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H failed");
  }
  TensorView view() const {
    TensorView t = host->view(Device::cuda(0));
    t.data = ptr;
    return t;
  }
};

}  // namespace mla::test
