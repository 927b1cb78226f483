// CPU mha_prefill: ragged non-absorbed attention (per head, 192-wide q/k, 128-wide v).
//
// Algorithm. Work items are (request, head, block of consecutive query rows); threads take items
// dynamically, longest first. An item walks the request's keys of its head in tiles of kKeyTile,
// converting each tile to float once for all rows of the item:
//   key_t  (192, kKeyTile)  transposed, for the score product q · k (vectorises over keys)
//   value  (kKeyTile, 128)  row-major
// Per row, an online softmax keeps a running max (exact max subtraction), a running sum and a
// 128-wide float accumulator, rescaled whenever the max grows. Rows go in pairs so that each
// key/value load feeds two rows.
//
// Causal is bottom-right aligned: query i of a request with q_len queries and kv_len keys sees
// keys 0 .. kv_len - q_len + i. When q_len > kv_len the first q_len - kv_len queries see no key
// and output 0 with lse -inf (as does every query of a request with kv_len 0).
//
// Data-dependent checks (cu_q_lens, cu_kv_lens, max lengths) run on the calling thread before any
// output is written.
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

constexpr int kQkDim = 192;   // validated by the public entry
constexpr int kVDim = 128;
constexpr int kKeyTile = 16;  // keys converted and scored together
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
  const int64_t num_q_tokens = args.q.shape[0], num_kv_tokens = args.k.shape[0];
  MLA_CHECK(cu_q[0] == 0, op, ": cu_q_lens[0] must be 0, got ", cu_q[0]);
  MLA_CHECK(cu_kv[0] == 0, op, ": cu_kv_lens[0] must be 0, got ", cu_kv[0]);
  MLA_CHECK(cu_q[batch] == num_q_tokens, op, ": cu_q_lens[", batch, "] must equal the ",
            num_q_tokens, " tokens of q, got ", cu_q[batch]);
  MLA_CHECK(cu_kv[batch] == num_kv_tokens, op, ": cu_kv_lens[", batch, "] must equal the ",
            num_kv_tokens, " tokens of k and v, got ", cu_kv[batch]);
  std::vector<Request> requests(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    MLA_CHECK(cu_q[b + 1] >= cu_q[b], op, ": cu_q_lens must be non-decreasing, got cu_q_lens[", b,
              "] = ", cu_q[b], " > cu_q_lens[", b + 1, "] = ", cu_q[b + 1]);
    MLA_CHECK(cu_kv[b + 1] >= cu_kv[b], op, ": cu_kv_lens must be non-decreasing, got cu_kv_lens[",
              b, "] = ", cu_kv[b], " > cu_kv_lens[", b + 1, "] = ", cu_kv[b + 1]);
    Request& req = requests[size_t(b)];
    req.q_first = cu_q[b];
    req.q_len = cu_q[b + 1] - cu_q[b];
    req.kv_first = cu_kv[b];
    req.kv_len = cu_kv[b + 1] - cu_kv[b];
    MLA_CHECK(args.max_q_len == 0 || req.q_len <= args.max_q_len, op, ": request ", b, " has ",
              req.q_len, " queries (from cu_q_lens) but max_q_len is ", args.max_q_len);
    MLA_CHECK(args.max_kv_len == 0 || req.kv_len <= args.max_kv_len, op, ": request ", b, " has ",
              req.kv_len, " keys (from cu_kv_lens) but max_kv_len is ", args.max_kv_len);
  }
  return requests;
}

// Per-thread buffers, reused across items.
struct Scratch {
  std::vector<float> queries;  // (rows, 192)
  std::vector<float> acc;      // (rows, 128)
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> row_keys;  // keys each row sees
  std::vector<float> key_t;    // (192, kKeyTile)
  std::vector<float> value;    // (kKeyTile, 128)
  std::vector<float> key;      // (192), one converted key
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
    std::atomic<size_t> next{0};
    const int64_t threads = std::min<int64_t>(num_worker_threads(), int64_t(items.size()));
    parallel_for(threads, [&](int64_t) {
      Scratch scratch;
      for (size_t i = next++; i < items.size(); i = next++) run_item(items[i], scratch);
    });
  }

 private:
  int64_t keys_seen(const Request& req, int64_t row) const {
    if (!args_.causal) return req.kv_len;
    return std::clamp<int64_t>(req.kv_len - req.q_len + row + 1, 0, req.kv_len);
  }

  std::vector<WorkItem> make_items() const {
    int64_t total_rows = 0;
    for (const Request& req : requests_) total_rows += req.q_len * num_heads_;
    // Enough items to keep every thread busy, each large enough to amortise the conversion.
    const int64_t target_items = 4 * int64_t(num_worker_threads());
    const int64_t rows_per_item = std::clamp<int64_t>((total_rows + target_items - 1) / target_items,
                                                      kMinRowsPerItem, kMaxRowsPerItem);
    std::vector<WorkItem> items;
    for (int64_t b = 0; b < int64_t(requests_.size()); ++b) {
      const Request& req = requests_[size_t(b)];
      for (int64_t r = 0; r < req.q_len; r += rows_per_item) {
        const int64_t end = std::min(req.q_len, r + rows_per_item);
        const int64_t cost = (end - r) * (keys_seen(req, end - 1) + 1);
        for (int64_t h = 0; h < num_heads_; ++h) items.push_back({b, h, r, end, cost});
      }
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
    return items;
  }

  // Converts keys [key_begin, key_begin + count) of the request's head into the tile buffers; the
  // rest of the tile is zero so that masked slots never produce NaN.
  void load_key_tile(const Request& req, int64_t head, int64_t key_begin, int count,
                     Scratch& s) const {
    const TensorView& k = args_.k;
    const TensorView& v = args_.v;
    for (int j = 0; j < kKeyTile; ++j) {
      float* value_row = s.value.data() + int64_t(j) * kVDim;
      if (j < count) {
        const int64_t token = req.kv_first + key_begin + j;
        load_floats(k.data, k.dtype, token * k.stride[0] + head * k.stride[1], kQkDim, s.key.data());
        load_floats(v.data, v.dtype, token * v.stride[0] + head * v.stride[1], kVDim, value_row);
      } else {
        std::fill(s.key.begin(), s.key.end(), 0.0f);
        std::fill(value_row, value_row + kVDim, 0.0f);
      }
      for (int d = 0; d < kQkDim; ++d) s.key_t[size_t(d) * kKeyTile + j] = s.key[size_t(d)];
    }
  }

  void run_item(const WorkItem& item, Scratch& s) const {
    const Request& req = requests_[size_t(item.request)];
    const int64_t num_rows = item.row_end - item.row_begin;
    s.queries.resize(size_t(num_rows) * kQkDim);
    s.acc.assign(size_t(num_rows) * kVDim, 0.0f);
    s.row_max.assign(size_t(num_rows), -std::numeric_limits<float>::infinity());
    s.row_sum.assign(size_t(num_rows), 0.0f);
    s.row_keys.resize(size_t(num_rows));
    s.key_t.resize(size_t(kQkDim) * kKeyTile);
    s.value.resize(size_t(kKeyTile) * kVDim);
    s.key.resize(kQkDim);

    const TensorView& q = args_.q;
    int64_t max_keys = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t token = req.q_first + item.row_begin + r;
      load_floats(q.data, q.dtype, token * q.stride[0] + item.head * q.stride[1], kQkDim,
                  s.queries.data() + r * kQkDim);
      s.row_keys[size_t(r)] = keys_seen(req, item.row_begin + r);
      max_keys = std::max(max_keys, s.row_keys[size_t(r)]);
    }

    for (int64_t key_begin = 0; key_begin < max_keys; key_begin += kKeyTile) {
      const int count = int(std::min<int64_t>(kKeyTile, max_keys - key_begin));
      load_key_tile(req, item.head, key_begin, count, s);
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
      store_row(req.q_first + item.row_begin + r, item.head, s.row_keys[size_t(r)] > 0,
                s.row_max[size_t(r)], s.row_sum[size_t(r)], s.acc.data() + r * kVDim);
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
      queries[i] = s.queries.data() + r * kQkDim;
      valid[i] = int(std::min<int64_t>(count, s.row_keys[r] - key_begin));
      row_max[i] = &s.row_max[r];
      row_sum[i] = &s.row_sum[r];
      acc[i] = s.acc.data() + r * kVDim;
    }
    attend_tile<kRows>(queries, valid, s, row_max, row_sum, acc);
  }

  // One online-softmax step of kRows rows over the current tile; row i sees the first valid[i]
  // keys.
  template <int kRows>
  void attend_tile(const float* const* queries, const int* valid, const Scratch& s,
                   float* const* row_max, float* const* row_sum, float* const* acc) const {
    float scores[kRows][kKeyTile] = {};
    const float* key_t = s.key_t.data();
    for (int d = 0; d < kQkDim; ++d) {
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
    for (int c0 = 0; c0 < kVDim; c0 += kChunk) {
      float a[kRows][kChunk];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) a[i][c] = acc[i][c0 + c] * correction[i];
      for (int j = 0; j < max_valid; ++j) {
        const float* v = value + int64_t(j) * kVDim + c0;
        for (int i = 0; i < kRows; ++i) {
          const float p = probs[i][j];  // 0 past valid[i]
          for (int c = 0; c < kChunk; ++c) a[i][c] += p * v[c];
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) acc[i][c0 + c] = a[i][c];
    }
  }

  // Writes out[t, h] = acc / row_sum * value_scale (0 for a row without keys) and lse[t, h].
  void store_row(int64_t t, int64_t h, bool has_keys, float row_max, float row_sum,
                 const float* acc) const {
    const TensorView& out = args_.out;
    const int64_t out_offset = t * out.stride[0] + h * out.stride[1];
    const float factor = has_keys ? value_scale_ / row_sum : 0.0f;
    if (out.dtype == DType::kFP32) {
      float* dst = static_cast<float*>(out.data) + out_offset;
      for (int c = 0; c < kVDim; ++c) dst[c] = has_keys ? acc[c] * factor : 0.0f;
    } else {
      for (int c = 0; c < kVDim; ++c)
        store_from_float(out.data, out.dtype, out_offset + c, has_keys ? acc[c] * factor : 0.0f);
    }
    if (!args_.lse.empty()) {
      static_cast<float*>(args_.lse.data)[t * args_.lse.stride[0] + h * args_.lse.stride[1]] =
          has_keys ? row_max + std::log(row_sum) : -std::numeric_limits<float>::infinity();
    }
  }

  const MhaPrefillArgs& args_;
  std::vector<Request> requests_;
  int64_t num_heads_ = 0;
  float score_scale_ = 0;
  float value_scale_ = 1;
};

}  // namespace

void mha_prefill(const MhaPrefillArgs& args) { PrefillRunner(args, read_requests(args)).run(); }

}  // namespace mla::cpu
