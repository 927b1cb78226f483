#include <array>
#include <mutex>

#include "cuda/cuda_check.hpp"

namespace mla::cuda {

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> infos;
  static std::array<std::once_flag, kMaxDevices> once;
  int device = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&device));
  MLA_CHECK(device >= 0 && device < kMaxDevices, "current CUDA device index ", device,
            " is out of the supported range [0, ", kMaxDevices, ")");
  std::call_once(once[size_t(device)], [device] {
    DeviceInfo info;
    info.device = device;
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
    int smem = 0, l2 = 0;
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    MLA_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
    info.max_smem_per_block_optin = size_t(smem);
    info.l2_bytes = size_t(l2);
    infos[size_t(device)] = info;
  });
  return infos[size_t(device)];
}

}  // namespace mla::cuda
