// mla_decode on the CPU against the float64 reference in attention_reference.hpp.
//
// Every case scatters each request's pages randomly over a pool whose unused pages (and the slots
// past kv_len in a request's last page) hold NaN, pads the block table with out-of-range page
// ids, pre-fills out and lse with NaN and checks every element.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention_reference.hpp"
#include "mla/ops.hpp"
#include "mla/schedule.hpp"
#include "test_util.hpp"

namespace mla::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct DecodeSetup {
  int num_heads = 16;
  int page_size = 16;
  std::vector<int> kv_lens = {9};
  std::vector<int> q_lens;        // per request; empty = 1 each
  bool variable_q = false;        // pass cu_q_lens (DRAFT_EXTEND); else the fixed q_len
  int max_q_len = 0;
  bool split_q = false;           // q_nope/q_pe instead of q
  bool strided = false;           // head-major q/out/lse with padding
  DType cache_dtype = DType::kBF16;
  DType q_dtype = DType::kBF16;
  DType out_dtype = DType::kFP32;
  bool with_lse = true;
  float softmax_scale = 0.25f;
  float q_scale = 1.0f;
  float k_scale = 1.0f;
  uint64_t seed = 1;
};

// The keys of every request as stored values (already rounded to the cache dtype), kv_len x 576.
using LogicalCache = std::vector<std::vector<float>>;

LogicalCache random_logical_cache(const DecodeSetup& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const float divisor = s.cache_dtype == DType::kFP8E4M3 ? s.k_scale : 1.0f;
  LogicalCache cache;
  for (int kv_len : s.kv_lens) {
    std::vector<float> keys(size_t(kv_len) * kLatentDim);
    for (float& x : keys) {
      const float value = dist(rng) / divisor;
      // Round through the cache dtype so the stored value is exactly representable.
      unsigned char buf[4];
      store_from_float(buf, s.cache_dtype, 0, value);
      x = load_as_float(buf, s.cache_dtype, 0);
    }
    cache.push_back(std::move(keys));
  }
  return cache;
}

struct DecodeProblem {
  HostTensor q, q_nope, q_pe, kv_cache, block_table, kv_lens, cu_q_lens, out, lse;
  MlaDecodeArgs args;
};

std::vector<int> query_lens(const DecodeSetup& s) {
  return s.q_lens.empty() ? std::vector<int>(s.kv_lens.size(), 1) : s.q_lens;
}

// A view [n0, n1, n2] over storage laid out head-major ([n1, n0, n2 + pad]) when strided.
TensorView view3(HostTensor& storage, int64_t n0, int64_t n1, int64_t n2, bool strided,
                 int64_t pad) {
  if (!strided) return storage.view();
  return TensorView::strided(storage.data(), storage.dtype, {n0, n1, n2},
                             {n2 + pad, n0 * (n2 + pad), 1});
}
HostTensor storage3(DType dtype, int64_t n0, int64_t n1, int64_t n2, bool strided, int64_t pad) {
  return strided ? HostTensor(dtype, {n1, n0, n2 + pad}) : HostTensor(dtype, {n0, n1, n2});
}

// Lays out `logical` in a pool shuffled by `rng`; queries are random from s.seed.
std::unique_ptr<DecodeProblem> make_problem(const DecodeSetup& s, const LogicalCache& logical,
                                            std::mt19937_64& rng) {
  std::mt19937_64 query_rng(s.seed * 7919 + 17);
  auto p = std::make_unique<DecodeProblem>();
  const int64_t batch = int64_t(s.kv_lens.size());
  const std::vector<int> q_lens = query_lens(s);
  const int64_t num_tokens = std::accumulate(q_lens.begin(), q_lens.end(), int64_t(0));
  const int64_t H = s.num_heads, S = s.page_size;

  // Pool: the pages in use, in random order, among poisoned spare pages.
  int64_t max_blocks = 0, used_pages = 0;
  for (int kv_len : s.kv_lens) {
    max_blocks = std::max<int64_t>(max_blocks, (kv_len + S - 1) / S);
    used_pages += (kv_len + S - 1) / S;
  }
  max_blocks += 2;  // padding entries
  const int64_t num_pages = used_pages + 3;
  std::vector<int32_t> page_order(static_cast<size_t>(num_pages));
  std::iota(page_order.begin(), page_order.end(), 0);
  std::shuffle(page_order.begin(), page_order.end(), rng);
  p->kv_cache = HostTensor(s.cache_dtype, {num_pages, S, kLatentDim});
  p->kv_cache.fill_nan();
  p->block_table = HostTensor(DType::kInt32, {batch, max_blocks});
  size_t next_page = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t kv_len = s.kv_lens[size_t(b)];
    for (int64_t j = 0; j < max_blocks; ++j) {
      if (j * S < kv_len) {
        const int32_t page = page_order[next_page++];
        p->block_table.i32(b * max_blocks + j) = page;
        for (int64_t o = 0; o < S && j * S + o < kv_len; ++o)
          for (int64_t d = 0; d < kLatentDim; ++d)
            p->kv_cache.set((page * S + o) * kLatentDim + d,
                            logical[size_t(b)][size_t((j * S + o) * kLatentDim + d)]);
      } else {
        // Padding: ids that must never be read.
        p->block_table.i32(b * max_blocks + j) = (j % 2) ? -1 : int32_t(num_pages + 1000);
      }
    }
  }
  std::vector<int32_t> kv(s.kv_lens.begin(), s.kv_lens.end());
  p->kv_lens = int32_tensor(kv);

  // Queries.
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const float q_divisor = s.q_dtype == DType::kFP8E4M3 ? s.q_scale : 1.0f;
  MlaDecodeArgs& a = p->args;
  if (s.split_q) {
    p->q_nope = storage3(s.q_dtype, num_tokens, H, kKvLoraRank, s.strided, 24);
    p->q_pe = storage3(s.q_dtype, num_tokens, H, kRopeDim, s.strided, 8);
    p->q_nope.fill_nan();
    p->q_pe.fill_nan();
    a.q_nope = view3(p->q_nope, num_tokens, H, kKvLoraRank, s.strided, 24);
    a.q_pe = view3(p->q_pe, num_tokens, H, kRopeDim, s.strided, 8);
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = 0; d < kKvLoraRank; ++d)
          store_from_float(a.q_nope.data, a.q_nope.dtype,
                           t * a.q_nope.stride[0] + h * a.q_nope.stride[1] + d, dist(query_rng) / q_divisor);
        for (int64_t d = 0; d < kRopeDim; ++d)
          store_from_float(a.q_pe.data, a.q_pe.dtype,
                           t * a.q_pe.stride[0] + h * a.q_pe.stride[1] + d, dist(query_rng) / q_divisor);
      }
  } else {
    p->q = storage3(s.q_dtype, num_tokens, H, kLatentDim, s.strided, 40);
    p->q.fill_nan();
    a.q = view3(p->q, num_tokens, H, kLatentDim, s.strided, 40);
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < kLatentDim; ++d)
          store_from_float(a.q.data, a.q.dtype, t * a.q.stride[0] + h * a.q.stride[1] + d,
                           dist(query_rng) / q_divisor);
  }

  a.kv_cache = p->kv_cache.view();
  a.block_table = p->block_table.view();
  a.kv_lens = p->kv_lens.view();
  if (s.variable_q) {
    std::vector<int32_t> cu(1, 0);
    for (int q_len : q_lens) cu.push_back(cu.back() + q_len);
    p->cu_q_lens = int32_tensor(cu);
    a.cu_q_lens = p->cu_q_lens.view();
  } else {
    a.q_len = q_lens.empty() ? 1 : q_lens[0];
  }
  a.max_q_len = s.max_q_len;
  a.softmax_scale = s.softmax_scale;
  a.q_scale = s.q_scale;
  a.k_scale = s.k_scale;

  p->out = storage3(s.out_dtype, num_tokens, H, kKvLoraRank, s.strided, 16);
  p->out.fill_nan();
  a.out = view3(p->out, num_tokens, H, kKvLoraRank, s.strided, 16);
  if (s.with_lse) {
    if (s.strided) {
      p->lse = HostTensor(DType::kFP32, {H, num_tokens + 3});
      a.lse = TensorView::strided(p->lse.data(), DType::kFP32, {num_tokens, H}, {1, num_tokens + 3});
    } else {
      p->lse = HostTensor(DType::kFP32, {num_tokens, H});
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
    case DType::kBF16: return {2e-5, 4e-3};   // half an ulp of bf16 is 2^-9
    case DType::kFP16: return {2e-5, 1e-3};   // half an ulp of fp16 is 2^-12
    default: return {5e-6, 2e-5};             // fp32 accumulation over <= ~2000 keys
  }
}
constexpr Tolerance kLseTolerance = {2e-5, 2e-5};

// Number of elements of `storage` outside the view that are no longer NaN.
int64_t touched_outside_view(const HostTensor& storage, const TensorView& view) {
  std::vector<bool> inside(size_t(storage.numel()), false);
  const int64_t n1 = view.ndim > 1 ? view.shape[1] : 1, n2 = view.ndim > 2 ? view.shape[2] : 1;
  for (int64_t i = 0; i < view.shape[0]; ++i)
    for (int64_t j = 0; j < n1; ++j)
      for (int64_t k = 0; k < n2; ++k)
        inside[size_t(i * view.stride[0] + (view.ndim > 1 ? j * view.stride[1] : 0) + k)] = true;
  int64_t touched = 0;
  for (int64_t e = 0; e < storage.numel(); ++e)
    if (!inside[size_t(e)] && !std::isnan(storage.get(e))) ++touched;
  return touched;
}

// Runs the op on the problem and checks out/lse element by element against the reference.
void run_and_check(DecodeProblem& p, const DecodeSetup& s, const char* label) {
  SCOPED_TRACE(label);
  const NaiveAttention ref = naive_mla_decode(p.args);
  ASSERT_NO_THROW(mla_decode(p.args));
  const std::vector<float> out = gather_floats(p.args.out);
  const Tolerance tol = out_tolerance(s.out_dtype);
  EXPECT_TRUE(all_close(out, ref.out, tol.atol, tol.rtol));
  // Rows that see no key: exactly 0 and -inf.
  int64_t empty_rows = 0;
  for (size_t row = 0; row < ref.lse.size(); ++row) {
    if (ref.lse[row] != -kInf) continue;
    ++empty_rows;
    for (int64_t c = 0; c < kKvLoraRank; ++c)
      ASSERT_EQ(out[row * kKvLoraRank + size_t(c)], 0.0f) << "row " << row << " has no keys";
  }
  if (s.with_lse) {
    const std::vector<float> lse = gather_floats(p.args.lse);
    EXPECT_TRUE(all_close(lse, ref.lse, kLseTolerance.atol, kLseTolerance.rtol));
    EXPECT_EQ(touched_outside_view(p.lse, p.args.lse), 0);
  }
  EXPECT_EQ(touched_outside_view(p.out, p.args.out), 0);
  (void)empty_rows;
}

void run_case(const DecodeSetup& s, const char* label) {
  std::mt19937_64 rng(s.seed);
  const LogicalCache logical = random_logical_cache(s, rng);
  auto p = make_problem(s, logical, rng);
  run_and_check(*p, s, label);
}

// ---------------------------------------------------------------------------------------------

TEST(MlaDecodeCpu, EveryPageSizeWithOddAndExactLengths) {
  const int heads[] = {1, 8, 12, 16, 24, 96, 128, 12};
  int index = 0;
  for (int page_size = 1; page_size <= 128; page_size *= 2, ++index) {
    DecodeSetup s;
    s.page_size = page_size;
    s.num_heads = heads[index];
    const int small = s.num_heads >= 96;  // keep 96/128 heads cheap
    s.kv_lens = {0, 1, small ? 2 * page_size + 1 : 3 * page_size + 1, page_size,
                 small ? 7 : 2 * page_size, 5};
    s.seed = uint64_t(100 + page_size);
    run_case(s, ("page_size " + std::to_string(page_size)).c_str());
  }
}

TEST(MlaDecodeCpu, EveryHeadCount) {
  for (int heads : {1, 8, 12, 16, 24, 96, 128}) {
    DecodeSetup s;
    s.num_heads = heads;
    s.page_size = 4;
    s.kv_lens = {5, 17, 0, 12};
    s.seed = uint64_t(200 + heads);
    run_case(s, ("heads " + std::to_string(heads)).c_str());
  }
}

TEST(MlaDecodeCpu, LongSequenceFewHeads) {
  DecodeSetup s;
  s.num_heads = 2;
  s.page_size = 64;
  s.kv_lens = {1500, 333};
  s.seed = 7;
  run_case(s, "long");
}

TEST(MlaDecodeCpu, TargetVerifyFixedQueryLength) {
  for (int q_len = 2; q_len <= 8; ++q_len) {
    DecodeSetup s;
    s.num_heads = 12;
    s.page_size = 8;
    // kv longer than q, kv == q, q > kv (first rows see nothing), kv 0, kv 1.
    s.kv_lens = {q_len + 9, q_len, q_len - 1, 0, 1};
    s.q_lens.assign(s.kv_lens.size(), q_len);
    s.max_q_len = q_len % 2 ? q_len : 8;
    s.seed = uint64_t(300 + q_len);
    run_case(s, ("q_len " + std::to_string(q_len)).c_str());
  }
}

TEST(MlaDecodeCpu, DraftExtendVariableQueryLength) {
  for (int max_q_len : {0, 7, 9}) {
    DecodeSetup s;
    s.num_heads = 16;
    s.page_size = 2;
    s.kv_lens = {20, 5, 1, 7, 1, 0, 33};
    s.q_lens = {3, 0, 1, 7, 2, 2, 5};  // includes q_len 0 and q_len > kv_len
    s.variable_q = true;
    s.max_q_len = max_q_len;
    s.seed = uint64_t(400 + max_q_len);
    run_case(s, ("max_q_len " + std::to_string(max_q_len)).c_str());
  }
}

// zero_padding_rows: the problem's last request is the padding (the call sees the first B - 1
// requests and all T rows). Its rows come out 0 with lse -inf, the others as the reference; the
// strided layout's gaps stay NaN. Without the flag the CPU refuses cu_q_lens[B] < T; with it,
// cu_q_lens[B] past T is still refused.
TEST(MlaDecodeCpu, ZeroPaddingRows) {
  for (bool strided : {false, true}) {
    for (DType out_dtype : {DType::kFP32, DType::kBF16}) {
      DecodeSetup s;
      s.num_heads = 12;
      s.page_size = 4;
      s.kv_lens = {20, 5, 9, 13};
      s.q_lens = {3, 0, 2, 4};  // the last request: the padding
      s.variable_q = true;
      s.strided = strided;
      s.out_dtype = out_dtype;
      s.seed = strided ? 451 : 452;
      SCOPED_TRACE(std::string(strided ? "strided" : "contiguous") + ", out " + std::string(dtype_name(out_dtype)));
      std::mt19937_64 rng(s.seed);
      const LogicalCache logical = random_logical_cache(s, rng);
      auto p = make_problem(s, logical, rng);
      NaiveAttention ref = naive_mla_decode(p->args);
      const int64_t first_pad = 5, T = 9, H = s.num_heads;
      std::fill(ref.out.begin() + first_pad * H * kKvLoraRank, ref.out.end(), 0.0);
      std::fill(ref.lse.begin() + first_pad * H, ref.lse.end(), -kInf);
      MlaDecodeArgs a = p->args;
      a.block_table.shape[0] = 3;
      a.kv_lens.shape[0] = 3;
      a.cu_q_lens.shape[0] = 4;
      EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens[3] must equal the 9 query tokens of q, got 5"}));
      a.zero_padding_rows = true;
      ASSERT_NO_THROW(mla_decode(a));
      const Tolerance tol = out_tolerance(out_dtype);
      EXPECT_TRUE(all_close(gather_floats(a.out), ref.out, tol.atol, tol.rtol));
      EXPECT_TRUE(all_close(gather_floats(a.lse), ref.lse, kLseTolerance.atol, kLseTolerance.rtol));
      EXPECT_EQ(touched_outside_view(p->out, a.out), 0);
      EXPECT_EQ(touched_outside_view(p->lse, a.lse), 0);
      p->cu_q_lens.i32(3) = int32_t(T + 1);
      EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens[3] must be at most the 9 query tokens"}));
    }
  }
}

TEST(MlaDecodeCpu, SplitQueryEqualsFusedQuery) {
  DecodeSetup s;
  s.num_heads = 24;
  s.page_size = 16;
  s.kv_lens = {40, 3, 17};
  s.q_lens = {2, 2, 2};
  std::mt19937_64 rng(5);
  const LogicalCache logical = random_logical_cache(s, rng);
  std::mt19937_64 layout_rng(6);
  auto fused = make_problem(s, logical, layout_rng);
  run_and_check(*fused, s, "fused q");

  // q_nope / q_pe as views into the same [T, H, 576] buffer (no concatenation copy).
  MlaDecodeArgs split = fused->args;
  split.q = TensorView();
  split.q_nope = TensorView::strided(fused->q.data(), s.q_dtype, {6, 24, kKvLoraRank},
                                     {24 * kLatentDim, kLatentDim, 1});
  split.q_pe = TensorView::strided(static_cast<uint16_t*>(fused->q.data()) + kKvLoraRank,
                                   s.q_dtype, {6, 24, kRopeDim}, {24 * kLatentDim, kLatentDim, 1});
  HostTensor out(DType::kFP32, {6, 24, kKvLoraRank}), lse(DType::kFP32, {6, 24});
  out.fill_nan();
  lse.fill_nan();
  split.out = out.view();
  split.lse = lse.view();
  ASSERT_NO_THROW(mla_decode(split));
  EXPECT_EQ(gather_floats(split.out), gather_floats(fused->args.out));
  EXPECT_EQ(gather_floats(split.lse), gather_floats(fused->args.lse));

  // Separate, strided q_nope / q_pe buffers.
  DecodeSetup t = s;
  t.split_q = true;
  t.strided = true;
  t.seed = 8;
  run_case(t, "split strided");
}

TEST(MlaDecodeCpu, NonContiguousQueryOutputAndLse) {
  for (DType out_dtype : {DType::kFP32, DType::kBF16}) {
    DecodeSetup s;
    s.num_heads = 12;
    s.page_size = 4;
    s.kv_lens = {13, 0, 4};
    s.q_lens = {3, 3, 3};
    s.strided = true;
    s.out_dtype = out_dtype;
    s.seed = 9;
    run_case(s, dtype_name(out_dtype).data());
  }
}

TEST(MlaDecodeCpu, CacheQueryAndOutputDtypes) {
  struct Combo {
    DType cache, q;
    float k_scale, q_scale;
  };
  const Combo combos[] = {
      {DType::kBF16, DType::kBF16, 1.0f, 1.0f},
      {DType::kFP16, DType::kFP16, 1.0f, 1.0f},
      {DType::kFP8E4M3, DType::kBF16, 0.02f, 1.0f},
      {DType::kFP8E4M3, DType::kFP16, 0.5f, 1.0f},
      {DType::kFP8E4M3, DType::kFP8E4M3, 0.02f, 0.05f},
      {DType::kFP8E4M3, DType::kFP8E4M3, 3.0f, 0.25f},
  };
  int index = 0;
  for (const Combo& combo : combos) {
    for (DType out_dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
      DecodeSetup s;
      s.num_heads = 8;
      s.page_size = 8;
      s.kv_lens = {19, 8, 1};
      s.q_lens = {2, 2, 2};
      s.cache_dtype = combo.cache;
      s.q_dtype = combo.q;
      s.k_scale = combo.k_scale;
      s.q_scale = combo.q_scale;
      s.out_dtype = out_dtype;
      s.with_lse = index % 4 != 3;
      s.seed = uint64_t(500 + index++);
      const std::string label = std::string(dtype_name(combo.cache)) + " cache, " +
                                std::string(dtype_name(combo.q)) + " q, " +
                                std::string(dtype_name(out_dtype)) + " out";
      run_case(s, label.c_str());
    }
  }
}

TEST(MlaDecodeCpu, ScalesOnlyApplyToFp8) {
  // A bf16 cache and query ignore k_scale / q_scale.
  DecodeSetup s;
  s.num_heads = 4;
  s.kv_lens = {10};
  std::mt19937_64 rng(11);
  const LogicalCache logical = random_logical_cache(s, rng);
  std::mt19937_64 layout_rng(12);
  auto p = make_problem(s, logical, layout_rng);
  ASSERT_NO_THROW(mla_decode(p->args));
  const std::vector<float> plain = gather_floats(p->args.out);
  p->args.k_scale = 3.0f;
  p->args.q_scale = 0.5f;
  ASSERT_NO_THROW(mla_decode(p->args));
  EXPECT_EQ(gather_floats(p->args.out), plain);
}

TEST(MlaDecodeCpu, ResultIndependentOfPageSizeAndPlacement) {
  DecodeSetup base;
  base.num_heads = 12;
  base.kv_lens = {130, 1, 64, 77};
  base.q_lens = {2, 2, 2, 2};
  std::mt19937_64 rng(13);
  const LogicalCache logical = random_logical_cache(base, rng);
  std::vector<float> first_out, first_lse;
  for (int page_size = 1; page_size <= 128; page_size *= 2) {
    for (uint64_t placement : {1, 2}) {
      DecodeSetup s = base;
      s.page_size = page_size;
      std::mt19937_64 layout_rng(placement * 1000 + uint64_t(page_size));
      auto p = make_problem(s, logical, layout_rng);
      ASSERT_NO_THROW(mla_decode(p->args));
      const std::vector<float> out = gather_floats(p->args.out);
      const std::vector<float> lse = gather_floats(p->args.lse);
      if (first_out.empty()) {
        first_out = out;
        first_lse = lse;
        run_and_check(*p, s, "page size 1");
        continue;
      }
      SCOPED_TRACE("page size " + std::to_string(page_size));
      EXPECT_TRUE(all_close(out, std::vector<double>(first_out.begin(), first_out.end()), 1e-6, 1e-6));
      EXPECT_TRUE(all_close(lse, std::vector<double>(first_lse.begin(), first_lse.end()), 1e-6, 1e-6));
    }
  }
}

TEST(MlaDecodeCpu, ResultIndependentOfBatchComposition) {
  // The rows of one request are bit-identical whether it runs alone or inside a larger batch
  // (which changes the work split and the thread that computes it).
  DecodeSetup batch;
  batch.num_heads = 16;
  batch.page_size = 8;
  batch.kv_lens = {300, 5, 77, 1, 120};
  batch.q_lens = {3, 1, 4, 2, 3};
  batch.variable_q = true;
  std::mt19937_64 rng(31);
  const LogicalCache logical = random_logical_cache(batch, rng);
  std::mt19937_64 layout_rng(32);
  auto all = make_problem(batch, logical, layout_rng);
  run_and_check(*all, batch, "batch");
  const std::vector<float> all_out = gather_floats(all->args.out);
  const std::vector<float> all_lse = gather_floats(all->args.lse);

  // Request 2 alone: same queries (rows 4..7 of the batch), same keys.
  DecodeSetup single = batch;
  single.kv_lens = {77};
  single.q_lens = {4};
  std::mt19937_64 single_layout(33);
  auto alone = make_problem(single, {logical[2]}, single_layout);
  const int64_t first_token = 4, row_width = 16 * kKvLoraRank;
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t h = 0; h < 16; ++h)
      for (int64_t d = 0; d < kLatentDim; ++d)
        store_from_float(alone->args.q.data, alone->args.q.dtype, (t * 16 + h) * kLatentDim + d,
                         load_as_float(all->args.q.data, all->args.q.dtype,
                                       ((first_token + t) * 16 + h) * kLatentDim + d));
  ASSERT_NO_THROW(mla_decode(alone->args));
  const std::vector<float> alone_out = gather_floats(alone->args.out);
  const std::vector<float> alone_lse = gather_floats(alone->args.lse);
  EXPECT_TRUE(std::equal(alone_out.begin(), alone_out.end(), all_out.begin() + first_token * row_width));
  EXPECT_TRUE(std::equal(alone_lse.begin(), alone_lse.end(), all_lse.begin() + first_token * 16));
}

// Random cases over what mla_decode takes: head counts, page sizes, fixed and per-request query
// lengths (0 included), dtypes, fused or split and strided queries, outputs with or without the
// LSE. Case i has seed 32000 + i.
TEST(MlaDecodeCpu, RandomCases) {
  const std::vector<int> heads = {1, 2, 3, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128};
  const std::vector<int> pages = {1, 2, 4, 8, 16, 32, 64, 128};
  const std::vector<std::pair<DType, DType>> types = {  // (query, cache)
      {DType::kBF16, DType::kBF16}, {DType::kFP16, DType::kFP16}, {DType::kBF16, DType::kFP8E4M3},
      {DType::kFP16, DType::kFP8E4M3}, {DType::kFP8E4M3, DType::kFP8E4M3}};
  const std::vector<DType> outs = {DType::kBF16, DType::kFP16, DType::kFP32};
  for (int i = 0; i < 40; ++i) {
    std::mt19937_64 rng(uint64_t(32000 + i));
    auto pick = [&](const auto& options) { return options[size_t(rng() % options.size())]; };
    DecodeSetup s;
    s.seed = uint64_t(32000 + i);
    s.num_heads = pick(heads);
    s.page_size = pick(pages);
    const int batch = 1 + int(rng() % 6);
    s.variable_q = rng() % 2 == 0;
    const int q_len = 1 + int(rng() % 8);
    s.kv_lens.clear();
    int64_t work = 0;  // the reference's: heads x sum of q_len x kv_len
    for (int b = 0; b < batch; ++b) {
      s.q_lens.push_back(s.variable_q ? int(rng() % (q_len + 1)) : q_len);
      const int64_t room = std::max<int64_t>(0, 60'000 - work) / (int64_t(s.num_heads) * q_len);
      s.kv_lens.push_back(int(rng() % uint64_t(std::min<int64_t>(room, 700) + 1)));
      work += int64_t(s.num_heads) * q_len * s.kv_lens.back();
    }
    const auto [q_dtype, cache_dtype] = pick(types);
    s.q_dtype = q_dtype;
    s.cache_dtype = cache_dtype;
    s.out_dtype = pick(outs);
    if (cache_dtype == DType::kFP8E4M3) s.k_scale = 0.01f + 0.002f * float(rng() % 500);
    if (q_dtype == DType::kFP8E4M3) s.q_scale = 0.02f + 0.002f * float(rng() % 400);
    s.split_q = rng() % 3 == 0;
    s.strided = rng() % 3 == 0;
    s.with_lse = rng() % 5 != 0;
    run_case(s, ("random case " + std::to_string(i)).c_str());
  }
}

TEST(MlaDecodeCpu, KeysARowMustNotSeeNeverReachIt) {
  // The next-to-last key of a request with three queries holds inf and NaN values: its first
  // query does not see it (the causal rule), so that query's rows and the other requests' rows,
  // paired with rows that see the key or not, must come out exactly as with finite values there.
  DecodeSetup s;
  s.num_heads = 3;
  s.page_size = 16;
  s.kv_lens = {37, 20, 1};
  s.q_lens = {3, 2, 1};
  s.variable_q = true;
  std::mt19937_64 rng(41);
  const LogicalCache logical = random_logical_cache(s, rng);
  LogicalCache poisoned = logical;
  const size_t key = size_t(35) * kLatentDim;
  for (size_t d = 0; d < size_t(kLatentDim); d += 7) poisoned[0][key + d] = d % 2 ? float(kInf) : kNaN;
  std::mt19937_64 layout_a(42), layout_b(42);
  auto clean = make_problem(s, logical, layout_a);
  auto bad = make_problem(s, poisoned, layout_b);
  run_and_check(*clean, s, "finite cache");
  ASSERT_NO_THROW(mla_decode(bad->args));
  const std::vector<float> clean_out = gather_floats(clean->args.out), bad_out = gather_floats(bad->args.out);
  const std::vector<float> clean_lse = gather_floats(clean->args.lse), bad_lse = gather_floats(bad->args.lse);
  const int64_t row_width = s.num_heads * kKvLoraRank;
  for (int64_t t : {0, 3, 4, 5}) {  // tokens 1 and 2 (request 0's last queries) see the key
    for (int64_t e = t * row_width; e < (t + 1) * row_width; ++e)
      ASSERT_EQ(bad_out[size_t(e)], clean_out[size_t(e)]) << "token " << t << ", element " << e - t * row_width;
    for (int64_t h = 0; h < s.num_heads; ++h)
      ASSERT_EQ(bad_lse[size_t(t * s.num_heads + h)], clean_lse[size_t(t * s.num_heads + h)]) << "token " << t;
  }
}

TEST(MlaDecodeCpu, NanQueryRowGivesANanRow) {
  // A NaN in one query row makes that row's output and LSE NaN (the GPU kernels and their combine
  // do the same, GpuDecode.NanQueryRowIsNanInEveryKernelAndSplit); every other row is unchanged.
  DecodeSetup s;
  s.num_heads = 3;
  s.kv_lens = {37, 20};
  std::mt19937_64 rng(43);
  const LogicalCache logical = random_logical_cache(s, rng);
  std::mt19937_64 layout_a(44), layout_b(44);
  auto clean = make_problem(s, logical, layout_a);
  auto bad = make_problem(s, logical, layout_b);
  const int64_t bad_row = 1;  // token 0, head 1
  store_from_float(bad->args.q.data, bad->args.q.dtype, bad_row * bad->args.q.stride[1] + 5, kNaN);
  run_and_check(*clean, s, "finite query");
  ASSERT_NO_THROW(mla_decode(bad->args));
  const std::vector<float> clean_out = gather_floats(clean->args.out), bad_out = gather_floats(bad->args.out);
  const std::vector<float> clean_lse = gather_floats(clean->args.lse), bad_lse = gather_floats(bad->args.lse);
  for (int64_t row = 0; row < 2 * s.num_heads; ++row) {
    for (int64_t e = row * kKvLoraRank; e < (row + 1) * kKvLoraRank; ++e) {
      if (row == bad_row)
        ASSERT_TRUE(std::isnan(bad_out[size_t(e)])) << "element " << e - row * kKvLoraRank;
      else
        ASSERT_EQ(bad_out[size_t(e)], clean_out[size_t(e)]) << "row " << row;
    }
    if (row == bad_row)
      EXPECT_TRUE(std::isnan(bad_lse[size_t(row)])) << bad_lse[size_t(row)];
    else
      EXPECT_EQ(bad_lse[size_t(row)], clean_lse[size_t(row)]) << "row " << row;
  }
}

TEST(MlaDecodeCpu, EmptyBatchTouchesNothing) {
  // IDLE: no requests at all.
  HostTensor q(DType::kBF16, {0, 16, kLatentDim}), cache(DType::kBF16, {4, 16, kLatentDim});
  HostTensor block_table(DType::kInt32, {0, 4}), kv_lens(DType::kInt32, {0});
  HostTensor out(DType::kFP32, {0, 16, kKvLoraRank}), lse(DType::kFP32, {0, 16});
  MlaDecodeArgs a;
  a.q = q.view();
  a.kv_cache = cache.view();
  a.block_table = block_table.view();
  a.kv_lens = kv_lens.view();
  a.softmax_scale = 0.1f;
  a.out = out.view();
  a.lse = lse.view();
  EXPECT_NO_THROW(mla_decode(a));

  // Requests without query tokens (cu_q_lens all zero): nothing is read, not even the page ids.
  HostTensor bt = int32_tensor({-5, 99, 7, 7}, {2, 2});
  HostTensor kv = int32_tensor({9, 3});
  HostTensor cu = int32_tensor({0, 0, 0});
  a.block_table = bt.view();
  a.kv_lens = kv.view();
  a.cu_q_lens = cu.view();
  EXPECT_NO_THROW(mla_decode(a));
}

// ---------------------------------------------------------------------------------------------
// Bad input: every error names the argument.

class MlaDecodeErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    DecodeSetup s;
    s.num_heads = 4;
    s.page_size = 4;
    s.kv_lens = {6, 3};
    s.q_lens = {2, 2};
    setup = s;
    std::mt19937_64 rng(21);
    const LogicalCache logical = random_logical_cache(s, rng);
    problem = make_problem(s, logical, rng);
    ASSERT_NO_THROW(mla_decode(problem->args));
  }
  MlaDecodeArgs args() const { return problem->args; }
  DecodeSetup setup;
  std::unique_ptr<DecodeProblem> problem;
};

TEST_F(MlaDecodeErrors, QueryArguments) {
  auto a = args();
  a.q.dtype = DType::kFP32;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"mla_decode", "q", "fp32"}));
  a = args();
  a.q.ndim = 2;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"mla_decode", "q must have 3 dims"}));
  a = args();
  a.q.shape[2] = 512;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q.shape[2] must be 576"}));
  a = args();
  a.q.stride[2] = 2;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q", "contiguous last dimension"}));
  a = args();
  a.q.shape[1] = 129;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"heads", "q.shape[1]", "129"}));
  a = args();
  a.q.shape[1] = 0;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"heads", "q.shape[1]", "got 0"}));
  a = args();
  a.q_nope = a.q;
  a.q_nope.shape[2] = kKvLoraRank;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"either q or q_nope/q_pe"}));
  a = args();
  a.q = TensorView();
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q is required"}));
  a = args();
  a.q_nope = a.q;
  a.q_nope.shape[2] = kKvLoraRank;
  a.q = TensorView();
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_pe is required"}));
  a.q_pe = a.q_nope;
  a.q_pe.shape[2] = 32;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_pe.shape[2] must be 64"}));
  a.q_pe.shape[2] = kRopeDim;
  a.q_pe.shape[1] = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_pe.shape[1] must be 4"}));
  a.q_pe.shape[1] = 4;
  a.q_pe.dtype = DType::kFP16;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_pe must be bf16"}));
  a = args();
  a.q.dtype = DType::kFP16;  // bf16 cache
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q must have the kv_cache dtype bf16"}));
  a = args();
  a.q.dtype = DType::kFP8E4M3;  // fp8 query, bf16 cache
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q", "fp8e4m3 kv_cache"}));
}

TEST_F(MlaDecodeErrors, CacheArguments) {
  auto a = args();
  a.kv_cache.dtype = DType::kFP32;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_cache", "bf16/fp16/fp8e4m3", "fp32"}));
  a = args();
  a.kv_cache.shape[2] = 512;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_cache.shape[2] must be 576"}));
  for (int64_t bad_page : {3, 256, 0, 96}) {
    a = args();
    a.kv_cache = TensorView::contiguous(problem->kv_cache.data(), DType::kBF16,
                                        {1, bad_page, kLatentDim});
    EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"page size", "kv_cache.shape[1]", "power of two"}))
        << bad_page;
  }
  a = args();
  a.kv_cache.stride[0] += 576;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_cache must be contiguous"}));
  a = args();
  a.kv_cache.ndim = 4;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_cache must have 3 dims"}));
}

TEST_F(MlaDecodeErrors, BatchArguments) {
  auto a = args();
  a.block_table.dtype = DType::kInt64;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"block_table must be int32"}));
  a = args();
  a.block_table.ndim = 1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"block_table must have 2 dims"}));
  a = args();
  a.kv_lens.shape[0] = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_lens.shape[0] must be 2"}));
  // A table of more than 2^31 - 256 keys a request (never read: the check comes first).
  a = args();
  a.block_table.shape[1] = kMaxKeysPerRequest / a.kv_cache.shape[1] + 1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"block_table has", "keys; at most 2147483392 keys a request"}));
  a = args();
  a.kv_lens.dtype = DType::kInt64;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_lens must be int32"}));
  a = args();
  a.q_len = 3;  // T = 4 != 2 x 3
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q has 4 tokens", "q_len 3"}));
  a = args();
  a.q_len = 0;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_len must be >= 1"}));
  a = args();
  a.max_q_len = 1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"max_q_len 1", "q_len 2"}));
  a = args();
  a.max_q_len = -1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"max_q_len must be >= 0"}));
}

TEST_F(MlaDecodeErrors, CumulativeQueryLengths) {
  auto a = args();
  HostTensor cu = int32_tensor({0, 2, 4});
  a.cu_q_lens = cu.view();
  EXPECT_NO_THROW(mla_decode(a));
  a.cu_q_lens.shape[0] = 2;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens.shape[0] must be 3"}));
  a.cu_q_lens.shape[0] = 3;
  a.cu_q_lens.dtype = DType::kInt64;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens must be int32"}));
  a.cu_q_lens.dtype = DType::kInt32;
  cu.i32(1) = 5;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens must be non-decreasing", "cu_q_lens[1] = 5"}));
  cu.i32(1) = 1;
  cu.i32(0) = 1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens[0] must be 0"}));
  cu.i32(0) = 0;
  cu.i32(2) = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"cu_q_lens[2] must equal the 4 query tokens"}));
  cu.i32(2) = 4;
  cu.i32(1) = 1;  // request 1 has 3 queries
  a.max_q_len = 2;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"request 1 has 3 queries", "max_q_len is 2"}));
}

TEST_F(MlaDecodeErrors, LengthsAndPageIds) {
  auto a = args();
  const int64_t max_blocks = a.block_table.shape[1];
  const int32_t saved_len = problem->kv_lens.i32(1);
  problem->kv_lens.i32(1) = int32_t(max_blocks * 4 + 1);
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_lens[1]", "must be in [0, ", "block_table"}));
  problem->kv_lens.i32(1) = -1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"kv_lens[1] = -1"}));
  problem->kv_lens.i32(1) = saved_len;

  // Request 0 uses blocks 0 and 1 (kv_len 6, page size 4).
  const int32_t saved_page = problem->block_table.i32(1);
  const int64_t num_pages = a.kv_cache.shape[0];
  for (int32_t bad : {-1, int32_t(num_pages), 1 << 30}) {
    problem->block_table.i32(1) = bad;
    const std::string value = "= " + std::to_string(bad);
    EXPECT_TRUE(throws_error([&] { mla_decode(a); },
                             {"block_table[0, 1]", value.c_str(), "request 0", "block 1"}));
  }
  problem->block_table.i32(1) = saved_page;
  EXPECT_NO_THROW(mla_decode(a));
}

TEST_F(MlaDecodeErrors, ScalesAndOutputs) {
  auto a = args();
  a.softmax_scale = 0;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"softmax_scale is required"}));
  for (float bad : {-0.1f, kNaN, float(kInf)}) {
    a.softmax_scale = bad;
    EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"softmax_scale"}));
  }
  a = args();
  a.k_scale = 0;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"k_scale must be finite and > 0"}));
  a = args();
  a.q_scale = kNaN;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"q_scale must be finite and > 0"}));
  a = args();
  a.out.dtype = DType::kFP8E4M3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out must be one of bf16/fp16/fp32"}));
  a = args();
  a.out.shape[2] = 128;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out.shape[2] must be 512"}));
  a = args();
  a.out.shape[0] = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out.shape[0] must be 4"}));
  a = args();
  a.out.stride[2] = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out", "contiguous last dimension"}));
  // Outputs whose rows share memory (a broadcast head dim, tokens laid over the heads).
  a = args();
  a.out.stride[1] = 0;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out is an output whose elements overlap", "stride[1] = 0"}));
  a = args();
  a.out.stride[0] = kKvLoraRank;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out is an output whose elements overlap", "] = 512 over 4 elements"}));
  a = args();
  a.lse.stride[0] = 1;
  a.lse.stride[1] = 1;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse is an output whose elements overlap"}));
  a = args();
  a.lse.dtype = DType::kBF16;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse must be fp32"}));
  a = args();
  a.lse.shape[1] = 5;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse.shape[1] must be 4"}));
  a = args();
  a.out = TensorView();
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out is required"}));
  // Outputs over an input or over each other.
  a = args();
  a.out = TensorView::strided(a.q.data, a.q.dtype, {4, 4, kKvLoraRank}, {a.q.stride[0], a.q.stride[1], 1});
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"mla_decode: out", "overlaps q", "its own memory"}));
  a = args();
  a.lse = TensorView::contiguous(a.kv_cache.data, DType::kFP32, {4, 4});
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse", "overlaps kv_cache"}));
  a = args();
  a.lse = TensorView::contiguous(a.out.data, DType::kFP32, {4, 4});
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse", "overlaps out"}));
  // A block table wide enough to hold an LSE: the original rows, then page 0.
  a = args();
  HostTensor wide_table(DType::kInt32, {a.block_table.shape[0], 16});
  const int32_t* rows = a.block_table.ptr<int32_t>();
  for (int64_t b = 0; b < a.block_table.shape[0]; ++b)
    for (int64_t j = 0; j < 16; ++j)
      wide_table.i32(b * 16 + j) = j < a.block_table.shape[1] ? rows[b * a.block_table.stride[0] + j] : 0;
  a.block_table = wide_table.view();
  ASSERT_NO_THROW(mla_decode(a));
  a.lse = TensorView::contiguous(wide_table.data(), DType::kFP32, {4, 4});
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"lse", "overlaps block_table"}));
  // A split query: the messages name q_nope.
  a = args();
  a.q_nope = a.q;
  a.q_nope.shape[2] = kKvLoraRank;
  a.q_pe = a.q;
  a.q_pe.data = static_cast<char*>(a.q.data) + kKvLoraRank * dtype_size(a.q.dtype);
  a.q_pe.shape[2] = kRopeDim;
  a.q = TensorView();
  ASSERT_NO_THROW(mla_decode(a));  // q_nope and q_pe as views of q's rows
  a.out.shape[0] = 3;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out.shape[0] must be 4 (tokens, as q_nope)"}));
}

TEST_F(MlaDecodeErrors, Devices) {
  auto a = args();
  a.out.device = Device::cuda(0);
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"out is on cuda:0", "q is on cpu", "one device"}));
  a = args();
  a.block_table.device = Device::cuda(1);
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"block_table is on cuda:1"}));
  // On a GPU the launch shape cannot be derived from cu_q_lens.
  a = args();
  HostTensor cu = int32_tensor({0, 2, 4});
  a.cu_q_lens = cu.view();
  for (TensorView* t : {&a.q, &a.kv_cache, &a.block_table, &a.kv_lens, &a.cu_q_lens, &a.out, &a.lse})
    t->device = Device::cuda(0);
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"max_q_len must be given"}));
}

TEST_F(MlaDecodeErrors, DeterministicModeTakesNoSchedule) {
  // The CPU path is deterministic in either mode: the same bits with the flag.
  auto a = args();
  const std::vector<float> out = gather_floats(a.out);
  a.deterministic = true;
  ASSERT_NO_THROW(mla_decode(a));
  EXPECT_EQ(gather_floats(a.out), out);
  // A split-KV schedule's cuts depend on the whole batch: refused with the flag, on every device.
  DecodeSchedule schedule;
  a.schedule = &schedule;
  EXPECT_TRUE(throws_error([&] { mla_decode(a); }, {"mla_decode", "deterministic", "schedule"}));
  a.deterministic = false;
  EXPECT_NO_THROW(mla_decode(a));  // the CPU ignores a schedule
}

}  // namespace
}  // namespace mla::test
