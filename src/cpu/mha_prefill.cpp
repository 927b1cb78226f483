// CPU mha_prefill: ragged non-absorbed attention (per head, 192-wide q/k, 128-wide v).
//
// Algorithm. Work items are (request, head, block of consecutive query rows); threads take items
// dynamically, longest first. An item walks the request's keys of its head in tiles of kKeyTile,
// converting each tile to float once for all rows of the item:
//   key_t  (192, kKeyTile)  transposed, for the score product q · k (vectorises over keys)
//   value  (kKeyTile, 128)  row-major
// Per row, an online softmax (cpu/online_softmax.hpp, shared with mla_decode) keeps a running
// max (exact max subtraction), a running sum and a 128-wide float accumulator, rescaled whenever
// the max grows. Rows go in pairs so that each key/value load feeds two rows.
//
// Causal is bottom-right aligned: query i of a request with q_len queries and kv_len keys sees
// keys 0 .. kv_len - q_len + i. When q_len > kv_len the first q_len - kv_len queries see no key
// and output 0 with lse -inf (as does every query of a request with kv_len 0).
//
// Data-dependent checks (cu_q_lens, cu_kv_lens, max lengths) run on the calling thread before any
// output is written.
#include <algorithm>
#include <array>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cpu/online_softmax.hpp"
#include "mla/error.hpp"

namespace mla::cpu {
namespace {

constexpr int kQkDim = 192;   // validated by the public entry
constexpr int kVDim = 128;

struct Request {
  int64_t q_first, q_len;
  int64_t kv_first, kv_len;
};

struct WorkItem {
  int64_t request, head;
  int64_t row_begin, row_end;  // query rows of the request
  int64_t cost;                // rows x keys, for longest-first ordering
};

// Reads and checks the cumulative lengths on the host.
std::vector<Request> read_requests(const MhaPrefillArgs& args) {
  constexpr const char* op = "mha_prefill";
  const int64_t batch = args.cu_q_lens.shape[0] - 1;
  const int32_t* cu_q = static_cast<const int32_t*>(args.cu_q_lens.data);
  const int32_t* cu_kv = static_cast<const int32_t*>(args.cu_kv_lens.data);
  check_cu_lens_ends(op, "cu_q_lens", cu_q, batch, args.q.shape[0], "tokens of q");
  check_cu_lens_ends(op, "cu_kv_lens", cu_kv, batch, args.k.shape[0], "tokens of k and v");
  std::vector<Request> requests(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    Request& req = requests[size_t(b)];
    req.q_first = cu_q[b];
    req.q_len = checked_cu_len(op, "cu_q_lens", cu_q, b, "queries", "max_q_len", args.max_q_len);
    req.kv_first = cu_kv[b];
    req.kv_len =
        checked_cu_len(op, "cu_kv_lens", cu_kv, b, "keys", "max_kv_len", args.max_kv_len);
  }
  return requests;
}

// Per-thread state: the rows of one item, and one converted key.
struct Scratch {
  OnlineSoftmax<kQkDim, kVDim> rows;
  std::array<float, kQkDim> key;
};

class PrefillRunner {
 public:
  PrefillRunner(const MhaPrefillArgs& args, std::vector<Request> requests)
      : args_(args), requests_(std::move(requests)) {
    num_heads_ = args.q.shape[1];
    const bool fp8 = args.q.dtype == DType::kFP8E4M3;
    score_scale_ = args.softmax_scale * (fp8 ? args.q_scale * args.k_scale : 1.0f);
    value_scale_ = fp8 ? args.v_scale : 1.0f;
  }

  void run() {
    std::vector<WorkItem> items = make_items();
    run_longest_first<Scratch>(items, [&](const WorkItem& item, Scratch& s) { run_item(item, s); });
  }

 private:
  int64_t keys_seen(const Request& req, int64_t row) const {
    return args_.causal ? causal_keys_seen(req.q_len, req.kv_len, row) : req.kv_len;
  }

  std::vector<WorkItem> make_items() const {
    const int64_t rows_per_item = rows_per_work_item(requests_, num_heads_);
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < int64_t(requests_.size()); ++b) {
      const Request& req = requests_[size_t(b)];
      for (int64_t r = 0; r < req.q_len; r += rows_per_item) {
        const int64_t end = std::min(req.q_len, r + rows_per_item);
        const int64_t cost = (end - r) * (keys_seen(req, end - 1) + 1);
        for (int64_t h = 0; h < num_heads_; ++h) items.push_back({b, h, r, end, cost});
      }
    }
    return items;
  }

  // Converts keys [key_begin, key_begin + count) of the request's head into the tile; the rest
  // of the tile is zero.
  void load_key_tile(const Request& req, int64_t head, int64_t key_begin, int count,
                     Scratch& s) const {
    const TensorView& k = args_.k;
    const TensorView& v = args_.v;
    for (int j = 0; j < kKeyTile; ++j) {
      float* value_row = s.rows.value_row(j);
      if (j < count) {
        const int64_t token = req.kv_first + key_begin + j;
        load_floats(k.data, k.dtype, token * k.stride[0] + head * k.stride[1], kQkDim, s.key.data());
        load_floats(v.data, v.dtype, token * v.stride[0] + head * v.stride[1], kVDim, value_row);
      } else {
        s.key.fill(0.0f);
        std::fill(value_row, value_row + kVDim, 0.0f);
      }
      s.rows.set_key(j, s.key.data());
    }
  }

  void run_item(const WorkItem& item, Scratch& s) const {
    const Request& req = requests_[size_t(item.request)];
    const int64_t num_rows = item.row_end - item.row_begin;
    const TensorView& q = args_.q;
    s.rows.start(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t token = req.q_first + item.row_begin + r;
      load_floats(q.data, q.dtype, token * q.stride[0] + item.head * q.stride[1], kQkDim,
                  s.rows.query(r));
      s.rows.set_keys_seen(r, keys_seen(req, item.row_begin + r));
    }
    s.rows.attend(score_scale_, [&](int64_t key_begin, int count) {
      load_key_tile(req, item.head, key_begin, count, s);
    });
    for (int64_t r = 0; r < num_rows; ++r)
      s.rows.store(r, args_.out, args_.lse, req.q_first + item.row_begin + r, item.head,
                   value_scale_);
  }

  const MhaPrefillArgs& args_;
  std::vector<Request> requests_;
  int64_t num_heads_ = 0;
  float score_scale_ = 0;
  float value_scale_ = 1;
};

}  // namespace

void check_prefill_metadata(const MhaPrefillArgs& args) { (void)read_requests(args); }

void mha_prefill(const MhaPrefillArgs& args) { PrefillRunner(args, read_requests(args)).run(); }

}  // namespace mla::cpu
