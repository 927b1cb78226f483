// build_block_table on the CPU: ragged requests (empty, partial last page, exact multiples of the
// page size, full width) for every page size, int32/int64 indices, strided tables; every element
// of a poisoned block table checked (page ids, then -1); bad input raises mla::Error naming it.
#include <algorithm>
#include <numeric>

#include "mla/ops.hpp"
#include "test_util.hpp"

namespace {

using mla::DType;
using mla::TensorView;
using mla::test::HostTensor;
using mla::test::throws_error;

constexpr int32_t kPoison = 0x5eed;

HostTensor index_tensor(DType dtype, const std::vector<int64_t>& values) {
  HostTensor t(dtype, {int64_t(values.size())});
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kInt32) t.i32(int64_t(i)) = int32_t(values[i]);
    else t.i64(int64_t(i)) = values[i];
  }
  return t;
}

struct TableCase {
  int page_size;
  std::vector<int64_t> seq_lens;
  int extra_blocks;       // block-table width beyond what the longest request needs
  DType index_dtype;      // req_pool_indices
  DType seq_len_dtype;    // seq_lens
  bool strided;           // req_to_token and block_table rows padded
  uint64_t seed;
};

void run_case(const TableCase& c) {
  std::ostringstream trace;
  trace << "page_size " << c.page_size << ", seq_lens";
  for (int64_t l : c.seq_lens) trace << " " << l;
  trace << ", extra_blocks " << c.extra_blocks << (c.strided ? ", strided" : "");
  SCOPED_TRACE(trace.str());

  std::mt19937_64 rng(c.seed);
  const int64_t S = c.page_size;
  const int64_t B = int64_t(c.seq_lens.size());
  const int64_t longest = B ? *std::max_element(c.seq_lens.begin(), c.seq_lens.end()) : 0;
  const int64_t needed_blocks = (longest + S - 1) / S;
  const int64_t max_blocks = needed_blocks + c.extra_blocks;
  const int64_t max_context_len = longest + 3;
  const int64_t num_req_slots = B + 2;  // a few rows no request uses

  // Each request gets its own row of req_to_token and its own pages (a random permutation of the
  // pool); positions at or past its length hold negative garbage that must never be read.
  std::vector<int64_t> rows(static_cast<size_t>(num_req_slots));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  int64_t total_blocks = 0;
  for (int64_t l : c.seq_lens) total_blocks += (l + S - 1) / S;
  std::vector<int64_t> pages(size_t(total_blocks + 5));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);

  const int64_t r2t_stride = c.strided ? max_context_len + 5 : max_context_len;
  HostTensor r2t_buf(DType::kInt32, {num_req_slots, r2t_stride});
  for (int64_t i = 0; i < r2t_buf.numel(); ++i) r2t_buf.i32(i) = -int32_t(1 + rng() % 1000);
  std::vector<std::vector<int64_t>> expected_pages(static_cast<size_t>(B));
  size_t next_page = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = rows[size_t(b)];
    const int64_t len = c.seq_lens[size_t(b)];
    for (int64_t j = 0; j < (len + S - 1) / S; ++j) {
      const int64_t page = pages[next_page++];
      expected_pages[size_t(b)].push_back(page);
      for (int64_t p = j * S; p < std::min(len, (j + 1) * S); ++p)
        r2t_buf.i32(row * r2t_stride + p) = int32_t(page * S + p % S);
    }
  }
  const TensorView req_to_token = TensorView::strided(
      r2t_buf.data(), DType::kInt32, {num_req_slots, max_context_len}, {r2t_stride, 1});

  std::vector<int64_t> req_indices(rows.begin(), rows.begin() + B);
  HostTensor req_pool_indices = index_tensor(c.index_dtype, req_indices);
  HostTensor seq_lens = index_tensor(c.seq_len_dtype, c.seq_lens);

  const int64_t table_stride = c.strided ? max_blocks + 3 : max_blocks;
  HostTensor table_buf(DType::kInt32, {B, table_stride});
  for (int64_t i = 0; i < table_buf.numel(); ++i) table_buf.i32(i) = kPoison;

  mla::BuildBlockTableArgs args;
  args.req_to_token = req_to_token;
  args.req_pool_indices = req_pool_indices.view();
  args.seq_lens = seq_lens.view();
  args.page_size = c.page_size;
  args.block_table = TensorView::strided(table_buf.data(), DType::kInt32, {B, max_blocks},
                                         {table_stride, 1});
  ASSERT_NO_THROW(mla::build_block_table(args));

  size_t bad = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < table_stride; ++j) {
      const auto& pages_b = expected_pages[size_t(b)];
      const int64_t expected = j >= max_blocks ? kPoison  // row padding stays untouched
                               : j < int64_t(pages_b.size()) ? pages_b[size_t(j)]
                                                             : -1;
      const int32_t got = table_buf.i32(b * table_stride + j);
      if (got != expected && bad++ < 8)
        ADD_FAILURE() << "block_table[" << b << ", " << j << "] = " << got << ", expected "
                      << expected;
    }
  EXPECT_EQ(bad, 0u);
}

TEST(BuildBlockTable, RaggedRequestsEveryPageSize) {
  uint64_t seed = 11;
  int variant = 0;
  for (int S = 1; S <= 128; S *= 2) {
    // Empty, one token, a partial last page, exact multiples of S, and one past a multiple.
    const std::vector<int64_t> seq_lens = {0, 1, 3 * S + S / 2 + 1, S, 4 * S, 2 * S + 1, 0, 7};
    for (int extra_blocks : {0, 3}) {
      ++variant;
      run_case({S, seq_lens, extra_blocks, variant % 2 ? DType::kInt32 : DType::kInt64,
                variant % 3 ? DType::kInt64 : DType::kInt32, variant % 4 >= 2, seed++});
    }
  }
}

TEST(BuildBlockTable, OddShapes) {
  run_case({1, {1}, 0, DType::kInt32, DType::kInt32, false, 1});        // one token
  run_case({128, {128}, 0, DType::kInt64, DType::kInt64, true, 2});     // exactly one full page
  run_case({16, {0, 0, 0}, 0, DType::kInt32, DType::kInt32, false, 3}); // zero-width table
  run_case({16, {0, 0, 0}, 2, DType::kInt32, DType::kInt64, true, 4});  // all -1
  std::vector<int64_t> many(37);
  for (size_t i = 0; i < many.size(); ++i) many[i] = int64_t(i * 13 % 97);
  run_case({8, many, 1, DType::kInt64, DType::kInt32, true, 5});
}

// A small valid setup: 2 requests of lengths 5 and 0 with page size 4, block table width 2.
struct Fixture {
  HostTensor req_to_token = mla::test::int32_tensor(
      {-1, -1, -1, -1, -1, -1, -1, -1,  //
       8, 9, 10, 11, 20, -1, -1, -1}, {2, 8});
  HostTensor req_pool_indices = mla::test::int32_tensor({1, 0});
  HostTensor seq_lens = mla::test::int32_tensor({5, 0});
  HostTensor block_table{DType::kInt32, {2, 2}};
  mla::BuildBlockTableArgs args;
  Fixture() {
    for (int i = 0; i < 4; ++i) block_table.i32(i) = kPoison;
    args.req_to_token = req_to_token.view();
    args.req_pool_indices = req_pool_indices.view();
    args.seq_lens = seq_lens.view();
    args.page_size = 4;
    args.block_table = block_table.view();
  }
  bool table_untouched() const {
    for (int i = 0; i < 4; ++i)
      if (block_table.i32(i) != kPoison) return false;
    return true;
  }
};

TEST(BuildBlockTable, FixtureIsValid) {
  Fixture f;
  ASSERT_NO_THROW(mla::build_block_table(f.args));
  EXPECT_EQ(f.block_table.i32(0), 2);
  EXPECT_EQ(f.block_table.i32(1), 5);
  EXPECT_EQ(f.block_table.i32(2), -1);
  EXPECT_EQ(f.block_table.i32(3), -1);
}

TEST(BuildBlockTable, EmptyBatchIsANoOp) {
  Fixture f;
  HostTensor none(DType::kInt32, {0});
  HostTensor table(DType::kInt32, {0, 2});
  HostTensor no_rows(DType::kInt32, {0, 8});
  f.args.req_pool_indices = none.view();
  f.args.seq_lens = none.view();
  f.args.block_table = table.view();
  EXPECT_NO_THROW(mla::build_block_table(f.args));
  f.args.req_to_token = no_rows.view();
  EXPECT_NO_THROW(mla::build_block_table(f.args));
}

TEST(BuildBlockTable, BadValuesRaiseAndWriteNothing) {
  auto expect_error = [](auto mutate, std::initializer_list<const char*> fragments) {
    Fixture f;
    mutate(f);
    EXPECT_TRUE(throws_error([&] { mla::build_block_table(f.args); }, fragments));
    EXPECT_TRUE(f.table_untouched());
  };
  HostTensor idx64(DType::kInt64, {2});
  expect_error([](Fixture& f) { f.req_pool_indices.i32(1) = 2; },
               {"build_block_table", "req_pool_indices[1] = 2", "[0, 2)"});
  expect_error([](Fixture& f) { f.req_pool_indices.i32(0) = -1; }, {"req_pool_indices[0] = -1"});
  expect_error([&](Fixture& f) {
    idx64.i64(0) = 1;
    idx64.i64(1) = int64_t(1) << 33;
    f.args.req_pool_indices = idx64.view();
  }, {"req_pool_indices[1] = 8589934592"});
  expect_error([](Fixture& f) { f.seq_lens.i32(1) = -3; }, {"seq_lens[1] = -3", ">= 0"});
  expect_error([](Fixture& f) { f.seq_lens.i32(0) = 9; }, {"seq_lens[0] = 9", "max_blocks 2", "8"});
  expect_error([](Fixture& f) {
    f.args.block_table.shape[1] = 1;  // 4 tokens of room
    f.args.block_table.stride[0] = 2;
  }, {"seq_lens[0] = 5", "max_blocks 1"});
  expect_error([](Fixture& f) {
    f.args.page_size = 8;  // width 2 * 8 = 16 > 8 columns of req_to_token
    f.seq_lens.i32(0) = 9;
  }, {"seq_lens[0] = 9", "req_to_token.shape[1]", "8"});
  expect_error([](Fixture& f) { f.req_to_token.i32(8 + 4) = -1; },
               {"req_to_token[1, 4] = -1", "negative", "request 0"});
  expect_error([](Fixture& f) { f.req_to_token.i32(8) = -7; }, {"req_to_token[1, 0] = -7"});
  // Entries past a request's length are never read, so garbage there is fine.
  Fixture ok;
  ok.req_to_token.i32(8 + 5) = -100;
  ok.req_to_token.i32(8 + 1) = -100;  // inside the first page but not its first token
  EXPECT_NO_THROW(mla::build_block_table(ok.args));
}

TEST(BuildBlockTable, BadArgumentsNameTheArgument) {
  auto expect_error = [](auto mutate, std::initializer_list<const char*> fragments) {
    Fixture f;
    mutate(f);
    EXPECT_TRUE(throws_error([&] { mla::build_block_table(f.args); }, fragments));
    EXPECT_TRUE(f.table_untouched());
  };
  HostTensor r2t_i64(DType::kInt64, {2, 8});
  HostTensor f32_1d(DType::kFP32, {2});
  HostTensor i32_3(DType::kInt32, {3});
  HostTensor table_i64(DType::kInt64, {2, 2});
  HostTensor table_3(DType::kInt32, {3, 2});
  HostTensor wide(DType::kInt32, {2, 16});
  HostTensor wide_1d(DType::kInt32, {4});

  expect_error([](Fixture& f) { f.args.req_to_token = {}; }, {"build_block_table", "req_to_token", "required"});
  expect_error([](Fixture& f) { f.args.req_to_token.ndim = 1; }, {"req_to_token", "2 dims"});
  expect_error([&](Fixture& f) { f.args.req_to_token = r2t_i64.view(); }, {"req_to_token", "int32", "int64"});
  expect_error([&](Fixture& f) {
    f.args.req_to_token = TensorView::strided(wide.data(), DType::kInt32, {2, 8}, {16, 2});
  }, {"req_to_token", "stride"});
  expect_error([](Fixture& f) { f.args.req_pool_indices = {}; }, {"req_pool_indices", "required"});
  expect_error([](Fixture& f) { f.args.req_pool_indices.ndim = 2; f.args.req_pool_indices.shape[1] = 1; },
               {"req_pool_indices", "1 dims"});
  expect_error([&](Fixture& f) { f.args.req_pool_indices = f32_1d.view(); },
               {"req_pool_indices", "int32/int64", "fp32"});
  expect_error([&](Fixture& f) {
    f.args.req_pool_indices = TensorView::strided(wide_1d.data(), DType::kInt32, {2}, {2});
  }, {"req_pool_indices", "stride"});
  expect_error([](Fixture& f) { f.args.seq_lens = {}; }, {"seq_lens", "required"});
  expect_error([&](Fixture& f) { f.args.seq_lens = i32_3.view(); }, {"seq_lens.shape[0]", "2"});
  expect_error([&](Fixture& f) { f.args.seq_lens = f32_1d.view(); }, {"seq_lens", "int32/int64"});
  expect_error([&](Fixture& f) {
    f.args.seq_lens = TensorView::strided(wide_1d.data(), DType::kInt32, {2}, {2});
  }, {"seq_lens", "stride"});
  for (int bad : {0, -4, 3, 48, 256})
    expect_error([bad](Fixture& f) { f.args.page_size = bad; },
                 {"build_block_table", "page_size", "power of two", std::to_string(bad).c_str()});
  expect_error([](Fixture& f) { f.args.block_table = {}; }, {"block_table", "required"});
  expect_error([](Fixture& f) { f.args.block_table.ndim = 1; }, {"block_table", "2 dims"});
  expect_error([&](Fixture& f) { f.args.block_table = table_3.view(); }, {"block_table.shape[0]", "2"});
  expect_error([&](Fixture& f) { f.args.block_table = table_i64.view(); }, {"block_table", "int32", "int64"});
  expect_error([&](Fixture& f) {
    f.args.block_table = TensorView::strided(wide.data(), DType::kInt32, {2, 2}, {16, 3});
  }, {"block_table", "stride"});
  expect_error([&](Fixture& f) {
    f.args.block_table = TensorView::strided(wide.data(), DType::kInt32, {2, 2}, {0, 1});
  }, {"block_table", "overlap"});
  // The table written over an input it reads (its lengths in its own second row).
  expect_error([](Fixture& f) {
    f.args.seq_lens = TensorView::contiguous(f.block_table.data(), DType::kInt32, {2});
  }, {"build_block_table: block_table", "overlaps seq_lens"});
  expect_error([](Fixture& f) { f.args.block_table.device = mla::Device::cuda(0); },
               {"block_table", "cuda:0", "req_to_token", "cpu"});
  expect_error([](Fixture& f) { f.args.seq_lens.device = mla::Device::cuda(0); }, {"seq_lens", "cuda:0"});
#if !defined(MLA_WITH_CUDA)
  expect_error([](Fixture& f) {
    for (TensorView* t : {&f.args.req_to_token, &f.args.req_pool_indices, &f.args.seq_lens,
                          &f.args.block_table})
      t->device = mla::Device::cuda(0);
  }, {"build_block_table", "no CUDA support"});
#endif
}

}  // namespace
