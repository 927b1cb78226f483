// The core shared by the CPU attention kernels (mha_prefill, mla_decode).
//
// A kernel cuts its query rows (one token of one head each) into work items of consecutive rows
// that attend to the same keys. An item loads its queries into an OnlineSoftmax, which walks the
// keys in tiles of kKeyTile: the kernel converts each tile to float once for all rows of the item,
//   key_t  (kQkDim, kKeyTile)      transposed, for the score product q · k (vectorises over keys)
//   value  (kKeyTile, kValueStride) row-major; its first kVDim columns are the values
// and every row takes one online-softmax step over it: a running max (exact max subtraction), a
// running sum and a kVDim-wide float accumulator, rescaled whenever the max grows. Rows go in
// pairs so that each key/value load feeds two rows. A row's arithmetic does not depend on the
// other rows of its item, so results are bit-identical however the rows are cut into items.
//
// Also here: float conversion of input rows, the work-item scheduler, the causal rule and the
// host checks of cumulative lengths (cu_q_lens, cu_kv_lens).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/parallel.hpp"
#include "mla/dtype.hpp"
#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace mla::cpu {

constexpr int kKeyTile = 16;  // keys converted and scored together

// dst[i] = element offset + i of a float-typed buffer, as float, for i < n.
inline void load_floats(const void* data, DType dtype, int64_t offset, int64_t n, float* dst) {
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

// Causal rule, bottom-right aligned: query `row` of a request with q_len queries and kv_len keys
// sees keys 0 .. kv_len - q_len + row. When q_len > kv_len the first q_len - kv_len queries see
// no key.
inline int64_t causal_keys_seen(int64_t q_len, int64_t kv_len, int64_t row) {
  return std::clamp<int64_t>(kv_len - q_len + row + 1, 0, kv_len);
}

// ---- host checks of cumulative lengths cu[0 .. batch] ----------------------------------------

// cu[0] == 0 and cu[batch] == total ("... must equal the <total> <total_what>"), or with
// at_most, cu[batch] <= total (rows past cu[batch] not covered: the GPU decode's padded batches).
inline void check_cu_lens_ends(const char* op, const char* name, const int32_t* cu, int64_t batch,
                               int64_t total, const char* total_what, bool at_most = false) {
  MLA_CHECK(cu[0] == 0, op, ": ", name, "[0] must be 0, got ", cu[0]);
  MLA_CHECK(at_most ? cu[batch] <= total : cu[batch] == total, op, ": ", name, "[", batch, "] must ",
            at_most ? "be at most" : "equal", " the ", total, " ", total_what, ", got ", cu[batch]);
}

// cu[b + 1] - cu[b], the `what` (queries, keys) of request b: checks that cu does not decrease
// there and, unless max_len is 0 (derive), that the length is at most max_len.
inline int64_t checked_cu_len(const char* op, const char* name, const int32_t* cu, int64_t b,
                              const char* what, const char* max_name, int64_t max_len) {
  MLA_CHECK(cu[b + 1] >= cu[b], op, ": ", name, " must be non-decreasing, got ", name, "[", b,
            "] = ", cu[b], " > ", name, "[", b + 1, "] = ", cu[b + 1]);
  const int64_t len = cu[b + 1] - cu[b];
  MLA_CHECK(max_len == 0 || len <= max_len, op, ": request ", b, " has ", len, " ", what,
            " (from ", name, ") but ", max_name, " is ", max_len);
  return len;
}

// ---- work items ------------------------------------------------------------------------------

// Rows per work item for requests of q_len queries x num_heads heads: enough items to keep every
// thread busy, each large enough to amortise the tile conversion.
template <typename Request>
int64_t rows_per_work_item(const std::vector<Request>& requests, int64_t num_heads) {
  constexpr int64_t kMinRowsPerItem = 4, kMaxRowsPerItem = 64;
  int64_t total_rows = 0;
  for (const Request& req : requests) total_rows += req.q_len * num_heads;
  const int64_t target_items = 4 * int64_t(num_worker_threads());
  return std::clamp<int64_t>((total_rows + target_items - 1) / target_items, kMinRowsPerItem,
                             kMaxRowsPerItem);
}

// Calls run_item(item, state) for every item (each with a `cost` member), largest cost first;
// threads take items dynamically and each keeps one State, reused across its items.
template <typename State, typename Item, typename RunItem>
void run_longest_first(std::vector<Item>& items, RunItem&& run_item) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<size_t> next{0};
  const int64_t threads = std::min<int64_t>(num_worker_threads(), int64_t(items.size()));
  parallel_for(threads, [&](int64_t) {
    State state;
    for (size_t i = next++; i < items.size(); i = next++) run_item(items[i], state);
  });
}

// ---- online softmax over key tiles -----------------------------------------------------------

// The rows of one work item and their softmax state. Dims are compile-time so that the inner
// loops stay tight: kQkDim query/key width, kVDim value/output width, kValueStride the row
// stride of the value tile (>= kVDim; the decode kernel keeps whole 576-wide latents there).
template <int kQkDim, int kVDim, int kValueStride = kVDim>
class OnlineSoftmax {
  static constexpr int kChunk = 16;  // accumulator columns kept in registers
  static_assert(kVDim % kChunk == 0 && kVDim <= kValueStride);

 public:
  // Starts an item of num_rows rows that have seen no key yet.
  void start(int64_t num_rows) {
    num_rows_ = num_rows;
    max_keys_ = 0;
    queries_.resize(size_t(num_rows) * kQkDim);
    acc_.assign(size_t(num_rows) * kVDim, 0.0f);
    row_max_.assign(size_t(num_rows), -std::numeric_limits<float>::infinity());
    row_sum_.assign(size_t(num_rows), 0.0f);
    row_keys_.resize(size_t(num_rows));
    key_t_.resize(size_t(kQkDim) * kKeyTile);
    value_.resize(size_t(kKeyTile) * kValueStride);
  }

  // Row r's query (kQkDim floats), to fill after start().
  float* query(int64_t r) { return queries_.data() + r * kQkDim; }
  // Row r sees keys [0, keys).
  void set_keys_seen(int64_t r, int64_t keys) {
    row_keys_[size_t(r)] = keys;
    max_keys_ = std::max(max_keys_, keys);
  }

  // For load_tile: key j of the tile, kQkDim floats (zeros past the tile's count).
  void set_key(int j, const float* key) {
    for (int d = 0; d < kQkDim; ++d) key_t_[size_t(d) * kKeyTile + j] = key[d];
  }
  // For load_tile: value row j of the tile, kValueStride floats (zeros past the tile's count).
  float* value_row(int j) { return value_.data() + int64_t(j) * kValueStride; }

  // Walks keys [0, the most any row sees) in tiles: load_tile(key_begin, count) fills keys and
  // values key_begin .. key_begin + count - 1 (set_key, value_row) and zeros the rest of the
  // tile, so that masked slots never produce NaN; then every row that still sees keys in the
  // tile takes one online-softmax step over them, scores scaled by score_scale.
  template <typename LoadTile>
  void attend(float score_scale, LoadTile&& load_tile) {
    for (int64_t key_begin = 0; key_begin < max_keys_; key_begin += kKeyTile) {
      const int count = int(std::min<int64_t>(kKeyTile, max_keys_ - key_begin));
      load_tile(key_begin, count);
      // Rows that still see keys in this tile, attended in pairs.
      int64_t pending = -1;
      for (int64_t r = 0; r < num_rows_; ++r) {
        if (row_keys_[size_t(r)] <= key_begin) continue;
        if (pending < 0) {
          pending = r;
          continue;
        }
        attend_rows<2>({pending, r}, key_begin, count, score_scale);
        pending = -1;
      }
      if (pending >= 0) attend_rows<1>({pending, pending}, key_begin, count, score_scale);
    }
  }

  // Writes out[t, h] = acc / row_sum * value_scale of row r (0 for a row without keys) and, when
  // lse is given, lse[t, h] (-inf for a row without keys).
  void store(int64_t r, const TensorView& out, const TensorView& lse, int64_t t, int64_t h,
             float value_scale) const {
    const bool has_keys = row_keys_[size_t(r)] > 0;
    const float row_max = row_max_[size_t(r)];
    const float row_sum = row_sum_[size_t(r)];
    const float* acc = acc_.data() + r * kVDim;
    const int64_t out_offset = t * out.stride[0] + h * out.stride[1];
    const float factor = has_keys ? value_scale / row_sum : 0.0f;
    if (out.dtype == DType::kFP32) {
      float* dst = static_cast<float*>(out.data) + out_offset;
      for (int c = 0; c < kVDim; ++c) dst[c] = has_keys ? acc[c] * factor : 0.0f;
    } else {
      for (int c = 0; c < kVDim; ++c)
        store_from_float(out.data, out.dtype, out_offset + c, has_keys ? acc[c] * factor : 0.0f);
    }
    if (!lse.empty()) {
      static_cast<float*>(lse.data)[t * lse.stride[0] + h * lse.stride[1]] =
          has_keys ? row_max + std::log(row_sum) : -std::numeric_limits<float>::infinity();
    }
  }

 private:
  template <int kRows>
  void attend_rows(std::array<int64_t, 2> rows, int64_t key_begin, int count, float score_scale) {
    const float* queries[kRows];
    int valid[kRows];
    float* row_max[kRows];
    float* row_sum[kRows];
    float* acc[kRows];
    for (int i = 0; i < kRows; ++i) {
      const size_t r = size_t(rows[size_t(i)]);
      queries[i] = queries_.data() + r * kQkDim;
      valid[i] = int(std::min<int64_t>(count, row_keys_[r] - key_begin));
      row_max[i] = &row_max_[r];
      row_sum[i] = &row_sum_[r];
      acc[i] = acc_.data() + r * kVDim;
    }
    attend_tile<kRows>(queries, valid, score_scale, row_max, row_sum, acc);
  }

  // One online-softmax step of kRows rows over the current tile; row i sees the first valid[i]
  // keys.
  template <int kRows>
  void attend_tile(const float* const* queries, const int* valid, float score_scale,
                   float* const* row_max, float* const* row_sum, float* const* acc) const {
    float scores[kRows][kKeyTile] = {};
    const float* key_t = key_t_.data();
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
        scores[i][j] *= score_scale;
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

    const float* value = value_.data();
    for (int c0 = 0; c0 < kVDim; c0 += kChunk) {
      float a[kRows][kChunk];
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) a[i][c] = acc[i][c0 + c] * correction[i];
      for (int j = 0; j < max_valid; ++j) {
        const float* v = value + int64_t(j) * kValueStride + c0;
        for (int i = 0; i < kRows; ++i) {
          // Keys past valid[i] are skipped, not weighted by 0: a value of inf or NaN there (a key
          // this row must not see) would make 0 * v NaN.
          if (j >= valid[i]) continue;
          const float p = probs[i][j];
          for (int c = 0; c < kChunk; ++c) a[i][c] += p * v[c];
        }
      }
      for (int i = 0; i < kRows; ++i)
        for (int c = 0; c < kChunk; ++c) acc[i][c0 + c] = a[i][c];
    }
  }

  int64_t num_rows_ = 0;
  int64_t max_keys_ = 0;              // the most keys any row sees
  std::vector<float> queries_;        // (rows, kQkDim)
  std::vector<float> acc_;            // (rows, kVDim)
  std::vector<float> row_max_, row_sum_;
  std::vector<int64_t> row_keys_;     // keys each row sees
  std::vector<float> key_t_;          // (kQkDim, kKeyTile)
  std::vector<float> value_;          // (kKeyTile, kValueStride)
};

}  // namespace mla::cpu
