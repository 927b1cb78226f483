// The split-KV schedule of the GPU mla_decode (DESIGN §3.4, §3.7).
//
// A DecodeSchedule is plain data: it describes a caller-owned device workspace and how that
// workspace is carved into the schedule's arrays. Using it takes three steps:
//
//   size_t bytes = mla::decode_workspace_bytes(max_batch, max_q_len, num_heads);
//   void* ws = /* cudaMalloc(bytes), once, at start-up */;
//   mla::DecodeSchedule sched = mla::make_decode_schedule(ws, bytes, max_batch, max_q_len, num_heads);
//   ...
//   // every step (all on one stream, no host synchronisation, CUDA-graph capturable):
//   mla::plan_decode(sched, kv_lens, cu_q_lens, q_len, max_q_len, stream);
//   args.schedule = &sched;
//   mla::mla_decode(args, stream);
//
// plan_decode runs one small kernel that reads kv_lens (and cu_q_lens) on the device and writes
// the per-CTA work lists into the workspace: the queries of each request are cut into row tiles
// of (token, head) rows, and the keys of every row tile are divided among the decode kernel's
// persistent CTAs (one per SM) so that each CTA gets about the same number of key blocks. A row
// tile whose keys went to several CTAs produces partial results in the workspace, merged by a
// combine kernel that mla_decode launches after the main kernel.
//
// Contract: mla_decode must describe the batch that the last plan_decode on the same schedule
// planned (same kv_lens and cu_q_lens contents or q_len, same batch size, same max_q_len, same
// number of heads), and run after it on the same stream (or inside the same captured graph). A
// decode kernel that finds a schedule planned for a different batch shape stops with a device
// trap rather than read past the plan. One workspace serves one decode at a time: two decodes
// that may run concurrently need separate workspaces.
//
// The schedule exists only on the GPU: the CPU implementation ignores MlaDecodeArgs::schedule,
// and these functions throw mla::Error for CPU tensors or in a build without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace mla {

struct DecodeSchedule {
  void* workspace = nullptr;   // device memory of workspace_bytes, owned by the caller
  size_t workspace_bytes = 0;  // >= decode_workspace_bytes(max_batch, max_q_len, num_heads, num_parts)
  int device = 0;              // CUDA device the workspace lives on

  // Capacity (fixed when the schedule is made).
  int max_batch = 0;        // requests per plan
  int max_q_len = 0;        // queries per request
  int num_heads = 0;        // H, query heads (1..128)
  int num_parts = 0;        // persistent CTAs of the decode kernel (the SM count by default)
  int max_items = 0;        // work items: row tiles + one extra per cut between CTAs
  int max_split_units = 0;  // row tiles whose keys are split over several CTAs
  int max_slots = 0;        // partial-result slots (one per piece of a split row tile)

  // A deterministic schedule (make_deterministic_decode_schedule): every request's keys are cut
  // every split_keys keys; requests have at most max_kv_len keys. 0 for the balanced schedule.
  int split_keys = 0;
  int max_kv_len = 0;

  // Byte offsets of the arrays inside the workspace (each 256-byte aligned).
  size_t header_offset = 0;       // header: counts and the planned batch shape
  size_t items_offset = 0;        // [max_items] work items (request, row tile, key range, slot)
  size_t part_begin_offset = 0;   // [num_parts + 1] int32: CTA p runs items [begin[p], begin[p+1])
  size_t split_units_offset = 0;  // [max_split_units] row tiles to combine
  size_t partial_lse_offset = 0;  // [64, max_slots] fp32: row r of slot s at r * max_slots + s
  size_t partial_out_offset = 0;  // [max_slots, 64, 512] in the output's dtype (room for fp32)
};

// Deterministic split-KV (MlaDecodeArgs::deterministic with a schedule). The balanced schedule
// cuts the keys where the whole batch puts them, so a request's output moves (within rounding)
// with the other requests; deterministic = true without a schedule runs every row tile on one
// CTA, which leaves a small batch of long requests on a few SMs. A deterministic schedule cuts
// every request's keys at the multiples of split_keys (pieces [0, S), [S, 2S), ...: the cuts
// depend on the request alone), spreads the pieces over all CTAs, and the combine adds a row's
// pieces in key order: a request's output and LSE have the same bits in any batch planned on a
// deterministic schedule with the same split_keys. Its workspace holds a partial result for
// every piece of every row tile of 64 rows (16 on sm_86 / sm_89) of up to max_batch requests of
// max_kv_len keys: max_batch x ceil(max_q_len x H / 64) x ceil(max_kv_len / split_keys) slots
// of 128 KiB, so
// split_keys trades memory (and a combine over more pieces) for the CTAs a short batch can use.
// mla_decode checks that the block table cannot hold more than max_kv_len keys
// (block_table.shape[1] x page_size <= max_kv_len). Usage as above, with
//   size_t bytes = mla::decode_workspace_bytes_deterministic(max_batch, max_q_len, num_heads,
//                                                             max_kv_len, split_keys);
//   mla::DecodeSchedule sched = mla::make_deterministic_decode_schedule(ws, bytes, max_batch,
//                                   max_q_len, num_heads, max_kv_len, split_keys);
//   mla::plan_decode(sched, ...);  args.schedule = &sched;  args.deterministic = true;

#if defined(MLA_WITH_CUDA)

// Bytes of device workspace for a schedule with this capacity. num_parts = 0 uses the SM count
// of the current CUDA device.
size_t decode_workspace_bytes(int max_batch, int max_q_len, int num_heads, int num_parts = 0);

// Describes `workspace` (device memory on the current device, `bytes` long) as a schedule of the
// given capacity. Writes nothing to the device. Throws mla::Error when the workspace is too small
// or is not device memory.
DecodeSchedule make_decode_schedule(void* workspace, size_t bytes, int max_batch, int max_q_len,
                                    int num_heads, int num_parts = 0);

// The same for a deterministic schedule: split_keys a positive multiple of 64, max_kv_len >= 1.
size_t decode_workspace_bytes_deterministic(int max_batch, int max_q_len, int num_heads,
                                            int max_kv_len, int split_keys, int num_parts = 0);
DecodeSchedule make_deterministic_decode_schedule(void* workspace, size_t bytes, int max_batch,
                                                  int max_q_len, int num_heads, int max_kv_len,
                                                  int split_keys, int num_parts = 0);

// Plans the split-KV work of one batch on the GPU, without any host synchronisation:
//   kv_lens    [B] int32 device tensor, cached tokens per request (including the new ones)
//   cu_q_lens  [B + 1] int32 device tensor, or empty to use q_len queries per request
//   q_len      queries per request when cu_q_lens is empty (>= 1)
//   max_q_len  upper bound on the queries of any request (ignored without cu_q_lens: q_len)
// B = kv_lens.shape[0] must be <= schedule.max_batch; max_q_len <= schedule.max_q_len.
void plan_decode(const DecodeSchedule& schedule, const TensorView& kv_lens,
                 const TensorView& cu_q_lens, int q_len, int max_q_len, Stream stream = nullptr);

#else  // a build without CUDA: the schedule cannot exist

inline size_t decode_workspace_bytes(int, int, int, int = 0) {
  MLA_FAIL("decode_workspace_bytes: this build of mla has no CUDA support; the split-KV decode "
           "schedule exists only on the GPU");
}
inline DecodeSchedule make_decode_schedule(void*, size_t, int, int, int, int = 0) {
  MLA_FAIL("make_decode_schedule: this build of mla has no CUDA support; the split-KV decode "
           "schedule exists only on the GPU");
}
inline size_t decode_workspace_bytes_deterministic(int, int, int, int, int, int = 0) {
  MLA_FAIL("decode_workspace_bytes_deterministic: this build of mla has no CUDA support; the "
           "split-KV decode schedule exists only on the GPU");
}
inline DecodeSchedule make_deterministic_decode_schedule(void*, size_t, int, int, int, int, int,
                                                         int = 0) {
  MLA_FAIL("make_deterministic_decode_schedule: this build of mla has no CUDA support; the "
           "split-KV decode schedule exists only on the GPU");
}
inline void plan_decode(const DecodeSchedule&, const TensorView&, const TensorView&, int, int,
                        Stream = nullptr) {
  MLA_FAIL("plan_decode: this build of mla has no CUDA support; the split-KV decode schedule "
           "exists only on the GPU");
}

#endif

}  // namespace mla
