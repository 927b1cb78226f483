#include "mla/tensor.hpp"

#include <array>
#include <cstdint>
#include <cstdlib>
#include <utility>

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

namespace {

// The bytes [first, last) a view spans, from its lowest element to the end of its highest; empty
// (first == last) without elements.
std::pair<uintptr_t, uintptr_t> byte_span(const TensorView& t) {
  const auto data = reinterpret_cast<uintptr_t>(t.data);
  if (t.empty() || t.numel() == 0) return {data, data};
  const int64_t esize = int64_t(dtype_size(t.dtype));
  int64_t low = 0, high = 0;  // element offsets of the lowest and highest elements
  for (int d = 0; d < t.ndim && d < kMaxDims; ++d) {
    const int64_t reach = (t.shape[d] - 1) * t.stride[d];
    (reach < 0 ? low : high) += reach;
  }
  return {data - uintptr_t(-low * esize), data + uintptr_t((high + 1) * esize)};
}

// Rows of two views laid side by side in one buffer (k_nope_out and k_pe_out over a [T, 576]
// cache row, q_nope and q_pe over [T, H, 576]): every stride but the last a multiple of a pitch
// of P bytes (the smallest of them), the last dims contiguous, and each view's row of w bytes
// inside a part of the pitch the other's rows never reach.
bool rows_apart(const TensorView& a, const TensorView& b) {
  int64_t strides[2 * kMaxDims];
  int n = 0;
  int64_t pitch = 0;
  for (const TensorView* t : {&a, &b}) {
    const int64_t esize = int64_t(dtype_size(t->dtype));
    if (t->ndim < 1 || t->ndim > kMaxDims) return false;
    if (t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1) return false;
    for (int d = 0; d + 1 < t->ndim; ++d) {
      if (t->shape[d] <= 1) continue;
      const int64_t bytes = std::abs(t->stride[d]) * esize;
      strides[n++] = bytes;
      if (pitch == 0 || bytes < pitch) pitch = bytes;
    }
  }
  if (pitch == 0) return false;  // one row each: their spans decide
  for (int i = 0; i < n; ++i)
    if (strides[i] % pitch != 0) return false;
  const int64_t width_a = a.shape[a.ndim - 1] * int64_t(dtype_size(a.dtype));
  const int64_t width_b = b.shape[b.ndim - 1] * int64_t(dtype_size(b.dtype));
  const int64_t delta = int64_t(reinterpret_cast<uintptr_t>(b.data) - reinterpret_cast<uintptr_t>(a.data));
  const int64_t r = ((delta % pitch) + pitch) % pitch;  // b's rows start r bytes into a's pitch
  return r >= width_a && r + width_b <= pitch;
}

bool spans_overlap(const TensorView& a, const TensorView& b) {
  const auto [a_first, a_last] = byte_span(a);
  const auto [b_first, b_last] = byte_span(b);
  return a_first != a_last && b_first != b_last && a_first < b_last && b_first < a_last &&
         !rows_apart(a, b);
}

}  // namespace

void disjoint(const char* op, const char* out_arg, const TensorView& out, const char* in_arg,
              const TensorView& in) {
  MLA_CHECK(!spans_overlap(out, in), op, ": ", out_arg, " (", out.describe(), ") overlaps ", in_arg,
            " (", in.describe(), "); give ", out_arg, " its own memory");
}

void disjoint(const char* op, const char* out_arg, const TensorView& out, NamedViews inputs) {
  for (const auto& [in_arg, in] : inputs) disjoint(op, out_arg, out, in_arg, *in);
}

void same_or_disjoint(const char* op, const char* out_arg, const TensorView& out,
                      const char* in_arg, const TensorView& in) {
  bool same = out.data == in.data && out.dtype == in.dtype && out.ndim == in.ndim;
  for (int d = 0; same && d < out.ndim && d < kMaxDims; ++d)
    same = out.shape[d] == in.shape[d] && (out.shape[d] <= 1 || out.stride[d] == in.stride[d]);
  MLA_CHECK(same || !spans_overlap(out, in), op, ": ", out_arg, " (", out.describe(),
            ") partly overlaps ", in_arg, " (", in.describe(), "); give it its own memory or ",
            in_arg, " itself (the same view, in place)");
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
