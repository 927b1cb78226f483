// Planning: the per-batch metadata the attention kernels consume (DESIGN §3.7, §4), as plain data,
// and the host-side functions that compute its length-dependent parts.
//
// A Plan is built by mla::Backend::init_forward_metadata (mla/backend.hpp). Its TensorViews point
// into buffers the Backend owns on its device; the host vectors are copies of what was uploaded,
// kept for inspection and for the chunked-prefix loop. The kernels only read plans.
//
// Vocabulary (DESIGN §2):
//   B  requests in the batch        S  page size (a power of two, 1..128)
//   T  query rows (tokens)          N  prefix tokens in one prefix chunk
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mla/tensor.hpp"

namespace mla {

// The GPU split-KV schedule (mla/schedule.hpp); opaque here.
struct DecodeSchedule;

// One forward pass runs in one mode (DESIGN §2).
enum class ForwardMode : uint8_t {
  kDecode,        // one query per request, absorbed attention over the paged cache
  kIdle,          // no requests (keeps data-parallel ranks in step); nothing runs, nothing fails
  kExtend,        // prefill: new tokens attend causally to themselves and to their cached prefix
  kTargetVerify,  // num_draft_tokens queries per request, absorbed, causal among the drafts
  kDraftExtend,   // a different number of queries per request, absorbed, causal
};
std::string_view forward_mode_name(ForwardMode mode);
// DECODE, TARGET_VERIFY and DRAFT_EXTEND: absorbed attention, planned without host lengths.
bool is_decode_family(ForwardMode mode);

// ---------------------------------------------------------------------------------------------
// Block tables.

// Granularity of block-table widths: a row covers a multiple of 128 tokens' pages, i.e. of
// max(1, 128 / S) pages, so kernels can load page ids 128 tokens at a time without a tail case.
int block_table_width_granularity(int page_size);
// Block-table width (pages per row) for sequences of up to max_seq_len tokens:
// ceil(max_seq_len / S) rounded up to a multiple of block_table_width_granularity(S), and at least
// one such multiple (so a batch of empty rows still gets a well-formed table).
int padded_block_count(int64_t max_seq_len, int page_size);

// ---------------------------------------------------------------------------------------------
// EXTEND: how the new tokens attend to their cached prefix.
//
//   * Chunked (non-absorbed, MHA): the prefix latent entries are gathered chunk by chunk, the
//     model up-projects them to per-head keys/values (192/128 wide), each chunk is attended
//     non-causally and merged by LSE into the causal attention over the new tokens.
//   * Absorbed (MQA): 576-wide absorbed queries attend over the paged cache directly (the new
//     tokens' latents saved first), with q lengths = extend lengths and the causal rule of §2.
//
// Cost model behind the automatic rule, per head: the chunked path up-projects every prefix token
// (2 * 512 * 256 = 262144 FLOPs), the absorbed path instead pays (576 + 512) - (192 + 128) = 768
// extra multiply-adds (1536 FLOPs) per (new token, key) pair it attends: every prefix token, and
// the new tokens up to its own (extend_b * (extend_b + 1) / 2 causal pairs of a request). Absorbed
// is cheaper while those pairs stay below about 262144 / 1536 = 170 a prefix token.
enum class ExtendPrefixPath : uint8_t {
  kAuto,      // the rule below
  kChunked,   // always chunked (MHA) when there is a prefix
  kAbsorbed,  // always absorbed
};

// The decision. With no prefix at all (every prefix length 0) the chunked path has no chunks and
// is plain causal MHA over the new tokens, so kAuto and kChunked give false; kAbsorbed gives true.
// kAuto: absorbed iff
//   sum_b (extend_b * prefix_b + extend_b * (extend_b + 1) / 2)
//       <= absorbed_max_extend_len * sum_b prefix_b        (real division: the pairs' count)
// i.e. iff the absorbed path's extra pairs a prefix token are at most absorbed_max_extend_len
// (0 = chunked whenever the batch has both a prefix and new tokens). A long new prompt in the
// batch (its causal pairs grow with the square of its length) therefore sends the batch down
// the chunked path.
bool use_absorbed_extend(std::span<const int32_t> prefix_lens, std::span<const int32_t> extend_lens,
                         ExtendPrefixPath path, int64_t absorbed_max_extend_len);

// A prefix chunk. The prefix tokens of all requests are laid out request-major (request 0's
// positions 0..prefix_0-1, then request 1's, ...) and cut into consecutive chunks of exactly
// `chunk_capacity` tokens (the last one shorter). A chunk therefore holds, for every request, one
// contiguous range of its prefix positions, possibly empty; chunk boundaries fall anywhere,
// also inside a request. Any partition is exact because the parts are merged by their LSE.
struct PrefixChunk {
  int64_t first_token = 0;          // offset of the chunk in the request-major prefix order
  int64_t num_tokens = 0;           // N: prefix tokens in the chunk, all requests together
  int max_kv_len = 0;               // longest range of one request in the chunk
  bool has_empty_rows = false;      // some request has no token in the chunk (its rows: lse -inf)
  std::vector<int32_t> kv_begin;    // [B] first prefix position of request b's range (an empty
                                    // range sits where the chunk meets the request: 0 or prefix_b)
  std::vector<int32_t> kv_lens;     // [B] length of request b's range
  std::vector<int32_t> cu_kv_lens;  // [B + 1] prefix sums of kv_lens (host copy)
  // Set by the Backend (views into its plan buffers on its device):
  TensorView cu_kv_lens_device;     // [B + 1] int32, as cu_kv_lens
  TensorView slots;                 // [N] int32 token slots of the chunk, request-major
};

// Cuts the request-major prefix order into chunks of chunk_capacity (> 0) tokens. Empty when
// every prefix length is 0.
// deterministic: a request's prefix is cut only at multiples of chunk_capacity of its own
// positions, and a chunk (still at most chunk_capacity tokens, one contiguous range of the
// packed order) holds at most one such piece of each request. A request then meets the same
// pieces in the same order whatever the other requests, so its merged attention has the same
// bits; the price is more chunks (up to one a piece) where short prefixes do not pack.
std::vector<PrefixChunk> split_prefix_into_chunks(std::span<const int32_t> prefix_lens,
                                                  int64_t chunk_capacity, bool deterministic = false);

struct ExtendPlan {
  std::vector<int32_t> extend_lens;  // [B] new tokens per request (host)
  std::vector<int32_t> prefix_lens;  // [B] cached tokens before them (host)
  std::vector<int32_t> cu_q_lens;    // [B + 1] prefix sums of extend_lens (host)
  int64_t num_tokens = 0;            // Tq = sum extend_lens
  int max_q_len = 0;                 // max extend_lens
  int64_t num_prefix_tokens = 0;     // sum prefix_lens
  int max_prefix_len = 0;
  int max_seq_len = 0;               // max (prefix + extend)
  bool use_absorbed = false;         // use_absorbed_extend(...)
  std::vector<PrefixChunk> chunks;   // split_prefix_into_chunks(prefix_lens, capacity)
  // Set by the Backend:
  TensorView cu_q_lens_device;       // [B + 1] int32: rows of the new tokens, used as both q and
                                     // kv offsets of the causal new-token attention
};

// The host part of an EXTEND plan. Lengths must be >= 0; throws mla::Error naming the argument.
// deterministic: deterministic chunks (above), and kAuto takes the chunked path (its rule
// depends on the whole batch).
ExtendPlan plan_extend_lengths(std::span<const int32_t> prefix_lens,
                               std::span<const int32_t> extend_lens, int64_t chunk_capacity,
                               ExtendPrefixPath path, int64_t absorbed_max_extend_len,
                               bool deterministic = false);

// ---------------------------------------------------------------------------------------------
// The plan of one batch.
struct Plan {
  ForwardMode mode = ForwardMode::kIdle;
  int batch_size = 0;           // B
  int64_t num_tokens = 0;       // T query rows; -1 when only known at forward time (DRAFT_EXTEND
                                // planned from device lengths alone)
  bool fixed_buffers = false;   // views of the CUDA-graph buffers (init_cuda_graph_state)

  // Absorbed attention over the paged cache: the decode family, and EXTEND's absorbed path.
  TensorView block_table;       // [B, max_blocks] int32 page ids, -1 beyond each request's pages
  int max_blocks = 0;           // padded_block_count(...) (full context width in fixed buffers)
  TensorView kv_lens;           // [B] int32 cached tokens per request, the new ones included
  TensorView cu_q_lens;         // [B + 1] int32 query rows per request (DRAFT_EXTEND, EXTEND);
                                // empty when every request has q_len rows
  int q_len = 1;                // queries per request when cu_q_lens is empty
  int max_q_len = 1;            // bound on any request's queries (GPU launch shape)
  int64_t max_kv_len = 0;       // bound on kv_lens[b]
  // The GPU split-KV schedule for mla_decode; null until the GPU scheduler fills it (the
  // kernels then run unsplit). Always null on the CPU.
  const DecodeSchedule* schedule = nullptr;

  ExtendPlan extend;            // EXTEND only
};

}  // namespace mla
