// append_latent_kv and build_block_table on the GPU, each against the CPU implementation on the
// same random inputs (the public op called once with CPU tensors, once with CUDA tensors) and
// against an expected result written out here. Both ops move values without arithmetic (fp8:
// one division by k_scale, done the same way on both sides), so the comparison is bit for bit
// over the whole NaN-poisoned pool / block table. Covered: every page size 1..128, bf16/fp16/fp32
// inputs into bf16/fp16/fp8 pools, int32/int64 indices, T = 0, 1 and odd, aligned (16-byte
// vector) and misaligned (element-wise) strided token rows, batches large enough for the
// grid-stride loop, out-of-range indices (skipped on the device), a non-blocking stream, and
// capture into a CUDA graph (proves: the stream is honoured, no host sync, no allocation).
#include <algorithm>
#include <limits>
#include <numeric>

#include "gpu_util.hpp"
#include "mla/ops.hpp"

namespace {

using mla::DType;
using mla::TensorView;
using mla::test::bitwise_equal;
using mla::test::CudaStream;
using mla::test::Launch;
using mla::test::launch_op;
using mla::test::DeviceTensor;
using mla::test::HostTensor;

constexpr int kNope = mla::kKvLoraRank;  // 512
constexpr int kRope = mla::kRopeDim;     // 64
constexpr int kEntry = mla::kLatentDim;  // 576

// Random magnitude 2^U(lo, hi) * scale with a random sign: every binade of the target dtype
// (subnormals, and for fp8 saturation past 448) is exercised.
float log_uniform(std::mt19937_64& rng, double lo, double hi, double scale) {
  std::uniform_real_distribution<double> exponent(lo, hi);
  const double magnitude = std::exp2(exponent(rng)) * scale;
  return float((rng() & 1) ? -magnitude : magnitude);
}

// ---------------------------------------------------------------------------------------------
// append_latent_kv

struct AppendCase {
  DType input_dtype;
  DType cache_dtype;
  DType loc_dtype;
  int page_size;
  int num_pages;
  int num_tokens;
  float k_scale;
  int row_pad;        // -1: separate contiguous k_nope/k_pe; else slices of a [T, 576 + pad] buffer
  int bad_locs;       // tokens given an out-of-range slot (GPU skips them; the CPU run gets -1)
  uint64_t seed;
  int specials = 0;   // input elements replaced by NaN, -NaN, +-inf, +-0, +-huge or tiny values
};

std::string describe(const AppendCase& c) {
  std::ostringstream os;
  os << "input " << mla::dtype_name(c.input_dtype) << ", cache " << mla::dtype_name(c.cache_dtype)
     << ", loc " << mla::dtype_name(c.loc_dtype) << ", page_size " << c.page_size << ", pages "
     << c.num_pages << ", tokens " << c.num_tokens << ", k_scale " << c.k_scale << ", row_pad "
     << c.row_pad << ", bad_locs " << c.bad_locs << ", specials " << c.specials;
  return os.str();
}

void run_append_case(const AppendCase& c, Launch launch = Launch::kDefaultStream) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int64_t T = c.num_tokens, S = c.page_size, P = c.num_pages;
  const bool fp8 = c.cache_dtype == DType::kFP8E4M3;
  ASSERT_LE(T, P * S) << "test setup: more tokens than slots";

  // Inputs: one buffer holding both (strided rows) or two contiguous tensors.
  const bool sliced = c.row_pad >= 0;
  const int64_t row = sliced ? kEntry + c.row_pad : 0;
  HostTensor nope_buf(c.input_dtype, {T, sliced ? row : int64_t(kNope)});
  HostTensor pe_buf(c.input_dtype, {T, int64_t(kRope)});
  for (int64_t i = 0; i < nope_buf.numel(); ++i)
    nope_buf.set(i, fp8 ? log_uniform(rng, -12, 9.2, c.k_scale) : log_uniform(rng, -18, 6, 1.0));
  for (int64_t i = 0; i < pe_buf.numel(); ++i)
    pe_buf.set(i, fp8 ? log_uniform(rng, -12, 9.2, c.k_scale) : log_uniform(rng, -18, 6, 1.0));
  // Values whose conversion the hardware and the CPU path must agree on bit for bit: NaN of
  // either sign, infinities, zeros of either sign, values past every dtype's range, subnormals.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {nan, -nan, inf, -inf, 0.0f, -0.0f, 3.0e38f, -3.0e38f, 1.0e-40f,
                            -1.0e-40f, 70000.0f, -70000.0f, 449.0f * c.k_scale, -465.0f * c.k_scale};
  for (int i = 0; i < c.specials && T > 0; ++i) {  // into the values the op reads
    const int64_t t = int64_t(rng() % uint64_t(T)), d = int64_t(rng() % kEntry);
    const float value = specials[size_t(i) % std::size(specials)];
    if (sliced) nope_buf.set(t * row + d, value);
    else if (d < kNope) nope_buf.set(t * kNope + d, value);
    else pe_buf.set(t * kRope + d - kNope, value);
  }
  DeviceTensor d_nope_buf(nope_buf), d_pe_buf(pe_buf);
  TensorView k_nope, k_pe, d_k_nope, d_k_pe;
  if (sliced) {
    k_nope = mla::test::strided_host_view(nope_buf, {T, kNope}, {row, 1});
    k_pe = mla::test::strided_host_view(nope_buf, {T, kRope}, {row, 1}, kNope);
    d_k_nope = d_nope_buf.view({T, kNope}, {row, 1});
    d_k_pe = d_nope_buf.view({T, kRope}, {row, 1}, kNope);
  } else {
    k_nope = nope_buf.view();
    k_pe = pe_buf.view();
    d_k_nope = d_nope_buf.view();
    d_k_pe = d_pe_buf.view();
  }
  auto input_value = [&](int64_t t, int64_t d) {  // element d of token t's 576-wide latent
    const TensorView& src = d < kNope ? k_nope : k_pe;
    return mla::load_as_float(src.data, src.dtype, t * src.stride[0] + (d < kNope ? d : d - kNope));
  };

  // Distinct random slots; about one token in five is padding (-1); the first `bad_locs` tokens
  // (in a shuffled order) get slots past the pool or below -1.
  std::vector<int64_t> slots(static_cast<size_t>(P * S));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int64_t> gpu_slot(static_cast<size_t>(T)), cpu_slot(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) gpu_slot[size_t(t)] = (rng() % 5 == 0) ? -1 : slots[size_t(t)];
  std::vector<int64_t> order(static_cast<size_t>(T));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int64_t int_max = c.loc_dtype == DType::kInt32 ? INT32_MAX : INT64_MAX;
  const int64_t int_min = c.loc_dtype == DType::kInt32 ? INT32_MIN : INT64_MIN;
  const int64_t bad_values[] = {P * S, P * S + 1, int_max, -2, int_min, P * S * 1000 + 7};
  for (int i = 0; i < c.bad_locs && i < T; ++i)
    gpu_slot[size_t(order[size_t(i)])] = bad_values[size_t(i) % std::size(bad_values)];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = gpu_slot[size_t(t)];
    cpu_slot[size_t(t)] = (s < 0 || s >= P * S) ? -1 : s;
  }
  HostTensor loc_cpu = mla::test::index_tensor(c.loc_dtype, cpu_slot);
  HostTensor loc_gpu = mla::test::index_tensor(c.loc_dtype, gpu_slot);
  DeviceTensor d_loc(loc_gpu);

  HostTensor cache_cpu(c.cache_dtype, {P, S, kEntry});
  cache_cpu.fill_nan();
  HostTensor cache_gpu = cache_cpu;
  DeviceTensor d_cache(cache_gpu);

  mla::AppendLatentKvArgs args;
  args.k_nope = k_nope;
  args.k_pe = k_pe;
  args.loc = loc_cpu.view();
  args.kv_cache = cache_cpu.view();
  args.k_scale = c.k_scale;
  ASSERT_NO_THROW(mla::append_latent_kv(args));

  mla::AppendLatentKvArgs d_args = args;
  d_args.k_nope = d_k_nope;
  d_args.k_pe = d_k_pe;
  d_args.loc = d_loc.view();
  d_args.kv_cache = d_cache.view();
  ASSERT_NO_FATAL_FAILURE(launch_op(launch, [&](mla::Stream s) { mla::append_latent_kv(d_args, s); }));
  d_cache.download();

  // GPU against the CPU implementation, bit for bit over the whole pool.
  EXPECT_TRUE(bitwise_equal(cache_gpu, cache_cpu));

  // And against the expected pool written out here: each valid token's converted latent
  // (fp8: of x / k_scale), NaN everywhere else.
  HostTensor expected(c.cache_dtype, {P, S, kEntry});
  expected.fill_nan();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = cpu_slot[size_t(t)];
    if (slot < 0) continue;
    for (int64_t d = 0; d < kEntry; ++d) {
      const float x = input_value(t, d);
      expected.set(slot * kEntry + d, fp8 ? x / c.k_scale : x);
    }
  }
  EXPECT_TRUE(bitwise_equal(cache_gpu, expected));
}

TEST(GpuAppendLatentKv, EveryPageSizeDtypeAndLayout) {
  MLA_REQUIRE_GPU();
  const DType input_dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  const DType cache_dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP8E4M3};
  const int row_pads[] = {-1, 0, 13, 8};  // contiguous, [T, 576] aligned, misaligned, aligned+pad
  const int token_counts[] = {0, 1, 37};
  uint64_t seed = 100;
  int variant = 0;
  for (int page_size = 1; page_size <= 128; page_size *= 2) {
    const int num_pages = std::max(2, 96 / page_size) + 1;
    for (DType input_dtype : input_dtypes)
      for (DType cache_dtype : cache_dtypes)
        for (int tokens : token_counts) {
          ++variant;
          AppendCase c;
          c.input_dtype = input_dtype;
          c.cache_dtype = cache_dtype;
          c.loc_dtype = variant % 2 ? DType::kInt32 : DType::kInt64;
          c.page_size = page_size;
          c.num_pages = num_pages;
          c.num_tokens = std::min(tokens, num_pages * page_size);
          c.k_scale = cache_dtype == DType::kFP8E4M3 ? (variant % 3 ? 0.0375f : 3.0f) : 1.0f;
          c.row_pad = row_pads[variant % 4];
          c.bad_locs = 0;
          c.seed = seed++;
          run_append_case(c);
          if (HasFailure()) return;
        }
  }
}

TEST(GpuAppendLatentKv, LargeBatchUsesTheGridStrideLoop) {
  MLA_REQUIRE_GPU();
  // 9001 tokens * 72 chunks is more threads than one grid wave (16 blocks of 256 per SM).
  run_append_case({DType::kBF16, DType::kBF16, DType::kInt64, 16, 600, 9001, 1.0f, -1, 0, 7});
  run_append_case({DType::kFP32, DType::kFP8E4M3, DType::kInt32, 64, 150, 9001, 0.25f, 0, 0, 8});
  run_append_case({DType::kFP16, DType::kFP16, DType::kInt32, 128, 75, 9001, 1.0f, 13, 0, 9});
}

TEST(GpuAppendLatentKv, OutOfRangeSlotsAreSkippedOnTheDevice) {
  MLA_REQUIRE_GPU();
  // Slots >= P * S or < -1 (the CPU throws on them): the kernel writes nothing for those tokens
  // and everything else exactly as the CPU does with those tokens set to -1.
  for (DType loc_dtype : {DType::kInt32, DType::kInt64})
    for (int page_size : {1, 16, 128}) {
      const int pages = 256 / page_size + 1;
      run_append_case({DType::kBF16, DType::kFP8E4M3, loc_dtype, page_size, pages, 41, 0.5f, -1, 6, 11});
      run_append_case({DType::kFP32, DType::kBF16, loc_dtype, page_size, pages, 1, 1.0f, 0, 1, 12});
    }
}

// AppendLatentKvArgs::check_metadata: a slot out of range is reported as the CPU path reports it
// (naming loc[t]) and nothing is written; good slots then write as without it; and the check,
// which waits for a host copy, is refused inside a CUDA graph capture.
TEST(GpuAppendLatentKv, CheckMetadataReportsOutOfRangeSlots) {
  MLA_REQUIRE_GPU();
  const int64_t P = 5, S = 16, T = 7;
  std::mt19937_64 rng(31);
  HostTensor nope(DType::kBF16, {T, kNope}), pe(DType::kBF16, {T, kRope});
  for (int64_t i = 0; i < nope.numel(); ++i) nope.set(i, log_uniform(rng, -3, 3, 1.0));
  for (int64_t i = 0; i < pe.numel(); ++i) pe.set(i, log_uniform(rng, -3, 3, 1.0));
  DeviceTensor d_nope(nope), d_pe(pe);
  for (DType loc_dtype : {DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(loc_dtype == DType::kInt32 ? "int32 loc" : "int64 loc");
    HostTensor cache(DType::kBF16, {P, S, kEntry});
    cache.fill_nan();
    const HostTensor poisoned = cache;
    DeviceTensor d_cache(cache);
    std::vector<int64_t> slots = {3, 17, -1, P * S, 40, 0, 79};
    HostTensor bad = mla::test::index_tensor(loc_dtype, slots);
    DeviceTensor d_bad(bad);
    mla::AppendLatentKvArgs a;
    a.k_nope = d_nope.view();
    a.k_pe = d_pe.view();
    a.loc = d_bad.view();
    a.kv_cache = d_cache.view();
    a.check_metadata = true;
    EXPECT_TRUE(mla::test::throws_error([&] { mla::append_latent_kv(a); },
                                        {"append_latent_kv: loc[3] = 80", "out of range", "[0, 80)"}));
    d_cache.download();
    EXPECT_TRUE(bitwise_equal(cache, poisoned)) << "the pool was written";

    slots[3] = 41;
    HostTensor good = mla::test::index_tensor(loc_dtype, slots);
    DeviceTensor d_good(good);
    a.loc = d_good.view();
    EXPECT_NO_THROW(mla::append_latent_kv(a));
    MLA_TEST_CUDA(cudaDeviceSynchronize());
    d_cache.download();
    HostTensor expected = poisoned;
    mla::AppendLatentKvArgs c = a;
    c.k_nope = nope.view();
    c.k_pe = pe.view();
    c.loc = good.view();
    c.kv_cache = expected.view();
    mla::append_latent_kv(c);
    EXPECT_TRUE(bitwise_equal(cache, expected));

    EXPECT_TRUE(mla::test::check_metadata_refused_during_capture([&](mla::Stream s) { mla::append_latent_kv(a, s); }));
  }
}

TEST(GpuAppendLatentKv, NonBlockingStreamAndCudaGraph) {
  MLA_REQUIRE_GPU();
  run_append_case({DType::kBF16, DType::kBF16, DType::kInt64, 32, 9, 37, 1.0f, -1, 0, 21},
                  Launch::kNonBlockingStream);
  run_append_case({DType::kFP32, DType::kFP8E4M3, DType::kInt32, 4, 40, 101, 0.125f, 13, 2, 22},
                  Launch::kNonBlockingStream);
  run_append_case({DType::kFP16, DType::kFP16, DType::kInt32, 64, 5, 37, 1.0f, 0, 0, 23},
                  Launch::kCudaGraph);
  run_append_case({DType::kBF16, DType::kFP8E4M3, DType::kInt64, 1, 100, 33, 2.0f, -1, 1, 24},
                  Launch::kCudaGraph);
}

TEST(GpuAppendLatentKv, NonFiniteAndOutOfRangeValuesConvertAsOnTheCpu) {
  MLA_REQUIRE_GPU();
  // Every input dtype into every pool dtype, vectorised and element-wise rows: the device's
  // conversions (fp8: the hardware's saturating cvt) against the CPU path's, bit for bit.
  uint64_t seed = 300;
  for (DType input_dtype : {DType::kBF16, DType::kFP16, DType::kFP32})
    for (DType cache_dtype : {DType::kBF16, DType::kFP16, DType::kFP8E4M3})
      for (int row_pad : {-1, 13}) {
        AppendCase c{input_dtype, cache_dtype, DType::kInt32, 16, 9, 37, 1.0f, row_pad, 0, seed++};
        c.k_scale = cache_dtype == DType::kFP8E4M3 ? 0.5f : 1.0f;
        c.specials = 400;
        run_append_case(c);
        if (HasFailure()) return;
      }
}

// ---------------------------------------------------------------------------------------------
// build_block_table

constexpr int32_t kTablePoison = 0x5eed5eed;

struct TableCase {
  int page_size;
  std::vector<int64_t> seq_lens;
  int extra_blocks;     // block-table width beyond what the longest request needs
  DType index_dtype;    // req_pool_indices
  DType seq_len_dtype;  // seq_lens
  int row_pad;          // extra int32s per row of req_to_token and block_table (strided rows)
  uint64_t seed;
  // Device-only bad input (the CPU throws; the GPU leaves the affected entries untouched):
  std::vector<int64_t> bad_rows;       // requests given an out-of-range req index or seq_len
  std::vector<int64_t> negative_slot;  // requests whose first page's token slot is negative
};

void run_table_case(const TableCase& c, Launch launch = Launch::kDefaultStream) {
  std::ostringstream trace;
  trace << "page_size " << c.page_size << ", B " << c.seq_lens.size() << ", extra_blocks "
        << c.extra_blocks << ", index " << mla::dtype_name(c.index_dtype) << ", seq_lens "
        << mla::dtype_name(c.seq_len_dtype) << ", row_pad " << c.row_pad;
  SCOPED_TRACE(trace.str());

  std::mt19937_64 rng(c.seed);
  const int64_t S = c.page_size;
  const int64_t B = int64_t(c.seq_lens.size());
  const int64_t longest = B ? *std::max_element(c.seq_lens.begin(), c.seq_lens.end()) : 0;
  const int64_t max_blocks = (longest + S - 1) / S + c.extra_blocks;
  const int64_t max_context_len = longest + 3;
  const int64_t num_req_slots = B + 3;
  const int64_t r2t_row = max_context_len + c.row_pad;
  const int64_t table_row = max_blocks + c.row_pad;

  // Each request owns a random row of req_to_token and random pages; positions at or past its
  // length hold negative garbage that must never be read.
  std::vector<int64_t> rows(static_cast<size_t>(num_req_slots));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  int64_t total_blocks = 1;
  for (int64_t l : c.seq_lens) total_blocks += (l + S - 1) / S;
  std::vector<int64_t> pages(size_t(total_blocks) * 2);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  HostTensor r2t_buf(DType::kInt32, {num_req_slots, std::max<int64_t>(r2t_row, 1)});
  for (int64_t i = 0; i < r2t_buf.numel(); ++i) r2t_buf.i32(i) = -int32_t(rng() % 1000) - 7;
  size_t next_page = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows[size_t(b)];
    for (int64_t pos = 0; pos < c.seq_lens[size_t(b)]; ++pos) {
      if (pos % S == 0) ++next_page;
      // Any offset within the page: the table must divide, not assume offset 0.
      const int64_t offset = (pos % S == 0) ? int64_t(rng() % uint64_t(S)) : pos % S;
      r2t_buf.i32(r * r2t_row + pos) = int32_t(pages[next_page] * S + offset);
    }
  }
  std::vector<int64_t> req_index(static_cast<size_t>(B)), seq_len(c.seq_lens);
  for (int64_t b = 0; b < B; ++b) req_index[size_t(b)] = rows[size_t(b)];
  for (int64_t b : c.negative_slot) r2t_buf.i32(rows[size_t(b)] * r2t_row) = -5;

  // The device sees the bad values; the CPU sees valid ones and its result for those rows (or
  // entries) is replaced by the -1 the device must write there.
  std::vector<int64_t> d_req_index = req_index, d_seq_len = seq_len;
  const int64_t idx_max = c.index_dtype == DType::kInt32 ? INT32_MAX : INT64_MAX;
  const int64_t len_max = c.seq_len_dtype == DType::kInt32 ? INT32_MAX : INT64_MAX;
  for (size_t i = 0; i < c.bad_rows.size(); ++i) {
    const size_t b = size_t(c.bad_rows[i]);
    switch (i % 6) {
      case 0: d_req_index[b] = num_req_slots; break;
      case 1: d_req_index[b] = -1; break;
      case 2: d_req_index[b] = idx_max; break;
      case 3: d_seq_len[b] = -3; break;
      case 4: d_seq_len[b] = max_blocks * S + 1; break;
      default: d_seq_len[b] = len_max; break;
    }
  }
  HostTensor r2t_cpu = r2t_buf;
  for (int64_t b : c.negative_slot) r2t_cpu.i32(rows[size_t(b)] * r2t_row) = 0;

  HostTensor idx_cpu = mla::test::index_tensor(c.index_dtype, req_index);
  HostTensor len_cpu = mla::test::index_tensor(c.seq_len_dtype, seq_len);
  HostTensor idx_gpu = mla::test::index_tensor(c.index_dtype, d_req_index);
  HostTensor len_gpu = mla::test::index_tensor(c.seq_len_dtype, d_seq_len);
  HostTensor table_cpu(DType::kInt32, {B, std::max<int64_t>(table_row, 1)});
  for (int64_t i = 0; i < table_cpu.numel(); ++i) table_cpu.i32(i) = kTablePoison;
  HostTensor table_gpu = table_cpu;
  DeviceTensor d_r2t(r2t_buf), d_idx(idx_gpu), d_len(len_gpu), d_table(table_gpu);

  mla::BuildBlockTableArgs args;
  args.req_to_token = mla::test::strided_host_view(r2t_cpu, {num_req_slots, max_context_len}, {r2t_row, 1});
  args.req_pool_indices = idx_cpu.view();
  args.seq_lens = len_cpu.view();
  args.page_size = c.page_size;
  args.block_table = mla::test::strided_host_view(table_cpu, {B, max_blocks}, {table_row, 1});
  ASSERT_NO_THROW(mla::build_block_table(args));

  mla::BuildBlockTableArgs d_args = args;
  d_args.req_to_token = d_r2t.view({num_req_slots, max_context_len}, {r2t_row, 1});
  d_args.req_pool_indices = d_idx.view();
  d_args.seq_lens = d_len.view();
  d_args.block_table = d_table.view({B, max_blocks}, {table_row, 1});
  ASSERT_NO_FATAL_FAILURE(launch_op(launch, [&](mla::Stream s) { mla::build_block_table(d_args, s); }));
  d_table.download();

  // Expected table written out here: page ids, then -1; bad rows and entries -1 (never the
  // poison an earlier call left); padding columns keep the poison.
  HostTensor expected(DType::kInt32, {B, std::max<int64_t>(table_row, 1)});
  for (int64_t i = 0; i < expected.numel(); ++i) expected.i32(i) = kTablePoison;
  HostTensor cpu_masked = table_cpu;
  for (int64_t b = 0; b < B; ++b) {
    const bool bad_row = std::find(c.bad_rows.begin(), c.bad_rows.end(), b) != c.bad_rows.end();
    const bool bad_first = std::find(c.negative_slot.begin(), c.negative_slot.end(), b) != c.negative_slot.end();
    const int64_t num_blocks = (seq_len[size_t(b)] + S - 1) / S;
    for (int64_t j = 0; j < max_blocks; ++j) {
      int32_t v = j < num_blocks ? r2t_buf.i32(req_index[size_t(b)] * r2t_row + j * S) / int32_t(S) : -1;
      if (bad_row || (bad_first && j == 0)) {
        v = -1;
        cpu_masked.i32(b * table_row + j) = -1;
      }
      expected.i32(b * table_row + j) = v;
    }
  }
  EXPECT_TRUE(bitwise_equal(table_gpu, cpu_masked));
  EXPECT_TRUE(bitwise_equal(table_gpu, expected));
}

TEST(GpuBuildBlockTable, EveryPageSizeAndIndexDtype) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 300;
  int variant = 0;
  for (int S = 1; S <= 128; S *= 2) {
    for (int batch : {0, 1, 7, 33}) {
      ++variant;
      std::mt19937_64 rng(seed);
      std::vector<int64_t> lens;
      // Empty, one token, exactly one page, one past a page, and random lengths up to 5 pages.
      const int64_t specials[] = {0, 1, S, S + 1, 3 * S, 2 * S - 1};
      for (int b = 0; b < batch; ++b)
        lens.push_back(b < 6 ? specials[b] : int64_t(rng() % uint64_t(5 * S + 1)));
      const DType idx = variant % 2 ? DType::kInt32 : DType::kInt64;
      const DType len = variant % 3 ? DType::kInt64 : DType::kInt32;
      run_table_case({S, lens, variant % 4, idx, len, variant % 3 == 0 ? 5 : 0, seed++, {}, {}});
      if (HasFailure()) return;
    }
  }
}

TEST(GpuBuildBlockTable, WideTablesUseTheGridStrideLoop) {
  MLA_REQUIRE_GPU();
  // 12000 columns (more than 64 blocks of 128 threads) and requests of very different lengths.
  run_table_case({1, {12000, 0, 7, 11999}, 3, DType::kInt64, DType::kInt32, 0, 41, {}, {}});
  run_table_case({2, {20001, 1, 2}, 0, DType::kInt32, DType::kInt64, 9, 42, {}, {}});
}

TEST(GpuBuildBlockTable, BadIndicesWriteMinusOneOnTheDevice) {
  MLA_REQUIRE_GPU();
  for (int S : {1, 8, 128}) {
    std::vector<int64_t> lens;
    for (int b = 0; b < 13; ++b) lens.push_back(1 + (b * 7 * S) / 3);
    run_table_case({S, lens, 2, DType::kInt32, DType::kInt32, 0, 50, {0, 2, 4, 6, 8, 10}, {3}});
    run_table_case({S, lens, 1, DType::kInt64, DType::kInt64, 3, 51, {1, 3, 5, 7, 9, 11}, {12}});
  }
}

// BuildBlockTableArgs::check_metadata: a request index out of range, a length past the table and
// a negative token slot of a page in use are reported as the CPU path reports them and nothing is
// written; a good batch then gives the CPU path's table; the check is refused during capture.
TEST(GpuBuildBlockTable, CheckMetadataReportsBadIndicesLengthsAndSlots) {
  MLA_REQUIRE_GPU();
  const int64_t R = 3, max_context = 40, S = 8, max_blocks = 5;
  HostTensor req_to_token(DType::kInt32, {R, max_context});
  for (int64_t i = 0; i < req_to_token.numel(); ++i) req_to_token.i32(i) = int32_t(1000 + i);
  req_to_token.i32(2 * max_context + 3 * S) = -5;  // request slot 2, page 3
  DeviceTensor d_r2t(req_to_token);
  for (DType index_dtype : {DType::kInt32, DType::kInt64}) {
    SCOPED_TRACE(index_dtype == DType::kInt32 ? "int32 indices" : "int64 indices");
    struct Bad {
      std::vector<int64_t> rpi, seq;
      std::initializer_list<const char*> fragments;
    };
    const Bad cases[] = {
        {{0, 3}, {5, 9}, {"build_block_table: req_pool_indices[1] = 3", "out of range [0, 3)"}},
        {{1, 0}, {41, 2}, {"build_block_table: seq_lens[0] = 41", "needs more pages than block_table holds"}},
        {{0, 2}, {16, 25}, {"req_to_token[2, 24] = -5", "is negative", "request 1"}},
    };
    for (const Bad& bad : cases) {
      HostTensor table(DType::kInt32, {int64_t(bad.rpi.size()), max_blocks});
      for (int64_t i = 0; i < table.numel(); ++i) table.i32(i) = 77;
      const HostTensor before = table;
      HostTensor rpi = mla::test::index_tensor(index_dtype, bad.rpi), seq = mla::test::index_tensor(index_dtype, bad.seq);
      DeviceTensor d_table(table), d_rpi(rpi), d_seq(seq);
      mla::BuildBlockTableArgs a;
      a.req_to_token = d_r2t.view();
      a.req_pool_indices = d_rpi.view();
      a.seq_lens = d_seq.view();
      a.page_size = int(S);
      a.block_table = d_table.view();
      a.check_metadata = true;
      EXPECT_TRUE(mla::test::throws_error([&] { mla::build_block_table(a); }, bad.fragments));
      d_table.download();
      EXPECT_TRUE(bitwise_equal(table, before)) << "the table was written";
    }
    HostTensor table(DType::kInt32, {2, max_blocks}), expected(DType::kInt32, {2, max_blocks});
    HostTensor rpi = mla::test::index_tensor(index_dtype, {2, 1}), seq = mla::test::index_tensor(index_dtype, {24, 40});
    DeviceTensor d_table(table), d_rpi(rpi), d_seq(seq);
    mla::BuildBlockTableArgs a;
    a.req_to_token = d_r2t.view();
    a.req_pool_indices = d_rpi.view();
    a.seq_lens = d_seq.view();
    a.page_size = int(S);
    a.block_table = d_table.view();
    a.check_metadata = true;
    EXPECT_NO_THROW(mla::build_block_table(a));
    MLA_TEST_CUDA(cudaDeviceSynchronize());
    d_table.download();
    mla::BuildBlockTableArgs c = a;
    c.req_to_token = req_to_token.view();
    c.req_pool_indices = rpi.view();
    c.seq_lens = seq.view();
    c.block_table = expected.view();
    mla::build_block_table(c);
    EXPECT_TRUE(bitwise_equal(table, expected));
    EXPECT_TRUE(mla::test::check_metadata_refused_during_capture([&](mla::Stream s) { mla::build_block_table(a, s); }));
  }
}

TEST(GpuBuildBlockTable, NonBlockingStreamAndCudaGraph) {
  MLA_REQUIRE_GPU();
  run_table_case({64, {1, 64, 65, 300, 0}, 2, DType::kInt32, DType::kInt32, 0, 61, {}, {}},
                 Launch::kNonBlockingStream);
  run_table_case({16, {5, 17, 160, 33, 0, 3}, 4, DType::kInt64, DType::kInt32, 3, 62, {2}, {}},
                 Launch::kCudaGraph);
}

// cumulative_lengths on the GPU: int32 and strided int64 lengths, eager and inside a CUDA graph
// replayed with new lengths (what a graph engine does with DRAFT_EXTEND's query counts).
TEST(GpuCumulativeLengths, MatchesTheHostSumsEagerAndInAGraph) {
  MLA_REQUIRE_GPU();
  std::mt19937_64 rng(71);
  for (int64_t batch : {0, 1, 7, 300, 1000}) {
    for (DType dtype : {DType::kInt32, DType::kInt64}) {
      const int64_t stride = dtype == DType::kInt64 ? 3 : 1;
      std::vector<int64_t> values(size_t(std::max<int64_t>(1, batch * stride)), -1);
      std::vector<int32_t> expected(size_t(batch) + 1, 0);
      for (int64_t b = 0; b < batch; ++b) {
        values[size_t(b * stride)] = int64_t(rng() % 9);
        expected[size_t(b) + 1] = expected[size_t(b)] + int32_t(values[size_t(b * stride)]);
      }
      HostTensor lens = mla::test::index_tensor(dtype, values);
      HostTensor cu(DType::kInt32, {batch + 1});
      std::memset(cu.data(), 0xff, cu.bytes.size());
      DeviceTensor d_lens(lens), d_cu(cu);
      const TensorView lens_view = TensorView::strided(d_lens.ptr, dtype, {batch}, {stride}, mla::Device::cuda(0));
      ASSERT_NO_THROW(mla::cumulative_lengths(lens_view, d_cu.view()));
      MLA_TEST_CUDA(cudaDeviceSynchronize());
      d_cu.download();
      EXPECT_EQ(0, std::memcmp(cu.data(), expected.data(), expected.size() * 4)) << "batch " << batch;
      if (batch == 0) continue;
      // Captured in a CUDA graph (global capture mode: no host sync, no allocation), then replayed
      // after the lengths changed on the device.
      CudaStream stream;
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      MLA_TEST_CUDA(cudaStreamBeginCapture(stream.stream, cudaStreamCaptureModeGlobal));
      mla::cumulative_lengths(lens_view, d_cu.view(), stream.get());
      MLA_TEST_CUDA(cudaStreamEndCapture(stream.stream, &graph));
      MLA_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int64_t b = 0; b < batch; ++b) {
        values[size_t(b * stride)] = int64_t(rng() % 5);
        expected[size_t(b) + 1] = expected[size_t(b)] + int32_t(values[size_t(b * stride)]);
      }
      lens = mla::test::index_tensor(dtype, values);
      d_lens.upload();
      std::memset(cu.data(), 0xff, cu.bytes.size());
      d_cu.upload();
      MLA_TEST_CUDA(cudaGraphLaunch(exec, stream.stream));
      MLA_TEST_CUDA(cudaStreamSynchronize(stream.stream));
      MLA_TEST_CUDA(cudaGraphExecDestroy(exec));
      MLA_TEST_CUDA(cudaGraphDestroy(graph));
      d_cu.download();
      EXPECT_EQ(0, std::memcmp(cu.data(), expected.data(), expected.size() * 4)) << "graph, batch " << batch;
    }
  }
}

}  // namespace
