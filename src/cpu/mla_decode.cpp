// CPU mla_decode: absorbed (MQA) attention over the paged latent cache.
//
// Algorithm. A "row" is one (token, head) pair of a request. The work is cut into items of
// (request, block of consecutive rows); threads take items dynamically, longest first. An item
// walks the request's keys in tiles of kKeyTile. Each tile's cache entries are converted to
// float once and shared by all rows of the item (every head attends to the same latent key):
//   key_t  (576, kKeyTile)  transposed, for the score product q · k (vectorises over keys)
//   value  (kKeyTile, 576)  row-major; its first 512 columns are the values
// Per row, an online softmax (cpu/online_softmax.hpp, shared with mha_prefill) keeps a running
// max (exact max subtraction), a running sum and a 512-wide float accumulator, rescaled whenever
// the max grows.
//
// Causal rule: query i of a request with q_len queries and kv_len keys sees keys
// 0 .. kv_len - q_len + i. q_len > kv_len is allowed: its first q_len - kv_len queries see no key
// and output 0 with lse -inf (as does every query of a request with kv_len 0).
//
// Data-dependent checks (cu_q_lens, kv_lens, page ids of the keys in use) run on the calling
// thread before any output is written.
#include <algorithm>
#include <utility>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cpu/online_softmax.hpp"
#include "mla/error.hpp"

namespace mla::cpu {
namespace {

// The rows of one item (per thread, reused across items). Its value tile keeps whole 576-wide
// cache entries, whose first 512 columns are the values.
using ItemRows = OnlineSoftmax<kLatentDim, kKvLoraRank, kLatentDim>;

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
// padded: cu_q_lens[B] may be below T (the GPU decode's rule; on the CPU with zero_padding_rows).
std::vector<Request> read_requests(const MlaDecodeArgs& args, int64_t num_tokens, bool padded) {
  constexpr const char* op = "mla_decode";
  const int64_t batch = args.block_table.shape[0];
  const int64_t max_blocks = args.block_table.shape[1];
  const int64_t page_size = args.kv_cache.shape[1];
  const int64_t num_pages = args.kv_cache.shape[0];
  const int32_t* kv_lens = static_cast<const int32_t*>(args.kv_lens.data);
  const int32_t* cu_q_lens = static_cast<const int32_t*>(args.cu_q_lens.data);
  const int32_t* block_table = static_cast<const int32_t*>(args.block_table.data);

  if (cu_q_lens)
    check_cu_lens_ends(op, "cu_q_lens", cu_q_lens, batch, num_tokens,
                       args.q.empty() ? "query tokens of q_nope" : "query tokens of q", padded);
  std::vector<Request> requests(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    Request& req = requests[size_t(b)];
    if (cu_q_lens) {
      req.first_token = cu_q_lens[b];
      req.q_len = checked_cu_len(op, "cu_q_lens", cu_q_lens, b, "queries", "max_q_len",
                                 args.max_q_len);
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
    run_longest_first<ItemRows>(items,
                                [&](const WorkItem& item, ItemRows& rows) { run_item(item, rows); });
  }

 private:
  std::vector<WorkItem> make_items() const {
    const int64_t rows_per_item = rows_per_work_item(requests_, num_heads_);
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < int64_t(requests_.size()); ++b) {
      const int64_t rows = requests_[size_t(b)].q_len * num_heads_;
      for (int64_t r = 0; r < rows; r += rows_per_item) {
        const int64_t end = std::min(rows, r + rows_per_item);
        items.push_back({b, r, end, (end - r) * (requests_[size_t(b)].kv_len + 1)});
      }
    }
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

  // Converts keys [key_begin, key_begin + count) of request b into the tile; the rest of the
  // tile is zero. Each cache entry is both the key (576) and, in its first 512 values, the value.
  void load_key_tile(int64_t b, int64_t key_begin, int count, ItemRows& rows) const {
    const int32_t* block_row =
        static_cast<const int32_t*>(args_.block_table.data) + b * args_.block_table.stride[0];
    const int64_t entry_stride = args_.kv_cache.stride[1];
    const int64_t page_stride = args_.kv_cache.stride[0];
    for (int j = 0; j < kKeyTile; ++j) {
      float* value_row = rows.value_row(j);
      if (j < count) {
        const int64_t key = key_begin + j;
        const int64_t page = block_row[key / page_size_];
        load_floats(args_.kv_cache.data, args_.kv_cache.dtype,
                    page * page_stride + (key % page_size_) * entry_stride, kLatentDim, value_row);
      } else {
        std::fill(value_row, value_row + kLatentDim, 0.0f);
      }
      rows.set_key(j, value_row);
    }
  }

  void run_item(const WorkItem& item, ItemRows& rows) const {
    const Request& req = requests_[size_t(item.request)];
    const int64_t num_rows = item.row_end - item.row_begin;
    rows.start(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t local_token = (item.row_begin + r) / num_heads_;
      const int64_t head = (item.row_begin + r) % num_heads_;
      load_query(req.first_token + local_token, head, rows.query(r));
      rows.set_keys_seen(r, causal_keys_seen(req.q_len, req.kv_len, local_token));
    }
    rows.attend(score_scale_, [&](int64_t key_begin, int count) {
      load_key_tile(item.request, key_begin, count, rows);
    });
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t local_token = (item.row_begin + r) / num_heads_;
      const int64_t head = (item.row_begin + r) % num_heads_;
      rows.store(r, args_.out, args_.lse, req.first_token + local_token, head, value_scale_);
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
  const bool padded = args.zero_padding_rows && !args.cu_q_lens.empty();
  std::vector<Request> requests = read_requests(args, num_tokens, padded);
  // zero_padding_rows: the rows past cu_q_lens[B] are one more request, without keys (out 0,
  // lse -inf, as every row that sees no key).
  if (padded) {
    const int64_t end = static_cast<const int32_t*>(args.cu_q_lens.data)[args.block_table.shape[0]];
    requests.push_back({end, num_tokens - end, 0});
  }
  DecodeRunner(args, std::move(requests)).run();
}

void check_decode_metadata(const MlaDecodeArgs& args, int64_t num_tokens) {
  (void)read_requests(args, num_tokens, /*padded=*/true);
}

}  // namespace mla::cpu
