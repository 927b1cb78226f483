// TensorView — a non-owning description of a tensor: pointer, dtype, shape, strides, device.
//
// Strides are in elements (not bytes), like PyTorch. Up to 4 dimensions. An "empty" view
// (data == nullptr and ndim == 0) stands for an optional argument that is not given.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "mla/dtype.hpp"

namespace mla {

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

std::string device_name(Device device);

// An opaque CUDA stream handle (cudaStream_t); nullptr is the legacy default stream.
using Stream = void*;

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // in elements
  Device device{};

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  // A view with explicit strides (elements).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> stride, Device device = Device::cpu());

  bool empty() const { return data == nullptr && ndim == 0; }
  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // Pointer to element with the given multi-index (no bounds check; callers validate first).
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  // "[2, 16, 576] bf16 cuda:0"
  std::string describe() const;
};

// Validation helpers used at every public entry. Each throws mla::Error naming `op` and `arg`.
namespace check {
void not_empty(const char* op, const char* arg, const TensorView& t);
void ndim(const char* op, const char* arg, const TensorView& t, int expected);
void dim(const char* op, const char* arg, const TensorView& t, int d, int64_t expected,
         const char* what = nullptr);
void dtype(const char* op, const char* arg, const TensorView& t, DType expected);
void dtype_in(const char* op, const char* arg, const TensorView& t,
              std::initializer_list<DType> allowed);
void inner_contiguous(const char* op, const char* arg, const TensorView& t);  // last stride 1
void contiguous(const char* op, const char* arg, const TensorView& t);
// An output: no two elements share an address (a stride of 0 over a dim of more than one element,
// or rows laid over each other, would let one element's result overwrite another's).
void non_overlapping(const char* op, const char* arg, const TensorView& t);
// An output and an input (or two outputs) of the same call share no byte: their spans (from the
// lowest to the highest element) are apart, or their rows lie side by side in one buffer (every
// outer stride a multiple of the smallest one, the pitch, and each view in its own columns of
// it: k_nope_out and k_pe_out over a latent cache row).
// Otherwise one element's result could overwrite an input another element still reads.
void disjoint(const char* op, const char* out_arg, const TensorView& out, const char* in_arg,
              const TensorView& in);
// The same against each of `inputs` (name, view), in order; a view not given holds no byte.
using NamedViews = std::initializer_list<std::pair<const char*, const TensorView*>>;
void disjoint(const char* op, const char* out_arg, const TensorView& out, NamedViews inputs);
// An output that may be computed in place over an input: the very same view (data, dtype, shape,
// strides), or disjoint from it.
void same_or_disjoint(const char* op, const char* out_arg, const TensorView& out,
                      const char* in_arg, const TensorView& in);
void same_device(const char* op, const char* arg, const TensorView& t, Device expected);
// Rows of 16-byte chunks (the GPU kernels' copies): the base address and every stride but the
// last (over a dim of more than one element) a multiple of 16 bytes. `where` says who needs it.
void rows_aligned16(const char* op, const char* arg, const TensorView& t, const char* where);
}  // namespace check

}  // namespace mla
