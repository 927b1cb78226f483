// Host-side planning: block-table widths, the EXTEND path decision, prefix chunking.
#include <algorithm>
#include <cstdint>

#include "mla/error.hpp"
#include "mla/ops.hpp"
#include "mla/plan.hpp"

namespace mla {

std::string_view forward_mode_name(ForwardMode mode) {
  switch (mode) {
    case ForwardMode::kDecode: return "DECODE";
    case ForwardMode::kIdle: return "IDLE";
    case ForwardMode::kExtend: return "EXTEND";
    case ForwardMode::kTargetVerify: return "TARGET_VERIFY";
    case ForwardMode::kDraftExtend: return "DRAFT_EXTEND";
  }
  return "unknown";
}

bool is_decode_family(ForwardMode mode) {
  return mode == ForwardMode::kDecode || mode == ForwardMode::kTargetVerify ||
         mode == ForwardMode::kDraftExtend;
}

namespace {
void check_page_size(const char* op, int page_size) {
  MLA_CHECK(page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0, op,
            ": page_size must be a power of two in 1..", kMaxPageSize, ", got ", page_size);
}
}  // namespace

int block_table_width_granularity(int page_size) {
  check_page_size("block_table_width_granularity", page_size);
  return std::max(1, kMaxPageSize / page_size);
}

int padded_block_count(int64_t max_seq_len, int page_size) {
  constexpr const char* op = "padded_block_count";
  check_page_size(op, page_size);
  MLA_CHECK(max_seq_len >= 0, op, ": max_seq_len must be >= 0, got ", max_seq_len);
  const int64_t granularity = block_table_width_granularity(page_size);
  const int64_t blocks = max_seq_len / page_size + (max_seq_len % page_size != 0);  // no overflow
  const int64_t padded = std::max<int64_t>(1, (blocks + granularity - 1) / granularity) * granularity;
  MLA_CHECK(padded <= INT32_MAX, op, ": max_seq_len ", max_seq_len, " needs ", padded,
            " pages per row, more than int32 holds");
  return int(padded);
}

bool use_absorbed_extend(std::span<const int32_t> prefix_lens, std::span<const int32_t> extend_lens,
                         ExtendPrefixPath path, int64_t absorbed_max_extend_len) {
  constexpr const char* op = "use_absorbed_extend";
  MLA_CHECK(prefix_lens.size() == extend_lens.size(), op, ": prefix_lens has ", prefix_lens.size(),
            " entries but extend_lens has ", extend_lens.size());
  MLA_CHECK(absorbed_max_extend_len >= 0, op, ": absorbed_max_extend_len must be >= 0, got ",
            absorbed_max_extend_len);
  int64_t prefix_total = 0;
  double pairs = 0;  // sum_b extend_b * prefix_b + extend_b * (extend_b + 1) / 2 (real, no overflow)
  for (size_t b = 0; b < prefix_lens.size(); ++b) {
    MLA_CHECK(prefix_lens[b] >= 0, op, ": prefix_lens[", b, "] must be >= 0, got ", prefix_lens[b]);
    MLA_CHECK(extend_lens[b] >= 0, op, ": extend_lens[", b, "] must be >= 0, got ", extend_lens[b]);
    prefix_total += prefix_lens[b];
    const double extend = double(extend_lens[b]);
    pairs += extend * double(prefix_lens[b]) + extend * (extend + 1) / 2;
  }
  if (path == ExtendPrefixPath::kAbsorbed) return true;
  if (prefix_total == 0 || path == ExtendPrefixPath::kChunked) return false;
  return pairs <= double(absorbed_max_extend_len) * double(prefix_total);
}

std::vector<PrefixChunk> split_prefix_into_chunks(std::span<const int32_t> prefix_lens,
                                                  int64_t chunk_capacity, bool deterministic) {
  constexpr const char* op = "split_prefix_into_chunks";
  MLA_CHECK(chunk_capacity > 0, op, ": chunk_capacity must be > 0, got ", chunk_capacity);
  const size_t batch = prefix_lens.size();
  // Request b's prefix occupies [offset[b], offset[b] + prefix_lens[b]) of the packed order.
  std::vector<int64_t> offset(batch + 1, 0);
  for (size_t b = 0; b < batch; ++b) {
    MLA_CHECK(prefix_lens[b] >= 0, op, ": prefix_lens[", b, "] must be >= 0, got ", prefix_lens[b]);
    offset[b + 1] = offset[b] + prefix_lens[b];
  }
  const int64_t total = offset[batch];

  // Where the chunks end in the packed order. Deterministic: a request's prefix is cut only at
  // multiples of the capacity in its own positions (pieces), and pieces are packed whole, in
  // order, while they fit. Every piece but a request's last is a whole capacity, so a chunk holds
  // at most one piece of a request, and each request meets the same pieces, merged in the same
  // order, whatever the other requests.
  std::vector<int64_t> ends;
  if (!deterministic) {
    for (int64_t first = 0; first < total; first += chunk_capacity)
      ends.push_back(std::min(total, first + chunk_capacity));
  } else {
    int64_t chunk_first = 0;
    for (size_t b = 0; b < batch; ++b)
      for (int64_t piece = offset[b], piece_end = 0; piece < offset[b + 1]; piece = piece_end) {
        piece_end = piece + std::min(chunk_capacity, offset[b + 1] - piece);  // no overflow
        if (piece > chunk_first && piece_end - chunk_first > chunk_capacity) {
          ends.push_back(piece);
          chunk_first = piece;
        }
      }
    if (total > chunk_first) ends.push_back(total);
  }

  std::vector<PrefixChunk> chunks;
  int64_t first = 0;
  for (const int64_t last : ends) {  // [first, last) of the packed order
    PrefixChunk chunk;
    chunk.first_token = first;
    chunk.num_tokens = last - first;
    chunk.kv_begin.assign(batch, 0);
    chunk.kv_lens.assign(batch, 0);
    chunk.cu_kv_lens.assign(batch + 1, 0);
    for (size_t b = 0; b < batch; ++b) {
      const int64_t begin = std::clamp(first, offset[b], offset[b + 1]);
      const int64_t end = std::clamp(last, offset[b], offset[b + 1]);
      chunk.kv_begin[b] = int32_t(begin - offset[b]);
      chunk.kv_lens[b] = int32_t(end - begin);
      chunk.cu_kv_lens[b + 1] = chunk.cu_kv_lens[b] + chunk.kv_lens[b];
      chunk.max_kv_len = std::max(chunk.max_kv_len, chunk.kv_lens[b]);
      chunk.has_empty_rows = chunk.has_empty_rows || chunk.kv_lens[b] == 0;
    }
    chunks.push_back(std::move(chunk));
    first = last;
  }
  return chunks;
}

ExtendPlan plan_extend_lengths(std::span<const int32_t> prefix_lens,
                               std::span<const int32_t> extend_lens, int64_t chunk_capacity,
                               ExtendPrefixPath path, int64_t absorbed_max_extend_len,
                               bool deterministic) {
  constexpr const char* op = "plan_extend_lengths";
  MLA_CHECK(prefix_lens.size() == extend_lens.size(), op, ": prefix_lens has ", prefix_lens.size(),
            " entries but extend_lens has ", extend_lens.size());
  const size_t batch = prefix_lens.size();
  ExtendPlan plan;
  plan.prefix_lens.assign(prefix_lens.begin(), prefix_lens.end());
  plan.extend_lens.assign(extend_lens.begin(), extend_lens.end());
  plan.cu_q_lens.assign(batch + 1, 0);
  for (size_t b = 0; b < batch; ++b) {
    MLA_CHECK(extend_lens[b] >= 0, op, ": extend_lens[", b, "] must be >= 0, got ", extend_lens[b]);
    MLA_CHECK(prefix_lens[b] >= 0, op, ": prefix_lens[", b, "] must be >= 0, got ", prefix_lens[b]);
    const int64_t cu = int64_t(plan.cu_q_lens[b]) + extend_lens[b];
    MLA_CHECK(cu <= INT32_MAX, op, ": the batch has more than 2^31 - 1 new tokens");
    plan.cu_q_lens[b + 1] = int32_t(cu);
    plan.max_q_len = std::max(plan.max_q_len, extend_lens[b]);
    plan.num_prefix_tokens += prefix_lens[b];
    plan.max_prefix_len = std::max(plan.max_prefix_len, prefix_lens[b]);
    const int64_t seq_len = int64_t(prefix_lens[b]) + extend_lens[b];
    MLA_CHECK(seq_len <= INT32_MAX, op, ": prefix_lens[", b, "] + extend_lens[", b,
              "] overflows int32");
    plan.max_seq_len = std::max(plan.max_seq_len, int(seq_len));
  }
  plan.num_tokens = plan.cu_q_lens[batch];
  // Deterministic: kAuto's choice depends on the whole batch, so it becomes the chunked path.
  if (deterministic && path == ExtendPrefixPath::kAuto) path = ExtendPrefixPath::kChunked;
  plan.use_absorbed = use_absorbed_extend(prefix_lens, extend_lens, path, absorbed_max_extend_len);
  plan.chunks = split_prefix_into_chunks(prefix_lens, chunk_capacity, deterministic);
  return plan;
}

}  // namespace mla
