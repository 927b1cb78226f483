#include "mla/tensor.hpp"

#include <array>
#include <cstdint>
#include <cstdlib>

#include "mla/error.hpp"

namespace mla {

std::string device_name(Device device) {
  return device.type == DeviceType::kCPU ? std::string("cpu")
                                         : "cuda:" + std::to_string(device.index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  MLA_CHECK(shape.size() <= size_t(kMaxDims), "TensorView: at most ", kMaxDims,
            " dimensions, got ", shape.size());
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = int(shape.size());
  t.device = device;
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> stride, Device device) {
  MLA_CHECK(shape.size() == stride.size(), "TensorView: shape has ", shape.size(),
            " dims but stride has ", stride.size());
  TensorView t = contiguous(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : stride) t.stride[i++] = s;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim && d < kMaxDims; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  if (ndim > kMaxDims) return false;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (empty()) return "(not given)";
  if (ndim < 0 || ndim > kMaxDims) return "(a view of " + std::to_string(ndim) + " dims)";
  std::string out = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) out += ", ";
    out += std::to_string(shape[d]);
  }
  out += "] ";
  out += dtype_name(dtype);
  return out + " " + device_name(device);
}

namespace check {

void not_empty(const char* op, const char* arg, const TensorView& t) {
  MLA_CHECK(!t.empty(), op, ": ", arg, " is required but was not given");
  MLA_CHECK(t.ndim >= 0 && t.ndim <= kMaxDims, op, ": ", arg, ".ndim must be in [0, ", kMaxDims,
            "] (a TensorView holds at most ", kMaxDims, " dims), got ", t.ndim);
  MLA_CHECK(t.data != nullptr || t.numel() == 0, op, ": ", arg, " has ", t.numel(),
            " elements but a null data pointer");
  for (int d = 0; d < t.ndim; ++d)
    MLA_CHECK(t.shape[d] >= 0, op, ": ", arg, ".shape[", d, "] must be >= 0, got ", t.shape[d]);
}

void ndim(const char* op, const char* arg, const TensorView& t, int expected) {
  not_empty(op, arg, t);
  MLA_CHECK(t.ndim == expected, op, ": ", arg, " must have ", expected, " dims, got ", t.ndim,
            " (", t.describe(), ")");
}

void dim(const char* op, const char* arg, const TensorView& t, int d, int64_t expected,
         const char* what) {
  MLA_CHECK(t.shape[d] == expected, op, ": ", arg, ".shape[", d, "] must be ", expected,
            what ? " (" : "", what ? what : "", what ? ")" : "", ", got ", t.shape[d], " (",
            t.describe(), ")");
}

void dtype(const char* op, const char* arg, const TensorView& t, DType expected) {
  MLA_CHECK(t.dtype == expected, op, ": ", arg, " must be ", dtype_name(expected), ", got ",
            dtype_name(t.dtype));
}

void dtype_in(const char* op, const char* arg, const TensorView& t,
              std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += (names.empty() ? "" : "/") + std::string(dtype_name(d));
  MLA_FAIL(op, ": ", arg, " must be one of ", names, ", got ", dtype_name(t.dtype));
}

void inner_contiguous(const char* op, const char* arg, const TensorView& t) {
  MLA_CHECK(t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1, op, ": ", arg,
            " must have a contiguous last dimension (stride 1), got stride ",
            t.stride[t.ndim - 1]);
}

void rows_aligned16(const char* op, const char* arg, const TensorView& t, const char* where) {
  const int64_t esize = int64_t(dtype_size(t.dtype));
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  MLA_CHECK(address % 16 == 0, op, ": ", arg, " must be 16-byte aligned ", where, ", got address ",
            t.data, " (", t.describe(), ")");
  for (int d = 0; d < t.ndim - 1; ++d)
    MLA_CHECK(t.shape[d] <= 1 || (t.stride[d] * esize) % 16 == 0, op, ": ", arg, ".stride[", d,
              "] must be a multiple of 16 bytes (", 16 / esize, " elements) ", where, ", got ",
              t.stride[d], " (", t.describe(), ")");
}

void non_overlapping(const char* op, const char* arg, const TensorView& t) {
  // Dims of more than one element by |stride|, innermost first: each dim's stride must clear the
  // span of the dims inside it (a sufficient condition, met by every dense or padded layout).
  if (t.numel() == 0) return;  // nothing is written
  std::array<int, kMaxDims> order{};
  int n = 0;
  for (int d = 0; d < t.ndim && d < kMaxDims; ++d) {
    if (t.shape[d] <= 1) continue;
    int i = n++;  // insertion by |stride|, stable: at most kMaxDims dims
    for (; i > 0 && std::abs(t.stride[order[size_t(i - 1)]]) > std::abs(t.stride[d]); --i)
      order[size_t(i)] = order[size_t(i - 1)];
    order[size_t(i)] = d;
  }
  int64_t span = 1;  // elements covered by the dims so far
  for (int i = 0; i < n; ++i) {
    const int d = order[size_t(i)];
    const int64_t stride = std::abs(t.stride[d]);
    MLA_CHECK(stride >= span, op, ": ", arg, " is an output whose elements overlap: stride[", d,
              "] = ", t.stride[d], " over ", t.shape[d], " elements (", t.describe(),
              "); give it distinct memory for every element");
    span = stride * (t.shape[d] - 1) + span;
  }
}

void contiguous(const char* op, const char* arg, const TensorView& t) {
  MLA_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous (row-major), got ",
            t.describe(), " with non-contiguous strides");
}

void same_device(const char* op, const char* arg, const TensorView& t, Device expected) {
  MLA_CHECK(t.device == expected, op, ": ", arg, " is on ", device_name(t.device),
            " but the other tensors are on ", device_name(expected));
}

}  // namespace check
}  // namespace mla
