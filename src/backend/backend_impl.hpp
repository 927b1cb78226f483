// Internals of mla::Backend shared by backend.cpp and multi_step.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/memory.hpp"
#include "mla/backend.hpp"
#include "mla/error.hpp"
#include "mla/schedule.hpp"

namespace mla::detail {

// Sections of one int32 plan buffer; each section starts on a 64-element (256-byte) boundary.
class Int32Layout {
 public:
  int64_t add(int64_t count) {
    const int64_t at = size_;
    size_ += (count + 63) / 64 * 64;
    return at;
  }
  int64_t size() const { return size_; }

 private:
  int64_t size_ = 0;
};

// Grows `buffer` (never shrinks) to hold `count` int32 values; returns its base.
int32_t* reserve_int32(Buffer& buffer, int64_t count, Device device, Stream stream);

// Views.
TensorView int32_view(int32_t* data, std::initializer_list<int64_t> shape, Device device);
TensorView first_rows(const TensorView& t, int64_t rows);           // [rows, ...] of t
TensorView row_range(const TensorView& t, int64_t begin, int64_t rows);

// An index-like vector argument: 1-D, int32/int64, at least `min_len` entries, on `device`.
void check_index_vector(const char* op, const char* name, const TensorView& t, int64_t min_len,
                        Device device);
// A host span of exactly `len` entries.
void check_host_lengths(const char* op, const char* name, std::span<const int32_t> values,
                        int64_t len);

// A plan's lengths on the host, for the checks that name the engine's arguments: on the CPU the
// values the plan computed from `lens` (`computed`: lens + offset, or with prefix_sums the n + 1
// cumulative offsets; already checked by lengths_to_int32 / prefix_sum_int32); on CUDA (only for
// BackendConfig::check_metadata: it waits for the stream) the engine's `lens` copied back and put
// through the same CPU helper, so that a bad value is named as on the CPU.
std::vector<int32_t> lengths_on_host(const char* op, const char* name, const TensorView& lens,
                                     const TensorView& computed, int32_t offset, bool prefix_sums,
                                     Stream stream);

// Each request's queries (cu: the n + 1 offsets lengths_on_host gives) at most `bound`, else
// mla::Error naming name[b] and where the bound came from.
void check_query_counts(const char* op, const char* name, const std::vector<int32_t>& cu, int bound,
                        const char* bound_what, const char* bound_source);

// block_table [bs, width] = the pages (of page_size tokens) that hold seq_lens [bs] tokens of the
// requests req_pool_indices [bs], from req_to_token (build_block_table; check_metadata: its
// debug mode, BackendConfig::check_metadata).
void fill_block_table(const TensorView& req_to_token, const TensorView& req_pool_indices,
                      const TensorView& seq_lens, int page_size, const TensorView& block_table,
                      bool check_metadata, Stream stream);

// Carves 256-byte aligned tensors out of a workspace, front to back (reset per call).
class ScratchArena {
 public:
  ScratchArena(const Workspace& workspace, const char* op) : workspace_(workspace), op_(op) {}
  TensorView take(const char* what, DType dtype, std::initializer_list<int64_t> shape);
  static size_t aligned_bytes(DType dtype, std::initializer_list<int64_t> shape);
  // Sizes past kMaxBytes cannot be a workspace: aligned_bytes and total_bytes saturate there
  // instead of wrapping around.
  static constexpr size_t kMaxBytes = size_t(1) << 62;
  static size_t total_bytes(std::initializer_list<size_t> sizes);

 private:
  const Workspace& workspace_;
  const char* op_;
  size_t used_ = 0;
};

}  // namespace mla::detail

namespace mla {

// A GPU split-KV schedule (mla/schedule.hpp) and the device memory it lives in. Unused on the CPU.
struct ScheduleSlot {
  detail::Buffer buffer;
  DecodeSchedule schedule;
  bool ready = false;
};

struct Backend::Impl {
  BackendConfig config;
  std::shared_ptr<Workspace> workspace;
  int64_t max_context_len = 0;
  // Draft step i of a MultiStepDraftBackend attends over seq_lens + i tokens.
  int seq_len_offset = 0;
  // Set by a MultiStepDraftBackend: re-plans all its steps (the DP-padding backstop).
  std::function<void(const ForwardBatch&, Stream)> replan_all_steps;

  Plan plan;
  bool planned = false;
  detail::Buffer plan_buffer;         // eager plan metadata, grows as needed
  std::vector<int32_t> host_staging;  // what is uploaded into plan_buffer

  // CUDA-graph state (init_cuda_graph_state).
  int graph_max_bs = 0;
  int64_t graph_max_num_tokens = 0;
  int graph_max_blocks = 0;
  // kv_lens [max_bs] | block_table [max_bs, graph_max_blocks], and with num_draft_tokens:
  // cu_q_lens [max_bs + 1] | equal_cu_q_lens [max_bs + 1] (b * num_draft_tokens)
  detail::Buffer graph_buffer;
  int32_t* graph_kv_lens = nullptr;
  int32_t* graph_block_table = nullptr;
  int32_t* graph_cu_q_lens = nullptr;        // DRAFT_EXTEND graphs' query offsets
  int32_t* graph_equal_cu_q_lens = nullptr;  // the offsets of num_draft_tokens queries a request
  // Split-KV schedules (CUDA): one for eager plans of the decode family, one for the graph
  // buffers, so that an eager re-plan never moves memory a captured graph reads, and one for
  // EXTEND's absorbed path, so that the decode family's is not grown to the largest batch times
  // the longest extend.
  ScheduleSlot eager_schedule;
  ScheduleSlot graph_schedule;
  ScheduleSlot extend_schedule;

  void validate_config();
  void plan_batch(const ForwardBatch& batch, Stream stream);
  void plan_decode_family(const ForwardBatch& batch, Stream stream);
  void plan_extend(const ForwardBatch& batch, Stream stream);
  void plan_fixed(const char* op, int bs, int64_t num_tokens, const TensorView& req_pool_indices,
                  const TensorView& seq_lens, ForwardMode mode, const TensorView& extend_seq_lens,
                  Stream stream);
  // The plan for a forward call: checks mode and batch size, re-plans when the batch grew.
  const Plan& plan_for(const char* op, const ForwardBatch& batch, Stream stream);
  // The start of a forward call: nullptr for an IDLE batch (nothing to run); otherwise checks
  // that batch.mode is one the call runs (the decode family, or EXTEND; mode_hint is appended to
  // the message) and the layer, and returns plan_for(batch).
  const Plan* begin_forward(const char* op, const ForwardBatch& batch, bool decode_family,
                            const char* mode_hint, const LayerParams& layer, Stream stream);
  // The layer of an attention call (cache and every scale), of a cache-only call (the cache and
  // k_scale: save_latent_kv, gather_prefix_chunk).
  void check_layer(const char* op, const LayerParams& layer) const;
  void check_cache(const char* op, const LayerParams& layer) const;
  // Queries per request of the fixed-length decode-family modes.
  int fixed_q_len(const char* op, ForwardMode mode, int batch_num_draft_tokens) const;
  void run_absorbed(const char* op, const ForwardBatch& batch, const LayerParams& layer,
                    const AbsorbedAttentionArgs& args, const Plan& plan, Stream stream);
  void run_new_token_attention(const char* op, const LayerParams& layer,
                               const MhaAttentionArgs& args, const TensorView& out,
                               const TensorView& lse, Stream stream);
  void run_prefix_chunk_attention(const char* op, int chunk_idx, const LayerParams& layer,
                                  const MhaAttentionArgs& args, const TensorView& out,
                                  const TensorView& lse, Stream stream);
  // mha_prefill of args.q over args.k/args.v, whose keys per request are cu_kv_lens.
  void run_mha_prefill(const LayerParams& layer, const MhaAttentionArgs& args,
                       const TensorView& cu_kv_lens, int max_kv_len, bool causal,
                       const TensorView& out, const TensorView& lse, Stream stream);
  // Writes k_nope/k_pe of num_tokens tokens into layer.kv_cache at out_cache_loc.
  void append_kv(const LayerParams& layer, const TensorView& k_nope, const TensorView& k_pe,
                 const TensorView& out_cache_loc, int64_t num_tokens, Stream stream);
  void check_mha(const char* op, const MhaAttentionArgs& args, int64_t num_q, int64_t num_kv,
                 bool lse_required) const;
  // An attention operand [rows, num_q_heads, width] of `dtype` on the configured device.
  void check_heads_operand(const char* op, const char* name, const TensorView& t, int64_t rows,
                           const char* rows_what, int64_t width, const char* width_what,
                           DType dtype) const;
  // args.lse [rows, num_q_heads], fp32 on the configured device.
  void check_lse(const char* op, const TensorView& lse, int64_t rows, const char* rows_what) const;
  void check_chunk_index(const char* op, int chunk_idx) const;
  // Whether mla_decode gets a split-KV schedule: on CUDA, unless the config is deterministic
  // without deterministic_split_keys (which runs unsplit).
  bool uses_schedule() const;
  // CUDA: (re)allocates `slot` for at least max_batch requests of max_q_len queries: a balanced
  // schedule, or a deterministic one for a deterministic config. No-op where !uses_schedule().
  void reserve_schedule(ScheduleSlot& slot, int max_batch, int max_q_len, Stream stream);
  // CUDA: plans the split-KV work of `p` (kv_lens, cu_q_lens) on the device and points
  // p.schedule at it; grows the slot only when may_grow. No-op where !uses_schedule().
  void attach_schedule(const char* op, Plan& p, ScheduleSlot& slot, bool may_grow, Stream stream);
};

}  // namespace mla
