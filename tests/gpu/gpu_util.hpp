// GPU test helpers: device buffers mirroring HostTensor (contiguous or strided views), streams,
// bit-for-bit comparison, and a skip when no GPU is present.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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

// Whether this build and device run the Hopper kernels (sm_90 and a build with them); when so,
// the Hopper tests force them (DecodeKernel::kHopper), so that a silent fallback cannot pass them.
inline bool hopper_expected() {
#if defined(MLA_TEST_EXPECT_HOPPER)
  cudaDeviceProp props{};
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaGetDeviceProperties(&props, device) == cudaSuccess && props.major == 9;
#else
  return false;
#endif
}
#define MLA_REQUIRE_HOPPER()                                                                    \
  do {                                                                                          \
    MLA_REQUIRE_GPU();                                                                          \
    if (!::mla::test::hopper_expected())                                                        \
      GTEST_SKIP() << "needs an sm_90 GPU and a build with the Hopper kernel";                 \
  } while (0)

#define MLA_TEST_CUDA(expr)                                                            \
  do {                                                                                 \
    cudaError_t s_ = (expr);                                                           \
    ASSERT_EQ(s_, cudaSuccess) << #expr << ": " << cudaGetErrorString(s_);             \
  } while (0)

// A view of `data` (a buffer of `buffer_elems` elements) with the given shape and element
// strides, starting `offset` elements in. Throws when the view would reach outside the buffer,
// so that a mistake in a test cannot turn into an out-of-bounds access.
inline TensorView strided_view_of(void* data, DType dtype, int64_t buffer_elems,
                                  std::initializer_list<int64_t> shape,
                                  std::initializer_list<int64_t> stride, int64_t offset,
                                  Device device) {
  TensorView t = TensorView::strided(static_cast<unsigned char*>(data) + offset * int64_t(dtype_size(dtype)),
                                     dtype, shape, stride, device);
  int64_t last = offset;
  bool any_empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) any_empty = true;
    else last += (t.shape[d] - 1) * t.stride[d];
  }
  if (!any_empty && (offset < 0 || last >= buffer_elems))
    throw std::runtime_error("strided_view_of: view reaches element " + std::to_string(last) +
                             " of a " + std::to_string(buffer_elems) + "-element buffer");
  return t;
}

// A strided view into a host tensor's storage (e.g. k_nope as columns 0..511 of a [T, 576] row).
inline TensorView strided_host_view(HostTensor& h, std::initializer_list<int64_t> shape,
                                    std::initializer_list<int64_t> stride, int64_t offset = 0) {
  return strided_view_of(h.data(), h.dtype, h.numel(), shape, stride, offset, Device::cpu());
}

// Raw device memory of n bytes, freed on destruction; filled from and read into host tensors.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (cudaMalloc(&ptr, n ? n : 16) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const HostTensor& h) {
    if (!h.bytes.empty() && cudaMemcpy(ptr, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy H2D failed");
  }
  void download(HostTensor& h) const {
    if (!h.bytes.empty() && cudaMemcpy(h.bytes.data(), ptr, h.bytes.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H failed");
  }
};

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
  // The whole buffer as a contiguous CUDA tensor of the host tensor's shape.
  TensorView view() const {
    TensorView t = host->view(Device::cuda(0));
    t.data = ptr;
    return t;
  }
  // A strided CUDA view into the buffer (bounds-checked against the buffer size).
  TensorView view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> stride,
                  int64_t offset = 0) const {
    return strided_view_of(ptr, host->dtype, host->numel(), shape, stride, offset, Device::cuda(0));
  }
};

// A tensor placed in a larger NaN-poisoned buffer (any shape, strides and offset), with the same
// placement in a host buffer for the CPU run and in a device buffer for the GPU run. Fill `cpu`
// (through at()), call finish_init(), run, then device->download() fills `gpu`; compare every
// element of both buffers, padding included.
struct PlacedTensor {
  HostTensor cpu;  // buffer of the CPU run
  HostTensor gpu;  // the same initial contents; receives the GPU result on download()
  std::unique_ptr<DeviceTensor> device;
  std::vector<int64_t> shape, stride;
  int64_t offset = 0;

  PlacedTensor(DType dtype, int64_t buffer_elems, std::vector<int64_t> shape_,
               std::vector<int64_t> stride_, int64_t offset_ = 0)
      : cpu(dtype, {buffer_elems}), shape(std::move(shape_)), stride(std::move(stride_)),
        offset(offset_) {
    bool empty = false;
    int64_t last = offset;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 0) empty = true;
      else last += (shape[d] - 1) * stride[d];
    }
    if (!empty && (offset < 0 || last >= buffer_elems))
      throw std::runtime_error("PlacedTensor: view reaches past the buffer");
    if (is_float_dtype(dtype)) cpu.fill_nan();
  }
  // Copies the host buffer (inputs filled, outputs poisoned) to `gpu` and to the device.
  void finish_init() {
    gpu = cpu;
    device = std::make_unique<DeviceTensor>(gpu);
  }
  TensorView make(void* base, Device dev) const {
    TensorView t;
    t.data = static_cast<unsigned char*>(base) + offset * int64_t(dtype_size(cpu.dtype));
    t.dtype = cpu.dtype;
    t.ndim = int(shape.size());
    t.device = dev;
    for (size_t d = 0; d < shape.size(); ++d) {
      t.shape[d] = shape[d];
      t.stride[d] = stride[d];
    }
    return t;
  }
  TensorView cpu_view() { return make(cpu.data(), Device::cpu()); }
  TensorView gpu_view() const { return make(device->ptr, Device::cuda(0)); }
  // Buffer index of the element at the given multi-index (trailing indices default to 0).
  int64_t at(int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) const {
    const int64_t idx[4] = {i0, i1, i2, i3};
    int64_t o = offset;
    for (size_t d = 0; d < shape.size(); ++d) o += idx[d] * stride[d];
    return o;
  }
};

// An owned non-blocking CUDA stream (does not synchronise with the legacy default stream).
struct CudaStream {
  cudaStream_t stream = nullptr;
  CudaStream() {
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
      throw std::runtime_error("cudaStreamCreateWithFlags failed");
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  ~CudaStream() { if (stream) cudaStreamDestroy(stream); }
  Stream get() const { return static_cast<Stream>(stream); }
};

// Integer tensor of int64 values.
inline HostTensor int64_tensor(const std::vector<int64_t>& values) {
  HostTensor t(DType::kInt64, {int64_t(values.size())});
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * 8);
  return t;
}

// An index tensor of the given dtype (int32 or int64) holding `values`.
inline HostTensor index_tensor(DType dtype, const std::vector<int64_t>& values) {
  if (dtype == DType::kInt64) return int64_tensor(values);
  std::vector<int32_t> narrow(values.begin(), values.end());
  return int32_tensor(narrow);
}

// Byte-for-byte equality of two host tensors of one dtype and size, compared element by element
// (so NaN payloads and signed zeros must match too). Reports the count and the first mismatches.
inline ::testing::AssertionResult bitwise_equal(const HostTensor& actual, const HostTensor& expected) {
  if (actual.dtype != expected.dtype || actual.bytes.size() != expected.bytes.size())
    return ::testing::AssertionFailure() << "dtype or size mismatch: " << dtype_name(actual.dtype)
                                         << " " << actual.bytes.size() << " bytes vs "
                                         << dtype_name(expected.dtype) << " "
                                         << expected.bytes.size() << " bytes";
  const size_t elem = dtype_size(actual.dtype);
  const size_t n = elem ? actual.bytes.size() / elem : 0;
  size_t bad = 0;
  std::ostringstream os;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&actual.bytes[i * elem], &expected.bytes[i * elem], elem) == 0) continue;
    if (bad < 8) {
      os << "\n  [" << i << "] got ";
      if (is_float_dtype(actual.dtype)) os << actual.get(int64_t(i)) << " expected " << expected.get(int64_t(i));
      else if (actual.dtype == DType::kInt32) os << actual.i32(int64_t(i)) << " expected " << expected.i32(int64_t(i));
      else os << "(bytes differ)";
    }
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " elements differ bitwise:" << os.str();
}

// Runs `enqueue(stream)` inside a CUDA-graph capture of a fresh non-blocking stream (global
// capture mode, so a launch on another stream, a host sync or an allocation fails the capture),
// then replays the graph and waits for it.
template <typename Fn>
::testing::AssertionResult run_in_cuda_graph(Fn&& enqueue) {
  CudaStream stream;
  if (cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeGlobal) != cudaSuccess)
    return ::testing::AssertionFailure() << "cudaStreamBeginCapture failed";
  try {
    enqueue(stream.get());
  } catch (const std::exception& e) {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream.stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return ::testing::AssertionFailure() << "op threw during capture: " << e.what();
  }
  cudaGraph_t graph = nullptr;
  cudaError_t status = cudaStreamEndCapture(stream.stream, &graph);
  if (status != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return ::testing::AssertionFailure() << "capture invalidated: " << cudaGetErrorString(status);
  }
  cudaGraphExec_t exec = nullptr;
  status = cudaGraphInstantiate(&exec, graph, 0);
  if (status == cudaSuccess) status = cudaGraphLaunch(exec, stream.stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream.stream);
  if (exec) cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  if (status != cudaSuccess)
    return ::testing::AssertionFailure() << "graph replay failed: " << cudaGetErrorString(status);
  return ::testing::AssertionSuccess();
}

// How a test enqueues an op: on the default stream, on a non-blocking stream, or captured into a
// CUDA graph and replayed.
enum class Launch { kDefaultStream, kNonBlockingStream, kCudaGraph };

// enqueue(stream) as `launch` says, then a device sync; a fatal GoogleTest failure where it
// throws or its capture fails (callers wrap it in ASSERT_NO_FATAL_FAILURE).
template <typename Fn>
void launch_op(Launch launch, Fn&& enqueue) {
  switch (launch) {
    case Launch::kDefaultStream:
      ASSERT_NO_THROW(enqueue(Stream{nullptr}));
      break;
    case Launch::kNonBlockingStream: {
      CudaStream stream;
      ASSERT_NO_THROW(enqueue(stream.get()));
      MLA_TEST_CUDA(cudaStreamSynchronize(stream.stream));
      break;
    }
    case Launch::kCudaGraph:
      ASSERT_TRUE(run_in_cuda_graph(enqueue));
      break;
  }
  MLA_TEST_CUDA(cudaDeviceSynchronize());
}

// `enqueue(stream)` with a debug mode on (check_metadata: it waits for host copies) is refused
// inside a CUDA-graph capture, with an error that names check_metadata.
template <typename Fn>
::testing::AssertionResult check_metadata_refused_during_capture(Fn&& enqueue) {
  const ::testing::AssertionResult captured = run_in_cuda_graph(std::forward<Fn>(enqueue));
  if (captured) return ::testing::AssertionFailure() << "captured and replayed without an error";
  if (std::string(captured.message()).find("check_metadata") == std::string::npos)
    return ::testing::AssertionFailure() << "the error does not name check_metadata: " << captured.message();
  return ::testing::AssertionSuccess();
}

}  // namespace mla::test
