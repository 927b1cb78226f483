// The planner: block-table widths and contents, prefix chunking, the EXTEND path decision, and
// the device metadata an EXTEND plan holds (slots, cumulative lengths).
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/memory.hpp"
#include "mla/backend.hpp"
#include "mla/plan.hpp"
#include "test_util.hpp"

namespace mla {
namespace {

using test::HostTensor;
using test::int32_tensor;
using test::throws_error;

std::vector<int32_t> read_int32(const TensorView& t) {
  std::vector<int32_t> v(size_t(t.numel()));
  const auto* data = static_cast<const int32_t*>(t.data);
  if (t.ndim == 1) {
    for (int64_t i = 0; i < t.shape[0]; ++i) v[size_t(i)] = data[i * t.stride[0]];
  } else {
    for (int64_t r = 0; r < t.shape[0]; ++r)
      for (int64_t c = 0; c < t.shape[1]; ++c)
        v[size_t(r * t.shape[1] + c)] = data[r * t.stride[0] + c * t.stride[1]];
  }
  return v;
}

TEST(Planner, ForwardModeNames) {
  EXPECT_EQ(forward_mode_name(ForwardMode::kDecode), "DECODE");
  EXPECT_EQ(forward_mode_name(ForwardMode::kIdle), "IDLE");
  EXPECT_EQ(forward_mode_name(ForwardMode::kExtend), "EXTEND");
  EXPECT_EQ(forward_mode_name(ForwardMode::kTargetVerify), "TARGET_VERIFY");
  EXPECT_EQ(forward_mode_name(ForwardMode::kDraftExtend), "DRAFT_EXTEND");
  EXPECT_TRUE(is_decode_family(ForwardMode::kDecode));
  EXPECT_TRUE(is_decode_family(ForwardMode::kTargetVerify));
  EXPECT_TRUE(is_decode_family(ForwardMode::kDraftExtend));
  EXPECT_FALSE(is_decode_family(ForwardMode::kExtend));
  EXPECT_FALSE(is_decode_family(ForwardMode::kIdle));
}

TEST(Planner, PaddedBlockCountRoundsToWholeGroupsOf128Tokens) {
  for (int page_size = 1; page_size <= 128; page_size *= 2) {
    const int granularity = std::max(1, 128 / page_size);
    EXPECT_EQ(block_table_width_granularity(page_size), granularity);
    EXPECT_EQ(padded_block_count(0, page_size), granularity);  // never an empty row
    for (int64_t len : {int64_t(1), int64_t(2), int64_t(page_size - 1), int64_t(page_size),
                        int64_t(page_size + 1), int64_t(127), int64_t(128), int64_t(129),
                        int64_t(1000), int64_t(163840)}) {
      if (len <= 0) continue;
      const int blocks = padded_block_count(len, page_size);
      SCOPED_TRACE("page " + std::to_string(page_size) + " len " + std::to_string(len));
      EXPECT_EQ(blocks % granularity, 0);
      EXPECT_GE(int64_t(blocks) * page_size, len);                    // covers the sequence
      EXPECT_LT(int64_t(blocks - granularity) * page_size, len);      // and is the smallest such
    }
  }
  // Examples from the reference behaviour: 64-token pages pad to an even count.
  EXPECT_EQ(padded_block_count(129, 64), 4);
  EXPECT_EQ(padded_block_count(128, 64), 2);
  EXPECT_EQ(padded_block_count(129, 1), 256);
  EXPECT_EQ(padded_block_count(129, 128), 2);
  EXPECT_TRUE(throws_error([] { padded_block_count(10, 3); }, {"page_size"}));
  EXPECT_TRUE(throws_error([] { padded_block_count(-1, 16); }, {"max_seq_len"}));
  EXPECT_TRUE(throws_error([] { padded_block_count(INT64_MAX, 64); }, {"max_seq_len", "int32"}));
}

TEST(Planner, SplitsPrefixAcrossRequestBoundaries) {
  // Request-major order: r0 [0, 5), r1 empty, r2 [5, 12); chunks of 4 tokens.
  const std::vector<int32_t> prefix = {5, 0, 7};
  const std::vector<PrefixChunk> chunks = split_prefix_into_chunks(prefix, 4);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].first_token, 0);
  EXPECT_EQ(chunks[0].num_tokens, 4);
  EXPECT_EQ(chunks[0].kv_begin, (std::vector<int32_t>{0, 0, 0}));
  EXPECT_EQ(chunks[0].kv_lens, (std::vector<int32_t>{4, 0, 0}));
  EXPECT_EQ(chunks[0].cu_kv_lens, (std::vector<int32_t>{0, 4, 4, 4}));
  EXPECT_EQ(chunks[0].max_kv_len, 4);
  EXPECT_TRUE(chunks[0].has_empty_rows);
  // The boundary at token 4 cuts request 0; chunk 1 holds its last token and r2's first three.
  EXPECT_EQ(chunks[1].first_token, 4);
  EXPECT_EQ(chunks[1].kv_begin, (std::vector<int32_t>{4, 0, 0}));
  EXPECT_EQ(chunks[1].kv_lens, (std::vector<int32_t>{1, 0, 3}));
  EXPECT_EQ(chunks[1].cu_kv_lens, (std::vector<int32_t>{0, 1, 1, 4}));
  EXPECT_EQ(chunks[1].max_kv_len, 3);
  EXPECT_EQ(chunks[2].first_token, 8);
  EXPECT_EQ(chunks[2].num_tokens, 4);
  EXPECT_EQ(chunks[2].kv_begin, (std::vector<int32_t>{5, 0, 3}));  // r0's empty range: at its end
  EXPECT_EQ(chunks[2].kv_lens, (std::vector<int32_t>{0, 0, 4}));
  EXPECT_EQ(chunks[2].max_kv_len, 4);
}

TEST(Planner, CapacityHitExactlyAndZeroPrefix) {
  const std::vector<int32_t> prefix = {4, 4};
  std::vector<PrefixChunk> chunks = split_prefix_into_chunks(prefix, 4);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].kv_lens, (std::vector<int32_t>{4, 0}));
  EXPECT_EQ(chunks[1].kv_lens, (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(chunks[1].kv_begin, (std::vector<int32_t>{4, 0}));  // r0 ended at the boundary
  chunks = split_prefix_into_chunks(prefix, 8);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].num_tokens, 8);
  EXPECT_FALSE(chunks[0].has_empty_rows);
  EXPECT_TRUE(split_prefix_into_chunks(std::vector<int32_t>{0, 0, 0}, 4).empty());
  EXPECT_TRUE(split_prefix_into_chunks(std::vector<int32_t>{}, 4).empty());
  chunks = split_prefix_into_chunks(std::vector<int32_t>{3}, 1);
  ASSERT_EQ(chunks.size(), 3u);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(chunks[size_t(c)].kv_begin[0], c);
  EXPECT_TRUE(throws_error([] { split_prefix_into_chunks(std::vector<int32_t>{1}, 0); }, {"chunk_capacity"}));
  EXPECT_TRUE(throws_error([] { split_prefix_into_chunks(std::vector<int32_t>{1, -2}, 4); }, {"prefix_lens[1]"}));
}

TEST(Planner, RandomChunkingsCoverEveryPrefixTokenOnce) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    std::uniform_int_distribution<int> batch_dist(0, 6), len_dist(0, 40), cap_dist(1, 50);
    std::vector<int32_t> prefix(size_t(batch_dist(rng)));
    for (int32_t& p : prefix) p = (rng() % 3 == 0) ? 0 : len_dist(rng);
    const int64_t capacity = cap_dist(rng);
    const std::vector<PrefixChunk> chunks = split_prefix_into_chunks(prefix, capacity);
    const int64_t total = std::accumulate(prefix.begin(), prefix.end(), int64_t(0));
    ASSERT_EQ(int64_t(chunks.size()), (total + capacity - 1) / capacity);
    std::vector<std::vector<int>> seen(prefix.size());
    for (size_t b = 0; b < prefix.size(); ++b) seen[b].assign(size_t(prefix[b]), 0);
    int64_t first = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const PrefixChunk& chunk = chunks[c];
      EXPECT_EQ(chunk.first_token, first);
      EXPECT_EQ(chunk.num_tokens, c + 1 < chunks.size() ? capacity : total - first);
      EXPECT_EQ(chunk.cu_kv_lens.back(), chunk.num_tokens);
      for (size_t b = 0; b < prefix.size(); ++b)
        for (int pos = chunk.kv_begin[b]; pos < chunk.kv_begin[b] + chunk.kv_lens[b]; ++pos) ++seen[b][size_t(pos)];
      first += chunk.num_tokens;
    }
    for (const std::vector<int>& s : seen)
      for (int count : s) ASSERT_EQ(count, 1);
  }
}

TEST(Planner, DeterministicChunksCutRequestsOnlyAtMultiplesOfTheCapacity) {
  // r0 10 tokens (pieces 4, 4, 2), r1 empty, r2 3, r3 3, r4 1; capacity 4.
  const std::vector<int32_t> prefix = {10, 0, 3, 3, 1};
  const std::vector<PrefixChunk> chunks = split_prefix_into_chunks(prefix, 4, /*deterministic=*/true);
  // [r0 0-4) | [r0 4-8) | [r0 8-10) + ... r2's 3 would make 5: alone | r2 | r3 + r4
  ASSERT_EQ(chunks.size(), 5u);
  const std::vector<std::vector<int32_t>> lens = {
      {4, 0, 0, 0, 0}, {4, 0, 0, 0, 0}, {2, 0, 0, 0, 0}, {0, 0, 3, 0, 0}, {0, 0, 0, 3, 1}};
  const std::vector<std::vector<int32_t>> begins = {
      {0, 0, 0, 0, 0}, {4, 0, 0, 0, 0}, {8, 0, 0, 0, 0}, {10, 0, 0, 0, 0}, {10, 0, 3, 0, 0}};
  int64_t first = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    SCOPED_TRACE("chunk " + std::to_string(c));
    EXPECT_EQ(chunks[c].kv_lens, lens[c]);
    EXPECT_EQ(chunks[c].kv_begin, begins[c]);
    EXPECT_EQ(chunks[c].first_token, first);
    first += chunks[c].num_tokens;
  }
  // The same request meets the same pieces in any batch: here r0 behind a 3-token request.
  const std::vector<PrefixChunk> shifted =
      split_prefix_into_chunks(std::vector<int32_t>{3, 10}, 4, /*deterministic=*/true);
  std::vector<std::pair<int32_t, int32_t>> pieces;
  for (const PrefixChunk& chunk : shifted)
    if (chunk.kv_lens[1] > 0) pieces.emplace_back(chunk.kv_begin[1], chunk.kv_lens[1]);
  EXPECT_EQ(pieces, (std::vector<std::pair<int32_t, int32_t>>{{0, 4}, {4, 4}, {8, 2}}));
}

TEST(Planner, RandomDeterministicChunkingsDependOnlyOnEachRequest) {
  std::mt19937_64 rng(19);
  for (int trial = 0; trial < 300; ++trial) {
    std::uniform_int_distribution<int> batch_dist(0, 7), len_dist(0, 60), cap_dist(1, 24);
    std::vector<int32_t> prefix(size_t(batch_dist(rng)));
    for (int32_t& p : prefix) p = (rng() % 4 == 0) ? 0 : len_dist(rng);
    const int64_t capacity = cap_dist(rng);
    const std::vector<PrefixChunk> chunks = split_prefix_into_chunks(prefix, capacity, true);
    const int64_t total = std::accumulate(prefix.begin(), prefix.end(), int64_t(0));
    int64_t first = 0;
    std::vector<int32_t> next(prefix.size(), 0);  // each request's next position
    for (const PrefixChunk& chunk : chunks) {
      EXPECT_EQ(chunk.first_token, first);
      EXPECT_GE(chunk.num_tokens, 1);
      EXPECT_LE(chunk.num_tokens, capacity);
      EXPECT_EQ(chunk.cu_kv_lens.back(), chunk.num_tokens);
      for (size_t b = 0; b < prefix.size(); ++b) {
        if (chunk.kv_lens[b] == 0) continue;
        // One piece: starts where the request left off, at a multiple of the capacity, and is
        // a whole capacity unless it is the request's last.
        EXPECT_EQ(chunk.kv_begin[b], next[b]);
        EXPECT_EQ(chunk.kv_begin[b] % capacity, 0);
        EXPECT_EQ(chunk.kv_lens[b], std::min<int64_t>(capacity, prefix[b] - chunk.kv_begin[b]));
        next[b] += chunk.kv_lens[b];
      }
      first += chunk.num_tokens;
    }
    EXPECT_EQ(first, total);
    EXPECT_EQ(next, prefix);
  }
}

TEST(Planner, AbsorbedOrChunkedDecision) {
  using P = ExtendPrefixPath;
  const std::vector<int32_t> no_prefix = {0, 0}, extend = {5, 7};
  EXPECT_FALSE(use_absorbed_extend(no_prefix, extend, P::kAuto, 128));
  EXPECT_FALSE(use_absorbed_extend(no_prefix, extend, P::kChunked, 128));
  EXPECT_TRUE(use_absorbed_extend(no_prefix, extend, P::kAbsorbed, 128));
  // Short extensions of long prefixes: absorbed; long extensions: chunked.
  EXPECT_TRUE(use_absorbed_extend(std::vector<int32_t>{100, 1000}, std::vector<int32_t>{1, 1}, P::kAuto, 128));
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{100}, std::vector<int32_t>{200}, P::kAuto, 128));
  for (P path : {P::kAuto, P::kAbsorbed, P::kChunked}) {
    EXPECT_TRUE(throws_error([&] { use_absorbed_extend(std::vector<int32_t>{5, -1}, std::vector<int32_t>{1, 1}, path, 128); },
                             {"use_absorbed_extend", "prefix_lens[1] must be >= 0"}));
    EXPECT_TRUE(throws_error([&] { use_absorbed_extend(std::vector<int32_t>{5, 1}, std::vector<int32_t>{-3, 1}, path, 128); },
                             {"extend_lens[0] must be >= 0"}));
  }
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{100}, std::vector<int32_t>{1}, P::kChunked, 128));
  // Pairs a prefix token: (1 * (10000 + 1) + 1000 * (10 + 500.5)) / 10010 ~ 52 <= 128.
  EXPECT_TRUE(use_absorbed_extend(std::vector<int32_t>{10000, 10}, std::vector<int32_t>{1, 1000}, P::kAuto, 128));
  // The new tokens' own causal pairs count: a fresh 32k prompt beside a long prefix of one new
  // token is (100001 + 32768 * 32769 / 2) / 100000 ~ 5370 pairs a prefix token: chunked.
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{100000, 0}, std::vector<int32_t>{1, 32768}, P::kAuto, 128));
  // Boundary: 4 * (10 + 2.5) = 50 = 5 * 10 is absorbed, 5 * (10 + 3) = 65 is not.
  EXPECT_TRUE(use_absorbed_extend(std::vector<int32_t>{10}, std::vector<int32_t>{4}, P::kAuto, 5));
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{10}, std::vector<int32_t>{5}, P::kAuto, 5));
  EXPECT_TRUE(use_absorbed_extend(std::vector<int32_t>{10, 30}, std::vector<int32_t>{4, 4}, P::kAuto, 5));
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{10, 30}, std::vector<int32_t>{4, 4}, P::kAuto, 4));
  // Threshold 0: chunked whenever new tokens meet a prefix.
  EXPECT_FALSE(use_absorbed_extend(std::vector<int32_t>{10}, std::vector<int32_t>{1}, P::kAuto, 0));
  EXPECT_TRUE(throws_error([] {
    use_absorbed_extend(std::vector<int32_t>{1}, std::vector<int32_t>{1, 2}, ExtendPrefixPath::kAuto, 4);
  }, {"prefix_lens", "extend_lens"}));
}

TEST(Planner, ExtendLengthsPlan) {
  const std::vector<int32_t> prefix = {3, 0, 9}, extend = {2, 4, 0};
  const ExtendPlan plan = plan_extend_lengths(prefix, extend, 5, ExtendPrefixPath::kChunked, 128);
  EXPECT_EQ(plan.cu_q_lens, (std::vector<int32_t>{0, 2, 6, 6}));
  EXPECT_EQ(plan.num_tokens, 6);
  EXPECT_EQ(plan.max_q_len, 4);
  EXPECT_EQ(plan.num_prefix_tokens, 12);
  EXPECT_EQ(plan.max_prefix_len, 9);
  EXPECT_EQ(plan.max_seq_len, 9);
  EXPECT_FALSE(plan.use_absorbed);
  EXPECT_EQ(plan.chunks.size(), 3u);
  // Deterministic: kAuto (which would take the absorbed path here) becomes the chunked path, an
  // explicit path stays, and the chunks are the deterministic ones ({3} | {5} | {4} here: r2's
  // 9 tokens cut at 5).
  EXPECT_TRUE(plan_extend_lengths(prefix, extend, 5, ExtendPrefixPath::kAuto, 128).use_absorbed);
  const ExtendPlan det = plan_extend_lengths(prefix, extend, 5, ExtendPrefixPath::kAuto, 128, true);
  EXPECT_FALSE(det.use_absorbed);
  ASSERT_EQ(det.chunks.size(), 3u);
  EXPECT_EQ(det.chunks[0].kv_lens, (std::vector<int32_t>{3, 0, 0}));
  EXPECT_EQ(det.chunks[1].kv_lens, (std::vector<int32_t>{0, 0, 5}));
  EXPECT_EQ(det.chunks[2].kv_lens, (std::vector<int32_t>{0, 0, 4}));
  EXPECT_TRUE(plan_extend_lengths(prefix, extend, 5, ExtendPrefixPath::kAbsorbed, 128, true).use_absorbed);
  EXPECT_TRUE(throws_error([&] {
    plan_extend_lengths(prefix, std::vector<int32_t>{1, -1, 0}, 5, ExtendPrefixPath::kAuto, 1);
  }, {"extend_lens[1]"}));
}

// Block tables through the Backend: page ids in order, -1 tails, padded widths.
TEST(Planner, BlockTablesHoldPageIdsThenMinusOne) {
  for (int page_size : {1, 4, 32, 128}) {
    const int max_len = 300, slots = 3;
    const int num_pages = slots * ((max_len + page_size - 1) / page_size);
    HostTensor req_to_token(DType::kInt32, {slots, max_len});
    std::vector<int32_t> pages(static_cast<size_t>(num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), std::mt19937_64(uint64_t(page_size)));
    size_t next = 0;
    for (int r = 0; r < slots; ++r)
      for (int pos = 0; pos < max_len; ++pos) {
        if (pos % page_size == 0) ++next;
        req_to_token.i32(int64_t(r) * max_len + pos) = pages[next - 1] * page_size + pos % page_size;
      }
    BackendConfig config;
    config.num_q_heads = 1;
    config.page_size = page_size;
    config.req_to_token = req_to_token.view();
    config.workspace_bytes = 0;
    Backend backend(config);
    const std::vector<int32_t> lens = {1, 0, 257};
    HostTensor rpi = test::int32_tensor({2, 0, 1}), seq = test::int32_tensor(lens);
    for (bool host : {true, false}) {
      ForwardBatch batch;
      batch.mode = ForwardMode::kDecode;
      batch.batch_size = 3;
      batch.req_pool_indices = rpi.view();
      batch.seq_lens = seq.view();
      if (host) batch.seq_lens_cpu = lens;
      backend.init_forward_metadata(batch);
      const Plan& plan = backend.plan();
      const int width = padded_block_count(host ? 257 : max_len, page_size);
      ASSERT_EQ(plan.max_blocks, width);
      ASSERT_EQ(plan.block_table.shape[1], width);
      EXPECT_EQ(read_int32(plan.kv_lens), lens);
      const std::vector<int32_t> table = read_int32(plan.block_table);
      for (int b = 0; b < 3; ++b) {
        const int r = rpi.i32(b);
        const int used = (lens[size_t(b)] + page_size - 1) / page_size;
        for (int j = 0; j < width; ++j) {
          const int32_t expected = j < used ? req_to_token.i32(int64_t(r) * max_len + j * page_size) / page_size : -1;
          ASSERT_EQ(table[size_t(b * width + j)], expected) << "page " << page_size << " row " << b << " block " << j;
        }
      }
    }
  }
}

// EXTEND plans: device cumulative lengths and the request-major slots of every chunk.
TEST(Planner, ExtendPlanDeviceMetadata) {
  const int page_size = 8, max_len = 64, slots = 3;
  HostTensor req_to_token(DType::kInt32, {slots, max_len});
  for (int64_t i = 0; i < req_to_token.numel(); ++i) req_to_token.i32(i) = int32_t((i * 37) % 1000);
  BackendConfig config;
  config.num_q_heads = 2;
  config.page_size = page_size;
  config.req_to_token = req_to_token.view();
  config.prefix_chunk_capacity = 6;
  config.workspace_bytes = 0;
  Backend backend(config);
  const std::vector<int32_t> prefix = {5, 0, 9}, extend = {2, 3, 1}, seq = {7, 3, 10};
  HostTensor rpi = test::int32_tensor({1, 2, 0});
  ForwardBatch batch;
  batch.mode = ForwardMode::kExtend;
  batch.batch_size = 3;
  batch.req_pool_indices = rpi.view();
  batch.extend_seq_lens_cpu = extend;
  batch.extend_prefix_lens_cpu = prefix;
  batch.seq_lens_cpu = seq;
  backend.init_forward_metadata(batch);
  const Plan& plan = backend.plan();
  EXPECT_EQ(plan.num_tokens, 6);
  EXPECT_EQ(read_int32(plan.kv_lens), seq);
  EXPECT_EQ(read_int32(plan.cu_q_lens), (std::vector<int32_t>{0, 2, 5, 6}));
  EXPECT_EQ(read_int32(plan.extend.cu_q_lens_device), (std::vector<int32_t>{0, 2, 5, 6}));
  EXPECT_EQ(plan.max_blocks, padded_block_count(10, page_size));
  ASSERT_EQ(backend.num_prefix_chunks(), 3);  // 14 prefix tokens in chunks of 6
  for (const PrefixChunk& chunk : plan.extend.chunks) {
    EXPECT_EQ(read_int32(chunk.cu_kv_lens_device), chunk.cu_kv_lens);
    std::vector<int32_t> expected;
    for (int b = 0; b < 3; ++b)
      for (int pos = chunk.kv_begin[size_t(b)]; pos < chunk.kv_begin[size_t(b)] + chunk.kv_lens[size_t(b)]; ++pos)
        expected.push_back(req_to_token.i32(int64_t(rpi.i32(b)) * max_len + pos));
    EXPECT_EQ(read_int32(chunk.slots), expected);
  }
}

// The memory layer's CPU path (the CUDA path runs the same helpers as kernels).
TEST(Ops, CumulativeLengths) {
  // int32 and strided int64 lengths, zeros among them; an empty batch gives cu = {0}.
  HostTensor lens = int32_tensor({3, 0, 7, 1});
  HostTensor cu(DType::kInt32, {5});
  std::memset(cu.data(), 0xff, cu.bytes.size());
  ASSERT_NO_THROW(cumulative_lengths(lens.view(), cu.view()));
  EXPECT_EQ(std::vector<int32_t>(static_cast<const int32_t*>(cu.data()), static_cast<const int32_t*>(cu.data()) + 5),
            (std::vector<int32_t>{0, 3, 3, 10, 11}));
  std::vector<int64_t> wide = {5, -1, 2, -1, 9, -1};  // every other element
  const TensorView strided = TensorView::strided(wide.data(), DType::kInt64, {3}, {2}, Device::cpu());
  HostTensor cu3(DType::kInt32, {4});
  ASSERT_NO_THROW(cumulative_lengths(strided, cu3.view()));
  EXPECT_EQ(std::vector<int32_t>(static_cast<const int32_t*>(cu3.data()), static_cast<const int32_t*>(cu3.data()) + 4),
            (std::vector<int32_t>{0, 5, 7, 16}));
  HostTensor none(DType::kInt32, {0}), cu1(DType::kInt32, {1});
  std::memset(cu1.data(), 0xff, cu1.bytes.size());
  ASSERT_NO_THROW(cumulative_lengths(none.view(), cu1.view()));
  EXPECT_EQ(*static_cast<const int32_t*>(cu1.data()), 0);
  // Bad input names the argument.
  HostTensor neg = int32_tensor({2, -4});
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(neg.view(), TensorView::contiguous(cu3.data(), DType::kInt32, {3}, Device::cpu())); },
                           {"cumulative_lengths", "lens[1]", ">= 0"}));
  HostTensor big = int32_tensor({INT32_MAX, 1});
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(big.view(), TensorView::contiguous(cu3.data(), DType::kInt32, {3}, Device::cpu())); },
                           {"cumulative_lengths", "lens[1]", "2^31 - 1"}));
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(lens.view(), cu3.view()); }, {"cu", "shape[0]"}));
  HostTensor f(DType::kFP32, {4});
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(f.view(), cu.view()); }, {"cumulative_lengths", "lens"}));
  // Negative strides run down from data: lens {b[4], b[3]} overlaps cu = b[1..4), lens {b[1],
  // b[0]} does not overlap cu = b[2..5).
  std::vector<int32_t> b(6, 2);
  const TensorView down4 = TensorView::strided(b.data() + 4, DType::kInt32, {2}, {-1}, Device::cpu());
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(down4, TensorView::contiguous(b.data() + 1, DType::kInt32, {3}, Device::cpu())); },
                           {"cumulative_lengths", "overlaps"}));
  b = {5, 3, -1, -1, -1, -1};
  const TensorView down1 = TensorView::strided(b.data() + 1, DType::kInt32, {2}, {-1}, Device::cpu());
  ASSERT_NO_THROW(cumulative_lengths(down1, TensorView::contiguous(b.data() + 2, DType::kInt32, {3}, Device::cpu())));
  EXPECT_EQ(b, (std::vector<int32_t>{5, 3, 0, 3, 8, -1}));
  // In place over its own lengths (cu[1:] holding them) is refused: cu must not overlap lens.
  EXPECT_TRUE(throws_error([&] { cumulative_lengths(TensorView::contiguous(static_cast<int32_t*>(cu.data()) + 1, DType::kInt32, {4}, Device::cpu()), cu.view()); },
                           {"cumulative_lengths", "overlaps"}));
}

TEST(MemoryLayer, BuffersAreZeroedAlignedAndMovable) {
  detail::Buffer buffer(1000, Device::cpu());
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % detail::Buffer::kAlignment, 0u);
  const auto* bytes = static_cast<const unsigned char*>(buffer.data());
  EXPECT_TRUE(std::all_of(bytes, bytes + 1000, [](unsigned char b) { return b == 0; }));
  detail::Buffer moved = std::move(buffer);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(moved.size(), 1000u);
  Workspace workspace(4096, Device::cpu());
  EXPECT_EQ(workspace.size_bytes(), 4096u);
  EXPECT_TRUE(throws_error([] { detail::Buffer b(16, Device::cuda(0)); }, {"Buffer", "cuda:0"}));
}

TEST(MemoryLayer, LengthsPrefixSumsAndRowGather) {
  HostTensor lens64(DType::kInt64, {4});
  for (int i = 0; i < 4; ++i) lens64.i64(i) = 10 * i + 1;
  HostTensor out(DType::kInt32, {4}), cu(DType::kInt32, {5});
  detail::lengths_to_int32("op", "lens", lens64.view(), 3, out.view(), nullptr);
  EXPECT_EQ(read_int32(out.view()), (std::vector<int32_t>{4, 14, 24, 34}));
  detail::prefix_sum_int32("op", "lens", lens64.view(), cu.view(), nullptr);
  EXPECT_EQ(read_int32(cu.view()), (std::vector<int32_t>{0, 1, 12, 33, 64}));
  HostTensor empty(DType::kInt32, {0}), cu1(DType::kInt32, {1});
  cu1.i32(0) = 7;
  detail::prefix_sum_int32("op", "lens", empty.view(), cu1.view(), nullptr);
  EXPECT_EQ(cu1.i32(0), 0);
  // int64 lengths that int32 cannot hold, negative ones and totals past 2^31 - 1 are errors that
  // name the caller's argument, not values cut to 32 bits.
  lens64.i64(2) = (int64_t(1) << 32) + 21;
  EXPECT_TRUE(throws_error([&] { detail::lengths_to_int32("plan", "batch.seq_lens", lens64.view(), 0, out.view(), nullptr); },
                           {"plan", "batch.seq_lens[2] = 4294967317", "2^31 - 1"}));
  lens64.i64(2) = -(int64_t(1) << 32) + 8;
  EXPECT_TRUE(throws_error([&] { detail::lengths_to_int32("plan", "batch.seq_lens", lens64.view(), 0, out.view(), nullptr); },
                           {"batch.seq_lens[2] = -4294967288"}));
  lens64.i64(2) = INT32_MAX;
  EXPECT_TRUE(throws_error([&] { detail::lengths_to_int32("plan", "seq_lens", lens64.view(), 1, out.view(), nullptr); },
                           {"seq_lens[2] = 2147483647", "draft step offset"}));
  EXPECT_TRUE(throws_error([&] { detail::prefix_sum_int32("plan", "batch.extend_seq_lens", lens64.view(), cu.view(), nullptr); },
                           {"batch.extend_seq_lens[2] = 2147483647", "past 2^31 - 1"}));
  lens64.i64(2) = -1;
  EXPECT_TRUE(throws_error([&] { detail::prefix_sum_int32("plan", "batch.extend_seq_lens", lens64.view(), cu.view(), nullptr); },
                           {"batch.extend_seq_lens[2] = -1", ">= 0"}));

  HostTensor src(DType::kBF16, {5, 6}), dst(DType::kBF16, {3, 6});
  for (int64_t i = 0; i < src.numel(); ++i) src.set(i, float(i));
  HostTensor index = test::int32_tensor({4, 0, 4});
  detail::gather_rows(src.view(), index.view(), dst.view(), nullptr);
  for (int n = 0; n < 3; ++n)
    for (int d = 0; d < 6; ++d) EXPECT_EQ(dst.get(n * 6 + d), src.get(index.i32(n) * 6 + d));
  HostTensor bad = test::int32_tensor({1, 5, 0});
  EXPECT_TRUE(throws_error([&] { detail::gather_rows(src.view(), bad.view(), dst.view(), nullptr); }, {"index[1]", "[0, 5)"}));
  HostTensor wrong(DType::kFP16, {3, 6});
  EXPECT_TRUE(throws_error([&] { detail::gather_rows(src.view(), index.view(), wrong.view(), nullptr); }, {"dst", "bf16"}));
}

}  // namespace
}  // namespace mla
