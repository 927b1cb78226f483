// The stateless operations of the MLA backend (DESIGN §3).
//
// Every op validates its arguments (throwing mla::Error that names the argument), then runs on
// the device its tensors live on: all CPU -> the CPU reference implementation; all CUDA -> the
// CUDA kernels (when the library was built with CUDA; otherwise mla::Error). Mixed devices are an
// error. Ops never allocate: outputs and scratch space are passed in.
//
// Shapes use these names:
//   T   tokens (queries) in the batch          H   query heads (1..128)
//   B   requests in the batch                  P   pages in the pool
//   S   page size (a power of two, 1..128)     D   576 = kv_lora_rank 512 + rope 64
//
// LSE convention: lse = ln(sum_j exp(s_j)), where s_j = softmax_scale * q·k_j (the *scaled* score,
// natural log). A row that attends to no key has output 0 and lse = -inf.
#pragma once

#include <cstdint>

#include "mla/tensor.hpp"

namespace mla {

// The GPU split-KV schedule (mla/schedule.hpp); an opaque pointer for CPU users.
struct DecodeSchedule;

constexpr int kKvLoraRank = 512;   // c_kv width, also the absorbed value / output width
constexpr int kRopeDim = 64;       // k_pe / q_pe width
constexpr int kLatentDim = 576;    // cache entry width = kKvLoraRank + kRopeDim
constexpr int kMaxHeads = 128;
constexpr int kMaxPageSize = 128;
// Keys a decode request may have (block_table columns x page size): kv_lens are int32, and the
// kernels form key positions up to a few tiles past a request's last key in 32 bits.
constexpr long long kMaxKeysPerRequest = (1LL << 31) - 256;
constexpr float kFp8E4M3Max = 448.0f;

// ---------------------------------------------------------------------------------------------
// 1. append_latent_kv: kv_cache[loc[t] / S, loc[t] % S, :] = (k_nope[t] | k_pe[t]) converted to
//    the cache dtype. For an fp8 cache the stored value is saturate_fp8(x / k_scale), so that
//    stored * k_scale approximates x. loc -1 skips that token (padding). Any other value outside
//    [0, P*S) is an error on the CPU (nothing is written); the CUDA kernel cannot report without
//    a host sync, so it skips such tokens and never writes out of bounds (with check_metadata
//    the GPU path reports them as the CPU path does). Two tokens with one slot
//    race: the CPU path keeps the later one, the GPU may store a mix of both rows' 16-byte chunks.
struct AppendLatentKvArgs {
  TensorView k_nope;    // [T, 512] bf16/fp16/fp32, inner stride 1
  TensorView k_pe;      // [T, 64]  same dtype as k_nope, inner stride 1
  TensorView loc;       // [T] int32 or int64: token slots in the pool (< P * S), -1 = skip
  TensorView kv_cache;  // [P, S, 576] bf16/fp16/fp8e4m3, contiguous; overlaps no input
  float k_scale = 1.0f; // fp8 only: dequantised = stored * k_scale (> 0)
  // GPU only, a debug mode: before launching, copy loc to the host and check it as the CPU path
  // does, throwing mla::Error that names the first slot out of range (nothing is written then).
  // It synchronises the stream, so it is refused while the stream is being captured into a CUDA
  // graph.
  bool check_metadata = false;
};
void append_latent_kv(const AppendLatentKvArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// 2. build_block_table: block_table[b, j] = req_to_token[req_pool_indices[b], j * S] / S for
//    j < ceil(seq_lens[b] / S), and -1 for the rest of the row.
//    seq_lens[b] must be <= max_blocks * S and <= req_to_token.shape[1]. The CPU path throws on a
//    bad index or length; the GPU path, which cannot report without a host sync, writes -1 over
//    the whole row of a bad request and over the entry of a negative token slot (never leaving
//    what an earlier call wrote there); with check_metadata it throws as the CPU path does.
struct BuildBlockTableArgs {
  TensorView req_to_token;      // [R, max_context_len] int32
  TensorView req_pool_indices;  // [B] int32 or int64, each in [0, R)
  TensorView seq_lens;          // [B] int32 or int64, each >= 0
  int page_size = 64;           // S
  TensorView block_table;       // [B, max_blocks] int32, output (no two entries at one address,
                                // none over an input)
  // GPU only, a debug mode: before launching, copy req_pool_indices, seq_lens and the token slots
  // of the pages in use to the host and check them as the CPU path does, throwing mla::Error that
  // names the first bad one (nothing is written then). It synchronises the stream (once a
  // request), so it is refused while the stream is being captured into a CUDA graph.
  bool check_metadata = false;
};
void build_block_table(const BuildBlockTableArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// 3. rope_quantize: rotary embedding of q_pe and k_pe, then
//      q_out[t, h] = q_nope[t, h] | rope(q_pe[t, h])   (576 wide)
//      k_nope_out[t] = k_nope[t], k_pe_out[t] = rope(k_pe[t])
//    each converted to its output's dtype; an fp8 output stores saturate_fp8(x / scale).
//    cos_sin_cache[pos] holds 32 cos values then 32 sin values (fp32).
//    NeoX: pairs (i, i + 32); interleaved (GPT-J): pairs (2i, 2i + 1). For pair (x1, x2) with
//    angle index i: x1' = x1 cos_i - x2 sin_i, x2' = x2 cos_i + x1 sin_i.
//    A position outside [0, max_position) throws on the CPU; on the GPU that token's query rows
//    and key row are written NaN (with check_metadata it throws as on the CPU). No output element may share an address with another
//    (check::non_overlapping) or with an input (check::disjoint): an in-place call is not
//    supported (the GPU reads a pair's partner while other threads write); either is an
//    mla::Error.
enum class RopeStyle : uint8_t { kNeox, kInterleaved };
struct RopeQuantizeArgs {
  TensorView q_nope;         // [T, H, 512] bf16/fp16/fp32, inner stride 1
  TensorView q_pe;           // [T, H, 64]  same dtype
  TensorView k_nope;         // [T, 512] optional (empty: no k outputs at all)
  TensorView k_pe;           // [T, 64]  required when k_nope given
  TensorView cos_sin_cache;  // [max_position, 64] fp32
  TensorView positions;      // [T] int32 or int64, each in [0, max_position)
  RopeStyle style = RopeStyle::kNeox;
  TensorView q_out;          // [T, H, 576] bf16/fp16/fp8e4m3, inner stride 1
  TensorView k_nope_out;     // [T, 512] bf16/fp16/fp8e4m3 (with k_nope)
  TensorView k_pe_out;       // [T, 64]  same dtype as k_nope_out
  float q_scale = 1.0f;      // used when q_out is fp8 (checked > 0 and finite in every call)
  float k_scale = 1.0f;      // used when the k outputs are fp8 (likewise)
  // GPU only, a debug mode: before launching, copy positions to the host and check them as the
  // CPU path does, throwing mla::Error that names the first one out of range (nothing is
  // written then). It synchronises the stream, so it is refused while the stream is being
  // captured into a CUDA graph.
  bool check_metadata = false;
};
void rope_quantize(const RopeQuantizeArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// 4. mla_decode: absorbed attention over the paged latent cache.
//
//    Requests b = 0..B-1 own query rows [cu_q_lens[b], cu_q_lens[b+1]) (or, without cu_q_lens,
//    rows [b*q_len, (b+1)*q_len)). kv_lens[b] counts the cached tokens including the new ones.
//    Causal rule: query i of request b (q_len_b rows) sees keys 0 .. kv_lens[b] - q_len_b + i.
//    A query that sees no key (kv_len < q_len, or kv_len 0) outputs 0 with lse -inf.
//    Non-finite cache values: the CPU path skips the keys a row must not see; the GPU kernels
//    give such a key the weight 0 inside a tile that other rows read, and 0 x inf is NaN, so an
//    inf or NaN in one of a request's new tokens can make its earlier queries' rows NaN there.
//    Key j of request b is kv_cache[block_table[b, j / S], j % S, 0:576]; value is its first 512.
//
//    score = (q · k) * softmax_scale * q_scale * k_scale    (q_scale only for fp8 queries,
//                                                            k_scale only for an fp8 cache)
//    out   = sum_j softmax(score)_j * v_j * k_scale          (k_scale only for an fp8 cache)
//
//    Queries come either as one [T, H, 576] tensor `q`, or as q_nope [T, H, 512] and q_pe
//    [T, H, 64] (no concatenation copy). Query, output and LSE may have any strides on the token
//    and head dims; the last dim must be contiguous, and no two output elements may overlap
//    (check::non_overlapping: a stride of 0 or rows laid over each other is an mla::Error), nor
//    may out or lse overlap each other or an input (check::disjoint).
// The GPU decode kernel. kAuto runs the Hopper kernel (wgmma + TMA, warp-specialised) where it
// applies: an sm_90 device, a build with sm_90a, a bf16 or fp16 cache with a query of its dtype
// or an fp8e4m3 cache with any query, a page size >= 16, a cache of at most 2^31 - 1 token slots
// (P x S), 16-byte aligned query rows, and either more than 16 query rows a request (max_q_len x
// heads), or a batch of 16 requests or more whose block table is wide enough for 12 key tiles of
// 64 an SM (batch x table width in tokens / 64 >= 12 x SMs: with fewer tiles a CTA the portable
// kernel is faster at 16 rows; an fp8 cache: a batch of 4 or more), or `deterministic`;
// anything else runs the portable mma.sync kernel (sm_80 and newer). kPortable
// always runs the portable kernel; kHopper runs the Hopper kernel or throws mla::Error saying
// which condition fails. Both give the same results up to fp32 rounding
// order. Ignored on the CPU.
enum class DecodeKernel { kAuto, kPortable, kHopper };

struct MlaDecodeArgs {
  TensorView q;            // [T, H, 576] bf16/fp16/fp8e4m3, or empty when q_nope/q_pe are given
  TensorView q_nope;       // [T, H, 512]
  TensorView q_pe;         // [T, H, 64]
  TensorView kv_cache;     // [P, S, 576] bf16/fp16/fp8e4m3, contiguous
  TensorView block_table;  // [B, max_blocks] int32, page ids in [0, P) for the pages in use
  TensorView kv_lens;      // [B] int32, each in [0, max_blocks * S]
  // [B + 1] int32, cu_q_lens[0] == 0, non-decreasing, cu_q_lens[B] == T; optional. On the GPU
  // (where it is checked only with check_metadata, by this rule), and on the CPU with
  // zero_padding_rows, cu_q_lens[B] < T is allowed: a CUDA-graph DRAFT_EXTEND captured at its
  // largest query count relies on that. The rows past cu_q_lens[B] are then left untouched (GPU),
  // or written as rows that see no key with zero_padding_rows.
  TensorView cu_q_lens;
  int q_len = 1;           // queries per request when cu_q_lens is empty (T == B * q_len)
  int max_q_len = 0;       // upper bound on q_len_b (GPU launch shape); 0 = derive (CPU, or
                           // an empty batch on the GPU)
  float softmax_scale = 0; // required, > 0
  float q_scale = 1.0f;
  float k_scale = 1.0f;
  TensorView out;          // [T, H, 512] bf16/fp16/fp32
  TensorView lse;          // [T, H] fp32, optional
  // GPU only: scratch for split-KV partial results and the schedule, from a DecodePlan (see
  // mla/plan.hpp). Ignored on the CPU. When null on the GPU, the kernel runs without splitting.
  const DecodeSchedule* schedule = nullptr;
  DecodeKernel kernel = DecodeKernel::kAuto;  // GPU only
  // GPU only, a debug mode: before launching, copy cu_q_lens, kv_lens and block_table to the
  // host and check them as the CPU path always does (kv_lens within the block table, q_len_b
  // <= max_q_len, page ids of the keys in use in [0, P); cu_q_lens[B] <= T, the GPU's rule
  // above, where the CPU needs == T), throwing mla::Error that names the
  // first bad value. Without it a bad value is not reported: the kernels clamp lengths and read
  // a key on a page id outside [0, P) as zeros, never out of bounds. It synchronises the stream,
  // so it is refused while the stream is being captured into a CUDA graph.
  bool check_metadata = false;
  // Deterministic mode (DESIGN §5): each request's output and LSE rows are bit-identical whatever
  // the other requests of the batch, its place in it, the batch size and max_q_len, and on every
  // run, for given heads, dtypes, page size, query layout and device (kAuto's kernel also
  // depends on the query rows' alignment and the pool's size). On the GPU every request's rows are cut
  // into tiles of 64 rows (also where fewer rows would fit a narrower tile; 16 on GPUs whose
  // blocks cannot hold the portable kernel's 64-row tile: sm_86 / sm_89), and kAuto picks the
  // kernel from everything but the batch size. Without a schedule each tile's keys are attended
  // by one thread block in order: slower where splitting pays (few requests with long contexts),
  // as fast at large batches, where the plan keeps units whole anyway. With a schedule from
  // make_deterministic_decode_schedule (mla/schedule.hpp; a balanced one is refused) every
  // request's keys are cut at the multiples of its split_keys and spread over all SMs. The CPU
  // path is deterministic in either mode.
  bool deterministic = false;
  // With cu_q_lens: the rows past cu_q_lens[B] (a padded batch's) are written as rows that see
  // no key, out 0 and lse -inf. On the GPU by one more small kernel in the stream after the
  // attention (no host sync; capturable), so that a graph replayed with fewer queries than it
  // was captured for leaves no stale rows and needs no zero-fill of the whole output first.
  // Without cu_q_lens there are no such rows.
  bool zero_padding_rows = false;
};
void mla_decode(const MlaDecodeArgs& args, Stream stream = nullptr);
// The kernel mla_decode runs for these arguments: "cpu", "sm80-mma" (portable) or "sm90-wgmma"
// (Hopper). Throws as mla_decode would when args.kernel asks for a kernel that does not apply.
const char* mla_decode_kernel_name(const MlaDecodeArgs& args);

// ---------------------------------------------------------------------------------------------
// 5. mha_prefill: ragged non-absorbed attention (per head, 192-wide q/k, 128-wide v).
//    Request b has q rows [cu_q_lens[b], cu_q_lens[b+1]) and kv rows [cu_kv_lens[b],
//    cu_kv_lens[b+1]). Causal is bottom-right aligned: query i of a request with q_len and kv_len
//    sees keys 0 .. kv_len - q_len + i. Rows that see no key output 0 with lse -inf.
//    score = (q · k) * softmax_scale * q_scale * k_scale; out = softmax(score) · v * v_scale.
//    As in mla_decode, an inf or NaN in a key or value that a causal row must not see is skipped
//    on the CPU and can make that row NaN on the GPU (weight 0 times inf).
//    The CPU path checks the offsets and throws. On the GPU they are device data read by the
//    kernel: each is clamped to [0, Tq] / [0, Tk] (a request whose end precedes its start has no
//    rows), so a bad one never reads or writes outside the tensors (it can still mix or overwrite
//    other requests' rows; `check_metadata` reports it instead), and a request's rows that the
//    launch does not cover (past ceil(max_q_len / 64) * 64) come out NaN.
struct MhaPrefillArgs {
  TensorView q;            // [Tq, H, 192] bf16/fp16/fp8e4m3, inner stride 1
  TensorView k;            // [Tk, H, 192] same dtype as q
  TensorView v;            // [Tk, H, 128] same dtype as q
  TensorView cu_q_lens;    // [B + 1] int32, cu_q_lens[0] == 0, cu_q_lens[B] == Tq
  TensorView cu_kv_lens;   // [B + 1] int32, cu_kv_lens[0] == 0, cu_kv_lens[B] == Tk
  int max_q_len = 0;       // upper bound on q_len_b (GPU launch shape); 0 = derive (CPU only)
  int max_kv_len = 0;      // upper bound on kv_len_b; 0 = derive (CPU only)
  bool causal = true;
  float softmax_scale = 0; // required, > 0
  float q_scale = 1.0f;    // fp8 inputs only
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  TensorView out;          // [Tq, H, 128] bf16/fp16/fp32; overlaps no input, nor lse
  TensorView lse;          // [Tq, H] fp32, optional
  // GPU only, a debug mode: before launching, copy cu_q_lens and cu_kv_lens to the host and check
  // them as the CPU path always does (ends 0 and Tq / Tk, non-decreasing, each length within
  // max_q_len / max_kv_len), throwing mla::Error that names the first bad value. It synchronises
  // the stream, so it is refused while the stream is being captured into a CUDA graph.
  bool check_metadata = false;
};
void mha_prefill(const MhaPrefillArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// 6. merge_states: combines two partial attentions over disjoint key sets by their LSE:
//      lse = ln(exp(lse_a) + exp(lse_b)),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
//    A side with lse -inf contributes nothing; both -inf gives out 0, lse -inf (never NaN).
//    out may be out_a or out_b itself (the same view: an in-place merge), lse_out lse_a or lse_b;
//    any other overlap of an output with an input or the other output is an mla::Error
//    (check::same_or_disjoint).
struct MergeStatesArgs {
  TensorView out_a;    // [T, H, Dv] bf16/fp16/fp32, inner stride 1
  TensorView lse_a;    // [T, H] fp32
  TensorView out_b;    // [T, H, Dv]
  TensorView lse_b;    // [T, H] fp32
  TensorView out;      // [T, H, Dv] bf16/fp16/fp32
  TensorView lse_out;  // [T, H] fp32, optional
};
void merge_states(const MergeStatesArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// 7. cumulative_lengths: cu[0] = 0, cu[b + 1] = cu[b] + lens[b], as int32: the prefix sums of a
//    plan (cu_q_lens from the queries per request), computed where the tensors are. On a GPU it
//    is one small kernel with no host copy and no allocation, so a CUDA-graph engine can update
//    its fixed buffers with it before each replay. lens [B] int32/int64 (any stride); cu [B + 1]
//    int32, contiguous, not overlapping lens. The CPU path throws on a negative length or a total
//    past 2^31 - 1; the GPU path does not see the values (no host copy) and sums them as given.
void cumulative_lengths(const TensorView& lens, const TensorView& cu, Stream stream = nullptr);

}  // namespace mla
