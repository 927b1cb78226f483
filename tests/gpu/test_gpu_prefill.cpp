// GPU tests of mha_prefill (src/cuda/prefill): every element of out and lse is checked against a
// float64 naive written here and against the CPU implementation run on the same inputs through the
// public op. Long requests are checked on sampled rows against the float64 naive only.
//
// Tolerances (|gpu - ref| <= atol + rtol * |ref|), from the two roundings the kernel makes:
//   P (softmax weights in [0, 1]) rounded to the compute type: bf16 2^-9, fp16 2^-11 relative,
//     giving an absolute error below p_err * max|v| (inputs here keep |v| <= 1);
//   the output rounded to its dtype (up to 1 ulp apart from the CPU's rounding).
//   compute bf16 (bf16 inputs): p_err 4e-3;  compute fp16 (fp16 and fp8 inputs): p_err 1e-3.
//   out bf16: atol p_err + 8e-3, rtol 8e-3;  fp16: atol p_err + 1e-3, rtol 1e-3;
//   fp32: atol p_err, rtol 1e-5.  lse (fp32 scores, both sides): atol 5e-4, rtol 2e-4.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "gpu_util.hpp"
#include "mla/ops.hpp"

namespace mla::test {
namespace {

constexpr int64_t kQkDim = 192;
constexpr int64_t kVDim = 128;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Tolerance {
  double atol, rtol;
};
Tolerance out_tolerance(DType in, DType out) {
  const double p_err = in == DType::kBF16 ? 4e-3 : 1e-3;
  switch (out) {
    case DType::kBF16: return {p_err + 8e-3, 8e-3};
    case DType::kFP16: return {p_err + 1e-3, 1e-3};
    default: return {p_err, 1e-5};
  }
}
constexpr Tolerance kLseTolerance{5e-4, 2e-4};

// A view into `base` starting `offset` elements in, on the host.
TensorView host_view(HostTensor& base, int64_t offset, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride) {
  auto* data = static_cast<unsigned char*>(base.data()) + offset * int64_t(dtype_size(base.dtype));
  return TensorView::strided(data, base.dtype, shape, stride, Device::cpu());
}
// The same view over the device copy of `base`.
TensorView device_view(const TensorView& host, const HostTensor& base, const DeviceTensor& dev) {
  TensorView t = host;
  t.device = Device::cuda(0);
  t.data = static_cast<unsigned char*>(dev.ptr) +
           (static_cast<const unsigned char*>(host.data) - static_cast<const unsigned char*>(base.data()));
  return t;
}

int64_t offset_of(const TensorView& t, int64_t i0, int64_t i1, int64_t i2 = 0) {
  return i0 * t.stride[0] + i1 * t.stride[1] + (t.ndim > 2 ? i2 * t.stride[2] : 0);
}
double element(const TensorView& t, int64_t i0, int64_t i1, int64_t i2) {
  return double(load_as_float(t.data, t.dtype, offset_of(t, i0, i1, i2)));
}

// Calls fn(i) for i in [0, n) on all host cores (the float64 references dominate test time).
template <typename Fn>
void parallel_for_each(int64_t n, Fn&& fn) {
  const int64_t workers = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (std::thread& t : threads) t.join();
}

std::vector<int32_t> cumulative(const std::vector<int>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t b = 0; b < lens.size(); ++b) cu[b + 1] = cu[b] + lens[b];
  return cu;
}

// Float64 attention of one (query token, head) row, straight from the formulas in mla/ops.hpp.
// Writes out[0, 128) and returns lse; a row with no visible key gives 0 and -inf.
double naive_row(const MhaPrefillArgs& a, int64_t q_first, int64_t q_len, int64_t kv_first,
                 int64_t kv_len, int64_t i, int64_t h, double* out) {
  const bool fp8 = a.q.dtype == DType::kFP8E4M3;
  const double score_scale = double(a.softmax_scale) * (fp8 ? double(a.q_scale) * a.k_scale : 1.0);
  const double value_scale = fp8 ? double(a.v_scale) : 1.0;
  const int64_t seen = a.causal ? std::clamp<int64_t>(kv_len - q_len + i + 1, 0, kv_len) : kv_len;
  std::fill(out, out + kVDim, 0.0);
  if (seen == 0) return kNegInf;
  double query[kQkDim];
  for (int64_t d = 0; d < kQkDim; ++d) query[d] = element(a.q, q_first + i, h, d);
  std::vector<double> scores(static_cast<size_t>(seen));
  for (int64_t j = 0; j < seen; ++j) {
    double dot = 0;
    for (int64_t d = 0; d < kQkDim; ++d) dot += query[d] * element(a.k, kv_first + j, h, d);
    scores[size_t(j)] = dot * score_scale;
  }
  const double max_score = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (int64_t j = 0; j < seen; ++j) {
    const double p = std::exp(scores[size_t(j)] - max_score);
    sum += p;
    for (int64_t c = 0; c < kVDim; ++c) out[c] += p * element(a.v, kv_first + j, h, c);
  }
  for (int64_t c = 0; c < kVDim; ++c) out[c] *= value_scale / sum;
  return max_score + std::log(sum);
}

// One ragged prefill problem with its host inputs, laid out as the case asks.
struct PrefillCase {
  std::vector<int> q_lens, kv_lens;
  int64_t heads = 1;
  DType in = DType::kBF16, out = DType::kBF16;
  bool causal = true;
  bool with_lse = true;
  // q, k, v as views into one packed [T, H, 544] buffer (192 | 192 | 128 | 32 NaN padding),
  // out inside a NaN-poisoned [T, H, 160] buffer and lse transposed ([H, T] storage).
  // Needs q_lens == kv_lens.
  bool strided = false;
  float softmax_scale = 0.3f;  // larger than 1/sqrt(192) to make the softmax peaked
  float q_scale = 0.5f, k_scale = 0.25f, v_scale = 0.125f;  // used for fp8 inputs
  int max_q_len_slack = 0;  // added to the true max q_len for the GPU launch bound
  bool cuda_graph = false;  // launch inside a CUDA-graph capture (no host sync, no allocation)
  uint64_t seed = 1;
};

struct PrefillBuffers {
  HostTensor qkv, q, k, v;  // qkv when strided; q, k, v otherwise
  HostTensor cu_q, cu_kv;
  HostTensor out, lse;      // NaN-poisoned output storage
  MhaPrefillArgs args;      // host views
  int64_t out_row = kVDim;  // elements between heads in `out` storage
};

void make_buffers(const PrefillCase& c, PrefillBuffers& buf) {
  const std::vector<int32_t> cu_q = cumulative(c.q_lens), cu_kv = cumulative(c.kv_lens);
  const int64_t tq = cu_q.back(), tk = cu_kv.back(), h = c.heads;
  std::mt19937_64 rng(c.seed);
  const bool fp8 = c.in == DType::kFP8E4M3;
  // Real values in [-1, 1] (fp8: stored values in [-1/scale, 1/scale]).
  const float q_range = fp8 ? 1.0f / c.q_scale : 1.0f;
  const float k_range = fp8 ? 1.0f / c.k_scale : 1.0f;
  const float v_range = fp8 ? 1.0f / c.v_scale : 1.0f;
  MhaPrefillArgs& a = buf.args;
  if (c.strided) {
    constexpr int64_t kPacked = 2 * kQkDim + kVDim + 32;
    buf.qkv = HostTensor(c.in, {tq, h, kPacked});
    buf.qkv.fill_nan();
    for (int64_t t = 0; t < tq; ++t)
      for (int64_t hh = 0; hh < h; ++hh) {
        const int64_t base = (t * h + hh) * kPacked;
        std::uniform_real_distribution<float> dq(-q_range, q_range), dk(-k_range, k_range),
            dv(-v_range, v_range);
        for (int64_t d = 0; d < kQkDim; ++d) buf.qkv.set(base + d, dq(rng));
        for (int64_t d = 0; d < kQkDim; ++d) buf.qkv.set(base + kQkDim + d, dk(rng));
        for (int64_t d = 0; d < kVDim; ++d) buf.qkv.set(base + 2 * kQkDim + d, dv(rng));
      }
    a.q = host_view(buf.qkv, 0, {tq, h, kQkDim}, {h * kPacked, kPacked, 1});
    a.k = host_view(buf.qkv, kQkDim, {tk, h, kQkDim}, {h * kPacked, kPacked, 1});
    a.v = host_view(buf.qkv, 2 * kQkDim, {tk, h, kVDim}, {h * kPacked, kPacked, 1});
  } else {
    buf.q = HostTensor(c.in, {tq, h, kQkDim});
    buf.k = HostTensor(c.in, {tk, h, kQkDim});
    buf.v = HostTensor(c.in, {tk, h, kVDim});
    buf.q.fill_uniform(rng, -q_range, q_range);
    buf.k.fill_uniform(rng, -k_range, k_range);
    buf.v.fill_uniform(rng, -v_range, v_range);
    // Poison what no query may read: keys and values of requests without queries, queries of
    // requests without keys (their rows must come out as 0 / -inf without touching q).
    for (size_t b = 0; b < c.q_lens.size(); ++b) {
      if (c.q_lens[b] == 0)
        for (int64_t e = cu_kv[b] * h; e < cu_kv[b + 1] * h; ++e) {
          for (int64_t d = 0; d < kQkDim; ++d) buf.k.set(e * kQkDim + d, NAN);
          for (int64_t d = 0; d < kVDim; ++d) buf.v.set(e * kVDim + d, NAN);
        }
      if (c.kv_lens[b] == 0)
        for (int64_t e = cu_q[b] * h * kQkDim; e < cu_q[b + 1] * h * kQkDim; ++e) buf.q.set(e, NAN);
    }
    a.q = buf.q.view();
    a.k = buf.k.view();
    a.v = buf.v.view();
  }
  buf.cu_q = int32_tensor(cu_q);
  buf.cu_kv = int32_tensor(cu_kv);
  a.cu_q_lens = buf.cu_q.view();
  a.cu_kv_lens = buf.cu_kv.view();
  buf.out_row = c.strided ? 160 : kVDim;
  buf.out = HostTensor(c.out, {tq, h, buf.out_row});
  buf.out.fill_nan();
  a.out = host_view(buf.out, 0, {tq, h, kVDim}, {h * buf.out_row, buf.out_row, 1});
  if (c.with_lse) {
    buf.lse = HostTensor(DType::kFP32, {tq, h});
    buf.lse.fill_nan();
    a.lse = c.strided ? host_view(buf.lse, 0, {tq, h}, {1, tq}) : host_view(buf.lse, 0, {tq, h}, {h, 1});
  }
  a.causal = c.causal;
  a.softmax_scale = c.softmax_scale;
  a.q_scale = c.q_scale;
  a.k_scale = c.k_scale;
  a.v_scale = c.v_scale;
  a.max_q_len = 0;
  a.max_kv_len = 0;
}

// Expected contents of the out and lse storage (NaN where nothing may be written), float64.
struct Expected {
  std::vector<double> out, lse;
};
Expected naive_all(const PrefillCase& c, const PrefillBuffers& buf) {
  const std::vector<int32_t> cu_q = cumulative(c.q_lens), cu_kv = cumulative(c.kv_lens);
  const MhaPrefillArgs& a = buf.args;
  Expected e;
  e.out.assign(size_t(buf.out.numel()), kNaN);
  e.lse.assign(size_t(buf.lse.numel()), kNaN);
  // Each (request, head) writes its own rows, so the work splits over threads without locks.
  const int64_t batch = int64_t(c.q_lens.size());
  parallel_for_each(batch * c.heads, [&](int64_t item) {
    const int64_t b = item / c.heads, h = item % c.heads;
    for (int64_t i = 0; i < c.q_lens[size_t(b)]; ++i) {
      double row[kVDim];
      const double lse = naive_row(a, cu_q[size_t(b)], c.q_lens[size_t(b)], cu_kv[size_t(b)],
                                   c.kv_lens[size_t(b)], i, h, row);
      const int64_t t = cu_q[size_t(b)] + i;
      std::copy(row, row + kVDim, e.out.begin() + offset_of(a.out, t, h));
      if (c.with_lse) e.lse[size_t(offset_of(a.lse, t, h))] = lse;
    }
  });
  return e;
}

std::vector<double> to_double(const HostTensor& t) {
  const std::vector<float> f = t.to_float();
  return {f.begin(), f.end()};
}

// Runs the case on the GPU (device copies of every input, NaN-poisoned outputs).
void run_gpu(const PrefillCase& c, PrefillBuffers& buf, HostTensor& out_gpu, HostTensor& lse_gpu) {
  HostTensor& in_base = c.strided ? buf.qkv : buf.q;
  DeviceTensor d_in(in_base);
  std::unique_ptr<DeviceTensor> d_k, d_v;
  MhaPrefillArgs a = buf.args;
  a.q = device_view(buf.args.q, in_base, d_in);
  if (c.strided) {
    a.k = device_view(buf.args.k, in_base, d_in);
    a.v = device_view(buf.args.v, in_base, d_in);
  } else {
    d_k = std::make_unique<DeviceTensor>(buf.k);
    d_v = std::make_unique<DeviceTensor>(buf.v);
    a.k = d_k->view();
    a.v = d_v->view();
  }
  DeviceTensor d_cu_q(buf.cu_q), d_cu_kv(buf.cu_kv);
  a.cu_q_lens = d_cu_q.view();
  a.cu_kv_lens = d_cu_kv.view();
  out_gpu = HostTensor(buf.out.dtype, buf.out.shape);
  out_gpu.fill_nan();
  DeviceTensor d_out(out_gpu);
  a.out = device_view(buf.args.out, buf.out, d_out);
  std::unique_ptr<DeviceTensor> d_lse;
  if (c.with_lse) {
    lse_gpu = HostTensor(DType::kFP32, buf.lse.shape);
    lse_gpu.fill_nan();
    d_lse = std::make_unique<DeviceTensor>(lse_gpu);
    a.lse = device_view(buf.args.lse, buf.lse, *d_lse);
  }
  a.max_q_len = (c.q_lens.empty() ? 0 : *std::max_element(c.q_lens.begin(), c.q_lens.end())) +
                c.max_q_len_slack;
  a.max_kv_len = c.kv_lens.empty() ? 0 : *std::max_element(c.kv_lens.begin(), c.kv_lens.end());
  if (a.max_q_len > 0) a.max_kv_len = std::max(a.max_kv_len, 1);  // a bound is then required
  if (c.cuda_graph) {
    EXPECT_TRUE(run_in_cuda_graph([&](Stream stream) { mla::mha_prefill(a, stream); }));
  } else {
    mla::mha_prefill(a, nullptr);
  }
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("kernel failed");
  d_out.download();
  if (d_lse) d_lse->download();
}

// The whole check for one case: GPU vs float64 naive and GPU vs the CPU implementation.
void check_case(const PrefillCase& c) {
  PrefillBuffers buf;
  make_buffers(c, buf);
  HostTensor out_gpu, lse_gpu;
  run_gpu(c, buf, out_gpu, lse_gpu);

  const Expected e = naive_all(c, buf);
  const Tolerance tol = out_tolerance(c.in, c.out);
  EXPECT_TRUE(all_close(out_gpu.to_float(), e.out, tol.atol, tol.rtol)) << "out vs float64 naive";
  if (c.with_lse) {
    EXPECT_TRUE(all_close(lse_gpu.to_float(), e.lse, kLseTolerance.atol, kLseTolerance.rtol))
        << "lse vs float64 naive";
  }

  mla::mha_prefill(buf.args);  // the CPU implementation on the same inputs
  EXPECT_TRUE(all_close(out_gpu.to_float(), to_double(buf.out), tol.atol, tol.rtol)) << "out vs CPU";
  if (c.with_lse) {
    EXPECT_TRUE(all_close(lse_gpu.to_float(), to_double(buf.lse), kLseTolerance.atol, kLseTolerance.rtol))
        << "lse vs CPU";
  }
}

// Ragged lengths covering 0, 1, odd, tile multiples +-1, kv longer than q (chunked prefix), kv
// shorter than q (leading rows see no key), kv 0, q 0 between other requests.
const std::vector<int> kRaggedQ = {0, 1, 1, 5, 63, 64, 65, 127, 0, 129, 10, 7, 33};
const std::vector<int> kRaggedKv = {17, 1, 64, 5, 63, 64, 65, 200, 3, 129, 4, 0, 97};

std::string describe(const PrefillCase& c) {
  std::string s = std::string("in ") + std::string(dtype_name(c.in)) + " out " +
                  std::string(dtype_name(c.out)) + " heads " + std::to_string(c.heads) +
                  (c.causal ? " causal" : " non-causal") + (c.with_lse ? " lse" : "") +
                  (c.strided ? " strided" : "");
  return s;
}

TEST(MhaPrefillGpu, RaggedBf16CausalAndNot) {
  MLA_REQUIRE_GPU();
  for (bool causal : {true, false})
    for (int64_t heads : {1, 16}) {
      PrefillCase c;
      c.q_lens = kRaggedQ;
      c.kv_lens = kRaggedKv;
      c.heads = heads;
      c.causal = causal;
      c.seed = uint64_t(10 + heads + causal);
      SCOPED_TRACE(describe(c));
      check_case(c);
    }
}

TEST(MhaPrefillGpu, RaggedOutputDtypesAndNoLse) {
  MLA_REQUIRE_GPU();
  const struct {
    DType in, out;
    bool causal, lse;
  } combos[] = {{DType::kBF16, DType::kFP32, true, false}, {DType::kBF16, DType::kFP16, false, true},
                {DType::kFP16, DType::kFP16, true, true},  {DType::kFP16, DType::kFP32, false, true},
                {DType::kFP16, DType::kBF16, true, false}};
  for (const auto& combo : combos) {
    PrefillCase c;
    c.q_lens = kRaggedQ;
    c.kv_lens = kRaggedKv;
    c.heads = 3;
    c.in = combo.in;
    c.out = combo.out;
    c.causal = combo.causal;
    c.with_lse = combo.lse;
    c.seed = 20 + uint64_t(combo.in) * 4 + uint64_t(combo.out);
    SCOPED_TRACE(describe(c));
    check_case(c);
  }
}

TEST(MhaPrefillGpu, RaggedFp8WithScales) {
  MLA_REQUIRE_GPU();
  for (DType out : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (bool causal : {true, false}) {
      PrefillCase c;
      c.q_lens = kRaggedQ;
      c.kv_lens = kRaggedKv;
      c.heads = 5;
      c.in = DType::kFP8E4M3;
      c.out = out;
      c.causal = causal;
      c.q_scale = 0.5f;
      c.k_scale = 0.25f;
      c.v_scale = 0.125f;
      c.seed = 40 + uint64_t(out) * 2 + causal;
      SCOPED_TRACE(describe(c));
      check_case(c);
    }
}

TEST(MhaPrefillGpu, Heads128ShortLengths) {
  MLA_REQUIRE_GPU();
  for (DType in : {DType::kBF16, DType::kFP8E4M3}) {
    PrefillCase c;
    c.q_lens = {1, 3, 17, 65, 0};
    c.kv_lens = {1, 40, 17, 70, 5};
    c.heads = 128;
    c.in = in;
    c.seed = 60 + uint64_t(in);
    SCOPED_TRACE(describe(c));
    check_case(c);
  }
}

TEST(MhaPrefillGpu, PackedQkvStridedOutTransposedLse) {
  MLA_REQUIRE_GPU();
  for (DType in : {DType::kBF16, DType::kFP8E4M3})
    for (bool causal : {true, false}) {
      PrefillCase c;
      c.q_lens = {1, 64, 0, 77, 130};
      c.kv_lens = c.q_lens;
      c.heads = 12;
      c.in = in;
      c.out = in == DType::kBF16 ? DType::kBF16 : DType::kFP32;
      c.causal = causal;
      c.strided = true;
      c.seed = 70 + uint64_t(in) * 2 + causal;
      SCOPED_TRACE(describe(c));
      check_case(c);
    }
}

TEST(MhaPrefillGpu, ChunkedPrefixAndEmptyRows) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  // kv much longer than q (prefix chunks), kv shorter than q, kv 0 (every row empty).
  c.q_lens = {5, 64, 100, 1, 70, 9, 3};
  c.kv_lens = {300, 193, 1000, 257, 4, 0, 2};
  c.heads = 16;
  c.max_q_len_slack = 500;  // a loose launch bound only adds idle tiles
  c.seed = 80;
  for (bool causal : {true, false}) {
    c.causal = causal;
    SCOPED_TRACE(describe(c));
    check_case(c);
  }
}

TEST(MhaPrefillGpu, CapturedInCudaGraph) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  c.q_lens = {5, 0, 70};
  c.kv_lens = {9, 4, 70};
  c.heads = 4;
  c.cuda_graph = true;
  c.seed = 85;
  check_case(c);
}

TEST(MhaPrefillGpu, EmptyBatches) {
  MLA_REQUIRE_GPU();
  // No requests (IDLE) and requests with no queries at all: nothing to do, and the exact bounds
  // (max_q_len 0) are accepted; with queries, a bound of 0 is an error naming it.
  for (const std::vector<int>& q_lens : {std::vector<int>{}, std::vector<int>{0, 0}}) {
    PrefillCase c;
    c.q_lens = q_lens;
    c.kv_lens = std::vector<int>(q_lens.size(), 3);
    c.heads = 4;
    PrefillBuffers buf;
    make_buffers(c, buf);
    HostTensor out_gpu, lse_gpu;
    EXPECT_NO_THROW(run_gpu(c, buf, out_gpu, lse_gpu));
  }
  PrefillCase c;
  c.q_lens = {2, 1};
  c.kv_lens = {3, 3};
  c.max_q_len_slack = -2;  // a bound of 0
  PrefillBuffers buf;
  make_buffers(c, buf);
  HostTensor out_gpu, lse_gpu;
  EXPECT_TRUE(throws_error([&] { run_gpu(c, buf, out_gpu, lse_gpu); }, {"mha_prefill", "max_q_len"}));
}

// Sampled rows of one long request against the float64 naive (the CPU implementation would be
// too slow here).
void check_long(PrefillCase c, const std::vector<int64_t>& rows,
                std::initializer_list<bool> causal_modes) {
  PrefillBuffers buf;
  make_buffers(c, buf);
  for (bool causal : causal_modes) {
    c.causal = causal;
    buf.args.causal = causal;
    SCOPED_TRACE(describe(c));
    HostTensor out_gpu, lse_gpu;
    const auto t0 = std::chrono::steady_clock::now();
    run_gpu(c, buf, out_gpu, lse_gpu);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("  long prefill q %d kv %d heads %lld %s: GPU call incl. copies %.1f ms\n", c.q_lens[0],
                c.kv_lens[0], static_cast<long long>(c.heads), causal ? "causal" : "non-causal", ms);
    const Tolerance tol = out_tolerance(c.in, c.out);
    const int64_t samples = int64_t(rows.size()) * c.heads;
    const size_t num_values = static_cast<size_t>(samples * kVDim), num_rows = static_cast<size_t>(samples);
    std::vector<float> got_out(num_values), got_lse(num_rows);
    std::vector<double> want_out(num_values), want_lse(num_rows);
    parallel_for_each(samples, [&](int64_t s) {
      const int64_t i = rows[size_t(s / c.heads)], h = s % c.heads;
      want_lse[size_t(s)] = naive_row(buf.args, 0, c.q_lens[0], 0, c.kv_lens[0], i, h,
                                      want_out.data() + s * kVDim);
      for (int64_t d = 0; d < kVDim; ++d)
        got_out[size_t(s * kVDim + d)] = out_gpu.get(offset_of(buf.args.out, i, h, d));
      got_lse[size_t(s)] = lse_gpu.get(offset_of(buf.args.lse, i, h));
    });
    EXPECT_TRUE(all_close(got_out, want_out, tol.atol, tol.rtol)) << "sampled out rows";
    EXPECT_TRUE(all_close(got_lse, want_lse, kLseTolerance.atol, kLseTolerance.rtol)) << "sampled lse";
    // Every row must be finite (no row sees zero keys here).
    const std::vector<float> all = out_gpu.to_float();
    EXPECT_EQ(std::count_if(all.begin(), all.end(), [](float x) { return !std::isfinite(x); }), 0);
  }
}

TEST(MhaPrefillGpu, LongSingleRequestCausal16k) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  c.q_lens = {16384};
  c.kv_lens = {16384};
  c.heads = 16;
  c.softmax_scale = float(1.0 / std::sqrt(192.0));
  c.seed = 90;
  check_long(c, {0, 1, 63, 64, 65, 1000, 4097, 8191, 12288, 16383}, {true});
}

TEST(MhaPrefillGpu, LongKvNonCausalFp8) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  c.q_lens = {300};
  c.kv_lens = {32768};
  c.heads = 16;
  c.in = DType::kFP8E4M3;
  c.out = DType::kBF16;
  c.seed = 91;
  // Causal is bottom-right aligned: row i sees 32468 + i + 1 keys.
  check_long(c, {0, 150, 299}, {false, true});
}

// A max_q_len below a request's q_len is a caller error the GPU cannot see without a host sync;
// the rows beyond the launch bound come out NaN (output and lse), the rows inside it are right.
TEST(MhaPrefillGpu, TooSmallMaxQLenPoisonsUncoveredRows) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  c.q_lens = {200, 10};
  c.kv_lens = {200, 10};
  c.heads = 2;
  c.max_q_len_slack = 64 - 200;  // launch bound 64
  PrefillBuffers buf;
  make_buffers(c, buf);
  HostTensor out_gpu, lse_gpu;
  run_gpu(c, buf, out_gpu, lse_gpu);
  Expected e = naive_all(c, buf);
  for (int64_t t = 64; t < 200; ++t)
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t d = 0; d < kVDim; ++d) e.out[size_t(offset_of(buf.args.out, t, h, d))] = kNaN;
      e.lse[size_t(offset_of(buf.args.lse, t, h))] = kNaN;
    }
  const Tolerance tol = out_tolerance(c.in, c.out);
  EXPECT_TRUE(all_close(out_gpu.to_float(), e.out, tol.atol, tol.rtol));
  EXPECT_TRUE(all_close(lse_gpu.to_float(), e.lse, kLseTolerance.atol, kLseTolerance.rtol));
}

// `host`'s arguments over device copies of contiguous tensors.
MhaPrefillArgs contiguous_on_device(const MhaPrefillArgs& host, DeviceTensor& q, DeviceTensor& k,
                                    DeviceTensor& v, DeviceTensor& cu_q, DeviceTensor& cu_kv,
                                    DeviceTensor& out, DeviceTensor& lse) {
  MhaPrefillArgs a = host;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.cu_q_lens = cu_q.view();
  a.cu_kv_lens = cu_kv.view();
  a.out = out.view();
  a.lse = lse.view();
  return a;
}

// Two requests of 2 heads for the offset tests: Tq 7, Tk 9.
PrefillCase two_requests() {
  PrefillCase c;
  c.q_lens = {3, 4};
  c.kv_lens = {5, 4};
  c.heads = 2;
  return c;
}

// Offsets on the device are not checked on the host: the kernel clamps them to [0, Tq] / [0, Tk]
// (a request whose end precedes its start has no rows). Each case's rows come out as attention
// over the clamped geometry, rows no request covers keep their NaN poison, and nothing is read or
// written outside the tensors (compute-sanitizer's memcheck runs this test).
TEST(MhaPrefillGpu, BadDeviceOffsetsAreClampedToTheTensors) {
  MLA_REQUIRE_GPU();
  const PrefillCase c = two_requests();
  PrefillBuffers buf;
  make_buffers(c, buf);
  constexpr int32_t kMax = INT32_MAX;
  struct Geometry {
    int64_t q_first, q_len, kv_first, kv_len;
  };
  struct BadCase {
    std::vector<int32_t> cu_q, cu_kv;
    std::vector<Geometry> expected;  // what the clamps make of each request
  };
  const std::vector<BadCase> cases = {
      {{0, 3, 1 << 30}, {0, 5, 1 << 30}, {{0, 3, 0, 5}, {3, 4, 5, 4}}},  // ends past T
      {{0, -5, 7}, {0, 5, 9}, {{0, 0, 0, 5}, {0, 7, 5, 4}}},            // negative offset
      {{0, 3, 7}, {0, kMax, -1}, {{0, 3, 0, 9}, {3, 4, 9, 0}}},         // no keys left
      {{-100, 3, 2}, {-3, 5, 9}, {{0, 3, 0, 5}, {3, 0, 5, 4}}},         // end before start
  };
  const Tolerance tol = out_tolerance(c.in, c.out);
  DeviceTensor d_q(buf.q), d_k(buf.k), d_v(buf.v);
  for (size_t i = 0; i < cases.size(); ++i) {
    const BadCase& bad = cases[i];
    HostTensor cu_q = int32_tensor(bad.cu_q), cu_kv = int32_tensor(bad.cu_kv);
    HostTensor out = buf.out, lse = buf.lse;  // NaN
    DeviceTensor d_cu_q(cu_q), d_cu_kv(cu_kv), d_out(out), d_lse(lse);
    MhaPrefillArgs a = contiguous_on_device(buf.args, d_q, d_k, d_v, d_cu_q, d_cu_kv, d_out, d_lse);
    a.max_q_len = 7;
    a.max_kv_len = 9;
    ASSERT_NO_THROW(mla::mha_prefill(a)) << "case " << i;
    MLA_TEST_CUDA(cudaDeviceSynchronize());
    d_out.download();
    d_lse.download();

    Expected e;
    e.out.assign(size_t(out.numel()), kNaN);
    e.lse.assign(size_t(lse.numel()), kNaN);
    for (const Geometry& g : bad.expected)
      for (int64_t r = 0; r < g.q_len; ++r)
        for (int64_t h = 0; h < c.heads; ++h) {
          double row[kVDim];
          const double row_lse = naive_row(buf.args, g.q_first, g.q_len, g.kv_first, g.kv_len, r, h, row);
          std::copy(row, row + kVDim, e.out.begin() + offset_of(buf.args.out, g.q_first + r, h));
          e.lse[size_t(offset_of(buf.args.lse, g.q_first + r, h))] = row_lse;
        }
    EXPECT_TRUE(all_close(out.to_float(), e.out, tol.atol, tol.rtol)) << "out, case " << i;
    EXPECT_TRUE(all_close(lse.to_float(), e.lse, kLseTolerance.atol, kLseTolerance.rtol))
        << "lse, case " << i;
  }
}

// MhaPrefillArgs::check_metadata: the device offsets checked on host copies with the CPU path's
// messages, before anything is launched; refused during graph capture. Good offsets give the
// bits of a run without it.
TEST(MhaPrefillGpu, CheckMetadataNamesTheFirstBadOffset) {
  MLA_REQUIRE_GPU();
  const PrefillCase c = two_requests();
  PrefillBuffers buf;
  make_buffers(c, buf);
  DeviceTensor d_q(buf.q), d_k(buf.k), d_v(buf.v);
  struct BadCase {
    std::vector<int32_t> cu_q, cu_kv;
    int max_q_len;
    const char* message[2];  // two fragments of the expected message
  };
  const std::vector<BadCase> cases = {
      {{0, 3, 1 << 30}, {0, 5, 9}, 7, {"mha_prefill", "cu_q_lens[2] must equal the 7"}},
      {{0, 3, 7}, {-1, 5, 9}, 7, {"mha_prefill", "cu_kv_lens[0] must be 0"}},
      {{0, 8, 7}, {0, 5, 9}, 8, {"cu_q_lens must be non-decreasing", "cu_q_lens[1] = 8 > cu_q_lens[2] = 7"}},
      {{0, 3, 7}, {0, 5, 9}, 3, {"request 1 has 4 queries", "max_q_len is 3"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const BadCase& bad = cases[i];
    HostTensor cu_q = int32_tensor(bad.cu_q), cu_kv = int32_tensor(bad.cu_kv);
    HostTensor out = buf.out, lse = buf.lse;  // NaN
    DeviceTensor d_cu_q(cu_q), d_cu_kv(cu_kv), d_out(out), d_lse(lse);
    MhaPrefillArgs a = contiguous_on_device(buf.args, d_q, d_k, d_v, d_cu_q, d_cu_kv, d_out, d_lse);
    a.max_q_len = bad.max_q_len;
    a.max_kv_len = 9;
    a.check_metadata = true;
    EXPECT_TRUE(throws_error([&] { mla::mha_prefill(a); }, {bad.message[0], bad.message[1]}))
        << "case " << i;
    d_lse.download();  // nothing was launched
    EXPECT_TRUE(std::isnan(lse.to_float()[0])) << "case " << i;
  }

  HostTensor cu_q = int32_tensor({0, 3, 7}), cu_kv = int32_tensor({0, 5, 9});
  HostTensor out = buf.out, lse = buf.lse, out_checked = buf.out, lse_checked = buf.lse;
  DeviceTensor d_cu_q(cu_q), d_cu_kv(cu_kv), d_out(out), d_lse(lse), d_out_checked(out_checked),
      d_lse_checked(lse_checked);
  MhaPrefillArgs a = contiguous_on_device(buf.args, d_q, d_k, d_v, d_cu_q, d_cu_kv, d_out, d_lse);
  a.max_q_len = 7;
  a.max_kv_len = 9;
  ASSERT_NO_THROW(mla::mha_prefill(a));
  MhaPrefillArgs checked = contiguous_on_device(buf.args, d_q, d_k, d_v, d_cu_q, d_cu_kv,
                                                d_out_checked, d_lse_checked);
  checked.max_q_len = 7;
  checked.max_kv_len = 9;
  checked.check_metadata = true;
  ASSERT_NO_THROW(mla::mha_prefill(checked));
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  for (DeviceTensor* t : {&d_out, &d_lse, &d_out_checked, &d_lse_checked}) t->download();
  EXPECT_TRUE(bitwise_equal(out_checked, out));
  EXPECT_TRUE(bitwise_equal(lse_checked, lse));
  EXPECT_TRUE(check_metadata_refused_during_capture([&](Stream s) { mla::mha_prefill(checked, s); }));
  MLA_TEST_CUDA(cudaDeviceSynchronize());
}

TEST(MhaPrefillGpu, BadArgumentsThrow) {
  MLA_REQUIRE_GPU();
  PrefillCase c;
  c.q_lens = {3, 4};
  c.kv_lens = {5, 4};
  c.heads = 2;
  PrefillBuffers buf;
  make_buffers(c, buf);
  DeviceTensor d_q(buf.q), d_k(buf.k), d_v(buf.v), d_cu_q(buf.cu_q), d_cu_kv(buf.cu_kv),
      d_out(buf.out), d_lse(buf.lse);
  MhaPrefillArgs a = contiguous_on_device(buf.args, d_q, d_k, d_v, d_cu_q, d_cu_kv, d_out, d_lse);
  a.max_q_len = 4;
  a.max_kv_len = 5;
  EXPECT_NO_THROW(mla::mha_prefill(a));
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  {
    MhaPrefillArgs bad = a;
    bad.max_q_len = 0;
    EXPECT_TRUE(throws_error([&] { mla::mha_prefill(bad); }, {"mha_prefill", "max_q_len"}));
  }
  {
    // q rows 196 elements apart (392 bytes): not 16-byte aligned.
    MhaPrefillArgs bad = a;
    bad.q = TensorView::strided(d_q.ptr, DType::kBF16, {7, 1, kQkDim}, {196, 196, 1}, Device::cuda(0));
    bad.k = TensorView::strided(d_k.ptr, DType::kBF16, {9, 1, kQkDim}, {kQkDim, kQkDim, 1}, Device::cuda(0));
    bad.v = TensorView::strided(d_v.ptr, DType::kBF16, {9, 1, kVDim}, {kVDim, kVDim, 1}, Device::cuda(0));
    bad.out = TensorView::strided(d_out.ptr, DType::kBF16, {7, 1, kVDim}, {kVDim, kVDim, 1}, Device::cuda(0));
    bad.lse = TensorView::strided(d_lse.ptr, DType::kFP32, {7, 1}, {1, 1}, Device::cuda(0));
    EXPECT_TRUE(throws_error([&] { mla::mha_prefill(bad); }, {"mha_prefill", "q", "16 bytes"}));
  }
  {
    // out starting 2 elements (4 bytes) into its buffer: not 16-byte aligned.
    MhaPrefillArgs bad = a;
    bad.out.data = static_cast<unsigned char*>(d_out.ptr) + 4;
    bad.out.shape[0] = 6;
    bad.out.shape[1] = 2;
    bad.q.shape[0] = 6;
    bad.lse.shape[0] = 6;
    auto cu = int32_tensor({0, 3, 6});
    DeviceTensor d_cu(cu);
    bad.cu_q_lens = d_cu.view();
    EXPECT_TRUE(throws_error([&] { mla::mha_prefill(bad); }, {"mha_prefill", "out", "16-byte aligned"}));
  }
}

}  // namespace
}  // namespace mla::test
