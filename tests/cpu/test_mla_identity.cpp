// The identities that make the two attention forms interchangeable.
//
// (a) MLA weight absorption: attention of per-head queries over up-projected keys/values
//     (the non-absorbed "MHA" form) equals absorbed attention over the latent cache followed by
//     the value up-projection:
//       k_nope_h = c_kv · W_UK_h^T      (N x 128)     W_UK_h: [128, 512]
//       v_h      = c_kv · W_UV_h        (N x 128)     W_UV_h: [512, 128]
//       q_abs_h  = q_nope_h · W_UK_h    (512)
//       q_abs_h · c_kv_j = q_nope_h · k_nope_h[j], so softmax weights agree, and
//       out_h = (softmax · c_kv) · W_UV_h = softmax · v_h.
//     The data are small multiples of powers of two, so every tensor the ops read (including
//     q_abs and the up-projected k/v) is exactly representable in bf16/fp16 and the comparison
//     can be tight.
// (b) Chunked prefix attention: non-causal attention over prefix chunks merged by LSE with causal
//     attention over the new tokens equals one causal (bottom-right) pass over prefix + new.
#include <cmath>
#include <random>
#include <vector>

#include "attention_reference.hpp"
#include "mla/ops.hpp"
#include "test_util.hpp"

namespace mla::test {
namespace {

constexpr int kNope = 128;  // qk_nope_head_dim
constexpr int kQk = 192;
constexpr int kV = 128;

// Random multiples of 1/denominator in [-limit_units, limit_units] / denominator, from a cheap
// generator (the 128-head weights alone take millions of draws).
struct GridRandom {
  uint64_t state;
  double operator()(int limit_units, double denominator) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const int64_t span = 2 * limit_units + 1;
    return double(int64_t((state >> 33) % uint64_t(span)) - limit_units) / denominator;
  }
};

float exact_float(double x, DType dtype) {
  unsigned char buf[4];
  store_from_float(buf, dtype, 0, float(x));
  const float stored = load_as_float(buf, dtype, 0);
  EXPECT_EQ(double(stored), x) << "test data must be exact in " << dtype_name(dtype);
  return stored;
}

void mla_identity_case(int num_heads, const std::vector<int>& kv_lens, uint64_t seed) {
  SCOPED_TRACE("heads " + std::to_string(num_heads));
  GridRandom grid{seed * 0x9E3779B97F4A7C15ull + 1};
  const int64_t H = num_heads, B = int64_t(kv_lens.size());
  // Weights: W_UK [H, 128, 512], W_UV [H, 512, 128], entries in {-1, 0, 1} / 8.
  std::vector<double> w_uk(size_t(H * kNope * kKvLoraRank)), w_uv(size_t(H * kKvLoraRank * kV));
  for (double& w : w_uk) w = grid(1, 8);
  for (double& w : w_uv) w = grid(1, 8);
  // Queries: one per request; q_nope in {-1, 0, 1}, q_pe multiples of 1/16.
  std::vector<double> q_nope(size_t(B * H * kNope)), q_pe(size_t(B * H * kRopeDim));
  for (double& x : q_nope) x = grid(1, 1);
  for (double& x : q_pe) x = grid(16, 16);
  // Latent cache entries per request: c_kv | k_pe, multiples of 1/16 in [-1, 1].
  std::vector<std::vector<double>> latent(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    latent[size_t(b)].resize(size_t(kv_lens[size_t(b)]) * kLatentDim);
    for (double& x : latent[size_t(b)]) x = grid(16, 16);
  }
  const double softmax_scale = 1.0 / std::sqrt(double(kQk));

  // --- Naive MHA in float64 with the up-projected keys and values.
  std::vector<double> naive_out(size_t(B * H * kV)), naive_lse(size_t(B * H));
  // Up-projected per-request, per-head k [N, H, 192] and v [N, H, 128], kept for mha_prefill.
  std::vector<std::vector<double>> k_full(static_cast<size_t>(B)), v_full(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t N = kv_lens[size_t(b)];
    const std::vector<double>& lat = latent[size_t(b)];
    k_full[size_t(b)].assign(size_t(N * H * kQk), 0.0);
    v_full[size_t(b)].assign(size_t(N * H * kV), 0.0);
    for (int64_t j = 0; j < N; ++j) {
      const double* c_kv = &lat[size_t(j * kLatentDim)];
      for (int64_t h = 0; h < H; ++h) {
        double* k = &k_full[size_t(b)][size_t((j * H + h) * kQk)];
        double* v = &v_full[size_t(b)][size_t((j * H + h) * kV)];
        for (int64_t i = 0; i < kNope; ++i) {
          const double* w = &w_uk[size_t((h * kNope + i) * kKvLoraRank)];
          double sum = 0;
          for (int64_t c = 0; c < kKvLoraRank; ++c) sum += c_kv[c] * w[c];
          k[i] = sum;
        }
        for (int64_t r = 0; r < kRopeDim; ++r) k[kNope + r] = c_kv[kKvLoraRank + r];
        for (int64_t c = 0; c < kKvLoraRank; ++c) {
          const double* w = &w_uv[size_t((h * kKvLoraRank + c) * kV)];
          for (int64_t e = 0; e < kV; ++e) v[e] += c_kv[c] * w[e];
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> scores(static_cast<size_t>(N)), values(size_t(N * kV));
      for (int64_t j = 0; j < N; ++j) {
        const double* k = &k_full[size_t(b)][size_t((j * H + h) * kQk)];
        double dot = 0;
        for (int64_t i = 0; i < kNope; ++i) dot += q_nope[size_t((b * H + h) * kNope + i)] * k[i];
        for (int64_t r = 0; r < kRopeDim; ++r) dot += q_pe[size_t((b * H + h) * kRopeDim + r)] * k[kNope + r];
        scores[size_t(j)] = dot * softmax_scale;
        for (int64_t e = 0; e < kV; ++e)
          values[size_t(j * kV + e)] = v_full[size_t(b)][size_t((j * H + h) * kV + e)];
      }
      naive_softmax_row(scores, values, kV, 1.0, &naive_out[size_t((b * H + h) * kV)],
                        naive_lse[size_t(b * H + h)]);
    }
  }

  // --- Absorbed: mla_decode over the latent cache (bf16, page size 4), then W_UV.
  const int64_t S = 4;
  int64_t max_blocks = 0;
  for (int n : kv_lens) max_blocks = std::max<int64_t>(max_blocks, (n + S - 1) / S);
  HostTensor cache(DType::kBF16, {B * max_blocks, S, kLatentDim});
  cache.fill_nan();
  HostTensor block_table(DType::kInt32, {B, max_blocks});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t blk = 0; blk < max_blocks; ++blk)
      block_table.i32(b * max_blocks + blk) = int32_t((B - 1 - b) * max_blocks + blk);  // reversed
    for (int64_t j = 0; j < kv_lens[size_t(b)]; ++j) {
      const int64_t page = block_table.i32(b * max_blocks + j / S);
      for (int64_t d = 0; d < kLatentDim; ++d)
        cache.set((page * S + j % S) * kLatentDim + d,
                  exact_float(latent[size_t(b)][size_t(j * kLatentDim + d)], DType::kBF16));
    }
  }
  HostTensor q(DType::kBF16, {B, H, kLatentDim});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < kKvLoraRank; ++c) {
        double q_abs = 0;
        for (int64_t i = 0; i < kNope; ++i)
          q_abs += q_nope[size_t((b * H + h) * kNope + i)] * w_uk[size_t((h * kNope + i) * kKvLoraRank + c)];
        q.set((b * H + h) * kLatentDim + c, exact_float(q_abs, DType::kBF16));
      }
      for (int64_t r = 0; r < kRopeDim; ++r)
        q.set((b * H + h) * kLatentDim + kKvLoraRank + r,
              exact_float(q_pe[size_t((b * H + h) * kRopeDim + r)], DType::kBF16));
    }
  std::vector<int32_t> kv32(kv_lens.begin(), kv_lens.end());
  HostTensor kv_len_tensor = int32_tensor(kv32);
  HostTensor latent_out(DType::kFP32, {B, H, kKvLoraRank}), decode_lse(DType::kFP32, {B, H});
  latent_out.fill_nan();
  decode_lse.fill_nan();
  MlaDecodeArgs d;
  d.q = q.view();
  d.kv_cache = cache.view();
  d.block_table = block_table.view();
  d.kv_lens = kv_len_tensor.view();
  d.softmax_scale = float(softmax_scale);
  d.out = latent_out.view();
  d.lse = decode_lse.view();
  ASSERT_NO_THROW(mla_decode(d));
  std::vector<float> absorbed_out(size_t(B * H * kV));
  for (int64_t row = 0; row < B * H; ++row) {
    const int64_t h = row % H;
    for (int64_t e = 0; e < kV; ++e) {
      double sum = 0;
      for (int64_t c = 0; c < kKvLoraRank; ++c)
        sum += double(latent_out.get(row * kKvLoraRank + c)) * w_uv[size_t((h * kKvLoraRank + c) * kV + e)];
      absorbed_out[size_t(row * kV + e)] = float(sum);
    }
  }
  // softmax_scale is rounded to float in the ops; the reference keeps the double, so allow for
  // a relative score error of ~6e-8 on scores of a few units.
  EXPECT_TRUE(all_close(absorbed_out, naive_out, 2e-5, 1e-4)) << "absorbed vs naive MHA";
  EXPECT_TRUE(all_close(decode_lse.to_float(), naive_lse, 2e-5, 1e-5)) << "absorbed lse";

  // --- Non-absorbed: mha_prefill with the up-projected k/v (fp16, exact), one query per request.
  std::vector<int32_t> cu_q(1, 0), cu_kv(1, 0);
  for (int64_t b = 0; b < B; ++b) {
    cu_q.push_back(cu_q.back() + 1);
    cu_kv.push_back(cu_kv.back() + kv_lens[size_t(b)]);
  }
  const int64_t Tk = cu_kv.back();
  HostTensor pq(DType::kFP16, {B, H, kQk}), pk(DType::kFP16, {Tk, H, kQk}), pv(DType::kFP16, {Tk, H, kV});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < kNope; ++i)
        pq.set((b * H + h) * kQk + i, exact_float(q_nope[size_t((b * H + h) * kNope + i)], DType::kFP16));
      for (int64_t r = 0; r < kRopeDim; ++r)
        pq.set((b * H + h) * kQk + kNope + r, exact_float(q_pe[size_t((b * H + h) * kRopeDim + r)], DType::kFP16));
    }
    for (int64_t j = 0; j < kv_lens[size_t(b)]; ++j) {
      const int64_t token = cu_kv[size_t(b)] + j;
      for (int64_t e = 0; e < H * kQk; ++e)
        pk.set(token * H * kQk + e, exact_float(k_full[size_t(b)][size_t(j * H * kQk + e)], DType::kFP16));
      for (int64_t e = 0; e < H * kV; ++e)
        pv.set(token * H * kV + e, exact_float(v_full[size_t(b)][size_t(j * H * kV + e)], DType::kFP16));
    }
  }
  HostTensor cu_q_t = int32_tensor(cu_q), cu_kv_t = int32_tensor(cu_kv);
  HostTensor prefill_out(DType::kFP32, {B, H, kV}), prefill_lse(DType::kFP32, {B, H});
  prefill_out.fill_nan();
  prefill_lse.fill_nan();
  MhaPrefillArgs p;
  p.q = pq.view();
  p.k = pk.view();
  p.v = pv.view();
  p.cu_q_lens = cu_q_t.view();
  p.cu_kv_lens = cu_kv_t.view();
  p.causal = true;  // one query per request: sees every key
  p.softmax_scale = float(softmax_scale);
  p.out = prefill_out.view();
  p.lse = prefill_lse.view();
  ASSERT_NO_THROW(mha_prefill(p));
  EXPECT_TRUE(all_close(prefill_out.to_float(), naive_out, 2e-5, 1e-4)) << "mha_prefill vs naive";
  EXPECT_TRUE(all_close(prefill_lse.to_float(), naive_lse, 2e-5, 1e-5)) << "mha_prefill lse";
  const std::vector<float> prefill_values = prefill_out.to_float();
  EXPECT_TRUE(all_close(absorbed_out,
                        std::vector<double>(prefill_values.begin(), prefill_values.end()), 2e-5,
                        1e-4))
      << "absorbed vs mha_prefill";
}

TEST(MlaIdentity, AbsorbedDecodeEqualsUpProjectedMha) {
  mla_identity_case(1, {37, 5}, 1);
  mla_identity_case(8, {13, 1, 8}, 2);
  mla_identity_case(16, {9}, 3);
  mla_identity_case(128, {3, 2}, 4);
}

// ---------------------------------------------------------------------------------------------

struct Ragged {
  HostTensor k, v, cu_kv;
};

// k/v [sum of lens, H, ...] from per-request row ranges [begin_b, end_b) of the logical keys.
Ragged slice_keys(const std::vector<HostTensor>& keys, const std::vector<HostTensor>& values,
                  const std::vector<std::pair<int64_t, int64_t>>& ranges, int64_t H) {
  std::vector<int32_t> cu(1, 0);
  for (const auto& [begin, end] : ranges) cu.push_back(cu.back() + int32_t(end - begin));
  Ragged r;
  r.k = HostTensor(DType::kBF16, {cu.back(), H, kQk});
  r.v = HostTensor(DType::kBF16, {cu.back(), H, kV});
  r.cu_kv = int32_tensor(cu);
  for (size_t b = 0; b < ranges.size(); ++b) {
    const auto [begin, end] = ranges[b];
    const size_t k_row = size_t(H * kQk) * 2, v_row = size_t(H * kV) * 2;  // bf16 bytes per token
    std::memcpy(r.k.bytes.data() + size_t(cu[b]) * k_row, keys[b].bytes.data() + size_t(begin) * k_row,
                size_t(end - begin) * k_row);
    std::memcpy(r.v.bytes.data() + size_t(cu[b]) * v_row, values[b].bytes.data() + size_t(begin) * v_row,
                size_t(end - begin) * v_row);
  }
  return r;
}

TEST(MlaIdentity, ChunkedPrefixPlusMergeEqualsOneShotAttention) {
  const int64_t H = 4;
  const std::vector<int64_t> prefix_lens = {40, 0, 13, 70, 5, 16};
  const std::vector<int64_t> extend_lens = {7, 5, 1, 12, 0, 3};
  const int64_t chunk = 16;
  const int64_t B = int64_t(prefix_lens.size());
  std::mt19937_64 rng(99);

  // Per request: all keys/values (prefix then extend), and the queries of the extend tokens.
  std::vector<HostTensor> keys, values;
  std::vector<int32_t> cu_q(1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = prefix_lens[size_t(b)] + extend_lens[size_t(b)];
    keys.emplace_back(DType::kBF16, std::vector<int64_t>{n, H, kQk});
    values.emplace_back(DType::kBF16, std::vector<int64_t>{n, H, kV});
    keys.back().fill_uniform(rng, -1.0f, 1.0f);
    values.back().fill_uniform(rng, -1.0f, 1.0f);
    cu_q.push_back(cu_q.back() + int32_t(extend_lens[size_t(b)]));
  }
  const int64_t Tq = cu_q.back();
  HostTensor q(DType::kBF16, {Tq, H, kQk});
  q.fill_uniform(rng, -1.0f, 1.0f);
  HostTensor cu_q_t = int32_tensor(cu_q);

  auto run = [&](const Ragged& kv, bool causal, HostTensor& out, HostTensor& lse) {
    out = HostTensor(DType::kFP32, {Tq, H, kV});
    lse = HostTensor(DType::kFP32, {Tq, H});
    out.fill_nan();
    lse.fill_nan();
    MhaPrefillArgs a;
    a.q = q.view();
    a.k = const_cast<HostTensor&>(kv.k).view();
    a.v = const_cast<HostTensor&>(kv.v).view();
    a.cu_q_lens = cu_q_t.view();
    a.cu_kv_lens = const_cast<HostTensor&>(kv.cu_kv).view();
    a.causal = causal;
    a.softmax_scale = 0.3f;
    a.out = out.view();
    a.lse = lse.view();
    mha_prefill(a);
    return a;
  };

  // One shot: causal, bottom-right aligned over prefix + extend.
  std::vector<std::pair<int64_t, int64_t>> full;
  for (int64_t b = 0; b < B; ++b) full.push_back({0, prefix_lens[size_t(b)] + extend_lens[size_t(b)]});
  const Ragged all_keys = slice_keys(keys, values, full, H);
  HostTensor ref_out, ref_lse;
  const MhaPrefillArgs one_shot = run(all_keys, true, ref_out, ref_lse);
  const NaiveAttention naive = naive_mha_prefill(one_shot);
  EXPECT_TRUE(all_close(ref_out.to_float(), naive.out, 5e-6, 2e-5));
  EXPECT_TRUE(all_close(ref_lse.to_float(), naive.lse, 2e-5, 2e-5));

  // Chunked: start from "no keys" (0, -inf), merge every prefix chunk, then the extend part.
  HostTensor acc_out(DType::kFP32, {Tq, H, kV}), acc_lse(DType::kFP32, {Tq, H});
  for (int64_t i = 0; i < acc_lse.numel(); ++i) acc_lse.set(i, -std::numeric_limits<float>::infinity());
  auto merge_into_acc = [&](HostTensor& part_out, HostTensor& part_lse) {
    MergeStatesArgs m;
    m.out_a = acc_out.view();
    m.lse_a = acc_lse.view();
    m.out_b = part_out.view();
    m.lse_b = part_lse.view();
    m.out = acc_out.view();
    m.lse_out = acc_lse.view();
    merge_states(m);
  };
  const int64_t max_prefix = *std::max_element(prefix_lens.begin(), prefix_lens.end());
  for (int64_t start = 0; start < max_prefix; start += chunk) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = prefix_lens[size_t(b)];
      ranges.push_back({std::min(start, p), std::min(start + chunk, p)});  // may be empty
    }
    const Ragged part = slice_keys(keys, values, ranges, H);
    HostTensor part_out, part_lse;
    ASSERT_NO_THROW(run(part, false, part_out, part_lse));
    ASSERT_NO_THROW(merge_into_acc(part_out, part_lse));
  }
  std::vector<std::pair<int64_t, int64_t>> extend;
  for (int64_t b = 0; b < B; ++b)
    extend.push_back({prefix_lens[size_t(b)], prefix_lens[size_t(b)] + extend_lens[size_t(b)]});
  const Ragged extend_keys = slice_keys(keys, values, extend, H);
  HostTensor ext_out, ext_lse;
  ASSERT_NO_THROW(run(extend_keys, true, ext_out, ext_lse));
  ASSERT_NO_THROW(merge_into_acc(ext_out, ext_lse));

  const std::vector<float> one_shot_out = ref_out.to_float(), one_shot_lse = ref_lse.to_float();
  EXPECT_TRUE(all_close(acc_out.to_float(), std::vector<double>(one_shot_out.begin(), one_shot_out.end()),
                        1e-5, 1e-5));
  EXPECT_TRUE(all_close(acc_lse.to_float(), std::vector<double>(one_shot_lse.begin(), one_shot_lse.end()),
                        1e-5, 1e-5));
}

}  // namespace
}  // namespace mla::test
