// mla::Backend and mla::MultiStepDraftBackend against float64 naive attention written here over
// the logical sequences (never through the library's ops): DECODE, TARGET_VERIFY, DRAFT_EXTEND,
// EXTEND (chunked prefix and absorbed), CUDA-graph fixed buffers, multi-step drafting, the
// DP-padding re-plan, IDLE / empty rows, and argument errors.
//
// Pools have their pages handed out in random order and every unused entry holds NaN, so a
// wrong page id or a read past a sequence shows up as NaN or a mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mla/backend.hpp"
#include "mla/ops.hpp"
#include "test_util.hpp"

namespace mla {
namespace {

using test::all_close;
using test::HostTensor;
using test::throws_error;

constexpr double kInf = std::numeric_limits<double>::infinity();
const float kSoftmaxScale = float(1.0 / std::sqrt(192.0));

// fp32 outputs of fp32-accumulating kernels over short sequences.
constexpr double kOutAtol = 2e-5, kOutRtol = 2e-4;
constexpr double kLseAtol = 2e-5, kLseRtol = 2e-5;

// ---------------------------------------------------------------------------------------------
// A paged latent pool with scattered pages, NaN everywhere unused, and its req_to_token table.
struct Pool {
  int page_size, num_pages, max_context_len, num_slots;
  DType dtype;
  float k_scale;
  HostTensor cache;         // [P, S, 576]
  HostTensor req_to_token;  // [R, max_context_len]
  std::vector<int32_t> free_pages;
  // What reading the cache gives back for each (request slot, position): 576 dequantised values.
  std::vector<std::vector<std::vector<float>>> latent;

  Pool(int s, int p, int max_len, int r, DType dt, uint64_t seed, float scale = 1.0f)
      : page_size(s), num_pages(p), max_context_len(max_len), num_slots(r), dtype(dt),
        k_scale(scale), cache(dt, {p, s, kLatentDim}), req_to_token(DType::kInt32, {r, max_len}),
        latent(size_t(r)) {
    cache.fill_nan();
    for (int64_t i = 0; i < req_to_token.numel(); ++i) req_to_token.i32(i) = -1;
    free_pages.resize(size_t(p));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
  }

  int32_t& slot(int r, int pos) { return req_to_token.i32(int64_t(r) * max_context_len + pos); }

  // Gives request slot r pages for positions [0, len).
  void reserve(int r, int len) {
    for (int first = 0; first < len; first += page_size) {
      if (slot(r, first) >= 0) continue;
      EXPECT_FALSE(free_pages.empty()) << "pool out of pages";
      const int page = free_pages.back();
      free_pages.pop_back();
      for (int o = 0; o < page_size && first + o < max_context_len; ++o)
        slot(r, first + o) = page * page_size + o;
    }
    if (int(latent[size_t(r)].size()) < len) latent[size_t(r)].resize(size_t(len));
  }

  // The value a write of v followed by a read gives back (fp8: quantised with k_scale).
  float stored(float v) const {
    HostTensor one(dtype, {1});
    one.set(0, dtype == DType::kFP8E4M3 ? v / k_scale : v);
    return one.get(0) * (dtype == DType::kFP8E4M3 ? k_scale : 1.0f);
  }
  // Writes a latent row into the cache directly (an earlier pass's tokens).
  void write(int r, int pos, const float* values) {
    reserve(r, pos + 1);
    const int64_t base = int64_t(slot(r, pos)) * kLatentDim;
    for (int d = 0; d < kLatentDim; ++d)
      cache.set(base + d, dtype == DType::kFP8E4M3 ? values[d] / k_scale : values[d]);
    expect(r, pos, values);
  }
  // Records what the backend is expected to store for (r, pos).
  void expect(int r, int pos, const float* values) {
    reserve(r, pos + 1);
    std::vector<float>& row = latent[size_t(r)][size_t(pos)];
    row.resize(kLatentDim);
    for (int d = 0; d < kLatentDim; ++d) row[size_t(d)] = stored(values[d]);
  }
  TensorView cache_view() { return cache.view(); }
};

std::vector<float> random_values(std::mt19937_64& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

HostTensor tensor_from(DType dtype, std::vector<int64_t> shape, const std::vector<float>& values) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, values[size_t(i)]);
  return t;
}

HostTensor nan_tensor(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  t.fill_nan();
  return t;
}

BackendConfig make_config(Pool& pool, int heads, DType q_dtype = DType::kFP16) {
  BackendConfig c;
  c.num_q_heads = heads;
  c.page_size = pool.page_size;
  c.kv_cache_dtype = pool.dtype;
  c.q_dtype = q_dtype;
  c.out_dtype = DType::kFP32;
  c.req_to_token = pool.req_to_token.view();
  c.max_context_len = pool.max_context_len;
  c.workspace_bytes = size_t(4) << 20;
  return c;
}

LayerParams make_layer(Pool& pool) {
  LayerParams layer;
  layer.kv_cache = pool.cache_view();
  layer.k_scale = pool.k_scale;
  layer.softmax_scale = kSoftmaxScale;
  return layer;
}

// ---------------------------------------------------------------------------------------------
// Float64 naive attention over the logical sequence.

struct Reference {
  std::vector<double> out;  // [T, H, Dv]
  std::vector<double> lse;  // [T, H]
};

// Absorbed: query q [576] (as given to the kernel) over the first `visible` latent rows.
void naive_absorbed_row(const std::vector<std::vector<float>>& keys, int visible, const double* q,
                        double* out, double* lse) {
  std::vector<double> scores(size_t(std::max(visible, 0)));
  double max_score = -kInf;
  for (int j = 0; j < visible; ++j) {
    double s = 0;
    for (int d = 0; d < kLatentDim; ++d) s += q[d] * double(keys[size_t(j)][size_t(d)]);
    scores[size_t(j)] = s * kSoftmaxScale;
    max_score = std::max(max_score, scores[size_t(j)]);
  }
  std::fill(out, out + kKvLoraRank, 0.0);
  if (visible <= 0) {
    *lse = -kInf;
    return;
  }
  double sum = 0;
  for (int j = 0; j < visible; ++j) {
    const double p = std::exp(scores[size_t(j)] - max_score);
    sum += p;
    for (int d = 0; d < kKvLoraRank; ++d) out[d] += p * double(keys[size_t(j)][size_t(d)]);
  }
  for (int d = 0; d < kKvLoraRank; ++d) out[d] /= sum;
  *lse = max_score + std::log(sum);
}

// One request of a decode-family batch: `cached` tokens already in the pool, `q_len` new ones
// computed (and saved) now.
struct Request {
  int slot;
  int cached;
  int q_len;
  int seq_len() const { return cached + q_len; }
};

// The tensors of an absorbed-attention pass over `requests`.
struct AbsorbedProblem {
  int heads = 0;
  std::vector<Request> requests;
  int64_t num_tokens = 0;
  HostTensor q;             // [T, H, 576]
  HostTensor k_nope, k_pe;  // [T, 512], [T, 64] fp32: the new tokens' latents
  HostTensor out, lse;      // NaN-poisoned outputs
  HostTensor req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens, positions;
  std::vector<int32_t> seq_lens_cpu, extend_seq_lens_cpu;

  ForwardBatch batch(ForwardMode mode, bool host_lengths = true) {
    ForwardBatch b;
    b.mode = mode;
    b.batch_size = int(requests.size());
    b.req_pool_indices = req_pool_indices.view();
    b.seq_lens = seq_lens.view();
    b.out_cache_loc = out_cache_loc.view();
    b.positions = positions.view();
    if (host_lengths) b.seq_lens_cpu = seq_lens_cpu;
    if (mode == ForwardMode::kDraftExtend) {
      b.extend_seq_lens = extend_seq_lens.view();
      if (host_lengths) b.extend_seq_lens_cpu = extend_seq_lens_cpu;
    }
    return b;
  }
  AbsorbedAttentionArgs args(bool save = true) {
    AbsorbedAttentionArgs a;
    a.q = q.view();
    a.save_kv_cache = save;
    a.k_nope = k_nope.view();
    a.k_pe = k_pe.view();
    a.out = out.view();
    a.lse = lse.view();
    return a;
  }
  void poison_outputs() {
    out.fill_nan();
    lse.fill_nan();
  }
};

// Fills the cached part of each request in the pool (random, from `rng`), draws the queries and
// the new latents, and records the latents the backend must store.
AbsorbedProblem make_absorbed_problem(Pool& pool, const std::vector<Request>& requests, int heads,
                                      DType q_dtype, std::mt19937_64& rng, bool fill_cache = true) {
  AbsorbedProblem p;
  p.heads = heads;
  p.requests = requests;
  for (const Request& r : requests) p.num_tokens += r.q_len;
  const int64_t t_count = p.num_tokens;
  const int batch = int(requests.size());
  std::vector<int32_t> rpi, seq_lens, loc, q_lens, positions;
  for (const Request& r : requests) {
    pool.reserve(r.slot, r.seq_len());
    if (fill_cache)
      for (int pos = 0; pos < r.cached; ++pos) pool.write(r.slot, pos, random_values(rng, kLatentDim).data());
    rpi.push_back(r.slot);
    seq_lens.push_back(r.seq_len());
    q_lens.push_back(r.q_len);
    for (int i = 0; i < r.q_len; ++i) {
      loc.push_back(pool.slot(r.slot, r.cached + i));
      positions.push_back(r.cached + i);
    }
  }
  p.q = tensor_from(q_dtype, {t_count, heads, kLatentDim}, random_values(rng, t_count * heads * kLatentDim));
  p.k_nope = tensor_from(DType::kFP32, {t_count, kKvLoraRank}, random_values(rng, t_count * kKvLoraRank));
  p.k_pe = tensor_from(DType::kFP32, {t_count, kRopeDim}, random_values(rng, t_count * kRopeDim));
  int64_t t = 0;
  for (const Request& r : requests) {
    for (int i = 0; i < r.q_len; ++i, ++t) {
      std::vector<float> row(kLatentDim);
      for (int d = 0; d < kKvLoraRank; ++d) row[size_t(d)] = p.k_nope.get(t * kKvLoraRank + d);
      for (int d = 0; d < kRopeDim; ++d) row[size_t(kKvLoraRank + d)] = p.k_pe.get(t * kRopeDim + d);
      pool.expect(r.slot, r.cached + i, row.data());
    }
  }
  p.out = nan_tensor(DType::kFP32, {t_count, heads, kKvLoraRank});
  p.lse = nan_tensor(DType::kFP32, {t_count, heads});
  p.req_pool_indices = test::int32_tensor(rpi, {batch});
  p.seq_lens = test::int32_tensor(seq_lens, {batch});
  p.out_cache_loc = test::int32_tensor(loc, {t_count});
  p.extend_seq_lens = test::int32_tensor(q_lens, {batch});
  p.positions = test::int32_tensor(positions, {t_count});
  p.seq_lens_cpu = seq_lens;
  p.extend_seq_lens_cpu = q_lens;
  return p;
}

// Causal absorbed attention of every query row (query i of a request sees cached + i + 1 keys).
Reference naive_absorbed(Pool& pool, const AbsorbedProblem& p) {
  Reference ref;
  ref.out.assign(size_t(p.num_tokens * p.heads * kKvLoraRank), 0.0);
  ref.lse.assign(size_t(p.num_tokens * p.heads), 0.0);
  int64_t t = 0;
  std::vector<double> q(kLatentDim);
  for (const Request& r : p.requests) {
    for (int i = 0; i < r.q_len; ++i, ++t) {
      for (int h = 0; h < p.heads; ++h) {
        for (int d = 0; d < kLatentDim; ++d) q[size_t(d)] = p.q.get((t * p.heads + h) * kLatentDim + d);
        naive_absorbed_row(pool.latent[size_t(r.slot)], r.cached + i + 1, q.data(),
                           &ref.out[size_t((t * p.heads + h) * kKvLoraRank)],
                           &ref.lse[size_t(t * p.heads + h)]);
      }
    }
  }
  return ref;
}

void expect_matches(const AbsorbedProblem& p, const Reference& ref, const std::string& label) {
  SCOPED_TRACE(label);
  EXPECT_TRUE(all_close(p.out.to_float(), ref.out, kOutAtol, kOutRtol));
  EXPECT_TRUE(all_close(p.lse.to_float(), ref.lse, kLseAtol, kLseRtol));
}

// Rows [row_begin, row_begin + rows) of a [T, H, D] tensor, flattened.
std::vector<float> rows_of(const HostTensor& t, int64_t row_begin, int64_t rows) {
  int64_t width = 1;
  for (size_t d = 1; d < t.shape.size(); ++d) width *= t.shape[d];
  std::vector<float> all = t.to_float();
  return std::vector<float>(all.begin() + row_begin * width, all.begin() + (row_begin + rows) * width);
}
std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---------------------------------------------------------------------------------------------
// DECODE

TEST(BackendDecode, MatchesNaiveForPageSizesAndHeads) {
  struct Case {
    int page_size, heads;
    std::vector<int> cached;
  };
  const Case cases[] = {{1, 12, {0, 5, 40}},       {2, 1, {1, 3}},       {16, 24, {16, 31, 1}},
                        {64, 128, {2, 9}},         {128, 3, {300, 127}}, {32, 8, {63, 64, 65, 0}},
                        {8, 96, {7}}};
  for (const Case& c : cases) {
    for (bool host_lengths : {true, false}) {
      std::mt19937_64 rng(uint64_t(c.page_size * 1000 + c.heads));
      Pool pool(c.page_size, 4 + 512 / c.page_size, 512, 6, DType::kFP16, rng());
      std::vector<Request> requests;
      for (size_t b = 0; b < c.cached.size(); ++b) requests.push_back({int(5 - b), c.cached[b], 1});
      AbsorbedProblem p = make_absorbed_problem(pool, requests, c.heads, DType::kFP16, rng);
      Backend backend(make_config(pool, c.heads));
      const ForwardBatch batch = p.batch(ForwardMode::kDecode, host_lengths);
      backend.init_forward_metadata(batch);
      EXPECT_EQ(backend.plan().max_blocks,
                padded_block_count(host_lengths ? *std::max_element(p.seq_lens_cpu.begin(), p.seq_lens_cpu.end())
                                                : pool.max_context_len,
                                   c.page_size));
      backend.forward_decode(batch, make_layer(pool), p.args());
      expect_matches(p, naive_absorbed(pool, p),
                     "page " + std::to_string(c.page_size) + " heads " + std::to_string(c.heads) +
                         (host_lengths ? " with" : " without") + " seq_lens_cpu");
    }
  }
}

TEST(BackendDecode, SplitQueryAndInt64IndicesMatchFusedQuery) {
  std::mt19937_64 rng(7);
  Pool pool(16, 64, 256, 4, DType::kBF16, 11);
  AbsorbedProblem p = make_absorbed_problem(pool, {{2, 20, 1}, {0, 47, 1}}, 5, DType::kBF16, rng);
  Backend backend(make_config(pool, 5, DType::kBF16));
  // int64 req_pool_indices / seq_lens, longer than the batch (the engine's static buffers).
  HostTensor rpi64(DType::kInt64, {3}), seq64(DType::kInt64, {3});
  for (int b = 0; b < 2; ++b) {
    rpi64.i64(b) = p.req_pool_indices.i32(b);
    seq64.i64(b) = p.seq_lens.i32(b);
  }
  rpi64.i64(2) = 999;
  seq64.i64(2) = 999;
  ForwardBatch batch = p.batch(ForwardMode::kDecode, false);
  batch.req_pool_indices = rpi64.view();
  batch.seq_lens = seq64.view();
  backend.init_forward_metadata(batch);
  HostTensor q_nope(DType::kBF16, {2, 5, kKvLoraRank}), q_pe(DType::kBF16, {2, 5, kRopeDim});
  for (int64_t row = 0; row < 10; ++row) {
    for (int d = 0; d < kKvLoraRank; ++d) q_nope.set(row * kKvLoraRank + d, p.q.get(row * kLatentDim + d));
    for (int d = 0; d < kRopeDim; ++d) q_pe.set(row * kRopeDim + d, p.q.get(row * kLatentDim + kKvLoraRank + d));
  }
  AbsorbedAttentionArgs args = p.args();
  args.q = TensorView{};
  args.q_nope = q_nope.view();
  args.q_pe = q_pe.view();
  backend.forward_decode(batch, make_layer(pool), args);
  expect_matches(p, naive_absorbed(pool, p), "split q, int64 indices");
}

TEST(BackendDecode, Fp8CacheMatchesNaive) {
  std::mt19937_64 rng(3);
  Pool pool(64, 16, 512, 3, DType::kFP8E4M3, 5, /*k_scale=*/0.5f);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 70, 1}, {1, 3, 1}, {2, 128, 1}}, 16,
                                            DType::kBF16, rng);
  BackendConfig config = make_config(pool, 16, DType::kBF16);
  Backend backend(config);
  const ForwardBatch batch = p.batch(ForwardMode::kDecode);
  backend.init_forward_metadata(batch);
  backend.forward_decode(batch, make_layer(pool), p.args());
  expect_matches(p, naive_absorbed(pool, p), "fp8 cache, k_scale 0.5");
}

// The rope path: inputs before rope give the same result as inputs roped by hand (NeoX).
TEST(BackendDecode, RopePathEqualsPreRopedInputs) {
  std::mt19937_64 rng(21);
  const int heads = 4, max_position = 64;
  Pool pool(8, 64, 128, 3, DType::kFP16, 9);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 10, 1}, {1, 33, 1}}, heads, DType::kFP16, rng);
  HostTensor cos_sin(DType::kFP32, {max_position, kRopeDim});
  for (int pos = 0; pos < max_position; ++pos)
    for (int i = 0; i < kRopeDim / 2; ++i) {
      const double angle = pos * std::pow(10000.0, -2.0 * i / kRopeDim);
      cos_sin.set(pos * kRopeDim + i, float(std::cos(angle)));
      cos_sin.set(pos * kRopeDim + kRopeDim / 2 + i, float(std::sin(angle)));
    }
  // Pre-rope inputs: q as drawn (its rope part is "before rope"), k in fp16.
  HostTensor q_raw = p.q;
  HostTensor k_nope16(DType::kFP16, {2, kKvLoraRank}), k_pe16(DType::kFP16, {2, kRopeDim});
  for (int64_t i = 0; i < k_nope16.numel(); ++i) k_nope16.set(i, p.k_nope.get(i));
  for (int64_t i = 0; i < k_pe16.numel(); ++i) k_pe16.set(i, p.k_pe.get(i));
  // Rope by hand (float64, rounded to fp16 as rope_quantize's outputs are).
  auto rope = [&](const HostTensor& src, int64_t offset, int pos, HostTensor& dst) {
    for (int i = 0; i < kRopeDim / 2; ++i) {
      const double c = cos_sin.get(pos * kRopeDim + i), s = cos_sin.get(pos * kRopeDim + kRopeDim / 2 + i);
      const double x1 = src.get(offset + i), x2 = src.get(offset + i + kRopeDim / 2);
      dst.set(offset + i, float(x1 * c - x2 * s));
      dst.set(offset + i + kRopeDim / 2, float(x2 * c + x1 * s));
    }
  };
  for (int t = 0; t < 2; ++t) {
    const int pos = p.positions.i32(t);
    for (int h = 0; h < heads; ++h) rope(q_raw, (int64_t(t) * heads + h) * kLatentDim + kKvLoraRank, pos, p.q);
    HostTensor k_pe_roped = k_pe16;
    rope(k_pe16, int64_t(t) * kRopeDim, pos, k_pe_roped);
    std::vector<float> row(kLatentDim);
    for (int d = 0; d < kKvLoraRank; ++d) row[size_t(d)] = k_nope16.get(int64_t(t) * kKvLoraRank + d);
    for (int d = 0; d < kRopeDim; ++d) row[size_t(kKvLoraRank + d)] = k_pe_roped.get(int64_t(t) * kRopeDim + d);
    pool.expect(p.requests[size_t(t)].slot, p.requests[size_t(t)].cached, row.data());
  }
  Backend backend(make_config(pool, heads));
  const ForwardBatch batch = p.batch(ForwardMode::kDecode);
  backend.init_forward_metadata(batch);
  AbsorbedAttentionArgs args = p.args();
  args.q = q_raw.view();
  args.k_nope = k_nope16.view();
  args.k_pe = k_pe16.view();
  args.cos_sin_cache = cos_sin.view();
  args.rope_style = RopeStyle::kNeox;
  backend.forward_decode(batch, make_layer(pool), args);
  // Roping in fp16 inside the library vs float64 here: a few fp16 ulps on the rope part.
  const Reference ref = naive_absorbed(pool, p);
  EXPECT_TRUE(all_close(p.out.to_float(), ref.out, 2e-3, 2e-3));
  EXPECT_TRUE(all_close(p.lse.to_float(), ref.lse, 2e-3, 2e-3));
}

// ---------------------------------------------------------------------------------------------
// TARGET_VERIFY and DRAFT_EXTEND

TEST(BackendTargetVerify, EqualsSequentialDecodeSteps) {
  for (int page_size : {1, 4, 64}) {
    std::mt19937_64 rng(static_cast<uint64_t>(page_size));
    const int heads = 6, k = 3;
    Pool pool(page_size, 8 + 512 / page_size, 256, 4, DType::kFP16, 100 + page_size);
    AbsorbedProblem verify =
        make_absorbed_problem(pool, {{3, 17, k}, {0, 0, k}, {1, 64, k}}, heads, DType::kFP16, rng);
    BackendConfig config = make_config(pool, heads);
    config.num_draft_tokens = k;
    Backend backend(config);
    const ForwardBatch batch = verify.batch(ForwardMode::kTargetVerify);
    backend.init_forward_metadata(batch);
    EXPECT_EQ(backend.plan().q_len, k);
    backend.forward_decode(batch, make_layer(pool), verify.args());
    expect_matches(verify, naive_absorbed(pool, verify), "target verify vs naive");

    // k DECODE steps, step i appending draft token i of every request.
    Backend decoder(make_config(pool, heads));
    for (int i = 0; i < k; ++i) {
      std::vector<Request> step;
      for (const Request& r : verify.requests) step.push_back({r.slot, r.cached + i, 1});
      AbsorbedProblem d = make_absorbed_problem(pool, step, heads, DType::kFP16, rng, false);
      for (size_t b = 0; b < step.size(); ++b) {
        const int64_t row = int64_t(b) * k + i;  // row of (request b, draft i) in the verify batch
        for (int64_t e = 0; e < heads * kLatentDim; ++e) d.q.set(int64_t(b) * heads * kLatentDim + e, verify.q.get(row * heads * kLatentDim + e));
        for (int e = 0; e < kKvLoraRank; ++e) d.k_nope.set(int64_t(b) * kKvLoraRank + e, verify.k_nope.get(row * kKvLoraRank + e));
        for (int e = 0; e < kRopeDim; ++e) d.k_pe.set(int64_t(b) * kRopeDim + e, verify.k_pe.get(row * kRopeDim + e));
      }
      const ForwardBatch decode_batch = d.batch(ForwardMode::kDecode);
      decoder.init_forward_metadata(decode_batch);
      decoder.forward_decode(decode_batch, make_layer(pool), d.args());
      for (size_t b = 0; b < step.size(); ++b) {
        const int64_t row = int64_t(b) * k + i;
        SCOPED_TRACE("page " + std::to_string(page_size) + " draft " + std::to_string(i));
        EXPECT_TRUE(all_close(rows_of(d.out, int64_t(b), 1), to_double(rows_of(verify.out, row, 1)), 1e-6, 1e-5));
        EXPECT_TRUE(all_close(rows_of(d.lse, int64_t(b), 1), to_double(rows_of(verify.lse, row, 1)), 1e-6, 1e-6));
      }
    }
  }
}

TEST(BackendDraftExtend, VariableLengthsEqualPerRequestRuns) {
  for (bool device_lengths : {true, false}) {
    std::mt19937_64 rng(device_lengths ? 1 : 2);
    const int heads = 12;
    Pool pool(16, 64, 256, 6, DType::kFP16, 77);
    const std::vector<Request> requests = {{4, 30, 2}, {1, 9, 0}, {0, 0, 3}, {5, 100, 1}, {2, 16, 4}};
    AbsorbedProblem all = make_absorbed_problem(pool, requests, heads, DType::kFP16, rng);
    BackendConfig config = make_config(pool, heads);
    config.num_draft_tokens = 4;
    Backend backend(config);
    ForwardBatch batch = all.batch(ForwardMode::kDraftExtend);
    if (device_lengths) batch.extend_seq_lens_cpu = {};  // q offsets from the device tensor
    else batch.extend_seq_lens = TensorView{};           // from the host lengths
    backend.init_forward_metadata(batch);
    EXPECT_EQ(backend.plan().num_tokens, device_lengths ? -1 : all.num_tokens);
    backend.forward_decode(batch, make_layer(pool), all.args());
    expect_matches(all, naive_absorbed(pool, all), device_lengths ? "device q lengths" : "host q lengths");

    int64_t row = 0;
    for (const Request& r : requests) {
      if (r.q_len > 0) {
        AbsorbedProblem one = make_absorbed_problem(pool, {r}, heads, DType::kFP16, rng, false);
        for (int64_t e = 0; e < one.q.numel(); ++e) one.q.set(e, all.q.get(row * heads * kLatentDim + e));
        for (int64_t e = 0; e < one.k_nope.numel(); ++e) one.k_nope.set(e, all.k_nope.get(row * kKvLoraRank + e));
        for (int64_t e = 0; e < one.k_pe.numel(); ++e) one.k_pe.set(e, all.k_pe.get(row * kRopeDim + e));
        Backend single(config);
        const ForwardBatch one_batch = one.batch(ForwardMode::kDraftExtend);
        single.init_forward_metadata(one_batch);
        single.forward_decode(one_batch, make_layer(pool), one.args());
        SCOPED_TRACE("request slot " + std::to_string(r.slot));
        EXPECT_TRUE(all_close(one.out.to_float(), to_double(rows_of(all.out, row, r.q_len)), 1e-6, 1e-5));
        EXPECT_TRUE(all_close(one.lse.to_float(), to_double(rows_of(all.lse, row, r.q_len)), 1e-6, 1e-6));
      }
      row += r.q_len;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Page size and page scattering do not change results; IDLE and empty rows never produce NaN.

TEST(BackendInvariance, ResultsDoNotDependOnPageSizeOrScattering) {
  const int heads = 7;
  const std::vector<int> cached = {45, 1, 130, 0};
  std::vector<float> reference_out, reference_lse;
  for (int page_size = 1; page_size <= 128; page_size *= 2) {
    for (uint64_t scatter_seed : {1u, 2u}) {
      std::mt19937_64 rng(2024);  // same logical data for every pool
      Pool pool(page_size, 8 + 1024 / page_size, 512, 4, DType::kBF16, scatter_seed * 31 + page_size);
      std::vector<Request> requests;
      for (size_t b = 0; b < cached.size(); ++b) requests.push_back({int(b), cached[b], 2});
      AbsorbedProblem p = make_absorbed_problem(pool, requests, heads, DType::kBF16, rng);
      BackendConfig config = make_config(pool, heads, DType::kBF16);
      config.num_draft_tokens = 2;
      Backend backend(config);
      const ForwardBatch batch = p.batch(ForwardMode::kTargetVerify);
      backend.init_forward_metadata(batch);
      backend.forward_decode(batch, make_layer(pool), p.args());
      if (reference_out.empty()) {
        expect_matches(p, naive_absorbed(pool, p), "page 1");
        reference_out = p.out.to_float();
        reference_lse = p.lse.to_float();
        continue;
      }
      SCOPED_TRACE("page " + std::to_string(page_size) + " scatter " + std::to_string(scatter_seed));
      EXPECT_TRUE(all_close(p.out.to_float(), to_double(reference_out), 1e-6, 1e-6));
      EXPECT_TRUE(all_close(p.lse.to_float(), to_double(reference_lse), 1e-6, 1e-6));
    }
  }
}

TEST(BackendIdle, PlanAndForwardsDoNothing) {
  Pool pool(16, 8, 64, 2, DType::kBF16, 1);
  BackendConfig config = make_config(pool, 4, DType::kBF16);
  Backend backend(config);
  ForwardBatch idle;
  idle.mode = ForwardMode::kIdle;
  backend.init_forward_metadata(idle);
  EXPECT_EQ(backend.plan().mode, ForwardMode::kIdle);
  EXPECT_EQ(backend.plan().batch_size, 0);
  const LayerParams layer = make_layer(pool);
  backend.forward_decode(idle, layer, AbsorbedAttentionArgs{});
  backend.forward_extend_absorbed(idle, layer, AbsorbedAttentionArgs{});
  backend.forward_extend(idle, layer, MhaAttentionArgs{});
  backend.forward_prefix_chunk(idle, 0, layer, MhaAttentionArgs{});
  backend.forward_extend_chunked(idle, layer, MhaAttentionArgs{}, nullptr);
  backend.save_latent_kv(idle, layer, TensorView{}, TensorView{});
  EXPECT_EQ(backend.num_prefix_chunks(), 0);
  // A decode-family batch of 0 requests plans and runs too.
  ForwardBatch empty;
  empty.mode = ForwardMode::kDecode;
  backend.init_forward_metadata(empty);
  HostTensor q(DType::kBF16, {0, 4, kLatentDim}), out(DType::kFP32, {0, 4, kKvLoraRank});
  AbsorbedAttentionArgs args;
  args.q = q.view();
  args.out = out.view();
  args.save_kv_cache = false;
  backend.forward_decode(empty, layer, args);
  // The multi-step backend as well.
  MultiStepDraftBackend draft(3, config);
  draft.init_forward_metadata(idle);
  draft.step(1).forward_decode(idle, layer, AbsorbedAttentionArgs{});
}

TEST(BackendEmptyRows, ZeroLengthRowsGiveZeroAndMinusInfNeverNaN) {
  std::mt19937_64 rng(5);
  const int heads = 3;
  Pool pool(4, 64, 128, 4, DType::kFP16, 8);
  // DECODE row with no keys at all (seq_len 0, nothing saved), next to normal rows.
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 5, 1}, {1, 0, 1}, {2, 9, 1}}, heads, DType::kFP16, rng);
  p.seq_lens.i32(1) = 0;
  p.seq_lens_cpu[1] = 0;
  Backend backend(make_config(pool, heads));
  const ForwardBatch batch = p.batch(ForwardMode::kDecode);
  backend.init_forward_metadata(batch);
  // Save only rows 0 and 2 (loc -1 skips row 1).
  p.out_cache_loc.i32(1) = -1;
  backend.forward_decode(batch, make_layer(pool), p.args());
  Reference ref = naive_absorbed(pool, p);
  for (int h = 0; h < heads; ++h) {
    std::fill_n(ref.out.begin() + (1 * heads + h) * kKvLoraRank, kKvLoraRank, 0.0);
    ref.lse[size_t(heads + h)] = -kInf;
  }
  expect_matches(p, ref, "decode with an empty row");
  for (float v : p.out.to_float()) ASSERT_FALSE(std::isnan(v));

  // DRAFT_EXTEND: a request with 0 queries and one whose queries outnumber its keys.
  AbsorbedProblem d = make_absorbed_problem(pool, {{3, 2, 2}, {0, 6, 0}}, heads, DType::kFP16, rng);
  d.seq_lens.i32(0) = 1;  // 2 queries over 1 key: the first sees nothing
  d.seq_lens_cpu[0] = 1;
  BackendConfig config = make_config(pool, heads);
  Backend draft(config);
  const ForwardBatch draft_batch = d.batch(ForwardMode::kDraftExtend);
  draft.init_forward_metadata(draft_batch);
  draft.forward_decode(draft_batch, make_layer(pool), d.args(false));
  const std::vector<float> out = d.out.to_float(), lse = d.lse.to_float();
  for (float v : out) ASSERT_FALSE(std::isnan(v));
  for (int h = 0; h < heads; ++h) {
    EXPECT_EQ(lse[size_t(h)], -std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isfinite(lse[size_t(heads + h)]));
    for (int e = 0; e < kKvLoraRank; ++e) EXPECT_EQ(out[size_t(h * kKvLoraRank + e)], 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// CUDA-graph fixed buffers

TEST(BackendGraph, ReplayWithNewBatchesEqualsEagerPlanning) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    std::mt19937_64 rng(uint64_t(mode) + 40);
    const int heads = 8, k = mode == ForwardMode::kDecode ? 1 : 2, max_bs = 4;
    Pool pool(32, 96, 384, 8, DType::kFP16, 55);
    BackendConfig config = make_config(pool, heads);
    config.num_draft_tokens = 2;
    Backend graph(config), eager(config);
    graph.init_cuda_graph_state(max_bs, int64_t(max_bs) * k);
    // Capture at max_bs with some batch.
    AbsorbedProblem capture = make_absorbed_problem(
        pool, {{0, 10, k}, {1, 20, k}, {2, 30, k}, {3, 40, k}}, heads, DType::kFP16, rng);
    graph.init_forward_metadata_capture_cuda_graph(max_bs, capture.num_tokens,
                                                   capture.req_pool_indices.view(),
                                                   capture.seq_lens.view(), mode);
    const Plan captured = graph.plan();
    EXPECT_TRUE(captured.fixed_buffers);
    EXPECT_EQ(captured.max_blocks, padded_block_count(pool.max_context_len, pool.page_size));
    graph.forward_decode(capture.batch(mode), make_layer(pool), capture.args());
    expect_matches(capture, naive_absorbed(pool, capture), "capture");

    // Replays: smaller batches, new lengths, new request slots (new pages).
    const std::vector<std::vector<Request>> replays = {
        {{4, 300, k}, {5, 1, k}}, {{6, 77, k}, {7, 150, k}, {2, 31, k}}, {{1, 0, k}}};
    for (const std::vector<Request>& requests : replays) {
      AbsorbedProblem p = make_absorbed_problem(pool, requests, heads, DType::kFP16, rng);
      const int bs = int(requests.size());
      // The engine's static buffers are max_bs long; only the first bs entries count.
      HostTensor rpi(DType::kInt32, {max_bs}), seq(DType::kInt32, {max_bs});
      for (int b = 0; b < max_bs; ++b) {
        rpi.i32(b) = b < bs ? p.req_pool_indices.i32(b) : 0;
        seq.i32(b) = b < bs ? p.seq_lens.i32(b) : 1;
      }
      graph.init_forward_metadata_replay_cuda_graph(bs, rpi.view(), seq.view(), mode);
      EXPECT_EQ(graph.plan().block_table.data, captured.block_table.data);
      EXPECT_EQ(graph.plan().kv_lens.data, captured.kv_lens.data);
      graph.forward_decode(p.batch(mode, false), make_layer(pool), p.args());
      const std::vector<float> graph_out = p.out.to_float(), graph_lse = p.lse.to_float();
      expect_matches(p, naive_absorbed(pool, p), "replay vs naive");

      // Same batch, eager planning (same q lengths for every request, like the graph).
      p.poison_outputs();
      ForwardBatch batch = p.batch(mode);
      eager.init_forward_metadata(batch);
      eager.forward_decode(batch, make_layer(pool), p.args());
      SCOPED_TRACE(std::string(forward_mode_name(mode)) + " bs " + std::to_string(bs));
      EXPECT_TRUE(all_close(p.out.to_float(), to_double(graph_out), 1e-6, 1e-6));
      EXPECT_TRUE(all_close(p.lse.to_float(), to_double(graph_lse), 1e-6, 1e-6));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-step drafting

TEST(BackendMultiStep, StepsEqualIndependentBackends) {
  for (bool graph_mode : {false, true}) {
    std::mt19937_64 rng(graph_mode ? 8 : 9);
    const int heads = 4, num_steps = 4;
    Pool pool(8, 128, 256, 4, DType::kFP16, 3);
    BackendConfig config = make_config(pool, heads);
    MultiStepDraftBackend draft(num_steps, config);
    ASSERT_EQ(draft.num_step_backends(), num_steps - 1);
    const std::vector<int> cached = {12, 0, 63};
    std::vector<Request> base;
    for (size_t b = 0; b < cached.size(); ++b) base.push_back({int(b), cached[b], 1});
    // Every step's draft token is in the pool before planning (step i appends token cached + i).
    for (const Request& r : base) pool.reserve(r.slot, r.cached + num_steps);
    AbsorbedProblem first = make_absorbed_problem(pool, base, heads, DType::kFP16, rng);
    // The engine passes the same batch (step 0's seq_lens) to every step.
    const HostTensor base_rpi = first.req_pool_indices, base_seq = first.seq_lens;
    if (graph_mode) {
      draft.init_cuda_graph_state(4, 4);
      draft.init_forward_metadata_capture_cuda_graph(3, 3, first.req_pool_indices.view(),
                                                     first.seq_lens.view());
    } else {
      draft.init_forward_metadata(first.batch(ForwardMode::kDecode));
    }
    EXPECT_EQ(draft.step(0).workspace(), draft.step(2).workspace());
    EXPECT_EQ(draft.step(0).plan().block_table.data, draft.step(2).plan().block_table.data);
    for (int i = 0; i < num_steps - 1; ++i) {
      std::vector<Request> step = base;
      for (Request& r : step) r.cached += i;
      // Step i's queries and the latent of draft token i (step 0's were drawn above).
      AbsorbedProblem p = i == 0 ? std::move(first)
                                 : make_absorbed_problem(pool, step, heads, DType::kFP16, rng, false);
      HostTensor rpi = base_rpi, seq = base_seq;
      ForwardBatch batch = p.batch(ForwardMode::kDecode, false);
      batch.req_pool_indices = rpi.view();
      batch.seq_lens = seq.view();
      draft.step(i).forward_decode(batch, make_layer(pool), p.args());
      expect_matches(p, naive_absorbed(pool, p), "draft step vs naive");
      const std::vector<float> step_out = p.out.to_float(), step_lse = p.lse.to_float();

      p.poison_outputs();
      Backend independent(config);
      const ForwardBatch own = p.batch(ForwardMode::kDecode);
      independent.init_forward_metadata(own);
      independent.forward_decode(own, make_layer(pool), p.args(false));
      SCOPED_TRACE(std::string(graph_mode ? "graph" : "eager") + " step " + std::to_string(i));
      EXPECT_TRUE(all_close(step_out, to_double(p.out.to_float()), 1e-6, 1e-6));
      EXPECT_TRUE(all_close(step_lse, to_double(p.lse.to_float()), 1e-6, 1e-6));
    }
  }
}

}  // namespace
}  // namespace mla
