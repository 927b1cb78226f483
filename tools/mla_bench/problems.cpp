// mla-bench: random host inputs for the decode and prefill cases, and their FLOP / byte counts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

#include "bench.hpp"
#include "mla/error.hpp"

namespace mla::bench {

const char* op_name(Op op) { return op == Op::kDecode ? "decode" : "prefill"; }

std::string describe(const BenchCase& c) {
  std::ostringstream os;
  if (c.op == Op::kDecode) {
    os << "decode b=" << c.batch << " h=" << c.heads << " kv=";
    if (c.kv_min >= 0) os << c.kv_min << "..";
    os << c.kv_len << " q=" << c.q_len << " page=" << c.page_size << " " << dtype_name(c.kv_dtype);
    if (c.q_dtype) os << " query " << dtype_name(*c.q_dtype);
  } else {
    os << "prefill tokens=" << c.tokens << " b=" << c.batch << " h=" << c.heads << " "
       << dtype_name(c.kv_dtype);
  }
  return os.str();
}

HostBuffer::HostBuffer(DType dt, std::vector<int64_t> s) : dtype(dt), shape(std::move(s)) {
  bytes.assign(size_t(numel()) * dtype_size(dtype), 0);
}

int64_t HostBuffer::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }

int Rng::below(int n) { return int(next() % uint64_t(n)); }

double median(std::vector<double> values) {
  MLA_CHECK(!values.empty(), "median of no values");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

namespace {

constexpr int kPrefillQkDim = 192;  // qk_nope_head_dim 128 + rope 64
constexpr int kPrefillVDim = 128;

// Values uniform in [-range, range], pre-converted to a dtype: 4096 codes, so that filling a
// large cache costs 12 random bits and one copy per element.
struct UniformCodes {
  static constexpr int kCount = 4096;
  DType dtype;
  size_t elem;
  std::vector<uint8_t> codes;
  UniformCodes(DType dtype_, Rng& rng, float range)
      : dtype(dtype_), elem(dtype_size(dtype_)), codes(kCount * elem) {
    for (int i = 0; i < kCount; ++i)
      store_from_float(codes.data(), dtype, i, float((2.0 * rng.uniform() - 1.0) * range));
  }
};

// Fills elements [begin, end) of `buf` with codes drawn at random from `table`.
void fill_uniform(HostBuffer& buf, const UniformCodes& table, Rng& rng, int64_t begin, int64_t end) {
  MLA_CHECK(buf.dtype == table.dtype, "fill_uniform: table dtype differs from the buffer's");
  const size_t elem = table.elem;
  uint8_t* dst = buf.bytes.data();
  int64_t i = begin;
  while (i < end) {
    uint64_t bits = rng.next();
    for (int k = 0; k < 5 && i < end; ++k, ++i, bits >>= 12)
      std::memcpy(dst + size_t(i) * elem, table.codes.data() + (bits & (UniformCodes::kCount - 1)) * elem,
                  elem);
  }
}

void fill_uniform(HostBuffer& buf, Rng& rng, float range, int64_t begin, int64_t end) {
  fill_uniform(buf, UniformCodes(buf.dtype, rng, range), rng, begin, end);
}

void fill_nan(HostBuffer& buf, int64_t begin, int64_t end) {
  const size_t elem = dtype_size(buf.dtype);
  uint8_t nan_code[8];
  store_from_float(nan_code, buf.dtype, 0, std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = begin; i < end; ++i) std::memcpy(buf.bytes.data() + size_t(i) * elem, nan_code, elem);
}

float fp8_range_or(DType dtype, float scale, float plain) {
  return dtype == DType::kFP8E4M3 ? plain / scale : plain;
}

}  // namespace

DecodeProblem make_decode_problem(const BenchCase& c, uint64_t seed) {
  MLA_CHECK(c.batch >= 1 && c.heads >= 1 && c.kv_len >= 0 && c.q_len >= 1 && c.page_size >= 1 &&
                c.kv_min <= c.kv_len,
            "decode case out of range: ", describe(c));
  Rng rng(seed);
  DecodeProblem p;
  p.c = c;
  p.q_dtype = c.q_dtype.value_or(c.kv_dtype);
  // The output in the query's 16-bit dtype (bf16 for an fp8 query: its cache is fp8 too).
  p.out_dtype = p.q_dtype == DType::kFP16 ? DType::kFP16 : DType::kBF16;
  p.softmax_scale = float(1.0 / std::sqrt(192.0));
  if (c.kv_dtype == DType::kFP8E4M3) {
    p.q_scale = 1.0f;   // as serving engines quantise the query
    p.k_scale = 0.5f;   // stored values are twice the real ones
  }
  const int S = c.page_size;
  const int pages_per_request = (c.kv_len + S - 1) / S;
  // Block-table rows padded to whole 128-token spans, as the planner sizes them (mla/plan.hpp).
  const int span_pages = std::max(1, 128 / S);
  p.max_blocks = std::max(1, (pages_per_request + span_pages - 1) / span_pages) * span_pages;
  const int64_t used_pages = int64_t(c.batch) * pages_per_request;
  const int64_t spare_pages = used_pages / 8 + 1;
  MLA_CHECK(used_pages + spare_pages < (int64_t(1) << 31), "decode case needs too many pages: ",
            describe(c));
  p.num_pages = int(used_pages + spare_pages);

  // Pages scattered randomly: request b's j-th page is a random, distinct page of the pool.
  std::vector<int32_t> perm(size_t(p.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  for (int i = p.num_pages - 1; i > 0; --i) std::swap(perm[size_t(i)], perm[size_t(rng.below(i + 1))]);
  p.block_table.assign(size_t(c.batch) * size_t(p.max_blocks), -1);
  // Every request kv_len tokens, or (kv_min >= 0) a length drawn from [kv_min, kv_len]; each
  // holds kv_len tokens' pages, the ones past its length unused.
  p.kv_lens.assign(size_t(c.batch), c.kv_len);
  if (c.kv_min >= 0)
    for (int32_t& kv : p.kv_lens) kv = c.kv_min + int32_t(rng.next() % (uint64_t(c.kv_len - c.kv_min) + 1));
  std::vector<int32_t> tokens_in_page(size_t(p.num_pages), 0);
  for (int b = 0; b < c.batch; ++b) {
    const int kv = p.kv_lens[size_t(b)];
    for (int j = 0; j < pages_per_request; ++j) {
      const int32_t page = perm[size_t(b) * size_t(pages_per_request) + size_t(j)];
      p.block_table[size_t(b) * size_t(p.max_blocks) + size_t(j)] = page;
      tokens_in_page[size_t(page)] = std::clamp(kv - j * S, 0, S);
    }
  }

  // The cache: random values in the slots that hold tokens, NaN everywhere else (spare pages and
  // the tail of each request's last page), so that a kernel reading past kv_len shows up.
  p.kv_cache = HostBuffer(c.kv_dtype, {p.num_pages, S, kLatentDim});
  const UniformCodes kv_codes(c.kv_dtype, rng, fp8_range_or(c.kv_dtype, p.k_scale, 1.0f));
  for (int page = 0; page < p.num_pages; ++page) {
    const int64_t base = int64_t(page) * S * kLatentDim;
    const int64_t filled = int64_t(tokens_in_page[size_t(page)]) * kLatentDim;
    fill_uniform(p.kv_cache, kv_codes, rng, base, base + filled);
    fill_nan(p.kv_cache, base + filled, base + int64_t(S) * kLatentDim);
  }
  p.q = HostBuffer(p.q_dtype, {p.num_tokens(), c.heads, kLatentDim});
  fill_uniform(p.q, rng, fp8_range_or(p.q_dtype, p.q_scale, 1.0f), 0, p.q.numel());
  return p;
}

PrefillProblem make_prefill_problem(const BenchCase& c, uint64_t seed) {
  MLA_CHECK(c.batch >= 1 && c.heads >= 1 && c.tokens >= c.batch,
            "prefill case out of range (need tokens >= batch >= 1): ", describe(c));
  Rng rng(seed);
  PrefillProblem p;
  p.c = c;
  p.out_dtype = c.kv_dtype == DType::kFP16 ? DType::kFP16 : DType::kBF16;
  p.softmax_scale = float(1.0 / std::sqrt(double(kPrefillQkDim)));
  if (c.kv_dtype == DType::kFP8E4M3) {
    p.q_scale = 1.0f;
    p.k_scale = 0.5f;
    p.v_scale = 0.25f;
  }
  // Ragged lengths: weights in [0.5, 1.5), scaled to sum to `tokens`, each at least 1.
  std::vector<double> weights(size_t(c.batch));
  for (double& w : weights) w = 0.5 + rng.uniform();
  const double total_weight = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> lens(size_t(c.batch));
  int64_t assigned = 0;
  for (int b = 0; b < c.batch; ++b) {
    lens[size_t(b)] = std::max<int64_t>(1, int64_t(double(c.tokens - c.batch) * weights[size_t(b)] / total_weight) + 1);
    assigned += lens[size_t(b)];
  }
  lens[size_t(rng.below(c.batch))] += c.tokens - assigned;  // floor() leaves a small remainder
  p.cu_seq_lens.assign(size_t(c.batch) + 1, 0);
  for (int b = 0; b < c.batch; ++b) {
    MLA_CHECK(lens[size_t(b)] >= 1, "prefill: bad ragged split for ", describe(c));
    p.cu_seq_lens[size_t(b) + 1] = int32_t(p.cu_seq_lens[size_t(b)] + lens[size_t(b)]);
    p.max_seq_len = std::max(p.max_seq_len, int(lens[size_t(b)]));
  }
  MLA_CHECK(p.cu_seq_lens.back() == c.tokens, "prefill: ragged split does not sum to tokens");

  p.q = HostBuffer(c.kv_dtype, {c.tokens, c.heads, kPrefillQkDim});
  p.k = HostBuffer(c.kv_dtype, {c.tokens, c.heads, kPrefillQkDim});
  p.v = HostBuffer(c.kv_dtype, {c.tokens, c.heads, kPrefillVDim});
  fill_uniform(p.q, rng, fp8_range_or(c.kv_dtype, p.q_scale, 1.0f), 0, p.q.numel());
  fill_uniform(p.k, rng, fp8_range_or(c.kv_dtype, p.k_scale, 1.0f), 0, p.k.numel());
  fill_uniform(p.v, rng, fp8_range_or(c.kv_dtype, p.v_scale, 1.0f), 0, p.v.numel());
  return p;
}

MlaDecodeArgs decode_args(const DecodeProblem& p, const DecodeBuffers& buffers, Device device) {
  const BenchCase& c = p.c;
  MlaDecodeArgs a;
  a.q = TensorView::contiguous(buffers.q, p.q_dtype, {p.num_tokens(), c.heads, kLatentDim}, device);
  a.kv_cache = TensorView::contiguous(buffers.kv_cache, c.kv_dtype,
                                      {p.num_pages, c.page_size, kLatentDim}, device);
  a.block_table = TensorView::contiguous(buffers.block_table, DType::kInt32,
                                         {c.batch, p.max_blocks}, device);
  a.kv_lens = TensorView::contiguous(buffers.kv_lens, DType::kInt32, {c.batch}, device);
  a.q_len = c.q_len;
  a.max_q_len = c.q_len;
  a.softmax_scale = p.softmax_scale;
  a.q_scale = p.q_scale;
  a.k_scale = p.k_scale;
  a.out = TensorView::contiguous(buffers.out, p.out_dtype, {p.num_tokens(), c.heads, kKvLoraRank},
                                 device);
  return a;
}

MhaPrefillArgs prefill_args(const PrefillProblem& p, const PrefillBuffers& buffers, Device device) {
  const BenchCase& c = p.c;
  MhaPrefillArgs a;
  a.q = TensorView::contiguous(buffers.q, c.kv_dtype, {c.tokens, c.heads, kPrefillQkDim}, device);
  a.k = TensorView::contiguous(buffers.k, c.kv_dtype, {c.tokens, c.heads, kPrefillQkDim}, device);
  a.v = TensorView::contiguous(buffers.v, c.kv_dtype, {c.tokens, c.heads, kPrefillVDim}, device);
  const int64_t num_requests = int64_t(p.cu_seq_lens.size());
  a.cu_q_lens = TensorView::contiguous(buffers.cu_seq_lens, DType::kInt32, {num_requests}, device);
  a.cu_kv_lens = a.cu_q_lens;
  a.max_q_len = p.max_seq_len;
  a.max_kv_len = p.max_seq_len;
  a.causal = true;
  a.softmax_scale = p.softmax_scale;
  a.q_scale = p.q_scale;
  a.k_scale = p.k_scale;
  a.v_scale = p.v_scale;
  a.out = TensorView::contiguous(buffers.out, p.out_dtype, {c.tokens, c.heads, kPrefillVDim}, device);
  return a;
}

Work decode_work(const DecodeProblem& p) {
  const BenchCase& c = p.c;
  double keys_seen = 0;
  for (int b = 0; b < c.batch; ++b) {
    const int64_t kv = p.kv_lens[size_t(b)];
    for (int i = 0; i < c.q_len; ++i)
      keys_seen += double(std::clamp<int64_t>(kv - c.q_len + i + 1, 0, kv));
  }
  Work w;
  w.flops = 2.0 * (kLatentDim + kKvLoraRank) * c.heads * keys_seen;
  double cache_tokens = 0;
  for (int32_t kv : p.kv_lens) cache_tokens += kv;
  w.bytes = cache_tokens * kLatentDim * double(dtype_size(c.kv_dtype)) +
            double(p.q.size_bytes()) + double(p.out_numel()) * double(dtype_size(p.out_dtype));
  return w;
}

Work prefill_work(const PrefillProblem& p) {
  double keys_seen = 0;
  for (size_t b = 0; b + 1 < p.cu_seq_lens.size(); ++b) {
    const double len = p.cu_seq_lens[b + 1] - p.cu_seq_lens[b];
    keys_seen += len * (len + 1) / 2;  // causal, no prefix: query i sees i + 1 keys
  }
  Work w;
  w.flops = 2.0 * (kPrefillQkDim + kPrefillVDim) * p.c.heads * keys_seen;
  w.bytes = double(p.q.size_bytes() + p.k.size_bytes() + p.v.size_bytes()) +
            double(p.out_numel()) * double(dtype_size(p.out_dtype));
  return w;
}

}  // namespace mla::bench
