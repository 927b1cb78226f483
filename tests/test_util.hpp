// Shared test helpers: owning host tensors, random fills, NaN poisoning, element-wise comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "mla/dtype.hpp"
#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace mla::test {

// An owning, contiguous host tensor.
struct HostTensor {
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;

  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> s) : dtype(dt), shape(std::move(s)) {
    bytes.assign(size_t(numel()) * dtype_size(dtype), 0);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  TensorView view(Device device = Device::cpu()) {
    TensorView t;
    // A zero-element tensor still gets a non-null pointer (it is "given", just empty).
    static unsigned char empty_storage[16];
    t.data = bytes.empty() ? static_cast<void*>(empty_storage) : static_cast<void*>(bytes.data());
    t.dtype = dtype;
    t.ndim = int(shape.size());
    t.device = device;
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape[d];
      t.stride[d] = stride;
      stride *= shape[d];
    }
    return t;
  }
  float get(int64_t i) const { return load_as_float(bytes.data(), dtype, i); }
  void set(int64_t i, float v) { store_from_float(bytes.data(), dtype, i, v); }
  int32_t& i32(int64_t i) { return reinterpret_cast<int32_t*>(bytes.data())[i]; }
  int32_t i32(int64_t i) const { return reinterpret_cast<const int32_t*>(bytes.data())[i]; }
  int64_t& i64(int64_t i) { return reinterpret_cast<int64_t*>(bytes.data())[i]; }
  // Float elements, as float.
  std::vector<float> to_float() const {
    std::vector<float> out(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) out[size_t(i)] = get(i);
    return out;
  }
  void fill_uniform(std::mt19937_64& rng, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
  }
  void fill_nan() {
    for (int64_t i = 0; i < numel(); ++i) set(i, std::numeric_limits<float>::quiet_NaN());
  }
};

// Integer tensors from a vector.
inline HostTensor int32_tensor(const std::vector<int32_t>& values, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {int64_t(values.size())};
  HostTensor t(DType::kInt32, shape);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * 4);
  return t;
}

// Every element of `actual` within atol + rtol*|expected|; NaN/inf positions must match.
// Reports the count and the first few mismatches with their flat index.
// The rows of requests `which` (in that order) of a [T, ...] tensor whose request b owns
// `counts[b]` consecutive rows from the start, request after request: a batch of its own.
inline HostTensor request_rows(const HostTensor& t, const std::vector<int32_t>& counts,
                               const std::vector<int>& which) {
  std::vector<size_t> first(counts.size() + 1, 0);
  for (size_t b = 0; b < counts.size(); ++b) first[b + 1] = first[b] + size_t(counts[b]);
  size_t rows = 0;
  for (int b : which) rows += size_t(counts[size_t(b)]);
  std::vector<int64_t> shape = t.shape;
  shape[0] = int64_t(rows);
  HostTensor out(t.dtype, shape);
  const size_t row_bytes = t.shape[0] ? t.bytes.size() / size_t(t.shape[0]) : 0;
  size_t at = 0;
  for (int b : which) {
    const size_t n = size_t(counts[size_t(b)]) * row_bytes;
    if (n) std::memcpy(out.bytes.data() + at, t.bytes.data() + first[size_t(b)] * row_bytes, n);
    at += n;
  }
  return out;
}

inline ::testing::AssertionResult all_close(const std::vector<float>& actual,
                                            const std::vector<double>& expected, double atol,
                                            double rtol) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure()
           << "size mismatch: " << actual.size() << " vs " << expected.size();
  size_t bad = 0;
  std::ostringstream os;
  double worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    double a = actual[i], e = expected[i];
    bool ok;
    if (std::isnan(e) || std::isnan(a)) ok = std::isnan(e) && std::isnan(a);
    else if (std::isinf(e) || std::isinf(a)) ok = a == e;
    else {
      double err = std::fabs(a - e);
      ok = err <= atol + rtol * std::fabs(e);
      worst = std::max(worst, err);
    }
    if (!ok) {
      if (bad < 8) os << "\n  [" << i << "] got " << a << " expected " << e;
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << actual.size()
                                       << " elements differ (atol " << atol << ", rtol " << rtol
                                       << ", worst finite abs err " << worst << "):" << os.str();
}

// Runs fn and checks it throws mla::Error whose message contains every given fragment.
template <typename Fn>
::testing::AssertionResult throws_error(Fn&& fn, std::initializer_list<const char*> fragments) {
  try {
    fn();
  } catch (const mla::Error& e) {
    std::string what = e.what();
    for (const char* f : fragments)
      if (what.find(f) == std::string::npos)
        return ::testing::AssertionFailure()
               << "mla::Error message lacks \"" << f << "\": " << what;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-mla exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace mla::test
