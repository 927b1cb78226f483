// mla::Backend and mla::MultiStepDraftBackend against float64 naive attention written here over
// the logical sequences (never through the library's ops): DECODE, TARGET_VERIFY, DRAFT_EXTEND,
// EXTEND (chunked prefix and absorbed), CUDA-graph fixed buffers, multi-step drafting, the
// DP-padding re-plan, IDLE / empty rows, and argument errors.
//
// Pools have their pages handed out in random order and every unused entry holds NaN, so a
// wrong page id or a read past a sequence shows up as NaN or a mismatch.
#include <algorithm>
#include <climits>
#include <cstring>
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

// All that save_latent_kv and gather_prefix_chunk read: no softmax scale.
LayerParams cache_only(Pool& pool) {
  LayerParams layer;
  layer.kv_cache = pool.cache_view();
  layer.k_scale = pool.k_scale;
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
  // An int64 length that int32 cannot hold is an error naming it, not a length cut to 32 bits.
  seq64.i64(1) = (int64_t(1) << 32) + 47;
  EXPECT_TRUE(throws_error([&] { backend.init_forward_metadata(batch); }, {"batch.seq_lens[1] = 4294967343"}));
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

  // The workspace this path needs: absorbed_workspace_bytes is enough, a byte less is not.
  BackendConfig sized = make_config(pool, heads);
  sized.workspace_bytes = Backend::absorbed_workspace_bytes(sized, 2);
  Backend exact(sized);
  exact.init_forward_metadata(batch);
  EXPECT_NO_THROW(exact.forward_decode(batch, make_layer(pool), args));
  sized.workspace_bytes -= 1;
  Backend short_by_one(sized);
  short_by_one.init_forward_metadata(batch);
  EXPECT_TRUE(throws_error([&] { short_by_one.forward_decode(batch, make_layer(pool), args); },
                           {"workspace", "too small", "absorbed_workspace_bytes"}));
  EXPECT_TRUE(throws_error([&] { Backend::absorbed_workspace_bytes(sized, -1); },
                           {"absorbed_workspace_bytes", "num_tokens must be >= 0"}));
  EXPECT_TRUE(throws_error([&] { Backend::chunked_extend_workspace_bytes(sized, -1); },
                           {"chunked_extend_workspace_bytes", "num_tokens must be >= 0"}));
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

// A DRAFT_EXTEND graph captured at num_draft_tokens rows a request, replayed with the accepted
// tokens of each request packed at the front (extend_seq_lens): the accepted rows match the
// naive and an eager plan of the exact batch, the rows past them come out 0 / -inf (they hold
// NaN before, and so do the padding queries). A replay without extend_seq_lens runs every
// request's num_draft_tokens rows in the same buffers.
TEST(BackendGraph, DraftExtendReplaysPackTheAcceptedQueries) {
  std::mt19937_64 rng(77);
  const int heads = 8, k = 3, max_bs = 4;
  Pool pool(16, 64, 256, 9, DType::kFP16, 56);
  BackendConfig config = make_config(pool, heads);
  config.num_draft_tokens = k;
  Backend graph(config), eager(config);
  graph.init_cuda_graph_state(max_bs, int64_t(max_bs) * k);
  const LayerParams layer = make_layer(pool);
  HostTensor q_lens(DType::kInt64, {max_bs});
  for (int b = 0; b < max_bs; ++b) q_lens.i64(b) = k;
  {
    AbsorbedProblem capture = make_absorbed_problem(
        pool, {{0, 5, k}, {1, 9, k}, {2, 1, k}, {3, 40, k}}, heads, DType::kFP16, rng);
    graph.init_forward_metadata_capture_cuda_graph(max_bs, capture.num_tokens,
                                                   capture.req_pool_indices.view(),
                                                   capture.seq_lens.view(), ForwardMode::kDraftExtend,
                                                   nullptr, q_lens.view());
    EXPECT_FALSE(graph.plan().cu_q_lens.empty());
    EXPECT_EQ(graph.plan().max_q_len, k);
    graph.forward_decode(capture.batch(ForwardMode::kDraftExtend, false), layer, capture.args());
    expect_matches(capture, naive_absorbed(pool, capture), "capture");
  }
  const void* captured_cu_q_lens = graph.plan().cu_q_lens.data;

  struct Replay {
    std::vector<Request> requests;
    bool with_lengths;
  };
  const Replay replays[] = {
      {{{4, 30, 1}, {5, 0, 3}, {6, 17, 0}}, true},      // a request with none accepted
      {{{7, 63, 2}, {8, 100, 2}, {1, 2, 1}, {2, 64, 3}}, true},
      {{{3, 11, 0}, {0, 20, 0}}, true},                 // every row is padding
      {{{4, 12, k}, {5, 33, k}}, false},                // no lengths: num_draft_tokens each
  };
  for (const Replay& replay : replays) {
    AbsorbedProblem p = make_absorbed_problem(pool, replay.requests, heads, DType::kFP16, rng);
    const int bs = int(replay.requests.size());
    const int64_t rows = int64_t(bs) * k, accepted = p.num_tokens;
    SCOPED_TRACE("bs " + std::to_string(bs) + ", " + std::to_string(accepted) + " accepted rows");
    // The new tokens' latents go in first (the graph's forward does not save them here: the
    // padding rows have no cache slots).
    graph.save_latent_kv(p.batch(ForwardMode::kDraftExtend), layer, p.k_nope.view(), p.k_pe.view());
    // The graph's static buffers: bs x k query rows, the accepted ones first, NaN after.
    HostTensor q = nan_tensor(DType::kFP16, {rows, heads, kLatentDim});
    for (int64_t i = 0; i < accepted * heads * kLatentDim; ++i) q.set(i, p.q.get(i));
    HostTensor out = nan_tensor(DType::kFP32, {rows, heads, kKvLoraRank});
    HostTensor lse = nan_tensor(DType::kFP32, {rows, heads});
    HostTensor lens(DType::kInt32, {max_bs});
    for (int b = 0; b < max_bs; ++b) lens.i32(b) = b < bs ? replay.requests[size_t(b)].q_len : 5;
    graph.init_forward_metadata_replay_cuda_graph(bs, p.req_pool_indices.view(), p.seq_lens.view(),
                                                  ForwardMode::kDraftExtend, nullptr,
                                                  replay.with_lengths ? lens.view() : TensorView{});
    EXPECT_EQ(graph.plan().cu_q_lens.data, captured_cu_q_lens);
    EXPECT_EQ(graph.plan().num_tokens, rows);
    ForwardBatch batch = p.batch(ForwardMode::kDraftExtend, false);
    batch.extend_seq_lens = {};  // the graph's offsets come from the replay call
    AbsorbedAttentionArgs args = p.args(false);
    args.q = q.view();
    args.out = out.view();
    args.lse = lse.view();
    graph.forward_decode(batch, layer, args);

    const std::vector<float> o = out.to_float(), l = lse.to_float();
    for (int64_t i = accepted * heads * kKvLoraRank; i < rows * heads * kKvLoraRank; ++i)
      ASSERT_EQ(o[size_t(i)], 0.0f) << "padding output element " << i;
    for (int64_t i = accepted * heads; i < rows * heads; ++i)
      ASSERT_EQ(l[size_t(i)], -std::numeric_limits<float>::infinity()) << "padding lse " << i;
    for (int64_t i = 0; i < accepted * heads * kKvLoraRank; ++i) p.out.set(i, o[size_t(i)]);
    for (int64_t i = 0; i < accepted * heads; ++i) p.lse.set(i, l[size_t(i)]);
    expect_matches(p, naive_absorbed(pool, p), "replay vs naive");

    // The exact batch planned eagerly gives the same rows.
    p.poison_outputs();
    const ForwardBatch exact = p.batch(ForwardMode::kDraftExtend);
    eager.init_forward_metadata(exact);
    eager.forward_decode(exact, layer, p.args(false));
    EXPECT_TRUE(all_close(rows_of(p.out, 0, accepted), to_double(rows_of(out, 0, accepted)), 0, 0));
    EXPECT_TRUE(all_close(rows_of(p.lse, 0, accepted), to_double(rows_of(lse, 0, accepted)), 0, 0));
  }
}

TEST(BackendGraph, DraftExtendLengthsAreChecked) {
  std::mt19937_64 rng(78);
  const int heads = 4, k = 2;
  Pool pool(16, 16, 128, 3, DType::kFP16, 57);
  BackendConfig config = make_config(pool, heads);
  config.num_draft_tokens = k;
  Backend graph(config);
  graph.init_cuda_graph_state(2, 4);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 5, 1}, {1, 9, 1}}, heads, DType::kFP16, rng);
  HostTensor over = test::int32_tensor({1, 3}, {2});
  EXPECT_TRUE(throws_error(
      [&] {
        graph.init_forward_metadata_replay_cuda_graph(2, p.req_pool_indices.view(), p.seq_lens.view(),
                                                      ForwardMode::kDraftExtend, nullptr, over.view());
      },
      {"extend_seq_lens[1] = 3", "queries per request, 2"}));
  EXPECT_FALSE(graph.has_plan());
  HostTensor negative = test::int32_tensor({-1, 1}, {2});
  EXPECT_TRUE(throws_error(
      [&] {
        graph.init_forward_metadata_replay_cuda_graph(2, p.req_pool_indices.view(), p.seq_lens.view(),
                                                      ForwardMode::kDraftExtend, nullptr, negative.view());
      },
      {"extend_seq_lens[0] = -1"}));
  HostTensor one = test::int32_tensor({1}, {1});
  EXPECT_TRUE(throws_error(
      [&] {
        graph.init_forward_metadata_replay_cuda_graph(2, p.req_pool_indices.view(), p.seq_lens.view(),
                                                      ForwardMode::kDraftExtend, nullptr, one.view());
      },
      {"extend_seq_lens"}));
  EXPECT_TRUE(throws_error(
      [&] {
        graph.init_forward_metadata_capture_cuda_graph(2, 2, p.req_pool_indices.view(), p.seq_lens.view(),
                                                       ForwardMode::kDecode, nullptr, p.extend_seq_lens.view());
      },
      {"extend_seq_lens is for DRAFT_EXTEND graphs", "DECODE"}));
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

// ---------------------------------------------------------------------------------------------
// EXTEND

float round_to(DType dtype, double x) {
  unsigned char storage[8] = {};
  store_from_float(storage, dtype, 0, float(x));
  return load_as_float(storage, dtype, 0);
}

// The test model's up-projections, per head: k_nope = W_UK c (128), v = W_UV c (128), with c the
// 512-wide c_kv; the key's rope part is the cached k_pe.
struct UpProjection {
  int heads;
  std::vector<double> w_uk, w_uv;  // [H, 128, 512]
  UpProjection(int h, std::mt19937_64& rng) : heads(h) {
    const double bound = 1.0 / std::sqrt(double(kKvLoraRank));
    std::uniform_real_distribution<double> dist(-bound, bound);
    w_uk.resize(size_t(h) * 128 * kKvLoraRank);
    w_uv.resize(w_uk.size());
    for (double& w : w_uk) w = dist(rng);
    for (double& w : w_uv) w = dist(rng);
  }
  // k [H, 192] and v [H, 128] of one latent row (576 dequantised values), rounded to `dtype`.
  void project(const float* latent, DType dtype, float* k, float* v) const {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < 128; ++i) {
        const double* uk = &w_uk[(size_t(h) * 128 + size_t(i)) * kKvLoraRank];
        const double* uv = &w_uv[(size_t(h) * 128 + size_t(i)) * kKvLoraRank];
        double sk = 0, sv = 0;
        for (int d = 0; d < kKvLoraRank; ++d) {
          sk += uk[d] * latent[d];
          sv += uv[d] * latent[d];
        }
        k[h * 192 + i] = round_to(dtype, sk);
        v[h * 128 + i] = round_to(dtype, sv);
      }
      for (int j = 0; j < kRopeDim; ++j) k[h * 192 + 128 + j] = round_to(dtype, latent[kKvLoraRank + j]);
    }
  }
};

struct ExtendProblem {
  int heads = 0;
  std::vector<int> slots, prefix, extend;
  int64_t num_tokens = 0;
  HostTensor q, k, v;        // MHA: [T, H, 192], [T, H, 192], [T, H, 128] (new tokens)
  HostTensor q_abs;          // absorbed: [T, H, 576] = (W_UK^T q_nope | q_pe)
  HostTensor k_nope, k_pe;   // the new tokens' latents, fp32
  HostTensor out, lse;       // [T, H, 128], [T, H]
  HostTensor out_abs, lse_abs;  // [T, H, 512], [T, H]
  HostTensor req_pool_indices, seq_lens, out_cache_loc;
  std::vector<int32_t> seq_lens_cpu, extend_cpu, prefix_cpu;

  ForwardBatch batch() {
    ForwardBatch b;
    b.mode = ForwardMode::kExtend;
    b.batch_size = int(slots.size());
    b.req_pool_indices = req_pool_indices.view();
    b.seq_lens = seq_lens.view();
    b.out_cache_loc = out_cache_loc.view();
    b.seq_lens_cpu = seq_lens_cpu;
    b.extend_seq_lens_cpu = extend_cpu;
    b.extend_prefix_lens_cpu = prefix_cpu;
    return b;
  }
  MhaAttentionArgs mha_args() {
    MhaAttentionArgs a;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.out = out.view();
    a.lse = lse.view();
    return a;
  }
  AbsorbedAttentionArgs absorbed_args() {
    AbsorbedAttentionArgs a;
    a.q = q_abs.view();
    a.k_nope = k_nope.view();
    a.k_pe = k_pe.view();
    a.out = out_abs.view();
    a.lse = lse_abs.view();
    return a;
  }
};

ExtendProblem make_extend_problem(Pool& pool, const UpProjection& proj, std::vector<int> slots,
                                  std::vector<int> prefix, std::vector<int> extend,
                                  std::mt19937_64& rng) {
  const DType dtype = DType::kFP16;
  const int heads = proj.heads;
  ExtendProblem p;
  p.heads = heads;
  p.slots = slots;
  p.prefix = prefix;
  p.extend = extend;
  for (int e : extend) p.num_tokens += e;
  const int64_t t_count = p.num_tokens;
  const int batch = int(slots.size());
  p.q = tensor_from(dtype, {t_count, heads, 192}, random_values(rng, t_count * heads * 192));
  p.k = HostTensor(dtype, {t_count, heads, 192});
  p.v = HostTensor(dtype, {t_count, heads, 128});
  p.k_nope = tensor_from(DType::kFP32, {t_count, kKvLoraRank}, random_values(rng, t_count * kKvLoraRank));
  p.k_pe = tensor_from(DType::kFP32, {t_count, kRopeDim}, random_values(rng, t_count * kRopeDim));
  std::vector<int32_t> loc;
  std::vector<float> k_row(size_t(heads) * 192), v_row(size_t(heads) * 128);
  int64_t t = 0;
  for (int b = 0; b < batch; ++b) {
    const int slot = slots[size_t(b)];
    pool.reserve(slot, prefix[size_t(b)] + extend[size_t(b)]);
    for (int pos = 0; pos < prefix[size_t(b)]; ++pos) pool.write(slot, pos, random_values(rng, kLatentDim).data());
    for (int i = 0; i < extend[size_t(b)]; ++i, ++t) {
      const int pos = prefix[size_t(b)] + i;
      std::vector<float> row(kLatentDim);
      for (int d = 0; d < kKvLoraRank; ++d) row[size_t(d)] = p.k_nope.get(t * kKvLoraRank + d);
      for (int d = 0; d < kRopeDim; ++d) row[size_t(kKvLoraRank + d)] = p.k_pe.get(t * kRopeDim + d);
      pool.expect(slot, pos, row.data());
      loc.push_back(pool.slot(slot, pos));
      // The new token's MHA key and value, from its latent as the cache will hold it.
      proj.project(pool.latent[size_t(slot)][size_t(pos)].data(), dtype, k_row.data(), v_row.data());
      for (int e = 0; e < heads * 192; ++e) p.k.set(t * heads * 192 + e, k_row[size_t(e)]);
      for (int e = 0; e < heads * 128; ++e) p.v.set(t * heads * 128 + e, v_row[size_t(e)]);
    }
    p.seq_lens_cpu.push_back(prefix[size_t(b)] + extend[size_t(b)]);
    p.extend_cpu.push_back(extend[size_t(b)]);
    p.prefix_cpu.push_back(prefix[size_t(b)]);
  }
  // Absorbed queries: q_nope folded through W_UK, q_pe as is.
  p.q_abs = HostTensor(dtype, {t_count, heads, kLatentDim});
  for (int64_t row = 0; row < t_count; ++row)
    for (int h = 0; h < heads; ++h) {
      const int64_t q_base = (row * heads + h) * 192, a_base = (row * heads + h) * kLatentDim;
      for (int d = 0; d < kKvLoraRank; ++d) {
        double sum = 0;
        for (int i = 0; i < 128; ++i)
          sum += proj.w_uk[(size_t(h) * 128 + size_t(i)) * kKvLoraRank + size_t(d)] * p.q.get(q_base + i);
        p.q_abs.set(a_base + d, float(sum));
      }
      for (int j = 0; j < kRopeDim; ++j) p.q_abs.set(a_base + kKvLoraRank + j, p.q.get(q_base + 128 + j));
    }
  p.out = nan_tensor(DType::kFP32, {t_count, heads, 128});
  p.lse = nan_tensor(DType::kFP32, {t_count, heads});
  p.out_abs = nan_tensor(DType::kFP32, {t_count, heads, kKvLoraRank});
  p.lse_abs = nan_tensor(DType::kFP32, {t_count, heads});
  std::vector<int32_t> rpi(slots.begin(), slots.end());
  p.req_pool_indices = test::int32_tensor(rpi, {batch});
  p.seq_lens = test::int32_tensor(p.seq_lens_cpu, {batch});
  p.out_cache_loc = test::int32_tensor(loc, {t_count});
  return p;
}

// One-shot causal MHA over prefix + extend: new token i of request b sees positions
// 0 .. prefix_b + i, with keys and values up-projected from the cached latents.
Reference naive_mha(Pool& pool, const UpProjection& proj, const ExtendProblem& p) {
  const int heads = p.heads;
  Reference ref;
  ref.out.assign(size_t(p.num_tokens * heads * 128), 0.0);
  ref.lse.assign(size_t(p.num_tokens * heads), 0.0);
  int64_t t = 0;
  for (size_t b = 0; b < p.slots.size(); ++b) {
    const int len = p.prefix[b] + p.extend[b];
    std::vector<float> keys(size_t(len) * heads * 192), values(size_t(len) * heads * 128);
    for (int pos = 0; pos < len; ++pos)
      proj.project(pool.latent[size_t(p.slots[b])][size_t(pos)].data(), DType::kFP16,
                   &keys[size_t(pos) * heads * 192], &values[size_t(pos) * heads * 128]);
    for (int i = 0; i < p.extend[b]; ++i, ++t) {
      const int visible = p.prefix[b] + i + 1;
      for (int h = 0; h < heads; ++h) {
        std::vector<double> scores(static_cast<size_t>(visible));
        double max_score = -kInf;
        for (int j = 0; j < visible; ++j) {
          double s = 0;
          for (int d = 0; d < 192; ++d)
            s += double(p.q.get((t * heads + h) * 192 + d)) * keys[(size_t(j) * heads + size_t(h)) * 192 + size_t(d)];
          scores[size_t(j)] = s * kSoftmaxScale;
          max_score = std::max(max_score, scores[size_t(j)]);
        }
        double sum = 0;
        double* out = &ref.out[size_t((t * heads + h) * 128)];
        for (int j = 0; j < visible; ++j) {
          const double w = std::exp(scores[size_t(j)] - max_score);
          sum += w;
          for (int d = 0; d < 128; ++d) out[d] += w * values[(size_t(j) * heads + size_t(h)) * 128 + size_t(d)];
        }
        for (int d = 0; d < 128; ++d) out[d] /= sum;
        ref.lse[size_t(t * heads + h)] = max_score + std::log(sum);
      }
    }
  }
  return ref;
}

// The model's up-projection callback: reads the gathered latents, writes k and v.
UpProjectFn make_up_project(const UpProjection& proj, float k_scale, std::vector<int>* calls) {
  return [&proj, k_scale, calls](int chunk_idx, const TensorView& latent, const TensorView& k,
                                 const TensorView& v, Stream) {
    if (calls) calls->push_back(chunk_idx);
    const int heads = proj.heads;
    std::vector<float> row(kLatentDim), k_row(size_t(heads) * 192), v_row(size_t(heads) * 128);
    for (int64_t n = 0; n < latent.shape[0]; ++n) {
      for (int d = 0; d < kLatentDim; ++d)
        row[size_t(d)] = load_as_float(latent.data, latent.dtype, n * latent.stride[0] + d) *
                         (latent.dtype == DType::kFP8E4M3 ? k_scale : 1.0f);
      proj.project(row.data(), k.dtype, k_row.data(), v_row.data());
      for (int e = 0; e < heads * 192; ++e) store_from_float(k.data, k.dtype, n * heads * 192 + e, k_row[size_t(e)]);
      for (int e = 0; e < heads * 128; ++e) store_from_float(v.data, v.dtype, n * heads * 128 + e, v_row[size_t(e)]);
    }
  };
}

struct ExtendCase {
  int page_size;
  int64_t capacity;
  std::vector<int> prefix, extend;
};

TEST(BackendExtend, ChunkedPrefixEqualsOneShotNaiveAttention) {
  const ExtendCase cases[] = {
      {8, 7, {0, 9, 21, 5}, {4, 1, 6, 0}},   // chunk boundaries inside requests
      {1, 1000, {3, 17}, {2, 5}},            // one chunk
      {32, 10, {4, 6, 10}, {3, 3, 1}},       // capacity hit exactly by request ends
      {16, 5, {0, 0}, {5, 2}},               // no prefix: plain causal attention
      {128, 64, {130, 1}, {1, 9}},           // long prefix, several chunks of one request
  };
  for (const ExtendCase& c : cases) {
    std::mt19937_64 rng(uint64_t(c.page_size) * 7 + uint64_t(c.capacity));
    const int heads = 3;
    UpProjection proj(heads, rng);
    Pool pool(c.page_size, 8 + 1024 / c.page_size, 512, 6, DType::kFP16, rng());
    std::vector<int> slots;
    for (size_t b = 0; b < c.prefix.size(); ++b) slots.push_back(int(5 - b));
    ExtendProblem p = make_extend_problem(pool, proj, slots, c.prefix, c.extend, rng);
    BackendConfig config = make_config(pool, heads);
    config.prefix_chunk_capacity = c.capacity;
    config.extend_prefix_path = ExtendPrefixPath::kChunked;
    Backend backend(config);
    const ForwardBatch batch = p.batch();
    backend.init_forward_metadata(batch);
    EXPECT_FALSE(backend.plan().extend.use_absorbed);
    const LayerParams layer = make_layer(pool);
    backend.save_latent_kv(batch, cache_only(pool), p.k_nope.view(), p.k_pe.view());
    std::vector<int> calls;
    backend.forward_extend_chunked(batch, layer, p.mha_args(), make_up_project(proj, 1.0f, &calls));
    int64_t total_prefix = 0;
    for (int x : c.prefix) total_prefix += x;
    EXPECT_EQ(int64_t(calls.size()), (total_prefix + c.capacity - 1) / c.capacity);
    const Reference ref = naive_mha(pool, proj, p);
    SCOPED_TRACE("page " + std::to_string(c.page_size) + " capacity " + std::to_string(c.capacity));
    EXPECT_TRUE(all_close(p.out.to_float(), ref.out, kOutAtol, kOutRtol));
    EXPECT_TRUE(all_close(p.lse.to_float(), ref.lse, kLseAtol, kLseRtol));
  }
}

// The requests `which` of `p` (in that order) as an EXTEND batch of their own: the same pool
// slots, query rows and new tokens, fresh NaN outputs.
ExtendProblem sub_problem(const ExtendProblem& p, const std::vector<int>& which) {
  ExtendProblem s;
  s.heads = p.heads;
  for (int b : which) {
    s.slots.push_back(p.slots[size_t(b)]);
    s.prefix.push_back(p.prefix[size_t(b)]);
    s.extend.push_back(p.extend[size_t(b)]);
    s.num_tokens += p.extend[size_t(b)];
    s.seq_lens_cpu.push_back(p.seq_lens_cpu[size_t(b)]);
    s.extend_cpu.push_back(p.extend_cpu[size_t(b)]);
    s.prefix_cpu.push_back(p.prefix_cpu[size_t(b)]);
  }
  // Token rows of the chosen requests, in order.
  const std::vector<int32_t> counts(p.extend.begin(), p.extend.end());
  auto rows = [&](const HostTensor& t) { return test::request_rows(t, counts, which); };
  s.q = rows(p.q);
  s.k = rows(p.k);
  s.v = rows(p.v);
  s.q_abs = rows(p.q_abs);
  s.k_nope = rows(p.k_nope);
  s.k_pe = rows(p.k_pe);
  s.out_cache_loc = rows(p.out_cache_loc);
  s.out = nan_tensor(DType::kFP32, {s.num_tokens, s.heads, 128});
  s.lse = nan_tensor(DType::kFP32, {s.num_tokens, s.heads});
  s.out_abs = nan_tensor(DType::kFP32, {s.num_tokens, s.heads, kKvLoraRank});
  s.lse_abs = nan_tensor(DType::kFP32, {s.num_tokens, s.heads});
  const int batch = int(which.size());
  std::vector<int32_t> rpi(s.slots.begin(), s.slots.end());
  s.req_pool_indices = test::int32_tensor(rpi, {batch});
  s.seq_lens = test::int32_tensor(s.seq_lens_cpu, {batch});
  return s;
}

// BackendConfig::deterministic: request 1's EXTEND rows (23 cached tokens, pieces of 8, 8 and 7)
// have the same bits alone, behind a 5-token prefix and ahead of others, on both paths; without
// it the chunked path cuts the request where the batch puts the chunk boundaries, and the bits
// move.
TEST(BackendDeterministic, ExtendRequestBitsDoNotDependOnTheBatch) {
  std::mt19937_64 rng(4242);
  const int heads = 3;
  UpProjection proj(heads, rng);
  Pool pool(8, 64, 512, 6, DType::kFP16, rng());
  ExtendProblem all = make_extend_problem(pool, proj, {4, 1, 2, 0}, {5, 23, 13, 0}, {3, 4, 2, 1}, rng);
  const LayerParams layer = make_layer(pool);
  {  // the new tokens' latents in the cache, for the absorbed path
    BackendConfig config = make_config(pool, heads);
    Backend backend(config);
    const ForwardBatch batch = all.batch();
    backend.init_forward_metadata(batch);
    backend.save_latent_kv(batch, layer, all.k_nope.view(), all.k_pe.view());
  }
  const std::vector<std::vector<int>> batches = {{1}, {0, 1}, {1, 2, 3}, {0, 1, 2, 3}};
  const int64_t row_out = heads * 128, row_abs = heads * kKvLoraRank;
  for (bool deterministic : {true, false}) {
    // Deterministic: kAuto (which alone would take the absorbed path here) takes the chunked one.
    const ExtendPrefixPath chunked = deterministic ? ExtendPrefixPath::kAuto : ExtendPrefixPath::kChunked;
    for (ExtendPrefixPath path : {chunked, ExtendPrefixPath::kAbsorbed}) {
      std::vector<std::vector<float>> outs, lses;  // request 1's rows in each batch
      for (const std::vector<int>& which : batches) {
        ExtendProblem p = sub_problem(all, which);
        BackendConfig config = make_config(pool, heads);
        config.prefix_chunk_capacity = 8;
        config.extend_prefix_path = path;
        config.absorbed_max_extend_len = 1000;  // kAuto alone would take the absorbed path
        config.deterministic = deterministic;
        Backend backend(config);
        const ForwardBatch batch = p.batch();
        backend.init_forward_metadata(batch);
        const bool absorbed = backend.plan().extend.use_absorbed;
        EXPECT_EQ(absorbed, path == ExtendPrefixPath::kAbsorbed);
        int64_t t0 = 0;
        for (int b : which) {
          if (b == 1) break;
          t0 += all.extend[size_t(b)];
        }
        if (absorbed) {
          AbsorbedAttentionArgs a = p.absorbed_args();
          a.save_kv_cache = false;
          backend.forward_extend_absorbed(batch, layer, a);
          const std::vector<float> o = p.out_abs.to_float(), l = p.lse_abs.to_float();
          outs.emplace_back(o.begin() + t0 * row_abs, o.begin() + (t0 + 4) * row_abs);
          lses.emplace_back(l.begin() + t0 * heads, l.begin() + (t0 + 4) * heads);
        } else {
          backend.forward_extend_chunked(batch, layer, p.mha_args(), make_up_project(proj, 1.0f, nullptr));
          const std::vector<float> o = p.out.to_float(), l = p.lse.to_float();
          outs.emplace_back(o.begin() + t0 * row_out, o.begin() + (t0 + 4) * row_out);
          lses.emplace_back(l.begin() + t0 * heads, l.begin() + (t0 + 4) * heads);
        }
      }
      SCOPED_TRACE(std::string(deterministic ? "deterministic" : "default") +
                   (path == ExtendPrefixPath::kAbsorbed ? ", absorbed" : ", chunked"));
      bool all_equal = true;
      for (size_t i = 1; i < outs.size(); ++i)
        all_equal = all_equal && outs[i] == outs[0] && lses[i] == lses[0];
      // The CPU's absorbed path is deterministic in either mode; the default chunked path is not.
      const bool default_chunked = !deterministic && path == ExtendPrefixPath::kChunked;
      EXPECT_EQ(all_equal, !default_chunked);
    }
  }
}

TEST(BackendExtend, StepByStepChunkedPathEqualsConvenience) {
  std::mt19937_64 rng(99);
  const int heads = 2;
  UpProjection proj(heads, rng);
  Pool pool(4, 256, 256, 4, DType::kFP16, 12);
  ExtendProblem p = make_extend_problem(pool, proj, {0, 1, 2}, {11, 0, 6}, {3, 2, 4}, rng);
  BackendConfig config = make_config(pool, heads);
  config.prefix_chunk_capacity = 5;
  config.extend_prefix_path = ExtendPrefixPath::kChunked;
  Backend backend(config);
  const ForwardBatch batch = p.batch();
  backend.init_forward_metadata(batch);
  const LayerParams layer = make_layer(pool);
  ASSERT_EQ(backend.num_prefix_chunks(), 4);  // 17 prefix tokens in chunks of 5
  backend.forward_extend_chunked(batch, layer, p.mha_args(), make_up_project(proj, 1.0f, nullptr));
  const std::vector<float> convenience_out = p.out.to_float(), convenience_lse = p.lse.to_float();

  // (a) new tokens, (b) gather, up-project, (c) attend each chunk, (d) merge.
  p.out.fill_nan();
  p.lse.fill_nan();
  backend.forward_extend(batch, layer, p.mha_args());
  const UpProjectFn up = make_up_project(proj, 1.0f, nullptr);
  for (int c = 0; c < backend.num_prefix_chunks(); ++c) {
    const PrefixChunk& chunk = backend.plan().extend.chunks[size_t(c)];
    HostTensor latent = nan_tensor(DType::kFP16, {chunk.num_tokens, kLatentDim});
    backend.gather_prefix_chunk(c, cache_only(pool), latent.view());
    // The gathered rows are the chunk's prefix tokens, request-major.
    int64_t n = 0;
    for (size_t b = 0; b < 3; ++b)
      for (int pos = chunk.kv_begin[b]; pos < chunk.kv_begin[b] + chunk.kv_lens[b]; ++pos, ++n)
        for (int d = 0; d < kLatentDim; ++d)
          ASSERT_EQ(latent.get(n * kLatentDim + d), pool.latent[b][size_t(pos)][size_t(d)]);
    ASSERT_EQ(n, chunk.num_tokens);
    HostTensor k(DType::kFP16, {chunk.num_tokens, heads, 192}), v(DType::kFP16, {chunk.num_tokens, heads, 128});
    up(c, latent.view(), k.view(), v.view(), nullptr);
    HostTensor part_out = nan_tensor(DType::kFP32, {p.num_tokens, heads, 128});
    HostTensor part_lse = nan_tensor(DType::kFP32, {p.num_tokens, heads});
    MhaAttentionArgs chunk_args = p.mha_args();
    chunk_args.k = k.view();
    chunk_args.v = v.view();
    chunk_args.out = part_out.view();
    chunk_args.lse = part_lse.view();
    backend.forward_prefix_chunk(batch, c, layer, chunk_args);
    MergeStatesArgs merge;
    merge.out_a = p.out.view();
    merge.lse_a = p.lse.view();
    merge.out_b = part_out.view();
    merge.lse_b = part_lse.view();
    merge.out = p.out.view();
    merge.lse_out = p.lse.view();
    merge_states(merge);
  }
  EXPECT_TRUE(all_close(p.out.to_float(), to_double(convenience_out), 1e-6, 1e-6));
  EXPECT_TRUE(all_close(p.lse.to_float(), to_double(convenience_lse), 1e-6, 1e-6));
  const Reference ref = naive_mha(pool, proj, p);
  EXPECT_TRUE(all_close(p.out.to_float(), ref.out, kOutAtol, kOutRtol));
}

TEST(BackendExtend, AbsorbedPathEqualsNaiveAttention) {
  const ExtendCase cases[] = {{8, 7, {0, 9, 21, 5}, {4, 1, 6, 0}}, {64, 100, {100, 3}, {2, 1}},
                              {1, 4, {0, 0}, {3, 1}}};
  for (const ExtendCase& c : cases) {
    std::mt19937_64 rng(uint64_t(c.page_size) + 500);
    const int heads = 3;
    UpProjection proj(heads, rng);
    Pool pool(c.page_size, 8 + 1024 / c.page_size, 512, 6, DType::kFP16, rng());
    std::vector<int> slots;
    for (size_t b = 0; b < c.prefix.size(); ++b) slots.push_back(int(b));
    ExtendProblem p = make_extend_problem(pool, proj, slots, c.prefix, c.extend, rng);
    BackendConfig config = make_config(pool, heads);
    config.extend_prefix_path = ExtendPrefixPath::kAbsorbed;
    Backend backend(config);
    const ForwardBatch batch = p.batch();
    backend.init_forward_metadata(batch);
    EXPECT_TRUE(backend.plan().extend.use_absorbed);
    backend.forward_extend_absorbed(batch, make_layer(pool), p.absorbed_args());
    SCOPED_TRACE("page " + std::to_string(c.page_size));
    // Exactly the absorbed attention of q_abs over the cached latents (new ones saved first).
    Reference absorbed;
    absorbed.out.assign(size_t(p.num_tokens * heads * kKvLoraRank), 0.0);
    absorbed.lse.assign(size_t(p.num_tokens * heads), 0.0);
    int64_t t = 0;
    std::vector<double> q(kLatentDim);
    for (size_t b = 0; b < slots.size(); ++b)
      for (int i = 0; i < c.extend[b]; ++i, ++t)
        for (int h = 0; h < heads; ++h) {
          for (int d = 0; d < kLatentDim; ++d) q[size_t(d)] = p.q_abs.get((t * heads + h) * kLatentDim + d);
          naive_absorbed_row(pool.latent[size_t(slots[b])], c.prefix[b] + i + 1, q.data(),
                             &absorbed.out[size_t((t * heads + h) * kKvLoraRank)],
                             &absorbed.lse[size_t(t * heads + h)]);
        }
    EXPECT_TRUE(all_close(p.out_abs.to_float(), absorbed.out, kOutAtol, kOutRtol));
    EXPECT_TRUE(all_close(p.lse_abs.to_float(), absorbed.lse, kLseAtol, kLseRtol));
    // And, through W_UV, the one-shot MHA attention (keys rounded differently in the two forms:
    // W_UK c to fp16 there, W_UK^T q to fp16 here).
    const Reference mha = naive_mha(pool, proj, p);
    std::vector<float> projected(size_t(p.num_tokens * heads * 128));
    for (int64_t row = 0; row < p.num_tokens; ++row)
      for (int h = 0; h < heads; ++h)
        for (int i = 0; i < 128; ++i) {
          double sum = 0;
          for (int d = 0; d < kKvLoraRank; ++d)
            sum += proj.w_uv[(size_t(h) * 128 + size_t(i)) * kKvLoraRank + size_t(d)] *
                   p.out_abs.get((row * heads + h) * kKvLoraRank + d);
          projected[size_t((row * heads + h) * 128 + i)] = float(sum);
        }
    EXPECT_TRUE(all_close(projected, mha.out, 3e-3, 3e-3));
    EXPECT_TRUE(all_close(p.lse_abs.to_float(), mha.lse, 3e-3, 3e-3));
  }
}

TEST(BackendExtend, AutomaticPathFollowsTheDocumentedRule) {
  std::mt19937_64 rng(4);
  UpProjection proj(1, rng);
  Pool pool(16, 64, 512, 4, DType::kFP16, 2);
  BackendConfig config = make_config(pool, 1);
  config.absorbed_max_extend_len = 5;
  Backend backend(config);
  // Pairs a prefix token (2*(40 + 1.5) + 9*(10 + 5)) / 50 = 4.36 <= 5: absorbed.
  ExtendProblem few = make_extend_problem(pool, proj, {0, 1}, {40, 10}, {2, 9}, rng);
  backend.init_forward_metadata(few.batch());
  EXPECT_TRUE(backend.plan().extend.use_absorbed);
  // (5*(40 + 3) + 9*(10 + 5)) / 50 = 7 > 5: chunked.
  ExtendProblem many = make_extend_problem(pool, proj, {2, 3}, {40, 10}, {5, 9}, rng);
  backend.init_forward_metadata(many.batch());
  EXPECT_FALSE(backend.plan().extend.use_absorbed);
  // No prefix: plain MHA, no chunks.
  ExtendProblem fresh = make_extend_problem(pool, proj, {0}, {0}, {7}, rng);
  backend.init_forward_metadata(fresh.batch());
  EXPECT_FALSE(backend.plan().extend.use_absorbed);
  EXPECT_EQ(backend.num_prefix_chunks(), 0);
}

// ---------------------------------------------------------------------------------------------
// Re-planning when data-parallel padding grew the batch after planning

TEST(BackendReplan, ForwardOfALargerBatchReplansInsteadOfReadingPastThePlan) {
  std::mt19937_64 rng(61);
  const int heads = 4;
  Pool pool(16, 64, 256, 4, DType::kFP16, 6);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 30, 1}, {1, 7, 1}, {2, 100, 1}}, heads,
                                            DType::kFP16, rng);
  Backend backend(make_config(pool, heads));
  ForwardBatch planned = p.batch(ForwardMode::kDecode);
  planned.batch_size = 2;  // planned before the padding request was added
  planned.seq_lens_cpu = std::span<const int32_t>(p.seq_lens_cpu).first(2);
  backend.init_forward_metadata(planned);
  ASSERT_EQ(backend.plan().batch_size, 2);
  const ForwardBatch grown = p.batch(ForwardMode::kDecode);
  backend.forward_decode(grown, make_layer(pool), p.args());
  EXPECT_EQ(backend.plan().batch_size, 3);
  expect_matches(p, naive_absorbed(pool, p), "re-planned decode");

  // A draft step that sees a grown batch re-plans every step (with its offset).
  const int num_steps = 3;
  std::vector<Request> base = {{0, 31, 1}, {1, 8, 1}, {3, 12, 1}};
  for (const Request& r : base) pool.reserve(r.slot, r.cached + num_steps);
  AbsorbedProblem first = make_absorbed_problem(pool, base, heads, DType::kFP16, rng);
  MultiStepDraftBackend draft(num_steps, make_config(pool, heads));
  ForwardBatch small = first.batch(ForwardMode::kDecode, false);
  small.batch_size = 1;
  draft.init_forward_metadata(small);
  draft.step(0).forward_decode(first.batch(ForwardMode::kDecode, false), make_layer(pool), first.args());
  expect_matches(first, naive_absorbed(pool, first), "draft step 0 after re-plan");
  EXPECT_EQ(draft.step(1).plan().batch_size, 3);
  std::vector<Request> step1 = base;
  for (Request& r : step1) r.cached += 1;
  AbsorbedProblem second = make_absorbed_problem(pool, step1, heads, DType::kFP16, rng, false);
  ForwardBatch step1_batch = second.batch(ForwardMode::kDecode, false);
  step1_batch.seq_lens = first.seq_lens.view();  // the same batch for every step
  draft.step(1).forward_decode(step1_batch, make_layer(pool), second.args());
  expect_matches(second, naive_absorbed(pool, second), "draft step 1 after re-plan");
}

// The padding grows batch_size and the device tensors but may leave the engine's host lists
// short: the re-plan then works from the device tensors (DECODE; DRAFT_EXTEND with the queries
// from extend_seq_lens, bounded by num_draft_tokens).
TEST(BackendReplan, HostListsLeftShortByThePaddingAreNotUsed) {
  std::mt19937_64 rng(62);
  const int heads = 4;
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kDraftExtend}) {
    SCOPED_TRACE(forward_mode_name(mode));
    const bool draft = mode == ForwardMode::kDraftExtend;
    Pool pool(16, 64, 256, 4, DType::kFP16, 7);
    AbsorbedProblem p = make_absorbed_problem(
        pool, {{0, 30, draft ? 2 : 1}, {1, 7, 1}, {2, 100, draft ? 3 : 1}}, heads, DType::kFP16, rng);
    Backend backend(make_config(pool, heads));
    auto shortened = [&](int planned_size) {
      ForwardBatch b = p.batch(mode);
      b.seq_lens_cpu = std::span<const int32_t>(p.seq_lens_cpu).first(2);
      if (draft) b.extend_seq_lens_cpu = std::span<const int32_t>(p.extend_seq_lens_cpu).first(2);
      b.batch_size = planned_size;
      b.num_draft_tokens = 3;
      return b;
    };
    backend.init_forward_metadata(shortened(2));
    ASSERT_EQ(backend.plan().batch_size, 2);
    p.poison_outputs();
    backend.forward_decode(shortened(3), make_layer(pool), p.args());
    EXPECT_EQ(backend.plan().batch_size, 3);
    expect_matches(p, naive_absorbed(pool, p), "re-planned from the device lengths");
    // Planned directly, short host lists are still an error: they are the engine's own.
    EXPECT_TRUE(throws_error([&] { backend.init_forward_metadata(shortened(3)); },
                             {"_lens_cpu must have batch_size = 3 entries, got 2"}));
  }
  // EXTEND is planned from its host lists: a short one is named, not dropped.
  std::mt19937_64 rng2(63);
  UpProjection proj(heads, rng2);
  Pool pool(16, 64, 256, 4, DType::kFP16, 8);
  ExtendProblem e = make_extend_problem(pool, proj, {0, 1, 2}, {5, 3, 2}, {2, 3, 1}, rng2);
  Backend backend(make_config(pool, heads));
  ForwardBatch planned = e.batch();
  planned.batch_size = 2;
  for (auto* host :
       {&planned.seq_lens_cpu, &planned.extend_seq_lens_cpu, &planned.extend_prefix_lens_cpu})
    *host = host->first(2);
  backend.init_forward_metadata(planned);
  ForwardBatch grown = e.batch();
  grown.extend_seq_lens_cpu = grown.extend_seq_lens_cpu.first(2);
  EXPECT_TRUE(throws_error([&] { backend.forward_extend(grown, make_layer(pool), e.mha_args()); },
                           {"batch.extend_seq_lens_cpu must have batch_size = 3 entries, got 2"}));
}

// A graph state that cannot be allocated leaves the previous one in use: the draft backend's
// step views are cut from its buffer by graph_max_bs, which used to take the new size before the
// allocation failed (step 1's lengths then lay far past the old buffer).
TEST(BackendCudaGraph, FailedDraftGraphStateKeepsThePreviousOne) {
  std::mt19937_64 rng(77);
  const int heads = 4, num_steps = 3;
  // Page size 1 and a 65536-token context: rows of 65536 pages, so 2^31 - 1 requests ask for
  // 512 TiB, which no allocator gives.
  Pool pool(1, 256, 65536, 4, DType::kFP16, 3);
  std::vector<Request> base = {{0, 12, 1}, {1, 40, 1}};
  for (const Request& r : base) pool.reserve(r.slot, r.cached + num_steps);
  AbsorbedProblem p = make_absorbed_problem(pool, base, heads, DType::kFP16, rng);
  MultiStepDraftBackend draft(num_steps, make_config(pool, heads));
  draft.init_cuda_graph_state(2, 2);
  EXPECT_THROW(draft.init_cuda_graph_state(INT32_MAX, INT32_MAX), Error);
  draft.init_forward_metadata_capture_cuda_graph(2, 2, p.req_pool_indices.view(), p.seq_lens.view());
  const auto* step0 = static_cast<const int32_t*>(draft.step(0).plan().kv_lens.data);
  const auto* step1 = static_cast<const int32_t*>(draft.step(1).plan().kv_lens.data);
  EXPECT_EQ(step1 - step0, 2) << "step 1's lengths follow step 0's in the 2-request buffer";
  EXPECT_EQ(step0[0], 12 + 1);
  EXPECT_EQ(step1[1], 40 + 2);
}

// The draft backend's host lengths are a bound its block table is planned from: device lengths
// past them are reported under the engine's name (they reached the kernel's checks as kv_lens).
TEST(BackendErrors, DraftStaleHostLengthsNameTheArgument) {
  std::mt19937_64 rng(78);
  const int heads = 4, num_steps = 3;
  Pool pool(64, 16, 512, 4, DType::kFP16, 8);
  std::vector<Request> base = {{0, 30, 1}, {1, 200, 1}};
  for (const Request& r : base) pool.reserve(r.slot, r.cached + num_steps);
  AbsorbedProblem p = make_absorbed_problem(pool, base, heads, DType::kFP16, rng);
  MultiStepDraftBackend draft(num_steps, make_config(pool, heads));
  ForwardBatch batch = p.batch(ForwardMode::kDecode);
  const std::vector<int32_t> stale = {31, 100};
  batch.seq_lens_cpu = stale;
  EXPECT_TRUE(throws_error([&] { draft.init_forward_metadata(batch); },
                           {"MultiStepDraftBackend::init_forward_metadata", "batch.seq_lens[1] = ",
                            "draft steps does not fit the block table", "(stale?)"}));
}

// ---------------------------------------------------------------------------------------------
// Bad input names the argument

TEST(BackendErrors, BadConfigNamesTheField) {
  Pool pool(16, 8, 64, 2, DType::kBF16, 1);
  const auto bad = [&](auto edit, std::initializer_list<const char*> fragments) {
    BackendConfig c = make_config(pool, 4, DType::kBF16);
    edit(c);
    return throws_error([&] { Backend backend(c); }, fragments);
  };
  EXPECT_TRUE(bad([](BackendConfig& c) { c.num_q_heads = 0; }, {"config.num_q_heads", "1..128"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.num_q_heads = 129; }, {"config.num_q_heads"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.page_size = 24; }, {"config.page_size", "power of two"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.page_size = 256; }, {"config.page_size"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.kv_cache_dtype = DType::kFP32; }, {"config.kv_cache_dtype"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.q_dtype = DType::kFP16; }, {"config.q_dtype", "bf16"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.out_dtype = DType::kInt32; }, {"config.out_dtype"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.req_to_token = TensorView{}; }, {"config.req_to_token"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.req_to_token.dtype = DType::kInt64; }, {"config.req_to_token", "int32"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.max_context_len = 65; }, {"config.max_context_len"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.prefix_chunk_capacity = 0; }, {"config.prefix_chunk_capacity"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.num_draft_tokens = -1; }, {"config.num_draft_tokens"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.absorbed_max_extend_len = -1; }, {"config.absorbed_max_extend_len"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.deterministic_split_keys = 100; },
                  {"config.deterministic_split_keys", "multiple of 64"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.deterministic_split_keys = -64; }, {"config.deterministic_split_keys"}));
  EXPECT_TRUE(bad(
      [](BackendConfig& c) {  // a view of the shape alone: validation reads no element
        c.req_to_token.shape[1] = INT32_MAX;
        c.req_to_token.stride[0] = INT32_MAX;
        c.max_context_len = kMaxKeysPerRequest + 1;
      },
      {"config.max_context_len", "at most 2147483392"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.device = Device::cuda(0); }, {"config.req_to_token", "cuda:0"}));
  EXPECT_TRUE(throws_error([] { MultiStepDraftBackend d(0, BackendConfig{}); }, {"num_steps"}));
  EXPECT_TRUE(bad([](BackendConfig& c) { c.prefix_chunk_capacity = int64_t(1) << 40; },
                  {"config.prefix_chunk_capacity", "2^31 - 1"}));
  // A draft backend of one step (no step backends) with its own workspace checks the config too.
  BackendConfig no_heads = make_config(pool, 4, DType::kBF16);
  no_heads.num_q_heads = 0;
  EXPECT_TRUE(throws_error([&] { MultiStepDraftBackend d(1, no_heads, std::make_shared<Workspace>(1024, Device::cpu())); },
                           {"config.num_q_heads"}));
  // The workspace sizes saturate instead of wrapping around.
  BackendConfig huge = make_config(pool, 128, DType::kBF16);
  huge.prefix_chunk_capacity = int64_t(1) << 57;
  EXPECT_GE(Backend::chunked_extend_workspace_bytes(huge, 1), size_t(1) << 62);
  EXPECT_GE(Backend::chunked_extend_workspace_bytes(make_config(pool, 128, DType::kBF16), int64_t(1) << 60),
            size_t(1) << 62);
}

TEST(BackendErrors, HostLengthsPastInt32AndDraftStepsPastTheContextNameTheArgument) {
  std::mt19937_64 rng(16);
  const int heads = 4;
  Pool pool(16, 64, 128, 4, DType::kFP16, 8);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 30, 1}, {1, 7, 1}}, heads, DType::kFP16, rng);
  BackendConfig config = make_config(pool, heads);
  config.num_draft_tokens = 2;
  Backend backend(config);
  ForwardBatch b = p.batch(ForwardMode::kDraftExtend, true);
  const std::vector<int32_t> huge = {INT32_MAX, 1};
  b.extend_seq_lens_cpu = huge;
  EXPECT_TRUE(throws_error([&] { backend.init_forward_metadata(b); },
                           {"batch.extend_seq_lens_cpu", "2^31 - 1"}));
  // Device query counts (no host copy) that do not add up to the queries given at forward time:
  // the error names batch.extend_seq_lens (planned here as 1 and 2, the queries are 1 + 1).
  {
    Backend device_lengths(config);
    ForwardBatch d = p.batch(ForwardMode::kDraftExtend, false);
    HostTensor three = test::int32_tensor({1, 2});
    d.extend_seq_lens = three.view();
    device_lengths.init_forward_metadata(d);
    EXPECT_TRUE(throws_error([&] { device_lengths.forward_decode(d, make_layer(pool), p.args(false)); },
                             {"batch.extend_seq_lens", "add up to 3", "has only 2"}));
  }
  // Fewer (a padded batch: request 1 has none now): the row past them comes out 0 with lse
  // -inf, and request 0's row has the bits it has when request 1 has its query.
  {
    Backend device_lengths(config);
    ForwardBatch d = p.batch(ForwardMode::kDraftExtend, false);
    HostTensor one_one = test::int32_tensor({1, 1}), one_none = test::int32_tensor({1, 0});
    d.extend_seq_lens = one_one.view();
    device_lengths.init_forward_metadata(d);
    p.poison_outputs();
    device_lengths.forward_decode(d, make_layer(pool), p.args(false));
    const HostTensor out_full = p.out, lse_full = p.lse;
    d.extend_seq_lens = one_none.view();
    device_lengths.init_forward_metadata(d);
    p.poison_outputs();
    device_lengths.forward_decode(d, make_layer(pool), p.args(false));
    const int64_t row = int64_t(heads) * kKvLoraRank;
    const auto row_bytes = std::ptrdiff_t(row * int64_t(dtype_size(p.out.dtype)));
    EXPECT_TRUE(std::equal(p.out.bytes.begin(), p.out.bytes.begin() + row_bytes, out_full.bytes.begin()));
    EXPECT_TRUE(std::equal(p.lse.bytes.begin(), p.lse.bytes.begin() + heads * 4, lse_full.bytes.begin()));
    for (int64_t i = row; i < 2 * row; ++i) EXPECT_EQ(p.out.get(i), 0.0f) << "padding element " << i;
    for (int64_t i = heads; i < 2 * heads; ++i) EXPECT_EQ(p.lse.get(i), -INFINITY) << "padding lse " << i;
  }
  // Three draft steps: the last attends seq_lens + 1 keys, past the context of 128 here.
  AbsorbedProblem full = make_absorbed_problem(pool, {{2, 127, 1}}, heads, DType::kFP16, rng);
  MultiStepDraftBackend draft(3, config);
  EXPECT_TRUE(throws_error([&] { draft.init_forward_metadata(full.batch(ForwardMode::kDecode, false)); },
                           {"batch.seq_lens[0] = 128", "draft steps", "max_context_len = 128"}));
}

TEST(BackendErrors, DraftExtendLengthsBeyondTheBoundNameTheArgument) {
  std::mt19937_64 rng(14);
  const int heads = 4;
  Pool pool(16, 64, 128, 4, DType::kFP16, 7);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 30, 1}, {1, 7, 4}}, heads, DType::kFP16, rng);
  BackendConfig config = make_config(pool, heads);
  config.num_draft_tokens = 2;  // the bound on the queries per request; request 1 has 4
  Backend backend(config);
  const ForwardBatch device_lengths = p.batch(ForwardMode::kDraftExtend, false);
  EXPECT_TRUE(throws_error([&] { backend.init_forward_metadata(device_lengths); },
                           {"batch.extend_seq_lens[1] = 4", "bound", "num_draft_tokens"}));
  config.num_draft_tokens = 4;
  Backend enough(config);
  EXPECT_NO_THROW(enough.init_forward_metadata(device_lengths));
}

TEST(BackendErrors, StaleHostLengthsNameTheArgument) {
  // Device lengths beyond the block table planned from the host lengths: the error names both.
  std::mt19937_64 rng(15);
  const int heads = 4;
  Pool pool(64, 16, 512, 4, DType::kFP16, 8);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 30, 1}, {1, 200, 1}}, heads, DType::kFP16, rng);
  Backend backend(make_config(pool, heads));
  ForwardBatch batch = p.batch(ForwardMode::kDecode);
  const std::vector<int32_t> stale = {31, 100};  // the table: 2 pages of 64 tokens a request
  batch.seq_lens_cpu = stale;
  EXPECT_TRUE(throws_error([&] { backend.init_forward_metadata(batch); },
                           {"batch.seq_lens[1] = 201", "block table of 128 tokens", "batch.seq_lens_cpu"}));
  EXPECT_NO_THROW(backend.init_forward_metadata(p.batch(ForwardMode::kDecode)));
}

TEST(BackendErrors, BadBatchesAndForwardsNameTheArgument) {
  std::mt19937_64 rng(13);
  const int heads = 4;
  Pool pool(16, 64, 128, 4, DType::kFP16, 6);
  AbsorbedProblem p = make_absorbed_problem(pool, {{0, 10, 1}, {1, 20, 1}}, heads, DType::kFP16, rng);
  BackendConfig config = make_config(pool, heads);
  Backend backend(config);
  const LayerParams layer = make_layer(pool);
  const ForwardBatch good = p.batch(ForwardMode::kDecode);

  // Forward before any plan.
  EXPECT_TRUE(throws_error([&] { backend.forward_decode(good, layer, p.args()); }, {"forward_decode", "init_forward_metadata"}));

  // Planning.
  const auto plan_error = [&](auto edit, std::initializer_list<const char*> fragments) {
    ForwardBatch b = good;
    HostTensor keep = p.seq_lens;  // storage for edits that swap tensors
    edit(b, keep);
    return throws_error([&] { backend.init_forward_metadata(b); }, fragments);
  };
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.batch_size = -1; }, {"batch.batch_size"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.batch_size = 3; }, {"batch.req_pool_indices", "3"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.seq_lens = TensorView{}; }, {"batch.seq_lens"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor& t) {
    t = HostTensor(DType::kFP32, {2});
    b.seq_lens = t.view();
  }, {"batch.seq_lens", "int32"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.seq_lens.device = Device::cuda(0); }, {"batch.seq_lens", "cuda:0"}));
  std::vector<int32_t> too_long = {10, 129};
  EXPECT_TRUE(plan_error([&](ForwardBatch& b, HostTensor&) { b.seq_lens_cpu = too_long; }, {"batch.seq_lens_cpu[1]", "max_context_len"}));
  std::vector<int32_t> one = {11};
  EXPECT_TRUE(plan_error([&](ForwardBatch& b, HostTensor&) { b.seq_lens_cpu = one; }, {"batch.seq_lens_cpu", "2"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.mode = ForwardMode::kTargetVerify; }, {"TARGET_VERIFY", "num_draft_tokens"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) {
    b.mode = ForwardMode::kDraftExtend;
    b.extend_seq_lens = TensorView{};
    b.extend_seq_lens_cpu = {};
  }, {"DRAFT_EXTEND", "batch.extend_seq_lens"}));
  EXPECT_TRUE(plan_error([](ForwardBatch& b, HostTensor&) { b.mode = ForwardMode::kExtend; }, {"batch.extend_seq_lens_cpu"}));
  std::vector<int32_t> extend = {1, 1}, prefix = {10, 200};
  EXPECT_TRUE(plan_error([&](ForwardBatch& b, HostTensor&) {
    b.mode = ForwardMode::kExtend;
    b.extend_seq_lens_cpu = extend;
    b.extend_prefix_lens_cpu = prefix;
    b.seq_lens_cpu = {};
  }, {"batch.extend_prefix_lens_cpu[1]", "max_context_len"}));
  EXPECT_TRUE(plan_error([&](ForwardBatch& b, HostTensor&) {
    b.mode = ForwardMode::kExtend;
    b.extend_seq_lens_cpu = extend;
    b.extend_prefix_lens_cpu = extend;
  }, {"batch.seq_lens_cpu[0]", "extend_prefix_lens_cpu[0]"}));

  backend.init_forward_metadata(good);
  const auto forward_error = [&](auto edit, std::initializer_list<const char*> fragments) {
    AbsorbedAttentionArgs a = p.args();
    LayerParams l = layer;
    ForwardBatch b = good;
    edit(a, l, b);
    return throws_error([&] { backend.forward_decode(b, l, a); }, fragments);
  };
  HostTensor wrong_heads(DType::kFP16, {2, heads + 1, kLatentDim});
  HostTensor wrong_tokens(DType::kFP16, {3, heads, kLatentDim});
  HostTensor wrong_dtype(DType::kBF16, {2, heads, kLatentDim});
  HostTensor wrong_out(DType::kBF16, {2, heads, kKvLoraRank});
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.q = wrong_heads.view(); }, {"args.q", "num_q_heads"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.q = wrong_tokens.view(); }, {"args.q", "3 tokens", "has 2"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.q = wrong_dtype.view(); }, {"args.q", "fp16"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.q = TensorView{}; }, {"args.q", "none was given"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.q_nope = wrong_heads.view(); }, {"both were given"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.out = wrong_out.view(); }, {"args.out", "fp32"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto&) { a.k_nope = TensorView{}; }, {"args.k_nope", "save_kv_cache"}));
  EXPECT_TRUE(forward_error([&](auto&, auto&, auto& b) { b.out_cache_loc = TensorView{}; }, {"batch.out_cache_loc"}));
  EXPECT_TRUE(forward_error([&](auto&, auto& l, auto&) { l.softmax_scale = 0; }, {"layer.softmax_scale"}));
  EXPECT_TRUE(forward_error([&](auto&, auto& l, auto&) { l.k_scale = -1; }, {"layer.k_scale"}));
  EXPECT_TRUE(forward_error([&](auto&, auto& l, auto&) { l.kv_cache.shape[1] = 8; }, {"layer.kv_cache", "page size"}));
  EXPECT_TRUE(forward_error([&](auto&, auto& l, auto&) { l.kv_cache.dtype = DType::kBF16; }, {"layer.kv_cache", "fp16"}));
  EXPECT_TRUE(forward_error([&](auto&, auto&, auto& b) { b.mode = ForwardMode::kTargetVerify; }, {"batch.mode", "plan was made for DECODE"}));
  EXPECT_TRUE(forward_error([&](auto&, auto&, auto& b) { b.mode = ForwardMode::kExtend; }, {"forward_decode", "batch.mode"}));
  EXPECT_TRUE(forward_error([&](auto&, auto&, auto& b) { b.batch_size = 1; }, {"batch.batch_size is 1", "2 requests"}));
  EXPECT_TRUE(forward_error([&](auto& a, auto&, auto& b) {
    static HostTensor cos_sin(DType::kFP32, {8, kRopeDim});
    a.cos_sin_cache = cos_sin.view();
    b.positions = TensorView{};
  }, {"batch.positions"}));

  // EXTEND-only entries on a decode plan, and bad chunk indices.
  HostTensor latent(DType::kFP16, {1, kLatentDim});
  EXPECT_TRUE(throws_error([&] { backend.gather_prefix_chunk(0, layer, latent.view()); }, {"gather_prefix_chunk", "EXTEND"}));
  EXPECT_TRUE(throws_error([&] { backend.forward_extend(good, layer, MhaAttentionArgs{}); }, {"forward_extend", "batch.mode"}));
  UpProjection proj(heads, rng);
  ExtendProblem e = make_extend_problem(pool, proj, {2, 3}, {7, 3}, {2, 1}, rng);
  BackendConfig small = config;
  small.prefix_chunk_capacity = 4;
  Backend extender(small);
  extender.init_forward_metadata(e.batch());
  ASSERT_EQ(extender.num_prefix_chunks(), 3);
  EXPECT_TRUE(throws_error([&] { extender.gather_prefix_chunk(3, layer, latent.view()); }, {"chunk_idx", "[0, 3)"}));
  EXPECT_TRUE(throws_error([&] { extender.gather_prefix_chunk(0, layer, latent.view()); }, {"latent_out", "4"}));
  HostTensor latent_bf16(DType::kBF16, {4, kLatentDim});
  EXPECT_TRUE(throws_error([&] { extender.gather_prefix_chunk(0, layer, latent_bf16.view()); }, {"latent_out", "fp16"}));
  const TensorView in_cache = TensorView::contiguous(layer.kv_cache.data, DType::kFP16, {4, kLatentDim});
  EXPECT_TRUE(throws_error([&] { extender.gather_prefix_chunk(0, layer, in_cache); },
                           {"gather_prefix_chunk: latent_out", "overlaps layer.kv_cache"}));
  MhaAttentionArgs mha = e.mha_args();
  EXPECT_TRUE(throws_error([&] { extender.forward_prefix_chunk(e.batch(), 0, layer, mha); }, {"args.k", "keys"}));
  mha.q = e.k.view();  // right shape
  HostTensor wrong_q(DType::kFP16, {2, heads, 192});
  mha.q = wrong_q.view();
  EXPECT_TRUE(throws_error([&] { extender.forward_extend(e.batch(), layer, mha); }, {"args.q", "tokens"}));
  EXPECT_TRUE(throws_error([&] { extender.forward_extend_chunked(e.batch(), layer, e.mha_args(), nullptr); }, {"up_project"}));
  {
    // An output the new tokens' attention could not write (strided last dim, heads laid over
    // each other) is named before any chunk is gathered or projected, prefix or not.
    MhaAttentionArgs bad = e.mha_args();
    HostTensor wide(bad.out.dtype, {e.num_tokens, heads, 256});
    bad.out = TensorView::strided(wide.data(), bad.out.dtype, {e.num_tokens, heads, 128},
                                  {heads * 256, 256, 2});
    std::vector<int> calls;
    EXPECT_TRUE(throws_error([&] {
      extender.forward_extend_chunked(e.batch(), layer, bad, make_up_project(proj, 1.0f, &calls));
    }, {"forward_extend_chunked", "args.out", "contiguous last dimension"}));
    bad.out = TensorView::strided(wide.data(), bad.out.dtype, {e.num_tokens, heads, 128}, {256, 0, 1});
    EXPECT_TRUE(throws_error([&] {
      extender.forward_extend_chunked(e.batch(), layer, bad, make_up_project(proj, 1.0f, &calls));
    }, {"forward_extend_chunked", "args.out", "overlap"}));
    EXPECT_TRUE(calls.empty());
  }
  // A workspace too small for the chunked path says how much is needed.
  BackendConfig tiny = small;
  tiny.workspace_bytes = 1024;
  Backend starved(tiny);
  starved.init_forward_metadata(e.batch());
  EXPECT_TRUE(throws_error([&] {
    starved.forward_extend_chunked(e.batch(), layer, e.mha_args(), make_up_project(proj, 1.0f, nullptr));
  }, {"workspace", "too small"}));
  EXPECT_GE(Backend::chunked_extend_workspace_bytes(small, e.num_tokens), size_t(4 * kLatentDim * 2));

  // CUDA-graph entries.
  EXPECT_TRUE(throws_error([&] {
    backend.init_forward_metadata_replay_cuda_graph(1, p.req_pool_indices.view(), p.seq_lens.view(), ForwardMode::kDecode);
  }, {"init_cuda_graph_state"}));
  EXPECT_TRUE(throws_error([&] { backend.init_cuda_graph_state(0, 4); }, {"max_bs"}));
  EXPECT_TRUE(throws_error([&] { backend.init_cuda_graph_state(4, 2); }, {"max_num_tokens"}));
  backend.init_cuda_graph_state(2, 4);
  EXPECT_TRUE(throws_error([&] {
    backend.init_forward_metadata_capture_cuda_graph(3, 3, p.req_pool_indices.view(), p.seq_lens.view(), ForwardMode::kDecode);
  }, {"bs", "max_bs = 2"}));
  EXPECT_TRUE(throws_error([&] {
    backend.init_forward_metadata_capture_cuda_graph(2, 3, p.req_pool_indices.view(), p.seq_lens.view(), ForwardMode::kDecode);
  }, {"num_tokens", "2"}));
  EXPECT_TRUE(throws_error([&] {
    backend.init_forward_metadata_capture_cuda_graph(2, 2, p.req_pool_indices.view(), p.seq_lens.view(), ForwardMode::kExtend);
  }, {"mode", "EXTEND"}));
  EXPECT_TRUE(throws_error([&] {
    backend.init_forward_metadata_replay_cuda_graph(2, p.req_pool_indices.view(), TensorView{}, ForwardMode::kDecode);
  }, {"seq_lens"}));
  // A CUDA-graph plan is not re-planned for a larger batch (its buffers are the graph's).
  backend.init_forward_metadata_capture_cuda_graph(1, 1, p.req_pool_indices.view(), p.seq_lens.view(), ForwardMode::kDecode);
  EXPECT_TRUE(throws_error([&] { backend.forward_decode(good, layer, p.args()); },
                           {"batch.batch_size 2", "CUDA-graph plan's 1", "padded batch size"}));
  backend.init_forward_metadata(good);  // an eager plan for the batch: fine again
  EXPECT_NO_THROW(backend.forward_decode(good, layer, p.args()));
}

}  // namespace
}  // namespace mla
