// CPU mla_decode: absorbed (MQA) attention over the paged latent cache.
//
// Algorithm. A "row" is one (token, head) pair of a request. The work is cut into items of
// (request, block of consecutive rows); threads take items dynamically, longest first. An item
// walks the request's keys in tiles of kKeyTile. Each tile's cache entries are converted to
// float once and shared by all rows of the item (every head attends to the same latent key):
//   key_t  (576, kKeyTile)  transposed, for the score product q · k (vectorises over keys)
//   value  (kKeyTile, 576)  row-major; its first 512 columns are the values
// Per row, an online softmax keeps a running max (exact max subtraction), a running sum and a
// 512-wide float accumulator, rescaled whenever the max grows.
//
// Causal rule: query i of a request with q_len queries and kv_len keys sees keys
// 0 .. kv_len - q_len + i. q_len > kv_len is allowed: its first q_len - kv_len queries see no key
// and output 0 with lse -inf (as does every query of a request with kv_len 0).
//
// Data-dependent checks (cu_q_lens, kv_lens, page ids of the keys in use) run on the calling
// thread before any output is written.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cpu/parallel.hpp"
#include "mla/error.hpp"

namespace mla::cpu {
namespace {

constexpr int kKeyTile = 16;       // keys converted and scored together
constexpr int kMaxRowsPerItem = 64;
constexpr int kMinRowsPerItem = 4;

// dst[i] = element offset + i of a float-typed buffer, as float, for i < n.
void load_floats(const void* data, DType dtype, int64_t offset, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = uint32_t(src[i]) << 16;  // bf16 is the top half of a float
        std::memcpy(&dst[i], &bits, 4);
      }
      return;
    }
    case DType::kFP16: {
      const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_float(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      static const std::vector<float> table = [] {
        std::vector<float> t(256);
        for (int b = 0; b < 256; ++b) t[size_t(b)] = fp8e4m3_to_float(uint8_t(b));
        return t;
      }();
      const uint8_t* src = static_cast<const uint8_t*>(data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_as_float(data, dtype, offset + i);
  }
}

struct Request {
  int64_t first_token;  // cu_q_lens[b]
  int64_t q_len;
  int64_t kv_len;
};

struct WorkItem {
  int64_t request;
  int64_t row_begin, row_end;  // rows r = local_token * H + head of the request
  int64_t cost;                // rows x keys, for longest-first ordering
};

// Reads cu_q_lens / kv_lens / block_table on the host and checks every value the kernel uses.
std::vector<Request> read_requests(const MlaDecodeArgs& args, int64_t num_tokens) {
  constexpr const char* op = "mla_decode";
  const int64_t batch = args.block_table.shape[0];
  const int64_t max_blocks = args.block_table.shape[1];
  const int64_t page_size = args.kv_cache.shape[1];
  const int64_t num_pages = args.kv_cache.shape[0];
  const int32_t* kv_lens = static_cast<const int32_t*>(args.kv_lens.data);
  const int32_t* cu_q_lens = static_cast<const int32_t*>(args.cu_q_lens.data);
  const int32_t* block_table = static_cast<const int32_t*>(args.block_table.data);

  if (cu_q_lens) {
    MLA_CHECK(cu_q_lens[0] == 0, op, ": cu_q_lens[0] must be 0, got ", cu_q_lens[0]);
    MLA_CHECK(cu_q_lens[batch] == num_tokens, op, ": cu_q_lens[", batch, "] must equal the ",
              num_tokens, " query tokens of q, got ", cu_q_lens[batch]);
  }
  std::vector<Request> requests(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    Request& req = requests[size_t(b)];
    if (cu_q_lens) {
      MLA_CHECK(cu_q_lens[b + 1] >= cu_q_lens[b], op, ": cu_q_lens must be non-decreasing, got cu_q_lens[",
                b, "] = ", cu_q_lens[b], " > cu_q_lens[", b + 1, "] = ", cu_q_lens[b + 1]);
      req.first_token = cu_q_lens[b];
      req.q_len = cu_q_lens[b + 1] - cu_q_lens[b];
      MLA_CHECK(args.max_q_len == 0 || req.q_len <= args.max_q_len, op, ": request ", b, " has ",
                req.q_len, " queries (from cu_q_lens) but max_q_len is ", args.max_q_len);
    } else {
      req.first_token = b * args.q_len;
      req.q_len = args.q_len;
    }
    req.kv_len = kv_lens[b];
    MLA_CHECK(req.kv_len >= 0 && req.kv_len <= max_blocks * page_size, op, ": kv_lens[", b,
              "] = ", req.kv_len, " must be in [0, ", max_blocks * page_size,
              "] (block_table has ", max_blocks, " blocks of page size ", page_size, ")");
    if (req.q_len == 0) continue;  // no query reads this request's keys
    const int64_t used_blocks = (req.kv_len + page_size - 1) / page_size;
    for (int64_t j = 0; j < used_blocks; ++j) {
      const int32_t page = block_table[b * args.block_table.stride[0] + j];
      MLA_CHECK(page >= 0 && page < num_pages, op, ": block_table[", b, ", ", j, "] = ", page,
                " is not a page id in [0, ", num_pages, ") (request ", b, ", block ", j,
                ", value ", page, ", needed for kv_lens[", b, "] = ", req.kv_len, ")");
    }
  }
  return requests;
}

// Per-thread buffers, reused across items.
struct Scratch {
  std::vector<float> queries;   // (rows, 576)
  std::vector<float> acc;       // (rows, 512)
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> row_keys;  // keys each row sees
  std::vector<float> key_t;     // (576, kKeyTile)
  std::vector<float> value;     // (kKeyTile, 576)
};

class DecodeRunner {
 public:
  DecodeRunner(const MlaDecodeArgs& args, std::vector<Request> requests)
      : args_(args), requests_(std::move(requests)) {
    num_heads_ = (args.q.empty() ? args.q_nope : args.q).shape[1];
    page_size_ = args.kv_cache.shape[1];
    const bool fp8_cache = args.kv_cache.dtype == DType::kFP8E4M3;
    const DType q_dtype = (args.q.empty() ? args.q_nope : args.q).dtype;
    score_scale_ = args.softmax_scale * (q_dtype == DType::kFP8E4M3 ? args.q_scale : 1.0f) *
                   (fp8_cache ? args.k_scale : 1.0f);
    value_scale_ = fp8_cache ? args.k_scale : 1.0f;
  }

  void run() {
    std::vector<WorkItem> items = make_items();
    std::atomic<size_t> next{0};
    const int64_t threads = std::min<int64_t>(num_worker_threads(), int64_t(items.size()));
    parallel_for(threads, [&](int64_t) {
      Scratch scratch;
      for (size_t i = next++; i < items.size(); i = next++) run_item(items[i], scratch);
    });
  }

 private:
  std::vector<WorkItem> make_items() const {
    int64_t total_rows = 0;
    for (const Request& req : requests_) total_rows += req.q_len * num_heads_;
    // Enough items to keep every thread busy, each large enough to amortise the conversion.
    const int64_t target_items = 4 * int64_t(num_worker_threads());
    const int64_t rows_per_item = std::clamp<int64_t>((total_rows + target_items - 1) / target_items,
                                                      kMinRowsPerItem, kMaxRowsPerItem);
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < int64_t(requests_.size()); ++b) {
      const int64_t rows = requests_[size_t(b)].q_len * num_heads_;
      for (int64_t r = 0; r < rows; r += rows_per_item) {
        const int64_t end = std::min(rows, r + rows_per_item);
        items.push_back({b, r, end, (end - r) * (requests_[size_t(b)].kv_len + 1)});
      }
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
    return items;
  }

  // Query row (576 floats) of token t, head h.
  void load_query(int64_t t, int64_t h, float* dst) const {
    if (!args_.q.empty()) {
      load_floats(args_.q.data, args_.q.dtype, t * args_.q.stride[0] + h * args_.q.stride[1],
                  kLatentDim, dst);
    } else {
      load_floats(args_.q_nope.data, args_.q_nope.dtype,
                  t * args_.q_nope.stride[0] + h * args_.q_nope.stride[1], kKvLoraRank, dst);
      load_floats(args_.q_pe.data, args_.q_pe.dtype,
                  t * args_.q_pe.stride[0] + h * args_.q_pe.stride[1], kRopeDim,
                  dst + kKvLoraRank);
    }
  }

  // Converts keys [key_begin, key_begin + count) of request b into the tile buffers; the rest of
  // the tile is zero so that masked slots never produce NaN.
  void load_key_tile(int64_t b, int64_t key_begin, int count, Scratch& s) const {
    const int32_t* block_row =
        static_cast<const int32_t*>(args_.block_table.data) + b * args_.block_table.stride[0];
    const int64_t entry_stride = args_.kv_cache.stride[1];
    const int64_t page_stride = args_.kv_cache.stride[0];
    for (int j = 0; j < kKeyTile; ++j) {
      float* value_row = s.value.data() + int64_t(j) * kLatentDim;
      if (j < count) {
        const int64_t key = key_begin + j;
        const int64_t page = block_row[key / page_size_];
        load_floats(args_.kv_cache.data, args_.kv_cache.dtype,
                    page * page_stride + (key % page_size_) * entry_stride, kLatentDim, value_row);
      } else {
        std::fill(value_row, value_row + kLatentDim, 0.0f);
      }
      for (int d = 0; d < kLatentDim; ++d) s.key_t[size_t(d) * kKeyTile + j] = value_row[d];
    }
  }

  void run_item(const WorkItem& item, Scratch& s) const {
    const Request& req = requests_[size_t(item.request)];
    const int64_t num_rows = item.row_end - item.row_begin;
    s.queries.resize(size_t(num_rows) * kLatentDim);
    s.acc.assign(size_t(num_rows) * kKvLoraRank, 0.0f);
    s.row_max.assign(size_t(num_rows), -std::numeric_limits<float>::infinity());
    s.row_sum.assign(size_t(num_rows), 0.0f);
    s.row_keys.resize(size_t(num_rows));
    s.key_t.resize(size_t(kLatentDim) * kKeyTile);
    s.value.resize(size_t(kKeyTile) * kLatentDim);

    int64_t max_keys = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t local_token = (item.row_begin + r) / num_heads_;
      const int64_t head = (item.row_begin + r) % num_heads_;
      load_query(req.first_token + local_token, head, s.queries.data() + r * kLatentDim);
      const int64_t keys = std::clamp<int64_t>(req.kv_len - req.q_len + local_token + 1, 0, req.kv_len);
      s.row_keys[size_t(r)] = keys;
      max_keys = std::max(max_keys, keys);
    }

    for (int64_t key_begin = 0; key_begin < max_keys; key_begin += kKeyTile) {
      const int count = int(std::min<int64_t>(kKeyTile, max_keys - key_begin));
      load_key_tile(item.request, key_begin, count, s);
      // Rows that still see keys in this tile, attended in pairs.
      int64_t pending = -1;
      for (int64_t r = 0; r < num_rows; ++r) {
        if (s.row_keys[size_t(r)] <= key_begin) continue;
        if (pending < 0) {
          pending = r;
          continue;
        }
        attend_rows<2>({pending, r}, key_begin, count, s);
        pending = -1;
      }
      if (pending >= 0) attend_rows<1>({pending, pending}, key_begin, count, s);
    }

    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t local_token = (item.row_begin + r) / num_heads_;
      const int64_t head = (item.row_begin + r) % num_heads_;
      store_row(req.first_token + local_token, head, s.row_keys[size_t(r)] > 0,
                s.row_max[size_t(r)], s.row_sum[size_t(r)], s.acc.data() + r * kKvLoraRank);
    }
  }

  template <int kRows>
  void attend_rows(std::array<int64_t, 2> rows, int64_t key_begin, int count, Scratch& s) const {
    const float* queries[kRows];
    int valid[kRows];
    float* row_max[kRows];
    float* row_sum[kRows];
    float* acc[kRows];
    for (int i = 0; i < kRows; ++i) {
      const size_t r = size_t(rows[size_t(i)]);
      queries[i] = s.queries.data() + r * kLatentDim;
      valid[i] = int(std::min<int64_t>(count, s.row_keys[r] - key_begin));
      row_max[i] = &s.row_max[r];
      row_sum[i] = &s.row_sum[r];
      acc[i] = s.acc.data() + r * kKvLoraRank;
    }
    attend_tile<kRows>(queries, valid, s, row_max, row_sum, acc);
  }

  // One online-softmax step of kRows rows over the current tile; row i sees the first valid[i]
  // keys. Rows are processed in pairs so that each key/value load feeds two rows.
  template <int kRows>
  void attend_tile(const float* const* queries, const int* valid, const Scratch& s,
                   float* const* row_max, float* const* row_sum, float* const* acc) const {
    float scores[kRows][kKeyTile] = {};
    const float* key_t = s.key_t.data();
    for (int d = 0; d < kLatentDim; ++d) {
      const float* k = key_t + d * kKeyTile;
      for (int i = 0; i < kRows; ++i) {
        const float qd = queries[i][d];
        for (int j = 0; j < kKeyTile; ++j) scores[i][j] += qd * k[j];
      }
    }
    float probs[kRows][kKeyTile] = {};
    float correction[kRows];
    int max_valid = 0;
    for (int i = 0; i < kRows; ++i) {
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < valid[i]; ++j) {
        scores[i][j] *= score_scale_;
        tile_max = std::max(tile_max, scores[i][j]);
      }
      const float new_max = std::max(*row_max[i], tile_max);
      correction[i] = std::exp(*row_max[i] - new_max);  // 0 on the first tile
      float tile_sum = 0;
      for (int j = 0; j < valid[i]; ++j) {
        probs[i][j] = std::exp(scores[i][j] - new_max);
        tile_sum += probs[i][j];
      }
      *row_max[i] = new_max;
      *row_sum[i] = *row_sum[i] * correction[i] + tile_sum;
      max_valid = std::max(max_valid, valid[i]);
    }

    constexpr int kChunk = 16;  // accumulator columns kept in registers
    const float* value = s.value.data();
    for (int c0 = 0; c0 < kKvLoraRank; c0 += kChunk) {
      float a[kRows][kChunk];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) a[i][c] = acc[i][c0 + c] * correction[i];
      for (int j = 0; j < max_valid; ++j) {
        const float* v = value + int64_t(j) * kLatentDim + c0;
        for (int i = 0; i < kRows; ++i) {
          const float p = probs[i][j];  // 0 past valid[i]
          for (int c = 0; c < kChunk; ++c) a[i][c] += p * v[c];
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) acc[i][c0 + c] = a[i][c];
    }
  }

  // Writes out[t, h] = acc / row_sum (0 for a row without keys) and lse[t, h].
  void store_row(int64_t t, int64_t h, bool has_keys, float row_max, float row_sum,
                 const float* acc) const {
    const TensorView& out = args_.out;
    const int64_t out_offset = t * out.stride[0] + h * out.stride[1];
    const float factor = has_keys ? value_scale_ / row_sum : 0.0f;
    if (out.dtype == DType::kFP32) {
      float* dst = static_cast<float*>(out.data) + out_offset;
      for (int c = 0; c < kKvLoraRank; ++c) dst[c] = has_keys ? acc[c] * factor : 0.0f;
    } else {
      for (int c = 0; c < kKvLoraRank; ++c)
        store_from_float(out.data, out.dtype, out_offset + c, has_keys ? acc[c] * factor : 0.0f);
    }
    if (!args_.lse.empty()) {
      static_cast<float*>(args_.lse.data)[t * args_.lse.stride[0] + h * args_.lse.stride[1]] =
          has_keys ? row_max + std::log(row_sum) : -std::numeric_limits<float>::infinity();
    }
  }

  const MlaDecodeArgs& args_;
  std::vector<Request> requests_;
  int64_t num_heads_ = 0;
  int64_t page_size_ = 0;
  float score_scale_ = 0;
  float value_scale_ = 1;
};

}  // namespace

void mla_decode(const MlaDecodeArgs& args) {
  const int64_t num_tokens = (args.q.empty() ? args.q_nope : args.q).shape[0];
  DecodeRunner(args, read_requests(args, num_tokens)).run();
}

}  // namespace mla::cpu
