// mha_prefill on the CPU against the float64 reference in attention_reference.hpp.
//
// Ragged batches (zero-length requests included), causal bottom-right aligned and non-causal,
// out and lse pre-filled with NaN and every element checked.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "attention_reference.hpp"
#include "mla/ops.hpp"
#include "test_util.hpp"

namespace mla::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kQk = 192, kV = 128;

struct PrefillSetup {
  int num_heads = 4;
  std::vector<int> q_lens = {3};
  std::vector<int> kv_lens = {5};
  bool causal = true;
  DType dtype = DType::kBF16;
  DType out_dtype = DType::kFP32;
  bool with_lse = true;
  bool strided = false;  // q head-major with padding, k/v views into one packed buffer
  float softmax_scale = 0.4f;
  float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;
  int max_q_len = 0, max_kv_len = 0;
  uint64_t seed = 1;
};

struct PrefillProblem {
  HostTensor q, kv, k, v, cu_q_lens, cu_kv_lens, out, lse;
  MhaPrefillArgs args;
};

void fill_view(const TensorView& t, std::mt19937_64& rng, float divisor) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.shape[0]; ++i)
    for (int64_t h = 0; h < t.shape[1]; ++h)
      for (int64_t d = 0; d < t.shape[2]; ++d)
        store_from_float(t.data, t.dtype, i * t.stride[0] + h * t.stride[1] + d, dist(rng) / divisor);
}

std::unique_ptr<PrefillProblem> make_problem(const PrefillSetup& s) {
  auto p = std::make_unique<PrefillProblem>();
  std::mt19937_64 rng(s.seed);
  const int64_t H = s.num_heads;
  std::vector<int32_t> cu_q(1, 0), cu_kv(1, 0);
  for (size_t b = 0; b < s.q_lens.size(); ++b) {
    cu_q.push_back(cu_q.back() + s.q_lens[b]);
    cu_kv.push_back(cu_kv.back() + s.kv_lens[b]);
  }
  const int64_t Tq = cu_q.back(), Tk = cu_kv.back();
  const bool fp8 = s.dtype == DType::kFP8E4M3;
  MhaPrefillArgs& a = p->args;
  if (s.strided) {
    p->q = HostTensor(s.dtype, {H, Tq, kQk + 8});
    p->q.fill_nan();
    a.q = TensorView::strided(p->q.data(), s.dtype, {Tq, H, kQk}, {kQk + 8, Tq * (kQk + 8), 1});
    // Packed [Tk, H, 192 + 128 + 4]: k then v per head.
    const int64_t row = kQk + kV + 4;
    p->kv = HostTensor(s.dtype, {Tk, H, row});
    p->kv.fill_nan();
    a.k = TensorView::strided(p->kv.data(), s.dtype, {Tk, H, kQk}, {H * row, row, 1});
    a.v = TensorView::strided(static_cast<unsigned char*>(p->kv.data()) + kQk * dtype_size(s.dtype),
                              s.dtype, {Tk, H, kV}, {H * row, row, 1});
  } else {
    p->q = HostTensor(s.dtype, {Tq, H, kQk});
    p->k = HostTensor(s.dtype, {Tk, H, kQk});
    p->v = HostTensor(s.dtype, {Tk, H, kV});
    a.q = p->q.view();
    a.k = p->k.view();
    a.v = p->v.view();
  }
  fill_view(a.q, rng, fp8 ? s.q_scale : 1.0f);
  fill_view(a.k, rng, fp8 ? s.k_scale : 1.0f);
  fill_view(a.v, rng, fp8 ? s.v_scale : 1.0f);
  p->cu_q_lens = int32_tensor(cu_q);
  p->cu_kv_lens = int32_tensor(cu_kv);
  a.cu_q_lens = p->cu_q_lens.view();
  a.cu_kv_lens = p->cu_kv_lens.view();
  a.max_q_len = s.max_q_len;
  a.max_kv_len = s.max_kv_len;
  a.causal = s.causal;
  a.softmax_scale = s.softmax_scale;
  a.q_scale = s.q_scale;
  a.k_scale = s.k_scale;
  a.v_scale = s.v_scale;
  if (s.strided) {
    p->out = HostTensor(s.out_dtype, {H, Tq, kV + 16});
    a.out = TensorView::strided(p->out.data(), s.out_dtype, {Tq, H, kV}, {kV + 16, Tq * (kV + 16), 1});
  } else {
    p->out = HostTensor(s.out_dtype, {Tq, H, kV});
    a.out = p->out.view();
  }
  p->out.fill_nan();
  if (s.with_lse) {
    if (s.strided) {
      p->lse = HostTensor(DType::kFP32, {H, Tq + 2});
      a.lse = TensorView::strided(p->lse.data(), DType::kFP32, {Tq, H}, {1, Tq + 2});
    } else {
      p->lse = HostTensor(DType::kFP32, {Tq, H});
      a.lse = p->lse.view();
    }
    p->lse.fill_nan();
  }
  return p;
}

struct Tolerance {
  double atol, rtol;
};
Tolerance out_tolerance(DType out_dtype) {
  switch (out_dtype) {
    case DType::kBF16: return {5e-6, 4e-3};  // half an ulp of bf16 is 2^-9
    case DType::kFP16: return {5e-6, 1e-3};  // half an ulp of fp16 is 2^-12
    default: return {5e-6, 2e-5};            // fp32 accumulation
  }
}
constexpr Tolerance kLseTolerance = {2e-5, 2e-5};

void run_and_check(PrefillProblem& p, const PrefillSetup& s, const std::string& label) {
  SCOPED_TRACE(label);
  const NaiveAttention ref = naive_mha_prefill(p.args);
  ASSERT_NO_THROW(mha_prefill(p.args));
  const std::vector<float> out = gather_floats(p.args.out);
  const Tolerance tol = out_tolerance(s.out_dtype);
  EXPECT_TRUE(all_close(out, ref.out, tol.atol, tol.rtol));
  for (size_t row = 0; row < ref.lse.size(); ++row) {
    if (ref.lse[row] != -kInf) continue;
    for (int c = 0; c < kV; ++c)
      ASSERT_EQ(out[row * kV + size_t(c)], 0.0f) << "row " << row << " has no keys";
  }
  if (s.with_lse)
    EXPECT_TRUE(all_close(gather_floats(p.args.lse), ref.lse, kLseTolerance.atol, kLseTolerance.rtol));
  // Padding of strided outputs stays untouched.
  if (s.strided) {
    int64_t written = 0;
    for (int64_t e = 0; e < p.out.numel(); ++e) written += !std::isnan(p.out.get(e));
    EXPECT_EQ(written, p.args.out.numel());
  }
}

void run_case(const PrefillSetup& s, const std::string& label) {
  auto p = make_problem(s);
  run_and_check(*p, s, label);
}

TEST(MhaPrefillCpu, RaggedBatchCausalAndNonCausal) {
  for (bool causal : {true, false}) {
    PrefillSetup s;
    s.num_heads = 4;
    // kv longer than q, zero q, equal lengths, q longer than kv, zero kv, one token.
    s.q_lens = {5, 0, 17, 6, 3, 1, 33};
    s.kv_lens = {9, 3, 17, 2, 0, 1, 70};
    s.causal = causal;
    s.seed = causal ? 1 : 2;
    run_case(s, causal ? "causal" : "non-causal");
  }
}

TEST(MhaPrefillCpu, QueriesLongerThanKeysSeeFewerKeys) {
  for (bool causal : {true, false}) {
    PrefillSetup s;
    s.q_lens = {6, 4};
    s.kv_lens = {2, 0};
    s.causal = causal;
    s.seed = 3;
    auto p = make_problem(s);
    run_and_check(*p, s, causal ? "causal" : "non-causal");
    // Causal: the first 4 queries of request 0 see nothing; request 1 sees nothing at all.
    const std::vector<float> lse = gather_floats(p->args.lse);
    for (int64_t t = 0; t < 10; ++t) {
      const bool empty = t >= 6 || (causal && t < 4);
      for (int64_t h = 0; h < s.num_heads; ++h)
        EXPECT_EQ(std::isinf(lse[size_t(t * s.num_heads + h)]), empty) << t;
    }
  }
}

TEST(MhaPrefillCpu, HeadCountsAtTinyLengths) {
  for (int heads : {1, 16, 128}) {
    for (bool causal : {true, false}) {
      PrefillSetup s;
      s.num_heads = heads;
      s.q_lens = {1, 2, 0};
      s.kv_lens = {2, 3, 1};
      s.causal = causal;
      s.seed = uint64_t(heads * 2 + causal);
      run_case(s, "heads " + std::to_string(heads));
    }
  }
}

TEST(MhaPrefillCpu, LongerSequences) {
  PrefillSetup s;
  s.num_heads = 2;
  s.q_lens = {150, 37};
  s.kv_lens = {400, 37};
  s.max_q_len = 150;
  s.max_kv_len = 400;
  s.seed = 4;
  run_case(s, "long");
}

TEST(MhaPrefillCpu, InputAndOutputDtypes) {
  struct Combo {
    DType dtype;
    float q_scale, k_scale, v_scale;
  };
  const Combo combos[] = {
      {DType::kBF16, 1.0f, 1.0f, 1.0f},
      {DType::kFP16, 1.0f, 1.0f, 1.0f},
      {DType::kFP8E4M3, 0.05f, 0.02f, 0.1f},
      {DType::kFP8E4M3, 2.0f, 0.5f, 4.0f},
  };
  int index = 0;
  for (const Combo& combo : combos) {
    for (DType out_dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
      PrefillSetup s;
      s.num_heads = 3;
      s.q_lens = {4, 7};
      s.kv_lens = {9, 7};
      s.dtype = combo.dtype;
      s.q_scale = combo.q_scale;
      s.k_scale = combo.k_scale;
      s.v_scale = combo.v_scale;
      s.out_dtype = out_dtype;
      s.with_lse = index % 3 != 2;
      s.causal = index % 2 == 0;
      s.seed = uint64_t(10 + index++);
      run_case(s, std::string(dtype_name(combo.dtype)) + " in, " +
                      std::string(dtype_name(out_dtype)) + " out");
    }
  }
}

TEST(MhaPrefillCpu, ScalesOnlyApplyToFp8) {
  PrefillSetup s;
  s.q_lens = {3};
  s.kv_lens = {8};
  auto p = make_problem(s);
  ASSERT_NO_THROW(mha_prefill(p->args));
  const std::vector<float> plain = gather_floats(p->args.out);
  p->args.q_scale = 2.0f;
  p->args.k_scale = 3.0f;
  p->args.v_scale = 0.5f;
  ASSERT_NO_THROW(mha_prefill(p->args));
  EXPECT_EQ(gather_floats(p->args.out), plain);
}

TEST(MhaPrefillCpu, StridedAndPackedViews) {
  for (DType out_dtype : {DType::kFP32, DType::kFP16}) {
    PrefillSetup s;
    s.num_heads = 5;
    s.q_lens = {4, 0, 9};
    s.kv_lens = {6, 2, 9};
    s.strided = true;
    s.out_dtype = out_dtype;
    s.seed = 20;
    run_case(s, dtype_name(out_dtype).data());
  }
}

TEST(MhaPrefillCpu, KeysARowMustNotSeeNeverReachIt) {
  // Causal, 5 queries over 5 keys: key 3 (its k and v hold inf and NaN) is seen by queries 3 and
  // 4 only, so queries 0-2, paired with rows that see it or not, must come out exactly as with
  // finite values there.
  PrefillSetup s;
  s.num_heads = 3;
  s.q_lens = {5};
  s.kv_lens = {5};
  s.seed = 51;
  auto clean = make_problem(s);
  auto bad = make_problem(s);
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const TensorView &k = bad->args.k, &v = bad->args.v;
    for (int64_t d = 0; d < kQk; d += 5)
      store_from_float(k.data, k.dtype, 3 * k.stride[0] + h * k.stride[1] + d, d % 2 ? float(kInf) : kNaN);
    for (int64_t d = 0; d < kV; d += 3)
      store_from_float(v.data, v.dtype, 3 * v.stride[0] + h * v.stride[1] + d, d % 2 ? kNaN : float(kInf));
  }
  run_and_check(*clean, s, "finite keys");
  ASSERT_NO_THROW(mha_prefill(bad->args));
  const std::vector<float> clean_out = gather_floats(clean->args.out), bad_out = gather_floats(bad->args.out);
  const std::vector<float> clean_lse = gather_floats(clean->args.lse), bad_lse = gather_floats(bad->args.lse);
  const size_t seen_by_first_three = size_t(3 * s.num_heads);  // rows of queries 0-2
  for (size_t e = 0; e < seen_by_first_three * kV; ++e) ASSERT_EQ(bad_out[e], clean_out[e]) << "element " << e;
  for (size_t r = 0; r < seen_by_first_three; ++r) ASSERT_EQ(bad_lse[r], clean_lse[r]) << "row " << r;
}

TEST(MhaPrefillCpu, EmptyBatches) {
  // No requests at all.
  PrefillSetup s;
  s.q_lens = {};
  s.kv_lens = {};
  auto p = make_problem(s);
  EXPECT_NO_THROW(mha_prefill(p->args));
  // Requests without queries (keys present): nothing to compute or write.
  s.q_lens = {0, 0};
  s.kv_lens = {3, 4};
  p = make_problem(s);
  EXPECT_NO_THROW(mha_prefill(p->args));
  // Only zero-length requests around one real request.
  s.q_lens = {0, 2, 0};
  s.kv_lens = {0, 3, 0};
  run_case(s, "zero-length neighbours");
}

// ---------------------------------------------------------------------------------------------

class MhaPrefillErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    PrefillSetup s;
    s.num_heads = 2;
    s.q_lens = {2, 3};
    s.kv_lens = {4, 3};
    problem = make_problem(s);
    ASSERT_NO_THROW(mha_prefill(problem->args));
  }
  MhaPrefillArgs args() const { return problem->args; }
  std::unique_ptr<PrefillProblem> problem;
};

TEST_F(MhaPrefillErrors, Tensors) {
  auto a = args();
  a.q.dtype = DType::kFP32;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"mha_prefill", "q must be one of", "fp32"}));
  a = args();
  a.k.dtype = DType::kFP16;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"k must be bf16, got fp16"}));
  a = args();
  a.v.dtype = DType::kFP16;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v must be bf16, got fp16"}));
  a = args();
  a.q.shape[2] = 128;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"q.shape[2] must be 192"}));
  a = args();
  a.k.shape[2] = 128;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"k.shape[2] must be 192"}));
  a = args();
  a.v.shape[2] = 192;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v.shape[2] must be 128"}));
  a = args();
  a.v.shape[0] = 6;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v.shape[0] must be 7"}));
  a = args();
  a.k.shape[1] = 3;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"k.shape[1] must be 2"}));
  a = args();
  a.q.shape[1] = 129;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"heads", "q.shape[1]", "129"}));
  a = args();
  a.q.stride[2] = 2;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"q", "contiguous last dimension"}));
  a = args();
  a.v.stride[2] = 2;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v", "contiguous last dimension"}));
  a = args();
  a.k.ndim = 2;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"k must have 3 dims"}));
  a = args();
  a.out.shape[2] = 192;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"out.shape[2] must be 128"}));
  a = args();
  a.out.dtype = DType::kFP8E4M3;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"out must be one of bf16/fp16/fp32"}));
  a = args();
  a.out.shape[0] = 4;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"out.shape[0] must be 5"}));
  a = args();
  a.lse.dtype = DType::kFP16;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"lse must be fp32"}));
  a = args();
  a.lse.shape[0] = 4;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"lse.shape[0] must be 5"}));
  a = args();
  a.v.device = Device::cuda(0);
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v is on cuda:0", "q is on cpu"}));
  a = args();
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.cu_q_lens, &a.cu_kv_lens, &a.out, &a.lse})
    t->device = Device::cuda(0);
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"max_q_len and max_kv_len must be given"}));
}

TEST_F(MhaPrefillErrors, Scalars) {
  auto a = args();
  a.softmax_scale = 0;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"softmax_scale is required"}));
  a.softmax_scale = kNaN;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"softmax_scale"}));
  a = args();
  a.v_scale = -1;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"v_scale must be finite and > 0"}));
  a = args();
  a.k_scale = float(kInf);
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"k_scale must be finite and > 0"}));
  a = args();
  a.q_scale = 0;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"q_scale must be finite and > 0"}));
  a = args();
  a.max_q_len = -1;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"max_q_len must be >= 0"}));
  a = args();
  a.max_kv_len = -2;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"max_kv_len must be >= 0"}));
  a = args();
  a.max_q_len = 2;  // request 1 has 3 queries
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"request 1 has 3 queries", "max_q_len is 2"}));
  a = args();
  a.max_kv_len = 3;  // request 0 has 4 keys
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"request 0 has 4 keys", "max_kv_len is 3"}));
}

TEST_F(MhaPrefillErrors, CumulativeLengths) {
  auto a = args();
  a.cu_q_lens.dtype = DType::kInt64;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens must be int32"}));
  a = args();
  a.cu_kv_lens.shape[0] = 2;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_kv_lens.shape[0] must be 3"}));
  a = args();
  a.cu_q_lens = TensorView();
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens is required"}));
  a = args();
  a.cu_q_lens.shape[0] = 0;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens must have B + 1 >= 1 entries"}));

  a = args();
  HostTensor& cu_q = problem->cu_q_lens;   // {0, 2, 5}
  HostTensor& cu_kv = problem->cu_kv_lens; // {0, 4, 7}
  cu_q.i32(1) = 6;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens must be non-decreasing", "cu_q_lens[1] = 6"}));
  cu_q.i32(1) = 2;
  cu_q.i32(0) = 1;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens[0] must be 0, got 1"}));
  cu_q.i32(0) = 0;
  cu_q.i32(2) = 4;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_q_lens[2] must equal the 5 tokens of q"}));
  cu_q.i32(2) = 5;
  cu_kv.i32(1) = -1;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_kv_lens must be non-decreasing", "cu_kv_lens[1] = -1"}));
  cu_kv.i32(1) = 8;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_kv_lens must be non-decreasing", "cu_kv_lens[1] = 8"}));
  cu_kv.i32(1) = 4;
  cu_kv.i32(0) = -3;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_kv_lens[0] must be 0, got -3"}));
  cu_kv.i32(0) = 0;
  cu_kv.i32(2) = 8;
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"cu_kv_lens[2] must equal the 7 tokens of k"}));
  cu_kv.i32(2) = 7;
  EXPECT_NO_THROW(mha_prefill(a));

  // Tokens but no request.
  HostTensor one_zero = int32_tensor({0});
  a.cu_q_lens = one_zero.view();
  a.cu_kv_lens = one_zero.view();
  EXPECT_TRUE(throws_error([&] { mha_prefill(a); }, {"q has 5 tokens", "cu_q_lens describes no request"}));
}

}  // namespace
}  // namespace mla::test
