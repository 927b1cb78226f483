// The stateful MLA attention backend (DESIGN §4): what a serving engine calls once per batch
// (planning) and once per layer (attention).
//
// Life cycle, per batch:
//   backend.init_forward_metadata(batch)           // eager: plan for the batch's mode
//   for each layer: backend.forward_decode(batch, layer, args)       // decode family
//                   backend.forward_extend_chunked(...) / forward_extend_absorbed(...)  // EXTEND
// With CUDA graphs (decode family):
//   backend.init_cuda_graph_state(max_bs, max_num_tokens)            // once: fixed buffers
//   backend.init_forward_metadata_capture_cuda_graph(bs, ...)        // before capturing bs
//   backend.init_forward_metadata_replay_cuda_graph(bs, ...)         // before each replay
//
// Conventions:
//   * Every tensor the engine passes lives on BackendConfig::device (checked).
//   * seq_lens counts the cached tokens of a request *including* the ones computed in this pass,
//     in every mode (for TARGET_VERIFY it includes the draft tokens).
//   * Planning the decode family never copies from the device to the host: lengths stay on the
//     device (host copies only narrow the block-table width when given). EXTEND plans from the
//     host lengths the engine has (extend_seq_lens_cpu, extend_prefix_lens_cpu).
//   * All buffers the Backend owns are on its device; it runs only the public ops (mla/ops.hpp)
//     and its memory layer, so the same code runs on CPU and CUDA tensors.
//   * Every entry validates its arguments and throws mla::Error naming the argument.
//   * IDLE batches (and batches of 0 requests): planning and every forward do nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "mla/dtype.hpp"
#include "mla/ops.hpp"
#include "mla/plan.hpp"
#include "mla/tensor.hpp"

namespace mla {

namespace detail {
class Buffer;
}

// A zero-initialised scratch buffer on a device, reused across calls. Backends that run one
// after another on one stream may share one (draft steps do); backends whose work may overlap
// (different streams) must each have their own.
class Workspace {
 public:
  static constexpr size_t kDefaultBytes = size_t(64) << 20;
  Workspace(size_t size_bytes, Device device, Stream stream = nullptr);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  void* data() const;
  size_t size_bytes() const;
  Device device() const;

 private:
  std::unique_ptr<detail::Buffer> buffer_;
};

struct BackendConfig {
  int num_q_heads = 0;                  // H, 1..128
  int page_size = 64;                   // S, a power of two in 1..128
  DType kv_cache_dtype = DType::kBF16;  // bf16 / fp16 / fp8e4m3
  // Dtype of every query, key and value the backend hands to the kernels (absorbed q, MHA
  // q/k/v): bf16/fp16 equal to a bf16/fp16 cache; bf16/fp16/fp8e4m3 with an fp8 cache.
  DType q_dtype = DType::kBF16;
  DType out_dtype = DType::kBF16;       // attention outputs: bf16 / fp16 / fp32
  TensorView req_to_token;              // [R, >= max_context_len] int32 token slots, on `device`
  int64_t max_context_len = 0;          // longest sequence; 0 = req_to_token.shape[1]
  Device device = Device::cpu();
  // Chunked prefix (EXTEND): prefix tokens gathered and up-projected per chunk, all requests
  // together (see mla/plan.hpp, PrefixChunk).
  int64_t prefix_chunk_capacity = 8192;
  int num_draft_tokens = 0;             // TARGET_VERIFY queries per request (speculative decoding)
  ExtendPrefixPath extend_prefix_path = ExtendPrefixPath::kAuto;
  int64_t absorbed_max_extend_len = 128;  // threshold of the kAuto rule (mla/plan.hpp)
  size_t workspace_bytes = Workspace::kDefaultBytes;  // when the Backend creates its workspace
  // GPU debug mode: the decode family's kernels get MlaDecodeArgs::check_metadata (and EXTEND's
  // mha_prefill calls MhaPrefillArgs::check_metadata, the saves of new latents
  // AppendLatentKvArgs::check_metadata, the rope RopeQuantizeArgs::check_metadata, the block
  // tables of every plan BuildBlockTableArgs::check_metadata), so that bad lengths, request
  // indices, token slots, block tables, page ids, cache slots and positions (also those the
  // engine's device tensors carried in) are reported as mla::Error before each launch. It
  // synchronises the stream: not for CUDA graphs.
  bool check_metadata = false;
  // Deterministic mode (DESIGN §5): a request's attention output (and LSE) is bit-identical
  // whatever the other requests of its batch, its place in it and the batch size, and on every
  // run (same config, device and inputs). The decode family and EXTEND's absorbed path run
  // mla_decode with MlaDecodeArgs::deterministic (unsplit, no split-KV schedule planned or
  // allocated; the decode family split by deterministic_split_keys below); EXTEND's chunked path uses deterministic prefix chunks (mla/plan.hpp), and the
  // kAuto choice between the two paths, which depends on the whole batch, becomes kChunked.
  // Slower where splitting pays (a few long requests); about as fast at large batches. The
  // chunked path's up_project callback must then give each row the same bits whatever the
  // number of rows of the call (a chunk's row count depends on the other requests).
  bool deterministic = false;
  // With `deterministic` on the GPU: 0 runs every request of the decode family unsplit (one CTA
  // a row tile); > 0 (a multiple of 64) plans a deterministic split-KV schedule that cuts every
  // request's keys every deterministic_split_keys keys (mla/schedule.hpp), so that a few long
  // requests still use every SM. Its workspace holds a partial result for each piece of the
  // largest batch at max_context_len (128 KiB a piece of a 64-row tile): a larger value takes
  // less memory. EXTEND's absorbed path stays unsplit (its row tiles fill the SMs).
  int deterministic_split_keys = 0;
};

// save_latent_kv and gather_prefix_chunk read only kv_cache and k_scale.
struct LayerParams {
  TensorView kv_cache;        // [P, S, 576] this layer's latent cache, kv_cache_dtype, contiguous
  float k_scale = 1.0f;       // fp8 cache: dequantised = stored * k_scale (ignored otherwise)
  float q_scale = 1.0f;       // fp8 queries: dequantised = stored * q_scale
  float softmax_scale = 0.0f; // required: 1/sqrt(192) times any model factor
  int layer_id = 0;           // for error messages
};

// One batch, as the engine describes it. Device tensors are on BackendConfig::device; host spans
// are optional copies the engine already has.
struct ForwardBatch {
  ForwardMode mode = ForwardMode::kDecode;
  int batch_size = 0;                 // B
  TensorView req_pool_indices;        // [>= B] int32/int64 rows of req_to_token (first B used)
  TensorView seq_lens;                // [>= B] int32/int64 cached tokens incl. those computed now
                                      // (decode family: required; EXTEND: optional, host lengths rule)
  TensorView out_cache_loc;           // [T] int32/int64 slots of the new tokens (to save latents)
  TensorView positions;               // [T] int32/int64 rope positions (when the backend ropes)
  TensorView extend_seq_lens;         // [>= B] int32/int64 DRAFT_EXTEND: queries per request
                                      // (alone, without extend_seq_lens_cpu: T comes from the
                                      // queries, and query rows past the lengths' total, a
                                      // padded batch's, give out 0 and lse -inf)
  std::span<const int32_t> seq_lens_cpu;            // [B] optional host copy of seq_lens
  std::span<const int32_t> extend_seq_lens_cpu;     // [B] EXTEND: required; DRAFT_EXTEND: optional
  std::span<const int32_t> extend_prefix_lens_cpu;  // [B] EXTEND: required
  int num_draft_tokens = 0;           // TARGET_VERIFY queries per request; 0 = the config's
};

// Absorbed attention (decode family, EXTEND absorbed path). T query rows, H heads.
struct AbsorbedAttentionArgs {
  TensorView q;              // [T, H, 576] q_dtype, or empty when q_nope and q_pe are given
  TensorView q_nope;         // [T, H, 512] absorbed q_nope (q_nope · W_UK)
  TensorView q_pe;           // [T, H, 64]
  bool save_kv_cache = true; // write k_nope | k_pe at batch.out_cache_loc first
  TensorView k_nope;         // [T, 512] the new tokens' c_kv (bf16/fp16/fp32)
  TensorView k_pe;           // [T, 64]  the new tokens' k_pe, same dtype
  // Optional rope: when given, q_pe and k_pe are *before* the rotary embedding and the backend
  // applies it (rope_quantize, positions = batch.positions), converting the query to q_dtype
  // (fp8 with layer.q_scale). Inputs must then be bf16/fp16 (q and k alike).
  TensorView cos_sin_cache;  // [max_position, 64] fp32
  RopeStyle rope_style = RopeStyle::kNeox;
  TensorView out;            // [T, H, 512] out_dtype
  TensorView lse;            // [T, H] fp32, optional (natural-log LSE of the scaled scores)
};

// Non-absorbed (MHA) attention: 192-wide q/k, 128-wide v per head. Each tensor has a contiguous
// last dim; out and lse have no two elements at one address; on the GPU q, k, v and out have
// 16-byte aligned rows (mha_prefill's copies), with or without a prefix.
struct MhaAttentionArgs {
  TensorView q;    // [Tq, H, 192] q_dtype
  TensorView k;    // [Tk, H, 192] q_dtype
  TensorView v;    // [Tk, H, 128] q_dtype
  TensorView out;  // [Tq, H, 128] out_dtype
  TensorView lse;  // [Tq, H] fp32 (optional where noted)
  float q_scale = 1.0f;  // fp8 q_dtype only: dequantised = stored * scale
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// Up-projects the latent entries of a prefix chunk (forward_extend_chunked):
//   latent [N, 576] in the cache dtype, as stored (times layer.k_scale for an fp8 cache);
//   k [N, H, 192] (k_nope from W_UK | k_pe) and v [N, H, 128] (from W_UV) in q_dtype, to fill;
//   for an fp8 q_dtype stored as value / k_scale and value / v_scale of the new tokens'
//   MhaAttentionArgs (the scales the chunk's attention applies, so that its LSE and the new
//   tokens' merge on one scale).
//   stream: the backend's stream. The latents are gathered on it and k and v are read on it
//   after the call, into buffers the next chunk reuses: enqueue the projection on `stream`
//   (or synchronise it before reading the latents and before returning).
using UpProjectFn = std::function<void(int chunk_idx, const TensorView& latent,
                                       const TensorView& k, const TensorView& v, Stream stream)>;

class MultiStepDraftBackend;

class Backend {
 public:
  // Validates the config. Without a workspace the backend allocates its own
  // (config.workspace_bytes).
  explicit Backend(const BackendConfig& config, std::shared_ptr<Workspace> workspace = nullptr);
  ~Backend();
  Backend(Backend&&) noexcept;
  Backend& operator=(Backend&&) noexcept;

  const BackendConfig& config() const;
  const std::shared_ptr<Workspace>& workspace() const;
  // The current plan (after init_forward_metadata or a capture/replay call).
  const Plan& plan() const;
  bool has_plan() const;

  // Plans `batch` (eager). Decode family: kv_lens and block tables built on the device from
  // seq_lens / req_pool_indices / req_to_token (width from seq_lens_cpu when given, else the full
  // context); DRAFT_EXTEND q offsets from extend_seq_lens (device) or extend_seq_lens_cpu.
  // EXTEND: from the host lengths; decides absorbed vs chunked; builds both paths' metadata.
  void init_forward_metadata(const ForwardBatch& batch, Stream stream = nullptr);

  // CUDA graphs (decode family). Preallocates kv_lens [max_bs] and a block table
  // [max_bs, padded_block_count(max_context_len)]; capture and replay fill their first bs rows in
  // place, on the device (no allocation, no host copy), and make them the current plan. Each
  // request then has q_len = 1 (DECODE) or num_draft_tokens (TARGET_VERIFY) query rows. A
  // DRAFT_EXTEND graph runs bs x num_draft_tokens query rows: with extend_seq_lens ([>= bs] int32
  // / int64 on the device, each at most num_draft_tokens: a replay's accepted tokens) request b
  // has extend_seq_lens[b] rows packed after the ones before it, and the rows past their total
  // come out 0 with lse -inf; without it every request has num_draft_tokens rows. A graph
  // captured either way replays either way.
  // req_pool_indices and seq_lens may be longer than bs (the engine's static buffers). A backend
  // that ropes inside forward_decode needs absorbed_workspace_bytes(config, max_num_tokens) of
  // workspace; a smaller one fails at the first forward_decode that needs more, with mla::Error.
  void init_cuda_graph_state(int max_bs, int64_t max_num_tokens);
  void init_forward_metadata_capture_cuda_graph(int bs, int64_t num_tokens,
                                                const TensorView& req_pool_indices,
                                                const TensorView& seq_lens, ForwardMode mode,
                                                Stream stream = nullptr,
                                                const TensorView& extend_seq_lens = {});
  void init_forward_metadata_replay_cuda_graph(int bs, const TensorView& req_pool_indices,
                                               const TensorView& seq_lens, ForwardMode mode,
                                               Stream stream = nullptr,
                                               const TensorView& extend_seq_lens = {});

  // Writes the new tokens' latents k_nope [T, 512] | k_pe [T, 64] at batch.out_cache_loc.
  void save_latent_kv(const ForwardBatch& batch, const LayerParams& layer, const TensorView& k_nope,
                      const TensorView& k_pe, Stream stream = nullptr);

  // DECODE / TARGET_VERIFY / DRAFT_EXTEND: optionally saves the new latents, optionally ropes,
  // then absorbed attention over the paged cache. A batch larger than the planned one (data-
  // parallel padding grows batch_size and the device tensors) is re-planned first; host lists
  // shorter than the new batch_size are not used for it. A CUDA-graph plan is not re-planned
  // (an error): capture and replay with the padded size.
  void forward_decode(const ForwardBatch& batch, const LayerParams& layer,
                      const AbsorbedAttentionArgs& args, Stream stream = nullptr);

  // EXTEND, absorbed path: 576-wide queries over the paged cache, q lengths = extend lengths.
  void forward_extend_absorbed(const ForwardBatch& batch, const LayerParams& layer,
                               const AbsorbedAttentionArgs& args, Stream stream = nullptr);

  // EXTEND, chunked path, step by step:
  //  (a) causal attention of the new tokens over themselves (q, k, v: [Tq, ...]; lse optional);
  void forward_extend(const ForwardBatch& batch, const LayerParams& layer,
                      const MhaAttentionArgs& args, Stream stream = nullptr);
  //  (b) the latent entries of prefix chunk `chunk_idx`: latent_out [N, 576] in the cache dtype,
  //      not inside the cache;
  int num_prefix_chunks() const;
  void gather_prefix_chunk(int chunk_idx, const LayerParams& layer, const TensorView& latent_out,
                           Stream stream = nullptr);
  //  (c) non-causal attention of all new tokens to their part of the chunk (k, v: [N, ...]);
  //      lse required; rows without keys give out 0, lse -inf;
  void forward_prefix_chunk(const ForwardBatch& batch, int chunk_idx, const LayerParams& layer,
                            const MhaAttentionArgs& args, Stream stream = nullptr);
  //  (d) merge with mla::merge_states. Or all of it in one call: new tokens, then for each chunk
  //      gather -> up_project -> attend -> merge (fp32 accumulation in the workspace).
  void forward_extend_chunked(const ForwardBatch& batch, const LayerParams& layer,
                              const MhaAttentionArgs& new_tokens, const UpProjectFn& up_project,
                              Stream stream = nullptr);
  // Workspace bytes forward_extend_chunked needs for Tq new tokens.
  static size_t chunked_extend_workspace_bytes(const BackendConfig& config, int64_t num_tokens);
  // Workspace bytes forward_decode / forward_extend_absorbed need for T tokens when the backend
  // ropes (args.cos_sin_cache): the roped query [T, H, 576] and, with save_kv_cache, the roped key.
  // Without rope they need none. For CUDA graphs, T = init_cuda_graph_state's max_num_tokens.
  static size_t absorbed_workspace_bytes(const BackendConfig& config, int64_t num_tokens);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  friend class MultiStepDraftBackend;
};

// EAGLE-style multi-step drafting: num_steps - 1 decode backends, step i attending over
// seq_lens + i tokens. They share one workspace and one block table (built for the longest step;
// a shorter step reads only its first pages); each step has its own kv_lens.
class MultiStepDraftBackend {
 public:
  MultiStepDraftBackend(int num_steps, const BackendConfig& config,
                        std::shared_ptr<Workspace> workspace = nullptr);
  ~MultiStepDraftBackend();
  MultiStepDraftBackend(MultiStepDraftBackend&&) noexcept;
  MultiStepDraftBackend& operator=(MultiStepDraftBackend&&) noexcept;

  int num_steps() const;
  int num_step_backends() const;  // num_steps - 1
  Backend& step(int i);

  // Plans every step for a DECODE (or IDLE) batch; step i sees seq_lens + i.
  void init_forward_metadata(const ForwardBatch& batch, Stream stream = nullptr);
  void init_cuda_graph_state(int max_bs, int64_t max_num_tokens);
  void init_forward_metadata_capture_cuda_graph(int bs, int64_t num_tokens,
                                                const TensorView& req_pool_indices,
                                                const TensorView& seq_lens,
                                                Stream stream = nullptr);
  void init_forward_metadata_replay_cuda_graph(int bs, const TensorView& req_pool_indices,
                                               const TensorView& seq_lens,
                                               Stream stream = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mla
