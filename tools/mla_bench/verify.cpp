// mla-bench: float64 naive attention, written from the definitions in include/mla/ops.hpp, to
// check the outputs of the timed kernels on a sample of rows (every row of small cases).
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "bench.hpp"
#include "mla/error.hpp"

namespace mla::bench {

namespace {

// Reference work (multiply-adds) below which every row is checked.
constexpr double kFullCheckBudget = 1e8;

// A few distinct indices in [0, n): the ends, the middle and `extra` random ones.
std::vector<int> sample_indices(int n, int extra, Rng& rng) {
  std::set<int> picked;
  if (n <= 0) return {};
  picked.insert(0);
  picked.insert(n - 1);
  picked.insert(n / 2);
  for (int i = 0; i < extra; ++i) picked.insert(rng.below(n));
  return {picked.begin(), picked.end()};
}

// Output elements that are NaN or inf: every output starts NaN-poisoned and every row the kernel
// should write is finite (0 for rows without keys), so this catches rows a kernel skips in the
// part of the output the reference sample does not cover.
int64_t count_non_finite(const HostBuffer& out) {
  int64_t n = 0;
  for (int64_t i = 0; i < out.numel(); ++i) n += !std::isfinite(out.get(i));
  return n;
}

std::vector<int> all_indices(int n) {
  std::vector<int> v(size_t(std::max(n, 0)));
  for (int i = 0; i < n; ++i) v[size_t(i)] = i;
  return v;
}

// Error of one output row (dv elements starting at element `offset` of `out`) against `ref`.
double row_error(const HostBuffer& out, int64_t offset, const std::vector<double>& ref) {
  double sum_sq = 0;
  for (double r : ref) sum_sq += r * r;
  const double rms = std::sqrt(sum_sq / double(ref.size()));
  double worst = 0;
  for (size_t d = 0; d < ref.size(); ++d) {
    const double o = out.get(offset + int64_t(d));
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    const double denom = std::abs(ref[d]) + rms;
    const double err = denom > 0 ? std::abs(o - ref[d]) / denom
                                 : (o == 0 ? 0.0 : std::numeric_limits<double>::infinity());
    worst = std::max(worst, err);
  }
  return worst;
}

// softmax(scale * q·k_j) · v over keys [0, num_keys): keys [num_keys][dk], values [num_keys][dv].
std::vector<double> attend(const std::vector<double>& q, const std::vector<double>& keys,
                           const std::vector<double>& values, int64_t num_keys, int dk, int dv,
                           double scale) {
  std::vector<double> out(size_t(dv), 0.0);
  if (num_keys <= 0) return out;  // a row with no keys outputs 0
  std::vector<double> scores(static_cast<size_t>(num_keys));
  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < num_keys; ++j) {
    double s = 0;
    const double* k = keys.data() + size_t(j) * size_t(dk);
    for (int d = 0; d < dk; ++d) s += q[size_t(d)] * k[d];
    scores[size_t(j)] = s * scale;
    max_score = std::max(max_score, scores[size_t(j)]);
  }
  double denom = 0;
  for (double& s : scores) {
    s = std::exp(s - max_score);
    denom += s;
  }
  for (int64_t j = 0; j < num_keys; ++j) {
    const double p = scores[size_t(j)] / denom;
    const double* v = values.data() + size_t(j) * size_t(dv);
    for (int d = 0; d < dv; ++d) out[size_t(d)] += p * v[d];
  }
  return out;
}

}  // namespace

double tolerance_for(DType input_dtype) {
  switch (input_dtype) {
    case DType::kFP8E4M3: return 1e-1;  // fp8 inputs; kernels may round probabilities to fp8
    case DType::kFP16: return 1e-2;
    default: return 2e-2;               // bf16 output and probabilities
  }
}

Verification verify_decode(const DecodeProblem& p, const HostBuffer& out, uint64_t seed) {
  const BenchCase& c = p.c;
  MLA_CHECK(out.numel() == p.out_numel(), "verify_decode: output has ", out.numel(),
            " elements, expected ", p.out_numel());
  Rng rng(seed ^ 0x5eedull);
  const double work = double(p.num_tokens()) * c.heads * c.kv_len * (kLatentDim + kKvLoraRank);
  Verification v;
  v.full = work <= kFullCheckBudget;
  // Decode converts an fp8 cache and query exactly to its 16-bit compute dtype (that of the
  // output), so the output's dtype bounds the error whatever the inputs: a tolerance of 1e-1 for
  // fp8 let a race through in one of four rows (docs/perf-notes.md: the fp8 raw stage).
  v.tolerance = tolerance_for(p.out_dtype);
  v.non_finite = count_non_finite(out);
  const std::vector<int> requests = v.full ? all_indices(c.batch) : sample_indices(c.batch, 1, rng);
  const std::vector<int> heads = v.full ? all_indices(c.heads) : sample_indices(c.heads, 1, rng);
  const bool fp8_cache = c.kv_dtype == DType::kFP8E4M3;
  const double k_scale = fp8_cache ? p.k_scale : 1.0;
  const double q_scale = p.q_dtype == DType::kFP8E4M3 ? p.q_scale : 1.0;
  const int S = c.page_size;

  for (int b : requests) {
    // Gather request b's keys from its pages, dequantised; values are the first 512 of each key.
    const int64_t kv = p.kv_lens[size_t(b)];
    std::vector<double> keys(size_t(kv) * kLatentDim), values(size_t(kv) * kKvLoraRank);
    for (int64_t j = 0; j < kv; ++j) {
      const int32_t page = p.block_table[size_t(b) * size_t(p.max_blocks) + size_t(j / S)];
      const int64_t base = (int64_t(page) * S + j % S) * kLatentDim;
      for (int d = 0; d < kLatentDim; ++d) {
        const double x = p.kv_cache.get(base + d) * k_scale;
        keys[size_t(j) * kLatentDim + size_t(d)] = x;
        if (d < kKvLoraRank) values[size_t(j) * kKvLoraRank + size_t(d)] = x;
      }
    }
    for (int i = 0; i < c.q_len; ++i) {
      const int64_t t = int64_t(b) * c.q_len + i;
      const int64_t num_keys = std::clamp<int64_t>(kv - c.q_len + i + 1, 0, kv);
      for (int h : heads) {
        std::vector<double> q(kLatentDim);
        for (int d = 0; d < kLatentDim; ++d)
          q[size_t(d)] = p.q.get((t * c.heads + h) * kLatentDim + d) * q_scale;
        const std::vector<double> ref =
            attend(q, keys, values, num_keys, kLatentDim, kKvLoraRank, p.softmax_scale);
        v.max_rel_err = std::max(v.max_rel_err, row_error(out, (t * c.heads + h) * kKvLoraRank, ref));
        ++v.rows_checked;
      }
    }
  }
  return v;
}

Verification verify_prefill(const PrefillProblem& p, const HostBuffer& out, uint64_t seed) {
  const BenchCase& c = p.c;
  constexpr int dk = 192, dv = 128;
  MLA_CHECK(out.numel() == p.out_numel(), "verify_prefill: output has ", out.numel(),
            " elements, expected ", p.out_numel());
  Rng rng(seed ^ 0xfeedull);
  double work = 0;
  for (size_t b = 0; b + 1 < p.cu_seq_lens.size(); ++b) {
    const double len = p.cu_seq_lens[b + 1] - p.cu_seq_lens[b];
    work += len * (len + 1) / 2 * c.heads * (dk + dv);
  }
  Verification v;
  v.full = work <= kFullCheckBudget;
  v.tolerance = tolerance_for(c.kv_dtype);
  v.non_finite = count_non_finite(out);
  const bool fp8 = c.kv_dtype == DType::kFP8E4M3;
  const double q_scale = fp8 ? p.q_scale : 1.0, k_scale = fp8 ? p.k_scale : 1.0;
  const double v_scale = fp8 ? p.v_scale : 1.0;
  const int num_requests = int(p.cu_seq_lens.size()) - 1;
  const std::vector<int> requests =
      v.full ? all_indices(num_requests) : sample_indices(num_requests, 1, rng);
  const std::vector<int> heads = v.full ? all_indices(c.heads) : sample_indices(c.heads, 1, rng);

  for (int b : requests) {
    const int64_t begin = p.cu_seq_lens[size_t(b)];
    const int len = p.cu_seq_lens[size_t(b) + 1] - p.cu_seq_lens[size_t(b)];
    const std::vector<int> rows = v.full ? all_indices(len) : sample_indices(len, 5, rng);
    for (int h : heads) {
      std::vector<double> keys(size_t(len) * dk), values(size_t(len) * dv);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t tok = begin + j;
        for (int d = 0; d < dk; ++d)
          keys[size_t(j) * dk + size_t(d)] = p.k.get((tok * c.heads + h) * dk + d) * k_scale;
        for (int d = 0; d < dv; ++d)
          values[size_t(j) * dv + size_t(d)] = p.v.get((tok * c.heads + h) * dv + d) * v_scale;
      }
      for (int i : rows) {
        const int64_t tok = begin + i;
        std::vector<double> q(dk);
        for (int d = 0; d < dk; ++d) q[size_t(d)] = p.q.get((tok * c.heads + h) * dk + d) * q_scale;
        // Causal, q and kv of equal length: query i sees keys 0..i.
        const std::vector<double> ref = attend(q, keys, values, i + 1, dk, dv, p.softmax_scale);
        v.max_rel_err = std::max(v.max_rel_err, row_error(out, (tok * c.heads + h) * dv, ref));
        ++v.rows_checked;
      }
    }
  }
  return v;
}

}  // namespace mla::bench
